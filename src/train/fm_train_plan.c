/* The planner's request of a training run from the trainer's options (fm_train_plan.h). */
#include <string.h>

#include "../bounded/fm_linear_ce.h"
#include "../model/fm_attn_sp.h"
#include "../schedule/fm_recompute.h"
#include "../schedule/fm_sco.h"
#include "fm_offload_adamw.h"
#include "fm_train_ep.h"
#include "fm_train_plan.h"
#include "fm_zero3.h"

void fm_train_plan_free(fm_train_plan *tp) {
    fm_free(tp->rc);
    tp->rc = NULL;
}

/* The model state's layout and bound: ZeRO over the world, --ep's share of the experts. */
static void plan_state(fm_train_plan *tp, const fm_train_opts *o, int W) {
    fm_plan_req *req = &tp->req;
    req->state_layout = (fm_state_layout){W, o->zero, tp->ep, o->master_weights};
    req->model_state_bytes = fm_model_state_bound;
    if (tp->ep > 1) { /* --zero 3 --ep: the non-expert parameters sharded, E/ep experts whole (fm_zero3.h) */
        req->model_state_bytes = o->zero == 3 && W > 1 ? fm_zero3_ep_model_state_bound : fm_train_ep_model_state_bound;
        req->ep = tp->ep;
        req->llep = &tp->llep;
    }
    req->offload_optimizer = o->offload_optimizer;
    req->offload_bucket = o->offload_optimizer_bucket > 0 ? o->offload_optimizer_bucket : FM_OFFLOAD_DEFAULT_BUCKET;
    req->offload_slots = o->offload_optimizer_slots;
    req->offload_fraction = o->optimizer_offload_fraction > 0 ? o->optimizer_offload_fraction : 1.0; /* chooser: less */
    req->offload_state_bytes = fm_offload_model_state_bound;
    req->bf16_moments = o->bf16_moments;
    /* the update overlaps the next forward, but not under ZeRO (its update ends in a gather) */
    req->optimizer_overlap = !o->no_optimizer_overlap && !(o->zero && W > 1);
    req->train_dp = W / (req->sp > 1 ? (int)req->sp : 1), req->train_zero = o->zero; /* the train flags line */
}

fm_status fm_train_plan_request(const fm_train_opts *o, const fm_config *c, int W, int sp, fm_plan_target target,
                                fm_train_plan *tp) {
    memset(tp, 0, sizeof *tp);
    fm_plan_req *req = &tp->req;
    req->cfg = *c;
    req->target = target;
    req->layout = o->layout; /* the layout knobs as the flags set them (fm_trainer.h), whole */
    FM_TRY(fm_plan_check_shape(c, o->micro_batch, o->seq_len));
    if (sp > 1) FM_TRY(fm_attn_sp_check(c, sp, o->seq_len)); /* seq-len and the head counts divisible by --sp */
    FM_TRY(fm_train_ep_check(o, c, W)); /* E/ep experts per rank, the EP dispatch's flags */
    tp->ep = o->ep > 1 ? o->ep : 1;
    tp->llep = fm_train_ep_llep(o);
    tp->moe_c = tp->ep > 1 && o->ep_cap_tokens > 0 ? o->ep_cap_tokens : o->moe_chunk_tokens;
    const int64_t L = c->num_hidden_layers;
    bool *rc = tp->rc = fm_malloc((size_t)(2 * L)); /* recompute [L], keep-attention [L] */
    if (!rc) return fm_error(FM_ERR_NOMEM, "out of memory for the recompute table (%lld layers)", (long long)L);
    FM_TRY(fm_recompute_parse(o->recompute, L, rc));
    FM_TRY(fm_recompute_keep_attention_fill(o->recompute_keep_attention, o->recompute != NULL, rc, L, rc + L));
    FM_TRY(fm_sco_parse(o->offload_boundaries, L, &req->n_offloaded_boundaries));
    req->B = o->micro_batch;
    req->T = o->seq_len;
    req->max_position_embeddings_flag = o->max_position_embeddings; /* repeated by the train flags line */
    req->grad_accum = o->grad_accum;
    req->recompute = rc;
    req->keep_attention = rc + L;
    req->moe_chunk_tokens = tp->moe_c > 0 ? tp->moe_c : 0;
    req->ce_block_tokens = o->ce_block_tokens > 0 ? o->ce_block_tokens : 0;
    req->ce_block_vocab = o->ce_block_vocab > 0 ? o->ce_block_vocab : 0;
    req->threads = o->threads;
    req->att_tile_q = o->att_tile_q;
    req->att_tile_kv = o->att_tile_kv;
    req->gpu_workspace = o->gpu_workspace;
    req->expert_fp8 = o->expert_fp8; /* the quantized copies in the expert live set */
    req->sp = sp > 1 ? sp : 1; /* activations of seq-len/sp tokens per sequence, the head-sharded attention buffers */
    /* --vocab-parallel ring: the linear CE (default blocks when neither flag is given), over the
     * W ranks when W > 1 (Ring-DTP's bound for the vocabulary live set) */
    tp->vocab_flag = o->vocab_parallel == FM_VOCAB_PARALLEL_RING;
    if (tp->vocab_flag && req->ce_block_tokens <= 0 && req->ce_block_vocab <= 0) {
        req->ce_block_tokens = FM_LCE_DEFAULT_BLOCK_TOKENS;
        req->ce_block_vocab = FM_LCE_DEFAULT_BLOCK_VOCAB;
    }
    req->vocab_ring = tp->vocab_flag && W > 1 ? W : 0;
    plan_state(tp, o, W);
    return FM_OK;
}

fm_status fm_train_plan_experts(fm_train_plan *tp, const fm_train_opts *o, const fm_expert_ask *eask,
                                const fm_calib *cal) {
    fm_plan_req *req = &tp->req;
    req->expert_fp8_codes = fm_expert_fp8_codes(req, eask); /* on E4M3 codes where the backend serves it */
    if (o->layout.expert_fp8_cache && !req->expert_fp8_codes) {
        char why[320];
        fm_expert_fp8_codes_why(req, eask, why, sizeof why);
        return fm_error(FM_ERR_ARG, "--fp8-weight-cache keeps the E4M3 weight codes of --expert-precision fp8's fast path, "
                        "but %s%s; drop --fp8-weight-cache", o->expert_fp8 ? "this run's fp8 experts are emulated, since " : "",
                        why);
    }
    req->expert_fp8_cache_auto = req->expert_fp8_codes && !o->layout.expert_fp8_cache && !o->no_fp8_weight_cache;
    fm_expert_choice_prepare(req, eask, cal); /* the chooser weighs each candidate at its faster form */
    return FM_OK;
}

fm_choose_opts fm_train_plan_choose_opts(const fm_train_plan *tp, const fm_train_opts *o, size_t budget,
                                         const char *budget_name, size_t host_budget, const char *host_budget_name,
                                         const fm_calib *cal) {
    const fm_choose_opts co = {budget, budget_name, host_budget, host_budget_name, cal, o->recompute != NULL,
                               o->recompute_keep_attention || o->no_recompute_keep_attention,
                               o->offload_boundaries != NULL,
                               /* --ep or a bf16 recipe: no streamed AdamW (it keeps an fp32 master) */
                               o->offload_optimizer || tp->ep > 1 || o->master_weights != FM_MASTER_FP32,
                               tp->moe_c >= 0, o->ce_block_tokens >= 0 || o->ce_block_vocab >= 0 || tp->vocab_flag,
                               o->optimizer_offload_fraction > 0};
    return co;
}
