/* The layer schedule (schedule/fm_schedule.h) and the MoE units (model/fm_router.h,
 * bounded/fm_moe_dispatch.h, model/fm_experts.h, model/fm_moe_layer.h) on the CPU backend:
 * - hooks run at every point, in the documented order, with recompute after BEFORE_BACKWARD;
 * - a failing hook stops the step and its status and message come back;
 * - hooks that do nothing leave loss and gradients bit-identical;
 * - the recompute policy's bound (saved sets) against a count made by hand;
 * - the router's loss terms against an fp64 computation from its saved probabilities;
 * - an empty chunk (K > N) passes through every dispatcher phase and changes nothing: the
 *   chunked MoE with empty chunks equals the plain twin bit for bit in its outputs through a
 *   fixed-order gemm (tests/fm_test_fixed_gemm.h: bit-identity by construction), and within the
 *   fp32 reordering bound through the BLAS, whose kernels may round a row by its tile. */
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_fixed_gemm.h"
#include "fm_test_model.h"
#include "model/fm_moe_layer.h"
#include "comm/fm_comm.h"
#include "schedule/fm_schedule.h"

static fm_backend g_be;

static fm_config small_config(void) { return fm_test_small_config(FM_MODEL_QWEN3_MOE, 3, false, 2); }

static void make_model(fm_model *m, const fm_config *c, const bool *rc, int64_t chunk) {
    FM_ASSERT(fm_test_model_create(m, c, g_be) == FM_OK);
    fm_layout_opts lo = {rc, chunk, 0, 0};
    FM_ASSERT(fm_model_layout(m, 2, 8, &lo) == FM_OK);
    FM_ASSERT(fm_model_init_weights(m, 11) == FM_OK);
    fm_test_fill_batch(m, 12, -1);
    memset(m->p.grads, 0, sizeof(float) * (size_t)m->p.n_params);
}

/* ---- hooks: order, failure, no effect ------------------------------------------------------ */

typedef struct recorder {
    int n;
    int point[64];
    int64_t layer[64];
    int fail_at;          /* event index at which to fail (-1: never) */
    /* at BEFORE_BACKWARD of a recomputed layer, the shared saved set still holds the last
     * forward's router probabilities, not this layer's recomputed ones */
    float probe[64];
    int64_t poison_layer; /* at BEFORE_BACKWARD of this layer, overwrite its saved probs[0] (-1: none) */
} recorder;

static fm_status record(void *user, fm_model *m, fm_hook_point p, int64_t l) {
    recorder *r = user;
    if (r->n == r->fail_at)
        return fm_error(FM_ERR_NUMERIC, "test hook: failing at %s of layer %lld", fm_hook_point_name(p), (long long)l);
    FM_ASSERT(r->n < 64);
    r->point[r->n] = (int)p;
    r->layer[r->n] = l;
    r->probe[r->n] = m->a.acts[l].router.probs[0];
    r->n++;
    if (p == FM_HOOK_BEFORE_BACKWARD && l == r->poison_layer) m->a.acts[l].router.probs[0] = -7.0f;
    return FM_OK;
}

