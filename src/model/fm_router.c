/* The MoE router: forward, losses, backward (fm_router.h). */
#include "fm_router.h"

fm_router_opts fm_router_opts_from_config(const fm_config *c) {
    fm_router_opts o = {FM_ROUTER_SCORE_SOFTMAX, c->num_experts, c->num_experts_per_tok, c->norm_topk_prob,
                        c->router_aux_loss_coef, c->router_z_loss_coef};
    return o;
}

fm_router_terms fm_router_forward(const fm_backend *be, const fm_router_opts *o, float *logits, fm_router_saved *s,
                                  float *h_prob_sum, const fm_act *x, const fm_act *W, int64_t N, int64_t H) {
    const int64_t E = o->num_experts, k = o->top_k;
    FM_ASSERT(o->score == FM_ROUTER_SCORE_SOFTMAX);
    fm_linear_fwd(be, logits, FM_DTYPE_F32, x, W, N, H, E);
    be->ops->router_fwd(be->ctx, s->probs, s->lse, s->topk_idx, s->topk_w, logits, N, E, k, o->norm_topk);
    const double lse_sq = be->ops->router_stats(be->ctx, s->count, s->prob_sum, s->probs, s->lse, s->topk_idx, N, E, k);
    /* the load-balancing statistics, to the host (2E floats) */
    be->ops->copy(be->ctx, s->h_count, s->count, sizeof(float) * (size_t)E, FM_COPY_D2H);
    be->ops->copy(be->ctx, h_prob_sum, s->prob_sum, sizeof(float) * (size_t)E, FM_COPY_D2H);
    double sum = 0;
    for (int64_t e = 0; e < E; e++) sum += ((double)s->h_count[e] / N) * ((double)h_prob_sum[e] / N);
    fm_router_terms t = {(double)E * sum, lse_sq / (double)N};
    return t;
}

void fm_router_losses(const fm_router_opts *o, double sum_aux, double sum_z, int64_t L, double *aux, double *z) {
    *aux = o->aux_loss_coef * sum_aux / (double)L;
    *z = o->z_loss_coef * sum_z / (double)L;
}

void fm_router_backward(const fm_backend *be, const fm_router_opts *o, fm_act *dx, fm_act *dW, float *dlogits,
                        fm_act *dlogits_act, float *dprobs, float *h_dprobs, const float *dtopk_w,
                        const fm_router_saved *s, const fm_act *x, const fm_act *W, int64_t N, int64_t H, int64_t L,
                        float scale) {
    const int64_t E = o->num_experts, k = o->top_k;
    /* d(aux)/d probs[n,e] = (coef * scale / L) * E * f_e / N with f_e = count_e / N held constant */
    const double aux_c = o->aux_loss_coef * scale / (double)L;
    for (int64_t e = 0; e < E; e++) h_dprobs[e] = (float)(aux_c * (double)E * ((double)s->h_count[e] / N) / (double)N);
    be->ops->copy(be->ctx, dprobs, h_dprobs, sizeof(float) * (size_t)E, FM_COPY_H2D);
    const float z_scale = (float)(o->z_loss_coef * scale / ((double)L * (double)N));
    be->ops->router_bwd(be->ctx, dlogits, dtopk_w, dprobs, z_scale, s->probs, s->lse, s->topk_idx, s->topk_w, N, E, k,
                        o->norm_topk);
    /* the router GEMMs take the fp32 logit gradient as fm_act */
    if ((void *)dlogits_act != (void *)dlogits)
        be->ops->convert(be->ctx, dlogits_act, FM_ACT_DTYPE, dlogits, FM_DTYPE_F32, N * E);
    fm_linear_bwd(be, dx, 1.0f, dW, dlogits_act, x, W, N, H, E, 1.0f);
}
