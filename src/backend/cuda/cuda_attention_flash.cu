/* Our own causal grouped-query flash attention for bf16 on sm_80+ tensor cores (mma.sync
 * m16n8k16, fp32 accumulation): FlashAttention-2 (Dao, arXiv 2307.08691), Algorithm 1 forward
 * and Algorithm 2 backward, with the backward split in two deterministic kernels.
 *
 * Forward (one block of 8 warps per (b, head, 128-query tile); each warp owns 16 query rows):
 *   for key tiles j (64 keys, double-buffered with cp.async) up to the diagonal:
 *     S = Q K_j^T (log2 domain: S * scale * log2 e), causal mask on diagonal tiles;
 *     m' = max(m, rowmax S); P = 2^(S - m'); l = l 2^(m - m') + rowsum P;
 *     O = O 2^(m - m') + P V_j  (P rounded to bf16 for the tensor cores)
 *   out = O / l, lse = (m + log2 l) ln 2.
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
 *
 * Head dims: the tiles are padded with zeros to HDP = 64 (hd <= 64) or 128 (hd <= 128); hd must
 * be even (4-byte rows); 16-byte cp.async loads when hd % 8 == 0 and the pointers are 16-byte
 * aligned, 4-byte loads otherwise. Anything else goes to the scalar kernels at the end of this
 * file (any hd; slow but exact in fp32).
 *
 * mma.sync fragment layouts (PTX ISA, m16n8k16 with .bf16): lane = 4*g + t;
 *   A (16x16, row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
 *   B (16x8, col):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
 *   C (16x8 f32):   c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
 * so two C tiles side by side are the A fragment of the next product (P V, dS K, ...). */
#include "cuda_attention_impl.h"

#include <math.h>

typedef __nv_bfloat16 bf16;

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

/* ---- small device helpers ------------------------------------------------------------------ */

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x (low half) = lo */
    return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ uint32_t ld32(const bf16 *p) { return *reinterpret_cast<const uint32_t *>(p); }
__device__ __forceinline__ void st32(bf16 *p, uint32_t v) { *reinterpret_cast<uint32_t *>(p) = v; }

__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Four 8x8 b16 matrices, transposed: lanes 8i..8i+7 give the row addresses of matrix i; lane L
 * receives element (row 2(L%4)+{0,1}, col L/4) of each. */
__device__ __forceinline__ void ldsm_x4_t(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                          const bf16 *p) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

