/* FP8 blockwise experts, emulated by fake quantization (fm_experts_fp8.h; DeepSeek-V3 §3.3). */
#include "fm_experts_fp8.h"

void fm_experts_fp8_weights(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, fm_moe_ws *ws,
                            fm_moe_weights *wq, bool backward) {
    /* without the cache: a backward right after its layer's forward or recompute keeps its codes */
    const bool held = !ws->w8_cache && backward && ws->w8_layer >= 0 && ws->w8_holds == ws->w8_layer;
    if (!ws->w8_cache) ws->w8_holds = ws->w8_layer;
    if (d->fp8_codes) {
        *wq = *w; /* unused: the codes path reads ws->w8 */
        if (ws->w8_cache) { /* --fp8-weight-cache: layer w8_layer's own set, quantized once a step */
            FM_ASSERT(ws->w8_fresh);
            fm_moe_ws_fp8_layer(ws, d, ws->w8_layer);
            if (ws->w8_fresh[ws->w8_layer]) return;
            ws->w8_fresh[ws->w8_layer] = true;
        } else if (held)
            return;
        FM_ASSERT(ws->w8[0] && ws->w8[1] && ws->w8[2]);
        fm_phase_mark(be, FM_PHASE_FP8_QUANT);
        be->ops->fp8_quant_weight(be->ctx, ws->w8[0], w->w_gate, d->E, d->I, d->H);
        be->ops->fp8_quant_weight(be->ctx, ws->w8[1], w->w_up, d->E, d->I, d->H);
        be->ops->fp8_quant_weight(be->ctx, ws->w8[2], w->w_down, d->E, d->H, d->I);
        return;
    }
    FM_ASSERT(ws->q_gate && ws->q_up && ws->q_down); /* laid out with d->fp8 */
    wq->w_gate = ws->q_gate;
    wq->w_up = ws->q_up;
    wq->w_down = ws->q_down;
    if (held) return;
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->quant_fp8_blocks(be->ctx, ws->q_gate, w->w_gate, d->E, d->I, d->H);
    be->ops->quant_fp8_blocks(be->ctx, ws->q_up, w->w_up, d->E, d->I, d->H);
    be->ops->quant_fp8_blocks(be->ctx, ws->q_down, w->w_down, d->E, d->H, d->I);
}

/* ---- the fast path: E4M3 codes (d->fp8_codes; fm_experts_fp8.h) ---- */

/* The forward over n tokens' R = n*k rows: x quantized into the rows operand, then h_act and
 * its rows operand from one fused op. */
static void codes_forward(const fm_backend *be, const fm_moe_dims *d, fm_moe_routes *r, const fm_moe_ws *ws,
                          int64_t n) {
    const int64_t H = d->H, I = d->I, E = d->E, rc = ws->fp8_rcap;
    const int64_t *off = r->offsets;
    FM_ASSERT(n * d->k <= rc);
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->fp8_quant_rows(be->ctx, ws->a8, r->xe, off, rc, E, H);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    be->ops->expert_fp8_gemm(be->ctx, 0, r->h_gate, 0.0f, ws->a8, ws->w8[0], off, rc, E, H, I);
    be->ops->expert_fp8_gemm(be->ctx, 0, r->h_up, 0.0f, ws->a8, ws->w8[1], off, rc, E, H, I);
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->fp8_swiglu_fwd_quant(be->ctx, r->h_act, ws->a8, r->h_gate, r->h_up, off, rc, E, I);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    be->ops->expert_fp8_gemm(be->ctx, 0, r->ye, 0.0f, ws->a8, ws->w8[2], off, rc, E, I, H);
}

/* The backward: each dgrad on dy's rows operand (ws->a8; dup's: ws->a8u) and the weight's codes
 * (their WqT), each wgrad on dy's and x's tokens operands (ws->t8[0] or, dup's, t8[2]; x's t8[1]
 * serves gate and up). dye's two operands come from one pass (fp8_quant_dual); dgate's and dup's
 * four from the SwiGLU backward itself (fp8_swiglu_bwd_quant: no fm_act dh_gate, dh_up). */
