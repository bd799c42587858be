/* Our FP8 grouped expert GEMM for Hopper (gg_sm90_fp8.h; its quantization kernels are in
 * gg_sm90_fp8_quant.cu): the kernel lab's v3 (dev/cuda/grouped_gemm/v3_fp8.cuh, validated on the
 * H200), promoted into the engine's byte layouts (backend/fm_fp8_layout.h: every sub-pointer comes
 * from its functions).
 *
 * sm_90's fp8 wgmma reads both operands K-major only (no transpose for 8-bit types), so every
 * product has operands whose reduction dimension is contiguous (fm_fp8_layout.h):
 *   kind 0 y = x W^T:   A = x's codes [rcap, in], scales [in/128][rpad];  B = Wq [E*out, in], sW [E][out/128][in/128]
 *   kind 1 dx = dy W:   A = dy's codes [rcap, out], scales [out/128][rpad]; B = WqT [E*in, out], sW read transposed
 *   kind 2 dW = dy^T x: A = dy's tokens [out, kcap], scales [kcap/128][out]; B = x's tokens [in, kcap], [kcap/128][in]
 * Kind 2's operands hold each group's tokens from a 128-token block boundary (pblk[e], the tail of
 * its last block zero), so no 128-token k-block mixes two experts and the kernel needs no masking.
 *
 * GEMM kernel: 3 warpgroups (384 threads), one CTA per SM, persistent over a tile list of 128 x 128
 * output tiles that every CTA builds in shared memory from offs (n fastest). Warpgroup 2 is the
 * producer: one thread issues cp.async.bulk.tensor loads (128-byte swizzle for the codes, none for
 * the scales) into a ring of 6 stages, each with a "full" mbarrier (expect-tx bytes) and an "empty"
 * one (one arrival per consumer warp). Warpgroups 0 and 1 each own 64 rows of the tile. BK = 128
 * (one 128-byte swizzled row of fp8 per tile row); per k-block: 4 wgmma.m64n128k32.e4m3 into a
 * fresh fp32 accumulator (the first with scale-d 0), wait, then fin += sa[row] * sb * acc (sb: one
 * weight scale per tile and k-block for kinds 0/1; per column, from shared memory, for kind 2), as
 * DeepGEMM's sm90 fp8 kernel promotes. The store is from registers, rows past the group's end
 * masked. setmaxnreg moves registers from the producer to the consumers (40 / 232: the kernel must
 * start with >= 168 registers a thread, checked at launch). Techniques learned from DeepGEMM
 * (deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh) and the public CUTLASS sm90 collective mainloop; the
 * code is our own.
 *
 * TMA rule this kernel keeps (the lab's first version broke it): the global address a
 * cp.async.bulk.tensor box starts at, base + c0 * element size along the innermost dimension, must
 * be a multiple of 16 bytes; a box that starts elsewhere raises cudaErrorIllegalInstruction and
 * kills the context. The code and kind-2 scale boxes start at k-block / tile offsets (multiples of
 * 128 B and 512 B); the row-scale box of kinds 0/1 would start at the tile's first row r0 + m0, so
 * it starts at that row rounded down to a multiple of 4 (fp32: 16 B) and is SA_BOX = 132 scales
 * long; the consumers read their rows at lead = r0 % 4 past its start (boxes_of). The lab checks
 * every box of every case on the host (fp8_tma_selftest in fp8_lab.cuh) and, in its GG_V3_DEBUG
 * build, on the device.
 *
 * fm_gg8_launch's schedule picks this kernel (v3) or one of the lab's v5 variants (gg_sm90_fp8_v5.cuh,
 * included below: the same tile list, boxes and results contract, promotion overlapped with the MMAs
 * and / or a TMA-store epilogue; v5 is the default: validated and the fastest on the H200, 2026-12-02).
 *
 * The quantizers (bf16 -> e4m3 + fp32 scales: fm_gg8_quant_weight, _rows, _tokens) are in
 * gg_sm90_fp8_quant.cu. */
#include "gg_sm90_fp8.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <type_traits> /* gg_sm90_fp8_v5.cuh: std::integral_constant */

#include "../../fm_backend_opts.h"
#include "../../fm_fp8_layout.h"
#include "sm90_common.cuh"
#include "wgmma_fp8.cuh"

