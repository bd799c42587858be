/* One optimizer step of training (DESIGN.md §4): zero the gradients, forward and backward over
 * grad_accum micro-batches drawn from the training data, check the losses, take the global
 * gradient norm, clip, set the learning rate of the schedule and update with AdamW. */
#ifndef FM_TRAIN_STEP_H
#define FM_TRAIN_STEP_H

#include "../core/fm_rng.h"
#include "../data/fm_data.h"
#include "fm_trainer.h"

/* What one step computed. */
typedef struct fm_step_stats {
    double ce, aux, z;   /* mean over the micro-batches: cross-entropy (nats/token), load-balancing
                            and z losses, each as fm_model_train_step reports it */
    double gnorm;        /* global L2 norm of the accumulated gradients, before clipping */
    double lr;           /* the learning rate of the update (fm_lr_at) */
} fm_step_stats;

/* Runs optimizer step `step` (1-based, of o->steps) on model m with optimizer opt: draws
 * o->grad_accum micro-batches of [o->micro_batch, o->seq_len] tokens from `train` with data_rng
 * (advanced), each weighted 1/grad_accum; clips the gradients to global norm o->grad_clip
 * (0: off); updates at fm_lr_at(step, o->steps, o->warmup, o->lr, o->min_lr); and returns when the
 * update has finished on the device (backend sync), so that the caller's clock covers it.
 * Phase marks: the zeroing and the update are the optimizer phase. Allocates nothing.
 * Errors: FM_ERR_NUMERIC when a micro-batch's loss or the gradient norm is not finite (the
 * message names the step and says that the last good checkpoint in o->out_dir stays); the
 * weights are then not updated. */
fm_status fm_train_step(fm_model *m, fm_adamw *opt, const fm_dataset *train, fm_rng *data_rng,
                        const fm_train_opts *o, int64_t step, fm_step_stats *out);

#endif
