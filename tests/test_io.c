/* Tests of src/io: safetensors read/write (roundtrip, dtype conversion, every malformed-header
 * case, shape and name errors) and checkpoint folders (layout, find-latest, and fault injection:
 * every failed write leaves the previous checkpoint byte-identical and findable).
 * Works in a fresh folder under /tmp, removed at the end. */
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
static const char *tpath(const char *name) {
    static char buf[8][512];
    static int k = 0;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}

static bool exists(const char *p) {
    struct stat sb;
    return lstat(p, &sb) == 0;
}

static bool msg_has(const char *s) { return strstr(fm_errmsg(), s) != NULL; }

static void write_bytes(const char *p, const void *data, size_t n) {
    FILE *f = fopen(p, "wb");
    if (!f) { perror(p); exit(2); }
    if (n) fwrite(data, 1, n, f);
    fclose(f);
}

/* Whole file in malloc'd memory; NULL if missing. */
static unsigned char *read_all(const char *p, size_t *n) {
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

static bool same_file(const char *p, const unsigned char *data, size_t n) {
    size_t m;
    unsigned char *b = read_all(p, &m);
    bool same = b && m == n && memcmp(b, data, n) == 0;
    free(b);
    return same;
}

/* A safetensors file from a raw header string and raw data bytes. */
static void make_st(const char *p, const char *header, const void *data, size_t ndata) {
    size_t hl = strlen(header);
    unsigned char *b = malloc(8 + hl + ndata + 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, header, hl);
    if (ndata) memcpy(b + 8 + hl, data, ndata);
    write_bytes(p, b, 8 + hl + ndata);
    free(b);
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}
static void rm_rf(const char *p) { nftw(p, rm_cb, 16, FTW_DEPTH | FTW_PHYS); }

/* Entries of `dir` whose name starts with ".tmp" or ends with ".tmp", recursively. */
static int count_tmp(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        size_t l = strlen(de->d_name);
        if (!strncmp(de->d_name, ".tmp", 4) || (l > 4 && !strcmp(de->d_name + l - 4, ".tmp"))) n++;
        char sub[1024];
        snprintf(sub, sizeof sub, "%s/%s", dir, de->d_name);
        struct stat sb;
        if (lstat(sub, &sb) == 0 && S_ISDIR(sb.st_mode)) n += count_tmp(sub);
    }
    closedir(d);
    return n;
}

static uint32_t g_lcg;
static float rnd(void) {
    g_lcg = g_lcg * 1664525u + 1013904223u;
    return (float)(g_lcg >> 8) / 16777216.0f * 2.0f - 1.0f;
}

static float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ------------------------------------------------------------------------------------------ */

static void test_roundtrip(void) {
    float emb[15], head[8], scalar = 3.25f;
    for (int i = 0; i < 15; i++) emb[i] = rnd();
    emb[0] = bits_f(0x7fc01234u); /* NaN with payload */
    emb[1] = -0.0f;
    emb[2] = bits_f(0xff800000u); /* -inf */
    emb[3] = bits_f(0x00000001u); /* smallest subnormal */
    for (int i = 0; i < 8; i++) head[i] = rnd() * 1e30f;
    fm_named_tensor t[4] = {
        {"model.embed_tokens.weight", emb, 2, {3, 5}},
        {"lm_head.weight", head, 2, {2, 4}},
        {"scalar", &scalar, 0, {0}},
        {"empty", NULL, 2, {0, 7}},
    };
    const char *meta[] = {"note", "quote \" backslash \\ newline \n tab \t", "step", "7", NULL};
    char p[600];
    snprintf(p, sizeof p, "%s/%s", g_dir, "rt.safetensors");
    CHECK(fm_st_write(p, t, 4, meta) == FM_OK);
    CHECK(!exists(tpath("rt.safetensors.tmp")));

    /* Layout: 8-byte length, '{', header padded to a multiple of 8, packed data. */
    size_t n;
    unsigned char *b = read_all(p, &n);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | b[i];
    CHECK(hl % 8 == 0);
    CHECK(b[8] == '{');
    CHECK(n == 8 + hl + (15 + 8 + 1) * 4);
    free(b);

    fm_safetensors st;
    CHECK(fm_st_open(&st, p) == FM_OK);
    CHECK(st.n_tensors == 4);
    for (int i = 0; i < 4 && st.n_tensors == 4; i++) {
        CHECK(strcmp(st.tensors[i].name, t[i].name) == 0); /* order kept */
        CHECK(st.tensors[i].dtype == FM_ST_F32);
        CHECK(st.tensors[i].ndim == t[i].ndim);
    }
    const fm_st_tensor *e = fm_st_find(&st, "model.embed_tokens.weight");
    CHECK(e && e->begin == 0 && e->end == 60 && e->shape[0] == 3 && e->shape[1] == 5);
    e = fm_st_find(&st, "lm_head.weight");
    CHECK(e && e->begin == 60 && e->end == 92);
    CHECK(fm_st_find(&st, "nope") == NULL);
    CHECK(fm_st_find(&st, "empty") && fm_st_find(&st, "empty")->begin == fm_st_find(&st, "empty")->end);

    float emb2[15], head2[8], scalar2 = 0;
    int64_t s_emb[2] = {3, 5}, s_head[2] = {2, 4}, s_empty[2] = {0, 7};
    CHECK(fm_st_read_f32(&st, "model.embed_tokens.weight", emb2, 2, s_emb) == FM_OK);
    CHECK(memcmp(emb, emb2, sizeof emb) == 0);
    CHECK(fm_st_read_f32(&st, "lm_head.weight", head2, 2, s_head) == FM_OK);
    CHECK(memcmp(head, head2, sizeof head) == 0);
    CHECK(fm_st_read_f32(&st, "scalar", &scalar2, 0, NULL) == FM_OK);
    CHECK(scalar2 == 3.25f);
    CHECK(fm_st_read_f32(&st, "empty", NULL, 2, s_empty) == FM_OK);
    CHECK(fm_st_metadata(&st, "format") && strcmp(fm_st_metadata(&st, "format"), "pt") == 0);
    CHECK(fm_st_metadata(&st, "note") && strcmp(fm_st_metadata(&st, "note"), meta[1]) == 0);
    CHECK(fm_st_metadata(&st, "step") && strcmp(fm_st_metadata(&st, "step"), "7") == 0);
    CHECK(fm_st_metadata(&st, "absent") == NULL);
    fm_st_close(&st);
    fm_st_close(&st); /* idempotent */
    CHECK(st.fd == -1 && st.tensors == NULL);

    /* Overwriting replaces the file; a caller-supplied "format" is kept as given. */
    head[0] = 42.0f;
    const char *meta2[] = {"format", "flatmoe", NULL};
    CHECK(fm_st_write(p, t + 1, 1, meta2) == FM_OK);
    CHECK(fm_st_open(&st, p) == FM_OK);
    CHECK(st.n_tensors == 1);
    CHECK(fm_st_read_f32(&st, "lm_head.weight", head2, 2, s_head) == FM_OK);
    CHECK(head2[0] == 42.0f);
    CHECK(fm_st_metadata(&st, "format") && strcmp(fm_st_metadata(&st, "format"), "flatmoe") == 0);
    fm_st_close(&st);

    /* Zero tensors is a valid file. */
    CHECK(fm_st_write(p, NULL, 0, NULL) == FM_OK);
    CHECK(fm_st_open(&st, p) == FM_OK);
    CHECK(st.n_tensors == 0);
    fm_st_close(&st);

    /* Many tensors: lookup by name is a binary search over a sorted index. */
    enum { M = 300 };
    static float vals[M];
    static fm_named_tensor many[M];
    static char names[M][32];
    for (int i = 0; i < M; i++) {
        vals[i] = (float)i;
        snprintf(names[i], sizeof names[i], "t.%d", (i * 7919) % M);
        many[i] = (fm_named_tensor){names[i], &vals[i], 1, {1}};
    }
    CHECK(fm_st_write(p, many, M, NULL) == FM_OK);
    CHECK(fm_st_open(&st, p) == FM_OK);
    int found = 0;
    for (int i = 0; i < M; i++) {
        float v = -1;
        int64_t one = 1;
        if (fm_st_read_f32(&st, names[i], &v, 1, &one) == FM_OK && v == (float)i) found++;
    }
    CHECK(found == M);
    fm_st_close(&st);
}

