/* The MoE router (softmax over experts, top-k; Shazeer et al. 2017, arXiv 1701.06538) with the
 * load-balancing gradient of Switch Transformer (Fedus et al. 2021, arXiv 2101.03961, eq. 4-6)
 * and the router z-loss of ST-MoE (Zoph et al. 2022, arXiv 2202.08906, eq. 5), and the dropless
 * token permutation (a stable counting sort of routes by expert, as in MegaBlocks, Gale et al.
 * 2022, arXiv 2211.15841, and Megatron-Core's permute/unpermute).
 *
 * Layouts (fm_backend.h): logits, probs, dlogits [N,E]; lse [N]; topk_idx, topk_w, dtopk_w
 * [N,k]; route r = n*k + j; x [N,H]; xe, ye [R,H] in the expert-major permuted order.
 * All loops are parallel over tokens or over expert columns and keep a fixed summation order.
 */
#include "cpu_internal.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#define FM_CPU_PAR_MIN 8192

static inline int cpu_threads(void *ctx) { return ((const fm_cpu_ctx *)ctx)->threads; }

/* ---- router ------------------------------------------------------------------------------ */

/* Per token n: probs = softmax(logits[n]) in fp32 with the max subtracted, lse[n] =
 * max + log(sum exp(l - max)); topk_idx[n] = the k largest probs by repeated selection, each
 * pass taking the largest prob strictly after the previous pick in the order (prob descending,
 * id ascending), so ties go to the lower expert id and no marker array is needed (O(k E));
 * topk_w = those probs, divided by their sum (added in j order) when norm_topk. A NaN prob
 * sorts below every number, so NaN logits still give k distinct valid ids (and NaN weights,
 * which the trainer's non-finite check reports) instead of an abort. */
void fm_cpu_router_fwd(void *ctx, float *probs, float *lse, int32_t *topk_idx, float *topk_w,
                       const float *logits, int64_t N, int64_t E, int64_t k, bool norm_topk) {
    FM_ASSERT(E >= 1 && k >= 1 && k <= E && E <= INT32_MAX);
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (N * E >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *x = logits + n * E;
        float *p = probs + n * E;
        int32_t *idx = topk_idx + n * k;
        float *tw = topk_w + n * k;
        float mx = x[0];
        for (int64_t e = 1; e < E; e++) mx = x[e] > mx ? x[e] : mx;
        float s = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            p[e] = expf(x[e] - mx);
            s += p[e];
        }
        for (int64_t e = 0; e < E; e++) p[e] /= s;
        lse[n] = mx + logf(s);
        float prev_p = INFINITY;
        int64_t prev_id = -1;
        float wsum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            float best_p = 0.0f;
            for (int64_t e = 0; e < E; e++) {
                const float pe = p[e] == p[e] ? p[e] : -INFINITY; /* NaN sorts last */
                if (!(pe < prev_p || (pe == prev_p && e > prev_id))) continue; /* already taken */
                if (best < 0 || pe > best_p) {
                    best = e;
                    best_p = pe;
                }
            }
            FM_ASSERT(best >= 0); /* a strict total order over E >= k experts */
            idx[j] = (int32_t)best;
            tw[j] = p[best];
            wsum += p[best];
            prev_p = best_p;
            prev_id = best;
        }
        if (norm_topk)
            for (int64_t j = 0; j < k; j++) tw[j] /= wsum;
    }
}

/* dlogits [N,E] assigned, per token in double. With p = probs[n], the gradient reaching p is
 *   dp_e = g_e (dprobs_per_expert, 0 if NULL) + [e = idx_j] dsel_j,
 *   dsel_j = dtopk_w_j                                  (no renormalization), or
 *   dsel_j = (dtopk_w_j - sum_i dtopk_w_i w_i) / S      (w_j = p_j / S, S = sum_i p_{idx_i}),
 * then through the softmax dlogit_e = p_e (dp_e - sum_f p_f dp_f), plus the z-loss term
 * 2 z_scale lse[n] p_e. dtopk_w may be NULL (no top-k gradient). */
