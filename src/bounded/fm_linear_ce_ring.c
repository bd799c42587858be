/* Ring-DTP (fm_linear_ce_ring.h): the schedule of the vocabulary ring, its messages and its
 * bound. Arithmetic: the one-rank operator's block steps (fm_linear_ce_fold_range,
 * fm_linear_ce_grad_range) and the backend's lce_finalize, add, copy_async and mem_set; data
 * movement: fm_comm_all_to_all_v with one nonzero count per side (to the successor or the
 * predecessor).
 *
 * Who holds what (rank r, P ranks, shard s = the head rows of rank s, block q = rank q's tokens):
 *   ACTIVATIONS forward  round k: block (r - k) mod P meets shard r; hop to r + 1.
 *               backward round k: block (r + 1 + k) mod P meets shard r; hop to r - 1; after
 *               round P - 1 rank r holds its own block again (r + 1 + P - 1 = r).
 *   WEIGHTS     forward  round k: shard (r - k) mod P meets block r; hop to r + 1.
 *               backward round k: shard (r + 1 + k) mod P meets block r; hop to r - 1; the last
 *               round holds shard r: the accumulator that travelled with it is added to dW.
 * The forward's last round leaves every rank holding what the backward's first round needs, so
 * a forward + backward call makes 2 (P - 1) hops. Whether a token block's state or dh was
 * already started (assigned by its first meeting, folded or added into later) depends only on
 * the shard sizes, which every rank knows: the host works it out, nothing travels for it.
 */
#include "fm_linear_ce_ring.h"

#include <limits.h>

static const int64_t F32 = (int64_t)sizeof(float);

const char *fm_lce_ring_mode_name(fm_lce_ring_mode mode) {
    switch (mode) {
    case FM_LCE_RING_AUTO: return "auto";
    case FM_LCE_RING_ACTIVATIONS: return "activations";
    case FM_LCE_RING_WEIGHTS: return "weights";
    }
    return "?";
}

fm_lce_ring_opts fm_lce_ring_opts_default(void) {
    fm_lce_ring_opts o = {0};
    o.lce = fm_lce_opts_default();
    o.mode = FM_LCE_RING_AUTO;
    return o;
}

static int64_t shard_size(int64_t V, int P) { return (V + P - 1) / P; }

void fm_lce_ring_shard(int64_t V, int P, int r, int64_t *first_row, int64_t *rows) {
    FM_ASSERT(V >= 0 && P >= 1 && r >= 0 && r < P && first_row && rows);
    const int64_t S = shard_size(V, P), b = (int64_t)r * S;
    *first_row = b < V ? b : V;
    *rows = b >= V ? 0 : (V - b < S ? V - b : S);
}

fm_lce_ring_mode fm_lce_ring_choose(int64_t n_max, int64_t V, int P) {
    return n_max <= shard_size(V, P) ? FM_LCE_RING_ACTIVATIONS : FM_LCE_RING_WEIGHTS;
}

