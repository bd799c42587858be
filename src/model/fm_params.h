/* The model's parameters (issue 24's model split; DESIGN.md §3 model/): the parameter table of
 * a config, in Hugging Face names, and the views of the flat buffers that hold them. Built from
 * the config alone (and, under expert parallelism, the rank's slice of the experts), with no
 * activation layout and no communicator: checkpoint I/O, the Hugging Face weight mapping, the
 * parameter store, the optimizer, ZeRO-3's groups and the weight init need only this part of
 * fm_model (model/fm_model.h: m->p).
 *
 * Parameters live in one flat buffer in a fixed order (the table below); gradients in a second
 * buffer of the same layout. Per-expert weights are stored stacked: gate and up [E, I, H], down
 * [E, H, I]; expert e's Hugging Face tensor is the e-th slice. */
#ifndef FM_PARAMS_H
#define FM_PARAMS_H

#include "../backend/fm_backend.h"
#include "fm_config.h"

typedef struct fm_param {
    char name[128];   /* Hugging Face tensor name */
    int ndim;
    int64_t shape[2];
    int64_t offset;   /* elements into the flat buffer */
    int64_t numel;
    bool decay;       /* AdamW weight decay applies (false for norm weights) */
    bool init_normal; /* a 1-D tensor drawn Normal(0, initializer_range) (gpt_oss's sinks and router
                       * bias, as GptOssPreTrainedModel._init_weights draws them), not 1 or 0 */
    bool buffer;      /* a buffer, not trained (e_score_correction_bias): zero-initialized, no weight
                       * decay, its gradient stays 0 so AdamW leaves it as it is; moved only by
                       * aux-loss-free balancing (train/fm_router_bias.h) */
} fm_param;

/* Pointers into one flat buffer (weights or gradients) for one layer. An MoE layer has router
 * and experts (mlp_* NULL), with the sigmoid router its selection bias
 * model.layers.N.mlp.gate.e_score_correction_bias, with shared experts their SwiGLU MLP
 * model.layers.N.mlp.shared_experts.{gate,up,down}_proj.weight (width Is =
 * fm_config_shared_width); a dense layer (fm_config_layer_is_moe false) the dense SwiGLU MLP
 * model.layers.N.mlp.{gate,up,down}_proj.weight (router and w_* NULL). */
typedef struct fm_layer_ptrs {
    fm_act *ln1, *wq, *wk, *wv, *wo, *q_norm, *k_norm, *ln2, *router;
    fm_act *bq, *bk, *bv, *bo; /* attention biases [nh*hd], [nkv*hd] x2, [H]; NULL without
                                  attention_bias / attention_o_bias (fm_config.h) */
    fm_act *w_gate, *w_up, *w_down; /* [E,I,H], [E,I,H], [E,H,I] */
    fm_act *mlp_gate, *mlp_up, *mlp_down; /* dense layer: [Id,H], [Id,H], [H,Id] */
    fm_act *router_bias;                  /* sigmoid router: e_score_correction_bias [E], else NULL */
    fm_act *sh_gate, *sh_up, *sh_down;    /* shared experts (glm4_moe): [Is,H], [Is,H], [H,Is], else NULL */
    /* multi-head latent attention (cfg->mla; model/fm_mla.h), else NULL; wq is then q_proj [nh*dq, H]
     * or, with q_lora_rank rq > 0, q_b_proj [nh*dq, rq]; wk, wv NULL; wo o_proj [H, nh*dv] */
    fm_act *wqa, *qa_norm;                /* q_a_proj [rq, H], q_a_layernorm [rq] (rq > 0) */
    fm_act *wkva, *kva_norm, *wkvb;       /* kv_a_proj_with_mqa [rkv+dr, H], kv_a_layernorm [rkv],
                                             kv_b_proj [nh*(dn+dv), rkv] */
    /* gpt_oss (fm_config_gpt_oss.c), else NULL: the attention sinks [nh]
     * (model.layers.N.self_attn.sinks), the router Linear's bias [E] (mlp.router.bias; the router
     * weight is then mlp.router.weight), the experts' biases stacked gate and up [E,I], down [E,H]
     * (per expert model.layers.N.mlp.experts.E.{gate,up,down}_proj.bias; Hugging Face's fused
     * gate_up_proj_bias / down_proj_bias are mapped at load, io/fm_hf_weights.h) */
    fm_act *sinks, *router_lin_bias, *eb_gate, *eb_up, *eb_down;
} fm_layer_ptrs;

typedef struct fm_model_ptrs {
    fm_act *embed;    /* [V,H] */
    fm_act *final_norm;
    fm_act *lm_head;  /* [V,H]; == embed when tied */
    fm_layer_ptrs *layers;
} fm_model_ptrs;

