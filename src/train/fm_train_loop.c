/* fm_train: set up the run, then the loop: one optimizer step (fm_train_step), its report,
 * validation every --eval-every steps and at the end, a checkpoint every --save-every steps or
 * --save-every-minutes minutes (whichever comes first) and at the end, the stop after
 * --exit-after steps of this invocation, and the graceful stop on SIGINT / SIGTERM
 * (fm_signal.h): the step in flight finishes, a checkpoint is written, the summary record
 * closes metrics.jsonl. */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../backend/fm_backend_default.h"
#include "../io/fm_checkpoint.h"
#include "fm_device_info.h"
#include "fm_signal.h"
#include "fm_tensorboard.h"
#include "fm_threads.h"
#include "fm_train_internal.h"
#include "fm_router_bias.h"
#include "fm_train_records.h"
#include "fm_train_step.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The schedule hook of the expert load: layer l's forward counts into row l of the step's
 * counts; nothing else does (the recompute of a layer in backward, evaluation, sampling). */
static fm_status count_hook(void *user, fm_model *m, fm_hook_point p, int64_t l) {
    fm_run_records *rec = user;
    if (p == FM_HOOK_BEFORE_FORWARD) m->a.moe_ws.counts = rec->counts + l * rec->E;
    else if (p == FM_HOOK_AFTER_FORWARD) m->a.moe_ws.counts = NULL;
    return FM_OK;
}

/* Max over experts / mean over experts of each layer's counts (1 = perfectly balanced; E = all
 * tokens on one expert). */
static void load_stats(fm_run_records *rec) {
    for (int64_t l = 0; l < rec->L; l++) {
        const int64_t *c = rec->counts + l * rec->E;
        int64_t mx = 0, sum = 0;
        for (int64_t e = 0; e < rec->E; e++) {
            sum += c[e];
            if (c[e] > mx) mx = c[e];
        }
        rec->load[l] = sum > 0 ? (double)mx * (double)rec->E / (double)sum : 0.0;
    }
}

/* Writes the step's checkpoint after checking that the weights are finite. */
static fm_status save_checked(run *r, const train_state *ts, fm_run_records *rec) {
    fm_model *m = &r->m;
    /* An update can overflow the weights while the loss and gradients it came from were
     * finite: never save such weights as the last good checkpoint. */
    double wsq;
    if (r->zero3) FM_TRY(fm_zero3_weight_sumsq(&r->z3, m, m->a.results + FM_RESULT_SUMSQ)); /* the shards' sum */
    else m->be.ops->sumsq(m->be.ctx, m->a.results + FM_RESULT_SUMSQ, m->p.params, m->p.n_params, false);
    /* sync point "checkpoint": every stream, so the streamed optimizer's last copies of the host
     * state (its own copy-out stream, which the overlap's flush does not wait for) are complete
     * before the save reads that state */
    m->be.ops->sync(m->be.ctx);
    m->be.ops->copy(m->be.ctx, &wsq, m->a.results + FM_RESULT_SUMSQ, sizeof wsq, FM_COPY_D2H);
    if (!isfinite(wsq))
        return fm_error(FM_ERR_NUMERIC, "step %lld: the weights are no longer finite after the optimizer update "
                        "(sum of squares %g); no checkpoint was written for this step (the last good one in %s "
                        "stays); lower --lr or raise --warmup", (long long)ts->step, wsq, r->o->out_dir);
    FM_TRY(fm_train_save_checkpoint(r, ts));
    snprintf(rec->last_ckpt, sizeof rec->last_ckpt, "%s/step_%06lld", r->o->out_dir, (long long)ts->step);
    return FM_OK;
}

/* The step's scalars as one TensorBoard Event (--tensorboard; fm_tensorboard.h): the losses, lr,
 * gradient norm, tokens/s, MFU, the epoch, validation, each layer's expert load (max/mean), and
 * memory: every live set's bound on the first step, the device's memory in use when the backend
 * has one, and the measured high-water marks on the steps --report-memory measures. */