static void put16(unsigned char *b, uint16_t v) { b[0] = (unsigned char)v; b[1] = (unsigned char)(v >> 8); }

static void test_conversions(void) {
    unsigned char data[56] = {0};
    uint16_t bf[4] = {0x3F80, 0xC000, 0x3EAB, 0x7F80};
    uint16_t hf[6] = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x8000, 0x3555};
    double df[3] = {1.5, -3.25, 0.1};
    int32_t iv = 7;
    for (int i = 0; i < 4; i++) put16(data + 2 * i, bf[i]);
    for (int i = 0; i < 6; i++) put16(data + 8 + 2 * i, hf[i]);
    memcpy(data + 24, df, 24); /* bytes 20..24 are a hole, which readers accept */
    memcpy(data + 48, &iv, 4);
    const char *hdr =
        "{\"b\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,8]},"
        "\"h\":{\"dtype\":\"F16\",\"shape\":[2,3],\"data_offsets\":[8,20]},"
        "\"d\":{\"dtype\":\"F64\",\"shape\":[3],\"data_offsets\":[24,48]},"
        "\"i\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[48,52]},"
        "\"__metadata__\":{\"k\":\"v\"}}   ";
    char p[600];
    snprintf(p, sizeof p, "%s/%s", g_dir, "conv.safetensors");
    make_st(p, hdr, data, sizeof data);
    fm_safetensors st;
    CHECK(fm_st_open(&st, p) == FM_OK);
    CHECK(st.n_tensors == 4 && st.n_meta == 1);
    CHECK(fm_st_find(&st, "b") && fm_st_find(&st, "b")->dtype == FM_ST_BF16);
    CHECK(fm_st_find(&st, "h") && fm_st_find(&st, "h")->dtype == FM_ST_F16);
    CHECK(fm_st_find(&st, "d") && fm_st_find(&st, "d")->dtype == FM_ST_F64);
    CHECK(fm_st_find(&st, "i") && fm_st_find(&st, "i")->dtype == FM_ST_I32);
    float o[6];
    int64_t s4 = 4, s23[2] = {2, 3}, s3 = 3, s1 = 1;
    CHECK(fm_st_read_f32(&st, "b", o, 1, &s4) == FM_OK);
    CHECK(o[0] == 1.0f && o[1] == -2.0f && o[2] == 0.333984375f && isinf(o[3]) && o[3] > 0);
    CHECK(fm_st_read_f32(&st, "h", o, 2, s23) == FM_OK);
    CHECK(o[0] == 1.0f && o[1] == -2.0f && o[2] == 65504.0f);
    CHECK(o[3] == 0x1p-24f);
    CHECK(o[4] == 0.0f && signbit(o[4]));
    CHECK(o[5] == 0.333251953125f);
    CHECK(fm_st_read_f32(&st, "d", o, 1, &s3) == FM_OK);
    CHECK(o[0] == 1.5f && o[1] == -3.25f && o[2] == (float)0.1);
    CHECK(fm_st_read_f32(&st, "i", o, 1, &s1) == FM_ERR_FORMAT);
    CHECK(msg_has("'i'") && msg_has("I32") && msg_has(p));
    fm_st_close(&st);

    /* The layout of the reference serializer (huggingface/safetensors tensor.rs, test
     * "serialization_forced_alignement"): no metadata, header padded with spaces to 8 bytes. */
    float ref[6] = {0, 1, 2, 3, 4, 5}, got[6];
    int64_t s1123[4] = {1, 1, 2, 3};
    make_st(p, "{\"attn0\":{\"dtype\":\"F32\",\"shape\":[1,1,2,3],\"data_offsets\":[0,24]}}       ", ref, 24);
    CHECK(fm_st_open(&st, p) == FM_OK);
    CHECK(st.n_meta == 0 && st.data_start == 80);
    CHECK(fm_st_read_f32(&st, "attn0", got, 4, s1123) == FM_OK && !memcmp(got, ref, sizeof ref));
    fm_st_close(&st);
    /* NUL padding, as some other writers do, is accepted too. */
    {
        unsigned char nulpad[8 + 8] = {8, 0, 0, 0, 0, 0, 0, 0, '{', '}', 0, 0, 0, 0, 0, 0};
        write_bytes(p, nulpad, sizeof nulpad);
    }
    CHECK(fm_st_open(&st, p) == FM_OK && st.n_tensors == 0);
    fm_st_close(&st);

    /* F16 specials: inf, NaN, largest subnormal, smallest normal. */
    uint16_t sp[4] = {0xFC00, 0x7E00, 0x03FF, 0x0400};
    unsigned char d2[8];
    for (int i = 0; i < 4; i++) put16(d2 + 2 * i, sp[i]);
    make_st(p, "{\"s\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]}}", d2, 8);
    CHECK(fm_st_open(&st, p) == FM_OK);
    CHECK(fm_st_read_f32(&st, "s", o, 1, &s4) == FM_OK);
    CHECK(isinf(o[0]) && o[0] < 0);
    CHECK(isnan(o[1]));
    CHECK(o[2] == 1023.0f * 0x1p-24f);
    CHECK(o[3] == 0x1p-14f);
    fm_st_close(&st);

    /* A BF16 tensor larger than the reader's 64 KiB piece: every bit pattern converts exactly. */
    enum { NB = 70000 };
    unsigned char *big = malloc(2 * NB);
    for (int i = 0; i < NB; i++) put16(big + 2 * i, (uint16_t)(i * 7));
    char h[128];
    snprintf(h, sizeof h, "{\"big\":{\"dtype\":\"BF16\",\"shape\":[%d],\"data_offsets\":[0,%d]}}", NB, 2 * NB);
    make_st(p, h, big, 2 * NB);
    float *ob = malloc(sizeof(float) * NB);
    int64_t snb = NB;
    CHECK(fm_st_open(&st, p) == FM_OK);
    CHECK(fm_st_read_f32(&st, "big", ob, 1, &snb) == FM_OK);
    int bad = 0;
    for (int i = 0; i < NB; i++) {
        uint32_t u;
        memcpy(&u, &ob[i], 4);
        if (u != (uint32_t)(uint16_t)(i * 7) << 16) bad++;
    }
    CHECK_MSG(bad == 0, "%d BF16 values converted wrongly", bad);
    fm_st_close(&st);
    free(ob);
    free(big);
}

