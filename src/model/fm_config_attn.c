/* The attention parts of config.json (fm_config_attn.h): biases, partial rotary, RoPE scaling,
 * with transformers' defaults (configuration_qwen3_moe.py / configuration_olmoe.py: attention_bias
 * False; modeling_rope_utils.py: rope_type and its parameters). */
#include "fm_config_attn.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fm_rope.h"

/* A number field of object o, or dflt when absent or null. */
static fm_status num_field(const cJSON *o, const char *path, const char *obj, const char *key, double dflt,
                           double *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!it || cJSON_IsNull(it)) { *out = dflt; return FM_OK; }
    if (!cJSON_IsNumber(it))
        return fm_error(FM_ERR_FORMAT, "%s: field \"%s%s%s\" must be a number", path, obj, *obj ? "." : "", key);
    *out = it->valuedouble;
    return FM_OK;
}

/* rope_scaling (or rope_parameters) object rs into cfg->rope_scaling. */
static fm_status parse_rope_scaling(fm_config *cfg, const cJSON *rs, const char *path, const char *name) {
    fm_rope_scaling *r = &cfg->rope_scaling;
    const cJSON *rt = cJSON_GetObjectItemCaseSensitive(rs, "rope_type");
    if (!rt || cJSON_IsNull(rt)) rt = cJSON_GetObjectItemCaseSensitive(rs, "type"); /* the older spelling */
    if (!rt || cJSON_IsNull(rt)) {
        if (!strcmp(name, "rope_parameters")) return FM_OK; /* transformers 5 without a type: default */
        return fm_error(FM_ERR_FORMAT, "%s: \"%s\" has no \"rope_type\"; expected one of \"default\", \"linear\", "
                        "\"yarn\"", path, name);
    }
    if (!cJSON_IsString(rt))
        return fm_error(FM_ERR_FORMAT, "%s: \"%s.rope_type\" must be a string", path, name);
    const char *t = rt->valuestring;
    if (!strcmp(t, "default")) return FM_OK;
    if (strcmp(t, "linear") && strcmp(t, "yarn"))
        return fm_error(FM_ERR_UNSUPPORTED, "%s: %s.rope_type is \"%s\", but flatmoe supports only \"default\", "
                        "\"linear\" and \"yarn\" RoPE (not dynamic, llama3, longrope yet); use one of those or "
                        "remove %s", path, name, t, name);
    r->type = !strcmp(t, "yarn") ? FM_ROPE_YARN : FM_ROPE_LINEAR;
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(rs, "factor");
    double om = 0;
    FM_TRY(num_field(rs, path, name, "original_max_position_embeddings", 0, &om));
    if (om != floor(om) || fabs(om) > 9e15)
        return fm_error(FM_ERR_FORMAT, "%s: \"%s.original_max_position_embeddings\" must be an integer, found %g", path,
                        name, om);
    /* absent: the file's max_position_embeddings (transformers' default), fixed here */
    r->original_max_position_embeddings = om != 0 ? (int64_t)om : cfg->max_position_embeddings;
    if ((!f || cJSON_IsNull(f)) && r->type == FM_ROPE_YARN && om != 0) /* transformers: the ratio */
        r->factor = (double)cfg->max_position_embeddings / om;
    else if (!f || cJSON_IsNull(f))
        return fm_error(FM_ERR_CONFIG, "%s: \"%s\" of rope_type \"%s\" needs \"factor\" (the context extension, "
                        "e.g. 4.0)", path, name, t);
    else FM_TRY(num_field(rs, path, name, "factor", 0, &r->factor));
    if (r->type == FM_ROPE_LINEAR) return FM_OK;
    /* transformers: `get("beta_fast") or 32`: absent, null or 0 take the default */
    FM_TRY(num_field(rs, path, name, "beta_fast", 32, &r->beta_fast));
    FM_TRY(num_field(rs, path, name, "beta_slow", 1, &r->beta_slow));
    if (r->beta_fast == 0) r->beta_fast = 32;
    if (r->beta_slow == 0) r->beta_slow = 1;
    FM_TRY(num_field(rs, path, name, "mscale", 0, &r->mscale));
    FM_TRY(num_field(rs, path, name, "mscale_all_dim", 0, &r->mscale_all_dim));
    FM_TRY(num_field(rs, path, name, "attention_factor", 0, &r->attention_factor));
    const cJSON *tr = cJSON_GetObjectItemCaseSensitive(rs, "truncate");
    r->truncate = true;
    if (tr && !cJSON_IsNull(tr)) {
        if (!cJSON_IsBool(tr)) return fm_error(FM_ERR_FORMAT, "%s: \"%s.truncate\" must be true or false", path, name);
        r->truncate = cJSON_IsTrue(tr);
    }
    return FM_OK;
}

