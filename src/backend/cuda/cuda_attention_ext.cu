/* Attention with GPT-OSS's sinks and sliding windows on the GPU (fm_backend.h attention_ext_fwd /
 * attention_ext_bwd): scalar kernels in the form of cuda_attention_fwd.cu's and _bwd.cu's scalar
 * ones (one block per query for the forward and dq, one per key for dk and dv; fp32 arithmetic,
 * a fixed order, no atomics: deterministic), with
 *   the window: query t's first key max(kv_start[t], t - W + 1) (W > 0), and key s's last query
 *     s + W - 1 in the dk/dv kernel;
 *   the sinks: the forward's denominator gains exp(sink_h - m) and lse includes it
 *     (m* = max(m, sink), l* = l e^(m - m*) + e^(sink - m*)), as cpu_attention.c's;
 *   dsinks[h] += -sum over (b, t) of exp(sink_h - lse) (dO . O), one block per head.
 * Neither cuDNN nor our tiled kernels serve sinks or windows yet: these kernels are correct, not
 * fast (O(T W hd) per head without tensor cores); the tiled kernels' window and sink terms are the
 * next step for speed. */
#include "cuda_attention_tile.cuh"
#include "cuda_internal.h"

namespace {

__device__ __forceinline__ int first_key(const int32_t *kvs, int b, int T, int t, int W) {
    const int f = kvs ? kvs[(int64_t)b * T + t] : 0;
    return W > 0 && t - W + 1 > f ? t - W + 1 : f;
}

/* One block per (b, head, query t). Shared: qrow[hd], o[hd], p[S_NT], red[S_NT/32]. */
__global__ void __launch_bounds__(S_NT) ext_fwd_kernel(bf16 *out, float *lse, const bf16 *q, const bf16 *k,
                                                       const bf16 *v, const int32_t *kvs, const bf16 *sinks, int T,
                                                       int nh, int nkv, int hd, int W, float scale) {
    extern __shared__ float sm[];
    float *qrow = sm, *o = qrow + hd, *p = o + hd, *red = p + S_NT;
    const int t = blockIdx.x, bh = blockIdx.y, b = bh / nh, h = bh - b * nh, g = h / (nh / nkv);
    const int64_t qs = (int64_t)nh * hd, ks = (int64_t)nkv * hd;
    const bf16 *qr = q + ((int64_t)b * T + t) * qs + (int64_t)h * hd;
    const bf16 *K = k + (int64_t)b * T * ks + (int64_t)g * hd, *V = v + (int64_t)b * T * ks + (int64_t)g * hd;
    for (int d = threadIdx.x; d < hd; d += S_NT) {
        qrow[d] = __bfloat162float(qr[d]);
        o[d] = 0.0f;
    }
    __syncthreads();
    float m = -INFINITY, l = 0.0f;
    for (int c0 = first_key(kvs, b, T, t, W); c0 <= t; c0 += S_NT) {
        const int j = c0 + threadIdx.x;
        const float s = j <= t ? dot_sf(qrow, K + (int64_t)j * ks, hd) * scale : -INFINITY;
        const float mn = fmaxf(m, block_max(s, red));
        const float corr = expf(m - mn);
        const float pj = j <= t ? expf(s - mn) : 0.0f;
        l = l * corr + block_sum(pj, red);
        m = mn;
        p[threadIdx.x] = pj;
        __syncthreads();
        const int n = min(S_NT, t + 1 - c0);
        for (int d = threadIdx.x; d < hd; d += S_NT) {
            float acc = o[d] * corr;
            for (int jj = 0; jj < n; jj++) acc = fmaf(p[jj], __bfloat162float(V[(int64_t)(c0 + jj) * ks + d]), acc);
            o[d] = acc;
        }
        __syncthreads();
    }
    float inv = 1.0f / l, L = m + logf(l);
    if (sinks) { /* the sink joins the denominator only */
        const float sk = __bfloat162float(sinks[h]), mf = fmaxf(m, sk);
        const float co = expf(m - mf), lf = l * co + expf(sk - mf);
        inv = co / lf;
        L = mf + logf(lf);
    }
    bf16 *orow = out + ((int64_t)b * T + t) * qs + (int64_t)h * hd;
    for (int d = threadIdx.x; d < hd; d += S_NT) orow[d] = __float2bfloat16(o[d] * inv);
    if (threadIdx.x == 0) lse[(int64_t)bh * T + t] = L;
}

/* One block per (b, head, query t). Shared: qrow[hd], dorow[hd], acc[hd], p[S_NT], red. */
__global__ void __launch_bounds__(S_NT) ext_dq_kernel(bf16 *dq, const bf16 *dout, const bf16 *q, const bf16 *k,
                                                      const bf16 *v, const bf16 *out, const float *lse,
                                                      const int32_t *kvs, int T, int nh, int nkv, int hd, int W,
                                                      float scale) {
    extern __shared__ float sm[];
    float *qrow = sm, *dorow = qrow + hd, *acc = dorow + hd, *p = acc + hd, *red = p + S_NT;
    const int t = blockIdx.x, bh = blockIdx.y, b = bh / nh, h = bh - b * nh, g = h / (nh / nkv);
    const int64_t qs = (int64_t)nh * hd, ks = (int64_t)nkv * hd;
    const int64_t qo = ((int64_t)b * T + t) * qs + (int64_t)h * hd;
    const bf16 *K = k + (int64_t)b * T * ks + (int64_t)g * hd, *V = v + (int64_t)b * T * ks + (int64_t)g * hd;
    float dpart = 0.0f;
    for (int d = threadIdx.x; d < hd; d += S_NT) {
        qrow[d] = __bfloat162float(q[qo + d]);
        dorow[d] = __bfloat162float(dout[qo + d]);
        dpart = fmaf(dorow[d], __bfloat162float(out[qo + d]), dpart);
        acc[d] = 0.0f;
    }
    const float D = block_sum(dpart, red);
    const float L = lse[(int64_t)bh * T + t];
    for (int c0 = first_key(kvs, b, T, t, W); c0 <= t; c0 += S_NT) {
        const int j = c0 + threadIdx.x;
        float ds = 0.0f;
        if (j <= t) {
            const float s = dot_sf(qrow, K + (int64_t)j * ks, hd) * scale;
            const float dp = dot_sf(dorow, V + (int64_t)j * ks, hd);
            ds = expf(s - L) * (dp - D);
        }
        __syncthreads();
        p[threadIdx.x] = ds;
        __syncthreads();
        const int n = min(S_NT, t + 1 - c0);
        for (int d = threadIdx.x; d < hd; d += S_NT) {
            float a = acc[d];
            for (int jj = 0; jj < n; jj++) a = fmaf(p[jj], __bfloat162float(K[(int64_t)(c0 + jj) * ks + d]), a);
            acc[d] = a;
        }
    }
    for (int d = threadIdx.x; d < hd; d += S_NT) dq[qo + d] = __float2bfloat16(acc[d] * scale);
}

/* One block per (b, kv head, key s), over the group's heads and the queries that see s.
 * Shared: krow[hd], vrow[hd], dka[hd], dva[hd], pp[S_NT], pd[S_NT]. */
__global__ void __launch_bounds__(S_NT) ext_dkdv_kernel(bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q,
                                                        const bf16 *k, const bf16 *v, const bf16 *out, const float *lse,
                                                        const int32_t *kvs, int T, int nh, int nkv, int hd, int W,
                                                        float scale) {
    extern __shared__ float sm[];
    float *krow = sm, *vrow = krow + hd, *dka = vrow + hd, *dva = dka + hd, *pp = dva + hd, *pd = pp + S_NT;
    const int s = blockIdx.x, bg = blockIdx.y, b = bg / nkv, g = bg - b * nkv, grp = nh / nkv;
    const int64_t qs = (int64_t)nh * hd, ks = (int64_t)nkv * hd;
    const int64_t ko = ((int64_t)b * T + s) * ks + (int64_t)g * hd;
    const int tend = W > 0 && s + W < T ? s + W : T; /* queries s .. s + W - 1 see key s */
    for (int d = threadIdx.x; d < hd; d += S_NT) {
        krow[d] = __bfloat162float(k[ko + d]);
        vrow[d] = __bfloat162float(v[ko + d]);
        dka[d] = dva[d] = 0.0f;
    }
    __syncthreads();
    for (int h = g * grp; h < (g + 1) * grp; h++) {
        const bf16 *Q = q + (int64_t)b * T * qs + (int64_t)h * hd;
        const bf16 *dO = dout + (int64_t)b * T * qs + (int64_t)h * hd;
        const bf16 *O = out + (int64_t)b * T * qs + (int64_t)h * hd;
        for (int c0 = s; c0 < tend; c0 += S_NT) {
            const int t = c0 + threadIdx.x;
            float p = 0.0f, ds = 0.0f;
            if (t < tend && s >= first_key(kvs, b, T, t, W)) {
                const bf16 *qr = Q + (int64_t)t * qs, *dr = dO + (int64_t)t * qs, *orr = O + (int64_t)t * qs;
                float sc = 0.0f, dp = 0.0f, D = 0.0f;
                for (int d = 0; d < hd; d++) {
                    const float x = __bfloat162float(dr[d]);
                    sc = fmaf(__bfloat162float(qr[d]), krow[d], sc);
                    dp = fmaf(x, vrow[d], dp);
                    D = fmaf(x, __bfloat162float(orr[d]), D);
                }
                p = expf(sc * scale - lse[((int64_t)b * nh + h) * T + t]);
                ds = p * (dp - D);
            }
            pp[threadIdx.x] = p;
            pd[threadIdx.x] = ds;
            __syncthreads();
            const int n = min(S_NT, tend - c0);
            for (int d = threadIdx.x; d < hd; d += S_NT) {
                float a = dva[d], c = dka[d];
                for (int tt = 0; tt < n; tt++) {
                    const int64_t ro = (int64_t)(c0 + tt) * qs + d;
                    a = fmaf(pp[tt], __bfloat162float(dO[ro]), a);
                    c = fmaf(pd[tt], __bfloat162float(Q[ro]), c);
                }
                dva[d] = a;
                dka[d] = c;
            }
            __syncthreads();
        }
    }
    for (int d = threadIdx.x; d < hd; d += S_NT) {
        dk[ko + d] = __float2bfloat16(dka[d] * scale);
        dv[ko + d] = __float2bfloat16(dva[d]);
    }
}

/* One block per head h: dsinks[h] += -sum over (b, t) of exp(sink - lse[b,h,t]) (dO . O)[b,t,h];
 * each thread sums its (b, t) in order, then a fixed tree (block_sum). */
__global__ void __launch_bounds__(S_NT) ext_dsinks_kernel(bf16 *dsinks, const bf16 *sinks, const bf16 *dout,
                                                          const bf16 *out, const float *lse, int B, int T, int nh,
                                                          int hd) {
    __shared__ float red[S_NT / 32];
    const int h = blockIdx.x;
    const float sk = __bfloat162float(sinks[h]);
    const int64_t qs = (int64_t)nh * hd;
    float acc = 0.0f;
    for (int64_t bt = threadIdx.x; bt < (int64_t)B * T; bt += S_NT) {
        const int64_t b = bt / T, t = bt - b * T;
        const bf16 *a = dout + bt * qs + (int64_t)h * hd, *o = out + bt * qs + (int64_t)h * hd;
        float D = 0.0f;
        for (int d = 0; d < hd; d++) D = fmaf(__bfloat162float(a[d]), __bfloat162float(o[d]), D);
        acc += expf(sk - lse[(b * nh + h) * T + t]) * D;
    }
    const float tot = block_sum(acc, red);
    if (threadIdx.x == 0) dsinks[h] = __float2bfloat16(__bfloat162float(dsinks[h]) - tot);
}

} // namespace

