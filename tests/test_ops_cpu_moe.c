/* CPU backend ops (src/backend/cpu): the router, the MoE permutation (route index, gather,
 * combine), cross-entropy, AdamW and thread-count independence (tests/test_ops_cpu.c has the
 * dense ops), against the plain fp64 references of tests/fm_ref_ops.c (shared with the CUDA op
 * tests); the helpers are tests/fm_test_ops_cpu.h. Method and tolerances (as in test_ops_cpu.c):
 *
 * For every op: the forward against a naive fp64 loop (naive full-matrix softmax for attention)
 * on random inputs from a fixed, printed seed, with outputs poisoned (NaN) before each call so an
 * unwritten element fails; the backward against central finite differences (h = 1e-6, fp64) of
 * the reference forward of a random objective L = sum(dout o f(x)), for every input that has a
 * gradient. Activation gradients are poisoned (NaN) to prove they are ASSIGNED; parameter
 * gradients are pre-filled with 1.0 to prove they ACCUMULATE.
 *
 * Error measure: normalized max error max|got - ref| / max|ref| ("nerr"), NaN/Inf counted as
 * infinite. Tolerances are stated per op: fp32 against fp64 is ~1e-7 per rounding, so forward
 * ops use 1e-5 (more for long sums), gradients 1e-4 (fp32 backward vs fp64 finite differences).
 */
#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_ref_ops.h"
#include "fm_test.h"

#include <float.h>
#include <stdint.h>
#include <time.h>

#include "fm_test_ops_cpu.h"

/* ---- router ------------------------------------------------------------------------------- */

typedef struct rt_st {
    double *logits, *probs, *lse; /* the objective reads logits; probs, lse are its scratch */
    fm_ref_router_loss loss;      /* the selection held fixed (piecewise constant in the logits) */
} rt_st;

static double rt_obj(void *p) {
    rt_st *s = p;
    return fm_ref_router_objective(&s->loss, s->logits, s->probs, s->lse);
}

/* With k = 1 and norm_topk the top-k weight is identically 1, so its exact gradient is zero and
 * only finite-difference noise (~1e-10) is left; router gradients of interest are O(0.1). */
#define ROUTER_GRAD_FLOOR 0.01

/* Router forward (probs, lse tol 1e-6; top-k ids exact incl. ties to the lower id; weights tol
 * 1e-6), router_stats, and router_bwd against FD (tol 1e-5) of each loss term alone and all
 * together. */
