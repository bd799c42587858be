/* Expert-parallel MoE: capped, strided chunks exchanged by all-to-all-v (fm_moe_ep.h). */
#include "fm_moe_ep.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/fm_experts.h"

#ifdef FM_ACT_BF16
#define EP_ACT_DTYPE FM_COMM_BF16
#else
#define EP_ACT_DTYPE FM_COMM_F32
#endif

/* The count table: per rank, E counts then these five: its K, its chunk size, an error flag, its
 * cap c and a fingerprint of its placement options and schedule (the layouts must agree: checked, so a
 * mismatch fails on every rank alike instead of desynchronizing the exchanges). */
enum { T_K = 0, T_N, T_ERR, T_C, T_OPTS, T_EXTRA };
/* Error flags a rank puts in the table at chunk 0 (agreed, so every rank fails together). */
enum { EP_ERR_NONE = 0, EP_ERR_K_SMALL = 1, EP_ERR_K_BAD = 2, EP_ERR_SCHEDULE = 3 };

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
    z.host = R8(d->E + 1) + S * R8(E_loc + 1) + R8((int64_t)ep * (d->E + T_EXTRA)) + (4 * S + 1) * R8(ep) +
             S * R4(Rm);
    if (llep_on(llep)) {
        const int64_t F = llep->max_foreign, PM = (int64_t)(ep - 1) * min64(F, E_loc);
        z.llep = 6 * RA(F * I * H) + 3 * RA(PM * I * H) + R4(c * k);
        z.host += R4(c * k) + 4 * R8(ep) + R8(F + 1) + R8(d->E) + R4(PM) + fm_llep_plan_bytes(ep, d->E, F);
    }
    z.device = z.recv + z.send + z.source + z.experts + z.llep;
    if (b) *b = z;
    return z.device;
}

/* Points the per-chunk views of w at chunk j's sets (fm_moe_ep_ws; one set: set 0 always). */
static void ep_view(fm_moe_ep_ws *w, int64_t j) {
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
    }
    ep_view(w, 0);
    /* a bad value does not fail the layout (the model's layout is checked before it is made): it is
     * agreed at the first chunk, where every rank refuses it alike */
    if (fm_moe_ep_schedule_from_env(&w->schedule) != FM_OK) w->schedule = FM_MOE_EP_AUTO, w->schedule_bad = true;
    return FM_OK;
}

