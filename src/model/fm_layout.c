/* Activation layout (fm_model.h): the arenas of every live set but the model state, laid out once
 * for a (micro-batch, sequence) shape; the same code runs over measuring arenas for the planner,
 * so the bytes planned are the bytes allocated. Also the model-owned live sets' bound formulas. */
#include "fm_model.h"

#include <math.h>
#include <string.h>

#include "../bounded/fm_linear_ce.h"
#include "../bounded/fm_linear_ce_ring.h"
#include "fm_experts.h"
#include "fm_layer_oss.h"
#include "fm_rope.h"
#include "fm_model_internal.h"

/* ------------------------------------------------------------------------------------------ */
/* Activation layout                                                                           */
/* ------------------------------------------------------------------------------------------ */

#define TAKE(arena, type, count) ((type *)fm_arena_alloc((arena), sizeof(type) * (size_t)(count)))

/* One layer's saved set; moe false: a dense layer's, without the router's part. */
static void layout_layer_acts(fm_layer_acts *a, fm_arena *ar, const fm_config *c, int64_t B, int64_t T, bool moe) {
    const int64_t N = B * T, H = c->hidden_size, E = c->num_experts, k = c->num_experts_per_tok;
    const int64_t qd = c->num_attention_heads * c->head_dim, kd = c->num_key_value_heads * c->head_dim;
    a->rstd1 = TAKE(ar, float, N);
    const bool qkn = c->qk_norm != FM_QK_NORM_NONE;
    a->v = TAKE(ar, fm_act, N * kd);
    a->qr = TAKE(ar, fm_act, N * qd);
    a->kr = TAKE(ar, fm_act, N * kd);
    /* Without QK-norm RoPE runs in place on the projections: q, k are qr, kr. */
    a->q = qkn ? TAKE(ar, fm_act, N * qd) : a->qr;
    a->k = qkn ? TAKE(ar, fm_act, N * kd) : a->kr;
    int64_t nq = c->qk_norm == FM_QK_NORM_PER_HEAD ? N * c->num_attention_heads : N;
    int64_t nk = c->qk_norm == FM_QK_NORM_PER_HEAD ? N * c->num_key_value_heads : N;
    a->rstd_q = c->qk_norm != FM_QK_NORM_NONE ? TAKE(ar, float, nq) : NULL;
    a->rstd_k = c->qk_norm != FM_QK_NORM_NONE ? TAKE(ar, float, nk) : NULL;
    a->att = TAKE(ar, fm_act, N * qd);
    a->lse = TAKE(ar, float, B * c->num_attention_heads * T);
    a->x_mid = TAKE(ar, fm_act, N * H);
    a->rstd2 = TAKE(ar, float, N);
    fm_mla_saved_layout(&a->mla, ar, c, N); /* MLA's latents (fm_mla.h; nothing without) */
    memset(&a->router, 0, sizeof a->router);
    if (!moe) return;
    a->router.probs = TAKE(ar, float, N * E);
    a->router.lse = TAKE(ar, float, N);
    a->router.topk_idx = TAKE(ar, int32_t, N * k);
    a->router.topk_w = TAKE(ar, float, N * k);
    a->router.count = TAKE(ar, float, E);
    a->router.prob_sum = TAKE(ar, float, E);
}

static void layout_ws(fm_bwd_ws *w, fm_arena *ar, const fm_config *c, int64_t N) {
    const int64_t H = c->hidden_size, E = c->num_experts, k = c->num_experts_per_tok;
    const int64_t qd = c->num_attention_heads * c->head_dim, kd = c->num_key_value_heads * c->head_dim;
    w->dx_a = TAKE(ar, fm_act, N * H);
    w->dx_b = TAKE(ar, fm_act, N * H);
    w->dtmp = TAKE(ar, fm_act, N * H);
    w->dln = TAKE(ar, fm_act, N * H);
    /* d ln1 gets its own [N,H] only when the free [N,qd] buffer it can use is smaller */
    w->dln1 = qd < H ? TAKE(ar, fm_act, N * H) : NULL;
    w->dq = TAKE(ar, fm_act, N * qd);
    w->dk = TAKE(ar, fm_act, N * kd);
    w->dv = TAKE(ar, fm_act, N * kd);
    w->datt = qd > H ? TAKE(ar, fm_act, N * qd) : NULL;
    w->dtopk_w = TAKE(ar, float, N * k);
    w->dlogits_r = TAKE(ar, float, N * E);
    w->dlogits_act = sizeof(fm_act) == sizeof(float) ? (fm_act *)(void *)w->dlogits_r : TAKE(ar, fm_act, N * E);
    w->dprobs_e = TAKE(ar, float, E);
    fm_mla_ws_layout(&w->mla, ar, c, N); /* MLA's buffers (fm_mla.h; nothing without) */
    memset(&w->dense, 0, sizeof w->dense);
    if (fm_config_dense_ws_width(c) > 0) { /* dense layers' and shared experts' MLP (fm_dense_mlp.h) */
        const int64_t Id = fm_config_dense_ws_width(c); /* the wider of the two: one at a time */
        w->dense.gate = TAKE(ar, fm_act, N * Id);
        w->dense.up = TAKE(ar, fm_act, N * Id);
        w->dense.h = TAKE(ar, fm_act, N * Id);
        w->dense.dgate = TAKE(ar, fm_act, N * Id);
        w->dense.dup = TAKE(ar, fm_act, N * Id);
    }
}

