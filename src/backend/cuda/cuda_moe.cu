/* The CUDA backend's router, MoE permutation, row movement, cross-entropy and linear-CE strip ops
 * (fm_backend.h; the CPU references are backend/cpu/cpu_moe.c, cpu_rows.c, cpu_lce.c and
 * cpu_backend.c's cross_entropy, whose semantics these follow: shapes, assign vs accumulate,
 * ties to the lower expert id, the stable counting-sort order, ignore_index, NaN propagation).
 *
 * Work layout: router ops run one warp per token (E up to 256 held in registers, larger E read
 * back from the probs row); row-wise losses and strips run one block per row with 16-byte loads
 * where the row length and the pointers allow; row movement and the MoE gather/combine run a
 * power-of-two group of lanes per row.
 *
 * Determinism: every output element is computed by one thread (or one warp / block) in a fixed
 * order, and every reduction has a fixed shape that depends on the sizes only (warp butterflies,
 * block trees, per-block partials of fixed ranges summed in order), never on timing. The only
 * atomics are integer ones whose result does not depend on their order (histograms, an error
 * flag). moe_route_index is a stable counting sort: per-chunk expert histograms, a scan over
 * chunks per expert and over experts, then a placement that walks each chunk in route order,
 * ranking routes of one expert within a warp by __match_any_sync and across warps by counts in
 * shared memory, so expert e's rows are its routes in increasing order, exactly as on the CPU.
 *
 * Nothing allocates: reductions use c->scratch (device) and c->host_scratch (pinned host); ops
 * that return host values copy them back and synchronize the stream. Argument errors the CPU
 * asserts on the host are asserted here too; invalid indices found on the device (a target
 * outside [0,V), a top-k id outside [0,E)) raise a flag in scratch that the host checks after
 * its synchronization, aborting like the CPU's assert.
 */
#if defined(__cplusplus) && !defined(_Noreturn)
#define _Noreturn [[noreturn]] /* fm_core.h is C11; nvcc's C++ front end has no _Noreturn */
#endif
#include "cuda_internal.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef __nv_bfloat16 bf16;

namespace {

/* Scratch layout: an int error flag at 0, data from FM_SCR_DATA (256-byte aligned). */
constexpr size_t FM_SCR_DATA = 256;
constexpr unsigned FULL = 0xffffffffu;

inline fm_cuda_ctx *cctx(void *ctx) { return static_cast<fm_cuda_ctx *>(ctx); }
inline int *scr_flag(fm_cuda_ctx *c) { return static_cast<int *>(c->scratch); }
inline char *scr_data(fm_cuda_ctx *c) { return static_cast<char *>(c->scratch) + FM_SCR_DATA; }

/* Blocks for a grid-stride loop over `items` with `per_block` items per block. */
inline unsigned grid_for(int64_t items, int64_t per_block, int64_t cap = (int64_t)1 << 20) {
    int64_t g = (items + per_block - 1) / per_block;
    if (g < 1) g = 1;
    if (g > cap) g = cap;
    return (unsigned)g;
}

inline bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* Smallest s with 2^s >= v, capped at 5 (a warp). */
inline int lanes_shift(int64_t v) {
    int s = 0;
    while (s < 5 && ((int64_t)1 << s) < v) s++;
    return s;
}

void clear_flag(fm_cuda_ctx *c) { FM_CUDA_CHECK(cudaMemsetAsync(scr_flag(c), 0, sizeof(int), c->stream)); }

/* ---- warp and block reductions (fixed shapes: the same bits every call) --------------------
 * The xor butterflies leave the identical value in every lane (IEEE addition and fmaxf are
 * commutative, so lane l and lane l^o compute the same thing at each level). */

__device__ __forceinline__ float warp_max_f(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum_f(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

/* Block-wide sums of NV doubles; every thread gets the results. blockDim.x a multiple of 32.
 * sh holds 32*NV doubles. Ends with a barrier, so sh can be reused at once. */
template <int NV>
__device__ __forceinline__ void block_sum_d(double (&v)[NV], double *sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        v[i] = warp_sum_d(v[i]);
        if (lane == 0) sh[i * 32 + w] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < NV; i++) v[i] = warp_sum_d(lane < nw ? sh[i * 32 + lane] : 0.0);
    __syncthreads();
}

/* Block-wide NaN-skipping max (fmaxf), every thread gets it. sh holds 32 floats. */
__device__ __forceinline__ float block_max_f(float v, float *sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max_f(v);
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = warp_max_f(lane < nw ? sh[lane] : -INFINITY);
    __syncthreads();
    return v;
}

/* ---- bf16 / fp32 vector loads --------------------------------------------------------------- */

template <int VEC>
__device__ __forceinline__ void load_bf(const bf16 *p, float (&f)[VEC]) {
    if constexpr (VEC == 8) {
        const uint4 u = *reinterpret_cast<const uint4 *>(p);
        const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 t = __bfloat1622float2(h[i]);
            f[2 * i] = t.x;
            f[2 * i + 1] = t.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++) f[i] = __bfloat162float(p[i]);
    }
}
template <int VEC>
__device__ __forceinline__ void store_bf(bf16 *p, const float (&f)[VEC]) {
    if constexpr (VEC == 8) {
        uint4 u;
        __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
        for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        *reinterpret_cast<uint4 *>(p) = u;
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++) p[i] = __float2bfloat16_rn(f[i]);
    }
}
template <int VEC>
__device__ __forceinline__ void load_f(const float *p, float (&f)[VEC]) {
    if constexpr (VEC == 4) {
        const float4 u = *reinterpret_cast<const float4 *>(p);
        f[0] = u.x, f[1] = u.y, f[2] = u.z, f[3] = u.w;
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++) f[i] = p[i];
    }
}
template <int VEC>
__device__ __forceinline__ void store_f(float *p, const float (&f)[VEC]) {
    if constexpr (VEC == 4) {
        *reinterpret_cast<float4 *>(p) = make_float4(f[0], f[1], f[2], f[3]);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++) p[i] = f[i];
    }
}

/* ==== router ================================================================================ */

/* Top-k order key of a probability: larger key = earlier pick. Probabilities are >= 0, so their
 * bits order like the values; +2 leaves 1 for NaN (which ranks below every number) and 0 for "no
 * candidate". Key ties are exact value ties, broken by the lower expert id. */
