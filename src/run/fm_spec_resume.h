/* The run spec in each checkpoint's state.json and its restore by --resume (DESIGN.md §7: "The
 * run spec is saved whole in each checkpoint's state.json"). Saved: every flag of train given
 * (or restored) whose row is not FM_SPEC_INVOCATION, as "spec": {"data": ["a.txt"],
 * "eval-every": 2, ...}; the flags left out were at their defaults. */
#ifndef FM_SPEC_RESUME_H
#define FM_SPEC_RESUME_H

#include "fm_run_spec.h"

/* The spec's saved flags as one JSON object (text; free with free()), or NULL when out of memory. */
char *fm_spec_to_json(const fm_run_spec *s);

/* Restores the flags of spec_json (a "spec" object read from `path`) into s: each flag not given
 * on this command line takes the run's value (marked given and restored); one given again keeps
 * its value, and when that differs from the run's a FM_SPEC_RUN flag says so in one line
 * ("--eval-every 5 overrides the run's 2", through fm_log when `say`); the fixed flags keep
 * fm_train's own refusal or warning. Errors: FM_ERR_FORMAT naming the file, the field, the value
 * found and the fix (a value the flag does not take, a field that is no flag of train). */
fm_status fm_spec_restore_json(fm_run_spec *s, const char *spec_json, const char *path, bool say);

/* --resume: the latest checkpoint of s->train.out_dir's state.json "spec", restored into s by
 * fm_spec_restore_json; *restored (may be NULL) says whether one was. Without --resume, without a
 * checkpoint, or with an older state.json that has no "spec": nothing (the flags given, as
 * before). Errors: fm_spec_restore_json's. */
fm_status fm_spec_resume(fm_run_spec *s, bool say, bool *restored);

#endif
