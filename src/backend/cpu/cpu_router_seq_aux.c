/* The CPU backend's sequence-wise balance loss of the sigmoid router (fm_backend.h
 * router_seq_aux_fwd / router_seq_aux_bwd: DeepSeek-V3, arXiv 2412.19437 §2.1.2 eq. 17-20, the
 * complementary sequence-wise balance loss; Megatron-Core's seq_aux_loss), over the rows of a
 * micro-batch or, with packed documents, over each document. Serial and in double: the loss is
 * O(N E), small beside the router GEMM, and one fixed order gives the same bits at every thread
 * count. The per-segment sums live on the stack ([E] counts and normalized-score sums, E <=
 * FM_ROUTER_MAX_SEQ_AUX_E): nothing allocated. The CUDA twin is cuda_router_seq_aux.cu. */
#include "cpu_internal.h"

/* The end of the segment that starts at row-local token t of row r (doc_start NULL: the row). */
static int64_t seg_end(const int32_t *doc_start, int64_t r, int64_t T, int64_t t) {
    if (!doc_start) return T;
    const int32_t *d = doc_start + r * T;
    int64_t u = t + 1;
    while (u < T && d[u] == d[t]) u++;
    return u;
}

/* The routes of tokens [n0, n0 + Ts) to each expert into c [E]. */
static void seg_counts(const int32_t *topk_idx, int64_t n0, int64_t Ts, int64_t E, int64_t k, double *c) {
    for (int64_t e = 0; e < E; e++) c[e] = 0;
    for (int64_t n = n0; n < n0 + Ts; n++)
        for (int64_t j = 0; j < k; j++) {
            const int32_t e = topk_idx[n * k + j];
            FM_ASSERT(e >= 0 && e < E);
            c[e] += 1;
        }
}

/* sum_j scores[n, j] + 1e-20 in double, j ascending. */
static double score_sum(const float *s, int64_t E) {
    double z = 0;
    for (int64_t e = 0; e < E; e++) z += s[e];
    return z + 1e-20;
}

void fm_cpu_router_seq_aux_fwd(void *ctx, double *term, const float *scores, const int32_t *topk_idx,
                               const int32_t *doc_start, int64_t B, int64_t T, int64_t E, int64_t k, double coef) {
    (void)ctx;
    FM_ASSERT(E >= 1 && E <= FM_ROUTER_MAX_SEQ_AUX_E && k >= 1 && k <= E && B >= 0 && T >= 1);
    double c[E], p[E];
    double sum = 0;
    for (int64_t r = 0; r < B; r++)
        for (int64_t t = 0; t < T;) {
            const int64_t u = seg_end(doc_start, r, T, t), Ts = u - t, n0 = r * T + t;
            seg_counts(topk_idx, n0, Ts, E, k, c);
            for (int64_t e = 0; e < E; e++) p[e] = 0;
            for (int64_t n = n0; n < n0 + Ts; n++) {
                const float *s = scores + n * E;
                const double z = score_sum(s, E);
                for (int64_t e = 0; e < E; e++) p[e] += (double)s[e] / z;
            }
            double l = 0; /* sum_i f_i P_i, f_i = E c_i / (k Ts), P_i = p_i / Ts */
            for (int64_t e = 0; e < E; e++) l += ((double)E * c[e] / ((double)k * (double)Ts)) * (p[e] / (double)Ts);
            sum += l;
            t = u;
        }
    *term = coef * sum;
}

void fm_cpu_router_seq_aux_bwd(void *ctx, float *dlogits, const float *scores, const int32_t *topk_idx,
                               const int32_t *doc_start, int64_t B, int64_t T, int64_t E, int64_t k, double coef) {
    (void)ctx;
    FM_ASSERT(E >= 1 && E <= FM_ROUTER_MAX_SEQ_AUX_E && k >= 1 && k <= E && B >= 0 && T >= 1);
    double g[E];
    for (int64_t r = 0; r < B; r++)
        for (int64_t t = 0; t < T;) {
            const int64_t u = seg_end(doc_start, r, T, t), Ts = u - t, n0 = r * T + t;
            seg_counts(topk_idx, n0, Ts, E, k, g);
            const double gs = (double)E / ((double)k * (double)Ts * (double)Ts); /* d l_s / d sh_i = gs c_i */
            for (int64_t e = 0; e < E; e++) g[e] *= gs;
            for (int64_t n = n0; n < n0 + Ts; n++) {
                const float *s = scores + n * E;
                float *dl = dlogits + n * E;
                const double z = score_sum(s, E);
                double dot = 0; /* sum_i g_i sh_i */
                for (int64_t e = 0; e < E; e++) dot += g[e] * ((double)s[e] / z);
                for (int64_t e = 0; e < E; e++) {
                    const double se = s[e];
                    dl[e] += (float)(coef * se * (1.0 - se) * (g[e] - dot) / z);
                }
            }
            t = u;
        }
}
