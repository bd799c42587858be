/* fp64 reference implementations of the backend ops (src/backend/fm_backend.h), written once and
 * shared by the CPU op tests (tests/test_ops_cpu.c) and the CUDA op tests (tests/gpu/). Plain
 * C11, no backend: naive loops in double, in the most direct form of each op's definition in
 * fm_backend.h (full score rows for attention, repeated selection for top-k, a counting sort for
 * the MoE route index), so they share no code or order of operations with the ops under test.
 *
 * Conventions: tensors are dense row-major double arrays (the test's inputs widened from fp32, or
 * from bf16 values held in fp32); shapes as in fm_backend.h; every output is ASSIGNED unless its
 * comment says "accumulated"; integer index arrays are int32 (offsets int64), as the ops take. The
 * RoPE tables are fp32, as the op reads them. Scratch is allocated inside (these are tests).
 */
#ifndef FM_REF_OPS_H
#define FM_REF_OPS_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A malloc'd double copy of x[0..n) (never NULL; free() it). */
double *fm_ref_widen(const float *x, int64_t n);

/* C [M,N] (row stride N) = op(A) @ op(B): op(A) [M,K] (A is [K,M] when ta), op(B) [K,N] (B is
 * [N,K] when tb); lda, ldb row strides of A and B. */
void fm_ref_gemm(double *C, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const double *A, int64_t lda,
                 const double *B, int64_t ldb);

/* Grouped expert linear layers over offsets [E+1] (expert e owns rows [off[e], off[e+1])):
 * fwd: y_e [m_e,out] = x_e [m_e,in] W_e^T with W_e = W + e*out*in;
 * bwd: dx_e [m_e,in] = dy_e W_e (assigned; skipped when dx is NULL), dW_e += dy_e^T x_e
 * (accumulated). */
void fm_ref_expert_linear_fwd(double *y, const double *x, const double *W, const int64_t *off, int64_t E, int64_t in,
                              int64_t out);
void fm_ref_expert_linear_bwd(double *dx, double *dW, const double *dy, const double *x, const double *W,
                              const int64_t *off, int64_t E, int64_t in, int64_t out);

/* dwte [V,H] += dout[n,:] at row tokens[n] (accumulated). */
void fm_ref_embedding_bwd(double *dwte, const double *dout, const int32_t *tokens, int64_t N, int64_t H);

/* RMSNorm (Zhang & Sennrich 2019): rstd[n] = 1/sqrt(mean_j x[n,j]^2 + eps), out = x*rstd*w.
 * out or rstd may be NULL. */
void fm_ref_rmsnorm_fwd(double *out, double *rstd, const double *x, const double *w, int64_t N, int64_t D,
                        double eps);
/* Its analytic backward: dx[n,j] = r w_j g_j - x_j r^3 (sum_i g_i w_i x_i) / D, dw_j = sum_n g x r
 * (both assigned; either may be NULL). */
void fm_ref_rmsnorm_bwd(double *dx, double *dw, const double *dout, const double *x, const double *w, int64_t N,
                        int64_t D, double eps);

/* RoPE, HF rotate_half layout, on the first rd dims of each head of x [B,T,nh,hd] into y (same
 * shape; y != x; dims rd .. hd-1 copied): for i < rd/2, c = cos_tab[t*rd/2+i], s =
 * sign*sin_tab[...]: (y_i, y_{i+rd/2}) = (x_i c - x_{i+rd/2} s, x_{i+rd/2} c + x_i s). sign +1 is
 * rope_fwd; -1 the transpose rotation (rope_bwd). */
void fm_ref_rope(double *y, const double *x, const float *cos_tab, const float *sin_tab, int64_t B, int64_t T,
                 int64_t nh, int64_t hd, int64_t rd, double sign);

/* Causal grouped-query attention over the full score row, fp64. q [B,T,nh,hd], k, v, [B,T,nkv,hd],
 * dout [B,T,nh,hd] (only for the backward); query head h reads kv head h / (nh/nkv); scale
 * 1/sqrt(hd). */
typedef struct fm_ref_att {
    const double *q, *k, *v, *dout;
    int64_t B, T, nh, nkv, hd;
    const int32_t *kv_start; /* [B*T] or NULL: query (b,t) sees keys kv_start[b*T+t] .. t (packed
                                documents, fm_backend.h), else 0 .. t */
} fm_ref_att;
/* One query row (b, h, t): o [hd] and *lse (natural log of the sum of exp of the scaled scores);
 * with dq != NULL also dq [hd] (assigned), and with dk, dv != NULL this row's contribution ADDED
 * to dk, dv ([B,T,nkv,hd]). scratch: 2*T doubles. */
void fm_ref_attention_row(const fm_ref_att *a, int64_t b, int64_t h, int64_t t, double *o, double *lse, double *dq,
                          double *dk, double *dv, double *scratch);
