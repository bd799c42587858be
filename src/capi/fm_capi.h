/* libflatmoe's inside (include/flatmoe.h is the public face; docs/rl.md): the session, the
 * packing of a caller's batch into the model's rows, and the policy-gradient coefficients. Not a
 * public API: tests include it to reach the engine beside the session. */
#ifndef FM_CAPI_H
#define FM_CAPI_H

#include "../../include/flatmoe.h"
#include "../run/fm_run_spec.h"
#include "../train/fm_train_internal.h"

/* flatmoe_generate's host scratch, allocated at open (flatmoe_generate.c). */
typedef struct fm_capi_gen {
    int32_t *tok;         /* [budget] the prompts with their completions so far, packed */
    int64_t *lens, *start; /* [budget] each sequence's length and first token */
    float *row, *probs;   /* [V] the logits of one position; the sampler's weights */
    int32_t *order;       /* [V] the sampler's candidates */
} fm_capi_gen;

/* flatmoe_generate's KV cache (--kv-cache; flatmoe_kv.c, its bound there): K and V of every
 * layer for every token of the budget, and one pass's scratch, allocated at open. */
#define FM_CAPI_KV_MAX_HD 512
typedef struct fm_capi_kv {
    bool on;
    size_t bytes;                 /* its share of the session's host arena (fm_capi_host_bytes) */
    float *K, *V;                 /* [L, budget, nkv x hd] the cache; slot = a token's place */
    float *x, *ln, *o;            /* [n, H] the residual stream, a norm's output, a block's output */
    float *q, *att, *k, *v;       /* [n, nh hd] x 2, [n, nkv hd] x 2 */
    float *rlog, *probs, *lse;    /* [n, E] x 2 router logits and probabilities, [n] */
    float *rstd;                  /* [n x nh] the norms' 1/rms */
    int32_t *pos;                 /* [n] each token's position in its sequence (RoPE) */
    int64_t *slot, *first;        /* [n] each token's cache slot; its sequence's first slot */
    int32_t *topk_idx;            /* [n, k] */
    float *topk_w;                /* [n, k] */
    float *hid;                   /* [3 I_max + H] one token's SwiGLU */
} fm_capi_kv;

/* A session: the run spec its options filled, the trainer's run (train/fm_train_internal.h: the
 * backend, model, parameter store, optimizer and step workspace that fm_train_setup_session made
 * from the plan), and host scratch for one batch of the token budget (B x T), allocated at open. */
struct flatmoe_session {
    fm_run_spec spec;
    fm_train_opts o;
    run r;
    train_state ts;
    char ckpt[4096];      /* --ckpt's checkpoint folder ("" without) */
    int64_t B, T, budget; /* the model's rows, tokens per row, B x T */
    fm_batch fb;          /* the packed batch as the model reads it (tokens, targets, pos, doc_start) */
    int64_t *pos_of;      /* [budget] the model position (row x T + offset) of each caller token */
    int32_t *seq_of;      /* [budget] each caller token's sequence */
    uint8_t *in_loss;     /* [budget] each caller token in the loss (mask and not its sequence's first) */
    float *tok_loss;      /* [budget] the model's per-position loss, read back */
    float *tok_ent;       /* [budget] the model's per-position entropy, read back */
    float *logp, *ent;    /* [budget] per caller token */
    double *coef;         /* [budget] dL/dlog p_t per caller token */
    int64_t *seq_count;   /* [budget] scratch: loss tokens per sequence */
    float *weight;        /* [budget] per model position: -coef (the linear CE's token weights) */
    double *ent_coef;     /* [budget] dL/dH_t per caller token (the entropy bonus) */
    float *ent_weight;    /* [budget] per model position: ent_coef (the linear CE's entropy weights) */
    int64_t L_moe, k;     /* MoE layers, experts per token (the routes' axes) */
    int32_t *routes;      /* [L_moe, budget, k] host staging of the model's rl_routes (flatmoe_replay.c) */
    int64_t topk_max;     /* --logprobs-topk K: the most top-k log-probs per token (0: none) */
    float *topk_lp;       /* [budget, K] the model's rl_topk_lp, read back */
    int32_t *topk_id;     /* [budget, K] the model's rl_topk_id, read back */
    fm_capi_gen gen;      /* flatmoe_generate's scratch */
    fm_capi_kv kv;        /* its KV cache (--kv-cache; kv.on false without) */
    fm_arena host;        /* the buffers above (fb to kv): one host arena of fm_capi_host_bytes */
    void *sleep_host;     /* flatmoe_sleep: the model-state arena's bytes on the host (NULL: awake) */
    size_t sleep_bytes;   /* its bytes: the device arenas' carved parts */
    size_t sleep_released; /* device bytes given back at sleep (ops->mem_release; 0: poisoned instead) */
    int threads;          /* the CPU threads its calls run on (--threads, or OpenMP's count at open) */
};

/* FM_OK when the session is awake, else FM_ERR_ARG naming `what` and the fix (flatmoe_wake). */
fm_status fm_capi_awake(const flatmoe_session *s, const char *what);

