/* SwiGLU experts over a dispatch's expert-major rows, and the native table (fm_experts.h). */
#include "fm_experts.h"

#include "fm_experts_fp8.h"

/* The experts' biases (gpt_oss): y rows of expert e += b_e, over the expert-major rows of a
 * dispatch (offsets host int64 [E+1]); one bias_add per expert with rows. */
static void expert_bias_add(const fm_backend *be, fm_act *y, const fm_act *b, const int64_t *offsets, int64_t E,
                            int64_t D) {
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
        if (m > 0) be->ops->bias_add(be->ctx, y + r0 * D, b + e * D, m, D);
    }
}

/* db_e += the column sums of dy's rows of expert e (bias_grad); experts without rows untouched. */
static void expert_bias_grad(const fm_backend *be, fm_act *db, const fm_act *dy, const int64_t *offsets, int64_t E,
                             int64_t D) {
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
        if (m > 0) be->ops->bias_grad(be->ctx, db + e * D, dy + r0 * D, m, D);
    }
}

void fm_experts_forward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, fm_moe_routes *r,
                        int64_t n) {
    const int64_t H = d->H, I = d->I, E = d->E, R = n * d->k;
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    if (n == 0) return;
    if (d->sync_free) { /* the offsets as the device reads them: no host wait (fm_moe_dims) */
        be->ops->expert_linear_fwd_dev(be->ctx, r->h_gate, r->xe, w->w_gate, r->offsets, R, E, H, I);
        be->ops->expert_linear_fwd_dev(be->ctx, r->h_up, r->xe, w->w_up, r->offsets, R, E, H, I);
        be->ops->swiglu_fwd(be->ctx, r->h_act, r->h_gate, r->h_up, R * I);
        be->ops->expert_linear_fwd_dev(be->ctx, r->ye, r->h_act, w->w_down, r->offsets, R, E, I, H);
        return;
    }
    fm_expert_linear_fwd(be, r->h_gate, r->xe, w->w_gate, r->offsets, E, H, I);
    fm_expert_linear_fwd(be, r->h_up, r->xe, w->w_up, r->offsets, E, H, I);
    if (w->b_gate) { /* gpt_oss: the biases, and its clamped SwiGLU */
        expert_bias_add(be, r->h_gate, w->b_gate, r->offsets, E, I);
        expert_bias_add(be, r->h_up, w->b_up, r->offsets, E, I);
    }
    /* elementwise: one launch over every expert's rows */
    if (d->swiglu_limit > 0)
        be->ops->swiglu_clamp_fwd(be->ctx, r->h_act, r->h_gate, r->h_up, R * I, d->swiglu_limit, d->swiglu_alpha);
    else
        be->ops->swiglu_fwd(be->ctx, r->h_act, r->h_gate, r->h_up, R * I);
    fm_expert_linear_fwd(be, r->ye, r->h_act, w->w_down, r->offsets, E, I, H);
    if (w->b_down) expert_bias_add(be, r->ye, w->b_down, r->offsets, E, H);
}

void fm_experts_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, const fm_moe_grads *g,
                         const fm_moe_routes *r, fm_moe_ws *ws, int64_t n) {
    const int64_t H = d->H, I = d->I, E = d->E, R = n * d->k;
    fm_phase_mark(be, FM_PHASE_EXPERTS);
    if (n == 0) return;
    if (d->sync_free) {
        be->ops->expert_linear_bwd_dev(be->ctx, ws->dact, 0.0f, g->w_down, ws->dye, r->h_act, w->w_down, r->offsets,
                                       R, E, I, H);
        be->ops->swiglu_bwd(be->ctx, ws->dh_gate, ws->dh_up, ws->dact, r->h_gate, r->h_up, R * I);
        be->ops->expert_linear_bwd_dev(be->ctx, ws->dxe, 0.0f, g->w_gate, ws->dh_gate, r->xe, w->w_gate, r->offsets,
                                       R, E, H, I);
        be->ops->expert_linear_bwd_dev(be->ctx, ws->dxe, 1.0f, g->w_up, ws->dh_up, r->xe, w->w_up, r->offsets, R, E,
                                       H, I);
        return;
    }
    fm_expert_linear_bwd(be, ws->dact, 0.0f, g->w_down, ws->dye, r->h_act, w->w_down, r->offsets, E, I, H);
    if (d->swiglu_limit > 0)
        be->ops->swiglu_clamp_bwd(be->ctx, ws->dh_gate, ws->dh_up, ws->dact, r->h_gate, r->h_up, R * I, d->swiglu_limit,
                                  d->swiglu_alpha);
    else
        be->ops->swiglu_bwd(be->ctx, ws->dh_gate, ws->dh_up, ws->dact, r->h_gate, r->h_up, R * I);
    if (g->b_gate) { /* gpt_oss: the biases' gradients, the column sums of each expert's rows */
        expert_bias_grad(be, g->b_down, ws->dye, r->offsets, E, H);
        expert_bias_grad(be, g->b_gate, ws->dh_gate, r->offsets, E, I);
        expert_bias_grad(be, g->b_up, ws->dh_up, r->offsets, E, I);
    }
    fm_expert_linear_bwd(be, ws->dxe, 0.0f, g->w_gate, ws->dh_gate, r->xe, w->w_gate, r->offsets, E, H, I);
    fm_expert_linear_bwd(be, ws->dxe, 1.0f, g->w_up, ws->dh_up, r->xe, w->w_up, r->offsets, E, H, I);
}

/* ---- the native table (fm_moe_experts) ---- */

static fm_status native_serves(const fm_backend *be, const fm_moe_dims *d, int64_t rows_max, int ep, bool llep) {
    (void)rows_max, (void)ep, (void)llep; /* llep: the hosted experts' biases travel with their weights
                                             (d->bias; bounded/fm_moe_ep.h) */
    if (d->swiglu_limit > 0 && (!be->ops->swiglu_clamp_fwd || !be->ops->swiglu_clamp_bwd))
        return fm_error(FM_ERR_UNSUPPORTED, "gpt_oss's clamped SwiGLU: the %s backend has no swiglu_clamp op",
                        be->ops->name ? be->ops->name : "this");
    return FM_OK; /* the grouped GEMM, or one GEMM per expert (fm_expert_linear_fwd) */
}

static size_t native_ws_bytes(const fm_moe_dims *d, int64_t rows, size_t act_bytes) {
    (void)d, (void)rows, (void)act_bytes;
    return 0;
}

static void native_weights(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, fm_moe_ws *ws,
                           fm_moe_weights *wq, bool backward) {
    (void)be, (void)d, (void)ws, (void)backward;
    *wq = *w;
}

static void native_forward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, fm_moe_routes *r,
                           fm_moe_ws *ws, int64_t n) {
    (void)ws;
    fm_experts_forward(be, d, w, r, n);
}

const fm_moe_experts fm_experts_native = {"native", native_serves, native_ws_bytes, native_weights, native_forward,
                                          fm_experts_backward};

const fm_moe_experts *fm_experts_select(const fm_moe_dims *d) {
    if (!d->fp8) return &fm_experts_native;
    return d->fp8_codes ? &fm_experts_fp8_codes : &fm_experts_fp8_emulated;
}
