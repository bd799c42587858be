/* CUDA attention (cuda_attention.cu) against the fp64 host reference of tests/fm_ref_ops.c (shared
 * with the CPU tests) on the same bf16-rounded inputs, on both paths: our own kernels ("fallback": the tiled tensor-core FlashAttention-2
 * kernels, and the scalar ones for head dims they do not serve) and cuDNN's fused flash
 * attention. For every shape: out (bf16, normalized error <= ATT_TOL_OUT), lse (fp32, <=
 * ATT_TOL_LSE), and dq, dk, dv (bf16, <= ATT_TOL_GRAD, assigned over poisoned buffers); the bf16
 * ones also element by element in bf16 ulps (ATT_ULPS_OUT, ATT_ULPS_GRAD). Shapes:
 * B = 1..2, T = 1, 17, 64, 127, 1000, 4096, nh/nkv = 1, 2, 4, 8, hd 64 and 128, plus odd head
 * dims. At T = 4096 the reference covers sampled query rows only (out, lse, dq); dk and dv are
 * checked for T <= 1000. Also: causality (future keys never change earlier rows), determinism of
 * the fallback (two calls, same bits), head dims above 128 (the scalar kernels), cuDNN's backward
 * split into chunks by a 4 MiB cuDNN workspace, and the forward / backward speed of each path at
 * B=1, T=16384, nh=16, nkv=16, hd=128 (TFLOP/s with 4 T^2 nh hd / 2 flops forward, 2.5x that
 * backward), cuDNN with the default 64 MiB workspace (backward in kv-head chunks) and 512 MiB.
 *
 * FLATMOE_ATTENTION_VERBOSE=1 prints cuDNN's refusals. Exits non-zero on any failure. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cuda/cuda_attention.h"
#include "backend/cuda/fm_backend_cuda.h"
#include "core/fm_rng.h"
#include "fm_op_cases.h"
#include "fm_ref_ops.h"
#include "gpu_test.h"

#define ATT_TOL_OUT GT_TOL_BF16 /* 1e-2: bf16 output, P rounded to bf16 for the P V product */
#define ATT_TOL_LSE GT_TOL_F32  /* 1e-4: fp32 output from bf16 inputs, fp32 accumulation */
#define ATT_TOL_GRAD 2e-2       /* bf16 outputs of two chained bf16 products (P, dS rounded) */
/* Gradient magnitude below which errors are measured absolutely (at T = 1, dq and dk are 0). */
#define ATT_GRAD_FLOOR 0.05
/* bf16 ulps (gt_bf16_ulps), measured with the floor rms(ref) (out and the gradients are sums over
 * up to T keys that cancel; below their RMS the error counts in ulps of the RMS). Both paths round
 * the probabilities P to bf16 for the P V product (relative 2^-9 each), so out errs by up to
 * 2^-9 sum_j p_j |v_j| <= 2^-9 max|v| (~4 at these inputs' 1.0 spread) where |out| ~ rms(out) ~
 * 0.1..0.5 on long rows: up to ~16 ulps of the RMS in the worst case, a few in practice. The
 * gradients chain two such products (P and dS = P o (dP - D) rounded): twice that. The same limits
 * follow from the normalized tolerances: an error of RMS ATT_TOL_OUT (1e-2) x rms(ref) has its
 * largest of ~1e5 elements near 4.5 x that, 0.045 rms(ref), 6 to 12 bf16 ulps of rms(ref) (an ulp
 * is 2^-8 to 2^-7 of a value); 2e-2 for the gradients: 12 to 23. */
#define ATT_ULPS_OUT 16
#define ATT_ULPS_GRAD 32

static fm_rng g_rng;
/* Packed documents (FM_CASES_ATT_DOCS, fm_backend.h kv_start): the case's starts on the host (the
 * reference's) and on the device (the op's); NULL: causal. */
static int32_t *g_kvs;
static void *g_kvs_dev;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void fill_normal(float *x, int64_t n, double sd) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(sd * fm_rng_normal(&g_rng));
    gt_round_bf16(x, n);
}

/* sqrt(sum (a - r)^2) / max(sqrt(sum r^2), floor * sqrt(n)); NaN in a -> inf. */
static double nerr_floor(const float *a, const double *r, int64_t n, double floor) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isinf(a[i])) return INFINITY;
        num += ((double)a[i] - r[i]) * ((double)a[i] - r[i]);
        den += r[i] * r[i];
    }
    den = sqrt(den);
    const double fl = floor * sqrt((double)(n > 0 ? n : 1));
    return sqrt(num) / (den > fl ? den : (fl > 0 ? fl : 1e-300));
}

