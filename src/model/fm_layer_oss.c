/* gpt_oss's parts of a decoder layer (fm_layer_oss.h). */
#include "fm_layer_oss.h"

#include "fm_attn_sp.h"

int64_t fm_layer_oss_window(const fm_config *c, int64_t l) {
    return fm_config_layer_is_sliding(c, l) ? c->sliding_window : 0;
}

bool fm_layer_oss_attention(const fm_model *m, int64_t l) {
    return m->cfg.attention_sinks || fm_layer_oss_window(&m->cfg, l) > 0;
}

fm_status fm_layer_oss_attention_fwd(fm_model *m, int64_t l, fm_layer_acts *a, const int32_t *kvs) {
    const fm_config *c = &m->cfg;
    const fm_layer_ptrs *w = &m->p.w.layers[l];
    if (m->mesh.sp > 1) /* Ulysses: head-sharded whole rows, this rank's heads' sinks */
        return fm_attn_sp_forward_ext(&m->a.sp_attn, &m->be, a->att, a->lse, a->qr, a->kr, a->v, kvs, w->sinks,
                                      fm_layer_oss_window(c, l));
    m->be.ops->attention_ext_fwd(m->be.ctx, a->att, a->lse, a->qr, a->kr, a->v, m->a.B, m->a.T, c->num_attention_heads,
                                 c->num_key_value_heads, c->head_dim, kvs, w->sinks, fm_layer_oss_window(c, l));
    return FM_OK;
}

fm_status fm_layer_oss_attention_bwd(fm_model *m, int64_t l, const fm_layer_acts *a, const fm_act *datt,
                                     const int32_t *kvs) {
    const fm_config *c = &m->cfg;
    const fm_layer_ptrs *w = &m->p.w.layers[l], *g = &m->p.g.layers[l];
    fm_bwd_ws *ws = &m->a.ws;
    if (m->mesh.sp > 1)
        return fm_attn_sp_backward_ext(&m->a.sp_attn, &m->be, ws->dq, ws->dk, ws->dv, g->sinks, datt, a->qr, a->kr,
                                       a->v, a->att, a->lse, kvs, w->sinks, fm_layer_oss_window(c, l));
    m->be.ops->attention_ext_bwd(m->be.ctx, ws->dq, ws->dk, ws->dv, g->sinks, datt, a->qr, a->kr, a->v, a->att, a->lse,
                                 m->a.B, m->a.T, c->num_attention_heads, c->num_key_value_heads, c->head_dim, kvs,
                                 w->sinks, fm_layer_oss_window(c, l));
    return FM_OK;
}

fm_status fm_layer_oss_check(const fm_model *m, int64_t sp, bool fp8) {
    const fm_config *c = &m->cfg;
    if (c->model_type != FM_MODEL_GPT_OSS) return FM_OK;
    const fm_ops *o = m->be.ops;
    if (!o->attention_ext_fwd || !o->attention_ext_bwd || !o->swiglu_clamp_fwd || !o->swiglu_clamp_bwd ||
        !o->bias_add_f32)
        return fm_error(FM_ERR_UNSUPPORTED, "model_type gpt_oss: the %s backend lacks %s; run it on the cpu backend",
                        o->name ? o->name : "this",
                        !o->attention_ext_fwd || !o->attention_ext_bwd
                            ? "attention with sinks and sliding windows (attention_ext_fwd/_bwd)"
                            : "the clamped SwiGLU or the router bias op");
    (void)sp; /* --sp: the sinks and windows run inside Ulysses' all-to-alls (fm_attn_sp_forward_ext) */
    if (fp8)
        return fm_error(FM_ERR_UNSUPPORTED, "model_type gpt_oss with --expert-precision fp8: the fp8 experts carry no "
                        "biases nor the clamped SwiGLU yet; use --expert-precision bf16");
    return FM_OK;
}
