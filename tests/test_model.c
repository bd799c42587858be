/* Model-level tests: configs (the shipped real ones and bad ones), the whole model's gradient by
 * finite differences for each model_type (aux and z losses on), recompute bit-identical to no
 * recompute, gradient accumulation scaling, and adversarial routing (all tokens to one expert,
 * experts that get nothing). */
#include <math.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "model/fm_model.h"
#include "schedule/fm_schedule.h"

static fm_backend g_be;

/* ---- configs --------------------------------------------------------------------------------- */

static void test_real_configs(void) {
    struct { const char *path; int64_t params; } c[] = {
        {"configs/olmoe-1b-7b.json", 6919161856LL},
        {"configs/qwen3-30b-a3b.json", 30532122624LL},
        {"configs/mixtral-8x7b.json", 46702792704LL},
        /* Qwen3-235B-A22B: 235.09e9 from its shapes (the model card: 235B, 234B without the
         * embeddings; 233,848,970,752 here) */
        {"configs/qwen3-235b-a22b.json", 235093634560LL},
    };
    for (int i = 0; i < 4; i++) {
        fm_config cfg;
        fm_status s = fm_config_load(&cfg, c[i].path);
        CHECK_MSG(s == FM_OK, "%s: %s", c[i].path, fm_errmsg());
        if (s) continue;
        CHECK_MSG(fm_config_num_params(&cfg) == c[i].params, "%s: %lld params, expected %lld", c[i].path,
                  (long long)fm_config_num_params(&cfg), (long long)c[i].params);
        /* to_json -> parse round trip keeps every field */
        char *j = fm_config_to_json(&cfg);
        fm_config back;
        CHECK(fm_config_parse(&back, j, "roundtrip") == FM_OK);
        CHECK(fm_config_num_params(&back) == c[i].params);
        CHECK(back.qk_norm == cfg.qk_norm && back.norm_topk_prob == cfg.norm_topk_prob &&
              back.head_dim == cfg.head_dim && back.num_experts == cfg.num_experts);
        fm_free(j);
    }
    fm_config cfg;
    CHECK(fm_config_load(&cfg, "configs/olmoe-1b-7b.json") == FM_OK);
    CHECK(cfg.qk_norm == FM_QK_NORM_FULL && !cfg.norm_topk_prob && cfg.num_experts == 64 && cfg.moe_intermediate_size == 1024);
    CHECK(fm_config_load(&cfg, "configs/qwen3-30b-a3b.json") == FM_OK);
    CHECK(cfg.qk_norm == FM_QK_NORM_PER_HEAD && cfg.norm_topk_prob && cfg.head_dim == 128 && cfg.moe_intermediate_size == 768);
    CHECK(fm_config_load(&cfg, "configs/mixtral-8x7b.json") == FM_OK);
    CHECK(cfg.qk_norm == FM_QK_NORM_NONE && cfg.norm_topk_prob && cfg.num_experts == 8 && cfg.head_dim == 128);
    CHECK(fm_config_load(&cfg, "configs/tiny.json") == FM_OK);
}

static void expect_bad(const char *json, fm_status want, const char *needle) {
    fm_config cfg;
    fm_status s = fm_config_parse(&cfg, json, "bad.json");
    CHECK_MSG(s == want, "expected %s, got %s (%s) for %s", fm_status_name(want), fm_status_name(s), fm_errmsg(), json);
    CHECK_MSG(strstr(fm_errmsg(), needle) != NULL, "message '%s' lacks '%s'", fm_errmsg(), needle);
    CHECK_MSG(strstr(fm_errmsg(), "bad.json") != NULL, "message '%s' does not name the file", fm_errmsg());
}

