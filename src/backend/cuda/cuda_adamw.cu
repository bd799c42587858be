/* The CUDA backend's AdamW (Loshchilov & Hutter 2019; fm_backend.h): fp32 arithmetic over an fp32
 * master (or the bf16 weights themselves), fp32 or bf16 moments; and AdamW on bf16 weights with no
 * master, Kahan-compensated or stochastically rounded (adamw_bf16w, fm_adamw_lowp.h).
 *
 * Element types: fm_act is bf16 in this build (FM_ACT_BF16), read here as __nv_bfloat16. Every
 * kernel does its arithmetic in fp32 (fp64 where a comment says so) and rounds to bf16 once, to
 * nearest even, when it stores an fm_act. Every launch goes on the context's stream and is
 * checked; nothing allocates after init.
 */
#include "cuda_internal.h"

namespace {

/* AdamW, the formula of fm_backend.h in fp32. w = master (fp32) when given, then p = bf16(w);
 * without a master the weights are p itself: w = fp32(p), and p = bf16(w) after the step. One
 * element's arithmetic, shared by the vector and scalar paths (the same bits either way). */
/* One element's update, every operation rounded on its own (the _rn intrinsics are never fused
 * into an FMA): the unrolled vector loop and the scalar tail, and any split of a tensor into
 * launches (the streamed optimizer's buckets, ZeRO shards), give the same bits, and they are the
 * CPU backend's (which has no FMA at its -march). Measured on the H200: with contraction left to
 * the compiler the two paths differed, and the streamed AdamW with unaligned buckets did not
 * match the on-device one (test_cuda_model_offload_adamw). */
__device__ __forceinline__ float adamw_one(float g, float grad_scale, float &m, float &v, float w, float lr, float b1,
                                           float b2, float eps, float wd, float bc1, float bc2) {
    const float gi = __fmul_rn(g, grad_scale);
    const float mi = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(1.0f - b1, gi));
    const float vi = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(__fmul_rn(1.0f - b2, gi), gi));
    m = mi;
    v = vi;
    const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(vi, bc2)), eps);
    const float upd = __fadd_rn(__fdiv_rn(__fdiv_rn(mi, bc1), denom), __fmul_rn(wd, w));
    return __fsub_rn(w, __fmul_rn(lr, upd));
}

/* 8 consecutive values as fp32, from fp32 (2 x 16 bytes) or bf16 (16 bytes); stores round bf16
 * to nearest even. */
