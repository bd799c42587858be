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
 * flatmoe_loss_spec's entropy_coef; 3: flatmoe_info's rank, n_ranks and ep. */
#define FLATMOE_ABI_VERSION 3
int flatmoe_abi_version(void);

/* The message of the last error on this thread ("" if none); valid until the next call. */
const char *flatmoe_last_error(void);

/* Opens a session from options spelled as `flatmoe train`'s flags (argv-like, without a program
 * name: {"--init-from", "DIR", "--seq-len", "512", ...}), parsed by the run spec's own flag table
 * (src/run/fm_spec_flags.c) with train's defaults (and, with --init-from, its fine-tuning
 * defaults). The model comes from one of:
 *   --init-from DIR   a Hugging Face folder (config.json, model.safetensors or its index)
 *   --ckpt DIR        a flatmoe checkpoint (or run folder: its latest), optimizer state included;
 *                     every flag not given again takes the run's value (state.json's spec, as
 *                     `train --resume`; not --data, --val-data, --grad-accum), so an --init-from
 *                     session's fine-tuning defaults and its schedule come back with it
 *   --config FILE     a config.json, weights drawn from --seed
 * The token budget of a batch is --micro-batch x --seq-len (the plan's shape). The vocabulary
 * projection is the linear cross-entropy (--ce-block-tokens/--ce-block-vocab: given, or 1024 x
 * 4096). --backend cpu|cuda, when given, must be this library's backend. The plan is made and
 * checked (against --mem-budget, or the GPU's free memory) before anything is allocated, with
 * train's refusal messages. Not in this slice (FLATMOE_ERR_UNSUPPORTED or FLATMOE_ERR_ARG, named):
 * --vocab-parallel ring, --sp, --zero 3, plain logits (--ce-block-tokens 0 --ce-block-vocab 0),
 * --moe-router-bias-update-rate other than 0 (a session's step does not move the bias). Every call
 * that runs the model sets the process's OpenMP and OpenBLAS thread counts to the session's
 * --threads first (process-wide: another session's count does not change this one's results).
 * *out gets the session (NULL on error). Its log lines (the plan, the weights loaded; none with
 * --quiet) go to the callback of flatmoe_set_log, or nowhere.
 * --logprobs-topk K (0 .. FLATMOE_TOPK_MAX, default 0; a flag-table row that `flatmoe train` refuses
 * non-zero), the session's own option: the most top-k
 * log-probs per token flatmoe_logprobs_ex may ask for (their buffers are planned). --kv-cache (a
 * flag-table row `flatmoe train` refuses), the session's own too: flatmoe_generate's key/value
 * cache, sized at open from the token budget (flatmoe_generate below). */
int flatmoe_open(flatmoe_session **out, int argc, const char *const *argv);

/* ---- many ranks (docs/rl.md "Many ranks") ------------------------------------------------------
 * Under mpirun/srun (the launcher's OMPI_COMM_WORLD_*, PMI_* or SLURM_* variables, handed over by
 * flatmoe_set_environment(environ) before flatmoe_open), every rank calls flatmoe_open with the
 * same options and becomes one rank of the session: data parallel over
 * the ranks (replicas, or --zero 1's sharded optimizer state), with --ep E the experts spread over
 * the ranks as `flatmoe train --ep` spreads them. --micro-batch is per rank (each rank's token
 * budget is --micro-batch x --seq-len), as in `flatmoe train`. MPI: the library calls
 * MPI_Init_thread (MPI_THREAD_FUNNELED) at flatmoe_open when the process has not initialized MPI
 * (a caller that did, e.g. through mpi4py, keeps its own); it never finalizes MPI on its own:
 * call flatmoe_finalize once after the last flatmoe_close (or MPI_Finalize, when the caller owns
 * MPI). Collective calls (every rank calls them, in the same order): flatmoe_open, flatmoe_close,
 * flatmoe_logprobs(_ex) and flatmoe_train_step (each rank with its own batch: its share of the
 * global batch), flatmoe_save (rank 0 writes the checkpoint), flatmoe_export_weights (rank 0's fn
 * receives every bucket; the other ranks' fn is never called). A rank whose batch is refused
 * returns its error and the others FLATMOE_ERR_ARG saying how many ranks refused; no rank runs
 * the call. Losses: the aggregation's denominators are every rank's (token-mean: the mean over ALL
 * ranks' loss tokens; the seq-mean modes: over all ranks' sequences, which lie whole on one rank),
 * so the gradients, summed over the ranks, are those of one rank on the whole batch, and each
 * rank's flatmoe_step_stats hold the global terms. Not across ranks yet (FLATMOE_ERR_UNSUPPORTED,
 * named): flatmoe_generate, flatmoe_sleep/wake, --sp, --zero 3, --vocab-parallel ring. */