/* Opens a file that must fail with `want`; checks the message holds every non-NULL needle. */
static void expect_open_fail(const char *p, fm_status want, const char *n1, const char *n2) {
    fm_safetensors st;
    fm_status s = fm_st_open(&st, p);
    CHECK_MSG(s == want, "%s: got %s, want %s (%s)", p, fm_status_name(s), fm_status_name(want), fm_errmsg());
    CHECK_MSG(msg_has(p), "message lacks the file name: %s", fm_errmsg());
    if (n1) CHECK_MSG(msg_has(n1), "message lacks '%s': %s", n1, fm_errmsg());
    if (n2) CHECK_MSG(msg_has(n2), "message lacks '%s': %s", n2, fm_errmsg());
    CHECK(st.fd == -1 && st.tensors == NULL && st.path == NULL);
    fm_st_close(&st);
}

static void test_malformed(void) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s", g_dir, "bad.safetensors");
    unsigned char zeros[64] = {0};

    write_bytes(p, "abcde", 5);
    expect_open_fail(p, FM_ERR_FORMAT, "shorter than the 8-byte", NULL);
    write_bytes(p, "", 0);
    expect_open_fail(p, FM_ERR_FORMAT, "0 bytes", NULL);

    unsigned char hl[20] = {0xe8, 0x03}; /* header length 1000, 12 bytes follow */
    write_bytes(p, hl, sizeof hl);
    expect_open_fail(p, FM_ERR_FORMAT, "1000", "12 bytes");

    make_st(p, "{\"a\":{\"dtype\":\"F32\",", NULL, 0);
    expect_open_fail(p, FM_ERR_FORMAT, "not valid JSON", NULL);
    make_st(p, "{} x", NULL, 0);
    expect_open_fail(p, FM_ERR_FORMAT, "unexpected text after", NULL);
    make_st(p, "[1, 2]", NULL, 0);
    expect_open_fail(p, FM_ERR_FORMAT, "JSON object", NULL);

    make_st(p, "{\"w\":{\"dtype\":\"F31\",\"shape\":[2],\"data_offsets\":[0,8]}}", zeros, 8);
    expect_open_fail(p, FM_ERR_FORMAT, "'w'", "\"F31\"");
    make_st(p, "{\"w\":{\"shape\":[2],\"data_offsets\":[0,8]}}", zeros, 8);
    expect_open_fail(p, FM_ERR_FORMAT, "'w'", "dtype");
    make_st(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", zeros, 8);
    expect_open_fail(p, FM_ERR_FORMAT, "'w'", "shape");
    make_st(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", zeros, 8);
    expect_open_fail(p, FM_ERR_FORMAT, "'w'", "shape[0]");
    make_st(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}", zeros, 8);
    expect_open_fail(p, FM_ERR_FORMAT, "'w'", "9 dimensions");
    make_st(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0.5,8]}}", zeros, 8);
    expect_open_fail(p, FM_ERR_FORMAT, "'w'", "data_offsets");
    make_st(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", zeros, 8);
    expect_open_fail(p, FM_ERR_FORMAT, "'w'", "data_offsets");
    make_st(p, "{\"w\":[1,2]}", zeros, 8);
    expect_open_fail(p, FM_ERR_FORMAT, "'w'", "JSON object");

    /* Offsets outside the data buffer. */
    make_st(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", zeros, 8);
    expect_open_fail(p, FM_ERR_FORMAT, "'w'", "only 8 bytes (file truncated?)");
    /* begin > end. */
    make_st(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", zeros, 8);
    expect_open_fail(p, FM_ERR_FORMAT, "'w'", "begin > end");
    /* end - begin != numel * dtype size. */
    make_st(p, "{\"w\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,12]}}", zeros, 16);
    expect_open_fail(p, FM_ERR_FORMAT, "'w'", "= 8 bytes");
    /* Overlap. */
    make_st(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", zeros, 24);
    expect_open_fail(p, FM_ERR_FORMAT, "'a'", "'b'");
    CHECK(msg_has("overlap"));
    /* Overlap hidden behind a long tensor: c lies inside a. */
    make_st(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[8],\"data_offsets\":[0,32]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]},"
               "\"c\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[20,24]}}", zeros, 32);
    expect_open_fail(p, FM_ERR_FORMAT, "overlap", NULL);
    /* Duplicate names, duplicate or bad metadata. */
    make_st(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
               "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", zeros, 8);
    expect_open_fail(p, FM_ERR_FORMAT, "'a'", "twice");
    make_st(p, "{\"__metadata__\":{\"step\":3}}", NULL, 0);
    expect_open_fail(p, FM_ERR_FORMAT, "__metadata__", "'step'");
    make_st(p, "{\"__metadata__\":[]}", NULL, 0);
    expect_open_fail(p, FM_ERR_FORMAT, "__metadata__", NULL);

    /* A real file cut short: the message names the last tensor and says truncated. */
    float v[16] = {0};
    fm_named_tensor t[2] = {{"model.norm.weight", v, 1, {8}}, {"lm_head.weight", v, 2, {2, 4}}};
    CHECK(fm_st_write(p, t, 2, NULL) == FM_OK);
    size_t n;
    unsigned char *b = read_all(p, &n);
    write_bytes(p, b, n - 4);
    free(b);
    expect_open_fail(p, FM_ERR_FORMAT, "'lm_head.weight'", "(file truncated?)");

    /* Not there, or a folder. */
    expect_open_fail(tpath("missing.safetensors"), FM_ERR_IO, "No such file", NULL);
    expect_open_fail(g_dir, FM_ERR_IO, "not a regular file", NULL);
}

static void test_shape_and_missing(void) {
    static float w[64 * 96];
    for (int i = 0; i < 64 * 96; i++) w[i] = (float)i;
    fm_named_tensor t[1] = {{"model.layers.0.mlp.gate.weight", w, 2, {64, 96}}};
    char p[600];
    snprintf(p, sizeof p, "%s/%s", g_dir, "model.safetensors");
    CHECK(fm_st_write(p, t, 1, NULL) == FM_OK);
    fm_safetensors st;
    CHECK(fm_st_open(&st, p) == FM_OK);
    static float dst[64 * 128];
    int64_t want[2] = {64, 128};
    CHECK(fm_st_read_f32(&st, "model.layers.0.mlp.gate.weight", dst, 2, want) == FM_ERR_FORMAT);
    CHECK_MSG(msg_has("expected [64, 128], found [64, 96]"), "%s", fm_errmsg());
    CHECK(msg_has("'model.layers.0.mlp.gate.weight'") && msg_has(p));
    int64_t flat = 64 * 96;
    CHECK(fm_st_read_f32(&st, "model.layers.0.mlp.gate.weight", dst, 1, &flat) == FM_ERR_FORMAT);
    CHECK_MSG(msg_has("expected [6144], found [64, 96]"), "%s", fm_errmsg());
    int64_t ok[2] = {64, 96};
    CHECK(fm_st_read_f32(&st, "model.layers.0.mlp.gate.weight", dst, 2, ok) == FM_OK);
    CHECK(memcmp(dst, w, sizeof w) == 0);
    CHECK(fm_st_read_f32(&st, "model.layers.1.mlp.gate.weight", dst, 2, ok) == FM_ERR_FORMAT);
    CHECK_MSG(msg_has("no tensor named 'model.layers.1.mlp.gate.weight'") && msg_has(p), "%s", fm_errmsg());
    CHECK_MSG(msg_has("closest name is 'model.layers.0.mlp.gate.weight'"), "%s", fm_errmsg());
    CHECK(fm_st_read_f32(&st, "x", dst, 9, ok) == FM_ERR_ARG);
    fm_st_close(&st);
}

static void test_write_args(void) {
    float v[4] = {1, 2, 3, 4};
    char p[600];
    snprintf(p, sizeof p, "%s/%s", g_dir, "args.safetensors");
    fm_named_tensor dup[2] = {{"a", v, 1, {2}}, {"a", v, 1, {2}}};
    CHECK(fm_st_write(p, dup, 2, NULL) == FM_ERR_ARG && msg_has("'a'") && msg_has("twice"));
    fm_named_tensor res[1] = {{"__metadata__", v, 1, {2}}};
    CHECK(fm_st_write(p, res, 1, NULL) == FM_ERR_ARG && msg_has("reserves"));
    fm_named_tensor nd[1] = {{"a", v, 9, {1}}};
    CHECK(fm_st_write(p, nd, 1, NULL) == FM_ERR_ARG && msg_has("ndim 9"));
    fm_named_tensor neg[1] = {{"a", v, 2, {2, -1}}};
    CHECK(fm_st_write(p, neg, 1, NULL) == FM_ERR_ARG && msg_has("[2, -1]"));
    fm_named_tensor nul[1] = {{"a", NULL, 1, {2}}};
    CHECK(fm_st_write(p, nul, 1, NULL) == FM_ERR_ARG && msg_has("NULL data"));
    fm_named_tensor noname[1] = {{"", v, 1, {2}}};
    CHECK(fm_st_write(p, noname, 1, NULL) == FM_ERR_ARG);
    const char *kv[] = {"k", NULL, NULL};
    fm_named_tensor ok[1] = {{"a", v, 1, {4}}};
    CHECK(fm_st_write(p, ok, 1, kv) == FM_ERR_ARG && msg_has("'k'"));
    CHECK(!exists(p) && !exists(tpath("args.safetensors.tmp")));
    char q[600];
    snprintf(q, sizeof q, "%s/%s", g_dir, "no/such/folder/x.safetensors");
    CHECK(fm_st_write(q, ok, 1, NULL) == FM_ERR_IO && msg_has(q) && msg_has("No such file"));
    /* Names needing JSON escapes survive the roundtrip. */
    fm_named_tensor esc[1] = {{"we\"ird\\name\x01", v, 1, {4}}};
    CHECK(fm_st_write(p, esc, 1, NULL) == FM_OK);
    fm_safetensors st;
    CHECK(fm_st_open(&st, p) == FM_OK);
    CHECK(fm_st_find(&st, "we\"ird\\name\x01") != NULL);
    fm_st_close(&st);
}

/* Fault injection on fm_st_write: every failure leaves the old file byte-identical. */
static void test_st_write_faults(void) {
    float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {9, 8, 7, 6, 5, 4};
    char p[600];
    snprintf(p, sizeof p, "%s/%s", g_dir, "faults.safetensors");
    fm_named_tensor ta[2] = {{"x", a, 1, {2}}, {"y", a + 2, 2, {2, 2}}};
    fm_named_tensor tb[2] = {{"x", b, 1, {2}}, {"y", b + 2, 2, {2, 2}}};
    CHECK(fm_st_write(p, ta, 2, NULL) == FM_OK);
    size_t n;
    unsigned char *old = read_all(p, &n);
    int failures = 0, n_fault = 1, bad = 0;
    for (; n_fault < 200; n_fault++) {
        fm_fault_set(n_fault);
        fm_status s = fm_st_write(p, tb, 2, NULL);
        fm_fault_set(0);
        if (s == FM_OK) break;
        failures++;
        bool ok = (s == FM_ERR_IO || s == FM_ERR_NOMEM) && same_file(p, old, n) &&
                  !exists(tpath("faults.safetensors.tmp")) && fm_errmsg()[0];
        if (!ok) { bad++; fprintf(stderr, "fault %d: %s %s\n", n_fault, fm_status_name(s), fm_errmsg()); }
    }
    CHECK_MSG(bad == 0, "%d of %d injected faults damaged the old file", bad, failures);
    CHECK_MSG(failures >= 7, "only %d fault points", failures); /* allocs, create, 4 writes, fsync, rename */
    printf("fm_st_write: %d injected faults, all left the old file intact\n", failures);
    fm_safetensors st;
    float r[2];
    int64_t s2 = 2;
    CHECK(fm_st_open(&st, p) == FM_OK);
    CHECK(fm_st_read_f32(&st, "x", r, 1, &s2) == FM_OK && r[0] == 9 && r[1] == 8);
    fm_st_close(&st);
    free(old);
}

static void test_text_files(void) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s", g_dir, "metrics.json");
    const char *txt = "{\"step\": 1, \"loss\": 2.5}\n";
    CHECK(fm_write_file_atomic(p, txt, strlen(txt)) == FM_OK);
    char *got = NULL;
    CHECK(fm_ckpt_read_text(p, &got) == FM_OK);
    CHECK(got && strcmp(got, txt) == 0);
    fm_free(got);
    CHECK(fm_write_file_atomic(p, "", 0) == FM_OK);
    CHECK(fm_ckpt_read_text(p, &got) == FM_OK && got && got[0] == '\0');
    fm_free(got);
    CHECK(fm_write_file_atomic(p, txt, strlen(txt)) == FM_OK);
    int failures = 0, bad = 0;
    for (int k = 1; k < 50; k++) {
        fm_fault_set(k);
        fm_status s = fm_write_file_atomic(p, "replaced", 8);
        fm_fault_set(0);
        if (s == FM_OK) break;
        failures++;
        if (!same_file(p, (const unsigned char *)txt, strlen(txt)) || exists(tpath("metrics.json.tmp"))) bad++;
    }
    CHECK(failures >= 4 && bad == 0);
    CHECK(same_file(p, (const unsigned char *)"replaced", 8));
    char m[600];
    snprintf(m, sizeof m, "%s/%s", g_dir, "absent.json");
    got = (char *)1;
    CHECK(fm_ckpt_read_text(m, &got) == FM_ERR_IO && got == NULL && msg_has(m) && msg_has("No such file"));
    CHECK(fm_ckpt_read_text(g_dir, &got) == FM_ERR_IO && msg_has("folder"));
}

/* ------------------------------------------------------------------------------------------ */
/* Checkpoints                                                                                */

typedef struct ckpt_data {
    float emb[32], expert[32], m[32], v[32];
    fm_named_tensor model[2], optim[2];
    char state[128];
} ckpt_data;

static void ckpt_fill(ckpt_data *d, uint32_t seed, int64_t step) {
    g_lcg = seed;
    for (int i = 0; i < 32; i++) {
        d->emb[i] = rnd(); d->expert[i] = rnd(); d->m[i] = rnd(); d->v[i] = rnd() * rnd();
    }
    d->model[0] = (fm_named_tensor){"model.embed_tokens.weight", d->emb, 2, {8, 4}};
    d->model[1] = (fm_named_tensor){"model.layers.0.mlp.experts.0.gate_proj.weight", d->expert, 2, {4, 8}};
    d->optim[0] = (fm_named_tensor){"adam.m.model.embed_tokens.weight", d->m, 2, {8, 4}};
    d->optim[1] = (fm_named_tensor){"adam.v.model.embed_tokens.weight", d->v, 2, {8, 4}};
    snprintf(d->state, sizeof d->state, "{\"step\": %lld, \"seed\": %u}", (long long)step, seed);
}

static const char *k_cfg = "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 4}";

static fm_status ckpt_write(const char *run, int64_t step, ckpt_data *d, char *out, size_t cap) {
    return fm_ckpt_write(run, step, d->model, 2, d->optim, 2, k_cfg, d->state, out, cap);
}

static const char *const k_files[4] = {"model.safetensors", "optimizer.safetensors", "config.json", "state.json"};

typedef struct snapshot { unsigned char *b[4]; size_t n[4]; } snapshot;

static void snap_take(snapshot *s, const char *dir) {
    char p[1024];
    for (int i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, k_files[i]);
        s->b[i] = read_all(p, &s->n[i]);
    }
}
static bool snap_same(const snapshot *s, const char *dir) {
    char p[1024];
    for (int i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, k_files[i]);
        if (!s->b[i] || !same_file(p, s->b[i], s->n[i])) return false;
    }
    return true;
}
static void snap_free(snapshot *s) { for (int i = 0; i < 4; i++) free(s->b[i]); }

