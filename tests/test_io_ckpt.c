/* Tests of src/io's folders: atomic text files, checkpoint folders (layout, find-latest, and
 * fault injection: every failed write leaves the previous checkpoint byte-identical and
 * findable) and Hugging Face model folders (index + shards, bf16 / fp16, missing, shape, dtype,
 * extras). Safetensors files themselves are tests/test_io.c; the helpers tests/fm_test_io.h.
 * Works in a fresh folder under /tmp, removed at the end. */
#include "fm_test_io.h"

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
    snprintf(g_dir, sizeof g_dir, "/tmp/fm_test_io_ckpt.XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    printf("working in %s\n", g_dir);
    g_lcg = (uint32_t)fm_test_seed(1234);
    test_text_files();
    test_ckpt_basic();
    test_ckpt_faults();
    test_hf_folder();
    rm_rf(g_dir);
    return fm_test_finish();
}
