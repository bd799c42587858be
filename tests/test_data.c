/* Tests for src/data: text and llm.c shard loading, format errors, split, windows, batches. */
#define _GNU_SOURCE
#include "fm_test.h"
#include "data/fm_data.h"

#include <stdarg.h>
#include <stdint.h>
#include <unistd.h>

static char g_dir[64];

static const char *tpath(const char *name) {
    static char bufs[8][256];
    static int k = 0;
    char *p = bufs[k++ % 8];
    snprintf(p, 256, "%s/%s", g_dir, name);
    return p;
}

static void write_raw(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(2); }
    if (n && fwrite(data, 1, n, f) != n) { perror(path); exit(2); }
    fclose(f);
}

static void put32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16); p[3] = (unsigned char)(v >> 24);
}

/* A shard image: 1024-byte header + count tokens of tb bytes + extra bytes (negative: cut). */
static size_t make_shard(unsigned char *img, uint32_t magic, uint32_t version, int32_t count, int tb,
                         const uint32_t *ids, int n_ids, long extra) {
    memset(img, 0, 1024);
    put32(img, magic);
    put32(img + 4, version);
    put32(img + 8, (uint32_t)count);
    size_t at = 1024;
    for (int i = 0; i < n_ids; i++) {
        if (tb == 2) { img[at] = (unsigned char)ids[i]; img[at + 1] = (unsigned char)(ids[i] >> 8); }
        else put32(img + at, ids[i]);
        at += (size_t)tb;
    }
    for (long i = 0; i < extra; i++) img[at++] = 0xAB;
    if (extra < 0) at = (size_t)((long)at + extra);
    return at;
}

/* Token i of a data set, as int32. */
static int32_t tok_at(const fm_dataset *ds, int64_t i) {
    int32_t v = -1;
    if (i >= 0 && i < ds->n_tokens) fm_dataset_tokens(ds, i, 1, &v);
    return v;
}

static fm_status load1(fm_dataset *ds, const char *path, int64_t vocab) {
    const char *paths[1] = {path};
    return fm_dataset_load(ds, paths, 1, vocab);
}

/* Expects status st and every needle (NULL-terminated list) in the message. */
static void expect_err(fm_status got, fm_status want, const char *what, ...) {
    if (getenv("FM_TEST_VERBOSE")) printf("  [%s] %s\n", what, fm_errmsg());
    CHECK_MSG(got == want, "%s: status %s, expected %s (msg: %s)", what, fm_status_name(got),
              fm_status_name(want), fm_errmsg());
    va_list ap;
    va_start(ap, what);
    for (const char *needle; (needle = va_arg(ap, const char *)) != NULL;)
        CHECK_MSG(strstr(fm_errmsg(), needle) != NULL, "%s: message lacks \"%s\": %s", what, needle, fm_errmsg());
    va_end(ap);
}

static void test_text(void) {
    write_raw(tpath("a.txt"), "hello ", 6);
    write_raw(tpath("b.txt"), "w\xc3\xb6rld", 6);
    write_raw(tpath("c.txt"), "!\n", 2);
    const char *paths[3] = {tpath("a.txt"), tpath("b.txt"), tpath("c.txt")};
    fm_dataset ds;
    fm_status s = fm_dataset_load(&ds, paths, 3, 256);
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    CHECK(ds.n_tokens == 14);
    CHECK(ds.owns);
    const unsigned char want[] = "hello w\xc3\xb6rld!\n";
    int same = 1;
    for (int i = 0; i < 14; i++) same &= tok_at(&ds, i) == (int32_t)want[i];
    CHECK(same);
    CHECK(tok_at(&ds, 7) == 0xc3); /* bytes are unsigned */
    CHECK_MSG(strcmp(ds.desc, "3 text files, 14 tokens (bytes)") == 0, "desc: %s", ds.desc);
    fm_dataset_free(&ds);
    CHECK(ds.parts == NULL && ds.n_tokens == 0 && !ds.owns);
    fm_dataset_free(&ds); /* twice is safe */

    CHECK(load1(&ds, tpath("a.txt"), 300) == FM_OK);
    CHECK_MSG(strcmp(ds.desc, "1 text file, 6 tokens (bytes)") == 0, "desc: %s", ds.desc);
    fm_dataset_free(&ds);

    expect_err(load1(&ds, tpath("a.txt"), 255), FM_ERR_ARG, "text vocab<256", "a.txt", "256", "255", NULL);
    CHECK(ds.parts == NULL && ds.n_tokens == 0);
}

static void test_shard_roundtrip(int version) {
    enum { N = 600000 }; /* spans several 1 MiB read/write chunks for both versions */
    int32_t *tok = malloc(sizeof(int32_t) * N);
    for (int i = 0; i < N; i++) tok[i] = (int32_t)((i * 7919u) % (version == 1 ? 65536u : 200000u));
    const char *p = tpath(version == 1 ? "v1.bin" : "v7.bin");
    fm_status s = fm_shard_write(p, tok, N, version);
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    CHECK(access(tpath(version == 1 ? "v1.bin.tmp" : "v7.bin.tmp"), F_OK) != 0); /* renamed away */
    FILE *f = fopen(p, "rb");
    long size = -1;
    if (f) { fseek(f, 0, SEEK_END); size = ftell(f); fclose(f); }
    CHECK(size == 1024 + (long)N * (version == 1 ? 2 : 4));

    fm_dataset ds;
    s = load1(&ds, p, version == 1 ? 65536 : 200000);
    CHECK_MSG(s == FM_OK, "v%d: %s", version, fm_errmsg());
    CHECK(ds.n_tokens == N);
    int32_t *back = malloc(sizeof(int32_t) * N);
    fm_dataset_tokens(&ds, 0, N, back);
    CHECK(memcmp(back, tok, sizeof(int32_t) * N) == 0);
    free(back);
    CHECK_MSG(strstr(ds.desc, "1 llm.c shard") && strstr(ds.desc, "600000 tokens"), "desc: %s", ds.desc);
    fm_dataset_free(&ds);

    /* The largest id must be < vocab_size: max id + 1 works, max id does not. */
    int32_t mx = 0;
    for (int i = 0; i < N; i++) if (tok[i] > mx) mx = tok[i];
    CHECK(load1(&ds, p, mx + 1) == FM_OK);
    fm_dataset_free(&ds);
    char idstr[32];
    snprintf(idstr, sizeof idstr, "id %d", mx);
    expect_err(load1(&ds, p, mx), FM_ERR_FORMAT, "id >= vocab", p, idstr, "vocab_size", NULL);
    free(tok);
}

