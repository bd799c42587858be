/* The run spec in a checkpoint's state.json ("spec": the flags given, by name) and its restore
 * by `train --out DIR --resume` (fm_spec_resume.h). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "../core/fm_log.h"
#include "../io/fm_checkpoint.h"
#include "fm_spec_resume.h"

/* Whether row f travels in state.json. */
static bool saved(const fm_spec_flag *f) { return (f->cmds & FM_CMD_TRAIN) && f->life != FM_SPEC_INVOCATION; }

char *fm_spec_to_json(const fm_run_spec *s) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    for (int i = 0; i < fm_spec_n_flags; i++) {
        const fm_spec_flag *f = &fm_spec_flags[i];
        if (!saved(f) || !(f->cmds & s->cmd) || !fm_spec_row_given(s, i)) continue;
        const char *base = (const char *)s + f->offset;
        char text[64];
        switch (f->kind) {
        case FM_SPEC_FILES: {
            cJSON *a = cJSON_AddArrayToObject(o, f->name);
            const int n = *(const int *)((const char *)s + f->count_offset);
            for (int k = 0; k < n; k++) cJSON_AddItemToArray(a, cJSON_CreateString(((const char *const *)base)[k]));
            break;
        }
        case FM_SPEC_BOOL: cJSON_AddBoolToObject(o, f->name, *(const bool *)base); break;
        case FM_SPEC_I64: cJSON_AddNumberToObject(o, f->name, (double)*(const int64_t *)base); break;
        case FM_SPEC_INT: cJSON_AddNumberToObject(o, f->name, *(const int *)base); break;
        case FM_SPEC_F64: cJSON_AddNumberToObject(o, f->name, *(const double *)base); break;
        default: /* text: strings, choices, and the 64-bit unsigned values a double cannot hold exactly */
            fm_spec_format(s, f, text, sizeof text);
            cJSON_AddStringToObject(o, f->name, f->kind == FM_SPEC_STR ? *(const char *const *)base : text);
            break;
        }
    }
    char *txt = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return txt; /* free with free() (cJSON's default allocator) */
}

/* The text form of a JSON value of row f (numbers as the command line writes them). */
static bool json_text(const fm_spec_flag *f, const cJSON *v, char *out, size_t cap) {
    if (cJSON_IsString(v)) snprintf(out, cap, "%s", v->valuestring);
    else if (cJSON_IsBool(v)) snprintf(out, cap, "%s", cJSON_IsTrue(v) ? "true" : "false");
    else if (cJSON_IsNumber(v) && (f->kind == FM_SPEC_F64)) snprintf(out, cap, "%.17g", v->valuedouble);
    else if (cJSON_IsNumber(v) && fabs(v->valuedouble) < 9.2e18 && v->valuedouble == (double)(int64_t)v->valuedouble)
        snprintf(out, cap, "%" PRId64, (int64_t)v->valuedouble);
    else if (cJSON_IsNumber(v)) snprintf(out, cap, "%.17g", v->valuedouble);
    else return false;
    return true;
}

/* The line saying that row f given now (text `now`) replaces the run's value `was`. */
static void log_override(const fm_spec_flag *f, const char *now, const char *was) {
    if (f->kind == FM_SPEC_BOOL) fm_log(FM_LOG_INFO, "--%s overrides the run's %s\n", f->name, was);
    else fm_log(FM_LOG_INFO, "--%s %s overrides the run's %s\n", f->name, now, was);
}

/* What a flag that fixes the run (FM_SPEC_FIXED) means when given again with another value on
 * --resume, for the fixed flags fm_train does not already warn about (the shape, --threads,
 * --bf16-moments and --expert-precision have their own warning there). */
static const char *const fixed_consequence[][2] = {
    {"val-fraction", "the held-out share changes, so training and validation are drawn from another split of --data "
                     "from here on and the validation loss is not comparable with the run's"},
    {"max-position-embeddings", "the config's limit changes; the checkpoint's weights are kept"},
};

/* Fixed row f given again on this command line (text now of its value) where the run had `was`
 * (its saved value, or its default): a note for the flags of fixed_consequence; --seed given
 * again is not used (the checkpoint holds the weights and the data order it seeded): returns true
 * so that the caller puts the run's value back, and a note says so. */
static bool fixed_given_again(const fm_spec_flag *f, const char *now_text, const char *was_text, bool say) {
    char now[600], was[600];
    snprintf(now, sizeof now, "%s", now_text);
    snprintf(was, sizeof was, "%s", was_text);
    if (!strcmp(was, now) || (f->kind == FM_SPEC_F64 && strtod(was, NULL) == strtod(now, NULL))) return false;
    if (!strcmp(f->name, "seed")) {
        if (say)
            fm_log(FM_LOG_NOTE, "note: --seed %s is not used on --resume: the run continues its checkpoint's weights and "
                   "data order, seeded by --seed %s; another seed is another run (a new --out)\n", now, was);
        return true;
    }
    if (f->kind == FM_SPEC_F64) { /* as a person writes them */
        snprintf(was, sizeof was, "%g", strtod(was, NULL));
        snprintf(now, sizeof now, "%g", strtod(now, NULL));
    }
    for (size_t i = 0; say && i < sizeof fixed_consequence / sizeof fixed_consequence[0]; i++)
        if (!strcmp(f->name, fixed_consequence[i][0]))
            fm_log(FM_LOG_NOTE, "note: --%s %s replaces the run's %s: %s\n", f->name, now, was, fixed_consequence[i][1]);
    return false;
}

