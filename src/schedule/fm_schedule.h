/* The layer schedule (DESIGN.md §3-§4): the order in which a micro-batch runs the model's pieces
 * (model/fm_model.h: embedding, one layer's forward and backward, the head), the recompute
 * policy, and hooks before and after each layer's forward and backward — the place where
 * checkpoint offload, ZeRO-3 gathers and reduce-scatters, optimizer streaming and the
 * expert-parallel overlap attach (llm.c's per-layer reduction in gpt2_backward_and_reduce is
 * the model of it).
 *
 * Order of one training step (fm_schedule_train_step):
 *   embed; for l = 0 .. L-1: BEFORE_FORWARD(l), layer_forward(l), AFTER_FORWARD(l);
 *   head (loss and its gradient);
 *   for l = L-1 .. 0: BEFORE_BACKWARD(l), [layer_forward(l) again if recomputed; without
 *                     its attention forward under keep-attention],
 *                     layer_backward(l), AFTER_BACKWARD(l);
 *   embedding backward.
 * A group hook (fm_schedule_add_group_hook) is also called at BEFORE_EMBED (layer -1) before the
 * embedding, BEFORE_HEAD (layer L) before the head, AFTER_HEAD_BACKWARD (L) after the head's
 * backward, and BEFORE_EMBED_BACKWARD / AFTER_EMBED_BACKWARD (-1) around the embedding's backward.
 * Hooks run in the order they were added. A hook that returns an error stops the step there and
 * the status is returned (the step's gradients are then incomplete). */
#ifndef FM_SCHEDULE_H
#define FM_SCHEDULE_H

#include "../model/fm_model.h"
#include "fm_recompute.h"

typedef enum fm_hook_point {
    FM_HOOK_BEFORE_FORWARD = 0,
    FM_HOOK_AFTER_FORWARD,
    FM_HOOK_BEFORE_BACKWARD, /* before the layer's recompute (a restored boundary is needed by it) */
    FM_HOOK_AFTER_BACKWARD,  /* the layer's parameter gradients for this micro-batch are complete */
    /* The parameter groups outside the layers (ZeRO-3's gathers and reduce-scatters,
     * train/fm_zero3.h), called only for hooks added with fm_schedule_add_group_hook; layer is
     * -1 at the embedding's points and L at the head's. */
    FM_HOOK_BEFORE_EMBED,          /* before the embedding's forward */
    FM_HOOK_BEFORE_HEAD,           /* before the final norm and head (forward, or forward and backward) */
    FM_HOOK_AFTER_HEAD_BACKWARD,   /* the final norm's and head's gradients are complete */
    FM_HOOK_BEFORE_EMBED_BACKWARD, /* before the embedding's backward */
    FM_HOOK_AFTER_EMBED_BACKWARD,  /* the embedding's gradients are complete */
    FM_HOOK_COUNT
} fm_hook_point;

const char *fm_hook_point_name(fm_hook_point p);

/* A hook: called at `point` of layer `layer` (0-based) of micro-batch m. Returns FM_OK, or an
 * error (with fm_error's message) that stops the step. */
typedef fm_status (*fm_hook_fn)(void *user, fm_model *m, fm_hook_point point, int64_t layer);

#define FM_SCHEDULE_MAX_HOOKS 8

typedef struct fm_schedule {
    fm_recompute_policy recompute;
    struct {
        fm_hook_fn fn;
        void *user;
        bool groups; /* also called at the embedding's and head's points */
    } hooks[FM_SCHEDULE_MAX_HOOKS];
    int n_hooks;
    int64_t restores_boundaries; /* offloaded boundaries a hook brings back in backward (the
                                    offload policy, fm_sco.h, sets it); backward refuses a model
                                    whose layout offloads more (m->a.n_offloaded_boundaries) */
    /* The optimizer overlap (train/fm_optim_overlap.h): when param_ready, the compute stream
     * waits, before the embedding, event param_event0; before layer l's forward (ahead of its
     * BEFORE_FORWARD hooks), param_event0 + 1 + l; before the head, param_event0 + L + 1: each
     * the last update of those parameters. The host never waits. */
    bool param_ready;
    int param_event0;
} fm_schedule;

/* A schedule for model m with its layout's recompute set (m->a.recompute) and no hooks. */
void fm_schedule_init(fm_schedule *s, const fm_model *m);

/* Adds a hook (called at every point; it filters the points it wants). Errors: FM_ERR_ARG when
 * FM_SCHEDULE_MAX_HOOKS are already added or fn is NULL. */
fm_status fm_schedule_add_hook(fm_schedule *s, fm_hook_fn fn, void *user);
/* The same for a hook that is also called at the embedding's and head's points (BEFORE_EMBED ..
 * AFTER_EMBED_BACKWARD, the header's comment). Errors: as fm_schedule_add_hook. */
fm_status fm_schedule_add_group_hook(fm_schedule *s, fm_hook_fn fn, void *user);

/* Forward of the batch b (model/fm_batch.h: tokens [B,T] of the model's active shape, and its
 * targets) through the loss, saving what backward needs. The losses land in m->a.results; with out
 * non-NULL the call ends with a sync point and fills out->ce, aux, z, n_valid
 * (fm_model_read_loss); NULL leaves them on the device and the host never waits. Without targets
 * (b->targets NULL) only m->a.logits is produced (for sampling; a linear-CE layout needs targets).
 * Errors: FM_ERR_ARG from fm_batch_check (b's shape is not m's active one, a token or target out
 * of range); a hook's, or the model's communicator's (m->mesh.comm: the valid-target count, the loss
 * sums and the router statistics are reduced over it). */
fm_status fm_schedule_forward(fm_schedule *s, fm_model *m, const fm_batch *b, fm_loss *out);

/* Backward of the last forward with targets: ACCUMULATES into m->p.grads, scaled by `scale`
 * (1/G for G-step accumulation); under the linear cross-entropy this runs the operator again
 * with gradients. Errors: the first of a hook's, the model's communicator's, the vocabulary
 * ring's (fm_model_head_backward), the expert-parallel operator's (fm_model_layer_backward),
 * each returned where it happens (the step stops there); FM_ERR_ARG when m's layout
 * offloads boundaries (m->a.n_offloaded_boundaries > 0) that no attached policy restores
 * (s->restores_boundaries). */
fm_status fm_schedule_backward(fm_schedule *s, fm_model *m, float scale);

/* Forward with targets and backward in one call (what the trainer runs): the same results as
 * fm_schedule_forward + fm_schedule_backward, but the linear cross-entropy runs once, fused.
 * b must have targets (FM_ERR_ARG otherwise). out as in fm_schedule_forward (the trainer passes NULL and copies m->a.results to pinned
 * memory, read once at the step's end). Errors: as fm_schedule_forward's and
 * fm_schedule_backward's, the first one returned. */
fm_status fm_schedule_train_step(fm_schedule *s, fm_model *m, const fm_batch *b, float scale, fm_loss *out);

/* The same with the default schedule of m (its layout's recompute set, no hooks): for
 * evaluation, sampling, tools and tests. Backward and train_step need a layout without offloaded
 * boundaries (FM_ERR_ARG otherwise). Errors: the model's communicator's (none when m->mesh.comm is
 * NULL). */
fm_status fm_schedule_default_forward(fm_model *m, const fm_batch *b, fm_loss *out);
fm_status fm_schedule_default_backward(fm_model *m, float scale);
fm_status fm_schedule_default_train_step(fm_model *m, const fm_batch *b, float scale, fm_loss *out);

#endif
