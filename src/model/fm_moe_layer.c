/* The MoE block's glue: the dispatcher's schedule around the experts (fm_moe_layer.h), the only
 * caller of the experts' table (fm_experts.h: fm_experts_select), on one rank and under expert
 * parallelism alike. */
#include "fm_moe_layer.h"

#include "fm_experts.h"

/* The expert load of one dispatch into ws->counts [E] (when set): rows per expert. Sync-free
 * (the offsets not yet on the host): added on the device, into counts in pinned host memory
 * (the trainer's, fm_train_loop.c), which the host reads after the step's sync. */
static void count_load(const fm_backend *be, const fm_moe_dims *d, const fm_moe_ws *ws, const fm_moe_routes *r) {
    if (!ws || !ws->counts) return;
    if (d->sync_free) {
        be->ops->moe_count_add(be->ctx, ws->counts, r->offsets, d->E);
        return;
    }
    for (int64_t e = 0; e < d->E; e++) ws->counts[e] += r->offsets[e + 1] - r->offsets[e];
}

/* The one-rank block's arguments (fm_moe_layer.h's errors). */
static fm_status moe_check(const fm_moe_dims *d, int64_t N, int64_t K, const int32_t *chunk_tokens, bool plain,
                           const char *what) {
    if (N < 0) return fm_error(FM_ERR_ARG, "moe %s: N = %lld tokens; expected >= 0", what, (long long)N);
    if (d->E < 1 || d->k < 1 || d->k > d->E)
        return fm_error(FM_ERR_ARG, "moe %s: top-%lld of %lld experts; expected 1 <= k <= E", what, (long long)d->k,
                        (long long)d->E);
    if (!plain && (K < 1 || (N > 0 && !chunk_tokens)))
        return fm_error(FM_ERR_ARG, "moe %s: the chunked form needs K >= 1 chunks and their token order "
                        "(fm_moe_chunk_order), found K = %lld%s", what, (long long)K,
                        chunk_tokens ? "" : " and no order");
    return FM_OK;
}

fm_status fm_moe_forward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, fm_act *y,
                    const fm_act *x, const int32_t *topk_idx, const float *topk_w, int64_t N, int64_t K,
                    const int32_t *chunk_tokens, fm_moe_routes *saved, fm_moe_ws *ws) {
    FM_TRY(moe_check(d, N, K, chunk_tokens, saved != NULL, "forward"));
    const fm_moe_experts *ex = fm_experts_select(d);
    fm_moe_weights wq;
    ex->weights(be, d, w, ws, &wq, false); /* fp8: the layer's weights quantized once, for every chunk */
    w = &wq;
    if (saved) {
        fm_moe_dispatch(be, d, saved, x, topk_idx, N);
        count_load(be, d, ws, saved);
        ex->forward(be, d, w, saved, ws, N);
        fm_moe_combine(be, d, saved, y, topk_w, N);
        return FM_OK;
    }
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act);
    for (int64_t j = 0, start = 0; j < K; j++) {
        const int64_t n = fm_moe_chunk_size(N, K, j);
        const int32_t *tok = chunk_tokens + start;
        start += n;
        fm_moe_chunk_gather(be, d, ws, x, topk_idx, topk_w, tok, n);
        fm_moe_dispatch(be, d, &ws->r, ws->xc, ws->topk_idx, n);
        count_load(be, d, ws, &ws->r);
        ex->forward(be, d, w, &ws->r, ws, n);
        fm_moe_combine(be, d, &ws->r, ws->yc, ws->topk_w, n);
        fm_moe_chunk_scatter(be, y, ws->yc, tok, n, Hb);
    }
    return FM_OK;
}