__device__ __forceinline__ void ld8(const float *p, float f[8]) {
    const float4 a = *reinterpret_cast<const float4 *>(p), b = *reinterpret_cast<const float4 *>(p + 4);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
__device__ __forceinline__ void ld8(const bf16 *p, float f[8]) { load8(p, f); }
__device__ __forceinline__ void st8(float *p, const float f[8]) {
    *reinterpret_cast<float4 *>(p) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4 *>(p + 4) = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void st8(bf16 *p, const float f[8]) { store8(p, f); }
__device__ __forceinline__ float ld1(const float *p) { return *p; }
__device__ __forceinline__ float ld1(const bf16 *p) { return ld(p); }
__device__ __forceinline__ void st1(float *p, float v) { *p = v; }
__device__ __forceinline__ void st1(bf16 *p, float v) { st(p, v); }

/* With vec (every pointer 16-byte aligned) the first n/8*8 elements go 8 at a time (the loop is
 * bound by memory: 28 bytes per element with a master and fp32 moments, 20 with bf16 moments),
 * the rest one at a time. MV: the moments' type (float or bf16). */
template <bool MASTER, typename MV>
__global__ void adamw_kernel(bf16 *p, const bf16 *g, float *master, MV *m, MV *v, int64_t n, bool vec, float lr,
                             float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_scale) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nv = vec ? n / 8 : 0;
    for (int64_t q = tid; q < nv; q += stride) {
        const int64_t i = 8 * q;
        float gf[8], w[8], mf[8], vf[8];
        load8(g + i, gf);
        ld8(m + i, mf);
        ld8(v + i, vf);
        if (MASTER) ld8(master + i, w);
        else load8(p + i, w);
#pragma unroll
        for (int k = 0; k < 8; k++) w[k] = adamw_one(gf[k], grad_scale, mf[k], vf[k], w[k], lr, b1, b2, eps, wd, bc1, bc2);
        st8(m + i, mf);
        st8(v + i, vf);
        if (MASTER) st8(master + i, w);
        store8(p + i, w);
    }
    for (int64_t i = 8 * nv + tid; i < n; i += stride) {
        float mi = ld1(m + i), vi = ld1(v + i);
        const float w = adamw_one(ld(g + i), grad_scale, mi, vi, MASTER ? master[i] : ld(p + i), lr, b1, b2, eps,
                                  wd, bc1, bc2);
        st1(m + i, mi);
        st1(v + i, vi);
        if (MASTER) master[i] = w;
        st(p + i, w);
    }
}

template <typename MV>
static void adamw_launch(fm_cuda_ctx *c, fm_act *p, const fm_act *g, float *master, MV *m, MV *v, int64_t n,
                         float lr, float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_scale) {
    const bool vec = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && (!master || aligned16(master));
    unsigned blocks = ew_blocks(vec ? n / 8 + 8 : n);
    /* on the overlap's update stream, at most update_blocks (FLATMOE_UPDATE_BLOCKS) blocks: a
     * grid-stride loop, so every element gets the same arithmetic whatever the grid */
    if (c->update_blocks > 0 && c->stream == c->update && blocks > (unsigned)c->update_blocks)
        blocks = (unsigned)c->update_blocks;
    if (master)
        adamw_kernel<true, MV><<<blocks, EW_THREADS, 0, c->stream>>>(BF(p), CBF(g), master, m, v, n, vec, lr, b1, b2,
                                                                     eps, wd, bc1, bc2, grad_scale);
    else
        adamw_kernel<false, MV><<<blocks, EW_THREADS, 0, c->stream>>>(BF(p), CBF(g), master, m, v, n, vec, lr, b1,
                                                                      b2, eps, wd, bc1, bc2, grad_scale);
    FM_CUDA_LAUNCH_CHECK(c);
}

/* One element of adamw_bf16w (fm_backend.h): w the bf16 weight as fp32, comp (Kahan) in and out
 * as fp32 holding a bf16 value, or stochastic rounding with the 16 bits r; returns the new
 * weight (a bf16 value). The moments as adamw_one. Every operation rounded on its own: the CPU
 * backend's bits. */
template <bool KAHAN>
__device__ __forceinline__ float adamw_bf16w_one(float g, float grad_scale, float &m, float &v, float w, float &comp,
                                                 uint32_t r, float lr, float b1, float b2, float eps, float wd,
                                                 float bc1, float bc2) {
    const float gi = __fmul_rn(g, grad_scale);
    const float mi = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(1.0f - b1, gi));
    const float vi = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(__fmul_rn(1.0f - b2, gi), gi));
    m = mi;
    v = vi;
    const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(vi, bc2)), eps);
    const float d = -__fmul_rn(lr, __fadd_rn(__fdiv_rn(__fdiv_rn(mi, bc1), denom), __fmul_rn(wd, w)));
    if (KAHAN) {
        const float c = __fadd_rn(comp, d);
        const float wn = __bfloat162float(__float2bfloat16_rn(__fadd_rn(w, c)));
        comp = __bfloat162float(__float2bfloat16_rn(__fsub_rn(c, __fsub_rn(wn, w))));
        return wn;
    }
    const uint16_t b = fm_sr_round_bits(__float_as_uint(__fadd_rn(w, d)), r);
    return __uint_as_float((uint32_t)b << 16);
}

/* adamw_bf16w over n elements, 8 at a time with vec (every pointer 16-byte aligned), then one at
 * a time; comp [n] bf16 with KAHAN. */
