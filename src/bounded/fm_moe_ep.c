/* Expert-parallel MoE: capped, strided chunks exchanged by all-to-all-v (fm_moe_ep.h). */
#include "fm_moe_ep_internal.h"

#include <stdlib.h>
#include <string.h>

#define R4(x) fm_arena_round((size_t)(x) * 4)
#define R8(x) fm_arena_round((size_t)(x) * 8)
#define RA(x) fm_arena_round((size_t)(x) * a)

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

fm_status fm_moe_ep_check(const fm_moe_dims *d, int ep, int64_t c) {
    if (ep < 1) return fm_error(FM_ERR_ARG, "moe_ep: the ep degree is %d; expected >= 1", ep);
    if (d->E % ep != 0)
        return fm_error(FM_ERR_ARG,
                        "moe_ep: num_experts %lld is not divisible by the ep degree %d (experts are split in "
                        "contiguous blocks of E/ep per rank); choose an ep degree that divides %lld",
                        (long long)d->E, ep, (long long)d->E);
    if (c < 1)
        return fm_error(FM_ERR_ARG, "moe_ep: the token cap per source per chunk is %lld; expected >= 1",
                        (long long)c);
    if ((int64_t)ep * (d->E + T_EXTRA) > FM_COMM_HOST_MAX_ELEMS)
        return fm_error(FM_ERR_ARG,
                        "moe_ep: the count table of ep %d x (num_experts %lld + 5) int64 exceeds the "
                        "communicator's host all-reduce limit of %d elements; use a smaller ep degree",
                        ep, (long long)d->E, FM_COMM_HOST_MAX_ELEMS);
    return FM_OK;
}

static bool llep_on(const fm_llep_opts *o) { return o && o->on; }

fm_moe_dims fm_moe_ep_local_dims(const fm_moe_dims *d, int ep) {
    fm_moe_dims dl = *d;
    dl.E = ep > 0 ? d->E / ep : d->E;
    dl.k = 1;
    dl.sync_free = false;
    return dl;
}

fm_moe_dims fm_moe_ep_hosted_dims(const fm_moe_dims *d, int64_t E_host) {
    fm_moe_dims dh = *d;
    dh.E = E_host;
    dh.k = 1;
    dh.sync_free = false;
    dh.fp8_cache_layers = 0;
    return dh;
}

size_t fm_moe_ep_bound_bytes(const fm_moe_dims *d, int ep, int64_t c, size_t a, const fm_llep_opts *llep,
                             fm_moe_ep_bound *b) {
    fm_moe_ep_bound z;
    memset(&z, 0, sizeof z);
    if (b) *b = z;
    if (ep < 1 || c < 1 || d->E % ep != 0) return 0;
    const int64_t H = d->H, I = d->I, k = d->k, E_loc = d->E / ep;
    const int64_t Rm = (int64_t)ep * c * min64(k, E_loc);
    const int S = llep_on(llep) ? 1 : 2, T = S == 2 ? 3 : 1; /* sets; routing sets */
    z.rows_max = Rm;
    z.sets = S;
    z.recv = S * RA(Rm * H);
    z.send = 2 * S * RA(c * k * H);
    z.source = 3 * RA(c * H) + (2 + 3 * T) * R4(c * k);
    z.experts = 3 * RA(Rm * H) + 6 * RA(Rm * I) + S * R4(Rm);
    const fm_moe_dims dl = fm_moe_ep_local_dims(d, ep);
    z.fp8 = fm_moe_fp8_bytes(&dl, Rm, a);
    z.host = R8(d->E + 1) + S * R8(E_loc + 1) + R8((int64_t)ep * (d->E + T_EXTRA)) + (4 * S + 1) * R8(ep) +
             S * R4(Rm);
    if (llep_on(llep)) {
        const int64_t F = llep->max_foreign, PM = (int64_t)(ep - 1) * min64(F, E_loc);
        z.llep = 6 * RA(F * I * H) + 3 * RA(PM * I * H) + R4(c * k);
        const fm_moe_dims dh = fm_moe_ep_hosted_dims(d, F);
        z.llep += fm_moe_fp8_bytes(&dh, Rm, a); /* the hosted experts' precision operands (0 without fp8) */
        z.host += R4(c * k) + 4 * R8(ep) + R8(F + 1) + R8(d->E) + R4(PM) + fm_llep_plan_bytes(ep, d->E, F);
        if (d->bias) { /* gpt_oss: the hosted experts' biases, B = 2I + H each (fm_moe_ep_ws.fb ..) */
            const int64_t B = 2 * I + H;
            z.llep += 3 * RA(F * B) + RA(PM * B);
            z.host += 4 * R8(ep);
        }
    }
    z.device = z.recv + z.send + z.source + z.experts + z.fp8 + z.llep;
    if (b) *b = z;
    return z.device;
}

