/* The CUDA backend's dropless MoE permutation and row movement (fm_backend.h): moe_route_index,
 * moe_gather / moe_gather_bwd, moe_combine_fwd / moe_combine_bwd, gather_rows / scatter_rows.
 * The CPU references are backend/cpu/cpu_moe.c and cpu_rows.c, whose semantics these follow
 * (shapes, assign vs accumulate, the stable counting-sort order).
 *
 * Work layout: row movement and the MoE gather/combine run a power-of-two group of lanes per row,
 * with 16-byte accesses where the row length and the pointers allow.
 *
 * Determinism: every output element is computed by one thread (or one lane group) in a fixed
 * order (the k routes of a token summed in ascending j). The only atomics are integer ones whose
 * result does not depend on their order (histograms). moe_route_index is a stable
 * counting sort: per-chunk expert histograms, a scan over chunks per expert and over experts,
 * then a placement that walks each chunk in route order, ranking routes of one expert within a
 * warp by __match_any_sync and across warps by counts in shared memory, so expert e's rows are
 * its routes in increasing order, exactly as on the CPU.
 *
 * Nothing allocates and nothing waits for the host: the sort's counts live in c->scratch, and
 * the expert offsets go to the caller's pinned host array by an asynchronous copy on the stream
 * (read after the caller's sync point). Argument errors the CPU asserts on the host are asserted
 * here too; a top-k id outside [0,E) found on the device raises a flag (mapped pinned memory,
 * cuda_internal.h) that `status` reports as FM_ERR_ARG.
 */
#include "cuda_internal.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace {

/* Smallest s with 2^s >= v, capped at 5 (a warp). */
inline int lanes_shift(int64_t v) {
    int s = 0;
    while (s < 5 && ((int64_t)1 << s) < v) s++;
    return s;
}

/* ==== dropless permutation (stable counting sort) ============================================ */

constexpr int RI_THREADS = 256; /* one tile of routes per iteration of the placement */
constexpr int RI_WARPS = RI_THREADS / 32;

/* Pass 1: counts[e*C + c] = routes of chunk c (routes [c*CH, (c+1)*CH)) that go to expert e. */
__global__ void __launch_bounds__(RI_THREADS)
    ri_count_kernel(int *__restrict__ counts, int *__restrict__ flag, const int32_t *__restrict__ topk_idx,
                    int64_t R, int E, int64_t CH, int64_t C) {
    extern __shared__ int hist_i[]; /* [E] */
    const int64_t c = blockIdx.x, r0 = c * CH, r1 = r0 + CH < R ? r0 + CH : R;
    for (int e = threadIdx.x; e < E; e += RI_THREADS) hist_i[e] = 0;
    __syncthreads();
    for (int64_t r = r0 + threadIdx.x; r < r1; r += RI_THREADS) {
        const int e = topk_idx[r];
        if (e >= 0 && e < E) atomicAdd(&hist_i[e], 1);
        else *flag = 1; /* mapped host memory: a plain store (every writer stores 1) */
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += RI_THREADS) counts[(int64_t)e * C + c] = hist_i[e];
}

/* Pass 2 (block e): exclusive scan of counts[e*C .. e*C+C) in place; totals[e] = the sum. */
__global__ void __launch_bounds__(RI_THREADS)
    ri_scan_chunks_kernel(int *__restrict__ counts, int *__restrict__ totals, int64_t C) {
    __shared__ int wsum[RI_WARPS];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    int *cnt = counts + (int64_t)blockIdx.x * C;
    int carry = 0;
    for (int64_t base = 0; base < C; base += RI_THREADS) {
        const int64_t i = base + tid;
        const int v = i < C ? cnt[i] : 0;
        int x = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(FULL, x, o);
            if (lane >= o) x += y;
        }
        if (lane == 31) wsum[w] = x;
        __syncthreads();
        if (w == 0) {
            int t = lane < RI_WARPS ? wsum[lane] : 0;
#pragma unroll
            for (int o = 1; o < RI_WARPS; o <<= 1) {
                const int y = __shfl_up_sync(FULL, t, o);
                if (lane >= o) t += y;
            }
            if (lane < RI_WARPS) wsum[lane] = t;
        }
        __syncthreads();
        if (i < C) cnt[i] = carry + (w > 0 ? wsum[w - 1] : 0) + x - v;
        carry += wsum[RI_WARPS - 1];
        __syncthreads();
    }
    if (tid == 0) totals[blockIdx.x] = carry;
}

