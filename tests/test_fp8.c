/* FP8 blockwise experts (--expert-precision fp8): backend/fm_fp8.h's E4M3 rounding and block
 * scales, the CPU backend's quant_fp8_* ops, the SNR of each expert product, and the fp8 MoE
 * layer (model/fm_experts_fp8.h) against the same fake quantization applied by hand.
 * - E4M3: a table of known values (448, the smallest subnormal 2^-9, ties to even, 449 -> 448,
 *   saturation, NaN), every finite code a fixed point whose encoding round-trips, and each
 *   midpoint between neighbouring codes rounding to the even one (just above/below: the
 *   upper/lower one);
 * - block scales: amax <= 448 s < 2 amax, s a power of two, s = 1 for a zero block, every
 *   q(x)/s an E4M3 value, |q(x) - x| <= 2^-4 |x| in the normal range, tiles independent (a
 *   huge value moves only its own tile's scale, partial tiles, one NaN -> its tile all NaN);
 * - SNR of fp8 against fp32 per product (forward gate/down, dgrad, wgrad) at OLMoE-like small
 *   shapes (4 experts, H 256, I 128, rows 200 / 0 / 77 / 300: an empty expert, partial 128-row
 *   tiles), in [20, 40] dB. Bound: E4M3 rounds to nearest with 3 mantissa bits, so each element's
 *   relative error |eps| <= 2^-4 (half an ulp) in the normal range (which, with a 448-scaled
 *   block, holds all but the values below amax / 2^15); for a product sum_k a_k b_k of
 *   independent zero-mean terms the error sum_k a_k b_k (eps_a + eps_b) has power
 *   <= 2 x 2^-8 x the signal power, i.e. SNR >= 10 log10(128) = 21.1 dB even if every element
 *   erred by the most; 20 dB leaves room for the few subnormal-range elements. The typical
 *   error (uniform within half an ulp) gives ~25-30 dB; above 40 dB the operands would not be
 *   quantized at all (a test that can fail both ways);
 * - the fp8 MoE layer (plain twin and chunked): each expert GEMM equals the fp64 product of the
 *   fake-quantized operands, read from the layer's own intermediates (each output within 1e-5
 *   of its sum of |terms|: fp32 sums), on operands scaled 2^-16 apart by row and column so that
 *   a wrong tiling fails (power-of-two scales make E4M3 rounding scale-free in its normal
 *   range: a tiling shows only in which values underflow; i.i.d. data would hide it); the
 *   chunked form's outputs and input gradients equal the plain twin's bit for bit through a
 *   fixed-order gemm (row tiles do not depend on the chunking; tests/fm_test_fixed_gemm.h) and
 *   within a derived bound through the BLAS (chunked_close), its weight gradients are close (the
 *   128 x 1 tiles follow the chunk's rows); the fp8 outputs differ from the native ones by a few
 *   percent; the working set's bytes grow by exactly the fp8 term. The layer's inputs have row and
 *   column scales over several binades, so a wrong tiling anywhere changes the block scales
 *   (with i.i.d. data all tiles share one binade of amax and every tiling gives the same bits). */
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "backend/fm_fp8.h"
#include "core/fm_rng.h"
#include "fm_ref_ops.h"
#include "fm_test.h"
#include "fm_test_fixed_gemm.h"
#include "model/fm_moe_layer.h"

static fm_backend g_be;

/* ---- E4M3 rounding ----------------------------------------------------------------------------- */

