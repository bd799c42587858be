/* CPU backend ops (src/backend/cpu) against the plain fp64 references of tests/fm_ref_ops.c
 * (shared with the CUDA op tests).
 *
 * For every op: the forward against a naive fp64 loop (naive full-matrix softmax for attention)
 * on random inputs from a fixed, printed seed, with outputs poisoned (NaN) before each call so an
 * unwritten element fails; the backward against central finite differences (h = 1e-6, fp64) of
 * the reference forward of a random objective L = sum(dout o f(x)), for every input that has a
 * gradient. Activation gradients are poisoned (NaN) to prove they are ASSIGNED; parameter
 * gradients are pre-filled with 1.0 to prove they ACCUMULATE.
 *
 * Error measure: normalized max error max|got - ref| / max|ref| ("nerr"), NaN/Inf counted as
 * infinite. Tolerances are stated per op: fp32 against fp64 is ~1e-7 per rounding, so forward
 * ops use 1e-5 (more for long sums), gradients 1e-4 (fp32 backward vs fp64 finite differences).
 */
#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_ref_ops.h"
#include "fm_test.h"

#include <float.h>
#include <stdint.h>
#include <time.h>

static fm_backend g_be;
static const fm_ops *OPS;

/* The reductions leave their result in backend memory (no host sync inside an op); on the CPU
 * that is host memory, so these read it directly. */
static double sumsq_(const fm_ops *o, void *c, const float *x, int64_t n) {
    double r = -1;
    o->sumsq(c, &r, x, n, false);
    return r;
}
static double router_stats_(const fm_ops *o, void *c, float *count, float *ps, const float *probs, const float *lse,
                            const int32_t *idx, int64_t N, int64_t E, int64_t k) {
    double z = -1;
    o->router_stats(c, count, ps, &z, probs, lse, idx, N, E, k);
    return z;
}
static double cross_entropy_(const fm_ops *o, void *c, float *loss, float *dl, const float *logits, const int32_t *tg,
                             int64_t N, int64_t V, float gs, int32_t ignore) {
    double sum = -1;
    o->cross_entropy(c, loss, dl, logits, tg, N, V, gs, ignore, &sum);
    return sum;
}
static void *CTX;
static fm_rng g_rng;

/* ---- helpers ---------------------------------------------------------------------------- */

static double rnd_normal(void) { return fm_rng_normal(&g_rng); }
static double rnd_uniform(double lo, double hi) {
    return lo + (hi - lo) * fm_rng_uniform_d(&g_rng);
}
static void fill_normal(float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * rnd_normal());
}
static void fill_uniform(float *x, int64_t n, double lo, double hi) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)rnd_uniform(lo, hi);
}
static void fill_const(float *x, int64_t n, float c) {
    for (int64_t i = 0; i < n; i++) x[i] = c;
}
static void poison(float *x, int64_t n) { fill_const(x, n, NAN); }
static void to_d(double *d, const float *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = f[i];
}
/* g[i] - base (an accumulated gradient minus its pre-fill), in double. */
static void minus_d(double *d, const float *f, float base, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = (double)f[i] - (double)base;
}
static bool all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

/* max|got - ref| / max(max|ref|, floor); infinite when got holds a NaN or Inf. */
static double nerr(const float *got, const double *ref, int64_t n, double floor) {
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

typedef double (*objective_fn)(void *state);

enum { FD_ELEMS = 24, FD_DIRS = 3 };
static const double FD_H = 1e-6;
/* A directional difference averages the rounding noise of n elements, so it is held to a
 * tighter tolerance than single elements: it catches a gradient off by a relative 1e-4
 * everywhere (a wrong constant), which single elements at tol 1e-4 cannot. */
static const double FD_DIR_TOL_FACTOR = 0.1;

/* Checks `grad` (the op's gradient of the objective w.r.t. x, n elements) against central
 * differences (f(x+h e) - f(x-h e)) / 2h of the fp64 objective `f`, which reads x (a double
 * copy of the op's input, perturbed here in place and restored). Elementwise on every element
 * when n <= FD_ELEMS, else on FD_ELEMS random ones, error normalized by max(max|grad|, floor);
 * then on FD_DIRS random directions u over the whole vector (<grad, u> against the directional
 * difference, normalized by max(sum|grad_i u_i|, floor sum|u_i|), tolerance
 * tol * FD_DIR_TOL_FACTOR), which sees an error in any element. `floor` only matters where the
 * exact gradient is ~0; h is the step (FD_H, larger where the objective is huge). */
static void fd_check_ex(const char *what, objective_fn f, void *st, double *x, int64_t n,
                        const double *grad, double tol, double floor, double h) {
    double gmax = floor > 1e-12 ? floor : 1e-12;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(grad[i])) {
            CHECK_MSG(0, "%s: gradient element %lld is %g", what, (long long)i, grad[i]);
            return;
        }
        gmax = fabs(grad[i]) > gmax ? fabs(grad[i]) : gmax;
    }
    double worst = 0;
    int64_t worst_i = -1;
    double worst_fd = 0;
    const int64_t ne = n <= FD_ELEMS ? n : FD_ELEMS;
    for (int64_t s = 0; s < ne; s++) {
        const int64_t i = n <= FD_ELEMS ? s : (int64_t)fm_rng_below(&g_rng, (uint64_t)n);
        const double x0 = x[i];
        x[i] = x0 + h;
        const double fp = f(st);
        x[i] = x0 - h;
        const double fm = f(st);
        x[i] = x0;
        const double fd = (fp - fm) / (2 * h);
        const double e = fabs(fd - grad[i]) / (gmax > fabs(fd) ? gmax : fabs(fd));
        if (e > worst) {
            worst = e;
            worst_i = i;
            worst_fd = fd;
        }
    }
    CHECK_MSG(worst <= tol,
              "%s: element %lld: op %.9g vs finite difference %.9g (nerr %.3g > %.3g)", what,
              (long long)worst_i, worst_i >= 0 ? grad[worst_i] : 0.0, worst_fd, worst, tol);
    double *x0 = dnew(n), *u = dnew(n);
    memcpy(x0, x, (size_t)n * sizeof(double));
    for (int d = 0; d < FD_DIRS; d++) {
        double an = 0, mag = 1e-300, umag = 0;
        for (int64_t i = 0; i < n; i++) {
            u[i] = rnd_normal();
            an += grad[i] * u[i];
            mag += fabs(grad[i] * u[i]);
            umag += fabs(u[i]);
        }
        mag = mag > floor * umag ? mag : floor * umag;
        for (int64_t i = 0; i < n; i++) x[i] = x0[i] + h * u[i];
        const double fp = f(st);
        for (int64_t i = 0; i < n; i++) x[i] = x0[i] - h * u[i];
        const double fm = f(st);
        memcpy(x, x0, (size_t)n * sizeof(double));
        const double fd = (fp - fm) / (2 * h), e = fabs(fd - an) / mag;
        const double dtol = tol * FD_DIR_TOL_FACTOR;
        CHECK_MSG(e <= dtol,
                  "%s: direction %d: <grad,u> %.9g vs finite difference %.9g (nerr %.3g > %.3g)",
                  what, d, an, fd, e, dtol);
    }
    free(x0);
    free(u);
}

static void fd_check(const char *what, objective_fn f, void *st, double *x, int64_t n,
                     const double *grad, double tol) {
    fd_check_ex(what, f, st, x, n, grad, tol, 0.0, FD_H);
}

/* ---- backend init ------------------------------------------------------------------------- */

static void test_init_errors(void) {
    fm_backend b;
    CHECK(fm_cpu_backend_init(&b, -1, 64) == FM_ERR_ARG);
    CHECK(fm_cpu_backend_init(&b, 1, 0) == FM_ERR_ARG);
    CHECK(b.ops == NULL && b.ctx == NULL);
    fm_fault_set(1);
    CHECK(fm_cpu_backend_init(&b, 2, 64) == FM_ERR_NOMEM);
    fm_fault_set(2);
    CHECK(fm_cpu_backend_init(&b, 2, 64) == FM_ERR_NOMEM);
    fm_fault_set(0);
    CHECK(fm_cpu_backend_scratch_bytes(2, 128) > fm_cpu_backend_scratch_bytes(1, 128));
    CHECK(fm_cpu_backend_scratch_bytes(1, 128) > fm_cpu_backend_scratch_bytes(1, 32));
    CHECK(fm_cpu_backend_scratch_bytes(-1, 128) == 0);
}