static void test_shard_multi(void) {
    int32_t a[3] = {1, 2, 3}, b[2] = {70000, 5};
    CHECK(fm_shard_write(tpath("m1.bin"), a, 3, 1) == FM_OK);
    CHECK(fm_shard_write(tpath("m7.bin"), b, 2, 7) == FM_OK);
    const char *paths[2] = {tpath("m1.bin"), tpath("m7.bin")};
    fm_dataset ds;
    fm_status s = fm_dataset_load(&ds, paths, 2, 100000);
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    CHECK(ds.n_tokens == 5);
    CHECK(tok_at(&ds, 0) == 1 && tok_at(&ds, 2) == 3 && tok_at(&ds, 3) == 70000 && tok_at(&ds, 4) == 5);
    CHECK_MSG(strstr(ds.desc, "2 llm.c shards") != NULL, "desc: %s", ds.desc);
    fm_dataset_free(&ds);

    /* Writer argument checks. */
    int32_t big[1] = {65536}, neg[1] = {-1};
    expect_err(fm_shard_write(tpath("w.bin"), big, 1, 1), FM_ERR_ARG, "v1 id range", "65536", NULL);
    expect_err(fm_shard_write(tpath("w.bin"), neg, 1, 7), FM_ERR_ARG, "negative id", "-1", NULL);
    expect_err(fm_shard_write(tpath("w.bin"), a, 3, 2), FM_ERR_ARG, "bad version", "version 2", NULL);
    expect_err(fm_shard_write(tpath("w.bin"), a, 0, 1), FM_ERR_ARG, "n = 0", NULL);
    expect_err(fm_shard_write(tpath("nodir/w.bin"), a, 3, 1), FM_ERR_IO, "no dir", "nodir", NULL);
    CHECK(access(tpath("w.bin"), F_OK) != 0);

    /* Fault injection on the header write: error, no file, no .tmp left. */
    fm_fault_set(3); /* 2 allocations, then the header write */
    expect_err(fm_shard_write(tpath("f.bin"), a, 3, 1), FM_ERR_IO, "fault", "f.bin.tmp", NULL);
    fm_fault_set(0);
    CHECK(access(tpath("f.bin"), F_OK) != 0);
    CHECK(access(tpath("f.bin.tmp"), F_OK) != 0);
}

static void test_shard_errors(void) {
    static unsigned char img[1024 + 64];
    uint32_t ids[4] = {1, 2, 3, 4};
    fm_dataset ds;
    size_t n;

    n = make_shard(img, FM_SHARD_MAGIC_V1, 7, 4, 2, ids, 4, 0);
    write_raw(tpath("badver1.bin"), img, n);
    expect_err(load1(&ds, tpath("badver1.bin"), 100), FM_ERR_FORMAT, "v1 magic, version 7", "badver1.bin",
               "20240520", "version 1", "found version 7", NULL);

    n = make_shard(img, FM_SHARD_MAGIC_V7, 1, 4, 4, ids, 4, 0);
    write_raw(tpath("badver7.bin"), img, n);
    expect_err(load1(&ds, tpath("badver7.bin"), 100), FM_ERR_FORMAT, "v7 magic, version 1", "20240801",
               "version 7", "found version 1", NULL);

    /* Bad magic: a binary file with NULs whose first int32 is not a magic. */
    n = make_shard(img, 12345, 1, 4, 2, ids, 4, 0);
    write_raw(tpath("badmagic.bin"), img, n);
    expect_err(load1(&ds, tpath("badmagic.bin"), 100), FM_ERR_FORMAT, "bad magic", "badmagic.bin",
               "not UTF-8 text and not an llm.c shard", "first int32 = 12345", "20240520 or 20240801", NULL);

    n = make_shard(img, FM_SHARD_MAGIC_V1, 1, 4, 2, ids, 4, -1);
    write_raw(tpath("trunc.bin"), img, n);
    expect_err(load1(&ds, tpath("trunc.bin"), 100), FM_ERR_FORMAT, "truncated", "trunc.bin", "truncated",
               "1031", "1 missing", NULL);

    n = make_shard(img, FM_SHARD_MAGIC_V7, 7, 4, 4, ids, 4, 3);
    write_raw(tpath("trail.bin"), img, n);
    expect_err(load1(&ds, tpath("trail.bin"), 100), FM_ERR_FORMAT, "trailing", "trail.bin",
               "3 trailing bytes", "1040", NULL);

    n = make_shard(img, FM_SHARD_MAGIC_V1, 1, 0, 2, ids, 0, 0);
    write_raw(tpath("zero.bin"), img, n);
    expect_err(load1(&ds, tpath("zero.bin"), 100), FM_ERR_FORMAT, "count 0", "zero.bin", "header[2]", NULL);

    /* Header alone cut short: starts with the magic but < 1024 bytes. */
    n = make_shard(img, FM_SHARD_MAGIC_V1, 1, 4, 2, ids, 4, 0);
    write_raw(tpath("short.bin"), img, 100);
    expect_err(load1(&ds, tpath("short.bin"), 100), FM_ERR_FORMAT, "short header", "short.bin", "truncated",
               NULL);

    /* Token id >= vocab_size names file, index and id. */
    uint32_t bad[4] = {1, 2, 99, 4};
    n = make_shard(img, FM_SHARD_MAGIC_V7, 7, 4, 4, bad, 4, 0);
    write_raw(tpath("badid.bin"), img, n);
    expect_err(load1(&ds, tpath("badid.bin"), 50), FM_ERR_FORMAT, "id >= vocab", "badid.bin", "token 2",
               "id 99", "vocab_size is 50", NULL);
    CHECK(load1(&ds, tpath("badid.bin"), 100) == FM_OK);
    fm_dataset_free(&ds);
    /* A uint32 id above INT32_MAX is rejected, not wrapped negative. */
    uint32_t huge[4] = {1, 0xFFFFFFF0u, 3, 4};
    n = make_shard(img, FM_SHARD_MAGIC_V7, 7, 4, 4, huge, 4, 0);
    write_raw(tpath("huge.bin"), img, n);
    expect_err(load1(&ds, tpath("huge.bin"), (int64_t)1 << 31), FM_ERR_FORMAT, "huge id", "4294967280", NULL);
    CHECK(ds.parts == NULL && ds.n_tokens == 0);
}