static void test_e4m3_table(void) {
    const struct { float in, out; } t[] = {
        {448.0f, 448.0f},           /* largest finite */
        {449.0f, 448.0f},           /* nearest */
        {464.0f, 448.0f},           /* tie between 448 (even) and 480 (not representable): 448 */
        {470.0f, 448.0f},           /* rounds to 480: saturates */
        {1e30f, 448.0f},            /* saturates */
        {-1e30f, -448.0f},
        {0.001953125f, 0.001953125f}, /* 2^-9, smallest subnormal */
        {0.0009765625f, 0.0f},      /* 2^-10: tie between 0 (even) and 2^-9 */
        {0.0029296875f, 0.00390625f}, /* 1.5 x 2^-9: tie, to 2 x 2^-9 (even) */
        {0.0048828125f, 0.00390625f}, /* 2.5 x 2^-9: tie, to 2 x 2^-9 (even) */
        {0.015625f, 0.015625f},     /* 2^-6, smallest normal */
        {1.0625f, 1.0f},            /* tie between 1 and 1.125: to 1 (even) */
        {1.1875f, 1.25f},           /* tie between 1.125 and 1.25: to 1.25 (even) */
        {1.2f, 1.25f},
        {-3.3f, -3.25f},
        {240.0f, 240.0f},
        {248.0f, 256.0f},           /* tie between 240 and 256: to 256 (even) */
        {1e-40f, 0.0f},             /* fp32 subnormal */
        {0.0f, 0.0f},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        CHECK_MSG(fm_e4m3_round(t[i].in) == t[i].out, "e4m3(%.10g) = %.10g, expected %.10g", t[i].in,
                  fm_e4m3_round(t[i].in), t[i].out);
    CHECK(fm_e4m3_round(nextafterf(0.0009765625f, 1.0f)) == 0.001953125f); /* just above the tie */
    CHECK(signbit(fm_e4m3_round(-0.0f)) && signbit(fm_e4m3_round(-1e-40f)));
    CHECK(isnan(fm_e4m3_round(NAN)) && isnan(fm_e4m3_round(INFINITY)) && isnan(fm_e4m3_round(-INFINITY)));
    CHECK(fm_e4m3_encode(448.0f) == 0x7E && fm_e4m3_encode(-448.0f) == 0xFE && fm_e4m3_encode(0.001953125f) == 0x01);
    CHECK(fm_e4m3_encode(1.0f) == 0x38 && fm_e4m3_encode(NAN) == 0x7F && isnan(fm_e4m3_decode(0x7F)));
    /* every finite code: a fixed point that encodes back to itself */
    int bad = 0;
    for (int b = 0; b < 256; b++) {
        if ((b & 0x7F) == 0x7F) continue;
        const float f = fm_e4m3_decode((uint8_t)b);
        if (fm_e4m3_round(f) != f || fm_e4m3_encode(f) != b) bad++;
    }
    CHECK_MSG(bad == 0, "%d E4M3 codes are not fixed points", bad);
    /* midpoints between neighbouring positive codes: to the even code; nudged: the nearer one */
    bad = 0;
    for (int b = 0; b < 0x7E; b++) {
        const float lo = fm_e4m3_decode((uint8_t)b), hi = fm_e4m3_decode((uint8_t)(b + 1)), mid = 0.5f * (lo + hi);
        const float even = (b & 1) ? hi : lo;
        if (fm_e4m3_round(mid) != even || fm_e4m3_round(nextafterf(mid, 0.0f)) != lo ||
            fm_e4m3_round(nextafterf(mid, 1e9f)) != hi || fm_e4m3_round(-mid) != -even)
            bad++;
    }
    CHECK_MSG(bad == 0, "%d midpoints round wrong", bad);
}

/* ---- block scales -------------------------------------------------------------------------------- */

static void test_block_scales(fm_rng *r) {
    /* the exponent: amax <= 448 * 2^e < 2 amax */
    int bad = 0;
    for (int i = 0; i < 20000; i++) {
        const float amax = ldexpf(1.0f + fm_rng_uniform(r), (int)(fm_rng_u64(r) % 200) - 120);
        const int e = fm_fp8_scale_exp(amax);
        if (!((double)amax <= 448.0 * ldexp(1.0, e) && 448.0 * ldexp(1.0, e) < 2.0 * amax)) bad++;
    }
    CHECK_MSG(bad == 0, "%d scale exponents off", bad);
    CHECK(fm_fp8_scale_exp(448.0f) == 0 && fm_fp8_scale_exp(449.0f) == 1 && fm_fp8_scale_exp(0.0f) == 0);
    /* rows: a [3, 300] tensor (tiles 128, 128, 44 per row) */
    const int64_t R = 3, C = 300;
    float *x = fnew(R * C), *y = fnew(R * C), *y2 = fnew(R * C);
    for (int64_t i = 0; i < R * C; i++) x[i] = (float)fm_rng_normal(r) * 0.01f;
    for (int64_t j = 0; j < 128; j++) x[1 * C + j] = 0.0f; /* row 1, tile 0: all zero */
    x[2 * C + 130] = 1e4f;                                  /* row 2, tile 1: one huge value */
    g_be.ops->quant_fp8_rows(g_be.ctx, y, x, R, C);
    int not_e4m3 = 0, too_far = 0;
    for (int64_t i = 0; i < R; i++)
        for (int64_t j0 = 0; j0 < C; j0 += 128) {
            const int64_t n = C - j0 < 128 ? C - j0 : 128;
            float amax = 0;
            for (int64_t j = 0; j < n; j++) amax = fmaxf(amax, fabsf(x[i * C + j0 + j]));
            const int e = fm_fp8_scale_exp(amax);
            for (int64_t j = 0; j < n; j++) {
                const float xv = x[i * C + j0 + j], q = y[i * C + j0 + j], u = ldexpf(q, -e);
                if (fm_e4m3_round(u) != u || fabsf(u) > 448.0f) not_e4m3++;
                if (fabsf(ldexpf(xv, -e)) >= 0.015625f && fabsf(q - xv) > 0.0625f * fabsf(xv)) too_far++;
            }
        }
    CHECK_MSG(not_e4m3 == 0, "%d quantized values are not E4M3 x 2^e", not_e4m3);
    CHECK_MSG(too_far == 0, "%d normal-range values off by more than 2^-4 relative", too_far);
    for (int64_t j = 0; j < 128; j++) CHECK(y[1 * C + j] == 0.0f);
    /* the huge value flushes its own tile's small values to zero, not the neighbouring tiles' */
    int flushed = 0, tile0_same = 1;
    for (int64_t j = 128; j < 256; j++) flushed += j != 130 && y[2 * C + j] == 0.0f;
    fm_fp8_ref_rows(y2, x, R, C);
    CHECK(memcmp(y, y2, sizeof(float) * (size_t)(R * C)) == 0); /* the op is the reference */
    x[2 * C + 130] = 0.0f;
    fm_fp8_ref_rows(y2, x, R, C);
    for (int64_t j = 0; j < 128; j++) tile0_same &= y2[2 * C + j] == y[2 * C + j];
    for (int64_t j = 256; j < C; j++) tile0_same &= y2[2 * C + j] == y[2 * C + j];
    CHECK_MSG(flushed > 100, "only %d of the huge value's tile flushed", flushed);
    CHECK(tile0_same);
    CHECK(y[2 * C + 130] == fm_fp8_fake(1e4f, fm_fp8_scale_exp(1e4f)));
    /* a NaN: its tile all NaN, the others finite */
    x[0 * C + 140] = NAN;
    g_be.ops->quant_fp8_rows(g_be.ctx, y, x, R, C);
    int nan_in = 0, nan_out = 0;
    for (int64_t j = 128; j < 256; j++) nan_in += isnan(y[j]) != 0;
    for (int64_t j = 0; j < R * C; j++) nan_out += (j < 128 || j >= 256) && isnan(y[j]);
    CHECK(nan_in == 128 && nan_out == 0);
    x[0 * C + 140] = 1.0f;
    /* blocks: 2 matrices [200, 150], in place equals out of place */
    const int64_t M = 2, BR = 200, BC = 150;
    float *w = fnew(M * BR * BC), *wq = fnew(M * BR * BC), *wr = fnew(M * BR * BC);
    for (int64_t i = 0; i < M * BR * BC; i++) w[i] = (float)fm_rng_normal(r) * 0.02f;
    w[1 * BR * BC + 130 * BC + 140] = 3.0f; /* matrix 1, block (1,1) */
    g_be.ops->quant_fp8_blocks(g_be.ctx, wq, w, M, BR, BC);
    fm_fp8_ref_blocks(wr, w, M, BR, BC);
    CHECK(memcmp(wq, wr, sizeof(float) * (size_t)(M * BR * BC)) == 0);
    float amax11 = 0;
    for (int64_t i = 128; i < BR; i++)
        for (int64_t j = 128; j < BC; j++) amax11 = fmaxf(amax11, fabsf(w[1 * BR * BC + i * BC + j]));
    const int e11 = fm_fp8_scale_exp(amax11);
    CHECK(e11 == fm_fp8_scale_exp(3.0f));
    int blk_ok = 1;
    for (int64_t i = 128; i < BR; i++)
        for (int64_t j = 128; j < BC; j++) {
            const float v = w[1 * BR * BC + i * BC + j];
            blk_ok &= wq[1 * BR * BC + i * BC + j] == fm_fp8_fake(v, e11);
        }
    CHECK(blk_ok);
    memcpy(wr, w, sizeof(float) * (size_t)(M * BR * BC));
    g_be.ops->quant_fp8_blocks(g_be.ctx, wr, wr, M, BR, BC);
    CHECK(memcmp(wq, wr, sizeof(float) * (size_t)(M * BR * BC)) == 0);
    /* cols grouped: groups of 200, 0, 77 rows; a tile never crosses a group */
    const int64_t off[4] = {0, 200, 200, 277}, CC = 5;
    float *a = fnew(277 * CC), *aq = fnew(277 * CC);
    for (int64_t i = 0; i < 277 * CC; i++) a[i] = (float)fm_rng_normal(r);
    a[199 * CC + 2] = 1e3f; /* group 0's last (partial) tile, column 2 */
    g_be.ops->quant_fp8_cols_grouped(g_be.ctx, aq, a, off, 3, CC);
    float amax_t = 0;
    for (int64_t i = 128; i < 200; i++) amax_t = fmaxf(amax_t, fabsf(a[i * CC + 2]));
    int col_ok = 1;
    for (int64_t i = 128; i < 200; i++) col_ok &= aq[i * CC + 2] == fm_fp8_fake(a[i * CC + 2], fm_fp8_scale_exp(amax_t));
    float amax_g2 = 0;
    for (int64_t i = 200; i < 277; i++) amax_g2 = fmaxf(amax_g2, fabsf(a[i * CC + 2]));
    for (int64_t i = 200; i < 277; i++) col_ok &= aq[i * CC + 2] == fm_fp8_fake(a[i * CC + 2], fm_fp8_scale_exp(amax_g2));
    CHECK(col_ok);
    free(x); free(y); free(y2); free(w); free(wq); free(wr); free(a); free(aq);
}

/* ---- SNR per product --------------------------------------------------------------------------- */

static double snr_db(const double *ref, const double *got, int64_t n) {
    double s = 0, e = 0;
    for (int64_t i = 0; i < n; i++) {
        s += ref[i] * ref[i];
        e += (got[i] - ref[i]) * (got[i] - ref[i]);
    }
    return 10.0 * log10(s / e);
}

/* The fp64 products below (tests/fm_ref_ops.h's grouped expert references on the widened
 * operands) also give, when mag is not NULL, each output's sum of |terms| (the scale its fp32
 * rounding error is relative to): the same product of the operands' absolute values. */
static double *widened(const float *x, int64_t n, bool absolute) {
    double *d = fm_ref_widen(x, n);
    if (absolute)
        for (int64_t i = 0; i < n; i++) d[i] = fabs(d[i]);
    return d;
}

/* y_e [m_e, out] = A_e [m_e, K] B_e^T, B_e [out, K]. */
static void gemm_nt(double *y, const float *A, const float *B, const int64_t *off, int64_t E, int64_t K, int64_t out,
                    double *mag) {
    for (int pass = 0; pass < (mag ? 2 : 1); pass++) {
        double *a = widened(A, off[E] * K, pass), *b = widened(B, E * out * K, pass);
        fm_ref_expert_linear_fwd(pass ? mag : y, a, b, off, E, K, out);
        free(a), free(b);
    }
}

/* dx_e [m_e, in] = dy_e [m_e, out] W_e, W_e [out, in]. */
static void gemm_nn(double *dx, const float *dy, const float *W, const int64_t *off, int64_t E, int64_t in, int64_t out,
                    double *mag) {
    double *x0 = dnew(off[E] * in), *dW = dnew(E * out * in); /* the reference's weight gradient: unused */
    for (int pass = 0; pass < (mag ? 2 : 1); pass++) {
        double *g = widened(dy, off[E] * out, pass), *w = widened(W, E * out * in, pass);
        fm_ref_expert_linear_bwd(pass ? mag : dx, dW, g, x0, w, off, E, in, out);
        free(g), free(w);
    }
    free(x0), free(dW);
}

/* dW_e [out, in] = dy_e^T x_e over the expert's rows. */
static void gemm_tn(double *dW, const float *dy, const float *x, const int64_t *off, int64_t E, int64_t in, int64_t out,
                    double *mag) {
    for (int pass = 0; pass < (mag ? 2 : 1); pass++) {
        double *to = pass ? mag : dW, *g = widened(dy, off[E] * out, pass), *a = widened(x, off[E] * in, pass);
        memset(to, 0, (size_t)(E * out * in) * sizeof(double)); /* the reference accumulates */
        fm_ref_expert_linear_bwd(NULL, to, g, a, to, off, E, in, out); /* W is not read without dx */
        free(g), free(a);
    }
}

static void test_snr(fm_rng *r) {
    const int64_t E = 4, H = 256, I = 128, off[5] = {0, 200, 200, 277, 577}, R = off[E];
    float *x = fnew(R * H), *h = fnew(R * I), *dy = fnew(R * H), *dh = fnew(R * I);
    float *Wg = fnew(E * I * H), *Wd = fnew(E * H * I);
    float *qx = fnew(R * H), *qh = fnew(R * I), *qdy = fnew(R * H), *qdh = fnew(R * I), *qWg = fnew(E * I * H),
          *qWd = fnew(E * H * I);
    for (int64_t i = 0; i < R * H; i++) { x[i] = (float)fm_rng_normal(r); dy[i] = (float)fm_rng_normal(r) * 1e-3f; }
    for (int64_t i = 0; i < R * I; i++) { /* SwiGLU-like heavy tails: a product of normals */
        h[i] = (float)(fm_rng_normal(r) * fm_rng_normal(r));
        dh[i] = (float)(fm_rng_normal(r) * fm_rng_normal(r)) * 1e-3f;
    }
    for (int64_t i = 0; i < E * I * H; i++) { Wg[i] = (float)fm_rng_normal(r) * 0.02f; Wd[i] = (float)fm_rng_normal(r) * 0.02f; }
    double *ref = dnew(E * H * I > R * H ? E * H * I : R * H), *got = dnew(E * H * I > R * H ? E * H * I : R * H);
    double snr[6];
    const char *names[6] = {"forward gate/up  y = x Wg^T  (K = H)", "forward down     y = h Wd^T  (K = I)",
                            "dgrad down       dh = dy Wd  (K = H)", "dgrad gate/up    dx = dh Wg  (K = I)",
                            "wgrad down       dWd = dy^T h (K = rows)", "wgrad gate/up    dWg = dh^T x (K = rows)"};
    g_be.ops->quant_fp8_blocks(g_be.ctx, qWg, Wg, E, I, H);
    g_be.ops->quant_fp8_blocks(g_be.ctx, qWd, Wd, E, H, I);
    /* forward and dgrad: row tiles */
    g_be.ops->quant_fp8_rows(g_be.ctx, qx, x, R, H);
    g_be.ops->quant_fp8_rows(g_be.ctx, qh, h, R, I);
    g_be.ops->quant_fp8_rows(g_be.ctx, qdy, dy, R, H);
    g_be.ops->quant_fp8_rows(g_be.ctx, qdh, dh, R, I);
    gemm_nt(ref, x, Wg, off, E, H, I, NULL), gemm_nt(got, qx, qWg, off, E, H, I, NULL), snr[0] = snr_db(ref, got, R * I);
    gemm_nt(ref, h, Wd, off, E, I, H, NULL), gemm_nt(got, qh, qWd, off, E, I, H, NULL), snr[1] = snr_db(ref, got, R * H);
    gemm_nn(ref, dy, Wd, off, E, I, H, NULL), gemm_nn(got, qdy, qWd, off, E, I, H, NULL), snr[2] = snr_db(ref, got, R * I);
    gemm_nn(ref, dh, Wg, off, E, H, I, NULL), gemm_nn(got, qdh, qWg, off, E, H, I, NULL), snr[3] = snr_db(ref, got, R * H);
    /* wgrad: each expert's 128 x 1 tiles */
    g_be.ops->quant_fp8_cols_grouped(g_be.ctx, qx, x, off, E, H);
    g_be.ops->quant_fp8_cols_grouped(g_be.ctx, qh, h, off, E, I);
    g_be.ops->quant_fp8_cols_grouped(g_be.ctx, qdy, dy, off, E, H);
    g_be.ops->quant_fp8_cols_grouped(g_be.ctx, qdh, dh, off, E, I);
    gemm_tn(ref, dy, h, off, E, I, H, NULL), gemm_tn(got, qdy, qh, off, E, I, H, NULL), snr[4] = snr_db(ref, got, E * H * I);
    gemm_tn(ref, dh, x, off, E, H, I, NULL), gemm_tn(got, qdh, qx, off, E, H, I, NULL), snr[5] = snr_db(ref, got, E * I * H);
    printf("SNR of fp8 (E4M3, power-of-two block scales) against fp32, E %lld H %lld I %lld rows 200/0/77/300:\n",
           (long long)E, (long long)H, (long long)I);
    for (int i = 0; i < 6; i++) {
        printf("  %-42s %.2f dB\n", names[i], snr[i]);
        CHECK_MSG(snr[i] >= 20.0 && snr[i] <= 40.0, "%s: SNR %.2f dB outside [20, 40]", names[i], snr[i]);
    }
    free(x); free(h); free(dy); free(dh); free(Wg); free(Wd); free(qx); free(qh); free(qdy); free(qdh); free(qWg);
    free(qWd); free(ref); free(got);
}

/* ---- the fp8 MoE layer ----------------------------------------------------------------------- */

/* max over the outputs of |got - ref| / (sum of |terms|): each output's error relative to its own
 * scale (fp32 sums keep it near 1e-7), so small outputs made of small operands count as much as
 * large ones; an output with no terms must be exactly 0. */
static double rel_err(const float *got, const double *ref, const double *mag, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) d = fmax(d, mag[i] > 0 ? fabs((double)got[i] - ref[i]) / mag[i] : fabs((double)got[i]));
    return d;
}

