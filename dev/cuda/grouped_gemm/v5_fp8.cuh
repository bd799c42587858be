/* v5: v3's FP8 grouped GEMM (v3_fp8.cuh: the same operands, quantizers, scales, tile list, TMA
 * boxes for A, B and the scales, 128 x 128 x 128 k-blocks, 3 warpgroups, both consumer warpgroups
 * on one tile, 64 rows each) with its two serial costs taken off the tensor cores (issue 14):
 *
 *  OVL (overlapped promotion): two accumulator sets. k-block kb's 4 wgmmas go into acc[kb % 2]
 *     and are committed; then wgmma.wait_group 1 (k-block kb-1's group done, kb's still running)
 *     and kb-1 is promoted, fin += sa * sb * acc[(kb-1) % 2], while the tensor cores run kb. The
 *     stage of kb-1 is released only after its promotion (its row / column scales are read from
 *     shared memory there), so a consumer holds at most two stages. 64 + 64 + 64 fp32 per thread
 *     (fin and two accumulators) within setmaxnreg's 232: ptxas shows no spills (README). The
 *     k-loop runs in straight-line chunks of 8 / 4 / 2 / 1 k-blocks, each ending with wait_group 0
 *     (a wgmma group in flight across a loop's back edge makes ptxas serialize them all: C7514).
 *     Without OVL: v3's loop (wait_group 0 after each k-block, then the promotion).
 *  CB (epilogue): 0 v3's register epilogue (8-byte fragments to global, beta read per pair);
 *     1 or 2 a TMA-store epilogue with CB shared-memory C tiles of 32 KB (each 128 x 128 bf16 as
 *     two 16 KB halves, one per consumer warpgroup, each half two {64 col, 64 row} boxes with
 *     128-byte swizzle, v4's layout): a warpgroup writes beta C + fin as bf16 into its half
 *     (16-byte chunk (col/8 % 8) ^ (row % 8)), fence.proxy.async, its named barrier, and its
 *     thread 0 stores the half with two cp.async.bulk.tensor stores (full lines, asynchronous).
 *     With beta != 0 (the SRC kernels) the producer loads the tile's old C by TMA into the tile's
 *     C buffer (b = the tile's TMA-tile count mod CB) after the tile's k-blocks (CB 1) or before
 *     them (CB 2), so it lands during the MMAs; per (buffer, half) cfull / cempty mbarriers, v4's
 *     protocol. CB 2 lets the old C of tile i+1 load while tile i's epilogue still owns the other
 *     buffer (dW at 512 rows has 4 k-blocks a tile: one C buffer leaves the load about one
 *     mainloop to land in).
 *     A group's last m-tile with rows past the group's end (kinds 0/1) is stored from registers
 *     with the row mask (a TMA store would write the next group's rows; each row's 16 old pairs
 *     loaded together, as v4r), and its old C is not loaded by TMA (producer and consumers test
 *     the same predicate, tma_tile). dW tiles are always whole.
 * Shared memory: STAGES x (32 KB operands + 1 KB scales) + CB x 32 KB: 6 / 5 / 4 stages for CB 0 /
 * 1 / 2 (the 227 KB limit). Requires what v3 requires (in, out multiples of 128; E <= GG_MAX_E;
 * rcap, kcap, E*in, E*out below 2^31).
 * Versions (fp8_lab.cuh): v5 = OVL + CB 1, v5a = CB 1 alone (the epilogue's share), v5b = OVL
 * alone (the promotion overlap's share), v5c = OVL + CB 2.
 * Protocol: v5_protocol_sim.py (make check) plays this producer / consumer / C-buffer protocol in
 * random interleavings. TMA boxes: A, B and the scales are v3::boxes_of; the C boxes (c_box below)
 * start at columns nt*128 + 64c (128-byte multiples) and fp8_tma_selftest checks them on the host.
 * GG_V3_DEBUG=1 (make grouped_gemm_v3dbg) covers v5 as v3: no setmaxnreg, every mbarrier wait bounded
 * (about 20 s) and named ("v3 debug: kernel<K> ...: v5 consumer: cfull wait: phase p never completed").
 * Techniques learned from DeepGEMM's sm90 fp8 kernel (promotion) and CUTLASS's sm90 TMA epilogue;
 * the code is our own.
 */
