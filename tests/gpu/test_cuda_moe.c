/* CUDA backend (cuda_router/permute.cu) router, MoE permutation and row movement ops against the
 * fp64 host references of tests/fm_ref_ops.c (shared with the CPU tests); cross-entropy, the
 * linear-CE strips and the no-host-wait sequence are test_cuda_loss.c's. Method (poisoned
 * outputs, tolerances, ulps, determinism) and helpers: gpu_moe_test.h. router_bwd is also checked
 * against central finite differences of the fp64 reference objective (each loss term alone, then
 * together); router_loss_terms and router_aux_grad also match the CPU backend's arithmetic bit for
 * bit; moe_route_index's offsets land in pinned memory read after one stream_sync; a
 * device-found index error is a sticky FM_ERR_ARG from status.
 */
#include "gpu_moe_test.h"

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

/* ==== device errors ========================================================================== */

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
}

/* ==== main ===================================================================================== */

int main(void) {
    if (!moe_test_begin(20240611)) return fm_test_finish();
    const char *only = test_only(); /* FLATMOE_TEST_ONLY: the sections to run (gpu_moe_test.h) */
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
    SECTION("device errors: sticky status", test_device_error_status());
    if (!only) CHECK_BACKEND_OK(&g_be); /* no op above recorded an error */
    /* FLATMOE_TEST_NO_BENCH=1 skips the timings (e.g. under compute-sanitizer). */
    if (!getenv("FLATMOE_TEST_NO_BENCH") && !only) bench_all();

    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