static void test_router_case(int64_t N, int64_t E, int64_t k, bool norm) {
    float *logits = fnew(N * E), *probs = fnew(N * E), *lse = fnew(N), *tw = fnew(N * k),
          *dw = fnew(N * k), *gpe = fnew(E), *dl = fnew(N * E), *zero = fnew(N * k);
    int32_t *idx = inew(N * k);
    fill_normal(logits, N * E, 2.0);
    /* Ties: row 0 all equal; row 1 the max shared by experts E-1 and 1; row 2 a tie at the
     * boundary of the selection (the k-th and (k+1)-th largest equal). */
    for (int64_t e = 0; e < E; e++) logits[e] = 0.25f;
    logits[1 * E + E - 1] = logits[1 * E + 1] = 9.0f;
    for (int64_t e = 0; e < E; e++) logits[2 * E + e] = (float)(-e);
    logits[2 * E + E - 1] = logits[2 * E + k - 1] = (float)(-(k - 1));
    poison(probs, N * E);
    poison(lse, N);
    poison(tw, N * k);
    for (int64_t i = 0; i < N * k; i++) idx[i] = -7;
    OPS->router_fwd(CTX, probs, lse, idx, tw, logits, N, E, k, norm);

    rt_st s = {dnew(N * E), dnew(N * E), dnew(N), {idx, NULL, NULL, 0.0, N, E, k, norm}};
    to_d(s.logits, logits, N * E);
    fm_ref_softmax(s.probs, s.lse, s.logits, N, E);
    char what[128];
    snprintf(what, sizeof what, "router N=%lld E=%lld k=%lld norm=%d", (long long)N, (long long)E,
             (long long)k, (int)norm);
    CHECK_MSG(nerr(probs, s.probs, N * E, 1e-30) <= 1e-6, "%s: probs", what);
    CHECK_MSG(nerr(lse, s.lse, N, 1.0) <= 1e-6, "%s: lse", what);
    /* Reference top-k: repeated selection on the fp64 probs, ties to the lower id. */
    int32_t *ridx = inew(N * k);
    fm_ref_topk(ridx, s.probs, N, E, k);
    const bool ids_ok = !memcmp(ridx, idx, sizeof(int32_t) * (size_t)(N * k));
    double *rw = dnew(N * k);
    fm_ref_topk_weights(rw, s.probs, ridx, N, E, k, norm);
    free(ridx);
    CHECK_MSG(ids_ok, "%s: top-k ids differ from the reference (ties to the lower id)", what);
    CHECK_MSG(idx[0] == 0 && (k < 2 || idx[1] == 1), "%s: all-equal row picks ids 0..k-1", what);
    CHECK_MSG(idx[k] == 1 && (k < 2 || idx[k + 1] == E - 1), "%s: tied max picks id 1 then E-1",
              what);
    CHECK_MSG(idx[2 * k + k - 1] == k - 1, "%s: boundary tie picks the lower id", what);
    CHECK_MSG(nerr(tw, rw, N * k, 1e-30) <= 1e-6, "%s: topk_w", what);

    /* router_stats */
    float *cnt = fnew(E), *psum = fnew(E);
    poison(cnt, E);
    poison(psum, E);
    double z = router_stats_(OPS, CTX, cnt, psum, probs, lse, idx, N, E, k);
    double *rc = dnew(E), *rp = dnew(E), *pd = fm_ref_widen(probs, N * E), *ld = fm_ref_widen(lse, N);
    const double rz = fm_ref_router_stats(rc, rp, pd, ld, idx, N, E, k); /* on the op's probs */
    free(pd), free(ld);
    CHECK_MSG(nerr(cnt, rc, E, 1e-30) == 0, "%s: router_stats count", what);
    CHECK_MSG(nerr(psum, rp, E, 1e-30) <= 1e-6, "%s: router_stats prob_sum", what);
    CHECK_CLOSE(z, rz, 1e-12);

    /* router_bwd: (a) top-k weights only, (b) load-balancing term only (dtopk_w zero, and
     * NULL), (c) z-loss only, (d) all three. */
    fill_normal(dw, N * k, 1.0);
    for (int64_t e = 0; e < E; e++) gpe[e] = (float)(0.3 * rnd_normal());
    fill_const(zero, N * k, 0.0f);
    double *ddw = dnew(N * k), *dgpe = dnew(E), *g = dnew(N * E);
    to_d(ddw, dw, N * k);
    to_d(dgpe, gpe, E);
    struct {
        const char *name;
        const float *dw;
        const float *gpe;
        float z;
    } cases[] = {{"topk_w", dw, NULL, 0.0f},
                 {"aux (dprobs_per_expert)", zero, gpe, 0.0f},
                 {"aux, dtopk_w NULL", NULL, gpe, 0.0f},
                 {"z-loss", zero, NULL, 0.01f},
                 {"all terms", dw, gpe, 0.01f}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        poison(dl, N * E);
        OPS->router_bwd(CTX, dl, cases[c].dw, cases[c].gpe, cases[c].z, probs, lse, idx, tw, N, E,
                        k, norm);
        s.loss.dw = cases[c].dw == dw ? ddw : NULL;
        s.loss.gpe = cases[c].gpe ? dgpe : NULL;
        s.loss.z = cases[c].z;
        to_d(g, dl, N * E);
        char w2[200];
        snprintf(w2, sizeof w2, "%s: router_bwd %s", what, cases[c].name);
        fd_check_ex(w2, rt_obj, &s, s.logits, N * E, g, 1e-5, ROUTER_GRAD_FLOOR, FD_H);
    }
    free(logits), free(probs), free(lse), free(tw), free(dw), free(gpe), free(dl), free(zero),
        free(idx);
    free(s.logits), free(s.probs), free(s.lse), free(rw), free(cnt), free(psum), free(rc), free(rp),
        free(ddw), free(dgpe), free(g);
}

