/* CUDA backend layer ops (src/backend/cuda/cuda_*.cu) against the plain fp64 host references of
 * tests/fm_ref_ops.c (shared with the CPU tests): embedding, RMSNorm, RoPE, SwiGLU (forward and
 * backward, the backward also against finite differences) and AdamW (with and without an fp32
 * master, bf16 moments; on bf16 weights with Kahan or stochastic rounding, --master-weights); determinism (two calls, the same bits) of embedding_bwd and rmsnorm_bwd.
 * The GEMMs, add, sumsq, convert and the memory ops are test_cuda_dense.c's; inputs, tolerances
 * and helpers: gpu_dense_test.h; the cases and FD objectives every backend runs: fm_op_cases.h.
 */
#include "fm_op_cases.h"
#include "gpu_dense_test.h"

/* ---- embedding ------------------------------------------------------------------------------- */

/* fwd bit-exact (a copy); bwd accumulates onto a random pre-fill with repeated tokens (one
 * token takes a third of them), an unused row untouched bit for bit, the same bits on a second
 * call from the same pre-fill; FD check of dwte when fd. */
static void test_embedding(int64_t N, int64_t V, int64_t H, bool fd) {
    int32_t *tok = inew(N);
    for (int64_t n = 0; n < N; n++) tok[n] = (int32_t)fm_rng_below(&g_rng, (uint64_t)(V - 1)); /* V-1 unused */
    for (int64_t n = 0; n < N; n += 3) tok[n] = 4 % (int32_t)(V - 1);
    if (N > 30) tok[3] = tok[7] = tok[30] = 1;
    float *wte = fnew(V * H), *out = fnew(N * H), *dout = fnew(N * H), *pre = fnew(V * H), *dw = fnew(V * H),
          *dw2 = fnew(V * H);
    fill_normal_bf(wte, V * H, 1.0);
    fill_normal_bf(dout, N * H, 1.0);
    fill_normal_bf(pre, V * H, 0.1);
    void *dtok = up_i32(tok, N), *dwte = up_act(wte, V * H), *dout_d = up_act(dout, N * H);
    void *dout_fwd = up_nan(N * H, FM_DTYPE_BF16);
    OPS->embedding_fwd(CTX, dout_fwd, dtok, dwte, N, H);
    down_act(out, dout_fwd, N * H);
    bool ok = true;
    for (int64_t n = 0; n < N && ok; n++)
        if (memcmp(out + n * H, wte + (int64_t)tok[n] * H, (size_t)H * sizeof(float))) ok = false;
    CHECK_MSG(ok, "embedding_fwd N=%lld H=%lld: rows differ from wte[tokens]", (long long)N, (long long)H);

    void *ddw = up_act(pre, V * H);
    OPS->embedding_bwd(CTX, ddw, dout_d, dtok, N, H);
    down_act(dw, ddw, V * H);
    dfree(ddw);
    ddw = up_act(pre, V * H);
    OPS->embedding_bwd(CTX, ddw, dout_d, dtok, N, H);
    down_act(dw2, ddw, V * H);
    CHECK_MSG(same_bits(dw, dw2, (size_t)(V * H) * sizeof(float)), "embedding_bwd N=%lld: two calls differ",
              (long long)N);
    CHECK_MSG(same_bits(dw + (V - 1) * H, pre + (V - 1) * H, (size_t)H * sizeof(float)),
              "embedding_bwd: a row no token uses changed");
    double *ref = fm_ref_widen(pre, V * H), *doutd = fm_ref_widen(dout, N * H);
    fm_ref_embedding_bwd(ref, doutd, tok, N, H); /* accumulated onto the pre-fill */
    free(doutd);
    char what[96];
    snprintf(what, sizeof what, "embedding_bwd N=%lld V=%lld H=%lld", (long long)N, (long long)V, (long long)H);
    CHECK_ERR(what, gt_nerr(dw, ref, V * H), GT_TOL_BF16);
    if (N <= ((int64_t)1 << 18)) {
        CHECK_ULPS(what, dw, ref, V * H, gt_rms(ref, V * H) / 64, ULPS_REDUCTION);
    } else {
        /* More tokens than one sort chunk (2^18): each chunk's sums are rounded into dwte, so the
         * first rounding is at a partial sum's magnitude, which can exceed the final value's (a later
         * chunk cancels it) but not twice the largest final value: measured in ulps of max|ref|,
         * two roundings of at most one such ulp each, plus the neighbour at a boundary: 3. */
        double mx = 0;
        for (int64_t i = 0; i < V * H; i++) mx = fmax(mx, fabs(ref[i]));
        CHECK_ULPS(what, dw, ref, V * H, mx, 3);
    }
    if (fd) {
        emb_st s = {dnew(V * H), dnew(N * H), tok, N, H};
        to_d(s.wte, wte, V * H);
        to_d(s.dout, dout, N * H);
        double *g = dnew(V * H);
        for (int64_t i = 0; i < V * H; i++) g[i] = (double)dw[i] - (double)pre[i];
        fd_check("embedding_bwd dwte (accumulated)", emb_obj, &s, s.wte, V * H, g, GT_TOL_BF16);
        free(s.wte), free(s.dout), free(g);
    }
    dfree(dtok), dfree(dwte), dfree(dout_d), dfree(dout_fwd), dfree(ddw);
    free(tok), free(wte), free(out), free(dout), free(pre), free(dw), free(dw2), free(ref);
}

