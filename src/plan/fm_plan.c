#include "fm_plan.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backend/fm_backend_plan.h"
#include "../bounded/fm_linear_ce.h"
#include "../bounded/fm_linear_ce_ring.h"
#include "fm_mesh_bound.h"
#include "../bounded/fm_moe_ep.h"
#include "../schedule/fm_recompute.h"
#include "../schedule/fm_sco.h"

int64_t fm_offload_buckets(int64_t n_params, int64_t bucket) {
    const int64_t b = bucket < n_params ? bucket : n_params;
    return b > 0 ? (n_params + b - 1) / b : 0;
}

int64_t fm_offload_streamed_buckets(int64_t n_params, int64_t bucket, double fraction) {
    const int64_t nb = fm_offload_buckets(n_params, bucket);
    if (!(fraction > 0) || fraction >= 1) return nb;
    const int64_t s = (int64_t)ceil(fraction * (double)nb - 1e-9);
    return s < 1 ? 1 : s > nb ? nb : s;
}

int64_t fm_offload_resident_params(int64_t n_params, int64_t bucket, double fraction) {
    const int64_t nb = fm_offload_buckets(n_params, bucket);
    return (nb - fm_offload_streamed_buckets(n_params, bucket, fraction)) * (bucket < n_params ? bucket : n_params);
}

const char *fm_plan_set_name(int i) {
    return i == FM_PLAN_ATTENTION ? "attention tiles" : fm_live_set_names[i];
}

fm_status fm_plan_check_shape(const fm_config *cfg, int64_t B, int64_t T) {
    if (B < 1 || T < 1)
        return fm_error(FM_ERR_ARG, "--micro-batch (%lld) and --seq-len (%lld) must be >= 1", (long long)B, (long long)T);
    const double routes = (double)B * (double)T * (double)cfg->num_experts_per_tok;
    if (routes >= 2147483648.0 || (double)B * (double)T * (double)cfg->vocab_size > 4.6e18)
        return fm_error(FM_ERR_ARG, "--micro-batch %lld x --seq-len %lld = %.4g tokens x top-%lld = %.4g routes; flatmoe "
                        "indexes routes with int32 (< 2^31 per micro-batch): lower --seq-len or --micro-batch",
                        (long long)B, (long long)T, (double)B * (double)T, (long long)cfg->num_experts_per_tok, routes);
    return FM_OK;
}

