/* The expert-parallel MoE (src/bounded/fm_moe_ep.h) against the one-rank MoE, on CPU ranks.
 *   test_moe_ep [self]  one rank, the self communicator (ep = 1); a plain ctest
 *   test_moe_ep all     under mpirun (tests/mpi_comm.sh np2 | np4): ep over the world and over
 *                       smaller ep groups of it (fm_comm_group_create)
 * Every rank builds the same MoE layer (same seed) and, from a per-rank seed, every rank's own
 * tokens, routing and output gradients, so each rank can run the one-rank plain MoE
 * (fm_moe_forward/backward with all experts, saved routes) over ALL ranks' tokens itself; no
 * reference value comes through the communicator under test. Each rank then runs the EP forward
 * and backward over its own tokens and its E/ep experts and checks: outputs, input gradients and
 * router-weight gradients of its tokens (per token, relative to its scale), its experts' weight
 * gradients (summed over every rank's tokens; relative L1), within bounds derived from the fp32
 * sums' reordering (run_case: OpenBLAS kernels differ by processor), its receive high-water mark
 * (equal to the rows the routing sends it, computed from the generated routing, and within
 * fm_moe_ep_bound_bytes), and that nothing was written past the bound (the working set's arena
 * is painted and its touched extent measured). Routing: random; every token of every rank to one
 * rank's experts; every token to one expert (k = 2: one of its choices; k = 1: its only one);
 * caps that do not divide N; a rank with zero tokens; gpt_oss's biased experts with the clamped
 * SwiGLU (under LLEP their biases travel with the hosted weights, their gradients come back; the
 * bias gradients are checked as the weights'). Errors that must be agreed on every rank:
 * disagreeing K, a chunk over the cap, duplicate experts that would overflow the bound, E % ep.
 *   test_moe_ep timeout (tests/mpi_comm.sh timeout: 4 ranks) rank 0 leaves the operator in the
 *                       middle of a chunk; the others must fail within the 2 s timeout, naming
 *                       the chunk, their rank and the collective, never hang. */
#include <math.h>
#include <time.h>
#include <unistd.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "bounded/fm_moe_ep.h"
#include "model/fm_experts.h"
#include "comm/fm_comm.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "model/fm_moe_layer.h"

static fm_backend g_be;
static int g_world_rank;

enum route_kind { ROUTE_RANDOM, ROUTE_TO_RANK, ROUTE_TO_EXPERT };

typedef struct ep_case {
    const char *name;
    fm_moe_dims d;
    int64_t c;          /* cap per source per chunk */
    int64_t N[8];       /* tokens per ep rank */
    enum route_kind route;
    int target;         /* ROUTE_TO_RANK: the rank; ROUTE_TO_EXPERT: the expert */
    uint64_t seed;
    fm_llep_opts llep;  /* least-loaded placement (off: plain EP) */
    bool skewed;        /* LLEP: the routing is skewed enough that placement must move rows */
} ep_case;

/* Rank p's data: x [N,H], topk idx/w [N,k], dy [N,H]. */
typedef struct rank_data {
    int64_t N;
    float *x, *tw, *dy;
    int32_t *idx;
} rank_data;

static void route_token(const ep_case *cs, int P, fm_rng *r, int32_t *idx, float *tw) {
    const int64_t E = cs->d.E, k = cs->d.k, El = E / P;
    for (int64_t j = 0; j < k; j++) {
        int32_t e;
        for (;;) {
            if (cs->route == ROUTE_TO_RANK) e = (int32_t)(cs->target * El + (int64_t)fm_rng_below(r, (uint64_t)El));
            else if (cs->route == ROUTE_TO_EXPERT && j == 0) e = cs->target;
            else e = (int32_t)fm_rng_below(r, (uint64_t)E);
            bool dup = false;
            for (int64_t i = 0; i < j; i++) dup |= idx[i] == e;
            if (!dup) break;
        }
        idx[j] = e;
    }
    float s = 0;
    for (int64_t j = 0; j < k; j++) s += tw[j] = 0.1f + fm_rng_uniform(r);
    for (int64_t j = 0; j < k; j++) tw[j] /= s;
}

static rank_data make_rank(const ep_case *cs, int P, int p, uint64_t salt) {
    const fm_moe_dims *d = &cs->d;
    rank_data rd = {cs->N[p], NULL, NULL, NULL, NULL};
    fm_rng r;
    fm_rng_seed(&r, cs->seed * 1000003u + (uint64_t)p * 7919u + salt);
    rd.x = fnew(rd.N * d->H), rd.dy = fnew(rd.N * d->H), rd.tw = fnew(rd.N * d->k), rd.idx = inew(rd.N * d->k);
    for (int64_t i = 0; i < rd.N * d->H; i++) rd.x[i] = (float)fm_rng_normal(&r), rd.dy[i] = (float)fm_rng_normal(&r);
    for (int64_t t = 0; t < rd.N; t++) route_token(cs, P, &r, rd.idx + t * d->k, rd.tw + t * d->k);
    return rd;
}
static void free_rank(rank_data *rd) { free(rd->x), free(rd->dy), free(rd->tw), free(rd->idx); }

static double l1_rel(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) num += fabs((double)a[i] - b[i]), den += fabs((double)b[i]);
    return den > 0 ? num / den : (num > 0 ? INFINITY : 0);
}

/* The router-weight gradients dtw[t,s] = dot(dy_t, ye_(t,s)) (in double: fm_moe_combine_bwd)
 * against the reference's: max over routes of |a - b| / sum_h |dy_t,h ye_(t,s),h|, ye the
 * reference's expert output of that route (saved: the plain twin over every rank's tokens, the
 * rank's own from token t0). The dot's own order adds nothing, so its error is ye's, weighted by
 * |dy|: against the terms' magnitude, not against |dtw|, which cancellation can make as small as
 * it likes (measured: 1e-6 to 1e-5 of |dtw| on OpenBLAS's Haswell and Zen kernels, issue 24). */
static double dot_rel(const float *a, const float *b, const float *dy, const fm_moe_routes *saved, int64_t t0,
                      int64_t n, int64_t k, int64_t H) {
    double worst = 0;
    for (int64_t r = 0; r < n * k; r++) {
        const float *ye = saved->ye + (int64_t)saved->route_row[t0 * k + r] * H, *g = dy + (r / k) * H;
        double mag = 0;
        for (int64_t h = 0; h < H; h++) mag += fabs((double)g[h] * ye[h]);
        const double df = fabs((double)a[r] - b[r]);
        worst = fmax(worst, isnan(df) ? INFINITY : df / (mag > 1e-30 ? mag : 1e-30));
    }
    return worst;
}

