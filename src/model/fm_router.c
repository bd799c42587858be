/* The MoE router: forward, losses, backward (fm_router.h). */
#include "fm_router.h"

#include <math.h>

fm_router_opts fm_router_opts_from_config(const fm_config *c) {
    fm_router_opts o = {c->router_sigmoid ? FM_ROUTER_SCORE_SIGMOID : FM_ROUTER_SCORE_SOFTMAX,
                        c->num_experts, c->num_experts_per_tok, c->norm_topk_prob,
                        c->router_aux_loss_coef, c->router_z_loss_coef};
    o.n_group = c->n_group > 0 ? c->n_group : 1;
    o.topk_group = c->topk_group > 0 ? c->topk_group : 1;
    o.scaling = c->router_sigmoid ? (float)c->routed_scaling_factor : 1.0f;
    if (c->model_type == FM_MODEL_DEEPSEEK_V2) { /* DeepseekV2Moe: never renormalized; groups only if limited */
        o.score = FM_ROUTER_SCORE_SOFTMAX_GROUP;
        o.norm_topk = false;
        o.n_group = c->router_group_limited ? c->n_group : 1;
        o.topk_group = c->router_group_limited ? c->topk_group : 1;
        o.scaling = (float)c->routed_scaling_factor;
    }
    return o;
}

fm_status fm_router_seq_aux_check(const fm_router_opts *o, double alpha, int sp) {
    if (!(alpha >= 0) || !isfinite(alpha))
        return fm_error(FM_ERR_ARG, "--moe-seq-aux-loss-coeff %g: expected a finite coefficient >= 0 (DeepSeek-V3 "
                        "used 1e-4; 0 = off)", alpha);
    if (alpha == 0) return FM_OK;
    if (o->score != FM_ROUTER_SCORE_SIGMOID)
        return fm_error(FM_ERR_ARG, "--moe-seq-aux-loss-coeff %g: the sequence-wise balance loss is built for the "
                        "sigmoid router (glm4_moe's, deepseek_v3's; its gradient is the sigmoid's, not the softmax's "
                        "of deepseek_v2 and the other families); this model's softmax router has the batch-wise one: "
                        "set router_aux_loss_coef in its config.json and drop the flag", alpha);
    if (o->num_experts > FM_ROUTER_MAX_SEQ_AUX_E)
        return fm_error(FM_ERR_ARG, "--moe-seq-aux-loss-coeff %g: %lld experts, the loss's kernels take at most %d; "
                        "drop the flag", alpha, (long long)o->num_experts, FM_ROUTER_MAX_SEQ_AUX_E);
    if (sp > 1)
        return fm_error(FM_ERR_ARG, "--moe-seq-aux-loss-coeff %g with --sp %d: a sequence's tokens are split over the "
                        "sp ranks and the per-sequence statistics are not gathered across them; use --sp 1 or drop "
                        "the flag", alpha, sp);
    return FM_OK;
}

