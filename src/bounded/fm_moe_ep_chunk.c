/* Expert-parallel MoE, one chunk's phases (fm_moe_ep_internal.h): the count table agreed and
 * checked, the placement (plain or least-loaded, fm_moe_llep.h), the all-to-all-v counts, the
 * exchanges source <-> owner, a spilled chunk's weights out and gradients back. */
#include "fm_moe_ep_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Wraps a communicator failure with the operator and chunk. */
fm_status fm_ep_comm_fail(const fm_moe_ep_pass *c, fm_status st, int64_t j) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", fm_errmsg());
    return fm_error(st, "moe_ep %s, chunk %lld of %lld: %s", c->what, (long long)(j + 1), (long long)c->K, msg);
}

/* Compute slots of rank q: its E_loc experts, then (spilled chunks) its hosted experts. */
static int64_t ep_nslots(const fm_moe_ep_ws *ws, int q) { return ws->E_loc + (ws->spill ? ws->plan.nforeign[q] : 0); }
static int64_t ep_slot(const fm_moe_ep_ws *ws, int q, int64_t s) {
    return ws->spill ? fm_llep_slot_expert(&ws->plan, q, s) : q * ws->E_loc + s;
}

/* Source p's rows of expert e that rank q computes: [*off, *off + *n) of p's rows of e (p's rows
 * of e are rows [G, G + count) of e's source-major order, G = the earlier sources' counts). */
static void ep_rows(const fm_moe_ep_ws *ws, int64_t S, int p, int64_t e, int q, int64_t *off, int64_t *n) {
    const int64_t cnt = ws->table[(int64_t)p * S + e];
    *off = 0;
    if (!ws->spill) {
        *n = q == e / ws->E_loc ? cnt : 0;
        return;
    }
    int64_t G = 0, lo, len;
    for (int pp = 0; pp < p; pp++) G += ws->table[(int64_t)pp * S + e];
    fm_llep_range(&ws->plan, e, q, &lo, &len);
    const int64_t a = G > lo ? G : lo, b = G + cnt < lo + len ? G + cnt : lo + len;
    *off = a - G;
    *n = b > a ? b - a : 0;
}

/* The weight exchange of a spilled chunk (elements of I*H per expert): this rank as native sends
 * each helper h its experts among h's hosted ones (staged in h order, then slot order: the pairs
 * pair_local lists), and as helper receives its hosted experts, which come sorted, so those of one
 * native rank are contiguous. */
static void ep_weight_counts(fm_moe_ep_ws *ws, const fm_moe_dims *d) {
    const int P = ws->ep, me = ws->rank;
    const int64_t El = ws->E_loc, IH = d->I * d->H;
    int64_t pi = 0;
    for (int h = 0; h < P; h++) {
        ws->wsend_displs[h] = pi * IH;
        for (int64_t s = El; s < ep_nslots(ws, h); s++) {
            const int64_t e = ep_slot(ws, h, s);
            if (e / El == me) ws->pair_local[pi++] = (int32_t)(e - me * El);
        }
        ws->wsend_counts[h] = pi * IH - ws->wsend_displs[h];
    }
    FM_ASSERT(pi <= ws->pairs_max);
    for (int o = 0; o < P; o++) ws->wrecv_counts[o] = 0, ws->wrecv_displs[o] = 0;
    for (int64_t s = El; s < ep_nslots(ws, me); s++) {
        const int o = (int)(ep_slot(ws, me, s) / El);
        if (ws->wrecv_counts[o] == 0) ws->wrecv_displs[o] = (s - El) * IH;
        ws->wrecv_counts[o] += IH;
    }
    if (ws->fb) /* the biases' exchange: the same pairs, B = 2I + H elements each */
        for (int q = 0; q < P; q++) {
            const int64_t B = 2 * d->I + d->H;
            ws->bsend_counts[q] = ws->wsend_counts[q] / IH * B, ws->bsend_displs[q] = ws->wsend_displs[q] / IH * B;
            ws->brecv_counts[q] = ws->wrecv_counts[q] / IH * B, ws->brecv_displs[q] = ws->wrecv_displs[q] / IH * B;
        }
}

