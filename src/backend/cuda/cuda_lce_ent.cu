/* The CUDA backend's lce_strip_grad_ent (fm_backend.h): the linear CE's logit gradient with the
 * entropy term of the RL head's entropy bonus. Twin of backend/cpu/cpu_lce_ent.c: per element in
 * double, lp = S - lse, p = exp(lp), g = c (1 + 2 z_coef lse) p - grad_scale ent_w p (lp + H), the
 * target column minus c (c = grad_scale w); rows whose target is ignore_index are zero.
 *
 * Work layout: one thread per element (grid-stride), the row's lse recomputed per element from
 * m and z (log in double), the target subtraction by the thread that owns the column. Each element
 * is read before it is written by the same thread, so grad may alias strip. No reduction, no
 * atomics, nothing allocated, no host wait. (Double arithmetic: a first, plain form, untimed.) */
#include "cuda_internal.h"

#include <math.h>
#include <stdint.h>

namespace {

__global__ void lce_strip_grad_ent_kernel(float *grad, const float *strip, const float *__restrict__ m,
                                          const float *__restrict__ z, const int32_t *__restrict__ targets,
                                          const float *__restrict__ weights, const float *__restrict__ ent_w,
                                          const float *__restrict__ ent, int64_t Nb, int64_t Vb, int64_t v0,
                                          int32_t ignore_index, float grad_scale, float z_coef) {
    const int64_t n = Nb * Vb;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / Vb, i = e - r * Vb;
        const int32_t t = targets[r];
        if (t == ignore_index) {
            grad[e] = 0.0f;
            continue;
        }
        const double lse = (double)m[r] + log((double)z[r]);
        const double c = (double)grad_scale * (weights ? (double)weights[r] : 1.0);
        const double fc = c * (1.0 + 2.0 * (double)z_coef * lse), fe = (double)grad_scale * (double)ent_w[r];
        const double lp = (double)strip[e] - lse, p = exp(lp);
        float g = (float)(fc * p - fe * p * (lp + (double)ent[r]));
        if (t == v0 + i) g -= (float)c;
        grad[e] = g;
    }
}

} /* namespace */

extern "C" {

void fm_cuda_lce_strip_grad_ent(void *ctx, float *grad, const float *strip, const float *m, const float *z,
                                const int32_t *targets, const float *weights, const float *ent_w, const float *ent,
                                int64_t Nb, int64_t Vb, int64_t v0, int32_t ignore_index, float grad_scale,
                                float z_coef) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(Nb >= 0 && Vb >= 1 && v0 >= 0 && ent_w && ent);
    if (Nb == 0) return;
    const int threads = 256;
    const int64_t want = (Nb * Vb + threads - 1) / threads;
    const int blocks = (int)(want < 65536 ? want : 65536);
    lce_strip_grad_ent_kernel<<<blocks, threads, 0, c->stream>>>(grad, strip, m, z, targets, weights, ent_w, ent, Nb,
                                                                 Vb, v0, ignore_index, grad_scale, z_coef);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
