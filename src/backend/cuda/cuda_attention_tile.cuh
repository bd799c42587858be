/* Device helpers of our own attention kernels (C++ only), shared by the forward
 * (cuda_attention_fwd.cu) and the backward (cuda_attention_bwd.cu): the mma.sync / ldmatrix /
 * cp.async wrappers and tile loads of the tensor-core kernels, and the block reductions of the
 * scalar kernels. Everything is in an anonymous namespace (each file its own copy).
 *
 * mma.sync fragment layouts (PTX ISA, m16n8k16 with .bf16): lane = 4*g + t;
 *   A (16x16, row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
 *   B (16x8, col):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
 *   C (16x8 f32):   c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
 * so two C tiles side by side are the A fragment of the next product (P V, dS K, ...). */
#ifndef FM_CUDA_ATTENTION_TILE_CUH
#define FM_CUDA_ATTENTION_TILE_CUH

#include "cuda_attention_impl.h"

#include <math.h>

typedef __nv_bfloat16 bf16;

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

/* ---- small device helpers ------------------------------------------------------------------ */

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x (low half) = lo */
    return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ uint32_t ld32(const bf16 *p) { return *reinterpret_cast<const uint32_t *>(p); }
__device__ __forceinline__ void st32(bf16 *p, uint32_t v) { *reinterpret_cast<uint32_t *>(p) = v; }

__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Four 8x8 b16 matrices, transposed: lanes 8i..8i+7 give the row addresses of matrix i; lane L
 * receives element (row 2(L%4)+{0,1}, col L/4) of each. */
__device__ __forceinline__ void ldsm_x4_t(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                          const bf16 *p) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

