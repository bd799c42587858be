/* Our own causal grouped-query flash attention for bf16 on sm_80+ tensor cores (mma.sync
 * m16n8k16, fp32 accumulation), the forward: FlashAttention-2 (Dao, arXiv 2307.08691),
 * Algorithm 1, and the scalar forward for any hd. The backward is in cuda_attention_bwd.cu.
 *
 * Forward (one block of 8 warps per (b, head, 128-query tile); each warp owns 16 query rows):
 *   for key tiles j (64 keys, double-buffered with cp.async) up to the diagonal:
 *     S = Q K_j^T (log2 domain: S * scale * log2 e), causal mask on diagonal tiles;
 *     m' = max(m, rowmax S); P = 2^(S - m'); l = l 2^(m - m') + rowsum P;
 *     O = O 2^(m - m') + P V_j  (P rounded to bf16 for the tensor cores)
 *   out = O / l, lse = (m + log2 l) ln 2.
 * Memory is O(T hd): tiles live in shared memory, nothing of size T x T exists.
 * Packed documents (kvs non-NULL): the key tiles start at the tile holding the block's first
 * row's kv_start, a warp skips tiles before its first row's start, and each row masks the keys
 * before its own start as the causal mask masks those after it. A row may then see no key of a
 * tile: its maximum stays -inf and the exponentials use 0 in its place (FlashAttention's
 * Check_inf), so nothing becomes NaN; with kvs NULL the arithmetic is unchanged.
 *
 * Head dims: the tiles are padded with zeros to HDP = 64 (hd <= 64) or 128 (hd <= 128); hd must
 * be even (4-byte rows); 16-byte cp.async loads when hd % 8 == 0 and the pointers are 16-byte
 * aligned, 4-byte loads otherwise. Anything else goes to the scalar kernels at the end of this
 * file (any hd; slow but exact in fp32).
 *
 * The fragment layouts are in cuda_attention_tile.cuh. */
#include "cuda_attention_tile.cuh"