#pragma once
#include "v3_fp8.cuh"
#include "v4_pingpong.cuh"
#include <type_traits>

namespace v5 {

using v3::BK;
using v3::BM;
using v3::BN;
using v3::THREADS;
constexpr int A_BYTES = BM * BK, STAGE_BYTES = v3::STAGE_BYTES, SC_BYTES = v3::SC_BYTES;
constexpr int C_BOX = 64 * 64 * 2, C_HALF = 2 * C_BOX, C_BYTES = 2 * C_HALF; /* bf16 {64, 64} box; a warpgroup's half; a tile */
constexpr int REG_PRODUCER = 40, REG_CONSUMER = 232;
template <int CB> struct shape {
    static constexpr int STAGES = CB == 0 ? 6 : CB == 1 ? 5 : 4;
    /* [stages][C buffers][scales], + room to align to 1024 */
    static constexpr int SMEM = STAGES * (STAGE_BYTES + SC_BYTES) + CB * C_BYTES + 1024;
};
static_assert(shape<0>::SMEM <= 232448 - 8192 && shape<1>::SMEM <= 232448 - 8192 && shape<2>::SMEM <= 232448 - 8192,
              "dynamic + static shared memory within 227 KB");
static_assert(STAGE_BYTES % 1024 == 0 && C_BOX % 1024 == 0, "128-byte swizzle boxes start 1024-aligned");

/* A tile whose C goes by TMA store: every dW tile, kinds 0/1 unless rows past the group's end */
__host__ __device__ inline bool tma_tile(int kind, const gg_tile &t) { return kind == 2 || (int64_t)(t.mt + 1) * BM <= t.me; }
/* C box i (0..3) of a tile: half w = i / 2 (rows 64 w .. 64 w + 63: consumer warpgroup w), columns
 * 64 (i % 2) ..; c0 the column (innermost, bf16), c1 the row in C's tensor map (kinds 0/1: [rcap,
 * N], kind 2: [E*out, in]); smem offset in a C buffer: w * C_HALF + (i % 2) * C_BOX */
__host__ __device__ inline void c_box(int kind, const gg_tile &t, int64_t out, int i, int *c0, int *c1) {
    const int w = i >> 1, c = i & 1;
    *c0 = t.nt * BN + 64 * c;
    *c1 = (kind == 2 ? (int)(t.e * out) : (int)t.r0) + t.mt * BM + 64 * w;
}

/* fin += (row scale) (column or weight scale) acc, v3's promotion. ss: the stage's scales (row
 * scales from lead; kind 2: the B scales at BM..); fragment d[4j + {0,1}] = (rl, 8j + 2(lane%4) +
 * {0,1}), d[4j + {2,3}] row rl + 8. */
template <int KIND>
__device__ __forceinline__ void promote(float (&fin)[64], const float (&acc)[64], const float *ss, int lead, int rl, int lane, float sbw) {
    const float sa0 = ss[lead + rl], sa1 = ss[lead + rl + 8];
    if (KIND != 2) {
        const float s0 = sa0 * sbw, s1 = sa1 * sbw;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            fin[4 * j] += s0 * acc[4 * j], fin[4 * j + 1] += s0 * acc[4 * j + 1];
            fin[4 * j + 2] += s1 * acc[4 * j + 2], fin[4 * j + 3] += s1 * acc[4 * j + 3];
        }
    } else { /* the column scales in groups of 4 x 2 (ordered by the fences: with two accumulator sets
              * live, all 32 loaded at once would spill) */
#pragma unroll
        for (int g = 0; g < 4; g++) {
            float2 v[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint32_t a = gg_smem_u32(ss + BM + (4 * g + i) * 8 + (lane & 3) * 2);
                asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v[i].x), "=f"(v[i].y) : "r"(a) : "memory");
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int j = 4 * g + i;
                fin[4 * j] += sa0 * v[i].x * acc[4 * j], fin[4 * j + 1] += sa0 * v[i].y * acc[4 * j + 1];
                fin[4 * j + 2] += sa1 * v[i].x * acc[4 * j + 2], fin[4 * j + 3] += sa1 * v[i].y * acc[4 * j + 3];
                asm volatile("" : "+f"(fin[4 * j]), "+f"(fin[4 * j + 1]), "+f"(fin[4 * j + 2]), "+f"(fin[4 * j + 3]));
            }
        }
    }
}