static void test_ckpt_basic(void) {
    char run[512], out[512], want[600];
    snprintf(run, sizeof run, "%s/runs/a/b", g_dir); /* parents created on demand */
    ckpt_data d;
    ckpt_fill(&d, 1, 100);
    CHECK(ckpt_write(run, 100, &d, out, sizeof out) == FM_OK);
    snprintf(want, sizeof want, "%s/step_000100", run);
    CHECK(strcmp(out, want) == 0);
    ckpt_fill(&d, 2, 200);
    CHECK(ckpt_write(run, 200, &d, out, sizeof out) == FM_OK);
    CHECK(count_tmp(run) == 0);

    /* Contents: config and state verbatim, tensors bit-exact, step in the metadata. */
    char p[800], *txt = NULL;
    snprintf(p, sizeof p, "%s/config.json", out);
    CHECK(fm_ckpt_read_text(p, &txt) == FM_OK && txt && strcmp(txt, k_cfg) == 0);
    fm_free(txt);
    snprintf(p, sizeof p, "%s/state.json", out);
    CHECK(fm_ckpt_read_text(p, &txt) == FM_OK && txt && strcmp(txt, d.state) == 0);
    fm_free(txt);
    fm_safetensors st;
    float r[32];
    int64_t s84[2] = {8, 4}, s48[2] = {4, 8};
    snprintf(p, sizeof p, "%s/model.safetensors", out);
    CHECK(fm_st_open(&st, p) == FM_OK);
    CHECK(fm_st_read_f32(&st, "model.embed_tokens.weight", r, 2, s84) == FM_OK && !memcmp(r, d.emb, sizeof r));
    CHECK(fm_st_read_f32(&st, "model.layers.0.mlp.experts.0.gate_proj.weight", r, 2, s48) == FM_OK &&
          !memcmp(r, d.expert, sizeof r));
    CHECK(fm_st_metadata(&st, "step") && !strcmp(fm_st_metadata(&st, "step"), "200"));
    CHECK(fm_st_metadata(&st, "format") && !strcmp(fm_st_metadata(&st, "format"), "pt"));
    fm_st_close(&st);
    snprintf(p, sizeof p, "%s/optimizer.safetensors", out);
    CHECK(fm_st_open(&st, p) == FM_OK);
    CHECK(fm_st_read_f32(&st, "adam.v.model.embed_tokens.weight", r, 2, s84) == FM_OK && !memcmp(r, d.v, sizeof r));
    fm_st_close(&st);

    /* find_latest: highest complete step; temp folders, incomplete folders, files and other
     * names are ignored. */
    char tmpd[600];
    snprintf(tmpd, sizeof tmpd, "%s/.tmp.step_000900", run);
    mkdir(tmpd, 0755);
    for (int i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", tmpd, k_files[i]);
        write_bytes(p, "{}", 2);
    }
    snprintf(p, sizeof p, "%s/step_000700", run);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/step_000700/state.json", run);
    write_bytes(p, "{}", 2);
    snprintf(p, sizeof p, "%s/step_0008x", run);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/step_000950", run);
    write_bytes(p, "x", 1);
    int64_t step = -1;
    char found[600];
    CHECK(fm_ckpt_find_latest(run, found, sizeof found, &step) == FM_OK);
    CHECK(step == 200 && strcmp(found, out) == 0);
    CHECK(fm_ckpt_find_latest(run, NULL, 0, NULL) == FM_OK);
    char tiny[8];
    CHECK(fm_ckpt_find_latest(run, tiny, sizeof tiny, &step) == FM_ERR_ARG);

    /* A later write of a step cleans its stale temporary folder. */
    ckpt_fill(&d, 9, 900);
    CHECK(ckpt_write(run, 900, &d, out, sizeof out) == FM_OK);
    CHECK(!exists(tmpd));
    CHECK(fm_ckpt_find_latest(run, found, sizeof found, &step) == FM_OK && step == 900);

    /* A crash while replacing step 900 left it moved aside and no step_000900: the next write
     * of that step puts it back first, so a failure of that write still leaves step 900. */
    char final900[600], aside900[600];
    snprintf(final900, sizeof final900, "%s/step_000900", run);
    snprintf(aside900, sizeof aside900, "%s/.tmp.old.step_000900", run);
    CHECK(rename(final900, aside900) == 0);
    CHECK(fm_ckpt_find_latest(run, found, sizeof found, &step) == FM_OK && step == 200);
    fm_fault_set(1);
    CHECK(ckpt_write(run, 900, &d, out, sizeof out) != FM_OK);
    fm_fault_set(0);
    CHECK(!exists(aside900) && count_tmp(run) == 0);
    CHECK(fm_ckpt_find_latest(run, found, sizeof found, &step) == FM_OK && step == 900);
    snprintf(p, sizeof p, "%s/state.json", final900);
    CHECK(fm_ckpt_read_text(p, &txt) == FM_OK && txt && strstr(txt, "\"seed\": 9}"));
    fm_free(txt);

    /* Overwriting an existing step replaces it and leaves nothing aside. */
    ckpt_fill(&d, 10, 900);
    CHECK(ckpt_write(run, 900, &d, out, sizeof out) == FM_OK);
    snprintf(p, sizeof p, "%s/state.json", out);
    CHECK(fm_ckpt_read_text(p, &txt) == FM_OK && txt && strcmp(txt, d.state) == 0);
    fm_free(txt);
    CHECK(count_tmp(run) == 0);

    /* Too small an out_dir buffer is refused before anything is written. */
    CHECK(ckpt_write(run, 1000, &d, tiny, sizeof tiny) == FM_ERR_ARG);
    snprintf(p, sizeof p, "%s/step_001000", run);
    CHECK(!exists(p));
    CHECK(fm_ckpt_write(run, -1, d.model, 2, d.optim, 2, k_cfg, d.state, NULL, 0) == FM_ERR_ARG);
    CHECK(fm_ckpt_write(run, 5, d.model, 2, d.optim, 2, NULL, d.state, NULL, 0) == FM_ERR_ARG);

    /* Steps past 6 digits keep all their digits and still sort numerically. */
    char run2[600];
    snprintf(run2, sizeof run2, "%s/runs/big", g_dir);
    CHECK(ckpt_write(run2, 999999, &d, NULL, 0) == FM_OK);
    CHECK(ckpt_write(run2, 1234567, &d, out, sizeof out) == FM_OK);
    CHECK(strstr(out, "/step_1234567") != NULL);
    CHECK(fm_ckpt_find_latest(run2, NULL, 0, &step) == FM_OK && step == 1234567);

    /* No checkpoint yet; no run folder. */
    char empty[600];
    snprintf(empty, sizeof empty, "%s/runs/empty", g_dir);
    mkdir(empty, 0755);
    CHECK(fm_ckpt_find_latest(empty, found, sizeof found, &step) == FM_ERR_IO);
    CHECK_MSG(msg_has(empty) && msg_has("no checkpoint found"), "%s", fm_errmsg());
    snprintf(empty, sizeof empty, "%s/runs/none", g_dir);
    CHECK(fm_ckpt_find_latest(empty, found, sizeof found, &step) == FM_ERR_IO);
    CHECK(msg_has(empty) && msg_has("No such file"));
    /* A run folder path that is a file. */
    snprintf(p, sizeof p, "%s/runs/afile", g_dir);
    write_bytes(p, "x", 1);
    CHECK(ckpt_write(p, 1, &d, NULL, 0) == FM_ERR_IO && msg_has(p) && msg_has("not a folder"));
}

