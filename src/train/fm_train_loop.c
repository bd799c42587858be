/* fm_train: set up the run, then the loop: one optimizer step (fm_train_step), its report,
 * validation every --eval-every steps and at the end, a checkpoint every --save-every steps and
 * at the end, and the stop after --exit-after steps of this invocation. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "../io/fm_checkpoint.h"
#include "fm_train_internal.h"
#include "fm_train_step.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static fm_status train_loop(run *r, train_state *ts, fm_rng *data_rng) {
    const fm_train_opts *o = r->o;
    fm_model *m = &r->m;
    const int64_t tokens_per_step = o->micro_batch * o->seq_len * o->grad_accum;
    double phase_discard[FM_PHASE_COUNT];
    (void)m->be.ops->prof_collect(m->be.ctx, phase_discard); /* the profile starts with step 1 */
    const double t0 = now_s();
    const int64_t first = ts->step + 1;
    if (first > o->steps)
        fprintf(stderr, "note: --resume: the run is at step %lld, already at or past --steps %lld: nothing to train "
                "(give a larger --steps to continue it)\n", (long long)ts->step, (long long)o->steps);
    int64_t ran = 0;
    uint64_t syncs0 = m->be.ops->host_sync_count(m->be.ctx);
    for (int64_t step = first; step <= o->steps; step++) {
        const double ts0 = now_s();
        fm_step_stats st;
        FM_TRY(fm_train_step(m, r->optim, r->opt_self, &r->world, &r->step, &r->train, data_rng, o, step, &st));
        double phase_ms[FM_PHASE_COUNT];
        const bool profiled = m->be.ops->prof_collect(m->be.ctx, phase_ms);
        fm_phase_mark(&m->be, FM_PHASE_OTHER);
        const uint64_t syncs1 = m->be.ops->host_sync_count(m->be.ctx);
        ts->step = step;
        ts->opt_step = r->opt.step;
        ts->tokens_seen += tokens_per_step;
        ts->data_rng = data_rng->state;
        ran++;

        const double t1 = now_s();
        fm_step_report rep = {step, st.ce, st.aux, st.z, st.lr, st.gnorm};
        rep.step_s = t1 - ts0;
        rep.elapsed = t1 - t0;
        rep.tok_s = (double)tokens_per_step / rep.step_s;
        rep.eta = rep.elapsed / (double)ran * (double)(o->steps - step);
        rep.val = NAN;
        rep.first = ran == 1;
        rep.phase_ms = profiled ? phase_ms : NULL;
        rep.host_syncs = syncs1 - syncs0;
        rep.tokens_seen = ts->tokens_seen;
        const bool last = step == o->steps || (o->exit_after > 0 && ran == o->exit_after);
        const bool eval = (o->eval_every > 0 && step % o->eval_every == 0) || last;
        const bool save = !o->no_checkpoint && ((o->save_every > 0 && step % o->save_every == 0) || last);
        if (eval || save || last || (o->report_memory && ran == 1)) /* they read the weights, or measure */
            fm_step_ws_flush(&r->step, m);
        if (eval)
            FM_TRY(fm_evaluate(m, &r->val, o->eval_batches, &rep.val, NULL));
        if (!o->quiet && (step % (o->log_every > 0 ? o->log_every : 1) == 0 || last || !isnan(rep.val)))
            fm_train_print_step(r, &rep);
        fm_train_metrics_begin(r, &rep);
        if (o->report_memory && (ran == 1 || last)) {
            fm_train_metrics_memory(r);
            double discard[FM_PHASE_COUNT]; /* the report's read-back is not the next step's time */
            (void)m->be.ops->prof_collect(m->be.ctx, discard);
        }
        fm_train_metrics_end(r);

        if (save) {
            /* An update can overflow the weights while the loss and gradients it came from were
             * finite: never save such weights as the last good checkpoint. */
            double wsq;
            m->be.ops->sumsq(m->be.ctx, m->results + FM_RESULT_SUMSQ, m->params, m->n_params, false);
            m->be.ops->stream_sync(m->be.ctx, FM_STREAM_COMPUTE); /* sync point "checkpoint" */
            m->be.ops->copy(m->be.ctx, &wsq, m->results + FM_RESULT_SUMSQ, sizeof wsq, FM_COPY_D2H);
            if (!isfinite(wsq))
                return fm_error(FM_ERR_NUMERIC, "step %lld: the weights are no longer finite after the optimizer update "
                                "(sum of squares %g); no checkpoint was written for this step (the last good one in %s "
                                "stays); lower --lr or raise --warmup", (long long)step, wsq, o->out_dir);
            FM_TRY(fm_train_save_checkpoint(r, ts));
        }
        if (o->exit_after > 0 && ran == o->exit_after) break;
        syncs0 = m->be.ops->host_sync_count(m->be.ctx); /* evaluation, reports and saving are not the step's */
    }
    return FM_OK;
}

