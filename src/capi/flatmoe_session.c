/* libflatmoe's session (include/flatmoe.h): options through the run spec's flag table, the
 * trainer's setup path (fm_train_setup_session: the plan checked before anything is allocated),
 * the batch scratch of the token budget, and the error message. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../bounded/fm_linear_ce.h"
#include "../comm/fm_comm.h"
#include "../io/fm_checkpoint.h"
#include "../run/fm_spec_check.h"
#include "../run/fm_spec_finetune.h"
#include "../run/fm_spec_resume.h"
#include "../train/fm_threads.h"
#include "fm_capi.h"

#include <cjson/cJSON.h>

_Static_assert(FM_SPEC_TOPK_MAX == FLATMOE_TOPK_MAX, "--logprobs-topk's bound: the flag table's and the header's");

const char *flatmoe_last_error(void) { return fm_errmsg(); }

int flatmoe_abi_version(void) { return FLATMOE_ABI_VERSION; }

/* flatmoe_set_log's callback behind the engine's sink (its level is fm_log_level's value). */
static flatmoe_log_fn user_log;
static void log_adapter(void *user, fm_log_level level, const char *text) { user_log(user, (int)level, text); }

void flatmoe_set_log(flatmoe_log_fn fn, void *user) {
    user_log = fn;
    fm_log_set(fn ? log_adapter : NULL, user);
}

/* --ckpt DIR: a checkpoint folder (config.json beside model.safetensors), or a run folder whose
 * latest checkpoint is taken. */
static fm_status resolve_ckpt(const char *dir, char *out, size_t cap) {
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/%s", dir, FM_CKPT_CONFIG_FILE);
    if (access(probe, R_OK) == 0) {
        snprintf(out, cap, "%s", dir);
        return FM_OK;
    }
    if (fm_ckpt_find_latest(dir, out, cap, NULL) == FM_OK) return FM_OK;
    return fm_error(FM_ERR_IO, "--ckpt %s: neither a checkpoint folder (no %s) nor a run folder with a complete "
                    "checkpoint; give a folder that `flatmoe train` wrote", dir, FM_CKPT_CONFIG_FILE);
}

/* --ckpt DIR: the options of the session (or `train` run) that wrote the checkpoint, its state.json
 * "spec", for every flag not given again (fm_spec_restore_json, as `train --resume` restores them),
 * and the learning-rate schedule, total and shape that `train --resume` takes from the state
 * itself (the rows fm_spec_restore_json leaves to it). So the options an --init-from session took
 * from the fine-tuning defaults (--lr 2e-5, --min-lr 0, --weight-decay 0, --warmup 0) stay: the
 * same other options continue the run bit for bit. Not restored: a `train` run's --data and
 * --val-data (a session takes no files) and --grad-accum (a session's step is one batch); the
 * invocation's flags are not saved (--logprobs-topk, --kv-cache, --ep, --zero, --quiet: given
 * again). A checkpoint without a readable state.json or a "spec" restores nothing (the loader
 * names what is wrong). Errors: fm_spec_restore_json's (FM_ERR_FORMAT naming the file and field), FM_ERR_NOMEM. */
static fm_status restore_run_spec(flatmoe_session *s, const char *ckpt_dir) {
    static const char *const kept[] = {"lr", "min-lr", "warmup", "steps", "seq-len", "micro-batch", "threads", NULL};
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", ckpt_dir, FM_CKPT_STATE_FILE);
    char *text = NULL;
    if (fm_ckpt_read_text(path, &text) != FM_OK) return FM_OK; /* fm_train_load_checkpoint names what is wrong */
    cJSON *state = cJSON_Parse(text);
    fm_free(text);
    cJSON *spec = cJSON_GetObjectItemCaseSensitive(state, "spec");
    fm_status st = FM_OK;
    if (cJSON_IsObject(spec)) {
        cJSON_DeleteItemFromObjectCaseSensitive(spec, "data");
        cJSON_DeleteItemFromObjectCaseSensitive(spec, "val-data");
        cJSON_DeleteItemFromObjectCaseSensitive(spec, "grad-accum");
        char *js = cJSON_PrintUnformatted(spec);
        st = js ? fm_spec_restore_json(&s->spec, js, path, !s->spec.train.quiet)
                : fm_error(FM_ERR_NOMEM, "flatmoe_open: out of memory reading %s", path);
        free(js);
        for (int i = 0; kept[i] && st == FM_OK; i++) { /* left to train's --resume by fm_spec_restore_json */
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(spec, kept[i]);
            if (!v || fm_spec_given(&s->spec, kept[i])) continue;
            char val[64];
            if (!cJSON_IsNumber(v)) {
                st = fm_error(FM_ERR_FORMAT, "%s: \"spec\" field \"%s\" is not a number; fix the file, or give --%s",
                              path, kept[i], kept[i]);
                break;
            }
            snprintf(val, sizeof val, "%.17g", v->valuedouble);
            st = fm_spec_set(&s->spec, kept[i], val);
        }
    }
    cJSON_Delete(state);
    return st;
}

