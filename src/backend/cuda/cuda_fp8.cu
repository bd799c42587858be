/* The CUDA backend's FP8 fake quantization (cuda_fp8.h): the kernels run backend/fm_fp8.h's
 * code (fm_fp8_scale_exp, fm_fp8_fake) on bf16 read as fp32, so the bits equal the C
 * reference's. A tile with a non-finite value comes out all NaN (fm_fp8.h). */
#include "cuda_internal.h"

#include "../fm_fp8.h"
#include "cuda_fp8.h"

namespace {

constexpr int T8 = FM_FP8_TILE; /* 128 */

__device__ __forceinline__ bool fp8_finite(float a) { return a <= 3.4028235e38f; } /* a = |x|; false for NaN, inf */

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

/* One warp per 1 x 128 tile (row i, columns [j0, j0 + n)); lane l holds columns j0 + l + 32 k. */
__global__ void quant_rows_kernel(bf16 *y, const bf16 *x, int64_t rows, int64_t cols, int64_t tiles_per_row) {
    const int lane = threadIdx.x & 31;
    const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5, tiles = rows * tiles_per_row;
    for (int64_t t = warp; t < tiles; t += nwarps) {
        const int64_t i = t / tiles_per_row, j0 = (t % tiles_per_row) * T8;
        const int n = cols - j0 < T8 ? (int)(cols - j0) : T8;
        const int64_t base = i * cols + j0;
        float v[4], amax = 0.0f;
        int bad = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int idx = lane + 32 * k;
            v[k] = idx < n ? ld(x + base + idx) : 0.0f;
            const float a = fabsf(v[k]);
            if (!fp8_finite(a)) bad = 1;
            else amax = fmaxf(amax, a);
        }
        amax = warp_max(amax);
        bad = __any_sync(FULL, bad);
        const int e = fm_fp8_scale_exp(amax);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int idx = lane + 32 * k;
            if (idx < n) st(y + base + idx, bad ? __int_as_float(0x7fc00000) : fm_fp8_fake(v[k], e));
        }
    }
}

/* One 256-thread block per 128 x 128 block of matrix m; thread t holds elements t + 256 k. */
__global__ void quant_blocks_kernel(bf16 *y, const bf16 *x, int64_t mats, int64_t rows, int64_t cols, int64_t br,
                                    int64_t bc) {
    __shared__ float s_max[8];
    __shared__ int s_bad[8];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int64_t nblocks = mats * br * bc;
    for (int64_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const int64_t m = b / (br * bc), rem = b % (br * bc), i0 = (rem / bc) * T8, j0 = (rem % bc) * T8;
        const int nr = rows - i0 < T8 ? (int)(rows - i0) : T8, nc = cols - j0 < T8 ? (int)(cols - j0) : T8;
        const int64_t base = m * rows * cols + i0 * cols + j0;
        float amax = 0.0f;
        int bad = 0;
        for (int idx = tid; idx < T8 * T8; idx += blockDim.x) {
            const int r = idx >> 7, cc = idx & (T8 - 1);
            if (r < nr && cc < nc) {
                const float a = fabsf(ld(x + base + (int64_t)r * cols + cc));
                if (!fp8_finite(a)) bad = 1;
                else amax = fmaxf(amax, a);
            }
        }
        amax = warp_max(amax);
        bad = __any_sync(FULL, bad);
        if (lane == 0) {
            s_max[w] = amax;
            s_bad[w] = bad;
        }
        __syncthreads();
        float bmax = s_max[0];
        int bbad = s_bad[0];
        for (int k = 1; k < (int)(blockDim.x >> 5); k++) {
            bmax = fmaxf(bmax, s_max[k]);
            bbad |= s_bad[k];
        }
        const int e = fm_fp8_scale_exp(bmax);
        for (int idx = tid; idx < T8 * T8; idx += blockDim.x) {
            const int r = idx >> 7, cc = idx & (T8 - 1);
            if (r < nr && cc < nc) {
                const int64_t o = base + (int64_t)r * cols + cc;
                st(y + o, bbad ? __int_as_float(0x7fc00000) : fm_fp8_fake(ld(x + o), e));
            }
        }
        __syncthreads(); /* s_max is read before the next block's writes */
    }
}

/* Rows [r0, r1) of one group: thread (column j, tile t) quantizes rows [r0 + 128 t, ...) of column j. */
__global__ void quant_cols_kernel(bf16 *y, const bf16 *x, int64_t r0, int64_t r1, int64_t cols) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    const int64_t tiles = (r1 - r0 + T8 - 1) / T8;
    for (int64_t t = blockIdx.y; t < tiles; t += gridDim.y) {
        const int64_t i0 = r0 + t * T8, i1 = i0 + T8 < r1 ? i0 + T8 : r1;
        float amax = 0.0f;
        int bad = 0;
        for (int64_t i = i0; i < i1; i++) {
            const float a = fabsf(ld(x + i * cols + j));
            if (!fp8_finite(a)) bad = 1;
            else amax = fmaxf(amax, a);
        }
        const int e = fm_fp8_scale_exp(amax);
        for (int64_t i = i0; i < i1; i++) {
            const int64_t o = i * cols + j;
            st(y + o, bad ? __int_as_float(0x7fc00000) : fm_fp8_fake(ld(x + o), e));
        }
    }
}

} // namespace

extern "C" void fm_cuda_quant_fp8_rows(void *ctx, fm_act *y, const fm_act *x, int64_t rows, int64_t cols) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(rows >= 0 && cols >= 0);
    if (rows == 0 || cols == 0) return;
    const int64_t tpr = (cols + T8 - 1) / T8;
    quant_rows_kernel<<<grid_for(rows * tpr, 8, (int64_t)1 << 16), 256, 0, c->stream>>>(BF(y), CBF(x), rows, cols, tpr);
    FM_CUDA_LAUNCH_CHECK(c);
}

extern "C" void fm_cuda_quant_fp8_blocks(void *ctx, fm_act *y, const fm_act *x, int64_t mats, int64_t rows,
                                         int64_t cols) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(mats >= 0 && rows >= 0 && cols >= 0);
    if (mats == 0 || rows == 0 || cols == 0) return;
    const int64_t br = (rows + T8 - 1) / T8, bc = (cols + T8 - 1) / T8;
    quant_blocks_kernel<<<grid_for(mats * br * bc, 1, (int64_t)1 << 16), 256, 0, c->stream>>>(BF(y), CBF(x), mats, rows,
                                                                                              cols, br, bc);
    FM_CUDA_LAUNCH_CHECK(c);
}

extern "C" void fm_cuda_quant_fp8_cols_grouped(void *ctx, fm_act *y, const fm_act *x, const int64_t *offsets,
                                               int64_t E, int64_t cols) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 0 && cols >= 0);
    if (cols == 0) return;
    for (int64_t g = 0; g < E; g++) {
        const int64_t r0 = offsets[g], r1 = offsets[g + 1];
        if (r1 <= r0) continue;
        const int64_t tiles = (r1 - r0 + T8 - 1) / T8;
        const dim3 grid(grid_for(cols, 128), (unsigned)(tiles < 65535 ? tiles : 65535));
        quant_cols_kernel<<<grid, 128, 0, c->stream>>>(BF(y), CBF(x), r0, r1, cols);
        FM_CUDA_LAUNCH_CHECK(c);
    }
}
