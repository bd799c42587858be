/* gpt_oss's config fields (fm_config.h: fm_config_parse_gpt_oss, fm_config_gpt_oss_to_json), with
 * the defaults of transformers' GptOssConfig (src/transformers/models/gpt_oss/
 * configuration_gpt_oss.py): sliding_window 128; layer_types absent: layer i is
 * "sliding_attention" when i is even, else "full_attention"; swiglu_limit 7.0, swiglu_alpha 1.702;
 * attention_bias true (q, k, v and o: fm_config_attn.c); rope_parameters absent: YaRN with factor
 * 32, beta_fast 32, beta_slow 1, truncate false, original_max_position_embeddings 4096;
 * router_aux_loss_coef 0.001 and output_router_logits false.
 *
 * The model (modeling_gpt_oss.py): every layer is MoE; each attention head has a learned sink
 * logit (self_attn.sinks [nh]) that joins the softmax's denominator and is dropped from its output;
 * the router is a Linear with a bias (mlp.router.weight [E,H], mlp.router.bias [E]) whose top-k
 * logits are softmaxed (flatmoe's softmax then renormalized top-k: the same function); the experts
 * are fused with biases (mlp.experts.gate_up_proj [E,H,2I], gate/up interleaved along 2I,
 * gate_up_proj_bias [E,2I], down_proj [E,I,H], down_proj_bias [E,H]) and apply the clamped SwiGLU
 * (backend swiglu_clamp_fwd).
 *
 * The load-balancing loss: transformers adds router_aux_loss_coef times it only when
 * output_router_logits is true (the released configs set the coefficient 0.9 and the flag false);
 * flatmoe follows: with output_router_logits false (or absent) the coefficient in force is 0. */
#include "fm_config.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

static fm_status oss_num(const cJSON *root, const char *path, const char *key, double dflt, double *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) { *out = dflt; return FM_OK; }
    if (!cJSON_IsNumber(it)) return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" must be a number", path, key);
    *out = it->valuedouble;
    return FM_OK;
}

/* layer_types into cfg->sliding_mask (absent or null: GptOssConfig's alternation). */
static fm_status parse_layer_types(fm_config *cfg, const cJSON *root, const char *path) {
    memset(cfg->sliding_mask, 0, sizeof cfg->sliding_mask);
    const int64_t L = cfg->num_hidden_layers;
    if (L > FM_CONFIG_MLP_ONLY_MAX)
        return fm_error(FM_ERR_CONFIG, "%s: \"num_hidden_layers\" is %lld; flatmoe's gpt_oss supports at most %d layers",
                        path, (long long)L, FM_CONFIG_MLP_ONLY_MAX);
    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(root, "layer_types");
    if (!lt || cJSON_IsNull(lt)) {
        for (int64_t l = 0; l < L; l += 2) cfg->sliding_mask[l / 64] |= 1ull << (l % 64);
        return FM_OK;
    }
    if (!cJSON_IsArray(lt))
        return fm_error(FM_ERR_FORMAT, "%s: \"layer_types\" must be a list of \"sliding_attention\" / \"full_attention\"",
                        path);
    const int n = cJSON_GetArraySize(lt);
    if (n != L)
        return fm_error(FM_ERR_CONFIG, "%s: \"layer_types\" has %d entries, but num_hidden_layers is %lld; give one "
                        "entry per layer", path, n, (long long)L);
    int64_t l = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, lt) {
        const char *v = cJSON_IsString(it) ? it->valuestring : NULL;
        if (v && !strcmp(v, "sliding_attention")) cfg->sliding_mask[l / 64] |= 1ull << (l % 64);
        else if (!v || strcmp(v, "full_attention"))
            return fm_error(FM_ERR_CONFIG, "%s: \"layer_types\"[%lld] is %s%s%s; expected \"sliding_attention\" or "
                            "\"full_attention\"", path, (long long)l, v ? "\"" : "", v ? v : "not a string",
                            v ? "\"" : "");
        l++;
    }
    return FM_OK;
}

