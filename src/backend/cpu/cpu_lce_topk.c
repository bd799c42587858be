/* The CPU backend's top-k strip ops of linear cross-entropy (fm_backend.h: lce_topk_fold,
 * lce_topk_finalize): a running top-k of each row's logits merged across the vocabulary blocks
 * (never N x V), then log-probs against the row's log-sum-exp. The CUDA twin is
 * backend/cuda/cuda_lce_topk.cu. */
#include "cpu_internal.h"

#include <math.h>

#define FM_CPU_PAR_MIN 8192

/* (v, id) before (tv, ti) in the strict order: logit descending, id ascending. */
static inline bool topk_before(float v, int32_t id, float tv, int32_t ti) {
    return v > tv || (v == tv && ti >= 0 && id < ti) || (ti < 0 && v == v);
}

void fm_cpu_lce_topk_fold(void *ctx, float *topv, int32_t *topi, const float *strip, int64_t Nb, int64_t Vb,
                          int64_t v0, int64_t k, bool first) {
    FM_ASSERT(Nb >= 0 && Vb >= 1 && v0 >= 0 && k >= 1);
    const int threads = ((const fm_cpu_ctx *)ctx)->threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (Nb * Vb >= FM_CPU_PAR_MIN)
    for (int64_t r = 0; r < Nb; r++) {
        float *tv = topv + r * k;
        int32_t *ti = topi + r * k;
        if (first)
            for (int64_t j = 0; j < k; j++) tv[j] = -INFINITY, ti[j] = -1;
        const float *s = strip + r * Vb;
        for (int64_t i = 0; i < Vb; i++) {
            const float v = s[i];
            const int32_t id = (int32_t)(v0 + i);
            if (!topk_before(v, id, tv[k - 1], ti[k - 1])) continue; /* not in the top k (NaN never is) */
            int64_t j = k - 1;
            for (; j > 0 && topk_before(v, id, tv[j - 1], ti[j - 1]); j--) tv[j] = tv[j - 1], ti[j] = ti[j - 1];
            tv[j] = v;
            ti[j] = id;
        }
    }
}

void fm_cpu_lce_topk_finalize(void *ctx, float *out_lp, int32_t *out_id, const float *topv, const int32_t *topi,
                              const float *m, const float *z, int64_t Nb, int64_t k) {
    (void)ctx;
    FM_ASSERT(Nb >= 0 && k >= 1);
    for (int64_t r = 0; r < Nb; r++) {
        const double lz = log((double)z[r]);
        for (int64_t j = 0; j < k; j++) {
            const int32_t id = topi[r * k + j];
            out_id[r * k + j] = id;
            out_lp[r * k + j] = id < 0 ? -INFINITY : (float)-(((double)m[r] - (double)topv[r * k + j]) + lz);
        }
    }
}
