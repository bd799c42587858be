/* The CUDA backend's router_force (cuda_router_force.cu: FLATMOE_TEST_FORCE_ROUTE's forced routing
 * on the device) against the CPU backend's (cpu_router_force.c, compiled into this test, so the
 * reference is the CPU code itself, not a copy), on the same probabilities: those of the CUDA
 * router_fwd on random logits, read back. Both start from router_fwd's own top-k; the forced
 * ids and weights must be the same bits (idx and weights compared with memcmp), and, so the test
 * can fail on its own: forced tokens hold experts first .. first+k-1 (mod E), their weights the
 * probabilities of those experts (summing to 1 with norm_topk), exactly floor(N*pct/100)
 * tokens are forced, and every other token keeps router_fwd's row. Shapes: OLMoE's (E 64, k 8,
 * no renormalization), Qwen3-MoE's (E 128, k 8, norm_topk, first near E: wrap-around), a skewed
 * 90% and 37%, pct 0 (nothing changes), N = 0, and a grid-stride N (more tokens than threads of
 * the grid); and one with the weights times a scaling of 2.5 (the sigmoid router's
 * routed_scaling_factor: the forced weights sum to it). Run twice on the device: the same bits
 * (determinism). */
#include "../../src/backend/cpu/cpu_router_force.c" /* fm_cpu_router_force: the CPU reference */

#include "core/fm_rng.h"
#include "gpu_test.h"

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

static void check_force_scaled(int64_t N, int64_t E, int64_t k, int64_t first, int pct, bool norm, float scale) {
    const size_t nl = (size_t)(N > 0 ? N : 1);
    float *logits = malloc(nl * (size_t)E * 4), *probs = malloc(nl * (size_t)E * 4);
    float *w0 = malloc(nl * (size_t)k * 4), *wc = malloc(nl * (size_t)k * 4), *wg = malloc(nl * (size_t)k * 4);
    int32_t *i0 = malloc(nl * (size_t)k * 4), *ic = malloc(nl * (size_t)k * 4), *ig = malloc(nl * (size_t)k * 4);
    FM_ASSERT(logits && probs && w0 && wc && wg && i0 && ic && ig);
    for (int64_t i = 0; i < N * E; i++) logits[i] = (float)(2.0 * fm_rng_normal(&g_rng));
    float *d_logits = dalloc(nl * (size_t)E * 4), *d_probs = dalloc(nl * (size_t)E * 4), *d_lse = dalloc(nl * 4);
    float *d_w = dalloc(nl * (size_t)k * 4);
    int32_t *d_idx = dalloc(nl * (size_t)k * 4);
    const size_t pb = (size_t)(N * E) * 4, kb = (size_t)(N * k) * 4;
    if (pb) OPS->copy(CTX, d_logits, logits, pb, FM_COPY_H2D);
    OPS->router_fwd(CTX, d_probs, d_lse, d_idx, d_w, d_logits, N, E, k, norm);
    if (pb) OPS->copy(CTX, probs, d_probs, pb, FM_COPY_D2H);
    if (kb) OPS->copy(CTX, i0, d_idx, kb, FM_COPY_D2H), OPS->copy(CTX, w0, d_w, kb, FM_COPY_D2H);
    memcpy(ic, i0, kb), memcpy(wc, w0, kb);
    fm_cpu_router_force(NULL, ic, wc, probs, N, E, k, first, pct, norm, scale); /* the CPU backend's op, on the host */
    char what[160];
    snprintf(what, sizeof what, "router_force N=%lld E=%lld k=%lld first=%lld pct=%d norm=%d scale %g", (long long)N,
             (long long)E, (long long)k, (long long)first, pct, (int)norm, (double)scale);
    for (int rep = 0; rep < 2; rep++) { /* twice from router_fwd's rows: the same bits */
        if (kb) OPS->copy(CTX, d_idx, i0, kb, FM_COPY_H2D), OPS->copy(CTX, d_w, w0, kb, FM_COPY_H2D);
        OPS->router_force(CTX, d_idx, d_w, d_probs, N, E, k, first, pct, norm, scale);
        if (kb) OPS->copy(CTX, ig, d_idx, kb, FM_COPY_D2H), OPS->copy(CTX, wg, d_w, kb, FM_COPY_D2H);
        OPS->stream_sync(CTX, FM_STREAM_COMPUTE);
        CHECK_MSG(!kb || !memcmp(ig, ic, kb), "%s (rep %d): top-k ids differ from the CPU backend's", what, rep);
        CHECK_MSG(!kb || !memcmp(wg, wc, kb), "%s (rep %d): top-k weights differ from the CPU backend's bits", what, rep);
    }
    int64_t forced = 0, bad_forced = 0, bad_kept = 0;
    for (int64_t n = 0; n < N; n++) {
        bool is_forced = true;
        double sum = 0;
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = (first + j) % E;
            if (ig[n * k + j] != e) is_forced = false;
            sum += wg[n * k + j];
            if (ig[n * k + j] == e && !norm && wg[n * k + j] != probs[n * E + e] * scale) bad_forced++;
        }
        const bool kept = !memcmp(ig + n * k, i0 + n * k, (size_t)k * 4) && !memcmp(wg + n * k, w0 + n * k, (size_t)k * 4);
        if (is_forced) {
            forced++;
            if (norm && fabs(sum - scale) > 1e-6 * scale) bad_forced++;
        } else if (!kept) bad_kept++;
    }
    /* a token router_fwd itself sent to exactly those experts counts as forced either way */
    int64_t natural = 0;
    for (int64_t n = 0; n < N; n++) {
        bool same = true;
        for (int64_t j = 0; j < k; j++) same = same && i0[n * k + j] == (first + j) % E;
        if (same && !(n * pct / 100 < (n + 1) * pct / 100)) natural++;
    }
    CHECK_MSG(forced == N * pct / 100 + natural, "%s: %lld tokens forced, expected %lld", what, (long long)forced,
              (long long)(N * pct / 100 + natural));
    CHECK_MSG(bad_forced == 0, "%s: %lld forced tokens with wrong weights", what, (long long)bad_forced);
    CHECK_MSG(bad_kept == 0, "%s: %lld unforced tokens changed", what, (long long)bad_kept);
    OPS->mem_free(CTX, d_logits), OPS->mem_free(CTX, d_probs), OPS->mem_free(CTX, d_lse);
    OPS->mem_free(CTX, d_w), OPS->mem_free(CTX, d_idx);
    free(logits), free(probs), free(w0), free(wc), free(wg), free(i0), free(ic), free(ig);
}

