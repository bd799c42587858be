/* Our own causal grouped-query flash attention for bf16 on sm_80+ tensor cores (mma.sync
 * m16n8k16, fp32 accumulation), the backward: FlashAttention-2 (Dao, arXiv 2307.08691),
 * Algorithm 2, split in two deterministic kernels, and the scalar backward for any hd. The
 * forward is in cuda_attention_fwd.cu.
 *
 * Backward, with D_i = rowsum(dO_i o O_i) computed on the fly (no scratch buffer):
 *   dK/dV kernel: one block of 4 warps per (b, kv head, 64-key tile), each warp 16 keys; it
 *     walks every query head of the group and every 32-query tile at or after the key tile
 *     (double-buffered), recomputing P^T = exp(scale K Q^T - lse) and
 *     dV += P^T dO;  dP^T = V dO^T;  dS^T = P^T o (dP^T - D);  dK += dS^T Q.
 *   dQ kernel: one block of 4 warps per (b, head, 64-query tile), each warp 16 queries; it walks
 *     the key tiles up to the diagonal: P = exp(scale Q K^T - lse); dP = dO V^T;
 *     dS = P o (dP - D); dQ += dS K.
 *   Every gradient element is written by one block, summed in a fixed order: bitwise
 *   deterministic. The two kernels recompute S and dP each (7 tile products instead of 5).
 * Memory is O(T hd): tiles live in shared memory, nothing of size T x T exists.
 * Packed documents (kvs non-NULL): P is 0 where a key is before its query's document start
 * (as after it, causally); the dQ kernel starts at the key tile of the block's first start and
 * a warp skips tiles before its own first start. The dK/dV kernel still walks every query
 * tile at or after its keys (the masked ones add zeros).
 *
 * Head dims: the tiles are padded with zeros to HDP = 64 (hd <= 64) or 128 (hd <= 128); hd must
 * be even (4-byte rows); 16-byte cp.async loads when hd % 8 == 0 and the pointers are 16-byte
 * aligned, 4-byte loads otherwise. Anything else goes to the scalar kernels at the end of this
 * file (any hd; slow but exact in fp32).
 *
 * The fragment layouts are in cuda_attention_tile.cuh. */
#include "cuda_attention_tile.cuh"

