/* The FP8 code ops (fm_backend.h "FP8 expert GEMMs on E4M3 codes", backend/fm_fp8_layout.h) on
 * the CPU backend, their layouts' reference, against the emulation (quant_fp8_*, fm_fp8.h):
 * - quantization: every code times its scale equals the emulation's fake-quantized value, bit
 *   for bit (rows operand 1 x 128, weight 128 x 128 with WqT its transpose, tokens operand
 *   128 x 1 per group from token block pblk[e], zero tails); a tile with a NaN: scale NaN, codes
 *   0x7F, the other tiles untouched; rows past offsets[E] not written; tiles of tiny magnitude
 *   (scales below fp32's normal range, amax down to fp32's subnormals) as exact;
 * - the GEMMs: each kind against the fp64 product of the fake-quantized operands, each output
 *   within 1e-5 of its sum of |terms| (fp32 sums in another order), over uneven experts (an
 *   empty one, one with a partial tile, one starting at an odd row); beta 0 does not read C
 *   (C filled with NaN first), beta 1 adds, an empty expert's dW with beta 1 untouched;
 * - the MoE layer with d.fp8_codes against the emulation (plain twin and chunked): outputs within
 *   1e-5 relative L2, every gradient within 1e-3 (a last-bit difference can flip one E4M3
 *   rounding downstream), the working set larger by exactly the code operands' bytes less
 *   dh_gate, dh_up's (the codes path has none), the codes path's buffers written;
 * - the fused quantizations (fp8_quant_dual, fp8_swiglu_bwd_quant, fp8_swiglu_fwd_quant): every
 *   output byte equal to the composed ops' on adversarial groups (empty ones, one holding every
 *   row, odd starts, fewer than 128 rows, non-finite values in a tile), bytes past the written
 *   rows untouched.
 * The operands' rows and columns carry scales 2^-16 apart, so a wrong tiling moves values
 * across E4M3's underflow and fails the bit-exact checks (test_fp8.c explains the trick). */
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "backend/fm_fp8.h"
#include "backend/fm_fp8_layout.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "model/fm_moe_layer.h"

static fm_backend g_be;

/* rows x cols values, row i and column j scaled 2^-16 when i % ri == 0 / j % cj == 0 */
static void fill(fm_rng *r, float *x, int64_t rows, int64_t cols, int ri, int cj, float s) {
    const float t16 = ldexpf(1.0f, -16);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++)
            x[i * cols + j] = (float)fm_rng_normal(r) * s * (i % ri == 1 ? t16 : 1.0f) * (j % cj == 2 ? t16 : 1.0f);
}

static bool same_float(float a, float b) { return (isnan(a) && isnan(b)) || memcmp(&a, &b, 4) == 0; }

/* the number of values where code * scale != want */
static int64_t rows_mismatch(const uint8_t *a8, const float *want, int64_t R, int64_t rcap, int64_t K) {
    const float *s = (const float *)(a8 + fm_fp8_rows_scales_at(rcap, K));
    int64_t bad = 0;
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < K; k++)
            bad += !same_float(fm_e4m3_decode(a8[r * K + k]) * s[(k / 128) * fm_fp8_rpad(rcap) + r], want[r * K + k]);
    return bad;
}

static void pblk_of(int64_t *pblk, const int64_t *off, int64_t E) {
    pblk[0] = 0;
    for (int64_t e = 0; e < E; e++) pblk[e + 1] = pblk[e] + (off[e + 1] - off[e] + 127) / 128;
}

static int64_t tokens_mismatch(const uint8_t *t8, const float *want, const int64_t *off, int64_t E, int64_t rcap,
                               int64_t C, int64_t *tails_bad) {
    const int64_t kcap = fm_fp8_kcap(rcap, E);
    const float *s = (const float *)(t8 + fm_fp8_tokens_scales_at(kcap, C));
    int64_t pblk[65], bad = 0;
    pblk_of(pblk, off, E);
    *tails_bad = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t m = off[e + 1] - off[e];
        for (int64_t c = 0; c < C; c++) {
            for (int64_t t = 0; t < m; t++) {
                const int64_t kb = pblk[e] + t / 128;
                const float v = fm_e4m3_decode(t8[c * kcap + pblk[e] * 128 + t]) * s[kb * C + c];
                bad += !same_float(v, want[(off[e] + t) * C + c]);
            }
            for (int64_t t = m; t < (pblk[e + 1] - pblk[e]) * 128; t++) *tails_bad += t8[c * kcap + pblk[e] * 128 + t] != 0;
        }
    }
    return bad;
}

enum { E = 5, H = 256, I = 128 };
static const int64_t g_off[E + 1] = {0, 201, 202, 202, 330, 457}; /* m = 201, 1 (odd start next), 0, 128, 127 */