/* ---- gemm --------------------------------------------------------------------------------- */

/* All four transpose combinations, alpha/beta, leading dimensions wider than the matrices (the
 * padding must stay untouched), beta = 0 over a NaN-poisoned C, and K = 0. Tol 1e-5. */
static void test_gemm(void) {
    const int64_t M = 37, N = 29, K = 23;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            const int64_t arows = ta ? K : M, acols = ta ? M : K, lda = acols + 5;
            const int64_t brows = tb ? N : K, bcols = tb ? K : N, ldb = bcols + 3;
            const int64_t ldc = N + 7;
            float *A = fnew(arows * lda), *Bm = fnew(brows * ldb), *Cm = fnew(M * ldc),
                  *C0 = fnew(M * ldc);
            fill_normal(A, arows * lda, 1.0);
            fill_normal(Bm, brows * ldb, 1.0);
            fill_normal(C0, M * ldc, 1.0);
            double *ref = dnew(M * N), *ab = dnew(M * N);
            double *Ad = fm_ref_widen(A, arows * lda), *Bd = fm_ref_widen(Bm, brows * ldb);
            fm_ref_gemm(ab, ta, tb, M, N, K, Ad, lda, Bd, ldb);
            free(Ad), free(Bd);
            const float alpha = 0.7f, beta = 0.3f;
            memcpy(Cm, C0, (size_t)(M * ldc) * sizeof(float));
            OPS->gemm(CTX, ta, tb, M, N, K, alpha, A, lda, Bm, ldb, beta, Cm, FM_DTYPE_F32, ldc);
            float *got = fnew(M * N);
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++) {
                    ref[i * N + j] = alpha * ab[i * N + j] + (double)beta * C0[i * ldc + j];
                    got[i * N + j] = Cm[i * ldc + j];
                }
            char what[64];
            snprintf(what, sizeof what, "gemm(%d,%d) alpha,beta", ta, tb);
            CHECK_ERR(what, nerr(got, ref, M * N, 1e-30), 1e-5);
            bool pad_ok = true;
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = N; j < ldc; j++)
                    if (memcmp(&Cm[i * ldc + j], &C0[i * ldc + j], sizeof(float))) pad_ok = false;
            CHECK_MSG(pad_ok, "gemm(%d,%d): columns between N and ldc were written", ta, tb);
            /* beta = 0 must overwrite a NaN C. */
            for (int64_t i = 0; i < M; i++) poison(Cm + i * ldc, N);
            OPS->gemm(CTX, ta, tb, M, N, K, 1.0f, A, lda, Bm, ldb, 0.0f, Cm, FM_DTYPE_F32, ldc);
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++) got[i * N + j] = Cm[i * ldc + j];
            snprintf(what, sizeof what, "gemm(%d,%d) beta=0 over NaN", ta, tb);
            CHECK_ERR(what, nerr(got, ab, M * N, 1e-30), 1e-5);
            free(A), free(Bm), free(Cm), free(C0), free(ref), free(ab), free(got);
        }
    /* K = 0: C = beta * C. */
    float C[6] = {1, 2, 3, 4, 5, 6}, dummy = 0;
    OPS->gemm(CTX, false, false, 2, 3, 0, 1.0f, &dummy, 0, &dummy, 3, 0.5f, C, FM_DTYPE_F32, 3);
    CHECK(C[0] == 0.5f && C[5] == 3.0f);
}

/* ---- add, sumsq --------------------------------------------------------------------------- */

static void test_add_sumsq(void) {
    const int64_t n = 100003;
    float *y = fnew(n), *x = fnew(n), *y0 = fnew(n);
    fill_normal(y, n, 1.0);
    fill_normal(x, n, 1.0);
    memcpy(y0, y, (size_t)n * sizeof(float));
    OPS->add(CTX, y, x, n);
    bool exact = true;
    for (int64_t i = 0; i < n; i++)
        if (y[i] != (float)((double)y0[i] + (double)x[i])) exact = false;
    CHECK_MSG(exact, "add: y += x is not the correctly rounded fp32 sum");

    const int64_t ns[] = {0, 1, 5, 255, 257, 1000003};
    for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++) {
        const int64_t m = ns[c];
        float *z = fnew(m);
        fill_normal(z, m, 3.0);
        double ref = 0;
        for (int64_t i = 0; i < m; i++) ref += (double)z[i] * z[i];
        double got = sumsq_(OPS, CTX, z, m), again = sumsq_(OPS, CTX, z, m);
        CHECK_CLOSE(got, ref, 1e-12);
        CHECK_MSG(memcmp(&got, &again, sizeof got) == 0, "sumsq(n=%lld) not deterministic",
                  (long long)m);
        free(z);
    }
    free(y), free(x), free(y0);
}

/* ---- embedding ---------------------------------------------------------------------------- */

typedef struct emb_st {
    double *wte, *dout;
    const int32_t *tok;
    int64_t N, H;
} emb_st;

static double emb_obj(void *p) {
    emb_st *s = p;
    double L = 0;
    for (int64_t n = 0; n < s->N; n++)
        for (int64_t j = 0; j < s->H; j++)
            L += s->dout[n * s->H + j] * s->wte[s->tok[n] * s->H + j];
    return L;
}

/* fwd exact (a copy); bwd accumulates (pre-fill 1.0) with repeated tokens, columns spanning
 * several 64-column blocks, an unused row untouched; FD tol 1e-5. */
static void test_embedding(int64_t N) {
    const int64_t V = 11, H = 130;
    int32_t *tok = inew(N);
    for (int64_t n = 0; n < N; n++) tok[n] = (int32_t)fm_rng_below(&g_rng, V - 1); /* V-1 unused */
    tok[3] = tok[7] = tok[30] = 4;
    float *wte = fnew(V * H), *out = fnew(N * H), *dout = fnew(N * H), *dwte = fnew(V * H);
    fill_normal(wte, V * H, 1.0);
    fill_normal(dout, N * H, 1.0);
    poison(out, N * H);
    OPS->embedding_fwd(CTX, out, tok, wte, N, H);
    bool ok = true;
    for (int64_t n = 0; n < N; n++)
        if (memcmp(out + n * H, wte + tok[n] * H, (size_t)H * sizeof(float))) ok = false;
    CHECK_MSG(ok, "embedding_fwd: rows differ from wte[tokens]");

    fill_const(dwte, V * H, 1.0f);
    OPS->embedding_bwd(CTX, dwte, dout, tok, N, H);
    bool untouched = true;
    for (int64_t j = 0; j < H; j++)
        if (dwte[(V - 1) * H + j] != 1.0f) untouched = false;
    CHECK_MSG(untouched, "embedding_bwd: a row no token uses changed");
    emb_st s = {dnew(V * H), dnew(N * H), tok, N, H};
    to_d(s.wte, wte, V * H);
    to_d(s.dout, dout, N * H);
    double *g = dnew(V * H);
    minus_d(g, dwte, 1.0f, V * H);
    fd_check("embedding_bwd dwte (accumulated)", emb_obj, &s, s.wte, V * H, g, 1e-5);
    free(tok), free(wte), free(out), free(dout), free(dwte), free(s.wte), free(s.dout), free(g);
}

/* ---- RMSNorm ------------------------------------------------------------------------------ */

typedef struct rms_st {
    double *x, *w, *dout;
    int64_t N, D;
    double eps;
} rms_st;

/* sum(a o b) over n elements. */
static double dot_d(const double *a, const double *b, int64_t n) {
    double L = 0;
    for (int64_t i = 0; i < n; i++) L += a[i] * b[i];
    return L;
}

static double rms_obj(void *p) {
    rms_st *s = p;
    double *y = dnew(s->N * s->D);
    fm_ref_rmsnorm_fwd(y, NULL, s->x, s->w, s->N, s->D, s->eps);
    const double L = dot_d(s->dout, y, s->N * s->D);
    free(y);
    return L;
}