/* ---- RMSNorm --------------------------------------------------------------------------------- */

/* x ~ N(0, x_scale^2). fwd out (bf16) and rstd (fp32, tol 1e-5) against fp64; bwd dx (assigned,
 * poisoned) and dw (accumulated onto 0.5) against the analytic fp64 gradient and, when fd, finite
 * differences; a second bwd call gives the same bits. */
static void test_rmsnorm(int64_t N, int64_t D, double x_scale, bool fd) {
    const float eps = 1e-5f;
    const int64_t nd = N * D;
    float *x = fnew(nd), *w = fnew(D), *dout = fnew(nd), *out = fnew(nd), *rstd = fnew(N), *dx = fnew(nd),
          *dw = fnew(D), *dx2 = fnew(nd), *dw2 = fnew(D), *half = fnew(D);
    fill_normal_bf(x, nd, x_scale);
    fill_uniform(w, D, 0.5, 1.5);
    gt_round_bf16(w, D);
    fill_normal_bf(dout, nd, 1.0);
    fill_const(half, D, 0.5f);
    void *dX = up_act(x, nd), *dW = up_act(w, D), *dG = up_act(dout, nd), *dO = up_nan(nd, FM_DTYPE_BF16),
         *dR = up_nan(N, FM_DTYPE_F32);
    OPS->rmsnorm_fwd(CTX, dO, dR, dX, dW, N, D, eps);
    down_act(out, dO, nd);
    down_f32(rstd, dR, N);
    double *rout = dnew(nd), *rr = dnew(N), *rdx = dnew(nd), *rdw = dnew(D);
    {
        double *xd = fm_ref_widen(x, nd), *wd = fm_ref_widen(w, D), *gd = fm_ref_widen(dout, nd);
        fm_ref_rmsnorm_fwd(rout, rr, xd, wd, N, D, eps);
        fm_ref_rmsnorm_bwd(rdx, rdw, gd, xd, wd, N, D, eps);
        free(xd), free(wd), free(gd);
    }
    char what[128];
    snprintf(what, sizeof what, "rmsnorm_fwd N=%lld D=%lld out", (long long)N, (long long)D);
    CHECK_ERR(what, gt_nerr(out, rout, nd), GT_TOL_BF16);
    CHECK_ULPS(what, out, rout, nd, 0.0, ULPS_ELEMENTWISE);
    snprintf(what, sizeof what, "rmsnorm_fwd N=%lld D=%lld rstd", (long long)N, (long long)D);
    CHECK_ERR(what, gt_nerr(rstd, rr, N), 1e-5);

    void *dDX = up_nan(nd, FM_DTYPE_BF16), *dDW = up_act(half, D);
    OPS->rmsnorm_bwd(CTX, dDX, dDW, dG, dX, dW, dR, N, D);
    down_act(dx, dDX, nd);
    down_act(dw, dDW, D);
    dfree(dDX), dfree(dDW);
    dDX = up_nan(nd, FM_DTYPE_BF16), dDW = up_act(half, D);
    OPS->rmsnorm_bwd(CTX, dDX, dDW, dG, dX, dW, dR, N, D);
    down_act(dx2, dDX, nd);
    down_act(dw2, dDW, D);
    CHECK_MSG(same_bits(dx, dx2, (size_t)nd * 4) && same_bits(dw, dw2, (size_t)D * 4),
              "rmsnorm_bwd N=%lld D=%lld: two calls differ", (long long)N, (long long)D);
    snprintf(what, sizeof what, "rmsnorm_bwd N=%lld D=%lld dx", (long long)N, (long long)D);
    CHECK_ERR(what, gt_nerr(dx, rdx, nd), GT_TOL_BF16);
    CHECK_ULPS(what, dx, rdx, nd, gt_rms(rdx, nd) / 64, ULPS_REDUCTION);
    double *g = dnew(nd > D ? nd : D);
    float *dwd = fnew(D);
    for (int64_t j = 0; j < D; j++) dwd[j] = dw[j] - 0.5f;
    snprintf(what, sizeof what, "rmsnorm_bwd N=%lld D=%lld dw (accumulated)", (long long)N, (long long)D);
    /* dw holds bf16(0.5 + sum): its rounding is relative to |0.5 + sum|, at most ~|sum| + 0.5 */
    CHECK_ERR(what, gt_nerr(dwd, rdw, D), GT_TOL_BF16);
    { /* the stored bf16 dw against 0.5 + the fp64 sum */
        double *rdw_acc = dnew(D);
        for (int64_t j = 0; j < D; j++) rdw_acc[j] = 0.5 + rdw[j];
        CHECK_ULPS(what, dw, rdw_acc, D, gt_rms(rdw_acc, D) / 64, ULPS_REDUCTION);
        free(rdw_acc);
    }
    if (fd) {
        rms_st s = {dnew(nd), dnew(D), dnew(nd), N, D, eps};
        to_d(s.x, x, nd);
        to_d(s.w, w, D);
        to_d(s.dout, dout, nd);
        to_d(g, dx, nd);
        fd_check("rmsnorm_bwd dx", rms_obj, &s, s.x, nd, g, GT_TOL_BF16);
        to_d(g, dwd, D);
        fd_check("rmsnorm_bwd dw (accumulated)", rms_obj, &s, s.w, D, g, GT_TOL_BF16);
        free(s.x), free(s.w), free(s.dout);
    }
    dfree(dX), dfree(dW), dfree(dG), dfree(dO), dfree(dR), dfree(dDX), dfree(dDW);
    free(x), free(w), free(dout), free(out), free(rstd), free(dx), free(dw), free(dx2), free(dw2), free(half);
    free(rout), free(rr), free(rdx), free(rdw), free(g), free(dwd);
}

