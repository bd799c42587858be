/* The run spec (fm_run_spec.h): defaults from the flag table, setting an option by name from its
 * text, the given bits, and the trainer's options view. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../plan/fm_plan.h"
#include "fm_run_spec.h"

int fm_spec_row(const fm_spec_flag *f) { return (int)(f - fm_spec_flags); }

const fm_spec_flag *fm_spec_find(const char *name, unsigned cmd) {
    for (int i = 0; i < fm_spec_n_flags; i++)
        if ((fm_spec_flags[i].cmds & cmd) && !strcmp(fm_spec_flags[i].name, name)) return &fm_spec_flags[i];
    return NULL;
}

bool fm_spec_row_given(const fm_run_spec *s, int row) { return (s->given[row / 64] >> (row % 64)) & 1; }

void fm_spec_mark_given(fm_run_spec *s, int row, bool given) {
    if (given) s->given[row / 64] |= 1ull << (row % 64);
    else s->given[row / 64] &= ~(1ull << (row % 64));
}

bool fm_spec_given(const fm_run_spec *s, const char *name) {
    const fm_spec_flag *f = fm_spec_find(name, s->cmd);
    return f && fm_spec_row_given(s, fm_spec_row(f));
}

static char *own(fm_run_spec *s, const char *text) {
    if (s->n_owned == s->cap_owned) {
        const int cap = s->cap_owned ? 2 * s->cap_owned : 16;
        char **p = realloc(s->owned, sizeof *p * (size_t)cap);
        if (!p) return NULL;
        s->owned = p;
        s->cap_owned = cap;
    }
    const size_t n = strlen(text);
    char *c = malloc(n + 1);
    if (!c) return NULL;
    memcpy(c, text, n + 1);
    s->owned[s->n_owned++] = c;
    return c;
}

void fm_spec_free(fm_run_spec *s) {
    for (int i = 0; i < s->n_owned; i++) free(s->owned[i]);
    free(s->owned);
    s->owned = NULL;
    s->n_owned = s->cap_owned = 0;
}

/* The choices of f as "a, b or c". */
static void choice_list(const fm_spec_flag *f, char *out, size_t cap) {
    size_t at = 0;
    int n = 0;
    while (f->choices[n]) n++;
    out[0] = 0;
    for (int i = 0; i < n && at < cap; i++)
        at += (size_t)snprintf(out + at, cap - at, "%s%s", i == 0 ? "" : i == n - 1 ? " or " : ", ", f->choices[i]);
}

fm_status fm_spec_set_row(fm_run_spec *s, const fm_spec_flag *f, const char *v, bool copy) {
    char *base = (char *)s + f->offset;
    if (copy && f->kind != FM_SPEC_BOOL && f->kind != FM_SPEC_CHOICE) {
        v = own(s, v);
        if (!v) return fm_error(FM_ERR_NOMEM, "--%s: out of memory for its value", f->name);
    }
    char *end = NULL;
    errno = 0;
    bool bad = false;
    long lv;
    switch (f->kind) {
    case FM_SPEC_STR: *(const char **)base = v; break; /* any text, the empty string included */
    case FM_SPEC_FILES: {
        int *count = (int *)((char *)s + f->count_offset);
        if (*count >= FM_SPEC_MAX_FILES)
            return fm_error(FM_ERR_ARG, "too many files for '--%s' (at most %d)", f->name, FM_SPEC_MAX_FILES);
        ((const char **)base)[(*count)++] = v;
        break;
    }
    case FM_SPEC_BOOL:
        if (!strcmp(v, "true") || !strcmp(v, "1")) *(bool *)base = true;
        else if (!strcmp(v, "false") || !strcmp(v, "0")) *(bool *)base = false;
        else return fm_error(FM_ERR_ARG, "flag '--%s' expects true or false, found '%s'", f->name, v);
        break;
    case FM_SPEC_BYTES: {
        char what[80];
        snprintf(what, sizeof what, "--%s", f->name);
        FM_TRY(fm_parse_bytes(v, what, (size_t *)base));
        break;
    }
    case FM_SPEC_CHOICE: {
        int k = -1;
        for (int i = 0; f->choices[i]; i++)
            if (!strcmp(f->choices[i], v)) k = i;
        if (k < 0) {
            char list[200];
            choice_list(f, list, sizeof list);
            return fm_error(FM_ERR_ARG, "--%s: expected %s, found '%s'", f->name, list, v);
        }
        if (f->width == 1) *(unsigned char *)base = (unsigned char)k;
        else *(int *)base = k;
        break;
    }
    case FM_SPEC_I64:
        bad = !*v;
        *(int64_t *)base = strtoll(v, &end, 10);
        break;
    case FM_SPEC_INT:
        bad = !*v;
        lv = strtol(v, &end, 10);
        bad |= lv < -1000000 || lv > 1000000;
        *(int *)base = (int)lv;
        break;
    case FM_SPEC_U64:
        bad = !*v || *v == '-';
        *(uint64_t *)base = strtoull(v, &end, 10);
        break;
    case FM_SPEC_F64:
        bad = !*v;
        *(double *)base = strtod(v, &end);
        bad |= !isfinite(*(double *)base);
        break;
    }
    if (end && (bad || *end || errno))
        return fm_error(FM_ERR_ARG, "flag '--%s' expects %s, found '%s'", f->name,
                        f->kind == FM_SPEC_F64 ? "a finite number"
                        : f->kind == FM_SPEC_U64 ? "a non-negative integer" : "an integer", v);
    fm_spec_mark_given(s, fm_spec_row(f), true);
    return FM_OK;
}

