/* Expert-parallel MoE: capped, strided chunks exchanged by all-to-all-v (fm_moe_ep.h). */
#include "fm_moe_ep.h"

#include <stdio.h>
#include <string.h>

#include "../model/fm_experts.h"

#ifdef FM_ACT_BF16
#define EP_ACT_DTYPE FM_COMM_BF16
#else
#define EP_ACT_DTYPE FM_COMM_F32
#endif

/* The count table: per rank, E counts then these three. */
enum { T_K = 0, T_N, T_ERR, T_EXTRA };
/* Error flags a rank puts in the table at chunk 0 (agreed, so every rank fails together). */
enum { EP_ERR_NONE = 0, EP_ERR_K_SMALL = 1, EP_ERR_K_BAD = 2 };

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
                        "moe_ep: the count table of ep %d x (num_experts %lld + 3) int64 exceeds the "
                        "communicator's host all-reduce limit of %d elements; use a smaller ep degree",
                        ep, (long long)d->E, FM_COMM_HOST_MAX_ELEMS);
    return FM_OK;
}

size_t fm_moe_ep_bound_bytes(const fm_moe_dims *d, int ep, int64_t c, size_t a, fm_moe_ep_bound *b) {
    fm_moe_ep_bound z;
    memset(&z, 0, sizeof z);
    if (b) *b = z;
    if (d->E % (ep > 0 ? ep : 1) != 0 || ep < 1 || c < 1) return 0;
    const int64_t H = d->H, I = d->I, k = d->k, E_loc = d->E / ep;
    const int64_t Rm = (int64_t)ep * c * min64(k, E_loc);
    z.rows_max = Rm;
    z.recv = RA(Rm * H);
    z.send = 2 * RA(c * k * H);
    z.source = 3 * RA(c * H) + 5 * R4(c * k);
    z.experts = 3 * RA(Rm * H) + 6 * RA(Rm * I) + R4(Rm);
    z.device = z.recv + z.send + z.source + z.experts;
    z.host = R8(d->E + 1) + R8(E_loc + 1) + R8((int64_t)ep * (d->E + T_EXTRA)) + 4 * R8(ep) + R4(Rm);
    if (b) *b = z;
    return z.device;
}

#define TAKE(ar, type, count) ((type *)fm_arena_alloc((ar), sizeof(type) * (size_t)(count)))

fm_status fm_moe_ep_ws_layout(fm_moe_ep_ws *w, fm_arena *dev, fm_arena *host, const fm_moe_dims *d, int ep,
                              int rank, int64_t c) {
    FM_TRY(fm_moe_ep_check(d, ep, c));
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
    /* device: recv, send, source, experts (the order of fm_moe_ep_bound) */
    w->recv = TAKE(dev, fm_act, Rm * H);
    w->src.xe = TAKE(dev, fm_act, c * k * H);
    w->src.ye = TAKE(dev, fm_act, c * k * H);
    w->xc = TAKE(dev, fm_act, c * H);
    w->yc = TAKE(dev, fm_act, c * H);
    w->dxc = TAKE(dev, fm_act, c * H);
    w->topk_idx = TAKE(dev, int32_t, c * k);
    w->topk_w = TAKE(dev, float, c * k);
    w->dtopk_w = TAKE(dev, float, c * k);
    w->src.row_route = TAKE(dev, int32_t, c * k);
    w->src.route_row = TAKE(dev, int32_t, c * k);
    w->exp.xe = TAKE(dev, fm_act, Rm * H);
    w->exp.ye = TAKE(dev, fm_act, Rm * H);
    w->exp_ws.dxe = TAKE(dev, fm_act, Rm * H);
    w->exp.h_gate = TAKE(dev, fm_act, Rm * I);
    w->exp.h_up = TAKE(dev, fm_act, Rm * I);
    w->exp.h_act = TAKE(dev, fm_act, Rm * I);
    w->exp_ws.dact = TAKE(dev, fm_act, Rm * I);
    w->exp_ws.dh_gate = TAKE(dev, fm_act, Rm * I);
    w->exp_ws.dh_up = TAKE(dev, fm_act, Rm * I);
    w->perm = TAKE(dev, int32_t, Rm);
    w->exp_ws.dye = w->exp.ye; /* ye is sent back before dye arrives */
    /* host */
    w->src.offsets = TAKE(host, int64_t, d->E + 1);
    w->exp.offsets = TAKE(host, int64_t, w->E_loc + 1);
    w->table = TAKE(host, int64_t, (int64_t)ep * (d->E + T_EXTRA));
    w->send_counts = TAKE(host, int64_t, ep);
    w->send_displs = TAKE(host, int64_t, ep);
    w->recv_counts = TAKE(host, int64_t, ep);
    w->recv_displs = TAKE(host, int64_t, ep);
    w->perm_host = TAKE(host, int32_t, Rm);
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
} ep_call;