fm_status fm_moe_ep_schedule_from_env(fm_moe_ep_schedule *s) {
    const char *v = getenv("FLATMOE_EP_SCHEDULE");
    if (!v || !*v || !strcmp(v, "auto")) *s = FM_MOE_EP_AUTO;
    else if (!strcmp(v, "serial")) *s = FM_MOE_EP_SERIAL;
    else if (!strcmp(v, "pipelined")) *s = FM_MOE_EP_PIPELINED;
    else
        return fm_error(FM_ERR_ARG, "FLATMOE_EP_SCHEDULE=\"%s\": expected auto, serial or pipelined (unset: auto)", v);
    return FM_OK;
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

/* ---- one chunk's phases ------------------------------------------------------------------------ */

typedef struct ep_call {
    const fm_backend *be;
    const fm_comm *comm;
    const fm_moe_dims *d;
    const fm_moe_weights *w;
    fm_moe_ep_ws *ws;
    double timeout_s;
    const char *what; /* "forward" | "backward" */
    int64_t K;
    bool pipe;        /* the pipelined schedule: the permutation goes up by copy_async */
} ep_call;

/* Wraps a communicator failure with the operator and chunk. */
static fm_status ep_comm_fail(const ep_call *c, fm_status st, int64_t j) {
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
static fm_status ep_agree(const ep_call *c, int64_t j, int64_t n, int64_t err, int64_t *R) {
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
    if (st != FM_OK) return ep_comm_fail(c, st, j);
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
static fm_status ep_exchange(const ep_call *c, int64_t j, bool to_owner, const fm_act *send, fm_act *recv) {
    const fm_moe_ep_ws *ws = c->ws;
    fm_status st = to_owner ? fm_comm_all_to_all_v(c->comm, send, ws->send_counts, ws->send_displs, recv,
                                                   ws->recv_counts, ws->recv_displs, EP_ACT_DTYPE, c->timeout_s)
                            : fm_comm_all_to_all_v(c->comm, send, ws->recv_counts, ws->recv_displs, recv,
                                                   ws->send_counts, ws->send_displs, EP_ACT_DTYPE, c->timeout_s);
    return st == FM_OK ? FM_OK : ep_comm_fail(c, st, j);
}

/* ep_exchange issued on the communicator's stream after the op stream's mark `after`
 * (fm_comm_all_to_all_v_async); *ticket names its completion. */
static fm_status ep_exchange_async(const ep_call *c, int64_t j, bool to_owner, const fm_act *send, fm_act *recv,
                                   int after, int *ticket) {
    const fm_moe_ep_ws *ws = c->ws;
    fm_status st = to_owner ? fm_comm_all_to_all_v_async(c->comm, send, ws->send_counts, ws->send_displs, recv,
                                                         ws->recv_counts, ws->recv_displs, EP_ACT_DTYPE, c->timeout_s,
                                                         after, ticket)
                            : fm_comm_all_to_all_v_async(c->comm, send, ws->recv_counts, ws->recv_displs, recv,
                                                         ws->send_counts, ws->send_displs, EP_ACT_DTYPE, c->timeout_s,
                                                         after, ticket);
    return st == FM_OK ? FM_OK : ep_comm_fail(c, st, j);
}

/* The source's rows out of ws->src.xe (expert-major over all E; a spilled chunk packs them by
 * computing rank into ws->src.ye first) into the computing ranks' ws->recv. */
static fm_status ep_to_owners(const ep_call *c, int64_t j) {
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
static fm_status ep_from_owners(const ep_call *c, int64_t j) {
    fm_moe_ep_ws *ws = c->ws;
    FM_TRY(ep_exchange(c, j, false, ws->recv, ws->spill ? ws->src.xe : ws->src.ye));
    if (ws->spill && ws->rows_out > 0)
        c->be->ops->scatter_rows(c->be->ctx, ws->src.ye, ws->src.xe, ws->pack, ws->rows_out,
                                 c->d->H * (int64_t)sizeof(fm_act));
    return FM_OK;
}

/* A spilled chunk's hosted experts' weights, from their native ranks (gate, up, down). */
static fm_status ep_weights_out(const ep_call *c, int64_t j) {
    fm_moe_ep_ws *ws = c->ws;
    const int64_t IH = c->d->I * c->d->H, npairs = ws->wsend_displs[ws->ep - 1] / IH + ws->wsend_counts[ws->ep - 1] / IH;
    const fm_act *W[3] = {c->w->w_gate, c->w->w_up, c->w->w_down};
    for (int m = 0; m < 3; m++) {
        for (int64_t pi = 0; pi < npairs; pi++)
            c->be->ops->copy(c->be->ctx, ws->stage[m] + pi * IH, W[m] + ws->pair_local[pi] * IH,
                             sizeof(fm_act) * (size_t)IH, FM_COPY_D2D);
        const fm_status st = fm_comm_all_to_all_v(c->comm, ws->stage[m], ws->wsend_counts, ws->wsend_displs, ws->fw[m],
                                                  ws->wrecv_counts, ws->wrecv_displs, EP_ACT_DTYPE, c->timeout_s);
        if (st != FM_OK) return ep_comm_fail(c, st, j);
    }
    return FM_OK;
}

/* A spilled chunk's hosted experts' weight gradients back to their native ranks, added there. */
static fm_status ep_grads_back(const ep_call *c, int64_t j, const fm_moe_grads *g) {
    fm_moe_ep_ws *ws = c->ws;
    const int64_t IH = c->d->I * c->d->H, npairs = ws->wsend_displs[ws->ep - 1] / IH + ws->wsend_counts[ws->ep - 1] / IH;
    fm_act *G[3] = {g->w_gate, g->w_up, g->w_down};
    for (int m = 0; m < 3; m++) {
        const fm_status st = fm_comm_all_to_all_v(c->comm, ws->fg[m], ws->wrecv_counts, ws->wrecv_displs, ws->stage[m],
                                                  ws->wsend_counts, ws->wsend_displs, EP_ACT_DTYPE, c->timeout_s);
        if (st != FM_OK) return ep_comm_fail(c, st, j);
        for (int64_t pi = 0; pi < npairs; pi++)
            c->be->ops->add(c->be->ctx, G[m] + ws->pair_local[pi] * IH, ws->stage[m] + pi * IH, IH);
    }
    return FM_OK;
}

/* The hosted experts' part of the rows (after the native experts' Rn rows): views of the
 * owner's buffers and the hosted weights. */
static int64_t ep_hosted(const ep_call *c, fm_moe_routes *hv, fm_moe_ws *hw, fm_moe_weights *wv, fm_moe_grads *gv,
                         fm_moe_dims *dv) {
    fm_moe_ep_ws *ws = c->ws;
    const int64_t H = c->d->H, I = c->d->I, Rn = ws->exp.offsets[ws->E_loc];
    memset(hv, 0, sizeof *hv);
    hv->offsets = ws->foff;
    hv->xe = ws->exp.xe + Rn * H, hv->ye = ws->exp.ye + Rn * H;
    hv->h_gate = ws->exp.h_gate + Rn * I, hv->h_up = ws->exp.h_up + Rn * I, hv->h_act = ws->exp.h_act + Rn * I;
    *hw = ws->exp_ws;
    hw->dye = ws->exp_ws.dye + Rn * H, hw->dxe = ws->exp_ws.dxe + Rn * H;
    hw->dact = ws->exp_ws.dact + Rn * I, hw->dh_gate = ws->exp_ws.dh_gate + Rn * I, hw->dh_up = ws->exp_ws.dh_up + Rn * I;
    wv->w_gate = ws->fw[0], wv->w_up = ws->fw[1], wv->w_down = ws->fw[2];
    gv->w_gate = ws->fg[0], gv->w_up = ws->fg[1], gv->w_down = ws->fg[2];
    *dv = (fm_moe_dims){H, I, ws->plan.nforeign[ws->rank], 1};
    return Rn;
}

/* Chunk j's forward up to the combine: its n tokens `tok` gathered and dispatched, the counts
 * agreed and the placement made, the rows at their computing ranks run through the experts (a
 * spilled chunk: the native experts', then the hosted ones with the weights just received) and
 * the outputs back in ws->src.ye (the source's expert-major layout over all E experts). */
static fm_status ep_chunk_experts(const ep_call *c, int64_t j, const fm_act *x, const int32_t *topk_idx,
                                  const float *topk_w, const int32_t *tok, int64_t n, int64_t err, int64_t *R) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act);
    fm_moe_chunk_gather_rows(be, ws->xc, x, tok, n, Hb);
    fm_moe_chunk_gather_rows(be, ws->topk_idx, topk_idx, tok, n, d->k * (int64_t)sizeof(int32_t));
    fm_moe_chunk_gather_rows(be, ws->topk_w, topk_w, tok, n, d->k * (int64_t)sizeof(float));
    fm_moe_dispatch(be, d, &ws->src, ws->xc, ws->topk_idx, n); /* ends with the "MoE offsets" sync */
    FM_TRY(ep_agree(c, j, n, err, R));
    if (ws->spill) FM_TRY(ep_weights_out(c, j));
    FM_TRY(ep_to_owners(c, j));
    const fm_moe_dims dl = {d->H, d->I, ws->E_loc, 1}; /* the owner's rows, one per route */
    if (*R > 0) {
        be->ops->gather_rows(be->ctx, ws->exp.xe, ws->recv, ws->perm, *R, Hb);
        const int64_t Rn = ws->exp.offsets[ws->E_loc];
        fm_experts_forward(be, &dl, c->w, &ws->exp, Rn);
        if (ws->spill && *R > Rn) {
            fm_moe_routes hv;
            fm_moe_ws hw;
            fm_moe_weights wv;
            fm_moe_grads gv;
            fm_moe_dims dv;
            ep_hosted(c, &hv, &hw, &wv, &gv, &dv);
            fm_experts_forward(be, &dv, &wv, &hv, *R - Rn);
        }
        be->ops->scatter_rows(be->ctx, ws->recv, ws->exp.ye, ws->perm, *R, Hb);
    }
    return ep_from_owners(c, j);
}

/* Local checks before the first collective; a failure here is agreed at chunk 0 (err flag). */
static fm_status ep_begin(ep_call *c, int64_t N, int64_t K, int64_t *err) {
    const fm_moe_ep_ws *ws = c->ws;
    if (fm_comm_size(c->comm) != ws->ep || fm_comm_rank(c->comm) != ws->rank)
        return fm_error(FM_ERR_ARG, "moe_ep %s: the communicator is rank %d of %d but the working set was laid out "
                        "for rank %d of %d", c->what, fm_comm_rank(c->comm), fm_comm_size(c->comm), ws->rank, ws->ep);
    if (fm_comm_mem_is_host(c->comm) && !c->be->ops->host_memory)
        return fm_error(FM_ERR_ARG, "moe_ep %s: the communicator moves host memory but the backend's buffers are "
                        "device memory; create the communicator over the backend", c->what);
    if (N < 0) return fm_error(FM_ERR_ARG, "moe_ep %s: N = %lld tokens; expected >= 0", c->what, (long long)N);
    c->K = K;
    ep_view(c->ws, 0);
    *err = K < 1 ? EP_ERR_K_BAD : (N + (K > 0 ? K : 1) - 1) / (K > 0 ? K : 1) > ws->c ? EP_ERR_K_SMALL : EP_ERR_NONE;
    if (ws->schedule_bad) *err = EP_ERR_SCHEDULE;
    return FM_OK;
}

/* ---- the pipelined schedule (fm_moe_ep.h "Overlap") ------------------------------------------- */

/* One chunk in flight: its tokens, rows received, and the marks and tickets of its exchanges. */
typedef struct ep_chunk {
    int64_t n, R;
    const int32_t *tok;
    int mark;   /* the op stream after this chunk's last op before an exchange */
    int ticket; /* its latest exchange */
} ep_chunk;

static bool ep_pipelined(const ep_call *c) {
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
    ep_view(ws, j);
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
    return st == FM_OK ? FM_OK : ep_comm_fail(c, st, j);
}

/* Chunk j's agreement (the host waits for its dispatch only: the "MoE offsets" sync point) and
 * its rows out to the owners, async after the dispatch's mark. */
static fm_status ep_pipe_send(const ep_call *c, int64_t j, int64_t err, ep_chunk *ch) {
    fm_moe_ep_ws *ws = c->ws;
    ep_view(ws, j);
    if (ch->n > 0) c->be->ops->event_sync(c->be->ctx, FM_MOE_EP_EVENT);
    FM_TRY(ep_agree(c, j, ch->n, err, &ch->R));
    return ep_exchange_async(c, j, true, ws->src.xe, ws->recv, ch->mark, &ch->ticket);
}

/* The owner's part of chunk j, after joining the exchange that brought its rows: the forward
 * (backward = false: gather, experts, outputs into the receive buffer) or the backward (dye
 * gathered, the experts' backward, dxe into the receive buffer); then a mark. */
static fm_status ep_pipe_owner(const ep_call *c, int64_t j, bool backward, const fm_moe_grads *g, ep_chunk *ch) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act), R = ch->R;
    const fm_moe_dims dl = {d->H, d->I, ws->E_loc, 1};
    ep_view(ws, j);
    fm_status st = fm_comm_join(c->comm, ch->ticket);
    if (st != FM_OK) return ep_comm_fail(c, st, j);
    if (R > 0 && !backward) {
        be->ops->gather_rows(be->ctx, ws->exp.xe, ws->recv, ws->perm, R, Hb);
        fm_experts_forward(be, &dl, c->w, &ws->exp, R);
        be->ops->scatter_rows(be->ctx, ws->recv, ws->exp.ye, ws->perm, R, Hb);
    } else if (R > 0) {
        be->ops->gather_rows(be->ctx, ws->exp_ws.dye, ws->recv, ws->perm, R, Hb);
        fm_experts_backward(be, &dl, c->w, g, &ws->exp, &ws->exp_ws, R);
        be->ops->scatter_rows(be->ctx, ws->recv, ws->exp_ws.dxe, ws->perm, R, Hb);
    }
    st = fm_comm_mark(c->comm, &ch->mark);
    return st == FM_OK ? FM_OK : ep_comm_fail(c, st, j);
}

