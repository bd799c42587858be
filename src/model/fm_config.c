#include "fm_config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---- JSON field helpers: each names the file and the field in its message ---------------- */

static fm_status get_int(const cJSON *root, const char *path, const char *key, bool required,
                         int64_t dflt, int64_t *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!it || cJSON_IsNull(it)) {
        if (required)
            return fm_error(FM_ERR_CONFIG, "%s: required field \"%s\" is missing; add it (an integer)",
                            path, key);
        *out = dflt;
        return FM_OK;
    }
    if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || fabs(it->valuedouble) > 9e15)
        return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" must be an integer, found %s", path, key,
                        cJSON_IsNumber(it) ? "a non-integer number" : "another JSON type");
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
    if (!cJSON_IsObject(root)) {
        st = fm_error(FM_ERR_FORMAT, "%s: expected a JSON object at the top level", path);
        goto done;
    }
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!cJSON_IsString(mt)) {
        st = fm_error(FM_ERR_CONFIG, "%s: field \"model_type\" is missing or not a string; expected "
                      "one of qwen3_moe, olmoe, mixtral", path);
        goto done;
    }
    snprintf(cfg->model_type_name, sizeof cfg->model_type_name, "%s", mt->valuestring);
    if (!strcmp(mt->valuestring, "qwen3_moe")) cfg->model_type = FM_MODEL_QWEN3_MOE;
    else if (!strcmp(mt->valuestring, "olmoe")) cfg->model_type = FM_MODEL_OLMOE;
    else if (!strcmp(mt->valuestring, "mixtral")) cfg->model_type = FM_MODEL_MIXTRAL;
    else {
        st = fm_error(FM_ERR_CONFIG, "%s: unknown model_type \"%s\"; expected one of qwen3_moe, olmoe, "
                      "mixtral", path, mt->valuestring);
        goto done;
    }
    const fm_model_type t = cfg->model_type;

