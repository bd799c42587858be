/* The CPU backend's DeepSeek-V2 router (fm_backend.h router_softmax_group_fwd / _bwd): softmax
 * affinities over all routed experts, device-limited = group-limited routing with a group's score
 * the largest affinity in it, top-k, the gate values the affinities times a scaling factor, never
 * renormalized (DeepSeek-V2, arXiv 2405.04434 §2.2.1-2.2.2; transformers' DeepseekV2Moe
 * route_tokens_to_experts: topk_method "greedy" or "group_limited_greedy"). Per token, parallel over
 * tokens, a fixed order within a token. The softmax is router_fwd's (cpu_moe.c) operation for
 * operation, so "greedy" with scaling 1 gives router_fwd's bits (tests/test_router_softmax_group.c).
 *
 * The ops' contract (fm_backend.h router_softmax_group_fwd / _bwd), per token n, in fp32:
 *   probs [N,E] = softmax(logits[n]), lse [N] = logsumexp(logits[n]) (router_fwd's arithmetic: the max
 *     subtracted, expf, divided by the fp32 sum added in e order);
 *   n_group > 1 ("group_limited_greedy"): group g's score = the largest prob of its E/n_group
 *     contiguous experts, the topk_group best groups kept (ties: lower group id; NaN last), every
 *     expert of the other groups chosen as 0.0 (transformers' masked_fill with 0.0);
 *     n_group == 1 ("greedy"): every expert kept;
 *   topk_idx [N,k] = the k largest choices (decreasing; ties: lower id; NaN last);
 *   topk_w [N,k] = probs at those experts times scaling (routed_scaling_factor), never renormalized
 *     (transformers' DeepseekV2Moe ignores norm_topk_prob). (A chosen masked expert, possible only
 *     when kept probs underflow to 0, weighs its prob, where transformers' weighs 0.)
 *   1 <= k <= topk_group * E / n_group, n_group divides E, n_group <= FM_ROUTER_MAX_GROUPS.
 * Backward: dlogits [N,E] ASSIGNED, router_bwd's gradient without renormalization, the top-k weights'
 *   gradient dtopk_w [N,k] (NULL: none) times scaling: with p = probs[n],
 *   dp_e = g_e (dprobs_per_expert [E], NULL: 0) + [e = idx_j] scaling dtopk_w_j,
 *   dlogit_e = p_e (dp_e - sum_f p_f dp_f) + 2 z_scale lse[n] p_e (the z-loss), per token in double.
 *   The group mask and the selection get no gradient.
 * logits, probs, dlogits [N,E] fp32; backend (host) memory. The CUDA twin: cuda_router_softmax_group.cu. */
#include "cpu_internal.h"

#include <math.h>

#define FM_CPU_PAR_MIN 8192

/* Whether (a, ia) comes before (b, ib) in the selection order: value descending, id ascending,
 * NaN after every number. */
static inline bool before(float a, int64_t ia, float b, int64_t ib) {
    const float x = a == a ? a : -INFINITY, y = b == b ? b : -INFINITY;
    return x > y || (x == y && ia < ib);
}

void fm_cpu_router_softmax_group_fwd(void *ctx, float *probs, float *lse, int32_t *topk_idx, float *topk_w,
                                     const float *logits, int64_t N, int64_t E, int64_t k, int64_t n_group,
                                     int64_t topk_group, float scaling) {
    const int threads = ((const fm_cpu_ctx *)ctx)->threads;
    FM_ASSERT(E >= 1 && n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group);
    FM_ASSERT(k >= 1 && k <= topk_group * (E / n_group) && E <= INT32_MAX && n_group <= FM_ROUTER_MAX_GROUPS);
    const int64_t gs = E / n_group;
#pragma omp parallel for num_threads(threads) schedule(static) if (N * E >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
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
        bool kept[FM_ROUTER_MAX_GROUPS];
        for (int64_t g = 0; g < n_group; g++) kept[g] = n_group == 1;
        if (n_group > 1) { /* group score: the group's largest prob (a max: exact in any order) */
            float gsc[FM_ROUTER_MAX_GROUPS];
            for (int64_t g = 0; g < n_group; g++) {
                int64_t b = g * gs;
                for (int64_t e = g * gs + 1; e < (g + 1) * gs; e++)
                    if (before(p[e], e, p[b], b)) b = e;
                gsc[g] = p[b];
            }
            for (int64_t j = 0; j < topk_group; j++) {
                int64_t best = -1;
                for (int64_t g = 0; g < n_group; g++)
                    if (!kept[g] && (best < 0 || before(gsc[g], g, gsc[best], best))) best = g;
                kept[best] = true;
            }
        }
        /* k passes, each taking the first choice strictly after the previous pick (no scratch) */
        int32_t *idx = topk_idx + n * k;
        float *tw = topk_w + n * k;
        float prev = 0.0f;
        int64_t prev_id = -1;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            float bv = 0.0f;
            for (int64_t e = 0; e < E; e++) {
                const float v = kept[e / gs] ? p[e] : 0.0f;
                if (prev_id >= 0 && !before(prev, prev_id, v, e)) continue; /* taken */
                if (best < 0 || before(v, e, bv, best)) { best = e; bv = v; }
            }
            FM_ASSERT(best >= 0);
            idx[j] = (int32_t)best;
            tw[j] = p[best] * scaling; /* transformers' masked 0.0 wins only over kept probs underflowed to 0 */
            prev = bv;
            prev_id = best;
        }
    }
}

void fm_cpu_router_softmax_group_bwd(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                                     float z_scale, const float *probs, const float *lse, const int32_t *topk_idx,
                                     int64_t N, int64_t E, int64_t k, float scaling) {
    const int threads = ((const fm_cpu_ctx *)ctx)->threads;
    FM_ASSERT(E >= 1 && k >= 1 && k <= E);
    const float *gpe = dprobs_per_expert;
#pragma omp parallel for num_threads(threads) schedule(static) if (N * E >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *p = probs + n * E;
        const int32_t *idx = topk_idx + n * k;
        const float *dw = dtopk_w ? dtopk_w + n * k : NULL;
        float *dl = dlogits + n * E;
        double dot = 0; /* sum_f p_f dp_f */
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
                FM_ASSERT(e >= 0 && e < E);
                const double g = gpe ? gpe[e] : 0.0;
                dl[e] = (float)(p[e] * (g + (double)scaling * dw[j] - dot + zt));
            }
    }
}