/* NaN logits (a diverged run) must not abort: k distinct ids in [0,E), NaN flowing into the
 * weights so the trainer's non-finite check sees it. Row 0 has one NaN, row 1 is all NaN. */
static void test_router_nan(void) {
    const int64_t N = 2, E = 6, k = 3;
    float logits[12], probs[12], lse[2], tw[6];
    int32_t idx[6];
    for (int e = 0; e < 12; e++) logits[e] = (float)(e % 5);
    logits[4] = NAN;
    for (int e = 6; e < 12; e++) logits[e] = NAN;
    OPS->router_fwd(CTX, probs, lse, idx, tw, logits, N, E, k, true);
    bool ok = true;
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < k; j++) {
            ok &= idx[n * k + j] >= 0 && idx[n * k + j] < E;
            for (int i = 0; i < j; i++) ok &= idx[n * k + i] != idx[n * k + j];
        }
    CHECK_MSG(ok, "router_fwd with NaN logits: ids not k distinct experts in [0,E)");
    CHECK_MSG(isnan(tw[0]) && isnan(tw[3]), "router_fwd with NaN logits: NaN did not reach topk_w");
}

static void test_router(void) {
    test_router_nan();
    test_router_case(33, 8, 1, false);
    test_router_case(33, 8, 1, true);
    test_router_case(33, 8, 2, false);
    test_router_case(33, 8, 2, true);
    test_router_case(20, 64, 8, true);
    test_router_case(20, 64, 8, false);
    test_router_case(7, 40, 40, true); /* k = E */
    test_router_case(200, 64, 8, true);
    test_router_case(200, 64, 4, false);
}

/* ---- MoE permutation ---------------------------------------------------------------------- */

/* Random top-k ids: k distinct experts per token drawn from [0,E) minus `skip` (-1: none). */
static void random_topk(int32_t *idx, int64_t N, int64_t E, int64_t k, int32_t skip) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < k; j++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)fm_rng_below(&g_rng, (uint64_t)E);
                dup = e == skip;
                for (int64_t i = 0; i < j; i++) dup |= idx[n * k + i] == e;
            } while (dup);
            idx[n * k + j] = e;
        }
}

/* Checks the op's route index against the documented layout, built independently
 * (fm_ref_route_index): expert e's rows are the routes r with topk_idx[r] == e in increasing r. */
static void check_route_index(const char *what, const int32_t *idx, int64_t N, int64_t E,
                              int64_t k) {
    const int64_t R = N * k;
    int64_t *off = malloc((size_t)(E + 1) * sizeof(int64_t));
    int32_t *rr = inew(R), *rw = inew(R);
    for (int64_t e = 0; e <= E; e++) off[e] = -5;
    for (int64_t r = 0; r < R; r++) rr[r] = rw[r] = -5;
    OPS->moe_route_index(CTX, off, rr, rw, idx, N, E, k);
    int64_t *roff = malloc((size_t)(E + 1) * sizeof(int64_t));
    int32_t *rrr = inew(R), *rrw = inew(R);
    fm_ref_route_index(roff, rrr, rrw, idx, N, E, k);
    const bool ok = !memcmp(off, roff, (size_t)(E + 1) * sizeof(int64_t)) &&
                    !memcmp(rr, rrr, (size_t)R * sizeof(int32_t)) && !memcmp(rw, rrw, (size_t)R * sizeof(int32_t));
    CHECK_MSG(ok, "moe_route_index %s: layout differs from the stable counting sort", what);
    free(off), free(rr), free(rw), free(roff), free(rrr), free(rrw);
}