/* The chunked form against the plain twin through the real BLAS. They differ only in the row
 * grouping of the expert GEMMs, which on some OpenBLAS kernels (fm_test_fixed_gemm.h) changes the
 * order of a row's fp32 sums: two orders of an n-term sum differ by at most 2 gamma_n sum|terms|
 * (gamma_n = n u / (1 - n u), u = 2^-24; Higham, Accuracy and Stability of Numerical Algorithms,
 * 2nd ed., §3.1). The layer chains two such products (gate/up over H terms, down over I) around a
 * requantization, so the bound per token is 2 gamma_(H+I) (4.6e-5 here) times 4 (the SwiGLU and
 * the backward's second chain) of the row's largest output for y and dx, and of sum_h |dy_h ye_h|
 * for each router-weight gradient dot(dy, ye) (the dot is in double: its own order adds nothing).
 * Measured: 2.2e-7 on OpenBLAS's Haswell and Zen kernels, 0 on SkylakeX and Sandybridge. One
 * exception is allowed for: a sum an ulp off can land on the other side of an E4M3 rounding
 * midpoint when requantized (about 2^-20 of the values that moved: 3 mantissa bits of 23) and move
 * that operand by one E4M3 step (2^-3 of it), so up to 1% of the tokens may exceed the bound, each
 * still within 2^-3 of its scale. A chunked form with a wrong tiling or a misread route fails both
 * by far (O(1) on the 2^-16-scaled rows). The bits themselves are checked through the
 * fixed-order gemm (test_layer_fixed_gemm). */
