/* The mapping between a flat fp32 parameter buffer and Hugging Face safetensors tensors
 * (DESIGN.md §7): which tensor of a file fills which elements of the buffer, under which name,
 * with which shape.
 *
 * The buffer is described by a plain table (fm_hf_table): one row per tensor (Hugging Face name,
 * shape, offset into the buffer) plus where each layer's stacked experts lie. Nothing here knows
 * the model: the trainer builds the table from its parameter table.
 *
 * Expert weights come in two layouts:
 *   - per expert (transformers 4 and what flatmoe writes): one 2-D tensor per expert,
 *     "model.layers.<l>.<moe>.experts.<e>.{gate,up,down}_proj.weight", [I, H], [I, H], [H, I];
 *     these are ordinary rows of the table (the e-th slice of the stacked buffer);
 *   - fused per layer (transformers 5): "model.layers.<l>.<moe>.experts.gate_up_proj" [E, 2I, H]
 *     (rows 0..I-1 of each expert are gate, I..2I-1 up) and "model.layers.<l>.<moe>.experts.down_proj"
 *     [E, H, I]; read into the stacked buffers gate [E, I, H], up [E, I, H], down [E, H, I].
 * <moe> is "mlp" (Qwen3-MoE, OLMoE) or "block_sparse_moe" (Mixtral).
 * Stored dtypes F32, F16, BF16 and F64 are converted to fp32 on reading (fm_st_read_f32). */
#ifndef FM_HF_WEIGHTS_H
#define FM_HF_WEIGHTS_H

#include <stdbool.h>
#include <stdint.h>

#include "../core/fm_core.h"
#include "fm_safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Longest tensor name fm_hf_name_tensors writes, with its prefix and the NUL. */
#define FM_HF_NAME_CAP 160

/* One tensor of the flat buffer. */
typedef struct fm_hf_param {
    const char *name;   /* Hugging Face tensor name, e.g. "model.layers.0.self_attn.q_proj.weight" */
    int ndim;           /* 1 or 2 */
    int64_t shape[2];   /* row-major dimensions (shape[1] unused when ndim is 1) */
    int64_t offset;     /* elements into the flat buffer */
} fm_hf_param;

/* Where one layer's stacked experts lie in the flat buffer, in elements: gate [E, I, H], up
 * [E, I, H] and down [E, H, I]. The range [gate, down + E*H*I) holds those three and nothing
 * else (the per-expert rows of the table that a fused file replaces). */
typedef struct fm_hf_experts {
    int64_t gate, up, down;
} fm_hf_experts;

/* A flat buffer's tensors as the mapping sees them. The caller owns every array. */
typedef struct fm_hf_table {
    const fm_hf_param *params;   /* [n_params] */
    int n_params;
    int64_t n_layers;            /* L */
    int64_t n_experts;           /* E */
    int64_t hidden;              /* H */
    int64_t expert_width;        /* I (moe_intermediate_size) */
    const char *moe_module;      /* "mlp" or "block_sparse_moe" */
    const fm_hf_experts *experts; /* [n_layers] */
    bool tied_lm_head;           /* embeddings tied: a file's "lm_head.weight" is ignored */
    const char *model_desc;      /* model type in messages, e.g. "qwen3_moe" */
} fm_hf_table;

/* Fills out[0..n_params) with the table's tensors under their Hugging Face names with `prefix`
 * prepended (e.g. "exp_avg." for an optimizer state), names[i] holding the i-th name. With base
 * non-NULL, out[i].data = base + params[i].offset (fp32); with base NULL, data is NULL for the
 * caller to set (or a fetch callback). fetch and fetch_ctx are cleared. Allocates nothing.
 * Errors: FM_ERR_ARG when a prefixed name does not fit in FM_HF_NAME_CAP. */
fm_status fm_hf_name_tensors(const fm_hf_table *t, const float *base, const char *prefix,
                             fm_named_tensor *out, char (*names)[FM_HF_NAME_CAP]);

/* Reads every tensor of the table whose name carries `prefix` ("" for a model file) from the
 * safetensors file at `path` into base (fp32, [elements of the buffer], each at its offset).
 * Experts may be stored per expert or fused per layer (above; the layout is detected per layer).
 * Tensors of the file with the prefix that the table does not hold are an error (a file written
 * for another config), except "lm_head.weight" when tied_lm_head.
 * Errors: FM_ERR_IO / FM_ERR_FORMAT from opening or reading the file (a missing tensor or a
 * shape mismatch names the tensor); FM_ERR_FORMAT naming a tensor the table does not hold, or
 * the counts when they differ; FM_ERR_NOMEM (a host buffer of L bools, and one of E*2I*H floats
 * when a layer is fused). */
fm_status fm_hf_read(const fm_hf_table *t, const char *path, const char *prefix, float *base);

#ifdef __cplusplus
}
#endif
#endif