static void test_route_index(void) {
    int32_t idx[37 * 3];
    random_topk(idx, 37, 6, 2, 3); /* expert 3 gets no token */
    check_route_index("N=37 E=6 k=2, expert 3 empty", idx, 37, 6, 2);
    for (int n = 0; n < 20; n++) idx[n] = 2;
    check_route_index("all tokens to expert 2 (k=1)", idx, 20, 4, 1);
    random_topk(idx, 16, 5, 3, 0);
    for (int n = 0; n < 16; n++) idx[n * 3 + n % 3] = 0; /* expert 0 in every token, slot varies */
    check_route_index("expert 0 in every token (k=3)", idx, 16, 5, 3);
    random_topk(idx, 37, 8, 3, -1);
    check_route_index("N=37 E=8 k=3", idx, 37, 8, 3);
    check_route_index("N=0", idx, 0, 8, 3);
}

typedef struct mg_st {
    double *x, *dxe;          /* gather */
    double *ye, *w, *dout;    /* combine */
    const int32_t *row_route, *route_row;
    int64_t N, k, H;
} mg_st;

static double gather_obj(void *p) {
    mg_st *s = p;
    double L = 0;
    for (int64_t r = 0; r < s->N * s->k; r++)
        for (int64_t h = 0; h < s->H; h++)
            L += s->dxe[r * s->H + h] * s->x[(s->row_route[r] / s->k) * s->H + h];
    return L;
}

static double combine_obj(void *p) {
    mg_st *s = p;
    double *out = dnew(s->N * s->H);
    fm_ref_moe_combine_fwd(out, s->ye, s->w, s->route_row, s->N, s->k, s->H);
    const double L = dot_d(s->dout, out, s->N * s->H);
    free(out);
    return L;
}

/* gather exact; gather_bwd, combine_fwd tol 1e-6 vs fp64; combine_bwd dye, dtopk_w (assigned)
 * and gather_bwd dx vs FD tol 1e-5. Includes an expert with no tokens. */
static void test_gather_combine(int64_t N, int64_t E, int64_t k, int64_t H) {
    const int64_t R = N * k;
    int32_t *idx = inew(R), *rr = inew(R), *rw = inew(R);
    int64_t *off = malloc((size_t)(E + 1) * sizeof(int64_t));
    random_topk(idx, N, E, k, (int32_t)(E - 1));
    OPS->moe_route_index(CTX, off, rr, rw, idx, N, E, k);
    float *x = fnew(N * H), *xe = fnew(R * H), *dxe = fnew(R * H), *dx = fnew(N * H);
    float *ye = fnew(R * H), *w = fnew(R), *out = fnew(N * H), *dout = fnew(N * H),
          *dye = fnew(R * H), *dw = fnew(R);
    fill_normal(x, N * H, 1.0);
    fill_normal(dxe, R * H, 1.0);
    fill_normal(ye, R * H, 1.0);
    fill_uniform(w, R, 0.0, 1.0);
    fill_normal(dout, N * H, 1.0);
    poison(xe, R * H);
    OPS->moe_gather(CTX, xe, x, rr, R, k, H);
    bool ok = true;
    for (int64_t r = 0; r < R; r++)
        ok &= !memcmp(xe + r * H, x + (rr[r] / k) * H, (size_t)H * sizeof(float));
    CHECK_MSG(ok, "moe_gather: rows differ from x[row_route/k]");
    mg_st s = {dnew(N * H), dnew(R * H), dnew(R * H), dnew(R), dnew(N * H), rr, rw, N, k, H};
    to_d(s.x, x, N * H);
    to_d(s.dxe, dxe, R * H);
    to_d(s.ye, ye, R * H);
    to_d(s.w, w, R);
    to_d(s.dout, dout, N * H);
    poison(dx, N * H);
    OPS->moe_gather_bwd(CTX, dx, dxe, rw, N, k, H);
    double *g = dnew(R * H), *ref = dnew(N * H);
    fm_ref_moe_gather_bwd(ref, s.dxe, rw, N, k, H);
    CHECK_ERR("moe_gather_bwd vs reference", nerr(dx, ref, N * H, 1e-30), 1e-6);
    to_d(g, dx, N * H);
    fd_check("moe_gather_bwd dx", gather_obj, &s, s.x, N * H, g, 1e-5);

    poison(out, N * H);
    OPS->moe_combine_fwd(CTX, out, ye, w, rw, N, k, H);
    fm_ref_moe_combine_fwd(ref, s.ye, s.w, rw, N, k, H);
    CHECK_ERR("moe_combine_fwd", nerr(out, ref, N * H, 1e-30), 1e-6);
    poison(dye, R * H);
    poison(dw, R);
    OPS->moe_combine_bwd(CTX, dye, dw, dout, ye, w, rw, N, k, H);
    to_d(g, dye, R * H);
    fd_check("moe_combine_bwd dye", combine_obj, &s, s.ye, R * H, g, 1e-5);
    to_d(g, dw, R);
    fd_check("moe_combine_bwd dtopk_w", combine_obj, &s, s.w, R, g, 1e-5);
    free(idx), free(rr), free(rw), free(off), free(x), free(xe), free(dxe), free(dx), free(ye),
        free(w), free(out), free(dout), free(dye), free(dw);
    free(s.x), free(s.dxe), free(s.ye), free(s.w), free(s.dout), free(g), free(ref);
}

