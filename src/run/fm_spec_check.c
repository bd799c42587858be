/* Every cross-flag rule of the run spec, in one function (fm_spec_check.h), for train and plan
 * alike. The trainer's own rules (those a library caller of fm_train needs too) are
 * fm_train_opts_check_flags (train/fm_train_opts.c), called from here. */
#include <stdio.h>

#include "fm_spec_check.h"

fm_status fm_spec_check(const fm_run_spec *s) {
    fm_train_opts o = fm_spec_train_opts(s);
    /* the values themselves (fm_spec_train_opts zeroes the shape a --resume takes from the run) */
    o.steps = s->train.steps, o.seq_len = s->train.seq_len, o.micro_batch = s->train.micro_batch;
    o.grad_accum = s->train.grad_accum;
    const bool plan = s->cmd & FM_CMD_PLAN;
    if (plan && !fm_spec_given(s, "config")) return fm_error(FM_ERR_ARG, "--config is required");
    if (plan && (s->train.seq_len < 1 || s->train.micro_batch < 1 || s->train.grad_accum < 1))
        return fm_error(FM_ERR_ARG, "--seq-len (required), --micro-batch and --grad-accum must be >= 1");
    /* the memory knobs: given, >= 0 (not given: chosen under a budget, else 0) */
    const char *mem[3] = {"moe-chunk-tokens", "ce-block-tokens", "ce-block-vocab"};
    const int64_t memv[3] = {s->train.moe_chunk_tokens, s->train.ce_block_tokens, s->train.ce_block_vocab};
    for (int i = 0; i < 3; i++)
        if (fm_spec_given(s, mem[i]) && memv[i] < 0)
            return fm_error(FM_ERR_ARG, "--moe-chunk-tokens, --ce-block-tokens and --ce-block-vocab must be >= 0, found "
                            "%lld", (long long)memv[i]);
    /* given: in (0, 1] (not given is -1 in the trainer's options: fm_train_opts_check_flags) */
    const double F = s->train.optimizer_offload_fraction;
    if (fm_spec_given(s, "optimizer-offload-fraction") && !(F > 0 && F <= 1))
        return fm_error(FM_ERR_ARG, "--optimizer-offload-fraction must be in (0, 1] (the share of the optimizer's "
                        "buckets streamed from the host; 1 = all), found %g; leave it out to let the plan choose", F);
    if (fm_spec_given(s, "mem-budget") && s->train.mem_budget == 0)
        return fm_error(FM_ERR_ARG, "--mem-budget must be > 0 (omit it for no budget)");
    if (plan && fm_spec_given(s, "device-mem") && fm_spec_given(s, "mem-budget"))
        return fm_error(FM_ERR_ARG, "give --device-mem (the device's memory) or --mem-budget (the planned sets' budget), "
                        "not both");
    const int64_t K = s->library.logprobs_topk;
    if (K != 0 && !s->library.session && !s->library.plan)
        return fm_error(FM_ERR_ARG, "--logprobs-topk %lld: the option of a library session (flatmoe_open, "
                        "include/flatmoe.h), whose log-probs calls return the top-k; `flatmoe train` returns none: drop "
                        "it (`flatmoe plan --library` plans a session with it)", (long long)K);
    if (s->library.kv_cache && !s->library.session && !s->library.plan)
        return fm_error(FM_ERR_ARG, "--kv-cache: the option of a library session's flatmoe_generate (flatmoe_open, "
                        "include/flatmoe.h); `flatmoe train` samples nothing: drop it (`flatmoe plan --library` plans a "
                        "session with it)");
    if (K < 0 || K > FM_SPEC_TOPK_MAX)
        return fm_error(FM_ERR_ARG, "flatmoe_open: --logprobs-topk %lld; expected an integer 0 .. %d (the most top-k "
                        "log-probs per token flatmoe_logprobs_ex may ask for; 0: none)", (long long)K, FM_SPEC_TOPK_MAX);
    if (s->train.threads < 0) return fm_error(FM_ERR_ARG, "--threads must be >= 0 (0 = all cores)");
    if (plan) { /* the mesh's degrees given must be >= 1 (train refuses --ep 0 and --sp 0 too) */
        const char *names[5] = {"world", "dp", "ep", "sp", "gpus-per-node"};
        const int64_t vals[5] = {s->planner.world, s->train.dp, s->train.ep, s->train.sp, s->planner.gpus_per_node};
        for (int i = 0; i < 5; i++)
            if (fm_spec_given(s, names[i]) && vals[i] < 1)
                return fm_error(FM_ERR_ARG, "the mesh's degrees must be >= 1 (or left out), found --%s %lld; give a "
                                "positive value or leave the flag out", names[i], (long long)vals[i]);
    }
    return fm_train_opts_check_flags(&o, plan ? FM_TRAIN_CHECK_PLAN : FM_TRAIN_CHECK_TRAIN);
}
