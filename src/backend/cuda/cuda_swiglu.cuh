/* SwiGLU's per-element arithmetic on the device (Shazeer 2020, arXiv 2002.05202: out = silu(gate)
 * up, silu(g) = g sigmoid(g)), in fp32: one definition for the CUDA backend's swiglu_fwd /
 * swiglu_bwd (cuda_elementwise.cu) and the FP8 path's fused kernels (sm90/gg_sm90_fp8_fused.cu),
 * so a fused kernel's values are swiglu_fwd's / swiglu_bwd's bit for bit (the same expressions,
 * the same association; both compiled without fast math). The callers round to bf16 (nearest
 * even) when they store. Header-only, device code. */
#ifndef FM_CUDA_SWIGLU_CUH
#define FM_CUDA_SWIGLU_CUH

/* sigmoid in fp32 with expf: exp(-g) overflows to inf for g < -88.7, giving exactly 0. */
static __device__ __forceinline__ float fm_swiglu_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

/* out = g sigmoid(g) u */
static __device__ __forceinline__ float fm_swiglu_fwd1(float g, float u) { return g * fm_swiglu_sigmoid(g) * u; }

/* dgate = dout up s (1 + g (1 - s)), dup = dout g s, s = sigmoid(g). */
static __device__ __forceinline__ void fm_swiglu_bwd1(float d, float g, float u, float *dg, float *du) {
    const float s = fm_swiglu_sigmoid(g);
    *dg = d * u * s * (1.0f + g * (1.0f - s));
    *du = d * g * s;
}

#endif
