/* v3: the FP8 option of the grouped expert GEMMs (gg_common.cuh's three kinds): E4M3 operands with
 * DeepSeek-V3's block scales (arXiv 2412.19437 section 3.3: 1 x 128 tiles of activations, 128 x
 * 128 blocks of weights) as powers of two, the engine's recipe (src/backend/fm_fp8.h: scale
 * 2^ceil(log2(amax / 448)), 1 for a zero block), fp32 accumulation with the scales applied when
 * each 128-deep k-block's partial sum is promoted into fp32 registers, bf16 out (one rounding, beta
 * as in gg_common.cuh). The quantization kernels are here too (bf16 -> e4m3 + fp32 scales; fp8_ref.h
 * is their host twin, states the arithmetic and holds the shared helpers, fm_fp8.h's included).
 *
 * sm_90's fp8 wgmma reads both operands K-major only (no transpose for 8-bit types), so every
 * product gets operands whose reduction dimension is contiguous:
 *   kind 0 fwd  y_e = x_e W_e^T:  A = xq  [rcap, in] e4m3, scales sx  [in/128][rpad] (1 x 128 along in)
 *                                 B = Wq  [E*out, in],     scales sW  [E][out/128][in/128]
 *   kind 1 dx   dx_e = dy_e W_e:  A = dyq [rcap, out],     scales sdy [out/128][rpad]
 *                                 B = WqT [E*in, out] (W_e^T: the same 128 x 128 blocks and codes,
 *                                     transposed by quant_weight), scales sW read transposed
 *   kind 2 dW   dW_e = dy_e^T x_e: A = dyT [out, kcap],    scales sdyT [kcap/128][out]
 *                                 B = xT  [in, kcap],      scales sxT  [kcap/128][in]
 * dW's operands are the token-major transposes of dy and x, quantized 128 x 1 (128 tokens of one
 * channel: the 1 x 128 tiles run along the token dimension, which is dW's reduction), and each
 * group's tokens start at a multiple of 128 (group e at token block pblk[e] = sum_{e'<e}
 * ceil(m_e'/128), the tail of its last block zero): every 128-token k-block lies in one group and
 * has one scale per channel, so no k-block mixes two experts and the kernel needs no tail masking.
 * kcap (a multiple of 128) bounds the padded tokens: round_up(rcap, 128) + 128 E suffices. Row scales
 * are stored scale-major ([K/128][rpad], rpad = rcap rounded up to 4) so that one TMA box brings a
 * tile's 128 row scales; every offset is read from offs in device memory (no host sync).
 *
 * GEMM kernel: as v2 (3 warpgroups, one producer thread issuing TMA into a 6-stage ring of full/
 * empty mbarriers, two consumer warpgroups of 64 rows each, persistent over gg_common.cuh's tile
 * list with 128 x 128 tiles), but BK = 128 (one 128-byte swizzled row of fp8 per tile row), and per
 * k-block: 4 wgmma.m64n128k32.e4m3 into a fresh fp32 accumulator (the first with scale-d 0), wait,
 * then fin += sa[row] * sb * acc (sb: one weight scale per tile and k-block for kinds 0/1; per
 * column, from shared memory, for kind 2), as DeepGEMM's sm90 fp8 kernel promotes. Technique
 * learned from DeepGEMM (deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh); the code is our own.
 * Requires in, out multiples of 128, E <= GG_MAX_E, rcap, kcap, E*in, E*out below 2^31 (TMA int32
 * coordinates); else GG_NOT_SERVED.
 *
 * TMA rule this kernel must keep (and broke in its first version, 7ba8ac5): the global address a
 * cp.async.bulk.tensor box starts at, base + c0 * element size along the innermost dimension, must
 * be a multiple of 16 bytes; a box that starts elsewhere raises cudaErrorIllegalInstruction (not a
 * misaligned-address error) and kills the context. The A/B boxes start at k-block offsets (multiples
 * of 128 B) and kind 2's scale boxes at tile offsets (multiples of 512 B), but the row-scale box of
 * kinds 0/1 started at the tile's first row r0 + m0: any group starting at a row not a multiple of 4
 * (fp32) broke the rule (small-full's third group starts at row 1). So that box now starts at
 * (r0 + m0) rounded down to a multiple of 4 and is SA_BOX = 132 scales long; the consumers read
 * their rows at lead = r0 % 4 past its start (boxes_of below; the lab checks every box of every
 * case, tile and k-block on the host: fp8_tma_selftest in fp8_lab.cuh).
 *
 * GG_V3_DEBUG=1 (make grouped_gemm_v3dbg): no setmaxnreg (so printf is safe in every warp), every
 * TMA box's alignment, the warp's convergence before the wgmmas and the launch shape checked on the
 * device, mbarrier waits bounded (about 20 s); a failed check prints "v3 debug: kernel<K> block b
 * thread t: <stage> ..." and traps (cudaErrorLaunchFailure, "unspecified launch failure", so a
 * trap is told apart from an illegal instruction).
 */
