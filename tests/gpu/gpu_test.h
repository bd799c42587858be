/* Helpers for the CUDA op tests (compiled with FM_ACT_BF16): host bf16 <-> fp32, device buffers
 * through the backend's memory ops, and the normalized error of a result against a reference.
 * Tests build inputs in fp32 on the host, round them to bf16 (so the reference sees exactly the
 * values the GPU sees), run the op, and compare against an fp64 host reference (tests/fm_ref_ops.h,
 * shared with the CPU tests): by normalized error, and bf16 outputs element by element in ulps. */
#ifndef FM_GPU_TEST_H
#define FM_GPU_TEST_H
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/fm_backend_cuda.h"
#include "backend/fm_backend.h"
#include "core/fm_core.h"
#include "fm_test.h"

/* A CUDA backend on `device` for the tests: the default options with the FLATMOE_* variables
 * applied as the CLI applies them (each fm_backend_opts_vars value through fm_backend_opts_set:
 * FLATMOE_EXPERT_GEMM, FLATMOE_ATTENTION_VERBOSE, ...; the library reads no environment, a test
 * may), head_dim <= max_head_dim and a cuDNN workspace of `workspace` bytes (0: 64 MiB). Errors:
 * those of fm_backend_opts_set and fm_cuda_backend_init. */
static inline fm_status gt_cuda_init(fm_backend *b, int device, int64_t max_head_dim, size_t workspace) {
    fm_backend_opts o = fm_backend_opts_default();
    for (int i = 0; fm_backend_opts_vars[i]; i++)
        FM_TRY(fm_backend_opts_set(&o, fm_backend_opts_vars[i], getenv(fm_backend_opts_vars[i])));
    o.max_head_dim = max_head_dim;
    o.gpu_workspace = workspace;
    return fm_cuda_backend_init(b, device, &o);
}

static inline uint16_t gt_f32_to_bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float gt_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* Rounds x[0..n) to bf16 values in place (fp32 storage). */
static inline void gt_round_bf16(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = gt_bf16_to_f32(gt_f32_to_bf16(x[i]));
}
/* Device copy of n fp32 values as bf16 (act) or fp32. */
static inline void *gt_upload(const fm_backend *be, const float *x, int64_t n, fm_dtype t) {
    void *d = be->ops->mem_alloc(be->ctx, (size_t)n * fm_dtype_size(t) + 256);
    if (t == FM_DTYPE_F32) be->ops->copy(be->ctx, d, x, (size_t)n * 4, FM_COPY_H2D);
    else {
        uint16_t *h = fm_malloc((size_t)n * 2 + 2);
        for (int64_t i = 0; i < n; i++) h[i] = gt_f32_to_bf16(x[i]);
        be->ops->copy(be->ctx, d, h, (size_t)n * 2, FM_COPY_H2D);
        fm_free(h);
    }
    return d;
}
static inline void gt_download(const fm_backend *be, float *x, const void *d, int64_t n, fm_dtype t) {
    if (t == FM_DTYPE_F32) be->ops->copy(be->ctx, x, d, (size_t)n * 4, FM_COPY_D2H);
    else {
        uint16_t *h = fm_malloc((size_t)n * 2 + 2);
        be->ops->copy(be->ctx, h, d, (size_t)n * 2, FM_COPY_D2H);
        for (int64_t i = 0; i < n; i++) x[i] = gt_bf16_to_f32(h[i]);
        fm_free(h);
    }
}
/* Device doubles for the ops' reductions (sumsq, router_stats' lse_sq, cross_entropy's sum,
 * lce_finalize's sums, router_loss_terms): n of them, zero-filled (mem_alloc). */
static inline double *gt_dev_f64(const fm_backend *be, int64_t n) {
    double *d = be->ops->mem_alloc(be->ctx, (size_t)(n > 0 ? n : 1) * sizeof(double));
    FM_ASSERT(d != NULL);
    return d;
}
/* h[0..n) = the device doubles d[0..n), read at a named sync point: stream_sync of the compute
 * stream (the ops' results are valid after it), then a synchronous copy. gt_read_f64: one. */
static inline void gt_read_f64s(const fm_backend *be, double *h, const double *d, int64_t n) {
    be->ops->stream_sync(be->ctx, FM_STREAM_COMPUTE);
    be->ops->copy(be->ctx, h, d, (size_t)n * sizeof(double), FM_COPY_D2H);
}
static inline double gt_read_f64(const fm_backend *be, const double *d) {
    double v = 0;
    gt_read_f64s(be, &v, d, 1);
    return v;
}
/* Stores v into the device double d (a synchronous copy). */
static inline void gt_write_f64(const fm_backend *be, double *d, double v) {
    be->ops->copy(be->ctx, d, &v, sizeof v, FM_COPY_H2D);
}
/* Checks the backend's sticky status after a sync (no device error so far). */
#define CHECK_BACKEND_OK(be)                                                                              \
    do {                                                                                                  \
        (be)->ops->sync((be)->ctx);                                                                       \
        const fm_status st_ = (be)->ops->status((be)->ctx);                                               \
        CHECK_MSG(st_ == FM_OK, "backend status %s: %s", fm_status_name(st_), st_ == FM_OK ? "" : fm_errmsg()); \
    } while (0)
