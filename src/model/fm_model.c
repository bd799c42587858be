#include "fm_model.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "../bounded/fm_linear_ce.h"
#include "../core/fm_rng.h"

const char *const fm_live_set_names[FM_LIVE_COUNT] = {
    "model state", "checkpoint boundaries", "layer activations", "expert dispatch",
    "layer working set", "vocabulary projection",
};

/* ------------------------------------------------------------------------------------------ */
/* Parameter table                                                                             */
/* ------------------------------------------------------------------------------------------ */

typedef struct table_builder {
    fm_param *t;     /* NULL: count only */
    int n;
    int64_t offset;
} table_builder;

static int64_t add_param(table_builder *b, bool decay, int ndim, int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

static int64_t add_param(table_builder *b, bool decay, int ndim, int64_t d0, int64_t d1, const char *fmt, ...) {
    int64_t off = b->offset;
    int64_t numel = ndim == 1 ? d0 : d0 * d1;
    if (b->t) {
        fm_param *p = &b->t[b->n];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(p->name, sizeof p->name, fmt, ap);
        va_end(ap);
        p->ndim = ndim;
        p->shape[0] = d0;
        p->shape[1] = ndim == 2 ? d1 : 0;
        p->offset = off;
        p->numel = numel;
        p->decay = decay;
    }
    b->n++;
    b->offset += numel;
    return off;
}

/* Offsets (in elements) of one layer's tensors within the flat buffer. */
typedef struct layer_offsets {
    int64_t ln1, wq, wk, wv, wo, q_norm, k_norm, ln2, router, w_gate, w_up, w_down;
} layer_offsets;

/* Fills the table (or counts it when b->t is NULL) and the offsets. The order is the flat
 * buffer's order. */
static void build_table(const fm_config *c, table_builder *b, int64_t *o_embed, int64_t *o_norm,
                        int64_t *o_head, layer_offsets *lo) {
    const int64_t H = c->hidden_size, V = c->vocab_size, I = c->moe_intermediate_size, E = c->num_experts;
    const int64_t nh = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim;
    const bool mixtral = c->model_type == FM_MODEL_MIXTRAL;
    const char *moe = mixtral ? "block_sparse_moe" : "mlp";
    const char *n_gate = mixtral ? "w1" : "gate_proj", *n_up = mixtral ? "w3" : "up_proj",
               *n_down = mixtral ? "w2" : "down_proj";
    *o_embed = add_param(b, true, 2, V, H, "model.embed_tokens.weight");
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        layer_offsets x;
        x.ln1 = add_param(b, false, 1, H, 0, "model.layers.%lld.input_layernorm.weight", (long long)l);
        x.wq = add_param(b, true, 2, nh * hd, H, "model.layers.%lld.self_attn.q_proj.weight", (long long)l);
        x.wk = add_param(b, true, 2, nkv * hd, H, "model.layers.%lld.self_attn.k_proj.weight", (long long)l);
        x.wv = add_param(b, true, 2, nkv * hd, H, "model.layers.%lld.self_attn.v_proj.weight", (long long)l);
        x.wo = add_param(b, true, 2, H, nh * hd, "model.layers.%lld.self_attn.o_proj.weight", (long long)l);
        x.q_norm = x.k_norm = -1;
        if (c->qk_norm == FM_QK_NORM_PER_HEAD) {
            x.q_norm = add_param(b, false, 1, hd, 0, "model.layers.%lld.self_attn.q_norm.weight", (long long)l);
            x.k_norm = add_param(b, false, 1, hd, 0, "model.layers.%lld.self_attn.k_norm.weight", (long long)l);
        } else if (c->qk_norm == FM_QK_NORM_FULL) {
            x.q_norm = add_param(b, false, 1, nh * hd, 0, "model.layers.%lld.self_attn.q_norm.weight", (long long)l);
            x.k_norm = add_param(b, false, 1, nkv * hd, 0, "model.layers.%lld.self_attn.k_norm.weight", (long long)l);
        }
        x.ln2 = add_param(b, false, 1, H, 0, "model.layers.%lld.post_attention_layernorm.weight", (long long)l);
        x.router = add_param(b, true, 2, E, H, "model.layers.%lld.%s.gate.weight", (long long)l, moe);
        x.w_gate = b->offset;
        for (int64_t e = 0; e < E; e++)
            add_param(b, true, 2, I, H, "model.layers.%lld.%s.experts.%lld.%s.weight", (long long)l, moe, (long long)e, n_gate);
        x.w_up = b->offset;
        for (int64_t e = 0; e < E; e++)
            add_param(b, true, 2, I, H, "model.layers.%lld.%s.experts.%lld.%s.weight", (long long)l, moe, (long long)e, n_up);
        x.w_down = b->offset;
        for (int64_t e = 0; e < E; e++)
            add_param(b, true, 2, H, I, "model.layers.%lld.%s.experts.%lld.%s.weight", (long long)l, moe, (long long)e, n_down);
        if (lo) lo[l] = x;
    }
    *o_norm = add_param(b, false, 1, H, 0, "model.norm.weight");
    *o_head = c->tie_word_embeddings ? *o_embed : add_param(b, true, 2, V, H, "lm_head.weight");
}

static void set_ptrs(fm_model_ptrs *p, fm_act *base, const fm_config *c, int64_t o_embed, int64_t o_norm,
                     int64_t o_head, const layer_offsets *lo) {
    p->embed = base + o_embed;
    p->final_norm = base + o_norm;
    p->lm_head = base + o_head;
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        const layer_offsets *x = &lo[l];
        fm_layer_ptrs *y = &p->layers[l];
        y->ln1 = base + x->ln1; y->wq = base + x->wq; y->wk = base + x->wk; y->wv = base + x->wv;
        y->wo = base + x->wo;
        y->q_norm = x->q_norm >= 0 ? base + x->q_norm : NULL;
        y->k_norm = x->k_norm >= 0 ? base + x->k_norm : NULL;
        y->ln2 = base + x->ln2; y->router = base + x->router;
        y->w_gate = base + x->w_gate; y->w_up = base + x->w_up; y->w_down = base + x->w_down;
    }
}

