/* The CPU backend (DESIGN.md §3): fp32, C11 + OpenMP + BLAS. This file holds the op table,
 * init/free, and the dense ops: gemm, add, sumsq, embedding, RMSNorm, RoPE, SwiGLU, softmax
 * cross-entropy, AdamW. Attention is in cpu_attention.c, router and MoE permutation in
 * cpu_moe.c, row gather/scatter in cpu_rows.c.
 *
 * Conventions (fm_backend.h): activation gradients are assigned, parameter gradients
 * accumulate. Ops never allocate: the only scratch (attention tiles) is sized at init. Every
 * parallel region runs on the context's thread count (num_threads), whatever OpenMP's default.
 * exp is the vectorized fm_cpu_exp4 (cpu_internal.h) in the hot loops (SwiGLU, cross-entropy).
 * Determinism: see cpu_internal.h — every output element is computed by one thread in a fixed
 * order, and double reductions use fixed chunks, so results do not depend on the thread count.
 */
#include "cpu_internal.h"

#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* Declared by OpenBLAS's cblas.h; repeated so other BLAS headers also compile. */
void openblas_set_num_threads(int num_threads);

/* Below this many elements an elementwise op runs on one thread (fork/join costs ~1 us). */
#define FM_CPU_PAR_MIN 8192

static inline int cpu_threads(void *ctx) { return ((const fm_cpu_ctx *)ctx)->threads; }

/* ---- dense linear algebra -------------------------------------------------------------- */

/* C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, row-major with row strides lda/ldb/ldc
 * (fm_backend.h). cblas_sgemm (OpenBLAS, which splits C, never K, among its threads, so the
 * result is deterministic). beta == 0 overwrites C even where it held NaN (BLAS semantics); a
 * K == 0 product is handled here because BLAS rejects lda = 0. */
static void cpu_gemm(void *ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                     float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
                     float beta, void *Cv, fm_dtype c_type, int64_t ldc) {
    (void)ctx;
    FM_ASSERT(c_type == FM_DTYPE_F32); /* fm_act is fp32 on the CPU: every C is fp32 */
    float *C = Cv;
    FM_ASSERT(M >= 0 && N >= 0 && K >= 0);
    if (M == 0 || N == 0) return;
    FM_ASSERT(ldc >= N);
    if (K == 0 || alpha == 0.0f) {
        for (int64_t i = 0; i < M; i++) {
            float *c = C + i * ldc;
            for (int64_t j = 0; j < N; j++) c[j] = beta == 0.0f ? 0.0f : beta * c[j];
        }
        return;
    }
    FM_ASSERT(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N));
    FM_ASSERT(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX &&
              ldc <= INT_MAX);
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K, alpha, A, (int)lda, B,
                (int)ldb, beta, C, (int)ldc);
}

/* ---- elementwise / reductions ---------------------------------------------------------- */

