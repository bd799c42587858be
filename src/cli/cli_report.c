/* flatmoe report RUN_DIR [--out DIR] [--format png|svg]: draws a run's metrics.jsonl through
 * gnuplot (Debian's gnuplot-nox): training and validation loss, learning rate, tokens/s, the
 * expert load (max/mean per layer over the steps) and each live set's bound against its measured
 * high-water mark. Writes the data files and the gnuplot script next to the images (DIR, default
 * RUN_DIR/report), every file to a temporary name first and renamed when complete. */
#define _DEFAULT_SOURCE
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli.h"
#include "io/fm_checkpoint.h"

/* A growing text buffer (the CLI's, outside any training step). */
typedef struct text {
    char *p;
    size_t n, cap;
    bool oom;
} text;

static void tprintf(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tprintf(text *t, const char *fmt, ...) {
    if (t->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        const size_t room = t->cap - t->n;
        const int k = vsnprintf(t->p ? t->p + t->n : NULL, room, fmt, ap);
        va_end(ap);
        if (k < 0) { t->oom = true; return; }
        if ((size_t)k < room) { t->n += (size_t)k; return; }
        const size_t cap = 2 * (t->cap + (size_t)k + 256);
        char *q = realloc(t->p, cap);
        if (!q) { t->oom = true; return; }
        t->p = q;
        t->cap = cap;
    }
}

/* One file of the report, written whole (fm_write_file_atomic: a temporary name, then rename). */
static fm_status write_text(const char *dir, const char *name, text *t) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (t->oom) return fm_error(FM_ERR_NOMEM, "%s: out of memory", path);
    return fm_write_file_atomic(path, t->p ? t->p : "", t->n);
}

/* The executable `name` on PATH, into out[cap]; false when there is none. */
static bool find_on_path(const char *name, char *out, size_t cap) {
    const char *path = getenv("PATH");
    if (!path || !*path) path = "/usr/local/bin:/usr/bin:/bin";
    for (const char *p = path; *p;) {
        const char *c = strchr(p, ':');
        const size_t len = c ? (size_t)(c - p) : strlen(p);
        snprintf(out, cap, "%.*s/%s", (int)len, len ? p : ".", name);
        if (access(out, X_OK) == 0) return true;
        p += len + (c ? 1 : 0);
    }
    return false;
}

