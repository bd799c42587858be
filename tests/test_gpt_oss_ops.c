/* GPT-OSS's operators on the CPU backend (issue 26) against the plain fp64 references of
 * tests/fm_ref_oss.h:
 *   swiglu_clamp_fwd / _bwd: the forward within 2e-6 and the backward within 1e-5 (normalized by
 *     the largest reference value: a handful of fp32 roundings and one expf, ~1 ulp, per
 *     element); the clamp's zero-gradient regions exactly 0 (gate above limit, up outside
 *     [-limit, limit]); values exactly at the limits take the inside gradient (torch.clamp's);
 *     NaN stays NaN; the backward against central differences of the fp64 forward at points off
 *     the kinks;
 *   attention_ext_fwd / _bwd (sinks, sliding windows, packed documents): out and lse within 1e-5
 *     (the tolerance of attention_fwd's own test, tests/test_ops_cpu.c), dq, dk, dv and the
 *     accumulated dsinks against central differences of the fp64 objective sum(dout o out) at
 *     1e-4; with no sinks and no window the bits of attention_fwd / _bwd; a window of T or more
 *     equals no window bit for bit (the same tiles and keys). */
#include "fm_test_ops_cpu.h"
#include "fm_ref_oss.h"

/* ---- the clamped SwiGLU -------------------------------------------------------------------- */

typedef struct sw_st {
    double *g, *u;
    const double *dout;
    int64_t n;
    double limit, alpha;
} sw_st;

static double sw_obj(void *p) {
    const sw_st *s = p;
    double *o = dnew(s->n), L = 0;
    fm_ref_swiglu_clamp_fwd(o, s->g, s->u, s->n, s->limit, s->alpha);
    for (int64_t i = 0; i < s->n; i++) L += o[i] * s->dout[i];
    free(o);
    return L;
}

static void test_swiglu_clamp(int64_t n, float limit, float alpha) {
    float *g = malloc((size_t)n * 4), *u = malloc((size_t)n * 4), *o = malloc((size_t)n * 4);
    float *d = malloc((size_t)n * 4), *dg = malloc((size_t)n * 4), *du = malloc((size_t)n * 4);
    fill_normal(g, n, 1.2 * limit);
    fill_normal(u, n, 1.2 * limit);
    fill_normal(d, n, 1.0);
    /* the edges: exactly at the limits, just inside and outside */
    const float edge[] = {limit, -limit, nextafterf(limit, 0), nextafterf(limit, 2 * limit), -nextafterf(limit, 0),
                          -nextafterf(limit, 2 * limit), 0.0f, -30.0f};
    for (int i = 0; i < 8 && 2 * i + 1 < n; i++) g[2 * i] = edge[i], u[2 * i + 1] = edge[i];
    poison(o, n), poison(dg, n), poison(du, n);
    OPS->swiglu_clamp_fwd(CTX, o, g, u, n, limit, alpha);
    OPS->swiglu_clamp_bwd(CTX, dg, du, d, g, u, n, limit, alpha);
    double *gd = dnew(n), *ud = dnew(n), *dd = dnew(n), *ro = dnew(n), *rg = dnew(n), *ru = dnew(n);
    to_d(gd, g, n), to_d(ud, u, n), to_d(dd, d, n);
    fm_ref_swiglu_clamp_fwd(ro, gd, ud, n, limit, alpha);
    fm_ref_swiglu_clamp_bwd(rg, ru, dd, gd, ud, n, limit, alpha);
    char what[128];
    snprintf(what, sizeof what, "swiglu_clamp_fwd n=%lld limit %g", (long long)n, (double)limit);
    CHECK_ERR(what, nerr(o, ro, n, 1e-30), 2e-6);
    snprintf(what, sizeof what, "swiglu_clamp_bwd dgate n=%lld limit %g", (long long)n, (double)limit);
    CHECK_ERR(what, nerr(dg, rg, n, 1e-30), 1e-5);
    snprintf(what, sizeof what, "swiglu_clamp_bwd dup n=%lld limit %g", (long long)n, (double)limit);
    CHECK_ERR(what, nerr(du, ru, n, 1e-30), 1e-5);
    int64_t zeros_ok = 0, zeros = 0, inside_ok = 0, inside = 0;
    for (int64_t i = 0; i < n; i++) {
        if (g[i] > limit) zeros++, zeros_ok += dg[i] == 0.0f;
        if (u[i] > limit || u[i] < -limit) zeros++, zeros_ok += du[i] == 0.0f;
        if (g[i] == limit) inside++, inside_ok += dg[i] != 0.0f && d[i] != 0.0f;
        if (u[i] == limit || u[i] == -limit) inside++, inside_ok += du[i] != 0.0f || g[i] == 0.0f;
    }
    CHECK_MSG(zeros > 0 && zeros_ok == zeros, "%s: %lld of %lld clamped elements have a zero gradient", what,
              (long long)zeros_ok, (long long)zeros);
    CHECK_MSG(inside > 0 && inside_ok == inside, "%s: %lld of %lld elements at a limit keep their gradient", what,
              (long long)inside_ok, (long long)inside);
    /* central differences of the fp64 forward, off the kinks (|x - limit| > 1e-3) */
    for (int64_t i = 0; i < n; i++) {
        if (fabs(gd[i] - limit) < 1e-3) gd[i] = limit - 0.5;
        if (fabs(fabs(ud[i]) - limit) < 1e-3) ud[i] = 0.5;
    }
    for (int64_t i = 0; i < n; i++) g[i] = (float)gd[i], u[i] = (float)ud[i];
    to_d(gd, g, n), to_d(ud, u, n);
    OPS->swiglu_clamp_bwd(CTX, dg, du, d, g, u, n, limit, alpha);
    sw_st st = {gd, ud, dd, n, limit, alpha};
    double *gr = dnew(n);
    to_d(gr, dg, n);
    fd_check(what, sw_obj, &st, gd, n, gr, 1e-5);
    to_d(gr, du, n);
    fd_check(what, sw_obj, &st, ud, n, gr, 1e-5);
    free(gr);
    /* NaN propagates through the forward (torch.clamp keeps NaN) */
    float gn = NAN, un = 1.0f, on = 0;
    OPS->swiglu_clamp_fwd(CTX, &on, &gn, &un, 1, limit, alpha);
    CHECK(isnan(on));
    gn = 1.0f, un = NAN;
    OPS->swiglu_clamp_fwd(CTX, &on, &gn, &un, 1, limit, alpha);
    CHECK(isnan(on));
    free(g), free(u), free(o), free(d), free(dg), free(du);
    free(gd), free(ud), free(dd), free(ro), free(rg), free(ru);
}

