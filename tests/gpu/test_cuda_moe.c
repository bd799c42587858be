/* CUDA backend (cuda_router/permute/loss.cu) router, MoE permutation, row movement,
 * cross-entropy and linear-CE strip ops against the fp64 host references of tests/fm_ref_ops.c
 * (shared with the CPU tests).
 *
 * For every op: inputs built on the host (bf16 inputs rounded first, so the reference sees the
 * values the GPU sees), outputs poisoned (all bytes 0xff: NaN for fp32 and bf16, -1 for int32)
 * before each call so an unwritten element fails, results compared with gt_nerr (normalized L2)
 * at the tolerance of the output's dtype (GT_TOL_BF16, GT_TOL_F32, tighter where the op computes
 * in fp32/fp64 on fp32 inputs), bf16 outputs also element by element in bf16 ulps of the
 * reference (gt_bf16_ulps; limits ULPS_* below), integer outputs (top-k ids, offsets, row_route, route_row) and
 * pure copies exactly. router_bwd is also checked against central finite differences of the fp64
 * reference objective (each loss term alone, then together). Every op is run twice on the same
 * inputs and must give the same bits (determinism). Reductions land in device doubles read after
 * a stream_sync (gt_read_f64); router_loss_terms and router_aux_grad also match the CPU backend's
 * arithmetic bit for bit; moe_route_index's offsets land in pinned memory read after one
 * stream_sync; a sequence of compute ops makes no host wait (host_sync_count); a device-found
 * index error is a sticky FM_ERR_ARG from status.
 */
#include "backend/cuda/fm_backend_cuda.h"
#include "core/fm_rng.h"
#include "fm_ref_ops.h"
#include "gpu_test.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static fm_backend g_be;
static const fm_ops *OPS;
static void *CTX;
static fm_rng g_rng;

/* ---- host helpers ------------------------------------------------------------------------- */

static double rnd_normal(void) { return fm_rng_normal(&g_rng); }
static double rnd_uniform(double lo, double hi) { return lo + (hi - lo) * fm_rng_uniform_d(&g_rng); }
static void fill_normal(float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * rnd_normal());
}
static void fill_uniform(float *x, int64_t n, double lo, double hi) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)rnd_uniform(lo, hi);
}
static void to_d(double *d, const float *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = f[i];
}
static bool all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

/* ---- device helpers ----------------------------------------------------------------------- */

static void *dalloc(size_t bytes) {
    void *p = OPS->mem_alloc(CTX, bytes + 256);
    FM_ASSERT(p);
    return p;
}
static void dfree(void *p) { OPS->mem_free(CTX, p); }
static void h2d(void *d, const void *h, size_t bytes) {
    if (bytes) OPS->copy(CTX, d, h, bytes, FM_COPY_H2D);
}
static void d2h(void *h, const void *d, size_t bytes) {
    if (bytes) OPS->copy(CTX, h, d, bytes, FM_COPY_D2H);
}
static void *up_bytes(const void *h, size_t bytes) {
    void *d = dalloc(bytes);
    h2d(d, h, bytes);
    return d;
}
static void *up_f32(const float *x, int64_t n) { return up_bytes(x, (size_t)n * 4); }
static void *up_i32(const int32_t *x, int64_t n) { return up_bytes(x, (size_t)n * 4); }
/* All bytes 0xff: NaN in fp32 and bf16, -1 in int32. */
static void dpoison(void *d, size_t bytes) {
    if (bytes) OPS->mem_set(CTX, d, 0xff, bytes);
}
/* Raw bf16 bits of a device bf16 buffer. */
static uint16_t *down_bits(const void *d, int64_t n) {
    uint16_t *h = calloc((size_t)(n > 0 ? n : 1), 2);
    FM_ASSERT(h);
    d2h(h, d, (size_t)n * 2);
    return h;
}
/* Two device buffers hold the same bytes. */
static bool same_bytes(const void *a, const void *b, size_t bytes) {
    if (!bytes) return true;
    char *ha = malloc(bytes), *hb = malloc(bytes);
    FM_ASSERT(ha && hb);
    d2h(ha, a, bytes);
    d2h(hb, b, bytes);
    const bool eq = !memcmp(ha, hb, bytes);
    free(ha), free(hb);
    return eq;
}

/* gt_nerr with the reference's RMS floored at `floor` (for references that can be ~0). */
static double nerr_floor(const float *a, const double *ref, int64_t n, double floor) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i])) return INFINITY;
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    const double fl = floor * floor * (double)(n > 0 ? n : 1);
    return sqrt(num / (den > fl ? den : fl));
}

#define CHECK_ERR(what, err, tol)                                                                  \
    CHECK_MSG((err) <= (tol), "%s: normalized error %.3g > tol %.3g", (what), (double)(err),      \
              (double)(tol))

/* bf16 ulp limits (gt_bf16_ulps against the fp64 reference rounded to bf16). gather_bwd and
 * combine_fwd add k <= 8 terms in fp32 and round once; combine_bwd's dye is one fp32 product
 * rounded: within 1 ulp of the rounded reference (the neighbour where the reference lies near a
 * rounding boundary); the sums can cancel, so they are floored at rms(ref)/64. cross_entropy's
 * dlogits = grad_scale (softmax - onehot) carries the fp32 exp and log-sum-exp errors (relative
 * ~|logit| 2^-24, 1e-3 at logits ~1e4: a quarter of a bf16 ulp) and cancels at the target
 * column: 2, floored. */
#define ULPS_MOE 1
#define ULPS_CE 2

/* ---- finite differences (as tests/test_ops_cpu.c) ------------------------------------------ */

typedef double (*objective_fn)(void *state);
enum { FD_ELEMS = 24, FD_DIRS = 3 };
static const double FD_H = 1e-6;

/* grad (n elements) against central differences of the fp64 objective f, which reads x (perturbed
 * in place and restored): FD_ELEMS random elements, error normalized by max(max|grad|, floor), at
 * tol; then FD_DIRS random directions at tol / 10. */
static void fd_check(const char *what, objective_fn f, void *st, double *x, int64_t n, const double *grad,
                     double tol, double floor) {
    double gmax = floor > 1e-12 ? floor : 1e-12;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(grad[i])) {
            CHECK_MSG(0, "%s: gradient element %lld is %g", what, (long long)i, grad[i]);
            return;
        }
        gmax = fabs(grad[i]) > gmax ? fabs(grad[i]) : gmax;
    }
    double worst = 0, worst_fd = 0;
    int64_t worst_i = -1;
    const int64_t ne = n <= FD_ELEMS ? n : FD_ELEMS;
    for (int64_t s = 0; s < ne; s++) {
        const int64_t i = n <= FD_ELEMS ? s : (int64_t)fm_rng_below(&g_rng, (uint64_t)n);
        const double x0 = x[i];
        x[i] = x0 + FD_H;
        const double fp = f(st);
        x[i] = x0 - FD_H;
        const double fm = f(st);
        x[i] = x0;
        const double fd = (fp - fm) / (2 * FD_H);
        const double e = fabs(fd - grad[i]) / (gmax > fabs(fd) ? gmax : fabs(fd));
        if (e > worst) {
            worst = e;
            worst_i = i;
            worst_fd = fd;
        }
    }
    CHECK_MSG(worst <= tol, "%s: element %lld: op %.9g vs finite difference %.9g (nerr %.3g > %.3g)", what,
              (long long)worst_i, worst_i >= 0 ? grad[worst_i] : 0.0, worst_fd, worst, tol);
    double *x0 = dnew(n), *u = dnew(n);
    memcpy(x0, x, (size_t)n * sizeof(double));
    for (int d = 0; d < FD_DIRS; d++) {
        double an = 0, mag = 1e-300, umag = 0;
        for (int64_t i = 0; i < n; i++) {
            u[i] = rnd_normal();
            an += grad[i] * u[i];
            mag += fabs(grad[i] * u[i]);
            umag += fabs(u[i]);
        }
        mag = mag > floor * umag ? mag : floor * umag;
        for (int64_t i = 0; i < n; i++) x[i] = x0[i] + FD_H * u[i];
        const double fp = f(st);
        for (int64_t i = 0; i < n; i++) x[i] = x0[i] - FD_H * u[i];
        const double fm = f(st);
        memcpy(x, x0, (size_t)n * sizeof(double));
        const double fd = (fp - fm) / (2 * FD_H), e = fabs(fd - an) / mag;
        CHECK_MSG(e <= tol * 0.1, "%s: direction %d: <grad,u> %.9g vs finite difference %.9g (nerr %.3g > %.3g)",
                  what, d, an, fd, e, tol * 0.1);
    }
    free(x0), free(u);
}

/* ==== router ================================================================================= */

typedef struct rt_st {
    double *logits, *probs, *lse; /* the objective reads logits; probs, lse hold its softmax */
    fm_ref_router_loss loss;      /* the selection held fixed */
} rt_st;

static double rt_obj(void *p) {
    rt_st *s = p;
    return fm_ref_router_objective(&s->loss, s->logits, s->probs, s->lse);
}

#define ROUTER_GRAD_FLOOR 0.01

/* router_loss_terms and router_aux_grad on the op's statistics (device count, prob_sum [E] and
 * lse_sq): against the fp64 references on the same (fp32) statistics, and bit for bit against
 * the CPU backend's expression (fm_cpu_router_loss_terms / _aux_grad: e ascending, in double),
 * each twice for determinism. */