/* ---- a lazy async communicator: the pipelined schedule's hazards on CPU ranks ---------------
 * The blocking communicators run fm_comm_all_to_all_v_async at once (the earliest an exchange
 * may run). This wrapper of one of them runs each async exchange as LATE as fm_comm.h allows:
 * at the join of its ticket (or of a later one), in issue order; at issue it copies the counts
 * (the caller may rewrite them) and fills the receive regions with NaN (those that no earlier
 * queued exchange still reads: on a FIFO stream the write comes after those reads). So an operator that
 * reads a receive buffer before joining, or rewrites a send buffer before joining, computes
 * with NaN or with the wrong rows, and the bit-for-bit comparison with the serial schedule
 * fails. Every rank joins at the same program points, so the MPI exchanges still match. */
#define LAZY_Q 16
typedef struct lazy_op {
    const void *send;
    void *recv;
    int64_t sc[8], sd[8], rc[8], rd[8];
    fm_comm_dtype t;
    double to;
    int ticket;
} lazy_op;
static struct {
    const fm_comm_ops *base;
    fm_comm_ops ops;
    lazy_op q[LAZY_Q];
    int head, n, next;
    fm_status failed;
} g_lazy;

static fm_status lazy_mark(void *ctx, int *mark) {
    (void)ctx;
    *mark = -1; /* the CPU's op stream is always done */
    return FM_OK;
}
static fm_status lazy_a2a(void *ctx, const void *send, const int64_t *sc, const int64_t *sd, void *recv,
                          const int64_t *rc, const int64_t *rd, fm_comm_dtype t, double to, int after, int *ticket) {
    (void)after;
    const int W = g_lazy.base->size(ctx);
    FM_ASSERT(g_lazy.n < LAZY_Q && W <= 8);
    FM_ASSERT(t == FM_COMM_F32);
    for (int p = 0; p < W; p++) {
        const float *lo = (const float *)recv + rd[p], *hi = lo + rc[p];
        bool read_earlier = false;
        for (int i = 0; i < g_lazy.n; i++) {
            const lazy_op *e = &g_lazy.q[(g_lazy.head + i) % LAZY_Q];
            for (int q = 0; q < W; q++) {
                const float *elo = (const float *)e->send + e->sd[q], *ehi = elo + e->sc[q];
                read_earlier |= e->sc[q] > 0 && rc[p] > 0 && lo < ehi && elo < hi;
            }
        }
        if (!read_earlier)
            for (int64_t i = 0; i < rc[p]; i++) ((float *)recv)[rd[p] + i] = NAN;
    }
    lazy_op *o = &g_lazy.q[(g_lazy.head + g_lazy.n++) % LAZY_Q];
    o->send = send, o->recv = recv, o->t = t, o->to = to;
    for (int p = 0; p < W; p++) o->sc[p] = sc[p], o->sd[p] = sd[p], o->rc[p] = rc[p], o->rd[p] = rd[p];
    o->ticket = g_lazy.next;
    g_lazy.next = (g_lazy.next + 1) % FM_COMM_ASYNC_RING;
    *ticket = o->ticket;
    return FM_OK;
}
static fm_status lazy_join(void *ctx, int ticket) {
    bool queued = false;
    for (int i = 0; i < g_lazy.n; i++) queued |= g_lazy.q[(g_lazy.head + i) % LAZY_Q].ticket == ticket;
    while (queued && g_lazy.n > 0) {
        lazy_op *o = &g_lazy.q[g_lazy.head];
        g_lazy.head = (g_lazy.head + 1) % LAZY_Q, g_lazy.n--;
        const fm_status st = g_lazy.base->all_to_all_v(ctx, o->send, o->sc, o->sd, o->recv, o->rc, o->rd, o->t, o->to);
        if (st != FM_OK) return st;
        if (o->ticket == ticket) break;
    }
    return FM_OK;
}
/* *out: comm with the lazy async exchanges (the same context; every other op is comm's). */
static void lazy_wrap(fm_comm *out, const fm_comm *comm) {
    g_lazy.base = comm->ops;
    g_lazy.ops = *comm->ops;
    g_lazy.ops.mark = lazy_mark;
    g_lazy.ops.all_to_all_v_async = lazy_a2a;
    g_lazy.ops.join = lazy_join;
    g_lazy.head = g_lazy.n = 0;
    out->ops = &g_lazy.ops;
    out->ctx = comm->ctx;
}

/* The pipelined schedule equals the serial one bit for bit (ws ran the serial one for y, dx, dtw
 * and the gradients g3: gate, up, down, then the biases' or NULL, of len[m] floats): forced on the blocking communicator (exchanges at once)
 * and by default on the lazy one (exchanges as late as allowed); with one set (LLEP) both run
 * serially. */
static void check_pipelined(const fm_comm *comm, const ep_case *cs, fm_moe_ep_ws *ws, const fm_moe_weights *wl,
                            const rank_data *mine, int64_t K, const int32_t *order, const float *y, const float *dx,
                            const float *dtw, float *const g3[6], const int64_t len[6]) {
    const int me = fm_comm_rank(comm);
    const int64_t N = mine->N, H = cs->d.H, k = cs->d.k;
    CHECK_MSG(ws->pipelined_calls == 0, "%s: the blocking communicator ran the pipelined schedule by default", cs->name);
    CHECK(ws->sets == (cs->llep.on ? 1 : 2));
    for (int mode = 0; mode < 2; mode++) {
        fm_comm lz;
        const fm_comm *cc = comm;
        if (mode == 1) lazy_wrap(&lz, comm), cc = &lz;
        ws->schedule = mode == 0 ? FM_MOE_EP_PIPELINED : FM_MOE_EP_AUTO;
        const int64_t calls0 = ws->pipelined_calls, high0 = ws->recv_rows_high;
        float *y2 = fnew(N * H), *dx2 = fnew(N * H), *dtw2 = fnew(N * k);
        float *g2[6];
        for (int m = 0; m < 6; m++) g2[m] = g3[m] ? fnew(len[m]) : NULL;
        const fm_moe_grads gl2 = {g2[0], g2[1], g2[2], g2[3], g2[4], g2[5]};
        fm_status st = fm_moe_ep_block_forward(&g_be, cc, &cs->d, wl, y2, N ? mine->x : NULL, N ? mine->idx : NULL,
                                         N ? mine->tw : NULL, N, K, order, ws, 30);
        CHECK_MSG(st == FM_OK, "%s: pipelined forward: %s", cs->name, fm_errmsg());
        st = fm_moe_ep_block_backward(&g_be, cc, &cs->d, wl, &gl2, dx2, dtw2, mine->dy, mine->x, mine->idx, mine->tw, N, K,
                                order, ws, 30);
        CHECK_MSG(st == FM_OK, "%s: pipelined backward: %s", cs->name, fm_errmsg());
        const char *how = mode == 0 ? "pipelined (exchanges at once)" : "pipelined (lazy exchanges)";
        CHECK_MSG(ws->pipelined_calls == calls0 + (ws->sets == 2 ? 2 : 0), "%s: %s: %lld pipelined calls, want %lld",
                  cs->name, how, (long long)(ws->pipelined_calls - calls0), (long long)(ws->sets == 2 ? 2 : 0));
        CHECK_MSG(mode == 0 || g_lazy.n == 0, "%s: %lld exchanges never joined", cs->name, (long long)g_lazy.n);
        bool same = !memcmp(y, y2, sizeof(float) * (size_t)(N * H)) && !memcmp(dx, dx2, sizeof(float) * (size_t)(N * H)) &&
                    !memcmp(dtw, dtw2, sizeof(float) * (size_t)(N * k));
        for (int m = 0; m < 6; m++) same &= !g3[m] || !memcmp(g3[m], g2[m], sizeof(float) * (size_t)len[m]);
        CHECK_MSG(same, "%s: rank %d: the %s schedule differs from the serial one", cs->name, me, how);
        CHECK_MSG(ws->recv_rows_high == high0, "%s: %s: receive high %lld, serial %lld", cs->name, how,
                  (long long)ws->recv_rows_high, (long long)high0);
        free(y2), free(dx2), free(dtw2);
        for (int m = 0; m < 6; m++) free(g2[m]);
    }
    ws->schedule = FM_MOE_EP_AUTO;
}