/* Points the per-chunk views of w at chunk j's sets (fm_moe_ep_ws; one set: set 0 always). */
void fm_ep_view(fm_moe_ep_ws *w, int64_t j) {
    const int a = w->sets == 2 ? (int)(j & 1) : 0, b = w->sets == 2 ? (int)(j % 3) : 0;
    w->recv = w->recv_s[a];
    w->src.xe = w->xe_s[a];
    w->src.ye = w->ye_s[a];
    w->perm = w->perm_s[a];
    w->perm_host = w->perm_host_s[a];
    w->exp.offsets = w->exp_off_s[a];
    w->send_counts = w->cnt_s[a][0];
    w->send_displs = w->cnt_s[a][1];
    w->recv_counts = w->cnt_s[a][2];
    w->recv_displs = w->cnt_s[a][3];
    w->topk_w = w->topk_w_s[b];
    w->src.row_route = w->row_route_s[b];
    w->src.route_row = w->route_row_s[b];
}

#define TAKE(ar, type, count) ((type *)fm_arena_alloc((ar), sizeof(type) * (size_t)(count)))

fm_status fm_moe_ep_ws_layout(fm_moe_ep_ws *w, fm_arena *dev, fm_arena *host, const fm_moe_dims *d, int ep,
                              int rank, int64_t c, const fm_llep_opts *llep) {
    FM_TRY(fm_moe_ep_check(d, ep, c));
    if (llep_on(llep) && !(llep->lambda >= 1 && llep->alpha > 0 && llep->min_piece >= 1 && llep->max_foreign >= 1))
        return fm_error(FM_ERR_ARG, "moe_ep: least-loaded placement options lambda %g, alpha %g, min_piece %lld, "
                        "max_foreign %lld; expected lambda >= 1, alpha > 0, min_piece >= 1, max_foreign >= 1 "
                        "(defaults: fm_llep_defaults)", llep->lambda, llep->alpha, (long long)llep->min_piece,
                        (long long)llep->max_foreign);
    if (rank < 0 || rank >= ep)
        return fm_error(FM_ERR_ARG, "moe_ep: rank %d is not in the ep group of %d ranks (expected 0..%d)", rank, ep,
                        ep - 1);
    memset(w, 0, sizeof *w);
    const int64_t H = d->H, I = d->I, k = d->k;
    w->ep = ep;
    w->rank = rank;
    w->E_loc = d->E / ep;
    w->c = c;
    w->rows_per_src = c * min64(k, w->E_loc);
    w->rows_max = (int64_t)ep * w->rows_per_src;
    const int64_t Rm = w->rows_max;
    const int S = llep_on(llep) ? 1 : 2, T = S == 2 ? 3 : 1; /* as fm_moe_ep_bound_bytes */
    w->sets = S;
    /* device: recv, send, source, experts (the order of fm_moe_ep_bound) */
    for (int s = 0; s < S; s++) w->recv_s[s] = TAKE(dev, fm_act, Rm * H);
    for (int s = 0; s < S; s++) {
        w->xe_s[s] = TAKE(dev, fm_act, c * k * H);
        w->ye_s[s] = TAKE(dev, fm_act, c * k * H);
    }
    w->xc = TAKE(dev, fm_act, c * H);
    w->yc = TAKE(dev, fm_act, c * H);
    w->dxc = TAKE(dev, fm_act, c * H);
    w->topk_idx = TAKE(dev, int32_t, c * k);
    for (int s = 0; s < T; s++) w->topk_w_s[s] = TAKE(dev, float, c * k);
    w->dtopk_w = TAKE(dev, float, c * k);
    for (int s = 0; s < T; s++) {
        w->row_route_s[s] = TAKE(dev, int32_t, c * k);
        w->route_row_s[s] = TAKE(dev, int32_t, c * k);
    }
    w->exp.xe = TAKE(dev, fm_act, Rm * H);
    w->exp.ye = TAKE(dev, fm_act, Rm * H);
    w->exp_ws.dxe = TAKE(dev, fm_act, Rm * H);
    w->exp.h_gate = TAKE(dev, fm_act, Rm * I);
    w->exp.h_up = TAKE(dev, fm_act, Rm * I);
    w->exp.h_act = TAKE(dev, fm_act, Rm * I);
    w->exp_ws.dact = TAKE(dev, fm_act, Rm * I);
    w->exp_ws.dh_gate = TAKE(dev, fm_act, Rm * I);
    w->exp_ws.dh_up = TAKE(dev, fm_act, Rm * I);
    const fm_moe_dims dl = fm_moe_ep_local_dims(d, ep);
    fm_moe_ws_fp8_layout(&w->exp_ws, dev, &dl, Rm); /* the fp8 experts' operands (nothing without d->fp8) */
    w->exp_ws.counts = NULL;
    /* set 1's permutation below set 0's: the working set's top byte is set 0's last row, written
     * whenever a chunk of the serial schedule (set 0 only) fills R_max, so the painted high-water
     * mark reaches the bound there as it did with one set */
    for (int s = S - 1; s >= 0; s--) w->perm_s[s] = TAKE(dev, int32_t, Rm);
    w->exp_ws.dye = w->exp.ye; /* ye is sent back before dye arrives */
    if (llep_on(llep)) {
        w->llep = *llep;
        w->F = llep->max_foreign;
        w->pairs_max = (int64_t)(ep - 1) * min64(w->F, w->E_loc);
        for (int m = 0; m < 3; m++) w->fw[m] = TAKE(dev, fm_act, w->F * I * H);
        for (int m = 0; m < 3; m++) w->fg[m] = TAKE(dev, fm_act, w->F * I * H);
        for (int m = 0; m < 3; m++) w->stage[m] = TAKE(dev, fm_act, w->pairs_max * I * H);
        w->pack = TAKE(dev, int32_t, c * k);
        const fm_moe_dims dh = fm_moe_ep_hosted_dims(d, w->F);
        fm_moe_ws_fp8_layout(&w->hosted, dev, &dh, Rm); /* the hosted experts' operands (nothing without d->fp8) */
        if (d->bias) { /* the hosted experts' biases (fm_moe_ep_bound's llep part) */
            const int64_t B = 2 * I + H;
            w->fb = TAKE(dev, fm_act, w->F * B);
            w->fbg = TAKE(dev, fm_act, w->F * B);
            w->bpack = TAKE(dev, fm_act, w->F * B);
            w->bstage = TAKE(dev, fm_act, w->pairs_max * B);
        }
    }
    /* host */
    w->src.offsets = TAKE(host, int64_t, d->E + 1);
    for (int s = 0; s < S; s++) w->exp_off_s[s] = TAKE(host, int64_t, w->E_loc + 1);
    w->table = TAKE(host, int64_t, (int64_t)ep * (d->E + T_EXTRA));
    for (int s = 0; s < S; s++)
        for (int a = 0; a < 4; a++) w->cnt_s[s][a] = TAKE(host, int64_t, ep);
    w->cursor = TAKE(host, int64_t, ep);
    for (int s = 0; s < S; s++) w->perm_host_s[s] = TAKE(host, int32_t, Rm);
    if (llep_on(llep)) {
        w->pack_host = TAKE(host, int32_t, c * k);
        w->wsend_counts = TAKE(host, int64_t, ep);
        w->wsend_displs = TAKE(host, int64_t, ep);
        w->wrecv_counts = TAKE(host, int64_t, ep);
        w->wrecv_displs = TAKE(host, int64_t, ep);
        w->foff = TAKE(host, int64_t, w->F + 1);
        w->load = TAKE(host, int64_t, d->E);
        w->pair_local = TAKE(host, int32_t, w->pairs_max);
        fm_llep_plan_layout(&w->plan, host, ep, d->E, w->F);
        if (d->bias) {
            w->bsend_counts = TAKE(host, int64_t, ep);
            w->bsend_displs = TAKE(host, int64_t, ep);
            w->brecv_counts = TAKE(host, int64_t, ep);
            w->brecv_displs = TAKE(host, int64_t, ep);
        }
    }
    fm_ep_view(w, 0);
    w->schedule = FM_MOE_EP_AUTO; /* the caller's choice, if any, after the layout: fm_moe_ep_ws_set_schedule */
    w->schedule_bad = false;
    return FM_OK;
}

