/* The parameter table and its views (fm_params.h): the table's order is the flat buffer's,
 * Hugging Face names; the initial weights by a counter-based generator. */
#include "fm_params.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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
    int64_t ln1, wq, wk, wv, wo, q_norm, k_norm, ln2, router, w_gate, w_up, w_down; /* -1: absent */
    int64_t bq, bk, bv, bo; /* attention biases, -1: absent */
    int64_t mlp_gate, mlp_up, mlp_down; /* dense layer only, else -1 */
    int64_t router_bias, sh_gate, sh_up, sh_down; /* sigmoid router's bias, shared experts; else -1 */
    int64_t wqa, qa_norm, wkva, kva_norm, wkvb; /* multi-head latent attention; else -1 */
    int64_t sinks, router_lin_bias, eb_gate, eb_up, eb_down; /* gpt_oss; else -1 */
} layer_offsets;

/* Multi-head latent attention's projections (transformers' DeepseekV3Attention, in its order),
 * in place of q, k, v, o: q_proj, or q_a_proj, q_a_layernorm and q_b_proj; kv_a_proj_with_mqa,
 * kv_a_layernorm, kv_b_proj, o_proj. */
static void mla_table(const fm_config *c, table_builder *b, layer_offsets *x, int64_t l) {
    const int64_t H = c->hidden_size, nh = c->num_attention_heads, rq = c->q_lora_rank, rkv = c->kv_lora_rank;
    const int64_t dq = c->qk_nope_head_dim + c->qk_rope_head_dim;
    const long long L = (long long)l;
    x->wqa = x->qa_norm = -1;
    if (rq > 0) {
        x->wqa = add_param(b, true, 2, rq, H, "model.layers.%lld.self_attn.q_a_proj.weight", L);
        x->qa_norm = add_param(b, false, 1, rq, 0, "model.layers.%lld.self_attn.q_a_layernorm.weight", L);
        x->wq = add_param(b, true, 2, nh * dq, rq, "model.layers.%lld.self_attn.q_b_proj.weight", L);
    } else {
        x->wq = add_param(b, true, 2, nh * dq, H, "model.layers.%lld.self_attn.q_proj.weight", L);
    }
    x->wkva = add_param(b, true, 2, rkv + c->qk_rope_head_dim, H, "model.layers.%lld.self_attn.kv_a_proj_with_mqa.weight", L);
    x->kva_norm = add_param(b, false, 1, rkv, 0, "model.layers.%lld.self_attn.kv_a_layernorm.weight", L);
    x->wkvb = add_param(b, true, 2, nh * (c->qk_nope_head_dim + c->v_head_dim), rkv,
                        "model.layers.%lld.self_attn.kv_b_proj.weight", L);
    x->wo = add_param(b, true, 2, H, nh * c->v_head_dim, "model.layers.%lld.self_attn.o_proj.weight", L);
    x->wk = x->wv = x->bq = x->bk = x->bv = x->bo = x->q_norm = x->k_norm = -1;
}

/* Fills the table (or counts it when b->t is NULL) and the offsets. The order is the flat
 * buffer's order. */
