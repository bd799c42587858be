/* Causal grouped-query attention on the CPU, tiled with an online softmax: FlashAttention-2
 * (Dao, arXiv 2307.08691, Algorithm 1 forward and Algorithm 2 backward; FlashAttention 1 is
 * arXiv 2205.14135). Scores live only in one Br x Bc tile per thread, so memory is O(T*hd) per
 * (batch, head) — the inputs and outputs — plus a fixed per-thread scratch, never T x T.
 *
 * Layouts (fm_backend.h): q, out, dq, dout [B,T,nh,hd]; k, v, dk, dv [B,T,nkv,hd]; lse [B,nh,T].
 * Query head h reads kv head h / (nh/nkv). A tile of rows t0..t0+br of head h is a strided
 * matrix (row stride nh*hd or nkv*hd), which cblas_sgemm reads directly; the tile products run
 * in OpenBLAS (single-threaded inside our parallel region, as its OpenMP build does there).
 *
 * Per-thread scratch (fm_cpu_att_scratch_floats), in floats:
 *   S  [Br*Bc]     scores, then probabilities P, then (backward) dS
 *   dP [Br*Bc]     backward only
 *   O  [Br*hd_max] forward output accumulator
 *   m, l, D [Br]   running max, running sum (forward); D = rowsum(dO o O) (backward)
 *
 * Packed documents (kv_start, fm_backend.h): query t of row b sees keys kv_start[b*T+t] .. t.
 * The key tiles of a query tile start at its first row's kv_start (the smallest: the values
 * are non-decreasing in a row) instead of 0, and each row masks the keys before its own start
 * as the causal mask masks those after it; with kv_start NULL every start is 0 and the loops are
 * today's, bit for bit. Work is then the sum over documents of their squared lengths, not T^2.
 *
 * Attention sinks and sliding windows (GPT-OSS; fm_backend.h attention_ext_fwd / _bwd): a
 * window W > 0 moves each query's first key to max(kv_start, t - W + 1) (transformers'
 * sliding_window_overlay, kv > q - W), so the key tiles start there too; a sink logit s_h per
 * head joins the softmax's denominator at the end of the forward (m* = max(m, s_h),
 * l* = l e^(m - m*) + e^(s_h - m*), out = O e^(m - m*) / l*, lse = m* + log l*), so the backward
 * needs nothing new but lse, and the sink's gradient is -sum_t e^(s_h - lse_t) D_t
 * (D_t = dO_t . O_t: the sink column's dS with dP = 0). With no sinks and W = 0 every loop and
 * expression is attention_fwd's / _bwd's, bit for bit.
 *
 * Determinism: forward tasks are (batch, head, query tile), backward tasks (batch, kv head);
 * each output element is written by exactly one task in a fixed order, so results depend
 * neither on the schedule nor on the thread count.
 */
#include "cpu_internal.h"

#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <string.h>

static size_t round16(size_t n) { return (n + 15) & ~(size_t)15; }

/* The tile sizes Br x Bc are the context's (fm_cpu_backend_init_tiles; plan inputs). */
size_t fm_cpu_att_scratch_floats(int64_t max_head_dim, int64_t BR, int64_t BC) {
    return round16((size_t)(BR * BC)) * 2 + round16((size_t)BR * (size_t)max_head_dim) +
           3 * round16((size_t)BR);
}

typedef struct att_ws {
    float *S, *dP, *O, *m, *l, *D;
} att_ws;

static att_ws att_ws_of(const fm_cpu_ctx *c, int tid) {
    const int64_t BR = c->att_br, BC = c->att_bc;
    att_ws w;
    float *p = c->att_scratch + (size_t)tid * c->att_stride;
    w.S = p;
    p += round16((size_t)BR * BC);
    w.dP = p;
    p += round16((size_t)BR * BC);
    w.O = p;
    p += round16((size_t)BR * (size_t)c->max_head_dim);
    w.m = p;
    p += round16(BR);
    w.l = p;
    p += round16(BR);
    w.D = p;
    return w;
}

static void att_check(const fm_cpu_ctx *c, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                      int64_t hd) {
    FM_ASSERT(B >= 0 && T >= 0 && nh >= 1 && nkv >= 1 && hd >= 1);
    FM_ASSERT(nh % nkv == 0);
    FM_ASSERT(hd <= c->max_head_dim);
    FM_ASSERT(nh * hd <= INT_MAX);
}

/* Row-major single-precision GEMM on tiles: C[M,N] = alpha op(A) op(B) + beta C. */
static inline void tile_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                             const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                             float *C, int64_t ldc) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
}