fm_status fm_spec_set(fm_run_spec *s, const char *name, const char *value) {
    const fm_spec_flag *f = fm_spec_find(name, s->cmd);
    if (!f) return fm_error(FM_ERR_ARG, "option '%s': no such flag of this command; see its --help", name);
    return fm_spec_set_row(s, f, value, true);
}

void fm_spec_default(fm_run_spec *s, unsigned cmd) {
    memset(s, 0, sizeof *s);
    s->cmd = cmd;
    fm_train_opts_default(&s->train); /* the trainer's defaults for the fields no row of cmd sets */
    s->train.recompute = NULL;
    for (int i = 0; i < fm_spec_n_flags; i++) {
        const fm_spec_flag *f = &fm_spec_flags[i];
        if (!(f->cmds & cmd)) continue;
        if (!f->dflt) { /* zero / unset, whatever fm_train_opts_default says for another command */
            static const size_t width[] = {[FM_SPEC_STR] = sizeof(char *), [FM_SPEC_I64] = 8, [FM_SPEC_INT] = sizeof(int),
                                           [FM_SPEC_U64] = 8, [FM_SPEC_F64] = 8, [FM_SPEC_BOOL] = sizeof(bool),
                                           [FM_SPEC_FILES] = 0, [FM_SPEC_BYTES] = sizeof(size_t), [FM_SPEC_CHOICE] = 0};
            memset((char *)s + f->offset, 0, f->kind == FM_SPEC_CHOICE ? f->width : width[f->kind]);
            if (f->kind == FM_SPEC_FILES) *(int *)((char *)s + f->count_offset) = 0;
            continue;
        }
        const fm_status st = fm_spec_set_row(s, f, f->dflt, false);
        FM_ASSERT(st == FM_OK); /* a table default that does not parse is a bug of the table */
        fm_spec_mark_given(s, i, false);
    }
}

void fm_spec_format(const fm_run_spec *s, const fm_spec_flag *f, char *out, size_t cap) {
    const char *base = (const char *)s + f->offset;
    switch (f->kind) {
    case FM_SPEC_STR: snprintf(out, cap, "%s", *(const char *const *)base ? *(const char *const *)base : ""); break;
    case FM_SPEC_FILES: {
        const int n = *(const int *)((const char *)s + f->count_offset);
        snprintf(out, cap, "%s", n > 0 ? ((const char *const *)base)[0] : "");
        break;
    }
    case FM_SPEC_BOOL: snprintf(out, cap, "%s", *(const bool *)base ? "true" : "false"); break;
    case FM_SPEC_BYTES: snprintf(out, cap, "%zu", *(const size_t *)base); break;
    case FM_SPEC_CHOICE: {
        const int k = f->width == 1 ? *(const unsigned char *)base : *(const int *)base;
        snprintf(out, cap, "%s", f->choices[k]);
        break;
    }
    case FM_SPEC_I64: snprintf(out, cap, "%" PRId64, *(const int64_t *)base); break;
    case FM_SPEC_INT: snprintf(out, cap, "%d", *(const int *)base); break;
    case FM_SPEC_U64: snprintf(out, cap, "%" PRIu64, *(const uint64_t *)base); break;
    case FM_SPEC_F64: snprintf(out, cap, "%.17g", *(const double *)base); break;
    }
}

void fm_spec_default_text(const fm_spec_flag *f, char *out, size_t cap) {
    char d[64] = "";
    if (f->dflt) { /* a newline shown as \n */
        size_t j = 0;
        for (const char *c = f->dflt; *c && j + 3 < sizeof d; c++) {
            if (*c == '\n') d[j++] = '\\', d[j++] = 'n';
            else d[j++] = *c;
        }
        d[j] = 0;
    }
    if (f->dflt && f->dflt_note) snprintf(out, cap, "%s; %s", d, f->dflt_note);
    else if (f->dflt) snprintf(out, cap, "%s", d);
    else if (f->dflt_note) snprintf(out, cap, "%s", f->dflt_note);
    else out[0] = 0;
}

/* Whether flag `name` of s->cmd was given by the user (not restored from a checkpoint). */
static bool user_given(const fm_run_spec *s, const char *name) {
    const fm_spec_flag *f = fm_spec_find(name, s->cmd);
    if (!f) return false;
    const int r = fm_spec_row(f);
    return fm_spec_row_given(s, r) && !((s->restored[r / 64] >> (r % 64)) & 1);
}

fm_train_opts fm_spec_train_opts(const fm_run_spec *s) {
    fm_train_opts o = s->train;
    o.data = s->data_files;
    o.val_data = o.n_val_data ? s->val_files : NULL;
    /* the memory knobs not given: -1, chosen under a budget, else 0 (fm_trainer.h) */
    if (!fm_spec_given(s, "moe-chunk-tokens")) o.moe_chunk_tokens = -1;
    if (!fm_spec_given(s, "ce-block-tokens")) o.ce_block_tokens = -1;
    if (!fm_spec_given(s, "ce-block-vocab")) o.ce_block_vocab = -1;
    if (!fm_spec_given(s, "optimizer-offload-fraction")) o.optimizer_offload_fraction = -1; /* chosen, else 1 */
    o.host_mem_budget_given = fm_spec_given(s, "host-mem-budget");
    /* --resume: the schedule and shape not given by the user are the checkpoint's (fm_train reads
     * them from state.json, with a line saying so) */
    o.lr_given = user_given(s, "lr");
    o.min_lr_given = user_given(s, "min-lr");
    o.warmup_given = user_given(s, "warmup");
    if (o.resume) {
        if (!user_given(s, "steps")) o.steps = 0;
        if (!user_given(s, "seq-len")) o.seq_len = 0;
        if (!user_given(s, "micro-batch")) o.micro_batch = 0;
        if (!user_given(s, "grad-accum")) o.grad_accum = 0;
    }
    return o;
}
