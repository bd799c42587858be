/* The MoE expert block after the router: dispatch (permute by expert), SwiGLU expert GEMMs,
 * combine (weighted sum), forward and backward; dropless.
 *
 * Two forms, with the same arithmetic per route:
 * - plain twin (chunk_tokens = 0): all N*k routes at once; every intermediate of every layer is
 *   saved for backward. Memory grows with L*N*k*(2H + 3I).
 * - chunked (chunk_tokens = c > 0): the N tokens are split into K = ceil(N/c) chunks with
 *   strided membership (token t -> chunk t mod K; PipelinedLLEP, arXiv 2609.14306 §3); each
 *   chunk is gathered, permuted, run through the experts and combined; nothing of it is saved,
 *   and backward recomputes each chunk's forward before its backward, so only one chunk's
 *   intermediates are ever live. Memory: one chunk's working set, independent of N, L and of
 *   the routing matrix.
 * The per-route arithmetic is identical; only the row grouping of the expert GEMMs (and so the
 * summation order of the expert weight gradients) differs: outputs are bit-identical, weight
 * gradients equal up to fp32 reassociation.
 */
#ifndef FM_MOE_DISPATCH_H
#define FM_MOE_DISPATCH_H

#include "../backend/fm_backend.h"
#include "../core/fm_arena.h"

/* Expert weights of one layer: gate and up [E,I,H], down [E,H,I] (stacked HF per-expert); the
 * experts' biases (gpt_oss), gate and up [E,I], down [E,H], or NULL (none: every other model). */
typedef struct fm_moe_weights {
    const fm_act *w_gate, *w_up, *w_down;
    const fm_act *b_gate, *b_up, *b_down;
} fm_moe_weights;

typedef struct fm_moe_grads {
    fm_act *w_gate, *w_up, *w_down; /* accumulated (+=) */
    fm_act *b_gate, *b_up, *b_down; /* accumulated (+=); NULL with the weights' biases */
} fm_moe_grads;

/* The dims of the block. sync_free: the backend runs the expert GEMMs from device-readable
 * offsets (fm_backend.h, expert_sync_free), so a dispatch does not wait for the host and the
 * expert-load counts are added on the device; false (the default of a 4-value initializer) keeps
 * the host-offset path. */
typedef struct fm_moe_dims {
    int64_t H, I, E, k;
    bool sync_free;
    bool fp8; /* --expert-precision fp8: the expert GEMMs' operands fake-quantized to blockwise E4M3
                 (model/fm_experts_fp8.h); the working set then holds the quantized copies */
    bool fp8_codes; /* with fp8: the backend runs the expert GEMMs on E4M3 codes (fm_backend.h
                       expert_fp8_serves; model/fm_experts_fp8.h's fast path), the working set
                       then holds the code operands (backend/fm_fp8_layout.h) instead */
    int64_t fp8_cache_layers; /* with fp8_codes: > 0 keeps that many layers' weight operands
                                 (ws->w8_cache) instead of one set; 0: none */
    float swiglu_limit, swiglu_alpha; /* > 0: GPT-OSS's clamped SwiGLU (fm_backend.h swiglu_clamp_fwd);
                                         0: the plain SwiGLU */
    bool bias; /* the experts carry biases (gpt_oss: fm_moe_weights' b_gate, b_up, b_down): under
                  least-loaded placement the EP operator sends them with the hosted experts' weights
                  and their gradients back (fm_moe_ep.h); the experts' table reads w's pointers */
} fm_moe_dims;

/* Buffers of one dispatch over n tokens (R = n*k routes): the routing index and the expert
 * intermediates. The plain twin keeps one per layer (n = N); the chunked form keeps one for
 * the current chunk (n = c_eff) in its working set. */
typedef struct fm_moe_routes {
    int64_t *offsets;               /* [E+1] host memory */
    int32_t *row_route, *route_row; /* [R] */
    fm_act *xe;                     /* [R,H] gathered inputs */
    fm_act *h_gate, *h_up, *h_act;  /* [R,I] */
    fm_act *ye;                     /* [R,H] expert outputs */
} fm_moe_routes;

/* Working set of the backward of one dispatch (R rows), and, for the chunked form, the chunk's
 * gathered rows. */
