/* The CUDA backend's router_replay (fm_backend.h): routing replay (R3) after router_fwd or
 * router_sigmoid_fwd on device memory. Twin of the CPU backend's cpu_router_replay.c, and of the
 * routers' weighting: the k probabilities (sigmoid: scores) of the given experts summed in fp32 in j
 * order, + eps, each weight divided by that in fp32 (IEEE division, as the routers' kernels do),
 * then times scaling, so a replay of the router's own routes is its bits (tests/gpu/
 * test_cuda_router_replay.c).
 *
 * Work layout: one thread per token, its k weights in order; a grid-stride loop over tokens. No
 * reduction across threads, no atomics, nothing allocated, no host wait. */
#include "cuda_internal.h"

#include <stdint.h>

namespace {

__global__ void router_replay_kernel(int32_t *__restrict__ topk_idx, float *__restrict__ topk_w,
                                     const float *__restrict__ probs, const int32_t *__restrict__ replay, int64_t N,
                                     int64_t E, int64_t k, bool norm_topk, float eps,
                                     float scaling) {
    for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x) {
        const int32_t *r = replay + n * k;
        if (r[0] < 0) continue; /* padding: router_fwd's choice */
        float wsum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const int32_t e = r[j];
            const float p = probs[n * E + e];
            topk_idx[n * k + j] = e;
            topk_w[n * k + j] = p;
            wsum += p;
        }
        const float den = wsum + eps; /* eps 0: wsum itself */
        for (int64_t j = 0; j < k; j++) { /* scaling 1: an exact no-op */
            const float w = topk_w[n * k + j];
            topk_w[n * k + j] = (norm_topk ? w / den : w) * scaling;
        }
    }
}

} /* namespace */

extern "C" {

void fm_cuda_router_replay(void *ctx, int32_t *topk_idx, float *topk_w, const float *probs, const int32_t *replay,
                           int64_t N, int64_t E, int64_t k, bool norm_topk, float eps, float scaling) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && k >= 1 && k <= E && N >= 0);
    if (N == 0) return;
    const int threads = 256;
    const int64_t want = (N + threads - 1) / threads;
    const int blocks = (int)(want < 4096 ? want : 4096);
    router_replay_kernel<<<blocks, threads, 0, c->stream>>>(topk_idx, topk_w, probs, replay, N, E, k, norm_topk, eps,
                                                            scaling);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
