/* GPT-OSS's ops on the GPU: the router logits' bias (fm_backend.h bias_add_f32) and the clamped
 * SwiGLU (swiglu_clamp_fwd / swiglu_clamp_bwd), the arithmetic of backend/cpu/cpu_gpt_oss.c per element in fp32 (expf, no fast math), bf16 in
 * and out, rounded to nearest even at the store. One thread per element, grid-stride. */
#include "cuda_internal.h"

namespace {

__device__ __forceinline__ float clamp_hi(float g, float limit) { return g > limit ? limit : g; }
__device__ __forceinline__ float clamp_pm(float u, float limit) { return u > limit ? limit : u < -limit ? -limit : u; }

__global__ void swiglu_clamp_fwd_kernel(bf16 *out, const bf16 *gate, const bf16 *up, int64_t n, float limit,
                                        float alpha) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = clamp_hi(ld(gate + i), limit), u = clamp_pm(ld(up + i), limit);
        const float s = 1.0f / (1.0f + expf(-alpha * g));
        st(out + i, (u + 1.0f) * (g * s));
    }
}

__global__ void swiglu_clamp_bwd_kernel(bf16 *dgate, bf16 *dup, const bf16 *dout, const bf16 *gate, const bf16 *up,
                                        int64_t n, float limit, float alpha) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g0 = ld(gate + i), u0 = ld(up + i), d = ld(dout + i);
        const float g = clamp_hi(g0, limit), u = clamp_pm(u0, limit);
        const float s = 1.0f / (1.0f + expf(-alpha * g));
        st(dgate + i, g0 <= limit ? d * (u + 1.0f) * (s * (1.0f + alpha * g * (1.0f - s))) : 0.0f);
        st(dup + i, u0 >= -limit && u0 <= limit ? d * (g * s) : 0.0f);
    }
}

__global__ void bias_add_f32_kernel(float *y, const bf16 *b, int64_t N, int64_t D) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N * D; i += stride) y[i] += ld(b + i % D);
}

} // namespace

void fm_cuda_bias_add_f32(void *ctx, float *y, const fm_act *b, int64_t N, int64_t D) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && D >= 1);
    if (N == 0) return;
    bias_add_f32_kernel<<<ew_blocks(N * D), EW_THREADS, 0, c->stream>>>(y, CBF(b), N, D);
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_swiglu_clamp_fwd(void *ctx, fm_act *out, const fm_act *gate, const fm_act *up, int64_t n, float limit,
                              float alpha) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0 && limit > 0 && alpha > 0);
    if (n == 0) return;
    swiglu_clamp_fwd_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(BF(out), CBF(gate), CBF(up), n, limit, alpha);
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_swiglu_clamp_bwd(void *ctx, fm_act *dgate, fm_act *dup, const fm_act *dout, const fm_act *gate,
                              const fm_act *up, int64_t n, float limit, float alpha) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0 && limit > 0 && alpha > 0);
    if (n == 0) return;
    swiglu_clamp_bwd_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(BF(dgate), BF(dup), CBF(dout), CBF(gate),
                                                                         CBF(up), n, limit, alpha);
    FM_CUDA_LAUNCH_CHECK(c);
}
