/* The training data's draw (DESIGN.md §3 train/: the data draw and epochs): each step's
 * micro-batches as windows at random offsets of the token stream (data/fm_data.h's cursor, the
 * RNG in state.json) or as rows of whole documents (data/fm_pack.h's packer, its cursor in
 * state.json), and --epochs: the number of steps that N passes over the data take, and the
 * epoch of each step (the step line, metrics.jsonl, TensorBoard). */
#ifndef FM_TRAIN_DATA_H
#define FM_TRAIN_DATA_H

#include "../data/fm_pack.h"
#include "fm_trainer.h"

typedef struct fm_train_data {
    int mode;            /* FM_PACK_ON, FM_PACK_PAD or FM_PACK_OFF: resolved from --pack */
    fm_packer pk;        /* on / pad: the packer over the global batch's W x B rows */
    int32_t *global;     /* on / pad with W > 1 data-parallel ranks or sp > 1: [4 x W x B x T] the global batch's
                            tokens, targets, positions, starts (every rank fills it, keeps its rows) */
    int dp, dp_rank;     /* W and this rank's index among them */
    int sp, sp_rank;     /* sequence-parallel ranks per row (the dataset's seq_parts) and this one's */
    int64_t epoch;       /* 1-based epoch of the last step drawn (0 before the first) */
    int64_t n_tokens;    /* off: the training tokens (an epoch's worth) */
} fm_train_data;

/* Resolves --pack (auto: on when `train` has a document index and o->init_from is set; a resumed
 * run's `resumed_mode`, FM_PACK_* from its state.json, wins when > 0), sets up the packer for
 * W = dp ranks x o->micro_batch rows of o->seq_len, adds positions and starts to the step's
 * micro-batches (fm_batch_alloc_docs), and with o->epochs > 0 returns in *steps the optimizer
 * steps the epochs take (packed: the packer's dry run; off: ceil(epochs x tokens / tokens per
 * step)), else o->steps. Errors: FM_ERR_ARG (--pack on without a document index; a document too
 * long under --pack-long refuse: fm_packer_init's), FM_ERR_NOMEM. */
fm_status fm_train_data_init(fm_train_data *d, const fm_train_opts *o, const fm_dataset *train, int dp, int dp_rank,
                             int resumed_mode, fm_batch *batches, int64_t *steps);

/* A resume: the packer's cursor from state.json (fm_packer_seek's errors). No-op when off. */
fm_status fm_train_data_seek(fm_train_data *d, int64_t epoch, int64_t next, int64_t done);

/* Draws the next step's o->grad_accum micro-batches into batches (this rank's windows of the
 * one-rank draw of W x micro_batch, fm_dataset_sample_batch, fm_train_step.h's comment; or packed
 * rows with their positions and starts), advancing data_rng (off) or the packer; d->epoch gets the
 * step's epoch (off: 1 + the tokens drawn before it over the data's tokens). `tokens_before`: the
 * global tokens of the steps before this one. No allocation. */
void fm_train_data_draw(fm_train_data *d, const fm_train_opts *o, const fm_dataset *train, fm_rng *data_rng,
                        fm_batch *batches, int64_t tokens_before);

/* "on", "pad" or "off". */
const char *fm_train_data_mode_name(int mode);

void fm_train_data_free(fm_train_data *d);

#endif