/* y[i] += x[i], i < n. */
static void cpu_add(void *ctx, float *y, const float *x, int64_t n) {
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (n >= FM_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

/* Sum of squares of x[0..n) in double: FM_CPU_RED_CHUNKS fixed contiguous chunks, each summed
 * in four interleaved lanes combined as (l0+l1)+(l2+l3), then the chunk sums added in order.
 * The same bits for any thread count and any alignment of x. */
static void cpu_sumsq(void *ctx, double *out, const float *x, int64_t n, bool accumulate) {
    double part[FM_CPU_RED_CHUNKS];
    const int64_t chunk = (n + FM_CPU_RED_CHUNKS - 1) / FM_CPU_RED_CHUNKS;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (n >= 65536)
    for (int ci = 0; ci < FM_CPU_RED_CHUNKS; ci++) {
        int64_t lo = ci * chunk, hi = lo + chunk < n ? lo + chunk : n;
        double l0 = 0, l1 = 0, l2 = 0, l3 = 0;
        int64_t i = lo;
        for (; i + 4 <= hi; i += 4) {
            double a = x[i], b = x[i + 1], c = x[i + 2], d = x[i + 3];
            l0 += a * a;
            l1 += b * b;
            l2 += c * c;
            l3 += d * d;
        }
        for (; i < hi; i++) l0 += (double)x[i] * x[i];
        part[ci] = (l0 + l1) + (l2 + l3);
    }
    double s = 0;
    for (int ci = 0; ci < FM_CPU_RED_CHUNKS; ci++) s += part[ci];
    *out = accumulate ? *out + s : s;
}

/* ---- embedding -------------------------------------------------------------------------- */

/* out[n,:] = wte[tokens[n],:]. out [N,H], tokens [N] in [0,V) (not checked against V, which
 * the op does not receive; negative ids are asserted), wte [V,H]. A row copy per token. */
static void cpu_embedding_fwd(void *ctx, float *out, const int32_t *tokens, const float *wte,
                              int64_t N, int64_t H) {
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (N * H >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        FM_ASSERT(tokens[n] >= 0);
        memcpy(out + n * H, wte + (int64_t)tokens[n] * H, (size_t)H * sizeof(float));
    }
}

/* dwte[tokens[n],:] += dout[n,:] (accumulated; dwte [V,H], dout [N,H]). Deterministic without
 * atomics: threads own blocks of 64 hidden columns and each loops the tokens in order n = 0..N-1,
 * so every dwte element sums its tokens in increasing n whatever the thread count. */
static void cpu_embedding_bwd(void *ctx, float *dwte, const float *dout, const int32_t *tokens,
                              int64_t N, int64_t H) {
    const int64_t CB = 64, nblk = (H + CB - 1) / CB;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (N * H >= FM_CPU_PAR_MIN)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t j0 = blk * CB, j1 = j0 + CB < H ? j0 + CB : H;
        for (int64_t n = 0; n < N; n++) {
            FM_ASSERT(tokens[n] >= 0);
            float *dw = dwte + (int64_t)tokens[n] * H;
            const float *g = dout + n * H;
            for (int64_t j = j0; j < j1; j++) dw[j] += g[j];
        }
    }
}

/* ---- RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467) ---------------------------------- */

/* out [N,D] = x * rstd * w with rstd [N] = 1/sqrt(mean(x^2) + eps) (the mean in double); x [N,D],
 * w [D]. One row per iteration. */
static void cpu_rmsnorm_fwd(void *ctx, float *out, float *rstd, const float *x, const float *w,
                            int64_t N, int64_t D, float eps) {
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (N * D >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * D;
        float *o = out + n * D;
        double ss = 0;
        for (int64_t j = 0; j < D; j++) ss += (double)xr[j] * xr[j];
        const float r = (float)(1.0 / sqrt(ss / (double)D + (double)eps));
        rstd[n] = r;
        for (int64_t j = 0; j < D; j++) o[j] = xr[j] * r * w[j];
    }
}

/* dx [N,D] assigned, dw [D] accumulated. With y_j = x_j r w_j and r = (mean(x^2)+eps)^(-1/2):
 *   dx_j = r w_j g_j - x_j r^3 (sum_i g_i w_i x_i) / D,   dw_j += sum_n g_nj x_nj r_n.
 * dx: parallel over rows. dw: parallel over blocks of 64 columns, each summing its rows in order
 * n = 0..N-1 in double (deterministic, no cross-thread reduction). */
static void cpu_rmsnorm_bwd(void *ctx, float *dx, float *dw, const float *dout, const float *x,
                            const float *w, const float *rstd, int64_t N, int64_t D) {
    const int nt = cpu_threads(ctx);
#pragma omp parallel for num_threads(nt) schedule(static) if (N * D >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * D, *g = dout + n * D;
        float *d = dx + n * D;
        double dot = 0;
        for (int64_t j = 0; j < D; j++) dot += (double)g[j] * w[j] * xr[j];
        const double r = rstd[n];
        const float a = (float)r, c = (float)(r * r * r * dot / (double)D);
        for (int64_t j = 0; j < D; j++) d[j] = a * w[j] * g[j] - c * xr[j];
    }
    enum { CB = 64 };
    const int64_t nblk = (D + CB - 1) / CB;
#pragma omp parallel for num_threads(nt) schedule(static) if (N * D >= FM_CPU_PAR_MIN)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t j0 = blk * CB, nj = j0 + CB < D ? CB : D - j0;
        double acc[CB];
        for (int64_t j = 0; j < nj; j++) acc[j] = 0;
        for (int64_t n = 0; n < N; n++) {
            const float *xr = x + n * D + j0, *g = dout + n * D + j0;
            const double r = rstd[n];
            for (int64_t j = 0; j < nj; j++) acc[j] += (double)g[j] * xr[j] * r;
        }
        for (int64_t j = 0; j < nj; j++) dw[j0 + j] += (float)acc[j];
    }
}

/* ---- rotary position embedding (Su et al. 2021, arXiv 2104.09864), rotate_half layout ---- */

/* Rotates each pair (x[i], x[i+rd/2]), i < rd/2, of each head of x [B,T,nh,hd] in place by the
 * angle of token t (dims rd .. hd-1 untouched: partial rotary): forward (c, s) = (cos, sin)
 * tables [T_max, rd/2]; backward applies the transpose, i.e. the same loop with s negated. */
