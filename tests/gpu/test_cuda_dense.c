/* CUDA backend dense ops (src/backend/cuda/cuda_*.cu) against the plain fp64 host references
 * of tests/fm_ref_ops.c (shared with the CPU tests): gemm (all transpose combinations, alpha/beta, leading dimensions wider than the
 * matrices, C bf16 and fp32, K = 0), add, sumsq, embedding, RMSNorm, RoPE, SwiGLU, AdamW (with
 * and without an fp32 master), convert, and the memory ops (buffer kinds; copy_async on the copy
 * streams ordered by events against the compute stream; host_sync_count at each sync point);
 * determinism (two calls, the same bits) of embedding_bwd, rmsnorm_bwd and sumsq (whose result,
 * a device double, is read after a stream_sync); a few timings at the end (printed, not checked).
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

static double rnd_normal(void) { return fm_rng_normal(&g_rng); }
static double rnd_uniform(double lo, double hi) { return lo + (hi - lo) * fm_rng_uniform_d(&g_rng); }
static void fill_normal(float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * rnd_normal());
}
static void fill_uniform(float *x, int64_t n, double lo, double hi) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)rnd_uniform(lo, hi);
}
/* fill_normal, then rounded to bf16 values (what the device will hold). */
static void fill_normal_bf(float *x, int64_t n, double scale) {
    fill_normal(x, n, scale);
    gt_round_bf16(x, n);
}
static void fill_const(float *x, int64_t n, float c) {
    for (int64_t i = 0; i < n; i++) x[i] = c;
}
static void to_d(double *d, const float *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = f[i];
}
static bool same_bits(const void *a, const void *b, size_t bytes) { return memcmp(a, b, bytes) == 0; }

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

