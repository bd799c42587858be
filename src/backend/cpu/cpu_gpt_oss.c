/* GPT-OSS's ops on the CPU: the router logits' bias (fm_backend.h bias_add_f32) and the clamped
 * SwiGLU (swiglu_clamp_fwd / swiglu_clamp_bwd). The SwiGLU is the
 * formula of transformers' GptOssExperts (modeling_gpt_oss.py) and OpenAI's gpt-oss reference
 * (gpt_oss/torch/model.py swiglu): gate clamped above at limit, up clamped to [-limit, limit],
 * out = (up + 1) * gate * sigmoid(alpha * gate). fp32, libm's expf, one fixed expression per
 * element (its value does not depend on the thread count or the element's position). */
#include "cpu_internal.h"

#include <math.h>

#define FM_CPU_PAR_MIN 8192

static inline int cpu_threads(void *ctx) { return ((const fm_cpu_ctx *)ctx)->threads; }

/* min(g, limit) and clamp(u, -limit, limit), NaN kept (as torch.clamp): comparisons with NaN are
 * false, so NaN falls through unchanged. */
static inline float clamp_hi(float g, float limit) { return g > limit ? limit : g; }
static inline float clamp_pm(float u, float limit) { return u > limit ? limit : u < -limit ? -limit : u; }

void fm_cpu_swiglu_clamp_fwd(void *ctx, float *out, const float *gate, const float *up, int64_t n, float limit,
                             float alpha) {
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (n >= FM_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float g = clamp_hi(gate[i], limit), u = clamp_pm(up[i], limit);
        const float s = 1.0f / (1.0f + expf(-alpha * g));
        out[i] = (u + 1.0f) * (g * s);
    }
}

void fm_cpu_swiglu_clamp_bwd(void *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                             const float *up, int64_t n, float limit, float alpha) {
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (n >= FM_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float g0 = gate[i], u0 = up[i];
        const float g = clamp_hi(g0, limit), u = clamp_pm(u0, limit);
        const float s = 1.0f / (1.0f + expf(-alpha * g));
        const float d = dout[i];
        /* d/dg [g s(alpha g)] = s + alpha g s (1 - s) = s (1 + alpha g (1 - s)) */
        dgate[i] = g0 <= limit ? d * (u + 1.0f) * (s * (1.0f + alpha * g * (1.0f - s))) : 0.0f;
        dup[i] = u0 >= -limit && u0 <= limit ? d * (g * s) : 0.0f;
    }
}

void fm_cpu_bias_add_f32(void *ctx, float *y, const float *b, int64_t N, int64_t D) {
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (N * D >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < D; j++) y[n * D + j] += b[j];
}
