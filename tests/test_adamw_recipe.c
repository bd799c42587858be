/* The state recipes of --master-weights (backend/fm_adamw_lowp.h) on the CPU backend:
 * - adamw_bf16w against its fp32 bit model (tests/fm_ref_ops.c: fm_ref_adamw_bf16w), bit for bit,
 *   Kahan and stochastic rounding, steps 1 and 5; bf16 moments give the fp32-moment weights from
 *   moments bf16 holds exactly;
 * - Kahan: 200 updates of 5% of a bf16 ulp each, against fp64 AdamW: within one bf16 ulp of the
 *   fp64 weights (the bound derived below), where plain rounding to nearest (the same op with the
 *   buffer zeroed before each step) loses every update and is off by more than 4 ulps;
 * - stochastic rounding: each result is one of the two bf16 neighbours of the fp32 sum, and the
 *   mean over 16 seeds x 65,536 elements is the fp32 sum within 5 standard errors; the same key
 *   gives the same bits, another key other bits, and any split of the range into launches the
 *   same bits;
 * - the bytes: the optimizer's state and the store per recipe, the model-state bound against the
 *   arena the trainer allocates, and 16 / 14 / 12 / 10 / 8 B/param on a bf16 target. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_ref_ops.h"
#include "fm_test.h"
#include "plan/fm_plan.h"
#include "plan/fm_plan_report.h"
#include "train/fm_optim.h"

static fm_backend g_be;
static fm_rng g_rng;

static float bf16v(float x) { return fm_bf16_to_f32(fm_f32_to_bf16(x)); }
static float normal(void) { return (float)fm_rng_normal(&g_rng); }

/* adamw_bf16w against the bit model, n elements (vector and scalar paths are one loop here). */
static void test_bits(bool kahan, int step, float wd, float gs) {
    const int64_t n = 3001;
    const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
    const float bc1 = 1.0f - powf(b1, (float)step), bc2 = 1.0f - powf(b2, (float)step);
    float *p = malloc(4 * n), *g = malloc(4 * n), *m = malloc(4 * n), *v = malloc(4 * n);
    float *p2 = malloc(4 * n), *m2 = malloc(4 * n), *v2 = malloc(4 * n);
    uint16_t *c = malloc(2 * n), *c2 = malloc(2 * n), *mh = malloc(2 * n), *vh = malloc(2 * n);
    for (int64_t i = 0; i < n; i++) {
        p[i] = bf16v(normal());
        g[i] = normal();
        m[i] = step > 1 ? bf16v(0.1f * normal()) : 0.0f;
        v[i] = step > 1 ? bf16v(0.01f * fabsf(normal())) : 0.0f;
        c[i] = fm_f32_to_bf16(kahan ? 1e-3f * normal() : 0.0f);
        mh[i] = fm_f32_to_bf16(m[i]);
        vh[i] = fm_f32_to_bf16(v[i]);
    }
    memcpy(p2, p, 4 * n), memcpy(m2, m, 4 * n), memcpy(v2, v, 4 * n), memcpy(c2, c, 2 * n);
    float *p0 = malloc(4 * n);
    uint16_t *c0 = malloc(2 * n);
    memcpy(p0, p, 4 * n), memcpy(c0, c, 2 * n);
    const uint64_t key = fm_sr_key(7, step);
    g_be.ops->adamw_bf16w(g_be.ctx, p, g, kahan ? c : NULL, m, v, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, gs,
                          key, 1000);
    fm_ref_adamw_bf16w(p2, g, kahan ? c2 : NULL, m2, v2, n, lr, b1, b2, eps, wd, bc1, bc2, gs, key, 1000);
    CHECK_MSG(!memcmp(p, p2, 4 * n) && !memcmp(m, m2, 4 * n) && !memcmp(v, v2, 4 * n) && (!kahan || !memcmp(c, c2, 2 * n)),
              "adamw_bf16w %s step %d: differs from the bit model", kahan ? "kahan" : "sr", step);
    int64_t notbf = 0;
    for (int64_t i = 0; i < n; i++) notbf += p[i] != bf16v(p[i]);
    CHECK_MSG(notbf == 0, "adamw_bf16w %s: %lld weights are not bf16 values", kahan ? "kahan" : "sr", (long long)notbf);
    /* bf16 moments: from the same (bf16-exact) moments, the same weights and buffer; the moments
     * the fp32 ones rounded to nearest even */
    float *p3 = malloc(4 * n);
    uint16_t *c3 = malloc(2 * n);
    memcpy(p2, p0, 4 * n), memcpy(p3, p0, 4 * n), memcpy(c2, c0, 2 * n), memcpy(c3, c0, 2 * n);
    for (int64_t i = 0; i < n; i++) m2[i] = fm_bf16_to_f32(mh[i]), v2[i] = fm_bf16_to_f32(vh[i]);
    g_be.ops->adamw_bf16w(g_be.ctx, p2, g, kahan ? c2 : NULL, m2, v2, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, gs,
                          key, 0);
    g_be.ops->adamw_bf16w(g_be.ctx, p3, g, kahan ? c3 : NULL, mh, vh, FM_DTYPE_BF16, n, lr, b1, b2, eps, wd, bc1, bc2,
                          gs, key, 0);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += p2[i] != p3[i] || mh[i] != fm_f32_to_bf16(m2[i]) || vh[i] != fm_f32_to_bf16(v2[i]) ||
               (kahan && c2[i] != c3[i]);
    CHECK_MSG(bad == 0, "adamw_bf16w %s bf16 moments: %lld elements differ from the fp32-moment step",
              kahan ? "kahan" : "sr", (long long)bad);
    free(p), free(g), free(m), free(v), free(p2), free(m2), free(v2), free(c), free(c2), free(mh), free(vh), free(p3),
        free(c3), free(p0), free(c0);
}