static void codes_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_grads *g,
                           const fm_moe_routes *r, fm_moe_ws *ws, int64_t n) {
    const int64_t H = d->H, I = d->I, E = d->E, rc = ws->fp8_rcap;
    const int64_t *off = r->offsets;
    void *A = ws->a8, *A2 = ws->a8u, *T0 = ws->t8[0], *T1 = ws->t8[1], *T2 = ws->t8[2];
    FM_ASSERT(n * d->k <= rc && A2 && T2);
    /* down: ye = h_act D^T (in = I, out = H) */
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->fp8_quant_dual(be->ctx, A, T0, ws->dye, off, rc, E, H);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    be->ops->expert_fp8_gemm(be->ctx, 1, ws->dact, 0.0f, A, ws->w8[2], off, rc, E, I, H);
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->fp8_quant_tokens(be->ctx, T1, r->h_act, off, rc, E, I);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    be->ops->expert_fp8_gemm(be->ctx, 2, g->w_down, 1.0f, T0, T1, off, rc, E, I, H);
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->fp8_swiglu_bwd_quant(be->ctx, A, A2, T0, T2, ws->dact, r->h_gate, r->h_up, off, rc, E, I);
    /* gate and up: h = xe W^T (in = H, out = I) */
    be->ops->fp8_quant_tokens(be->ctx, T1, r->xe, off, rc, E, H);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    be->ops->expert_fp8_gemm(be->ctx, 1, ws->dxe, 0.0f, A, ws->w8[0], off, rc, E, H, I);
    be->ops->expert_fp8_gemm(be->ctx, 2, g->w_gate, 1.0f, T0, T1, off, rc, E, H, I);
    be->ops->expert_fp8_gemm(be->ctx, 1, ws->dxe, 1.0f, A2, ws->w8[1], off, rc, E, H, I);
    be->ops->expert_fp8_gemm(be->ctx, 2, g->w_up, 1.0f, T2, T1, off, rc, E, H, I);
}

/* ---- the emulation ---- */

void fm_experts_fp8_forward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *wq, fm_moe_routes *r,
                            fm_moe_ws *ws, int64_t n) {
    const int64_t H = d->H, I = d->I, E = d->E, R = n * d->k;
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    if (n == 0) return;
    if (d->fp8_codes) {
        codes_forward(be, d, r, ws, n);
        return;
    }
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->quant_fp8_rows(be->ctx, ws->q_a, r->xe, R, H); /* K = H */
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    fm_expert_linear_fwd(be, r->h_gate, ws->q_a, wq->w_gate, r->offsets, E, H, I);
    fm_expert_linear_fwd(be, r->h_up, ws->q_a, wq->w_up, r->offsets, E, H, I);
    be->ops->swiglu_fwd(be->ctx, r->h_act, r->h_gate, r->h_up, R * I);
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->quant_fp8_rows(be->ctx, ws->q_a, r->h_act, R, I); /* K = I */
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    fm_expert_linear_fwd(be, r->ye, ws->q_a, wq->w_down, r->offsets, E, I, H);
}

/* dx_e [m_e,in] = beta dx_e + dy_e W_e (the dgrad alone, one grouped call: the fp8 wgrad takes
 * differently quantized operands) */
static void dgrad(const fm_backend *be, fm_act *dx, float beta, const fm_act *dy, const fm_act *W,
                  const int64_t *offsets, int64_t E, int64_t in, int64_t out) {
    fm_expert_linear_bwd(be, dx, beta, NULL, dy, NULL, W, offsets, E, in, out);
}

/* dW_e += dy_e^T x_e (the wgrad alone: the grouped bwd with dx NULL). */
static void wgrad(const fm_backend *be, fm_act *dW, const fm_act *dy, const fm_act *x, const fm_act *W,
                  const int64_t *offsets, int64_t E, int64_t in, int64_t out) {
    fm_expert_linear_bwd(be, NULL, 0.0f, dW, dy, x, W, offsets, E, in, out);
}

