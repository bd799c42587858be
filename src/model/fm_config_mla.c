/* deepseek_v3's (and deepseek_v2's) multi-head latent attention fields (fm_config.h: fm_config_parse_mla,
 * fm_config_mla_to_json, fm_config_mla_attn_params), with the defaults of transformers'
 * DeepseekV3Config (src/transformers/models/deepseek_v3/configuration_deepseek_v3.py):
 * q_lora_rank 1536 (null: q_proj, no compression; Moonlight), kv_lora_rank 512, qk_nope_head_dim
 * 128, qk_rope_head_dim 64, v_head_dim 128, rope_interleave true, attention_bias false. The class
 * sets head_dim = qk_rope_head_dim (its rotary embedding's dim); the MLA layer itself is
 * model/fm_mla.h. DeepseekV2Config has the same attention defaults (configuration_deepseek_v2.py) and
 * no rope_interleave (always the interleaved pairs). */
#include "fm_config.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* An integer field, dflt when absent; *is_null set when the field is present and null. */
static fm_status mla_int(const cJSON *root, const char *path, const char *key, int64_t dflt, int64_t *out,
                         bool *is_null) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (is_null) *is_null = it && cJSON_IsNull(it);
    if (!it || cJSON_IsNull(it)) { *out = dflt; return FM_OK; }
    if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || fabs(it->valuedouble) > (1LL << 30))
        return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" must be an integer in [1, 2^30]%s", path, key,
                        !strcmp(key, "q_lora_rank") ? " or null" : "");
    *out = (int64_t)it->valuedouble;
    return FM_OK;
}

fm_status fm_config_parse_mla(fm_config *cfg, const void *root_v, const char *path, int64_t *head_dim) {
    const cJSON *root = root_v;
    bool q_null = false;
    cfg->mla = true;
    FM_TRY(mla_int(root, path, "q_lora_rank", 1536, &cfg->q_lora_rank, &q_null));
    if (q_null) cfg->q_lora_rank = 0; /* None: q_proj over the hidden state */
    FM_TRY(mla_int(root, path, "kv_lora_rank", 512, &cfg->kv_lora_rank, NULL));
    FM_TRY(mla_int(root, path, "qk_nope_head_dim", 128, &cfg->qk_nope_head_dim, NULL));
    FM_TRY(mla_int(root, path, "qk_rope_head_dim", 64, &cfg->qk_rope_head_dim, NULL));
    FM_TRY(mla_int(root, path, "v_head_dim", 128, &cfg->v_head_dim, NULL));
    const cJSON *ri = cJSON_GetObjectItemCaseSensitive(root, "rope_interleave");
    cfg->rope_interleave = true;
    /* deepseek_v2 has no such field: DeepseekV2Attention's apply_rotary_emb always rotates the pairs
     * (2i, 2i+1) as complex numbers (the field, if present, is ignored as transformers ignores it) */
    if (ri && !cJSON_IsNull(ri) && cfg->model_type != FM_MODEL_DEEPSEEK_V2) {
        if (!cJSON_IsBool(ri)) return fm_error(FM_ERR_FORMAT, "%s: field \"rope_interleave\" must be true or false", path);
        cfg->rope_interleave = cJSON_IsTrue(ri);
    }
    struct { const char *k; int64_t v; } pos[] = {
        {"q_lora_rank", q_null ? 1 : cfg->q_lora_rank}, {"kv_lora_rank", cfg->kv_lora_rank},
        {"qk_nope_head_dim", cfg->qk_nope_head_dim}, {"qk_rope_head_dim", cfg->qk_rope_head_dim},
        {"v_head_dim", cfg->v_head_dim},
    };
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (pos[i].v <= 0)
            return fm_error(FM_ERR_CONFIG, "%s: \"%s\" must be positive%s, found %lld", path, pos[i].k,
                            i == 0 ? " (or null: no query compression)" : "", (long long)pos[i].v);
    if (cfg->qk_rope_head_dim % 2)
        return fm_error(FM_ERR_CONFIG, "%s: \"qk_rope_head_dim\" (%lld) must be even (rotary pairs)", path,
                        (long long)cfg->qk_rope_head_dim);
    const int64_t dq = cfg->qk_nope_head_dim + cfg->qk_rope_head_dim;
    if (cfg->v_head_dim > dq)
        return fm_error(FM_ERR_CONFIG, "%s: \"v_head_dim\" (%lld) exceeds the q/k head dim qk_nope_head_dim + "
                        "qk_rope_head_dim (%lld); flatmoe's MLA pads v to the q/k head dim: lower v_head_dim",
                        path, (long long)cfg->v_head_dim, (long long)dq);
    if (*head_dim != 0 && *head_dim != cfg->qk_rope_head_dim)
        return fm_error(FM_ERR_CONFIG, "%s: \"head_dim\" is %lld, but %s's head_dim is qk_rope_head_dim (%lld; "
                        "transformers' rotary dim): remove the field or set it to %lld", path, (long long)*head_dim,
                        cfg->model_type_name,
                        (long long)cfg->qk_rope_head_dim, (long long)cfg->qk_rope_head_dim);
    cfg->num_key_value_heads = cfg->num_attention_heads; /* MLA: every head its own k and v */
    *head_dim = dq;
    return FM_OK;
}

void fm_config_mla_to_json(const fm_config *c, void *json) {
    cJSON *o = json;
    if (c->q_lora_rank > 0) cJSON_AddNumberToObject(o, "q_lora_rank", (double)c->q_lora_rank);
    else cJSON_AddNullToObject(o, "q_lora_rank");
    cJSON_AddNumberToObject(o, "kv_lora_rank", (double)c->kv_lora_rank);
    cJSON_AddNumberToObject(o, "qk_nope_head_dim", (double)c->qk_nope_head_dim);
    cJSON_AddNumberToObject(o, "qk_rope_head_dim", (double)c->qk_rope_head_dim);
    cJSON_AddNumberToObject(o, "v_head_dim", (double)c->v_head_dim);
    if (c->model_type != FM_MODEL_DEEPSEEK_V2) cJSON_AddBoolToObject(o, "rope_interleave", c->rope_interleave);
}

int64_t fm_config_mla_attn_params(const fm_config *c) {
    const int64_t H = c->hidden_size, nh = c->num_attention_heads, rq = c->q_lora_rank, rkv = c->kv_lora_rank;
    const int64_t dq = c->qk_nope_head_dim + c->qk_rope_head_dim;
    const int64_t q = rq > 0 ? H * rq + rq + rq * nh * dq : H * nh * dq; /* q_a, q_a_layernorm, q_b; or q_proj */
    return q + H * (rkv + c->qk_rope_head_dim) + rkv               /* kv_a_proj_with_mqa, kv_a_layernorm */
           + rkv * nh * (c->qk_nope_head_dim + c->v_head_dim)      /* kv_b_proj */
           + nh * c->v_head_dim * H;                               /* o_proj */
}
