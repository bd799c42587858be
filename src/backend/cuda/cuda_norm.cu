/* The CUDA backend's RMSNorm (Zhang & Sennrich 2019; fm_backend.h): y = x / sqrt(mean(x^2) + eps)
 * * w, one warp per row, and its backward.
 *
 * Element types: fm_act is bf16 in this build (FM_ACT_BF16), read here as __nv_bfloat16. Every
 * kernel does its arithmetic in fp32 (fp64 where a comment says so) and rounds to bf16 once, to
 * nearest even, when it stores an fm_act. Every launch goes on the context's stream and is
 * checked; nothing allocates after init.
 * Determinism: rmsnorm_bwd's dw sums fixed row chunks, then the chunk partials in order; no
 * floating-point atomics.
 */
#include "cuda_internal.h"

#include <climits>
#include <cmath>

namespace {

/* Warp sum whose result every lane holds, added in a fixed order (down-tree then broadcast, so
 * all lanes agree bit for bit). */
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return __shfl_sync(0xffffffffu, v, 0);
}

enum { RMS_WARPS = 8 }; /* rows per 256-thread block: one warp per row */

/* One warp per row: ss = sum x^2 (fp32, lanes then a fixed warp tree), r = 1/sqrt(ss/D + eps)
 * (in double, as the CPU), out = x r w. vec: D % 8 == 0 and 16-byte aligned rows. */
__global__ void rmsnorm_fwd_kernel(bf16 *out, float *rstd, const bf16 *x, const bf16 *w, int64_t N, int64_t D,
                                   float eps, bool vec) {
    const int64_t row = (int64_t)blockIdx.x * RMS_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= N) return;
    const bf16 *xr = x + row * D;
    bf16 *o = out + row * D;
    float ss = 0.0f;
    if (vec) {
        for (int64_t j = 8 * lane; j < D; j += 256) {
            float f[8];
            load8(xr + j, f);
#pragma unroll
            for (int k = 0; k < 8; k++) ss += f[k] * f[k];
        }
    } else {
        for (int64_t j = lane; j < D; j += 32) {
            const float f = ld(xr + j);
            ss += f * f;
        }
    }
    ss = warp_sum(ss);
    const float r = (float)(1.0 / sqrt((double)ss / (double)D + (double)eps));
    if (lane == 0) rstd[row] = r;
    if (vec) {
        for (int64_t j = 8 * lane; j < D; j += 256) {
            float f[8], g[8];
            load8(xr + j, f);
            load8(w + j, g);
#pragma unroll
            for (int k = 0; k < 8; k++) f[k] = f[k] * r * g[k];
            store8(o + j, f);
        }
    } else {
        for (int64_t j = lane; j < D; j += 32) st(o + j, ld(xr + j) * r * ld(w + j));
    }
}

/* dx = r w g - x r^3 (sum_i g_i w_i x_i) / D, one warp per row. */
__global__ void rmsnorm_bwd_dx_kernel(bf16 *dx, const bf16 *dout, const bf16 *x, const bf16 *w, const float *rstd,
                                      int64_t N, int64_t D, bool vec) {
    const int64_t row = (int64_t)blockIdx.x * RMS_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= N) return;
    const bf16 *xr = x + row * D, *g = dout + row * D;
    bf16 *d = dx + row * D;
    float dot = 0.0f;
    if (vec) {
        for (int64_t j = 8 * lane; j < D; j += 256) {
            float a[8], b[8], e[8];
            load8(g + j, a);
            load8(w + j, b);
            load8(xr + j, e);
#pragma unroll
            for (int k = 0; k < 8; k++) dot += a[k] * b[k] * e[k];
        }
    } else {
        for (int64_t j = lane; j < D; j += 32) dot += ld(g + j) * ld(w + j) * ld(xr + j);
    }
    dot = warp_sum(dot);
    const double r = rstd[row];
    const float a = (float)r, cc = (float)(r * r * r * (double)dot / (double)D);
    if (vec) {
        for (int64_t j = 8 * lane; j < D; j += 256) {
            float gg[8], ww[8], xx[8];
            load8(g + j, gg);
            load8(w + j, ww);
            load8(xr + j, xx);
#pragma unroll
            for (int k = 0; k < 8; k++) gg[k] = a * ww[k] * gg[k] - cc * xx[k];
            store8(d + j, gg);
        }
    } else {
        for (int64_t j = lane; j < D; j += 32) st(d + j, a * ld(w + j) * ld(g + j) - cc * ld(xr + j));
    }
}

