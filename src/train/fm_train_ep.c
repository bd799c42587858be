/* Expert parallelism in the trainer: checks, the model-state bound, the gradients' reduction and
 * the checkpoint gather (fm_train_ep.h). */
#include "fm_train_ep.h"

#include <stdio.h>
#include <string.h>

#include "../train/fm_optim.h"

static const fm_comm_dtype act_comm_dtype = sizeof(fm_act) == sizeof(float) ? FM_COMM_F32 : FM_COMM_BF16;

/* The divisors of n as "1, 2, 4" (for messages). */
static const char *divisors(int64_t n, char *buf, size_t cap) {
    size_t w = 0;
    buf[0] = 0;
    for (int64_t d = 1; d <= n && w + 24 < cap; d++)
        if (n % d == 0) w += (size_t)snprintf(buf + w, cap - w, "%s%lld", w ? ", " : "", (long long)d);
    return buf;
}

fm_status fm_train_ep_check(const fm_train_opts *o, const fm_config *c, int W) {
    const int ep = o->ep == 0 ? 1 : o->ep;
    char dv[256];
    if (ep < 1) return fm_error(FM_ERR_ARG, "--ep %d: expected an expert-parallel degree >= 1 (1: every rank holds "
                                "every expert); use --ep 1 or a divisor of the ranks", ep);
    if (W % ep != 0)
        return fm_error(FM_ERR_ARG, "--ep %d does not divide the %d rank%s running (expert-parallel groups are drawn "
                        "from the world's ranks); expected one of %s; use such an --ep, or launch a multiple of %d "
                        "ranks", ep, W, W == 1 ? "" : "s", divisors(W, dv, sizeof dv), ep);
    if (c->num_experts % ep != 0)
        return fm_error(FM_ERR_ARG, "--ep %d does not divide num_experts %lld of the model config (each rank holds "
                        "E/ep experts); expected one of %s; use such an --ep", ep, (long long)c->num_experts,
                        divisors(c->num_experts, dv, sizeof dv));
    if (o->ep_cap_tokens < 0)
        return fm_error(FM_ERR_ARG, "--ep-cap-tokens must be >= 1 tokens per source per chunk (0: chosen), found %lld",
                        (long long)o->ep_cap_tokens);
    if (!(o->llep_lambda >= 1.0))
        return fm_error(FM_ERR_ARG, "--llep-lambda must be >= 1 (the busiest rank's load over the mean that triggers "
                        "the placement; the paper's 1.3), found %g", o->llep_lambda);
    if (o->llep_min_piece < 1)
        return fm_error(FM_ERR_ARG, "--llep-min-piece must be >= 1 rows, found %lld", (long long)o->llep_min_piece);
    if (ep == 1) {
        if (o->llep)
            return fm_error(FM_ERR_ARG, "--llep places experts over the ranks of an expert-parallel group, but --ep is "
                            "1; add --ep N (N > 1, dividing the ranks and num_experts) or drop --llep");
        if (o->ep_cap_tokens > 0)
            return fm_error(FM_ERR_ARG, "--ep-cap-tokens %lld caps the expert-parallel dispatch, but --ep is 1; add "
                            "--ep N, or use --moe-chunk-tokens for the local MoE's chunks", (long long)o->ep_cap_tokens);
        return FM_OK;
    }
    /* --zero 1 and --offload-optimizer with --ep: fm_train_opts_check_flags (fm_trainer.h) */
    if (o->ep_cap_tokens > 0 && o->moe_chunk_tokens > 0 && o->ep_cap_tokens != o->moe_chunk_tokens)
        return fm_error(FM_ERR_ARG, "--ep-cap-tokens %lld and --moe-chunk-tokens %lld: under --ep the dispatch's "
                        "chunks are the MoE's chunks; give one of them (or the same value)",
                        (long long)o->ep_cap_tokens, (long long)o->moe_chunk_tokens);
    return FM_OK;
}

fm_llep_opts fm_train_ep_llep(const fm_train_opts *o) {
    fm_llep_opts l = fm_llep_defaults();
    l.on = o->llep;
    l.lambda = o->llep_lambda;
    l.min_piece = o->llep_min_piece;
    return l;
}

/* ---- the model-state bound ---- */