/* Hands the library the process environment, envp as C's `environ` ("NAME=VALUE" strings, NULL
 * terminated; NULL: none), of which it keeps the launcher's variables (OMPI_COMM_WORLD_RANK/SIZE,
 * PMI_RANK/SIZE, SLURM_PROCID/NTASKS and the node-local ones; copied). The library reads no
 * environment behind its caller's back: without this call before flatmoe_open, a session is one
 * rank, under mpirun too. Process-wide. python/flatmoe calls it with os.environ. Errors:
 * FLATMOE_ERR_NOMEM. */
int flatmoe_set_environment(const char *const *envp);

/* MPI_Finalize when MPI is initialized and not yet finalized (else nothing): once, after the last
 * flatmoe_close, by a caller that let flatmoe_open initialize MPI. Errors: FLATMOE_ERR_IO. */
int flatmoe_finalize(void);

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
    int64_t rank, n_ranks; /* this process's rank of the session's ranks, and their number (ABI 3) */
    int64_t ep;           /* the expert-parallel degree (--ep; 1: off) (ABI 3) */
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

/* ---- save, weight export, sampling (issue 29's second slice; docs/rl.md) ---------------------- */

/* Saves the session as a `flatmoe train` checkpoint, through the trainer's own writer
 * (src/train/fm_train_ckpt.c): DIR/step_NNNNNN/ (NNNNNN the session's step, zero-padded to 6
 * digits) holding model.safetensors (fp32 weights under the Hugging Face names), optimizer.safetensors
 * (the fp32 master and AdamW's moments), config.json, state.json (the step, the optimizer's step,
 * the run spec: the options the session was opened with) and the tokenizer files of --init-from's
 * folder when it has them. Atomic: written as DIR/.tmp.step_NNNNNN/ and renamed when complete (an
 * existing step_NNNNNN is replaced only then); DIR is created if missing. A session opened with
 * --ckpt DIR (the run folder: its latest step) or --ckpt DIR/step_NNNNNN (the saved run spec gives
 * the options not given again; the invocation's --logprobs-topk, --kv-cache, --ep, --zero are not
 * saved: given again) continues bit for bit as if it had not stopped. Errors: FLATMOE_ERR_ARG (dir NULL or empty),
 * FLATMOE_ERR_IO naming the path (nothing of an earlier checkpoint is lost), FLATMOE_ERR_NOMEM. */
int flatmoe_save(flatmoe_session *s, const char *dir);

/* Dtypes of exported weights. */
enum { FLATMOE_DTYPE_F32 = 0, FLATMOE_DTYPE_BF16 = 1 };

/* One piece of one tensor in a bucket of flatmoe_export_weights. */
typedef struct flatmoe_weight_piece {
    const char *name;     /* the Hugging Face name (the checkpoint's model.safetensors'), NUL-terminated */
    int dtype;            /* FLATMOE_DTYPE_BF16 */
    int ndim;             /* 1 or 2 */
    int64_t shape[2];     /* the whole tensor's shape (row-major; shape[1] 0 when ndim is 1) */
    int64_t tensor_bytes; /* the whole tensor's bytes (elements x 2) */
    int64_t offset;       /* bytes into the whole tensor where this piece starts (even) */
    int64_t nbytes;       /* bytes of this piece (even, > 0) */
    const void *data;     /* the piece's bytes, little-endian bf16, inside the bucket */
} flatmoe_weight_piece;

/* Receives one bucket: n_pieces pieces whose data lie one after another in one buffer of at most
 * bucket_bytes bytes (valid only during the call). Returns 0 to go on; anything else stops the
 * export (flatmoe_export_weights then returns FLATMOE_ERR_IO naming the value and the bucket). */
typedef int (*flatmoe_bucket_fn)(void *user, const flatmoe_weight_piece *pieces, int n_pieces);

/* Streams the session's weights to fn in buckets, for an inference engine's weight update (verl's
 * per-tensor generator, slime's bucketed sync): every tensor of the checkpoint's model.safetensors,
 * in its order and under its names and shapes, as bf16 rounded to nearest even from the fp32
 * master (fm_f32_to_bf16, as the trainer narrows everywhere; equal to model.safetensors' values so
 * rounded). Filling: tensors in order; a tensor that fits in bucket_bytes always arrives whole in
 * one bucket (the bucket is sent first when the tensor does not fit in what is left of it); a
 * tensor larger than bucket_bytes is split across consecutive buckets, each piece filling its
 * bucket (floor(bucket_bytes / 2) elements) but the last, which later tensors may join. So
 * bucket_bytes >= the largest tensor's bytes sends every tensor whole; a huge bucket_bytes sends
 * one bucket. Memory: one host buffer of min(bucket_bytes, all tensors' bytes) and a table of
 * [tensors] pieces, allocated for the call and freed before it returns (plus the checkpoint
 * staging the session holds since open, through which the master is read: 8 x min(4 Mi, the
 * largest tensor) bytes); nothing on the device. An overlapped optimizer update still in flight
 * lands first. Errors: FLATMOE_ERR_ARG (bucket_bytes < 2: not one bf16 element; fn NULL),
 * FLATMOE_ERR_NOMEM (the bucket), FLATMOE_ERR_IO (fn returned non-zero). */