void fm_plan_compute(const fm_plan_req *r, fm_plan *p) {
    memset(p, 0, sizeof *p);
    const fm_config *c = &r->cfg;
    /* a mesh rank holds T / sp of each sequence's tokens (Ulysses); one rank: all of them */
    /* (r->sp: the trainer's --sp run, exact to its arenas; r->mesh.sp: a mesh rank's what-if) */
    const int64_t sp = r->mesh.on && r->mesh.sp > 1 ? r->mesh.sp : r->sp > 1 ? r->sp : 1, Tl = r->T / sp;
    const int64_t L = c->num_hidden_layers, N = r->B * Tl, H = c->hidden_size, I = c->moe_intermediate_size;
    const int64_t k = c->num_experts_per_tok, E = c->num_experts;
    const fm_recompute_policy rp = {r->recompute, L, r->keep_attention}; /* the policy's bound */
    const int64_t nr = fm_recompute_count(&rp), nka = fm_recompute_keep_attention_count(&rp);
    p->n_recomputed = nr;
    p->n_keep_attention = nka;
    const int64_t saved_sets = fm_recompute_saved_sets(&rp);
    p->n_params = fm_config_num_params(c);
    p->n_active = fm_config_num_active_params(c);
    /* element size of activations and weights on the target backend */
    const fm_plan_target tgt = r->target;
    const size_t a = tgt == FM_PLAN_TARGET_CPU ? 4 : tgt == FM_PLAN_TARGET_CUDA ? 2 : sizeof(fm_act);

    /* model state: the parameter store's weights, grads and master and the optimizer's state,
     * asked of the caller (train/fm_optim.h: fm_model_state_bound) */
    FM_ASSERT(r->model_state_bytes); /* a request without it is a caller bug */
    p->host_optimizer_bytes = 0;
    if (r->offload_optimizer) {
        FM_ASSERT(r->offload_state_bytes && r->offload_bucket >= 1 && r->offload_slots >= 1);
        p->bytes[FM_LIVE_MODEL_STATE] = r->offload_state_bytes(c, a, r->bf16_moments, r->offload_bucket,
                                                               r->offload_slots, r->offload_fraction,
                                                               &p->host_optimizer_bytes, p->inputs[FM_LIVE_MODEL_STATE]);
        const int64_t n = fm_config_num_params(c);
        p->offload_buckets = fm_offload_buckets(n, r->offload_bucket);
        p->offload_streamed_buckets = fm_offload_streamed_buckets(n, r->offload_bucket, r->offload_fraction);
        p->offload_resident = fm_offload_resident_params(n, r->offload_bucket, r->offload_fraction);
    } else {
        p->bytes[FM_LIVE_MODEL_STATE] = r->model_state_bytes(c, &r->state_layout, a, r->bf16_moments, p->inputs[FM_LIVE_MODEL_STATE]);
    }

    /* the offload policy's bound: L+1 - n_off + min(n_off, 2) residual-stream tensors on the
     * device, n_off on the host (schedule/fm_sco.h) */
    const int64_t n_off = r->n_offloaded_boundaries, n_bnd = fm_sco_device_boundaries(L, n_off);
    p->n_offloaded_boundaries = n_off;
    p->bytes[FM_LIVE_BOUNDARIES] = fm_model_boundary_bytes_sp(c, r->B, Tl, sp, r->moe_chunk_tokens > 0 || r->ep > 1, n_bnd, a);
    p->host_bytes = fm_sco_host_bytes(N, H, n_off, a) + p->host_optimizer_bytes;
    if (n_off > 0)
        snprintf(p->inputs[FM_LIVE_BOUNDARIES], 200, "(L+1 - %lld offloaded + %d slots = %lld) x N x H x %d B, N = %lld, "
                 "H = %lld (+ tokens, RoPE)", (long long)n_off, n_off < 2 ? (int)n_off : 2, (long long)n_bnd, (int)a,
                 (long long)N, (long long)H);
    else
        snprintf(p->inputs[FM_LIVE_BOUNDARIES], 200, "(L+1 = %lld) x N x H x %d B, N = %lld, H = %lld (+ tokens, RoPE)",
                 (long long)L + 1, (int)a, (long long)N, (long long)H);

    const size_t one = fm_model_layer_acts_bytes(c, r->B, Tl, a);
    const size_t kept_att = fm_model_kept_attention_bytes(c, r->B, Tl, a);
    /* dense layers (qwen3_moe's decoder_sparse_step / mlp_only_layers) save no router's part and
     * no dispatch: the sets of each shape, as the layout takes them */
    int64_t sets_moe, sets_dense;
    fm_model_saved_sets(c, r->recompute, &sets_moe, &sets_dense);
    p->bytes[FM_LIVE_LAYER_ACTS] = (size_t)sets_moe * one + (size_t)sets_dense * fm_model_dense_layer_acts_bytes(c, r->B, Tl, a) +
                                   (size_t)nka * kept_att;
    if (sets_dense > 0)
        snprintf(p->inputs[FM_LIVE_LAYER_ACTS], 200, "%lld saved sets (%lld layers, %lld recomputed): %lld MoE x %.1f MiB + "
                 "%lld dense x %.1f MiB%s", (long long)saved_sets, (long long)L, (long long)nr, (long long)sets_moe,
                 one / 1048576.0, (long long)sets_dense, fm_model_dense_layer_acts_bytes(c, r->B, Tl, a) / 1048576.0,
                 nka > 0 ? " + kept attention outputs" : "");
    else if (nka > 0)
        snprintf(p->inputs[FM_LIVE_LAYER_ACTS], 200, "%lld saved sets (%lld layers, %lld recomputed) x %.1f MiB per layer "
                 "+ %lld kept attention outputs x %.1f MiB", (long long)saved_sets, (long long)L, (long long)nr,
                 one / 1048576.0, (long long)nka, kept_att / 1048576.0);
    else
        snprintf(p->inputs[FM_LIVE_LAYER_ACTS], 200, "%lld saved sets (%lld layers, %lld recomputed) x %.1f MiB per layer",
                 (long long)saved_sets, (long long)L, (long long)nr, one / 1048576.0);

    const bool fp8c = r->expert_fp8 && r->expert_fp8_codes;
    fm_moe_dims md = {H, I, E, k, false, r->expert_fp8, fp8c,
                      fp8c && r->layout.expert_fp8_cache ? fm_config_num_moe_layers(c) : 0}; /* fm_moe_ws_bytes */
    md.bias = c->expert_bias; /* gpt_oss: LLEP's hosted experts' biases (fm_moe_ep_bound.llep) */
    fm_moe_chunks(N, r->moe_chunk_tokens, &p->moe_K, &p->moe_c_eff);
    if (r->ep > 1) { /* expert parallelism: the EP operator's bound for one chunk of <= c_eff tokens per source */
        fm_moe_ep_bound eb;
        p->bytes[FM_LIVE_EXPERT] = fm_arena_round(fm_moe_ep_bound_bytes(&md, r->ep, p->moe_c_eff, a, r->llep, &eb));
        snprintf(p->inputs[FM_LIVE_EXPERT], 200, "EP over %d ranks: K = %lld chunks of <= %lld tokens per source, "
                 "R_max = %lld rows x (4H + 6I) x %d B + c x k source rows%s", r->ep, (long long)p->moe_K,
                 (long long)p->moe_c_eff, (long long)eb.rows_max, (int)a, !(r->llep && r->llep->on) ? "" : md.bias ? " + LLEP weights and biases" : " + LLEP weights");
    } else if (r->moe_chunk_tokens > 0) {
        p->bytes[FM_LIVE_EXPERT] = fm_arena_round(fm_moe_ws_bytes(&md, p->moe_c_eff, true, a));
        snprintf(p->inputs[FM_LIVE_EXPERT], 200, "one chunk fwd+bwd: K = %lld chunks of <= %lld tokens x k = %lld routes, "
                 "(2H + 3I) x %d B per route%s", (long long)p->moe_K, (long long)p->moe_c_eff, (long long)k, (int)a,
                 !r->expert_fp8 ? "" : !r->expert_fp8_codes ? " + fp8 copies" : r->layout.expert_fp8_cache ? " + fp8 code operands, L weight code sets" : " + fp8 code operands");
    } else {
        p->bytes[FM_LIVE_EXPERT] = (size_t)sets_moe * fm_moe_routes_bytes(&md, N, a) + fm_moe_ws_bytes(&md, N, false, a);
        snprintf(p->inputs[FM_LIVE_EXPERT], 200, "plain: %lld saved dispatches of N x k = %lld routes x (2H + 3I) x %d B, "
                 "+ backward%s", (long long)sets_moe, (long long)(N * k), (int)a,
                 !r->expert_fp8 ? "" : !r->expert_fp8_codes ? " + fp8 copies (3 E H I + 2 N k max(H,I))" : r->layout.expert_fp8_cache ? " + fp8 code operands, L weight code sets (L x 6 E H I)" : " + fp8 code operands");
    }

    const bool cuda = tgt == FM_PLAN_TARGET_CUDA || (tgt == FM_PLAN_TARGET_BUILD && sizeof(fm_act) != 4);
    /* under sp, attention runs over the whole sequence with heads / sp query heads and
     * fm_mesh_kv_heads key/value heads (replicated when fewer than sp) */
    const fm_backend_plan_req breq = {.B = r->B, .T = r->T, .nh = c->num_attention_heads / sp,
                                      .nkv = sp > 1 ? fm_mesh_kv_heads(c, sp) : c->num_key_value_heads,
                                      .hd = c->head_dim, .threads = r->threads,
                                      .tile_q = r->att_tile_q, .tile_kv = r->att_tile_kv,
                                      .gpu_workspace = r->gpu_workspace};
    fm_backend_plan_info bw;
    fm_backend_plan_workspaces(cuda ? FM_BACKEND_KIND_CUDA : FM_BACKEND_KIND_CPU, &breq, &bw);
    if (cuda) {
        /* the cuDNN workspace: as given, else sized for this shape (fm_cuda_cudnn_workspace_auto) */
        p->gpu_workspace = bw.cudnn_workspace;
        p->bytes[FM_PLAN_ATTENTION] = bw.total;
        snprintf(p->inputs[FM_PLAN_ATTENTION], 200, "CUDA: cuDNN workspace %.0f MiB (%s) + cuBLASLt %.0f MiB + 16 MiB scratch",
                 p->gpu_workspace / 1048576.0, r->gpu_workspace ? "--gpu-workspace" : "sized for the attention backward",
                 bw.lt_workspace / 1048576.0);
    } else if (!bw.known) { /* a CPU run planned from the CUDA build */
        p->bytes[FM_PLAN_ATTENTION] = 0; /* the CUDA build carries no CPU backend to ask */
        snprintf(p->inputs[FM_PLAN_ATTENTION], 200, "CPU tiles: plan with the CPU build for this figure");
    } else {
        p->bytes[FM_PLAN_ATTENTION] = bw.total;
        snprintf(p->inputs[FM_PLAN_ATTENTION], 200, "per-thread flash tiles %lld x %lld, head_dim %lld (never T x T)",
                 (long long)(r->att_tile_q > 0 ? r->att_tile_q : 64),
                 (long long)(r->att_tile_kv > 0 ? r->att_tile_kv : 64), (long long)c->head_dim);
    }

    p->bytes[FM_LIVE_WORKING_SET] = fm_model_working_set_bytes(c, N, a);
    snprintf(p->inputs[FM_LIVE_WORKING_SET], 200, "one layer's backward: 4 x N x H (5 if heads x head_dim < H) + q/k/v grads + "
             "router grads%s%s", fm_config_num_moe_layers(c) < L ? " + dense MLP 5 x N x intermediate_size" : "",
             c->mla ? " + MLA's q, latents, kv_b and o_proj input (fm_mla_ws_bytes)" : "");
    if (r->sp > 1 && !r->mesh.on) { /* the trainer's Ulysses: the head-sharded q/k/v/o and their grads, the
                                        all-to-all blocks, index tables (a mesh counts them in its comm set) */
        const fm_attn_sp_dims sd = {r->B, Tl, c->num_attention_heads, c->num_key_value_heads, c->head_dim, (int)sp};
        const size_t spb = fm_attn_sp_bytes(&sd, a);
        p->bytes[FM_LIVE_WORKING_SET] += spb;
        snprintf(p->inputs[FM_LIVE_WORKING_SET], 200, "one layer's backward at N = B x T/sp = %lld + Ulysses sp = %lld: "
                 "head-sharded q/k/v/o + grads [B,T,heads/sp] and 2 all-to-all blocks, %.1f MiB", (long long)N,
                 (long long)sp, spb / 1048576.0);
    }

    const bool lce = r->ce_block_tokens > 0 || r->ce_block_vocab > 0;
    if (lce && r->vocab_ring > 1) { /* --vocab-parallel ring: Ring-DTP over the world's P ranks */
        const int P = (int)r->vocab_ring;
        const fm_lce_ring_mode mode = fm_lce_ring_choose(N, c->vocab_size, P);
        p->bytes[FM_LIVE_VOCAB] = fm_model_vocab_ring_bytes(c, N, r->ce_block_tokens, r->ce_block_vocab, P, a);
        snprintf(p->inputs[FM_LIVE_VOCAB], 200, "Ring-DTP over P = %d, moving %s: one %lld x %lld fp32 strip + 2 messages "
                 "of %s (+ final norm N x H)", P, mode == FM_LCE_RING_ACTIVATIONS ? "activations" : "weights",
                 (long long)(r->ce_block_tokens > 0 ? r->ce_block_tokens : FM_LCE_DEFAULT_BLOCK_TOKENS),
                 (long long)(r->ce_block_vocab > 0 ? r->ce_block_vocab : FM_LCE_DEFAULT_BLOCK_VOCAB),
                 mode == FM_LCE_RING_ACTIVATIONS ? "N x H h, dh and state" : "a V/P x H shard and its dW");
    } else if (lce) {
        p->bytes[FM_LIVE_VOCAB] = fm_model_vocab_linear_bytes(c, N, r->ce_block_tokens, r->ce_block_vocab, a);
        if (r->layout.rl_head) /* the RL head's per-token weights, entropies and entropy state (docs/rl.md) */
            p->bytes[FM_LIVE_VOCAB] += fm_model_vocab_rl_bytes(c, N, r->ce_block_tokens, r->ce_block_vocab,
                                                               r->layout.rl_topk, a);
        const int64_t nb = r->ce_block_tokens > 0 ? r->ce_block_tokens : FM_LCE_DEFAULT_BLOCK_TOKENS;
        const int64_t vb = r->ce_block_vocab > 0 ? r->ce_block_vocab : FM_LCE_DEFAULT_BLOCK_VOCAB;
        snprintf(p->inputs[FM_LIVE_VOCAB], 200, "linear CE: one %lld x %lld fp32 strip (+ final norm N x H)",
                 (long long)(nb < N ? nb : N), (long long)(vb < c->vocab_size ? vb : c->vocab_size)); /* as the call clamps them */
    } else {
        p->bytes[FM_LIVE_VOCAB] = fm_model_vocab_plain_bytes(c, N, a);
        snprintf(p->inputs[FM_LIVE_VOCAB], 200, "plain logits N x V x %d B, V = %lld (+ final norm)", (int)a, (long long)c->vocab_size);
    }

    if (r->mesh.on) fm_mesh_plan_sets(r, p); /* model state, experts, vocabulary, comm buffers per rank */
    for (int i = 0; i < FM_PLAN_SETS; i++) p->total += p->bytes[i];
    p->total += p->comm_bytes;

    /* FLOPs (Megatron's count; REFERENCES.md "FLOPs and MFU"): 6 per active matmul parameter
     * per token, plus causal attention 6 * L * (nh*hd) * T. Hardware FLOPs add the forwards run
     * again: recomputed layers (2 * their active parameters + their attention forward, which a
     * keep-attention layer does not run again: 2 * h_attn * T per token, causal), and
     * the chunked MoE's expert forward (2 * k * 3HI per token per layer). */
    const double h_attn = (double)(c->num_attention_heads * c->head_dim);
    /* the layers' causal T, a sliding-window layer's 2 x its mean keys per query (gpt_oss;
     * fm_config_attention_span) */
    double att_T = 0;
    for (int64_t l = 0; l < L; l++) att_T += fm_config_attention_span(c, l, r->T);
    p->flops_model_token = 6.0 * (double)p->n_active + 6.0 * h_attn * att_T;
    const double layer_active = (double)(p->n_active - c->vocab_size * H - H) / (double)L;
    double hw = p->flops_model_token;
    hw += (double)nr * 2.0 * layer_active + (double)(nr - nka) * 2.0 * h_attn * (double)r->T;
    const int64_t Lm = fm_config_num_moe_layers(c);
    int64_t nr_moe = 0; /* recomputed MoE layers */
    for (int64_t l = 0; r->recompute && l < L; l++) nr_moe += r->recompute[l] && fm_config_layer_is_moe(c, l);
    if (r->moe_chunk_tokens > 0 || r->ep > 1) hw += (double)(Lm - nr_moe) * 2.0 * (double)k * 3.0 * (double)H * (double)I;
    /* a dense layer's backward forms gate and up again (fm_dense_mlp.h): 2 x 2 H Id per token */
    hw += (double)(L - Lm) * 4.0 * (double)H * (double)c->dense_intermediate_size;
    hw += (double)Lm * 4.0 * (double)H * (double)fm_config_shared_width(c); /* the shared experts' too */
    if (lce) hw += 2.0 * (double)c->vocab_size * (double)H; /* the logits formed twice */
    p->flops_hw_token = hw;
    /* the whole step's tokens: dp ranks' sequences (sp ranks share theirs): a mesh's dp, or the
     * trainer's run's --dp */
    const int64_t dp_all = r->mesh.on ? r->mesh.dp : r->train_dp;
    p->tokens_per_step = N * sp * (dp_all > 1 ? dp_all : 1) * (r->grad_accum > 0 ? r->grad_accum : 1);
    p->bf16_moments = r->bf16_moments;
}