#define TRY(x) do { st = (x); if (st != FM_OK) goto done; } while (0)
    TRY(get_int(root, path, "vocab_size", true, 0, &cfg->vocab_size));
    TRY(get_int(root, path, "hidden_size", true, 0, &cfg->hidden_size));
    TRY(get_int(root, path, "num_hidden_layers", true, 0, &cfg->num_hidden_layers));
    TRY(get_int(root, path, "num_attention_heads", true, 0, &cfg->num_attention_heads));
    TRY(get_int(root, path, "num_key_value_heads", false, cfg->num_attention_heads, &cfg->num_key_value_heads));
    TRY(get_int(root, path, "max_position_embeddings", true, 0, &cfg->max_position_embeddings));
    const char *width_key = t == FM_MODEL_QWEN3_MOE ? "moe_intermediate_size" : "intermediate_size";
    TRY(get_int(root, path, width_key, true, 0, &cfg->moe_intermediate_size));
    /* transformers 5 writes qwen3_moe's expert count as num_local_experts: accept either name */
    const char *experts_key = t == FM_MODEL_MIXTRAL ? "num_local_experts" : "num_experts";
    const char *experts_alt = t == FM_MODEL_MIXTRAL ? "num_experts" : "num_local_experts";
    if (!cJSON_GetObjectItemCaseSensitive(root, experts_key) && cJSON_GetObjectItemCaseSensitive(root, experts_alt))
        experts_key = experts_alt;
    TRY(get_int(root, path, experts_key, true, 0, &cfg->num_experts));
    TRY(get_int(root, path, "num_experts_per_tok", true, 0, &cfg->num_experts_per_tok));
    TRY(get_num(root, path, "rope_theta", t == FM_MODEL_MIXTRAL ? 1e6 : 10000.0, &cfg->rope_theta));
    /* transformers 5 writes RoPE settings as "rope_parameters": {"rope_type", "rope_theta", ...} */
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(root, "rope_parameters");
    if (rp && !cJSON_IsNull(rp)) {
        if (!cJSON_IsObject(rp)) {
            st = fm_error(FM_ERR_FORMAT, "%s: \"rope_parameters\" must be an object", path);
            goto done;
        }
        const cJSON *rt = cJSON_GetObjectItemCaseSensitive(rp, "rope_type");
        if (rt && cJSON_IsString(rt) && strcmp(rt->valuestring, "default") != 0) {
            st = fm_error(FM_ERR_UNSUPPORTED, "%s: rope_parameters.rope_type is \"%s\", but flatmoe supports only "
                          "\"default\" RoPE yet", path, rt->valuestring);
            goto done;
        }
        TRY(get_num(rp, path, "rope_theta", cfg->rope_theta, &cfg->rope_theta));
    }
    TRY(get_num(root, path, "rms_norm_eps", t == FM_MODEL_QWEN3_MOE ? 1e-6 : 1e-5, &cfg->rms_norm_eps));
    TRY(get_bool(root, path, "tie_word_embeddings", false, &cfg->tie_word_embeddings));
    TRY(get_num(root, path, "router_aux_loss_coef", t == FM_MODEL_QWEN3_MOE ? 0.001 : (t == FM_MODEL_OLMOE ? 0.01 : 0.001),
                &cfg->router_aux_loss_coef));
    TRY(get_num(root, path, "router_z_loss_coef", 0.0, &cfg->router_z_loss_coef));
    TRY(get_num(root, path, "initializer_range", 0.02, &cfg->initializer_range));
    if (t == FM_MODEL_MIXTRAL) cfg->norm_topk_prob = true;
    else TRY(get_bool(root, path, "norm_topk_prob", false, &cfg->norm_topk_prob));
    cfg->qk_norm = t == FM_MODEL_QWEN3_MOE ? FM_QK_NORM_PER_HEAD
                 : t == FM_MODEL_OLMOE ? FM_QK_NORM_FULL : FM_QK_NORM_NONE;

    int64_t hd_given = 0;
    TRY(get_int(root, path, "head_dim", false, 0, &hd_given));

    /* Features not implemented: refuse rather than train something else. */
    TRY(reject_if_set(root, path, "attention_bias", "biases in the attention projections"));
    TRY(reject_if_set(root, path, "clip_qkv", "clipping of q, k, v"));
    TRY(reject_if_set(root, path, "rope_scaling", "RoPE scaling"));
    TRY(reject_if_set(root, path, "use_sliding_window", "sliding-window attention"));
    TRY(reject_if_set(root, path, "mlp_only_layers", "dense (non-MoE) layers"));
    TRY(reject_if_set(root, path, "shared_expert_intermediate_size", "shared experts"));
    if (t == FM_MODEL_MIXTRAL) {
        const cJSON *sw = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
        if (sw && !cJSON_IsNull(sw)) {
            st = fm_error(FM_ERR_UNSUPPORTED, "%s: \"sliding_window\" is %g, but flatmoe does not support "
                          "sliding-window attention yet; set it to null", path, cJSON_IsNumber(sw) ? sw->valuedouble : 0.0);
            goto done;
        }
    }
    int64_t sparse_step = 1;
    TRY(get_int(root, path, "decoder_sparse_step", false, 1, &sparse_step));
    if (sparse_step != 1) {
        st = fm_error(FM_ERR_UNSUPPORTED, "%s: \"decoder_sparse_step\" is %lld; flatmoe supports only 1 "
                      "(every layer MoE)", path, (long long)sparse_step);
        goto done;
    }
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, "hidden_act");
    if (act && cJSON_IsString(act) && strcmp(act->valuestring, "silu") != 0) {
        st = fm_error(FM_ERR_UNSUPPORTED, "%s: \"hidden_act\" is \"%s\"; flatmoe's experts are SwiGLU and "
                      "need \"silu\"", path, act->valuestring);
        goto done;
    }

    /* Consistency. */
    struct { const char *name; int64_t v; } pos[] = {
        {"vocab_size", cfg->vocab_size}, {"hidden_size", cfg->hidden_size},
        {"num_hidden_layers", cfg->num_hidden_layers}, {"num_attention_heads", cfg->num_attention_heads},
        {"num_key_value_heads", cfg->num_key_value_heads}, {"max_position_embeddings", cfg->max_position_embeddings},
        {width_key, cfg->moe_intermediate_size}, {experts_key, cfg->num_experts},
        {"num_experts_per_tok", cfg->num_experts_per_tok},
    };
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (pos[i].v <= 0) {
            st = fm_error(FM_ERR_CONFIG, "%s: \"%s\" must be positive, found %lld", path, pos[i].name,
                          (long long)pos[i].v);
            goto done;
        }
    if (hd_given < 0) {
        st = fm_error(FM_ERR_CONFIG, "%s: \"head_dim\" must be positive, found %lld", path, (long long)hd_given);
        goto done;
    }
    if (hd_given > 0) cfg->head_dim = hd_given;
    else {
        if (cfg->hidden_size % cfg->num_attention_heads) {
            st = fm_error(FM_ERR_CONFIG, "%s: num_attention_heads (%lld) must divide hidden_size (%lld); "
                          "change one of them or give head_dim", path, (long long)cfg->num_attention_heads,
                          (long long)cfg->hidden_size);
            goto done;
        }
        cfg->head_dim = cfg->hidden_size / cfg->num_attention_heads;
    }
    if (cfg->head_dim % 2) {
        st = fm_error(FM_ERR_CONFIG, "%s: head_dim (%lld) must be even for rotary embeddings", path,
                      (long long)cfg->head_dim);
        goto done;
    }
    if (cfg->num_attention_heads % cfg->num_key_value_heads) {
        st = fm_error(FM_ERR_CONFIG, "%s: num_key_value_heads (%lld) must divide num_attention_heads (%lld)",
                      path, (long long)cfg->num_key_value_heads, (long long)cfg->num_attention_heads);
        goto done;
    }
    if (cfg->num_experts_per_tok > cfg->num_experts) {
        st = fm_error(FM_ERR_CONFIG, "%s: num_experts_per_tok (%lld) must be <= %s (%lld)", path,
                      (long long)cfg->num_experts_per_tok, experts_key, (long long)cfg->num_experts);
        goto done;
    }
    if (!(cfg->rms_norm_eps > 0) || !(cfg->rope_theta > 0) || !isfinite(cfg->rms_norm_eps) || !isfinite(cfg->rope_theta)) {
        st = fm_error(FM_ERR_CONFIG, "%s: rms_norm_eps (%g) and rope_theta (%g) must be positive and finite", path,
                      cfg->rms_norm_eps, cfg->rope_theta);
        goto done;
    }
    if (!(cfg->router_aux_loss_coef >= 0) || !(cfg->router_z_loss_coef >= 0) || !isfinite(cfg->router_aux_loss_coef) ||
        !isfinite(cfg->router_z_loss_coef)) {
        st = fm_error(FM_ERR_CONFIG, "%s: router_aux_loss_coef (%g) and router_z_loss_coef (%g) must be finite and >= 0",
                      path, cfg->router_aux_loss_coef, cfg->router_z_loss_coef);
        goto done;
    }
    if (!(cfg->initializer_range >= 0) || !isfinite(cfg->initializer_range)) {
        st = fm_error(FM_ERR_CONFIG, "%s: \"initializer_range\" (%g) must be finite and >= 0 (the std of the initial "
                      "weights)", path, cfg->initializer_range);
        goto done;
    }
    if (cfg->head_dim > (1LL << 30)) {
        st = fm_error(FM_ERR_CONFIG, "%s: \"head_dim\" is %lld; flatmoe supports at most 2^30", path,
                      (long long)cfg->head_dim);
        goto done;
    }
    /* Sizes flatmoe indexes with 64-bit counts: keep every product well inside int64. */
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (pos[i].v > (1LL << 30)) {
            st = fm_error(FM_ERR_CONFIG, "%s: \"%s\" is %lld; flatmoe supports at most 2^30", path, pos[i].name,
                          (long long)pos[i].v);
            goto done;
        }
    {
        const double H = (double)cfg->hidden_size, I = (double)cfg->moe_intermediate_size, E = (double)cfg->num_experts;
        const double hd = (double)cfg->head_dim, nh = (double)cfg->num_attention_heads, V = (double)cfg->vocab_size;
        const double params = (double)cfg->num_hidden_layers * (E * 3 * H * I + 4 * H * nh * hd) + 2 * V * H;
        if (params > 1e15) {
            st = fm_error(FM_ERR_CONFIG, "%s: the config describes about %.3g parameters; flatmoe supports at most "
                          "1e15 (check hidden_size, num_hidden_layers, the expert sizes)", path, params);
            goto done;
        }
    }