fm_status fm_router_forward(const fm_backend *be, const fm_router_opts *o, const fm_comm *comm, float *logits,
                            fm_router_saved *s, double *lse_sq, double *terms, const fm_act *x, const fm_act *W,
                            const fm_act *lin_bias, const fm_act *bias, int64_t N, int64_t H, const int32_t *replay,
                            const fm_router_segs *seg) {
    const int64_t E = o->num_experts, k = o->top_k;
    fm_linear_fwd(be, logits, FM_DTYPE_F32, x, W, N, H, E);
    if (lin_bias) { /* gpt_oss: the Linear's bias on the logits */
        if (!be->ops->bias_add_f32)
            return fm_error(FM_ERR_UNSUPPORTED, "a router Linear with a bias (gpt_oss's): the %s backend has no "
                            "bias_add_f32 op (the cpu and cuda backends have it)", be->ops->name ? be->ops->name : "this");
        be->ops->bias_add_f32(be->ctx, logits, lin_bias, N, E);
    }
    if (o->score == FM_ROUTER_SCORE_SOFTMAX_GROUP) {
        if (!be->ops->router_softmax_group_fwd)
            return fm_error(FM_ERR_UNSUPPORTED, "the %s backend has no DeepSeek-V2 router (deepseek_v2's softmax with "
                            "group-limited greedy top-k and routed_scaling_factor, router_softmax_group_fwd): train "
                            "deepseek_v2 on the cpu or cuda backend", be->ops->name ? be->ops->name : "this");
        be->ops->router_softmax_group_fwd(be->ctx, s->probs, s->lse, s->topk_idx, s->topk_w, logits, N, E, k,
                                          o->n_group, o->topk_group, o->scaling);
    } else if (o->score == FM_ROUTER_SCORE_SIGMOID) {
        if (!be->ops->router_sigmoid_fwd)
            return fm_error(FM_ERR_UNSUPPORTED, "the %s backend has no sigmoid router (glm4_moe's); use the cpu or "
                            "cuda backend", be->ops->name ? be->ops->name : "this");
        be->ops->router_sigmoid_fwd(be->ctx, s->probs, s->lse, s->topk_idx, s->topk_w, logits, bias, N, E, k,
                                    o->n_group, o->topk_group, o->norm_topk, o->scaling);
    } else {
        be->ops->router_fwd(be->ctx, s->probs, s->lse, s->topk_idx, s->topk_w, logits, N, E, k, o->norm_topk);
    }
    const bool sig = o->score == FM_ROUTER_SCORE_SIGMOID;
    if (replay) { /* routing replay (R3): the given experts, the current router's weights */
        if (!be->ops->router_replay)
            return fm_error(FM_ERR_UNSUPPORTED, "routing replay: the %s backend has no router_replay op (the cpu and "
                            "cuda backends have it); drop the batch's routed_experts",
                            be->ops->name ? be->ops->name : "this");
        /* weighed as the scoring weighs its own choice: router_sigmoid_fwd's + 1e-20f and scaling;
         * router_softmax_group_fwd's scaling (norm_topk false); router_fwd's 1 (an exact no-op) */
        be->ops->router_replay(be->ctx, s->topk_idx, s->topk_w, s->probs, replay, N, E, k, o->norm_topk,
                               sig ? 1e-20f : 0.0f, o->score != FM_ROUTER_SCORE_SOFTMAX ? o->scaling : 1.0f);
    }
    if (o->force_route) { /* test hook (fm_router_opts): the top-k forced, weights from the probabilities */
        if (!be->ops->router_force)
            return fm_error(FM_ERR_UNSUPPORTED, "FLATMOE_TEST_FORCE_ROUTE: the %s backend has no router_force op (the "
                            "forced routing, a test hook, runs on the cpu and cuda backends); unset it",
                            be->ops->name ? be->ops->name : "this");
        be->ops->router_force(be->ctx, s->topk_idx, s->topk_w, s->probs, N, E, k, o->force_first, o->force_percent,
                              o->norm_topk, o->score != FM_ROUTER_SCORE_SOFTMAX ? o->scaling : 1.0f);
    }
    be->ops->router_stats(be->ctx, s->count, s->prob_sum, lse_sq, s->probs, s->lse, s->topk_idx, N, E, k);
    int64_t n_tot = N;
    if (comm) { /* the batch's statistics: summed over the ranks that see its tokens (in place) */
        FM_TRY(fm_comm_all_reduce(comm, s->count, s->count, E, FM_COMM_F32, FM_COMM_SUM, 0));
        FM_TRY(fm_comm_all_reduce(comm, s->prob_sum, s->prob_sum, E, FM_COMM_F32, FM_COMM_SUM, 0));
        FM_TRY(fm_comm_all_reduce(comm, lse_sq, lse_sq, 1, FM_COMM_F64, FM_COMM_SUM, 0));
        n_tot = N * fm_comm_size(comm);
    }
    be->ops->router_loss_terms(be->ctx, terms, s->count, s->prob_sum, lse_sq, n_tot, E);
    if (sig && o->seq_aux_coef > 0) { /* the sequence-wise term replaces the (unused) Switch term */
        if (!be->ops->router_seq_aux_fwd)
            return fm_error(FM_ERR_UNSUPPORTED, "--moe-seq-aux-loss-coeff: the %s backend has no router_seq_aux_fwd "
                            "op (the cpu and cuda backends have it); drop the flag",
                            be->ops->name ? be->ops->name : "this");
        FM_ASSERT(seg && seg->B * seg->T == N && seg->n_seg >= 1);
        const int w = comm ? fm_comm_size(comm) : 1; /* the mean of each rank's mean over its segments */
        be->ops->router_seq_aux_fwd(be->ctx, terms, s->probs, s->topk_idx, seg->doc_start, seg->B, seg->T, E, k,
                                    1.0 / ((double)seg->n_seg * (double)w));
        if (comm) FM_TRY(fm_comm_all_reduce(comm, terms, terms, 1, FM_COMM_F64, FM_COMM_SUM, 0));
    }
    return FM_OK;
}

