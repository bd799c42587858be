/* The strip ops of linear cross-entropy (fm_backend.h: lce_fold, lce_finalize, lce_strip_grad)
 * on the CPU: the online log-sum-exp of Milakov & Gimelshein 2018 (arXiv 1805.02867) folded one
 * vocabulary block at a time, as in Wijmans et al., Cut Your Losses (arXiv 2411.09009), and the
 * blocked logit gradient softmax - onehot with Liger-Kernel's z-loss term 2 s lse p.
 *
 * Layouts: strip and grad [Nb,Vb] fp32 (row stride Vb); m, z, tgt, ent [Nb] fp32; targets [Nb]
 * int32; weights [Nb] fp32 or NULL.
 * Determinism (cpu_internal.h): fold and strip_grad are parallel over rows, each row computed
 * by one thread in a fixed order — exp sums in four fp32 lanes over chunks of 256 columns,
 * combined as (l0 + l1) + (l2 + l3), the chunk sums added in double in column order; finalize
 * runs sequentially in row order. So the bits do not depend on the thread count.
 */
#include "cpu_internal.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#define FM_CPU_PAR_MIN 8192
/* Columns per fp32 partial sum; partial sums are added in double. */
#define FM_CPU_LCE_CHUNK 256

static inline int cpu_threads(void *ctx) { return ((const fm_cpu_ctx *)ctx)->threads; }

/* se = sum_i exp(x_i - sub) and, when sed != NULL, sed = sum_i exp(x_i - sub) (x_i - sub), for
 * i < n. Four fp32 lanes per chunk of FM_CPU_LCE_CHUNK columns, chunk sums added in double.
 * A tail shorter than 4 is padded with d = -200 (exp gives exactly 0, so the pad adds 0). An
 * element with exp(d) == 0 adds 0 to sed, also for d = -inf. */
static void lce_exp_sums(const float *x, int64_t n, float sub, double *se, double *sed) {
    const fm_cpu_v4f s4 = fm_cpu_v4f_splat(sub), zero = fm_cpu_v4f_splat(0.0f);
    double te = 0, ted = 0;
    for (int64_t c0 = 0; c0 < n; c0 += FM_CPU_LCE_CHUNK) {
        const int64_t c1 = c0 + FM_CPU_LCE_CHUNK < n ? c0 + FM_CPU_LCE_CHUNK : n;
        fm_cpu_v4f ae = zero, aed = zero;
        for (int64_t i = c0; i < c1; i += 4) {
            fm_cpu_v4f d;
            if (i + 4 <= c1) {
                __builtin_memcpy(&d, x + i, sizeof d);
                d -= s4;
            } else {
                float t[4] = {-200.0f, -200.0f, -200.0f, -200.0f};
                for (int64_t j = 0; j < c1 - i; j++) t[j] = x[i + j] - sub;
                __builtin_memcpy(&d, t, sizeof d);
            }
            const fm_cpu_v4f e = fm_cpu_exp4(d);
            ae += e;
            if (sed) aed += fm_cpu_v4f_select(e > zero, e * d, zero);
        }
        te += (double)((ae[0] + ae[1]) + (ae[2] + ae[3]));
        ted += (double)((aed[0] + aed[1]) + (aed[2] + aed[3]));
    }
    *se = te;
    if (sed) *sed = ted;
}

/* lce_fold (fm_backend.h): per row, the block max bm, m' = max(m, bm), then the block's sums
 * relative to m' (lce_exp_sums) and the rescale of the old state by exp(m - m') (libm exp in
 * double: one per row and block). */
