/* DeepSeek-V2's router op of the CPU backend (fm_backend.h router_softmax_group_fwd / _bwd) against a
 * plain fp64 reference (tests/fm_ref_ops.c fm_ref_router_softmax_group, shared with the GPU test)
 * written from transformers' DeepseekV2Moe.route_tokens_to_experts (modeling_deepseek_v2.py):
 * router_logits.softmax(fp32); "greedy": torch.topk(scores, k);
 * "group_limited_greedy": group_scores = scores.view(N, n_group, -1).max(-1), the topk_group groups
 * of torch.topk(group_scores), the other groups' scores masked_fill'ed with 0.0, torch.topk(k) of
 * those; topk_weight = the chosen (masked) scores * routed_scaling_factor, no renormalization.
 *
 * torch.topk(sorted=False) leaves the order of its result and its tie-breaking unspecified, so the
 * reference's ids are compared as a set with the op's, and only on rows whose fp64 margins are
 * clear: the topk_group-th group score above the next by more than 1e-5 relative, and the k-th
 * chosen score above the next likewise (fp32 rounds a probability by ~6e-8 relative; a smaller
 * margin could order the fp32 and fp64 values differently). The rows skipped are counted and
 * printed, and each case must check most of its rows. The op's own order (decreasing, ties to the
 * lower id) is checked on every row, and exactly on constructed ties. Weights within 1e-6
 * normalized of the reference (fp32 softmax against fp64); probs and lse likewise.
 *
 * Also: "greedy" with scaling 1 is router_fwd's bits (the same softmax; the top-k order is the same
 * total order); an adversarial row where the third-best expert is in a group not kept (so it is NOT
 * chosen, unlike plain top-k); the backward against central finite differences of the fp64
 * objective sum_j dw_j scaling p_{idx_j} + sum_n,e g_e p_{n,e} + z sum_n lse_n^2 with the selection
 * held fixed (tolerances as tests/test_router_sigmoid.c: 1e-5 with a floor of 0.01). */
#include "fm_test_ops_cpu.h"

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