/* ---- fp64 reference ------------------------------------------------------------------------- */

typedef struct att_host {
    int64_t B, T, nh, nkv, hd;
    float *q, *k, *v, *dout; /* bf16-rounded values */
} att_host;

/* ---- device buffers --------------------------------------------------------------------------- */

typedef struct att_dev {
    void *q, *k, *v, *dout, *out, *lse, *dq, *dk, *dv;
} att_dev;

static void dev_upload(const fm_backend *be, att_dev *d, const att_host *a) {
    const int64_t nq = a->B * a->T * a->nh * a->hd, nk = a->B * a->T * a->nkv * a->hd, nl = a->B * a->nh * a->T;
    d->q = gt_upload(be, a->q, nq, FM_DTYPE_BF16);
    d->k = gt_upload(be, a->k, nk, FM_DTYPE_BF16);
    d->v = gt_upload(be, a->v, nk, FM_DTYPE_BF16);
    d->dout = gt_upload(be, a->dout, nq, FM_DTYPE_BF16);
    d->out = be->ops->mem_alloc(be->ctx, (size_t)nq * 2 + 256);
    d->lse = be->ops->mem_alloc(be->ctx, (size_t)nl * 4 + 256);
    d->dq = be->ops->mem_alloc(be->ctx, (size_t)nq * 2 + 256);
    d->dk = be->ops->mem_alloc(be->ctx, (size_t)nk * 2 + 256);
    d->dv = be->ops->mem_alloc(be->ctx, (size_t)nk * 2 + 256);
    FM_ASSERT(d->q && d->k && d->v && d->dout && d->out && d->lse && d->dq && d->dk && d->dv);
}
static void dev_free(const fm_backend *be, att_dev *d) {
    void *p[9] = {d->q, d->k, d->v, d->dout, d->out, d->lse, d->dq, d->dk, d->dv};
    for (int i = 0; i < 9; i++) be->ops->mem_free(be->ctx, p[i]);
}
/* NaN-poisons the outputs (0xFF bytes: bf16 and fp32 NaN) so that unwritten elements fail. */
static void dev_poison(const fm_backend *be, att_dev *d, const att_host *a, bool grads) {
    const int64_t nq = a->B * a->T * a->nh * a->hd, nk = a->B * a->T * a->nkv * a->hd, nl = a->B * a->nh * a->T;
    if (!grads) {
        be->ops->mem_set(be->ctx, d->out, 0xff, (size_t)nq * 2);
        be->ops->mem_set(be->ctx, d->lse, 0xff, (size_t)nl * 4);
    } else {
        be->ops->mem_set(be->ctx, d->dq, 0xff, (size_t)nq * 2);
        be->ops->mem_set(be->ctx, d->dk, 0xff, (size_t)nk * 2);
        be->ops->mem_set(be->ctx, d->dv, 0xff, (size_t)nk * 2);
    }
}
static void run_fwd(const fm_backend *be, att_dev *d, const att_host *a) {
    be->ops->attention_fwd(be->ctx, d->out, d->lse, d->q, d->k, d->v, a->B, a->T, a->nh, a->nkv, a->hd,
                           (const int32_t *)g_kvs_dev);
}
static void run_bwd(const fm_backend *be, att_dev *d, const att_host *a) {
    be->ops->attention_bwd(be->ctx, d->dq, d->dk, d->dv, d->dout, d->q, d->k, d->v, d->out, d->lse, a->B, a->T,
                           a->nh, a->nkv, a->hd, (const int32_t *)g_kvs_dev);
}

static att_host host_new(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
    att_host a = {B, T, nh, nkv, hd, NULL, NULL, NULL, NULL};
    const int64_t nq = B * T * nh * hd, nk = B * T * nkv * hd;
    a.q = fm_malloc((size_t)nq * 4 + 4);
    a.k = fm_malloc((size_t)nk * 4 + 4);
    a.v = fm_malloc((size_t)nk * 4 + 4);
    a.dout = fm_malloc((size_t)nq * 4 + 4);
    FM_ASSERT(a.q && a.k && a.v && a.dout);
    fill_normal(a.q, nq, 1.2);
    fill_normal(a.k, nk, 1.2);
    fill_normal(a.v, nk, 1.0);
    fill_normal(a.dout, nq, 1.0);
    return a;
}
static void host_free(att_host *a) { fm_free(a->q), fm_free(a->k), fm_free(a->v), fm_free(a->dout); }