#pragma once
#include "fp8_ref.h"
#include "v2_wgmma.cuh"
#include <cuda_fp8.h>

struct gg_fp8_problem {
    int kind;             /* 0 fwd, 1 dx, 2 dW */
    const uint8_t *A, *B; /* e4m3 codes, layouts above */
    const float *sA, *sB; /* kind 0: sx, sW; 1: sdy, sW; 2: sdyT, sxT */
    bf16 *C;              /* as gg_problem */
    const int64_t *offs;  /* device int64 [E+1] */
    int E;
    int64_t in, out, rcap, kcap;
    float beta;
};
__host__ __device__ inline int64_t gg_fp8_rpad(int64_t rcap) { return (rcap + 3) / 4 * 4; }
inline int64_t gg_fp8_kcap(int64_t rcap, int E) { return (rcap + 127) / 128 * 128 + 128 * (int64_t)E; }

namespace v3 {

constexpr int BM = 128, BN = 128, BK = 128, THREADS = 384, STAGES = 6;
constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SC_BYTES = (BM + BN) * 4;                         /* per stage: A scales, B scales (kind 2) */
constexpr int SMEM = STAGES * (STAGE_BYTES + SC_BYTES) + 1024; /* + room to align to 1024 */
/* kinds 0/1: the row-scale box, from the tile's first row rounded down to a multiple of 4 (16 B) */
constexpr int SA_BOX = BM + 4;
static_assert(SA_BOX * 4 <= SC_BYTES && SA_BOX * 4 % 16 == 0 && SA_BOX <= 256, "row-scale box");
constexpr int REG_PRODUCER = 40, REG_CONSUMER = 232; /* setmaxnreg counts: need 168 a thread at launch */

/* The TMA boxes of k-block kb of tile t, as the producer issues them: [0] A, [1] B, [2] A's scales,
 * [3] B's scales (kind 2 only; n = 3 or 4). c0 is the innermost coordinate (elements of box_elem(i)
 * bytes), c1 the outer one. brow: W_e's first row in Wq / WqT (kinds 0/1); pb: the group's first
 * token block (kind 2). lead: where the tile's first row scale lies in box [2] (0 for kind 2). */
struct stage_boxes {
    int n, lead;
    int c0[4], c1[4];
};
__host__ __device__ inline int box_elem(int i) { return i < 2 ? 1 : 4; } /* bytes an element of box i */
__host__ __device__ inline int box_inner(int kind, int i) { return i < 2 ? BK : kind == 2 ? BM : SA_BOX; }
__host__ __device__ inline int box_outer(int kind, int i) { return i < 2 ? BM : 1; }
__host__ __device__ inline int stage_tx_bytes(int kind) { return STAGE_BYTES + (kind == 2 ? 2 * BM * 4 : SA_BOX * 4); }
template <int KIND> __host__ __device__ inline stage_boxes boxes_of(const gg_tile &t, int kb, int brow, int pb) {
    stage_boxes b;
    const int m0 = t.mt * BM, n0 = t.nt * BN, r0 = (int)t.r0;
    if (KIND != 2) {
        b.n = 3, b.lead = r0 & 3;
        b.c0[0] = kb * BK, b.c1[0] = r0 + m0;
        b.c0[1] = kb * BK, b.c1[1] = brow + n0;
        b.c0[2] = r0 + m0 - b.lead, b.c1[2] = kb; /* a 16-byte aligned start (the rule above) */
        b.c0[3] = b.c1[3] = 0;
    } else {
        const int kt = (pb + kb) * BK;
        b.n = 4, b.lead = 0;
        b.c0[0] = kt, b.c1[0] = m0;
        b.c0[1] = kt, b.c1[1] = n0;
        b.c0[2] = m0, b.c1[2] = pb + kb;
        b.c0[3] = n0, b.c1[3] = pb + kb;
    }
    return b;
}

#ifndef GG_V3_DEBUG
#define GG_V3_DEBUG 0
#endif
#if GG_V3_DEBUG
#define V3_CHECK(cond, ...)                                                                                \
    do {                                                                                                  \
        if (!(cond)) {                                                                                    \
            printf("v3 debug: kernel<%d> block %d thread %d: ", KIND, (int)blockIdx.x, (int)threadIdx.x); \
            printf(__VA_ARGS__);                                                                          \
            printf("\n");                                                                                 \
            __trap();                                                                                     \
        }                                                                                                 \
    } while (0)
#else
#define V3_CHECK(cond, ...) \
    do {                    \
    } while (0)
#endif

/* v2::mbar_wait; in debug builds bounded (4e10 clock64 ticks, about 20 s) and named (what, it) */
template <int KIND> __device__ inline void mbar_wait_dbg(uint64_t *b, uint32_t parity, const char *what, uint32_t it) {
#if GG_V3_DEBUG
    const long long t0 = clock64();
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(gg_smem_u32(b)), "r"(parity) : "memory");
        V3_CHECK(done || clock64() - t0 < 40000000000ll, "%s: phase %u never completed (k-block count %u)", what, parity, it);
    } while (!done);