size_t fm_train_ep_model_state_bound(const fm_config *cfg, const fm_state_layout *lay, size_t a, bool bf16_moments,
                                     char desc[200]) {
    const int bound_ep = lay->ep > 1 ? lay->ep : 1;
    const int64_t n = fm_params_ep_num_params(cfg, bound_ep);
    if (desc)
        snprintf(desc, 200, "%d B/param (weight, grad%s, Adam m, v) x %lld params (experts / ep = %d)",
                 (int)(2 * a + (a != 4 ? 4 : 0) + (bf16_moments ? 4 : 8)), a != 4 ? ", fp32 master" : "",
                 (long long)n, bound_ep);
    size_t b = 2 * fm_arena_round((size_t)n * a); /* as fm_param_store_bytes, for n parameters */
    if (a != sizeof(float)) b += fm_arena_round((size_t)n * sizeof(float));
    return b + fm_adamw_state_bytes(n, bf16_moments);
}

/* ---- groups ---- */

void fm_train_ep_free(fm_train_ep *x) {
    if (x->full_ok) fm_params_free(&x->full);
    if (x->host_ok) fm_comm_free(&x->host_world);
    if (x->edp_ok) fm_comm_free(&x->edp);
    if (x->group_ok) fm_comm_group_free(&x->group);
    memset(x, 0, sizeof *x);
    x->ep = 1;
}

fm_status fm_train_ep_init(fm_train_ep *x, const fm_comm *world, int dp, int ep, int sp, fm_model *m) {
    memset(x, 0, sizeof *x);
    x->ep = ep;
    x->world_rank = fm_comm_rank(world);
    x->world = fm_comm_size(world);
    x->rank = x->world_rank % ep;
    FM_ASSERT(ep > 1 && m->p.ep == ep && m->p.ep_rank == x->rank);
    FM_TRY(fm_comm_group_create(&x->group, world, dp, ep, sp)); /* ep: the block [r - r % ep, + ep), any sp ranks */
    x->group_ok = true;
    FM_TRY(world->ops->split(world->ctx, x->rank, x->world_rank, &x->edp)); /* same experts: same r % ep */
    x->edp_ok = true;
    FM_TRY(fm_comm_mpi_world(&x->host_world, NULL, world->ops->default_timeout(world->ctx), 0));
    x->host_ok = true;
    FM_TRY(fm_params_create(&x->full, &m->cfg, 1, 0)); /* a table only: no parameter memory */
    x->full_ok = true;
    m->mesh.moe_ep_comm = &x->group.axis[FM_AXIS_EP].comm;
    return FM_OK;
}

/* ---- gradients ---- */

fm_status fm_train_ep_reduce_grads(fm_model *m, const fm_comm *dp, const fm_train_ep *x) {
    const fm_config *c = &m->cfg;
    const int64_t H = c->hidden_size, I = c->moe_intermediate_size;
    /* a layer's experts: gate, up, down and (gpt_oss) their biases, contiguous (model/fm_params.c) */
    const int64_t L = c->num_hidden_layers, span = m->p.E_loc * (3 * H * I + (c->expert_bias ? 2 * I + H : 0));
    const fm_comm *ep = &x->group.axis[FM_AXIS_EP].comm;
    const bool edp = fm_comm_size(&x->edp) > 1;
    fm_act *g = m->p.grads;
    int64_t prev = 0;
    for (int64_t l = 0; l < L; l++) { /* [prev, gate): replicated tensors; [gate, + span): the layer's experts */
        if (!m->p.g.layers[l].w_gate) continue; /* a dense layer: replicated, in the next range */
        const int64_t g0 = m->p.g.layers[l].w_gate - g;
        FM_TRY(fm_comm_all_reduce(dp, g + prev, g + prev, g0 - prev, act_comm_dtype, FM_COMM_SUM, 0));
        if (edp) FM_TRY(fm_comm_all_reduce(&x->edp, g + g0, g + g0, span, act_comm_dtype, FM_COMM_SUM, 0));
        prev = g0 + span;
    }
    FM_TRY(fm_comm_all_reduce(dp, g + prev, g + prev, m->p.n_params - prev, act_comm_dtype, FM_COMM_SUM, 0));
    /* squares: every expert once (summed over the ep group), then the replicas' on every rank */
    double *sq = m->a.results + FM_RESULT_SUMSQ;
    bool first = true;
    for (int64_t l = 0; l < L; l++) {
        if (!m->p.g.layers[l].w_gate) continue;
        m->be.ops->sumsq(m->be.ctx, sq, m->p.g.layers[l].w_gate, span, !first);
        first = false;
    }
    FM_TRY(fm_comm_all_reduce(ep, sq, sq, 1, FM_COMM_F64, FM_COMM_SUM, 0));
    prev = 0;
    for (int64_t l = 0; l < L; l++) {
        if (!m->p.g.layers[l].w_gate) continue;
        const int64_t g0 = m->p.g.layers[l].w_gate - g;
        if (g0 > prev) m->be.ops->sumsq(m->be.ctx, sq, g + prev, g0 - prev, true);
        prev = g0 + span;
    }
    if (m->p.n_params > prev) m->be.ops->sumsq(m->be.ctx, sq, g + prev, m->p.n_params - prev, true);
    return FM_OK;
}