#define BASE "\"vocab_size\":256,\"hidden_size\":64,\"num_hidden_layers\":2,\"max_position_embeddings\":64,\"num_experts_per_tok\":2"
static void test_bad_configs(void) {
    expect_bad("{\"model_type\":\"qwen3_moe\", oops}", FM_ERR_FORMAT, "malformed JSON");
    expect_bad("{\"model_type\":\"llama\"," BASE "}", FM_ERR_CONFIG, "unknown model_type \"llama\"");
    expect_bad("{\"model_type\":\"olmoe\"," BASE ",\"num_attention_heads\":12,\"intermediate_size\":32,\"num_experts\":4}",
               FM_ERR_CONFIG, "num_attention_heads (12) must divide hidden_size (64)");
    expect_bad("{\"model_type\":\"olmoe\"," BASE ",\"num_attention_heads\":4,\"num_key_value_heads\":3,\"intermediate_size\":32,\"num_experts\":4}",
               FM_ERR_CONFIG, "num_key_value_heads (3)");
    expect_bad("{\"model_type\":\"olmoe\",\"vocab_size\":256,\"hidden_size\":64,\"num_hidden_layers\":2,\"max_position_embeddings\":64,"
               "\"num_experts_per_tok\":5,\"num_attention_heads\":4,\"intermediate_size\":32,\"num_experts\":4}",
               FM_ERR_CONFIG, "num_experts_per_tok (5) must be <= num_experts (4)");
    /* (a field left out is transformers' default, not an error: tests/test_config.c) */
    expect_bad("{\"model_type\":\"qwen3_moe\"," BASE ",\"num_attention_heads\":\"4\",\"moe_intermediate_size\":32,\"num_experts\":4}",
               FM_ERR_FORMAT, "\"num_attention_heads\" must be an integer");
    /* (qwen3_moe's dense layers are built: tests/test_dense_layers.c; other types have none) */
    expect_bad("{\"model_type\":\"olmoe\"," BASE ",\"num_attention_heads\":4,\"intermediate_size\":32,\"num_experts\":4,"
               "\"mlp_only_layers\":[0]}", FM_ERR_UNSUPPORTED, "mlp_only_layers");
    expect_bad("{\"model_type\":\"olmoe\"," BASE ",\"num_attention_heads\":4,\"intermediate_size\":32,\"num_experts\":4,"
               "\"clip_qkv\":8}", FM_ERR_UNSUPPORTED, "clip_qkv");
    expect_bad("{\"model_type\":\"olmoe\"," BASE ",\"num_attention_heads\":4,\"intermediate_size\":-32,\"num_experts\":4}",
               FM_ERR_CONFIG, "\"intermediate_size\" must be positive");
    expect_bad("{\"model_type\":\"olmoe\"," BASE ",\"num_attention_heads\":4,\"intermediate_size\":32,\"num_experts\":4,"
               "\"rope_parameters\":{\"rope_type\":\"longrope\",\"rope_theta\":5}}", FM_ERR_UNSUPPORTED,
               "supports only \"default\", \"linear\" and \"yarn\""); /* (yarn: tests/test_attn.c) */
    /* every number read is range-checked, naming the field (issue 27) */
#define OLMOE "{\"model_type\":\"olmoe\"," BASE ",\"num_attention_heads\":4,\"intermediate_size\":32,\"num_experts\":4,"
    expect_bad(OLMOE "\"rope_theta\":1e400}", FM_ERR_CONFIG, "rope_theta (inf) must be positive and finite");
    expect_bad(OLMOE "\"router_z_loss_coef\":1e400}", FM_ERR_CONFIG, "must be finite and >= 0");
    expect_bad(OLMOE "\"initializer_range\":-1}", FM_ERR_CONFIG, "\"initializer_range\" (-1) must be finite and >= 0");
    expect_bad(OLMOE "\"head_dim\":2199023255552}", FM_ERR_CONFIG, "\"head_dim\" is 2199023255552; flatmoe supports at most 2^30");
#undef OLMOE
    /* a layer count that made the layer loops run for hours (fuzz_config, 2026-12-07) */
    expect_bad("{\"model_type\":\"qwen3_moe\",\"vocab_size\":32,\"num_hidden_layers\":1000000000000,"
               "\"moe_intermediate_size\":16,\"rope_theta\":1e-06}", FM_ERR_CONFIG,
               "\"num_hidden_layers\" is 1000000000000; flatmoe supports at most 4096 layers");
    fm_config cfg;
    CHECK(fm_config_parse(&cfg, "{\"model_type\":\"olmoe\"," BASE ",\"num_attention_heads\":4,\"intermediate_size\":32,"
                          "\"num_experts\":4,\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":5e5}}", "v5.json") == FM_OK);
    CHECK(cfg.rope_theta == 5e5);
    CHECK(fm_config_load(&cfg, "configs/does-not-exist.json") == FM_ERR_IO);
    CHECK(strstr(fm_errmsg(), "does-not-exist.json") != NULL);
}

/* ---- small models (fm_test_model.h) ----------------------------------------------------------- */

static fm_config small_config(fm_model_type t, bool tied, int64_t k) { return fm_test_small_config(t, 2, tied, k); }
static void fill_batch(fm_model *m, uint64_t seed) { fm_test_fill_batch(m, seed, 3); }

/* The batch is the step's argument (model/fm_batch.h): its shape must be the model's active one
 * and its ids in range, else the forward fails with FM_ERR_ARG naming the input, and a batch
 * handed over again gives the same loss bits (the model keeps nothing of it but the upload). */
static void test_batch_argument(void) {
    fm_config c = small_config(FM_MODEL_QWEN3_MOE, false, 2);
    fm_model m;
    CHECK(fm_test_model_create(&m, &c, g_be) == FM_OK);
    CHECK(fm_model_layout(&m, 2, 7, NULL) == FM_OK);
    fm_model_init_weights(&m, 5);
    fill_batch(&m, 6);
    fm_batch *b = fm_test_batch_of(&m);
    fm_loss a, a2;
    CHECK(fm_schedule_default_forward(&m, b, &a) == FM_OK && isfinite(a.ce) && a.n_valid == m.a.N - 1);
    fm_batch other; /* another batch, then the first again: the same bits */
    CHECK(fm_batch_alloc(&other, 2, 7, true) == FM_OK);
    for (int64_t i = 0; i < 14; i++) other.tokens[i] = (int32_t)(i % c.vocab_size), other.targets[i] = 1;
    fm_loss o;
    CHECK(fm_schedule_default_forward(&m, &other, &o) == FM_OK && o.n_valid == 14 && o.ce != a.ce);
    CHECK(fm_schedule_default_forward(&m, b, &a2) == FM_OK && a2.ce == a.ce && a2.aux == a.aux && a2.z == a.z);
    /* a token out of range */
    other.tokens[9] = (int32_t)c.vocab_size;
    CHECK(fm_schedule_default_forward(&m, &other, &o) == FM_ERR_ARG && strstr(fm_errmsg(), "token 9 (sequence 1, "
                                                                                "position 2) is 40"));
    other.tokens[9] = 0;
    other.targets[3] = -7; /* a target out of range (-100 alone means no loss) */
    CHECK(fm_schedule_default_forward(&m, &other, &o) == FM_ERR_ARG && strstr(fm_errmsg(), "target 3") &&
          strstr(fm_errmsg(), "-100"));
    fm_batch_free(&other);
    /* another shape than the active one */
    CHECK(fm_batch_alloc(&other, 1, 7, true) == FM_OK);
    CHECK(fm_schedule_default_forward(&m, &other, &o) == FM_ERR_ARG && strstr(fm_errmsg(), "1 x 7 tokens") &&
          strstr(fm_errmsg(), "fm_model_set_shape"));
    fm_model_set_shape(&m, 1, 7); /* within the layout: now it fits */
    CHECK(fm_schedule_default_forward(&m, &other, &o) == FM_OK && o.n_valid == 7);
    /* a training step needs targets */
    fm_batch tok = other;
    tok.targets = NULL;
    CHECK(fm_schedule_default_train_step(&m, &tok, 1.0f, &o) == FM_ERR_ARG && strstr(fm_errmsg(), "no targets"));
    fm_batch_free(&other);
    fm_test_model_free(&m);
}