#else
    (void)what, (void)it;
    v2::mbar_wait(b, parity);
#endif
}

/* token-block prefix of the dW layout: pblk[e] = sum_{e' < e} ceil(m_e' / 128) */
struct sched {
    gg_sched s;
    int pblk[GG_MAX_E + 1];
};
__device__ inline void pblk_build(int *pblk, const int64_t *offs, int E) {
    int acc = 0;
    pblk[0] = 0;
    for (int e = 0; e < E; e++) pblk[e + 1] = acc += (int)((offs[e + 1] - offs[e] + 127) / 128);
}

template <int KIND>
__global__ void __launch_bounds__(THREADS, 1)
kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
       const __grid_constant__ CUtensorMap tmSA, const __grid_constant__ CUtensorMap tmSB, gg_fp8_problem p) {
    extern __shared__ uint8_t smem_raw[];
    __shared__ sched sc;
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
    const uint32_t smem = (gg_smem_u32(smem_raw) + 1023u) & ~1023u;
    const float *sscale = reinterpret_cast<const float *>(smem_raw + (smem - gg_smem_u32(smem_raw)) + STAGES * STAGE_BYTES);
    const uint32_t sscale_u32 = smem + STAGES * STAGE_BYTES;
#if GG_V3_DEBUG
    {
        uint32_t dyn;
        asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
        V3_CHECK(blockDim.x == THREADS && blockDim.y == 1 && dyn >= (uint32_t)SMEM, "launch: %d threads (want %d), %u B dynamic smem (want %d)",
                 (int)blockDim.x, THREADS, dyn, SMEM);
    }
#endif

    gg_problem gp; /* the tile list's view of the problem */
    gp.kind = KIND, gp.E = p.E, gp.in = p.in, gp.out = p.out, gp.beta = p.beta, gp.offs = p.offs, gp.C = p.C;
    gp.A = gp.B = nullptr, gp.rcap = p.rcap;
    gg_sched_build(sc.s, gp, BM, BN);
    if (threadIdx.x == 0) {
        if (KIND == 2) pblk_build(sc.pblk, sc.s.offs, p.E);
        for (int s = 0; s < STAGES; s++) v2::mbar_init(&full[s], 1), v2::mbar_init(&empty[s], 8);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int total = sc.s.tile[p.E], wg = threadIdx.x / 128;

    if (wg == 2) { /* producer */
#if !GG_V3_DEBUG
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REG_PRODUCER));
#endif
        if (threadIdx.x != 256) return;
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmA)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmB)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmSA)) : "memory");
        if (KIND == 2) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmSB)) : "memory");
        const CUtensorMap *maps[4] = {&tmA, &tmB, &tmSA, &tmSB};
        uint32_t it = 0;
        for (int ti = blockIdx.x; ti < total; ti += gridDim.x) {
            const gg_tile t = gg_tile_of(sc.s, gp, ti, BN);
            const int nk = KIND == 2 ? (int)((t.me + BK - 1) / BK) : (int)((KIND == 0 ? p.in : p.out) / BK);
            const int brow = KIND == 2 ? 0 : (int)(t.e * (KIND == 0 ? p.out : p.in)); /* W_e's first row in Wq / WqT */
            const int pb = KIND == 2 ? sc.pblk[t.e] : 0;
            for (int kb = 0; kb < nk; kb++, it++) {
                const int s = it % STAGES;
                mbar_wait_dbg<KIND>(&empty[s], ((it / STAGES) & 1) ^ 1, "producer: empty wait", it);
                const uint32_t sa = smem + s * STAGE_BYTES, ssa = sscale_u32 + s * SC_BYTES;
                const uint32_t dst[4] = {sa, sa + A_BYTES, ssa, ssa + BM * 4};
                const stage_boxes b = boxes_of<KIND>(t, kb, brow, pb);
                v2::mbar_expect_tx(&full[s], stage_tx_bytes(KIND));
#pragma unroll
                for (int i = 0; i < (KIND == 2 ? 4 : 3); i++) {
                    V3_CHECK(b.c0[i] >= 0 && b.c1[i] >= 0 && (int64_t)b.c0[i] * box_elem(i) % 16 == 0 && dst[i] % (i < 2 ? 1024 : 128) == 0,
                             "producer: TMA box %d of tile %d k-block %d starts at (%d, %d), smem 0x%x: inner offset not 16-byte "
                             "aligned or smem misaligned", i, ti, kb, b.c0[i], b.c1[i], dst[i]);
                    v2::tma_2d(dst[i], maps[i], &full[s], b.c0[i], b.c1[i]);
                }
            }
        }
        return;
    }

    /* consumers: warpgroup wg owns rows wg*64 .. wg*64+63 of the tile */
