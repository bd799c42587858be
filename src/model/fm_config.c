#include "fm_config.h"

#include "fm_config_attn.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- JSON field helpers: each names the file and the field in its message ---------------- */

static fm_status get_int(const cJSON *root, const char *path, const char *key, int64_t dflt, int64_t *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) {
        *out = dflt;
        return FM_OK;
    }
    if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || fabs(it->valuedouble) > 9e15)
        return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" must be an integer, found %s", path, key,
                        cJSON_IsNumber(it) ? "a non-integer number (or one beyond 9e15)"
                        : cJSON_IsString(it) ? "a string (write the number without quotes)"
                        : cJSON_IsBool(it)   ? "true or false"
                        : cJSON_IsArray(it)  ? "an array"
                                             : "an object");
    *out = (int64_t)it->valuedouble;
    return FM_OK;
}

static fm_status get_num(const cJSON *root, const char *path, const char *key, double dflt, double *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) { *out = dflt; return FM_OK; }
    if (!cJSON_IsNumber(it))
        return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" must be a number", path, key);
    *out = it->valuedouble;
    return FM_OK;
}

static fm_status get_bool(const cJSON *root, const char *path, const char *key, bool dflt, bool *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) { *out = dflt; return FM_OK; }
    if (!cJSON_IsBool(it))
        return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" must be true or false", path, key);
    *out = cJSON_IsTrue(it);
    return FM_OK;
}

/* A field whose presence with a non-default value flatmoe cannot honour yet. */
static fm_status reject_if_set(const cJSON *root, const char *path, const char *key, const char *why) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it) || cJSON_IsFalse(it)) return FM_OK;
    if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 0) return FM_OK;
    if (cJSON_IsNumber(it) && it->valuedouble == 0) return FM_OK;
    return fm_error(FM_ERR_UNSUPPORTED, "%s: \"%s\" is set, but flatmoe does not support %s yet; "
                    "remove the field or set it to null/false", path, key, why);
}

/* ---- transformers' defaults per model_type ------------------------------------------------
 * The default of every field flatmoe reads, as transformers' config classes give it
 * (transformers src/transformers/models/{qwen3_moe,olmoe,mixtral}/configuration_*.py:
 * Qwen3MoeConfig, OlmoeConfig, MixtralConfig; rope_theta the class's default_theta, 10000 unless
 * the class sets it). Every model_type: initializer_range 0.02, tie_word_embeddings false,
 * norm_topk_prob false (mixtral: always renormalized), decoder_sparse_step 1, mlp_only_layers []. */
typedef struct hf_defaults {
    const char *name;
    fm_model_type type;
    int64_t vocab_size, hidden_size;
    int64_t intermediate_size;     /* olmoe, mixtral: the experts'; qwen3_moe: the dense MLP's */
    int64_t moe_intermediate_size; /* qwen3_moe only (0: the field is not read) */
    int64_t num_hidden_layers, num_attention_heads;
    int64_t num_key_value_heads;   /* 0: num_attention_heads (OlmoeConfig's None) */
    int64_t max_position_embeddings, num_experts, num_experts_per_tok;
    double rope_theta, rms_norm_eps, router_aux_loss_coef;
} hf_defaults;