static void *up_act(const float *x, int64_t n) { return gt_upload(&g_be, x, n, FM_DTYPE_BF16); }
static void *up_f32(const float *x, int64_t n) { return gt_upload(&g_be, x, n, FM_DTYPE_F32); }
static void *up_i32(const int32_t *x, int64_t n) {
    void *d = OPS->mem_alloc(CTX, (size_t)(n > 0 ? n : 1) * 4 + 256);
    FM_ASSERT(d);
    if (n) OPS->copy(CTX, d, x, (size_t)n * 4, FM_COPY_H2D);
    return d;
}
/* n elements of NaN (bf16 or fp32). */
static void *up_nan(int64_t n, fm_dtype t) {
    float *h = fnew(n);
    fill_const(h, n, NAN);
    void *d = gt_upload(&g_be, h, n, t);
    free(h);
    return d;
}
static void down_act(float *x, const void *d, int64_t n) { gt_download(&g_be, x, d, n, FM_DTYPE_BF16); }
static void down_f32(float *x, const void *d, int64_t n) { gt_download(&g_be, x, d, n, FM_DTYPE_F32); }
static void *down_raw(const void *d, size_t bytes) {
    void *h = malloc(bytes ? bytes : 1);
    FM_ASSERT(h);
    if (bytes) OPS->copy(CTX, h, d, bytes, FM_COPY_D2H);
    return h;
}
static void dfree(void *d) { OPS->mem_free(CTX, d); }
/* The element one past p (a bf16 pointer that is not 16-byte aligned: the kernels' scalar path). */
static void *off1(void *p) { return (uint16_t *)p + 1; }

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
static void fd_check(const char *what, objective_fn f, void *st, double *x, int64_t n, const double *grad,
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

/* ---- init ------------------------------------------------------------------------------------ */

static void test_init_errors(void) {
    fm_backend b = {(const fm_ops *)1, (void *)1};
    CHECK(gt_cuda_init(NULL, 0, 64, 0) == FM_ERR_ARG);
    CHECK(gt_cuda_init(&b, -1, 64, 0) == FM_ERR_ARG);
    CHECK(b.ops == NULL && b.ctx == NULL);
    CHECK(gt_cuda_init(&b, 0, 0, 0) == FM_ERR_ARG);
    CHECK(gt_cuda_init(&b, 4096, 64, 0) == FM_ERR_ARG); /* no such device */
    CHECK_MSG(strstr(fm_errmsg(), "device") != NULL, "message: %s", fm_errmsg());
    CHECK(b.ops == NULL && b.ctx == NULL);
    /* cuBLASLt 32 MiB + the default cuDNN 64 MiB + 16 MiB scratch */
    CHECK(fm_cuda_backend_workspace_bytes(128, 0) == ((size_t)112 << 20));
    CHECK(fm_cuda_backend_workspace_bytes(128, (size_t)1 << 20) < fm_cuda_backend_workspace_bytes(128, 0));
    fm_cuda_backend_free(NULL);
    fm_backend empty = {NULL, NULL};
    fm_cuda_backend_free(&empty);
}

/* ---- gemm ------------------------------------------------------------------------------------ */

/* All four transpose combinations x C fp32/bf16, alpha/beta, leading dimensions wider than the
 * matrices (the padding must stay untouched, bit for bit), beta = 0 over a NaN C; K = 0 and
 * alpha = 0 (C = beta C). */
static void gemm_case(int64_t M, int64_t N, int64_t K) {
    for (int ct = 0; ct < 2; ct++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                const fm_dtype c_type = ct ? FM_DTYPE_BF16 : FM_DTYPE_F32;
                const size_t cs = fm_dtype_size(c_type);
                const int64_t arows = ta ? K : M, acols = ta ? M : K, lda = acols + 5;
                const int64_t brows = tb ? N : K, bcols = tb ? K : N, ldb = bcols + 3;
                const int64_t ldc = N + 7;
                float *A = fnew(arows * lda), *Bm = fnew(brows * ldb), *C0 = fnew(M * ldc), *Cg = fnew(M * ldc);
                fill_normal_bf(A, arows * lda, 1.0);
                fill_normal_bf(Bm, brows * ldb, 1.0);
                fill_normal(C0, M * ldc, 1.0);
                if (ct) gt_round_bf16(C0, M * ldc);
                double *ab = dnew(M * N), *ref = dnew(M * N);
                double *Ad = fm_ref_widen(A, arows * lda), *Bd = fm_ref_widen(Bm, brows * ldb);
                fm_ref_gemm(ab, ta, tb, M, N, K, Ad, lda, Bd, ldb);
                free(Ad), free(Bd);
                const float alpha = 0.7f, beta = 0.3f;
                void *dA = up_act(A, arows * lda), *dB = up_act(Bm, brows * ldb);
                void *dC = gt_upload(&g_be, C0, M * ldc, c_type);
                void *c_before = down_raw(dC, (size_t)(M * ldc) * cs);
                OPS->gemm(CTX, ta, tb, M, N, K, alpha, dA, lda, dB, ldb, beta, dC, c_type, ldc);
                void *c_after = down_raw(dC, (size_t)(M * ldc) * cs);
                gt_download(&g_be, Cg, dC, M * ldc, c_type);
                float *got = fnew(M * N);
                for (int64_t i = 0; i < M; i++)
                    for (int64_t j = 0; j < N; j++) {
                        ref[i * N + j] = alpha * ab[i * N + j] + (double)beta * C0[i * ldc + j];
                        got[i * N + j] = Cg[i * ldc + j];
                    }
                const double tol = ct ? GT_TOL_BF16 : GT_TOL_F32;
                char what[96];
                snprintf(what, sizeof what, "gemm %lldx%lldx%lld (%d,%d) C %s alpha,beta", (long long)M,
                         (long long)N, (long long)K, ta, tb, ct ? "bf16" : "f32");
                CHECK_ERR(what, gt_nerr(got, ref, M * N), tol);
                if (ct) CHECK_ULPS(what, got, ref, M * N, gt_rms(ref, M * N) / 64, ULPS_REDUCTION);
                bool pad_ok = true;
                for (int64_t i = 0; i < M; i++)
                    if (!same_bits((char *)c_after + (size_t)(i * ldc + N) * cs,
                                   (char *)c_before + (size_t)(i * ldc + N) * cs, (size_t)(ldc - N) * cs))
                        pad_ok = false;
                CHECK_MSG(pad_ok, "%s: columns between N and ldc were written", what);
                /* beta = 0 overwrites a NaN C */
                dfree(dC);
                dC = up_nan(M * ldc, c_type);
                OPS->gemm(CTX, ta, tb, M, N, K, 1.0f, dA, lda, dB, ldb, 0.0f, dC, c_type, ldc);
                gt_download(&g_be, Cg, dC, M * ldc, c_type);
                for (int64_t i = 0; i < M; i++)
                    for (int64_t j = 0; j < N; j++) got[i * N + j] = Cg[i * ldc + j];
                snprintf(what, sizeof what, "gemm %lldx%lldx%lld (%d,%d) C %s beta=0 over NaN", (long long)M,
                         (long long)N, (long long)K, ta, tb, ct ? "bf16" : "f32");
                CHECK_ERR(what, gt_nerr(got, ab, M * N), tol);
                if (ct) CHECK_ULPS(what, got, ab, M * N, gt_rms(ab, M * N) / 64, ULPS_REDUCTION);
                dfree(dA), dfree(dB), dfree(dC);
                free(A), free(Bm), free(C0), free(Cg), free(ab), free(ref), free(got), free(c_before),
                    free(c_after);
            }
}

static void test_gemm(void) {
    gemm_case(37, 29, 23);
    gemm_case(130, 96, 517); /* several tiles, a long K */
    /* K = 0 and alpha = 0: C = beta C, both C types. */
    for (int ct = 0; ct < 2; ct++) {
        const fm_dtype t = ct ? FM_DTYPE_BF16 : FM_DTYPE_F32;
        float C[6] = {1, 2, 3, 4, 5, 6}, got[6];
        void *dC = gt_upload(&g_be, C, 6, t), *dA = up_act(C, 6);
        OPS->gemm(CTX, false, false, 2, 3, 0, 1.0f, dA, 0, dA, 3, 0.5f, dC, t, 3);
        gt_download(&g_be, got, dC, 6, t);
        CHECK_MSG(got[0] == 0.5f && got[5] == 3.0f, "gemm K=0 (C %s): %g %g", ct ? "bf16" : "f32", got[0], got[5]);
        OPS->gemm(CTX, false, false, 2, 3, 1, 0.0f, dA, 1, dA, 3, 0.0f, dC, t, 3);
        gt_download(&g_be, got, dC, 6, t);
        CHECK_MSG(got[0] == 0.0f && got[5] == 0.0f, "gemm alpha=0 beta=0 (C %s)", ct ? "bf16" : "f32");
        dfree(dC), dfree(dA);
    }
}

/* ---- grouped expert GEMMs -------------------------------------------------------------------- */

/* expert_linear_fwd/bwd against an fp64 per-expert reference: rows[e] rows per expert (zeros
 * allowed: that expert's dW must stay bit for bit what it was), y over a NaN buffer (every row
 * written), dx with beta 1 over a random dx and with beta 0 over NaN, dW accumulated. */
static void expert_case(const char *label, int64_t E, const int64_t *rows, int64_t in, int64_t out) {
    int64_t *off = calloc((size_t)E + 1, sizeof *off);
    for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + rows[e];
    const int64_t R = off[E], nw = E * out * in;
    const int64_t Rr = R > 0 ? R : 1;
    float *x = fnew(Rr * in), *W = fnew(nw), *dy = fnew(Rr * out), *dx0 = fnew(Rr * in), *dW0 = fnew(nw);
    fill_normal_bf(x, R * in, 1.0);
    fill_normal_bf(W, nw, 1.0);
    fill_normal_bf(dy, R * out, 1.0);
    fill_normal_bf(dx0, R * in, 1.0);
    fill_normal_bf(dW0, nw, 1.0);
    double *ry = dnew(Rr * out), *rdx = dnew(Rr * in), *rdx0 = dnew(Rr * in), *rdW = fm_ref_widen(dW0, nw);
    {
        double *xd = fm_ref_widen(x, Rr * in), *Wd = fm_ref_widen(W, nw), *dyd = fm_ref_widen(dy, Rr * out);
        fm_ref_expert_linear_fwd(ry, xd, Wd, off, E, in, out);
        fm_ref_expert_linear_bwd(rdx0, rdW, dyd, xd, Wd, off, E, in, out); /* dW accumulated onto dW0 */
        for (int64_t i = 0; i < R * in; i++) rdx[i] = rdx0[i] + dx0[i];
        free(xd), free(Wd), free(dyd);
    }
    void *dX = up_act(x, Rr * in), *dWt = up_act(W, nw), *dDY = up_act(dy, Rr * out);
    void *dY = up_nan(Rr * out, FM_DTYPE_BF16), *dDX = up_act(dx0, Rr * in), *dDW = up_act(dW0, nw);
    void *dW_before = down_raw(dDW, (size_t)nw * 2);
    fm_expert_linear_fwd(&g_be, dY, dX, dWt, off, E, in, out);
    fm_expert_linear_bwd(&g_be, dDX, 1.0f, dDW, dDY, dX, dWt, off, E, in, out);
    int64_t ng = nw;
    if (Rr * in > ng) ng = Rr * in;
    if (Rr * out > ng) ng = Rr * out;
    float *got = fnew(ng);
    char what[128];
    if (R > 0) {
        down_act(got, dY, R * out);
        snprintf(what, sizeof what, "expert_linear_fwd %s (E %lld, R %lld)", label, (long long)E, (long long)R);
        CHECK_ERR(what, gt_nerr(got, ry, R * out), GT_TOL_BF16);
        CHECK_ULPS(what, got, ry, R * out, gt_rms(ry, R * out) / 64, ULPS_REDUCTION);
        down_act(got, dDX, R * in);
        snprintf(what, sizeof what, "expert_linear_bwd dx beta=1 %s", label);
        CHECK_ERR(what, gt_nerr(got, rdx, R * in), GT_TOL_BF16);
        /* accumulated into a bf16 output (beta 1): measured on the H200, results near a cancellation
         * sit on the grid of the operands' magnitude (e.g. -3 x 2^-7 for fp64 -0.0261), as if the
         * product were rounded before the add; counted in ulps of max|ref| (two roundings, 3) */
        CHECK_ULPS(what, got, rdx, R * in, gt_maxabs(rdx, R * in), 3);
    }
    down_act(got, dDW, nw);
    snprintf(what, sizeof what, "expert_linear_bwd dW %s", label);
    CHECK_ERR(what, gt_nerr(got, rdW, nw), GT_TOL_BF16);
    CHECK_ULPS(what, got, rdW, nw, gt_maxabs(rdW, nw), 3); /* accumulated (+=) into bf16: as dx above */
    void *dW_after = down_raw(dDW, (size_t)nw * 2);
    bool idle_ok = true;
    for (int64_t e = 0; e < E; e++)
        if (rows[e] == 0 && !same_bits((char *)dW_after + (size_t)(e * out * in) * 2,
                                       (char *)dW_before + (size_t)(e * out * in) * 2, (size_t)(out * in) * 2))
            idle_ok = false;
    CHECK_MSG(idle_ok, "expert_linear_bwd %s: an expert with no rows changed its dW", label);
    /* beta = 0 over NaN, dW not checked again */
    dfree(dDX);
    dDX = up_nan(Rr * in, FM_DTYPE_BF16);
    fm_expert_linear_bwd(&g_be, dDX, 0.0f, dDW, dDY, dX, dWt, off, E, in, out);
    if (R > 0) {
        down_act(got, dDX, R * in);
        snprintf(what, sizeof what, "expert_linear_bwd dx beta=0 over NaN %s", label);
        CHECK_ERR(what, gt_nerr(got, rdx0, R * in), GT_TOL_BF16);
        CHECK_ULPS(what, got, rdx0, R * in, gt_rms(rdx0, R * in) / 64, ULPS_REDUCTION);
    }
    dfree(dX), dfree(dWt), dfree(dDY), dfree(dY), dfree(dDX), dfree(dDW);
    free(off), free(x), free(W), free(dy), free(dx0), free(dW0), free(ry), free(rdx), free(rdx0), free(rdW),
        free(got), free(dW_before), free(dW_after);
}

static void test_expert_linear(void) {
    {
        const int64_t rows[6] = {5, 0, 17, 1, 0, 40};
        expert_case("mixed, two idle experts", 6, rows, 48, 24);
    }
    {
        const int64_t rows[4] = {0, 0, 61, 0};
        expert_case("every row to one expert", 4, rows, 32, 40);
    }
    {
        const int64_t rows[5] = {1100, 3, 0, 1030, 50}; /* experts over FM_CUDA_GROUP_ROWS_MAX: own calls */
        expert_case("busy experts beside small ones", 5, rows, 16, 8);
    }
    {
        const int64_t rows[3] = {0, 0, 0};
        expert_case("no rows", 3, rows, 16, 8);
    }
    {
        enum { EB = 300 }; /* more experts than one grouped call takes */
        int64_t rows[EB];
        for (int e = 0; e < EB; e++) rows[e] = (e % 7 == 3) ? 0 : (int64_t)fm_rng_below(&g_rng, 9);
        expert_case("300 experts", EB, rows, 24, 16);
    }
}

/* ---- add, sumsq ------------------------------------------------------------------------------ */

/* y += x is one rounding of the fp32 sum: bit-exact against the host's. Aligned (vector path)
 * and one element off (scalar path). */
static void test_add(void) {
    const int64_t n = 100003;
    for (int off = 0; off < 2; off++) {
        float *y = fnew(n + 1), *x = fnew(n + 1), *got = fnew(n + 1);
        fill_normal_bf(y, n + 1, 1.0);
        fill_normal_bf(x, n + 1, 1.0);
        void *dy = up_act(y, n + 1), *dx = up_act(x, n + 1);
        OPS->add(CTX, off ? off1(dy) : dy, off ? off1(dx) : dx, n);
        down_act(got, dy, n + 1);
        bool exact = true;
        for (int64_t i = 0; i < n + 1; i++) {
            const bool in = off ? i >= 1 : i < n;
            const float want = in ? gt_bf16_to_f32(gt_f32_to_bf16(y[i] + x[i])) : y[i];
            if (memcmp(&want, &got[i], 4)) exact = false;
        }
        CHECK_MSG(exact, "add (offset %d): not the bf16 rounding of the fp32 sum, or wrote outside [0,n)", off);
        double *ref = dnew(n);
        for (int64_t i = 0; i < n; i++) ref[i] = (double)y[i + off] + (double)x[i + off];
        char what[64];
        snprintf(what, sizeof what, "add (offset %d)", off);
        CHECK_ULPS(what, got + off, ref, n, 0.0, ULPS_ELEMENTWISE);
        free(ref);
        dfree(dy), dfree(dx);
        free(y), free(x), free(got);
    }
}

/* sumsq into a device double: close to the fp64 sum, the same bits on a second call, n = 0
 * assigns +0; accumulate adds the same bits a fresh call gives to the old value (and n = 0 with
 * accumulate leaves it). */
static void test_sumsq(void) {
    const int64_t ns[] = {0, 1, 5, 255, 257, 1000003, 3000017};
    double *d_out = gt_dev_f64(&g_be, 3);
    for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++)
        for (int off = 0; off < 2; off++) {
            const int64_t m = ns[c];
            float *z = fnew(m + 1);
            fill_normal_bf(z, m + 1, 3.0);
            double ref = 0;
            for (int64_t i = off; i < m + off; i++) ref += (double)z[i] * z[i];
            void *dz = up_act(z, m + 1);
            void *p = off ? off1(dz) : dz;
            gt_write_f64(&g_be, d_out, 12345.0); /* assigned, whatever it held */
            OPS->sumsq(CTX, d_out, p, m, false);
            OPS->sumsq(CTX, d_out + 1, p, m, false);
            const double got = gt_read_f64(&g_be, d_out), again = gt_read_f64(&g_be, d_out + 1);
            CHECK_CLOSE(got, ref, 1e-12);
            CHECK_MSG(same_bits(&got, &again, sizeof got), "sumsq(n=%lld, offset %d) not deterministic",
                      (long long)m, off);
            /* accumulate: 0.5 + s, then + s again (each the same bits as got) */
            gt_write_f64(&g_be, d_out + 2, 0.5);
            OPS->sumsq(CTX, d_out + 2, p, m, true);
            OPS->sumsq(CTX, d_out + 2, p, m, true);
            const double acc = gt_read_f64(&g_be, d_out + 2), want = (0.5 + got) + got;
            CHECK_MSG(same_bits(&acc, &want, sizeof acc), "sumsq(n=%lld, offset %d) accumulate: %.17g, want %.17g",
                      (long long)m, off, acc, want);
            dfree(dz);
            free(z);
        }
    dfree(d_out);
}

