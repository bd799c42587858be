/* The CUDA backend (fm_backend_cuda.h): the op table, init/free, and the dense ops: gemm
 * (cuBLAS), add, sumsq, embedding, RMSNorm, RoPE, SwiGLU, AdamW, and the memory ops. Attention
 * is in cuda_attention.cu, router / MoE permutation / rows / cross-entropy / linear-CE strips in
 * cuda_moe.cu.
 *
 * Element types: fm_act is bf16 in this build (FM_ACT_BF16), read here as __nv_bfloat16. Every
 * kernel does its arithmetic in fp32 (fp64 for sumsq) and rounds to bf16 once, to nearest even,
 * when it stores an fm_act.
 *
 * Conventions (fm_backend.h): activation gradients are assigned, parameter gradients accumulate.
 * Every launch goes on the context's stream and is checked; nothing allocates after init (the
 * reductions use c->scratch, results come back through the pinned c->host_scratch).
 * Determinism: no floating-point atomics anywhere in this file. sumsq reduces in a fixed tree
 * over a grid that depends on n only; rmsnorm_bwd's dw sums fixed row chunks, then the chunk
 * partials in order; embedding_bwd stable-sorts the tokens (CUB radix sort, whose output is
 * unique) and sums each vocabulary row's tokens in increasing n. The same inputs give the same
 * bits on every call.
 */
#include "cuda_internal.h"

#include <cub/cub.cuh>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

typedef __nv_bfloat16 bf16;

static inline fm_cuda_ctx *ctx_of(void *ctx) { return static_cast<fm_cuda_ctx *>(ctx); }
static inline bf16 *BF(fm_act *p) { return reinterpret_cast<bf16 *>(p); }
static inline const bf16 *CBF(const fm_act *p) { return reinterpret_cast<const bf16 *>(p); }
static inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

/* Threads per block for the elementwise kernels, and the most blocks any grid-stride kernel
 * launches (132 SMs x 16 resident 256-thread blocks would be 2112; the loops cover the rest). */
enum { EW_THREADS = 256, EW_MAX_BLOCKS = 4096 };

static unsigned ew_blocks(int64_t work) {
    int64_t b = (work + EW_THREADS - 1) / EW_THREADS;
    if (b < 1) b = 1;
    if (b > EW_MAX_BLOCKS) b = EW_MAX_BLOCKS;
    return (unsigned)b;
}

/* ---- errors -------------------------------------------------------------------------------- */

extern "C" void fm_cuda_fail(const char *call, const char *what, const char *file, int line) {
    char msg[1024];
    snprintf(msg, sizeof msg, "CUDA backend: %s failed: %s", call, what ? what : "(no message)");
    fm_abort(file, line, msg);
}

/* Kernels and op functions have internal linkage (the other .cu files of the backend define
 * kernels of their own). */
namespace {

/* ---- bf16 vector helpers: 8 elements (16 bytes) per access --------------------------------- */

__device__ __forceinline__ void load8(const bf16 *p, float f[8]) {
    const uint4 u = *reinterpret_cast<const uint4 *>(p);
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float2 t = __bfloat1622float2(h[k]);
        f[2 * k] = t.x;
        f[2 * k + 1] = t.y;
    }
}

__device__ __forceinline__ void store8(bf16 *p, const float f[8]) {
    uint4 u;
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
    for (int k = 0; k < 4; k++) h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
    *reinterpret_cast<uint4 *>(p) = u;
}

__device__ __forceinline__ float ld(const bf16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st(bf16 *p, float v) { *p = __float2bfloat16_rn(v); }

/* Warp sum whose result every lane holds, added in a fixed order (down-tree then broadcast, so
 * all lanes agree bit for bit). */
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return __shfl_sync(0xffffffffu, v, 0);
}

/* ---- dense linear algebra ------------------------------------------------------------------ */

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

/* C[M,N] = alpha op(A)[M,K] op(B)[K,N] + beta C, row-major with row strides (fm_backend.h),
 * through cublasGemmEx (bf16 A and B, fp32 compute, C bf16 or fp32). A row-major matrix with row
 * stride ld is the column-major transpose with leading dimension ld, so the row-major product
 * C = op(A) op(B) is the column-major product C^T = op(B)^T op(A)^T: B goes first, with its own
 * transpose flag, and the sizes are (N, M, K). beta == 0 overwrites C (BLAS semantics: C is not
 * read); K == 0 or alpha == 0 scales C by beta here (cuBLAS would want lda >= 1). */
