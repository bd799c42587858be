/* Every rank of a launch must train with the same flags (fm_train_agree.h). */
#include "fm_train_agree.h"

#include <stdio.h>
#include <string.h>

/* FNV-1a of a string (NULL: 0), so that string flags compare as one value. */
static int64_t str_hash(const char *s) {
    if (!s) return 0;
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return (int64_t)(h >> 1);
}

static int64_t f64_bits(double v) {
    int64_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

/* The FNV-1a hashes of a list of strings, combined in order (a list of data files). */
static int64_t list_hash(const char *const *list, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = (h ^ (uint64_t)str_hash(list[i])) * 1099511628211ull;
    return (int64_t)(h >> 1);
}

enum { K_INT = 0, K_F64 = 1, K_HASH = 2 }; /* how a value compares and prints */

fm_status fm_train_agree(const fm_comm *world, const fm_train_opts *o, const fm_config *c) {
    if (!world || fm_comm_size(world) == 1) return FM_OK;
    /* The flags that shape the run or decide which collectives a step runs (evaluation, checkpoints,
     * the stop), the data, and the config's values that make the model: a difference would hang or
     * break a collective, or train a different model on each rank. */
    const struct { const char *name; int kind; int64_t v; } f[] = {
        {"--seq-len", K_INT, o->seq_len}, {"--micro-batch", K_INT, o->micro_batch}, {"--grad-accum", K_INT, o->grad_accum},
        {"--steps", K_INT, o->steps}, {"--seed", K_INT, (int64_t)(o->seed >> 1)}, {"--dp", K_INT, o->dp},
        {"--ep", K_INT, o->ep}, {"--sp", K_INT, o->sp}, {"--zero", K_INT, o->zero},
        {"--moe-chunk-tokens", K_INT, o->moe_chunk_tokens}, {"--ce-block-tokens", K_INT, o->ce_block_tokens},
        {"--ce-block-vocab", K_INT, o->ce_block_vocab}, {"--mem-budget", K_INT, (int64_t)o->mem_budget},
        {"--offload-optimizer", K_INT, o->offload_optimizer}, {"--offload-boundaries", K_HASH, str_hash(o->offload_boundaries)},
        {"--recompute", K_HASH, str_hash(o->recompute)}, {"--bf16-moments", K_INT, o->bf16_moments},
        {"--expert-precision", K_INT, o->expert_fp8}, {"--fp8-weight-cache", K_INT, o->layout.expert_fp8_cache},
        {"--no-fp8-weight-cache", K_INT, o->no_fp8_weight_cache},
        {"--lr", K_F64, f64_bits(o->lr)}, {"--min-lr", K_F64, f64_bits(o->min_lr)}, {"--warmup", K_INT, o->warmup},
        {"--weight-decay", K_F64, f64_bits(o->weight_decay)}, {"--grad-clip", K_F64, f64_bits(o->grad_clip)},
        {"--ep-cap-tokens", K_INT, o->ep_cap_tokens}, {"--llep", K_INT, o->llep},
        {"the config's hidden_size", K_INT, c->hidden_size}, {"the config's num_hidden_layers", K_INT, c->num_hidden_layers},
        {"the config's num_experts", K_INT, c->num_experts}, {"the config's vocab_size", K_INT, c->vocab_size},
        {"--vocab-parallel", K_INT, o->vocab_parallel},
        {"--eval-every", K_INT, o->eval_every}, {"--eval-batches", K_INT, o->eval_batches},
        {"--save-every", K_INT, o->save_every}, {"--save-every-minutes", K_F64, f64_bits(o->save_every_minutes)},
        {"--exit-after", K_INT, o->exit_after}, {"--no-checkpoint", K_INT, o->no_checkpoint},
        {"--data (the file list)", K_HASH, list_hash(o->data, o->n_data)},
        {"--val-data (the file list)", K_HASH, list_hash(o->val_data, o->n_val_data)},
        {"--val-fraction", K_F64, f64_bits(o->val_fraction)},
        {"the config's moe_intermediate_size", K_INT, c->moe_intermediate_size},
        {"the config's num_experts_per_tok", K_INT, c->num_experts_per_tok},
        {"the config's num_attention_heads", K_INT, c->num_attention_heads},
        {"the config's rope_theta", K_F64, f64_bits(c->rope_theta)},
        {"the config's router_aux_loss_coef", K_F64, f64_bits(c->router_aux_loss_coef)},
        {"the config's router_z_loss_coef", K_F64, f64_bits(c->router_z_loss_coef)},
        {"the config's attention_bias", K_INT, (int64_t)c->attention_bias + 2 * (int64_t)c->attention_o_bias},
        {"the config's partial_rotary_factor", K_F64, f64_bits(c->partial_rotary_factor)},
        {"the config's rope_scaling type", K_INT, (int64_t)c->rope_scaling.type},
        {"the config's rope_scaling factor", K_F64, f64_bits(c->rope_scaling.factor)},
    };
    enum { N = sizeof f / sizeof f[0] };
    int64_t v[2 * N], mine[N];
    for (int i = 0; i < N; i++) mine[i] = v[i] = f[i].v, v[N + i] = ~f[i].v; /* max of ~x is ~min x */
    FM_TRY(fm_comm_allreduce_max_i64(world, v, 2 * N, 0));
    for (int i = 0; i < N; i++) {
        const int64_t mx = v[i], mn = ~v[N + i];
        if (mx == mn) continue;
        char mine_s[64], lo[64], hi[64];
        const int64_t vals[3] = {mine[i], mn, mx};
        char *out[3] = {mine_s, lo, hi};
        for (int j = 0; j < 3; j++) {
            double d;
            memcpy(&d, &vals[j], sizeof d);
            if (f[i].kind == K_F64) snprintf(out[j], 64, "%.17g", d);
            else if (f[i].kind == K_HASH) snprintf(out[j], 64, "hash %llx", (unsigned long long)vals[j]);
            else snprintf(out[j], 64, "%lld", (long long)(i == 4 ? vals[j] << 1 : vals[j]));
        }
        if (i == 4) snprintf(mine_s, sizeof mine_s, "%llu", (unsigned long long)o->seed); /* as given, lowest bit too */
        return fm_error(FM_ERR_ARG, "rank %d of %d: %s differs between the ranks of this launch (this rank's value %s; "
                        "the ranks' values span %s to %s%s); every rank must be started with the same flags, data "
                        "and config", fm_comm_rank(world), fm_comm_size(world), f[i].name, mine_s, lo, hi,
                        i == 4 ? ", seeds compared and shown without their lowest bit" : "");
    }
    return FM_OK;
}
