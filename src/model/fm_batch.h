/* A micro-batch as the model reads it (DESIGN.md §3: the batch is an argument of the step, never
 * a field of the model): B sequences of T tokens in host memory, row-major [B,T], and their
 * next-token targets. The model's forward (fm_model_embed_forward, fm_model_head_forward), the
 * schedule (schedule/fm_schedule.h) and the step (train/fm_train_step.h) take it as an argument;
 * the model copies it into its pinned staging and uploads it.
 *
 * Built to grow without touching those signatures: the fine-tuning and RL issues add, as fields
 * here (NULL: absent, today's behaviour), per-token positions and document starts for packed
 * sequences and per-token loss weights (advantages, masks). */
#ifndef FM_BATCH_H
#define FM_BATCH_H

#include "../core/fm_core.h"

typedef struct fm_batch {
    int32_t *tokens;  /* [B*T] host int32: token ids in [0, vocab_size) */
    int32_t *targets; /* [B*T] host int32: the target of each position, -100 where no loss is
                         taken; NULL: no targets (a forward for the logits only: sampling) */
    int64_t B, T;     /* sequences and tokens per sequence (this rank's slice of each under
                         sequence parallelism) */
} fm_batch;

/* Host memory for a B x T batch (tokens, and targets when `targets`), zeroed; b->B, b->T set.
 * Errors: FM_ERR_ARG for B or T < 1 (naming both); FM_ERR_NOMEM naming the bytes. */
fm_status fm_batch_alloc(fm_batch *b, int64_t B, int64_t T, bool targets);

/* Frees what fm_batch_alloc allocated and zeroes b. Safe on a zeroed batch. */
void fm_batch_free(fm_batch *b);

/* Checks b against the vocabulary (tokens in [0, V); targets in [0, V) or -100) and an expected
 * shape B x T. Errors: FM_ERR_ARG naming the first bad position, its value and the range, or the
 * two shapes (the fix: fm_model_set_shape to the batch's, or a batch of the model's shape). */
fm_status fm_batch_check(const fm_batch *b, int64_t B, int64_t T, int64_t V);

#endif