static void cu_gemm(void *ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
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
        FM_CUDA_LAUNCH_CHECK();
        return;
    }
    FM_ASSERT(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N));
    FM_ASSERT(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX &&
              ldc <= INT_MAX);
    const cudaDataType_t ct = c_type == FM_DTYPE_F32 ? CUDA_R_32F : CUDA_R_16BF;
    FM_CUBLAS_CHECK(cublasGemmEx(c->cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha, B,
                                 CUDA_R_16BF, (int)ldb, A, CUDA_R_16BF, (int)lda, &beta, C, ct, (int)ldc,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
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
 * with shared transposes, row strides, alpha and beta (cu_gemm's convention per group: the
 * column-major call swaps A and B and M and N), in one cublasGemmGroupedBatchedEx call with one
 * problem per group. Every M_g, N_g, K_g >= 1. */
static void grouped_call(fm_cuda_ctx *c, bool ta, bool tb, int n, const int *M, const int *N, const int *K,
                         float alpha, const group_ptrs &p, int lda, int ldb, float beta, int ldc) {
    const void **dev = reinterpret_cast<const void **>(static_cast<char *>(c->scratch) + FM_CUDA_REDUCE_BYTES);
    group_ptrs_kernel<<<1, FM_CUDA_GROUP_MAX, 0, c->stream>>>(p, n, dev);
    FM_CUDA_LAUNCH_CHECK();
    cublasOperation_t op_b[FM_CUDA_GROUP_MAX], op_a[FM_CUDA_GROUP_MAX];
    int lda_a[FM_CUDA_GROUP_MAX], ldb_a[FM_CUDA_GROUP_MAX], ldc_a[FM_CUDA_GROUP_MAX], size[FM_CUDA_GROUP_MAX];
    float al[FM_CUDA_GROUP_MAX], be[FM_CUDA_GROUP_MAX];
    for (int g = 0; g < n; g++) {
        op_b[g] = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
        op_a[g] = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
        lda_a[g] = lda, ldb_a[g] = ldb, ldc_a[g] = ldc, size[g] = 1;
        al[g] = alpha, be[g] = beta;
    }
    FM_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(c->cublas, op_b, op_a, N, M, K, al, dev + FM_CUDA_GROUP_MAX,
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

/* The row threshold: FLATMOE_EXPERT_GEMM=loop (every expert its own call), =grouped (every
 * expert in the grouped call), otherwise FM_CUDA_GROUP_ROWS_MAX. Read once. */
static int64_t expert_own_call_rows(void) {
    static int64_t rows = -1;
    if (rows < 0) {
        const char *e = getenv("FLATMOE_EXPERT_GEMM");
        rows = (e && strcmp(e, "loop") == 0) ? 1 : (e && strcmp(e, "grouped") == 0) ? INT64_MAX : FM_CUDA_GROUP_ROWS_MAX;
    }
    return rows;
}

/* One expert product over rows [r, r+mm) of expert e, in cu_gemm's row-major terms. kind 0:
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
 * expert_own_call_rows() rows gets its own cu_gemm (y, dx: over a multiple of
 * FM_CUDA_OWN_CALL_QUANTUM rows, the rest grouped); the rest go FM_CUDA_GROUP_MAX at a time into
 * grouped calls. */
static void expert_gemm(void *ctx, int kind, fm_act *C, const fm_act *A, const fm_act *B, float beta,
                        const int64_t *off, int64_t E, int64_t in, int64_t out) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(in >= 1 && out >= 1 && in <= INT_MAX && out <= INT_MAX && off[0] == 0);
    const bool ta = kind == 2, tb = kind == 0;
    const int64_t lda = kind == 0 ? in : out, ldb = in, ldc = kind == 0 ? out : in;
    const float cbeta = kind == 0 ? 0.0f : kind == 1 ? beta : 1.0f;
    const int64_t own = expert_own_call_rows();
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
            cu_gemm(ctx, ta, tb, q.M, q.N, q.K, 1.0f, static_cast<const fm_act *>(q.a), lda,
                    static_cast<const fm_act *>(q.b), ldb, cbeta, q.c, FM_DTYPE_BF16, ldc);
        }
        if (mo < m) group(expert_rows(kind, C, A, B, e, r0 + mo, m - mo, in, out));
    }
    flush();
}

static void cu_expert_linear_fwd(void *ctx, fm_act *y, const fm_act *x, const fm_act *W, const int64_t *offsets,
                                 int64_t E, int64_t in, int64_t out) {
    expert_gemm(ctx, 0, y, x, W, 0.0f, offsets, E, in, out);
}

static void cu_expert_linear_bwd(void *ctx, fm_act *dx, float beta, fm_act *dW, const fm_act *dy, const fm_act *x,
                                 const fm_act *W, const int64_t *offsets, int64_t E, int64_t in, int64_t out) {
    if (dx) expert_gemm(ctx, 1, dx, dy, W, beta, offsets, E, in, out);
    expert_gemm(ctx, 2, dW, dy, x, 1.0f, offsets, E, in, out);
}

/* ---- elementwise / reductions -------------------------------------------------------------- */

/* The elementwise kernels below share one shape: with vec (every pointer 16-byte aligned) the
 * first n/8*8 elements go 8 at a time, the tail one at a time; without vec all go one at a
 * time. Grid-stride loops; each element's value does not depend on which path computed it. */

__global__ void add_kernel(bf16 *y, const bf16 *x, int64_t n, bool vec) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nv = vec ? n / 8 : 0;
    for (int64_t v = tid; v < nv; v += stride) {
        float a[8], b[8];
        load8(y + 8 * v, a);
        load8(x + 8 * v, b);
#pragma unroll
        for (int k = 0; k < 8; k++) a[k] += b[k];
        store8(y + 8 * v, a);
    }
    for (int64_t i = 8 * nv + tid; i < n; i += stride) st(y + i, ld(y + i) + ld(x + i));
}

/* y[i] += x[i] (one rounding of the fp32 sum). */
static void cu_add(void *ctx, fm_act *y, const fm_act *x, int64_t n) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0);
    if (n == 0) return;
    const bool vec = aligned16(y) && aligned16(x);
    add_kernel<<<ew_blocks(vec ? n / 8 + 8 : n), EW_THREADS, 0, c->stream>>>(BF(y), CBF(x), n, vec);
    FM_CUDA_LAUNCH_CHECK();
}

enum { SUMSQ_THREADS = 256, SUMSQ_MAX_BLOCKS = 1024 };

/* Block-wide double sum in a fixed tree; the result is valid in thread 0. */
__device__ double block_sum_d(double v) {
    __shared__ double sh[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = threadIdx.x < (unsigned)nw ? sh[threadIdx.x] : 0.0;
    if (wid == 0) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    }
    return v;
}

/* Pass 1: block b sums the squares of its grid-stride share into part[b], in fp64 (the bf16
 * squares are exact in fp64; an H200 has fp64 throughput to spare for a memory-bound loop). */
__global__ void sumsq_part_kernel(const bf16 *x, int64_t n, bool vec, double *part) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nv = vec ? n / 8 : 0;
    double acc = 0.0;
    for (int64_t v = tid; v < nv; v += stride) {
        float f[8];
        load8(x + 8 * v, f);
        double a0 = 0.0, a1 = 0.0;
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            a0 += (double)f[k] * (double)f[k];
            a1 += (double)f[k + 1] * (double)f[k + 1];
        }
        acc += a0 + a1;
    }
    for (int64_t i = 8 * nv + tid; i < n; i += stride) {
        const double f = ld(x + i);
        acc += f * f;
    }
    acc = block_sum_d(acc);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

/* Pass 2: one block adds the nb partials in a fixed tree into *out. */
__global__ void sumsq_final_kernel(const double *part, int nb, double *out) {
    double acc = 0.0;
    for (int i = threadIdx.x; i < nb; i += blockDim.x) acc += part[i];
    acc = block_sum_d(acc);
    if (threadIdx.x == 0) *out = acc;
}

/* Sum of squares of x[0..n) in double. The grid depends on n (and the alignment of x) only, so
 * the same input gives the same bits on every call. Waits for the stream (the result is read
 * on the host). */
static double cu_sumsq(void *ctx, const fm_act *x, int64_t n) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0);
    if (n == 0) return 0.0;
    const bool vec = aligned16(x);
    int64_t work = vec ? n / 8 + 8 : n, nb = (work + SUMSQ_THREADS - 1) / SUMSQ_THREADS;
    if (nb > SUMSQ_MAX_BLOCKS) nb = SUMSQ_MAX_BLOCKS;
    double *part = static_cast<double *>(c->scratch), *out = part + SUMSQ_MAX_BLOCKS;
    sumsq_part_kernel<<<(unsigned)nb, SUMSQ_THREADS, 0, c->stream>>>(CBF(x), n, vec, part);
    FM_CUDA_LAUNCH_CHECK();
    sumsq_final_kernel<<<1, 1024, 0, c->stream>>>(part, (int)nb, out);
    FM_CUDA_LAUNCH_CHECK();
    FM_CUDA_CHECK(cudaMemcpyAsync(c->host_scratch, out, sizeof(double), cudaMemcpyDeviceToHost, c->stream));
    FM_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    c->host_syncs++;
    double r;
    memcpy(&r, c->host_scratch, sizeof r);
    return r;
}

/* ---- embedding ----------------------------------------------------------------------------- */

/* Block (x: token n, y: column slice): out[n, :] = wte[tokens[n], :]. A negative token id is a
 * caller bug: the kernel traps (the CPU backend asserts). */