/* the 4 wgmma.m64n128k32.e4m3 of one k-block into acc (the first overwrites), committed as a group */
__device__ __forceinline__ void mma_kblock(float (&acc)[64], uint32_t sa, uint32_t sb, int wg) {
    v2::acc_fence(acc);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < BK / 32; kk++) {
        const uint64_t da = v2::sdesc(sa + wg * (64 * 128) + kk * 32, 0, 1024);
        const uint64_t db = v2::sdesc(sb + kk * 32, 0, 1024);
        wgmma_fp8_m64n128(acc, da, db, kk > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int KIND, bool SRC, bool OVL, int CB>
__global__ void __launch_bounds__(THREADS, 1)
kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB, const __grid_constant__ CUtensorMap tmSA,
       const __grid_constant__ CUtensorMap tmSB, const __grid_constant__ CUtensorMap tmC, gg_fp8_problem p) {
    constexpr int STAGES = shape<CB>::STAGES;
    static_assert(!(SRC && CB == 0), "the register epilogue reads the old C itself");
    extern __shared__ uint8_t smem_raw[];
    __shared__ v3::sched sc;
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES], cfull[2][2], cempty[2][2]; /* [buffer][half] */
    const uint32_t smem = (gg_smem_u32(smem_raw) + 1023u) & ~1023u;
    uint8_t *smem_ptr = smem_raw + (smem - gg_smem_u32(smem_raw));
    const uint32_t cbuf0 = smem + STAGES * STAGE_BYTES, sscale_u32 = cbuf0 + CB * C_BYTES;
    const float *sscale = reinterpret_cast<const float *>(smem_ptr + STAGES * STAGE_BYTES + CB * C_BYTES);

    gg_problem gp; /* the tile list's view of the problem */
    gp.kind = KIND, gp.E = p.E, gp.in = p.in, gp.out = p.out, gp.beta = p.beta, gp.offs = p.offs, gp.C = p.C;
    gp.A = gp.B = nullptr, gp.rcap = p.rcap;
    gg_sched_build(sc.s, gp, BM, BN);
    if (threadIdx.x == 0) {
        if (KIND == 2) v3::pblk_build(sc.pblk, sc.s.offs, p.E);
        for (int s = 0; s < STAGES; s++) v2::mbar_init(&full[s], 1), v2::mbar_init(&empty[s], 8);
        for (int b = 0; b < 2; b++)
            for (int w = 0; w < 2; w++) v2::mbar_init(&cfull[b][w], 1), v2::mbar_init(&cempty[b][w], 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int total = sc.s.tile[p.E], wg = threadIdx.x / 128;

    if (wg == 2) { /* producer: v3's, plus (SRC) each TMA tile's old C after its k-blocks */
#if !GG_V3_DEBUG
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REG_PRODUCER));
#endif
        if (threadIdx.x != 256) return;
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmA)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmB)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmSA)) : "memory");
        if (KIND == 2) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmSB)) : "memory");
        if (CB > 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmC)) : "memory");
        const CUtensorMap *maps[4] = {&tmA, &tmB, &tmSA, &tmSB};
        uint32_t it = 0, cn = 0; /* cn: TMA tiles so far (the C buffer sequence) */
        for (int ti = blockIdx.x; ti < total; ti += gridDim.x) {
            const gg_tile t = gg_tile_of(sc.s, gp, ti, BN);
            const int nk = KIND == 2 ? (int)((t.me + BK - 1) / BK) : (int)((KIND == 0 ? p.in : p.out) / BK);
            const int brow = KIND == 2 ? 0 : (int)(t.e * (KIND == 0 ? p.out : p.in));
            const int pb = KIND == 2 ? sc.pblk[t.e] : 0;
            auto old_c = [&]() { /* the old C into buffer cn % CB, each half once its last store has read it */
                const int bi = CB == 2 ? (int)(cn & 1) : 0;
                const uint32_t n = CB == 2 ? cn >> 1 : cn; /* earlier uses of buffer bi */
                cn++;
                for (int w = 0; w < 2; w++) {
                    v3::mbar_wait_dbg<KIND>(&cempty[bi][w], (n & 1) ^ 1, "v5 producer: cempty wait", cn);
                    v2::mbar_expect_tx(&cfull[bi][w], C_HALF);
                    for (int c = 0; c < 2; c++) {
                        int c0, c1;
                        c_box(KIND, t, p.out, 2 * w + c, &c0, &c1);
                        v2::tma_2d(cbuf0 + bi * C_BYTES + w * C_HALF + c * C_BOX, &tmC, &cfull[bi][w], c0, c1);
                    }
                }
            };
            /* CB 2: before the tile's k-blocks (its buffer was last used two TMA tiles back, whose store
             * read it during the previous tile's mainloop: no wait in practice, and the load gets a whole
             * tile to land); CB 1: after them (the buffer frees only at the previous tile's epilogue, and
             * waiting for it first would hold back this tile's k-blocks), as v4 */
            const bool ld = SRC && tma_tile(KIND, t);
            if (ld && CB == 2) old_c();
            for (int kb = 0; kb < nk; kb++, it++) {
                const int s = it % STAGES;
                v3::mbar_wait_dbg<KIND>(&empty[s], ((it / STAGES) & 1) ^ 1, "v5 producer: empty wait", it);
                const uint32_t sa = smem + s * STAGE_BYTES, ssa = sscale_u32 + s * SC_BYTES;
                const uint32_t dst[4] = {sa, sa + A_BYTES, ssa, ssa + BM * 4};
                const v3::stage_boxes b = v3::boxes_of<KIND>(t, kb, brow, pb);
                v2::mbar_expect_tx(&full[s], v3::stage_tx_bytes(KIND));
#pragma unroll
                for (int i = 0; i < (KIND == 2 ? 4 : 3); i++) v2::tma_2d(dst[i], maps[i], &full[s], b.c0[i], b.c1[i]);
            }
            if (ld && CB != 2) old_c();
        }
        return;
    }

    /* consumers: warpgroup wg owns rows wg*64 .. wg*64+63 of every tile */