static void test_other_errors(void) {
    fm_dataset ds;
    write_raw(tpath("empty.txt"), "", 0);
    expect_err(load1(&ds, tpath("empty.txt"), 256), FM_ERR_FORMAT, "empty", "empty.txt", "empty", NULL);

    write_raw(tpath("nul.txt"), "abc\0def", 7);
    expect_err(load1(&ds, tpath("nul.txt"), 256), FM_ERR_FORMAT, "NUL", "nul.txt",
               "not UTF-8 text and not an llm.c shard", "first int32 = 6513249", NULL);

    /* A NUL past the first 64 KiB is not looked for: the file loads as text. */
    size_t big = (64u << 10) + 10;
    char *t = malloc(big);
    memset(t, 'x', big);
    t[big - 3] = '\0';
    write_raw(tpath("latenul.txt"), t, big);
    free(t);
    CHECK(load1(&ds, tpath("latenul.txt"), 256) == FM_OK && ds.n_tokens == (int64_t)big);
    fm_dataset_free(&ds);

    expect_err(load1(&ds, tpath("missing.txt"), 256), FM_ERR_IO, "missing", "missing.txt",
               "No such file or directory", NULL);
    expect_err(load1(&ds, g_dir, 256), FM_ERR_IO, "directory", "directory", NULL);

    const char *none[1] = {NULL};
    expect_err(fm_dataset_load(&ds, none, 0, 256), FM_ERR_ARG, "n_paths 0", "no files", NULL);
    expect_err(load1(&ds, tpath("a.txt"), 0), FM_ERR_ARG, "vocab 0", "vocab_size", NULL);

    /* Mixing text and shards, in either order; a later missing file fails the whole load. */
    const char *mix1[2] = {tpath("a.txt"), tpath("m1.bin")};
    expect_err(fm_dataset_load(&ds, mix1, 2, 1000), FM_ERR_ARG, "mix text+shard", "a.txt", "m1.bin", "mix",
               NULL);
    const char *mix2[2] = {tpath("m1.bin"), tpath("a.txt")};
    expect_err(fm_dataset_load(&ds, mix2, 2, 1000), FM_ERR_ARG, "mix shard+text", "a.txt is text",
               "m1.bin holds token ids", NULL);
    const char *miss[2] = {tpath("a.txt"), tpath("nope.txt")};
    expect_err(fm_dataset_load(&ds, miss, 2, 256), FM_ERR_IO, "second missing", "nope.txt", NULL);
    CHECK(ds.parts == NULL && ds.n_tokens == 0);

    /* Allocation failure is reported, not crashed on. */
    fm_fault_set(1);
    expect_err(load1(&ds, tpath("a.txt"), 256), FM_ERR_NOMEM, "nomem", NULL);
    fm_fault_set(2); /* the part table, then the text's bytes */
    expect_err(load1(&ds, tpath("a.txt"), 256), FM_ERR_NOMEM, "nomem tokens", "6 bytes", NULL);
    fm_fault_set(0);
}

static fm_dataset iota_ds(int32_t *buf, int64_t n) {
    for (int64_t i = 0; i < n; i++) buf[i] = (int32_t)i;
    char desc[64];
    snprintf(desc, sizeof desc, "iota %lld", (long long)n);
    fm_dataset ds;
    CHECK(fm_dataset_from_tokens(&ds, buf, n, desc) == FM_OK);
    return ds;
}