static double num(const cJSON *o, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

/* gnuplot's single-quoted string of s ('' doubles a quote). */
static void gp_quote(text *t, const char *s) {
    tprintf(t, "'");
    for (; *s; s++) tprintf(t, *s == '\'' ? "''" : "%c", *s);
    tprintf(t, "'");
}

typedef struct report_data {
    text loss, val, lr, tps, load, mem;
    int64_t n_steps, n_val, n_load_layers;
    bool have_mem_hw;
    double mem_min;      /* the smallest positive MiB value of the memory table (its log axis) */
    char title[512];
} report_data;

/* The memory table from a record's "memory" object ({set: {bound, high_water}}). */
static void memory_table(report_data *d, const cJSON *mem) {
    d->mem.n = 0;
    d->have_mem_hw = false;
    const cJSON *it;
    cJSON_ArrayForEach(it, mem) {
        const double b = num(it, "bound"), hw = num(it, "high_water");
        if (!it->string || isnan(b)) continue;
        if (!isnan(hw)) d->have_mem_hw = true;
        if (b > 0 && (d->mem_min == 0 || b / 1048576.0 < d->mem_min)) d->mem_min = b / 1048576.0;
        if (hw > 0 && (d->mem_min == 0 || hw / 1048576.0 < d->mem_min)) d->mem_min = hw / 1048576.0;
        tprintf(&d->mem, "\"%s\" %.6f ", it->string, b / 1048576.0);
        if (isnan(hw)) tprintf(&d->mem, "NaN\n");
        else tprintf(&d->mem, "%.6f\n", hw / 1048576.0);
    }
}

/* Reads RUN_DIR/metrics.jsonl into the data files' text. Step records: "type":"step", or (files
 * written before the header record existed) any record with "step" and "loss". */
static fm_status read_metrics(const char *path, report_data *d) {
    char *all;
    if (fm_ckpt_read_text(path, &all) != FM_OK)
        return fm_error(FM_ERR_IO, "%s: cannot read it; give the run folder that `flatmoe train --out` wrote", path);
    const cJSON *plan_bytes = NULL;
    cJSON *header = NULL, *summary = NULL, *last_mem = NULL;
    int64_t lineno = 0;
    fm_status st = FM_OK;
    for (char *line = all; *line && st == FM_OK;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        lineno++;
        if (line[strspn(line, " \t\r")]) {
            cJSON *r = cJSON_Parse(line);
            if (!r || !cJSON_IsObject(r)) {
                cJSON_Delete(r);
                st = fm_error(FM_ERR_FORMAT, "%s:%lld: not a JSON object (metrics.jsonl holds one per line)", path,
                              (long long)lineno);
                break;
            }
            const cJSON *type = cJSON_GetObjectItemCaseSensitive(r, "type");
            const char *ty = cJSON_IsString(type) ? type->valuestring : NULL;
            const double step = num(r, "step"), loss = num(r, "loss");
            if (ty && !strcmp(ty, "header")) {
                cJSON_Delete(header);
                header = r;
                r = NULL;
            } else if (ty && !strcmp(ty, "summary")) {
                cJSON_Delete(summary);
                summary = r;
                r = NULL;
            } else if ((ty ? !strcmp(ty, "step") : true) && !isnan(step) && !isnan(loss)) {
                d->n_steps++;
                tprintf(&d->loss, "%.0f %.9g %.9g\n", step, loss, num(r, "aux_loss"));
                const double v = num(r, "val_loss");
                if (!isnan(v)) { tprintf(&d->val, "%.0f %.9g\n", step, v); d->n_val++; }
                tprintf(&d->lr, "%.0f %.9g\n", step, num(r, "lr"));
                tprintf(&d->tps, "%.0f %.3f\n", step, num(r, "tokens_per_s"));
                const cJSON *ld = cJSON_GetObjectItemCaseSensitive(r, "expert_load_max_mean");
                if (cJSON_IsArray(ld)) {
                    const int64_t L = cJSON_GetArraySize(ld);
                    if (L > d->n_load_layers) d->n_load_layers = L;
                    tprintf(&d->load, "%.0f", step);
                    const cJSON *x;
                    cJSON_ArrayForEach(x, ld) tprintf(&d->load, " %.6g", cJSON_IsNumber(x) ? x->valuedouble : NAN);
                    tprintf(&d->load, "\n");
                }
                if (cJSON_GetObjectItemCaseSensitive(r, "memory")) {
                    cJSON_Delete(last_mem);
                    last_mem = r;
                    r = NULL;
                }
            }
            cJSON_Delete(r);
        }
        if (!nl) break;
        line = nl + 1;
    }
    fm_free(all);
    if (st == FM_OK && d->n_steps == 0)
        st = fm_error(FM_ERR_FORMAT, "%s: no step records (has the run trained a step yet?)", path);
    if (st == FM_OK) {
        /* memory: the summary's high-water marks, else the last --report-memory record's, else the
         * header's bounds alone */
        const cJSON *m = summary ? cJSON_GetObjectItemCaseSensitive(summary, "memory") : NULL;
        if (!m && last_mem) m = cJSON_GetObjectItemCaseSensitive(last_mem, "memory");
        if (m) memory_table(d, m);
        else if (header && (plan_bytes = cJSON_GetObjectItemCaseSensitive(
                                cJSON_GetObjectItemCaseSensitive(header, "plan"), "bytes"))) {
            const cJSON *it;
            cJSON_ArrayForEach(it, plan_bytes)
                if (it->string && cJSON_IsNumber(it)) {
                    tprintf(&d->mem, "\"%s\" %.6f NaN\n", it->string, it->valuedouble / 1048576.0);
                    const double v = it->valuedouble / 1048576.0;
                    if (v > 0 && (d->mem_min == 0 || v < d->mem_min)) d->mem_min = v;
                }
        }
        const cJSON *cfg = header ? cJSON_GetObjectItemCaseSensitive(header, "config") : NULL;
        const cJSON *mt = cfg ? cJSON_GetObjectItemCaseSensitive(cfg, "model_type") : NULL;
        const cJSON *commit = header ? cJSON_GetObjectItemCaseSensitive(header, "git_commit") : NULL;
        snprintf(d->title, sizeof d->title, "%s%s%s", cJSON_IsString(mt) ? mt->valuestring : "flatmoe run",
                 cJSON_IsString(commit) ? ", flatmoe " : "", cJSON_IsString(commit) ? commit->valuestring : "");
    }
    cJSON_Delete(header);
    cJSON_Delete(summary);
    cJSON_Delete(last_mem);
    return st;
}

/* Runs `gnuplot script` in dir; returns its exit status (-1: it could not run). */
static int run_gnuplot(const char *gnuplot, const char *dir, const char *script) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        if (chdir(dir) != 0) _exit(126);
        execl(gnuplot, "gnuplot", script, (char *)NULL);
        _exit(127);
    }
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0)
        if (errno != EINTR) return -1;
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