static fm_status tb_step(run *r, const fm_run_records *rec, const fm_step_report *rep, int64_t tokens_per_step,
                         bool measured) {
    fm_tensorboard *tb = r->tb;
    fm_tensorboard_begin(tb, rep->step, 0);
    fm_status s = FM_OK;
#define TB(tag, v) if (s == FM_OK) s = fm_tensorboard_add(tb, tag, v)
    TB("train/loss", rep->ce);
    TB("train/aux_loss", rep->aux);
    TB("train/z_loss", rep->z);
    TB("train/lr", rep->lr);
    TB("train/grad_norm", rep->gnorm);
    TB("train/tokens_per_s", rep->tok_s);
    TB("train/step_s", rep->step_s);
    if (rec->peak_flops > 0 && rep->step_s > 0)
        TB("train/mfu", r->plan.flops_model_token * (double)tokens_per_step / rep->step_s / rec->peak_flops);
    if (rep->epoch > 0) TB("train/epoch", (double)rep->epoch);
    if (!isnan(rep->val)) TB("val/loss", rep->val);
    char tag[64];
    for (int64_t l = 0; l < rec->L; l++) {
        if (!fm_config_layer_is_moe(&r->cfg, l)) continue; /* a dense layer has no experts */
        snprintf(tag, sizeof tag, "expert_load/layer_%02lld", (long long)l);
        TB(tag, rec->load[l]);
    }
    for (int i = 0; i < FM_LIVE_COUNT; i++) {
        if (rep->first) {
            snprintf(tag, sizeof tag, "memory/bound_bytes/%s", fm_live_set_names[i]);
            TB(tag, (double)r->plan.bytes[i]);
        }
        if (measured) {
            snprintf(tag, sizeof tag, "memory/high_water_bytes/%s", fm_live_set_names[i]);
            TB(tag, (double)fm_run_live_high(r, i));
        }
    }
    size_t dfree = 0, dtotal = 0;
    if (fm_backend_default_device_memory(&dfree, &dtotal) == FM_OK && dtotal > 0)
        TB("memory/device_used_bytes", (double)(dtotal - dfree));
#undef TB
    return s == FM_OK ? fm_tensorboard_end(tb) : s;
}