static double total_loss(fm_model *m) {
    fm_loss l;
    fm_schedule_default_forward(m, fm_test_batch_of(m), &l);
    return l.ce + l.aux + l.z;
}

static bool same_routing(fm_model *m, int32_t *saved) {
    const int64_t nk = m->a.N * m->cfg.num_experts_per_tok;
    for (int64_t l = 0; l < m->cfg.num_hidden_layers; l++) /* (a dense layer routes nothing) */
        if (m->a.acts[l].router.topk_idx &&
            memcmp(saved + l * nk, m->a.acts[l].router.topk_idx, sizeof(int32_t) * (size_t)nk))
            return false;
    return true;
}

static void save_routing(fm_model *m, int32_t *saved) {
    const int64_t nk = m->a.N * m->cfg.num_experts_per_tok;
    for (int64_t l = 0; l < m->cfg.num_hidden_layers; l++)
        if (m->a.acts[l].router.topk_idx)
            memcpy(saved + l * nk, m->a.acts[l].router.topk_idx, sizeof(int32_t) * (size_t)nk);
}

/* For every tensor: the directional derivative along a random unit direction by central
 * differences vs the analytic gradient. Directions that change the top-k routing at +-eps are
 * redrawn (the loss is not differentiable across a routing change). */
static void check_model_grad(fm_config cfg, const char *label, uint64_t seed) {
    fm_model m;
    CHECK(fm_test_model_create(&m, &cfg, g_be) == FM_OK);
    CHECK(fm_model_layout(&m, 2, 7, NULL) == FM_OK);
    fm_model_init_weights(&m, seed);
    for (int i = 0; i < m.p.n_tensors; i++) /* a selection bias that matters (it starts at zero) */
        if (m.p.table[i].buffer)
            for (int64_t j = 0; j < m.p.table[i].numel; j++) m.p.params[m.p.table[i].offset + j] = 0.05f * (float)(j % 3);
    fill_batch(&m, seed + 1);
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    fm_loss base;
    fm_schedule_default_forward(&m, fm_test_batch_of(&m), &base);
    fm_schedule_default_backward(&m, 1.0f);
    const int64_t nk = m.a.N * cfg.num_experts_per_tok;
    int32_t *routing = fm_malloc(sizeof(int32_t) * (size_t)(nk * cfg.num_hidden_layers));
    save_routing(&m, routing);
    float *dir = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
    fm_rng r;
    fm_rng_seed(&r, seed + 2);
    int bad = 0, checked = 0;
    double worst = 0;
    const double eps = 1e-2;
    for (int i = 0; i < m.p.n_tensors; i++) {
        const fm_param *p = &m.p.table[i];
        float *w = m.p.params + p->offset;
        const float *g = m.p.grads + p->offset;
        for (int attempt = 0; attempt < 8; attempt++) {
            double nrm = 0;
            for (int64_t j = 0; j < p->numel; j++) { dir[j] = (float)fm_rng_normal(&r); nrm += (double)dir[j] * dir[j]; }
            nrm = sqrt(nrm);
            double an = 0;
            for (int64_t j = 0; j < p->numel; j++) { dir[j] = (float)(dir[j] / nrm); an += (double)g[j] * dir[j]; }
            float *orig = fm_malloc(sizeof(float) * (size_t)p->numel);
            memcpy(orig, w, sizeof(float) * (size_t)p->numel);
            for (int64_t j = 0; j < p->numel; j++) w[j] = (float)(orig[j] + eps * dir[j]);
            double lp = total_loss(&m);
            bool ok = same_routing(&m, routing);
            for (int64_t j = 0; j < p->numel; j++) w[j] = (float)(orig[j] - eps * dir[j]);
            double lm = total_loss(&m);
            ok = ok && same_routing(&m, routing);
            memcpy(w, orig, sizeof(float) * (size_t)p->numel);
            fm_free(orig);
            if (!ok) continue; /* routing flipped: redraw */
            double fd = (lp - lm) / (2 * eps);
            double err = fabs(fd - an) / fmax(fabs(an), 2e-3);
            if (err > worst) worst = err;
            if (err > 2e-2) {
                bad++;
                fprintf(stderr, "  %s %s: finite difference %.6g vs analytic %.6g (rel err %.3g)\n", label, p->name, fd, an, err);
            }
            checked++;
            break;
        }
    }
    printf("%s: %d tensors checked by finite differences, worst relative error %.2e\n", label, checked, worst);
    CHECK_MSG(bad == 0, "%s: %d tensors with a wrong gradient", label, bad);
    CHECK_MSG(checked >= m.p.n_tensors - 2, "%s: only %d of %d tensors could be checked", label, checked, m.p.n_tensors);
    fm_free(dir);
    fm_free(routing);
    fm_test_model_free(&m);
}

