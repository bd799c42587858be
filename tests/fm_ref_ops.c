/* fp64 references of the backend ops (fm_ref_ops.h). Naive loops, straight from each op's
 * definition in src/backend/fm_backend.h; no code shared with any backend. */
#include "fm_ref_ops.h"

#include "backend/fm_adamw_lowp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static double *dalloc0(int64_t n) {
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    if (!p) abort();
    return p;
}

double *fm_ref_widen(const float *x, int64_t n) {
    double *d = dalloc0(n);
    for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

void fm_ref_gemm(double *C, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const double *A, int64_t lda,
                 const double *B, int64_t ldb) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0;
            for (int64_t p = 0; p < K; p++) {
                const double a = ta ? A[p * lda + i] : A[i * lda + p];
                const double b = tb ? B[j * ldb + p] : B[p * ldb + j];
                s += a * b;
            }
            C[i * N + j] = s;
        }
}

void fm_ref_expert_linear_fwd(double *y, const double *x, const double *W, const int64_t *off, int64_t E, int64_t in,
                              int64_t out) {
    for (int64_t e = 0; e < E; e++) {
        const double *We = W + e * out * in;
        for (int64_t r = off[e]; r < off[e + 1]; r++)
            for (int64_t o = 0; o < out; o++) {
                double t = 0;
                for (int64_t i = 0; i < in; i++) t += x[r * in + i] * We[o * in + i];
                y[r * out + o] = t;
            }
    }
}

void fm_ref_expert_linear_bwd(double *dx, double *dW, const double *dy, const double *x, const double *W,
                              const int64_t *off, int64_t E, int64_t in, int64_t out) {
    for (int64_t e = 0; e < E; e++) {
        const double *We = W + e * out * in;
        double *dWe = dW + e * out * in;
        for (int64_t r = off[e]; r < off[e + 1]; r++) {
            if (dx)
                for (int64_t i = 0; i < in; i++) {
                    double t = 0;
                    for (int64_t o = 0; o < out; o++) t += dy[r * out + o] * We[o * in + i];
                    dx[r * in + i] = t;
                }
            for (int64_t o = 0; o < out; o++)
                for (int64_t i = 0; i < in; i++) dWe[o * in + i] += dy[r * out + o] * x[r * in + i];
        }
    }
}

void fm_ref_embedding_bwd(double *dwte, const double *dout, const int32_t *tokens, int64_t N, int64_t H) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < H; j++) dwte[(int64_t)tokens[n] * H + j] += dout[n * H + j];
}

static double rms_rstd(const double *x, int64_t D, double eps) {
    double ss = 0;
    for (int64_t j = 0; j < D; j++) ss += x[j] * x[j];
    return 1.0 / sqrt(ss / (double)D + eps);
}

void fm_ref_rmsnorm_fwd(double *out, double *rstd, const double *x, const double *w, int64_t N, int64_t D,
                        double eps) {
    for (int64_t n = 0; n < N; n++) {
        const double r = rms_rstd(x + n * D, D, eps);
        if (rstd) rstd[n] = r;
        if (out)
            for (int64_t j = 0; j < D; j++) out[n * D + j] = x[n * D + j] * r * w[j];
    }
}

void fm_ref_rmsnorm_bwd(double *dx, double *dw, const double *dout, const double *x, const double *w, int64_t N,
                        int64_t D, double eps) {
    if (dw)
        for (int64_t j = 0; j < D; j++) dw[j] = 0;
    for (int64_t n = 0; n < N; n++) {
        const double *xr = x + n * D, *g = dout + n * D;
        const double r = rms_rstd(xr, D, eps);
        double dot = 0;
        for (int64_t j = 0; j < D; j++) {
            dot += g[j] * w[j] * xr[j];
            if (dw) dw[j] += g[j] * xr[j] * r;
        }
        if (dx)
            for (int64_t j = 0; j < D; j++) dx[n * D + j] = r * w[j] * g[j] - xr[j] * r * r * r * dot / (double)D;
    }
}

void fm_ref_rope(double *y, const double *x, const float *cos_tab, const float *sin_tab, int64_t B, int64_t T,
                 int64_t nh, int64_t hd, int64_t rd, double sign) {
    const int64_t half = rd / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < nh; h++) {
                const double *a = x + ((b * T + t) * nh + h) * hd;
                double *o = y + ((b * T + t) * nh + h) * hd;
                for (int64_t i = 0; i < half; i++) {
                    const double c = cos_tab[t * half + i], s = sign * (double)sin_tab[t * half + i];
                    o[i] = a[i] * c - a[i + half] * s;
                    o[i + half] = a[i + half] * c + a[i] * s;
                }
                for (int64_t i = rd; i < hd; i++) o[i] = a[i]; /* passed through */
            }
}