/* A fingerprint of the placement options (0: plain EP), to check that every rank has the same. */
static int64_t ep_opts_print(const fm_moe_ep_ws *ws) {
    if (!ws->llep.on) return 0;
    const fm_llep_opts *o = &ws->llep;
    uint64_t h = 1469598103934665603ull, v[4] = {(uint64_t)o->max_foreign, (uint64_t)o->min_piece,
                                                 (uint64_t)llround(o->lambda * 1e6), (uint64_t)llround(o->alpha * 1e6)};
    for (int i = 0; i < 4; i++) h = (h ^ v[i]) * 1099511628211ull;
    return (int64_t)(h >> 2) + 1; /* > 0, and sums of one rank's slot stay exact */
}

/* Agrees on chunk j's counts (n tokens here, `err` this rank's flag) and checks them; on every
 * rank the same table, so the same verdict. Sets the all-to-all counts and displacements of the
 * forward direction (source -> owner) and the owner's permutation and local offsets. Returns the
 * rows this rank receives in *R. */
fm_status fm_ep_agree(const fm_moe_ep_pass *c, int64_t j, int64_t n, int64_t err, int64_t *R) {
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const int P = ws->ep, me = ws->rank;
    const int64_t E = d->E, El = ws->E_loc, S = E + T_EXTRA, H = d->H;
    int64_t *t = ws->table;
    memset(t, 0, sizeof(int64_t) * (size_t)(P * S));
    int64_t *mine = t + (int64_t)me * S;
    for (int64_t e = 0; e < E; e++) mine[e] = ws->src.offsets[e + 1] - ws->src.offsets[e];
    mine[E + T_K] = c->K;
    mine[E + T_N] = n;
    mine[E + T_ERR] = err;
    mine[E + T_C] = ws->c;
    mine[E + T_OPTS] = ep_opts_print(ws) + (c->pipe ? 1 : 0); /* the schedule too: the exchanges' order differs */
    const fm_status st = fm_comm_allreduce_sum_i64(c->comm, t, (int64_t)P * S, c->timeout_s);
    if (st != FM_OK) return fm_ep_comm_fail(c, st, j);
    /* the verdict, the same on every rank: the first offending rank */
    for (int p = 0; p < P; p++) {
        const int64_t *tp = t + (int64_t)p * S;
        if (tp[E + T_ERR] == EP_ERR_SCHEDULE)
            return fm_error(FM_ERR_ARG, "moe_ep %s (rank %d of %d): rank %d's FLATMOE_EP_SCHEDULE is not one of auto, "
                            "serial, pipelined (unset it, or set the same valid value on every rank)", c->what, me, P, p);
        if (tp[E + T_C] != ws->c || tp[E + T_OPTS] != mine[E + T_OPTS])
            return fm_error(FM_ERR_ARG, "moe_ep %s (rank %d of %d): rank %d's working set was laid out with cap c = "
                            "%lld and placement options and schedule %s this rank's (c = %lld); every rank of the ep group "
                            "must lay it out alike and run the same schedule (FLATMOE_EP_SCHEDULE)", c->what, me, P, p, (long long)tp[E + T_C],
                            tp[E + T_OPTS] == mine[E + T_OPTS] ? "equal to" : "other than", (long long)ws->c);
        if (tp[E + T_ERR] == EP_ERR_K_BAD || tp[E + T_K] < 1)
            return fm_error(FM_ERR_ARG, "moe_ep %s (rank %d of %d): rank %d passed K = %lld chunks; expected >= 1 "
                            "(fm_moe_ep_chunks)", c->what, me, P, p, (long long)tp[E + T_K]);
        if (tp[E + T_K] != c->K)
            return fm_error(FM_ERR_ARG, "moe_ep %s (rank %d of %d): rank %d passed K = %lld chunks but this rank "
                            "K = %lld; every rank of the ep group must run the same chunks (agree K with "
                            "fm_moe_ep_chunks)", c->what, me, P, p, (long long)tp[E + T_K], (long long)c->K);
        if (tp[E + T_ERR] == EP_ERR_K_SMALL || tp[E + T_N] > ws->c)
            return fm_error(FM_ERR_ARG, "moe_ep %s (rank %d of %d): rank %d's chunks hold more than the cap c = %lld "
                            "tokens (K = %lld is below ceil(N / c) for its N); agree K with fm_moe_ep_chunks "
                            "over the same c", c->what, me, P, p, (long long)ws->c, (long long)c->K);
        for (int q = 0; q < P; q++) {
            int64_t rows = 0;
            for (int64_t e = 0; e < El; e++) rows += tp[q * El + e];
            if (rows > ws->rows_per_src)
                return fm_error(FM_ERR_ARG, "moe_ep %s (rank %d of %d), chunk %lld of %lld: rank %d routes %lld rows of its "
                                "%lld tokens to rank %d's %lld experts, more than c * min(k, E/ep) = %lld: a "
                                "token's top-k experts must be distinct", c->what, me, P, (long long)(j + 1), (long long)c->K, p,
                                (long long)rows, (long long)tp[E + T_N], q, (long long)El,
                                (long long)ws->rows_per_src);
        }
    }
    /* the placement: plain, or least-loaded (the same plan on every rank: the same table) */
    ws->spill = false;
    if (ws->llep.on) {
        for (int64_t e = 0; e < E; e++) {
            ws->load[e] = 0;
            for (int p = 0; p < P; p++) ws->load[e] += t[(int64_t)p * S + e];
        }
        fm_llep_place(&ws->plan, ws->load, ws->rows_max, &ws->llep);
        ws->spill = ws->plan.spill;
        if (ws->spill) ws->llep_chunks++;
    }
    ws->rows_out = n * d->k;
    /* source -> computing rank: for each rank q, its slots' rows of this source, slot by slot
     * (plain: q's experts in order, one contiguous block of the expert-major rows) */
    int64_t pos = 0;
    for (int q = 0; q < P; q++) {
        ws->send_displs[q] = pos * H;
        for (int64_t s = 0; s < ep_nslots(ws, q); s++) {
            const int64_t e = ep_slot(ws, q, s);
            int64_t off, cnt;
            ep_rows(ws, S, me, e, q, &off, &cnt);
            if (ws->spill)
                for (int64_t i = 0; i < cnt; i++) ws->pack_host[pos + i] = (int32_t)(ws->src.offsets[e] + off + i);
            pos += cnt;
        }
        ws->send_counts[q] = pos * H - ws->send_displs[q];
    }
    FM_ASSERT(pos == n * d->k);
    if (ws->spill && pos > 0)
        c->be->ops->copy(c->be->ctx, ws->pack, ws->pack_host, sizeof(int32_t) * (size_t)pos, FM_COPY_H2D);
    /* computing rank <- sources: source p's block holds its rows of this rank's slots, in slot order */
    const int64_t ns = ep_nslots(ws, me);
    int64_t rows = 0;
    for (int p = 0; p < P; p++) {
        int64_t rp = 0;
        for (int64_t s = 0; s < ns; s++) {
            int64_t off, cnt;
            ep_rows(ws, S, p, ep_slot(ws, me, s), me, &off, &cnt);
            rp += cnt;
        }
        ws->recv_counts[p] = rp * H;
        ws->recv_displs[p] = rows * H;
        ws->cursor[p] = rows;
        rows += rp;
    }
    /* the slot-major (expert-major) order: slot s's rows from source 0, then 1, ... */
    pos = 0;
    ws->exp.offsets[0] = 0;
    for (int64_t s = 0; s < ns; s++) {
        for (int p = 0; p < P; p++) {
            int64_t off, cnt;
            ep_rows(ws, S, p, ep_slot(ws, me, s), me, &off, &cnt);
            for (int64_t i = 0; i < cnt; i++) ws->perm_host[pos++] = (int32_t)(ws->cursor[p] + i);
            ws->cursor[p] += cnt;
        }
        if (s < El) ws->exp.offsets[s + 1] = pos;
        else ws->foff[s - El + 1] = pos - ws->exp.offsets[El];
    }
    if (ws->foff) ws->foff[0] = 0;
    FM_ASSERT(pos == rows && rows <= ws->rows_max);
    if (rows > 0 && c->pipe) /* on the op stream: its host copy is not rewritten before the set's next chunk,
                                whose agreement comes after a host wait past this copy */
        c->be->ops->copy_async(c->be->ctx, ws->perm, ws->perm_host, sizeof(int32_t) * (size_t)rows, FM_COPY_H2D,
                               FM_STREAM_OPS);
    else if (rows > 0)
        c->be->ops->copy(c->be->ctx, ws->perm, ws->perm_host, sizeof(int32_t) * (size_t)rows, FM_COPY_H2D);
    if (rows > ws->recv_rows_high) ws->recv_rows_high = rows;
    if (n * d->k > ws->send_rows_high) ws->send_rows_high = n * d->k;
    if (ws->spill) ep_weight_counts(ws, d);
    *R = rows;
    return FM_OK;
}