static void test_hooks(void) {
    const fm_config c = small_config();
    const int64_t L = c.num_hidden_layers;
    bool rc[3] = {false, true, false};
    fm_model m;
    make_model(&m, &c, rc, 0);
    fm_schedule s;
    fm_schedule_init(&s, &m);
    recorder rec = {0};
    rec.fail_at = -1;
    rec.poison_layer = 1;
    CHECK(fm_schedule_add_hook(&s, record, &rec) == FM_OK);
    fm_loss l;
    CHECK(fm_schedule_train_step(&s, &m, fm_test_batch_of(&m), 1.0f, &l) == FM_OK);
    CHECK(rec.n == 4 * (int)L);
    int i = 0;
    for (int64_t k = 0; k < L; k++) {
        CHECK(rec.point[i] == FM_HOOK_BEFORE_FORWARD && rec.layer[i] == k); i++;
        CHECK(rec.point[i] == FM_HOOK_AFTER_FORWARD && rec.layer[i] == k); i++;
    }
    for (int64_t k = L - 1; k >= 0; k--) {
        CHECK(rec.point[i] == FM_HOOK_BEFORE_BACKWARD && rec.layer[i] == k); i++;
        CHECK(rec.point[i] == FM_HOOK_AFTER_BACKWARD && rec.layer[i] == k); i++;
    }
    /* layer 1 is recomputed: at BEFORE_BACKWARD(1) (event 2L+2) its shared saved set is still
     * what its forward wrote (event 3: AFTER_FORWARD(1)); the hook then poisons it, and by
     * AFTER_BACKWARD(1) (event 2L+3) the recompute, which runs after the hook, has rewritten it */
    CHECK(rec.probe[2 * L + 2] == rec.probe[3]);
    CHECK(rec.probe[2 * L + 3] == rec.probe[3] && rec.probe[3] != -7.0f);
    float *g_hooked = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
    memcpy(g_hooked, m.p.grads, sizeof(float) * (size_t)m.p.n_params);
    const double loss_hooked = l.ce + l.aux + l.z;

    /* the same step with no hooks: bit-identical */
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    fm_loss l2;
    fm_schedule_default_train_step(&m, fm_test_batch_of(&m), 1.0f, &l2);
    CHECK(l2.ce + l2.aux + l2.z == loss_hooked);
    CHECK(memcmp(g_hooked, m.p.grads, sizeof(float) * (size_t)m.p.n_params) == 0);

    /* a failing hook stops the step: no later event, its status and message come back */
    fm_schedule s2;
    fm_schedule_init(&s2, &m);
    recorder r2 = {0};
    r2.poison_layer = -1;
    r2.fail_at = 3; /* AFTER_FORWARD(1) */
    CHECK(fm_schedule_add_hook(&s2, record, &r2) == FM_OK);
    CHECK(fm_schedule_train_step(&s2, &m, fm_test_batch_of(&m), 1.0f, &l) == FM_ERR_NUMERIC);
    CHECK(r2.n == 3);
    CHECK(strstr(fm_errmsg(), "after_forward of layer 1") != NULL);

    /* the hook table's limits */
    fm_schedule s3;
    fm_schedule_init(&s3, &m);
    CHECK(fm_schedule_add_hook(&s3, NULL, NULL) == FM_ERR_ARG);
    for (int k = 0; k < FM_SCHEDULE_MAX_HOOKS; k++) CHECK(fm_schedule_add_hook(&s3, record, &rec) == FM_OK);
    CHECK(fm_schedule_add_hook(&s3, record, &rec) == FM_ERR_ARG);
    CHECK(strstr(fm_errmsg(), "already has") != NULL);
    fm_free(g_hooked);
    fm_test_model_free(&m);
}

/* ---- the recompute policy ------------------------------------------------------------------- */

static void test_recompute_policy(void) {
    bool rc[6];
    CHECK(fm_recompute_parse("1,4", 6, rc) == FM_OK);
    fm_recompute_policy p = {rc, 6};
    CHECK(fm_recompute_count(&p) == 2);
    CHECK(fm_recompute_saved_sets(&p) == 5); /* 4 kept + 1 shared */
    CHECK(fm_recompute_parse("full", 6, rc) == FM_OK);
    CHECK(fm_recompute_saved_sets(&p) == 1);
    CHECK(fm_recompute_parse("none", 6, rc) == FM_OK);
    CHECK(fm_recompute_saved_sets(&p) == 6);
    fm_recompute_policy none = {NULL, 6};
    CHECK(fm_recompute_saved_sets(&none) == 6);
    CHECK(fm_recompute_parse("1,1", 6, rc) == FM_ERR_ARG && strstr(fm_errmsg(), "listed twice"));
    CHECK(fm_recompute_parse("6", 6, rc) == FM_ERR_ARG && strstr(fm_errmsg(), "0..5"));
    CHECK(fm_recompute_parse("2,", 6, rc) == FM_ERR_ARG && strstr(fm_errmsg(), "trailing comma"));
    CHECK(fm_recompute_parse("x", 6, rc) == FM_ERR_ARG && strstr(fm_errmsg(), "expected none"));
}

