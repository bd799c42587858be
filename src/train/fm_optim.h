/* The optimizer interface (DESIGN.md §3: train/ owns the model-state live set with the parameter
 * store) and its AdamW; global-norm clipping's sum of squares; the learning-rate schedule (linear
 * warmup, then cosine decay to min_lr).
 *
 * An optimizer is a table of functions over its own state (fm_optimizer_ops): the bytes of state
 * it needs for n parameters (for the plan and the parameter store's arena), init (its state from
 * the store's arena), a step over a range of the parameter table's tensors (the whole table
 * today; layer by layer or bucket by bucket for the optimizer overlap and the streamed AdamW of
 * the next issues), and its tensors for checkpoints. */
#ifndef FM_OPTIM_H
#define FM_OPTIM_H
#include "../model/fm_model.h"
#include "../plan/fm_plan.h"
#include "fm_param_store.h"

/* One tensor of optimizer state for checkpoints: n_params elements of dtype in the parameter
 * table's layout, saved as "<prefix><HF name>" (fp32 on disk). An optimizer that owns the fp32
 * master (the streamed AdamW) names it too, prefix "master."; the checkpoint then saves the
 * weights and "master." from it. At most 3 per optimizer. */
/* The prefix of bf16-kahan's compensation buffer in the optimizer file; a checkpoint without it
 * (another recipe's) loads with the buffer at zero. */
#define FM_KAHAN_PREFIX "kahan_comp."

typedef struct fm_optim_state {
    const char *prefix; /* "exp_avg.", "exp_avg_sq.", "master." */
    void *base;         /* backend memory */
    fm_dtype dtype;
    bool host;          /* base is host memory (pinned: the streamed optimizer's), not the backend's */
    void *dev;          /* dev_len > 0: elements [0, dev_len) are at dev (backend memory) and element
                           i >= dev_len at base + (i - dev_len) (the partially offloaded AdamW's
                           moments, fm_offload_adamw.h); 0: every element at base */
    int64_t dev_len;
} fm_optim_state;

typedef struct fm_optimizer_ops {
    const char *name;
    /* Bytes of state for n_params parameters (fm_param_store_create's optimizer_bytes). */
    size_t (*state_bytes)(const void *self, int64_t n_params);
    /* Takes and zeroes its state from the store's arena. */
    void (*init)(void *self, fm_param_store *ps, const fm_backend *be);
    /* Starts an update (bias correction counts it); then step_range over every tensor once. */
    void (*step_begin)(void *self);
    /* The update of tensors [t0, t1) of m's table at learning rate lr; gradients are multiplied
     * by grad_scale first (clipping). Issues work only. */
    void (*step_range)(void *self, fm_model *m, int t0, int t1, double lr, float grad_scale);
    /* Its state tensors for checkpoints into out[cap]; returns how many. */
    int (*state_tensors)(void *self, fm_optim_state *out, int cap);
    /* ZeRO-1/2 (fm_param_store_create_sharded): the update of the flat parameters [p0, p1) only,
     * the store's shard, whose state init took (state element i is parameter shard_begin + i);
     * each table tensor's decay flag applies to its part of the range. NULL: the optimizer cannot
     * run on a shard (the streamed AdamW). Issues work only. */
    void (*step_shard)(void *self, fm_model *m, int64_t p0, int64_t p1, double lr, float grad_scale);
    /* ZeRO-3 (train/fm_zero3.h): the update of the flat parameters [p0, p1) held elsewhere than
     * m's buffers: their weights at w, gradients at g and fp32 master at master (NULL: the
     * weights are the master, fp32 builds), each element p0 first, backend memory; their state
     * from state element s0. Each table tensor's decay flag applies to its part of the range.
     * NULL: the optimizer cannot (the streamed AdamW). Issues work only. */
    void (*step_at)(void *self, fm_model *m, int64_t p0, int64_t p1, fm_act *w, const fm_act *g, float *master,
                    int64_t s0, double lr, float grad_scale);
} fm_optimizer_ops;

/* AdamW (Loshchilov & Hutter, arXiv 1711.05101) with per-tensor weight-decay masks. State: Adam
 * moments m and v with the layout of the flat parameter buffer, fp32 (default) or bf16
 * (--bf16-moments: 4 instead of 8 bytes per parameter; the update is computed in fp32 and only
 * the stored moments are rounded); on the CPU backend the fp32 parameters are the master weights. */
