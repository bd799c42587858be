/* Our grouped expert GEMM for Hopper (gg_sm90.h): the kernel lab's v4 (dev/cuda/grouped_gemm,
 * v4_pingpong.cuh, validated and timed there on the H200: bench/RESULTS.md, session 7), promoted.
 *
 * CTA: 3 warpgroups (384 threads), one CTA per SM, persistent over a tile list of 128 x 128 tiles
 * that every CTA builds in shared memory from offs (the expert offsets, read from memory the
 * device reads: no host sync). Warpgroup 2 is the producer: one thread issues
 * cp.async.bulk.tensor loads (128-byte swizzle) into a ring of STAGES stages, each with a "full"
 * mbarrier (expect-tx bytes) and an "empty" one (one arrival per consumer warp), in the CTA's
 * tile order. Warpgroups 0 and 1 are ping-pong consumers (CUTLASS's sm90 "pingpong" schedule):
 * each computes a whole tile (two wgmma.m64n128k16 per k16 step, fp32 accumulators in registers,
 * one k-block of wgmmas in flight), warpgroup 0 the CTA's even tiles and 1 its odd ones, so one
 * warpgroup's epilogue runs while the other's MMAs do. A warpgroup starts a tile's mainloop only
 * after the other has passed every "full" wait of the previous tile (the "order" mbarriers: a
 * parity wait cannot tell a phase two ahead from the one before; the lab's v4_protocol_sim.py
 * shows the failure without them). setmaxnreg moves registers from the producer to the consumers.
 *
 * Epilogue: with beta != 0 the producer loads the tile's old C by TMA into the consumer's 32 KB C
 * buffer during the tile's MMAs; the consumer writes beta C + acc as bf16 into that swizzled
 * buffer and one thread stores it with two asynchronous TMA stores (full 128-byte lines). A
 * group's last, partial m-tile in fwd / dx stores from registers with the row mask (a TMA store
 * would write the next expert's rows); dW tiles are always whole.
 *
 * As GEMMs C[M,N] = sum_k A[m,k] B[n,k] per expert:
 *   kind 0: M = m_e, N = out, K = in;  A = x  (K-major),  B = W_e (K-major)
 *   kind 1: M = m_e, N = in,  K = out; A = dy (K-major),  B = W_e (MN-major: [K=out][N=in])
 *   kind 2: M = out, N = in,  K = m_e; A = dy (MN-major: [K=rows][M=out]), B = x (MN-major)
 * K-major tiles are one TMA box {64 k, rows} (128 B per row, 8-row 1024-byte swizzle atoms;
 * descriptor SBO 1024, k16 step +32 B); MN-major tiles are boxes {64 mn, 64 k} per 64 columns
 * (descriptor with the transpose bit, LBO 8192 B between 64-column chunks, SBO 1024 B between
 * 8-row k groups, k16 step +2048 B). kind 2's K is the expert's rows: the last stage's rows past
 * its end (another expert's rows, or rows past rcap, which TMA fills with zeros) are zeroed in
 * shared memory by the consumer before the wgmma (fence.proxy.async, then a warpgroup barrier).
 *
 * Shared memory: 4 stages of 32 KB + 2 C buffers of 32 KB = 192 KB (+ 1 KB alignment, the tile list).
 * Techniques learned from the public CUTLASS sm90 collective mainloop and pingpong kernel (TMA +
 * mbarrier pipeline, warp-specialized producer/consumer, the GMMA descriptor's canonical layouts,
 * the TMA epilogue) and DeepGEMM's sm90 kernels (persistent grouped scheduling); the code is our
 * own. Compiled for sm_90a only (wgmma and setmaxnreg need the arch-specific target); elsewhere
 * the kernel body traps and fm_gg_sm90_device_ok answers false. */
#include "gg_sm90.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include "sm90_common.cuh"
#include "wgmma_bf16.cuh"

namespace {

typedef __nv_bfloat16 bf16;

constexpr int MAX_E = 256;
constexpr int BM = 128, BN = 128, BK = 64, THREADS = 384, STAGES = 4;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int C_BYTES = BM * BN * 2, C_BOX = 64 * BM * 2; /* a C buffer; one {64, 128} box of it */
constexpr int SMEM = STAGES * STAGE_BYTES + 2 * C_BYTES + 1024; /* + room to align to 1024 */
constexpr uint32_t CHUNK = 64 * 128;                            /* bytes of one {64, 64} box */

/* The tile list: offs copied to shared memory and the tile prefix over experts. */
struct sched {
    int64_t offs[MAX_E + 1];
    int tile[MAX_E + 1];
};

__host__ __device__ inline int64_t ndim(const fm_gg_problem &p) { return p.kind == 0 ? p.out : p.in; }

/* Tiles of expert e with m_e rows: kinds 0/1 ceil(m_e/BM) x N/BN; kind 2 out/BM x N/BN, none when
 * m_e == 0 and beta == 1 (dW_e is left as it is). */
__device__ inline int expert_tiles(const fm_gg_problem &p, int64_t me) {
    const int ntn = (int)(ndim(p) / BN);
    if (p.kind == 2) return (me == 0 && p.beta == 1.0f) ? 0 : (int)(p.out / BM) * ntn;
    return (int)((me + BM - 1) / BM) * ntn;
}

__device__ inline void sched_build(sched &s, const fm_gg_problem &p) {
    for (int i = threadIdx.x; i <= p.E; i += blockDim.x) s.offs[i] = p.offs[i];
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        s.tile[0] = 0;
        for (int e = 0; e < p.E; e++) {
            acc += expert_tiles(p, s.offs[e + 1] - s.offs[e]);
            s.tile[e + 1] = acc;
        }
    }
    __syncthreads();
}