/* The session's host scratch (flatmoe_host.c): every host buffer beside the plan's live sets
 * (the batch, the per-token arrays, the routes' and top-k staging, flatmoe_generate's sampling
 * scratch, and with kv_cache the KV cache and its decoder's scratch), for config c, B rows of T
 * tokens and topk (--logprobs-topk), in bytes (64-byte rounded pieces, as one host arena takes
 * them); *kv_bytes (may be NULL) gets the KV cache's share (0 without kv_cache). Never fails. */
size_t fm_capi_host_bytes(const fm_config *c, int64_t B, int64_t T, int64_t topk, bool kv_cache, size_t *kv_bytes);
/* At open, after the run is set up (s->r, B, T, budget, topk_max): refuses --kv-cache where the
 * cached decoder does not serve the model (fm_capi_kv_check), then allocates the one host arena of
 * fm_capi_host_bytes and carves every buffer from it (s->fb, the per-token arrays, s->gen, s->kv).
 * Errors: FM_ERR_UNSUPPORTED (--kv-cache), FM_ERR_NOMEM naming the bytes. Free: safe on a zeroed
 * session. */
fm_status fm_capi_host_alloc(flatmoe_session *s);
void fm_capi_host_free(flatmoe_session *s);
/* FM_OK when --kv-cache serves session s's model, else FM_ERR_UNSUPPORTED naming why (the CUDA
 * build, several ranks, MLA, gpt_oss's parts, the sigmoid router, shared experts, fp8 experts,
 * head_dim > FM_CAPI_KV_MAX_HD) and the fix. */
fm_status fm_capi_kv_check(const flatmoe_session *s);
/* One pass of the cached decoder over n tokens (1 .. budget) tok [n], with s->kv.pos, slot and
 * first [n] filled by the caller (each token's position, cache slot, and its sequence's first
 * slot; a token's earlier positions already cached, or among the n at smaller slots): writes K
 * and V at their slots and leaves each token's final-normed hidden state in s->kv.ln [n, H].
 * Host memory (the CPU build). Errors: the backend's status. */
fm_status fm_capi_kv_pass(flatmoe_session *s, const int32_t *tok, int64_t n);

/* The batch validator and packer, callable without a model (fuzz/fuzz_rlbatch.c drives it with
 * untrusted batches): checks b (n_tokens in 1 .. B x T, n_seqs in 1 .. n_tokens before seq_lens is read, tokens and seq_lens set, each
 * seq_lens[i] in 1 .. T summing to n_tokens, every token in [0, V); the per-token float arrays are
 * not read), then packs its sequences first fit, in order, into B rows of T positions (B, T >= 1;
 * asserted): fb's tokens, targets, pos and doc_start [B*T] int32 (model/fm_batch.h; padding is a
 * document of its own with targets -100), and per caller token t < n_tokens its model position
 * pos_of[t] (row x T + offset), its sequence seq_of[t] and in_loss[t] (in the loss: not its
 * sequence's first token, and loss_mask[t] != 0 or loss_mask NULL). with_targets_all: a target at
 * every position whose next token is in its sequence (logprobs); else only where that next token
 * is in the loss (train_step: the same targets `train` gives). pos_of, seq_of, in_loss: [B*T]
 * each, written for t < n_tokens. Errors: FM_ERR_ARG naming the field, the value found and the
 * range or budget (the outputs are then partly written). No allocation. */
fm_status fm_capi_pack_rows(const flatmoe_batch *b, int64_t B, int64_t T, int64_t V, bool with_targets_all,
                            fm_batch *fb, int64_t *pos_of, int32_t *seq_of, uint8_t *in_loss);

/* fm_capi_pack_rows into the session's s->fb, pos_of, seq_of and in_loss, for its --micro-batch
 * rows of --seq-len and its model's vocabulary. Errors: as fm_capi_pack_rows's. */
fm_status fm_capi_pack(flatmoe_session *s, const flatmoe_batch *b, bool with_targets_all);

/* Routing replay and the routes taken (flatmoe_replay.c). fm_capi_routes_stage, after the batch is
 * packed: with b->routed_experts, checks every id (in [0, E), distinct within a token's row;
 * FM_ERR_ARG naming the token, the MoE layer and the value), scatters them to the model's
 * positions (padding rows -1: the router's own choice) and copies them into the model's
 * rl_routes; without, nothing. Whether the routers replay or record is the call's switches'
 * (fm_capi_call_begin: replay when b->routed_experts is set).
 * fm_capi_routes_read, after the forward: the routes of each caller token into out
 * [n_tokens, L_moe, k] (a sync point: the device buffer read back). */
fm_status fm_capi_routes_stage(flatmoe_session *s, const flatmoe_batch *b);
fm_status fm_capi_routes_read(flatmoe_session *s, const flatmoe_batch *b, int32_t *out);

/* The per-call switches of one library call (model/fm_acts.h fm_rl_call), set whole into the
 * model at the call's start and zeroed at its end, the only two places that write them (begin also
 * re-applies the session's thread count, process-wide: another session may have set its own, and
 * the CPU results depend on it):
 * fm_capi_call_begin sets outputs (the forward's entropies and top-k), weighted and ent_bonus as
 * given (a train step's backward), replay when b (may be NULL) has routed_experts, else record
 * when the model has MoE layers. Every library call that runs the model brackets its forward
 * and backward with the pair, so the trainer's step (switches zero) is never affected. */