__device__ __forceinline__ unsigned prob_key(float p) { return p == p ? __float_as_uint(p) + 2u : 1u; }
__device__ __forceinline__ float key_prob(unsigned key) { return key == 1u ? __uint_as_float(0x7fffffffu) : __uint_as_float(key - 2u); }

/* The ids after `prev` in the selection order (key descending, id ascending). */
__device__ __forceinline__ bool after_prev(unsigned key, int e, unsigned prev_key, int prev_id) {
    return key < prev_key || (key == prev_key && e > prev_id);
}

/* Grid of the warp-per-token kernels: as many 256-thread blocks as are resident at once (at most
 * one warp per token); each warp then walks several tokens, prefetching the next one's inputs
 * while it works on the current one. */
template <typename K>
unsigned warp_grid(fm_cuda_ctx *c, K kernel, int64_t N) {
    int nsm = 0, per_sm = 0;
    FM_CUDA_CHECK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, c->device));
    FM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, 0));
    return grid_for(N, 8, (int64_t)(nsm > 0 ? nsm : 1) * (per_sm > 0 ? per_sm : 1));
}

/* router_fwd for E <= 32*PER (PER <= 8): one warp per token, lane l owning experts l, l+32, ...
 * in registers. softmax as on the CPU (max subtracted, expf, divided by the fp32 sum); then k
 * passes, each taking the largest (prob, -id) strictly after the previous pick: a lane's best
 * candidate, the warp's largest key (__reduce_max_sync) and the lowest id holding it
 * (__reduce_min_sync); integer reductions, so the picks do not depend on timing. Pick j < 32 is
 * kept by lane j and stored at the end (one coalesced store); picks j >= 32 (k > 32) are written
 * by lane 0 as they come. The next token's logits are loaded before this token is worked on. */
template <int PER>
__global__ void __launch_bounds__(256)
    router_fwd_reg_kernel(float *__restrict__ probs, float *__restrict__ lse, int32_t *__restrict__ topk_idx,
                          float *__restrict__ topk_w, const float *__restrict__ logits, int64_t N, int E, int k,
                          bool norm) {
    const int lane = threadIdx.x & 31;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    int64_t n = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    float nx[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int e = lane + 32 * i;
        nx[i] = (n < N && e < E) ? logits[n * E + e] : -INFINITY;
    }
    for (; n < N; n += nwarps) {
        float v[PER];
#pragma unroll
        for (int i = 0; i < PER; i++) v[i] = nx[i];
        const int64_t nn = n + nwarps;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int e = lane + 32 * i;
            nx[i] = (nn < N && e < E) ? logits[nn * E + e] : -INFINITY;
        }
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < PER; i++) mx = fmaxf(mx, v[i]);
        mx = warp_max_f(mx);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (lane + 32 * i < E) {
                v[i] = expf(v[i] - mx);
                s += v[i];
            }
        s = warp_sum_f(s);
        float *p = probs + n * E;
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (lane + 32 * i < E) {
                v[i] = v[i] / s;
                p[lane + 32 * i] = v[i];
            }
        if (lane == 0) lse[n] = mx + logf(s);

        int32_t *idx = topk_idx + n * k;
        float *tw = topk_w + n * k;
        unsigned prev_key = 0xffffffffu;
        int prev_id = -1, my_id = 0;
        float wsum = 0.0f, my_w = 0.0f;
        for (int j = 0; j < k; j++) {
            unsigned bk = 0u;
            int bi = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < PER; i++) {
                const int e = lane + 32 * i;
                if (e >= E) continue;
                const unsigned key = prob_key(v[i]);
                if (after_prev(key, e, prev_key, prev_id) && key > bk) { /* e ascending: ties keep the lower id */
                    bk = key;
                    bi = e;
                }
            }
            const unsigned M = __reduce_max_sync(FULL, bk);
            const int wi = (int)__reduce_min_sync(FULL, bk == M ? (unsigned)bi : 0xffffffffu);
            const float pv = key_prob(M);
            if (j < 32) {
                if (lane == j) {
                    my_id = wi;
                    my_w = pv;
                }
            } else if (lane == 0) {
                idx[j] = wi;
                tw[j] = pv;
            }
            wsum += pv;
            prev_key = M;
            prev_id = wi;
        }
        if (lane < k) {
            idx[lane] = my_id;
            tw[lane] = norm ? my_w / wsum : my_w;
        }
        if (norm && k > 32) {
            __syncwarp();
            for (int j = 32 + lane; j < k; j += 32) tw[j] = tw[j] / wsum;
        }
        __syncwarp();
    }
}

/* router_fwd for any E: one warp per token, the row re-read from probs (each lane reads only
 * what it wrote). The same softmax; k passes of a warp argmax (shuffles) over the strict order
 * (prob descending, id ascending) restricted to the experts after the previous pick; a NaN prob
 * ranks as -inf, so NaN logits still give k distinct ids. */
