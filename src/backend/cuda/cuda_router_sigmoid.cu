/* The CUDA backend's sigmoid router (fm_backend.h router_sigmoid_fwd / router_sigmoid_bwd: the
 * DeepSeek-V3 router, arXiv 2412.19437 §2.1.2, as transformers' Glm4MoeTopkRouter computes it).
 * Twin of the CPU backend's cpu_router_sigmoid.c, operation for operation in fp32 (the sigmoid,
 * the choice = score + bias, the group scores as the sum of a group's 2 best choices, the groups
 * not kept at 0.0, the selection by repeated passes in the order value descending / id
 * ascending / NaN last, the weights' sum in j order); the backward's per-token sums in double.
 * expf / logf may differ from the host's by an ulp, so the GPU test (tests/gpu/
 * test_cuda_router_sigmoid.c) compares against the fp64 reference within 1e-6, ids exactly.
 *
 * Work layout: one thread per token, a grid-stride loop over tokens; the passes over experts are
 * serial within the thread (O(k E) per token, E a few hundred at most in the real configs): a
 * first version, correct before fast (a warp-per-token version like router_fwd's is the next
 * step). No reduction across threads, no atomics, nothing allocated, no host wait. */
#include "cuda_internal.h"

#include <math.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ bool sg_before(float a, int64_t ia, float b, int64_t ib) {
    const float x = a == a ? a : -INFINITY, y = b == b ? b : -INFINITY;
    return x > y || (x == y && ia < ib);
}

__device__ __forceinline__ float sg_choice(const float *s, const bf16 *bias, const bool *kept, int64_t gs, int64_t e) {
    if (kept && !kept[e / gs]) return 0.0f;
    return s[e] + (bias ? __bfloat162float(bias[e]) : 0.0f);
}

/* The k first choices of experts [e0, e0 + n) into idx (ids relative to e0), as the CPU's. */
__device__ void sg_select(const float *s, const bf16 *bias, const bool *kept, int64_t gs, int64_t e0, int64_t n,
                          int64_t k, int32_t *idx) {
    float prev = 0.0f;
    int64_t prev_id = -1;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        float bv = 0.0f;
        for (int64_t e = 0; e < n; e++) {
            const float v = sg_choice(s, bias, kept, gs, e0 + e);
            if (prev_id >= 0 && !sg_before(prev, prev_id, v, e)) continue;
            if (best < 0 || sg_before(v, e, bv, best)) { best = e; bv = v; }
        }
        idx[j] = (int32_t)best;
        prev = bv;
        prev_id = best;
    }
}

/* n_group <= FM_ROUTER_MAX_GROUPS (the per-thread arrays); the launcher asserts it. */
#define SG_MAX_GROUPS FM_ROUTER_MAX_GROUPS

__global__ void router_sigmoid_fwd_kernel(float *__restrict__ scores, float *__restrict__ lse,
                                          int32_t *__restrict__ topk_idx, float *__restrict__ topk_w,
                                          const float *__restrict__ logits, const bf16 *__restrict__ bias, int64_t N,
                                          int64_t E, int64_t k, int64_t n_group, int64_t topk_group, bool norm,
                                          float scaling) {
    const int64_t gs = E / n_group;
    for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x) {
        const float *x = logits + n * E;
        float *s = scores + n * E;
        float mx = x[0];
        for (int64_t e = 1; e < E; e++) mx = x[e] > mx ? x[e] : mx;
        float se = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            s[e] = 1.0f / (1.0f + expf(-x[e]));
            se += expf(x[e] - mx);
        }
        lse[n] = mx + logf(se);
        bool kept_buf[SG_MAX_GROUPS];
        const bool *kept = NULL;
        if (n_group > 1) {
            float gsc[SG_MAX_GROUPS];
            for (int64_t g = 0; g < n_group; g++) {
                int32_t two[2];
                sg_select(s, bias, NULL, gs, g * gs, gs, 2, two);
                gsc[g] = sg_choice(s, bias, NULL, gs, g * gs + two[0]) + sg_choice(s, bias, NULL, gs, g * gs + two[1]);
            }
            for (int64_t g = 0; g < n_group; g++) kept_buf[g] = false;
            for (int64_t j = 0; j < topk_group; j++) {
                int64_t best = -1;
                for (int64_t g = 0; g < n_group; g++)
                    if (!kept_buf[g] && (best < 0 || sg_before(gsc[g], g, gsc[best], best))) best = g;
                kept_buf[best] = true;
            }
            kept = kept_buf;
        }
        int32_t *idx = topk_idx + n * k;
        float *tw = topk_w + n * k;
        sg_select(s, bias, kept, gs, 0, E, k, idx);
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            tw[j] = s[idx[j]];
            sum += tw[j];
        }
        const float den = sum + 1e-20f;
        for (int64_t j = 0; j < k; j++) tw[j] = (norm ? tw[j] / den : tw[j]) * scaling;
    }
}

