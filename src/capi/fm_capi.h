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
    fm_capi_gen gen;      /* flatmoe_generate's scratch */
    void *sleep_host;     /* flatmoe_sleep: the model-state arena's bytes on the host (NULL: awake) */
    size_t sleep_bytes;
};

/* FM_OK when the session is awake, else FM_ERR_ARG naming `what` and the fix (flatmoe_wake). */
fm_status fm_capi_awake(const flatmoe_session *s, const char *what);

/* flatmoe_generate's scratch (s->gen) of the session's token budget and vocabulary, at open; and
 * its release (safe on a zeroed one). Errors: FM_ERR_NOMEM. */
fm_status fm_capi_gen_alloc(flatmoe_session *s);
void fm_capi_gen_free(flatmoe_session *s);

/* Fills s->fb, pos_of, seq_of and in_loss from b (checked first: every field named in the error).
 * with_targets_all: a target at every position whose next token is in its sequence (logprobs);
 * else only where that next token is in the loss (train_step: the same targets `train` gives).
 * Errors: FM_ERR_ARG naming the field, the value found and the range or budget. */
fm_status fm_capi_pack(flatmoe_session *s, const flatmoe_batch *b, bool with_targets_all);

/* The forward of the packed batch (the session's step schedule), then per caller token its
 * log-prob and entropy into s->logp, s->ent (0 at each sequence's first token). A sync point. */
fm_status fm_capi_forward(flatmoe_session *s, const flatmoe_batch *b);

/* flatmoe_train_step less its update: pack, zero the gradients, forward, the coefficients, the
 * weighted backward and the step's reduction (the sync point "step end"); the gradients stay in
 * the model (m->p.grads) and st gets the loss terms and statistics (grad_norm and lr not yet).
 * Errors: as flatmoe_train_step's. */
fm_status fm_capi_grads(flatmoe_session *s, const flatmoe_batch *b, const flatmoe_loss_spec *spec,
                        flatmoe_step_stats *st);

/* The per-token coefficients c_t = dL/dlog p_t of spec over the n caller tokens (fp64; docs/rl.md
 * and flatmoe_pg.c give each formula's source), from logp [n], the batch's arrays, in_loss [n]
 * and seq_of [n] (b->n_seqs sequences; seq_count [b->n_seqs] scratch); ent [n] (may be NULL) for the
 * statistics. coef [n] ASSIGNED
 * (0 outside the loss); st gets the loss terms and statistics (grad_norm, lr, router terms and
 * step left to the caller). Errors: FM_ERR_ARG naming a spec value out of range or an array the
 * spec needs that is NULL; a batch with no loss token. */
fm_status fm_pg_coefs(const flatmoe_loss_spec *spec, const flatmoe_batch *b, int64_t n, const float *logp,
                      const float *ent, const uint8_t *in_loss, const int32_t *seq_of, int64_t *seq_count,
                      double *coef, flatmoe_step_stats *st);

#endif
