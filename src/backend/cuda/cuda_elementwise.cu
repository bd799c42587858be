/* The CUDA backend's elementwise ops and reductions (fm_backend.h): add, sumsq, SwiGLU (Shazeer
 * 2020: out = silu(gate) * up) and the fp32 <-> bf16 convert.
 *
 * Element types: fm_act is bf16 in this build (FM_ACT_BF16), read here as __nv_bfloat16. Every
 * kernel does its arithmetic in fp32 (fp64 where a comment says so) and rounds to bf16 once, to
 * nearest even, when it stores an fm_act. Every launch goes on the context's stream and is
 * checked; nothing allocates after init.
 * Determinism: no floating-point atomics; sumsq reduces in a fixed tree over a grid that depends
 * on n (and the alignment of x) only, so the same inputs give the same bits on every call.
 */
#include "cuda_internal.h"
#include "cuda_swiglu.cuh"

#include <cstring>

namespace {

/* The elementwise kernels below share one shape: with vec (every pointer 16-byte aligned) the
 * first n/8*8 elements go 8 at a time, the tail one at a time; without vec all go one at a
 * time. Grid-stride loops; each element's value does not depend on which path computed it. */

__global__ void add_kernel(bf16 *y, const bf16 *x, int64_t n, bool vec) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nv = vec ? n / 8 : 0;
    for (int64_t v = tid; v < nv; v += stride) {
        float a[8], b[8];
        load8(y + 8 * v, a);
        load8(x + 8 * v, b);
#pragma unroll
        for (int k = 0; k < 8; k++) a[k] += b[k];
        store8(y + 8 * v, a);
    }
    for (int64_t i = 8 * nv + tid; i < n; i += stride) st(y + i, ld(y + i) + ld(x + i));
}

enum { SUMSQ_THREADS = 256, SUMSQ_MAX_BLOCKS = 1024 };

/* Block-wide double sum in a fixed tree; the result is valid in thread 0. */
__device__ double block_sum_d(double v) {
    __shared__ double sh[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = threadIdx.x < (unsigned)nw ? sh[threadIdx.x] : 0.0;
    if (wid == 0) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    }
    return v;
}

/* Pass 1: block b sums the squares of its grid-stride share into part[b], in fp64 (the bf16
 * squares are exact in fp64; an H200 has fp64 throughput to spare for a memory-bound loop). */
__global__ void sumsq_part_kernel(const bf16 *x, int64_t n, bool vec, double *part) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nv = vec ? n / 8 : 0;
    double acc = 0.0;
    for (int64_t v = tid; v < nv; v += stride) {
        float f[8];
        load8(x + 8 * v, f);
        double a0 = 0.0, a1 = 0.0;
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            a0 += (double)f[k] * (double)f[k];
            a1 += (double)f[k + 1] * (double)f[k + 1];
        }
        acc += a0 + a1;
    }
    for (int64_t i = 8 * nv + tid; i < n; i += stride) {
        const double f = ld(x + i);
        acc += f * f;
    }
    acc = block_sum_d(acc);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

/* Pass 2: one block adds the nb partials in a fixed tree; *out = the sum, or *out + the sum when
 * accumulate. */
__global__ void sumsq_final_kernel(const double *part, int nb, double *out, bool accumulate) {
    double acc = 0.0;
    for (int i = threadIdx.x; i < nb; i += blockDim.x) acc += part[i];
    acc = block_sum_d(acc);
    if (threadIdx.x == 0) *out = accumulate ? *out + acc : acc;
}

/* ---- SwiGLU ------------------------------------------------------------------------------------ */

/* The per-element arithmetic: cuda_swiglu.cuh (shared with the FP8 path's fused kernels). */

__global__ void swiglu_fwd_kernel(bf16 *out, const bf16 *gate, const bf16 *up, int64_t n, bool vec) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nv = vec ? n / 8 : 0;
    for (int64_t v = tid; v < nv; v += stride) {
        float g[8], u[8];
        load8(gate + 8 * v, g);
        load8(up + 8 * v, u);
#pragma unroll
        for (int k = 0; k < 8; k++) g[k] = fm_swiglu_fwd1(g[k], u[k]);
        store8(out + 8 * v, g);
    }
    for (int64_t i = 8 * nv + tid; i < n; i += stride) {
        st(out + i, fm_swiglu_fwd1(ld(gate + i), ld(up + i)));
    }
}