/* Kahan against fp64 AdamW over K steps of updates far below a bf16 ulp.
 * Weights in [1.1, 1.9] (bf16 ulp u = 2^-7), lr = 0.05 u; with gradients of one sign and unit
 * spread the normalized step |m^/sqrt(v^)| stays near 1 and |d| ~ lr (1 + wd w) < 0.06 u. The
 * fp64 run keeps the exact sum; plain rounding to nearest drops every update (|d| < u/2), so after
 * K = 200 steps it is off by several u. With Kahan the value w + c follows the exact sum up to the
 * rounding of c to bf16 at each step (|c| <= u/2 + |d| < 2^-8, so that rounding is at most
 * 2^-16 = u/512) and the fp32 arithmetic (relative 2^-24 of values below 2: u/2^17): after K steps
 * |w + c - exact| <= K (u/512 + u/2^17) < 0.4 u, and the weight alone is within |c| < 0.56 u more:
 * |w - exact| < 0.96 u. Checked: <= 1 u. */
static void test_kahan_vs_fp64(void) {
    const int64_t n = 4096, K = 200;
    const float u = 1.0f / 128.0f, lr = 0.05f * u, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    float *p = malloc(4 * n), *pp = malloc(4 * n), *g = malloc(4 * n), *m = malloc(4 * n), *v = malloc(4 * n),
          *m2 = malloc(4 * n), *v2 = malloc(4 * n);
    uint16_t *c = calloc((size_t)n, 2), *c0 = calloc((size_t)n, 2);
    double *w = malloc(8 * n), *md = calloc((size_t)n, 8), *vd = calloc((size_t)n, 8);
    for (int64_t i = 0; i < n; i++) {
        p[i] = pp[i] = bf16v(1.1f + 0.8f * (float)fm_rng_uniform(&g_rng));
        w[i] = p[i];
        m[i] = v[i] = m2[i] = v2[i] = 0.0f;
    }
    for (int64_t s = 1; s <= K; s++) {
        const float bc1 = 1.0f - powf(b1, (float)s), bc2 = 1.0f - powf(b2, (float)s);
        for (int64_t i = 0; i < n; i++) g[i] = 0.5f + normal(); /* biased: the updates add up */
        g_be.ops->adamw_bf16w(g_be.ctx, p, g, c, m, v, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, 1.0f, 0, 0);
        memset(c0, 0, 2 * (size_t)n); /* plain rounding to nearest: the same op, no compensation carried */
        g_be.ops->adamw_bf16w(g_be.ctx, pp, g, c0, m2, v2, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, 1.0f, 0, 0);
        const double dbc1 = 1.0 - pow(b1, (double)s), dbc2 = 1.0 - pow(b2, (double)s);
        for (int64_t i = 0; i < n; i++) {
            md[i] = b1 * md[i] + (1.0 - b1) * g[i];
            vd[i] = b2 * vd[i] + (1.0 - b2) * (double)g[i] * g[i];
            w[i] -= lr * ((md[i] / dbc1) / (sqrt(vd[i] / dbc2) + eps) + wd * w[i]);
        }
    }
    double ek = 0, ep = 0, sk = 0, sp = 0;
    for (int64_t i = 0; i < n; i++) {
        ek = fmax(ek, fabs(p[i] - w[i])), ep = fmax(ep, fabs(pp[i] - w[i]));
        sk += fabs(p[i] - w[i]), sp += fabs(pp[i] - w[i]);
    }
    printf("kahan: max |w - fp64| %.3g ulp (mean %.3g); round to nearest: max %.3g ulp (mean %.3g)\n", ek / u,
           sk / n / u, ep / u, sp / n / u);
    CHECK_MSG(ek <= u, "bf16-kahan is %.3g bf16 ulps from fp64 AdamW after %lld steps (bound: 1)", ek / u, (long long)K);
    CHECK_MSG(ep > 4 * u, "plain rounding to nearest is only %.3g ulps off: the test's updates are not below an ulp",
              ep / u);
    CHECK_MSG(sk < 0.1 * sp, "bf16-kahan's mean error %.3g is not a tenth of plain rounding's %.3g", sk / n, sp / n);
    free(p), free(pp), free(g), free(m), free(v), free(m2), free(v2), free(c), free(c0), free(w), free(md), free(vd);
}