/* ---- cross-entropy ------------------------------------------------------------------------ */

typedef struct ce_st {
    double *logits;
    const int32_t *tgt;
    int64_t N, V;
    double scale;
    int32_t ignore;
} ce_st;

static double ce_obj(void *p) {
    ce_st *s = p;
    return s->scale * fm_ref_cross_entropy(NULL, NULL, s->logits, s->tgt, NULL, s->N, s->V, 1.0, 0.0, s->ignore);
}

/* loss (tol 1e-6 vs fp64) and its returned sum, dlogits vs FD of grad_scale * sum(loss)
 * (tol 1e-5), ignored rows zero, dlogits aliasing logits gives the same bits, dlogits NULL,
 * and logits ~1e4 (exp overflows without the max) staying finite and correct. */
static void test_cross_entropy(double logit_scale, int64_t N, int64_t V) {
    const int32_t ignore = -100;
    const float gs = 0.37f;
    int32_t *tgt = inew(N);
    for (int64_t n = 0; n < N; n++) tgt[n] = (int32_t)fm_rng_below(&g_rng, V);
    tgt[2] = tgt[5] = tgt[11] = ignore;
    tgt[0] = 0, tgt[1] = V - 1;
    float *logits = fnew(N * V), *loss = fnew(N), *dl = fnew(N * V), *buf = fnew(N * V);
    fill_normal(logits, N * V, logit_scale);
    poison(loss, N);
    poison(dl, N * V);
    double sum = cross_entropy_(OPS, CTX, loss, dl, logits, tgt, N, V, gs, ignore);
    ce_st s = {dnew(N * V), tgt, N, V, gs, ignore};
    to_d(s.logits, logits, N * V);
    double *ref = dnew(N);
    const double rsum = fm_ref_cross_entropy(ref, NULL, s.logits, tgt, NULL, N, V, 1.0, 0.0, ignore);
    char what[96];
    snprintf(what, sizeof what, "cross_entropy loss (logit scale %g)", logit_scale);
    CHECK_ERR(what, nerr(loss, ref, N, 1.0), 1e-6);
    CHECK_CLOSE(sum, rsum, 1e-6);
    bool zero_rows = true;
    for (int64_t n = 0; n < N; n++)
        if (tgt[n] == ignore)
            for (int64_t i = 0; i < V; i++) zero_rows &= dl[n * V + i] == 0.0f;
    CHECK_MSG(zero_rows, "cross_entropy: ignored rows of dlogits are not zero");
    CHECK_MSG(all_finite(dl, N * V) && all_finite(loss, N), "cross_entropy: non-finite output");
    double *g = dnew(N * V);
    to_d(g, dl, N * V);
    snprintf(what, sizeof what, "cross_entropy dlogits (logit scale %g)", logit_scale);
    /* With logits ~1e4 the objective is ~1e5 and h = 1e-6 would leave fp64 noise ~1e-5 in the
     * difference; the loss is smooth at that scale, so a larger step is exact enough. */
    fd_check_ex(what, ce_obj, &s, s.logits, N * V, g, 1e-5, 0.0, logit_scale > 100 ? 1e-3 : FD_H);
    /* dlogits aliasing logits */
    memcpy(buf, logits, (size_t)(N * V) * sizeof(float));
    float *loss2 = fnew(N);
    double sum2 = cross_entropy_(OPS, CTX, loss2, buf, buf, tgt, N, V, gs, ignore);
    CHECK_MSG(!memcmp(buf, dl, (size_t)(N * V) * sizeof(float)) && sum2 == sum,
              "cross_entropy: dlogits aliasing logits differs from the separate-buffer result");
    double sum3 = cross_entropy_(OPS, CTX, loss2, NULL, logits, tgt, N, V, gs, ignore);
    CHECK(sum3 == sum && !memcmp(loss2, loss, (size_t)N * sizeof(float)));
    free(tgt), free(logits), free(loss), free(dl), free(buf), free(loss2), free(s.logits),
        free(ref), free(g);
}