__global__ void embedding_fwd_kernel(bf16 *out, const int32_t *tokens, const bf16 *wte, int64_t H, bool vec) {
    const int64_t n = blockIdx.x;
    const int32_t t = tokens[n];
    if (t < 0) __trap();
    const bf16 *src = wte + (int64_t)t * H;
    bf16 *dst = out + n * H;
    if (vec) {
        const int64_t nv = H / 8;
        for (int64_t v = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; v < nv; v += (int64_t)gridDim.y * blockDim.x)
            reinterpret_cast<uint4 *>(dst)[v] = reinterpret_cast<const uint4 *>(src)[v];
    } else {
        for (int64_t j = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; j < H; j += (int64_t)gridDim.y * blockDim.x)
            dst[j] = src[j];
    }
}

static void cu_embedding_fwd(void *ctx, fm_act *out, const int32_t *tokens, const fm_act *wte, int64_t N,
                             int64_t H) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && H >= 0);
    if (N == 0 || H == 0) return;
    FM_ASSERT(N <= INT_MAX);
    const bool vec = H % 8 == 0 && aligned16(out) && aligned16(wte);
    const int64_t per_row = vec ? H / 8 : H;
    int64_t gy = (per_row + EW_THREADS - 1) / EW_THREADS;
    if (gy > 64) gy = 64;
    embedding_fwd_kernel<<<dim3((unsigned)N, (unsigned)gy), EW_THREADS, 0, c->stream>>>(BF(out), tokens, CBF(wte),
                                                                                          H, vec);
    FM_CUDA_LAUNCH_CHECK();
}

__global__ void iota_kernel(int32_t *v, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        v[i] = (int32_t)i;
}

/* After a stable sort of the tokens of rows [n0, n0+n): skey [n] the sorted token ids, sidx [n]
 * their row offsets (increasing within equal ids). Block x = a sorted position; only the first
 * position of each run of equal ids works: its threads (y: column slices) add the run's dout
 * rows in increasing n to the fp32 value of dwte's row and store it once. */
__global__ void embedding_bwd_kernel(bf16 *dwte, const bf16 *dout, const int32_t *skey, const int32_t *sidx,
                                     int64_t n, int64_t n0, int64_t H) {
    const int64_t i = blockIdx.x;
    const int32_t t = skey[i];
    if (i > 0 && skey[i - 1] == t) return;
    if (t < 0) __trap();
    for (int64_t j = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; j < H; j += (int64_t)gridDim.y * blockDim.x) {
        bf16 *d = dwte + (int64_t)t * H + j;
        float acc = ld(d);
        for (int64_t s = i; s < n && skey[s] == t; s++) acc += ld(dout + (n0 + sidx[s]) * H + j);
        st(d, acc);
    }
}

/* Largest token chunk embedding_bwd sorts at once (3 int32 arrays + CUB's temporary storage must
 * fit c->scratch); longer inputs go in chunks of increasing n, each rounded to bf16 once. */
static const int64_t EMB_CHUNK = (int64_t)1 << 18;

/* dwte[tokens[n], :] += dout[n, :], deterministic: each dwte element sums its tokens' rows in
 * increasing n in fp32, starting from its old value, and is rounded once. The token ids are
 * stable-sorted (cub::DeviceRadixSort::SortPairs on (id, n), whose output is unique), so no
 * floating-point atomics and no order that depends on scheduling. */
static void cu_embedding_bwd(void *ctx, fm_act *dwte, const fm_act *dout, const int32_t *tokens, int64_t N,
                             int64_t H) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && H >= 0);
    if (N == 0 || H == 0) return;
    int64_t chunk = N < EMB_CHUNK ? N : EMB_CHUNK;
    size_t temp = 0, arr = 0;
    for (;;) {
        FM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp, (const int32_t *)nullptr, (int32_t *)nullptr,
                                                      (const int32_t *)nullptr, (int32_t *)nullptr, (int)chunk, 0,
                                                      32, c->stream));
        arr = ((size_t)chunk * sizeof(int32_t) + 255) & ~(size_t)255;
        if (3 * arr + temp <= FM_CUDA_REDUCE_BYTES) break;
        FM_ASSERT(chunk > 1024);
        chunk /= 2;
    }
    char *base = static_cast<char *>(c->scratch);
    int32_t *skey = reinterpret_cast<int32_t *>(base), *iota = reinterpret_cast<int32_t *>(base + arr),
            *sidx = reinterpret_cast<int32_t *>(base + 2 * arr);
    void *tmp = base + 3 * arr;
    int64_t gy = (H + EW_THREADS - 1) / EW_THREADS;
    if (gy > 64) gy = 64;
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        const int64_t n = N - n0 < chunk ? N - n0 : chunk;
        iota_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(iota, n);
        FM_CUDA_LAUNCH_CHECK();
        size_t t = temp;
        FM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(tmp, t, tokens + n0, skey, iota, sidx, (int)n, 0, 32,
                                                      c->stream));
        embedding_bwd_kernel<<<dim3((unsigned)n, (unsigned)gy), EW_THREADS, 0, c->stream>>>(
            BF(dwte), CBF(dout), skey, sidx, n, n0, H);
        FM_CUDA_LAUNCH_CHECK();
    }
}

/* ---- RMSNorm ------------------------------------------------------------------------------- */

enum { RMS_WARPS = 8 }; /* rows per 256-thread block: one warp per row */

/* One warp per row: ss = sum x^2 (fp32, lanes then a fixed warp tree), r = 1/sqrt(ss/D + eps)
 * (in double, as the CPU), out = x r w. vec: D % 8 == 0 and 16-byte aligned rows. */
__global__ void rmsnorm_fwd_kernel(bf16 *out, float *rstd, const bf16 *x, const bf16 *w, int64_t N, int64_t D,
                                   float eps, bool vec) {
    const int64_t row = (int64_t)blockIdx.x * RMS_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= N) return;
    const bf16 *xr = x + row * D;
    bf16 *o = out + row * D;
    float ss = 0.0f;
    if (vec) {
        for (int64_t j = 8 * lane; j < D; j += 256) {
            float f[8];
            load8(xr + j, f);
#pragma unroll
            for (int k = 0; k < 8; k++) ss += f[k] * f[k];
        }
    } else {
        for (int64_t j = lane; j < D; j += 32) {
            const float f = ld(xr + j);
            ss += f * f;
        }
    }
    ss = warp_sum(ss);
    const float r = (float)(1.0 / sqrt((double)ss / (double)D + (double)eps));
    if (lane == 0) rstd[row] = r;
    if (vec) {
        for (int64_t j = 8 * lane; j < D; j += 256) {
            float f[8], g[8];
            load8(xr + j, f);
            load8(w + j, g);
#pragma unroll
            for (int k = 0; k < 8; k++) f[k] = f[k] * r * g[k];
            store8(o + j, f);
        }
    } else {
        for (int64_t j = lane; j < D; j += 32) st(o + j, ld(xr + j) * r * ld(w + j));
    }
}

