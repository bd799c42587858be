/* One optimizer step of training (DESIGN.md §4): zero the gradients, forward and backward over
 * grad_accum micro-batches drawn from the training data, check the losses, take the global
 * gradient norm, clip, set the learning rate of the schedule and update with AdamW. */
#ifndef FM_TRAIN_STEP_H
#define FM_TRAIN_STEP_H

#include "../core/fm_rng.h"
#include "../data/fm_data.h"
#include "../schedule/fm_schedule.h"
#include "fm_optim_overlap.h"
#include "fm_trainer.h"

/* What a step keeps between its micro-batches: the layer schedule, pinned copies of each
 * micro-batch's device results (fm_model_results_count doubles each, and one for the gradient
 * norm), read at the step's one sync point, and each micro-batch's valid-target count. */
typedef struct fm_step_ws {
    fm_schedule sched;
    fm_arena results;    /* pinned host memory: (grad_accum + 1) x n_res doubles */
    double *res;
    int64_t n_res;
    int64_t *n_valid;    /* [grad_accum] */
    int64_t grad_accum;
    fm_optim_overlap overlap; /* the optimizer overlap (fm_step_ws_enable_overlap) */
    bool overlap_on;
    /* Data parallelism (set by the trainer after fm_step_ws_init): zero_ps, the ZeRO-1/2 store
     * (fm_param_store_create_sharded over dp) whose shard this rank updates; NULL: every rank
     * updates its whole replica. */
    const struct fm_param_store *zero_ps;
    /* ZeRO-3 (train/fm_zero3.h; set by the trainer, whose schedule carries its hook): the step
     * zeroes, norms and updates the shard only; NULL: not ZeRO-3. */
    struct fm_zero3 *zero3;
    /* Expert parallelism (train/fm_train_ep.h; NULL: none): the gradients are reduced by
     * fm_train_ep_reduce_grads (experts over the ranks holding them, the rest over dp). */
    const struct fm_train_ep *ep;
    /* The step's micro-batches as the trainer draws them (fm_train_data_draw, train/fm_train_data.h): [grad_accum] host
     * batches of the model's shape (m->a.B x m->a.T), handed to fm_train_step. */
    fm_batch *batches;
} fm_step_ws;

/* Sets up w for model m (its default schedule, laid out already) and grad_accum micro-batches
 * per step; pinned memory from m's backend, host memory for grad_accum batches of m->a.B x m->a.T
 * tokens and targets. Errors: FM_ERR_NOMEM naming what. */
fm_status fm_step_ws_init(fm_step_ws *w, fm_model *m, int64_t grad_accum);

/* Turns the optimizer overlap on (fm_optim_overlap.h): each step's update is issued on the
 * update stream group by group, and the next step's forward waits per layer for it. Errors:
 * fm_optim_overlap_init's. */
fm_status fm_step_ws_enable_overlap(fm_step_ws *w, fm_model *m);
/* Before anything other than the next step reads the weights or the optimizer state
 * (evaluation, checkpoints, sampling): the compute stream waits for the updates in flight. No
 * host wait; a no-op without the overlap. */
void fm_step_ws_flush(fm_step_ws *w, fm_model *m);
/* Frees w; call before the backend is freed. Safe on a zeroed w. */
void fm_step_ws_free(fm_step_ws *w);

/* What one step computed. */
typedef struct fm_step_stats {
    double ce, aux, z;   /* mean over the micro-batches: cross-entropy (nats/token), load-balancing
                            and z losses, each as fm_model_loss_from_results reports it */
    double gnorm;        /* global L2 norm of the accumulated gradients, before clipping */
    double lr;           /* the learning rate of the update (fm_lr_at) */
} fm_step_stats;

