/* v1: a simple sync-free grouped GEMM (gg_common.cuh's three kinds) on mma.sync.m16n8k16 bf16.
 *
 * CTA tile 128x128x32, 8 warps as 2 (M) x 4 (N), each warp 64x32 (4x4 m16n8 accumulators);
 * operands staged through a 3-stage cp.async pipeline (16-byte copies, rows past a group's end or
 * past its K zero-filled with src-size 0); fragments by ldmatrix (K-major tiles) or ldmatrix.trans
 * (MN-major tiles: the dx B operand, both dW operands), padded rows so that neither conflicts on
 * banks. A persistent grid walks gg_common.cuh's tile list, built in each CTA from offs in device
 * memory: no host sync. Requires in and out multiples of 128.
 * Technique: the mma.sync/ldmatrix fragment layouts of the PTX ISA (warp-level matrix fragments
 * for mma.m16n8k16); the pipeline is the usual cp.async multistage loop.
 */
#pragma once
#include "gg_common.cuh"

namespace v1 {

constexpr int BM = 128, BN = 128, BK = 32, STAGES = 3, THREADS = 256;
constexpr int PK = BK + 8;   /* K-major tile row pitch (elements): [128][PK] */
constexpr int PMN = BM + 8;  /* MN-major tile row pitch: [BK][PMN] */
constexpr int TILE_ELEMS = (BM * PK > BK * PMN) ? BM * PK : BK * PMN;
constexpr int SMEM_BYTES = STAGES * 2 * TILE_ELEMS * 2;

__device__ inline void cp_async16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(gg_smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ inline void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ inline void ldsm_x4(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(gg_smem_u32(p)));
}
__device__ inline void ldsm_x4_t(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(gg_smem_u32(p)));
}
__device__ inline void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Stage one k-block kb of tile t into sA/sB. Kind 0/1 A: K-major [BM][PK] from rows r0+m0+i of
 * A (row stride lda), zero past the group's m_e rows. Kind 2 A: MN-major [BK][PMN], element (k,
 * m) = dy[r0+k0+k, m0+m], zero past m_e. B kind 0: K-major from W_e rows n0+i; kind 1: MN-major
 * (k, n) = W_e[k0+k, n0+n]; kind 2: MN-major (k, n) = x[r0+k0+k, n0+n], zero past m_e. */
template <int KIND>
__device__ inline void load_stage(const gg_problem &p, const gg_tile &t, int kb, bf16 *sA, bf16 *sB) {
    const int tid = threadIdx.x;
    const int64_t k0 = (int64_t)kb * BK, m0 = (int64_t)t.mt * BM, n0 = (int64_t)t.nt * BN;
    const int64_t lda = KIND == 0 ? p.in : p.out;
    const bf16 *We = p.B + (int64_t)t.e * p.out * p.in;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int c = tid + i * THREADS;
        if (KIND != 2) { /* A K-major: 128 rows x 4 chunks */
            const int row = c >> 2, kc = c & 3;
            const bool v = m0 + row < t.me;
            const bf16 *src = v ? p.A + (t.r0 + m0 + row) * lda + k0 + kc * 8 : p.A;
            cp_async16(sA + row * PK + kc * 8, src, v);
        } else { /* A MN-major: 32 k-rows x 16 chunks */
            const int k = c >> 4, mc = c & 15;
            const bool v = k0 + k < t.me;
            const bf16 *src = v ? p.A + (t.r0 + k0 + k) * p.out + m0 + mc * 8 : p.A;
            cp_async16(sA + k * PMN + mc * 8, src, v);
        }
        if (KIND == 0) { /* B K-major */
            const int row = c >> 2, kc = c & 3;
            cp_async16(sB + row * PK + kc * 8, We + (n0 + row) * p.in + k0 + kc * 8, true);
        } else if (KIND == 1) {
            const int k = c >> 4, nc = c & 15;
            cp_async16(sB + k * PMN + nc * 8, We + (k0 + k) * p.in + n0 + nc * 8, true);
        } else {
            const int k = c >> 4, nc = c & 15;
            const bool v = k0 + k < t.me;
            const bf16 *src = v ? p.B + (t.r0 + k0 + k) * p.in + n0 + nc * 8 : p.B;
            cp_async16(sB + k * PMN + nc * 8, src, v);
        }
    }
}