/* ---- embedding ------------------------------------------------------------------------------- */

typedef struct emb_st {
    double *wte, *dout;
    const int32_t *tok;
    int64_t N, H;
} emb_st;

static double emb_obj(void *p) {
    emb_st *s = p;
    double L = 0;
    for (int64_t n = 0; n < s->N; n++)
        for (int64_t j = 0; j < s->H; j++) L += s->dout[n * s->H + j] * s->wte[s->tok[n] * s->H + j];
    return L;
}

/* fwd bit-exact (a copy); bwd accumulates onto a random pre-fill with repeated tokens (one
 * token takes a third of them), an unused row untouched bit for bit, the same bits on a second
 * call from the same pre-fill; FD check of dwte when fd. */
static void test_embedding(int64_t N, int64_t V, int64_t H, bool fd) {
    int32_t *tok = inew(N);
    for (int64_t n = 0; n < N; n++) tok[n] = (int32_t)fm_rng_below(&g_rng, (uint64_t)(V - 1)); /* V-1 unused */
    for (int64_t n = 0; n < N; n += 3) tok[n] = 4 % (int32_t)(V - 1);
    if (N > 30) tok[3] = tok[7] = tok[30] = 1;
    float *wte = fnew(V * H), *out = fnew(N * H), *dout = fnew(N * H), *pre = fnew(V * H), *dw = fnew(V * H),
          *dw2 = fnew(V * H);
    fill_normal_bf(wte, V * H, 1.0);
    fill_normal_bf(dout, N * H, 1.0);
    fill_normal_bf(pre, V * H, 0.1);
    void *dtok = up_i32(tok, N), *dwte = up_act(wte, V * H), *dout_d = up_act(dout, N * H);
    void *dout_fwd = up_nan(N * H, FM_DTYPE_BF16);
    OPS->embedding_fwd(CTX, dout_fwd, dtok, dwte, N, H);
    down_act(out, dout_fwd, N * H);
    bool ok = true;
    for (int64_t n = 0; n < N && ok; n++)
        if (memcmp(out + n * H, wte + (int64_t)tok[n] * H, (size_t)H * sizeof(float))) ok = false;
    CHECK_MSG(ok, "embedding_fwd N=%lld H=%lld: rows differ from wte[tokens]", (long long)N, (long long)H);

    void *ddw = up_act(pre, V * H);
    OPS->embedding_bwd(CTX, ddw, dout_d, dtok, N, H);
    down_act(dw, ddw, V * H);
    dfree(ddw);
    ddw = up_act(pre, V * H);
    OPS->embedding_bwd(CTX, ddw, dout_d, dtok, N, H);
    down_act(dw2, ddw, V * H);
    CHECK_MSG(same_bits(dw, dw2, (size_t)(V * H) * sizeof(float)), "embedding_bwd N=%lld: two calls differ",
              (long long)N);
    CHECK_MSG(same_bits(dw + (V - 1) * H, pre + (V - 1) * H, (size_t)H * sizeof(float)),
              "embedding_bwd: a row no token uses changed");
    double *ref = fm_ref_widen(pre, V * H), *doutd = fm_ref_widen(dout, N * H);
    fm_ref_embedding_bwd(ref, doutd, tok, N, H); /* accumulated onto the pre-fill */
    free(doutd);
    char what[96];
    snprintf(what, sizeof what, "embedding_bwd N=%lld V=%lld H=%lld", (long long)N, (long long)V, (long long)H);
    CHECK_ERR(what, gt_nerr(dw, ref, V * H), GT_TOL_BF16);
    if (N <= ((int64_t)1 << 18)) {
        CHECK_ULPS(what, dw, ref, V * H, gt_rms(ref, V * H) / 64, ULPS_REDUCTION);
    } else {
        /* More tokens than one sort chunk (2^18): each chunk's sums are rounded into dwte, so the
         * first rounding is at a partial sum's magnitude, which can exceed the final value's (a later
         * chunk cancels it) but not twice the largest final value: measured in ulps of max|ref|,
         * two roundings of at most one such ulp each, plus the neighbour at a boundary: 3. */
        double mx = 0;
        for (int64_t i = 0; i < V * H; i++) mx = fmax(mx, fabs(ref[i]));
        CHECK_ULPS(what, dw, ref, V * H, mx, 3);
    }
    if (fd) {
        emb_st s = {dnew(V * H), dnew(N * H), tok, N, H};
        to_d(s.wte, wte, V * H);
        to_d(s.dout, dout, N * H);
        double *g = dnew(V * H);
        for (int64_t i = 0; i < V * H; i++) g[i] = (double)dw[i] - (double)pre[i];
        fd_check("embedding_bwd dwte (accumulated)", emb_obj, &s, s.wte, V * H, g, GT_TOL_BF16);
        free(s.wte), free(s.dout), free(g);
    }
    dfree(dtok), dfree(dwte), dfree(dout_d), dfree(dout_fwd), dfree(ddw);
    free(tok), free(wte), free(out), free(dout), free(pre), free(dw), free(dw2), free(ref);
}

/* ---- RMSNorm --------------------------------------------------------------------------------- */