fm_status fm_model_create(fm_model *m, const fm_config *cfg, fm_backend be, size_t extra_state_bytes) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->be = be;
    const int64_t L = cfg->num_hidden_layers;
    table_builder counter = {0};
    int64_t oe, on, oh;
    build_table(cfg, &counter, &oe, &on, &oh, NULL);
    m->n_tensors = counter.n;
    m->n_params = counter.offset;
    m->table = fm_malloc(sizeof(fm_param) * (size_t)counter.n);
    layer_offsets *lo = fm_malloc(sizeof(layer_offsets) * (size_t)L);
    m->w.layers = fm_malloc(sizeof(fm_layer_ptrs) * (size_t)L);
    m->g.layers = fm_malloc(sizeof(fm_layer_ptrs) * (size_t)L);
    m->recompute = fm_malloc((size_t)L);
    if (!m->table || !lo || !m->w.layers || !m->g.layers || !m->recompute) {
        fm_free(lo);
        fm_model_free(m);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the parameter table (%d tensors)", counter.n);
    }
    table_builder b = {m->table, 0, 0};
    build_table(cfg, &b, &oe, &on, &oh, lo);
    const size_t state = fm_model_state_bytes(cfg, sizeof(fm_act));
    fm_status st = fm_arena_init_backend(&m->arena[FM_LIVE_MODEL_STATE], fm_live_set_names[FM_LIVE_MODEL_STATE],
                                         state + extra_state_bytes, &m->be);
    if (st) {
        fm_free(lo);
        fm_model_free(m);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the model state (%lld parameters, %.3f GiB); "
                        "use a smaller config", (long long)counter.offset, (state + extra_state_bytes) / 1073741824.0);
    }
    m->params = fm_arena_alloc(&m->arena[FM_LIVE_MODEL_STATE], (size_t)m->n_params * sizeof(fm_act));
    m->grads = fm_arena_alloc(&m->arena[FM_LIVE_MODEL_STATE], (size_t)m->n_params * sizeof(fm_act));
    m->master = sizeof(fm_act) == sizeof(float)
                    ? (float *)(void *)m->params
                    : fm_arena_alloc(&m->arena[FM_LIVE_MODEL_STATE], (size_t)m->n_params * sizeof(float));
    set_ptrs(&m->w, m->params, cfg, oe, on, oh, lo);
    set_ptrs(&m->g, m->grads, cfg, oe, on, oh, lo);
    fm_free(lo);
    return FM_OK;
}

const fm_param *fm_model_find_param(const fm_model *m, const char *name) {
    for (int i = 0; i < m->n_tensors; i++)
        if (!strcmp(m->table[i].name, name)) return &m->table[i];
    return NULL;
}

size_t fm_model_state_bytes(const fm_config *cfg, size_t a) {
    const int64_t n = fm_config_num_params(cfg);
    size_t b = 2 * fm_arena_round((size_t)n * a);
    if (a != sizeof(float)) b += fm_arena_round((size_t)n * sizeof(float));
    return b;
}

void fm_model_upload_master(fm_model *m, const float *host) {
    const size_t n = (size_t)m->n_params;
    m->be.ops->copy(m->be.ctx, m->master, host, n * sizeof(float), FM_COPY_H2D);
    if ((void *)m->master != (void *)m->params)
        m->be.ops->convert(m->be.ctx, m->params, FM_ACT_DTYPE, m->master, FM_DTYPE_F32, (int64_t)n);
}

void fm_model_download_master(const fm_model *m, float *host) {
    m->be.ops->copy(m->be.ctx, host, m->master, (size_t)m->n_params * sizeof(float), FM_COPY_D2H);
}

/* splitmix64's output for counter value `i` of a stream: the generator is a hash of a counter,
 * so element j of a tensor can be drawn directly, in any order, by any thread. */
