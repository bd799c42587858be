/* A micro-batch as the model reads it (DESIGN.md §3: the batch is an argument of the step, never
 * a field of the model): B sequences of T tokens in host memory, row-major [B,T], and their
 * next-token targets. The model's forward (fm_model_embed_forward, fm_model_head_forward), the
 * schedule (schedule/fm_schedule.h) and the step (train/fm_train_step.h) take it as an argument;
 * the model copies it into its pinned staging and uploads it.
 *
 * Built to grow without touching those signatures: fields NULL are absent (today's behaviour).
 * Packed documents (issue 28; data/fm_pack.h fills them): pos and doc_start, both or neither.
 * The RL issue adds per-token loss weights (advantages, masks) the same way. */
#ifndef FM_BATCH_H
#define FM_BATCH_H

#include "../core/fm_core.h"

typedef struct fm_batch {
    int32_t *tokens;  /* [B*T] host int32: token ids in [0, vocab_size) */
    int32_t *targets; /* [B*T] host int32: the target of each position, -100 where no loss is
                         taken; NULL: no targets (a forward for the logits only: sampling) */
    int64_t B, T;     /* sequences and tokens per sequence (this rank's slice of each under
                         sequence parallelism) */

    /* ---- packed documents (NULL: one causal sequence per row, positions 0..T-1) ---------- */
    int32_t *pos;       /* [B*T] host int32: the RoPE position of each token, restarting at 0 at
                           each document's first token (Hugging Face's position_ids) */
    int32_t *doc_start; /* [B*T] host int32: the row-local index of the first token of the
                           token's document; attention of token t sees tokens doc_start[t] .. t of
                           its row only (FlashAttention's cu_seqlens, per token). A row's values
                           are non-decreasing and doc_start[t] is doc_start[t-1] or t. Padding is
                           a document of its own (targets -100). Under sequence parallelism
                           ([B*T_full], see below) the WHOLE rows' starts, indices in [0, T_full). */
    int64_t T_full, t0; /* sequence parallelism (Ulysses, model/fm_attn_sp.h): this batch holds
                           positions t0 .. t0+T-1 of rows of T_full tokens; tokens, targets and pos
                           are the local [B*T] slice (pos: the RoPE positions of those tokens),
                           doc_start the whole [B*T_full] rows (the attention runs over whole
                           sequences). 0, 0: no slicing (T_full = T). */
} fm_batch;

/* Host memory for a B x T batch (tokens, and targets when `targets`), zeroed; b->B, b->T set.
 * Errors: FM_ERR_ARG for B or T < 1 (naming both); FM_ERR_NOMEM naming the bytes. */
fm_status fm_batch_alloc(fm_batch *b, int64_t B, int64_t T, bool targets);

/* Adds pos and doc_start ([B*T] each) to a batch from fm_batch_alloc, filled as one document per
 * row (pos[b*T+t] = t, doc_start = 0: the same attention and positions as NULL).
 * Errors: FM_ERR_NOMEM naming the bytes (the batch keeps what it had). */
fm_status fm_batch_alloc_docs(fm_batch *b);
/* The same for rank sp_rank of sp sequence-parallel ranks (sp >= 1, 0 <= sp_rank < sp): pos [B*T]
 * local (pos = sp_rank T + t), doc_start [B * sp T] whole rows (0), T_full = sp T, t0 = sp_rank T.
 * sp 1 is fm_batch_alloc_docs. Errors: FM_ERR_NOMEM naming the bytes (the batch keeps what it had). */
fm_status fm_batch_alloc_docs_sp(fm_batch *b, int64_t sp, int64_t sp_rank);

/* Frees what fm_batch_alloc allocated and zeroes b. Safe on a zeroed batch. */
void fm_batch_free(fm_batch *b);

/* Checks b against the vocabulary (tokens in [0, V); targets in [0, V) or -100) and an expected
 * shape B x T; with documents: pos and doc_start both present, doc_start as described above and
 * pos[t] in [0, t0 + t] (doc_start over rows of T_full, pos over the local slice). Errors: FM_ERR_ARG naming the first bad position, its value and the range, or the
 * two shapes (the fix: fm_model_set_shape to the batch's, or a batch of the model's shape). */
fm_status fm_batch_check(const fm_batch *b, int64_t B, int64_t T, int64_t V);

#endif