typedef struct rms_st {
    double *x, *w, *dout;
    int64_t N, D;
    double eps;
} rms_st;

static double rms_obj(void *p) {
    rms_st *s = p;
    double *y = dnew(s->N * s->D), L = 0;
    fm_ref_rmsnorm_fwd(y, NULL, s->x, s->w, s->N, s->D, s->eps);
    for (int64_t i = 0; i < s->N * s->D; i++) L += s->dout[i] * y[i];
    free(y);
    return L;
}

/* x ~ N(0, x_scale^2). fwd out (bf16) and rstd (fp32, tol 1e-5) against fp64; bwd dx (assigned,
 * poisoned) and dw (accumulated onto 0.5) against the analytic fp64 gradient and, when fd, finite
 * differences; a second bwd call gives the same bits. */
static void test_rmsnorm(int64_t N, int64_t D, double x_scale, bool fd) {
    const float eps = 1e-5f;
    const int64_t nd = N * D;
    float *x = fnew(nd), *w = fnew(D), *dout = fnew(nd), *out = fnew(nd), *rstd = fnew(N), *dx = fnew(nd),
          *dw = fnew(D), *dx2 = fnew(nd), *dw2 = fnew(D), *half = fnew(D);
    fill_normal_bf(x, nd, x_scale);
    fill_uniform(w, D, 0.5, 1.5);
    gt_round_bf16(w, D);
    fill_normal_bf(dout, nd, 1.0);
    fill_const(half, D, 0.5f);
    void *dX = up_act(x, nd), *dW = up_act(w, D), *dG = up_act(dout, nd), *dO = up_nan(nd, FM_DTYPE_BF16),
         *dR = up_nan(N, FM_DTYPE_F32);
    OPS->rmsnorm_fwd(CTX, dO, dR, dX, dW, N, D, eps);
    down_act(out, dO, nd);
    down_f32(rstd, dR, N);
    double *rout = dnew(nd), *rr = dnew(N), *rdx = dnew(nd), *rdw = dnew(D);
    {
        double *xd = fm_ref_widen(x, nd), *wd = fm_ref_widen(w, D), *gd = fm_ref_widen(dout, nd);
        fm_ref_rmsnorm_fwd(rout, rr, xd, wd, N, D, eps);
        fm_ref_rmsnorm_bwd(rdx, rdw, gd, xd, wd, N, D, eps);
        free(xd), free(wd), free(gd);
    }
    char what[128];
    snprintf(what, sizeof what, "rmsnorm_fwd N=%lld D=%lld out", (long long)N, (long long)D);
    CHECK_ERR(what, gt_nerr(out, rout, nd), GT_TOL_BF16);
    CHECK_ULPS(what, out, rout, nd, 0.0, ULPS_ELEMENTWISE);
    snprintf(what, sizeof what, "rmsnorm_fwd N=%lld D=%lld rstd", (long long)N, (long long)D);
    CHECK_ERR(what, gt_nerr(rstd, rr, N), 1e-5);

    void *dDX = up_nan(nd, FM_DTYPE_BF16), *dDW = up_act(half, D);
    OPS->rmsnorm_bwd(CTX, dDX, dDW, dG, dX, dW, dR, N, D);
    down_act(dx, dDX, nd);
    down_act(dw, dDW, D);
    dfree(dDX), dfree(dDW);
    dDX = up_nan(nd, FM_DTYPE_BF16), dDW = up_act(half, D);
    OPS->rmsnorm_bwd(CTX, dDX, dDW, dG, dX, dW, dR, N, D);
    down_act(dx2, dDX, nd);
    down_act(dw2, dDW, D);
    CHECK_MSG(same_bits(dx, dx2, (size_t)nd * 4) && same_bits(dw, dw2, (size_t)D * 4),
              "rmsnorm_bwd N=%lld D=%lld: two calls differ", (long long)N, (long long)D);
    snprintf(what, sizeof what, "rmsnorm_bwd N=%lld D=%lld dx", (long long)N, (long long)D);
    CHECK_ERR(what, gt_nerr(dx, rdx, nd), GT_TOL_BF16);
    CHECK_ULPS(what, dx, rdx, nd, gt_rms(rdx, nd) / 64, ULPS_REDUCTION);
    double *g = dnew(nd > D ? nd : D);
    float *dwd = fnew(D);
    for (int64_t j = 0; j < D; j++) dwd[j] = dw[j] - 0.5f;
    snprintf(what, sizeof what, "rmsnorm_bwd N=%lld D=%lld dw (accumulated)", (long long)N, (long long)D);
    /* dw holds bf16(0.5 + sum): its rounding is relative to |0.5 + sum|, at most ~|sum| + 0.5 */
    CHECK_ERR(what, gt_nerr(dwd, rdw, D), GT_TOL_BF16);
    { /* the stored bf16 dw against 0.5 + the fp64 sum */
        double *rdw_acc = dnew(D);
        for (int64_t j = 0; j < D; j++) rdw_acc[j] = 0.5 + rdw[j];
        CHECK_ULPS(what, dw, rdw_acc, D, gt_rms(rdw_acc, D) / 64, ULPS_REDUCTION);
        free(rdw_acc);
    }
    if (fd) {
        rms_st s = {dnew(nd), dnew(D), dnew(nd), N, D, eps};
        to_d(s.x, x, nd);
        to_d(s.w, w, D);
        to_d(s.dout, dout, nd);
        to_d(g, dx, nd);
        fd_check("rmsnorm_bwd dx", rms_obj, &s, s.x, nd, g, GT_TOL_BF16);
        to_d(g, dwd, D);
        fd_check("rmsnorm_bwd dw (accumulated)", rms_obj, &s, s.w, D, g, GT_TOL_BF16);
        free(s.x), free(s.w), free(s.dout);
    }
    dfree(dX), dfree(dW), dfree(dG), dfree(dO), dfree(dR), dfree(dDX), dfree(dDW);
    free(x), free(w), free(dout), free(out), free(rstd), free(dx), free(dw), free(dx2), free(dw2), free(half);
    free(rout), free(rr), free(rdx), free(rdw), free(g), free(dwd);
}

/* ---- RoPE ------------------------------------------------------------------------------------ */

typedef struct rope_st {
    double *x, *dout;
    const float *cs, *sn;
    int64_t B, T, nh, hd;
} rope_st;

static double rope_obj(void *p) {
    rope_st *s = p;
    const int64_t n = s->B * s->T * s->nh * s->hd;
    double *y = dnew(n), L = 0;
    fm_ref_rope(y, s->x, s->cs, s->sn, s->B, s->T, s->nh, s->hd, 1.0);
    for (int64_t i = 0; i < n; i++) L += s->dout[i] * y[i];
    free(y);
    return L;
}

/* Tables with c^2 + s^2 != 1 (so the backward must be the transpose, not the inverse angle). */
static void test_rope(int64_t B, int64_t T, int64_t Tmax, int64_t nh, int64_t hd) {
    const int64_t n = B * T * nh * hd;
    float *cs = fnew(Tmax * hd / 2), *sn = fnew(Tmax * hd / 2), *x = fnew(n), *dout = fnew(n), *buf = fnew(n);
    fill_uniform(cs, Tmax * hd / 2, -1.2, 1.2);
    fill_uniform(sn, Tmax * hd / 2, -1.2, 1.2);
    fill_normal_bf(x, n, 1.0);
    fill_normal_bf(dout, n, 1.0);
    void *dcs = up_f32(cs, Tmax * hd / 2), *dsn = up_f32(sn, Tmax * hd / 2), *dx = up_act(x, n),
         *dg = up_act(dout, n);
    rope_st s = {dnew(n), dnew(n), cs, sn, B, T, nh, hd};
    to_d(s.x, x, n);
    to_d(s.dout, dout, n);
    double *ref = dnew(n);
    fm_ref_rope(ref, s.x, cs, sn, B, T, nh, hd, 1.0);
    OPS->rope_fwd(CTX, dx, dcs, dsn, B, T, nh, hd);
    down_act(buf, dx, n);
    char what[96];
    snprintf(what, sizeof what, "rope_fwd B=%lld T=%lld nh=%lld hd=%lld", (long long)B, (long long)T, (long long)nh,
             (long long)hd);
    CHECK_ERR(what, gt_nerr(buf, ref, n), GT_TOL_BF16);
    CHECK_ULPS(what, buf, ref, n, gt_rms(ref, n) / 64, ULPS_ELEMENTWISE);
    OPS->rope_bwd(CTX, dg, dcs, dsn, B, T, nh, hd);
    down_act(buf, dg, n);
    fm_ref_rope(ref, s.dout, cs, sn, B, T, nh, hd, -1.0);
    snprintf(what, sizeof what, "rope_bwd B=%lld T=%lld nh=%lld hd=%lld", (long long)B, (long long)T, (long long)nh,
             (long long)hd);
    CHECK_ERR(what, gt_nerr(buf, ref, n), GT_TOL_BF16);
    CHECK_ULPS(what, buf, ref, n, gt_rms(ref, n) / 64, ULPS_ELEMENTWISE);
    double *g = dnew(n);
    to_d(g, buf, n);
    fd_check("rope_bwd dx", rope_obj, &s, s.x, n, g, GT_TOL_BF16);
    dfree(dcs), dfree(dsn), dfree(dx), dfree(dg);
    free(cs), free(sn), free(x), free(dout), free(buf), free(s.x), free(s.dout), free(ref), free(g);
}

