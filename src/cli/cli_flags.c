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
        if (!f) return cli_usage_error(cmd, "unknown flag '--%s'", name);
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
