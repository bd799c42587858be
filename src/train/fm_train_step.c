/* One optimizer step: accumulate, check, clip, update (see fm_train_step.h). */
#include "fm_train_step.h"

#include "../io/fm_checkpoint.h"
#include "fm_param_store.h"
#include "fm_zero3.h"
#include "fm_train_ep.h"

#include <math.h>
#include <string.h>

fm_status fm_step_ws_init(fm_step_ws *w, fm_model *m, int64_t grad_accum) {
    memset(w, 0, sizeof *w);
    fm_schedule_init(&w->sched, m);
    w->grad_accum = grad_accum;
    w->n_res = fm_model_results_count(&m->cfg);
    const size_t bytes = (size_t)(grad_accum + 1) * (size_t)w->n_res * sizeof(double);
    FM_TRY(fm_arena_init_backend_kind(&w->results, "step results", bytes, &m->be, FM_BUFFER_PINNED));
    w->res = fm_arena_alloc(&w->results, bytes);
    w->n_valid = fm_malloc(sizeof(int64_t) * (size_t)grad_accum);
    w->batches = fm_malloc(sizeof(fm_batch) * (size_t)grad_accum);
    if (!w->n_valid || !w->batches)
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the step's counters (%lld micro-batches)",
                        (long long)grad_accum);
    memset(w->batches, 0, sizeof(fm_batch) * (size_t)grad_accum);
    for (int64_t g = 0; g < grad_accum; g++) FM_TRY(fm_batch_alloc(&w->batches[g], m->a.B, m->a.T, true));
    return FM_OK;
}

fm_status fm_step_ws_enable_overlap(fm_step_ws *w, fm_model *m) {
    FM_TRY(fm_optim_overlap_init(&w->overlap, m));
    fm_optim_overlap_attach(&w->overlap, &w->sched);
    w->overlap_on = true;
    return FM_OK;
}

void fm_step_ws_flush(fm_step_ws *w, fm_model *m) {
    if (w->overlap_on) fm_optim_overlap_flush(&w->overlap, m);
}

void fm_step_ws_free(fm_step_ws *w) {
    fm_optim_overlap_free(&w->overlap);
    fm_arena_free(&w->results);
    fm_free(w->n_valid);
    if (w->batches)
        for (int64_t g = 0; g < w->grad_accum; g++) fm_batch_free(&w->batches[g]);
    fm_free(w->batches);
    memset(w, 0, sizeof *w);
}

/* What a stopped run leaves: "the last good checkpoint stays: " + its folder, or that there is
 * none yet (the message's two %s). */
static const char *last_good(const fm_train_opts *o, char *buf, size_t n) {
    if (o->out_dir && fm_ckpt_find_latest(o->out_dir, buf, n, NULL) == FM_OK) return "the last good checkpoint stays: ";
    buf[0] = 0;
    return "no checkpoint of this run exists yet";
}

/* ---- data parallelism (fm_train_step.h): this rank's windows, the gradients' reduction ---- */

static const fm_comm_dtype act_comm_dtype = sizeof(fm_act) == sizeof(float) ? FM_COMM_F32 : FM_COMM_BF16;

/* The accumulated gradients summed over dp, and their sum of squares into m->results (the
 * global norm's square on every rank): all-reduced whole (replicas), or reduce-scattered so
 * that this rank's block of the padded buffer holds its shard's sum (ZeRO-1/2), squares summed
 * over the shard and then over dp. One rank: the sum of squares of the whole table. */
static fm_status reduce_grads(fm_model *m, const fm_comm *dp, const fm_param_store *zps, const fm_train_ep *ep) {
    if (ep) return fm_train_ep_reduce_grads(m, dp, ep); /* expert parallelism (fm_train_ep.h) */
    double *sq = m->a.results + FM_RESULT_SUMSQ;
    if (!dp || fm_comm_size(dp) == 1) { /* one rank: as before data parallelism */
        fm_grad_sumsq(m, sq);
        return dp ? fm_comm_all_reduce(dp, sq, sq, 1, FM_COMM_F64, FM_COMM_SUM, 0) : FM_OK;
    }
    if (!zps) {
        FM_TRY(fm_comm_all_reduce(dp, m->p.grads, m->p.grads, m->p.n_params, act_comm_dtype, FM_COMM_SUM, 0));
        fm_grad_sumsq(m, sq);
        return FM_OK;
    }
    const int64_t S = zps->shard_len;
    fm_act *mine = m->p.grads + (size_t)fm_comm_rank(dp) * (size_t)S;
    FM_TRY(fm_comm_reduce_scatter(dp, m->p.grads, mine, S, act_comm_dtype, FM_COMM_SUM, 0));
    m->be.ops->sumsq(m->be.ctx, sq, mine, S, false); /* the padding past n_params is zero */
    return fm_comm_all_reduce(dp, sq, sq, 1, FM_COMM_F64, FM_COMM_SUM, 0);
}

/* ZeRO-1/2's update: this rank's shard, then every rank's updated weights gathered in place. */
static fm_status update_shard(fm_model *m, const fm_optimizer_ops *optim, void *opt, const fm_comm *dp,
                              const fm_param_store *zps, double lr, float clip) {
    optim->step_begin(opt);
    optim->step_shard(opt, m, zps->shard_begin, zps->shard_end, lr, clip);
    const int64_t S = zps->shard_len;
    return fm_comm_all_gather(dp, m->p.params + (size_t)fm_comm_rank(dp) * (size_t)S, m->p.params, S, act_comm_dtype, 0);
}

/* ---- one step ---- */

