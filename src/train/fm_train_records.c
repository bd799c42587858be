/* metrics.jsonl's header and summary records and the step record's expert load and MFU
 * (fm_train_records.h). */
#define _DEFAULT_SOURCE
#include "fm_train_records.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../backend/fm_backend_default.h"
#include "fm_build_info.h"
#include "fm_signal.h"

/* Integers exactly (cJSON's numbers are doubles: a seed or a byte count above 2^53 would round). */
static void add_int(cJSON *o, const char *name, long long v) {
    char b[32];
    snprintf(b, sizeof b, "%lld", v);
    cJSON_AddRawToObject(o, name, b);
}
static void add_u64(cJSON *o, const char *name, unsigned long long v) {
    char b[32];
    snprintf(b, sizeof b, "%llu", v);
    cJSON_AddRawToObject(o, name, b);
}
static void add_num(cJSON *o, const char *name, double v) {
    if (isfinite(v)) cJSON_AddNumberToObject(o, name, v);
    else cJSON_AddNullToObject(o, name);
}
static void add_str(cJSON *o, const char *name, const char *v) {
    if (v) cJSON_AddStringToObject(o, name, v);
    else cJSON_AddNullToObject(o, name);
}
static void add_files(cJSON *o, const char *name, const char *const *f, int n) {
    cJSON *a = cJSON_AddArrayToObject(o, name);
    for (int i = 0; f && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateString(f[i]));
}

/* Every option of the run as resolved (fm_train_opts, named as the flags are, - as _). */
static cJSON *flags_json(const fm_train_opts *o) {
    cJSON *f = cJSON_CreateObject();
    add_str(f, "config", o->config_path);
    add_files(f, "data", o->data, o->n_data);
    add_files(f, "val_data", o->val_data, o->n_val_data);
    add_num(f, "val_fraction", o->val_fraction);
    add_int(f, "seq_len", o->seq_len);
    add_int(f, "micro_batch", o->micro_batch);
    add_int(f, "grad_accum", o->grad_accum);
    add_int(f, "steps", o->steps);
    add_num(f, "lr", o->lr);
    add_num(f, "min_lr", o->min_lr);
    add_int(f, "warmup", o->warmup);
    add_num(f, "weight_decay", o->weight_decay);
    add_num(f, "grad_clip", o->grad_clip);
    add_num(f, "beta1", o->beta1);
    add_num(f, "beta2", o->beta2);
    add_num(f, "adam_eps", o->adam_eps);
    add_u64(f, "seed", o->seed);
    add_int(f, "threads", o->threads);
    add_str(f, "out", o->out_dir);
    cJSON_AddBoolToObject(f, "resume", o->resume);
    add_int(f, "eval_every", o->eval_every);
    add_int(f, "eval_batches", o->eval_batches);
    add_int(f, "log_every", o->log_every);
    add_int(f, "save_every", o->save_every);
    add_num(f, "save_every_minutes", o->save_every_minutes);
    add_int(f, "expert_counts_every", o->expert_counts_every);
    add_num(f, "moe_router_bias_update_rate", o->moe_router_bias_update_rate);
    add_num(f, "moe_seq_aux_loss_coeff", o->moe_seq_aux_loss_coeff);
    add_num(f, "peak_flops", o->peak_flops);
    add_int(f, "exit_after", o->exit_after);
    add_str(f, "recompute", o->recompute);
    cJSON_AddBoolToObject(f, "recompute_keep_attention", o->recompute_keep_attention);
    cJSON_AddBoolToObject(f, "no_recompute_keep_attention", o->no_recompute_keep_attention);
    add_int(f, "moe_chunk_tokens", o->moe_chunk_tokens);
    add_int(f, "ce_block_tokens", o->ce_block_tokens);
    add_int(f, "ce_block_vocab", o->ce_block_vocab);
    add_u64(f, "mem_budget", o->mem_budget);
    add_int(f, "attention_tile_q", o->att_tile_q);
    add_int(f, "attention_tile_kv", o->att_tile_kv);
    add_u64(f, "gpu_workspace", o->gpu_workspace);
    cJSON_AddBoolToObject(f, "bf16_moments", o->bf16_moments);
    cJSON_AddStringToObject(f, "master_weights", fm_master_recipe_name((fm_master_recipe)o->master_weights));
    cJSON_AddStringToObject(f, "expert_precision", o->expert_fp8 ? "fp8" : "bf16");
    cJSON_AddBoolToObject(f, "offload_optimizer", o->offload_optimizer);
    add_int(f, "offload_optimizer_bucket", o->offload_optimizer_bucket);
    add_int(f, "offload_optimizer_slots", o->offload_optimizer_slots);
    if (o->optimizer_offload_fraction > 0) add_num(f, "optimizer_offload_fraction", o->optimizer_offload_fraction);
    else cJSON_AddNullToObject(f, "optimizer_offload_fraction"); /* not given: the plan's (below) */
    add_str(f, "offload_boundaries", o->offload_boundaries);
    cJSON_AddBoolToObject(f, "report_memory", o->report_memory);
    cJSON_AddBoolToObject(f, "quiet", o->quiet);
    cJSON_AddBoolToObject(f, "no_checkpoint", o->no_checkpoint);
    cJSON_AddBoolToObject(f, "no_optimizer_overlap", o->no_optimizer_overlap);
    cJSON_AddNumberToObject(f, "dp", o->dp);
    cJSON_AddNumberToObject(f, "sp", o->sp > 1 ? o->sp : 1);
    cJSON_AddNumberToObject(f, "ep", o->ep > 1 ? o->ep : 1);
    add_int(f, "ep_cap_tokens", o->ep_cap_tokens);
    cJSON_AddBoolToObject(f, "llep", o->llep);
    if (o->llep) cJSON_AddNumberToObject(f, "llep_lambda", o->llep_lambda);
    cJSON_AddStringToObject(f, "comm", o->comm_kind == FM_COMM_KIND_MPI ? "mpi" : o->comm_kind == FM_COMM_KIND_NCCL ? "nccl" : "auto");
    cJSON_AddNumberToObject(f, "zero", o->zero);
    cJSON_AddNumberToObject(f, "comm_timeout", o->comm_timeout);
    if (o->init_from) cJSON_AddStringToObject(f, "init_from", o->init_from);
    else cJSON_AddNullToObject(f, "init_from");
    cJSON_AddBoolToObject(f, "resume_trust_optimizer", o->resume_trust_optimizer);
    if (o->host_mem_budget_given) cJSON_AddNumberToObject(f, "host_mem_budget", (double)o->host_mem_budget);
    else cJSON_AddNullToObject(f, "host_mem_budget");
    add_int(f, "max_position_embeddings", o->max_position_embeddings);
    char bo[FM_BACKEND_OPTS_JSON_MAX];
    if (fm_backend_opts_json(&o->backend, bo, sizeof bo) == FM_OK) cJSON_AddRawToObject(f, "backend", bo);
    return f;
}

