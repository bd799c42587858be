/* ZeRO-3 over the world's dp x sp ranks: shard arithmetic, the schedule hook's gathers and reduce-scatters, the shard's
 * update and the checkpoints' full tensors (fm_zero3.h). */
#include "fm_zero3.h"

#include <stdio.h>
#include <string.h>

static const fm_comm_dtype act_dtype = sizeof(fm_act) == sizeof(float) ? FM_COMM_F32 : FM_COMM_BF16;

int64_t fm_zero3_piece_len(int64_t n, int W) {
    const int64_t s = (n + W - 1) / W;
    return (s + FM_SHARD_ALIGN - 1) / FM_SHARD_ALIGN * FM_SHARD_ALIGN;
}

void fm_zero3_free(fm_zero3 *z) {
    fm_free(z->begin);
    memset(z, 0, sizeof *z);
}

fm_status fm_zero3_layout(fm_zero3 *z, const int64_t *begin, int n_groups, bool tied, int rank, int W) {
    return fm_zero3_layout_keep(z, begin, NULL, n_groups, tied, rank, W, false);
}

fm_status fm_zero3_layout_keep(fm_zero3 *z, const int64_t *begin, const int64_t *keep, int n_groups, bool tied, int rank,
                               int W, bool whole_sq) {
    memset(z, 0, sizeof *z);
    if (W < 1 || rank < 0 || rank >= W || n_groups < 2)
        return fm_error(FM_ERR_ARG, "ZeRO-3 layout: rank %d of %d ranks over %d parameter groups; expected 0 <= rank < "
                        "ranks and at least 2 groups", rank, W, n_groups);
    for (int g = 0; g < n_groups; g++) {
        if (begin[g + 1] < begin[g] || begin[0] != 0)
            return fm_error(FM_ERR_ARG, "ZeRO-3 layout: parameter group %d starts at %lld and ends at %lld; the groups "
                            "must tile the flat parameters from 0 in order", g, (long long)begin[g],
                            (long long)begin[g + 1]);
        const int64_t k = keep ? keep[g] : 0;
        if (k < 0 || k > begin[g + 1] - begin[g] || (k > 0 && (g == 0 || g == n_groups - 1)))
            return fm_error(FM_ERR_ARG, "ZeRO-3 layout: group %d of %lld elements keeps %lld whole; expected 0 to its "
                            "size, and 0 for the embedding and head groups", g, (long long)(begin[g + 1] - begin[g]),
                            (long long)k);
    }
    z->begin = fm_malloc(sizeof(int64_t) * (size_t)(5 * n_groups + 1));
    if (!z->begin) return fm_error(FM_ERR_NOMEM, "memory: ZeRO-3's table of %d parameter groups", n_groups);
    z->piece = z->begin + n_groups + 1;
    z->local = z->piece + n_groups;
    z->keep = z->local + n_groups;
    z->wlocal = z->keep + n_groups;
    memcpy(z->begin, begin, sizeof(int64_t) * (size_t)(n_groups + 1));
    z->W = W;
    z->rank = rank;
    z->n_groups = n_groups;
    z->L = n_groups - 2;
    z->tied = tied;
    z->whole_sq = whole_sq;
    z->n_params = begin[n_groups];
    int64_t o = 0, mx = 0;
    for (int g = 0; g < n_groups; g++) {
        z->keep[g] = keep ? keep[g] : 0;
        z->piece[g] = fm_zero3_piece_len(begin[g + 1] - begin[g] - z->keep[g], W);
        z->local[g] = o;
        o += z->piece[g];
        if (z->piece[g] > mx) mx = z->piece[g];
    }
    z->piece_total = o;
    for (int g = 0; g < n_groups; g++) { /* the whole parts after the pieces */
        z->wlocal[g] = o;
        o += z->keep[g];
    }
    z->shard_len = o;
    z->slot_len = (int64_t)W * mx;
    const int64_t head_both = (int64_t)W * (z->piece[0] + z->piece[n_groups - 1]);
    z->gbuf_len = tied && head_both > z->slot_len ? head_both : z->slot_len;
    z->slot_group[0] = z->slot_group[1] = -1;
    return FM_OK;
}

