/* The v5 schedules of our FP8 grouped expert GEMM (gg_sm90_fp8.h: fm_gg8_launch's schedule
 * argument, FLATMOE_FP8_GEMM): the kernel lab's v5 (dev/cuda/grouped_gemm/v5_fp8.cuh and its
 * README section, issue 14), ported onto the engine's v3 kernel of gg_sm90_fp8.cu. Included by
 * gg_sm90_fp8.cu inside its anonymous namespace, after its tile list (sched, tile_of, c_ptr,
 * store2), stage boxes (boxes_of, stage_tx_bytes), constants and make_map: those are shared, not
 * copied. On the H200 (2026-12-02, test_cuda_fp8_codes at 64 x 2048 x 1024, 512 rows an expert) all four
 * pass every check against the C reference; v5 runs the forward at 897 TFLOP/s and dx + dW at 651 against
 * v3's 726 and 267, and is the default (bench/RESULTS.md, session 11).
 *
 * The same operands, scales, tile list, A / B / scale TMA boxes and 128 x 128 x 128 k-blocks as
 * v3, 3 warpgroups (one producer thread, two consumer warpgroups of 64 rows of one tile), with
 * v3's two serial costs taken off the tensor cores, each behind a template flag:
 *  OVL (overlapped promotion): two accumulator sets. k-block kb's 4 wgmmas go into acc[kb % 2] and
 *     are committed; then wgmma.wait_group 1 (kb-1 done, kb still running) and kb-1 is promoted,
 *     fin += sa sb acc[(kb-1) % 2], while the tensor cores run kb. kb-1's stage is released only
 *     after its promotion (which reads its scales from the stage). The k-loop runs in straight-line
 *     chunks of 8 / 4 / 2 / 1 k-blocks (nk's binary digits), each ending with wait_group 0: a wgmma
 *     group in flight across a loop's back edge makes ptxas serialize every wgmma of the kernel
 *     (warning C7514). Without OVL: v3's loop (wait_group 0, promotion, release).
 *  CB (epilogue): 0 v3's register epilogue; 1 or 2 a TMA-store epilogue with CB shared-memory C
 *     tiles of 32 KB (a 128 x 128 bf16 tile as two 16 KB halves, one per consumer warpgroup, each
 *     half two {64 col, 64 row} boxes, 128-byte swizzle: 16-byte chunk (col/8 % 8) ^ (row % 8)):
 *     a warpgroup writes beta C + fin as bf16 into its half, fence.proxy.async, its named barrier,
 *     and its thread 0 stores the half with two cp.async.bulk.tensor stores. With beta != 0 (the
 *     SRC kernels: kinds 1, 2) the producer loads the tile's old C by TMA into the tile's C buffer
 *     (the TMA tile count mod CB) after the tile's k-blocks (CB 1) or before them (CB 2), per
 *     (buffer, half) cfull / cempty mbarriers (the producer waits until that half's last store has
 *     read it). A group's last m-tile with rows past the group's end (kinds 0/1) is stored from
 *     registers with the row mask (a TMA store would write the next group's rows) and its old C is
 *     not loaded by TMA (producer and consumers test the same tma_tile); dW tiles are whole.
 * Schedules: v5 = OVL + CB 1 (the lab's proposal), v5a = CB 1 alone (the epilogue's share), v5b =
 * OVL alone (the overlap's share), v5c = OVL + CB 2 (the dW variant). Shared memory STAGES x (32 KB
 * + 1 KB scales) + CB x 32 KB, STAGES 6 / 5 / 4 for CB 0 / 1 / 2.
 * TMA rule (gg_sm90_fp8.cu's header): the C boxes start at columns nt*128 + 64c (128-byte
 * multiples) of a C whose rows are multiples of 256 bytes, so C itself must be 16-byte aligned
 * for CB > 0 (checked by fm_gg8_launch). Beta semantics as v3's: beta 0 never reads C (no SRC
 * kernel, the masked path tests beta), kind 2 with m_e = 0 and beta 1 has no tile.
 * Techniques learned from DeepGEMM's sm90 fp8 kernel (promotion) and CUTLASS's sm90 TMA epilogue;
 * the code is our own. */
#pragma once
/* (no includes here: this file is read inside gg_sm90_fp8.cu's anonymous namespace, which
 * includes what it needs, <type_traits> for std::integral_constant among them) */

