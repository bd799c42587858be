/* v2: the Hopper grouped GEMM (gg_common.cuh's three kinds): wgmma fed by TMA.
 *
 * CTA: 3 warpgroups (384 threads), one CTA per SM, persistent over gg_common.cuh's tile list
 * (built in each CTA from offs in device memory: no host sync). Warpgroup 2 is the producer (one
 * thread issues cp.async.bulk.tensor loads, 128-byte swizzle, into a ring of STAGES stages, each
 * with a "full" mbarrier (expect-tx bytes) and an "empty" one (one arrival per consumer warp));
 * warpgroups 0 and 1 are consumers, each computing 64 rows of the 128 x BN tile with
 * wgmma.mma_async.m64nBNk16 (bf16 in, fp32 accumulators in registers, 4 k16 steps per 64-deep
 * stage) and storing straight from registers, rows past the group's end masked. setmaxnreg moves
 * registers from the producer to the consumers. The PIPE form (v2.*p) keeps one k-block of wgmmas
 * in flight per consumer (wait_group 1) and releases the stage before it.
 *
 * Operands, per gg_common.cuh: K-major tiles (x, dy for kinds 0/1; W for kind 0) are one TMA box
 * {64 k, rows} (128 B per row, 8-row 1024-byte swizzle atoms; descriptor SBO 1024, k16 step +32 B);
 * MN-major tiles (W for dx; dy and x for dW) are boxes {64 mn, 64 k} per 64 columns (each k row
 * 128 B; descriptor with the transpose bit, LBO = 8192 B between 64-column chunks, SBO = 1024 B
 * between 8-row k groups, k16 step +2048 B). dW's K is the group's rows: the last stage's rows
 * past the group's end (another group's rows, or never-written rows up to rcap) are zeroed in
 * shared memory by the consumers before the wgmma (fence.proxy.async, then a named barrier).
 * TMA coordinates are int32 rows (not elements): rcap and E*out must stay below 2^31.
 * Requires in and out multiples of BN and of 128. TMA descriptors: cuTensorMapEncodeTiled through
 * cudaGetDriverEntryPointByVersion (no -lcuda).
 * Techniques learned from the public CUTLASS sm90 collective mainloop (TMA + mbarrier pipeline,
 * warp-specialized producer/consumer, the GMMA descriptor's canonical layouts) and DeepGEMM's
 * sm90 kernels (persistent grouped scheduling); the code is our own.
 */
#pragma once
#include "gg_common.cuh"
#include "wgmma_ops.cuh"
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cstdio>

namespace v2 {

constexpr int BM = 128, BK = 64, THREADS = 384;
template <int BN> struct cfg {
    static constexpr int STAGES = BN == 128 ? 6 : 4;
    static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int SMEM = STAGES * STAGE_BYTES + 1024; /* + room to align to 1024 */
};
constexpr uint32_t CHUNK = 64 * 128; /* bytes of one {64, 64} box; also a 64-row K-major block */

__device__ inline void mbar_init(uint64_t *b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(gg_smem_u32(b)), "r"(count));
}
__device__ inline void mbar_wait(uint64_t *b, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(gg_smem_u32(b)), "r"(parity) : "memory");
    } while (!done);
}
__device__ inline void mbar_expect_tx(uint64_t *b, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(gg_smem_u32(b)), "r"(bytes) : "memory");
}
__device__ inline void mbar_arrive(uint64_t *b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(gg_smem_u32(b)) : "memory");
}
__device__ inline void tma_2d(uint32_t dst, const CUtensorMap *m, uint64_t *bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(gg_smem_u32(bar)) : "memory");
}
/* sm90 shared-memory matrix descriptor: start >> 4 [0,14), LBO >> 4 [16,30), SBO >> 4 [32,46),
 * layout type [62,64) = 1 (128-byte swizzle). */
__device__ inline uint64_t sdesc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) | (1ull << 62);
}
template <int N> __device__ inline void acc_fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

/* k-blocks of a tile: kinds 0/1 K/BK (in, out multiples of 64), kind 2 ceil(m_e/BK). */
template <int KIND> __device__ inline int nk_of(const gg_problem &p, const gg_tile &t) {
    return KIND == 2 ? (int)((t.me + BK - 1) / BK) : (int)((KIND == 0 ? p.in : p.out) / BK);
}