/* Rows source -> owner (fwd = true: send_* out of `send`, recv_* into `recv`) or back. */
static fm_status ep_exchange(const fm_moe_ep_pass *c, int64_t j, bool to_owner, const fm_act *send, fm_act *recv) {
    const fm_moe_ep_ws *ws = c->ws;
    fm_status st = to_owner ? fm_comm_all_to_all_v(c->comm, send, ws->send_counts, ws->send_displs, recv,
                                                   ws->recv_counts, ws->recv_displs, EP_ACT_DTYPE, c->timeout_s)
                            : fm_comm_all_to_all_v(c->comm, send, ws->recv_counts, ws->recv_displs, recv,
                                                   ws->send_counts, ws->send_displs, EP_ACT_DTYPE, c->timeout_s);
    return st == FM_OK ? FM_OK : fm_ep_comm_fail(c, st, j);
}

/* ep_exchange issued on the communicator's stream after the op stream's mark `after`
 * (fm_comm_all_to_all_v_async); *ticket names its completion. */
fm_status fm_ep_exchange_async(const fm_moe_ep_pass *c, int64_t j, bool to_owner, const fm_act *send, fm_act *recv,
                               int after, int *ticket) {
    const fm_moe_ep_ws *ws = c->ws;
    fm_status st = to_owner ? fm_comm_all_to_all_v_async(c->comm, send, ws->send_counts, ws->send_displs, recv,
                                                         ws->recv_counts, ws->recv_displs, EP_ACT_DTYPE, c->timeout_s,
                                                         after, ticket)
                            : fm_comm_all_to_all_v_async(c->comm, send, ws->recv_counts, ws->recv_displs, recv,
                                                         ws->send_counts, ws->send_displs, EP_ACT_DTYPE, c->timeout_s,
                                                         after, ticket);
    return st == FM_OK ? FM_OK : fm_ep_comm_fail(c, st, j);
}

