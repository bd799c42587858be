/* The attention parts of config.json (model/fm_config.h: attention_bias, attention_o_bias,
 * partial_rotary_factor, rope_scaling), read and written by fm_config.c through these; internal to
 * model/. */
#ifndef FM_CONFIG_ATTN_H
#define FM_CONFIG_ATTN_H
#include <cjson/cJSON.h>

#include "fm_config.h"

/* Reads attention_bias, partial_rotary_factor and rope_scaling (or transformers 5's
 * rope_parameters: its rope_type, factor, ... and partial_rotary_factor) of root into cfg, with
 * transformers' defaults; cfg->model_type and cfg->max_position_embeddings must be read already.
 * Errors (naming path and the field): FM_ERR_FORMAT a field of the wrong JSON type;
 * FM_ERR_UNSUPPORTED attention_bias on mixtral or deepseek_v3 (MLA), a rope_type other than default, linear, yarn,
 * partial_rotary_factor != 1 on a model_type whose attention rotates the whole head (all but
 * glm4_moe, default 0.5 there; its attention_bias biases q, k, v, not o). */
fm_status fm_config_parse_attention(fm_config *cfg, const cJSON *root, const char *path);

/* Values checked once head_dim is known: partial_rotary_factor in (0, 1] giving an even
 * rotary_dim >= 2; rope_scaling's factor > 0 and finite, original_max_position_embeddings > 0,
 * beta_fast and beta_slow finite and > 0, mscale / mscale_all_dim / attention_factor finite (and
 * the attention factor > 0). Errors: FM_ERR_CONFIG naming the field and the value found. */
fm_status fm_config_check_attention(const fm_config *cfg, const char *path);

/* Adds cfg's attention fields to o (fm_config_to_json): "attention_bias" always;
 * "partial_rotary_factor" when not 1 (always for glm4_moe, whose default is 0.5); "rope_scaling" when the type is not default. */
void fm_config_attention_to_json(const fm_config *cfg, cJSON *o);

#endif