static void rope_apply(int nt, float *x, const float *cos_tab, const float *sin_tab, int64_t B,
                       int64_t T, int64_t nh, int64_t hd, int64_t rd, const int32_t *pos, float sign) {
    FM_ASSERT(rd % 2 == 0 && rd >= 2 && rd <= hd);
    const int64_t half = rd / 2, BT = B * T;
#pragma omp parallel for num_threads(nt) schedule(static) if (BT * nh * hd >= FM_CPU_PAR_MIN)
    for (int64_t bt = 0; bt < BT; bt++) {
        const int64_t t = pos ? (int64_t)pos[bt] : bt % T; /* packed documents: its own position */
        const float *ct = cos_tab + t * half, *st = sin_tab + t * half;
        for (int64_t h = 0; h < nh; h++) {
            float *a = x + (bt * nh + h) * hd, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                const float c = ct[i], s = sign * st[i], x0 = a[i], x1 = b[i];
                a[i] = x0 * c - x1 * s;
                b[i] = x1 * c + x0 * s;
            }
        }
    }
}

/* In place on x [B,T,nh,hd]: (x[i], x[i+rd/2]) <- (x[i] c - x[i+rd/2] s, x[i+rd/2] c + x[i] s), i < rd/2. */
static void cpu_rope_fwd(void *ctx, float *x, const float *cos_tab, const float *sin_tab,
                         int64_t B, int64_t T, int64_t nh, int64_t hd, int64_t rd, const int32_t *pos) {
    rope_apply(cpu_threads(ctx), x, cos_tab, sin_tab, B, T, nh, hd, rd, pos, 1.0f);
}

/* In place on dx [B,T,nh,hd]: the transpose rotation (dx[i] c + dx[i+rd/2] s,
 * dx[i+rd/2] c - dx[i] s), exact for any tables (not only c^2 + s^2 = 1). */
static void cpu_rope_bwd(void *ctx, float *dx, const float *cos_tab, const float *sin_tab,
                         int64_t B, int64_t T, int64_t nh, int64_t hd, int64_t rd, const int32_t *pos) {
    rope_apply(cpu_threads(ctx), dx, cos_tab, sin_tab, B, T, nh, hd, rd, pos, -1.0f);
}

/* ---- biases of linear layers ---------------------------------------------------------------- */

/* y[n,j] += b[j]. */
static void cpu_bias_add(void *ctx, float *y, const float *b, int64_t N, int64_t D) {
    const int nt = cpu_threads(ctx);
#pragma omp parallel for num_threads(nt) schedule(static) if (N * D >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < D; j++) y[n * D + j] += b[j];
}

/* db[j] += sum_n dy[n,j], each column summed in double over n in order (threads split the
 * columns: the same bits for any thread count). */
static void cpu_bias_grad(void *ctx, float *db, const float *dy, int64_t N, int64_t D) {
    const int nt = cpu_threads(ctx);
    enum { CB = 64 };
    const int64_t nblk = (D + CB - 1) / CB;
#pragma omp parallel for num_threads(nt) schedule(static) if (N * D >= FM_CPU_PAR_MIN)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t j0 = blk * CB, nj = D - j0 < CB ? D - j0 : CB;
        double acc[CB] = {0};
        for (int64_t n = 0; n < N; n++) {
            const float *g = dy + n * D + j0;
            for (int64_t j = 0; j < nj; j++) acc[j] += (double)g[j];
        }
        for (int64_t j = 0; j < nj; j++) db[j0 + j] += (float)acc[j];
    }
}

/* ---- SwiGLU (Shazeer 2020, arXiv 2002.05202) -------------------------------------------- */

/* sigmoid(g) for 4 lanes: 1 / (1 + exp(-g)) with fm_cpu_exp4 (exp(-g) saturates at 1.65e38
 * for g < -88, giving ~6e-39, and is 0 for g > 87.3, giving exactly 1). */
static inline fm_cpu_v4f sigmoid4(fm_cpu_v4f g) {
    return fm_cpu_v4f_splat(1.0f) / (fm_cpu_v4f_splat(1.0f) + fm_cpu_exp4(-g));
}

/* Loads n < 4 floats into the low lanes of a vector (the rest 0). */
static inline fm_cpu_v4f load_part(const float *x, int64_t n) {
    fm_cpu_v4f v = fm_cpu_v4f_splat(0.0f);
    for (int64_t j = 0; j < n; j++) v[j] = x[j];
    return v;
}

/* out = silu(gate) * up, silu(g) = g * sigmoid(g); n elements each. Vectorized in blocks of 4
 * (each element's value does not depend on its position). */
