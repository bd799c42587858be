/* The CUDA backend's DeepSeek-V2 router (fm_backend.h router_softmax_group_fwd / _bwd; the contract
 * in full: backend/cpu/cpu_router_softmax_group.c): softmax affinities, "greedy" or
 * "group_limited_greedy" top-k (groups scored by their largest prob), the gates prob x
 * routed_scaling_factor, never renormalized (DeepSeek-V2, arXiv 2405.04434 §2.2; transformers'
 * DeepseekV2Moe). Twin of the CPU op, operation for operation in fp32 (the max, the exp sum in e
 * order, the division, the group maxima, the selection passes in the order prob descending / id
 * ascending / NaN last); expf / logf may differ from the host's by an ulp, so the GPU test
 * (tests/gpu/test_cuda_router_softmax_group.c) holds it to the CPU op's ids on rows without a
 * near-tie and to its probs, lse and weights within 1e-6. The backward's per-token sums in double,
 * as the CPU's.
 *
 * Work layout: one thread per token for both (a grid-stride loop; the row's E probs re-read from
 * global memory in the selection passes: O(k E) per token, E <= a few hundred for DeepSeek-V2's
 * shapes). Not tuned: the first version, written without a GPU (compiled, not yet run). No reduction
 * across threads, no atomics, nothing allocated, no host wait. */
#include "cuda_internal.h"

#include <math.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ bool sgm_before(float a, int64_t ia, float b, int64_t ib) {
    const float x = a == a ? a : -INFINITY, y = b == b ? b : -INFINITY;
    return x > y || (x == y && ia < ib);
}

__global__ void router_softmax_group_fwd_kernel(float *__restrict__ probs, float *__restrict__ lse,
                                                int32_t *__restrict__ topk_idx, float *__restrict__ topk_w,
                                                const float *__restrict__ logits, int64_t N, int64_t E, int64_t k,
                                                int64_t n_group, int64_t topk_group, float scaling) {
    const int64_t gs = E / n_group;
    for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x) {
        const float *x = logits + n * E;
        float *p = probs + n * E;
        float mx = x[0];
        for (int64_t e = 1; e < E; e++) mx = x[e] > mx ? x[e] : mx;
        float s = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            p[e] = expf(x[e] - mx);
            s += p[e];
        }
        for (int64_t e = 0; e < E; e++) p[e] /= s;
        lse[n] = mx + logf(s);
        uint64_t kept = n_group == 1 ? ~(uint64_t)0 : 0; /* bit g: group g kept (n_group <= 64) */
        if (n_group > 1) {
            float gsc[FM_ROUTER_MAX_GROUPS];
            for (int64_t g = 0; g < n_group; g++) {
                int64_t b = g * gs;
                for (int64_t e = g * gs + 1; e < (g + 1) * gs; e++)
                    if (sgm_before(p[e], e, p[b], b)) b = e;
                gsc[g] = p[b];
            }
            for (int64_t j = 0; j < topk_group; j++) {
                int64_t best = -1;
                for (int64_t g = 0; g < n_group; g++)
                    if (!(kept >> g & 1u) && (best < 0 || sgm_before(gsc[g], g, gsc[best], best))) best = g;
                kept |= (uint64_t)1 << best;
            }
        }
        int32_t *idx = topk_idx + n * k;
        float *tw = topk_w + n * k;
        float prev = 0.0f;
        int64_t prev_id = -1;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            float bv = 0.0f;
            for (int64_t e = 0; e < E; e++) {
                const float v = (kept >> (e / gs) & 1u) ? p[e] : 0.0f;
                if (prev_id >= 0 && !sgm_before(prev, prev_id, v, e)) continue; /* taken */
                if (best < 0 || sgm_before(v, e, bv, best)) { best = e; bv = v; }
            }
            idx[j] = (int32_t)best;
            tw[j] = p[best] * scaling;
            prev = bv;
            prev_id = best;
        }
    }
}

__global__ void router_softmax_group_bwd_kernel(float *__restrict__ dlogits, const float *__restrict__ dtopk_w,
                                                const float *__restrict__ gpe, float z_scale,
                                                const float *__restrict__ probs, const float *__restrict__ lse,
                                                const int32_t *__restrict__ topk_idx, int64_t N, int64_t E, int64_t k,
                                                float scaling) {
    for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x) {
        const float *p = probs + n * E;
        const int32_t *idx = topk_idx + n * k;
        const float *dw = dtopk_w ? dtopk_w + n * k : NULL;
        float *dl = dlogits + n * E;
        double dot = 0;
        if (gpe)
            for (int64_t e = 0; e < E; e++) dot += (double)p[e] * gpe[e];
        if (dw)
            for (int64_t j = 0; j < k; j++) dot += (double)p[idx[j]] * ((double)scaling * dw[j]);
        const double zt = 2.0 * (double)z_scale * (double)lse[n];
        for (int64_t e = 0; e < E; e++) {
            const double g = gpe ? gpe[e] : 0.0;
            dl[e] = (float)(p[e] * (g - dot + zt));
        }
        if (dw)
            for (int64_t j = 0; j < k; j++) {
                const int64_t e = idx[j];
                const double g = gpe ? gpe[e] : 0.0;
                dl[e] = (float)(p[e] * (g + (double)scaling * dw[j] - dot + zt));
            }
    }
}

int sgm_blocks(int64_t N, int threads) {
    const int64_t want = (N + threads - 1) / threads;
    return (int)(want < 4096 ? want : 4096);
}

} /* namespace */

extern "C" {

void fm_cuda_router_softmax_group_fwd(void *ctx, float *probs, float *lse, int32_t *topk_idx, float *topk_w,
                                      const float *logits, int64_t N, int64_t E, int64_t k, int64_t n_group,
                                      int64_t topk_group, float scaling) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group);
    FM_ASSERT(k >= 1 && k <= topk_group * (E / n_group) && E <= INT32_MAX && n_group <= FM_ROUTER_MAX_GROUPS);
    if (N == 0) return;
    router_softmax_group_fwd_kernel<<<sgm_blocks(N, 128), 128, 0, c->stream>>>(probs, lse, topk_idx, topk_w, logits,
                                                                               N, E, k, n_group, topk_group, scaling);
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_router_softmax_group_bwd(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                                      float z_scale, const float *probs, const float *lse, const int32_t *topk_idx,
                                      int64_t N, int64_t E, int64_t k, float scaling) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && k >= 1 && k <= E);
    if (N == 0) return;
    router_softmax_group_bwd_kernel<<<sgm_blocks(N, 128), 128, 0, c->stream>>>(
        dlogits, dtopk_w, dprobs_per_expert, z_scale, probs, lse, topk_idx, N, E, k, scaling);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