/* ---- attention with sinks and sliding windows ----------------------------------------------- */

typedef struct ax_st {
    double *q, *k, *v, *sinks, *dout, *out, *lse;
    int64_t B, T, nh, nkv, hd, W;
    const int32_t *kvs;
    bool use_sinks;
} ax_st;

static double ax_obj(void *p) {
    const ax_st *s = p;
    fm_ref_attention_ext(s->out, s->lse, s->q, s->k, s->v, s->B, s->T, s->nh, s->nkv, s->hd, s->kvs,
                         s->use_sinks ? s->sinks : NULL, s->W);
    return dot_d(s->out, s->dout, s->B * s->T * s->nh * s->hd);
}

static void test_attention_ext(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t W, bool sinks,
                               const int32_t *kvs) {
    const int64_t nq = B * T * nh * hd, nk = B * T * nkv * hd, nl = B * nh * T;
    float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4), *v = malloc((size_t)nk * 4);
    float *out = malloc((size_t)nq * 4), *lse = malloc((size_t)nl * 4), *dout = malloc((size_t)nq * 4);
    float *dq = malloc((size_t)nq * 4), *dk = malloc((size_t)nk * 4), *dv = malloc((size_t)nk * 4);
    float *sk = malloc((size_t)nh * 4), *dsk = malloc((size_t)nh * 4);
    fill_normal(q, nq, 1.5), fill_normal(k, nk, 1.5), fill_normal(v, nk, 1.0), fill_normal(dout, nq, 1.0);
    fill_normal(sk, nh, 1.5);
    sk[0] = 6.0f; /* a sink that dominates its head */
    poison(out, nq), poison(lse, nl);
    OPS->attention_ext_fwd(CTX, out, lse, q, k, v, B, T, nh, nkv, hd, kvs, sinks ? sk : NULL, W);
    ax_st s = {dnew(nq), dnew(nk), dnew(nk), dnew(nh), dnew(nq), dnew(nq), dnew(nl), B, T, nh, nkv, hd, W, kvs, sinks};
    to_d(s.q, q, nq), to_d(s.k, k, nk), to_d(s.v, v, nk), to_d(s.sinks, sk, nh), to_d(s.dout, dout, nq);
    ax_obj(&s);
    char what[160];
    snprintf(what, sizeof what, "attention_ext B=%lld T=%lld nh=%lld nkv=%lld hd=%lld W=%lld sinks=%d docs=%d",
             (long long)B, (long long)T, (long long)nh, (long long)nkv, (long long)hd, (long long)W, (int)sinks,
             kvs != NULL);
    CHECK_ERR(what, nerr(out, s.out, nq, 1e-30), 1e-5);
    CHECK_ERR(what, nerr(lse, s.lse, nl, 1.0), 1e-5);
    poison(dq, nq), poison(dk, nk), poison(dv, nk);
    fill_const(dsk, nh, 0.25f);
    OPS->attention_ext_bwd(CTX, dq, dk, dv, dsk, dout, q, k, v, out, lse, B, T, nh, nkv, hd, kvs, sinks ? sk : NULL, W);
    double *g = dnew(nq);
    const float *grads[3] = {dq, dk, dv};
    double *xs[3] = {s.q, s.k, s.v};
    const int64_t ns[3] = {nq, nk, nk};
    for (int i = 0; i < 3; i++) {
        to_d(g, grads[i], ns[i]);
        fd_check_ex(what, ax_obj, &s, xs[i], ns[i], g, 1e-4, 0.1, FD_H);
    }
    if (sinks) {
        minus_d(g, dsk, 0.25f, nh);
        fd_check_ex(what, ax_obj, &s, s.sinks, nh, g, 1e-4, 0.1, FD_H);
    } else {
        bool untouched = true;
        for (int64_t h = 0; h < nh; h++) untouched &= dsk[h] == 0.25f;
        CHECK_MSG(untouched, "%s: dsinks written without sinks", what);
    }
    free(g);
    free(s.q), free(s.k), free(s.v), free(s.sinks), free(s.dout), free(s.out), free(s.lse);
    free(q), free(k), free(v), free(out), free(lse), free(dout), free(dq), free(dk), free(dv), free(sk), free(dsk);
}