static void check_router_loss(const char *what, const void *d_cnt, const void *d_ps, const double *d_lsesq, int64_t N,
                              int64_t E) {
    float *cnt = fnew(E), *psum = fnew(E), *g = fnew(E), *g2 = fnew(E);
    d2h(cnt, d_cnt, (size_t)E * 4);
    d2h(psum, d_ps, (size_t)E * 4);
    const double lse_sq = gt_read_f64(&g_be, d_lsesq);
    double *terms_d = gt_dev_f64(&g_be, 4);
    gt_write_f64(&g_be, terms_d, NAN), gt_write_f64(&g_be, terms_d + 1, NAN);
    OPS->router_loss_terms(CTX, terms_d, d_cnt, d_ps, d_lsesq, N, E);
    OPS->router_loss_terms(CTX, terms_d + 2, d_cnt, d_ps, d_lsesq, N, E);
    double terms[4];
    gt_read_f64s(&g_be, terms, terms_d, 4);
    double *cd = fm_ref_widen(cnt, E), *pd = fm_ref_widen(psum, E), rt[2];
    fm_ref_router_loss_terms(rt, cd, pd, lse_sq, N, E);
    char w2[200];
    snprintf(w2, sizeof w2, "%s: router_loss_terms", what);
    CHECK_MSG(fabs(terms[0] - rt[0]) <= 1e-13 * fabs(rt[0]) && fabs(terms[1] - rt[1]) <= 1e-15 * fabs(rt[1]),
              "%s: (%.17g, %.17g) vs fp64 (%.17g, %.17g)", w2, terms[0], terms[1], rt[0], rt[1]);
    double s = 0; /* the CPU backend's arithmetic, operation by operation */
    for (int64_t e = 0; e < E; e++) s += ((double)cnt[e] / N) * ((double)psum[e] / N);
    const double cpu0 = (double)E * s, cpu1 = lse_sq / (double)N;
    CHECK_MSG(!memcmp(&terms[0], &cpu0, 8) && !memcmp(&terms[1], &cpu1, 8),
              "%s: (%.17g, %.17g) not the CPU's bits (%.17g, %.17g)", w2, terms[0], terms[1], cpu0, cpu1);
    CHECK_MSG(!memcmp(terms, terms + 2, 16), "%s: two calls differ", w2);
    const double coefs[2] = {0.01, 1.0};
    for (int ci = 0; ci < 2; ci++) {
        const double coef = coefs[ci];
        void *d_g = dalloc((size_t)E * 4), *d_g2 = dalloc((size_t)E * 4);
        dpoison(d_g, (size_t)E * 4);
        OPS->router_aux_grad(CTX, d_g, d_cnt, coef, N, E);
        OPS->router_aux_grad(CTX, d_g2, d_cnt, coef, N, E);
        d2h(g, d_g, (size_t)E * 4);
        d2h(g2, d_g2, (size_t)E * 4);
        double *rg = dnew(E);
        fm_ref_router_aux_grad(rg, cd, coef, N, E);
        snprintf(w2, sizeof w2, "%s: router_aux_grad coef %g", what, coef);
        CHECK_ERR(w2, gt_nerr(g, rg, E), 1e-7);
        bool bits = true;
        for (int64_t e = 0; e < E; e++) {
            const float want = (float)(coef * (double)E * ((double)cnt[e] / N) / (double)N);
            bits &= !memcmp(&g[e], &want, 4);
        }
        CHECK_MSG(bits, "%s: not the CPU's bits", w2);
        CHECK_MSG(!memcmp(g, g2, (size_t)E * 4), "%s: two calls differ", w2);
        free(rg);
        dfree(d_g), dfree(d_g2);
    }
    free(cnt), free(psum), free(g), free(g2), free(cd), free(pd);
    dfree(terms_d);
}

/* router_fwd (probs, lse vs fp64; ids exact vs the selection rule applied to the op's probs, and
 * the documented ties; weights vs fp64), router_stats, router_bwd (analytic fp64 and finite
 * differences), each twice for determinism. */
static void test_router_case(int64_t N, int64_t E, int64_t k, bool norm, bool fd) {
    char what[128];
    snprintf(what, sizeof what, "router N=%lld E=%lld k=%lld norm=%d", (long long)N, (long long)E, (long long)k,
             (int)norm);
    float *logits = fnew(N * E), *probs = fnew(N * E), *lse = fnew(N), *tw = fnew(N * k);
    int32_t *idx = inew(N * k), *ridx = inew(N * k);
    fill_normal(logits, N * E, 2.0);
    /* Ties: row 0 all equal; row 1 the max shared by experts E-1 and 1; row 2 a tie at the
     * boundary of the selection (the k-th and (k+1)-th largest equal). */
    if (N >= 3 && E >= 3) {
        for (int64_t e = 0; e < E; e++) logits[e] = 0.25f;
        logits[1 * E + E - 1] = logits[1 * E + 1] = 9.0f;
        for (int64_t e = 0; e < E; e++) logits[2 * E + e] = (float)(-e);
        logits[2 * E + E - 1] = logits[2 * E + k - 1] = (float)(-(k - 1));
    }
    void *d_logits = up_f32(logits, N * E);
    void *d_probs = dalloc((size_t)(N * E) * 4), *d_lse = dalloc((size_t)N * 4), *d_idx = dalloc((size_t)(N * k) * 4),
         *d_tw = dalloc((size_t)(N * k) * 4);
    void *d_probs2 = dalloc((size_t)(N * E) * 4), *d_lse2 = dalloc((size_t)N * 4),
         *d_idx2 = dalloc((size_t)(N * k) * 4), *d_tw2 = dalloc((size_t)(N * k) * 4);
    dpoison(d_probs, (size_t)(N * E) * 4), dpoison(d_lse, (size_t)N * 4), dpoison(d_idx, (size_t)(N * k) * 4),
        dpoison(d_tw, (size_t)(N * k) * 4);
    OPS->router_fwd(CTX, d_probs, d_lse, d_idx, d_tw, d_logits, N, E, k, norm);
    OPS->router_fwd(CTX, d_probs2, d_lse2, d_idx2, d_tw2, d_logits, N, E, k, norm);
    CHECK_MSG(same_bytes(d_probs, d_probs2, (size_t)(N * E) * 4) && same_bytes(d_lse, d_lse2, (size_t)N * 4) &&
                  same_bytes(d_idx, d_idx2, (size_t)(N * k) * 4) && same_bytes(d_tw, d_tw2, (size_t)(N * k) * 4),
              "%s: two calls differ", what);
    d2h(probs, d_probs, (size_t)(N * E) * 4);
    d2h(lse, d_lse, (size_t)N * 4);
    d2h(idx, d_idx, (size_t)(N * k) * 4);
    d2h(tw, d_tw, (size_t)(N * k) * 4);

    rt_st s = {dnew(N * E), dnew(N * E), dnew(N), {idx, NULL, NULL, 0.0, N, E, k, norm}};
    to_d(s.logits, logits, N * E);
    fm_ref_softmax(s.probs, s.lse, s.logits, N, E);
    double *pd = fm_ref_widen(probs, N * E), *ld = fm_ref_widen(lse, N); /* the op's fp32 probs, lse */
    char w2[200];
    snprintf(w2, sizeof w2, "%s: probs", what);
    CHECK_ERR(w2, gt_nerr(probs, s.probs, N * E), 1e-5);
    snprintf(w2, sizeof w2, "%s: lse", what);
    CHECK_ERR(w2, gt_nerr(lse, s.lse, N), 1e-5);
    fm_ref_topk(ridx, pd, N, E, k); /* the selection rule applied to the op's probs */
    CHECK_MSG(!memcmp(idx, ridx, (size_t)(N * k) * 4), "%s: top-k ids differ from the selection rule", what);
    if (N >= 3 && E >= 3) {
        CHECK_MSG(idx[0] == 0 && (k < 2 || idx[1] == 1), "%s: all-equal row picks ids 0..k-1", what);
        CHECK_MSG(idx[k] == 1 && (k < 2 || idx[k + 1] == E - 1), "%s: tied max picks id 1 then E-1", what);
        CHECK_MSG(idx[2 * k + k - 1] == k - 1, "%s: boundary tie picks the lower id", what);
    }
    double *rw = dnew(N * k);
    fm_ref_topk_weights(rw, s.probs, idx, N, E, k, norm);
    snprintf(w2, sizeof w2, "%s: topk_w", what);
    CHECK_ERR(w2, gt_nerr(tw, rw, N * k), 1e-5);

    /* router_stats */
    float *cnt = fnew(E), *psum = fnew(E);
    void *d_cnt = dalloc((size_t)E * 4), *d_ps = dalloc((size_t)E * 4), *d_cnt2 = dalloc((size_t)E * 4),
         *d_ps2 = dalloc((size_t)E * 4);
    dpoison(d_cnt, (size_t)E * 4), dpoison(d_ps, (size_t)E * 4);
    double *d_z = gt_dev_f64(&g_be, 2), zz[2];
    gt_write_f64(&g_be, d_z, NAN); /* assigned */
    OPS->router_stats(CTX, d_cnt, d_ps, d_z, d_probs, d_lse, d_idx, N, E, k);
    OPS->router_stats(CTX, d_cnt2, d_ps2, d_z + 1, d_probs, d_lse, d_idx, N, E, k);
    gt_read_f64s(&g_be, zz, d_z, 2);
    const double z = zz[0], z2 = zz[1];
    CHECK_MSG(!memcmp(&z, &z2, 8) && same_bytes(d_cnt, d_cnt2, (size_t)E * 4) && same_bytes(d_ps, d_ps2, (size_t)E * 4),
              "%s: router_stats: two calls differ", what);
    d2h(cnt, d_cnt, (size_t)E * 4);
    d2h(psum, d_ps, (size_t)E * 4);
    double *rc = dnew(E), *rp = dnew(E);
    const double rz = fm_ref_router_stats(rc, rp, pd, ld, idx, N, E, k);
    bool cnt_ok = true;
    for (int64_t e = 0; e < E; e++) cnt_ok &= (double)cnt[e] == rc[e];
    CHECK_MSG(cnt_ok, "%s: router_stats count", what);
    snprintf(w2, sizeof w2, "%s: router_stats prob_sum", what);
    CHECK_ERR(w2, gt_nerr(psum, rp, E), 1e-6);
    CHECK_CLOSE(z, rz, 1e-9);
    check_router_loss(what, d_cnt, d_ps, d_z, N, E);
    dfree(d_z);

    /* router_bwd: (a) top-k weights only, (b) load-balancing term only (dtopk_w zero, and NULL),
     * (c) z-loss only, (d) all three. */
    float *dw = fnew(N * k), *gpe = fnew(E), *dl = fnew(N * E), *zero = fnew(N * k);
    fill_normal(dw, N * k, 1.0);
    for (int64_t e = 0; e < E; e++) gpe[e] = (float)(0.3 * rnd_normal());
    void *d_dw = up_f32(dw, N * k), *d_gpe = up_f32(gpe, E), *d_zero = up_f32(zero, N * k);
    void *d_dl = dalloc((size_t)(N * E) * 4), *d_dl2 = dalloc((size_t)(N * E) * 4);
    double *ddw = dnew(N * k), *dgpe = dnew(E), *g = dnew(N * E), *gref = dnew(N * E);
    to_d(ddw, dw, N * k);
    to_d(dgpe, gpe, E);
    struct {
        const char *name;
        void *dw;
        void *gpe;
        float z;
    } cases[] = {{"topk_w", d_dw, NULL, 0.0f},
                 {"aux (dprobs_per_expert)", d_zero, d_gpe, 0.0f},
                 {"aux, dtopk_w NULL", NULL, d_gpe, 0.0f},
                 {"z-loss", d_zero, NULL, 0.01f},
                 {"all terms", d_dw, d_gpe, 0.01f}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        dpoison(d_dl, (size_t)(N * E) * 4);
        OPS->router_bwd(CTX, d_dl, cases[c].dw, cases[c].gpe, cases[c].z, d_probs, d_lse, d_idx, d_tw, N, E, k,
                        norm);
        OPS->router_bwd(CTX, d_dl2, cases[c].dw, cases[c].gpe, cases[c].z, d_probs, d_lse, d_idx, d_tw, N, E, k,
                        norm);
        snprintf(w2, sizeof w2, "%s: router_bwd %s", what, cases[c].name);
        CHECK_MSG(same_bytes(d_dl, d_dl2, (size_t)(N * E) * 4), "%s: two calls differ", w2);
        d2h(dl, d_dl, (size_t)(N * E) * 4);
        s.loss.dw = cases[c].dw == d_dw ? ddw : NULL;
        s.loss.gpe = cases[c].gpe ? dgpe : NULL;
        s.loss.z = cases[c].z;
        to_d(g, dl, N * E);
        fm_ref_softmax(s.probs, s.lse, s.logits, N, E);
        fm_ref_router_bwd(gref, &s.loss, s.probs, s.lse);
        /* analytic: normalized by the gradient's size, floored like the FD check */
        double num = 0, den = 0;
        for (int64_t i = 0; i < N * E; i++) {
            if (!isfinite(g[i])) num = INFINITY;
            num += (g[i] - gref[i]) * (g[i] - gref[i]);
            den += gref[i] * gref[i];
        }
        const double floor2 = 1e-6 * (double)(N * E); /* an RMS gradient of 1e-3 */
        CHECK_ERR(w2, sqrt(num / (den > floor2 ? den : floor2)), 1e-5);
        if (fd) fd_check(w2, rt_obj, &s, s.logits, N * E, g, GT_TOL_F32, ROUTER_GRAD_FLOOR);
    }
    free(logits), free(probs), free(lse), free(tw), free(idx), free(ridx), free(s.logits), free(s.probs),
        free(s.lse), free(rw), free(cnt), free(psum), free(rc), free(rp), free(dw), free(gpe), free(dl), free(zero),
        free(ddw), free(dgpe), free(g), free(gref), free(pd), free(ld);
    void *dev[] = {d_logits, d_probs, d_lse, d_idx, d_tw, d_probs2, d_lse2, d_idx2, d_tw2, d_cnt, d_ps,
                   d_cnt2,   d_ps2,   d_dw,  d_gpe, d_zero, d_dl,   d_dl2};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) dfree(dev[i]);
}

