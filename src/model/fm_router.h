/* The MoE router (Megatron-Core's TopKRouter split, STYLE.md): a linear layer to fp32 logits, a
 * score function and top-k selection, the routing statistics, and the router's losses — the
 * Switch-Transformer load-balancing loss (Fedus et al. 2021, arXiv 2101.03961, eq. 4-6:
 * E * sum_e f_e P_e per layer, f_e held constant) and the ST-MoE z-loss (Zoph et al. 2022,
 * arXiv 2202.08906, eq. 5: mean_n lse_n^2) — with their gradients. The model's layer calls it;
 * the aux-loss arithmetic lives here and nowhere else.
 *
 * Shapes: N tokens, H hidden_size, E num_experts, k top-k. Logits, probabilities, log-sum-exps
 * and top-k weights are fp32 in every build; the router weight W [E,H] and the input x [N,H]
 * are fm_act. */
#ifndef FM_ROUTER_H
#define FM_ROUTER_H

#include "../backend/fm_backend.h"
#include "../comm/fm_comm.h"
#include "fm_config.h"

typedef enum fm_router_score {
    FM_ROUTER_SCORE_SOFTMAX = 0, /* softmax over experts, then top-k (Qwen3-MoE, OLMoE, Mixtral) */
    /* DeepSeek-V3's (GLM-4.5's Glm4MoeTopkRouter): sigmoid scores, the layer's
     * e_score_correction_bias added for the selection only, group-limited top-k, the chosen
     * scores renormalized (norm_topk) and times scaling (fm_backend.h router_sigmoid_fwd) */
    FM_ROUTER_SCORE_SIGMOID = 1,
    /* DeepSeek-V2's (transformers' DeepseekV2Moe): softmax scores, top-k "greedy" (n_group 1) or
     * "group_limited_greedy" (groups scored by their largest score), the chosen scores times scaling,
     * never renormalized (norm_topk false; fm_backend.h router_softmax_group_fwd) */
    FM_ROUTER_SCORE_SOFTMAX_GROUP = 2,
} fm_router_score;

typedef struct fm_router_opts {
    fm_router_score score;
    int64_t num_experts;     /* E */
    int64_t top_k;           /* k = num_experts_per_tok */
    bool norm_topk;          /* renormalize the k weights to sum 1 (norm_topk_prob) */
    double aux_loss_coef;    /* router_aux_loss_coef */
    double z_loss_coef;      /* router_z_loss_coef (flatmoe extension; 0 = off) */
    int64_t n_group, topk_group; /* sigmoid, softmax_group: group-limited top-k (1, 1: plain top-k) */
    float scaling;           /* sigmoid, softmax_group: routed_scaling_factor (softmax: 1, unused) */
    /* sigmoid: alpha of DeepSeek-V3's complementary sequence-wise balance loss (§2.1.2 eq. 17-20;
     * --moe-seq-aux-loss-coeff; 0 = off). Per segment s (a row of the micro-batch, or with packed
     * documents each document, padding included) of T_s tokens, l_s = sum_i f_i P_i with
     * f_i = E c_i / (k T_s) (c_i the segment's routes to expert i, held constant) and P_i the
     * mean over its tokens of the scores normalized over all experts (s_i / (sum_j s_j + 1e-20));
     * the layer's term is the mean of l_s over the rank's segments, averaged over the ranks of the
     * statistics communicator (each rank's mean, as Megatron-Core's per-rank mean over its
     * sequences under data parallelism), in terms[0] in place of the Switch term (which the
     * sigmoid router never uses: glm4_moe refuses router_aux_loss_coef), and the loss is
     * seq_aux_coef times the mean of the terms over the MoE layers (fm_router_losses). */
    double seq_aux_coef;
    /* Test hook (adversarial routing, tests/mpi_train_ep.sh; the trainer sets it from
     * the test hook FLATMOE_TEST_FORCE_ROUTE, core/fm_test_hooks.h): every token's top-k becomes experts force_first .. force_first
     * + k - 1 (mod E), their weights the softmax probabilities of those experts (renormalized with
     * norm_topk), so forward, statistics and backward stay those of a router that chose them (the
     * sigmoid router: its scores, renormalized with norm_topk, times routed_scaling_factor, as its
     * backward assumes).
     * force_percent (in [0,100]) of each call's tokens are forced, spread evenly (token n when
     * n*pct/100 < (n+1)*pct/100), the rest keep the router's own choice: the skewed form
     * (FLATMOE_TEST_FORCE_ROUTE=FIRST:PCT; plain FIRST is 100). Runs as the backend's
     * router_force op after router_fwd (the CPU and the CUDA backends, the same bits); false:
     * the router's own choice. */
    bool force_route;
    int64_t force_first;   /* >= 0 */
    int force_percent;     /* [0,100] */
} fm_router_opts;