void fm_cpu_swiglu_fwd(void *ctx, float *out, const float *gate, const float *up, int64_t n) {
    const int64_t nv = (n + 3) / 4;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (n >= FM_CPU_PAR_MIN)
    for (int64_t b = 0; b < nv; b++) {
        const int64_t i = 4 * b, c = n - i < 4 ? n - i : 4;
        fm_cpu_v4f g, u;
        if (c == 4) {
            memcpy(&g, gate + i, sizeof g);
            memcpy(&u, up + i, sizeof u);
        } else {
            g = load_part(gate + i, c);
            u = load_part(up + i, c);
        }
        const fm_cpu_v4f o = g * sigmoid4(g) * u;
        for (int64_t j = 0; j < c; j++) out[i + j] = o[j];
    }
}

/* dgate = dout * up * s * (1 + g (1 - s)), dup = dout * g * s with s = sigmoid(g); assigned. */
void fm_cpu_swiglu_bwd(void *ctx, float *dgate, float *dup, const float *dout,
                       const float *gate, const float *up, int64_t n) {
    const int64_t nv = (n + 3) / 4;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (n >= FM_CPU_PAR_MIN)
    for (int64_t b = 0; b < nv; b++) {
        const int64_t i = 4 * b, c = n - i < 4 ? n - i : 4;
        fm_cpu_v4f g, u, d;
        if (c == 4) {
            memcpy(&g, gate + i, sizeof g);
            memcpy(&u, up + i, sizeof u);
            memcpy(&d, dout + i, sizeof d);
        } else {
            g = load_part(gate + i, c);
            u = load_part(up + i, c);
            d = load_part(dout + i, c);
        }
        const fm_cpu_v4f s = sigmoid4(g), one = fm_cpu_v4f_splat(1.0f);
        const fm_cpu_v4f dg = d * u * s * (one + g * (one - s)), du = d * g * s;
        for (int64_t j = 0; j < c; j++) {
            dgate[i + j] = dg[j];
            dup[i + j] = du[j];
        }
    }
}

/* ---- loss -------------------------------------------------------------------------------- */

/* Softmax cross-entropy over logits [N,V] (fm_backend.h). Per row, stable: m = max,
 * e_i = exp(l_i - m) (fm_cpu_exp4) summed in blocks of 256 (fixed lane order within a block,
 * blocks added in double), lse = m + log s, loss = lse - l[target]; the e_i are stored in
 * dlogits and turned into grad_scale * (e_i / s - onehot) in place. Every element is read
 * before it is written, so dlogits may alias logits; dlogits may also be NULL (loss only).
 * *sum = the sum of loss over non-ignored rows, added in row order. */
static void cpu_cross_entropy(void *ctx, float *loss, float *dlogits, const float *logits,
                              const int32_t *targets, int64_t N, int64_t V, float grad_scale,
                              int32_t ignore_index, double *sum_out) {
    enum { BLK = 256 };
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (N * V >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *row = logits + n * V;
        float *drow = dlogits ? dlogits + n * V : NULL;
        const int32_t t = targets[n];
        if (t == ignore_index) {
            loss[n] = 0.0f;
            if (drow) memset(drow, 0, (size_t)V * sizeof(float));
            continue;
        }
        FM_ASSERT(t >= 0 && t < V);
        const float m = fm_cpu_max(row, V, row[0]), xt = row[t];
        double s = 0;
        for (int64_t i0 = 0; i0 < V; i0 += BLK)
            s += fm_cpu_exp_sub_sum(drow ? drow + i0 : NULL, row + i0, m,
                                    V - i0 < BLK ? V - i0 : BLK);
        loss[n] = (float)((double)m + log(s) - (double)xt);
        if (!drow) continue;
        const float inv = (float)(1.0 / s), pt = drow[t] * inv;
#pragma omp simd
        for (int64_t i = 0; i < V; i++) drow[i] = grad_scale * (drow[i] * inv);
        drow[t] = grad_scale * (pt - 1.0f);
    }
    double sum = 0;
    for (int64_t n = 0; n < N; n++)
        if (targets[n] != ignore_index) sum += loss[n];
    *sum_out = sum;
}

/* ---- optimizer --------------------------------------------------------------------------- */

/* AdamW (Loshchilov & Hutter 2019, arXiv 1711.05101, Algorithm 2) over n elements, in place:
 * g' = g * grad_scale; m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'^2;
 * p -= lr * ((m/bc1) / (sqrt(v/bc2) + eps) + wd * p), with bc1, bc2 from the caller. */