#if !GG_V3_DEBUG
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REG_CONSUMER));
#endif
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
    const int rl = wg * 64 + warp * 16 + (lane >> 2); /* this thread's first row in the tile (and rl + 8) */
    const int64_t kb_in = p.in / 128, kb_out = p.out / 128;
    uint32_t it = 0;
    for (int ti = blockIdx.x; ti < total; ti += gridDim.x) {
        const gg_tile t = gg_tile_of(sc.s, gp, ti, BN);
        const int nk = KIND == 2 ? (int)((t.me + BK - 1) / BK) : (int)((KIND == 0 ? p.in : p.out) / BK);
        const int lead = KIND == 2 ? 0 : (int)(t.r0 & 3); /* boxes_of: the row-scale box starts lead rows early */
        /* the weight scales of this tile (kinds 0/1): kind 0 block (n-block nt, k-block kb) of
         * W_e, kind 1 block (kb, nt): W_e^T's blocks are W_e's, transposed */
        const float *wsc = KIND == 0 ? p.sB + ((int64_t)t.e * kb_out + t.nt) * kb_in
                                     : p.sB + (int64_t)t.e * kb_out * kb_in + t.nt;
        const int64_t wstep = KIND == 0 ? 1 : kb_in;
        float acc[64], fin[64];
#pragma unroll
        for (int i = 0; i < 64; i++) fin[i] = 0.0f, acc[i] = 0.0f; /* acc: overwritten by each block's first wgmma */
        for (int kb = 0; kb < nk; kb++, it++) {
            const int s = it % STAGES;
            const float sbw = KIND != 2 ? __ldg(wsc + kb * wstep) : 0.0f;
            mbar_wait_dbg<KIND>(&full[s], (it / STAGES) & 1, "consumer: full wait", it);
            const uint32_t sa = smem + s * STAGE_BYTES, sb = sa + A_BYTES;
            const float *ss = sscale + s * (SC_BYTES / 4);
            const float sa0 = ss[lead + rl], sa1 = ss[lead + rl + 8];
            float sbc[32]; /* kind 2: the B scales of this thread's 32 columns */
            if (KIND == 2) {
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    const float2 v = *reinterpret_cast<const float2 *>(ss + BM + j * 8 + (lane & 3) * 2);
                    sbc[2 * j] = v.x, sbc[2 * j + 1] = v.y;
                }
            }
            V3_CHECK(__activemask() == 0xffffffffu, "consumer: warp not converged before the wgmmas (mask 0x%x, tile %d k-block %d)",
                     __activemask(), ti, kb);
            v2::acc_fence(acc);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < BK / 32; kk++) {
                /* K-major, 128-byte swizzle: a tile row is 128 fp8 (128 B), 8-row atoms 1024 B apart
                 * (SBO), LBO unused; the k32 step is +32 B inside the swizzled row, as v2's k16 */
                const uint64_t da = v2::sdesc(sa + wg * (64 * 128) + kk * 32, 0, 1024);
                const uint64_t db = v2::sdesc(sb + kk * 32, 0, 1024);
                wgmma_fp8_m64n128(acc, da, db, kk > 0);
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            v2::acc_fence(acc);
            if (lane == 0) v2::mbar_arrive(&empty[s]); /* operands and scales of stage s all read */
            /* promotion: d[4j + {0,1}] = (rl, 8j + 2(lane%4) + {0,1}), d[4j + {2,3}] = row rl + 8 */
            if (KIND != 2) {
                const float s0 = sa0 * sbw, s1 = sa1 * sbw;
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    fin[4 * j] += s0 * acc[4 * j], fin[4 * j + 1] += s0 * acc[4 * j + 1];
                    fin[4 * j + 2] += s1 * acc[4 * j + 2], fin[4 * j + 3] += s1 * acc[4 * j + 3];
                }
            } else {
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    fin[4 * j] += sa0 * sbc[2 * j] * acc[4 * j], fin[4 * j + 1] += sa0 * sbc[2 * j + 1] * acc[4 * j + 1];
                    fin[4 * j + 2] += sa1 * sbc[2 * j] * acc[4 * j + 2], fin[4 * j + 3] += sa1 * sbc[2 * j + 1] * acc[4 * j + 3];
                }
            }
        }
        const int64_t mlim = KIND == 2 ? p.out : t.me;
        const int64_t row = (int64_t)t.mt * BM + rl;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int64_t col = (int64_t)t.nt * BN + j * 8 + (lane & 3) * 2;
            if (row < mlim) gg_store2(gg_c_ptr(gp, t, row, col), fin[4 * j], fin[4 * j + 1], p.beta);
            if (row + 8 < mlim) gg_store2(gg_c_ptr(gp, t, row + 8, col), fin[4 * j + 2], fin[4 * j + 3], p.beta);
        }
    }
}

