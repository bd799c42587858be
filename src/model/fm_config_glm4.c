/* glm4_moe's config fields (fm_config.h: fm_config_parse_glm4, fm_config_glm4_to_json), with the
 * defaults of transformers' Glm4MoeConfig (src/transformers/models/glm4_moe/
 * configuration_glm4_moe.py): n_shared_experts 1, routed_scaling_factor 1.0, n_group 1,
 * topk_group 1, first_k_dense_replace 1, norm_topk_prob true (fm_config.c), use_qk_norm false
 * (partial_rotary_factor 0.5 and attention_bias false, q/k/v only: fm_config_attn.c); num_nextn_predict_layers 0 (the class does
 * not read it: Glm4MoeModel skips the MTP layer's weights on load, and so does flatmoe). The
 * router is DeepSeek-V3's (Glm4MoeTopkRouter: sigmoid scores, e_score_correction_bias, groups). */
#include "fm_config.h"

#include "../backend/fm_backend.h" /* FM_ROUTER_MAX_GROUPS */

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

static fm_status glm_int(const cJSON *root, const char *path, const char *key, int64_t dflt, int64_t *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) { *out = dflt; return FM_OK; }
    if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || fabs(it->valuedouble) > 9e15)
        return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" must be an integer", path, key);
    *out = (int64_t)it->valuedouble;
    return FM_OK;
}

static fm_status glm_num(const cJSON *root, const char *path, const char *key, double dflt, double *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) { *out = dflt; return FM_OK; }
    if (!cJSON_IsNumber(it)) return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" must be a number", path, key);
    *out = it->valuedouble;
    return FM_OK;
}

static fm_status glm_bool(const cJSON *root, const char *path, const char *key, bool dflt, bool *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) { *out = dflt; return FM_OK; }
    if (!cJSON_IsBool(it)) return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" must be true or false", path, key);
    *out = cJSON_IsTrue(it);
    return FM_OK;
}

