/* Model configuration read from a Hugging Face config.json (model_type qwen3_moe, olmoe,
 * mixtral, glm4_moe). Field names are Hugging Face's, per model_type:
 *   expert width:  qwen3_moe, glm4_moe moe_intermediate_size; olmoe and mixtral intermediate_size
 *   expert count:  qwen3_moe and olmoe num_experts; mixtral num_local_experts; glm4_moe n_routed_experts
 *   QK-norm:       qwen3_moe RMSNorm per head over head_dim; olmoe RMSNorm over the whole q and k
 *                  projections; mixtral none
 *   norm_topk_prob: qwen3_moe and olmoe read it (HF defaults false); mixtral always renormalizes
 * flatmoe extension (absent from HF files, default 0): router_z_loss_coef.
 *
 * A field absent from the file (or null) takes transformers' own default for its model_type
 * (Qwen3MoeConfig, OlmoeConfig, MixtralConfig; one table in fm_config.c), so the same file builds
 * the same model here and in transformers: e.g. num_key_value_heads is 4 for qwen3_moe, 8 for
 * mixtral, num_attention_heads for olmoe. Only model_type is required.
 *
 * glm4_moe (fm_config_glm4.c): the first first_k_dense_replace layers are dense (intermediate_size),
 * every MoE layer has n_shared_experts shared experts and DeepSeek-V3's sigmoid router.
 * deepseek_v3: glm4_moe's MoE block (DeepseekV3Config's defaults) with multi-head latent
 * attention (fm_config_mla.c); MTP layers skipped as glm4_moe's.
 *
 * Dense layers (qwen3_moe, as transformers' Qwen3MoeDecoderLayer decides): layer i is MoE
 * when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; else its MLP is a
 * dense SwiGLU of width intermediate_size (model.layers.i.mlp.{gate,up,down}_proj.weight) and it
 * has no router.
 *
 * Attention parts (issue 26; model/fm_rope.h, docs/models.md):
 *   attention_bias: q_proj, k_proj, v_proj carry a bias (model.layers.i.self_attn.{q,k,v}_proj.bias);
 *                   attention_o_bias: o_proj too. qwen3_moe and olmoe read "attention_bias" (default
 *                   false) and bias all four projections with it, as Qwen3MoeAttention and
 *                   OlmoeAttention do; mixtral has no such field (refused when set true).
 *   partial_rotary_factor: RoPE rotates the first rotary_dim = int(head_dim x factor) dims of each
 *                   head (rotate_half over that slice, the rest passed through: GPT-NeoX's
 *                   apply_rotary_pos_emb, which glm4_moe uses, default 0.5 there); 1 for qwen3_moe,
 *                   olmoe and mixtral (their attention rotates the whole head: another value is
 *                   refused). A config
 *                   built in code with 0 reads as 1 (fm_config_rotary_dim).
 *   rope_scaling:   "rope_scaling" (or transformers 5's "rope_parameters") with rope_type "yarn"
 *                   or "linear" (fm_rope_scaling below); other types are refused, naming these. */
#ifndef FM_CONFIG_H
#define FM_CONFIG_H
#include "../core/fm_core.h"

typedef enum fm_model_type {
    FM_MODEL_QWEN3_MOE,
    FM_MODEL_OLMOE,
    FM_MODEL_MIXTRAL,
    FM_MODEL_GLM4_MOE, /* GLM-4.5 / GLM-4.5-Air (transformers' Glm4MoeConfig; fm_config_glm4.c) */
    FM_MODEL_DEEPSEEK_V3, /* DeepSeek-V3, Kimi-K2, Moonlight (DeepseekV3Config): glm4_moe's MoE block +
                           * multi-head latent attention (fm_config_mla.c, model/fm_mla.h) */
    FM_MODEL_GPT_OSS,  /* gpt-oss-20b / -120b (transformers' GptOssConfig; fm_config_gpt_oss.c) */
    FM_MODEL_DEEPSEEK_V2, /* DeepSeek-V2, V2-Lite, V2.5 (DeepseekV2Config): deepseek_v3's multi-head latent
                           * attention and MoE layout with DeepSeek-V2's softmax router
                           * (fm_config_deepseek_v2.c) */
} fm_model_type;

