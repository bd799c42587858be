/* The keep-attention recompute policy (schedule/fm_recompute.h): a recomputed layer that keeps
 * its attention output and log-sum-exp gives gradients and loss bit-identical (memcmp) to full
 * recompute and to no recompute on the CPU backend, for each model_type, with the chunked MoE
 * on and off, through forward + backward and the fused train step; a probe (a counting
 * attention_fwd in a copy of the CPU op table) shows that backward never runs the attention
 * forward of a keep-attention layer and runs it once for each fully recomputed one; the layer
 * activations' capacity equals the policy's bound; the policy's counts and errors. */
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "model/fm_model.h"
#include "schedule/fm_schedule.h"

static fm_backend g_be;   /* the CPU backend */
static fm_ops g_count_ops; /* its op table with a counting attention_fwd */
static const fm_ops *g_cpu_ops;
static int64_t g_att_fwd_calls;

static void counting_attention_fwd(void *ctx, fm_act *out, float *lse, const fm_act *q, const fm_act *k,
                                   const fm_act *v, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                                   const int32_t *kv_start) {
    g_att_fwd_calls++;
    g_cpu_ops->attention_fwd(ctx, out, lse, q, k, v, B, T, nh, nkv, hd, kv_start);
}



enum { B_ = 2, T_ = 9, L_ = 3 };

static fm_config small_config(fm_model_type t) { return fm_test_small_config(t, L_, t == FM_MODEL_MIXTRAL, 2); }
static void fill_batch(fm_model *m, uint64_t seed) { fm_test_fill_batch(m, seed, 3); }

/* A policy: rc, keep per layer (3 layers). */
typedef struct {
    const char *name;
    bool rc[L_], keep[L_];
} policy;

static const policy k_policies[] = {
    {"none", {0, 0, 0}, {0, 0, 0}},
    {"full", {1, 1, 1}, {0, 0, 0}},
    {"keep-attention, all layers", {1, 1, 1}, {1, 1, 1}},
    {"keep-attention on layers 1,2 (0 kept)", {0, 1, 1}, {1, 1, 1}},
    {"keep-attention on layer 1, full on 0 and 2", {1, 1, 1}, {0, 1, 0}},
    {"keep-attention on layer 0, full on 2, 1 kept", {1, 0, 1}, {1, 1, 0}},
};
#define N_POLICIES ((int)(sizeof k_policies / sizeof k_policies[0]))

/* One step of policy pol; returns grads (caller frees) and the loss; checks the attention-forward
 * count of backward and the layer activations' capacity against the bound. */