static int64_t blk(int64_t asked, int64_t dflt) { return asked > 0 ? asked : dflt; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static size_t rnd(int64_t bytes) { return fm_arena_round((size_t)bytes); }

/* What travels, agreed by the group. */
typedef struct ring_flags {
    bool weights, entropy, dh, dW;
} ring_flags;

/* The ACTIVATIONS message of a block of n tokens: byte offsets of its parts (64-byte aligned);
 * the state prefix ends at `state`, the forward message at `fwd`, the backward one at `bwd`. */
typedef struct act_layout {
    size_t tg, w, m, z, tgt, ent, h, dh;
    size_t state, fwd, bwd;
} act_layout;

static act_layout act_lay(int64_t n, int64_t H, size_t a, ring_flags f) {
    act_layout L;
    size_t o = 0;
    L.tg = o, o += rnd(n * 4);
    L.w = o, o += f.weights ? rnd(n * F32) : 0;
    L.m = o, o += rnd(n * F32);
    L.z = o, o += rnd(n * F32);
    L.tgt = o, o += rnd(n * F32);
    L.ent = o, o += f.entropy ? rnd(n * F32) : 0;
    L.state = o;
    L.h = o, o += rnd(n * H * (int64_t)a);
    L.fwd = o;
    L.dh = o, o += f.dh ? rnd(n * H * (int64_t)a) : 0;
    L.bwd = o;
    return L;
}

/* The WEIGHTS message of a shard of `rows` rows: W_s at 0, the dW accumulator at `acc`. The
 * forward message is exactly rows H a bytes (it is sent from the caller's W_shard at first). */
static size_t w_acc_off(int64_t rows, int64_t H, size_t a) { return rnd(rows * H * (int64_t)a); }
static size_t w_fwd(int64_t rows, int64_t H, size_t a) { return (size_t)(rows * H) * a; }
static size_t w_bwd(int64_t rows, int64_t H, size_t a, ring_flags f) {
    return f.dW ? w_acc_off(rows, H, a) + (size_t)(rows * H) * a : w_fwd(rows, H, a);
}
static size_t w_cap(int64_t S, int64_t H, size_t a, ring_flags f) {
    return w_acc_off(S, H, a) + (f.dW ? w_acc_off(S, H, a) : 0);
}

static int ring_buffers(int P, fm_lce_ring_mode mode) {
    return P > 1 ? 2 : (mode == FM_LCE_RING_ACTIVATIONS ? 1 : 0);
}

/* The bound (the header's formula); the schedule below takes exactly these pieces. */
static size_t ring_bound(fm_lce_ring_mode mode, int64_t n_max, int64_t H, int64_t V, int P, int64_t Nb0,
                         int64_t Vb0, ring_flags f, size_t a) {
    if (n_max <= 0) return 0;
    const int64_t S = shard_size(V, P);
    if (mode == FM_LCE_RING_AUTO) mode = fm_lce_ring_choose(n_max, V, P);
    /* the strip's act copy exists only with backward (act size 4: the formula without it) */
    const size_t strip = fm_linear_ce_strip_bytes_a(min64(Nb0, n_max), min64(Vb0, S), f.dh || f.dW ? a : 4);
    const size_t B = (size_t)ring_buffers(P, mode);
    if (mode == FM_LCE_RING_ACTIVATIONS) {
        const act_layout L = act_lay(n_max, H, a, f);
        return strip + B * (f.dh ? L.bwd : L.fwd);
    }
    return strip + B * w_cap(S, H, a, f) + (size_t)(3 + f.entropy) * rnd(n_max * F32);
}

size_t fm_linear_ce_ring_bound_bytes_a(fm_lce_ring_mode mode, int64_t n_max, int64_t H, int64_t V, int P,
                                       bool want_dh, bool want_dW, const fm_lce_opts *opts, size_t act_bytes) {
    FM_ASSERT(n_max >= 0 && H >= 1 && V >= 1 && P >= 1);
    const fm_lce_opts o = opts ? *opts : fm_lce_opts_default();
    const ring_flags f = {o.token_weight != NULL, o.out_entropy != NULL, want_dh, want_dW};
    return ring_bound(mode, n_max, H, V, P, blk(o.block_tokens, FM_LCE_DEFAULT_BLOCK_TOKENS),
                      blk(o.block_vocab, FM_LCE_DEFAULT_BLOCK_VOCAB), f, act_bytes);
}

size_t fm_linear_ce_ring_bound_bytes(fm_lce_ring_mode mode, int64_t n_max, int64_t H, int64_t V, int P,
                                     bool want_dh, bool want_dW, const fm_lce_opts *opts) {
    return fm_linear_ce_ring_bound_bytes_a(mode, n_max, H, V, P, want_dh, want_dW, opts, sizeof(fm_act));
}

/* ---- the first exchange: every rank's N, its argument check, and the agreed arguments ------- */

/* Arguments that must be equal on every rank, and flags that every rank holding data (tokens,
 * or shard rows for dW) must agree on. */
enum { CFG_V, CFG_H, CFG_MODE, CFG_NB, CFG_VB, CFG_IGNORE, CFG_ZLOSS, CFG_COUNT };
enum { FLAG_WEIGHTS, FLAG_ENTROPY, FLAG_DH, FLAG_DW, FLAG_COUNT };
static const char *const cfg_name[CFG_COUNT] = {"V", "H", "mode", "block_tokens", "block_vocab", "ignore_index",
                                                "z_loss"};
static const char *const flag_name[FLAG_COUNT] = {"token_weight", "out_entropy", "dh", "dW_shard"};

/* The ring's state during one call. */
typedef struct ring {
    const fm_backend *be;
    const fm_comm *comm;
    int r, P;
    double timeout;
    int64_t n[FM_LCE_RING_MAX_RANKS];     /* tokens of each rank */
    int64_t sc[FM_LCE_RING_MAX_RANKS], sd[FM_LCE_RING_MAX_RANKS]; /* all_to_all_v counts, displs */
    int64_t rc[FM_LCE_RING_MAX_RANKS], rd[FM_LCE_RING_MAX_RANKS];
    int64_t V, H, S, Nb0, Vb0;
    size_t a;
    ring_flags f;
    bool sync_before_hop; /* device memory through a host-staged communicator */
    int hops;
    size_t bytes_sent;
} ring;

static int mod(int x, int P) { return ((x % P) + P) % P; }
static int64_t rows_of(const ring *R, int s) {
    int64_t b, n;
    fm_lce_ring_shard(R->V, R->P, s, &b, &n);
    return n;
}
static int64_t first_of(const ring *R, int s) {
    int64_t b, n;
    fm_lce_ring_shard(R->V, R->P, s, &b, &n);
    return b;
}
/* Whether any of the shards start, start + step, ... (count of them) has rows: a token block
 * that met those shards has started its state (or its dh). */
static bool any_rows(const ring *R, int start, int step, int count) {
    for (int j = 0; j < count; j++)
        if (rows_of(R, mod(start + j * step, R->P)) > 0) return true;
    return false;
}

static fm_status exchange(ring *R, const fm_comm *comm, int64_t N, const int64_t cfg[CFG_COUNT],
                          const bool given[FLAG_COUNT], const bool has_data[FLAG_COUNT], bool bad) {
    const int P = R->P, r = R->r;
    int64_t x[2 * FM_LCE_RING_MAX_RANKS + 2 * CFG_COUNT + 2 * FLAG_COUNT];
    const int nx = 2 * P + 2 * CFG_COUNT + 2 * FLAG_COUNT;
    int64_t *xn = x, *xbad = x + P, *xcfg = x + 2 * P, *xflag = x + 2 * P + 2 * CFG_COUNT;
    for (int q = 0; q < P; q++) xn[q] = xbad[q] = -1;
    xn[r] = N >= 0 ? N : 0;
    xbad[r] = bad ? 1 : 0;
    for (int i = 0; i < CFG_COUNT; i++) xcfg[2 * i] = cfg[i], xcfg[2 * i + 1] = -cfg[i];
    for (int i = 0; i < FLAG_COUNT; i++) {
        xflag[2 * i] = has_data[i] && given[i];      /* max: some rank with data gave it */
        xflag[2 * i + 1] = has_data[i] && !given[i]; /* max: some rank with data left it NULL */
    }
    FM_TRY(fm_comm_allreduce_max_i64(comm, x, nx, R->timeout));
    if (bad) return FM_ERR_ARG; /* this rank's message is already set */
    for (int q = 0; q < P; q++)
        if (xbad[q] > 0)
            return fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring: rank %d was given bad arguments (its own "
                            "error names them); every rank stops", r, P, q);
    for (int i = 0; i < CFG_COUNT; i++)
        if (xcfg[2 * i] != -xcfg[2 * i + 1])
            return fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring: %s differs between the ranks (from %lld to "
                            "%lld; this rank: %lld): every rank must pass the same", r, P, cfg_name[i],
                            (long long)-xcfg[2 * i + 1], (long long)xcfg[2 * i], (long long)cfg[i]);
    for (int i = 0; i < FLAG_COUNT; i++)
        if (xflag[2 * i] > 0 && xflag[2 * i + 1] > 0)
            return fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring: %s is given on some ranks and NULL on "
                            "others (this rank: %s): every rank with %s must pass it, or none", r, P, flag_name[i],
                            given[i] ? "given" : "NULL", i == FLAG_DW ? "shard rows" : "tokens");
    for (int q = 0; q < P; q++) R->n[q] = xn[q];
    R->f.weights = xflag[2 * FLAG_WEIGHTS] > 0;
    R->f.entropy = xflag[2 * FLAG_ENTROPY] > 0;
    R->f.dh = xflag[2 * FLAG_DH] > 0;
    R->f.dW = xflag[2 * FLAG_DW] > 0;
    return FM_OK;
}

