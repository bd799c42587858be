/* The shared part of the CPU op tests (tests/test_ops_cpu.c: dense ops; tests/test_ops_cpu_moe.c:
 * router, MoE permutation, cross-entropy, AdamW, thread-count independence): the backend under
 * test, the reductions read back, random fills, the normalized error and the finite-difference
 * checks. Included by one test file each (its statics are that binary's). */
#ifndef FM_TEST_OPS_CPU_H
#define FM_TEST_OPS_CPU_H
#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_ref_ops.h"
#include "fm_test.h"
#include "fm_test_fd.h"

#include <float.h>
#include <stdint.h>
#include <time.h>

static fm_backend g_be;
static const fm_ops *OPS;

/* The reductions leave their result in backend memory (no host sync inside an op); on the CPU
 * that is host memory, so these read it directly. */
static inline double sumsq_(const fm_ops *o, void *c, const float *x, int64_t n) {
    double r = -1;
    o->sumsq(c, &r, x, n, false);
    return r;
}
static inline double router_stats_(const fm_ops *o, void *c, float *count, float *ps, const float *probs, const float *lse,
                                   const int32_t *idx, int64_t N, int64_t E, int64_t k) {
    double z = -1;
    o->router_stats(c, count, ps, &z, probs, lse, idx, N, E, k);
    return z;
}
static inline double cross_entropy_(const fm_ops *o, void *c, float *loss, float *dl, const float *logits, const int32_t *tg,
                                    int64_t N, int64_t V, float gs, int32_t ignore) {
    double sum = -1;
    o->cross_entropy(c, loss, dl, logits, tg, N, V, gs, ignore, &sum);
    return sum;
}
static void *CTX;
static fm_rng g_rng;

/* ---- helpers ---------------------------------------------------------------------------- */

static inline double rnd_normal(void) { return fm_rng_normal(&g_rng); }
static inline double rnd_uniform(double lo, double hi) {
    return lo + (hi - lo) * fm_rng_uniform_d(&g_rng);
}
static inline void fill_normal(float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * rnd_normal());
}
static inline void fill_uniform(float *x, int64_t n, double lo, double hi) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)rnd_uniform(lo, hi);
}
static inline void fill_const(float *x, int64_t n, float c) {
    for (int64_t i = 0; i < n; i++) x[i] = c;
}
static inline void poison(float *x, int64_t n) { fill_const(x, n, NAN); }
static inline void to_d(double *d, const float *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = f[i];
}
/* g[i] - base (an accumulated gradient minus its pre-fill), in double. */
static inline void minus_d(double *d, const float *f, float base, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = (double)f[i] - (double)base;
}
/* sum(a o b) over n elements. */
static inline double dot_d(const double *a, const double *b, int64_t n) {
    double L = 0;
    for (int64_t i = 0; i < n; i++) L += a[i] * b[i];
    return L;
}
static inline bool all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

/* max|got - ref| / max(max|ref|, floor); infinite when got holds a NaN or Inf. */
static inline double nerr(const float *got, const double *ref, int64_t n, double floor) {
    double num = 0, den = floor;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) return INFINITY;
        double d = fabs((double)got[i] - ref[i]);
        num = d > num ? d : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return num / den;
}

#define CHECK_ERR(what, err, tol)                                                             \
    CHECK_MSG((err) <= (tol), "%s: normalized error %.3g > tol %.3g", (what), (double)(err), \
              (double)(tol))

/* ---- finite differences ------------------------------------------------------------------- */

/* A directional difference averages the rounding noise of n elements, so it is held to a
 * tighter tolerance than single elements: it catches a gradient off by a relative 1e-4
 * everywhere (a wrong constant), which single elements at tol 1e-4 cannot. */
static const double FD_DIR_TOL_FACTOR = 0.1;

/* fm_fd_check (fm_test_fd.h) on g_rng, directions at tol * FD_DIR_TOL_FACTOR. */
static inline void fd_check_ex(const char *what, objective_fn f, void *st, double *x, int64_t n,
                               const double *grad, double tol, double floor, double h) {
    fm_fd_check(what, f, st, x, n, grad, tol, floor, h, FD_DIR_TOL_FACTOR, &g_rng);
}

static inline void fd_check(const char *what, objective_fn f, void *st, double *x, int64_t n,
                            const double *grad, double tol) {
    fd_check_ex(what, f, st, x, n, grad, tol, 0.0, FD_H);
}


#endif