fm_status fm_zero3_layout_params(fm_zero3 *z, const fm_model_params *pp, int rank, int W) {
    const int ng = (int)pp->cfg.num_hidden_layers + 2;
    int64_t *b = fm_malloc(sizeof(int64_t) * (size_t)(2 * ng + 1));
    if (!b) return fm_error(FM_ERR_NOMEM, "memory: ZeRO-3's table of %d parameter groups", ng);
    int64_t *keep = b + ng + 1;
    for (int g = 0; g <= ng; g++) b[g] = fm_params_group_begin(pp, g);
    for (int g = 0; g < ng; g++) keep[g] = 0;
    if (pp->ep > 1) /* expert parallelism: each layer's E/ep experts [w_gate, end) stay whole */
        for (int g = 1; g + 1 < ng; g++) {
            int64_t gate, up, down;
            fm_params_layer_expert_offsets(pp, g - 1, &gate, &up, &down);
            keep[g] = gate >= 0 ? b[g + 1] - gate : 0; /* a dense layer: sharded whole */
        }
    const fm_status s = fm_zero3_layout_keep(z, b, keep, ng, pp->o_head == pp->o_embed, rank, W, rank < pp->ep);
    fm_free(b);
    return s;
}

/* The groups' sizes from a config (the table's, model/fm_params.c: the embedding V H; the layers
 * all alike; the final norm H and the untied head V H). */
/* The groups' sizes: the embedding n0, the head group nh, an MoE layer's nl (every expert) and
 * a dense layer's nd (its SwiGLU MLP; 0 when every layer is MoE). Layer l's group is
 * a + (MoE: E H + 3 E H I; dense: 3 H Id), a the attention and the two norms. */
static void group_sizes(const fm_config *c, int64_t *n0, int64_t *nl, int64_t *nh, int64_t *nd) {
    const int64_t n = fm_config_num_params(c), H = c->hidden_size, VH = c->vocab_size * H, L = c->num_hidden_layers;
    const int64_t Lm = fm_config_num_moe_layers(c), E = c->num_experts;
    const int64_t moe = E * H + 3 * E * H * c->moe_intermediate_size + fm_config_moe_extra_params(c), dense = 3 * H * c->dense_intermediate_size;
    *n0 = VH;
    *nh = H + (c->tie_word_embeddings ? 0 : VH);
    const int64_t a = L > 0 ? (n - *n0 - *nh - Lm * moe - (L - Lm) * dense) / L : 0;
    *nl = a + moe;
    *nd = Lm < L ? a + dense : 0;
}

/* Bytes of the store's walk (fm_param_store_create_zero3) for shard S, slot and gradient buffer. */
static size_t store_bytes(int64_t S, int64_t slot, int64_t gbuf, size_t a) {
    size_t b = 2 * fm_arena_round((size_t)S * a) + 2 * fm_arena_round((size_t)slot * a) + fm_arena_round((size_t)gbuf * a);
    if (a != sizeof(float)) b += fm_arena_round((size_t)S * sizeof(float));
    return b;
}

size_t fm_zero3_store_bytes(const fm_zero3 *z, size_t a) { return store_bytes(z->shard_len, z->slot_len, z->gbuf_len, a); }

