/* Checkpoint glue of the trainer: the model's table for the Hugging Face mapping, state.json,
 * metrics.jsonl on resume, saving and loading a run's checkpoint, and loading a checkpoint's
 * weights for inference. The tensors themselves are read and named by io/fm_hf_weights. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../io/fm_checkpoint.h"
#include "fm_train_internal.h"

/* ---- the model's table for the Hugging Face mapping ----------------------------------------- */

fm_status fm_train_hf_init(fm_train_hf *h, const fm_model_params *pp) {
    const fm_config *c = &pp->cfg;
    const int64_t L = c->num_hidden_layers;
    memset(h, 0, sizeof *h);
    h->params = fm_malloc(sizeof(fm_hf_param) * (size_t)(pp->n_tensors > 0 ? pp->n_tensors : 1));
    h->experts = fm_malloc(sizeof(fm_hf_experts) * (size_t)(L > 0 ? L : 1));
    if (!h->params || !h->experts) {
        fm_train_hf_free(h);
        return fm_error(FM_ERR_NOMEM, "out of memory for the tensor table (%d tensors)", pp->n_tensors);
    }
    for (int i = 0; i < pp->n_tensors; i++) {
        const fm_param *p = &pp->table[i];
        h->params[i] = (fm_hf_param){p->name, p->ndim, {p->shape[0], p->shape[1]}, p->offset};
    }
    for (int64_t l = 0; l < L; l++) { /* a table-only model without a layout (--ep's full table) has none */
        int64_t g = 0, u = 0, d = 0;
        if (pp->offsets) fm_params_layer_expert_offsets(pp, l, &g, &u, &d);
        h->experts[l] = (fm_hf_experts){g, u, d};
    }
    h->t = (fm_hf_table){h->params, pp->n_tensors, L, pp->E_loc > 0 ? pp->E_loc : c->num_experts, c->hidden_size,
                         c->moe_intermediate_size,
                         c->model_type == FM_MODEL_MIXTRAL ? "block_sparse_moe" : "mlp", h->experts,
                         c->tie_word_embeddings, c->model_type_name,
                         c->num_nextn_predict_layers > 0 ? c->num_hidden_layers : 0};
    if (c->expert_bias && pp->offsets) { /* gpt_oss: its fused experts' biases (io/fm_hf_weights.h) */
        if (!(h->expert_bias = fm_malloc(sizeof(fm_hf_experts) * (size_t)(L > 0 ? L : 1)))) {
            fm_train_hf_free(h);
            return fm_error(FM_ERR_NOMEM, "out of memory for the tensor table (%lld layers)", (long long)L);
        }
        for (int64_t l = 0; l < L; l++) {
            int64_t g, u, d;
            fm_params_layer_expert_bias_offsets(pp, l, &g, &u, &d);
            h->expert_bias[l] = (fm_hf_experts){g, u, d};
        }
        h->t.expert_bias = h->expert_bias;
    }
    return FM_OK;
}

void fm_train_hf_free(fm_train_hf *h) {
    fm_free(h->params);
    fm_free(h->experts);
    fm_free(h->expert_bias);
    memset(h, 0, sizeof *h);
}

/* ---- loading tensors into backend buffers --------------------------------------------------- */

/* fm_hf_read, except that under expert parallelism (m->p.ep > 1: the table holds this rank's
 * experts) the other ranks' experts in the file are skipped, not an error. */
static fm_status hf_read(const fm_model *m, const fm_hf_table *t, const char *path, const char *prefix, float *base) {
    if (m->p.ep <= 1) return fm_hf_read(t, path, prefix, base);
    fm_hf_files f;
    FM_TRY(fm_hf_files_open(&f, path));
    char extra[256];
    const fm_hf_read_opts ro = {false, extra, sizeof extra};
    const fm_status s = fm_hf_read_files(t, &f, prefix, base, &ro);
    fm_hf_files_close(&f);
    return s;
}

/* Loads a safetensors file's fp32 tensors (with the name prefix) into a backend buffer [n_params]
 * of dtype in table layout (bf16: rounded to nearest even): directly when the backend's memory is
 * host memory and dtype fp32, else through a host staging copy. */