static void build_table(const fm_config *c, table_builder *b, int64_t *o_embed, int64_t *o_norm,
                        int64_t *o_head, layer_offsets *lo, int64_t e0, int64_t e1) {
    const int64_t H = c->hidden_size, V = c->vocab_size, I = c->moe_intermediate_size, E = c->num_experts;
    const int64_t nh = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim;
    const bool mixtral = c->model_type == FM_MODEL_MIXTRAL, oss = c->model_type == FM_MODEL_GPT_OSS;
    const char *moe = mixtral ? "block_sparse_moe" : "mlp", *router = oss ? "router" : "gate";
    const char *n_gate = mixtral ? "w1" : "gate_proj", *n_up = mixtral ? "w3" : "up_proj",
               *n_down = mixtral ? "w2" : "down_proj";
    *o_embed = add_param(b, true, 2, V, H, "model.embed_tokens.weight");
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        layer_offsets x;
        x.ln1 = add_param(b, false, 1, H, 0, "model.layers.%lld.input_layernorm.weight", (long long)l);
        /* each projection's bias (attention_bias, attention_o_bias) right after its weight; no
         * weight decay on biases (as on norm weights) */
        const bool ab = c->attention_bias, ob = c->attention_o_bias;
        x.bq = x.bk = x.bv = x.bo = -1;
        x.wqa = x.qa_norm = x.wkva = x.kva_norm = x.wkvb = -1;
        if (c->mla) mla_table(c, b, &x, l);
        else {
            x.wq = add_param(b, true, 2, nh * hd, H, "model.layers.%lld.self_attn.q_proj.weight", (long long)l);
            if (ab) x.bq = add_param(b, false, 1, nh * hd, 0, "model.layers.%lld.self_attn.q_proj.bias", (long long)l);
            x.wk = add_param(b, true, 2, nkv * hd, H, "model.layers.%lld.self_attn.k_proj.weight", (long long)l);
            if (ab) x.bk = add_param(b, false, 1, nkv * hd, 0, "model.layers.%lld.self_attn.k_proj.bias", (long long)l);
            x.wv = add_param(b, true, 2, nkv * hd, H, "model.layers.%lld.self_attn.v_proj.weight", (long long)l);
            if (ab) x.bv = add_param(b, false, 1, nkv * hd, 0, "model.layers.%lld.self_attn.v_proj.bias", (long long)l);
            x.wo = add_param(b, true, 2, H, nh * hd, "model.layers.%lld.self_attn.o_proj.weight", (long long)l);
            if (ob) x.bo = add_param(b, false, 1, H, 0, "model.layers.%lld.self_attn.o_proj.bias", (long long)l);
        }
        x.sinks = x.router_lin_bias = x.eb_gate = x.eb_up = x.eb_down = -1;
        if (c->attention_sinks) {
            x.sinks = add_param(b, false, 1, nh, 0, "model.layers.%lld.self_attn.sinks", (long long)l);
            if (b->t) b->t[b->n - 1].init_normal = true;
        }
        x.q_norm = x.k_norm = -1;
        if (c->qk_norm == FM_QK_NORM_PER_HEAD) {
            x.q_norm = add_param(b, false, 1, hd, 0, "model.layers.%lld.self_attn.q_norm.weight", (long long)l);
            x.k_norm = add_param(b, false, 1, hd, 0, "model.layers.%lld.self_attn.k_norm.weight", (long long)l);
        } else if (c->qk_norm == FM_QK_NORM_FULL) {
            x.q_norm = add_param(b, false, 1, nh * hd, 0, "model.layers.%lld.self_attn.q_norm.weight", (long long)l);
            x.k_norm = add_param(b, false, 1, nkv * hd, 0, "model.layers.%lld.self_attn.k_norm.weight", (long long)l);
        }
        x.ln2 = add_param(b, false, 1, H, 0, "model.layers.%lld.post_attention_layernorm.weight", (long long)l);
        x.mlp_gate = x.mlp_up = x.mlp_down = -1;
        x.router_bias = x.sh_gate = x.sh_up = x.sh_down = -1;
        if (!fm_config_layer_is_moe(c, l)) { /* dense SwiGLU MLP (qwen3_moe's Qwen3MoeMLP), no router */
            const int64_t Id = c->dense_intermediate_size;
            x.router = x.w_gate = x.w_up = x.w_down = -1;
            x.mlp_gate = add_param(b, true, 2, Id, H, "model.layers.%lld.mlp.gate_proj.weight", (long long)l);
            x.mlp_up = add_param(b, true, 2, Id, H, "model.layers.%lld.mlp.up_proj.weight", (long long)l);
            x.mlp_down = add_param(b, true, 2, H, Id, "model.layers.%lld.mlp.down_proj.weight", (long long)l);
            if (lo) lo[l] = x;
            continue;
        }
        x.router = add_param(b, true, 2, E, H, "model.layers.%lld.%s.%s.weight", (long long)l, moe, router);
        if (c->router_linear_bias) {
            x.router_lin_bias = add_param(b, false, 1, E, 0, "model.layers.%lld.mlp.router.bias", (long long)l);
            if (b->t) b->t[b->n - 1].init_normal = true;
        }
        /* the sigmoid router's bias and the shared experts come before the routed experts (full_index) */
        if (c->router_sigmoid) {
            x.router_bias = add_param(b, false, 1, E, 0, "model.layers.%lld.mlp.gate.e_score_correction_bias", (long long)l);
            if (b->t) b->t[b->n - 1].buffer = true;
        }
        const int64_t Is = fm_config_shared_width(c);
        if (Is > 0) {
            x.sh_gate = add_param(b, true, 2, Is, H, "model.layers.%lld.mlp.shared_experts.gate_proj.weight", (long long)l);
            x.sh_up = add_param(b, true, 2, Is, H, "model.layers.%lld.mlp.shared_experts.up_proj.weight", (long long)l);
            x.sh_down = add_param(b, true, 2, H, Is, "model.layers.%lld.mlp.shared_experts.down_proj.weight", (long long)l);
        }
        x.w_gate = b->offset;
        for (int64_t e = e0; e < e1; e++) /* expert parallelism: this rank's experts only */
            add_param(b, true, 2, I, H, "model.layers.%lld.%s.experts.%lld.%s.weight", (long long)l, moe, (long long)e, n_gate);
        x.w_up = b->offset;
        for (int64_t e = e0; e < e1; e++) /* expert parallelism: this rank's experts only */
            add_param(b, true, 2, I, H, "model.layers.%lld.%s.experts.%lld.%s.weight", (long long)l, moe, (long long)e, n_up);
        x.w_down = b->offset;
        for (int64_t e = e0; e < e1; e++) /* expert parallelism: this rank's experts only */
            add_param(b, true, 2, H, I, "model.layers.%lld.%s.experts.%lld.%s.weight", (long long)l, moe, (long long)e, n_down);
        if (c->expert_bias) { /* stacked after the weights, this rank's experts only, no weight decay */
            x.eb_gate = b->offset;
            for (int64_t e = e0; e < e1; e++)
                add_param(b, false, 1, I, 0, "model.layers.%lld.mlp.experts.%lld.gate_proj.bias", (long long)l, (long long)e);
            x.eb_up = b->offset;
            for (int64_t e = e0; e < e1; e++)
                add_param(b, false, 1, I, 0, "model.layers.%lld.mlp.experts.%lld.up_proj.bias", (long long)l, (long long)e);
            x.eb_down = b->offset;
            for (int64_t e = e0; e < e1; e++)
                add_param(b, false, 1, H, 0, "model.layers.%lld.mlp.experts.%lld.down_proj.bias", (long long)l, (long long)e);
        }
        if (lo) lo[l] = x;
    }
    *o_norm = add_param(b, false, 1, H, 0, "model.norm.weight");
    *o_head = c->tie_word_embeddings ? *o_embed : add_param(b, true, 2, V, H, "lm_head.weight");
}

