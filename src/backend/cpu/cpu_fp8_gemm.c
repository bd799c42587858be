/* The CPU backend's FP8 code ops (fm_backend.h "FP8 expert GEMMs on E4M3 codes"): the reference
 * of backend/fm_fp8_layout.h's byte layouts and of the device kernels' arithmetic, in plain C.
 * Quantization: fm_fp8.h's recipe tile by tile (scale 2^fm_fp8_scale_exp(amax), at least 2^-149: code_exp; code
 * fm_e4m3_encode(x / scale); a tile with a non-finite value: scale NaN, codes 0x7F), so the
 * codes and scales are the bits the CUDA kernels must give. GEMMs: per output element, each
 * 128-deep k-block's sum of decoded code products in fp32, promoted into an fp32 total times the
 * two scales (DeepSeek-V3 §3.3; the order the sm_90 kernel promotes in), one rounding to the
 * output. The training step uses these ops on the CPU only under the test hook FLATMOE_TEST_FP8_CODES=1 (the
 * emulation, cpu_fp8.c, is the CPU's path otherwise): they are the layouts' executable spec.
 * Threads split output rows (or dW's experts' rows), never a sum: the bits do not depend on the
 * thread count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#include "../fm_fp8.h"
#include "../fm_fp8_layout.h"

#define T8 FM_FP8_TILE

static inline int cpu_threads(void *ctx) { return ((const fm_cpu_ctx *)ctx)->threads; }

static float g_dec[256]; /* fm_e4m3_decode of every byte (filled once; pure) */
static int g_dec_ready;
static void dec_init(void) {
    if (g_dec_ready) return;
    for (int b = 0; b < 256; b++) g_dec[b] = fm_e4m3_decode((uint8_t)b);
    g_dec_ready = 1;
}

/* A tile's scale exponent and scale on this path. fm_fp8_scale_exp goes below fp32's normal range
 * for tiny tiles (amax < 448 * 2^-127; down to -157 for a subnormal amax), where fm_fp8_pow2 (a
 * normal fp32 built from e's bits) is garbage: the scale is 2^e through fm_fp8_ldexp instead (an
 * exact fp32 subnormal for e >= -149), and e is raised to -149 below that. Both keep code * scale
 * bit-equal to the emulation's q(x): a tile with e < -149 holds only multiples m 2^-149 with
 * |m| <= 224, and E4M3's rounding of m 2^(-149-e) is its rounding of m, times 2^(-149-e). (The
 * CUDA kernels read bf16, whose amax keeps e >= -141: the same codes and scales.) */
static inline int code_exp(float amax) {
    const int e = fm_fp8_scale_exp(amax);
    return e < -149 ? -149 : e;
}
static inline float code_scale(int e) { return fm_fp8_ldexp(1.0f, e); }

/* One tile: n values at x[i*stride], i < n: their scale, and codes into q[i*qstride]. */
static float quant_tile(uint8_t *q, int64_t qstride, const float *x, int64_t stride, int64_t n) {
    float amax = 0.0f;
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i * stride]);
        if (!(a <= 3.4028235e38f)) bad = 1;
        else if (a > amax) amax = a;
    }
    const int e = code_exp(amax);
    for (int64_t i = 0; i < n; i++) q[i * qstride] = bad ? (uint8_t)0x7F : fm_e4m3_encode(fm_fp8_ldexp(x[i * stride], -e));
    return bad ? NAN : code_scale(e);
}

bool fm_cpu_expert_fp8_serves(void *ctx, int64_t E, int64_t H, int64_t I, int64_t rows_max) {
    return ((const fm_cpu_ctx *)ctx)->fp8_codes && fm_fp8_layer_serves(E, H, I, rows_max);
}

void fm_cpu_fp8_quant_weight(void *ctx, void *w8, const float *W, int64_t E, int64_t out, int64_t in) {
    FM_ASSERT(E >= 1 && out % T8 == 0 && in % T8 == 0);
    uint8_t *Wq = w8, *WqT = (uint8_t *)w8 + fm_fp8_weight_t_at(E, out, in);
    float *sW = (float *)((uint8_t *)w8 + fm_fp8_weight_scales_at(E, out, in));
    const int64_t bo = out / T8, bi = in / T8, nb = E * bo * bi;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (E * out * in >= 65536)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t e = b / (bo * bi), n0 = (b / bi % bo) * T8, k0 = b % bi * T8;
        const float *src = W + (e * out + n0) * in + k0;
        float amax = 0.0f;
        int bad = 0;
        for (int64_t i = 0; i < T8; i++)
            for (int64_t j = 0; j < T8; j++) {
                const float a = fabsf(src[i * in + j]);
                if (!(a <= 3.4028235e38f)) bad = 1;
                else if (a > amax) amax = a;
            }
        const int ex = code_exp(amax);
        for (int64_t i = 0; i < T8; i++)
            for (int64_t j = 0; j < T8; j++) {
                const uint8_t c = bad ? (uint8_t)0x7F : fm_e4m3_encode(fm_fp8_ldexp(src[i * in + j], -ex));
                Wq[(e * out + n0 + i) * in + k0 + j] = c;
                WqT[(e * in + k0 + j) * out + n0 + i] = c;
            }
        sW[b] = bad ? NAN : code_scale(ex); /* b = (e * bo + n-block) * bi + k-block */
    }
}