/* Stochastic rounding: unbiased over seeds, two neighbours only, reproducible, split-invariant. */
static void test_sr(void) {
    const int64_t n = 65536, S = 16;
    const float u = 1.0f / 256.0f; /* bf16 ulp in [0.5, 1) */
    const float lr = 0.3f * u, b1 = 0.9f, b2 = 0.95f, eps = 0.0f, bc1 = 1.0f - b1, bc2 = 1.0f - b2;
    float *p = malloc(4 * n), *q = malloc(4 * n), *g = malloc(4 * n), *m = malloc(4 * n), *v = malloc(4 * n),
          *x = malloc(4 * n), *first = malloc(4 * n);
    /* the fp32 sum w + d, from the fp32-master op on the same inputs (its weights are the master) */
    for (int64_t i = 0; i < n; i++) x[i] = 1.0f, g[i] = 1.0f, m[i] = v[i] = 0.0f;
    g_be.ops->adamw(g_be.ctx, x, g, NULL, m, v, FM_DTYPE_F32, n, lr, b1, b2, eps, 0.0f, bc1, bc2, 1.0f);
    const double xs = x[0];
    const float lo = fm_bf16_to_f32((uint16_t)(fm_f32_to_bf16(x[0]) - (bf16v(x[0]) > x[0]))), hi = lo + u;
    CHECK_MSG(xs > lo && xs < hi && x[0] == x[n - 1], "sr setup: x %.9g not between %.9g and %.9g", xs, lo, hi);
    const double pr = (xs - lo) / u, se = u * sqrt(pr * (1.0 - pr) / (double)(n * S));
    double sum = 0;
    int64_t outside = 0;
    for (int64_t s = 0; s < S; s++) {
        for (int64_t i = 0; i < n; i++) p[i] = 1.0f, m[i] = v[i] = 0.0f;
        g_be.ops->adamw_bf16w(g_be.ctx, p, g, NULL, m, v, FM_DTYPE_F32, n, lr, b1, b2, eps, 0.0f, bc1, bc2, 1.0f,
                              fm_sr_key(1337 + (uint64_t)s, 1), 0);
        for (int64_t i = 0; i < n; i++) {
            outside += p[i] != lo && p[i] != hi;
            sum += p[i];
        }
        if (s == 0) memcpy(first, p, 4 * n);
    }
    const double mean = sum / (double)(n * S);
    printf("sr: fp32 sum %.9g, mean of %lld rounded %.9g (%.2f standard errors; nearest gives %.9g)\n", xs,
           (long long)(n * S), mean, fabs(mean - xs) / se, (double)bf16v(x[0]));
    CHECK_MSG(outside == 0, "sr: %lld results are not a bf16 neighbour of the fp32 sum", (long long)outside);
    CHECK_MSG(fabs(mean - xs) <= 5 * se, "sr: mean %.9g is %.2f standard errors from the fp32 sum %.9g", mean,
              fabs(mean - xs) / se, xs);
    CHECK_MSG(fabs((double)bf16v(x[0]) - xs) > 5 * se, "sr: rounding to nearest is unbiased here; the test shows nothing");
    /* the same key: the same bits; split into two launches (idx0 carries the index): the same bits */
    const uint64_t k0 = fm_sr_key(1337, 1);
    for (int64_t i = 0; i < n; i++) p[i] = q[i] = 1.0f, m[i] = v[i] = 0.0f;
    g_be.ops->adamw_bf16w(g_be.ctx, p, g, NULL, m, v, FM_DTYPE_F32, n, lr, b1, b2, eps, 0.0f, bc1, bc2, 1.0f, k0, 0);
    CHECK_MSG(!memcmp(p, first, 4 * n), "sr: the same key gave other bits");
    for (int64_t i = 0; i < n; i++) m[i] = v[i] = 0.0f;
    const int64_t cut = 12345;
    g_be.ops->adamw_bf16w(g_be.ctx, q, g, NULL, m, v, FM_DTYPE_F32, cut, lr, b1, b2, eps, 0.0f, bc1, bc2, 1.0f, k0, 0);
    g_be.ops->adamw_bf16w(g_be.ctx, q + cut, g + cut, NULL, m + cut, v + cut, FM_DTYPE_F32, n - cut, lr, b1, b2, eps,
                          0.0f, bc1, bc2, 1.0f, k0, cut);
    CHECK_MSG(!memcmp(p, q, 4 * n), "sr: two launches gave other bits than one");
    for (int64_t i = 0; i < n; i++) q[i] = 1.0f, m[i] = v[i] = 0.0f;
    g_be.ops->adamw_bf16w(g_be.ctx, q, g, NULL, m, v, FM_DTYPE_F32, n, lr, b1, b2, eps, 0.0f, bc1, bc2, 1.0f,
                          fm_sr_key(1337, 2), 0);
    int64_t diff = 0;
    for (int64_t i = 0; i < n; i++) diff += p[i] != q[i];
    CHECK_MSG(diff > n / 4, "sr: step 2's bits differ from step 1's at only %lld of %lld elements", (long long)diff,
              (long long)n);
    free(p), free(q), free(g), free(m), free(v), free(x), free(first);
}