/* NaN logits (a diverged run) must not fault: k distinct ids in [0,E), NaN in the weights.
 * Row 0 has one NaN, row 1 is all NaN. */
static void test_router_nan(void) {
    const int64_t N = 2, E = 6, k = 3;
    float logits[12], tw[6];
    int32_t idx[6];
    for (int e = 0; e < 12; e++) logits[e] = (float)(e % 5);
    logits[4] = NAN;
    for (int e = 6; e < 12; e++) logits[e] = NAN;
    void *d_l = up_f32(logits, 12), *d_p = dalloc(48), *d_lse = dalloc(8), *d_i = dalloc(24), *d_w = dalloc(24);
    OPS->router_fwd(CTX, d_p, d_lse, d_i, d_w, d_l, N, E, k, true);
    d2h(idx, d_i, 24);
    d2h(tw, d_w, 24);
    bool ok = true;
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < k; j++) {
            ok &= idx[n * k + j] >= 0 && idx[n * k + j] < E;
            for (int i = 0; i < j; i++) ok &= idx[n * k + i] != idx[n * k + j];
        }
    CHECK_MSG(ok, "router_fwd with NaN logits: ids not k distinct experts in [0,E)");
    CHECK_MSG(isnan(tw[0]) && isnan(tw[3]), "router_fwd with NaN logits: NaN did not reach topk_w");
    dfree(d_l), dfree(d_p), dfree(d_lse), dfree(d_i), dfree(d_w);
}

/* router_stats over many tokens (several blocks of partial sums) and a wide E. */
static void test_router_stats_large(int64_t N, int64_t E, int64_t k) {
    float *logits = fnew(N * E), *probs = fnew(N * E), *lse = fnew(N), *cnt = fnew(E), *psum = fnew(E);
    int32_t *idx = inew(N * k);
    fill_normal(logits, N * E, 1.5);
    void *d_l = up_f32(logits, N * E), *d_p = dalloc((size_t)(N * E) * 4), *d_lse = dalloc((size_t)N * 4),
         *d_i = dalloc((size_t)(N * k) * 4), *d_w = dalloc((size_t)(N * k) * 4), *d_c = dalloc((size_t)E * 4),
         *d_s = dalloc((size_t)E * 4);
    OPS->router_fwd(CTX, d_p, d_lse, d_i, d_w, d_l, N, E, k, true);
    d2h(probs, d_p, (size_t)(N * E) * 4);
    d2h(lse, d_lse, (size_t)N * 4);
    d2h(idx, d_i, (size_t)(N * k) * 4);
    dpoison(d_c, (size_t)E * 4), dpoison(d_s, (size_t)E * 4);
    double *d_z = gt_dev_f64(&g_be, 1);
    OPS->router_stats(CTX, d_c, d_s, d_z, d_p, d_lse, d_i, N, E, k);
    const double z = gt_read_f64(&g_be, d_z);
    d2h(cnt, d_c, (size_t)E * 4);
    d2h(psum, d_s, (size_t)E * 4);
    double *rc = dnew(E), *rp = dnew(E), *pd = fm_ref_widen(probs, N * E), *ld = fm_ref_widen(lse, N);
    const double rz = fm_ref_router_stats(rc, rp, pd, ld, idx, N, E, k);
    free(pd), free(ld);
    bool ok = true;
    for (int64_t e = 0; e < E; e++) ok &= (double)cnt[e] == rc[e];
    char what[96];
    snprintf(what, sizeof what, "router_stats N=%lld E=%lld k=%lld", (long long)N, (long long)E, (long long)k);
    CHECK_MSG(ok, "%s: count", what);
    CHECK_ERR(what, gt_nerr(psum, rp, E), 1e-6);
    CHECK_CLOSE(z, rz, 1e-9);
    check_router_loss(what, d_c, d_s, d_z, N, E);
    OPS->router_stats(CTX, d_c, d_s, d_z, d_p, d_lse, d_i, N, E, k);
    const double z2 = gt_read_f64(&g_be, d_z);
    float *psum2 = fnew(E);
    d2h(psum2, d_s, (size_t)E * 4);
    CHECK_MSG(!memcmp(&z2, &z, 8) && !memcmp(psum, psum2, (size_t)E * 4), "%s: two calls differ", what);
    dfree(d_z);
    free(logits), free(probs), free(lse), free(cnt), free(psum), free(psum2), free(idx), free(rc), free(rp);
    dfree(d_l), dfree(d_p), dfree(d_lse), dfree(d_i), dfree(d_w), dfree(d_c), dfree(d_s);
}

static void test_router(void) {
    test_router_nan();
    test_router_case(33, 8, 1, false, true);
    test_router_case(33, 8, 1, true, true);
    test_router_case(33, 8, 2, true, true);
    test_router_case(20, 64, 8, true, true);
    test_router_case(20, 64, 8, false, true);
    test_router_case(7, 40, 40, true, true);  /* k = E > 32 */
    test_router_case(12, 128, 8, true, true); /* E = 128 */
    test_router_case(9, 256, 8, false, true); /* E = 256 */
    test_router_case(10, 300, 8, true, true); /* E > 256: the generic path */
    test_router_case(6, 300, 40, false, true);
    test_router_case(1000, 64, 8, true, false);
    test_router_case(777, 128, 8, false, false);
    test_router_case(4099, 128, 1, true, false);
    test_router_case(301, 256, 8, true, false);
    /* more tokens than resident warps: each warp walks several tokens (prefetching) */
    test_router_case(20011, 64, 8, true, false);
    test_router_case(9001, 256, 4, false, false);
    test_router_case(9001, 300, 2, true, false);
    test_router_stats_large(200003, 64, 8);
    test_router_stats_large(5001, 300, 4);
    test_router_stats_large(70001, 8, 2);
}

/* ==== MoE permutation ========================================================================= */

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

/* Pinned host int64 [n] for moe_route_index's offsets (buffer_alloc), filled with `fill`. */
static int64_t *pinned_i64(int64_t n, int64_t fill) {
    int64_t *p = OPS->buffer_alloc(CTX, FM_BUFFER_PINNED, (size_t)n * sizeof(int64_t));
    FM_ASSERT(p != NULL);
    for (int64_t i = 0; i < n; i++) p[i] = fill;
    return p;
}
static void pinned_free(void *p) { OPS->buffer_free(CTX, FM_BUFFER_PINNED, p); }

/* The op's route index against the stable counting sort built here: expert e's rows are the
 * routes r with topk_idx[r] == e in increasing r. The offsets land in pinned memory and are read
 * after one stream_sync, the named sync point (the two calls make no host wait: host_sync_count
 * moves by exactly one). Also: two calls give the same result. */
static void check_route_index(const char *what, const int32_t *idx, int64_t N, int64_t E, int64_t k) {
    const int64_t R = N * k;
    int64_t *off = pinned_i64(E + 1, -5), *off2 = pinned_i64(E + 1, -5);
    int32_t *rr = inew(R), *rw = inew(R);
    void *d_idx = up_i32(idx, R), *d_rr = dalloc((size_t)R * 4), *d_rw = dalloc((size_t)R * 4),
         *d_rr2 = dalloc((size_t)R * 4), *d_rw2 = dalloc((size_t)R * 4);
    dpoison(d_rr, (size_t)R * 4), dpoison(d_rw, (size_t)R * 4);
    const uint64_t h0 = OPS->host_sync_count(CTX);
    OPS->moe_route_index(CTX, off, d_rr, d_rw, d_idx, N, E, k);
    OPS->moe_route_index(CTX, off2, d_rr2, d_rw2, d_idx, N, E, k);
    CHECK_MSG(OPS->host_sync_count(CTX) == h0, "moe_route_index %s: the op made the host wait", what);
    OPS->stream_sync(CTX, FM_STREAM_COMPUTE);
    CHECK_MSG(OPS->host_sync_count(CTX) == h0 + 1, "moe_route_index %s: stream_sync is not one host sync", what);
    int64_t *off_now = malloc((size_t)(E + 1) * sizeof(int64_t)); /* what the host saw right after the sync */
    memcpy(off_now, off, (size_t)(E + 1) * sizeof(int64_t));
    d2h(rr, d_rr, (size_t)R * 4);
    d2h(rw, d_rw, (size_t)R * 4);
    /* the stable counting sort on the host */
    int64_t *roff = malloc((size_t)(E + 1) * sizeof(int64_t));
    int32_t *rrr = inew(R), *rrw = inew(R);
    fm_ref_route_index(roff, rrr, rrw, idx, N, E, k);
    const bool ok = !memcmp(off_now, roff, (size_t)(E + 1) * 8) && !memcmp(rr, rrr, (size_t)R * 4) &&
                    !memcmp(rw, rrw, (size_t)R * 4);
    free(roff), free(rrr), free(rrw);
    CHECK_MSG(ok, "moe_route_index %s: layout differs from the stable counting sort", what);
    CHECK_MSG(!memcmp(off, off2, (size_t)(E + 1) * 8) && same_bytes(d_rr, d_rr2, (size_t)R * 4) &&
                  same_bytes(d_rw, d_rw2, (size_t)R * 4),
              "moe_route_index %s: two calls differ", what);
    pinned_free(off), pinned_free(off2), free(off_now), free(rr), free(rw);
    dfree(d_idx), dfree(d_rr), dfree(d_rw), dfree(d_rr2), dfree(d_rw2);
}