/* ---- AdamW -------------------------------------------------------------------------------- */

/* One step against a scalar fp64 reference of the formula in fm_backend.h (bias correction at
 * `step`, weight decay, grad_scale): the update p_new - p_old tol 1e-4, m and v tol 1e-6. */
static void test_adamw(int step, float wd, float gs) {
    const int64_t n = 20001;
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
    const float bc1 = 1.0f - powf(b1, (float)step), bc2 = 1.0f - powf(b2, (float)step);
    float *p = fnew(n), *g = fnew(n), *m = fnew(n), *v = fnew(n), *p0 = fnew(n);
    fill_normal(p, n, 1.0);
    fill_normal(g, n, 1.0);
    fill_normal(m, n, step > 1 ? 0.1 : 0.0);
    for (int64_t i = 0; i < n; i++) v[i] = step > 1 ? (float)(0.01 * fabs(rnd_normal())) : 0.0f;
    memcpy(p0, p, (size_t)n * sizeof(float));
    double *rd = dnew(n), *rm = dnew(n), *rv = dnew(n);
    {
        double *wd_ = fm_ref_widen(p, n), *gd = fm_ref_widen(g, n), *md = fm_ref_widen(m, n), *vd = fm_ref_widen(v, n);
        fm_ref_adamw(rd, rm, rv, wd_, gd, md, vd, n, lr, b1, b2, eps, wd, bc1, bc2, gs);
        free(wd_), free(gd), free(md), free(vd);
    }
    /* with a separate fp32 master (the bf16 builds' path; here fp32 -> p is a copy of it) */
    float *p2 = fnew(n), *mst = fnew(n), *m2 = fnew(n), *v2 = fnew(n);
    memcpy(p2, p, (size_t)n * sizeof(float));
    memcpy(mst, p, (size_t)n * sizeof(float));
    memcpy(m2, m, (size_t)n * sizeof(float));
    memcpy(v2, v, (size_t)n * sizeof(float));
    OPS->adamw(CTX, p2, g, mst, m2, v2, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, gs);
    OPS->adamw(CTX, p, g, NULL, m, v, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, gs);
    CHECK_MSG(memcmp(p, p2, (size_t)n * sizeof(float)) == 0 && memcmp(p, mst, (size_t)n * sizeof(float)) == 0,
              "adamw with a master: weights differ from the in-place update");
    free(p2), free(mst), free(m2), free(v2);
    float *d = fnew(n);
    for (int64_t i = 0; i < n; i++) d[i] = (float)((double)p[i] - (double)p0[i]);
    char what[96];
    snprintf(what, sizeof what, "adamw step %d wd %g grad_scale %g: update", step, wd, gs);
    CHECK_ERR(what, nerr(d, rd, n, 1e-30), 1e-4);
    snprintf(what, sizeof what, "adamw step %d: m", step);
    CHECK_ERR(what, nerr(m, rm, n, 1e-30), 1e-6);
    snprintf(what, sizeof what, "adamw step %d: v", step);
    CHECK_ERR(what, nerr(v, rv, n, 1e-30), 1e-6);
    free(p), free(g), free(m), free(v), free(p0), free(rd), free(rm), free(rv), free(d);
}