/* First key (row-local index) query t of row b sees: kv_start's value, 0 when NULL; with a
 * sliding window W > 0 at least t - W + 1. */
static inline int64_t kv_first(const int32_t *kv_start, int64_t b, int64_t T, int64_t t, int64_t W) {
    const int64_t f = kv_start ? (int64_t)kv_start[b * T + t] : 0;
    return W > 0 && t - W + 1 > f ? t - W + 1 : f;
}

/* First valid column of row r of the tile (query i0+r, keys j0..j0+bc): its document's start
 * (or its window's) minus j0, at least 0. */
static inline int64_t start_col(const int32_t *kv_start, int64_t b, int64_t T, int64_t i0, int64_t r, int64_t j0,
                                int64_t W) {
    const int64_t c0 = kv_first(kv_start, b, T, i0 + r, W) - j0;
    return c0 > 0 ? c0 : 0;
}

/* Number of valid (causal) key columns of row r of the tile (query i0+r, keys j0..j0+bc). */
static inline int64_t causal_cols(int64_t i0, int64_t r, int64_t j0, int64_t bc) {
    int64_t n = i0 + r - j0 + 1;
    return n < 0 ? 0 : (n > bc ? bc : n);
}

/* Forward, FlashAttention-2 Algorithm 1, one task per (b, h, query tile i):
 *   for key tiles j <= i:  S = scale Q_i K_j^T (masked causally on the diagonal tile);
 *     m' = max(m, rowmax S); P = exp(S - m'); l = l e^(m - m') + rowsum P;
 *       (exp is fm_cpu_exp4, vectorized; rowsum in a fixed lane order)
 *     O = O e^(m - m') + P V_j;  m = m'
 *   out_i = O / l, lse_i = m + log l.
 * Tiles are handed out round-robin (static, 1) to balance the causal triangle. */
static void att_fwd(void *ctx, float *out, float *lse, const float *q, const float *k, const float *v, int64_t B,
                    int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start, const float *sinks,
                    int64_t W) {
    const fm_cpu_ctx *c = ctx;
    const int64_t BR = c->att_br, BC = c->att_bc;
    att_check(c, B, T, nh, nkv, hd);
    const int64_t grp = nh / nkv, ntile = (T + BR - 1) / BR, ntask = B * nh * ntile;
    const int64_t qs = nh * hd, ks = nkv * hd;
    const float scale = (float)(1.0 / sqrt((double)hd));
#pragma omp parallel num_threads(c->threads) if (ntask > 1)
    {
        const att_ws w = att_ws_of(c, omp_get_thread_num());
#pragma omp for schedule(static, 1)
        for (int64_t task = 0; task < ntask; task++) {
            /* Heavy (late) query tiles first, so the round-robin ends with light ones. */
            const int64_t it = ntile - 1 - task % ntile, bh = task / ntile;
            const int64_t b = bh / nh, h = bh % nh, g = h / grp;
            const int64_t i0 = it * BR, br = T - i0 < BR ? T - i0 : BR;
            const float *Qi = q + ((b * T + i0) * nh + h) * hd;
            for (int64_t r = 0; r < br; r++) {
                w.m[r] = -INFINITY;
                w.l[r] = 0.0f;
            }
            memset(w.O, 0, (size_t)(br * hd) * sizeof(float));
            const int64_t jend = i0 + br; /* keys jbeg..jend-1 are visible to some row */
            for (int64_t j0 = kv_first(kv_start, b, T, i0, W); j0 < jend; j0 += BC) {
                const int64_t bc = jend - j0 < BC ? jend - j0 : BC;
                const float *Kj = k + ((b * T + j0) * nkv + g) * hd;
                const float *Vj = v + ((b * T + j0) * nkv + g) * hd;
                tile_gemm(false, true, br, bc, hd, scale, Qi, qs, Kj, ks, 0.0f, w.S, BC);
                for (int64_t r = 0; r < br; r++) {
                    float *s = w.S + r * BC;
                    const int64_t nc = causal_cols(i0, r, j0, bc);
                    const int64_t c0 = start_col(kv_start, b, T, i0, r, j0, W);
                    for (int64_t cc = nc; cc < bc; cc++) s[cc] = 0.0f;
                    if (c0 >= nc) { /* the row sees no key of this tile */
                        for (int64_t cc = 0; cc < nc; cc++) s[cc] = 0.0f;
                        continue;
                    }
                    for (int64_t cc = 0; cc < c0; cc++) s[cc] = 0.0f; /* keys of an earlier document */
                    const float mx = fm_cpu_max(s + c0, nc - c0, w.m[r]);
                    const float sum = fm_cpu_exp_sub_sum(s + c0, s + c0, mx, nc - c0);
                    const float corr = fm_cpu_expf(w.m[r] - mx); /* 0 on the first tile */
                    w.l[r] = w.l[r] * corr + sum;
                    w.m[r] = mx;
                    if (corr != 1.0f) {
                        float *o = w.O + r * hd;
#pragma omp simd
                        for (int64_t d = 0; d < hd; d++) o[d] *= corr;
                    }
                }
                tile_gemm(false, false, br, hd, bc, 1.0f, w.S, BC, Vj, ks, 1.0f, w.O, hd);
            }
            float *lse_i = lse + (b * nh + h) * T + i0;
            for (int64_t r = 0; r < br; r++) {
                const float *o = w.O + r * hd;
                float *dst = out + ((b * T + i0 + r) * nh + h) * hd;
                if (sinks) { /* the sink joins the denominator only */
                    const float sk = sinks[h], mf = w.m[r] > sk ? w.m[r] : sk;
                    const float co = expf(w.m[r] - mf), lf = w.l[r] * co + expf(sk - mf), inv = co / lf;
                    for (int64_t d = 0; d < hd; d++) dst[d] = o[d] * inv;
                    lse_i[r] = mf + logf(lf);
                    continue;
                }
                const float inv = 1.0f / w.l[r];
#pragma omp simd
                for (int64_t d = 0; d < hd; d++) dst[d] = o[d] * inv;
                lse_i[r] = w.m[r] + logf(w.l[r]);
            }
        }
    }
}

