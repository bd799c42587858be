/* The CUDA backend's DeepSeek-V2 router (cuda_router_softmax_group.cu: router_softmax_group_fwd /
 * _bwd) against the plain fp64 reference of tests/fm_ref_ops.c (fm_ref_router_softmax_group, written
 * from transformers' DeepseekV2Moe; the CPU test tests/test_router_softmax_group.c holds the CPU op
 * to the same reference): probs and lse within 1e-6 normalized; ids as sets on the rows whose fp64
 * margins exceed 1e-5 (torch.topk's tie order is unspecified; the skipped rows are counted and must
 * be few), the op's own order (prob descending, ties to the lower id) on every row; each weight
 * exactly its prob times scaling (one fp32 multiply on either side); the all-equal row picks
 * 0..k-1 and a row whose third-best expert's group is dropped does not pick it; two runs the same
 * bits; the backward against the reference objective's central finite differences at 1e-5 (floor
 * 0.01). Shapes: DeepSeek-V2-Lite's router (E 64, k 6, greedy), DeepSeek-V2's (E 160, k 6, 8 groups
 * keep 3, scaling 16), a small grouped one with the constructed rows, and a grid-stride N.
 * Written without a GPU (compiled, not yet run). */
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

typedef struct obj_st {
    double *logits;
    const int32_t *idx;
    const double *dw, *gpe;
    double z, scaling;
    int64_t N, E, k;
} obj_st;