static void test_route_index(void) {
    int32_t *idx = inew(2000000);
    random_topk(idx, 37, 6, 2, 3);
    check_route_index("N=37 E=6 k=2, expert 3 empty", idx, 37, 6, 2);
    for (int n = 0; n < 20; n++) idx[n] = 2;
    check_route_index("all tokens to expert 2 (k=1)", idx, 20, 4, 1);
    for (int n = 0; n < 100003; n++) idx[n] = 2;
    check_route_index("100003 tokens all to expert 2 (k=1)", idx, 100003, 4, 1);
    random_topk(idx, 16, 5, 3, 0);
    for (int n = 0; n < 16; n++) idx[n * 3 + n % 3] = 0; /* expert 0 in every token, slot varies */
    check_route_index("expert 0 in every token (k=3)", idx, 16, 5, 3);
    random_topk(idx, 37, 8, 3, -1);
    check_route_index("N=37 E=8 k=3", idx, 37, 8, 3);
    check_route_index("N=0", idx, 0, 8, 3);
    for (int n = 0; n < 5000; n++) idx[n] = 0;
    check_route_index("E=1", idx, 5000, 1, 1);
    random_topk(idx, 10007, 128, 8, 77);
    check_route_index("N=10007 E=128 k=8, expert 77 empty", idx, 10007, 128, 8);
    random_topk(idx, 3001, 256, 8, -1);
    check_route_index("N=3001 E=256 k=8", idx, 3001, 256, 8);
    random_topk(idx, 1000, 64, 1, -1);
    check_route_index("N=1000 E=64 k=1", idx, 1000, 64, 1);
    /* 2M routes (several hundred chunks), skewed: half the routes go to expert 5. */
    random_topk(idx, 250000, 64, 8, -1);
    for (int64_t r = 0; r < 250000 * 8; r++)
        if (fm_rng_below(&g_rng, 2) == 0) {
            const int64_t n = r / 8;
            bool has5 = false;
            for (int j = 0; j < 8; j++) has5 |= idx[n * 8 + j] == 5;
            if (!has5) idx[r] = 5;
        }
    check_route_index("N=250000 E=64 k=8, skewed", idx, 250000, 64, 8);
    free(idx);
}

/* ==== MoE gather / combine =================================================================== */

static float *rounded_normal(int64_t n, double scale) {
    float *x = fnew(n);
    fill_normal(x, n, scale);
    gt_round_bf16(x, n);
    return x;
}

/* gather exact (bits), gather_bwd and combine_fwd (bf16) vs fp64, combine_bwd dye (bf16) and
 * dtopk_w (fp32) vs fp64; every op twice for determinism. */
static void test_gather_combine(int64_t N, int64_t E, int64_t k, int64_t H) {
    char what[96];
    snprintf(what, sizeof what, "N=%lld E=%lld k=%lld H=%lld", (long long)N, (long long)E, (long long)k,
             (long long)H);
    const int64_t R = N * k;
    int32_t *idx = inew(R), *rr = inew(R), *rw = inew(R);
    int64_t *off = pinned_i64(E + 1, -5);
    random_topk(idx, N, E, k, (int32_t)(E - 1));
    void *d_idx = up_i32(idx, R), *d_rr = dalloc((size_t)R * 4), *d_rw = dalloc((size_t)R * 4);
    OPS->moe_route_index(CTX, off, d_rr, d_rw, d_idx, N, E, k);
    OPS->stream_sync(CTX, FM_STREAM_COMPUTE);
    d2h(rr, d_rr, (size_t)R * 4);
    d2h(rw, d_rw, (size_t)R * 4);
    float *x = rounded_normal(N * H, 1.0), *dxe = rounded_normal(R * H, 1.0), *ye = rounded_normal(R * H, 1.0),
          *dout = rounded_normal(N * H, 1.0), *w = fnew(R), *out = fnew(N * H), *dx = fnew(N * H),
          *dye = fnew(R * H), *dw = fnew(R);
    fill_uniform(w, R, 0.0, 1.0);
    void *d_x = gt_upload(&g_be, x, N * H, FM_DTYPE_BF16), *d_dxe = gt_upload(&g_be, dxe, R * H, FM_DTYPE_BF16),
         *d_ye = gt_upload(&g_be, ye, R * H, FM_DTYPE_BF16), *d_dout = gt_upload(&g_be, dout, N * H, FM_DTYPE_BF16),
         *d_w = up_f32(w, R);
    void *d_xe = dalloc((size_t)(R * H) * 2), *d_xe2 = dalloc((size_t)(R * H) * 2), *d_dx = dalloc((size_t)(N * H) * 2),
         *d_dx2 = dalloc((size_t)(N * H) * 2), *d_out = dalloc((size_t)(N * H) * 2),
         *d_out2 = dalloc((size_t)(N * H) * 2), *d_dye = dalloc((size_t)(R * H) * 2),
         *d_dye2 = dalloc((size_t)(R * H) * 2), *d_dw = dalloc((size_t)R * 4), *d_dw2 = dalloc((size_t)R * 4);
    char w2[160];

    /* gather */
    dpoison(d_xe, (size_t)(R * H) * 2);
    OPS->moe_gather(CTX, d_xe, d_x, d_rr, R, k, H);
    OPS->moe_gather(CTX, d_xe2, d_x, d_rr, R, k, H);
    uint16_t *xb = down_bits(d_x, N * H), *xeb = down_bits(d_xe, R * H);
    bool ok = true;
    for (int64_t r = 0; r < R; r++) ok &= !memcmp(xeb + r * H, xb + (rr[r] / k) * H, (size_t)H * 2);
    CHECK_MSG(ok, "moe_gather %s: rows differ from x[row_route/k]", what);
    CHECK_MSG(same_bytes(d_xe, d_xe2, (size_t)(R * H) * 2), "moe_gather %s: two calls differ", what);

    /* gather_bwd */
    dpoison(d_dx, (size_t)(N * H) * 2);
    OPS->moe_gather_bwd(CTX, d_dx, d_dxe, d_rw, N, k, H);
    OPS->moe_gather_bwd(CTX, d_dx2, d_dxe, d_rw, N, k, H);
    gt_download(&g_be, dx, d_dx, N * H, FM_DTYPE_BF16);
    double *ref = dnew((R > N ? R : N) * H), *rdw = dnew(R);
    double *dxed = fm_ref_widen(dxe, R * H), *yed = fm_ref_widen(ye, R * H), *wd = fm_ref_widen(w, R),
           *doutd = fm_ref_widen(dout, N * H);
    fm_ref_moe_gather_bwd(ref, dxed, rw, N, k, H);
    snprintf(w2, sizeof w2, "moe_gather_bwd %s", what);
    CHECK_ERR(w2, gt_nerr(dx, ref, N * H), GT_TOL_BF16);
    CHECK_ULPS(w2, dx, ref, N * H, gt_rms(ref, N * H) / 64, ULPS_MOE);
    CHECK_MSG(same_bytes(d_dx, d_dx2, (size_t)(N * H) * 2), "%s: two calls differ", w2);

    /* combine_fwd */
    dpoison(d_out, (size_t)(N * H) * 2);
    OPS->moe_combine_fwd(CTX, d_out, d_ye, d_w, d_rw, N, k, H);
    OPS->moe_combine_fwd(CTX, d_out2, d_ye, d_w, d_rw, N, k, H);
    gt_download(&g_be, out, d_out, N * H, FM_DTYPE_BF16);
    fm_ref_moe_combine_fwd(ref, yed, wd, rw, N, k, H);
    snprintf(w2, sizeof w2, "moe_combine_fwd %s", what);
    CHECK_ERR(w2, gt_nerr(out, ref, N * H), GT_TOL_BF16);
    CHECK_ULPS(w2, out, ref, N * H, gt_rms(ref, N * H) / 64, ULPS_MOE);
    CHECK_MSG(same_bytes(d_out, d_out2, (size_t)(N * H) * 2), "%s: two calls differ", w2);

    /* combine_bwd */
    dpoison(d_dye, (size_t)(R * H) * 2);
    dpoison(d_dw, (size_t)R * 4);
    OPS->moe_combine_bwd(CTX, d_dye, d_dw, d_dout, d_ye, d_w, d_rw, N, k, H);
    OPS->moe_combine_bwd(CTX, d_dye2, d_dw2, d_dout, d_ye, d_w, d_rw, N, k, H);
    gt_download(&g_be, dye, d_dye, R * H, FM_DTYPE_BF16);
    d2h(dw, d_dw, (size_t)R * 4);
    fm_ref_moe_combine_bwd(ref, rdw, doutd, yed, wd, rw, N, k, H);
    snprintf(w2, sizeof w2, "moe_combine_bwd dye %s", what);
    CHECK_ERR(w2, gt_nerr(dye, ref, R * H), GT_TOL_BF16);
    CHECK_ULPS(w2, dye, ref, R * H, 0.0, ULPS_MOE);
    snprintf(w2, sizeof w2, "moe_combine_bwd dtopk_w %s", what);
    CHECK_ERR(w2, gt_nerr(dw, rdw, R), 1e-6);
    CHECK_MSG(same_bytes(d_dye, d_dye2, (size_t)(R * H) * 2) && same_bytes(d_dw, d_dw2, (size_t)R * 4),
              "moe_combine_bwd %s: two calls differ", what);

    pinned_free(off);
    free(idx), free(rr), free(rw), free(x), free(dxe), free(ye), free(dout), free(w), free(out),
        free(dx), free(dye), free(dw), free(xb), free(xeb), free(ref), free(rdw), free(dxed), free(yed), free(wd),
        free(doutd);
    void *dev[] = {d_idx, d_rr,  d_rw,  d_x,    d_dxe,  d_ye,  d_dout, d_w,   d_xe,
                   d_xe2, d_dx,  d_dx2, d_out,  d_out2, d_dye, d_dye2, d_dw,  d_dw2};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) dfree(dev[i]);
}

/* ==== row gather / scatter ==================================================================== */

/* gather_rows (repeats allowed) and scatter_rows (distinct targets; rows not targeted keep their
 * bytes) on rows of any byte length, with a base pointer off the 16-byte grid. Exact. */
