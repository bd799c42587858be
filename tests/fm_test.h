/* A minimal test harness: CHECK macros that count, print the failing expression with its values,
 * and a closing line "N passed, N failed". A test binary exits non-zero when anything failed.
 * Seeds are fixed and printed; FLATMOE_TEST_SEED overrides them for a sweep. */
#ifndef FM_TEST_H
#define FM_TEST_H
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fm_core.h"

static int fm_test_passed = 0, fm_test_failed = 0;

#define CHECK(cond)                                                                      \
    do {                                                                                 \
        if (cond) fm_test_passed++;                                                      \
        else { fm_test_failed++; fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); } \
    } while (0)

#define CHECK_MSG(cond, ...)                                                             \
    do {                                                                                 \
        if (cond) fm_test_passed++;                                                      \
        else { fm_test_failed++; fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
               fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); }                      \
    } while (0)

/* |a-b| <= tol * max(1, |b|)-style check with both values printed. */
#define CHECK_CLOSE(a, b, tol)                                                           \
    do {                                                                                 \
        double fa_ = (double)(a), fb_ = (double)(b);                                     \
        double d_ = fabs(fa_ - fb_), s_ = fabs(fb_) > 1.0 ? fabs(fb_) : 1.0;             \
        if (d_ <= (tol) * s_ && !isnan(fa_) && !isnan(fb_)) fm_test_passed++;            \
        else { fm_test_failed++; fprintf(stderr, "FAIL %s:%d: %s = %.9g vs %s = %.9g (tol %g)\n", \
               __FILE__, __LINE__, #a, fa_, #b, fb_, (double)(tol)); }                    \
    } while (0)

static inline unsigned long long fm_test_seed(unsigned long long dflt) {
    const char *s = getenv("FLATMOE_TEST_SEED");
    unsigned long long seed = s ? strtoull(s, NULL, 10) : dflt;
    printf("seed %llu (set FLATMOE_TEST_SEED to replay another)\n", seed);
    return seed;
}

/* The thread count of a test's main CPU backend: dflt, or FLATMOE_TEST_THREADS when set to a
 * positive count (printed). scripts/test.sh's second pass sets it to 1 (with another OpenBLAS
 * kernel), so that a check which holds at one thread count only fails here, not on a user's
 * machine. Tests that compare 1 thread with 2 on purpose make their own backends. */
static inline int fm_test_threads(int dflt) {
    const char *s = getenv("FLATMOE_TEST_THREADS");
    const int t = s && atoi(s) > 0 ? atoi(s) : dflt;
    printf("threads %d (set FLATMOE_TEST_THREADS to run at another count)\n", t);
    return t;
}

/* Two paths that group the same rows differently (a chunked operator and its plain twin, expert
 * parallelism and one rank) sum in another order wherever a BLAS kernel rounds a row by its tile
 * (tests/fm_test_fixed_gemm.h). fm_test_reorder_bound(n): the most two orders of an n-term fp32
 * sum can differ by, relative to sum|terms|: 2 gamma_n, gamma_n = n u / (1 - n u), u = 2^-24
 * (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1). */
static inline double fm_test_reorder_bound(int64_t n) {
    const double u = ldexp(1.0, -24);
    return 2.0 * (double)n * u / (1.0 - (double)n * u);
}

/* max over rows t < n of max_i |a - b| / max_i |b| (rows of width w): each row's error against its
 * own scale; infinite where a and b differ by a NaN. */
static inline double fm_test_row_rel(const float *a, const float *b, int64_t n, int64_t w) {
    double worst = 0;
    for (int64_t t = 0; t < n; t++) {
        double dm = 0, bm = 0;
        for (int64_t i = 0; i < w; i++) {
            const double df = fabs((double)a[t * w + i] - b[t * w + i]);
            dm = isnan(df) ? INFINITY : fmax(dm, df);
            bm = fmax(bm, fabs((double)b[t * w + i]));
        }
        worst = fmax(worst, dm / (bm > 1e-30 ? bm : 1e-30));
    }
    return worst;
}

/* Zero-filled test buffers (free() them), never NULL: n floats, n doubles, n int32s. */
static inline float *fnew(int64_t n) {
    float *p = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    FM_ASSERT(p);
    return p;
}
static inline double *dnew(int64_t n) {
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    FM_ASSERT(p);
    return p;
}
static inline int32_t *inew(int64_t n) {
    int32_t *p = calloc((size_t)(n > 0 ? n : 1), sizeof(int32_t));
    FM_ASSERT(p);
    return p;
}

static inline int fm_test_finish(void) {
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
#endif