/* ---- RoPE ------------------------------------------------------------------------------------ */

/* Tables with c^2 + s^2 != 1 (so the backward must be the transpose, not the inverse angle). */
static void test_rope(int64_t B, int64_t T, int64_t Tmax, int64_t nh, int64_t hd, int64_t rd) {
    const int64_t n = B * T * nh * hd;
    float *cs = fnew(Tmax * rd / 2), *sn = fnew(Tmax * rd / 2), *x = fnew(n), *dout = fnew(n), *buf = fnew(n);
    fill_uniform(cs, Tmax * rd / 2, -1.2, 1.2);
    fill_uniform(sn, Tmax * rd / 2, -1.2, 1.2);
    fill_normal_bf(x, n, 1.0);
    fill_normal_bf(dout, n, 1.0);
    void *dcs = up_f32(cs, Tmax * rd / 2), *dsn = up_f32(sn, Tmax * rd / 2), *dx = up_act(x, n),
         *dg = up_act(dout, n);
    rope_st s = {dnew(n), dnew(n), cs, sn, B, T, nh, hd, rd};
    to_d(s.x, x, n);
    to_d(s.dout, dout, n);
    double *ref = dnew(n);
    fm_ref_rope(ref, s.x, cs, sn, B, T, nh, hd, rd, 1.0);
    OPS->rope_fwd(CTX, dx, dcs, dsn, B, T, nh, hd, rd, NULL);
    down_act(buf, dx, n);
    char what[112];
    snprintf(what, sizeof what, "rope_fwd B=%lld T=%lld nh=%lld hd=%lld rd=%lld", (long long)B, (long long)T,
             (long long)nh, (long long)hd, (long long)rd);
    CHECK_ERR(what, gt_nerr(buf, ref, n), GT_TOL_BF16);
    CHECK_ULPS(what, buf, ref, n, gt_rms(ref, n) / 64, ULPS_ELEMENTWISE);
    OPS->rope_bwd(CTX, dg, dcs, dsn, B, T, nh, hd, rd, NULL);
    down_act(buf, dg, n);
    fm_ref_rope(ref, s.dout, cs, sn, B, T, nh, hd, rd, -1.0);
    snprintf(what, sizeof what, "rope_bwd B=%lld T=%lld nh=%lld hd=%lld rd=%lld", (long long)B, (long long)T,
             (long long)nh, (long long)hd, (long long)rd);
    CHECK_ERR(what, gt_nerr(buf, ref, n), GT_TOL_BF16);
    CHECK_ULPS(what, buf, ref, n, gt_rms(ref, n) / 64, ULPS_ELEMENTWISE);
    double *g = dnew(n);
    to_d(g, buf, n);
    fd_check("rope_bwd dx", rope_obj, &s, s.x, n, g, GT_TOL_BF16);
    dfree(dcs), dfree(dsn), dfree(dx), dfree(dg);
    free(cs), free(sn), free(x), free(dout), free(buf), free(s.x), free(s.dout), free(ref), free(g);
}

/* ---- linear-layer biases --------------------------------------------------------------------- */

/* bias_add and bias_grad (fm_backend.h) on bf16 against fp64: the output rounded to bf16 once
 * (GT_TOL_BF16 and ULPS_ELEMENTWISE), the column sums accumulated in fp32 then rounded once. */