static void cu_rmsnorm_fwd(void *ctx, fm_act *out, float *rstd, const fm_act *x, const fm_act *w, int64_t N,
                           int64_t D, float eps) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && D >= 1);
    if (N == 0) return;
    const bool vec = D % 8 == 0 && aligned16(out) && aligned16(x) && aligned16(w);
    const int64_t nb = (N + RMS_WARPS - 1) / RMS_WARPS;
    FM_ASSERT(nb <= INT_MAX);
    rmsnorm_fwd_kernel<<<(unsigned)nb, 32 * RMS_WARPS, 0, c->stream>>>(BF(out), rstd, CBF(x), CBF(w), N, D, eps,
                                                                        vec);
    FM_CUDA_LAUNCH_CHECK();
}

/* dx = r w g - x r^3 (sum_i g_i w_i x_i) / D, one warp per row. */
__global__ void rmsnorm_bwd_dx_kernel(bf16 *dx, const bf16 *dout, const bf16 *x, const bf16 *w, const float *rstd,
                                      int64_t N, int64_t D, bool vec) {
    const int64_t row = (int64_t)blockIdx.x * RMS_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= N) return;
    const bf16 *xr = x + row * D, *g = dout + row * D;
    bf16 *d = dx + row * D;
    float dot = 0.0f;
    if (vec) {
        for (int64_t j = 8 * lane; j < D; j += 256) {
            float a[8], b[8], e[8];
            load8(g + j, a);
            load8(w + j, b);
            load8(xr + j, e);
#pragma unroll
            for (int k = 0; k < 8; k++) dot += a[k] * b[k] * e[k];
        }
    } else {
        for (int64_t j = lane; j < D; j += 32) dot += ld(g + j) * ld(w + j) * ld(xr + j);
    }
    dot = warp_sum(dot);
    const double r = rstd[row];
    const float a = (float)r, cc = (float)(r * r * r * (double)dot / (double)D);
    if (vec) {
        for (int64_t j = 8 * lane; j < D; j += 256) {
            float gg[8], ww[8], xx[8];
            load8(g + j, gg);
            load8(w + j, ww);
            load8(xr + j, xx);
#pragma unroll
            for (int k = 0; k < 8; k++) gg[k] = a * ww[k] * gg[k] - cc * xx[k];
            store8(d + j, gg);
        }
    } else {
        for (int64_t j = lane; j < D; j += 32) st(d + j, a * ld(w + j) * ld(g + j) - cc * ld(xr + j));
    }
}

/* dw partials: block (x: 256 columns, y: row chunk) sums g x r over its chunk's rows in order. */
__global__ void rmsnorm_bwd_dw_part_kernel(float *part, const bf16 *dout, const bf16 *x, const float *rstd,
                                           int64_t N, int64_t D, int64_t rows_per) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= D) return;
    const int64_t r0 = (int64_t)blockIdx.y * rows_per, r1 = r0 + rows_per < N ? r0 + rows_per : N;
    float acc = 0.0f;
    for (int64_t r = r0; r < r1; r++) acc += ld(dout + r * D + j) * ld(x + r * D + j) * rstd[r];
    part[(int64_t)blockIdx.y * D + j] = acc;
}

/* dw[j] += sum over chunks (in chunk order) of part[chunk, j]. */
__global__ void rmsnorm_bwd_dw_final_kernel(bf16 *dw, const float *part, int64_t nch, int64_t D) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= D) return;
    float acc = 0.0f;
    for (int64_t ch = 0; ch < nch; ch++) acc += part[ch * D + j];
    st(dw + j, ld(dw + j) + acc);
}

/* dx [N,D] assigned, dw [D] accumulated. dw is deterministic: the rows are cut into at most 512
 * fixed chunks (a function of N and D only), each chunk's column sums go to c->scratch, and the
 * chunk sums are added in chunk order, then once to dw. */
static void cu_rmsnorm_bwd(void *ctx, fm_act *dx, fm_act *dw, const fm_act *dout, const fm_act *x,
                           const fm_act *w, const float *rstd, int64_t N, int64_t D) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && D >= 1);
    if (N == 0) return;
    const bool vec = D % 8 == 0 && aligned16(dx) && aligned16(dout) && aligned16(x) && aligned16(w);
    const int64_t nb = (N + RMS_WARPS - 1) / RMS_WARPS;
    FM_ASSERT(nb <= INT_MAX);
    rmsnorm_bwd_dx_kernel<<<(unsigned)nb, 32 * RMS_WARPS, 0, c->stream>>>(BF(dx), CBF(dout), CBF(x), CBF(w), rstd,
                                                                           N, D, vec);
    FM_CUDA_LAUNCH_CHECK();
    int64_t max_ch = (int64_t)(FM_CUDA_REDUCE_BYTES / (sizeof(float) * (size_t)D));
    if (max_ch > 512) max_ch = 512;
    FM_ASSERT(max_ch >= 1); /* D <= 4M columns */
    int64_t rows_per = (N + max_ch - 1) / max_ch;
    if (rows_per < 16) rows_per = 16;
    const int64_t nch = (N + rows_per - 1) / rows_per, nbx = (D + EW_THREADS - 1) / EW_THREADS;
    FM_ASSERT(nbx <= INT_MAX);
    float *part = static_cast<float *>(c->scratch);
    rmsnorm_bwd_dw_part_kernel<<<dim3((unsigned)nbx, (unsigned)nch), EW_THREADS, 0, c->stream>>>(
        part, CBF(dout), CBF(x), rstd, N, D, rows_per);
    FM_CUDA_LAUNCH_CHECK();
    rmsnorm_bwd_dw_final_kernel<<<(unsigned)nbx, EW_THREADS, 0, c->stream>>>(BF(dw), part, nch, D);
    FM_CUDA_LAUNCH_CHECK();
}

/* ---- rotary position embedding, rotate_half layout ----------------------------------------- */

/* One thread per pair (x[i], x[i+hd/2]) of x [B,T,nh,hd]; sign = -1 applies the transpose. */
__global__ void rope_kernel(bf16 *x, const float *cos_tab, const float *sin_tab, int64_t T, int64_t nh,
                            int64_t half, int64_t total, float sign) {
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = e % half, vec = e / half, t = (vec / nh) % T;
        bf16 *a = x + vec * 2 * half;
        const float cs = cos_tab[t * half + i], sn = sign * sin_tab[t * half + i];
        const float x0 = ld(a + i), x1 = ld(a + i + half);
        st(a + i, x0 * cs - x1 * sn);
        st(a + i + half, x1 * cs + x0 * sn);
    }
}