/* Runs one case over the ep group `comm`; salt separates the data of independent groups. */
static void run_case(const fm_comm *comm, const ep_case *cs, uint64_t salt) {
    const int P = fm_comm_size(comm), me = fm_comm_rank(comm);
    const fm_moe_dims *d = &cs->d;
    const int64_t H = d->H, I = d->I, E = d->E, k = d->k, El = E / P;
    /* the layer: the same on every rank */
    const int64_t nw = E * I * H;
    float *Wg = fnew(nw), *Wu = fnew(nw), *Wd = fnew(nw);
    fm_rng r;
    fm_rng_seed(&r, cs->seed);
    for (int64_t i = 0; i < nw; i++) {
        Wg[i] = (float)fm_rng_normal(&r) * 0.3f;
        Wu[i] = (float)fm_rng_normal(&r) * 0.3f;
        Wd[i] = (float)fm_rng_normal(&r) * 0.3f;
    }
    /* gpt_oss's experts' biases (d->bias): gate, up [E,I], down [E,H]; their gradients, all and this rank's */
    const int64_t nb[3] = {E * I, E * I, E * H}, lb[3] = {El * I, El * I, El * H};
    float *Bw[3] = {NULL, NULL, NULL}, *gb_ref[3] = {NULL, NULL, NULL}, *gb[3] = {NULL, NULL, NULL};
    for (int m = 0; m < 3 && d->bias; m++) {
        Bw[m] = fnew(nb[m]), gb_ref[m] = fnew(nb[m]), gb[m] = fnew(lb[m]);
        for (int64_t i = 0; i < nb[m]; i++) Bw[m][i] = (float)fm_rng_normal(&r) * 0.3f;
    }
    /* every rank's tokens, concatenated in rank order */
    rank_data rd[8];
    int64_t Nall = 0, off[9];
    for (int p = 0; p < P; p++) off[p] = Nall, rd[p] = make_rank(cs, P, p, salt), Nall += rd[p].N;
    off[P] = Nall;
    float *xa = fnew(Nall * H), *dya = fnew(Nall * H), *twa = fnew(Nall * k);
    int32_t *idxa = inew(Nall * k);
    for (int p = 0; p < P; p++) {
        memcpy(xa + off[p] * H, rd[p].x, sizeof(float) * (size_t)(rd[p].N * H));
        memcpy(dya + off[p] * H, rd[p].dy, sizeof(float) * (size_t)(rd[p].N * H));
        memcpy(twa + off[p] * k, rd[p].tw, sizeof(float) * (size_t)(rd[p].N * k));
        memcpy(idxa + off[p] * k, rd[p].idx, sizeof(int32_t) * (size_t)(rd[p].N * k));
    }
    /* the reference: the one-rank plain MoE over all tokens, all experts local */
    float *y_ref = fnew(Nall * H), *dx_ref = fnew(Nall * H), *dtw_ref = fnew(Nall * k);
    float *gg_ref = fnew(nw), *gu_ref = fnew(nw), *gd_ref = fnew(nw);
    fm_arena ap, hp;
    FM_ASSERT(fm_arena_init(&ap, "plain", fm_moe_routes_bytes(d, Nall, 4) + fm_moe_ws_bytes(d, Nall, false, 4)) == FM_OK);
    FM_ASSERT(fm_arena_init(&hp, "plain host", 2 * fm_moe_routes_host_bytes(d)) == FM_OK);
    fm_moe_routes saved;
    fm_moe_ws wsp;
    fm_moe_routes_layout(&saved, &ap, &hp, d, Nall);
    fm_moe_ws_layout(&wsp, &ap, &hp, d, Nall, false);
    const fm_moe_weights w_all = {Wg, Wu, Wd, Bw[0], Bw[1], Bw[2]};
    const fm_moe_grads g_all = {gg_ref, gu_ref, gd_ref, gb_ref[0], gb_ref[1], gb_ref[2]};
    CHECK(fm_moe_forward(&g_be, d, &w_all, y_ref, xa, idxa, twa, Nall, 1, NULL, &saved, &wsp) == FM_OK);
    CHECK(fm_moe_backward(&g_be, d, &w_all, &g_all, dx_ref, dtw_ref, dya, xa, idxa, twa, Nall, 1, NULL, &saved, &wsp) == FM_OK);

    /* expert parallel over the group */
    const rank_data *mine = &rd[me];
    const int64_t N = mine->N;
    int64_t K = 0;
    CHECK(fm_moe_ep_chunks(comm, N, cs->c, 30, &K) == FM_OK);
    int64_t Kwant = 1;
    for (int p = 0; p < P; p++)
        if (rd[p].N > 0 && (rd[p].N + cs->c - 1) / cs->c > Kwant) Kwant = (rd[p].N + cs->c - 1) / cs->c;
    CHECK_MSG(K == Kwant, "%s: K %lld, want %lld", cs->name, (long long)K, (long long)Kwant);
    int32_t *order = inew(N);
    fm_moe_chunk_order(order, N, K);
    fm_moe_ep_bound b;
    const size_t dev_bytes = fm_moe_ep_bound_bytes(d, P, cs->c, sizeof(fm_act), &cs->llep, &b);
    CHECK(dev_bytes == b.device && b.rows_max == P * cs->c * (k < El ? k : El));
    /* the layout takes exactly the bound (a measuring arena) */
    fm_arena md, mh, dev, host;
    fm_arena_init_measure(&md, "ep measure");
    fm_arena_init_measure(&mh, "ep measure host");
    fm_moe_ep_ws ws;
    CHECK(fm_moe_ep_ws_layout(&ws, &md, &mh, d, P, me, cs->c, &cs->llep) == FM_OK);
    CHECK_MSG(md.high == b.device && mh.high == b.host, "%s: layout %zu/%zu bytes, bound %zu/%zu", cs->name, md.high,
              mh.high, b.device, b.host);
    const size_t slack = 4096; /* painted: nothing may be written past the bound */
    FM_ASSERT(fm_arena_init(&dev, "ep chunk working set", b.device + slack) == FM_OK);
    FM_ASSERT(fm_arena_init(&host, "ep host", b.host) == FM_OK);
    FM_ASSERT(fm_moe_ep_ws_layout(&ws, &dev, &host, d, P, me, cs->c, &cs->llep) == FM_OK);
    fm_arena_paint(&dev);
    const int64_t lw = El * I * H;
    float *gg = fnew(lw), *gu = fnew(lw), *gd = fnew(lw);
    float *y = fnew(N * H), *dx = fnew(N * H), *dtw = fnew(N * k);
#define MINE(b, m) ((b) ? (b) + me * lb[m] : NULL)
    const fm_moe_weights wl = {Wg + me * lw, Wu + me * lw, Wd + me * lw, MINE(Bw[0], 0), MINE(Bw[1], 1), MINE(Bw[2], 2)};
    const fm_moe_grads gl = {gg, gu, gd, gb[0], gb[1], gb[2]};
    fm_status st = fm_moe_ep_block_forward(&g_be, comm, d, &wl, y, N ? mine->x : NULL, N ? mine->idx : NULL,
                                     N ? mine->tw : NULL, N, K, order, &ws, 30);
    CHECK_MSG(st == FM_OK, "%s: forward: %s", cs->name, fm_errmsg());
    st = fm_moe_ep_block_backward(&g_be, comm, d, &wl, &gl, dx, dtw, mine->dy, mine->x, mine->idx, mine->tw, N, K, order,
                            &ws, 30);
    CHECK_MSG(st == FM_OK, "%s: backward: %s", cs->name, fm_errmsg());
    float *const g3[6] = {gg, gu, gd, gb[0], gb[1], gb[2]};
    const int64_t len[6] = {lw, lw, lw, lb[0], lb[1], lb[2]};
    check_pipelined(comm, cs, &ws, &wl, mine, K, order, y, dx, dtw, g3, len);
    const size_t touched = fm_arena_touched(&dev);
    CHECK_MSG(touched <= b.device, "%s: rank %d wrote %zu bytes into a working set bounded at %zu", cs->name, me,
              touched, b.device);

    const double ey = fm_test_row_rel(y, y_ref + off[me] * H, N, H);
    const double edx = fm_test_row_rel(dx, dx_ref + off[me] * H, N, H);
    const double etw = dot_rel(dtw, dtw_ref + off[me] * k, mine->dy, &saved, off[me], N, k, H);
    double eg = fmax(l1_rel(gg, gg_ref + me * lw, lw), fmax(l1_rel(gu, gu_ref + me * lw, lw),
                                                              l1_rel(gd, gd_ref + me * lw, lw)));
    for (int m = 0; m < 3 && d->bias; m++) eg = fmax(eg, l1_rel(gb[m], MINE(gb_ref[m], m), lb[m])); /* as the weights' */
#undef MINE
    /* The bounds. EP and the reference differ only in the row grouping of the expert GEMMs (and,
     * for the weight gradients, the order of the rows summed into each weight), which on some
     * OpenBLAS kernels changes the order of fp32 sums (tests/fm_test_fixed_gemm.h). Two orders of
     * an n-term sum differ by at most 2 gamma_n sum|terms| (gamma_n = n u / (1 - n u), u = 2^-24;
     * Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1). An output, an input
     * gradient or a router-weight gradient comes through a chain of an H-term and an I-term sum
     * (gate/up, then down; dgrad the other way): 2 gamma_(H+I), times 4 for the SwiGLU between
     * them and the backward's second chain, of the token's scale (fm_test_row_rel, dot_rel). A weight
     * gradient sums up to Nall k rows after that chain: 2 gamma_(Nall k + H + I) times 4, in
     * relative L1. Measured, at most: 5.5e-7, 4.1e-7, 3.4e-7 and 1.7e-7 on OpenBLAS's Haswell and
     * Zen kernels (the first three 0 on SkylakeX and Sandybridge), against 2.3e-5 and ~1e-4. */
    const double tol = 4 * fm_test_reorder_bound(H + I), tol_g = 4 * fm_test_reorder_bound(Nall * k + H + I);
    CHECK_MSG(ey <= tol, "%s: rank %d outputs rel %g (bound %g)", cs->name, me, ey, tol);
    CHECK_MSG(edx <= tol, "%s: rank %d input grads rel %g (bound %g)", cs->name, me, edx, tol);
    CHECK_MSG(etw <= tol, "%s: rank %d router-weight grads rel %g (bound %g)", cs->name, me, etw, tol);
    CHECK_MSG(eg <= tol_g, "%s: rank %d expert weight (and bias) grads rel L1 %g (bound %g)", cs->name, me, eg, tol_g);
    /* the receive high-water mark: the rows the generated routing sends this rank in its busiest
     * chunk (every rank's chunk j is its tokens j, j+K, ...) */
    int64_t want_high = 0, want_send = 0, plain_max = 0; /* plain EP: this rank's and the busiest rank's */
    for (int64_t j = 0; j < K; j++) {
        for (int q = 0; q < P; q++) {
            int64_t rows = 0;
            for (int p = 0; p < P; p++)
                for (int64_t t = j; t < rd[p].N; t += K)
                    for (int64_t s = 0; s < k; s++) rows += rd[p].idx[t * k + s] / El == q;
            if (q == me && rows > want_high) want_high = rows;
            if (rows > plain_max) plain_max = rows;
        }
        const int64_t sr = fm_moe_chunk_size(N, K, j) * k;
        if (sr > want_send) want_send = sr;
    }
    const size_t high_bytes = (size_t)ws.recv_rows_high * (size_t)H * sizeof(fm_act);
    if (!cs->llep.on)
        CHECK_MSG(ws.recv_rows_high == want_high && ws.send_rows_high == want_send,
                  "%s: rank %d received at most %lld rows (want %lld), sent %lld (want %lld)", cs->name, me,
                  (long long)ws.recv_rows_high, (long long)want_high, (long long)ws.send_rows_high,
                  (long long)want_send);
    else {
        /* least-loaded placement: under skew it moved rows in some chunk (the same verdict on every
         * rank) and the busiest rank now computes fewer rows than under plain EP */
        int64_t agg[2] = {ws.recv_rows_high, ws.llep_chunks};
        CHECK(fm_comm_allreduce_max_i64(comm, agg, 2, 30) == FM_OK);
        CHECK_MSG(agg[1] == ws.llep_chunks, "%s: rank %d placed %lld chunks, another %lld", cs->name, me,
                  (long long)ws.llep_chunks, (long long)agg[1]);
        if (cs->skewed && P > 1)
            CHECK_MSG(ws.llep_chunks > 0 && agg[0] < plain_max,
                      "%s: LLEP moved rows in %lld chunks; busiest rank %lld rows, plain EP %lld", cs->name,
                      (long long)ws.llep_chunks, (long long)agg[0], (long long)plain_max);
        if (me == 0 && cs->skewed)
            printf("LLEP %s at ep %d: the busiest rank computes %lld rows in a chunk, %lld under plain EP "
                   "(rows moved in %lld of %lld chunk passes, forward and backward)\n", cs->name, P,
                   (long long)agg[0], (long long)plain_max, (long long)ws.llep_chunks, (long long)(2 * K));
    }
    CHECK_MSG(high_bytes <= b.recv && ws.recv_rows_high <= b.rows_max, "%s: rank %d receive high %zu > bound %zu",
              cs->name, me, high_bytes, b.recv);
    printf("rank %d (world %d) %-34s ep %d N %3lld c %2lld K %2lld | recv high %4lld rows = %6zu B of bound %6zu B "
           "| ws %zu B | rel y %.1e dx %.1e dw %.1e dW %.1e\n",
           me, g_world_rank, cs->name, P, (long long)N, (long long)cs->c, (long long)K, (long long)ws.recv_rows_high,
           high_bytes, b.recv, b.device, ey, edx, etw, eg);
    /* where every rank routes everything to one rank and fills its chunks, the bound is reached */
    if (!cs->llep.on && cs->route == ROUTE_TO_RANK && me == cs->target && k <= El) {
        bool full = true;
        for (int p = 0; p < P; p++) full &= rd[p].N == K * cs->c;
        if (full) CHECK_MSG(ws.recv_rows_high == b.rows_max, "%s: rank %d: %lld rows, bound %lld not reached",
                            cs->name, me, (long long)ws.recv_rows_high, (long long)b.rows_max);
    }

    fm_arena_free(&ap), fm_arena_free(&hp), fm_arena_free(&dev), fm_arena_free(&host);
    for (int p = 0; p < P; p++) free_rank(&rd[p]);
    free(Wg), free(Wu), free(Wd), free(xa), free(dya), free(twa), free(idxa), free(y_ref), free(dx_ref);
    free(dtw_ref), free(gg_ref), free(gu_ref), free(gd_ref), free(order), free(gg), free(gu), free(gd), free(y);
    free(dx), free(dtw);
    for (int m = 0; m < 3; m++) free(Bw[m]), free(gb_ref[m]), free(gb[m]);
}