/* Lays out everything but the model state into arenas ar[1..]. Pointer arrays m->a.boundary and
 * m->a.acts must already exist. */
static fm_moe_dims moe_dims(const fm_config *c) {
    fm_moe_dims d = {c->hidden_size, c->moe_intermediate_size, c->num_experts, c->num_experts_per_tok};
    d.swiglu_limit = (float)c->swiglu_limit; /* gpt_oss's clamped SwiGLU; 0 elsewhere */
    d.swiglu_alpha = (float)c->swiglu_alpha;
    d.bias = c->expert_bias; /* gpt_oss's experts' biases */
    return d;
}

/* Ring-DTP's scratch for training calls (dh and dW wanted, no token weights or entropy) with
 * this rank's N as the group's largest count, in the mode AUTO picks. */
static size_t ring_scratch_bytes(const fm_config *c, int64_t N, int64_t block_tokens, int64_t block_vocab, int P,
                                 size_t a) {
    fm_lce_opts lo = fm_lce_opts_default();
    lo.block_tokens = block_tokens;
    lo.block_vocab = block_vocab;
    return fm_linear_ce_ring_bound_bytes_a(FM_LCE_RING_AUTO, N, c->hidden_size, c->vocab_size, P, true, true, &lo, a);
}

static void layout_all(fm_model *m, fm_arena *ar, fm_arena *host) {
    const fm_config *c = &m->cfg;
    const int64_t L = c->num_hidden_layers, N = m->a.N, H = c->hidden_size, hd = c->head_dim;
    fm_arena *bnd = &ar[FM_LIVE_BOUNDARIES], *acts = &ar[FM_LIVE_LAYER_ACTS],
             *ws = &ar[FM_LIVE_WORKING_SET], *voc = &ar[FM_LIVE_VOCAB], *ex = &ar[FM_LIVE_EXPERT];
    fm_moe_dims md = moe_dims(c);
    md.fp8 = m->a.moe_fp8;
    md.fp8_codes = m->a.moe_fp8_codes; /* (the path's own bytes, as planned: fm_moe_ws_bytes) */
    md.fp8_cache_layers = m->a.opts.expert_fp8_cache ? fm_config_num_moe_layers(c) : 0; /* a set per MoE layer */
    const bool chunked = m->a.moe_chunk_tokens > 0;
    int64_t c_eff;
    fm_moe_chunks(N, m->a.moe_chunk_tokens, &m->a.moe_K, &c_eff);
    m->a.tokens = TAKE(bnd, int32_t, N);
    m->a.targets = TAKE(bnd, int32_t, N);
    m->a.results = TAKE(bnd, double, fm_model_results_count(c));
    m->a.pin_tokens = TAKE(host, int32_t, N);
    m->a.pin_targets = TAKE(host, int32_t, N);
    m->a.pin_results = TAKE(host, double, fm_model_results_count(c));
    const int64_t Tf = m->a.T * (m->mesh.sp > 1 ? m->mesh.sp : 1); /* whole rows under sp (packed positions) */
    const int64_t rhalf = fm_config_rotary_dim(c) / 2; /* partial rotary: rotary_dim / 2 columns */
    m->a.rope_cos = TAKE(bnd, float, Tf * rhalf);
    m->a.rope_sin = TAKE(bnd, float, Tf * rhalf);
    m->a.moe_chunk_order = chunked ? TAKE(bnd, int32_t, N) : NULL;
    m->a.doc_pos = TAKE(bnd, int32_t, N); /* packed documents (fm_batch.h): taken whatever the data */
    /* attention's document starts: whole rows [B, sp T] under sequence parallelism (fm_attn_sp.h) */
    const int64_t Nf = N * (m->mesh.sp > 1 ? m->mesh.sp : 1);
    m->a.doc_start = TAKE(bnd, int32_t, Nf);
    m->a.pin_doc_pos = TAKE(host, int32_t, N);
    m->a.pin_doc_start = TAKE(host, int32_t, Nf);
    /* Offloaded boundaries 0 .. n_off-1 rotate through slots 0 and 1 (taken where boundaries 0
     * and 1 would be); with n_off = 0 this is the plain L+1 tensors, in the same order. */
    const int64_t n_off = m->a.n_offloaded_boundaries;
    for (int64_t l = 0; l <= L; l++)
        m->a.boundary[l] = l < n_off && l >= 2 ? m->a.boundary[l % 2] : TAKE(bnd, fm_act, N * H);
    /* the recomputed layers share one set: an MoE layer's when any of them is MoE, else a dense
     * layer's (fm_model_saved_sets) */
    fm_layer_acts shared;
    bool any_recompute = false, shared_moe = false;
    for (int64_t l = 0; l < L; l++) {
        any_recompute |= m->a.recompute[l];
        shared_moe |= m->a.recompute[l] && fm_config_layer_is_moe(c, l);
    }
    if (any_recompute) {
        layout_layer_acts(&shared, acts, c, m->a.B, m->a.T, shared_moe);
        memset(&shared.moe, 0, sizeof shared.moe);
        if (!chunked && shared_moe) fm_moe_routes_layout(&shared.moe, ex, host, &md, N);
    }
    for (int64_t l = 0; l < L; l++) {
        const bool moe = fm_config_layer_is_moe(c, l);
        if (m->a.recompute[l]) {
            m->a.acts[l] = shared;
            if (m->a.keep_attention[l]) { /* keep-attention: its own att and lse, kept to backward */
                m->a.acts[l].att = TAKE(acts, fm_act, N * c->num_attention_heads * hd);
                m->a.acts[l].lse = TAKE(acts, float, m->a.B * c->num_attention_heads * m->a.T);
            }
            continue;
        }
        layout_layer_acts(&m->a.acts[l], acts, c, m->a.B, m->a.T, moe);
        memset(&m->a.acts[l].moe, 0, sizeof m->a.acts[l].moe);
        if (!chunked && moe) fm_moe_routes_layout(&m->a.acts[l].moe, ex, host, &md, N);
    }
    if (m->p.ep > 1) { /* expert parallelism: the EP operator's chunk working set (its bound) */
        memset(&m->a.moe_ws, 0, sizeof m->a.moe_ws);
        fm_status st = fm_moe_ep_ws_layout(&m->a.moe_ep_ws, ex, host, &md, m->p.ep, m->p.ep_rank, c_eff, &m->mesh.moe_llep);
        FM_ASSERT(st == FM_OK); /* checked by fm_model_layout before */
    } else {
        fm_moe_ws_layout(&m->a.moe_ws, ex, host, &md, chunked ? c_eff : N, chunked);
    }
    layout_ws(&m->a.ws, ws, c, N);
    /* Ulysses sequence parallelism: the head-sharded attention buffers, in the working set */
    const fm_attn_sp_dims sd = {m->a.B, m->a.T, c->num_attention_heads, c->num_key_value_heads, hd, m->mesh.sp > 1 ? m->mesh.sp : 1};
    fm_attn_sp_layout(&m->a.sp_attn, ws, &sd);
    m->a.xf = TAKE(voc, fm_act, N * H);
    m->a.rstd_f = TAKE(voc, float, N);
    m->a.logits = m->a.linear_ce ? NULL : TAKE(voc, fm_act, N * c->vocab_size);
    m->a.token_loss = TAKE(voc, float, N);
    const bool rl = m->a.opts.rl_head && m->a.linear_ce && m->mesh.vocab_P <= 1;
    m->a.rl_weight = rl ? TAKE(voc, float, N) : NULL; /* the RL head's per-token weights and entropies */
    m->a.rl_entropy = rl ? TAKE(voc, float, N) : NULL;
    m->a.rl_ent_weight = rl ? TAKE(voc, float, N) : NULL; /* the entropy bonus's per-token weights */
    const int64_t rl_route_n = fm_config_num_moe_layers(c) * N * c->num_experts_per_tok;
    m->a.rl_routes = rl && rl_route_n > 0 ? TAKE(voc, int32_t, rl_route_n) : NULL; /* routes taken / replayed */
    const int64_t rl_topk = rl ? m->a.opts.rl_topk : 0;
    m->a.rl_topk_lp = rl_topk > 0 ? TAKE(voc, float, N * rl_topk) : NULL; /* the top-k log-probs and ids */
    m->a.rl_topk_id = rl_topk > 0 ? TAKE(voc, int32_t, N * rl_topk) : NULL;
    if (m->a.linear_ce) { /* the operator's strip (Ring-DTP: its messages too): carved and released inside each call */
        /* one rank: blocks clamped to N x V as the call clamps them, no entropy vector: what the call takes */
        size_t strip = m->mesh.vocab_P > 1 ? ring_scratch_bytes(c, N, m->a.ce_block_tokens, m->a.ce_block_vocab, m->mesh.vocab_P,
                                                           sizeof(fm_act))
                                      : fm_linear_ce_call_bytes_a(m->a.ce_block_tokens, m->a.ce_block_vocab, N,
                                                                  c->vocab_size, rl, sizeof(fm_act)) +
                                            fm_linear_ce_topk_bytes(m->a.ce_block_tokens, N, rl_topk);
        if (fm_arena_is_measure(voc)) { /* the real arena was sized from this measurement */
            voc->used += strip;
            if (voc->used > voc->high) voc->high = voc->used;
        }
    }
}