void fm_cpu_router_bwd(void *ctx, float *dlogits, const float *dtopk_w,
                       const float *dprobs_per_expert, float z_scale, const float *probs,
                       const float *lse, const int32_t *topk_idx, const float *topk_w, int64_t N,
                       int64_t E, int64_t k, bool norm_topk) {
    FM_ASSERT(E >= 1 && k >= 1 && k <= E);
    const float *gpe = dprobs_per_expert;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (N * E >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *p = probs + n * E;
        const int32_t *idx = topk_idx + n * k;
        const float *dw = dtopk_w ? dtopk_w + n * k : NULL;
        const float *tw = topk_w + n * k;
        float *dl = dlogits + n * E;
        double S = 0, dotw = 0;
        if (dw && norm_topk) {
            for (int64_t j = 0; j < k; j++) {
                S += p[idx[j]];
                dotw += (double)dw[j] * tw[j];
            }
        }
        /* dot = sum_f p_f dp_f */
        double dot = 0;
        if (gpe)
            for (int64_t e = 0; e < E; e++) dot += (double)p[e] * gpe[e];
        if (dw)
            for (int64_t j = 0; j < k; j++) {
                const double dsel = norm_topk ? ((double)dw[j] - dotw) / S : (double)dw[j];
                dot += (double)p[idx[j]] * dsel;
            }
        const double zt = 2.0 * (double)z_scale * (double)lse[n];
        for (int64_t e = 0; e < E; e++) {
            const double g = gpe ? gpe[e] : 0.0;
            dl[e] = (float)(p[e] * (g - dot + zt));
        }
        if (dw)
            for (int64_t j = 0; j < k; j++) {
                const int64_t e = idx[j];
                FM_ASSERT(e >= 0 && e < E);
                const double dsel = norm_topk ? ((double)dw[j] - dotw) / S : (double)dw[j];
                const double g = gpe ? gpe[e] : 0.0;
                dl[e] = (float)(p[e] * (g + dsel - dot + zt));
            }
    }
}

/* count[e] = number of routes to e (as float; exact below 2^24 per expert), prob_sum[e] =
 * sum_n probs[n,e] (double, n ascending), both assigned; *lse_sq = sum_n lse[n]^2 (double, n
 * ascending). Parallel over blocks of 16 experts, each scanning the tokens in order. */
void fm_cpu_router_stats(void *ctx, float *count, float *prob_sum, double *lse_sq, const float *probs,
                         const float *lse, const int32_t *topk_idx, int64_t N, int64_t E, int64_t k) {
    FM_ASSERT(E >= 1 && k >= 1);
    enum { EB = 16 };
    const int64_t nblk = (E + EB - 1) / EB;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (N * E >= FM_CPU_PAR_MIN)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t e0 = blk * EB, ne = e0 + EB < E ? EB : E - e0;
        double ps[EB];
        int64_t cnt[EB];
        for (int64_t c = 0; c < EB; c++) {
            ps[c] = 0;
            cnt[c] = 0;
        }
        for (int64_t n = 0; n < N; n++) {
            const float *p = probs + n * E + e0;
            for (int64_t c = 0; c < ne; c++) ps[c] += p[c];
            for (int64_t j = 0; j < k; j++) {
                const int64_t e = topk_idx[n * k + j] - e0;
                if (e >= 0 && e < ne) cnt[e]++;
            }
        }
        for (int64_t c = 0; c < ne; c++) {
            prob_sum[e0 + c] = (float)ps[c];
            count[e0 + c] = (float)cnt[c];
        }
    }
    double z = 0;
    for (int64_t n = 0; n < N; n++) z += (double)lse[n] * lse[n];
    *lse_sq = z;
}

/* terms[0] = E * sum_e (count_e / N) (prob_sum_e / N), e ascending; terms[1] = lse_sq / N. */
void fm_cpu_router_loss_terms(void *ctx, double *terms, const float *count, const float *prob_sum,
                              const double *lse_sq, int64_t N, int64_t E) {
    (void)ctx;
    double s = 0;
    for (int64_t e = 0; e < E; e++) s += ((double)count[e] / N) * ((double)prob_sum[e] / N);
    terms[0] = (double)E * s;
    terms[1] = *lse_sq / (double)N;
}

/* dprobs[e] = (float)(coef * E * (count_e / N) / N), in double. */
void fm_cpu_router_aux_grad(void *ctx, float *dprobs, const float *count, double coef, int64_t N, int64_t E) {
    (void)ctx;
    for (int64_t e = 0; e < E; e++) dprobs[e] = (float)(coef * (double)E * ((double)count[e] / N) / (double)N);
}

/* ---- dropless permutation ---------------------------------------------------------------- */

/* Stable counting sort of the R = N*k routes by expert: offsets [E+1] (offsets[e] = number of
 * routes to experts < e), row_route [R] (permuted row -> route, routes of one expert in
 * increasing order), route_row [R] (its inverse). Sequential, O(R + E): the offsets double as
 * the insertion cursors and are shifted back afterwards, so no scratch is needed. */