/* The same, 8 pairs per thread with 16-byte accesses (half % 8 == 0, x 16-byte aligned). */
__global__ void rope_vec_kernel(bf16 *x, const float *cos_tab, const float *sin_tab, int64_t T, int64_t nh,
                                int64_t half, int64_t total8, float sign) {
    const int64_t g8 = half / 8;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total8;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i0 = 8 * (e % g8), vec = e / g8, t = (vec / nh) % T;
        bf16 *a = x + vec * 2 * half + i0, *b = a + half;
        const float *ct = cos_tab + t * half + i0, *stab = sin_tab + t * half + i0;
        float x0[8], x1[8], y0[8], y1[8];
        load8(a, x0);
        load8(b, x1);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float cs = ct[k], sn = sign * stab[k];
            y0[k] = x0[k] * cs - x1[k] * sn;
            y1[k] = x1[k] * cs + x0[k] * sn;
        }
        store8(a, y0);
        store8(b, y1);
    }
}

static void rope_launch(fm_cuda_ctx *c, fm_act *x, const float *cos_tab, const float *sin_tab, int64_t B, int64_t T,
                        int64_t nh, int64_t hd, float sign) {
    FM_ASSERT(B >= 0 && T >= 0 && nh >= 0 && hd >= 0 && hd % 2 == 0);
    const int64_t half = hd / 2, total = B * T * nh * half;
    if (total == 0) return;
    if (half % 8 == 0 && aligned16(x))
        rope_vec_kernel<<<ew_blocks(total / 8), EW_THREADS, 0, c->stream>>>(BF(x), cos_tab, sin_tab, T, nh, half,
                                                                             total / 8, sign);
    else
        rope_kernel<<<ew_blocks(total), EW_THREADS, 0, c->stream>>>(BF(x), cos_tab, sin_tab, T, nh, half, total,
                                                                     sign);
    FM_CUDA_LAUNCH_CHECK();
}

static void cu_rope_fwd(void *ctx, fm_act *x, const float *cos_tab, const float *sin_tab, int64_t B, int64_t T,
                        int64_t nh, int64_t hd) {
    rope_launch(ctx_of(ctx), x, cos_tab, sin_tab, B, T, nh, hd, 1.0f);
}

static void cu_rope_bwd(void *ctx, fm_act *dx, const float *cos_tab, const float *sin_tab, int64_t B, int64_t T,
                        int64_t nh, int64_t hd) {
    rope_launch(ctx_of(ctx), dx, cos_tab, sin_tab, B, T, nh, hd, -1.0f);
}

/* ---- SwiGLU -------------------------------------------------------------------------------- */

/* sigmoid in fp32 with expf: exp(-g) overflows to inf for g < -88.7, giving exactly 0. */
__device__ __forceinline__ float sigmoidf_(float g) { return 1.0f / (1.0f + expf(-g)); }

__global__ void swiglu_fwd_kernel(bf16 *out, const bf16 *gate, const bf16 *up, int64_t n, bool vec) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nv = vec ? n / 8 : 0;
    for (int64_t v = tid; v < nv; v += stride) {
        float g[8], u[8];
        load8(gate + 8 * v, g);
        load8(up + 8 * v, u);
#pragma unroll
        for (int k = 0; k < 8; k++) g[k] = g[k] * sigmoidf_(g[k]) * u[k];
        store8(out + 8 * v, g);
    }
    for (int64_t i = 8 * nv + tid; i < n; i += stride) {
        const float g = ld(gate + i);
        st(out + i, g * sigmoidf_(g) * ld(up + i));
    }
}

/* dgate = dout up s (1 + g (1 - s)), dup = dout g s, s = sigmoid(g). */
__global__ void swiglu_bwd_kernel(bf16 *dgate, bf16 *dup, const bf16 *dout, const bf16 *gate, const bf16 *up,
                                  int64_t n, bool vec) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nv = vec ? n / 8 : 0;
    for (int64_t v = tid; v < nv; v += stride) {
        float g[8], u[8], d[8], dg[8], du[8];
        load8(gate + 8 * v, g);
        load8(up + 8 * v, u);
        load8(dout + 8 * v, d);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float s = sigmoidf_(g[k]);
            dg[k] = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
            du[k] = d[k] * g[k] * s;
        }
        store8(dgate + 8 * v, dg);
        store8(dup + 8 * v, du);
    }
    for (int64_t i = 8 * nv + tid; i < n; i += stride) {
        const float g = ld(gate + i), u = ld(up + i), d = ld(dout + i), s = sigmoidf_(g);
        st(dgate + i, d * u * s * (1.0f + g * (1.0f - s)));
        st(dup + i, d * g * s);
    }
}

static void cu_swiglu_fwd(void *ctx, fm_act *out, const fm_act *gate, const fm_act *up, int64_t n) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0);
    if (n == 0) return;
    const bool vec = aligned16(out) && aligned16(gate) && aligned16(up);
    swiglu_fwd_kernel<<<ew_blocks(vec ? n / 8 + 8 : n), EW_THREADS, 0, c->stream>>>(BF(out), CBF(gate), CBF(up), n,
                                                                                     vec);
    FM_CUDA_LAUNCH_CHECK();
}

static void cu_swiglu_bwd(void *ctx, fm_act *dgate, fm_act *dup, const fm_act *dout, const fm_act *gate,
                          const fm_act *up, int64_t n) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0);
    if (n == 0) return;
    const bool vec = aligned16(dgate) && aligned16(dup) && aligned16(dout) && aligned16(gate) && aligned16(up);
    swiglu_bwd_kernel<<<ew_blocks(vec ? n / 8 + 8 : n), EW_THREADS, 0, c->stream>>>(BF(dgate), BF(dup), CBF(dout),
                                                                                     CBF(gate), CBF(up), n, vec);
    FM_CUDA_LAUNCH_CHECK();
}

/* ---- optimizer ----------------------------------------------------------------------------- */

/* AdamW, the formula of fm_backend.h in fp32. w = master (fp32) when given, then p = bf16(w);
 * without a master the weights are p itself: w = fp32(p), and p = bf16(w) after the step. One
 * element's arithmetic, shared by the vector and scalar paths (the same bits either way). */
__device__ __forceinline__ float adamw_one(float gi, float &m, float &v, float w, float lr, float b1, float b2,
                                           float eps, float wd, float bc1, float bc2) {
    const float mi = b1 * m + (1.0f - b1) * gi;
    const float vi = b2 * v + (1.0f - b2) * gi * gi;
    m = mi;
    v = vi;
    return w - lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + wd * w);
}

/* 8 consecutive values as fp32, from fp32 (2 x 16 bytes) or bf16 (16 bytes); stores round bf16
 * to nearest even. */