/* Pass 3 (one thread): expert_off[e] = sum of totals below e; expert_off[E] = R. */
__global__ void ri_scan_experts_kernel(int64_t *__restrict__ expert_off, const int *__restrict__ totals, int E) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    int64_t off = 0;
    for (int e = 0; e < E; e++) {
        expert_off[e] = off;
        off += totals[e];
    }
    expert_off[E] = off;
}

/* Pass 4 (block c): walks chunk c in tiles of RI_THREADS routes, in route order. A route's row
 * is expert_off[e] + (routes of e in earlier chunks) + (in earlier tiles of this chunk: run[e])
 * + (in earlier warps of this tile: wcnt) + (in earlier lanes of this warp: match mask). */
__global__ void __launch_bounds__(RI_THREADS)
    ri_place_kernel(int32_t *__restrict__ row_route, int32_t *__restrict__ route_row,
                    const int32_t *__restrict__ topk_idx, const int *__restrict__ counts,
                    const int64_t *__restrict__ expert_off, int64_t R, int E, int64_t CH, int64_t C) {
    extern __shared__ int sm_i[];
    int *wcnt = sm_i;                /* [RI_WARPS][E] */
    int *run = sm_i + RI_WARPS * E; /* [E] */
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    for (int i = tid; i < (RI_WARPS + 1) * E; i += RI_THREADS) sm_i[i] = 0;
    __syncthreads();
    const int64_t c = blockIdx.x, r0 = c * CH, r1 = r0 + CH < R ? r0 + CH : R;
    const unsigned lt = (1u << lane) - 1u;
    for (int64_t t0 = r0; t0 < r1; t0 += RI_THREADS) {
        const int64_t r = t0 + tid;
        int e = r < r1 ? topk_idx[r] : -1;
        if (e >= E) e = -1; /* flagged by ri_count_kernel */
        const unsigned mask = __match_any_sync(FULL, e);
        const bool leader = (mask & lt) == 0;
        if (e >= 0 && leader) wcnt[w * E + e] = __popc(mask);
        __syncthreads();
        if (e >= 0) {
            int before = run[e] + __popc(mask & lt);
            for (int v = 0; v < w; v++) before += wcnt[v * E + e];
            const int64_t row = expert_off[e] + counts[(int64_t)e * C + c] + before;
            row_route[row] = (int32_t)r;
            route_row[r] = (int32_t)row;
        }
        __syncthreads();
        for (int x = tid; x < E; x += RI_THREADS) {
            int s = 0;
#pragma unroll
            for (int v = 0; v < RI_WARPS; v++) s += wcnt[v * E + x];
            run[x] += s;
        }
        __syncthreads();
        if (e >= 0 && leader) wcnt[w * E + e] = 0;
        __syncwarp();
    }
}

/* ==== row movement ========================================================================== */

/* MODE 0: dst row i = src row idx[i]; 1: dst row idx[i] = src row i; 2: dst row i = src row
 * idx[i] / k. Rows are vpr elements of V; a group of 2^shift lanes per row. */
template <typename V, int MODE>
__global__ void __launch_bounds__(256)
    rows_kernel(V *__restrict__ dst, const V *__restrict__ src, const int32_t *__restrict__ idx, int64_t n,
                int64_t vpr, int shift, int k) {
    const int64_t total = n << shift, L = (int64_t)1 << shift, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += stride) {
        const int64_t i = g >> shift;
        int64_t s, d;
        if constexpr (MODE == 0) {
            s = idx[i];
            d = i;
        } else if constexpr (MODE == 1) {
            s = i;
            d = idx[i];
        } else {
            s = idx[i] / k;
            d = i;
        }
        const V *sp = src + s * vpr;
        V *dp = dst + d * vpr;
#pragma unroll 4
        for (int64_t col = g & (L - 1); col < vpr; col += L) dp[col] = sp[col];
    }
}