/* Row f given again on this command line, with the run's saved value v: one line saying which
 * wins (fixed rows: fixed_given_again, whose result lands in *keep_saved). */
static void say_override(const fm_run_spec *s, const fm_spec_flag *f, const cJSON *v, bool say, bool *keep_saved) {
    *keep_saved = false;
    if (f->life == FM_SPEC_FIXED) {
        char now[600], was[600];
        if (f->kind == FM_SPEC_FILES || !json_text(f, v, was, sizeof was)) return;
        fm_spec_format(s, f, now, sizeof now);
        *keep_saved = fixed_given_again(f, now, was, say);
        return;
    }
    if (!say || f->life != FM_SPEC_RUN) return;
    char now[600], was[600] = "";
    if (f->kind == FM_SPEC_FILES) {
        const int n = *(const int *)((const char *)s + f->count_offset);
        const char *const *list = (const char *const *)((const char *)s + f->offset);
        bool same = cJSON_IsArray(v) && cJSON_GetArraySize(v) == n;
        for (int k = 0; same && k < n; k++) {
            const cJSON *e = cJSON_GetArrayItem(v, k);
            same = cJSON_IsString(e) && !strcmp(e->valuestring, list[k]);
        }
        if (same) return;
        size_t at = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, v) {
            if (cJSON_IsString(e) && at < sizeof was)
                at += (size_t)snprintf(was + at, sizeof was - at, "%s%s", at ? " " : "", e->valuestring);
        }
        at = 0;
        for (int k = 0; k < n && at < sizeof now; k++)
            at += (size_t)snprintf(now + at, sizeof now - at, "%s%s", k ? " " : "", list[k]);
    } else {
        if (!json_text(f, v, was, sizeof was)) return;
        fm_spec_format(s, f, now, sizeof now);
        if (f->kind == FM_SPEC_F64 && strtod(was, NULL) == strtod(now, NULL)) return;
        if (!strcmp(was, now)) return;
        if (f->kind == FM_SPEC_F64) { /* as a person writes them */
            snprintf(was, sizeof was, "%g", strtod(was, NULL));
            snprintf(now, sizeof now, "%g", strtod(now, NULL));
        }
    }
    log_override(f, now, was);
}

/* Restores row f from the saved value v (f not given on the command line). */
static fm_status restore_row(fm_run_spec *s, const fm_spec_flag *f, const cJSON *v, const char *path) {
    const int row = fm_spec_row(f);
    char text[4200];
    if (f->kind == FM_SPEC_FILES) {
        if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) < 1)
            return fm_error(FM_ERR_FORMAT, "%s: \"spec\" field \"%s\": expected a list of file names, found another "
                            "value; fix the field, or give --%s on the command line", path, f->name, f->name);
        *(int *)((char *)s + f->count_offset) = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, v) {
            if (!cJSON_IsString(e))
                return fm_error(FM_ERR_FORMAT, "%s: \"spec\" field \"%s\": expected file names (strings); fix the "
                                "field, or give --%s on the command line", path, f->name, f->name);
            FM_TRY(fm_spec_set_row(s, f, e->valuestring, true));
        }
    } else {
        if (!json_text(f, v, text, sizeof text))
            return fm_error(FM_ERR_FORMAT, "%s: \"spec\" field \"%s\": expected a value of --%s, found a %s; fix the "
                            "field, or give --%s on the command line", path, f->name, f->name,
                            cJSON_IsArray(v) ? "list" : cJSON_IsObject(v) ? "JSON object" : "null", f->name);
        if (fm_spec_set_row(s, f, text, true) != FM_OK) {
            char why[400];
            snprintf(why, sizeof why, "%s", fm_errmsg());
            return fm_error(FM_ERR_FORMAT, "%s: \"spec\" field \"%s\" has the value '%s', which --%s does not take (%s); "
                            "fix the value in the file, or give --%s on the command line", path, f->name, text, f->name,
                            why, f->name);
        }
    }
    s->restored[row / 64] |= 1ull << (row % 64);
    return FM_OK;
}

/* Flags fm_train itself takes from state.json's own fields on --resume when not given (the run's
 * total, shape, thread count and schedule, each with its "--resume: ..." line): not restored here. */
static const char *const kept_by_train[] = {"steps", "seq-len", "micro-batch", "grad-accum", "threads",
                                            "lr", "min-lr", "warmup", NULL};