typedef enum fm_qk_norm {
    FM_QK_NORM_NONE,     /* mixtral */
    FM_QK_NORM_PER_HEAD, /* qwen3_moe: weight [head_dim] */
    FM_QK_NORM_FULL,     /* olmoe: weights [heads*head_dim] and [kv_heads*head_dim] */
} fm_qk_norm;

/* mlp_only_layers entries must be below this (entries >= num_hidden_layers are ignored, as
 * transformers ignores them). */
#define FM_CONFIG_MLP_ONLY_MAX 4096

typedef enum fm_rope_type {
    FM_ROPE_DEFAULT = 0, /* inv_freq[i] = theta^(-2i/rotary_dim) */
    FM_ROPE_LINEAR,      /* inv_freq / factor (transformers' _compute_linear_scaling_rope_parameters) */
    FM_ROPE_YARN,        /* YaRN (Peng et al. 2023, arXiv 2309.00071; transformers'
                            _compute_yarn_parameters): model/fm_rope.h */
} fm_rope_type;

/* RoPE scaling as read from config.json's rope_scaling / rope_parameters (defaults transformers'). */
typedef struct fm_rope_scaling {
    fm_rope_type type;
    double factor;            /* linear, yarn: the context extension factor (> 0) */
    int64_t original_max_position_embeddings; /* yarn: the pretrained context; absent: the file's
                                 max_position_embeddings, fixed at parse (so
                                 --max-position-embeddings does not move the tables) */
    double beta_fast, beta_slow; /* yarn: 32 and 1 when absent (or 0, as transformers' `or`) */
    double mscale, mscale_all_dim; /* yarn (DeepSeek): 0 when absent */
    double attention_factor;  /* yarn: as given; 0 when absent (then derived: fm_rope_attention_factor) */
    bool truncate;            /* yarn: floor/ceil the correction range (default true) */
} fm_rope_scaling;