static const char *path_name(fm_cuda_att_path p) { return p == FM_CUDA_ATT_FALLBACK ? "fallback" : "cudnn"; }

/* Counts of shapes the cuDNN path really served (vs. handed to our kernels). */
static int g_cudnn_served_fwd, g_cudnn_served_bwd, g_cudnn_cases;

/* One shape on one path: forward and backward against the reference. Rows: all rows when
 * T <= full_T, else a sample (first, last, tile edges, random); dk, dv only when all rows are
 * referenced. */
static void check_case(const fm_backend *be, fm_cuda_att_path path, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                       int64_t hd, int64_t full_T, const char **served_bwd) {
    fm_cuda_attention_set_path(be->ctx, path);
    att_host a = host_new(B, T, nh, nkv, hd);
    att_dev d;
    dev_upload(be, &d, &a);
    dev_poison(be, &d, &a, false);
    run_fwd(be, &d, &a);
    be->ops->sync(be->ctx);
    const char *pf = fm_cuda_attention_last(be->ctx, false);
    dev_poison(be, &d, &a, true);
    run_bwd(be, &d, &a);
    be->ops->sync(be->ctx);
    const char *pb = fm_cuda_attention_last(be->ctx, true);

    const int64_t nq = B * T * nh * hd, nk = B * T * nkv * hd, nl = B * nh * T;
    float *out = fm_malloc((size_t)nq * 4 + 4), *lse = fm_malloc((size_t)nl * 4 + 4);
    float *dq = fm_malloc((size_t)nq * 4 + 4), *dk = fm_malloc((size_t)nk * 4 + 4), *dv = fm_malloc((size_t)nk * 4 + 4);
    gt_download(be, out, d.out, nq, FM_DTYPE_BF16);
    gt_download(be, lse, d.lse, nl, FM_DTYPE_F32);
    gt_download(be, dq, d.dq, nq, FM_DTYPE_BF16);
    gt_download(be, dk, d.dk, nk, FM_DTYPE_BF16);
    gt_download(be, dv, d.dv, nk, FM_DTYPE_BF16);

    /* the query rows referenced */
    const bool full = T <= full_T;
    int64_t nrows = full ? T : 0;
    int64_t *rows = fm_malloc(sizeof(int64_t) * (size_t)(full ? T : 64) + 8);
    if (full) {
        for (int64_t t = 0; t < T; t++) rows[t] = t;
    } else {
        const int64_t fixed[] = {0, 1, 63, 64, 65, 127, 128, 129, 1000, T / 2 - 1, T / 2, T - 65, T - 2, T - 1};
        for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
            if (fixed[i] >= 0 && fixed[i] < T) rows[nrows++] = fixed[i];
        while (nrows < 32) rows[nrows++] = (int64_t)fm_rng_below(&g_rng, (uint64_t)T);
    }
    const int64_t nref = B * nh * nrows * hd;
    double *ro = fm_malloc((size_t)nref * 8 + 8), *rdq = fm_malloc((size_t)nref * 8 + 8);
    double *rl = fm_malloc((size_t)(B * nh * nrows) * 8 + 8);
    float *go = fm_malloc((size_t)nref * 4 + 4), *gdq = fm_malloc((size_t)nref * 4 + 4);
    float *gl = fm_malloc((size_t)(B * nh * nrows) * 4 + 4);
    double *rdk = full ? fm_malloc((size_t)nk * 8 + 8) : NULL, *rdv = full ? fm_malloc((size_t)nk * 8 + 8) : NULL;
    double *scratch = fm_malloc((size_t)(2 * T) * 8 + 8);
    if (rdk) memset(rdk, 0, (size_t)nk * 8), memset(rdv, 0, (size_t)nk * 8);
    double *qd = fm_ref_widen(a.q, nq), *kd = fm_ref_widen(a.k, nk), *vd = fm_ref_widen(a.v, nk),
           *dod = fm_ref_widen(a.dout, nq);
    const fm_ref_att ra = {qd, kd, vd, dod, B, T, nh, nkv, hd, g_kvs};
    int64_t ri = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < nh; h++)
            for (int64_t r = 0; r < nrows; r++, ri++) {
                const int64_t t = rows[r];
                fm_ref_attention_row(&ra, b, h, t, ro + ri * hd, rl + ri, rdq + ri * hd, rdk, rdv, scratch);
                const int64_t off = ((b * T + t) * nh + h) * hd;
                memcpy(go + ri * hd, out + off, (size_t)hd * 4);
                memcpy(gdq + ri * hd, dq + off, (size_t)hd * 4);
                gl[ri] = lse[(b * nh + h) * T + t];
            }
    const double e_out = nerr_floor(go, ro, nref, 0.0), e_lse = nerr_floor(gl, rl, ri, 0.0);
    const double e_dq = nerr_floor(gdq, rdq, nref, ATT_GRAD_FLOOR);
    const double e_dk = full ? nerr_floor(dk, rdk, nk, ATT_GRAD_FLOOR) : 0.0;
    const double e_dv = full ? nerr_floor(dv, rdv, nk, ATT_GRAD_FLOOR) : 0.0;
    bool finite = true;
    for (int64_t i = 0; i < nk && finite; i++) finite = isfinite(dk[i]) && isfinite(dv[i]);
    for (int64_t i = 0; i < nq && finite; i++) finite = isfinite(out[i]) && isfinite(dq[i]);

    printf("  %-8s B=%lld T=%-5lld nh=%-2lld nkv=%-2lld hd=%-3lld [%s/%s] out %.2e lse %.2e dq %.2e", path_name(path),
           (long long)B, (long long)T, (long long)nh, (long long)nkv, (long long)hd, pf, pb, e_out, e_lse, e_dq);
    if (full) printf(" dk %.2e dv %.2e", e_dk, e_dv);
    else printf(" (%lld sampled rows; dk, dv finite)", (long long)nrows);
    printf("\n");
    char what[160];
    snprintf(what, sizeof what, "%s B=%lld T=%lld nh=%lld nkv=%lld hd=%lld", path_name(path), (long long)B,
             (long long)T, (long long)nh, (long long)nkv, (long long)hd);
    CHECK_MSG(e_out <= ATT_TOL_OUT, "%s: out error %.3e > %.1e", what, e_out, ATT_TOL_OUT);
    CHECK_MSG(e_lse <= ATT_TOL_LSE, "%s: lse error %.3e > %.1e", what, e_lse, ATT_TOL_LSE);
    CHECK_MSG(e_dq <= ATT_TOL_GRAD, "%s: dq error %.3e > %.1e", what, e_dq, ATT_TOL_GRAD);
    CHECK_MSG(e_dk <= ATT_TOL_GRAD, "%s: dk error %.3e > %.1e", what, e_dk, ATT_TOL_GRAD);
    CHECK_MSG(e_dv <= ATT_TOL_GRAD, "%s: dv error %.3e > %.1e", what, e_dv, ATT_TOL_GRAD);
    CHECK_MSG(finite, "%s: non-finite output or gradient", what);
    char wu[200];
    snprintf(wu, sizeof wu, "%s out", what);
    CHECK_ULPS(wu, go, ro, nref, gt_rms(ro, nref), ATT_ULPS_OUT);
    snprintf(wu, sizeof wu, "%s dq", what);
    CHECK_ULPS(wu, gdq, rdq, nref, fmax(gt_rms(rdq, nref), ATT_GRAD_FLOOR), ATT_ULPS_GRAD);
    if (full) {
        snprintf(wu, sizeof wu, "%s dk", what);
        CHECK_ULPS(wu, dk, rdk, nk, fmax(gt_rms(rdk, nk), ATT_GRAD_FLOOR), ATT_ULPS_GRAD);
        snprintf(wu, sizeof wu, "%s dv", what);
        CHECK_ULPS(wu, dv, rdv, nk, fmax(gt_rms(rdv, nk), ATT_GRAD_FLOOR), ATT_ULPS_GRAD);
    }
    if (path == FM_CUDA_ATT_FALLBACK) {
        CHECK_MSG(strncmp(pf, "cudnn", 5) && strncmp(pb, "cudnn", 5), "%s: the fallback path called cuDNN", what);
    } else {
        g_cudnn_cases++;
        g_cudnn_served_fwd += !strncmp(pf, "cudnn", 5);
        g_cudnn_served_bwd += !strncmp(pb, "cudnn", 5);
    }
    if (served_bwd) *served_bwd = pb;

    fm_free(out), fm_free(lse), fm_free(dq), fm_free(dk), fm_free(dv), fm_free(rows);
    fm_free(ro), fm_free(rdq), fm_free(rl), fm_free(go), fm_free(gdq), fm_free(gl);
    fm_free(rdk), fm_free(rdv), fm_free(scratch);
    free(qd), free(kd), free(vd), free(dod);
    dev_free(be, &d);
    host_free(&a);
}