/* Pairs of which one given on the command line replaces the other's saved value. */
static const char *const exclusive[][2] = {{"fp8-weight-cache", "no-fp8-weight-cache"},
                                           {"recompute-keep-attention", "no-recompute-keep-attention"}};

/* Whether the saved row f is left to fm_train, or replaced by its partner given now. */
static bool not_restored(const fm_run_spec *s, const fm_spec_flag *f) {
    for (int i = 0; kept_by_train[i]; i++)
        if (!strcmp(f->name, kept_by_train[i])) return true;
    for (size_t i = 0; i < sizeof exclusive / sizeof exclusive[0]; i++)
        for (int k = 0; k < 2; k++)
            if (!strcmp(f->name, exclusive[i][k]) && fm_spec_given(s, exclusive[i][1 - k])) return true;
    return false;
}

fm_status fm_spec_restore_json(fm_run_spec *s, const char *spec_json, const char *path, bool say) {
    cJSON *o = cJSON_Parse(spec_json);
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return fm_error(FM_ERR_FORMAT, "%s: \"spec\" is not a JSON object of flags; fix it, or remove the field to resume "
                        "from the flags given", path);
    }
    fm_status st = FM_OK;
    const cJSON *v;
    cJSON_ArrayForEach(v, o) {
        const fm_spec_flag *f = fm_spec_find(v->string, FM_CMD_TRAIN);
        if (!f || !saved(f)) {
            st = fm_error(FM_ERR_FORMAT, "%s: \"spec\" field \"%s\" is not a flag of train that a run keeps; remove the "
                          "field (this flatmoe does not know it)", path, v->string);
            break;
        }
        bool keep_saved = false;
        if (fm_spec_row_given(s, fm_spec_row(f))) say_override(s, f, v, say, &keep_saved);
        if ((!fm_spec_row_given(s, fm_spec_row(f)) || keep_saved) && !not_restored(s, f) &&
            (st = restore_row(s, f, v, path)))
            break;
    }
    /* a flag given now that the run left at its default: say that it overrides the default */
    for (int i = 0; st == FM_OK && i < fm_spec_n_flags; i++) {
        const fm_spec_flag *f = &fm_spec_flags[i];
        if (!saved(f) || f->life == FM_SPEC_INVOCATION || f->kind == FM_SPEC_FILES || !(f->cmds & s->cmd) ||
            !fm_spec_row_given(s, i) || cJSON_GetObjectItemCaseSensitive(o, f->name))
            continue;
        char now[600];
        fm_spec_format(s, f, now, sizeof now);
        if (f->life == FM_SPEC_FIXED) { /* the run had the default */
            if (f->dflt && !not_restored(s, f) && fixed_given_again(f, now, f->dflt, say)) {
                st = fm_spec_set_row(s, f, f->dflt, false);
                fm_spec_mark_given(s, i, false);
            }
            continue;
        }
        if (!say) continue;
        const char *dflt = f->dflt ? f->dflt : f->kind == FM_SPEC_BOOL ? "false" : "unset";
        if (!strcmp(now, dflt) || (f->kind == FM_SPEC_F64 && f->dflt && strtod(now, NULL) == strtod(dflt, NULL))) continue;
        char was[96];
        snprintf(was, sizeof was, "default %s", f->kind == FM_SPEC_BOOL ? "(off)" : dflt);
        log_override(f, now, was);
    }
    cJSON_Delete(o);
    return st;
}

fm_status fm_spec_resume(fm_run_spec *s, bool say, bool *restored) {
    if (restored) *restored = false;
    if (!s->train.resume || !s->train.out_dir) return FM_OK;
    char ckpt[4096], path[4200];
    if (fm_ckpt_find_latest(s->train.out_dir, ckpt, sizeof ckpt, NULL) != FM_OK) { /* nothing to resume */
        if (!fm_spec_given(s, "data"))
            return fm_error(FM_ERR_ARG, "--resume: no checkpoint in %s (no step_* folder) to continue, and no --data to "
                            "start a run there; give the run folder that holds the checkpoints as --out, or --config "
                            "(or --init-from) and --data to start one", s->train.out_dir);
        return FM_OK; /* fm_train starts the run at step 0, and says so */
    }
    snprintf(path, sizeof path, "%s/%s", ckpt, FM_CKPT_STATE_FILE);
    char *text = NULL;
    if (fm_ckpt_read_text(path, &text) != FM_OK) return FM_OK; /* fm_train says what is wrong with it */
    cJSON *state = cJSON_Parse(text);
    fm_free(text);
    const cJSON *spec = cJSON_GetObjectItemCaseSensitive(state, "spec");
    fm_status st = FM_OK;
    if (spec) { /* older checkpoints have none: the flags given, as before */
        char *js = cJSON_PrintUnformatted(spec);
        st = js ? fm_spec_restore_json(s, js, path, say) : fm_error(FM_ERR_NOMEM, "%s: out of memory", path);
        free(js);
        if (restored && st == FM_OK) *restored = true;
    }
    cJSON_Delete(state);
    return st;
}
