/* What a training run reports: its header lines, one step line (and a profile line) per logged
 * step on stdout, metrics.jsonl's records (a header record, one record per step with its expert
 * load and MFU, a summary record: fm_train_records.h), the memory report (--report-memory) and
 * the summary line. The lines go to the logging callback (core/fm_log.h); metrics.jsonl is a file. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

#include "../backend/fm_backend_default.h"
#include "../plan/fm_plan_report.h"
#include "fm_train_internal.h"

static void fmt_hms(char *buf, size_t n, double s) {
    if (s < 0 || !isfinite(s)) s = 0;
    long t = (long)(s + 0.5);
    snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
}

void fm_line_add(fm_line *l, const char *fmt, ...) {
    if (l->n >= sizeof l->buf) return;
    va_list ap;
    va_start(ap, fmt);
    const int w = vsnprintf(l->buf + l->n, sizeof l->buf - l->n, fmt, ap);
    va_end(ap);
    if (w > 0) l->n = l->n + (size_t)w < sizeof l->buf ? l->n + (size_t)w : sizeof l->buf - 1;
}

void fm_train_print_header(const run *r, const fm_plan_req *req, int64_t tokens_per_step) {
    const fm_train_opts *o = r->o;
    const fm_config *c = &r->cfg;
    const fm_model *m = &r->m;
    const fm_plan *plan = &r->plan;
    fm_log(FM_LOG_INFO, "model %s: %lld parameters (%lld active per token), %lld layers, %lld experts top-%lld\n",
           c->model_type_name, (long long)fm_config_num_params(c), (long long)fm_config_num_active_params(c),
           (long long)c->num_hidden_layers, (long long)c->num_experts, (long long)c->num_experts_per_tok);
    if (m->p.ep > 1) /* --ep: this rank's table */
        fm_log(FM_LOG_INFO, "expert parallelism: --ep %d, %lld experts per rank, %lld parameters per rank\n", m->p.ep,
               (long long)m->p.E_loc, (long long)m->p.n_params);
    const int dp = r->n_ranks > 1 ? r->n_ranks / (r->sp > 1 ? r->sp : 1) : 1; /* every rank's tokens, as metrics.jsonl's */
    fm_line l = {.n = 0};
    fm_line_add(&l, "data: train %lld tokens, validation %lld tokens; %lld tokens per step (%lld x %lld x %lld",
                (long long)r->train.n_tokens, (long long)r->val.n_tokens, (long long)(tokens_per_step * dp),
                (long long)o->micro_batch, (long long)o->seq_len, (long long)o->grad_accum);
    if (dp > 1) fm_line_add(&l, " x %d data-parallel ranks", dp);
    fm_log(FM_LOG_INFO, "%s)\n", l.buf);
    l.n = 0;
    fm_line_add(&l, "plan: %.1f MiB =", plan->total / 1048576.0);
    for (int i = 0; i < FM_PLAN_SETS; i++)
        fm_line_add(&l, "%s %s %.1f", i ? "," : "", i < FM_LIVE_COUNT ? fm_live_set_names[i] : "attention tiles",
                    plan->bytes[i] / 1048576.0);
    fm_line_add(&l, "; recompute %lld of %lld layers", (long long)plan->n_recomputed, (long long)c->num_hidden_layers);
    if (plan->n_keep_attention > 0) fm_line_add(&l, " (%lld keep their attention output)", (long long)plan->n_keep_attention);
    fm_line_add(&l, ", MoE %s", req->moe_chunk_tokens > 0 ? "chunked" : "unchunked");
    if (req->moe_chunk_tokens > 0)
        fm_line_add(&l, " (%lld chunks of <= %lld tokens)", (long long)plan->moe_K, (long long)plan->moe_c_eff);
    fm_line_add(&l, ", vocabulary %s", req->ce_block_tokens > 0 || req->ce_block_vocab > 0 ? "linear cross-entropy" : "plain logits");
    fm_line_add(&l, ", AdamW moments %s, master weights %s (%d B/param)", o->bf16_moments ? "bf16" : "fp32",
                fm_master_recipe_name((fm_master_recipe)o->master_weights), fm_plan_state_bytes_per_param(req));
    if (o->expert_fp8)
        fm_line_add(&l, ", expert GEMMs fp8 (blockwise E4M3, %s%s)", m->a.moe_fp8_codes ? "on E4M3 codes" : "emulated",
                    m->a.opts.expert_fp8_cache ? ", every layer's weight codes kept" : "");
    if (plan->n_offloaded_boundaries > 0)
        fm_line_add(&l, ", %lld boundaries offloaded (%.1f MiB pinned host memory)", (long long)plan->n_offloaded_boundaries,
                    (plan->host_bytes - plan->host_optimizer_bytes) / 1048576.0);
    if (plan->host_optimizer_bytes > 0)
        fm_line_add(&l, ", optimizer offloaded (%.1f MiB pinned host memory, %lld slots of %lld parameters; %lld of "
                    "%lld buckets streamed, the first %lld parameters' state on the device)",
                    plan->host_optimizer_bytes / 1048576.0, (long long)req->offload_slots,
                    (long long)(req->offload_bucket < plan->n_params - plan->offload_resident
                                    ? req->offload_bucket : plan->n_params - plan->offload_resident),
                    (long long)plan->offload_streamed_buckets, (long long)plan->offload_buckets,
                    (long long)plan->offload_resident);
    fm_log(FM_LOG_INFO, "%s\n", l.buf);
    fm_log(FM_LOG_INFO, "flops per token: model %.4e, hardware %.4e (with the recomputed forwards)\n",
           plan->flops_model_token, plan->flops_hw_token);
}