/* The router options of a config (softmax scores, or sigmoid with cfg->router_sigmoid, or
 * deepseek_v2's softmax_group; the config's E, k, norm_topk_prob (deepseek_v2: false, as
 * transformers), coefs, groups (deepseek_v2 "greedy": 1, 1) and scaling; seq_aux_coef 0). */
fm_router_opts fm_router_opts_from_config(const fm_config *c);

/* Whether the sequence-wise balance loss with coefficient alpha can run: FM_OK for alpha 0, or a
 * finite alpha > 0 on the sigmoid router without sequence parallelism (sp <= 1: under --sp a
 * sequence's tokens are split over ranks, and the per-segment statistics are not gathered
 * across them). Errors: FM_ERR_ARG naming --moe-seq-aux-loss-coeff, the value or the option that
 * prevents it, and the fix. */
fm_status fm_router_seq_aux_check(const fm_router_opts *o, double alpha, int sp);

/* The segments of a micro-batch for the sequence-wise loss: B rows of T tokens (N = B T); doc_start
 * [N] int32 in backend memory (fm_acts.h's, the batch's row-local document starts; NULL: one
 * segment per row); n_seg the number of segments (rows, or documents: counted on the host at the
 * batch's upload, fm_model_embed_forward). */
typedef struct fm_router_segs {
    const int32_t *doc_start;
    int64_t B, T, n_seg;
} fm_router_segs;

/* What one layer's router saves for its backward and for the losses (backend memory). */
typedef struct fm_router_saved {
    float *probs, *lse;          /* [N,E], [N] */
    int32_t *topk_idx;           /* [N,k] experts in decreasing probability */
    float *topk_w;               /* [N,k] */
    float *count, *prob_sum;     /* [E] routes per expert, sum_n probs[n,e] */
} fm_router_saved;

/* Forward: logits [N,E] fp32 = x W^T into `logits` (transient scratch), then the score function
 * (sigmoid: with the selection bias [E] fm_act, the layer's e_score_correction_bias, NULL: none;
 * s->probs holds the sigmoid scores) and top-k into s->probs, lse, topk_idx, topk_w, the statistics into s->count, prob_sum, and
 * the layer's loss terms before the coefficients into terms [2] (backend memory, doubles):
 * terms[0] = E * sum_e f_e P_e with f_e = count_e / N_tot, P_e = prob_sum_e / N_tot;
 * terms[1] = sum_n lse_n^2 / N_tot. With `comm` (the ranks that see this batch's tokens, in
 * backend memory; NULL: this rank alone) the statistics count, prob_sum and lse_sq are
 * all-reduced (sum) over its ranks first and N_tot = N x its size (every rank routes N tokens),
 * so the loss and its gradient are those of the whole batch (Megatron-Core reduces them the
 * same way). lse_sq [1] is backend scratch.
 * replay [N,k] int32 (backend memory; NULL: none): routing replay (R3; slime's
 * --use-rollout-routing-replay, verl's router_replay R3): a row whose first id is >= 0 replaces the
 * token's top-k by the given experts, in the given order, and their weights are the CURRENT
 * router's probabilities of those experts (the sigmoid router: its scores, without the selection
 * bias or the group mask; deepseek_v2's: its softmax probabilities, without the group mask),
 * renormalized with norm_topk (and times routed_scaling_factor) exactly
 * as the router weighs its own choice (the backend's router_replay op), so the router keeps
 * learning through the gates and a replay of its own routes is bit-identical to no replay; the
 * backward is the router's own over the replayed selection; a row starting with -1
 * (padding) keeps the router's choice. The statistics, the losses and the backward then see the
 * replayed routes as if the router had chosen them; the dispatch bound is unchanged (it holds for
 * any routing). The ids are checked by the caller (in [0,E), distinct within a row). With the
 * force_route test hook on as well, the hook's routes win (it runs after). Issues work only (no
 * host sync). With o->seq_aux_coef > 0 (the sigmoid router), terms[0] is the sequence-wise
 * balance term over seg's segments instead (fm_router_opts; the backend's router_seq_aux_fwd, then
 * all-reduced over comm). Errors: the communicator's (naming the rank and the collective);
 * FM_ERR_UNSUPPORTED for replay on a backend without router_replay, or the sequence-wise loss on a
 * backend without router_seq_aux_fwd, or lin_bias on a backend without bias_add_f32.
 * lin_bias [E] fm_act (NULL: none): the router Linear's bias, logits = x W^T + lin_bias before the
 * scoring (GPT-OSS's GptOssTopKRouter: its top-k logits softmaxed, which the softmax router with
 * norm_topk computes: exp(l_i) / sum over the k of exp(l_j)). */
