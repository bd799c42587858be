/* The helpers of the CUDA dense-op tests, test_cuda_dense.c and test_cuda_layers.c (one executable
 * each: the globals below are each test's own): the backend, the random inputs, device buffers
 * through the backend's memory ops, the error checks and the finite differences.
 *
 * Inputs are drawn in fp32 from a fixed, printed seed and rounded to bf16 before the reference
 * sees them, so reference and GPU read the same values. Outputs are poisoned (NaN) before each
 * call, so an unwritten element fails. Backward ops are also checked against central finite
 * differences of the fp64 reference forward (as tests/test_ops_cpu.c does), for every input
 * with a gradient. Error measure: gt_nerr (normalized L2, gpu_test.h); tolerances by output
 * dtype: GT_TOL_BF16 (1e-2) for bf16 outputs, GT_TOL_F32 (1e-4) or tighter for fp32 ones. Every
 * bf16 output is also checked element by element in bf16 ulps of the fp64 reference
 * (gt_bf16_ulps), with the limit stated per op next to its check (ULPS_*, below).
 * Ops that are exact by definition (copies, one rounding of an fp32 sum, conversions) are
 * checked bit for bit.
 */
#ifndef FM_GPU_DENSE_TEST_H
#define FM_GPU_DENSE_TEST_H

#include "backend/cuda/fm_backend_cuda.h"
#include "core/fm_rng.h"
#include "fm_ref_ops.h"
#include "gpu_test.h"
#include "fm_test_fd.h"

#include <float.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static fm_backend g_be;
static const fm_ops *OPS;
static void *CTX;
static fm_rng g_rng;

/* ---- host helpers ---------------------------------------------------------------------------- */

static inline double rnd_normal(void) { return fm_rng_normal(&g_rng); }
static inline double rnd_uniform(double lo, double hi) { return lo + (hi - lo) * fm_rng_uniform_d(&g_rng); }
static inline void fill_normal(float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * rnd_normal());
}
static inline void fill_uniform(float *x, int64_t n, double lo, double hi) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)rnd_uniform(lo, hi);
}
/* fill_normal, then rounded to bf16 values (what the device will hold). */
static inline void fill_normal_bf(float *x, int64_t n, double scale) {
    fill_normal(x, n, scale);
    gt_round_bf16(x, n);
}
static inline void fill_const(float *x, int64_t n, float c) {
    for (int64_t i = 0; i < n; i++) x[i] = c;
}
static inline void to_d(double *d, const float *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = f[i];
}
static inline bool same_bits(const void *a, const void *b, size_t bytes) { return memcmp(a, b, bytes) == 0; }

#define CHECK_ERR(what, err, tol) \
    CHECK_MSG((err) <= (tol), "%s: normalized error %.3g > tol %.3g", (what), (double)(err), (double)(tol))

/* bf16 ulp limits (gpu_test.h's gt_bf16_ulps against the fp64 reference rounded to bf16). An op
 * that forms an fp32 result f with |f - ref| well below half a bf16 ulp and rounds it once lands
 * on the rounded reference or, where ref lies near a rounding boundary (f and ref on either side
 * of it), on its neighbour: 1 ulp. Sums and differences (GEMMs, reductions, RMSNorm's dx, RoPE)
 * can cancel to values far below their terms, where a relative measure means nothing: those are
 * measured with a floor of rms(ref)/64 (errors below it in ulps of the floor), and where the fp32
 * accumulation of long sums (K up to 517, 1667 tokens per embedding row) or a second rounding
 * (embedding_bwd in token chunks; beta*C added to a bf16 C) can add up to another half ulp, the
 * limit is 2. */
#define ULPS_ELEMENTWISE 1 /* add, swiglu, rmsnorm_fwd out, rope, adamw's bf16 weights: one rounding */
#define ULPS_REDUCTION 2   /* gemm and expert GEMMs (bf16 C), embedding_bwd, rmsnorm_bwd dx/dw, dgate */

/* ---- device helpers (through the backend's memory ops) --------------------------------------- */

static inline void *up_act(const float *x, int64_t n) { return gt_upload(&g_be, x, n, FM_DTYPE_BF16); }
static inline void *up_f32(const float *x, int64_t n) { return gt_upload(&g_be, x, n, FM_DTYPE_F32); }
static inline void *up_i32(const int32_t *x, int64_t n) {
    void *d = OPS->mem_alloc(CTX, (size_t)(n > 0 ? n : 1) * 4 + 256);
    FM_ASSERT(d);
    if (n) OPS->copy(CTX, d, x, (size_t)n * 4, FM_COPY_H2D);
    return d;
}
/* n elements of NaN (bf16 or fp32). */
static inline void *up_nan(int64_t n, fm_dtype t) {
    float *h = fnew(n);
    fill_const(h, n, NAN);
    void *d = gt_upload(&g_be, h, n, t);
    free(h);
    return d;
}
static inline void down_act(float *x, const void *d, int64_t n) { gt_download(&g_be, x, d, n, FM_DTYPE_BF16); }
static inline void down_f32(float *x, const void *d, int64_t n) { gt_download(&g_be, x, d, n, FM_DTYPE_F32); }
static inline void *down_raw(const void *d, size_t bytes) {
    void *h = malloc(bytes ? bytes : 1);
    FM_ASSERT(h);
    if (bytes) OPS->copy(CTX, h, d, bytes, FM_COPY_D2H);
    return h;
}
static inline void dfree(void *d) { OPS->mem_free(CTX, d); }
/* The element one past p (a bf16 pointer that is not 16-byte aligned: the kernels' scalar path). */
static inline void *off1(void *p) { return (uint16_t *)p + 1; }

/* ---- finite differences (tests/test_ops_cpu.c's scheme, bf16 tolerances) -------------------- */

/* A direction averages the bf16 rounding noise of many elements, but with as few as 16 elements
 * only by a factor ~3: 0.25 (CPU test: 0.1) still sees a 1% error in every element. */
static const double FD_DIR_TOL_FACTOR = 0.25;

/* fm_fd_check (fm_test_fd.h) on g_rng, floor 0, directions at tol * FD_DIR_TOL_FACTOR. */
static inline void fd_check(const char *what, objective_fn f, void *st, double *x, int64_t n, const double *grad,
                            double tol) {
    fm_fd_check(what, f, st, x, n, grad, tol, 0.0, FD_H, FD_DIR_TOL_FACTOR, &g_rng);
}

/* Seconds on the monotonic clock. */
static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}


/* The CUDA backend on device 0 (g_be, OPS, CTX), checked to be "cuda"; false, with a failed
 * check and the reason on stderr, when it cannot be made. */
static inline bool dense_test_backend(void) {
    fm_status s = gt_cuda_init(&g_be, 0, 128, 0);
    if (s != FM_OK) {
        fprintf(stderr, "cannot create the CUDA backend: %s: %s\n", fm_status_name(s), fm_errmsg());
        CHECK(s == FM_OK);
        return false;
    }
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK(strcmp(OPS->name, "cuda") == 0);
    return true;
}

#endif