__global__ void router_sigmoid_bwd_kernel(float *__restrict__ dlogits, const float *__restrict__ dtopk_w,
                                          const float *__restrict__ gpe, const float *__restrict__ scores,
                                          const int32_t *__restrict__ topk_idx, int64_t N, int64_t E, int64_t k,
                                          bool norm, float scaling) {
    for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x) {
        const float *s = scores + n * E;
        const int32_t *idx = topk_idx + n * k;
        float *dl = dlogits + n * E;
        for (int64_t e = 0; e < E; e++) {
            const double g = gpe ? (double)gpe[e] : 0.0;
            dl[e] = (float)((double)s[e] * (1.0 - (double)s[e]) * g);
        }
        if (!dtopk_w) continue;
        const float *dw = dtopk_w + n * k;
        double S = 1e-20, dot = 0;
        if (norm) {
            for (int64_t j = 0; j < k; j++) S += s[idx[j]];
            for (int64_t j = 0; j < k; j++) dot += (double)dw[j] * s[idx[j]];
        }
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = idx[j];
            const double ds = norm ? (double)scaling * ((double)dw[j] - dot / S) / S : (double)scaling * dw[j];
            const double g = gpe ? (double)gpe[e] : 0.0;
            dl[e] = (float)((double)s[e] * (1.0 - (double)s[e]) * (g + ds));
        }
    }
}

int sg_blocks(int64_t N, int threads) {
    const int64_t want = (N + threads - 1) / threads;
    return (int)(want < 4096 ? want : 4096);
}

} /* namespace */

extern "C" {

void fm_cuda_router_sigmoid_fwd(void *ctx, float *scores, float *lse, int32_t *topk_idx, float *topk_w,
                                const float *logits, const fm_act *bias, int64_t N, int64_t E, int64_t k,
                                int64_t n_group, int64_t topk_group, bool norm_topk, float scaling) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group);
    FM_ASSERT(k >= 1 && k <= topk_group * (E / n_group) && n_group <= SG_MAX_GROUPS);
    FM_ASSERT(n_group == 1 || E / n_group >= 2);
    if (N == 0) return;
    router_sigmoid_fwd_kernel<<<sg_blocks(N, 128), 128, 0, c->stream>>>(
        scores, lse, topk_idx, topk_w, logits, (const bf16 *)(const void *)bias, N, E, k, n_group, topk_group,
        norm_topk, scaling);
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_router_sigmoid_bwd(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                                const float *scores, const int32_t *topk_idx, int64_t N, int64_t E, int64_t k,
                                bool norm_topk, float scaling) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && k >= 1 && k <= E);
    if (N == 0) return;
    router_sigmoid_bwd_kernel<<<sg_blocks(N, 128), 128, 0, c->stream>>>(dlogits, dtopk_w, dprobs_per_expert, scores,
                                                                         topk_idx, N, E, k, norm_topk, scaling);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
