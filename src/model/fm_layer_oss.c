/* gpt_oss's parts of a decoder layer (fm_layer_oss.h). */
#include "fm_layer_oss.h"

int64_t fm_layer_oss_window(const fm_config *c, int64_t l) {
    return fm_config_layer_is_sliding(c, l) ? c->sliding_window : 0;
}

bool fm_layer_oss_attention(const fm_model *m, int64_t l) {
    return m->cfg.attention_sinks || fm_layer_oss_window(&m->cfg, l) > 0;
}

void fm_layer_oss_attention_fwd(fm_model *m, int64_t l, fm_layer_acts *a, const int32_t *kvs) {
    const fm_config *c = &m->cfg;
    const fm_layer_ptrs *w = &m->p.w.layers[l];
    m->be.ops->attention_ext_fwd(m->be.ctx, a->att, a->lse, a->qr, a->kr, a->v, m->a.B, m->a.T, c->num_attention_heads,
                                 c->num_key_value_heads, c->head_dim, kvs, w->sinks, fm_layer_oss_window(c, l));
}

void fm_layer_oss_attention_bwd(fm_model *m, int64_t l, const fm_layer_acts *a, const fm_act *datt,
                                const int32_t *kvs) {
    const fm_config *c = &m->cfg;
    const fm_layer_ptrs *w = &m->p.w.layers[l], *g = &m->p.g.layers[l];
    fm_bwd_ws *ws = &m->a.ws;
    m->be.ops->attention_ext_bwd(m->be.ctx, ws->dq, ws->dk, ws->dv, g->sinks, datt, a->qr, a->kr, a->v, a->att, a->lse,
                                 m->a.B, m->a.T, c->num_attention_heads, c->num_key_value_heads, c->head_dim, kvs,
                                 w->sinks, fm_layer_oss_window(c, l));
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
    if (sp > 1)
        return fm_error(FM_ERR_UNSUPPORTED, "model_type gpt_oss with --sp %lld: the attention sinks and sliding windows "
                        "are not wired into sequence parallelism's all-to-alls yet; drop --sp", (long long)sp);
    if (fp8)
        return fm_error(FM_ERR_UNSUPPORTED, "model_type gpt_oss with --expert-precision fp8: the fp8 experts carry no "
                        "biases nor the clamped SwiGLU yet; use --expert-precision bf16");
    return FM_OK;
}