/* ---- one hop -------------------------------------------------------------------------------- */

/* send [send_bytes] to rank `to`; recv [recv_bytes] from rank `from` (ring neighbours). */
static fm_status hop(ring *R, const void *send, size_t send_bytes, int to, void *recv, size_t recv_bytes, int from) {
    for (int q = 0; q < R->P; q++) R->sc[q] = R->sd[q] = R->rc[q] = R->rd[q] = 0;
    R->sc[to] = (int64_t)send_bytes;
    R->rc[from] = (int64_t)recv_bytes;
    if (R->sync_before_hop) R->be->ops->stream_sync(R->be->ctx, FM_STREAM_COMPUTE); /* staged copies read it */
    FM_TRY(fm_comm_all_to_all_v(R->comm, send_bytes ? send : NULL, R->sc, R->sd, recv_bytes ? recv : NULL, R->rc,
                                R->rd, FM_COMM_BYTE, R->timeout));
    R->hops++;
    R->bytes_sent += send_bytes;
    return FM_OK;
}

static void dcopy(const ring *R, void *dst, const void *src, size_t bytes) {
    if (bytes) R->be->ops->copy_async(R->be->ctx, dst, src, bytes, FM_COPY_D2D, FM_STREAM_COMPUTE);
}

/* Token blocks of Nb0 over n tokens, as fm_linear_ce cuts them. */
#define FOR_TOKEN_BLOCKS(R, n, n0, nb) \
    for (int64_t n0 = 0, nb = 0; n0 < (n) && ((nb = min64((R)->Nb0, (n) - n0)) > 0); n0 += (R)->Nb0)