/* Every row: out [B,T,nh,hd], lse [B,nh,T] (may be NULL). */
void fm_ref_attention_fwd(double *out, double *lse, const fm_ref_att *a);

/* SwiGLU (Shazeer 2020): silu(g) = g sigmoid(g); out = silu(gate) up; dgate = dout up
 * sigmoid(g) (1 + g (1 - sigmoid(g))), dup = dout silu(g). */
double fm_ref_silu(double g);
void fm_ref_swiglu_fwd(double *out, const double *gate, const double *up, int64_t n);
void fm_ref_swiglu_bwd(double *dgate, double *dup, const double *dout, const double *gate, const double *up,
                       int64_t n);

/* Row softmax and log-sum-exp: probs [N,E] = softmax(logits[n,:]), lse [N] (may be NULL). */
void fm_ref_softmax(double *probs, double *lse, const double *logits, int64_t N, int64_t E);
/* The k largest of each row of probs [N,E] by repeated selection: probability descending, ties to
 * the lower id, NaN below everything. idx [N,k]. */
void fm_ref_topk(int32_t *idx, const double *probs, int64_t N, int64_t E, int64_t k);
/* w [N,k] = probs[n, idx[n,j]], divided by their sum over j when norm. */
void fm_ref_topk_weights(double *w, const double *probs, const int32_t *idx, int64_t N, int64_t E, int64_t k,
                         bool norm);
/* count [E] (routes per expert), prob_sum [E] (sum over n of probs[n,e]); returns sum_n lse^2. */
double fm_ref_router_stats(double *count, double *prob_sum, const double *probs, const double *lse,
                           const int32_t *idx, int64_t N, int64_t E, int64_t k);
/* The router's loss terms from its statistics over N tokens and E experts: terms[0] = the
 * load-balancing loss E sum_e f_e P_e with f_e = count_e / N, P_e = prob_sum_e / N (Switch
 * Transformer, Fedus et al. 2021, eq. 4), formed here as E (sum_e count_e prob_sum_e) / N^2;
 * terms[1] = the mean z-loss lse_sq / N (ST-MoE, Zoph et al. 2022, eq. 5). */
void fm_ref_router_loss_terms(double terms[2], const double *count, const double *prob_sum, double lse_sq, int64_t N,
                              int64_t E);
/* g [E] = coef * d(E sum_e f_e P_e)/d prob[n,e] with f held constant = coef E count_e / N^2. */
void fm_ref_router_aux_grad(double *g, const double *count, double coef, int64_t N, int64_t E);

/* The router's objective with the selection idx held fixed (the op's router_bwd contract):
 *   L = sum dtopk_w o topk_w + sum_e g_e sum_n probs[n,e] + z sum_n lse[n]^2,
 * topk_w as fm_ref_topk_weights. dw [N,k] and gpe [E] may be NULL (term absent). */
typedef struct fm_ref_router_loss {
    const int32_t *idx;
    const double *dw, *gpe;
    double z;
    int64_t N, E, k;
    bool norm;
} fm_ref_router_loss;
/* L at logits [N,E]; probs [N,E] and lse [N] are scratch (left holding the softmax). */
double fm_ref_router_objective(const fm_ref_router_loss *s, const double *logits, double *probs, double *lse);
/* dL/dlogits [N,E], analytically, from the softmax probs and lse of the logits. */
void fm_ref_router_bwd(double *g, const fm_ref_router_loss *s, const double *probs, const double *lse);

/* The sigmoid router (fm_backend.h router_sigmoid_fwd; DeepSeek-V3 / transformers'
 * Glm4MoeTopkRouter) in fp64, by its definition: scores [N,E] = 1 / (1 + exp(-logits)); choice
 * = scores + bias (bias [E], NULL: 0); n_group > 1: group scores = the sum of the 2 largest
 * choices of each group (found by sorting the group), the topk_group best groups kept (ties: the
 * lower group), the others' choices 0.0; idx [N,k] the k largest choices (ties: the lower id);
 * w [N,k] = scores there, / (sum + 1e-20) when norm, times scaling. */
void fm_ref_router_sigmoid(int32_t *idx, double *w, double *scores, const double *logits, const double *bias,
                           int64_t N, int64_t E, int64_t k, int64_t n_group, int64_t topk_group, bool norm,
                           double scaling);
/* The sigmoid router's objective with the selection idx [N,k] held fixed (router_sigmoid_bwd's
 * contract): L = sum_{n,j} dw[n,j] w[n,j] + sum_{n,e} gpe[e] scores[n,e], w as above (dw, gpe
 * may be NULL: term absent). */
double fm_ref_router_sigmoid_objective(const double *logits, const int32_t *idx, const double *dw, const double *gpe,
                                       int64_t N, int64_t E, int64_t k, bool norm, double scaling);