fm_status fm_moe_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w,
                     const fm_moe_grads *g, fm_act *dx, float *dtopk_w, const fm_act *dy, const fm_act *x,
                     const int32_t *topk_idx, const float *topk_w, int64_t N, int64_t K,
                     const int32_t *chunk_tokens, const fm_moe_routes *saved, fm_moe_ws *ws) {
    FM_TRY(moe_check(d, N, K, chunk_tokens, saved != NULL, "backward"));
    const fm_moe_experts *ex = fm_experts_select(d);
    fm_moe_weights wq;
    /* fp8: this layer's codes from its forward or recompute just before (and with
     * --fp8-weight-cache its forward's, kept), else quantized again: the same bits */
    ex->weights(be, d, w, ws, &wq, true);
    w = &wq;
    if (saved) {
        fm_moe_combine_backward(be, d, saved, ws->dye, dtopk_w, dy, topk_w, N);
        ex->backward(be, d, w, g, saved, ws, N);
        fm_moe_dispatch_backward(be, d, saved, dx, ws->dxe, N);
        return FM_OK;
    }
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act);
    for (int64_t j = 0, start = 0; j < K; j++) {
        const int64_t n = fm_moe_chunk_size(N, K, j);
        const int32_t *tok = chunk_tokens + start;
        start += n;
        fm_moe_chunk_gather(be, d, ws, x, topk_idx, topk_w, tok, n);
        /* recompute the chunk's dispatch and experts (no combine: backward needs only ye) */
        fm_moe_dispatch(be, d, &ws->r, ws->xc, ws->topk_idx, n);
        ex->forward(be, d, w, &ws->r, ws, n);
        fm_moe_chunk_gather_rows(be, ws->yc, dy, tok, n, Hb);
        fm_moe_combine_backward(be, d, &ws->r, ws->dye, ws->dtopk_w, ws->yc, ws->topk_w, n);
        ex->backward(be, d, w, g, &ws->r, ws, n);
        fm_moe_dispatch_backward(be, d, &ws->r, ws->dxc, ws->dxe, n);
        fm_moe_chunk_scatter(be, dx, ws->dxc, tok, n, Hb);
        fm_moe_chunk_scatter(be, dtopk_w, ws->dtopk_w, tok, n, d->k * (int64_t)sizeof(float));
    }
    return FM_OK;
}

/* ---- expert parallelism: the EP operator's pass delivers each chunk's rows, the glue runs the
 * experts on them ---- */

/* Runs the experts on one work of an EP pass (fm_moe_ep_work): this rank's own experts over dl
 * with wq (their precision's form, made once per layer call), then the experts hosted for this
 * chunk, whose precision's form (fp8: quantized into the work's hws) is made here from the
 * weights received, every work (a recompute quantizes again: the same bits). */
static void ep_run_work(const fm_backend *be, const fm_moe_experts *ex, const fm_moe_dims *dl,
                        const fm_moe_weights *wq, const fm_moe_grads *g, fm_moe_ep_work *wk) {
    const bool bwd = wk->kind == FM_MOE_EP_WORK_BACKWARD;
    if (wk->rows + wk->hosted_rows > 0) {
        if (bwd) ex->backward(be, dl, wq, g, wk->r, wk->rws, wk->rows);
        else ex->forward(be, dl, wq, wk->r, wk->rws, wk->rows);
    }
    if (wk->hosted_E == 0 || wk->hosted_rows == 0) return;
    fm_moe_weights hq;
    ex->weights(be, &wk->hd, &wk->hw, &wk->hws, &hq, false);
    if (bwd) ex->backward(be, &wk->hd, &hq, &wk->hg, &wk->hr, &wk->hws, wk->hosted_rows);
    else ex->forward(be, &wk->hd, &hq, &wk->hr, &wk->hws, wk->hosted_rows);
}

/* Steps a begun pass to its end, running the experts on every work. */
static fm_status ep_run_pass(const fm_backend *be, fm_moe_ep_pass *p, const fm_moe_experts *ex,
                             const fm_moe_weights *wq, const fm_moe_grads *g) {
    fm_moe_ep_work *wk;
    fm_status st;
    while ((st = fm_moe_ep_next(p, &wk)) == FM_OK && wk) ep_run_work(be, ex, &p->dl, wq, g, wk);
    return st;
}