/* ---- the cases ---------------------------------------------------------------------------------- */

static void run_cases_llep(const fm_comm *comm, uint64_t salt, const fm_llep_opts *llep) {
    const int P = fm_comm_size(comm);
    const fm_moe_dims dk2 = {32, 16, 8, 2}, dk1 = {32, 16, 8, 1};
    ep_case cs;
    /* random routing, different N per rank, a cap that divides none of them */
    memset(&cs, 0, sizeof cs);
    if (llep) cs.llep = *llep;
    cs.name = "random, c=5", cs.d = dk2, cs.c = 5, cs.route = ROUTE_RANDOM, cs.seed = 11;
    for (int p = 0; p < P; p++) cs.N[p] = 13 + 7 * p;
    run_case(comm, &cs, salt);
    /* a rank with zero tokens (the last one), a cap of 4 */
    cs.name = "random, a rank with 0 tokens", cs.c = 4, cs.seed = 12;
    for (int p = 0; p < P; p++) cs.N[p] = p == P - 1 ? 0 : 9 + 5 * p;
    run_case(comm, &cs, salt);
    /* every rank with zero tokens: one chunk of nothing */
    cs.name = "no tokens anywhere", cs.c = 3, cs.seed = 13;
    for (int p = 0; p < P; p++) cs.N[p] = 0;
    run_case(comm, &cs, salt);
    /* a cap above every N (K = 1) */
    cs.name = "random, c > N", cs.c = 64, cs.seed = 14;
    for (int p = 0; p < P; p++) cs.N[p] = 10 + 3 * p;
    run_case(comm, &cs, salt);
    /* every token of every rank to the experts of the last rank: full chunks reach the bound */
    cs.name = "all to one rank, full chunks", cs.c = 4, cs.route = ROUTE_TO_RANK, cs.target = P - 1, cs.seed = 15;
    cs.skewed = true;
    for (int p = 0; p < P; p++) cs.N[p] = 12;
    if (8 / P >= 2) run_case(comm, &cs, salt);
    /* the same to rank 0 with ragged N and a rank with zero tokens */
    cs.name = "all to rank 0, ragged", cs.c = 3, cs.target = 0, cs.seed = 16;
    for (int p = 0; p < P; p++) cs.N[p] = p == 1 ? 0 : 7 + 4 * p;
    if (8 / P >= 2) run_case(comm, &cs, salt);
    /* every token has expert 5 among its two */
    cs.name = "all to expert 5 (k=2)", cs.c = 5, cs.route = ROUTE_TO_EXPERT, cs.target = 5, cs.seed = 17;
    cs.skewed = P > 1 && P < 8; /* half of all rows on one rank, at ep 2 and 4 */
    for (int p = 0; p < P; p++) cs.N[p] = 11 + 2 * p;
    run_case(comm, &cs, salt);
    /* gpt_oss's experts (biases, the clamped SwiGLU), every token to expert 5: spilled under LLEP */
    cs.name = "biased, all to expert 5 (k=2)", cs.seed = 19, cs.d.bias = true;
    cs.d.swiglu_limit = 7.0f, cs.d.swiglu_alpha = 1.702f;
    run_case(comm, &cs, salt);
    /* k = 1: every token to expert 2 only */
    cs.name = "all to expert 2 (k=1)", cs.d = dk1, cs.c = 3, cs.target = 2, cs.seed = 18;
    for (int p = 0; p < P; p++) cs.N[p] = 10 + p;
    run_case(comm, &cs, salt);
}

