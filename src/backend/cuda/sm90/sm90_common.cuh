/* PTX helpers and tensor maps shared by our sm_90a kernels (gg_sm90.cu, the bf16 grouped GEMM;
 * gg_sm90_fp8.cu, the FP8 one): mbarriers, TMA loads and stores, the wgmma shared-memory
 * descriptor (128-byte swizzle), and cuTensorMapEncodeTiled through the runtime's driver entry
 * point (no -lcuda). Internal to src/backend/cuda/sm90 (an anonymous namespace in each file that
 * includes it); the device helpers exist only when compiled for sm_90a. PTX: the PTX ISA 8.x
 * (mbarrier, cp.async.bulk.tensor, wgmma descriptors), as the public CUTLASS sm90 collectives use
 * it; the code is our own. */
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

__device__ inline uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ inline void mbar_init(uint64_t *b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(count));
}
__device__ inline void mbar_wait(uint64_t *b, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_u32(b)), "r"(parity)
                     : "memory");
    } while (!done);
}
__device__ inline void mbar_expect_tx(uint64_t *b, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ inline void mbar_arrive(uint64_t *b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
__device__ inline void tma_2d(uint32_t dst, const CUtensorMap *m, uint64_t *bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            dst),
        "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
        : "memory");
}
__device__ inline void tma_store_2d(const CUtensorMap *m, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                     reinterpret_cast<uint64_t>(m)),
                 "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ inline void bulk_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ inline void bulk_wait0() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
/* sm90 shared-memory matrix descriptor: start >> 4 [0,14), LBO >> 4 [16,30), SBO >> 4 [32,46),
 * layout type [62,64) = 1 (128-byte swizzle). */
__device__ inline uint64_t sdesc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (1ull << 62);
}
template <int N> __device__ inline void acc_fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
#endif

/* cuTensorMapEncodeTiled from the driver (no -lcuda); NULL when the driver has none. The lookup
 * runs once (a function-local static: thread-safe initialization, the same for every device). */
inline PFN_cuTensorMapEncodeTiled_v12000 sm90_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
        cudaDriverEntryPointQueryResult q;
        void *f = nullptr;
        const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
        if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || !f) {
            (void)cudaGetLastError();
            return nullptr;
        }
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
    }();
    return fn;
}

/* A 2-D tensor map over a row-major [outer, inner] tensor (rows of inner elements of elem bytes)
 * with a {box_inner, box_outer} box and the given swizzle, zeros out of bounds. Returns
 * cudaErrorNotSupported without the driver entry point, cudaErrorInvalidValue when the driver
 * refuses the map (a misaligned base or stride, a box over 256). */
inline cudaError_t sm90_make_map(CUtensorMap *m, const void *base, uint64_t inner, uint64_t outer, uint32_t box_inner,
                                 uint32_t box_outer, CUtensorMapDataType dtype, uint32_t elem, CUtensorMapSwizzle swz) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = sm90_encoder();
    if (!encode) return cudaErrorNotSupported;
    const cuuint64_t dims[2] = {inner, outer}, strides[1] = {inner * elem};
    const cuuint32_t box[2] = {box_inner, box_outer}, es[2] = {1, 1};
    const CUresult r = encode(m, dtype, 2, const_cast<void *>(base), dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              swz, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

} // namespace