static void test_bias(int64_t N, int64_t D) {
    float *y = fnew(N * D), *b = fnew(D), *dy = fnew(N * D), *db = fnew(D), *buf = fnew(N * D);
    fill_normal_bf(y, N * D, 1.0);
    fill_normal_bf(b, D, 1.0);
    fill_normal_bf(dy, N * D, 1.0);
    fill_normal_bf(db, D, 1.0);
    double *ry = dnew(N * D), *rdb = dnew(D);
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < D; j++) ry[n * D + j] = (double)y[n * D + j] + b[j];
    for (int64_t j = 0; j < D; j++) {
        rdb[j] = db[j];
        for (int64_t n = 0; n < N; n++) rdb[j] += dy[n * D + j];
    }
    void *d_y = up_act(y, N * D), *d_b = up_act(b, D), *d_dy = up_act(dy, N * D), *d_db = up_act(db, D);
    OPS->bias_add(CTX, d_y, d_b, N, D);
    down_act(buf, d_y, N * D);
    char what[96];
    snprintf(what, sizeof what, "bias_add N=%lld D=%lld", (long long)N, (long long)D);
    CHECK_ERR(what, gt_nerr(buf, ry, N * D), GT_TOL_BF16);
    CHECK_ULPS(what, buf, ry, N * D, gt_rms(ry, N * D) / 64, ULPS_ELEMENTWISE);
    OPS->bias_grad(CTX, d_db, d_dy, N, D);
    down_act(buf, d_db, D);
    snprintf(what, sizeof what, "bias_grad N=%lld D=%lld", (long long)N, (long long)D);
    CHECK_ERR(what, gt_nerr(buf, rdb, D), GT_TOL_BF16);
    dfree(d_y), dfree(d_b), dfree(d_dy), dfree(d_db);
    free(y), free(b), free(dy), free(db), free(buf), free(ry), free(rdb);
}

/* ---- head slices (multi-head latent attention's assembly) ---------------------------------- */

/* head_slice against the fp64 reference on bf16-representable inputs: a plain copy exact, a scaled
 * or summed one within bf16's rounding of the fp32 result. */
static void test_head_slice(const fm_case_slice *c) {
    const int64_t ns = c->N * fm_case_slice_src_heads(c) * c->sw, nd = c->N * fm_case_slice_dst_heads(c) * c->dw;
    const int64_t nsa = ns > 0 ? ns : 1;
    float *src = fnew(nsa), *dst = fnew(nd), *buf = fnew(nd);
    fill_normal_bf(src, nsa, 1.0);
    fill_normal_bf(dst, nd, 1.0);
    double *ref = dnew(nd);
    for (int64_t i = 0; i < nd; i++) ref[i] = dst[i];
    fm_case_slice_ref(ref, src, c);
    void *d_src = up_act(src, nsa), *d_dst = up_act(dst, nd);
    const fm_slice sa = {fm_case_slice_src_heads(c) * c->sw, c->bcast ? 0 : c->sw, c->soff};
    const fm_slice da = {fm_case_slice_dst_heads(c) * c->dw, c->sum ? 0 : c->dw, c->doff};
    OPS->head_slice(CTX, d_dst, da, c->zeros ? NULL : d_src, sa, c->N, c->nh, c->d, c->perm, c->alpha, c->acc);
    down_act(buf, d_dst, nd);
    char what[96];
    snprintf(what, sizeof what, "head_slice N=%lld nh=%lld d=%lld perm %d", (long long)c->N, (long long)c->nh,
             (long long)c->d, c->perm);
    if (c->alpha == 1.0f && !c->sum && !c->acc) {
        double worst = 0;
        for (int64_t i = 0; i < nd; i++) worst = fmax(worst, fabs(buf[i] - ref[i]));
        CHECK_MSG(worst == 0, "%s: a copy differs by %g", what, worst);
    } else {
        CHECK_ERR(what, gt_nerr(buf, ref, nd), GT_TOL_BF16);
    }
    dfree(d_src), dfree(d_dst);
    free(src), free(dst), free(buf), free(ref);
}

/* ---- SwiGLU ---------------------------------------------------------------------------------- */

/* Gates up to |g| ~ 30 and one at -100 (exp overflows: sigmoid exactly 0); aligned (vector path)
 * and one element off (scalar path). fwd and bwd against fp64, bwd also against FD. */
