/* flatmoe_generate's KV cache (--kv-cache; include/flatmoe.h, docs/rl.md "Sampling with a KV
 * cache"): an incremental decoder of the session's model on the CPU build, so that each sampling
 * round runs the new tokens only instead of the whole prefix.
 *
 * Bound (sized at open from the token budget N = --micro-batch x --seq-len, carved then from the
 * session's host arena, never grown; flatmoe_host.c lists the pieces and `flatmoe plan --library
 * --kv-cache` prints the sum): the cache K, V of every layer for every token of the budget,
 *   2 x L x N x (nkv x hd) x 4 bytes,
 * and the scratch of one pass over up to N tokens, N x (3 H + 2 nh hd + 2 nkv hd + 2 E + nh + 2 k
 * + 1) x 4 + N x 20 bytes, plus 3 I_max + H floats for one token's SwiGLU (I_max the larger of the
 * expert and dense widths), each piece rounded up to 64 bytes. A request is refused above
 * the budget before any work (flatmoe_generate's own check: the prompts plus max_new each).
 *
 * The pass (Vaswani et al. 2017 "Attention Is All You Need" §3.2, with a key/value cache as in
 * every autoregressive decoder, e.g. llama.cpp's): for each layer, RMSNorm, the q/k/v projections
 * (+ biases, QK-norm), RoPE at each token's own position (the model's tables), K and V written
 * into the cache at each token's slot, then causal attention of each token over its sequence's
 * cached positions 0 .. its own (softmax in double), the output projection; RMSNorm, the router
 * (the backend's router_fwd: softmax, top-k, norm_topk_prob) and the top-k experts' SwiGLU
 * weighted by the gates, or the dense layer's SwiGLU; then the final RMSNorm. Every projection
 * is the model's own GEMM (fm_linear_fwd) and every norm, rotation and routing the backend's op:
 * only attention and the expert sum run here, so the logits equal the whole-prefix forward's
 * within fp32 reassociation (tests/test_capi_kv.c states and checks the tolerance), not bit for
 * bit. Served: the CPU build (fp32; host memory is the backend's), one rank, the softmax router,
 * native expert precision, no shared experts; else flatmoe_open refuses --kv-cache naming why. */
#include <math.h>
#include <string.h>

#include "fm_capi.h"

#ifdef FM_ACT_BF16 /* the bf16 build: the decoder is the fp32 build's; --kv-cache is refused at open */
fm_status fm_capi_kv_check(const flatmoe_session *s) {
    (void)s;
    return fm_error(FM_ERR_UNSUPPORTED, "flatmoe_open: --kv-cache is not served for the CUDA build (the cache's "
                    "decoder runs on the CPU build only); drop --kv-cache");
}
fm_status fm_capi_kv_pass(flatmoe_session *s, const int32_t *tok, int64_t n) {
    (void)s, (void)tok, (void)n;
    return fm_error(FM_ERR_UNSUPPORTED, "fm_capi_kv_pass: the CUDA build has no KV cache");
}
#else

/* Why the model cannot use the cache (NULL: it can). */
static const char *kv_refusal(const flatmoe_session *s) {
    const fm_config *c = &s->r.cfg;
    if (sizeof(fm_act) != sizeof(float)) return "the CUDA build (the cache's decoder runs on the CPU build only)";
    if (s->r.n_ranks > 1) return "a session of several ranks (flatmoe_generate is one rank's)";
    if (c->mla) return "multi-head latent attention (deepseek_v3)";
    if (c->attention_sinks || c->sliding_window > 0 || c->expert_bias || c->router_linear_bias || c->swiglu_limit > 0)
        return "gpt_oss's attention sinks, sliding windows, biased router and experts, clamped SwiGLU";
    if (c->router_sigmoid) return "the sigmoid router (glm4_moe, deepseek_v3)";
    if (fm_config_shared_width(c) > 0) return "shared experts";
    if (s->r.m.a.moe_fp8) return "--expert-precision fp8";
    if (c->head_dim > FM_CAPI_KV_MAX_HD) return "a head_dim over 512";
    return NULL;
}

fm_status fm_capi_kv_check(const flatmoe_session *s) {
    const char *why = kv_refusal(s);
    if (why)
        return fm_error(FM_ERR_UNSUPPORTED, "flatmoe_open: --kv-cache is not served for %s; drop --kv-cache "
                        "(flatmoe_generate then runs the whole prefix each round)", why);
    return FM_OK;
}