static fm_status load_fp32_as_ex(fm_model *m, const fm_hf_table *t, const char *path, const char *prefix, void *dst,
                                 fm_dtype dtype, bool host) {
    if ((host || m->be.ops->host_memory) && dtype == FM_DTYPE_F32) return hf_read(m, t, path, prefix, dst);
    float *stage = fm_malloc(sizeof(float) * (size_t)m->p.n_params);
    if (!stage) return fm_error(FM_ERR_NOMEM, "%s: cannot stage %lld values on the host", path, (long long)m->p.n_params);
    fm_status s = hf_read(m, t, path, prefix, stage);
    if (s == FM_OK && dtype == FM_DTYPE_BF16) {
        uint16_t *h = (uint16_t *)stage; /* narrowing in increasing order never overtakes the reads */
        for (int64_t i = 0; i < m->p.n_params; i++) h[i] = fm_f32_to_bf16(stage[i]);
    }
    if (s == FM_OK && host) memcpy(dst, stage, fm_dtype_size(dtype) * (size_t)m->p.n_params);
    else if (s == FM_OK) m->be.ops->copy(m->be.ctx, dst, stage, fm_dtype_size(dtype) * (size_t)m->p.n_params, FM_COPY_H2D);
    fm_free(stage);
    return s;
}

static fm_status load_fp32_as(fm_model *m, const fm_hf_table *t, const char *path, const char *prefix, void *dst,
                              fm_dtype dtype) {
    return load_fp32_as_ex(m, t, path, prefix, dst, dtype, false);
}

/* Loads the weights (with the name prefix) into the fp32 master and refreshes the fm_act weights. */
static fm_status load_master(fm_model *m, const fm_hf_table *t, const char *path, const char *prefix) {
    FM_TRY(load_fp32_as(m, t, path, prefix, m->p.master, FM_DTYPE_F32));
    if ((void *)m->p.master != (void *)m->p.params)
        m->be.ops->convert(m->be.ctx, m->p.params, FM_ACT_DTYPE, m->p.master, FM_DTYPE_F32, m->p.n_params);
    return FM_OK;
}

/* ---- state.json ------------------------------------------------------------------------------ */

static fm_status read_json_file(const char *path, cJSON **out) {
    char *text;
    FM_TRY(fm_ckpt_read_text(path, &text));
    *out = cJSON_Parse(text);
    fm_free(text);
    if (!*out || !cJSON_IsObject(*out)) {
        cJSON_Delete(*out);
        return fm_error(FM_ERR_FORMAT, "%s: malformed JSON; expected an object written by flatmoe", path);
    }
    return FM_OK;
}

/* state.json's integer field `key` of object o (named `where` in messages: "" or "schedule.") into
 * *out: absent or null gives `absent`; else an integer in [lo, hi], or FM_ERR_FORMAT naming the file,
 * the field, the value found and the range (a value past the range once overflowed a product, or
 * wrapped an int, on --resume: issue 27). */
static fm_status state_i64(const cJSON *o, const char *key, const char *where, int64_t lo, int64_t hi,
                           int64_t absent, const char *path, int64_t *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    *out = absent;
    if (!it || cJSON_IsNull(it)) return FM_OK;
    const double v = cJSON_IsNumber(it) ? it->valuedouble : NAN;
    if (!(v >= (double)lo && v <= (double)hi) || v != floor(v)) {
        char found[64];
        if (cJSON_IsNumber(it)) snprintf(found, sizeof found, "%.17g", v);
        else snprintf(found, sizeof found, "a %s", cJSON_IsString(it) ? "string" : cJSON_IsBool(it) ? "boolean"
                                                   : cJSON_IsArray(it) ? "list" : "JSON object");
        return fm_error(FM_ERR_FORMAT, "%s: field \"%s%s\" is %s; expected an integer in [%" PRId64 ", %" PRId64 "] "
                        "(state.json is written by flatmoe: restore the file from the run, or fix the field)", path,
                        where, key, found, lo, hi);
    }
    *out = (int64_t)v;
    return FM_OK;
}

/* state.json's number field `key` of o: absent or null gives NAN; else finite in [lo, hi]. */
static fm_status state_f64(const cJSON *o, const char *key, const char *where, double lo, double hi, const char *path,
                           double *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    *out = NAN;
    if (!it || cJSON_IsNull(it)) return FM_OK;
    if (!cJSON_IsNumber(it) || !(it->valuedouble >= lo && it->valuedouble <= hi))
        return fm_error(FM_ERR_FORMAT, "%s: field \"%s%s\" is %s%.17g; expected a number in [%g, %g] (restore the "
                        "file from the run, or fix the field)", path, where, key, cJSON_IsNumber(it) ? "" : "not a number: ",
                        cJSON_IsNumber(it) ? it->valuedouble : 0.0, lo, hi);
    *out = it->valuedouble;
    return FM_OK;
}

