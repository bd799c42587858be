/* Shared helpers of the libFuzzer harnesses (fuzz/fuzz_*.c): a private scratch folder for the
 * parsers that read files, the input cut into files, and a check that aborts (a finding) when an
 * invariant the harness states does not hold. Header-only: each harness is one translation unit. */
#ifndef FM_FUZZ_H
#define FM_FUZZ_H

#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/fm_core.h"

/* An invariant of the harness: on failure print it and abort, which libFuzzer reports as a crash
 * with the input that broke it. */
#define FUZZ_CHECK(cond, ...)                                                                          \
    do {                                                                                               \
        if (!(cond)) {                                                                                 \
            fprintf(stderr, "fuzz: %s:%d: %s: ", __FILE__, __LINE__, #cond);                           \
            fprintf(stderr, __VA_ARGS__);                                                              \
            fprintf(stderr, "\n");                                                                     \
            abort();                                                                                   \
        }                                                                                              \
    } while (0)

static char fuzz_dir_[64];

static inline void fuzz_rmdir_(void) {
    if (!fuzz_dir_[0]) return;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", fuzz_dir_);
    if (system(cmd) != 0) fprintf(stderr, "fuzz: could not remove %s\n", fuzz_dir_);
}

/* This process's scratch folder (in /dev/shm when there is one: no disk writes per input),
 * removed at exit. */
static inline const char *fuzz_dir(void) {
    if (!fuzz_dir_[0]) {
        snprintf(fuzz_dir_, sizeof fuzz_dir_, "%s/fm_fuzz_XXXXXX", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
        if (!mkdtemp(fuzz_dir_)) {
            perror("fuzz: mkdtemp");
            abort();
        }
        atexit(fuzz_rmdir_);
    }
    return fuzz_dir_;
}

/* dir/name, in one of 8 rotating buffers. */
static inline const char *fuzz_path(const char *name) {
    static char bufs[8][256];
    static int k;
    char *p = bufs[k++ % 8];
    snprintf(p, 256, "%s/%s", fuzz_dir(), name);
    return p;
}

/* Writes n bytes to dir/name (replacing it); returns the path. */
static inline const char *fuzz_write(const char *name, const void *data, size_t n) {
    const char *p = fuzz_path(name);
    FILE *f = fopen(p, "wb");
    FUZZ_CHECK(f != NULL, "cannot write %s", p);
    if (n) FUZZ_CHECK(fwrite(data, 1, n, f) == n, "short write to %s", p);
    fclose(f);
    return p;
}

/* The next piece of the input: a 4-byte little-endian length, then that many bytes (fewer when
 * the input ends first); with under 4 bytes left, the rest. Advances *p, *n. */
static inline void fuzz_take(const uint8_t **p, size_t *n, const uint8_t **out, size_t *len) {
    if (*n < 4) {
        *out = *p, *len = *n;
        *p += *n, *n = 0;
        return;
    }
    size_t l = (size_t)(*p)[0] | (size_t)(*p)[1] << 8 | (size_t)(*p)[2] << 16 | (size_t)(*p)[3] << 24;
    *p += 4, *n -= 4;
    if (l > *n) l = *n;
    *out = *p, *len = l;
    *p += l, *n -= l;
}

/* A NUL-terminated copy of data[0..n) (free with free()). */
static inline char *fuzz_str(const uint8_t *data, size_t n) {
    char *s = malloc(n + 1);
    FUZZ_CHECK(s != NULL, "out of memory");
    if (n) memcpy(s, data, n);
    s[n] = 0;
    return s;
}

#endif