/* Causal attention of the n tokens over their sequences' cache of layer l: token i at slot
 * kv->slot[i] attends to slots kv->first[i] .. kv->slot[i]; att [n, nh, hd]. */
static void attend(fm_capi_kv *kv, const fm_config *c, int64_t l, int64_t N, int64_t n) {
    const int64_t nh = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim, kd = nkv * hd;
    const float *K = kv->K + l * N * kd, *V = kv->V + l * N * kd;
    const double scale = 1.0 / sqrt((double)hd);
    for (int64_t i = 0; i < n; i++) {
        const int64_t j0 = kv->first[i], j1 = kv->slot[i];
        for (int64_t h = 0; h < nh; h++) {
            const int64_t g = h / (nh / nkv);
            const float *qh = kv->q + (i * nh + h) * hd;
            float *out = kv->att + (i * nh + h) * hd;
            double mx = -INFINITY, sum = 0;
            for (int64_t j = j0; j <= j1; j++) {
                double d = 0;
                for (int64_t e = 0; e < hd; e++) d += (double)qh[e] * K[j * kd + g * hd + e];
                mx = d * scale > mx ? d * scale : mx;
            }
            double acc[FM_CAPI_KV_MAX_HD]; /* head_dim <= FM_CAPI_KV_MAX_HD (kv_refusal) */
            const int64_t hb = hd;
            for (int64_t e = 0; e < hb; e++) acc[e] = 0;
            for (int64_t j = j0; j <= j1; j++) {
                double d = 0;
                for (int64_t e = 0; e < hd; e++) d += (double)qh[e] * K[j * kd + g * hd + e];
                const double p = exp(d * scale - mx);
                sum += p;
                for (int64_t e = 0; e < hb; e++) acc[e] += p * V[j * kd + g * hd + e];
            }
            for (int64_t e = 0; e < hb; e++) out[e] = (float)(acc[e] / sum);
        }
    }
}

/* The SwiGLU MLP of one token: y [H] (+)= w x W_down silu(W_gate x) * (W_up x), widths I. */
static void swiglu(const fm_backend *be, float *y, float w, const float *x, const float *Wg, const float *Wu,
                   const float *Wd, int64_t H, int64_t I, float *hid) {
    float *g = hid, *u = hid + I, *a = hid + 2 * I, *o = hid + 3 * I;
    fm_linear_fwd(be, g, FM_ACT_DTYPE, x, Wg, 1, H, I);
    fm_linear_fwd(be, u, FM_ACT_DTYPE, x, Wu, 1, H, I);
    for (int64_t e = 0; e < I; e++) a[e] = g[e] / (1.0f + expf(-g[e])) * u[e];
    fm_linear_fwd(be, o, FM_ACT_DTYPE, a, Wd, 1, I, H);
    for (int64_t e = 0; e < H; e++) y[e] += w * o[e];
}

/* The MLP block of layer l on the n tokens: x += MLP(RMSNorm(x)). */
static void mlp_block(flatmoe_session *s, int64_t l, int64_t n) {
    fm_model *m = &s->r.m;
    const fm_config *c = &s->r.cfg;
    const fm_ops *ops = m->be.ops;
    fm_capi_kv *kv = &s->kv;
    const fm_layer_ptrs *w = &m->p.w.layers[l];
    const int64_t H = c->hidden_size, E = c->num_experts, k = c->num_experts_per_tok, I = c->moe_intermediate_size;
    ops->rmsnorm_fwd(m->be.ctx, kv->ln, kv->rstd, kv->x, w->ln2, n, H, (float)c->rms_norm_eps);
    if (!w->router) {
        for (int64_t i = 0; i < n; i++)
            swiglu(&m->be, kv->x + i * H, 1.0f, kv->ln + i * H, w->mlp_gate, w->mlp_up, w->mlp_down, H,
                   c->dense_intermediate_size, kv->hid);
        return;
    }
    fm_linear_fwd(&m->be, kv->rlog, FM_DTYPE_F32, kv->ln, w->router, n, H, E);
    ops->router_fwd(m->be.ctx, kv->probs, kv->lse, kv->topk_idx, kv->topk_w, kv->rlog, n, E, k, c->norm_topk_prob);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = kv->topk_idx[i * k + j];
            swiglu(&m->be, kv->x + i * H, kv->topk_w[i * k + j], kv->ln + i * H, w->w_gate + e * I * H,
                   w->w_up + e * I * H, w->w_down + e * H * I, H, I, kv->hid);
        }
}