/* Chunk j's receive buffer back to its sources' returned-rows buffer (async, after the mark). */
static fm_status ep_pipe_back(const ep_call *c, int64_t j, ep_chunk *ch) {
    fm_moe_ep_ws *ws = c->ws;
    ep_view(ws, j);
    return ep_exchange_async(c, j, false, ws->recv, ws->src.ye, ch->mark, &ch->ticket);
}

/* Joins chunk j's latest exchange and points the views at its sets. */
static fm_status ep_pipe_join(const ep_call *c, int64_t j, const ep_chunk *ch) {
    ep_view(c->ws, j);
    const fm_status st = fm_comm_join(c->comm, ch->ticket);
    return st == FM_OK ? FM_OK : ep_comm_fail(c, st, j);
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

/* The forward, pipelined: iteration i issues chunk i+1's dispatch, chunk i's experts, chunk
 * i+1's agreement and exchange out, chunk i's exchange back, chunk i-1's combine. */
static fm_status ep_pipe_forward(ep_call *c, fm_act *y, const fm_act *x, const int32_t *topk_idx,
                                 const float *topk_w, int64_t N, const int32_t *chunk_tokens, int64_t err) {
    const fm_backend *be = c->be;
    fm_moe_ep_ws *ws = c->ws;
    const fm_moe_dims *d = c->d;
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act), K = c->K, Kr = K > 0 ? K : 1;
    ep_chunk ch[3];
    int64_t start = 0;
    FM_TRY(ep_pipe_begin(c, ch, N, err, chunk_tokens, &start, x, topk_idx, topk_w));
    for (int64_t i = 0; i < Kr; i++) {
        ep_chunk *cur = &ch[i % 3], *nxt = &ch[(i + 1) % 3], *prv = &ch[(i + 2) % 3];
        if (i + 1 < Kr) FM_TRY(ep_pipe_next(c, nxt, i + 1, N, err, chunk_tokens, &start, x, topk_idx, topk_w));
        FM_TRY(ep_pipe_owner(c, i, false, NULL, cur));
        if (i + 1 < Kr) FM_TRY(ep_pipe_send(c, i + 1, 0, nxt));
        FM_TRY(ep_pipe_back(c, i, cur));
        if (i > 0) {
            FM_TRY(ep_pipe_join(c, i - 1, prv));
            fm_moe_combine(be, d, &ws->src, ws->yc, ws->topk_w, prv->n);
            fm_moe_chunk_scatter(be, y, ws->yc, prv->tok, prv->n, Hb);
        }
    }
    ep_chunk *last = &ch[(Kr - 1) % 3];
    FM_TRY(ep_pipe_join(c, Kr - 1, last));
    fm_moe_combine(be, d, &ws->src, ws->yc, ws->topk_w, last->n);
    fm_moe_chunk_scatter(be, y, ws->yc, last->tok, last->n, Hb);
    ep_view(ws, 0);
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
static fm_status ep_pipe_backward(ep_call *c, const fm_moe_grads *g, fm_act *dx, float *dtopk_w, const fm_act *dy,
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
        ep_chunk *cur = &ch[j % 3], *nxt = &ch[(j + 1) % 3], *prv = &ch[(j + 2) % 3];
        if (j + 1 < Kr) FM_TRY(ep_pipe_next(c, nxt, j + 1, N, err, chunk_tokens, &start, x, topk_idx, topk_w));
        FM_TRY(ep_pipe_owner(c, j, false, NULL, cur)); /* the recompute */
        if (j + 1 < Kr) FM_TRY(ep_pipe_send(c, j + 1, 0, nxt));
        FM_TRY(ep_pipe_back(c, j, cur));
        /* the source: the combine's backward, dye into the outgoing buffer (its x rows were sent) */
        FM_TRY(ep_pipe_join(c, j, cur));
        fm_moe_chunk_gather_rows(be, ws->yc, dy, cur->tok, cur->n, Hb);
        fm_moe_combine_backward(be, d, &ws->src, ws->src.xe, ws->dtopk_w, ws->yc, ws->topk_w, cur->n);
        fm_moe_chunk_scatter(be, dtopk_w, ws->dtopk_w, cur->tok, cur->n, d->k * (int64_t)sizeof(float));
        fm_status st = fm_comm_mark(c->comm, &cur->mark);
        if (st != FM_OK) return ep_comm_fail(c, st, j);
        FM_TRY(ep_exchange_async(c, j, true, ws->src.xe, ws->recv, cur->mark, &cur->ticket));
        FM_TRY(ep_pipe_owner(c, j, true, g, cur)); /* the experts' backward */
        FM_TRY(ep_pipe_back(c, j, cur));           /* the rows' input gradients into the returned-rows buffer */
        if (j > 0) FM_TRY(ep_pipe_dx(c, j - 1, prv, dx));
    }
    FM_TRY(ep_pipe_dx(c, Kr - 1, &ch[(Kr - 1) % 3], dx));
    ep_view(ws, 0);
    return FM_OK;
}

