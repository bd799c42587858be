/* The RoPE tables (Su et al. 2021, arXiv 2104.09864) of a config: the inverse frequencies of the
 * rotated dims (default, linear scaling, or YaRN: Peng et al. 2023, arXiv 2309.00071, §3.2-3.4),
 * the attention factor YaRN multiplies into cos and sin, and the [T, rotary_dim/2] cos/sin tables
 * the backend's rope_fwd/rope_bwd read (backend/fm_backend.h). The formulas are transformers'
 * (modeling_rope_utils.py: _compute_default_rope_parameters, _compute_linear_scaling_rope_parameters,
 * _compute_yarn_parameters; the rotary embedding multiplies cos and sin by attention_scaling),
 * computed here in fp64 (transformers computes inv_freq in fp32: the tables agree to ~1e-7
 * relative). No memory is allocated; nothing fails. */
#ifndef FM_ROPE_H
#define FM_ROPE_H
#include "fm_config.h"

/* inv_freq [fm_config_rotary_dim(c) / 2], radians per position:
 *   default: theta^(-2i/rd)
 *   linear:  theta^(-2i/rd) / factor
 *   yarn:    interp_i r_i + extrap_i (1 - r_i), extrap_i = theta^(-2i/rd), interp_i = extrap_i /
 *            factor, r_i = clamp((i - low) / (high - low), 0, 1) (high += 0.001 when equal), with
 *            low = max(floor(d(beta_fast)), 0), high = min(ceil(d(beta_slow)), rd - 1) (floor and ceil
 *            only when truncate), d(b) = rd ln(omax / (2 pi b)) / (2 ln theta), omax the
 *            original_max_position_embeddings. */
void fm_rope_inv_freq(const fm_config *c, double *inv);

/* The factor cos and sin are multiplied by: 1 for default and linear; yarn: attention_factor when
 * given, else m(factor, mscale) / m(factor, mscale_all_dim) when both mscale and mscale_all_dim are
 * non-zero (DeepSeek), else m(factor, 1), where m(s, k) = 0.1 k ln(s) + 1 for s > 1, else 1. */
double fm_rope_attention_factor(const fm_config *c);

/* cos_tab, sin_tab [T, rd/2] fp32 (host memory): row t, column i = cos / sin of t inv_freq[i],
 * times fm_rope_attention_factor (yarn only). The default type's values are bit for bit those
 * flatmoe made before the RoPE kinds existed (the angle t theta^(-2i/rd) in double). */
void fm_rope_tables_host(const fm_config *c, int64_t T, float *cos_tab, float *sin_tab);

#endif
