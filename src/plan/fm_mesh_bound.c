/* The per-rank bounds of a mesh and the time of its collectives (fm_mesh_bound.h). */
#include "fm_mesh_bound.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../bounded/fm_linear_ce.h"
#include "../bounded/fm_linear_ce_ring.h"
#include "../bounded/fm_moe_ep.h"
#include "../model/fm_attn_sp.h"

int64_t fm_mesh_kv_heads(const fm_config *c, int64_t sp) {
    const int64_t nkv = c->num_key_value_heads;
    return sp > 1 && nkv % sp == 0 ? nkv / sp : sp > 1 ? 1 : nkv;
}

int64_t fm_mesh_expert_params(const fm_config *c) {
    return fm_config_num_moe_layers(c) * c->num_experts * 3 * c->hidden_size * c->moe_intermediate_size;
}

int64_t fm_mesh_gather_unit(const fm_config *c) {
    const int64_t H = c->hidden_size, V = c->vocab_size, L = c->num_hidden_layers;
    const int64_t rest = fm_config_num_params(c) - fm_mesh_expert_params(c) - V * H * (c->tie_word_embeddings ? 1 : 2) - H;
    int64_t layer = L > 0 ? rest / L : 0; /* attention, router, the two norms */
    const int64_t Lm = fm_config_num_moe_layers(c), D = 3 * H * c->dense_intermediate_size, R = c->num_experts * H + fm_config_moe_extra_params(c);
    if (Lm < L && L > 0) { /* rest = L A + Lm R + (L - Lm) D: the larger of an MoE layer's A + R and a dense one's A + D */
        const int64_t A = (rest - Lm * R - (L - Lm) * D) / L;
        layer = A + (D > R ? D : R);
    }
    return layer > V * H ? layer : V * H;
}

static size_t r_(double bytes) { return fm_arena_round((size_t)bytes); }

/* model state: ZeRO-3 over W for the non-expert parameters, E/ep experts whole */
static void model_state(const fm_plan_req *r, fm_plan *p, size_t a) {
    const fm_config *c = &r->cfg;
    const int64_t W = r->mesh.dp * r->mesh.sp, ep = r->mesh.ep;
    const int64_t n = fm_config_num_params(c), n_exp = fm_mesh_expert_params(c), n_ne = n - n_exp;
    const int64_t shard = (n_ne + W - 1) / W, exp_loc = n_exp / ep, held = shard + exp_loc;
    const int64_t U = fm_mesh_gather_unit(c);
    p->n_params_rank = held;
    const double mv = r->bf16_moments ? 2.0 : 4.0;
    const size_t gathered = W > 1 ? 3 * r_((double)U * (double)a) : 0;
    char g[80] = "";
    if (W > 1) snprintf(g, sizeof g, " + 3 slots x U = %lld x %d B (2 gathered, 1 grad)", (long long)U, (int)a);
    if (r->offload_optimizer) {
        const int64_t beta = r->offload_bucket < held ? r->offload_bucket : held;
        const double host_pp = 4.0 + 2.0 * mv; /* master, m, v */
        p->bytes[FM_LIVE_MODEL_STATE] = r_((double)held * 2.0 * (double)a) +
                                        (size_t)r->offload_slots * r_((double)beta * host_pp) + gathered;
        p->host_optimizer_bytes = r_((double)held * host_pp);
        snprintf(p->inputs[FM_LIVE_MODEL_STATE], 200, "ZeRO-3/%lld: %d B x (%lld shard + %lld experts/%lld) + %lld "
                 "slots x %lld x %.0f B%s", (long long)W, (int)(2 * a), (long long)shard, (long long)exp_loc,
                 (long long)ep, (long long)r->offload_slots, (long long)beta, host_pp, g);
    } else {
        const double bpp = (a == 4 ? 8.0 : 2.0 * (double)a + 4.0) + 2.0 * mv;
        p->bytes[FM_LIVE_MODEL_STATE] = r_((double)held * bpp) + gathered;
        p->host_optimizer_bytes = 0;
        snprintf(p->inputs[FM_LIVE_MODEL_STATE], 200, "ZeRO-3/%lld: %.0f B x (%lld shard + %lld experts/%lld)%s",
                 (long long)W, bpp, (long long)shard, (long long)exp_loc, (long long)ep, g);
    }
}