template <int MODE>
void move_rows(fm_cuda_ctx *c, void *dst, const void *src, const int32_t *idx, int64_t n, int64_t row_bytes,
               int k) {
    if (n <= 0 || row_bytes <= 0) return;
    const uintptr_t a = (uintptr_t)dst | (uintptr_t)src | (uintptr_t)row_bytes;
    const int w = (a & 15) == 0 ? 16 : (a & 7) == 0 ? 8 : (a & 3) == 0 ? 4 : (a & 1) == 0 ? 2 : 1;
    const int64_t vpr = row_bytes / w;
    const int shift = lanes_shift(vpr);
    const unsigned grid = grid_for(n << shift, 256);
    switch (w) {
    case 16:
        rows_kernel<uint4, MODE><<<grid, 256, 0, c->stream>>>((uint4 *)dst, (const uint4 *)src, idx, n, vpr, shift, k);
        break;
    case 8:
        rows_kernel<uint2, MODE><<<grid, 256, 0, c->stream>>>((uint2 *)dst, (const uint2 *)src, idx, n, vpr, shift, k);
        break;
    case 4:
        rows_kernel<unsigned, MODE>
            <<<grid, 256, 0, c->stream>>>((unsigned *)dst, (const unsigned *)src, idx, n, vpr, shift, k);
        break;
    case 2:
        rows_kernel<unsigned short, MODE><<<grid, 256, 0, c->stream>>>(
            (unsigned short *)dst, (const unsigned short *)src, idx, n, vpr, shift, k);
        break;
    default:
        rows_kernel<unsigned char, MODE><<<grid, 256, 0, c->stream>>>(
            (unsigned char *)dst, (const unsigned char *)src, idx, n, vpr, shift, k);
        break;
    }
    FM_CUDA_LAUNCH_CHECK(c);
}

/* ==== MoE gather backward / combine (bf16 rows, fp32 math) ================================== */

/* dx[n,:] = sum_j dxe[route_row[n*k+j],:], j ascending, fp32 sums rounded once to bf16. */
template <int VEC>
__global__ void __launch_bounds__(256)
    moe_gather_bwd_kernel(bf16 *__restrict__ dx, const bf16 *__restrict__ dxe, const int32_t *__restrict__ route_row,
                          int64_t N, int k, int64_t H, int shift) {
    const int64_t nv = H / VEC, total = N << shift, L = (int64_t)1 << shift,
                  stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += stride) {
        const int64_t n = g >> shift;
        const int32_t *rr = route_row + n * k;
        for (int64_t c = g & (L - 1); c < nv; c += L) {
            float acc[VEC], t[VEC];
            load_bf<VEC>(dxe + (int64_t)rr[0] * H + c * VEC, acc);
            for (int j = 1; j < k; j++) {
                load_bf<VEC>(dxe + (int64_t)rr[j] * H + c * VEC, t);
#pragma unroll
                for (int i = 0; i < VEC; i++) acc[i] += t[i];
            }
            store_bf<VEC>(dx + n * H + c * VEC, acc);
        }
    }
}

/* out[n,:] = sum_j topk_w[n*k+j] * ye[route_row[n*k+j],:], j ascending, fp32. */
template <int VEC>
__global__ void __launch_bounds__(256)
    moe_combine_fwd_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ ye, const float *__restrict__ topk_w,
                           const int32_t *__restrict__ route_row, int64_t N, int k, int64_t H, int shift) {
    const int64_t nv = H / VEC, total = N << shift, L = (int64_t)1 << shift,
                  stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += stride) {
        const int64_t n = g >> shift;
        const int32_t *rr = route_row + n * k;
        const float *tw = topk_w + n * k;
        for (int64_t c = g & (L - 1); c < nv; c += L) {
            float acc[VEC], t[VEC];
            load_bf<VEC>(ye + (int64_t)rr[0] * H + c * VEC, t);
            const float w0 = tw[0];
#pragma unroll
            for (int i = 0; i < VEC; i++) acc[i] = w0 * t[i];
            for (int j = 1; j < k; j++) {
                load_bf<VEC>(ye + (int64_t)rr[j] * H + c * VEC, t);
                const float w = tw[j];
#pragma unroll
                for (int i = 0; i < VEC; i++) acc[i] += w * t[i];
            }
            store_bf<VEC>(out + n * H + c * VEC, acc);
        }
    }
}

/* A group of 2^shift lanes per route q = n*k + j: dye[row,:] = w * dout[n,:] and
 * dtopk_w[q] = dot(dout[n,:], ye[row,:]) (exact bf16 products, summed in double; a fixed xor
 * tree across the group). The loop bound is uniform per warp so the shuffles see all lanes. */
