/* flatmoe command line: the flag parser shared by every command (argv through the flag table,
 * run/fm_spec_flags.c), the error exits, and --ckpt. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "io/fm_checkpoint.h"

int cli_usage_error(const char *cmd, const char *fmt, const char *arg) {
    fprintf(stderr, "flatmoe %s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\nRun 'flatmoe %s --help' for the flags.\n", cmd);
    return 2;
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

/* The name nearest to `name` by edit distance among names[0..n) and the aliases of those
 * names; NULL when none is within max(2, len/3) edits (a guess further off misleads). */
static const char *nearest_name(const char *name, const char *const *names, int n) {
    const char *best = NULL;
    int bd = 1 << 30;
    const int limit = (int)strlen(name) / 3 > 2 ? (int)strlen(name) / 3 : 2;
    for (int j = 0; j < n; j++) {
        const int d = cli_edit_distance(name, names[j]);
        if (d < bd) { bd = d; best = names[j]; }
    }
    for (size_t a = 0; a < sizeof flag_aliases / sizeof flag_aliases[0]; a++) {
        const char *target = NULL;
        for (int j = 0; j < n; j++)
            if (!strcmp(names[j], flag_aliases[a][1])) target = names[j];
        if (!target) continue;
        const int d = cli_edit_distance(name, flag_aliases[a][0]);
        if (d < bd) { bd = d; best = target; }
    }
    return bd <= limit ? best : NULL;
}

/* "unknown flag '--x'" with the nearest flag of the command when one is close; returns 2. */
static int unknown_flag(const char *cmd, const char *name, const char *near) {
    if (!near) return cli_usage_error(cmd, "unknown flag '--%s'", name);
    fprintf(stderr, "flatmoe %s: unknown flag '--%s'; did you mean --%s?\n", cmd, name, near);
    fprintf(stderr, "Run 'flatmoe %s --help' for the flags.\n", cmd);
    return 2;
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

/* ---- the run spec's commands: argv through the flag table (run/fm_spec_flags.c) ---- */

void cli_print_spec_help(const char *cmd, unsigned bit, const char *synopsis) {
    printf("usage: flatmoe %s %s\n\nflags:\n", cmd, synopsis);
    for (int i = 0; i < fm_spec_n_flags; i++) {
        const fm_spec_flag *f = &fm_spec_flags[i];
        if (!(f->cmds & bit)) continue;
        char d[400];
        fm_spec_default_text(f, d, sizeof d);
        if (d[0]) printf("  --%-18s %s (%s)\n", f->name, f->help, d);
        else printf("  --%-18s %s\n", f->name, f->help);
    }
    printf("  --%-18s %s\n", "help", "print this help");
}

int cli_parse_spec(const char *cmd, const char *synopsis, int argc, char **argv, fm_run_spec *s) {
    const unsigned bit = s->cmd;
    for (int i = 0; i < argc; i++) {
        char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            cli_print_spec_help(cmd, bit, synopsis);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) return cli_usage_error(cmd, "unexpected argument '%s' (flags start with --)", a);
        char name[64];
        const char *eq = strchr(a + 2, '=');
        size_t len = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
        if (len >= sizeof name) return cli_usage_error(cmd, "unknown flag '%s'", a);
        memcpy(name, a + 2, len);
        name[len] = 0;
        const fm_spec_flag *f = fm_spec_find(name, bit);
        if (!f) {
            const char *names[FM_SPEC_MAX_ROWS];
            int n = 0;
            for (int j = 0; j < fm_spec_n_flags; j++)
                if (fm_spec_flags[j].cmds & bit) names[n++] = fm_spec_flags[j].name;
            return unknown_flag(cmd, name, nearest_name(name, names, n));
        }
        fm_status st;
        if (f->kind == FM_SPEC_BOOL) {
            if (eq) return cli_usage_error(cmd, "flag '--%s' takes no value", name);
            st = fm_spec_set_row(s, f, "true", false);
        } else if (f->kind == FM_SPEC_FILES) {
            int *count = (int *)((char *)s + f->count_offset); /* a flag given again adds to its list */
            if (eq && (st = fm_spec_set_row(s, f, eq + 1, false))) return cli_usage_error(cmd, "%s", fm_errmsg());
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0)
                if ((st = fm_spec_set_row(s, f, argv[++i], false))) return cli_usage_error(cmd, "%s", fm_errmsg());
            if (*count == 0) return cli_usage_error(cmd, "flag '--%s' needs at least one file", name);
            st = FM_OK;
        } else {
            const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v) return cli_usage_error(cmd, "flag '--%s' needs a value", name);
            st = fm_spec_set_row(s, f, v, false);
        }
        if (st == FM_ERR_ARG && f->kind == FM_SPEC_CHOICE) return cli_usage_error(cmd, "%s", fm_errmsg());
        if (st && f->kind == FM_SPEC_BYTES) return cli_fail(cmd, st);
        if (st) {
            fprintf(stderr, "flatmoe %s: %s\n", cmd, fm_errmsg());
            return 2;
        }
    }
    return 0;
}