/* ---- bound formulas of the model-owned live sets (the planner's; test_plan checks them
 * against the layout above, measured) ---------------------------------------------------------- */

#define B4(x) fm_arena_round((size_t)(x) * 4)
#define BA(x) fm_arena_round((size_t)(x) * a)

int64_t fm_model_boundary_tensors(int64_t L, int64_t n_off) {
    return L + 1 - n_off + (n_off < 2 ? n_off : 2);
}

size_t fm_model_boundary_bytes_chunked(const fm_config *c, int64_t B, int64_t T, bool moe_chunked, size_t a) {
    return fm_model_boundary_bytes_n(c, B, T, moe_chunked, c->num_hidden_layers + 1, a);
}

size_t fm_model_boundary_bytes_n(const fm_config *c, int64_t B, int64_t T, bool moe_chunked, int64_t n_tensors,
                                 size_t a) {
    return fm_model_boundary_bytes_sp(c, B, T, 1, moe_chunked, n_tensors, a);
}

size_t fm_model_boundary_bytes_sp(const fm_config *c, int64_t B, int64_t T, int64_t sp, bool moe_chunked,
                                  int64_t n_tensors, size_t a) {
    const int64_t N = B * T, Tf = T * (sp > 1 ? sp : 1);
    /* tokens, targets, the packed documents' positions [N] and starts [B, sp T] (fm_batch.h: the
     * whole rows' under sequence parallelism; laid out whether or not the data is packed:
     * packing never changes the bound), the micro-batch's device results (4 + 2L doubles), RoPE
     * cos/sin [sp T, rd/2] (whole rows; rd = fm_config_rotary_dim), the chunked MoE's token order [N] int32, n_tensors
     * residual-stream tensors [N,H] */
    return 3 * B4(N) + B4(B * Tf) + fm_arena_round((size_t)fm_model_results_count(c) * 8) +
           2 * B4(Tf * (fm_config_rotary_dim(c) / 2)) + (moe_chunked ? B4(N) : 0) + (size_t)n_tensors * BA(N * c->hidden_size);
}