template <int VEC>
__global__ void __launch_bounds__(256)
    moe_combine_bwd_kernel(bf16 *__restrict__ dye, float *__restrict__ dtopk_w, const bf16 *__restrict__ dout,
                           const bf16 *__restrict__ ye, const float *__restrict__ topk_w,
                           const int32_t *__restrict__ route_row, int64_t N, int k, int64_t H, int shift) {
    const int64_t nv = H / VEC, total = (N * k) << shift, L = (int64_t)1 << shift,
                  stride = (int64_t)gridDim.x * blockDim.x;
    const int wl = threadIdx.x & 31;
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g - wl < total; g += stride) {
        const bool act = g < total;
        const int64_t q = g >> shift;
        double dot = 0;
        if (act) {
            const int64_t n = q / k, row = route_row[q];
            const float w = topk_w[q];
            for (int64_t c = g & (L - 1); c < nv; c += L) {
                float gd[VEC], y[VEC], o[VEC];
                load_bf<VEC>(dout + n * H + c * VEC, gd);
                load_bf<VEC>(ye + row * H + c * VEC, y);
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    o[i] = w * gd[i];
                    dot += (double)(gd[i] * y[i]); /* bf16 products are exact in fp32 */
                }
                store_bf<VEC>(dye + row * H + c * VEC, o);
            }
        }
        for (int o = (int)(L >> 1); o; o >>= 1) dot += __shfl_xor_sync(FULL, dot, o);
        if (act && (g & (L - 1)) == 0) dtopk_w[q] = (float)dot;
    }
}

} // namespace

/* counts[e] += offsets[e+1] - offsets[e] (one thread per expert; counts is pinned host memory,
 * reached through unified addressing). */
static __global__ void count_add_kernel(int64_t *counts, const int64_t *offsets, int E) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] += offsets[e + 1] - offsets[e];
}

extern "C" {

void fm_cuda_moe_count_add(void *ctx, int64_t *counts, const int64_t *offsets, int64_t E) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && E <= 4096 && counts && offsets);
    count_add_kernel<<<1, 256, 0, c->stream>>>(counts, offsets, (int)E);
    FM_CUDA_LAUNCH_CHECK(c);
}

/* The stable counting sort on the stream (four kernels, launch shapes from N, E and k only), then
 * the offsets [E+1] copied asynchronously from scratch into `offsets` (pinned host memory) on
 * the stream: they are valid after the caller's next stream_sync / event_sync, not on return.
 * A top-k id outside [0,E) raises FM_CUDA_FLAG_ROUTE (reported by status). */
void fm_cuda_moe_route_index(void *ctx, int64_t *offsets, int32_t *row_route, int32_t *route_row,
                             const int32_t *topk_idx, int64_t N, int64_t E, int64_t k) {
    fm_cuda_ctx *c = ctx_of(ctx);
    const int64_t R = N * k;
    FM_ASSERT(E >= 1 && k >= 1 && N >= 0 && R <= INT32_MAX && E <= 4096);
    char *d = scr_data(c);
    int64_t *expert_off = (int64_t *)d; /* [E+1] */
    const size_t off_bytes = (size_t)(E + 1) * sizeof(int64_t);
    if (R == 0) {
        FM_CUDA_CHECK(c, cudaMemsetAsync(expert_off, 0, off_bytes, c->stream));
        FM_CUDA_CHECK(c, cudaMemcpyAsync(offsets, expert_off, off_bytes, cudaMemcpyDeviceToHost, c->stream));
        return;
    }
    /* Chunks of CH routes: counts [E][C] int take at most 12 MiB of scratch. */
    const int64_t cmax = ((int64_t)12 << 20) / (4 * E);
    int64_t CH = (R + cmax - 1) / cmax;
    CH = (CH + RI_THREADS - 1) / RI_THREADS * RI_THREADS;
    if (CH < 4096) CH = 4096;
    const int64_t C = (R + CH - 1) / CH;
    int *totals = (int *)(d + (((E + 1) * 8 + 255) & ~(int64_t)255));    /* [E] */
    int *counts = totals + ((E + 63) & ~(int64_t)63);                    /* [E][C] */
    FM_ASSERT(FM_SCR_DATA + (size_t)((char *)(counts + E * C) - d) <= FM_CUDA_REDUCE_BYTES);
    ri_count_kernel<<<(unsigned)C, RI_THREADS, (size_t)E * sizeof(int), c->stream>>>(
        counts, dev_flag(c, FM_CUDA_FLAG_ROUTE), topk_idx, R, (int)E, CH, C);
    FM_CUDA_LAUNCH_CHECK(c);
    ri_scan_chunks_kernel<<<(unsigned)E, RI_THREADS, 0, c->stream>>>(counts, totals, C);
    FM_CUDA_LAUNCH_CHECK(c);
    ri_scan_experts_kernel<<<1, 32, 0, c->stream>>>(expert_off, totals, (int)E);
    FM_CUDA_LAUNCH_CHECK(c);
    const size_t place_smem = (size_t)(RI_WARPS + 1) * E * sizeof(int);
    if (place_smem > 48 * 1024)
        FM_CUDA_CHECK(c, cudaFuncSetAttribute(ri_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              (int)place_smem));
    ri_place_kernel<<<(unsigned)C, RI_THREADS, place_smem, c->stream>>>(row_route, route_row, topk_idx, counts,
                                                                        expert_off, R, (int)E, CH, C);
    FM_CUDA_LAUNCH_CHECK(c);
    FM_CUDA_CHECK(c, cudaMemcpyAsync(offsets, expert_off, off_bytes, cudaMemcpyDeviceToHost, c->stream));
}