#undef TRY
done:
    cJSON_Delete(root);
    return st;
}

fm_status fm_config_load(fm_config *cfg, const char *path) {
    struct stat sb;
    if (stat(path, &sb) == 0 && !S_ISREG(sb.st_mode))
        return fm_error(FM_ERR_IO, "%s: is not a file; expected a Hugging Face config.json", path);
    FILE *f = fopen(path, "rb");
    if (!f) return fm_error(FM_ERR_IO, "%s: cannot open the model config: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (n < 0 || n > (1 << 24)) {
        fclose(f);
        return fm_error(FM_ERR_FORMAT, "%s: expected a config.json of at most 16 MiB, found %ld bytes", path, n);
    }
    char *text = fm_malloc((size_t)n + 1);
    if (!text) { fclose(f); return fm_error(FM_ERR_NOMEM, "%s: out of memory reading the config", path); }
    size_t got = fread(text, 1, (size_t)n, f);
    fclose(f);
    if (got != (size_t)n) { fm_free(text); return fm_error(FM_ERR_IO, "%s: short read", path); }
    text[n] = 0;
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
                     : c->model_type == FM_MODEL_OLMOE ? "OlmoeForCausalLM" : "MixtralForCausalLM";
    cJSON *a = cJSON_AddArrayToObject(o, "architectures");
    cJSON_AddItemToArray(a, cJSON_CreateString(arch));
    cJSON_AddStringToObject(o, "model_type", c->model_type_name);
    cJSON_AddNumberToObject(o, "vocab_size", (double)c->vocab_size);
    cJSON_AddNumberToObject(o, "hidden_size", (double)c->hidden_size);
    if (c->model_type == FM_MODEL_QWEN3_MOE) {
        cJSON_AddNumberToObject(o, "moe_intermediate_size", (double)c->moe_intermediate_size);
        cJSON_AddNumberToObject(o, "intermediate_size", (double)c->moe_intermediate_size);
    } else {
        cJSON_AddNumberToObject(o, "intermediate_size", (double)c->moe_intermediate_size);
    }
    cJSON_AddNumberToObject(o, "num_hidden_layers", (double)c->num_hidden_layers);
    cJSON_AddNumberToObject(o, "num_attention_heads", (double)c->num_attention_heads);
    cJSON_AddNumberToObject(o, "num_key_value_heads", (double)c->num_key_value_heads);
    cJSON_AddNumberToObject(o, "head_dim", (double)c->head_dim);
    cJSON_AddStringToObject(o, "hidden_act", "silu");
    cJSON_AddNumberToObject(o, "max_position_embeddings", (double)c->max_position_embeddings);
    add_float(o, "rope_theta", c->rope_theta);
    add_float(o, "rms_norm_eps", c->rms_norm_eps);
    cJSON_AddBoolToObject(o, "attention_bias", 0);
    cJSON_AddNumberToObject(o, c->model_type == FM_MODEL_MIXTRAL ? "num_local_experts" : "num_experts",
                            (double)c->num_experts);
    cJSON_AddNumberToObject(o, "num_experts_per_tok", (double)c->num_experts_per_tok);
    if (c->model_type != FM_MODEL_MIXTRAL) cJSON_AddBoolToObject(o, "norm_topk_prob", c->norm_topk_prob);
    if (c->model_type == FM_MODEL_QWEN3_MOE) {
        cJSON_AddNumberToObject(o, "decoder_sparse_step", 1);
        cJSON_AddItemToObject(o, "mlp_only_layers", cJSON_CreateArray());
    }
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
    int64_t H = c->hidden_size, hd = c->head_dim, nh = c->num_attention_heads, nkv = c->num_key_value_heads;
    int64_t p = H * nh * hd * 2 + H * nkv * hd * 2; /* q, o, k, v */
    if (c->qk_norm == FM_QK_NORM_PER_HEAD) p += 2 * hd;
    if (c->qk_norm == FM_QK_NORM_FULL) p += nh * hd + nkv * hd;
    return p;
}

int64_t fm_config_num_params(const fm_config *c) {
    int64_t H = c->hidden_size, I = c->moe_intermediate_size, E = c->num_experts, V = c->vocab_size;
    int64_t layer = attn_params(c) + 2 * H + E * H + E * 3 * H * I;
    return V * H * (c->tie_word_embeddings ? 1 : 2) + c->num_hidden_layers * layer + H;
}

int64_t fm_config_num_active_params(const fm_config *c) {
    int64_t H = c->hidden_size, I = c->moe_intermediate_size, E = c->num_experts, V = c->vocab_size;
    int64_t k = c->num_experts_per_tok;
    int64_t layer = attn_params(c) + 2 * H + E * H + k * 3 * H * I;
    return V * H + c->num_hidden_layers * layer + H;
}