size_t fm_model_layer_acts_bytes(const fm_config *c, int64_t B, int64_t T, size_t a) {
    const int64_t N = B * T, H = c->hidden_size, E = c->num_experts, k = c->num_experts_per_tok;
    const int64_t nh = c->num_attention_heads, nkv = c->num_key_value_heads;
    const int64_t qd = nh * c->head_dim, kd = nkv * c->head_dim;
    size_t b = B4(N)                              /* rstd1 (ln1 itself is formed again in backward) */
             + BA(N * kd) + BA(N * qd) + BA(N * kd) /* v, q and k after QK-norm + RoPE */
             + BA(N * qd) + B4(B * nh * T)        /* attention output, its log-sum-exp */
             + BA(N * H) + B4(N)                  /* x_mid, rstd2 (ln2: as ln1) */
             + B4(N * E) + B4(N)                  /* router probs, lse */
             + 2 * B4(N * k) + 2 * B4(E);         /* top-k ids and weights, expert stats */
    if (c->qk_norm == FM_QK_NORM_PER_HEAD) b += BA(N * qd) + BA(N * kd) + B4(N * nh) + B4(N * nkv);
    if (c->qk_norm == FM_QK_NORM_FULL) b += BA(N * qd) + BA(N * kd) + 2 * B4(N);
    return b + fm_mla_saved_bytes(c, N, a); /* MLA's latents (0 without) */
}

size_t fm_model_dense_layer_acts_bytes(const fm_config *c, int64_t B, int64_t T, size_t a) {
    const int64_t N = B * T, E = c->num_experts, k = c->num_experts_per_tok;
    /* the MoE layer's set less the router's: probs, lse, top-k ids and weights, expert stats */
    return fm_model_layer_acts_bytes(c, B, T, a) - (B4(N * E) + B4(N) + 2 * B4(N * k) + 2 * B4(E));
}

void fm_model_saved_sets(const fm_config *c, const bool *recompute, int64_t *n_moe, int64_t *n_dense) {
    bool any = false, shared_moe = false;
    *n_moe = *n_dense = 0;
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        const bool moe = fm_config_layer_is_moe(c, l), rc = recompute && recompute[l];
        any |= rc;
        shared_moe |= rc && moe;
        if (!rc) *(moe ? n_moe : n_dense) += 1;
    }
    if (any) *(shared_moe ? n_moe : n_dense) += 1;
}

size_t fm_model_kept_attention_bytes(const fm_config *c, int64_t B, int64_t T, size_t a) {
    const int64_t nh = c->num_attention_heads;
    return BA(B * T * nh * c->head_dim) + B4(B * nh * T); /* att, its log-sum-exp */
}

size_t fm_model_working_set_bytes(const fm_config *c, int64_t N, size_t a) {
    const int64_t H = c->hidden_size, E = c->num_experts, k = c->num_experts_per_tok;
    const int64_t qd = c->num_attention_heads * c->head_dim, kd = c->num_key_value_heads * c->head_dim;
    /* dx ping-pong, dtmp, dln [N,H] (+ dln1 when qd < H); dq, dk, dv (+ datt when qd > H, else
     * it reuses the incoming-gradient buffer); dtopk_w; router logits/grad (fp32, + an fm_act
     * copy when fm_act is not fp32); dprobs */
    /* + with dense layers or shared experts, their MLP's five [N, Id] buffers (fm_dense_mlp.h; Id
     * the wider, fm_config_dense_ws_width: one MLP runs at a time) */
    const int64_t Id = fm_config_dense_ws_width(c);
    return (qd < H ? 5 : 4) * BA(N * H) + (qd > H ? 2 : 1) * BA(N * qd) + 2 * BA(N * kd) + B4(N * k) + B4(N * E) +
           (a == sizeof(float) ? 0 : BA(N * E)) + B4(E) +
           (Id > 0 ? FM_DENSE_MLP_WS_BUFFERS * BA(N * Id) : 0) + fm_mla_ws_bytes(c, N, a); /* MLA's (0 without) */
}

size_t fm_model_vocab_plain_bytes(const fm_config *c, int64_t N, size_t a) {
    /* final-norm output [N,H] and rstd, logits [N,V] (their gradient in place), per-token loss */
    return BA(N * c->hidden_size) + B4(N) + BA(N * c->vocab_size) + B4(N);
}