static void test_rows(int64_t n, int64_t nsrc, int64_t row_bytes, size_t misalign) {
    char what[96];
    snprintf(what, sizeof what, "n=%lld row_bytes=%lld misalign=%zu", (long long)n, (long long)row_bytes, misalign);
    unsigned char *src = malloc((size_t)(nsrc * row_bytes)), *dst = malloc((size_t)(n * row_bytes)),
                  *big = malloc((size_t)(nsrc * row_bytes)), *exp_ = malloc((size_t)(nsrc * row_bytes));
    for (int64_t i = 0; i < nsrc * row_bytes; i++) src[i] = (unsigned char)fm_rng_below(&g_rng, 256);
    int32_t *gi = inew(n), *si = inew(n), *perm = inew(nsrc);
    for (int64_t i = 0; i < n; i++) gi[i] = (int32_t)fm_rng_below(&g_rng, (uint64_t)nsrc);
    for (int64_t i = 0; i < nsrc; i++) perm[i] = (int32_t)i;
    for (int64_t i = nsrc - 1; i > 0; i--) {
        const int64_t j = (int64_t)fm_rng_below(&g_rng, (uint64_t)(i + 1));
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    FM_ASSERT(n <= nsrc);
    for (int64_t i = 0; i < n; i++) si[i] = perm[i];
    char *d_src = dalloc((size_t)(nsrc * row_bytes) + 16), *d_dst = dalloc((size_t)(nsrc * row_bytes) + 16);
    void *d_gi = up_i32(gi, n), *d_si = up_i32(si, n);
    h2d(d_src + misalign, src, (size_t)(nsrc * row_bytes));
    dpoison(d_dst, (size_t)(nsrc * row_bytes) + 16);
    OPS->gather_rows(CTX, d_dst + misalign, d_src + misalign, d_gi, n, row_bytes);
    d2h(dst, d_dst + misalign, (size_t)(n * row_bytes));
    bool ok = true;
    for (int64_t i = 0; i < n; i++) ok &= !memcmp(dst + i * row_bytes, src + gi[i] * row_bytes, (size_t)row_bytes);
    CHECK_MSG(ok, "gather_rows %s: rows differ", what);
    /* scatter: dst [nsrc rows] pre-filled with `big`, rows si[i] = src row i */
    for (int64_t i = 0; i < nsrc * row_bytes; i++) big[i] = (unsigned char)(i * 7 + 3);
    h2d(d_dst + misalign, big, (size_t)(nsrc * row_bytes));
    OPS->scatter_rows(CTX, d_dst + misalign, d_src + misalign, d_si, n, row_bytes);
    memcpy(exp_, big, (size_t)(nsrc * row_bytes));
    for (int64_t i = 0; i < n; i++) memcpy(exp_ + si[i] * row_bytes, src + i * row_bytes, (size_t)row_bytes);
    d2h(big, d_dst + misalign, (size_t)(nsrc * row_bytes));
    CHECK_MSG(!memcmp(big, exp_, (size_t)(nsrc * row_bytes)), "scatter_rows %s: rows differ", what);
    free(src), free(dst), free(big), free(exp_), free(gi), free(si), free(perm);
    dfree(d_src), dfree(d_dst), dfree(d_gi), dfree(d_si);
}

static void test_rows_all(void) {
    test_rows(1000, 1500, 256, 0);
    test_rows(1000, 1500, 256, 2); /* 2-byte accesses */
    test_rows(777, 800, 24, 0);
    test_rows(777, 800, 12, 0);
    test_rows(777, 800, 6, 0);
    test_rows(300, 301, 7, 1);
    test_rows(50, 60, 8192, 0);
    test_rows(5, 9, 2 * 4096 + 16, 0);
    test_rows(0, 9, 64, 0);
}

/* ==== cross-entropy ========================================================================== */

/* loss (fp32) vs fp64 and its returned sum, dlogits (bf16) vs the fp64 gradient, ignored rows
 * zero, dlogits aliasing logits gives the same bits, dlogits NULL, two calls the same bits, and
 * logits ~1e4 staying finite. With nan_row >= 0 that row holds a NaN logit: its loss is NaN and
 * the other rows are unaffected. */
static void test_cross_entropy(double scale, int64_t N, int64_t V, int64_t nan_row) {
    char what[128];
    snprintf(what, sizeof what, "cross_entropy N=%lld V=%lld scale %g%s", (long long)N, (long long)V, scale,
             nan_row >= 0 ? " NaN row" : "");
    const int32_t ignore = -100;
    const float gs = 0.37f;
    int32_t *tgt = inew(N);
    for (int64_t n = 0; n < N; n++) tgt[n] = (int32_t)fm_rng_below(&g_rng, (uint64_t)V);
    if (N > 11) tgt[2] = tgt[5] = tgt[11] = ignore;
    tgt[0] = 0;
    if (N > 1) tgt[1] = (int32_t)(V - 1);
    float *logits = rounded_normal(N * V, scale), *loss = fnew(N), *loss2 = fnew(N), *dl = fnew(N * V);
    if (nan_row >= 0) logits[nan_row * V + V / 3] = NAN;
    void *d_l = gt_upload(&g_be, logits, N * V, FM_DTYPE_BF16), *d_t = up_i32(tgt, N),
         *d_buf = gt_upload(&g_be, logits, N * V, FM_DTYPE_BF16), *d_loss = dalloc((size_t)N * 4),
         *d_loss2 = dalloc((size_t)N * 4), *d_dl = dalloc((size_t)(N * V) * 2), *d_dl2 = dalloc((size_t)(N * V) * 2);
    dpoison(d_loss, (size_t)N * 4);
    dpoison(d_dl, (size_t)(N * V) * 2);
    double *d_sum = gt_dev_f64(&g_be, 4); /* the four calls' sums */
    for (int i = 0; i < 4; i++) gt_write_f64(&g_be, d_sum + i, -7.0); /* assigned, whatever it held */
    OPS->cross_entropy(CTX, d_loss, d_dl, d_l, d_t, N, V, gs, ignore, d_sum);
    OPS->cross_entropy(CTX, d_loss2, d_dl2, d_l, d_t, N, V, gs, ignore, d_sum + 1);
    const double sum = gt_read_f64(&g_be, d_sum), sum_b = gt_read_f64(&g_be, d_sum + 1);
    CHECK_MSG((!memcmp(&sum, &sum_b, 8) || (isnan(sum) && isnan(sum_b))) && same_bytes(d_loss, d_loss2, (size_t)N * 4) &&
                  same_bytes(d_dl, d_dl2, (size_t)(N * V) * 2),
              "%s: two calls differ", what);
    d2h(loss, d_loss, (size_t)N * 4);
    gt_download(&g_be, dl, d_dl, N * V, FM_DTYPE_BF16);
    double *ref = dnew(N), *gref = dnew(N * V), *ld = fm_ref_widen(logits, N * V);
    int32_t *rtgt = inew(N); /* the NaN row left out of the reference */
    for (int64_t n = 0; n < N; n++) rtgt[n] = n == nan_row ? ignore : tgt[n];
    const double rsum = fm_ref_cross_entropy(ref, gref, ld, rtgt, NULL, N, V, gs, 0.0, ignore);
    free(ld), free(rtgt);
    if (nan_row >= 0) {
        CHECK_MSG(isnan(loss[nan_row]) && isnan(sum), "%s: the NaN row's loss (and the sum) is not NaN", what);
        loss[nan_row] = 0.0f;
        for (int64_t i = 0; i < V; i++) dl[nan_row * V + i] = 0.0f;
    }
    char w2[200];
    snprintf(w2, sizeof w2, "%s: loss", what);
    CHECK_ERR(w2, gt_nerr(loss, ref, N), GT_TOL_F32);
    if (nan_row < 0) CHECK_CLOSE(sum, rsum, 1e-5);
    bool zero_rows = true;
    for (int64_t n = 0; n < N; n++)
        if (tgt[n] == ignore) {
            zero_rows &= loss[n] == 0.0f;
            for (int64_t i = 0; i < V; i++) zero_rows &= dl[n * V + i] == 0.0f;
        }
    CHECK_MSG(zero_rows, "%s: ignored rows of loss/dlogits are not zero", what);
    CHECK_MSG(all_finite(dl, N * V) && all_finite(loss, N), "%s: non-finite output", what);
    snprintf(w2, sizeof w2, "%s: dlogits", what);
    CHECK_ERR(w2, gt_nerr(dl, gref, N * V), GT_TOL_BF16);
    CHECK_ULPS(w2, dl, gref, N * V, gt_rms(gref, N * V) / 64, ULPS_CE);
    /* dlogits aliasing logits */
    OPS->cross_entropy(CTX, d_loss2, d_buf, d_buf, d_t, N, V, gs, ignore, d_sum + 2);
    const double sum2 = gt_read_f64(&g_be, d_sum + 2);
    CHECK_MSG(same_bytes(d_buf, d_dl, (size_t)(N * V) * 2) && same_bytes(d_loss2, d_loss, (size_t)N * 4) &&
                  (sum2 == sum || nan_row >= 0),
              "%s: dlogits aliasing logits differs from the separate-buffer result", what);
    /* dlogits NULL */
    dpoison(d_loss2, (size_t)N * 4);
    OPS->cross_entropy(CTX, d_loss2, NULL, d_l, d_t, N, V, gs, ignore, d_sum + 3);
    const double sum3 = gt_read_f64(&g_be, d_sum + 3);
    CHECK_MSG((sum3 == sum || nan_row >= 0) && same_bytes(d_loss2, d_loss, (size_t)N * 4),
              "%s: dlogits NULL changes the loss", what);
    free(tgt), free(logits), free(loss), free(loss2), free(dl), free(ref), free(gref);
    dfree(d_l), dfree(d_t), dfree(d_buf), dfree(d_loss), dfree(d_loss2), dfree(d_dl), dfree(d_dl2), dfree(d_sum);
}

/* ==== linear cross-entropy strips ============================================================= */

/* Folds the fp32 logits S [Nb,V] in vocabulary blocks (bounds[0..nblk], visited in `order`),
 * then finalizes and takes each strip's gradient; all against fp64 from the logits. */
static void test_lce(const char *name, int64_t Nb, int64_t V, const int64_t *bounds, const int *order, int nblk,
                     double scale, bool with_ent, bool with_weights, int64_t nan_row) {
    char what[160];
    snprintf(what, sizeof what, "lce %s (Nb=%lld V=%lld)", name, (long long)Nb, (long long)V);
    const int32_t ignore = -100;
    const float gs = 0.61f, zc = 1e-3f;
    float *S = fnew(Nb * V), *w = fnew(Nb);
    fill_normal(S, Nb * V, scale);
    if (nan_row >= 0) S[nan_row * V + V / 2] = NAN;
    fill_uniform(w, Nb, 0.5, 1.5);
    int32_t *tg = inew(Nb);
    for (int64_t r = 0; r < Nb; r++) tg[r] = (int32_t)fm_rng_below(&g_rng, (uint64_t)V);
    if (Nb > 4) tg[1] = tg[4] = ignore;
    tg[0] = (int32_t)(V - 1);
    /* fp64 reference per row */
    double *rm = dnew(Nb), *rlse = dnew(Nb), *rent = dnew(Nb), *rloss = dnew(Nb);
    double *Sd = fm_ref_widen(S, Nb * V);
    for (int64_t r = 0; r < Nb; r++) {
        rlse[r] = fm_ref_logsumexp(Sd + r * V, V, &rm[r], &rent[r]); /* rent: -sum p log p */
        rloss[r] = tg[r] == ignore ? 0.0 : rlse[r] - Sd[r * V + tg[r]];
    }
    void *d_t = up_i32(tg, Nb), *d_w = up_f32(w, Nb);
    void *d_m = dalloc((size_t)Nb * 4), *d_z = dalloc((size_t)Nb * 4), *d_tg = dalloc((size_t)Nb * 4),
         *d_e = dalloc((size_t)Nb * 4);
    void *d_m2 = dalloc((size_t)Nb * 4), *d_z2 = dalloc((size_t)Nb * 4), *d_tg2 = dalloc((size_t)Nb * 4),
         *d_e2 = dalloc((size_t)Nb * 4);
    void **d_strip = malloc(sizeof(void *) * (size_t)nblk);
    for (int b = 0; b < nblk; b++) {
        const int64_t v0 = bounds[b], Vb = bounds[b + 1] - v0;
        float *h = fnew(Nb * Vb);
        for (int64_t r = 0; r < Nb; r++) memcpy(h + r * Vb, S + r * V + v0, (size_t)Vb * 4);
        d_strip[b] = up_f32(h, Nb * Vb);
        free(h);
    }
    /* fold, twice (state poisoned before the first block) */
    for (int pass = 0; pass < 2; pass++) {
        void *m = pass ? d_m2 : d_m, *z = pass ? d_z2 : d_z, *t = pass ? d_tg2 : d_tg, *e = pass ? d_e2 : d_e;
        dpoison(m, (size_t)Nb * 4), dpoison(z, (size_t)Nb * 4), dpoison(t, (size_t)Nb * 4),
            dpoison(e, (size_t)Nb * 4);
        for (int i = 0; i < nblk; i++) {
            const int b = order[i];
            const int64_t v0 = bounds[b], Vb = bounds[b + 1] - v0;
            OPS->lce_fold(CTX, m, z, t, with_ent ? e : NULL, d_strip[b], d_t, Nb, Vb, v0, i == 0);
        }
    }
    CHECK_MSG(same_bytes(d_m, d_m2, (size_t)Nb * 4) && same_bytes(d_z, d_z2, (size_t)Nb * 4) &&
                  same_bytes(d_tg, d_tg2, (size_t)Nb * 4) && (!with_ent || same_bytes(d_e, d_e2, (size_t)Nb * 4)),
              "%s: fold: two runs differ", what);
    float *m = fnew(Nb), *z = fnew(Nb), *tgt = fnew(Nb), *ent = fnew(Nb);
    d2h(m, d_m, (size_t)Nb * 4);
    d2h(z, d_z, (size_t)Nb * 4);
    d2h(tgt, d_tg, (size_t)Nb * 4);
    d2h(ent, d_e, (size_t)Nb * 4);
    bool m_ok = true, t_ok = true;
    double *rz = dnew(Nb), *re = dnew(Nb);
    for (int64_t r = 0; r < Nb; r++) {
        m_ok &= (double)m[r] == rm[r];
        if (tg[r] == ignore) t_ok &= isnan(tgt[r]);
        else t_ok &= tgt[r] == S[r * V + tg[r]] || (r == nan_row && isnan(S[r * V + tg[r]]));
        /* z and ent relative to the op's m (fp32 logits, fp64 sums) */
        double s = 0, se = 0;
        for (int64_t i = 0; i < V; i++) {
            const double d = (double)S[r * V + i] - m[r];
            s += exp(d);
            se += exp(d) * d;
        }
        rz[r] = s;
        re[r] = se;
    }
    CHECK_MSG(m_ok, "%s: fold m differs from the row max", what);
    CHECK_MSG(t_ok, "%s: fold tgt differs from the target logit (NaN where never seen)", what);
    if (nan_row >= 0) {
        CHECK_MSG(isnan(z[nan_row]), "%s: a NaN logit did not reach z", what);
        z[nan_row] = 1.0f, rz[nan_row] = 1.0;
        ent[nan_row] = 0.0f, re[nan_row] = 0.0;
    }
    char w2[220];
    snprintf(w2, sizeof w2, "%s: fold z", what);
    CHECK_ERR(w2, gt_nerr(z, rz, Nb), 1e-5);
    if (with_ent) {
        snprintf(w2, sizeof w2, "%s: fold ent", what);
        CHECK_ERR(w2, nerr_floor(ent, re, Nb, 1e-3), 1e-5);
    }
    if (nan_row >= 0) { /* the rest of the test wants finite state: refold without the NaN */
        free(m), free(z), free(tgt), free(ent), free(rz), free(re);
        free(S), free(Sd), free(w), free(tg), free(rm), free(rlse), free(rent), free(rloss);
        for (int b = 0; b < nblk; b++) dfree(d_strip[b]);
        free(d_strip);
        dfree(d_t), dfree(d_w), dfree(d_m), dfree(d_z), dfree(d_tg), dfree(d_e), dfree(d_m2), dfree(d_z2),
            dfree(d_tg2), dfree(d_e2);
        return;
    }

    /* finalize, twice */
    float *loss = fnew(Nb), *lp = fnew(Nb), *entropy = fnew(Nb);
    void *d_loss = dalloc((size_t)Nb * 4), *d_lp = dalloc((size_t)Nb * 4), *d_ent = dalloc((size_t)Nb * 4),
         *d_loss2 = dalloc((size_t)Nb * 4);
    dpoison(d_loss, (size_t)Nb * 4), dpoison(d_lp, (size_t)Nb * 4), dpoison(d_ent, (size_t)Nb * 4);
    void *wts = with_weights ? d_w : NULL;
    double *d_sums = gt_dev_f64(&g_be, 4), sums[4]; /* zero-filled: the sums are ADDED */
    OPS->lce_finalize(CTX, d_loss, d_lp, with_ent ? d_ent : NULL, d_sums, d_m, d_z, d_tg, with_ent ? d_e : NULL, d_t,
                      wts, Nb, V, ignore);
    OPS->lce_finalize(CTX, d_loss2, NULL, NULL, d_sums + 2, d_m, d_z, d_tg, NULL, d_t, wts, Nb, V, ignore);
    gt_read_f64s(&g_be, sums, d_sums, 4);
    const double ce = sums[0], zsq = sums[1];
    CHECK_MSG(!memcmp(sums, sums + 2, 16) && same_bytes(d_loss, d_loss2, (size_t)Nb * 4),
              "%s: finalize: two calls differ", what);
    /* a second block's sums are added to the first's: here the same block again, so exactly 2x */
    OPS->lce_finalize(CTX, d_loss2, NULL, NULL, d_sums, d_m, d_z, d_tg, NULL, d_t, wts, Nb, V, ignore);
    gt_read_f64s(&g_be, sums, d_sums, 2);
    const double ce_x2 = ce + ce, zsq_x2 = zsq + zsq;
    CHECK_MSG(!memcmp(&sums[0], &ce_x2, 8) && !memcmp(&sums[1], &zsq_x2, 8),
              "%s: finalize: sums not added (%.17g, %.17g) vs 2x (%.17g, %.17g)", what, sums[0], sums[1], ce_x2,
              zsq_x2);
    dfree(d_sums);
    d2h(loss, d_loss, (size_t)Nb * 4);
    d2h(lp, d_lp, (size_t)Nb * 4);
    d2h(entropy, d_ent, (size_t)Nb * 4);
    double rce = 0, rzs = 0, *rlp = dnew(Nb);
    bool ign_ok = true;
    for (int64_t r = 0; r < Nb; r++) {
        rlp[r] = -rloss[r];
        if (tg[r] == ignore) {
            ign_ok &= loss[r] == 0.0f && lp[r] == 0.0f;
            continue;
        }
        const double wr = with_weights ? (double)w[r] : 1.0;
        rce += wr * rloss[r];
        rzs += wr * rlse[r] * rlse[r];
    }
    CHECK_MSG(ign_ok, "%s: finalize: ignored rows' loss/logprob not 0", what);
    snprintf(w2, sizeof w2, "%s: finalize loss", what);
    CHECK_ERR(w2, gt_nerr(loss, rloss, Nb), GT_TOL_F32);
    snprintf(w2, sizeof w2, "%s: finalize logprob", what);
    CHECK_ERR(w2, gt_nerr(lp, rlp, Nb), GT_TOL_F32);
    if (with_ent) {
        snprintf(w2, sizeof w2, "%s: finalize entropy", what);
        CHECK_ERR(w2, nerr_floor(entropy, rent, Nb, 1e-3), GT_TOL_F32);
    }
    CHECK_CLOSE(ce, rce, 1e-5);
    CHECK_CLOSE(zsq, rzs, 1e-5);

    /* strip_grad per block (separate buffer, then in place), against the fp64 gradient of
     * w_r (loss_r + zc lse_r^2) over the whole vocabulary, sliced per block */
    double *gfull = dnew(Nb * V), *wdd = fm_ref_widen(w, Nb);
    fm_ref_cross_entropy(NULL, gfull, Sd, tg, with_weights ? wdd : NULL, Nb, V, gs, zc, ignore);
    for (int b = 0; b < nblk; b++) {
        const int64_t v0 = bounds[b], Vb = bounds[b + 1] - v0;
        float *gg = fnew(Nb * Vb);
        double *gr = dnew(Nb * Vb);
        void *d_g = dalloc((size_t)(Nb * Vb) * 4), *d_g2 = dalloc((size_t)(Nb * Vb) * 4);
        dpoison(d_g, (size_t)(Nb * Vb) * 4);
        OPS->lce_strip_grad(CTX, d_g, d_strip[b], d_m, d_z, d_t, wts, Nb, Vb, v0, ignore, gs, zc);
        OPS->lce_strip_grad(CTX, d_g2, d_strip[b], d_m, d_z, d_t, wts, Nb, Vb, v0, ignore, gs, zc);
        CHECK_MSG(same_bytes(d_g, d_g2, (size_t)(Nb * Vb) * 4), "%s: strip_grad: two calls differ", what);
        d2h(gg, d_g, (size_t)(Nb * Vb) * 4);
        bool zero_ok = true;
        for (int64_t r = 0; r < Nb; r++) {
            if (tg[r] == ignore) {
                for (int64_t i = 0; i < Vb; i++) zero_ok &= gg[r * Vb + i] == 0.0f;
                continue;
            }
            for (int64_t i = 0; i < Vb; i++) gr[r * Vb + i] = gfull[r * V + v0 + i];
        }
        CHECK_MSG(zero_ok, "%s: strip_grad: ignored rows not zero", what);
        snprintf(w2, sizeof w2, "%s: strip_grad block %d", what, b);
        CHECK_ERR(w2, gt_nerr(gg, gr, Nb * Vb), GT_TOL_F32);
        /* in place: grad aliases strip */
        OPS->copy(CTX, d_g2, d_strip[b], (size_t)(Nb * Vb) * 4, FM_COPY_D2D);
        OPS->lce_strip_grad(CTX, d_g2, d_g2, d_m, d_z, d_t, wts, Nb, Vb, v0, ignore, gs, zc);
        CHECK_MSG(same_bytes(d_g, d_g2, (size_t)(Nb * Vb) * 4), "%s: strip_grad in place differs", what);
        free(gg), free(gr);
        dfree(d_g), dfree(d_g2);
    }

    free(m), free(z), free(tgt), free(ent), free(rz), free(re), free(loss), free(lp), free(entropy), free(rlp);
    free(gfull), free(wdd);
    free(S), free(Sd), free(w), free(tg), free(rm), free(rlse), free(rent), free(rloss);
    for (int b = 0; b < nblk; b++) dfree(d_strip[b]);
    free(d_strip);
    dfree(d_t), dfree(d_w), dfree(d_m), dfree(d_z), dfree(d_tg), dfree(d_e), dfree(d_m2), dfree(d_z2), dfree(d_tg2),
        dfree(d_e2), dfree(d_loss), dfree(d_lp), dfree(d_ent), dfree(d_loss2);
}

static void test_lce_all(void) {
    {
        const int64_t b[] = {0, 384, 767, 1000}; /* 384 (vec), 383 and 233 (scalar) columns */
        const int o[] = {1, 0, 2};
        test_lce("3 blocks, middle first", 37, 1000, b, o, 3, 2.0, true, true, -1);
        test_lce("3 blocks, no entropy, no weights", 37, 1000, b, o, 3, 2.0, false, false, -1);
        test_lce("logits ~1e4", 9, 1000, b, o, 3, 1e4, true, true, -1);
        test_lce("a NaN logit", 9, 1000, b, o, 3, 1.0, true, false, 3);
    }
    {
        const int64_t b[] = {0, 32768, 65536};
        const int o[] = {0, 1};
        test_lce("2 wide blocks", 20, 65536, b, o, 2, 3.0, true, true, -1);
    }
    {
        const int64_t b[] = {0, 50257};
        const int o[] = {0};
        test_lce("one block V=50257", 6, 50257, b, o, 1, 1.0, true, false, -1);
    }
}

/* ==== no host wait inside a step (DESIGN.md section 4) ========================================= */

/* A sequence of compute ops as a step issues them (router GEMM, router_fwd, router_stats,
 * router_loss_terms, router_aux_grad, moe_route_index, cross_entropy, lce_fold, lce_finalize,
 * sumsq) moves host_sync_count by nothing; one stream_sync moves it by exactly one, after which
 * every result the host reads (the pinned offsets, the device scalars) is right. Then the other
 * sync points count one each: event_sync (of an event just recorded, and of FM_EVENT_TOKENS,
 * recorded only at init), sync, a synchronous copy. */
static void test_host_syncs(void) {
    const int64_t N = 300, H = 64, E = 16, k = 2, V = 520;
    float *x = rounded_normal(N * H, 1.0), *W = rounded_normal(E * H, 0.3), *lg = rounded_normal(N * V, 1.0);
    int32_t *tgt = inew(N);
    for (int64_t n = 0; n < N; n++) tgt[n] = (int32_t)fm_rng_below(&g_rng, (uint64_t)V);
    tgt[7] = -100;
    void *d_x = gt_upload(&g_be, x, N * H, FM_DTYPE_BF16), *d_W = gt_upload(&g_be, W, E * H, FM_DTYPE_BF16),
         *d_lg = gt_upload(&g_be, lg, N * V, FM_DTYPE_BF16), *d_lgf = up_f32(lg, N * V), *d_t = up_i32(tgt, N);
    void *d_logits = dalloc((size_t)(N * E) * 4), *d_probs = dalloc((size_t)(N * E) * 4), *d_lse = dalloc((size_t)N * 4),
         *d_idx = dalloc((size_t)(N * k) * 4), *d_tw = dalloc((size_t)(N * k) * 4), *d_cnt = dalloc((size_t)E * 4),
         *d_ps = dalloc((size_t)E * 4), *d_gpe = dalloc((size_t)E * 4), *d_rr = dalloc((size_t)(N * k) * 4),
         *d_rw = dalloc((size_t)(N * k) * 4), *d_loss = dalloc((size_t)N * 4), *d_dl = dalloc((size_t)(N * V) * 2),
         *d_m = dalloc((size_t)N * 4), *d_z = dalloc((size_t)N * 4), *d_tg = dalloc((size_t)N * 4),
         *d_l2 = dalloc((size_t)N * 4);
    double *d_s = gt_dev_f64(&g_be, 8); /* lse_sq, terms[2], ce sum, lce sums[2], sumsq */
    int64_t *off = pinned_i64(E + 1, -5);
    OPS->sync(CTX);

    const uint64_t h0 = OPS->host_sync_count(CTX);
    OPS->gemm(CTX, false, true, N, E, H, 1.0f, d_x, H, d_W, H, 0.0f, d_logits, FM_DTYPE_F32, E);
    OPS->router_fwd(CTX, d_probs, d_lse, d_idx, d_tw, d_logits, N, E, k, true);
    OPS->router_stats(CTX, d_cnt, d_ps, d_s, d_probs, d_lse, d_idx, N, E, k);
    OPS->router_loss_terms(CTX, d_s + 1, d_cnt, d_ps, d_s, N, E);
    OPS->router_aux_grad(CTX, d_gpe, d_cnt, 0.01, N, E);
    OPS->moe_route_index(CTX, off, d_rr, d_rw, d_idx, N, E, k);
    OPS->cross_entropy(CTX, d_loss, d_dl, d_lg, d_t, N, V, 1.0f, -100, d_s + 3);
    OPS->lce_fold(CTX, d_m, d_z, d_tg, NULL, d_lgf, d_t, N, V, 0, true);
    OPS->lce_finalize(CTX, d_l2, NULL, NULL, d_s + 4, d_m, d_z, d_tg, NULL, d_t, NULL, N, V, -100);
    OPS->sumsq(CTX, d_s + 6, d_x, N * H, false);
    const uint64_t h1 = OPS->host_sync_count(CTX);
    CHECK_MSG(h1 == h0, "compute ops made the host wait %llu times", (unsigned long long)(h1 - h0));
    OPS->stream_sync(CTX, FM_STREAM_COMPUTE);
    CHECK_MSG(OPS->host_sync_count(CTX) == h0 + 1, "stream_sync counted %llu host syncs",
              (unsigned long long)(OPS->host_sync_count(CTX) - h0));
    /* the results, read right after the sync point */
    bool off_ok = off[0] == 0 && off[E] == N * k;
    for (int64_t e = 0; e < E; e++) off_ok &= off[e + 1] >= off[e];
    CHECK_MSG(off_ok, "pinned offsets after stream_sync: offsets[0] %lld, offsets[E] %lld (want %lld)",
              (long long)off[0], (long long)off[E], (long long)(N * k));
    const uint64_t h2 = OPS->host_sync_count(CTX);
    double sc[8];
    OPS->copy(CTX, sc, d_s, sizeof sc, FM_COPY_D2H); /* a synchronous copy: one host sync */
    CHECK(OPS->host_sync_count(CTX) == h2 + 1);
    bool fin = true;
    for (int i = 0; i < 7; i++) fin &= isfinite(sc[i]) && sc[i] > 0;
    CHECK_MSG(fin, "device scalars after the sync: lse_sq %g terms %g %g ce %g lce %g %g sumsq %g", sc[0], sc[1],
              sc[2], sc[3], sc[4], sc[5], sc[6]);
    CHECK_CLOSE(sc[3], sc[4], 1e-3); /* cross_entropy's sum and linear CE's over the same logits (bf16 vs fp32) */
    int64_t *roff = malloc((size_t)(E + 1) * sizeof(int64_t));
    int32_t *hidx = inew(N * k), *rrr = inew(N * k), *rrw = inew(N * k);
    d2h(hidx, d_idx, (size_t)(N * k) * 4);
    fm_ref_route_index(roff, rrr, rrw, hidx, N, E, k);
    CHECK_MSG(!memcmp(off, roff, (size_t)(E + 1) * 8), "pinned offsets after stream_sync differ from the counting sort");
    free(roff), free(hidx), free(rrr), free(rrw);

    const uint64_t h3 = OPS->host_sync_count(CTX);
    OPS->event_sync(CTX, FM_EVENT_TOKENS); /* recorded only at init: returns at once */
    OPS->event_record(CTX, FM_EVENT_FIRST_FREE, FM_STREAM_COMPUTE);
    CHECK(OPS->host_sync_count(CTX) == h3 + 1);
    OPS->event_sync(CTX, FM_EVENT_FIRST_FREE);
    CHECK(OPS->host_sync_count(CTX) == h3 + 2);
    OPS->sync(CTX);
    CHECK_MSG(OPS->host_sync_count(CTX) == h3 + 3, "sync (three streams) must count as one host sync");
    CHECK_MSG(OPS->status(CTX) == FM_OK, "status after the sequence: %s", fm_errmsg());

    pinned_free(off);
    free(x), free(W), free(lg), free(tgt);
    void *dev[] = {d_x,   d_W,  d_lg,  d_lgf, d_t,  d_logits, d_probs, d_lse, d_idx, d_tw, d_cnt, d_ps,
                   d_gpe, d_rr, d_rw,  d_loss, d_dl, d_m,     d_z,     d_tg,  d_l2,  d_s};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) dfree(dev[i]);
}