#if !GG_V3_DEBUG
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REG_CONSUMER));
#endif
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
    const int rl = wg * 64 + warp * 16 + (lane >> 2); /* this thread's first row in the tile (and rl + 8) */
    const int64_t kb_in = p.in / 128, kb_out = p.out / 128;
    const float beta = KIND == 0 ? 0.0f : p.beta;
    uint32_t it = 0, cn = 0;
    float acc0[64], acc1[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc0[i] = 0.0f, acc1[i] = 0.0f; /* overwritten by each block's first wgmma */
    for (int ti = blockIdx.x; ti < total; ti += gridDim.x) {
        const gg_tile t = gg_tile_of(sc.s, gp, ti, BN);
        const int nk = KIND == 2 ? (int)((t.me + BK - 1) / BK) : (int)((KIND == 0 ? p.in : p.out) / BK);
        const int lead = KIND == 2 ? 0 : (int)(t.r0 & 3); /* v3::boxes_of: the row-scale box starts lead rows early */
        const float *wsc = KIND == 0 ? p.sB + ((int64_t)t.e * kb_out + t.nt) * kb_in : p.sB + (int64_t)t.e * kb_out * kb_in + t.nt;
        const int64_t wstep = KIND == 0 ? 1 : kb_in;
        float fin[64];
#pragma unroll
        for (int i = 0; i < 64; i++) fin[i] = 0.0f;
        if (OVL) {
            /* k-block kb: stage (it + kb) % STAGES, its wgmmas into acc[kb % 2] (kb counted from the
             * chunk's start); k-block kb-1 promoted after them (wait_group 1). In chunks of U = 8, 4,
             * 2, 1 k-blocks (the binary digits of nk), each ending with wait_group 0: with a wgmma
             * group in flight across a loop's back edge ptxas serializes every wgmma of the kernel
             * (C7514), as it does not with straight-line code. So (U-1)/U of the promotions overlap
             * the next k-block's MMAs (kinds 0/1 at K 2,048: 14 of 16; dW at 512 rows: 3 of 4). */
            auto issue = [&](float(&cur)[64], int kb) {
                const uint32_t q = it + kb;
                const int s = q % STAGES;
                const float sbw = KIND != 2 ? __ldg(wsc + kb * wstep) : 0.0f;
                v3::mbar_wait_dbg<KIND>(&full[s], (q / STAGES) & 1, "v5 consumer: full wait", q);
                const uint32_t sa = smem + s * STAGE_BYTES;
                mma_kblock(cur, sa, sa + A_BYTES, wg);
                return sbw;
            };
            auto retire = [&](float(&prv)[64], int kp, float sbw) { /* promote k-block kp (its wgmmas done), release its stage */
                v2::acc_fence(prv);
                const int sp = (it + kp) % STAGES;
                promote<KIND>(fin, prv, sscale + sp * (SC_BYTES / 4), lead, rl, lane, sbw);
                if (lane == 0) v2::mbar_arrive(&empty[sp]); /* kp's operands and scales all read */
            };
            auto chunk = [&](auto uc, int kb0) { /* k-blocks kb0 .. kb0 + U - 1, straight-line */
                constexpr int U = decltype(uc)::value;
                float sb[U];
#pragma unroll
                for (int i = 0; i < U; i++) {
                    sb[i] = issue((i & 1) ? acc1 : acc0, kb0 + i);
                    if (i > 0) {
                        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                        retire((i & 1) ? acc0 : acc1, kb0 + i - 1, sb[i - 1]);
                    }
                }
                asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
                retire(((U - 1) & 1) ? acc1 : acc0, kb0 + U - 1, sb[U - 1]);
            };
            int kb = 0;
            for (; kb + 8 <= nk; kb += 8) chunk(std::integral_constant<int, 8>(), kb);
            if (nk - kb >= 4) chunk(std::integral_constant<int, 4>(), kb), kb += 4;
            if (nk - kb >= 2) chunk(std::integral_constant<int, 2>(), kb), kb += 2;
            if (nk - kb >= 1) chunk(std::integral_constant<int, 1>(), kb);
            it += nk;
        } else { /* v3's loop */
            for (int kb = 0; kb < nk; kb++, it++) {
                const int s = it % STAGES;
                const float sbw = KIND != 2 ? __ldg(wsc + kb * wstep) : 0.0f;
                v3::mbar_wait_dbg<KIND>(&full[s], (it / STAGES) & 1, "v5 consumer: full wait", it);
                const uint32_t sa = smem + s * STAGE_BYTES;
                mma_kblock(acc0, sa, sa + A_BYTES, wg);
                asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
                v2::acc_fence(acc0);
                promote<KIND>(fin, acc0, sscale + s * (SC_BYTES / 4), lead, rl, lane, sbw);
                if (lane == 0) v2::mbar_arrive(&empty[s]);
            }
        }

        /* epilogue */
        const int64_t mlim = KIND == 2 ? p.out : t.me;
        if (CB > 0 && tma_tile(KIND, t)) {
            const int bi = CB == 2 ? (int)(cn & 1) : 0;
            const uint32_t n = CB == 2 ? cn >> 1 : cn;
            cn++;
            const uint32_t half = cbuf0 + bi * C_BYTES + wg * C_HALF;
            uint8_t *half_ptr = smem_ptr + STAGES * STAGE_BYTES + bi * C_BYTES + wg * C_HALF;
            if (SRC) v3::mbar_wait_dbg<KIND>(&cfull[bi][wg], n & 1, "v5 consumer: cfull wait", cn); /* the old C landed (after this half's last store read it) */
            else { /* this warpgroup's earlier stores have read the buffer */
                if (tid == 0) v4::bulk_wait_read0();
                v4::wg_bar(wg);
            }
#pragma unroll
            for (int j = 0; j < 16; j++)
#pragma unroll
                for (int r8 = 0; r8 < 2; r8++) {
                    const int r = warp * 16 + r8 * 8 + (lane >> 2); /* row in the half; r % 8 = lane / 4 */
                    const uint32_t off = (j >> 3) * C_BOX + r * 128 + (((j & 7) ^ (lane >> 2)) << 4) + (lane & 3) * 4;
                    __nv_bfloat162 *q = reinterpret_cast<__nv_bfloat162 *>(half_ptr + off);
                    float v0 = fin[4 * j + 2 * r8], v1 = fin[4 * j + 2 * r8 + 1];
                    if (SRC) {
                        const float2 old = __bfloat1622float2(*q);
                        v0 += beta * old.x, v1 += beta * old.y;
                    }
                    *q = __floats2bfloat162_rn(v0, v1);
                }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* our writes, then the TMA's reads */
            v4::wg_bar(wg);
            if (tid == 0) {
                for (int c = 0; c < 2; c++) {
                    int c0, c1;
                    c_box(KIND, t, p.out, 2 * wg + c, &c0, &c1);
                    v4::tma_store_2d(&tmC, half + c * C_BOX, c0, c1);
                }
                v4::bulk_commit();
                if (SRC) { /* the producer may load the next old C once the store has read the half */
                    v4::bulk_wait_read0();
                    v2::mbar_arrive(&cempty[bi][wg]);
                }
            }
            __syncwarp(); /* warp 0 whole again before the next tile's .aligned wgmma instructions */
        } else if (CB > 0) { /* rows past the group's end: masked register stores, each row's old pairs loaded together */
            const int64_t row0 = (int64_t)t.mt * BM + rl;
#pragma unroll
            for (int r8 = 0; r8 < 2; r8++) {
                const int64_t row = row0 + 8 * r8;
                if (row < mlim) {
                    __nv_bfloat162 old[16];
#pragma unroll
                    for (int j = 0; j < 16; j++)
                        old[j] = beta != 0.0f ? *reinterpret_cast<const __nv_bfloat162 *>(
                                                    gg_c_ptr(gp, t, row, (int64_t)t.nt * BN + j * 8 + (lane & 3) * 2))
                                              : __float2bfloat162_rn(0.0f);
#pragma unroll
                    for (int j = 0; j < 16; j++) {
                        float v0 = fin[4 * j + 2 * r8], v1 = fin[4 * j + 2 * r8 + 1];
                        if (beta != 0.0f) {
                            const float2 o = __bfloat1622float2(old[j]);
                            v0 += beta * o.x, v1 += beta * o.y;
                        }
                        *reinterpret_cast<__nv_bfloat162 *>(gg_c_ptr(gp, t, row, (int64_t)t.nt * BN + j * 8 + (lane & 3) * 2)) =
                            __floats2bfloat162_rn(v0, v1);
                    }
                }
            }
        } else { /* v3's register epilogue */
            const int64_t row = (int64_t)t.mt * BM + rl;
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const int64_t col = (int64_t)t.nt * BN + j * 8 + (lane & 3) * 2;
                if (row < mlim) gg_store2(gg_c_ptr(gp, t, row, col), fin[4 * j], fin[4 * j + 1], beta);
                if (row + 8 < mlim) gg_store2(gg_c_ptr(gp, t, row + 8, col), fin[4 * j + 2], fin[4 * j + 3], beta);
            }
        }
    }
    if (CB > 0 && tid == 0) v4::bulk_wait0(); /* this warpgroup's last TMA stores complete before the CTA exits */
}