fm_status fm_config_parse_gpt_oss(fm_config *cfg, const void *root_v, const char *path) {
    const cJSON *root = root_v;
    cfg->attention_sinks = true;
    cfg->router_linear_bias = true;
    cfg->expert_bias = true;
    FM_TRY(parse_layer_types(cfg, root, path));
    bool any_sliding = false;
    for (int64_t l = 0; l < cfg->num_hidden_layers; l++) any_sliding |= fm_config_layer_is_sliding(cfg, l);
    const cJSON *sw = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
    double w = 128;
    if (sw && cJSON_IsNull(sw)) w = 0;
    else FM_TRY(oss_num(root, path, "sliding_window", 128, &w));
    if (w != floor(w) || w < 0 || w > 9e15)
        return fm_error(FM_ERR_FORMAT, "%s: \"sliding_window\" must be a non-negative integer, found %g", path, w);
    cfg->sliding_window = (int64_t)w;
    if (any_sliding && cfg->sliding_window <= 0)
        return fm_error(FM_ERR_CONFIG, "%s: layer_types marks sliding_attention layers, but \"sliding_window\" is %s; "
                        "give the window (128 in the released models) or make every layer full_attention", path,
                        sw && cJSON_IsNull(sw) ? "null" : "0");
    FM_TRY(oss_num(root, path, "swiglu_limit", 7.0, &cfg->swiglu_limit));
    FM_TRY(oss_num(root, path, "swiglu_alpha", 1.702, &cfg->swiglu_alpha));
    if (!(cfg->swiglu_limit > 0) || !isfinite(cfg->swiglu_limit) || !(cfg->swiglu_alpha > 0) ||
        !isfinite(cfg->swiglu_alpha))
        return fm_error(FM_ERR_CONFIG, "%s: \"swiglu_limit\" (%g) and \"swiglu_alpha\" (%g) must be positive and finite",
                        path, cfg->swiglu_limit, cfg->swiglu_alpha);
    const cJSON *orl = cJSON_GetObjectItemCaseSensitive(root, "output_router_logits");
    if (orl && !cJSON_IsNull(orl) && !cJSON_IsBool(orl))
        return fm_error(FM_ERR_FORMAT, "%s: field \"output_router_logits\" must be true or false", path);
    if (!cJSON_IsTrue(orl)) cfg->router_aux_loss_coef = 0; /* transformers adds the loss only with the flag */
    /* GptOssConfig's rope_parameters when the file names no RoPE scaling at all */
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
    if ((!rs || cJSON_IsNull(rs)) && (!rp || cJSON_IsNull(rp))) {
        fm_rope_scaling *r = &cfg->rope_scaling;
        memset(r, 0, sizeof *r);
        r->type = FM_ROPE_YARN;
        r->factor = 32.0;
        r->beta_fast = 32.0;
        r->beta_slow = 1.0;
        r->truncate = false;
        r->original_max_position_embeddings = 4096;
    }
    return FM_OK;
}

static void oss_float(cJSON *o, const char *key, double v) {
    char buf[64];
    snprintf(buf, sizeof buf, "%.17g", v);
    if (!strpbrk(buf, ".eEn")) strcat(buf, ".0");
    cJSON_AddItemToObject(o, key, cJSON_CreateRaw(buf));
}

void fm_config_gpt_oss_to_json(const fm_config *c, void *json) {
    cJSON *o = json;
    cJSON_AddNumberToObject(o, "sliding_window", (double)c->sliding_window);
    cJSON *lt = cJSON_AddArrayToObject(o, "layer_types");
    for (int64_t l = 0; l < c->num_hidden_layers; l++)
        cJSON_AddItemToArray(lt, cJSON_CreateString(fm_config_layer_is_sliding(c, l) ? "sliding_attention"
                                                                                     : "full_attention"));
    oss_float(o, "swiglu_limit", c->swiglu_limit);
    oss_float(o, "swiglu_alpha", c->swiglu_alpha);
    cJSON_AddBoolToObject(o, "output_router_logits", c->router_aux_loss_coef > 0);
    /* plain RoPE said so: absent, GptOssConfig's YaRN would be read back */
    if (c->rope_scaling.type == FM_ROPE_DEFAULT)
        cJSON_AddStringToObject(cJSON_AddObjectToObject(o, "rope_scaling"), "rope_type", "default");
}

bool fm_config_layer_is_sliding(const fm_config *c, int64_t l) {
    return c->model_type == FM_MODEL_GPT_OSS && l >= 0 && l < FM_CONFIG_MLP_ONLY_MAX &&
           (c->sliding_mask[l / 64] >> (l % 64) & 1);
}

int64_t fm_config_gpt_oss_extra_params(const fm_config *c, bool active) {
    if (c->model_type != FM_MODEL_GPT_OSS) return 0;
    const int64_t H = c->hidden_size, I = c->moe_intermediate_size, E = c->num_experts;
    const int64_t k = c->num_experts_per_tok, Lm = fm_config_num_moe_layers(c);
    const int64_t sinks = c->attention_sinks ? c->num_attention_heads : 0;
    const int64_t rb = c->router_linear_bias ? E : 0;
    const int64_t eb = c->expert_bias ? (active ? k : E) * (2 * I + H) : 0;
    return c->num_hidden_layers * sinks + Lm * (rb + eb);
}

double fm_config_attention_span(const fm_config *c, int64_t l, int64_t T) {
    const int64_t W = fm_config_layer_is_sliding(c, l) ? c->sliding_window : 0;
    if (W <= 0 || W >= T) return (double)T;
    return 2.0 * ((double)W * (double)(W + 1) / 2.0 + (double)(T - W) * (double)W) / (double)T;
}