struct tile {
    int e, mt, nt;
    int64_t r0, me; /* the expert's first row and rows */
};

/* Tile t (< s.tile[E]) as expert e, m-tile mt, n-tile nt (n fastest, so CTAs running at the same
 * time share the A rows and W_e). Binary search on the prefix (empty experts have equal ones). */
__device__ inline tile tile_of(const sched &s, const fm_gg_problem &p, int t) {
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

__device__ inline bf16 *c_ptr(const fm_gg_problem &p, const tile &t, int64_t row, int64_t col) {
    bf16 *C = static_cast<bf16 *>(p.C);
    if (p.kind == 0) return C + (t.r0 + row) * p.out + col;
    if (p.kind == 1) return C + (t.r0 + row) * p.in + col;
    return C + (int64_t)t.e * p.out * p.in + row * p.in + col;
}

/* k-blocks of a tile: kinds 0/1 K/BK, kind 2 ceil(m_e/BK). */
template <int KIND> __device__ inline int nk_of(const fm_gg_problem &p, const tile &t) {
    return KIND == 2 ? (int)((t.me + BK - 1) / BK) : (int)((KIND == 0 ? p.in : p.out) / BK);
}
/* the tile's first row in C's tensor map (kinds 0/1: [rcap, N]; kind 2: [E*out, in]) */
__device__ inline int c_row(const fm_gg_problem &p, const tile &t) {
    return p.kind == 2 ? (int)(t.e * p.out) + t.mt * BM : (int)t.r0 + t.mt * BM;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* the consumer warpgroup wg's named barrier (ids 2, 3; 0 is __syncthreads) */
__device__ inline void wg_bar(int wg) {
    if (wg == 0) asm volatile("bar.sync 2, 128;\n" ::: "memory");
    else asm volatile("bar.sync 3, 128;\n" ::: "memory");
}
#endif

/* SRC: beta != 0 for kinds 1, 2 (the old C comes by TMA); kind 0 never reads C. */
template <int KIND, bool SRC>
__global__ void __launch_bounds__(THREADS, 1)
gg_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
          const __grid_constant__ CUtensorMap tmC, fm_gg_problem p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool AMN = KIND == 2, BMN = KIND != 0;
    extern __shared__ uint8_t smem_raw[];
    __shared__ sched sc;
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES], cfull[2], cempty[2], order[2];
    const uint32_t smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
    uint8_t *smem_ptr = smem_raw + (smem - smem_u32(smem_raw));
    const uint32_t cbuf0 = smem + STAGES * STAGE_BYTES; /* C buffer of warpgroup w: cbuf0 + w * C_BYTES */

    sched_build(sc, p);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mbar_init(&full[s], 1), mbar_init(&empty[s], 4);
        for (int w = 0; w < 2; w++) mbar_init(&cfull[w], 1), mbar_init(&cempty[w], 1), mbar_init(&order[w], 4);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int total = sc.tile[p.E], wg = threadIdx.x / 128;
    const float beta = KIND == 0 ? 0.0f : p.beta;

    if (wg == 2) { /* producer: the tiles' k-blocks in order, and (SRC) each tile's old C after them */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x != 256) return;
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmA)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmB)) : "memory");
        if (SRC) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmC)) : "memory");
        uint32_t it = 0, cn0 = 0, cn1 = 0; /* old-C loads so far per warpgroup */
        int j = 0;
        for (int ti = blockIdx.x; ti < total; ti += gridDim.x, j ^= 1) {
            const tile t = tile_of(sc, p, ti);
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
                const int cr = c_row(p, t);
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
        const tile t = tile_of(sc, p, ti);
        const int nk = nk_of<KIND>(p, t);
        if (j != wg) { /* the other warpgroup's tile: skip its stages */
            it += nk;
            continue;
        }
        /* Mainloop order: start only after the other warpgroup has passed every "full" wait of
         * the CTA's previous tile. Signal n to order[w] is the end of the other warpgroup's n-th
         * mainloop: warpgroup 1's k-th tile waits signal k, warpgroup 0's k-th (k >= 1) k - 1. */
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
                        uint8_t *base = smem_ptr + s * STAGE_BYTES +
                                        (c < BM / 64 ? c * CHUNK : A_BYTES + (c - BM / 64) * CHUNK);
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
        const bool tma_tile = KIND == 2 || (int64_t)(t.mt + 1) * BM <= t.me;
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
#pragma unroll
                for (int jj = 0; jj < BN / 8; jj++) {
                    const uint32_t off =
                        (jj >> 3) * C_BOX + r * 128 + (((jj & 7) ^ (lane >> 2)) << 4) + (lane & 3) * 4;
                    __nv_bfloat162 *q = reinterpret_cast<__nv_bfloat162 *>(cb_ptr + off);
                    float v0 = acc[h][4 * jj + 2 * r8], v1 = acc[h][4 * jj + 2 * r8 + 1];
                    if (SRC) {
                        const float2 old = __bfloat1622float2(*q);
                        v0 += beta * old.x, v1 += beta * old.y;
                    }
                    const __nv_bfloat162 o = __floats2bfloat162_rn(v0, v1);
                    if (tma_tile) *q = o;
                    else if (grow < mlim)
                        *reinterpret_cast<__nv_bfloat162 *>(c_ptr(p, t, grow, (int64_t)t.nt * BN + jj * 8 + (lane & 3) * 2)) = o;
                }
            }
        if (tma_tile) {
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* our writes, then the TMA's reads */
            wg_bar(wg);
            if (tid == 0) {
                const int cr = c_row(p, t), n0 = t.nt * BN;
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
#else
    __trap(); /* built without sm_90a: fm_gg_sm90_device_ok keeps callers away */
#endif
}

/* A 2-D tensor map over a row-major bf16 [outer, inner] tensor with a {box_inner, box_outer} box,
 * 128-byte swizzle, zeros out of bounds (sm90_common.cuh). */
cudaError_t make_map(CUtensorMap *m, const void *base, uint64_t inner, uint64_t outer, uint32_t box_inner,
                     uint32_t box_outer) {
    return sm90_make_map(m, base, inner, outer, box_inner, box_outer, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                         CU_TENSOR_MAP_SWIZZLE_128B);
}

template <int KIND, bool SRC> cudaError_t launch_kind(const fm_gg_problem &p, int sm_count, cudaStream_t stream) {
    static bool attr = false; /* set once the attribute is: a failed first call is retried */
    auto fn = gg_kernel<KIND, SRC>;
    if (!attr) {
        const cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
        if (err != cudaSuccess) return err;
        attr = true;
    }
    CUtensorMap ta, tb, tc;
    const uint64_t wrows = (uint64_t)p.E * (uint64_t)p.out, rc = (uint64_t)p.rcap;
    const uint64_t in = (uint64_t)p.in, out = (uint64_t)p.out;
    cudaError_t err;
    if (KIND == 0) {
        err = make_map(&ta, p.A, in, rc, 64, BM);
        if (err == cudaSuccess) err = make_map(&tb, p.B, in, wrows, 64, BN);
        if (err == cudaSuccess) err = make_map(&tc, p.C, out, rc, 64, BM);
    } else if (KIND == 1) {
        err = make_map(&ta, p.A, out, rc, 64, BM);
        if (err == cudaSuccess) err = make_map(&tb, p.B, in, wrows, 64, 64);
        if (err == cudaSuccess) err = make_map(&tc, p.C, in, rc, 64, BM);
    } else {
        err = make_map(&ta, p.A, out, rc, 64, 64);
        if (err == cudaSuccess) err = make_map(&tb, p.B, in, rc, 64, 64);
        if (err == cudaSuccess) err = make_map(&tc, p.C, in, wrows, 64, BM);
    }
    if (err != cudaSuccess) return err;
    fn<<<sm_count, THREADS, SMEM, stream>>>(ta, tb, tc, p);
    return cudaGetLastError();
}

} // namespace

extern "C" {

bool fm_gg_sm90_serves(int64_t E, int64_t in, int64_t out, int64_t rcap) {
    return E >= 1 && E <= MAX_E && in >= BN && out >= BM && in % BN == 0 && out % BM == 0 && rcap >= 0 &&
           rcap < INT32_MAX && E * out < INT32_MAX;
}

bool fm_gg_sm90_device_ok(int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return major == 9 && minor == 0;
}

cudaError_t fm_gg_sm90_launch(const fm_gg_problem *p, int sm_count, cudaStream_t stream) {
    if (!p || !fm_gg_sm90_serves(p->E, p->in, p->out, p->rcap) || p->kind < 0 || p->kind > 2 || sm_count < 1)
        return cudaErrorInvalidValue;
    if (p->rcap == 0) return cudaSuccess;
    const bool src = p->kind != 0 && p->beta != 0.0f;
    if (p->kind == 0) return launch_kind<0, false>(*p, sm_count, stream);
    if (p->kind == 1) return src ? launch_kind<1, true>(*p, sm_count, stream) : launch_kind<1, false>(*p, sm_count, stream);
    return src ? launch_kind<2, true>(*p, sm_count, stream) : launch_kind<2, false>(*p, sm_count, stream);
}

} /* extern "C" */