size_t fm_zero3_state_bytes_ep(const fm_config *c, size_t a, int W, int ep, bool bf16_moments, char desc[200]) {
    int64_t n0, nl, nh, nd;
    group_sizes(c, &n0, &nl, &nh, &nd);
    const int64_t L = c->num_hidden_layers, Lm = fm_config_num_moe_layers(c);
    /* --ep: the MoE layers' groups are fm_model_create_ep's (E/ep experts each), the experts kept
     * whole; a dense layer's group is sharded whole */
    const int64_t H = c->hidden_size, I = c->moe_intermediate_size;
    const int64_t per_expert = 3 * H * I + (c->expert_bias ? 2 * I + H : 0); /* gpt_oss: + the experts' biases */
    const int64_t span = ep > 1 ? (c->num_experts / ep) * per_expert : 0;
    if (ep > 1) nl -= c->num_experts * per_expert;
    const int64_t p0 = fm_zero3_piece_len(n0, W), pl = fm_zero3_piece_len(nl, W), ph = fm_zero3_piece_len(nh, W);
    const int64_t pd = Lm < L ? fm_zero3_piece_len(nd, W) : 0;
    const int64_t S = p0 + Lm * pl + (L - Lm) * pd + ph + Lm * span;
    int64_t mx = p0 > ph ? p0 : ph;
    if (Lm > 0 && pl > mx) mx = pl;
    if (pd > mx) mx = pd;
    const int64_t slot = (int64_t)W * mx, both = (int64_t)W * (p0 + ph);
    const int64_t gbuf = c->tie_word_embeddings && both > slot ? both : slot;
    if (desc && ep > 1)
        snprintf(desc, 200, "ZeRO-3 over %d, experts / ep = %d whole: %d B/param x (%lld shard + %lld experts) + %d B x "
                 "(2 x %lld + %lld) (2 gathered groups, 1 group's grads)", W, ep, 8 + (bf16_moments ? 4 : 8),
                 (long long)(S - Lm * span), (long long)(Lm * span), (int)a, (long long)slot, (long long)gbuf);
    else if (desc)
        snprintf(desc, 200, "ZeRO-3 over %d: %d B/param x %lld params (shard) + %d B x (2 x %lld + %lld) (2 gathered "
                 "groups, 1 group's grads)", W, 8 + (bf16_moments ? 4 : 8), (long long)S, (int)a, (long long)slot,
                 (long long)gbuf);
    return store_bytes(S, slot, gbuf, a) + fm_adamw_state_bytes(S, bf16_moments);
}

size_t fm_zero3_state_bytes(const fm_config *c, size_t a, int W, bool bf16_moments, char desc[200]) {
    return fm_zero3_state_bytes_ep(c, a, W, 1, bf16_moments, desc);
}

size_t fm_zero3_ep_model_state_bound(const fm_config *cfg, const fm_state_layout *lay, size_t a, bool bf16_moments,
                                     char desc[200]) {
    return fm_zero3_state_bytes_ep(cfg, a, lay->ranks > 1 ? lay->ranks : 1, lay->ep > 1 ? lay->ep : 1, bf16_moments,
                                   desc);
}

/* ---- host packing ---- */

/* Rank q's valid elements of group g's sharded part: flat [begin + q p, begin + q p + *n). */
static int64_t valid(const fm_zero3 *z, int g, int q, int64_t *first) {
    const int64_t n = z->begin[g + 1] - z->begin[g] - z->keep[g], a = (int64_t)q * z->piece[g];
    *first = z->begin[g] + a;
    const int64_t v = n - a;
    return v < 0 ? 0 : v > z->piece[g] ? z->piece[g] : v;
}

void fm_zero3_pack(const fm_zero3 *z, int q, const void *full, void *local, size_t es) {
    memset(local, 0, (size_t)z->shard_len * es);
    for (int g = 0; g < z->n_groups; g++) {
        int64_t f;
        const int64_t v = valid(z, g, q, &f);
        if (v > 0) memcpy((char *)local + (size_t)z->local[g] * es, (const char *)full + (size_t)f * es, (size_t)v * es);
        if (z->keep[g] > 0) /* the whole part: this rank's own */
            memcpy((char *)local + (size_t)z->wlocal[g] * es, (const char *)full + (size_t)(z->begin[g + 1] - z->keep[g]) * es,
                   (size_t)z->keep[g] * es);
    }
}