/* state.json's unsigned 64-bit field `key` (a string of digits in base `base`: 16 or 10). */
static fm_status state_u64(const cJSON *o, const char *key, int base, const char *path, uint64_t *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    const char *s = cJSON_IsString(it) ? it->valuestring : NULL;
    char *end = NULL;
    errno = 0;
    if (s && *s && *s != '-' && *s != '+' && *s != ' ') *out = strtoull(s, &end, base);
    if (!end || *end || errno)
        return fm_error(FM_ERR_FORMAT, "%s: field \"%s\" is %s%s%s; expected a string of %s digits (an unsigned 64-bit "
                        "value: restore the file from the run, or fix the field)", path, key, s ? "\"" : "",
                        s ? s : "missing or not a string", s ? "\"" : "", base == 16 ? "hexadecimal" : "decimal");
    return FM_OK;
}

/* state.json's "expert_precision" is "fp8" (absent in older checkpoints: bf16) */
static bool json_is_fp8(const cJSON *o) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, "expert_precision");
    return cJSON_IsString(it) && strcmp(it->valuestring, "fp8") == 0;
}

static char *state_to_json(const run *r, const train_state *s) {
    cJSON *o = cJSON_CreateObject();
    char hex[32];
    cJSON_AddNumberToObject(o, "step", (double)s->step);
    cJSON_AddNumberToObject(o, "optimizer_step", (double)s->opt_step);
    cJSON_AddNumberToObject(o, "tokens_seen", (double)s->tokens_seen);
    snprintf(hex, sizeof hex, "%016" PRIx64, s->data_rng);
    cJSON_AddStringToObject(o, "data_rng_state", hex);
    snprintf(hex, sizeof hex, "%" PRIu64, s->seed);
    cJSON_AddStringToObject(o, "seed", hex);
    cJSON_AddNumberToObject(o, "seq_len", (double)s->seq_len);
    cJSON_AddNumberToObject(o, "micro_batch", (double)s->micro_batch);
    cJSON_AddNumberToObject(o, "grad_accum", (double)s->grad_accum);
    cJSON_AddNumberToObject(o, "steps", (double)s->steps);
    cJSON_AddNumberToObject(o, "threads", (double)r->o->threads);
    cJSON *sch = cJSON_AddObjectToObject(o, "schedule"); /* what --resume keeps unless given again */
    cJSON_AddNumberToObject(sch, "lr", r->o->lr);
    cJSON_AddNumberToObject(sch, "min_lr", r->o->min_lr);
    cJSON_AddNumberToObject(sch, "warmup", (double)r->o->warmup);
    cJSON_AddStringToObject(o, "adam_moments", s->bf16_moments ? "bf16" : "fp32");
    cJSON_AddStringToObject(o, "master_weights", fm_master_recipe_name((fm_master_recipe)s->master_weights));
    cJSON_AddStringToObject(o, "expert_precision", s->expert_fp8 ? "fp8" : "bf16");
    /* the sampling cursor (fm_dataset_sample_batch): the RNG state is all of it; rank, world and
     * the training tokens say what it was drawn over */
    cJSON *cur = cJSON_AddObjectToObject(o, "data_cursor");
    snprintf(hex, sizeof hex, "%016" PRIx64, s->data_rng);
    cJSON_AddStringToObject(cur, "rng_state", hex);
    cJSON_AddNumberToObject(cur, "rank", r->train.rank);
    cJSON_AddNumberToObject(cur, "world", r->train.world);
    cJSON_AddNumberToObject(cur, "train_tokens", (double)r->train.n_tokens);
    /* packed documents (fm_pack.h): the packer's cursor is all of it */
    cJSON_AddStringToObject(cur, "pack", fm_train_data_mode_name(r->data.mode));
    if (r->data.mode != FM_PACK_OFF) {
        cJSON_AddNumberToObject(cur, "epoch", (double)s->pk_epoch);
        cJSON_AddNumberToObject(cur, "document", (double)s->pk_next);
        cJSON_AddNumberToObject(cur, "position", (double)s->pk_done);
        cJSON_AddNumberToObject(cur, "train_documents", (double)r->train.n_docs);
    }
    cJSON_AddNumberToObject(o, "data_parallel", (double)(s->dp > 0 ? s->dp : 1));
    if (r->o->spec_json) { /* the run spec, restored by --resume (run/fm_spec_resume.h) */
        cJSON *spec = cJSON_Parse(r->o->spec_json);
        if (spec) cJSON_AddItemToObject(o, "spec", spec);
    }
    cJSON_AddStringToObject(o, "format", "flatmoe-state-1");
    char *txt = cJSON_Print(o);
    cJSON_Delete(o);
    size_t n = strlen(txt);
    char *out = fm_malloc(n + 2);
    if (out) { memcpy(out, txt, n); out[n] = '\n'; out[n + 1] = 0; }
    cJSON_free(txt);
    return out;
}

