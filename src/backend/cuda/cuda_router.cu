/* The CUDA backend's router ops (fm_backend.h): router_fwd (softmax over experts, top-k),
 * router_bwd, router_stats and the load-balancing loss terms and gradient (router_loss_terms,
 * router_aux_grad). The CPU references are backend/cpu/cpu_moe.c, whose semantics
 * these follow: shapes, assign vs accumulate, ties to the lower expert id, NaN propagation.
 *
 * Work layout: one warp per token, E up to 256 held in registers, larger E read back from the
 * probs row.
 *
 * Determinism: every output element is computed by one thread (or one warp / block) in a fixed
 * order, and every reduction has a fixed shape that depends on the sizes only (warp butterflies,
 * block trees, per-block partials of fixed ranges summed in order), never on timing. The only
 * atomics are integer ones whose result does not depend on their order (router_stats' route
 * histograms).
 *
 * Nothing allocates and nothing waits for the host: reductions use c->scratch (device) and
 * their results (router_stats' lse_sq, router_loss_terms) land in device memory, read by the
 * caller after a sync point. Argument errors the CPU asserts on the host are asserted here too.
 */
#include "cuda_internal.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace {

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
    if (!FM_CUDA_OK(c, cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, c->device)) ||
        !FM_CUDA_OK(c, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, 0)))
        return 1; /* recorded (status); any grid is correct for the grid-stride kernels */
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

/* router_stats, pass 3 (one thread): *lse_sq = the nb block partials added in block order
 * (0 when nb == 0), the order the host loop used before this ran on the device. */
__global__ void router_stats_lse_kernel(double *__restrict__ lse_sq, const double *__restrict__ part_z, int nb) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double z = 0;
    for (int b = 0; b < nb; b++) z += part_z[b];
    *lse_sq = z;
}

/* router_loss_terms (one thread): fm_cpu_router_loss_terms' arithmetic, operation by operation
 * (e ascending; __dmul_rn / __dadd_rn keep nvcc from contracting the sum into FMAs, which the
 * CPU build, compiled without FMA, does not have). */
__global__ void router_loss_terms_kernel(double *__restrict__ terms, const float *__restrict__ count,
                                         const float *__restrict__ prob_sum, const double *__restrict__ lse_sq,
                                         int64_t N, int64_t E) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const double dn = (double)N;
    double s = 0;
    for (int64_t e = 0; e < E; e++) s = __dadd_rn(s, __dmul_rn((double)count[e] / dn, (double)prob_sum[e] / dn));
    terms[0] = __dmul_rn((double)E, s);
    terms[1] = *lse_sq / dn;
}

/* router_aux_grad: dprobs[e] = (float)(coef * E * (count[e] / N) / N), in double, left to right
 * as on the CPU (products and quotients only: nothing to contract). */
__global__ void router_aux_grad_kernel(float *__restrict__ dprobs, const float *__restrict__ count, double coef,
                                       int64_t N, int64_t E) {
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < E; e += (int64_t)gridDim.x * blockDim.x)
        dprobs[e] = (float)(__dmul_rn(__dmul_rn(coef, (double)E), (double)count[e] / (double)N) / (double)N);
}

} // namespace

extern "C" {

void fm_cuda_router_fwd(void *ctx, float *probs, float *lse, int32_t *topk_idx, float *topk_w,
                        const float *logits, int64_t N, int64_t E, int64_t k, bool norm_topk) {
    fm_cuda_ctx *c = ctx_of(ctx);
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
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_router_bwd(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                        float z_scale, const float *probs, const float *lse, const int32_t *topk_idx,
                        const float *topk_w, int64_t N, int64_t E, int64_t k, bool norm_topk) {
    fm_cuda_ctx *c = ctx_of(ctx);
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
    FM_CUDA_LAUNCH_CHECK(c);
}

/* count, prob_sum [E] and *lse_sq (device double) on the stream: per-block partials, then the
 * per-expert sums over blocks in order and the lse^2 partials in order (router_stats_lse_kernel).
 * No host wait. */
void fm_cuda_router_stats(void *ctx, float *count, float *prob_sum, double *lse_sq, const float *probs,
                          const float *lse, const int32_t *topk_idx, int64_t N, int64_t E, int64_t k) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && k >= 1 && N >= 0 && E <= 8192 && lse_sq != NULL);
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
    FM_CUDA_CHECK(c, cudaMemsetAsync(gcount, 0, (size_t)E * 8, c->stream));
    if (nb > 0) {
        router_stats_partial_kernel<<<(unsigned)nb, RS_THREADS, (size_t)E * sizeof(unsigned), c->stream>>>(
            probs, lse, topk_idx, N, (int)E, (int)k, chunk, part_ps, part_z, gcount);
        FM_CUDA_LAUNCH_CHECK(c);
    }
    router_stats_final_kernel<<<grid_for(E, 256), 256, 0, c->stream>>>(count, prob_sum, part_ps, gcount, (int)E,
                                                                        (int)nb);
    FM_CUDA_LAUNCH_CHECK(c);
    router_stats_lse_kernel<<<1, 1, 0, c->stream>>>(lse_sq, part_z, (int)nb);
    FM_CUDA_LAUNCH_CHECK(c);
}

/* terms[0] = E sum_e (count_e/N)(prob_sum_e/N), terms[1] = *lse_sq / N (fm_backend.h); device
 * memory; one thread, the CPU's arithmetic. */
void fm_cuda_router_loss_terms(void *ctx, double *terms, const float *count, const float *prob_sum,
                               const double *lse_sq, int64_t N, int64_t E) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && N >= 0 && terms != NULL);
    router_loss_terms_kernel<<<1, 1, 0, c->stream>>>(terms, count, prob_sum, lse_sq, N, E);
    FM_CUDA_LAUNCH_CHECK(c);
}

/* dprobs [E] = (float)(coef E (count_e/N) / N) (fm_backend.h), device memory. */
void fm_cuda_router_aux_grad(void *ctx, float *dprobs, const float *count, double coef, int64_t N, int64_t E) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(E >= 1 && N >= 0);
    router_aux_grad_kernel<<<grid_for(E, 256), 256, 0, c->stream>>>(dprobs, count, coef, N, E);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