__global__ void __launch_bounds__(256)
    router_fwd_kernel(float *__restrict__ probs, float *__restrict__ lse, int32_t *__restrict__ topk_idx,
                      float *__restrict__ topk_w, const float *__restrict__ logits, int64_t N, int E, int k,
                      bool norm) {
    const int lane = threadIdx.x & 31;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t n = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; n < N; n += nwarps) {
        const float *x = logits + n * E;
        float *p = probs + n * E;
        float mx = -INFINITY;
        for (int e = lane; e < E; e += 32) mx = fmaxf(mx, x[e]);
        mx = warp_max_f(mx);
        float s = 0.0f;
        for (int e = lane; e < E; e += 32) {
            const float t = expf(x[e] - mx);
            p[e] = t;
            s += t;
        }
        s = warp_sum_f(s);
        for (int e = lane; e < E; e += 32) p[e] = p[e] / s;
        if (lane == 0) lse[n] = mx + logf(s);

        int32_t *idx = topk_idx + n * k;
        float *tw = topk_w + n * k;
        float prev_p = INFINITY, wsum = 0.0f;
        int prev_id = -1;
        for (int j = 0; j < k; j++) {
            float bp = -INFINITY, bv = 0.0f;
            int bi = -1;
            for (int e = lane; e < E; e += 32) {
                const float pv = p[e];
                const float pe = pv == pv ? pv : -INFINITY; /* NaN sorts last */
                if (!(pe < prev_p || (pe == prev_p && e > prev_id))) continue; /* already taken */
                if (bi < 0 || pe > bp) { /* e ascending within a lane: ties keep the lower id */
                    bi = e;
                    bp = pe;
                    bv = pv;
                }
            }
#pragma unroll
            for (int o = 16; o; o >>= 1) {
                const float obp = __shfl_xor_sync(FULL, bp, o), obv = __shfl_xor_sync(FULL, bv, o);
                const int obi = __shfl_xor_sync(FULL, bi, o);
                if (obi >= 0 && (bi < 0 || obp > bp || (obp == bp && obi < bi))) {
                    bp = obp;
                    bi = obi;
                    bv = obv;
                }
            }
            if (lane == 0) {
                idx[j] = bi;
                tw[j] = bv;
            }
            wsum += bv;
            prev_p = bp;
            prev_id = bi;
        }
        if (norm) {
            __syncwarp();
            for (int j = lane; j < k; j += 32) tw[j] = tw[j] / wsum;
        }
        __syncwarp();
    }
}

/* router_bwd for E <= 32*PER and k <= 32: one warp per token, probs in registers as in
 * router_fwd_reg_kernel, lane j < k holding pick j (its id, dtopk_w, topk_w and, by shuffles, its
 * prob); the next token's inputs are loaded before this token is worked on. The CPU's formula in
 * double (fm_cpu_router_bwd); the selected experts are written after the others (__syncwarp
 * orders the two writes of one element). */
template <int PER>
__global__ void __launch_bounds__(256)
    router_bwd_reg_kernel(float *__restrict__ dlogits, const float *__restrict__ dtopk_w,
                          const float *__restrict__ gpe, float z_scale, const float *__restrict__ probs,
                          const float *__restrict__ lse, const int32_t *__restrict__ topk_idx,
                          const float *__restrict__ topk_w, int64_t N, int E, int k, bool norm) {
    const int lane = threadIdx.x & 31;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    double g[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int e = lane + 32 * i;
        g[i] = (gpe && e < E) ? (double)gpe[e] : 0.0;
    }
    int64_t n = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    float np[PER], nl = 0.0f, ndw = 0.0f, ntw = 0.0f;
    int nid = -1;
    auto load = [&](int64_t t) {
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int e = lane + 32 * i;
            np[i] = (t < N && e < E) ? probs[t * E + e] : 0.0f;
        }
        if (t < N) {
            nl = lse[t];
            if (lane < k) {
                nid = topk_idx[t * k + lane];
                ntw = topk_w[t * k + lane];
                ndw = dtopk_w ? dtopk_w[t * k + lane] : 0.0f;
            }
        }
    };
    load(n);
    for (; n < N; n += nwarps) {
        float pv[PER];
#pragma unroll
        for (int i = 0; i < PER; i++) pv[i] = np[i];
        const float l = nl, dwj = ndw, twj = ntw;
        const int ej = lane < k ? nid : -1;
        load(n + nwarps);
        /* the prob of this lane's pick, from its owner lane */
        float pj = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const float t = __shfl_sync(FULL, pv[i], ej & 31);
            if ((ej >> 5) == i) pj = t;
        }
        const bool valid = ej >= 0 && ej < E;
        double S = 0, dotw = 0, dsel = 0;
        if (dtopk_w && norm) {
            S = warp_sum_d(valid ? (double)pj : 0.0);
            dotw = warp_sum_d(lane < k ? (double)dwj * twj : 0.0);
        }
        if (dtopk_w && valid) dsel = norm ? ((double)dwj - dotw) / S : (double)dwj;
        double dot = 0;
#pragma unroll
        for (int i = 0; i < PER; i++) dot += (double)pv[i] * g[i];
        if (dtopk_w && valid) dot += (double)pj * dsel;
        dot = warp_sum_d(dot);
        const double zt = 2.0 * (double)z_scale * (double)l;
        float *dl = dlogits + n * E;
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (lane + 32 * i < E) dl[lane + 32 * i] = (float)(pv[i] * (g[i] - dot + zt));
        if (dtopk_w) {
            __syncwarp();
            if (valid) {
                const double ge = gpe ? (double)gpe[ej] : 0.0;
                dl[ej] = (float)(pj * (ge + dsel - dot + zt));
            }
        }
        __syncwarp();
    }
}

/* One warp per token; the CPU's formula in double (fm_cpu_router_bwd):
 *   dp_e = g_e + [e = idx_j] dsel_j, dlogit_e = p_e (dp_e - sum_f p_f dp_f) + 2 z lse p_e.
 * The selected experts are written after the others (__syncwarp orders the two writes). */
__global__ void __launch_bounds__(256)
    router_bwd_kernel(float *__restrict__ dlogits, const float *__restrict__ dtopk_w,
                      const float *__restrict__ gpe, float z_scale, const float *__restrict__ probs,
                      const float *__restrict__ lse, const int32_t *__restrict__ topk_idx,
                      const float *__restrict__ topk_w, int64_t N, int E, int k, bool norm) {
    const int lane = threadIdx.x & 31;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t n = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; n < N; n += nwarps) {
        const float *p = probs + n * E;
        const int32_t *idx = topk_idx + n * k;
        const float *dw = dtopk_w ? dtopk_w + n * k : nullptr;
        const float *tw = topk_w + n * k;
        float *dl = dlogits + n * E;
        double S = 0, dotw = 0;
        if (dw && norm) {
            for (int j = lane; j < k; j += 32) {
                const int e = idx[j];
                S += (e >= 0 && e < E) ? (double)p[e] : 0.0;
                dotw += (double)dw[j] * tw[j];
            }
            S = warp_sum_d(S);
            dotw = warp_sum_d(dotw);
        }
        double dot = 0;
        if (gpe)
            for (int e = lane; e < E; e += 32) dot += (double)p[e] * gpe[e];
        if (dw)
            for (int j = lane; j < k; j += 32) {
                const int e = idx[j];
                if (e < 0 || e >= E) continue;
                const double dsel = norm ? ((double)dw[j] - dotw) / S : (double)dw[j];
                dot += (double)p[e] * dsel;
            }
        dot = warp_sum_d(dot);
        const double zt = 2.0 * (double)z_scale * (double)lse[n];
        for (int e = lane; e < E; e += 32) {
            const double g = gpe ? (double)gpe[e] : 0.0;
            dl[e] = (float)(p[e] * (g - dot + zt));
        }
        if (dw) {
            __syncwarp();
            for (int j = lane; j < k; j += 32) {
                const int e = idx[j];
                if (e < 0 || e >= E) continue;
                const double dsel = norm ? ((double)dw[j] - dotw) / S : (double)dw[j];
                const double g = gpe ? (double)gpe[e] : 0.0;
                dl[e] = (float)(p[e] * (g + dsel - dot + zt));
            }
        }
        __syncwarp();
    }
}