/* x ~ N(0, x_scale^2). fwd out and rstd tol 1e-5; bwd dx (assigned) and dw (accumulated) vs FD
 * tol 1e-5. */
static void test_rmsnorm(int64_t N, int64_t D, double x_scale) {
    const float eps = 1e-5f;
    float *x = fnew(N * D), *w = fnew(D), *out = fnew(N * D), *rstd = fnew(N), *dout = fnew(N * D),
          *dx = fnew(N * D), *dw = fnew(D);
    fill_normal(x, N * D, x_scale);
    fill_uniform(w, D, 0.5, 1.5);
    fill_normal(dout, N * D, 1.0);
    poison(out, N * D);
    poison(rstd, N);
    OPS->rmsnorm_fwd(CTX, out, rstd, x, w, N, D, eps);
    rms_st s = {dnew(N * D), dnew(D), dnew(N * D), N, D, eps};
    to_d(s.x, x, N * D);
    to_d(s.w, w, D);
    to_d(s.dout, dout, N * D);
    double *rout = dnew(N * D), *rr = dnew(N);
    fm_ref_rmsnorm_fwd(rout, rr, s.x, s.w, N, D, eps);
    CHECK_ERR("rmsnorm_fwd out", nerr(out, rout, N * D, 1e-30), 1e-5);
    CHECK_ERR("rmsnorm_fwd rstd", nerr(rstd, rr, N, 1e-30), 1e-5);
    poison(dx, N * D);
    fill_const(dw, D, 1.0f);
    OPS->rmsnorm_bwd(CTX, dx, dw, dout, x, w, rstd, N, D);
    double *g = dnew(N * D);
    to_d(g, dx, N * D);
    fd_check("rmsnorm_bwd dx", rms_obj, &s, s.x, N * D, g, 1e-5);
    minus_d(g, dw, 1.0f, D);
    fd_check("rmsnorm_bwd dw (accumulated)", rms_obj, &s, s.w, D, g, 1e-5);
    free(x), free(w), free(out), free(rstd), free(dout), free(dx), free(dw);
    free(s.x), free(s.w), free(s.dout), free(rout), free(rr), free(g);
}

/* ---- RoPE --------------------------------------------------------------------------------- */

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
    L = dot_d(s->dout, y, n);
    free(y);
    return L;
}

/* Tables are random (not unit-norm), so the backward must be the transpose, not merely an
 * inverse; T < T_max and B > 1 so the position must be t, not b*T + t. Tol 1e-5. */
static void test_rope(int64_t B, int64_t T, int64_t Tmax, int64_t nh, int64_t hd) {
    const int64_t n = B * T * nh * hd;
    float *cs = fnew(Tmax * hd / 2), *sn = fnew(Tmax * hd / 2), *x = fnew(n), *dout = fnew(n),
          *buf = fnew(n);
    fill_uniform(cs, Tmax * hd / 2, -1.2, 1.2);
    fill_uniform(sn, Tmax * hd / 2, -1.2, 1.2);
    fill_normal(x, n, 1.0);
    fill_normal(dout, n, 1.0);
    rope_st s = {dnew(n), dnew(n), cs, sn, B, T, nh, hd};
    to_d(s.x, x, n);
    to_d(s.dout, dout, n);
    double *ref = dnew(n);
    fm_ref_rope(ref, s.x, cs, sn, B, T, nh, hd, 1.0);
    memcpy(buf, x, (size_t)n * sizeof(float));
    OPS->rope_fwd(CTX, buf, cs, sn, B, T, nh, hd);
    CHECK_ERR("rope_fwd", nerr(buf, ref, n, 1e-30), 1e-5);
    memcpy(buf, dout, (size_t)n * sizeof(float));
    OPS->rope_bwd(CTX, buf, cs, sn, B, T, nh, hd);
    double *g = dnew(n);
    to_d(g, buf, n);
    fd_check("rope_bwd dx", rope_obj, &s, s.x, n, g, 1e-5);
    free(cs), free(sn), free(x), free(dout), free(buf), free(s.x), free(s.dout), free(ref), free(g);
}

/* ---- attention ---------------------------------------------------------------------------- */

typedef struct att_st {
    double *q, *k, *v, *dout, *out, *lse;
    int64_t B, T, nh, nkv, hd;
} att_st;

/* fm_ref_attention_fwd (naive causal GQA over the full score row, fp64) on double arrays. */
static void att_ref(double *out, double *lse, const double *q, const double *k, const double *v,
                    int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
    const fm_ref_att a = {q, k, v, NULL, B, T, nh, nkv, hd};
    fm_ref_attention_fwd(out, lse, &a);
}

static double att_obj(void *p) {
    att_st *s = p;
    const int64_t n = s->B * s->T * s->nh * s->hd;
    att_ref(s->out, NULL, s->q, s->k, s->v, s->B, s->T, s->nh, s->nkv, s->hd);
    return dot_d(s->dout, s->out, n);
}

typedef struct att_bufs {
    float *q, *k, *v, *out, *lse, *dout, *dq, *dk, *dv;
    int64_t nq, nk, nl;
} att_bufs;

static att_bufs att_alloc(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
    att_bufs a;
    a.nq = B * T * nh * hd;
    a.nk = B * T * nkv * hd;
    a.nl = B * nh * T;
    a.q = fnew(a.nq), a.k = fnew(a.nk), a.v = fnew(a.nk), a.out = fnew(a.nq), a.lse = fnew(a.nl);
    a.dout = fnew(a.nq), a.dq = fnew(a.nq), a.dk = fnew(a.nk), a.dv = fnew(a.nk);
    return a;
}
static void att_free(att_bufs *a) {
    free(a->q), free(a->k), free(a->v), free(a->out), free(a->lse);
    free(a->dout), free(a->dq), free(a->dk), free(a->dv);
}

/* Gradient magnitude below which errors are measured absolutely: at T = 1 the exact dq and dk
 * are zero (softmax over one key) and the fp32 op leaves rounding noise ~1e-6. The inputs are
 * O(1), so the gradients of interest are O(1..10). */
#define ATT_GRAD_FLOOR 0.1

/* Forward out tol 1e-5 and lse tol 1e-5 against att_ref; with `grad`, dq, dk, dv (assigned,
 * poisoned) against FD of sum(dout o att_ref) with tol 1e-4 (normalized by max(max|grad|,
 * ATT_GRAD_FLOOR)). */
static void test_attention_case(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                                bool grad) {
    att_bufs a = att_alloc(B, T, nh, nkv, hd);
    fill_normal(a.q, a.nq, 1.5);
    fill_normal(a.k, a.nk, 1.5);
    fill_normal(a.v, a.nk, 1.0);
    fill_normal(a.dout, a.nq, 1.0);
    poison(a.out, a.nq);
    poison(a.lse, a.nl);
    OPS->attention_fwd(CTX, a.out, a.lse, a.q, a.k, a.v, B, T, nh, nkv, hd);
    att_st s = {dnew(a.nq), dnew(a.nk), dnew(a.nk), dnew(a.nq), dnew(a.nq), dnew(a.nl),
                B, T, nh, nkv, hd};
    to_d(s.q, a.q, a.nq);
    to_d(s.k, a.k, a.nk);
    to_d(s.v, a.v, a.nk);
    to_d(s.dout, a.dout, a.nq);
    att_ref(s.out, s.lse, s.q, s.k, s.v, B, T, nh, nkv, hd);
    char what[128];
    snprintf(what, sizeof what, "attention_fwd out B=%lld T=%lld nh=%lld nkv=%lld hd=%lld",
             (long long)B, (long long)T, (long long)nh, (long long)nkv, (long long)hd);
    CHECK_ERR(what, nerr(a.out, s.out, a.nq, 1e-30), 1e-5);
    snprintf(what, sizeof what, "attention_fwd lse B=%lld T=%lld nh=%lld nkv=%lld hd=%lld",
             (long long)B, (long long)T, (long long)nh, (long long)nkv, (long long)hd);
    CHECK_ERR(what, nerr(a.lse, s.lse, a.nl, 1.0), 1e-5);
    if (grad) {
        poison(a.dq, a.nq);
        poison(a.dk, a.nk);
        poison(a.dv, a.nk);
        OPS->attention_bwd(CTX, a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, B, T, nh,
                           nkv, hd);
        double *g = dnew(a.nq);
        const char *names[3] = {"dq", "dk", "dv"};
        float *grads[3] = {a.dq, a.dk, a.dv};
        double *xs[3] = {s.q, s.k, s.v};
        int64_t ns[3] = {a.nq, a.nk, a.nk};
        for (int i = 0; i < 3; i++) {
            to_d(g, grads[i], ns[i]);
            snprintf(what, sizeof what, "attention_bwd %s B=%lld T=%lld nh=%lld nkv=%lld hd=%lld",
                     names[i], (long long)B, (long long)T, (long long)nh, (long long)nkv,
                     (long long)hd);
            fd_check_ex(what, att_obj, &s, xs[i], ns[i], g, 1e-4, ATT_GRAD_FLOOR, FD_H);
        }
        free(g);
    }
    free(s.q), free(s.k), free(s.v), free(s.dout), free(s.out), free(s.lse);
    att_free(&a);
}