void fm_cpu_fp8_quant_rows(void *ctx, void *a8, const float *a, const int64_t *offsets, int64_t rcap, int64_t E,
                           int64_t K) {
    const int64_t R = offsets[E], nb = K / T8, rpad = fm_fp8_rpad(rcap);
    FM_ASSERT(K % T8 == 0 && R <= rcap);
    uint8_t *q = a8;
    float *s = (float *)((uint8_t *)a8 + fm_fp8_rows_scales_at(rcap, K));
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (R * K >= 65536)
    for (int64_t r = 0; r < R; r++)
        for (int64_t b = 0; b < nb; b++) s[b * rpad + r] = quant_tile(q + r * K + b * T8, 1, a + r * K + b * T8, 1, T8);
}

/* pblk[e] = sum_{e' < e} ceil(m_e' / 128), e <= E (fm_fp8_layout.h's tokens operand). */
static void token_blocks(int64_t *pblk, const int64_t *offsets, int64_t E) {
    pblk[0] = 0;
    for (int64_t e = 0; e < E; e++) pblk[e + 1] = pblk[e] + (offsets[e + 1] - offsets[e] + T8 - 1) / T8;
}

void fm_cpu_fp8_quant_tokens(void *ctx, void *t8, const float *a, const int64_t *offsets, int64_t rcap, int64_t E,
                             int64_t C) {
    FM_ASSERT(C % T8 == 0 && E >= 1 && E <= 256 && offsets[E] <= rcap);
    const int64_t kcap = fm_fp8_kcap(rcap, E);
    int64_t pblk[257];
    token_blocks(pblk, offsets, E);
    uint8_t *q = t8;
    float *s = (float *)((uint8_t *)t8 + fm_fp8_tokens_scales_at(kcap, C));
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
        for (int64_t b = 0; b * T8 < m; b++) {
            const int64_t t0 = r0 + b * T8, n = m - b * T8 < T8 ? m - b * T8 : T8, kb = pblk[e] + b;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (n * C >= 65536)
            for (int64_t c = 0; c < C; c++) {
                uint8_t *dst = q + c * kcap + kb * T8;
                s[kb * C + c] = quant_tile(dst, 1, a + t0 * C + c, C, n);
                memset(dst + n, 0, (size_t)(T8 - n)); /* the tile's tail: zero codes */
            }
        }
    }
}

/* out = beta * out + v (beta 0: out is not read). */
static inline void store(float *out, float v, float beta) { *out = beta == 0.0f ? v : beta * *out + v; }

void fm_cpu_expert_fp8_gemm(void *ctx, int kind, float *C, float beta, const void *A8, const void *B8,
                            const int64_t *offsets, int64_t rcap, int64_t E, int64_t in, int64_t out) {
    FM_ASSERT(kind >= 0 && kind <= 2 && in % T8 == 0 && out % T8 == 0 && E >= 1 && E <= 256);
    dec_init();
    const uint8_t *a = A8, *b = B8;
    if (kind != 2) {
        /* rows: K = in (kind 0) or out (kind 1); N = out or in */
        const int64_t K = kind == 0 ? in : out, N = kind == 0 ? out : in, nk = K / T8, rpad = fm_fp8_rpad(rcap);
        const float *sa = (const float *)(a + fm_fp8_rows_scales_at(rcap, K));
        const uint8_t *w = kind == 0 ? b : b + fm_fp8_weight_t_at(E, out, in);
        const float *sw = (const float *)(b + fm_fp8_weight_scales_at(E, out, in));
        const int64_t bi = in / T8, bo = out / T8;
        for (int64_t e = 0; e < E; e++) {
            const int64_t r0 = offsets[e], r1 = offsets[e + 1];
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if ((r1 - r0) * N * K >= 65536)
            for (int64_t r = r0; r < r1; r++)
                for (int64_t n = 0; n < N; n++) {
                    const uint8_t *xa = a + r * K, *xb = w + (e * N + n) * K;
                    float fin = 0.0f;
                    for (int64_t kb = 0; kb < nk; kb++) {
                        float acc = 0.0f;
                        for (int64_t k = kb * T8; k < kb * T8 + T8; k++) acc += g_dec[xa[k]] * g_dec[xb[k]];
                        /* W_e's block (n-block, k-block): kind 0 (n / 128, kb); kind 1 reads W_e^T, (kb, n / 128) */
                        const float swb = kind == 0 ? sw[(e * bo + n / T8) * bi + kb] : sw[(e * bo + kb) * bi + n / T8];
                        fin += sa[kb * rpad + r] * swb * acc;
                    }
                    store(C + r * N + n, fin, kind == 0 ? 0.0f : beta); /* kind 0 has no beta (as CUDA) */
                }
        }
        return;
    }
    /* dW_e [out, in] = beta dW_e + sum over e's token tiles */
    const int64_t kcap = fm_fp8_kcap(rcap, E);
    const float *sa = (const float *)(a + fm_fp8_tokens_scales_at(kcap, out));
    const float *sb = (const float *)(b + fm_fp8_tokens_scales_at(kcap, in));
    int64_t pblk[257];
    token_blocks(pblk, offsets, E);
    for (int64_t e = 0; e < E; e++) {
        const int64_t nt = pblk[e + 1] - pblk[e];
        if (nt == 0 && beta == 1.0f) continue; /* no rows: dW_e as it was */
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (out * in * nt * T8 >= 65536)
        for (int64_t m = 0; m < out; m++)
            for (int64_t n = 0; n < in; n++) {
                float fin = 0.0f;
                for (int64_t kb = pblk[e]; kb < pblk[e + 1]; kb++) {
                    const uint8_t *xa = a + m * kcap + kb * T8, *xb = b + n * kcap + kb * T8;
                    float acc = 0.0f;
                    for (int64_t t = 0; t < T8; t++) acc += g_dec[xa[t]] * g_dec[xb[t]];
                    fin += sa[kb * out + m] * sb[kb * in + n] * acc;
                }
                store(C + (e * out + m) * in + n, fin, beta);
            }
    }
}

