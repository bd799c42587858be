/* The CUDA backend's dense linear algebra (fm_backend.h): gemm through cublasGemmEx, and the
 * grouped expert GEMMs of a dispatch (expert_linear_fwd/bwd) through cublasGemmGroupedBatchedEx,
 * with busy experts in calls of their own.
 *
 * Element types: fm_act is bf16 in this build (FM_ACT_BF16), read here as __nv_bfloat16. Every
 * kernel does its arithmetic in fp32 (fp64 where a comment says so) and rounds to bf16 once, to
 * nearest even, when it stores an fm_act. Every launch goes on the context's stream and is
 * checked; nothing allocates after init. cuBLAS sums in fp32 (CUBLAS_COMPUTE_32F).
 */
#include "cuda_internal.h"
#include "sm90/gg_sm90.h"

#include <climits>
#include <cstdint>

namespace {

/* C[i,j] = beta * C[i,j] (0 when beta == 0, whatever C held): the K == 0 or alpha == 0 gemm. */
template <typename T>
__global__ void scale_c_kernel(T *C, int64_t M, int64_t N, int64_t ldc, float beta) {
    const int64_t total = M * N, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        T *p = C + (e / N) * ldc + e % N;
        const float v = beta == 0.0f ? 0.0f : beta * (float)*p;
        *p = (T)v;
    }
}

/* ---- grouped expert GEMMs -------------------------------------------------------------------- */

/* The device pointer arrays of one grouped call, passed by value (3 KiB of kernel parameters). */
struct group_ptrs {
    const void *a[FM_CUDA_GROUP_MAX];
    const void *b[FM_CUDA_GROUP_MAX];
    void *c[FM_CUDA_GROUP_MAX];
};

/* out[0..n) = A pointers, out[G..G+n) = B, out[2G..2G+n) = C (G = FM_CUDA_GROUP_MAX). Stream
 * order makes the single array safe to refill: the previous call's GEMM has read it. */
__global__ void group_ptrs_kernel(group_ptrs p, int n, const void **out) {
    const int i = threadIdx.x;
    if (i < n) {
        out[i] = p.a[i];
        out[FM_CUDA_GROUP_MAX + i] = p.b[i];
        out[2 * FM_CUDA_GROUP_MAX + i] = p.c[i];
    }
}

/* Up to FM_CUDA_GROUP_MAX row-major products C_g[M_g,N_g] = alpha op(A_g) op(B_g) + beta C_g
 * with shared transposes, row strides, alpha and beta (fm_cuda_gemm's convention per group: the
 * column-major call swaps A and B and M and N), in one cublasGemmGroupedBatchedEx call with one
 * problem per group. Every M_g, N_g, K_g >= 1. */
static void grouped_call(fm_cuda_ctx *c, bool ta, bool tb, int n, const int *M, const int *N, const int *K,
                         float alpha, const group_ptrs &p, int lda, int ldb, float beta, int ldc) {
    const void **dev = reinterpret_cast<const void **>(static_cast<char *>(c->scratch) + FM_CUDA_REDUCE_BYTES);
    group_ptrs_kernel<<<1, FM_CUDA_GROUP_MAX, 0, c->stream>>>(p, n, dev);
    FM_CUDA_LAUNCH_CHECK(c);
    cublasOperation_t op_b[FM_CUDA_GROUP_MAX], op_a[FM_CUDA_GROUP_MAX];
    int lda_a[FM_CUDA_GROUP_MAX], ldb_a[FM_CUDA_GROUP_MAX], ldc_a[FM_CUDA_GROUP_MAX], size[FM_CUDA_GROUP_MAX];
    float al[FM_CUDA_GROUP_MAX], be[FM_CUDA_GROUP_MAX];
    for (int g = 0; g < n; g++) {
        op_b[g] = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
        op_a[g] = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
        lda_a[g] = lda, ldb_a[g] = ldb, ldc_a[g] = ldc, size[g] = 1;
        al[g] = alpha, be[g] = beta;
    }
    FM_CUBLAS_CHECK(c, cublasGemmGroupedBatchedEx(c->cublas, op_b, op_a, N, M, K, al, dev + FM_CUDA_GROUP_MAX,
                                               CUDA_R_16BF, ldb_a, dev, CUDA_R_16BF, lda_a, be,
                                               const_cast<void *const *>(dev + 2 * FM_CUDA_GROUP_MAX),
                                               CUDA_R_16BF, ldc_a, n, size, CUBLAS_COMPUTE_32F));
}

/* Rows from which an expert's product is its own cublasGemmEx call rather than part of the
 * grouped call. Measured on the H200 with OLMoE's shapes (bench/RESULTS.md, 2026-11-29 session
 * 3): at ~512 rows per expert the grouped call runs 1.4x (forward) and 1.2x (backward) the
 * per-expert loop, and a whole 4K step 1.7x; at ~2048 rows the loop's per-shape kernels win
 * (a 16K step's experts 231 ms looped against 327 ms grouped). */