/* router_stats, pass 1: block b covers tokens [b*chunk, (b+1)*chunk). Route counts go into a
 * shared histogram and then into gcount (integer atomics: order-independent); the per-expert
 * prob sums (double, fixed order) go to part_ps[b*E + e] and the lse^2 sum to part_z[b]. */
constexpr int RS_THREADS = 256;
__global__ void __launch_bounds__(RS_THREADS)
    router_stats_partial_kernel(const float *__restrict__ probs, const float *__restrict__ lse,
                                const int32_t *__restrict__ topk_idx, int64_t N, int E, int k, int64_t chunk,
                                double *__restrict__ part_ps, double *__restrict__ part_z,
                                unsigned long long *__restrict__ gcount) {
    extern __shared__ unsigned int hist[]; /* [E] */
    __shared__ double red[RS_THREADS];
    __shared__ double sh[32];
    const int tid = threadIdx.x;
    const int64_t b = blockIdx.x, n0 = b * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
    for (int e = tid; e < E; e += RS_THREADS) hist[e] = 0;
    __syncthreads();
    for (int64_t r = n0 * k + tid; r < n1 * k; r += RS_THREADS) {
        const int e = topk_idx[r];
        if (e >= 0 && e < E) atomicAdd(&hist[e], 1u);
    }
    double zl[1] = {0.0};
    for (int64_t n = n0 + tid; n < n1; n += RS_THREADS) zl[0] += (double)lse[n] * lse[n];
    block_sum_d<1>(zl, sh);
    if (tid == 0) part_z[b] = zl[0];
    if (E <= RS_THREADS) {
        /* Thread t sums column t % E over rows t / E, t / E + RS, ...: coalesced for any E. */
        const int RS = RS_THREADS / E, T = RS * E;
        double acc = 0;
        if (tid < T) {
            const int col = tid % E;
            for (int64_t n = n0 + tid / E; n < n1; n += RS) acc += probs[n * E + col];
        }
        red[tid] = acc;
        __syncthreads();
        if (tid < E) {
            double s = 0;
            for (int i = 0; i < RS; i++) s += red[tid + i * E];
            part_ps[b * E + tid] = s;
        }
    } else {
        for (int e = tid; e < E; e += RS_THREADS) {
            double acc = 0;
            for (int64_t n = n0; n < n1; n++) acc += probs[n * E + e];
            part_ps[b * E + e] = acc;
        }
    }
    __syncthreads();
    for (int e = tid; e < E; e += RS_THREADS)
        if (hist[e]) atomicAdd(&gcount[e], (unsigned long long)hist[e]);
}

/* router_stats, pass 2: prob_sum[e] = sum over blocks in order; count[e] as float. */
__global__ void router_stats_final_kernel(float *__restrict__ count, float *__restrict__ prob_sum,
                                          const double *__restrict__ part_ps,
                                          const unsigned long long *__restrict__ gcount, int E, int nb) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
        double s = 0;
        for (int b = 0; b < nb; b++) s += part_ps[(int64_t)b * E + e];
        prob_sum[e] = (float)s;
        count[e] = (float)gcount[e];
    }
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
        else atomicExch(flag, 1);
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
    FM_CUDA_LAUNCH_CHECK();
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

/* ==== cross-entropy over bf16 logits ========================================================== */

/* One block per row: max (NaN-skipping), s = sum exp(x - max) (fp32 per thread, double across
 * threads), loss = max + log s - x_t, dlogits = grad_scale (softmax - onehot) in bf16. dlogits may
 * alias logits: each element is read and written by one thread, and the barrier after the target
 * logit is read comes before the first write. */
constexpr int CE_MAX_THREADS = 512;
template <int VEC>
__global__ void __launch_bounds__(CE_MAX_THREADS)
    cross_entropy_kernel(float *__restrict__ loss, bf16 *dlogits, const bf16 *logits, const int32_t *__restrict__ targets,
                         int64_t N, int64_t V, float grad_scale, int32_t ignore_index, int *__restrict__ flag) {
    __shared__ double shd[32];
    __shared__ float shf[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    const int64_t nv = V / VEC;
    for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
        const int32_t t = targets[row];
        const bf16 *x = logits + row * V;
        bf16 *d = dlogits ? dlogits + row * V : nullptr;
        if (t == ignore_index || t < 0 || (int64_t)t >= V) { /* uniform across the block */
            if (t != ignore_index && tid == 0) atomicExch(flag, 1);
            if (tid == 0) loss[row] = t == ignore_index ? 0.0f : NAN;
            if (d) {
                const float z[VEC] = {};
                for (int64_t c = tid; c < nv; c += nt) store_bf<VEC>(d + c * VEC, z);
            }
            continue;
        }
        float m = -INFINITY;
        for (int64_t c = tid; c < nv; c += nt) {
            float v[VEC];
            load_bf<VEC>(x + c * VEC, v);
#pragma unroll
            for (int i = 0; i < VEC; i++) m = fmaxf(m, v[i]);
        }
        m = block_max_f(m, shf);
        float s = 0.0f;
        for (int64_t c = tid; c < nv; c += nt) {
            float v[VEC];
            load_bf<VEC>(x + c * VEC, v);
#pragma unroll
            for (int i = 0; i < VEC; i++) s += expf(v[i] - m);
        }
        double S[1] = {(double)s};
        const float xt = __bfloat162float(x[t]);
        block_sum_d<1>(S, shd); /* ends with a barrier: x[t] is read everywhere before any write */
        if (tid == 0) loss[row] = (float)((double)m + log(S[0]) - (double)xt);
        if (d) {
            const float inv = (float)(1.0 / S[0]), pt = expf(xt - m) * inv;
            for (int64_t c = tid; c < nv; c += nt) {
                float v[VEC];
                load_bf<VEC>(x + c * VEC, v);
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    v[i] = grad_scale * (expf(v[i] - m) * inv);
                    if (c * VEC + i == t) v[i] = grad_scale * (pt - 1.0f);
                }
                store_bf<VEC>(d + c * VEC, v);
            }
        }
        __syncthreads(); /* shared reductions of the next row */
    }
}