static void test_swiglu(int64_t n, int off) {
    float *g = fnew(n), *u = fnew(n), *dout = fnew(n), *out = fnew(n), *dg = fnew(n), *du = fnew(n);
    fill_normal(g, n, 3.0);
    g[0] = 30.0f, g[1] = -30.0f, g[2] = 0.0f, g[3] = -100.0f;
    gt_round_bf16(g, n);
    fill_normal_bf(u, n, 1.0);
    fill_normal_bf(dout, n, 1.0);
    float *tmp = fnew(n + off);
    tmp[0] = 0.0f;
    memcpy(tmp + off, g, (size_t)n * 4);
    void *dG = up_act(tmp, n + off);
    memcpy(tmp + off, u, (size_t)n * 4);
    void *dU = up_act(tmp, n + off);
    memcpy(tmp + off, dout, (size_t)n * 4);
    void *dD = up_act(tmp, n + off);
    void *dO = up_nan(n + off, FM_DTYPE_BF16), *dDG = up_nan(n + off, FM_DTYPE_BF16),
         *dDU = up_nan(n + off, FM_DTYPE_BF16);
#define SW(p) (off ? off1(p) : (p))
    OPS->swiglu_fwd(CTX, SW(dO), SW(dG), SW(dU), n);
    OPS->swiglu_bwd(CTX, SW(dDG), SW(dDU), SW(dD), SW(dG), SW(dU), n);
#undef SW
    down_act(tmp, dO, n + off);
    memcpy(out, tmp + off, (size_t)n * 4);
    down_act(tmp, dDG, n + off);
    memcpy(dg, tmp + off, (size_t)n * 4);
    down_act(tmp, dDU, n + off);
    memcpy(du, tmp + off, (size_t)n * 4);
    swi_st s = {dnew(n), dnew(n), dnew(n), n};
    to_d(s.g, g, n);
    to_d(s.u, u, n);
    to_d(s.dout, dout, n);
    double *ref = dnew(n), *rdg = dnew(n), *rdu = dnew(n);
    fm_ref_swiglu_fwd(ref, s.g, s.u, n);
    fm_ref_swiglu_bwd(rdg, rdu, s.dout, s.g, s.u, n);
    char what[96];
    snprintf(what, sizeof what, "swiglu_fwd n=%lld offset %d", (long long)n, off);
    CHECK_ERR(what, gt_nerr(out, ref, n), GT_TOL_BF16);
    CHECK_ULPS(what, out, ref, n, 0.0, ULPS_ELEMENTWISE);
    snprintf(what, sizeof what, "swiglu_bwd n=%lld offset %d dgate", (long long)n, off);
    CHECK_ERR(what, gt_nerr(dg, rdg, n), GT_TOL_BF16);
    /* dgate's factor 1 + g (1 - sigmoid(g)) cancels near g = -1.28: floored, and an fp32 sigmoid's
     * error there can move the rounding by one more step */
    CHECK_ULPS(what, dg, rdg, n, gt_rms(rdg, n) / 64, ULPS_REDUCTION);
    snprintf(what, sizeof what, "swiglu_bwd n=%lld offset %d dup", (long long)n, off);
    CHECK_ERR(what, gt_nerr(du, rdu, n), GT_TOL_BF16);
    CHECK_ULPS(what, du, rdu, n, 0.0, ULPS_ELEMENTWISE);
    CHECK_MSG(out[3] == 0.0f && dg[3] == 0.0f && du[3] == 0.0f, "swiglu at gate -100: %g %g %g", out[3], dg[3],
              du[3]);
    if (!off) {
        to_d(ref, dg, n);
        fd_check("swiglu_bwd dgate", swi_obj, &s, s.g, n, ref, GT_TOL_BF16);
        to_d(ref, du, n);
        fd_check("swiglu_bwd dup", swi_obj, &s, s.u, n, ref, GT_TOL_BF16);
    }
    dfree(dG), dfree(dU), dfree(dD), dfree(dO), dfree(dDG), dfree(dDU);
    free(g), free(u), free(dout), free(out), free(dg), free(du), free(tmp), free(s.g), free(s.u), free(s.dout);
    free(ref), free(rdg), free(rdu);
}

/* ---- AdamW ----------------------------------------------------------------------------------- */

/* One step against an fp64 reference of fm_backend.h's formula (bias correction at `step`,
 * weight decay, grad_scale). With a master: master's update tol 1e-4, m and v tol 1e-6, and p
 * is exactly bf16(master). Without (p is the weights, read as fp32): p_new is the bf16 rounding
 * of the reference p + update (within one bf16 step where the reference sits at a rounding
 * boundary). The learning rate is large (0.05) so the bf16 update is not lost in rounding. */