/* ---- quantization (fp8_ref.h states the arithmetic; the kernels match it bit for bit) ----
 * A block's scale is 2^e, e = fm_fp8_scale_exp(amax) (src/backend/fm_fp8.h, the engine's), stored
 * as fp32 (fp8_scale); each value is coded as the hardware e4m3(v * 2^-e) (fm_fp8_ldexp: exact),
 * which equals fm_e4m3_encode for the finite values it gets (fp8_host_check); a block with a
 * non-finite value (fp8_amax_fold makes its amax +inf) gets scale NaN and codes 0x7F (NaN). */
__device__ inline uint8_t q8(float v, int e, bool bad) {
    return bad ? (uint8_t)0x7F : (uint8_t)__nv_cvt_float_to_fp8(fm_fp8_ldexp(v, -e), __NV_SATFINITE, __NV_E4M3);
}
__device__ inline float warp_max(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* 1 x 128 row blocks: a [R, K] bf16 (R = offs[E], read here) -> q [rcap, K] e4m3 and s [K/128][rpad]
 * fp32 (row scales scale-major). One warp per (row, block), 4 elements a lane. */
__global__ void quant_rows(const bf16 *a, int64_t K, const int64_t *offs, int E, int64_t rpad, uint8_t *q, float *s) {
    const int64_t R = offs[E], nb = K / 128, nw = R * nb;
    const int lane = threadIdx.x & 31;
    for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < nw; w += ((int64_t)gridDim.x * blockDim.x) >> 5) {
        const int64_t r = w / nb, b = w % nb, i = r * K + b * 128 + lane * 4;
        const uint2 raw = *reinterpret_cast<const uint2 *>(a + i);
        const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&raw.x));
        const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&raw.y));
        const float amax =
            warp_max(fp8_amax_fold(fp8_amax_fold(fp8_amax_fold(fp8_amax_fold(0.0f, v01.x), v01.y), v23.x), v23.y));
        const float sc = fp8_scale(amax);
        const int ex = fm_fp8_scale_exp(amax);
        const bool bad = fp8_block_bad(amax);
        const uint32_t pk = (uint32_t)q8(v01.x, ex, bad) | (uint32_t)q8(v01.y, ex, bad) << 8 | (uint32_t)q8(v23.x, ex, bad) << 16 |
                            (uint32_t)q8(v23.y, ex, bad) << 24;
        *reinterpret_cast<uint32_t *>(q + i) = pk;
        if (lane == 0) s[b * rpad + r] = sc;
    }
}