typedef struct fm_config {
    fm_model_type model_type;
    char model_type_name[32];       /* as written in config.json */
    int64_t vocab_size;             /* V */
    int64_t hidden_size;            /* H */
    int64_t moe_intermediate_size;  /* I: width of one expert's SwiGLU */
    int64_t num_hidden_layers;      /* L */
    int64_t num_attention_heads;    /* nh */
    int64_t num_key_value_heads;    /* nkv (default: per model_type, see above) */
    int64_t head_dim;               /* hd (qwen3_moe may set it; else H / nh) */
    int64_t max_position_embeddings;
    int64_t num_experts;            /* E */
    int64_t num_experts_per_tok;    /* k (top-k) */
    double rope_theta;
    double rms_norm_eps;
    bool norm_topk_prob;
    bool tie_word_embeddings;
    double router_aux_loss_coef;
    double router_z_loss_coef;
    double initializer_range;       /* std of normal init (HF default 0.02) */
    fm_qk_norm qk_norm;
    /* dense layers (qwen3_moe; olmoe and mixtral: every layer MoE, step 1, no mask) */
    int64_t dense_intermediate_size; /* Id: the dense MLP's width (qwen3_moe intermediate_size) */
    int64_t decoder_sparse_step;     /* >= 1 */
    uint64_t mlp_only_mask[FM_CONFIG_MLP_ONLY_MAX / 64]; /* bit i: layer i in mlp_only_layers */
    /* glm4_moe (DeepSeek-V3's MoE block; 0 / false / 1.0 for the other model_types) */
    int64_t first_k_dense_replace;  /* layers < this are dense (glm4_moe; 0 elsewhere) */
    int64_t n_shared_experts;       /* shared experts: one SwiGLU MLP of width I * n_shared_experts
                                     * on every token of an MoE layer (0: none) */
    bool router_sigmoid;            /* sigmoid scores, e_score_correction_bias for selection,
                                     * group-limited top-k (fm_router.h) */
    int64_t n_group, topk_group;    /* group-limited top-k: keep the topk_group best of n_group groups */
    double routed_scaling_factor;   /* the top-k weights times this (1.0 elsewhere) */
    int64_t num_nextn_predict_layers; /* MTP layers: neither built, trained nor saved (as transformers) */
    /* deepseek_v2 (fm_config_deepseek_v2.c): softmax scores times routed_scaling_factor, top-k
     * "greedy" or "group_limited_greedy" (n_group groups scored by their largest score, topk_group
     * kept); false elsewhere. norm_topk_prob is read and not used (transformers' DeepseekV2Moe). */
    bool router_group_limited;
    /* attention parts (above) */
    bool attention_bias;             /* q, k, v projections biased */
    bool attention_o_bias;           /* o projection biased (GPT-OSS, qwen3_moe/olmoe with attention_bias) */
    double partial_rotary_factor;    /* (0, 1]; 0 in a config built in code reads as 1 */
    fm_rope_scaling rope_scaling;
    /* multi-head latent attention (deepseek_v3; model/fm_mla.h; false / 0 elsewhere). With mla,
     * head_dim is the attention kernel's head dim qk_nope_head_dim + qk_rope_head_dim (q and k;
     * v padded to it with zeros) and num_key_value_heads is num_attention_heads (every head has
     * its own k and v); the file's num_key_value_heads is not used, as in transformers. */
    bool mla;
    int64_t q_lora_rank;             /* 0: q_proj (the file's null); else q_a_proj, q_a_layernorm, q_b_proj */
    int64_t kv_lora_rank;            /* compressed_kv's width */
    int64_t qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    bool rope_interleave;            /* q_pe, k_pe rotated in interleaved pairs (DeepseekV3Config default) */
    /* gpt_oss (fm_config_gpt_oss.c; false / 0 for the other model_types) */
    bool attention_sinks;            /* a learned sink logit per query head (self_attn.sinks [nh]) */
    int64_t sliding_window;          /* keys within this many positions (the query's own included) on
                                      * the layers of sliding_mask; 0: none */
    uint64_t sliding_mask[FM_CONFIG_MLP_ONLY_MAX / 64]; /* bit i: layer_types[i] "sliding_attention" */
    bool router_linear_bias;         /* the router Linear has a bias (mlp.router.bias [E]) */
    bool expert_bias;                /* the experts' gate/up and down projections carry biases */
    double swiglu_limit;             /* > 0: the clamped SwiGLU (fm_config_gpt_oss.c); 0: plain SwiGLU */
    double swiglu_alpha;             /* the clamped SwiGLU's sigmoid gain (1.702) */
} fm_config;

/* Parses config.json text. `path` is only used in messages. Errors (each names the file and the
 * field): FM_ERR_FORMAT malformed JSON or a field of the wrong JSON type; FM_ERR_CONFIG unknown
 * or missing model_type, non-positive sizes (a defaulted value is named as the default), num_attention_heads not dividing
 * hidden_size (when head_dim is not given), num_key_value_heads not dividing
 * num_attention_heads, odd head_dim, top-k outside [1, num_experts]; FM_ERR_UNSUPPORTED for
 * features flatmoe does not implement yet (attention_bias on mixtral, clip_qkv, rope_scaling
 * types other than yarn and linear, sliding window, qwen2-style shared experts; decoder_sparse_step
 * / mlp_only_layers outside qwen3_moe, or leaving no MoE layer). */
fm_status fm_config_parse(fm_config *cfg, const char *json_text, const char *path);

/* Reads and parses a config.json file. Errors: FM_ERR_IO if unreadable, else as above. */
fm_status fm_config_load(fm_config *cfg, const char *path);

/* The text of the file at path, fm_malloc'd into *text (the caller frees it). Errors: FM_ERR_IO
 * (not a file, unreadable), FM_ERR_FORMAT (over 16 MiB), FM_ERR_NOMEM. (fm_config_json.c) */
fm_status fm_config_read_text(const char *path, char **text);

/* config.json as read: `text` (the file a model came from, which parses to cfg but for the
 * fields flatmoe changes) with only those fields set to cfg's values, into a new fm_malloc'd
 * *out; everything else is the file's own bytes (unknown fields, number spellings, order). The
 * fields flatmoe changes: max_position_embeddings (--max-position-embeddings), replaced where
 * the file has it, else inserted as the first member. Errors: the parse's for text (naming
 * path); FM_ERR_ARG when cfg differs from text in another field, or changes
 * max_position_embeddings of a YaRN config whose rope_scaling lacks original_max_position_embeddings
 * (the written file would read another original context); FM_ERR_NOMEM. (fm_config_json.c) */