/* Scores far beyond exp's fp32 range (|score| ~ 1e4, and ~1e35 near FLT_MAX): q and k hold
 * integers times a power of two and hd = 64 (scale 1/8), so the fp32 scores are exact and the
 * op must match the fp64 reference (tol 1e-5) with finite lse and gradients. */
static void test_attention_overflow(double pow2) {
    const int64_t B = 1, T = 100, nh = 2, nkv = 1, hd = 64;
    att_bufs a = att_alloc(B, T, nh, nkv, hd);
    for (int64_t i = 0; i < a.nq; i++)
        a.q[i] = (float)ldexp((double)((int)fm_rng_below(&g_rng, 201) - 100), (int)pow2);
    for (int64_t i = 0; i < a.nk; i++)
        a.k[i] = (float)ldexp((double)((int)fm_rng_below(&g_rng, 201) - 100), (int)pow2);
    fill_normal(a.v, a.nk, 1.0);
    fill_normal(a.dout, a.nq, 1.0);
    poison(a.out, a.nq);
    poison(a.lse, a.nl);
    OPS->attention_fwd(CTX, a.out, a.lse, a.q, a.k, a.v, B, T, nh, nkv, hd);
    double *q = dnew(a.nq), *k = dnew(a.nk), *v = dnew(a.nk), *out = dnew(a.nq), *lse = dnew(a.nl);
    to_d(q, a.q, a.nq);
    to_d(k, a.k, a.nk);
    to_d(v, a.v, a.nk);
    att_ref(out, lse, q, k, v, B, T, nh, nkv, hd);
    double smax = 0;
    for (int64_t i = 0; i < a.nl; i++) smax = fabs(lse[i]) > smax ? fabs(lse[i]) : smax;
    printf("attention overflow case: max |lse| = %.3g\n", smax);
    CHECK_ERR("attention_fwd out, huge scores", nerr(a.out, out, a.nq, 1e-30), 1e-5);
    CHECK_ERR("attention_fwd lse, huge scores", nerr(a.lse, lse, a.nl, 1.0), 1e-6);
    poison(a.dq, a.nq);
    poison(a.dk, a.nk);
    poison(a.dv, a.nk);
    OPS->attention_bwd(CTX, a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, B, T, nh, nkv,
                       hd);
    CHECK_MSG(all_finite(a.dq, a.nq) && all_finite(a.dk, a.nk) && all_finite(a.dv, a.nk),
              "attention_bwd: non-finite gradient with huge scores (2^%g)", pow2);
    free(q), free(k), free(v), free(out), free(lse);
    att_free(&a);
}

/* Two calls give the same bits; a 1-thread context gives the same bits as the 2-thread one. */
static void test_attention_determinism(void) {
    const int64_t B = 2, T = 200, nh = 4, nkv = 2, hd = 64;
    att_bufs a = att_alloc(B, T, nh, nkv, hd), b = att_alloc(B, T, nh, nkv, hd);
    fill_normal(a.q, a.nq, 1.0);
    fill_normal(a.k, a.nk, 1.0);
    fill_normal(a.v, a.nk, 1.0);
    fill_normal(a.dout, a.nq, 1.0);
    OPS->attention_fwd(CTX, a.out, a.lse, a.q, a.k, a.v, B, T, nh, nkv, hd);
    OPS->attention_fwd(CTX, b.out, b.lse, a.q, a.k, a.v, B, T, nh, nkv, hd);
    CHECK_MSG(!memcmp(a.out, b.out, (size_t)a.nq * 4) && !memcmp(a.lse, b.lse, (size_t)a.nl * 4),
              "attention_fwd: two calls differ");
    OPS->attention_bwd(CTX, a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, B, T, nh, nkv,
                       hd);
    OPS->attention_bwd(CTX, b.dq, b.dk, b.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, B, T, nh, nkv,
                       hd);
    CHECK_MSG(!memcmp(a.dq, b.dq, (size_t)a.nq * 4) && !memcmp(a.dk, b.dk, (size_t)a.nk * 4) &&
                  !memcmp(a.dv, b.dv, (size_t)a.nk * 4),
              "attention_bwd: two calls differ");
    fm_backend one;
    CHECK(fm_cpu_backend_init(&one, 1, 64) == FM_OK);
    one.ops->attention_fwd(one.ctx, b.out, b.lse, a.q, a.k, a.v, B, T, nh, nkv, hd);
    one.ops->attention_bwd(one.ctx, b.dq, b.dk, b.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, B, T, nh,
                           nkv, hd);
    CHECK_MSG(!memcmp(a.out, b.out, (size_t)a.nq * 4) && !memcmp(a.dq, b.dq, (size_t)a.nq * 4) &&
                  !memcmp(a.dk, b.dk, (size_t)a.nk * 4) && !memcmp(a.dv, b.dv, (size_t)a.nk * 4),
              "attention: 1 thread and 2 threads differ");
    fm_cpu_backend_free(&one);
    att_free(&a);
    att_free(&b);
}

static void test_attention(void) {
    /* Forward only, larger T: tiles 64, T not a multiple, GQA groups 1/2/4, hd 32/64/128. */
    test_attention_case(1, 1, 1, 1, 32, false);
    test_attention_case(2, 64, 2, 2, 32, false);
    test_attention_case(1, 257, 4, 1, 128, false);
    test_attention_case(2, 300, 4, 2, 64, false);
    test_attention_case(1, 700, 2, 1, 64, false);
    /* Forward and backward. */
    test_attention_case(1, 1, 2, 1, 32, true);
    test_attention_case(2, 70, 4, 2, 32, true);
    test_attention_case(1, 130, 4, 1, 64, true);
    test_attention_case(1, 67, 2, 2, 128, true);
    test_attention_case(2, 129, 2, 2, 64, true);
    test_attention_overflow(0);  /* |score| ~ 1e4: exp overflows without the max */
    test_attention_overflow(50); /* |score| ~ 1e34, near FLT_MAX */
    test_attention_determinism();
}

/* ---- SwiGLU ------------------------------------------------------------------------------- */

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

/* Gates up to |g| ~ 30 (saturated sigmoid). fwd tol 1e-5, bwd FD tol 1e-5. */
static void test_swiglu(void) {
    const int64_t n = 9001; /* above the single-thread cutoff (8192) */
    float *g = fnew(n), *u = fnew(n), *out = fnew(n), *dout = fnew(n), *dg = fnew(n), *du = fnew(n);
    fill_normal(g, n, 3.0);
    g[0] = 30.0f, g[1] = -30.0f, g[2] = 0.0f;
    fill_normal(u, n, 1.0);
    fill_normal(dout, n, 1.0);
    poison(out, n);
    OPS->swiglu_fwd(CTX, out, g, u, n);
    swi_st s = {dnew(n), dnew(n), dnew(n), n};
    to_d(s.g, g, n);
    to_d(s.u, u, n);
    to_d(s.dout, dout, n);
    double *ref = dnew(n);
    fm_ref_swiglu_fwd(ref, s.g, s.u, n);
    CHECK_ERR("swiglu_fwd", nerr(out, ref, n, 1e-30), 1e-5);
    poison(dg, n);
    poison(du, n);
    OPS->swiglu_bwd(CTX, dg, du, dout, g, u, n);
    to_d(ref, dg, n);
    fd_check("swiglu_bwd dgate", swi_obj, &s, s.g, n, ref, 1e-5);
    to_d(ref, du, n);
    fd_check("swiglu_bwd dup", swi_obj, &s, s.u, n, ref, 1e-5);
    free(g), free(u), free(out), free(dout), free(dg), free(du), free(s.g), free(s.u), free(s.dout),
        free(ref);
}