/* 128 x 128 weight blocks: W [E*out, in] bf16 -> Wq [E*out, in], WqT [E*in, out] (W_e^T, the same
 * codes), sW [E][out/128][in/128]. Grid (in/128, out/128, E), 256 threads: thread t has row t/2,
 * columns 64 (t%2) .. +63 of the block. */
__global__ void __launch_bounds__(256) quant_weight(const bf16 *W, int64_t out, int64_t in, uint8_t *Wq, uint8_t *WqT, float *sW) {
    __shared__ uint8_t qt[128][128 + 4]; /* the block's codes, [column][row] */
    __shared__ float wmax[8];
    const int64_t e = blockIdx.z, n0 = (int64_t)blockIdx.y * 128, k0 = (int64_t)blockIdx.x * 128;
    const int r = threadIdx.x >> 1, h = threadIdx.x & 1;
    const bf16 *src = W + (e * out + n0 + r) * in + k0 + h * 64;
    float v[64], amax = 0.0f;
#pragma unroll
    for (int c = 0; c < 8; c++) {
        const uint4 raw = reinterpret_cast<const uint4 *>(src)[c];
        const __nv_bfloat162 *b2 = reinterpret_cast<const __nv_bfloat162 *>(&raw);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = __bfloat1622float2(b2[j]);
            v[c * 8 + 2 * j] = f.x, v[c * 8 + 2 * j + 1] = f.y;
            amax = fp8_amax_fold(fp8_amax_fold(amax, f.x), f.y);
        }
    }
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) wmax[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = wmax[0];
    for (int i = 1; i < 8; i++) amax = fmaxf(amax, wmax[i]);
    const float sc = fp8_scale(amax);
    const int ex = fm_fp8_scale_exp(amax);
    const bool bad = fp8_block_bad(amax);
    uint8_t *dst = Wq + (e * out + n0 + r) * in + k0 + h * 64;
#pragma unroll
    for (int c = 0; c < 4; c++) {
        uint32_t w4[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int k = c * 16 + j * 4;
            uint32_t pk = 0;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const uint8_t code = q8(v[k + b], ex, bad);
                pk |= (uint32_t)code << (8 * b);
                qt[h * 64 + k + b][r] = code;
            }
            w4[j] = pk;
        }
        reinterpret_cast<uint4 *>(dst)[c] = make_uint4(w4[0], w4[1], w4[2], w4[3]);
    }
    if (threadIdx.x == 0) sW[(e * (out / 128) + blockIdx.y) * (in / 128) + blockIdx.x] = sc;
    __syncthreads();
    /* W_e^T rows k0 + t/2 (an in channel), columns n0 + 64 (t%2) .. +63 (out channels) */
    uint8_t *dt = WqT + (e * in + k0 + r) * out + n0 + h * 64;
#pragma unroll
    for (int c = 0; c < 16; c++) reinterpret_cast<uint32_t *>(dt)[c] = *reinterpret_cast<const uint32_t *>(&qt[r][h * 64 + c * 4]);
}

