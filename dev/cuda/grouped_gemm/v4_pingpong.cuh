/* v4: v2's TMA + wgmma grouped GEMM (gg_common.cuh's three kinds) with the epilogue taken off the
 * critical path, for the H200 table's two slow products (README "v4: why").
 *
 * What v2 measured: every product pays a fixed cost per tile for its epilogue, not overlapped with
 * any MMA (both consumer warpgroups store at the same time; the producer runs at most STAGES
 * k-blocks ahead), and with beta != 0 that cost is about three times larger: gg_store2 loads the
 * old value and stores the new one element pair by element pair, and the compiler keeps the loads
 * in program order between the stores (the PTX shows ld/st/ld/st...), so a 128 x 256 tile waits
 * for 64 global-load latencies in a row. That is gu dx (beta 1, K = 1,024: only 16 k-blocks per
 * tile to hide it) and dW (beta 1, K = the group's rows: 4 k-blocks at 256 rows per expert).
 *
 * v4, the same producer and descriptors as v2, three changes:
 *  1. Ping-pong consumers (CUTLASS's sm90 "pingpong" schedule): each consumer warpgroup computes a
 *     whole 128 x 128 tile (two m64n128k16 wgmmas per k16 step, 128 fp32 accumulators per thread),
 *     warpgroup 0 the CTA's even tiles, warpgroup 1 its odd ones. The producer loads the tiles'
 *     k-blocks in the CTA's tile order into one ring, so warpgroup 1's tile starts when warpgroup
 *     0's loads end: one warpgroup's epilogue runs while the other's MMAs do. Each stage is
 *     consumed by one warpgroup ("empty" counts 4 warp arrivals); each consumer walks the whole
 *     tile list to keep the ring position (it += nk for the other warpgroup's tiles) and starts a
 *     tile's mainloop only after the other warpgroup has passed every "full" wait of the previous
 *     tile (the "order" mbarriers, CUTLASS's ordered math barrier: a parity wait cannot tell a
 *     phase two ahead from the one before; v4_protocol_sim.py shows the failure without it). One
 *     k-block of wgmmas stays in flight (wait_group 1, v2.*p), since one warpgroup alone must keep
 *     the tensor cores fed.
 *  2. The old C (beta != 0) comes by TMA: the producer loads the tile's C (two {64, 128} boxes,
 *     128-byte swizzle) into the consumer's 32 KB C buffer after the tile's k-blocks, so it arrives
 *     during the tile's MMAs; the epilogue reads it from shared memory (no global latency), the
 *     buffer's cfull / cempty mbarriers as the ring's.
 *  3. TMA-store epilogue: the consumer writes beta C + acc as bf16 into the same swizzled buffer
 *     (16-byte chunk (c/8 % 8) ^ (row % 8): the 8 rows of a warp's store hit 8 different chunks, no
 *     bank conflicts), fence.proxy.async, a warpgroup barrier, and one thread stores the 128 x 128
 *     tile with two cp.async.bulk.tensor stores (full 128-byte lines, asynchronous: the
 *     warpgroup goes on to its next tile). Tiles with rows past the group's end (the last m-tile of
 *     a group in fwd / dx) cannot go by TMA (the store would write the next group's rows); they
 *     store from registers with the row mask, as v2. dW tiles are always full.
 * beta == 0 (fwd always; dx of down and gate; dW's first touch) loads nothing: the SRC = false
 * kernels have no source path at all.
 * v4r (REG): change 1 alone, with v2's register epilogue except that each row's 16 old pairs are
 * loaded together before its stores (16 loads in flight, 4 latencies per tile instead of 64), no
 * C buffers, 6 stages: v4r against v2.128p is the ping-pong's share, v4 against v4r the TMA
 * epilogue's.
 *
 * Shared memory: 4 stages of 32 KB (A 128 x 64, B 128 x 64) + 2 C buffers of 32 KB = 192 KB
 * (v4r: 6 stages, 192 KB).
 * Requires in, out multiples of 128; TMA coordinates int32 (rcap, E*out < 2^31), as v2.
 * Techniques learned from CUTLASS's sm90 pingpong kernel and its TMA epilogue (source load into
 * shared memory, TMA store); the code is our own.
 */