static void cpu_adamw(void *ctx, float *p, const float *g, float *master, void *mv_m, void *mv_v, fm_dtype mv_dtype,
                      int64_t n, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                      float grad_scale) {
    float *w = master ? master : p; /* fp32 weights are their own master */
    const bool half = mv_dtype == FM_DTYPE_BF16;
    float *m = mv_m, *v = mv_v;
    uint16_t *mh = mv_m, *vh = mv_v;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (n >= FM_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i] * grad_scale;
        const float m0 = half ? fm_bf16_to_f32(mh[i]) : m[i], v0 = half ? fm_bf16_to_f32(vh[i]) : v[i];
        const float mi = b1 * m0 + (1.0f - b1) * gi;
        const float vi = b2 * v0 + (1.0f - b2) * gi * gi;
        if (half) {
            mh[i] = fm_f32_to_bf16(mi);
            vh[i] = fm_f32_to_bf16(vi);
        } else {
            m[i] = mi;
            v[i] = vi;
        }
        w[i] -= lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + wd * w[i]);
        if (master) p[i] = w[i];
    }
}

/* AdamW on bf16-valued weights, Kahan-compensated (comp) or stochastically rounded (comp NULL):
 * fm_backend.h's adamw_bf16w, the recipes of fm_adamw_lowp.h (Zamirai et al. 2020). p holds
 * bf16 values widened to fp32. */
static void cpu_adamw_bf16w(void *ctx, float *p, const float *g, uint16_t *comp, void *mv_m, void *mv_v,
                            fm_dtype mv_dtype, int64_t n, float lr, float b1, float b2, float eps, float wd, float bc1,
                            float bc2, float grad_scale, uint64_t sr_key, int64_t idx0) {
    const bool half = mv_dtype == FM_DTYPE_BF16;
    float *m = mv_m, *v = mv_v;
    uint16_t *mh = mv_m, *vh = mv_v;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (n >= FM_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i] * grad_scale;
        const float m0 = half ? fm_bf16_to_f32(mh[i]) : m[i], v0 = half ? fm_bf16_to_f32(vh[i]) : v[i];
        const float mi = b1 * m0 + (1.0f - b1) * gi;
        const float vi = b2 * v0 + (1.0f - b2) * gi * gi;
        if (half) {
            mh[i] = fm_f32_to_bf16(mi);
            vh[i] = fm_f32_to_bf16(vi);
        } else {
            m[i] = mi;
            v[i] = vi;
        }
        const float w = fm_bf16_to_f32(fm_f32_to_bf16(p[i]));
        const float d = -(lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + wd * w));
        if (comp) {
            const float c = fm_bf16_to_f32(comp[i]) + d;
            const float wn = fm_bf16_to_f32(fm_f32_to_bf16(w + c));
            comp[i] = fm_f32_to_bf16(c - (wn - w));
            p[i] = wn;
        } else {
            const float x = w + d;
            uint32_t u;
            memcpy(&u, &x, sizeof u);
            p[i] = fm_bf16_to_f32(fm_sr_round_bits(u, fm_sr_bits(sr_key, idx0 + i)));
        }
    }
}

/* ---- memory: host memory on the CPU backend -------------------------------------------------- */

static void *cpu_mem_alloc(void *ctx, size_t bytes) {
    (void)ctx;
    return fm_malloc(bytes);
}

static void cpu_mem_free(void *ctx, void *p) {
    (void)ctx;
    fm_free(p);
}

/* The whole pages inside [p, p + bytes) dropped (madvise MADV_DONTNEED: private anonymous pages
 * read as zeros when touched again); the partial pages at the ends stay. */
static size_t cpu_mem_release(void *ctx, void *p, size_t bytes) {
    (void)ctx;
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = ((uintptr_t)p + pg - 1) & ~(pg - 1), b = ((uintptr_t)p + bytes) & ~(pg - 1);
    if (!p || b <= a || madvise((void *)a, b - a, MADV_DONTNEED) != 0) return 0;
    return (size_t)(b - a);
}

static bool cpu_mem_restore(void *ctx, void *p, size_t bytes) {
    (void)ctx;
    memset(p, 0, bytes);
    return true;
}

static void cpu_mem_set(void *ctx, void *dst, int byte, size_t bytes) {
    (void)ctx;
    memset(dst, byte, bytes);
}

static void cpu_copy(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind) {
    (void)kind;
    ((fm_cpu_ctx *)ctx)->host_syncs++; /* synchronous: a sync on a device */
    if (dst != src && bytes) memmove(dst, src, bytes);
}