/* ---- ACTIVATIONS: the token blocks travel --------------------------------------------------- */

static fm_status run_activations(ring *R, const fm_lce_strip *st, uint8_t *buf[2], float *loss, fm_act *dh,
                                 fm_act *dW, const fm_act *h, const fm_act *W, const int32_t *targets,
                                 const fm_lce_opts *o, float grad_scale, double *sums) {
    const fm_backend *be = R->be;
    const int P = R->P, r = R->r, succ = mod(r + 1, P), pred = mod(r - 1, P);
    const int64_t H = R->H, off = first_of(R, r), rows = rows_of(R, r), Nr = R->n[r];
    uint8_t *cur = buf[0], *nxt = buf[1];
#define SWAP() do { uint8_t *t_ = cur; cur = nxt; nxt = t_; } while (0)
#define AT(T, L, part) ((T *)(void *)(cur + (L).part))

    /* pack this rank's block: targets, weights, h */
    const act_layout Lr = act_lay(Nr, H, R->a, R->f);
    dcopy(R, cur + Lr.tg, targets, (size_t)(Nr * 4));
    if (R->f.weights) dcopy(R, cur + Lr.w, o->token_weight, (size_t)(Nr * F32));
    dcopy(R, cur + Lr.h, h, (size_t)(Nr * H) * R->a);

    for (int k = 0; k < P; k++) { /* forward: block q meets shard r */
        const int q = mod(r - k, P);
        const act_layout L = act_lay(R->n[q], H, R->a, R->f);
        const bool first = !any_rows(R, q, 1, k); /* it met shards q .. q+k-1 = r-k .. r-1 */
        FOR_TOKEN_BLOCKS(R, R->n[q], n0, nb)
            fm_linear_ce_fold_range(be, st, AT(float, L, m) + n0, AT(float, L, z) + n0, AT(float, L, tgt) + n0,
                                    R->f.entropy ? AT(float, L, ent) + n0 : NULL, AT(fm_act, L, h) + n0 * H,
                                    AT(int32_t, L, tg) + n0, nb, W, off, rows, H, first);
        if (k == P - 1) break;
        const act_layout Lp = act_lay(R->n[mod(q - 1, P)], H, R->a, R->f);
        FM_TRY(hop(R, cur, L.fwd, succ, nxt, Lp.fwd, pred));
        SWAP();
    }
    if (R->f.dh || R->f.dW) {
        for (int k = 0; k < P; k++) { /* backward: block q meets shard r, on its way home */
            const int q = mod(r + 1 + k, P);
            const act_layout L = act_lay(R->n[q], H, R->a, R->f);
            const bool dh_first = !any_rows(R, q - 1, -1, k); /* it met shards q-1 .. q-k */
            FOR_TOKEN_BLOCKS(R, R->n[q], n0, nb) {
                const float *wb = R->f.weights ? AT(float, L, w) + n0 : NULL;
                fm_linear_ce_grad_range(be, st, AT(float, L, m) + n0, AT(float, L, z) + n0, AT(fm_act, L, h) + n0 * H,
                                        AT(int32_t, L, tg) + n0, wb, nb, W, off, rows, H, o->ignore_index,
                                        grad_scale, o->z_loss, R->f.dh ? AT(fm_act, L, dh) + n0 * H : NULL,
                                        dh_first, rows > 0 ? dW : NULL);
            }
            if (k == P - 1) break;
            const act_layout Ln = act_lay(R->n[mod(q + 1, P)], H, R->a, R->f);
            FM_TRY(hop(R, cur, L.bwd, pred, nxt, Ln.bwd, succ));
            SWAP();
        }
        if (R->f.dh && dh) dcopy(R, dh, cur + Lr.dh, (size_t)(Nr * H) * R->a);
    } else if (P > 1) { /* forward only: the finished state goes home (rank r holds block r+1) */
        const act_layout L = act_lay(R->n[succ], H, R->a, R->f);
        FM_TRY(hop(R, cur, L.state, succ, nxt, Lr.state, pred));
        SWAP();
    }
    FOR_TOKEN_BLOCKS(R, Nr, n0, nb)
        be->ops->lce_finalize(be->ctx, loss + n0, o->out_logprob ? o->out_logprob + n0 : NULL,
                              o->out_entropy ? o->out_entropy + n0 : NULL, sums, AT(float, Lr, m) + n0,
                              AT(float, Lr, z) + n0, AT(float, Lr, tgt) + n0,
                              R->f.entropy ? AT(float, Lr, ent) + n0 : NULL, targets + n0,
                              R->f.weights ? o->token_weight + n0 : NULL, nb, R->V, o->ignore_index);
#undef AT
#undef SWAP
    return FM_OK;
}