/* The ranges of state.json's fields: counts exact in a JSON number (2^53), shapes whose products
 * (micro_batch x data_parallel x seq_len x grad_accum) stay far inside int64, threads as --threads
 * takes them. 0 (or -1) is "absent" where the field may be missing from older checkpoints. */
#define FM_STATE_MAX_COUNT (INT64_C(1) << 53)
#define FM_STATE_MAX_SHAPE (INT64_C(1) << 20)
#define FM_STATE_MAX_SEQ (INT64_C(1) << 30)
#define FM_STATE_MAX_THREADS INT64_C(1000000)

fm_status fm_train_state_read(const char *path, train_state *s) {
    cJSON *o;
    FM_TRY(read_json_file(path, &o));
    const cJSON *sch = cJSON_GetObjectItemCaseSensitive(o, "schedule");
    if (sch && !cJSON_IsObject(sch)) sch = NULL;
    const cJSON *mom = cJSON_GetObjectItemCaseSensitive(o, "adam_moments");
    s->bf16_moments = cJSON_IsString(mom) && strcmp(mom->valuestring, "bf16") == 0;
    const cJSON *mw = cJSON_GetObjectItemCaseSensitive(o, "master_weights");
    s->master_weights = FM_MASTER_FP32;
    for (int k = FM_MASTER_BF16_KAHAN; k <= FM_MASTER_BF16_SR && cJSON_IsString(mw); k++)
        if (!strcmp(mw->valuestring, fm_master_recipe_name((fm_master_recipe)k))) s->master_weights = k;
    s->expert_fp8 = json_is_fp8(o);
    const cJSON *cur = cJSON_GetObjectItemCaseSensitive(o, "data_cursor");
    const cJSON *pk = cJSON_GetObjectItemCaseSensitive(cur, "pack");
    s->pack_mode = !cJSON_IsString(pk) ? 0 : !strcmp(pk->valuestring, "on") ? FM_PACK_ON
                 : !strcmp(pk->valuestring, "pad") ? FM_PACK_PAD : FM_PACK_OFF;
    if (!cJSON_IsObject(cur)) cur = NULL;
    fm_status st = FM_OK;
    if (!cJSON_GetObjectItemCaseSensitive(o, "step") || !cJSON_GetObjectItemCaseSensitive(o, "optimizer_step"))
        st = fm_error(FM_ERR_FORMAT, "%s: expected fields step, optimizer_step, data_rng_state and seed", path);
    if (!st) st = state_i64(o, "step", "", 0, FM_STATE_MAX_COUNT, -1, path, &s->step);
    if (!st) st = state_i64(o, "optimizer_step", "", 0, FM_STATE_MAX_COUNT, -1, path, &s->opt_step);
    if (!st) st = state_i64(o, "tokens_seen", "", 0, FM_STATE_MAX_COUNT, 0, path, &s->tokens_seen);
    if (!st) st = state_i64(o, "seq_len", "", 1, FM_STATE_MAX_SEQ, 0, path, &s->seq_len);
    if (!st) st = state_i64(o, "micro_batch", "", 1, FM_STATE_MAX_SHAPE, 0, path, &s->micro_batch);
    if (!st) st = state_i64(o, "grad_accum", "", 1, FM_STATE_MAX_SHAPE, 0, path, &s->grad_accum);
    if (!st) st = state_i64(o, "steps", "", 1, FM_STATE_MAX_COUNT, 0, path, &s->steps);
    if (!st) st = state_i64(o, "threads", "", 0, FM_STATE_MAX_THREADS, 0, path, &s->threads);
    if (!st) st = state_i64(o, "data_parallel", "", 1, FM_STATE_MAX_SHAPE, 1, path, &s->dp);
    if (!st) st = state_f64(sch, "lr", "schedule.", 1e-30, 1e6, path, &s->lr);
    if (!st) st = state_f64(sch, "min_lr", "schedule.", 0, 1e6, path, &s->min_lr);
    if (!st) st = state_i64(sch, "warmup", "schedule.", 0, FM_STATE_MAX_COUNT, -1, path, &s->warmup);
    if (!st) st = state_u64(o, "data_rng_state", 16, path, &s->data_rng);
    if (!st) st = state_u64(o, "seed", 10, path, &s->seed);
    /* the packer's cursor (fm_pack.h): epoch, next document, tokens of it already placed */
    if (!st) st = state_i64(cur, "epoch", "data_cursor.", 0, FM_STATE_MAX_COUNT, 0, path, &s->pk_epoch);
    if (!st) st = state_i64(cur, "document", "data_cursor.", 0, FM_STATE_MAX_COUNT, 0, path, &s->pk_next);
    if (!st) st = state_i64(cur, "position", "data_cursor.", 0, FM_STATE_MAX_COUNT, 0, path, &s->pk_done);
    cJSON_Delete(o);
    return st;
}