/* DeepSeek-V2's router (transformers' DeepseekV2Moe.route_tokens_to_experts) on one row of logits
 * x [E], in fp64: p [E] = softmax(x); n_group > 1 ("group_limited_greedy"): the topk_group groups of
 * largest max p kept, the others' p masked to 0; the k largest (masked) scores chosen: in [E] true
 * for a chosen expert, w [E] its (masked) score times scaling (0 elsewhere). Returns the row's
 * smallest relative margin: between the topk_group-th and the next group score, and between the
 * k-th and the next chosen score (ties break any way: a row with a small margin is not comparable
 * to an op whose ties go to the lower id). E <= 4096, n_group <= 64. */
double fm_ref_router_softmax_group(const double *x, int64_t E, int64_t k, int64_t n_group, int64_t topk_group,
                                   double scaling, double *p, bool *in, double *w);

/* Its objective over N rows with the selection idx [N,k] held: sum_j dw_j scaling p_{idx_j} (dw NULL:
 * none) + sum_n,e gpe_e p_{n,e} (gpe NULL: none) + z sum_n lse_n^2, in fp64. */
double fm_ref_router_softmax_group_objective(const double *logits, const int32_t *idx, const double *dw,
                                             const double *gpe, double z, double scaling, int64_t N, int64_t E,
                                             int64_t k);

/* The MoE route index as a stable counting sort of the routes r = n*k + j by expert idx[r]:
 * offsets [E+1], row_route [R] (row -> route), route_row [R] (route -> row); R = N*k. */
void fm_ref_route_index(int64_t *offsets, int32_t *row_route, int32_t *route_row, const int32_t *idx, int64_t N,
                        int64_t E, int64_t k);
/* dx [N,H] = sum_j dxe[route_row[n*k+j],:]. */
void fm_ref_moe_gather_bwd(double *dx, const double *dxe, const int32_t *route_row, int64_t N, int64_t k, int64_t H);
/* out [N,H] = sum_j w[n*k+j] ye[route_row[n*k+j],:]. */
void fm_ref_moe_combine_fwd(double *out, const double *ye, const double *w, const int32_t *route_row, int64_t N,
                            int64_t k, int64_t H);
/* dye[route_row[n*k+j],:] = w[n*k+j] dout[n,:], dw[n*k+j] = dot(dout[n,:], ye[route_row[n*k+j],:]). */
void fm_ref_moe_combine_bwd(double *dye, double *dw, const double *dout, const double *ye, const double *w,
                            const int32_t *route_row, int64_t N, int64_t k, int64_t H);

/* One row x [V]: returns lse = m + log sum exp(x - m); *max = m (may be NULL); *entropy =
 * -sum p log p (may be NULL). */
double fm_ref_logsumexp(const double *x, int64_t V, double *max, double *entropy);
/* Softmax cross-entropy over logits [N,V] with per-row weights (NULL: all 1) and a z-loss:
 *   loss [N] = lse - x[target] (0 where target == ignore; may be NULL),
 *   dlogits [N,V] = grad_scale w_n ((1 + 2 z_coef lse) softmax - onehot) (0 rows where ignored;
 *   may be NULL), the gradient of w_n (loss_n + z_coef lse_n^2);
 * returns sum over non-ignored rows of w_n loss_n. */
double fm_ref_cross_entropy(double *loss, double *dlogits, const double *logits, const int32_t *targets,
                            const double *weights, int64_t N, int64_t V, double grad_scale, double z_coef,
                            int32_t ignore_index);

/* AdamW (Loshchilov & Hutter 2019), fm_backend.h's formula, from w, g, m, v [n]:
 *   g' = g grad_scale; m' = b1 m + (1-b1) g'; v' = b2 v + (1-b2) g'^2;
 *   update = -lr ((m'/bc1) / (sqrt(v'/bc2) + eps) + wd w).  update, m_new, v_new [n]. */
void fm_ref_adamw(double *update, double *m_new, double *v_new, const double *w, const double *g, const double *m,
                  const double *v, int64_t n, double lr, double b1, double b2, double eps, double wd, double bc1,
                  double bc2, double grad_scale);

/* AdamW on bf16 weights (fm_backend.h's adamw_bf16w), fp32 moments: the fp32 bit model, each
 * operation rounded on its own, in place on p [n] (bf16 values as fp32), m, v [n]; comp [n] bf16
 * bits (Kahan) or NULL (stochastic rounding with fm_sr_bits(key, idx0 + i), fm_adamw_lowp.h).
 * Written from the op's definition (bf16 rounding on the bits here), so a backend that matches it
 * bit for bit computes that definition. */
void fm_ref_adamw_bf16w(float *p, const float *g, uint16_t *comp, float *m, float *v, int64_t n, float lr, float b1,
                        float b2, float eps, float wd, float bc1, float bc2, float grad_scale, uint64_t key,
                        int64_t idx0);

#ifdef __cplusplus
}
#endif
#endif