/* dgate = dout up s (1 + g (1 - s)), dup = dout g s, s = sigmoid(g). */
__global__ void swiglu_bwd_kernel(bf16 *dgate, bf16 *dup, const bf16 *dout, const bf16 *gate, const bf16 *up,
                                  int64_t n, bool vec) {
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nv = vec ? n / 8 : 0;
    for (int64_t v = tid; v < nv; v += stride) {
        float g[8], u[8], d[8], dg[8], du[8];
        load8(gate + 8 * v, g);
        load8(up + 8 * v, u);
        load8(dout + 8 * v, d);
#pragma unroll
        for (int k = 0; k < 8; k++) fm_swiglu_bwd1(d[k], g[k], u[k], &dg[k], &du[k]);
        store8(dgate + 8 * v, dg);
        store8(dup + 8 * v, du);
    }
    for (int64_t i = 8 * nv + tid; i < n; i += stride) {
        float dg, du;
        fm_swiglu_bwd1(ld(dout + i), ld(gate + i), ld(up + i), &dg, &du);
        st(dgate + i, dg);
        st(dup + i, du);
    }
}

/* ---- convert ----------------------------------------------------------------------------------- */

__global__ void f32_to_bf16_kernel(bf16 *dst, const float *src, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void bf16_to_f32_kernel(float *dst, const bf16 *src, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __bfloat162float(src[i]);
}

} // namespace

extern "C" {

/* y[i] += x[i] (one rounding of the fp32 sum). */
void fm_cuda_add(void *ctx, fm_act *y, const fm_act *x, int64_t n) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0);
    if (n == 0) return;
    const bool vec = aligned16(y) && aligned16(x);
    add_kernel<<<ew_blocks(vec ? n / 8 + 8 : n), EW_THREADS, 0, c->stream>>>(BF(y), CBF(x), n, vec);
    FM_CUDA_LAUNCH_CHECK(c);
}

/* Sum of squares of x[0..n) in double into *out (device memory): assigned, or added to it when
 * accumulate. The grid depends on n (and the alignment of x) only, so the same input gives the
 * same bits on every call. Two kernels on the stream; no host wait. */
void fm_cuda_sumsq(void *ctx, double *out, const fm_act *x, int64_t n, bool accumulate) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0 && out != NULL);
    if (n == 0) {
        if (!accumulate) FM_CUDA_CHECK(c, cudaMemsetAsync(out, 0, sizeof(double), c->stream)); /* +0.0 */
        return;
    }
    const bool vec = aligned16(x);
    int64_t work = vec ? n / 8 + 8 : n, nb = (work + SUMSQ_THREADS - 1) / SUMSQ_THREADS;
    if (nb > SUMSQ_MAX_BLOCKS) nb = SUMSQ_MAX_BLOCKS;
    double *part = static_cast<double *>(c->scratch);
    sumsq_part_kernel<<<(unsigned)nb, SUMSQ_THREADS, 0, c->stream>>>(CBF(x), n, vec, part);
    FM_CUDA_LAUNCH_CHECK(c);
    sumsq_final_kernel<<<1, 1024, 0, c->stream>>>(part, (int)nb, out, accumulate);
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_swiglu_fwd(void *ctx, fm_act *out, const fm_act *gate, const fm_act *up, int64_t n) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0);
    if (n == 0) return;
    const bool vec = aligned16(out) && aligned16(gate) && aligned16(up);
    swiglu_fwd_kernel<<<ew_blocks(vec ? n / 8 + 8 : n), EW_THREADS, 0, c->stream>>>(BF(out), CBF(gate), CBF(up), n,
                                                                                     vec);
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_swiglu_bwd(void *ctx, fm_act *dgate, fm_act *dup, const fm_act *dout, const fm_act *gate,
                        const fm_act *up, int64_t n) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0);
    if (n == 0) return;
    const bool vec = aligned16(dgate) && aligned16(dup) && aligned16(dout) && aligned16(gate) && aligned16(up);
    swiglu_bwd_kernel<<<ew_blocks(vec ? n / 8 + 8 : n), EW_THREADS, 0, c->stream>>>(BF(dgate), BF(dup), CBF(dout),
                                                                                     CBF(gate), CBF(up), n, vec);
    FM_CUDA_LAUNCH_CHECK(c);
}

/* fp32 <-> bf16, round to nearest even (NaN stays NaN); the same type is a copy (a no-op in
 * place). */
void fm_cuda_convert(void *ctx, void *dst, fm_dtype dst_type, const void *src, fm_dtype src_type, int64_t n) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(n >= 0);
    FM_ASSERT((dst_type == FM_DTYPE_F32 || dst_type == FM_DTYPE_BF16) &&
              (src_type == FM_DTYPE_F32 || src_type == FM_DTYPE_BF16));
    if (n == 0) return;
    if (dst_type == src_type) {
        if (dst != src)
            FM_CUDA_CHECK(c, cudaMemcpyAsync(dst, src, (size_t)n * fm_dtype_size(dst_type), cudaMemcpyDeviceToDevice,
                                          c->stream));
        return;
    }
    if (dst_type == FM_DTYPE_BF16)
        f32_to_bf16_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>((bf16 *)dst, (const float *)src, n);
    else
        bf16_to_f32_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>((float *)dst, (const bf16 *)src, n);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
