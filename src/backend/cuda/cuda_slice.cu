/* The CUDA backend's head slices (fm_backend.h head_slice): multi-head latent attention's
 * strided q/k/v assembly and its backward (model/fm_mla.c). One thread per (row n, column j)
 * walks the heads in order h = 0 .. nh-1, so a summed slice (dst.hs 0) adds in the CPU
 * backend's order (cpu_slice.c), in fp32, rounded to bf16 once per store. Goes on the context's
 * stream; allocates nothing. */
#include "cuda_internal.h"

namespace {

__device__ __forceinline__ int64_t slice_src_col(int perm, int64_t j, int64_t d) {
    if (perm == FM_SLICE_DEINTERLEAVE) return j < d / 2 ? 2 * j : 2 * (j - d / 2) + 1;
    if (perm == FM_SLICE_INTERLEAVE) return j % 2 == 0 ? j / 2 : d / 2 + j / 2;
    return j;
}

__global__ void head_slice_kernel(bf16 *dst, fm_slice da, const bf16 *src, fm_slice sa, int64_t N, int64_t nh,
                                  int64_t d, int perm, float alpha, bool accumulate) {
    const int64_t total = N * d;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t n = e / d, j = e % d;
        const int64_t sj = slice_src_col(perm, j, d);
        if (da.hs == 0) { /* the heads summed into one slice, in head order */
            bf16 *y = dst + n * da.ld + da.off + j;
            float acc = accumulate ? ld(y) : 0.0f;
            for (int64_t h = 0; h < nh; h++)
                acc += src ? alpha * ld(src + n * sa.ld + h * sa.hs + sa.off + sj) : 0.0f;
            st(y, acc);
            continue;
        }
        for (int64_t h = 0; h < nh; h++) {
            bf16 *y = dst + n * da.ld + h * da.hs + da.off + j;
            const float v = src ? alpha * ld(src + n * sa.ld + h * sa.hs + sa.off + sj) : 0.0f;
            st(y, accumulate ? ld(y) + v : v);
        }
    }
}

} // namespace

extern "C" {

void fm_cuda_head_slice(void *ctx, fm_act *dst, fm_slice da, const fm_act *src, fm_slice sa, int64_t N, int64_t nh,
                        int64_t d, int perm, float alpha, bool accumulate) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && nh >= 1 && d >= 0 && (perm == FM_SLICE_PLAIN || d % 2 == 0));
    if (N * d == 0) return;
    head_slice_kernel<<<ew_blocks(N * d), EW_THREADS, 0, c->stream>>>(BF(dst), da, CBF(src), sa, N, nh, d, perm, alpha,
                                                                      accumulate);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