namespace {

/* ---- forward -------------------------------------------------------------------------------- */

constexpr int F_BM = 128, F_BN = 64, F_NT = 256;

template <int HDP>
constexpr size_t fwd_smem() { return (size_t)(F_BM + 4 * F_BN) * (HDP + 8) * sizeof(bf16); }

template <int HDP>
__global__ void __launch_bounds__(F_NT) fwd_kernel(bf16 *__restrict__ out, float *__restrict__ lse,
                                                   const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                                                   const bf16 *__restrict__ v, const int32_t *__restrict__ kvs,
                                                   int T, int nh, int nkv, int hd, float sl2, int vec) {
    constexpr int LD = HDP + 8, KT = HDP / 16, NTN = F_BN / 8, NTD = HDP / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16 *Qs = reinterpret_cast<bf16 *>(smem_raw);
    bf16 *Ks = Qs + F_BM * LD;
    bf16 *Vs = Ks + 2 * F_BN * LD;

    const int it = gridDim.x - 1 - blockIdx.x; /* heavy (late) query tiles first */
    const int bh = blockIdx.y, b = bh / nh, h = bh - b * nh, g = h / (nh / nkv);
    const int i0 = it * F_BM;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tq = lane & 3;
    const int64_t qs = (int64_t)nh * hd, ks = (int64_t)nkv * hd;
    const bf16 *Qg = q + ((int64_t)b * T + i0) * qs + (int64_t)h * hd;
    const bf16 *Kg = k + (int64_t)b * T * ks + (int64_t)g * hd;
    const bf16 *Vg = v + (int64_t)b * T * ks + (int64_t)g * hd;
    const int jend = min(T, i0 + F_BM);
    const int nj = (jend + F_BN - 1) / F_BN;
    const int32_t *kvb = kvs ? kvs + (int64_t)b * T : NULL; /* this row's document starts */
    const int jf = kvb ? kvb[i0] / F_BN : 0;                /* first key tile any row sees */

    load_tile<F_BM, HDP, F_NT>(Qs, Qg, qs, T - i0, hd, vec, tid, q);
    load_tile<F_BN, HDP, F_NT>(Ks, Kg + (int64_t)jf * F_BN * ks, ks, T - jf * F_BN, hd, vec, tid, k);
    load_tile<F_BN, HDP, F_NT>(Vs, Vg + (int64_t)jf * F_BN * ks, ks, T - jf * F_BN, hd, vec, tid, v);
    cp_async_commit();

    float o[NTD][4];
#pragma unroll
    for (int i = 0; i < NTD; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const int wrow = warp * 16;
    const int r0 = i0 + wrow + gr, r1 = r0 + 8;
    const int s0 = kvb ? kvb[min(r0, T - 1)] : 0, s1 = kvb ? kvb[min(r1, T - 1)] : 0; /* rows' starts */
    const int sw = kvb ? kvb[min(i0 + wrow, T - 1)] : 0; /* the warp's first start */

    for (int j = jf; j < nj; j++) {
        cp_async_wait_all();
        __syncthreads();
        if (j + 1 < nj) {
            const int st = (j + 1 - jf) & 1, jn = (j + 1) * F_BN;
            load_tile<F_BN, HDP, F_NT>(Ks + st * F_BN * LD, Kg + (int64_t)jn * ks, ks, T - jn, hd, vec, tid, k);
            load_tile<F_BN, HDP, F_NT>(Vs + st * F_BN * LD, Vg + (int64_t)jn * ks, ks, T - jn, hd, vec, tid, v);
            cp_async_commit();
        }
        const int j0 = j * F_BN;
        if (j0 > i0 + wrow + 15) continue; /* every key of the tile is after every row of this warp */
        if (j0 + F_BN <= sw) continue;     /* every key of the tile is before every row's document */
        const bf16 *Kc = Ks + ((j - jf) & 1) * F_BN * LD, *Vc = Vs + ((j - jf) & 1) * F_BN * LD;

        float s[NTN][4];
#pragma unroll
        for (int i = 0; i < NTN; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            uint32_t a[4];
            frag_a<LD>(a, Qs, wrow, kk * 16, gr, tq);
#pragma unroll
            for (int np = 0; np < NTN / 2; np++) {
                uint32_t b[4];
                frag_b2<LD>(b, Kc, np * 16, kk * 16, gr, tq);
                mma16816(s[2 * np], a, b[0], b[1]);
                mma16816(s[2 * np + 1], a, b[2], b[3]);
            }
        }
        const bool diag = j0 + F_BN - 1 > i0 + wrow;
        const bool lo = j0 < s0 || j0 < s1; /* some key of the tile is before a row's document */
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < NTN; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = j0 + nt * 8 + tq * 2 + e;
                float x0 = s[nt][e] * sl2, x1 = s[nt][2 + e] * sl2;
                if (diag) {
                    if (col > r0) x0 = -INFINITY;
                    if (col > r1) x1 = -INFINITY;
                }
                if (lo) {
                    if (col < s0) x0 = -INFINITY;
                    if (col < s1) x1 = -INFINITY;
                }
                s[nt][e] = x0;
                s[nt][2 + e] = x1;
                mx0 = fmaxf(mx0, x0);
                mx1 = fmaxf(mx1, x1);
            }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        /* Causal: mx is finite (key 0 is visible to every row on the first tile, and m stays
         * finite). Packed documents: a row that has seen no key yet has mx -inf; 0 stands in
         * for it, so c = 2^-inf = 0 and every p = 2^-inf = 0. */
        const float e0 = mx0 == -INFINITY ? 0.0f : mx0, e1 = mx1 == -INFINITY ? 0.0f : mx1;
        const float c0 = exp2f(m0 - e0), c1 = exp2f(m1 - e1);
        m0 = mx0;
        m1 = mx1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NTN; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                s[nt][e] = exp2f(s[nt][e] - e0);
                s[nt][2 + e] = exp2f(s[nt][2 + e] - e1);
                ps0 += s[nt][e];
                ps1 += s[nt][2 + e];
            }
        l0 = l0 * c0 + ps0;
        l1 = l1 * c1 + ps1;
#pragma unroll
        for (int nd = 0; nd < NTD; nd++) {
            o[nd][0] *= c0;
            o[nd][1] *= c0;
            o[nd][2] *= c1;
            o[nd][3] *= c1;
        }
#pragma unroll
        for (int kc = 0; kc < F_BN / 16; kc++) {
            uint32_t a[4];
            a[0] = pack_bf16(s[2 * kc][0], s[2 * kc][1]);
            a[1] = pack_bf16(s[2 * kc][2], s[2 * kc][3]);
            a[2] = pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]);
            a[3] = pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
            for (int dp = 0; dp < HDP / 16; dp++) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, Vc + (kc * 16 + (lane & 15)) * LD + dp * 16 + (lane >> 4) * 8);
                mma16816(o[2 * dp], a, b0, b1);
                mma16816(o[2 * dp + 1], a, b2, b3);
            }
        }
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
    if (tq == 0) {
        if (r0 < T) lse[(int64_t)bh * T + r0] = m0 * kLn2 + logf(l0);
        if (r1 < T) lse[(int64_t)bh * T + r1] = m1 * kLn2 + logf(l1);
    }
    /* Stage the warp's 16 rows in its own rows of Qs (read by no other warp), then store. */
    bf16 *Os = Qs + wrow * LD;
