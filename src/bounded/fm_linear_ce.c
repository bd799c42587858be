/* Linear cross-entropy with an online log-sum-exp (fm_linear_ce.h): the schedule, its bound, and
 * the plain twin. All arithmetic goes through the op table (gemm, lce_fold, lce_finalize,
 * lce_strip_grad), so any backend that fills those runs this file unchanged.
 *
 * Bound (DESIGN.md §2, "vocabulary projection"): with Nb = block_tokens, Vb = block_vocab,
 *
 *   bound = round(Nb * Vb * 4)        one fp32 strip S [Nb,Vb] (logits, then in place their grad)
 *         + 4 * round(Nb * 4)         per-token state m, z, tgt, ent [Nb] fp32
 *
 * bytes, round() = fm_arena_round (64-byte pieces, as fm_arena_alloc hands them out). It does
 * not depend on N or V: a run uses min(Nb, N) x min(Vb, V), which is never more; ent is taken
 * only when the entropy is asked for. fm_linear_ce_call_bytes_a is the same formula at those
 * clamped blocks, with ent only when asked for: what one call takes (the trainer's plan). The
 * plain twin takes
 *
 *   plain = 2 * round(N * V * 4) + 4 * round(N * 4)
 *
 * (N x V logits and their gradient, and the same state for all N tokens). Where fm_act is not
 * fp32 (the bf16 CUDA build), the fp32 gradient strip is converted to fm_act for its two GEMMs:
 * add round(Nb * Vb * sizeof(fm_act)) to the bound (round(N * V * sizeof(fm_act)) to the twin).
 * With the top-k outputs (fm_lce_opts.topk = k), the running top-k of a token block adds
 * 2 * round(Nb * k * 4) (fm_linear_ce_topk_bytes; the twin 2 * round(N * k * 4)).
 */
#include "fm_linear_ce.h"

static const int64_t FM_LCE_F32 = (int64_t)sizeof(float);

fm_lce_opts fm_lce_opts_default(void) {
    fm_lce_opts o = {0};
    o.block_tokens = FM_LCE_DEFAULT_BLOCK_TOKENS;
    o.block_vocab = FM_LCE_DEFAULT_BLOCK_VOCAB;
    o.ignore_index = -100;
    return o;
}

static int64_t lce_block(int64_t asked, int64_t dflt) { return asked > 0 ? asked : dflt; }

/* Bytes of the act-typed copy of a gradient strip of n elements (none when it is fp32). */
static size_t act_copy_bytes_a(int64_t n, size_t a) {
    return a == sizeof(float) ? 0 : fm_arena_round((size_t)n * a);
}
static size_t act_copy_bytes(int64_t n) { return act_copy_bytes_a(n, sizeof(fm_act)); }

/* The gradient strip as the GEMMs' fm_act operand: itself when fm_act is fp32, else converted
 * into `copy`. */
static const fm_act *act_view(const fm_ops *ops, void *ctx, const float *g, fm_act *copy, int64_t n) {
    if (sizeof(fm_act) == sizeof(float)) return (const fm_act *)(const void *)g;
    ops->convert(ctx, copy, FM_ACT_DTYPE, g, FM_DTYPE_F32, n);
    return copy;
}

/* The bound formula above; the planner and the schedule below share it. */
size_t fm_linear_ce_bound_bytes_a(int64_t block_tokens, int64_t block_vocab, size_t act_bytes) {
    const int64_t nb = lce_block(block_tokens, FM_LCE_DEFAULT_BLOCK_TOKENS);
    const int64_t vb = lce_block(block_vocab, FM_LCE_DEFAULT_BLOCK_VOCAB);
    return fm_arena_round((size_t)(nb * vb * FM_LCE_F32)) + act_copy_bytes_a(nb * vb, act_bytes) +
           4 * fm_arena_round((size_t)(nb * FM_LCE_F32));
}