/* part[b] = sum of loss[n] over non-ignored n in [b*chunk, (b+1)*chunk), double, fixed order. */
__global__ void __launch_bounds__(256)
    masked_sum_kernel(double *__restrict__ part, const float *__restrict__ loss, const int32_t *__restrict__ targets,
                      int32_t ignore_index, int64_t N, int64_t chunk) {
    __shared__ double sh[32];
    const int64_t b = blockIdx.x, n0 = b * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
    double s[1] = {0.0};
    for (int64_t n = n0 + threadIdx.x; n < n1; n += blockDim.x)
        if (targets[n] != ignore_index) s[0] += (double)loss[n];
    block_sum_d<1>(s, sh);
    if (threadIdx.x == 0) part[b] = s[0];
}

/* ==== linear cross-entropy strips (fp32) ====================================================== */

/* One block per row of the strip: block max bm (NaN-skipping), m' = max(m, bm), the block's
 * exp sums relative to m' (fp32 per vector, double per thread and across threads), then the
 * CPU's state update in double (fm_cpu_lce_fold). */
constexpr int LCE_MAX_THREADS = 512;
template <int VEC>
__global__ void __launch_bounds__(LCE_MAX_THREADS)
    lce_fold_kernel(float *__restrict__ m, float *__restrict__ z, float *__restrict__ tgt, float *__restrict__ ent,
                    const float *__restrict__ strip, const int32_t *__restrict__ targets, int64_t Nb, int64_t Vb,
                    int64_t v0, bool first) {
    __shared__ double shd[64];
    __shared__ float shf[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    const int64_t nv = Vb / VEC;
    for (int64_t r = blockIdx.x; r < Nb; r += gridDim.x) {
        const float *s = strip + r * Vb;
        const float m_old = first ? -INFINITY : m[r];
        float bm = -INFINITY;
        for (int64_t c = tid; c < nv; c += nt) {
            float v[VEC];
            load_f<VEC>(s + c * VEC, v);
#pragma unroll
            for (int i = 0; i < VEC; i++) bm = fmaxf(bm, v[i]);
        }
        bm = block_max_f(bm, shf); /* barrier: every thread read m[r] before thread 0 writes it */
        const float m_new = bm > m_old ? bm : m_old;
        double sums[2] = {0.0, 0.0};
        if (m_new != -INFINITY) {
            for (int64_t c = tid; c < nv; c += nt) {
                float v[VEC], se = 0.0f, sed = 0.0f;
                load_f<VEC>(s + c * VEC, v);
#pragma unroll
                for (int i = 0; i < VEC; i++) {
                    const float dd = v[i] - m_new, e = expf(dd);
                    se += e;
                    if (ent && e > 0.0f) sed += e * dd; /* exp(d) == 0 adds 0 (also d = -inf) */
                }
                sums[0] += (double)se;
                sums[1] += (double)sed;
            }
        }
        block_sum_d<2>(sums, shd);
        if (tid == 0) {
            const double se = sums[0], sed = sums[1];
            if (first || m_old == -INFINITY) {
                z[r] = (float)se;
                if (ent) ent[r] = (float)sed;
            } else {
                const double dm = (double)m_old - (double)m_new, sc = exp(dm), z_old = z[r];
                z[r] = (float)(z_old * sc + se);
                if (ent) ent[r] = (float)(sc * ((double)ent[r] + dm * z_old) + sed);
            }
            m[r] = m_new;
            if (first) tgt[r] = NAN;
            const int64_t t = targets[r];
            if (t >= v0 && t < v0 + Vb) tgt[r] = s[t - v0];
        }
    }
}

/* Block b finishes rows [b*chunk, (b+1)*chunk) (one thread per row, fm_cpu_lce_finalize's
 * formulas in double) and writes its weighted loss and lse^2 sums to part[2b], part[2b+1]. */
__global__ void __launch_bounds__(256)
    lce_finalize_kernel(double *__restrict__ part, int *__restrict__ flag, float *__restrict__ loss,
                        float *__restrict__ logprob, float *__restrict__ entropy, const float *__restrict__ m,
                        const float *__restrict__ z, const float *__restrict__ tgt, const float *__restrict__ ent,
                        const int32_t *__restrict__ targets, const float *__restrict__ weights, int64_t Nb,
                        int64_t V, int32_t ignore_index, int64_t chunk) {
    __shared__ double sh[64];
    const int64_t b = blockIdx.x, r0 = b * chunk, r1 = r0 + chunk < Nb ? r0 + chunk : Nb;
    double acc[2] = {0.0, 0.0};
    for (int64_t r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
        const int32_t t = targets[r];
        const double lz = log((double)z[r]);
        if (entropy) entropy[r] = (float)(lz - (double)ent[r] / (double)z[r]);
        if (t == ignore_index) {
            loss[r] = 0.0f;
            if (logprob) logprob[r] = 0.0f;
            continue;
        }
        if (t < 0 || (int64_t)t >= V) {
            atomicExch(flag, 1);
            continue;
        }
        const double l = ((double)m[r] - (double)tgt[r]) + lz, lse = (double)m[r] + lz;
        const double w = weights ? (double)weights[r] : 1.0;
        loss[r] = (float)l;
        if (logprob) logprob[r] = (float)-l;
        acc[0] += w * l;
        acc[1] += w * lse * lse;
    }
    block_sum_d<2>(acc, sh);
    if (threadIdx.x == 0) {
        part[2 * b] = acc[0];
        part[2 * b + 1] = acc[1];
    }
}

/* One block per row: grad = exp(S - m) * f with f = grad_scale w (1 + 2 z_coef lse) / z, the
 * target column minus grad_scale w; ignored rows zero. grad may alias strip (each element is
 * read, then written, by one thread). */
template <int VEC>
__global__ void __launch_bounds__(LCE_MAX_THREADS)
    lce_strip_grad_kernel(float *grad, const float *strip, const float *__restrict__ m, const float *__restrict__ z,
                          const int32_t *__restrict__ targets, const float *__restrict__ weights, int64_t Nb,
                          int64_t Vb, int64_t v0, int32_t ignore_index, float grad_scale, float z_coef) {
    const int tid = threadIdx.x, nt = blockDim.x;
    const int64_t nv = Vb / VEC;
    for (int64_t r = blockIdx.x; r < Nb; r += gridDim.x) {
        float *g = grad + r * Vb;
        const float *s = strip + r * Vb;
        const int32_t t = targets[r];
        if (t == ignore_index) {
            const float zz[VEC] = {};
            for (int64_t c = tid; c < nv; c += nt) store_f<VEC>(g + c * VEC, zz);
            continue;
        }
        const float mr = m[r];
        const double lse = (double)mr + log((double)z[r]);
        const double cc = (double)grad_scale * (weights ? (double)weights[r] : 1.0);
        const float f = (float)(cc * (1.0 + 2.0 * (double)z_coef * lse) / (double)z[r]), cf = (float)cc;
        const int64_t tc = (int64_t)t - v0; /* the target's column, maybe outside the strip */
        for (int64_t c = tid; c < nv; c += nt) {
            float v[VEC];
            load_f<VEC>(s + c * VEC, v);
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                v[i] = expf(v[i] - mr) * f;
                if (c * VEC + i == tc) v[i] -= cf;
            }
            store_f<VEC>(g + c * VEC, v);
        }
    }
}

