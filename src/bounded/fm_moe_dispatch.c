#include "fm_moe_dispatch.h"

#include <string.h>

#include "../backend/fm_fp8_layout.h"

/* Bound (see the header; a = sizeof(fm_act)): a dispatch over n tokens holds
 *   routes(n) = row_route, route_row 2*n*k*4 + xe, ye 2*n*k*H*a  (+ the host offsets (E+1)*8)
 *               + h_gate, h_up, h_act 3*n*k*I*a
 * and its backward dye, dxe 2*n*k*H*a + dact, dh_gate, dh_up 3*n*k*I*a (the FP8 codes path: dact
 * alone, 1*n*k*I*a; its code operands replace dh_gate, dh_up). The chunked form adds
 * the chunk's top-k rows 3*c*k*4 (idx, w, dw) and xc, yc, dxc 3*c*H*a, and holds routes(c)
 * itself (the chunk-major token order [N] int32 lives with the boundaries). Nothing here depends on how the router spreads the routes: a
 * dispatch of n tokens has exactly n*k rows (dropless). */

#define R4(x) fm_arena_round((size_t)(x) * 4)
#define R8(x) fm_arena_round((size_t)(x) * 8)
#define RA(x) fm_arena_round((size_t)(x) * a)

size_t fm_moe_routes_bytes(const fm_moe_dims *d, int64_t n, size_t a) {
    const int64_t R = n * d->k;
    return 2 * R4(R) + 2 * RA(R * d->H) + 3 * RA(R * d->I);
}

size_t fm_moe_routes_host_bytes(const fm_moe_dims *d) { return R8(d->E + 1); }

/* The fp8 term (the header): the emulation's buffers, or with d->fp8_codes the code operands. */
static size_t fp8_emu_bytes(const fm_moe_dims *d, int64_t R, size_t a) {
    return 3 * RA(d->E * d->H * d->I) + 2 * RA(R * (d->H > d->I ? d->H : d->I));
}
/* one layer's three weight operands (gate, up, down), each rounded as the arena rounds */
static size_t fp8_weights_bytes(const fm_moe_dims *d) {
    return 2 * fm_arena_round((size_t)fm_fp8_weight_bytes(d->E, d->I, d->H)) +
           fm_arena_round((size_t)fm_fp8_weight_bytes(d->E, d->H, d->I));
}
static size_t fp8_codes_bytes(const fm_moe_dims *d, int64_t R) {
    if (!fm_fp8_layout_serves(d->H, d->I)) return 0;
    const size_t one = (size_t)fm_fp8_dev_ws_bytes(d->E, d->H, d->I, R, 64); /* one set of weights */
    return d->fp8_cache_layers > 0 ? one - fp8_weights_bytes(d) + (size_t)d->fp8_cache_layers * fp8_weights_bytes(d)
                                   : one;
}
static size_t fp8_bytes(const fm_moe_dims *d, int64_t R, size_t a) {
    return d->fp8_codes ? fp8_codes_bytes(d, R) : fp8_emu_bytes(d, R, a);
}

size_t fm_moe_fp8_bytes(const fm_moe_dims *d, int64_t rows, size_t a) { return d->fp8 ? fp8_bytes(d, rows, a) : 0; }

/* The codes path's own buffers replace dh_gate, dh_up (fp8_swiglu_bwd_quant codes dgate, dup
 * without storing them): the layout has no fm_act dh_gate, dh_up then. */
static bool codes_ws(const fm_moe_dims *d) { return d->fp8 && d->fp8_codes && fm_fp8_layout_serves(d->H, d->I); }

size_t fm_moe_ws_bytes(const fm_moe_dims *d, int64_t n, bool chunked, size_t a) {
    const int64_t R = n * d->k;
    size_t b = 2 * RA(R * d->H) + (codes_ws(d) ? 1 : 3) * RA(R * d->I);
    if (chunked) b += 3 * R4(n * d->k) + 3 * RA(n * d->H) + fm_moe_routes_bytes(d, n, a);
    if (d->fp8) b += fp8_bytes(d, R, sizeof(fm_act));
    return b;
}

void fm_moe_chunk_order(int32_t *tokens, int64_t N, int64_t K) {
    int64_t p = 0;
    for (int64_t j = 0; j < K; j++)
        for (int64_t t = j; t < N; t += K) tokens[p++] = (int32_t)t;
}

void fm_moe_chunks(int64_t N, int64_t chunk_tokens, int64_t *K, int64_t *c_eff) {
    int64_t k = (chunk_tokens <= 0 || chunk_tokens >= N) ? 1 : (N + chunk_tokens - 1) / chunk_tokens;
    *K = k;
    *c_eff = (N + k - 1) / k;
}

#define TAKE(a, type, count) ((type *)fm_arena_alloc((a), sizeof(type) * (size_t)(count)))