/* ---- SwiGLU ---------------------------------------------------------------------------------- */

typedef struct swi_st {
    double *g, *u, *dout;
    int64_t n;
} swi_st;

static double swi_obj(void *p) {
    swi_st *s = p;
    double L = 0;
    for (int64_t i = 0; i < s->n; i++) L += s->dout[i] * fm_ref_silu(s->g[i]) * s->u[i];
    return L;
}

/* Gates up to |g| ~ 30 and one at -100 (exp overflows: sigmoid exactly 0); aligned (vector path)
 * and one element off (scalar path). fwd and bwd against fp64, bwd also against FD. */
static void test_swiglu(int64_t n, int off) {
    float *g = fnew(n), *u = fnew(n), *dout = fnew(n), *out = fnew(n), *dg = fnew(n), *du = fnew(n);
    fill_normal(g, n, 3.0);
    g[0] = 30.0f, g[1] = -30.0f, g[2] = 0.0f, g[3] = -100.0f;
    gt_round_bf16(g, n);
    fill_normal_bf(u, n, 1.0);
    fill_normal_bf(dout, n, 1.0);
    float *tmp = fnew(n + off);
    tmp[0] = 0.0f;
    memcpy(tmp + off, g, (size_t)n * 4);
    void *dG = up_act(tmp, n + off);
    memcpy(tmp + off, u, (size_t)n * 4);
    void *dU = up_act(tmp, n + off);
    memcpy(tmp + off, dout, (size_t)n * 4);
    void *dD = up_act(tmp, n + off);
    void *dO = up_nan(n + off, FM_DTYPE_BF16), *dDG = up_nan(n + off, FM_DTYPE_BF16),
         *dDU = up_nan(n + off, FM_DTYPE_BF16);
#define SW(p) (off ? off1(p) : (p))
    OPS->swiglu_fwd(CTX, SW(dO), SW(dG), SW(dU), n);
    OPS->swiglu_bwd(CTX, SW(dDG), SW(dDU), SW(dD), SW(dG), SW(dU), n);
#undef SW
    down_act(tmp, dO, n + off);
    memcpy(out, tmp + off, (size_t)n * 4);
    down_act(tmp, dDG, n + off);
    memcpy(dg, tmp + off, (size_t)n * 4);
    down_act(tmp, dDU, n + off);
    memcpy(du, tmp + off, (size_t)n * 4);
    swi_st s = {dnew(n), dnew(n), dnew(n), n};
    to_d(s.g, g, n);
    to_d(s.u, u, n);
    to_d(s.dout, dout, n);
    double *ref = dnew(n), *rdg = dnew(n), *rdu = dnew(n);
    fm_ref_swiglu_fwd(ref, s.g, s.u, n);
    fm_ref_swiglu_bwd(rdg, rdu, s.dout, s.g, s.u, n);
    char what[96];
    snprintf(what, sizeof what, "swiglu_fwd n=%lld offset %d", (long long)n, off);
    CHECK_ERR(what, gt_nerr(out, ref, n), GT_TOL_BF16);
    CHECK_ULPS(what, out, ref, n, 0.0, ULPS_ELEMENTWISE);
    snprintf(what, sizeof what, "swiglu_bwd n=%lld offset %d dgate", (long long)n, off);
    CHECK_ERR(what, gt_nerr(dg, rdg, n), GT_TOL_BF16);
    /* dgate's factor 1 + g (1 - sigmoid(g)) cancels near g = -1.28: floored, and an fp32 sigmoid's
     * error there can move the rounding by one more step */
    CHECK_ULPS(what, dg, rdg, n, gt_rms(rdg, n) / 64, ULPS_REDUCTION);
    snprintf(what, sizeof what, "swiglu_bwd n=%lld offset %d dup", (long long)n, off);
    CHECK_ERR(what, gt_nerr(du, rdu, n), GT_TOL_BF16);
    CHECK_ULPS(what, du, rdu, n, 0.0, ULPS_ELEMENTWISE);
    CHECK_MSG(out[3] == 0.0f && dg[3] == 0.0f && du[3] == 0.0f, "swiglu at gate -100: %g %g %g", out[3], dg[3],
              du[3]);
    if (!off) {
        to_d(ref, dg, n);
        fd_check("swiglu_bwd dgate", swi_obj, &s, s.g, n, ref, GT_TOL_BF16);
        to_d(ref, du, n);
        fd_check("swiglu_bwd dup", swi_obj, &s, s.u, n, ref, GT_TOL_BF16);
    }
    dfree(dG), dfree(dU), dfree(dD), dfree(dO), dfree(dDG), dfree(dDU);
    free(g), free(u), free(dout), free(out), free(dg), free(du), free(tmp), free(s.g), free(s.u), free(s.dout);
    free(ref), free(rdg), free(rdu);
}

/* ---- AdamW ----------------------------------------------------------------------------------- */

/* One step against an fp64 reference of fm_backend.h's formula (bias correction at `step`,
 * weight decay, grad_scale). With a master: master's update tol 1e-4, m and v tol 1e-6, and p
 * is exactly bf16(master). Without (p is the weights, read as fp32): p_new is the bf16 rounding
 * of the reference p + update (within one bf16 step where the reference sits at a rounding
 * boundary). The learning rate is large (0.05) so the bf16 update is not lost in rounding. */
static void test_adamw(int step, float wd, float gs, bool with_master) {
    const int64_t n = 20001;
    const float lr = 5e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
    const float bc1 = 1.0f - powf(b1, (float)step), bc2 = 1.0f - powf(b2, (float)step);
    float *w = fnew(n), *g = fnew(n), *m = fnew(n), *v = fnew(n), *p = fnew(n);
    fill_normal(w, n, 1.0);
    if (!with_master) gt_round_bf16(w, n);
    for (int64_t i = 0; i < n; i++) p[i] = gt_bf16_to_f32(gt_f32_to_bf16(w[i]));
    fill_normal_bf(g, n, 1.0);
    fill_normal(m, n, step > 1 ? 0.1 : 0.0);
    for (int64_t i = 0; i < n; i++) v[i] = step > 1 ? (float)(0.01 * fabs(rnd_normal())) : 0.0f;
    double *rd = dnew(n), *rm = dnew(n), *rv = dnew(n);
    {
        double *wd_ = fm_ref_widen(w, n), *gd = fm_ref_widen(g, n), *md = fm_ref_widen(m, n), *vd = fm_ref_widen(v, n);
        fm_ref_adamw(rd, rm, rv, wd_, gd, md, vd, n, lr, b1, b2, eps, wd, bc1, bc2, gs);
        free(wd_), free(gd), free(md), free(vd);
    }
    void *dP = up_act(p, n), *dG = up_act(g, n), *dM = up_f32(m, n), *dV = up_f32(v, n);
    void *dW = with_master ? up_f32(w, n) : NULL;
    OPS->adamw(CTX, dP, dG, dW, dM, dV, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, gs);
    float *pn = fnew(n), *mn = fnew(n), *vn = fnew(n), *wn = fnew(n), *d = fnew(n);
    down_act(pn, dP, n);
    down_f32(mn, dM, n);
    down_f32(vn, dV, n);
    char what[128];
    snprintf(what, sizeof what, "adamw step %d wd %g grad_scale %g %s master", step, wd, gs,
             with_master ? "with" : "without");
    if (with_master) {
        down_f32(wn, dW, n);
        for (int64_t i = 0; i < n; i++) d[i] = (float)((double)wn[i] - (double)w[i]);
        CHECK_ERR(what, gt_nerr(d, rd, n), 1e-4);
        bool ok = true;
        for (int64_t i = 0; i < n; i++)
            if (gt_f32_to_bf16(wn[i]) != gt_f32_to_bf16(pn[i])) ok = false;
        CHECK_MSG(ok, "%s: p is not the bf16 rounding of the master", what);
    } else {
        /* Rounding the fp32 result to bf16 errs by at most half a bf16 step (2^(e-8) for
         * |ref| in [2^(e-1), 2^e)) plus the fp32 arithmetic's own error (slack). */
        int64_t bad = 0, bad_i = -1;
        for (int64_t i = 0; i < n; i++) {
            const double ref = (double)w[i] + rd[i];
            int e2 = 0;
            (void)frexp(fabs(ref), &e2);
            const double half_step = ldexp(1.0, e2 - 9), slack = 1e-6 * (fabs(w[i]) + fabs(rd[i]) + lr);
            if (!(fabs((double)pn[i] - ref) <= half_step + slack)) {
                if (bad_i < 0) bad_i = i;
                bad++;
            }
        }
        CHECK_MSG(bad == 0, "%s: %lld elements are not the bf16 rounding of p + update (first %lld: %.9g vs %.9g)",
                  what, (long long)bad, (long long)bad_i, bad_i >= 0 ? pn[bad_i] : 0.0,
                  bad_i >= 0 ? (double)w[bad_i] + rd[bad_i] : 0.0);
        double *pref = dnew(n);
        for (int64_t i = 0; i < n; i++) pref[i] = (double)w[i] + rd[i];
        CHECK_ULPS(what, pn, pref, n, gt_rms(pref, n) / 64, ULPS_ELEMENTWISE); /* w + update can cancel */
        free(pref);
    }
    snprintf(what, sizeof what, "adamw step %d %s master: m", step, with_master ? "with" : "without");
    CHECK_ERR(what, gt_nerr(mn, rm, n), 1e-6);
    snprintf(what, sizeof what, "adamw step %d %s master: v", step, with_master ? "with" : "without");
    CHECK_ERR(what, gt_nerr(vn, rv, n), 1e-6);
    dfree(dP), dfree(dG), dfree(dM), dfree(dV);
    if (dW) dfree(dW);
    free(w), free(g), free(m), free(v), free(p), free(rd), free(rm), free(rv), free(pn), free(mn), free(vn),
        free(wn), free(d);
}