namespace {

/* ---- backward: dQ ---------------------------------------------------------------------------- */

constexpr int Q_BM = 64, Q_BN = 64, Q_NT = 128;

template <int HDP>
constexpr size_t dq_smem() {
    return (size_t)(2 * Q_BM + 4 * Q_BN) * (HDP + 8) * sizeof(bf16) + 2 * Q_BM * sizeof(float);
}

template <int HDP>
__global__ void __launch_bounds__(Q_NT) bwd_dq_kernel(bf16 *__restrict__ dq, const bf16 *__restrict__ dout,
                                                      const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                                                      const bf16 *__restrict__ v, const bf16 *__restrict__ out,
                                                      const float *__restrict__ lse, const int32_t *__restrict__ kvs,
                                                      int T, int nh, int nkv, int hd, float sl2, float scale,
                                                      int vec) {
    constexpr int LD = HDP + 8, KT = HDP / 16, NTN = Q_BN / 8, NTD = HDP / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16 *Qs = reinterpret_cast<bf16 *>(smem_raw);
    bf16 *dOs = Qs + Q_BM * LD;
    bf16 *Ks = dOs + Q_BM * LD;
    bf16 *Vs = Ks + 2 * Q_BN * LD;
    float *lse2s = reinterpret_cast<float *>(Vs + 2 * Q_BN * LD);
    float *Ds = lse2s + Q_BM;

    const int it = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / nh, h = bh - b * nh, g = h / (nh / nkv);
    const int i0 = it * Q_BM;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tq = lane & 3;
    const int64_t qs = (int64_t)nh * hd, ks = (int64_t)nkv * hd;
    const int64_t qoff = ((int64_t)b * T + i0) * qs + (int64_t)h * hd;
    const bf16 *Kg = k + (int64_t)b * T * ks + (int64_t)g * hd;
    const bf16 *Vg = v + (int64_t)b * T * ks + (int64_t)g * hd;
    const int jend = min(T, i0 + Q_BM);
    const int nj = (jend + Q_BN - 1) / Q_BN;
    const int32_t *kvb = kvs ? kvs + (int64_t)b * T : NULL; /* this row's document starts */
    const int jf = kvb ? kvb[i0] / Q_BN : 0;                /* first key tile any row sees */

    load_tile<Q_BM, HDP, Q_NT>(Qs, q + qoff, qs, T - i0, hd, vec, tid, q);
    load_tile<Q_BM, HDP, Q_NT>(dOs, dout + qoff, qs, T - i0, hd, vec, tid, dout);
    load_tile<Q_BN, HDP, Q_NT>(Ks, Kg + (int64_t)jf * Q_BN * ks, ks, T - jf * Q_BN, hd, vec, tid, k);
    load_tile<Q_BN, HDP, Q_NT>(Vs, Vg + (int64_t)jf * Q_BN * ks, ks, T - jf * Q_BN, hd, vec, tid, v);
    cp_async_commit();
    tile_D_lse<Q_BM, Q_NT>(Ds, lse2s, dout + qoff, out + qoff, qs, lse + (int64_t)bh * T + i0, T - i0, hd, tid);

    float acc[NTD][4];
#pragma unroll
    for (int i = 0; i < NTD; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    const int wrow = warp * 16;
    const int r0 = i0 + wrow + gr, r1 = r0 + 8;
    float L0 = 0.0f, L1 = 0.0f, D0 = 0.0f, D1 = 0.0f;
    const int s0 = kvb ? kvb[min(r0, T - 1)] : 0, s1 = kvb ? kvb[min(r1, T - 1)] : 0; /* rows' starts */
    const int sw = kvb ? kvb[min(i0 + wrow, T - 1)] : 0; /* the warp's first start */

    for (int j = jf; j < nj; j++) {
        cp_async_wait_all();
        __syncthreads();
        if (j == jf) {
            L0 = lse2s[wrow + gr];
            L1 = lse2s[wrow + gr + 8];
            D0 = Ds[wrow + gr];
            D1 = Ds[wrow + gr + 8];
        }
        if (j + 1 < nj) {
            const int st = (j + 1 - jf) & 1, jn = (j + 1) * Q_BN;
            load_tile<Q_BN, HDP, Q_NT>(Ks + st * Q_BN * LD, Kg + (int64_t)jn * ks, ks, T - jn, hd, vec, tid, k);
            load_tile<Q_BN, HDP, Q_NT>(Vs + st * Q_BN * LD, Vg + (int64_t)jn * ks, ks, T - jn, hd, vec, tid, v);
            cp_async_commit();
        }
        const int j0 = j * Q_BN;
        if (j0 > i0 + wrow + 15) continue;
        if (j0 + Q_BN <= sw) continue; /* every key of the tile is before every row's document */
        const bf16 *Kc = Ks + ((j - jf) & 1) * Q_BN * LD, *Vc = Vs + ((j - jf) & 1) * Q_BN * LD;

        float s[NTN][4], dp[NTN][4];
#pragma unroll
        for (int i = 0; i < NTN; i++) {
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
            dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            uint32_t a[4], a2[4];
            frag_a<LD>(a, Qs, wrow, kk * 16, gr, tq);
            frag_a<LD>(a2, dOs, wrow, kk * 16, gr, tq);
#pragma unroll
            for (int np = 0; np < NTN / 2; np++) {
                uint32_t b[4], b2[4];
                frag_b2<LD>(b, Kc, np * 16, kk * 16, gr, tq);
                frag_b2<LD>(b2, Vc, np * 16, kk * 16, gr, tq);
                mma16816(s[2 * np], a, b[0], b[1]);
                mma16816(s[2 * np + 1], a, b[2], b[3]);
                mma16816(dp[2 * np], a2, b2[0], b2[1]);
                mma16816(dp[2 * np + 1], a2, b2[2], b2[3]);
            }
        }
        const bool diag = j0 + Q_BN - 1 > i0 + wrow;
        const bool lo = j0 < s0 || j0 < s1; /* some key of the tile is before a row's document */
#pragma unroll
        for (int nt = 0; nt < NTN; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = j0 + nt * 8 + tq * 2 + e;
                float p0 = exp2f(s[nt][e] * sl2 - L0), p1 = exp2f(s[nt][2 + e] * sl2 - L1);
                if (diag) {
                    if (col > r0) p0 = 0.0f;
                    if (col > r1) p1 = 0.0f;
                }
                if (lo) {
                    if (col < s0) p0 = 0.0f;
                    if (col < s1) p1 = 0.0f;
                }
                s[nt][e] = p0 * (dp[nt][e] - D0);
                s[nt][2 + e] = p1 * (dp[nt][2 + e] - D1);
            }
#pragma unroll
        for (int kc = 0; kc < Q_BN / 16; kc++) {
            uint32_t a[4];
            a[0] = pack_bf16(s[2 * kc][0], s[2 * kc][1]);
            a[1] = pack_bf16(s[2 * kc][2], s[2 * kc][3]);
            a[2] = pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]);
            a[3] = pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
            for (int dd = 0; dd < HDP / 16; dd++) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, Kc + (kc * 16 + (lane & 15)) * LD + dd * 16 + (lane >> 4) * 8);
                mma16816(acc[2 * dd], a, b0, b1);
                mma16816(acc[2 * dd + 1], a, b2, b3);
            }
        }
    }

    bf16 *Os = Qs + wrow * LD; /* this warp's own Q rows */
    __syncwarp();