void fm_mesh_plan_sets(const fm_plan_req *r, fm_plan *p) {
    const fm_config *c = &r->cfg;
    const size_t a = r->target == FM_PLAN_TARGET_CPU ? 4 : r->target == FM_PLAN_TARGET_CUDA ? 2 : sizeof(fm_act);
    const int64_t sp = r->mesh.sp, ep = r->mesh.ep, W = r->mesh.dp * sp;
    const int64_t H = c->hidden_size, V = c->vocab_size, hd = c->head_dim, nh = c->num_attention_heads;
    const int64_t Nl = r->B * (r->T / sp);
    const size_t host_off = p->host_bytes - p->host_optimizer_bytes; /* the offloaded boundaries */
    model_state(r, p, a);
    p->host_bytes = host_off + p->host_optimizer_bytes;

    if (ep > 1) { /* capped strided chunks (PipelinedLLEP); no chunk given: one chunk of N_loc */
        fm_moe_dims md = {H, c->moe_intermediate_size, c->num_experts, c->num_experts_per_tok};
        md.bias = c->expert_bias; /* gpt_oss: LLEP's hosted experts carry their biases */
        const int64_t cap = r->moe_chunk_tokens > 0 && r->moe_chunk_tokens < Nl ? r->moe_chunk_tokens : (Nl > 0 ? Nl : 1);
        fm_moe_ep_bound b;
        const bool llep = r->llep && r->llep->on; /* --llep: the hosted experts' weights (and biases) counted */
        p->bytes[FM_LIVE_EXPERT] = fm_moe_ep_bound_bytes(&md, (int)ep, cap, a, r->llep, &b);
        p->host_bytes += b.host;
        fm_moe_chunks(Nl, cap, &p->moe_K, &p->moe_c_eff);
        snprintf(p->inputs[FM_LIVE_EXPERT], 200, "EP over %lld: R_max = ep x c x min(k, E/ep) = %lld rows x H; recv + send "
                 "+ source + experts%s, K = %lld chunks of c <= %lld", (long long)ep, (long long)b.rows_max,
                 !llep ? "" : md.bias ? " + LLEP weights and biases" : " + LLEP weights", (long long)p->moe_K, (long long)cap);
    }

    if (W > 1) { /* Ring-DTP over the W ranks */
        fm_lce_opts lo = fm_lce_opts_default();
        lo.block_tokens = r->ce_block_tokens > 0 ? r->ce_block_tokens : FM_LCE_DEFAULT_BLOCK_TOKENS;
        lo.block_vocab = r->ce_block_vocab > 0 ? r->ce_block_vocab : FM_LCE_DEFAULT_BLOCK_VOCAB;
        const fm_lce_ring_mode mode = fm_lce_ring_choose(Nl, V, (int)W);
        p->bytes[FM_LIVE_VOCAB] = fm_linear_ce_ring_bound_bytes_a(FM_LCE_RING_AUTO, Nl, H, V, (int)W, true, true, &lo, a) +
                                  r_((double)Nl * (double)H * (double)a) + 2 * r_((double)Nl * 4.0);
        snprintf(p->inputs[FM_LIVE_VOCAB], 200, "Ring-DTP over P = %lld, moving %s: one %lld x %lld fp32 strip + 2 "
                 "messages of %s (+ final norm N x H)", (long long)W, mode == FM_LCE_RING_ACTIVATIONS ? "activations" : "weights",
                 (long long)lo.block_tokens, (long long)lo.block_vocab,
                 mode == FM_LCE_RING_ACTIVATIONS ? "N x H h, dh and state" : "a V/P x H shard and its dW");
    }

    /* communication buffers */
    size_t comm = 0;
    char sp_part[90] = "", z_part[60] = "";
    if (sp > 1) { /* the trainer's own bound (fm_attn_sp_bytes), so its launch fits as this plan does */
        const int64_t qd_loc = nh / sp * hd, kd_loc = fm_mesh_kv_heads(c, sp) * hd;
        const int64_t nkv = c->num_key_value_heads;
        const fm_attn_sp_dims sd = {r->B, r->T / sp, nh, nkv, hd, sp};
        if (r->T / sp >= 1 && nkv >= 1 && nh % sp == 0 && nh % nkv == 0 && (nkv % sp == 0 || sp % nkv == 0))
            comm += fm_attn_sp_bytes(&sd, (size_t)a);
        else /* a degree Ulysses cannot serve (the mesh chooser refuses it): the same buffers, roughly */
            comm += 4 * r_((double)r->B * (double)r->T * (double)qd_loc * (double)a) +
                    4 * r_((double)r->B * (double)r->T * (double)kd_loc * (double)a) +
                    2 * r_((double)Nl * (double)(nh * hd) * (double)a);
        snprintf(sp_part, sizeof sp_part, "SP: q, o, k, v + grads [B T, %lld | %lld] + a2a send, receive [N, %lld]",
                 (long long)qd_loc, (long long)kd_loc, (long long)(nh * hd));
    }
    if (W > 1) {
        const int64_t U = fm_mesh_gather_unit(c);
        comm += r_((double)((U + W - 1) / W) * (double)a);
        snprintf(z_part, sizeof z_part, "%sreduce-scatter out U/%lld", sp_part[0] ? "; " : "", (long long)W);
    }
    /* process groups of more than one rank: the world (ZeRO-3, ring), ep, sp, expert-data-parallel */
    int groups = (W > 1) + (ep > 1 && ep < W) + (sp > 1 && sp < W) + (ep > 1 && W / ep > 1);
    comm += (size_t)groups * FM_MESH_NCCL_GROUP_BYTES;
    p->comm_bytes = comm;
    snprintf(p->comm_inputs, 200, "%s%s%s%d groups x %d MiB NCCL (nominal)", sp_part, z_part,
             sp_part[0] || z_part[0] ? "; " : "", groups, (int)(FM_MESH_NCCL_GROUP_BYTES >> 20));
}