fm_status fm_config_json_as_read(const char *text, const fm_config *cfg, const char *path, char **out);

/* Adds member `key` = v to the cJSON object `obj` (a cJSON *) as a float with a decimal point, as
 * transformers' strict config classes want a float: the shortest of %.15g / %.17g that reads back
 * as v, with ".0" appended to an integral spelling (2 -> 2.0). (fm_config_json.c) */
void fm_config_json_add_float(void *obj, const char *key, double v);

/* The config as Hugging Face config.json text (fields for its model_type, "architectures",
 * "torch_dtype":"float32"), into an fm_malloc'd string: a canonical form (two configs are the
 * same model when their texts are equal) and the config of a model made without a file; a
 * checkpoint writes fm_config_json_as_read's text instead. */
char *fm_config_to_json(const fm_config *cfg);

/* glm4_moe's fields and checks into cfg (fm_config_glm4.c), called by fm_config_parse after the
 * common fields: first_k_dense_replace, n_shared_experts, n_group, topk_group,
 * routed_scaling_factor, use_qk_norm, num_nextn_predict_layers with Glm4MoeConfig's defaults
 * (its attention fields: fm_config_attn.c). root is a cJSON object. Errors:
 * FM_ERR_FORMAT (a field of the wrong JSON type), FM_ERR_CONFIG (n_group not dividing
 * n_routed_experts, topk_group outside [1, n_group], ...), FM_ERR_UNSUPPORTED (the router's
 * auxiliary losses), each naming path and the field. */
fm_status fm_config_parse_glm4(fm_config *cfg, const void *root, const char *path);

/* deepseek_v3's attention fields (fm_config_mla.c), called by fm_config_parse after the common
 * and glm4_moe's MoE fields: q_lora_rank (absent 1536, null: no q compression), kv_lora_rank 512,
 * qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, rope_interleave true
 * (DeepseekV3Config's defaults); sets mla, num_key_value_heads = num_attention_heads and
 * *head_dim = qk_nope_head_dim + qk_rope_head_dim. Errors: FM_ERR_FORMAT (wrong JSON type),
 * FM_ERR_CONFIG (a non-positive size, an odd qk_rope_head_dim, v_head_dim above the q/k head
 * dim, a head_dim field other than qk_rope_head_dim), each naming path and the field
 * (attention_bias true is refused by fm_config_parse_attention). */
fm_status fm_config_parse_mla(fm_config *cfg, const void *root, const char *path, int64_t *head_dim);

/* deepseek_v2's MoE fields and checks into cfg (fm_config_deepseek_v2.c), called by fm_config_parse
 * after the common fields (and before fm_config_parse_mla, which reads its attention fields with
 * the same defaults as deepseek_v3's): first_k_dense_replace 0, n_shared_experts 2,
 * routed_scaling_factor 1.0, topk_method "greedy", n_group and topk_group None,
 * num_experts_per_tok None (DeepseekV2Config's defaults). Errors: FM_ERR_FORMAT (wrong JSON type),
 * FM_ERR_CONFIG (num_experts_per_tok absent or null, n_shared_experts null, group_limited_greedy
 * without n_group / topk_group or with groups that do not divide the experts, a non-positive
 * routed_scaling_factor, no MoE layer), FM_ERR_UNSUPPORTED (a topk_method other than greedy and
 * group_limited_greedy, scoring_func other than softmax, moe_layer_freq other than 1), each naming
 * path and the field. */
fm_status fm_config_parse_deepseek_v2(fm_config *cfg, const void *root, const char *path);

/* deepseek_v2's MoE fields of cfg into the cJSON object json (fm_config_to_json's canonical form). */
void fm_config_deepseek_v2_to_json(const fm_config *cfg, void *json);

/* deepseek_v3's attention fields of cfg into the cJSON object json (fm_config_to_json). */
void fm_config_mla_to_json(const fm_config *cfg, void *json);