void fm_cpu_lce_fold(void *ctx, float *m, float *z, float *tgt, float *ent, const float *strip,
                     const int32_t *targets, int64_t Nb, int64_t Vb, int64_t v0, bool first) {
    FM_ASSERT(Nb >= 0 && Vb >= 1 && v0 >= 0);
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (Nb * Vb >= FM_CPU_PAR_MIN)
    for (int64_t r = 0; r < Nb; r++) {
        const float *s = strip + r * Vb;
        const float m_old = first ? -INFINITY : m[r];
        const float bm = fm_cpu_max(s, Vb, -INFINITY);
        const float m_new = bm > m_old ? bm : m_old;
        double se = 0, sed = 0;
        if (m_new != -INFINITY) lce_exp_sums(s, Vb, m_new, &se, ent ? &sed : NULL);
        if (first || m_old == -INFINITY) {
            z[r] = (float)se;
            if (ent) ent[r] = (float)sed;
        } else {
            const double dm = (double)m_old - (double)m_new, sc = exp(dm);
            const double z_old = z[r];
            z[r] = (float)(z_old * sc + se);
            if (ent) ent[r] = (float)(sc * ((double)ent[r] + dm * z_old) + sed);
        }
        m[r] = m_new;
        if (first) tgt[r] = NAN;
        const int64_t t = targets[r];
        if (t >= v0 && t < v0 + Vb) tgt[r] = s[t - v0];
    }
}

/* lce_finalize (fm_backend.h): sequential over rows, in double: log z, loss = (m - tgt) + log z
 * (the difference of the two large numbers first, so logits near 1e5 keep their precision),
 * entropy = log z - ent / z, lse = m + log z. */
void fm_cpu_lce_finalize(void *ctx, float *loss, float *logprob, float *entropy, double *sums,
                           const float *m, const float *z, const float *tgt, const float *ent,
                           const int32_t *targets, const float *weights, int64_t Nb, int64_t V,
                           int32_t ignore_index) {
    (void)ctx;
    FM_ASSERT(Nb >= 0 && V >= 1 && (entropy == NULL || ent != NULL));
    double ce = 0, zs = 0;
    for (int64_t r = 0; r < Nb; r++) {
        const int32_t t = targets[r];
        const double lz = log((double)z[r]);
        if (entropy) entropy[r] = (float)(lz - (double)ent[r] / (double)z[r]);
        if (t == ignore_index) {
            loss[r] = 0.0f;
            if (logprob) logprob[r] = 0.0f;
            continue;
        }
        FM_ASSERT(t >= 0 && t < V);
        const double l = ((double)m[r] - (double)tgt[r]) + lz, lse = (double)m[r] + lz;
        const double w = weights ? (double)weights[r] : 1.0;
        loss[r] = (float)l;
        if (logprob) logprob[r] = (float)-l;
        ce += w * l;
        zs += w * lse * lse;
    }
    sums[0] += ce;
    sums[1] += zs;
}

/* lce_strip_grad (fm_backend.h): per row, e_i = exp(S_i - m) (fm_cpu_exp_sub_sum, written into
 * grad; each element is read before it is written, so grad may alias strip), then
 * grad_i = e_i * f with f = grad_scale * w * (1 + 2 z_coef lse) / z, and the target column
 * minus grad_scale * w. */
void fm_cpu_lce_strip_grad(void *ctx, float *grad, const float *strip, const float *m,
                           const float *z, const int32_t *targets, const float *weights,
                           int64_t Nb, int64_t Vb, int64_t v0, int32_t ignore_index,
                           float grad_scale, float z_coef) {
    FM_ASSERT(Nb >= 0 && Vb >= 1 && v0 >= 0);
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (Nb * Vb >= FM_CPU_PAR_MIN)
    for (int64_t r = 0; r < Nb; r++) {
        float *g = grad + r * Vb;
        const int32_t t = targets[r];
        if (t == ignore_index) {
            memset(g, 0, (size_t)Vb * sizeof(float));
            continue;
        }
        const double lse = (double)m[r] + log((double)z[r]);
        const double c = (double)grad_scale * (weights ? (double)weights[r] : 1.0);
        const float f = (float)(c * (1.0 + 2.0 * (double)z_coef * lse) / (double)z[r]);
        (void)fm_cpu_exp_sub_sum(g, strip + r * Vb, m[r], Vb);
#pragma omp simd
        for (int64_t i = 0; i < Vb; i++) g[i] *= f;
        if (t >= v0 && t < v0 + Vb) g[t - v0] -= (float)c;
    }
}