typedef struct fm_adamw {
    void *m, *v;       /* [n_params] each of moments_dtype, taken from the parameter store's arena */
    fm_master_recipe recipe; /* --master-weights (fm_adamw_lowp.h): fp32 master (the adamw op), or bf16
                                weights updated by adamw_bf16w, Kahan-compensated or stochastically
                                rounded */
    uint16_t *comp;    /* bf16-kahan: the compensation buffer [state_len] bf16, from the store's arena */
    uint64_t seed;     /* bf16-sr: the run's seed (the random bits of step s: fm_sr_key(seed, s)) */
    fm_dtype moments_dtype; /* FM_DTYPE_F32 or FM_DTYPE_BF16 */
    int64_t step;      /* optimizer steps taken (bias correction uses step+1 on the next) */
    int64_t state_begin, state_len; /* m and v hold parameters [state_begin, + state_len): the
                                       store's shard (the whole table unsharded) */
    double beta1, beta2, eps, weight_decay;
} fm_adamw;

extern const fm_optimizer_ops fm_adamw_ops;

/* An AdamW's hyper-parameters (state taken later by fm_adamw_ops.init). */
void fm_adamw_config(fm_adamw *opt, double beta1, double beta2, double eps, double weight_decay, bool bf16_moments);

/* Bytes of optimizer state for n_params parameters (m and v): 8 bytes per parameter with fp32
 * moments, 4 with bf16_moments. */
size_t fm_adamw_state_bytes(int64_t n_params, bool bf16_moments);

/* The state recipe (--master-weights; fm_adamw_lowp.h) of an AdamW configured by
 * fm_adamw_config (which sets fp32), before init: its state then adds fm_adamw_recipe_bytes and
 * the update runs the backend's adamw_bf16w with the random bits of (seed, step, index). Where the
 * weights are fp32 (the CPU build) the caller keeps them at bf16 values (fm_adamw_round_weights). */
void fm_adamw_set_recipe(fm_adamw *opt, fm_master_recipe recipe, uint64_t seed);

/* Bytes the recipe adds to AdamW's state for n_params parameters: r(2 n) for bf16-kahan's
 * buffer, else 0 (the fp32 master, where there is one, is the parameter store's). */
size_t fm_adamw_recipe_bytes(int64_t n_params, fm_master_recipe recipe);

/* Rounds n fp32 weights w (host memory) to bf16 values in place (nearest even): the fp32 build's
 * weights under a bf16 recipe, after an init or a load (an fp32 run's checkpoint). */
void fm_adamw_round_weights(float *w, int64_t n);

/* The model-state live set's bound for a plan (DESIGN.md §2): the parameter store's bytes plus
 * AdamW's, for activations of act_bytes, over the data-parallel layout *lay (NULL or zeroed: the
 * whole replica; lay->master_recipe: a bf16 recipe drops the store's fp32 master where there is
 * one (fm_param_store_bytes_recipe) and bf16-kahan adds its buffer; one rank or ZeRO-1/2): zero 1 over lay->ranks > 1: ZeRO-1/2 (the store of
 * fm_param_store_create_sharded, weights and grads padded to ranks * S, Adam m and v of S =
 * ceil(n / ranks) parameters: a per-rank bound); zero 3: ZeRO-3 (train/fm_zero3.h:
 * fm_zero3_state_bytes, the shard's 16 B/param plus two gathered groups and one group's
 * gradients); zero 0 or one rank: the whole replica. desc (200 bytes) gets the formula in words.
 * The plan request carries it (plan/ asks its caller; it includes nothing of train/). */
size_t fm_model_state_bound(const fm_config *cfg, const fm_state_layout *lay, size_t act_bytes, bool bf16_moments,
                            char desc[200]);

/* The sum of squares of all gradients (double) into *out (backend memory, assigned): the global
 * L2 norm's square, read by the host at the step's sync point. Issues work only. */
void fm_grad_sumsq(fm_model *m, double *out);

/* Learning rate at 1-based step s of `total`: lr*s/warmup for s <= warmup, then cosine from lr
 * down to min_lr at s = total: min_lr + (lr-min_lr)*0.5*(1+cos(pi*(s-warmup)/(total-warmup))). */
double fm_lr_at(int64_t s, int64_t total, int64_t warmup, double lr, double min_lr);

#endif