/* Normalized error sqrt(sum (a-b)^2 / sum b^2) (ggml's nmse, square-rooted); NaN in a -> inf. */
static inline double gt_nerr(const float *a, const double *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i])) return INFINITY;
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return sqrt(num / (den > 0 ? den : 1e-300));
}
/* ---- bf16 results in ulps of the reference -------------------------------------------------
 * gt_ref_to_bf16 rounds an fp64 reference to the nearest bf16 (ties to even) in one step (no
 * double rounding through fp32): 8 significant bits, the subnormal quantum 2^-133 below 2^-126,
 * overflow to inf. gt_bf16_ulps counts, for each element, the bf16 values between the GPU's
 * result (a bf16 value held in fp32) and the rounded reference, through the ordered integer
 * image of the bf16 encoding (so the count crosses powers of two and zero correctly: -0 and +0
 * are one point). Where |ref| < floor (a cancellation, where a relative measure is meaningless:
 * GEMMs, reductions, differences) the error is counted in ulps of floor instead:
 * |got - ref| / ulp(floor), rounded up; floor = 0 measures every element in its own ulps. NaN or
 * inf in got where the reference is finite counts as INT64_MAX. */
static inline double gt_ref_to_bf16(double r) {
    if (!isfinite(r) || r == 0) return r;
    int e;
    (void)frexp(r, &e); /* |r| in [2^(e-1), 2^e) */
    const int q = e - 1 >= -126 ? e - 8 : -133; /* the exponent of r's bf16 quantum */
    const double v = ldexp(nearbyint(ldexp(r, -q)), q); /* the default rounding mode: to nearest even */
    return fabs(v) > 3.3895313892515355e38 ? copysign(INFINITY, r) : v; /* above bf16's largest finite */
}
static inline int64_t gt_bf16_key(float bf) { /* the ordered integer of a bf16 value held in fp32 */
    const uint16_t h = gt_f32_to_bf16(bf);
    return (h & 0x8000u) ? -(int64_t)(h & 0x7fffu) : (int64_t)h;
}
/* ulp of bf16 at |x| (the quantum of the binade holding x; 2^-133 for subnormals). */
static inline double gt_bf16_ulp(double x) {
    int e;
    (void)frexp(fabs(x), &e);
    return ldexp(1.0, e - 1 >= -126 ? e - 8 : -133);
}
typedef struct gt_ulps {
    int64_t max;   /* the largest distance, in bf16 ulps */
    int64_t worst; /* its index (-1 when n == 0) */
    double got, ref; /* the GPU's value and the fp64 reference there */
} gt_ulps;
static inline gt_ulps gt_bf16_ulps(const float *got, const double *ref, int64_t n, double floor) {
    gt_ulps u = {0, -1, 0, 0};
    const double ulp_floor = floor > 0 ? gt_bf16_ulp(floor) : 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t d;
        if (isnan(ref[i]) && isnan(got[i])) d = 0;
        else if (!isfinite(got[i]) && isfinite(ref[i])) d = INT64_MAX;
        else if (fabs(ref[i]) < floor) d = (int64_t)ceil(fabs((double)got[i] - ref[i]) / ulp_floor);
        else {
            d = gt_bf16_key(got[i]) - gt_bf16_key((float)gt_ref_to_bf16(ref[i]));
            d = d < 0 ? -d : d;
        }
        if (d > u.max || u.worst < 0) u.max = d, u.worst = i, u.got = got[i], u.ref = ref[i];
    }
    return u;
}
/* Root mean square of ref[0..n) (a floor for gt_bf16_ulps: rms / 64 puts the floor 6 binades
 * below the typical magnitude). */
static inline double gt_maxabs(const double *ref, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(ref[i]));
    return m;
}

static inline double gt_rms(const double *ref, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += ref[i] * ref[i];
    return n > 0 ? sqrt(s / (double)n) : 0.0;
}
/* Checks max ulps <= limit, naming the worst element. */
#define CHECK_ULPS(what, got_, ref_, n_, floor_, limit)                                                       \
    do {                                                                                                  \
        const gt_ulps u_ = gt_bf16_ulps((got_), (ref_), (n_), (floor_));                                     \
        CHECK_MSG(u_.max <= (limit), "%s: %lld bf16 ulps > limit %d at element %lld (got %.9g, fp64 %.9g)", \
                  (what), (long long)u_.max, (int)(limit), (long long)u_.worst, u_.got, u_.ref);          \
        if (getenv("FLATMOE_GPU_ULPS")) printf("  ulps %-60s max %lld (limit %d)\n", (what), (long long)u_.max, (int)(limit)); \
    } while (0)

/* Tolerances by output dtype: bf16 outputs carry ~2^-9 relative rounding; fp32 outputs computed
 * from bf16 inputs with fp32 accumulation match an fp64 reference on the same inputs to ~1e-5. */
#define GT_TOL_BF16 1e-2
#define GT_TOL_F32 1e-4
#endif
