/* The CUDA backend's top-k strip ops of linear cross-entropy (fm_backend.h: lce_topk_fold,
 * lce_topk_finalize). Twin of backend/cpu/cpu_lce_topk.c, operation for operation: the same
 * strict order (logit descending, id ascending) and insertion, and the log-prob formed in double
 * and rounded once, so the same bits (tests/gpu/test_cuda_lce_topk.c).
 *
 * Work layout: one thread per row, scanning its strip row in column order against the k-th
 * logit held in a register (most columns are rejected by one compare); the row's running top-k
 * stays in the caller's topv / topi (device memory). A grid-stride loop over rows. No reduction
 * across threads, no atomics, nothing allocated, no host wait. (A warp per row would read the
 * strip coalesced; this is the first, plain form.) */
#include "cuda_internal.h"

#include <math.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ bool topk_before(float v, int32_t id, float tv, int32_t ti) {
    return v > tv || (v == tv && ti >= 0 && id < ti) || (ti < 0 && v == v);
}

__global__ void lce_topk_fold_kernel(float *__restrict__ topv, int32_t *__restrict__ topi,
                                     const float *__restrict__ strip, int64_t Nb, int64_t Vb, int64_t v0, int64_t k,
                                     bool first) {
    for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < Nb; r += (int64_t)gridDim.x * blockDim.x) {
        float *tv = topv + r * k;
        int32_t *ti = topi + r * k;
        if (first)
            for (int64_t j = 0; j < k; j++) tv[j] = -INFINITY, ti[j] = -1;
        float lastv = tv[k - 1];
        int32_t lasti = ti[k - 1];
        const float *s = strip + r * Vb;
        for (int64_t i = 0; i < Vb; i++) {
            const float v = s[i];
            const int32_t id = (int32_t)(v0 + i);
            if (!topk_before(v, id, lastv, lasti)) continue;
            int64_t j = k - 1;
            for (; j > 0 && topk_before(v, id, tv[j - 1], ti[j - 1]); j--) tv[j] = tv[j - 1], ti[j] = ti[j - 1];
            tv[j] = v;
            ti[j] = id;
            lastv = tv[k - 1];
            lasti = ti[k - 1];
        }
    }
}

__global__ void lce_topk_finalize_kernel(float *__restrict__ out_lp, int32_t *__restrict__ out_id,
                                         const float *__restrict__ topv, const int32_t *__restrict__ topi,
                                         const float *__restrict__ m, const float *__restrict__ z, int64_t Nb,
                                         int64_t k) {
    for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < Nb; r += (int64_t)gridDim.x * blockDim.x) {
        const double lz = log((double)z[r]);
        for (int64_t j = 0; j < k; j++) {
            const int32_t id = topi[r * k + j];
            out_id[r * k + j] = id;
            out_lp[r * k + j] = id < 0 ? -INFINITY : (float)-(((double)m[r] - (double)topv[r * k + j]) + lz);
        }
    }
}

int grid_for(int64_t n, int threads) {
    const int64_t want = (n + threads - 1) / threads;
    return (int)(want < 4096 ? want : 4096);
}

} /* namespace */

extern "C" {

void fm_cuda_lce_topk_fold(void *ctx, float *topv, int32_t *topi, const float *strip, int64_t Nb, int64_t Vb,
                           int64_t v0, int64_t k, bool first) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(Nb >= 0 && Vb >= 1 && v0 >= 0 && k >= 1);
    if (Nb == 0) return;
    lce_topk_fold_kernel<<<grid_for(Nb, 128), 128, 0, c->stream>>>(topv, topi, strip, Nb, Vb, v0, k, first);
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_lce_topk_finalize(void *ctx, float *out_lp, int32_t *out_id, const float *topv, const int32_t *topi,
                               const float *m, const float *z, int64_t Nb, int64_t k) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(Nb >= 0 && k >= 1);
    if (Nb == 0) return;
    lce_topk_finalize_kernel<<<grid_for(Nb, 128), 128, 0, c->stream>>>(out_lp, out_id, topv, topi, m, z, Nb, k);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
