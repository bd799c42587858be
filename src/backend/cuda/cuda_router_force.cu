/* The CUDA backend's router_force (fm_backend.h): the forced routing of FLATMOE_TEST_FORCE_ROUTE
 * (fm_router.h's test hook) on device memory, after router_fwd. Twin of the CPU backend's
 * cpu_router_force.c, operation for operation: the same forced-token predicate in integer
 * arithmetic, the k probabilities summed in double in j order, each weight the double quotient
 * rounded once to float (IEEE division in double on the device as on the host), then times scaling in
 * fp32, so the same bits
 * (tests/gpu/test_cuda_router_force.c compares the two).
 *
 * Work layout: one thread per token, its k weights in order (k is small: 8 for OLMoE and
 * Qwen3-MoE); a grid-stride loop over tokens. No reduction across threads, no atomics, nothing
 * allocated, no host wait. */
#include "cuda_internal.h"

#include <stdint.h>

namespace {

__global__ void router_force_kernel(int32_t *__restrict__ topk_idx, float *__restrict__ topk_w,
                                    const float *__restrict__ probs, int64_t N, int64_t E, int64_t k, int64_t first,
                                    int percent, bool norm_topk, float scaling) {
    for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x) {
        if (!(n * percent / 100 < (n + 1) * percent / 100)) continue; /* not forced: router_fwd's choice */
        double sum = 0;
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = (first + j) % E;
            const float p = probs[n * E + e];
            topk_idx[n * k + j] = (int32_t)e;
            topk_w[n * k + j] = p;
            sum += (double)p;
        }
        if (norm_topk)
            for (int64_t j = 0; j < k; j++) topk_w[n * k + j] = (float)((double)topk_w[n * k + j] / sum);
        for (int64_t j = 0; j < k; j++) topk_w[n * k + j] = topk_w[n * k + j] * scaling; /* 1 (softmax): exact */
    }
}

} /* namespace */

extern "C" {

void fm_cuda_router_force(void *ctx, int32_t *topk_idx, float *topk_w, const float *probs, int64_t N, int64_t E,
                          int64_t k, int64_t first, int percent, bool norm_topk, float scaling) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && k >= 1 && k <= E && N >= 0 && first >= 0 && percent >= 0 && percent <= 100);
    if (N == 0) return;
    const int threads = 256;
    const int64_t want = (N + threads - 1) / threads;
    const int blocks = (int)(want < 4096 ? want : 4096);
    router_force_kernel<<<blocks, threads, 0, c->stream>>>(topk_idx, topk_w, probs, N, E, k, first, percent, norm_topk,
                                                           scaling);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