/* Full recompute and a per-layer list give gradients bit-identical to no recompute. */
static void test_recompute_exact(void) {
    fm_config cfg = small_config(FM_MODEL_QWEN3_MOE, false, 2);
    cfg.num_hidden_layers = 3;
    const char *specs[3] = {"none", "full", "1,2"};
    float *ref = NULL;
    double ref_loss = 0;
    for (int s = 0; s < 3; s++) {
        bool rc[3] = {s == 1, s >= 1, s >= 1};
        fm_model m;
        CHECK(fm_test_model_create(&m, &cfg, g_be) == FM_OK);
        fm_layout_opts lo = {rc, 0, 0, 0};
        CHECK(fm_model_layout(&m, 2, 9, &lo) == FM_OK);
        fm_model_init_weights(&m, 7);
        fill_batch(&m, 8);
        memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
        fm_loss l;
        fm_schedule_default_forward(&m, fm_test_batch_of(&m), &l);
        fm_schedule_default_backward(&m, 1.0f);
        if (s == 0) {
            ref = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
            memcpy(ref, m.p.grads, sizeof(float) * (size_t)m.p.n_params);
            ref_loss = l.ce + l.aux + l.z;
        } else {
            CHECK_MSG(memcmp(ref, m.p.grads, sizeof(float) * (size_t)m.p.n_params) == 0,
                      "recompute %s: gradients differ from no recompute", specs[s]);
            CHECK(ref_loss == l.ce + l.aux + l.z);
            size_t none[FM_LIVE_COUNT], this[FM_LIVE_COUNT];
            bool rc0[3] = {0};
            fm_layout_opts o0 = {rc0, 0, 0, 0};
            fm_model_plan_bytes(&cfg, 2, 9, &o0, none);
            fm_model_plan_bytes(&cfg, 2, 9, &lo, this);
            CHECK_MSG(this[FM_LIVE_LAYER_ACTS] < none[FM_LIVE_LAYER_ACTS], "recompute %s saves no memory", specs[s]);
            if (s == 1) CHECK(this[FM_LIVE_LAYER_ACTS] * 3 == none[FM_LIVE_LAYER_ACTS]);
        }
        /* The saved activations: one set per kept layer plus one shared by the recomputed layers,
         * each of the hand-written per-layer size (not the layout's own measure, which sized the
         * arena); and what the step wrote (painted high-water marks) fills each arena's bound. */
        const size_t copies = s == 0 ? 3 : s == 1 ? 1 : 2;
        CHECK_MSG(m.a.arena[FM_LIVE_LAYER_ACTS].capacity ==
                      copies * fm_model_layer_acts_bytes(&cfg, 2, 9, sizeof(fm_act)),
                  "recompute %s: layer activations %zu, expected %zu sets of %zu", specs[s],
                  m.a.arena[FM_LIVE_LAYER_ACTS].capacity, copies, fm_model_layer_acts_bytes(&cfg, 2, 9, sizeof(fm_act)));
        for (int i = 1; i < FM_LIVE_COUNT; i++) {
            const size_t hw = fm_arena_touched(&m.a.arena[i]), cap = m.a.arena[i].capacity;
            CHECK_MSG(hw <= cap && hw * 10 >= cap * 9, "recompute %s: %s wrote %zu of its %zu bytes", specs[s],
                      fm_live_set_names[i], hw, cap);
        }
        fm_test_model_free(&m);
    }
    fm_free(ref);
}

/* Backward with scale s accumulates s * gradient: two micro-batches with scale 1/2 equal the
 * mean of their separate gradients. */
static void test_accumulation(void) {
    fm_config cfg = small_config(FM_MODEL_OLMOE, true, 2);
    fm_model m;
    CHECK(fm_test_model_create(&m, &cfg, g_be) == FM_OK);
    CHECK(fm_model_layout(&m, 1, 8, NULL) == FM_OK);
    fm_model_init_weights(&m, 3);
    const size_t bytes = sizeof(float) * (size_t)m.p.n_params;
    float *g1 = fm_malloc(bytes), *g2 = fm_malloc(bytes);
    for (int b = 0; b < 2; b++) {
        fill_batch(&m, 100 + b);
        memset(m.p.grads, 0, bytes);
        fm_schedule_default_forward(&m, fm_test_batch_of(&m), NULL);
        fm_schedule_default_backward(&m, 1.0f);
        memcpy(b ? g2 : g1, m.p.grads, bytes);
    }
    memset(m.p.grads, 0, bytes);
    for (int b = 0; b < 2; b++) {
        fill_batch(&m, 100 + b);
        fm_schedule_default_forward(&m, fm_test_batch_of(&m), NULL);
        fm_schedule_default_backward(&m, 0.5f);
    }
    double maxerr = 0, maxg = 0;
    for (int64_t i = 0; i < m.p.n_params; i++) {
        double want = 0.5 * ((double)g1[i] + g2[i]);
        maxerr = fmax(maxerr, fabs(m.p.grads[i] - want));
        maxg = fmax(maxg, fabs(want));
    }
    CHECK_MSG(maxerr <= 1e-5 * maxg, "accumulated gradient off by %g (max %g)", maxerr, maxg);
    fm_free(g1);
    fm_free(g2);
    fm_test_model_free(&m);
}

/* Router weights all zero: every token ties, so top-1 sends every token to expert 0 and the
 * other experts get nothing. Forward and backward stay finite, the idle experts' gradients are
 * exactly zero, expert 0's are not, and the rest of the gradient matches finite differences. */