typedef struct fm_model_params {
    fm_config cfg;        /* the config the table was built from */
    /* Expert parallelism (--ep, bounded/fm_moe_ep.h): the table holds the E_loc = E/ep experts
     * ep_rank*E_loc .. of every layer under their global Hugging Face names; ep 1: all E. The
     * ep group's degree and this rank's index in it (the mesh's moe_ep_comm) are these. */
    int ep, ep_rank;
    int64_t E_loc;
    int64_t n_params;
    int n_tensors;
    fm_param *table;      /* n_tensors entries */
    fm_act *params, *grads; /* backend memory, [n_params] each: the parameter store's (bound) */
    float *master;        /* fp32 master weights [n_params]: params itself when fm_act is fp32 */
    bool master_host;     /* master is (pinned) host memory: the streamed optimizer's, not the backend's */
    int64_t o_embed, o_norm, o_head; /* offsets of the embedding, final norm and LM head */
    void *offsets;        /* [L] per-layer tensor offsets (fm_params.c) */
    fm_model_ptrs w, g;   /* views of params and grads */
} fm_model_params;

/* Builds the parameter table (names, shapes, offsets into the flat parameter buffer) of config
 * cfg for rank ep_rank of an expert-parallel group of ep ranks (1, 0: no expert parallelism):
 * the table holds every non-expert tensor and, of each layer's experts, only ep_rank*E/ep ..
 * (ep_rank+1)*E/ep - 1 (stacked [E/ep, I, H] / [E/ep, H, I], rows named by their global expert
 * index), so the parameter store, the optimizer and the gradients hold E/ep experts
 * (fm_params_ep_num_params). Allocates host memory for the table and views only, no parameter
 * memory: that is the parameter store's (train/fm_param_store.h), bound with fm_params_bind.
 * Errors: FM_ERR_ARG when ep < 1, ep does not divide num_experts or ep_rank is outside [0, ep)
 * (naming --ep and the fix); FM_ERR_NOMEM. On error p is freed (zeroed). */
fm_status fm_params_create(fm_model_params *p, const fm_config *cfg, int ep, int ep_rank);

/* Frees what fm_params_create allocated and zeroes p (the bound buffers are the caller's).
 * Safe on a zeroed p. */
void fm_params_free(fm_model_params *p);

/* Parameters of one rank's table under expert parallelism of degree ep (E % ep == 0):
 * fm_config_num_params less L_moe * (E - E/ep) * 3 * H * I (the other ranks' experts; L_moe the
 * MoE layers, fm_config_num_moe_layers). */
int64_t fm_params_ep_num_params(const fm_config *cfg, int ep);

/* Points the parameters at their buffers: weights and grads [n_params] fm_act and the fp32
 * master weights [n_params] (== weights when fm_act is fp32), backend memory in the table's
 * layout (fm_param.offset); sets the per-layer views p->w and p->g. */
void fm_params_bind(fm_model_params *p, fm_act *weights, fm_act *grads, float *master);

/* Parameter groups (ZeRO-3's unit of gathering, train/fm_zero3.h; the optimizer overlap's
 * groups): group 0 the embedding (with tied embeddings also the LM head), group 1 + l layer l,
 * group L + 1 the final norm and the untied LM head; each a contiguous range of the flat buffer,
 * in forward order. fm_params_group_begin gives group g's first flat offset (g = L + 2:
 * n_params, the end). fm_params_bind_group points the weight views (weights non-NULL) and the
 * gradient views (grads non-NULL) of group g at buffers that hold the group's range from its
 * first element, [fm_params_group_begin(g + 1) - fm_params_group_begin(g)] fm_act each, leaving
 * the other groups' views as they were (ZeRO-3 points them at its gather slots). */
int64_t fm_params_group_begin(const fm_model_params *p, int64_t g);
void fm_params_bind_group(fm_model_params *p, int64_t g, fm_act *weights, fm_act *grads);

/* Flat offsets (elements) of layer l's stacked expert weights gate [E,I,H], up [E,I,H] and down
 * [E,H,I] (the Hugging Face mapping's experts, io/fm_hf_weights.h); -1 each for a dense layer. */
void fm_params_layer_expert_offsets(const fm_model_params *p, int64_t l, int64_t *gate, int64_t *up,
                                    int64_t *down);

/* Flat offsets of layer l's stacked expert biases gate [E,I], up [E,I], down [E,H] (gpt_oss); -1
 * each when the layer has none. */
void fm_params_layer_expert_bias_offsets(const fm_model_params *p, int64_t l, int64_t *gate, int64_t *up,
                                         int64_t *down);

/* Looks up a parameter by Hugging Face name; NULL if absent. */
const fm_param *fm_params_find(const fm_model_params *p, const char *name);

/* The initial fp32 weights (Hugging Face init: Normal(0, initializer_range) for matrices and
 * embeddings, 1 for norm weights, 0 for biases: tensors named *.bias), drawn into host memory w [n_params] (table layout); nothing
 * uploaded. Counter-based (splitmix64 per element, Box-Muller), so the values do not depend on
 * the thread count, and every --ep rank draws the one-rank model's values for its experts. */
void fm_params_init_weights_host(const fm_model_params *p, uint64_t seed, float *w);
/* Elements [first, first + count) of table tensor i of the initial weights above into out
 * [count] (the same values as fm_params_init_weights_host's; ZeRO-3 draws only its shard). */
void fm_params_init_weights_range(const fm_model_params *p, uint64_t seed, int i, int64_t first, int64_t count,
                                  float *out);

#endif