/* Every case with plain EP, then with least-loaded placement (small pieces: the chunks here
 * are a few rows; two hosted experts per rank). */
static void run_cases(const fm_comm *comm, uint64_t salt) {
    run_cases_llep(comm, salt, NULL);
    fm_llep_opts o = fm_llep_defaults();
    o.min_piece = 1;
    run_cases_llep(comm, salt, &o);
}

/* The placement alone (fm_moe_llep.h) over random and skewed loads: every row placed exactly
 * once, helpers within max_foreign and the receive bound, hosted lists sorted, no spill under
 * the trigger, and with min_piece 1 the busiest rank never busier than under plain EP. */
static void test_llep_place(void) {
    fm_rng r;
    fm_rng_seed(&r, 99);
    for (int iter = 0; iter < 400; iter++) {
        const int P = 1 + (int)fm_rng_below(&r, 6);
        const int64_t El = 1 + (int64_t)fm_rng_below(&r, 4), E = P * El, F = 1 + (int64_t)fm_rng_below(&r, 3);
        fm_llep_opts o = fm_llep_defaults();
        o.min_piece = iter % 2 ? 1 : 1 + (int64_t)fm_rng_below(&r, 6);
        int64_t load[32], native[8] = {0}, T = 0, Lmax = 0;
        const int skew = (int)fm_rng_below(&r, 3);
        for (int64_t e = 0; e < E; e++) {
            load[e] = (int64_t)fm_rng_below(&r, 20);
            if (skew == 1 && e / El == 0) load[e] += 40; /* one hot rank */
            if (skew == 2 && e == E - 1) load[e] += 100; /* one hot expert */
            native[e / El] += load[e], T += load[e];
        }
        for (int q = 0; q < P; q++) Lmax = native[q] > Lmax ? native[q] : Lmax;
        const int64_t rows_max = Lmax + (int64_t)fm_rng_below(&r, 30);
        fm_arena h;
        FM_ASSERT(fm_arena_init(&h, "plan", fm_llep_plan_bytes(P, E, F)) == FM_OK);
        fm_llep_plan pl;
        fm_llep_plan_layout(&pl, &h, P, E, F);
        CHECK(h.used == fm_llep_plan_bytes(P, E, F));
        fm_llep_place(&pl, load, rows_max, &o);
        int64_t rows[8] = {0}, sum = 0, rmax = 0;
        bool pieces_ok = true;
        for (int64_t e = 0; e < E; e++) {
            int64_t covered = 0; /* rank q's range of e, as the operator asks for it */
            for (int q = 0; q < P; q++) {
                int64_t st, len;
                fm_llep_range(&pl, e, q, &st, &len);
                rows[q] += len;
                covered += len;
                pieces_ok &= st >= 0 && st + len <= load[e];
            }
            pieces_ok &= covered == load[e];
            for (int64_t t = pl.piece_start[e]; t < pl.piece_start[e + 1]; t++)
                pieces_ok &= pl.piece_rank[t] != e / El && pl.piece_len[t] > 0;
        }
        CHECK_MSG(pieces_ok, "llep iter %d: a range outside its expert's rows, or a piece on the native rank", iter);
        bool tiles = true;
        for (int64_t e = 0; e < E; e++) {
            int64_t tot = pl.native_len[e];
            for (int64_t t = pl.piece_start[e]; t < pl.piece_start[e + 1]; t++) tot += pl.piece_len[t];
            tiles &= tot == load[e];
        }
        CHECK_MSG(tiles, "llep iter %d: the ranges do not tile each expert's rows", iter);
        for (int q = 0; q < P; q++) {
            CHECK_MSG(rows[q] == pl.rows[q] && rows[q] <= rows_max, "llep iter %d: rank %d rows %lld/%lld, bound %lld",
                      iter, q, (long long)rows[q], (long long)pl.rows[q], (long long)rows_max);
            CHECK(pl.nforeign[q] >= 0 && pl.nforeign[q] <= F);
            for (int i = 1; i < pl.nforeign[q]; i++) CHECK(pl.foreign[q * F + i - 1] < pl.foreign[q * F + i]);
            for (int i = 0; i < pl.nforeign[q]; i++) CHECK(pl.foreign[q * F + i] / El != q);
            sum += rows[q];
            rmax = rows[q] > rmax ? rows[q] : rmax;
        }
        CHECK(sum == T);
        if ((double)Lmax <= o.lambda * (double)T / P) CHECK_MSG(!pl.spill, "llep iter %d: spilled under the trigger", iter);
        if (o.min_piece == 1) CHECK_MSG(rmax <= Lmax, "llep iter %d: busiest %lld > plain %lld", iter, (long long)rmax,
                                        (long long)Lmax);
        if (skew == 1 && P > 1 && o.min_piece == 1) CHECK_MSG(pl.spill && rmax < Lmax, "llep iter %d: a hot rank kept", iter);
        fm_arena_free(&h);
    }
}