void fm_ref_attention_row(const fm_ref_att *a, int64_t b, int64_t h, int64_t t, double *o, double *lse, double *dq,
                          double *dk, double *dv, double *scratch) {
    const int64_t hd = a->hd, nh = a->nh, nkv = a->nkv, T = a->T, g = h / (nh / nkv);
    const double scale = 1.0 / sqrt((double)hd);
    double *s = scratch, *dp = scratch + T;
    const double *qr = a->q + ((b * T + t) * nh + h) * hd;
    double m = -INFINITY;
    const int64_t j0 = a->kv_start ? a->kv_start[b * T + t] : 0; /* packed documents: t's first key */
    for (int64_t j = j0; j <= t; j++) {
        const double *kr = a->k + ((b * T + j) * nkv + g) * hd;
        double d = 0;
        for (int64_t i = 0; i < hd; i++) d += qr[i] * kr[i];
        s[j] = d * scale;
        if (s[j] > m) m = s[j];
    }
    double sum = 0;
    for (int64_t j = j0; j <= t; j++) sum += (s[j] = exp(s[j] - m));
    for (int64_t i = 0; i < hd; i++) o[i] = 0;
    for (int64_t j = j0; j <= t; j++) {
        s[j] /= sum; /* the softmax probability of key j */
        const double *vr = a->v + ((b * T + j) * nkv + g) * hd;
        for (int64_t i = 0; i < hd; i++) o[i] += s[j] * vr[i];
    }
    *lse = m + log(sum);
    if (!dq) return;
    const double *dor = a->dout + ((b * T + t) * nh + h) * hd;
    double D = 0; /* sum_j p_j dp_j = dot(dout, o) */
    for (int64_t j = j0; j <= t; j++) {
        const double *vr = a->v + ((b * T + j) * nkv + g) * hd;
        double d = 0;
        for (int64_t i = 0; i < hd; i++) d += dor[i] * vr[i];
        dp[j] = d;
        D += s[j] * d;
    }
    for (int64_t i = 0; i < hd; i++) dq[i] = 0;
    for (int64_t j = j0; j <= t; j++) {
        const double ds = s[j] * (dp[j] - D) * scale; /* dL/dscore_j times the scale */
        const int64_t ko = ((b * T + j) * nkv + g) * hd;
        for (int64_t i = 0; i < hd; i++) dq[i] += ds * a->k[ko + i];
        if (dk && dv)
            for (int64_t i = 0; i < hd; i++) {
                dk[ko + i] += ds * qr[i];
                dv[ko + i] += s[j] * dor[i];
            }
    }
}

void fm_ref_attention_fwd(double *out, double *lse, const fm_ref_att *a) {
    double *scratch = dalloc0(2 * a->T);
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->nh; h++)
            for (int64_t t = 0; t < a->T; t++) {
                double l;
                fm_ref_attention_row(a, b, h, t, out + ((b * a->T + t) * a->nh + h) * a->hd, &l, NULL, NULL, NULL,
                                     scratch);
                if (lse) lse[(b * a->nh + h) * a->T + t] = l;
            }
    free(scratch);
}

double fm_ref_silu(double g) { return g / (1.0 + exp(-g)); }

void fm_ref_swiglu_fwd(double *out, const double *gate, const double *up, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = fm_ref_silu(gate[i]) * up[i];
}

void fm_ref_swiglu_bwd(double *dgate, double *dup, const double *dout, const double *gate, const double *up,
                       int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const double g = gate[i], sg = 1.0 / (1.0 + exp(-g));
        dgate[i] = dout[i] * up[i] * sg * (1.0 + g * (1.0 - sg));
        dup[i] = dout[i] * g * sg;
    }
}

void fm_ref_softmax(double *probs, double *lse, const double *logits, int64_t N, int64_t E) {
    for (int64_t n = 0; n < N; n++) {
        const double *x = logits + n * E;
        double m = x[0], s = 0;
        for (int64_t e = 1; e < E; e++) m = x[e] > m ? x[e] : m;
        for (int64_t e = 0; e < E; e++) s += exp(x[e] - m);
        for (int64_t e = 0; e < E; e++) probs[n * E + e] = exp(x[e] - m) / s;
        if (lse) lse[n] = m + log(s);
    }
}