/* Future keys and values (t >= cut) never change out, lse or dq of earlier rows: bitwise on
 * the fallback, to 1e-6 on cuDNN (whose dQ accumulation order may vary). */
static void check_causality(const fm_backend *be, fm_cuda_att_path path) {
    const int64_t B = 1, T = 100, nh = 4, nkv = 2, hd = 64, cut = 60;
    fm_cuda_attention_set_path(be->ctx, path);
    att_host a = host_new(B, T, nh, nkv, hd);
    const int64_t nq = B * T * nh * hd, nk = B * T * nkv * hd, nl = B * nh * T;
    float *o1 = fm_malloc((size_t)nq * 4), *o2 = fm_malloc((size_t)nq * 4), *q1 = fm_malloc((size_t)nq * 4),
          *q2 = fm_malloc((size_t)nq * 4), *l1 = fm_malloc((size_t)nl * 4), *l2 = fm_malloc((size_t)nl * 4);
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            for (int64_t i = cut * nkv * hd; i < nk; i++) {
                a.k[i] = gt_bf16_to_f32(gt_f32_to_bf16(a.k[i] * -3.0f + 1.0f));
                a.v[i] = gt_bf16_to_f32(gt_f32_to_bf16(a.v[i] * 5.0f - 2.0f));
            }
        att_dev d;
        dev_upload(be, &d, &a);
        run_fwd(be, &d, &a);
        run_bwd(be, &d, &a);
        gt_download(be, pass ? o2 : o1, d.out, nq, FM_DTYPE_BF16);
        gt_download(be, pass ? q2 : q1, d.dq, nq, FM_DTYPE_BF16);
        gt_download(be, pass ? l2 : l1, d.lse, nl, FM_DTYPE_F32);
        dev_free(be, &d);
    }
    const bool exact = path == FM_CUDA_ATT_FALLBACK;
    double worst = 0;
    bool same_lse = true;
    for (int64_t i = 0; i < cut * nh * hd; i++) {
        const double eo = fabs((double)o1[i] - o2[i]), eq = fabs((double)q1[i] - q2[i]);
        worst = fmax(worst, fmax(eo, eq));
    }
    for (int64_t h = 0; h < nh; h++)
        for (int64_t t = 0; t < cut; t++) same_lse &= fabs((double)l1[h * T + t] - l2[h * T + t]) <= (exact ? 0 : 1e-6);
    bool later_changed = false;
    for (int64_t i = cut * nh * hd; i < nq; i++) later_changed |= o1[i] != o2[i];
    printf("  causality (%s): rows < %lld max change %.3g, later rows changed: %s\n", path_name(path),
           (long long)cut, worst, later_changed ? "yes" : "no");
    CHECK_MSG(exact ? worst == 0 : worst <= 1e-6, "%s: rows before %lld changed by %.3g when later keys changed",
              path_name(path), (long long)cut, worst);
    CHECK_MSG(same_lse, "%s: lse of early rows changed when later keys changed", path_name(path));
    CHECK_MSG(later_changed, "%s: later rows did not change (test is void)", path_name(path));
    fm_free(o1), fm_free(o2), fm_free(q1), fm_free(q2), fm_free(l1), fm_free(l2);
    host_free(&a);
}