void fm_zero3_unpack(const fm_zero3 *z, int q, const void *local, void *full, size_t es) {
    for (int g = 0; g < z->n_groups; g++) {
        int64_t f;
        const int64_t v = valid(z, g, q, &f);
        if (v > 0) memcpy((char *)full + (size_t)f * es, (const char *)local + (size_t)z->local[g] * es, (size_t)v * es);
        if (z->keep[g] > 0 && q == z->rank) /* the whole part: this rank's own */
            memcpy((char *)full + (size_t)(z->begin[g + 1] - z->keep[g]) * es, (const char *)local + (size_t)z->wlocal[g] * es,
                   (size_t)z->keep[g] * es);
    }
}

void fm_zero3_owner(const fm_zero3 *z, int64_t p, int *rank, int64_t *local) {
    int g = 0;
    while (g + 1 < z->n_groups && z->begin[g + 1] <= p) g++;
    const int64_t i = p - z->begin[g];
    *rank = (int)(i / z->piece[g]);
    *local = z->local[g] + i % z->piece[g];
}

/* ---- the schedule hook ---- */

/* Group g's whole part (a layer's experts, fm_model_create_ep's [w_gate, end): their weights and,
 * gpt_oss, their biases) in the model's views: weights (when w) and gradients (when gr) at the
 * shard's whole part. */
static void bind_whole(fm_zero3 *z, fm_model *m, int g, bool w, bool gr) {
    if (z->keep[g] == 0) return;
    int64_t gate, up, down;
    fm_params_layer_expert_offsets(&m->p, g - 1, &gate, &up, &down);
    FM_ASSERT(gate == z->begin[g + 1] - z->keep[g]);
    fm_layer_ptrs *y[2] = {w ? &m->p.w.layers[g - 1] : NULL, gr ? &m->p.g.layers[g - 1] : NULL};
    int64_t bg, bu, bd; /* gpt_oss: the experts' biases, stacked after w_down in the whole part (-1: none) */
    fm_params_layer_expert_bias_offsets(&m->p, g - 1, &bg, &bu, &bd);
    fm_act *base[2] = {z->weights + z->wlocal[g], z->grads + z->wlocal[g]};
    for (int i = 0; i < 2; i++)
        if (y[i]) {
            y[i]->w_gate = base[i];
            y[i]->w_up = base[i] + (up - gate);
            y[i]->w_down = base[i] + (down - gate);
            if (bg >= 0) {
                y[i]->eb_gate = base[i] + (bg - gate);
                y[i]->eb_up = base[i] + (bu - gate);
                y[i]->eb_down = base[i] + (bd - gate);
            }
        }
}

void fm_zero3_bind(fm_zero3 *z, fm_model *m, const fm_param_store *ps, const fm_comm *dp) {
    FM_ASSERT(ps->zero3 && ps->shard_len == z->shard_len && ps->slot_len == z->slot_len && ps->gbuf_len == z->gbuf_len);
    z->weights = ps->weights;
    z->grads = ps->grads;
    z->master = ps->master;
    z->slot[0] = ps->slot[0];
    z->slot[1] = ps->slot[1];
    z->gbuf = ps->gbuf;
    FM_ASSERT(z->slot[1] == z->slot[0] + z->slot_len); /* one buffer for the checkpoints' fp32 gathers */
    z->dp = dp;
    m->p.params = ps->weights;
    m->p.grads = ps->grads;
    m->p.master = ps->master;
    z->edp = NULL;
    for (int g = 1; g + 1 < z->n_groups; g++) bind_whole(z, m, g, true, true);
    fm_zero3_invalidate(z);
}

void fm_zero3_set_edp(fm_zero3 *z, const fm_comm *edp) { z->edp = edp && fm_comm_size(edp) > 1 ? edp : NULL; }

void fm_zero3_invalidate(fm_zero3 *z) { z->slot_group[0] = z->slot_group[1] = -1; }

/* Group g's full weights in a slot (gathered unless a slot holds them; the least recently used
 * slot other than the one holding `keep` is overwritten) and the model's views pointed there. */