size_t fm_model_vocab_linear_bytes(const fm_config *c, int64_t N, int64_t block_tokens, int64_t block_vocab,
                                   size_t a) {
    return BA(N * c->hidden_size) + 2 * B4(N) + fm_linear_ce_call_bytes_a(block_tokens, block_vocab, N, c->vocab_size,
                                                                          false, a);
}

size_t fm_model_vocab_rl_bytes(const fm_config *c, int64_t N, int64_t block_tokens, int64_t block_vocab, int64_t topk,
                               size_t a) {
    /* rl_weight, rl_entropy and rl_ent_weight [N] fp32, the routes [L_moe, N, k] int32 (routes taken, routing
     * replay), the top-K log-probs and ids [N, K] and the call's running top-K, and the linear CE
     * call's entropy state (the call with the entropy less the call without) */
    const int64_t route_n = fm_config_num_moe_layers(c) * N * c->num_experts_per_tok;
    const size_t tk = topk > 0 ? 2 * B4(N * topk) + fm_linear_ce_topk_bytes(block_tokens, N, topk) : 0;
    return 3 * B4(N) + (route_n > 0 ? B4(route_n) : 0) + tk + fm_linear_ce_call_bytes_a(block_tokens, block_vocab, N, c->vocab_size, true, a) -
           fm_linear_ce_call_bytes_a(block_tokens, block_vocab, N, c->vocab_size, false, a);
}

size_t fm_model_vocab_ring_bytes(const fm_config *c, int64_t N, int64_t block_tokens, int64_t block_vocab, int P,
                                 size_t a) {
    return BA(N * c->hidden_size) + 2 * B4(N) + ring_scratch_bytes(c, N, block_tokens, block_vocab, P, a);
}

void fm_model_free_layout(fm_model *m) {
    fm_attn_sp_free(&m->a.sp_attn);
    for (int i = 1; i < FM_LIVE_COUNT; i++) fm_arena_free(&m->a.arena[i]);
    fm_arena_free(&m->a.host_arena);
    fm_free(m->a.boundary);
    fm_free(m->a.moe_fp8_fresh);
    m->a.moe_fp8_fresh = NULL;
    fm_free(m->a.acts);
    m->a.boundary = NULL;
    m->a.acts = NULL;
}

static void plan_bytes(const fm_config *cfg, int64_t B, int64_t T, const fm_layout_opts *opts,
                       size_t bytes[FM_LIVE_COUNT], size_t *host_bytes) {
    const bool *recompute = opts ? opts->recompute : NULL;
    const int64_t L = cfg->num_hidden_layers;
    fm_model m;
    memset(&m, 0, sizeof m);
    m.cfg = *cfg;
    if (opts) m.a.opts = *opts; /* what layout_all reads through m->a.opts, resolved below */
    m.a.B = B; m.a.T = T; m.a.N = B * T;
    m.a.moe_chunk_tokens = opts ? opts->moe_chunk_tokens : 0;
    m.a.linear_ce = opts && (opts->ce_block_tokens > 0 || opts->ce_block_vocab > 0);
    m.a.ce_block_tokens = opts ? opts->ce_block_tokens : 0;
    m.a.ce_block_vocab = opts ? opts->ce_block_vocab : 0;
    m.a.n_offloaded_boundaries = opts ? opts->n_offloaded_boundaries : 0;
    m.mesh.sp = opts && opts->sp > 1 ? (int)opts->sp : 1;
    m.mesh.vocab_P = opts && opts->vocab_ring > 1 ? opts->vocab_ring : 0;
    m.p.ep = opts && opts->ep > 1 ? opts->ep : 1;
    m.a.moe_fp8 = opts && opts->expert_fp8;
    m.a.moe_fp8_codes = m.a.moe_fp8 && opts->expert_fp8_codes;
    m.a.opts.expert_fp8_cache = m.a.moe_fp8_codes && opts->expert_fp8_cache;
    m.p.ep_rank = opts && opts->ep > 1 ? opts->ep_rank : 0;
    if (opts && opts->ep > 1 && opts->llep) m.mesh.moe_llep = *opts->llep;
    bool *rc = fm_malloc((size_t)(2 * L + 1));
    fm_act **bp = fm_malloc(sizeof(fm_act *) * (size_t)(L + 1));
    fm_layer_acts *la = fm_malloc(sizeof(fm_layer_acts) * (size_t)(L + 1));
    FM_ASSERT(rc && bp && la); /* a few bytes per layer; the config's layer count is bounded */
    const bool *keep = opts ? opts->keep_attention : NULL;
    for (int64_t l = 0; l < L; l++) rc[l] = recompute ? recompute[l] : false;
    for (int64_t l = 0; l < L; l++) rc[L + l] = rc[l] && keep && keep[l];
    m.a.recompute = rc;
    m.a.keep_attention = rc + L;
    m.a.boundary = bp;
    m.a.acts = la;
    fm_arena ar[FM_LIVE_COUNT], host;
    for (int i = 0; i < FM_LIVE_COUNT; i++) fm_arena_init_measure(&ar[i], fm_live_set_names[i]);
    fm_arena_init_measure(&host, "host");
    layout_all(&m, ar, &host);
    if (host_bytes) *host_bytes = host.used;
    bytes[FM_LIVE_MODEL_STATE] = 0; /* the parameter store's and the optimizer's (train/fm_param_store.h) */
    for (int i = 1; i < FM_LIVE_COUNT; i++) bytes[i] = ar[i].used;
    fm_free(rc);
    fm_free(bp);
    fm_free(la);
}