fm_status fm_config_parse_attention(fm_config *cfg, const cJSON *root, const char *path) {
    const bool mixtral = cfg->model_type == FM_MODEL_MIXTRAL, glm = cfg->model_type == FM_MODEL_GLM4_MOE;
    /* biases: Qwen3MoeAttention and OlmoeAttention bias q, k, v and o with attention_bias;
     * Glm4MoeAttention q, k and v only (its o_proj has bias=False) */
    const cJSON *ab = cJSON_GetObjectItemCaseSensitive(root, "attention_bias");
    cfg->attention_bias = cfg->model_type == FM_MODEL_GPT_OSS; /* GptOssConfig's default: true */
    if (ab && !cJSON_IsNull(ab)) {
        if (!cJSON_IsBool(ab)) return fm_error(FM_ERR_FORMAT, "%s: field \"attention_bias\" must be true or false", path);
        cfg->attention_bias = cJSON_IsTrue(ab);
    }
    if (mixtral && cfg->attention_bias)
        return fm_error(FM_ERR_UNSUPPORTED, "%s: \"attention_bias\" is true, but transformers' Mixtral attention has "
                        "no biases (MixtralConfig has no such field); remove it or set it to false", path);
    if (cfg->mla && cfg->attention_bias)
        return fm_error(FM_ERR_UNSUPPORTED, "%s: \"attention_bias\" is true, but flatmoe's multi-head latent attention "
                        "has no biases yet (DeepSeek-V3, Kimi-K2 and Moonlight have none); set it to false", path);
    cfg->attention_o_bias = cfg->attention_bias && !glm;
    /* RoPE: rope_scaling (transformers 4) or rope_parameters (transformers 5) */
    memset(&cfg->rope_scaling, 0, sizeof cfg->rope_scaling);
    cfg->rope_scaling.truncate = true;
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
    if (rs && !cJSON_IsNull(rs)) {
        if (!cJSON_IsObject(rs)) return fm_error(FM_ERR_FORMAT, "%s: \"rope_scaling\" must be an object or null", path);
        FM_TRY(parse_rope_scaling(cfg, rs, path, "rope_scaling"));
    } else if (rp && cJSON_IsObject(rp)) {
        FM_TRY(parse_rope_scaling(cfg, rp, path, "rope_parameters"));
    }
    /* Glm4MoeConfig's default 0.5 (GPT-NeoX-style: rotate_half over the first rotary_dim dims) */
    double prf = glm ? 0.5 : 1.0;
    FM_TRY(num_field(root, path, "", "partial_rotary_factor", prf, &prf));
    if (rp && cJSON_IsObject(rp) && cJSON_GetObjectItemCaseSensitive(rp, "partial_rotary_factor"))
        FM_TRY(num_field(rp, path, "rope_parameters", "partial_rotary_factor", prf, &prf));
    cfg->partial_rotary_factor = prf;
    if (prf != 1.0 && !glm)
        return fm_error(FM_ERR_UNSUPPORTED, "%s: \"partial_rotary_factor\" is %g, but transformers' %s attention "
                        "rotates the whole head (apply_rotary_pos_emb over head_dim); remove it or set it to 1.0",
                        path, prf, cfg->model_type_name);
    return FM_OK;
}