void fm_train_print_step(const run *r, const fm_step_report *s) {
    char el[32], et[32];
    fmt_hms(el, sizeof el, s->elapsed);
    fmt_hms(et, sizeof et, s->eta);
    fm_line l = {.n = 0};
    fm_line_add(&l, "step %6lld/%lld | loss %.4f | aux %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | %s elapsed | ETA %s",
                (long long)s->step, (long long)r->o->steps, s->ce, s->aux, s->lr, s->gnorm, s->tok_s, el, et);
    if (!isnan(s->val)) fm_line_add(&l, " | val loss %.4f", s->val);
    if (s->epoch > 0) {
        if (r->o->epochs > 0) fm_line_add(&l, " | epoch %lld/%lld", (long long)s->epoch, (long long)r->o->epochs);
        else fm_line_add(&l, " | epoch %lld", (long long)s->epoch);
    }
    fm_log(FM_LOG_INFO, "%s\n", l.buf);
    if (s->phase_ms) {
        double tot = 0;
        for (int i = 0; i < FM_PHASE_COUNT; i++) tot += s->phase_ms[i];
        l.n = 0;
        fm_line_add(&l, "profile step %lld: %.1f ms =", (long long)s->step, tot);
        for (int i = 0; i < FM_PHASE_COUNT; i++)
            fm_line_add(&l, "%s %s %.1f (%.0f%%)", i ? "," : "", fm_phase_name(i), s->phase_ms[i],
                        tot > 0 ? 100.0 * s->phase_ms[i] / tot : 0.0);
        fm_log(FM_LOG_INFO, "%s; host syncs %llu\n", l.buf, (unsigned long long)s->host_syncs);
    }
}

void fm_train_metrics_begin(run *r, const fm_step_report *s) {
    if (!r->metrics) return; /* a rank other than 0 */
    fprintf(r->metrics, "{\"type\":\"step\",\"step\":%lld,\"loss\":%.17g,\"aux_loss\":%.17g,\"z_loss\":%.17g,\"lr\":%.17g,"
            "\"grad_norm\":%.17g,\"tokens\":%lld,\"tokens_per_s\":%.1f,\"step_s\":%.6f,\"elapsed_s\":%.3f",
            (long long)s->step, s->ce, s->aux, s->z, s->lr, s->gnorm, (long long)s->tokens_seen, s->tok_s, s->step_s,
            s->elapsed);
    if (!isnan(s->val)) fprintf(r->metrics, ",\"val_loss\":%.17g", s->val);
    if (s->epoch > 0) fprintf(r->metrics, ",\"epoch\":%lld", (long long)s->epoch);
    fprintf(r->metrics, ",\"host_syncs\":%llu", (unsigned long long)s->host_syncs);
    char bo[FM_BACKEND_OPTS_JSON_MAX];
    if (s->first && fm_backend_opts_json(&r->backend_opts, bo, sizeof bo) == FM_OK)
        fprintf(r->metrics, ",\"backend\":%s", bo);
    if (s->phase_ms) {
        fprintf(r->metrics, ",\"phase_ms\":{");
        for (int i = 0; i < FM_PHASE_COUNT; i++)
            fprintf(r->metrics, "%s\"%s\":%.3f", i ? "," : "", fm_phase_name(i), s->phase_ms[i]);
        fprintf(r->metrics, "}");
    }
}

/* Measured high-water mark of every arena (painted at layout) next to its planned bound.
 * dev_used, dev_total: the device's memory in use and its size (0: no device to report). */
