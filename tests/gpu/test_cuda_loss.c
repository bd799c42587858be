/* CUDA backend (cuda_loss.cu, cuda_lce_ent.cu) cross-entropy and linear-CE strip ops (lce_fold,
 * lce_finalize, lce_strip_grad; lce_strip_grad_ent in the cases with the entropy) against the fp64
 * host references of tests/fm_ref_ops.c (shared with the CPU tests), and a step's sequence of
 * compute ops (router, permutation, loss) making no host wait (host_sync_count); the router and
 * permutation ops themselves are test_cuda_moe.c's. Method (poisoned outputs, tolerances, ulps,
 * determinism) and helpers: gpu_moe_test.h.
 */
#include "gpu_moe_test.h"

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
    float *ew = fnew(Nb); /* the entropy bonus's per-row weights (lce_strip_grad_ent), both signs */
    fill_uniform(ew, Nb, -1.0, 1.0);
    void *d_ew = up_f32(ew, Nb);
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
        if (with_ent) { /* lce_strip_grad_ent: + gs ew_r dH_r/dS = -gs ew_r p (log p + H_r), H_r lce_finalize's */
            dpoison(d_g, (size_t)(Nb * Vb) * 4);
            OPS->lce_strip_grad_ent(CTX, d_g, d_strip[b], d_m, d_z, d_t, wts, d_ew, d_ent, Nb, Vb, v0, ignore, gs, zc);
            d2h(gg, d_g, (size_t)(Nb * Vb) * 4);
            zero_ok = true;
            for (int64_t r = 0; r < Nb; r++)
                for (int64_t i = 0; i < Vb; i++) {
                    if (tg[r] == ignore) { zero_ok &= gg[r * Vb + i] == 0.0f; continue; }
                    const double lp = Sd[r * V + v0 + i] - rlse[r];
                    gr[r * Vb + i] = gfull[r * V + v0 + i] - (double)gs * ew[r] * exp(lp) * (lp + rent[r]);
                }
            CHECK_MSG(zero_ok, "%s: strip_grad_ent: ignored rows not zero", what);
            snprintf(w2, sizeof w2, "%s: strip_grad_ent block %d", what, b);
            CHECK_ERR(w2, gt_nerr(gg, gr, Nb * Vb), GT_TOL_F32);
            OPS->copy(CTX, d_g2, d_strip[b], (size_t)(Nb * Vb) * 4, FM_COPY_D2D); /* in place */
            OPS->lce_strip_grad_ent(CTX, d_g2, d_g2, d_m, d_z, d_t, wts, d_ew, d_ent, Nb, Vb, v0, ignore, gs, zc);
            CHECK_MSG(same_bytes(d_g, d_g2, (size_t)(Nb * Vb) * 4), "%s: strip_grad_ent in place differs", what);
        }
        free(gg), free(gr);
        dfree(d_g), dfree(d_g2);
    }

    free(m), free(z), free(tgt), free(ent), free(rz), free(re), free(loss), free(lp), free(entropy), free(rlp);
    free(gfull), free(wdd), free(ew);
    dfree(d_ew);
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
/* ==== timings at training sizes (printed, not checked) ========================================
 * Inputs are the zero-filled buffers of mem_alloc (the values do not change the work). */

static void bench_loss(void) {
    printf("timings (mean of 5 after a warm-up call):\n");
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
    if (!moe_test_begin(20240611)) return fm_test_finish();
    const char *only = test_only(); /* FLATMOE_TEST_ONLY: the sections to run (gpu_moe_test.h) */
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
    if (!only) CHECK_BACKEND_OK(&g_be); /* no op above recorded an error */
    /* FLATMOE_TEST_NO_BENCH=1 skips the timings (e.g. under compute-sanitizer). */
    if (!getenv("FLATMOE_TEST_NO_BENCH") && !only) bench_loss();

    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