/* The options, argv-like, through the flag table rows of `train`; --ckpt and --backend are the
 * session's own. */
static fm_status parse_options(flatmoe_session *s, int argc, const char *const *argv, const char **ckpt_arg) {
    fm_run_spec *sp = &s->spec;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!a || strncmp(a, "--", 2) != 0)
            return fm_error(FM_ERR_ARG, "flatmoe_open: option %d is '%s', expected a flag such as --seq-len (the "
                            "options are `flatmoe train`'s flags, and --ckpt DIR)", i, a ? a : "(null)");
        const char *name = a + 2;
        const fm_spec_flag *f = fm_spec_find(name, FM_CMD_TRAIN);
        const bool own = !strcmp(name, "ckpt") || !strcmp(name, "backend");
        if (!f && !own)
            return fm_error(FM_ERR_ARG, "flatmoe_open: unknown option '--%s'; the options are `flatmoe train`'s "
                            "flags (flatmoe train --help, --logprobs-topk among them), and --ckpt DIR and --backend "
                            "cpu|cuda",
                            name);
        if (f && (!strcmp(name, "data") || !strcmp(name, "val-data")))
            return fm_error(FM_ERR_ARG, "flatmoe_open: --%s: a session takes its batches from flatmoe_logprobs and "
                            "flatmoe_train_step, not from files; drop --%s", name, name);
        if (f && f->kind == FM_SPEC_BOOL) {
            FM_TRY(fm_spec_set_row(sp, f, "true", true));
            continue;
        }
        if (i + 1 >= argc || !argv[i + 1])
            return fm_error(FM_ERR_ARG, "flatmoe_open: --%s expects a value after it", name);
        const char *v = argv[++i];
        if (!strcmp(name, "ckpt")) {
            *ckpt_arg = v;
        } else if (!strcmp(name, "backend")) {
            const char *mine = sizeof(fm_act) == sizeof(float) ? "cpu" : "cuda";
            if (strcmp(v, mine) != 0)
                return fm_error(FM_ERR_ARG, "flatmoe_open: --backend %s, but this library is the %s build (fm_act %s); "
                                "load the %s build's library, or pass --backend %s", v, mine,
                                sizeof(fm_act) == sizeof(float) ? "fp32" : "bf16", v, mine);
        } else {
            FM_TRY(fm_spec_set_row(sp, f, v, true));
        }
    }
    return FM_OK;
}

/* The session's rules over the trainer's options: the linear CE (default blocks when not given),
 * the RL head laid out, one vocabulary rank. */