/* Threads per row-block for a row of `vecs` vectors. */
inline int row_threads(int64_t vecs, int maxt) {
    int t = 64;
    while (t < maxt && (int64_t)t * 4 < vecs) t *= 2;
    return t;
}

/* Copies `bytes` of device scratch data to the pinned host scratch and waits; returns it. */
const void *fetch(fm_cuda_ctx *c, const void *dev, size_t bytes) {
    FM_CUDA_CHECK(cudaMemcpyAsync(c->host_scratch, dev, bytes, cudaMemcpyDeviceToHost, c->stream));
    FM_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    c->host_syncs++;
    return c->host_scratch;
}

/* Fixed partition of n items into at most `max_blocks` contiguous chunks (>= min_chunk each). */
inline int64_t chunk_of(int64_t n, int64_t max_blocks, int64_t min_chunk) {
    int64_t ch = (n + max_blocks - 1) / max_blocks;
    return ch < min_chunk ? min_chunk : ch;
}

} // namespace

/* ==== the ops ================================================================================ */

extern "C" {

void fm_cuda_router_fwd(void *ctx, float *probs, float *lse, int32_t *topk_idx, float *topk_w,
                        const float *logits, int64_t N, int64_t E, int64_t k, bool norm_topk) {
    fm_cuda_ctx *c = cctx(ctx);
    FM_ASSERT(E >= 1 && k >= 1 && k <= E && E <= INT32_MAX && N >= 0);
    if (N == 0) return;
    const int e = (int)E, kk = (int)k;
    auto run = [&](auto kernel) {
        kernel<<<warp_grid(c, kernel, N), 256, 0, c->stream>>>(probs, lse, topk_idx, topk_w, logits, N, e, kk, norm_topk);
    };
    if (E <= 32) run(router_fwd_reg_kernel<1>);
    else if (E <= 64) run(router_fwd_reg_kernel<2>);
    else if (E <= 128) run(router_fwd_reg_kernel<4>);
    else if (E <= 256) run(router_fwd_reg_kernel<8>);
    else run(router_fwd_kernel);
    FM_CUDA_LAUNCH_CHECK();
}

void fm_cuda_router_bwd(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                        float z_scale, const float *probs, const float *lse, const int32_t *topk_idx,
                        const float *topk_w, int64_t N, int64_t E, int64_t k, bool norm_topk) {
    fm_cuda_ctx *c = cctx(ctx);
    FM_ASSERT(E >= 1 && k >= 1 && k <= E && E <= INT32_MAX && N >= 0);
    if (N == 0) return;
    const int e = (int)E, kk = (int)k;
    auto run = [&](auto kernel) {
        kernel<<<warp_grid(c, kernel, N), 256, 0, c->stream>>>(dlogits, dtopk_w, dprobs_per_expert, z_scale, probs, lse,
                                                               topk_idx, topk_w, N, e, kk, norm_topk);
    };
    if (k <= 32 && E <= 32) run(router_bwd_reg_kernel<1>);
    else if (k <= 32 && E <= 64) run(router_bwd_reg_kernel<2>);
    else if (k <= 32 && E <= 128) run(router_bwd_reg_kernel<4>);
    else if (k <= 32 && E <= 256) run(router_bwd_reg_kernel<8>);
    else run(router_bwd_kernel);
    FM_CUDA_LAUNCH_CHECK();
}

double fm_cuda_router_stats(void *ctx, float *count, float *prob_sum, const float *probs, const float *lse,
                            const int32_t *topk_idx, int64_t N, int64_t E, int64_t k) {
    fm_cuda_ctx *c = cctx(ctx);
    FM_ASSERT(E >= 1 && k >= 1 && N >= 0 && E <= 8192);
    /* Scratch: gcount [E] u64, part_z [nb], part_ps [nb][E]; nb * E doubles <= 8 MiB. */
    int64_t max_blocks = ((int64_t)8 << 20) / (8 * E);
    if (max_blocks > 1024) max_blocks = 1024;
    const int64_t chunk = chunk_of(N > 0 ? N : 1, max_blocks, 64);
    const int64_t nb = N > 0 ? (N + chunk - 1) / chunk : 0;
    char *d = scr_data(c);
    unsigned long long *gcount = (unsigned long long *)d;
    double *part_z = (double *)(d + ((E * 8 + 255) & ~(int64_t)255));
    double *part_ps = part_z + ((nb + 31) & ~(int64_t)31);
    FM_ASSERT(FM_SCR_DATA + (size_t)((char *)(part_ps + nb * E) - d) <= FM_CUDA_REDUCE_BYTES);
    FM_CUDA_CHECK(cudaMemsetAsync(gcount, 0, (size_t)E * 8, c->stream));
    if (nb > 0) {
        router_stats_partial_kernel<<<(unsigned)nb, RS_THREADS, (size_t)E * sizeof(unsigned), c->stream>>>(
            probs, lse, topk_idx, N, (int)E, (int)k, chunk, part_ps, part_z, gcount);
        FM_CUDA_LAUNCH_CHECK();
    }
    router_stats_final_kernel<<<grid_for(E, 256), 256, 0, c->stream>>>(count, prob_sum, part_ps, gcount, (int)E,
                                                                        (int)nb);
    FM_CUDA_LAUNCH_CHECK();
    if (nb == 0) {
        FM_CUDA_CHECK(cudaStreamSynchronize(c->stream));
        c->host_syncs++;
        return 0.0;
    }
    const double *pz = (const double *)fetch(c, part_z, (size_t)nb * sizeof(double));
    double zsum = 0;
    for (int64_t b = 0; b < nb; b++) zsum += pz[b];
    return zsum;
}

void fm_cuda_moe_route_index(void *ctx, int64_t *offsets, int32_t *row_route, int32_t *route_row,
                             const int32_t *topk_idx, int64_t N, int64_t E, int64_t k) {
    fm_cuda_ctx *c = cctx(ctx);
    const int64_t R = N * k;
    FM_ASSERT(E >= 1 && k >= 1 && N >= 0 && R <= INT32_MAX && E <= 4096);
    if (R == 0) {
        for (int64_t e = 0; e <= E; e++) offsets[e] = 0;
        return;
    }
    /* Chunks of CH routes: counts [E][C] int take at most 12 MiB of scratch. */
    const int64_t cmax = ((int64_t)12 << 20) / (4 * E);
    int64_t CH = (R + cmax - 1) / cmax;
    CH = (CH + RI_THREADS - 1) / RI_THREADS * RI_THREADS;
    if (CH < 4096) CH = 4096;
    const int64_t C = (R + CH - 1) / CH;
    char *d = scr_data(c);
    int64_t *expert_off = (int64_t *)d;                                  /* [E+1] */
    int *totals = (int *)(d + (((E + 1) * 8 + 255) & ~(int64_t)255));    /* [E] */
    int *counts = totals + ((E + 63) & ~(int64_t)63);                    /* [E][C] */
    FM_ASSERT(FM_SCR_DATA + (size_t)((char *)(counts + E * C) - d) <= FM_CUDA_REDUCE_BYTES);
    clear_flag(c);
    ri_count_kernel<<<(unsigned)C, RI_THREADS, (size_t)E * sizeof(int), c->stream>>>(counts, scr_flag(c), topk_idx,
                                                                                     R, (int)E, CH, C);
    FM_CUDA_LAUNCH_CHECK();
    ri_scan_chunks_kernel<<<(unsigned)E, RI_THREADS, 0, c->stream>>>(counts, totals, C);
    FM_CUDA_LAUNCH_CHECK();
    ri_scan_experts_kernel<<<1, 32, 0, c->stream>>>(expert_off, totals, (int)E);
    FM_CUDA_LAUNCH_CHECK();
    const size_t place_smem = (size_t)(RI_WARPS + 1) * E * sizeof(int);
    if (place_smem > 48 * 1024)
        FM_CUDA_CHECK(cudaFuncSetAttribute(ri_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)place_smem));
    ri_place_kernel<<<(unsigned)C, RI_THREADS, place_smem, c->stream>>>(row_route, route_row, topk_idx, counts,
                                                                        expert_off, R, (int)E, CH, C);
    FM_CUDA_LAUNCH_CHECK();
    /* Host copy: the flag (4 bytes at scratch 0) and the offsets, in one transfer. */
    const char *h = (const char *)fetch(c, c->scratch, FM_SCR_DATA + (size_t)(E + 1) * 8);
    int flag;
    memcpy(&flag, h, sizeof flag);
    if (flag) fm_cuda_fail("fm_cuda_moe_route_index", "a top-k expert id is outside [0,E)", __FILE__, __LINE__);
    memcpy(offsets, h + FM_SCR_DATA, (size_t)(E + 1) * sizeof(int64_t));
}

