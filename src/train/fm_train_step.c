/* One optimizer step: accumulate, check, clip, update (see fm_train_step.h). */
#include "fm_train_step.h"

#include <math.h>

fm_status fm_train_step(fm_model *m, fm_adamw *opt, const fm_dataset *train, fm_rng *data_rng,
                        const fm_train_opts *o, int64_t step, fm_step_stats *out) {
    fm_phase_mark(&m->be, FM_PHASE_OPTIMIZER);
    m->be.ops->mem_set(m->be.ctx, m->grads, 0, sizeof(fm_act) * (size_t)m->n_params);
    double ce = 0, aux = 0, z = 0;
    for (int64_t g = 0; g < o->grad_accum; g++) {
        fm_dataset_sample_batch(train, data_rng, o->micro_batch, o->seq_len, m->h_tokens, m->h_targets);
        fm_loss l;
        fm_model_train_step(m, 1.0f / (float)o->grad_accum, &l);
        if (!isfinite(l.ce) || !isfinite(l.aux) || !isfinite(l.z))
            return fm_error(FM_ERR_NUMERIC, "step %lld: the loss is not finite (cross-entropy %g, aux %g, z %g); "
                            "training stopped and no checkpoint was written for this step (the last good "
                            "one in %s stays); lower --lr or raise --warmup", (long long)step, l.ce, l.aux, l.z,
                            o->out_dir);
        ce += l.ce / (double)o->grad_accum;
        aux += l.aux / (double)o->grad_accum;
        z += l.z / (double)o->grad_accum;
    }
    fm_phase_mark(&m->be, FM_PHASE_OPTIMIZER);
    const double gnorm = fm_grad_norm(m);
    if (!isfinite(gnorm))
        return fm_error(FM_ERR_NUMERIC, "step %lld: the gradient norm is not finite (%g); training stopped and no "
                        "checkpoint was written for this step (the last good one in %s stays); lower --lr",
                        (long long)step, gnorm, o->out_dir);
    const float clip = (o->grad_clip > 0 && gnorm > o->grad_clip) ? (float)(o->grad_clip / gnorm) : 1.0f;
    const double lr = fm_lr_at(step, o->steps, o->warmup, o->lr, o->min_lr);
    fm_adamw_step(opt, m, lr, clip);
    m->be.ops->sync(m->be.ctx); /* the step's time includes its update */
    out->ce = ce;
    out->aux = aux;
    out->z = z;
    out->gnorm = gnorm;
    out->lr = lr;
    return FM_OK;
}