/* bf16 moments: from moments that bf16 holds exactly, the same step with bf16 and with fp32
 * moments gives the same weights bit for bit, and the bf16 moments are the fp32 ones rounded to
 * nearest even. */
static void test_adamw_bf16_moments(int step) {
    const int64_t n = 5003;
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    const float bc1 = 1.0f - powf(b1, (float)step), bc2 = 1.0f - powf(b2, (float)step);
    float *p = fnew(n), *g = fnew(n), *m = fnew(n), *v = fnew(n), *p2 = fnew(n);
    uint16_t *mh = calloc((size_t)n, 2), *vh = calloc((size_t)n, 2);
    fill_normal(p, n, 1.0);
    fill_normal(g, n, 1.0);
    fill_normal(m, n, step > 1 ? 0.1 : 0.0);
    for (int64_t i = 0; i < n; i++) {
        v[i] = step > 1 ? (float)(0.01 * fabs(rnd_normal())) : 0.0f;
        mh[i] = fm_f32_to_bf16(m[i]), vh[i] = fm_f32_to_bf16(v[i]);
        m[i] = fm_bf16_to_f32(mh[i]), v[i] = fm_bf16_to_f32(vh[i]);
    }
    memcpy(p2, p, (size_t)n * sizeof(float));
    OPS->adamw(CTX, p, g, NULL, m, v, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, 1.0f);
    OPS->adamw(CTX, p2, g, NULL, mh, vh, FM_DTYPE_BF16, n, lr, b1, b2, eps, wd, bc1, bc2, 1.0f);
    CHECK_MSG(memcmp(p, p2, (size_t)n * sizeof(float)) == 0, "adamw bf16 moments step %d: weights differ", step);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (mh[i] != fm_f32_to_bf16(m[i]) || vh[i] != fm_f32_to_bf16(v[i])) bad++;
    CHECK_MSG(bad == 0, "adamw bf16 moments step %d: %lld moments are not the fp32 ones rounded", step, (long long)bad);
    free(p), free(g), free(m), free(v), free(p2), free(mh), free(vh);
}

/* ---- thread-count independence ------------------------------------------------------------ */

static bool same_bits(const void *a, const void *b, int64_t n_floats) {
    return memcmp(a, b, (size_t)n_floats * sizeof(float)) == 0;
}

/* The reductions (sumsq, embedding_bwd, rmsnorm_bwd's dw, router_stats, cross_entropy's sum)
 * and the attention tiles give the same bits on 1 and 2 threads (cpu_internal.h: outputs are
 * partitioned, never sums), at sizes where the 2-thread context really forks. */