__device__ __forceinline__ void ld8(const float *p, float f[8]) {
    const float4 a = *reinterpret_cast<const float4 *>(p), b = *reinterpret_cast<const float4 *>(p + 4);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
__device__ __forceinline__ void ld8(const bf16 *p, float f[8]) { load8(p, f); }
__device__ __forceinline__ void st8(float *p, const float f[8]) {
    *reinterpret_cast<float4 *>(p) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4 *>(p + 4) = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void st8(bf16 *p, const float f[8]) { store8(p, f); }
__device__ __forceinline__ float ld1(const float *p) { return *p; }
__device__ __forceinline__ float ld1(const bf16 *p) { return ld(p); }
__device__ __forceinline__ void st1(float *p, float v) { *p = v; }
__device__ __forceinline__ void st1(bf16 *p, float v) { st(p, v); }

/* With vec (every pointer 16-byte aligned) the first n/8*8 elements go 8 at a time (the loop is
 * bound by memory: 28 bytes per element with a master and fp32 moments, 20 with bf16 moments),
 * the rest one at a time. MV: the moments' type (float or bf16). */
template <bool MASTER, typename MV>
__global__ void adamw_kernel(bf16 *p, const bf16 *g, float *master, MV *m, MV *v, int64_t n, bool vec, float lr,
                             float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_scale) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nv = vec ? n / 8 : 0;
    for (int64_t q = tid; q < nv; q += stride) {
        const int64_t i = 8 * q;
        float gf[8], w[8], mf[8], vf[8];
        load8(g + i, gf);
        ld8(m + i, mf);
        ld8(v + i, vf);
        if (MASTER) ld8(master + i, w);
        else load8(p + i, w);
#pragma unroll
        for (int k = 0; k < 8; k++) w[k] = adamw_one(gf[k] * grad_scale, mf[k], vf[k], w[k], lr, b1, b2, eps, wd, bc1, bc2);
        st8(m + i, mf);
        st8(v + i, vf);
        if (MASTER) st8(master + i, w);
        store8(p + i, w);
    }
    for (int64_t i = 8 * nv + tid; i < n; i += stride) {
        float mi = ld1(m + i), vi = ld1(v + i);
        const float w = adamw_one(ld(g + i) * grad_scale, mi, vi, MASTER ? master[i] : ld(p + i), lr, b1, b2, eps,
                                  wd, bc1, bc2);
        st1(m + i, mi);
        st1(v + i, vi);
        if (MASTER) master[i] = w;
        st(p + i, w);
    }
}

template <typename MV>
static void adamw_launch(fm_cuda_ctx *c, fm_act *p, const fm_act *g, float *master, MV *m, MV *v, int64_t n,
                         float lr, float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_scale) {
    const bool vec = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && (!master || aligned16(master));
    const unsigned blocks = ew_blocks(vec ? n / 8 + 8 : n);
    if (master)
        adamw_kernel<true, MV><<<blocks, EW_THREADS, 0, c->stream>>>(BF(p), CBF(g), master, m, v, n, vec, lr, b1, b2,
                                                                     eps, wd, bc1, bc2, grad_scale);
    else
        adamw_kernel<false, MV><<<blocks, EW_THREADS, 0, c->stream>>>(BF(p), CBF(g), master, m, v, n, vec, lr, b1,
                                                                      b2, eps, wd, bc1, bc2, grad_scale);
    FM_CUDA_LAUNCH_CHECK();
}

static void cu_adamw(void *ctx, fm_act *p, const fm_act *g, float *master, void *m, void *v, fm_dtype mv_dtype,
                     int64_t n, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                     float grad_scale) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0 && (mv_dtype == FM_DTYPE_F32 || mv_dtype == FM_DTYPE_BF16));
    if (n == 0) return;
    if (mv_dtype == FM_DTYPE_BF16)
        adamw_launch<bf16>(c, p, g, master, static_cast<bf16 *>(m), static_cast<bf16 *>(v), n, lr, b1, b2, eps, wd,
                           bc1, bc2, grad_scale);
    else
        adamw_launch<float>(c, p, g, master, static_cast<float *>(m), static_cast<float *>(v), n, lr, b1, b2, eps,
                            wd, bc1, bc2, grad_scale);
}

/* ---- memory -------------------------------------------------------------------------------- */

/* cudaMalloc (256-byte aligned) and zero-filled; NULL when the device is out of memory (the
 * error is cleared so the context stays usable). */
static void *cu_mem_alloc(void *ctx, size_t bytes) {
    fm_cuda_ctx *c = ctx_of(ctx);
    void *p = NULL;
    const cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        if (e != cudaErrorMemoryAllocation) fm_cuda_fail("cudaMalloc(&p, bytes)", cudaGetErrorString(e), __FILE__, __LINE__);
        (void)cudaGetLastError();
        return NULL;
    }
    FM_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes ? bytes : 1, c->stream));
    FM_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return p;
}

static void cu_mem_free(void *ctx, void *p) {
    (void)ctx;
    if (p) FM_CUDA_CHECK(cudaFree(p)); /* cudaFree waits for the device */
}

static void cu_mem_set(void *ctx, void *dst, int byte, size_t bytes) {
    if (bytes) FM_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, ctx_of(ctx)->stream));
}

/* Synchronous: issued on the stream (so it follows every op before it), then waited for. */
static void cu_copy(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (bytes == 0 || dst == src) return;
    const cudaMemcpyKind k = kind == FM_COPY_H2D   ? cudaMemcpyHostToDevice
                             : kind == FM_COPY_D2H ? cudaMemcpyDeviceToHost
                                                   : cudaMemcpyDeviceToDevice;
    FM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, k, c->stream));
    FM_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    c->host_syncs++;
}

__global__ void f32_to_bf16_kernel(bf16 *dst, const float *src, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void bf16_to_f32_kernel(float *dst, const bf16 *src, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __bfloat162float(src[i]);
}

/* fp32 <-> bf16, round to nearest even (NaN stays NaN); the same type is a copy (a no-op in
 * place). */
static void cu_convert(void *ctx, void *dst, fm_dtype dst_type, const void *src, fm_dtype src_type, int64_t n) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0);
    FM_ASSERT((dst_type == FM_DTYPE_F32 || dst_type == FM_DTYPE_BF16) &&
              (src_type == FM_DTYPE_F32 || src_type == FM_DTYPE_BF16));
    if (n == 0) return;
    if (dst_type == src_type) {
        if (dst != src)
            FM_CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)n * fm_dtype_size(dst_type), cudaMemcpyDeviceToDevice,
                                          c->stream));
        return;
    }
    if (dst_type == FM_DTYPE_BF16)
        f32_to_bf16_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>((bf16 *)dst, (const float *)src, n);
    else
        bf16_to_f32_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>((float *)dst, (const bf16 *)src, n);
    FM_CUDA_LAUNCH_CHECK();
}

static void cu_sync(void *ctx) {
    FM_CUDA_CHECK(cudaStreamSynchronize(ctx_of(ctx)->stream));
    ctx_of(ctx)->host_syncs++;
}

static uint64_t cu_host_sync_count(void *ctx) { return ctx_of(ctx)->host_syncs; }

/* ---- profiling: events at phase marks ------------------------------------------------------- */

/* Waits for the last recorded event and folds the intervals between the pool's events into
 * prof_acc; the last event becomes the pool's first. */