void fm_ref_topk(int32_t *idx, const double *probs, int64_t N, int64_t E, int64_t k) {
    for (int64_t n = 0; n < N; n++) {
        const double *p = probs + n * E;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            double bp = 0;
            for (int64_t e = 0; e < E; e++) {
                bool used = false;
                for (int64_t i = 0; i < j; i++) used |= idx[n * k + i] == e;
                if (used) continue;
                const double pe = isnan(p[e]) ? -INFINITY : p[e];
                if (best < 0 || pe > bp) { /* strictly greater: ties keep the lower id */
                    best = e;
                    bp = pe;
                }
            }
            idx[n * k + j] = (int32_t)best;
        }
    }
}

void fm_ref_topk_weights(double *w, const double *probs, const int32_t *idx, int64_t N, int64_t E, int64_t k,
                         bool norm) {
    for (int64_t n = 0; n < N; n++) {
        double S = 0;
        for (int64_t j = 0; j < k; j++) S += probs[n * E + idx[n * k + j]];
        for (int64_t j = 0; j < k; j++) w[n * k + j] = probs[n * E + idx[n * k + j]] / (norm ? S : 1.0);
    }
}

double fm_ref_router_stats(double *count, double *prob_sum, const double *probs, const double *lse,
                           const int32_t *idx, int64_t N, int64_t E, int64_t k) {
    double z = 0;
    for (int64_t e = 0; e < E; e++) count[e] = prob_sum[e] = 0;
    for (int64_t n = 0; n < N; n++) {
        for (int64_t j = 0; j < k; j++) count[idx[n * k + j]] += 1;
        for (int64_t e = 0; e < E; e++) prob_sum[e] += probs[n * E + e];
        z += lse[n] * lse[n];
    }
    return z;
}

void fm_ref_router_loss_terms(double terms[2], const double *count, const double *prob_sum, double lse_sq, int64_t N,
                              int64_t E) {
    double s = 0;
    for (int64_t e = 0; e < E; e++) s += count[e] * prob_sum[e];
    terms[0] = (double)E * s / ((double)N * (double)N);
    terms[1] = lse_sq / (double)N;
}

void fm_ref_router_aux_grad(double *g, const double *count, double coef, int64_t N, int64_t E) {
    for (int64_t e = 0; e < E; e++) g[e] = coef * (double)E * count[e] / ((double)N * (double)N);
}

double fm_ref_router_objective(const fm_ref_router_loss *s, const double *logits, double *probs, double *lse) {
    fm_ref_softmax(probs, lse, logits, s->N, s->E);
    double L = 0;
    for (int64_t n = 0; n < s->N; n++) {
        const double *pr = probs + n * s->E;
        double S = 0;
        for (int64_t j = 0; j < s->k; j++) S += pr[s->idx[n * s->k + j]];
        if (s->dw)
            for (int64_t j = 0; j < s->k; j++)
                L += s->dw[n * s->k + j] * pr[s->idx[n * s->k + j]] / (s->norm ? S : 1.0);
        if (s->gpe)
            for (int64_t e = 0; e < s->E; e++) L += s->gpe[e] * pr[e];
        L += s->z * lse[n] * lse[n];
    }
    return L;
}

void fm_ref_router_bwd(double *g, const fm_ref_router_loss *s, const double *probs, const double *lse) {
    const int64_t N = s->N, E = s->E, k = s->k;
    double *dp = dalloc0(E);
    for (int64_t n = 0; n < N; n++) {
        const double *p = probs + n * E;
        const int32_t *idx = s->idx + n * k;
        for (int64_t e = 0; e < E; e++) dp[e] = s->gpe ? s->gpe[e] : 0.0; /* dL/dprobs */
        if (s->dw) {
            double S = 0, dotw = 0;
            for (int64_t j = 0; j < k; j++) S += p[idx[j]];
            for (int64_t j = 0; j < k; j++) dotw += s->dw[n * k + j] * p[idx[j]] / S;
            for (int64_t j = 0; j < k; j++) dp[idx[j]] += s->norm ? (s->dw[n * k + j] - dotw) / S : s->dw[n * k + j];
        }
        double dot = 0;
        for (int64_t e = 0; e < E; e++) dot += p[e] * dp[e];
        for (int64_t e = 0; e < E; e++) g[n * E + e] = p[e] * (dp[e] - dot) + 2.0 * s->z * lse[n] * p[e];
    }
    free(dp);
}

