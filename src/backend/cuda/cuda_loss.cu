/* The CUDA backend's losses (fm_backend.h): cross_entropy over bf16 logits and the linear
 * cross-entropy strip ops lce_fold / lce_finalize / lce_strip_grad (fp32). The CPU references are
 * cpu_backend.c's cross_entropy and backend/cpu/cpu_lce.c, whose semantics these follow (shapes,
 * ignore_index, NaN propagation).
 *
 * Work layout: one block per row, with 16-byte loads where the row length and the pointers allow.
 *
 * Determinism: every output element is computed by one thread (or one block) in a fixed order,
 * and every reduction has a fixed shape that depends on the sizes only (block trees, per-block
 * partials of fixed ranges summed in order), never on timing. No atomics.
 *
 * Nothing allocates and nothing waits for the host: per-block partials go to c->scratch and
 * their block-order sums (one thread, the order the host used to add them) land in the caller's
 * device doubles (cross_entropy's sum, lce_finalize's sums), read after a sync point. Argument
 * errors the CPU asserts on the host are asserted here too; a target outside [0,V) found on the
 * device raises a flag (mapped pinned memory, cuda_internal.h) that `status` reports as
 * FM_ERR_ARG.
 */
#include "cuda_internal.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace {

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
            if (t != ignore_index && tid == 0) *flag = 1; /* mapped host memory: a plain store */
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

/* *sum = part[0] + part[1] + ... + part[nb-1], added in block order by one thread (0 when nb == 0):
 * the order the host loop used before this ran on the device. */
__global__ void ce_sum_kernel(double *__restrict__ sum, const double *__restrict__ part, int64_t nb) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = 0;
    for (int64_t b = 0; b < nb; b++) s += part[b];
    *sum = s;
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
            *flag = 1; /* mapped host memory: a plain store (every writer stores 1) */
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

/* sums[0] += sum_b part[2b], sums[1] += sum_b part[2b+1]: each block-order sum formed first (one
 * thread, in double), then added, as fm_cpu_lce_finalize adds its block's sums. */
__global__ void lce_sums_kernel(double *__restrict__ sums, const double *__restrict__ part, int64_t nb) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double ce = 0, zs = 0;
    for (int64_t b = 0; b < nb; b++) {
        ce += part[2 * b];
        zs += part[2 * b + 1];
    }
    sums[0] += ce;
    sums[1] += zs;
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

} // namespace

extern "C" {

/* loss, dlogits and *sum (device double, assigned) on the stream: the row kernel, per-block masked
 * partials, then their block-order sum (ce_sum_kernel). No host wait; a target outside [0,V)
 * raises FM_CUDA_FLAG_CE (its loss is NaN), reported by status. */
void fm_cuda_cross_entropy(void *ctx, float *loss, fm_act *dlogits, const fm_act *logits, const int32_t *targets,
                           int64_t N, int64_t V, float grad_scale, int32_t ignore_index, double *sum) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && V >= 1 && sum != NULL);
    double *part = (double *)(scr_data(c));
    if (N == 0) {
        ce_sum_kernel<<<1, 1, 0, c->stream>>>(sum, part, 0);
        FM_CUDA_LAUNCH_CHECK(c);
        return;
    }
    bf16 *d = (bf16 *)dlogits;
    const bf16 *x = (const bf16 *)logits;
    int *flag = dev_flag(c, FM_CUDA_FLAG_CE);
    const unsigned grid = grid_for(N, 1);
    if (V % 8 == 0 && aligned16(x) && (d == nullptr || aligned16(d))) {
        const int nt = row_threads(V / 8, CE_MAX_THREADS);
        cross_entropy_kernel<8><<<grid, nt, 0, c->stream>>>(loss, d, x, targets, N, V, grad_scale, ignore_index, flag);
    } else {
        const int nt = row_threads(V, CE_MAX_THREADS);
        cross_entropy_kernel<1><<<grid, nt, 0, c->stream>>>(loss, d, x, targets, N, V, grad_scale, ignore_index, flag);
    }
    FM_CUDA_LAUNCH_CHECK(c);
    const int64_t chunk = chunk_of(N, 256, 1024), nb = (N + chunk - 1) / chunk;
    masked_sum_kernel<<<(unsigned)nb, 256, 0, c->stream>>>(part, loss, targets, ignore_index, N, chunk);
    FM_CUDA_LAUNCH_CHECK(c);
    ce_sum_kernel<<<1, 1, 0, c->stream>>>(sum, part, nb);
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_lce_fold(void *ctx, float *m, float *z, float *tgt, float *ent, const float *strip,
                      const int32_t *targets, int64_t Nb, int64_t Vb, int64_t v0, bool first) {
    fm_cuda_ctx *c = ctx_of(ctx);
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
    FM_CUDA_LAUNCH_CHECK(c);
}

/* loss, logprob, entropy [Nb] assigned and sums[0..1] (device doubles) ADDED on the stream:
 * per-block partials of w*loss and w*lse^2, then their block-order sums added (lce_sums_kernel).
 * No host wait; a target outside [0,V) raises FM_CUDA_FLAG_LCE, reported by status. */
void fm_cuda_lce_finalize(void *ctx, float *loss, float *logprob, float *entropy, double *sums, const float *m,
                          const float *z, const float *tgt, const float *ent, const int32_t *targets,
                          const float *weights, int64_t Nb, int64_t V, int32_t ignore_index) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(Nb >= 0 && V >= 1 && (entropy == NULL || ent != NULL) && sums != NULL);
    double *part = (double *)scr_data(c);
    int64_t nb = 0;
    if (Nb > 0) {
        const int64_t chunk = chunk_of(Nb, 256, 256);
        nb = (Nb + chunk - 1) / chunk;
        lce_finalize_kernel<<<(unsigned)nb, 256, 0, c->stream>>>(part, dev_flag(c, FM_CUDA_FLAG_LCE), loss, logprob,
                                                                 entropy, m, z, tgt, ent, targets, weights, Nb, V,
                                                                 ignore_index, chunk);
        FM_CUDA_LAUNCH_CHECK(c);
    }
    lce_sums_kernel<<<1, 1, 0, c->stream>>>(sums, part, nb); /* Nb == 0 adds +0.0, as the CPU does */
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_lce_strip_grad(void *ctx, float *grad, const float *strip, const float *m, const float *z,
                            const int32_t *targets, const float *weights, int64_t Nb, int64_t Vb, int64_t v0,
                            int32_t ignore_index, float grad_scale, float z_coef) {
    fm_cuda_ctx *c = ctx_of(ctx);
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
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