/* The source's rows out of ws->src.xe (expert-major over all E; a spilled chunk packs them by
 * computing rank into ws->src.ye first) into the computing ranks' ws->recv. */
fm_status fm_ep_to_owners(const fm_moe_ep_pass *c, int64_t j) {
    fm_moe_ep_ws *ws = c->ws;
    const fm_act *out = ws->src.xe;
    if (ws->spill && ws->rows_out > 0) {
        c->be->ops->gather_rows(c->be->ctx, ws->src.ye, ws->src.xe, ws->pack, ws->rows_out,
                                c->d->H * (int64_t)sizeof(fm_act));
        out = ws->src.ye;
    }
    return ep_exchange(c, j, true, out, ws->recv);
}

/* The computing ranks' ws->recv back to the sources, into ws->src.ye (expert-major over all E;
 * a spilled chunk lands in ws->src.xe and is unpacked). */
fm_status fm_ep_from_owners(const fm_moe_ep_pass *c, int64_t j) {
    fm_moe_ep_ws *ws = c->ws;
    FM_TRY(ep_exchange(c, j, false, ws->recv, ws->spill ? ws->src.xe : ws->src.ye));
    if (ws->spill && ws->rows_out > 0)
        c->be->ops->scatter_rows(c->be->ctx, ws->src.ye, ws->src.xe, ws->pack, ws->rows_out,
                                 c->d->H * (int64_t)sizeof(fm_act));
    return FM_OK;
}