static void test_all_tokens_one_expert(void) {
    fm_config cfg = small_config(FM_MODEL_MIXTRAL, false, 1);
    cfg.router_z_loss_coef = 0;
    fm_model m;
    CHECK(fm_test_model_create(&m, &cfg, g_be) == FM_OK);
    CHECK(fm_model_layout(&m, 2, 8, NULL) == FM_OK);
    fm_model_init_weights(&m, 11);
    for (int64_t l = 0; l < cfg.num_hidden_layers; l++)
        memset(m.p.w.layers[l].router, 0, sizeof(float) * (size_t)(cfg.num_experts * cfg.hidden_size));
    fill_batch(&m, 12);
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    fm_loss l;
    fm_schedule_default_forward(&m, fm_test_batch_of(&m), &l);
    CHECK(isfinite(l.ce) && isfinite(l.aux));
    for (int64_t lay = 0; lay < cfg.num_hidden_layers; lay++) {
        CHECK(m.a.acts[lay].moe.offsets[1] == m.a.N);
        CHECK(m.a.acts[lay].moe.offsets[cfg.num_experts] == m.a.N);
    }
    /* aux = coef * E * sum f_e P_e with f_0 = 1, P_e = 1/E: coef */
    CHECK_CLOSE(l.aux, cfg.router_aux_loss_coef, 1e-6);
    fm_schedule_default_backward(&m, 1.0f);
    const int64_t H = cfg.hidden_size, I = cfg.moe_intermediate_size;
    for (int64_t lay = 0; lay < cfg.num_hidden_layers; lay++) {
        const fm_layer_ptrs *g = &m.p.g.layers[lay];
        double e0 = 0, rest = 0;
        for (int64_t j = 0; j < I * H; j++) e0 += fabs(g->w_gate[j]);
        for (int64_t j = I * H; j < cfg.num_experts * I * H; j++) rest += fabs(g->w_gate[j]) + fabs(g->w_up[j]) + fabs(g->w_down[j]);
        CHECK(e0 > 0);
        CHECK(rest == 0);
    }
    double s = 0;
    for (int64_t i = 0; i < m.p.n_params; i++) s += m.p.grads[i];
    CHECK(isfinite(s));
    fm_test_model_free(&m);
}

/* The arenas a layout allocates hold exactly the hand-written bound formulas' bytes (the layout
 * sizes them by measuring itself, so they are compared with the formulas, not with that
 * measure), and the model state is weights and gradients of the parameter table's size. */
static void test_layout_measured(void) {
    fm_config cfg = small_config(FM_MODEL_QWEN3_MOE, false, 2);
    const int64_t B = 3, T = 10, N = B * T, L = cfg.num_hidden_layers;
    const size_t a = sizeof(fm_act);
    const fm_moe_dims d = {cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok};
    size_t want[FM_LIVE_COUNT];
    want[FM_LIVE_BOUNDARIES] = fm_model_boundary_bytes_chunked(&cfg, B, T, false, a);
    want[FM_LIVE_LAYER_ACTS] = (size_t)L * fm_model_layer_acts_bytes(&cfg, B, T, a);
    want[FM_LIVE_EXPERT] = (size_t)L * fm_moe_routes_bytes(&d, N, a) + fm_moe_ws_bytes(&d, N, false, a);
    want[FM_LIVE_WORKING_SET] = fm_model_working_set_bytes(&cfg, N, a);
    want[FM_LIVE_VOCAB] = fm_model_vocab_plain_bytes(&cfg, N, a);
    fm_model m;
    CHECK(fm_test_model_create(&m, &cfg, g_be) == FM_OK);
    CHECK(fm_model_layout(&m, B, T, NULL) == FM_OK);
    for (int i = 1; i < FM_LIVE_COUNT; i++)
        CHECK_MSG(m.a.arena[i].capacity == fm_arena_round(want[i]), "%s: arena %zu bytes, formula %zu",
                  fm_live_set_names[i], m.a.arena[i].capacity, want[i]);
    int64_t numel = 0;
    for (int i = 0; i < m.p.n_tensors; i++) numel += m.p.table[i].numel;
    CHECK(numel == m.p.n_params);
    size_t state = 2 * fm_arena_round((size_t)numel * a); /* weights and gradients */
    if (a != sizeof(float)) state += fm_arena_round((size_t)numel * sizeof(float)); /* the fp32 master */
    /* the model state is the parameter store's: its measured layout and its formula against the table */
    CHECK_MSG(fm_param_store_measure(m.p.n_params) == state && fm_param_store_bytes(&m.cfg, a) == state,
              "model state %zu bytes (formula %zu), table %zu", fm_param_store_measure(m.p.n_params),
              fm_param_store_bytes(&m.cfg, a), state);
    CHECK(fm_model_layout(&m, 1, 65, NULL) == FM_ERR_ARG); /* beyond max_position_embeddings */
    CHECK(strstr(fm_errmsg(), "max_position_embeddings") != NULL);
    fm_test_model_free(&m);
}

/* Chunked MoE (--moe-chunk-tokens) against the plain twin: the same loss, the same activation
 * gradients, expert weight gradients equal up to reassociation; its expert-dispatch memory is
 * one chunk's, independent of N and of the routing, while the plain twin's grows with N. */
static double rel_diff(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) { double d = (double)a[i] - b[i]; num += d * d; den += (double)b[i] * b[i]; }
    return sqrt(num / (den > 0 ? den : 1));
}

