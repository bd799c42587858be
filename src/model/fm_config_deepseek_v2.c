/* deepseek_v2's MoE fields (fm_config.h: fm_config_parse_deepseek_v2, fm_config_deepseek_v2_to_json),
 * with the defaults of transformers' DeepseekV2Config (src/transformers/models/deepseek_v2/
 * configuration_deepseek_v2.py, transformers 5): first_k_dense_replace 0, n_shared_experts 2,
 * n_routed_experts 64, moe_intermediate_size 1407, routed_scaling_factor 1.0, topk_method "greedy",
 * n_group None, topk_group None, num_experts_per_tok None, norm_topk_prob false (read, not used:
 * DeepseekV2Moe never renormalizes). The layer rule is DeepseekV2DecoderLayer's: layer i is MoE when
 * i >= first_k_dense_replace (moe_layer_freq is not read by transformers; DeepSeek's own
 * modeling_deepseek.py also asks i % moe_layer_freq == 0, so a value other than 1 is refused). The
 * router is DeepseekV2Moe.route_tokens_to_experts (fm_router.h FM_ROUTER_SCORE_SOFTMAX_GROUP); the
 * attention is deepseek_v3's MLA (fm_config_mla.c), its softmax scale with YaRN's
 * m(factor, mscale_all_dim)^2 as transformers applies it to DeepSeek-V2 since its PR #47435. */
#include "fm_config.h"

#include "../backend/fm_backend.h" /* FM_ROUTER_MAX_GROUPS */

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* An integer field: dflt when absent; *is_null when present and null (then dflt too). */
static fm_status v2_int(const cJSON *root, const char *path, const char *key, int64_t dflt, int64_t *out,
                        bool *is_null) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (is_null) *is_null = it && cJSON_IsNull(it);
    if (!it || cJSON_IsNull(it)) { *out = dflt; return FM_OK; }
    if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || fabs(it->valuedouble) > 9e15)
        return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" must be an integer", path, key);
    *out = (int64_t)it->valuedouble;
    return FM_OK;
}

/* A string field: dflt when absent or null. */
static fm_status v2_str(const cJSON *root, const char *path, const char *key, const char *dflt, const char **out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) { *out = dflt; return FM_OK; }
    if (!cJSON_IsString(it)) return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" must be a string", path, key);
    *out = it->valuestring;
    return FM_OK;
}

/* The router's fields: topk_method, scoring_func, n_group, topk_group, routed_scaling_factor. */
static fm_status parse_router(fm_config *cfg, const cJSON *root, const char *path) {
    const char *method, *scoring;
    FM_TRY(v2_str(root, path, "topk_method", "greedy", &method));
    if (!strcmp(method, "noaux_tc"))
        return fm_error(FM_ERR_UNSUPPORTED, "%s: \"topk_method\" is \"noaux_tc\" (DeepSeek-V3's sigmoid router with "
                        "e_score_correction_bias), which transformers' DeepseekV2Moe does not run; a DeepSeek-V3 "
                        "checkpoint is model_type \"deepseek_v3\": set that, or topk_method \"greedy\" / "
                        "\"group_limited_greedy\"", path);
    if (strcmp(method, "greedy") && strcmp(method, "group_limited_greedy"))
        return fm_error(FM_ERR_UNSUPPORTED, "%s: \"topk_method\" is \"%s\"; deepseek_v2's router knows \"greedy\" and "
                        "\"group_limited_greedy\" (transformers' DeepseekV2Moe): set one of them", path, method);
    cfg->router_group_limited = !strcmp(method, "group_limited_greedy");
    FM_TRY(v2_str(root, path, "scoring_func", "softmax", &scoring));
    if (strcmp(scoring, "softmax"))
        return fm_error(FM_ERR_UNSUPPORTED, "%s: \"scoring_func\" is \"%s\", but deepseek_v2's router scores with a "
                        "softmax (transformers' DeepseekV2Moe ignores the field; a sigmoid router is model_type "
                        "\"deepseek_v3\"): remove it or set \"softmax\"", path, scoring);
    bool ng_null = false, tg_null = false;
    FM_TRY(v2_int(root, path, "n_group", 0, &cfg->n_group, &ng_null));
    FM_TRY(v2_int(root, path, "topk_group", 0, &cfg->topk_group, &tg_null));
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(root, "routed_scaling_factor");
    cfg->routed_scaling_factor = 1.0;
    if (rs && !cJSON_IsNull(rs)) {
        if (!cJSON_IsNumber(rs)) return fm_error(FM_ERR_FORMAT, "%s: field \"routed_scaling_factor\" must be a number", path);
        cfg->routed_scaling_factor = rs->valuedouble;
    }
    if (!(cfg->routed_scaling_factor > 0) || !isfinite(cfg->routed_scaling_factor))
        return fm_error(FM_ERR_CONFIG, "%s: \"routed_scaling_factor\" must be positive and finite, found %g", path,
                        cfg->routed_scaling_factor);
    const int64_t E = cfg->num_experts;
    if (!cfg->router_group_limited) { /* greedy: the groups are not read (any value, or none, is accepted) */
        if (cfg->n_group < 0 || cfg->topk_group < 0)
            return fm_error(FM_ERR_CONFIG, "%s: \"n_group\" (%lld) and \"topk_group\" (%lld) must be >= 0 or null", path,
                            (long long)cfg->n_group, (long long)cfg->topk_group);
        return FM_OK;
    }
    if (cfg->n_group == 0 || cfg->topk_group == 0) {
        const bool ng = cfg->n_group == 0;
        return fm_error(FM_ERR_CONFIG, "%s: \"topk_method\" \"group_limited_greedy\" needs \"n_group\" and \"topk_group\", "
                        "but \"%s\" is %s (DeepseekV2Config's default is None); give both (DeepSeek-V2: 8 and 3)", path,
                        ng ? "n_group" : "topk_group", (ng ? ng_null : tg_null) ? "null" : "absent or 0");
    }
    if (cfg->n_group < 1 || E % cfg->n_group != 0 || cfg->n_group > FM_ROUTER_MAX_GROUPS)
        return fm_error(FM_ERR_CONFIG, "%s: \"n_group\" (%lld) must be in [1, %d] and divide n_routed_experts (%lld)",
                        path, (long long)cfg->n_group, FM_ROUTER_MAX_GROUPS, (long long)E);
    if (cfg->topk_group < 1 || cfg->topk_group > cfg->n_group)
        return fm_error(FM_ERR_CONFIG, "%s: \"topk_group\" (%lld) must be in [1, n_group = %lld]", path,
                        (long long)cfg->topk_group, (long long)cfg->n_group);
    if (cfg->num_experts_per_tok > cfg->topk_group * (E / cfg->n_group))
        return fm_error(FM_ERR_CONFIG, "%s: num_experts_per_tok (%lld) exceeds the experts of the topk_group (%lld) "
                        "groups kept (%lld each); raise topk_group or lower num_experts_per_tok", path,
                        (long long)cfg->num_experts_per_tok, (long long)cfg->topk_group, (long long)(E / cfg->n_group));
    return FM_OK;
}