__device__ __forceinline__ void cp_async16(bf16 *smem, const bf16 *gmem, bool valid) {
    uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    int n = valid ? 16 : 0; /* 0: zero-fill, nothing read */
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

/* Loads rows [0, ROWS) x cols [0, HDP) of a strided bf16 matrix g (row stride gs elements) into
 * shared memory (row stride HDP+8), zero-filling rows >= nvalid and columns >= hd. vec: 16-byte
 * cp.async (hd % 8 == 0, 16-byte aligned); else 4-byte loads (hd even). `safe` is a valid
 * address that zero-filled cp.async slots name instead of one past the tensor. */
template <int ROWS, int HDP, int NT>
__device__ __forceinline__ void load_tile(bf16 *sm, const bf16 *g, int64_t gs, int nvalid, int hd,
                                          int vec, int tid, const bf16 *safe) {
    constexpr int LD = HDP + 8;
    if (vec) {
        constexpr int CPR = HDP / 8;
#pragma unroll 4
        for (int c = tid; c < ROWS * CPR; c += NT) {
            const int r = c / CPR, cc = (c % CPR) * 8;
            const bool ok = r < nvalid && cc < hd;
            cp_async16(sm + r * LD + cc, ok ? g + (int64_t)r * gs + cc : safe, ok);
        }
    } else {
        constexpr int CPR = HDP / 2;
#pragma unroll 4
        for (int c = tid; c < ROWS * CPR; c += NT) {
            const int r = c / CPR, cc = (c % CPR) * 2;
            uint32_t val = 0;
            if (r < nvalid && cc < hd) val = ld32(g + (int64_t)r * gs + cc);
            st32(sm + r * LD + cc, val);
        }
    }
}

/* Writes 16 rows (row stride LD in shared memory) to global rows r0.. (stride gs), rows < nvalid,
 * columns < hd, by one warp. */
template <int HDP>
__device__ __forceinline__ void store_rows16(bf16 *g, int64_t gs, const bf16 *sm, int nvalid, int hd,
                                             int vec, int lane) {
    constexpr int LD = HDP + 8;
    if (vec) {
        constexpr int CPR = HDP / 8;
        for (int c = lane; c < 16 * CPR; c += 32) {
            const int r = c / CPR, cc = (c % CPR) * 8;
            if (r < nvalid && cc < hd)
                *reinterpret_cast<uint4 *>(g + (int64_t)r * gs + cc) =
                    *reinterpret_cast<const uint4 *>(sm + r * LD + cc);
        }
    } else {
        constexpr int CPR = HDP / 2;
        for (int c = lane; c < 16 * CPR; c += 32) {
            const int r = c / CPR, cc = (c % CPR) * 2;
            if (r < nvalid && cc < hd) st32(g + (int64_t)r * gs + cc, ld32(sm + r * LD + cc));
        }
    }
}

/* The A fragment (16x16 at rows row.., cols col..) of a row-major shared tile. */
template <int LD>
__device__ __forceinline__ void frag_a(uint32_t a[4], const bf16 *base, int row, int col, int gr, int tq) {
    const bf16 *p = base + (row + gr) * LD + col + tq * 2;
    a[0] = ld32(p);
    a[1] = ld32(p + 8 * LD);
    a[2] = ld32(p + 8);
    a[3] = ld32(p + 8 * LD + 8);
}

/* The B fragments of two adjacent n-tiles (n = rows nrow..nrow+15, k = cols kcol..kcol+15) of a
 * row-major [n][k] shared tile: b[0], b[1] for rows nrow.., b[2], b[3] for rows nrow+8... (An
 * ldmatrix.x4 variant of these loads measured no faster on an H200.) */
template <int LD>
__device__ __forceinline__ void frag_b2(uint32_t b[4], const bf16 *base, int nrow, int kcol, int gr, int tq) {
    const bf16 *p = base + (nrow + gr) * LD + kcol + tq * 2;
    b[0] = ld32(p);
    b[1] = ld32(p + 8);
    b[2] = ld32(p + 8 * LD);
    b[3] = ld32(p + 8 * LD + 8);
}

/* D[r] = sum_d dO[r][d] * O[r][d] and lse2[r] = lse[r] * log2 e for the ROWS query rows of a
 * tile (rows >= nvalid: D = 0, lse2 = +inf so that P = 0 there). NT/ROWS threads per row, on
 * consecutive lanes. */
template <int ROWS, int NT>
__device__ __forceinline__ void tile_D_lse(float *Ds, float *lse2s, const bf16 *dO, const bf16 *O,
                                           int64_t gs, const float *lse, int nvalid, int hd, int tid) {
    constexpr int TPR = NT / ROWS;
    static_assert(TPR >= 1 && TPR <= 32 && (TPR & (TPR - 1)) == 0, "threads per row");
    const int r = tid / TPR, part = tid % TPR;
    float acc = 0.0f;
    if (r < nvalid) {
        const bf16 *a = dO + (int64_t)r * gs, *b = O + (int64_t)r * gs;
        for (int d = part * 2; d < hd; d += 2 * TPR) {
            const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(a + d));
            const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(b + d));
            acc = fmaf(x.x, y.x, acc);
            acc = fmaf(x.y, y.y, acc);
        }
    }
#pragma unroll
    for (int o = 1; o < TPR; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (part == 0) {
        Ds[r] = acc;
        lse2s[r] = r < nvalid ? lse[r] * kLog2e : INFINITY;
    }
}

/* ---- forward -------------------------------------------------------------------------------- */

constexpr int F_BM = 128, F_BN = 64, F_NT = 256;