void fm_moe_ep_ws_set_schedule(fm_moe_ep_ws *w, int schedule) {
    /* a bad value does not fail here (the model's layout is checked before it is made): it is
     * agreed at the first chunk, where every rank refuses it alike */
    const bool ok = schedule == FM_MOE_EP_AUTO || schedule == FM_MOE_EP_SERIAL || schedule == FM_MOE_EP_PIPELINED;
    w->schedule = ok ? (fm_moe_ep_schedule)schedule : FM_MOE_EP_AUTO;
    w->schedule_bad = !ok;
}

fm_status fm_moe_ep_chunks(const fm_comm *comm, int64_t N, int64_t c, double timeout_s, int64_t *K) {
    if (N < 0 || c < 1)
        return fm_error(FM_ERR_ARG, "moe_ep: chunks of N = %lld tokens with cap c = %lld: expected N >= 0, c >= 1",
                        (long long)N, (long long)c);
    int64_t k = N == 0 ? 1 : (N + c - 1) / c;
    FM_TRY(fm_comm_allreduce_max_i64(comm, &k, 1, timeout_s));
    *K = k;
    return FM_OK;
}

/* Local checks before the first collective; a failure here is agreed at chunk 0 (err flag). */
static fm_status ep_begin(fm_moe_ep_pass *c, int64_t N, int64_t K) {
    const fm_moe_ep_ws *ws = c->ws;
    if (fm_comm_size(c->comm) != ws->ep || fm_comm_rank(c->comm) != ws->rank)
        return fm_error(FM_ERR_ARG, "moe_ep %s: the communicator is rank %d of %d but the working set was laid out "
                        "for rank %d of %d", c->what, fm_comm_rank(c->comm), fm_comm_size(c->comm), ws->rank, ws->ep);
    if (fm_comm_mem_is_host(c->comm) && !c->be->ops->host_memory)
        return fm_error(FM_ERR_ARG, "moe_ep %s: the communicator moves host memory but the backend's buffers are "
                        "device memory; create the communicator over the backend", c->what);
    if (N < 0) return fm_error(FM_ERR_ARG, "moe_ep %s: N = %lld tokens; expected >= 0", c->what, (long long)N);
    if (ws->llep.on) { /* a spilled chunk sends the biases only when the layout holds them (d->bias) */
        const bool wb = c->w && c->w->b_gate && c->w->b_up && c->w->b_down;
        const bool gb = !c->backward || (c->g && c->g->b_gate && c->g->b_up && c->g->b_down);
        if (wb != (ws->fb != NULL))
            return fm_error(FM_ERR_ARG, "moe_ep %s: the experts' weights %s biases (b_gate, b_up, b_down) but the "
                            "working set was laid out %s them (fm_moe_dims.bias %s); lay it out with bias = true "
                            "exactly when the experts carry biases", c->what, wb ? "carry" : "lack",
                            ws->fb ? "with" : "without", ws->fb ? "true" : "false");
        if (ws->fb && !gb)
            return fm_error(FM_ERR_ARG, "moe_ep backward: the experts carry biases but g has no bias gradients "
                            "(b_gate, b_up, b_down); pass them");
    }
    c->K = K;
    fm_ep_view(c->ws, 0);
    c->err = K < 1 ? EP_ERR_K_BAD : (N + (K > 0 ? K : 1) - 1) / (K > 0 ? K : 1) > ws->c ? EP_ERR_K_SMALL : EP_ERR_NONE;
    if (ws->schedule_bad) c->err = EP_ERR_SCHEDULE;
    c->j = 0, c->start = 0, c->stage = 0;
    if (fm_ep_pipelined(c)) return fm_ep_pipe_begin(c);
    return FM_OK;
}

