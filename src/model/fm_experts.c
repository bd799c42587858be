/* SwiGLU experts over a dispatch's expert-major rows, and the native table (fm_experts.h). */
#include "fm_experts.h"

#include "fm_experts_fp8.h"

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
    /* elementwise: one launch over every expert's rows */
    be->ops->swiglu_fwd(be->ctx, r->h_act, r->h_gate, r->h_up, R * I);
    fm_expert_linear_fwd(be, r->ye, r->h_act, w->w_down, r->offsets, E, I, H);
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
    be->ops->swiglu_bwd(be->ctx, ws->dh_gate, ws->dh_up, ws->dact, r->h_gate, r->h_up, R * I);
    fm_expert_linear_bwd(be, ws->dxe, 0.0f, g->w_gate, ws->dh_gate, r->xe, w->w_gate, r->offsets, E, H, I);
    fm_expert_linear_bwd(be, ws->dxe, 1.0f, g->w_up, ws->dh_up, r->xe, w->w_up, r->offsets, E, H, I);
}

/* ---- the native table (fm_moe_experts) ---- */

static fm_status native_serves(const fm_backend *be, const fm_moe_dims *d, int64_t rows_max, int ep, bool llep) {
    (void)be, (void)d, (void)rows_max, (void)ep, (void)llep;
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
