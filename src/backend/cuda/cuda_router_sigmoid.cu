/* The CUDA backend's sigmoid router (fm_backend.h router_sigmoid_fwd / router_sigmoid_bwd: the
 * DeepSeek-V3 router, arXiv 2412.19437 §2.1.2, as transformers' Glm4MoeTopkRouter computes it).
 * Twin of the CPU backend's cpu_router_sigmoid.c, operation for operation in fp32 (the sigmoid,
 * the choice = score + bias, the group scores as the sum of a group's 2 best choices, the groups
 * not kept at 0.0, the selection by repeated passes in the order value descending / id
 * ascending / NaN last, the weights' sum in j order); the backward's per-token sums in double.
 * expf / logf may differ from the host's by an ulp, so the GPU test (tests/gpu/
 * test_cuda_router_sigmoid.c) compares against the fp64 reference within 1e-6, ids exactly.
 *
 * Work layout. Forward: one warp per token (router_sigmoid_fwd_kernel's comment: the scores and
 * the experts' passes spread over the lanes, the group scores one group per lane, every selection
 * pass a warp-wide first-of by shuffles, the sums that set bits by one lane in the serial order),
 * so its ids, weights, scores and lse are the one-thread-per-token kernel's bits: selection is
 * exact comparison, and every fp32 operation is the serial kernel's, in its order (a float max is
 * exact in any order). Backward: one thread per token, a grid-stride loop. No reduction across
 * threads of different tokens, no atomics, nothing allocated, no host wait. */
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

/* The warp's first of (v, id) in the selection order over its lanes' candidates (id < 0: none),
 * by a butterfly of shuffles: every lane ends with the same pair (the order is total: value
 * descending with NaN as -inf, then id ascending), so the winner is the serial scan's. */
__device__ __forceinline__ void sg_warp_first(float &v, int32_t &id) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int32_t oid = __shfl_xor_sync(0xffffffffu, id, o);
        if (oid >= 0 && (id < 0 || sg_before(ov, oid, v, id))) v = ov, id = oid;
    }
}

/* Experts at most for the per-warp shared copy of exp(x - max) (the lse's serial sum); above it
 * lane 0 forms them again (the same expf, the same bits). */
#define SG_SMEM_E 512
#define SG_WARPS 4

/* One warp per token (a grid-stride loop over tokens by warps). Lanes take experts e = lane,
 * lane + 32, ...: the scores (written), the max logit by shuffles (exact), exp(x - max) into the
 * warp's shared row, summed by lane 0 in e order (the serial kernel's sum, bit for bit); the group
 * scores by lane g (groups g = lane, lane + 32) with the serial sg_select over its group; the
 * topk_group groups and then the k experts by repeated warp-wide first-of passes (sg_warp_first),
 * each pass taking the first candidate strictly after the previous pick, as the serial scan
 * does; the weights by lane 0 in j order. Selection is exact comparison and the arithmetic is the
 * serial kernel's, in the same order: ids, weights, scores and lse are its bits (and the CPU op's
 * up to expf / logf: tests/gpu/test_cuda_router_sigmoid.c). */
__global__ void __launch_bounds__(SG_WARPS * 32)
    router_sigmoid_fwd_kernel(float *__restrict__ scores, float *__restrict__ lse, int32_t *__restrict__ topk_idx,
                              float *__restrict__ topk_w, const float *__restrict__ logits,
                              const bf16 *__restrict__ bias, int64_t N, int64_t E, int64_t k, int64_t n_group,
                              int64_t topk_group, bool norm, float scaling) {
    __shared__ float ex_sh[SG_WARPS][SG_SMEM_E];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int64_t gs = E / n_group;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t n = blockIdx.x * (int64_t)(blockDim.x >> 5) + wib; n < N; n += warps) {
        const float *x = logits + n * E;
        float *s = scores + n * E;
        float mx = x[0];
        for (int64_t e = lane; e < E; e += 32) {
            s[e] = 1.0f / (1.0f + expf(-x[e]));
            mx = x[e] > mx ? x[e] : mx;
        }
        for (int o = 16; o > 0; o >>= 1) { /* max is exact in any order (NaN as the serial's: skipped) */
            const float om = __shfl_xor_sync(0xffffffffu, mx, o);
            mx = om > mx ? om : mx;
        }
        if (E <= SG_SMEM_E)
            for (int64_t e = lane; e < E; e += 32) ex_sh[wib][e] = expf(x[e] - mx);
        __syncwarp(); /* s and the shared row written */
        if (lane == 0) {
            float se = 0.0f;
            for (int64_t e = 0; e < E; e++) se += E <= SG_SMEM_E ? ex_sh[wib][e] : expf(x[e] - mx);
            lse[n] = mx + logf(se);
        }
        uint64_t kept = ~(uint64_t)0; /* bit g: group g kept */
        if (n_group > 1) { /* group-limited: a group's score is the sum of its 2 best choices */
            float g_lo = 0.0f, g_hi = 0.0f; /* groups lane and lane + 32 */
            for (int h = 0; h < 2; h++) {
                const int64_t g = lane + 32 * h;
                if (g >= n_group) continue;
                int32_t two[2];
                sg_select(s, bias, NULL, gs, g * gs, gs, 2, two);
                const float v =
                    sg_choice(s, bias, NULL, gs, g * gs + two[0]) + sg_choice(s, bias, NULL, gs, g * gs + two[1]);
                if (h == 0) g_lo = v; else g_hi = v;
            }
            kept = 0;
            for (int64_t j = 0; j < topk_group; j++) {
                float bv = 0.0f;
                int32_t bid = -1;
                for (int h = 0; h < 2; h++) {
                    const int32_t g = lane + 32 * h;
                    const float v = h == 0 ? g_lo : g_hi;
                    if (g >= n_group || (kept >> g & 1u)) continue;
                    if (bid < 0 || sg_before(v, g, bv, bid)) bv = v, bid = g;
                }
                sg_warp_first(bv, bid);
                kept |= (uint64_t)1 << bid;
            }
        }
        int32_t *idx = topk_idx + n * k;
        float prev = 0.0f;
        int32_t prev_id = -1;
        for (int64_t j = 0; j < k; j++) { /* the k first choices, each strictly after the previous */
            float bv = 0.0f;
            int32_t bid = -1;
            for (int64_t e = lane; e < E; e += 32) {
                const float v = (kept >> (e / gs) & 1u) ? s[e] + (bias ? __bfloat162float(bias[e]) : 0.0f) : 0.0f;
                if (prev_id >= 0 && !sg_before(prev, prev_id, v, e)) continue; /* taken */
                if (bid < 0 || sg_before(v, e, bv, bid)) bv = v, bid = (int32_t)e;
            }
            sg_warp_first(bv, bid);
            if (lane == 0) idx[j] = bid;
            prev = bv;
            prev_id = bid;
        }
        __syncwarp(); /* idx written */
        if (lane == 0) {
            float *tw = topk_w + n * k;
            float sum = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                tw[j] = s[idx[j]];
                sum += tw[j];
            }
            const float den = sum + 1e-20f;
            for (int64_t j = 0; j < k; j++) tw[j] = (norm ? tw[j] / den : tw[j]) * scaling;
        }
        __syncwarp(); /* the shared row is reused by the warp's next token */
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
    router_sigmoid_fwd_kernel<<<sg_blocks(N, SG_WARPS), SG_WARPS * 32, 0, c->stream>>>(
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