/* Device-found argument errors are sticky and reported by status after a sync point, without
 * aborting (on a backend of its own: the error stays): a top-k id outside [0,E) given to
 * moe_route_index makes status FM_ERR_ARG naming the op, and later calls keep returning it. */
static void test_device_error_status(void) {
    fm_backend b;
    if (gt_cuda_init(&b, 0, 64, (size_t)1 << 20) != FM_OK) {
        CHECK_MSG(false, "second backend: %s", fm_errmsg());
        return;
    }
    const fm_ops *o = b.ops;
    CHECK(o->status(b.ctx) == FM_OK);
    const int64_t N = 40, E = 4, k = 2;
    int32_t idx[80];
    for (int i = 0; i < 80; i++) idx[i] = i % 4;
    idx[33] = 9; /* outside [0,E) */
    void *d_idx = o->mem_alloc(b.ctx, sizeof idx), *d_rr = o->mem_alloc(b.ctx, sizeof idx),
         *d_rw = o->mem_alloc(b.ctx, sizeof idx);
    int64_t *off = o->buffer_alloc(b.ctx, FM_BUFFER_PINNED, (size_t)(E + 1) * sizeof(int64_t));
    CHECK(d_idx && d_rr && d_rw && off);
    o->copy(b.ctx, d_idx, idx, sizeof idx, FM_COPY_H2D);
    o->moe_route_index(b.ctx, off, d_rr, d_rw, d_idx, N, E, k);
    o->stream_sync(b.ctx, FM_STREAM_COMPUTE);
    const fm_status s1 = o->status(b.ctx);
    CHECK_MSG(s1 == FM_ERR_ARG && strstr(fm_errmsg(), "moe_route_index") != NULL,
              "a bad top-k id: status %s, message \"%s\"", fm_status_name(s1), fm_errmsg());
    o->sync(b.ctx);
    CHECK_MSG(o->status(b.ctx) == FM_ERR_ARG, "the error is not sticky");
    o->buffer_free(b.ctx, FM_BUFFER_PINNED, off);
    o->mem_free(b.ctx, d_idx), o->mem_free(b.ctx, d_rr), o->mem_free(b.ctx, d_rw);
    fm_cuda_backend_free(&b);
}