void fm_ref_route_index(int64_t *offsets, int32_t *row_route, int32_t *route_row, const int32_t *idx, int64_t N,
                        int64_t E, int64_t k) {
    const int64_t R = N * k;
    for (int64_t e = 0; e <= E; e++) offsets[e] = 0;
    for (int64_t r = 0; r < R; r++) offsets[idx[r] + 1]++;
    for (int64_t e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    int64_t *cur = calloc((size_t)(E + 1), sizeof(int64_t));
    if (!cur) abort();
    memcpy(cur, offsets, (size_t)E * sizeof(int64_t));
    for (int64_t r = 0; r < R; r++) {
        const int64_t row = cur[idx[r]]++;
        row_route[row] = (int32_t)r;
        route_row[r] = (int32_t)row;
    }
    free(cur);
}

void fm_ref_moe_gather_bwd(double *dx, const double *dxe, const int32_t *route_row, int64_t N, int64_t k, int64_t H) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < H; h++) {
            double s = 0;
            for (int64_t j = 0; j < k; j++) s += dxe[(int64_t)route_row[n * k + j] * H + h];
            dx[n * H + h] = s;
        }
}

void fm_ref_moe_combine_fwd(double *out, const double *ye, const double *w, const int32_t *route_row, int64_t N,
                            int64_t k, int64_t H) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < H; h++) {
            double s = 0;
            for (int64_t j = 0; j < k; j++) s += w[n * k + j] * ye[(int64_t)route_row[n * k + j] * H + h];
            out[n * H + h] = s;
        }
}

void fm_ref_moe_combine_bwd(double *dye, double *dw, const double *dout, const double *ye, const double *w,
                            const int32_t *route_row, int64_t N, int64_t k, int64_t H) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t row = route_row[n * k + j];
            double dot = 0;
            for (int64_t h = 0; h < H; h++) {
                dye[row * H + h] = w[n * k + j] * dout[n * H + h];
                dot += dout[n * H + h] * ye[row * H + h];
            }
            dw[n * k + j] = dot;
        }
}

double fm_ref_logsumexp(const double *x, int64_t V, double *max, double *entropy) {
    double m = -INFINITY, s = 0, se = 0;
    for (int64_t i = 0; i < V; i++) m = x[i] > m ? x[i] : m;
    for (int64_t i = 0; i < V; i++) {
        const double e = exp(x[i] - m);
        s += e;
        se += e * (x[i] - m);
    }
    if (max) *max = m;
    if (entropy) *entropy = log(s) - se / s; /* -sum p log p with p = e/s, log p = (x - m) - log s */
    return m + log(s);
}

double fm_ref_cross_entropy(double *loss, double *dlogits, const double *logits, const int32_t *targets,
                            const double *weights, int64_t N, int64_t V, double grad_scale, double z_coef,
                            int32_t ignore_index) {
    double sum = 0;
    for (int64_t n = 0; n < N; n++) {
        const double *x = logits + n * V;
        if (targets[n] == ignore_index) {
            if (loss) loss[n] = 0;
            if (dlogits)
                for (int64_t i = 0; i < V; i++) dlogits[n * V + i] = 0;
            continue;
        }
        const double lse = fm_ref_logsumexp(x, V, NULL, NULL), wn = weights ? weights[n] : 1.0;
        const double l = lse - x[targets[n]];
        if (loss) loss[n] = l;
        sum += wn * l;
        if (dlogits) {
            const double c = grad_scale * wn;
            for (int64_t i = 0; i < V; i++)
                dlogits[n * V + i] = c * ((1.0 + 2.0 * z_coef * lse) * exp(x[i] - lse) - (i == targets[n] ? 1.0 : 0.0));
        }
    }
    return sum;
}

void fm_ref_adamw(double *update, double *m_new, double *v_new, const double *w, const double *g, const double *m,
                  const double *v, int64_t n, double lr, double b1, double b2, double eps, double wd, double bc1,
                  double bc2, double grad_scale) {
    for (int64_t i = 0; i < n; i++) {
        const double gg = g[i] * grad_scale;
        m_new[i] = b1 * m[i] + (1.0 - b1) * gg;
        v_new[i] = b2 * v[i] + (1.0 - b2) * gg * gg;
        update[i] = -lr * ((m_new[i] / bc1) / (sqrt(v_new[i] / bc2) + eps) + wd * w[i]);
    }
}

