/* Multi-head latent attention's forward and backward (fm_mla.h), on the backend's ops: linear
 * layers, RMSNorm, RoPE, head_slice (the q'/k'/v' assembly) and the attention kernels of plain
 * multi-head attention at head dim dq. */
#include "fm_mla.h"

#include <math.h>
#include <string.h>

#include "../core/fm_arena.h"
#include "fm_model.h"

#define OPS (m->be.ops)
#define CTX (m->be.ctx)
#define PHASE(p) fm_phase_mark(&m->be, FM_PHASE_##p)
#define TAKE(arena, type, count) ((type *)fm_arena_alloc((arena), sizeof(type) * (size_t)(count)))

/* The sizes of one MLA layer. */
typedef struct mla_dims {
    int64_t B, T, N, H, nh, rq, rkv, dn, dr, dv, dq;
    int perm, unperm; /* q_pe's / k_pe's column order into the rotation (rope_interleave), and back */
} mla_dims;

static mla_dims dims_of(const fm_model *m) {
    const fm_config *c = &m->cfg;
    mla_dims d = {m->a.B, m->a.T, m->a.N, c->hidden_size, c->num_attention_heads, c->q_lora_rank, c->kv_lora_rank,
                  c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim,
                  c->qk_nope_head_dim + c->qk_rope_head_dim, FM_SLICE_PLAIN, FM_SLICE_PLAIN};
    if (c->rope_interleave) {
        d.perm = FM_SLICE_DEINTERLEAVE;
        d.unperm = FM_SLICE_INTERLEAVE;
    }
    return d;
}

static fm_slice at(int64_t ld, int64_t hs, int64_t off) { return (fm_slice){ld, hs, off}; }

static double yarn_m(double s, double k) { return s <= 1 ? 1.0 : 0.1 * k * log(s) + 1.0; }

double fm_mla_softmax_factor(const fm_config *c) {
    const fm_rope_scaling *r = &c->rope_scaling;
    if (r->type == FM_ROPE_DEFAULT || r->mscale_all_dim == 0) return 1.0;
    const double ms = yarn_m(r->factor, r->mscale_all_dim);
    return ms * ms;
}

/* The RoPE table rows of this rank (fm_layer.c's rope_rows: whole rows under packed documents). */
static void rope_rows(const fm_model *m, const float **cos_t, const float **sin_t) {
    const int64_t off = m->a.docs ? 0 : (int64_t)m->mesh.sp_rank * m->a.T * (fm_config_rotary_dim(&m->cfg) / 2);
    *cos_t = m->a.rope_cos + off;
    *sin_t = m->a.rope_sin + off;
}

