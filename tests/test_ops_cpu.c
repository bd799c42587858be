/* CPU backend ops (src/backend/cpu), the dense ones (init, gemm, add, sumsq, embedding, RMSNorm,
 * RoPE, attention, SwiGLU; tests/test_ops_cpu_moe.c has the router, the MoE permutation,
 * cross-entropy, AdamW and thread-count independence) against the plain fp64 references of
 * tests/fm_ref_ops.c (shared with the CUDA op tests); the helpers are tests/fm_test_ops_cpu.h; the
 * layer op cases and FD objectives every backend runs are tests/fm_op_cases.h.
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

#include "fm_test_ops_cpu.h"
#include "fm_op_cases.h"

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

/* fwd exact (a copy); bwd accumulates (pre-fill 1.0) with repeated tokens, columns spanning
 * several 64-column blocks, an unused row untouched; FD tol 1e-5. */
static void test_embedding(int64_t N, int64_t V, int64_t H) {
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

/* Tables are random (not unit-norm), so the backward must be the transpose, not merely an
 * inverse; T < T_max and B > 1 so the position must be t, not b*T + t; rd < hd: the dims past rd
 * must come out as they went in (the reference copies them). Tol 1e-5. */
static void test_rope(int64_t B, int64_t T, int64_t Tmax, int64_t nh, int64_t hd, int64_t rd) {
    const int64_t n = B * T * nh * hd;
    float *cs = fnew(Tmax * rd / 2), *sn = fnew(Tmax * rd / 2), *x = fnew(n), *dout = fnew(n),
          *buf = fnew(n);
    fill_uniform(cs, Tmax * rd / 2, -1.2, 1.2);
    fill_uniform(sn, Tmax * rd / 2, -1.2, 1.2);
    fill_normal(x, n, 1.0);
    fill_normal(dout, n, 1.0);
    rope_st s = {dnew(n), dnew(n), cs, sn, B, T, nh, hd, rd};
    to_d(s.x, x, n);
    to_d(s.dout, dout, n);
    double *ref = dnew(n);
    fm_ref_rope(ref, s.x, cs, sn, B, T, nh, hd, rd, 1.0);
    memcpy(buf, x, (size_t)n * sizeof(float));
    OPS->rope_fwd(CTX, buf, cs, sn, B, T, nh, hd, rd, NULL);
    CHECK_ERR("rope_fwd", nerr(buf, ref, n, 1e-30), 1e-5);
    if (rd < hd) { /* the passed-through dims: bit for bit the input */
        bool same = true;
        for (int64_t v = 0; v < B * T * nh; v++) same = same && !memcmp(buf + v * hd + rd, x + v * hd + rd, sizeof(float) * (size_t)(hd - rd));
        CHECK_MSG(same, "rope_fwd rd %lld < hd %lld: the dims past rd changed", (long long)rd, (long long)hd);
    }
    memcpy(buf, dout, (size_t)n * sizeof(float));
    OPS->rope_bwd(CTX, buf, cs, sn, B, T, nh, hd, rd, NULL);
    double *g = dnew(n);
    to_d(g, buf, n);
    fd_check("rope_bwd dx", rope_obj, &s, s.x, n, g, 1e-5);
    free(cs), free(sn), free(x), free(dout), free(buf), free(s.x), free(s.dout), free(ref), free(g);
}

/* ---- linear-layer biases ------------------------------------------------------------------ */

/* bias_add against y + b in fp64 (one fp32 rounding: within 2^-24 relative); bias_grad against
 * the fp64 column sums added onto a non-zero db (it accumulates), N terms of fp32 inputs summed
 * in double: 1e-6 relative is far above its rounding and far below any missing or extra row. */
static void test_bias(int64_t N, int64_t D) {
    float *y = fnew(N * D), *b = fnew(D), *dy = fnew(N * D), *db = fnew(D);
    fill_normal(y, N * D, 1.0);
    fill_normal(b, D, 1.0);
    fill_normal(dy, N * D, 1.0);
    fill_normal(db, D, 1.0);
    double *ry = dnew(N * D), *rdb = dnew(D);
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < D; j++) ry[n * D + j] = (double)y[n * D + j] + b[j];
    for (int64_t j = 0; j < D; j++) {
        rdb[j] = db[j];
        for (int64_t n = 0; n < N; n++) rdb[j] += dy[n * D + j];
    }
    OPS->bias_add(CTX, y, b, N, D);
    CHECK_ERR("bias_add", nerr(y, ry, N * D, 1e-30), 1e-6);
    OPS->bias_grad(CTX, db, dy, N, D);
    CHECK_ERR("bias_grad", nerr(db, rdb, D, 1e-30), 1e-6);
    free(y), free(b), free(dy), free(db), free(ry), free(rdb);
}

