/* The planner's request of a training run, derived once from the trainer's options (the run
 * spec's train part, run/fm_run_spec.h) and used by `train` (fm_train_setup) and `plan` alike:
 * the same flags give the same request, and the same combinations are refused with the same
 * messages. The planner is plan/fm_plan.h; this file only translates the flags. */
#ifndef FM_TRAIN_PLAN_H
#define FM_TRAIN_PLAN_H

#include "../plan/fm_choose.h"
#include "../plan/fm_expert_choice.h"
#include "fm_trainer.h"

/* A request and what it points into (do not copy it once made: req points at rc and llep). */
typedef struct fm_train_plan {
    fm_plan_req req;
    bool *rc;             /* [2L]: recompute [L], keep-attention [L] (req.recompute, req.keep_attention) */
    fm_llep_opts llep;    /* --llep's options (req.llep under --ep) */
    int ep;               /* the expert-parallel degree (>= 1) */
    int64_t moe_c;        /* the chunk asked: --ep-cap-tokens under --ep when given, else --moe-chunk-tokens
                             (-1: chosen) */
    bool vocab_flag;      /* --vocab-parallel ring given */
} fm_train_plan;

/* Fills *tp for options o, config c (--max-position-embeddings applied), `world` ranks of the
 * trainer (dp x sp: train's launch, plan's --dp x --sp) of which sp are one sequence's
 * (sp >= 1), with target the backend planned for: the shape, recompute (--recompute,
 * --recompute-keep-attention), offload (--offload-boundaries, --offload-optimizer), the memory
 * knobs (0 where not given; the chooser picks them), the data-parallel layout of the model state
 * (ZeRO over world ranks; --ep: E/ep experts per rank, the capped dispatch), Ulysses (--sp),
 * Ring-DTP (--vocab-parallel ring over world ranks), the optimizer overlap, the "train flags"
 * line's --dp/--zero. Checks what needs the config or the world (fm_attn_sp_check,
 * fm_train_ep_check, fm_recompute_parse, fm_sco_parse). Errors: FM_ERR_ARG naming the flag, the
 * value and the fix; FM_ERR_NOMEM. Free with fm_train_plan_free. */
fm_status fm_train_plan_request(const fm_train_opts *o, const fm_config *c, int world, int sp, fm_plan_target target,
                                fm_train_plan *tp);
void fm_train_plan_free(fm_train_plan *tp);

/* --expert-precision fp8's path and weight cache for the backend eask describes: req.expert_fp8_codes
 * (fm_expert_fp8_codes), --fp8-weight-cache refused where the codes path does not run (naming
 * why), the cache given or left to the chooser; then fm_expert_choice_prepare with the rates cal.
 * Errors: FM_ERR_ARG. */
fm_status fm_train_plan_experts(fm_train_plan *tp, const fm_train_opts *o, const fm_expert_ask *eask,
                                const fm_calib *cal);

/* The chooser's options: the budgets (device bytes and its name, pinned host bytes and its name,
 * the rates) and which knobs the user fixed (given in o: recompute, keep-attention, offloaded
 * boundaries, the optimizer's placement (--ep keeps it on the device), the MoE chunk, the
 * vocabulary projection). Never fails. */
fm_choose_opts fm_train_plan_choose_opts(const fm_train_plan *tp, const fm_train_opts *o, size_t budget,
                                         const char *budget_name, size_t host_budget, const char *host_budget_name,
                                         const fm_calib *cal);

#endif