static void test_split(void) {
    int32_t buf[1000];
    fm_dataset all = iota_ds(buf, 1000), tr, va;
    CHECK(fm_dataset_split(&all, 0.1, &tr, &va) == FM_OK);
    CHECK(tr.n_tokens == 900 && va.n_tokens == 100);
    CHECK(tok_at(&tr, 0) == 0 && tok_at(&va, 0) == 900 && tok_at(&va, 99) == 999 && va.begin == 900);
    CHECK(!tr.owns && !va.owns);
    CHECK_MSG(strstr(va.desc, "iota 1000") != NULL, "desc: %s", va.desc);
    fm_dataset_free(&tr); /* views free nothing */
    CHECK(buf[0] == 0);

    CHECK(fm_dataset_split(&all, 0.29, &tr, &va) == FM_OK && va.n_tokens == 290 && tr.n_tokens == 710);
    expect_err(fm_dataset_split(&all, 0.0, &tr, &va), FM_ERR_ARG, "f=0", "(0, 1)", NULL);
    expect_err(fm_dataset_split(&all, 1.0, &tr, &va), FM_ERR_ARG, "f=1", "(0, 1)", NULL);
    expect_err(fm_dataset_split(&all, 0.0 / 0.0, &tr, &va), FM_ERR_ARG, "f=nan", NULL);
    fm_dataset small = iota_ds(buf, 3);
    expect_err(fm_dataset_split(&small, 0.1, &tr, &va), FM_ERR_ARG, "empty val", "0 validation", NULL);
    expect_err(fm_dataset_split(&small, 0.9, &tr, &va), FM_ERR_ARG, "empty train", "0 training", NULL);
    CHECK(fm_dataset_split(&small, 0.5, &tr, &va) == FM_OK && tr.n_tokens + va.n_tokens == 3);

    CHECK(fm_dataset_check_windows(&all, 999, "training data") == FM_OK);
    expect_err(fm_dataset_check_windows(&all, 1000, "training data"), FM_ERR_ARG, "too short",
               "training data: 1000 tokens, but --seq-len 1000 needs at least 1001", "shorter --seq-len", NULL);
    fm_dataset v500 = iota_ds(buf, 500);
    expect_err(fm_dataset_check_windows(&v500, 1024, "validation data"), FM_ERR_ARG, "spec message",
               "validation data: 500 tokens, but --seq-len 1024 needs at least 1025; use a shorter --seq-len "
               "or more data", NULL);
    expect_err(fm_dataset_check_windows(&all, 0, "x"), FM_ERR_ARG, "seq_len 0", NULL);
    fm_dataset_free(&v500); /* their part tables (LeakSanitizer named them in the sanitized pass) */
    fm_dataset_free(&small);
    fm_dataset_free(&all);
}

static void test_batches(unsigned long long seed) {
    enum { N = 517, B = 6, T = 16 };
    int32_t buf[N];
    fm_dataset ds = iota_ds(buf, N);
    int32_t in1[B * T], tg1[B * T], in2[B * T], tg2[B * T];
    fm_rng r1, r2;
    fm_rng_seed(&r1, seed);
    fm_rng_seed(&r2, seed);
    fm_dataset_sample_batch(&ds, &r1, B, T, in1, tg1);
    fm_dataset_sample_batch(&ds, &r2, B, T, in2, tg2);
    CHECK(memcmp(in1, in2, sizeof in1) == 0 && memcmp(tg1, tg2, sizeof tg1) == 0);
    CHECK(r1.state == r2.state);
    int ok = 1;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            ok &= tg1[b * T + t] == in1[b * T + t] + 1;            /* shifted by one */
            if (t) ok &= in1[b * T + t] == in1[b * T + t - 1] + 1; /* contiguous */
            ok &= in1[b * T] >= 0 && in1[b * T] <= N - T - 1;
        }
    CHECK(ok);
    /* Starts follow the documented draw: fm_rng_below(rng, N - T), one per row in order. */
    fm_rng r3;
    fm_rng_seed(&r3, seed);
    ok = 1;
    for (int b = 0; b < B; b++) ok &= in1[b * T] == (int32_t)fm_rng_below(&r3, N - T);
    CHECK(ok);
    /* Resume: the saved RNG state continues the same stream. */
    fm_rng saved = r1;
    fm_dataset_sample_batch(&ds, &r1, B, T, in1, tg1);
    fm_dataset_sample_batch(&ds, &saved, B, T, in2, tg2);
    CHECK(memcmp(in1, in2, sizeof in1) == 0);
    fm_rng other;
    fm_rng_seed(&other, seed + 1);
    fm_dataset_sample_batch(&ds, &other, B, T, in2, tg2);
    CHECK(memcmp(in1, in2, sizeof in1) != 0);

    /* Extremes: n = T + 1 has exactly one start (0); both ends are reachable. */
    fm_dataset tiny = iota_ds(buf, T + 1);
    fm_dataset_sample_batch(&tiny, &r1, B, T, in1, tg1);
    ok = 1;
    for (int b = 0; b < B; b++) ok &= in1[b * T] == 0 && tg1[b * T + T - 1] == T;
    CHECK(ok);
    fm_dataset small = iota_ds(buf, T + 3); /* starts 0, 1, 2 */
    int seen[3] = {0, 0, 0};
    for (int k = 0; k < 200; k++) {
        fm_dataset_sample_batch(&small, &r1, 1, T, in1, tg1);
        if (in1[0] >= 0 && in1[0] < 3) seen[in1[0]]++;
        else seen[0] = -1000;
    }
    CHECK(seen[0] > 0 && seen[1] > 0 && seen[2] > 0);

    /* Eval windows: (N - 1) / T = 32 windows; batches of B walk them in order. */
    CHECK(fm_dataset_eval_windows(&ds, T) == (N - 1) / T);
    CHECK(fm_dataset_eval_windows(&tiny, T) == 1);
    fm_dataset one = iota_ds(buf, T);
    CHECK(fm_dataset_eval_windows(&one, T) == 0);
    int64_t nw = fm_dataset_eval_windows(&ds, T), w = 0, filled, calls = 0;
    ok = 1;
    while (w < nw) {
        for (int i = 0; i < B * T; i++) in1[i] = -7;
        fm_dataset_eval_batch(&ds, w, B, T, in1, tg1, &filled);
        ok &= filled >= 1 && filled <= B;
        for (int64_t b = 0; b < filled; b++)
            for (int t = 0; t < T; t++)
                ok &= in1[b * T + t] == (int32_t)((w + b) * T + t) && tg1[b * T + t] == in1[b * T + t] + 1;
        for (int64_t b = filled; b < B; b++) ok &= in1[b * T] == -7; /* untouched */
        w += filled;
        calls++;
    }
    CHECK(ok);
    CHECK(w == 32 && calls == 6); /* 5 full batches of 6, then 2 */
    fm_dataset_eval_batch(&ds, nw, B, T, in1, tg1, &filled);
    CHECK(filled == 0);
    /* The last window's final target is the last token it may use. */
    fm_dataset_eval_batch(&ds, nw - 1, B, T, in1, tg1, &filled);
    CHECK(filled == 1 && tg1[T - 1] == (int32_t)(nw * T) && nw * T <= N - 1);
    fm_dataset_free(&one);
    fm_dataset_free(&small);
    fm_dataset_free(&tiny);
    fm_dataset_free(&ds);
}

