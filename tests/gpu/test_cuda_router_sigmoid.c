/* The CUDA backend's sigmoid router (cuda_router_sigmoid.cu: router_sigmoid_fwd / _bwd, the
 * DeepSeek-V3 router of glm4_moe) against the plain fp64 reference of tests/fm_ref_ops.c
 * (fm_ref_router_sigmoid, fm_ref_router_sigmoid_objective: the CPU test
 * tests/test_router_sigmoid.c uses the same), on random logits with a bias of bf16 values (the
 * CUDA build's fm_act; the reference reads the same values): scores, lse and weights within 1e-6
 * normalized, ids exact away from near-ties (TIE_MARGIN; the CPU backend's test holds its op to the same reference, so both
 * agree); the backward against the reference objective's central finite differences at 1e-5
 * (floor 0.01). Shapes: GLM-4.5-Air's
 * router (E 128, k 8, one group), DeepSeek-V3's (E 256, k 8, 8 groups keep 4), a small grouped one
 * with the adversarial rows of the CPU test's (all equal; the best expert's group losing), and a
 * grid-stride N. Run twice: the same bits. Written in session 16 without a GPU: not yet run.
 * Since the kernel went to one warp per token (a warp-wide selection by shuffles): adversarial
 * ties across lanes (experts 5, 37, 69 exactly equal: the order 5, 37, 69; the lanes compare
 * across the warp, so a wrong tie rule shows), two groups with exactly equal group scores (the
 * lower group first), a random bias (the bias zeroed otherwise, as the all-equal row needs), and
 * E 640 (above the kernel's shared row of 512: lane 0 forms the lse's terms again), and 64 groups
 * of 2 (each lane scores groups lane and lane + 32). The lse against the fp64 logsumexp (it was
 * read back but not compared before session 19). */
#include "core/fm_rng.h"
#include "fm_ref_ops.h"
#include "fm_test_fd.h"
#include "gpu_test.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static fm_backend g_be;
static const fm_ops *OPS;
static void *CTX;
static fm_rng g_rng;

static void *dalloc(size_t bytes) {
    void *p = OPS->mem_alloc(CTX, bytes + 256);
    FM_ASSERT(p);
    return p;
}

typedef struct sg_st {
    double *logits;
    const int32_t *idx;
    const double *dw;
    int64_t N, E, k;
    bool norm;
    double scaling;
} sg_st;

static double sg_obj(void *p) {
    const sg_st *s = p;
    return fm_ref_router_sigmoid_objective(s->logits, s->idx, s->dw, NULL, s->N, s->E, s->k, s->norm, s->scaling);
}

static double nerr(const float *got, const double *ref, int64_t n) {
    double num = 0, den = 1e-30;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) return INFINITY;
        num = fmax(num, fabs((double)got[i] - ref[i]));
        den = fmax(den, fabs(ref[i]));
    }
    return num / den;
}

#define TIE_MARGIN 1e-5

/* Whether one row's fp64 selection (fm_ref_router_sigmoid's: choice = sigmoid + bias, groups by
 * their two best choices, the others' choices masked to 0, top-k) is within TIE_MARGIN of another:
 * the k+1 best choices closer than that, or the topk_group-th and next group scores. */
