/* Setting up a training run: the resume point, the model config (checked against the
 * checkpoint's when resuming), the data, the memory plan, and the backend, model and optimizer
 * allocated from it; then the checkpoint's state or fresh weights, and metrics.jsonl. */
#include <errno.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include "../backend/fm_backend_default.h"
#include "../backend/fm_backend_plan.h"
#include "../bounded/fm_linear_ce_ring.h"
#include "../io/fm_checkpoint.h"
#include "../plan/fm_choose.h"
#include "../plan/fm_expert_choice.h"
#include "../plan/fm_plan_device.h"
#include "../core/fm_log.h"
#include "../schedule/fm_recompute.h"
#include "fm_train_plan.h"
#include "fm_train_agree.h"
#include "fm_tensorboard.h"
#include "fm_train_internal.h"

void fm_train_run_free(run *r) {
    if (r->metrics) fclose(r->metrics);
    fm_step_ws_free(&r->step); /* before the backend whose memory it holds */
    fm_sco_free(&r->sco);
    if (r->mesh_ok) fm_comm_group_free(&r->mesh); /* before the world it was split from */
    fm_train_ep_free(&r->ep); /* its groups are splits of the world */
    if (r->world_ok) fm_comm_free(&r->world);
    fm_param_store_free(&r->ps);
    fm_zero3_free(&r->z3);
    fm_offload_adamw_free(&r->oopt);
    if (r->model_ok) fm_model_free(&r->m);
    if (r->be_ok) fm_backend_default_free(&r->be);
    fm_train_data_free(&r->data);
    fm_tensorboard_close(r->tb);
    r->tb = NULL;
    fm_dataset_free(&r->train); /* views: their own document tables only */
    fm_dataset_free(&r->val);
    fm_dataset_free(&r->val_own);
    fm_dataset_free(&r->train_all);
    fm_free(r->config_json);
    fm_free(r->named);
    fm_free(r->names);
    fm_free(r->rc);
    fm_train_hf_free(&r->hf);
    fm_ckpt_stage_free(r);
    fm_train_hf_free(&r->ep_hf);
}

