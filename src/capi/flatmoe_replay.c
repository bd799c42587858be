/* libflatmoe's routes (include/flatmoe.h): routing replay (R3) of a batch's routed_experts and the
 * routes taken, between the caller's [n_tokens, L_moe, k] and the model's rl_routes [L_moe, N, k]
 * (model/fm_acts.h), which the MoE layers' routers replay or record (fm_router_forward's replay). */
#include <math.h>
#include <string.h>

#include "fm_capi.h"

/* The batch's routed_experts: every id in [0, E), a token's k ids distinct. */
static fm_status check_routes(const flatmoe_session *s, const flatmoe_batch *b) {
    const int64_t E = s->r.cfg.num_experts, L = s->L_moe, k = s->k;
    for (int64_t t = 0; t < b->n_tokens; t++)
        for (int64_t l = 0; l < L; l++) {
            const int32_t *row = b->routed_experts + (t * L + l) * k;
            for (int64_t j = 0; j < k; j++) {
                if (row[j] < 0 || row[j] >= E)
                    return fm_error(FM_ERR_ARG, "batch: routed_experts[token %lld, MoE layer %lld, slot %lld] is %d; "
                                    "expected 0 .. %lld (the model's num_experts %lld); pass the experts the "
                                    "rollout engine routed to, [n_tokens, num_moe_layers %lld, top_k %lld]",
                                    (long long)t, (long long)l, (long long)j, row[j], (long long)E - 1, (long long)E,
                                    (long long)L, (long long)k);
                for (int64_t i = 0; i < j; i++)
                    if (row[i] == row[j])
                        return fm_error(FM_ERR_ARG, "batch: routed_experts[token %lld, MoE layer %lld] holds expert "
                                        "%d twice (slots %lld and %lld); a token's top_k experts are distinct",
                                        (long long)t, (long long)l, row[j], (long long)i, (long long)j);
            }
        }
    return FM_OK;
}

fm_status fm_capi_routes_stage(flatmoe_session *s, const flatmoe_batch *b) {
    fm_model *m = &s->r.m;
    if (!b->routed_experts) return FM_OK;
    if (!m->a.rl_routes) /* a model without MoE layers: nothing to replay */
        return fm_error(FM_ERR_ARG, "batch: routed_experts given, but the model has no MoE layer (num_moe_layers 0); "
                        "pass NULL");
    FM_TRY(check_routes(s, b));
    const int64_t L = s->L_moe, k = s->k, N = s->budget;
    for (int64_t i = 0; i < L * N * k; i++) s->routes[i] = -1; /* padding: the router's choice */
    for (int64_t t = 0; t < b->n_tokens; t++)
        for (int64_t l = 0; l < L; l++)
            memcpy(s->routes + (l * N + s->pos_of[t]) * k, b->routed_experts + (t * L + l) * k,
                   sizeof(int32_t) * (size_t)k);
    /* a blocking copy (sync point "replayed routes"): the host staging is reused by the next batch */
    m->be.ops->copy(m->be.ctx, m->a.rl_routes, s->routes, sizeof(int32_t) * (size_t)(L * N * k), FM_COPY_H2D);
    return m->be.ops->status(m->be.ctx); /* replayed when the call's switches say so (fm_capi_call_begin) */
}

fm_status fm_capi_routes_read(flatmoe_session *s, const flatmoe_batch *b, int32_t *out) {
    fm_model *m = &s->r.m;
    const int64_t L = s->L_moe, k = s->k, N = s->budget;
    if (L == 0) return FM_OK; /* no MoE layer: [n_tokens, 0, k] holds nothing */
    if (b->routed_experts) { /* replayed: the routes taken are the given ones */
        memcpy(out, b->routed_experts, sizeof(int32_t) * (size_t)(b->n_tokens * L * k));
        return FM_OK;
    }
    m->be.ops->stream_sync(m->be.ctx, FM_STREAM_COMPUTE); /* sync point "routes taken" */
    m->be.ops->copy(m->be.ctx, s->routes, m->a.rl_routes, sizeof(int32_t) * (size_t)(L * N * k), FM_COPY_D2H);
    FM_TRY(m->be.ops->status(m->be.ctx));
    for (int64_t t = 0; t < b->n_tokens; t++)
        for (int64_t l = 0; l < L; l++)
            memcpy(out + (t * L + l) * k, s->routes + (l * N + s->pos_of[t]) * k, sizeof(int32_t) * (size_t)k);
    return FM_OK;
}