typedef struct fm_moe_ws {
    fm_act *dye, *dxe;                 /* [R,H] */
    fm_act *dact, *dh_gate, *dh_up;    /* [R,I] */
    /* chunked form only (NULL for the plain twin): */
    int32_t *topk_idx;                 /* [c,k] */
    float *topk_w, *dtopk_w;           /* [c,k] */
    fm_act *xc, *yc, *dxc;             /* [c,H]: inputs, outputs / output grads, input grads */
    fm_moe_routes r;                   /* the chunk's routes */
    /* d->fp8 only (NULL otherwise; model/fm_experts_fp8.h): the layer's quantized expert weights
     * (gate, up [E,I,H], down [E,H,I]) and two [R, max(H,I)] buffers of quantized operands */
    fm_act *q_gate, *q_up, *q_down, *q_a, *q_b;
    /* d->fp8 with d->fp8_codes instead (the q_* above NULL): the same bytes hold E4M3 operands
     * in backend/fm_fp8_layout.h's layouts, for fp8_rcap rows (the n*k this ws was laid out for):
     * the weights' (gate, up, down), one rows operand (a8) and two tokens operands (t8[0], t8[1])
     * of max(H,I) columns, and dup's rows (a8u) and tokens (t8[2]) operands of I columns; dh_gate,
     * dh_up are NULL then (fp8_swiglu_bwd_quant codes dgate, dup without storing them) */
    void *w8[3], *a8, *a8u, *t8[3];
    int64_t fp8_rcap;
    /* d->fp8_cache_layers > 0: layer l's weight operands at w8_cache + l * w8_stride (gate, up,
     * down), quantized when w8_fresh[l] is false (then set); w8_layer: the layer the next
     * fm_moe_forward / fm_moe_backward runs (its caller sets it); w8_fresh [layers] host flags
     * (the model's). NULL / 0 without the cache. */
    uint8_t *w8_cache;
    int64_t w8_stride, w8_layer;
    bool *w8_fresh;
    /* Without the cache (d->fp8 on either path): the layer (w8_layer's value) whose quantized
     * weights the one set (q_* or w8) holds from the last fm_experts_fp8_weights, -1 for none;
     * fm_moe_backward of that layer uses them instead of quantizing the same weights again (its
     * forward or recompute ran just before it, no other layer's between). The trainer resets it
     * to -1 where the weights change (fm_model_fp8_cache_invalidate); a forward always
     * quantizes. */
    int64_t w8_holds;
    /* Expert load: NULL, or host int64 [E] to which fm_moe_forward adds each dispatch's tokens
     * per expert (offsets[e+1] - offsets[e], read from the pinned offsets after the dispatch's
     * sync point: no extra wait). Only the forward counts, never the recompute inside
     * fm_moe_backward; the trainer's hook points it at layer l's row around layer l's forward
     * and clears it after, so a recomputed layer's second forward is not counted either. */
    int64_t *counts;
} fm_moe_ws;

/* The fp8 working set for dispatches of `rows` rows over d->E experts (d->fp8; the header's "fp8"
 * bound term: the emulation's quantized weights and operands, or with d->fp8_codes the code
 * operands, with d->fp8_cache_layers sets of weights); 0 without d->fp8. act_bytes as above. */
size_t fm_moe_fp8_bytes(const fm_moe_dims *d, int64_t rows, size_t act_bytes);
/* Carves that working set from arena a into w's q_* (emulation) or w8, a8, a8u, t8, w8_cache
 * (codes) and sets fp8_rcap, w8_stride; one allocation of fm_moe_fp8_bytes(d, rows,
 * sizeof(fm_act)) bytes. Nothing without d->fp8. */
void fm_moe_ws_fp8_layout(fm_moe_ws *w, fm_arena *a, const fm_moe_dims *d, int64_t rows);

/* --fp8-weight-cache (d->fp8_cache_layers > 0): points w->w8 at layer l's weight operands in
 * w->w8_cache (gate, up, down, as fm_moe_ws_layout carves them). */
void fm_moe_ws_fp8_layer(fm_moe_ws *w, const fm_moe_dims *d, int64_t l);

/* Chunk geometry: K = ceil(N / chunk_tokens), c_eff = ceil(N / K) (the largest chunk). With
 * chunk_tokens = 0 or >= N: K = 1, c_eff = N. */
void fm_moe_chunks(int64_t N, int64_t chunk_tokens, int64_t *K, int64_t *c_eff);

/* Bound formulas (bytes, each buffer rounded as fm_arena_alloc rounds; a = sizeof(fm_act)):
 *   routes(n)      = 2*n*k*4 + n*k*(2H + 3I)*a      (+ (E+1)*8 host bytes: the offsets)
 *   plain saved    = routes(N) per layer (saved for backward);  plain ws = n*k*(2H + 3I)*a with n = N
 *   chunked ws     = routes(c) + c*k*(2H + 3I)*a + 3*c*k*4 + 3*c*H*a with c = c_eff:
 *                    one chunk's forward and backward, whatever the routing (dropless: a chunk's
 *                    c*k routes fill exactly c*k rows however they are spread over experts).
 *   fp8 (d->fp8)   adds to either ws the emulation's 3*E*H*I*a (the layer's quantized weights) +
 *                  2*n*k*max(H,I)*a, or with d->fp8_codes the code operands' fm_fp8_dev_ws_bytes
 *                  (H and I multiples of 128; about 6*E*H*I + 3*n*k*max(H,I) + 256*E*max(H,I)
 *                  + 2*n*k*I + 128*E*I bytes) less dh_gate, dh_up's 2*n*k*I*a; with
 *                  d->fp8_cache_layers = L > 0 the weights' 6*E*H*I (+ scales) L times. */