/* ---- the router's loss terms against fp64 from its saved probabilities ----------------------- */

static void test_router_terms(void) {
    const fm_config c = small_config();
    fm_model m;
    make_model(&m, &c, NULL, 0);
    CHECK(fm_model_embed_forward(&m, fm_test_batch_of(&m)) == FM_OK);
    fm_model_layer_forward(&m, 0, fm_model_boundary(&m, 1));
    const double *terms = m.a.results + FM_RESULT_LAYERS; /* backend memory is host memory on the CPU */
    const int64_t N = m.a.N, E = c.num_experts, k = c.num_experts_per_tok;
    const fm_router_saved *s = &m.a.acts[0].router;
    double aux = 0, z = 0;
    for (int64_t e = 0; e < E; e++) {
        double f = 0, P = 0;
        for (int64_t n = 0; n < N; n++) {
            P += s->probs[n * E + e];
            for (int64_t j = 0; j < k; j++) f += s->topk_idx[n * k + j] == e;
        }
        CHECK(s->count[e] == (float)f);
        aux += (f / N) * (P / N);
    }
    aux *= (double)E;
    for (int64_t n = 0; n < N; n++) z += (double)s->lse[n] * s->lse[n]; /* the saved log-sum-exps */
    z /= (double)N;
    CHECK_CLOSE(terms[0], aux, 1e-6);
    CHECK_CLOSE(terms[1], z, 1e-6);
    /* the losses: coefficient times the mean over layers of the terms */
    const double two[4] = {terms[0], terms[1], 3 * terms[0], 5 * terms[1]};
    double la, lz;
    fm_router_losses(&m.router, two, 2, NULL, &la, &lz);
    CHECK_CLOSE(la, c.router_aux_loss_coef * 2 * terms[0], 1e-15);
    CHECK_CLOSE(lz, c.router_z_loss_coef * 3 * terms[1], 1e-15);
    /* the aux-loss gradient on the device from the device counts: coef * E * f_e / N */
    float *dp = fnew(E);
    g_be.ops->router_aux_grad(g_be.ctx, dp, s->count, 0.25, N, E);
    for (int64_t e = 0; e < E; e++) CHECK_CLOSE(dp[e], 0.25 * E * (s->count[e] / N) / N, 1e-7);
    free(dp);
    fm_test_model_free(&m);
}

/* ---- an empty chunk passes through every phase ---------------------------------------------- */

/* exact: through the fixed-order gemm, outputs and input gradients bit for bit; else through be's
 * BLAS, whose kernels may round a row by where it falls in their tiling (1-token chunks against
 * 5 rows at once): two orders of an n-term fp32 sum differ by at most 2 gamma_n sum|terms|
 * (gamma_n = n u / (1 - n u), u = 2^-24; Higham, Accuracy and Stability, §3.1); an output comes
 * through an H-term and an I-term sum, so 2 gamma_(H+I) times 4 (the SwiGLU between them, the
 * backward's second chain) of each token's scale; the router-weight gradients (a dot of H, in
 * double) likewise. The weight gradients sum at most N k more rows: 2 gamma_(Nk+H+I) times 4 in
 * relative L1, in both cases (the chunked form adds them chunk by chunk). */