fm_status fm_router_forward(const fm_backend *be, const fm_router_opts *o, const fm_comm *comm, float *logits,
                            fm_router_saved *s, double *lse_sq, double *terms, const fm_act *x, const fm_act *W,
                            const fm_act *lin_bias, const fm_act *bias, int64_t N, int64_t H, const int32_t *replay,
                            const fm_router_segs *seg);

/* After fm_router_backward (which leaves the fm_act logit gradient in dlogits_act [N,E]): the
 * router Linear's bias (lin_bias of fm_router_forward; gpt_oss's) db [E] += sum over n of
 * dlogits_act[n,:] (the backend's bias_grad). */
void fm_router_lin_bias_backward(const fm_backend *be, fm_act *db, const fm_act *dlogits_act, int64_t N, int64_t E);

/* The router losses of a micro-batch from its L layers' terms (host copies, [L][2], summed in
 * layer order over the MoE layers, fm_config_layer_is_moe of `layers`; NULL: all L, a dense
 * layer's terms are never read): *aux = aux_loss_coef * sum_l aux_l / L_moe (the sigmoid router:
 * seq_aux_coef, its terms[0] the sequence-wise term), *z = z_loss_coef *
 * sum_l z_l / L_moe (per-layer mean over the L_moe MoE layers, as Megatron-Core; DESIGN.md §5). */
void fm_router_losses(const fm_router_opts *o, const double *terms, int64_t L, const fm_config *layers, double *aux,
                      double *z);

/* Backward: dlogits [N,E] fp32 (ASSIGNED, scratch) from dtopk_w [N,k] (the top-k weights'
 * gradient), plus the load-balancing loss's gradient (coef * scale / L) * E * f_e / N on every
 * probs[n,e] (f_e from s->count, held constant; router_aux_grad, on the device) and the
 * z-loss's (zcoef * scale / (L N)) * 2 lse_n probs[n,e]; then through the linear layer:
 * dx [N,H] += dlogits W (beta 1: dx holds the experts' input gradient) and dW [E,H] +=
 * dlogits^T x. scale is the micro-batch's loss scale (1/G for G-step accumulation); L the number
 * of layers the losses are averaged over (the MoE layers, fm_config_num_moe_layers). dprobs [E]
 * is backend scratch, dlogits_act [N,E] an fm_act copy of the logit gradient for the GEMMs
 * (== dlogits when fm_act is fp32). N_tot as in the forward (N x the statistics communicator's
 * size): the aux gradient uses the batch's f_e and P_e's normalization. With o->seq_aux_coef > 0
 * the sequence-wise loss's gradient (seq_aux_coef * scale / (L n_seg W)) d l_s / d logits is added
 * to dlogits (router_seq_aux_bwd; W = N_tot / N ranks, seg as in the forward). Issues work only. */
void fm_router_backward(const fm_backend *be, const fm_router_opts *o, int64_t N_tot, fm_act *dx, fm_act *dW, float *dlogits,
                        fm_act *dlogits_act, float *dprobs, const float *dtopk_w, const fm_router_saved *s,
                        const fm_act *x, const fm_act *W, int64_t N, int64_t H, int64_t L, float scale,
                        const fm_router_segs *seg);

#endif