static void test_quant(fm_rng *r) {
    const int64_t R = g_off[E], rcap = R + 7, K = H;
    float *x = fnew(rcap * K), *fq = fnew(rcap * K);
    fill(r, x, R, K, 3, 4, 1.0f);
    x[5 * K + 130] = NAN; /* row 5's second tile */
    uint8_t *a8 = malloc((size_t)fm_fp8_rows_bytes(rcap, K));
    FM_ASSERT(a8);
    memset(a8, 0xAB, (size_t)fm_fp8_rows_bytes(rcap, K));
    g_be.ops->fp8_quant_rows(g_be.ctx, a8, x, g_off, rcap, E, K);
    g_be.ops->quant_fp8_rows(g_be.ctx, fq, x, R, K);
    CHECK_MSG(rows_mismatch(a8, fq, R, rcap, K) == 0, "rows: %lld values differ", (long long)rows_mismatch(a8, fq, R, rcap, K));
    const float *sr = (const float *)(a8 + fm_fp8_rows_scales_at(rcap, K));
    CHECK(isnan(sr[1 * fm_fp8_rpad(rcap) + 5]) && a8[5 * K + 128] == 0x7F && a8[5 * K + 255] == 0x7F);
    CHECK(!isnan(sr[5]) && a8[5 * K + 3] != 0x7F); /* row 5's first tile as usual */
    CHECK(a8[R * K] == 0xAB && a8[(rcap - 1) * K + K - 1] == 0xAB); /* rows past offsets[E]: not written */
    x[5 * K + 130] = 1.0f;

    /* weight: [E, out = I, in = H] */
    const int64_t out = I, in = H, EW = E * out * in;
    float *W = fnew(EW), *Wf = fnew(EW);
    fill(r, W, E * out, in, 4, 5, 0.05f);
    uint8_t *w8 = malloc((size_t)fm_fp8_weight_bytes(E, out, in));
    FM_ASSERT(w8);
    g_be.ops->fp8_quant_weight(g_be.ctx, w8, W, E, out, in);
    g_be.ops->quant_fp8_blocks(g_be.ctx, Wf, W, E, out, in);
    const uint8_t *WqT = w8 + fm_fp8_weight_t_at(E, out, in);
    const float *sW = (const float *)(w8 + fm_fp8_weight_scales_at(E, out, in));
    int64_t bad = 0, tbad = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t n = 0; n < out; n++)
            for (int64_t k = 0; k < in; k++) {
                const int64_t i = (e * out + n) * in + k;
                bad += !same_float(fm_e4m3_decode(w8[i]) * sW[(e * (out / 128) + n / 128) * (in / 128) + k / 128], Wf[i]);
                tbad += WqT[(e * in + k) * out + n] != w8[i];
            }
    CHECK_MSG(bad == 0 && tbad == 0, "weight: %lld values differ, %lld transposed codes differ", (long long)bad,
              (long long)tbad);

    /* tokens: x [R, C] per group */
    const int64_t C = H;
    uint8_t *t8 = malloc((size_t)fm_fp8_tokens_bytes(fm_fp8_kcap(rcap, E), C));
    FM_ASSERT(t8);
    memset(t8, 0xCD, (size_t)fm_fp8_tokens_bytes(fm_fp8_kcap(rcap, E), C));
    g_be.ops->fp8_quant_tokens(g_be.ctx, t8, x, g_off, rcap, E, C);
    g_be.ops->quant_fp8_cols_grouped(g_be.ctx, fq, x, g_off, E, C);
    int64_t tails;
    bad = tokens_mismatch(t8, fq, g_off, E, rcap, C, &tails);
    CHECK_MSG(bad == 0 && tails == 0, "tokens: %lld values differ, %lld tail codes not zero", (long long)bad,
              (long long)tails);
    free(x), free(fq), free(a8), free(W), free(Wf), free(w8), free(t8);
}

/* Tiles of tiny magnitude (fp32 amax from 2^-100 down to fp32's subnormals, 2^-149): the block
 * scale 2^e with e below fp32's normal range (-126; down to -157 for a subnormal amax). Every
 * code times its scale must still be the emulation's value bit for bit (a scale built as a
 * normal fp32 from e's bits is garbage there). */
static void test_tiny_scales(fm_rng *r) {
    enum { TR = 12 };
    static const int mag[TR] = {-100, -118, -122, -126, -128, -132, -136, -140, -144, -147, -149, -152};
    const int64_t K = 256, rcap = TR;
    const int64_t off[2] = {0, TR};
    float *x = fnew(rcap * K), *fq = fnew(rcap * K);
    for (int64_t i = 0; i < TR; i++)
        for (int64_t k = 0; k < K; k++) x[i * K + k] = ldexpf((float)fm_rng_normal(r), mag[i]);
    for (int64_t k = 0; k < K; k += 2) x[(TR - 2) * K + k] = ldexpf(k % 4 ? 1.0f : -1.0f, -149); /* 0 or +-2^-149 */
    uint8_t *a8 = malloc((size_t)fm_fp8_rows_bytes(rcap, K)), *t8 = malloc((size_t)fm_fp8_tokens_bytes(fm_fp8_kcap(rcap, 1), K));
    FM_ASSERT(a8 && t8);
    g_be.ops->fp8_quant_rows(g_be.ctx, a8, x, off, rcap, 1, K);
    g_be.ops->quant_fp8_rows(g_be.ctx, fq, x, TR, K);
    const int64_t rbad = rows_mismatch(a8, fq, TR, rcap, K);
    CHECK_MSG(rbad == 0, "tiny rows tiles: %lld values differ", (long long)rbad);
    /* tokens: one group of TR tokens; the 128 x 1 tiles mix the magnitudes, so scale the
     * channels instead: channel c's tokens all at 2^mag[c % TR] */
    for (int64_t i = 0; i < TR; i++)
        for (int64_t k = 0; k < K; k++) x[i * K + k] = ldexpf((float)fm_rng_normal(r), mag[k % TR]);
    g_be.ops->fp8_quant_tokens(g_be.ctx, t8, x, off, rcap, 1, K);
    g_be.ops->quant_fp8_cols_grouped(g_be.ctx, fq, x, off, 1, K);
    int64_t tails;
    const int64_t tbad = tokens_mismatch(t8, fq, off, 1, rcap, K, &tails);
    CHECK_MSG(tbad == 0 && tails == 0, "tiny token tiles: %lld values differ", (long long)tbad);
    /* weight: E = TR matrices of one 128 x 128 block each, matrix e at 2^mag[e] */
    const int64_t EW = TR * 128 * 128;
    float *W = fnew(EW), *Wf = fnew(EW);
    for (int64_t i = 0; i < EW; i++) W[i] = ldexpf((float)fm_rng_normal(r), mag[i / (128 * 128)]);
    uint8_t *w8 = malloc((size_t)fm_fp8_weight_bytes(TR, 128, 128));
    FM_ASSERT(w8);
    g_be.ops->fp8_quant_weight(g_be.ctx, w8, W, TR, 128, 128);
    g_be.ops->quant_fp8_blocks(g_be.ctx, Wf, W, TR, 128, 128);
    const float *sW = (const float *)(w8 + fm_fp8_weight_scales_at(TR, 128, 128));
    int64_t wbad = 0;
    for (int64_t i = 0; i < EW; i++) wbad += !same_float(fm_e4m3_decode(w8[i]) * sW[i / (128 * 128)], Wf[i]);
    CHECK_MSG(wbad == 0, "tiny weight blocks: %lld values differ", (long long)wbad);
    free(x), free(fq), free(a8), free(t8), free(W), free(Wf), free(w8);
}