void fm_moe_routes_layout(fm_moe_routes *r, fm_arena *a, fm_arena *host, const fm_moe_dims *d, int64_t n) {
    const int64_t R = n * d->k;
    r->offsets = TAKE(host ? host : a, int64_t, d->E + 1);
    r->row_route = TAKE(a, int32_t, R);
    r->route_row = TAKE(a, int32_t, R);
    r->xe = TAKE(a, fm_act, R * d->H);
    r->h_gate = TAKE(a, fm_act, R * d->I);
    r->h_up = TAKE(a, fm_act, R * d->I);
    r->h_act = TAKE(a, fm_act, R * d->I);
    r->ye = TAKE(a, fm_act, R * d->H);
}

void fm_moe_ws_layout(fm_moe_ws *w, fm_arena *a, fm_arena *host, const fm_moe_dims *d, int64_t n, bool chunked) {
    const int64_t R = n * d->k;
    w->counts = NULL; /* no expert-load counting until a caller sets it */
    w->dye = TAKE(a, fm_act, R * d->H);
    w->dxe = TAKE(a, fm_act, R * d->H);
    w->dact = TAKE(a, fm_act, R * d->I);
    w->dh_gate = codes_ws(d) ? NULL : TAKE(a, fm_act, R * d->I);
    w->dh_up = codes_ws(d) ? NULL : TAKE(a, fm_act, R * d->I);
    if (chunked) {
        w->topk_idx = TAKE(a, int32_t, n * d->k);
        w->topk_w = TAKE(a, float, n * d->k);
        w->dtopk_w = TAKE(a, float, n * d->k);
        w->xc = TAKE(a, fm_act, n * d->H);
        w->yc = TAKE(a, fm_act, n * d->H);
        w->dxc = TAKE(a, fm_act, n * d->H);
        fm_moe_routes_layout(&w->r, a, host, d, n);
    } else {
        w->topk_idx = NULL;
        w->topk_w = w->dtopk_w = NULL;
        w->xc = w->yc = w->dxc = NULL;
    }
    fm_moe_ws_fp8_layout(w, a, d, R);
}

void fm_moe_ws_fp8_layout(fm_moe_ws *w, fm_arena *a, const fm_moe_dims *d, int64_t rows) {
    const int64_t R = rows;
    w->q_gate = w->q_up = w->q_down = w->q_a = w->q_b = NULL;
    w->w8[0] = w->w8[1] = w->w8[2] = w->a8 = w->a8u = w->t8[0] = w->t8[1] = w->t8[2] = NULL;
    w->fp8_rcap = 0;
    w->w8_cache = NULL, w->w8_stride = 0, w->w8_layer = -1, w->w8_fresh = NULL, w->w8_holds = -1;
    if (d->fp8) { /* model/fm_experts_fp8.h: one block of fp8_bytes, carved for the path */
        uint8_t *q = TAKE(a, uint8_t, fp8_bytes(d, R, sizeof(fm_act)));
        size_t at = 0;
#define CARVE(bytes) ((void *)(q + (at += fm_arena_round((size_t)(bytes))) - fm_arena_round((size_t)(bytes))))
        const int64_t M = d->H > d->I ? d->H : d->I;
        if (d->fp8_codes) {
            FM_ASSERT(fm_fp8_layout_serves(d->H, d->I));
            const int64_t kcap = fm_fp8_kcap(R, d->E);
            /* the weights last: written whole every step, so the arena's high-water mark reaches its
             * bound (a tokens operand's last padding blocks are touched only when many experts' rows
             * end just past a 128-row tile) */
            w->a8 = CARVE(fm_fp8_rows_bytes(R, M));
            w->t8[0] = CARVE(fm_fp8_tokens_bytes(kcap, M));
            w->t8[1] = CARVE(fm_fp8_tokens_bytes(kcap, M));
            w->a8u = CARVE(fm_fp8_rows_bytes(R, d->I));
            w->t8[2] = CARVE(fm_fp8_tokens_bytes(kcap, d->I));
            if (d->fp8_cache_layers > 0) { /* every layer's set; fm_experts_fp8_weights points w8 at one */
                w->w8_stride = (int64_t)fp8_weights_bytes(d);
                w->w8_cache = CARVE((size_t)d->fp8_cache_layers * fp8_weights_bytes(d));
            } else {
                w->w8[0] = CARVE(fm_fp8_weight_bytes(d->E, d->I, d->H));
                w->w8[1] = CARVE(fm_fp8_weight_bytes(d->E, d->I, d->H));
                w->w8[2] = CARVE(fm_fp8_weight_bytes(d->E, d->H, d->I));
            }
            w->fp8_rcap = R;
            FM_ASSERT(at == fp8_codes_bytes(d, R));
        } else {
            const size_t ab = sizeof(fm_act);
            w->q_gate = CARVE(ab * (size_t)(d->E * d->I * d->H));
            w->q_up = CARVE(ab * (size_t)(d->E * d->I * d->H));
            w->q_down = CARVE(ab * (size_t)(d->E * d->H * d->I));
            w->q_a = CARVE(ab * (size_t)(R * M));
            w->q_b = CARVE(ab * (size_t)(R * M));
            FM_ASSERT(at == fp8_emu_bytes(d, R, ab));
        }
#undef CARVE
    }
}