#pragma unroll
    for (int nd = 0; nd < NTD; nd++) {
        const int col = nd * 8 + tq * 2;
        st32(Os + gr * LD + col, pack_bf16(o[nd][0] * inv0, o[nd][1] * inv0));
        st32(Os + (gr + 8) * LD + col, pack_bf16(o[nd][2] * inv1, o[nd][3] * inv1));
    }
    __syncwarp();
    store_rows16<HDP>(out + ((int64_t)b * T + i0 + wrow) * qs + (int64_t)h * hd, qs, Os, T - (i0 + wrow),
                      hd, vec, lane);
}

/* ---- the scalar forward (any hd) -------------------------------------------------------------- */

/* One block per (b, head, query t). Shared: qrow[hd], o[hd], p[S_NT], red[S_NT/32]. */
__global__ void __launch_bounds__(S_NT) simple_fwd_kernel(bf16 *out, float *lse, const bf16 *q, const bf16 *k,
                                                          const bf16 *v, const int32_t *kvs, int T, int nh, int nkv,
                                                          int hd, float scale) {
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
    for (int c0 = kvs ? kvs[(int64_t)b * T + t] : 0; c0 <= t; c0 += S_NT) { /* keys of t's document */
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
    bf16 *orow = out + ((int64_t)b * T + t) * qs + (int64_t)h * hd;
    for (int d = threadIdx.x; d < hd; d += S_NT) orow[d] = __float2bfloat16(o[d] / l);
    if (threadIdx.x == 0) lse[(int64_t)bh * T + t] = m + logf(l);
}

template <int HDP>
void launch_fwd(cudaStream_t st, bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                const int32_t *kvs, int B, int T, int nh, int nkv, int hd, int vec) {
    const float sl2 = (float)(1.0 / sqrt((double)hd)) * kLog2e;
    dim3 grid((T + F_BM - 1) / F_BM, B * nh);
    fwd_kernel<HDP><<<grid, F_NT, fwd_smem<HDP>(), st>>>(out, lse, q, k, v, kvs, T, nh, nkv, hd, sl2, vec);
}

} // namespace

cudaError_t fm_att_flash_setup(void) {
    cudaError_t e;
#define FM_ATT_SMEM(kern, bytes)                                                                  \
    if ((e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(bytes))) != \
        cudaSuccess)                                                                              \
        return e;
    FM_ATT_SMEM(fwd_kernel<64>, fwd_smem<64>());
    FM_ATT_SMEM(fwd_kernel<128>, fwd_smem<128>());
#undef FM_ATT_SMEM
    return fm_att_flash_bwd_setup();
}

int fm_att_flash_ok(int64_t hd, const void *const *ptrs, int nptrs) {
    if (hd < 2 || hd > 128 || (hd & 1)) return 0;
    for (int i = 0; i < nptrs; i++)
        if (!aligned(ptrs[i], 4)) return 0;
    return 1;
}

void fm_att_flash_fwd(cudaStream_t s, bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, int64_t B,
                      int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start) {
    const void *p[4] = {out, q, k, v};
    const int vec = vec_ok(hd, p, 4);
    if (hd <= 64) launch_fwd<64>(s, out, lse, q, k, v, kv_start, (int)B, (int)T, (int)nh, (int)nkv, (int)hd, vec);
    else launch_fwd<128>(s, out, lse, q, k, v, kv_start, (int)B, (int)T, (int)nh, (int)nkv, (int)hd, vec);
}

void fm_att_simple_fwd(cudaStream_t s, bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, int64_t B,
                       int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start) {
    const float scale = (float)(1.0 / sqrt((double)hd));
    const size_t sm = ((size_t)2 * hd + S_NT + S_NT / 32) * sizeof(float);
    simple_fwd_kernel<<<dim3((unsigned)T, (unsigned)(B * nh)), S_NT, sm, s>>>(out, lse, q, k, v, kv_start, (int)T,
                                                                               (int)nh, (int)nkv, (int)hd, scale);
}
