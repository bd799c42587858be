/* A backend whose gemm gives each output element the same bits whatever the call's shape: for
 * the tests that claim bit-identity between two paths that group the same rows differently (a
 * chunked operator and its plain twin, expert parallelism and one rank).
 *
 * Why: OpenBLAS's sgemm kernels differ by processor (OPENBLAS_CORETYPE), and some of them
 * (Haswell, Zen: AVX2) compute a row's dot products differently depending on where the row falls
 * in the kernel's M tiling (full tile or tail), so the same row gives other bits when a chunk
 * holds fewer rows; others (SkylakeX, Sandybridge) happen not to. Measured on an AMD EPYC and on
 * an AVX-512 Xeon with OPENBLAS_CORETYPE=Haswell (issue 24). A bit-identity that holds on one
 * kernel and not another is not a property of our code, so such a test runs its two paths through
 * this gemm, where it holds by construction: C[i,j] = alpha * sum_p A[i,p] B[p,j] (+ beta C[i,j]),
 * the sum in fp32 in ascending p, one element at a time, no threads. The same paths through the
 * real BLAS are then compared at a tolerance the test derives.
 *
 * fm_test_backend_fixed_gemm: dst = src with its op table copied into *ops and ops->gemm replaced
 * (src's context and every other op unchanged; a backend whose expert_linear_fwd/bwd bypass gemm
 * keeps them, so this is for the CPU backend, where they are NULL and the experts loop over gemm;
 * asserted). fm_act is fp32 here (the CPU build). */
#ifndef FM_TEST_FIXED_GEMM_H
#define FM_TEST_FIXED_GEMM_H
#include <stdbool.h>
#include <stdint.h>

#include "backend/fm_backend.h"
#include "core/fm_core.h"

static void fm_test_fixed_gemm(void *ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                               const fm_act *A, int64_t lda, const fm_act *B, int64_t ldb, float beta, void *C,
                               fm_dtype c_type, int64_t ldc) {
    (void)ctx;
    FM_ASSERT(c_type == FM_DTYPE_F32 && sizeof(fm_act) == sizeof(float));
    float *c = C;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            float s = 0.0f;
            for (int64_t p = 0; p < K; p++) {
                const float a = trans_a ? A[p * lda + i] : A[i * lda + p];
                const float b = trans_b ? B[j * ldb + p] : B[p * ldb + j];
                s += a * b;
            }
            /* beta == 0: C is not read (it may hold NaN paint), as BLAS does */
            c[i * ldc + j] = beta == 0.0f ? alpha * s : alpha * s + beta * c[i * ldc + j];
        }
}

static inline fm_backend fm_test_backend_fixed_gemm(const fm_backend *src, fm_ops *ops) {
    FM_ASSERT(!src->ops->expert_linear_fwd && !src->ops->expert_linear_bwd);
    *ops = *src->ops;
    ops->gemm = fm_test_fixed_gemm;
    fm_backend b = {ops, src->ctx};
    return b;
}
#endif
