/* Expert-parallel MoE, the pipelined chunk schedule (fm_moe_ep.h "Overlap"; fm_moe_ep_internal.h):
 * chunk i+1's dispatch exchange beside chunk i's expert GEMMs, chunk i's return beside chunk i+1's. */
#include "fm_moe_ep_internal.h"

/* One chunk in flight: its tokens, rows received, and the marks and tickets of its exchanges. */
typedef struct ep_chunk {
    int64_t n, R;
    const int32_t *tok;
    int mark;   /* the op stream after this chunk's last op before an exchange */
    int ticket; /* its latest exchange */
} ep_chunk;

bool fm_ep_pipelined(const ep_call *c) {
    const fm_moe_ep_ws *ws = c->ws;
    if (ws->sets != 2 || ws->llep.on) return false;
    return ws->schedule == FM_MOE_EP_PIPELINED || (ws->schedule == FM_MOE_EP_AUTO && fm_comm_has_async(c->comm));
}

/* Chunk j's gather and dispatch on the op stream, without the host wait: the backend event
 * FM_MOE_EP_EVENT and a communicator mark follow it. */
static fm_status ep_pipe_route(const ep_call *c, int64_t j, const fm_act *x, const int32_t *topk_idx,
                               const float *topk_w, ep_chunk *ch) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const int64_t n = ch->n;
    fm_ep_view(ws, j);
    fm_moe_chunk_gather_rows(be, ws->xc, x, ch->tok, n, d->H * (int64_t)sizeof(fm_act));
    fm_moe_chunk_gather_rows(be, ws->topk_idx, topk_idx, ch->tok, n, d->k * (int64_t)sizeof(int32_t));
    fm_moe_chunk_gather_rows(be, ws->topk_w, topk_w, ch->tok, n, d->k * (int64_t)sizeof(float));
    if (n > 0) {
        fm_moe_dims ds = *d;
        ds.sync_free = true; /* the same ops; the host waits below on the event, not the stream */
        fm_moe_dispatch(be, &ds, &ws->src, ws->xc, ws->topk_idx, n);
        be->ops->event_record(be->ctx, FM_MOE_EP_EVENT, FM_STREAM_OPS);
    } else {
        fm_moe_dispatch(be, d, &ws->src, ws->xc, ws->topk_idx, 0); /* the offsets are zero, no wait */
    }
    const fm_status st = fm_comm_mark(c->comm, &ch->mark);
    return st == FM_OK ? FM_OK : fm_ep_comm_fail(c, st, j);
}

/* Chunk j's agreement (the host waits for its dispatch only: the "MoE offsets" sync point) and
 * its rows out to the owners, async after the dispatch's mark. */
static fm_status ep_pipe_send(const ep_call *c, int64_t j, int64_t err, ep_chunk *ch) {
    fm_moe_ep_ws *ws = c->ws;
    fm_ep_view(ws, j);
    if (ch->n > 0) c->be->ops->event_sync(c->be->ctx, FM_MOE_EP_EVENT);
    FM_TRY(fm_ep_agree(c, j, ch->n, err, &ch->R));
    return fm_ep_exchange_async(c, j, true, ws->src.xe, ws->recv, ch->mark, &ch->ticket);
}

/* The owner's part of chunk j, after joining the exchange that brought its rows: the forward
 * (backward = false: gather, experts, outputs into the receive buffer) or the backward (dye
 * gathered, the experts' backward, dxe into the receive buffer); then a mark. */
static fm_status ep_pipe_owner(const ep_call *c, int64_t j, bool backward, const fm_moe_grads *g, ep_chunk *ch) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act), R = ch->R;
    fm_ep_view(ws, j);
    fm_status st = fm_comm_join(c->comm, ch->ticket);
    if (st != FM_OK) return fm_ep_comm_fail(c, st, j);
    if (R > 0 && !backward) {
        be->ops->gather_rows(be->ctx, ws->exp.xe, ws->recv, ws->perm, R, Hb);
        c->ex->forward(be, &c->dl, c->w, &ws->exp, &ws->exp_ws, R);
        be->ops->scatter_rows(be->ctx, ws->recv, ws->exp.ye, ws->perm, R, Hb);
    } else if (R > 0) {
        be->ops->gather_rows(be->ctx, ws->exp_ws.dye, ws->recv, ws->perm, R, Hb);
        c->ex->backward(be, &c->dl, c->w, g, &ws->exp, &ws->exp_ws, R);
        be->ops->scatter_rows(be->ctx, ws->recv, ws->exp_ws.dxe, ws->perm, R, Hb);
    }
    st = fm_comm_mark(c->comm, &ch->mark);
    return st == FM_OK ? FM_OK : fm_ep_comm_fail(c, st, j);
}

