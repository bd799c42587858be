/* The CPU backend's router_force (fm_backend.h): the forced routing of FLATMOE_TEST_FORCE_ROUTE
 * (fm_router.h's test hook). With percent = 100 it is, operation for operation, the loop that
 * fm_router.c ran on host memory before the op existed (the same bits; the weights times scaling, the sigmoid router's routed_scaling_factor, as router_sigmoid_fwd's). The CUDA twin is
 * backend/cuda/cuda_router_force.cu; tests/gpu/test_cuda_router_force.c compiles this file into
 * the GPU test (it needs nothing but this function) and compares the two bit for bit. */
#include "cpu_internal.h"

void fm_cpu_router_force(void *ctx, int32_t *topk_idx, float *topk_w, const float *probs, int64_t N, int64_t E,
                         int64_t k, int64_t first, int percent, bool norm_topk, float scaling) {
    (void)ctx;
    FM_ASSERT(E >= 1 && k >= 1 && k <= E && N >= 0 && first >= 0 && percent >= 0 && percent <= 100);
    for (int64_t n = 0; n < N; n++) {
        if (!(n * percent / 100 < (n + 1) * percent / 100)) continue; /* not forced: router_fwd's choice */
        double sum = 0;
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = (first + j) % E;
            topk_idx[n * k + j] = (int32_t)e;
            topk_w[n * k + j] = probs[n * E + e];
            sum += probs[n * E + e];
        }
        if (norm_topk)
            for (int64_t j = 0; j < k; j++) topk_w[n * k + j] = (float)(topk_w[n * k + j] / sum);
        for (int64_t j = 0; j < k; j++) topk_w[n * k + j] *= scaling; /* 1 (softmax): exact */
    }
}