/* Expert e's biases b[0] (gate [.,I]), b[1] (up [.,I]), b[2] (down [.,H]) and a packed run of
 * B = 2I + H elements (gate, up, down): to_run copies them into run, else copies (or, with add,
 * adds) run into them. */
static void ep_bias_run(const fm_moe_ep_pass *c, fm_act *const b[3], int64_t e, fm_act *run, bool to_run, bool add) {
    const int64_t I = c->d->I, H = c->d->H, len[3] = {I, I, H}, at[3] = {0, I, 2 * I};
    for (int m = 0; m < 3; m++) {
        fm_act *x = b[m] + e * len[m], *r = run + at[m];
        if (add) c->be->ops->add(c->be->ctx, x, r, len[m]);
        else c->be->ops->copy(c->be->ctx, to_run ? r : x, to_run ? x : r, sizeof(fm_act) * (size_t)len[m], FM_COPY_D2D);
    }
}

/* The hosted experts' bias arrays (gate, up, down) within a [F*B] buffer (fm_moe_ep_ws.fb, fbg). */
static void ep_bias_views(const fm_moe_ep_ws *ws, const fm_moe_dims *d, fm_act *buf, fm_act *v[3]) {
    v[0] = buf, v[1] = buf + ws->F * d->I, v[2] = buf + 2 * ws->F * d->I;
}

/* The pairs this rank stages as native (pair_local's length) in a spilled chunk. */
static int64_t ep_npairs(const fm_moe_ep_ws *ws, const fm_moe_dims *d) {
    const int64_t IH = d->I * d->H;
    return ws->wsend_displs[ws->ep - 1] / IH + ws->wsend_counts[ws->ep - 1] / IH;
}

/* A spilled chunk's hosted experts' weights, from their native ranks (gate, up, down), and with
 * d->bias their biases (packed per expert: one more exchange, unpacked into ws->fb). */
static fm_status ep_weights_out(const fm_moe_ep_pass *c, int64_t j) {
    fm_moe_ep_ws *ws = c->ws;
    const int64_t IH = c->d->I * c->d->H, npairs = ep_npairs(ws, c->d);
    const fm_act *W[3] = {c->w->w_gate, c->w->w_up, c->w->w_down};
    for (int m = 0; m < 3; m++) {
        for (int64_t pi = 0; pi < npairs; pi++)
            c->be->ops->copy(c->be->ctx, ws->stage[m] + pi * IH, W[m] + ws->pair_local[pi] * IH,
                             sizeof(fm_act) * (size_t)IH, FM_COPY_D2D);
        const fm_status st = fm_comm_all_to_all_v(c->comm, ws->stage[m], ws->wsend_counts, ws->wsend_displs, ws->fw[m],
                                                  ws->wrecv_counts, ws->wrecv_displs, EP_ACT_DTYPE, c->timeout_s);
        if (st != FM_OK) return fm_ep_comm_fail(c, st, j);
    }
    if (!ws->fb) return FM_OK;
    const int64_t B = 2 * c->d->I + c->d->H;
    fm_act *const wb[3] = {(fm_act *)c->w->b_gate, (fm_act *)c->w->b_up, (fm_act *)c->w->b_down}; /* read only */
    for (int64_t pi = 0; pi < npairs; pi++) ep_bias_run(c, wb, ws->pair_local[pi], ws->bstage + pi * B, true, false);
    const fm_status st = fm_comm_all_to_all_v(c->comm, ws->bstage, ws->bsend_counts, ws->bsend_displs, ws->bpack,
                                              ws->brecv_counts, ws->brecv_displs, EP_ACT_DTYPE, c->timeout_s);
    if (st != FM_OK) return fm_ep_comm_fail(c, st, j);
    fm_act *hb[3];
    ep_bias_views(ws, c->d, ws->fb, hb);
    for (int64_t f = 0; f < ws->plan.nforeign[ws->rank]; f++) ep_bias_run(c, hb, f, ws->bpack + f * B, false, false);
    return FM_OK;
}