/* 128 x 1 token blocks for dW: a [R, C] bf16 with groups offs -> aT [C, kcap] e4m3 (token-major,
 * group e's tokens from token block pblk[e], the tail of its last block zero) and sT [kcap/128][C]
 * fp32. Grid (kcap/128, C/128), 256 threads; a CTA past the last group's blocks returns. */
__global__ void __launch_bounds__(256) quant_tokens_t(const bf16 *a, int64_t C, const int64_t *offs, int E, int64_t kcap,
                                                      uint8_t *aT, float *sT) {
    __shared__ int pblk[GG_MAX_E + 1];
    __shared__ uint32_t tile[128][65]; /* 128 tokens x 128 channels as bf16 pairs, padded */
    if (threadIdx.x == 0) pblk_build(pblk, offs, E);
    __syncthreads();
    const int b = blockIdx.x;
    if (b >= pblk[E]) return;
    int lo = 0, hi = E - 1; /* the group of block b: the last e with pblk[e] <= b */
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (pblk[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    const int64_t t0 = offs[lo] + (int64_t)(b - pblk[lo]) * 128, c0 = (int64_t)blockIdx.y * 128;
    const int valid = (int)min((int64_t)128, offs[lo + 1] - t0);
    for (int i = threadIdx.x; i < 128 * 16; i += 256) { /* 16 x 16 bytes a token */
        const int t = i >> 4, q = i & 15;
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (t < valid) raw = *reinterpret_cast<const uint4 *>(a + (t0 + t) * C + c0 + q * 8);
        tile[t][q * 4] = raw.x, tile[t][q * 4 + 1] = raw.y, tile[t][q * 4 + 2] = raw.z, tile[t][q * 4 + 3] = raw.w;
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int c = warp * 16; c < warp * 16 + 16; c++) {
        float v[4], amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t w = tile[lane + 32 * j][c >> 1];
            const __nv_bfloat162 p2 = *reinterpret_cast<const __nv_bfloat162 *>(&w);
            v[j] = (c & 1) ? __high2float(p2) : __low2float(p2);
            amax = fp8_amax_fold(amax, v[j]);
        }
        amax = warp_max(amax);
        const float sc = fp8_scale(amax);
        const int ex = fm_fp8_scale_exp(amax);
        const bool bad = fp8_block_bad(amax);
        uint8_t *dst = aT + (c0 + c) * kcap + (int64_t)b * 128;
#pragma unroll
        for (int j = 0; j < 4; j++) dst[lane + 32 * j] = lane + 32 * j < valid ? q8(v[j], ex, bad) : (uint8_t)0;
        if (lane == 0) sT[(int64_t)b * C + c0 + c] = sc;
    }
}

template <int KIND> static cudaError_t launch_kind(const gg_fp8_problem &p, cudaStream_t stream) {
    static int grid = 0;
    auto fn = kernel<KIND>;
    if (!grid) {
        int dev, sms = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
        if (err != cudaSuccess) return err;
        /* setmaxnreg.inc waits until the CTA's pool (registers a thread at launch x THREADS) holds
         * the consumers' REG_CONSUMER and the producer's REG_PRODUCER: with fewer it waits forever */
        cudaFuncAttributes fa;
        err = cudaFuncGetAttributes(&fa, fn);
        if (err != cudaSuccess) return err;
        if (!GG_V3_DEBUG && fa.numRegs * THREADS < 256 * REG_CONSUMER + 128 * REG_PRODUCER) {
            fprintf(stderr, "grouped_gemm: v3 kernel<%d> has %d registers a thread; setmaxnreg %d/%d needs %d\n", KIND, fa.numRegs,
                    REG_PRODUCER, REG_CONSUMER, (256 * REG_CONSUMER + 128 * REG_PRODUCER + THREADS - 1) / THREADS);
            return cudaErrorInvalidConfiguration;
        }
        grid = sms;
    }
    const CUtensorMapDataType U8 = CU_TENSOR_MAP_DATA_TYPE_UINT8, F32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    const CUtensorMapSwizzle NOSW = CU_TENSOR_MAP_SWIZZLE_NONE;
    const int64_t rpad = gg_fp8_rpad(p.rcap);
    CUtensorMap ta, tb, tsa, tsb;
    cudaError_t err;
    if (KIND == 0) {
        err = v2::make_map(&ta, p.A, p.in, p.rcap, 128, BM, U8, 1);
        if (!err) err = v2::make_map(&tb, p.B, p.in, (uint64_t)p.E * p.out, 128, BN, U8, 1);
        if (!err) err = v2::make_map(&tsa, p.sA, rpad, p.in / 128, SA_BOX, 1, F32, 4, NOSW);
        tsb = tsa;
    } else if (KIND == 1) {
        err = v2::make_map(&ta, p.A, p.out, p.rcap, 128, BM, U8, 1);
        if (!err) err = v2::make_map(&tb, p.B, p.out, (uint64_t)p.E * p.in, 128, BN, U8, 1);
        if (!err) err = v2::make_map(&tsa, p.sA, rpad, p.out / 128, SA_BOX, 1, F32, 4, NOSW);
        tsb = tsa;
    } else {
        err = v2::make_map(&ta, p.A, p.kcap, p.out, 128, BM, U8, 1);
        if (!err) err = v2::make_map(&tb, p.B, p.kcap, p.in, 128, BN, U8, 1);
        if (!err) err = v2::make_map(&tsa, p.sA, p.out, p.kcap / 128, BM, 1, F32, 4, NOSW);
        if (!err) err = v2::make_map(&tsb, p.sB, p.in, p.kcap / 128, BN, 1, F32, 4, NOSW);
    }
    if (err != cudaSuccess) return err;
    fn<<<grid, THREADS, SMEM, stream>>>(ta, tb, tsa, tsb, p);
    return cudaGetLastError();
}

} // namespace v3