size_t fm_moe_routes_bytes(const fm_moe_dims *d, int64_t n, size_t act_bytes);
size_t fm_moe_ws_bytes(const fm_moe_dims *d, int64_t n, bool chunked, size_t act_bytes);

/* Lays out the buffers from an arena (a measuring arena gives the bytes); the expert offsets
 * [E+1] (read by the host to size the expert GEMMs) come from `host`, an arena of host memory
 * (NULL: `a`, when a is host memory). */
void fm_moe_routes_layout(fm_moe_routes *r, fm_arena *a, fm_arena *host, const fm_moe_dims *d, int64_t n);
void fm_moe_ws_layout(fm_moe_ws *w, fm_arena *a, fm_arena *host, const fm_moe_dims *d, int64_t n, bool chunked);
/* Host bytes of one routes layout (the offsets). */
size_t fm_moe_routes_host_bytes(const fm_moe_dims *d);

/* The chunk-major token order for N tokens in K strided chunks: chunk j's tokens j, j+K, j+2K, ...
 * come at positions [start_j, start_j + n_j), n_j = ceil((N - j) / K). tokens [N] host memory
 * (the caller uploads it once, at layout). */
void fm_moe_chunk_order(int32_t *tokens, int64_t N, int64_t K);

/* ---- the dispatcher's phases (Megatron-Core's token dispatcher: dispatch preprocess, token
 * dispatch, combine), over one dispatch of n tokens (a chunk, or all N for the plain twin).
 * Local today; under expert parallelism the token dispatch and combine become all-to-all-v.
 * n may be 0 (a rank or chunk with no tokens passes through every phase; nothing is done but
 * the offsets are set to zero). The experts (model/fm_experts.h) run between dispatch and
 * combine on r->xe -> r->ye. */

/* Dispatch preprocess and token dispatch: the routing index of topk_idx [n,k] into r (offsets
 * on the host, row_route, route_row) and the permuted rows r->xe [n*k,H] of x [n,H]. Ends with
 * the dispatch's one sync point, "MoE offsets" (the host reads the expert offsets from pinned
 * memory to size the grouped expert GEMMs). */
void fm_moe_dispatch(const fm_backend *be, const fm_moe_dims *d, fm_moe_routes *r, const fm_act *x,
                     const int32_t *topk_idx, int64_t n);
/* Combine: y [n,H] (assigned) = sum_j topk_w[t,j] * r->ye[route_row[t*k+j]]. */
void fm_moe_combine(const fm_backend *be, const fm_moe_dims *d, const fm_moe_routes *r, fm_act *y,
                    const float *topk_w, int64_t n);
/* Backward of the combine: dye [n*k,H] and dtopk_w [n,k] assigned from dy [n,H]. */
void fm_moe_combine_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_routes *r, fm_act *dye,
                             float *dtopk_w, const fm_act *dy, const float *topk_w, int64_t n);
/* Backward of the token dispatch: dx [n,H] (assigned) = sum over each token's k rows of dxe. */
void fm_moe_dispatch_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_routes *r, fm_act *dx,
                              const fm_act *dxe, int64_t n);

/* ---- the chunk schedule (chunked form): chunk j of K holds tokens j, j+K, j+2K, ... ---------- */

/* Tokens in chunk j: n_j = ceil((N - j) / K) (0 when j >= N), at offset start_j of the
 * chunk-major order (fm_moe_chunk_order). */
int64_t fm_moe_chunk_size(int64_t N, int64_t K, int64_t j);
/* Chunk j's token rows: ws->xc [n_j,H] from x, ws->topk_idx/topk_w [n_j,k] from the layer's
 * [N,k] (gather_rows by tok, chunk j's slice of the chunk-major order). */
void fm_moe_chunk_gather(const fm_backend *be, const fm_moe_dims *d, fm_moe_ws *ws, const fm_act *x,
                         const int32_t *topk_idx, const float *topk_w, const int32_t *tok, int64_t n);
/* dst row i = src rows tok[i] (i < n) of row_bytes bytes: a layer-wide tensor's rows of a chunk. */
void fm_moe_chunk_gather_rows(const fm_backend *be, void *dst, const void *src, const int32_t *tok, int64_t n,
                              int64_t row_bytes);
/* dst rows tok[i] = src row i (i < n) of row_bytes bytes: a chunk's outputs back to the layer. */
void fm_moe_chunk_scatter(const fm_backend *be, void *dst, const void *src, const int32_t *tok, int64_t n,
                          int64_t row_bytes);

#endif