static void test_tinyshakespeare(void) {
    const char *root = getenv("FLATMOE_SOURCE_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/../shared/data/tinyshakespeare.txt", root ? root : ".");
    if (access(path, R_OK) != 0) {
        printf("note: %s not present; skipping the real-text check\n", path);
        return;
    }
    fm_dataset ds, tr, va;
    fm_status s = load1(&ds, path, 256);
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    CHECK(ds.n_tokens == 1115394);
    CHECK_MSG(strcmp(ds.desc, "1 text file, 1115394 tokens (bytes)") == 0, "desc: %s", ds.desc);
    const char *head = "First Citizen:";
    int ok = ds.parts != NULL;
    for (int i = 0; ok && head[i]; i++) ok &= tok_at(&ds, i) == head[i];
    CHECK(ok);
    CHECK(fm_dataset_split(&ds, 0.1, &tr, &va) == FM_OK);
    CHECK(va.n_tokens == 111539 && tr.n_tokens == 1115394 - 111539);
    CHECK(fm_dataset_check_windows(&va, 1024, "validation data") == FM_OK);
    printf("tinyshakespeare: %s; %s\n", ds.desc, va.desc);
    fm_dataset_free(&ds);
}

/* ---- loss masks ----------------------------------------------------------------------------- */

static void put64(unsigned char *p, uint64_t v) { put32(p, (uint32_t)v); put32(p + 4, (uint32_t)(v >> 32)); }

static void test_masks(void) {
    enum { N = 300, B = 4, T = 20 };
    int32_t tok[N];
    uint8_t mask[N];
    for (int i = 0; i < N; i++) { tok[i] = (i * 37) % 1000; mask[i] = (uint8_t)((i / 7) % 3 != 0); }
    CHECK(fm_shard_write(tpath("mk.bin"), tok, N, 7) == FM_OK);
    CHECK(fm_mask_write(tpath("mk.bin.mask"), mask, N) == FM_OK);
    fm_dataset ds;
    fm_status s = load1(&ds, tpath("mk.bin"), 1000);
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    CHECK(ds.has_mask);
    CHECK_MSG(strstr(ds.desc, "loss mask on 1 of 1") != NULL, "desc: %s", ds.desc);
    int ok = 1;
    for (int i = 0; i < N; i++) ok &= fm_dataset_mask_at(&ds, i) == mask[i];
    CHECK(ok);
    int32_t in[B * T], tg[B * T];
    fm_rng r;
    fm_rng_seed(&r, 99);
    int n_ign = 0, n_kept = 0;
    for (int k = 0; k < 20; k++) {
        fm_rng before = r;
        fm_dataset_sample_batch(&ds, &r, B, T, in, tg);
        for (int b = 0; b < B; b++) {
            int64_t st = (int64_t)fm_rng_below(&before, N - T);
            for (int t = 0; t < T; t++) {
                ok &= in[b * T + t] == tok[st + t]; /* inputs are never masked */
                int32_t want = mask[st + t + 1] ? tok[st + t + 1] : FM_IGNORE_INDEX;
                ok &= tg[b * T + t] == want;
                n_ign += tg[b * T + t] == FM_IGNORE_INDEX;
                n_kept += tg[b * T + t] != FM_IGNORE_INDEX;
            }
        }
    }
    CHECK(ok && n_ign > 0 && n_kept > 0);
    /* eval windows are masked the same way */
    int64_t filled;
    fm_dataset_eval_batch(&ds, 1, B, T, in, tg, &filled);
    ok = filled == B;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            int64_t i = (1 + b) * T + t + 1;
            ok &= tg[b * T + t] == (mask[i] ? tok[i] : FM_IGNORE_INDEX) && in[b * T + t] == tok[i - 1];
        }
    CHECK(ok);
    fm_dataset_free(&ds);

    /* The other sidecar name: data.mask next to data.bin. */
    CHECK(fm_shard_write(tpath("mk2.bin"), tok, N, 1) == FM_OK);
    CHECK(fm_mask_write(tpath("mk2.mask"), mask, N) == FM_OK);
    CHECK(load1(&ds, tpath("mk2.bin"), 1000) == FM_OK && ds.has_mask && fm_dataset_mask_at(&ds, 0) == mask[0]);
    fm_dataset_free(&ds);
    /* A shard without a mask, next to one with: every target of it counts. */
    CHECK(fm_shard_write(tpath("nomask.bin"), tok, N, 7) == FM_OK);
    const char *two[2] = {tpath("nomask.bin"), tpath("mk.bin")};
    CHECK(fm_dataset_load(&ds, two, 2, 1000) == FM_OK);
    ok = 1;
    for (int i = 0; i < N; i++) ok &= fm_dataset_mask_at(&ds, i) == 1 && fm_dataset_mask_at(&ds, N + i) == mask[i];
    CHECK(ok);
    fm_dataset_free(&ds);

    /* Bad mask files. */
    static unsigned char img[16 + N + 8];
    memcpy(img, "FMMASK01", 8);
    put64(img + 8, N);
    memcpy(img + 16, mask, N);
    CHECK(fm_shard_write(tpath("bm.bin"), tok, N, 7) == FM_OK);
    img[0] = 'X';
    write_raw(tpath("bm.bin.mask"), img, 16 + N);
    expect_err(load1(&ds, tpath("bm.bin"), 1000), FM_ERR_FORMAT, "mask magic", "bm.bin.mask", "FMMASK01", NULL);
    img[0] = 'F';
    put64(img + 8, N - 1);
    write_raw(tpath("bm.bin.mask"), img, 16 + N - 1);
    expect_err(load1(&ds, tpath("bm.bin"), 1000), FM_ERR_FORMAT, "mask count", "bm.bin.mask", "299 tokens",
               "300 tokens", NULL);
    put64(img + 8, N);
    write_raw(tpath("bm.bin.mask"), img, 16 + N + 3);
    expect_err(load1(&ds, tpath("bm.bin"), 1000), FM_ERR_FORMAT, "mask size", "bm.bin.mask", "316 bytes",
               "found 319", NULL);
    img[16 + 123] = 2;
    write_raw(tpath("bm.bin.mask"), img, 16 + N);
    expect_err(load1(&ds, tpath("bm.bin"), 1000), FM_ERR_FORMAT, "mask byte", "bm.bin.mask", "byte 123", "is 2",
               NULL);
    write_raw(tpath("bm.bin.mask"), img, 5);
    expect_err(load1(&ds, tpath("bm.bin"), 1000), FM_ERR_FORMAT, "mask short", "bm.bin.mask", "16-byte header",
               NULL);
    CHECK(ds.parts == NULL && ds.n_tokens == 0);
    uint8_t two_b[2] = {1, 2};
    expect_err(fm_mask_write(tpath("w.mask"), two_b, 2), FM_ERR_ARG, "mask write 2", "byte 1", NULL);
}