fm_status fm_train_truncate_metrics(const char *path, int64_t last_step) {
    char *text;
    if (fm_ckpt_read_text(path, &text) != FM_OK) return FM_OK; /* no metrics yet */
    size_t n = strlen(text), w = 0;
    char *out = fm_malloc(n + 1);
    if (!out) { fm_free(text); return fm_error(FM_ERR_NOMEM, "%s: out of memory", path); }
    for (char *line = text; *line;) {
        char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line + 1) : strlen(line);
        const char *sp = strstr(line, "\"step\":");
        long long step = sp && sp < line + len ? strtoll(sp + 7, NULL, 10) : -1;
        if (step >= 0 && step <= last_step) { memcpy(out + w, line, len); w += len; }
        line += len;
    }
    fm_status s = fm_write_file_atomic(path, out, w);
    fm_free(out);
    fm_free(text);
    return s;
}

/* ---- saving and loading a run's checkpoint -------------------------------------------------- */

/* Names the table's tensors of a [n_params] fp32 host buffer (data pointers: the writer reads
 * them in place; every other case streams through the staging, fm_train_ckpt_stream.c). */
static fm_status name_state(run *r, const fm_hf_table *t, const void *base, const char *prefix, int slot) {
    const int n = t->n_params;
    return fm_hf_name_tensors(t, base, prefix, r->named + slot * n, r->names + slot * n);
}

/* The optimizer's own fp32 master among its state tensors ("master."), or NULL. */
static const fm_optim_state *optim_master(const fm_optim_state *os, int n) {
    for (int i = 0; i < n; i++)
        if (!strcmp(os[i].prefix, "master.")) return &os[i];
    return NULL;
}

fm_status fm_train_ckpt_init(run *r) {
    const int n = r->ep.full_ok ? r->ep.full.n_tensors : r->m.p.n_tensors; /* --ep: the full table's names */
    r->named = fm_malloc(sizeof(fm_named_tensor) * (size_t)(FM_CKPT_MAX_STATES * n));
    r->names = fm_malloc(sizeof(*r->names) * (size_t)(FM_CKPT_MAX_STATES * n));
    if (!r->named || !r->names) return fm_error(FM_ERR_NOMEM, "out of memory for the tensor name table");
    if (r->ep.full_ok) FM_TRY(fm_train_hf_init(&r->ep_hf, &r->ep.full)); /* --ep: the checkpoint's full names */
    FM_TRY(fm_train_hf_init(&r->hf, &r->m.p));
    return fm_ckpt_stage_init(r); /* the checkpoint staging, once (fm_train_ckpt_stream.h) */
}

static fm_status save_named(run *r, const train_state *ts, const fm_optim_state *os, int nos);

/* ---- many ranks: rank 0 writes, the owners stream their pieces to it (fm_train_ckpt_stream.c) ---- */

static fm_status write_named(run *r, const train_state *ts, int n, int n_optim);

static fm_status save_checkpoint(run *r, const train_state *ts) {
    /* fp32 master (as model.safetensors and master.*: the model's, or the optimizer's when it
     * names one), m, v */
    fm_optim_state os[3];
    const int nos = r->optim->state_tensors(r->opt_self, os, 3);
    if (!fm_ckpt_stream_wanted(r, os, nos)) return save_named(r, ts, os, nos); /* in place */
    int slots;
    FM_TRY(fm_ckpt_stream_prepare(r, os, nos, &slots));
    if (r->rank != 0) return fm_ckpt_stream_serve(r, slots); /* rank 0 writes the files */
    return write_named(r, ts, r->cst.n_full, (slots - 1) * r->cst.n_full);
}