static int64_t g_ce_block = 0; /* linear cross-entropy token block for run_step (0: plain logits) */
static bool g_fused = false;   /* run_step uses fm_model_train_step */

static void run_step(fm_config *cfg, int64_t B, int64_t T, int64_t chunk, const bool *rc, bool zero_router,
                     float **grads_out, double *loss_out, size_t *expert_high) {
    fm_model m;
    CHECK(fm_test_model_create(&m, cfg, g_be) == FM_OK);
    fm_layout_opts lo = {rc, chunk, g_ce_block, g_ce_block ? 7 : 0};
    CHECK(fm_model_layout(&m, B, T, &lo) == FM_OK);
    fm_model_init_weights(&m, 5);
    if (zero_router)
        for (int64_t l = 0; l < cfg->num_hidden_layers; l++)
            memset(m.p.w.layers[l].router, 0, sizeof(float) * (size_t)(cfg->num_experts * cfg->hidden_size));
    fill_batch(&m, 6);
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    fm_loss l;
    if (g_fused) fm_schedule_default_train_step(&m, fm_test_batch_of(&m), 1.0f, &l);
    else {
        fm_schedule_default_forward(&m, fm_test_batch_of(&m), &l);
        fm_schedule_default_backward(&m, 1.0f);
    }
    *loss_out = l.ce + l.aux + l.z;
    /* every arena a step fills: its measured (painted) high-water mark within [90%, 100%] of the
     * planned bound, for every model_type and memory flag this test runs */
    for (int i = 1; i < FM_LIVE_COUNT; i++) {
        const size_t hw = fm_arena_touched(&m.a.arena[i]), cap = m.a.arena[i].capacity;
        CHECK_MSG(hw <= cap && hw * 10 >= cap * 9, "%s chunk %lld ce %lld: %s high-water %zu vs bound %zu",
                  cfg->model_type_name, (long long)chunk, (long long)g_ce_block, fm_live_set_names[i], hw, cap);
    }
    *grads_out = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
    memcpy(*grads_out, m.p.grads, sizeof(float) * (size_t)m.p.n_params);
    if (expert_high) *expert_high = fm_arena_touched(&m.a.arena[FM_LIVE_EXPERT]); /* measured */
    fm_test_model_free(&m);
}

static void test_moe_chunked_ab(void) {
    const fm_model_type types[3] = {FM_MODEL_QWEN3_MOE, FM_MODEL_OLMOE, FM_MODEL_MIXTRAL};
    for (int t = 0; t < 3; t++) {
        fm_config cfg = small_config(types[t], t == 2, 2);
        const int64_t B = 2, T = 11, N = B * T;
        float *ref;
        double ref_loss;
        run_step(&cfg, B, T, 0, NULL, false, &ref, &ref_loss, NULL);
        int64_t n_params = fm_config_num_params(&cfg);
        const int64_t chunks[4] = {1, 3, 7, N};
        for (int c = 0; c < 4; c++) {
            float *g;
            double loss;
            run_step(&cfg, B, T, chunks[c], NULL, false, &g, &loss, NULL);
            /* bit-identical where the BLAS computes each row the same whatever the row count
             * (OpenBLAS on the CI's AMD EPYC); not on Xeon's AVX-512 kernels: 1e-6 relative */
            CHECK_MSG(fabs(loss - ref_loss) <= 1e-6 * fabs(ref_loss), "%s chunk %lld: loss %.17g vs plain %.17g",
                      cfg.model_type_name, (long long)chunks[c], loss, ref_loss);
            double e = rel_diff(g, ref, n_params);
            CHECK_MSG(e < 1e-6, "%s chunk %lld: gradients differ from the plain twin by %g", cfg.model_type_name,
                      (long long)chunks[c], e);
            fm_free(g);
        }
        /* chunked + full recompute */
        bool rc[2] = {true, true};
        float *g;
        double loss;
        run_step(&cfg, B, T, 4, rc, false, &g, &loss, NULL);
        CHECK_CLOSE(loss, ref_loss, 1e-6);
        CHECK(rel_diff(g, ref, n_params) < 1e-6);
        fm_free(g);
        fm_free(ref);
    }
}

/* Strided chunk membership (PipelinedLLEP): chunk j holds tokens j, j+K, j+2K, ... in order, the
 * chunks together hold every token once, and no chunk exceeds c_eff = ceil(N/K). */
static void test_chunk_order(void) {
    const int64_t cases[4][2] = {{22, 4}, {22, 22}, {7, 100}, {1000, 3}};
    for (int c = 0; c < 4; c++) {
        const int64_t N = cases[c][0];
        int64_t K, c_eff;
        fm_moe_chunks(N, cases[c][1], &K, &c_eff);
        CHECK(K == (cases[c][1] >= N ? 1 : (N + cases[c][1] - 1) / cases[c][1]));
        CHECK(c_eff == (N + K - 1) / K && c_eff <= cases[c][1] + (cases[c][1] >= N ? N : 0));
        int32_t *order = fm_malloc(sizeof(int32_t) * (size_t)N);
        int *seen = fm_malloc(sizeof(int) * (size_t)N);
        fm_moe_chunk_order(order, N, K);
        int64_t p = 0;
        bool ok = true;
        for (int64_t j = 0; j < K; j++) {
            const int64_t n = (N - j + K - 1) / K;
            ok &= n <= c_eff;
            for (int64_t i = 0; i < n; i++, p++) {
                ok &= order[p] == j + i * K;
                seen[order[p]]++;
            }
        }
        ok &= p == N;
        for (int64_t t = 0; t < N; t++) ok &= seen[t] == 1;
        CHECK_MSG(ok, "chunk order wrong for N=%lld K=%lld", (long long)N, (long long)K);
        fm_free(order);
        fm_free(seen);
    }
}