/* fp32 -> bf16 bits, round to nearest even (NaN kept quiet). */
static uint16_t ref_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    const uint32_t lsb = (u >> 16) & 1u;
    return (uint16_t)((u + 0x7fffu + lsb) >> 16);
}

static float ref_bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* x stored through a volatile: one rounding to fp32, never fused with its neighbours */
static float R(float x) {
    volatile float t = x;
    return t;
}

void fm_ref_adamw_bf16w(float *p, const float *g, uint16_t *comp, float *m, float *v, int64_t n, float lr, float b1,
                        float b2, float eps, float wd, float bc1, float bc2, float grad_scale, uint64_t key,
                        int64_t idx0) {
    for (int64_t i = 0; i < n; i++) { /* R(): each operation's result stored, so rounded on its own */
        const float gi = R(g[i] * grad_scale);
        const float mi = R(R(b1 * m[i]) + R(R(1.0f - b1) * gi));
        const float vi = R(R(b2 * v[i]) + R(R(R(1.0f - b2) * gi) * gi));
        m[i] = mi;
        v[i] = vi;
        const float w = ref_bf16_value(ref_bf16_bits(p[i]));
        const float den = R(R(sqrtf(R(vi / bc2))) + eps);
        const float upd = R(R(R(mi / bc1) / den) + R(wd * w));
        const float d = -R(lr * upd);
        if (comp) {
            const float c = R(ref_bf16_value(comp[i]) + d);
            const float wn = ref_bf16_value(ref_bf16_bits(R(w + c)));
            comp[i] = ref_bf16_bits(R(c - R(wn - w)));
            p[i] = wn;
        } else {
            const float x = R(w + d);
            uint32_t u;
            memcpy(&u, &x, 4);
            const uint32_t r = fm_sr_bits(key, idx0 + i);
            /* finite: add the 16 random bits below the kept half, truncate (magnitude rounds up with
             * probability low/2^16) */
            const uint16_t b = (u & 0x7fffffffu) >= 0x7f800000u ? ref_bf16_bits(x) : (uint16_t)((u + r) >> 16);
            p[i] = ref_bf16_value(b);
        }
    }
}

/* ---- the sigmoid router ------------------------------------------------------------------ */

static double ref_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* Whether (a, ia) comes before (b, ib): value descending, id ascending. */
static bool ref_before(double a, int64_t ia, double b, int64_t ib) { return a > b || (a == b && ia < ib); }

/* The order of v[0..n) (value descending, id ascending) into ord [n], by insertion sort. */
static void ref_order(int32_t *ord, const double *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int64_t j = i;
        while (j > 0 && ref_before(v[i], i, v[ord[j - 1]], ord[j - 1])) {
            ord[j] = ord[j - 1];
            j--;
        }
        ord[j] = (int32_t)i;
    }
}

void fm_ref_router_sigmoid(int32_t *idx, double *w, double *scores, const double *logits, const double *bias,
                           int64_t N, int64_t E, int64_t k, int64_t n_group, int64_t topk_group, bool norm,
                           double scaling) {
    const int64_t gs = E / n_group;
    double *c = malloc(sizeof(double) * (size_t)E), *gsc = malloc(sizeof(double) * (size_t)n_group);
    int32_t *ord = malloc(sizeof(int32_t) * (size_t)(E > n_group ? E : n_group));
    for (int64_t n = 0; n < N; n++) {
        double *s = scores + n * E;
        for (int64_t e = 0; e < E; e++) {
            s[e] = ref_sigmoid(logits[n * E + e]);
            c[e] = s[e] + (bias ? bias[e] : 0.0);
        }
        if (n_group > 1) {
            for (int64_t g = 0; g < n_group; g++) {
                ref_order(ord, c + g * gs, gs);
                gsc[g] = c[g * gs + ord[0]] + c[g * gs + ord[1]];
            }
            ref_order(ord, gsc, n_group);
            for (int64_t r = topk_group; r < n_group; r++) /* the groups not kept */
                for (int64_t e = ord[r] * gs; e < (ord[r] + 1) * gs; e++) c[e] = 0.0;
        }
        ref_order(ord, c, E);
        double sum = 0;
        for (int64_t j = 0; j < k; j++) {
            idx[n * k + j] = ord[j];
            sum += s[ord[j]];
        }
        for (int64_t j = 0; j < k; j++) w[n * k + j] = (norm ? s[ord[j]] / (sum + 1e-20) : s[ord[j]]) * scaling;
    }
    free(c), free(gsc), free(ord);
}