/* ---- Megatron indexed data sets -------------------------------------------------------------- */

/* Writes PREFIX.bin and PREFIX.idx (dtype code `code`, element size es) holding tok split into
 * sequences of the given sizes; `gap` adds bytes between sequence 0 and 1 (not back to back). */
static void write_megatron(const char *prefix, int code, int es, const int32_t *tok, const int *sizes, int S,
                           int gap, uint64_t version) {
    char p[300];
    snprintf(p, sizeof p, "%s.bin", prefix);
    FILE *f = fopen(p, "wb");
    int64_t ptr = 0, ptrs[64];
    int at = 0;
    for (int i = 0; i < S; i++) {
        ptrs[i] = ptr;
        for (int k = 0; k < sizes[i]; k++, at++) {
            unsigned char e[8] = {0};
            put64(e, (uint64_t)(int64_t)tok[at]);
            fwrite(e, 1, (size_t)es, f);
        }
        ptr += (int64_t)sizes[i] * es;
        if (i == 0 && gap) { for (int g = 0; g < gap; g++) fputc(0, f); ptr += gap; }
    }
    fclose(f);
    snprintf(p, sizeof p, "%s.idx", prefix);
    f = fopen(p, "wb");
    unsigned char h[34];
    memcpy(h, "MMIDIDX\0\0", 9);
    put64(h + 9, version);
    h[17] = (unsigned char)code;
    put64(h + 18, (uint64_t)S);
    put64(h + 26, (uint64_t)(S + 1));
    fwrite(h, 1, 34, f);
    for (int i = 0; i < S; i++) { unsigned char e[4]; put32(e, (uint32_t)sizes[i]); fwrite(e, 1, 4, f); }
    for (int i = 0; i < S; i++) { unsigned char e[8]; put64(e, (uint64_t)ptrs[i]); fwrite(e, 1, 8, f); }
    for (int i = 0; i <= S; i++) { unsigned char e[8]; put64(e, (uint64_t)i); fwrite(e, 1, 8, f); }
    fclose(f);
}

