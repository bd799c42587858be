/* fm_train_opts: the defaults (the CLI's help texts name the same values) and the checks that
 * need no file. */
#include <math.h>
#include <string.h>

#include "fm_train_internal.h"

void fm_train_opts_default(fm_train_opts *o) {
    memset(o, 0, sizeof *o);
    o->backend = fm_backend_opts_default();
    o->val_fraction = 0.1;
    o->seq_len = 128;
    o->micro_batch = 16;
    o->grad_accum = 1;
    o->steps = 1000;
    o->lr = 2e-3;
    o->min_lr = 2e-4;
    o->warmup = 50;
    o->weight_decay = 0.1;
    o->grad_clip = 1.0;
    o->beta1 = 0.9;
    o->beta2 = 0.95;
    o->adam_eps = 1e-8;
    o->seed = 1337;
    o->threads = 0;
    o->out_dir = "runs/tiny";
    o->eval_every = 250;
    o->eval_batches = 20;
    o->save_every = 1000;
    o->save_every_minutes = 30;
    o->ep = 1;
    o->sp = 1;
    o->llep_lambda = 1.3;
    o->llep_min_piece = 1024;
    o->expert_counts_every = 100;
    o->peak_flops = 0;
    o->log_every = 1;
    o->recompute = NULL;
    o->recompute_keep_attention = false;
    o->moe_chunk_tokens = -1;
    o->ce_block_tokens = -1;
    o->ce_block_vocab = -1;
    o->offload_optimizer_bucket = 0;
    o->offload_optimizer_slots = 2;
    o->optimizer_offload_fraction = -1;
}

fm_status fm_train_opts_check(const fm_train_opts *o) {
    if (o->n_data < 1) return fm_error(FM_ERR_ARG, "--data: give at least one text file or llm.c token shard");
    if (!o->out_dir || !*o->out_dir) return fm_error(FM_ERR_ARG, "--out: give a run folder");
    return fm_train_opts_check_flags(o, FM_TRAIN_CHECK_TRAIN);
}