/* A spilled chunk's hosted experts' weight gradients back to their native ranks, added there. */
fm_status fm_ep_grads_back(const fm_moe_ep_pass *c, int64_t j, const fm_moe_grads *g) {
    fm_moe_ep_ws *ws = c->ws;
    const int64_t IH = c->d->I * c->d->H, npairs = ep_npairs(ws, c->d);
    fm_act *G[3] = {g->w_gate, g->w_up, g->w_down};
    for (int m = 0; m < 3; m++) {
        const fm_status st = fm_comm_all_to_all_v(c->comm, ws->fg[m], ws->wrecv_counts, ws->wrecv_displs, ws->stage[m],
                                                  ws->wsend_counts, ws->wsend_displs, EP_ACT_DTYPE, c->timeout_s);
        if (st != FM_OK) return fm_ep_comm_fail(c, st, j);
        for (int64_t pi = 0; pi < npairs; pi++)
            c->be->ops->add(c->be->ctx, G[m] + ws->pair_local[pi] * IH, ws->stage[m] + pi * IH, IH);
    }
    if (!ws->fb) return FM_OK;
    /* the biases' gradients: packed per hosted expert, back in one exchange, added as the weights' */
    const int64_t B = 2 * c->d->I + c->d->H;
    fm_act *hg[3], *const gb[3] = {g->b_gate, g->b_up, g->b_down};
    ep_bias_views(ws, c->d, ws->fbg, hg);
    for (int64_t f = 0; f < ws->plan.nforeign[ws->rank]; f++) ep_bias_run(c, hg, f, ws->bpack + f * B, true, false);
    const fm_status st = fm_comm_all_to_all_v(c->comm, ws->bpack, ws->brecv_counts, ws->brecv_displs, ws->bstage,
                                              ws->bsend_counts, ws->bsend_displs, EP_ACT_DTYPE, c->timeout_s);
    if (st != FM_OK) return fm_ep_comm_fail(c, st, j);
    for (int64_t pi = 0; pi < npairs; pi++) ep_bias_run(c, gb, ws->pair_local[pi], ws->bstage + pi * B, false, true);
    return FM_OK;
}