fm_status fm_mla_forward(fm_model *m, int64_t l, bool skip_attention) {
    const fm_config *c = &m->cfg;
    const mla_dims d = dims_of(m);
    const fm_act *x = m->a.boundary[l];
    fm_layer_acts *a = &m->a.acts[l];
    const fm_layer_ptrs *w = &m->p.w.layers[l];
    const fm_mla_ws *ws = &m->a.ws.mla;
    const int64_t N = d.N, H = d.H, nh = d.nh, dq = d.dq, qd = nh * dq, kvbw = d.dn + d.dv;
    const float eps = (float)c->rms_norm_eps, s = (float)fm_mla_softmax_factor(c);
    fm_act *ln1 = m->a.ws.dln;

    PHASE(DENSE);
    OPS->rmsnorm_fwd(CTX, ln1, a->rstd1, x, w->ln1, N, H, eps);
    if (d.rq > 0) { /* q_b_proj(q_a_layernorm(q_a_proj(ln1))) */
        fm_linear_fwd(&m->be, a->mla.qa, FM_ACT_DTYPE, ln1, w->wqa, N, H, d.rq);
        OPS->rmsnorm_fwd(CTX, ws->lat, a->mla.rstd_qa, a->mla.qa, w->qa_norm, N, d.rq, eps);
        fm_linear_fwd(&m->be, ws->q, FM_ACT_DTYPE, ws->lat, w->wq, N, d.rq, qd);
    } else {
        fm_linear_fwd(&m->be, ws->q, FM_ACT_DTYPE, ln1, w->wq, N, H, qd);
    }
    /* q' = s [q_pe | q_nope] per head */
    OPS->head_slice(CTX, a->qr, at(qd, dq, 0), ws->q, at(qd, dq, d.dn), N, nh, d.dr, d.perm, s, false);
    OPS->head_slice(CTX, a->qr, at(qd, dq, d.dr), ws->q, at(qd, dq, 0), N, nh, d.dn, FM_SLICE_PLAIN, s, false);
    /* compressed_kv | k_pe, the latent normed, then k_nope | v per head */
    fm_linear_fwd(&m->be, ws->kva, FM_ACT_DTYPE, ln1, w->wkva, N, H, d.rkv + d.dr);
    OPS->head_slice(CTX, a->mla.ckv, at(d.rkv, 0, 0), ws->kva, at(d.rkv + d.dr, 0, 0), N, 1, d.rkv, FM_SLICE_PLAIN,
                    1.0f, false);
    OPS->head_slice(CTX, ws->kpe, at(d.dr, 0, 0), ws->kva, at(d.rkv + d.dr, 0, d.rkv), N, 1, d.dr, d.perm, 1.0f, false);
    OPS->rmsnorm_fwd(CTX, ws->lat, a->mla.rstd_kv, a->mla.ckv, w->kva_norm, N, d.rkv, eps);
    fm_linear_fwd(&m->be, ws->kvb, FM_ACT_DTYPE, ws->lat, w->wkvb, N, d.rkv, nh * kvbw);
    /* RoPE on q_pe (every head) and on the one k_pe */
    const int32_t *pos = m->a.docs ? m->a.doc_pos : NULL, *kvs = m->a.docs ? m->a.doc_start : NULL;
    const float *rc, *rs;
    rope_rows(m, &rc, &rs);
    OPS->rope_fwd(CTX, a->qr, rc, rs, d.B, d.T, nh, dq, d.dr, pos);
    OPS->rope_fwd(CTX, ws->kpe, rc, rs, d.B, d.T, 1, d.dr, d.dr, pos);
    /* k' = [k_pe (broadcast) | k_nope], v' = [v | 0] */
    OPS->head_slice(CTX, a->kr, at(qd, dq, 0), ws->kpe, at(d.dr, 0, 0), N, nh, d.dr, FM_SLICE_PLAIN, 1.0f, false);
    OPS->head_slice(CTX, a->kr, at(qd, dq, d.dr), ws->kvb, at(nh * kvbw, kvbw, 0), N, nh, d.dn, FM_SLICE_PLAIN, 1.0f,
                    false);
    OPS->head_slice(CTX, a->v, at(qd, dq, 0), ws->kvb, at(nh * kvbw, kvbw, d.dn), N, nh, d.dv, FM_SLICE_PLAIN, 1.0f,
                    false);
    if (dq > d.dv)
        OPS->head_slice(CTX, a->v, at(qd, dq, d.dv), NULL, at(0, 0, 0), N, nh, dq - d.dv, FM_SLICE_PLAIN, 1.0f, false);
    if (!skip_attention) { /* keep-attention's recompute: out' and lse are the forward's, kept */
        PHASE(ATTENTION);
        if (m->mesh.sp > 1)
            FM_TRY(fm_attn_sp_forward(&m->a.sp_attn, &m->be, a->att, a->lse, a->qr, a->kr, a->v, kvs));
        else
            OPS->attention_fwd(CTX, a->att, a->lse, a->qr, a->kr, a->v, d.B, d.T, nh, nh, dq, kvs);
        PHASE(DENSE);
    }
    /* o_proj over out' less its padded columns */
    OPS->head_slice(CTX, ws->att, at(nh * d.dv, d.dv, 0), a->att, at(qd, dq, 0), N, nh, d.dv, FM_SLICE_PLAIN, 1.0f,
                    false);
    fm_linear_fwd(&m->be, a->x_mid, FM_ACT_DTYPE, ws->att, w->wo, N, nh * d.dv, H);
    OPS->add(CTX, a->x_mid, x, N * H);
    return FM_OK;
}