template <int KIND, bool SRC, bool OVL, int CB> static cudaError_t launch_kind(const gg_fp8_problem &p, cudaStream_t stream) {
    static int grid = 0; /* set once the attribute is: a failed first call is retried, not launched bare */
    auto fn = kernel<KIND, SRC, OVL, CB>;
    constexpr int SMEM = shape<CB>::SMEM;
    if (!grid) {
        int dev, sms = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
        if (err != cudaSuccess) return err;
        /* setmaxnreg.inc waits forever unless the launch's pool holds 2 x 128 x 232 + 128 x 40 */
        cudaFuncAttributes fa;
        err = cudaFuncGetAttributes(&fa, fn);
        if (err != cudaSuccess) return err;
        if (!GG_V3_DEBUG && fa.numRegs * THREADS < 256 * REG_CONSUMER + 128 * REG_PRODUCER) {
            fprintf(stderr, "grouped_gemm: v5 kernel<%d, %d, %d, %d> has %d registers a thread; setmaxnreg %d/%d needs %d\n", KIND,
                    (int)SRC, (int)OVL, CB, fa.numRegs, REG_PRODUCER, REG_CONSUMER,
                    (256 * REG_CONSUMER + 128 * REG_PRODUCER + THREADS - 1) / THREADS);
            return cudaErrorInvalidConfiguration;
        }
        grid = sms;
    }
    const CUtensorMapDataType U8 = CU_TENSOR_MAP_DATA_TYPE_UINT8, F32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    const CUtensorMapSwizzle NOSW = CU_TENSOR_MAP_SWIZZLE_NONE;
    const int64_t rpad = gg_fp8_rpad(p.rcap);
    CUtensorMap ta, tb, tsa, tsb, tc;
    cudaError_t err;
    if (KIND == 0) {
        err = v2::make_map(&ta, p.A, p.in, p.rcap, 128, BM, U8, 1);
        if (!err) err = v2::make_map(&tb, p.B, p.in, (uint64_t)p.E * p.out, 128, BN, U8, 1);
        if (!err) err = v2::make_map(&tsa, p.sA, rpad, p.in / 128, v3::SA_BOX, 1, F32, 4, NOSW);
        if (!err) err = v2::make_map(&tc, p.C, p.out, p.rcap, 64, 64); /* bf16, 128-byte swizzle */
        tsb = tsa;
    } else if (KIND == 1) {
        err = v2::make_map(&ta, p.A, p.out, p.rcap, 128, BM, U8, 1);
        if (!err) err = v2::make_map(&tb, p.B, p.out, (uint64_t)p.E * p.in, 128, BN, U8, 1);
        if (!err) err = v2::make_map(&tsa, p.sA, rpad, p.out / 128, v3::SA_BOX, 1, F32, 4, NOSW);
        if (!err) err = v2::make_map(&tc, p.C, p.in, p.rcap, 64, 64);
        tsb = tsa;
    } else {
        err = v2::make_map(&ta, p.A, p.kcap, p.out, 128, BM, U8, 1);
        if (!err) err = v2::make_map(&tb, p.B, p.kcap, p.in, 128, BN, U8, 1);
        if (!err) err = v2::make_map(&tsa, p.sA, p.out, p.kcap / 128, BM, 1, F32, 4, NOSW);
        if (!err) err = v2::make_map(&tsb, p.sB, p.in, p.kcap / 128, BN, 1, F32, 4, NOSW);
        if (!err) err = v2::make_map(&tc, p.C, p.in, (uint64_t)p.E * p.out, 64, 64);
    }
    if (err != cudaSuccess) return err;
    fn<<<grid, THREADS, SMEM, stream>>>(ta, tb, tsa, tsb, tc, p);
    return cudaGetLastError();
}

} // namespace v5