/* ---- WEIGHTS: the shards travel ------------------------------------------------------------- */

static fm_status run_weights(ring *R, const fm_lce_strip *st, uint8_t *buf[2], float *state[4], float *loss,
                             fm_act *dh, fm_act *dW, const fm_act *h, const fm_act *W, const int32_t *targets,
                             const fm_lce_opts *o, float grad_scale, double *sums) {
    const fm_backend *be = R->be;
    const int P = R->P, r = R->r, succ = mod(r + 1, P), pred = mod(r - 1, P);
    const int64_t H = R->H, Nr = R->n[r];
    float *m = state[0], *z = state[1], *tgt = state[2], *ent = state[3];
    const float *w = R->f.weights ? o->token_weight : NULL;
    uint8_t *cur = buf[0], *nxt = buf[1];

    for (int k = 0; k < P; k++) { /* forward: shard s meets block r */
        const int s = mod(r - k, P);
        const int64_t rows = rows_of(R, s);
        const fm_act *Ws = k == 0 ? W : (const fm_act *)(const void *)cur;
        const bool first = !any_rows(R, r, -1, k); /* block r met shards r .. r-k+1 */
        FOR_TOKEN_BLOCKS(R, Nr, n0, nb)
            fm_linear_ce_fold_range(be, st, m + n0, z + n0, tgt + n0, ent ? ent + n0 : NULL, h + n0 * H, targets + n0,
                                    nb, Ws, first_of(R, s), rows, H, first);
        if (k == P - 1) break;
        FM_TRY(hop(R, Ws, w_fwd(rows, H, R->a), succ, nxt, w_fwd(rows_of(R, mod(s - 1, P)), H, R->a), pred));
        uint8_t *t = cur;
        cur = nxt;
        nxt = t;
    }
    FOR_TOKEN_BLOCKS(R, Nr, n0, nb)
        be->ops->lce_finalize(be->ctx, loss + n0, o->out_logprob ? o->out_logprob + n0 : NULL,
                              o->out_entropy ? o->out_entropy + n0 : NULL, sums, m + n0, z + n0, tgt + n0,
                              ent ? ent + n0 : NULL, targets + n0, w ? w + n0 : NULL, nb, R->V, o->ignore_index);
    if (!(R->f.dh || R->f.dW)) return FM_OK;

    for (int k = 0; k < P; k++) { /* backward: shard s meets block r, on its way home */
        const int s = mod(r + 1 + k, P);
        const int64_t rows = rows_of(R, s);
        const bool home = k == P - 1; /* s == r */
        const fm_act *Ws = home ? W : (const fm_act *)(const void *)cur;
        fm_act *acc = NULL;
        if (R->f.dW) {
            fm_act *travelled = P > 1 ? (fm_act *)(void *)(cur + w_acc_off(rows, H, R->a)) : NULL;
            if (!home) {
                acc = travelled;
                if (k == 0 && rows > 0) be->ops->mem_set(be->ctx, acc, 0, (size_t)(rows * H) * R->a);
            } else if (rows > 0) {
                acc = dW; /* the caller's dW_shard: += the others' contributions, then this rank's */
                if (P > 1) be->ops->add(be->ctx, dW, travelled, rows * H);
            }
        }
        const bool dh_first = !any_rows(R, r + 1, 1, k); /* block r met shards r+1 .. r+k */
        FOR_TOKEN_BLOCKS(R, Nr, n0, nb)
            fm_linear_ce_grad_range(be, st, m + n0, z + n0, h + n0 * H, targets + n0, w ? w + n0 : NULL, nb, Ws,
                                    first_of(R, s), rows, H, o->ignore_index, grad_scale, o->z_loss,
                                    R->f.dh && dh ? dh + n0 * H : NULL, dh_first, acc);
        if (home) break;
        FM_TRY(hop(R, cur, w_bwd(rows, H, R->a, R->f), pred, nxt, w_bwd(rows_of(R, mod(s + 1, P)), H, R->a, R->f),
                   succ));
        uint8_t *t = cur;
        cur = nxt;
        nxt = t;
    }
    return FM_OK;
}

