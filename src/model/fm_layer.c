/* One decoder layer's forward and backward (fm_model.h: fm_model_layer_forward/backward):
 *   x -> RMSNorm -> causal GQA attention (optional q/k/v/o biases, optional QK-norm, RoPE over the
 *        first rotary_dim dims of each head, model/fm_rope.h) -> +x = x_mid
 *        (deepseek_v3: multi-head latent attention instead, model/fm_mla.h)
 *   x_mid -> RMSNorm -> router -> MoE (dispatch, experts, combine) [+ shared experts] -> +x_mid = y
 *   (a dense layer, fm_config_layer_is_moe false: x_mid -> RMSNorm -> SwiGLU MLP -> +x_mid = y)
 * With sequence parallelism (m->mesh.sp > 1) the attention op is fm_attn_sp's (Ulysses all-to-alls
 * around it); every other op runs on this rank's tokens as it is.
 * The loop over layers is the schedule's (schedule/fm_schedule.h), never the model's. */
#include "fm_model.h"

#include "fm_dense_mlp.h"
#include "fm_layer_oss.h"
#include "fm_moe_layer.h"

#define OPS (m->be.ops)
#define CTX (m->be.ctx)
#define PHASE(p) fm_phase_mark(&m->be, FM_PHASE_##p)

static void linear_fwd(fm_model *m, fm_act *y, const fm_act *x, const fm_act *W, int64_t N, int64_t in, int64_t out) {
    fm_linear_fwd(&m->be, y, FM_ACT_DTYPE, x, W, N, in, out);
}

static void linear_bwd(fm_model *m, fm_act *dx, float beta, fm_act *dW, const fm_act *dy, const fm_act *x,
                       const fm_act *W, int64_t N, int64_t in, int64_t out) {
    fm_linear_bwd(&m->be, dx, beta, dW, dy, x, W, N, in, out, 1.0f);
}

static fm_moe_dims moe_dims(const fm_model *m) {
    const fm_config *c = &m->cfg;
    fm_moe_dims d = {c->hidden_size, c->moe_intermediate_size, c->num_experts, c->num_experts_per_tok,
                     m->a.moe_sync_free, m->a.moe_fp8, m->a.moe_fp8_codes,
                     m->a.opts.expert_fp8_cache ? fm_config_num_moe_layers(c) : 0}; /* a set per MoE layer */
    d.swiglu_limit = (float)c->swiglu_limit; /* gpt_oss's clamped SwiGLU; 0 elsewhere */
    d.swiglu_alpha = (float)c->swiglu_alpha;
    d.bias = c->expert_bias; /* gpt_oss's experts' biases */
    return d;
}

/* MoE layer l's index among the MoE layers (the fp8 weight cache's set: one per MoE layer). */
static int64_t moe_index(const fm_config *c, int64_t l) {
    int64_t n = 0;
    for (int64_t j = 0; j < l; j++) n += fm_config_layer_is_moe(c, j);
    return n;
}

void fm_model_fp8_cache_invalidate(fm_model *m) {
    if (m->a.moe_fp8_fresh) memset(m->a.moe_fp8_fresh, 0, sizeof(bool) * (size_t)m->cfg.num_hidden_layers);
    m->a.moe_ws.w8_holds = -1; /* without the cache: the one set's codes are of the old weights */
    m->a.moe_ep_ws.exp_ws.w8_holds = -1; /* the same for the EP owner's set */
}

fm_act *fm_model_boundary(fm_model *m, int64_t l) {
    FM_ASSERT(l >= 0 && l <= m->cfg.num_hidden_layers);
    return m->a.boundary[l];
}

fm_act *fm_model_grad_buffer(fm_model *m, int i) {
    FM_ASSERT(i == 0 || i == 1);
    return i == 0 ? m->a.ws.dx_a : m->a.ws.dx_b;
}

/* The micro-batch's segments for the router's sequence-wise loss (fm_router_segs): its rows, or
 * the documents of the last uploaded batch. */
static fm_router_segs router_segs(const fm_model *m) {
    return (fm_router_segs){m->a.docs ? m->a.doc_start : NULL, m->a.B, m->a.T, m->a.n_seg};
}

/* The norm outputs ln1, ln2 live in the working set's dln and dtmp, free whenever a forward
 * runs (before backward, and during a recompute: the schedule's dy and dx are the other
 * buffers); y must be neither. */
/* The RoPE table rows this rank reads: the whole row's [sp T, rd/2] table (fm_layout.c) indexed
 * by the packed positions (doc_pos), else rows sp_rank T .. sp_rank T + T - 1 of it (positions t). */