static float *run(const fm_config *cfg, const policy *pol, int64_t chunk, bool fused, double *loss) {
    fm_backend be = {&g_count_ops, g_be.ctx};
    fm_model m;
    CHECK(fm_test_model_create(&m, cfg, be) == FM_OK);
    fm_layout_opts lo = {pol->rc, chunk, 0, 0, 0, pol->keep};
    CHECK(fm_model_layout(&m, B_, T_, &lo) == FM_OK);
    fm_model_init_weights(&m, 7);
    fill_batch(&m, 8);
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    fm_loss l;
    int64_t n_full = 0, r = 0, r_att = 0;
    for (int i = 0; i < L_; i++) {
        r += pol->rc[i];
        r_att += pol->rc[i] && pol->keep[i];
        n_full += pol->rc[i] && !pol->keep[i];
    }
    g_att_fwd_calls = 0;
    if (fused) {
        CHECK(fm_schedule_default_train_step(&m, fm_test_batch_of(&m), 1.0f, &l) == FM_OK);
        CHECK_MSG(g_att_fwd_calls == L_ + n_full, "%s %s: %lld attention forwards in a step, expected %lld",
                  cfg->model_type_name, pol->name, (long long)g_att_fwd_calls, (long long)(L_ + n_full));
    } else {
        CHECK(fm_schedule_default_forward(&m, fm_test_batch_of(&m), &l) == FM_OK);
        CHECK(g_att_fwd_calls == L_);
        g_att_fwd_calls = 0;
        CHECK(fm_schedule_default_backward(&m, 1.0f) == FM_OK);
        CHECK_MSG(g_att_fwd_calls == n_full, "%s %s: %lld attention forwards in backward, expected %lld (the fully "
                  "recomputed layers only)", cfg->model_type_name, pol->name, (long long)g_att_fwd_calls,
                  (long long)n_full);
    }
    *loss = l.ce + l.aux + l.z;
    /* the bound beside the policy: saved sets + kept attention outputs */
    const fm_recompute_policy rp = {pol->rc, L_, pol->keep};
    CHECK(fm_recompute_count(&rp) == r && fm_recompute_keep_attention_count(&rp) == r_att);
    const size_t want = (size_t)fm_recompute_saved_sets(&rp) * fm_model_layer_acts_bytes(cfg, B_, T_, sizeof(fm_act)) +
                        (size_t)r_att * fm_model_kept_attention_bytes(cfg, B_, T_, sizeof(fm_act));
    CHECK_MSG(m.a.arena[FM_LIVE_LAYER_ACTS].capacity == fm_arena_round(want), "%s %s: layer activations %zu, bound %zu",
              cfg->model_type_name, pol->name, m.a.arena[FM_LIVE_LAYER_ACTS].capacity, want);
    /* what the step wrote fills each arena's bound (the kept attention outputs are written) */
    for (int i = 1; i < FM_LIVE_COUNT; i++) {
        const size_t hw = fm_arena_touched(&m.a.arena[i]), cap = m.a.arena[i].capacity;
        CHECK_MSG(hw <= cap && hw * 10 >= cap * 9, "%s %s: %s wrote %zu of its %zu bytes", cfg->model_type_name,
                  pol->name, fm_live_set_names[i], hw, cap);
    }
    float *g = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
    memcpy(g, m.p.grads, sizeof(float) * (size_t)m.p.n_params);
    fm_test_model_free(&m);
    return g;
}

static void test_bit_identical(void) {
    const fm_model_type types[3] = {FM_MODEL_QWEN3_MOE, FM_MODEL_OLMOE, FM_MODEL_MIXTRAL};
    const int64_t chunks[2] = {0, 4};
    for (int t = 0; t < 3; t++)
        for (int c = 0; c < 2; c++)
            for (int fused = 0; fused < 2; fused++) {
                const fm_config cfg = small_config(types[t]);
                const int64_t np = fm_config_num_params(&cfg);
                double ref_loss;
                float *ref = run(&cfg, &k_policies[0], chunks[c], fused, &ref_loss);
                for (int p = 1; p < N_POLICIES; p++) {
                    double loss;
                    float *g = run(&cfg, &k_policies[p], chunks[c], fused, &loss);
                    CHECK_MSG(memcmp(g, ref, sizeof(float) * (size_t)np) == 0,
                              "%s chunk %lld %s, %s: gradients differ from no recompute", cfg.model_type_name,
                              (long long)chunks[c], fused ? "train step" : "forward+backward", k_policies[p].name);
                    CHECK_MSG(loss == ref_loss, "%s chunk %lld, %s: loss %.17g vs %.17g", cfg.model_type_name,
                              (long long)chunks[c], k_policies[p].name, loss, ref_loss);
                    fm_free(g);
                }
                fm_free(ref);
            }
}

/* Keep-attention saves less than no recompute and costs more than full recompute, by exactly
 * the kept attention outputs; the measured layout (fm_model_plan_bytes) agrees. */