/* The tokenizer beside the weights (sample and eval find it there; transformers loads the folder
 * with it): tokenizer.json and its companions from the run's last checkpoint that has them (the
 * resumed one, or the last saved), else from --init-from's folder, each written atomically into
 * the new checkpoint folder `dir`. None there: nothing to copy. Errors: FM_ERR_IO (the copy). */
static fm_status copy_tokenizer(run *r, const char *dir) {
    static const char *const names[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                        "generation_config.json", "chat_template.jinja"};
    char src[4096] = "", probe[4200];
    if (r->tokenizer_dir[0]) snprintf(src, sizeof src, "%s", r->tokenizer_dir); /* resumed, or saved before */
    else if (r->o->init_from) snprintf(src, sizeof src, "%s", r->o->init_from);
    snprintf(probe, sizeof probe, "%s/tokenizer.json", src);
    if (!src[0] || access(probe, R_OK) != 0 || !strcmp(src, dir)) return FM_OK;
    snprintf(r->tokenizer_dir, sizeof r->tokenizer_dir, "%s", dir); /* the next save copies from here */
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char from[4300], to[4300], *text = NULL;
        snprintf(from, sizeof from, "%s/%s", src, names[i]);
        if (access(from, R_OK) != 0) continue;
        FM_TRY(fm_ckpt_read_text(from, &text));
        snprintf(to, sizeof to, "%s/%s", dir, names[i]);
        const fm_status s = fm_write_file_atomic(to, text, strlen(text));
        fm_free(text);
        FM_TRY(s);
    }
    return FM_OK;
}

/* One rank whose master, m and v are fp32 host buffers (fm_ckpt_stream_wanted false): names
 * them in place (the optimizer's master when it names one, else the model's) and writes. */
static fm_status save_named(run *r, const train_state *ts, const fm_optim_state *os, int nos) {
    const fm_hf_table *t = &r->hf.t;
    const int n = t->n_params;
    const fm_optim_state *ms = optim_master(os, nos);
    const void *master = ms ? ms->base : r->m.p.master;
    FM_TRY(name_state(r, t, master, "", 0));
    FM_TRY(name_state(r, t, master, "master.", 1));
    int k = 2;
    for (int i = 0; i < nos; i++)
        if (&os[i] != ms) FM_TRY(name_state(r, t, os[i].base, os[i].prefix, k++));
    return write_named(r, ts, n, (k - 1) * n);
}

/* Rank 0: writes the checkpoint of r->named (model [n], then the optimizer's [n_optim]),
 * state.json and the tokenizer. */
static fm_status write_named(run *r, const train_state *ts, int n, int n_optim) {
    char *state = state_to_json(r, ts);
    fm_status s = state ? FM_OK : fm_error(FM_ERR_NOMEM, "out of memory writing state.json");
    char dir[4096];
    if (s == FM_OK)
        s = fm_ckpt_write(r->o->out_dir, ts->step, r->named, n, r->named + n, n_optim, r->config_json, state, dir,
                          sizeof dir);
    fm_free(state);
    if (s == FM_OK) s = copy_tokenizer(r, dir);
    if (s == FM_OK && !r->o->quiet) fm_log(FM_LOG_INFO, "saved checkpoint %s\n", dir);
    return s;
}

/* IEEE 754 binary32 -> binary16, round to nearest even (overflow to inf, subnormals, NaN kept NaN). */
static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {                                    /* below 2^-14: a subnormal, m * 2^-24 */
        float v;
        memcpy(&v, &ax, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(v * 16777216.0f));
    }
    uint32_t h = ((ax >> 23) - 112u) << 10 | ((ax & 0x7fffffu) >> 13);
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

/* Whether a value read from a file stored as dtype equals the master value rounded to dtype. */
bool fm_train_same_rounded(float master, float stored, int dtype) {
    uint32_t a, b;
    if (dtype == FM_ST_BF16) return fm_f32_to_bf16(master) == fm_f32_to_bf16(stored);
    if (dtype == FM_ST_F16) return f32_to_f16(master) == f32_to_f16(stored);
    memcpy(&a, &master, 4); /* F32 (and F64, read rounded to fp32): bit for bit */
    memcpy(&b, &stored, 4);
    return a == b;
}