/* ---- the operator --------------------------------------------------------------------------- */

fm_status fm_linear_ce_ring(const fm_backend *be, const fm_comm *comm, fm_arena *ws, float *loss, fm_act *dh,
                            fm_act *dW_shard, const fm_act *h, const fm_act *W_shard, const int32_t *targets,
                            int64_t N, int64_t H, int64_t V, float grad_scale, const fm_lce_ring_opts *opts,
                            double *sums, fm_lce_ring_info *info) {
    FM_ASSERT(be && be->ops && comm && comm->ops && ws);
    const int P = fm_comm_size(comm), r = fm_comm_rank(comm);
    if (P > FM_LCE_RING_MAX_RANKS) /* the same on every rank: no exchange needed to agree */
        return fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring: at most %d ranks (FM_LCE_RING_MAX_RANKS), "
                        "found %d", r, P, FM_LCE_RING_MAX_RANKS, P);
    const fm_lce_ring_opts ro = opts ? *opts : fm_lce_ring_opts_default();
    const fm_lce_opts o = ro.lce;
    ring R; /* its host count arrays: 5 x FM_LCE_RING_MAX_RANKS int64 on the stack */
    memset(&R, 0, sizeof R);
    R.be = be, R.comm = comm, R.r = r, R.P = P, R.timeout = ro.timeout_s;
    R.V = V, R.H = H, R.a = sizeof(fm_act);
    R.Nb0 = blk(o.block_tokens, FM_LCE_DEFAULT_BLOCK_TOKENS);
    R.Vb0 = blk(o.block_vocab, FM_LCE_DEFAULT_BLOCK_VOCAB);
    const bool measure = fm_arena_is_measure(ws);

    /* this rank's arguments (reported to the group before anyone stops) */
    int64_t off = 0, rows = 0;
    if (V >= 1) fm_lce_ring_shard(V, P, r, &off, &rows);
    bool bad = true;
    if (N < 0) fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring: N = %lld tokens, expected >= 0", r, P, (long long)N);
    else if (H < 1 || V < 1)
        fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring: H = %lld, V = %lld; both must be >= 1", r, P, (long long)H,
                 (long long)V);
    else if (N > 0 && (!loss || !h || !targets))
        fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring: %s is NULL with N = %lld tokens", r, P,
                 !loss ? "loss" : !h ? "h" : "targets", (long long)N);
    else if (rows > 0 && !W_shard)
        fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring: W_shard is NULL; this rank's shard has %lld rows "
                 "[%lld, %lld) of V = %lld", r, P, (long long)rows, (long long)off, (long long)(off + rows), (long long)V);
    else if (!sums && !measure)
        fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring: sums is NULL (expected double [2] of backend memory)", r, P);
    else if (ro.mode != FM_LCE_RING_AUTO && ro.mode != FM_LCE_RING_ACTIVATIONS && ro.mode != FM_LCE_RING_WEIGHTS)
        fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring: mode %d is not auto (0), activations (1) or weights (2)",
                 r, P, (int)ro.mode);
    else if (!be->ops->host_memory && fm_comm_mem_is_host(comm))
        fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring: the communicator (%s) moves host memory but the "
                 "backend's (%s) is not: create the communicator over the backend", r, P, comm->ops->name,
                 be->ops->name);
    else bad = false;

    float zl = o.z_loss;
    uint32_t zbits;
    memcpy(&zbits, &zl, sizeof zbits);
    const int64_t cfg[CFG_COUNT] = {V, H, (int64_t)ro.mode, R.Nb0, R.Vb0, o.ignore_index, (int64_t)zbits};
    const bool given[FLAG_COUNT] = {o.token_weight != NULL, o.out_entropy != NULL, dh != NULL, dW_shard != NULL};
    const bool has_data[FLAG_COUNT] = {N > 0, N > 0, N > 0, rows > 0};
    FM_TRY(exchange(&R, comm, N, cfg, given, has_data, bad));

    int64_t n_max = 0, n_total = 0;
    for (int q = 0; q < P; q++) {
        n_max = R.n[q] > n_max ? R.n[q] : n_max;
        n_total += R.n[q];
    }
    R.S = shard_size(V, P);
    const fm_lce_ring_mode mode = ro.mode == FM_LCE_RING_AUTO ? fm_lce_ring_choose(n_max, V, P) : ro.mode;
    R.sync_before_hop = !be->ops->host_memory && strcmp(comm->ops->name, "nccl") != 0;

    /* scratch: the strip, then the ring buffers (and WEIGHTS: the own tokens' state) */
    const size_t entry = ws->used;
    fm_lce_strip st = {0};
    uint8_t *buf[2] = {NULL, NULL};
    float *state[4] = {NULL, NULL, NULL, NULL};
    if (n_max > 0) {
        st = fm_linear_ce_strip_alloc(ws, min64(R.Nb0, n_max), min64(R.Vb0, R.S), R.f.dh || R.f.dW);
        const act_layout Lmax = act_lay(n_max, H, R.a, R.f);
        const size_t cap = mode == FM_LCE_RING_ACTIVATIONS ? (R.f.dh ? Lmax.bwd : Lmax.fwd) : w_cap(R.S, H, R.a, R.f);
        for (int i = 0; i < ring_buffers(P, mode); i++) buf[i] = fm_arena_alloc(ws, cap);
        if (mode == FM_LCE_RING_WEIGHTS)
            for (int i = 0; i < 3 + R.f.entropy; i++) state[i] = fm_arena_alloc(ws, (size_t)(R.n[r] * F32));
    }
    const size_t taken = ws->used - entry;
    ws->used = entry;
    if (measure) return FM_OK;
    ws->used = entry + taken;

    be->ops->mem_set(be->ctx, sums, 0, 2 * sizeof(double));
    fm_status s = FM_OK;
    if (n_max > 0) {
        if (mode == FM_LCE_RING_ACTIVATIONS)
            s = run_activations(&R, &st, buf, loss, dh, dW_shard, h, W_shard, targets, &o, grad_scale, sums);
        else s = run_weights(&R, &st, buf, state, loss, dh, dW_shard, h, W_shard, targets, &o, grad_scale, sums);
    }
    ws->used = entry;
    FM_TRY(s);
    if (R.sync_before_hop) be->ops->stream_sync(be->ctx, FM_STREAM_COMPUTE);
    FM_TRY(fm_comm_all_reduce(comm, sums, sums, 2, FM_COMM_F64, FM_COMM_SUM, R.timeout));
    if (info) {
        info->mode = mode;
        info->n_total = n_total;
        info->n_max = n_max;
        info->shard_rows = R.S;
        info->hops = R.hops;
        info->bytes_sent = R.bytes_sent;
        info->ws_bytes = taken;
    }
    return FM_OK;
}