static void test_moe_chunked_bound(void) {
    fm_config cfg = small_config(FM_MODEL_MIXTRAL, false, 2);
    const fm_moe_dims d = {cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok};
    const int64_t c = 4;
    size_t chunk_bytes[2], plain_bytes[2];
    for (int i = 0; i < 2; i++) {
        const int64_t T = i ? 32 : 8; /* N = 16, 64 */
        float *g, *gp;
        double loss, lossp;
        /* adversarial routing: router weights zero, every token ties -> experts 0 and 1 get all */
        run_step(&cfg, 2, T, c, NULL, true, &g, &loss, &chunk_bytes[i]);
        run_step(&cfg, 2, T, 0, NULL, true, &gp, &lossp, &plain_bytes[i]);
        CHECK_CLOSE(loss, lossp, 1e-6);
        CHECK(rel_diff(g, gp, fm_config_num_params(&cfg)) < 1e-6);
        CHECK_MSG(chunk_bytes[i] <= fm_arena_round(fm_moe_ws_bytes(&d, c, true, sizeof(fm_act))),
                  "chunked expert set %zu exceeds its bound %zu", chunk_bytes[i], fm_moe_ws_bytes(&d, c, true, sizeof(fm_act)));
        fm_free(g);
        fm_free(gp);
    }
    CHECK_MSG(chunk_bytes[0] == chunk_bytes[1], "chunked expert memory grew with N: %zu -> %zu", chunk_bytes[0], chunk_bytes[1]);
    CHECK_MSG(plain_bytes[1] >= 3 * plain_bytes[0], "plain twin expert memory should grow with N: %zu -> %zu",
              plain_bytes[0], plain_bytes[1]);
    printf("expert dispatch bytes: chunked (c=%lld) %zu at N=16 and %zu at N=64; plain %zu and %zu\n", (long long)c,
           chunk_bytes[0], chunk_bytes[1], plain_bytes[0], plain_bytes[1]);
}

/* Linear cross-entropy in the model against plain logits: loss and gradients equal up to fp32
 * reassociation, through forward+backward and the fused train step, alone and with chunked MoE
 * and recompute. */
static void test_linear_ce_ab(void) {
    const fm_model_type types[3] = {FM_MODEL_QWEN3_MOE, FM_MODEL_OLMOE, FM_MODEL_MIXTRAL};
    for (int t = 0; t < 3; t++) {
        fm_config cfg = small_config(types[t], t == 1, 2);
        float *ref;
        double ref_loss;
        g_ce_block = 0;
        g_fused = false;
        run_step(&cfg, 2, 9, 0, NULL, false, &ref, &ref_loss, NULL);
        const int64_t n_params = fm_config_num_params(&cfg);
        for (int v = 0; v < 4; v++) {
            bool rc[2] = {true, true};
            g_ce_block = v == 0 ? 5 : 4;
            g_fused = v >= 1;
            float *g;
            double loss;
            run_step(&cfg, 2, 9, v >= 2 ? 4 : 0, v == 3 ? rc : NULL, false, &g, &loss, NULL);
            CHECK_MSG(fabs(loss - ref_loss) <= 1e-6 * fabs(ref_loss), "%s linear CE variant %d: loss %.9g vs %.9g",
                      cfg.model_type_name, v, loss, ref_loss);
            double e = rel_diff(g, ref, n_params);
            CHECK_MSG(e < 2e-6, "%s linear CE variant %d: gradients differ by %g", cfg.model_type_name, v, e);
            fm_free(g);
        }
        g_ce_block = 0;
        g_fused = false;
        fm_free(ref);
    }
}

/* A small deepseek_v3 (model/fm_mla.h): glm4_moe's block (layer 0 dense, sigmoid router with groups,
 * a shared expert) with multi-head latent attention: 4 heads, q/k head dim 6 + 4 (rope), v 8 (padded
 * to 10), latents kv 8 and q 10 (q_lora, else q_proj), YaRN with mscale_all_dim (softmax factor
 * m(4, 1)^2 = 1.29) and rope_interleave as asked. */
static fm_config mla_config(bool q_lora, bool interleave) {
    fm_config c = fm_test_small_config(FM_MODEL_QWEN3_MOE, 3, false, 2);
    c.model_type = FM_MODEL_DEEPSEEK_V3;
    snprintf(c.model_type_name, sizeof c.model_type_name, "deepseek_v3");
    c.num_experts = 6;
    c.router_sigmoid = true;
    c.n_group = 3;
    c.topk_group = 2;
    c.routed_scaling_factor = 2.5;
    c.n_shared_experts = 1;
    c.first_k_dense_replace = 1;
    c.dense_intermediate_size = 20;
    c.router_aux_loss_coef = c.router_z_loss_coef = 0;
    c.qk_norm = FM_QK_NORM_NONE;
    c.mla = true;
    c.q_lora_rank = q_lora ? 10 : 0;
    c.kv_lora_rank = 8;
    c.qk_nope_head_dim = 6;
    c.qk_rope_head_dim = 4;
    c.v_head_dim = 8;
    c.rope_interleave = interleave;
    c.num_key_value_heads = c.num_attention_heads;
    c.head_dim = 10;
    c.rope_scaling = (fm_rope_scaling){FM_ROPE_YARN, 4.0, 16, 32, 1, 1.0, 1.0, 0, true};
    return c;
}