/* For n = 1, 2, ...: fail the n-th allocation or write of fm_ckpt_write. Every failure must
 * return non-OK with a message, leave no temporary folder or file, and leave the previous
 * checkpoint byte-identical and found by fm_ckpt_find_latest. */
static void test_ckpt_faults(void) {
    char run[512], dir200[600], dir300[600], out[600], found[600];
    snprintf(run, sizeof run, "%s/runs/faults", g_dir);
    snprintf(dir200, sizeof dir200, "%s/step_000200", run);
    snprintf(dir300, sizeof dir300, "%s/step_000300", run);
    ckpt_data a, b;
    ckpt_fill(&a, 11, 200);
    ckpt_fill(&b, 22, 200);
    CHECK(ckpt_write(run, 200, &a, NULL, 0) == FM_OK);
    snapshot sa;
    snap_take(&sa, dir200);

    /* 1. Rewriting the same step (move aside, rename, delete). */
    int failures = 0, bad = 0, k = 1;
    for (; k < 500; k++) {
        fm_fault_set(k);
        fm_status s = ckpt_write(run, 200, &b, out, sizeof out);
        fm_fault_set(0);
        if (s == FM_OK) break;
        failures++;
        int64_t step = -1;
        bool ok = fm_errmsg()[0] && count_tmp(run) == 0 && snap_same(&sa, dir200) &&
                  fm_ckpt_find_latest(run, found, sizeof found, &step) == FM_OK && step == 200 &&
                  strcmp(found, dir200) == 0;
        if (!ok) { bad++; fprintf(stderr, "rewrite fault %d: %s\n", k, fm_errmsg()); }
    }
    CHECK_MSG(bad == 0, "%d of %d faults damaged the checkpoint", bad, failures);
    CHECK_MSG(failures >= 20, "only %d fault points", failures);
    printf("fm_ckpt_write (same step): %d injected faults, previous checkpoint intact after each\n", failures);
    CHECK(k < 500 && count_tmp(run) == 0);
    snapshot sb;
    snap_take(&sb, dir200);
    CHECK(!snap_same(&sa, dir200)); /* the successful write replaced it */
    char p[700], *txt = NULL;
    snprintf(p, sizeof p, "%s/state.json", dir200);
    CHECK(fm_ckpt_read_text(p, &txt) == FM_OK && txt && strcmp(txt, b.state) == 0);
    fm_free(txt);

    /* 2. Writing a new step next to the existing one. */
    ckpt_fill(&a, 33, 300);
    failures = bad = 0;
    for (k = 1; k < 500; k++) {
        fm_fault_set(k);
        fm_status s = ckpt_write(run, 300, &a, NULL, 0);
        fm_fault_set(0);
        if (s == FM_OK) break;
        failures++;
        int64_t step = -1;
        bool ok = fm_errmsg()[0] && count_tmp(run) == 0 && !exists(dir300) && snap_same(&sb, dir200) &&
                  fm_ckpt_find_latest(run, found, sizeof found, &step) == FM_OK && step == 200;
        if (!ok) { bad++; fprintf(stderr, "new-step fault %d: %s\n", k, fm_errmsg()); }
    }
    CHECK_MSG(bad == 0, "%d of %d faults damaged the run", bad, failures);
    CHECK(failures >= 20);
    int64_t step = -1;
    CHECK(fm_ckpt_find_latest(run, found, sizeof found, &step) == FM_OK && step == 300);
    CHECK(snap_same(&sb, dir200));
    snap_free(&sa);
    snap_free(&sb);
}

