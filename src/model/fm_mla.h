/* Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434 §2.1; DeepSeek-V3, arXiv
 * 2412.19437 §2.1.1), the attention of model_type deepseek_v3 (cfg->mla), as transformers'
 * DeepseekV3Attention computes it (modeling_deepseek_v3.py), without the inference-time weight
 * absorption:
 *   q     = q_b_proj(RMSNorm(q_a_proj(ln1)))  (q_lora_rank rq > 0), else q_proj(ln1)   [N, nh, dq]
 *           each head q_nope [dn] | q_pe [dr], dq = dn + dr
 *   kva   = kv_a_proj_with_mqa(ln1) = compressed_kv [rkv] | k_pe [dr]   (ONE k_pe for all heads)
 *   kvb   = kv_b_proj(RMSNorm(compressed_kv))                                           [N, nh, dn + dv]
 *           each head k_nope [dn] | v [dv]
 *   RoPE on q_pe and k_pe only (rotary dim dr; rope_interleave: the pairs (2i, 2i+1), which
 *   transformers' apply_rotary_pos_emb_interleave first reorders into rotate_half's halves)
 *   out   = o_proj(softmax(q k^T * scale) v),  scale = dq^-0.5 * m(factor, mscale_all_dim)^2 under
 *           a scaled rope_scaling with mscale_all_dim (fm_mla_softmax_factor), else dq^-0.5.
 * The attention kernels (backend attention_fwd/bwd, the Ulysses wrapper, cuDNN) see plain
 * multi-head attention of head dim dq with nkv = nh: q' = [q_pe | q_nope] and k' = [k_pe | k_nope]
 * per head (the same permutation of both, so q'.k' = q.k; q_pe first so the backend's rope_fwd
 * rotates the first dr dims), v' = [v | 0] padded with dq - dv zero columns, and the output's
 * padded columns dropped. Exact by construction: the zero columns add exact zeros to every dot
 * product of the forward and the backward (d v' = P^T d out', whose padded columns are 0 because
 * d out' is 0 there). The extra softmax factor multiplies q' (both parts; RoPE is linear).
 * The assembly is the backend's head_slice op; the saved set and the working set below are
 * counted by the plan (fm_mla_saved_bytes, fm_mla_ws_bytes; fm_layout.c lays them out). */
#ifndef FM_MLA_H
#define FM_MLA_H

#include "../backend/fm_backend.h"
#include "fm_config.h"

/* What one MLA layer's backward reads beside the attention's saved q', k', v', out', lse (in
 * fm_layer_acts: qr, kr, v, att [N, nh*dq] each, lse [B, nh, T]). NULL each without MLA. */
typedef struct fm_mla_saved {
    fm_act *qa;        /* [N, rq] q_a_proj's output, before its norm (rq > 0; else NULL) */
    float *rstd_qa;    /* [N] */
    fm_act *ckv;       /* [N, rkv] compressed_kv before kv_a_layernorm */
    float *rstd_kv;    /* [N] */
} fm_mla_saved;

/* MLA's part of the backward working set (one layer at a time; the forward uses it too). NULL
 * each without MLA. Widths: rl = max(rq, rkv). */
typedef struct fm_mla_ws {
    fm_act *q;         /* [N, nh*dq]: the q projection (forward), its gradient (backward) */
    fm_act *kva;       /* [N, rkv + dr]: kv_a_proj_with_mqa's output / gradient */
    fm_act *kpe;       /* [N, dr]: k_pe rotated / its gradient summed over the heads */
    fm_act *lat;       /* [N, rl]: a normed latent (q_a_layernorm's, kv_a_layernorm's output) */
    fm_act *dlat, *dlat2; /* [N, rl] each: a normed latent's gradient, and its norm's input's */
    fm_act *kvb;       /* [N, nh*(dn + dv)]: kv_b_proj's output / gradient */
    fm_act *att, *datt; /* [N, nh*dv]: o_proj's input (out' less its padding) and its gradient */
} fm_mla_ws;

struct fm_model;

/* The factor the q/k scores are multiplied by beside dq^-0.5 (transformers' DeepseekV3Attention
 * scaling): m(factor, mscale_all_dim)^2, m(s, k) = 0.1 k ln s + 1 for s > 1 (yarn_get_mscale), when
 * rope_scaling has a type other than default and a non-zero mscale_all_dim; else 1. */
double fm_mla_softmax_factor(const fm_config *c);

/* Layer l's attention block under MLA: from the boundary x [N,H] to a->x_mid = x + o_proj(...)
 * [N,H]; saves qa, ckv, their rstd, rstd1, q', k', v' and (unless skip_attention: keep-attention's
 * recompute, out' and lse kept) out' and lse in m->a.acts[l]. ln1 is formed in m->a.ws.dln. Errors:
 * the Ulysses all-to-all's (sequence parallelism). */
fm_status fm_mla_forward(struct fm_model *m, int64_t l, bool skip_attention);

/* Its backward: from dxmid [N,H] (the gradient of x_mid, kept) into dx [N,H] (assigned: the
 * block's input gradient plus dxmid); the MLA weights' gradients accumulated. datt [N, nh*dq] a
 * free buffer for d out' (the layer's, fm_layer.c). Errors: the Ulysses all-to-all's. */
fm_status fm_mla_backward(struct fm_model *m, int64_t l, const fm_act *dxmid, fm_act *datt, fm_act *dx);

/* Lays out one layer's saved set / the working set from arena ar (a measuring arena for the plan
 * takes the same bytes: fm_mla_saved_bytes, fm_mla_ws_bytes); zeroes them without MLA. */
void fm_mla_saved_layout(fm_mla_saved *s, struct fm_arena *ar, const fm_config *c, int64_t N);
void fm_mla_ws_layout(fm_mla_ws *w, struct fm_arena *ar, const fm_config *c, int64_t N);

/* Bytes of one layer's fm_mla_saved for N tokens at a bytes per fm_act (each buffer rounded as
 * the arena rounds it: fm_arena_round); 0 without MLA. */
size_t fm_mla_saved_bytes(const fm_config *c, int64_t N, size_t a);

/* Bytes of fm_mla_ws for N tokens (as above); 0 without MLA. */
size_t fm_mla_ws_bytes(const fm_config *c, int64_t N, size_t a);

#endif
