/* The CUDA backend's router_replay (cuda_router_replay.cu: routing replay, R3, on the device) against
 * the CPU backend's (cpu_router_replay.c, compiled into this test: the reference is the CPU code
 * itself), on the probabilities of the CUDA router_fwd on random logits, read back:
 *  - replaying router_fwd's own routes gives router_fwd's ids and weights bit for bit (the device
 *    replay weighs as the device router_fwd does: fp32 sum in j order, IEEE division), every token
 *    and with padding rows (-1) mixed in;
 *  - replaying random distinct routes: the same bits as the CPU op; the ids are the given ones, the
 *    weights the probabilities of those experts (summing to 1 with norm_topk), padding rows keep
 *    router_fwd's row.
 * Shapes: OLMoE's (E 64, k 8, no renormalization), Qwen3-MoE's (E 128, k 8, norm_topk), a small
 * one, N = 0, and a grid-stride N. The same for the sigmoid router (router_sigmoid_fwd with a random
 * selection bias and groups; replay with eps 1e-20f and routed_scaling_factor, as fm_router.c
 * calls it): its own routes give router_sigmoid_fwd's bits, other routes the CPU op's, the weights
 * the scores (no bias) times the scaling (summing to it with norm_topk): GLM-4.5-Air's shape (E 128,
 * k 8, 1 group, 1.0), DeepSeek-V3's (E 256, k 8, 8 groups keeping 4, 2.5) and a small one. Run twice
 * on the device: the same bits. */
#include "../../src/backend/cpu/cpu_router_replay.c" /* fm_cpu_router_replay: the CPU reference */

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

/* own: replay the router's own routes (else random distinct ones); pad_pct: share of rows -1; ng > 0:
 * the sigmoid router with ng groups keeping tg, scaling (else router_fwd's softmax). */
static void check_replay_as(int64_t N, int64_t E, int64_t k, bool norm, bool own, int pad_pct, int64_t ng, int64_t tg,
                            float scaling) {
    const bool sig = ng > 0;
    const float eps = sig ? 1e-20f : 0.0f, scale = sig ? scaling : 1.0f;
    const size_t nl = (size_t)(N > 0 ? N : 1);
    float *logits = malloc(nl * (size_t)E * 4), *probs = malloc(nl * (size_t)E * 4);
    float *w0 = malloc(nl * (size_t)k * 4), *wc = malloc(nl * (size_t)k * 4), *wg = malloc(nl * (size_t)k * 4);
    int32_t *i0 = malloc(nl * (size_t)k * 4), *ic = malloc(nl * (size_t)k * 4), *ig = malloc(nl * (size_t)k * 4);
    int32_t *rep = malloc(nl * (size_t)k * 4);
    uint16_t *bias = malloc((size_t)E * 2); /* bf16 bits (the CUDA build's fm_act) */
    FM_ASSERT(logits && probs && w0 && wc && wg && i0 && ic && ig && rep && bias);
    for (int64_t i = 0; i < N * E; i++) logits[i] = (float)(2.0 * fm_rng_normal(&g_rng));
    for (int64_t e = 0; e < E; e++) { /* a small random selection bias */
        const float b = (float)(0.1 * fm_rng_normal(&g_rng));
        uint32_t u;
        memcpy(&u, &b, 4);
        bias[e] = (uint16_t)(u >> 16);
    }
    fm_act *d_bias = dalloc((size_t)E * 2);
    OPS->copy(CTX, d_bias, bias, (size_t)E * 2, FM_COPY_H2D);
    float *d_logits = dalloc(nl * (size_t)E * 4), *d_probs = dalloc(nl * (size_t)E * 4), *d_lse = dalloc(nl * 4);
    float *d_w = dalloc(nl * (size_t)k * 4);
    int32_t *d_idx = dalloc(nl * (size_t)k * 4), *d_rep = dalloc(nl * (size_t)k * 4);
    const size_t pb = (size_t)(N * E) * 4, kb = (size_t)(N * k) * 4;
    if (pb) OPS->copy(CTX, d_logits, logits, pb, FM_COPY_H2D);
    if (sig)
        OPS->router_sigmoid_fwd(CTX, d_probs, d_lse, d_idx, d_w, d_logits, d_bias, N, E, k, ng, tg, norm, scaling);
    else
        OPS->router_fwd(CTX, d_probs, d_lse, d_idx, d_w, d_logits, N, E, k, norm);
    if (pb) OPS->copy(CTX, probs, d_probs, pb, FM_COPY_D2H);
    if (kb) OPS->copy(CTX, i0, d_idx, kb, FM_COPY_D2H), OPS->copy(CTX, w0, d_w, kb, FM_COPY_D2H);
    for (int64_t n = 0; n < N; n++) {
        int32_t *r = rep + n * k;
        if ((int)fm_rng_below(&g_rng, 100) < pad_pct) {
            for (int64_t j = 0; j < k; j++) r[j] = -1;
            continue;
        }
        if (own) {
            memcpy(r, i0 + n * k, (size_t)k * 4);
            continue;
        }
        for (int64_t j = 0; j < k; j++) { /* distinct random ids */
            bool dup;
            do {
                r[j] = (int32_t)fm_rng_below(&g_rng, (uint64_t)E);
                dup = false;
                for (int64_t i = 0; i < j; i++) dup |= r[i] == r[j];
            } while (dup);
        }
    }
    if (kb) OPS->copy(CTX, d_rep, rep, kb, FM_COPY_H2D);
    memcpy(ic, i0, kb), memcpy(wc, w0, kb);
    fm_cpu_router_replay(NULL, ic, wc, probs, rep, N, E, k, norm, eps, scale); /* the CPU backend's op, on the host */
    char what[160];
    snprintf(what, sizeof what, "router_replay (%s) N=%lld E=%lld k=%lld norm=%d own=%d pad=%d%%",
             sig ? "sigmoid" : "softmax", (long long)N, (long long)E, (long long)k, (int)norm, (int)own, pad_pct);
    for (int r = 0; r < 2; r++) { /* twice from router_fwd's rows: the same bits */
        if (kb) OPS->copy(CTX, d_idx, i0, kb, FM_COPY_H2D), OPS->copy(CTX, d_w, w0, kb, FM_COPY_H2D);
        OPS->router_replay(CTX, d_idx, d_w, d_probs, d_rep, N, E, k, norm, eps, scale);
        if (kb) OPS->copy(CTX, ig, d_idx, kb, FM_COPY_D2H), OPS->copy(CTX, wg, d_w, kb, FM_COPY_D2H);
        OPS->stream_sync(CTX, FM_STREAM_COMPUTE);
        CHECK_MSG(!kb || !memcmp(ig, ic, kb), "%s (rep %d): ids differ from the CPU backend's", what, r);
        CHECK_MSG(!kb || !memcmp(wg, wc, kb), "%s (rep %d): weights differ from the CPU backend's bits", what, r);
        if (own) CHECK_MSG(!kb || (!memcmp(ig, i0, kb) && !memcmp(wg, w0, kb)), "%s: not router_fwd's bits", what);
    }
    int64_t bad = 0;
    for (int64_t n = 0; n < N; n++) {
        if (rep[n * k] < 0) {
            bad += memcmp(ig + n * k, i0 + n * k, (size_t)k * 4) || memcmp(wg + n * k, w0 + n * k, (size_t)k * 4);
            continue;
        }
        double sum = 0;
        for (int64_t j = 0; j < k; j++) {
            const int32_t e = rep[n * k + j];
            bad += ig[n * k + j] != e;
            if (!norm) bad += wg[n * k + j] != probs[n * E + e] * scale;
            sum += wg[n * k + j];
        }
        if (norm) bad += fabs(sum - scale) > 1e-6 * scale;
    }
    CHECK_MSG(bad == 0, "%s: %lld rows with wrong ids or weights", what, (long long)bad);
    OPS->mem_free(CTX, d_logits), OPS->mem_free(CTX, d_probs), OPS->mem_free(CTX, d_lse);
    OPS->mem_free(CTX, d_w), OPS->mem_free(CTX, d_idx), OPS->mem_free(CTX, d_rep), OPS->mem_free(CTX, d_bias);
    free(bias), free(logits), free(probs), free(w0), free(wc), free(wg), free(i0), free(ic), free(ig), free(rep);
}