/* Whether two paths name the same file (both exist, same device and inode). */
static bool same_file(const char *a, const char *b) {
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/* --init-from: the fp32 master from the folder's weights (every tensor of the table, each
 * widened to fp32; nothing random), the fm_act weights rounded from it as a fresh run's are.
 * Tensors of the folder the model does not use are named in one warning. */
static fm_status init_from_folder(run *r, const char *dir) {
    fm_model *m = &r->m;
    fm_hf_files f;
    FM_TRY(fm_hf_files_open(&f, dir));
    /* straight into a host master (ZeRO-3: the shard is not the table; staged, then scattered) */
    const bool host = (m->be.ops->host_memory || m->p.master_host) && !r->zero3;
    float *w = host ? m->p.master : fm_malloc(sizeof(float) * (size_t)m->p.n_params);
    if (!w) {
        fm_hf_files_close(&f);
        return fm_error(FM_ERR_NOMEM, "--init-from: cannot stage %lld weights on the host", (long long)m->p.n_params);
    }
    char extra[2048];
    const fm_hf_read_opts ro = {true, extra, sizeof extra};
    fm_status s = fm_hf_read_files(&r->hf.t, &f, "", w, &ro);
    if (s == FM_OK) {
        if (r->o->master_weights != FM_MASTER_FP32 && sizeof(fm_act) == sizeof(float))
            fm_adamw_round_weights(w, m->p.n_params); /* the recipe's weights are bf16 values */
        if (r->zero3) s = fm_zero3_set_master(&r->z3, m, w);
        else s = fm_param_store_upload_f32(&r->ps, m, w);
        if (extra[0] && m->p.ep <= 1 && r->rank == 0) /* --ep: the other ranks' experts are the extras; rank 0 speaks */
            fm_log(FM_LOG_WARN, "warning: --init-from %s: %s\n", dir, extra);
        if (!r->o->quiet)
            fm_log(FM_LOG_INFO, "initialized from %s (%d tensors, %lld parameters; optimizer state fresh)\n", f.where, m->p.n_tensors,
                   (long long)m->p.n_params);
    }
    if (!host) fm_free(w);
    fm_hf_files_close(&f);
    return s;
}

/* The resume point: ckpt[cap] gets the latest complete checkpoint of --out with --resume ("" for
 * a fresh run); a damaged newer one is refused, and a fresh run into a folder with checkpoints. */
static fm_status setup_resume_point(run *r, char *ckpt, size_t cap) {
    const fm_train_opts *o = r->o;
    int64_t ckpt_step = -1;
    ckpt[0] = 0;
    if (!o->resume) {
        char probe[4096];
        if (fm_ckpt_find_latest(o->out_dir, probe, sizeof probe, NULL) == FM_OK)
            return fm_error(FM_ERR_ARG, "--out %s already holds checkpoints (latest %s); pass --resume to continue "
                            "that run, or choose a new --out folder", o->out_dir, probe);
        return FM_OK;
    }
    if (fm_ckpt_find_latest(o->out_dir, ckpt, cap, &ckpt_step) != FM_OK) {
        ckpt[0] = 0;
        ckpt_step = -1;
    } else { /* its tokenizer goes on into the run's next checkpoints */
        char tj[4200];
        snprintf(tj, sizeof tj, "%s/tokenizer.json", ckpt);
        if (access(tj, R_OK) == 0) snprintf(r->tokenizer_dir, sizeof r->tokenizer_dir, "%s", ckpt);
    }
    /* A damaged checkpoint newer than the one we would resume from is not skipped silently:
     * training on would overwrite it (or start over). */
    char bad[4096];
    const char *missing = "";
    if (fm_ckpt_find_incomplete(o->out_dir, ckpt_step, bad, sizeof bad, &missing))
        return fm_error(FM_ERR_IO, "--resume: %s is an incomplete checkpoint (no %s)%s%s; restore the file, or "
                        "move that folder away to resume from %s", bad, missing,
                        ckpt[0] ? ", newer than " : "", ckpt[0] ? ckpt : "",
                        ckpt[0] ? "the older checkpoint" : "scratch");
    if (!ckpt[0] && !o->quiet)
        fm_log(FM_LOG_INFO, "--resume: no checkpoint in %s yet; starting from step 0%s%s\n", o->out_dir,
               o->init_from ? " with the weights of --init-from " : "", o->init_from ? o->init_from : "");
    if (ckpt[0] && o->init_from && r->rank == 0) /* many ranks: the same on every rank, said once */
        fm_log(FM_LOG_NOTE, "note: --resume continues the run in %s from %s; --init-from %s is not used (it only "
               "starts a run)\n", o->out_dir, ckpt, o->init_from);
    return FM_OK;
}

/* --config given with --resume: it must be the checkpoint's config p (loaded in r->cfg), but
 * for --max-position-embeddings; the error names the first field that differs. */
static fm_status check_config_resumed(const run *r, const char *p) {
    const fm_train_opts *o = r->o;
    fm_config given;
    FM_TRY(fm_config_load(&given, o->config_path));
    if (o->max_position_embeddings > 0) given.max_position_embeddings = o->max_position_embeddings;
    char *a = fm_config_to_json(&given), *b = fm_config_to_json(&r->cfg);
    bool same = a && b && !strcmp(a, b);
    fm_free(a);
    fm_free(b);
    if (same) return FM_OK;
    if (given.max_position_embeddings != r->cfg.max_position_embeddings) {
        fm_config g2 = given; /* is it the only difference? */
        g2.max_position_embeddings = r->cfg.max_position_embeddings;
        char *x = fm_config_to_json(&g2), *y = fm_config_to_json(&r->cfg);
        const bool only = x && y && !strcmp(x, y);
        fm_free(x);
        fm_free(y);
        if (only)
            return fm_error(FM_ERR_CONFIG, "--config %s has max_position_embeddings %lld but the checkpoint %s was "
                            "trained with %lld; pass --max-position-embeddings %lld (or drop --config)", o->config_path,
                            (long long)given.max_position_embeddings, p, (long long)r->cfg.max_position_embeddings,
                            (long long)r->cfg.max_position_embeddings);
    }
    const fm_config *c = &r->cfg;
    const char *field = given.vocab_size != c->vocab_size ? "vocab_size"
                      : given.hidden_size != c->hidden_size ? "hidden_size"
                      : given.num_hidden_layers != c->num_hidden_layers ? "num_hidden_layers"
                      : given.num_experts != c->num_experts ? "the expert count"
                      : given.moe_intermediate_size != c->moe_intermediate_size ? "the expert width"
                      : given.model_type != c->model_type ? "model_type" : "a field";
    return fm_error(FM_ERR_CONFIG, "--config %s differs from the checkpoint's %s (%s differs); resume with the same "
                    "model config (or drop --config to use the checkpoint's)", o->config_path, p, field);
}

/* The model config: the checkpoint's (checked against --config), --init-from's, or --config;
 * then --max-position-embeddings, and --seq-len within it. */
static fm_status setup_config(run *r, const char *ckpt) {
    const fm_train_opts *o = r->o;
    char p[4200];
    if (ckpt[0]) {
        snprintf(p, sizeof p, "%s/%s", ckpt, FM_CKPT_CONFIG_FILE);
        FM_TRY(fm_config_load(&r->cfg, p));
        if (o->config_path) FM_TRY(check_config_resumed(r, p));
    } else if (o->init_from) {
        snprintf(p, sizeof p, "%s/%s", o->init_from, FM_CKPT_CONFIG_FILE);
        if (o->config_path && !same_file(o->config_path, p))
            return fm_error(FM_ERR_ARG, "--config %s and --init-from %s both give the model config: --init-from takes "
                            "%s; drop --config (--max-position-embeddings and the training flags still apply)",
                            o->config_path, o->init_from, p);
        FM_TRY(fm_config_load(&r->cfg, p));
    } else {
        if (!o->config_path)
            return fm_error(FM_ERR_ARG, "--config: required (a Hugging Face config.json), or --init-from DIR (a Hugging "
                            "Face model folder)");
        snprintf(p, sizeof p, "%s", o->config_path);
        FM_TRY(fm_config_load(&r->cfg, p));
    }
    if (o->max_position_embeddings > 0) r->cfg.max_position_embeddings = o->max_position_embeddings;
    { /* the checkpoints' config.json: the file read, with only the fields flatmoe changes (fm_config.h) */
        char *text;
        FM_TRY(fm_config_read_text(p, &text));
        fm_status st = fm_config_json_as_read(text, &r->cfg, p, &r->config_json);
        fm_free(text);
        FM_TRY(st);
    }
    const fm_config *c = &r->cfg;
    if (o->seq_len > c->max_position_embeddings)
        return fm_error(FM_ERR_ARG, "--seq-len %lld exceeds max_position_embeddings (%lld) of the model config; "
                        "use --seq-len <= %lld, or raise the limit with --max-position-embeddings", (long long)o->seq_len,
                        (long long)c->max_position_embeddings, (long long)c->max_position_embeddings);
    return fm_plan_check_shape(c, o->micro_batch, o->seq_len);
}

/* --init-from a folder that has a tokenizer.json, with byte-level text as data set `ds` (its
 * parts are all text or all tokens; a text part's tokens are in its heap): train reads text one
 * token per byte, ids 0..255 of the tokenizer's vocabulary, not the tokenizer's encoding (which
 * eval and sample use): a warning naming the file and the `flatmoe prepare` command, on rank 0. */
static void warn_text_with_tokenizer(const fm_train_opts *o, const fm_dataset *ds, const char *flag, const char *path) {
    char tj[4200];
    if (!o->init_from || ds->n_parts < 1 || !ds->parts[0].heap) return;
    snprintf(tj, sizeof tj, "%s/tokenizer.json", o->init_from);
    int rank = 0, size = 1;
    if (access(tj, R_OK) != 0 || fm_comm_launcher(&rank, &size, NULL) != FM_OK || rank != 0) return;
    fm_log(FM_LOG_WARN, "warning: %s %s is text, which train reads one token per byte (ids 0..255), not with the "
           "tokenizer of --init-from %s (%s); to train on its tokens: flatmoe prepare --tokenizer %s --input %s "
           "--out PREFIX, then %s PREFIX_000000.bin\n", flag, path, o->init_from, tj, o->init_from, path, flag);
}

/* The training and validation data (--val-data, else --val-fraction of --data). */
static fm_status setup_data(run *r) {
    const fm_train_opts *o = r->o;
    const fm_config *c = &r->cfg;
    FM_TRY(fm_dataset_load(&r->train_all, o->data, o->n_data, c->vocab_size));
    warn_text_with_tokenizer(o, &r->train_all, "--data", o->data[0]);
    if (o->n_val_data > 0) {
        FM_TRY(fm_dataset_load(&r->val_own, o->val_data, o->n_val_data, c->vocab_size));
        warn_text_with_tokenizer(o, &r->val_own, "--val-data", o->val_data[0]);
        r->train = r->train_all;
        r->train.owns = r->train.docs_owned = false;
        r->val = r->val_own;
        r->val.owns = r->val.docs_owned = false;
    } else {
        FM_TRY(fm_dataset_split(&r->train_all, o->val_fraction, &r->train, &r->val));
    }
    FM_TRY(fm_dataset_check_windows(&r->train, o->seq_len, "training data"));
    return fm_dataset_check_windows(&r->val, o->seq_len, "validation data");
}

/* Many ranks: the launcher's world (created over the backend later) is dp x sp ranks (--sp:
 * Ulysses sequence parallelism; --dp defaults to W / sp); *dp gets the data-parallel degree. */
static fm_status setup_world(run *r, int *dp_out) {
    const fm_train_opts *o = r->o;
    FM_TRY(fm_comm_launcher(&r->rank, &r->n_ranks, NULL));
    const int W = r->n_ranks, sp = r->sp = o->sp > 1 ? o->sp : 1;
    if (W % sp != 0)
        return fm_error(FM_ERR_ARG, "--sp %d does not divide the %d rank%s running (the world is dp x sp ranks); "
                        "launch a multiple of %d ranks, or use an --sp that divides %d", sp, W, W == 1 ? "" : "s", sp, W);
    const int dp = o->dp > 0 ? o->dp : W / sp;
    if (W % dp != 0)
        return fm_error(FM_ERR_ARG, "--dp %d does not divide the %d rank%s running (the world is dp x sp ranks); "
                        "use --dp %d or launch a multiple of %d ranks", dp, W, W == 1 ? "" : "s", W / sp, dp);
    if (dp * sp != W)
        return fm_error(FM_ERR_ARG, "--dp %d with %d ranks leaves sp = %d, but --sp is %d (the world is dp x sp ranks); "
                        "pass --sp %d, or use --dp %d (or leave --dp out)", dp, W, W / dp, sp, W / dp, W / sp);
    *dp_out = dp;
#ifdef FM_ACT_BF16
    if (W > 1) { /* GPU ranks: this rank's device is its node-local rank's, chosen before any CUDA context */
        int local_rank = 0, local_size = 1;
        FM_TRY(fm_comm_local(&local_rank, &local_size, NULL));
        FM_TRY(fm_backend_default_select_device(local_rank, NULL));
    }
#endif
    return FM_OK;
}

/* The plan: every live set's bound, from the config and flags alone (fm_train_plan.h, as `flatmoe
 * plan` derives it), fitted to the budgets: --mem-budget, else (CUDA) the device's free memory
 * less the context and libraries' growth, measured (plan/fm_plan_device.h); --host-mem-budget,
 * else what this host can pin. The chooser picks every memory knob not given. */
static fm_status setup_plan(run *r, fm_train_plan *tp) {
    const fm_train_opts *o = r->o;
    const fm_config *c = &r->cfg;
    const int W = r->n_ranks;
    FM_TRY(fm_train_plan_request(o, c, W, r->sp, FM_PLAN_TARGET_BUILD, tp));
    r->rc = tp->rc; /* freed with the run */
    tp->rc = NULL;
    fm_plan_req *req = &tp->req;
    size_t budget = o->mem_budget;
    fm_device_budget dev = {0};
    if (budget == 0) {
        FM_TRY(fm_device_budget_measure(c->head_dim, &dev));
        budget = dev.budget;
    }
    size_t host_budget = o->host_mem_budget_given ? o->host_mem_budget : fm_host_mem_budget_default();
    if (host_budget == 0 && !o->host_mem_budget_given) host_budget = FM_HOST_BUDGET_UNLIMITED; /* unknown */
    if (!o->host_mem_budget_given && host_budget != FM_HOST_BUDGET_UNLIMITED && W > 1) {
        /* the node's pinnable memory is shared by its ranks (as plan --world splits it): each
         * rank plans its share; --host-mem-budget gives one rank's budget as it is */
        int local_rank = 0, local_size = 1;
        if (fm_comm_local(&local_rank, &local_size, NULL) == FM_OK && local_size > 1) host_budget /= (size_t)local_size;
    }
    fm_calib cal;
    char note[1400];
    FM_TRY(fm_calib_find(&cal, NULL, o->backend.calib_dir, sizeof(fm_act) == 4 ? "cpu" : "cuda", dev.total ? dev.name : NULL, note));
    /* The expert GEMMs' form (plan/fm_expert_choice.h): FLATMOE_EXPERT_GEMM forces one; auto weighs
     * the sm90 kernel against cuBLAS at every chunk the chooser tries, then settles it at the chunk
     * chosen; the backend is created with it (bo.expert_gemm), so fm_model_layout finds it
     * answering expert_sync_free for the sm90 form (no host wait per MoE chunk). */
    const fm_expert_ask eask = {o->backend.expert_gemm, sizeof(fm_act) != 4,
                                sizeof(fm_act) != 4 && fm_backend_default_expert_sm90_ok() == 1, o->backend.cpu_fp8_codes};
    FM_TRY(fm_train_plan_experts(tp, o, &eask, &cal));
    const fm_choose_opts co = fm_train_plan_choose_opts(
        tp, o, budget, o->mem_budget ? "--mem-budget" : "the GPU's measured free memory (no --mem-budget given)",
        host_budget, "--host-mem-budget", &cal);
    fm_projection proj;
    FM_TRY(fm_plan_fit(req, &co, r->rc, &r->plan, &proj));
    fm_expert_choice_finish(req, &r->plan, &eask, &cal, &r->expert_choice);
    if (tp->ep > 1 && req->moe_chunk_tokens <= 0) /* no cap given or chosen: one chunk of the micro-batch (the same plan) */
        req->moe_chunk_tokens = o->micro_batch * o->seq_len;
    if (!o->quiet && o->mem_budget == 0 && budget > 0)
        fm_log(FM_LOG_INFO, "memory budget: %.1f MiB (the GPU's %.1f MiB: %.1f MiB free with the context, less %.1f MiB "
               "the libraries took when loaded and %.0f MiB for kernels loaded later; --mem-budget sets it)\n",
               budget / 1048576.0, dev.total / 1048576.0, dev.free_start / 1048576.0, dev.library_bytes / 1048576.0,
               FM_PLAN_LATE_LOAD_MARGIN / 1048576.0);
    if (!o->quiet && budget > 0)
        fm_log(FM_LOG_INFO, "%s\nprojected step: %.4g s, %.0f tokens/s, MFU %.1f%%\n", note, proj.step_s,
               proj.tokens_per_s, 100.0 * proj.mfu);
    if (!o->quiet && budget > 0 && r->rank == 0) { /* a cheaper state recipe that would be faster: named only */
        char rnote[1200];
        fm_plan_recipe_note(req, &co, proj.step_s, rnote, sizeof rnote);
        if (rnote[0]) fm_log(FM_LOG_NOTE, "%s\n", rnote);
    }
    if (!o->quiet && eask.cuda_bf16 && r->rank == 0) {
        char line[600];
        fm_expert_choice_line(&r->expert_choice, line, sizeof line);
        fm_log(FM_LOG_INFO, "%s\n", line);
    }
    return FM_OK;
}

/* The optimizer and the parameter store, as planned: streamed AdamW, ZeRO-3 shards, ZeRO-1/2,
 * or the whole replica. */
static fm_status setup_optimizer(run *r, const fm_plan_req *req, fm_comm_kind comm_kind) {
    const fm_train_opts *o = r->o;
    fm_model *m = &r->m;
    const int W = r->n_ranks;
    const fm_plan *plan = &r->plan;
    fm_adamw_config(&r->opt, o->beta1, o->beta2, o->adam_eps, o->weight_decay, o->bf16_moments);
    fm_adamw_set_recipe(&r->opt, (fm_master_recipe)o->master_weights, o->seed);
    const bool bf16w = o->master_weights != FM_MASTER_FP32; /* no fp32 master (fm_train_opts_check_flags: no
                                                                 offload, ZeRO-3 or --ep with it) */
    r->optim = &fm_adamw_ops;
    r->opt_self = &r->opt;
    if (req->offload_optimizer) { /* the streamed AdamW: its host state, as planned; the store without master */
        FM_TRY(fm_offload_adamw_create_split(&r->oopt, &r->opt, m->p.n_params, req->offload_bucket,
                                             o->offload_optimizer_slots,
                                             req->offload_fraction > 0 ? req->offload_fraction : 1.0, &r->be));
        if (r->oopt.host.capacity != fm_arena_round(plan->host_optimizer_bytes)) {
            char msg[200];
            snprintf(msg, sizeof msg, "the offloaded optimizer's host arena holds %zu bytes but the plan says %zu",
                     r->oopt.host.capacity, plan->host_optimizer_bytes);
            fm_abort(__FILE__, __LINE__, msg);
        }
        r->optim = &fm_offload_adamw_ops;
        r->opt_self = &r->oopt;
        FM_TRY(fm_param_store_create_host_master(&r->ps, m, r->optim->state_bytes(r->opt_self, m->p.n_params),
                                                 r->oopt.h_master));
    } else if (o->zero == 3 && W > 1) { /* ZeRO-3: the shards, two gather slots, one group's gradients */
        FM_TRY(fm_zero3_layout_params(&r->z3, &m->p, r->rank, W));
        FM_TRY(fm_param_store_create_zero3(&r->ps, m, &r->z3, r->optim->state_bytes(r->opt_self, r->z3.shard_len)));
        r->zero3 = true;
    } else if (o->zero && W > 1 && comm_kind == FM_COMM_KIND_NCCL) {
        /* the checkpoint gathers the Adam shards into a host buffer on rank 0 (fm_train_ckpt.c), which
         * NCCL cannot write: refused here rather than failing at the first save */
        return fm_error(FM_ERR_ARG, "--zero 1 with the nccl communicator: its checkpoints gather Adam's shards into "
                                    "host memory, which NCCL cannot write; use --zero 3 (whose gathers stay on the "
                                    "device) or --comm mpi");
    } else if (o->zero && W > 1) { /* ZeRO-1/2: the store padded to W blocks, AdamW's state of this rank's */
        const size_t ob = r->optim->state_bytes(r->opt_self, fm_param_store_shard_len(m->p.n_params, W));
        FM_TRY(bf16w ? fm_param_store_create_bf16(&r->ps, m, r->rank, W, ob)
                     : fm_param_store_create_sharded(&r->ps, m, r->rank, W, ob));
    } else if (bf16w) { /* a bf16 recipe: weights and grads, no master */
        FM_TRY(fm_param_store_create_bf16(&r->ps, m, 0, 1, r->optim->state_bytes(r->opt_self, m->p.n_params)));
    } else {
        FM_TRY(fm_param_store_create(&r->ps, m, r->optim->state_bytes(r->opt_self, m->p.n_params)));
    }
    r->optim->init(r->opt_self, &r->ps, &r->be);
    return FM_OK;
}

/* The model's arenas as planned, and the step's schedule with its hooks (ZeRO-3's gathers, the
 * optimizer overlap, the checkpoint offload). */
static fm_status setup_layout(run *r, const fm_train_plan *tp) {
    const fm_train_opts *o = r->o;
    const fm_plan_req *req = &tp->req;
    fm_model *m = &r->m;
    const int W = r->n_ranks, ep = tp->ep;
    const fm_plan *plan = &r->plan;
    const bool vocab_ring = req->vocab_ring > 1;
    fm_layout_opts lo = req->layout; /* the flags' layout knobs as planned (the chooser's, e.g. the fp8
                                        cache), then what this run derives: */
    lo.recompute = req->recompute;
    lo.moe_chunk_tokens = req->moe_chunk_tokens;
    lo.ce_block_tokens = req->ce_block_tokens;
    lo.ce_block_vocab = req->ce_block_vocab;
    lo.n_offloaded_boundaries = req->n_offloaded_boundaries;
    lo.keep_attention = req->keep_attention;
    lo.ep = ep;
    lo.ep_rank = r->rank % ep;
    lo.llep = &tp->llep;
    lo.sp = r->sp;
    lo.vocab_ring = vocab_ring ? W : 0;
    lo.expert_fp8 = o->expert_fp8;
    lo.expert_fp8_codes = req->expert_fp8_codes;
    FM_TRY(fm_model_layout(m, o->micro_batch, o->seq_len / r->sp, &lo)); /* this rank's slice of each sequence */
    if (vocab_ring && !o->quiet)
        fm_log(FM_LOG_INFO, "vocab-parallel: Ring-DTP over %d ranks, head rows [%lld, %lld) on this rank (%lld of %lld), "
               "moving %s\n", W, (long long)m->mesh.vocab_first, (long long)(m->mesh.vocab_first + m->mesh.vocab_rows),
               (long long)m->mesh.vocab_rows, (long long)r->cfg.vocab_size,
               fm_lce_ring_choose(m->a.N, r->cfg.vocab_size, W) == FM_LCE_RING_ACTIVATIONS ? "activations (N <= V/P)"
                                                                                         : "weight shards (N > V/P)");
    else if (tp->vocab_flag && !o->quiet)
        fm_log(FM_LOG_INFO, "vocab-parallel: one rank, so the one-rank linear cross-entropy (the ring at P = 1)\n");
    for (int i = 0; i < FM_LIVE_COUNT; i++) {
        const fm_arena *a = fm_train_arena(r, i);
        if (a->capacity != fm_arena_round(plan->bytes[i])) {
            char msg[200];
            snprintf(msg, sizeof msg, "the %s arena holds %zu bytes but the plan says %zu", fm_live_set_names[i],
                     a->capacity, plan->bytes[i]);
            fm_abort(__FILE__, __LINE__, msg);
        }
    }
    FM_TRY(fm_step_ws_init(&r->step, m, o->grad_accum));
    r->step.zero_ps = r->ps.sharded && !r->zero3 ? &r->ps : NULL; /* ZeRO-1/2: the step updates this rank's shard */
    if (r->zero3) { /* ZeRO-3: the step's and evaluation's schedules gather and reduce-scatter in its hook */
        fm_zero3_bind(&r->z3, m, &r->ps, &r->world);
        if (ep > 1) fm_zero3_set_edp(&r->z3, &r->ep.edp); /* the experts' gradients: over the ranks holding them */
        r->step.zero3 = &r->z3;
        FM_TRY(fm_schedule_add_group_hook(&r->step.sched, fm_zero3_hook, &r->z3));
        fm_schedule_init(&r->eval_sched, m);
        FM_TRY(fm_schedule_add_group_hook(&r->eval_sched, fm_zero3_hook, &r->z3));
    }
    r->step.ep = ep > 1 ? &r->ep : NULL; /* expert parallelism: its gradients' reduction */
    /* the optimizer overlap (not with ZeRO-1/2, whose update ends in an all-gather of the weights,
     * nor ZeRO-3, whose weights are gathered group by group) */
    if (!o->no_optimizer_overlap && !r->step.zero_ps && !r->zero3) FM_TRY(fm_step_ws_enable_overlap(&r->step, m));
    if (req->n_offloaded_boundaries > 0) { /* the offload policy: its pinned host copies, as planned, and its hook */
        FM_TRY(fm_sco_create(&r->sco, m));
        if (r->sco.host.capacity != fm_arena_round(plan->host_bytes - plan->host_optimizer_bytes)) {
            char msg[200];
            snprintf(msg, sizeof msg, "the offloaded-boundaries host arena holds %zu bytes but the plan says %zu",
                     r->sco.host.capacity, plan->host_bytes - plan->host_optimizer_bytes);
            fm_abort(__FILE__, __LINE__, msg);
        }
        FM_TRY(fm_sco_attach(&r->sco, &r->step.sched));
    }
    return FM_OK;
}

/* Backend, model, communicators and optimizer, allocated from the plan. */
static fm_status setup_allocate(run *r, const fm_train_plan *tp, int dp) {
    const fm_train_opts *o = r->o;
    const fm_config *c = &r->cfg;
    const int W = r->n_ranks, sp = r->sp, ep = tp->ep;
    fm_backend_opts bo = o->backend;
    bo.threads = o->threads;
    bo.max_head_dim = c->head_dim;
    bo.tile_q = o->att_tile_q;
    bo.tile_kv = o->att_tile_kv;
    bo.gpu_workspace = r->plan.gpu_workspace;
    bo.expert_gemm = r->expert_choice.gemm; /* auto resolved: sm90 or cublas (forced forms as given) */
    if (tp->req.expert_fp8_codes) bo.expert_gemm = o->backend.expert_gemm; /* auto or sm90: the FP8 kernel serves */
    r->backend_opts = bo;
    FM_TRY(fm_backend_default_init_opts(&r->be, &bo));
    r->be_ok = true;
    FM_TRY(fm_model_create_ep(&r->m, c, r->be, ep, r->rank % ep));
    r->model_ok = true;
    fm_model *m = &r->m;
    fm_comm_kind comm_kind = FM_COMM_KIND_AUTO; /* --comm: self on one rank (auto), mpi or nccl */
    FM_TRY(fm_comm_world_create_kind(&r->world, &r->be, o->comm_timeout, (fm_comm_kind)o->comm_kind, o->comm_check,
                                     &comm_kind));
    r->world_ok = true;
    if (!o->quiet && r->rank == 0 && comm_kind != FM_COMM_KIND_AUTO)
        fm_log(FM_LOG_INFO, "communicator: %s over %d rank%s\n", r->world.ops->name, W, W == 1 ? "" : "s");
    FM_TRY(fm_train_agree(&r->world, o, c)); /* every rank with the same flags, before any other collective */
    m->mesh.comm = &r->world; /* the batch's valid targets, loss sums and router statistics */
    if (tp->req.vocab_ring > 1) m->mesh.vocab_comm = &r->world; /* Ring-DTP over every rank (fm_layout_opts.vocab_ring) */
    if (sp > 1) { /* Ulysses: the mesh's sp group carries attention's all-to-alls */
        FM_TRY(fm_comm_group_create(&r->mesh, &r->world, dp, 1, sp));
        r->mesh_ok = true;
        m->mesh.sp_comm = &r->mesh.axis[FM_AXIS_SP].comm;
        /* the sp ranks of a data-parallel rank read its windows and keep their slice of each */
        const int sp_rank = fm_comm_rank(m->mesh.sp_comm);
        FM_TRY(fm_dataset_set_seq_slice(&r->train, sp_rank, sp));
        FM_TRY(fm_dataset_set_seq_slice(&r->val, sp_rank, sp));
    }
    r->ep.ep = 1;
    if (ep > 1) FM_TRY(fm_train_ep_init(&r->ep, &r->world, dp, ep, sp, m)); /* the ep and expert-data-parallel groups */
    FM_TRY(fm_router_seq_aux_check(&m->router, o->moe_seq_aux_loss_coeff, sp));
    m->router.seq_aux_coef = o->moe_seq_aux_loss_coeff; /* the sequence-wise balance loss (fm_router.h) */
    if (o->test_hooks.force_route) { /* test hook: adversarial routing (fm_router.h) */
        m->router.force_route = true;
        m->router.force_first = o->test_hooks.force_first % m->router.num_experts;
        m->router.force_percent = o->test_hooks.force_percent;
    }
    /* the sampling cursor: this rank of the data-parallel ranks (fm_dataset_sample_batch) */
    FM_TRY(fm_dataset_set_ranks(&r->train, sp > 1 ? fm_comm_rank(&r->mesh.axis[FM_AXIS_DP].comm) : fm_comm_rank(&r->world),
                                dp));
    FM_TRY(setup_optimizer(r, &tp->req, comm_kind));
    FM_TRY(setup_layout(r, tp));
    return fm_train_ckpt_init(r);
}

/* Warnings of a resume whose fixed-after-step-1 flags differ from the checkpoint's (ts). */
static void warn_resumed(const run *r, const train_state *ts, int dp) {
    const fm_train_opts *o = r->o;
    if (r->rank != 0) return;
    /* many ranks: the sequences per micro-batch are micro_batch x dp (a resume at another W
     * continues the same run when that product is kept) */
    const int64_t ts_dp = ts->dp > 0 ? ts->dp : 1;
    /* the products in 128 bits: neither the flags' nor state.json's values can overflow them */
    const bool same_global = (__int128)ts->micro_batch * ts_dp == (__int128)o->micro_batch * dp;
    if (ts->seq_len != o->seq_len || !same_global || ts->grad_accum != o->grad_accum)
        fm_log(FM_LOG_WARN, "warning: resuming with --seq-len/--micro-batch/--grad-accum %lld/%lld/%lld on %d "
               "data-parallel rank%s, but the checkpoint was trained with %lld/%lld/%lld on %lld: the global batch "
               "changed, so the run will not match an uninterrupted one (keep micro-batch x data-parallel ranks)\n",
               (long long)o->seq_len, (long long)o->micro_batch, (long long)o->grad_accum, dp, dp == 1 ? "" : "s",
               (long long)ts->seq_len, (long long)ts->micro_batch, (long long)ts->grad_accum, (long long)ts_dp);
    if (ts->bf16_moments != o->bf16_moments)
        fm_log(FM_LOG_WARN, "warning: resuming with %s Adam moments, but the checkpoint was trained with %s: the run "
               "will not match an uninterrupted one (%s to continue it as it was)\n",
               o->bf16_moments ? "bf16" : "fp32", ts->bf16_moments ? "--bf16-moments" : "fp32 moments",
               ts->bf16_moments ? "pass --bf16-moments" : "drop --bf16-moments");
    if (ts->master_weights != o->master_weights) { /* the checkpoint's fp32 weights load under any recipe */
        const char *now = fm_master_recipe_name((fm_master_recipe)o->master_weights),
                   *was = fm_master_recipe_name((fm_master_recipe)ts->master_weights);
        fm_log(FM_LOG_WARN, "warning: resuming with --master-weights %s, but the checkpoint was trained with "
               "--master-weights %s: the run will not match an uninterrupted one (pass --master-weights %s to "
               "continue it as it was)\n", now, was, was);
    }
    if (ts->expert_fp8 != o->expert_fp8)
        fm_log(FM_LOG_WARN, "warning: resuming with --expert-precision %s, but the checkpoint was trained with "
               "--expert-precision %s: the run will not match an uninterrupted one (pass --expert-precision %s "
               "to continue it as it was)\n", o->expert_fp8 ? "fp8" : "bf16", ts->expert_fp8 ? "fp8" : "bf16",
               ts->expert_fp8 ? "fp8" : "bf16");
}

/* The data draw (fm_train_data.h): --pack resolved (a resumed run keeps its own mode), the packer,
 * and with --epochs the steps they take (set in the options: the loop, the schedule and
 * state.json read o->steps). */
static fm_status setup_data_draw(run *r, const char *ckpt, int dp) {
    const fm_train_opts *o = r->o;
    int resumed = 0;
    if (ckpt[0]) {
        char p[4200];
        train_state ts0;
        memset(&ts0, 0, sizeof ts0);
        snprintf(p, sizeof p, "%s/%s", ckpt, FM_CKPT_STATE_FILE);
        if (fm_train_state_read(p, &ts0) == FM_OK) resumed = ts0.pack_mode;
    }
    int64_t steps = o->steps;
    FM_TRY(fm_train_data_init(&r->data, o, &r->train, dp, r->train.rank, resumed, r->step.batches, &steps));
    if (o->epochs > 0 && r->o_rw) {
        r->o_rw->steps = steps;
        if (!o->quiet && r->rank == 0)
            fm_log(FM_LOG_INFO, "--epochs %lld: %lld optimizer steps (%s)\n", (long long)o->epochs, (long long)steps,
                   r->data.mode == FM_PACK_OFF ? "the data's tokens per epoch" : "the packed batches of each epoch");
    }
    if (!o->quiet && r->rank == 0 && r->data.mode != FM_PACK_OFF)
        fm_log(FM_LOG_INFO, "data: --pack %s: rows of %lld tokens filled with %s (%lld documents)%s\n",
               fm_train_data_mode_name(r->data.mode), (long long)o->seq_len,
               r->data.mode == FM_PACK_PAD ? "one whole document each" : "whole documents", (long long)r->train.n_docs,
               o->pack == FM_PACK_AUTO ? " (auto: the data has a document index and the run fine-tunes)" : "");
    return FM_OK;
}

/* A bf16 recipe's initial weights: drawn as fm_model_init_weights draws them, rounded to bf16
 * (nearest even), into the store (fm_param_store_upload_f32). */
static fm_status init_weights_bf16(run *r, uint64_t seed) {
    fm_model *m = &r->m;
    const bool host = m->be.ops->host_memory; /* the fp32 build's weights: written in place */
    float *w = host ? (float *)(void *)m->p.params : fm_malloc(sizeof(float) * (size_t)m->p.n_params);
    if (!w) return fm_error(FM_ERR_NOMEM, "memory: cannot stage %lld initial weights on the host", (long long)m->p.n_params);
    fm_params_init_weights_host(&m->p, seed, w);
    fm_adamw_round_weights(w, m->p.n_params);
    const fm_status s = host ? FM_OK : fm_param_store_upload_f32(&r->ps, m, w);
    if (!host) fm_free(w);
    return s;
}

/* The checkpoint's state (weights, optimizer, data cursor) or fresh weights; *ts for this run. */
static fm_status setup_state(run *r, const char *ckpt, train_state *ts, fm_rng *data_rng, int dp) {
    const fm_train_opts *o = r->o;
    if (ckpt[0]) {
        FM_TRY(fm_train_load_checkpoint(r, ckpt, ts));
        if (o->master_weights != FM_MASTER_FP32 && r->m.be.ops->host_memory) /* another recipe's fp32 weights */
            fm_adamw_round_weights((float *)(void *)r->m.p.params, r->ps.n_alloc);
        data_rng->state = ts->data_rng;
        warn_resumed(r, ts, dp);
        if (!o->quiet) fm_log(FM_LOG_INFO, "resumed from %s (step %lld)\n", ckpt, (long long)ts->step);
    } else {
        if (o->init_from) FM_TRY(init_from_folder(r, o->init_from));
        else if (r->zero3) { /* every rank draws only its shard of the initial weights (bounded staging) */
            FM_TRY(fm_ckpt_stream_init_zero3(r, o->seed));
        } else if (o->master_weights != FM_MASTER_FP32) { /* bf16 values, and no master to go through */
            FM_TRY(init_weights_bf16(r, o->seed));
        } else FM_TRY(fm_model_init_weights(&r->m, o->seed));
        fm_rng_seed(data_rng, o->seed ^ 0xDA7A5EEDull);
        ts->seed = o->seed;
    }
    ts->seq_len = o->seq_len;
    ts->micro_batch = o->micro_batch;
    ts->dp = dp;
    ts->bf16_moments = o->bf16_moments;
    ts->master_weights = o->master_weights;
    ts->expert_fp8 = o->expert_fp8;
    ts->grad_accum = o->grad_accum;
    ts->steps = o->steps;
    return FM_OK;
}

fm_status fm_train_setup(run *r, train_state *ts, fm_rng *data_rng) {
    const fm_train_opts *o = r->o;
    FM_TRY(fm_train_opts_check(o));
    char ckpt[4096];
    FM_TRY(setup_resume_point(r, ckpt, sizeof ckpt));
    FM_TRY(setup_config(r, ckpt));
    FM_TRY(setup_data(r));
    int dp = 1;
    FM_TRY(setup_world(r, &dp));
    fm_train_plan tp;
    fm_status s = setup_plan(r, &tp);
    if (s == FM_OK) s = setup_allocate(r, &tp, dp);
    if (s == FM_OK) s = setup_data_draw(r, ckpt, dp);
    if (s == FM_OK) s = setup_state(r, ckpt, ts, data_rng, dp);
    if (s == FM_OK && ckpt[0]) s = fm_train_data_seek(&r->data, ts->pk_epoch, ts->pk_next, ts->pk_done);
    ts->pack_mode = r->data.mode;
    if (s == FM_OK) { /* the run folder and metrics.jsonl (many ranks: rank 0 writes it; r->metrics NULL elsewhere) */
        s = fm_mkdirs(o->out_dir);
        char mpath[4200];
        snprintf(mpath, sizeof mpath, "%s/metrics.jsonl", o->out_dir);
        if (s == FM_OK && r->rank == 0) {
            s = fm_train_truncate_metrics(mpath, ckpt[0] ? ts->step : -1);
            if (s == FM_OK && !(r->metrics = fopen(mpath, "a")))
                s = fm_error(FM_ERR_IO, "%s: cannot open for appending: %s", mpath, strerror(errno));
        }
    }
    if (s == FM_OK && r->rank == 0 && o->tensorboard) { /* --tensorboard: rank 0 writes the events */
        s = fm_tensorboard_open(&r->tb, o->tensorboard);
        if (s == FM_OK && !o->quiet) fm_log(FM_LOG_INFO, "tensorboard: %s\n", fm_tensorboard_path(r->tb));
    }
    if (s == FM_OK && !o->quiet) fm_train_print_header(r, &tp.req, o->micro_batch * o->seq_len * o->grad_accum);
    fm_train_plan_free(&tp);
    return s;
}

fm_status fm_train_setup_session(run *r, const char *ckpt, train_state *ts) {
    const fm_train_opts *o = r->o;
    FM_TRY(fm_train_opts_check_flags(o, FM_TRAIN_CHECK_TRAIN));
    FM_TRY(setup_config(r, ckpt));
    int dp = 1;
    FM_TRY(setup_world(r, &dp));
    fm_train_plan tp;
    fm_status s = setup_plan(r, &tp); /* the plan, checked before anything is allocated */
    if (s == FM_OK) s = setup_allocate(r, &tp, dp);
    fm_rng data_rng;
    if (s == FM_OK) s = setup_state(r, ckpt, ts, &data_rng, dp);
    fm_train_plan_free(&tp);
    return s;
}