static void chunked_close(const fm_moe_dims *d, const fm_moe_routes *saved, const float *y, const float *yc,
                          const float *dx, const float *dxc, const float *dtw, const float *dtwc, const float *dy,
                          int64_t N) {
    const int64_t H = d->H, k = d->k, n = d->H + d->I;
    const double tol = 4 * fm_test_reorder_bound(n), step = 0.125;
    double *e = dnew(N * k), worst[3] = {0, 0, 0};
    int64_t over[3] = {0, 0, 0};
    for (int q = 0; q < 3; q++) {
        int64_t m = N;
        if (q < 2) /* per token, against its own scale (the rows here are 2^-16 apart in scale) */
            for (int64_t t = 0; t < N; t++)
                e[t] = fm_test_row_rel((q ? dxc : yc) + t * H, (q ? dx : y) + t * H, 1, H);
        else {
            m = N * k;
            for (int64_t t = 0; t < m; t++) {
                const float *ye = saved->ye + (int64_t)saved->route_row[t] * H, *g = dy + (t / k) * H;
                double mag = 0;
                for (int64_t h = 0; h < H; h++) mag += fabs((double)g[h] * ye[h]);
                const double df = fabs((double)dtwc[t] - dtw[t]);
                e[t] = isnan(df) ? INFINITY : (mag > 0 ? df / mag : df);
            }
        }
        for (int64_t t = 0; t < m; t++) worst[q] = fmax(worst[q], e[t]), over[q] += e[t] > tol;
        CHECK_MSG(over[q] * 100 <= m && worst[q] <= step, "chunked vs plain %s: %lld of %lld tokens over %g, worst %g",
                  q == 0 ? "outputs" : q == 1 ? "input grads" : "router-weight grads", (long long)over[q],
                  (long long)m, tol, worst[q]);
    }
    printf("chunked vs plain (real BLAS): outputs %.3g, input grads %.3g, router-weight grads %.3g (bound %.3g; "
           "tokens over it: %lld %lld %lld)\n", worst[0], worst[1], worst[2], tol, (long long)over[0],
           (long long)over[1], (long long)over[2]);
    free(e);
}