/* ---- the fused quantizations against the ops they compose ---- */

/* n bytes of a fresh buffer preset to byte b */
static uint8_t *bytes_of(int64_t n, int b) {
    uint8_t *p = malloc((size_t)n);
    FM_ASSERT(p);
    memset(p, b, (size_t)n);
    return p;
}

/* The number of differing bytes (and the first), over n. */
static int64_t bytes_differ(const void *a, const void *b, int64_t n, int64_t *first) {
    const uint8_t *x = a, *y = b;
    int64_t d = 0;
    *first = -1;
    for (int64_t i = 0; i < n; i++)
        if (x[i] != y[i]) d += 1, *first = *first < 0 ? i : *first;
    return d;
}

#define SAME_BYTES(what, got, want, n)                                                                                 \
    do {                                                                                                               \
        int64_t first_;                                                                                                \
        const int64_t d_ = bytes_differ(got, want, n, &first_);                                                        \
        CHECK_MSG(d_ == 0, "%s (case %s): %lld of %lld bytes differ, the first at %lld", what, name, (long long)d_,     \
                  (long long)(n), (long long)first_);                                                                  \
    } while (0)

/* One set of groups: dual over K = 256 columns, the SwiGLU pair over I = 256; rcap = rows + 5. */
static void fused_case(fm_rng *r, const char *name, const int64_t *off, int64_t Eg) {
    const int64_t R = off[Eg], rcap = R + 5, C = 256, kcap = fm_fp8_kcap(rcap, Eg);
    const int64_t nr = fm_fp8_rows_bytes(rcap, C), nt = fm_fp8_tokens_bytes(kcap, C);
    float *a = fnew(rcap * C), *g = fnew(rcap * C), *u = fnew(rcap * C), *dg = fnew(rcap * C), *du = fnew(rcap * C);
    fill(r, a, R, C, 3, 5, 1.0f);
    fill(r, g, R, C, 7, 3, 4.0f);
    fill(r, u, R, C, 2, 7, 1.0f);
    if (R > 3) { /* non-finite values: a NaN in one tile, an inf in another; SwiGLU saturating */
        a[2 * C + 7] = NAN, a[(R - 1) * C + 200] = INFINITY;
        u[1 * C + 130] = NAN, g[3 * C + 5] = -INFINITY, g[(R - 2) * C + 140] = 1e30f;
        g[(R / 2) * C + 3] = -100.0f, g[(R / 2) * C + 4] = 100.0f; /* sigmoid exactly 0 and 1 */
    }
    /* fp8_quant_dual = fp8_quant_rows + fp8_quant_tokens */
    uint8_t *q0 = bytes_of(nr, 0xAB), *t0 = bytes_of(nt, 0xCD), *q1 = bytes_of(nr, 0xAB), *t1 = bytes_of(nt, 0xCD);
    g_be.ops->fp8_quant_rows(g_be.ctx, q0, a, off, rcap, Eg, C);
    g_be.ops->fp8_quant_tokens(g_be.ctx, t0, a, off, rcap, Eg, C);
    g_be.ops->fp8_quant_dual(g_be.ctx, q1, t1, a, off, rcap, Eg, C);
    SAME_BYTES("fp8_quant_dual rows operand", q1, q0, nr);
    SAME_BYTES("fp8_quant_dual tokens operand", t1, t0, nt);
    /* fp8_swiglu_bwd_quant = swiglu_bwd + the four quantizations (a as dout) */
    uint8_t *q2 = bytes_of(nr, 0xAB), *t2 = bytes_of(nt, 0xCD), *q3 = bytes_of(nr, 0xAB), *t3 = bytes_of(nt, 0xCD);
    g_be.ops->swiglu_bwd(g_be.ctx, dg, du, a, g, u, R * C);
    g_be.ops->fp8_quant_rows(g_be.ctx, q0, dg, off, rcap, Eg, C);
    g_be.ops->fp8_quant_tokens(g_be.ctx, t0, dg, off, rcap, Eg, C);
    g_be.ops->fp8_quant_rows(g_be.ctx, q1, du, off, rcap, Eg, C);
    g_be.ops->fp8_quant_tokens(g_be.ctx, t1, du, off, rcap, Eg, C);
    g_be.ops->fp8_swiglu_bwd_quant(g_be.ctx, q2, q3, t2, t3, a, g, u, off, rcap, Eg, C);
    SAME_BYTES("fp8_swiglu_bwd_quant dgate rows operand", q2, q0, nr);
    SAME_BYTES("fp8_swiglu_bwd_quant dgate tokens operand", t2, t0, nt);
    SAME_BYTES("fp8_swiglu_bwd_quant dup rows operand", q3, q1, nr);
    SAME_BYTES("fp8_swiglu_bwd_quant dup tokens operand", t3, t1, nt);
    /* fp8_swiglu_fwd_quant = swiglu_fwd + fp8_quant_rows; rows past offsets[E] of out untouched */
    memset(q0, 0xAB, (size_t)nr), memset(q1, 0xAB, (size_t)nr);
    for (int64_t i = 0; i < rcap * C; i++) dg[i] = du[i] = -7.0f;
    g_be.ops->swiglu_fwd(g_be.ctx, dg, g, u, R * C);
    g_be.ops->fp8_quant_rows(g_be.ctx, q0, dg, off, rcap, Eg, C);
    g_be.ops->fp8_swiglu_fwd_quant(g_be.ctx, du, q1, g, u, off, rcap, Eg, C);
    SAME_BYTES("fp8_swiglu_fwd_quant out", du, dg, rcap * C * (int64_t)sizeof(float));
    SAME_BYTES("fp8_swiglu_fwd_quant rows operand", q1, q0, nr);
    free(a), free(g), free(u), free(dg), free(du);
    free(q0), free(t0), free(q1), free(t1), free(q2), free(t2), free(q3), free(t3);
}