fm_status fm_mla_backward(fm_model *m, int64_t l, const fm_act *dxmid, fm_act *datt, fm_act *dx) {
    const fm_config *c = &m->cfg;
    const mla_dims d = dims_of(m);
    const fm_act *x = m->a.boundary[l];
    fm_layer_acts *a = &m->a.acts[l];
    const fm_layer_ptrs *w = &m->p.w.layers[l];
    const fm_layer_ptrs *g = &m->p.g.layers[l];
    fm_bwd_ws *bw = &m->a.ws;
    const fm_mla_ws *ws = &bw->mla;
    const int64_t N = d.N, H = d.H, nh = d.nh, dq = d.dq, qd = nh * dq, kvbw = d.dn + d.dv, ovd = nh * d.dv;
    const float eps = (float)c->rms_norm_eps, s = (float)fm_mla_softmax_factor(c);
    const int32_t *pos = m->a.docs ? m->a.doc_pos : NULL, *kvs = m->a.docs ? m->a.doc_start : NULL;

    /* o_proj: its input formed again from out', d out' = [d out | 0] */
    PHASE(DENSE);
    OPS->head_slice(CTX, ws->att, at(ovd, d.dv, 0), a->att, at(qd, dq, 0), N, nh, d.dv, FM_SLICE_PLAIN, 1.0f, false);
    fm_linear_bwd(&m->be, ws->datt, 0.0f, g->wo, dxmid, ws->att, w->wo, N, ovd, H, 1.0f);
    OPS->head_slice(CTX, datt, at(qd, dq, 0), ws->datt, at(ovd, d.dv, 0), N, nh, d.dv, FM_SLICE_PLAIN, 1.0f, false);
    if (dq > d.dv)
        OPS->head_slice(CTX, datt, at(qd, dq, d.dv), NULL, at(0, 0, 0), N, nh, dq - d.dv, FM_SLICE_PLAIN, 1.0f, false);
    PHASE(ATTENTION);
    if (m->mesh.sp > 1)
        FM_TRY(fm_attn_sp_backward(&m->a.sp_attn, &m->be, bw->dq, bw->dk, bw->dv, datt, a->qr, a->kr, a->v, a->att,
                                   a->lse, kvs));
    else
        OPS->attention_bwd(CTX, bw->dq, bw->dk, bw->dv, datt, a->qr, a->kr, a->v, a->att, a->lse, d.B, d.T, nh, nh, dq,
                           kvs);
    PHASE(DENSE);
    const float *rc, *rs;
    rope_rows(m, &rc, &rs);
    OPS->rope_bwd(CTX, bw->dq, rc, rs, d.B, d.T, nh, dq, d.dr, pos);
    /* d k_pe: the heads' k' gradients summed (the broadcast's backward), then the rotation's */
    OPS->head_slice(CTX, ws->kpe, at(d.dr, 0, 0), bw->dk, at(qd, dq, 0), N, nh, d.dr, FM_SLICE_PLAIN, 1.0f, false);
    OPS->rope_bwd(CTX, ws->kpe, rc, rs, d.B, d.T, 1, d.dr, d.dr, pos);
    /* d q (the projection's layout: q_nope | q_pe per head), times the softmax factor */
    OPS->head_slice(CTX, ws->q, at(qd, dq, d.dn), bw->dq, at(qd, dq, 0), N, nh, d.dr, d.unperm, s, false);
    OPS->head_slice(CTX, ws->q, at(qd, dq, 0), bw->dq, at(qd, dq, d.dr), N, nh, d.dn, FM_SLICE_PLAIN, s, false);
    /* d kvb = [d k_nope | d v] per head */
    OPS->head_slice(CTX, ws->kvb, at(nh * kvbw, kvbw, 0), bw->dk, at(qd, dq, d.dr), N, nh, d.dn, FM_SLICE_PLAIN, 1.0f,
                    false);
    OPS->head_slice(CTX, ws->kvb, at(nh * kvbw, kvbw, d.dn), bw->dv, at(qd, dq, 0), N, nh, d.dv, FM_SLICE_PLAIN, 1.0f,
                    false);
    /* kv_b_proj and kv_a_layernorm (the normed latent formed again) */
    OPS->rmsnorm_fwd(CTX, ws->lat, a->mla.rstd_kv, a->mla.ckv, w->kva_norm, N, d.rkv, eps);
    fm_linear_bwd(&m->be, ws->dlat, 0.0f, g->wkvb, ws->kvb, ws->lat, w->wkvb, N, d.rkv, nh * kvbw, 1.0f);
    OPS->rmsnorm_bwd(CTX, ws->dlat2, g->kva_norm, ws->dlat, a->mla.ckv, w->kva_norm, a->mla.rstd_kv, N, d.rkv);
    /* d kva = [d compressed_kv | d k_pe in the projection's column order] */
    OPS->head_slice(CTX, ws->kva, at(d.rkv + d.dr, 0, 0), ws->dlat2, at(d.rkv, 0, 0), N, 1, d.rkv, FM_SLICE_PLAIN,
                    1.0f, false);
    OPS->head_slice(CTX, ws->kva, at(d.rkv + d.dr, 0, d.rkv), ws->kpe, at(d.dr, 0, 0), N, 1, d.dr, d.unperm, 1.0f,
                    false);
    /* d ln1 [N,H] in the d out' buffer (dead; [N, qd] with qd >= H) or its own (qd < H) */
    fm_act *dln1 = bw->dln1 ? bw->dln1 : datt;
    fm_act *ln1 = dx; /* ln2 is dead: form ln1 again there */
    OPS->rmsnorm_fwd(CTX, ln1, a->rstd1, x, w->ln1, N, H, eps);
    fm_linear_bwd(&m->be, dln1, 0.0f, g->wkva, ws->kva, ln1, w->wkva, N, H, d.rkv + d.dr, 1.0f);
    if (d.rq > 0) {
        OPS->rmsnorm_fwd(CTX, ws->lat, a->mla.rstd_qa, a->mla.qa, w->qa_norm, N, d.rq, eps);
        fm_linear_bwd(&m->be, ws->dlat, 0.0f, g->wq, ws->q, ws->lat, w->wq, N, d.rq, qd, 1.0f);
        OPS->rmsnorm_bwd(CTX, ws->dlat2, g->qa_norm, ws->dlat, a->mla.qa, w->qa_norm, a->mla.rstd_qa, N, d.rq);
        fm_linear_bwd(&m->be, dln1, 1.0f, g->wqa, ws->dlat2, ln1, w->wqa, N, H, d.rq, 1.0f);
    } else {
        fm_linear_bwd(&m->be, dln1, 1.0f, g->wq, ws->q, ln1, w->wq, N, H, qd, 1.0f);
    }
    OPS->rmsnorm_bwd(CTX, dx, g->ln1, dln1, x, w->ln1, a->rstd1, N, H);
    OPS->add(CTX, dx, dxmid, N * H);
    return FM_OK;
}