namespace {

typedef __nv_bfloat16 bf16;

constexpr int MAX_E = 256;
constexpr int BM = 128, BN = 128, BK = 128, THREADS = 384, STAGES = 6;
constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SC_BYTES = (BM + BN) * 4;                         /* per stage: A scales, B scales (kind 2) */
constexpr int SMEM = STAGES * (STAGE_BYTES + SC_BYTES) + 1024; /* + room to align to 1024 */
/* kinds 0/1: the row-scale box, from the tile's first row rounded down to a multiple of 4 (16 B) */
constexpr int SA_BOX = BM + 4;
static_assert(SA_BOX * 4 <= SC_BYTES && SA_BOX * 4 % 16 == 0 && SA_BOX <= 256, "row-scale box");
constexpr int REG_PRODUCER = 40, REG_CONSUMER = 232; /* setmaxnreg counts: need 168 a thread at launch */

struct problem {
    int kind;             /* 0 fwd, 1 dx, 2 dW */
    const uint8_t *A, *B; /* e4m3 codes (the header's layouts) */
    const float *sA, *sB; /* kind 0: x's, W's scales; 1: dy's, W's; 2: dy's, x's token scales */
    bf16 *C;
    const int64_t *offs; /* [E+1], device-readable */
    int E;
    int64_t in, out, rcap, kcap;
    float beta;
};

/* ---- the tile list (the lab's gg_common.cuh, over this kernel's problem) ---- */

struct sched {
    int64_t offs[MAX_E + 1];
    int tile[MAX_E + 1]; /* the tile prefix over experts */
    int pblk[MAX_E + 1]; /* kind 2: the first 128-token block of each group */
};

__host__ __device__ inline int64_t ndim(const problem &p) { return p.kind == 0 ? p.out : p.in; }

/* Tiles of expert e with m_e rows: kinds 0/1 ceil(m_e/BM) x N/BN; kind 2 out/BM x N/BN, none when
 * m_e == 0 and beta == 1 (dW_e is left as it is). */
__device__ inline int expert_tiles(const problem &p, int64_t me) {
    const int ntn = (int)(ndim(p) / BN);
    if (p.kind == 2) return (me == 0 && p.beta == 1.0f) ? 0 : (int)(p.out / BM) * ntn;
    return (int)((me + BM - 1) / BM) * ntn;
}

/* pblk[e] = sum_{e' < e} ceil(m_e' / 128) (fm_fp8_layout.h's tokens layout), from offs. */
__device__ inline void pblk_build(int *pblk, const int64_t *offs, int E) {
    int acc = 0;
    pblk[0] = 0;
    for (int e = 0; e < E; e++) pblk[e + 1] = acc += (int)((offs[e + 1] - offs[e] + 127) / 128);
}

/* The whole CTA: offs into shared memory (one parallel read of the device-readable array), then
 * the prefixes. Every CTA builds the same list. */
__device__ inline void sched_build(sched &s, const problem &p) {
    for (int i = threadIdx.x; i <= p.E; i += blockDim.x) s.offs[i] = p.offs[i];
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        s.tile[0] = 0;
        for (int e = 0; e < p.E; e++) s.tile[e + 1] = acc += expert_tiles(p, s.offs[e + 1] - s.offs[e]);
        if (p.kind == 2) pblk_build(s.pblk, s.offs, p.E);
    }
    __syncthreads();
}

struct tile {
    int e, mt, nt;
    int64_t r0, me; /* the expert's first row and rows */
};

/* Tile t (< s.tile[E]) as expert e, m-tile mt, n-tile nt. Binary search on the prefix (empty
 * experts have equal ones). */