int cmd_report(int argc, char **argv) {
    static fm_run_spec sp; /* the flags (run/fm_spec_flags.c rows of report); RUN_DIR is positional */
    fm_spec_default(&sp, FM_CMD_REPORT);
    if (argc > 0 && strncmp(argv[0], "--", 2) != 0 && strcmp(argv[0], "-h") != 0) {
        sp.report.run_dir = argv[0];
        argc--;
        argv++;
    }
    int pr = cli_parse_spec("report", "RUN_DIR [--out DIR] [--format png|svg]", argc, argv, &sp);
    if (pr) return pr == 1 ? 0 : pr;
    const char *run_dir = sp.report.run_dir, *out = sp.report.out, *format = sp.report.format;
    if (!run_dir) return cli_usage_error("report", "%s", "give the run folder: flatmoe report RUN_DIR");
    if (strcmp(format, "png") && strcmp(format, "svg"))
        return cli_usage_error("report", "--format must be png or svg, found '%s'", format);
    char gnuplot[4200];
    const char *gp_env = getenv("FLATMOE_GNUPLOT"); /* tests point it at a missing binary */
    if (gp_env ? access(gp_env, X_OK) != 0 : !find_on_path("gnuplot", gnuplot, sizeof gnuplot)) {
        fprintf(stderr, "flatmoe report: error: gnuplot %s%s; install it (Debian/Ubuntu: apt-get install gnuplot-nox; "
                "scripts/setup.sh does) and run the report again\n", gp_env ? "not executable at " : "not found on PATH",
                gp_env ? gp_env : "");
        return 1;
    }
    if (gp_env) snprintf(gnuplot, sizeof gnuplot, "%s", gp_env);
    char mpath[4200], dir[4200];
    snprintf(mpath, sizeof mpath, "%s/metrics.jsonl", run_dir);
    snprintf(dir, sizeof dir, "%s", out ? out : "");
    if (!out) snprintf(dir, sizeof dir, "%s/report", run_dir);
    report_data d;
    memset(&d, 0, sizeof d);
    fm_status s = read_metrics(mpath, &d);
    if (s == FM_OK) s = fm_mkdirs(dir);
    const bool png = !strcmp(format, "png");
    const char *ext = png ? "png" : "svg";
    static const char *const images[] = {"loss", "lr", "tokens_per_s", "expert_load", "memory"};
    text gp = {0};
    if (s == FM_OK) {
        tprintf(&gp, "# flatmoe report of %s (generated; run with gnuplot in this folder)\n", run_dir);
        if (png) tprintf(&gp, "set terminal pngcairo size 960,540 noenhanced\n");
        else tprintf(&gp, "set terminal svg size 960,540 noenhanced\n");
        tprintf(&gp, "set grid\nset key outside right top\nset xlabel 'step'\n");
        tprintf(&gp, "set output 'loss.%s.tmp'\nset title ", ext);
        gp_quote(&gp, d.title);
        tprintf(&gp, "\nset ylabel 'loss (nats/token)'\nplot 'loss.dat' using 1:2 with lines title 'training loss'");
        if (d.n_val > 0) tprintf(&gp, ", 'val.dat' using 1:2 with linespoints pointtype 7 title 'validation loss'");
        tprintf(&gp, "\nset output 'lr.%s.tmp'\nset title 'learning rate'\nset ylabel 'lr'\n"
                "plot 'lr.dat' using 1:2 with lines title 'lr'\n", ext);
        tprintf(&gp, "set output 'tokens_per_s.%s.tmp'\nset title 'throughput (each step)'\nset ylabel 'tokens/s'\n"
                "set yrange [0:*]\nplot 'tokens_per_s.dat' using 1:2 with lines title 'tokens/s'\nset yrange [*:*]\n", ext);
        tprintf(&gp, "set output 'expert_load.%s.tmp'\nset title 'expert load: max over mean tokens per expert, per layer'\n"
                "set ylabel 'max / mean (1 = balanced)'\n", ext);
        if (d.n_load_layers > 0)
            tprintf(&gp, "plot for [i=2:%lld] 'expert_load.dat' using 1:i with lines title sprintf('layer %%d', i-2)\n",
                    (long long)d.n_load_layers + 1);
        else
            tprintf(&gp, "set label 1 'no expert-load records in this run' at graph 0.5,0.5 center\n"
                    "plot [0:1] [0:1] NaN notitle\nunset label 1\n");
        tprintf(&gp, "set output 'memory.%s.tmp'\nset title 'live sets: planned bound and measured high-water mark%s'\n"
                "set xlabel ''\nset ylabel 'MiB'\nset style data histograms\nset style histogram clustered gap 1\n"
                "set style fill solid 0.8 border -1\nset xtics rotate by -30\n", ext,
                d.have_mem_hw ? "" : " (no high-water marks recorded)");
        /* a log axis: the live sets span bytes to gigabytes */
        tprintf(&gp, "set logscale y\nset yrange [%.6g:*]\n", d.mem_min > 0 ? d.mem_min / 2 : 1e-3);
        if (d.mem.n > 0)
            tprintf(&gp, "plot 'memory.dat' using 2:xtic(1) title 'bound', '' using 3 title 'high-water'\n");
        else
            tprintf(&gp, "set label 1 'no memory records' at graph 0.5,0.5 center\nplot [0:1] [0:1] NaN notitle\n");
        tprintf(&gp, "set output\n");
        text *files[] = {&d.loss, &d.val, &d.lr, &d.tps, &d.load, &d.mem};
        const char *names[] = {"loss.dat", "val.dat", "lr.dat", "tokens_per_s.dat", "expert_load.dat", "memory.dat"};
        for (int i = 0; i < 6 && s == FM_OK; i++) s = write_text(dir, names[i], files[i]);
        if (s == FM_OK) s = write_text(dir, "report.gp", &gp);
    }
    int rc = 0;
    if (s != FM_OK) {
        rc = cli_fail("report", s);
    } else {
        const int g = run_gnuplot(gnuplot, dir, "report.gp");
        if (g != 0) {
            fprintf(stderr, "flatmoe report: error: gnuplot %s on %s/report.gp (exit %d); the images were not written\n",
                    gnuplot, dir, g);
            rc = 1;
        }
        for (size_t i = 0; i < sizeof images / sizeof images[0]; i++) {
            char tmp[4300], fin[4300];
            snprintf(tmp, sizeof tmp, "%s/%s.%s.tmp", dir, images[i], ext);
            snprintf(fin, sizeof fin, "%s/%s.%s", dir, images[i], ext);
            struct stat sb;
            if (rc == 0 && stat(tmp, &sb) == 0 && sb.st_size > 0 && rename(tmp, fin) == 0) {
                printf("wrote %s\n", fin);
            } else {
                if (rc == 0) {
                    fprintf(stderr, "flatmoe report: error: gnuplot left no %s\n", tmp);
                    rc = 1;
                }
                unlink(tmp);
            }
        }
    }
    free(gp.p);
    free(d.loss.p); free(d.val.p); free(d.lr.p); free(d.tps.p); free(d.load.p); free(d.mem.p);
    return rc;
}