fm_status fm_config_parse_deepseek_v2(fm_config *cfg, const void *root_v, const char *path) {
    const cJSON *root = root_v;
    const cJSON *k = cJSON_GetObjectItemCaseSensitive(root, "num_experts_per_tok");
    if (!k || cJSON_IsNull(k))
        return fm_error(FM_ERR_CONFIG, "%s: \"num_experts_per_tok\" is %s; DeepseekV2Config's default is None (a dense "
                        "model), which flatmoe does not train: give it (DeepSeek-V2 and V2-Lite: 6)", path,
                        k ? "null" : "absent");
    bool sh_null = false;
    FM_TRY(v2_int(root, path, "first_k_dense_replace", 0, &cfg->first_k_dense_replace, NULL));
    FM_TRY(v2_int(root, path, "n_shared_experts", 2, &cfg->n_shared_experts, &sh_null));
    if (sh_null)
        return fm_error(FM_ERR_CONFIG, "%s: \"n_shared_experts\" is null; transformers' DeepseekV2Moe then builds no "
                        "shared experts but still calls them: give a number (0: none; DeepSeek-V2: 2)", path);
    if (cfg->first_k_dense_replace < 0 || cfg->n_shared_experts < 0)
        return fm_error(FM_ERR_CONFIG, "%s: \"first_k_dense_replace\" (%lld) and \"n_shared_experts\" (%lld) must be "
                        ">= 0", path, (long long)cfg->first_k_dense_replace, (long long)cfg->n_shared_experts);
    const cJSON *mb = cJSON_GetObjectItemCaseSensitive(root, "mlp_bias");
    if (mb && cJSON_IsTrue(mb))
        return fm_error(FM_ERR_UNSUPPORTED, "%s: \"mlp_bias\" is true, but flatmoe's dense and shared-expert MLPs have "
                        "no biases (no released DeepSeek-V2 has them); set it to false", path);
    int64_t freq = 1;
    FM_TRY(v2_int(root, path, "moe_layer_freq", 1, &freq, NULL));
    if (freq != 1)
        return fm_error(FM_ERR_UNSUPPORTED, "%s: \"moe_layer_freq\" is %lld; transformers' DeepseekV2DecoderLayer "
                        "ignores it (every layer from first_k_dense_replace on is MoE) while DeepSeek's "
                        "modeling_deepseek.py makes only the layers i with i %% %lld == 0 MoE, so the file means two "
                        "models: set it to 1 (every released DeepSeek-V2 config does)", path, (long long)freq,
                        (long long)freq);
    FM_TRY(parse_router(cfg, root, path));
    if (cfg->first_k_dense_replace >= cfg->num_hidden_layers)
        return fm_error(FM_ERR_CONFIG, "%s: \"first_k_dense_replace\" (%lld) makes all %lld layers dense; flatmoe "
                        "trains MoE models: make at least one layer MoE", path,
                        (long long)cfg->first_k_dense_replace, (long long)cfg->num_hidden_layers);
    return FM_OK;
}

void fm_config_deepseek_v2_to_json(const fm_config *c, void *json) {
    cJSON *o = json;
    cJSON_AddNumberToObject(o, "n_shared_experts", (double)c->n_shared_experts);
    cJSON_AddNumberToObject(o, "first_k_dense_replace", (double)c->first_k_dense_replace);
    cJSON_AddStringToObject(o, "topk_method", c->router_group_limited ? "group_limited_greedy" : "greedy");
    if (c->n_group > 0) cJSON_AddNumberToObject(o, "n_group", (double)c->n_group);
    if (c->topk_group > 0) cJSON_AddNumberToObject(o, "topk_group", (double)c->topk_group);
    fm_config_json_add_float(o, "routed_scaling_factor", c->routed_scaling_factor);
}