/* No sinks, no window: attention_fwd / _bwd's bits; a window >= T: no window's bits. */
static void test_attention_ext_same_bits(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
    const int64_t nq = B * T * nh * hd, nk = B * T * nkv * hd, nl = B * nh * T;
    float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4), *v = malloc((size_t)nk * 4);
    float *dout = malloc((size_t)nq * 4);
    float *o[3], *l[3], *dq[3], *dk[3], *dv[3];
    for (int i = 0; i < 3; i++) {
        o[i] = malloc((size_t)nq * 4), l[i] = malloc((size_t)nl * 4), dq[i] = malloc((size_t)nq * 4);
        dk[i] = malloc((size_t)nk * 4), dv[i] = malloc((size_t)nk * 4);
    }
    fill_normal(q, nq, 1.5), fill_normal(k, nk, 1.5), fill_normal(v, nk, 1.0), fill_normal(dout, nq, 1.0);
    OPS->attention_fwd(CTX, o[0], l[0], q, k, v, B, T, nh, nkv, hd, NULL);
    OPS->attention_bwd(CTX, dq[0], dk[0], dv[0], dout, q, k, v, o[0], l[0], B, T, nh, nkv, hd, NULL);
    for (int i = 1; i < 3; i++) {
        const int64_t W = i == 1 ? 0 : T;
        OPS->attention_ext_fwd(CTX, o[i], l[i], q, k, v, B, T, nh, nkv, hd, NULL, NULL, W);
        OPS->attention_ext_bwd(CTX, dq[i], dk[i], dv[i], NULL, dout, q, k, v, o[i], l[i], B, T, nh, nkv, hd, NULL,
                               NULL, W);
        CHECK_MSG(!memcmp(o[i], o[0], (size_t)nq * 4) && !memcmp(l[i], l[0], (size_t)nl * 4) &&
                      !memcmp(dq[i], dq[0], (size_t)nq * 4) && !memcmp(dk[i], dk[0], (size_t)nk * 4) &&
                      !memcmp(dv[i], dv[0], (size_t)nk * 4),
                  "attention_ext W=%lld without sinks differs from attention_fwd/_bwd", (long long)W);
    }
    for (int i = 0; i < 3; i++) free(o[i]), free(l[i]), free(dq[i]), free(dk[i]), free(dv[i]);
    free(q), free(k), free(v), free(dout);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20261207));
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK(OPS->swiglu_clamp_fwd && OPS->swiglu_clamp_bwd && OPS->attention_ext_fwd && OPS->attention_ext_bwd);
    test_swiglu_clamp(1000, 7.0f, 1.702f);  /* gpt-oss's limit and alpha, one thread */
    test_swiglu_clamp(20000, 2.5f, 1.702f); /* the OpenMP team */
    test_attention_ext(2, 37, 4, 2, 16, 5, true, NULL);   /* window inside a tile, sinks */
    test_attention_ext(1, 150, 4, 1, 16, 70, true, NULL); /* window across tiles (64 x 64) */
    test_attention_ext(2, 37, 4, 4, 8, 0, true, NULL);    /* sinks alone */
    test_attention_ext(1, 130, 2, 1, 8, 64, false, NULL); /* window alone, tile-aligned */
    static int32_t kvs[2 * 40]; /* documents of 17 and 23 tokens in row 0; 40 in row 1 */
    for (int t = 0; t < 40; t++) kvs[t] = t < 17 ? 0 : 17, kvs[40 + t] = 0;
    test_attention_ext(2, 40, 2, 1, 8, 6, true, kvs);
    test_attention_ext(2, 40, 2, 1, 8, 30, true, kvs);    /* the window wider than a document */
    test_attention_ext_same_bits(2, 150, 4, 2, 16);
    fm_cpu_backend_free(&g_be);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