static void check_force(int64_t N, int64_t E, int64_t k, int64_t first, int pct, bool norm) {
    check_force_scaled(N, E, k, first, pct, norm, 1.0f);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20261201));
    const fm_status st = gt_cuda_init(&g_be, 0, 128, 0);
    CHECK_MSG(st == FM_OK, "fm_cuda_backend_init: %s", fm_errmsg());
    if (st != FM_OK) return fm_test_finish();
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK_MSG(OPS->router_force != NULL, "the CUDA backend has no router_force op");
    if (OPS->router_force) {
        check_force(1000, 64, 8, 0, 100, false);   /* OLMoE-1B-7B: every token to experts 0..7 */
        check_force(1000, 128, 8, 125, 100, true); /* Qwen3-30B-A3B, wrapping: 125, 126, 127, 0, ..., 4 */
        check_force(777, 64, 8, 3, 90, true);      /* the skewed form */
        check_force(513, 8, 2, 7, 37, true);
        check_force(300, 64, 8, 0, 0, false);      /* nothing forced */
        check_force(0, 64, 8, 0, 100, true);       /* no tokens */
        check_force(1500000, 16, 4, 5, 75, true);  /* more tokens than the grid's threads: the grid-stride loop */
        check_force_scaled(1000, 64, 8, 3, 60, true, 2.5f);  /* the sigmoid router's routed_scaling_factor */
        check_force_scaled(1000, 64, 8, 3, 60, false, 2.5f);
        CHECK_BACKEND_OK(&g_be);
    }
    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
