/* The CPU backend's router_replay (fm_backend.h): routing replay (R3) after router_fwd or
 * router_sigmoid_fwd, the given experts weighted by the current router's probabilities (softmax) or
 * scores (sigmoid: no bias, no group mask) exactly as that router weighs its own choice (fp32 sum in
 * j order, + eps, fp32 division, times scaling: eps 0 and scaling 1 for the softmax router, 1e-20f
 * and routed_scaling_factor for the sigmoid one), so a replay of the router's routes is its bits. The
 * CUDA twin is backend/cuda/cuda_router_replay.cu (tests/gpu/test_cuda_router_replay.c compiles
 * this file and compares the two). */
#include "cpu_internal.h"

void fm_cpu_router_replay(void *ctx, int32_t *topk_idx, float *topk_w, const float *probs, const int32_t *replay,
                          int64_t N, int64_t E, int64_t k, bool norm_topk, float eps, float scaling) {
    (void)ctx;
    FM_ASSERT(E >= 1 && k >= 1 && k <= E && N >= 0);
    for (int64_t n = 0; n < N; n++) {
        const int32_t *r = replay + n * k;
        if (r[0] < 0) continue; /* padding: router_fwd's choice */
        float wsum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const int32_t e = r[j];
            FM_ASSERT(e >= 0 && e < E);
            topk_idx[n * k + j] = e;
            topk_w[n * k + j] = probs[n * E + e];
            wsum += probs[n * E + e];
        }
        const float den = wsum + eps; /* eps 0: wsum itself */
        for (int64_t j = 0; j < k; j++) /* scaling 1: an exact no-op */
            topk_w[n * k + j] = (norm_topk ? topk_w[n * k + j] / den : topk_w[n * k + j]) * scaling;
    }
}