/* The fallback gives the same bits on two calls. */
static void check_determinism(const fm_backend *be, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
    fm_cuda_attention_set_path(be->ctx, FM_CUDA_ATT_FALLBACK);
    att_host a = host_new(B, T, nh, nkv, hd);
    att_dev d;
    dev_upload(be, &d, &a);
    const int64_t nq = B * T * nh * hd, nk = B * T * nkv * hd, nl = B * nh * T;
    const size_t bytes = (size_t)(2 * nq + 2 * nk) * 2 + (size_t)nl * 4;
    unsigned char *r[2] = {fm_malloc(bytes), fm_malloc(bytes)};
    for (int pass = 0; pass < 2; pass++) {
        dev_poison(be, &d, &a, false);
        dev_poison(be, &d, &a, true);
        run_fwd(be, &d, &a);
        run_bwd(be, &d, &a);
        unsigned char *p = r[pass];
        be->ops->copy(be->ctx, p, d.out, (size_t)nq * 2, FM_COPY_D2H), p += nq * 2;
        be->ops->copy(be->ctx, p, d.dq, (size_t)nq * 2, FM_COPY_D2H), p += nq * 2;
        be->ops->copy(be->ctx, p, d.dk, (size_t)nk * 2, FM_COPY_D2H), p += nk * 2;
        be->ops->copy(be->ctx, p, d.dv, (size_t)nk * 2, FM_COPY_D2H), p += nk * 2;
        be->ops->copy(be->ctx, p, d.lse, (size_t)nl * 4, FM_COPY_D2H);
    }
    const bool same = !memcmp(r[0], r[1], bytes);
    printf("  determinism (%s) B=%lld T=%lld nh=%lld nkv=%lld hd=%lld [%s/%s]: %s\n",
           path_name(FM_CUDA_ATT_FALLBACK), (long long)B,
           (long long)T, (long long)nh, (long long)nkv, (long long)hd, fm_cuda_attention_last(be->ctx, false),
           fm_cuda_attention_last(be->ctx, true), same ? "same bits" : "DIFFERENT");
    CHECK_MSG(same, "fallback attention is not bitwise deterministic (B=%lld T=%lld hd=%lld)", (long long)B,
              (long long)T, (long long)hd);
    fm_free(r[0]), fm_free(r[1]);
    dev_free(be, &d);
    host_free(&a);
}