static void test_fused(fm_rng *r) {
    static const int64_t all[5] = {0, 0, 300, 300, 300};          /* one group holds every row */
    static const int64_t one[2] = {0, 77};                        /* E = 1, fewer rows than a tile */
    static const int64_t tiny[4] = {0, 1, 2, 3};                  /* one row a group */
    static const int64_t edge[5] = {0, 0, 129, 129, 385};         /* empty first, 128 + 1, 256 from an odd start */
    fused_case(r, "uneven", g_off, E);
    fused_case(r, "one group holds every row", all, 4);
    fused_case(r, "E 1, 77 rows", one, 1);
    fused_case(r, "a row a group", tiny, 3);
    fused_case(r, "empty first, 129, 256", edge, 4);
}

/* fp64 references over fake-quantized operands: kind 0 y = a W^T, 1 dx = a W, 2 dW = a^T b */
static void ref_product(int kind, double *y, double *mag, const float *a, const float *b, const int64_t *off,
                        int64_t in, int64_t out) {
    for (int64_t e = 0; e < E; e++) {
        const float *We = b + e * out * in;
        for (int64_t r = off[e]; r < off[e + 1]; r++) {
            if (kind == 0)
                for (int64_t n = 0; n < out; n++) {
                    double s = 0, m = 0;
                    for (int64_t k = 0; k < in; k++) s += (double)a[r * in + k] * We[n * in + k], m += fabs((double)a[r * in + k] * We[n * in + k]);
                    y[r * out + n] = s, mag[r * out + n] = m;
                }
            else if (kind == 1)
                for (int64_t n = 0; n < in; n++) {
                    double s = 0, m = 0;
                    for (int64_t k = 0; k < out; k++) s += (double)a[r * out + k] * We[k * in + n], m += fabs((double)a[r * out + k] * We[k * in + n]);
                    y[r * in + n] = s, mag[r * in + n] = m;
                }
        }
        if (kind == 2)
            for (int64_t m0 = 0; m0 < out; m0++)
                for (int64_t n = 0; n < in; n++) {
                    double s = 0, m = 0;
                    for (int64_t r = off[e]; r < off[e + 1]; r++) s += (double)a[r * out + m0] * b[r * in + n], m += fabs((double)a[r * out + m0] * b[r * in + n]);
                    y[(e * out + m0) * in + n] = s, mag[(e * out + m0) * in + n] = m;
                }
    }
}

/* max over outputs of |got - (base + ref)| / (|base| + mag) */
static double rel_err(const float *got, const float *base, const double *ref, const double *mag, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) {
        const double b = base ? base[i] : 0.0, want = b + ref[i], m = fabs(b) + mag[i];
        const double err = fabs((double)got[i] - want);
        d = fmax(d, isnan(got[i]) ? INFINITY : (m > 0 ? err / m : err));
    }
    return d;
}

static void test_gemms(fm_rng *r) {
    const int64_t R = g_off[E], rcap = R + 3, kcap = fm_fp8_kcap(rcap, E), in = H, out = I, EW = E * out * in;
    float *x = fnew(rcap * in), *dy = fnew(rcap * out), *W = fnew(EW);
    float *qx = fnew(rcap * in), *qdy = fnew(rcap * out), *qW = fnew(EW);
    fill(r, x, R, in, 3, 4, 1.0f);
    fill(r, dy, R, out, 5, 3, 1.0f);
    fill(r, W, E * out, in, 4, 5, 0.05f);
    uint8_t *a8 = malloc((size_t)fm_fp8_rows_bytes(rcap, in)), *w8 = malloc((size_t)fm_fp8_weight_bytes(E, out, in));
    uint8_t *t0 = malloc((size_t)fm_fp8_tokens_bytes(kcap, out)), *t1 = malloc((size_t)fm_fp8_tokens_bytes(kcap, in));
    FM_ASSERT(a8 && w8 && t0 && t1);
    const int64_t big = rcap * in > EW ? rcap * in : EW;
    double *ref = dnew(big), *mag = dnew(big);
    float *C = fnew(big), *base = fnew(big);
    g_be.ops->fp8_quant_weight(g_be.ctx, w8, W, E, out, in);
    g_be.ops->quant_fp8_blocks(g_be.ctx, qW, W, E, out, in);

    /* kind 0: y = x W^T, beta 0 over NaN */
    g_be.ops->fp8_quant_rows(g_be.ctx, a8, x, g_off, rcap, E, in);
    g_be.ops->quant_fp8_rows(g_be.ctx, qx, x, R, in);
    for (int64_t i = 0; i < R * out; i++) C[i] = NAN;
    g_be.ops->expert_fp8_gemm(g_be.ctx, 0, C, 0.0f, a8, w8, g_off, rcap, E, in, out);
    ref_product(0, ref, mag, qx, qW, g_off, in, out);
    const double e0 = rel_err(C, NULL, ref, mag, R * out);

    /* kind 1: dx = beta dx + dy W, beta 0 over NaN, then beta 1 onto a base */
    g_be.ops->fp8_quant_rows(g_be.ctx, a8, dy, g_off, rcap, E, out);
    g_be.ops->quant_fp8_rows(g_be.ctx, qdy, dy, R, out);
    for (int64_t i = 0; i < R * in; i++) C[i] = NAN;
    g_be.ops->expert_fp8_gemm(g_be.ctx, 1, C, 0.0f, a8, w8, g_off, rcap, E, in, out);
    ref_product(1, ref, mag, qdy, qW, g_off, in, out);
    const double e1 = rel_err(C, NULL, ref, mag, R * in);
    fill(r, base, R, in, 7, 7, 1.0f);
    memcpy(C, base, sizeof(float) * (size_t)(R * in));
    g_be.ops->expert_fp8_gemm(g_be.ctx, 1, C, 1.0f, a8, w8, g_off, rcap, E, in, out);
    const double e1b = rel_err(C, base, ref, mag, R * in);

    /* kind 2: dW = dW + dy^T x; empty expert 2 keeps its sentinel */
    g_be.ops->fp8_quant_tokens(g_be.ctx, t0, dy, g_off, rcap, E, out);
    g_be.ops->fp8_quant_tokens(g_be.ctx, t1, x, g_off, rcap, E, in);
    g_be.ops->quant_fp8_cols_grouped(g_be.ctx, qdy, dy, g_off, E, out);
    g_be.ops->quant_fp8_cols_grouped(g_be.ctx, qx, x, g_off, E, in);
    fill(r, base, E * out, in, 7, 7, 1.0f);
    for (int64_t i = 2 * out * in; i < 3 * out * in; i++) base[i] = 12345.0f;
    memcpy(C, base, sizeof(float) * (size_t)EW);
    g_be.ops->expert_fp8_gemm(g_be.ctx, 2, C, 1.0f, t0, t1, g_off, rcap, E, in, out);
    ref_product(2, ref, mag, qdy, qx, g_off, in, out);
    const double e2 = rel_err(C, base, ref, mag, EW);
    bool untouched = true;
    for (int64_t i = 2 * out * in; i < 3 * out * in; i++) untouched = untouched && C[i] == 12345.0f;
    for (int64_t i = 0; i < EW; i++) C[i] = NAN;
    g_be.ops->expert_fp8_gemm(g_be.ctx, 2, C, 0.0f, t0, t1, g_off, rcap, E, in, out);
    const double e2z = rel_err(C, NULL, ref, mag, EW); /* beta 0: the empty expert's dW_e = 0 */
    printf("fp8 code GEMMs vs the emulation's fp64 products: fwd %.3g, dx %.3g / %.3g (beta 1), dW %.3g / %.3g (beta 0)\n",
           e0, e1, e1b, e2, e2z);
    CHECK_MSG(e0 < 1e-5 && e1 < 1e-5 && e1b < 1e-5 && e2 < 1e-5 && e2z < 1e-5, "errors %g %g %g %g %g", e0, e1, e1b, e2, e2z);
    CHECK(untouched);
    free(x), free(dy), free(W), free(qx), free(qdy), free(qW), free(a8), free(w8), free(t0), free(t1);
    free(ref), free(mag), free(C), free(base);
}

