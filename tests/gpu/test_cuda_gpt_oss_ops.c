/* GPT-OSS's operators on the CUDA backend (issue 26; cuda_gpt_oss.cu, cuda_attention_ext.cu)
 * against the plain fp64 references of tests/fm_ref_oss.h (the CPU test tests/test_gpt_oss_ops.c
 * holds the CPU backend to the same references), on bf16 inputs (the references read the same
 * bf16 values):
 *   swiglu_clamp_fwd / _bwd: normalized error <= GT_TOL_BF16 (outputs rounded once to bf16), the
 *     clamp's zero-gradient regions exactly 0;
 *   bias_add_f32: exact (one fp32 add of a bf16 value);
 *   attention_ext_fwd / _bwd (sinks, sliding windows, packed documents): out, dq, dk, dv within
 *     GT_TOL_BF16, lse and dsinks within 1e-3 normalized (fp32 outputs from bf16 inputs, compared
 *     with the fp64 forward and the central differences of sum(dout o out) for the sinks);
 *   two runs give the same bits (no atomics).
 * Shapes: windows and documents inside and across the scalar kernels' 128-key chunks.
 * Written in session 17 without a GPU: compiled, not yet run. */
#include "core/fm_rng.h"
#include "fm_ref_oss.h"
#include "fm_test_fd.h"
#include "gpu_test.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static fm_backend g_be;
static fm_rng g_rng;

static void fill(float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * fm_rng_normal(&g_rng));
    gt_round_bf16(x, n);
}