void fm_router_losses(const fm_router_opts *o, const double *terms, int64_t L, const fm_config *layers, double *aux,
                      double *z) {
    double sa = 0, sz = 0;
    int64_t n = 0;
    for (int64_t l = 0; l < L; l++) {
        if (layers && !fm_config_layer_is_moe(layers, l)) continue;
        sa += terms[2 * l];
        sz += terms[2 * l + 1];
        n++;
    }
    const double ac = o->score == FM_ROUTER_SCORE_SIGMOID ? o->seq_aux_coef : o->aux_loss_coef;
    *aux = n ? ac * sa / (double)n : 0.0;
    *z = n ? o->z_loss_coef * sz / (double)n : 0.0;
}

void fm_router_backward(const fm_backend *be, const fm_router_opts *o, int64_t N_tot, fm_act *dx, fm_act *dW, float *dlogits,
                        fm_act *dlogits_act, float *dprobs, const float *dtopk_w, const fm_router_saved *s,
                        const fm_act *x, const fm_act *W, int64_t N, int64_t H, int64_t L, float scale,
                        const fm_router_segs *seg) {
    const int64_t E = o->num_experts, k = o->top_k;
    /* d(aux)/d probs[n,e] = (coef * scale / L) * E * f_e / N with f_e = count_e / N held constant */
    be->ops->router_aux_grad(be->ctx, dprobs, s->count, o->aux_loss_coef * scale / (double)L, N_tot, E);
    const float z_scale = (float)(o->z_loss_coef * scale / ((double)L * (double)N_tot));
    if (o->score == FM_ROUTER_SCORE_SIGMOID) /* aux and z coefficients are 0 (fm_config_glm4.c refuses them) */
        be->ops->router_sigmoid_bwd(be->ctx, dlogits, dtopk_w, o->aux_loss_coef > 0 ? dprobs : NULL, s->probs,
                                    s->topk_idx, N, E, k, o->norm_topk, o->scaling);
    else if (o->score == FM_ROUTER_SCORE_SOFTMAX_GROUP) /* the forward checked the op */
        be->ops->router_softmax_group_bwd(be->ctx, dlogits, dtopk_w, dprobs, z_scale, s->probs, s->lse, s->topk_idx,
                                          N, E, k, o->scaling);
    else
        be->ops->router_bwd(be->ctx, dlogits, dtopk_w, dprobs, z_scale, s->probs, s->lse, s->topk_idx, s->topk_w, N,
                            E, k, o->norm_topk);
    if (o->score == FM_ROUTER_SCORE_SIGMOID && o->seq_aux_coef > 0) { /* sequence-wise (the forward checked the op) */
        const double w = (double)N_tot / (double)N; /* ranks of the statistics communicator */
        be->ops->router_seq_aux_bwd(be->ctx, dlogits, s->probs, s->topk_idx, seg->doc_start, seg->B, seg->T, E, k,
                                    o->seq_aux_coef * scale / ((double)L * (double)seg->n_seg * w));
    }
    /* the router GEMMs take the fp32 logit gradient as fm_act */
    if ((void *)dlogits_act != (void *)dlogits)
        be->ops->convert(be->ctx, dlogits_act, FM_ACT_DTYPE, dlogits, FM_DTYPE_F32, N * E);
    fm_linear_bwd(be, dx, 1.0f, dW, dlogits_act, x, W, N, H, E, 1.0f);
}

void fm_router_lin_bias_backward(const fm_backend *be, fm_act *db, const fm_act *dlogits_act, int64_t N, int64_t E) {
    be->ops->bias_grad(be->ctx, db, dlogits_act, N, E);
}