static void rope_rows(const fm_model *m, const float **cos_t, const float **sin_t) {
    const int64_t off = m->a.docs ? 0 : (int64_t)m->mesh.sp_rank * m->a.T * (fm_config_rotary_dim(&m->cfg) / 2);
    *cos_t = m->a.rope_cos + off;
    *sin_t = m->a.rope_sin + off;
}

static fm_status layer_forward(fm_model *m, int64_t l, fm_act *y, bool skip_attention) {
    const fm_config *c = &m->cfg;
    FM_ASSERT(l >= 0 && l < c->num_hidden_layers);
    const fm_act *x = m->a.boundary[l];
    fm_layer_acts *a = &m->a.acts[l];
    const fm_layer_ptrs *w = &m->p.w.layers[l];
    const int64_t B = m->a.B, T = m->a.T, N = m->a.N, H = c->hidden_size;
    const int64_t nh = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim;
    const int64_t qd = nh * hd, kd = nkv * hd;
    const float eps = (float)c->rms_norm_eps;

    fm_act *ln1 = m->a.ws.dln, *ln2 = m->a.ws.dtmp;
    FM_ASSERT(y != ln1 && y != ln2);
    if (c->mla) { /* multi-head latent attention (deepseek_v3; fm_mla.h): x -> x_mid */
        FM_TRY(fm_mla_forward(m, l, skip_attention));
        goto mlp_block;
    }

    /* attention block */
    PHASE(DENSE);
    OPS->rmsnorm_fwd(CTX, ln1, a->rstd1, x, w->ln1, N, H, eps);
    linear_fwd(m, a->q, ln1, w->wq, N, H, qd);
    linear_fwd(m, a->k, ln1, w->wk, N, H, kd);
    linear_fwd(m, a->v, ln1, w->wv, N, H, kd);
    if (w->bq) { /* attention_bias: q, k, v projections' biases, before QK-norm and RoPE */
        OPS->bias_add(CTX, a->q, w->bq, N, qd);
        OPS->bias_add(CTX, a->k, w->bk, N, kd);
        OPS->bias_add(CTX, a->v, w->bv, N, kd);
    }
    if (c->qk_norm == FM_QK_NORM_PER_HEAD) {
        OPS->rmsnorm_fwd(CTX, a->qr, a->rstd_q, a->q, w->q_norm, N * nh, hd, eps);
        OPS->rmsnorm_fwd(CTX, a->kr, a->rstd_k, a->k, w->k_norm, N * nkv, hd, eps);
    } else if (c->qk_norm == FM_QK_NORM_FULL) {
        OPS->rmsnorm_fwd(CTX, a->qr, a->rstd_q, a->q, w->q_norm, N, qd, eps);
        OPS->rmsnorm_fwd(CTX, a->kr, a->rstd_k, a->k, w->k_norm, N, kd, eps);
    } /* else q, k alias qr, kr: RoPE below works in place on the projections */
    const int32_t *pos = m->a.docs ? m->a.doc_pos : NULL, *kvs = m->a.docs ? m->a.doc_start : NULL; /* packed */
    const float *rc, *rs;
    rope_rows(m, &rc, &rs);
    const int64_t rd = fm_config_rotary_dim(c); /* partial rotary: the first rd dims of each head */
    OPS->rope_fwd(CTX, a->qr, rc, rs, B, T, nh, hd, rd, pos);
    OPS->rope_fwd(CTX, a->kr, rc, rs, B, T, nkv, hd, rd, pos);
    if (!skip_attention) { /* keep-attention's recompute: att and lse are the forward's, kept */
        PHASE(ATTENTION);
        if (fm_layer_oss_attention(m, l)) /* gpt_oss: sinks, sliding windows (under --sp too) */
            FM_TRY(fm_layer_oss_attention_fwd(m, l, a, kvs));
        else if (m->mesh.sp > 1) /* Ulysses: to head-sharded, attention over the whole sequence, back */
            FM_TRY(fm_attn_sp_forward(&m->a.sp_attn, &m->be, a->att, a->lse, a->qr, a->kr, a->v, kvs));
        else
            OPS->attention_fwd(CTX, a->att, a->lse, a->qr, a->kr, a->v, B, T, nh, nkv, hd, kvs);
        PHASE(DENSE);
    }
    linear_fwd(m, a->x_mid, a->att, w->wo, N, qd, H);
    if (w->bo) OPS->bias_add(CTX, a->x_mid, w->bo, N, H); /* attention_o_bias */
    OPS->add(CTX, a->x_mid, x, N * H);

mlp_block:
    OPS->rmsnorm_fwd(CTX, ln2, a->rstd2, a->x_mid, w->ln2, N, H, eps);
    if (!w->router) { /* a dense layer (fm_config_layer_is_moe): the SwiGLU MLP, no router */
        fm_dense_mlp_forward(&m->be, y, ln2, w->mlp_gate, w->mlp_up, w->mlp_down, N, H, c->dense_intermediate_size,
                             &m->a.ws.dense);
        OPS->add(CTX, y, a->x_mid, N * H);
        return FM_OK;
    }
    /* MoE block: router, then the experts through the dispatcher */
    PHASE(ROUTER);
    /* router logits: fp32, transient in the working set (backward needs only probs and lse) */
    const int64_t k = c->num_experts_per_tok;
    int32_t *routes = m->a.rl_routes ? m->a.rl_routes + moe_index(c, l) * N * k : NULL; /* the RL head's (fm_acts.h) */
    const fm_router_segs segs = router_segs(m);
    FM_TRY(fm_router_forward(&m->be, &m->router, m->mesh.comm, m->a.ws.dlogits_r, &a->router,
                             m->a.results + FM_RESULT_SCRATCH, m->a.results + FM_RESULT_LAYERS + 2 * l, ln2, w->router,
                             w->router_lin_bias /* gpt_oss's, else NULL */, w->router_bias, N, H,
                             m->a.rl.replay ? routes : NULL, &segs));
    if (routes && m->a.rl.record && !m->a.rl.replay) /* the routes taken, read back by the library */
        OPS->copy_async(CTX, routes, a->router.topk_idx, sizeof(int32_t) * (size_t)(N * k), FM_COPY_D2D,
                        FM_STREAM_COMPUTE);
    const fm_moe_dims md = moe_dims(m);
    const fm_moe_weights mw = {w->w_gate, w->w_up, w->w_down, w->eb_gate, w->eb_up, w->eb_down};
    if (m->mesh.moe_ep_comm) { /* expert parallelism (--ep): the experts of the ep group */
        m->a.moe_ep_ws.exp_ws.w8_layer = moe_index(c, l); /* --fp8-weight-cache: this layer's codes */
        FM_TRY(fm_moe_ep_layer_forward(&m->be, m->mesh.moe_ep_comm, &md, &mw, y, ln2, a->router.topk_idx, a->router.topk_w,
                                       N, m->a.moe_K, m->a.moe_chunk_order, &m->a.moe_ep_ws, m->a.moe_ws.counts,
                                       m->a.moe_ep_counts_host));
    } else {
        m->a.moe_ws.w8_layer = moe_index(c, l); /* --fp8-weight-cache: this layer's codes */
        FM_TRY(fm_moe_forward(&m->be, &md, &mw, y, ln2, a->router.topk_idx, a->router.topk_w, N, m->a.moe_K,
                              m->a.moe_chunk_order, m->a.moe_chunk_tokens > 0 ? NULL : &a->moe, &m->a.moe_ws));
    }
    PHASE(DENSE);
    if (w->sh_gate) { /* shared experts (glm4_moe): on every token, into ln1's buffer (dead) */
        fm_dense_mlp_forward(&m->be, m->a.ws.dln, ln2, w->sh_gate, w->sh_up, w->sh_down, N, H,
                             fm_config_shared_width(c), &m->a.ws.dense);
        OPS->add(CTX, y, m->a.ws.dln, N * H);
    }
    OPS->add(CTX, y, a->x_mid, N * H);
    return FM_OK;
}