/* Chunk j's receive buffer back to its sources' returned-rows buffer (async, after the mark). */
static fm_status ep_pipe_back(const ep_call *c, int64_t j, ep_chunk *ch) {
    fm_moe_ep_ws *ws = c->ws;
    fm_ep_view(ws, j);
    return fm_ep_exchange_async(c, j, false, ws->recv, ws->src.ye, ch->mark, &ch->ticket);
}

/* Joins chunk j's latest exchange and points the views at its sets. */
static fm_status ep_pipe_join(const ep_call *c, int64_t j, const ep_chunk *ch) {
    fm_ep_view(c->ws, j);
    const fm_status st = fm_comm_join(c->comm, ch->ticket);
    return st == FM_OK ? FM_OK : fm_ep_comm_fail(c, st, j);
}

static int64_t ep_chunks_setup(ep_chunk *ch, int64_t j, int64_t N, int64_t K, int64_t err, const int32_t *chunk_tokens,
                               int64_t *start) {
    ch->n = err ? 0 : fm_moe_chunk_size(N, K, j);
    ch->tok = chunk_tokens + *start;
    ch->R = 0, ch->mark = -1, ch->ticket = -1;
    *start += ch->n;
    return ch->n;
}

/* Chunk i's source side (its tokens, then its routing and dispatch: ep_chunks_setup, ep_pipe_route),
 * as both pipelined passes issue it one chunk ahead. */
static fm_status ep_pipe_next(ep_call *c, ep_chunk *ch, int64_t i, int64_t N, int64_t err, const int32_t *chunk_tokens,
                              int64_t *start, const fm_act *x, const int32_t *topk_idx, const float *topk_w) {
    ep_chunks_setup(ch, i, N, c->K, err, chunk_tokens, start);
    return ep_pipe_route(c, i, x, topk_idx, topk_w, ch);
}

/* Both pipelined passes' start: chunk 0 routed and its exchange out issued. */
static fm_status ep_pipe_begin(ep_call *c, ep_chunk *ch, int64_t N, int64_t err, const int32_t *chunk_tokens,
                               int64_t *start, const fm_act *x, const int32_t *topk_idx, const float *topk_w) {
    c->pipe = true;
    c->ws->pipelined_calls++;
    FM_TRY(ep_pipe_next(c, &ch[0], 0, N, err, chunk_tokens, start, x, topk_idx, topk_w));
    return ep_pipe_send(c, 0, err, &ch[0]);
}

/* Both pipelined passes' iteration i up to chunk i's return (ch: the three chunks in flight, chunk
 * i at ch[i % 3]): chunk i+1's routing and dispatch, chunk i's experts forward (in the backward:
 * the recompute), chunk i+1's agreement and exchange out, chunk i's outputs back to its sources. */
static fm_status ep_pipe_ahead(ep_call *c, ep_chunk *ch, int64_t i, int64_t N, int64_t err, const int32_t *chunk_tokens,
                               int64_t *start, const fm_act *x, const int32_t *topk_idx, const float *topk_w) {
    const int64_t Kr = c->K > 0 ? c->K : 1;
    ep_chunk *cur = &ch[i % 3], *nxt = &ch[(i + 1) % 3];
    if (i + 1 < Kr) FM_TRY(ep_pipe_next(c, nxt, i + 1, N, err, chunk_tokens, start, x, topk_idx, topk_w));
    FM_TRY(ep_pipe_owner(c, i, false, NULL, cur));
    if (i + 1 < Kr) FM_TRY(ep_pipe_send(c, i + 1, 0, nxt));
    return ep_pipe_back(c, i, cur);
}

/* Chunk i's combine on the source (after joining its outputs' return), scattered into y. */
static fm_status ep_pipe_y(const ep_call *c, int64_t i, const ep_chunk *ch, fm_act *y) {
    fm_moe_ep_ws *ws = c->ws;
    FM_TRY(ep_pipe_join(c, i, ch));
    fm_moe_combine(c->be, c->d, &ws->src, ws->yc, ws->topk_w, ch->n);
    fm_moe_chunk_scatter(c->be, y, ws->yc, ch->tok, ch->n, c->d->H * (int64_t)sizeof(fm_act));
    return FM_OK;
}