size_t fm_linear_ce_call_bytes_a(int64_t block_tokens, int64_t block_vocab, int64_t N, int64_t V, bool want_entropy,
                                 size_t act_bytes) {
    FM_ASSERT(N >= 0 && V >= 1);
    int64_t nb = lce_block(block_tokens, FM_LCE_DEFAULT_BLOCK_TOKENS);
    int64_t vb = lce_block(block_vocab, FM_LCE_DEFAULT_BLOCK_VOCAB);
    if (nb > N) nb = N; /* as fm_linear_ce clamps them */
    if (vb > V) vb = V;
    return fm_arena_round((size_t)(nb * vb * FM_LCE_F32)) + act_copy_bytes_a(nb * vb, act_bytes) +
           (want_entropy ? 4 : 3) * fm_arena_round((size_t)(nb * FM_LCE_F32));
}

size_t fm_linear_ce_topk_bytes(int64_t block_tokens, int64_t N, int64_t k) {
    FM_ASSERT(N >= 0);
    if (k <= 0) return 0;
    int64_t nb = lce_block(block_tokens, FM_LCE_DEFAULT_BLOCK_TOKENS);
    if (nb > N) nb = N;
    return 2 * fm_arena_round((size_t)(nb * k * FM_LCE_F32));
}

size_t fm_linear_ce_strip_bytes_a(int64_t nb, int64_t vb, size_t act_bytes) {
    FM_ASSERT(nb >= 0 && vb >= 0);
    return fm_arena_round((size_t)(nb * vb * FM_LCE_F32)) + act_copy_bytes_a(nb * vb, act_bytes);
}

size_t fm_linear_ce_bound_bytes(int64_t block_tokens, int64_t block_vocab) {
    return fm_linear_ce_bound_bytes_a(block_tokens, block_vocab, sizeof(fm_act));
}

size_t fm_linear_ce_plain_bytes(int64_t N, int64_t V) {
    FM_ASSERT(N >= 0 && V >= 0);
    return 2 * fm_arena_round((size_t)(N * V * FM_LCE_F32)) + act_copy_bytes(N * V) +
           4 * fm_arena_round((size_t)(N * FM_LCE_F32));
}

/* Per-token state of one token block, taken from the arena. */
typedef struct lce_state {
    float *m, *z, *tgt, *ent;
} lce_state;

static lce_state lce_state_alloc(fm_arena *ws, int64_t nb, bool want_entropy) {
    lce_state s;
    const size_t b = (size_t)(nb * FM_LCE_F32);
    s.m = fm_arena_alloc(ws, b);
    s.z = fm_arena_alloc(ws, b);
    s.tgt = fm_arena_alloc(ws, b);
    s.ent = want_entropy ? fm_arena_alloc(ws, b) : NULL;
    return s;
}

static void lce_check_args(const fm_backend *be, fm_arena *ws, const float *loss, const fm_act *h,
                           const fm_act *W, const int32_t *targets, int64_t N, int64_t H,
                           int64_t V) {
    FM_ASSERT(be && be->ops && ws && loss && h && W && targets);
    FM_ASSERT(N >= 0 && H >= 0 && V >= 1);
    FM_ASSERT(be->ops->gemm && be->ops->lce_fold && be->ops->lce_finalize &&
              be->ops->lce_strip_grad);
}

fm_lce_strip fm_linear_ce_strip_alloc(fm_arena *ws, int64_t nb, int64_t vb, bool backward) {
    fm_lce_strip st;
    st.nb = nb;
    st.vb = vb;
    st.S = fm_arena_alloc(ws, (size_t)(nb * vb * FM_LCE_F32));
    st.Sa = sizeof(fm_act) == sizeof(float) || !backward ? NULL : fm_arena_alloc(ws, act_copy_bytes(nb * vb));
    return st;
}

/* The running top-k of a token block (fm_lce_opts.topk): topv [nb,k] fp32, topi [nb,k] int32. */
typedef struct lce_topk {
    float *v;
    int32_t *i;
    int64_t k;
} lce_topk;