double fm_ref_router_sigmoid_objective(const double *logits, const int32_t *idx, const double *dw, const double *gpe,
                                       int64_t N, int64_t E, int64_t k, bool norm, double scaling) {
    double L = 0;
    for (int64_t n = 0; n < N; n++) {
        double sum = 0;
        for (int64_t j = 0; j < k; j++) sum += ref_sigmoid(logits[n * E + idx[n * k + j]]);
        if (dw)
            for (int64_t j = 0; j < k; j++) {
                const double s = ref_sigmoid(logits[n * E + idx[n * k + j]]);
                L += dw[n * k + j] * (norm ? s / (sum + 1e-20) : s) * scaling;
            }
        if (gpe)
            for (int64_t e = 0; e < E; e++) L += gpe[e] * ref_sigmoid(logits[n * E + e]);
    }
    return L;
}

double fm_ref_router_softmax_group(const double *x, int64_t E, int64_t k, int64_t ng, int64_t tg, double scaling,
                                   double *p, bool *in, double *w) {
    if (!(E <= 4096 && ng >= 1 && ng <= 64 && E % ng == 0)) abort(); /* the fixed arrays below */
    double mx = x[0], s = 0;
    for (int64_t e = 1; e < E; e++) mx = fmax(mx, x[e]);
    for (int64_t e = 0; e < E; e++) s += exp(x[e] - mx);
    for (int64_t e = 0; e < E; e++) p[e] = exp(x[e] - mx) / s;
    const int64_t gs = E / ng;
    double margin = INFINITY, tmp[4096], gsc[64];
    bool kept[64];
    for (int64_t g = 0; g < ng; g++) {
        gsc[g] = -1;
        for (int64_t e = g * gs; e < (g + 1) * gs; e++) gsc[g] = fmax(gsc[g], p[e]);
        kept[g] = ng == 1;
    }
    if (ng > 1) { /* the tg largest group scores (group_scores.topk) */
        for (int64_t j = 0; j < tg; j++) {
            int64_t b = -1;
            for (int64_t g = 0; g < ng; g++)
                if (!kept[g] && (b < 0 || gsc[g] > gsc[b])) b = g;
            kept[b] = true;
        }
        double lo = INFINITY, hi = -INFINITY; /* the smallest kept, the largest dropped */
        for (int64_t g = 0; g < ng; g++) {
            if (kept[g]) lo = fmin(lo, gsc[g]);
            else hi = fmax(hi, gsc[g]);
        }
        if (tg < ng) margin = fmin(margin, (lo - hi) / lo);
    }
    for (int64_t e = 0; e < E; e++) { /* masked_fill(~mask, 0.0), then topk */
        tmp[e] = kept[e / gs] ? p[e] : 0.0;
        in[e] = false;
    }
    for (int64_t j = 0; j < k; j++) {
        int64_t b = -1;
        for (int64_t e = 0; e < E; e++)
            if (!in[e] && (b < 0 || tmp[e] > tmp[b])) b = e;
        in[b] = true;
    }
    double lo = INFINITY, hi = -INFINITY;
    for (int64_t e = 0; e < E; e++) {
        if (in[e]) lo = fmin(lo, tmp[e]);
        else hi = fmax(hi, tmp[e]);
        w[e] = in[e] ? tmp[e] * scaling : 0.0; /* topk_weight * routed_scaling_factor */
    }
    if (k < E) margin = fmin(margin, (lo - hi) / lo);
    return margin;
}

double fm_ref_router_softmax_group_objective(const double *logits, const int32_t *idx, const double *dw,
                                             const double *gpe, double z, double scaling, int64_t N, int64_t E,
                                             int64_t k) {
    double f = 0;
    for (int64_t n = 0; n < N; n++) {
        const double *x = logits + n * E;
        double mx = x[0], s = 0;
        for (int64_t e = 1; e < E; e++) mx = fmax(mx, x[e]);
        for (int64_t e = 0; e < E; e++) s += exp(x[e] - mx);
        const double lse = mx + log(s);
        if (dw)
            for (int64_t j = 0; j < k; j++) f += dw[n * k + j] * scaling * exp(x[idx[n * k + j]] - lse);
        if (gpe)
            for (int64_t e = 0; e < E; e++) f += gpe[e] * exp(x[e] - lse);
        f += z * lse * lse;
    }
    return f;
}