/* One layer's attention parameters under MLA: q (q_proj, or q_a_proj + q_a_layernorm +
 * q_b_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj. */
int64_t fm_config_mla_attn_params(const fm_config *cfg);

/* glm4_moe's fields of cfg into the cJSON object json (fm_config_to_json's canonical form). */
void fm_config_glm4_to_json(const fm_config *cfg, void *json);

/* gpt_oss's fields and checks into cfg (fm_config_gpt_oss.c), called by fm_config_parse after the
 * common and attention fields: sliding_window, layer_types, swiglu_limit, swiglu_alpha,
 * output_router_logits, with GptOssConfig's defaults (and its default YaRN rope_parameters when
 * the file has neither rope_scaling nor rope_parameters). root is a cJSON object. Errors:
 * FM_ERR_FORMAT (a field of the wrong JSON type), FM_ERR_CONFIG (layer_types of the wrong length
 * or an unknown entry, a non-positive sliding_window on a config with sliding layers, a
 * non-positive swiglu_limit), each naming path and the field. */
fm_status fm_config_parse_gpt_oss(fm_config *cfg, const void *root, const char *path);

/* gpt_oss's fields of cfg into the cJSON object json (fm_config_to_json's canonical form). */
void fm_config_gpt_oss_to_json(const fm_config *cfg, void *json);

/* Whether layer l's attention is a sliding window (gpt_oss's layer_types; false elsewhere). */
bool fm_config_layer_is_sliding(const fm_config *cfg, int64_t l);

/* The T of layer l's attention FLOPs at sequence length T (the plan's 6 (nh hd) T per token, causal:
 * T is twice the mean keys per query): T for a causal layer; for a sliding-window layer of window
 * W < T, 2 x (W (W + 1) / 2 + (T - W) W) / T, twice its mean keys per query. */
double fm_config_attention_span(const fm_config *cfg, int64_t l, int64_t T);

/* gpt_oss's parameters beside those fm_config_num_params counts for every model: per layer the
 * sinks [nh]; per MoE layer the router bias [E] and the experts' biases E * (2 I + H). */
int64_t fm_config_gpt_oss_extra_params(const fm_config *cfg, bool active);

/* An MoE layer's parameters beside its router weight and routed experts: the shared experts' 3
 * H Is and the sigmoid router's e_score_correction_bias E (fm_config.c). */
int64_t fm_config_moe_extra_params(const fm_config *cfg);

/* Width of the shared experts' SwiGLU MLP (moe_intermediate_size * n_shared_experts; 0: none). */
int64_t fm_config_shared_width(const fm_config *cfg);

/* Width of the dense-MLP working set (fm_dense_mlp.h), the largest of the dense layers' MLP
 * (dense_intermediate_size, when there are dense layers) and the shared experts'
 * (fm_config_shared_width); 0 when neither exists. */
int64_t fm_config_dense_ws_width(const fm_config *cfg);

/* Whether layer l (in [0, num_hidden_layers)) is an MoE layer (router and experts), else a dense
 * SwiGLU MLP of dense_intermediate_size (transformers' Qwen3MoeDecoderLayer rule, above; glm4_moe:
 * l >= first_k_dense_replace). */
bool fm_config_layer_is_moe(const fm_config *cfg, int64_t l);

/* The number of MoE layers (>= 1 for a parsed config). */
int64_t fm_config_num_moe_layers(const fm_config *cfg);

/* The rotated dims per head: int(head_dim x partial_rotary_factor) (head_dim when the factor is 0
 * or 1; qk_rope_head_dim under MLA), even and >= 2 for a parsed config. */
int64_t fm_config_rotary_dim(const fm_config *cfg);

/* Parameter counts: total (all experts, embeddings, untied head, dense MLPs) and active per token
 * (the attention, the router, k of E experts, the dense MLPs, norms, and the LM head; the embedding lookup is not a
 * matmul and is excluded, as in Megatron's FLOP count). */
int64_t fm_config_num_params(const fm_config *cfg);
int64_t fm_config_num_active_params(const fm_config *cfg);

#endif