#define FM_CUDA_GROUP_ROWS_MAX 1024
#define FM_CUDA_OWN_CALL_QUANTUM 256

/* The row threshold of the context's expert_gemm option (fm_backend_opts.h): loop 1 (every expert
 * its own call), grouped INT64_MAX (every expert in the grouped call), cublas and auto (which the
 * trainer resolves to sm90 or cublas before creating the backend: plan/fm_expert_choice.h), and
 * sm90 for the shapes its kernel does not serve, FM_CUDA_GROUP_ROWS_MAX. */
static int64_t expert_own_call_rows(const fm_cuda_ctx *c) {
    return c->expert_gemm == FM_EXPERT_GEMM_LOOP      ? 1
           : c->expert_gemm == FM_EXPERT_GEMM_GROUPED ? INT64_MAX
                                                      : FM_CUDA_GROUP_ROWS_MAX;
}

/* One expert product over rows [r, r+mm) of expert e, in fm_cuda_gemm's row-major terms. kind 0:
 * y_e = x_e W_e^T ([mm,in] x [out,in]^T); 1: dx_e = beta dx_e + dy_e W_e ([mm,out] x [out,in]);
 * 2: dW_e += dy_e^T x_e ([mm,out]^T x [mm,in]; B is x and C is dW). Transposes and row strides
 * depend on the kind only. */
struct expert_problem {
    const void *a, *b;
    void *c;
    int64_t M, N, K;
};

static expert_problem expert_rows(int kind, fm_act *C, const fm_act *A, const fm_act *B, int64_t e, int64_t r,
                                  int64_t mm, int64_t in, int64_t out) {
    const fm_act *We = B + e * out * in;
    if (kind == 0) return {A + r * in, We, C + r * out, mm, out, in};
    if (kind == 1) return {A + r * out, We, C + r * in, mm, in, out};
    return {A + r * out, B + r * in, C + e * out * in, out, in, mm};
}

/* The three expert products, one kind per call (expert_rows). An expert with m_e >=
 * expert_own_call_rows(c) rows gets its own fm_cuda_gemm (y, dx: over a multiple of
 * FM_CUDA_OWN_CALL_QUANTUM rows, the rest grouped); the rest go FM_CUDA_GROUP_MAX at a time into
 * grouped calls. */
static void expert_gemm(void *ctx, int kind, fm_act *C, const fm_act *A, const fm_act *B, float beta,
                        const int64_t *off, int64_t E, int64_t in, int64_t out) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(in >= 1 && out >= 1 && in <= INT_MAX && out <= INT_MAX && off[0] == 0);
    const bool ta = kind == 2, tb = kind == 0;
    const int64_t lda = kind == 0 ? in : out, ldb = in, ldc = kind == 0 ? out : in;
    const float cbeta = kind == 0 ? 0.0f : kind == 1 ? beta : 1.0f;
    const int64_t own = expert_own_call_rows(c);
    group_ptrs p;
    int M[FM_CUDA_GROUP_MAX], N[FM_CUDA_GROUP_MAX], K[FM_CUDA_GROUP_MAX];
    int n = 0;
    auto flush = [&]() {
        if (n) grouped_call(c, ta, tb, n, M, N, K, 1.0f, p, (int)lda, (int)ldb, cbeta, (int)ldc);
        n = 0;
    };
    auto group = [&](const expert_problem &q) {
        p.a[n] = q.a, p.b[n] = q.b, p.c[n] = q.c;
        M[n] = (int)q.M, N[n] = (int)q.N, K[n] = (int)q.K;
        if (++n == FM_CUDA_GROUP_MAX) flush();
    };
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = off[e], m = off[e + 1] - r0;
        FM_ASSERT(m >= 0 && m <= INT_MAX);
        if (m == 0) continue;
        int64_t mo = 0;
        if (m >= own) {
            /* y and dx: its own call over the first mo rows, a multiple of FM_CUDA_OWN_CALL_QUANTUM
             * in the default form so that few distinct shapes reach cuBLAS's heuristics (measured
             * at 4K: experts 61-89 ms a step without, 45-53 with); the last m - mo rows join the
             * grouped call. dW takes all m rows in one call: a remainder call would read and write
             * the whole dW_e again (measured 25% slower at ~2048 rows per expert). */
            const int64_t qn = (own == 1 || kind == 2) ? 1 : FM_CUDA_OWN_CALL_QUANTUM;
            mo = m / qn * qn;
            const expert_problem q = expert_rows(kind, C, A, B, e, r0, mo, in, out);
            fm_cuda_gemm(ctx, ta, tb, q.M, q.N, q.K, 1.0f, static_cast<const fm_act *>(q.a), lda,
                         static_cast<const fm_act *>(q.b), ldb, cbeta, q.c, FM_DTYPE_BF16, ldc);
        }
        if (mo < m) group(expert_rows(kind, C, A, B, e, r0 + mo, m - mo, in, out));
    }
    flush();
}

} // namespace

