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

fm_status fm_train_agree(const fm_comm *world, const fm_train_opts *o, const fm_config *c) {
    if (!world || fm_comm_size(world) == 1) return FM_OK;
    const char *names[] = {"--seq-len", "--micro-batch", "--grad-accum", "--steps", "--seed", "--dp", "--ep", "--sp",
                           "--zero", "--moe-chunk-tokens", "--ce-block-tokens", "--ce-block-vocab", "--mem-budget",
                           "--offload-optimizer", "--offload-boundaries", "--recompute", "--bf16-moments", "--lr",
                           "--min-lr", "--warmup", "--weight-decay", "--grad-clip", "--ep-cap-tokens", "--llep",
                           "the config's hidden_size", "the config's num_hidden_layers", "the config's num_experts",
                           "the config's vocab_size", "--vocab-parallel"};
    enum { N = sizeof names / sizeof names[0] };
    int64_t v[2 * N] = {o->seq_len, o->micro_batch, o->grad_accum, o->steps, (int64_t)(o->seed >> 1), o->dp, o->ep,
                        o->sp, o->zero, o->moe_chunk_tokens, o->ce_block_tokens, o->ce_block_vocab,
                        (int64_t)o->mem_budget, o->offload_optimizer, str_hash(o->offload_boundaries),
                        str_hash(o->recompute), o->bf16_moments, f64_bits(o->lr), f64_bits(o->min_lr), o->warmup,
                        f64_bits(o->weight_decay), f64_bits(o->grad_clip), o->ep_cap_tokens, o->llep,
                        c->hidden_size, c->num_hidden_layers, c->num_experts, c->vocab_size, o->vocab_parallel};
    int64_t mine[N];
    memcpy(mine, v, sizeof mine);
    for (int i = 0; i < N; i++) v[N + i] = ~v[i]; /* max of ~x is ~min x (order-reversing, no overflow) */
    FM_TRY(fm_comm_allreduce_max_i64(world, v, 2 * N, 0));
    for (int i = 0; i < N; i++) {
        const int64_t mx = v[i], mn = ~v[N + i];
        if (mx != mn)
            return fm_error(FM_ERR_ARG, "rank %d of %d: %s differs between the ranks of this launch (this rank's value "
                            "%s %lld; the ranks span %lld to %lld%s); every rank must be started with the same flags "
                            "and config", fm_comm_rank(world), fm_comm_size(world), names[i],
                            mine[i] == mx ? "is the largest," : mine[i] == mn ? "is the smallest," : "lies between,",
                            (long long)mine[i], (long long)mn, (long long)mx,
                            i == 4 || i == 14 || i == 15 || (i >= 17 && i <= 21 && i != 19) ? ", as bits or a hash" : "");
    }
    return FM_OK;
}