fm_status fm_config_parse_glm4(fm_config *cfg, const void *root_v, const char *path) {
    const cJSON *root = root_v;
    /* deepseek_v3 shares the block with DeepseekV3Config's defaults: first_k_dense_replace 3,
     * n_group 8, topk_group 4, routed_scaling_factor 2.5 (n_shared_experts 1 as glm4_moe's) */
    const bool ds = cfg->model_type == FM_MODEL_DEEPSEEK_V3;
    cfg->router_sigmoid = true;
    FM_TRY(glm_int(root, path, "first_k_dense_replace", ds ? 3 : 1, &cfg->first_k_dense_replace));
    FM_TRY(glm_int(root, path, "n_shared_experts", 1, &cfg->n_shared_experts));
    FM_TRY(glm_int(root, path, "n_group", ds ? 8 : 1, &cfg->n_group));
    FM_TRY(glm_int(root, path, "topk_group", ds ? 4 : 1, &cfg->topk_group));
    FM_TRY(glm_num(root, path, "routed_scaling_factor", ds ? 2.5 : 1.0, &cfg->routed_scaling_factor));
    FM_TRY(glm_int(root, path, "num_nextn_predict_layers", 0, &cfg->num_nextn_predict_layers));
    bool qk = false; /* deepseek_v3 has no QK-norm (DeepseekV3Attention) */
    if (!ds) FM_TRY(glm_bool(root, path, "use_qk_norm", false, &qk));
    cfg->qk_norm = qk ? FM_QK_NORM_PER_HEAD : FM_QK_NORM_NONE; /* Glm4MoeRMSNorm(head_dim) on q and k */
    if (cfg->first_k_dense_replace < 0 || cfg->n_shared_experts < 0)
        return fm_error(FM_ERR_CONFIG, "%s: \"first_k_dense_replace\" (%lld) and \"n_shared_experts\" (%lld) must be "
                        ">= 0", path, (long long)cfg->first_k_dense_replace, (long long)cfg->n_shared_experts);
    if (cfg->num_nextn_predict_layers < 0)
        return fm_error(FM_ERR_CONFIG, "%s: \"num_nextn_predict_layers\" must be >= 0, found %lld", path,
                        (long long)cfg->num_nextn_predict_layers);
    const int64_t E = cfg->num_experts;
    if (cfg->n_group < 1 || E % cfg->n_group != 0 || cfg->n_group > FM_ROUTER_MAX_GROUPS)
        return fm_error(FM_ERR_CONFIG, "%s: \"n_group\" (%lld) must be in [1, %d] and divide n_routed_experts "
                        "(%lld)", path, (long long)cfg->n_group, FM_ROUTER_MAX_GROUPS, (long long)E);
    if (cfg->n_group > 1 && E / cfg->n_group < 2)
        return fm_error(FM_ERR_CONFIG, "%s: \"n_group\" (%lld) leaves %lld expert(s) per group; a group's score is "
                        "the sum of its best 2 experts' (Glm4MoeTopkRouter): use at most %lld groups", path,
                        (long long)cfg->n_group, (long long)(E / cfg->n_group), (long long)(E / 2));
    if (cfg->topk_group < 1 || cfg->topk_group > cfg->n_group)
        return fm_error(FM_ERR_CONFIG, "%s: \"topk_group\" (%lld) must be in [1, n_group = %lld]", path,
                        (long long)cfg->topk_group, (long long)cfg->n_group);
    if (cfg->num_experts_per_tok > cfg->topk_group * (E / cfg->n_group))
        return fm_error(FM_ERR_CONFIG, "%s: num_experts_per_tok (%lld) exceeds the experts of the topk_group (%lld) "
                        "groups kept (%lld each); raise topk_group or lower num_experts_per_tok", path,
                        (long long)cfg->num_experts_per_tok, (long long)cfg->topk_group, (long long)(E / cfg->n_group));
    if (!(cfg->routed_scaling_factor > 0) || !isfinite(cfg->routed_scaling_factor))
        return fm_error(FM_ERR_CONFIG, "%s: \"routed_scaling_factor\" must be positive and finite, found %g", path,
                        cfg->routed_scaling_factor);
    if (cfg->router_aux_loss_coef != 0 || cfg->router_z_loss_coef != 0)
        return fm_error(FM_ERR_UNSUPPORTED, "%s: router_aux_loss_coef (%g) / router_z_loss_coef (%g) are set, but "
                        "%s's sigmoid router balances without the batch-wise auxiliary loss: remove them and use "
                        "--moe-router-bias-update-rate (and --moe-seq-aux-loss-coeff for DeepSeek-V3's sequence-wise "
                        "loss)",
                        path, cfg->router_aux_loss_coef, cfg->router_z_loss_coef, cfg->model_type_name);
    if (cfg->first_k_dense_replace >= cfg->num_hidden_layers)
        return fm_error(FM_ERR_CONFIG, "%s: \"first_k_dense_replace\" (%lld) makes all %lld layers dense; flatmoe "
                        "trains MoE models: make at least one layer MoE", path,
                        (long long)cfg->first_k_dense_replace, (long long)cfg->num_hidden_layers);
    return FM_OK;
}

void fm_config_glm4_to_json(const fm_config *c, void *json) {
    cJSON *o = json;
    cJSON_AddNumberToObject(o, "n_shared_experts", (double)c->n_shared_experts);
    cJSON_AddNumberToObject(o, "first_k_dense_replace", (double)c->first_k_dense_replace);
    cJSON_AddNumberToObject(o, "n_group", (double)c->n_group);
    cJSON_AddNumberToObject(o, "topk_group", (double)c->topk_group);
    fm_config_json_add_float(o, "routed_scaling_factor", c->routed_scaling_factor);
    if (!c->mla) cJSON_AddBoolToObject(o, "use_qk_norm", c->qk_norm == FM_QK_NORM_PER_HEAD);
    cJSON_AddNumberToObject(o, "num_nextn_predict_layers", (double)c->num_nextn_predict_layers);
}

int64_t fm_config_shared_width(const fm_config *c) { return c->moe_intermediate_size * c->n_shared_experts; }

int64_t fm_config_dense_ws_width(const fm_config *c) {
    const int64_t d = fm_config_num_moe_layers(c) < c->num_hidden_layers ? c->dense_intermediate_size : 0;
    const int64_t s = fm_config_shared_width(c);
    return d > s ? d : s;
}