/* Backward, FlashAttention-2 Algorithm 2 with the loops swapped for the CPU: one task per
 * (b, kv head g) owns dk, dv of g and dq of every query head of its group, so no two threads
 * write the same gradient and none needs atomics. For each head h of the group and query tile
 * i: D_i = rowsum(dO_i o O_i); for key tiles j <= i, recompute P = exp(scale Q_i K_j^T - lse_i)
 * (masked), then dV_j += P^T dO_i; dP = dO_i V_j^T; dS = P o (dP - D_i);
 * dQ_i += scale dS K_j; dK_j += scale dS^T Q_i. All sums run in a fixed order (h, i, j). */
static void att_bwd(void *ctx, float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                    const float *v, const float *out, const float *lse, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                    int64_t hd, const int32_t *kv_start, int64_t W) {
    const fm_cpu_ctx *c = ctx;
    const int64_t BR = c->att_br, BC = c->att_bc;
    att_check(c, B, T, nh, nkv, hd);
    const int64_t grp = nh / nkv, ntask = B * nkv;
    const int64_t qs = nh * hd, ks = nkv * hd;
    const float scale = (float)(1.0 / sqrt((double)hd));
#pragma omp parallel num_threads(c->threads) if (ntask > 1)
    {
        const att_ws w = att_ws_of(c, omp_get_thread_num());
#pragma omp for schedule(static, 1)
        for (int64_t task = 0; task < ntask; task++) {
            const int64_t b = task / nkv, g = task % nkv;
            for (int64_t t = 0; t < T; t++) {
                memset(dk + ((b * T + t) * nkv + g) * hd, 0, (size_t)hd * sizeof(float));
                memset(dv + ((b * T + t) * nkv + g) * hd, 0, (size_t)hd * sizeof(float));
                memset(dq + ((b * T + t) * nh + g * grp) * hd, 0,
                       (size_t)(grp * hd) * sizeof(float));
            }
            for (int64_t h = g * grp; h < (g + 1) * grp; h++) {
                for (int64_t i0 = 0; i0 < T; i0 += BR) {
                    const int64_t br = T - i0 < BR ? T - i0 : BR;
                    const int64_t qoff = ((b * T + i0) * nh + h) * hd;
                    const float *Qi = q + qoff, *dOi = dout + qoff, *Oi = out + qoff;
                    float *dQi = dq + qoff;
                    const float *lse_i = lse + (b * nh + h) * T + i0;
                    for (int64_t r = 0; r < br; r++) {
                        const float *a = dOi + r * qs, *o = Oi + r * qs;
                        float s = 0.0f;
                        for (int64_t d = 0; d < hd; d++) s += a[d] * o[d];
                        w.D[r] = s;
                    }
                    const int64_t jend = i0 + br;
                    for (int64_t j0 = kv_first(kv_start, b, T, i0, W); j0 < jend; j0 += BC) {
                        const int64_t bc = jend - j0 < BC ? jend - j0 : BC;
                        const int64_t koff = ((b * T + j0) * nkv + g) * hd;
                        const float *Kj = k + koff, *Vj = v + koff;
                        float *dKj = dk + koff, *dVj = dv + koff;
                        tile_gemm(false, true, br, bc, hd, scale, Qi, qs, Kj, ks, 0.0f, w.S, BC);
                        for (int64_t r = 0; r < br; r++) {
                            float *s = w.S + r * BC;
                            const int64_t nc = causal_cols(i0, r, j0, bc);
                            const int64_t c0 = start_col(kv_start, b, T, i0, r, j0, W);
                            if (c0 < nc) fm_cpu_exp_sub_sum(s + c0, s + c0, lse_i[r], nc - c0);
                            for (int64_t cc = 0; cc < c0 && cc < bc; cc++) s[cc] = 0.0f;
                            for (int64_t cc = nc > c0 ? nc : c0; cc < bc; cc++) s[cc] = 0.0f;
                        }
                        tile_gemm(true, false, bc, hd, br, 1.0f, w.S, BC, dOi, qs, 1.0f, dVj, ks);
                        tile_gemm(false, true, br, bc, hd, 1.0f, dOi, qs, Vj, ks, 0.0f, w.dP, BC);
                        for (int64_t r = 0; r < br; r++) {
                            float *s = w.S + r * BC;
                            const float *dp = w.dP + r * BC, Dr = w.D[r];
#pragma omp simd
                            for (int64_t cc = 0; cc < bc; cc++) s[cc] = s[cc] * (dp[cc] - Dr);
                        }
                        tile_gemm(false, false, br, hd, bc, scale, w.S, BC, Kj, ks, 1.0f, dQi, qs);
                        tile_gemm(true, false, bc, hd, br, scale, w.S, BC, Qi, qs, 1.0f, dKj, ks);
                    }
                }
            }
        }
    }
}