void fm_moe_ws_fp8_layer(fm_moe_ws *w, const fm_moe_dims *d, int64_t l) {
    FM_ASSERT(w->w8_cache && l >= 0 && l < d->fp8_cache_layers);
    uint8_t *base = w->w8_cache + l * w->w8_stride;
    const size_t gu = fm_arena_round((size_t)fm_fp8_weight_bytes(d->E, d->I, d->H)); /* fp8_weights_bytes's order */
    w->w8[0] = base, w->w8[1] = base + gu, w->w8[2] = base + 2 * gu;
}

/* ---- the dispatcher's phases --------------------------------------------------------------- */

void fm_moe_dispatch(const fm_backend *be, const fm_moe_dims *d, fm_moe_routes *r, const fm_act *x,
                     const int32_t *topk_idx, int64_t n) {
    fm_phase_mark(be, FM_PHASE_DISPATCH);
    if (n == 0) { /* (sync-free: the device may still read the previous dispatch's offsets) */
        if (d->sync_free) be->ops->stream_sync(be->ctx, FM_STREAM_COMPUTE);
        memset(r->offsets, 0, sizeof(int64_t) * (size_t)(d->E + 1));
        return;
    }
    be->ops->moe_route_index(be->ctx, r->offsets, r->row_route, r->route_row, topk_idx, n, d->E, d->k);
    be->ops->moe_gather(be->ctx, r->xe, x, r->row_route, n * d->k, d->k, d->H);
    /* sync point "MoE offsets": the expert GEMMs' sizes (pinned host memory) are read on the
     * host — once per dispatch, the only wait of an MoE chunk; none when the GEMMs read them on
     * the device (d->sync_free) */
    if (!d->sync_free) be->ops->stream_sync(be->ctx, FM_STREAM_COMPUTE);
}

void fm_moe_combine(const fm_backend *be, const fm_moe_dims *d, const fm_moe_routes *r, fm_act *y,
                    const float *topk_w, int64_t n) {
    fm_phase_mark(be, FM_PHASE_DISPATCH);
    if (n > 0) be->ops->moe_combine_fwd(be->ctx, y, r->ye, topk_w, r->route_row, n, d->k, d->H);
}

void fm_moe_combine_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_routes *r, fm_act *dye,
                             float *dtopk_w, const fm_act *dy, const float *topk_w, int64_t n) {
    fm_phase_mark(be, FM_PHASE_DISPATCH);
    if (n > 0) be->ops->moe_combine_bwd(be->ctx, dye, dtopk_w, dy, r->ye, topk_w, r->route_row, n, d->k, d->H);
}

void fm_moe_dispatch_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_routes *r, fm_act *dx,
                              const fm_act *dxe, int64_t n) {
    fm_phase_mark(be, FM_PHASE_DISPATCH);
    if (n > 0) be->ops->moe_gather_bwd(be->ctx, dx, dxe, r->route_row, n, d->k, d->H);
}

/* ---- the chunk schedule ---------------------------------------------------------------------- */

int64_t fm_moe_chunk_size(int64_t N, int64_t K, int64_t j) { return j >= N ? 0 : (N - j + K - 1) / K; }

void fm_moe_chunk_gather(const fm_backend *be, const fm_moe_dims *d, fm_moe_ws *ws, const fm_act *x,
                         const int32_t *topk_idx, const float *topk_w, const int32_t *tok, int64_t n) {
    fm_phase_mark(be, FM_PHASE_DISPATCH);
    if (n == 0) return;
    be->ops->gather_rows(be->ctx, ws->xc, x, tok, n, d->H * (int64_t)sizeof(fm_act));
    be->ops->gather_rows(be->ctx, ws->topk_idx, topk_idx, tok, n, d->k * (int64_t)sizeof(int32_t));
    be->ops->gather_rows(be->ctx, ws->topk_w, topk_w, tok, n, d->k * (int64_t)sizeof(float));
}

void fm_moe_chunk_gather_rows(const fm_backend *be, void *dst, const void *src, const int32_t *tok, int64_t n,
                              int64_t row_bytes) {
    if (n > 0) be->ops->gather_rows(be->ctx, dst, src, tok, n, row_bytes);
}

void fm_moe_chunk_scatter(const fm_backend *be, void *dst, const void *src, const int32_t *tok, int64_t n,
                          int64_t row_bytes) {
    if (n > 0) be->ops->scatter_rows(be->ctx, dst, src, tok, n, row_bytes);
}