void fm_ep_chunk_setup(fm_moe_ep_pass *c, int64_t j) {
    fm_moe_ep_chunk *ch = &c->ch[j % 3];
    ch->n = c->err ? 0 : fm_moe_chunk_size(c->N, c->K, j);
    ch->tok = c->chunk_tokens + c->start;
    ch->R = 0, ch->mark = -1, ch->ticket = -1;
    c->start += ch->n;
}

static void pass_init(fm_moe_ep_pass *c, const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                      const fm_moe_weights *w, fm_moe_ep_ws *ws, int64_t N, const fm_act *x, const int32_t *topk_idx,
                      const float *topk_w, const int32_t *chunk_tokens, double timeout_s, bool backward) {
    memset(c, 0, sizeof *c);
    c->be = be, c->comm = comm, c->d = d, c->dl = fm_moe_ep_local_dims(d, ws->ep), c->w = w, c->ws = ws;
    c->timeout_s = timeout_s;
    c->backward = backward;
    c->what = backward ? "backward" : "forward";
    c->N = N, c->x = x, c->topk_idx = topk_idx, c->topk_w = topk_w, c->chunk_tokens = chunk_tokens;
}

fm_status fm_moe_ep_fwd_begin(fm_moe_ep_pass *p, const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                              const fm_moe_weights *w, fm_act *y, const fm_act *x, const int32_t *topk_idx,
                              const float *topk_w, int64_t N, int64_t K, const int32_t *chunk_tokens,
                              fm_moe_ep_ws *ws, double timeout_s) {
    pass_init(p, be, comm, d, w, ws, N, x, topk_idx, topk_w, chunk_tokens, timeout_s, false);
    p->y = y;
    const fm_status st = ep_begin(p, N, K);
    if (st != FM_OK) p->stage = 3;
    return st;
}