static fm_status ensure(fm_zero3 *z, fm_model *m, int g, int keep) {
    int s = z->slot_group[0] == g ? 0 : z->slot_group[1] == g ? 1 : -1;
    if (s < 0) {
        if (z->slot_group[0] == keep && keep >= 0) s = 1;
        else if (z->slot_group[1] == keep && keep >= 0) s = 0;
        else s = z->slot_used[0] <= z->slot_used[1] ? 0 : 1;
        z->slot_group[s] = -1; /* a failed gather leaves the slot empty */
        FM_TRY(fm_comm_all_gather(z->dp, z->weights + z->local[g], z->slot[s], z->piece[g], act_dtype, 0));
        z->slot_group[s] = g;
        z->gathers++;
    }
    z->slot_used[s] = ++z->clock;
    fm_params_bind_group(&m->p, g, z->slot[s], NULL);
    bind_whole(z, m, g, true, false);
    return FM_OK;
}

/* The gradient buffer at element off for group g: zeroed (padding included) and the model's
 * gradient views pointed there. */
static void grads_at(fm_zero3 *z, fm_model *m, int g, int64_t off) {
    FM_ASSERT(off + (int64_t)z->W * z->piece[g] <= z->gbuf_len);
    m->be.ops->mem_set(m->be.ctx, z->gbuf + off, 0, sizeof(fm_act) * (size_t)z->W * (size_t)z->piece[g]);
    fm_params_bind_group(&m->p, g, NULL, z->gbuf + off);
    bind_whole(z, m, g, false, true); /* the experts' gradients accumulate whole, over the micro-batches */
}

/* Group g's full gradients at gbuf + off reduce-scattered (in place: block r is this rank's)
 * and added into piece g of the shard's gradients. */
static fm_status reduce(fm_zero3 *z, fm_model *m, int g, int64_t off) {
    fm_act *full = z->gbuf + off, *mine = full + (size_t)z->rank * (size_t)z->piece[g];
    FM_TRY(fm_comm_reduce_scatter(z->dp, full, mine, z->piece[g], act_dtype, FM_COMM_SUM, 0));
    m->be.ops->add(m->be.ctx, z->grads + z->local[g], mine, z->piece[g]);
    z->reduce_scatters++;
    return FM_OK;
}

fm_status fm_zero3_hook(void *user, fm_model *m, fm_hook_point p, int64_t layer) {
    fm_zero3 *z = user;
    const int L = (int)z->L, head = L + 1, g = (int)layer + 1; /* layer l's group; the embedding's at -1 */
    switch (p) {
    case FM_HOOK_BEFORE_EMBED:
        FM_TRY(ensure(z, m, 0, -1));
        return ensure(z, m, L > 0 ? 1 : head, 0); /* prefetch layer 0 */
    case FM_HOOK_BEFORE_FORWARD:
        FM_TRY(ensure(z, m, g, -1));
        return ensure(z, m, g + 1, g); /* prefetch layer l + 1 (the head after the last layer) */
    case FM_HOOK_BEFORE_HEAD:
        FM_TRY(ensure(z, m, head, -1));
        if (z->tied) { /* the head's weight is the embedding's: both groups at once */
            FM_TRY(ensure(z, m, 0, head));
            grads_at(z, m, 0, 0);
            grads_at(z, m, head, (int64_t)z->W * z->piece[0]);
        } else {
            grads_at(z, m, head, 0);
        }
        return FM_OK;
    case FM_HOOK_AFTER_HEAD_BACKWARD:
        if (z->tied) {
            FM_TRY(reduce(z, m, 0, 0)); /* the head's part of the embedding's gradient */
            return reduce(z, m, head, (int64_t)z->W * z->piece[0]);
        }
        return reduce(z, m, head, 0);
    case FM_HOOK_BEFORE_BACKWARD:
        FM_TRY(ensure(z, m, g, -1)); /* for the recompute and the backward */
        if (g > 1) FM_TRY(ensure(z, m, g - 1, g)); /* prefetch layer l - 1 (the embedding's backward needs none) */
        grads_at(z, m, g, 0);
        return FM_OK;
    case FM_HOOK_AFTER_BACKWARD:
        return reduce(z, m, g, 0);
    case FM_HOOK_BEFORE_EMBED_BACKWARD:
        grads_at(z, m, 0, 0);
        return FM_OK;
    case FM_HOOK_AFTER_EMBED_BACKWARD:
        return reduce(z, m, 0, 0);
    default:
        return FM_OK;
    }
}