/* dw partials: block (x: 256 columns, y: row chunk) sums g x r over its chunk's rows in order. */
__global__ void rmsnorm_bwd_dw_part_kernel(float *part, const bf16 *dout, const bf16 *x, const float *rstd,
                                           int64_t N, int64_t D, int64_t rows_per) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= D) return;
    const int64_t r0 = (int64_t)blockIdx.y * rows_per, r1 = r0 + rows_per < N ? r0 + rows_per : N;
    float acc = 0.0f;
    for (int64_t r = r0; r < r1; r++) acc += ld(dout + r * D + j) * ld(x + r * D + j) * rstd[r];
    part[(int64_t)blockIdx.y * D + j] = acc;
}

/* dw[j] += sum over chunks (in chunk order) of part[chunk, j]. */
__global__ void rmsnorm_bwd_dw_final_kernel(bf16 *dw, const float *part, int64_t nch, int64_t D) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= D) return;
    float acc = 0.0f;
    for (int64_t ch = 0; ch < nch; ch++) acc += part[ch * D + j];
    st(dw + j, ld(dw + j) + acc);
}

} // namespace

extern "C" {

void fm_cuda_rmsnorm_fwd(void *ctx, fm_act *out, float *rstd, const fm_act *x, const fm_act *w, int64_t N,
                         int64_t D, float eps) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && D >= 1);
    if (N == 0) return;
    const bool vec = D % 8 == 0 && aligned16(out) && aligned16(x) && aligned16(w);
    const int64_t nb = (N + RMS_WARPS - 1) / RMS_WARPS;
    FM_ASSERT(nb <= INT_MAX);
    rmsnorm_fwd_kernel<<<(unsigned)nb, 32 * RMS_WARPS, 0, c->stream>>>(BF(out), rstd, CBF(x), CBF(w), N, D, eps,
                                                                        vec);
    FM_CUDA_LAUNCH_CHECK(c);
}

/* dx [N,D] assigned, dw [D] accumulated. dw is deterministic: the rows are cut into at most 512
 * fixed chunks (a function of N and D only), each chunk's column sums go to c->scratch, and the
 * chunk sums are added in chunk order, then once to dw. */
void fm_cuda_rmsnorm_bwd(void *ctx, fm_act *dx, fm_act *dw, const fm_act *dout, const fm_act *x,
                         const fm_act *w, const float *rstd, int64_t N, int64_t D) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && D >= 1);
    if (N == 0) return;
    const bool vec = D % 8 == 0 && aligned16(dx) && aligned16(dout) && aligned16(x) && aligned16(w);
    const int64_t nb = (N + RMS_WARPS - 1) / RMS_WARPS;
    FM_ASSERT(nb <= INT_MAX);
    rmsnorm_bwd_dx_kernel<<<(unsigned)nb, 32 * RMS_WARPS, 0, c->stream>>>(BF(dx), CBF(dout), CBF(x), CBF(w), rstd,
                                                                           N, D, vec);
    FM_CUDA_LAUNCH_CHECK(c);
    int64_t max_ch = (int64_t)(FM_CUDA_REDUCE_BYTES / (sizeof(float) * (size_t)D));
    if (max_ch > 512) max_ch = 512;
    FM_ASSERT(max_ch >= 1); /* D <= 4M columns */
    int64_t rows_per = (N + max_ch - 1) / max_ch;
    if (rows_per < 16) rows_per = 16;
    const int64_t nch = (N + rows_per - 1) / rows_per, nbx = (D + EW_THREADS - 1) / EW_THREADS;
    FM_ASSERT(nbx <= INT_MAX);
    float *part = static_cast<float *>(c->scratch);
    rmsnorm_bwd_dw_part_kernel<<<dim3((unsigned)nbx, (unsigned)nch), EW_THREADS, 0, c->stream>>>(
        part, CBF(dout), CBF(x), rstd, N, D, rows_per);
    FM_CUDA_LAUNCH_CHECK(c);
    rmsnorm_bwd_dw_final_kernel<<<(unsigned)nbx, EW_THREADS, 0, c->stream>>>(BF(dw), part, nch, D);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