static void cpu_convert(void *ctx, void *dst, fm_dtype dst_type, const void *src, fm_dtype src_type, int64_t n) {
    (void)ctx;
    FM_ASSERT(dst_type == FM_DTYPE_F32 && src_type == FM_DTYPE_F32); /* the CPU has no other type */
    if (dst != src && n) memmove(dst, src, sizeof(float) * (size_t)n);
}

/* Buffers: every kind is host memory on the CPU. */
static void *cpu_buffer_alloc(void *ctx, fm_buffer_kind kind, size_t bytes) {
    (void)ctx;
    (void)kind;
    return fm_malloc(bytes);
}

static void cpu_buffer_free(void *ctx, fm_buffer_kind kind, void *p) {
    (void)ctx;
    (void)kind;
    fm_free(p);
}

/* Streams and events: every op has completed when it returns, so a copy is a copy, an event is
 * always reached and waiting is free; the waits are counted as on a device (host_sync_count). */
static void cpu_copy_async(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind, fm_stream stream) {
    (void)ctx;
    (void)kind;
    FM_ASSERT(stream >= 0 && stream < FM_STREAM_COUNT);
    if (dst != src && bytes) memmove(dst, src, bytes);
}

static void cpu_event_record(void *ctx, int event, fm_stream stream) {
    (void)ctx;
    FM_ASSERT(event >= 0 && event < FM_EVENT_POOL && stream >= 0 && stream < FM_STREAM_COUNT);
}

static void cpu_event_wait(void *ctx, fm_stream stream, int event) {
    (void)ctx;
    FM_ASSERT(event >= 0 && event < FM_EVENT_POOL && stream >= 0 && stream < FM_STREAM_COUNT);
}

static void cpu_event_sync(void *ctx, int event) {
    FM_ASSERT(event >= 0 && event < FM_EVENT_POOL);
    ((fm_cpu_ctx *)ctx)->host_syncs++;
}

static void cpu_stream_sync(void *ctx, fm_stream stream) {
    FM_ASSERT(stream >= 0 && stream < FM_STREAM_COUNT);
    ((fm_cpu_ctx *)ctx)->host_syncs++;
}

static void cpu_set_op_stream(void *ctx, fm_stream stream) {
    (void)ctx;
    FM_ASSERT(stream == FM_STREAM_COMPUTE || stream == FM_STREAM_UPDATE);
}

static void cpu_sync(void *ctx) { ((fm_cpu_ctx *)ctx)->host_syncs++; }
static uint64_t cpu_host_sync_count(void *ctx) { return ((fm_cpu_ctx *)ctx)->host_syncs; }
static fm_status cpu_status(void *ctx) {
    (void)ctx;
    return FM_OK; /* CPU ops cannot fail at run time: their argument checks are asserts */
}

/* ---- the table, init, free ---------------------------------------------------------------- */

/* ---- profiling (wall clock) ------------------------------------------------------------------ */

static double cpu_now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void cpu_prof_mark(void *ctx, fm_phase phase) {
    fm_cpu_ctx *c = ctx;
    if (!c->prof_on) return;
    const double t = cpu_now_s();
    c->prof_acc[c->prof_phase] += t - c->prof_last;
    c->prof_last = t;
    c->prof_phase = (int)phase;
}

static bool cpu_prof_collect(void *ctx, double *ms) {
    fm_cpu_ctx *c = ctx;
    if (!c->prof_on) return false;
    cpu_prof_mark(ctx, (fm_phase)c->prof_phase);
    for (int i = 0; i < FM_PHASE_COUNT; i++) {
        ms[i] = 1e3 * c->prof_acc[i];
        c->prof_acc[i] = 0;
    }
    return true;
}