/* The code ops on 1 and 2 threads give the same bytes: cpu_fp8_gemm.c splits rows, columns or
 * experts among threads, never a sum, and calls no BLAS, so this holds by construction on every
 * CPU (the whole training run's bits do depend on the thread count, through the BLAS's dense
 * GEMMs: tests/cli_fp8_codes.sh). At sizes where the 2-thread context forks (R * K >= 65536). */
static void test_gemm_threads(fm_rng *r) {
    fm_backend one, two;
    FM_ASSERT(fm_cpu_backend_init(&one, 1, 64) == FM_OK && fm_cpu_backend_init(&two, 2, 64) == FM_OK);
    const fm_backend *be[2] = {&one, &two};
    const int64_t R = g_off[E], rcap = R + 3, kcap = fm_fp8_kcap(rcap, E), in = H, out = I, EW = E * out * in;
    float *x = fnew(rcap * in), *dy = fnew(rcap * out), *W = fnew(EW);
    fill(r, x, R, in, 3, 4, 1.0f);
    fill(r, dy, R, out, 5, 3, 1.0f);
    fill(r, W, E * out, in, 4, 5, 0.05f);
    const int64_t na = fm_fp8_rows_bytes(rcap, in > out ? in : out), nw = fm_fp8_weight_bytes(E, out, in);
    const int64_t n0 = fm_fp8_tokens_bytes(kcap, out), n1 = fm_fp8_tokens_bytes(kcap, in);
    const int64_t big = rcap * in > EW ? rcap * in : EW;
    uint8_t *a8[2], *d8[2], *w8[2], *t0[2], *t1[2];
    float *C[2][3];
    for (int t = 0; t < 2; t++) {
        const fm_ops *o = be[t]->ops;
        void *c = be[t]->ctx;
        a8[t] = calloc((size_t)na, 1), d8[t] = calloc((size_t)na, 1), w8[t] = calloc((size_t)nw, 1);
        t0[t] = calloc((size_t)n0, 1), t1[t] = calloc((size_t)n1, 1);
        FM_ASSERT(a8[t] && d8[t] && w8[t] && t0[t] && t1[t]);
        for (int q = 0; q < 3; q++) C[t][q] = fnew(big);
        o->fp8_quant_weight(c, w8[t], W, E, out, in);
        o->fp8_quant_rows(c, a8[t], x, g_off, rcap, E, in);
        o->fp8_quant_rows(c, d8[t], dy, g_off, rcap, E, out);
        o->fp8_quant_tokens(c, t0[t], dy, g_off, rcap, E, out);
        o->fp8_quant_tokens(c, t1[t], x, g_off, rcap, E, in);
        o->expert_fp8_gemm(c, 0, C[t][0], 0.0f, a8[t], w8[t], g_off, rcap, E, in, out);
        o->expert_fp8_gemm(c, 1, C[t][1], 0.0f, d8[t], w8[t], g_off, rcap, E, in, out);
        o->expert_fp8_gemm(c, 2, C[t][2], 0.0f, t0[t], t1[t], g_off, rcap, E, in, out);
    }
    CHECK_MSG(!memcmp(w8[0], w8[1], (size_t)nw) && !memcmp(a8[0], a8[1], (size_t)na) &&
              !memcmp(d8[0], d8[1], (size_t)na) && !memcmp(t0[0], t0[1], (size_t)n0) &&
              !memcmp(t1[0], t1[1], (size_t)n1), "fp8 code quantization: 1 and 2 threads differ");
    CHECK_MSG(!memcmp(C[0][0], C[1][0], sizeof(float) * (size_t)(R * out)) &&
              !memcmp(C[0][1], C[1][1], sizeof(float) * (size_t)(R * in)) &&
              !memcmp(C[0][2], C[1][2], sizeof(float) * (size_t)EW), "fp8 code GEMMs: 1 and 2 threads differ");
    for (int t = 0; t < 2; t++) {
        free(a8[t]), free(d8[t]), free(w8[t]), free(t0[t]), free(t1[t]);
        for (int q = 0; q < 3; q++) free(C[t][q]);
    }
    free(x), free(dy), free(W);
    fm_cpu_backend_free(&one), fm_cpu_backend_free(&two);
}