int flatmoe_export_weights(flatmoe_session *s, int64_t bucket_bytes, flatmoe_bucket_fn fn, void *user);

/* How flatmoe_generate samples. */
typedef struct flatmoe_sample_spec {
    int64_t max_new;      /* tokens to generate per prompt, >= 1 */
    double temperature;   /* >= 0; 0: greedy (the most likely token, the lowest id on ties) */
    int64_t top_k;        /* >= 0; 0: every token */
    double top_p;         /* in (0, 1]; 1: off (nucleus sampling: the smallest set of most likely
                             tokens whose probability reaches top_p, after top_k) */
    uint64_t seed;        /* the sampling RNG's seed: the same seed, weights and prompts give the
                             same completions */
    int32_t stop_token;   /* a completion ends after this token (kept in it); -1: none */
} flatmoe_sample_spec;

/* Defaults: max_new 16, temperature 1, top_k 0, top_p 1, seed 0, no stop token. */
flatmoe_sample_spec flatmoe_sample_spec_default(void);

/* Completions of n_prompts prompts (packed as a batch: prompt_lens [n_prompts], each >= 1,
 * prompts [sum prompt_lens] int32 concatenated), sampled together by the engine's sampler
 * (src/train/fm_sample.h fm_sample_pick: temperature, top-k; top-p added there): each of
 * max_new rounds packs every prompt with its completion so far as a flatmoe_batch (one sequence
 * each, first fit into the session's rows), runs one forward, forms the logits of each unfinished
 * sequence's last position from the final hidden state and the LM head in vocabulary blocks of
 * --ce-block-vocab (the linear CE's strip memory: no N x V logits), and draws its next token, the
 * sequences in order, from one RNG seeded with spec->seed. Every prompt plus max_new must fit the
 * token budget as flatmoe_logprobs packs it (checked before the first round).
 * out_tokens [n_prompts x max_new] int32: row i holds completion i, out_lens[i] tokens (max_new, or
 * fewer when it ended at stop_token), then -1. out_logprobs [n_prompts x max_new] fp32 (may be
 * NULL): the log-prob of each completion token under the current weights at temperature 1 (the
 * training policy's: a PG step's old_logprobs), 0 after the completion; computed by one more
 * forward over the prompts with their completions, exactly as flatmoe_logprobs computes them
 * (equal to it bit for bit on the same sequences). With --kv-cache (an open option: CPU build, one
 * rank, softmax router, no shared experts, native expert precision; else flatmoe_open refuses it
 * naming why): the rounds run through a key/value cache of every layer sized at open for the token
 * budget (2 x layers x budget x num_key_value_heads x head_dim fp32, and one pass's scratch): one
 * pass over the prompts, then one over each unfinished sequence's last token per round, the draws
 * in the same order from the same RNG; its logits equal the whole-prefix ones within fp32
 * reassociation (not bit for bit: the same tokens unless a draw falls within that of a boundary),
 * and out_logprobs still come from the one whole-sequence forward. No allocation after open. Errors:
 * FLATMOE_ERR_ARG naming the field (a spec value out of range, a prompt token out of the
 * vocabulary, prompts that do not fit the budget with max_new), FLATMOE_ERR_NUMERIC (a non-finite
 * logit: the weights diverged). */
int flatmoe_generate(flatmoe_session *s, const int32_t *prompts, int64_t n_prompts, const int64_t *prompt_lens,
                     const flatmoe_sample_spec *spec, int32_t *out_tokens, int64_t *out_lens, float *out_logprobs);

/* Sleep and wake (verl's offload of model and optimizer between rollouts). flatmoe_sleep copies the
 * carved part of every device arena of the session -- the model state (the weights, their
 * gradients, the fp32 master and the optimizer state that lives there; train/fm_param_store.h) and
 * the activation live sets' persistent parts -- to host memory (one allocation of their bytes),
 * then gives each arena's memory back where the backend can while keeping its addresses (the CPU
 * build: madvise, its resident memory drops by the arenas' whole pages; the CUDA build: the
 * arenas' physical memory unmapped and released through CUDA's virtual memory management, so the
 * device keeps only the context and the backend's workspaces), else fills it with NaNs;
 * flatmoe_wake backs the arenas again, copies the contents back and frees the host copy, so the
 * next steps are bit for bit those of a session that did not sleep. While asleep, every other call
 * on the session but flatmoe_get_info and flatmoe_close is refused (FLATMOE_ERR_ARG: "asleep").
 * Errors: FLATMOE_ERR_ARG (already asleep; wake while awake), FLATMOE_ERR_NOMEM (sleep: the host
 * copy, the session stays awake; wake: no device memory to back an arena again, e.g. an inference
 * engine still holds it: the session stays asleep, call flatmoe_wake again once it is free). */
int flatmoe_sleep(flatmoe_session *s);
int flatmoe_wake(flatmoe_session *s);

#ifdef __cplusplus
}
#endif
#endif
