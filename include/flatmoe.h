/* libflatmoe: flatmoe as the trainer of an RL loop (issue 29; docs/rl.md). A session holds one
 * model, its optimizer and the plan that bounds every memory peak; a caller hands it packed
 * batches of sequences and gets per-token log-probs and entropies, or an optimizer step on a
 * policy-gradient (or SFT) loss. The vocabulary projection is the linear cross-entropy
 * (src/bounded/fm_linear_ce.h): the N x V logits are never held.
 *
 * Conventions: every function returns an int status, FLATMOE_OK (0) or an error code below, and
 * flatmoe_last_error() gives the message of the last error on this thread (it names the input,
 * the value expected and found, and the fix). Arrays are the caller's host memory, C order.
 * One session is used by one thread at a time. The static library (libflatmoe.a) and the shared
 * one (libflatmoe.so) hold the same functions; python/flatmoe binds the shared one. */
#ifndef FLATMOE_H
#define FLATMOE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes (the engine's fm_status values). */
enum {
    FLATMOE_OK = 0,
    FLATMOE_ERR_ARG = 1,         /* a bad option or argument (the message names it) */
    FLATMOE_ERR_IO = 2,          /* a file could not be read */
    FLATMOE_ERR_FORMAT = 3,      /* a file's contents are malformed */
    FLATMOE_ERR_CONFIG = 4,      /* a model config is inconsistent or unsupported */
    FLATMOE_ERR_NOMEM = 5,       /* an allocation failed, or the plan does not fit the budget */
    FLATMOE_ERR_NUMERIC = 6,     /* a loss or gradient norm is not finite (the weights are not updated) */
    FLATMOE_ERR_UNSUPPORTED = 7, /* a valid request this build or slice cannot serve */
};

typedef struct flatmoe_session flatmoe_session;

/* The layout of the structs below (flatmoe_info, flatmoe_batch, flatmoe_loss_spec,
 * flatmoe_step_stats). They grow only at their end, and each growth raises this number; a program
 * (or a binding such as python/flatmoe) must use the header of the library it loads: check
 * flatmoe_abi_version() == FLATMOE_ABI_VERSION before the first call that takes a struct, and
 * zero-initialize the structs ({0}, or memset) so that fields it does not know are NULL / 0.
 * 1: the first slice; 2: flatmoe_info's num_moe_layers and top_k, flatmoe_batch's routed_experts,
 * flatmoe_loss_spec's entropy_coef. */
#define FLATMOE_ABI_VERSION 2
int flatmoe_abi_version(void);

/* The message of the last error on this thread ("" if none); valid until the next call. */
const char *flatmoe_last_error(void);

/* Opens a session from options spelled as `flatmoe train`'s flags (argv-like, without a program
 * name: {"--init-from", "DIR", "--seq-len", "512", ...}), parsed by the run spec's own flag table
 * (src/run/fm_spec_flags.c) with train's defaults (and, with --init-from, its fine-tuning
 * defaults). The model comes from one of:
 *   --init-from DIR   a Hugging Face folder (config.json, model.safetensors or its index)
 *   --ckpt DIR        a flatmoe checkpoint (or run folder: its latest), optimizer state included
 *   --config FILE     a config.json, weights drawn from --seed
 * The token budget of a batch is --micro-batch x --seq-len (the plan's shape). The vocabulary
 * projection is the linear cross-entropy (--ce-block-tokens/--ce-block-vocab: given, or 1024 x
 * 4096). --backend cpu|cuda, when given, must be this library's backend. The plan is made and
 * checked (against --mem-budget, or the GPU's free memory) before anything is allocated, with
 * train's refusal messages. Not in this slice (FLATMOE_ERR_UNSUPPORTED or FLATMOE_ERR_ARG, named):
 * several ranks, --vocab-parallel ring, plain logits (--ce-block-tokens 0 --ce-block-vocab 0).
 * *out gets the session (NULL on error). Its log lines (the plan, the weights loaded; none with
 * --quiet) go to the callback of flatmoe_set_log, or nowhere.
 * --logprobs-topk K (0 .. FLATMOE_TOPK_MAX, default 0), the session's own option: the most top-k
 * log-probs per token flatmoe_logprobs_ex may ask for (their buffers are planned). */