static const hf_defaults k_hf_defaults[] = {
    {"qwen3_moe", FM_MODEL_QWEN3_MOE, 151936, 2048, 6144, 768, 24, 32, 4, 32768, 128, 8, 10000.0, 1e-6, 0.001},
    {"olmoe", FM_MODEL_OLMOE, 50304, 2048, 2048, 0, 16, 16, 0, 4096, 64, 8, 10000.0, 1e-5, 0.01},
    {"mixtral", FM_MODEL_MIXTRAL, 32000, 4096, 14336, 0, 32, 32, 8, 4096 * 32, 8, 2, 1e6, 1e-5, 0.001},
    /* Glm4MoeConfig: no router_aux_loss_coef (aux-loss-free balancing: 0); n_routed_experts 128 */
    {"glm4_moe", FM_MODEL_GLM4_MOE, 151552, 4096, 10944, 1408, 46, 96, 8, 131072, 128, 8, 10000.0, 1e-5, 0.0},
    /* DeepseekV3Config (DeepSeek-V3 671B): n_routed_experts 256; MLA's fields in fm_config_mla.c */
    {"deepseek_v3", FM_MODEL_DEEPSEEK_V3, 129280, 7168, 18432, 2048, 61, 128, 128, 4096, 256, 8, 10000.0, 1e-6, 0.0},
    /* GptOssConfig: intermediate_size is the experts' width, num_local_experts, head_dim 64
     * (fm_config_gpt_oss.c), rope_theta 150000 (its default_theta) */
    {"gpt_oss", FM_MODEL_GPT_OSS, 201088, 2880, 2880, 0, 36, 64, 8, 131072, 128, 4, 150000.0, 1e-5, 0.001},
    /* DeepseekV2Config (transformers 5; the class's defaults, not DeepSeek-V2's: vocab 32000,
     * n_routed_experts 64, num_experts_per_tok None: required, fm_config_deepseek_v2.c); no router
     * aux loss in transformers (the files' aux_loss_alpha and seq_aux are not read) */
    {"deepseek_v2", FM_MODEL_DEEPSEEK_V2, 32000, 4096, 11008, 1407, 32, 32, 0, 2048, 64, 1, 10000.0, 1e-6, 0.0},
};

/* The field's value or, absent, its default; *defaulted says which (for messages). */
static fm_status get_int_d(const cJSON *root, const char *path, const char *key, int64_t dflt, int64_t *out,
                           bool *defaulted) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (defaulted) *defaulted = !it || cJSON_IsNull(it);
    return get_int(root, path, key, dflt, out);
}

/* dense layers (qwen3_moe): decoder_sparse_step and mlp_only_layers into cfg; other model_types
 * refuse them (transformers' classes for them have no dense layers). */
static fm_status parse_dense_layers(fm_config *cfg, const cJSON *root, const char *path) {
    cfg->decoder_sparse_step = 1;
    memset(cfg->mlp_only_mask, 0, sizeof cfg->mlp_only_mask);
    const cJSON *mo = cJSON_GetObjectItemCaseSensitive(root, "mlp_only_layers");
    const cJSON *ds = cJSON_GetObjectItemCaseSensitive(root, "decoder_sparse_step");
    if (cfg->model_type != FM_MODEL_QWEN3_MOE) {
        if (mo && !cJSON_IsNull(mo) && !(cJSON_IsArray(mo) && cJSON_GetArraySize(mo) == 0))
            return fm_error(FM_ERR_UNSUPPORTED, "%s: \"mlp_only_layers\" is set, but %s has no dense layers (only "
                            "qwen3_moe reads the field); remove it", path, cfg->model_type_name);
        if (ds && !cJSON_IsNull(ds) && !(cJSON_IsNumber(ds) && ds->valuedouble == 1))
            return fm_error(FM_ERR_UNSUPPORTED, "%s: \"decoder_sparse_step\" is set, but %s has no dense layers (only "
                            "qwen3_moe reads the field); remove it or set it to 1", path, cfg->model_type_name);
        return FM_OK;
    }
    FM_TRY(get_int(root, path, "decoder_sparse_step", 1, &cfg->decoder_sparse_step));
    if (cfg->decoder_sparse_step < 1)
        return fm_error(FM_ERR_CONFIG, "%s: \"decoder_sparse_step\" must be >= 1 (layer i is MoE when (i + 1) %% step "
                        "== 0), found %lld", path, (long long)cfg->decoder_sparse_step);
    if (!mo || cJSON_IsNull(mo)) return FM_OK;
    if (!cJSON_IsArray(mo))
        return fm_error(FM_ERR_FORMAT, "%s: \"mlp_only_layers\" must be a list of layer indices", path);
    const cJSON *it;
    cJSON_ArrayForEach(it, mo) {
        if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || it->valuedouble < 0 ||
            it->valuedouble >= FM_CONFIG_MLP_ONLY_MAX)
            return fm_error(FM_ERR_CONFIG, "%s: \"mlp_only_layers\" holds %s; expected layer indices in [0, %d)", path,
                            cJSON_IsNumber(it) ? "a number outside the integers it takes" : "a non-number",
                            FM_CONFIG_MLP_ONLY_MAX);
        const int64_t l = (int64_t)it->valuedouble;
        cfg->mlp_only_mask[l / 64] |= 1ull << (l % 64);
    }
    return FM_OK;
}