void fm_cuda_moe_gather(void *ctx, fm_act *xe, const fm_act *x, const int32_t *row_route, int64_t R, int64_t k,
                        int64_t H) {
    FM_ASSERT(k >= 1 && k <= INT32_MAX && R >= 0 && H >= 0);
    move_rows<2>(cctx(ctx), xe, x, row_route, R, H * (int64_t)sizeof(fm_act), (int)k);
}

void fm_cuda_moe_gather_bwd(void *ctx, fm_act *dx, const fm_act *dxe, const int32_t *route_row, int64_t N,
                            int64_t k, int64_t H) {
    fm_cuda_ctx *c = cctx(ctx);
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
    FM_CUDA_LAUNCH_CHECK();
}

void fm_cuda_moe_combine_fwd(void *ctx, fm_act *out, const fm_act *ye, const float *topk_w,
                             const int32_t *route_row, int64_t N, int64_t k, int64_t H) {
    fm_cuda_ctx *c = cctx(ctx);
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
    FM_CUDA_LAUNCH_CHECK();
}

void fm_cuda_moe_combine_bwd(void *ctx, fm_act *dye, float *dtopk_w, const fm_act *dout, const fm_act *ye,
                             const float *topk_w, const int32_t *route_row, int64_t N, int64_t k, int64_t H) {
    fm_cuda_ctx *c = cctx(ctx);
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
    FM_CUDA_LAUNCH_CHECK();
}

void fm_cuda_gather_rows(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n, int64_t row_bytes) {
    FM_ASSERT(n >= 0 && row_bytes >= 0);
    move_rows<0>(cctx(ctx), dst, src, idx, n, row_bytes, 1);
}

