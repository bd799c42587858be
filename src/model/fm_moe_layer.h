/* The MoE block of a layer after the router (Megatron-Core's moe_layer glue): for each dispatch
 * of the dispatcher's chunk schedule (bounded/fm_moe_dispatch.h), dispatch -> experts
 * (fm_experts.h) -> combine; backward recomputes a chunk's forward before its backward.
 *
 * Two forms, with the same arithmetic per route (see fm_moe_dispatch.h for the bounds):
 * - plain twin (saved != NULL): one dispatch of all N tokens, its intermediates saved for
 *   backward;
 * - chunked (saved == NULL): K strided chunks (token t -> chunk t mod K); nothing is saved and
 *   backward recomputes each chunk, so one chunk's intermediates are live at a time. Every chunk,
 *   an empty one too, passes through every phase (as a rank with zero tokens must under expert
 *   parallelism).
 * Outputs are bit-identical between the forms; expert weight gradients equal up to fp32
 * reassociation (the row grouping of the expert GEMMs differs). */
#ifndef FM_MOE_LAYER_H
#define FM_MOE_LAYER_H

#include "../bounded/fm_moe_dispatch.h"
#include "../bounded/fm_moe_ep.h"

/* Forward: y [N,H] (assigned) = sum_j topk_w[n,j] * expert_{topk_idx[n,j]}(x[n]), x [N,H],
 * topk_idx/topk_w [N,k]. Plain twin: `saved` (routes over N) receives the intermediates.
 * Chunked (saved == NULL): chunk_tokens [N] (backend memory, fm_moe_chunk_order) gives the
 * chunks' tokens; ws holds one chunk at a time; nothing is saved. Errors: FM_ERR_ARG for N < 0,
 * k outside [1, E], or the chunked form without K >= 1 or its token order (nothing is written). */
fm_status fm_moe_forward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, fm_act *y,
                         const fm_act *x, const int32_t *topk_idx, const float *topk_w, int64_t N, int64_t K,
                         const int32_t *chunk_tokens, fm_moe_routes *saved, fm_moe_ws *ws);

/* Backward: dx [N,H] and dtopk_w [N,k] assigned, expert weight grads accumulated, from dy [N,H].
 * Plain twin reads `saved`; chunked recomputes each chunk's forward into ws first. Errors: the
 * forward's. */
fm_status fm_moe_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w,
                          const fm_moe_grads *g, fm_act *dx, float *dtopk_w, const fm_act *dy, const fm_act *x,
                          const int32_t *topk_idx, const float *topk_w, int64_t N, int64_t K,
                          const int32_t *chunk_tokens, const fm_moe_routes *saved, fm_moe_ws *ws);

/* ---- expert parallelism (bounded/fm_moe_ep.h) -------------------------------------------------
 * The MoE block of a layer under --ep: the same contract as fm_moe_forward / fm_moe_backward in
 * the chunked form, but the experts of topk_idx (global ids in [0, E)) live on the ranks of the
 * ep group `comm` and w / g are this rank's E/ep experts, run in d's precision (any table of
 * fm_experts.h). The EP operator's pass (fm_moe_ep_fwd_begin / fm_moe_ep_bwd_begin,
 * fm_moe_ep_next) moves the rows and delivers each chunk's rows at this rank; this glue runs the
 * experts on them: this rank's own experts with the layer's weights as the table prepares them
 * once per call, in ws->exp_ws (under fp8 ws->exp_ws.w8_layer names the layer, as
 * fm_moe_ws.w8_layer does on one rank), and under least-loaded placement the experts hosted for
 * a chunk with the weights received, prepared per work into the operator's ws->hosted operands.
 * The chunks are the operator's (K = chunks agreed over the group, every rank running every
 * chunk's collectives, a rank with zero tokens routed to it too). timeout_s: per collective (0:
 * the communicator's default). Errors: those of fm_moe_ep_fwd_begin / fm_moe_ep_next (the same
 * on every rank of comm). */
fm_status fm_moe_ep_block_forward(const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                                  const fm_moe_weights *w, fm_act *y, const fm_act *x, const int32_t *topk_idx,
                                  const float *topk_w, int64_t N, int64_t K, const int32_t *chunk_tokens,
                                  fm_moe_ep_ws *ws, double timeout_s);
fm_status fm_moe_ep_block_backward(const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                                   const fm_moe_weights *w, const fm_moe_grads *g, fm_act *dx, float *dtopk_w,
                                   const fm_act *dy, const fm_act *x, const int32_t *topk_idx, const float *topk_w,
                                   int64_t N, int64_t K, const int32_t *chunk_tokens, fm_moe_ep_ws *ws,
                                   double timeout_s);

/* The layer's calls (the trainer's): fm_moe_ep_block_forward / _backward with the default
 * timeout; the forward also adds, into counts [E] (NULL: none), this rank's routes per expert
 * (the trainer's expert-load record, as count_load does for the local dispatch), read from
 * topk_idx (through counts_host [N*k] int32, a host copy, when the backend's memory is not host
 * memory). */
fm_status fm_moe_ep_layer_forward(const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                                  const fm_moe_weights *w, fm_act *y, const fm_act *x, const int32_t *topk_idx,
                                  const float *topk_w, int64_t N, int64_t K, const int32_t *chunk_tokens,
                                  fm_moe_ep_ws *ws, int64_t *counts, int32_t *counts_host);
fm_status fm_moe_ep_layer_backward(const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                                   const fm_moe_weights *w, const fm_moe_grads *g, fm_act *dx, float *dtopk_w,
                                   const fm_act *dy, const fm_act *x, const int32_t *topk_idx, const float *topk_w,
                                   int64_t N, int64_t K, const int32_t *chunk_tokens, fm_moe_ep_ws *ws);

#endif