/* ---- router ------------------------------------------------------------------------------- */

typedef struct rt_st {
    double *logits, *probs, *lse; /* the objective reads logits; probs, lse are its scratch */
    fm_ref_router_loss loss;      /* the selection held fixed (piecewise constant in the logits) */
} rt_st;

static double rt_obj(void *p) {
    rt_st *s = p;
    return fm_ref_router_objective(&s->loss, s->logits, s->probs, s->lse);
}

/* With k = 1 and norm_topk the top-k weight is identically 1, so its exact gradient is zero and
 * only finite-difference noise (~1e-10) is left; router gradients of interest are O(0.1). */
#define ROUTER_GRAD_FLOOR 0.01

/* Router forward (probs, lse tol 1e-6; top-k ids exact incl. ties to the lower id; weights tol
 * 1e-6), router_stats, and router_bwd against FD (tol 1e-5) of each loss term alone and all
 * together. */
static void test_router_case(int64_t N, int64_t E, int64_t k, bool norm) {
    float *logits = fnew(N * E), *probs = fnew(N * E), *lse = fnew(N), *tw = fnew(N * k),
          *dw = fnew(N * k), *gpe = fnew(E), *dl = fnew(N * E), *zero = fnew(N * k);
    int32_t *idx = inew(N * k);
    fill_normal(logits, N * E, 2.0);
    /* Ties: row 0 all equal; row 1 the max shared by experts E-1 and 1; row 2 a tie at the
     * boundary of the selection (the k-th and (k+1)-th largest equal). */
    for (int64_t e = 0; e < E; e++) logits[e] = 0.25f;
    logits[1 * E + E - 1] = logits[1 * E + 1] = 9.0f;
    for (int64_t e = 0; e < E; e++) logits[2 * E + e] = (float)(-e);
    logits[2 * E + E - 1] = logits[2 * E + k - 1] = (float)(-(k - 1));
    poison(probs, N * E);
    poison(lse, N);
    poison(tw, N * k);
    for (int64_t i = 0; i < N * k; i++) idx[i] = -7;
    OPS->router_fwd(CTX, probs, lse, idx, tw, logits, N, E, k, norm);

    rt_st s = {dnew(N * E), dnew(N * E), dnew(N), {idx, NULL, NULL, 0.0, N, E, k, norm}};
    to_d(s.logits, logits, N * E);
    fm_ref_softmax(s.probs, s.lse, s.logits, N, E);
    char what[128];
    snprintf(what, sizeof what, "router N=%lld E=%lld k=%lld norm=%d", (long long)N, (long long)E,
             (long long)k, (int)norm);
    CHECK_MSG(nerr(probs, s.probs, N * E, 1e-30) <= 1e-6, "%s: probs", what);
    CHECK_MSG(nerr(lse, s.lse, N, 1.0) <= 1e-6, "%s: lse", what);
    /* Reference top-k: repeated selection on the fp64 probs, ties to the lower id. */
    int32_t *ridx = inew(N * k);
    fm_ref_topk(ridx, s.probs, N, E, k);
    const bool ids_ok = !memcmp(ridx, idx, sizeof(int32_t) * (size_t)(N * k));
    double *rw = dnew(N * k);
    fm_ref_topk_weights(rw, s.probs, ridx, N, E, k, norm);
    free(ridx);
    CHECK_MSG(ids_ok, "%s: top-k ids differ from the reference (ties to the lower id)", what);
    CHECK_MSG(idx[0] == 0 && (k < 2 || idx[1] == 1), "%s: all-equal row picks ids 0..k-1", what);
    CHECK_MSG(idx[k] == 1 && (k < 2 || idx[k + 1] == E - 1), "%s: tied max picks id 1 then E-1",
              what);
    CHECK_MSG(idx[2 * k + k - 1] == k - 1, "%s: boundary tie picks the lower id", what);
    CHECK_MSG(nerr(tw, rw, N * k, 1e-30) <= 1e-6, "%s: topk_w", what);

    /* router_stats */
    float *cnt = fnew(E), *psum = fnew(E);
    poison(cnt, E);
    poison(psum, E);
    double z = router_stats_(OPS, CTX, cnt, psum, probs, lse, idx, N, E, k);
    double *rc = dnew(E), *rp = dnew(E), *pd = fm_ref_widen(probs, N * E), *ld = fm_ref_widen(lse, N);
    const double rz = fm_ref_router_stats(rc, rp, pd, ld, idx, N, E, k); /* on the op's probs */
    free(pd), free(ld);
    CHECK_MSG(nerr(cnt, rc, E, 1e-30) == 0, "%s: router_stats count", what);
    CHECK_MSG(nerr(psum, rp, E, 1e-30) <= 1e-6, "%s: router_stats prob_sum", what);
    CHECK_CLOSE(z, rz, 1e-12);

    /* router_bwd: (a) top-k weights only, (b) load-balancing term only (dtopk_w zero, and
     * NULL), (c) z-loss only, (d) all three. */
    fill_normal(dw, N * k, 1.0);
    for (int64_t e = 0; e < E; e++) gpe[e] = (float)(0.3 * rnd_normal());
    fill_const(zero, N * k, 0.0f);
    double *ddw = dnew(N * k), *dgpe = dnew(E), *g = dnew(N * E);
    to_d(ddw, dw, N * k);
    to_d(dgpe, gpe, E);
    struct {
        const char *name;
        const float *dw;
        const float *gpe;
        float z;
    } cases[] = {{"topk_w", dw, NULL, 0.0f},
                 {"aux (dprobs_per_expert)", zero, gpe, 0.0f},
                 {"aux, dtopk_w NULL", NULL, gpe, 0.0f},
                 {"z-loss", zero, NULL, 0.01f},
                 {"all terms", dw, gpe, 0.01f}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        poison(dl, N * E);
        OPS->router_bwd(CTX, dl, cases[c].dw, cases[c].gpe, cases[c].z, probs, lse, idx, tw, N, E,
                        k, norm);
        s.loss.dw = cases[c].dw == dw ? ddw : NULL;
        s.loss.gpe = cases[c].gpe ? dgpe : NULL;
        s.loss.z = cases[c].z;
        to_d(g, dl, N * E);
        char w2[200];
        snprintf(w2, sizeof w2, "%s: router_bwd %s", what, cases[c].name);
        fd_check_ex(w2, rt_obj, &s, s.logits, N * E, g, 1e-5, ROUTER_GRAD_FLOOR, FD_H);
    }
    free(logits), free(probs), free(lse), free(tw), free(dw), free(gpe), free(dl), free(zero),
        free(idx);
    free(s.logits), free(s.probs), free(s.lse), free(rw), free(cnt), free(psum), free(rc), free(rp),
        free(ddw), free(dgpe), free(g);
}

/* NaN logits (a diverged run) must not abort: k distinct ids in [0,E), NaN flowing into the
 * weights so the trainer's non-finite check sees it. Row 0 has one NaN, row 1 is all NaN. */
static void test_router_nan(void) {
    const int64_t N = 2, E = 6, k = 3;
    float logits[12], probs[12], lse[2], tw[6];
    int32_t idx[6];
    for (int e = 0; e < 12; e++) logits[e] = (float)(e % 5);
    logits[4] = NAN;
    for (int e = 6; e < 12; e++) logits[e] = NAN;
    OPS->router_fwd(CTX, probs, lse, idx, tw, logits, N, E, k, true);
    bool ok = true;
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < k; j++) {
            ok &= idx[n * k + j] >= 0 && idx[n * k + j] < E;
            for (int i = 0; i < j; i++) ok &= idx[n * k + i] != idx[n * k + j];
        }
    CHECK_MSG(ok, "router_fwd with NaN logits: ids not k distinct experts in [0,E)");
    CHECK_MSG(isnan(tw[0]) && isnan(tw[3]), "router_fwd with NaN logits: NaN did not reach topk_w");
}