/* ---- the step ---- */

void fm_zero3_zero_grads(fm_zero3 *z, fm_model *m) {
    m->be.ops->mem_set(m->be.ctx, z->grads, 0, sizeof(fm_act) * (size_t)z->shard_len);
}

/* The squares of the pieces (padding zero) plus, on a rank with whole_sq, of the whole parts,
 * summed over the W ranks. */
static fm_status sumsq_all(fm_zero3 *z, fm_model *m, const fm_act *x, double *dev_out) {
    m->be.ops->sumsq(m->be.ctx, dev_out, x, z->piece_total, false); /* the padding is zero */
    if (z->whole_sq && z->shard_len > z->piece_total)
        m->be.ops->sumsq(m->be.ctx, dev_out, x + z->piece_total, z->shard_len - z->piece_total, true);
    return fm_comm_all_reduce(z->dp, dev_out, dev_out, 1, FM_COMM_F64, FM_COMM_SUM, 0);
}

fm_status fm_zero3_grad_sumsq(fm_zero3 *z, fm_model *m, double *dev_out) {
    const int64_t whole = z->shard_len - z->piece_total;
    if (z->edp && whole > 0) /* the experts' gradients: the sum over the ranks holding them */
        FM_TRY(fm_comm_all_reduce(z->edp, z->grads + z->piece_total, z->grads + z->piece_total, whole, act_dtype,
                                  FM_COMM_SUM, 0));
    return sumsq_all(z, m, z->grads, dev_out);
}

fm_status fm_zero3_weight_sumsq(fm_zero3 *z, fm_model *m, double *dev_out) {
    return sumsq_all(z, m, z->weights, dev_out);
}

fm_status fm_zero3_update(fm_zero3 *z, fm_model *m, const fm_optimizer_ops *optim, void *opt, double lr, float clip) {
    if (!optim->step_at)
        return fm_error(FM_ERR_UNSUPPORTED, "--zero 3: the optimizer %s cannot update a shard; use the on-device AdamW "
                        "(drop --offload-optimizer)", optim->name);
    optim->step_begin(opt);
    const bool own_master = (void *)z->master != (void *)z->weights;
    for (int g = 0; g < z->n_groups; g++) {
        int64_t f;
        const int64_t v = valid(z, g, z->rank, &f), o = z->local[g];
        if (v > 0)
            optim->step_at(opt, m, f, f + v, z->weights + o, z->grads + o, own_master ? z->master + o : NULL, o, lr, clip);
    }
    for (int g = 0; g < z->n_groups; g++) { /* the whole parts */
        const int64_t k = z->keep[g], f = z->begin[g + 1] - k, o = z->wlocal[g];
        if (k > 0)
            optim->step_at(opt, m, f, f + k, z->weights + o, z->grads + o, own_master ? z->master + o : NULL, o, lr, clip);
    }
    fm_zero3_invalidate(z); /* the next forward gathers the updated weights */
    return FM_OK;
}

/* ---- checkpoints ---- */