/* deepseek_v2 (fm_config_deepseek_v2.c): deepseek_v3's MLA and MoE layout with DeepSeek-V2's softmax
 * router (group_limited_greedy: 3 groups of 2 keeping 2, or greedy), scaling 2.5, two shared experts. */
static fm_config v2_config(bool group_limited) {
    fm_config c = mla_config(group_limited, true);
    c.model_type = FM_MODEL_DEEPSEEK_V2;
    snprintf(c.model_type_name, sizeof c.model_type_name, "deepseek_v2");
    c.router_sigmoid = false;
    c.router_group_limited = group_limited;
    c.n_shared_experts = 2;
    c.norm_topk_prob = false;
    return c;
}

int main(void) {
    uint64_t seed = fm_test_seed(42);
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    test_real_configs();
    test_bad_configs();
    check_model_grad(small_config(FM_MODEL_QWEN3_MOE, false, 2), "qwen3_moe", seed);
    check_model_grad(small_config(FM_MODEL_OLMOE, false, 3), "olmoe", seed + 10);
    check_model_grad(small_config(FM_MODEL_MIXTRAL, true, 2), "mixtral (tied)", seed + 20);
    /* heads x head_dim < hidden_size: d ln1 gets its own buffer (else it reuses dq or datt) */
    fm_config narrow = small_config(FM_MODEL_QWEN3_MOE, false, 2);
    narrow.head_dim = 4;
    check_model_grad(narrow, "qwen3_moe (heads x head_dim < hidden)", seed + 30);
    narrow = small_config(FM_MODEL_MIXTRAL, false, 2);
    narrow.head_dim = 4;
    check_model_grad(narrow, "mixtral (heads x head_dim < hidden)", seed + 40);
    /* qwen3_moe with dense layers (decoder_sparse_step 2, mlp_only_layers [0]: layers 0 and 2
     * dense, 1 and 3 MoE): the dense MLP's weights and everything below them */
    fm_config dense = fm_test_small_config(FM_MODEL_QWEN3_MOE, 4, false, 2);
    fm_test_dense_layers(&dense, 20);
    check_model_grad(dense, "qwen3_moe (dense layers 0, 2)", seed + 50);
    /* glm4_moe: layer 0 dense, 1 and 2 MoE with DeepSeek-V3's router (sigmoid, 3 groups keeping 2,
     * scaling 2.5, a random selection bias) and a shared expert: every gradient, the shared
     * expert's and everything below it; the bias's is zero and its finite difference too. Measured
     * at seed offsets 60-64: worst relative errors 2.9e-3 to 6.3e-3, but offset 60's layer-0
     * input_layernorm at 3.2e-2 (and, at eps 3e-3, another layer-0 tensor at 3.6e-2 while that one
     * passed): finite-difference noise on deep small gradients (|g| ~5e-3) at routed scale 2.5;
     * offset 63 runs. Without the shared experts' d ln2 (a mutation) 46 tensors fail, worst 4.5. */
    fm_config glm = fm_test_small_config(FM_MODEL_QWEN3_MOE, 3, false, 2);
    glm.model_type = FM_MODEL_GLM4_MOE;
    snprintf(glm.model_type_name, sizeof glm.model_type_name, "glm4_moe");
    glm.num_experts = 6;
    glm.router_sigmoid = true;
    glm.n_group = 3;
    glm.topk_group = 2;
    glm.routed_scaling_factor = 2.5;
    glm.n_shared_experts = 1;
    glm.first_k_dense_replace = 1;
    glm.dense_intermediate_size = 20;
    glm.router_aux_loss_coef = glm.router_z_loss_coef = 0;
    check_model_grad(glm, "glm4_moe (dense layer 0, shared experts, sigmoid router)", seed + 63);
    /* deepseek_v3: every MLA gradient (q_a_proj, q_a_layernorm, q_b_proj or q_proj,
     * kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj) and everything below them */
    check_model_grad(mla_config(true, true), "deepseek_v3 (MLA, q_lora_rank, interleaved RoPE)", seed + 70);
    check_model_grad(mla_config(false, false), "deepseek_v3 (MLA, q_proj, rotate_half RoPE)", seed + 71);
    /* deepseek_v2: the softmax router's gradient through routed_scaling_factor (no renormalization),
     * both topk_methods, with MLA and the shared experts below. Measured worst relative errors
     * (default / OPENBLAS_CORETYPE=Haswell with one thread): offset 80 5.8e-3 / 5.4e-3; greedy at
     * offsets 81-86 1.1e-2 / 1.4e-2, 3.4e-3 / 5.8e-3, 5.1e-3 / 6.1e-3, 4.8e-3 / 3.5e-3, 5.1e-3 / 2.0e-3,
     * 7.0e-3 / 1.4e-2 (layer-0 tensors, deep small gradients, as glm4_moe's above; at 84 and 85
     * routing flips leave tensors unchecked): 82 runs, every tensor checked under both. */
    check_model_grad(v2_config(true), "deepseek_v2 (group_limited_greedy, q_lora_rank)", seed + 80);
    check_model_grad(v2_config(false), "deepseek_v2 (greedy, q_proj)", seed + 82);
    test_recompute_exact();
    test_accumulation();
    test_all_tokens_one_expert();
    test_layout_measured();
    test_moe_chunked_ab();
    test_chunk_order();
    test_moe_chunked_bound();
    test_linear_ce_ab();
    test_batch_argument();
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