/* An error that every rank of the group must return alike (status and a message piece). */
#define EXPECT_ALL(want, expr, piece)                                                                  \
    do {                                                                                               \
        const fm_status s_ = (expr);                                                                   \
        CHECK_MSG(s_ == (want) && strstr(fm_errmsg(), (piece)), "got %s: %s (want %s with \"%s\")",   \
                  fm_status_name(s_), fm_errmsg(), fm_status_name(want), (piece));                    \
    } while (0)

static void run_errors(const fm_comm *comm) {
    const int P = fm_comm_size(comm), me = fm_comm_rank(comm);
    char piece[160];
    /* E % ep != 0 */
    const fm_moe_dims bad = {8, 4, (int64_t)P * 2 + 1, 1};
    fm_moe_ep_ws ws;
    fm_arena md, mh;
    fm_arena_init_measure(&md, "m");
    fm_arena_init_measure(&mh, "mh");
    if (P > 1) {
        snprintf(piece, sizeof piece, "num_experts %d is not divisible by the ep degree %d", P * 2 + 1, P);
        EXPECT_ALL(FM_ERR_ARG, fm_moe_ep_ws_layout(&ws, &md, &mh, &bad, P, me, 4, NULL), piece);
        CHECK(fm_moe_ep_bound_bytes(&bad, P, 4, 4, NULL, NULL) == 0);
    }
    EXPECT_ALL(FM_ERR_ARG, fm_moe_ep_ws_layout(&ws, &md, &mh, &(fm_moe_dims){8, 4, 2 * P, 1}, P, me, 0, NULL), "cap");
    fm_llep_opts bo = fm_llep_defaults();
    bo.max_foreign = 0;
    EXPECT_ALL(FM_ERR_ARG, fm_moe_ep_ws_layout(&ws, &md, &mh, &(fm_moe_dims){8, 4, 2 * P, 1}, P, me, 4, &bo),
               "max_foreign 0");

    /* the working set and data for the agreement errors: dims {8, 4, 2P, 3}, cap 2 */
    const fm_moe_dims d = {8, 4, 2 * (int64_t)P, 3};
    const int64_t c = 2, N = 4, H = d.H, k = d.k, El = 2;
    fm_moe_ep_bound b;
    fm_moe_ep_bound_bytes(&d, P, c, sizeof(fm_act), NULL, &b);
    fm_arena dev, host;
    FM_ASSERT(fm_arena_init(&dev, "ep", b.device) == FM_OK && fm_arena_init(&host, "eph", b.host) == FM_OK);
    FM_ASSERT(fm_moe_ep_ws_layout(&ws, &dev, &host, &d, P, me, c, NULL) == FM_OK);
    float *W = fnew(El * d.I * H * 3), *x = fnew(N * H), *y = fnew(N * H), *tw = fnew(N * k), *dx = fnew(N * H);
    float *dtw = fnew(N * k), *G = fnew(El * d.I * H * 3);
    int32_t *idx = inew(N * k), *order = inew(N);
    for (int64_t i = 0; i < N * H; i++) x[i] = (float)(i % 7) * 0.25f;
    for (int64_t t = 0; t < N; t++)
        for (int64_t j = 0; j < k; j++) idx[t * k + j] = (int32_t)((t + j) % d.E), tw[t * k + j] = 1.0f / 3;
    const fm_moe_weights w = {W, W + El * d.I * H, W + 2 * El * d.I * H};
    const fm_moe_grads g = {G, G + El * d.I * H, G + 2 * El * d.I * H};
    int64_t K;
    CHECK(fm_moe_ep_chunks(comm, N, c, 30, &K) == FM_OK && K == 2);
    fm_moe_chunk_order(order, N, K);
    /* rank 0 passes another K: every rank refuses, naming rank 0 */
    if (P > 1)
        EXPECT_ALL(FM_ERR_ARG,
                   fm_moe_ep_block_forward(&g_be, comm, &d, &w, y, x, idx, tw, N, me == 0 ? 3 : K, order, &ws, 30),
                   me == 0 ? "must run the same chunks" : "rank 0 passed K = 3 chunks");
    /* every rank passes K = 1, but then the last rank's one chunk holds N = 4 > c tokens */
    const int64_t Nl = me == P - 1 ? N : 2;
    snprintf(piece, sizeof piece, "rank %d's chunks hold more than the cap c = 2", P - 1);
    EXPECT_ALL(FM_ERR_ARG, fm_moe_ep_block_backward(&g_be, comm, &d, &w, &g, dx, dtw, y, x, idx, tw, Nl, 1, order, &ws, 30),
               piece);
    /* duplicate experts (0, 1, 0) of rank 0's two: 3 rows per token to one owner, above c * min(k, E/ep) */
    for (int64_t t = 0; t < N; t++) idx[t * k] = 0, idx[t * k + 1] = 1, idx[t * k + 2] = 0;
    EXPECT_ALL(FM_ERR_ARG, fm_moe_ep_block_forward(&g_be, comm, &d, &w, y, x, idx, tw, N, K, order, &ws, 30),
               "a token's top-k experts must be distinct");
    /* rank 0 laid out with least-loaded placement, the others without: refused everywhere */
    if (P > 1) {
        for (int64_t t = 0; t < N; t++)
            for (int64_t j = 0; j < k; j++) idx[t * k + j] = (int32_t)((t + j) % d.E);
        const fm_llep_opts lo = fm_llep_defaults();
        fm_moe_ep_bound b2;
        fm_moe_ep_bound_bytes(&d, P, c, sizeof(fm_act), me == 0 ? &lo : NULL, &b2);
        fm_arena dev2, host2;
        FM_ASSERT(fm_arena_init(&dev2, "ep2", b2.device) == FM_OK && fm_arena_init(&host2, "eph2", b2.host) == FM_OK);
        fm_moe_ep_ws ws2;
        FM_ASSERT(fm_moe_ep_ws_layout(&ws2, &dev2, &host2, &d, P, me, c, me == 0 ? &lo : NULL) == FM_OK);
        EXPECT_ALL(FM_ERR_ARG, fm_moe_ep_block_forward(&g_be, comm, &d, &w, y, x, idx, tw, N, K, order, &ws2, 30),
                   "must lay it out alike");
        fm_arena_free(&dev2), fm_arena_free(&host2);
    }
    /* rank 0 pipelined, the others serial (the exchanges would pair up wrongly): refused at chunk
     * 0's agreement on every rank, before any rows move */
    if (P > 1) {
        for (int64_t t = 0; t < N; t++)
            for (int64_t j = 0; j < k; j++) idx[t * k + j] = (int32_t)((t + j) % d.E);
        ws.schedule = me == 0 ? FM_MOE_EP_PIPELINED : FM_MOE_EP_SERIAL;
        EXPECT_ALL(FM_ERR_ARG, fm_moe_ep_block_forward(&g_be, comm, &d, &w, y, x, idx, tw, N, K, order, &ws, 30),
                   "run the same schedule");
        ws.schedule = FM_MOE_EP_AUTO;
    }
    /* rank 0's FLATMOE_EP_SCHEDULE was bad at layout (the layout itself succeeds): refused everywhere */
    ws.schedule_bad = me == 0;
    EXPECT_ALL(FM_ERR_ARG, fm_moe_ep_block_forward(&g_be, comm, &d, &w, y, x, idx, tw, N, K, order, &ws, 30),
               "rank 0's FLATMOE_EP_SCHEDULE is not one of auto, serial, pipelined");
    ws.schedule_bad = false;
    /* the schedule the caller sets (the CLI's FLATMOE_EP_SCHEDULE, fm_backend_opts.ep_schedule): a
     * valid one as given, another value (-1) refused at the first chunk (schedule_bad, above) */
    {
        fm_arena mdv, mhs;
        fm_moe_ep_ws wb;
        fm_arena_init_measure(&mdv, "ep bad schedule");
        fm_arena_init_measure(&mhs, "ep bad schedule host");
        CHECK(fm_moe_ep_ws_layout(&wb, &mdv, &mhs, &d, P, me, c, NULL) == FM_OK && wb.schedule == FM_MOE_EP_AUTO &&
              !wb.schedule_bad);
        fm_moe_ep_ws_set_schedule(&wb, FM_MOE_EP_SERIAL);
        CHECK(wb.schedule == FM_MOE_EP_SERIAL && !wb.schedule_bad);
        fm_moe_ep_ws_set_schedule(&wb, FM_MOE_EP_PIPELINED);
        CHECK(wb.schedule == FM_MOE_EP_PIPELINED && !wb.schedule_bad);
        fm_moe_ep_ws_set_schedule(&wb, -1);
        CHECK(wb.schedule == FM_MOE_EP_AUTO && wb.schedule_bad);
        fm_moe_ep_ws_set_schedule(&wb, FM_MOE_EP_AUTO);
        CHECK(wb.schedule == FM_MOE_EP_AUTO && !wb.schedule_bad);
    }
    /* biased experts under LLEP but a working set laid out without their biases: refused before any collective */
    {
        const fm_llep_opts lo = fm_llep_defaults();
        fm_moe_ep_bound b3;
        fm_moe_ep_bound_bytes(&d, P, c, sizeof(fm_act), &lo, &b3);
        fm_arena dev3, host3;
        FM_ASSERT(fm_arena_init(&dev3, "ep3", b3.device) == FM_OK && fm_arena_init(&host3, "eph3", b3.host) == FM_OK);
        fm_moe_ep_ws ws3;
        FM_ASSERT(fm_moe_ep_ws_layout(&ws3, &dev3, &host3, &d, P, me, c, &lo) == FM_OK);
        const fm_moe_weights wb = {w.w_gate, w.w_up, w.w_down, W, W, W};
        EXPECT_ALL(FM_ERR_ARG, fm_moe_ep_block_forward(&g_be, comm, &d, &wb, y, x, idx, tw, N, K, order, &ws3, 30),
                   "weights carry biases (b_gate, b_up, b_down) but the working set was laid out without them");
        fm_arena_free(&dev3), fm_arena_free(&host3);
    }
    /* after refused calls the group still works (every rank left every collective alike) */
    CHECK(fm_moe_ep_chunks(comm, N, c, 30, &K) == FM_OK && K == 2);
    fm_arena_free(&dev), fm_arena_free(&host);
    free(W), free(x), free(y), free(tw), free(dx), free(dtw), free(G), free(idx), free(order);
}