namespace v5 {

constexpr int C_BOX = 64 * 64 * 2, C_HALF = 2 * C_BOX, C_BYTES = 2 * C_HALF; /* a bf16 {64, 64} box; a warpgroup's half; a tile */
template <int CB> struct shape {
    static constexpr int STAGES = CB == 0 ? 6 : CB == 1 ? 5 : 4;
    static constexpr int SMEM = STAGES * (STAGE_BYTES + SC_BYTES) + CB * C_BYTES + 1024; /* + room to align to 1024 */
};
static_assert(shape<0>::SMEM <= 232448 - 8192 && shape<1>::SMEM <= 232448 - 8192 && shape<2>::SMEM <= 232448 - 8192,
              "dynamic + static shared memory within 227 KB");
static_assert(STAGE_BYTES % 1024 == 0 && C_BOX % 1024 == 0, "128-byte swizzle boxes start 1024-aligned");

/* A tile whose C goes by TMA store: every dW tile, kinds 0/1 unless rows past the group's end */
__host__ __device__ inline bool tma_tile(int kind, const tile &t) { return kind == 2 || (int64_t)(t.mt + 1) * BM <= t.me; }

/* C box i (0..3) of a tile: half w = i / 2 (rows 64 w ..: consumer warpgroup w), columns 64 (i % 2)
 * ..; c0 the column, c1 the row in C's tensor map (kinds 0/1: [rcap, N]; kind 2: [E*out, in]) */
__host__ __device__ inline void c_box(int kind, const tile &t, int64_t out, int i, int *c0, int *c1) {
    const int w = i >> 1, c = i & 1;
    *c0 = t.nt * BN + 64 * c;
    *c1 = (kind == 2 ? (int)(t.e * out) : (int)t.r0) + t.mt * BM + 64 * w;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* consumer warpgroup wg's named barrier (ids 2, 3; 0 is __syncthreads) */
__device__ inline void wg_bar(int wg) {
    if (wg == 0) asm volatile("bar.sync 2, 128;\n" ::: "memory");
    else asm volatile("bar.sync 3, 128;\n" ::: "memory");
}

/* fin += (row scale) (weight or column scale) acc, v3's promotion. ss: the stage's scales (row
 * scales from lead; kind 2: the column scales at BM..); fragment d[4j + {0,1}] = (rl, 8j +
 * 2(lane%4) + {0,1}), d[4j + {2,3}] row rl + 8. */
template <int KIND>
__device__ __forceinline__ void promote(float (&fin)[64], const float (&acc)[64], const float *ss, int lead, int rl, int lane,
                                        float sbw) {
    const float sa0 = ss[lead + rl], sa1 = ss[lead + rl + 8];
    if (KIND != 2) {
        const float s0 = sa0 * sbw, s1 = sa1 * sbw;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            fin[4 * j] += s0 * acc[4 * j], fin[4 * j + 1] += s0 * acc[4 * j + 1];
            fin[4 * j + 2] += s1 * acc[4 * j + 2], fin[4 * j + 3] += s1 * acc[4 * j + 3];
        }
    } else { /* the column scales in groups of 4 x 2 (ordered by the empty asm: with two accumulator
              * sets live, all 32 loaded at once would spill) */
#pragma unroll
        for (int g = 0; g < 4; g++) {
            float2 v[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint32_t a = smem_u32(ss + BM + (4 * g + i) * 8 + (lane & 3) * 2);
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

#endif

template <int KIND, bool SRC, bool OVL, int CB>
__global__ void __launch_bounds__(THREADS, 1)
kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB, const __grid_constant__ CUtensorMap tmSA,
       const __grid_constant__ CUtensorMap tmSB, const __grid_constant__ CUtensorMap tmC, problem p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int NST = shape<CB>::STAGES;
    static_assert(!(SRC && CB == 0), "the register epilogue reads the old C itself");
    extern __shared__ uint8_t smem_raw[];
    __shared__ sched sc;
    __shared__ __align__(8) uint64_t full[NST], empty[NST], cfull[2][2], cempty[2][2]; /* [buffer][half] */
    const uint32_t smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
    uint8_t *smem_ptr = smem_raw + (smem - smem_u32(smem_raw));
    const uint32_t cbuf0 = smem + NST * STAGE_BYTES, sscale_u32 = cbuf0 + CB * C_BYTES;
    const float *sscale = reinterpret_cast<const float *>(smem_ptr + NST * STAGE_BYTES + CB * C_BYTES);

    sched_build(sc, p);
    if (threadIdx.x == 0) {
        for (int s = 0; s < NST; s++) mbar_init(&full[s], 1), mbar_init(&empty[s], 8);
        for (int b = 0; b < 2; b++)
            for (int w = 0; w < 2; w++) mbar_init(&cfull[b][w], 1), mbar_init(&cempty[b][w], 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int total = sc.tile[p.E], wg = threadIdx.x / 128;

    if (wg == 2) { /* producer: v3's, plus (SRC) each TMA tile's old C */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REG_PRODUCER));
        if (threadIdx.x != 256) return;
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmA)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmB)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmSA)) : "memory");
        if (KIND == 2) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmSB)) : "memory");
        if (CB > 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmC)) : "memory");
        const CUtensorMap *maps[4] = {&tmA, &tmB, &tmSA, &tmSB};
        uint32_t it = 0, cn = 0; /* cn: TMA tiles so far (the C buffer sequence) */
        for (int ti = blockIdx.x; ti < total; ti += gridDim.x) {
            const tile t = tile_of(sc, p, ti);
            const int nk = KIND == 2 ? (int)((t.me + BK - 1) / BK) : (int)((KIND == 0 ? p.in : p.out) / BK);
            const int brow = KIND == 2 ? 0 : (int)(t.e * (KIND == 0 ? p.out : p.in));
            const int pb = KIND == 2 ? sc.pblk[t.e] : 0;
            auto old_c = [&]() { /* the old C into buffer cn % CB, each half once its last store has read it */
                const int bi = CB == 2 ? (int)(cn & 1) : 0;
                const uint32_t n = CB == 2 ? cn >> 1 : cn; /* earlier uses of buffer bi */
                cn++;
                for (int w = 0; w < 2; w++) {
                    mbar_wait(&cempty[bi][w], (n & 1) ^ 1);
                    mbar_expect_tx(&cfull[bi][w], C_HALF);
                    for (int c = 0; c < 2; c++) {
                        int c0, c1;
                        c_box(KIND, t, p.out, 2 * w + c, &c0, &c1);
                        tma_2d(cbuf0 + bi * C_BYTES + w * C_HALF + c * C_BOX, &tmC, &cfull[bi][w], c0, c1);
                    }
                }
            };
            /* CB 2: before the tile's k-blocks (its buffer's last store, two TMA tiles back, read it
             * during the previous mainloop); CB 1: after them (waiting for the previous tile's store
             * first would hold back this tile's k-blocks) */
            const bool ld = SRC && tma_tile(KIND, t);
            if (ld && CB == 2) old_c();
            for (int kb = 0; kb < nk; kb++, it++) {
                const int s = it % NST;
                mbar_wait(&empty[s], ((it / NST) & 1) ^ 1);
                const uint32_t sa = smem + s * STAGE_BYTES, ssa = sscale_u32 + s * SC_BYTES;
                const uint32_t dst[4] = {sa, sa + A_BYTES, ssa, ssa + BM * 4};
                const stage_boxes b = boxes_of<KIND>(t, kb, brow, pb);
                mbar_expect_tx(&full[s], stage_tx_bytes(KIND));
#pragma unroll
                for (int i = 0; i < (KIND == 2 ? 4 : 3); i++) tma_2d(dst[i], maps[i], &full[s], b.c0[i], b.c1[i]);
            }
            if (ld && CB != 2) old_c();
        }
        return;
    }

    /* consumers: warpgroup wg owns rows wg*64 .. wg*64+63 of every tile */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REG_CONSUMER));
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
    const int rl = wg * 64 + warp * 16 + (lane >> 2); /* this thread's first row in the tile (and rl + 8) */
    const int64_t kb_in = p.in / 128, kb_out = p.out / 128;
    const float beta = KIND == 0 ? 0.0f : p.beta;
    uint32_t it = 0, cn = 0;
    float acc0[64], acc1[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc0[i] = 0.0f, acc1[i] = 0.0f; /* overwritten by each block's first wgmma */
    for (int ti = blockIdx.x; ti < total; ti += gridDim.x) {
        const tile t = tile_of(sc, p, ti);
        const int nk = KIND == 2 ? (int)((t.me + BK - 1) / BK) : (int)((KIND == 0 ? p.in : p.out) / BK);
        const int lead = KIND == 2 ? 0 : (int)(t.r0 & 3); /* boxes_of: the row-scale box starts lead rows early */
        /* the tile's weight scales (kinds 0/1): kind 0 block (nt, kb) of W_e, kind 1 block (kb, nt) */
        const float *wsc = KIND == 0 ? p.sB + ((int64_t)t.e * kb_out + t.nt) * kb_in : p.sB + (int64_t)t.e * kb_out * kb_in + t.nt;
        const int64_t wstep = KIND == 0 ? 1 : kb_in;
        float fin[64];
#pragma unroll
        for (int i = 0; i < 64; i++) fin[i] = 0.0f;
        if (OVL) {
            /* k-block kb: stage (it + kb) % NST, its wgmmas into acc[kb % 2] (kb counted from the
             * chunk's start, chunks of even length but the last: the parity is the chunk's); kb-1
             * promoted after them (wait_group 1); each chunk ends with wait_group 0 */
            auto issue = [&](float(&cur)[64], int kb) {
                const uint32_t q = it + kb;
                const int s = q % NST;
                const float sbw = KIND != 2 ? __ldg(wsc + kb * wstep) : 0.0f;
                mbar_wait(&full[s], (q / NST) & 1);
                const uint32_t sa = smem + s * STAGE_BYTES;
                mma_kblock(cur, sa, sa + A_BYTES, wg);
                return sbw;
            };
            auto retire = [&](float(&prv)[64], int kp, float sbw) { /* promote k-block kp (its wgmmas done), release its stage */
                acc_fence(prv);
                const int sp = (it + kp) % NST;
                promote<KIND>(fin, prv, sscale + sp * (SC_BYTES / 4), lead, rl, lane, sbw);
                if (lane == 0) mbar_arrive(&empty[sp]); /* kp's operands and scales all read */
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
                const int s = it % NST;
                const float sbw = KIND != 2 ? __ldg(wsc + kb * wstep) : 0.0f;
                mbar_wait(&full[s], (it / NST) & 1);
                const uint32_t sa = smem + s * STAGE_BYTES;
                mma_kblock(acc0, sa, sa + A_BYTES, wg);
                asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
                acc_fence(acc0);
                promote<KIND>(fin, acc0, sscale + s * (SC_BYTES / 4), lead, rl, lane, sbw);
                if (lane == 0) mbar_arrive(&empty[s]);
            }
        }

        /* epilogue */
        const int64_t mlim = KIND == 2 ? p.out : t.me;
        if (CB > 0 && tma_tile(KIND, t)) {
            const int bi = CB == 2 ? (int)(cn & 1) : 0;
            const uint32_t n = CB == 2 ? cn >> 1 : cn;
            cn++;
            const uint32_t half = cbuf0 + bi * C_BYTES + wg * C_HALF;
            uint8_t *half_ptr = smem_ptr + NST * STAGE_BYTES + bi * C_BYTES + wg * C_HALF;
            if (SRC) mbar_wait(&cfull[bi][wg], n & 1); /* the old C landed (after this half's last store read it) */
            else { /* this warpgroup's earlier stores have read the buffer */
                if (tid == 0) bulk_wait_read0();
                wg_bar(wg);
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
            wg_bar(wg);
            if (tid == 0) {
                for (int c = 0; c < 2; c++) {
                    int c0, c1;
                    c_box(KIND, t, p.out, 2 * wg + c, &c0, &c1);
                    tma_store_2d(&tmC, half + c * C_BOX, c0, c1);
                }
                bulk_commit();
                if (SRC) { /* the producer may load the next old C once the store has read the half */
                    bulk_wait_read0();
                    mbar_arrive(&cempty[bi][wg]);
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
                                                    c_ptr(p, t, row, (int64_t)t.nt * BN + j * 8 + (lane & 3) * 2))
                                              : __float2bfloat162_rn(0.0f);
#pragma unroll
                    for (int j = 0; j < 16; j++) {
                        float v0 = fin[4 * j + 2 * r8], v1 = fin[4 * j + 2 * r8 + 1];
                        if (beta != 0.0f) {
                            const float2 o = __bfloat1622float2(old[j]);
                            v0 += beta * o.x, v1 += beta * o.y;
                        }
                        *reinterpret_cast<__nv_bfloat162 *>(c_ptr(p, t, row, (int64_t)t.nt * BN + j * 8 + (lane & 3) * 2)) =
                            __floats2bfloat162_rn(v0, v1);
                    }
                }
            }
        } else { /* v3's register epilogue */
            const int64_t row = (int64_t)t.mt * BM + rl;
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const int64_t col = (int64_t)t.nt * BN + j * 8 + (lane & 3) * 2;
                if (row < mlim) store2(c_ptr(p, t, row, col), fin[4 * j], fin[4 * j + 1], beta);
                if (row + 8 < mlim) store2(c_ptr(p, t, row + 8, col), fin[4 * j + 2], fin[4 * j + 3], beta);
            }
        }
    }
    if (CB > 0 && tid == 0) bulk_wait0(); /* this warpgroup's last TMA stores complete before the CTA exits */
