/* The helpers of the CUDA router / permutation / loss op tests, test_cuda_moe.c and
 * test_cuda_loss.c (one executable each: the globals below are each test's own): the backend,
 * random inputs, device buffers, the error checks, the bf16 ulp limits, the finite differences
 * and the timings' macro.
 *
 * For every op: inputs built on the host (bf16 inputs rounded first, so the reference sees the
 * values the GPU sees), outputs poisoned (all bytes 0xff: NaN for fp32 and bf16, -1 for int32)
 * before each call so an unwritten element fails, results compared with gt_nerr (normalized L2)
 * at the tolerance of the output's dtype (GT_TOL_BF16, GT_TOL_F32, tighter where the op computes
 * in fp32/fp64 on fp32 inputs), bf16 outputs also element by element in bf16 ulps of the
 * reference (gt_bf16_ulps; limits ULPS_* below), integer outputs (top-k ids, offsets, row_route, route_row) and
 * pure copies exactly. router_bwd is also checked against central finite differences of the fp64
 * reference objective (each loss term alone, then together). Every op is run twice on the same
 * inputs and must give the same bits (determinism). Reductions land in device doubles read after
 * a stream_sync (gt_read_f64); router_loss_terms and router_aux_grad also match the CPU backend's
 * arithmetic bit for bit; moe_route_index's offsets land in pinned memory read after one
 * stream_sync; a sequence of compute ops makes no host wait (host_sync_count); a device-found
 * index error is a sticky FM_ERR_ARG from status.
 */
#ifndef FM_GPU_MOE_TEST_H
#define FM_GPU_MOE_TEST_H

#include "backend/cuda/fm_backend_cuda.h"
#include "core/fm_rng.h"
#include "fm_ref_ops.h"
#include "gpu_test.h"
#include "fm_test_fd.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static fm_backend g_be;
static const fm_ops *OPS;
static void *CTX;
static fm_rng g_rng;

/* ---- host helpers ------------------------------------------------------------------------- */

static inline double rnd_normal(void) { return fm_rng_normal(&g_rng); }
static inline double rnd_uniform(double lo, double hi) { return lo + (hi - lo) * fm_rng_uniform_d(&g_rng); }
static inline void fill_normal(float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * rnd_normal());
}
static inline void fill_uniform(float *x, int64_t n, double lo, double hi) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)rnd_uniform(lo, hi);
}
static inline void to_d(double *d, const float *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = f[i];
}
static inline bool all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

/* ---- device helpers ----------------------------------------------------------------------- */

static inline void *dalloc(size_t bytes) {
    void *p = OPS->mem_alloc(CTX, bytes + 256);
    FM_ASSERT(p);
    return p;
}
static inline void dfree(void *p) { OPS->mem_free(CTX, p); }
static inline void h2d(void *d, const void *h, size_t bytes) {
    if (bytes) OPS->copy(CTX, d, h, bytes, FM_COPY_H2D);
}
static inline void d2h(void *h, const void *d, size_t bytes) {
    if (bytes) OPS->copy(CTX, h, d, bytes, FM_COPY_D2H);
}
static inline void *up_bytes(const void *h, size_t bytes) {
    void *d = dalloc(bytes);
    h2d(d, h, bytes);
    return d;
}
static inline void *up_f32(const float *x, int64_t n) { return up_bytes(x, (size_t)n * 4); }
static inline void *up_i32(const int32_t *x, int64_t n) { return up_bytes(x, (size_t)n * 4); }
/* All bytes 0xff: NaN in fp32 and bf16, -1 in int32. */
static inline void dpoison(void *d, size_t bytes) {
    if (bytes) OPS->mem_set(CTX, d, 0xff, bytes);
}
/* Raw bf16 bits of a device bf16 buffer. */
static inline uint16_t *down_bits(const void *d, int64_t n) {
    uint16_t *h = calloc((size_t)(n > 0 ? n : 1), 2);
    FM_ASSERT(h);
    d2h(h, d, (size_t)n * 2);
    return h;
}
/* Two device buffers hold the same bytes. */
static inline bool same_bytes(const void *a, const void *b, size_t bytes) {
    if (!bytes) return true;
    char *ha = malloc(bytes), *hb = malloc(bytes);
    FM_ASSERT(ha && hb);
    d2h(ha, a, bytes);
    d2h(hb, b, bytes);
    const bool eq = !memcmp(ha, hb, bytes);
    free(ha), free(hb);
    return eq;
}

/* gt_nerr with the reference's RMS floored at `floor` (for references that can be ~0). */
static inline double nerr_floor(const float *a, const double *ref, int64_t n, double floor) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i])) return INFINITY;
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    const double fl = floor * floor * (double)(n > 0 ? n : 1);
    return sqrt(num / (den > fl ? den : fl));
}