/* fm_zero3_gather_full (all false: rank 0 only) and fm_zero3_gather_all (all true). */
static fm_status gather(fm_zero3 *z, const fm_model *m, const void *local, fm_dtype dtype, bool all, void **full) {
    const int W = z->W, r = z->rank;
    const bool mine = all || r == 0;
    const size_t es = fm_dtype_size(dtype);
    *full = NULL;
    FM_ASSERT(es <= 2 * sizeof(fm_act)); /* a group of W p_g fits in the two slots together */
    void *out = mine ? fm_malloc(es * (size_t)z->n_params) : NULL;
    /* an allocation failure returns before the collectives: the CLI then ends every rank */
    if (mine && !out)
        return fm_error(FM_ERR_NOMEM, "rank %d of %d: cannot gather %lld values of the ZeRO-3 shards for the checkpoint "
                        "on the host", r, W, (long long)z->n_params);
    /* group by group through the two gather slots (backend memory the plan holds; adjacent: one
     * buffer of 2 slot_len fm_act), each group's full range copied out on rank 0 */
    void *buf = z->slot[0];
    fm_zero3_invalidate(z);
    fm_status st = FM_OK;
    for (int g = 0; g < z->n_groups && st == FM_OK; g++) {
        st = fm_comm_all_gather(z->dp, (const char *)local + es * (size_t)z->local[g], buf, z->piece[g],
                                dtype == FM_DTYPE_BF16 ? FM_COMM_BF16 : FM_COMM_F32, 0);
        const size_t n = (size_t)(z->begin[g + 1] - z->begin[g] - z->keep[g]) * es;
        if (st == FM_OK && mine && n > 0) {
            char *dst = (char *)out + es * (size_t)z->begin[g];
            if (m->be.ops->host_memory) memcpy(dst, buf, n);
            else m->be.ops->copy(m->be.ctx, dst, buf, n, FM_COPY_D2H);
        }
        if (st == FM_OK && mine && z->keep[g] > 0) { /* the whole part: this rank's own */
            char *dst = (char *)out + es * (size_t)(z->begin[g + 1] - z->keep[g]);
            const char *src = (const char *)local + es * (size_t)z->wlocal[g];
            if (m->be.ops->host_memory) memcpy(dst, src, es * (size_t)z->keep[g]);
            else m->be.ops->copy(m->be.ctx, dst, src, es * (size_t)z->keep[g], FM_COPY_D2H);
        }
    }
    if (st != FM_OK) fm_free(out), out = NULL;
    *full = out;
    return st;
}

fm_status fm_zero3_gather_full(fm_zero3 *z, const fm_model *m, const void *local, fm_dtype dtype, void **full) {
    return gather(z, m, local, dtype, false, full);
}

fm_status fm_zero3_gather_all(fm_zero3 *z, const fm_model *m, const void *local, fm_dtype dtype, void **full) {
    return gather(z, m, local, dtype, true, full);
}

fm_status fm_zero3_scatter_full(fm_zero3 *z, fm_model *m, const float *full, void *local, fm_dtype dtype) {
    const size_t S = (size_t)z->shard_len;
    float *h = fm_malloc(sizeof(float) * S);
    if (!h) return fm_error(FM_ERR_NOMEM, "memory: cannot stage this rank's %lld-element ZeRO-3 shard on the host",
                            (long long)z->shard_len);
    fm_zero3_pack(z, z->rank, full, h, sizeof(float));
    if (dtype == FM_DTYPE_BF16) {
        uint16_t *b = (uint16_t *)h; /* narrowing in increasing order never overtakes the reads */
        for (size_t i = 0; i < S; i++) b[i] = fm_f32_to_bf16(h[i]);
    }
    const size_t bytes = fm_dtype_size(dtype) * S;
    if (m->be.ops->host_memory) memcpy(local, h, bytes);
    else m->be.ops->copy(m->be.ctx, local, h, bytes, FM_COPY_H2D);
    fm_free(h);
    fm_zero3_invalidate(z);
    return FM_OK;
}

fm_status fm_zero3_set_master(fm_zero3 *z, fm_model *m, const float *full) {
    FM_TRY(fm_zero3_scatter_full(z, m, full, z->master, FM_DTYPE_F32));
    if ((void *)z->master != (void *)z->weights)
        m->be.ops->convert(m->be.ctx, z->weights, FM_ACT_DTYPE, z->master, FM_DTYPE_F32, z->shard_len);
    return FM_OK;
}