static double rel_l2(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), den += (double)b[i] * b[i];
    return den > 0 ? sqrt(num / den) : (num > 0 ? INFINITY : 0);
}

/* The layer over both paths; chunks K (1: the plain twin with saved routes). */
static void test_layer(fm_rng *r, int64_t K) {
    const fm_moe_dims de = {H, I, 4, 2, false, true, false, 0};
    fm_moe_dims dc = de;
    dc.fp8_codes = true;
    const int64_t N = 150, Ex = de.E, EIH = Ex * I * H;
    const bool chunked = K > 1;
    int64_t Kc = 1, c_eff = N;
    if (chunked) fm_moe_chunks(N, (N + K - 1) / K, &Kc, &c_eff);
    fm_moe_dims dn = de; /* the working set without fp8: the codes path adds exactly its operands */
    dn.fp8 = false;
    /* ... less dh_gate, dh_up (fp8_swiglu_bwd_quant codes dgate, dup without storing them) */
    CHECK(fm_moe_ws_bytes(&dc, c_eff, chunked, 4) == fm_moe_ws_bytes(&dn, c_eff, chunked, 4) +
                                                          (size_t)fm_fp8_dev_ws_bytes(de.E, H, I, c_eff * de.k, 64) -
                                                          2 * fm_arena_round((size_t)(c_eff * de.k * I) * 4));
    float *Wg = fnew(EIH), *Wu = fnew(EIH), *Wd = fnew(EIH), *x = fnew(N * H), *tw = fnew(N * 2), *dy = fnew(N * H);
    fill(r, Wg, Ex * I, H, 4, 5, 0.05f);
    fill(r, Wu, Ex * I, H, 4, 5, 0.05f);
    fill(r, Wd, Ex * H, I, 4, 5, 0.05f);
    fill(r, x, N, H, 3, 4, 1.0f);
    fill(r, dy, N, H, 3, 4, 1.0f);
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(N * 2)), *order = malloc(sizeof(int32_t) * (size_t)N);
    FM_ASSERT(idx && order);
    for (int64_t n = 0; n < N; n++) { /* uneven: expert 3 gets no route */
        const int32_t a = n % 5 < 4 ? 0 : 1, b = n % 2 ? 2 : (a == 0 ? 1 : 0);
        idx[n * 2] = a, idx[n * 2 + 1] = b, tw[n * 2] = 0.6f, tw[n * 2 + 1] = 0.4f;
    }
    fm_moe_chunk_order(order, N, Kc);
    float *y[2], *dx[2], *dtw[2], *gg[2], *gu[2], *gd[2];
    bool codes_ran = false;
    for (int p = 0; p < 2; p++) {
        const fm_moe_dims *d = p ? &dc : &de;
        y[p] = fnew(N * H), dx[p] = fnew(N * H), dtw[p] = fnew(N * 2);
        gg[p] = fnew(EIH), gu[p] = fnew(EIH), gd[p] = fnew(EIH);
        fm_arena a, h;
        const size_t bytes = (chunked ? 0 : fm_moe_routes_bytes(d, N, 4)) + fm_moe_ws_bytes(d, c_eff, chunked, 4);
        FM_ASSERT(fm_arena_init(&a, "moe", bytes) == FM_OK);
        FM_ASSERT(fm_arena_init(&h, "host", 2 * fm_moe_routes_host_bytes(d)) == FM_OK);
        fm_moe_routes saved;
        fm_moe_ws ws;
        if (!chunked) fm_moe_routes_layout(&saved, &a, &h, d, N);
        fm_moe_ws_layout(&ws, &a, &h, d, c_eff, chunked);
        CHECK(a.used == a.capacity);
        CHECK(p ? (ws.a8 && ws.t8[1] && ws.a8u && ws.t8[2] && !ws.q_a && !ws.dh_gate && !ws.dh_up)
                : (ws.q_a && !ws.a8 && !ws.a8u && ws.dh_gate && ws.dh_up));
        const fm_moe_weights w = {Wg, Wu, Wd};
        const fm_moe_grads g = {gg[p], gu[p], gd[p]};
        CHECK(fm_moe_forward(&g_be, d, &w, y[p], x, idx, tw, N, Kc, chunked ? order : NULL, chunked ? NULL : &saved, &ws) == FM_OK);
        CHECK(fm_moe_backward(&g_be, d, &w, &g, dx[p], dtw[p], dy, x, idx, tw, N, Kc, chunked ? order : NULL,
                              chunked ? NULL : &saved, &ws) == FM_OK);
        if (p) { /* the codes path ran: gate's weight operand holds block (0, 0)'s scale */
            float amax = 0;
            for (int64_t i = 0; i < 128; i++)
                for (int64_t k = 0; k < 128; k++) amax = fmaxf(amax, fabsf(Wg[i * H + k]));
            const float *sw = (const float *)((const uint8_t *)ws.w8[0] + fm_fp8_weight_scales_at(Ex, I, H));
            codes_ran = sw[0] == fm_fp8_pow2(fm_fp8_scale_exp(amax));
        }
        fm_arena_free(&a), fm_arena_free(&h);
    }
    const double ey = rel_l2(y[1], y[0], N * H), edx = rel_l2(dx[1], dx[0], N * H), edt = rel_l2(dtw[1], dtw[0], N * 2);
    const double eg = rel_l2(gg[1], gg[0], EIH), eu = rel_l2(gu[1], gu[0], EIH), ed = rel_l2(gd[1], gd[0], EIH);
    printf("MoE layer (K = %lld), codes vs emulation, relative L2: y %.3g dx %.3g dtopk_w %.3g dW gate %.3g up %.3g "
           "down %.3g\n", (long long)Kc, ey, edx, edt, eg, eu, ed);
    /* The products agree to fp32 rounding (test_gemms), but a last-bit difference upstream can flip
     * one E4M3 rounding downstream (a 2^-4 step of one term), so the gradients are compared
     * normwise at 1e-3: a wiring error (a wrong operand, buffer or tiling) is O(1) */
    CHECK_MSG(ey < 1e-5 && edx < 1e-3 && edt < 1e-3 && eg < 1e-3 && eu < 1e-3 && ed < 1e-3, "layer K %lld",
              (long long)Kc);
    CHECK(codes_ran);
    for (int p = 0; p < 2; p++) free(y[p]), free(dx[p]), free(dtw[p]), free(gg[p]), free(gu[p]), free(gd[p]);
    free(Wg), free(Wu), free(Wd), free(x), free(tw), free(dy), free(idx), free(order);
}