static void test_adamw(int step, float wd, float gs, bool with_master) {
    const int64_t n = 20001;
    const float lr = 5e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
    const float bc1 = 1.0f - powf(b1, (float)step), bc2 = 1.0f - powf(b2, (float)step);
    float *w = fnew(n), *g = fnew(n), *m = fnew(n), *v = fnew(n), *p = fnew(n);
    fill_normal(w, n, 1.0);
    if (!with_master) gt_round_bf16(w, n);
    for (int64_t i = 0; i < n; i++) p[i] = gt_bf16_to_f32(gt_f32_to_bf16(w[i]));
    fill_normal_bf(g, n, 1.0);
    fill_normal(m, n, step > 1 ? 0.1 : 0.0);
    for (int64_t i = 0; i < n; i++) v[i] = step > 1 ? (float)(0.01 * fabs(rnd_normal())) : 0.0f;
    double *rd = dnew(n), *rm = dnew(n), *rv = dnew(n);
    {
        double *wd_ = fm_ref_widen(w, n), *gd = fm_ref_widen(g, n), *md = fm_ref_widen(m, n), *vd = fm_ref_widen(v, n);
        fm_ref_adamw(rd, rm, rv, wd_, gd, md, vd, n, lr, b1, b2, eps, wd, bc1, bc2, gs);
        free(wd_), free(gd), free(md), free(vd);
    }
    void *dP = up_act(p, n), *dG = up_act(g, n), *dM = up_f32(m, n), *dV = up_f32(v, n);
    void *dW = with_master ? up_f32(w, n) : NULL;
    OPS->adamw(CTX, dP, dG, dW, dM, dV, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, gs);
    float *pn = fnew(n), *mn = fnew(n), *vn = fnew(n), *wn = fnew(n), *d = fnew(n);
    down_act(pn, dP, n);
    down_f32(mn, dM, n);
    down_f32(vn, dV, n);
    char what[128];
    snprintf(what, sizeof what, "adamw step %d wd %g grad_scale %g %s master", step, wd, gs,
             with_master ? "with" : "without");
    if (with_master) {
        down_f32(wn, dW, n);
        for (int64_t i = 0; i < n; i++) d[i] = (float)((double)wn[i] - (double)w[i]);
        CHECK_ERR(what, gt_nerr(d, rd, n), 1e-4);
        bool ok = true;
        for (int64_t i = 0; i < n; i++)
            if (gt_f32_to_bf16(wn[i]) != gt_f32_to_bf16(pn[i])) ok = false;
        CHECK_MSG(ok, "%s: p is not the bf16 rounding of the master", what);
    } else {
        /* Rounding the fp32 result to bf16 errs by at most half a bf16 step (2^(e-8) for
         * |ref| in [2^(e-1), 2^e)) plus the fp32 arithmetic's own error (slack). */
        int64_t bad = 0, bad_i = -1;
        for (int64_t i = 0; i < n; i++) {
            const double ref = (double)w[i] + rd[i];
            int e2 = 0;
            (void)frexp(fabs(ref), &e2);
            const double half_step = ldexp(1.0, e2 - 9), slack = 1e-6 * (fabs(w[i]) + fabs(rd[i]) + lr);
            if (!(fabs((double)pn[i] - ref) <= half_step + slack)) {
                if (bad_i < 0) bad_i = i;
                bad++;
            }
        }
        CHECK_MSG(bad == 0, "%s: %lld elements are not the bf16 rounding of p + update (first %lld: %.9g vs %.9g)",
                  what, (long long)bad, (long long)bad_i, bad_i >= 0 ? pn[bad_i] : 0.0,
                  bad_i >= 0 ? (double)w[bad_i] + rd[bad_i] : 0.0);
        double *pref = dnew(n);
        for (int64_t i = 0; i < n; i++) pref[i] = (double)w[i] + rd[i];
        CHECK_ULPS(what, pn, pref, n, gt_rms(pref, n) / 64, ULPS_ELEMENTWISE); /* w + update can cancel */
        free(pref);
    }
    snprintf(what, sizeof what, "adamw step %d %s master: m", step, with_master ? "with" : "without");
    CHECK_ERR(what, gt_nerr(mn, rm, n), 1e-6);
    snprintf(what, sizeof what, "adamw step %d %s master: v", step, with_master ? "with" : "without");
    CHECK_ERR(what, gt_nerr(vn, rv, n), 1e-6);
    dfree(dP), dfree(dG), dfree(dM), dfree(dV);
    if (dW) dfree(dW);
    free(w), free(g), free(m), free(v), free(p), free(rd), free(rm), free(rv), free(pn), free(mn), free(vn),
        free(wn), free(d);
}

/* bf16 moments (vector path and, one element off, the scalar path): from moments bf16 holds
 * exactly, the step with bf16 moments gives the same master and bf16 weights bit for bit as with
 * fp32 moments, and its moments are the fp32 ones rounded to nearest even. */
