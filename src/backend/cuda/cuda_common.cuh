/* Device and host helpers shared by the CUDA backend's files (C++ only; included at the end of
 * cuda_internal.h). Everything is in an anonymous namespace: each file gets its own copy, as
 * when each file defined them. Nothing here changes a kernel's arithmetic: these are the loads,
 * stores, reductions and launch-shape helpers the kernels were written with.
 *
 * Reductions have fixed shapes (warp butterflies, block trees) that depend on the sizes only,
 * never on timing, so the same inputs give the same bits on every call. */
#ifndef FM_CUDA_COMMON_CUH
#define FM_CUDA_COMMON_CUH

#include <math.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

namespace {

/* ---- the context, bf16 views of fm_act, alignment ----------------------------------------------- */

inline fm_cuda_ctx *ctx_of(void *ctx) { return static_cast<fm_cuda_ctx *>(ctx); }
inline bf16 *BF(fm_act *p) { return reinterpret_cast<bf16 *>(p); }
inline const bf16 *CBF(const fm_act *p) { return reinterpret_cast<const bf16 *>(p); }
inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

/* ---- launch shapes ---------------------------------------------------------------------------- */

/* Threads per block for the elementwise kernels, and the most blocks any grid-stride kernel
 * launches (132 SMs x 16 resident 256-thread blocks would be 2112; the loops cover the rest). */
enum { EW_THREADS = 256, EW_MAX_BLOCKS = 4096 };

inline unsigned ew_blocks(int64_t work) {
    int64_t b = (work + EW_THREADS - 1) / EW_THREADS;
    if (b < 1) b = 1;
    if (b > EW_MAX_BLOCKS) b = EW_MAX_BLOCKS;
    return (unsigned)b;
}

/* Blocks for a grid-stride loop over `items` with `per_block` items per block. */
inline unsigned grid_for(int64_t items, int64_t per_block, int64_t cap = (int64_t)1 << 20) {
    int64_t g = (items + per_block - 1) / per_block;
    if (g < 1) g = 1;
    if (g > cap) g = cap;
    return (unsigned)g;
}

/* Threads per row-block for a row of `vecs` vectors (the row-wise losses). */
inline int row_threads(int64_t vecs, int maxt) {
    int t = 64;
    while (t < maxt && (int64_t)t * 4 < vecs) t *= 2;
    return t;
}

/* Fixed partition of n items into at most `max_blocks` contiguous chunks (>= min_chunk each). */
inline int64_t chunk_of(int64_t n, int64_t max_blocks, int64_t min_chunk) {
    int64_t ch = (n + max_blocks - 1) / max_blocks;
    return ch < min_chunk ? min_chunk : ch;
}

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

/* ---- scratch (device reductions) and the device-error flags ------------------------------------- */

constexpr size_t FM_SCR_DATA = 256; /* reductions start here (the first bytes are left unused) */
constexpr unsigned FULL = 0xffffffffu;

inline char *scr_data(fm_cuda_ctx *c) { return static_cast<char *>(c->scratch) + FM_SCR_DATA; }

/* The device pointer of flag `which` (FM_CUDA_FLAG_*): kernels store 1 there on an invalid
 * index; status reports it (sticky, never cleared). */
inline int *dev_flag(fm_cuda_ctx *c, int which) { return c->flags_dev + which; }

/* ---- warp and block reductions (fixed shapes: the same bits every call) --------------------
 * The xor butterflies leave the identical value in every lane (IEEE addition and fmaxf are
 * commutative, so lane l and lane l^o compute the same thing at each level). */

__device__ __forceinline__ float warp_max_f(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum_f(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

/* Block-wide sums of NV doubles; every thread gets the results. blockDim.x a multiple of 32.
 * sh holds 32*NV doubles. Ends with a barrier, so sh can be reused at once. */
template <int NV>
__device__ __forceinline__ void block_sum_d(double (&v)[NV], double *sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        v[i] = warp_sum_d(v[i]);
        if (lane == 0) sh[i * 32 + w] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < NV; i++) v[i] = warp_sum_d(lane < nw ? sh[i * 32 + lane] : 0.0);
    __syncthreads();
}

/* Block-wide NaN-skipping max (fmaxf), every thread gets it. sh holds 32 floats. */
__device__ __forceinline__ float block_max_f(float v, float *sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max_f(v);
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = warp_max_f(lane < nw ? sh[lane] : -INFINITY);
    __syncthreads();
    return v;
}

/* ---- bf16 vector loads and stores of VEC elements (16 bytes when VEC == 8) ---------------------- */

template <int VEC>
__device__ __forceinline__ void load_bf(const bf16 *p, float (&f)[VEC]) {
    if constexpr (VEC == 8) {
        const uint4 u = *reinterpret_cast<const uint4 *>(p);
        const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 t = __bfloat1622float2(h[i]);
            f[2 * i] = t.x;
            f[2 * i + 1] = t.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++) f[i] = __bfloat162float(p[i]);
    }
}
template <int VEC>
__device__ __forceinline__ void store_bf(bf16 *p, const float (&f)[VEC]) {
    if constexpr (VEC == 8) {
        uint4 u;
        __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
        for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        *reinterpret_cast<uint4 *>(p) = u;
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++) p[i] = __float2bfloat16_rn(f[i]);
    }
}

} // namespace

#endif