template <int KIND, int BN, bool PIPE>
__global__ void __launch_bounds__(THREADS, 1)
kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB, gg_problem p) {
    using C = cfg<BN>;
    constexpr bool AMN = KIND == 2, BMN = KIND != 0;
    extern __shared__ uint8_t smem_raw[];
    __shared__ gg_sched sched;
    __shared__ __align__(8) uint64_t full[C::STAGES], empty[C::STAGES];
    const uint32_t smem = (gg_smem_u32(smem_raw) + 1023u) & ~1023u;
    uint8_t *smem_ptr = smem_raw + (smem - gg_smem_u32(smem_raw));

    gg_sched_build(sched, p, BM, BN);
    if (threadIdx.x == 0) {
        for (int s = 0; s < C::STAGES; s++) mbar_init(&full[s], 1), mbar_init(&empty[s], 8);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int total = sched.tile[p.E], wg = threadIdx.x / 128;

    if (wg == 2) { /* producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x != 256) return;
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmA)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmB)) : "memory");
        uint32_t it = 0;
        for (int ti = blockIdx.x; ti < total; ti += gridDim.x) {
            const gg_tile t = gg_tile_of(sched, p, ti, BN);
            const int nk = nk_of<KIND>(p, t);
            const int m0 = t.mt * BM, n0 = t.nt * BN, r0 = (int)t.r0, wrow = (int)(t.e * p.out);
            for (int kb = 0; kb < nk; kb++, it++) {
                const int s = it % C::STAGES, k0 = kb * BK;
                mbar_wait(&empty[s], ((it / C::STAGES) & 1) ^ 1);
                const uint32_t sa = smem + s * C::STAGE_BYTES, sb = sa + C::A_BYTES;
                mbar_expect_tx(&full[s], C::STAGE_BYTES);
                if (!AMN) tma_2d(sa, &tmA, &full[s], k0, r0 + m0);
                else
                    for (int c = 0; c < BM / 64; c++) tma_2d(sa + c * CHUNK, &tmA, &full[s], m0 + 64 * c, r0 + k0);
                if (KIND == 0) tma_2d(sb, &tmB, &full[s], k0, wrow + n0);
                else
                    for (int c = 0; c < BN / 64; c++)
                        tma_2d(sb + c * CHUNK, &tmB, &full[s], n0 + 64 * c, (KIND == 1 ? wrow : r0) + k0);
            }
        }
        return;
    }

    /* consumers: warpgroup wg owns rows wg*64 .. wg*64+63 of the tile */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
    uint32_t it = 0;
    int prev = -1; /* PIPE: the stage whose wgmmas may still run */
    for (int ti = blockIdx.x; ti < total; ti += gridDim.x) {
        const gg_tile t = gg_tile_of(sched, p, ti, BN);
        const int nk = nk_of<KIND>(p, t);
        float acc[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; i++) acc[i] = 0.0f;
        if (PIPE) acc_fence(acc); /* once: touching acc between in-flight wgmmas would make ptxas wait */
        for (int kb = 0; kb < nk; kb++, it++) {
            const int s = it % C::STAGES;
            mbar_wait(&full[s], (it / C::STAGES) & 1);
            const uint32_t sa = smem + s * C::STAGE_BYTES, sb = sa + C::A_BYTES;
            if (KIND == 2) {
                const int valid = (int)(t.me - (int64_t)kb * BK);
                if (valid < BK) { /* zero k rows valid..63 of both A chunks and every B chunk */
                    const int rows = BK - valid, per = rows * 8, n = (BM / 64 + BN / 64) * per;
                    for (int i = threadIdx.x; i < n; i += 256) {
                        const int c = i / per, r = valid + (i % per) / 8, q = i % 8;
                        uint8_t *base = smem_ptr + s * C::STAGE_BYTES + (c < BM / 64 ? c * CHUNK : C::A_BYTES + (c - BM / 64) * CHUNK);
                        reinterpret_cast<uint4 *>(base + r * 128)[q] = make_uint4(0, 0, 0, 0);
                    }
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                    asm volatile("bar.sync 1, 256;\n" ::: "memory");
                }
            }
            if (!PIPE) acc_fence(acc);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++) {
                const uint64_t da = AMN ? sdesc(sa + wg * CHUNK + kk * 2048, CHUNK, 1024)
                                        : sdesc(sa + wg * CHUNK + kk * 32, 0, 1024);
                const uint64_t db = BMN ? sdesc(sb + kk * 2048, CHUNK, 1024) : sdesc(sb + kk * 32, 0, 1024);
                if constexpr (BN == 128) wgmma_m64n128<AMN, BMN>(acc, da, db);
                else wgmma_m64n256<AMN, BMN>(acc, da, db);
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            if (PIPE) { /* keep this k-block's wgmmas in flight; the previous one's are done */
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);
                prev = s;
            } else {
                asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
                acc_fence(acc);
                if (lane == 0) mbar_arrive(&empty[s]);
            }
        }
        if (PIPE) { /* the tile's last wgmmas: wait, release their stage */
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            acc_fence(acc);
            if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);
            prev = -1;
        }
        /* epilogue: accumulator fragment d[4j + {0,1}] = (row, 8j + 2(lane%4) + {0,1}),
         * d[4j + {2,3}] = row + 8, row = 16 warp + lane/4 within the warpgroup's 64 rows */
        const int64_t mlim = KIND == 2 ? p.out : t.me;
        const int64_t row = (int64_t)t.mt * BM + wg * 64 + warp * 16 + (lane >> 2);
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            const int64_t col = (int64_t)t.nt * BN + j * 8 + (lane & 3) * 2;
            if (row < mlim) gg_store2(gg_c_ptr(p, t, row, col), acc[4 * j], acc[4 * j + 1], p.beta);
            if (row + 8 < mlim) gg_store2(gg_c_ptr(p, t, row + 8, col), acc[4 * j + 2], acc[4 * j + 3], p.beta);
        }
    }
}