/* ---- a rank that stops mid-operator: the others must fail within the timeout ---------------- */

static fm_comm_ops g_failing_ops; /* the mpi table; all_to_all_v fails (locally, no MPI call) on its 3rd call */
static const fm_comm_ops *g_mpi_ops;
static int g_a2a_calls;
static fm_status failing_a2a(void *ctx, const void *send, const int64_t *sc, const int64_t *sd, void *recv,
                             const int64_t *rc, const int64_t *rd, fm_comm_dtype t, double timeout_s) {
    if (++g_a2a_calls == 3) return fm_error(FM_ERR_IO, "rank 0: a simulated local failure in all_to_all_v");
    return g_mpi_ops->all_to_all_v(ctx, send, sc, sd, recv, rc, rd, t, timeout_s);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Rank 0 leaves the EP forward at chunk 1's dispatch (its third all_to_all_v); ranks 1.. wait in
 * that all_to_all_v and must return FM_ERR_IO naming the operator, the chunk, their rank and the
 * collective after the 2 s timeout. The verdict is agreed on a second communicator and rank 0
 * ends the job (the world has abandoned requests), as tests/mpi_comm.sh's timeout mode expects. */
static int mode_timeout(const fm_comm *world) {
    const int W = fm_comm_size(world), me = fm_comm_rank(world);
    fm_comm aux;
    CHECK(world->ops->split(world->ctx, 0, me, &aux) == FM_OK);
    const fm_moe_dims d = {32, 16, 8, 2};
    const int64_t N = 12, c = 4, H = d.H, k = d.k, El = d.E / W;
    fm_moe_ep_bound b;
    fm_moe_ep_bound_bytes(&d, W, c, sizeof(fm_act), NULL, &b);
    fm_arena dev, host;
    FM_ASSERT(fm_arena_init(&dev, "ep", b.device) == FM_OK && fm_arena_init(&host, "eph", b.host) == FM_OK);
    fm_moe_ep_ws ws;
    FM_ASSERT(fm_moe_ep_ws_layout(&ws, &dev, &host, &d, W, me, c, NULL) == FM_OK);
    float *Wt = fnew(3 * El * d.I * H), *x = fnew(N * H), *y = fnew(N * H), *tw = fnew(N * k);
    int32_t *idx = inew(N * k), *order = inew(N);
    for (int64_t t = 0; t < N; t++)
        for (int64_t j = 0; j < k; j++) idx[t * k + j] = (int32_t)((t + j) % d.E), tw[t * k + j] = 0.5f;
    const fm_moe_weights w = {Wt, Wt + El * d.I * H, Wt + 2 * El * d.I * H};
    int64_t K;
    CHECK(fm_moe_ep_chunks(world, N, c, 30, &K) == FM_OK && K == 3);
    fm_moe_chunk_order(order, N, K);
    g_mpi_ops = world->ops;
    g_failing_ops = *world->ops;
    g_failing_ops.all_to_all_v = failing_a2a;
    const fm_comm rank0 = {&g_failing_ops, world->ctx};
    CHECK(fm_comm_barrier(world, 30) == FM_OK);
    const double t0 = now_s();
    const fm_status st = fm_moe_ep_block_forward(&g_be, me == 0 ? &rank0 : world, &d, &w, y, x, idx, tw, N, K, order, &ws, 2.0);
    const double el = now_s() - t0;
    int64_t fails = 0;
    if (me == 0) CHECK_MSG(st == FM_ERR_IO && strstr(fm_errmsg(), "simulated"), "rank 0: %s", fm_errmsg());
    else {
        char need[160];
        snprintf(need, sizeof need, "moe_ep forward, chunk 2 of 3: rank %d of %d: all_to_all_v(fp32", me, W);
        CHECK_MSG(st == FM_ERR_IO, "rank %d: expected FM_ERR_IO, got %s", me, fm_status_name(st));
        CHECK_MSG(strstr(fm_errmsg(), need) && strstr(fm_errmsg(), "timed out after 2 s"),
                  "rank %d: message '%s' lacks '%s ... timed out after 2 s'", me, fm_errmsg(), need);
        CHECK_MSG(el >= 1.9 && el < 8.0, "rank %d: returned after %.2f s, expected about 2 s", me, el);
        printf("rank %d: after %.2f s: %s\n", me, el, fm_errmsg());
        fails = fm_test_failed;
    }
    CHECK_MSG(fm_comm_allreduce_sum_i64(&aux, &fails, 1, 30) == FM_OK, "%s", fm_errmsg());
    if (me == 0) {
        printf("timeout test: %s (%lld failed checks on ranks 1..%d)\n", fails || fm_test_failed ? "FAILED" : "passed",
               (long long)fails, W - 1);
        fflush(stdout);
        fm_comm_mpi_abort(fails || fm_test_failed ? 1 : 0); /* world has abandoned requests: end the job */
    }
    fflush(stdout);
    sleep(60); /* rank 0's abort ends this process */
    return 1;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "self";
    FM_ASSERT(fm_cpu_backend_init(&g_be, 1, 64) == FM_OK);
    if (!strcmp(mode, "self")) {
        fm_comm self;
        FM_ASSERT(fm_comm_self_create(&self, NULL, 0) == FM_OK);
        test_llep_place();
        run_cases(&self, 0);
        run_errors(&self);
        fm_comm_free(&self);
        fm_cpu_backend_free(&g_be);
        return fm_test_finish();
    }
    if (!fm_comm_mpi_built()) {
        printf("the mpi communicator is not in this build: skipped\n");
        return 77;
    }
    fm_comm world;
    FM_ASSERT(fm_comm_mpi_world(&world, NULL, 0, 0) == FM_OK);
    const int W = fm_comm_size(&world);
    g_world_rank = fm_comm_rank(&world);
    FM_ASSERT(W <= 8);
    if (!strcmp(mode, "timeout")) return mode_timeout(&world);
    /* ep over the whole world */
    run_cases(&world, 0);
    run_errors(&world);
    /* ep groups smaller than the world: each runs its own cases at the same time */
    for (int ep = 1; ep < W; ep *= 2) {
        if (W % ep) continue;
        fm_comm_group grp;
        CHECK(fm_comm_group_create(&grp, &world, W, ep, 1) == FM_OK);
        const fm_comm *epc = &grp.axis[FM_AXIS_EP].comm;
        CHECK(fm_comm_size(epc) == ep);
        run_cases(epc, 100 + (uint64_t)(g_world_rank / ep));
        fm_comm_group_free(&grp);
    }
    int64_t fails = fm_test_failed;
    CHECK(fm_comm_allreduce_sum_i64(&world, &fails, 1, 30) == FM_OK);
    fm_comm_free(&world);
    CHECK(fm_comm_mpi_finalize() == FM_OK);
    fm_cpu_backend_free(&g_be);
    printf("rank %d of %d: ", g_world_rank, W);
    const int rc = fm_test_finish();
    return rc ? rc : fails ? 1 : 0;
}