#define CHECK_ERR(what, err, tol)                                                                  \
    CHECK_MSG((err) <= (tol), "%s: normalized error %.3g > tol %.3g", (what), (double)(err),      \
              (double)(tol))

/* bf16 ulp limits (gt_bf16_ulps against the fp64 reference rounded to bf16). gather_bwd and
 * combine_fwd add k <= 8 terms in fp32 and round once; combine_bwd's dye is one fp32 product
 * rounded: within 1 ulp of the rounded reference (the neighbour where the reference lies near a
 * rounding boundary); the sums can cancel, so they are floored at rms(ref)/64. cross_entropy's
 * dlogits = grad_scale (softmax - onehot) carries the fp32 exp and log-sum-exp errors (relative
 * ~|logit| 2^-24, 1e-3 at logits ~1e4: a quarter of a bf16 ulp) and cancels at the target
 * column: 2, floored. */
#define ULPS_MOE 1
#define ULPS_CE 2

/* ---- finite differences (as tests/test_ops_cpu.c) ------------------------------------------ */

/* fm_fd_check (fm_test_fd.h) on g_rng: errors normalized by max(max|grad|, floor), directions at
 * tol / 10. */
static inline void fd_check(const char *what, objective_fn f, void *st, double *x, int64_t n, const double *grad,
                            double tol, double floor) {
    fm_fd_check(what, f, st, x, n, grad, tol, floor, FD_H, 0.1, &g_rng);
}

/* Random top-k ids: k distinct experts per token drawn from [0,E) minus `skip` (-1: none). */
static inline void random_topk(int32_t *idx, int64_t N, int64_t E, int64_t k, int32_t skip) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < k; j++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)fm_rng_below(&g_rng, (uint64_t)E);
                dup = e == skip;
                for (int64_t i = 0; i < j; i++) dup |= idx[n * k + i] == e;
            } while (dup);
            idx[n * k + j] = e;
        }
}

/* Pinned host int64 [n] for moe_route_index's offsets (buffer_alloc), filled with `fill`. */
static inline int64_t *pinned_i64(int64_t n, int64_t fill) {
    int64_t *p = OPS->buffer_alloc(CTX, FM_BUFFER_PINNED, (size_t)n * sizeof(int64_t));
    FM_ASSERT(p != NULL);
    for (int64_t i = 0; i < n; i++) p[i] = fill;
    return p;
}
static inline void pinned_free(void *p) { OPS->buffer_free(CTX, FM_BUFFER_PINNED, p); }

/* n normal values (scale), rounded to bf16 values. */
static inline float *rounded_normal(int64_t n, double scale) {
    float *x = fnew(n);
    fill_normal(x, n, scale);
    gt_round_bf16(x, n);
    return x;
}

/* ---- the test's start ------------------------------------------------------------------------ */

/* The seed (FLATMOE_TEST_SEED, else dflt; printed) and the CUDA backend on device 0 (g_be, OPS,
 * CTX); false, with a failed check, when the backend cannot be made. */
static inline bool moe_test_begin(unsigned long long dflt) {
    fm_rng_seed(&g_rng, fm_test_seed(dflt));
    const fm_status st = gt_cuda_init(&g_be, 0, 128, 0);
    CHECK_MSG(st == FM_OK, "fm_cuda_backend_init: %s", fm_errmsg());
    if (st != FM_OK) return false;
    OPS = g_be.ops;
    CTX = g_be.ctx;
    return true;
}

/* FLATMOE_TEST_ONLY=text runs only the sections whose name holds it (e.g. under a sanitizer):
 * test_only() is that text (NULL: every section), SECTION runs `call` under `name` if chosen. */
static inline const char *test_only(void) { return getenv("FLATMOE_TEST_ONLY"); }
#define SECTION(name, call)                                                                        \
    do {                                                                                           \
        const char *only_ = test_only();                                                           \
        if (only_ && !strstr(name, only_)) break;                                                  \
        printf("%s\n", name);                                                                      \
        fflush(stdout);                                                                            \
        call;                                                                                      \
    } while (0)

/* ---- timings -------------------------------------------------------------------------------- */

/* Seconds on the monotonic clock; BENCH: the mean time of 5 calls after a warm-up call, printed. */
static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define BENCH(label, bytes, call)                                                                  \
    do {                                                                                           \
        call;                                                                                      \
        OPS->sync(CTX);                                                                            \
        const double t0_ = now_s();                                                                \
        for (int rep_ = 0; rep_ < 5; rep_++) call;                                                 \
        OPS->sync(CTX);                                                                            \
        const double dt_ = (now_s() - t0_) / 5;                                                    \
        printf("  %-52s %9.3f ms  %7.0f GB/s\n", label, dt_ * 1e3, (double)(bytes) / dt_ * 1e-9); \
    } while (0)

#endif