void fm_cuda_scatter_rows(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n, int64_t row_bytes) {
    FM_ASSERT(n >= 0 && row_bytes >= 0);
    move_rows<1>(cctx(ctx), dst, src, idx, n, row_bytes, 1);
}

double fm_cuda_cross_entropy(void *ctx, float *loss, fm_act *dlogits, const fm_act *logits, const int32_t *targets,
                             int64_t N, int64_t V, float grad_scale, int32_t ignore_index) {
    fm_cuda_ctx *c = cctx(ctx);
    FM_ASSERT(N >= 0 && V >= 1);
    if (N == 0) return 0.0;
    bf16 *d = (bf16 *)dlogits;
    const bf16 *x = (const bf16 *)logits;
    clear_flag(c);
    const unsigned grid = grid_for(N, 1);
    if (V % 8 == 0 && aligned16(x) && (d == nullptr || aligned16(d))) {
        const int nt = row_threads(V / 8, CE_MAX_THREADS);
        cross_entropy_kernel<8><<<grid, nt, 0, c->stream>>>(loss, d, x, targets, N, V, grad_scale, ignore_index,
                                                            scr_flag(c));
    } else {
        const int nt = row_threads(V, CE_MAX_THREADS);
        cross_entropy_kernel<1><<<grid, nt, 0, c->stream>>>(loss, d, x, targets, N, V, grad_scale, ignore_index,
                                                            scr_flag(c));
    }
    FM_CUDA_LAUNCH_CHECK();
    const int64_t chunk = chunk_of(N, 256, 1024), nb = (N + chunk - 1) / chunk;
    double *part = (double *)(scr_data(c));
    masked_sum_kernel<<<(unsigned)nb, 256, 0, c->stream>>>(part, loss, targets, ignore_index, N, chunk);
    FM_CUDA_LAUNCH_CHECK();
    const char *h = (const char *)fetch(c, c->scratch, FM_SCR_DATA + (size_t)nb * sizeof(double));
    int flag;
    memcpy(&flag, h, sizeof flag);
    if (flag)
        fm_cuda_fail("fm_cuda_cross_entropy", "a target is outside [0,V) and not ignore_index", __FILE__, __LINE__);
    const double *p = (const double *)(h + FM_SCR_DATA);
    double sum = 0;
    for (int64_t b = 0; b < nb; b++) sum += p[b];
    return sum;
}

void fm_cuda_lce_fold(void *ctx, float *m, float *z, float *tgt, float *ent, const float *strip,
                      const int32_t *targets, int64_t Nb, int64_t Vb, int64_t v0, bool first) {
    fm_cuda_ctx *c = cctx(ctx);
    FM_ASSERT(Nb >= 0 && Vb >= 1 && v0 >= 0);
    if (Nb == 0) return;
    const unsigned grid = grid_for(Nb, 1);
    if (Vb % 4 == 0 && aligned16(strip)) {
        lce_fold_kernel<4><<<grid, row_threads(Vb / 4, LCE_MAX_THREADS), 0, c->stream>>>(m, z, tgt, ent, strip, targets,
                                                                                        Nb, Vb, v0, first);
    } else {
        lce_fold_kernel<1><<<grid, row_threads(Vb, LCE_MAX_THREADS), 0, c->stream>>>(m, z, tgt, ent, strip, targets, Nb,
                                                                                    Vb, v0, first);
    }
    FM_CUDA_LAUNCH_CHECK();
}

double fm_cuda_lce_finalize(void *ctx, float *loss, float *logprob, float *entropy, double *zsq, const float *m,
                            const float *z, const float *tgt, const float *ent, const int32_t *targets,
                            const float *weights, int64_t Nb, int64_t V, int32_t ignore_index) {
    fm_cuda_ctx *c = cctx(ctx);
    FM_ASSERT(Nb >= 0 && V >= 1 && (entropy == NULL || ent != NULL));
    if (Nb == 0) {
        if (zsq) *zsq = 0.0;
        return 0.0;
    }
    const int64_t chunk = chunk_of(Nb, 256, 256), nb = (Nb + chunk - 1) / chunk;
    double *part = (double *)scr_data(c);
    clear_flag(c);
    lce_finalize_kernel<<<(unsigned)nb, 256, 0, c->stream>>>(part, scr_flag(c), loss, logprob, entropy, m, z, tgt,
                                                             ent, targets, weights, Nb, V, ignore_index, chunk);
    FM_CUDA_LAUNCH_CHECK();
    const char *h = (const char *)fetch(c, c->scratch, FM_SCR_DATA + (size_t)nb * 2 * sizeof(double));
    int flag;
    memcpy(&flag, h, sizeof flag);
    if (flag)
        fm_cuda_fail("fm_cuda_lce_finalize", "a target is outside [0,V) and not ignore_index", __FILE__, __LINE__);
    const double *p = (const double *)(h + FM_SCR_DATA);
    double ce = 0, zs = 0;
    for (int64_t b = 0; b < nb; b++) {
        ce += p[2 * b];
        zs += p[2 * b + 1];
    }
    if (zsq) *zsq = zs;
    return ce;
}

void fm_cuda_lce_strip_grad(void *ctx, float *grad, const float *strip, const float *m, const float *z,
                            const int32_t *targets, const float *weights, int64_t Nb, int64_t Vb, int64_t v0,
                            int32_t ignore_index, float grad_scale, float z_coef) {
    fm_cuda_ctx *c = cctx(ctx);
    FM_ASSERT(Nb >= 0 && Vb >= 1 && v0 >= 0);
    if (Nb == 0) return;
    const unsigned grid = grid_for(Nb, 1);
    if (Vb % 4 == 0 && aligned16(strip) && aligned16(grad)) {
        lce_strip_grad_kernel<4><<<grid, row_threads(Vb / 4, LCE_MAX_THREADS), 0, c->stream>>>(
            grad, strip, m, z, targets, weights, Nb, Vb, v0, ignore_index, grad_scale, z_coef);
    } else {
        lce_strip_grad_kernel<1><<<grid, row_threads(Vb, LCE_MAX_THREADS), 0, c->stream>>>(
            grad, strip, m, z, targets, weights, Nb, Vb, v0, ignore_index, grad_scale, z_coef);
    }
    FM_CUDA_LAUNCH_CHECK();
}

} /* extern "C" */