static double obj(void *v) {
    const obj_st *s = v;
    return fm_ref_router_softmax_group_objective(s->logits, s->idx, s->dw, s->gpe, s->z, s->scaling, s->N, s->E, s->k);
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

static void check(int64_t N, int64_t E, int64_t k, int64_t ng, int64_t tg, float scaling, bool fd) {
    const size_t NE = (size_t)(N * E), Nk = (size_t)(N * k);
    float *logits = malloc(NE * 4), *probs = malloc(NE * 4), *lse = malloc((size_t)N * 4), *tw = malloc(Nk * 4);
    float *dw = malloc(Nk * 4), *gpe = malloc((size_t)E * 4), *dl = malloc(NE * 4), *tw2 = malloc(Nk * 4);
    int32_t *idx = malloc(Nk * 4), *idx2 = malloc(Nk * 4);
    double *ld = malloc(NE * 8), *rp = malloc(NE * 8), *rl = malloc((size_t)N * 8), *pr = malloc((size_t)E * 8);
    double *rw = malloc((size_t)E * 8);
    bool *in = malloc((size_t)E);
    for (size_t i = 0; i < NE; i++) logits[i] = (float)(2.0 * fm_rng_normal(&g_rng));
    const int64_t gs = E / ng;
    for (int64_t e = 0; e < E; e++) logits[e] = 0.25f; /* row 0: all equal */
    const bool row1 = ng >= 3 && gs >= 2 && tg == 2 && k == 3 && N > 1;
    if (row1) { /* the third-best expert (group 2's best) is in a group not kept */
        for (int64_t e = 0; e < E; e++) logits[E + e] = -1.0f;
        logits[E + 0] = 6.0f, logits[E + gs] = 5.0f, logits[E + 2 * gs] = 4.0f, logits[E + 1] = 0.5f;
    }
    for (size_t i = 0; i < Nk; i++) dw[i] = (float)fm_rng_normal(&g_rng);
    for (int64_t e = 0; e < E; e++) gpe[e] = (float)(0.3 * fm_rng_normal(&g_rng));
    float *d_logits = dalloc(NE * 4), *d_probs = dalloc(NE * 4), *d_lse = dalloc((size_t)N * 4), *d_tw = dalloc(Nk * 4);
    float *d_dw = dalloc(Nk * 4), *d_gpe = dalloc((size_t)E * 4), *d_dl = dalloc(NE * 4);
    int32_t *d_idx = dalloc(Nk * 4);
    OPS->copy(CTX, d_logits, logits, NE * 4, FM_COPY_H2D);
    OPS->copy(CTX, d_dw, dw, Nk * 4, FM_COPY_H2D);
    OPS->copy(CTX, d_gpe, gpe, (size_t)E * 4, FM_COPY_H2D);
    const float z = 0.05f;
    char what[160];
    snprintf(what, sizeof what, "cuda deepseek_v2 router N=%lld E=%lld k=%lld groups %lld/%lld scale %g", (long long)N,
             (long long)E, (long long)k, (long long)tg, (long long)ng, (double)scaling);
    for (int rep = 0; rep < 2; rep++) {
        OPS->router_softmax_group_fwd(CTX, d_probs, d_lse, d_idx, d_tw, d_logits, N, E, k, ng, tg, scaling);
        OPS->router_softmax_group_bwd(CTX, d_dl, d_dw, d_gpe, z, d_probs, d_lse, d_idx, N, E, k, scaling);
        OPS->copy(CTX, rep ? idx2 : idx, d_idx, Nk * 4, FM_COPY_D2H);
        OPS->copy(CTX, rep ? tw2 : tw, d_tw, Nk * 4, FM_COPY_D2H);
        OPS->copy(CTX, probs, d_probs, NE * 4, FM_COPY_D2H);
        OPS->copy(CTX, lse, d_lse, (size_t)N * 4, FM_COPY_D2H);
        OPS->copy(CTX, dl, d_dl, NE * 4, FM_COPY_D2H);
        OPS->stream_sync(CTX, FM_STREAM_COMPUTE);
    }
    CHECK_MSG(!memcmp(idx, idx2, Nk * 4) && !memcmp(tw, tw2, Nk * 4), "%s: two runs differ", what);
    for (size_t i = 0; i < NE; i++) ld[i] = logits[i];
    fm_ref_softmax(rp, rl, ld, N, E);
    CHECK_MSG(nerr(probs, rp, (int64_t)NE) <= 1e-6, "%s: probs", what);
    CHECK_MSG(nerr(lse, rl, N) <= 1e-6, "%s: lse", what);
    int64_t skipped = 0, wrong = 0, order = 0;
    for (int64_t n = 0; n < N; n++) {
        const int32_t *id = idx + n * k;
        for (int64_t j = 0; j < k; j++) {
            const bool ok_id = id[j] >= 0 && id[j] < E;
            if (!ok_id) { order++; break; }
            if (tw[n * k + j] != probs[n * E + id[j]] * scaling) order++;
            if (j > 0 && !(probs[n * E + id[j - 1]] > probs[n * E + id[j]] ||
                           (probs[n * E + id[j - 1]] == probs[n * E + id[j]] && id[j - 1] < id[j])))
                order++;
        }
        if (order) continue;
        if (!(fm_ref_router_softmax_group(ld + n * E, E, k, ng, tg, scaling, pr, in, rw) > 1e-5)) { skipped++; continue; }
        for (int64_t j = 0; j < k; j++) wrong += !in[id[j]];
    }
    printf("%s: %lld of %lld rows against the fp64 reference (%lld skipped: margin <= 1e-5)\n", what,
           (long long)(N - skipped), (long long)N, (long long)skipped);
    CHECK_MSG(order == 0, "%s: %lld ids out of range, out of the op's order, or weights not prob x scaling", what,
              (long long)order);
    CHECK_MSG(wrong == 0, "%s: %lld chosen ids are not transformers'", what, (long long)wrong);
    CHECK_MSG(skipped <= 1 + N / 10, "%s: %lld rows skipped of %lld", what, (long long)skipped, (long long)N);
    for (int64_t j = 0; j < k; j++) CHECK_MSG(idx[j] == j, "%s: the all-equal row picks 0..k-1", what);
    if (row1) CHECK_MSG(idx[k] == 0 && idx[k + 1] == gs && idx[k + 2] == 1, "%s: row 1: the third-best's group", what);
    if (fd) {
        double *g = malloc(NE * 8), *ddw = malloc(Nk * 8), *dgpe = malloc((size_t)E * 8);
        for (size_t i = 0; i < NE; i++) g[i] = dl[i];
        for (size_t i = 0; i < Nk; i++) ddw[i] = dw[i];
        for (int64_t e = 0; e < E; e++) dgpe[e] = gpe[e];
        obj_st s = {ld, idx, ddw, dgpe, z, scaling, N, E, k};
        fm_fd_check(what, obj, &s, ld, (int64_t)NE, g, 1e-5, 0.01, FD_H, 0.1, &g_rng);
        free(g), free(ddw), free(dgpe);
    }
    OPS->mem_free(CTX, d_logits), OPS->mem_free(CTX, d_probs), OPS->mem_free(CTX, d_lse), OPS->mem_free(CTX, d_tw);
    OPS->mem_free(CTX, d_dw), OPS->mem_free(CTX, d_gpe), OPS->mem_free(CTX, d_dl), OPS->mem_free(CTX, d_idx);
    free(logits), free(probs), free(lse), free(tw), free(dw), free(gpe), free(dl), free(tw2), free(idx), free(idx2);
    free(ld), free(rp), free(rl), free(pr), free(rw), free(in);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20261208));
    const fm_status st = gt_cuda_init(&g_be, 0, 128, 0);
    CHECK_MSG(st == FM_OK, "fm_cuda_backend_init: %s", fm_errmsg());
    if (st != FM_OK) return fm_test_finish();
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK_MSG(OPS->router_softmax_group_fwd && OPS->router_softmax_group_bwd, "the CUDA backend has no DeepSeek-V2 router");
    if (OPS->router_softmax_group_fwd && OPS->router_softmax_group_bwd) {
        check(31, 8, 3, 4, 2, 16.0f, true);       /* the constructed rows; groups keep 2 of 4 */
        check(64, 64, 6, 1, 1, 1.0f, true);       /* DeepSeek-V2-Lite's router */
        check(48, 160, 6, 8, 3, 16.0f, false);    /* DeepSeek-V2's */
        check(300000, 16, 4, 4, 2, 1.0f, false);  /* grid-stride: more tokens than threads */
        CHECK_BACKEND_OK(&g_be);
    }
    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