void fm_cpu_attention_fwd(void *ctx, float *out, float *lse, const float *q, const float *k, const float *v, int64_t B,
                          int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start) {
    att_fwd(ctx, out, lse, q, k, v, B, T, nh, nkv, hd, kv_start, NULL, 0);
}

void fm_cpu_attention_bwd(void *ctx, float *dq, float *dk, float *dv, const float *dout, const float *q,
                          const float *k, const float *v, const float *out, const float *lse, int64_t B, int64_t T,
                          int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start) {
    att_bwd(ctx, dq, dk, dv, dout, q, k, v, out, lse, B, T, nh, nkv, hd, kv_start, 0);
}

void fm_cpu_attention_ext_fwd(void *ctx, float *out, float *lse, const float *q, const float *k, const float *v,
                              int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start,
                              const float *sinks, int64_t window) {
    FM_ASSERT(window >= 0);
    att_fwd(ctx, out, lse, q, k, v, B, T, nh, nkv, hd, kv_start, sinks, window);
}

/* dsinks[h] += -sum over (b, t) of e^(sinks[h] - lse[b,h,t]) (dO . O)[b,t,h], in double, b then
 * t ascending; one task per head. */
static void sinks_grad(const fm_cpu_ctx *c, float *dsinks, const float *dout, const float *out, const float *lse,
                       const float *sinks, int64_t B, int64_t T, int64_t nh, int64_t hd) {
#pragma omp parallel for num_threads(c->threads) schedule(static) if (nh > 1 && B * T * hd >= 4096)
    for (int64_t h = 0; h < nh; h++) {
        double acc = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) {
                const float *a = dout + ((b * T + t) * nh + h) * hd, *o = out + ((b * T + t) * nh + h) * hd;
                double D = 0;
                for (int64_t d = 0; d < hd; d++) D += (double)a[d] * o[d];
                acc += exp((double)sinks[h] - lse[(b * nh + h) * T + t]) * D;
            }
        dsinks[h] += (float)-acc;
    }
}

void fm_cpu_attention_ext_bwd(void *ctx, float *dq, float *dk, float *dv, float *dsinks, const float *dout,
                              const float *q, const float *k, const float *v, const float *out, const float *lse,
                              int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start,
                              const float *sinks, int64_t window) {
    FM_ASSERT(window >= 0);
    att_bwd(ctx, dq, dk, dv, dout, q, k, v, out, lse, B, T, nh, nkv, hd, kv_start, window);
    if (sinks && dsinks) sinks_grad(ctx, dsinks, dout, out, lse, sinks, B, T, nh, hd);
}