static bool near_tie(const double *logits, const double *bias, int64_t E, int64_t k, int64_t ng, int64_t tg) {
    double c[1024], gsc[64];
    FM_ASSERT(E <= 1024 && ng <= 64);
    const int64_t gs = E / ng;
    for (int64_t e = 0; e < E; e++) c[e] = 1.0 / (1.0 + exp(-logits[e])) + bias[e];
    bool tie = false;
    if (ng > 1) {
        for (int64_t g = 0; g < ng; g++) {
            double a = -INFINITY, b = -INFINITY;
            for (int64_t e = g * gs; e < (g + 1) * gs; e++) {
                if (c[e] > a) b = a, a = c[e];
                else if (c[e] > b) b = c[e];
            }
            gsc[g] = a + b;
        }
        bool kept[64] = {false};
        for (int64_t r = 0; r <= tg && r < ng; r++) { /* the tg best groups, and the next one */
            int64_t best = -1;
            for (int64_t g = 0; g < ng; g++)
                if (!kept[g] && (best < 0 || gsc[g] > gsc[best])) best = g;
            if (r == tg) {
                double worst_kept = INFINITY;
                for (int64_t g = 0; g < ng; g++)
                    if (kept[g]) worst_kept = fmin(worst_kept, gsc[g]);
                tie |= worst_kept - gsc[best] < TIE_MARGIN;
            } else {
                kept[best] = true;
            }
        }
        for (int64_t e = 0; e < E; e++)
            if (!kept[e / gs]) c[e] = 0.0;
    }
    double prev = INFINITY;
    bool used[1024] = {false};
    for (int64_t j = 0; j <= k && j < E; j++) { /* the k+1 best choices, in order */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!used[e] && (best < 0 || c[e] > c[best])) best = e;
        used[best] = true;
        if (j > 0) tie |= prev - c[best] < TIE_MARGIN;
        prev = c[best];
    }
    return tie;
}