/* base + (off - first), or NULL for an absent tensor (off -1). */
static fm_act *at(fm_act *base, int64_t off, int64_t first) { return off >= 0 ? base + (off - first) : NULL; }

static void set_ptrs(fm_model_ptrs *p, fm_act *base, const fm_config *c, int64_t o_embed, int64_t o_norm,
                     int64_t o_head, const layer_offsets *lo) {
    p->embed = base + o_embed;
    p->final_norm = base + o_norm;
    p->lm_head = base + o_head;
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        const layer_offsets *x = &lo[l];
        fm_layer_ptrs *y = &p->layers[l];
        y->ln1 = base + x->ln1; y->wq = base + x->wq; y->wk = at(base, x->wk, 0); y->wv = at(base, x->wv, 0);
        y->wo = base + x->wo;
        y->wqa = at(base, x->wqa, 0); y->qa_norm = at(base, x->qa_norm, 0); y->wkva = at(base, x->wkva, 0);
        y->kva_norm = at(base, x->kva_norm, 0); y->wkvb = at(base, x->wkvb, 0);
        y->q_norm = x->q_norm >= 0 ? base + x->q_norm : NULL;
        y->k_norm = x->k_norm >= 0 ? base + x->k_norm : NULL;
        y->ln2 = base + x->ln2;
        y->bq = at(base, x->bq, 0); y->bk = at(base, x->bk, 0); y->bv = at(base, x->bv, 0); y->bo = at(base, x->bo, 0);
        y->router = at(base, x->router, 0);
        y->w_gate = at(base, x->w_gate, 0); y->w_up = at(base, x->w_up, 0); y->w_down = at(base, x->w_down, 0);
        y->mlp_gate = at(base, x->mlp_gate, 0); y->mlp_up = at(base, x->mlp_up, 0);
        y->mlp_down = at(base, x->mlp_down, 0);
        y->router_bias = at(base, x->router_bias, 0);
        y->sh_gate = at(base, x->sh_gate, 0); y->sh_up = at(base, x->sh_up, 0); y->sh_down = at(base, x->sh_down, 0);
        y->sinks = at(base, x->sinks, 0); y->router_lin_bias = at(base, x->router_lin_bias, 0);
        y->eb_gate = at(base, x->eb_gate, 0); y->eb_up = at(base, x->eb_up, 0); y->eb_down = at(base, x->eb_down, 0);
    }
}

