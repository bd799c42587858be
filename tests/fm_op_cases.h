/* One definition of each layer op case, run on every backend (ggml's tests/test-backend-ops.cpp
 * habit): the shapes every backend's op test runs with finite differences, and the fp64 objective
 * L = sum(dout o f(x)) whose finite differences check each backward. tests/test_ops_cpu.c runs
 * them on the CPU backend (fp32, its tolerances), tests/gpu/test_cuda_layers.c on the CUDA
 * backend (bf16, its tolerances and ulps); each adds only the cases of its own code paths (the
 * CUDA kernels' large, no-FD shapes). The forwards are tests/fm_ref_ops.h's. */
#ifndef FM_OP_CASES_H
#define FM_OP_CASES_H
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "fm_ref_ops.h"
#include "fm_test.h"

/* ---- the cases ------------------------------------------------------------------------------ */

/* Embedding: N tokens over a vocabulary of V rows of width H (the last row unused). H 130 spans
 * several 64-column blocks and is the CUDA kernel's scalar path (H % 8 != 0); 256 its 16-byte one. */
typedef struct fm_case_emb { int64_t N, V, H; } fm_case_emb;
static const fm_case_emb FM_CASES_EMB[] = {{40, 11, 130}, {100, 11, 130}, {100, 11, 256}};

/* RMSNorm: N rows of D, x ~ N(0, x_scale^2). */
typedef struct fm_case_rms { int64_t N, D; double x_scale; } fm_case_rms;
static const fm_case_rms FM_CASES_RMS[] = {
    {9, 130, 1.5},
    {40, 16, 1.5},  /* QK-norm shape: rows = tokens*heads, D = head_dim */
    {80, 130, 1.5}, /* above the CPU's OpenMP cutoff (8192 elements) */
    {80, 256, 1.5},
    {20, 64, 3e-3}, /* mean(x^2) ~ eps: eps must enter like the reference */
};

/* RoPE on [B,T,nh,hd] with tables of Tmax positions, the first rd dims rotated: T < Tmax and
 * B > 1 (the position must be t, not b*T + t); rd/2 % 8 == 0 is the CUDA kernel's 16-byte path,
 * hd 12 its scalar one; rd < hd partial rotary (glm4_moe: half the head), on both paths. */
typedef struct fm_case_rope { int64_t B, T, Tmax, nh, hd, rd; } fm_case_rope;
static const fm_case_rope FM_CASES_ROPE[] = {{2, 5, 8, 3, 16, 16},  {2, 40, 48, 4, 32, 32}, {2, 40, 48, 4, 64, 64},
                                             {2, 7, 9, 3, 12, 12},  {2, 40, 48, 4, 64, 32}, {2, 7, 9, 3, 12, 4},
                                             {2, 5, 8, 3, 40, 16}};

/* Linear-layer biases (fm_backend.h bias_add, bias_grad) on [N,D]: one row; D under and over the
 * CPU's 64-column blocks and the CUDA kernel's 32 columns; N over its 8 row lanes. */
typedef struct fm_case_bias { int64_t N, D; } fm_case_bias;
static const fm_case_bias FM_CASES_BIAS[] = {{1, 7}, {13, 24}, {70, 100}, {257, 33}};

/* Attention over packed documents (fm_backend.h kv_start): each row of T holds documents of the
 * lengths len[0..n-1] in turn, repeated (the last cut at T). Cases: documents shorter than, across
 * and longer than the CPU's 64-row query tiles and the CUDA kernels' 64/128-row tiles; a
 * one-token document; GQA groups 2 and 1; hd 12 (the CUDA tiles' 4-byte loads), 16, 64 and 9 (the
 * CUDA scalar kernels). */
typedef struct fm_case_att_docs { int64_t B, T, nh, nkv, hd; int n; int64_t len[4]; } fm_case_att_docs;
static const fm_case_att_docs FM_CASES_ATT_DOCS[] = {
    {2, 40, 4, 2, 16, 3, {7, 19, 14}},
    {1, 150, 2, 1, 64, 4, {1, 70, 50, 29}},
    {2, 33, 2, 2, 12, 2, {5, 9}},
    {1, 40, 2, 1, 9, 3, {5, 20, 15}}, /* odd hd: the CUDA scalar kernels */
};

/* Fills kv_start [B*T] of a case: every token's document's first row-local index. */
static inline void fm_case_att_kv_start(const fm_case_att_docs *c, int32_t *kvs) {
    for (int64_t b = 0; b < c->B; b++) {
        int64_t t = 0, d = 0;
        while (t < c->T) {
            const int64_t s = t, e = t + c->len[d % c->n] < c->T ? t + c->len[d % c->n] : c->T;
            for (; t < e; t++) kvs[b * c->T + t] = (int32_t)s;
            d++;
        }
    }
}

/* Head slices (fm_backend.h head_slice; multi-head latent attention's assembly, model/fm_mla.c):
 * d columns of each of nh heads from src [N, nh or 1 (bcast: src.hs 0), sw] at column soff into dst
 * [N, nh or 1 (sum: dst.hs 0, the heads summed), dw] at column doff, in pair order perm, times
 * alpha, added when acc; zeros: src NULL. MLA's own shapes (q_pe de-interleaved and scaled, the
 * nope part, k_pe broadcast, its gradient summed, v's zero padding) and one above the CPU's
 * OpenMP cutoff and across many CUDA blocks. */