/* The forward's top-K log-probs (model positions) into each caller token's first k: the row of the
 * position that predicted it; a sequence's first token gets -inf and -1. A sync point. */
static fm_status topk_read(flatmoe_session *s, const flatmoe_batch *b, int64_t k, float *lp, int32_t *id) {
    fm_model *m = &s->r.m;
    const int64_t K = s->topk_max, N = s->budget;
    m->be.ops->stream_sync(m->be.ctx, FM_STREAM_COMPUTE); /* sync point "top-k log-probs" */
    m->be.ops->copy(m->be.ctx, s->topk_lp, m->a.rl_topk_lp, sizeof(float) * (size_t)(N * K), FM_COPY_D2H);
    m->be.ops->copy(m->be.ctx, s->topk_id, m->a.rl_topk_id, sizeof(int32_t) * (size_t)(N * K), FM_COPY_D2H);
    FM_TRY(m->be.ops->status(m->be.ctx));
    for (int64_t t = 0; t < b->n_tokens; t++) {
        const bool first = t == 0 || s->seq_of[t - 1] != s->seq_of[t];
        const int64_t p = first ? 0 : s->pos_of[t - 1];
        for (int64_t j = 0; j < k; j++) {
            lp[t * k + j] = first ? -INFINITY : s->topk_lp[p * K + j];
            id[t * k + j] = first ? -1 : s->topk_id[p * K + j];
        }
    }
    return FM_OK;
}

int flatmoe_logprobs_ex(flatmoe_session *s, const flatmoe_batch *b, float *logprobs, float *entropy,
                        int32_t *routed_experts, int64_t topk, float *topk_logprobs, int32_t *topk_ids) {
    if (!s) return fm_error(FM_ERR_ARG, "flatmoe_logprobs_ex: the session is NULL");
    FM_TRY(fm_capi_awake(s, "flatmoe_logprobs_ex"));
    /* the arguments, then the batch: a rank refusing either still joins the agreement (no rank waits) */
    fm_status ok = FM_OK;
    if (!logprobs) ok = fm_error(FM_ERR_ARG, "flatmoe_logprobs_ex: logprobs is NULL; pass an [n_tokens] fp32 array");
    else if (topk < 0 || topk > s->topk_max)
        ok = fm_error(FM_ERR_ARG, "flatmoe_logprobs_ex: topk %lld; expected 0 .. %lld (the session's --logprobs-topk); "
                      "open the session with --logprobs-topk %lld or more", (long long)topk, (long long)s->topk_max,
                      (long long)topk);
    else if (topk > 0 && (!topk_logprobs || !topk_ids))
        ok = fm_error(FM_ERR_ARG, "flatmoe_logprobs_ex: topk %lld with topk_%s NULL; pass both [n_tokens, topk] "
                      "arrays", (long long)topk, topk_logprobs ? "ids" : "logprobs");
    if (ok == FM_OK) ok = fm_capi_pack(s, b, true);
    FM_TRY(fm_capi_agree(s, ok, "flatmoe_logprobs_ex")); /* many ranks: each its own batch */
    fm_capi_call_begin(s, b, false, false);
    fm_status st = fm_capi_forward(s, b);
    fm_capi_call_end(s);
    FM_TRY(st);
    memcpy(logprobs, s->logp, sizeof(float) * (size_t)b->n_tokens);
    if (entropy) memcpy(entropy, s->ent, sizeof(float) * (size_t)b->n_tokens);
    if (routed_experts) FM_TRY(fm_capi_routes_read(s, b, routed_experts));
    if (topk > 0) FM_TRY(topk_read(s, b, topk, topk_logprobs, topk_ids));
    return FLATMOE_OK;
}