bool fm_config_layer_is_moe(const fm_config *c, int64_t l) {
    if (l < c->first_k_dense_replace) return false; /* glm4_moe's first dense layers */
    if (l < FM_CONFIG_MLP_ONLY_MAX && (c->mlp_only_mask[l / 64] >> (l % 64) & 1)) return false;
    return c->num_experts > 0 && (l + 1) % (c->decoder_sparse_step > 0 ? c->decoder_sparse_step : 1) == 0;
}

int64_t fm_config_num_moe_layers(const fm_config *c) {
    int64_t n = 0;
    for (int64_t l = 0; l < c->num_hidden_layers; l++) n += fm_config_layer_is_moe(c, l);
    return n;
}

/* Reads every field (absent: transformers' default, d) into cfg; head_dim as given (0: absent)
 * into *hd_given. */
static fm_status parse_fields(fm_config *cfg, const cJSON *root, const char *path, const hf_defaults *d,
                              int64_t *hd_given, bool *kv_defaulted) {
    const fm_model_type t = cfg->model_type;
    FM_TRY(get_int(root, path, "vocab_size", d->vocab_size, &cfg->vocab_size));
    FM_TRY(get_int(root, path, "hidden_size", d->hidden_size, &cfg->hidden_size));
    FM_TRY(get_int(root, path, "num_hidden_layers", d->num_hidden_layers, &cfg->num_hidden_layers));
    FM_TRY(get_int(root, path, "num_attention_heads", d->num_attention_heads, &cfg->num_attention_heads));
    /* absent: the class's default; null (None): the attention heads, as MixtralConfig's and
     * OlmoeConfig's __post_init__ make it */
    const cJSON *kv = cJSON_GetObjectItemCaseSensitive(root, "num_key_value_heads");
    FM_TRY(get_int_d(root, path, "num_key_value_heads",
                     d->num_key_value_heads > 0 && !kv ? d->num_key_value_heads : cfg->num_attention_heads,
                     &cfg->num_key_value_heads, kv_defaulted));
    FM_TRY(get_int(root, path, "max_position_embeddings", d->max_position_embeddings,
                   &cfg->max_position_embeddings));
    const bool v2 = t == FM_MODEL_DEEPSEEK_V2;
    const bool ds = t == FM_MODEL_DEEPSEEK_V3 || v2; /* glm4_moe's MoE layout (v2: its own router), own defaults */
    if (t == FM_MODEL_QWEN3_MOE || t == FM_MODEL_GLM4_MOE || ds) {
        FM_TRY(get_int(root, path, "moe_intermediate_size", d->moe_intermediate_size, &cfg->moe_intermediate_size));
        FM_TRY(get_int(root, path, "intermediate_size", d->intermediate_size, &cfg->dense_intermediate_size));
    } else {
        FM_TRY(get_int(root, path, "intermediate_size", d->intermediate_size, &cfg->moe_intermediate_size));
    }
    /* transformers 5 writes qwen3_moe's expert count as num_local_experts: accept either name */
    const bool local = t == FM_MODEL_MIXTRAL || t == FM_MODEL_GPT_OSS; /* num_local_experts */
    const char *experts_key = local ? "num_local_experts"
                            : t == FM_MODEL_GLM4_MOE || ds ? "n_routed_experts" : "num_experts";
    const char *experts_alt = local ? "num_experts" : "num_local_experts";
    if (!cJSON_GetObjectItemCaseSensitive(root, experts_key) && cJSON_GetObjectItemCaseSensitive(root, experts_alt))
        experts_key = experts_alt;
    FM_TRY(get_int(root, path, experts_key, d->num_experts, &cfg->num_experts));
    FM_TRY(get_int(root, path, "num_experts_per_tok", d->num_experts_per_tok, &cfg->num_experts_per_tok));
    FM_TRY(get_num(root, path, "rope_theta", d->rope_theta, &cfg->rope_theta));
    /* transformers 5 writes RoPE settings as "rope_parameters": {"rope_type", "rope_theta", ...} */
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
    if (rp && !cJSON_IsNull(rp)) {
        if (!cJSON_IsObject(rp)) return fm_error(FM_ERR_FORMAT, "%s: \"rope_parameters\" must be an object", path);
        /* its rope_type and scaling parameters: fm_config_parse_attention */
        FM_TRY(get_num(rp, path, "rope_theta", cfg->rope_theta, &cfg->rope_theta));
    }
    FM_TRY(get_num(root, path, "rms_norm_eps", d->rms_norm_eps, &cfg->rms_norm_eps));
    FM_TRY(get_bool(root, path, "tie_word_embeddings", false, &cfg->tie_word_embeddings));
    FM_TRY(get_num(root, path, "router_aux_loss_coef", d->router_aux_loss_coef, &cfg->router_aux_loss_coef));
    FM_TRY(get_num(root, path, "router_z_loss_coef", 0.0, &cfg->router_z_loss_coef));
    FM_TRY(get_num(root, path, "initializer_range", 0.02, &cfg->initializer_range));
    /* mixtral renormalizes the top-k softmax; gpt_oss's softmax over the k selected logits is the
     * same function (exp(l_i) / sum over the k of exp(l_j)) */
    if (t == FM_MODEL_MIXTRAL || t == FM_MODEL_GPT_OSS) cfg->norm_topk_prob = true;
    else FM_TRY(get_bool(root, path, "norm_topk_prob", t == FM_MODEL_GLM4_MOE || (ds && !v2), &cfg->norm_topk_prob));
    cfg->qk_norm = t == FM_MODEL_QWEN3_MOE ? FM_QK_NORM_PER_HEAD
                 : t == FM_MODEL_OLMOE ? FM_QK_NORM_FULL : FM_QK_NORM_NONE;
    FM_TRY(get_int(root, path, "head_dim", t == FM_MODEL_GPT_OSS ? 64 : 0, hd_given)); /* GptOssConfig: 64 */
    cfg->routed_scaling_factor = 1.0;
    if (t == FM_MODEL_GLM4_MOE || (ds && !v2)) FM_TRY(fm_config_parse_glm4(cfg, root, path));
    if (v2) FM_TRY(fm_config_parse_deepseek_v2(cfg, root, path)); /* softmax router, greedy or group-limited */
    if (ds) FM_TRY(fm_config_parse_mla(cfg, root, path, hd_given)); /* head_dim: MLA's q/k head dim */
    return parse_dense_layers(cfg, root, path);
}