static fm_status train_loop(run *r, train_state *ts, fm_rng *data_rng, fm_run_records *rec) {
    const fm_train_opts *o = r->o;
    fm_model *m = &r->m;
    const int64_t tokens_per_step = o->micro_batch * o->seq_len * o->grad_accum; /* one data-parallel rank's */
    /* the step's tokens over every rank: the dp ranks' summed, the sp ranks of a sequence counted once
     * (tokens, tokens/s, tokens_seen; the MFU below stays per device) */
    const int sp = r->sp > 1 ? r->sp : 1;
    const int64_t global_tokens = tokens_per_step * (r->n_ranks > sp ? r->n_ranks / sp : 1);
    double phase_discard[FM_PHASE_COUNT];
    (void)m->be.ops->prof_collect(m->be.ctx, phase_discard); /* the profile starts with step 1 */
    const double t0 = now_s();
    double t_saved = t0;
    const int64_t first = ts->step + 1;
    rec->first_step = first;
    rec->last_step = ts->step;
    if (first > o->steps && r->rank == 0) /* many ranks: the same on every rank, said once */
        fm_log(FM_LOG_NOTE, "note: --resume: the run is at step %lld, already at or past --steps %lld: nothing to train "
                "(give a larger --steps to continue it)\n", (long long)ts->step, (long long)o->steps);
    int64_t ran = 0;
    bool warned_no_targets = false;
    double int_s = 0; /* the logging interval's step time and tokens: the step line's tok/s */
    int64_t int_tok = 0;
    uint64_t syncs0 = m->be.ops->host_sync_count(m->be.ctx);
    /* test hook FLATMOE_TEST_SIGNAL_AFTER=RANK:STEP (tests/mpi_train.sh; core/fm_test_hooks.h) */
    const int test_signal_rank = o->test_hooks.signal_after ? o->test_hooks.signal_rank : -1;
    const long long test_signal_step = o->test_hooks.signal_after ? (long long)o->test_hooks.signal_step : -1;
    for (int64_t step = first; step <= o->steps; step++) {
        if (ran == 0) { /* a signal before the first step: nothing to finish or save. Later steps need no
                         * check here: the agreed flag after each step decides, on every rank alike (a
                         * rank-local check here would let the signalled rank leave while the others
                         * wait in the step's first collective) */
            int64_t early = fm_stop_requested();
            if (fm_comm_size(&r->world) > 1) FM_TRY(fm_comm_allreduce_max_i64(&r->world, &early, 1, 0));
            if (early) {
                rec->stopped_by = (int)early;
                if (!fm_stop_requested()) fm_stop_follow((int)early); /* every rank exits 128 + signal */
                break;
            }
        }
        const double ts0 = now_s();
        fm_step_stats st;
        memset(rec->counts, 0, sizeof(int64_t) * (size_t)(rec->L * rec->E));
        /* this step's micro-batches: windows, or packed documents (fm_train_data.h) */
        fm_train_data_draw(&r->data, o, &r->train, data_rng, r->step.batches, ts->tokens_seen);
        FM_TRY(fm_train_step(m, r->optim, r->opt_self, &r->world, &r->step, r->step.batches, o, step, &st));
        double phase_ms[FM_PHASE_COUNT];
        const bool profiled = m->be.ops->prof_collect(m->be.ctx, phase_ms);
        fm_phase_mark(&m->be, FM_PHASE_OTHER);
        const uint64_t syncs1 = m->be.ops->host_sync_count(m->be.ctx);
        ts->step = step;
        ts->opt_step = r->opt.step;
        ts->tokens_seen += global_tokens;
        ts->data_rng = data_rng->state;
        ts->pk_epoch = r->data.pk.epoch;
        ts->pk_next = r->data.pk.next;
        ts->pk_done = r->data.pk.done;
        ran++;

        const double t1 = now_s();
        fm_step_report rep = {step, st.ce, st.aux, st.z, st.lr, st.gnorm};
        rep.step_s = t1 - ts0;
        rep.elapsed = t1 - t0;
        rep.tok_s = (double)global_tokens / rep.step_s;
        rep.eta = rep.elapsed / (double)ran * (double)(o->steps - step);
        rep.val = NAN;
        rep.first = ran == 1;
        rep.phase_ms = profiled ? phase_ms : NULL;
        rep.host_syncs = syncs1 - syncs0;
        rep.tokens_seen = ts->tokens_seen;
        rep.epoch = r->data.mode != FM_PACK_OFF || o->epochs > 0 ? r->data.epoch : 0;
        rec->last_step = step;
        rec->steps_run = ran;
        rec->tokens_run += global_tokens;
        rec->step_s_sum += rep.step_s;
        int_s += rep.step_s;
        int_tok += global_tokens;
        if (r->n_ranks > 1 && rec->counts) /* every rank's routes of the step (a host reduction, no device wait) */
            FM_TRY(fm_comm_allreduce_sum_i64(&r->world, rec->counts, rec->L * rec->E, 0));
        load_stats(rec);
        /* aux-loss-free balancing: the selection bias against this step's load, on every rank alike */
        fm_router_bias_update(m, r->zero3 ? &r->z3 : NULL, rec->counts, o->moe_router_bias_update_rate, rec->bias_tmp);
        int64_t valid = 0;
        for (int64_t g = 0; g < o->grad_accum; g++) valid += r->step.n_valid[g];
        if (valid == 0 && !warned_no_targets && r->rank == 0) { /* all masked: a silent loss of 0 trains nothing */
            fm_log(FM_LOG_WARN, "warning: step %lld had no target to learn from: every target of its %lld micro-batch(es) "
                    "is masked (the data's loss mask) or ignored, so its loss is 0 and its gradient is zero; check the "
                    "data and its .mask files\n", (long long)step, (long long)o->grad_accum);
            warned_no_targets = true;
        }
        /* the stop flag and the time-based save: each rank's own (a signal, its clock), agreed as
         * their max over the ranks in one host collective, so every rank stops or saves after the
         * same step */
        int64_t flags[2] = {fm_stop_requested(),
                            o->save_every_minutes > 0 && now_s() - t_saved >= 60.0 * o->save_every_minutes};
        if (fm_comm_size(&r->world) > 1) FM_TRY(fm_comm_allreduce_max_i64(&r->world, flags, 2, 0));
        const int stop = (int)flags[0];
        /* a stop another rank received: this one stops alike and exits 128 + signal. Its own signal
         * may still land later (a launcher forwards one to every rank, each at its own moment): that
         * is its first, recorded, not a second that ends it at once (fm_stop_follow, fm_signal.h) */
        if (stop && !fm_stop_requested()) fm_stop_follow(stop);
        if (test_signal_rank == r->rank && step == test_signal_step)
            raise(SIGTERM); /* test hook: a real SIGTERM landing just after the step's agreement (the race windows) */
        const bool last = step == o->steps || (o->exit_after > 0 && ran == o->exit_after);
        const bool eval = ((o->eval_every > 0 && step % o->eval_every == 0) || last) && !stop;
        const bool due_time = flags[1] != 0;
        const bool due = (o->save_every > 0 && step % o->save_every == 0) || due_time;
        const bool save = !o->no_checkpoint && (due || last || stop);
        if (eval || save || last || stop || (o->report_memory && ran == 1)) /* they read the weights, or measure */
            fm_step_ws_flush(&r->step, m);
        if (eval) {
            FM_TRY(fm_evaluate_sched(r->zero3 ? &r->eval_sched : NULL, m, &r->val, o->eval_batches, &rep.val, NULL));
            rec->final_val = rep.val;
            if (isnan(rec->best_val) || rep.val < rec->best_val) {
                rec->best_val = rep.val;
                rec->best_val_step = step;
            }
        }
        if (!o->quiet && (step % (o->log_every > 0 ? o->log_every : 1) == 0 || last || stop || !isnan(rep.val))) {
            fm_step_report line = rep;
            line.tok_s = int_s > 0 ? (double)int_tok / int_s : rep.tok_s; /* over the logging interval */
            fm_train_print_step(r, &line);
            int_s = 0;
            int_tok = 0;
        }
        fm_train_metrics_begin(r, &rep);
        /* (MFU per device: under --sp, the sp ranks of a data-parallel rank share its tokens) */
        fm_train_metrics_step_extra(r, rec, rep.step_s, tokens_per_step / sp,
                                    o->expert_counts_every > 0 && step % o->expert_counts_every == 0);
        if (o->report_memory && (ran == 1 || last)) {
            fm_train_metrics_memory(r);
            double discard[FM_PHASE_COUNT]; /* the report's read-back is not the next step's time */
            (void)m->be.ops->prof_collect(m->be.ctx, discard);
        }
        fm_train_metrics_end(r);
        if (r->tb) FM_TRY(tb_step(r, rec, &rep, tokens_per_step / sp, o->report_memory && (ran == 1 || last)));

        if (save) {
            FM_TRY(save_checked(r, ts, rec));
            t_saved = now_s();
        }
        if (stop) {
            rec->stopped_by = stop;
            break;
        }
        if (o->exit_after > 0 && ran == o->exit_after) break;
        syncs0 = m->be.ops->host_sync_count(m->be.ctx); /* evaluation, reports and saving are not the step's */
    }
    if (!rec->stopped_by) rec->stopped_by = fm_stop_requested();
    rec->elapsed_s = now_s() - t0;
    fm_train_metrics_summary(r, rec);
    if (rec->stopped_by && r->rank == 0) { /* many ranks: every rank stops after the same step; rank 0 says so */
        if (ran == 0) /* the sink flushes stdout before it writes stderr */
            fm_log(FM_LOG_NOTE, "flatmoe train: %s received before step %lld: stopped without training; the run folder "
                    "%s is as it was\n", fm_signal_name(rec->stopped_by), (long long)first, o->out_dir);
        else if (rec->last_ckpt[0])
            fm_log(FM_LOG_NOTE, "flatmoe train: %s received: finished step %lld, saved %s; continue with --resume "
                    "(a second signal stops at once, without saving)\n", fm_signal_name(rec->stopped_by),
                    (long long)rec->last_step, rec->last_ckpt);
        else
            fm_log(FM_LOG_NOTE, "flatmoe train: %s received: finished step %lld; no checkpoint written "
                    "(--no-checkpoint)\n", fm_signal_name(rec->stopped_by), (long long)rec->last_step);
    }
    return FM_OK;
}