static void prof_fold(fm_cuda_ctx *c) {
    if (c->prof_n < 1) return;
    FM_CUDA_CHECK(cudaEventSynchronize(c->prof_ev[c->prof_n - 1]));
    c->host_syncs++;
    for (int i = 1; i < c->prof_n; i++) {
        float ms = 0;
        FM_CUDA_CHECK(cudaEventElapsedTime(&ms, c->prof_ev[i - 1], c->prof_ev[i]));
        c->prof_acc[c->prof_phase[i - 1]] += ms;
    }
    cudaEvent_t last = c->prof_ev[c->prof_n - 1];
    c->prof_ev[c->prof_n - 1] = c->prof_ev[0];
    c->prof_ev[0] = last;
    c->prof_phase[0] = c->prof_phase[c->prof_n - 1];
    c->prof_n = 1;
}

static void cu_prof_mark(void *ctx, fm_phase phase) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (!c->prof_ev) return;
    if (c->prof_n == c->prof_cap) prof_fold(c);
    FM_CUDA_CHECK(cudaEventRecord(c->prof_ev[c->prof_n], c->stream));
    c->prof_phase[c->prof_n++] = (unsigned char)phase;
}

static bool cu_prof_collect(void *ctx, double *ms) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (!c->prof_ev) return false;
    cu_prof_mark(ctx, c->prof_n ? (fm_phase)c->prof_phase[c->prof_n - 1] : FM_PHASE_OTHER);
    prof_fold(c);
    for (int i = 0; i < FM_PHASE_COUNT; i++) {
        ms[i] = c->prof_acc[i];
        c->prof_acc[i] = 0;
    }
    return true;
}

} // namespace

/* ---- the table ----------------------------------------------------------------------------- */

static fm_ops make_cuda_ops(void) {
    fm_ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.gemm = cu_gemm;
    o.expert_linear_fwd = cu_expert_linear_fwd;
    o.expert_linear_bwd = cu_expert_linear_bwd;
    o.add = cu_add;
    o.sumsq = cu_sumsq;
    o.embedding_fwd = cu_embedding_fwd;
    o.embedding_bwd = cu_embedding_bwd;
    o.rmsnorm_fwd = cu_rmsnorm_fwd;
    o.rmsnorm_bwd = cu_rmsnorm_bwd;
    o.rope_fwd = cu_rope_fwd;
    o.rope_bwd = cu_rope_bwd;
    o.attention_fwd = fm_cuda_attention_fwd;
    o.attention_bwd = fm_cuda_attention_bwd;
    o.swiglu_fwd = cu_swiglu_fwd;
    o.swiglu_bwd = cu_swiglu_bwd;
    o.router_fwd = fm_cuda_router_fwd;
    o.router_bwd = fm_cuda_router_bwd;
    o.router_stats = fm_cuda_router_stats;
    o.moe_route_index = fm_cuda_moe_route_index;
    o.moe_gather = fm_cuda_moe_gather;
    o.moe_gather_bwd = fm_cuda_moe_gather_bwd;
    o.moe_combine_fwd = fm_cuda_moe_combine_fwd;
    o.moe_combine_bwd = fm_cuda_moe_combine_bwd;
    o.gather_rows = fm_cuda_gather_rows;
    o.scatter_rows = fm_cuda_scatter_rows;
    o.cross_entropy = fm_cuda_cross_entropy;
    o.adamw = cu_adamw;
    o.lce_fold = fm_cuda_lce_fold;
    o.lce_finalize = fm_cuda_lce_finalize;
    o.lce_strip_grad = fm_cuda_lce_strip_grad;
    o.mem_alloc = cu_mem_alloc;
    o.mem_free = cu_mem_free;
    o.mem_set = cu_mem_set;
    o.copy = cu_copy;
    o.convert = cu_convert;
    o.sync = cu_sync;
    o.host_sync_count = cu_host_sync_count;
    o.prof_mark = cu_prof_mark;
    o.prof_collect = cu_prof_collect;
    return o;
}

static const fm_ops fm_cuda_ops = make_cuda_ops();

/* ---- init, free ---------------------------------------------------------------------------- */

static const size_t FM_CUDA_DEFAULT_WORKSPACE = FM_CUDA_DEFAULT_WORKSPACE_BYTES;
static_assert(FM_CUDA_SCRATCH_BYTES == FM_CUDA_SCRATCH_BYTES_PUBLIC, "scratch size in two headers");

static size_t resolve_workspace(size_t workspace_bytes) {
    return workspace_bytes ? workspace_bytes : FM_CUDA_DEFAULT_WORKSPACE;
}

extern "C" size_t fm_cuda_backend_workspace_bytes(int64_t max_head_dim, size_t workspace_bytes) {
    (void)max_head_dim; /* attention's own state (cuda_attention.cu) is not counted here */
    return fm_cuda_backend_workspace_bytes_for(workspace_bytes); /* cuBLASLt + cuDNN, reduction scratch */
}

extern "C" fm_status fm_cuda_device_memory(int device, size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = *total_bytes = 0;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaMemGetInfo(free_bytes, total_bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaMemGetInfo on device %d failed: %s (no usable CUDA device; "
                        "use the CPU build)", device, cudaGetErrorString(e));
    }
    return FM_OK;
}

/* Releases whatever part of a context exists (init's error paths and free). Errors here are
 * ignored: the context is going away and may be half built. */
static void ctx_destroy(fm_cuda_ctx *c, bool attention_up) {
    if (!c) return;
    if (c->stream) (void)cudaStreamSynchronize(c->stream);
    if (attention_up) fm_cuda_attention_free(c);
    if (c->prof_ev) {
        for (int i = 0; i < c->prof_cap; i++)
            if (c->prof_ev[i]) (void)cudaEventDestroy(c->prof_ev[i]);
        fm_free(c->prof_ev);
    }
    fm_free(c->prof_phase);
    if (c->cudnn) (void)cudnnDestroy(c->cudnn);
    if (c->cublaslt) (void)cublasLtDestroy(c->cublaslt);
    if (c->cublas) (void)cublasDestroy(c->cublas);
    if (c->lt_workspace) (void)cudaFree(c->lt_workspace);
    if (c->cudnn_workspace) (void)cudaFree(c->cudnn_workspace);
    if (c->scratch) (void)cudaFree(c->scratch);
    if (c->host_scratch) (void)cudaFreeHost(c->host_scratch);
    if (c->stream) (void)cudaStreamDestroy(c->stream);
    (void)cudaGetLastError();
    fm_free(c);
}

/* Device allocation for init: FM_ERR_NOMEM naming what it was for. */
static fm_status init_alloc(void **p, size_t bytes, const char *what, int device) {
    const cudaError_t e = cudaMalloc(p, bytes);
    if (e == cudaSuccess) return FM_OK;
    *p = NULL;
    (void)cudaGetLastError();
    return fm_error(FM_ERR_NOMEM, "cuda backend: cudaMalloc of %zu bytes for the %s on device %d failed: %s", bytes,
                    what, device, cudaGetErrorString(e));
}