/* Features not implemented: refuse rather than train something else. */
static fm_status reject_unsupported(const fm_config *cfg, const cJSON *root, const char *path) {
    FM_TRY(reject_if_set(root, path, "clip_qkv", "clipping of q, k, v"));
    FM_TRY(reject_if_set(root, path, "use_sliding_window", "sliding-window attention"));
    FM_TRY(reject_if_set(root, path, "shared_expert_intermediate_size", "shared experts"));
    if (cfg->model_type == FM_MODEL_MIXTRAL) {
        const cJSON *sw = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
        if (sw && !cJSON_IsNull(sw))
            return fm_error(FM_ERR_UNSUPPORTED, "%s: \"sliding_window\" is %g, but flatmoe does not support "
                            "sliding-window attention yet; set it to null", path,
                            cJSON_IsNumber(sw) ? sw->valuedouble : 0.0);
    }
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, "hidden_act");
    if (act && cJSON_IsString(act) && strcmp(act->valuestring, "silu") != 0)
        return fm_error(FM_ERR_UNSUPPORTED, "%s: \"hidden_act\" is \"%s\"; flatmoe's experts are SwiGLU and "
                        "need \"silu\"", path, act->valuestring);
    return FM_OK;
}

/* Consistency of the values read (or defaulted). */
static fm_status check_fields(fm_config *cfg, const char *path, int64_t hd_given, bool kv_defaulted) {
    const fm_model_type t = cfg->model_type;
    const bool ds = t == FM_MODEL_DEEPSEEK_V3 || t == FM_MODEL_DEEPSEEK_V2;
    const char *width_key = t == FM_MODEL_QWEN3_MOE || t == FM_MODEL_GLM4_MOE || ds ? "moe_intermediate_size"
                                                                                   : "intermediate_size";
    const char *experts_key = t == FM_MODEL_MIXTRAL || t == FM_MODEL_GPT_OSS ? "num_local_experts"
                            : t == FM_MODEL_GLM4_MOE || ds ? "n_routed_experts" : "num_experts";
    if (cfg->num_hidden_layers > FM_CONFIG_MLP_ONLY_MAX) /* before any loop over the layers (fuzz_config's timeout) */
        return fm_error(FM_ERR_CONFIG, "%s: \"num_hidden_layers\" is %lld; flatmoe supports at most %d layers", path,
                        (long long)cfg->num_hidden_layers, FM_CONFIG_MLP_ONLY_MAX);
    const int64_t n_moe = fm_config_num_moe_layers(cfg);
    struct { const char *name; int64_t v; } pos[] = {
        {"vocab_size", cfg->vocab_size}, {"hidden_size", cfg->hidden_size},
        {"num_hidden_layers", cfg->num_hidden_layers}, {"num_attention_heads", cfg->num_attention_heads},
        {"num_key_value_heads", cfg->num_key_value_heads}, {"max_position_embeddings", cfg->max_position_embeddings},
        {width_key, cfg->moe_intermediate_size}, {experts_key, cfg->num_experts},
        {"num_experts_per_tok", cfg->num_experts_per_tok},
        {"intermediate_size", n_moe < cfg->num_hidden_layers ? cfg->dense_intermediate_size : 1},
    };
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (pos[i].v <= 0)
            return fm_error(FM_ERR_CONFIG, "%s: \"%s\" must be positive, found %lld", path, pos[i].name,
                            (long long)pos[i].v);
    if (n_moe == 0)
        return fm_error(FM_ERR_CONFIG, "%s: no layer is an MoE layer (decoder_sparse_step %lld, mlp_only_layers, %lld "
                        "layers); flatmoe trains MoE models: make at least one layer MoE", path,
                        (long long)cfg->decoder_sparse_step, (long long)cfg->num_hidden_layers);
    if (hd_given < 0)
        return fm_error(FM_ERR_CONFIG, "%s: \"head_dim\" must be positive, found %lld", path, (long long)hd_given);
    if (hd_given > 0) cfg->head_dim = hd_given;
    else {
        if (cfg->hidden_size % cfg->num_attention_heads)
            return fm_error(FM_ERR_CONFIG, "%s: num_attention_heads (%lld) must divide hidden_size (%lld); "
                            "change one of them or give head_dim", path, (long long)cfg->num_attention_heads,
                            (long long)cfg->hidden_size);
        cfg->head_dim = cfg->hidden_size / cfg->num_attention_heads;
    }
    if (cfg->head_dim % 2)
        return fm_error(FM_ERR_CONFIG, "%s: head_dim (%lld) must be even for rotary embeddings", path,
                        (long long)cfg->head_dim);
    if (cfg->num_attention_heads % cfg->num_key_value_heads)
        return fm_error(FM_ERR_CONFIG, "%s: num_key_value_heads (%lld%s) must divide num_attention_heads (%lld)%s",
                        path, (long long)cfg->num_key_value_heads,
                        kv_defaulted ? ", transformers' default for this model_type: the field is absent" : "",
                        (long long)cfg->num_attention_heads, kv_defaulted ? "; give num_key_value_heads" : "");
    if (cfg->num_experts_per_tok > cfg->num_experts)
        return fm_error(FM_ERR_CONFIG, "%s: num_experts_per_tok (%lld) must be <= %s (%lld)", path,
                        (long long)cfg->num_experts_per_tok, experts_key, (long long)cfg->num_experts);
    if (!(cfg->rms_norm_eps > 0) || !(cfg->rope_theta > 0) || !isfinite(cfg->rms_norm_eps) || !isfinite(cfg->rope_theta))
        return fm_error(FM_ERR_CONFIG, "%s: rms_norm_eps (%g) and rope_theta (%g) must be positive and finite", path,
                        cfg->rms_norm_eps, cfg->rope_theta);
    if (!(cfg->router_aux_loss_coef >= 0) || !(cfg->router_z_loss_coef >= 0) || !isfinite(cfg->router_aux_loss_coef) ||
        !isfinite(cfg->router_z_loss_coef))
        return fm_error(FM_ERR_CONFIG, "%s: router_aux_loss_coef (%g) and router_z_loss_coef (%g) must be finite and >= 0",
                        path, cfg->router_aux_loss_coef, cfg->router_z_loss_coef);
    if (!(cfg->initializer_range >= 0) || !isfinite(cfg->initializer_range))
        return fm_error(FM_ERR_CONFIG, "%s: \"initializer_range\" (%g) must be finite and >= 0 (the std of the initial "
                        "weights)", path, cfg->initializer_range);
    if (cfg->head_dim > (1LL << 30))
        return fm_error(FM_ERR_CONFIG, "%s: \"head_dim\" is %lld; flatmoe supports at most 2^30", path,
                        (long long)cfg->head_dim);
    /* Sizes flatmoe indexes with 64-bit counts: keep every product well inside int64. */
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (pos[i].v > (1LL << 30))
            return fm_error(FM_ERR_CONFIG, "%s: \"%s\" is %lld; flatmoe supports at most 2^30", path, pos[i].name,
                            (long long)pos[i].v);
    const double H = (double)cfg->hidden_size, I = (double)cfg->moe_intermediate_size, E = (double)cfg->num_experts;
    const double hd = (double)cfg->head_dim, nh = (double)cfg->num_attention_heads, V = (double)cfg->vocab_size;
    const double Id = (double)cfg->dense_intermediate_size;
    const double Is = (double)fm_config_shared_width(cfg);
    const double params =
        (double)cfg->num_hidden_layers * (E * 3 * H * I + 3 * H * (Id + Is) + 4 * H * nh * hd) + 2 * V * H;
    if (params > 1e15)
        return fm_error(FM_ERR_CONFIG, "%s: the config describes about %.3g parameters; flatmoe supports at most "
                        "1e15 (check hidden_size, num_hidden_layers, the expert sizes)", path, params);
    return FM_OK;
}

