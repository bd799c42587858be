/* FP8 blockwise experts (--expert-precision fp8): the numerics of E4M3 expert GEMMs with
 * DeepSeek-V3's fine-grained scaling (arXiv 2412.19437 §3.3; power-of-two UE8M0 scales as in
 * DeepSeek-V3.1 / MXFP8), emulated: before each expert GEMM its operands are fake-quantized
 * (backend op quant_fp8_*, backend/fm_fp8.h) into the working set, and the backend's plain
 * expert GEMM (fp32 accumulation) runs on them. Since every quantized value is exact in fm_act,
 * this equals the FP8 GEMM with per-tile scales up to the order of the fp32 sums. It gives the
 * recipe's numerics, not its speed.
 *
 * The fast path (d->fp8_codes: the backend's expert_fp8_serves, CUDA on sm_90): the same
 * operands quantized into real E4M3 codes with their scales (backend op fp8_quant_*, the byte
 * layouts of backend/fm_fp8_layout.h, the same recipe and bits) and the backend's FP8 grouped
 * GEMM (expert_fp8_gemm: each 128-deep k-block's partial sum promoted into fp32 times the two
 * scales). The offsets are read where the device reads them, so this path is sync-free. The
 * products and the quantization of each operand are the emulation's, one for one; only the
 * order of the fp32 sums differs (tests/test_fp8_codes.c: the two paths agree).
 *
 * Tiles per product (K: the GEMM's reduction dimension):
 *   forward  y = x W^T (K = in):   x in 1 x 128 tiles per row, W [E,out,in] in 128 x 128 blocks
 *   dgrad    dx = dy W (K = out):  dy in 1 x 128 tiles per row, the same quantized W
 *   wgrad    dW = dy^T x (K = the expert's rows): dy and x in 128 x 1 tiles along the rows of
 *            each expert (rows [offsets[e], offsets[e+1]); its last tile shorter)
 * The master weights, the weight gradients and everything outside the expert GEMMs (router,
 * SwiGLU, combine) stay as they are. The weights are quantized once per call of fm_moe_forward
 * / fm_moe_backward for a layer (before the chunk loop; a chunked backward's recompute uses the
 * same copy), into ws->q_gate, q_up, q_down: deterministic, so a recompute sees the same bits.
 * On the fast path they go into ws->w8; with --fp8-weight-cache (d->fp8_cache_layers > 0) into
 * layer ws->w8_layer's own set in ws->w8_cache, only when ws->w8_fresh[layer] is false: once
 * between two fm_model_fp8_cache_invalidate calls, which must come after every change of the
 * master weights (the trainer: at each step's start and each evaluation's), else the codes of
 * the old weights are used.
 * The activation operands use ws->q_a and q_b ([R, max(H,I)]); the fast path uses ws->w8, a8,
 * a8u and t8 instead, and quantizes fused where an operand's source was just made: SwiGLU's
 * output with its rows operand (fp8_swiglu_fwd_quant), dy's two operands in one pass
 * (fp8_quant_dual), and the SwiGLU backward's dgate, dup straight into their four operands
 * (fp8_swiglu_bwd_quant: no fm_act dh_gate, dh_up on this path); the same bytes as the unfused
 * ops. Bytes: fm_moe_fp8_bytes (fm_moe_ws_bytes's fp8 term, fm_moe_ep_bound's fp8 part). The
 * emulation needs the backend's quant_fp8_* ops and the host-offset expert GEMMs (not
 * sync-free). Under expert parallelism the same functions run at the owner of the rows over its
 * E/ep experts (the EP operator's exp_ws holds their operands, quantized by the glue per layer
 * call), and over the experts hosted for a chunk under least-loaded placement (their own
 * operands, ws->hosted of fm_moe_ep_ws, quantized by the glue per work). */
#ifndef FM_EXPERTS_FP8_H
#define FM_EXPERTS_FP8_H

#include "fm_experts.h"

/* Quantizes w's gate, up [E,I,H] and down [E,H,I] in 128 x 128 blocks into ws->q_*, and points
 * *wq at them (the fast path: into ws->w8's code operands; *wq = *w, unused). Skipped where the
 * set already holds layer ws->w8_layer's codes: with the weight cache, ws->w8 is first pointed at
 * layer ws->w8_layer's set, quantized only when that layer's ws->w8_fresh flag is false, then set;
 * without it, for a backward (`backward`) of the layer ws->w8_holds names (ws->w8_layer >= 0),
 * whose forward or recompute quantized the same weights last. No errors (the backend's status
 * carries a kernel's). */
void fm_experts_fp8_weights(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, fm_moe_ws *ws,
                            fm_moe_weights *wq, bool backward);

/* fm_experts_forward's contract with wq the quantized weights (fm_experts_fp8_weights); the
 * GEMMs' activation operands quantized into ws->q_a (the fast path: ws->a8, and wq unused). */
void fm_experts_fp8_forward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *wq, fm_moe_routes *r,
                            fm_moe_ws *ws, int64_t n);

/* fm_experts_backward's contract with wq the quantized weights: each dgrad on dy quantized in
 * row tiles, each wgrad on dy and x quantized in each expert's row tiles (ws->q_a, q_b; the fast
 * path: ws->a8, a8u, t8, wq unused, and ws->dh_gate, dh_up NULL, never written). */
void fm_experts_fp8_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *wq,
                             const fm_moe_grads *g, const fm_moe_routes *r, fm_moe_ws *ws, int64_t n);

/* The two fp8 tables (fm_experts.h's fm_moe_experts) over the functions above:
 * weights fm_experts_fp8_weights, forward and backward as above, ws_bytes fm_moe_fp8_bytes.
 * fm_experts_fp8_emulated (d->fp8, not d->fp8_codes) serves a backend with the quant_fp8_* ops;
 * fm_experts_fp8_codes (d->fp8 and d->fp8_codes) one whose fp8 code ops serve E = d->E experts of
 * d->H x d->I over rows_max rows (fm_backend_fp8_codes_serves). Both serve expert parallelism
 * (the glue runs them at the owner over fm_moe_ep_local_dims, on the rows the EP operator
 * delivers) and least-loaded placement (the experts hosted for a chunk: their weights as
 * received quantized by `weights` into the operator's hosted operands, every work). */
extern const fm_moe_experts fm_experts_fp8_emulated;
extern const fm_moe_experts fm_experts_fp8_codes;

#endif