/* A 2-D tensor map over a row-major [outer, inner] tensor of dtype (elem bytes each, rows of
 * inner elements) with a {box_inner, box_outer} box, swizzle (default 128-byte), zero fill out of
 * bounds. A refusal by the driver is a real error (cudaErrorInvalidValue, with the CUresult and
 * the arguments on stderr), never "not served". */
static cudaError_t make_map(CUtensorMap *m, const void *base, uint64_t inner, uint64_t outer, uint32_t box_inner,
                            uint32_t box_outer, CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                            uint32_t elem = 2, CUtensorMapSwizzle swz = CU_TENSOR_MAP_SWIZZLE_128B) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (!encode) {
        cudaDriverEntryPointQueryResult q;
        void *fn = nullptr;
        cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
        if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn) return cudaErrorNotSupported;
        encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }
    const cuuint64_t dims[2] = {inner, outer}, strides[1] = {inner * elem};
    const cuuint32_t box[2] = {box_inner, box_outer}, es[2] = {1, 1};
    const CUresult r = encode(m, dtype, 2, const_cast<void *>(base), dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              swz, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r == CUDA_SUCCESS) return cudaSuccess;
    fprintf(stderr, "grouped_gemm: cuTensorMapEncodeTiled refused (CUresult %d): base %p dims {%llu, %llu} box {%u, %u} elem %u\n",
            (int)r, base, (unsigned long long)inner, (unsigned long long)outer, box_inner, box_outer, elem);
    return cudaErrorInvalidValue;
}

template <int KIND, int BN, bool PIPE> static cudaError_t launch_kind(const gg_problem &p, cudaStream_t stream) {
    static int grid = 0; /* set once the attribute is: a failed first call is retried, not launched bare */
    auto fn = kernel<KIND, BN, PIPE>;
    if (!grid) {
        int dev, sms = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        const cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, cfg<BN>::SMEM);
        if (err != cudaSuccess) return err;
        grid = sms;
    }
    CUtensorMap ta, tb;
    const uint64_t Wrows = (uint64_t)p.E * p.out;
    cudaError_t err;
    if (KIND == 0) {
        err = make_map(&ta, p.A, p.in, p.rcap, 64, BM);
        if (err == cudaSuccess) err = make_map(&tb, p.B, p.in, Wrows, 64, BN);
    } else if (KIND == 1) {
        err = make_map(&ta, p.A, p.out, p.rcap, 64, BM);
        if (err == cudaSuccess) err = make_map(&tb, p.B, p.in, Wrows, 64, 64);
    } else {
        err = make_map(&ta, p.A, p.out, p.rcap, 64, 64);
        if (err == cudaSuccess) err = make_map(&tb, p.B, p.in, p.rcap, 64, 64);
    }
    if (err != cudaSuccess) return err;
    fn<<<grid, THREADS, cfg<BN>::SMEM, stream>>>(ta, tb, p);
    return cudaGetLastError();
}

} // namespace v2

/* Launch v2 with a 128 x BN tile (BN 128 or 256) for p on stream; PIPE keeps one k-block of
 * wgmmas in flight (wait_group 1, the previous stage released) instead of waiting for each
 * (wait_group 0). Returns a CUDA error code; GG_NOT_SERVED when a shape is not served
 * (in, out not multiples of BN; rows past 2^31). */
template <int BN, bool PIPE = false> static cudaError_t gg_v2_launch(const gg_problem &p, cudaStream_t stream) {
    if (p.in % BN || p.out % BN || p.out % v2::BM || p.E > GG_MAX_E || p.rcap >= INT32_MAX ||
        (int64_t)p.E * p.out >= INT32_MAX)
        return GG_NOT_SERVED;
    if (p.kind == 0) return v2::launch_kind<0, BN, PIPE>(p, stream);
    if (p.kind == 1) return v2::launch_kind<1, BN, PIPE>(p, stream);
    return v2::launch_kind<2, BN, PIPE>(p, stream);
}