fm_status fm_model_layer_forward(fm_model *m, int64_t l, fm_act *y) { return layer_forward(m, l, y, false); }

fm_status fm_model_layer_recompute(fm_model *m, int64_t l, fm_act *y, bool skip_attention) {
    FM_ASSERT(l >= 0 && l < m->cfg.num_hidden_layers);
    if (skip_attention && !(m->a.keep_attention && m->a.keep_attention[l]))
        return fm_error(FM_ERR_ARG, "recompute of layer %lld without its attention forward: the layout keeps no "
                        "attention output for it (fm_layout_opts.keep_attention)", (long long)l);
    return layer_forward(m, l, y, skip_attention);
}

/* The MoE block's backward of layer l: d ln2 into ws.dln (assigned) from dy, the experts' and
 * the router's weight gradients accumulated; ln2 [N,H] the block's input, formed again. */
static fm_status moe_block_backward(fm_model *m, int64_t l, const fm_act *dy, const fm_act *ln2, float scale) {
    const fm_config *c = &m->cfg;
    fm_layer_acts *a = &m->a.acts[l];
    const fm_layer_ptrs *w = &m->p.w.layers[l];
    const fm_layer_ptrs *g = &m->p.g.layers[l];
    fm_bwd_ws *ws = &m->a.ws;
    const int64_t N = m->a.N, H = c->hidden_size;
    const fm_moe_dims md = moe_dims(m);
    const fm_moe_weights mw = {w->w_gate, w->w_up, w->w_down, w->eb_gate, w->eb_up, w->eb_down};
    const fm_moe_grads mg = {g->w_gate, g->w_up, g->w_down, g->eb_gate, g->eb_up, g->eb_down};
    if (m->mesh.moe_ep_comm) { /* expert parallelism: the ep group's error, the same on every rank */
        m->a.moe_ep_ws.exp_ws.w8_layer = moe_index(c, l);
        FM_TRY(fm_moe_ep_layer_backward(&m->be, m->mesh.moe_ep_comm, &md, &mw, &mg, ws->dln, ws->dtopk_w, dy, ln2,
                                        a->router.topk_idx, a->router.topk_w, N, m->a.moe_K, m->a.moe_chunk_order,
                                        &m->a.moe_ep_ws));
    } else {
        m->a.moe_ws.w8_layer = moe_index(c, l);
        FM_TRY(fm_moe_backward(&m->be, &md, &mw, &mg, ws->dln, ws->dtopk_w, dy, ln2, a->router.topk_idx,
                               a->router.topk_w, N, m->a.moe_K, m->a.moe_chunk_order,
                               m->a.moe_chunk_tokens > 0 ? NULL : &a->moe, &m->a.moe_ws));
    }
    PHASE(ROUTER);
    const int64_t n_tot = m->mesh.comm ? N * fm_comm_size(m->mesh.comm) : N;
    const fm_router_segs segs = router_segs(m);
    fm_router_backward(&m->be, &m->router, n_tot, ws->dln, g->router, ws->dlogits_r, ws->dlogits_act, ws->dprobs_e,
                       ws->dtopk_w, &a->router, ln2, w->router, N, H, fm_config_num_moe_layers(c), scale,
                       &segs);
    if (g->router_lin_bias) /* gpt_oss: the router bias's gradient from the logit gradient */
        fm_router_lin_bias_backward(&m->be, g->router_lin_bias, ws->dlogits_act, N, c->num_experts);
    return FM_OK;
}

