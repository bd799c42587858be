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

/* Expert weights of one layer: gate and up [E,I,H], down [E,H,I] (stacked HF per-expert). */
typedef struct fm_moe_weights {
    const fm_act *w_gate, *w_up, *w_down;
} fm_moe_weights;

typedef struct fm_moe_grads {
    fm_act *w_gate, *w_up, *w_down; /* accumulated (+=) */
} fm_moe_grads;

/* The dims of the block. */
typedef struct fm_moe_dims {
    int64_t H, I, E, k;
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
} fm_moe_ws;

/* Chunk geometry: K = ceil(N / chunk_tokens), c_eff = ceil(N / K) (the largest chunk). With
 * chunk_tokens = 0 or >= N: K = 1, c_eff = N. */
void fm_moe_chunks(int64_t N, int64_t chunk_tokens, int64_t *K, int64_t *c_eff);

/* Bound formulas (bytes, each buffer rounded as fm_arena_alloc rounds; a = sizeof(fm_act)):
 *   routes(n)      = 2*n*k*4 + n*k*(2H + 3I)*a      (+ (E+1)*8 host bytes: the offsets)
 *   plain saved    = routes(N) per layer (saved for backward);  plain ws = n*k*(2H + 3I)*a with n = N
 *   chunked ws     = routes(c) + c*k*(2H + 3I)*a + 3*c*k*4 + 3*c*H*a with c = c_eff:
 *                    one chunk's forward and backward, whatever the routing (dropless: a chunk's
 *                    c*k routes fill exactly c*k rows however they are spread over experts). */
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

/* Forward: y [N,H] (assigned) = sum_j topk_w[n,j] * expert_{topk_idx[n,j]}(x[n]), x [N,H],
 * topk_idx/topk_w [N,k]. Plain twin: `saved` (routes over N) receives the intermediates.
 * Chunked (saved == NULL): chunk_tokens [N] (backend memory, fm_moe_chunk_order) gives the
 * chunks' tokens; ws holds one chunk at a time; nothing is saved. */
void fm_moe_forward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, fm_act *y,
                    const fm_act *x, const int32_t *topk_idx, const float *topk_w, int64_t N, int64_t K,
                    const int32_t *chunk_tokens, fm_moe_routes *saved, fm_moe_ws *ws);

/* Backward: dx [N,H] and dtopk_w [N,k] assigned, expert weight grads accumulated, from dy [N,H].
 * Plain twin reads `saved`; chunked recomputes each chunk's forward into ws first. */
void fm_moe_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w,
                     const fm_moe_grads *g, fm_act *dx, float *dtopk_w, const fm_act *dy, const fm_act *x,
                     const int32_t *topk_idx, const float *topk_w, int64_t N, int64_t K,
                     const int32_t *chunk_tokens, const fm_moe_routes *saved, fm_moe_ws *ws);

#endif