void fm_cuda_attention_ext_fwd(void *ctx, fm_act *out, float *lse, const fm_act *q, const fm_act *k, const fm_act *v,
                               int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start,
                               const fm_act *sinks, int64_t window) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(B >= 0 && T >= 0 && nh >= 1 && nkv >= 1 && nh % nkv == 0 && window >= 0 && B * nh <= 65535);
    if (B == 0 || T == 0) return;
    const float scale = (float)(1.0 / sqrt((double)hd));
    const size_t sm = ((size_t)2 * hd + S_NT + S_NT / 32) * sizeof(float);
    const int W = window > T ? (int)T : (int)window;
    ext_fwd_kernel<<<dim3((unsigned)T, (unsigned)(B * nh)), S_NT, sm, c->stream>>>(
        BF(out), lse, CBF(q), CBF(k), CBF(v), kv_start, CBF(sinks), (int)T, (int)nh, (int)nkv, (int)hd, W, scale);
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_attention_ext_bwd(void *ctx, fm_act *dq, fm_act *dk, fm_act *dv, fm_act *dsinks, const fm_act *dout,
                               const fm_act *q, const fm_act *k, const fm_act *v, const fm_act *out, const float *lse,
                               int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start,
                               const fm_act *sinks, int64_t window) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(B >= 0 && T >= 0 && nh >= 1 && nkv >= 1 && nh % nkv == 0 && window >= 0 && B * nh <= 65535);
    if (B == 0 || T == 0) return;
    const float scale = (float)(1.0 / sqrt((double)hd));
    const int W = window > T ? (int)T : (int)window;
    const size_t smq = ((size_t)3 * hd + S_NT + S_NT / 32) * sizeof(float);
    ext_dq_kernel<<<dim3((unsigned)T, (unsigned)(B * nh)), S_NT, smq, c->stream>>>(
        BF(dq), CBF(dout), CBF(q), CBF(k), CBF(v), CBF(out), lse, kv_start, (int)T, (int)nh, (int)nkv, (int)hd, W, scale);
    FM_CUDA_LAUNCH_CHECK(c);
    const size_t smk = ((size_t)4 * hd + 2 * S_NT) * sizeof(float);
    ext_dkdv_kernel<<<dim3((unsigned)T, (unsigned)(B * nkv)), S_NT, smk, c->stream>>>(
        BF(dk), BF(dv), CBF(dout), CBF(q), CBF(k), CBF(v), CBF(out), lse, kv_start, (int)T, (int)nh, (int)nkv, (int)hd, W,
        scale);
    FM_CUDA_LAUNCH_CHECK(c);
    if (sinks && dsinks) {
        ext_dsinks_kernel<<<(unsigned)nh, S_NT, 0, c->stream>>>(BF(dsinks), CBF(sinks), CBF(dout), CBF(out), lse,
                                                                (int)B, (int)T, (int)nh, (int)hd);
        FM_CUDA_LAUNCH_CHECK(c);
    }
}