/* Wraps a communicator failure with the operator and chunk. */
static fm_status ep_comm_fail(const ep_call *c, fm_status st, int64_t j) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", fm_errmsg());
    return fm_error(st, "moe_ep %s, chunk %lld of %lld: %s", c->what, (long long)j, (long long)c->K, msg);
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
    const fm_status st = fm_comm_allreduce_sum_i64(c->comm, t, (int64_t)P * S, c->timeout_s);
    if (st != FM_OK) return ep_comm_fail(c, st, j);
    /* the verdict, the same on every rank: the first offending rank */
    for (int p = 0; p < P; p++) {
        const int64_t *tp = t + (int64_t)p * S;
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
                return fm_error(FM_ERR_ARG, "moe_ep %s (rank %d of %d), chunk %lld: rank %d routes %lld rows of its "
                                "%lld tokens to rank %d's %lld experts, more than c * min(k, E/ep) = %lld: a "
                                "token's top-k experts must be distinct", c->what, me, P, (long long)j, p,
                                (long long)rows, (long long)tp[E + T_N], q, (long long)El,
                                (long long)ws->rows_per_src);
        }
    }
    /* source -> owner counts (elements) */
    for (int q = 0; q < P; q++) {
        const int64_t r0 = ws->src.offsets[q * El], r1 = ws->src.offsets[(q + 1) * El];
        ws->send_counts[q] = (r1 - r0) * H;
        ws->send_displs[q] = r0 * H;
    }
    int64_t rows = 0;
    for (int p = 0; p < P; p++) {
        const int64_t *tp = t + (int64_t)p * S + (int64_t)me * El;
        int64_t rp = 0;
        for (int64_t e = 0; e < El; e++) rp += tp[e];
        ws->recv_counts[p] = rp * H;
        ws->recv_displs[p] = rows * H;
        rows += rp;
    }
    /* the owner's expert-major order: expert e's rows from source 0, then 1, ...; recv holds
     * source p's block at recv_displs[p], its experts' rows in expert order inside it */
    int64_t pos = 0;
    ws->exp.offsets[0] = 0;
    for (int64_t e = 0; e < El; e++) {
        for (int p = 0; p < P; p++) {
            const int64_t *tp = t + (int64_t)p * S + (int64_t)me * El;
            int64_t base = ws->recv_displs[p] / H;
            for (int64_t f = 0; f < e; f++) base += tp[f];
            for (int64_t i = 0; i < tp[e]; i++) ws->perm_host[pos++] = (int32_t)(base + i);
        }
        ws->exp.offsets[e + 1] = pos;
    }
    FM_ASSERT(pos == rows && rows <= ws->rows_max);
    if (rows > 0) c->be->ops->copy(c->be->ctx, ws->perm, ws->perm_host, sizeof(int32_t) * (size_t)rows, FM_COPY_H2D);
    if (rows > ws->recv_rows_high) ws->recv_rows_high = rows;
    if (n * d->k > ws->send_rows_high) ws->send_rows_high = n * d->k;
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

/* Chunk j's forward up to the combine: its n tokens `tok` gathered and dispatched, the counts
 * agreed, the rows at their owners run through the experts and the outputs back in ws->src.ye
 * (the source's expert-major layout over all E experts). */
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
    FM_TRY(ep_exchange(c, j, true, ws->src.xe, ws->recv));
    const fm_moe_dims dl = {d->H, d->I, ws->E_loc, 1}; /* the owner's rows, one per route */
    if (*R > 0) {
        be->ops->gather_rows(be->ctx, ws->exp.xe, ws->recv, ws->perm, *R, Hb);
        fm_experts_forward(be, &dl, c->w, &ws->exp, *R);
        be->ops->scatter_rows(be->ctx, ws->recv, ws->exp.ye, ws->perm, *R, Hb);
    }
    return ep_exchange(c, j, false, ws->recv, ws->src.ye);
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
    *err = K < 1 ? EP_ERR_K_BAD : (N + (K > 0 ? K : 1) - 1) / (K > 0 ? K : 1) > ws->c ? EP_ERR_K_SMALL : EP_ERR_NONE;
    return FM_OK;
}

fm_status fm_moe_ep_forward(const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                            const fm_moe_weights *w, fm_act *y, const fm_act *x, const int32_t *topk_idx,
                            const float *topk_w, int64_t N, int64_t K, const int32_t *chunk_tokens,
                            fm_moe_ep_ws *ws, double timeout_s) {
    ep_call c = {be, comm, d, w, ws, timeout_s, "forward", K};
    int64_t err;
    FM_TRY(ep_begin(&c, N, K, &err));
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
    ep_call c = {be, comm, d, w, ws, timeout_s, "backward", K};
    int64_t err;
    FM_TRY(ep_begin(&c, N, K, &err));
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
        FM_TRY(ep_exchange(&c, j, true, ws->src.xe, ws->recv));
        if (R > 0) {
            be->ops->gather_rows(be->ctx, ws->exp_ws.dye, ws->recv, ws->perm, R, Hb);
            fm_experts_backward(be, &dl, w, g, &ws->exp, &ws->exp_ws, R);
            be->ops->scatter_rows(be->ctx, ws->recv, ws->exp_ws.dxe, ws->perm, R, Hb);
        }
        /* the rows' input gradients back into the returned-rows buffer (ye was consumed) */
        FM_TRY(ep_exchange(&c, j, false, ws->recv, ws->src.ye));
        fm_moe_dispatch_backward(be, d, &ws->src, ws->dxc, ws->src.ye, n);
        fm_moe_chunk_scatter(be, dx, ws->dxc, tok, n, Hb);
        fm_moe_chunk_scatter(be, dtopk_w, ws->dtopk_w, tok, n, d->k * (int64_t)sizeof(float));
    }
    return FM_OK;
}
