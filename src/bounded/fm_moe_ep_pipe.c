/* Expert-parallel MoE, the pipelined chunk schedule (fm_moe_ep.h "Overlap"; fm_moe_ep_internal.h):
 * chunk i+1's dispatch exchange beside chunk i's expert GEMMs, chunk i's return beside chunk i+1's. */
#include "fm_moe_ep_internal.h"

bool fm_ep_pipelined(const fm_moe_ep_pass *c) {
    const fm_moe_ep_ws *ws = c->ws;
    if (ws->sets != 2 || ws->llep.on) return false;
    return ws->schedule == FM_MOE_EP_PIPELINED || (ws->schedule == FM_MOE_EP_AUTO && fm_comm_has_async(c->comm));
}

/* Chunk j's gather and dispatch on the op stream, without the host wait: the backend event
 * FM_MOE_EP_EVENT and a communicator mark follow it. */
static fm_status ep_pipe_route(const fm_moe_ep_pass *c, int64_t j, fm_moe_ep_chunk *ch) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const int64_t n = ch->n;
    fm_ep_view(ws, j);
    fm_moe_chunk_gather_rows(be, ws->xc, c->x, ch->tok, n, d->H * (int64_t)sizeof(fm_act));
    fm_moe_chunk_gather_rows(be, ws->topk_idx, c->topk_idx, ch->tok, n, d->k * (int64_t)sizeof(int32_t));
    fm_moe_chunk_gather_rows(be, ws->topk_w, c->topk_w, ch->tok, n, d->k * (int64_t)sizeof(float));
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
static fm_status ep_pipe_send(const fm_moe_ep_pass *c, int64_t j, int64_t err, fm_moe_ep_chunk *ch) {
    fm_moe_ep_ws *ws = c->ws;
    fm_ep_view(ws, j);
    if (ch->n > 0) c->be->ops->event_sync(c->be->ctx, FM_MOE_EP_EVENT);
    FM_TRY(fm_ep_agree(c, j, ch->n, err, &ch->R));
    return fm_ep_exchange_async(c, j, true, ws->src.xe, ws->recv, ch->mark, &ch->ticket);
}

/* The owner's part of chunk j before its work, after joining the exchange that brought its rows
 * (forward: xe gathered from the receive buffer; backward: dye). */
static fm_status ep_pipe_owner_in(const fm_moe_ep_pass *c, int64_t j, bool backward, const fm_moe_ep_chunk *ch) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const int64_t Hb = c->d->H * (int64_t)sizeof(fm_act), R = ch->R;
    fm_ep_view(ws, j);
    const fm_status st = fm_comm_join(c->comm, ch->ticket);
    if (st != FM_OK) return fm_ep_comm_fail(c, st, j);
    if (R > 0) be->ops->gather_rows(be->ctx, backward ? ws->exp_ws.dye : ws->exp.xe, ws->recv, ws->perm, R, Hb);
    return FM_OK;
}

/* The owner's part of chunk j after its work: its outputs (forward) or input gradients (backward)
 * into the receive buffer; then a mark. */
static fm_status ep_pipe_owner_out(const fm_moe_ep_pass *c, int64_t j, bool backward, fm_moe_ep_chunk *ch) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const int64_t Hb = c->d->H * (int64_t)sizeof(fm_act), R = ch->R;
    fm_ep_view(ws, j);
    if (R > 0) be->ops->scatter_rows(be->ctx, ws->recv, backward ? ws->exp_ws.dxe : ws->exp.ye, ws->perm, R, Hb);
    const fm_status st = fm_comm_mark(c->comm, &ch->mark);
    return st == FM_OK ? FM_OK : fm_ep_comm_fail(c, st, j);
}

/* Chunk j's receive buffer back to its sources' returned-rows buffer (async, after the mark). */
static fm_status ep_pipe_back(const fm_moe_ep_pass *c, int64_t j, fm_moe_ep_chunk *ch) {
    fm_moe_ep_ws *ws = c->ws;
    fm_ep_view(ws, j);
    return fm_ep_exchange_async(c, j, false, ws->recv, ws->src.ye, ch->mark, &ch->ticket);
}

/* Joins chunk j's latest exchange and points the views at its sets. */
static fm_status ep_pipe_join(const fm_moe_ep_pass *c, int64_t j, const fm_moe_ep_chunk *ch) {
    fm_ep_view(c->ws, j);
    const fm_status st = fm_comm_join(c->comm, ch->ticket);
    return st == FM_OK ? FM_OK : fm_ep_comm_fail(c, st, j);
}

/* Chunk i's source side (its tokens, then its routing and dispatch), as both passes issue it one
 * chunk ahead. */
static fm_status ep_pipe_next(fm_moe_ep_pass *c, int64_t i) {
    fm_ep_chunk_setup(c, i);
    return ep_pipe_route(c, i, &c->ch[i % 3]);
}

fm_status fm_ep_pipe_begin(fm_moe_ep_pass *c) {
    c->pipe = true;
    c->ws->pipelined_calls++;
    FM_TRY(ep_pipe_next(c, 0));
    return ep_pipe_send(c, 0, c->err, &c->ch[0]);
}