/* The chunked form against the plain twin through the fixed-order gemm (fm_test_fixed_gemm.h):
 * the per-route arithmetic is the same and the activation tiles are rows (1 x 128), whatever the
 * chunk, so outputs, input gradients and router-weight gradients are bit-identical by
 * construction; a tiling that followed the chunk (the inputs' row and column scales make it move
 * values across the underflow line) or a route read from the wrong chunk breaks them. */
static void test_layer_fixed_gemm(const fm_moe_dims *d, const fm_moe_weights *w, const float *x, const int32_t *idx,
                                  const float *tw, const float *dy, int64_t N, int64_t K, const int32_t *order) {
    fm_ops ops;
    const fm_backend fb = fm_test_backend_fixed_gemm(&g_be, &ops);
    const int64_t H = d->H, k = d->k, EIH = d->E * d->I * d->H;
    int64_t Kc, c_eff;
    fm_moe_chunks(N, (N + K - 1) / K, &Kc, &c_eff);
    FM_ASSERT(Kc == K);
    float *y[2], *dx[2], *dtw[2];
    for (int c = 0; c < 2; c++) {
        const int64_t Kr = c ? K : 1, n = c ? c_eff : N;
        fm_arena a, h;
        FM_ASSERT(fm_arena_init(&a, "fixed", (c ? 0 : fm_moe_routes_bytes(d, N, 4)) + fm_moe_ws_bytes(d, n, c, 4)) ==
                  FM_OK);
        FM_ASSERT(fm_arena_init(&h, "fixed host", 2 * fm_moe_routes_host_bytes(d)) == FM_OK);
        fm_moe_routes saved;
        fm_moe_ws ws;
        if (!c) fm_moe_routes_layout(&saved, &a, &h, d, N);
        fm_moe_ws_layout(&ws, &a, &h, d, n, c);
        float *gg = fnew(EIH), *gu = fnew(EIH), *gd = fnew(EIH);
        const fm_moe_grads g = {gg, gu, gd};
        y[c] = fnew(N * H), dx[c] = fnew(N * H), dtw[c] = fnew(N * k);
        CHECK(fm_moe_forward(&fb, d, w, y[c], x, idx, tw, N, Kr, c ? order : NULL, c ? NULL : &saved, &ws) == FM_OK);
        CHECK(fm_moe_backward(&fb, d, w, &g, dx[c], dtw[c], dy, x, idx, tw, N, Kr, c ? order : NULL, c ? NULL : &saved,
                              &ws) == FM_OK);
        fm_arena_free(&a), fm_arena_free(&h);
        free(gg), free(gu), free(gd);
    }
    CHECK_MSG(memcmp(y[0], y[1], sizeof(float) * (size_t)(N * H)) == 0, "fixed-order gemm: chunked outputs differ");
    CHECK_MSG(memcmp(dx[0], dx[1], sizeof(float) * (size_t)(N * H)) == 0,
              "fixed-order gemm: chunked input grads differ");
    CHECK_MSG(memcmp(dtw[0], dtw[1], sizeof(float) * (size_t)(N * k)) == 0,
              "fixed-order gemm: chunked router-weight grads differ");
    for (int c = 0; c < 2; c++) free(y[c]), free(dx[c]), free(dtw[c]);
}