static void test_empty_chunk(const fm_backend *be, bool exact) {
    const fm_moe_dims d = {16, 8, 4, 2};
    const int64_t N = 5, K = 7; /* chunks 5 and 6 are empty */
    fm_rng r;
    fm_rng_seed(&r, 3);
    float *Wg = fnew(d.E * d.I * d.H), *Wu = fnew(d.E * d.I * d.H), *Wd = fnew(d.E * d.H * d.I);
    float *x = fnew(N * d.H), *tw = fnew(N * d.k), *y_plain = fnew(N * d.H), *y_chunk = fnew(N * d.H);
    float *dy = fnew(N * d.H), *dx_p = fnew(N * d.H), *dx_c = fnew(N * d.H), *dtw_p = fnew(N * d.k), *dtw_c = fnew(N * d.k);
    float *gg_p = fnew(d.E * d.I * d.H), *gu_p = fnew(d.E * d.I * d.H), *gd_p = fnew(d.E * d.H * d.I);
    float *gg_c = fnew(d.E * d.I * d.H), *gu_c = fnew(d.E * d.I * d.H), *gd_c = fnew(d.E * d.H * d.I);
    int32_t *idx = inew(N * d.k), *order = inew(N);
    for (int64_t i = 0; i < d.E * d.I * d.H; i++) {
        Wg[i] = (float)fm_rng_normal(&r) * 0.3f;
        Wu[i] = (float)fm_rng_normal(&r) * 0.3f;
        Wd[i] = (float)fm_rng_normal(&r) * 0.3f;
    }
    for (int64_t i = 0; i < N * d.H; i++) { x[i] = (float)fm_rng_normal(&r); dy[i] = (float)fm_rng_normal(&r); }
    for (int64_t n = 0; n < N; n++) {
        idx[n * 2] = (int32_t)(n % d.E);
        idx[n * 2 + 1] = (int32_t)((n + 1) % d.E);
        tw[n * 2] = 0.7f;
        tw[n * 2 + 1] = 0.3f;
    }
    fm_moe_chunk_order(order, N, K);
    for (int64_t j = 0; j < K; j++) CHECK(fm_moe_chunk_size(N, K, j) == (j < N ? 1 : 0));
    fm_arena a_p, a_c, h_p, h_c;
    FM_ASSERT(fm_arena_init(&a_p, "plain", fm_moe_routes_bytes(&d, N, 4) + fm_moe_ws_bytes(&d, N, false, 4)) == FM_OK);
    FM_ASSERT(fm_arena_init(&a_c, "chunked", fm_moe_ws_bytes(&d, 1, true, 4)) == FM_OK);
    FM_ASSERT(fm_arena_init(&h_p, "host", 2 * fm_moe_routes_host_bytes(&d)) == FM_OK);
    FM_ASSERT(fm_arena_init(&h_c, "host", 2 * fm_moe_routes_host_bytes(&d)) == FM_OK);
    fm_moe_routes saved;
    fm_moe_ws ws_p, ws_c;
    fm_moe_routes_layout(&saved, &a_p, &h_p, &d, N);
    fm_moe_ws_layout(&ws_p, &a_p, &h_p, &d, N, false);
    fm_moe_ws_layout(&ws_c, &a_c, &h_c, &d, 1, true);
    const fm_moe_weights w = {Wg, Wu, Wd};
    const fm_moe_grads gp = {gg_p, gu_p, gd_p}, gc = {gg_c, gu_c, gd_c};
    const double tol = 4 * fm_test_reorder_bound(d.H + d.I);
    const double tol_g = 4 * fm_test_reorder_bound(N * d.k + d.H + d.I);
    CHECK(fm_moe_forward(be, &d, &w, y_plain, x, idx, tw, N, 1, NULL, &saved, &ws_p) == FM_OK);
    CHECK(fm_moe_forward(be, &d, &w, y_chunk, x, idx, tw, N, K, order, NULL, &ws_c) == FM_OK);
    if (exact) CHECK(memcmp(y_plain, y_chunk, sizeof(float) * (size_t)(N * d.H)) == 0);
    else
        CHECK_MSG(fm_test_row_rel(y_chunk, y_plain, N, d.H) <= tol, "outputs %g",
                  fm_test_row_rel(y_chunk, y_plain, N, d.H));
    /* the last (empty) chunk left the chunk's routes with zero offsets */
    for (int64_t e = 0; e <= d.E; e++) CHECK(ws_c.r.offsets[e] == 0);
    CHECK(fm_moe_backward(be, &d, &w, &gp, dx_p, dtw_p, dy, x, idx, tw, N, 1, NULL, &saved, &ws_p) == FM_OK);
    CHECK(fm_moe_backward(be, &d, &w, &gc, dx_c, dtw_c, dy, x, idx, tw, N, K, order, NULL, &ws_c) == FM_OK);
    if (exact) {
        CHECK(memcmp(dx_p, dx_c, sizeof(float) * (size_t)(N * d.H)) == 0);
        CHECK(memcmp(dtw_p, dtw_c, sizeof(float) * (size_t)(N * d.k)) == 0);
    } else {
        double etw = 0; /* against sum_h |dy_h ye_h|, the dot's terms (ye: the plain twin's) */
        for (int64_t t = 0; t < N * d.k; t++) {
            double mag = 0;
            for (int64_t h = 0; h < d.H; h++)
                mag += fabs((double)dy[(t / d.k) * d.H + h] * saved.ye[(int64_t)saved.route_row[t] * d.H + h]);
            etw = fmax(etw, fabs((double)dtw_c[t] - dtw_p[t]) / (mag > 0 ? mag : 1e-30));
        }
        CHECK_MSG(fm_test_row_rel(dx_c, dx_p, N, d.H) <= tol && etw <= tol, "input grads %g, router-weight grads %g",
                  fm_test_row_rel(dx_c, dx_p, N, d.H), etw);
    }
    double num = 0, den = 0;
    for (int64_t i = 0; i < d.E * d.I * d.H; i++) {
        num += fabs((double)gg_p[i] - gg_c[i]) + fabs((double)gu_p[i] - gu_c[i]) + fabs((double)gd_p[i] - gd_c[i]);
        den += fabs((double)gg_p[i]) + fabs((double)gu_p[i]) + fabs((double)gd_p[i]);
    }
    CHECK_MSG(den > 0 && num / den <= tol_g, "expert weight grads: relative L1 %g (bound %g)", num / den, tol_g);
    fm_arena_free(&a_p); fm_arena_free(&a_c); fm_arena_free(&h_p); fm_arena_free(&h_c);
    free(Wg); free(Wu); free(Wd); free(x); free(tw); free(y_plain); free(y_chunk); free(dy); free(dx_p); free(dx_c);
    free(dtw_p); free(dtw_c); free(gg_p); free(gu_p); free(gd_p); free(gg_c); free(gu_c); free(gd_c); free(idx);
    free(order);
}