#pragma once
#include "v2_wgmma.cuh"

namespace v4 {

using v2::mbar_arrive;
using v2::mbar_expect_tx;
using v2::mbar_init;
using v2::mbar_wait;
using v2::sdesc;
using v2::tma_2d;

constexpr int BM = 128, BN = 128, BK = 64, THREADS = 384, MAX_STAGES = 6;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int C_BYTES = BM * BN * 2, C_BOX = 64 * BM * 2; /* a C buffer; one {64, 128} box of it */
/* REG (v4r): the register epilogue, no C buffers, 6 stages; else 4 stages + 2 C buffers */
template <bool REG> struct shape {
    static constexpr int STAGES = REG ? 6 : 4;
    static constexpr int SMEM = STAGES * STAGE_BYTES + (REG ? 0 : 2 * C_BYTES) + 1024; /* + room to align to 1024 */
};
constexpr uint32_t CHUNK = 64 * 128;

template <int N> __device__ inline void acc_fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
/* the consumer warpgroup wg's named barrier (ids 2, 3; 0 is __syncthreads) */
__device__ inline void wg_bar(int wg) {
    if (wg == 0) asm volatile("bar.sync 2, 128;\n" ::: "memory");
    else asm volatile("bar.sync 3, 128;\n" ::: "memory");
}
__device__ inline void tma_store_2d(const CUtensorMap *m, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 ::"l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(src) : "memory");
}
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ inline void bulk_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ inline void bulk_wait0() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

/* k-blocks of a tile: kinds 0/1 K/BK, kind 2 ceil(m_e/BK) */
template <int KIND> __device__ inline int nk_of(const gg_problem &p, const gg_tile &t) {
    return KIND == 2 ? (int)((t.me + BK - 1) / BK) : (int)((KIND == 0 ? p.in : p.out) / BK);
}
/* the tile's first row in C's tensor map (kinds 0/1: [rcap, N]; kind 2: [E*out, in]) */
__device__ inline int c_row(const gg_problem &p, const gg_tile &t, int kind) {
    return kind == 2 ? (int)(t.e * p.out) + t.mt * BM : (int)t.r0 + t.mt * BM;
}

template <int KIND, bool SRC, bool REG>
__global__ void __launch_bounds__(THREADS, 1)
kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
       const __grid_constant__ CUtensorMap tmC, gg_problem p) {
    constexpr bool AMN = KIND == 2, BMN = KIND != 0;
    constexpr int STAGES = shape<REG>::STAGES;
    static_assert(!(SRC && REG), "the register epilogue reads the old C itself");
    extern __shared__ uint8_t smem_raw[];
    __shared__ gg_sched sched;
    __shared__ __align__(8) uint64_t full[MAX_STAGES], empty[MAX_STAGES], cfull[2], cempty[2], order[2];
    const uint32_t smem = (gg_smem_u32(smem_raw) + 1023u) & ~1023u;
    uint8_t *smem_ptr = smem_raw + (smem - gg_smem_u32(smem_raw));
    const uint32_t cbuf0 = smem + STAGES * STAGE_BYTES; /* C buffer of warpgroup w: cbuf0 + w * C_BYTES */

    gg_sched_build(sched, p, BM, BN);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mbar_init(&full[s], 1), mbar_init(&empty[s], 4);
        for (int w = 0; w < 2; w++) mbar_init(&cfull[w], 1), mbar_init(&cempty[w], 1), mbar_init(&order[w], 4);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int total = sched.tile[p.E], wg = threadIdx.x / 128;
    const float beta = KIND == 0 ? 0.0f : p.beta;

    if (wg == 2) { /* producer: v2's, plus (SRC) the tile's old C after its k-blocks */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x != 256) return;
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmA)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmB)) : "memory");
        if (SRC) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmC)) : "memory");
        uint32_t it = 0, cn0 = 0, cn1 = 0; /* old-C loads so far per warpgroup */
        int j = 0;
        for (int ti = blockIdx.x; ti < total; ti += gridDim.x, j ^= 1) {
            const gg_tile t = gg_tile_of(sched, p, ti, BN);
            const int nk = nk_of<KIND>(p, t);
            const int m0 = t.mt * BM, n0 = t.nt * BN, r0 = (int)t.r0, wrow = (int)(t.e * p.out);
            for (int kb = 0; kb < nk; kb++, it++) {
                const int s = it % STAGES, k0 = kb * BK;
                mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                const uint32_t sa = smem + s * STAGE_BYTES, sb = sa + A_BYTES;
                mbar_expect_tx(&full[s], STAGE_BYTES);
                if (!AMN) tma_2d(sa, &tmA, &full[s], k0, r0 + m0);
                else
                    for (int c = 0; c < BM / 64; c++) tma_2d(sa + c * CHUNK, &tmA, &full[s], m0 + 64 * c, r0 + k0);
                if (KIND == 0) tma_2d(sb, &tmB, &full[s], k0, wrow + n0);
                else
                    for (int c = 0; c < BN / 64; c++)
                        tma_2d(sb + c * CHUNK, &tmB, &full[s], n0 + 64 * c, (KIND == 1 ? wrow : r0) + k0);
            }
            if (SRC) { /* the old C of this tile into its warpgroup's buffer, once that is free */
                const uint32_t n = j ? cn1++ : cn0++;
                mbar_wait(&cempty[j], (n & 1) ^ 1);
                const uint32_t cb = cbuf0 + j * C_BYTES;
                mbar_expect_tx(&cfull[j], C_BYTES);
                const int cr = c_row(p, t, KIND);
                tma_2d(cb, &tmC, &cfull[j], n0, cr);
                tma_2d(cb + C_BOX, &tmC, &cfull[j], n0 + 64, cr);
            }
        }
        return;
    }

    /* consumers: warpgroup wg computes the CTA's tiles j = wg, wg + 2, ... (128 x 128 each) */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
    const uint32_t cb = cbuf0 + wg * C_BYTES;
    uint8_t *cb_ptr = smem_ptr + STAGES * STAGE_BYTES + wg * C_BYTES;
    uint32_t it = 0, cn = 0, own = 0; /* own: this warpgroup's tiles so far */
    int j = 0;
    for (int ti = blockIdx.x; ti < total; ti += gridDim.x, j ^= 1) {
        const gg_tile t = gg_tile_of(sched, p, ti, BN);
        const int nk = nk_of<KIND>(p, t);
        if (j != wg) { /* the other warpgroup's tile: skip its stages */
            it += nk;
            continue;
        }
        /* Mainloop order (CUTLASS's ordered math barrier): start only after the other warpgroup
         * has passed every "full" wait of the CTA's previous tile. Without it a warpgroup that
         * skipped the other's stages could wait on a stage's barrier two phases ahead, and a
         * parity wait cannot tell that from the phase before (it would pass on an old phase and
         * read the stage before its k-block lands). Signal n to order[w] is the end of the other
         * warpgroup's n-th mainloop: warpgroup 1's k-th tile waits signal k, warpgroup 0's k-th
         * (k >= 1) signal k - 1. */
        if (wg == 1) mbar_wait(&order[1], own & 1);
        else if (own > 0) mbar_wait(&order[0], (own - 1) & 1);
        own++;
        float acc[2][64]; /* rows h*64 .. h*64+63 of the tile */
#pragma unroll
        for (int i = 0; i < 64; i++) acc[0][i] = 0.0f, acc[1][i] = 0.0f;
        acc_fence(acc[0]), acc_fence(acc[1]);
        int prev = -1; /* the stage whose wgmmas may still run */
        for (int kb = 0; kb < nk; kb++, it++) {
            const int s = it % STAGES;
            mbar_wait(&full[s], (it / STAGES) & 1);
            const uint32_t sa = smem + s * STAGE_BYTES, sb = sa + A_BYTES;
            if (KIND == 2) {
                const int valid = (int)(t.me - (int64_t)kb * BK);
                if (valid < BK) { /* zero k rows valid..63 of both A chunks and both B chunks */
                    const int rows = BK - valid, per = rows * 8, n = (BM / 64 + BN / 64) * per;
                    for (int i = tid; i < n; i += 128) {
                        const int c = i / per, r = valid + (i % per) / 8, q = i % 8;
                        uint8_t *base = smem_ptr + s * STAGE_BYTES + (c < BM / 64 ? c * CHUNK : A_BYTES + (c - BM / 64) * CHUNK);
                        reinterpret_cast<uint4 *>(base + r * 128)[q] = make_uint4(0, 0, 0, 0);
                    }
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                    wg_bar(wg);
                }
            }
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++) {
                const uint64_t db = BMN ? sdesc(sb + kk * 2048, CHUNK, 1024) : sdesc(sb + kk * 32, 0, 1024);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const uint64_t da = AMN ? sdesc(sa + h * CHUNK + kk * 2048, CHUNK, 1024)
                                            : sdesc(sa + h * CHUNK + kk * 32, 0, 1024);
                    wgmma_m64n128<AMN, BMN>(acc[h], da, db);
                }
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);
            prev = s;
        }
        if (lane == 0) mbar_arrive(&order[wg ^ 1]); /* every full wait of this tile passed */
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        acc_fence(acc[0]), acc_fence(acc[1]);
        if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);

        /* epilogue. Fragment: acc[h][4jj + 2r8 + {0,1}] = (row h*64 + 16 warp + 8 r8 + lane/4,
         * col 8jj + 2(lane%4) + {0,1}); in the C buffer (two {64, 128} boxes, 128-byte swizzle)
         * at box jj/8, row*128 + 16 ((jj%8) ^ (row%8)) + 4 (lane%4), row%8 = lane/4. */
        const bool tma_tile = !REG && (KIND == 2 || (int64_t)(t.mt + 1) * BM <= t.me);
        const int64_t mlim = KIND == 2 ? p.out : t.me;
        if (SRC) {
            mbar_wait(&cfull[wg], cn & 1);
            cn++;
        } else if (tma_tile) { /* the buffer's previous TMA store must have read it */
            if (tid == 0) bulk_wait_read0();
            wg_bar(wg);
        }
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int r8 = 0; r8 < 2; r8++) {
                const int r = h * 64 + warp * 16 + r8 * 8 + (lane >> 2);
                const int64_t grow = (int64_t)t.mt * BM + r;
                __nv_bfloat162 oldr[BN / 8]; /* REG: this row's 16 old pairs, loaded together */
                if (REG) {
                    const bool rd = beta != 0.0f && grow < mlim;
#pragma unroll
                    for (int jj = 0; jj < BN / 8; jj++)
                        oldr[jj] = rd ? *reinterpret_cast<const __nv_bfloat162 *>(
                                            gg_c_ptr(p, t, grow, (int64_t)t.nt * BN + jj * 8 + (lane & 3) * 2))
                                      : __float2bfloat162_rn(0.0f);
                }
#pragma unroll
                for (int jj = 0; jj < BN / 8; jj++) {
                    const uint32_t off = (jj >> 3) * C_BOX + r * 128 + (((jj & 7) ^ (lane >> 2)) << 4) + (lane & 3) * 4;
                    __nv_bfloat162 *q = reinterpret_cast<__nv_bfloat162 *>(cb_ptr + off);
                    float v0 = acc[h][4 * jj + 2 * r8], v1 = acc[h][4 * jj + 2 * r8 + 1];
                    if (SRC || (REG && beta != 0.0f)) {
                        const float2 old = __bfloat1622float2(SRC ? *q : oldr[jj]);
                        v0 += beta * old.x, v1 += beta * old.y;
                    }
                    const __nv_bfloat162 o = __floats2bfloat162_rn(v0, v1);
                    if (tma_tile) *q = o;
                    else if (grow < mlim)
                        *reinterpret_cast<__nv_bfloat162 *>(gg_c_ptr(p, t, grow, (int64_t)t.nt * BN + jj * 8 + (lane & 3) * 2)) = o;
                }
            }
        if (tma_tile) {
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* our writes, then the TMA's reads */
            wg_bar(wg);
            if (tid == 0) {
                const int cr = c_row(p, t, KIND), n0 = t.nt * BN;
                tma_store_2d(&tmC, cb, n0, cr);
                tma_store_2d(&tmC, cb + C_BOX, n0 + 64, cr);
                bulk_commit();
                if (SRC) { /* the producer may load the next old C once the store has read the buffer */
                    bulk_wait_read0();
                    mbar_arrive(&cempty[wg]);
                }
            }
            __syncwarp(); /* warp 0 whole again before the next tile's .aligned wgmma instructions */
        } else if (SRC) { /* every thread has read its old values */
            wg_bar(wg);
            if (tid == 0) mbar_arrive(&cempty[wg]);
            __syncwarp();
        }
    }
    if (tid == 0) bulk_wait0(); /* the last TMA stores complete before the CTA exits */
}

