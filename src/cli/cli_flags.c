/* flatmoe command line: the flag parser shared by every command, the error exits, and --ckpt. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "io/fm_checkpoint.h"

int cli_usage_error(const char *cmd, const char *fmt, const char *arg) {
    fprintf(stderr, "flatmoe %s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\nRun 'flatmoe %s --help' for the flags.\n", cmd);
    return 2;
}

static void cli_print_help(const char *cmd, const char *synopsis, const flag *flags, int n) {
    printf("usage: flatmoe %s %s\n\nflags:\n", cmd, synopsis);
    for (int i = 0; i < n; i++) printf("  --%-18s %s\n", flags[i].name, flags[i].help);
    printf("  --%-18s %s\n", "help", "print this help");
}

/* Levenshtein distance of a and b (insert, delete, substitute: 1 each), capped at 63. */
int cli_edit_distance(const char *a, const char *b) {
    int la = (int)strlen(a), lb = (int)strlen(b);
    if (la > 63) la = 63;
    if (lb > 63) lb = 63;
    int row[64];
    for (int j = 0; j <= lb; j++) row[j] = j;
    for (int i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= lb; j++) {
            const int up = row[j];
            const int sub = diag + (a[i - 1] != b[j - 1]);
            int best = up + 1 < row[j - 1] + 1 ? up + 1 : row[j - 1] + 1;
            row[j] = sub < best ? sub : best;
            diag = up;
        }
    }
    return row[lb] > 63 ? 63 : row[lb];
}

/* Names other trainers (Hugging Face Trainer, torchtitan, Megatron-LM, llm.c) give our flags:
 * a typo of one of them is suggested as the flag it means (only when the command has it). */
static const char *const flag_aliases[][2] = {
    {"learning-rate", "lr"}, {"lr-min", "min-lr"}, {"min-learning-rate", "min-lr"},
    {"batch-size", "micro-batch"}, {"micro-batch-size", "micro-batch"}, {"per-device-train-batch-size", "micro-batch"},
    {"max-steps", "steps"}, {"train-iters", "steps"}, {"num-steps", "steps"}, {"iters", "steps"},
    {"gradient-accumulation-steps", "grad-accum"}, {"sequence-length", "seq-len"}, {"seq-length", "seq-len"},
    {"context-length", "seq-len"}, {"output-dir", "out"}, {"output", "out"}, {"num-threads", "threads"},
    {"warmup-steps", "warmup"}, {"lr-warmup-iters", "warmup"}, {"checkpoint", "ckpt"}, {"model", "config"},
    {"save-steps", "save-every"}, {"save-interval", "save-every"}, {"eval-steps", "eval-every"},
    {"eval-interval", "eval-every"}, {"logging-steps", "log-every"}, {"log-interval", "log-every"},
    {"max-grad-norm", "grad-clip"}, {"clip-grad", "grad-clip"}, {"train-data", "data"}, {"valid-data", "val-data"},
};

/* The command's flag nearest to `name` by edit distance, over its flags and the aliases of
 * those flags; NULL when none is within max(2, len/3) edits (a guess further off misleads). */
static const char *nearest_flag(const char *name, const flag *flags, int n) {
    const char *best = NULL;
    int bd = 1 << 30;
    const int limit = (int)strlen(name) / 3 > 2 ? (int)strlen(name) / 3 : 2;
    for (int j = 0; j < n; j++) {
        const int d = cli_edit_distance(name, flags[j].name);
        if (d < bd) { bd = d; best = flags[j].name; }
    }
    for (size_t a = 0; a < sizeof flag_aliases / sizeof flag_aliases[0]; a++) {
        const flag *target = NULL;
        for (int j = 0; j < n; j++)
            if (!strcmp(flags[j].name, flag_aliases[a][1])) target = &flags[j];
        if (!target) continue;
        const int d = cli_edit_distance(name, flag_aliases[a][0]);
        if (d < bd) { bd = d; best = target->name; }
    }
    return bd <= limit ? best : NULL;
}