static void test_layer(fm_rng *r) {
    fm_moe_dims d = {256, 128, 4, 2, false, true}, dn = d;
    dn.fp8 = false;
    const int64_t N = 150, K = 3, H = d.H, I = d.I, E = d.E, R = N * d.k, EIH = E * I * H;
    /* the fp8 term of the working set, exactly */
    const size_t term = 3 * fm_arena_round((size_t)EIH * 4) + 2 * fm_arena_round((size_t)(R * H) * 4);
    CHECK(fm_moe_ws_bytes(&d, N, false, 4) == fm_moe_ws_bytes(&dn, N, false, 4) + term);
    float *Wg = fnew(EIH), *Wu = fnew(EIH), *Wd = fnew(EIH), *x = fnew(N * H), *tw = fnew(N * d.k);
    float *y = fnew(N * H), *yc = fnew(N * H), *yn = fnew(N * H), *dy = fnew(N * H);
    float *dx = fnew(N * H), *dxc = fnew(N * H), *dtw = fnew(N * d.k), *dtwc = fnew(N * d.k);
    float *gg = fnew(EIH), *gu = fnew(EIH), *gd = fnew(EIH), *ggc = fnew(EIH), *guc = fnew(EIH), *gdc = fnew(EIH);
    int32_t *idx = inew(N * d.k), *order = inew(N);
    /* Scales 2^-16 apart between rows and between columns: with power-of-two scales E4M3's
     * rounding is the same at any scale in its normal range, so a tiling shows only in which
     * values fall below it (about 2^-15 under their tile's amax). Every 4th column and every
     * 3rd row of x and dy, and every 4th row of the weights and every 5th of their columns, are
     * 2^-16 times the rest, so each wrong tiling (rows for columns, rows for blocks, ...) moves
     * some values across that line; the error is measured per output against its own scale
     * (rel_err), where those small values decide the small outputs. */
    const float t16 = ldexpf(1.0f, -16);
    for (int64_t i = 0; i < EIH; i++) {
        const int64_t row = i / H, col = i % H; /* gate/up [E*I, H] */
        const float sc = 0.05f * (row % 4 == 1 ? t16 : 1.0f) * (col % 5 == 2 ? t16 : 1.0f);
        Wg[i] = (float)fm_rng_normal(r) * sc;
        Wu[i] = (float)fm_rng_normal(r) * sc;
        const int64_t rd = i / I, cd = i % I; /* down [E*H, I] */
        Wd[i] = (float)fm_rng_normal(r) * 0.05f * (rd % 4 == 1 ? t16 : 1.0f) * (cd % 5 == 2 ? t16 : 1.0f);
    }
    for (int64_t i = 0; i < N * H; i++) {
        const int64_t n = i / H, j = i % H;
        const float sc = (n % 3 == 0 ? t16 : 1.0f) * (j % 4 == 0 ? t16 : 1.0f);
        x[i] = (float)fm_rng_normal(r) * sc;
        dy[i] = (float)fm_rng_normal(r) * sc;
    }
    for (int64_t n = 0; n < N; n++) { /* uneven: expert 3 gets no route, expert 0 most */
        const int32_t a = n % 5 < 4 ? 0 : 1, b = n % 2 ? 2 : (a == 0 ? 1 : 0);
        idx[n * 2] = a, idx[n * 2 + 1] = b;
        tw[n * 2] = 0.6f, tw[n * 2 + 1] = 0.4f;
    }
    fm_moe_chunk_order(order, N, K);
    int64_t Kc, c_eff;
    fm_moe_chunks(N, (N + K - 1) / K, &Kc, &c_eff);
    FM_ASSERT(Kc == K);
    fm_arena ap, ac, an, hp, hc, hn;
    FM_ASSERT(fm_arena_init(&ap, "plain", fm_moe_routes_bytes(&d, N, 4) + fm_moe_ws_bytes(&d, N, false, 4)) == FM_OK);
    FM_ASSERT(fm_arena_init(&ac, "chunked", fm_moe_ws_bytes(&d, c_eff, true, 4)) == FM_OK);
    FM_ASSERT(fm_arena_init(&an, "native", fm_moe_routes_bytes(&dn, N, 4) + fm_moe_ws_bytes(&dn, N, false, 4)) == FM_OK);
    FM_ASSERT(fm_arena_init(&hp, "host", 2 * fm_moe_routes_host_bytes(&d)) == FM_OK);
    FM_ASSERT(fm_arena_init(&hc, "host", 2 * fm_moe_routes_host_bytes(&d)) == FM_OK);
    FM_ASSERT(fm_arena_init(&hn, "host", 2 * fm_moe_routes_host_bytes(&d)) == FM_OK);
    fm_moe_routes saved, saved_n;
    fm_moe_ws ws, wsc, wsn;
    fm_moe_routes_layout(&saved, &ap, &hp, &d, N);
    fm_moe_ws_layout(&ws, &ap, &hp, &d, N, false);
    fm_moe_ws_layout(&wsc, &ac, &hc, &d, c_eff, true);
    fm_moe_routes_layout(&saved_n, &an, &hn, &dn, N);
    fm_moe_ws_layout(&wsn, &an, &hn, &dn, N, false);
    CHECK(ap.used == ap.capacity && ac.used == ac.capacity); /* the layout takes exactly the bound */
    const fm_moe_weights w = {Wg, Wu, Wd};
    const fm_moe_grads g = {gg, gu, gd}, gc = {ggc, guc, gdc};
    CHECK(fm_moe_forward(&g_be, &d, &w, y, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK);
    CHECK(fm_moe_forward(&g_be, &d, &w, yc, x, idx, tw, N, K, order, NULL, &wsc) == FM_OK);
    CHECK(fm_moe_forward(&g_be, &dn, &w, yn, x, idx, tw, N, 1, NULL, &saved_n, &wsn) == FM_OK);
    const int64_t *off = saved.offsets;
    CHECK(off[4] == R && off[4] - off[3] == 0 && off[1] - off[0] > 128); /* an empty expert, a partial tile */
    /* each forward product from the layer's own intermediates */
    float *qa = fnew(R * H), *qw = fnew(EIH);
    double *ref = dnew(R * H > EIH ? R * H : EIH), *mag = dnew(R * H > EIH ? R * H : EIH);
    fm_fp8_ref_rows(qa, saved.xe, R, H);
    fm_fp8_ref_blocks(qw, Wg, E, I, H);
    gemm_nt(ref, qa, qw, off, E, H, I, mag);
    const double e_gate = rel_err(saved.h_gate, ref, mag, R * I);
    fm_fp8_ref_blocks(qw, Wu, E, I, H);
    gemm_nt(ref, qa, qw, off, E, H, I, mag);
    const double e_up = rel_err(saved.h_up, ref, mag, R * I);
    fm_fp8_ref_rows(qa, saved.h_act, R, I);
    fm_fp8_ref_blocks(qw, Wd, E, H, I);
    gemm_nt(ref, qa, qw, off, E, I, H, mag);
    const double e_down = rel_err(saved.ye, ref, mag, R * H);
    CHECK_MSG(e_gate < 1e-5 && e_up < 1e-5 && e_down < 1e-5, "forward products: %g %g %g", e_gate, e_up, e_down);
    /* the fp8 layer is not the native one, but close */
    double num = 0, den = 0;
    for (int64_t i = 0; i < N * H; i++) num += (y[i] - yn[i]) * (y[i] - yn[i]), den += yn[i] * yn[i];
    printf("fp8 MoE layer output vs native fp32: relative L2 %.4f\n", sqrt(num / den));
    CHECK_MSG(num > 0 && sqrt(num / den) < 0.15, "relative L2 %g", sqrt(num / den));

    CHECK(fm_moe_backward(&g_be, &d, &w, &g, dx, dtw, dy, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK);
    /* dgrad down and wgrad down from ws->dye, saved.h_act */
    float *qb = fnew(R * H);
    fm_fp8_ref_rows(qa, ws.dye, R, H);
    fm_fp8_ref_blocks(qw, Wd, E, H, I);
    gemm_nn(ref, qa, qw, off, E, I, H, mag);
    const double e_dact = rel_err(ws.dact, ref, mag, R * I);
    fm_fp8_ref_cols_grouped(qa, ws.dye, off, E, H);
    fm_fp8_ref_cols_grouped(qb, saved.h_act, off, E, I);
    gemm_tn(ref, qa, qb, off, E, I, H, mag);
    const double e_gd = rel_err(gd, ref, mag, EIH);
    /* wgrad gate / up from ws->dh_gate, dh_up and saved.xe */
    fm_fp8_ref_cols_grouped(qb, saved.xe, off, E, H);
    fm_fp8_ref_cols_grouped(qa, ws.dh_gate, off, E, I);
    gemm_tn(ref, qa, qb, off, E, H, I, mag);
    const double e_gg = rel_err(gg, ref, mag, EIH);
    fm_fp8_ref_cols_grouped(qa, ws.dh_up, off, E, I);
    gemm_tn(ref, qa, qb, off, E, H, I, mag);
    const double e_gu = rel_err(gu, ref, mag, EIH);
    /* dgrad gate + up: dxe = q(dh_gate) q(Wg) + q(dh_up) q(Wu) */
    double *ref2 = dnew(R * H), *mag2 = dnew(R * H);
    fm_fp8_ref_rows(qa, ws.dh_gate, R, I);
    fm_fp8_ref_blocks(qw, Wg, E, I, H);
    gemm_nn(ref, qa, qw, off, E, H, I, mag);
    fm_fp8_ref_rows(qa, ws.dh_up, R, I);
    fm_fp8_ref_blocks(qw, Wu, E, I, H);
    gemm_nn(ref2, qa, qw, off, E, H, I, mag2);
    for (int64_t i = 0; i < R * H; i++) ref[i] += ref2[i], mag[i] += mag2[i];
    const double e_dxe = rel_err(ws.dxe, ref, mag, R * H);
    printf("backward product errors: dact %g dW down %g dW gate %g dW up %g dxe %g\n", e_dact, e_gd, e_gg, e_gu, e_dxe);
    CHECK_MSG(e_dact < 1e-5 && e_gd < 1e-5 && e_gg < 1e-5 && e_gu < 1e-5 && e_dxe < 1e-5,
              "backward products: dact %g, dW down %g, dW gate %g, dW up %g, dxe %g", e_dact, e_gd, e_gg, e_gu, e_dxe);
    /* chunked, through the real BLAS: the same outputs and input gradients up to the order of the
     * expert GEMMs' fp32 sums (chunked_close), close weight gradients */
    CHECK(fm_moe_backward(&g_be, &d, &w, &gc, dxc, dtwc, dy, x, idx, tw, N, K, order, NULL, &wsc) == FM_OK);
    chunked_close(&d, &saved, y, yc, dx, dxc, dtw, dtwc, dy, N);
    num = den = 0;
    for (int64_t i = 0; i < EIH; i++) {
        num += fabs((double)gg[i] - ggc[i]) + fabs((double)gu[i] - guc[i]) + fabs((double)gd[i] - gdc[i]);
        den += fabs((double)gg[i]) + fabs((double)gu[i]) + fabs((double)gd[i]);
    }
    CHECK_MSG(den > 0 && num / den < 0.1, "chunked weight grads: relative L1 %g", num / den);
    test_layer_fixed_gemm(&d, &w, x, idx, tw, dy, N, K, order);
    fm_arena_free(&ap); fm_arena_free(&ac); fm_arena_free(&an); fm_arena_free(&hp); fm_arena_free(&hc);
    fm_arena_free(&hn);
    free(Wg); free(Wu); free(Wd); free(x); free(tw); free(y); free(yc); free(yn); free(dy); free(dx); free(dxc);
    free(dtw); free(dtwc); free(gg); free(gu); free(gd); free(ggc); free(guc); free(gdc); free(idx); free(order);
    free(qa); free(qb); free(qw); free(ref); free(ref2); free(mag); free(mag2);
}

int main(void) {
    fm_rng r;
    fm_rng_seed(&r, fm_test_seed(8));
    FM_ASSERT(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    test_e4m3_table();
    test_block_scales(&r);
    test_snr(&r);
    test_layer(&r);
    fm_cpu_backend_free(&g_be);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