/* Tensors given by a fetch callback instead of a pointer are written byte-identically. */
static void fetch_copy(void *ctx, float *buf) {
    const float *src = ctx;
    memcpy(buf, src, 6 * sizeof(float));
}

static void test_fetch_write(const char *dir) {
    float a[6] = {1, -2, 3.5f, 0, 1e-30f, 7}, b[6] = {9, 8, 7, 6, 5, 4};
    fm_named_tensor direct[2] = {{"a", a, 2, {2, 3}}, {"b", b, 1, {6}}};
    fm_named_tensor fetched[2] = {{"a", NULL, 2, {2, 3}, fetch_copy, a}, {"b", NULL, 1, {6}, fetch_copy, b}};
    char p1[512], p2[512];
    snprintf(p1, sizeof p1, "%s/direct.safetensors", dir);
    snprintf(p2, sizeof p2, "%s/fetched.safetensors", dir);
    CHECK(fm_st_write(p1, direct, 2, NULL) == FM_OK);
    CHECK(fm_st_write(p2, fetched, 2, NULL) == FM_OK);
    FILE *f1 = fopen(p1, "rb"), *f2 = fopen(p2, "rb");
    CHECK(f1 && f2);
    if (f1 && f2) {
        int c1, c2, same = 1;
        do {
            c1 = fgetc(f1);
            c2 = fgetc(f2);
            same &= c1 == c2;
        } while (c1 != EOF && c2 != EOF);
        CHECK_MSG(same, "a fetched tensor was written differently from the same data by pointer");
    }
    if (f1) fclose(f1);
    if (f2) fclose(f2);
    /* neither data nor fetch: refused */
    fm_named_tensor none[1] = {{"a", NULL, 1, {6}}};
    CHECK(fm_st_write(p1, none, 1, NULL) == FM_ERR_ARG);
}