static inline uint64_t counter_u64(uint64_t key, uint64_t i) {
    uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

fm_status fm_model_init_weights(fm_model *m, uint64_t seed) {
    const float std = (float)m->cfg.initializer_range;
    const bool host = m->be.ops->host_memory;
    float *w = host ? m->master : fm_malloc(sizeof(float) * (size_t)m->n_params);
    if (!w) return fm_error(FM_ERR_NOMEM, "memory: cannot stage %lld initial weights on the host", (long long)m->n_params);
    /* Normal(0, std) by Box-Muller on counter-based uniforms: tensor i uses the key
     * hash(seed, i), element j the counters 2j and 2j+1 — the same values for any thread count,
     * in parallel (a 7B-parameter model initializes in seconds, not minutes). */
    for (int i = 0; i < m->n_tensors; i++) {
        const fm_param *p = &m->table[i];
        float *x = w + p->offset;
        const uint64_t key = counter_u64(seed ^ 0x5EEDull, (uint64_t)i);
        const int64_t n = p->numel;
        const bool ones = p->ndim == 1;
#pragma omp parallel for schedule(static) if (n > 65536)
        for (int64_t j = 0; j < n; j++) {
            if (ones) {
                x[j] = 1.0f;
                continue;
            }
            double u1 = (double)(counter_u64(key, 2 * (uint64_t)j) >> 11) * (1.0 / 9007199254740992.0);
            double u2 = (double)(counter_u64(key, 2 * (uint64_t)j + 1) >> 11) * (1.0 / 9007199254740992.0);
            if (u1 < 1e-300) u1 = 1e-300;
            x[j] = std * (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
        }
    }
    fm_model_upload_master(m, w);
    if (!host) fm_free(w);
    return FM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Activation layout                                                                           */
/* ------------------------------------------------------------------------------------------ */

#define TAKE(arena, type, count) ((type *)fm_arena_alloc((arena), sizeof(type) * (size_t)(count)))

static void layout_layer_acts(fm_layer_acts *a, fm_arena *ar, const fm_config *c, int64_t B, int64_t T) {
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
    a->probs = TAKE(ar, float, N * E);
    a->router_lse = TAKE(ar, float, N);
    a->topk_idx = TAKE(ar, int32_t, N * k);
    a->topk_w = TAKE(ar, float, N * k);
    a->expert_count = TAKE(ar, float, E);
    a->expert_prob_sum = TAKE(ar, float, E);
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
}

/* Lays out everything but the model state into arenas ar[1..]. Pointer arrays m->boundary and
 * m->acts must already exist. */
static fm_moe_dims moe_dims(const fm_config *c) {
    fm_moe_dims d = {c->hidden_size, c->moe_intermediate_size, c->num_experts, c->num_experts_per_tok};
    return d;
}

static void layout_all(fm_model *m, fm_arena *ar, fm_arena *host) {
    const fm_config *c = &m->cfg;
    const int64_t L = c->num_hidden_layers, N = m->N, H = c->hidden_size, hd = c->head_dim;
    fm_arena *bnd = &ar[FM_LIVE_BOUNDARIES], *acts = &ar[FM_LIVE_LAYER_ACTS],
             *ws = &ar[FM_LIVE_WORKING_SET], *voc = &ar[FM_LIVE_VOCAB], *ex = &ar[FM_LIVE_EXPERT];
    const fm_moe_dims md = moe_dims(c);
    const bool chunked = m->moe_chunk_tokens > 0;
    int64_t c_eff;
    fm_moe_chunks(N, m->moe_chunk_tokens, &m->moe_K, &c_eff);
    m->tokens = TAKE(bnd, int32_t, N);
    m->targets = TAKE(bnd, int32_t, N);
    m->rope_cos = TAKE(bnd, float, m->T * hd / 2);
    m->rope_sin = TAKE(bnd, float, m->T * hd / 2);
    m->moe_chunk_order = chunked ? TAKE(bnd, int32_t, N) : NULL;
    for (int64_t l = 0; l <= L; l++) m->boundary[l] = TAKE(bnd, fm_act, N * H);
    fm_layer_acts shared;
    bool any_recompute = false;
    for (int64_t l = 0; l < L; l++) any_recompute |= m->recompute[l];
    if (any_recompute) {
        layout_layer_acts(&shared, acts, c, m->B, m->T);
        memset(&shared.moe, 0, sizeof shared.moe);
        if (!chunked) fm_moe_routes_layout(&shared.moe, ex, host, &md, N);
    }
    for (int64_t l = 0; l < L; l++) {
        if (m->recompute[l]) {
            m->acts[l] = shared;
            continue;
        }
        layout_layer_acts(&m->acts[l], acts, c, m->B, m->T);
        memset(&m->acts[l].moe, 0, sizeof m->acts[l].moe);
        if (!chunked) fm_moe_routes_layout(&m->acts[l].moe, ex, host, &md, N);
    }
    fm_moe_ws_layout(&m->moe_ws, ex, host, &md, chunked ? c_eff : N, chunked);
    layout_ws(&m->ws, ws, c, N);
    m->xf = TAKE(voc, fm_act, N * H);
    m->rstd_f = TAKE(voc, float, N);
    m->logits = m->linear_ce ? NULL : TAKE(voc, fm_act, N * c->vocab_size);
    m->token_loss = TAKE(voc, float, N);
    if (m->linear_ce) { /* the operator's strip: carved and released inside each call */
        size_t strip = fm_linear_ce_bound_bytes(m->ce_block_tokens, m->ce_block_vocab);
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

size_t fm_model_boundary_bytes_chunked(const fm_config *c, int64_t B, int64_t T, bool moe_chunked, size_t a) {
    const int64_t N = B * T;
    /* tokens, targets, RoPE cos/sin [T, hd/2], the chunked MoE's token order [N] int32, L+1
     * residual-stream boundaries [N,H] */
    return 2 * B4(N) + 2 * B4(T * c->head_dim / 2) + (moe_chunked ? B4(N) : 0) +
           (size_t)(c->num_hidden_layers + 1) * BA(N * c->hidden_size);
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
    return b;
}

size_t fm_model_working_set_bytes(const fm_config *c, int64_t N, size_t a) {
    const int64_t H = c->hidden_size, E = c->num_experts, k = c->num_experts_per_tok;
    const int64_t qd = c->num_attention_heads * c->head_dim, kd = c->num_key_value_heads * c->head_dim;
    /* dx ping-pong, dtmp, dln [N,H] (+ dln1 when qd < H); dq, dk, dv (+ datt when qd > H, else
     * it reuses the incoming-gradient buffer); dtopk_w; router logits/grad (fp32, + an fm_act
     * copy when fm_act is not fp32); dprobs */
    return (qd < H ? 5 : 4) * BA(N * H) + (qd > H ? 2 : 1) * BA(N * qd) + 2 * BA(N * kd) + B4(N * k) + B4(N * E) +
           (a == sizeof(float) ? 0 : BA(N * E)) + B4(E);
}

size_t fm_model_vocab_plain_bytes(const fm_config *c, int64_t N, size_t a) {
    /* final-norm output [N,H] and rstd, logits [N,V] (their gradient in place), per-token loss */
    return BA(N * c->hidden_size) + B4(N) + BA(N * c->vocab_size) + B4(N);
}

size_t fm_model_vocab_linear_bytes(const fm_config *c, int64_t N, int64_t block_tokens, int64_t block_vocab,
                                   size_t a) {
    return BA(N * c->hidden_size) + 2 * B4(N) + fm_linear_ce_bound_bytes_a(block_tokens, block_vocab, a);
}

static void free_layout(fm_model *m) {
    for (int i = 1; i < FM_LIVE_COUNT; i++) fm_arena_free(&m->arena[i]);
    fm_arena_free(&m->host_arena);
    fm_free(m->boundary);
    fm_free(m->acts);
    fm_free(m->h_tokens);
    fm_free(m->h_targets);
    fm_free(m->h_scratch);
    fm_free(m->h_counts);
    m->boundary = NULL;
    m->acts = NULL;
    m->h_tokens = m->h_targets = NULL;
    m->h_scratch = m->h_counts = NULL;
}

static void plan_bytes(const fm_config *cfg, int64_t B, int64_t T, const fm_layout_opts *opts,
                       size_t bytes[FM_LIVE_COUNT], size_t *host_bytes) {
    const bool *recompute = opts ? opts->recompute : NULL;
    const int64_t L = cfg->num_hidden_layers;
    fm_model m;
    memset(&m, 0, sizeof m);
    m.cfg = *cfg;
    m.B = B; m.T = T; m.N = B * T;
    m.moe_chunk_tokens = opts ? opts->moe_chunk_tokens : 0;
    m.linear_ce = opts && (opts->ce_block_tokens > 0 || opts->ce_block_vocab > 0);
    m.ce_block_tokens = opts ? opts->ce_block_tokens : 0;
    m.ce_block_vocab = opts ? opts->ce_block_vocab : 0;
    bool *rc = fm_malloc((size_t)(L + 1));
    fm_act **bp = fm_malloc(sizeof(fm_act *) * (size_t)(L + 1));
    fm_layer_acts *la = fm_malloc(sizeof(fm_layer_acts) * (size_t)(L + 1));
    FM_ASSERT(rc && bp && la); /* a few bytes per layer; the config's layer count is bounded */
    for (int64_t l = 0; l < L; l++) rc[l] = recompute ? recompute[l] : false;
    m.recompute = rc;
    m.boundary = bp;
    m.acts = la;
    fm_arena ar[FM_LIVE_COUNT], host;
    for (int i = 0; i < FM_LIVE_COUNT; i++) fm_arena_init_measure(&ar[i], fm_live_set_names[i]);
    fm_arena_init_measure(&host, "host");
    layout_all(&m, ar, &host);
    if (host_bytes) *host_bytes = host.used;
    table_builder counter = {0};
    int64_t oe, on, oh;
    build_table(cfg, &counter, &oe, &on, &oh, NULL);
    bytes[FM_LIVE_MODEL_STATE] = fm_model_state_bytes(cfg, sizeof(fm_act));
    for (int i = 1; i < FM_LIVE_COUNT; i++) bytes[i] = ar[i].used;
    fm_free(rc);
    fm_free(bp);
    fm_free(la);
}

void fm_model_plan_bytes(const fm_config *cfg, int64_t B, int64_t T, const fm_layout_opts *opts,
                         size_t bytes[FM_LIVE_COUNT]) {
    plan_bytes(cfg, B, T, opts, bytes, NULL);
}

fm_status fm_model_layout(fm_model *m, int64_t B, int64_t T, const fm_layout_opts *opts) {
    const bool *recompute = opts ? opts->recompute : NULL;
    const fm_config *c = &m->cfg;
    const int64_t L = c->num_hidden_layers;
    if (T > c->max_position_embeddings)
        return fm_error(FM_ERR_ARG, "a sequence of %lld tokens (--seq-len, or sample's --context) exceeds the model's "
                        "max_position_embeddings (%lld); use at most %lld", (long long)T,
                        (long long)c->max_position_embeddings, (long long)c->max_position_embeddings);
    if (B < 1 || T < 1)
        return fm_error(FM_ERR_ARG, "--micro-batch (%lld) and --seq-len (%lld) must be >= 1", (long long)B,
                        (long long)T);
    free_layout(m);
    m->B = m->B_cap = B;
    m->T = m->T_cap = T;
    m->N = B * T;
    if (opts && opts->moe_chunk_tokens < 0)
        return fm_error(FM_ERR_ARG, "--moe-chunk-tokens must be >= 0 (0 = unchunked), found %lld",
                        (long long)opts->moe_chunk_tokens);
    for (int64_t l = 0; l < L; l++) m->recompute[l] = recompute ? recompute[l] : false;
    if (opts && (opts->ce_block_tokens < 0 || opts->ce_block_vocab < 0))
        return fm_error(FM_ERR_ARG, "--ce-block-tokens and --ce-block-vocab must be >= 0");
    m->moe_chunk_tokens = opts ? opts->moe_chunk_tokens : 0;
    m->linear_ce = opts && (opts->ce_block_tokens > 0 || opts->ce_block_vocab > 0);
    m->ce_block_tokens = opts ? opts->ce_block_tokens : 0;
    m->ce_block_vocab = opts ? opts->ce_block_vocab : 0;
    fm_layout_opts o = {m->recompute, m->moe_chunk_tokens, m->ce_block_tokens, m->ce_block_vocab};
    size_t bytes[FM_LIVE_COUNT];
    size_t host_bytes = 0;
    plan_bytes(c, B, T, &o, bytes, &host_bytes);
    fm_status st;
    m->boundary = fm_malloc(sizeof(fm_act *) * (size_t)(L + 1));
    m->acts = fm_malloc(sizeof(fm_layer_acts) * (size_t)L);
    m->h_tokens = fm_malloc(sizeof(int32_t) * (size_t)(B * T));
    m->h_targets = fm_malloc(sizeof(int32_t) * (size_t)(B * T));
    m->h_scratch = fm_malloc(sizeof(float) * (size_t)(2 * c->num_experts));
    m->h_counts = fm_malloc(sizeof(float) * (size_t)(L * c->num_experts));
    if (!m->boundary || !m->acts || !m->h_tokens || !m->h_targets || !m->h_scratch || !m->h_counts) {
        free_layout(m);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the layer tables and host staging");
    }
    for (int i = 1; i < FM_LIVE_COUNT; i++) {
        st = fm_arena_init_backend(&m->arena[i], fm_live_set_names[i], bytes[i], &m->be);
        if (st) {
            free_layout(m);
            return fm_error(FM_ERR_NOMEM, "memory: cannot allocate %.3f GiB for the %s live set at "
                            "micro-batch %lld x sequence %lld; lower one of them (train: or recompute more layers)",
                            bytes[i] / 1073741824.0, fm_live_set_names[i], (long long)B, (long long)T);
        }
    }
    /* Painted before anything is written, so fm_arena_touched measures what the run writes (the
     * RoPE tables and the chunk order below are the first writes). One memset per arena, at launch. */
    for (int i = 1; i < FM_LIVE_COUNT; i++) fm_arena_paint(&m->arena[i]);
    st = fm_arena_init(&m->host_arena, "host", host_bytes);
    if (st) {
        free_layout(m);
        return st;
    }
    layout_all(m, m->arena, &m->host_arena);
    for (int64_t l = 0; l < L; l++) m->acts[l].h_expert_count = m->h_counts + l * c->num_experts;
    /* RoPE tables (HF: inv_freq[i] = theta^(-2i/hd); angle = t * inv_freq[i]), in double, made on
     * the host and uploaded; and the chunked MoE's token order. */
    const int64_t half = c->head_dim / 2;
    float *tab = fm_malloc(sizeof(float) * (size_t)(2 * T * half + 1));
    int32_t *order = m->moe_chunk_order ? fm_malloc(sizeof(int32_t) * (size_t)m->N) : NULL;
    if (!tab || (m->moe_chunk_order && !order)) {
        fm_free(tab);
        free_layout(m);
        return fm_error(FM_ERR_NOMEM, "memory: cannot stage the RoPE tables");
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < half; i++) {
            double inv = pow(c->rope_theta, -2.0 * (double)i / (double)c->head_dim);
            double ang = (double)t * inv;
            tab[t * half + i] = (float)cos(ang);
            tab[T * half + t * half + i] = (float)sin(ang);
        }
    m->be.ops->copy(m->be.ctx, m->rope_cos, tab, sizeof(float) * (size_t)(T * half), FM_COPY_H2D);
    m->be.ops->copy(m->be.ctx, m->rope_sin, tab + T * half, sizeof(float) * (size_t)(T * half), FM_COPY_H2D);
    fm_free(tab);
    if (order) {
        fm_moe_chunk_order(order, m->N, m->moe_K);
        m->be.ops->copy(m->be.ctx, m->moe_chunk_order, order, sizeof(int32_t) * (size_t)m->N, FM_COPY_H2D);
        fm_free(order);
    }
    return FM_OK;
}

void fm_model_set_shape(fm_model *m, int64_t B, int64_t T) {
    FM_ASSERT(B >= 1 && T >= 1 && B <= m->B_cap && T <= m->T_cap);
    FM_ASSERT(m->moe_chunk_tokens == 0 || B * T == m->B_cap * m->T_cap); /* chunk order is for N_cap */
    m->B = B;
    m->T = T;
    m->N = B * T;
}

void fm_model_logits_row(const fm_model *m, int64_t row, float *host) {
    const int64_t V = m->cfg.vocab_size;
    FM_ASSERT(m->logits && row >= 0 && row < m->N);
    if (sizeof(fm_act) == sizeof(float)) {
        m->be.ops->copy(m->be.ctx, host, m->logits + row * V, sizeof(float) * (size_t)V, FM_COPY_D2H);
        return;
    }
    /* bf16 -> fp32 on the host: the high half of the fp32 bits (sampling, not a training step) */
    uint16_t *tmp = fm_malloc(sizeof(uint16_t) * (size_t)V);
    FM_ASSERT(tmp);
    m->be.ops->copy(m->be.ctx, tmp, m->logits + row * V, sizeof(uint16_t) * (size_t)V, FM_COPY_D2H);
    for (int64_t v = 0; v < V; v++) {
        uint32_t u = (uint32_t)tmp[v] << 16;
        memcpy(&host[v], &u, sizeof u);
    }
    fm_free(tmp);
}

void fm_model_free(fm_model *m) {
    free_layout(m);
    fm_arena_free(&m->arena[FM_LIVE_MODEL_STATE]);
    fm_free(m->table);
    fm_free(m->w.layers);
    fm_free(m->g.layers);
    fm_free(m->recompute);
    memset(m, 0, sizeof *m);
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                     */
/* ------------------------------------------------------------------------------------------ */

#define OPS (m->be.ops)
#define CTX (m->be.ctx)
#define PHASE(p) fm_phase_mark(&m->be, FM_PHASE_##p)

/* The model's linear layers (fm_linear_fwd/bwd of fm_backend.h) in fm_act, alpha 1. */
static void linear_fwd(fm_model *m, fm_act *y, const fm_act *x, const fm_act *W, int64_t N, int64_t in, int64_t out) {
    fm_linear_fwd(&m->be, y, FM_ACT_DTYPE, x, W, N, in, out);
}

static void linear_bwd(fm_model *m, fm_act *dx, float beta, fm_act *dW, const fm_act *dy, const fm_act *x,
                       const fm_act *W, int64_t N, int64_t in, int64_t out) {
    fm_linear_bwd(&m->be, dx, beta, dW, dy, x, W, N, in, out, 1.0f);
}

/* One layer forward: x [N,H] -> y [N,H]; saves into a. Returns the layer's (aux, z) terms.
 * The norm outputs ln1, ln2 live in the working set's dln and dtmp, free whenever a forward
 * runs (before backward, and during a recompute: backward_body's dy and dx are the other
 * buffers); y must be neither. */
static void layer_forward(fm_model *m, int64_t l, const fm_act *x, fm_act *y, fm_layer_acts *a,
                          double *aux, double *zterm) {
    const fm_config *c = &m->cfg;
    const fm_layer_ptrs *w = &m->w.layers[l];
    const int64_t B = m->B, T = m->T, N = m->N, H = c->hidden_size;
    const int64_t nh = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim;
    const int64_t qd = nh * hd, kd = nkv * hd, E = c->num_experts, k = c->num_experts_per_tok;
    const float eps = (float)c->rms_norm_eps;

    fm_act *ln1 = m->ws.dln, *ln2 = m->ws.dtmp;
    FM_ASSERT(y != ln1 && y != ln2);

    /* attention block */
    PHASE(DENSE);
    OPS->rmsnorm_fwd(CTX, ln1, a->rstd1, x, w->ln1, N, H, eps);
    linear_fwd(m, a->q, ln1, w->wq, N, H, qd);
    linear_fwd(m, a->k, ln1, w->wk, N, H, kd);
    linear_fwd(m, a->v, ln1, w->wv, N, H, kd);
    if (c->qk_norm == FM_QK_NORM_PER_HEAD) {
        OPS->rmsnorm_fwd(CTX, a->qr, a->rstd_q, a->q, w->q_norm, N * nh, hd, eps);
        OPS->rmsnorm_fwd(CTX, a->kr, a->rstd_k, a->k, w->k_norm, N * nkv, hd, eps);
    } else if (c->qk_norm == FM_QK_NORM_FULL) {
        OPS->rmsnorm_fwd(CTX, a->qr, a->rstd_q, a->q, w->q_norm, N, qd, eps);
        OPS->rmsnorm_fwd(CTX, a->kr, a->rstd_k, a->k, w->k_norm, N, kd, eps);
    } /* else q, k alias qr, kr: RoPE below works in place on the projections */
    OPS->rope_fwd(CTX, a->qr, m->rope_cos, m->rope_sin, B, T, nh, hd);
    OPS->rope_fwd(CTX, a->kr, m->rope_cos, m->rope_sin, B, T, nkv, hd);
    PHASE(ATTENTION);
    OPS->attention_fwd(CTX, a->att, a->lse, a->qr, a->kr, a->v, B, T, nh, nkv, hd);
    PHASE(DENSE);
    linear_fwd(m, a->x_mid, a->att, w->wo, N, qd, H);
    OPS->add(CTX, a->x_mid, x, N * H);

    /* MoE block */
    OPS->rmsnorm_fwd(CTX, ln2, a->rstd2, a->x_mid, w->ln2, N, H, eps);
    PHASE(ROUTER);
    float *router_logits = m->ws.dlogits_r; /* fp32, transient: backward needs only probs and lse */
    fm_linear_fwd(&m->be, router_logits, FM_DTYPE_F32, ln2, w->router, N, H, E);
    OPS->router_fwd(CTX, a->probs, a->router_lse, a->topk_idx, a->topk_w, router_logits, N, E, k,
                    c->norm_topk_prob);
    double lse_sq = OPS->router_stats(CTX, a->expert_count, a->expert_prob_sum, a->probs, a->router_lse,
                                      a->topk_idx, N, E, k);
    /* the load-balancing statistics, to the host (2E floats) */
    float *hc = a->h_expert_count ? a->h_expert_count : m->h_scratch, *hp = m->h_scratch + E;
    OPS->copy(CTX, hc, a->expert_count, sizeof(float) * (size_t)E, FM_COPY_D2H);
    OPS->copy(CTX, hp, a->expert_prob_sum, sizeof(float) * (size_t)E, FM_COPY_D2H);
    double s = 0;
    for (int64_t e = 0; e < E; e++) s += ((double)hc[e] / N) * ((double)hp[e] / N);
    *aux = (double)E * s;
    *zterm = lse_sq / (double)N;

    const fm_moe_dims md = moe_dims(c);
    const fm_moe_weights mw = {w->w_gate, w->w_up, w->w_down};
    fm_moe_forward(&m->be, &md, &mw, y, ln2, a->topk_idx, a->topk_w, N, m->moe_K, m->moe_chunk_order,
                   m->moe_chunk_tokens > 0 ? NULL : &a->moe, &m->moe_ws);
    PHASE(DENSE);
    OPS->add(CTX, y, a->x_mid, N * H);
}

/* Embedding, the layers and the final norm; the router losses into r. */
static void forward_body(fm_model *m, fm_loss *r, bool with_targets) {
    const fm_config *c = &m->cfg;
    const int64_t L = c->num_hidden_layers, N = m->N, H = c->hidden_size;
    PHASE(OTHER);
    OPS->copy(CTX, m->tokens, m->h_tokens, sizeof(int32_t) * (size_t)N, FM_COPY_H2D);
    if (with_targets) OPS->copy(CTX, m->targets, m->h_targets, sizeof(int32_t) * (size_t)N, FM_COPY_H2D);
    OPS->embedding_fwd(CTX, m->boundary[0], m->tokens, m->w.embed, N, H);
    double aux = 0, z = 0;
    for (int64_t l = 0; l < L; l++) {
        double a_l, z_l;
        layer_forward(m, l, m->boundary[l], m->boundary[l + 1], &m->acts[l], &a_l, &z_l);
        aux += a_l;
        z += z_l;
    }
    PHASE(DENSE);
    OPS->rmsnorm_fwd(CTX, m->xf, m->rstd_f, m->boundary[L], m->w.final_norm, N, H, (float)c->rms_norm_eps);
    PHASE(LOSS);
    memset(r, 0, sizeof *r);
    r->aux = c->router_aux_loss_coef * aux / (double)L;
    r->z = c->router_z_loss_coef * z / (double)L;
}

static int64_t count_valid(const fm_model *m) {
    int64_t valid = 0;
    for (int64_t n = 0; n < m->N; n++) valid += m->h_targets[n] != -100;
    return valid;
}

/* The linear cross-entropy over xf and the LM head; with grads, dxf -> ws.dtmp and the head's
 * gradient accumulated, scaled by scale/valid. Returns the mean loss. */
static double linear_ce(fm_model *m, bool grads, float scale) {
    const fm_config *c = &m->cfg;
    fm_lce_opts o = fm_lce_opts_default();
    o.block_tokens = m->ce_block_tokens;
    o.block_vocab = m->ce_block_vocab;
    const int64_t valid = m->n_valid;
    double sum = fm_linear_ce(&m->be, &m->arena[FM_LIVE_VOCAB], m->token_loss, grads ? m->ws.dtmp : NULL,
                              grads ? m->g.lm_head : NULL, m->xf, m->w.lm_head, m->targets, m->N, c->hidden_size,
                              c->vocab_size, valid ? scale / (float)valid : 0.0f, &o, NULL);
    return valid ? sum / (double)valid : 0.0;
}

void fm_model_forward(fm_model *m, bool with_targets, fm_loss *out) {
    const fm_config *c = &m->cfg;
    const int64_t N = m->N, H = c->hidden_size, V = c->vocab_size;
    fm_loss r;
    forward_body(m, &r, with_targets);
    if (m->linear_ce) {
        FM_ASSERT(with_targets); /* a linear-CE layout has no logits to sample from */
        m->n_valid = r.n_valid = count_valid(m);
        r.ce = linear_ce(m, false, 1.0f);
    } else {
        linear_fwd(m, m->logits, m->xf, m->w.lm_head, N, H, V);
        if (with_targets) {
            m->n_valid = r.n_valid = count_valid(m);
            /* The gradient (mean over valid tokens) is formed in place now: the logits are not
             * needed afterwards. Backward scales it for accumulation. */
            double sum = OPS->cross_entropy(CTX, m->token_loss, m->logits, m->logits, m->targets, N, V,
                                            r.n_valid ? 1.0f / (float)r.n_valid : 0.0f, -100);
            r.ce = r.n_valid ? sum / (double)r.n_valid : 0.0;
        }
    }
    if (out) *out = r;
}

/* ------------------------------------------------------------------------------------------ */
/* Backward                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* dy [N,H]: gradient of the layer output, clobbered (its buffer holds d att once dy is added
 * into d x_mid). Writes dx [N,H] (assigned); until its last op dx holds ln2, then ln1, formed
 * again from x_mid and x. */
static void layer_backward(fm_model *m, int64_t l, const fm_act *x, fm_act *dy, fm_act *dx,
                           fm_layer_acts *a, float scale) {
    const fm_config *c = &m->cfg;
    const fm_layer_ptrs *w = &m->w.layers[l];
    const fm_layer_ptrs *g = &m->g.layers[l];
    fm_bwd_ws *ws = &m->ws;
    const int64_t B = m->B, T = m->T, N = m->N, H = c->hidden_size;
    const int64_t nh = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim;
    const int64_t qd = nh * hd, kd = nkv * hd, E = c->num_experts, k = c->num_experts_per_tok;
    const int64_t L = c->num_hidden_layers;
    const float eps = (float)c->rms_norm_eps;

    /* MoE block: y = x_mid + experts(ln2(x_mid)); ln2 formed again into dx */
    PHASE(DENSE);
    fm_act *ln2 = dx;
    OPS->rmsnorm_fwd(CTX, ln2, a->rstd2, a->x_mid, w->ln2, N, H, eps);
    const fm_moe_dims md = moe_dims(c);
    const fm_moe_weights mw = {w->w_gate, w->w_up, w->w_down};
    const fm_moe_grads mg = {g->w_gate, g->w_up, g->w_down};
    fm_moe_backward(&m->be, &md, &mw, &mg, ws->dln, ws->dtopk_w, dy, ln2, a->topk_idx, a->topk_w, N, m->moe_K,
                    m->moe_chunk_order, m->moe_chunk_tokens > 0 ? NULL : &a->moe, &m->moe_ws);
    PHASE(ROUTER);
    /* Router: top-k weights, plus the load-balancing loss coef/L * E * sum_e f_e P_e with
     * P_e = mean_n probs[n,e] (f_e = count_e/N held constant), plus the z-loss
     * zcoef/L * mean_n lse_n^2. The batch's loss is scaled by `scale` (accumulation). */
    const double aux_c = c->router_aux_loss_coef * scale / (double)L;
    const float *hc = a->h_expert_count; /* this layer's counts, kept on the host by its forward */
    for (int64_t e = 0; e < E; e++)
        m->h_scratch[e] = (float)(aux_c * (double)E * ((double)hc[e] / N) / (double)N);
    OPS->copy(CTX, ws->dprobs_e, m->h_scratch, sizeof(float) * (size_t)E, FM_COPY_H2D);
    const float z_scale = (float)(c->router_z_loss_coef * scale / ((double)L * (double)N));
    OPS->router_bwd(CTX, ws->dlogits_r, ws->dtopk_w, ws->dprobs_e, z_scale, a->probs, a->router_lse,
                    a->topk_idx, a->topk_w, N, E, k, c->norm_topk_prob);
    /* the router GEMMs take the fp32 logit gradient as fm_act */
    if ((void *)ws->dlogits_act != (void *)ws->dlogits_r)
        OPS->convert(CTX, ws->dlogits_act, FM_ACT_DTYPE, ws->dlogits_r, FM_DTYPE_F32, N * E);
    linear_bwd(m, ws->dln, 1.0f, g->router, ws->dlogits_act, ln2, w->router, N, H, E);
    /* d x_mid = dy + rmsnorm_bwd(dln) */
    PHASE(DENSE);
    OPS->rmsnorm_bwd(CTX, ws->dtmp, g->ln2, ws->dln, a->x_mid, w->ln2, a->rstd2, N, H);
    OPS->add(CTX, ws->dtmp, dy, N * H);
    fm_act *dxmid = ws->dtmp;
    fm_act *datt = ws->datt ? ws->datt : dy; /* dy is dead from here on */

    /* attention block: x_mid = x + o_proj(attn(rope(qknorm(q,k)), v)) */
    linear_bwd(m, datt, 0.0f, g->wo, dxmid, a->att, w->wo, N, qd, H);
    PHASE(ATTENTION);
    OPS->attention_bwd(CTX, ws->dq, ws->dk, ws->dv, datt, a->qr, a->kr, a->v, a->att, a->lse, B, T, nh,
                       nkv, hd);
    PHASE(DENSE);
    OPS->rope_bwd(CTX, ws->dq, m->rope_cos, m->rope_sin, B, T, nh, hd);
    OPS->rope_bwd(CTX, ws->dk, m->rope_cos, m->rope_sin, B, T, nkv, hd);
    fm_act *dq = ws->dq, *dk = ws->dk;
    if (c->qk_norm != FM_QK_NORM_NONE) {
        /* datt is free now: reuse it for dq before the norm; dln (free) for dk. */
        const bool ph = c->qk_norm == FM_QK_NORM_PER_HEAD;
        OPS->rmsnorm_bwd(CTX, datt, g->q_norm, ws->dq, a->q, w->q_norm, a->rstd_q, ph ? N * nh : N,
                         ph ? hd : qd);
        OPS->rmsnorm_bwd(CTX, ws->dln, g->k_norm, ws->dk, a->k, w->k_norm, a->rstd_k, ph ? N * nkv : N,
                         ph ? hd : kd);
        dq = datt;
        dk = ws->dln;
    }
    /* d ln1 [N,H]: in the [N,qd] buffer the q gradient no longer needs (dq after the QK-norm
     * backward moved it to datt; datt otherwise), when qd >= H */
    fm_act *dln1 = ws->dln1 ? ws->dln1 : (c->qk_norm != FM_QK_NORM_NONE ? ws->dq : datt);
    fm_act *ln1 = dx; /* ln2 is dead: form ln1 again there */
    OPS->rmsnorm_fwd(CTX, ln1, a->rstd1, x, w->ln1, N, H, eps);
    linear_bwd(m, dln1, 0.0f, g->wq, dq, ln1, w->wq, N, H, qd);
    linear_bwd(m, dln1, 1.0f, g->wk, dk, ln1, w->wk, N, H, kd);
    linear_bwd(m, dln1, 1.0f, g->wv, ws->dv, ln1, w->wv, N, H, kd);
    OPS->rmsnorm_bwd(CTX, dx, g->ln1, dln1, x, w->ln1, a->rstd1, N, H);
    OPS->add(CTX, dx, dxmid, N * H);
}

/* Backward from ws.dtmp = d loss / d xf through the final norm, the layers and the embedding. */
static void backward_body(fm_model *m, float scale) {
    const fm_config *c = &m->cfg;
    const int64_t L = c->num_hidden_layers, N = m->N, H = c->hidden_size;
    fm_bwd_ws *ws = &m->ws;
    fm_act *dy = ws->dx_a, *dx = ws->dx_b;
    PHASE(DENSE);
    OPS->rmsnorm_bwd(CTX, dy, m->g.final_norm, ws->dtmp, m->boundary[L], m->w.final_norm, m->rstd_f, N, H);
    for (int64_t l = L - 1; l >= 0; l--) {
        if (m->recompute[l]) {
            double a_l, z_l;
            /* Re-run the forward from the saved boundary into the shared set; the output goes
             * to dx, free until layer_backward assigns it, so boundary l+1 stays as it was. */
            layer_forward(m, l, m->boundary[l], dx, &m->acts[l], &a_l, &z_l);
        }
        layer_backward(m, l, m->boundary[l], dy, dx, &m->acts[l], scale);
        fm_act *t = dy; dy = dx; dx = t;
    }
    PHASE(OTHER);
    OPS->embedding_bwd(CTX, m->g.embed, dy, m->tokens, N, H);
}

void fm_model_backward(fm_model *m, float scale) {
    const fm_config *c = &m->cfg;
    const int64_t N = m->N, H = c->hidden_size, V = c->vocab_size;
    PHASE(LOSS);
    if (m->linear_ce) {
        linear_ce(m, true, scale);
    } else {
        /* m->logits holds dloss/dlogits (mean CE) from forward; the GEMMs scale it (alpha) for
         * accumulation. */
        fm_linear_bwd(&m->be, m->ws.dtmp, 0.0f, m->g.lm_head, m->logits, m->xf, m->w.lm_head, N, H, V, scale);
    }
    backward_body(m, scale);
}

void fm_model_train_step(fm_model *m, float scale, fm_loss *out) {
    if (!m->linear_ce) {
        fm_model_forward(m, true, out);
        fm_model_backward(m, scale);
        return;
    }
    fm_loss r;
    forward_body(m, &r, true);
    m->n_valid = r.n_valid = count_valid(m);
    PHASE(LOSS);
    r.ce = linear_ce(m, true, scale);
    backward_body(m, scale);
    if (out) *out = r;
}