static lce_topk lce_topk_alloc(fm_arena *ws, int64_t nb, const fm_lce_opts *o) {
    lce_topk t = {NULL, NULL, 0};
    if (o->topk <= 0 || !o->out_topk_logprob || !o->out_topk_id) return t;
    t.k = o->topk;
    t.v = fm_arena_alloc(ws, (size_t)(nb * t.k * FM_LCE_F32));
    t.i = fm_arena_alloc(ws, (size_t)(nb * t.k) * sizeof(int32_t));
    return t;
}

/* fm_linear_ce_fold_range, and each strip folded into the running top-k when tk->k > 0. */
static void fold_range_topk(const fm_backend *be, const fm_lce_strip *st, float *m, float *z, float *tgt, float *ent,
                            const lce_topk *tk, const fm_act *hb, const int32_t *tb, int64_t nb, const fm_act *W,
                            int64_t v_begin, int64_t v_count, int64_t H, bool first) {
    const fm_ops *ops = be->ops;
    void *ctx = be->ctx;
    FM_ASSERT(nb <= st->nb);
    for (int64_t v = 0; v < v_count; v += st->vb) {
        const int64_t vb = v_count - v < st->vb ? v_count - v : st->vb;
        ops->gemm(ctx, false, true, nb, vb, H, 1.0f, hb, H, W + v * H, H, 0.0f, st->S, FM_DTYPE_F32, vb);
        ops->lce_fold(ctx, m, z, tgt, ent, st->S, tb, nb, vb, v_begin + v, first && v == 0);
        if (tk && tk->k > 0) ops->lce_topk_fold(ctx, tk->v, tk->i, st->S, nb, vb, v_begin + v, tk->k, first && v == 0);
    }
}

void fm_linear_ce_fold_range(const fm_backend *be, const fm_lce_strip *st, float *m, float *z, float *tgt,
                             float *ent, const fm_act *hb, const int32_t *tb, int64_t nb, const fm_act *W,
                             int64_t v_begin, int64_t v_count, int64_t H, bool first) {
    fold_range_topk(be, st, m, z, tgt, ent, NULL, hb, tb, nb, W, v_begin, v_count, H, first);
}

/* fm_linear_ce_grad_range, with the entropy term's gradient when ent_w (and ent, [nb]) is set. */
static void grad_range_ent(const fm_backend *be, const fm_lce_strip *st, const float *m, const float *z,
                           const fm_act *hb, const int32_t *tb, const float *wb, const float *ent_w, const float *ent,
                           int64_t nb, const fm_act *W, int64_t v_begin, int64_t v_count, int64_t H,
                           int32_t ignore_index, float grad_scale, float z_loss, fm_act *dh, bool dh_first,
                           fm_act *dW) {
    const fm_ops *ops = be->ops;
    void *ctx = be->ctx;
    FM_ASSERT(nb <= st->nb);
    for (int64_t v = 0; v < v_count; v += st->vb) {
        const int64_t vb = v_count - v < st->vb ? v_count - v : st->vb;
        const fm_act *Wb = W + v * H;
        float *S = st->S;
        ops->gemm(ctx, false, true, nb, vb, H, 1.0f, hb, H, Wb, H, 0.0f, S, FM_DTYPE_F32, vb);
        if (ent_w)
            ops->lce_strip_grad_ent(ctx, S, S, m, z, tb, wb, ent_w, ent, nb, vb, v_begin + v, ignore_index, grad_scale,
                                    z_loss);
        else
            ops->lce_strip_grad(ctx, S, S, m, z, tb, wb, nb, vb, v_begin + v, ignore_index, grad_scale, z_loss);
        const fm_act *G = act_view(ops, ctx, S, st->Sa, nb * vb);
        if (dh) /* dh_blk (=, then +=) G [nb,vb] W_blk [vb,H] */
            ops->gemm(ctx, false, false, nb, H, vb, 1.0f, G, vb, Wb, H, dh_first && v == 0 ? 0.0f : 1.0f, dh,
                      FM_ACT_DTYPE, H);
        if (dW) /* dW_blk [vb,H] += G^T h_blk */
            ops->gemm(ctx, true, false, vb, H, nb, 1.0f, G, vb, hb, H, 1.0f, dW + v * H, FM_ACT_DTYPE, H);
    }
}