void fm_capi_call_begin(flatmoe_session *s, const flatmoe_batch *b, bool weighted, bool ent_bonus);
void fm_capi_call_end(flatmoe_session *s);

/* The forward of the packed batch (the session's step schedule), then per caller token its
 * log-prob and entropy into s->logp, s->ent (0 at each sequence's first token), inside a call
 * begun by fm_capi_call_begin. A sync point. */
fm_status fm_capi_forward(flatmoe_session *s, const flatmoe_batch *b);

/* flatmoe_train_step less its update: pack, zero the gradients, forward, the coefficients, the
 * weighted backward and the step's reduction (the sync point "step end"); the gradients stay in
 * the model (m->p.grads) and st gets the loss terms and statistics (grad_norm and lr not yet).
 * Errors: as flatmoe_train_step's. */
fm_status fm_capi_grads(flatmoe_session *s, const flatmoe_batch *b, const flatmoe_loss_spec *spec,
                        flatmoe_step_stats *st);

/* The loss's validator, run before the forward: spec's values in range (loss, agg and kl one of
 * their enums; clip_low in [0, 1); clip_high, tis_cap, kl_coef finite and >= 0; clip_dual 0 or
 * finite > 1), the arrays the spec needs set, and, at every token t < n with in_loss[t] (from
 * fm_capi_pack_rows), those arrays finite (advantages, old_logprobs when set, rollout_logprobs with
 * tis_cap > 0, ref_logprobs with a KL term; values outside the loss are not read). Errors:
 * FM_ERR_ARG naming the spec value, or the array, the token and its value, and the fix. */
fm_status fm_pg_check(const flatmoe_loss_spec *spec, const flatmoe_batch *b, int64_t n, const uint8_t *in_loss);

/* The per-token coefficients c_t = dL/dlog p_t of spec over the n caller tokens (fp64; docs/rl.md
 * and flatmoe_pg.c give each formula's source), from logp [n], the batch's arrays, in_loss [n]
 * and seq_of [n] (b->n_seqs sequences; seq_count [b->n_seqs] scratch); ent [n] (may be NULL) for the
 * statistics. coef [n] ASSIGNED
 * (0 outside the loss); st gets the loss terms and statistics (grad_norm, lr, router terms and
 * step left to the caller). Errors: fm_pg_check's (run first); FM_ERR_ARG for a batch with no
 * loss token. */
fm_status fm_pg_coefs(const flatmoe_loss_spec *spec, const flatmoe_batch *b, int64_t n, const float *logp,
                      const float *ent, const uint8_t *in_loss, const int32_t *seq_of, int64_t *seq_count,
                      double *coef, flatmoe_step_stats *st);

/* fm_pg_coefs across ranks: a collective over comm (NULL or one rank: fm_pg_coefs exactly). Each
 * rank passes its own tokens; the aggregation's |M| and |S| are every rank's loss tokens and
 * sequences (all-reduced first: token-mean is the mean over ALL ranks' loss tokens, as verl's
 * global batch info makes it; a sequence lies whole on one rank, so |M_s| is local), so the
 * coefficients are those of one rank over the whole batch and the ranks' gradients sum to its
 * gradient; st's terms and statistics are the sums over the ranks (fp64, all-reduced), the same on
 * every rank. Errors: fm_pg_coefs's (no loss token on any rank), the communicator's. */
fm_status fm_pg_coefs_ranks(const flatmoe_loss_spec *spec, const flatmoe_batch *b, int64_t n, const float *logp,
                            const float *ent, const uint8_t *in_loss, const int32_t *seq_of, int64_t *seq_count,
                            const fm_comm *comm, double *coef, flatmoe_step_stats *st);

/* Many ranks: every rank's verdict on its part of a collective call, before the first collective
 * of the model (a rank that refused its batch must not leave the others waiting in the forward).
 * One rank: local. Else an all-reduce of the failures: a failing rank returns its own error (its
 * message kept), the others FM_ERR_ARG naming `what` and how many ranks refused. */
fm_status fm_capi_agree(flatmoe_session *s, fm_status local, const char *what);

/* Refuses `what` (FM_ERR_UNSUPPORTED, naming it and the ranks) in a session of several ranks. */
fm_status fm_capi_one_rank(const flatmoe_session *s, const char *what);

/* The entropy bonus's per-token coefficients dL/dH_t = -entropy_coef * a_t (a_t the aggregation
 * weight; 0 outside the loss) into ent_coef [n] (ASSIGNED), after fm_pg_coefs filled seq_count and
 * st (its n_loss_tokens, n_loss_seqs). The loss term itself is in fm_pg_coefs's st->loss. */
void fm_pg_entropy_coefs(const flatmoe_loss_spec *spec, int64_t n, const uint8_t *in_loss, const int32_t *seq_of,
                         const int64_t *seq_count, const flatmoe_step_stats *st, double *ent_coef);

#endif