/* Forward and backward time of each path at one long shape (no reference: random inputs). */
static void bench(const fm_backend *be, const char *label, bool with_fallback, int64_t B, int64_t T, int64_t nh,
                  int64_t nkv, int64_t hd) {
    att_host a = {B, T, nh, nkv, hd, NULL, NULL, NULL, NULL};
    const int64_t nq = B * T * nh * hd, nk = B * T * nkv * hd;
    a.q = fm_malloc((size_t)nq * 4), a.k = fm_malloc((size_t)nk * 4), a.v = fm_malloc((size_t)nk * 4);
    a.dout = fm_malloc((size_t)nq * 4);
    FM_ASSERT(a.q && a.k && a.v && a.dout);
    for (int64_t i = 0; i < nq; i++) a.q[i] = (float)(fm_rng_uniform(&g_rng) * 2 - 1), a.dout[i] = a.q[i] * 0.5f;
    for (int64_t i = 0; i < nk; i++) a.k[i] = (float)(fm_rng_uniform(&g_rng) * 2 - 1), a.v[i] = a.k[i] * -0.7f;
    att_dev d;
    dev_upload(be, &d, &a);
    const double fwd_flop = 4.0 * (double)T * (double)T * (double)nh * (double)hd / 2.0 * (double)B;
    const fm_cuda_att_path paths[2] = {FM_CUDA_ATT_FALLBACK, FM_CUDA_ATT_CUDNN};
    for (int pi = with_fallback ? 0 : 1; pi < 2; pi++) {
        fm_cuda_attention_set_path(be->ctx, paths[pi]);
        run_fwd(be, &d, &a); /* warm up (and build cuDNN's plans) */
        run_bwd(be, &d, &a);
        be->ops->sync(be->ctx);
        const int reps = 5;
        double t0 = now_s();
        for (int r = 0; r < reps; r++) run_fwd(be, &d, &a);
        be->ops->sync(be->ctx);
        const double tf = (now_s() - t0) / reps;
        t0 = now_s();
        for (int r = 0; r < reps; r++) run_bwd(be, &d, &a);
        be->ops->sync(be->ctx);
        const double tb = (now_s() - t0) / reps;
        printf("  speed %-8s %s B=%lld T=%lld nh=%lld nkv=%lld hd=%lld: forward [%s] %.3f ms %.1f TFLOP/s, "
               "backward [%s] %.3f ms %.1f TFLOP/s\n",
               path_name(paths[pi]), label, (long long)B, (long long)T, (long long)nh, (long long)nkv, (long long)hd,
               fm_cuda_attention_last(be->ctx, false), tf * 1e3, fwd_flop / tf * 1e-12,
               fm_cuda_attention_last(be->ctx, true), tb * 1e3, 2.5 * fwd_flop / tb * 1e-12);
        float lse0;
        be->ops->copy(be->ctx, &lse0, d.lse, 4, FM_COPY_D2H);
        CHECK_MSG(isfinite(lse0), "speed run (%s): non-finite lse", path_name(paths[pi]));
    }
    dev_free(be, &d);
    host_free(&a);
}