/* Runs optimizer step `step` (1-based, of o->steps) on model m with optimizer opt and step
 * workspace w (fm_step_ws_init, with o->grad_accum) over the micro-batches mb [o->grad_accum]
 * (model/fm_batch.h; each of the model's shape, e.g. w->batches after fm_train_data_draw, train/fm_train_data.h), each
 * weighted 1/grad_accum; clips the gradients to global norm o->grad_clip
 * (0: off); updates at fm_lr_at(step, o->steps, o->warmup, o->lr, o->min_lr); and returns when the
 * update has finished on the device (backend sync), so that the caller's clock covers it — or,
 * with the optimizer overlap (fm_step_ws_enable_overlap), as soon as the update is issued: the
 * next step's forward waits for it layer by layer, and its gradients were zeroed by it.
 * The host waits for the device at named sync points only: once per MoE dispatch (its expert
 * offsets), once per micro-batch before its token upload, once at the step's end (every
 * micro-batch's losses and the gradient norm, before the clip scale is known; the gradients' sum
 * of squares is all-reduced over dp, the data-parallel ranks, first) and, without the overlap,
 * once after the update (the step's clock). Device errors come back as the backend's sticky status.
 * of squares is all-reduced over dp, the data-parallel ranks, first) and once after the
 * update (the step's clock). Device errors come back as the backend's sticky status.
 * Data parallelism over dp (W ranks, rank q; NULL or one rank: none): micro_batch is per rank, and
 * the W ranks' micro-batches together are the sequences one rank draws at W x micro_batch: every
 * rank advances data_rng by W x micro_batch windows per micro-batch and keeps windows
 * [q micro_batch, (q + 1) micro_batch) (fm_train_data_draw, train/fm_train_data.h; so data_rng stays the same on every rank
 * and at every W).
 * The loss is the mean over the global valid targets (the model reduces over m->mesh.comm), so the
 * gradient is the SUM of the ranks' gradients: all-reduced (w->zero_ps NULL; every rank then
 * updates its replica), or reduce-scattered to the shard's owner, which updates its shard, the
 * updated weights then all-gathered (ZeRO-1/2, w->zero_ps); or, under ZeRO-3 (w->zero3), reduce-
 * scattered group by group in the schedule's hooks into the shard, whose sum of squares is
 * all-reduced and which alone is updated (the weights stay sharded: the next forward gathers).
 * Phase marks: the zeroing and the update are the optimizer phase. Allocates nothing.
 * Errors: FM_ERR_ARG from fm_batch_check (a micro-batch of another shape, a token or target out
 * of range); FM_ERR_NUMERIC when a micro-batch's loss or the gradient norm is not finite (the
 * message names the step and says that the last good checkpoint in o->out_dir stays); the
 * weights are then not updated. */
fm_status fm_train_step(fm_model *m, const fm_optimizer_ops *optim, void *opt, const fm_comm *dp, fm_step_ws *w,
                        const fm_batch *mb, const fm_train_opts *o, int64_t step, fm_step_stats *out);

/* fm_train_step's three parts, for a caller that runs its own forward and backward between them
 * (the library's RL step, src/capi/flatmoe_step.c; fm_train_step is exactly: zero, the
 * micro-batches, reduce, the loss checks, apply):
 * fm_train_step_zero_grads: the gradients zeroed (or found zeroed by the overlapped update).
 * fm_train_step_reduce: the gradients reduced over dp and their sum of squares, the results copied
 *   to w->res [grad_accum x n_res] (the micro-batches' copies are the caller's), then the sync
 *   point "step end". Errors: the communicator's, the backend's sticky status.
 * fm_train_step_apply: the global norm from w->res (FM_ERR_NUMERIC when not finite; nothing
 *   updated), the clip, the learning rate of `step` and the update; *gnorm_out, *lr_out. Errors:
 *   as fm_train_step's update. Allocate nothing. */
void fm_train_step_zero_grads(fm_model *m, fm_step_ws *w);
fm_status fm_train_step_reduce(fm_model *m, const fm_comm *dp, fm_step_ws *w);
fm_status fm_train_step_apply(fm_model *m, const fm_optimizer_ops *optim, void *opt, const fm_comm *dp, fm_step_ws *w,
                              const fm_train_opts *o, int64_t step, double *gnorm_out, double *lr_out);

#endif