template <int KIND, bool SRC, bool REG> static cudaError_t launch_kind(const gg_problem &p, cudaStream_t stream) {
    static int grid = 0; /* set once the attribute is: a failed first call is retried, not launched bare */
    auto fn = kernel<KIND, SRC, REG>;
    constexpr int SMEM = shape<REG>::SMEM;
    if (!grid) {
        int dev, sms = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        const cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
        if (err != cudaSuccess) return err;
        grid = sms;
    }
    CUtensorMap ta, tb, tc;
    const uint64_t Wrows = (uint64_t)p.E * p.out;
    cudaError_t err;
    if (KIND == 0) {
        err = v2::make_map(&ta, p.A, p.in, p.rcap, 64, BM);
        if (err == cudaSuccess) err = v2::make_map(&tb, p.B, p.in, Wrows, 64, BN);
        if (err == cudaSuccess) err = v2::make_map(&tc, p.C, p.out, p.rcap, 64, BM);
    } else if (KIND == 1) {
        err = v2::make_map(&ta, p.A, p.out, p.rcap, 64, BM);
        if (err == cudaSuccess) err = v2::make_map(&tb, p.B, p.in, Wrows, 64, 64);
        if (err == cudaSuccess) err = v2::make_map(&tc, p.C, p.in, p.rcap, 64, BM);
    } else {
        err = v2::make_map(&ta, p.A, p.out, p.rcap, 64, 64);
        if (err == cudaSuccess) err = v2::make_map(&tb, p.B, p.in, p.rcap, 64, 64);
        if (err == cudaSuccess) err = v2::make_map(&tc, p.C, p.in, Wrows, 64, BM);
    }
    if (err != cudaSuccess) return err;
    fn<<<grid, THREADS, SMEM, stream>>>(ta, tb, tc, p);
    return cudaGetLastError();
}

} // namespace v4