/* --resume: model.safetensors must hold the optimizer's master copy: the table's names and
 * shapes, float dtypes, and nothing else (its values are checked against the master range by
 * range as it loads, fm_ckpt_stream_load). Reads the header only. Errors: FM_ERR_FORMAT naming
 * the first tensor that differs, and how to proceed. */
static fm_status check_model_file(run *r, const char *dir) {
    fm_model *m = &r->m;
    char path[4200], a[96], b[96];
    snprintf(path, sizeof path, "%s/%s", dir, FM_CKPT_MODEL_FILE);
    fm_safetensors st;
    fm_status s = fm_st_open(&st, path);
    if (s != FM_OK) return s;
    const char *how = FM_TRAIN_RESUME_HOW;
    for (int i = 0; i < m->p.n_tensors && s == FM_OK; i++) {
        const fm_param *p = &m->p.table[i];
        const fm_st_tensor *t = fm_st_find(&st, p->name);
        bool same_shape = t && t->ndim == p->ndim;
        for (int d = 0; same_shape && d < p->ndim; d++) same_shape = t->shape[d] == p->shape[d];
        if (!t || !same_shape) {
            snprintf(a, sizeof a, p->ndim == 1 ? "[%lld]" : "[%lld, %lld]", (long long)p->shape[0], (long long)p->shape[1]);
            if (t) snprintf(b, sizeof b, "a tensor of %d dimensions [%lld, ...]", t->ndim, (long long)t->shape[0]);
            s = fm_error(FM_ERR_FORMAT, "--resume: %s disagrees with the optimizer's master copy: tensor '%s' (shape %s) "
                         "is %s%s; the file was changed after the checkpoint was written, or is damaged: %s", path,
                         p->name, a, t ? "there with the wrong shape: " : "missing", t ? b : "", how);
            break;
        }
        if (t->dtype != FM_ST_F32 && t->dtype != FM_ST_BF16 && t->dtype != FM_ST_F16 && t->dtype != FM_ST_F64) {
            s = fm_error(FM_ERR_FORMAT, "--resume: %s: tensor '%s' has dtype %s; expected F32 (or BF16, F16): %s", path,
                         p->name, fm_st_dtype_name(t->dtype), how);
            break;
        }
    }
    /* --ep: the file holds every rank's experts, the table this rank's */
    const int64_t n_expect = m->p.n_tensors + (int64_t)(m->p.ep - 1) * fm_config_num_moe_layers(&m->cfg) * 3 * m->p.E_loc;
    if (s == FM_OK && st.n_tensors != n_expect) { /* every table tensor is there: name one it lacks */
        for (int i = 0; i < st.n_tensors && s == FM_OK; i++)
            if (m->p.ep <= 1 && !fm_params_find(&m->p, st.tensors[i].name))
                s = fm_error(FM_ERR_FORMAT, "--resume: %s holds tensor '%s', which is not a parameter of this model; the "
                             "file was changed after the checkpoint was written: %s", path, st.tensors[i].name, how);
        if (s == FM_OK && m->p.ep > 1)
            s = fm_error(FM_ERR_FORMAT, "--resume: %s holds %d tensors; the model with all its experts has %lld: the "
                         "file was changed after the checkpoint was written: %s", path, st.n_tensors,
                         (long long)n_expect, how);
    }
    fm_st_close(&st);
    return s;
}

