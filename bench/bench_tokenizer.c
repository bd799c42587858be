/* Tokenizer encoding speed: MB/s of fm_tokenizer_encode on one core, per tokenizer and file, as
 * input megabytes per second of this process's CPU time (one thread: MB/s per core, whatever
 * else the machine runs) and per second of wall time.
 *   bench_tokenizer TOKENIZER_DIR_OR_JSON[,...] FILE... [--repeat N] [--chunk BYTES]
 * Each file is encoded whole (--chunk 0, the default) or in pieces of BYTES cut at a newline
 * (how documents arrive in JSONL), N times (3) with a fresh tokenizer, so the first pass is with a
 * cold word cache; prints the cold and the best warm pass (CPU time) and the best wall-time pass.
 * Results go to bench/RESULTS.md. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tok/fm_tokenizer.h"

static double now_s(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    fclose(f);
    return b;
}

/* Encodes buf[0..n) in chunks cut after a newline at or past `chunk` bytes (0: whole). */
static int64_t encode_all(fm_tokenizer *t, const char *buf, size_t n, size_t chunk, int32_t **ids, int64_t *cap) {
    int64_t total = 0;
    for (size_t a = 0; a < n;) {
        size_t e = n;
        if (chunk && a + chunk < n) {
            const char *nl = memchr(buf + a + chunk, '\n', n - a - chunk);
            e = nl ? (size_t)(nl - buf) + 1 : n;
        }
        int64_t m = 0;
        if (fm_tokenizer_encode_append(t, buf + a, e - a, ids, &m, cap)) {
            fprintf(stderr, "encode: %s\n", fm_errmsg());
            exit(1);
        }
        total += m;
        a = e;
    }
    return total;
}

int main(int argc, char **argv) {
    int repeat = 3;
    size_t chunk = 0;
    const char *toks = NULL, *files[64];
    int nf = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--chunk") && i + 1 < argc) chunk = (size_t)atol(argv[++i]);
        else if (!toks) toks = argv[i];
        else if (nf < 64) files[nf++] = argv[i];
    }
    if (!toks || nf == 0 || repeat < 1) {
        fprintf(stderr, "usage: bench_tokenizer TOKENIZER[,TOKENIZER...] FILE... [--repeat N] [--chunk BYTES]\n");
        return 2;
    }
    char *list = strdup(toks);
    printf("%-24s %-24s %7s %9s %14s %14s %14s\n", "tokenizer", "file", "MB", "tokens", "cold MB/cpu-s",
           "warm MB/cpu-s", "best MB/wall-s");
    for (char *tk = strtok(list, ","); tk; tk = strtok(NULL, ",")) {
        for (int f = 0; f < nf; f++) {
            size_t n;
            char *buf = read_all(files[f], &n);
            fm_tokenizer t;
            if (fm_tokenizer_load(&t, tk)) { fprintf(stderr, "%s\n", fm_errmsg()); return 1; }
            int32_t *ids = NULL;
            int64_t cap = 0, ntok = 0;
            double cold = 0, best = 0, wall = 0;
            for (int r = 0; r < repeat; r++) {
                const double c0 = now_s(CLOCK_PROCESS_CPUTIME_ID), w0 = now_s(CLOCK_MONOTONIC);
                ntok = encode_all(&t, buf, n, chunk, &ids, &cap);
                const double mbs = (double)n / 1e6 / (now_s(CLOCK_PROCESS_CPUTIME_ID) - c0);
                const double mbw = (double)n / 1e6 / (now_s(CLOCK_MONOTONIC) - w0);
                if (r == 0) cold = mbs;
                else if (mbs > best) best = mbs;
                if (mbw > wall) wall = mbw;
            }
            const char *tn = strrchr(tk, '/'), *fn = strrchr(files[f], '/');
            printf("%-24s %-24s %7.2f %9lld %14.2f %14.2f %14.2f\n", tn ? tn + 1 : tk, fn ? fn + 1 : files[f],
                   (double)n / 1e6, (long long)ntok, cold, best, wall);
            fm_free(ids);
            fm_tokenizer_free(&t);
            free(buf);
        }
    }
    free(list);
    return 0;
}