fm_status fm_linear_ce_ring_valid_count(const fm_comm *comm, const int32_t *targets_host, int64_t N,
                                        int32_t ignore_index, double timeout_s, int64_t *valid) {
    FM_ASSERT(comm && comm->ops);
    const int P = fm_comm_size(comm), r = fm_comm_rank(comm);
    if (!valid) return fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring_valid_count: valid is NULL", r, P);
    int64_t c[2] = {0, 0}; /* valid tokens, ranks with bad arguments */
    if (N < 0 || (N > 0 && !targets_host)) {
        c[1] = 1;
        fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring_valid_count: N = %lld with targets_host %s; expected "
                 "N >= 0 and host targets [N]", r, P, (long long)N, targets_host ? "given" : "NULL");
    } else
        for (int64_t i = 0; i < N; i++) c[0] += targets_host[i] != ignore_index;
    FM_TRY(fm_comm_allreduce_sum_i64(comm, c, 2, timeout_s));
    if (c[1] > 0) {
        if (N < 0 || (N > 0 && !targets_host)) return FM_ERR_ARG;
        return fm_error(FM_ERR_ARG, "rank %d of %d: linear_ce_ring_valid_count: %lld rank(s) were given bad "
                        "arguments (their own errors name them)", r, P, (long long)c[1]);
    }
    *valid = c[0];
    return FM_OK;
}