static const fm_ops fm_cpu_ops = {
    .name = "cpu",
    .host_memory = true,
    .gemm = cpu_gemm,
    .add = cpu_add,
    .sumsq = cpu_sumsq,
    .embedding_fwd = cpu_embedding_fwd,
    .embedding_bwd = cpu_embedding_bwd,
    .rmsnorm_fwd = cpu_rmsnorm_fwd,
    .rmsnorm_bwd = cpu_rmsnorm_bwd,
    .rope_fwd = cpu_rope_fwd,
    .rope_bwd = cpu_rope_bwd,
    .bias_add = cpu_bias_add,
    .bias_grad = cpu_bias_grad,
    .attention_fwd = fm_cpu_attention_fwd,
    .attention_bwd = fm_cpu_attention_bwd,
    .swiglu_fwd = fm_cpu_swiglu_fwd,
    .swiglu_bwd = fm_cpu_swiglu_bwd,
    .attention_ext_fwd = fm_cpu_attention_ext_fwd,
    .attention_ext_bwd = fm_cpu_attention_ext_bwd,
    .swiglu_clamp_fwd = fm_cpu_swiglu_clamp_fwd,
    .swiglu_clamp_bwd = fm_cpu_swiglu_clamp_bwd,
    .bias_add_f32 = fm_cpu_bias_add_f32,
    .quant_fp8_rows = fm_cpu_quant_fp8_rows, /* cpu_fp8.c */
    .quant_fp8_blocks = fm_cpu_quant_fp8_blocks,
    .quant_fp8_cols_grouped = fm_cpu_quant_fp8_cols_grouped,
    .expert_fp8_serves = fm_cpu_expert_fp8_serves, /* cpu_fp8_gemm.c */
    .fp8_quant_weight = fm_cpu_fp8_quant_weight,
    .fp8_quant_rows = fm_cpu_fp8_quant_rows,
    .fp8_quant_tokens = fm_cpu_fp8_quant_tokens,
    .expert_fp8_gemm = fm_cpu_expert_fp8_gemm,
    .fp8_quant_dual = fm_cpu_fp8_quant_dual,
    .fp8_swiglu_bwd_quant = fm_cpu_fp8_swiglu_bwd_quant,
    .fp8_swiglu_fwd_quant = fm_cpu_fp8_swiglu_fwd_quant,
    .router_fwd = fm_cpu_router_fwd,
    .router_bwd = fm_cpu_router_bwd,
    .router_stats = fm_cpu_router_stats,
    .router_loss_terms = fm_cpu_router_loss_terms,
    .router_aux_grad = fm_cpu_router_aux_grad,
    .router_force = fm_cpu_router_force,
    .router_sigmoid_fwd = fm_cpu_router_sigmoid_fwd,
    .router_sigmoid_bwd = fm_cpu_router_sigmoid_bwd,
    .router_replay = fm_cpu_router_replay,
    .router_softmax_group_fwd = fm_cpu_router_softmax_group_fwd,
    .router_softmax_group_bwd = fm_cpu_router_softmax_group_bwd,
    .router_seq_aux_fwd = fm_cpu_router_seq_aux_fwd,
    .router_seq_aux_bwd = fm_cpu_router_seq_aux_bwd,
    .moe_route_index = fm_cpu_moe_route_index,
    .moe_gather = fm_cpu_moe_gather,
    .moe_gather_bwd = fm_cpu_moe_gather_bwd,
    .moe_combine_fwd = fm_cpu_moe_combine_fwd,
    .moe_combine_bwd = fm_cpu_moe_combine_bwd,
    .gather_rows = fm_cpu_gather_rows,
    .scatter_rows = fm_cpu_scatter_rows,
    .head_slice = fm_cpu_head_slice, /* cpu_slice.c */
    .cross_entropy = cpu_cross_entropy,
    .adamw = cpu_adamw,
    .adamw_bf16w = cpu_adamw_bf16w,
    .mem_alloc = cpu_mem_alloc,
    .mem_release = cpu_mem_release,
    .mem_restore = cpu_mem_restore,
    .mem_free = cpu_mem_free,
    .mem_set = cpu_mem_set,
    .copy = cpu_copy,
    .convert = cpu_convert,
    .sync = cpu_sync,
    .status = cpu_status,
    .host_sync_count = cpu_host_sync_count,
    .buffer_alloc = cpu_buffer_alloc,
    .buffer_free = cpu_buffer_free,
    .copy_async = cpu_copy_async,
    .event_record = cpu_event_record,
    .event_wait = cpu_event_wait,
    .event_sync = cpu_event_sync,
    .stream_sync = cpu_stream_sync,
    .set_op_stream = cpu_set_op_stream,
    .lce_fold = fm_cpu_lce_fold,
    .lce_finalize = fm_cpu_lce_finalize,
    .lce_strip_grad = fm_cpu_lce_strip_grad,
    .lce_strip_grad_ent = fm_cpu_lce_strip_grad_ent,
    .lce_topk_fold = fm_cpu_lce_topk_fold,
    .lce_topk_finalize = fm_cpu_lce_topk_finalize,
    .prof_mark = cpu_prof_mark,
    .prof_collect = cpu_prof_collect,
};

/* Threads a context created with `threads` runs on (0: OpenMP's current default). */
static int cpu_resolve_threads(int threads) {
    int t = threads > 0 ? threads : omp_get_max_threads();
    return t > 0 ? t : 1;
}

