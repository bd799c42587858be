/* The CUDA backend's sequence-wise balance loss of the sigmoid router (cuda_router_seq_aux.cu:
 * router_seq_aux_fwd / _bwd) against the CPU backend's (cpu_router_seq_aux.c, compiled into this
 * test: the reference is the CPU code itself, which tests/test_router_seq_aux.c holds to an fp64
 * reference and finite differences), on the same fp32 scores and routes: the loss within 1e-12
 * relative and the gradient added to a pre-filled dlogits within 1e-6 of its largest increment
 * (the same double sums in the same orders; nvcc may contract a product and a sum into an FMA, and
 * the backward's score sums and dot products are warp butterflies, not the CPU's j-ascending sums:
 * a few ulp of double, then one fp32 rounding). Segments: rows, and packed documents of mixed
 * lengths with one-token documents; shapes GLM-4.5-Air's router (E 128, k 8), DeepSeek-V3's
 * (E 256, k 8), Kimi-K2's (E 384: threads take experts e and e + 256) and a small one; more
 * tokens per segment than the forward's 256-token chunk. Run twice on the device: the same bits.
 * Written without a GPU: compiled, not yet run. */
#include "../../src/backend/cpu/cpu_router_seq_aux.c" /* fm_cpu_router_seq_aux_*: the CPU reference */

#include "core/fm_rng.h"
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

static void check(int64_t B, int64_t T, int64_t E, int64_t k, bool docs) {
    const int64_t N = B * T;
    const size_t NE = (size_t)(N * E), Nk = (size_t)(N * k);
    float *scores = malloc(NE * 4), *dc = malloc(NE * 4), *dg = malloc(NE * 4), *dg2 = malloc(NE * 4);
    int32_t *idx = malloc(Nk * 4), *doc = malloc((size_t)N * 4);
    FM_ASSERT(scores && dc && dg && dg2 && idx && doc);
    for (size_t i = 0; i < NE; i++) scores[i] = (float)(1.0 / (1.0 + exp(-2.0 * fm_rng_normal(&g_rng))));
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < k; j++) {
            bool dup;
            do {
                idx[n * k + j] = (int32_t)fm_rng_below(&g_rng, (uint64_t)E);
                dup = false;
                for (int64_t i = 0; i < j; i++) dup |= idx[n * k + i] == idx[n * k + j];
            } while (dup);
        }
    for (int64_t r = 0; r < B; r++) /* documents: 1, 1, then 1 .. 400 tokens */
        for (int64_t t = 0, d = 0; t < T; d++) {
            const int64_t len = d < 2 ? 1 : 1 + (int64_t)fm_rng_below(&g_rng, 400);
            for (int64_t i = 0; i < len && t + i < T; i++) doc[r * T + t + i] = (int32_t)t;
            t += len;
        }
    float *d_s = dalloc(NE * 4), *d_dl = dalloc(NE * 4);
    int32_t *d_idx = dalloc(Nk * 4), *d_doc = dalloc((size_t)N * 4);
    double *d_term = dalloc(8);
    OPS->copy(CTX, d_s, scores, NE * 4, FM_COPY_H2D);
    OPS->copy(CTX, d_idx, idx, Nk * 4, FM_COPY_H2D);
    OPS->copy(CTX, d_doc, doc, (size_t)N * 4, FM_COPY_H2D);
    const int32_t *dp = docs ? doc : NULL, *d_dp = docs ? d_doc : NULL;
    const double coef = 0.01;
    double tc = -1, tg = -2, tg2 = -3;
    fm_cpu_router_seq_aux_fwd(NULL, &tc, scores, idx, dp, B, T, E, k, coef);
    for (size_t i = 0; i < NE; i++) dc[i] = 0.25f;
    fm_cpu_router_seq_aux_bwd(NULL, dc, scores, idx, dp, B, T, E, k, coef);
    for (int rep = 0; rep < 2; rep++) {
        for (size_t i = 0; i < NE; i++) dg[i] = 0.25f;
        OPS->copy(CTX, d_dl, dg, NE * 4, FM_COPY_H2D);
        OPS->router_seq_aux_fwd(CTX, d_term, d_s, d_idx, d_dp, B, T, E, k, coef);
        OPS->router_seq_aux_bwd(CTX, d_dl, d_s, d_idx, d_dp, B, T, E, k, coef);
        OPS->copy(CTX, rep ? &tg2 : &tg, d_term, 8, FM_COPY_D2H);
        OPS->copy(CTX, rep ? dg2 : dg, d_dl, NE * 4, FM_COPY_D2H);
        OPS->stream_sync(CTX, FM_STREAM_COMPUTE);
    }
    char what[160];
    snprintf(what, sizeof what, "router_seq_aux B=%lld T=%lld E=%lld k=%lld %s", (long long)B, (long long)T,
             (long long)E, (long long)k, docs ? "documents" : "rows");
    CHECK_MSG(tg == tg2 && !memcmp(dg, dg2, NE * 4), "%s: two runs differ", what);
    CHECK_MSG(fabs(tg - tc) <= 1e-12 * fabs(tc), "%s: loss %.17g, CPU %.17g", what, tg, tc);
    double worst = 0, scale = 1e-30;
    for (size_t i = 0; i < NE; i++) {
        worst = fmax(worst, fabs((double)dg[i] - (double)dc[i]));
        scale = fmax(scale, fabs((double)dc[i] - 0.25));
    }
    CHECK_MSG(worst <= 1e-6 * scale + 6e-8, "%s: gradient off the CPU's by %.3g (largest increment %.3g)", what, worst,
              scale);
    OPS->mem_free(CTX, d_s), OPS->mem_free(CTX, d_dl), OPS->mem_free(CTX, d_idx), OPS->mem_free(CTX, d_doc);
    OPS->mem_free(CTX, d_term);
    free(scores), free(dc), free(dg), free(dg2), free(idx), free(doc);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20261209));
    const fm_status st = gt_cuda_init(&g_be, 0, 128, 0);
    CHECK_MSG(st == FM_OK, "fm_cuda_backend_init: %s", fm_errmsg());
    if (st != FM_OK) return fm_test_finish();
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK_MSG(OPS->router_seq_aux_fwd && OPS->router_seq_aux_bwd, "the CUDA backend has no sequence-wise loss");
    if (OPS->router_seq_aux_fwd && OPS->router_seq_aux_bwd) {
        check(2, 1000, 128, 8, false); /* GLM-4.5-Air's router, rows of 1000 (> the 256-token chunk) */
        check(2, 1000, 128, 8, true);
        check(1, 700, 256, 8, true);   /* DeepSeek-V3's */
        check(3, 50, 8, 2, true);
        check(1, 600, 384, 8, true);   /* Kimi-K2's E 384: more experts than the 256 threads (strided) */
        CHECK_BACKEND_OK(&g_be);
    }
    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