template <int HDP>
constexpr size_t fwd_smem() { return (size_t)(F_BM + 4 * F_BN) * (HDP + 8) * sizeof(bf16); }

template <int HDP>
__global__ void __launch_bounds__(F_NT) fwd_kernel(bf16 *__restrict__ out, float *__restrict__ lse,
                                                   const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                                                   const bf16 *__restrict__ v, int T, int nh, int nkv,
                                                   int hd, float sl2, int vec) {
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

    load_tile<F_BM, HDP, F_NT>(Qs, Qg, qs, T - i0, hd, vec, tid, q);
    load_tile<F_BN, HDP, F_NT>(Ks, Kg, ks, T, hd, vec, tid, k);
    load_tile<F_BN, HDP, F_NT>(Vs, Vg, ks, T, hd, vec, tid, v);
    cp_async_commit();

    float o[NTD][4];
#pragma unroll
    for (int i = 0; i < NTD; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const int wrow = warp * 16;
    const int r0 = i0 + wrow + gr, r1 = r0 + 8;

    for (int j = 0; j < nj; j++) {
        cp_async_wait_all();
        __syncthreads();
        if (j + 1 < nj) {
            const int st = (j + 1) & 1, jn = (j + 1) * F_BN;
            load_tile<F_BN, HDP, F_NT>(Ks + st * F_BN * LD, Kg + (int64_t)jn * ks, ks, T - jn, hd, vec, tid, k);
            load_tile<F_BN, HDP, F_NT>(Vs + st * F_BN * LD, Vg + (int64_t)jn * ks, ks, T - jn, hd, vec, tid, v);
            cp_async_commit();
        }
        const int j0 = j * F_BN;
        if (j0 > i0 + wrow + 15) continue; /* every key of the tile is after every row of this warp */
        const bf16 *Kc = Ks + (j & 1) * F_BN * LD, *Vc = Vs + (j & 1) * F_BN * LD;

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
                s[nt][e] = x0;
                s[nt][2 + e] = x1;
                mx0 = fmaxf(mx0, x0);
                mx1 = fmaxf(mx1, x1);
            }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        /* mx is finite: key 0 is visible to every row on the first tile, and m stays finite. */
        const float c0 = exp2f(m0 - mx0), c1 = exp2f(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NTN; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                s[nt][e] = exp2f(s[nt][e] - m0);
                s[nt][2 + e] = exp2f(s[nt][2 + e] - m1);
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
                                                      const float *__restrict__ lse, int T, int nh, int nkv,
                                                      int hd, float sl2, float scale, int vec) {
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

    load_tile<Q_BM, HDP, Q_NT>(Qs, q + qoff, qs, T - i0, hd, vec, tid, q);
    load_tile<Q_BM, HDP, Q_NT>(dOs, dout + qoff, qs, T - i0, hd, vec, tid, dout);
    load_tile<Q_BN, HDP, Q_NT>(Ks, Kg, ks, T, hd, vec, tid, k);
    load_tile<Q_BN, HDP, Q_NT>(Vs, Vg, ks, T, hd, vec, tid, v);
    cp_async_commit();
    tile_D_lse<Q_BM, Q_NT>(Ds, lse2s, dout + qoff, out + qoff, qs, lse + (int64_t)bh * T + i0, T - i0, hd, tid);

    float acc[NTD][4];
#pragma unroll
    for (int i = 0; i < NTD; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    const int wrow = warp * 16;
    const int r0 = i0 + wrow + gr, r1 = r0 + 8;
    float L0 = 0.0f, L1 = 0.0f, D0 = 0.0f, D1 = 0.0f;

    for (int j = 0; j < nj; j++) {
        cp_async_wait_all();
        __syncthreads();
        if (j == 0) {
            L0 = lse2s[wrow + gr];
            L1 = lse2s[wrow + gr + 8];
            D0 = Ds[wrow + gr];
            D1 = Ds[wrow + gr + 8];
        }
        if (j + 1 < nj) {
            const int st = (j + 1) & 1, jn = (j + 1) * Q_BN;
            load_tile<Q_BN, HDP, Q_NT>(Ks + st * Q_BN * LD, Kg + (int64_t)jn * ks, ks, T - jn, hd, vec, tid, k);
            load_tile<Q_BN, HDP, Q_NT>(Vs + st * Q_BN * LD, Vg + (int64_t)jn * ks, ks, T - jn, hd, vec, tid, v);
            cp_async_commit();
        }
        const int j0 = j * Q_BN;
        if (j0 > i0 + wrow + 15) continue;
        const bf16 *Kc = Ks + (j & 1) * Q_BN * LD, *Vc = Vs + (j & 1) * Q_BN * LD;

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
                                                        int T, int nh, int nkv, int hd, float sl2, float scale,
                                                        int vec) {
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

/* ---- the scalar kernels (any hd) -------------------------------------------------------------- */

constexpr int S_NT = 128;

/* Sum (or max) over the block's S_NT threads, in a fixed order; every thread gets the result. */
__device__ __forceinline__ float block_sum(float x, float *red) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    const int w = threadIdx.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[w] = x;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < S_NT / 32; i++) s += red[i];
    return s;
}
__device__ __forceinline__ float block_max(float x, float *red) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    const int w = threadIdx.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[w] = x;
    __syncthreads();
    float s = -INFINITY;
    for (int i = 0; i < S_NT / 32; i++) s = fmaxf(s, red[i]);
    return s;
}
__device__ __forceinline__ float dot_sf(const float *a, const bf16 *b, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc = fmaf(a[i], __bfloat162float(b[i]), acc);
    return acc;
}

/* One block per (b, head, query t). Shared: qrow[hd], o[hd], p[S_NT], red[S_NT/32]. */
__global__ void __launch_bounds__(S_NT) simple_fwd_kernel(bf16 *out, float *lse, const bf16 *q, const bf16 *k,
                                                          const bf16 *v, int T, int nh, int nkv, int hd,
                                                          float scale) {
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
    for (int c0 = 0; c0 <= t; c0 += S_NT) {
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

/* One block per (b, head, query t). Shared: qrow[hd], dorow[hd], acc[hd], p[S_NT], red. */
__global__ void __launch_bounds__(S_NT) simple_dq_kernel(bf16 *dq, const bf16 *dout, const bf16 *q, const bf16 *k,
                                                         const bf16 *v, const bf16 *out, const float *lse, int T,
                                                         int nh, int nkv, int hd, float scale) {
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
    for (int c0 = 0; c0 <= t; c0 += S_NT) {
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
                                                           const float *lse, int T, int nh, int nkv, int hd,
                                                           float scale) {
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
            if (t < T) {
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

bool aligned(const void *p, uintptr_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

template <int HDP>
void launch_fwd(cudaStream_t st, bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, int B, int T,
                int nh, int nkv, int hd, int vec) {
    const float sl2 = (float)(1.0 / sqrt((double)hd)) * kLog2e;
    dim3 grid((T + F_BM - 1) / F_BM, B * nh);
    fwd_kernel<HDP><<<grid, F_NT, fwd_smem<HDP>(), st>>>(out, lse, q, k, v, T, nh, nkv, hd, sl2, vec);
}

template <int HDP>
void launch_bwd(cudaStream_t st, bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q, const bf16 *k,
                const bf16 *v, const bf16 *out, const float *lse, int B, int T, int nh, int nkv, int hd, int vec) {
    const float scale = (float)(1.0 / sqrt((double)hd)), sl2 = scale * kLog2e;
    dim3 gk((T + K_BN - 1) / K_BN, B * nkv);
    dim3 gq((T + Q_BM - 1) / Q_BM, B * nh);
    bwd_dkdv_kernel<HDP><<<gk, K_NT, dkdv_smem<HDP>(), st>>>(dk, dv, dout, q, k, v, out, lse, T, nh, nkv, hd, sl2,
                                                              scale, vec);
    bwd_dq_kernel<HDP><<<gq, Q_NT, dq_smem<HDP>(), st>>>(dq, dout, q, k, v, out, lse, T, nh, nkv, hd, sl2, scale,
                                                          vec);
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
    FM_ATT_SMEM(bwd_dq_kernel<64>, dq_smem<64>());
    FM_ATT_SMEM(bwd_dq_kernel<128>, dq_smem<128>());
    FM_ATT_SMEM(bwd_dkdv_kernel<64>, dkdv_smem<64>());
    FM_ATT_SMEM(bwd_dkdv_kernel<128>, dkdv_smem<128>());
#undef FM_ATT_SMEM
    return cudaSuccess;
}

int fm_att_flash_ok(int64_t hd, const void *const *ptrs, int nptrs) {
    if (hd < 2 || hd > 128 || (hd & 1)) return 0;
    for (int i = 0; i < nptrs; i++)
        if (!aligned(ptrs[i], 4)) return 0;
    return 1;
}

static int vec_ok(int64_t hd, const void *const *ptrs, int nptrs) {
    if (hd % 8) return 0;
    for (int i = 0; i < nptrs; i++)
        if (!aligned(ptrs[i], 16)) return 0;
    return 1;
}

void fm_att_flash_fwd(cudaStream_t s, bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, int64_t B,
                      int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
    const void *p[4] = {out, q, k, v};
    const int vec = vec_ok(hd, p, 4);
    if (hd <= 64) launch_fwd<64>(s, out, lse, q, k, v, (int)B, (int)T, (int)nh, (int)nkv, (int)hd, vec);
    else launch_fwd<128>(s, out, lse, q, k, v, (int)B, (int)T, (int)nh, (int)nkv, (int)hd, vec);
}

void fm_att_flash_bwd(cudaStream_t s, bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q, const bf16 *k,
                      const bf16 *v, const bf16 *out, const float *lse, int64_t B, int64_t T, int64_t nh,
                      int64_t nkv, int64_t hd) {
    const void *p[8] = {dq, dk, dv, dout, q, k, v, out};
    const int vec = vec_ok(hd, p, 8);
    if (hd <= 64)
        launch_bwd<64>(s, dq, dk, dv, dout, q, k, v, out, lse, (int)B, (int)T, (int)nh, (int)nkv, (int)hd, vec);
    else
        launch_bwd<128>(s, dq, dk, dv, dout, q, k, v, out, lse, (int)B, (int)T, (int)nh, (int)nkv, (int)hd, vec);
}

void fm_att_simple_fwd(cudaStream_t s, bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, int64_t B,
                       int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
    const float scale = (float)(1.0 / sqrt((double)hd));
    const size_t sm = ((size_t)2 * hd + S_NT + S_NT / 32) * sizeof(float);
    simple_fwd_kernel<<<dim3((unsigned)T, (unsigned)(B * nh)), S_NT, sm, s>>>(out, lse, q, k, v, (int)T, (int)nh,
                                                                               (int)nkv, (int)hd, scale);
}

void fm_att_simple_bwd(cudaStream_t s, bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q, const bf16 *k,
                       const bf16 *v, const bf16 *out, const float *lse, int64_t B, int64_t T, int64_t nh,
                       int64_t nkv, int64_t hd) {
    const float scale = (float)(1.0 / sqrt((double)hd));
    const size_t smq = ((size_t)3 * hd + S_NT + S_NT / 32) * sizeof(float);
    simple_dq_kernel<<<dim3((unsigned)T, (unsigned)(B * nh)), S_NT, smq, s>>>(dq, dout, q, k, v, out, lse, (int)T,
                                                                               (int)nh, (int)nkv, (int)hd, scale);
    const size_t smk = ((size_t)4 * hd + 2 * S_NT) * sizeof(float);
    simple_dkdv_kernel<<<dim3((unsigned)T, (unsigned)(B * nkv)), S_NT, smk, s>>>(
        dk, dv, dout, q, k, v, out, lse, (int)T, (int)nh, (int)nkv, (int)hd, scale);
}