typedef struct fm_case_slice {
    int64_t N, nh, d, sw, soff, dw, doff;
    bool bcast, sum, zeros;
    int perm;
    float alpha;
    bool acc;
} fm_case_slice;
static const fm_case_slice FM_CASES_SLICE[] = {
    {7, 3, 4, 10, 6, 10, 0, false, false, false, 1 /* DEINTERLEAVE */, 1.29f, false}, /* q_pe -> q' */
    {7, 3, 6, 10, 0, 10, 4, false, false, false, 0, 1.29f, false},                    /* q_nope -> q' */
    {9, 4, 4, 4, 0, 8, 0, true, false, false, 0, 1.0f, false},                        /* k_pe broadcast */
    {9, 4, 4, 8, 0, 4, 0, false, true, false, 0, 1.0f, false},                        /* d k_pe summed */
    {9, 4, 4, 8, 2, 6, 2, false, true, false, 2 /* INTERLEAVE */, 0.5f, true},        /* summed, added */
    {5, 2, 3, 0, 0, 8, 5, false, false, true, 0, 1.0f, false},                        /* v's zero padding */
    {700, 8, 24, 40, 16, 32, 8, false, false, false, 1, 1.0f, true},                  /* large */
};

/* The case's shapes: src [N, src_heads, sw], dst [N, dst_heads, dw]. */
static inline int64_t fm_case_slice_src_heads(const fm_case_slice *c) { return c->bcast ? 1 : c->nh; }
static inline int64_t fm_case_slice_dst_heads(const fm_case_slice *c) { return c->sum ? 1 : c->nh; }

/* The fp64 reference: dst (holding the initial values) updated as head_slice documents it. */
static inline void fm_case_slice_ref(double *dst, const float *src, const fm_case_slice *c) {
    const int64_t shs = c->bcast ? 0 : c->sw, dhs = c->sum ? 0 : c->dw, d = c->d;
    for (int64_t n = 0; n < c->N; n++)
        for (int64_t h = 0; h < c->nh; h++)
            for (int64_t j = 0; j < d; j++) {
                const int64_t pj = c->perm == 1 ? (j < d / 2 ? 2 * j : 2 * (j - d / 2) + 1)
                                 : c->perm == 2 ? (j % 2 == 0 ? j / 2 : d / 2 + j / 2) : j;
                const double v = c->zeros ? 0.0 : (double)c->alpha * src[n * fm_case_slice_src_heads(c) * c->sw + h * shs + c->soff + pj];
                double *y = &dst[n * fm_case_slice_dst_heads(c) * c->dw + h * dhs + c->doff + j];
                *y = c->acc || (c->sum && h > 0) ? *y + v : v;
            }
}

/* SwiGLU over n elements: above the CPU's OpenMP cutoff (8192), and a short one. */
static const int64_t FM_CASES_SWIGLU[] = {9001, 64};

#define FM_CASES_COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* ---- the objectives (fm_fd_check's objective_fn) -------------------------------------------- */

static inline double fm_case_dot(const double *a, const double *b, int64_t n) {
    double L = 0;
    for (int64_t i = 0; i < n; i++) L += a[i] * b[i];
    return L;
}

/* L = sum_n dout[n,:] . wte[tok[n],:] */
typedef struct emb_st {
    double *wte, *dout;
    const int32_t *tok;
    int64_t N, H;
} emb_st;
static inline double emb_obj(void *p) {
    emb_st *s = p;
    double L = 0;
    for (int64_t n = 0; n < s->N; n++) L += fm_case_dot(s->dout + n * s->H, s->wte + s->tok[n] * s->H, s->H);
    return L;
}

/* L = sum(dout o rmsnorm(x, w)) */
typedef struct rms_st {
    double *x, *w, *dout;
    int64_t N, D;
    double eps;
} rms_st;
static inline double rms_obj(void *p) {
    rms_st *s = p;
    double *y = calloc((size_t)(s->N * s->D), sizeof(double));
    FM_ASSERT(y);
    fm_ref_rmsnorm_fwd(y, NULL, s->x, s->w, s->N, s->D, s->eps);
    const double L = fm_case_dot(s->dout, y, s->N * s->D);
    free(y);
    return L;
}

/* L = sum(dout o rope(x)) */
typedef struct rope_st {
    double *x, *dout;
    const float *cs, *sn;
    int64_t B, T, nh, hd, rd;
} rope_st;
static inline double rope_obj(void *p) {
    rope_st *s = p;
    const int64_t n = s->B * s->T * s->nh * s->hd;
    double *y = calloc((size_t)n, sizeof(double));
    FM_ASSERT(y);
    fm_ref_rope(y, s->x, s->cs, s->sn, s->B, s->T, s->nh, s->hd, s->rd, 1.0);
    const double L = fm_case_dot(s->dout, y, n);
    free(y);
    return L;
}

/* L = sum(dout o silu(g) o u) */
typedef struct swi_st {
    double *g, *u, *dout;
    int64_t n;
} swi_st;
static inline double swi_obj(void *p) {
    swi_st *s = p;
    double L = 0;
    for (int64_t i = 0; i < s->n; i++) L += s->dout[i] * fm_ref_silu(s->g[i]) * s->u[i];
    return L;
}
#endif