/* One MoE layer's saved routes and workspace for N tokens of d in their own arenas (*a, *h; the
 * caller frees them), and routes idx/tw [N, 2]: token n to experts n % 4 and (n + 1) % 4, 0.5 each. */
static void open_layer(const fm_moe_dims *d, int64_t N, int32_t *idx, float *tw, fm_arena *a, fm_arena *h,
                       fm_moe_routes *saved, fm_moe_ws *ws) {
    for (int64_t n = 0; n < N; n++) idx[2 * n] = (int32_t)(n % 4), idx[2 * n + 1] = (int32_t)((n + 1) % 4), tw[2 * n] = 0.5f, tw[2 * n + 1] = 0.5f;
    FM_ASSERT(fm_arena_init(a, "moe", fm_moe_routes_bytes(d, N, 4) + fm_moe_ws_bytes(d, N, false, 4)) == FM_OK);
    FM_ASSERT(fm_arena_init(h, "host", 2 * fm_moe_routes_host_bytes(d)) == FM_OK);
    fm_moe_routes_layout(saved, a, h, d, N);
    fm_moe_ws_layout(ws, a, h, d, N, false);
}

/* --fp8-weight-cache's mechanism: two layers' weight codes in one ws; a layer whose codes are
 * fresh is not quantized again (its output uses them even after its weights change), one marked
 * stale is; the other layer's set is its own. */