static fm_status train_impl(run *r) {
    train_state ts = {0};
    fm_rng data_rng;
    FM_TRY(fm_train_setup(r, &ts, &data_rng));
    return train_loop(r, &ts, &data_rng);
}

fm_status fm_train(const fm_train_opts *o) {
    fm_train_opts oo = *o;
    int launch_rank = 0, launch_size = 1; /* many ranks: only rank 0 prints (and writes, fm_train_setup) */
    if (fm_comm_launcher(&launch_rank, &launch_size, NULL) == FM_OK && launch_rank != 0) oo.quiet = true;
    const bool need = oo.steps == 0 || oo.seq_len == 0 || oo.micro_batch == 0 || oo.grad_accum == 0;
    if (oo.resume && need) { /* flags not given: the run's own total and shape, from its latest checkpoint */
        char ck[4096], p[4200];
        train_state ts = {0};
        bool have = false;
        if (oo.out_dir && fm_ckpt_find_latest(oo.out_dir, ck, sizeof ck, NULL) == FM_OK) {
            snprintf(p, sizeof p, "%s/%s", ck, FM_CKPT_STATE_FILE);
            have = fm_train_state_read(p, &ts) == FM_OK;
        }
        fm_train_opts dflt;
        fm_train_opts_default(&dflt);
        if (oo.steps == 0) {
            oo.steps = have && ts.steps > 0 ? ts.steps : 1000;
            if (!oo.quiet) printf("--resume: --steps %lld (the run's total; --steps sets another)\n", (long long)oo.steps);
        }
        const bool shape = oo.seq_len == 0 || oo.micro_batch == 0 || oo.grad_accum == 0;
        if (oo.seq_len == 0) oo.seq_len = have && ts.seq_len > 0 ? ts.seq_len : dflt.seq_len;
        if (oo.micro_batch == 0) { /* many ranks: the run's sequences per micro-batch, over this launch's ranks */
            const int64_t global = have && ts.micro_batch > 0 ? ts.micro_batch * (ts.dp > 0 ? ts.dp : 1) : 0;
            oo.micro_batch = global > 0 && global % launch_size == 0 ? global / launch_size
                           : have && ts.micro_batch > 0 ? ts.micro_batch : dflt.micro_batch;
        }
        if (oo.grad_accum == 0) oo.grad_accum = have && ts.grad_accum > 0 ? ts.grad_accum : dflt.grad_accum;
        if (shape && !oo.quiet)
            printf("--resume: --seq-len %lld --micro-batch %lld --grad-accum %lld (the run's; the flags set others)\n",
                   (long long)oo.seq_len, (long long)oo.micro_batch, (long long)oo.grad_accum);
    }
    o = &oo;
    run r;
    memset(&r, 0, sizeof r);
    r.o = o;
    fm_status s = train_impl(&r);
    fm_train_run_free(&r);
    return s;
}