static void check_b(int64_t N, int64_t E, int64_t k, int64_t ng, int64_t tg, bool norm, float scaling, bool fd,
                    bool with_bias) {
    const size_t NE = (size_t)(N * E), Nk = (size_t)(N * k);
    float *logits = malloc(NE * 4), *scores = malloc(NE * 4), *lse = malloc((size_t)N * 4), *tw = malloc(Nk * 4);
    float *dw = malloc(Nk * 4), *dl = malloc(NE * 4), *tw2 = malloc(Nk * 4);
    int32_t *idx = malloc(Nk * 4), *ridx = malloc(Nk * 4), *idx2 = malloc(Nk * 4);
    uint16_t *bias = malloc((size_t)E * 2);
    double *ld = malloc(NE * 8), *rs = malloc(NE * 8), *rw = malloc(Nk * 8), *bd = malloc((size_t)E * 8);
    for (size_t i = 0; i < NE; i++) logits[i] = (float)(2.0 * fm_rng_normal(&g_rng));
    for (int64_t e = 0; e < E; e++) { /* bf16 values: multiples of 1/256 in [-0.25, 0.25] */
        const float b = (float)((int)(fm_rng_normal(&g_rng) * 16) % 64) / 256.0f;
        uint32_t u;
        memcpy(&u, &b, 4);
        bias[e] = (uint16_t)(u >> 16);
        bd[e] = b;
    }
    const int64_t gs = E / ng;
    for (int64_t e = 0; e < E; e++) { /* row 0: all equal (with the bias zeroed) */
        logits[e] = 0.25f;
        if (!with_bias) bias[e] = 0, bd[e] = 0;
    }
    if (!with_bias && ng == 1 && E >= 96 && k >= 3 && N > 3) { /* row 2: ties across lanes */
        for (int64_t e = 0; e < E; e++) logits[2 * E + e] = -4.0f;
        logits[2 * E + 69] = logits[2 * E + 37] = logits[2 * E + 5] = 2.0f;
    }
    if (!with_bias && ng > 2 && N > 3) { /* row 3: groups 1 and 2 tie exactly, the rest far below */
        for (int64_t e = 0; e < E; e++) logits[3 * E + e] = -6.0f;
        logits[3 * E + gs] = logits[3 * E + gs + 1] = logits[3 * E + 2 * gs] = logits[3 * E + 2 * gs + 1] = 3.0f;
    }
    if (ng > 2 && N > 2) { /* row 1: expert 0 best alone; groups 1, 2 two good experts each */
        for (int64_t e = 0; e < E; e++) logits[E + e] = -6.0f;
        logits[E] = 6.0f;
        logits[E + gs] = logits[E + gs + 1] = logits[E + 2 * gs] = logits[E + 2 * gs + 1] = 3.0f;
    }
    for (size_t i = 0; i < Nk; i++) dw[i] = (float)fm_rng_normal(&g_rng);
    float *d_logits = dalloc(NE * 4), *d_scores = dalloc(NE * 4), *d_lse = dalloc((size_t)N * 4), *d_tw = dalloc(Nk * 4);
    float *d_dw = dalloc(Nk * 4), *d_dl = dalloc(NE * 4);
    int32_t *d_idx = dalloc(Nk * 4);
    uint16_t *d_bias = dalloc((size_t)E * 2);
    OPS->copy(CTX, d_logits, logits, NE * 4, FM_COPY_H2D);
    OPS->copy(CTX, d_bias, bias, (size_t)E * 2, FM_COPY_H2D);
    OPS->copy(CTX, d_dw, dw, Nk * 4, FM_COPY_H2D);
    char what[160];
    snprintf(what, sizeof what, "cuda sigmoid router N=%lld E=%lld k=%lld groups %lld/%lld norm=%d scale %g",
             (long long)N, (long long)E, (long long)k, (long long)tg, (long long)ng, (int)norm, (double)scaling);
    for (int rep = 0; rep < 2; rep++) {
        OPS->router_sigmoid_fwd(CTX, d_scores, d_lse, d_idx, d_tw, d_logits, (const fm_act *)(const void *)d_bias, N, E,
                                k, ng, tg, norm, scaling);
        OPS->router_sigmoid_bwd(CTX, d_dl, d_dw, NULL, d_scores, d_idx, N, E, k, norm, scaling);
        int32_t *ig = rep ? idx2 : idx;
        float *wg = rep ? tw2 : tw;
        OPS->copy(CTX, ig, d_idx, Nk * 4, FM_COPY_D2H);
        OPS->copy(CTX, wg, d_tw, Nk * 4, FM_COPY_D2H);
        OPS->copy(CTX, scores, d_scores, NE * 4, FM_COPY_D2H);
        OPS->copy(CTX, lse, d_lse, (size_t)N * 4, FM_COPY_D2H);
        OPS->copy(CTX, dl, d_dl, NE * 4, FM_COPY_D2H);
        OPS->stream_sync(CTX, FM_STREAM_COMPUTE);
    }
    CHECK_MSG(!memcmp(idx, idx2, Nk * 4) && !memcmp(tw, tw2, Nk * 4), "%s: two runs differ", what);
    for (size_t i = 0; i < NE; i++) ld[i] = logits[i];
    fm_ref_router_sigmoid(ridx, rw, rs, ld, bd, N, E, k, ng, tg, norm, scaling);
    /* Ids exact, and weights in the same order, on every row whose fp64 selection has no near-tie;
     * a near-tie row (margin < TIE_MARGIN, far above fp32 sigmoid's ~1e-7) may order or pick
     * otherwise and is left out of both comparisons (row 0, all equal, is checked below). */
    int64_t ties = 0, differ = 0;
    for (int64_t n = 0; n < N; n++) {
        const bool same = !memcmp(ridx + n * k, idx + n * k, (size_t)k * 4);
        if (near_tie(ld + n * E, bd, E, k, ng, tg)) {
            ties++;
            for (int64_t j = 0; j < k; j++) rw[n * k + j] = tw[n * k + j]; /* out of the weights' check */
            continue;
        }
        if (!same && differ++ < 3)
            fprintf(stderr, "%s: row %lld: ids differ from the fp64 reference, which has no near-tie there\n", what,
                    (long long)n);
    }
    printf("%s: %lld of %lld rows within %g of a tie (not compared)\n", what, (long long)ties, (long long)N, TIE_MARGIN);
    CHECK_MSG(differ == 0, "%s: ids differ from the fp64 reference on %lld rows without a near-tie", what,
              (long long)differ);
    CHECK_MSG(nerr(scores, rs, (int64_t)NE) <= 1e-6, "%s: scores", what);
    double *rp = malloc(NE * 8), *rl = malloc((size_t)N * 8); /* lse: logsumexp of the logits in fp64 */
    fm_ref_softmax(rp, rl, ld, N, E);
    CHECK_MSG(nerr(lse, rl, N) <= 1e-6, "%s: lse (nerr %g)", what, nerr(lse, rl, N));
    free(rp), free(rl);
    CHECK_MSG(nerr(tw, rw, (int64_t)Nk) <= 1e-6, "%s: weights", what);
    bool all0 = true;
    for (int64_t j = 0; j < k; j++) all0 &= idx[j] == j;
    CHECK_MSG(with_bias || all0, "%s: the all-equal row picks 0..k-1", what);
    if (!with_bias && ng > 2 && N > 2 && tg == 2) CHECK_MSG(idx[k] == gs, "%s: the best expert's group must lose", what);
    if (!with_bias && ng == 1 && E >= 96 && k >= 3 && N > 3)
        CHECK_MSG(idx[2 * k] == 5 && idx[2 * k + 1] == 37 && idx[2 * k + 2] == 69, "%s: tied experts 5, 37, 69 came "
                  "as %d, %d, %d", what, idx[2 * k], idx[2 * k + 1], idx[2 * k + 2]);
    if (!with_bias && ng > 2 && N > 3) /* groups 1 and 2 tie: 1's pair first, then 2's */
        CHECK_MSG(idx[3 * k] == gs && (k < 3 || idx[3 * k + 2] == 2 * gs), "%s: the tied groups' experts came as %d, %d",
                  what, idx[3 * k], k >= 3 ? idx[3 * k + 2] : -1);
    if (fd) {
        double *g = malloc(NE * 8), *ddw = malloc(Nk * 8);
        for (size_t i = 0; i < NE; i++) g[i] = dl[i];
        for (size_t i = 0; i < Nk; i++) ddw[i] = dw[i];
        sg_st s = {ld, idx, ddw, N, E, k, norm, scaling};
        fm_fd_check(what, sg_obj, &s, ld, (int64_t)NE, g, 1e-5, 0.01, FD_H, 0.1, &g_rng);
        free(g), free(ddw);
    }
    OPS->mem_free(CTX, d_logits), OPS->mem_free(CTX, d_scores), OPS->mem_free(CTX, d_lse), OPS->mem_free(CTX, d_tw);
    OPS->mem_free(CTX, d_dw), OPS->mem_free(CTX, d_dl), OPS->mem_free(CTX, d_idx), OPS->mem_free(CTX, d_bias);
    free(logits), free(scores), free(lse), free(tw), free(dw), free(dl), free(tw2), free(idx), free(ridx), free(idx2);
    free(bias), free(ld), free(rs), free(rw), free(bd);
}