int64_t fm_params_ep_num_params(const fm_config *c, int ep) {
    const int64_t E = c->num_experts, El = ep > 0 ? E / ep : E;
    const int64_t H = c->hidden_size, I = c->moe_intermediate_size;
    const int64_t per_expert = 3 * H * I + (c->expert_bias ? 2 * I + H : 0); /* gpt_oss: the biases too */
    return fm_config_num_params(c) - fm_config_num_moe_layers(c) * (E - El) * per_expert;
}

fm_status fm_params_create(fm_model_params *p, const fm_config *cfg, int ep, int ep_rank) {
    memset(p, 0, sizeof *p);
    if (ep < 1 || cfg->num_experts % ep != 0 || ep_rank < 0 || ep_rank >= ep)
        return fm_error(FM_ERR_ARG, "--ep %d: expected a degree >= 1 that divides num_experts (%lld), rank %d in "
                        "[0, %d); choose an --ep that divides %lld", ep, (long long)cfg->num_experts, ep_rank, ep,
                        (long long)cfg->num_experts);
    p->cfg = *cfg;
    p->ep = ep;
    p->ep_rank = ep_rank;
    p->E_loc = cfg->num_experts / ep;
    const int64_t e0 = (int64_t)ep_rank * p->E_loc, e1 = e0 + p->E_loc;
    const int64_t L = cfg->num_hidden_layers;
    table_builder counter = {0};
    int64_t oe, on, oh;
    build_table(cfg, &counter, &oe, &on, &oh, NULL, e0, e1);
    p->n_tensors = counter.n;
    p->n_params = counter.offset;
    p->table = fm_malloc(sizeof(fm_param) * (size_t)counter.n);
    p->offsets = fm_malloc(sizeof(layer_offsets) * (size_t)L);
    p->w.layers = fm_malloc(sizeof(fm_layer_ptrs) * (size_t)L);
    p->g.layers = fm_malloc(sizeof(fm_layer_ptrs) * (size_t)L);
    if (!p->table || !p->offsets || !p->w.layers || !p->g.layers) {
        fm_params_free(p);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the parameter table (%d tensors)", counter.n);
    }
    table_builder b = {p->table, 0, 0};
    build_table(cfg, &b, &p->o_embed, &p->o_norm, &p->o_head, (layer_offsets *)p->offsets, e0, e1);
    return FM_OK;
}

void fm_params_free(fm_model_params *p) {
    fm_free(p->table);
    fm_free(p->offsets);
    fm_free(p->w.layers);
    fm_free(p->g.layers);
    memset(p, 0, sizeof *p);
}

void fm_params_bind(fm_model_params *p, fm_act *weights, fm_act *grads, float *master) {
    FM_ASSERT(weights && grads && master);
    p->params = weights;
    p->grads = grads;
    p->master = master;
    const layer_offsets *lo = p->offsets;
    set_ptrs(&p->w, p->params, &p->cfg, p->o_embed, p->o_norm, p->o_head, lo);
    set_ptrs(&p->g, p->grads, &p->cfg, p->o_embed, p->o_norm, p->o_head, lo);
}

/* One group's views from its buffer (ZeRO-3): base holds the group's flat range from its first
 * element, so a tensor at table offset o is at base + (o - group's first offset). */
