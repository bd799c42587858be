/* Grouped expert GEMM lab (dev/cuda/grouped_gemm): the problem every version solves, the device
 * tile scheduler they share, and small PTX helpers.
 *
 * The three products of training over E groups (experts); group e owns rows [offs[e], offs[e+1])
 * of the row tensors (offs: int64 [E+1] in DEVICE memory, offs[0] = 0, nondecreasing; m_e =
 * offs[e+1] - offs[e] may be 0; one group may own every row). W is [E, out, in] (Hugging Face
 * layout, W_e = W + e*out*in), exactly fm_backend.h's expert_linear_fwd/bwd:
 *   kind 0 (fwd): y_e [m_e,out]  = x_e [m_e,in] W_e^T                  (C = y,  beta ignored: 0)
 *   kind 1 (dx):  dx_e [m_e,in]  = beta dx_e + dy_e [m_e,out] W_e      (C = dx)
 *   kind 2 (dW):  dW_e [out,in]  = beta dW_e + dy_e^T x_e              (C = dW; the backend: beta 1)
 * bf16 in and out, fp32 accumulation, one rounding to bf16 (nearest even) at the store. beta == 0
 * overwrites C without reading it. For dW an empty group gives dW_e = beta dW_e (unchanged for
 * beta 1, the backend's case).
 *
 * As GEMMs C[M,N] = sum_k A[m,k] B[n,k] per group:
 *   kind 0: M = m_e, N = out, K = in;  A = x  (K-major, row stride in),  B = W_e (K-major)
 *   kind 1: M = m_e, N = in,  K = out; A = dy (K-major, row stride out), B = W_e (MN-major: [K=out][N=in])
 *   kind 2: M = out, N = in,  K = m_e; A = dy (MN-major: [K=rows][M=out]), B = x (MN-major: [K=rows][N=in])
 * Every index product is int64 (row tensors may hold more than 2^31 elements).
 */
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

typedef __nv_bfloat16 bf16;

/* What a version's launch returns for a shape it does not serve (the table's "n/a"): a code no
 * CUDA call of the lab returns, so that a real error (an invalid launch, a tensor map the driver
 * refuses) is never shown as "n/a". */
constexpr cudaError_t GG_NOT_SERVED = cudaErrorNotYetImplemented;

#define GG_MAX_E 256 /* groups a kernel of this lab serves (smem copy of offs) */

struct gg_problem {
    int kind;             /* 0 fwd, 1 dx, 2 dW */
    const bf16 *A;        /* kind 0: x [rcap,in]; 1 and 2: dy [rcap,out] */
    const bf16 *B;        /* kind 0 and 1: W [E,out,in]; 2: x [rcap,in] */
    bf16 *C;              /* kind 0: y [rcap,out]; 1: dx [rcap,in]; 2: dW [E,out,in] */
    const int64_t *offs;  /* device int64 [E+1] */
    int E;
    int64_t in, out;      /* the layer's in and out features */
    int64_t rcap;         /* rows allocated in the row tensors (>= offs[E]; a plan-time bound) */
    float beta;
};

/* GEMM N of a kind (columns of C). */
__host__ __device__ inline int64_t gg_ndim(const gg_problem &p) { return p.kind == 0 ? p.out : p.in; }

/* Tiles of group e with m_e rows: kinds 0/1 ceil(m_e/BM) x N/BN; kind 2 out/BM x N/BN, none when
 * m_e == 0 and beta == 1 (dW_e is left as it is). */
__host__ __device__ inline int gg_group_tiles(const gg_problem &p, int64_t me, int BM, int BN) {
    const int ntn = (int)(gg_ndim(p) / BN);
    if (p.kind == 2) return (me == 0 && p.beta == 1.0f) ? 0 : (int)(p.out / BM) * ntn;
    return (int)((me + BM - 1) / BM) * ntn;
}

/* Shared-memory view of the schedule: s_offs[E+1] and the tile prefix s_tile[E+1], built by the
 * whole CTA from offs (device memory) at kernel start. Every CTA builds the same list, so the
 * persistent loop "for t = blockIdx.x; t < s_tile[E]; t += gridDim.x" covers each tile once. */
struct gg_sched {
    int64_t offs[GG_MAX_E + 1];
    int tile[GG_MAX_E + 1];
};

/* The tile prefix from s.offs (serial; E is small). Host-callable for the lab's self-test. */
__host__ __device__ inline void gg_sched_prefix(gg_sched &s, const gg_problem &p, int BM, int BN) {
    int acc = 0;
    s.tile[0] = 0;
    for (int e = 0; e < p.E; e++) {
        acc += gg_group_tiles(p, s.offs[e + 1] - s.offs[e], BM, BN);
        s.tile[e + 1] = acc;
    }
}

__device__ inline void gg_sched_build(gg_sched &s, const gg_problem &p, int BM, int BN) {
    for (int i = threadIdx.x; i <= p.E; i += blockDim.x) s.offs[i] = p.offs[i];
    __syncthreads();
    if (threadIdx.x == 0) gg_sched_prefix(s, p, BM, BN);
    __syncthreads();
}

/* The tile t (< s.tile[E]) as group e, m-tile mt and n-tile nt (n fastest: CTAs that run at the
 * same time share the A rows and, for kinds 0/1, all of W_e). Binary search on the prefix. */
struct gg_tile {
    int e, mt, nt;
    int64_t r0, me; /* the group's first row and rows */
};

__host__ __device__ inline gg_tile gg_tile_of(const gg_sched &s, const gg_problem &p, int t, int BN) {
    int lo = 0, hi = p.E - 1; /* the last e with s.tile[e] <= t; empty groups have equal prefixes */
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s.tile[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    const int ntn = (int)(gg_ndim(p) / BN), local = t - s.tile[lo];
    gg_tile r;
    r.e = lo, r.mt = local / ntn, r.nt = local % ntn;
    r.r0 = s.offs[lo], r.me = s.offs[lo + 1] - s.offs[lo];
    return r;
}

/* Store two adjacent fp32 results (row, col), (row, col+1) of C as bf16 with beta; c2 points at
 * C[row, col] (4-byte aligned: col even). */
__device__ inline void gg_store2(bf16 *c2, float v0, float v1, float beta) {
    __nv_bfloat162 *q = reinterpret_cast<__nv_bfloat162 *>(c2);
    if (beta != 0.0f) {
        const float2 old = __bfloat1622float2(*q);
        v0 += beta * old.x, v1 += beta * old.y;
    }
    *q = __floats2bfloat162_rn(v0, v1);
}

/* The pointer to C[row, col] of tile (e, r0) for a kind (row within the group's M). */
__device__ inline bf16 *gg_c_ptr(const gg_problem &p, const gg_tile &t, int64_t row, int64_t col) {
    if (p.kind == 0) return p.C + (t.r0 + row) * p.out + col;
    if (p.kind == 1) return p.C + (t.r0 + row) * p.in + col;
    return p.C + (int64_t)t.e * p.out * p.in + row * p.in + col;
}

/* ---- generic PTX helpers ---- */
__device__ inline uint32_t gg_smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
