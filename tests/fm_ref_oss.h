/* Plain fp64 references of GPT-OSS's operators (issue 26), header-only, shared by the CPU test
 * (tests/test_gpt_oss_ops.c) and the CUDA A/B test (tests/gpu/test_cuda_gpt_oss_ops.c):
 *   the clamped SwiGLU (transformers' GptOssExperts.forward: gate.clamp(max=limit),
 *     up.clamp(-limit, limit), glu = gate sigmoid(alpha gate), out = (up + 1) glu) and its
 *     gradient, torch.clamp's (1 inside the closed interval, 0 outside);
 *   attention with sinks and a sliding window, the naive full-row softmax of
 *     eager_attention_forward (scores, then the sink's logit appended, softmax, the sink's column
 *     dropped) with masking_utils' window (key j visible to query t when kv_start <= j <= t and
 *     j > t - W), O(T^2) per head. */
#ifndef FM_REF_OSS_H
#define FM_REF_OSS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline void fm_ref_swiglu_clamp_fwd(double *out, const double *gate, const double *up, int64_t n, double limit,
                                           double alpha) {
    for (int64_t i = 0; i < n; i++) {
        const double g = gate[i] > limit ? limit : gate[i];
        const double u = up[i] > limit ? limit : up[i] < -limit ? -limit : up[i];
        out[i] = (u + 1.0) * g / (1.0 + exp(-alpha * g));
    }
}

static inline void fm_ref_swiglu_clamp_bwd(double *dgate, double *dup, const double *dout, const double *gate,
                                           const double *up, int64_t n, double limit, double alpha) {
    for (int64_t i = 0; i < n; i++) {
        const double g = gate[i] > limit ? limit : gate[i];
        const double u = up[i] > limit ? limit : up[i] < -limit ? -limit : up[i];
        const double s = 1.0 / (1.0 + exp(-alpha * g));
        dgate[i] = gate[i] <= limit ? dout[i] * (u + 1.0) * (s + alpha * g * s * (1.0 - s)) : 0.0;
        dup[i] = up[i] >= -limit && up[i] <= limit ? dout[i] * g * s : 0.0;
    }
}

/* out [B,T,nh,hd], lse [B,nh,T] (the sink included) from q [B,T,nh,hd], k, v [B,T,nkv,hd];
 * kv_start [B*T] or NULL; sinks [nh] or NULL; W 0: no window. */
static inline void fm_ref_attention_ext(double *out, double *lse, const double *q, const double *k, const double *v,
                                        int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                                        const int32_t *kv_start, const double *sinks, int64_t W) {
    const double scale = 1.0 / sqrt((double)hd);
    double *s = (double *)malloc((size_t)(T > 0 ? T : 1) * sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < nh; h++)
            for (int64_t t = 0; t < T; t++) {
                const int64_t g = h / (nh / nkv);
                int64_t j0 = kv_start ? kv_start[b * T + t] : 0;
                if (W > 0 && t - W + 1 > j0) j0 = t - W + 1;
                const double *qt = q + ((b * T + t) * nh + h) * hd;
                double m = sinks ? sinks[h] : -INFINITY;
                for (int64_t j = j0; j <= t; j++) {
                    const double *kj = k + ((b * T + j) * nkv + g) * hd;
                    double d = 0;
                    for (int64_t x = 0; x < hd; x++) d += qt[x] * kj[x];
                    s[j] = d * scale;
                    m = s[j] > m ? s[j] : m;
                }
                double z = sinks ? exp(sinks[h] - m) : 0;
                for (int64_t j = j0; j <= t; j++) z += exp(s[j] - m);
                double *o = out + ((b * T + t) * nh + h) * hd;
                for (int64_t x = 0; x < hd; x++) o[x] = 0;
                for (int64_t j = j0; j <= t; j++) {
                    const double p = exp(s[j] - m) / z;
                    const double *vj = v + ((b * T + j) * nkv + g) * hd;
                    for (int64_t x = 0; x < hd; x++) o[x] += p * vj[x];
                }
                lse[(b * nh + h) * T + t] = m + log(z);
            }
    free(s);
}

#endif
