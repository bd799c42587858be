/* The CUDA backend's top-k strip ops of linear cross-entropy (cuda_lce_topk.cu: lce_topk_fold,
 * lce_topk_finalize) against the CPU backend's (cpu_lce_topk.c, compiled into this test: the
 * reference is the CPU code itself): random strips folded block by block (the last block partial),
 * then finalized with the same m, z; the ids and log-probs compared bit for bit, and, so the test
 * can fail on its own, against a plain sort of each row (ids in the strict order: logit
 * descending, id ascending). Rows with repeated logits (ties to the lower id), a NaN logit (never
 * enters), k = 1, k = 64 and k > the row's finite logits (-inf, -1). Run twice: the same bits. */
#include "../../src/backend/cpu/cpu_lce_topk.c" /* fm_cpu_lce_topk_*: the CPU reference */

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

static void check_topk(int64_t Nb, int64_t V, int64_t Vb, int64_t k, bool ties) {
    float *full = malloc((size_t)(Nb * V) * 4), *strip = malloc((size_t)(Nb * Vb) * 4);
    float *m = malloc((size_t)Nb * 4), *z = malloc((size_t)Nb * 4);
    float *tv = malloc((size_t)(Nb * k) * 4), *lc = malloc((size_t)(Nb * k) * 4), *lg = malloc((size_t)(Nb * k) * 4);
    int32_t *ti = malloc((size_t)(Nb * k) * 4), *ic = malloc((size_t)(Nb * k) * 4), *ig = malloc((size_t)(Nb * k) * 4);
    FM_ASSERT(full && strip && m && z && tv && lc && lg && ti && ic && ig);
    for (int64_t i = 0; i < Nb * V; i++)
        full[i] = ties ? (float)(int)fm_rng_below(&g_rng, 7) : (float)(3.0 * fm_rng_normal(&g_rng));
    if (Nb > 1) full[V + 3] = NAN; /* row 1: a NaN logit never enters */
    for (int64_t r = 0; r < Nb; r++) m[r] = 5.0f, z[r] = 1.0f + (float)r;
    float *d_strip = dalloc((size_t)(Nb * Vb) * 4), *d_tv = dalloc((size_t)(Nb * k) * 4), *d_m = dalloc((size_t)Nb * 4);
    float *d_z = dalloc((size_t)Nb * 4), *d_lp = dalloc((size_t)(Nb * k) * 4);
    int32_t *d_ti = dalloc((size_t)(Nb * k) * 4), *d_id = dalloc((size_t)(Nb * k) * 4);
    OPS->copy(CTX, d_m, m, (size_t)Nb * 4, FM_COPY_H2D);
    OPS->copy(CTX, d_z, z, (size_t)Nb * 4, FM_COPY_H2D);
    char what[128];
    snprintf(what, sizeof what, "lce_topk Nb=%lld V=%lld Vb=%lld k=%lld ties=%d", (long long)Nb, (long long)V,
             (long long)Vb, (long long)k, (int)ties);
    for (int rep = 0; rep < 2; rep++) {
        for (int64_t v0 = 0; v0 < V; v0 += Vb) {
            const int64_t vb = V - v0 < Vb ? V - v0 : Vb;
            for (int64_t r = 0; r < Nb; r++) memcpy(strip + r * vb, full + r * V + v0, (size_t)vb * 4);
            OPS->copy(CTX, d_strip, strip, (size_t)(Nb * vb) * 4, FM_COPY_H2D);
            OPS->lce_topk_fold(CTX, d_tv, d_ti, d_strip, Nb, vb, v0, k, v0 == 0);
            if (rep == 0) fm_cpu_lce_topk_fold(NULL, tv, ti, strip, Nb, vb, v0, k, v0 == 0);
        }
        OPS->lce_topk_finalize(CTX, d_lp, d_id, d_tv, d_ti, d_m, d_z, Nb, k);
        if (rep == 0) fm_cpu_lce_topk_finalize(NULL, lc, ic, tv, ti, m, z, Nb, k);
        OPS->copy(CTX, lg, d_lp, (size_t)(Nb * k) * 4, FM_COPY_D2H);
        OPS->copy(CTX, ig, d_id, (size_t)(Nb * k) * 4, FM_COPY_D2H);
        OPS->stream_sync(CTX, FM_STREAM_COMPUTE);
        CHECK_MSG(!memcmp(ig, ic, (size_t)(Nb * k) * 4), "%s (rep %d): ids differ from the CPU backend's", what, rep);
        CHECK_MSG(!memcmp(lg, lc, (size_t)(Nb * k) * 4), "%s (rep %d): log-probs differ from the CPU's bits", what, rep);
    }
    int64_t bad = 0;
    for (int64_t r = 0; r < Nb; r++) { /* the plain selection: j-th best in the strict order */
        int32_t prev = -1;
        for (int64_t j = 0; j < k; j++) {
            int32_t best = -1;
            for (int32_t v = 0; v < V; v++) {
                const float x = full[r * V + v];
                if (x != x) continue;
                bool taken = false;
                for (int64_t i = 0; i < j; i++) taken |= ig[r * k + i] == v;
                if (taken) continue;
                if (best < 0 || x > full[r * V + best]) best = v;
            }
            bad += ig[r * k + j] != best;
            if (best >= 0) {
                const float want = (float)-(((double)m[r] - (double)full[r * V + best]) + log((double)z[r]));
                bad += lg[r * k + j] != want;
            }
            prev = best;
        }
        (void)prev;
    }
    CHECK_MSG(bad == 0, "%s: %lld entries off the plain selection", what, (long long)bad);
    OPS->mem_free(CTX, d_strip), OPS->mem_free(CTX, d_tv), OPS->mem_free(CTX, d_m), OPS->mem_free(CTX, d_z);
    OPS->mem_free(CTX, d_lp), OPS->mem_free(CTX, d_ti), OPS->mem_free(CTX, d_id);
    free(full), free(strip), free(m), free(z), free(tv), free(lc), free(lg), free(ti), free(ic), free(ig);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20261208));
    const fm_status st = gt_cuda_init(&g_be, 0, 128, 0);
    CHECK_MSG(st == FM_OK, "fm_cuda_backend_init: %s", fm_errmsg());
    if (st != FM_OK) return fm_test_finish();
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK_MSG(OPS->lce_topk_fold && OPS->lce_topk_finalize, "the CUDA backend has no lce_topk ops");
    if (OPS->lce_topk_fold && OPS->lce_topk_finalize) {
        check_topk(300, 1000, 256, 8, false); /* four blocks, the last partial */
        check_topk(200, 500, 128, 20, true);  /* ties: the lower id first */
        check_topk(64, 300, 300, 1, false);   /* one block, k = 1 */
        check_topk(50, 4096, 1024, 64, false);
        check_topk(10, 5, 2, 8, false);       /* k > V: -inf and -1 past the fifth */
        CHECK_BACKEND_OK(&g_be);
    }
    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