static void test_megatron(void) {
    enum { N = 1000 };
    int32_t tok[N];
    for (int i = 0; i < N; i++) tok[i] = (i * 7919) % 50000;
    const int sizes[5] = {100, 1, 499, 250, 150};
    CHECK(fm_shard_write(tpath("same.bin"), tok, N, 1) == FM_OK);
    fm_dataset ref, ds;
    CHECK(load1(&ref, tpath("same.bin"), 50000) == FM_OK);
    int32_t a[N], b[N];
    fm_dataset_tokens(&ref, 0, N, a);
    const int codes[3] = {8, 4, 5}, ess[3] = {2, 4, 8}; /* uint16, int32, int64 */
    for (int c = 0; c < 3; c++) {
        char prefix[256];
        snprintf(prefix, sizeof prefix, "%s", tpath(c == 0 ? "mega16" : c == 1 ? "mega32" : "mega64"));
        write_megatron(prefix, codes[c], ess[c], tok, sizes, 5, 0, 1);
        const char *names[3] = {"", ".bin", ".idx"};
        for (int k = 0; k < 3; k++) {
            char p[300];
            snprintf(p, sizeof p, "%s%s", prefix, names[k]);
            fm_status s = load1(&ds, p, 50000);
            CHECK_MSG(s == FM_OK, "%s: %s", p, fm_errmsg());
            if (s != FM_OK) continue;
            CHECK(ds.n_tokens == N);
            fm_dataset_tokens(&ds, 0, N, b);
            CHECK_MSG(memcmp(a, b, sizeof a) == 0, "%s: tokens differ from the llm.c shard's", p);
            CHECK_MSG(strstr(ds.desc, "1 Megatron data set") != NULL, "desc: %s", ds.desc);
            /* its documents: doc_idx 0..5 over sequences of 100, 1, 499, 250, 150 tokens */
            CHECK(ds.docs && ds.n_docs == 5 && ds.docs[0] == 0 && ds.docs[1] == 100 && ds.docs[2] == 101 &&
                  ds.docs[3] == 600 && ds.docs[4] == 850 && fm_dataset_doc_len(&ds, 4) == 150);
            /* same windows as the shard */
            int32_t i1[3 * 50], t1[3 * 50], i2[3 * 50], t2[3 * 50];
            fm_rng r1, r2;
            fm_rng_seed(&r1, 5);
            fm_rng_seed(&r2, 5);
            fm_dataset_sample_batch(&ref, &r1, 3, 50, i1, t1);
            fm_dataset_sample_batch(&ds, &r2, 3, 50, i2, t2);
            CHECK(!memcmp(i1, i2, sizeof i1) && !memcmp(t1, t2, sizeof t1));
            fm_dataset_free(&ds);
        }
    }
    /* A mask sidecar on a Megatron prefix. */
    uint8_t mask[N];
    for (int i = 0; i < N; i++) mask[i] = (uint8_t)(i % 2);
    CHECK(fm_mask_write(tpath("mega16.mask"), mask, N) == FM_OK);
    CHECK(load1(&ds, tpath("mega16"), 50000) == FM_OK && ds.has_mask && fm_dataset_mask_at(&ds, 3) == 1 &&
          fm_dataset_mask_at(&ds, 4) == 0);
    fm_dataset_free(&ds);
    /* Errors. */
    write_megatron(tpath("mbad"), 8, 2, tok, sizes, 5, 0, 2);
    expect_err(load1(&ds, tpath("mbad"), 50000), FM_ERR_FORMAT, "mega version", "mbad.idx", "version 2", NULL);
    write_megatron(tpath("mbad"), 7, 4, tok, sizes, 5, 0, 1);
    expect_err(load1(&ds, tpath("mbad"), 50000), FM_ERR_FORMAT, "mega float", "mbad.idx", "dtype code 7", NULL);
    write_megatron(tpath("mbad"), 8, 2, tok, sizes, 5, 6, 1);
    expect_err(load1(&ds, tpath("mbad"), 50000), FM_ERR_FORMAT, "mega gap", "mbad.idx", "sequence 1", "back to back",
               NULL);
    write_megatron(tpath("mbad"), 8, 2, tok, sizes, 5, 0, 1);
    expect_err(load1(&ds, tpath("mbad"), 1000), FM_ERR_FORMAT, "mega vocab", "mbad.bin", "vocab_size is 1000", NULL);
    write_raw(tpath("mbad.bin"), tok, 10);
    expect_err(load1(&ds, tpath("mbad.bin"), 50000), FM_ERR_FORMAT, "mega bin size", "mbad.bin", "10 bytes",
               "2000 bytes", NULL);
    CHECK(ds.parts == NULL);
    fm_dataset_free(&ref);
}

/* ---- memory: a mapped shard costs no RSS ------------------------------------------------------ */

static long vm_rss_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6)) kb = strtol(line + 6, NULL, 10);
    fclose(f);
    return kb;
}

static void test_mmap_rss(void) {
    enum { CH = 1 << 20 };
    const int64_t n = 50 * (int64_t)CH; /* 50M uint32 tokens: a 200 MB shard */
    const char *p = tpath("big.bin");
    FILE *f = fopen(p, "wb");
    unsigned char hdr[1024] = {0};
    put32(hdr, FM_SHARD_MAGIC_V7);
    put32(hdr + 4, 7);
    put32(hdr + 8, (uint32_t)n);
    fwrite(hdr, 1, sizeof hdr, f);
    uint32_t *chunk = malloc(sizeof(uint32_t) * CH);
    for (int64_t c = 0; c < n / CH; c++) {
        for (int i = 0; i < CH; i++) chunk[i] = (uint32_t)((c * CH + i) % 100003);
        fwrite(chunk, sizeof(uint32_t), CH, f);
    }
    free(chunk);
    fclose(f);
    long before = vm_rss_kib();
    fm_dataset ds;
    fm_status s = load1(&ds, p, 100003);
    long after = vm_rss_kib();
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    CHECK(ds.n_tokens == n);
    /* draw a few windows: their pages come in, but not the file */
    int32_t in[8 * 512], tg[8 * 512];
    fm_rng r;
    fm_rng_seed(&r, 1);
    int ok = 1;
    for (int k = 0; k < 50; k++) {
        fm_rng b4 = r;
        fm_dataset_sample_batch(&ds, &r, 8, 512, in, tg);
        int64_t st = (int64_t)fm_rng_below(&b4, (uint64_t)(n - 512));
        ok &= in[0] == (int32_t)(st % 100003) && tg[0] == (int32_t)((st + 1) % 100003);
    }
    CHECK(ok);
    long sampled = vm_rss_kib();
    printf("mmap: VmRSS %ld KiB before loading a %lld MB shard, %ld KiB after, %ld KiB after 400 windows\n", before,
           (long long)(n * 4 / 1000000), after, sampled);
    CHECK_MSG(before > 0 && after - before < 16 * 1024, "loading grew RSS by %ld KiB", after - before);
    CHECK_MSG(sampled - before < 32 * 1024, "sampling grew RSS by %ld KiB", sampled - before);
    fm_dataset_free(&ds);
    remove(p);
}

/* ---- the rank-aware cursor -------------------------------------------------------------------- */