static void report_memory(const run *r, size_t dev_used, size_t dev_total) {
    fm_log(FM_LOG_INFO, "memory: %-22s %14s %14s %7s\n", "live set", "bound (B)", "high-water (B)", "used");
    for (int i = 0; i < FM_PLAN_SETS; i++) {
        if (i == FM_LIVE_COUNT) {
            fm_log(FM_LOG_INFO, "memory: %-22s %14zu %14s %7s\n", "attention tiles", r->plan.bytes[i], "(backend)", "");
            continue;
        }
        size_t hw = fm_run_live_high(r, i);
        fm_log(FM_LOG_INFO, "memory: %-22s %14zu %14zu %6.1f%%\n", fm_live_set_names[i], r->plan.bytes[i], hw,
               r->plan.bytes[i] ? 100.0 * (double)hw / (double)r->plan.bytes[i] : 0.0);
    }
    if (r->cst.high > 0) /* host: the loads and saves so far that staged (a one-rank fp32 host save names its buffers) */
        fm_log(FM_LOG_INFO, "memory: %-22s %14zu %14zu %6.1f%%\n", "checkpoint staging", r->cst.bytes, r->cst.high,
               100.0 * (double)r->cst.high / (double)r->cst.bytes);
    const size_t host_used = fm_run_host_pinned_used(r); /* offloaded boundaries + optimizer */
    if (r->plan.host_bytes > 0)
        fm_log(FM_LOG_INFO, "memory: %-22s %14zu %14zu %6.1f%%\n", "host (pinned)", r->plan.host_bytes, host_used,
               100.0 * (double)host_used / (double)r->plan.host_bytes);
    if (dev_total > 0)
        fm_log(FM_LOG_INFO, "memory: device in use %.1f MiB of %.1f MiB (plan %.1f MiB; the rest is the CUDA context and "
               "libraries)\n", dev_used / 1048576.0, dev_total / 1048576.0, r->plan.total / 1048576.0);
}

void fm_train_metrics_memory(run *r) {
    const fm_model *m = &r->m;
    if (m->mesh.moe_ep_comm) { /* --ep: every rank's dispatch against its bound (fm_train_ep.h; ranks > 0 are quiet) */
        char line[400];
        fm_train_ep_report(m, line, sizeof line);
        fm_log(FM_LOG_INFO, "rank %d of %d: %s\n", r->rank, r->n_ranks, line);
    }
    if (!r->metrics) { /* a rank other than 0: its own arenas against its plan, one line */
        char line[1600];
        size_t n = 0;
        n += (size_t)snprintf(line + n, sizeof line - n, "rank %d of %d: memory (high-water / bound, B):", r->rank,
                              r->n_ranks);
        for (int i = 0; i < FM_LIVE_COUNT && n < sizeof line; i++)
            n += (size_t)snprintf(line + n, sizeof line - n, "%s %s %zu / %zu", i ? ";" : "", fm_live_set_names[i],
                                  fm_run_live_high(r, i),
                                  r->plan.bytes[i]);
        if (r->plan.host_bytes > 0 && n < sizeof line)
            n += (size_t)snprintf(line + n, sizeof line - n, "; host (pinned) %zu / %zu", fm_run_host_pinned_used(r),
                                  r->plan.host_bytes);
        size_t df = 0, dt = 0;
        if (fm_backend_default_device_memory(&df, &dt) == FM_OK && dt > 0 && n < sizeof line)
            snprintf(line + n, sizeof line - n, "; device in use %.1f MiB of %.1f MiB (plan %.1f MiB)",
                     (dt - df) / 1048576.0, dt / 1048576.0, r->plan.total / 1048576.0);
        fm_log(FM_LOG_INFO, "%s\n", line);
        return;
    }
    fprintf(r->metrics, ",\"memory\":{");
    for (int i = 0; i < FM_LIVE_COUNT; i++)
        fprintf(r->metrics, "%s\"%s\":{\"bound\":%zu,\"high_water\":%zu}", i ? "," : "", fm_live_set_names[i],
                r->plan.bytes[i], fm_run_live_high(r, i));
    fprintf(r->metrics, "}");
    if (m->mesh.moe_ep_comm) /* rank 0's expert-parallel dispatch: rows per chunk against R_max */
        fprintf(r->metrics, ",\"ep_dispatch\":{\"rows_max\":%lld,\"recv_rows_high\":%lld,\"send_rows_high\":%lld,"
                "\"llep_chunks\":%lld}", (long long)m->a.moe_ep_ws.rows_max, (long long)m->a.moe_ep_ws.recv_rows_high,
                (long long)m->a.moe_ep_ws.send_rows_high, (long long)m->a.moe_ep_ws.llep_chunks);
    if (r->plan.host_bytes > 0)
        fprintf(r->metrics, ",\"host_pinned\":{\"bound\":%zu,\"used\":%zu}", r->plan.host_bytes,
                fm_run_host_pinned_used(r));
    size_t dfree = 0, dtotal = 0;
    if (fm_backend_default_device_memory(&dfree, &dtotal) != FM_OK) dfree = dtotal = 0;
    if (dtotal > 0)
        fprintf(r->metrics, ",\"device_used_bytes\":%zu,\"device_total_bytes\":%zu", dtotal - dfree, dtotal);
    if (!r->o->quiet) report_memory(r, dtotal - dfree, dtotal);
}

void fm_train_metrics_end(run *r) {
    if (!r->metrics) return; /* a rank other than 0 */
    fprintf(r->metrics, "}\n");
    fflush(r->metrics);
}