void fm_cpu_moe_route_index(void *ctx, int64_t *offsets, int32_t *row_route, int32_t *route_row,
                            const int32_t *topk_idx, int64_t N, int64_t E, int64_t k) {
    (void)ctx;
    const int64_t R = N * k;
    FM_ASSERT(E >= 1 && k >= 1 && R <= INT32_MAX);
    for (int64_t e = 0; e <= E; e++) offsets[e] = 0;
    for (int64_t r = 0; r < R; r++) {
        const int32_t e = topk_idx[r];
        FM_ASSERT(e >= 0 && e < E);
        offsets[e + 1]++;
    }
    for (int64_t e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    /* offsets[e] is now the start of e; use it as e's cursor. */
    for (int64_t r = 0; r < R; r++) {
        const int64_t row = offsets[topk_idx[r]]++;
        row_route[row] = (int32_t)r;
        route_row[r] = (int32_t)row;
    }
    /* Each cursor ended at the start of the next expert: shift back by one expert. */
    for (int64_t e = E; e > 0; e--) offsets[e] = offsets[e - 1];
    offsets[0] = 0;
}

/* xe[r,:] = x[row_route[r]/k, :]; xe [R,H], x [N,H]. A row copy per permuted row. */
void fm_cpu_moe_gather(void *ctx, float *xe, const float *x, const int32_t *row_route, int64_t R,
                       int64_t k, int64_t H) {
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (R * H >= FM_CPU_PAR_MIN)
    for (int64_t r = 0; r < R; r++)
        memcpy(xe + r * H, x + (int64_t)(row_route[r] / k) * H, (size_t)H * sizeof(float));
}

/* dx[n,:] = sum_j dxe[route_row[n*k+j],:] (assigned, j ascending); parallel over tokens. */
void fm_cpu_moe_gather_bwd(void *ctx, float *dx, const float *dxe, const int32_t *route_row,
                           int64_t N, int64_t k, int64_t H) {
#pragma omp parallel for num_threads(cpu_threads(ctx)) \
    schedule(static) if (N * k * H >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        float *d = dx + n * H;
        memcpy(d, dxe + (int64_t)route_row[n * k] * H, (size_t)H * sizeof(float));
        for (int64_t j = 1; j < k; j++) {
            const float *s = dxe + (int64_t)route_row[n * k + j] * H;
            for (int64_t h = 0; h < H; h++) d[h] += s[h];
        }
    }
}

/* out[n,:] = sum_j topk_w[n*k+j] * ye[route_row[n*k+j],:] (assigned, j ascending). */
void fm_cpu_moe_combine_fwd(void *ctx, float *out, const float *ye, const float *topk_w,
                            const int32_t *route_row, int64_t N, int64_t k, int64_t H) {
#pragma omp parallel for num_threads(cpu_threads(ctx)) \
    schedule(static) if (N * k * H >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        float *o = out + n * H;
        const float w0 = topk_w[n * k];
        const float *y0 = ye + (int64_t)route_row[n * k] * H;
        for (int64_t h = 0; h < H; h++) o[h] = w0 * y0[h];
        for (int64_t j = 1; j < k; j++) {
            const float w = topk_w[n * k + j];
            const float *y = ye + (int64_t)route_row[n * k + j] * H;
            for (int64_t h = 0; h < H; h++) o[h] += w * y[h];
        }
    }
}

/* dye[route_row[n*k+j],:] = topk_w[n*k+j] * dout[n,:] and dtopk_w[n*k+j] =
 * dot(dout[n,:], ye[route_row[n*k+j],:]) (the dot in double), both assigned. Each permuted row
 * belongs to exactly one route, so the token-parallel loop writes disjoint rows. */
void fm_cpu_moe_combine_bwd(void *ctx, float *dye, float *dtopk_w, const float *dout,
                            const float *ye, const float *topk_w, const int32_t *route_row,
                            int64_t N, int64_t k, int64_t H) {
#pragma omp parallel for num_threads(cpu_threads(ctx)) \
    schedule(static) if (N * k * H >= FM_CPU_PAR_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *g = dout + n * H;
        for (int64_t j = 0; j < k; j++) {
            const int64_t row = route_row[n * k + j];
            const float w = topk_w[n * k + j];
            const float *y = ye + row * H;
            float *d = dye + row * H;
            double dot = 0;
            for (int64_t h = 0; h < H; h++) {
                d[h] = w * g[h];
                dot += (double)g[h] * y[h];
            }
            dtopk_w[n * k + j] = (float)dot;
        }
    }
}