/* ---- checkpoints ---- */

/* src [n] of dtype (backend or host memory) as fp32 host values into dst [n]. */
static void download_f32(const fm_model *m, float *dst, const void *src, fm_dtype dtype, bool host, int64_t n) {
    if (dtype == FM_DTYPE_F32) {
        if (host || m->be.ops->host_memory) memcpy(dst, src, sizeof(float) * (size_t)n);
        else m->be.ops->copy(m->be.ctx, dst, src, sizeof(float) * (size_t)n, FM_COPY_D2H);
        return;
    }
    FM_ASSERT(dtype == FM_DTYPE_BF16);
    uint16_t *h = (uint16_t *)((char *)dst + 2 * (size_t)n); /* widened in increasing order (as fetch_from_backend) */
    if (host || m->be.ops->host_memory) memcpy(h, src, 2 * (size_t)n);
    else m->be.ops->copy(m->be.ctx, h, src, 2 * (size_t)n, FM_COPY_D2H);
    for (int64_t i = 0; i < n; i++) dst[i] = fm_bf16_to_f32(h[i]);
}

fm_status fm_train_ep_gather(const fm_train_ep *x, const fm_model *m, const void *src, fm_dtype dtype, bool host,
                             float **full) {
    *full = NULL;
    const int ep = x->ep, W = x->world, me = x->world_rank;
    const int64_t n = m->p.n_params;
    const bool root = me == 0, sender = me < ep; /* rank 0's ep group is world ranks [0, ep) */
    int64_t *cnt = fm_malloc(sizeof(int64_t) * 4 * (size_t)W);
    float *mine = fm_malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    float *all = root ? fm_malloc(sizeof(float) * (size_t)(n * ep)) : NULL;
    fm_status st = FM_OK;
    if (!cnt || !mine || (root && !all))
        st = fm_error(FM_ERR_NOMEM, "rank %d of %d: memory to gather the experts for the checkpoint (%lld values)", me,
                      W, (long long)(root ? n * ep : n));
    if (st == FM_OK) {
        download_f32(m, mine, src, dtype, host, n);
        int64_t *sc = cnt, *sd = cnt + W, *rc = cnt + 2 * W, *rd = cnt + 3 * W;
        for (int q = 0; q < W; q++) {
            sc[q] = sd[q] = 0;
            rc[q] = root && q < ep ? n : 0;
            rd[q] = root && q < ep ? (int64_t)q * n : 0;
        }
        if (sender) sc[0] = n;
        /* an allocation failure returns before the collective on that rank: the CLI then ends every rank */
        st = fm_comm_all_to_all_v(&x->host_world, mine, sc, sd, all, rc, rd, FM_COMM_F32, 0);
    }
    float *out = NULL;
    if (st == FM_OK && root) { /* each ep rank's table is a subsequence of the full one, in its order */
        const fm_model_params *F = &x->full;
        out = fm_malloc(sizeof(float) * (size_t)F->n_params);
        if (!out) st = fm_error(FM_ERR_NOMEM, "rank 0: memory for the checkpoint's %lld values", (long long)F->n_params);
        for (int q = 0; q < ep && st == FM_OK; q++) {
            fm_model_params t;
            st = fm_params_create(&t, &m->cfg, ep, q);
            if (st != FM_OK) break;
            for (int i = 0, j = 0; i < F->n_tensors && j < t.n_tensors; i++)
                if (!strcmp(F->table[i].name, t.table[j].name)) {
                    memcpy(out + F->table[i].offset, all + (size_t)q * (size_t)n + t.table[j].offset,
                           sizeof(float) * (size_t)F->table[i].numel);
                    j++;
                }
            fm_params_free(&t);
        }
    }
    fm_free(cnt);
    fm_free(mine);
    fm_free(all);
    if (st != FM_OK) {
        fm_free(out);
        return st;
    }
    *full = out;
    return FM_OK;
}

void fm_train_ep_report(const fm_model *m, char *buf, size_t n) {
    const fm_moe_ep_ws *w = &m->a.moe_ep_ws;
    snprintf(buf, n, "ep dispatch: rows received per chunk high %lld of R_max %lld (ep %d x cap %lld x min(k, E/ep)); "
             "sent high %lld; LLEP chunk passes that moved rows %lld", (long long)w->recv_rows_high,
             (long long)w->rows_max, w->ep, (long long)w->c, (long long)w->send_rows_high, (long long)w->llep_chunks);
}