static void test_thread_independence(void) {
    fm_backend one;
    CHECK(fm_cpu_backend_init(&one, 1, 64) == FM_OK);
    const fm_ops *o1 = one.ops;
    void *c1 = one.ctx;
    const int64_t n = 1000003;
    float *x = fnew(n);
    fill_normal(x, n, 2.0);
    double s2 = sumsq_(OPS, CTX, x, n), s1 = sumsq_(o1, c1, x, n);
    CHECK_MSG(memcmp(&s1, &s2, sizeof s1) == 0, "sumsq: 1 and 2 threads differ");

    const int64_t N = 300, H = 130, V = 17;
    int32_t *tok = inew(N);
    for (int64_t i = 0; i < N; i++) tok[i] = (int32_t)fm_rng_below(&g_rng, V);
    float *dout = fnew(N * H), *a1 = fnew(V * H), *a2 = fnew(V * H);
    fill_normal(dout, N * H, 1.0);
    fill_const(a1, V * H, 0.5f);
    fill_const(a2, V * H, 0.5f);
    OPS->embedding_bwd(CTX, a2, dout, tok, N, H);
    o1->embedding_bwd(c1, a1, dout, tok, N, H);
    CHECK_MSG(same_bits(a1, a2, V * H), "embedding_bwd: 1 and 2 threads differ");

    float *xx = fnew(N * H), *w = fnew(H), *out = fnew(N * H), *rstd = fnew(N), *dx1 = fnew(N * H),
          *dx2 = fnew(N * H), *dw1 = fnew(H), *dw2 = fnew(H);
    fill_normal(xx, N * H, 1.0);
    fill_uniform(w, H, 0.5, 1.5);
    OPS->rmsnorm_fwd(CTX, out, rstd, xx, w, N, H, 1e-6f);
    fill_const(dw1, H, 0.0f);
    fill_const(dw2, H, 0.0f);
    OPS->rmsnorm_bwd(CTX, dx2, dw2, dout, xx, w, rstd, N, H);
    o1->rmsnorm_bwd(c1, dx1, dw1, dout, xx, w, rstd, N, H);
    CHECK_MSG(same_bits(dx1, dx2, N * H) && same_bits(dw1, dw2, H),
              "rmsnorm_bwd: 1 and 2 threads differ");

    const int64_t E = 64, k = 8;
    float *logits = fnew(N * E), *probs = fnew(N * E), *lse = fnew(N), *tw = fnew(N * k),
          *cnt1 = fnew(E), *cnt2 = fnew(E), *ps1 = fnew(E), *ps2 = fnew(E);
    int32_t *idx = inew(N * k);
    fill_normal(logits, N * E, 1.0);
    OPS->router_fwd(CTX, probs, lse, idx, tw, logits, N, E, k, true);
    double z2 = router_stats_(OPS, CTX, cnt2, ps2, probs, lse, idx, N, E, k);
    double z1 = router_stats_(o1, c1, cnt1, ps1, probs, lse, idx, N, E, k);
    CHECK_MSG(z1 == z2 && same_bits(cnt1, cnt2, E) && same_bits(ps1, ps2, E),
              "router_stats: 1 and 2 threads differ");

    const int64_t NV = 64 * 1000;
    float *lg = fnew(NV), *l1 = fnew(64), *l2 = fnew(64), *d1 = fnew(NV), *d2 = fnew(NV);
    int32_t *tg = inew(64);
    fill_normal(lg, NV, 3.0);
    for (int i = 0; i < 64; i++) tg[i] = (int32_t)fm_rng_below(&g_rng, 1000);
    double ce2 = cross_entropy_(OPS, CTX, l2, d2, lg, tg, 64, 1000, 1.0f / 64, -1);
    double ce1 = cross_entropy_(o1, c1, l1, d1, lg, tg, 64, 1000, 1.0f / 64, -1);
    CHECK_MSG(ce1 == ce2 && same_bits(l1, l2, 64) && same_bits(d1, d2, NV),
              "cross_entropy: 1 and 2 threads differ");

    fm_cpu_backend_free(&one);
    free(x), free(tok), free(dout), free(a1), free(a2), free(xx), free(w), free(out), free(rstd);
    free(dx1), free(dx2), free(dw1), free(dw2), free(logits), free(probs), free(lse), free(tw);
    free(cnt1), free(cnt2), free(ps1), free(ps2), free(idx), free(lg), free(l1), free(l2), free(d1),
        free(d2), free(tg);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20240607));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    CHECK(fm_cpu_backend_init(&g_be, 2, 128) == FM_OK);
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK(strcmp(OPS->name, "cpu") == 0);

    test_router();
    test_route_index();
    test_gather_combine(23, 5, 3, 37);
    test_gather_combine(40, 8, 1, 70);
    test_gather_combine(100, 8, 2, 64);
    test_cross_entropy(1.0, 12, 50);
    test_cross_entropy(1e4, 12, 50);
    test_cross_entropy(1.0, 40, 300);
    test_cross_entropy(1e4, 40, 300);
    test_adamw(1, 0.0f, 1.0f);
    test_adamw(5, 0.1f, 0.5f);
    test_adamw_bf16_moments(1);
    test_adamw_bf16_moments(7);
    test_thread_independence();

    fm_cpu_backend_free(&g_be);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("time %.2f s\n",
           (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    return fm_test_finish();
}