fm_moe_ep_work *fm_ep_work(fm_moe_ep_pass *c, int64_t j, int64_t R, fm_moe_ep_work_kind kind) {
    fm_moe_ep_ws *ws = c->ws;
    fm_moe_ep_work *wk = &c->work;
    const int64_t H = c->d->H, I = c->d->I, Rn = R > 0 ? ws->exp.offsets[ws->E_loc] : 0;
    memset(wk, 0, sizeof *wk);
    wk->kind = kind;
    wk->chunk = j;
    wk->rows = Rn;
    wk->r = &ws->exp;
    wk->rws = &ws->exp_ws;
    if (!ws->spill) return wk;
    /* the hosted experts: the owner's buffers past the own experts' Rn rows, the weights received */
    const int64_t F = ws->plan.nforeign[ws->rank];
    wk->hosted_E = F;
    wk->hosted_rows = R - Rn;
    wk->hd = fm_moe_ep_hosted_dims(c->d, F);
    fm_moe_routes *hv = &wk->hr;
    hv->offsets = ws->foff;
    hv->xe = ws->exp.xe + Rn * H, hv->ye = ws->exp.ye + Rn * H;
    hv->h_gate = ws->exp.h_gate + Rn * I, hv->h_up = ws->exp.h_up + Rn * I, hv->h_act = ws->exp.h_act + Rn * I;
    fm_moe_ws *hw = &wk->hws;
    *hw = ws->hosted; /* the precision's operands (fp8), else nothing */
    hw->dye = ws->exp_ws.dye + Rn * H, hw->dxe = ws->exp_ws.dxe + Rn * H;
    hw->dact = ws->exp_ws.dact + Rn * I, hw->dh_gate = ws->exp_ws.dh_gate + Rn * I, hw->dh_up = ws->exp_ws.dh_up + Rn * I;
    wk->hw.w_gate = ws->fw[0], wk->hw.w_up = ws->fw[1], wk->hw.w_down = ws->fw[2];
    wk->hg.w_gate = ws->fg[0], wk->hg.w_up = ws->fg[1], wk->hg.w_down = ws->fg[2];
    if (ws->fb) { /* d->bias: the hosted experts' biases (received with the weights) and their gradients */
        fm_act *b[3], *bg[3];
        ep_bias_views(ws, c->d, ws->fb, b);
        ep_bias_views(ws, c->d, ws->fbg, bg);
        wk->hw.b_gate = b[0], wk->hw.b_up = b[1], wk->hw.b_down = b[2];
        wk->hg.b_gate = bg[0], wk->hg.b_up = bg[1], wk->hg.b_down = bg[2];
    }
    if (kind == FM_MOE_EP_WORK_BACKWARD) { /* the glue accumulates into them; they go back after it (none: empty) */
        for (int m = 0; m < 3; m++) c->be->ops->mem_set(c->be->ctx, ws->fg[m], 0, sizeof(fm_act) * (size_t)(F * I * H));
        if (ws->fbg) c->be->ops->mem_set(c->be->ctx, ws->fbg, 0, sizeof(fm_act) * (size_t)(ws->F * (2 * I + H)));
    }
    return wk;
}

fm_status fm_ep_chunk_dispatch(const fm_moe_ep_pass *c, int64_t j, const int32_t *tok, int64_t n, int64_t err,
                               int64_t *R) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act);
    fm_moe_chunk_gather_rows(be, ws->xc, c->x, tok, n, Hb);
    fm_moe_chunk_gather_rows(be, ws->topk_idx, c->topk_idx, tok, n, d->k * (int64_t)sizeof(int32_t));
    fm_moe_chunk_gather_rows(be, ws->topk_w, c->topk_w, tok, n, d->k * (int64_t)sizeof(float));
    fm_moe_dispatch(be, d, &ws->src, ws->xc, ws->topk_idx, n); /* ends with the "MoE offsets" sync */
    FM_TRY(fm_ep_agree(c, j, n, err, R));
    if (ws->spill) FM_TRY(ep_weights_out(c, j));
    FM_TRY(fm_ep_to_owners(c, j));
    if (*R > 0) /* the owner's rows, one per route, expert-major over its slots */
        be->ops->gather_rows(be->ctx, ws->exp.xe, ws->recv, ws->perm, *R, Hb);
    return FM_OK;
}

fm_status fm_ep_chunk_return(const fm_moe_ep_pass *c, int64_t j, int64_t R) {
    fm_moe_ep_ws *ws = c->ws;
    const int64_t Hb = c->d->H * (int64_t)sizeof(fm_act);
    if (R > 0) c->be->ops->scatter_rows(c->be->ctx, ws->recv, ws->exp.ye, ws->perm, R, Hb);
    return fm_ep_from_owners(c, j);
}
