/* The sigmoid router's sequence-wise balance loss (fm_backend.h router_seq_aux_fwd / _bwd;
 * DeepSeek-V3 §2.1.2 eq. 17-20) of the CPU backend against a plain fp64 reference written here
 * from the paper's formula (segments found by comparing document starts, f_i and P_i computed as
 * written), and its backward against central finite differences of that reference in the logits
 * (scores = sigmoid(logits), the routes held fixed: the selection has no gradient).
 * Cases: one segment per row; packed documents of mixed lengths including one-token documents;
 * every token routed to the same k experts (the most unbalanced segment); E 8 and 64.
 * Tolerances: the forward reads fp32 scores that the reference takes as the same values widened,
 * so the two are the same double sums up to summation order: 1e-12 relative. The backward's
 * output is fp32 (one rounding of a double result) against an fp64 central difference with
 * h 1e-6: 1e-5 normalized, floor 1e-3 of the loss scale (as test_router_sigmoid.c). The backward
 * adds to dlogits: pre-filled with 2^-10, the increment is compared. */
#include "fm_test_ops_cpu.h"

typedef struct sa_st {
    const double *logits; /* [N,E] */
    const int32_t *idx, *doc;
    int64_t B, T, E, k;
    double coef;
} sa_st;

/* coef * sum over segments of sum_i f_i P_i at the given logits (fp64 sigmoid), plain. */
static double ref_loss(const double *logits, const int32_t *idx, const int32_t *doc, int64_t B, int64_t T, int64_t E,
                       int64_t k, double coef, bool scores_given, const float *scores) {
    double total = 0;
    for (int64_t r = 0; r < B; r++) {
        int64_t t = 0;
        while (t < T) {
            int64_t u = t + 1;
            while (doc && u < T && doc[r * T + u] == doc[r * T + t]) u++;
            if (!doc) u = T;
            const double Ts = (double)(u - t);
            for (int64_t i = 0; i < E; i++) {
                double cnt = 0, P = 0;
                for (int64_t n = r * T + t; n < r * T + u; n++) {
                    double z = 0;
                    for (int64_t j = 0; j < E; j++)
                        z += scores_given ? (double)scores[n * E + j] : 1.0 / (1.0 + exp(-logits[n * E + j]));
                    const double si = scores_given ? (double)scores[n * E + i] : 1.0 / (1.0 + exp(-logits[n * E + i]));
                    P += si / (z + 1e-20);
                    for (int64_t j = 0; j < k; j++) cnt += idx[n * k + j] == i;
                }
                total += ((double)E * cnt / ((double)k * Ts)) * (P / Ts);
            }
            t = u;
        }
    }
    return coef * total;
}

static double sa_obj(void *p) {
    const sa_st *s = p;
    return ref_loss(s->logits, s->idx, s->doc, s->B, s->T, s->E, s->k, s->coef, false, NULL);
}