/* Chunk i's combine on the source (after joining its outputs' return), scattered into y. */
static fm_status ep_pipe_y(const fm_moe_ep_pass *c, int64_t i, const fm_moe_ep_chunk *ch) {
    fm_moe_ep_ws *ws = c->ws;
    FM_TRY(ep_pipe_join(c, i, ch));
    fm_moe_combine(c->be, c->d, &ws->src, ws->yc, ws->topk_w, ch->n);
    fm_moe_chunk_scatter(c->be, c->y, ws->yc, ch->tok, ch->n, c->d->H * (int64_t)sizeof(fm_act));
    return FM_OK;
}

/* Chunk j's dispatch backward on the source (after joining its row gradients' return). */
static fm_status ep_pipe_dx(const fm_moe_ep_pass *c, int64_t j, const fm_moe_ep_chunk *ch) {
    fm_moe_ep_ws *ws = c->ws;
    FM_TRY(ep_pipe_join(c, j, ch));
    fm_moe_dispatch_backward(c->be, c->d, &ws->src, ws->dxc, ws->src.ye, ch->n);
    fm_moe_chunk_scatter(c->be, c->dx, ws->dxc, ch->tok, ch->n, c->d->H * (int64_t)sizeof(fm_act));
    return FM_OK;
}

/* Iteration j (either pass), up to chunk j's work: chunk j+1's routing and dispatch (issued before
 * chunk j's expert GEMMs), then chunk j's rows joined at the owner. */
fm_status fm_ep_pipe_fwd_work(fm_moe_ep_pass *c, int64_t j, fm_moe_ep_work **work) {
    const int64_t Kr = c->K > 0 ? c->K : 1;
    if (j + 1 < Kr) FM_TRY(ep_pipe_next(c, j + 1));
    fm_moe_ep_chunk *cur = &c->ch[j % 3];
    FM_TRY(ep_pipe_owner_in(c, j, false, cur));
    *work = fm_ep_work(c, j, cur->R, FM_MOE_EP_WORK_FORWARD);
    return FM_OK;
}

/* After chunk j's FORWARD work: its outputs out, chunk j+1's agreement and exchange out, chunk
 * j's outputs back to their sources; then the forward combines chunk j-1, the backward runs chunk
 * j's combine backward and sends dye out: its BACKWARD work. */
fm_status fm_ep_pipe_fwd_done(fm_moe_ep_pass *c, int64_t j, fm_moe_ep_work **work) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act), Kr = c->K > 0 ? c->K : 1;
    fm_moe_ep_chunk *cur = &c->ch[j % 3];
    FM_TRY(ep_pipe_owner_out(c, j, false, cur));
    if (j + 1 < Kr) FM_TRY(ep_pipe_send(c, j + 1, 0, &c->ch[(j + 1) % 3]));
    FM_TRY(ep_pipe_back(c, j, cur));
    if (!c->backward) {
        if (j > 0) FM_TRY(ep_pipe_y(c, j - 1, &c->ch[(j + 2) % 3]));
        return FM_OK;
    }
    /* the source: the combine's backward, dye into the outgoing buffer (its x rows were sent) */
    FM_TRY(ep_pipe_join(c, j, cur));
    fm_moe_chunk_gather_rows(be, ws->yc, c->dy, cur->tok, cur->n, Hb);
    fm_moe_combine_backward(be, d, &ws->src, ws->src.xe, ws->dtopk_w, ws->yc, ws->topk_w, cur->n);
    fm_moe_chunk_scatter(be, c->dtopk_w, ws->dtopk_w, cur->tok, cur->n, d->k * (int64_t)sizeof(float));
    const fm_status st = fm_comm_mark(c->comm, &cur->mark);
    if (st != FM_OK) return fm_ep_comm_fail(c, st, j);
    FM_TRY(fm_ep_exchange_async(c, j, true, ws->src.xe, ws->recv, cur->mark, &cur->ticket));
    FM_TRY(ep_pipe_owner_in(c, j, true, cur));
    *work = fm_ep_work(c, j, cur->R, FM_MOE_EP_WORK_BACKWARD);
    return FM_OK;
}

/* After chunk j's BACKWARD work: its input gradients out and back (async), chunk j-1's dispatch
 * backward. */
fm_status fm_ep_pipe_bwd_done(fm_moe_ep_pass *c, int64_t j) {
    fm_moe_ep_chunk *cur = &c->ch[j % 3];
    FM_TRY(ep_pipe_owner_out(c, j, true, cur));
    FM_TRY(ep_pipe_back(c, j, cur)); /* the rows' input gradients into the returned-rows buffer */
    if (j > 0) FM_TRY(ep_pipe_dx(c, j - 1, &c->ch[(j + 2) % 3]));
    return FM_OK;
}

fm_status fm_ep_pipe_end(fm_moe_ep_pass *c) {
    const int64_t Kr = c->K > 0 ? c->K : 1;
    if (c->backward) FM_TRY(ep_pipe_dx(c, Kr - 1, &c->ch[(Kr - 1) % 3]));
    else FM_TRY(ep_pipe_y(c, Kr - 1, &c->ch[(Kr - 1) % 3]));
    fm_ep_view(c->ws, 0);
    return FM_OK;
}