/* The attention block of layer l on the n tokens: x += Attention(RMSNorm(x)), K and V cached. */
static void attention_block(flatmoe_session *s, int64_t l, int64_t n) {
    fm_model *m = &s->r.m;
    const fm_config *c = &s->r.cfg;
    const fm_ops *ops = m->be.ops;
    void *ctx = m->be.ctx;
    fm_capi_kv *kv = &s->kv;
    const fm_layer_ptrs *w = &m->p.w.layers[l];
    const int64_t H = c->hidden_size, nh = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim;
    const int64_t qd = nh * hd, kd = nkv * hd, N = s->budget;
    const float eps = (float)c->rms_norm_eps;
    ops->rmsnorm_fwd(ctx, kv->ln, kv->rstd, kv->x, w->ln1, n, H, eps);
    fm_linear_fwd(&m->be, kv->q, FM_ACT_DTYPE, kv->ln, w->wq, n, H, qd);
    fm_linear_fwd(&m->be, kv->k, FM_ACT_DTYPE, kv->ln, w->wk, n, H, kd);
    fm_linear_fwd(&m->be, kv->v, FM_ACT_DTYPE, kv->ln, w->wv, n, H, kd);
    if (w->bq) {
        ops->bias_add(ctx, kv->q, w->bq, n, qd);
        ops->bias_add(ctx, kv->k, w->bk, n, kd);
        ops->bias_add(ctx, kv->v, w->bv, n, kd);
    }
    if (c->qk_norm == FM_QK_NORM_PER_HEAD) { /* in place: the op reads each row before it writes it */
        ops->rmsnorm_fwd(ctx, kv->att, kv->rstd, kv->q, w->q_norm, n * nh, hd, eps);
        memcpy(kv->q, kv->att, sizeof(float) * (size_t)(n * qd));
        ops->rmsnorm_fwd(ctx, kv->att, kv->rstd, kv->k, w->k_norm, n * nkv, hd, eps);
        memcpy(kv->k, kv->att, sizeof(float) * (size_t)(n * kd));
    } else if (c->qk_norm == FM_QK_NORM_FULL) {
        ops->rmsnorm_fwd(ctx, kv->att, kv->rstd, kv->q, w->q_norm, n, qd, eps);
        memcpy(kv->q, kv->att, sizeof(float) * (size_t)(n * qd));
        ops->rmsnorm_fwd(ctx, kv->att, kv->rstd, kv->k, w->k_norm, n, kd, eps);
        memcpy(kv->k, kv->att, sizeof(float) * (size_t)(n * kd));
    }
    const int64_t rd = fm_config_rotary_dim(c);
    ops->rope_fwd(ctx, kv->q, m->a.rope_cos, m->a.rope_sin, 1, n, nh, hd, rd, kv->pos);
    ops->rope_fwd(ctx, kv->k, m->a.rope_cos, m->a.rope_sin, 1, n, nkv, hd, rd, kv->pos);
    for (int64_t i = 0; i < n; i++) { /* into the cache, then attention over it */
        memcpy(kv->K + (l * N + kv->slot[i]) * kd, kv->k + i * kd, sizeof(float) * (size_t)kd);
        memcpy(kv->V + (l * N + kv->slot[i]) * kd, kv->v + i * kd, sizeof(float) * (size_t)kd);
    }
    attend(kv, c, l, N, n);
    fm_linear_fwd(&m->be, kv->o, FM_ACT_DTYPE, kv->att, w->wo, n, qd, H);
    if (w->bo) ops->bias_add(ctx, kv->o, w->bo, n, H);
    for (int64_t i = 0; i < n * H; i++) kv->x[i] += kv->o[i];
}

fm_status fm_capi_kv_pass(flatmoe_session *s, const int32_t *tok, int64_t n) {
    fm_model *m = &s->r.m;
    const fm_config *c = &s->r.cfg;
    fm_capi_kv *kv = &s->kv;
    const int64_t H = c->hidden_size;
    FM_ASSERT(kv->on && n >= 1 && n <= s->budget);
    for (int64_t i = 0; i < n; i++) memcpy(kv->x + i * H, m->p.w.embed + (int64_t)tok[i] * H, sizeof(float) * (size_t)H);
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        attention_block(s, l, n);
        mlp_block(s, l, n);
    }
    m->be.ops->rmsnorm_fwd(m->be.ctx, kv->ln, kv->rstd, kv->x, m->p.w.final_norm, n, H, (float)c->rms_norm_eps);
    return m->be.ops->status(m->be.ctx);
}
#endif