void fm_linear_ce_grad_range(const fm_backend *be, const fm_lce_strip *st, const float *m, const float *z,
                             const fm_act *hb, const int32_t *tb, const float *wb, int64_t nb, const fm_act *W,
                             int64_t v_begin, int64_t v_count, int64_t H, int32_t ignore_index, float grad_scale,
                             float z_loss, fm_act *dh, bool dh_first, fm_act *dW) {
    grad_range_ent(be, st, m, z, hb, tb, wb, NULL, NULL, nb, W, v_begin, v_count, H, ignore_index, grad_scale, z_loss,
                   dh, dh_first, dW);
}

void fm_linear_ce(const fm_backend *be, fm_arena *ws, float *loss, fm_act *dh, fm_act *dW,
                  const fm_act *h, const fm_act *W, const int32_t *targets, int64_t N, int64_t H,
                  int64_t V, float grad_scale, const fm_lce_opts *opts, double *sums) {
    lce_check_args(be, ws, loss, h, W, targets, N, H, V);
    FM_ASSERT(sums || fm_arena_is_measure(ws));
    const fm_lce_opts o = opts ? *opts : fm_lce_opts_default();
    const fm_ops *ops = be->ops;
    void *ctx = be->ctx;
    if (!fm_arena_is_measure(ws)) ops->mem_set(ctx, sums, 0, 2 * sizeof(double));
    if (N == 0) return;

    const int64_t Nb0 = lce_block(o.block_tokens, FM_LCE_DEFAULT_BLOCK_TOKENS);
    const int64_t Vb0 = lce_block(o.block_vocab, FM_LCE_DEFAULT_BLOCK_VOCAB);
    const int64_t Nb = Nb0 < N ? Nb0 : N, Vb = Vb0 < V ? Vb0 : V;
    const bool backward = dh || dW;

    const size_t entry = ws->used;
    const fm_lce_strip strip = fm_linear_ce_strip_alloc(ws, Nb, Vb, backward);
    const lce_state st = lce_state_alloc(ws, Nb, o.out_entropy != NULL);
    const lce_topk tk = lce_topk_alloc(ws, Nb, &o);
    if (fm_arena_is_measure(ws)) {
        ws->used = entry;
        return;
    }
    FM_ASSERT(tk.k == 0 || (ops->lce_topk_fold && ops->lce_topk_finalize));
    FM_ASSERT(!o.ent_weight || (o.ent_value && ops->lce_strip_grad_ent));

    for (int64_t n0 = 0; n0 < N; n0 += Nb) {
        const int64_t nb = N - n0 < Nb ? N - n0 : Nb;
        const fm_act *hb = h + n0 * H;
        const int32_t *tb = targets + n0;
        const float *wb = o.token_weight ? o.token_weight + n0 : NULL;

        /* pass 1: fold every vocabulary block into m, z, tgt (and ent) */
        fold_range_topk(be, &strip, st.m, st.z, st.tgt, st.ent, &tk, hb, tb, nb, W, 0, V, H, true);
        ops->lce_finalize(ctx, loss + n0, o.out_logprob ? o.out_logprob + n0 : NULL,
                          o.out_entropy ? o.out_entropy + n0 : NULL, sums, st.m, st.z, st.tgt, st.ent, tb, wb,
                          nb, V, o.ignore_index);
        if (tk.k > 0)
            ops->lce_topk_finalize(ctx, o.out_topk_logprob + n0 * tk.k, o.out_topk_id + n0 * tk.k, tk.v, tk.i, st.m,
                                   st.z, nb, tk.k);
        if (!backward) continue;

        /* pass 2: recompute each strip, turn it into G in place, contract into dh and dW */
        grad_range_ent(be, &strip, st.m, st.z, hb, tb, wb, o.ent_weight ? o.ent_weight + n0 : NULL,
                       o.ent_weight ? o.ent_value + n0 : NULL, nb, W, 0, V, H, o.ignore_index, grad_scale, o.z_loss,
                       dh ? dh + n0 * H : NULL, true, dW);
    }
    ws->used = entry;
}