fm_status fm_train_load_checkpoint(run *r, const char *dir, train_state *ts) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, FM_CKPT_STATE_FILE);
    FM_TRY(fm_train_state_read(path, ts));
    cJSON *so; /* the sampling cursor: drawn over the same ranks and data? */
    if (read_json_file(path, &so) == FM_OK) {
        const cJSON *cur = cJSON_GetObjectItemCaseSensitive(so, "data_cursor");
        if (cJSON_IsObject(cur)) {
            int64_t w, nt;
            fm_status cs = state_i64(cur, "world", "data_cursor.", 1, FM_STATE_MAX_SHAPE, 1, path, &w);
            if (!cs) cs = state_i64(cur, "train_tokens", "data_cursor.", 0, FM_STATE_MAX_COUNT, -1, path, &nt);
            if (cs) {
                cJSON_Delete(so);
                return cs;
            }
            if (w != r->train.world && r->rank == 0) /* rank 0 speaks for all: the same on every rank */
                fm_log(FM_LOG_NOTE, "note: --resume: the checkpoint's data cursor was drawn over %lld rank(s), this run has "
                        "%d: the same sequences are drawn, split over other ranks (the global batch is micro-batch x "
                        "data-parallel ranks; a warning follows if that changed)\n", (long long)w, r->train.world);
            if (nt >= 0 && nt != r->train.n_tokens && r->rank == 0)
                fm_log(FM_LOG_WARN, "warning: --resume: the training data holds %lld tokens, the checkpoint's was %lld: the "
                        "data order will not match an uninterrupted run\n", (long long)r->train.n_tokens, (long long)nt);
        }
        cJSON_Delete(so);
    }
    /* this rank's ranges of the fp32 master (model.safetensors holds the same values, checked
     * range by range) and of the optimizer's state, from optimizer.safetensors at any world size */
    const bool trust = r->o->resume_trust_optimizer;
    if (trust && !r->o->quiet)
        fm_log(FM_LOG_INFO, "--resume-trust-optimizer: %s/%s is not checked against the master copy\n", dir, FM_CKPT_MODEL_FILE);
    if (!trust) FM_TRY(check_model_file(r, dir)); /* names, shapes, dtypes, count */
    FM_TRY(fm_ckpt_stream_load(r, dir, !trust));
    r->opt.step = ts->opt_step;
    /* test hook (tests/mpi_ckpt.sh): write the loaded state again at once, so that a checkpoint
     * read at one world size and written at another can be compared byte for byte */
    if (r->o->test_hooks.ckpt_resave) FM_TRY(fm_train_save_checkpoint(r, ts)); /* FLATMOE_TEST_CKPT_RESAVE=1 */
    return FM_OK;
}

/* ---- loading a checkpoint for inference ----------------------------------------------------- */

fm_status fm_load_for_inference(fm_model *m, fm_param_store *ps, const char *ckpt_dir, fm_backend be, int64_t B, int64_t T,
                                fm_trained_info *trained) {
    char path[4096];
    fm_config cfg;
    snprintf(path, sizeof path, "%s/%s", ckpt_dir, FM_CKPT_CONFIG_FILE);
    FM_TRY(fm_config_load(&cfg, path));
    fm_trained_info info = {0, false};
    snprintf(path, sizeof path, "%s/%s", ckpt_dir, FM_CKPT_STATE_FILE);
    cJSON *state;
    if (read_json_file(path, &state) == FM_OK) { /* optional: a bare model folder has none */
        const fm_status ss = state_i64(state, "seq_len", "", 1, FM_STATE_MAX_SEQ, 0, path, &info.seq_len);
        info.expert_fp8 = json_is_fp8(state);
        cJSON_Delete(state);
        FM_TRY(ss);
    }
    if (trained) *trained = info;
    if (T <= 0) T = info.seq_len > 0 ? info.seq_len : cfg.max_position_embeddings;
    FM_TRY(fm_model_create(m, &cfg, be));
    fm_status s = fm_param_store_create(ps, m, 0);
    if (s == FM_OK) s = fm_model_layout(m, B, T, NULL);
    fm_train_hf hf = {0};
    if (s == FM_OK) s = fm_train_hf_init(&hf, &m->p);
    if (s == FM_OK) {
        s = load_master(m, &hf.t, ckpt_dir, ""); /* model.safetensors, or model.safetensors.index.json and shards */
    }
    fm_train_hf_free(&hf);
    if (s != FM_OK) {
        fm_model_free(m);
        fm_param_store_free(ps);
    }
    return s;
}

/* Every rank waits for rank 0's writes to end in a barrier of its own long timeout: the next
 * collective's --comm-timeout (300 s) would otherwise count rank 0's writing, which for a large
 * model takes longer (measured: a 1 s timeout failed a 3-step run saving every step). */
#define FM_SAVE_BARRIER_TIMEOUT_S FM_CKPT_SAVE_TIMEOUT_S
fm_status fm_train_save_checkpoint(run *r, const train_state *ts) {
    const fm_status s = save_checkpoint(r, ts);
    if (s != FM_OK || r->n_ranks <= 1) return s;
    const double t = r->o->comm_timeout > FM_SAVE_BARRIER_TIMEOUT_S ? r->o->comm_timeout : FM_SAVE_BARRIER_TIMEOUT_S;
    return fm_comm_barrier(&r->world, t);
}