static int largest_set(const fm_plan *p) {
    int best = 0;
    for (int i = 1; i < FM_PLAN_SETS; i++)
        if (p->bytes[i] > p->bytes[best]) best = i;
    return best;
}

fm_status fm_plan_check(const fm_plan *p, size_t budget, const char *flag_budget) {
    if (budget == 0 || p->total <= budget) return FM_OK;
    int big = largest_set(p);
    return fm_error(FM_ERR_NOMEM, "plan: %.1f MiB needed but %s is %.1f MiB; the largest live set is %s (%.1f MiB)",
                    p->total / 1048576.0, flag_budget, budget / 1048576.0, fm_plan_set_name(big),
                    p->bytes[big] / 1048576.0);
}

fm_status fm_parse_bytes(const char *s, const char *flag, size_t *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || !(v >= 0))
        return fm_error(FM_ERR_ARG, "%s: expected a byte count like 16GiB, 80G or 17179869184, found '%s'", flag, s);
    while (*end == ' ') end++;
    char suf[8] = {0};
    for (int i = 0; end[i] && i < 7; i++) suf[i] = (char)toupper((unsigned char)end[i]);
    double mul = 0;
    const char *bin[] = {"", "B", "K", "KIB", "M", "MIB", "G", "GIB", "T", "TIB"};
    const double binv[] = {1, 1, 1024.0, 1024.0, 1048576.0, 1048576.0, 1073741824.0, 1073741824.0, 1099511627776.0, 1099511627776.0};
    for (int i = 0; i < 10; i++) if (!strcmp(suf, bin[i])) mul = binv[i];
    if (!strcmp(suf, "KB")) mul = 1e3;
    if (!strcmp(suf, "MB")) mul = 1e6;
    if (!strcmp(suf, "GB")) mul = 1e9;
    if (!strcmp(suf, "TB")) mul = 1e12;
    if (mul == 0)
        return fm_error(FM_ERR_ARG, "%s: unknown unit '%s' in '%s'; use B, KiB, MiB, GiB, TiB (or K, M, G, T), or KB, MB, GB, TB",
                        flag, end, s);
    const double bytes = v * mul;
    if (!isfinite(bytes) || bytes >= 18446744073709551616.0) /* 2^64: (size_t) of it is undefined */
        return fm_error(FM_ERR_ARG, "%s: '%s' is beyond what a byte count can hold (2^64 bytes); give a size like 16GiB",
                        flag, s);
    if (bytes > 0 && bytes < 1)
        return fm_error(FM_ERR_ARG, "%s: '%s' is less than one byte; give a size like 16GiB", flag, s);
    *out = (size_t)bytes;
    return FM_OK;
}