__device__ inline tile tile_of(const sched &s, const problem &p, int t) {
    int lo = 0, hi = p.E - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s.tile[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    const int ntn = (int)(ndim(p) / BN), local = t - s.tile[lo];
    tile r;
    r.e = lo, r.mt = local / ntn, r.nt = local % ntn;
    r.r0 = s.offs[lo], r.me = s.offs[lo + 1] - s.offs[lo];
    return r;
}

__device__ inline bf16 *c_ptr(const problem &p, const tile &t, int64_t row, int64_t col) {
    if (p.kind == 0) return p.C + (t.r0 + row) * p.out + col;
    if (p.kind == 1) return p.C + (t.r0 + row) * p.in + col;
    return p.C + (int64_t)t.e * p.out * p.in + row * p.in + col;
}

/* Two adjacent fp32 results (row, col), (row, col + 1) as bf16 with beta (0: C is not read). */
__device__ inline void store2(bf16 *c2, float v0, float v1, float beta) {
    __nv_bfloat162 *q = reinterpret_cast<__nv_bfloat162 *>(c2);
    if (beta != 0.0f) {
        const float2 old = __bfloat1622float2(*q);
        v0 += beta * old.x, v1 += beta * old.y;
    }
    *q = __floats2bfloat162_rn(v0, v1);
}

/* The TMA boxes of k-block kb of tile t as the producer issues them: [0] A, [1] B, [2] A's scales,
 * [3] B's scales (kind 2 only). c0 is the innermost coordinate, c1 the outer one. brow: W_e's first
 * row in Wq / WqT (kinds 0/1); pb: the group's first token block (kind 2). lead: where the tile's
 * first row scale lies in box [2] (0 for kind 2). */
struct stage_boxes {
    int lead;
    int c0[4], c1[4];
};
template <int KIND> __device__ inline stage_boxes boxes_of(const tile &t, int kb, int brow, int pb) {
    stage_boxes b;
    const int m0 = t.mt * BM, n0 = t.nt * BN, r0 = (int)t.r0;
    if (KIND != 2) {
        b.lead = r0 & 3;
        b.c0[0] = kb * BK, b.c1[0] = r0 + m0;
        b.c0[1] = kb * BK, b.c1[1] = brow + n0;
        b.c0[2] = r0 + m0 - b.lead, b.c1[2] = kb; /* a 16-byte aligned start (the TMA rule above) */
        b.c0[3] = b.c1[3] = 0;
    } else {
        const int kt = (pb + kb) * BK;
        b.lead = 0;
        b.c0[0] = kt, b.c1[0] = m0;
        b.c0[1] = kt, b.c1[1] = n0;
        b.c0[2] = m0, b.c1[2] = pb + kb;
        b.c0[3] = n0, b.c1[3] = pb + kb;
    }
    return b;
}
__host__ __device__ inline int stage_tx_bytes(int kind) { return STAGE_BYTES + (kind == 2 ? 2 * BM * 4 : SA_BOX * 4); }


#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* The 4 wgmma.m64n128k32.e4m3 of one k-block into acc (the first overwrites), committed as a group
 * (v3 and v5). K-major, 128-byte swizzle: a tile row is 128 fp8 (128 B), 8-row atoms 1024 B apart
 * (SBO), LBO unused; the k32 step is +32 B inside the swizzled row. */
__device__ __forceinline__ void mma_kblock(float (&acc)[64], uint32_t sa, uint32_t sb, int wg) {
    acc_fence(acc);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < BK / 32; kk++) {
        const uint64_t da = sdesc(sa + wg * (64 * 128) + kk * 32, 0, 1024);
        const uint64_t db = sdesc(sb + kk * 32, 0, 1024);
        wgmma_fp8_m64n128(acc, da, db, kk > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
#endif

template <int KIND>
__global__ void __launch_bounds__(THREADS, 1)
gg8_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
           const __grid_constant__ CUtensorMap tmSA, const __grid_constant__ CUtensorMap tmSB, problem p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    __shared__ sched sc;
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
    const uint32_t smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const float *sscale = reinterpret_cast<const float *>(smem_raw + (smem - smem_u32(smem_raw)) + STAGES * STAGE_BYTES);
    const uint32_t sscale_u32 = smem + STAGES * STAGE_BYTES;

    sched_build(sc, p);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mbar_init(&full[s], 1), mbar_init(&empty[s], 8);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int total = sc.tile[p.E], wg = threadIdx.x / 128;

    if (wg == 2) { /* producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REG_PRODUCER));
        if (threadIdx.x != 256) return;
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmA)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmB)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmSA)) : "memory");
        if (KIND == 2) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmSB)) : "memory");
        const CUtensorMap *maps[4] = {&tmA, &tmB, &tmSA, &tmSB};
        uint32_t it = 0;
        for (int ti = blockIdx.x; ti < total; ti += gridDim.x) {
            const tile t = tile_of(sc, p, ti);
            const int nk = KIND == 2 ? (int)((t.me + BK - 1) / BK) : (int)((KIND == 0 ? p.in : p.out) / BK);
            const int brow = KIND == 2 ? 0 : (int)(t.e * (KIND == 0 ? p.out : p.in)); /* W_e's first row in Wq / WqT */
            const int pb = KIND == 2 ? sc.pblk[t.e] : 0;
            for (int kb = 0; kb < nk; kb++, it++) {
                const int s = it % STAGES;
                mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                const uint32_t sa = smem + s * STAGE_BYTES, ssa = sscale_u32 + s * SC_BYTES;
                const uint32_t dst[4] = {sa, sa + A_BYTES, ssa, ssa + BM * 4};
                const stage_boxes b = boxes_of<KIND>(t, kb, brow, pb);
                mbar_expect_tx(&full[s], stage_tx_bytes(KIND));
#pragma unroll
                for (int i = 0; i < (KIND == 2 ? 4 : 3); i++) tma_2d(dst[i], maps[i], &full[s], b.c0[i], b.c1[i]);
            }
        }
        return;
    }

    /* consumers: warpgroup wg owns rows wg*64 .. wg*64+63 of the tile */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REG_CONSUMER));
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
    const int rl = wg * 64 + warp * 16 + (lane >> 2); /* this thread's first row in the tile (and rl + 8) */
    const int64_t kb_in = p.in / 128, kb_out = p.out / 128;
    const float beta = KIND == 0 ? 0.0f : p.beta;
    uint32_t it = 0;
    for (int ti = blockIdx.x; ti < total; ti += gridDim.x) {
        const tile t = tile_of(sc, p, ti);
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
            mbar_wait(&full[s], (it / STAGES) & 1);
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
            mma_kblock(acc, sa, sb, wg);
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            acc_fence(acc);
            if (lane == 0) mbar_arrive(&empty[s]); /* operands and scales of stage s all read */
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
            if (row < mlim) store2(c_ptr(p, t, row, col), fin[4 * j], fin[4 * j + 1], beta);
            if (row + 8 < mlim) store2(c_ptr(p, t, row + 8, col), fin[4 * j + 2], fin[4 * j + 3], beta);
        }
    }