fm_status fm_moe_ep_forward(const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                            const fm_moe_weights *w, fm_act *y, const fm_act *x, const int32_t *topk_idx,
                            const float *topk_w, int64_t N, int64_t K, const int32_t *chunk_tokens,
                            fm_moe_ep_ws *ws, double timeout_s) {
    ep_call c = {be, comm, d, w, ws, timeout_s, "forward", K, false};
    int64_t err;
    FM_TRY(ep_begin(&c, N, K, &err));
    if (ep_pipelined(&c)) return ep_pipe_forward(&c, y, x, topk_idx, topk_w, N, chunk_tokens, err);
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act), Kr = K > 0 ? K : 1;
    for (int64_t j = 0, start = 0; j < Kr; j++) {
        const int64_t n = err ? 0 : fm_moe_chunk_size(N, K, j);
        const int32_t *tok = chunk_tokens + start;
        start += n;
        int64_t R;
        FM_TRY(ep_chunk_experts(&c, j, x, topk_idx, topk_w, tok, n, j == 0 ? err : 0, &R));
        fm_moe_combine(be, d, &ws->src, ws->yc, ws->topk_w, n);
        fm_moe_chunk_scatter(be, y, ws->yc, tok, n, Hb);
    }
    return FM_OK;
}

fm_status fm_moe_ep_backward(const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                             const fm_moe_weights *w, const fm_moe_grads *g, fm_act *dx, float *dtopk_w,
                             const fm_act *dy, const fm_act *x, const int32_t *topk_idx, const float *topk_w,
                             int64_t N, int64_t K, const int32_t *chunk_tokens, fm_moe_ep_ws *ws,
                             double timeout_s) {
    ep_call c = {be, comm, d, w, ws, timeout_s, "backward", K, false};
    int64_t err;
    FM_TRY(ep_begin(&c, N, K, &err));
    if (ep_pipelined(&c))
        return ep_pipe_backward(&c, g, dx, dtopk_w, dy, x, topk_idx, topk_w, N, chunk_tokens, err);
    const int64_t Hb = d->H * (int64_t)sizeof(fm_act), Kr = K > 0 ? K : 1;
    const fm_moe_dims dl = {d->H, d->I, ws->E_loc, 1};
    for (int64_t j = 0, start = 0; j < Kr; j++) {
        const int64_t n = err ? 0 : fm_moe_chunk_size(N, K, j);
        const int32_t *tok = chunk_tokens + start;
        start += n;
        int64_t R;
        /* recompute the chunk's dispatch and experts; the outputs come back for the combine's backward */
        FM_TRY(ep_chunk_experts(&c, j, x, topk_idx, topk_w, tok, n, j == 0 ? err : 0, &R));
        fm_moe_chunk_gather_rows(be, ws->yc, dy, tok, n, Hb);
        /* dye into the outgoing buffer (the x rows there were sent) */
        fm_moe_combine_backward(be, d, &ws->src, ws->src.xe, ws->dtopk_w, ws->yc, ws->topk_w, n);
        FM_TRY(ep_to_owners(&c, j));
        if (R > 0) {
            be->ops->gather_rows(be->ctx, ws->exp_ws.dye, ws->recv, ws->perm, R, Hb);
            const int64_t Rn = ws->exp.offsets[ws->E_loc];
            fm_experts_backward(be, &dl, w, g, &ws->exp, &ws->exp_ws, Rn);
            if (ws->spill) {
                fm_moe_routes hv;
                fm_moe_ws hw;
                fm_moe_weights wv;
                fm_moe_grads gv;
                fm_moe_dims dv;
                ep_hosted(&c, &hv, &hw, &wv, &gv, &dv);
                for (int m = 0; m < 3; m++)
                    be->ops->mem_set(be->ctx, ws->fg[m], 0, sizeof(fm_act) * (size_t)(dv.E * d->I * d->H));
                fm_experts_backward(be, &dv, &wv, &gv, &hv, &hw, R - Rn);
            }
            be->ops->scatter_rows(be->ctx, ws->recv, ws->exp_ws.dxe, ws->perm, R, Hb);
        } else if (ws->spill) {
            for (int m = 0; m < 3; m++) /* hosts nothing with rows: its (empty) gradients still go back */
                be->ops->mem_set(be->ctx, ws->fg[m], 0, sizeof(fm_act) * (size_t)(ws->plan.nforeign[ws->rank] * d->I * d->H));
        }
        if (ws->spill) FM_TRY(ep_grads_back(&c, j, g));
        /* the rows' input gradients back into the returned-rows buffer (ye was consumed) */
        FM_TRY(ep_from_owners(&c, j));
        fm_moe_dispatch_backward(be, d, &ws->src, ws->dxc, ws->src.ye, n);
        fm_moe_chunk_scatter(be, dx, ws->dxc, tok, n, Hb);
        fm_moe_chunk_scatter(be, dtopk_w, ws->dtopk_w, tok, n, d->k * (int64_t)sizeof(float));
    }
    return FM_OK;
}
