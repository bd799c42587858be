/* The CPU backend's sigmoid router (fm_backend.h router_sigmoid_fwd / router_sigmoid_bwd): the
 * DeepSeek-V3 router (arXiv 2412.19437 §2.1.2: sigmoid affinities, a per-expert bias added for
 * the top-k selection only, node-limited = group-limited routing, normalized gate values times a
 * scaling factor), as transformers' Glm4MoeTopkRouter computes it. Per token, parallel over
 * tokens, a fixed order within a token; the CUDA twin (cuda_router_sigmoid.cu) runs the same
 * float operations in the same order. */
#include "cpu_internal.h"

#include <math.h>

#define FM_CPU_PAR_MIN 8192

/* Whether (a, ia) comes before (b, ib) in the selection order: value descending, id ascending,
 * NaN after every number. */
static inline bool before(float a, int64_t ia, float b, int64_t ib) {
    const float x = a == a ? a : -INFINITY, y = b == b ? b : -INFINITY;
    return x > y || (x == y && ia < ib);
}

/* The choice score of expert e (fm_backend.h): scores + bias, 0.0 in a group not kept (kept
 * NULL: every group kept). */
static inline float choice(const float *s, const fm_act *bias, const bool *kept, int64_t gs, int64_t e) {
    if (kept && !kept[e / gs]) return 0.0f;
    return s[e] + (bias ? (float)bias[e] : 0.0f);
}

/* The k first of the choice scores of experts [e0, e0 + n) in the selection order into idx
 * (ids relative to e0; repeated selection as the softmax router's: each pass takes the first
 * element strictly after the previous pick, O(k n), no scratch). */
static void select_topk(const float *s, const fm_act *bias, const bool *kept, int64_t gs, int64_t e0, int64_t n,
                        int64_t k, int32_t *idx) {
    float prev = 0;
    int64_t prev_id = -1;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        float bv = 0;
        for (int64_t e = 0; e < n; e++) {
            const float v = choice(s, bias, kept, gs, e0 + e);
            if (prev_id >= 0 && !before(prev, prev_id, v, e)) continue; /* taken */
            if (best < 0 || before(v, e, bv, best)) { best = e; bv = v; }
        }
        FM_ASSERT(best >= 0);
        idx[j] = (int32_t)best;
        prev = bv;
        prev_id = best;
    }
}

/* The topk_group first of the group scores g[0..n) (the same order) into kept [n]. */
static void keep_groups(const float *g, int64_t n, int64_t topk_group, bool *kept) {
    for (int64_t i = 0; i < n; i++) kept[i] = false;
    for (int64_t j = 0; j < topk_group; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++)
            if (!kept[i] && (best < 0 || before(g[i], i, g[best], best))) best = i;
        kept[best] = true;
    }
}

void fm_cpu_router_sigmoid_fwd(void *ctx, float *scores, float *lse, int32_t *topk_idx, float *topk_w,
                               const float *logits, const fm_act *bias, int64_t N, int64_t E, int64_t k,
                               int64_t n_group, int64_t topk_group, bool norm_topk, float scaling) {
    const int threads = ((const fm_cpu_ctx *)ctx)->threads;
    FM_ASSERT(E >= 1 && n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group);
    FM_ASSERT(k >= 1 && k <= topk_group * (E / n_group) && E <= INT32_MAX && n_group <= FM_ROUTER_MAX_GROUPS);
    FM_ASSERT(n_group == 1 || E / n_group >= 2);
    const int64_t gs = E / n_group;
#pragma omp parallel for num_threads(threads) schedule(static) if (N * E >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
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
        bool kept_buf[FM_ROUTER_MAX_GROUPS];
        const bool *kept = NULL;
        if (n_group > 1) { /* group-limited: a group's score is the sum of its 2 best choices */
            float gsc[FM_ROUTER_MAX_GROUPS];
            for (int64_t g = 0; g < n_group; g++) {
                int32_t two[2];
                select_topk(s, bias, NULL, gs, g * gs, gs, 2, two);
                gsc[g] = choice(s, bias, NULL, gs, g * gs + two[0]) + choice(s, bias, NULL, gs, g * gs + two[1]);
            }
            keep_groups(gsc, n_group, topk_group, kept_buf);
            kept = kept_buf;
        }
        int32_t *idx = topk_idx + n * k;
        float *tw = topk_w + n * k;
        select_topk(s, bias, kept, gs, 0, E, k, idx);
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            tw[j] = s[idx[j]];
            sum += tw[j];
        }
        const float den = sum + 1e-20f;
        for (int64_t j = 0; j < k; j++) tw[j] = (norm_topk ? tw[j] / den : tw[j]) * scaling;
    }
}

void fm_cpu_router_sigmoid_bwd(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                               const float *scores, const int32_t *topk_idx, int64_t N, int64_t E, int64_t k,
                               bool norm_topk, float scaling) {
    const int threads = ((const fm_cpu_ctx *)ctx)->threads;
    FM_ASSERT(E >= 1 && k >= 1 && k <= E);
#pragma omp parallel for num_threads(threads) schedule(static) if (N * E >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *s = scores + n * E;
        const int32_t *idx = topk_idx + n * k;
        float *dl = dlogits + n * E;
        for (int64_t e = 0; e < E; e++) {
            const double g = dprobs_per_expert ? (double)dprobs_per_expert[e] : 0.0;
            dl[e] = (float)((double)s[e] * (1.0 - (double)s[e]) * g);
        }
        if (!dtopk_w) continue;
        const float *dw = dtopk_w + n * k;
        double S = 1e-20, dot = 0;
        if (norm_topk) {
            for (int64_t j = 0; j < k; j++) S += s[idx[j]];
            for (int64_t j = 0; j < k; j++) dot += (double)dw[j] * s[idx[j]];
        }
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = idx[j];
            FM_ASSERT(e >= 0 && e < E);
            const double ds = norm_topk ? (double)scaling * ((double)dw[j] - dot / S) / S : (double)scaling * dw[j];
            const double g = dprobs_per_expert ? (double)dprobs_per_expert[e] : 0.0;
            dl[e] = (float)((double)s[e] * (1.0 - (double)s[e]) * (g + ds));
        }
    }
}