#else
    __trap(); /* built without sm_90a: fm_gg_sm90_device_ok keeps callers away */
#endif
}

/* ---- host side ---- */

cudaError_t make_map(CUtensorMap *m, const void *base, uint64_t inner, uint64_t outer, uint32_t box_inner,
                     uint32_t box_outer, CUtensorMapDataType dtype, uint32_t elem, CUtensorMapSwizzle swz) {
    return sm90_make_map(m, base, inner, outer, box_inner, box_outer, dtype, elem, swz); /* sm90_common.cuh */
}

/* p is a multiple of a bytes (NULL passes: the callers check the pointers that must exist) */
bool aligned(const void *p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

template <int KIND> cudaError_t launch_kind(const problem &p, int sm_count, cudaStream_t stream) {
    auto fn = gg8_kernel<KIND>;
    /* per call, not cached: the attribute belongs to the current device's copy of the kernel */
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    if (err != cudaSuccess) return err;
    /* setmaxnreg.inc waits until the CTA's pool (registers a thread at launch x THREADS) holds the
     * consumers' REG_CONSUMER and the producer's REG_PRODUCER: with fewer it waits forever */
    cudaFuncAttributes fa;
    if ((err = cudaFuncGetAttributes(&fa, fn)) != cudaSuccess) return err;
    if (fa.numRegs * THREADS < 256 * REG_CONSUMER + 128 * REG_PRODUCER) return cudaErrorInvalidConfiguration;
    const CUtensorMapDataType U8 = CU_TENSOR_MAP_DATA_TYPE_UINT8, F32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    const CUtensorMapSwizzle SW = CU_TENSOR_MAP_SWIZZLE_128B, NOSW = CU_TENSOR_MAP_SWIZZLE_NONE;
    const uint64_t rpad = (uint64_t)fm_fp8_rpad(p.rcap), E = (uint64_t)p.E, in = (uint64_t)p.in, out = (uint64_t)p.out;
    const uint64_t rc = (uint64_t)p.rcap, kc = (uint64_t)p.kcap;
    CUtensorMap ta, tb, tsa, tsb;
    if (KIND == 0) {
        err = make_map(&ta, p.A, in, rc, BK, BM, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tb, p.B, in, E * out, BK, BN, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tsa, p.sA, rpad, in / 128, SA_BOX, 1, F32, 4, NOSW);
        tsb = tsa;
    } else if (KIND == 1) {
        err = make_map(&ta, p.A, out, rc, BK, BM, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tb, p.B, out, E * in, BK, BN, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tsa, p.sA, rpad, out / 128, SA_BOX, 1, F32, 4, NOSW);
        tsb = tsa;
    } else {
        err = make_map(&ta, p.A, kc, out, BK, BM, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tb, p.B, kc, in, BK, BN, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tsa, p.sA, out, kc / 128, BM, 1, F32, 4, NOSW);
        if (err == cudaSuccess) err = make_map(&tsb, p.sB, in, kc / 128, BN, 1, F32, 4, NOSW);
    }
    if (err != cudaSuccess) return err;
    fn<<<sm_count, THREADS, SMEM, stream>>>(ta, tb, tsa, tsb, p);
    return cudaGetLastError();
}

/* The v5 schedules (FLATMOE_FP8_GEMM=v5|v5a|v5b|v5c), over this file's tile list and boxes */
#include "gg_sm90_fp8_v5.cuh"

/* One product of p under the schedule (fm_backend_opts.h's fm_fp8_gemm values) */
cudaError_t launch_schedule(int schedule, const problem &p, int sm_count, cudaStream_t stream) {
    switch (schedule) {
    case FM_FP8_GEMM_V3:
        return p.kind == 0 ? launch_kind<0>(p, sm_count, stream)
               : p.kind == 1 ? launch_kind<1>(p, sm_count, stream)
                             : launch_kind<2>(p, sm_count, stream);
    case FM_FP8_GEMM_V5: return v5::launch<true, 1>(p, sm_count, stream);
    case FM_FP8_GEMM_V5A: return v5::launch<false, 1>(p, sm_count, stream);
    case FM_FP8_GEMM_V5B: return v5::launch<true, 0>(p, sm_count, stream);
    case FM_FP8_GEMM_V5C: return v5::launch<true, 2>(p, sm_count, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace

extern "C" {

bool fm_gg8_serves(int64_t E, int64_t in, int64_t out, int64_t rcap) {
    return fm_fp8_layer_serves(E, in, out, rcap); /* fm_fp8_layout.h: the one rule (symmetric in in, out) */
}

cudaError_t fm_gg8_launch(int schedule, int kind, void *C, float beta, const void *A8, const void *B8,
                          const int64_t *offs, int64_t rcap, int64_t E, int64_t in, int64_t out, int sm_count,
                          cudaStream_t stream) {
    if (!fm_gg8_serves(E, in, out, rcap) || kind < 0 || kind > 2 || sm_count < 1 || !offs || !C || !A8 || !B8 ||
        !aligned(C, 4) || !aligned(A8, 16) || !aligned(B8, 16) || schedule < FM_FP8_GEMM_V3 ||
        schedule > FM_FP8_GEMM_V5C)
        return cudaErrorInvalidValue;
    /* the TMA-store epilogues (v5, v5a, v5c) store C by TMA: its base 16-byte aligned (the TMA rule) */
    if (schedule != FM_FP8_GEMM_V3 && schedule != FM_FP8_GEMM_V5B && !aligned(C, 16)) return cudaErrorInvalidValue;
    if (kind != 2 && rcap == 0) return cudaSuccess; /* no rows: y, dx have none */
    const uint8_t *a8 = static_cast<const uint8_t *>(A8), *b8 = static_cast<const uint8_t *>(B8);
    problem p;
    p.kind = kind, p.C = static_cast<bf16 *>(C), p.offs = offs, p.E = (int)E;
    p.in = in, p.out = out, p.rcap = rcap, p.kcap = fm_fp8_kcap(rcap, E), p.beta = kind == 0 ? 0.0f : beta;
    if (kind == 0) { /* x's rows operand (K = in), W's weight operand */
        p.A = a8, p.sA = reinterpret_cast<const float *>(a8 + fm_fp8_rows_scales_at(rcap, in));
        p.B = b8, p.sB = reinterpret_cast<const float *>(b8 + fm_fp8_weight_scales_at(E, out, in));
        return launch_schedule(schedule, p, sm_count, stream);
    }
    if (kind == 1) { /* dy's rows operand (K = out), W's WqT */
        p.A = a8, p.sA = reinterpret_cast<const float *>(a8 + fm_fp8_rows_scales_at(rcap, out));
        p.B = b8 + fm_fp8_weight_t_at(E, out, in), p.sB = reinterpret_cast<const float *>(b8 + fm_fp8_weight_scales_at(E, out, in));
        return launch_schedule(schedule, p, sm_count, stream);
    }
    /* dy's tokens operand (C = out), x's (C = in) */
    p.A = a8, p.sA = reinterpret_cast<const float *>(a8 + fm_fp8_tokens_scales_at(p.kcap, out));
    p.B = b8, p.sB = reinterpret_cast<const float *>(b8 + fm_fp8_tokens_scales_at(p.kcap, in));
    return launch_schedule(schedule, p, sm_count, stream);
}

} /* extern "C" */