static void test_bound(void) {
    const fm_config cfg = small_config(FM_MODEL_OLMOE);
    const policy *none = &k_policies[0], *full = &k_policies[1], *ka = &k_policies[2];
    size_t bn[FM_LIVE_COUNT], bf[FM_LIVE_COUNT], bk[FM_LIVE_COUNT];
    fm_layout_opts o0 = {none->rc, 0, 0, 0, 0, none->keep}, o1 = {full->rc, 0, 0, 0, 0, full->keep},
                   o2 = {ka->rc, 0, 0, 0, 0, ka->keep};
    fm_model_plan_bytes(&cfg, B_, T_, &o0, bn);
    fm_model_plan_bytes(&cfg, B_, T_, &o1, bf);
    fm_model_plan_bytes(&cfg, B_, T_, &o2, bk);
    CHECK(bk[FM_LIVE_LAYER_ACTS] == bf[FM_LIVE_LAYER_ACTS] + L_ * fm_model_kept_attention_bytes(&cfg, B_, T_, 4));
    CHECK(bk[FM_LIVE_LAYER_ACTS] < bn[FM_LIVE_LAYER_ACTS]);
    for (int i = 0; i < FM_LIVE_COUNT; i++)
        if (i != FM_LIVE_LAYER_ACTS) CHECK(bk[i] == bf[i]);
    /* by hand: att [N, 4*6] fp32 and lse [2, 4, 9] fp32, each rounded */
    CHECK(fm_model_kept_attention_bytes(&cfg, B_, T_, 4) ==
          fm_arena_round(B_ * T_ * 24 * 4) + fm_arena_round(B_ * 4 * T_ * 4));
    /* keep flags on layers that are not recomputed change nothing */
    bool rc0[L_] = {0, 0, 0}, all[L_] = {1, 1, 1};
    fm_layout_opts o3 = {rc0, 0, 0, 0, 0, all};
    size_t b3[FM_LIVE_COUNT];
    fm_model_plan_bytes(&cfg, B_, T_, &o3, b3);
    CHECK(memcmp(b3, bn, sizeof bn) == 0);
}

/* The policy's helpers and errors. */
static void test_policy(void) {
    bool rc[4], keep[4];
    CHECK(fm_recompute_parse("none", 4, rc) == FM_OK);
    CHECK(fm_recompute_keep_attention_fill(true, true, rc, 4, keep) == FM_ERR_ARG);
    CHECK(strstr(fm_errmsg(), "--recompute-keep-attention") != NULL);
    CHECK(fm_recompute_keep_attention_fill(true, false, rc, 4, keep) == FM_OK); /* the chooser decides */
    CHECK(fm_recompute_parse("1,3", 4, rc) == FM_OK);
    CHECK(fm_recompute_keep_attention_fill(true, true, rc, 4, keep) == FM_OK);
    fm_recompute_policy p = {rc, 4, keep};
    CHECK(fm_recompute_count(&p) == 2 && fm_recompute_keep_attention_count(&p) == 2);
    CHECK(fm_recompute_keeps_attention(&p, 1) && !fm_recompute_keeps_attention(&p, 0));
    CHECK(fm_recompute_keep_attention_fill(false, true, rc, 4, keep) == FM_OK);
    CHECK(fm_recompute_keep_attention_count(&p) == 0);
    fm_recompute_policy q = {rc, 4, NULL};
    CHECK(fm_recompute_keep_attention_count(&q) == 0);

    /* a recompute without attention where the layout kept none is refused */
    const fm_config cfg = small_config(FM_MODEL_MIXTRAL);
    fm_model m;
    CHECK(fm_test_model_create(&m, &cfg, g_be) == FM_OK);
    bool rcf[L_] = {1, 1, 1};
    fm_layout_opts lo = {rcf, 0, 0, 0, 0, NULL};
    CHECK(fm_model_layout(&m, B_, T_, &lo) == FM_OK);
    CHECK(fm_model_layer_recompute(&m, 1, fm_model_grad_buffer(&m, 1), true) == FM_ERR_ARG);
    CHECK(strstr(fm_errmsg(), "keeps no attention output") != NULL);
    fm_test_model_free(&m);
}

int main(void) {
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    g_cpu_ops = g_be.ops;
    g_count_ops = *g_be.ops;
    g_count_ops.attention_fwd = counting_attention_fwd;
    test_policy();
    test_bound();
    test_bit_identical();
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