static const char *set_name(int i) { return i < FM_LIVE_COUNT ? fm_live_set_names[i] : "attention tiles"; }

fm_status fm_train_metrics_header(run *r, const fm_run_records *rec, int64_t resume_step) {
    if (!r->metrics) return FM_OK; /* a rank other than 0 writes no metrics */
    const fm_plan *p = &r->plan;
    cJSON *h = cJSON_CreateObject();
    cJSON_AddStringToObject(h, "type", "header");
    add_int(h, "step", resume_step);
    cJSON_AddStringToObject(h, "flatmoe_version", fm_build_version());
    cJSON_AddStringToObject(h, "git_commit", fm_build_commit());
    add_u64(h, "seed", r->o->seed);
    cJSON *cfg = r->config_json ? cJSON_Parse(r->config_json) : NULL;
    if (cfg) cJSON_AddItemToObject(h, "config", cfg);
    else cJSON_AddNullToObject(h, "config");
    cJSON_AddItemToObject(h, "flags", flags_json(r->o));
    cJSON *pl = cJSON_AddObjectToObject(h, "plan");
    cJSON *b = cJSON_AddObjectToObject(pl, "bytes");
    for (int i = 0; i < FM_PLAN_SETS; i++) add_u64(b, set_name(i), p->bytes[i]);
    add_u64(pl, "total_bytes", p->total);
    add_u64(pl, "host_pinned_bytes", p->host_bytes);
    { /* the state recipe (--master-weights, --bf16-moments) and its bytes per parameter on one rank */
        cJSON *sr = cJSON_AddObjectToObject(pl, "state_recipe");
        const fm_master_recipe rc = (fm_master_recipe)r->o->master_weights;
        const int a = (int)sizeof(fm_act);
        cJSON_AddStringToObject(sr, "master_weights", fm_master_recipe_name(rc));
        cJSON_AddStringToObject(sr, "moments", r->o->bf16_moments ? "bf16" : "fp32");
        add_int(sr, "bytes_per_param", 2 * a + fm_master_extra_bytes(rc, a) + (r->o->bf16_moments ? 4 : 8));
    }
    add_int(pl, "n_params", p->n_params);
    add_int(pl, "n_active_params", p->n_active);
    add_int(pl, "recomputed_layers", p->n_recomputed);
    add_int(pl, "keep_attention_layers", p->n_keep_attention);
    add_int(pl, "moe_chunks", p->moe_K);
    add_int(pl, "offloaded_boundaries", p->n_offloaded_boundaries);
    if (p->offload_buckets > 0) { /* the streamed optimizer as run: --optimizer-offload-fraction's split */
        cJSON *oo = cJSON_AddObjectToObject(pl, "optimizer_offload");
        add_num(oo, "fraction", (double)p->offload_streamed_buckets / (double)p->offload_buckets);
        add_int(oo, "buckets", p->offload_buckets);
        add_int(oo, "streamed_buckets", p->offload_streamed_buckets);
        add_int(oo, "resident_params", p->offload_resident);
    }
    add_num(pl, "flops_model_per_token", p->flops_model_token);
    add_num(pl, "flops_hardware_per_token", p->flops_hw_token);
    { /* the expert GEMMs' form, an init option of the backend, and why (plan/fm_expert_choice.h) */
        char ej[FM_EXPERT_CHOICE_JSON_MAX];
        if (fm_expert_choice_json(&r->expert_choice, ej, sizeof ej) == FM_OK) cJSON_AddRawToObject(h, "expert_gemm", ej);
    }
    if (r->m.a.moe_fp8) /* which FP8 path the experts run (model/fm_experts_fp8.h) */
        cJSON_AddStringToObject(h, "expert_fp8_path", r->m.a.moe_fp8_codes ? "codes" : "emulated");
    if (r->m.a.moe_fp8) cJSON_AddBoolToObject(h, "fp8_weight_cache", r->m.a.opts.expert_fp8_cache);
    cJSON *host = cJSON_AddObjectToObject(h, "host");
    char hn[256] = "";
    if (gethostname(hn, sizeof hn - 1) != 0) hn[0] = 0;
    cJSON_AddStringToObject(host, "hostname", hn);
    add_int(host, "cores", sysconf(_SC_NPROCESSORS_ONLN));
    add_int(host, "threads", rec->threads);
    if (rec->threads_busy >= 0) add_int(host, "busy_cores_at_start", rec->threads_busy);
    cJSON_AddStringToObject(host, "backend", r->m.be.ops ? r->m.be.ops->name : fm_build_backend());
    if (rec->device[0]) cJSON_AddStringToObject(host, "device", rec->device);
    else cJSON_AddNullToObject(host, "device");
    add_num(host, "peak_flops", rec->peak_flops > 0 ? rec->peak_flops : NAN);
    char *txt = cJSON_PrintUnformatted(h);
    cJSON_Delete(h);
    if (!txt) return fm_error(FM_ERR_NOMEM, "metrics.jsonl: out of memory for the header record");
    fprintf(r->metrics, "%s\n", txt);
    cJSON_free(txt);
    if (fflush(r->metrics) != 0) return fm_error(FM_ERR_IO, "%s/metrics.jsonl: cannot write the header record", r->o->out_dir);
    return FM_OK;
}