/* Returns 0 on success, 1 if help was printed, 2 on a usage error (message printed). */
int cli_parse_flags(const char *cmd, const char *synopsis, int argc, char **argv, flag *flags, int n) {
    for (int i = 0; i < argc; i++) {
        char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            cli_print_help(cmd, synopsis, flags, n);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) return cli_usage_error(cmd, "unexpected argument '%s' (flags start with --)", a);
        char name[64];
        const char *eq = strchr(a + 2, '=');
        size_t len = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
        if (len >= sizeof name) return cli_usage_error(cmd, "unknown flag '%s'", a);
        memcpy(name, a + 2, len);
        name[len] = 0;
        flag *f = NULL;
        for (int j = 0; j < n; j++)
            if (!strcmp(flags[j].name, name)) f = &flags[j];
        if (!f) {
            const char *near = nearest_flag(name, flags, n);
            if (!near) return cli_usage_error(cmd, "unknown flag '--%s'", name);
            fprintf(stderr, "flatmoe %s: unknown flag '--%s'; did you mean --%s?\n", cmd, name, near);
            fprintf(stderr, "Run 'flatmoe %s --help' for the flags.\n", cmd);
            return 2;
        }
        if (f->kind == F_BOOL) {
            if (eq) return cli_usage_error(cmd, "flag '--%s' takes no value", name);
            *(bool *)f->ptr = true;
            continue;
        }
        if (f->kind == F_FILES) {
            const char **list = f->ptr;
            if (eq) {
                if (*f->count >= MAX_FILES) return cli_usage_error(cmd, "too many files for '--%s' (at most 256)", name);
                list[(*f->count)++] = eq + 1;
            }
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
                if (*f->count >= MAX_FILES) return cli_usage_error(cmd, "too many files for '--%s' (at most 256)", name);
                list[(*f->count)++] = argv[++i];
            }
            if (*f->count == 0) return cli_usage_error(cmd, "flag '--%s' needs at least one file", name);
            continue;
        }
        const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (!v) return cli_usage_error(cmd, "flag '--%s' needs a value", name);
        char *end = NULL;
        errno = 0;
        if (f->kind == F_STR) { /* any text, the empty string included (e.g. --prompt "") */
            *(const char **)f->ptr = v;
            continue;
        }
        bool bad = !*v || (f->kind == F_U64 && *v == '-');
        long lv;
        switch (f->kind) {
        case F_I64: *(int64_t *)f->ptr = strtoll(v, &end, 10); break;
        case F_INT:
            lv = strtol(v, &end, 10);
            bad |= lv < -1000000 || lv > 1000000;
            *(int *)f->ptr = (int)lv;
            break;
        case F_U64: *(uint64_t *)f->ptr = strtoull(v, &end, 10); break;
        case F_F64:
            *(double *)f->ptr = strtod(v, &end);
            bad |= !isfinite(*(double *)f->ptr);
            break;
        default: break;
        }
        if (bad || *end || errno) {
            fprintf(stderr, "flatmoe %s: flag '--%s' expects %s, found '%s'\n", cmd, name,
                    f->kind == F_F64 ? "a finite number" : f->kind == F_U64 ? "a non-negative integer" : "an integer", v);
            return 2;
        }
    }
    return 0;
}

int cli_fail(const char *cmd, fm_status s) {
    fflush(stdout);
    fprintf(stderr, "flatmoe %s: error: %s\n", cmd, fm_errmsg());
    return s == FM_ERR_ARG ? 2 : 1;
}

/* A run folder (use its latest checkpoint) or a checkpoint folder. */
fm_status cli_resolve_ckpt(const char *dir, char *out, size_t cap) {
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/%s", dir, FM_CKPT_MODEL_FILE);
    FILE *f = fopen(probe, "rb");
    if (!f) { /* a Hugging Face folder with sharded weights */
        snprintf(probe, sizeof probe, "%s/model.safetensors.index.json", dir);
        f = fopen(probe, "rb");
    }
    if (f) {
        fclose(f);
        snprintf(out, cap, "%s", dir);
        return FM_OK;
    }
    fm_status s = fm_ckpt_find_latest(dir, out, cap, NULL);
    if (s) return fm_error(s, "--ckpt %s: neither a checkpoint folder (no %s) nor a run folder with step_* checkpoints",
                           dir, FM_CKPT_MODEL_FILE);
    return FM_OK;
}
