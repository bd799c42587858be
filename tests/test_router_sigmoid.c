/* The sigmoid router op of the CPU backend (fm_backend.h router_sigmoid_fwd / _bwd; DeepSeek-V3's
 * router as transformers' Glm4MoeTopkRouter computes it) against the plain fp64 reference of
 * tests/fm_ref_ops.c (fm_ref_router_sigmoid, shared with the GPU test tests/gpu/
 * test_cuda_router_sigmoid.c) and central finite differences of the reference objective with the
 * selection held fixed. Method and tolerances as tests/test_ops_cpu_moe.c: outputs poisoned (NaN)
 * before each call; scores and weights within 1e-6 normalized (fp32 sigmoid and one division
 * against fp64: a few roundings); ids exact (random logits, or ties constructed exactly);
 * gradients against finite differences at 1e-5 with a floor of 0.01 (the gradients are O(0.1)).
 *
 * Adversarial rows in every case: all logits equal (ids 0..k-1); a tied maximum (the lower id
 * first); a bias that selects an expert whose score is low (its weight is still its score,
 * without the bias); with groups, a single best expert in a group whose second-best is poor, so
 * that two groups of two good experts win (the best expert is NOT chosen); and an all-negative
 * bias, where the 0.0 of the groups not kept outranks every kept expert (transformers' masked_fill
 * with 0.0, which the op reproduces). */
#include "fm_test_ops_cpu.h"

typedef struct sg_st {
    double *logits;
    const int32_t *idx;
    const double *dw, *gpe;
    int64_t N, E, k;
    bool norm;
    double scaling;
} sg_st;

static double sg_obj(void *p) {
    const sg_st *s = p;
    return fm_ref_router_sigmoid_objective(s->logits, s->idx, s->dw, s->gpe, s->N, s->E, s->k, s->norm, s->scaling);
}