static fm_status session_options(flatmoe_session *s, const char *ckpt_arg) {
    fm_train_opts *o = &s->o;
    if (o->ce_block_tokens == 0 && o->ce_block_vocab == 0)
        return fm_error(FM_ERR_ARG, "flatmoe_open: --ce-block-tokens 0 --ce-block-vocab 0 asks for plain logits, but a "
                        "session's log-probs and losses run through the linear cross-entropy (never N x V); give blocks "
                        "> 0 or leave both out (then %d x %d)", FM_LCE_DEFAULT_BLOCK_TOKENS, FM_LCE_DEFAULT_BLOCK_VOCAB);
    if (o->ce_block_tokens < 0) o->ce_block_tokens = FM_LCE_DEFAULT_BLOCK_TOKENS;
    if (o->ce_block_vocab < 0) o->ce_block_vocab = FM_LCE_DEFAULT_BLOCK_VOCAB;
    if (o->vocab_parallel != FM_VOCAB_PARALLEL_OFF)
        return fm_error(FM_ERR_UNSUPPORTED, "flatmoe_open: --vocab-parallel ring is not in this slice of the library "
                        "(a session's head is one rank's linear CE, on each rank); drop it");
    if (o->sp > 1)
        return fm_error(FM_ERR_UNSUPPORTED, "flatmoe_open: --sp %d is not in this slice of the library: a session's "
                        "ranks each take whole sequences of their own batch, where --sp cuts every sequence across "
                        "ranks; drop --sp (data parallelism and --ep are served)", o->sp);
    if (o->zero == 3)
        return fm_error(FM_ERR_UNSUPPORTED, "flatmoe_open: --zero 3 is not in this slice of the library (not yet tested "
                        "in a session); use --zero 0 or 1 across the ranks");
    if (o->grad_accum != 1)
        return fm_error(FM_ERR_ARG, "flatmoe_open: --grad-accum %lld: a session's train step is one packed batch of "
                        "the token budget; pass --grad-accum 1 (or leave it out) and call flatmoe_train_step per batch",
                        (long long)o->grad_accum);
    if (o->moe_router_bias_update_rate != 0) { /* train's loop moves the bias (fm_router_bias.h); a session's step does not */
        const fm_spec_flag *f = fm_spec_find("moe-router-bias-update-rate", FM_CMD_TRAIN);
        const int row = fm_spec_row(f);
        const bool restored = (s->spec.restored[row / 64] >> (row % 64)) & 1;
        return fm_error(FM_ERR_UNSUPPORTED, "flatmoe_open: --moe-router-bias-update-rate %g%s: a session's train step "
                        "does not move the routers' e_score_correction_bias (aux-loss-free balancing is `flatmoe train`'s "
                        "loop); pass --moe-router-bias-update-rate 0 (the bias then stays as loaded)",
                        o->moe_router_bias_update_rate, restored ? " (the checkpoint's run options)" : "");
    }
    o->layout.rl_head = true;
    o->layout.rl_topk = s->topk_max; /* the top-k log-probs' buffers, planned */
    if (!ckpt_arg && !o->init_from && !o->config_path) {
        return fm_error(FM_ERR_ARG, "flatmoe_open: no model: give --init-from DIR (a Hugging Face folder), --ckpt DIR "
                        "(a flatmoe checkpoint) or --config FILE (fresh weights from --seed)");
    }
    return FM_OK;
}

/* Host scratch of one batch of the token budget (one arena, allocated once: the calls allocate
 * nothing; flatmoe_host.c). */
static fm_status alloc_scratch(flatmoe_session *s) {
    FM_TRY(fm_capi_host_alloc(s));
    if (!s->o.quiet)
        fm_log(FM_LOG_INFO, "library host scratch: %.1f MiB for %lld tokens (%.1f MiB of it the kv cache)\n",
               (double)s->host.capacity / 1048576.0, (long long)s->budget, (double)s->kv.bytes / 1048576.0);
    return FM_OK;
}