static void test_router(void) {
    test_router_nan();
    test_router_case(33, 8, 1, false);
    test_router_case(33, 8, 1, true);
    test_router_case(33, 8, 2, false);
    test_router_case(33, 8, 2, true);
    test_router_case(20, 64, 8, true);
    test_router_case(20, 64, 8, false);
    test_router_case(7, 40, 40, true); /* k = E */
    test_router_case(200, 64, 8, true);
    test_router_case(200, 64, 4, false);
}

/* ---- MoE permutation ---------------------------------------------------------------------- */

/* Random top-k ids: k distinct experts per token drawn from [0,E) minus `skip` (-1: none). */
static void random_topk(int32_t *idx, int64_t N, int64_t E, int64_t k, int32_t skip) {
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

/* Checks the op's route index against the documented layout, built independently
 * (fm_ref_route_index): expert e's rows are the routes r with topk_idx[r] == e in increasing r. */
static void check_route_index(const char *what, const int32_t *idx, int64_t N, int64_t E,
                              int64_t k) {
    const int64_t R = N * k;
    int64_t *off = malloc((size_t)(E + 1) * sizeof(int64_t));
    int32_t *rr = inew(R), *rw = inew(R);
    for (int64_t e = 0; e <= E; e++) off[e] = -5;
    for (int64_t r = 0; r < R; r++) rr[r] = rw[r] = -5;
    OPS->moe_route_index(CTX, off, rr, rw, idx, N, E, k);
    int64_t *roff = malloc((size_t)(E + 1) * sizeof(int64_t));
    int32_t *rrr = inew(R), *rrw = inew(R);
    fm_ref_route_index(roff, rrr, rrw, idx, N, E, k);
    const bool ok = !memcmp(off, roff, (size_t)(E + 1) * sizeof(int64_t)) &&
                    !memcmp(rr, rrr, (size_t)R * sizeof(int32_t)) && !memcmp(rw, rrw, (size_t)R * sizeof(int32_t));
    CHECK_MSG(ok, "moe_route_index %s: layout differs from the stable counting sort", what);
    free(off), free(rr), free(rw), free(roff), free(rrr), free(rrw);
}

static void test_route_index(void) {
    int32_t idx[37 * 3];
    random_topk(idx, 37, 6, 2, 3); /* expert 3 gets no token */
    check_route_index("N=37 E=6 k=2, expert 3 empty", idx, 37, 6, 2);
    for (int n = 0; n < 20; n++) idx[n] = 2;
    check_route_index("all tokens to expert 2 (k=1)", idx, 20, 4, 1);
    random_topk(idx, 16, 5, 3, 0);
    for (int n = 0; n < 16; n++) idx[n * 3 + n % 3] = 0; /* expert 0 in every token, slot varies */
    check_route_index("expert 0 in every token (k=3)", idx, 16, 5, 3);
    random_topk(idx, 37, 8, 3, -1);
    check_route_index("N=37 E=8 k=3", idx, 37, 8, 3);
    check_route_index("N=0", idx, 0, 8, 3);
}

typedef struct mg_st {
    double *x, *dxe;          /* gather */
    double *ye, *w, *dout;    /* combine */
    const int32_t *row_route, *route_row;
    int64_t N, k, H;
} mg_st;

static double gather_obj(void *p) {
    mg_st *s = p;
    double L = 0;
    for (int64_t r = 0; r < s->N * s->k; r++)
        for (int64_t h = 0; h < s->H; h++)
            L += s->dxe[r * s->H + h] * s->x[(s->row_route[r] / s->k) * s->H + h];
    return L;
}

static double combine_obj(void *p) {
    mg_st *s = p;
    double *out = dnew(s->N * s->H);
    fm_ref_moe_combine_fwd(out, s->ye, s->w, s->route_row, s->N, s->k, s->H);
    const double L = dot_d(s->dout, out, s->N * s->H);
    free(out);
    return L;
}

/* gather exact; gather_bwd, combine_fwd tol 1e-6 vs fp64; combine_bwd dye, dtopk_w (assigned)
 * and gather_bwd dx vs FD tol 1e-5. Includes an expert with no tokens. */
static void test_gather_combine(int64_t N, int64_t E, int64_t k, int64_t H) {
    const int64_t R = N * k;
    int32_t *idx = inew(R), *rr = inew(R), *rw = inew(R);
    int64_t *off = malloc((size_t)(E + 1) * sizeof(int64_t));
    random_topk(idx, N, E, k, (int32_t)(E - 1));
    OPS->moe_route_index(CTX, off, rr, rw, idx, N, E, k);
    float *x = fnew(N * H), *xe = fnew(R * H), *dxe = fnew(R * H), *dx = fnew(N * H);
    float *ye = fnew(R * H), *w = fnew(R), *out = fnew(N * H), *dout = fnew(N * H),
          *dye = fnew(R * H), *dw = fnew(R);
    fill_normal(x, N * H, 1.0);
    fill_normal(dxe, R * H, 1.0);
    fill_normal(ye, R * H, 1.0);
    fill_uniform(w, R, 0.0, 1.0);
    fill_normal(dout, N * H, 1.0);
    poison(xe, R * H);
    OPS->moe_gather(CTX, xe, x, rr, R, k, H);
    bool ok = true;
    for (int64_t r = 0; r < R; r++)
        ok &= !memcmp(xe + r * H, x + (rr[r] / k) * H, (size_t)H * sizeof(float));
    CHECK_MSG(ok, "moe_gather: rows differ from x[row_route/k]");
    mg_st s = {dnew(N * H), dnew(R * H), dnew(R * H), dnew(R), dnew(N * H), rr, rw, N, k, H};
    to_d(s.x, x, N * H);
    to_d(s.dxe, dxe, R * H);
    to_d(s.ye, ye, R * H);
    to_d(s.w, w, R);
    to_d(s.dout, dout, N * H);
    poison(dx, N * H);
    OPS->moe_gather_bwd(CTX, dx, dxe, rw, N, k, H);
    double *g = dnew(R * H), *ref = dnew(N * H);
    fm_ref_moe_gather_bwd(ref, s.dxe, rw, N, k, H);
    CHECK_ERR("moe_gather_bwd vs reference", nerr(dx, ref, N * H, 1e-30), 1e-6);
    to_d(g, dx, N * H);
    fd_check("moe_gather_bwd dx", gather_obj, &s, s.x, N * H, g, 1e-5);

    poison(out, N * H);
    OPS->moe_combine_fwd(CTX, out, ye, w, rw, N, k, H);
    fm_ref_moe_combine_fwd(ref, s.ye, s.w, rw, N, k, H);
    CHECK_ERR("moe_combine_fwd", nerr(out, ref, N * H, 1e-30), 1e-6);
    poison(dye, R * H);
    poison(dw, R);
    OPS->moe_combine_bwd(CTX, dye, dw, dout, ye, w, rw, N, k, H);
    to_d(g, dye, R * H);
    fd_check("moe_combine_bwd dye", combine_obj, &s, s.ye, R * H, g, 1e-5);
    to_d(g, dw, R);
    fd_check("moe_combine_bwd dtopk_w", combine_obj, &s, s.w, R, g, 1e-5);
    free(idx), free(rr), free(rw), free(off), free(x), free(xe), free(dxe), free(dx), free(ye),
        free(w), free(out), free(dout), free(dye), free(dw);
    free(s.x), free(s.dxe), free(s.ye), free(s.w), free(s.dout), free(g), free(ref);
}

/* ---- cross-entropy ------------------------------------------------------------------------ */

typedef struct ce_st {
    double *logits;
    const int32_t *tgt;
    int64_t N, V;
    double scale;
    int32_t ignore;
} ce_st;

static double ce_obj(void *p) {
    ce_st *s = p;
    return s->scale * fm_ref_cross_entropy(NULL, NULL, s->logits, s->tgt, NULL, s->N, s->V, 1.0, 0.0, s->ignore);
}

/* loss (tol 1e-6 vs fp64) and its returned sum, dlogits vs FD of grad_scale * sum(loss)
 * (tol 1e-5), ignored rows zero, dlogits aliasing logits gives the same bits, dlogits NULL,
 * and logits ~1e4 (exp overflows without the max) staying finite and correct. */
static void test_cross_entropy(double logit_scale, int64_t N, int64_t V) {
    const int32_t ignore = -100;
    const float gs = 0.37f;
    int32_t *tgt = inew(N);
    for (int64_t n = 0; n < N; n++) tgt[n] = (int32_t)fm_rng_below(&g_rng, V);
    tgt[2] = tgt[5] = tgt[11] = ignore;
    tgt[0] = 0, tgt[1] = V - 1;
    float *logits = fnew(N * V), *loss = fnew(N), *dl = fnew(N * V), *buf = fnew(N * V);
    fill_normal(logits, N * V, logit_scale);
    poison(loss, N);
    poison(dl, N * V);
    double sum = cross_entropy_(OPS, CTX, loss, dl, logits, tgt, N, V, gs, ignore);
    ce_st s = {dnew(N * V), tgt, N, V, gs, ignore};
    to_d(s.logits, logits, N * V);
    double *ref = dnew(N);
    const double rsum = fm_ref_cross_entropy(ref, NULL, s.logits, tgt, NULL, N, V, 1.0, 0.0, ignore);
    char what[96];
    snprintf(what, sizeof what, "cross_entropy loss (logit scale %g)", logit_scale);
    CHECK_ERR(what, nerr(loss, ref, N, 1.0), 1e-6);
    CHECK_CLOSE(sum, rsum, 1e-6);
    bool zero_rows = true;
    for (int64_t n = 0; n < N; n++)
        if (tgt[n] == ignore)
            for (int64_t i = 0; i < V; i++) zero_rows &= dl[n * V + i] == 0.0f;
    CHECK_MSG(zero_rows, "cross_entropy: ignored rows of dlogits are not zero");
    CHECK_MSG(all_finite(dl, N * V) && all_finite(loss, N), "cross_entropy: non-finite output");
    double *g = dnew(N * V);
    to_d(g, dl, N * V);
    snprintf(what, sizeof what, "cross_entropy dlogits (logit scale %g)", logit_scale);
    /* With logits ~1e4 the objective is ~1e5 and h = 1e-6 would leave fp64 noise ~1e-5 in the
     * difference; the loss is smooth at that scale, so a larger step is exact enough. */
    fd_check_ex(what, ce_obj, &s, s.logits, N * V, g, 1e-5, 0.0, logit_scale > 100 ? 1e-3 : FD_H);
    /* dlogits aliasing logits */
    memcpy(buf, logits, (size_t)(N * V) * sizeof(float));
    float *loss2 = fnew(N);
    double sum2 = cross_entropy_(OPS, CTX, loss2, buf, buf, tgt, N, V, gs, ignore);
    CHECK_MSG(!memcmp(buf, dl, (size_t)(N * V) * sizeof(float)) && sum2 == sum,
              "cross_entropy: dlogits aliasing logits differs from the separate-buffer result");
    double sum3 = cross_entropy_(OPS, CTX, loss2, NULL, logits, tgt, N, V, gs, ignore);
    CHECK(sum3 == sum && !memcmp(loss2, loss, (size_t)N * sizeof(float)));
    free(tgt), free(logits), free(loss), free(dl), free(buf), free(loss2), free(s.logits),
        free(ref), free(g);
}

/* ---- AdamW -------------------------------------------------------------------------------- */

/* One step against a scalar fp64 reference of the formula in fm_backend.h (bias correction at
 * `step`, weight decay, grad_scale): the update p_new - p_old tol 1e-4, m and v tol 1e-6. */
static void test_adamw(int step, float wd, float gs) {
    const int64_t n = 20001;
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
    const float bc1 = 1.0f - powf(b1, (float)step), bc2 = 1.0f - powf(b2, (float)step);
    float *p = fnew(n), *g = fnew(n), *m = fnew(n), *v = fnew(n), *p0 = fnew(n);
    fill_normal(p, n, 1.0);
    fill_normal(g, n, 1.0);
    fill_normal(m, n, step > 1 ? 0.1 : 0.0);
    for (int64_t i = 0; i < n; i++) v[i] = step > 1 ? (float)(0.01 * fabs(rnd_normal())) : 0.0f;
    memcpy(p0, p, (size_t)n * sizeof(float));
    double *rd = dnew(n), *rm = dnew(n), *rv = dnew(n);
    {
        double *wd_ = fm_ref_widen(p, n), *gd = fm_ref_widen(g, n), *md = fm_ref_widen(m, n), *vd = fm_ref_widen(v, n);
        fm_ref_adamw(rd, rm, rv, wd_, gd, md, vd, n, lr, b1, b2, eps, wd, bc1, bc2, gs);
        free(wd_), free(gd), free(md), free(vd);
    }
    /* with a separate fp32 master (the bf16 builds' path; here fp32 -> p is a copy of it) */
    float *p2 = fnew(n), *mst = fnew(n), *m2 = fnew(n), *v2 = fnew(n);
    memcpy(p2, p, (size_t)n * sizeof(float));
    memcpy(mst, p, (size_t)n * sizeof(float));
    memcpy(m2, m, (size_t)n * sizeof(float));
    memcpy(v2, v, (size_t)n * sizeof(float));
    OPS->adamw(CTX, p2, g, mst, m2, v2, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, gs);
    OPS->adamw(CTX, p, g, NULL, m, v, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, gs);
    CHECK_MSG(memcmp(p, p2, (size_t)n * sizeof(float)) == 0 && memcmp(p, mst, (size_t)n * sizeof(float)) == 0,
              "adamw with a master: weights differ from the in-place update");
    free(p2), free(mst), free(m2), free(v2);
    float *d = fnew(n);
    for (int64_t i = 0; i < n; i++) d[i] = (float)((double)p[i] - (double)p0[i]);
    char what[96];
    snprintf(what, sizeof what, "adamw step %d wd %g grad_scale %g: update", step, wd, gs);
    CHECK_ERR(what, nerr(d, rd, n, 1e-30), 1e-4);
    snprintf(what, sizeof what, "adamw step %d: m", step);
    CHECK_ERR(what, nerr(m, rm, n, 1e-30), 1e-6);
    snprintf(what, sizeof what, "adamw step %d: v", step);
    CHECK_ERR(what, nerr(v, rv, n, 1e-30), 1e-6);
    free(p), free(g), free(m), free(v), free(p0), free(rd), free(rm), free(rv), free(d);
}

/* bf16 moments: from moments that bf16 holds exactly, the same step with bf16 and with fp32
 * moments gives the same weights bit for bit, and the bf16 moments are the fp32 ones rounded to
 * nearest even. */
static void test_adamw_bf16_moments(int step) {
    const int64_t n = 5003;
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    const float bc1 = 1.0f - powf(b1, (float)step), bc2 = 1.0f - powf(b2, (float)step);
    float *p = fnew(n), *g = fnew(n), *m = fnew(n), *v = fnew(n), *p2 = fnew(n);
    uint16_t *mh = calloc((size_t)n, 2), *vh = calloc((size_t)n, 2);
    fill_normal(p, n, 1.0);
    fill_normal(g, n, 1.0);
    fill_normal(m, n, step > 1 ? 0.1 : 0.0);
    for (int64_t i = 0; i < n; i++) {
        v[i] = step > 1 ? (float)(0.01 * fabs(rnd_normal())) : 0.0f;
        mh[i] = fm_f32_to_bf16(m[i]), vh[i] = fm_f32_to_bf16(v[i]);
        m[i] = fm_bf16_to_f32(mh[i]), v[i] = fm_bf16_to_f32(vh[i]);
    }
    memcpy(p2, p, (size_t)n * sizeof(float));
    OPS->adamw(CTX, p, g, NULL, m, v, FM_DTYPE_F32, n, lr, b1, b2, eps, wd, bc1, bc2, 1.0f);
    OPS->adamw(CTX, p2, g, NULL, mh, vh, FM_DTYPE_BF16, n, lr, b1, b2, eps, wd, bc1, bc2, 1.0f);
    CHECK_MSG(memcmp(p, p2, (size_t)n * sizeof(float)) == 0, "adamw bf16 moments step %d: weights differ", step);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (mh[i] != fm_f32_to_bf16(m[i]) || vh[i] != fm_f32_to_bf16(v[i])) bad++;
    CHECK_MSG(bad == 0, "adamw bf16 moments step %d: %lld moments are not the fp32 ones rounded", step, (long long)bad);
    free(p), free(g), free(m), free(v), free(p2), free(mh), free(vh);
}

/* ---- thread-count independence ------------------------------------------------------------ */

static bool same_bits(const void *a, const void *b, int64_t n_floats) {
    return memcmp(a, b, (size_t)n_floats * sizeof(float)) == 0;
}

/* The reductions (sumsq, embedding_bwd, rmsnorm_bwd's dw, router_stats, cross_entropy's sum)
 * and the attention tiles give the same bits on 1 and 2 threads (cpu_internal.h: outputs are
 * partitioned, never sums), at sizes where the 2-thread context really forks. */
static void test_thread_independence(void) {
    fm_backend one;
    CHECK(fm_cpu_backend_init(&one, 1, 64) == FM_OK);
    const fm_ops *o1 = one.ops;
    void *c1 = one.ctx;
    const int64_t n = 1000003;
    float *x = fnew(n);
    fill_normal(x, n, 2.0);
    double s2 = sumsq_(OPS, CTX, x, n), s1 = sumsq_(o1, c1, x, n);
    CHECK_MSG(memcmp(&s1, &s2, sizeof s1) == 0, "sumsq: 1 and 2 threads differ");

    const int64_t N = 300, H = 130, V = 17;
    int32_t *tok = inew(N);
    for (int64_t i = 0; i < N; i++) tok[i] = (int32_t)fm_rng_below(&g_rng, V);
    float *dout = fnew(N * H), *a1 = fnew(V * H), *a2 = fnew(V * H);
    fill_normal(dout, N * H, 1.0);
    fill_const(a1, V * H, 0.5f);
    fill_const(a2, V * H, 0.5f);
    OPS->embedding_bwd(CTX, a2, dout, tok, N, H);
    o1->embedding_bwd(c1, a1, dout, tok, N, H);
    CHECK_MSG(same_bits(a1, a2, V * H), "embedding_bwd: 1 and 2 threads differ");

    float *xx = fnew(N * H), *w = fnew(H), *out = fnew(N * H), *rstd = fnew(N), *dx1 = fnew(N * H),
          *dx2 = fnew(N * H), *dw1 = fnew(H), *dw2 = fnew(H);
    fill_normal(xx, N * H, 1.0);
    fill_uniform(w, H, 0.5, 1.5);
    OPS->rmsnorm_fwd(CTX, out, rstd, xx, w, N, H, 1e-6f);
    fill_const(dw1, H, 0.0f);
    fill_const(dw2, H, 0.0f);
    OPS->rmsnorm_bwd(CTX, dx2, dw2, dout, xx, w, rstd, N, H);
    o1->rmsnorm_bwd(c1, dx1, dw1, dout, xx, w, rstd, N, H);
    CHECK_MSG(same_bits(dx1, dx2, N * H) && same_bits(dw1, dw2, H),
              "rmsnorm_bwd: 1 and 2 threads differ");

    const int64_t E = 64, k = 8;
    float *logits = fnew(N * E), *probs = fnew(N * E), *lse = fnew(N), *tw = fnew(N * k),
          *cnt1 = fnew(E), *cnt2 = fnew(E), *ps1 = fnew(E), *ps2 = fnew(E);
    int32_t *idx = inew(N * k);
    fill_normal(logits, N * E, 1.0);
    OPS->router_fwd(CTX, probs, lse, idx, tw, logits, N, E, k, true);
    double z2 = router_stats_(OPS, CTX, cnt2, ps2, probs, lse, idx, N, E, k);
    double z1 = router_stats_(o1, c1, cnt1, ps1, probs, lse, idx, N, E, k);
    CHECK_MSG(z1 == z2 && same_bits(cnt1, cnt2, E) && same_bits(ps1, ps2, E),
              "router_stats: 1 and 2 threads differ");

    const int64_t NV = 64 * 1000;
    float *lg = fnew(NV), *l1 = fnew(64), *l2 = fnew(64), *d1 = fnew(NV), *d2 = fnew(NV);
    int32_t *tg = inew(64);
    fill_normal(lg, NV, 3.0);
    for (int i = 0; i < 64; i++) tg[i] = (int32_t)fm_rng_below(&g_rng, 1000);
    double ce2 = cross_entropy_(OPS, CTX, l2, d2, lg, tg, 64, 1000, 1.0f / 64, -1);
    double ce1 = cross_entropy_(o1, c1, l1, d1, lg, tg, 64, 1000, 1.0f / 64, -1);
    CHECK_MSG(ce1 == ce2 && same_bits(l1, l2, 64) && same_bits(d1, d2, NV),
              "cross_entropy: 1 and 2 threads differ");

    fm_cpu_backend_free(&one);
    free(x), free(tok), free(dout), free(a1), free(a2), free(xx), free(w), free(out), free(rstd);
    free(dx1), free(dx2), free(dw1), free(dw2), free(logits), free(probs), free(lse), free(tw);
    free(cnt1), free(cnt2), free(ps1), free(ps2), free(idx), free(lg), free(l1), free(l2), free(d1),
        free(d2), free(tg);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20240607));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    test_init_errors();
    CHECK(fm_cpu_backend_init(&g_be, 2, 128) == FM_OK);
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK(strcmp(OPS->name, "cpu") == 0);

    test_gemm();
    test_add_sumsq();
    /* Each op runs at least once below and once above the size (8192 elements) where the CPU
     * backend starts its OpenMP team, so both code paths are checked. */
    test_embedding(40);
    test_embedding(100);
    test_rmsnorm(9, 130, 1.5);
    test_rmsnorm(40, 16, 1.5); /* QK-norm shape: rows = tokens*heads, D = head_dim */
    test_rmsnorm(80, 130, 1.5);
    test_rmsnorm(20, 64, 3e-3); /* mean(x^2) ~ eps: eps must enter like the reference */
    test_rope(2, 5, 8, 3, 16);
    test_rope(2, 40, 48, 4, 32);
    test_attention();
    test_swiglu();
    test_router();
    test_route_index();
    test_gather_combine(23, 5, 3, 37);
    test_gather_combine(40, 8, 1, 70);
    test_gather_combine(100, 8, 2, 64);
    test_cross_entropy(1.0, 12, 50);
    test_cross_entropy(1e4, 12, 50);
    test_cross_entropy(1.0, 40, 300);
    test_cross_entropy(1e4, 40, 300);
    test_adamw(1, 0.0f, 1.0f);
    test_adamw(5, 0.1f, 0.5f);
    test_adamw_bf16_moments(1);
    test_adamw_bf16_moments(7);
    test_thread_independence();

    /* Attention with other tile sizes (plan inputs: --attention-tile-q/-kv), including tiles
     * that divide nothing and a single-row tile, against the same fp64 reference. */
    fm_cpu_backend_free(&g_be);
    const int64_t tiles[3][2] = {{16, 48}, {1, 7}, {128, 32}};
    for (int i = 0; i < 3; i++) {
        CHECK(fm_cpu_backend_init_tiles(&g_be, 2, 128, tiles[i][0], tiles[i][1]) == FM_OK);
        OPS = g_be.ops;
        CTX = g_be.ctx;
        test_attention_case(2, 70, 4, 2, 32, true);
        test_attention_case(1, 131, 2, 1, 64, true);
        fm_cpu_backend_free(&g_be);
    }
    CHECK(fm_cpu_backend_init_tiles(&g_be, 2, 128, 0, 64) == FM_ERR_ARG);
    CHECK(fm_cpu_backend_init(&g_be, 2, 128) == FM_OK);

    fm_cpu_backend_free(&g_be);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("time %.2f s\n",
           (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    return fm_test_finish();
}