static void test_case(int64_t N, int64_t E, int64_t k, int64_t ng, int64_t tg, bool norm, float scaling) {
    float *logits = fnew(N * E), *scores = fnew(N * E), *lse = fnew(N), *tw = fnew(N * k), *bias = fnew(E);
    float *dw = fnew(N * k), *gpe = fnew(E), *dl = fnew(N * E);
    int32_t *idx = inew(N * k), *ridx = inew(N * k);
    fill_normal(logits, N * E, 2.0);
    fill_normal(bias, E, 0.1);
    const int64_t gs = E / ng;
    /* rows 0-2 are exact ties or constructed orders only under the zero bias (flat == 0 below) */
    for (int64_t e = 0; e < E; e++) logits[e] = 0.25f;
    for (int64_t e = 0; e < E; e++) logits[E + e] = -3.0f;
    logits[E + E - 1] = logits[E + 1] = 4.0f; /* tied maximum: 1 then E-1 (groups permitting) */
    if (ng > 1 && N > 3) { /* row 2: expert 0 (group 0) best alone; groups 1 and 2 two good ones each */
        for (int64_t e = 0; e < E; e++) logits[2 * E + e] = -6.0f;
        logits[2 * E + 0] = 6.0f;
        logits[2 * E + gs] = logits[2 * E + gs + 1] = 3.0f;
        logits[2 * E + 2 * gs] = logits[2 * E + 2 * gs + 1] = 3.0f;
    }
    char what[160];
    for (int flat = 0; flat < 3; flat++) { /* bias: 0 (ties exact), random, all -2 (masked 0.0 wins) */
        if (flat == 0) fill_const(bias, E, 0.0f);
        if (flat == 2) fill_const(bias, E, -2.0f);
        if (flat == 1) { fill_normal(bias, E, 0.1); bias[E - 2] = 5.0f; } /* expert E-2 chosen by its bias */
        snprintf(what, sizeof what, "sigmoid router N=%lld E=%lld k=%lld groups %lld/%lld norm=%d scale %g bias %s",
                 (long long)N, (long long)E, (long long)k, (long long)tg, (long long)ng, (int)norm, (double)scaling,
                 flat == 0 ? "zero" : flat == 1 ? "random" : "-2");
        poison(scores, N * E), poison(lse, N), poison(tw, N * k);
        for (int64_t i = 0; i < N * k; i++) idx[i] = -7;
        OPS->router_sigmoid_fwd(CTX, scores, lse, idx, tw, logits, bias, N, E, k, ng, tg, norm, scaling);
        double *ld = fm_ref_widen(logits, N * E), *bd = fm_ref_widen(bias, E), *rs = dnew(N * E), *rw = dnew(N * k);
        fm_ref_router_sigmoid(ridx, rw, rs, ld, bd, N, E, k, ng, tg, norm, scaling);
        CHECK_ERR(what, nerr(scores, rs, N * E, 1e-30), 1e-6);
        CHECK_MSG(!memcmp(ridx, idx, sizeof(int32_t) * (size_t)(N * k)), "%s: ids differ from the reference", what);
        CHECK_ERR(what, nerr(tw, rw, N * k, 1e-30), 1e-6);
        double *rl = dnew(N), *rp = dnew(N * E);
        fm_ref_softmax(rp, rl, ld, N, E);
        CHECK_ERR(what, nerr(lse, rl, N, 1.0), 1e-6);
        if (flat == 0) {
            bool all0 = true;
            for (int64_t j = 0; j < k; j++) all0 &= idx[j] == j;
            CHECK_MSG(all0, "%s: all-equal row: ids 0..k-1", what);
            if (ng == 1) CHECK_MSG(idx[k] == 1 && (k < 2 || idx[k + 1] == E - 1), "%s: tied max: 1 then E-1", what);
            if (ng > 1 && N > 3 && tg == 2) { /* the two groups of two good experts are the ones kept */
                bool has0 = false;
                for (int64_t j = 0; j < k; j++) has0 |= idx[2 * k + j] == 0;
                CHECK_MSG(!has0 && idx[2 * k] == gs, "%s: the best expert's group must lose to two "
                          "groups of two good experts (found %d first)", what, idx[2 * k]);
            }
        }
        if (flat == 1 && ng == 1) {
            bool has = false;
            for (int64_t n = 0; n < N; n++)
                for (int64_t j = 0; j < k; j++)
                    if (idx[n * k + j] == E - 2) {
                        has = true;
                        if (!norm) CHECK_CLOSE(tw[n * k + j], scaling * scores[n * E + E - 2], 1e-6);
                    }
            CHECK_MSG(has, "%s: a bias of 5 selects expert E-2", what);
        }
        /* backward: (a) top-k weights, (b) per-expert term, (c) both */
        fill_normal(dw, N * k, 1.0);
        for (int64_t e = 0; e < E; e++) gpe[e] = (float)(0.3 * rnd_normal());
        double *ddw = fm_ref_widen(dw, N * k), *dgpe = fm_ref_widen(gpe, E), *g = dnew(N * E);
        for (int c = 0; c < 3; c++) {
            poison(dl, N * E);
            OPS->router_sigmoid_bwd(CTX, dl, c != 1 ? dw : NULL, c != 0 ? gpe : NULL, scores, idx, N, E, k, norm,
                                    scaling);
            sg_st s = {ld, idx, c != 1 ? ddw : NULL, c != 0 ? dgpe : NULL, N, E, k, norm, scaling};
            to_d(g, dl, N * E);
            char w2[220];
            snprintf(w2, sizeof w2, "%s: bwd %s", what, c == 0 ? "topk_w" : c == 1 ? "per-expert" : "both");
            fd_check_ex(w2, sg_obj, &s, ld, N * E, g, 1e-5, 0.01, FD_H);
        }
        free(ld), free(bd), free(rs), free(rw), free(rl), free(rp), free(ddw), free(dgpe), free(g);
    }
    free(logits), free(scores), free(lse), free(tw), free(bias), free(dw), free(gpe), free(dl), free(idx), free(ridx);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20261207));
    CHECK(fm_cpu_backend_init(&g_be, 2, 128) == FM_OK);
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK(OPS->router_sigmoid_fwd && OPS->router_sigmoid_bwd);
    test_case(17, 8, 2, 1, 1, true, 1.0f);
    test_case(17, 8, 2, 1, 1, false, 2.5f);
    test_case(17, 8, 1, 1, 1, false, 1.0f);
    test_case(23, 16, 4, 4, 2, true, 2.5f);  /* groups: keep 2 of 4 */
    test_case(23, 16, 4, 4, 2, false, 1.0f);
    test_case(23, 16, 4, 4, 3, true, 1.0f);  /* keep 3 of 4 */
    test_case(9, 16, 8, 8, 4, true, 1.0f);   /* k = all experts of the kept groups */
    test_case(40, 64, 8, 8, 4, true, 2.5f);  /* DeepSeek-V3's shape, smaller */
    test_case(200, 64, 6, 1, 1, true, 1.0f); /* parallel path (N E >= 8192) */
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