/* The forward, pipelined: iteration i issues chunk i+1's dispatch, chunk i's experts, chunk
 * i+1's agreement and exchange out, chunk i's exchange back, chunk i-1's combine. */
fm_status fm_ep_pipe_forward(ep_call *c, fm_act *y, const fm_act *x, const int32_t *topk_idx,
                             const float *topk_w, int64_t N, const int32_t *chunk_tokens, int64_t err) {
    const int64_t K = c->K, Kr = K > 0 ? K : 1;
    ep_chunk ch[3];
    int64_t start = 0;
    FM_TRY(ep_pipe_begin(c, ch, N, err, chunk_tokens, &start, x, topk_idx, topk_w));
    for (int64_t i = 0; i < Kr; i++) {
        FM_TRY(ep_pipe_ahead(c, ch, i, N, err, chunk_tokens, &start, x, topk_idx, topk_w));
        if (i > 0) FM_TRY(ep_pipe_y(c, i - 1, &ch[(i + 2) % 3], y));
    }
    FM_TRY(ep_pipe_y(c, Kr - 1, &ch[(Kr - 1) % 3], y));
    fm_ep_view(c->ws, 0);
    return FM_OK;
}

/* Chunk j's dispatch backward on the source (after joining its row gradients' return). */
static fm_status ep_pipe_dx(const ep_call *c, int64_t j, const ep_chunk *ch, fm_act *dx) {
    fm_moe_ep_ws *ws = c->ws;
    FM_TRY(ep_pipe_join(c, j, ch));
    fm_moe_dispatch_backward(c->be, c->d, &ws->src, ws->dxc, ws->src.ye, ch->n);
    fm_moe_chunk_scatter(c->be, dx, ws->dxc, ch->tok, ch->n, c->d->H * (int64_t)sizeof(fm_act));
    return FM_OK;
}

/* The backward, pipelined: iteration j issues chunk j+1's dispatch, chunk j's expert recompute,
 * chunk j+1's agreement and exchange out, chunk j's outputs back, its combine backward, dye out,
 * its experts' backward, its row gradients back, chunk j-1's dispatch backward. */
fm_status fm_ep_pipe_backward(ep_call *c, const fm_moe_grads *g, fm_act *dx, float *dtopk_w, const fm_act *dy,
                              const fm_act *x, const int32_t *topk_idx, const float *topk_w, int64_t N,
                              const int32_t *chunk_tokens, int64_t err) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act), K = c->K, Kr = K > 0 ? K : 1;
    ep_chunk ch[3];
    int64_t start = 0;
    FM_TRY(ep_pipe_begin(c, ch, N, err, chunk_tokens, &start, x, topk_idx, topk_w));
    for (int64_t j = 0; j < Kr; j++) {
        ep_chunk *cur = &ch[j % 3], *prv = &ch[(j + 2) % 3];
        FM_TRY(ep_pipe_ahead(c, ch, j, N, err, chunk_tokens, &start, x, topk_idx, topk_w)); /* the recompute */
        /* the source: the combine's backward, dye into the outgoing buffer (its x rows were sent) */
        FM_TRY(ep_pipe_join(c, j, cur));
        fm_moe_chunk_gather_rows(be, ws->yc, dy, cur->tok, cur->n, Hb);
        fm_moe_combine_backward(be, d, &ws->src, ws->src.xe, ws->dtopk_w, ws->yc, ws->topk_w, cur->n);
        fm_moe_chunk_scatter(be, dtopk_w, ws->dtopk_w, cur->tok, cur->n, d->k * (int64_t)sizeof(float));
        fm_status st = fm_comm_mark(c->comm, &cur->mark);
        if (st != FM_OK) return fm_ep_comm_fail(c, st, j);
        FM_TRY(fm_ep_exchange_async(c, j, true, ws->src.xe, ws->recv, cur->mark, &cur->ticket));
        FM_TRY(ep_pipe_owner(c, j, true, g, cur)); /* the experts' backward */
        FM_TRY(ep_pipe_back(c, j, cur));           /* the rows' input gradients into the returned-rows buffer */
        if (j > 0) FM_TRY(ep_pipe_dx(c, j - 1, prv, dx));
    }
    FM_TRY(ep_pipe_dx(c, Kr - 1, &ch[(Kr - 1) % 3], dx));
    fm_ep_view(ws, 0);
    return FM_OK;
}