/* The v5 GEMM (OVL: promotion overlapped with the next k-block's wgmmas; CB: 0 register epilogue,
 * 1 or 2 TMA-store epilogue with that many shared-memory C tiles) for p on stream, the operands of
 * gg_v3_launch (quantized by gg_v3_quant_*; layouts in v3_fp8.cuh). Returns a CUDA error code;
 * GG_NOT_SERVED for a shape v3 does not serve. */
template <bool OVL, int CB> static cudaError_t gg_v5_launch(const gg_fp8_problem &p, cudaStream_t stream) {
    if (p.in % 128 || p.out % 128 || p.E > GG_MAX_E || p.rcap >= INT32_MAX - 256 || p.kcap % 128 || p.kcap >= INT32_MAX ||
        (int64_t)p.E * p.out >= INT32_MAX || (int64_t)p.E * p.in >= INT32_MAX)
        return GG_NOT_SERVED;
    const bool src = CB > 0 && p.kind != 0 && p.beta != 0.0f;
    if (p.kind == 0) return v5::launch_kind<0, false, OVL, CB>(p, stream);
    if (p.kind == 1) return src ? v5::launch_kind<1, CB != 0, OVL, CB>(p, stream) : v5::launch_kind<1, false, OVL, CB>(p, stream);
    return src ? v5::launch_kind<2, CB != 0, OVL, CB>(p, stream) : v5::launch_kind<2, false, OVL, CB>(p, stream);
}