fm_status fm_config_parse(fm_config *cfg, const char *json_text, const char *path) {
    memset(cfg, 0, sizeof *cfg);
    cJSON *root = cJSON_Parse(json_text);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        long off = at ? (long)(at - json_text) : -1;
        return fm_error(FM_ERR_FORMAT, "%s: malformed JSON near byte %ld; expected a Hugging Face "
                        "config.json object", path, off);
    }
    fm_status st = FM_OK;
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    const hf_defaults *d = NULL;
    if (!cJSON_IsObject(root)) {
        st = fm_error(FM_ERR_FORMAT, "%s: expected a JSON object at the top level", path);
    } else if (!cJSON_IsString(mt)) {
        st = fm_error(FM_ERR_CONFIG, "%s: field \"model_type\" is missing or not a string; expected "
                      "one of qwen3_moe, olmoe, mixtral, glm4_moe, deepseek_v2, deepseek_v3, gpt_oss", path);
    } else {
        for (size_t i = 0; i < sizeof k_hf_defaults / sizeof k_hf_defaults[0]; i++)
            if (!strcmp(mt->valuestring, k_hf_defaults[i].name)) d = &k_hf_defaults[i];
        if (!d)
            st = fm_error(FM_ERR_CONFIG, "%s: unknown model_type \"%s\"; expected one of qwen3_moe, olmoe, "
                          "mixtral, glm4_moe, deepseek_v2, deepseek_v3, gpt_oss", path, mt->valuestring);
    }
    if (st == FM_OK) {
        snprintf(cfg->model_type_name, sizeof cfg->model_type_name, "%s", mt->valuestring);
        cfg->model_type = d->type;
        int64_t hd_given = 0;
        bool kv_defaulted = false;
        st = parse_fields(cfg, root, path, d, &hd_given, &kv_defaulted);
        if (st == FM_OK) st = fm_config_parse_attention(cfg, root, path); /* biases, RoPE kinds */
        if (st == FM_OK && cfg->model_type == FM_MODEL_GPT_OSS) st = fm_config_parse_gpt_oss(cfg, root, path);
        if (st == FM_OK) st = reject_unsupported(cfg, root, path);
        if (st == FM_OK) st = check_fields(cfg, path, hd_given, kv_defaulted);
        if (st == FM_OK) st = fm_config_check_attention(cfg, path);
    }
    cJSON_Delete(root);
    return st;
}