static double *to_d(const float *x, int64_t n) {
    double *d = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

static void test_swiglu_clamp(int64_t n, float limit) {
    const fm_ops *o = g_be.ops;
    float *g = malloc((size_t)n * 4), *u = malloc((size_t)n * 4), *d = malloc((size_t)n * 4);
    float *out = malloc((size_t)n * 4), *dg = malloc((size_t)n * 4), *du = malloc((size_t)n * 4);
    fill(g, n, 1.2 * limit), fill(u, n, 1.2 * limit), fill(d, n, 1.0);
    g[0] = limit, u[1] = -limit, u[2] = limit; /* exactly at the limits (bf16 values for 7.0) */
    void *dgp = gt_upload(&g_be, g, n, FM_DTYPE_BF16), *dup = gt_upload(&g_be, u, n, FM_DTYPE_BF16);
    void *ddp = gt_upload(&g_be, d, n, FM_DTYPE_BF16), *dout = gt_upload(&g_be, d, n, FM_DTYPE_BF16);
    void *ddg = gt_upload(&g_be, d, n, FM_DTYPE_BF16), *ddu = gt_upload(&g_be, d, n, FM_DTYPE_BF16);
    o->swiglu_clamp_fwd(g_be.ctx, dout, dgp, dup, n, limit, 1.702f);
    o->swiglu_clamp_bwd(g_be.ctx, ddg, ddu, ddp, dgp, dup, n, limit, 1.702f);
    gt_download(&g_be, out, dout, n, FM_DTYPE_BF16);
    gt_download(&g_be, dg, ddg, n, FM_DTYPE_BF16);
    gt_download(&g_be, du, ddu, n, FM_DTYPE_BF16);
    double *gd = to_d(g, n), *ud = to_d(u, n), *dd = to_d(d, n);
    double *ro = malloc(sizeof(double) * (size_t)n), *rg = malloc(sizeof(double) * (size_t)n),
           *ru = malloc(sizeof(double) * (size_t)n);
    fm_ref_swiglu_clamp_fwd(ro, gd, ud, n, limit, 1.702);
    fm_ref_swiglu_clamp_bwd(rg, ru, dd, gd, ud, n, limit, 1.702);
    CHECK_MSG(gt_nerr(out, ro, n) <= GT_TOL_BF16, "swiglu_clamp_fwd n=%lld: nerr %g", (long long)n, gt_nerr(out, ro, n));
    CHECK_MSG(gt_nerr(dg, rg, n) <= GT_TOL_BF16, "swiglu_clamp_bwd dgate: nerr %g", gt_nerr(dg, rg, n));
    CHECK_MSG(gt_nerr(du, ru, n) <= GT_TOL_BF16, "swiglu_clamp_bwd dup: nerr %g", gt_nerr(du, ru, n));
    int64_t zero_bad = 0;
    for (int64_t i = 0; i < n; i++) {
        if (g[i] > limit && dg[i] != 0.0f) zero_bad++;
        if ((u[i] > limit || u[i] < -limit) && du[i] != 0.0f) zero_bad++;
    }
    CHECK_MSG(zero_bad == 0, "swiglu_clamp_bwd: %lld clamped elements with a nonzero gradient", (long long)zero_bad);
    o->mem_free(g_be.ctx, dgp), o->mem_free(g_be.ctx, dup), o->mem_free(g_be.ctx, ddp), o->mem_free(g_be.ctx, dout);
    o->mem_free(g_be.ctx, ddg), o->mem_free(g_be.ctx, ddu);
    free(g), free(u), free(d), free(out), free(dg), free(du), free(gd), free(ud), free(dd), free(ro), free(rg), free(ru);
}

static void test_bias_add_f32(void) {
    const int64_t N = 37, D = 11;
    float y[37 * 11], b[11], want[37 * 11];
    fill(y, N * D, 1.0), fill(b, D, 1.0);
    for (int64_t i = 0; i < N * D; i++) want[i] = y[i] + b[i % D];
    void *dy = gt_upload(&g_be, y, N * D, FM_DTYPE_F32), *db = gt_upload(&g_be, b, D, FM_DTYPE_BF16);
    g_be.ops->bias_add_f32(g_be.ctx, dy, db, N, D);
    gt_download(&g_be, y, dy, N * D, FM_DTYPE_F32);
    CHECK_MSG(!memcmp(y, want, sizeof y), "bias_add_f32: not y + b exactly");
    g_be.ops->mem_free(g_be.ctx, dy), g_be.ops->mem_free(g_be.ctx, db);
}

typedef struct att_case {
    int64_t B, T, nh, nkv, hd, W;
    bool sinks, docs;
} att_case;

static double obj(const att_case *c, const double *q, const double *k, const double *v, const double *s,
                  const double *dout, const int32_t *kvs, double *out, double *lse) {
    fm_ref_attention_ext(out, lse, q, k, v, c->B, c->T, c->nh, c->nkv, c->hd, kvs, c->sinks ? s : NULL, c->W);
    double L = 0;
    for (int64_t i = 0; i < c->B * c->T * c->nh * c->hd; i++) L += out[i] * dout[i];
    return L;
}

typedef struct fd_st {
    const att_case *c;
    double *q, *k, *v, *s, *dout, *out, *lse;
    const int32_t *kvs;
} fd_st;

static double fd_obj(void *p) {
    const fd_st *f = p;
    return obj(f->c, f->q, f->k, f->v, f->s, f->dout, f->kvs, f->out, f->lse);
}

static void test_attention(att_case c) {
    const fm_ops *o = g_be.ops;
    const int64_t nq = c.B * c.T * c.nh * c.hd, nk = c.B * c.T * c.nkv * c.hd, nl = c.B * c.nh * c.T;
    float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4), *v = malloc((size_t)nk * 4);
    float *dout = malloc((size_t)nq * 4), *sk = malloc((size_t)c.nh * 4);
    float *out = malloc((size_t)nq * 4), *lse = malloc((size_t)nl * 4), *dq = malloc((size_t)nq * 4);
    float *dk = malloc((size_t)nk * 4), *dv = malloc((size_t)nk * 4), *ds = malloc((size_t)c.nh * 4);
    float *out2 = malloc((size_t)nq * 4), *dq2 = malloc((size_t)nq * 4);
    fill(q, nq, 1.0), fill(k, nk, 1.0), fill(v, nk, 1.0), fill(dout, nq, 1.0), fill(sk, c.nh, 1.0);
    int32_t *kvs = malloc(sizeof(int32_t) * (size_t)(c.B * c.T));
    for (int64_t b = 0; b < c.B; b++) /* documents: row b splits at T/3 */
        for (int64_t t = 0; t < c.T; t++) kvs[b * c.T + t] = c.docs && t >= c.T / 3 ? (int32_t)(c.T / 3) : 0;
    void *Dq = gt_upload(&g_be, q, nq, FM_DTYPE_BF16), *Dk = gt_upload(&g_be, k, nk, FM_DTYPE_BF16);
    void *Dv = gt_upload(&g_be, v, nk, FM_DTYPE_BF16), *Ddo = gt_upload(&g_be, dout, nq, FM_DTYPE_BF16);
    void *Ds = gt_upload(&g_be, sk, c.nh, FM_DTYPE_BF16);
    float zero[64] = {0};
    void *Dds = gt_upload(&g_be, zero, c.nh, FM_DTYPE_BF16);
    void *Do = gt_upload(&g_be, out, nq, FM_DTYPE_BF16), *Dgq = gt_upload(&g_be, q, nq, FM_DTYPE_BF16);
    void *Dgk = gt_upload(&g_be, k, nk, FM_DTYPE_BF16), *Dgv = gt_upload(&g_be, v, nk, FM_DTYPE_BF16);
    float *Dl = g_be.ops->mem_alloc(g_be.ctx, (size_t)nl * 4 + 256);
    int32_t *Dkvs = g_be.ops->mem_alloc(g_be.ctx, sizeof(int32_t) * (size_t)(c.B * c.T) + 256);
    o->copy(g_be.ctx, Dkvs, kvs, sizeof(int32_t) * (size_t)(c.B * c.T), FM_COPY_H2D);
    for (int rep = 0; rep < 2; rep++) {
        o->attention_ext_fwd(g_be.ctx, Do, Dl, Dq, Dk, Dv, c.B, c.T, c.nh, c.nkv, c.hd, c.docs ? Dkvs : NULL,
                             c.sinks ? Ds : NULL, c.W);
        o->attention_ext_bwd(g_be.ctx, Dgq, Dgk, Dgv, rep == 0 ? Dds : NULL, Ddo, Dq, Dk, Dv, Do, Dl, c.B, c.T, c.nh,
                             c.nkv, c.hd, c.docs ? Dkvs : NULL, c.sinks ? Ds : NULL, c.W);
        gt_download(&g_be, rep ? out2 : out, Do, nq, FM_DTYPE_BF16);
        gt_download(&g_be, rep ? dq2 : dq, Dgq, nq, FM_DTYPE_BF16);
    }
    gt_download(&g_be, lse, Dl, nl, FM_DTYPE_F32);
    gt_download(&g_be, dk, Dgk, nk, FM_DTYPE_BF16);
    gt_download(&g_be, dv, Dgv, nk, FM_DTYPE_BF16);
    gt_download(&g_be, ds, Dds, c.nh, FM_DTYPE_BF16);
    char what[160];
    snprintf(what, sizeof what, "cuda attention_ext B=%lld T=%lld nh=%lld nkv=%lld hd=%lld W=%lld sinks=%d docs=%d",
             (long long)c.B, (long long)c.T, (long long)c.nh, (long long)c.nkv, (long long)c.hd, (long long)c.W,
             (int)c.sinks, (int)c.docs);
    CHECK_MSG(!memcmp(out, out2, (size_t)nq * 4) && !memcmp(dq, dq2, (size_t)nq * 4), "%s: two runs differ", what);
    double *qd = to_d(q, nq), *kd = to_d(k, nk), *vd = to_d(v, nk), *sd = to_d(sk, c.nh), *dd = to_d(dout, nq);
    double *ro = malloc(sizeof(double) * (size_t)nq), *rl = malloc(sizeof(double) * (size_t)nl);
    obj(&c, qd, kd, vd, sd, dd, c.docs ? kvs : NULL, ro, rl);
    CHECK_MSG(gt_nerr(out, ro, nq) <= GT_TOL_BF16, "%s: out nerr %g", what, gt_nerr(out, ro, nq));
    CHECK_MSG(gt_nerr(lse, rl, nl) <= 1e-3, "%s: lse nerr %g", what, gt_nerr(lse, rl, nl));
    /* gradients: central differences of the fp64 objective (fm_fd_check: sampled elements and
     * random directions; bf16 gradients, so 3e-2 normalized by max(max|grad|, 0.1)) */
    fd_st f = {&c, qd, kd, vd, sd, dd, ro, rl, c.docs ? kvs : NULL};
    double *xs[4] = {qd, kd, vd, sd};
    const float *gs[4] = {dq, dk, dv, ds};
    const int64_t ns[4] = {nq, nk, nk, c.nh};
    const char *names[4] = {"dq", "dk", "dv", "dsinks"};
    for (int a = 0; a < (c.sinks ? 4 : 3); a++) {
        double *g = to_d(gs[a], ns[a]);
        char w2[200];
        snprintf(w2, sizeof w2, "%s %s", what, names[a]);
        fm_fd_check(w2, fd_obj, &f, xs[a], ns[a], g, 3e-2, 0.1, FD_H, 0.5, &g_rng);
        free(g);
    }
    void *dev[] = {Dq, Dk, Dv, Ddo, Ds, Dds, Do, Dgq, Dgk, Dgv, Dl, Dkvs};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) o->mem_free(g_be.ctx, dev[i]);
    free(q), free(k), free(v), free(dout), free(sk), free(out), free(lse), free(dq), free(dk), free(dv), free(ds);
    free(out2), free(dq2), free(kvs), free(qd), free(kd), free(vd), free(sd), free(dd), free(ro), free(rl);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20261207));
    const fm_status st = gt_cuda_init(&g_be, 0, 128, 0);
    CHECK_MSG(st == FM_OK, "fm_cuda_backend_init: %s", fm_errmsg());
    if (st != FM_OK) return fm_test_finish();
    const fm_ops *o = g_be.ops;
    CHECK_MSG(o->swiglu_clamp_fwd && o->swiglu_clamp_bwd && o->bias_add_f32 && o->attention_ext_fwd &&
                  o->attention_ext_bwd, "the CUDA backend lacks a GPT-OSS op");
    if (o->swiglu_clamp_fwd && o->attention_ext_fwd && o->bias_add_f32) {
        test_swiglu_clamp(1000, 7.0f);
        test_swiglu_clamp(300000, 2.5f); /* grid-stride */
        test_bias_add_f32();
        test_attention((att_case){2, 37, 4, 2, 16, 5, true, false});
        test_attention((att_case){1, 150, 4, 1, 64, 128, true, false}); /* gpt-oss's head_dim and window */
        test_attention((att_case){2, 40, 2, 1, 8, 6, true, true});
        test_attention((att_case){1, 33, 2, 2, 8, 0, true, false});     /* sinks alone */
        test_attention((att_case){1, 33, 2, 1, 8, 4, false, false});    /* window alone */
        /* more than the kernels' S_NT = 128 keys per query and queries per key (the forward's
         * online rescale across chunks, dq's and dk/dv's chunk loops and their partial tails):
         * a window of 150 with a 200-token document; causal rows of 290 (chunks 128, 128, 34) */
        test_attention((att_case){1, 300, 2, 1, 8, 150, true, true});
        test_attention((att_case){1, 290, 2, 2, 8, 0, true, false});
        CHECK_BACKEND_OK(&g_be);
    }
    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