/* ---- layout and its bound (the plan's; fm_layout.c calls the layouts) -------------------- */

static int64_t latent_width(const fm_config *c) { return c->q_lora_rank > c->kv_lora_rank ? c->q_lora_rank : c->kv_lora_rank; }

void fm_mla_saved_layout(fm_mla_saved *s, fm_arena *ar, const fm_config *c, int64_t N) {
    memset(s, 0, sizeof *s);
    if (!c->mla) return;
    if (c->q_lora_rank > 0) {
        s->qa = TAKE(ar, fm_act, N * c->q_lora_rank);
        s->rstd_qa = TAKE(ar, float, N);
    }
    s->ckv = TAKE(ar, fm_act, N * c->kv_lora_rank);
    s->rstd_kv = TAKE(ar, float, N);
}

void fm_mla_ws_layout(fm_mla_ws *w, fm_arena *ar, const fm_config *c, int64_t N) {
    memset(w, 0, sizeof *w);
    if (!c->mla) return;
    const int64_t nh = c->num_attention_heads, dq = c->qk_nope_head_dim + c->qk_rope_head_dim, rl = latent_width(c);
    w->q = TAKE(ar, fm_act, N * nh * dq);
    w->kva = TAKE(ar, fm_act, N * (c->kv_lora_rank + c->qk_rope_head_dim));
    w->kpe = TAKE(ar, fm_act, N * c->qk_rope_head_dim);
    w->lat = TAKE(ar, fm_act, N * rl);
    w->dlat = TAKE(ar, fm_act, N * rl);
    w->dlat2 = TAKE(ar, fm_act, N * rl);
    w->kvb = TAKE(ar, fm_act, N * nh * (c->qk_nope_head_dim + c->v_head_dim));
    w->att = TAKE(ar, fm_act, N * nh * c->v_head_dim);
    w->datt = TAKE(ar, fm_act, N * nh * c->v_head_dim);
}

#define B4(x) fm_arena_round((size_t)(x) * 4)
#define BA(x) fm_arena_round((size_t)(x) * a)

size_t fm_mla_saved_bytes(const fm_config *c, int64_t N, size_t a) {
    if (!c->mla) return 0;
    /* q_a_proj's output and its rstd (rq > 0), compressed_kv and its rstd */
    return (c->q_lora_rank > 0 ? BA(N * c->q_lora_rank) + B4(N) : 0) + BA(N * c->kv_lora_rank) + B4(N);
}

size_t fm_mla_ws_bytes(const fm_config *c, int64_t N, size_t a) {
    if (!c->mla) return 0;
    const int64_t nh = c->num_attention_heads, dq = c->qk_nope_head_dim + c->qk_rope_head_dim, rl = latent_width(c);
    /* q [N, nh dq], kva [N, rkv + dr], k_pe [N, dr], three latents [N, rl], kvb [N, nh (dn + dv)],
     * o_proj's input and its gradient [N, nh dv] */
    return BA(N * nh * dq) + BA(N * (c->kv_lora_rank + c->qk_rope_head_dim)) + BA(N * c->qk_rope_head_dim) +
           3 * BA(N * rl) + BA(N * nh * (c->qk_nope_head_dim + c->v_head_dim)) + 2 * BA(N * nh * c->v_head_dim);
}