fm_status fm_config_load(fm_config *cfg, const char *path) {
    char *text;
    FM_TRY(fm_config_read_text(path, &text));
    fm_status st = fm_config_parse(cfg, text, path);
    fm_free(text);
    return st;
}

/* A float field written with a decimal point ("0.0", "10000.0"), as transformers' strict config
 * classes want a float there, not an integer. */
static void add_float(cJSON *o, const char *key, double v) {
    char buf[64];
    snprintf(buf, sizeof buf, "%.15g", v);
    if (strtod(buf, NULL) != v) snprintf(buf, sizeof buf, "%.17g", v); /* shortest that reads back */
    if (!strpbrk(buf, ".eEn")) strcat(buf, ".0");
    cJSON_AddItemToObject(o, key, cJSON_CreateRaw(buf));
}

char *fm_config_to_json(const fm_config *c) {
    cJSON *o = cJSON_CreateObject();
    const char *arch = c->model_type == FM_MODEL_QWEN3_MOE ? "Qwen3MoeForCausalLM"
                     : c->model_type == FM_MODEL_OLMOE ? "OlmoeForCausalLM"
                     : c->model_type == FM_MODEL_GLM4_MOE ? "Glm4MoeForCausalLM"
                     : c->model_type == FM_MODEL_DEEPSEEK_V2 ? "DeepseekV2ForCausalLM"
                     : c->mla ? "DeepseekV3ForCausalLM"
                     : c->model_type == FM_MODEL_GPT_OSS ? "GptOssForCausalLM" : "MixtralForCausalLM";
    cJSON *a = cJSON_AddArrayToObject(o, "architectures");
    cJSON_AddItemToArray(a, cJSON_CreateString(arch));
    cJSON_AddStringToObject(o, "model_type", c->model_type_name);
    cJSON_AddNumberToObject(o, "vocab_size", (double)c->vocab_size);
    cJSON_AddNumberToObject(o, "hidden_size", (double)c->hidden_size);
    if (c->model_type == FM_MODEL_QWEN3_MOE || c->model_type == FM_MODEL_GLM4_MOE || c->mla) {
        cJSON_AddNumberToObject(o, "moe_intermediate_size", (double)c->moe_intermediate_size);
        cJSON_AddNumberToObject(o, "intermediate_size", (double)c->dense_intermediate_size);
    } else {
        cJSON_AddNumberToObject(o, "intermediate_size", (double)c->moe_intermediate_size);
    }
    cJSON_AddNumberToObject(o, "num_hidden_layers", (double)c->num_hidden_layers);
    cJSON_AddNumberToObject(o, "num_attention_heads", (double)c->num_attention_heads);
    cJSON_AddNumberToObject(o, "num_key_value_heads", (double)c->num_key_value_heads);
    if (!c->mla) cJSON_AddNumberToObject(o, "head_dim", (double)c->head_dim); /* MLA: transformers' is qk_rope_head_dim */
    cJSON_AddStringToObject(o, "hidden_act", "silu");
    cJSON_AddNumberToObject(o, "max_position_embeddings", (double)c->max_position_embeddings);
    add_float(o, "rope_theta", c->rope_theta);
    add_float(o, "rms_norm_eps", c->rms_norm_eps);
    fm_config_attention_to_json(c, o); /* attention_bias, partial_rotary_factor, rope_scaling */
    cJSON_AddNumberToObject(o, c->model_type == FM_MODEL_MIXTRAL || c->model_type == FM_MODEL_GPT_OSS ? "num_local_experts"
                               : c->model_type == FM_MODEL_GLM4_MOE || c->mla ? "n_routed_experts" : "num_experts",
                            (double)c->num_experts);
    cJSON_AddNumberToObject(o, "num_experts_per_tok", (double)c->num_experts_per_tok);
    if (c->model_type != FM_MODEL_MIXTRAL && c->model_type != FM_MODEL_GPT_OSS)
        cJSON_AddBoolToObject(o, "norm_topk_prob", c->norm_topk_prob);
    if (c->model_type == FM_MODEL_QWEN3_MOE) {
        cJSON_AddNumberToObject(o, "decoder_sparse_step", (double)c->decoder_sparse_step);
        cJSON *mo = cJSON_AddArrayToObject(o, "mlp_only_layers");
        for (int64_t l = 0; l < FM_CONFIG_MLP_ONLY_MAX; l++)
            if (c->mlp_only_mask[l / 64] >> (l % 64) & 1) cJSON_AddItemToArray(mo, cJSON_CreateNumber((double)l));
    }
    const bool v2 = c->model_type == FM_MODEL_DEEPSEEK_V2;
    if (c->model_type == FM_MODEL_GLM4_MOE || (c->mla && !v2)) fm_config_glm4_to_json(c, o);
    if (v2) fm_config_deepseek_v2_to_json(c, o);
    if (c->mla) fm_config_mla_to_json(c, o);
    if (c->model_type == FM_MODEL_GPT_OSS) fm_config_gpt_oss_to_json(c, o);
    if ((c->model_type != FM_MODEL_GLM4_MOE && !c->mla) || c->router_aux_loss_coef > 0) /* v2: a flatmoe extension */
        add_float(o, "router_aux_loss_coef", c->router_aux_loss_coef);
    if (c->router_z_loss_coef > 0) add_float(o, "router_z_loss_coef", c->router_z_loss_coef);
    add_float(o, "initializer_range", c->initializer_range);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_word_embeddings);
    cJSON_AddStringToObject(o, "torch_dtype", "float32");
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    size_t n = strlen(s);
    char *out = fm_malloc(n + 2);
    if (out) { memcpy(out, s, n); out[n] = '\n'; out[n + 1] = 0; }
    cJSON_free(s);
    return out;
}