static fm_status session_open(flatmoe_session *s, int argc, const char *const *argv) {
    fm_spec_default(&s->spec, FM_CMD_TRAIN);
    const char *ckpt_arg = NULL;
    FM_TRY(parse_options(s, argc, argv, &ckpt_arg));
    s->ckpt[0] = 0;
    if (ckpt_arg) {
        const fm_train_opts *t = &s->spec.train;
        if (t->init_from || t->config_path)
            return fm_error(FM_ERR_ARG, "flatmoe_open: --ckpt %s and %s %s both give the model; keep one", ckpt_arg,
                            t->init_from ? "--init-from" : "--config", t->init_from ? t->init_from : t->config_path);
        FM_TRY(resolve_ckpt(ckpt_arg, s->ckpt, sizeof s->ckpt));
        FM_TRY(restore_run_spec(s, s->ckpt)); /* the run's options (its --init-from defaults among them) */
    }
    char said[512] = "";
    if (!ckpt_arg) FM_TRY(fm_spec_finetune_defaults(&s->spec, said, sizeof said)); /* --init-from: train's values */
    if (said[0] && !s->spec.train.quiet) fm_log(FM_LOG_INFO, "%s\n", said);
    s->spec.library.session = true; /* --logprobs-topk is a session's (fm_spec_check) */
    FM_TRY(fm_spec_check(&s->spec));
    s->topk_max = s->spec.library.logprobs_topk;
    s->o = fm_spec_train_opts(&s->spec);
    FM_TRY(session_options(s, ckpt_arg));
    s->r.o = &s->o;
    s->r.o_rw = &s->o;
    FM_TRY(fm_train_setup_session(&s->r, s->ckpt, &s->ts));
    s->B = s->r.m.a.B;
    s->T = s->r.m.a.T;
    s->budget = s->B * s->T;
    s->threads = s->o.threads > 0 ? s->o.threads : fm_threads_get(); /* re-applied at each call */
    return alloc_scratch(s);
}

int flatmoe_open(flatmoe_session **out, int argc, const char *const *argv) {
    if (!out) return fm_error(FM_ERR_ARG, "flatmoe_open: out is NULL; pass the address of a flatmoe_session *");
    *out = NULL;
    if (argc < 0 || (argc > 0 && !argv))
        return fm_error(FM_ERR_ARG, "flatmoe_open: argc %d with argv %s; pass argc >= 0 options in argv", argc,
                        argv ? "set" : "NULL");
    flatmoe_session *s = calloc(1, sizeof *s);
    if (!s) return fm_error(FM_ERR_NOMEM, "flatmoe_open: cannot allocate the session (%zu bytes)", sizeof *s);
    const fm_status st = session_open(s, argc, argv);
    if (st != FM_OK) {
        char msg[2048]; /* the message outlives the frees below */
        snprintf(msg, sizeof msg, "%s", fm_errmsg());
        flatmoe_close(s);
        return fm_error(st, "%s", msg);
    }
    *out = s;
    return FLATMOE_OK;
}

int flatmoe_finalize(void) { return fm_comm_mpi_finalize(); }

int flatmoe_set_environment(const char *const *envp) {
    const char *vals[FM_COMM_ENV_COUNT] = {0}; /* the launcher's variables (comm/fm_comm.h fm_comm_env_names) */
    for (const char *const *e = envp; e && *e; e++)
        for (int i = 0; i < FM_COMM_ENV_COUNT; i++) {
            const size_t n = strlen(fm_comm_env_names[i]);
            if (!strncmp(*e, fm_comm_env_names[i], n) && (*e)[n] == '=') vals[i] = *e + n + 1;
        }
    return fm_comm_env_set(vals);
}

void flatmoe_close(flatmoe_session *s) {
    if (!s) return;
    if (s->r.model_ok) fm_step_ws_flush(&s->r.step, &s->r.m); /* an overlapped update still in flight */
    fm_train_run_free(&s->r);
    fm_capi_host_free(s);
    fm_free(s->sleep_host);
    fm_spec_free(&s->spec);
    free(s);
}

int flatmoe_get_info(const flatmoe_session *s, flatmoe_info *out) {
    if (!s || !out) return fm_error(FM_ERR_ARG, "flatmoe_get_info: %s is NULL", s ? "out" : "the session");
    const fm_config *c = &s->r.cfg;
    out->vocab_size = c->vocab_size;
    out->micro_batch = s->B;
    out->seq_len = s->T;
    out->token_budget = s->budget;
    out->num_layers = c->num_hidden_layers;
    out->num_experts = c->num_experts;
    out->hidden_size = c->hidden_size;
    out->step = s->ts.step;
    out->num_moe_layers = s->L_moe;
    out->top_k = s->k;
    out->rank = s->r.rank;
    out->n_ranks = s->r.n_ranks;
    out->ep = s->r.ep.ep > 1 ? s->r.ep.ep : 1;
    return FLATMOE_OK;
}