/* ---- head slices (multi-head latent attention's assembly) ---------------------------------- */

static void test_head_slice(const fm_case_slice *c) {
    const int64_t ns = c->N * fm_case_slice_src_heads(c) * c->sw, nd = c->N * fm_case_slice_dst_heads(c) * c->dw;
    float *src = fnew(ns > 0 ? ns : 1), *dst = fnew(nd);
    fill_normal(src, ns > 0 ? ns : 1, 1.0);
    fill_normal(dst, nd, 1.0);
    double *ref = dnew(nd);
    for (int64_t i = 0; i < nd; i++) ref[i] = dst[i];
    fm_case_slice_ref(ref, src, c);
    const fm_slice sa = {fm_case_slice_src_heads(c) * c->sw, c->bcast ? 0 : c->sw, c->soff};
    const fm_slice da = {fm_case_slice_dst_heads(c) * c->dw, c->sum ? 0 : c->dw, c->doff};
    OPS->head_slice(CTX, dst, da, c->zeros ? NULL : src, sa, c->N, c->nh, c->d, c->perm, c->alpha, c->acc);
    /* a copy (alpha 1, nothing summed) is exact; a scaled or summed one within fp32 rounding */
    const bool exact = c->alpha == 1.0f && !c->sum && !c->acc;
    double worst = 0;
    for (int64_t i = 0; i < nd; i++) worst = fmax(worst, fabs(dst[i] - ref[i]));
    CHECK_MSG(exact ? worst == 0 : worst <= 1e-6 * 8, "head_slice N=%lld nh=%lld d=%lld perm %d: max error %g",
              (long long)c->N, (long long)c->nh, (long long)c->d, c->perm, worst);
    free(src), free(dst), free(ref);
}

/* ---- attention ---------------------------------------------------------------------------- */

typedef struct att_st {
    double *q, *k, *v, *dout, *out, *lse;
    int64_t B, T, nh, nkv, hd;
    const int32_t *kvs; /* packed documents' starts, or NULL: causal */
} att_st;

/* fm_ref_attention_fwd (naive causal GQA over the full score row, fp64) on double arrays. */
static void att_ref(double *out, double *lse, const double *q, const double *k, const double *v,
                    int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kvs) {
    const fm_ref_att a = {q, k, v, NULL, B, T, nh, nkv, hd, kvs};
    fm_ref_attention_fwd(out, lse, &a);
}