/* ---- the communicator: the self communicator changes nothing; a failing one stops the step ---- */

/* A communicator whose all_reduce fails like a timed-out rank (everything else is the self
 * communicator's). */
static fm_comm g_self;
static fm_status failing_all_reduce(void *ctx, const void *send, void *recv, int64_t count, fm_comm_dtype dtype,
                                    fm_comm_op op, double timeout_s) {
    (void)ctx, (void)send, (void)recv, (void)dtype, (void)op, (void)timeout_s;
    return fm_error(FM_ERR_IO, "rank 0 of 1: all_reduce(%lld elements) timed out (test)", (long long)count);
}

/* A communicator of two ranks that hold the same batch: every sum is twice this rank's value. */
static int two_size(void *ctx) {
    (void)ctx;
    return 2;
}
static fm_status twice_all_reduce(void *ctx, const void *send, void *recv, int64_t count, fm_comm_dtype dtype,
                                  fm_comm_op op, double timeout_s) {
    (void)ctx, (void)timeout_s;
    FM_ASSERT(op == FM_COMM_SUM);
    for (int64_t i = 0; i < count; i++) {
        if (dtype == FM_COMM_F32) ((float *)recv)[i] = 2 * ((const float *)send)[i];
        else if (dtype == FM_COMM_F64) ((double *)recv)[i] = 2 * ((const double *)send)[i];
        else if (dtype == FM_COMM_I64) ((int64_t *)recv)[i] = 2 * ((const int64_t *)send)[i];
        else FM_ASSERT(!"dtype");
    }
    return FM_OK;
}
static fm_status twice_all_reduce_host(void *ctx, void *buf, int64_t count, fm_comm_dtype dtype, fm_comm_op op,
                                       double timeout_s) {
    return twice_all_reduce(ctx, buf, buf, count, dtype, op, timeout_s);
}