size_t fm_cpu_backend_scratch_bytes_tiles(int threads, int64_t max_head_dim, int64_t tile_q, int64_t tile_kv) {
    if (threads < 0 || max_head_dim < 1 || tile_q < 1 || tile_kv < 1) return 0;
    return (size_t)cpu_resolve_threads(threads) * fm_cpu_att_scratch_floats(max_head_dim, tile_q, tile_kv) *
           sizeof(float);
}

size_t fm_cpu_backend_scratch_bytes(int threads, int64_t max_head_dim) {
    return fm_cpu_backend_scratch_bytes_tiles(threads, max_head_dim, FM_CPU_ATT_BR, FM_CPU_ATT_BC);
}

/* The one init: every fm_cpu_backend_init* comes here. */
static fm_status cpu_init(fm_backend *b, int threads, int64_t max_head_dim, int64_t tile_q, int64_t tile_kv,
                          bool profile) {
    if (!b) return fm_error(FM_ERR_ARG, "fm_cpu_backend_init: backend pointer is NULL");
    b->ops = NULL;
    b->ctx = NULL;
    if (threads < 0)
        return fm_error(FM_ERR_ARG,
                        "cpu backend: threads must be >= 0 (0 = OpenMP default), got %d", threads);
    if (max_head_dim < 1)
        return fm_error(FM_ERR_ARG, "cpu backend: max_head_dim must be >= 1, got %lld",
                        (long long)max_head_dim);
    if (tile_q < 1 || tile_kv < 1 || tile_q > 4096 || tile_kv > 4096)
        return fm_error(FM_ERR_ARG, "--attention-tile %lldx%lld: each side must be in [1, 4096]", (long long)tile_q,
                        (long long)tile_kv);
    if (threads > 0) {
        omp_set_num_threads(threads);
        openblas_set_num_threads(threads);
    }
    fm_cpu_ctx *c = fm_malloc(sizeof *c);
    if (!c) return fm_error(FM_ERR_NOMEM, "cpu backend: cannot allocate the context (%zu bytes)",
                            sizeof *c);
    c->threads = cpu_resolve_threads(threads);
    c->max_head_dim = max_head_dim;
    c->att_br = tile_q;
    c->att_bc = tile_kv;
    c->att_stride = fm_cpu_att_scratch_floats(max_head_dim, tile_q, tile_kv);
    c->prof_on = profile;
    c->fp8_codes = false; /* fm_cpu_backend_init_opts sets it from the options */
    c->prof_phase = FM_PHASE_OTHER;
    c->prof_last = cpu_now_s();
    memset(c->prof_acc, 0, sizeof c->prof_acc);
    const size_t bytes = fm_cpu_backend_scratch_bytes_tiles(c->threads, max_head_dim, tile_q, tile_kv);
    c->att_scratch = fm_malloc(bytes);
    if (!c->att_scratch) {
        const int nt = c->threads;
        fm_free(c);
        return fm_error(FM_ERR_NOMEM,
                        "cpu backend: cannot allocate %zu bytes of attention scratch (%d threads, "
                        "max_head_dim %lld); lower --threads or the head dim",
                        bytes, nt, (long long)max_head_dim);
    }
    b->ops = &fm_cpu_ops;
    b->ctx = c;
    return FM_OK;
}

fm_status fm_cpu_backend_init_opts(fm_backend *b, const fm_backend_opts *o) {
    const fm_backend_opts d = fm_backend_opts_default();
    if (!o) o = &d;
    FM_TRY(cpu_init(b, o->threads, o->max_head_dim, o->tile_q == 0 ? FM_CPU_ATT_BR : o->tile_q,
                    o->tile_kv == 0 ? FM_CPU_ATT_BC : o->tile_kv, o->profile));
    ((fm_cpu_ctx *)b->ctx)->fp8_codes = o->cpu_fp8_codes; /* the test hook FLATMOE_TEST_FP8_CODES=1 */
    return FM_OK;
}

fm_status fm_cpu_backend_init(fm_backend *b, int threads, int64_t max_head_dim) {
    return cpu_init(b, threads, max_head_dim, FM_CPU_ATT_BR, FM_CPU_ATT_BC, false);
}

fm_status fm_cpu_backend_init_tiles(fm_backend *b, int threads, int64_t max_head_dim, int64_t tile_q,
                                    int64_t tile_kv) {
    return cpu_init(b, threads, max_head_dim, tile_q, tile_kv, false);
}

void fm_cpu_backend_free(fm_backend *b) {
    if (!b) return;
    fm_cpu_ctx *c = b->ctx;
    if (c) {
        fm_free(c->att_scratch);
        fm_free(c);
    }
    b->ctx = NULL;
    b->ops = NULL;
}