/* ---- Hugging Face folders: index + shards, bf16 / fp16, missing, shape, dtype, extras -------- */

/* A two-tensor table: "model.embed_tokens.weight" [2, 3] at 0 and "model.norm.weight" [3] at 6. */
static const fm_hf_param k_params[2] = {{"model.embed_tokens.weight", 2, {2, 3}, 0}, {"model.norm.weight", 1, {3, 0}, 6}};
static const fm_hf_table k_table = {k_params, 2, 0, 0, 3, 0, "mlp", NULL, false, "test"};

static void test_hf_folder(void) {
    const float emb[6] = {1.5f, -2.0f, 0.25f, 3.0f, -0.125f, 384.0f}, norm[3] = {1.0f, 0.5f, -7.0f};
    /* bf16 of emb (exact values: each fits bf16's 8 bits), fp16 of norm */
    uint16_t emb_bf16[6], norm_f16[3] = {0x3C00, 0x3800, 0xC700}; /* 1.0, 0.5, -7.0 */
    for (int i = 0; i < 6; i++) emb_bf16[i] = fm_f32_to_bf16(emb[i]);
    char dir[600];
    snprintf(dir, sizeof dir, "%s/hf", g_dir);
    mkdir(dir, 0755);
    char p[700];
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
    make_st(p, "{\"model.embed_tokens.weight\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,12]}}", emb_bf16, 12);
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    unsigned char two[6 + 8];
    memcpy(two, norm_f16, 6);
    memset(two + 6, 0, 8);
    make_st(p, "{\"model.norm.weight\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[0,6]},"
               "\"model.rotary.inv_freq\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[6,14]}}", two, 14);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    const char *idx = "{\"metadata\": {\"total_size\": 26}, \"weight_map\": {"
                      "\"model.embed_tokens.weight\": \"model-00001-of-00002.safetensors\", "
                      "\"model.norm.weight\": \"model-00002-of-00002.safetensors\", "
                      "\"model.rotary.inv_freq\": \"model-00002-of-00002.safetensors\"}}";
    write_bytes(p, idx, strlen(idx));

    fm_hf_files f;
    fm_status s = fm_hf_files_open(&f, dir);
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    CHECK(f.n == 2 && strstr(f.where, "model.safetensors.index.json"));
    float out[9];
    memset(out, 0, sizeof out);
    char extra[512] = "x";
    fm_hf_read_opts ro = {true, extra, sizeof extra};
    s = fm_hf_read_files(&k_table, &f, "", out, &ro);
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    CHECK(!memcmp(out, emb, sizeof emb) && !memcmp(out + 6, norm, sizeof norm)); /* widened exactly */
    CHECK_MSG(strstr(extra, "1 tensor of") && strstr(extra, "'model.rotary.inv_freq'") && strstr(extra, "ignored"),
              "extra: %s", extra);
    /* strict (a checkpoint file): the extra tensor is an error naming it */
    s = fm_hf_read_files(&k_table, &f, "", out, NULL);
    CHECK(s == FM_ERR_FORMAT && msg_has("'model.rotary.inv_freq' is not a parameter of this test model"));
    fm_hf_files_close(&f);
    fm_hf_files_close(&f); /* twice is safe */

    /* missing tensor: named, with its shape, never filled */
    fm_hf_param more[3] = {k_params[0], k_params[1], {"lm_head.weight", 2, {2, 3}, 9}};
    fm_hf_table t3 = k_table;
    t3.params = more;
    t3.n_params = 3;
    CHECK(fm_hf_files_open(&f, dir) == FM_OK);
    float big[15];
    for (int i = 0; i < 15; i++) big[i] = -999.0f;
    s = fm_hf_read_files(&t3, &f, "", big, &ro);
    CHECK_MSG(s == FM_ERR_FORMAT && msg_has("no tensor named 'lm_head.weight'") && msg_has("[2, 3]") &&
              msg_has("never initialized at random"), "%s", fm_errmsg());
    CHECK(big[9] == -999.0f && big[14] == -999.0f);
    fm_hf_files_close(&f);

    /* wrong shape; wrong dtype */
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
    make_st(p, "{\"model.embed_tokens.weight\":{\"dtype\":\"BF16\",\"shape\":[3,2],\"data_offsets\":[0,12]}}", emb_bf16, 12);
    CHECK(fm_hf_files_open(&f, dir) == FM_OK);
    s = fm_hf_read_files(&k_table, &f, "", out, &ro);
    CHECK_MSG(s == FM_ERR_FORMAT && msg_has("'model.embed_tokens.weight' has the wrong shape: expected [2, 3], found [3, 2]"),
              "%s", fm_errmsg());
    fm_hf_files_close(&f);
    make_st(p, "{\"model.embed_tokens.weight\":{\"dtype\":\"I16\",\"shape\":[2,3],\"data_offsets\":[0,12]}}", emb_bf16, 12);
    CHECK(fm_hf_files_open(&f, dir) == FM_OK);
    s = fm_hf_read_files(&k_table, &f, "", out, &ro);
    CHECK_MSG(s == FM_ERR_FORMAT && msg_has("has dtype I16; expected F32, BF16 or F16"), "%s", fm_errmsg());
    fm_hf_files_close(&f);

    /* an index that lies, a missing shard, a malformed index, an empty folder */
    const char *lie = "{\"weight_map\": {\"model.norm.weight\": \"model-00001-of-00002.safetensors\"}}";
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    write_bytes(p, lie, strlen(lie));
    s = fm_hf_files_open(&f, dir);
    CHECK_MSG(s == FM_ERR_FORMAT && msg_has("places tensor 'model.norm.weight'"), "%s", fm_errmsg());
    const char *gone = "{\"weight_map\": {\"model.norm.weight\": \"model-00009-of-00009.safetensors\"}}";
    write_bytes(p, gone, strlen(gone));
    CHECK(fm_hf_files_open(&f, dir) == FM_ERR_IO && msg_has("model-00009-of-00009.safetensors"));
    write_bytes(p, "{\"weight_map\": 3}", 17);
    CHECK(fm_hf_files_open(&f, dir) == FM_ERR_FORMAT && msg_has("weight_map"));
    const char *up = "{\"weight_map\": {\"a\": \"../x.safetensors\"}}";
    write_bytes(p, up, strlen(up));
    CHECK(fm_hf_files_open(&f, dir) == FM_ERR_FORMAT && msg_has("a relative name"));
    snprintf(p, sizeof p, "%s/empty", g_dir);
    mkdir(p, 0755);
    CHECK(fm_hf_files_open(&f, p) == FM_ERR_IO && msg_has("holds neither model.safetensors nor"));
    CHECK(f.n == 0 && f.st == NULL);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/fm_test_io.XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    printf("working in %s\n", g_dir);
    g_lcg = (uint32_t)fm_test_seed(1234);
    test_roundtrip();
    test_conversions();
    test_malformed();
    test_shape_and_missing();
    test_write_args();
    test_fetch_write(g_dir);
    test_st_write_faults();
    test_text_files();
    test_ckpt_basic();
    test_ckpt_faults();
    test_hf_folder();
    rm_rf(g_dir);
    return fm_test_finish();
}