/* bf16 moments (vector path and, one element off, the scalar path): from moments bf16 holds
 * exactly, the step with bf16 moments gives the same master and bf16 weights bit for bit as with
 * fp32 moments, and its moments are the fp32 ones rounded to nearest even. */
static void test_adamw_bf16_moments(int step, int off) {
    const int64_t n = 20001;
    const float lr = 5e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    const float bc1 = 1.0f - powf(b1, (float)step), bc2 = 1.0f - powf(b2, (float)step);
    float *w = fnew(n + 1), *g = fnew(n + 1), *m = fnew(n + 1), *v = fnew(n + 1);
    fill_normal(w, n + 1, 1.0);
    fill_normal_bf(g, n + 1, 1.0);
    fill_normal_bf(m, n + 1, step > 1 ? 0.1 : 0.0);
    for (int64_t i = 0; i <= n; i++) v[i] = step > 1 ? gt_bf16_to_f32(gt_f32_to_bf16((float)(0.01 * fabs(rnd_normal())))) : 0.0f;
    void *dP = up_act(w, n + 1), *dP2 = up_act(w, n + 1), *dG = up_act(g, n + 1), *dW = up_f32(w, n + 1),
         *dW2 = up_f32(w, n + 1), *dM = up_f32(m, n + 1), *dV = up_f32(v, n + 1), *dMh = up_act(m, n + 1),
         *dVh = up_act(v, n + 1);
    const size_t o4 = (size_t)off * 4, o2 = (size_t)off * 2;
    OPS->adamw(CTX, (fm_act *)((char *)dP + o2), (const fm_act *)((char *)dG + o2), (float *)((char *)dW + o4), (char *)dM + o4, (char *)dV + o4,
               FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, 1.0f);
    OPS->adamw(CTX, (fm_act *)((char *)dP2 + o2), (const fm_act *)((char *)dG + o2), (float *)((char *)dW2 + o4), (char *)dMh + o2,
               (char *)dVh + o2, FM_DTYPE_BF16, n, lr, b1, b2, eps, wd, bc1, bc2, 1.0f);
    void *p1 = down_raw(dP, (size_t)(n + 1) * 2), *p2 = down_raw(dP2, (size_t)(n + 1) * 2);
    void *w1 = down_raw(dW, (size_t)(n + 1) * 4), *w2 = down_raw(dW2, (size_t)(n + 1) * 4);
    CHECK_MSG(same_bits(p1, p2, (size_t)(n + 1) * 2) && same_bits(w1, w2, (size_t)(n + 1) * 4),
              "adamw bf16 moments step %d offset %d: weights differ from the fp32-moment step", step, off);
    float *mf = fnew(n + 1), *vf = fnew(n + 1);
    down_f32(mf, dM, n + 1);
    down_f32(vf, dV, n + 1);
    uint16_t *mb = down_raw(dMh, (size_t)(n + 1) * 2), *vb = down_raw(dVh, (size_t)(n + 1) * 2);
    int64_t bad = 0;
    for (int64_t i = off; i < n + off; i++)
        if (mb[i] != gt_f32_to_bf16(mf[i]) || vb[i] != gt_f32_to_bf16(vf[i])) bad++;
    CHECK_MSG(bad == 0, "adamw bf16 moments step %d offset %d: %lld moments are not the fp32 ones rounded", step, off,
              (long long)bad);
    dfree(dP), dfree(dP2), dfree(dG), dfree(dW), dfree(dW2), dfree(dM), dfree(dV), dfree(dMh), dfree(dVh);
    free(w), free(g), free(m), free(v), free(p1), free(p2), free(w1), free(w2), free(mf), free(vf), free(mb), free(vb);
}

/* ---- convert, memory ops --------------------------------------------------------------------- */

static uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16 round to nearest even, bit for bit against gpu_test.h's (ties both ways, Inf,
 * overflow to Inf, subnormals, NaN stays NaN); bf16 -> fp32 exact; same type: a copy, in place a
 * no-op. */
static void test_convert(void) {
    const int64_t n = 10007;
    float *x = fnew(n), *back = fnew(n);
    fill_normal(x, n, 10.0);
    x[0] = u2f(0x3F808000u); /* tie, even below: 0x3F80 */
    x[1] = u2f(0x3F818000u); /* tie, even above: 0x3F82 */
    x[2] = u2f(0xBF808001u); /* just above a tie */
    x[3] = INFINITY, x[4] = -INFINITY, x[5] = NAN, x[6] = FLT_MAX, x[7] = -0.0f;
    x[8] = u2f(0x00000123u), x[9] = u2f(0x807F8000u), x[10] = u2f(0x7F7F8000u);
    void *dx = up_f32(x, n), *db = up_nan(n, FM_DTYPE_BF16), *df = up_nan(n, FM_DTYPE_F32);
    OPS->convert(CTX, db, FM_DTYPE_BF16, dx, FM_DTYPE_F32, n);
    uint16_t *hb = down_raw(db, (size_t)n * 2);
    bool ok = true;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t want = gt_f32_to_bf16(x[i]);
        if (isnan(x[i]) ? !isnan(gt_bf16_to_f32(hb[i])) : hb[i] != want) {
            if (ok) fprintf(stderr, "convert f32->bf16 [%lld]: 0x%08x -> 0x%04x, want 0x%04x\n", (long long)i,
                            f2u(x[i]), hb[i], want);
            ok = false;
        }
    }
    CHECK_MSG(ok, "convert f32->bf16 is not round-to-nearest-even");
    OPS->convert(CTX, df, FM_DTYPE_F32, db, FM_DTYPE_BF16, n);
    down_f32(back, df, n);
    ok = true;
    for (int64_t i = 0; i < n; i++) {
        const float want = gt_bf16_to_f32(hb[i]);
        if (isnan(want) ? !isnan(back[i]) : f2u(back[i]) != f2u(want)) ok = false;
    }
    CHECK_MSG(ok, "convert bf16->f32 is not exact");
    OPS->convert(CTX, db, FM_DTYPE_BF16, db, FM_DTYPE_BF16, n); /* in place, same type */
    uint16_t *hb2 = down_raw(db, (size_t)n * 2);
    CHECK_MSG(same_bits(hb, hb2, (size_t)n * 2), "convert bf16->bf16 in place changed the data");
    void *df2 = up_nan(n, FM_DTYPE_F32);
    OPS->convert(CTX, df2, FM_DTYPE_F32, dx, FM_DTYPE_F32, n);
    float *h2 = down_raw(df2, (size_t)n * 4);
    CHECK_MSG(same_bits(h2, x, (size_t)n * 4), "convert f32->f32 is not a copy");
    dfree(dx), dfree(db), dfree(df), dfree(df2);
    free(x), free(back), free(hb), free(hb2), free(h2);
}

