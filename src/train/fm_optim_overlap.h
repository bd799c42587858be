/* The optimizer overlaps the next forward (issue 10, item 4; compare ZeRO-Offload's overlap of
 * the update with the next step, arXiv 2101.06840, here exact: without its one-step delay): once the step's gradient norm is known (the step-end sync point, so the clip scale is
 * known), the update of every parameter is issued on the update stream (FM_STREAM_UPDATE), group
 * by group in forward order — group 0 the embedding, group 1 + l layer l, group L + 1 the final
 * norm and the LM head (with tied embeddings the head is group 0's) — and each group's gradients
 * are zeroed there right after its update; event FM_EVENT_OVERLAP0 + g marks group g done. The
 * next step's forward waits on the compute stream, before the embedding, each layer and the head,
 * only for that group's event (fm_schedule.param_ready), so layer l's forward of step s + 1 runs
 * while layers l + 1 .. L of step s are still being updated. The host never waits for an update.
 *
 * Exact: the same update kernel over the same elements as the serial step (the whole table in
 * one step_range), only split at group boundaries; AdamW is elementwise and its CUDA kernel
 * rounds each operation on its own (so its vector and scalar paths agree), so the weights,
 * master and moments are bit-identical to the serial step's (tests/test_optim_overlap.c on the
 * CPU; tests/gpu/cli_cuda_overlap.sh on the GPU). The streamed AdamW runs the same pipeline:
 * its buckets start at each group's first parameter, its copies use the copy streams and its
 * kernels the update stream (FM_STREAM_OPS inside it).
 *
 * Anything else that reads the weights or the optimizer state between steps (evaluation, a
 * checkpoint, sampling) calls fm_optim_overlap_flush first. */
#ifndef FM_OPTIM_OVERLAP_H
#define FM_OPTIM_OVERLAP_H

#include "../schedule/fm_schedule.h"
#include "fm_optim.h"

typedef struct fm_optim_overlap {
    int n_groups;         /* L + 2 */
    int *t0;              /* [n_groups + 1]: group g is tensors [t0[g], t0[g + 1]) of the table */
    bool grads_zeroed;    /* the last issue zeroed every gradient (the next step need not) */
    bool in_flight;       /* updates issued that the compute stream has not been made to wait for */
} fm_optim_overlap;

/* Groups m's parameter table (embedding, each layer, norm + head; the table's order is the
 * forward order and the flat buffer's). Errors: FM_ERR_ARG when L + 2 groups need more events
 * than the pool has past FM_EVENT_OVERLAP0 (more than 126 layers: run with
 * --no-optimizer-overlap), or when the table is not in that order; FM_ERR_NOMEM. */
fm_status fm_optim_overlap_init(fm_optim_overlap *o, const fm_model *m);
void fm_optim_overlap_free(fm_optim_overlap *o);

/* The schedule's forward waits for each group's update (fm_schedule.param_ready). */
void fm_optim_overlap_attach(const fm_optim_overlap *o, fm_schedule *s);

/* Issues the update of every tensor (after optim->step_begin) at learning rate lr with gradient
 * scale clip, group by group on the update stream, zeroing each group's gradients after its
 * update and recording its event. Work only; the op stream is compute again on return. */
void fm_optim_overlap_issue(fm_optim_overlap *o, fm_model *m, const fm_optimizer_ops *optim, void *opt, double lr,
                            float clip);

/* Makes the compute stream (and so every later op and synchronous copy) wait for the updates in
 * flight: one event wait, no host wait. Call before evaluation, checkpoints and sampling. */
void fm_optim_overlap_flush(fm_optim_overlap *o, fm_model *m);

#endif
