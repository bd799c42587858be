/* The shared part of the src/io tests (tests/test_io.c: safetensors; tests/test_io_ckpt.c: text
 * files, checkpoint folders, Hugging Face folders): the working folder, file helpers, a raw
 * safetensors writer and a seeded generator. Included by one test file each (its statics are
 * that binary's). */
#ifndef FM_TEST_IO_H
#define FM_TEST_IO_H
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fm_test.h"
#include "core/fm_core.h"
#include "io/fm_checkpoint.h"
#include "io/fm_hf_weights.h"
#include "io/fm_safetensors.h"

static char g_dir[256];

/* g_dir/name in a rotating static buffer: for immediate use only; keep a copy otherwise. */
static inline const char *tpath(const char *name) {
    static char buf[8][512];
    static int k = 0;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}

static inline bool exists(const char *p) {
    struct stat sb;
    return lstat(p, &sb) == 0;
}

static inline bool msg_has(const char *s) { return strstr(fm_errmsg(), s) != NULL; }

static inline void write_bytes(const char *p, const void *data, size_t n) {
    FILE *f = fopen(p, "wb");
    if (!f) { perror(p); exit(2); }
    if (n) fwrite(data, 1, n, f);
    fclose(f);
}

/* Whole file in malloc'd memory; NULL if missing. */
static inline unsigned char *read_all(const char *p, size_t *n) {
    FILE *f = fopen(p, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)len + 1);
    *n = fread(b, 1, (size_t)len, f);
    fclose(f);
    return b;
}

static inline bool same_file(const char *p, const unsigned char *data, size_t n) {
    size_t m;
    unsigned char *b = read_all(p, &m);
    bool same = b && m == n && memcmp(b, data, n) == 0;
    free(b);
    return same;
}

/* A safetensors file from a raw header string and raw data bytes. */
static inline void make_st(const char *p, const char *header, const void *data, size_t ndata) {
    size_t hl = strlen(header);
    unsigned char *b = malloc(8 + hl + ndata + 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, header, hl);
    if (ndata) memcpy(b + 8 + hl, data, ndata);
    write_bytes(p, b, 8 + hl + ndata);
    free(b);
}

static inline int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}
static inline void rm_rf(const char *p) { nftw(p, rm_cb, 16, FTW_DEPTH | FTW_PHYS); }

/* Entries of `dir` whose name starts with ".tmp" or ends with ".tmp", recursively. */
static inline int count_tmp(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        size_t l = strlen(de->d_name);
        if (!strncmp(de->d_name, ".tmp", 4) || (l > 4 && !strcmp(de->d_name + l - 4, ".tmp"))) n++;
        char sub[1024];
        if (snprintf(sub, sizeof sub, "%s/%s", dir, de->d_name) >= (int)sizeof sub) continue; /* never: short names */
        struct stat sb;
        if (lstat(sub, &sb) == 0 && S_ISDIR(sb.st_mode)) n += count_tmp(sub);
    }
    closedir(d);
    return n;
}

static uint32_t g_lcg;
static inline float rnd(void) {
    g_lcg = g_lcg * 1664525u + 1013904223u;
    return (float)(g_lcg >> 8) / 16777216.0f * 2.0f - 1.0f;
}

static inline float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

#endif