#else
    __trap(); /* built without sm_90a: fm_gg_sm90_device_ok keeps callers away */
#endif
}

/* One v5 launch of p (gg_sm90_fp8.cu's launch_kind, plus C's tensor map for CB > 0). */
template <int KIND, bool SRC, bool OVL, int CB> cudaError_t launch_kind(const problem &p, int sm_count, cudaStream_t stream) {
    auto fn = kernel<KIND, SRC, OVL, CB>;
    constexpr int SMEM_V5 = shape<CB>::SMEM;
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_V5); /* per call: per device */
    if (err != cudaSuccess) return err;
    cudaFuncAttributes fa; /* setmaxnreg.inc waits forever unless the pool holds its split */
    if ((err = cudaFuncGetAttributes(&fa, fn)) != cudaSuccess) return err;
    if (fa.numRegs * THREADS < 256 * REG_CONSUMER + 128 * REG_PRODUCER) return cudaErrorInvalidConfiguration;
    const CUtensorMapDataType U8 = CU_TENSOR_MAP_DATA_TYPE_UINT8, F32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    const CUtensorMapDataType BF = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const CUtensorMapSwizzle SW = CU_TENSOR_MAP_SWIZZLE_128B, NOSW = CU_TENSOR_MAP_SWIZZLE_NONE;
    const uint64_t rpad = (uint64_t)fm_fp8_rpad(p.rcap), E = (uint64_t)p.E, in = (uint64_t)p.in, out = (uint64_t)p.out;
    const uint64_t rc = (uint64_t)p.rcap, kc = (uint64_t)p.kcap;
    CUtensorMap ta, tb, tsa, tsb, tc;
    if (KIND == 0) {
        err = make_map(&ta, p.A, in, rc, BK, BM, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tb, p.B, in, E * out, BK, BN, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tsa, p.sA, rpad, in / 128, SA_BOX, 1, F32, 4, NOSW);
        if (err == cudaSuccess && CB > 0) err = make_map(&tc, p.C, out, rc, 64, 64, BF, 2, SW);
        tsb = tsa;
    } else if (KIND == 1) {
        err = make_map(&ta, p.A, out, rc, BK, BM, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tb, p.B, out, E * in, BK, BN, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tsa, p.sA, rpad, out / 128, SA_BOX, 1, F32, 4, NOSW);
        if (err == cudaSuccess && CB > 0) err = make_map(&tc, p.C, in, rc, 64, 64, BF, 2, SW);
        tsb = tsa;
    } else {
        err = make_map(&ta, p.A, kc, out, BK, BM, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tb, p.B, kc, in, BK, BN, U8, 1, SW);
        if (err == cudaSuccess) err = make_map(&tsa, p.sA, out, kc / 128, BM, 1, F32, 4, NOSW);
        if (err == cudaSuccess) err = make_map(&tsb, p.sB, in, kc / 128, BN, 1, F32, 4, NOSW);
        if (err == cudaSuccess && CB > 0) err = make_map(&tc, p.C, in, E * out, 64, 64, BF, 2, SW);
    }
    if (err != cudaSuccess) return err;
    if (CB == 0) tc = ta; /* unused: the register epilogue */
    fn<<<sm_count, THREADS, SMEM_V5, stream>>>(ta, tb, tsa, tsb, tc, p);
    return cudaGetLastError();
}

/* The v5 schedule (OVL, CB) for p: the SRC kernels where the TMA epilogue reads the old C. */
template <bool OVL, int CB> cudaError_t launch(const problem &p, int sm_count, cudaStream_t stream) {
    const bool src = CB > 0 && p.kind != 0 && p.beta != 0.0f;
    if (p.kind == 0) return launch_kind<0, false, OVL, CB>(p, sm_count, stream);
    if (p.kind == 1)
        return src ? launch_kind<1, CB != 0, OVL, CB>(p, sm_count, stream) : launch_kind<1, false, OVL, CB>(p, sm_count, stream);
    return src ? launch_kind<2, CB != 0, OVL, CB>(p, sm_count, stream) : launch_kind<2, false, OVL, CB>(p, sm_count, stream);
}

} // namespace v5