void fm_linear_ce_plain(const fm_backend *be, fm_arena *ws, float *loss, fm_act *dh, fm_act *dW,
                        const fm_act *h, const fm_act *W, const int32_t *targets, int64_t N,
                        int64_t H, int64_t V, float grad_scale, const fm_lce_opts *opts,
                        double *sums) {
    lce_check_args(be, ws, loss, h, W, targets, N, H, V);
    FM_ASSERT(sums || fm_arena_is_measure(ws));
    const fm_lce_opts o = opts ? *opts : fm_lce_opts_default();
    const fm_ops *ops = be->ops;
    void *ctx = be->ctx;
    if (!fm_arena_is_measure(ws)) ops->mem_set(ctx, sums, 0, 2 * sizeof(double));
    if (N == 0) return;

    const size_t entry = ws->used;
    float *logits = fm_arena_alloc(ws, (size_t)(N * V * FM_LCE_F32));
    float *dlogits = fm_arena_alloc(ws, (size_t)(N * V * FM_LCE_F32));
    fm_act *da = sizeof(fm_act) == sizeof(float) ? NULL : fm_arena_alloc(ws, act_copy_bytes(N * V));
    const lce_state st = lce_state_alloc(ws, N, o.out_entropy != NULL);
    const lce_topk tk = lce_topk_alloc(ws, N, &o);
    if (fm_arena_is_measure(ws)) {
        ws->used = entry;
        return;
    }

    ops->gemm(ctx, false, true, N, V, H, 1.0f, h, H, W, H, 0.0f, logits, FM_DTYPE_F32, V);
    ops->lce_fold(ctx, st.m, st.z, st.tgt, st.ent, logits, targets, N, V, 0, true);
    ops->lce_finalize(ctx, loss, o.out_logprob, o.out_entropy, sums, st.m, st.z, st.tgt, st.ent, targets,
                      o.token_weight, N, V, o.ignore_index);
    if (tk.k > 0) {
        ops->lce_topk_fold(ctx, tk.v, tk.i, logits, N, V, 0, tk.k, true);
        ops->lce_topk_finalize(ctx, o.out_topk_logprob, o.out_topk_id, tk.v, tk.i, st.m, st.z, N, tk.k);
    }
    if (dh || dW) {
        if (o.ent_weight)
            ops->lce_strip_grad_ent(ctx, dlogits, logits, st.m, st.z, targets, o.token_weight, o.ent_weight,
                                    o.ent_value, N, V, 0, o.ignore_index, grad_scale, o.z_loss);
        else
            ops->lce_strip_grad(ctx, dlogits, logits, st.m, st.z, targets, o.token_weight, N, V, 0,
                                o.ignore_index, grad_scale, o.z_loss);
        const fm_act *G = act_view(ops, ctx, dlogits, da, N * V);
        if (dh) ops->gemm(ctx, false, false, N, H, V, 1.0f, G, V, W, H, 0.0f, dh, FM_ACT_DTYPE, H);
        if (dW) ops->gemm(ctx, true, false, V, H, N, 1.0f, G, V, h, H, 1.0f, dW, FM_ACT_DTYPE, H);
    }
    ws->used = entry;
}

double fm_linear_ce_read(const fm_backend *be, const double *sums, float z_loss, double *z_term) {
    double h[2];
    be->ops->stream_sync(be->ctx, FM_STREAM_COMPUTE); /* sync point: the operator's sums */
    be->ops->copy(be->ctx, h, sums, sizeof h, FM_COPY_D2H);
    if (z_term) *z_term = (double)z_loss * h[1];
    return h[0];
}