static double att_obj(void *p) {
    att_st *s = p;
    const int64_t n = s->B * s->T * s->nh * s->hd;
    att_ref(s->out, NULL, s->q, s->k, s->v, s->B, s->T, s->nh, s->nkv, s->hd, s->kvs);
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
static void test_attention_case_kv(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                                   bool grad, const int32_t *kvs) {
    att_bufs a = att_alloc(B, T, nh, nkv, hd);
    fill_normal(a.q, a.nq, 1.5);
    fill_normal(a.k, a.nk, 1.5);
    fill_normal(a.v, a.nk, 1.0);
    fill_normal(a.dout, a.nq, 1.0);
    poison(a.out, a.nq);
    poison(a.lse, a.nl);
    OPS->attention_fwd(CTX, a.out, a.lse, a.q, a.k, a.v, B, T, nh, nkv, hd, kvs);
    att_st s = {dnew(a.nq), dnew(a.nk), dnew(a.nk), dnew(a.nq), dnew(a.nq), dnew(a.nl),
                B, T, nh, nkv, hd, kvs};
    to_d(s.q, a.q, a.nq);
    to_d(s.k, a.k, a.nk);
    to_d(s.v, a.v, a.nk);
    to_d(s.dout, a.dout, a.nq);
    att_ref(s.out, s.lse, s.q, s.k, s.v, B, T, nh, nkv, hd, kvs);
    char what[128];
    snprintf(what, sizeof what, kvs ? "attention_fwd (documents) out B=%lld" : "attention_fwd out B=%lld T=%lld nh=%lld nkv=%lld hd=%lld",
             (long long)B, (long long)T, (long long)nh, (long long)nkv, (long long)hd);
    CHECK_ERR(what, nerr(a.out, s.out, a.nq, 1e-30), 1e-5);
    snprintf(what, sizeof what, kvs ? "attention_fwd (documents) lse B=%lld" : "attention_fwd lse B=%lld T=%lld nh=%lld nkv=%lld hd=%lld",
             (long long)B, (long long)T, (long long)nh, (long long)nkv, (long long)hd);
    CHECK_ERR(what, nerr(a.lse, s.lse, a.nl, 1.0), 1e-5);
    if (grad) {
        poison(a.dq, a.nq);
        poison(a.dk, a.nk);
        poison(a.dv, a.nk);
        OPS->attention_bwd(CTX, a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, B, T, nh,
                           nkv, hd, kvs);
        double *g = dnew(a.nq);
        const char *names[3] = {"dq", "dk", "dv"};
        float *grads[3] = {a.dq, a.dk, a.dv};
        double *xs[3] = {s.q, s.k, s.v};
        int64_t ns[3] = {a.nq, a.nk, a.nk};
        for (int i = 0; i < 3; i++) {
            to_d(g, grads[i], ns[i]);
            snprintf(what, sizeof what, kvs ? "attention_bwd (documents) %s B=%lld" : "attention_bwd %s B=%lld T=%lld nh=%lld nkv=%lld hd=%lld",
                     names[i], (long long)B, (long long)T, (long long)nh, (long long)nkv,
                     (long long)hd);
            fd_check_ex(what, att_obj, &s, xs[i], ns[i], g, 1e-4, ATT_GRAD_FLOOR, FD_H);
        }
        free(g);
    }
    free(s.q), free(s.k), free(s.v), free(s.dout), free(s.out), free(s.lse);
    att_free(&a);
}

static void test_attention_case(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, bool grad) {
    test_attention_case_kv(B, T, nh, nkv, hd, grad, NULL);
}

/* Packed documents (FM_CASES_ATT_DOCS): against the fp64 reference restricted to each query's
 * document, forward and finite-difference backward at the causal cases' tolerances. */
static void test_attention_docs(void) {
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_ATT_DOCS); i++) {
        const fm_case_att_docs *c = &FM_CASES_ATT_DOCS[i];
        int32_t *kvs = malloc(sizeof(int32_t) * (size_t)(c->B * c->T));
        fm_case_att_kv_start(c, kvs);
        test_attention_case_kv(c->B, c->T, c->nh, c->nkv, c->hd, true, kvs);
        free(kvs);
    }
}

/* RoPE by given positions (packed documents restart them): each token rotated by its own
 * position's table row, as the reference rotates one token at that position; the backward is
 * the transpose of the same rotation. */