template <int KIND>
__global__ void __launch_bounds__(THREADS) kernel(gg_problem p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ gg_sched sched;
    bf16 *smem = reinterpret_cast<bf16 *>(smem_raw);
    gg_sched_build(sched, p, BM, BN);
    const int total = sched.tile[p.E];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp >> 2, wn = warp & 3;
    constexpr bool AMN = KIND == 2, BMN = KIND != 0;

    for (int ti = blockIdx.x; ti < total; ti += gridDim.x) {
        const gg_tile t = gg_tile_of(sched, p, ti, BN);
        const int nk = KIND == 2 ? (int)((t.me + BK - 1) / BK) : (int)((KIND == 0 ? p.in : p.out) / BK);
        float acc[4][4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;

#pragma unroll
        for (int s = 0; s < STAGES - 1; s++) {
            if (s < nk) load_stage<KIND>(p, t, s, smem + s * 2 * TILE_ELEMS, smem + (s * 2 + 1) * TILE_ELEMS);
            cp_async_commit();
        }
        for (int kb = 0; kb < nk; kb++) {
            cp_async_wait<STAGES - 2>();
            __syncthreads(); /* stage kb landed for all; stage kb-1 is free for everyone */
            const int pf = kb + STAGES - 1;
            if (pf < nk) {
                const int s = pf % STAGES;
                load_stage<KIND>(p, t, pf, smem + s * 2 * TILE_ELEMS, smem + (s * 2 + 1) * TILE_ELEMS);
            }
            cp_async_commit();
            const int s = kb % STAGES;
            const bf16 *sA = smem + s * 2 * TILE_ELEMS, *sB = smem + (s * 2 + 1) * TILE_ELEMS;
#pragma unroll
            for (int kk = 0; kk < BK; kk += 16) {
                uint32_t a[4][4], b[2][4];
#pragma unroll
                for (int mi = 0; mi < 4; mi++) {
                    const int m = wm * 64 + mi * 16;
                    if (!AMN) ldsm_x4(a[mi], sA + (m + (lane & 15)) * PK + kk + (lane >> 4) * 8);
                    else {
                        const int j = lane >> 3, r = lane & 7;
                        ldsm_x4_t(a[mi], sA + (kk + r + (j >> 1) * 8) * PMN + m + (j & 1) * 8);
                    }
                }
#pragma unroll
                for (int nj = 0; nj < 2; nj++) {
                    const int n = wn * 32 + nj * 16, j = lane >> 3, r = lane & 7;
                    if (!BMN) ldsm_x4(b[nj], sB + (n + r + (j >> 1) * 8) * PK + kk + (j & 1) * 8);
                    else ldsm_x4_t(b[nj], sB + (kk + r + (j & 1) * 8) * PMN + n + (j >> 1) * 8);
                }
#pragma unroll
                for (int mi = 0; mi < 4; mi++)
#pragma unroll
                    for (int ni = 0; ni < 4; ni++)
                        mma16816(acc[mi][ni], a[mi], b[ni >> 1][(ni & 1) * 2], b[ni >> 1][(ni & 1) * 2 + 1]);
            }
        }
        cp_async_wait<0>();
        __syncthreads(); /* every warp is done with the stages before the next tile refills them */

        /* epilogue: C fragment (row lane/4 [+8], cols 2*(lane%4)+{0,1}) per m16n8 block */
        const int64_t mlim = KIND == 2 ? p.out : t.me;
        if (KIND == 2 && nk == 0 && p.beta == 1.0f) continue;
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const int64_t row = (int64_t)t.mt * BM + wm * 64 + mi * 16 + (lane >> 2);
                const int64_t col = (int64_t)t.nt * BN + wn * 32 + ni * 8 + (lane & 3) * 2;
                if (row < mlim) gg_store2(gg_c_ptr(p, t, row, col), acc[mi][ni][0], acc[mi][ni][1], p.beta);
                if (row + 8 < mlim) gg_store2(gg_c_ptr(p, t, row + 8, col), acc[mi][ni][2], acc[mi][ni][3], p.beta);
            }
    }
}

} // namespace v1

/* Launch v1 for p on stream (a persistent grid of SMs x resident CTAs). Returns a CUDA error code;
 * GG_NOT_SERVED for a shape it does not serve (in, out not multiples of 128; E > GG_MAX_E). */
static cudaError_t gg_v1_launch(const gg_problem &p, cudaStream_t stream) {
    static int grid[3] = {0, 0, 0};
    if (p.in % v1::BM || p.out % v1::BM || p.E > GG_MAX_E) return GG_NOT_SERVED;
    const void *fn = p.kind == 0 ? (const void *)v1::kernel<0> : p.kind == 1 ? (const void *)v1::kernel<1>
                                                                           : (const void *)v1::kernel<2>;
    if (!grid[p.kind]) {
        int dev, sms, per;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, v1::SMEM_BYTES);
        if (err != cudaSuccess) return err;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, fn, v1::THREADS, v1::SMEM_BYTES);
        grid[p.kind] = sms * (per > 0 ? per : 1);
    }
    if (p.kind == 0) v1::kernel<0><<<grid[0], v1::THREADS, v1::SMEM_BYTES, stream>>>(p);
    else if (p.kind == 1) v1::kernel<1><<<grid[1], v1::THREADS, v1::SMEM_BYTES, stream>>>(p);
    else v1::kernel<2><<<grid[2], v1::THREADS, v1::SMEM_BYTES, stream>>>(p);
    return cudaGetLastError();
}
