/* Tests of src/io's safetensors: read/write (roundtrip, dtype conversion, every malformed-header
 * case, shape and name errors, argument checks, tensors written through a fetch callback) and
 * fault injection (every failed write leaves the previous file byte-identical). Checkpoint and
 * Hugging Face folders are tests/test_io_ckpt.c; the helpers tests/fm_test_io.h.
 * Works in a fresh folder under /tmp, removed at the end. */
#include "fm_test_io.h"

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
    rm_rf(g_dir);
    return fm_test_finish();
}