/* Launch v4 (ping-pong consumers, TMA source load and TMA store epilogue, 128 x 128 tiles) for p
 * on stream; REG (v4r): the same ping-pong mainloop with a register epilogue (each row's 16 old
 * values loaded together, then the masked stores; 6 stages, no C buffers), to tell the two
 * changes apart. beta as gg_common.cuh (kind 0 ignores it; 0 reads nothing). Returns a CUDA error
 * code; GG_NOT_SERVED when the shape is not served (in, out not multiples of 128; E > GG_MAX_E;
 * rows or E*out past int32 TMA coordinates). */
template <bool REG = false> static cudaError_t gg_v4_launch(const gg_problem &p, cudaStream_t stream) {
    if (p.in % v4::BN || p.out % v4::BM || p.E > GG_MAX_E || p.rcap >= INT32_MAX || (int64_t)p.E * p.out >= INT32_MAX)
        return GG_NOT_SERVED;
    const bool src = p.kind != 0 && p.beta != 0.0f;
    if (REG) {
        if (p.kind == 0) return v4::launch_kind<0, false, true>(p, stream);
        if (p.kind == 1) return v4::launch_kind<1, false, true>(p, stream);
        return v4::launch_kind<2, false, true>(p, stream);
    }
    if (p.kind == 0) return v4::launch_kind<0, false, false>(p, stream);
    if (p.kind == 1) return src ? v4::launch_kind<1, true, false>(p, stream) : v4::launch_kind<1, false, false>(p, stream);
    return src ? v4::launch_kind<2, true, false>(p, stream) : v4::launch_kind<2, false, false>(p, stream);
}