void fm_model_plan_bytes(const fm_config *cfg, int64_t B, int64_t T, const fm_layout_opts *opts,
                         size_t bytes[FM_LIVE_COUNT]) {
    plan_bytes(cfg, B, T, opts, bytes, NULL);
}

/* Ring-DTP over P ranks (P <= 1: off): the communicator's size, the linear CE, this rank's shard. */
static fm_status vocab_ring_setup(fm_model *m, int P) {
    m->mesh.vocab_P = 0;
    m->mesh.vocab_rank = 0;
    m->mesh.vocab_first = 0;
    m->mesh.vocab_rows = m->cfg.vocab_size;
    if (P <= 1) return FM_OK;
    if (!m->a.linear_ce)
        return fm_error(FM_ERR_ARG, "--vocab-parallel ring: the ring is the linear cross-entropy, but the layout has plain "
                        "logits (--ce-block-tokens 0 --ce-block-vocab 0); give blocks > 0 or leave both flags out");
    if (!m->mesh.vocab_comm || fm_comm_size(m->mesh.vocab_comm) != P)
        return fm_error(FM_ERR_ARG, "--vocab-parallel ring over %d ranks: the model's ring communicator (m->mesh.vocab_comm) "
                        "has %d ranks; set it to the world before fm_model_layout", P,
                        m->mesh.vocab_comm ? fm_comm_size(m->mesh.vocab_comm) : 0);
    if (P > FM_LCE_RING_MAX_RANKS)
        return fm_error(FM_ERR_ARG, "--vocab-parallel ring over %d ranks: the ring takes at most %d; launch fewer ranks or "
                        "drop the flag", P, FM_LCE_RING_MAX_RANKS);
    m->mesh.vocab_P = P;
    m->mesh.vocab_rank = fm_comm_rank(m->mesh.vocab_comm);
    fm_lce_ring_shard(m->cfg.vocab_size, P, m->mesh.vocab_rank, &m->mesh.vocab_first, &m->mesh.vocab_rows);
    return FM_OK;
}