static void test_memory(void) {
    const size_t nb = 100001;
    unsigned char *p = OPS->mem_alloc(CTX, nb);
    CHECK(p != NULL);
    CHECK_MSG(((uintptr_t)p & 255u) == 0, "mem_alloc: %p is not 256-byte aligned", (void *)p);
    unsigned char *h = down_raw(p, nb);
    bool zero = true;
    for (size_t i = 0; i < nb; i++)
        if (h[i]) zero = false;
    CHECK_MSG(zero, "mem_alloc: not zero-filled");
    OPS->mem_set(CTX, p + 3, 0xAB, 777);
    free(h);
    h = down_raw(p, nb);
    bool ok = h[2] == 0 && h[3 + 777] == 0;
    for (size_t i = 3; i < 3 + 777; i++)
        if (h[i] != 0xAB) ok = false;
    CHECK_MSG(ok, "mem_set: wrong bytes");
    unsigned char *q = OPS->mem_alloc(CTX, nb);
    OPS->copy(CTX, q, p, nb, FM_COPY_D2D);
    unsigned char *h2 = down_raw(q, nb);
    CHECK_MSG(same_bits(h, h2, nb), "copy D2D: bytes differ");
    OPS->sync(CTX);
    /* An allocation the device cannot serve is NULL, and the backend stays usable. */
    void *huge = OPS->mem_alloc(CTX, (size_t)1 << 50);
    CHECK(huge == NULL);
    CHECK_MSG(OPS->status(CTX) == FM_OK, "an allocation the device cannot serve must not set the sticky status");
    float one = 2.0f;
    void *d = up_act(&one, 1);
    double *d_sq = gt_dev_f64(&g_be, 1);
    OPS->sumsq(CTX, d_sq, d, 1, false);
    CHECK(gt_read_f64(&g_be, d_sq) == 4.0);
    dfree(d), dfree(d_sq);
    OPS->mem_free(CTX, NULL);
    dfree(p), dfree(q);
    free(h), free(h2);
}

/* Buffer kinds: each non-NULL and zero-filled (PINNED and HOST read on the host, DEVICE through a
 * copy), a pinned allocation the host cannot serve is NULL without touching the sticky status. */
static void test_buffers(void) {
    const size_t nb = 300007;
    for (int kind = 0; kind < FM_BUFFER_KINDS; kind++) {
        unsigned char *p = OPS->buffer_alloc(CTX, (fm_buffer_kind)kind, nb);
        CHECK_MSG(p != NULL, "buffer_alloc kind %d: NULL", kind);
        if (!p) continue;
        unsigned char *h = kind == FM_BUFFER_DEVICE ? down_raw(p, nb) : p;
        bool zero = true;
        for (size_t i = 0; i < nb; i++) zero &= h[i] == 0;
        CHECK_MSG(zero, "buffer_alloc kind %d: not zero-filled", kind);
        if (kind != FM_BUFFER_DEVICE) memset(p, 0x5A, nb); /* host-writable */
        else free(h);
        OPS->buffer_free(CTX, (fm_buffer_kind)kind, p);
    }
    OPS->buffer_free(CTX, FM_BUFFER_PINNED, NULL);
    CHECK(OPS->buffer_alloc(CTX, FM_BUFFER_PINNED, (size_t)1 << 52) == NULL);
    CHECK_MSG(OPS->status(CTX) == FM_OK, "a failed pinned allocation set the sticky status: %s", fm_errmsg());
}

/* copy_async on the copy-in and copy-out streams, ordered against the compute stream by events:
 * pinned host -> device on copy-in; compute waits for it (event_wait) and converts fp32 -> bf16
 * -> fp32 (exact on these values); copy-out waits for compute and copies the result to pinned
 * memory; the host waits once (event_sync) and checks every value. 64 MiB, so that a missing
 * wait would let a kernel or copy run over data not yet there. No host sync before the
 * event_sync. Done twice (the events and buffers reused). */
static void test_streams(void) {
    const int64_t n = (int64_t)1 << 24;
    const size_t bytes = (size_t)n * 4;
    float *hin = OPS->buffer_alloc(CTX, FM_BUFFER_PINNED, bytes), *hout = OPS->buffer_alloc(CTX, FM_BUFFER_PINNED, bytes);
    void *a = OPS->mem_alloc(CTX, bytes), *c16 = OPS->mem_alloc(CTX, (size_t)n * 2), *b = OPS->mem_alloc(CTX, bytes);
    CHECK(hin && hout && a && c16 && b);
    if (!(hin && hout && a && c16 && b)) return;
    const int ev_in = FM_EVENT_FIRST_FREE, ev_done = FM_EVENT_FIRST_FREE + 1, ev_out = FM_EVENT_FIRST_FREE + 2;
    for (int rep = 0; rep < 2; rep++) {
        for (int64_t i = 0; i < n; i++) hin[i] = 0.5f * (float)((i * 7 + rep) % 251 - 125); /* exact in bf16 */
        for (int64_t i = 0; i < n; i++) hout[i] = NAN;
        OPS->mem_set(CTX, b, 0xff, bytes);
        OPS->sync(CTX);
        const uint64_t h0 = OPS->host_sync_count(CTX);
        OPS->copy_async(CTX, a, hin, bytes, FM_COPY_H2D, FM_STREAM_COPY_IN);
        OPS->event_record(CTX, ev_in, FM_STREAM_COPY_IN);
        OPS->event_wait(CTX, FM_STREAM_COMPUTE, ev_in);
        OPS->convert(CTX, c16, FM_DTYPE_BF16, a, FM_DTYPE_F32, n);
        OPS->convert(CTX, b, FM_DTYPE_F32, c16, FM_DTYPE_BF16, n);
        OPS->event_record(CTX, ev_done, FM_STREAM_COMPUTE);
        OPS->event_wait(CTX, FM_STREAM_COPY_OUT, ev_done);
        OPS->copy_async(CTX, hout, b, bytes, FM_COPY_D2H, FM_STREAM_COPY_OUT);
        OPS->event_record(CTX, ev_out, FM_STREAM_COPY_OUT);
        CHECK_MSG(OPS->host_sync_count(CTX) == h0, "copy_async / event_record / event_wait made the host wait");
        OPS->event_sync(CTX, ev_out);
        CHECK_MSG(OPS->host_sync_count(CTX) == h0 + 1, "event_sync is not one host sync");
        int64_t bad = -1;
        for (int64_t i = 0; i < n && bad < 0; i++)
            if (hout[i] != hin[i]) bad = i;
        CHECK_MSG(bad < 0, "streams (pass %d): element %lld is %g, want %g", rep, (long long)bad,
                  bad < 0 ? 0.0 : (double)hout[bad], bad < 0 ? 0.0 : (double)hin[bad]);
    }
    /* stream_sync of each copy stream counts one host sync each */
    const uint64_t h1 = OPS->host_sync_count(CTX);
    OPS->stream_sync(CTX, FM_STREAM_COPY_IN);
    OPS->stream_sync(CTX, FM_STREAM_COPY_OUT);
    CHECK(OPS->host_sync_count(CTX) == h1 + 2);
    CHECK_MSG(OPS->status(CTX) == FM_OK, "status after the stream test: %s", fm_errmsg());
    OPS->buffer_free(CTX, FM_BUFFER_PINNED, hin), OPS->buffer_free(CTX, FM_BUFFER_PINNED, hout);
    dfree(a), dfree(c16), dfree(b);
}

/* ---- timings (printed, not checked) ---------------------------------------------------------- */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Device buffer of n random bf16 values in [-1, 1) (fp32 staged through convert). */
static void *rand_act(int64_t n) {
    float *h = fnew(n);
    for (int64_t i = 0; i < n; i++) h[i] = (float)(fm_rng_u64(&g_rng) >> 40) * (2.0f / 16777216.0f) - 1.0f;
    void *f = up_f32(h, n), *b = OPS->mem_alloc(CTX, (size_t)n * 2 + 256);
    OPS->convert(CTX, b, FM_DTYPE_BF16, f, FM_DTYPE_F32, n);
    dfree(f);
    free(h);
    return b;
}

#define TIME_OP(label, reps, bytes, flops, call)                                                         \
    do {                                                                                                 \
        call;                                                                                            \
        OPS->sync(CTX);                                                                                  \
        const double t0_ = now_s();                                                                      \
        for (int r_ = 0; r_ < (reps); r_++) call;                                                        \
        OPS->sync(CTX);                                                                                  \
        const double dt_ = (now_s() - t0_) / (reps);                                                     \
        printf("time %-44s %9.3f ms", label, dt_ * 1e3);                                                  \
        if ((bytes) > 0) printf("  %7.0f GB/s", (double)(bytes) / dt_ * 1e-9);                          \
        if ((flops) > 0) printf("  %7.1f TFLOP/s", (double)(flops) / dt_ * 1e-12);                      \
        printf("\n");                                                                                    \
    } while (0)