fm_status fm_moe_ep_bwd_begin(fm_moe_ep_pass *p, const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                              const fm_moe_weights *w, const fm_moe_grads *g, fm_act *dx, float *dtopk_w,
                              const fm_act *dy, const fm_act *x, const int32_t *topk_idx, const float *topk_w,
                              int64_t N, int64_t K, const int32_t *chunk_tokens, fm_moe_ep_ws *ws,
                              double timeout_s) {
    pass_init(p, be, comm, d, w, ws, N, x, topk_idx, topk_w, chunk_tokens, timeout_s, true);
    p->g = g, p->dx = dx, p->dtopk_w = dtopk_w, p->dy = dy;
    const fm_status st = ep_begin(p, N, K);
    if (st != FM_OK) p->stage = 3;
    return st;
}

/* ---- the serial schedule: one chunk after another ---- */

/* Chunk j's dispatch phase: its FORWARD work (in the backward, the recompute). */
static fm_status serial_fwd_work(fm_moe_ep_pass *c, int64_t j, fm_moe_ep_work **work) {
    fm_ep_chunk_setup(c, j);
    fm_moe_ep_chunk *ch = &c->ch[j % 3];
    FM_TRY(fm_ep_chunk_dispatch(c, j, ch->tok, ch->n, j == 0 ? c->err : 0, &ch->R));
    *work = fm_ep_work(c, j, ch->R, FM_MOE_EP_WORK_FORWARD);
    return FM_OK;
}

