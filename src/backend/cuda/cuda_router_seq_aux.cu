/* The CUDA backend's sequence-wise balance loss of the sigmoid router (fm_backend.h
 * router_seq_aux_fwd / router_seq_aux_bwd: DeepSeek-V3, arXiv 2412.19437 §2.1.2 eq. 17-20;
 * Megatron-Core's seq_aux_loss). Twin of the CPU backend's cpu_router_seq_aux.c: the same segments
 * (rows, or the documents of doc_start), the same double sums in the same orders (a token's score
 * sum j ascending, an expert's sums over the segment's tokens in order, the loss over experts
 * ascending); nvcc may contract a product and a sum into one FMA, so the GPU test compares with
 * the CPU op within a tolerance, not bit for bit.
 *
 * Work layout. Forward: one block of 256 threads over the whole batch (the loss is one double;
 * one block keeps its sum in a fixed order without a scratch buffer): per segment, the threads
 * take 256 tokens' score sums at a time into shared memory, then thread e (strided over E) adds
 * those tokens' normalized scores and routes of expert e in token order; thread 0 sums the
 * experts' terms. Backward: one block per row, its segments in turn: the counts as above, then a
 * warp per token (score sum and dot product by fixed warp butterflies) adds the gradient to its
 * row of dlogits. Shared memory: 2 E doubles (E <= FM_ROUTER_MAX_SEQ_AUX_E). No atomics, nothing
 * allocated, no host wait. */
#include "cuda_internal.h"

#include <stdint.h>

namespace {

enum { SA_THREADS = 256 };

/* The end of the segment starting at row-local token t of row r (doc_start NULL: the row). */
__device__ int64_t sa_seg_end(const int32_t *doc_start, int64_t r, int64_t T, int64_t t) {
    if (!doc_start) return T;
    const int32_t *d = doc_start + r * T;
    int64_t u = t + 1;
    while (u < T && d[u] == d[t]) u++;
    return u;
}

/* c[e] = routes of tokens [n0, n0 + Ts) to e, in token order (thread e, strided). */
__device__ void sa_counts(double *c, const int32_t *topk_idx, int64_t n0, int64_t Ts, int64_t E, int64_t k) {
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
        double ce = 0;
        for (int64_t n = n0; n < n0 + Ts; n++)
            for (int64_t j = 0; j < k; j++) ce += topk_idx[n * k + j] == e ? 1.0 : 0.0;
        c[e] = ce;
    }
}

__global__ void __launch_bounds__(SA_THREADS)
    seq_aux_fwd_kernel(double *term, const float *__restrict__ scores, const int32_t *__restrict__ topk_idx,
                       const int32_t *__restrict__ doc_start, int64_t B, int64_t T, int64_t E, int64_t k, double coef) {
    extern __shared__ double sa_sh[]; /* c [E], p [E] */
    __shared__ double zs[SA_THREADS];
    __shared__ int64_t seg_u;
    double *c = sa_sh, *p = sa_sh + E;
    double sum = 0; /* thread 0's */
    for (int64_t r = 0; r < B; r++)
        for (int64_t t = 0; t < T;) {
            if (threadIdx.x == 0) seg_u = sa_seg_end(doc_start, r, T, t);
            __syncthreads();
            const int64_t u = seg_u, Ts = u - t, n0 = r * T + t;
            sa_counts(c, topk_idx, n0, Ts, E, k);
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) p[e] = 0;
            for (int64_t c0 = n0; c0 < n0 + Ts; c0 += SA_THREADS) {
                __syncthreads(); /* zs free */
                const int64_t n = c0 + threadIdx.x;
                if (n < n0 + Ts) {
                    double z = 0;
                    for (int64_t e = 0; e < E; e++) z += scores[n * E + e];
                    zs[threadIdx.x] = z + 1e-20;
                }
                __syncthreads();
                const int64_t m = n0 + Ts - c0 < SA_THREADS ? n0 + Ts - c0 : SA_THREADS;
                for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
                    double pe = p[e];
                    for (int64_t i = 0; i < m; i++) pe += (double)scores[(c0 + i) * E + e] / zs[i];
                    p[e] = pe;
                }
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                double l = 0;
                for (int64_t e = 0; e < E; e++)
                    l += ((double)E * c[e] / ((double)k * (double)Ts)) * (p[e] / (double)Ts);
                sum += l;
            }
            __syncthreads(); /* c, p and seg_u free */
            t = u;
        }
    if (threadIdx.x == 0) *term = coef * sum;
}

__device__ __forceinline__ double sa_warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__global__ void __launch_bounds__(SA_THREADS)
    seq_aux_bwd_kernel(float *__restrict__ dlogits, const float *__restrict__ scores,
                       const int32_t *__restrict__ topk_idx,
                       const int32_t *__restrict__ doc_start, int64_t T, int64_t E, int64_t k, double coef) {
    extern __shared__ double sa_sh[]; /* g [E] */
    __shared__ int64_t seg_u;
    double *g = sa_sh;
    const int64_t r = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int64_t t = 0; t < T;) {
        if (threadIdx.x == 0) seg_u = sa_seg_end(doc_start, r, T, t);
        __syncthreads();
        const int64_t u = seg_u, Ts = u - t, n0 = r * T + t;
        sa_counts(g, topk_idx, n0, Ts, E, k);
        const double gs = (double)E / ((double)k * (double)Ts * (double)Ts);
        for (int64_t e = threadIdx.x; e < E; e += blockDim.x) g[e] *= gs;
        __syncthreads();
        for (int64_t n = n0 + warp; n < n0 + Ts; n += warps) {
            const float *s = scores + n * E;
            double z = 0, dot = 0;
            for (int64_t e = lane; e < E; e += 32) z += s[e];
            z = sa_warp_sum(z) + 1e-20;
            for (int64_t e = lane; e < E; e += 32) dot += g[e] * ((double)s[e] / z);
            dot = sa_warp_sum(dot);
            float *dl = dlogits + n * E;
            for (int64_t e = lane; e < E; e += 32) {
                const double se = s[e];
                dl[e] += (float)(coef * se * (1.0 - se) * (g[e] - dot) / z);
            }
        }
        __syncthreads(); /* g and seg_u free */
        t = u;
    }
}

} /* namespace */

extern "C" {

void fm_cuda_router_seq_aux_fwd(void *ctx, double *term, const float *scores, const int32_t *topk_idx,
                                const int32_t *doc_start, int64_t B, int64_t T, int64_t E, int64_t k, double coef) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && E <= FM_ROUTER_MAX_SEQ_AUX_E && k >= 1 && k <= E && B >= 0 && T >= 1);
    seq_aux_fwd_kernel<<<1, SA_THREADS, 2 * (size_t)E * sizeof(double), c->stream>>>(term, scores, topk_idx, doc_start,
                                                                                      B, T, E, k, coef);
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_router_seq_aux_bwd(void *ctx, float *dlogits, const float *scores, const int32_t *topk_idx,
                                const int32_t *doc_start, int64_t B, int64_t T, int64_t E, int64_t k, double coef) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && E <= FM_ROUTER_MAX_SEQ_AUX_E && k >= 1 && k <= E && B >= 0 && T >= 1);
    if (B == 0) return;
    seq_aux_bwd_kernel<<<(unsigned)B, SA_THREADS, (size_t)E * sizeof(double), c->stream>>>(dlogits, scores, topk_idx,
                                                                                           doc_start, T, E, k, coef);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