int flatmoe_open(flatmoe_session **out, int argc, const char *const *argv);

/* Where the library's log lines go: fn(user, level, text) with level 0 info, 1 note, 2 warning, 3
 * error and text one line ending in a newline; fn NULL: nowhere (the default). Process-wide (the
 * engine's one sink, src/core/fm_log.h); set it before flatmoe_open. */
typedef void (*flatmoe_log_fn)(void *user, int level, const char *text);
void flatmoe_set_log(flatmoe_log_fn fn, void *user);

/* Frees the session and everything it holds. NULL is a no-op. */
void flatmoe_close(flatmoe_session *s);

/* What a session was opened with. */
typedef struct flatmoe_info {
    int64_t vocab_size;   /* token ids are in [0, vocab_size) */
    int64_t micro_batch;  /* rows of the packed batch (--micro-batch) */
    int64_t seq_len;      /* tokens per row (--seq-len): no sequence may be longer */
    int64_t token_budget; /* micro_batch x seq_len: the most tokens one batch holds */
    int64_t num_layers, num_experts, hidden_size;
    int64_t step;         /* optimizer steps taken (a --ckpt session starts at its checkpoint's) */
    int64_t num_moe_layers; /* the MoE layers (the routes' second axis; dense layers have no routes) */
    int64_t top_k;        /* experts per token (num_experts_per_tok: the routes' third axis) */
} flatmoe_info;
int flatmoe_get_info(const flatmoe_session *s, flatmoe_info *out);

/* A packed batch: n_seqs sequences (documents; e.g. prompt + response) of seq_lens[i] >= 1 tokens,
 * concatenated into tokens [n_tokens]. Each sequence attends only within itself and its positions
 * restart at 0 (packed as issue 28's documents: first fit, in order, into micro_batch rows of
 * seq_len; a sequence longer than seq_len, or sequences that do not fit the rows, are refused
 * naming the budget). Token t's log-prob is log p(tokens[t] | the tokens before it in its
 * sequence); a sequence's first token has none (0 is written there, and it is never in the loss).
 * Per-token arrays are [n_tokens], NULL when absent. */
typedef struct flatmoe_batch {
    int64_t n_tokens;
    const int32_t *tokens;           /* [n_tokens] ids in [0, vocab_size) */
    int64_t n_seqs;
    const int64_t *seq_lens;         /* [n_seqs], each >= 1, summing to n_tokens */
    const uint8_t *loss_mask;        /* 1: the token is in the loss (a response token); NULL: every
                                        token but each sequence's first */
    const float *advantages;         /* A_t (policy-gradient losses: required) */
    const float *old_logprobs;       /* the behaviour policy's log-probs (the PPO ratio's
                                        denominator); NULL: the current ones, detached (ratio 1) */
    const float *rollout_logprobs;   /* the rollout engine's log-probs (truncated importance
                                        sampling; required when tis_cap > 0) */
    const float *ref_logprobs;       /* the reference model's log-probs (required when kl != NONE) */
    /* Routing replay (R3; ABI 2): [n_tokens, num_moe_layers, top_k] int32, the experts each token
     * was routed to in each MoE layer (model order; dense layers have no entry) by the rollout
     * engine (vLLM's and SGLang's routed experts, slime's --use-rollout-routing-replay), or by
     * flatmoe_logprobs_ex's routed_experts. NULL: every MoE layer routes by its own top-k. Given,
     * every MoE layer uses these experts instead of its own top-k, in the given order, in the
     * forward (log-probs, train step) and in any recompute; their gate weights are the CURRENT
     * router's probabilities of these experts (softmax over all experts, then, with the config's
     * norm_topk_prob, divided by their sum, exactly as the router weighs its own choice), so the
     * router keeps learning through the gates and replaying the router's own routes is
     * bit-identical to no replay. The router's load-balancing and z losses count the replayed
     * routes. The dispatch bound is unchanged (it holds for any routing: a replayed route is one
     * more). Each id must be in [0, num_experts) and a token's top_k ids distinct (else
     * FLATMOE_ERR_ARG naming the token, the MoE layer and the value). */
    const int32_t *routed_experts;
} flatmoe_batch;