template <bool KAHAN, typename MV>
__global__ void adamw_bf16w_kernel(bf16 *p, const bf16 *g, bf16 *comp, MV *m, MV *v, int64_t n, bool vec, float lr,
                                   float b1, float b2, float eps, float wd, float bc1, float bc2, float grad_scale,
                                   uint64_t key, int64_t idx0) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nv = vec ? n / 8 : 0;
    for (int64_t q = tid; q < nv; q += stride) {
        const int64_t i = 8 * q;
        float gf[8], w[8], mf[8], vf[8], cf[8] = {};
        load8(g + i, gf);
        ld8(m + i, mf);
        ld8(v + i, vf);
        load8(p + i, w);
        if (KAHAN) load8(comp + i, cf);
#pragma unroll
        for (int k = 0; k < 8; k++)
            w[k] = adamw_bf16w_one<KAHAN>(gf[k], grad_scale, mf[k], vf[k], w[k], cf[k],
                                          KAHAN ? 0u : fm_sr_bits(key, idx0 + i + k), lr, b1, b2, eps, wd, bc1, bc2);
        st8(m + i, mf);
        st8(v + i, vf);
        if (KAHAN) store8(comp + i, cf);
        store8(p + i, w); /* bf16 values already: stored exactly */
    }
    for (int64_t i = 8 * nv + tid; i < n; i += stride) {
        float mi = ld1(m + i), vi = ld1(v + i), ci = KAHAN ? ld(comp + i) : 0.0f;
        const float w = adamw_bf16w_one<KAHAN>(ld(g + i), grad_scale, mi, vi, ld(p + i), ci,
                                               KAHAN ? 0u : fm_sr_bits(key, idx0 + i), lr, b1, b2, eps, wd, bc1, bc2);
        st1(m + i, mi);
        st1(v + i, vi);
        if (KAHAN) st(comp + i, ci);
        st(p + i, w);
    }
}

template <typename MV>
static void adamw_bf16w_launch(fm_cuda_ctx *c, fm_act *p, const fm_act *g, uint16_t *comp, MV *m, MV *v, int64_t n,
                               float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                               float grad_scale, uint64_t key, int64_t idx0) {
    const bool vec = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && (!comp || aligned16(comp));
    unsigned blocks = ew_blocks(vec ? n / 8 + 8 : n);
    if (c->update_blocks > 0 && c->stream == c->update && blocks > (unsigned)c->update_blocks)
        blocks = (unsigned)c->update_blocks;
    bf16 *cb = reinterpret_cast<bf16 *>(comp);
    if (comp)
        adamw_bf16w_kernel<true, MV><<<blocks, EW_THREADS, 0, c->stream>>>(BF(p), CBF(g), cb, m, v, n, vec, lr, b1, b2,
                                                                          eps, wd, bc1, bc2, grad_scale, key, idx0);
    else
        adamw_bf16w_kernel<false, MV><<<blocks, EW_THREADS, 0, c->stream>>>(BF(p), CBF(g), cb, m, v, n, vec, lr, b1,
                                                                           b2, eps, wd, bc1, bc2, grad_scale, key, idx0);
    FM_CUDA_LAUNCH_CHECK(c);
}

} // namespace

extern "C" {

void fm_cuda_adamw(void *ctx, fm_act *p, const fm_act *g, float *master, void *m, void *v, fm_dtype mv_dtype,
                   int64_t n, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                   float grad_scale) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0 && (mv_dtype == FM_DTYPE_F32 || mv_dtype == FM_DTYPE_BF16));
    if (n == 0) return;
    if (mv_dtype == FM_DTYPE_BF16)
        adamw_launch<bf16>(c, p, g, master, static_cast<bf16 *>(m), static_cast<bf16 *>(v), n, lr, b1, b2, eps, wd,
                           bc1, bc2, grad_scale);
    else
        adamw_launch<float>(c, p, g, master, static_cast<float *>(m), static_cast<float *>(v), n, lr, b1, b2, eps,
                            wd, bc1, bc2, grad_scale);
}

void fm_cuda_adamw_bf16w(void *ctx, fm_act *p, const fm_act *g, uint16_t *comp, void *m, void *v, fm_dtype mv_dtype,
                         int64_t n, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                         float grad_scale, uint64_t sr_key, int64_t idx0) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0 && (mv_dtype == FM_DTYPE_F32 || mv_dtype == FM_DTYPE_BF16));
    if (n == 0) return;
    if (mv_dtype == FM_DTYPE_BF16)
        adamw_bf16w_launch<bf16>(c, p, g, comp, static_cast<bf16 *>(m), static_cast<bf16 *>(v), n, lr, b1, b2, eps, wd,
                                 bc1, bc2, grad_scale, sr_key, idx0);
    else
        adamw_bf16w_launch<float>(c, p, g, comp, static_cast<float *>(m), static_cast<float *>(v), n, lr, b1, b2, eps,
                                  wd, bc1, bc2, grad_scale, sr_key, idx0);
}

} /* extern "C" */