static void test_ranks(void) {
    enum { N = 2000, B = 3, T = 10, W = 4 };
    static int32_t buf[N];
    fm_dataset ds = iota_ds(buf, N);
    int32_t all_in[W * B * T], all_tg[W * B * T], in[B * T], tg[B * T];
    fm_rng r0;
    fm_rng_seed(&r0, 42);
    fm_rng g = r0;
    fm_dataset_sample_batch(&ds, &g, W * B, T, all_in, all_tg); /* one rank, the global batch */
    int ok = 1;
    for (int rank = 0; rank < W; rank++) {
        CHECK(fm_dataset_set_ranks(&ds, rank, W) == FM_OK);
        fm_rng r = r0;
        fm_dataset_sample_batch(&ds, &r, B, T, in, tg);
        ok &= !memcmp(in, all_in + rank * B * T, sizeof in) && !memcmp(tg, all_tg + rank * B * T, sizeof tg);
        ok &= r.state == g.state; /* every rank's cursor advances the same */
    }
    CHECK(ok);
    expect_err(fm_dataset_set_ranks(&ds, 4, 4), FM_ERR_ARG, "rank 4 of 4", "rank 4 of 4", NULL);
    expect_err(fm_dataset_set_ranks(&ds, 0, 0), FM_ERR_ARG, "0 ranks", NULL);
    fm_dataset_free(&ds);
}

/* ---- document indexes (fm_data.h "Document index") ------------------------------------------ */

static void test_docs(void) {
    enum { N = 300 };
    int32_t tok[N];
    for (int i = 0; i < N; i++) tok[i] = i % 251;
    CHECK(fm_shard_write(tpath("docs.bin"), tok, N, 1) == FM_OK);
    const int64_t st[4] = {0, 17, 18, 200};
    CHECK(fm_docs_write(tpath("docs.docs"), st, 4, N) == FM_OK); /* found as .bin -> .docs */
    fm_dataset ds, tr, va;
    CHECK(load1(&ds, tpath("docs.bin"), 256) == FM_OK);
    CHECK(ds.n_docs == 4 && ds.docs[3] == 200 && fm_dataset_doc_len(&ds, 3) == 100);
    CHECK_MSG(strstr(ds.desc, "4 documents") != NULL, "desc: %s", ds.desc);
    /* a split: the validation view starts a document at its first token */
    CHECK(fm_dataset_split(&ds, 0.2, &tr, &va) == FM_OK);
    CHECK(tr.n_docs == 4 && va.n_docs == 1 && va.docs[0] == 0 && fm_dataset_doc_len(&va, 0) == 60);
    fm_dataset_free(&tr), fm_dataset_free(&va), fm_dataset_free(&ds);
    /* two shards, one without an index: one document */
    CHECK(fm_shard_write(tpath("plain.bin"), tok, 50, 1) == FM_OK);
    const char *two[2] = {tpath("plain.bin"), NULL};
    char first[256];
    snprintf(first, sizeof first, "%s", two[0]);
    two[0] = first;
    two[1] = tpath("docs.bin");
    CHECK(fm_dataset_load(&ds, two, 2, 256) == FM_OK);
    CHECK(ds.n_docs == 5 && ds.docs[0] == 0 && ds.docs[1] == 50 && ds.docs[4] == 250);
    fm_dataset_free(&ds);
    /* errors: each names the file and the fix */
    const int64_t back[3] = {0, 20, 19};
    expect_err(fm_docs_write(tpath("bad.docs"), back, 3, N), FM_ERR_FORMAT, "docs order", "document 2", NULL);
    CHECK(fm_docs_write(tpath("docs.docs"), st, 4, N - 1) == FM_OK); /* another token count */
    expect_err(load1(&ds, tpath("docs.bin"), 256), FM_ERR_FORMAT, "docs count", "docs.docs", "299 tokens",
               "prepare both again", NULL);
    FILE *f = fopen(tpath("docs.docs"), "wb");
    fputs("FMDOCS02 and more bytes than a header", f);
    fclose(f);
    expect_err(load1(&ds, tpath("docs.bin"), 256), FM_ERR_FORMAT, "docs magic", "not a document index", NULL);
    CHECK(fm_docs_write(tpath("docs.docs"), st, 4, N) == FM_OK);
    f = fopen(tpath("docs.docs"), "r+b");
    fseek(f, 24 + 8 * 3, SEEK_SET);
    unsigned char big[8] = {0x2c, 0x01, 0, 0, 0, 0, 0, 0}; /* 300: not below the token count */
    fwrite(big, 1, 8, f);
    fclose(f);
    expect_err(load1(&ds, tpath("docs.bin"), 256), FM_ERR_FORMAT, "docs range", "document 3", "300", NULL);
    CHECK(truncate(tpath("docs.docs"), 24 + 8 * 2) == 0);
    expect_err(load1(&ds, tpath("docs.bin"), 256), FM_ERR_FORMAT, "docs truncated", "truncated", NULL);
    CHECK(ds.parts == NULL);
    remove(tpath("docs.docs"));
}

int main(void) {
    unsigned long long seed = fm_test_seed(1234);
    snprintf(g_dir, sizeof g_dir, "/tmp/fm_test_data_XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    test_text();
    test_shard_roundtrip(1);
    test_shard_roundtrip(7);
    test_shard_multi();
    test_shard_errors();
    test_other_errors();
    test_split();
    test_batches(seed);
    test_tinyshakespeare();
    test_masks();
    test_megatron();
    test_docs();
    test_ranks();
    test_mmap_rss();
    int rc = fm_test_finish();
    if (rc == 0) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
        if (system(cmd) != 0) fprintf(stderr, "note: could not remove %s\n", g_dir);
    } else {
        printf("test files kept in %s\n", g_dir);
    }
    return rc;
}
