/* The CPU backend's lce_strip_grad_ent (fm_backend.h): the linear CE's logit gradient with the
 * entropy term of the RL head's entropy bonus, per element in double:
 *   lp = S - lse, p = exp(lp), g = c (1 + 2 z_coef lse) p - grad_scale ent_w p (lp + H)
 * and the target column minus c (c = grad_scale w). Each element is read before it is written, so
 * grad may alias strip. The CUDA twin is backend/cuda/cuda_lce_ent.cu (the same formula). */
#include "cpu_internal.h"

#include <math.h>
#include <omp.h>
#include <string.h>

void fm_cpu_lce_strip_grad_ent(void *ctx, float *grad, const float *strip, const float *m, const float *z,
                               const int32_t *targets, const float *weights, const float *ent_w, const float *ent,
                               int64_t Nb, int64_t Vb, int64_t v0, int32_t ignore_index, float grad_scale,
                               float z_coef) {
    FM_ASSERT(Nb >= 0 && Vb >= 1 && v0 >= 0 && ent_w && ent);
    const int threads = ((const fm_cpu_ctx *)ctx)->threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (Nb * Vb >= 8192)
    for (int64_t r = 0; r < Nb; r++) {
        float *g = grad + r * Vb;
        const float *s = strip + r * Vb;
        const int32_t t = targets[r];
        if (t == ignore_index) {
            memset(g, 0, (size_t)Vb * sizeof(float));
            continue;
        }
        const double lse = (double)m[r] + log((double)z[r]);
        const double c = (double)grad_scale * (weights ? (double)weights[r] : 1.0);
        const double fc = c * (1.0 + 2.0 * (double)z_coef * lse), fe = (double)grad_scale * (double)ent_w[r];
        const double H = ent[r];
        for (int64_t i = 0; i < Vb; i++) {
            const double lp = (double)s[i] - lse, p = exp(lp);
            g[i] = (float)(fc * p - fe * p * (lp + H));
        }
        if (t >= v0 && t < v0 + Vb) g[t - v0] -= (float)c;
    }
}