/* ==== timings at training sizes (printed, not checked) ========================================
 * Inputs are the zero-filled buffers of mem_alloc (the values do not change the work), except
 * the top-k ids of the permutation, which are random. */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define BENCH(label, bytes, call)                                                                  \
    do {                                                                                           \
        call;                                                                                      \
        OPS->sync(CTX);                                                                            \
        const double t0_ = now_s();                                                                \
        for (int rep_ = 0; rep_ < 5; rep_++) call;                                                 \
        OPS->sync(CTX);                                                                            \
        const double dt_ = (now_s() - t0_) / 5;                                                    \
        printf("  %-52s %9.3f ms  %7.0f GB/s\n", label, dt_ * 1e3, (double)(bytes) / dt_ * 1e-9); \
    } while (0)

static void bench_all(void) {
    printf("timings (mean of 5 after a warm-up call):\n");
    {
        const int64_t N = 1 << 20, E = 64, k = 8;
        void *lg = dalloc((size_t)(N * E) * 4), *pr = dalloc((size_t)(N * E) * 4), *lse = dalloc((size_t)N * 4),
             *ix = dalloc((size_t)(N * k) * 4), *tw = dalloc((size_t)(N * k) * 4), *dw = dalloc((size_t)(N * k) * 4),
             *dl = dalloc((size_t)(N * E) * 4), *gpe = dalloc((size_t)E * 4), *cnt = dalloc((size_t)E * 4),
             *ps = dalloc((size_t)E * 4), *rr = dalloc((size_t)(N * k) * 4), *rw = dalloc((size_t)(N * k) * 4);
        int64_t *off = pinned_i64(E + 1, 0);
        double *dz = gt_dev_f64(&g_be, 1);
        BENCH("router_fwd N=1M E=64 k=8", N * E * 8, OPS->router_fwd(CTX, pr, lse, ix, tw, lg, N, E, k, true));
        BENCH("router_bwd N=1M E=64 k=8", N * E * 8,
              OPS->router_bwd(CTX, dl, dw, gpe, 1e-3f, pr, lse, ix, tw, N, E, k, true));
        BENCH("router_fwd N=16K E=64 k=8", 16384 * E * 8,
              OPS->router_fwd(CTX, pr, lse, ix, tw, lg, 16384, E, k, true));
        BENCH("router_bwd N=16K E=64 k=8", 16384 * E * 8,
              OPS->router_bwd(CTX, dl, dw, gpe, 1e-3f, pr, lse, ix, tw, 16384, E, k, true));
        BENCH("router_stats N=1M E=64 k=8", N * E * 4,
              OPS->router_stats(CTX, cnt, ps, dz, pr, lse, ix, N, E, k));
        int32_t *hidx = inew(N * k);
        random_topk(hidx, N, E, k, -1);
        h2d(ix, hidx, (size_t)(N * k) * 4);
        free(hidx);
        BENCH("moe_route_index N=1M E=64 k=8 (random ids)", N * k * 12,
              OPS->moe_route_index(CTX, off, rr, rw, ix, N, E, k));
        pinned_free(off);
        dfree(dz);
        void *d[] = {lg, pr, lse, ix, tw, dw, dl, gpe, cnt, ps, rr, rw};
        for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) dfree(d[i]);
    }
    {
        const int64_t N = 16384, E = 64, k = 8, H = 2048, R = N * k;
        int32_t *hidx = inew(R);
        random_topk(hidx, N, E, k, -1);
        void *ix = up_i32(hidx, R), *rr = dalloc((size_t)R * 4), *rw = dalloc((size_t)R * 4),
             *x = dalloc((size_t)(N * H) * 2), *xe = dalloc((size_t)(R * H) * 2), *w = dalloc((size_t)R * 4),
             *out = dalloc((size_t)(N * H) * 2), *dw = dalloc((size_t)R * 4), *dye = dalloc((size_t)(R * H) * 2);
        free(hidx);
        int64_t *off = pinned_i64(E + 1, 0);
        OPS->moe_route_index(CTX, off, rr, rw, ix, N, E, k);
        OPS->stream_sync(CTX, FM_STREAM_COMPUTE);
        pinned_free(off);
        BENCH("moe_gather R=128K H=2048", R * H * 4, OPS->moe_gather(CTX, xe, x, rr, R, k, H));
        BENCH("moe_gather_bwd N=16K k=8 H=2048", (R + N) * H * 2, OPS->moe_gather_bwd(CTX, x, xe, rw, N, k, H));
        BENCH("moe_combine_fwd N=16K k=8 H=2048", (R + N) * H * 2,
              OPS->moe_combine_fwd(CTX, out, xe, w, rw, N, k, H));
        BENCH("moe_combine_bwd N=16K k=8 H=2048", (2 * R + N) * H * 2,
              OPS->moe_combine_bwd(CTX, dye, dw, out, xe, w, rw, N, k, H));
        BENCH("gather_rows n=16K rows of 4 KiB", N * H * 4, OPS->gather_rows(CTX, out, xe, rr, N, H * 2));
        void *d[] = {ix, rr, rw, x, xe, w, out, dw, dye};
        for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) dfree(d[i]);
    }
    {
        const int64_t N = 4096, V = 131072;
        void *lg = dalloc((size_t)(N * V) * 2), *t = dalloc((size_t)N * 4), *loss = dalloc((size_t)N * 4);
        double *sum = gt_dev_f64(&g_be, 1);
        BENCH("cross_entropy N=4096 V=128K, in place", N * V * 6,
              OPS->cross_entropy(CTX, loss, lg, lg, t, N, V, 1.0f, -100, sum));
        dfree(lg), dfree(t), dfree(loss), dfree(sum);
    }
    {
        const int64_t Nb = 4096, Vb = 32768;
        void *s = dalloc((size_t)(Nb * Vb) * 4), *t = dalloc((size_t)Nb * 4), *m = dalloc((size_t)Nb * 4),
             *z = dalloc((size_t)Nb * 4), *tg = dalloc((size_t)Nb * 4), *e = dalloc((size_t)Nb * 4),
             *l = dalloc((size_t)Nb * 4);
        double *sums = gt_dev_f64(&g_be, 2);
        BENCH("lce_fold Nb=4096 Vb=32K (first)", Nb * Vb * 8, OPS->lce_fold(CTX, m, z, tg, e, s, t, Nb, Vb, 0, true));
        BENCH("lce_strip_grad Nb=4096 Vb=32K, in place", Nb * Vb * 8,
              OPS->lce_strip_grad(CTX, s, s, m, z, t, NULL, Nb, Vb, 0, -100, 1.0f, 1e-4f));
        BENCH("lce_finalize Nb=4096", Nb * 28,
              OPS->lce_finalize(CTX, l, NULL, e, sums, m, z, tg, e, t, NULL, Nb, Vb, -100));
        dfree(sums);
        void *d[] = {s, t, m, z, tg, e, l};
        for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) dfree(d[i]);
    }
}