void fm_train_step_zero_grads(fm_model *m, fm_step_ws *w) {
    fm_model_fp8_cache_invalidate(m); /* --fp8-weight-cache: the last update changed the weights */
    fm_phase_mark(&m->be, FM_PHASE_OPTIMIZER);
    if (w->zero3) fm_zero3_zero_grads(w->zero3, m); /* the shard's: the hooks add each group's into it */
    else if (!(w->overlap_on && w->overlap.grads_zeroed)) /* else the last update zeroed them, group by group */
        m->be.ops->mem_set(m->be.ctx, m->p.grads, 0, sizeof(fm_act) * (size_t)m->p.n_params);
    w->overlap.grads_zeroed = false;
}

fm_status fm_train_step_reduce(fm_model *m, const fm_comm *dp, fm_step_ws *w) {
    const size_t res_bytes = (size_t)w->n_res * sizeof(double);
    fm_phase_mark(&m->be, FM_PHASE_OPTIMIZER);
    if (w->zero3) FM_TRY(fm_zero3_grad_sumsq(w->zero3, m, m->a.results + FM_RESULT_SUMSQ)); /* reduced in the hooks */
    else FM_TRY(reduce_grads(m, dp, w->zero_ps, w->ep)); /* data parallelism: the gradients' sum and its global norm */
    const double *gres = w->res + w->grad_accum * w->n_res;
    m->be.ops->copy_async(m->be.ctx, (double *)gres, m->a.results, res_bytes, FM_COPY_D2H, FM_STREAM_COMPUTE);
    m->be.ops->stream_sync(m->be.ctx, FM_STREAM_COMPUTE); /* sync point "step end": losses, gradient norm */
    return m->be.ops->status(m->be.ctx);
}

fm_status fm_train_step_apply(fm_model *m, const fm_optimizer_ops *optim, void *opt, const fm_comm *dp, fm_step_ws *w,
                              const fm_train_opts *o, int64_t step, double *gnorm_out, double *lr_out) {
    char lg[4096];
    const double gnorm = sqrt(w->res[w->grad_accum * w->n_res + FM_RESULT_SUMSQ]);
    if (!isfinite(gnorm))
        return fm_error(FM_ERR_NUMERIC, "step %lld: the gradient norm is not finite (%g); training stopped and no "
                        "checkpoint was written for this step (%s%s); lower --lr", (long long)step, gnorm,
                        last_good(o, lg, sizeof lg), lg);
    const float clip = (o->grad_clip > 0 && gnorm > o->grad_clip) ? (float)(o->grad_clip / gnorm) : 1.0f;
    const double lr = fm_lr_at(step, o->steps, o->warmup, o->lr, o->min_lr);
    if (w->zero3) { /* ZeRO-3: this rank's shard; the next forward gathers the weights */
        FM_TRY(fm_zero3_update(w->zero3, m, optim, opt, lr, clip));
        m->be.ops->sync(m->be.ctx); /* sync point "step clock" */
    } else if (w->zero_ps && dp && fm_comm_size(dp) > 1) { /* ZeRO-1/2: this rank's shard, then the weights gathered */
        FM_TRY(update_shard(m, optim, opt, dp, w->zero_ps, lr, clip));
        m->be.ops->sync(m->be.ctx); /* sync point "step clock": the step's time includes its update */
    } else {
        optim->step_begin(opt);
        if (w->overlap_on) { /* issued on the update stream; the next step's forward waits per layer */
            fm_optim_overlap_issue(&w->overlap, m, optim, opt, lr, clip);
        } else {
            optim->step_range(opt, m, 0, m->p.n_tensors, lr, clip); /* every tensor: the whole table */
            m->be.ops->sync(m->be.ctx); /* sync point "step clock": the step's time includes its update */
        }
    }
    FM_TRY(m->be.ops->status(m->be.ctx));
    *gnorm_out = gnorm;
    *lr_out = lr;
    return FM_OK;
}

fm_status fm_train_step(fm_model *m, const fm_optimizer_ops *optim, void *opt, const fm_comm *dp, fm_step_ws *w,
                        const fm_batch *mb, const fm_train_opts *o, int64_t step, fm_step_stats *out) {
    FM_ASSERT(w->grad_accum == o->grad_accum);
    const int64_t G = o->grad_accum, n_res = w->n_res;
    const size_t res_bytes = (size_t)n_res * sizeof(double);
    fm_train_step_zero_grads(m, w);
    for (int64_t g = 0; g < G; g++) {
        FM_TRY(fm_schedule_train_step(&w->sched, m, &mb[g], 1.0f / (float)G, NULL));
        w->n_valid[g] = m->a.n_valid;
        /* the micro-batch's losses to pinned memory, read at the step's sync point */
        m->be.ops->copy_async(m->be.ctx, w->res + g * n_res, m->a.results, res_bytes, FM_COPY_D2H, FM_STREAM_COMPUTE);
    }
    FM_TRY(fm_train_step_reduce(m, dp, w));
    double ce = 0, aux = 0, z = 0;
    char lg[4096];
    for (int64_t g = 0; g < G; g++) {
        fm_loss l;
        fm_model_loss_from_results(m, w->res + g * n_res, w->n_valid[g], &l);
        if (!isfinite(l.ce) || !isfinite(l.aux) || !isfinite(l.z))
            return fm_error(FM_ERR_NUMERIC, "step %lld: the loss is not finite (cross-entropy %g, aux %g, z %g); "
                            "training stopped and no checkpoint was written for this step (%s%s); lower --lr or "
                            "raise --warmup", (long long)step, l.ce, l.aux, l.z, last_good(o, lg, sizeof lg),
                            lg);
        ce += l.ce / (double)G;
        aux += l.aux / (double)G;
        z += l.z / (double)G;
    }
    FM_TRY(fm_train_step_apply(m, optim, opt, dp, w, o, step, &out->gnorm, &out->lr));
    out->ce = ce;
    out->aux = aux;
    out->z = z;
    return FM_OK;
}