static void set_group_ptrs(fm_model_params *pp, fm_model_ptrs *p, int64_t g, fm_act *base) {
    const int64_t L = pp->cfg.num_hidden_layers;
    const layer_offsets *lo = pp->offsets;
    const bool tied = pp->o_head == pp->o_embed;
    if (g == 0) {
        p->embed = base;
        if (tied) p->lm_head = base;
    } else if (g == L + 1) {
        p->final_norm = base;
        if (!tied) p->lm_head = base + (pp->o_head - pp->o_norm);
    } else {
        const layer_offsets *x = &lo[g - 1];
        const int64_t b = x->ln1;
        fm_layer_ptrs *y = &p->layers[g - 1];
        y->ln1 = base; y->wq = base + (x->wq - b); y->wk = at(base, x->wk, b); y->wv = at(base, x->wv, b);
        y->wo = base + (x->wo - b);
        y->wqa = at(base, x->wqa, b); y->qa_norm = at(base, x->qa_norm, b); y->wkva = at(base, x->wkva, b);
        y->kva_norm = at(base, x->kva_norm, b); y->wkvb = at(base, x->wkvb, b);
        y->q_norm = x->q_norm >= 0 ? base + (x->q_norm - b) : NULL;
        y->k_norm = x->k_norm >= 0 ? base + (x->k_norm - b) : NULL;
        y->ln2 = base + (x->ln2 - b);
        y->bq = at(base, x->bq, b); y->bk = at(base, x->bk, b); y->bv = at(base, x->bv, b); y->bo = at(base, x->bo, b);
        y->router = at(base, x->router, b);
        y->w_gate = at(base, x->w_gate, b); y->w_up = at(base, x->w_up, b); y->w_down = at(base, x->w_down, b);
        y->mlp_gate = at(base, x->mlp_gate, b); y->mlp_up = at(base, x->mlp_up, b);
        y->mlp_down = at(base, x->mlp_down, b);
        y->router_bias = at(base, x->router_bias, b);
        y->sh_gate = at(base, x->sh_gate, b); y->sh_up = at(base, x->sh_up, b); y->sh_down = at(base, x->sh_down, b);
        y->sinks = at(base, x->sinks, b); y->router_lin_bias = at(base, x->router_lin_bias, b);
        y->eb_gate = at(base, x->eb_gate, b); y->eb_up = at(base, x->eb_up, b); y->eb_down = at(base, x->eb_down, b);
    }
}

void fm_params_bind_group(fm_model_params *pp, int64_t g, fm_act *weights, fm_act *grads) {
    FM_ASSERT(g >= 0 && g <= pp->cfg.num_hidden_layers + 1);
    if (weights) set_group_ptrs(pp, &pp->w, g, weights);
    if (grads) set_group_ptrs(pp, &pp->g, g, grads);
}

int64_t fm_params_group_begin(const fm_model_params *pp, int64_t g) {
    const int64_t L = pp->cfg.num_hidden_layers;
    FM_ASSERT(g >= 0 && g <= L + 2);
    if (g == 0) return pp->o_embed;
    if (g == L + 1) return pp->o_norm;
    if (g == L + 2) return pp->n_params;
    return ((const layer_offsets *)pp->offsets)[g - 1].ln1;
}

void fm_params_layer_expert_offsets(const fm_model_params *pp, int64_t l, int64_t *gate, int64_t *up, int64_t *down) {
    const layer_offsets *x = &((const layer_offsets *)pp->offsets)[l];
    *gate = x->w_gate;
    *up = x->w_up;
    *down = x->w_down;
}

void fm_params_layer_expert_bias_offsets(const fm_model_params *pp, int64_t l, int64_t *gate, int64_t *up,
                                         int64_t *down) {
    const layer_offsets *x = &((const layer_offsets *)pp->offsets)[l];
    *gate = x->eb_gate;
    *up = x->eb_up;
    *down = x->eb_down;
}

const fm_param *fm_params_find(const fm_model_params *pp, const char *name) {
    for (int i = 0; i < pp->n_tensors; i++)
        if (!strcmp(pp->table[i].name, name)) return &pp->table[i];
    return NULL;
}

/* splitmix64's output for counter value `i` of a stream: the generator is a hash of a counter,
 * so element j of a tensor can be drawn directly, in any order, by any thread. */