/* The v3 GEMM for p on stream (operands already quantized; layouts in the header comment).
 * Returns a CUDA error code; GG_NOT_SERVED for a shape it does not serve. */
static cudaError_t gg_v3_launch(const gg_fp8_problem &p, cudaStream_t stream) {
    if (p.in % 128 || p.out % 128 || p.E > GG_MAX_E || p.rcap >= INT32_MAX || p.kcap % 128 || p.kcap >= INT32_MAX ||
        (int64_t)p.E * p.out >= INT32_MAX || (int64_t)p.E * p.in >= INT32_MAX)
        return GG_NOT_SERVED;
    if (p.kind == 0) return v3::launch_kind<0>(p, stream);
    if (p.kind == 1) return v3::launch_kind<1>(p, stream);
    return v3::launch_kind<2>(p, stream);
}

/* Quantize the activations of one product kind into f's buffers (see gg_fp8_problem): kind 0 x
 * rows, kind 1 dy rows, kind 2 dy and x token-major. Weights: gg_v3_quant_weight, once a step.
 * a: x or dy [rcap, C] bf16; returns the launch error. */
static cudaError_t gg_v3_quant_rows(const bf16 *a, int64_t C, const int64_t *offs, int E, int64_t rcap, uint8_t *q, float *s,
                                    cudaStream_t st) {
    v3::quant_rows<<<132 * 8, 256, 0, st>>>(a, C, offs, E, gg_fp8_rpad(rcap), q, s);
    return cudaGetLastError();
}
static cudaError_t gg_v3_quant_tokens_t(const bf16 *a, int64_t C, const int64_t *offs, int E, int64_t kcap, uint8_t *aT, float *sT,
                                        cudaStream_t st) {
    v3::quant_tokens_t<<<dim3((unsigned)(kcap / 128), (unsigned)(C / 128)), 256, 0, st>>>(a, C, offs, E, kcap, aT, sT);
    return cudaGetLastError();
}
static cudaError_t gg_v3_quant_weight(const bf16 *W, int E, int64_t out, int64_t in, uint8_t *Wq, uint8_t *WqT, float *sW,
                                      cudaStream_t st) {
    v3::quant_weight<<<dim3((unsigned)(in / 128), (unsigned)(out / 128), (unsigned)E), 256, 0, st>>>(W, out, in, Wq, WqT, sW);
    return cudaGetLastError();
}