/* dy [N,H]: gradient of the layer output, clobbered (its buffer holds d att once dy is added
 * into d x_mid). Writes dx [N,H] (assigned); until its last op dx holds ln2, then ln1, formed
 * again from x_mid and x. */
fm_status fm_model_layer_backward(fm_model *m, int64_t l, fm_act *dy, fm_act *dx, float scale) {
    const fm_config *c = &m->cfg;
    FM_ASSERT(l >= 0 && l < c->num_hidden_layers);
    const fm_act *x = m->a.boundary[l];
    fm_layer_acts *a = &m->a.acts[l];
    const fm_layer_ptrs *w = &m->p.w.layers[l];
    const fm_layer_ptrs *g = &m->p.g.layers[l];
    fm_bwd_ws *ws = &m->a.ws;
    const int64_t B = m->a.B, T = m->a.T, N = m->a.N, H = c->hidden_size;
    const int64_t nh = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim;
    const int64_t qd = nh * hd, kd = nkv * hd;
    const float eps = (float)c->rms_norm_eps;

    /* MoE block: y = x_mid + experts(ln2(x_mid)); ln2 formed again into dx */
    PHASE(DENSE);
    fm_act *ln2 = dx;
    OPS->rmsnorm_fwd(CTX, ln2, a->rstd2, a->x_mid, w->ln2, N, H, eps);
    if (!w->router) /* a dense layer: d ln2 from the SwiGLU MLP (gate and up formed again) */
        fm_dense_mlp_backward(&m->be, ws->dln, g->mlp_gate, g->mlp_up, g->mlp_down, dy, ln2, w->mlp_gate, w->mlp_up,
                              w->mlp_down, N, H, c->dense_intermediate_size, &ws->dense);
    else {
        if (w->sh_gate) /* shared experts: their part of d ln2 into dtmp (free until the norm's backward) */
            fm_dense_mlp_backward(&m->be, ws->dtmp, g->sh_gate, g->sh_up, g->sh_down, dy, ln2, w->sh_gate, w->sh_up,
                                  w->sh_down, N, H, fm_config_shared_width(c), &ws->dense);
        FM_TRY(moe_block_backward(m, l, dy, ln2, scale));
        if (w->sh_gate) OPS->add(CTX, ws->dln, ws->dtmp, N * H);
    }
    /* d x_mid = dy + rmsnorm_bwd(dln) */
    PHASE(DENSE);
    OPS->rmsnorm_bwd(CTX, ws->dtmp, g->ln2, ws->dln, a->x_mid, w->ln2, a->rstd2, N, H);
    OPS->add(CTX, ws->dtmp, dy, N * H);
    fm_act *dxmid = ws->dtmp;
    fm_act *datt = ws->datt ? ws->datt : dy; /* dy is dead from here on */
    if (c->mla) return fm_mla_backward(m, l, dxmid, datt, dx); /* multi-head latent attention (fm_mla.h) */

    /* attention block: x_mid = x + o_proj(attn(rope(qknorm(q,k)), v)) */
    const int32_t *pos = m->a.docs ? m->a.doc_pos : NULL, *kvs = m->a.docs ? m->a.doc_start : NULL; /* packed */
    linear_bwd(m, datt, 0.0f, g->wo, dxmid, a->att, w->wo, N, qd, H);
    if (g->bo) OPS->bias_grad(CTX, g->bo, dxmid, N, H);
    PHASE(ATTENTION);
    if (fm_layer_oss_attention(m, l)) /* gpt_oss: sinks (their gradient too), sliding windows (under --sp too) */
        FM_TRY(fm_layer_oss_attention_bwd(m, l, a, datt, kvs));
    else if (m->mesh.sp > 1) /* Ulysses: the transposed all-to-alls around the attention backward */
        FM_TRY(fm_attn_sp_backward(&m->a.sp_attn, &m->be, ws->dq, ws->dk, ws->dv, datt, a->qr, a->kr, a->v, a->att,
                                   a->lse, kvs));
    else
        OPS->attention_bwd(CTX, ws->dq, ws->dk, ws->dv, datt, a->qr, a->kr, a->v, a->att, a->lse, B, T, nh, nkv, hd,
                           kvs);
    PHASE(DENSE);
    const float *rc, *rs;
    rope_rows(m, &rc, &rs);
    const int64_t rd = fm_config_rotary_dim(c);
    OPS->rope_bwd(CTX, ws->dq, rc, rs, B, T, nh, hd, rd, pos);
    OPS->rope_bwd(CTX, ws->dk, rc, rs, B, T, nkv, hd, rd, pos);
    fm_act *dq = ws->dq, *dk = ws->dk;
    if (c->qk_norm != FM_QK_NORM_NONE) {
        /* datt is free now: reuse it for dq before the norm; dln (free) for dk. */
        const bool ph = c->qk_norm == FM_QK_NORM_PER_HEAD;
        OPS->rmsnorm_bwd(CTX, datt, g->q_norm, ws->dq, a->q, w->q_norm, a->rstd_q, ph ? N * nh : N, ph ? hd : qd);
        OPS->rmsnorm_bwd(CTX, ws->dln, g->k_norm, ws->dk, a->k, w->k_norm, a->rstd_k, ph ? N * nkv : N, ph ? hd : kd);
        dq = datt;
        dk = ws->dln;
    }
    /* d ln1 [N,H]: in the [N,qd] buffer the q gradient no longer needs (dq after the QK-norm
     * backward moved it to datt; datt otherwise), when qd >= H */
    fm_act *dln1 = ws->dln1 ? ws->dln1 : (c->qk_norm != FM_QK_NORM_NONE ? ws->dq : datt);
    if (g->bq) { /* the biases' gradients: the projections' output gradients summed over tokens */
        OPS->bias_grad(CTX, g->bq, dq, N, qd);
        OPS->bias_grad(CTX, g->bk, dk, N, kd);
        OPS->bias_grad(CTX, g->bv, ws->dv, N, kd);
    }
    fm_act *ln1 = dx; /* ln2 is dead: form ln1 again there */
    OPS->rmsnorm_fwd(CTX, ln1, a->rstd1, x, w->ln1, N, H, eps);
    linear_bwd(m, dln1, 0.0f, g->wq, dq, ln1, w->wq, N, H, qd);
    linear_bwd(m, dln1, 1.0f, g->wk, dk, ln1, w->wk, N, H, kd);
    linear_bwd(m, dln1, 1.0f, g->wv, ws->dv, ln1, w->wv, N, H, kd);
    OPS->rmsnorm_bwd(CTX, dx, g->ln1, dln1, x, w->ln1, a->rstd1, N, H);
    OPS->add(CTX, dx, dxmid, N * H);
    return FM_OK;
}