extern "C" {

/* C[M,N] = alpha op(A)[M,K] op(B)[K,N] + beta C, row-major with row strides (fm_backend.h),
 * through cublasGemmEx (bf16 A and B, fp32 compute, C bf16 or fp32). A row-major matrix with row
 * stride ld is the column-major transpose with leading dimension ld, so the row-major product
 * C = op(A) op(B) is the column-major product C^T = op(B)^T op(A)^T: B goes first, with its own
 * transpose flag, and the sizes are (N, M, K). beta == 0 overwrites C (BLAS semantics: C is not
 * read); K == 0 or alpha == 0 scales C by beta here (cuBLAS would want lda >= 1). */
void fm_cuda_gemm(void *ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                  float alpha, const fm_act *A, int64_t lda, const fm_act *B, int64_t ldb,
                  float beta, void *C, fm_dtype c_type, int64_t ldc) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(M >= 0 && N >= 0 && K >= 0);
    FM_ASSERT(c_type == FM_DTYPE_F32 || c_type == FM_DTYPE_BF16);
    if (M == 0 || N == 0) return;
    FM_ASSERT(ldc >= N);
    if (K == 0 || alpha == 0.0f) {
        if (c_type == FM_DTYPE_F32)
            scale_c_kernel<float><<<ew_blocks(M * N), EW_THREADS, 0, c->stream>>>((float *)C, M, N, ldc, beta);
        else
            scale_c_kernel<bf16><<<ew_blocks(M * N), EW_THREADS, 0, c->stream>>>((bf16 *)C, M, N, ldc, beta);
        FM_CUDA_LAUNCH_CHECK(c);
        return;
    }
    FM_ASSERT(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N));
    FM_ASSERT(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX &&
              ldc <= INT_MAX);
    const cudaDataType_t ct = c_type == FM_DTYPE_F32 ? CUDA_R_32F : CUDA_R_16BF;
    FM_CUBLAS_CHECK(c, cublasGemmEx(c->cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha, B,
                                 CUDA_R_16BF, (int)ldb, A, CUDA_R_16BF, (int)lda, &beta, C, ct, (int)ldc,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void fm_cuda_expert_linear_fwd(void *ctx, fm_act *y, const fm_act *x, const fm_act *W, const int64_t *offsets,
                               int64_t E, int64_t in, int64_t out) {
    expert_gemm(ctx, 0, y, x, W, 0.0f, offsets, E, in, out);
}

void fm_cuda_expert_linear_bwd(void *ctx, fm_act *dx, float beta, fm_act *dW, const fm_act *dy, const fm_act *x,
                               const fm_act *W, const int64_t *offsets, int64_t E, int64_t in, int64_t out) {
    if (dx) expert_gemm(ctx, 1, dx, dy, W, beta, offsets, E, in, out);
    if (dW) expert_gemm(ctx, 2, dW, dy, x, 1.0f, offsets, E, in, out);
}

/* ---- sync-free expert GEMMs (the sm90 option; sm90/gg_sm90.h) -------------------------------- */

bool fm_cuda_expert_sync_free(void *ctx, int64_t E, int64_t H, int64_t I, int64_t rows_max) {
    const fm_cuda_ctx *c = ctx_of(ctx);
    /* the gate/up products map H -> I and down I -> H; every product must be served */
    return c->expert_gemm == FM_EXPERT_GEMM_SM90 && c->sm_count > 0 &&
           fm_cuda_sm90_expert_gemm_serves(E, H, I, rows_max);
}

static void sm90_call(fm_cuda_ctx *c, int kind, void *C, const fm_act *A, const fm_act *B, float beta,
                      const int64_t *offsets, int64_t rows, int64_t E, int64_t in, int64_t out) {
    FM_ASSERT(fm_gg_sm90_serves(E, in, out, rows));
    if (rows == 0) return; /* no rows: y, dx have none; dW_e += 0 */
    fm_gg_problem p;
    p.kind = kind, p.A = A, p.B = B, p.C = C, p.offs = offsets, p.E = (int)E;
    p.in = in, p.out = out, p.rcap = rows, p.beta = beta;
    FM_CUDA_CHECK(c, fm_gg_sm90_launch(&p, c->sm_count, c->stream));
}

void fm_cuda_expert_linear_fwd_dev(void *ctx, fm_act *y, const fm_act *x, const fm_act *W, const int64_t *offsets,
                                   int64_t rows, int64_t E, int64_t in, int64_t out) {
    sm90_call(ctx_of(ctx), 0, y, x, W, 0.0f, offsets, rows, E, in, out);
}

void fm_cuda_expert_linear_bwd_dev(void *ctx, fm_act *dx, float beta, fm_act *dW, const fm_act *dy, const fm_act *x,
                                   const fm_act *W, const int64_t *offsets, int64_t rows, int64_t E, int64_t in,
                                   int64_t out) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (dx) sm90_call(c, 1, dx, dy, W, beta, offsets, rows, E, in, out);
    if (dW) sm90_call(c, 2, dW, dy, x, 1.0f, offsets, rows, E, in, out);
}

} /* extern "C" */