/* After chunk j's FORWARD work: the outputs back; a forward pass combines them into y, a backward
 * pass runs the combine's backward, sends dye to the owners: its BACKWARD work. */
static fm_status serial_fwd_done(fm_moe_ep_pass *c, int64_t j, fm_moe_ep_work **work) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const fm_moe_ep_chunk *ch = &c->ch[j % 3];
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act), n = ch->n;
    FM_TRY(fm_ep_chunk_return(c, j, ch->R));
    if (!c->backward) {
        fm_moe_combine(be, d, &ws->src, ws->yc, ws->topk_w, n);
        fm_moe_chunk_scatter(be, c->y, ws->yc, ch->tok, n, Hb);
        return FM_OK;
    }
    fm_moe_chunk_gather_rows(be, ws->yc, c->dy, ch->tok, n, Hb);
    /* dye into the outgoing buffer (the x rows there were sent) */
    fm_moe_combine_backward(be, d, &ws->src, ws->src.xe, ws->dtopk_w, ws->yc, ws->topk_w, n);
    FM_TRY(fm_ep_to_owners(c, j));
    if (ch->R > 0) be->ops->gather_rows(be->ctx, ws->exp_ws.dye, ws->recv, ws->perm, ch->R, Hb);
    *work = fm_ep_work(c, j, ch->R, FM_MOE_EP_WORK_BACKWARD);
    return FM_OK;
}

/* After chunk j's BACKWARD work: the input gradients (and a spilled chunk's hosted weight
 * gradients) back, the dispatch's backward, scattered into dx and dtopk_w. */
static fm_status serial_bwd_done(fm_moe_ep_pass *c, int64_t j) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const fm_moe_ep_chunk *ch = &c->ch[j % 3];
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act), n = ch->n;
    if (ch->R > 0) be->ops->scatter_rows(be->ctx, ws->recv, ws->exp_ws.dxe, ws->perm, ch->R, Hb);
    if (ws->spill) FM_TRY(fm_ep_grads_back(c, j, c->g));
    /* the rows' input gradients back into the returned-rows buffer (ye was consumed) */
    FM_TRY(fm_ep_from_owners(c, j));
    fm_moe_dispatch_backward(be, d, &ws->src, ws->dxc, ws->src.ye, n);
    fm_moe_chunk_scatter(be, c->dx, ws->dxc, ch->tok, n, Hb);
    fm_moe_chunk_scatter(be, c->dtopk_w, ws->dtopk_w, ch->tok, n, d->k * (int64_t)sizeof(float));
    return FM_OK;
}

/* ---- stepping a pass (either schedule) ---- */

static fm_status ep_step(fm_moe_ep_pass *c, fm_moe_ep_work **work) {
    const int64_t Kr = c->K > 0 ? c->K : 1;
    if (c->stage == 1) { /* chunk j's FORWARD work ran */
        FM_TRY(c->pipe ? fm_ep_pipe_fwd_done(c, c->j, work) : serial_fwd_done(c, c->j, work));
        if (c->backward) {
            c->stage = 2;
            return FM_OK;
        }
        c->j++;
    } else if (c->stage == 2) { /* chunk j's BACKWARD work ran */
        FM_TRY(c->pipe ? fm_ep_pipe_bwd_done(c, c->j) : serial_bwd_done(c, c->j));
        c->j++;
    }
    if (c->j < Kr) {
        FM_TRY(c->pipe ? fm_ep_pipe_fwd_work(c, c->j, work) : serial_fwd_work(c, c->j, work));
        c->stage = 1;
        return FM_OK;
    }
    if (c->pipe) FM_TRY(fm_ep_pipe_end(c));
    c->stage = 3;
    return FM_OK;
}

fm_status fm_moe_ep_next(fm_moe_ep_pass *p, fm_moe_ep_work **work) {
    *work = NULL;
    if (p->stage == 3) return FM_OK;
    const fm_status st = ep_step(p, work);
    if (st != FM_OK) {
        *work = NULL;
        p->stage = 3;
    }
    return st;
}