void fm_train_metrics_step_extra(run *r, const fm_run_records *rec, double step_s, int64_t tokens_per_step,
                                 bool full) {
    FILE *f = r->metrics;
    if (!f) return; /* a rank other than 0 */
    if (rec->peak_flops > 0 && step_s > 0)
        fprintf(f, ",\"mfu\":%.6g", r->plan.flops_model_token * (double)tokens_per_step / step_s / rec->peak_flops);
    else
        fprintf(f, ",\"mfu\":null");
    /* the MoE layers only, in layer order (a dense layer has no experts) */
    fprintf(f, ",\"expert_load_max_mean\":[");
    for (int64_t l = 0, n = 0; l < rec->L; l++)
        if (fm_config_layer_is_moe(&r->cfg, l)) fprintf(f, "%s%.4f", n++ ? "," : "", rec->load[l]);
    fprintf(f, "]");
    if (!full) return;
    fprintf(f, ",\"expert_counts\":[");
    for (int64_t l = 0, n = 0; l < rec->L; l++) {
        if (!fm_config_layer_is_moe(&r->cfg, l)) continue;
        fprintf(f, "%s[", n++ ? "," : "");
        for (int64_t e = 0; e < rec->E; e++) fprintf(f, "%s%lld", e ? "," : "", (long long)rec->counts[l * rec->E + e]);
        fprintf(f, "]");
    }
    fprintf(f, "]");
}

