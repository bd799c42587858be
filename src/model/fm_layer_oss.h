/* gpt_oss's parts of a decoder layer (fm_layer.c calls these where the config has them): the
 * attention with sinks and a sliding window (fm_backend.h attention_ext_fwd / _bwd; transformers'
 * GptOssAttention), the router with its Linear bias (fm_router.h: fm_router_forward's lin_bias),
 * the experts' biases (the fm_moe_weights / fm_moe_grads fields). Not a public header. */
#ifndef FM_LAYER_OSS_H
#define FM_LAYER_OSS_H

#include "fm_model.h"

/* Whether layer l's attention needs attention_ext (sinks, or a sliding window on this layer). */
bool fm_layer_oss_attention(const fm_model *m, int64_t l);

/* The window of layer l's attention in keys (0: full causal). */
int64_t fm_layer_oss_window(const fm_config *c, int64_t l);

/* Layer l's attention forward: att, lse from qr, kr, v (the layer's saved set); kvs as
 * attention_fwd's; under --sp through Ulysses' all-to-alls (model/fm_attn_sp.h
 * fm_attn_sp_forward_ext). Errors: the communicator's. */
fm_status fm_layer_oss_attention_fwd(fm_model *m, int64_t l, fm_layer_acts *a, const int32_t *kvs);

/* Its backward: dq, dk, dv (the working set's, assigned) and the sinks' gradient (accumulated)
 * from datt. */
fm_status fm_layer_oss_attention_bwd(fm_model *m, int64_t l, const fm_layer_acts *a, const fm_act *datt,
                                const int32_t *kvs);

/* Whether the model's shape and options can run gpt_oss's layers here: the backend's ops
 * (attention_ext, swiglu_clamp, bias_add_f32), and no --sp (the windowed attention is not wired
 * into Ulysses' all-to-alls yet) nor --expert-precision fp8 (the fp8 experts carry no biases).
 * FM_OK for every other model_type. */
fm_status fm_layer_oss_check(const fm_model *m, int64_t sp, bool fp8);

#endif