/* Per-token log-probs and entropies of the batch under the session's current weights (a forward
 * only: no gradient, no update). logprobs [n_tokens] fp32 (nats; 0 at each sequence's first token);
 * entropy [n_tokens] fp32 or NULL: the entropy (nats) of the distribution that predicted token t,
 * H = lse - sum_v p_v z_v, formed beside the log-sum-exp in the linear CE's blocks (0 at each
 * sequence's first token). Equal bit for bit to the per-token loss, negated, of the model's
 * evaluation forward (`flatmoe eval`'s) with the same linear-CE blocks.
 * Errors: FLATMOE_ERR_ARG naming the bad field (a token out of range, lengths that do not sum,
 * a batch over the token budget). */
int flatmoe_logprobs(flatmoe_session *s, const flatmoe_batch *b, float *logprobs, float *entropy);

/* The most top-k log-probs per token a session may be opened for (--logprobs-topk K). */
#define FLATMOE_TOPK_MAX 64

/* flatmoe_logprobs with more outputs (each NULL when not wanted):
 * routed_experts [n_tokens, num_moe_layers, top_k] int32: the experts token t was routed to in each
 * MoE layer (model order; dense layers have no entry; each token's ids in the router's order,
 * decreasing probability, ties to the lower id), the rollout engine's format (vLLM / SGLang
 * return routed experts the same way), ready to hand back as flatmoe_batch.routed_experts; with
 * the batch's routed_experts given, they are those. Every token has routes, each sequence's first
 * too (its routes are the router's on that token as input).
 * topk (0 .. the session's --logprobs-topk K; 0: none), topk_logprobs [n_tokens, topk] fp32,
 * topk_ids [n_tokens, topk] int32: the topk largest log-probs (nats, decreasing; ties to the lower
 * id) of the distribution that predicted token t, and their token ids (NeMo-RL's / vLLM's top-k
 * log-probs), formed in the linear CE's vocabulary blocks from a running top-k of the logits
 * (never N x V) and log p = logit - lse exactly as the token's log-prob is (where a top id is the
 * token, its log-prob bits); each sequence's first token gets -inf and id -1. A session opened
 * without --logprobs-topk has K = 0 (the buffers are planned at open: [budget, K] fp32 and int32,
 * and a running top-K per token block).
 * Errors: flatmoe_logprobs's; FLATMOE_ERR_ARG for topk outside 0 .. K or topk > 0 with an output
 * NULL. */
int flatmoe_logprobs_ex(flatmoe_session *s, const flatmoe_batch *b, float *logprobs, float *entropy,
                        int32_t *routed_experts, int64_t topk, float *topk_logprobs, int32_t *topk_ids);

/* The loss of a train step. */
enum { FLATMOE_LOSS_SFT = 0, FLATMOE_LOSS_PG = 1 };
/* How per-token losses become one (verl's loss_agg_mode). M: the loss tokens; S: the sequences
 * with at least one loss token; M_s: sequence s's loss tokens. */
enum {
    FLATMOE_AGG_TOKEN_MEAN = 0,          /* sum_t l_t / |M| */
    FLATMOE_AGG_SEQ_MEAN_TOKEN_SUM = 1,  /* (1/|S|) sum_s sum_{t in M_s} l_t (Dr. GRPO's) */
    FLATMOE_AGG_SEQ_MEAN_TOKEN_MEAN = 2, /* (1/|S|) sum_s (1/|M_s|) sum_{t in M_s} l_t (GRPO's) */
};
enum { FLATMOE_KL_NONE = 0, FLATMOE_KL_K1 = 1, FLATMOE_KL_K3 = 2 };