static inline uint64_t counter_u64(uint64_t key, uint64_t i) {
    uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The index of table tensor i in the table of all experts (fm_params_create's tables are
 * subsequences of it): the initial weights are drawn by that index, so every --ep draws the
 * one-rank model's. Layer l's tensors: its non-expert ones (nne), then, in an MoE layer, gate,
 * up, down per expert (E_loc of them here, E in the full table). */
static uint64_t full_index(const fm_model_params *pp, int i) {
    if (pp->ep <= 1 || i < 1) return (uint64_t)i;
    const fm_config *c = &pp->cfg;
    const int64_t L = c->num_hidden_layers, E = c->num_experts, El = pp->E_loc;
    const int64_t attn = c->mla ? 2 + (c->q_lora_rank > 0 ? 3 : 1) + 4 /* ln1, q (or q_a, its norm, q_b), kv_a, its
                                                                         norm, kv_b, o, ln2 */
                       : 6 + (c->qk_norm != FM_QK_NORM_NONE ? 2 : 0) /* ln1, q, k, v, o, (q/k norm), ln2 */
                       + (c->attention_bias ? 3 : 0) + (c->attention_o_bias ? 1 : 0) /* (biases) */
                       + (c->attention_sinks ? 1 : 0);                                /* (sinks) */
    const int64_t groups = 3 + (c->expert_bias ? 3 : 0); /* gate, up, down (and their biases) per expert */
    int64_t ti = 1, fi = 1; /* the layer's first index in this table and in the full one */
    for (int64_t l = 0; l < L; l++) {
        const bool moe = fm_config_layer_is_moe(c, l);
        const int64_t extra = (c->router_sigmoid ? 1 : 0) + (fm_config_shared_width(c) > 0 ? 3 : 0) +
                              (c->router_linear_bias ? 1 : 0);
        const int64_t nne = attn + (moe ? 1 + extra : 3), nt = nne + (moe ? groups * El : 0),
                      nf = nne + (moe ? groups * E : 0);
        if (i < ti + nt) {
            const int64_t p = i - ti;
            const int64_t q = p < nne ? p : nne + (p - nne) / El * E + pp->ep_rank * El + (p - nne) % El;
            return (uint64_t)(fi + q);
        }
        ti += nt;
        fi += nf;
    }
    return (uint64_t)(fi + (i - ti)); /* the final norm and the LM head */
}

void fm_params_init_weights_range(const fm_model_params *pp, uint64_t seed, int i, int64_t first, int64_t count, float *out) {
    const float std = (float)pp->cfg.initializer_range;
    /* Normal(0, std) by Box-Muller on counter-based uniforms: tensor i uses the key
     * hash(seed, i), element j the counters 2j and 2j+1 — the same values for any thread count,
     * in parallel (a 7B-parameter model initializes in seconds, not minutes), and any range of
     * a tensor without the rest (ZeRO-3's shards) */
    const fm_param *p = &pp->table[i];
    const uint64_t key = counter_u64(seed ^ 0x5EEDull, full_index(pp, i));
    const bool ones = p->ndim == 1 && !p->init_normal;
    const size_t nl = strlen(p->name);
    const bool bias = nl > 5 && !strcmp(p->name + nl - 5, ".bias"); /* HF's _init_weights: bias.zero_() */
#pragma omp parallel for schedule(static) if (count > 65536)
    for (int64_t k = 0; k < count; k++) {
        if (ones) {
            /* a bias or a buffer (e_score_correction_bias): zeros, as transformers' _init_weights */
            out[k] = bias || p->buffer ? 0.0f : 1.0f;
            continue;
        }
        const uint64_t j = (uint64_t)(first + k);
        double u1 = (double)(counter_u64(key, 2 * j) >> 11) * (1.0 / 9007199254740992.0);
        double u2 = (double)(counter_u64(key, 2 * j + 1) >> 11) * (1.0 / 9007199254740992.0);
        if (u1 < 1e-300) u1 = 1e-300;
        out[k] = std * (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
}

void fm_params_init_weights_host(const fm_model_params *pp, uint64_t seed, float *w) {
    for (int i = 0; i < pp->n_tensors; i++)
        fm_params_init_weights_range(pp, seed, i, 0, pp->table[i].numel, w + pp->table[i].offset);
}