fm_status fm_train_opts_check_flags(const fm_train_opts *o, fm_train_check_for what) {
    const bool train = what == FM_TRAIN_CHECK_TRAIN;
    if (o->layout.expert_fp8_cache && o->no_fp8_weight_cache)
        return fm_error(FM_ERR_ARG, "--fp8-weight-cache and --no-fp8-weight-cache both given: keep one, or neither "
                        "(then the planner keeps every layer's weight codes when its plan still fits with them)");
    if (o->no_fp8_weight_cache && !o->expert_fp8)
        return fm_error(FM_ERR_ARG, "--no-fp8-weight-cache is for --expert-precision fp8's weight codes, but "
                        "--expert-precision is bf16; drop --no-fp8-weight-cache (or pass --expert-precision fp8)");
    if (o->recompute_keep_attention && o->no_recompute_keep_attention)
        return fm_error(FM_ERR_ARG, "--recompute-keep-attention and --no-recompute-keep-attention: give one, not both");
    const char *shape_names[4] = {"--seq-len", "--micro-batch", "--grad-accum", "--steps"};
    const int64_t shape_vals[4] = {o->seq_len, o->micro_batch, o->grad_accum, o->steps};
    for (int i = 0; train && i < 4; i++)
        if (shape_vals[i] < 1)
            return fm_error(FM_ERR_ARG, "%s must be >= 1, found %lld (--seq-len, --micro-batch, --grad-accum and "
                            "--steps are counts of tokens, sequences, micro-batches and optimizer steps)",
                            shape_names[i], (long long)shape_vals[i]);
    if (!(o->lr > 0) || !isfinite(o->lr) || !(o->min_lr >= 0) || !(o->min_lr <= o->lr))
        return fm_error(FM_ERR_ARG, "--lr must be finite and > 0, and --min-lr in [0, lr] (found lr %g, min-lr %g)", o->lr,
                        o->min_lr);
    if (o->warmup < 0 || !(o->weight_decay >= 0) || !isfinite(o->weight_decay) || !(o->grad_clip >= 0) ||
        !isfinite(o->grad_clip))
        return fm_error(FM_ERR_ARG, "--warmup, --weight-decay and --grad-clip must be finite and >= 0 (found %lld, %g, %g)",
                        (long long)o->warmup, o->weight_decay, o->grad_clip);
    if (!(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1) || !(o->adam_eps > 0))
        return fm_error(FM_ERR_ARG, "--beta1 and --beta2 must be in [0, 1) (found %g, %g)", o->beta1, o->beta2);
    if (o->eval_every < 0 || o->eval_batches < 0 || o->save_every < 0 || o->log_every < 0 || o->exit_after < 0)
        return fm_error(FM_ERR_ARG, "--eval-every, --eval-batches, --save-every, --log-every and --exit-after must be >= 0");
    if (!(o->save_every_minutes >= 0) || !(o->peak_flops >= 0) || o->expert_counts_every < 0)
        return fm_error(FM_ERR_ARG, "--save-every-minutes, --peak-flops and --expert-counts-every must be >= 0 (found "
                        "%g, %g, %lld)", o->save_every_minutes, o->peak_flops, (long long)o->expert_counts_every);
    if (o->max_position_embeddings < 0 || o->max_position_embeddings > (1LL << 30))
        return fm_error(FM_ERR_ARG, "--max-position-embeddings must be in [1, 2^30] (0 keeps the config's), found %lld",
                        (long long)o->max_position_embeddings);
    if (o->att_tile_q < 0 || o->att_tile_q > 4096 || o->att_tile_kv < 0 || o->att_tile_kv > 4096)
        return fm_error(FM_ERR_ARG, "--attention-tile-q/-kv must be in [1, 4096] (0 = 64), found %lld x %lld",
                        (long long)o->att_tile_q, (long long)o->att_tile_kv);
    /* --ep / --sp 0 is not "off": say so rather than take it as 1 (fm_train_opts_default sets 1) */
    if (o->ep < 1) return fm_error(FM_ERR_ARG, "--ep must be >= 1 (expert-parallel ranks; 1 = off), found %d", o->ep);
    if (o->sp < 1) return fm_error(FM_ERR_ARG, "--sp must be >= 1 (sequence-parallel ranks; 1 = off), found %d", o->sp);
    if (o->no_checkpoint && o->exit_after > 0)
        return fm_error(FM_ERR_ARG, "--exit-after stops with a checkpoint to resume from, but --no-checkpoint writes "
                        "none; drop one of them");
    if (o->offload_optimizer_bucket < 0)
        return fm_error(FM_ERR_ARG, "--offload-optimizer-bucket must be >= 1 parameters (0 = 100M), found %lld",
                        (long long)o->offload_optimizer_bucket);
    if (o->offload_optimizer_slots < 1 || o->offload_optimizer_slots > 16)
        return fm_error(FM_ERR_ARG, "--offload-optimizer-slots must be in [1, 16], found %lld",
                        (long long)o->offload_optimizer_slots);
    if (o->optimizer_offload_fraction != -1 && !(o->optimizer_offload_fraction > 0 && o->optimizer_offload_fraction <= 1))
        return fm_error(FM_ERR_ARG, "--optimizer-offload-fraction must be in (0, 1] (the share of the optimizer's "
                        "buckets streamed from the host; 1 = all), found %g; leave it out to let the plan choose",
                        o->optimizer_offload_fraction);
    /* refused alone rather than implying the switch: a value flag never turns a mode on by itself
     * (a resume restores both flags; without --offload-optimizer the chooser decides whether the
     * optimizer streams at all, and a fraction of nothing means nothing) */
    if (o->optimizer_offload_fraction != -1 && !o->offload_optimizer)
        return fm_error(FM_ERR_ARG, "--optimizer-offload-fraction %g without --offload-optimizer: it is the share of "
                        "the streamed optimizer's buckets that stream; add --offload-optimizer, or drop the fraction "
                        "(the plan then chooses where the optimizer lives and how much of it streams)",
                        o->optimizer_offload_fraction);
    if (o->zero != 0 && o->zero != 1 && o->zero != 3)
        return fm_error(FM_ERR_ARG, "--zero must be 0 (replicas), 1 (optimizer state sharded over the dp x sp ranks) "
                        "or 3 (weights, gradients and optimizer state sharded over the dp x sp ranks), found %d", o->zero);
    if (o->sp < 0) return fm_error(FM_ERR_ARG, "--sp must be >= 1 (sequence-parallel ranks; 1 = off), found %d", o->sp);
    if (o->dp < 0) return fm_error(FM_ERR_ARG, "--dp must be >= 1 (0 = the number of ranks), found %d", o->dp);
    if (o->zero == 3 && o->offload_optimizer)
        return fm_error(FM_ERR_ARG, "--zero 3 and --offload-optimizer do not go together yet (the streamed AdamW "
                        "runs on the whole replica, ZeRO-3 keeps only a shard of it); drop one of them");
    if (o->zero && o->offload_optimizer)
        return fm_error(FM_ERR_ARG, "--zero 1 and --offload-optimizer do not go together yet (the streamed AdamW "
                        "runs on the whole replica); drop one of them");
    if (o->ep > 1 && o->zero == 1) /* --zero 3 beside --ep shards only the non-expert parameters (train/fm_zero3.h) */
        return fm_error(FM_ERR_ARG, "--zero 1 with --ep %d: ZeRO-1/2 shards the optimizer state over dp as if every "
                        "rank held the same tensors, but under expert parallelism each rank holds other experts; use "
                        "--zero 0 with --ep (each rank already keeps only E/ep experts' state), or --zero 3 (the "
                        "non-expert parameters sharded too, each rank's experts whole), or --ep 1", o->ep);
    if (o->ep > 1 && o->offload_optimizer)
        return fm_error(FM_ERR_ARG, "--offload-optimizer with --ep %d is not supported yet (the streamed AdamW's "
                        "bound counts every expert); drop one of them", o->ep);
    if (o->master_weights < FM_MASTER_FP32 || o->master_weights > FM_MASTER_BF16_SR)
        return fm_error(FM_ERR_ARG, "--master-weights: expected fp32, bf16-kahan or bf16-sr, found value %d",
                        o->master_weights);
    if (o->master_weights != FM_MASTER_FP32 && (o->offload_optimizer || o->zero == 3 || o->ep > 1))
        return fm_error(FM_ERR_ARG, "--master-weights %s with %s is not supported yet (the streamed AdamW and the "
                        "ZeRO-3 and expert-parallel stores keep an fp32 master); use --master-weights fp32 or drop %s",
                        fm_master_recipe_name((fm_master_recipe)o->master_weights),
                        o->offload_optimizer ? "--offload-optimizer" : o->zero == 3 ? "--zero 3" : "--ep",
                        o->offload_optimizer ? "--offload-optimizer" : o->zero == 3 ? "--zero 3" : "--ep");
    if (o->vocab_parallel != FM_VOCAB_PARALLEL_OFF && o->vocab_parallel != FM_VOCAB_PARALLEL_RING)
        return fm_error(FM_ERR_ARG, "--vocab-parallel: expected off or ring, found value %d", o->vocab_parallel);
    if (o->vocab_parallel == FM_VOCAB_PARALLEL_RING && o->ce_block_tokens == 0 && o->ce_block_vocab == 0)
        return fm_error(FM_ERR_ARG, "--vocab-parallel ring with --ce-block-tokens 0 --ce-block-vocab 0 (plain logits): "
                        "the ring is the linear cross-entropy over the ranks; give blocks > 0 or leave both flags out "
                        "(then 1024 x 4096)");
    if (o->pack < FM_PACK_AUTO || o->pack > FM_PACK_PAD)
        return fm_error(FM_ERR_ARG, "--pack: expected auto, on, off or pad, found value %d", o->pack);
    if (o->pack_long != FM_PACK_LONG_SPLIT && o->pack_long != FM_PACK_LONG_REFUSE)
        return fm_error(FM_ERR_ARG, "--pack-long: expected split or refuse, found value %d", o->pack_long);
    if (o->epochs < 0) return fm_error(FM_ERR_ARG, "--epochs must be >= 0 (0: --steps), found %lld", (long long)o->epochs);
    if (!(o->comm_timeout >= 0) || !isfinite(o->comm_timeout))
        return fm_error(FM_ERR_ARG, "--comm-timeout must be finite and >= 0 s (0 = 300), found %g", o->comm_timeout);
    if (train && !(o->val_fraction > 0 && o->val_fraction < 1) && o->n_val_data == 0)
        return fm_error(FM_ERR_ARG, "--val-fraction must be in (0, 1), found %g", o->val_fraction);
    return FM_OK;
}