__device__ __forceinline__ void cp_async16(bf16 *smem, const bf16 *gmem, bool valid) {
    uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    int n = valid ? 16 : 0; /* 0: zero-fill, nothing read */
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

/* Loads rows [0, ROWS) x cols [0, HDP) of a strided bf16 matrix g (row stride gs elements) into
 * shared memory (row stride HDP+8), zero-filling rows >= nvalid and columns >= hd. vec: 16-byte
 * cp.async (hd % 8 == 0, 16-byte aligned); else 4-byte loads (hd even). `safe` is a valid
 * address that zero-filled cp.async slots name instead of one past the tensor. */
template <int ROWS, int HDP, int NT>
__device__ __forceinline__ void load_tile(bf16 *sm, const bf16 *g, int64_t gs, int nvalid, int hd,
                                          int vec, int tid, const bf16 *safe) {
    constexpr int LD = HDP + 8;
    if (vec) {
        constexpr int CPR = HDP / 8;
#pragma unroll 4
        for (int c = tid; c < ROWS * CPR; c += NT) {
            const int r = c / CPR, cc = (c % CPR) * 8;
            const bool ok = r < nvalid && cc < hd;
            cp_async16(sm + r * LD + cc, ok ? g + (int64_t)r * gs + cc : safe, ok);
        }
    } else {
        constexpr int CPR = HDP / 2;
#pragma unroll 4
        for (int c = tid; c < ROWS * CPR; c += NT) {
            const int r = c / CPR, cc = (c % CPR) * 2;
            uint32_t val = 0;
            if (r < nvalid && cc < hd) val = ld32(g + (int64_t)r * gs + cc);
            st32(sm + r * LD + cc, val);
        }
    }
}

/* Writes 16 rows (row stride LD in shared memory) to global rows r0.. (stride gs), rows < nvalid,
 * columns < hd, by one warp. */
template <int HDP>
__device__ __forceinline__ void store_rows16(bf16 *g, int64_t gs, const bf16 *sm, int nvalid, int hd,
                                             int vec, int lane) {
    constexpr int LD = HDP + 8;
    if (vec) {
        constexpr int CPR = HDP / 8;
        for (int c = lane; c < 16 * CPR; c += 32) {
            const int r = c / CPR, cc = (c % CPR) * 8;
            if (r < nvalid && cc < hd)
                *reinterpret_cast<uint4 *>(g + (int64_t)r * gs + cc) =
                    *reinterpret_cast<const uint4 *>(sm + r * LD + cc);
        }
    } else {
        constexpr int CPR = HDP / 2;
        for (int c = lane; c < 16 * CPR; c += 32) {
            const int r = c / CPR, cc = (c % CPR) * 2;
            if (r < nvalid && cc < hd) st32(g + (int64_t)r * gs + cc, ld32(sm + r * LD + cc));
        }
    }
}

/* The A fragment (16x16 at rows row.., cols col..) of a row-major shared tile. */
template <int LD>
__device__ __forceinline__ void frag_a(uint32_t a[4], const bf16 *base, int row, int col, int gr, int tq) {
    const bf16 *p = base + (row + gr) * LD + col + tq * 2;
    a[0] = ld32(p);
    a[1] = ld32(p + 8 * LD);
    a[2] = ld32(p + 8);
    a[3] = ld32(p + 8 * LD + 8);
}

/* The B fragments of two adjacent n-tiles (n = rows nrow..nrow+15, k = cols kcol..kcol+15) of a
 * row-major [n][k] shared tile: b[0], b[1] for rows nrow.., b[2], b[3] for rows nrow+8... (An
 * ldmatrix.x4 variant of these loads measured no faster on an H200.) */
template <int LD>
__device__ __forceinline__ void frag_b2(uint32_t b[4], const bf16 *base, int nrow, int kcol, int gr, int tq) {
    const bf16 *p = base + (nrow + gr) * LD + kcol + tq * 2;
    b[0] = ld32(p);
    b[1] = ld32(p + 8);
    b[2] = ld32(p + 8 * LD);
    b[3] = ld32(p + 8 * LD + 8);
}

/* D[r] = sum_d dO[r][d] * O[r][d] and lse2[r] = lse[r] * log2 e for the ROWS query rows of a
 * tile (rows >= nvalid: D = 0, lse2 = +inf so that P = 0 there). NT/ROWS threads per row, on
 * consecutive lanes. */
template <int ROWS, int NT>
__device__ __forceinline__ void tile_D_lse(float *Ds, float *lse2s, const bf16 *dO, const bf16 *O,
                                           int64_t gs, const float *lse, int nvalid, int hd, int tid) {
    constexpr int TPR = NT / ROWS;
    static_assert(TPR >= 1 && TPR <= 32 && (TPR & (TPR - 1)) == 0, "threads per row");
    const int r = tid / TPR, part = tid % TPR;
    float acc = 0.0f;
    if (r < nvalid) {
        const bf16 *a = dO + (int64_t)r * gs, *b = O + (int64_t)r * gs;
        for (int d = part * 2; d < hd; d += 2 * TPR) {
            const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(a + d));
            const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(b + d));
            acc = fmaf(x.x, y.x, acc);
            acc = fmaf(x.y, y.y, acc);
        }
    }
#pragma unroll
    for (int o = 1; o < TPR; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (part == 0) {
        Ds[r] = acc;
        lse2s[r] = r < nvalid ? lse[r] * kLog2e : INFINITY;
    }
}

/* ---- the scalar kernels (any hd) -------------------------------------------------------------- */

constexpr int S_NT = 128;

/* Sum (or max) over the block's S_NT threads, in a fixed order; every thread gets the result. */
__device__ __forceinline__ float block_sum(float x, float *red) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    const int w = threadIdx.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[w] = x;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < S_NT / 32; i++) s += red[i];
    return s;
}
__device__ __forceinline__ float block_max(float x, float *red) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    const int w = threadIdx.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[w] = x;
    __syncthreads();
    float s = -INFINITY;
    for (int i = 0; i < S_NT / 32; i++) s = fmaxf(s, red[i]);
    return s;
}
__device__ __forceinline__ float dot_sf(const float *a, const bf16 *b, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc = fmaf(a[i], __bfloat162float(b[i]), acc);
    return acc;
}

/* ---- alignment ------------------------------------------------------------------------------- */

inline bool aligned(const void *p, uintptr_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

/* 16-byte loads: hd % 8 == 0 and every pointer 16-byte aligned. */
inline int vec_ok(int64_t hd, const void *const *ptrs, int nptrs) {
    if (hd % 8) return 0;
    for (int i = 0; i < nptrs; i++)
        if (!aligned(ptrs[i], 16)) return 0;
    return 1;
}

} // namespace

#endif