static void hms(char *buf, size_t n, double s) {
    if (s < 0 || !isfinite(s)) s = 0;
    long t = (long)(s + 0.5);
    snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
}

void fm_train_metrics_summary(run *r, const fm_run_records *rec) {
    FILE *f = r->metrics;
    if (!f) return; /* a rank other than 0: no record, no summary line */
    const double mean_tps = rec->step_s_sum > 0 ? (double)rec->tokens_run / rec->step_s_sum : 0;
    fprintf(f, "{\"type\":\"summary\",\"first_step\":%lld,\"last_step\":%lld,\"steps_run\":%lld,\"tokens_run\":%lld,"
            "\"time_s\":%.3f,\"step_time_s\":%.3f,\"mean_tokens_per_s\":%.1f",
            (long long)rec->first_step, (long long)rec->last_step, (long long)rec->steps_run,
            (long long)rec->tokens_run, rec->elapsed_s, rec->step_s_sum, mean_tps);
    if (isnan(rec->final_val)) fprintf(f, ",\"final_val_loss\":null,\"best_val_loss\":null,\"best_val_step\":null");
    else
        fprintf(f, ",\"final_val_loss\":%.17g,\"best_val_loss\":%.17g,\"best_val_step\":%lld", rec->final_val,
                rec->best_val, (long long)rec->best_val_step);
    if (rec->stopped_by) fprintf(f, ",\"stopped_by\":\"%s\"", fm_signal_name(rec->stopped_by));
    else fprintf(f, ",\"stopped_by\":null");
    if (rec->last_ckpt[0]) {
        cJSON *s = cJSON_CreateString(rec->last_ckpt);
        char *t = s ? cJSON_PrintUnformatted(s) : NULL;
        if (t) fprintf(f, ",\"checkpoint\":%s", t);
        cJSON_free(t);
        cJSON_Delete(s);
    }
    /* the arenas' measured high-water marks next to their bounds (as --report-memory measures them) */
    fprintf(f, ",\"memory\":{");
    for (int i = 0; i < FM_PLAN_SETS; i++) {
        fprintf(f, "%s\"%s\":{\"bound\":%zu", i ? "," : "", set_name(i), r->plan.bytes[i]);
        if (i < FM_LIVE_COUNT)
            fprintf(f, ",\"high_water\":%zu}",
                    fm_run_live_high(r, i));
        else
            fprintf(f, ",\"high_water\":null}"); /* the backend's own: not measured */
    }
    if (r->plan.host_bytes > 0)
        fprintf(f, ",\"host (pinned)\":{\"bound\":%zu,\"high_water\":%zu}", r->plan.host_bytes,
                fm_run_host_pinned_used(r));
    fprintf(f, ",\"checkpoint staging\":{\"bound\":%zu,\"high_water\":%zu}", r->cst.bytes, r->cst.high); /* host, rank 0 */
    fprintf(f, "}}\n");
    fflush(f);
    if (r->o->quiet) return;

    char el[32];
    hms(el, sizeof el, rec->elapsed_s);
    fm_line l = {.n = 0};
    fm_line_add(&l, "summary: %lld steps (%lld..%lld) in %s, %.0f tok/s mean", (long long)rec->steps_run,
                (long long)rec->first_step, (long long)rec->last_step, el, mean_tps);
    if (!isnan(rec->final_val))
        fm_line_add(&l, " | val loss final %.4f, best %.4f (step %lld)", rec->final_val, rec->best_val,
                    (long long)rec->best_val_step);
    if (rec->stopped_by) fm_line_add(&l, " | stopped by %s", fm_signal_name(rec->stopped_by));
    fm_log(FM_LOG_INFO, "%s\n", l.buf);
}