static void test_adamw_bf16_moments(int step, int off) {
    const int64_t n = 20001;
    const float lr = 5e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    const float bc1 = 1.0f - powf(b1, (float)step), bc2 = 1.0f - powf(b2, (float)step);
    float *w = fnew(n + 1), *g = fnew(n + 1), *m = fnew(n + 1), *v = fnew(n + 1);
    fill_normal(w, n + 1, 1.0);
    fill_normal_bf(g, n + 1, 1.0);
    fill_normal_bf(m, n + 1, step > 1 ? 0.1 : 0.0);
    for (int64_t i = 0; i <= n; i++) v[i] = step > 1 ? gt_bf16_to_f32(gt_f32_to_bf16((float)(0.01 * fabs(rnd_normal())))) : 0.0f;
    void *dP = up_act(w, n + 1), *dP2 = up_act(w, n + 1), *dG = up_act(g, n + 1), *dW = up_f32(w, n + 1),
         *dW2 = up_f32(w, n + 1), *dM = up_f32(m, n + 1), *dV = up_f32(v, n + 1), *dMh = up_act(m, n + 1),
         *dVh = up_act(v, n + 1);
    const size_t o4 = (size_t)off * 4, o2 = (size_t)off * 2;
    OPS->adamw(CTX, (fm_act *)((char *)dP + o2), (const fm_act *)((char *)dG + o2), (float *)((char *)dW + o4), (char *)dM + o4, (char *)dV + o4,
               FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, 1.0f);
    OPS->adamw(CTX, (fm_act *)((char *)dP2 + o2), (const fm_act *)((char *)dG + o2), (float *)((char *)dW2 + o4), (char *)dMh + o2,
               (char *)dVh + o2, FM_DTYPE_BF16, n, lr, b1, b2, eps, wd, bc1, bc2, 1.0f);
    void *p1 = down_raw(dP, (size_t)(n + 1) * 2), *p2 = down_raw(dP2, (size_t)(n + 1) * 2);
    void *w1 = down_raw(dW, (size_t)(n + 1) * 4), *w2 = down_raw(dW2, (size_t)(n + 1) * 4);
    CHECK_MSG(same_bits(p1, p2, (size_t)(n + 1) * 2) && same_bits(w1, w2, (size_t)(n + 1) * 4),
              "adamw bf16 moments step %d offset %d: weights differ from the fp32-moment step", step, off);
    float *mf = fnew(n + 1), *vf = fnew(n + 1);
    down_f32(mf, dM, n + 1);
    down_f32(vf, dV, n + 1);
    uint16_t *mb = down_raw(dMh, (size_t)(n + 1) * 2), *vb = down_raw(dVh, (size_t)(n + 1) * 2);
    int64_t bad = 0;
    for (int64_t i = off; i < n + off; i++)
        if (mb[i] != gt_f32_to_bf16(mf[i]) || vb[i] != gt_f32_to_bf16(vf[i])) bad++;
    CHECK_MSG(bad == 0, "adamw bf16 moments step %d offset %d: %lld moments are not the fp32 ones rounded", step, off,
              (long long)bad);
    dfree(dP), dfree(dP2), dfree(dG), dfree(dW), dfree(dW2), dfree(dM), dfree(dV), dfree(dMh), dfree(dVh);
    free(w), free(g), free(m), free(v), free(p1), free(p2), free(w1), free(w2), free(mf), free(vf), free(mb), free(vb);
}

/* AdamW on bf16 weights (adamw_bf16w: Kahan, or stochastic rounding; vector path and, one element
 * off, the scalar path; fp32 and bf16 moments) against its fp32 bit model (tests/fm_ref_ops.c),
 * bit for bit: every operation of the kernel is rounded on its own and the random bits are the
 * same hash of (key, index), so the CUDA and CPU backends give the same weights. With bf16 moments
 * (from moments bf16 holds exactly) the weights are the fp32-moment step's and the moments are
 * its moments rounded to nearest even. */
