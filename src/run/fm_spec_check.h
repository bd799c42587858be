/* The cross-flag rules of a run spec (fm_run_spec.h). */
#ifndef FM_SPEC_CHECK_H
#define FM_SPEC_CHECK_H

#include "fm_run_spec.h"

/* Checks s for its command (s->cmd: train or plan) before any file is read: each value in its
 * range and the flags that do not go together (--zero 1 with --offload-optimizer, both
 * --fp8-weight-cache forms, --vocab-parallel ring with plain logits, ...), the same rules and
 * messages for train and plan. Rules that need the config, the world or the device come with the
 * plan request (train/fm_train_plan.h). Errors: FM_ERR_ARG naming the flags, the values found
 * and the fix. */
fm_status fm_spec_check(const fm_run_spec *s);

#endif
