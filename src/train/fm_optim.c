#include "fm_optim.h"

#include <math.h>

size_t fm_adamw_state_bytes(int64_t n_params, bool bf16_moments) {
    return 2 * fm_arena_round((size_t)n_params * (bf16_moments ? 2 : sizeof(float)));
}

void fm_adamw_init(fm_adamw *opt, fm_model *m, double beta1, double beta2, double eps, double weight_decay,
                   bool bf16_moments) {
    fm_arena *a = &m->arena[FM_LIVE_MODEL_STATE];
    opt->moments_dtype = bf16_moments ? FM_DTYPE_BF16 : FM_DTYPE_F32;
    const size_t bytes = (size_t)m->n_params * fm_dtype_size(opt->moments_dtype);
    opt->m = fm_arena_alloc(a, bytes);
    opt->v = fm_arena_alloc(a, bytes);
    m->be.ops->mem_set(m->be.ctx, opt->m, 0, bytes);
    m->be.ops->mem_set(m->be.ctx, opt->v, 0, bytes);
    opt->step = 0;
    opt->beta1 = beta1;
    opt->beta2 = beta2;
    opt->eps = eps;
    opt->weight_decay = weight_decay;
}

void fm_adamw_step(fm_adamw *opt, fm_model *m, double lr, float grad_scale) {
    opt->step++;
    const float bc1 = (float)(1.0 - pow(opt->beta1, (double)opt->step));
    const float bc2 = (float)(1.0 - pow(opt->beta2, (double)opt->step));
    /* Consecutive tensors with the same decay flag form one launch. */
    int i = 0;
    while (i < m->n_tensors) {
        const bool decay = m->table[i].decay;
        const int64_t off = m->table[i].offset;
        int64_t n = 0;
        int j = i;
        while (j < m->n_tensors && m->table[j].decay == decay && m->table[j].offset == off + n) {
            n += m->table[j].numel;
            j++;
        }
        float *master = (void *)m->master == (void *)m->params ? NULL : m->master + off;
        const size_t mo = (size_t)off * fm_dtype_size(opt->moments_dtype);
        m->be.ops->adamw(m->be.ctx, m->params + off, m->grads + off, master, (char *)opt->m + mo, (char *)opt->v + mo,
                         opt->moments_dtype, n, (float)lr,
                         (float)opt->beta1, (float)opt->beta2, (float)opt->eps,
                         decay ? (float)opt->weight_decay : 0.0f, bc1, bc2, grad_scale);
        i = j;
    }
}

void fm_grad_sumsq(fm_model *m, double *out) { m->be.ops->sumsq(m->be.ctx, out, m->grads, m->n_params, false); }

double fm_lr_at(int64_t s, int64_t total, int64_t warmup, double lr, double min_lr) {
    if (warmup > 0 && s <= warmup) return lr * (double)s / (double)warmup;
    if (total <= warmup) return lr;
    double p = (double)(s - warmup) / (double)(total - warmup);
    if (p > 1) p = 1;
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + cos(3.14159265358979323846 * p));
}