static void test_adamw_bf16w(bool kahan, int step, int off) {
    const int64_t n = 20001, N = n + 1;
    const float lr = 5e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    const float bc1 = 1.0f - powf(b1, (float)step), bc2 = 1.0f - powf(b2, (float)step);
    const uint64_t key = fm_sr_key(99, step);
    float *w = fnew(N), *g = fnew(N), *m = fnew(N), *v = fnew(N), *c = fnew(N), *out = fnew(N), *mo = fnew(N),
          *vo = fnew(N), *co = fnew(N);
    fill_normal_bf(w, N, 1.0);
    fill_normal_bf(g, N, 1.0);
    fill_normal_bf(m, N, step > 1 ? 0.1 : 0.0);
    fill_normal_bf(c, N, kahan ? 1e-3 : 0.0);
    for (int64_t i = 0; i < N; i++) v[i] = step > 1 ? gt_bf16_to_f32(gt_f32_to_bf16((float)(0.01 * fabs(rnd_normal())))) : 0.0f;
    uint16_t *c16 = malloc(2 * (size_t)N);
    for (int64_t i = 0; i < N; i++) c16[i] = gt_f32_to_bf16(c[i]);
    void *dP = up_act(w, N), *dP2 = up_act(w, N), *dG = up_act(g, N), *dM = up_f32(m, N), *dV = up_f32(v, N),
         *dC = up_act(c, N), *dC2 = up_act(c, N), *dMh = up_act(m, N), *dVh = up_act(v, N);
    const size_t o4 = (size_t)off * 4, o2 = (size_t)off * 2;
    OPS->adamw_bf16w(CTX, (fm_act *)((char *)dP + o2), (const fm_act *)((char *)dG + o2),
                     kahan ? (uint16_t *)((char *)dC + o2) : NULL, (char *)dM + o4, (char *)dV + o4, FM_DTYPE_F32, n, lr,
                     b1, b2, eps, wd, bc1, bc2, 0.5f, key, 1234);
    OPS->adamw_bf16w(CTX, (fm_act *)((char *)dP2 + o2), (const fm_act *)((char *)dG + o2),
                     kahan ? (uint16_t *)((char *)dC2 + o2) : NULL, (char *)dMh + o2, (char *)dVh + o2, FM_DTYPE_BF16, n,
                     lr, b1, b2, eps, wd, bc1, bc2, 0.5f, key, 1234);
    fm_ref_adamw_bf16w(w + off, g + off, kahan ? c16 + off : NULL, m + off, v + off, n, lr, b1, b2, eps, wd, bc1, bc2,
                       0.5f, key, 1234);
    down_act(out, dP, N);
    down_f32(mo, dM, N);
    down_f32(vo, dV, N);
    down_act(co, dC, N);
    int64_t bad = 0, badc = 0;
    for (int64_t i = off; i < n + off; i++) {
        bad += out[i] != w[i] || mo[i] != m[i] || vo[i] != v[i];
        badc += kahan && gt_f32_to_bf16(co[i]) != c16[i];
    }
    CHECK_MSG(bad == 0 && badc == 0, "adamw_bf16w %s step %d offset %d: %lld weights/moments and %lld buffer elements "
              "differ from the bit model", kahan ? "kahan" : "sr", step, off, (long long)bad, (long long)badc);
    float *out2 = fnew(N), *co2 = fnew(N), *mh = fnew(N), *vh = fnew(N);
    down_act(out2, dP2, N);
    down_act(co2, dC2, N);
    down_act(mh, dMh, N);
    down_act(vh, dVh, N);
    bad = 0;
    for (int64_t i = off; i < n + off; i++)
        bad += out2[i] != out[i] || (kahan && co2[i] != co[i]) || gt_f32_to_bf16(mo[i]) != gt_f32_to_bf16(mh[i]) ||
               gt_f32_to_bf16(vo[i]) != gt_f32_to_bf16(vh[i]);
    CHECK_MSG(bad == 0, "adamw_bf16w %s step %d offset %d, bf16 moments: %lld elements differ from the fp32-moment step",
              kahan ? "kahan" : "sr", step, off, (long long)bad);
    dfree(dP), dfree(dP2), dfree(dG), dfree(dM), dfree(dV), dfree(dC), dfree(dC2), dfree(dMh), dfree(dVh);
    free(w), free(g), free(m), free(v), free(c), free(out), free(mo), free(vo), free(co), free(c16), free(out2), free(co2),
        free(mh), free(vh);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20241129));
    const double t0 = now_s();
    if (!dense_test_backend()) return fm_test_finish();

    /* the layer op cases every backend runs, with finite differences (tests/fm_op_cases.h) */
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_EMB); i++)
        test_embedding(FM_CASES_EMB[i].N, FM_CASES_EMB[i].V, FM_CASES_EMB[i].H, true);
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_RMS); i++)
        test_rmsnorm(FM_CASES_RMS[i].N, FM_CASES_RMS[i].D, FM_CASES_RMS[i].x_scale, true);
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_ROPE); i++) {
        const fm_case_rope *c = &FM_CASES_ROPE[i];
        test_rope(c->B, c->T, c->Tmax, c->nh, c->hd, c->rd);
    }
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_BIAS); i++) test_bias(FM_CASES_BIAS[i].N, FM_CASES_BIAS[i].D);
    test_bias(40000, 96); /* many rows per lane: the fixed-order fp32 column sums */
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_SLICE); i++) test_head_slice(&FM_CASES_SLICE[i]);
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_SWIGLU); i++) test_swiglu(FM_CASES_SWIGLU[i], 0);
    /* and the CUDA kernels' own paths */
    test_embedding(5000, 300, 72, false); /* many runs of repeated ids */
    test_embedding(300000, 500, 16, false); /* more than one sort chunk (2^18 tokens) */
    test_rmsnorm(20000, 64, 1.0, false); /* 500 row chunks for dw */
    test_rmsnorm(1000, 2050, 1.0, false); /* wide, scalar path */
    test_swiglu(9001, 1); /* one element off: the scalar path */
    test_adamw(1, 0.0f, 1.0f, true);
    test_adamw(5, 0.1f, 0.5f, true);
    test_adamw(1, 0.0f, 1.0f, false);
    test_adamw(5, 0.1f, 0.5f, false);
    test_adamw_bf16_moments(1, 0);
    test_adamw_bf16_moments(6, 0);
    test_adamw_bf16_moments(6, 1); /* unaligned: the scalar path */
    for (int k = 0; k < 2; k++) { /* the state recipes (--master-weights): Kahan, stochastic rounding */
        test_adamw_bf16w(k, 1, 0);
        test_adamw_bf16w(k, 6, 0);
        test_adamw_bf16w(k, 6, 1); /* unaligned: the scalar path */
    }
    CHECK_BACKEND_OK(&g_be); /* no op above recorded an error */
    printf("checks done in %.2f s\n", now_s() - t0);

    fm_cuda_backend_free(&g_be);
    CHECK(g_be.ops == NULL && g_be.ctx == NULL);
    return fm_test_finish();
}
