/* Fine-tuning defaults for `train --init-from` (fm_spec_finetune.h). */
#include <stdio.h>
#include <string.h>

#include "fm_spec_finetune.h"

static bool applies(const fm_run_spec *s) {
    return (s->cmd & FM_CMD_TRAIN) && fm_spec_given(s, "init-from") && s->train.init_from;
}

fm_status fm_spec_finetune_out(fm_run_spec *s, char *said, size_t cap) {
    if (cap) said[0] = '\0';
    if (!applies(s) || fm_spec_given(s, "out")) return FM_OK;
    /* the folder's own name for --out: runs/ft-NAME */
    char name[256], out[300];
    const char *from = s->train.init_from;
    size_t n = strlen(from);
    while (n > 1 && from[n - 1] == '/') n--;
    size_t b = n;
    while (b > 0 && from[b - 1] != '/') b--;
    snprintf(name, sizeof name, "%.*s", (int)(n - b), from + b);
    snprintf(out, sizeof out, "runs/ft-%s", name[0] && strcmp(name, ".") && strcmp(name, "..") ? name : "model");
    fm_status st = fm_spec_set(s, "out", out);
    if (st) return st;
    snprintf(said, cap, "--out %s (the default with --init-from; give --out to override)", out);
    return FM_OK;
}

fm_status fm_spec_finetune_defaults(fm_run_spec *s, char *said, size_t cap) {
    if (cap) said[0] = '\0';
    if (!applies(s)) return FM_OK;
    const char *flag[5] = {"lr", "min-lr", "weight-decay", "warmup", "micro-batch"};
    const char *value[5] = {"2e-5", "0", "0", "0", "8"};
    size_t at = 0;
    for (int i = 0; i < 5; i++) {
        if (fm_spec_given(s, flag[i])) continue; /* given, or restored by --resume: kept */
        fm_status st = fm_spec_set(s, flag[i], value[i]);
        if (st) return st;
        if (at < cap) {
            int k = snprintf(said + at, cap - at, "%s--%s %s", at ? ", " : "", flag[i], value[i]);
            if (k > 0) at += (size_t)k;
        }
    }
    if (at && at < cap)
        snprintf(said + at, cap - at, " (the fine-tuning defaults with --init-from: TRL's SFTConfig and transformers' "
                 "TrainingArguments; give a flag to override)");
    return FM_OK;
}