static void check_replay(int64_t N, int64_t E, int64_t k, bool norm, bool own, int pad_pct) {
    check_replay_as(N, E, k, norm, own, pad_pct, 0, 0, 1.0f);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20261207));
    const fm_status st = gt_cuda_init(&g_be, 0, 128, 0);
    CHECK_MSG(st == FM_OK, "fm_cuda_backend_init: %s", fm_errmsg());
    if (st != FM_OK) return fm_test_finish();
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK_MSG(OPS->router_replay != NULL, "the CUDA backend has no router_replay op");
    if (OPS->router_replay) {
        check_replay(1000, 64, 8, false, true, 0);   /* OLMoE-1B-7B, its own routes: router_fwd's bits */
        check_replay(1000, 128, 8, true, true, 10);  /* Qwen3-30B-A3B, own routes, padding rows */
        check_replay(1000, 300, 8, true, true, 0);   /* E > 256: router_fwd's generic kernel */
        check_replay(777, 64, 8, false, false, 20);  /* random routes */
        check_replay(513, 128, 8, true, false, 0);
        check_replay(300, 8, 2, true, false, 50);
        check_replay(0, 64, 8, true, false, 0);      /* no tokens */
        check_replay(1500000, 16, 4, true, false, 5); /* more tokens than the grid's threads */
        CHECK_MSG(OPS->router_sigmoid_fwd != NULL, "the CUDA backend has no sigmoid router");
        if (OPS->router_sigmoid_fwd) {
            check_replay_as(1000, 128, 8, true, true, 10, 1, 1, 1.0f);   /* GLM-4.5-Air: own routes */
            check_replay_as(1000, 256, 8, true, true, 0, 8, 4, 2.5f);    /* DeepSeek-V3: own routes */
            check_replay_as(777, 256, 8, true, false, 20, 8, 4, 2.5f);   /* random routes */
            check_replay_as(300, 8, 2, false, false, 50, 4, 2, 2.5f);    /* no renormalization */
            check_replay_as(300, 8, 2, false, true, 0, 4, 2, 2.5f);
        }
        CHECK_BACKEND_OK(&g_be);
    }
    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