fm_status fm_config_check_attention(const fm_config *c, const char *path) {
    const double f = c->partial_rotary_factor;
    if (f != 0 && !(f > 0 && f <= 1))
        return fm_error(FM_ERR_CONFIG, "%s: \"partial_rotary_factor\" must be in (0, 1], found %g", path, f);
    const int64_t rd = fm_config_rotary_dim(c);
    if (rd < 2 || rd % 2)
        return fm_error(FM_ERR_CONFIG, "%s: the rotary dims int(head_dim %lld x partial_rotary_factor %g) = %lld must be "
                        "even and >= 2; change partial_rotary_factor", path, (long long)c->head_dim, f, (long long)rd);
    const fm_rope_scaling *r = &c->rope_scaling;
    if (r->type == FM_ROPE_DEFAULT) return FM_OK;
    if (!(r->factor > 0) || !isfinite(r->factor))
        return fm_error(FM_ERR_CONFIG, "%s: rope_scaling \"factor\" must be positive and finite, found %g", path,
                        r->factor);
    if (r->type != FM_ROPE_YARN) return FM_OK;
    if (r->original_max_position_embeddings <= 0)
        return fm_error(FM_ERR_CONFIG, "%s: rope_scaling \"original_max_position_embeddings\" must be positive, found "
                        "%lld", path, (long long)r->original_max_position_embeddings);
    if (!(r->beta_fast > 0) || !(r->beta_slow > 0) || !isfinite(r->beta_fast) || !isfinite(r->beta_slow))
        return fm_error(FM_ERR_CONFIG, "%s: rope_scaling \"beta_fast\" (%g) and \"beta_slow\" (%g) must be positive and "
                        "finite", path, r->beta_fast, r->beta_slow);
    if (!isfinite(r->mscale) || !isfinite(r->mscale_all_dim) || !isfinite(r->attention_factor) ||
        r->attention_factor < 0)
        return fm_error(FM_ERR_CONFIG, "%s: rope_scaling \"mscale\" (%g), \"mscale_all_dim\" (%g) must be finite and "
                        "\"attention_factor\" (%g) finite and positive", path, r->mscale, r->mscale_all_dim,
                        r->attention_factor);
    const double af = fm_rope_attention_factor(c);
    if (!(af > 0) || !isfinite(af))
        return fm_error(FM_ERR_CONFIG, "%s: rope_scaling gives the attention factor %g (from factor %g, mscale %g, "
                        "mscale_all_dim %g); it must be positive", path, af, r->factor, r->mscale, r->mscale_all_dim);
    return FM_OK;
}


void fm_config_attention_to_json(const fm_config *c, cJSON *o) {
    cJSON_AddBoolToObject(o, "attention_bias", c->attention_bias);
    if (c->model_type == FM_MODEL_GLM4_MOE || (c->partial_rotary_factor > 0 && c->partial_rotary_factor != 1.0))
        fm_config_json_add_float(o, "partial_rotary_factor", c->partial_rotary_factor);
    const fm_rope_scaling *r = &c->rope_scaling;
    if (r->type == FM_ROPE_DEFAULT) return;
    cJSON *s = cJSON_AddObjectToObject(o, "rope_scaling");
    cJSON_AddStringToObject(s, "rope_type", r->type == FM_ROPE_YARN ? "yarn" : "linear");
    fm_config_json_add_float(s, "factor", r->factor);
    if (r->type != FM_ROPE_YARN) return;
    cJSON_AddNumberToObject(s, "original_max_position_embeddings", (double)r->original_max_position_embeddings);
    fm_config_json_add_float(s, "beta_fast", r->beta_fast);
    fm_config_json_add_float(s, "beta_slow", r->beta_slow);
    if (r->mscale != 0) fm_config_json_add_float(s, "mscale", r->mscale);
    if (r->mscale_all_dim != 0) fm_config_json_add_float(s, "mscale_all_dim", r->mscale_all_dim);
    if (r->attention_factor != 0) fm_config_json_add_float(s, "attention_factor", r->attention_factor);
    if (!r->truncate) cJSON_AddBoolToObject(s, "truncate", 0);
}