fm_status fm_moe_ep_block_forward(const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                                  const fm_moe_weights *w, fm_act *y, const fm_act *x, const int32_t *topk_idx,
                                  const float *topk_w, int64_t N, int64_t K, const int32_t *chunk_tokens,
                                  fm_moe_ep_ws *ws, double timeout_s) {
    /* the experts of this rank at the owner: their table and, under fp8, this layer's weights
     * quantized into the owner's working set once, for every chunk */
    const fm_moe_dims dl = fm_moe_ep_local_dims(d, ws->ep);
    const fm_moe_experts *ex = fm_experts_select(&dl);
    fm_moe_weights wq;
    ex->weights(be, &dl, w, &ws->exp_ws, &wq, false);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    fm_moe_ep_pass p;
    FM_TRY(fm_moe_ep_fwd_begin(&p, be, comm, d, w, y, x, topk_idx, topk_w, N, K, chunk_tokens, ws, timeout_s));
    return ep_run_pass(be, &p, ex, &wq, NULL);
}

fm_status fm_moe_ep_block_backward(const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                                   const fm_moe_weights *w, const fm_moe_grads *g, fm_act *dx, float *dtopk_w,
                                   const fm_act *dy, const fm_act *x, const int32_t *topk_idx, const float *topk_w,
                                   int64_t N, int64_t K, const int32_t *chunk_tokens, fm_moe_ep_ws *ws,
                                   double timeout_s) {
    const fm_moe_dims dl = fm_moe_ep_local_dims(d, ws->ep);
    const fm_moe_experts *ex = fm_experts_select(&dl);
    fm_moe_weights wq;
    ex->weights(be, &dl, w, &ws->exp_ws, &wq, true); /* fp8: the forward's or recompute's codes, kept */
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    fm_moe_ep_pass p;
    FM_TRY(fm_moe_ep_bwd_begin(&p, be, comm, d, w, g, dx, dtopk_w, dy, x, topk_idx, topk_w, N, K, chunk_tokens, ws,
                               timeout_s));
    return ep_run_pass(be, &p, ex, &wq, g);
}

fm_status fm_moe_ep_layer_forward(const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                                  const fm_moe_weights *w, fm_act *y, const fm_act *x, const int32_t *topk_idx,
                                  const float *topk_w, int64_t N, int64_t K, const int32_t *chunk_tokens,
                                  fm_moe_ep_ws *ws, int64_t *counts, int32_t *counts_host) {
    if (counts && N > 0) { /* this rank's routes per expert, as the local dispatch counts them */
        const int32_t *idx = topk_idx;
        if (!be->ops->host_memory) {
            be->ops->copy(be->ctx, counts_host, topk_idx, sizeof(int32_t) * (size_t)(N * d->k), FM_COPY_D2H);
            idx = counts_host;
        }
        for (int64_t i = 0; i < N * d->k; i++)
            if (idx[i] >= 0 && idx[i] < d->E) counts[idx[i]]++;
    }
    return fm_moe_ep_block_forward(be, comm, d, w, y, x, topk_idx, topk_w, N, K, chunk_tokens, ws, 0);
}

fm_status fm_moe_ep_layer_backward(const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                                   const fm_moe_weights *w, const fm_moe_grads *g, fm_act *dx, float *dtopk_w,
                                   const fm_act *dy, const fm_act *x, const int32_t *topk_idx, const float *topk_w,
                                   int64_t N, int64_t K, const int32_t *chunk_tokens, fm_moe_ep_ws *ws) {
    return fm_moe_ep_block_backward(be, comm, d, w, g, dx, dtopk_w, dy, x, topk_idx, topk_w, N, K, chunk_tokens, ws,
                                    0);
}