static void test_comm(void) {
    const fm_config c = small_config();
    bool rc[3] = {false, true, false};
    fm_model m;
    make_model(&m, &c, rc, 3);
    fm_loss a, b;
    fm_schedule_default_train_step(&m, fm_test_batch_of(&m), 1.0f, &a); /* no communicator: this rank alone */
    float *g0 = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
    memcpy(g0, m.p.grads, sizeof(float) * (size_t)m.p.n_params);
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    FM_ASSERT(fm_comm_self_create(&g_self, &g_be, 0) == FM_OK);
    m.mesh.comm = &g_self; /* the valid count, the loss sums and the router statistics go through it */
    fm_schedule_default_train_step(&m, fm_test_batch_of(&m), 1.0f, &b);
    CHECK(a.ce == b.ce && a.aux == b.aux && a.z == b.z && a.n_valid == b.n_valid);
    CHECK(memcmp(g0, m.p.grads, sizeof(float) * (size_t)m.p.n_params) == 0);
    /* two ranks with the same batch: the batch's losses are this rank's, its valid targets twice
     * as many, and this rank's share of every gradient exactly half (a power of two) */
    fm_comm_ops two = *g_self.ops;
    two.size = two_size;
    two.all_reduce = twice_all_reduce;
    two.all_reduce_host = twice_all_reduce_host;
    fm_comm pair = {&two, g_self.ctx};
    m.mesh.comm = &pair;
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    fm_loss d;
    fm_schedule_default_train_step(&m, fm_test_batch_of(&m), 1.0f, &d);
    CHECK_MSG(d.ce == a.ce && d.aux == a.aux && d.z == a.z && d.n_valid == 2 * a.n_valid,
              "two ranks: ce %.17g vs %.17g, aux %.17g vs %.17g, valid %lld", d.ce, a.ce, d.aux, a.aux,
              (long long)d.n_valid);
    int64_t off = 0;
    for (int64_t i = 0; i < m.p.n_params; i++) off += m.p.grads[i] != 0.5f * g0[i];
    CHECK_MSG(off == 0, "two ranks: %lld of %lld gradients are not half of one rank's", (long long)off,
              (long long)m.p.n_params);
    /* a collective that fails stops the step with its status and message */
    fm_comm_ops bad = *g_self.ops;
    bad.all_reduce = failing_all_reduce;
    fm_comm broken = {&bad, g_self.ctx};
    m.mesh.comm = &broken;
    fm_schedule s;
    fm_schedule_init(&s, &m);
    CHECK(fm_schedule_train_step(&s, &m, fm_test_batch_of(&m), 1.0f, NULL) == FM_ERR_IO);
    CHECK(strstr(fm_errmsg(), "timed out") != NULL);
    m.mesh.comm = NULL;
    fm_comm_free(&g_self);
    fm_free(g0);
    fm_test_model_free(&m);
}

int main(void) {
    FM_ASSERT(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    test_hooks();
    test_recompute_policy();
    test_router_terms();
    fm_ops fixed_ops;
    const fm_backend fixed = fm_test_backend_fixed_gemm(&g_be, &fixed_ops);
    test_empty_chunk(&fixed, true);
    test_empty_chunk(&g_be, false);
    test_comm();
    fm_cpu_backend_free(&g_be);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
