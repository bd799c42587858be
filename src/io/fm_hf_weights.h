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
 *   - gpt_oss (the table's expert_bias set; transformers' GptOssExperts): per layer
 *     "model.layers.<l>.mlp.experts.gate_up_proj" [E, H, 2I] (x @ W: column 2i of expert e is gate
 *     row i, column 2i+1 up row i), "...gate_up_proj_bias" [E, 2I] (interleaved the same way),
 *     "...down_proj" [E, I, H] (x @ W), "...down_proj_bias" [E, H]; or, as the released
 *     checkpoints store them, gate_up_proj and down_proj in MXFP4 ("..._blocks" [E, 2I, H/32, 16]
 *     and "..._scales" [E, 2I, H/32]; down [E, H, I/32, 16] and [E, H, I/32]: io/fm_mxfp4.h),
 *     dequantized exactly at load (logged). Read into the stacked gate, up [E, I, H], down
 *     [E, H, I] and the biases gate, up [E, I], down [E, H] (the transposes and the
 *     de-interleaving are exact permutations).
 * <moe> is "mlp" (Qwen3-MoE, OLMoE, gpt_oss) or "block_sparse_moe" (Mixtral).
 * Stored dtypes F32, F16, BF16 and F64 are converted to fp32 on reading (fm_st_read_f32).
 *
 * A model's tensors may lie in one file or in several (fm_hf_files): a Hugging Face model folder
 * holds model.safetensors, or model.safetensors.index.json ({"weight_map": {"NAME": "SHARD", ...}},
 * as transformers' save_pretrained writes it) and the shard files it names. */
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
 * else (the per-expert rows of the table that a fused file replaces). gate < 0: the layer has
 * no experts (a dense layer: its mlp.{gate,up,down}_proj are ordinary rows of the table). */
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
    /* > 0: tensors "model.layers.<l>.*" with l >= this are skipped without a word: the MTP
     * layers a glm4_moe checkpoint holds after its num_hidden_layers (transformers' Glm4MoeModel
     * ignores them on load: _keys_to_ignore_on_load_unexpected); 0: none skipped */
    int64_t skip_layers_from;
    /* gpt_oss: per layer [n_layers] the offsets of the experts' biases, gate [E, I], up [E, I] and
     * down [E, H] in the fields gate, up, down (each contiguous; gate < 0: none), and the fused
     * gpt_oss layout above is read where a file has it; NULL: no expert biases (every other model) */
    const fm_hf_experts *expert_bias;
} fm_hf_table;

/* Fills out[0..n_params) with the table's tensors under their Hugging Face names with `prefix`
 * prepended (e.g. "exp_avg." for an optimizer state), names[i] holding the i-th name. With base
 * non-NULL, out[i].data = base + params[i].offset (fp32); with base NULL, data is NULL for the
 * caller to set (or a fetch callback). fetch, fetch_ctx, fetch_range and stage are cleared. Allocates nothing.
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

/* The open safetensors files that together hold one model's tensors. */
typedef struct fm_hf_files {
    fm_safetensors *st;  /* [n] */
    int n;
    char where[4400];    /* what they are, for messages: a file's path, or "DIR/model.safetensors.index.json" */
} fm_hf_files;

/* Opens `path`: a safetensors file, or a folder holding model.safetensors (preferred) or
 * model.safetensors.index.json and every shard its weight_map names (each opened and validated by
 * fm_st_open). Errors: FM_ERR_IO (the folder holds neither file, naming both; a shard cannot be
 * opened); FM_ERR_FORMAT (malformed index JSON or no weight_map object, a non-string or absolute
 * shard name, a tensor the index places in a shard that does not hold it; a shard's own
 * errors); FM_ERR_NOMEM. On error *f is closed. */
fm_status fm_hf_files_open(fm_hf_files *f, const char *path);

/* Closes every file; safe on a closed or zeroed struct. */
void fm_hf_files_close(fm_hf_files *f);

/* How fm_hf_read_files treats what the table does not expect. */
typedef struct fm_hf_read_opts {
    bool float_only;   /* every tensor read must be F32, BF16, F16 or F64 (messages name the fix for a
                          Hugging Face folder); other dtypes are refused either way */
    char *extra;       /* NULL: a tensor of the files (with the prefix) that the table does not hold is
                          an error. Non-NULL: they are listed here instead ("N tensors ...: a, b, ...";
                          "" when none), extra_cap bytes, for the caller's warning */
    size_t extra_cap;
} fm_hf_read_opts;

/* Reads every tensor of the table whose name carries `prefix` from the files f into base (fp32,
 * each at its offset), as fm_hf_read does for one file; a tensor is looked up in every file (the
 * first that holds it). opts NULL: strict (extras are an error). Never fills a tensor the files do
 * not hold: a missing one is an error naming it, its expected shape and the files.
 * Errors: FM_ERR_FORMAT naming the tensor when it is missing, has the wrong shape (expected and
 * found) or a dtype that is not a float (found, and the fix); naming an extra tensor (strict);
 * FM_ERR_IO from reading; FM_ERR_NOMEM. */
fm_status fm_hf_read_files(const fm_hf_table *t, const fm_hf_files *f, const char *prefix, float *base,
                           const fm_hf_read_opts *opts);

#ifdef __cplusplus
}
#endif
#endif