static void test_rope_positions(void) {
    const int64_t B = 2, T = 11, nh = 3, hd = 16, half = hd / 2, n = B * T * nh * hd;
    float *cs = fnew(T * half), *sn = fnew(T * half), *x = fnew(n), *buf = fnew(n);
    fill_uniform(cs, T * half, -1.2, 1.2);
    fill_uniform(sn, T * half, -1.2, 1.2);
    fill_normal(x, n, 1.0);
    int32_t pos[B * T];
    for (int64_t i = 0; i < B * T; i++) pos[i] = (int32_t)((i % T) < 4 ? i % T : (i % T) - 4); /* docs 0..3, 4.. */
    double *xd = dnew(n), *ref = dnew(n);
    to_d(xd, x, n);
    for (int64_t bt = 0; bt < B * T; bt++)
        fm_ref_rope(ref + bt * nh * hd, xd + bt * nh * hd, cs + pos[bt] * half, sn + pos[bt] * half, 1, 1, nh, hd,
                    hd, 1.0);
    memcpy(buf, x, (size_t)n * sizeof(float));
    OPS->rope_fwd(CTX, buf, cs, sn, B, T, nh, hd, hd, pos);
    CHECK_ERR("rope_fwd (positions)", nerr(buf, ref, n, 1e-30), 1e-5);
    for (int64_t bt = 0; bt < B * T; bt++)
        fm_ref_rope(ref + bt * nh * hd, xd + bt * nh * hd, cs + pos[bt] * half, sn + pos[bt] * half, 1, 1, nh, hd,
                    hd, -1.0);
    memcpy(buf, x, (size_t)n * sizeof(float));
    OPS->rope_bwd(CTX, buf, cs, sn, B, T, nh, hd, hd, pos);
    CHECK_ERR("rope_bwd (positions)", nerr(buf, ref, n, 1e-30), 1e-5);
    free(cs), free(sn), free(x), free(buf), free(xd), free(ref);
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
    OPS->attention_fwd(CTX, a.out, a.lse, a.q, a.k, a.v, B, T, nh, nkv, hd, NULL);
    double *q = dnew(a.nq), *k = dnew(a.nk), *v = dnew(a.nk), *out = dnew(a.nq), *lse = dnew(a.nl);
    to_d(q, a.q, a.nq);
    to_d(k, a.k, a.nk);
    to_d(v, a.v, a.nk);
    att_ref(out, lse, q, k, v, B, T, nh, nkv, hd, NULL);
    double smax = 0;
    for (int64_t i = 0; i < a.nl; i++) smax = fabs(lse[i]) > smax ? fabs(lse[i]) : smax;
    printf("attention overflow case: max |lse| = %.3g\n", smax);
    CHECK_ERR("attention_fwd out, huge scores", nerr(a.out, out, a.nq, 1e-30), 1e-5);
    CHECK_ERR("attention_fwd lse, huge scores", nerr(a.lse, lse, a.nl, 1.0), 1e-6);
    poison(a.dq, a.nq);
    poison(a.dk, a.nk);
    poison(a.dv, a.nk);
    OPS->attention_bwd(CTX, a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, B, T, nh, nkv,
                       hd, NULL);
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
    OPS->attention_fwd(CTX, a.out, a.lse, a.q, a.k, a.v, B, T, nh, nkv, hd, NULL);
    OPS->attention_fwd(CTX, b.out, b.lse, a.q, a.k, a.v, B, T, nh, nkv, hd, NULL);
    CHECK_MSG(!memcmp(a.out, b.out, (size_t)a.nq * 4) && !memcmp(a.lse, b.lse, (size_t)a.nl * 4),
              "attention_fwd: two calls differ");
    OPS->attention_bwd(CTX, a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, B, T, nh, nkv,
                       hd, NULL);
    OPS->attention_bwd(CTX, b.dq, b.dk, b.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, B, T, nh, nkv,
                       hd, NULL);
    CHECK_MSG(!memcmp(a.dq, b.dq, (size_t)a.nq * 4) && !memcmp(a.dk, b.dk, (size_t)a.nk * 4) &&
                  !memcmp(a.dv, b.dv, (size_t)a.nk * 4),
              "attention_bwd: two calls differ");
    fm_backend one;
    CHECK(fm_cpu_backend_init(&one, 1, 64) == FM_OK);
    one.ops->attention_fwd(one.ctx, b.out, b.lse, a.q, a.k, a.v, B, T, nh, nkv, hd, NULL);
    one.ops->attention_bwd(one.ctx, b.dq, b.dk, b.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, B, T, nh,
                           nkv, hd, NULL);
    CHECK_MSG(!memcmp(a.out, b.out, (size_t)a.nq * 4) && !memcmp(a.dq, b.dq, (size_t)a.nq * 4) &&
                  !memcmp(a.dk, b.dk, (size_t)a.nk * 4) && !memcmp(a.dv, b.dv, (size_t)a.nk * 4),
              "attention: 1 thread and 2 threads differ");
    fm_cpu_backend_free(&one);
    att_free(&a);
    att_free(&b);
}

static void test_attention(void) {
    /* Forward only, larger T: tiles 64, T not a multiple, GQA groups 1/2/4, hd 32/64/128. */
    test_attention_docs();
    test_rope_positions();
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

/* Gates up to |g| ~ 30 (saturated sigmoid). fwd tol 1e-5, bwd FD tol 1e-5. */
static void test_swiglu(int64_t n) {
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
    /* the layer op cases every backend runs (tests/fm_op_cases.h) */
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_EMB); i++)
        test_embedding(FM_CASES_EMB[i].N, FM_CASES_EMB[i].V, FM_CASES_EMB[i].H);
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_RMS); i++)
        test_rmsnorm(FM_CASES_RMS[i].N, FM_CASES_RMS[i].D, FM_CASES_RMS[i].x_scale);
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_ROPE); i++) {
        const fm_case_rope *c = &FM_CASES_ROPE[i];
        test_rope(c->B, c->T, c->Tmax, c->nh, c->hd, c->rd);
    }
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_BIAS); i++) test_bias(FM_CASES_BIAS[i].N, FM_CASES_BIAS[i].D);
    test_bias(300, 64); /* over the OpenMP threshold (8192 elements) */
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_SLICE); i++) test_head_slice(&FM_CASES_SLICE[i]);
    test_attention();
    for (int i = 0; i < FM_CASES_COUNT(FM_CASES_SWIGLU); i++) test_swiglu(FM_CASES_SWIGLU[i]);

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
