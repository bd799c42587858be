/* AdamW with per-tensor weight-decay masks, global-norm clipping and the learning-rate
 * schedule (linear warmup, then cosine decay to min_lr).
 *
 * State: Adam moments m and v with the layout of the flat parameter buffer, fp32 (default) or
 * bf16 (--bf16-moments: 4 instead of 8 bytes per parameter; the update is computed in fp32 and
 * only the stored moments are rounded); on the CPU backend the fp32 parameters are the master
 * weights. */
#ifndef FM_OPTIM_H
#define FM_OPTIM_H
#include "../model/fm_model.h"

typedef struct fm_adamw {
    void *m, *v;       /* [n_params] each of moments_dtype, taken from the model-state arena */
    fm_dtype moments_dtype; /* FM_DTYPE_F32 or FM_DTYPE_BF16 */
    int64_t step;      /* optimizer steps taken (bias correction uses step+1 on the next) */
    double beta1, beta2, eps, weight_decay;
} fm_adamw;

/* Bytes of optimizer state for n_params parameters (m and v): 8 bytes per parameter with fp32
 * moments, 4 with bf16_moments. */
size_t fm_adamw_state_bytes(int64_t n_params, bool bf16_moments);

/* Takes m and v (zeroed) from the model's model-state arena, which fm_model_create sized with
 * fm_adamw_state_bytes(). */
void fm_adamw_init(fm_adamw *opt, fm_model *m, double beta1, double beta2, double eps, double weight_decay,
                   bool bf16_moments);

/* One AdamW step (Loshchilov & Hutter, arXiv 1711.05101) over every tensor of the parameter
 * table at learning rate lr; gradients are multiplied by grad_scale first (clipping). Norm
 * weights (table's decay = false) get no weight decay. */
void fm_adamw_step(fm_adamw *opt, fm_model *m, double lr, float grad_scale);

/* The sum of squares of all gradients (double) into *out (backend memory, assigned): the global
 * L2 norm's square, read by the host at the step's sync point. Issues work only. */
void fm_grad_sumsq(fm_model *m, double *out);

/* Learning rate at 1-based step s of `total`: lr*s/warmup for s <= warmup, then cosine from lr
 * down to min_lr at s = total: min_lr + (lr-min_lr)*0.5*(1+cos(pi*(s-warmup)/(total-warmup))). */
double fm_lr_at(int64_t s, int64_t total, int64_t warmup, double lr, double min_lr);

#endif
