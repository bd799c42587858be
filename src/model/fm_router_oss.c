/* GPT-OSS's router (fm_router_oss.h): fm_router_forward's softmax path with the Linear's bias
 * added to the logits before the score function. */
#include "fm_router_oss.h"

fm_status fm_router_oss_forward(const fm_backend *be, const fm_router_opts *o, const fm_comm *comm, float *logits,
                                fm_router_saved *s, double *lse_sq, double *terms, const fm_act *x, const fm_act *W,
                                const fm_act *b, int64_t N, int64_t H, const int32_t *replay) {
    const int64_t E = o->num_experts, k = o->top_k;
    if (!be->ops->bias_add_f32 || o->score != FM_ROUTER_SCORE_SOFTMAX)
        return fm_error(FM_ERR_UNSUPPORTED, "gpt_oss's router (a Linear with a bias, softmax over the top-k): the %s "
                        "backend has no bias_add_f32 op (the cpu and cuda backends have it)",
                        be->ops->name ? be->ops->name : "this");
    fm_linear_fwd(be, logits, FM_DTYPE_F32, x, W, N, H, E);
    be->ops->bias_add_f32(be->ctx, logits, b, N, E);
    be->ops->router_fwd(be->ctx, s->probs, s->lse, s->topk_idx, s->topk_w, logits, N, E, k, o->norm_topk);
    if (replay) { /* routing replay (R3): the given experts, the current router's weights */
        if (!be->ops->router_replay)
            return fm_error(FM_ERR_UNSUPPORTED, "routing replay: the %s backend has no router_replay op; drop the "
                            "batch's routed_experts", be->ops->name ? be->ops->name : "this");
        be->ops->router_replay(be->ctx, s->topk_idx, s->topk_w, s->probs, replay, N, E, k, o->norm_topk, 0.0f, 1.0f);
    }
    if (o->force_route) {
        if (!be->ops->router_force)
            return fm_error(FM_ERR_UNSUPPORTED, "FLATMOE_TEST_FORCE_ROUTE: the %s backend has no router_force op; "
                            "unset it", be->ops->name ? be->ops->name : "this");
        be->ops->router_force(be->ctx, s->topk_idx, s->topk_w, s->probs, N, E, k, o->force_first, o->force_percent,
                              o->norm_topk, 1.0f);
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
    return FM_OK;
}

void fm_router_oss_bias_backward(const fm_backend *be, fm_act *db, const fm_act *dlogits_act, int64_t N, int64_t E) {
    be->ops->bias_grad(be->ctx, db, dlogits_act, N, E);
}