extern "C" fm_status fm_cuda_backend_init(fm_backend *b, int device, int64_t max_head_dim, size_t workspace_bytes) {
    if (!b) return fm_error(FM_ERR_ARG, "fm_cuda_backend_init: backend pointer is NULL");
    b->ops = NULL;
    b->ctx = NULL;
    if (device < 0) return fm_error(FM_ERR_ARG, "cuda backend: device must be >= 0, got %d", device);
    if (max_head_dim < 1)
        return fm_error(FM_ERR_ARG, "cuda backend: max_head_dim must be >= 1, got %lld", (long long)max_head_dim);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return fm_error(FM_ERR_UNSUPPORTED,
                        "cuda backend: cudaGetDeviceCount failed: %s (no CUDA driver or device on this machine; "
                        "use the CPU build)",
                        cudaGetErrorString(e));
    }
    if (count == 0)
        return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: no CUDA device found (use the CPU build)");
    if (device >= count)
        return fm_error(FM_ERR_ARG, "cuda backend: device %d requested but only %d CUDA device(s) present (0..%d)",
                        device, count, count - 1);
    cudaDeviceProp prop;
    e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess)
        return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaGetDeviceProperties(%d) failed: %s", device,
                        cudaGetErrorString(e));
    if (prop.major != 9)
        return fm_error(FM_ERR_UNSUPPORTED,
                        "cuda backend: device %d (%s) has compute capability %d.%d, but this build's kernels are "
                        "for sm_90 (Hopper: H100/H200) only; run on a Hopper GPU or use the CPU build",
                        device, prop.name, prop.major, prop.minor);
    e = cudaSetDevice(device);
    if (e != cudaSuccess)
        return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaSetDevice(%d) failed: %s", device, cudaGetErrorString(e));

    fm_cuda_ctx *c = static_cast<fm_cuda_ctx *>(fm_malloc(sizeof *c));
    if (!c) return fm_error(FM_ERR_NOMEM, "cuda backend: cannot allocate the context (%zu bytes)", sizeof *c);
    memset(c, 0, sizeof *c);
    c->device = device;
    c->max_head_dim = max_head_dim;
    const size_t ws = resolve_workspace(workspace_bytes);
    fm_status s = FM_OK;

    if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        c->stream = NULL;
        s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaStreamCreateWithFlags failed: %s", cudaGetErrorString(e));
        goto fail;
    }
    if ((s = init_alloc(&c->lt_workspace, FM_CUDA_LT_WORKSPACE_BYTES, "cuBLAS/cuBLASLt workspace", device)) != FM_OK)
        goto fail;
    c->lt_workspace_bytes = FM_CUDA_LT_WORKSPACE_BYTES;
    if ((s = init_alloc(&c->cudnn_workspace, ws, "cuDNN workspace", device)) != FM_OK) goto fail;
    c->cudnn_workspace_bytes = ws;
    if ((s = init_alloc(&c->scratch, FM_CUDA_SCRATCH_BYTES, "reduction scratch", device)) != FM_OK) goto fail;
    if ((e = cudaMallocHost(&c->host_scratch, FM_CUDA_SCRATCH_BYTES)) != cudaSuccess) {
        c->host_scratch = NULL;
        s = fm_error(FM_ERR_NOMEM, "cuda backend: cudaMallocHost of %zu bytes of pinned scratch failed: %s",
                     (size_t)FM_CUDA_SCRATCH_BYTES, cudaGetErrorString(e));
        goto fail;
    }
    {
        cublasStatus_t bs;
        if ((bs = cublasCreate(&c->cublas)) != CUBLAS_STATUS_SUCCESS) {
            c->cublas = NULL;
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cublasCreate failed: %s", cublasGetStatusString(bs));
            goto fail;
        }
        if ((bs = cublasSetStream(c->cublas, c->stream)) != CUBLAS_STATUS_SUCCESS ||
            (bs = cublasSetWorkspace(c->cublas, c->lt_workspace, c->lt_workspace_bytes)) != CUBLAS_STATUS_SUCCESS ||
            (bs = cublasSetPointerMode(c->cublas, CUBLAS_POINTER_MODE_HOST)) != CUBLAS_STATUS_SUCCESS ||
            (bs = cublasSetMathMode(c->cublas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS) {
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: configuring the cuBLAS handle failed: %s",
                         cublasGetStatusString(bs));
            goto fail;
        }
        if ((bs = cublasLtCreate(&c->cublaslt)) != CUBLAS_STATUS_SUCCESS) {
            c->cublaslt = NULL;
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cublasLtCreate failed: %s", cublasGetStatusString(bs));
            goto fail;
        }
    }
    {
        cudnnStatus_t ds;
        if ((ds = cudnnCreate(&c->cudnn)) != CUDNN_STATUS_SUCCESS) {
            c->cudnn = NULL;
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudnnCreate failed: %s (is libcudnn 9 installed?)",
                         cudnnGetErrorString(ds));
            goto fail;
        }
        if ((ds = cudnnSetStream(c->cudnn, c->stream)) != CUDNN_STATUS_SUCCESS) {
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudnnSetStream failed: %s", cudnnGetErrorString(ds));
            goto fail;
        }
    }
    {
        const char *prof = getenv("FLATMOE_PROFILE");
        if (prof && prof[0] && strcmp(prof, "0") != 0) {
            c->prof_cap = 16384;
            c->prof_ev = static_cast<cudaEvent_t *>(fm_malloc(sizeof(cudaEvent_t) * (size_t)c->prof_cap));
            c->prof_phase = static_cast<unsigned char *>(fm_malloc((size_t)c->prof_cap));
            if (!c->prof_ev || !c->prof_phase) {
                s = fm_error(FM_ERR_NOMEM, "cuda backend: cannot allocate the FLATMOE_PROFILE event pool");
                goto fail;
            }
            memset(c->prof_ev, 0, sizeof(cudaEvent_t) * (size_t)c->prof_cap);
            for (int i = 0; i < c->prof_cap; i++)
                if ((e = cudaEventCreate(&c->prof_ev[i])) != cudaSuccess) {
                    s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaEventCreate for FLATMOE_PROFILE failed: %s",
                                 cudaGetErrorString(e));
                    goto fail;
                }
            FM_CUDA_CHECK(cudaEventRecord(c->prof_ev[0], c->stream));
            c->prof_phase[0] = FM_PHASE_OTHER;
            c->prof_n = 1;
        }
    }
    if ((s = fm_cuda_attention_init(c)) != FM_OK) goto fail;
    b->ops = &fm_cuda_ops;
    b->ctx = c;
    return FM_OK;
fail:
    ctx_destroy(c, false);
    return s;
}

extern "C" void fm_cuda_backend_free(fm_backend *b) {
    if (!b) return;
    fm_cuda_ctx *c = static_cast<fm_cuda_ctx *>(b->ctx);
    if (c) {
        FM_CUDA_CHECK(cudaSetDevice(c->device));
        FM_CUDA_CHECK(cudaStreamSynchronize(c->stream));
        ctx_destroy(c, true);
    }
    b->ctx = NULL;
    b->ops = NULL;
}