static fm_config small_config(void) {
    fm_config c;
    memset(&c, 0, sizeof c);
    c.model_type = FM_MODEL_OLMOE;
    snprintf(c.model_type_name, sizeof c.model_type_name, "olmoe");
    c.vocab_size = 40; c.hidden_size = 24; c.moe_intermediate_size = 12; c.num_hidden_layers = 3;
    c.num_attention_heads = 4; c.num_key_value_heads = 2; c.head_dim = 6; c.max_position_embeddings = 64;
    c.num_experts = 5; c.num_experts_per_tok = 2; c.rope_theta = 10000; c.rms_norm_eps = 1e-5;
    c.norm_topk_prob = false; c.router_aux_loss_coef = 0.01; c.router_z_loss_coef = 0.001;
    c.initializer_range = 0.3; c.qk_norm = FM_QK_NORM_FULL;
    return c;
}

/* The bytes: the arena the trainer allocates per recipe equals the plan's bound; B/param. */
static void test_bytes(void) {
    const fm_config c = small_config();
    const int64_t n = fm_config_num_params(&c);
    for (int rc = 0; rc < 3; rc++)
        for (int half = 0; half < 2; half++) {
            fm_model m;
            FM_ASSERT(fm_model_create(&m, &c, g_be) == FM_OK);
            fm_adamw a;
            fm_adamw_config(&a, 0.9, 0.95, 1e-8, 0.1, half);
            fm_adamw_set_recipe(&a, (fm_master_recipe)rc, 1);
            fm_param_store ps;
            const size_t ob = fm_adamw_ops.state_bytes(&a, n);
            FM_ASSERT((rc ? fm_param_store_create_bf16(&ps, &m, 0, 1, ob) : fm_param_store_create(&ps, &m, ob)) == FM_OK);
            fm_adamw_ops.init(&a, &ps, &g_be);
            const fm_state_layout lay = {1, 0, 1, rc};
            const size_t bound = fm_model_state_bound(&c, &lay, 4, half, NULL);
            CHECK_MSG(ps.arena.capacity == fm_arena_round(bound) && ps.arena.used == ps.arena.capacity,
                      "recipe %d moments %s: arena %zu (used %zu), plan %zu", rc, half ? "bf16" : "fp32",
                      ps.arena.capacity, ps.arena.used, bound);
            fm_optim_state st[3];
            CHECK(fm_adamw_ops.state_tensors(&a, st, 3) == (rc == FM_MASTER_BF16_KAHAN ? 3 : 2));
            fm_param_store_free(&ps);
            fm_model_free(&m);
            /* a bf16 target: 16, 12 (fp32 master), 14, 10 (Kahan), 12, 8 (stochastic rounding) */
            fm_plan_req r;
            memset(&r, 0, sizeof r);
            r.target = FM_PLAN_TARGET_CUDA;
            r.bf16_moments = half;
            r.state_layout.master_recipe = rc;
            const int want[3][2] = {{16, 12}, {14, 10}, {12, 8}};
            CHECK_MSG(fm_plan_state_bytes_per_param(&r) == want[rc][half], "recipe %d: %d B/param, expected %d", rc,
                      fm_plan_state_bytes_per_param(&r), want[rc][half]);
            const size_t b2 = fm_model_state_bound(&c, &lay, 2, half, NULL);
            const size_t w2 = 2 * fm_arena_round((size_t)n * 2) + (rc == 0 ? fm_arena_round((size_t)n * 4) : 0) +
                              (rc == 1 ? fm_arena_round((size_t)n * 2) : 0) + 2 * fm_arena_round((size_t)n * (half ? 2 : 4));
            CHECK_MSG(b2 == w2, "recipe %d, bf16 target: bound %zu, expected %zu", rc, b2, w2);
        }
}

int main(void) {
    FM_ASSERT(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    fm_rng_seed(&g_rng, fm_test_seed(20261207));
    for (int k = 0; k < 2; k++) {
        test_bits(k, 1, 0.0f, 1.0f);
        test_bits(k, 5, 0.1f, 0.5f);
    }
    test_kahan_vs_fp64();
    test_sr();
    test_bytes();
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