static void check(int64_t N, int64_t E, int64_t k, int64_t ng, int64_t tg, bool norm, float scaling, bool fd) {
    check_b(N, E, k, ng, tg, norm, scaling, fd, false);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20261207));
    const fm_status st = gt_cuda_init(&g_be, 0, 128, 0);
    CHECK_MSG(st == FM_OK, "fm_cuda_backend_init: %s", fm_errmsg());
    if (st != FM_OK) return fm_test_finish();
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK_MSG(OPS->router_sigmoid_fwd && OPS->router_sigmoid_bwd, "the CUDA backend has no sigmoid router");
    if (OPS->router_sigmoid_fwd && OPS->router_sigmoid_bwd) {
        check(23, 16, 4, 4, 2, true, 2.5f, true);     /* adversarial rows, groups keep 2 of 4 */
        check(64, 128, 8, 1, 1, true, 1.0f, true);    /* GLM-4.5-Air's router */
        check(64, 256, 8, 8, 4, true, 2.5f, false);   /* DeepSeek-V3's */
        check(300000, 16, 4, 4, 2, false, 1.0f, false); /* grid-stride: more tokens than threads */
        check_b(64, 256, 8, 8, 4, true, 2.5f, false, true); /* DeepSeek-V3's with a random bias */
        check_b(64, 128, 8, 1, 1, false, 1.0f, true, true);
        check(40, 640, 8, 1, 1, true, 1.0f, false);     /* E above the shared row */
        check(50, 128, 4, 64, 8, true, 1.0f, false);    /* 64 groups: lanes hold groups lane and lane + 32 */
        CHECK_BACKEND_OK(&g_be);
    }
    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