void fm_cuda_moe_gather(void *ctx, fm_act *xe, const fm_act *x, const int32_t *row_route, int64_t R, int64_t k,
                        int64_t H) {
    FM_ASSERT(k >= 1 && k <= INT32_MAX && R >= 0 && H >= 0);
    move_rows<2>(ctx_of(ctx), xe, x, row_route, R, H * (int64_t)sizeof(fm_act), (int)k);
}

void fm_cuda_moe_gather_bwd(void *ctx, fm_act *dx, const fm_act *dxe, const int32_t *route_row, int64_t N,
                            int64_t k, int64_t H) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(k >= 1 && k <= INT32_MAX && N >= 0 && H >= 0);
    if (N == 0 || H == 0) return;
    bf16 *o = (bf16 *)dx;
    const bf16 *in = (const bf16 *)dxe;
    if (H % 8 == 0 && aligned16(o) && aligned16(in)) {
        const int s = lanes_shift(H / 8);
        moe_gather_bwd_kernel<8><<<grid_for(N << s, 256), 256, 0, c->stream>>>(o, in, route_row, N, (int)k, H, s);
    } else {
        const int s = lanes_shift(H);
        moe_gather_bwd_kernel<1><<<grid_for(N << s, 256), 256, 0, c->stream>>>(o, in, route_row, N, (int)k, H, s);
    }
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_moe_combine_fwd(void *ctx, fm_act *out, const fm_act *ye, const float *topk_w,
                             const int32_t *route_row, int64_t N, int64_t k, int64_t H) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(k >= 1 && k <= INT32_MAX && N >= 0 && H >= 0);
    if (N == 0 || H == 0) return;
    bf16 *o = (bf16 *)out;
    const bf16 *y = (const bf16 *)ye;
    if (H % 8 == 0 && aligned16(o) && aligned16(y)) {
        const int s = lanes_shift(H / 8);
        moe_combine_fwd_kernel<8><<<grid_for(N << s, 256), 256, 0, c->stream>>>(o, y, topk_w, route_row, N, (int)k,
                                                                                H, s);
    } else {
        const int s = lanes_shift(H);
        moe_combine_fwd_kernel<1><<<grid_for(N << s, 256), 256, 0, c->stream>>>(o, y, topk_w, route_row, N, (int)k,
                                                                                H, s);
    }
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_moe_combine_bwd(void *ctx, fm_act *dye, float *dtopk_w, const fm_act *dout, const fm_act *ye,
                             const float *topk_w, const int32_t *route_row, int64_t N, int64_t k, int64_t H) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(k >= 1 && k <= INT32_MAX && N >= 0 && H >= 0);
    if (N == 0) return;
    bf16 *dy = (bf16 *)dye;
    const bf16 *g = (const bf16 *)dout, *y = (const bf16 *)ye;
    const int64_t R = N * k;
    if (H % 8 == 0 && aligned16(dy) && aligned16(g) && aligned16(y)) {
        const int s = lanes_shift(H / 8);
        moe_combine_bwd_kernel<8><<<grid_for(R << s, 256), 256, 0, c->stream>>>(dy, dtopk_w, g, y, topk_w, route_row,
                                                                                N, (int)k, H, s);
    } else {
        const int s = lanes_shift(H);
        moe_combine_bwd_kernel<1><<<grid_for(R << s, 256), 256, 0, c->stream>>>(dy, dtopk_w, g, y, topk_w, route_row,
                                                                                N, (int)k, H, s);
    }
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_gather_rows(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n, int64_t row_bytes) {
    FM_ASSERT(n >= 0 && row_bytes >= 0);
    move_rows<0>(ctx_of(ctx), dst, src, idx, n, row_bytes, 1);
}

void fm_cuda_scatter_rows(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n, int64_t row_bytes) {
    FM_ASSERT(n >= 0 && row_bytes >= 0);
    move_rows<1>(ctx_of(ctx), dst, src, idx, n, row_bytes, 1);
}

} /* extern "C" */