static fm_status train_impl(run *r, fm_run_records *rec) {
    train_state ts = {0};
    fm_rng data_rng;
    FM_TRY(fm_train_setup(r, &ts, &data_rng));
    if (r->m.p.ep > 1) /* the EP chunk schedule (FLATMOE_EP_SCHEDULE, read by the CLI): before the first step */
        fm_moe_ep_ws_set_schedule(&r->m.a.moe_ep_ws, r->o->backend.ep_schedule);
    const fm_config *c = &r->cfg;
    rec->L = c->num_hidden_layers;
    rec->E = c->num_experts;
    /* Sync-free experts add the counts on the device (fm_moe_layer.c): then they live in pinned
     * host memory the device writes, freed below before the backend goes. */
    const size_t counts_bytes = sizeof(int64_t) * (size_t)(rec->L * rec->E);
    const bool pinned_counts = r->m.a.moe_sync_free;
    rec->counts = pinned_counts ? r->m.be.ops->buffer_alloc(r->m.be.ctx, FM_BUFFER_PINNED, counts_bytes)
                                : fm_malloc(counts_bytes);
    rec->load = fm_malloc(sizeof(double) * (size_t)rec->L);
    rec->bias_tmp = fm_malloc(sizeof(float) * (size_t)rec->E);
    FM_TRY(fm_router_bias_check(&r->m, r->o->moe_router_bias_update_rate, r->ps.no_master));
    if (!rec->counts || !rec->load || !rec->bias_tmp)
        return fm_error(FM_ERR_NOMEM, "out of memory for the expert-load counts (%lld layers x %lld experts)",
                        (long long)rec->L, (long long)rec->E);
    FM_TRY(fm_schedule_add_hook(&r->step.sched, count_hook, rec));
    if (strcmp(r->m.be.ops->name, "cpu") != 0) fm_device_gpu_name(rec->device, sizeof rec->device);
    rec->peak_flops = r->o->peak_flops > 0 ? r->o->peak_flops : fm_device_peak_flops(rec->device);
    FM_TRY(fm_train_metrics_header(r, rec, ts.step));
    fm_status s = train_loop(r, &ts, &data_rng, rec);
    r->m.a.moe_ws.counts = NULL;
    if (pinned_counts) { /* the device's last count_add ran before the last step's sync */
        r->m.be.ops->buffer_free(r->m.be.ctx, FM_BUFFER_PINNED, rec->counts);
        rec->counts = NULL;
    }
    return s;
}