/* ---- the fused quantizations: the compositions they replace (fm_backend.h) ---- */

void fm_cpu_fp8_quant_dual(void *ctx, void *a8, void *t8, const float *a, const int64_t *offsets, int64_t rcap,
                           int64_t E, int64_t K) {
    fm_cpu_fp8_quant_rows(ctx, a8, a, offsets, rcap, E, K);
    fm_cpu_fp8_quant_tokens(ctx, t8, a, offsets, rcap, E, K);
}

void fm_cpu_fp8_swiglu_fwd_quant(void *ctx, float *out, void *a8, const float *gate, const float *up,
                                 const int64_t *offsets, int64_t rcap, int64_t E, int64_t I) {
    FM_ASSERT(offsets[E] <= rcap);
    fm_cpu_swiglu_fwd(ctx, out, gate, up, offsets[E] * I);
    fm_cpu_fp8_quant_rows(ctx, a8, out, offsets, rcap, E, I);
}

/* swiglu_bwd then the four quantizations, tile by tile (no [R, I] buffer of dgate, dup): each
 * tile's values come from fm_cpu_swiglu_bwd on that tile's inputs (an element's value does not
 * depend on its position), then quant_tile as fp8_quant_rows / fp8_quant_tokens code them. */
void fm_cpu_fp8_swiglu_bwd_quant(void *ctx, void *dg8, void *du8, void *dgT8, void *duT8, const float *dout,
                                 const float *gate, const float *up, const int64_t *offsets, int64_t rcap, int64_t E,
                                 int64_t I) {
    FM_ASSERT(I % T8 == 0 && E >= 1 && E <= 256 && offsets[E] <= rcap);
    const int64_t R = offsets[E], nb = I / T8, rpad = fm_fp8_rpad(rcap), kcap = fm_fp8_kcap(rcap, E);
    uint8_t *qg = dg8, *qu = du8, *tg = dgT8, *tu = duT8;
    float *sg = (float *)(qg + fm_fp8_rows_scales_at(rcap, I)), *su = (float *)(qu + fm_fp8_rows_scales_at(rcap, I));
    float *stg = (float *)(tg + fm_fp8_tokens_scales_at(kcap, I)), *stu = (float *)(tu + fm_fp8_tokens_scales_at(kcap, I));
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (R * I >= 65536)
    for (int64_t r = 0; r < R; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = r * I + b * T8;
            float dg[T8], du[T8];
            fm_cpu_swiglu_bwd(ctx, dg, du, dout + at, gate + at, up + at, T8);
            sg[b * rpad + r] = quant_tile(qg + at, 1, dg, 1, T8);
            su[b * rpad + r] = quant_tile(qu + at, 1, du, 1, T8);
        }
    int64_t pblk[257];
    token_blocks(pblk, offsets, E);
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
        for (int64_t b = 0; b * T8 < m; b++) {
            const int64_t t0 = r0 + b * T8, n = m - b * T8 < T8 ? m - b * T8 : T8, kb = pblk[e] + b;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (n * I >= 65536)
            for (int64_t c = 0; c < I; c++) {
                float d[T8], g[T8], u[T8], dg[T8], du[T8];
                for (int64_t t = 0; t < n; t++) {
                    const int64_t i = (t0 + t) * I + c;
                    d[t] = dout[i], g[t] = gate[i], u[t] = up[i];
                }
                fm_cpu_swiglu_bwd(ctx, dg, du, d, g, u, n);
                uint8_t *dst_g = tg + c * kcap + kb * T8, *dst_u = tu + c * kcap + kb * T8;
                stg[kb * I + c] = quant_tile(dst_g, 1, dg, 1, n);
                stu[kb * I + c] = quant_tile(dst_u, 1, du, 1, n);
                memset(dst_g + n, 0, (size_t)(T8 - n)); /* the tiles' tails: zero codes */
                memset(dst_u + n, 0, (size_t)(T8 - n));
            }
        }
    }
}