typedef struct shape { int64_t B, T, nh, nkv, hd; } shape;

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    fm_rng_seed(&g_rng, fm_test_seed(20251129));
    const double t_start = now_s();
    fm_backend be;
    fm_status st = gt_cuda_init(&be, 0, 128, 0);
    if (st != FM_OK) {
        fprintf(stderr, "cuda backend init failed: %s: %s\n", fm_status_name(st), fm_errmsg());
        CHECK(st == FM_OK);
        return fm_test_finish();
    }
    printf("cuDNN runtime version %ld; default path %s\n", fm_cuda_attention_cudnn_version(),
           fm_cuda_attention_get_path(be.ctx) == FM_CUDA_ATT_FALLBACK ? "fallback" : "cudnn where it can");

    /* hd 64 and 128, groups nh/nkv = 1, 2, 4, 8, T = 1, 17, 64, 127, 1000, 4096 */
    const shape shapes[] = {
        {1, 1, 1, 1, 64},    {2, 17, 4, 2, 64},    {1, 64, 8, 1, 128},    {2, 127, 4, 1, 128},
        {1, 127, 2, 2, 64},  {1, 1000, 8, 1, 128}, {2, 1000, 4, 4, 64},   {1, 1000, 4, 2, 128},
        {1, 4096, 8, 2, 128}, {2, 4096, 4, 4, 64},
    };
    /* other head dims: padded tiles (32, 80, 96), 4-byte loads (66), tiny (8) */
    const shape odd[] = {{1, 100, 4, 2, 32}, {1, 100, 2, 1, 80}, {2, 65, 4, 4, 96}, {1, 70, 2, 1, 66}, {1, 40, 2, 1, 8}};
    const fm_cuda_att_path paths[2] = {FM_CUDA_ATT_FALLBACK, FM_CUDA_ATT_CUDNN};
    for (int pi = 0; pi < 2; pi++) {
        printf("%s path:\n", path_name(paths[pi]));
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
            const shape *s = &shapes[i];
            check_case(&be, paths[pi], s->B, s->T, s->nh, s->nkv, s->hd, 1000, NULL);
        }
        for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
            const shape *s = &odd[i];
            check_case(&be, paths[pi], s->B, s->T, s->nh, s->nkv, s->hd, 1000, NULL);
        }
        check_causality(&be, paths[pi]);
        /* packed documents: attention stops at each document's start (our kernels on both paths) */
        for (int i = 0; i < FM_CASES_COUNT(FM_CASES_ATT_DOCS); i++) {
            const fm_case_att_docs *c = &FM_CASES_ATT_DOCS[i];
            const size_t bytes = sizeof(int32_t) * (size_t)(c->B * c->T);
            g_kvs = fm_malloc(bytes);
            fm_case_att_kv_start(c, g_kvs);
            g_kvs_dev = be.ops->mem_alloc(be.ctx, bytes);
            FM_ASSERT(g_kvs && g_kvs_dev);
            be.ops->copy(be.ctx, g_kvs_dev, g_kvs, bytes, FM_COPY_H2D);
            printf("  documents of %lld, %lld, ... tokens:\n", (long long)c->len[0], (long long)c->len[1]);
            const char *pb = NULL;
            check_case(&be, paths[pi], c->B, c->T, c->nh, c->nkv, c->hd, 1000, &pb);
            CHECK_MSG(strncmp(pb, "cudnn", 5) != 0, "packed documents went to cuDNN (%s)", pb);
            be.ops->mem_free(be.ctx, g_kvs_dev);
            fm_free(g_kvs);
            g_kvs = NULL;
            g_kvs_dev = NULL;
        }
        printf("  (%.1f s so far)\n", now_s() - t_start);
    }
    if (g_cudnn_cases)
        printf("cuDNN served %d of %d forward and %d of %d backward calls on the cudnn path%s%s\n",
               g_cudnn_served_fwd, g_cudnn_cases, g_cudnn_served_bwd, g_cudnn_cases,
               fm_cuda_attention_cudnn_note(be.ctx)[0] ? "; last refusal: " : "",
               fm_cuda_attention_cudnn_note(be.ctx));
    check_determinism(&be, 2, 300, 8, 2, 128);
    check_determinism(&be, 1, 257, 4, 4, 64);
    CHECK_BACKEND_OK(&be); /* no device error recorded (a cuDNN refusal is a fallback, not an error) */
    fm_cuda_backend_free(&be);

    /* head dims above 128: the scalar kernels (and cuDNN where it serves them) */
    {
        fm_backend be2;
        CHECK((st = gt_cuda_init(&be2, 0, 256, 0)) == FM_OK);
        if (st == FM_OK) {
            printf("max_head_dim 256:\n");
            for (int pi = 0; pi < 2; pi++) {
                check_case(&be2, paths[pi], 1, 77, 4, 2, 192, 1000, NULL);
                check_case(&be2, paths[pi], 2, 33, 2, 1, 130, 1000, NULL);
            }
            fm_cuda_backend_free(&be2);
        }
    }
    printf("(%.1f s so far)\n", now_s() - t_start);

    /* cuDNN's backward split into chunks: a 4 MiB cuDNN workspace cannot hold these shapes' fp32 dQ
     * accumulators whole (batch chunks; kv-head chunks with GQA; batch chunks with GQA) */
    {
        fm_backend be4;
        CHECK((st = gt_cuda_init(&be4, 0, 128, (size_t)4 << 20)) == FM_OK);
        if (st == FM_OK) {
            printf("cuDNN workspace 4 MiB:\n");
            const shape chunked[] = {{2, 1000, 8, 8, 64}, {1, 1000, 8, 4, 128}, {2, 700, 4, 2, 128}};
            for (size_t i = 0; i < sizeof chunked / sizeof chunked[0]; i++) {
                const shape *s = &chunked[i];
                const char *pb = "";
                const size_t whole = fm_cuda_attention_cudnn_workspace(s->B, s->T, s->nh, s->nkv, s->hd, true);
                const size_t least = fm_cuda_attention_cudnn_workspace(s->B, s->T, s->nh, s->nkv, s->hd, false);
                CHECK_MSG(whole > ((size_t)4 << 20) && least <= ((size_t)4 << 20),
                          "workspace hints %zu (whole) and %zu (chunked) do not bracket 4 MiB", whole, least);
                check_case(&be4, FM_CUDA_ATT_CUDNN, s->B, s->T, s->nh, s->nkv, s->hd, 1000, &pb);
                CHECK_MSG(!strcmp(pb, "cudnn-chunked"), "B=%lld T=%lld nh=%lld nkv=%lld hd=%lld: backward served by "
                          "%s, expected cudnn-chunked (%s)", (long long)s->B, (long long)s->T, (long long)s->nh,
                          (long long)s->nkv, (long long)s->hd, pb, fm_cuda_attention_cudnn_note(be4.ctx));
            }
            CHECK_BACKEND_OK(&be4);
            fm_cuda_backend_free(&be4);
        }
    }

    /* speed: the default 64 MiB cuDNN workspace (cuDNN's backward in kv-head chunks: its fp32 dQ
     * accumulator is B*nh*T*hd*4 = 128 MiB here), then 512 MiB (one call) */
    {
        fm_backend be5;
        CHECK((st = gt_cuda_init(&be5, 0, 128, 0)) == FM_OK);
        if (st == FM_OK) {
            printf("  cuDNN backward workspace at T=16384 hd=128: %zu MiB whole (nh=16), %zu MiB in chunks (MHA), "
                   "%zu MiB in chunks (8 query heads per kv head)\n",
                   fm_cuda_attention_cudnn_workspace(1, 16384, 16, 16, 128, true) >> 20,
                   fm_cuda_attention_cudnn_workspace(1, 16384, 16, 16, 128, false) >> 20,
                   fm_cuda_attention_cudnn_workspace(1, 16384, 16, 2, 128, false) >> 20);
            bench(&be5, "(64 MiB ws)", false, 1, 16384, 16, 16, 128);
            fm_cuda_backend_free(&be5);
        }
        fm_backend be3;
        CHECK((st = gt_cuda_init(&be3, 0, 128, (size_t)512 << 20)) == FM_OK);
        if (st == FM_OK) {
            bench(&be3, "(512 MiB ws)", true, 1, 16384, 16, 16, 128);
            const char *n = fm_cuda_attention_cudnn_note(be3.ctx);
            if (n[0]) printf("  cuDNN note: %s\n", n);
            fm_cuda_backend_free(&be3);
        }
    }
    printf("(%.1f s total)\n", now_s() - t_start);
    return fm_test_finish();
}