fm_status fm_model_layout(fm_model *m, int64_t B, int64_t T, const fm_layout_opts *opts) {
    const bool *recompute = opts ? opts->recompute : NULL;
    const fm_config *c = &m->cfg;
    const int64_t L = c->num_hidden_layers;
    const int64_t sp = opts && opts->sp > 1 ? opts->sp : 1;
    if (sp > 1) { /* Ulysses: T is this rank's slice; the sp group is the caller's */
        FM_TRY(fm_attn_sp_check(c, sp, sp * T));
        if (!m->mesh.sp_comm || fm_comm_size(m->mesh.sp_comm) != sp)
            return fm_error(FM_ERR_ARG, "sequence parallelism over %lld ranks: the model's sp group (m->mesh.sp_comm) has %d "
                            "ranks; set it to the mesh's sp communicator before fm_model_layout", (long long)sp,
                            m->mesh.sp_comm ? fm_comm_size(m->mesh.sp_comm) : 0);
    }
    if (sp * T > c->max_position_embeddings)
        return fm_error(FM_ERR_ARG, "a sequence of %lld tokens (--seq-len) exceeds the model's max_position_embeddings "
                        "(%lld); use at most %lld", (long long)(sp * T), (long long)c->max_position_embeddings,
                        (long long)c->max_position_embeddings);
    if (T > c->max_position_embeddings)
        return fm_error(FM_ERR_ARG, "a sequence of %lld tokens (--seq-len, or sample's --context) exceeds the model's "
                        "max_position_embeddings (%lld); use at most %lld", (long long)T,
                        (long long)c->max_position_embeddings, (long long)c->max_position_embeddings);
    if (B < 1 || T < 1)
        return fm_error(FM_ERR_ARG, "--micro-batch (%lld) and --seq-len (%lld) must be >= 1", (long long)B,
                        (long long)T);
    fm_model_free_layout(m);
    m->a.B = m->a.B_cap = B;
    m->a.T = m->a.T_cap = T;
    m->a.N = B * T;
    if (opts && opts->moe_chunk_tokens < 0)
        return fm_error(FM_ERR_ARG, "--moe-chunk-tokens must be >= 0 (0 = unchunked), found %lld",
                        (long long)opts->moe_chunk_tokens);
    for (int64_t l = 0; l < L; l++) m->a.recompute[l] = recompute ? recompute[l] : false;
    for (int64_t l = 0; l < L; l++)
        m->a.keep_attention[l] = m->a.recompute[l] && opts && opts->keep_attention && opts->keep_attention[l];
    if (opts && (opts->ce_block_tokens < 0 || opts->ce_block_vocab < 0))
        return fm_error(FM_ERR_ARG, "--ce-block-tokens and --ce-block-vocab must be >= 0");
    m->a.moe_chunk_tokens = opts ? opts->moe_chunk_tokens : 0;
    m->a.moe_fp8 = opts && opts->expert_fp8;
    FM_TRY(fm_layer_oss_check(m, sp, m->a.moe_fp8)); /* gpt_oss: its ops, no --sp or fp8 yet */
    m->a.linear_ce = opts && (opts->ce_block_tokens > 0 || opts->ce_block_vocab > 0);
    m->a.ce_block_tokens = opts ? opts->ce_block_tokens : 0;
    m->a.ce_block_vocab = opts ? opts->ce_block_vocab : 0;
    if (opts && (opts->n_offloaded_boundaries < 0 || opts->n_offloaded_boundaries > L))
        return fm_error(FM_ERR_ARG, "--offload-boundaries: found %lld; expected 0 .. %lld (the model's layers; "
                        "boundary %lld, the head's input, stays on the device)",
                        (long long)opts->n_offloaded_boundaries, (long long)L, (long long)L);
    m->a.n_offloaded_boundaries = opts ? opts->n_offloaded_boundaries : 0;
    const int ep = opts && opts->ep > 1 ? opts->ep : 1;
    if (ep != m->p.ep || (ep > 1 && opts->ep_rank != m->p.ep_rank))
        return fm_error(FM_ERR_ARG, "layout for --ep %d (rank %d) of a model created for ep %d (rank %d): create it "
                        "with fm_model_create_ep", ep, opts ? opts->ep_rank : 0, m->p.ep, m->p.ep_rank);
    if (ep > 1) {
        memset(&m->mesh.moe_llep, 0, sizeof m->mesh.moe_llep);
        if (opts->llep) m->mesh.moe_llep = *opts->llep;
        const fm_moe_dims md = moe_dims(c);
        if (m->a.moe_chunk_tokens <= 0)
            return fm_error(FM_ERR_ARG, "--ep %d needs a token cap per chunk (--ep-cap-tokens >= 1), found %lld", ep,
                            (long long)m->a.moe_chunk_tokens);
        FM_TRY(fm_moe_ep_check(&md, ep, m->a.moe_chunk_tokens));
    }
    m->mesh.sp = (int)sp;
    m->mesh.sp_rank = sp > 1 ? fm_comm_rank(m->mesh.sp_comm) : 0;
    { /* sync-free experts: the backend's own choice for this shape (not beside --ep, whose
       * all-to-all needs the counts on the host anyway) */
        int64_t K, c_eff;
        fm_moe_chunks(m->a.N, m->a.moe_chunk_tokens, &K, &c_eff);
        const int64_t rows_max = c_eff * c->num_experts_per_tok;
        /* fp8: the fast path on E4M3 codes when the caller asks (train asks where the backend
         * serves the shape: fm_backend_fp8_codes_serves); its ops read the offsets on the device,
         * so the dispatch is sync-free where the backend adds the expert-load counts there too */
        m->a.moe_fp8_codes = m->a.moe_fp8 && opts->expert_fp8_codes;
        m->a.opts.expert_fp8_cache = m->a.moe_fp8_codes && opts->expert_fp8_cache; /* resolved */
        if (opts && opts->expert_fp8_cache && !m->a.moe_fp8_codes)
            return fm_error(FM_ERR_ARG, "--fp8-weight-cache keeps the E4M3 weight codes of --expert-precision fp8's fast "
                            "path, but this run's experts %s; drop --fp8-weight-cache",
                            m->a.moe_fp8 ? "run the fp8 emulation (no E4M3 codes here)" : "are not fp8");
        /* the experts' precision must serve this backend and shape (fm_moe_experts.serves): on one
         * rank over dispatches of rows_max rows; under --ep at the owner over its E/ep experts and
         * the R_max rows it may receive (fm_moe_ep_bound) */
        fm_moe_dims ed = moe_dims(c);
        ed.fp8 = m->a.moe_fp8;
        ed.fp8_codes = m->a.moe_fp8_codes;
        int64_t ex_rows = rows_max;
        if (ep > 1) {
            ed = fm_moe_ep_local_dims(&ed, ep);
            const int64_t k = c->num_experts_per_tok;
            ex_rows = (int64_t)ep * c_eff * (k < ed.E ? k : ed.E);
        }
        FM_TRY(fm_experts_select(&ed)->serves(&m->be, &ed, ex_rows, ep, ep > 1 && m->mesh.moe_llep.on));
        if (m->a.moe_fp8) /* sync-free where the codes' ops read the offsets on the device (not under
                         * --ep: the all-to-all needs the counts on the host) */
            m->a.moe_sync_free = ep == 1 && m->a.moe_fp8_codes && m->be.ops->moe_count_add != NULL;
        else
            m->a.moe_sync_free = ep == 1 && !c->expert_bias && m->be.ops->expert_sync_free && /* gpt_oss's
                               * per-expert biases read the host offsets (fm_experts.c) */
                               m->be.ops->expert_sync_free(m->be.ctx, c->num_experts, c->hidden_size,
                                                           c->moe_intermediate_size, rows_max);
    }
    FM_TRY(vocab_ring_setup(m, opts ? opts->vocab_ring : 0));
    fm_layout_opts o = opts ? *opts : (fm_layout_opts){0}; /* as given (a knob read only through
                                                               m->a.opts needs no line here) */
    o.recompute = m->a.recompute; /* ... with the model's own copies and the resolved values: */
    o.moe_chunk_tokens = m->a.moe_chunk_tokens;
    o.ce_block_tokens = m->a.ce_block_tokens;
    o.ce_block_vocab = m->a.ce_block_vocab;
    o.n_offloaded_boundaries = m->a.n_offloaded_boundaries;
    o.keep_attention = m->a.keep_attention;
    o.ep = ep;
    o.ep_rank = m->p.ep_rank;
    o.llep = &m->mesh.moe_llep;
    o.sp = sp;
    o.vocab_ring = m->mesh.vocab_P;
    o.expert_fp8 = m->a.moe_fp8;
    o.expert_fp8_codes = m->a.moe_fp8_codes;
    o.expert_fp8_cache = m->a.opts.expert_fp8_cache;
    m->a.opts = o; /* as laid out: its pointers are the model's own (fm_acts.h) */
    size_t bytes[FM_LIVE_COUNT];
    size_t host_bytes = 0;
    plan_bytes(c, B, T, &o, bytes, &host_bytes);
    fm_status st;
    m->a.boundary = fm_malloc(sizeof(fm_act *) * (size_t)(L + 1));
    m->a.acts = fm_malloc(sizeof(fm_layer_acts) * (size_t)L);
    if (!m->a.boundary || !m->a.acts) {
        fm_model_free_layout(m);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the layer tables");
    }
    for (int i = 1; i < FM_LIVE_COUNT; i++) {
        st = fm_arena_init_backend(&m->a.arena[i], fm_live_set_names[i], bytes[i], &m->be);
        if (st) {
            fm_model_free_layout(m);
            return fm_error(FM_ERR_NOMEM, "memory: cannot allocate %.3f GiB for the %s live set at "
                            "micro-batch %lld x sequence %lld; lower one of them (train: or recompute more layers)",
                            bytes[i] / 1073741824.0, fm_live_set_names[i], (long long)B, (long long)T);
        }
    }
    /* Painted before anything is written, so fm_arena_touched measures what the run writes (the
     * RoPE tables and the chunk order below are the first writes). One memset per arena, at launch. */
    for (int i = 1; i < FM_LIVE_COUNT; i++) fm_arena_paint(&m->a.arena[i]);
    st = fm_arena_init_backend_kind(&m->a.host_arena, "pinned host", host_bytes, &m->be, FM_BUFFER_PINNED);
    if (st) {
        fm_model_free_layout(m);
        return st;
    }
    layout_all(m, m->a.arena, &m->a.host_arena);
    fm_free(m->a.moe_fp8_fresh);
    m->a.moe_fp8_fresh = NULL;
    if (m->a.opts.expert_fp8_cache) { /* every layer's codes stale until its first use */
        m->a.moe_fp8_fresh = fm_malloc(sizeof(bool) * (size_t)L);
        FM_ASSERT(m->a.moe_fp8_fresh); /* L bytes, at layout */
        memset(m->a.moe_fp8_fresh, 0, sizeof(bool) * (size_t)L);
        m->a.moe_ws.w8_fresh = m->a.moe_fp8_fresh;
        m->a.moe_ep_ws.exp_ws.w8_fresh = m->a.moe_fp8_fresh; /* (under --ep: the owner's sets) */
    }
    st = fm_attn_sp_init(&m->a.sp_attn, &m->be, m->mesh.sp_comm);
    if (st) {
        fm_model_free_layout(m);
        return st;
    }
    fm_free(m->a.moe_ep_counts_host);
    m->a.moe_ep_counts_host = NULL;
    if (m->p.ep > 1 && !m->be.ops->host_memory) { /* the expert-load counts' host copy of top-k ids */
        m->a.moe_ep_counts_host = fm_malloc(sizeof(int32_t) * (size_t)(m->a.N * c->num_experts_per_tok));
        if (!m->a.moe_ep_counts_host) {
            fm_model_free_layout(m);
            return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the expert-load counts' staging");
        }
    }
    /* RoPE tables (model/fm_rope.h; default: inv_freq[i] = theta^(-2i/rd); angle = t * inv_freq[i]), in double, made on
     * the host and uploaded; and the chunked MoE's token order. Sequence parallelism: row t of the
     * tables is global position t of the whole row [0, sp T) (a packed document's positions
     * reach past this rank's slice); unpacked, a rank reads rows sp_rank T + t (fm_layer.c). */
    const int64_t half = fm_config_rotary_dim(c) / 2, Tf = T * (m->mesh.sp > 1 ? m->mesh.sp : 1);
    float *tab = fm_malloc(sizeof(float) * (size_t)(2 * Tf * half + 1));
    int32_t *order = m->a.moe_chunk_order ? fm_malloc(sizeof(int32_t) * (size_t)m->a.N) : NULL;
    if (!tab || (m->a.moe_chunk_order && !order)) {
        fm_free(tab);
        fm_model_free_layout(m);
        return fm_error(FM_ERR_NOMEM, "memory: cannot stage the RoPE tables");
    }
    fm_rope_tables_host(c, Tf, tab, tab + Tf * half); /* default, linear or YaRN (model/fm_rope.h) */
    m->be.ops->copy(m->be.ctx, m->a.rope_cos, tab, sizeof(float) * (size_t)(Tf * half), FM_COPY_H2D);
    m->be.ops->copy(m->be.ctx, m->a.rope_sin, tab + Tf * half, sizeof(float) * (size_t)(Tf * half), FM_COPY_H2D);
    fm_free(tab);
    if (order) {
        fm_moe_chunk_order(order, m->a.N, m->a.moe_K);
        m->be.ops->copy(m->be.ctx, m->a.moe_chunk_order, order, sizeof(int32_t) * (size_t)m->a.N, FM_COPY_H2D);
        fm_free(order);
    }
    return FM_OK;
}