void fm_experts_fp8_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *wq,
                             const fm_moe_grads *g, const fm_moe_routes *r, fm_moe_ws *ws, int64_t n) {
    const int64_t H = d->H, I = d->I, E = d->E, R = n * d->k;
    const int64_t *off = r->offsets;
    fm_act *A = ws->q_a, *B = ws->q_b;
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    if (n == 0) return;
    if (d->fp8_codes) {
        codes_backward(be, d, g, r, ws, n);
        return;
    }
    /* down: ye = h_act D^T (in = I, out = H) */
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->quant_fp8_rows(be->ctx, A, ws->dye, R, H);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    dgrad(be, ws->dact, 0.0f, A, wq->w_down, off, E, I, H);
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->quant_fp8_cols_grouped(be->ctx, A, ws->dye, off, E, H);
    be->ops->quant_fp8_cols_grouped(be->ctx, B, r->h_act, off, E, I);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    wgrad(be, g->w_down, A, B, wq->w_down, off, E, I, H);
    be->ops->swiglu_bwd(be->ctx, ws->dh_gate, ws->dh_up, ws->dact, r->h_gate, r->h_up, R * I);
    /* gate and up: h = xe W^T (in = H, out = I); B holds xe in column tiles for both wgrads */
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->quant_fp8_rows(be->ctx, A, ws->dh_gate, R, I);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    dgrad(be, ws->dxe, 0.0f, A, wq->w_gate, off, E, H, I);
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->quant_fp8_cols_grouped(be->ctx, B, r->xe, off, E, H);
    be->ops->quant_fp8_cols_grouped(be->ctx, A, ws->dh_gate, off, E, I);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    wgrad(be, g->w_gate, A, B, wq->w_gate, off, E, H, I);
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->quant_fp8_rows(be->ctx, A, ws->dh_up, R, I);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    dgrad(be, ws->dxe, 1.0f, A, wq->w_up, off, E, H, I);
    fm_phase_mark(be, FM_PHASE_FP8_QUANT);
    be->ops->quant_fp8_cols_grouped(be->ctx, A, ws->dh_up, off, E, I);
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    wgrad(be, g->w_up, A, B, wq->w_up, off, E, H, I);
}

/* ---- the two tables (fm_moe_experts) ---- */

static fm_status emulated_serves(const fm_backend *be, const fm_moe_dims *d, int64_t rows_max, int ep, bool llep) {
    (void)d, (void)rows_max, (void)ep, (void)llep; /* hosted experts (llep) are quantized like the own ones */
    if (!(be->ops->quant_fp8_rows && be->ops->quant_fp8_blocks && be->ops->quant_fp8_cols_grouped))
        return fm_error(FM_ERR_UNSUPPORTED, "--expert-precision fp8: the %s backend has no FP8 quantization ops "
                        "(quant_fp8_*); use --expert-precision bf16", be->ops->name);
    return FM_OK;
}

static fm_status codes_serves(const fm_backend *be, const fm_moe_dims *d, int64_t rows_max, int ep, bool llep) {
    if (!fm_backend_fp8_codes_serves(be, d->E, d->H, d->I, rows_max))
        return fm_error(FM_ERR_UNSUPPORTED, "--expert-precision fp8 on E4M3 codes: the %s backend does not serve "
                        "%lld experts%s of hidden %lld, intermediate %lld over %lld rows (needs the fp8 code ops, "
                        "sizes multiples of 128); leave fm_layout_opts.expert_fp8_codes unset for the emulation",
                        be->ops->name, (long long)d->E, ep > 1 ? " per rank" : "", (long long)d->H, (long long)d->I,
                        (long long)rows_max);
    /* least-loaded placement: the hosted experts' own operands (fm_moe_ep_hosted_dims) take the
     * same code ops over at most max_foreign experts, laid out beside these */
    (void)llep;
    return FM_OK;
}

static size_t fp8_ws_bytes(const fm_moe_dims *d, int64_t rows, size_t act_bytes) {
    return fm_moe_fp8_bytes(d, rows, act_bytes);
}

const fm_moe_experts fm_experts_fp8_emulated = {"fp8 emulated", emulated_serves, fp8_ws_bytes, fm_experts_fp8_weights,
                                                fm_experts_fp8_forward, fm_experts_fp8_backward};
const fm_moe_experts fm_experts_fp8_codes = {"fp8 codes", codes_serves, fp8_ws_bytes, fm_experts_fp8_weights,
                                             fm_experts_fp8_forward, fm_experts_fp8_backward};