#pragma unroll
    for (int nd = 0; nd < NTD; nd++) {
        const int col = nd * 8 + tq * 2;
        st32(Os + gr * LD + col, pack_bf16(acc[nd][0] * scale, acc[nd][1] * scale));
        st32(Os + (gr + 8) * LD + col, pack_bf16(acc[nd][2] * scale, acc[nd][3] * scale));
    }
    __syncwarp();
    store_rows16<HDP>(dq + qoff + (int64_t)wrow * qs, qs, Os, T - (i0 + wrow), hd, vec, lane);
}

/* ---- backward: dK, dV ------------------------------------------------------------------------ */

constexpr int K_BM = 32, K_BN = 64, K_NT = 128;

template <int HDP>
constexpr size_t dkdv_smem() {
    return (size_t)(2 * K_BN + 4 * K_BM) * (HDP + 8) * sizeof(bf16) + 4 * K_BM * sizeof(float);
}

template <int HDP>
__global__ void __launch_bounds__(K_NT) bwd_dkdv_kernel(bf16 *__restrict__ dk, bf16 *__restrict__ dv,
                                                        const bf16 *__restrict__ dout, const bf16 *__restrict__ q,
                                                        const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                                                        const bf16 *__restrict__ out, const float *__restrict__ lse,
                                                        const int32_t *__restrict__ kvs, int T, int nh, int nkv,
                                                        int hd, float sl2, float scale, int vec) {
    constexpr int LD = HDP + 8, KT = HDP / 16, NTQ = K_BM / 8, NTD = HDP / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16 *Ks = reinterpret_cast<bf16 *>(smem_raw);
    bf16 *Vs = Ks + K_BN * LD;
    bf16 *Qs = Vs + K_BN * LD;     /* [2][K_BM][LD] */
    bf16 *dOs = Qs + 2 * K_BM * LD; /* [2][K_BM][LD] */
    float *lse2s = reinterpret_cast<float *>(dOs + 2 * K_BM * LD); /* [2][K_BM] */
    float *Ds = lse2s + 2 * K_BM;                                  /* [2][K_BM] */

    const int jt = blockIdx.x; /* early key tiles see the most queries: they go first */
    const int bg = blockIdx.y, b = bg / nkv, g = bg - b * nkv;
    const int grp = nh / nkv;
    const int j0 = jt * K_BN;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tq = lane & 3;
    const int64_t qs = (int64_t)nh * hd, ks = (int64_t)nkv * hd;
    const int64_t koff = ((int64_t)b * T + j0) * ks + (int64_t)g * hd;
    const int istart = (j0 / K_BM) * K_BM;
    const int nqt = (T - istart + K_BM - 1) / K_BM;
    const int nit = grp * nqt;

    auto q_off = [&](int iter, int &i0, int &h) -> int64_t {
        const int hh = iter / nqt;
        i0 = istart + (iter - hh * nqt) * K_BM;
        h = g * grp + hh;
        return ((int64_t)b * T + i0) * qs + (int64_t)h * hd;
    };

    load_tile<K_BN, HDP, K_NT>(Ks, k + koff, ks, T - j0, hd, vec, tid, k);
    load_tile<K_BN, HDP, K_NT>(Vs, v + koff, ks, T - j0, hd, vec, tid, v);
    {
        int i0, h;
        const int64_t qo = q_off(0, i0, h);
        load_tile<K_BM, HDP, K_NT>(Qs, q + qo, qs, T - i0, hd, vec, tid, q);
        load_tile<K_BM, HDP, K_NT>(dOs, dout + qo, qs, T - i0, hd, vec, tid, dout);
        cp_async_commit();
        tile_D_lse<K_BM, K_NT>(Ds, lse2s, dout + qo, out + qo, qs, lse + ((int64_t)b * nh + h) * T + i0, T - i0,
                               hd, tid);
    }

    float dka[NTD][4], dva[NTD][4];
#pragma unroll
    for (int i = 0; i < NTD; i++) {
        dka[i][0] = dka[i][1] = dka[i][2] = dka[i][3] = 0.0f;
        dva[i][0] = dva[i][1] = dva[i][2] = dva[i][3] = 0.0f;
    }
    const int wrow = warp * 16;
    const int kr0 = j0 + wrow + gr, kr1 = kr0 + 8;

    for (int iter = 0; iter < nit; iter++) {
        cp_async_wait_all();
        __syncthreads();
        int i0, h;
        q_off(iter, i0, h);
        int i0n = 0, hn = 0;
        int64_t qon = 0;
        if (iter + 1 < nit) {
            const int st = (iter + 1) & 1;
            qon = q_off(iter + 1, i0n, hn);
            load_tile<K_BM, HDP, K_NT>(Qs + st * K_BM * LD, q + qon, qs, T - i0n, hd, vec, tid, q);
            load_tile<K_BM, HDP, K_NT>(dOs + st * K_BM * LD, dout + qon, qs, T - i0n, hd, vec, tid, dout);
            cp_async_commit();
        }
        const int st = iter & 1;
        const bf16 *Qc = Qs + st * K_BM * LD, *dOc = dOs + st * K_BM * LD;
        const float *lc = lse2s + st * K_BM, *Dc = Ds + st * K_BM;

        if (i0 + K_BM - 1 >= j0 + wrow) { /* some query of the tile sees some key of this warp */
            float s[NTQ][4], dp[NTQ][4];
#pragma unroll
            for (int i = 0; i < NTQ; i++) {
                s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
                dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
            }
            /* S^T = K Q^T and dP^T = V dO^T (rows: this warp's 16 keys; cols: the tile's queries) */
#pragma unroll
            for (int kk = 0; kk < KT; kk++) {
                uint32_t a[4], a2[4];
                frag_a<LD>(a, Ks, wrow, kk * 16, gr, tq);
                frag_a<LD>(a2, Vs, wrow, kk * 16, gr, tq);
#pragma unroll
                for (int np = 0; np < NTQ / 2; np++) {
                    uint32_t b[4], b2[4];
                    frag_b2<LD>(b, Qc, np * 16, kk * 16, gr, tq);
                    frag_b2<LD>(b2, dOc, np * 16, kk * 16, gr, tq);
                    mma16816(s[2 * np], a, b[0], b[1]);
                    mma16816(s[2 * np + 1], a, b[2], b[3]);
                    mma16816(dp[2 * np], a2, b2[0], b2[1]);
                    mma16816(dp[2 * np + 1], a2, b2[2], b2[3]);
                }
            }
            const bool diag = i0 < j0 + wrow + 16;
#pragma unroll
            for (int nt = 0; nt < NTQ; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int ql = nt * 8 + tq * 2 + e, qi = i0 + ql;
                    const float L = lc[ql];
                    float p0 = exp2f(s[nt][e] * sl2 - L), p1 = exp2f(s[nt][2 + e] * sl2 - L);
                    if (diag) {
                        if (kr0 > qi) p0 = 0.0f;
                        if (kr1 > qi) p1 = 0.0f;
                    }
                    if (kvs && qi < T) { /* packed: keys before the query's document */
                        const int sq = kvs[(int64_t)b * T + qi];
                        if (kr0 < sq) p0 = 0.0f;
                        if (kr1 < sq) p1 = 0.0f;
                    }
                    s[nt][e] = p0;
                    s[nt][2 + e] = p1;
                }
            /* dV += P^T dO */
#pragma unroll
            for (int kc = 0; kc < K_BM / 16; kc++) {
                uint32_t a[4];
                a[0] = pack_bf16(s[2 * kc][0], s[2 * kc][1]);
                a[1] = pack_bf16(s[2 * kc][2], s[2 * kc][3]);
                a[2] = pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]);
                a[3] = pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
                for (int dd = 0; dd < HDP / 16; dd++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4_t(b0, b1, b2, b3, dOc + (kc * 16 + (lane & 15)) * LD + dd * 16 + (lane >> 4) * 8);
                    mma16816(dva[2 * dd], a, b0, b1);
                    mma16816(dva[2 * dd + 1], a, b2, b3);
                }
            }
            /* dS^T = P^T o (dP^T - D) */
#pragma unroll
            for (int nt = 0; nt < NTQ; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float D = Dc[nt * 8 + tq * 2 + e];
                    s[nt][e] *= dp[nt][e] - D;
                    s[nt][2 + e] *= dp[nt][2 + e] - D;
                }
            /* dK += dS^T Q */
#pragma unroll
            for (int kc = 0; kc < K_BM / 16; kc++) {
                uint32_t a[4];
                a[0] = pack_bf16(s[2 * kc][0], s[2 * kc][1]);
                a[1] = pack_bf16(s[2 * kc][2], s[2 * kc][3]);
                a[2] = pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]);
                a[3] = pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
                for (int dd = 0; dd < HDP / 16; dd++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4_t(b0, b1, b2, b3, Qc + (kc * 16 + (lane & 15)) * LD + dd * 16 + (lane >> 4) * 8);
                    mma16816(dka[2 * dd], a, b0, b1);
                    mma16816(dka[2 * dd + 1], a, b2, b3);
                }
            }
        }
        if (iter + 1 < nit) {
            const int sn = (iter + 1) & 1;
            tile_D_lse<K_BM, K_NT>(Ds + sn * K_BM, lse2s + sn * K_BM, dout + qon, out + qon, qs,
                                   lse + ((int64_t)b * nh + hn) * T + i0n, T - i0n, hd, tid);
        }
    }

    /* Stage this warp's 16 rows of dK in its own rows of Ks, dV in its own rows of Vs. */
    bf16 *dKs = Ks + wrow * LD, *dVs = Vs + wrow * LD;
    __syncwarp();