/* docs: 0 rows, 1 documents of mixed lengths; skew: every token to experts 0..k-1. */
static void test_case(int64_t B, int64_t T, int64_t E, int64_t k, int docs, bool skew) {
    const int64_t N = B * T;
    float *logits = fnew(N * E), *scores = fnew(N * E), *dl = fnew(N * E);
    int32_t *idx = inew(N * k), *doc = inew(N);
    fill_normal(logits, N * E, 2.0);
    for (int64_t i = 0; i < N * E; i++) scores[i] = 1.0f / (1.0f + expf(-logits[i]));
    for (int64_t n = 0; n < N; n++) /* k distinct experts per token */
        for (int64_t j = 0; j < k; j++) {
            bool dup;
            do {
                idx[n * k + j] = skew ? (int32_t)j : (int32_t)fm_rng_below(&g_rng, (uint64_t)E);
                dup = false;
                for (int64_t i = 0; i < j; i++) dup |= idx[n * k + i] == idx[n * k + j];
            } while (dup);
        }
    int64_t n_seg = B;
    if (docs) { /* row r: documents of lengths 1, 3, 1, then runs of 2..6, the last cut by the row end */
        n_seg = 0;
        for (int64_t r = 0; r < B; r++) {
            const int64_t lens[4] = {1, 3, 1, 0};
            int64_t t = 0, d = 0;
            while (t < T) {
                const int64_t len = d < 3 ? lens[d] : 2 + (int64_t)fm_rng_below(&g_rng, 5);
                for (int64_t i = 0; i < len && t + i < T; i++) doc[r * T + t + i] = (int32_t)t;
                t += len;
                d++;
                n_seg++;
            }
        }
    }
    const int32_t *dp = docs ? doc : NULL;
    char what[160];
    snprintf(what, sizeof what, "seq aux B=%lld T=%lld E=%lld k=%lld %s%s (%lld segments)", (long long)B, (long long)T,
             (long long)E, (long long)k, docs ? "documents" : "rows", skew ? " all to experts 0..k-1" : "",
             (long long)n_seg);
    const double coef = 0.37;
    double term = -1;
    OPS->router_seq_aux_fwd(CTX, &term, scores, idx, dp, B, T, E, k, coef);
    const double want = ref_loss(NULL, idx, dp, B, T, E, k, coef, true, scores);
    CHECK_MSG(fabs(term - want) <= 1e-12 * fabs(want), "%s: forward %.17g, reference %.17g", what, term, want);
    if (skew) /* every route to 0..k-1: f_i = E/k there, 0 elsewhere; a loss over each segment's 1 */
        CHECK_MSG(term > 0, "%s: the skewed loss is %.3g", what, term);
    fill_const(dl, N * E, 0x1p-10f); /* small: the rounding of the sum stays far below the increments (~1e-3) */
    OPS->router_seq_aux_bwd(CTX, dl, scores, idx, dp, B, T, E, k, coef);
    double *g = dnew(N * E);
    minus_d(g, dl, 0x1p-10f, N * E);
    double *ld = fm_ref_widen(logits, N * E);
    sa_st st = {ld, idx, dp, B, T, E, k, coef};
    fd_check_ex(what, sa_obj, &st, ld, N * E, g, 1e-5, 1e-3 * coef, FD_H);
    free(g), free(ld);
    free(logits), free(scores), free(dl), free(idx), free(doc);
}

/* The loss is balanced-minimal: equal routes and equal scores give sum_i (E c/(k T)) (1/E) = 1
 * per segment, whatever E and k (f_i = 1 and P_i = 1/E): a closed form the op must hit. */
static void test_balanced(void) {
    const int64_t B = 2, T = 8, E = 8, k = 2, N = B * T;
    float *scores = fnew(N * E);
    int32_t *idx = inew(N * k);
    fill_const(scores, N * E, 0.3f);
    for (int64_t n = 0; n < N; n++) /* token t of a row: experts 2 (t mod 4), +1: each twice per row */
        for (int64_t j = 0; j < k; j++) idx[n * k + j] = (int32_t)(2 * ((n % T) % 4) + j);
    double term = -1;
    OPS->router_seq_aux_fwd(CTX, &term, scores, idx, NULL, B, T, E, k, 1.0);
    CHECK_MSG(fabs(term - (double)B) <= 1e-12, "balanced rows: loss %.17g, expected %lld (1 per row)", term,
              (long long)B);
    free(scores), free(idx);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20261208));
    CHECK(fm_cpu_backend_init(&g_be, 2, 128) == FM_OK);
    OPS = g_be.ops;
    CTX = g_be.ctx;
    CHECK(OPS->router_seq_aux_fwd && OPS->router_seq_aux_bwd);
    test_balanced();
    test_case(3, 7, 8, 2, 0, false);
    test_case(3, 16, 8, 2, 1, false);
    test_case(2, 16, 8, 2, 1, true);
    test_case(2, 12, 64, 6, 1, false);
    test_case(1, 5, 64, 8, 0, true);
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