static void test_cache(fm_rng *r) {
    fm_moe_dims d = {H, I, 4, 2, false, true, true, 2};
    const int64_t N = 40, Ex = d.E, EIH = Ex * I * H;
    float *Wg = fnew(EIH), *Wu = fnew(EIH), *Wd = fnew(EIH), *x = fnew(N * H), *tw = fnew(N * 2);
    float *y0 = fnew(N * H), *y1 = fnew(N * H), *y2 = fnew(N * H), *y3 = fnew(N * H);
    fill(r, Wg, Ex * I, H, 4, 5, 0.05f), fill(r, Wu, Ex * I, H, 4, 5, 0.05f), fill(r, Wd, Ex * H, I, 4, 5, 0.05f);
    fill(r, x, N, H, 3, 4, 1.0f);
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(N * 2));
    FM_ASSERT(idx);
    fm_moe_dims d1 = d;
    d1.fp8_cache_layers = 0;
    CHECK(fm_moe_ws_bytes(&d, N, false, 4) > fm_moe_ws_bytes(&d1, N, false, 4)); /* a second set of weights */
    fm_arena a, h;
    fm_moe_routes saved;
    fm_moe_ws ws;
    open_layer(&d, N, idx, tw, &a, &h, &saved, &ws);
    CHECK(a.used == a.capacity && ws.w8_cache != NULL);
    bool fresh[2] = {false, false};
    ws.w8_fresh = fresh;
    const fm_moe_weights w = {Wg, Wu, Wd};
    ws.w8_layer = 0;
    CHECK(fm_moe_forward(&g_be, &d, &w, y0, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK);
    CHECK(fresh[0] && !fresh[1]);
    for (int64_t i = 0; i < EIH; i++) Wg[i] *= 3.0f; /* the weights change; layer 0's codes do not */
    CHECK(fm_moe_forward(&g_be, &d, &w, y1, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK);
    CHECK(memcmp(y0, y1, sizeof(float) * (size_t)(N * H)) == 0);
    ws.w8_layer = 1; /* layer 1: its own set, quantized from the new weights */
    CHECK(fm_moe_forward(&g_be, &d, &w, y2, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK);
    CHECK(fresh[1] && memcmp(y0, y2, sizeof(float) * (size_t)(N * H)) != 0);
    fresh[0] = fresh[1] = false; /* fm_model_fp8_cache_invalidate */
    ws.w8_layer = 0;
    CHECK(fm_moe_forward(&g_be, &d, &w, y3, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK);
    CHECK(memcmp(y2, y3, sizeof(float) * (size_t)(N * H)) == 0);
    fm_arena_free(&a), fm_arena_free(&h);
    free(Wg), free(Wu), free(Wd), free(x), free(tw), free(y0), free(y1), free(y2), free(y3), free(idx);
}

/* Without the cache, a backward right after its own layer's forward (or recompute) uses the codes
 * that forward made (fm_moe_ws.w8_holds), on either path: planted here by changing the weights
 * between the two, which the backward then must not see (dx bit-identical to the unchanged run's).
 * Each case that must quantize again does see them: another layer's forward between, the trainer's
 * reset (w8_holds = -1), a caller that names no layer (w8_layer -1); a forward always quantizes. */
static void test_reuse(fm_rng *r, bool codes) {
    fm_moe_dims d = {H, I, 4, 2, false, true, codes, 0};
    const int64_t N = 40, Ex = d.E, EIH = Ex * I * H;
    float *Wg = fnew(EIH), *Wg3 = fnew(EIH), *Wu = fnew(EIH), *Wd = fnew(EIH), *x = fnew(N * H), *tw = fnew(N * 2);
    float *dy = fnew(N * H), *y = fnew(N * H), *y3 = fnew(N * H), *dtw = fnew(N * 2);
    float *gg = fnew(EIH), *gu = fnew(EIH), *gd = fnew(EIH), *dx[6];
    fill(r, Wg, Ex * I, H, 4, 5, 0.05f), fill(r, Wu, Ex * I, H, 4, 5, 0.05f), fill(r, Wd, Ex * H, I, 4, 5, 0.05f);
    fill(r, x, N, H, 3, 4, 1.0f), fill(r, dy, N, H, 3, 4, 1.0f);
    for (int64_t i = 0; i < EIH; i++) Wg3[i] = 3.0f * Wg[i];
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(N * 2));
    FM_ASSERT(idx);
    fm_arena a, h;
    fm_moe_routes saved;
    fm_moe_ws ws;
    open_layer(&d, N, idx, tw, &a, &h, &saved, &ws);
    CHECK(ws.w8_cache == NULL && ws.w8_holds == -1 && ws.w8_layer == -1);
    const fm_moe_weights w = {Wg, Wu, Wd}, w3 = {Wg3, Wu, Wd};
    const fm_moe_grads g = {gg, gu, gd};
    /* case c: the backward of layer 0 with the gate weights tripled after (or, c 0, without) its forward */
    for (int c = 0; c < 6; c++) {
        dx[c] = fnew(N * H);
        ws.w8_layer = c == 5 ? -1 : 0;
        CHECK(fm_moe_forward(&g_be, &d, &w, y, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK);
        if (c == 2) { /* another layer's forward between: the set then holds layer 1's codes */
            ws.w8_layer = 1;
            CHECK(fm_moe_forward(&g_be, &d, &w, y3, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK);
            CHECK(ws.w8_holds == 1);
            ws.w8_layer = 0;
            CHECK(fm_moe_forward(&g_be, &d, &w, y, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK); /* layer 0's routes again */
            ws.w8_layer = 1;
            CHECK(fm_moe_forward(&g_be, &d, &w, y3, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK); /* the routes kept: same x */
            ws.w8_layer = 0;
        }
        if (c == 3) ws.w8_holds = -1; /* fm_model_fp8_cache_invalidate */
        memset(gg, 0, sizeof(float) * (size_t)EIH), memset(gu, 0, sizeof(float) * (size_t)EIH);
        memset(gd, 0, sizeof(float) * (size_t)EIH);
        CHECK(fm_moe_backward(&g_be, &d, c == 0 ? &w : &w3, &g, dx[c], dtw, dy, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK);
    }
    const size_t nb = sizeof(float) * (size_t)(N * H);
    CHECK_MSG(memcmp(dx[1], dx[0], nb) == 0, "%s: the backward right after its forward quantized again",
              codes ? "codes" : "emulation");
    CHECK_MSG(memcmp(dx[2], dx[0], nb) != 0 && memcmp(dx[3], dx[0], nb) != 0 && memcmp(dx[5], dx[0], nb) != 0,
              "%s: a backward whose layer's codes were not held used them", codes ? "codes" : "emulation");
    CHECK(memcmp(dx[2], dx[3], nb) == 0 && memcmp(dx[3], dx[5], nb) == 0); /* each quantized the tripled weights */
    /* case 4: the same as 1 (a repeat: reuse is not a one-off) */
    CHECK(memcmp(dx[4], dx[0], nb) == 0);
    /* a forward always quantizes: the tripled weights change y */
    ws.w8_layer = 0;
    CHECK(fm_moe_forward(&g_be, &d, &w, y, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK);
    CHECK(fm_moe_forward(&g_be, &d, &w3, y3, x, idx, tw, N, 1, NULL, &saved, &ws) == FM_OK);
    CHECK(memcmp(y, y3, nb) != 0);
    fm_arena_free(&a), fm_arena_free(&h);
    for (int c = 0; c < 6; c++) free(dx[c]);
    free(Wg), free(Wg3), free(Wu), free(Wd), free(x), free(tw), free(dy), free(y), free(y3), free(dtw);
    free(gg), free(gu), free(gd), free(idx);
}

int main(void) {
    fm_rng r;
    fm_rng_seed(&r, fm_test_seed(14));
    FM_ASSERT(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    CHECK(g_be.ops->expert_fp8_serves && g_be.ops->fp8_quant_rows && g_be.ops->expert_fp8_gemm);
    CHECK(!g_be.ops->expert_fp8_serves(g_be.ctx, E, H, I, 1000)); /* the CPU's path is the emulation */
    { /* the test hook (fm_backend_opts.cpu_fp8_codes, FLATMOE_TEST_FP8_CODES=1 in the CLI): the codes path */
        fm_backend hb;
        fm_backend_opts o = fm_backend_opts_default();
        o.threads = 2, o.max_head_dim = 64, o.cpu_fp8_codes = true;
        FM_ASSERT(fm_cpu_backend_init_opts(&hb, &o) == FM_OK);
        CHECK(hb.ops->expert_fp8_serves(hb.ctx, E, H, I, 1000) && !hb.ops->expert_fp8_serves(hb.ctx, E, 64, I, 1000));
        fm_cpu_backend_free(&hb);
    }
    test_quant(&r);
    test_tiny_scales(&r);
    test_gemms(&r);
    test_layer(&r, 1);
    test_layer(&r, 3);
    test_cache(&r);
    test_fused(&r); /* the tests above see the random stream they saw before it */
    test_reuse(&r, true); /* then, after all of them, the reuse of a layer's weight codes */
    test_reuse(&r, false);
    test_gemm_threads(&r); /* last: the tests above see the random stream they saw before */
    fm_cpu_backend_free(&g_be);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