#pragma unroll
    for (int nd = 0; nd < NTD; nd++) {
        const int col = nd * 8 + tq * 2;
        st32(dKs + gr * LD + col, pack_bf16(dka[nd][0] * scale, dka[nd][1] * scale));
        st32(dKs + (gr + 8) * LD + col, pack_bf16(dka[nd][2] * scale, dka[nd][3] * scale));
        st32(dVs + gr * LD + col, pack_bf16(dva[nd][0], dva[nd][1]));
        st32(dVs + (gr + 8) * LD + col, pack_bf16(dva[nd][2], dva[nd][3]));
    }
    __syncwarp();
    const int64_t wo = koff + (int64_t)wrow * ks;
    store_rows16<HDP>(dk + wo, ks, dKs, T - (j0 + wrow), hd, vec, lane);
    store_rows16<HDP>(dv + wo, ks, dVs, T - (j0 + wrow), hd, vec, lane);
}

/* ---- the scalar backward (any hd) ------------------------------------------------------------- */

/* One block per (b, head, query t). Shared: qrow[hd], dorow[hd], acc[hd], p[S_NT], red. */
__global__ void __launch_bounds__(S_NT) simple_dq_kernel(bf16 *dq, const bf16 *dout, const bf16 *q, const bf16 *k,
                                                         const bf16 *v, const bf16 *out, const float *lse,
                                                         const int32_t *kvs, int T, int nh, int nkv, int hd,
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
    const float D = block_sum(dpart, red); /* also makes qrow, dorow visible */
    const float L = lse[(int64_t)bh * T + t];
    for (int c0 = kvs ? kvs[(int64_t)b * T + t] : 0; c0 <= t; c0 += S_NT) { /* keys of t's document */
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

/* One block per (b, kv head, key s), over the group's heads and queries t >= s.
 * Shared: krow[hd], vrow[hd], dka[hd], dva[hd], pp[S_NT], pd[S_NT]. */
__global__ void __launch_bounds__(S_NT) simple_dkdv_kernel(bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q,
                                                           const bf16 *k, const bf16 *v, const bf16 *out,
                                                           const float *lse, const int32_t *kvs, int T, int nh,
                                                           int nkv, int hd, float scale) {
    extern __shared__ float sm[];
    float *krow = sm, *vrow = krow + hd, *dka = vrow + hd, *dva = dka + hd, *pp = dva + hd, *pd = pp + S_NT;
    const int s = blockIdx.x, bg = blockIdx.y, b = bg / nkv, g = bg - b * nkv, grp = nh / nkv;
    const int64_t qs = (int64_t)nh * hd, ks = (int64_t)nkv * hd;
    const int64_t ko = ((int64_t)b * T + s) * ks + (int64_t)g * hd;
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
        for (int c0 = s; c0 < T; c0 += S_NT) {
            const int t = c0 + threadIdx.x;
            float p = 0.0f, ds = 0.0f;
            if (t < T && (!kvs || s >= kvs[(int64_t)b * T + t])) { /* packed: t's document holds s */
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
            const int n = min(S_NT, T - c0);
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

template <int HDP>
void launch_bwd(cudaStream_t st, bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q, const bf16 *k,
                const bf16 *v, const bf16 *out, const float *lse, const int32_t *kvs, int B, int T, int nh, int nkv,
                int hd, int vec) {
    const float scale = (float)(1.0 / sqrt((double)hd)), sl2 = scale * kLog2e;
    dim3 gk((T + K_BN - 1) / K_BN, B * nkv);
    dim3 gq((T + Q_BM - 1) / Q_BM, B * nh);
    bwd_dkdv_kernel<HDP><<<gk, K_NT, dkdv_smem<HDP>(), st>>>(dk, dv, dout, q, k, v, out, lse, kvs, T, nh, nkv, hd,
                                                              sl2, scale, vec);
    bwd_dq_kernel<HDP><<<gq, Q_NT, dq_smem<HDP>(), st>>>(dq, dout, q, k, v, out, lse, kvs, T, nh, nkv, hd, sl2,
                                                          scale, vec);
}

} // namespace

cudaError_t fm_att_flash_bwd_setup(void) {
    cudaError_t e;
#define FM_ATT_SMEM(kern, bytes)                                                                  \
    if ((e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(bytes))) != \
        cudaSuccess)                                                                              \
        return e;
    FM_ATT_SMEM(bwd_dq_kernel<64>, dq_smem<64>());
    FM_ATT_SMEM(bwd_dq_kernel<128>, dq_smem<128>());
    FM_ATT_SMEM(bwd_dkdv_kernel<64>, dkdv_smem<64>());
    FM_ATT_SMEM(bwd_dkdv_kernel<128>, dkdv_smem<128>());
#undef FM_ATT_SMEM
    return cudaSuccess;
}

void fm_att_flash_bwd(cudaStream_t s, bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q, const bf16 *k,
                      const bf16 *v, const bf16 *out, const float *lse, int64_t B, int64_t T, int64_t nh,
                      int64_t nkv, int64_t hd, const int32_t *kv_start) {
    const void *p[8] = {dq, dk, dv, dout, q, k, v, out};
    const int vec = vec_ok(hd, p, 8);
    if (hd <= 64)
        launch_bwd<64>(s, dq, dk, dv, dout, q, k, v, out, lse, kv_start, (int)B, (int)T, (int)nh, (int)nkv, (int)hd,
                       vec);
    else
        launch_bwd<128>(s, dq, dk, dv, dout, q, k, v, out, lse, kv_start, (int)B, (int)T, (int)nh, (int)nkv,
                        (int)hd, vec);
}

void fm_att_simple_bwd(cudaStream_t s, bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q, const bf16 *k,
                       const bf16 *v, const bf16 *out, const float *lse, int64_t B, int64_t T, int64_t nh,
                       int64_t nkv, int64_t hd, const int32_t *kv_start) {
    const float scale = (float)(1.0 / sqrt((double)hd));
    const size_t smq = ((size_t)3 * hd + S_NT + S_NT / 32) * sizeof(float);
    simple_dq_kernel<<<dim3((unsigned)T, (unsigned)(B * nh)), S_NT, smq, s>>>(dq, dout, q, k, v, out, lse, kv_start,
                                                                               (int)T, (int)nh, (int)nkv, (int)hd,
                                                                               scale);
    const size_t smk = ((size_t)4 * hd + 2 * S_NT) * sizeof(float);
    simple_dkdv_kernel<<<dim3((unsigned)T, (unsigned)(B * nkv)), S_NT, smk, s>>>(
        dk, dv, dout, q, k, v, out, lse, kv_start, (int)T, (int)nh, (int)nkv, (int)hd, scale);
}