/* ==== main ===================================================================================== */

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20240611));
    const fm_status st = gt_cuda_init(&g_be, 0, 128, 0);
    CHECK_MSG(st == FM_OK, "fm_cuda_backend_init: %s", fm_errmsg());
    if (st != FM_OK) return fm_test_finish();
    OPS = g_be.ops;
    CTX = g_be.ctx;

    /* FLATMOE_TEST_ONLY=text runs only the sections whose name holds it (e.g. under a sanitizer). */
    const char *only = getenv("FLATMOE_TEST_ONLY");
#define SECTION(name, call)                                                                        \
    do {                                                                                           \
        if (only && !strstr(name, only)) break;                                                    \
        printf("%s\n", name);                                                                      \
        fflush(stdout);                                                                            \
        call;                                                                                      \
    } while (0)
    SECTION("router", test_router());
    SECTION("moe_route_index", test_route_index());
    SECTION("moe_gather / combine", {
        test_gather_combine(37, 6, 2, 64);
        test_gather_combine(100, 8, 1, 70); /* H % 8 != 0: the scalar path */
        test_gather_combine(513, 128, 8, 2048);
        test_gather_combine(64, 16, 8, 4096);
        test_gather_combine(1000, 64, 8, 24);
        test_gather_combine(23, 5, 3, 37);
    });
    SECTION("gather_rows / scatter_rows", test_rows_all());
    SECTION("cross_entropy", {
        test_cross_entropy(1.0, 37, 1000, -1);
        test_cross_entropy(1.0, 37, 1001, -1); /* V % 8 != 0: the scalar path */
        test_cross_entropy(1e4, 37, 1000, -1);
        test_cross_entropy(1.0, 16, 50257, -1);
        test_cross_entropy(3.0, 8, 131072, -1);
        test_cross_entropy(1.0, 13, 1000, 7);
    });
    SECTION("lce_fold / lce_finalize / lce_strip_grad", test_lce_all());
    SECTION("host syncs: none inside the compute ops", test_host_syncs());
    SECTION("device errors: sticky status", test_device_error_status());
    if (!only) CHECK_BACKEND_OK(&g_be); /* no op above recorded an error */
    /* FLATMOE_TEST_NO_BENCH=1 skips the timings (e.g. under compute-sanitizer). */
    if (!getenv("FLATMOE_TEST_NO_BENCH") && !only) bench_all();

    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