fm_status fm_train(const fm_train_opts *o) {
    fm_train_opts oo = *o;
    int launch_rank = 0, launch_size = 1; /* many ranks: only rank 0 prints (and writes, fm_train_setup) */
    if (fm_comm_launcher(&launch_rank, &launch_size, NULL) == FM_OK && launch_rank != 0) oo.quiet = true;
    const bool need = oo.steps == 0 || oo.seq_len == 0 || oo.micro_batch == 0 || oo.grad_accum == 0;
    train_state ts = {0};
    bool have = false;
    if (oo.resume && oo.out_dir) { /* the latest checkpoint's state: the run's shape and thread count */
        char ck[4096], p[4200];
        if (fm_ckpt_find_latest(oo.out_dir, ck, sizeof ck, NULL) == FM_OK) {
            snprintf(p, sizeof p, "%s/%s", ck, FM_CKPT_STATE_FILE);
            FM_TRY(fm_train_state_read(p, &ts)); /* a field out of its range: the file and the field named */
            have = true;
        }
    }
    if (oo.resume && have && ts.threads > 0 && sizeof(fm_act) == sizeof(float)) { /* the CPU's reductions depend on the thread count */
        if (oo.threads == 0) {
            oo.threads = (int)ts.threads;
            if (!oo.quiet) fm_log(FM_LOG_INFO, "--resume: --threads %d (the run's: results depend on the thread count; --threads sets "
                                  "another)\n", oo.threads);
        } else if (oo.threads != ts.threads && launch_rank == 0) { /* the same on every rank: said once */
            fm_log(FM_LOG_WARN, "warning: --resume with --threads %d, the run trained with %lld: the CPU's sums run in "
                    "another order, so the run will not match an uninterrupted one bit for bit\n", oo.threads,
                    (long long)ts.threads);
        }
    }
    if (oo.resume && have) { /* the learning-rate schedule not given again: the run's own (state.json) */
        char said[160] = "";
        size_t at = 0;
        if (!oo.lr_given && !isnan(ts.lr) && ts.lr != oo.lr)
            oo.lr = ts.lr, at += (size_t)snprintf(said + at, sizeof said - at, " --lr %g", oo.lr);
        if (!oo.min_lr_given && !isnan(ts.min_lr) && ts.min_lr != oo.min_lr && at < sizeof said)
            oo.min_lr = ts.min_lr, at += (size_t)snprintf(said + at, sizeof said - at, " --min-lr %g", oo.min_lr);
        if (!oo.warmup_given && ts.warmup >= 0 && ts.warmup != oo.warmup && at < sizeof said)
            oo.warmup = ts.warmup, at += (size_t)snprintf(said + at, sizeof said - at, " --warmup %lld", (long long)oo.warmup);
        if (at && !oo.quiet) fm_log(FM_LOG_INFO, "--resume:%s (the run's schedule; the flags set others)\n", said);
    }
    if (oo.resume && need) { /* flags not given: the run's own total and shape, from its latest checkpoint */
        fm_train_opts dflt;
        fm_train_opts_default(&dflt);
        if (oo.steps == 0) {
            oo.steps = have && ts.steps > 0 ? ts.steps : 1000;
            if (!oo.quiet) fm_log(FM_LOG_INFO, "--resume: --steps %lld (the run's total; --steps sets another)\n", (long long)oo.steps);
        }
        char taken[160] = ""; /* the shape flags not given, taken from the run (only those are named) */
        size_t at = 0;
        if (oo.seq_len == 0) at += (size_t)snprintf(taken + at, sizeof taken - at, " --seq-len %lld",
                                                    (long long)(oo.seq_len = have && ts.seq_len > 0 ? ts.seq_len : dflt.seq_len));
        if (oo.micro_batch == 0 && at < sizeof taken) { /* many ranks: the run's sequences per micro-batch, over this launch's ranks */
            const int64_t global = have && ts.micro_batch > 0 ? ts.micro_batch * (ts.dp > 0 ? ts.dp : 1) : 0;
            const int dp_launch = launch_size / (oo.sp > 1 && launch_size % oo.sp == 0 ? oo.sp : 1);
            oo.micro_batch = global > 0 && global % dp_launch == 0 ? global / dp_launch
                           : have && ts.micro_batch > 0 ? ts.micro_batch : dflt.micro_batch;
            at += (size_t)snprintf(taken + at, sizeof taken - at, " --micro-batch %lld", (long long)oo.micro_batch);
        }
        if (oo.grad_accum == 0 && at < sizeof taken)
            at += (size_t)snprintf(taken + at, sizeof taken - at, " --grad-accum %lld",
                                   (long long)(oo.grad_accum = have && ts.grad_accum > 0 ? ts.grad_accum : dflt.grad_accum));
        if (at && !oo.quiet) fm_log(FM_LOG_INFO, "--resume:%s (the run's; the flags set others)\n", taken);
    }
    fm_run_records rec;
    memset(&rec, 0, sizeof rec);
    rec.final_val = rec.best_val = NAN;
    rec.threads_busy = -1;
    if (oo.threads == 0) { /* the cores free now (fm_threads.h): one busy core must not halve the speed */
        fm_threads_probe tp;
        oo.threads = fm_threads_auto(150, &oo.threads_env, &tp);
        rec.threads_busy = tp.from_env ? -1 : tp.busy;
        if (!oo.quiet && !tp.from_env && tp.blas_pthreads)
            fm_log(FM_LOG_INFO, "threads: 1 (OpenBLAS here is its pthread build, whose pool contends with flatmoe's OpenMP threads: "
                   "on 2 cores 2 threads ran at 0.39x the OpenMP build's speed, 1 at 0.75x; fix: apt-get install "
                   "libopenblas0-openmp && update-alternatives --set libopenblas.so.0-x86_64-linux-gnu "
                   "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0; --threads sets the count)\n");
        else if (!oo.quiet && !tp.from_env && tp.busy > 0)
            fm_log(FM_LOG_INFO, "threads: %d (%d of the %d cores this process may use are busy with other work; --threads sets "
                   "the count)\n", tp.threads, tp.busy, tp.allowed);
    }
    rec.threads = oo.threads;
    o = &oo;
    run r;
    memset(&r, 0, sizeof r);
    r.o = o;
    r.o_rw = &oo;
    r.rank = launch_rank; /* before fm_train_setup finds it again: its first messages are rank 0's alone */
    r.n_ranks = launch_size;
    fm_status s = train_impl(&r, &rec);
    fm_free(rec.counts);
    fm_free(rec.load);
    fm_free(rec.bias_tmp);
    fm_train_run_free(&r);
    return s;
}