/* The loss of flatmoe_train_step; docs/rl.md gives each formula and its source.
 * SFT: l_t = -log p_t (the cross-entropy of `flatmoe train`, whose step it equals with token-mean).
 * PG: the clipped surrogate, r_t = exp(log p_t - old_t),
 *   l_t = max(-r_t A_t, -clip(r_t, 1 - clip_low, 1 + clip_high) A_t)        (PPO; DAPO's clip-higher)
 *   dual clip (clip_dual = c > 1): for A_t < 0, l_t = min(l_t, -c A_t)
 *   truncated IS (tis_cap = C > 0): l_t *= min(exp(old_t - rollout_t), C), the weight detached
 *   KL (kl = K1 | K3): l_t += kl_coef * k(log p_t, ref_t)
 *   entropy bonus (entropy_coef = c; ABI 2): l_t -= c * H_t, H_t the entropy (nats) of the
 *     distribution that predicted token t (verl's actor: pg_loss - entropy_coeff * agg(entropy));
 *     its gradient flows through the logits: dH_t/dz_v = -p_v (log p_v + H_t)
 * The MoE router's auxiliary losses are added as `flatmoe train` adds them. */
typedef struct flatmoe_loss_spec {
    int loss;          /* FLATMOE_LOSS_* */
    int agg;           /* FLATMOE_AGG_* */
    double clip_low;   /* eps_low >= 0 (PPO 0.2) */
    double clip_high;  /* eps_high >= 0 (PPO 0.2; DAPO 0.28) */
    double clip_dual;  /* c > 1, or 0: off (verl's clip_ratio_c, 3) */
    double tis_cap;    /* C > 0, or 0: off (2) */
    int kl;            /* FLATMOE_KL_* */
    double kl_coef;    /* beta >= 0 */
    double entropy_coef; /* c, finite (verl's entropy_coeff; 0: off); ABI 2 */
} flatmoe_loss_spec;

/* A spec with defaults: SFT, token-mean, clip 0.2 / 0.2, no dual clip, no TIS, no KL. */
flatmoe_loss_spec flatmoe_loss_spec_default(void);

/* What a train step measured (over the loss tokens M). */
typedef struct flatmoe_step_stats {
    double loss;          /* the aggregated loss (pg + kl - entropy_coef x entropy terms), without the router's */
    double pg_loss;       /* the aggregated policy (or SFT) term alone */
    double kl;            /* mean of k(log p, ref) over M (0 without KL) */
    double entropy;       /* mean entropy over M (nats) */
    double ratio_mean;    /* mean r_t over M (1 for SFT) */
    double clip_frac;     /* share of M whose gradient the clip removed (either side) */
    double clip_frac_low, clip_frac_high; /* r_t < 1 - clip_low with A_t < 0; r_t > 1 + clip_high with A_t > 0 */
    double dual_clip_frac;/* share of M held at -c A_t by the dual clip */
    double tis_mean;      /* mean truncated IS weight (1 without TIS) */
    double router_aux, router_z; /* the MoE router's losses, as `flatmoe train` reports them */
    double grad_norm;     /* global L2 norm before clipping (--grad-clip) */
    double lr;            /* the learning rate of the update */
    int64_t n_loss_tokens, n_loss_seqs, step;
} flatmoe_step_stats;

/* One optimizer step on the batch: a forward (the current log-probs and entropies), the per-token
 * coefficients dL/dlog p_t of the loss (host, fp64), then the backward through the linear CE with
 * those coefficients as token weights (the gradient wrt the logits of token t is c_t (onehot - p)),
 * the global-norm clip and the AdamW update at the learning rate of train's schedule (--lr,
 * --warmup, --steps, --min-lr) for the session's next step. out (may be NULL) gets the statistics.
 * Errors: FLATMOE_ERR_ARG naming the field (as flatmoe_logprobs, an array the spec needs missing,
 * a spec value out of range, a batch with no loss token); FLATMOE_ERR_NUMERIC when the loss or the
 * gradient norm is not finite (the weights are then not updated). */
int flatmoe_train_step(flatmoe_session *s, const flatmoe_batch *b, const flatmoe_loss_spec *spec,
                       flatmoe_step_stats *out);

#ifdef __cplusplus
}
#endif
#endif