static void timings(void) {
    {
        const int64_t S = 8192;
        void *A = rand_act(S * S), *B = rand_act(S * S), *C = OPS->mem_alloc(CTX, (size_t)(S * S) * 4);
        TIME_OP("gemm 8192^3 (0,1) C bf16", 10, 0, 2.0 * S * S * S,
                OPS->gemm(CTX, false, true, S, S, S, 1.0f, A, S, B, S, 0.0f, C, FM_DTYPE_BF16, S));
        TIME_OP("gemm 8192^3 (1,0) C f32 beta=1", 10, 0, 2.0 * S * S * S,
                OPS->gemm(CTX, true, false, S, S, S, 1.0f, A, S, B, S, 1.0f, C, FM_DTYPE_F32, S));
        dfree(A), dfree(B), dfree(C);
    }
    {
        const int64_t N = 16384, D = 4096, nd = N * D;
        void *x = rand_act(nd), *w = rand_act(D), *g = rand_act(nd), *o = OPS->mem_alloc(CTX, (size_t)nd * 2),
             *dw = OPS->mem_alloc(CTX, (size_t)D * 2), *rs = OPS->mem_alloc(CTX, (size_t)N * 4);
        TIME_OP("rmsnorm_fwd 16384x4096", 20, 4.0 * nd, 0, OPS->rmsnorm_fwd(CTX, o, rs, x, w, N, D, 1e-6f));
        TIME_OP("rmsnorm_bwd 16384x4096", 20, 8.0 * nd, 0, OPS->rmsnorm_bwd(CTX, o, dw, g, x, w, rs, N, D));
        TIME_OP("add 64M", 20, 6.0 * nd, 0, OPS->add(CTX, o, x, nd));
        TIME_OP("swiglu_fwd 64M", 20, 6.0 * nd, 0, OPS->swiglu_fwd(CTX, o, x, g, nd));
        double *sq = gt_dev_f64(&g_be, 1);
        TIME_OP("sumsq 64M", 20, 2.0 * nd, 0, OPS->sumsq(CTX, sq, x, nd, false));
        dfree(sq);
        void *tab = OPS->mem_alloc(CTX, (size_t)4096 * 64 * 4);
        TIME_OP("rope_fwd B=4 T=4096 nh=32 hd=128", 20, 4.0 * nd, 0, OPS->rope_fwd(CTX, x, tab, tab, 4, 4096, 32, 128));
        dfree(tab);
        const int64_t V = 50000, NT = 16384;
        int32_t *tok = inew(NT);
        for (int64_t i = 0; i < NT; i++) tok[i] = (int32_t)fm_rng_below(&g_rng, 1000); /* many repeats */
        void *dtok = up_i32(tok, NT), *wte = OPS->mem_alloc(CTX, (size_t)(V * D) * 2);
        TIME_OP("embedding_fwd N=16384 H=4096", 20, 4.0 * nd, 0, OPS->embedding_fwd(CTX, o, dtok, wte, NT, D));
        TIME_OP("embedding_bwd N=16384 H=4096 (1000 ids)", 5, 0, 0, OPS->embedding_bwd(CTX, wte, g, dtok, NT, D));
        dfree(x), dfree(w), dfree(g), dfree(o), dfree(dw), dfree(rs), dfree(dtok), dfree(wte);
        free(tok);
    }
    {
        /* OLMoE-1B-7B expert shapes (E 64, top-8, H 2048, I 1024): rows per expert drawn around
         * 512 (4096 tokens) and around 2048 (16K tokens), some experts twice as busy as others. */
        const int64_t E = 64, H = 2048, I = 1024;
        for (int rep = 0; rep < 2; rep++) {
            const int64_t avg = rep ? 2048 : 512;
            int64_t off[65];
            off[0] = 0;
            for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + avg / 2 + (int64_t)fm_rng_below(&g_rng, (uint64_t)avg);
            const int64_t R = off[E];
            void *x = rand_act(R * H), *W = rand_act(E * I * H), *y = rand_act(R * I), *dx = rand_act(R * H),
                 *dW = rand_act(E * I * H);
            const char *mode = getenv("FLATMOE_EXPERT_GEMM");
            char l1[96], l2[96];
            snprintf(l1, sizeof l1, "expert fwd 64x[~%lld,2048]x[1024] (%s)", (long long)avg, mode ? mode : "default");
            snprintf(l2, sizeof l2, "expert bwd 64x[~%lld,1024] (%s)", (long long)avg, mode ? mode : "default");
            TIME_OP(l1, 20, 0, 2.0 * R * H * I, fm_expert_linear_fwd(&g_be, y, x, W, off, E, H, I));
            TIME_OP(l2, 20, 0, 4.0 * R * H * I, fm_expert_linear_bwd(&g_be, dx, 0.0f, dW, y, x, W, off, E, H, I));
            dfree(x), dfree(W), dfree(y), dfree(dx), dfree(dW);
        }
    }
    {
        const int64_t n = (int64_t)1 << 27;
        void *p = rand_act(n), *g = rand_act(n), *mw = OPS->mem_alloc(CTX, (size_t)n * 4),
             *m = OPS->mem_alloc(CTX, (size_t)n * 4), *v = OPS->mem_alloc(CTX, (size_t)n * 4);
        TIME_OP("adamw 128M with master", 10, 28.0 * n, 0,
                OPS->adamw(CTX, p, g, mw, m, v, FM_DTYPE_F32, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 0.5f, 1.0f));
        TIME_OP("adamw 128M with master, bf16 moments", 10, 20.0 * n, 0,
                OPS->adamw(CTX, p, g, mw, m, v, FM_DTYPE_BF16, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 0.5f, 1.0f));
        dfree(p), dfree(g), dfree(mw), dfree(m), dfree(v);
    }
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20241129));
    const double t0 = now_s();
    test_init_errors();
    fm_status s = gt_cuda_init(&g_be, 0, 128, 0);
    if (s != FM_OK) {
        fprintf(stderr, "cannot create the CUDA backend: %s: %s\n", fm_status_name(s), fm_errmsg());
        CHECK(s == FM_OK);
        return fm_test_finish();
    }
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK(strcmp(OPS->name, "cuda") == 0);

    test_memory();
    test_buffers();
    test_streams();
    test_convert();
    test_gemm();
    test_expert_linear();
    test_add();
    test_sumsq();
    test_embedding(40, 11, 130, true);    /* scalar path (H % 8 != 0) */
    test_embedding(100, 11, 256, true);   /* 16-byte path */
    test_embedding(5000, 300, 72, false); /* many runs of repeated ids */
    test_embedding(300000, 500, 16, false); /* more than one sort chunk (2^18 tokens) */
    test_rmsnorm(9, 130, 1.5, true);
    test_rmsnorm(40, 16, 1.5, true); /* QK-norm shape: rows = tokens*heads, D = head_dim */
    test_rmsnorm(80, 256, 1.5, true);
    test_rmsnorm(20, 64, 3e-3, true); /* mean(x^2) ~ eps: eps must enter like the reference */
    test_rmsnorm(20000, 64, 1.0, false); /* 500 row chunks for dw */
    test_rmsnorm(1000, 2050, 1.0, false); /* wide, scalar path */
    test_rope(2, 5, 8, 3, 16);   /* 16-byte path (hd/2 % 8 == 0) */
    test_rope(2, 40, 48, 4, 64);
    test_rope(2, 7, 9, 3, 12);   /* scalar path */
    test_swiglu(9001, 0);
    test_swiglu(9001, 1);
    test_swiglu(64, 0);
    test_adamw(1, 0.0f, 1.0f, true);
    test_adamw(5, 0.1f, 0.5f, true);
    test_adamw(1, 0.0f, 1.0f, false);
    test_adamw(5, 0.1f, 0.5f, false);
    test_adamw_bf16_moments(1, 0);
    test_adamw_bf16_moments(6, 0);
    test_adamw_bf16_moments(6, 1); /* unaligned: the scalar path */
    CHECK_BACKEND_OK(&g_be); /* no op above recorded an error */
    printf("checks done in %.2f s\n", now_s() - t0);
    if (!getenv("FLATMOE_GPU_NO_TIMINGS")) timings();

    fm_cuda_backend_free(&g_be);
    CHECK(g_be.ops == NULL && g_be.ctx == NULL);
    printf("time %.2f s\n", now_s() - t0);
    return fm_test_finish();
}