static void test_case(int64_t N, int64_t E, int64_t k, int64_t ng, int64_t tg, float scaling) {
    float *logits = fnew(N * E), *probs = fnew(N * E), *lse = fnew(N), *tw = fnew(N * k);
    float *dw = fnew(N * k), *gpe = fnew(E), *dl = fnew(N * E);
    int32_t *idx = inew(N * k);
    fill_normal(logits, N * E, 2.0);
    const int64_t gs = E / ng;
    for (int64_t e = 0; e < E; e++) logits[e] = 0.25f; /* row 0: all equal */
    if (ng > 1 && gs >= 2 && tg == 2 && k == 3 && ng >= 3) { /* row 1: the third-best expert's group is not kept */
        for (int64_t e = 0; e < E; e++) logits[E + e] = -1.0f;
        logits[E + 0] = 6.0f;          /* group 0's best: the best overall */
        logits[E + gs] = 5.0f;         /* group 1's best */
        logits[E + 2 * gs] = 4.0f;     /* group 2's best: third overall, its group third */
        logits[E + 1] = 0.5f;          /* group 0's second: chosen third */
    }
    char what[160];
    snprintf(what, sizeof what, "deepseek_v2 router N=%lld E=%lld k=%lld groups %lld/%lld scale %g", (long long)N,
             (long long)E, (long long)k, (long long)tg, (long long)ng, (double)scaling);
    poison(probs, N * E), poison(lse, N), poison(tw, N * k);
    for (int64_t i = 0; i < N * k; i++) idx[i] = -7;
    OPS->router_softmax_group_fwd(CTX, probs, lse, idx, tw, logits, N, E, k, ng, tg, scaling);
    double *ld = fm_ref_widen(logits, N * E), *rp = dnew(N * E), *rl = dnew(N), *rw = dnew(E), *pr = dnew(E);
    bool *in = calloc((size_t)E, sizeof(bool));
    fm_ref_softmax(rp, rl, ld, N, E);
    CHECK_ERR(what, nerr(probs, rp, N * E, 1e-30), 1e-6);
    CHECK_ERR(what, nerr(lse, rl, N, 1.0), 1e-6);
    int64_t skipped = 0, wrong = 0;
    double werr = 0;
    for (int64_t n = 0; n < N; n++) {
        const int32_t *id = idx + n * k;
        for (int64_t j = 0; j < k; j++) { /* the op's order: decreasing prob among its choices, ties to the lower id */
            CHECK_MSG(id[j] >= 0 && id[j] < E, "%s: row %lld: id %d", what, (long long)n, id[j]);
            if (j > 0)
                CHECK_MSG(probs[n * E + id[j - 1]] > probs[n * E + id[j]] ||
                              (probs[n * E + id[j - 1]] == probs[n * E + id[j]] && id[j - 1] < id[j]),
                          "%s: row %lld: ids not in the op's order", what, (long long)n);
            CHECK_MSG(tw[n * k + j] == probs[n * E + id[j]] * scaling, "%s: row %lld: weight is not prob x scaling",
                      what, (long long)n);
        }
        const double margin = fm_ref_router_softmax_group(ld + n * E, E, k, ng, tg, scaling, pr, in, rw);
        if (!(margin > 1e-5)) { skipped++; continue; }
        for (int64_t j = 0; j < k; j++) {
            if (!in[id[j]]) wrong++;
            else werr = fmax(werr, fabs(tw[n * k + j] - rw[id[j]]) / (scaling * 1.0));
        }
    }
    printf("%s: %lld of %lld rows checked against transformers' formulas (%lld skipped: fp64 margin <= 1e-5), "
           "max weight error %.3g\n", what, (long long)(N - skipped), (long long)N, (long long)skipped, werr);
    CHECK_MSG(wrong == 0, "%s: %lld chosen ids are not transformers'", what, (long long)wrong);
    CHECK_MSG(werr <= 1e-6, "%s: weights differ from the reference by %g", what, werr);
    CHECK_MSG(skipped <= 1 + N / 10, "%s: %lld rows skipped of %lld: too few checked", what, (long long)skipped,
              (long long)N);
    /* constructed rows: all equal -> the first topk_group groups' experts in id order; row 1 */
    for (int64_t j = 0; j < k; j++) CHECK_MSG(idx[j] == j, "%s: all-equal row: ids 0..k-1 (found %d at %lld)", what, idx[j], (long long)j);
    if (ng > 1 && gs >= 2 && tg == 2 && k == 3 && ng >= 3)
        CHECK_MSG(idx[k] == 0 && idx[k + 1] == gs && idx[k + 2] == 1,
                  "%s: row 1: expected experts 0, %lld, 1 (the third-best %lld's group dropped), found %d %d %d", what,
                  (long long)gs, (long long)(2 * gs), idx[k], idx[k + 1], idx[k + 2]);
    /* greedy with scaling 1: router_fwd's bits */
    if (ng == 1 && scaling == 1.0f) {
        float *p2 = fnew(N * E), *l2 = fnew(N), *w2 = fnew(N * k);
        int32_t *i2 = inew(N * k);
        OPS->router_fwd(CTX, p2, l2, i2, w2, logits, N, E, k, false);
        CHECK_MSG(!memcmp(p2, probs, sizeof(float) * (size_t)(N * E)) && !memcmp(l2, lse, sizeof(float) * (size_t)N) &&
                      !memcmp(i2, idx, sizeof(int32_t) * (size_t)(N * k)) && !memcmp(w2, tw, sizeof(float) * (size_t)(N * k)),
                  "%s: greedy with scaling 1 is not router_fwd's bits", what);
        free(p2), free(l2), free(w2), free(i2);
    }
    /* backward: (a) top-k weights, (b) per-expert term, (c) both with the z-loss */
    fill_normal(dw, N * k, 1.0);
    for (int64_t e = 0; e < E; e++) gpe[e] = (float)(0.3 * rnd_normal());
    double *ddw = fm_ref_widen(dw, N * k), *dgpe = fm_ref_widen(gpe, E), *g = dnew(N * E);
    for (int c = 0; c < 3; c++) {
        const float z = c == 2 ? 0.05f : 0.0f;
        poison(dl, N * E);
        OPS->router_softmax_group_bwd(CTX, dl, c != 1 ? dw : NULL, c != 0 ? gpe : NULL, z, probs, lse, idx, N, E, k,
                                      scaling);
        obj_st s = {ld, idx, c != 1 ? ddw : NULL, c != 0 ? dgpe : NULL, z, scaling, N, E, k};
        to_d(g, dl, N * E);
        char w2[220];
        snprintf(w2, sizeof w2, "%s: bwd %s", what, c == 0 ? "topk_w" : c == 1 ? "per-expert" : "both + z");
        fd_check_ex(w2, obj, &s, ld, N * E, g, 1e-5, 0.01, FD_H);
    }
    free(ld), free(rp), free(rl), free(rw), free(pr), free(in), free(ddw), free(dgpe), free(g);
    free(logits), free(probs), free(lse), free(tw), free(dw), free(gpe), free(dl), free(idx);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20261208));
    CHECK(fm_cpu_backend_init(&g_be, 2, 128) == FM_OK);
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK(OPS->router_softmax_group_fwd && OPS->router_softmax_group_bwd);
    test_case(31, 8, 2, 1, 1, 1.0f);       /* greedy */
    test_case(31, 8, 3, 4, 2, 16.0f);      /* group-limited: keep 2 of 4 groups of 2 (tests/data/deepseek_v2_tiny.json) */
    test_case(31, 16, 4, 4, 3, 2.5f);      /* keep 3 of 4 */
    test_case(9, 16, 8, 4, 2, 1.0f);       /* k = all experts of the kept groups */
    test_case(64, 64, 6, 1, 1, 1.0f);      /* DeepSeek-V2-Lite's router: greedy over 64, k 6 */
    test_case(48, 160, 6, 8, 3, 16.0f);    /* DeepSeek-V2's: 160 experts, 8 groups keep 3, scaling 16 */
    test_case(200, 64, 6, 8, 3, 1.0f);     /* parallel path (N E >= 8192) */
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