static int64_t attn_params(const fm_config *c) {
    if (c->mla) return fm_config_mla_attn_params(c); /* multi-head latent attention */
    int64_t H = c->hidden_size, hd = c->head_dim, nh = c->num_attention_heads, nkv = c->num_key_value_heads;
    int64_t p = H * nh * hd * 2 + H * nkv * hd * 2; /* q, o, k, v */
    if (c->qk_norm == FM_QK_NORM_PER_HEAD) p += 2 * hd;
    if (c->qk_norm == FM_QK_NORM_FULL) p += nh * hd + nkv * hd;
    if (c->attention_bias) p += nh * hd + 2 * nkv * hd; /* q, k, v biases */
    if (c->attention_o_bias) p += H;                    /* o bias */
    return p;
}

/* One dense layer's MLP: gate, up [Id,H] and down [H,Id]. */
static int64_t dense_params(const fm_config *c) { return 3 * c->hidden_size * c->dense_intermediate_size; }

/* An MoE layer's parameters beside the routed experts: the shared experts' MLP and, with the
 * sigmoid router, e_score_correction_bias [E] (a buffer in transformers, held in the table). */
int64_t fm_config_moe_extra_params(const fm_config *c) {
    return 3 * c->hidden_size * fm_config_shared_width(c) + (c->router_sigmoid ? c->num_experts : 0);
}

int64_t fm_config_num_params(const fm_config *c) {
    int64_t H = c->hidden_size, I = c->moe_intermediate_size, E = c->num_experts, V = c->vocab_size;
    const int64_t L = c->num_hidden_layers, Lm = fm_config_num_moe_layers(c);
    int64_t layer = attn_params(c) + 2 * H;
    return V * H * (c->tie_word_embeddings ? 1 : 2) + L * layer + Lm * (E * H + E * 3 * H * I + fm_config_moe_extra_params(c)) +
           (L - Lm) * dense_params(c) + H + fm_config_gpt_oss_extra_params(c, false);
}

int64_t fm_config_num_active_params(const fm_config *c) {
    int64_t H = c->hidden_size, I = c->moe_intermediate_size, E = c->num_experts, V = c->vocab_size;
    int64_t k = c->num_experts_per_tok;
    const int64_t L = c->num_hidden_layers, Lm = fm_config_num_moe_layers(c);
    int64_t layer = attn_params(c) + 2 * H;
    return V * H + L * layer + Lm * (E * H + k * 3 * H * I + fm_config_moe_extra_params(c)) + (L - Lm) * dense_params(c) + H +
           fm_config_gpt_oss_extra_params(c, true);
}
