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

typedef double (*objective_fn)(void *state);
enum { FD_ELEMS = 24, FD_DIRS = 3 };
static const double FD_H = 1e-6;
/* A direction averages the bf16 rounding noise of many elements, but with as few as 16 elements
 * only by a factor ~3: 0.25 (CPU test: 0.1) still sees a 1% error in every element. */
static const double FD_DIR_TOL_FACTOR = 0.25;

/* `grad` (the op's gradient w.r.t. x, n elements) against central differences of the fp64
 * objective f, which reads x (perturbed in place and restored): on FD_ELEMS random elements
 * (error normalized by max|grad|), then on FD_DIRS random directions (tolerance
 * tol * FD_DIR_TOL_FACTOR: a direction averages the bf16 rounding noise of many elements). */
static inline void fd_check(const char *what, objective_fn f, void *st, double *x, int64_t n, const double *grad,
                            double tol) {
    double gmax = 1e-12;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(grad[i])) {
            CHECK_MSG(0, "%s: gradient element %lld is %g", what, (long long)i, grad[i]);
            return;
        }
        gmax = fabs(grad[i]) > gmax ? fabs(grad[i]) : gmax;
    }
    double worst = 0, worst_fd = 0;
    int64_t worst_i = -1;
    const int64_t ne = n <= FD_ELEMS ? n : FD_ELEMS;
    for (int64_t s = 0; s < ne; s++) {
        const int64_t i = n <= FD_ELEMS ? s : (int64_t)fm_rng_below(&g_rng, (uint64_t)n);
        const double x0 = x[i];
        x[i] = x0 + FD_H;
        const double fp = f(st);
        x[i] = x0 - FD_H;
        const double fm = f(st);
        x[i] = x0;
        const double fd = (fp - fm) / (2 * FD_H);
        const double e = fabs(fd - grad[i]) / (gmax > fabs(fd) ? gmax : fabs(fd));
        if (e > worst) worst = e, worst_i = i, worst_fd = fd;
    }
    CHECK_MSG(worst <= tol, "%s: element %lld: op %.9g vs finite difference %.9g (nerr %.3g > %.3g)", what,
              (long long)worst_i, worst_i >= 0 ? grad[worst_i] : 0.0, worst_fd, worst, tol);
    double *x0 = dnew(n), *u = dnew(n);
    memcpy(x0, x, (size_t)n * sizeof(double));
    for (int d = 0; d < FD_DIRS; d++) {
        double an = 0, mag = 1e-300;
        for (int64_t i = 0; i < n; i++) {
            u[i] = rnd_normal();
            an += grad[i] * u[i];
            mag += fabs(grad[i] * u[i]);
        }
        for (int64_t i = 0; i < n; i++) x[i] = x0[i] + FD_H * u[i];
        const double fp = f(st);
        for (int64_t i = 0; i < n; i++) x[i] = x0[i] - FD_H * u[i];
        const double fm = f(st);
        memcpy(x, x0, (size_t)n * sizeof(double));
        const double fd = (fp - fm) / (2 * FD_H), e = fabs(fd - an) / mag, dtol = tol * FD_DIR_TOL_FACTOR;
        CHECK_MSG(e <= dtol, "%s: direction %d: <grad,u> %.9g vs finite difference %.9g (nerr %.3g > %.3g)", what,
                  d, an, fd, e, dtol);
    }
    free(x0);
    free(u);
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
