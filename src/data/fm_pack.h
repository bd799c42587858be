/* Document-aware batches (issue 28): rows filled with whole documents of a data set that has a
 * document index (fm_data.h), in a seeded order per epoch, with per-token positions and
 * document starts (model/fm_batch.h) so that attention never crosses a document and RoPE
 * restarts in each one; the rest of a row is padding (targets -100, a document of its own).
 *
 * A document of n tokens gives n - 1 training positions: inputs tokens[0 .. n-2], targets
 * tokens[1 .. n-1] (a target whose loss-mask byte is 0 is -100); its last token, which has no
 * next token in the document, is not an input. Documents of one token give none and are
 * skipped. A document with more positions than a row (T) is cut into pieces of T positions
 * (--pack-long split; each piece its own sequence: positions restart at 0, no attention between
 * pieces, as Megatron and TRL cut over-long samples), or refused at the start (refuse).
 *
 * Order and packing (the algorithm, as TRL's and Megatron's packers choose rows): epoch e visits
 * the documents in a Fisher-Yates permutation seeded by (seed, e). A batch of R rows takes
 * documents in that order and puts each into the first row with room for it (first-fit); the
 * batch is complete at the first document that fits no row (it opens the next batch), or at the
 * epoch's end (a batch never holds two epochs: the last one of an epoch may be partly empty).
 * Pad mode (the plain twin of packing): at most one document (or piece) per row.
 *
 * The cursor (epoch, next, done) is the whole state: the same cursor gives the same batches, so
 * a run resumed from its state.json continues bit for bit (train/fm_train_ckpt.c). Data
 * parallelism: every rank fills the same global batch of W x B rows and keeps its own B rows
 * (train/fm_train_step.c), so the cursor is the same on every rank. Sequence parallelism is not
 * supported with packed batches (the model refuses it, model/fm_head.c). */
#ifndef FM_PACK_H
#define FM_PACK_H

#include "fm_data.h"

typedef struct fm_packer {
    const fm_dataset *ds; /* must outlive the packer; ds->docs non-NULL */
    int64_t T;            /* positions per row */
    bool pad;             /* one document per row */
    bool split_long;      /* cut documents longer than a row (else they were refused at init) */
    uint64_t seed;
    int64_t *order;       /* [ds->n_docs] the epoch's permutation */
    int64_t *used;        /* [rows_cap] positions filled per row (scratch of fm_packer_fill) */
    int64_t rows_cap;
    int64_t epoch;        /* 0-based epoch of the cursor (order is its permutation) */
    int64_t next;         /* index into order of the next document */
    int64_t done;         /* positions of order[next] already placed (a long document's pieces) */
} fm_packer;

/* A packer over ds for rows of T positions and batches of up to rows_cap rows, at epoch 0.
 * Errors: FM_ERR_ARG when ds has no document index (naming the fix: `flatmoe prepare` writes
 * one), when T or rows_cap < 1, when no document has two tokens, or (split_long false) when a
 * document has more than T positions (naming it, its length and the fixes); FM_ERR_NOMEM. */
fm_status fm_packer_init(fm_packer *p, const fm_dataset *ds, int64_t T, int64_t rows_cap, bool pad, bool split_long,
                         uint64_t seed);

/* Moves the cursor to (epoch, next, done), e.g. from a checkpoint's state.json.
 * Errors: FM_ERR_ARG when next or done is outside the data (naming them: the checkpoint belongs
 * to other data). */
fm_status fm_packer_seek(fm_packer *p, int64_t epoch, int64_t next, int64_t done);

/* Fills the next batch of `rows` rows (<= rows_cap) of T positions: tokens, targets, pos and
 * doc_start [rows*T] int32 each (model/fm_batch.h), or, with tokens NULL, only advances the
 * cursor (a dry run: counting batches). Returns the 0-based epoch the batch belongs to. Writes
 * into the caller's arrays only (no allocation). */
int64_t fm_packer_fill(fm_packer *p, int64_t rows, int32_t *tokens, int32_t *targets, int32_t *pos,
                       int32_t *doc_start);

/* The number of batches of `rows` rows that `epochs` epochs take (a dry run from epoch 0 of a
 * packer like p; p itself is not moved). Errors: FM_ERR_NOMEM. */
fm_status fm_packer_count(const fm_packer *p, int64_t rows, int64_t epochs, int64_t *batches);

void fm_packer_free(fm_packer *p);

#endif