static double link_bw(int64_t span, int64_t gpn, const fm_calib *c) {
    return span > gpn ? c->inter_node_bw : c->intra_node_bw;
}

double fm_mesh_ring_s(double bytes, int64_t g, int64_t span, int64_t gpn, const fm_calib *c) {
    if (g <= 1 || bytes <= 0) return 0.0;
    return bytes * (double)(g - 1) / (double)g / link_bw(span, gpn, c);
}

double fm_mesh_all_to_all_s(double bytes, int64_t g, int64_t span, int64_t gpn, const fm_calib *c) {
    if (g <= 1 || bytes <= 0) return 0.0;
    /* peers on this rank's node (a contiguous group fills nodes in order) and off it */
    const int64_t per_node = span > gpn ? (g * gpn + span - 1) / span : g; /* members per node */
    const double on = (double)(per_node - 1), off = (double)(g - per_node);
    const double each = bytes / (double)g;
    return fmax(on * each / c->intra_node_bw, off * each / c->inter_node_bw);
}

void fm_mesh_project_comm(const fm_plan_req *r, const fm_plan *p, const fm_calib *cb, const fm_mesh_layer_times *t,
                          fm_projection *o) {
    const fm_config *c = &r->cfg;
    const int64_t sp = r->mesh.sp, ep = r->mesh.ep, W = r->mesh.dp * sp;
    const int64_t gpn = r->mesh.gpus_per_node > 0 ? r->mesh.gpus_per_node : 8;
    const double a = r->target == FM_PLAN_TARGET_CPU ? 4 : r->target == FM_PLAN_TARGET_CUDA ? 2 : (double)sizeof(fm_act);
    const double L = (double)c->num_hidden_layers, H = (double)c->hidden_size, V = (double)c->vocab_size;
    const double k = (double)c->num_experts_per_tok, hd = (double)c->head_dim;
    const double N = (double)(r->B * (r->T / sp)), nr = (double)p->n_recomputed;
    const double ga = (double)(r->grad_accum > 0 ? r->grad_accum : 1);
    const double layer_f = t->att_f + t->dense_f + t->exp_f + t->mem_f;
    const double layer_b = t->att_b + t->dense_b + t->exp_b + 2.0 * t->mem_f;

    /* ZeRO-3: each layer's non-expert weights over the W ranks (the world: span W) */
    double z = 0;
    if (W > 1) {
        const int64_t n_exp = fm_mesh_expert_params(c);
        const double emb = V * H;
        const double layer_params = (double)(fm_config_num_params(c) - n_exp) - emb * (c->tie_word_embeddings ? 1 : 2) - H;
        const double lp = L > 0 ? layer_params / L : 0;
        const double tg = fm_mesh_ring_s(lp * a, W, W, gpn, cb); /* gather, and reduce-scatter: the same bytes */
        const double te = fm_mesh_ring_s(emb * a, W, W, gpn, cb);
        z = L * (fmax(0.0, tg - layer_f) + fmax(0.0, 2.0 * tg - layer_b)) + tg + 2.0 * te;
        z *= ga;
        if (W / ep > 1) { /* experts' grads over their W/ep replicas (strided by ep: span W) */
            const double ar = 2.0 * fm_mesh_ring_s((double)n_exp / (double)ep * a, W / ep, W, gpn, cb);
            z += fmax(0.0, ar - L * layer_b);
        }
    }
    o->sec[FM_PROJ_ZERO3] = z;

    /* EP: 6 row all-to-alls per layer (+2 per recomputed layer), over ep consecutive ranks */
    double e = 0;
    if (ep > 1) {
        const double one = fm_mesh_all_to_all_s(N * k * H * a, ep, ep, gpn, cb);
        const double K = (double)(p->moe_K > 0 ? p->moe_K : 1);
        const double per_layer = 6.0 * one, rec = 2.0 * one;
        const double exp_layer = t->exp_f + t->exp_b;
        if (K <= 1) e = L * per_layer + nr * rec;
        else
            e = L * (fmax(0.0, per_layer - exp_layer) + per_layer / K) + nr * (fmax(0.0, rec - t->exp_f) + rec / K);
        e *= ga;
    }
    o->sec[FM_PROJ_EP] = e;

    /* SP: Ulysses, never hidden */
    double s = 0;
    if (sp > 1) {
        const double qd = (double)(c->num_attention_heads * c->head_dim);
        const double nkv = (double)c->num_key_value_heads;
        const double kd_send = nkv >= (double)sp ? nkv * hd : (double)sp * hd;
        s = ga * L * fm_mesh_all_to_all_s(6.0 * (qd + kd_send) * N * a, sp, sp, gpn, cb);
    }
    o->sec[FM_PROJ_SP] = s;

    /* Ring-DTP over W: P - 1 hops each way, behind the head's compute */
    double g = 0;
    if (W > 1) {
        const bool acts = fm_lce_ring_choose((int64_t)N, (int64_t)V, (int)W) == FM_LCE_RING_ACTIVATIONS;
        const double S = ceil(V / (double)W);
        const double mf = acts ? N * (H * a + 16.0) : S * H * a, mbk = acts ? N * (2.0 * H * a + 16.0) : 2.0 * S * H * a;
        const double bw = W > gpn ? cb->inter_node_bw : cb->intra_node_bw;
        const double hops = (double)(W - 1) * (mf + mbk) / bw;
        g = ga * (fmax(0.0, hops - t->head) + (mf + mbk) / bw);
    }
    o->sec[FM_PROJ_RING] = g;
}
