#include "fm_trainer.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "../backend/fm_backend_default.h"
#include "../core/fm_rng.h"
#include "../data/fm_data.h"
#include "../io/fm_checkpoint.h"
#include "../io/fm_safetensors.h"
#include "../plan/fm_plan.h"
#include "../schedule/fm_schedule.h"

void fm_train_opts_default(fm_train_opts *o) {
    memset(o, 0, sizeof *o);
    o->val_fraction = 0.1;
    o->seq_len = 128;
    o->micro_batch = 16;
    o->grad_accum = 1;
    o->steps = 1000;
    o->lr = 2e-3;
    o->min_lr = 2e-4;
    o->warmup = 50;
    o->weight_decay = 0.1;
    o->grad_clip = 1.0;
    o->beta1 = 0.9;
    o->beta2 = 0.95;
    o->adam_eps = 1e-8;
    o->seed = 1337;
    o->threads = 0;
    o->out_dir = "runs/tiny";
    o->eval_every = 250;
    o->eval_batches = 20;
    o->save_every = 0;
    o->log_every = 1;
    o->recompute = NULL;
    o->moe_chunk_tokens = -1;
    o->ce_block_tokens = -1;
    o->ce_block_vocab = -1;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void fmt_hms(char *buf, size_t n, double s) {
    if (s < 0 || !isfinite(s)) s = 0;
    long t = (long)(s + 0.5);
    snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
}

fm_status fm_parse_recompute(const char *spec, int64_t L, bool *rc) {
    for (int64_t l = 0; l < L; l++) rc[l] = false;
    if (!spec || !strcmp(spec, "none") || !*spec) return FM_OK;
    if (!strcmp(spec, "full")) {
        for (int64_t l = 0; l < L; l++) rc[l] = true;
        return FM_OK;
    }
    const char *p = spec;
    while (*p) {
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || (*end && *end != ','))
            return fm_error(FM_ERR_ARG, "--recompute \"%s\": expected none, full, or comma-separated layer ids "
                            "(e.g. 0,2,5)", spec);
        if (v < 0 || v >= L)
            return fm_error(FM_ERR_ARG, "--recompute: layer id %lld is out of range; the model has layers 0..%lld",
                            v, (long long)L - 1);
        if (rc[v]) return fm_error(FM_ERR_ARG, "--recompute: layer %lld is listed twice", v);
        rc[v] = true;
        if (*end == ',' && !end[1]) return fm_error(FM_ERR_ARG, "--recompute \"%s\": trailing comma", spec);
        p = *end ? end + 1 : end;
    }
    return FM_OK;
}

/* ---- checkpoint glue ------------------------------------------------------------------------ */

static fm_status model_named(const fm_model *m, const float *base, const char *prefix, fm_named_tensor *out,
                             char (*names)[160]) {
    for (int i = 0; i < m->n_tensors; i++) {
        const fm_param *p = &m->table[i];
        snprintf(names[i], sizeof names[i], "%s%s", prefix, p->name);
        out[i].name = names[i];
        out[i].data = base ? base + p->offset : NULL;
        out[i].fetch = NULL;
        out[i].fetch_ctx = NULL;
        out[i].ndim = p->ndim;
        memset(out[i].shape, 0, sizeof out[i].shape);
        for (int d = 0; d < p->ndim; d++) out[i].shape[d] = p->shape[d];
    }
    return FM_OK;
}

/* Reads every tensor of the table from a safetensors file into base (+offset), with the name
 * prefix. Experts may be stored per expert (HF's classic names, what flatmoe writes) or fused
 * per layer as transformers 5 stores them: "<moe>.experts.gate_up_proj" [E, 2I, H] (rows
 * 0..I-1 of each expert are gate, I..2I-1 up) and "<moe>.experts.down_proj" [E, H, I].
 * Tensors in the file that the model does not have are an error (a different model), except
 * lm_head.weight for a tied model. */
static fm_status load_named(fm_model *m, const char *path, const char *prefix, float *base) {
    const fm_config *c = &m->cfg;
    const int64_t L = c->num_hidden_layers, E = c->num_experts, H = c->hidden_size, I = c->moe_intermediate_size;
    const char *moe = c->model_type == FM_MODEL_MIXTRAL ? "block_sparse_moe" : "mlp";
    fm_safetensors st;
    FM_TRY(fm_st_open(&st, path));
    fm_status s = FM_OK;
    char name[256];
    int consumed = 0;
    bool *fused = fm_malloc((size_t)(L > 0 ? L : 1));
    float *tmp = NULL;
    if (!fused) {
        fm_st_close(&st);
        return fm_error(FM_ERR_NOMEM, "%s: out of memory", path);
    }
    for (int64_t l = 0; l < L && s == FM_OK; l++) {
        snprintf(name, sizeof name, "%smodel.layers.%lld.%s.experts.gate_up_proj", prefix, (long long)l, moe);
        fused[l] = fm_st_find(&st, name) != NULL;
        if (!fused[l]) continue;
        const int64_t gu_shape[3] = {E, 2 * I, H}, d_shape[3] = {E, H, I};
        if (!tmp && !(tmp = fm_malloc(sizeof(float) * (size_t)(E * 2 * I * H)))) {
            s = fm_error(FM_ERR_NOMEM, "%s: out of memory reading fused experts", path);
            break;
        }
        s = fm_st_read_f32(&st, name, tmp, 3, gu_shape);
        const int64_t og = m->w.layers[l].w_gate - m->params, ou = m->w.layers[l].w_up - m->params,
                      od = m->w.layers[l].w_down - m->params;
        for (int64_t e = 0; e < E && s == FM_OK; e++) {
            memcpy(base + og + e * I * H, tmp + e * 2 * I * H, sizeof(float) * (size_t)(I * H));
            memcpy(base + ou + e * I * H, tmp + e * 2 * I * H + I * H, sizeof(float) * (size_t)(I * H));
        }
        snprintf(name, sizeof name, "%smodel.layers.%lld.%s.experts.down_proj", prefix, (long long)l, moe);
        if (s == FM_OK) s = fm_st_read_f32(&st, name, base + od, 3, d_shape);
        consumed += 2;
    }
    fm_free(tmp);
    for (int i = 0; i < m->n_tensors && s == FM_OK; i++) {
        const fm_param *p = &m->table[i];
        bool in_fused = false;
        for (int64_t l = 0; l < L && !in_fused; l++) {
            const int64_t lo = m->w.layers[l].w_gate - m->params, hi = m->w.layers[l].w_down - m->params + E * H * I;
            in_fused = fused[l] && p->offset >= lo && p->offset < hi;
        }
        if (in_fused) continue;
        snprintf(name, sizeof name, "%s%s", prefix, p->name);
        s = fm_st_read_f32(&st, name, base + p->offset, p->ndim, p->shape);
        consumed++;
    }
    int in_file = 0;
    const size_t plen = strlen(prefix);
    for (int i = 0; i < st.n_tensors; i++)
        if (!strncmp(st.tensors[i].name, prefix, plen) &&
            !(c->tie_word_embeddings && !strcmp(st.tensors[i].name + plen, "lm_head.weight")))
            in_file++;
    if (s == FM_OK && in_file != consumed) { /* find one tensor the model does not have, to name it */
        for (int i = 0; i < st.n_tensors && s == FM_OK; i++) {
            const char *n = st.tensors[i].name;
            if (strncmp(n, prefix, plen) || strstr(n, ".experts.gate_up_proj") || strstr(n, ".experts.down_proj")) continue;
            if (!fm_model_find_param(m, n + plen) && !(c->tie_word_embeddings && !strcmp(n + plen, "lm_head.weight")))
                s = fm_error(FM_ERR_FORMAT, "%s: tensor '%s' is not a parameter of this %s model (%d tensors "
                             "expected); was the file written for another config?", path, n, c->model_type_name,
                             m->n_tensors);
        }
        if (s == FM_OK)
            s = fm_error(FM_ERR_FORMAT, "%s: holds %d tensors where this model reads %d; was the file written for "
                         "another config?", path, in_file, consumed);
    }
    fm_st_close(&st);
    fm_free(fused);
    return s;
}

/* Loads a safetensors file's fp32 tensors (with the name prefix) into a backend buffer [n_params]
 * of dtype in table layout (bf16: rounded to nearest even): directly when the backend's memory is
 * host memory and dtype fp32, else through a host staging copy. */
static fm_status load_fp32_as(fm_model *m, const char *path, const char *prefix, void *dst, fm_dtype dtype) {
    if (m->be.ops->host_memory && dtype == FM_DTYPE_F32) return load_named(m, path, prefix, dst);
    float *stage = fm_malloc(sizeof(float) * (size_t)m->n_params);
    if (!stage) return fm_error(FM_ERR_NOMEM, "%s: cannot stage %lld values on the host", path, (long long)m->n_params);
    fm_status s = load_named(m, path, prefix, stage);
    if (s == FM_OK && dtype == FM_DTYPE_BF16) {
        uint16_t *h = (uint16_t *)stage; /* narrowing in increasing order never overtakes the reads */
        for (int64_t i = 0; i < m->n_params; i++) h[i] = fm_f32_to_bf16(stage[i]);
    }
    if (s == FM_OK) m->be.ops->copy(m->be.ctx, dst, stage, fm_dtype_size(dtype) * (size_t)m->n_params, FM_COPY_H2D);
    fm_free(stage);
    return s;
}

static fm_status load_fp32(fm_model *m, const char *path, const char *prefix, float *dst) {
    return load_fp32_as(m, path, prefix, dst, FM_DTYPE_F32);
}

/* Loads the weights into the fp32 master and refreshes the fm_act weights. */
static fm_status load_weights(fm_model *m, const char *path) {
    FM_TRY(load_fp32(m, path, "", m->master));
    if ((void *)m->master != (void *)m->params)
        m->be.ops->convert(m->be.ctx, m->params, FM_ACT_DTYPE, m->master, FM_DTYPE_F32, m->n_params);
    return FM_OK;
}

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

static int64_t json_i64(const cJSON *o, const char *key, int64_t dflt) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(it) ? (int64_t)it->valuedouble : dflt;
}

fm_status fm_load_for_inference(fm_model *m, const char *ckpt_dir, fm_backend be, int64_t B, int64_t T,
                                int64_t *trained_seq_len) {
    char path[4096];
    fm_config cfg;
    snprintf(path, sizeof path, "%s/%s", ckpt_dir, FM_CKPT_CONFIG_FILE);
    FM_TRY(fm_config_load(&cfg, path));
    int64_t tsl = 0;
    snprintf(path, sizeof path, "%s/%s", ckpt_dir, FM_CKPT_STATE_FILE);
    cJSON *state;
    if (read_json_file(path, &state) == FM_OK) { /* optional: a bare model folder has none */
        tsl = json_i64(state, "seq_len", 0);
        cJSON_Delete(state);
    }
    if (trained_seq_len) *trained_seq_len = tsl;
    if (T <= 0) T = tsl > 0 ? tsl : cfg.max_position_embeddings;
    FM_TRY(fm_model_create(m, &cfg, be, 0));
    fm_status s = fm_model_layout(m, B, T, NULL);
    if (s == FM_OK) {
        snprintf(path, sizeof path, "%s/%s", ckpt_dir, FM_CKPT_MODEL_FILE);
        s = load_weights(m, path);
    }
    if (s != FM_OK) fm_model_free(m);
    return s;
}

/* ---- evaluation ------------------------------------------------------------------------------ */

void fm_evaluate(fm_model *m, const fm_dataset *ds, int64_t max_batches, double *mean_loss, int64_t *n_tokens_out) {
    const int64_t B = m->B, T = m->T;
    const int64_t nwin = fm_dataset_eval_windows(ds, T);
    double sum = 0;
    int64_t count = 0, batches = 0;
    for (int64_t w = 0; w < nwin; w += B) {
        if (max_batches > 0 && batches >= max_batches) break;
        int64_t filled = 0;
        fm_dataset_eval_batch(ds, w, B, T, m->h_tokens, m->h_targets, &filled);
        for (int64_t i = filled * T; i < B * T; i++) {
            m->h_tokens[i] = 0;
            m->h_targets[i] = -100;
        }
        fm_loss l;
        fm_schedule_default_forward(m, true, &l);
        sum += l.ce * (double)l.n_valid;
        count += l.n_valid;
        batches++;
    }
    *mean_loss = count ? sum / (double)count : NAN;
    if (n_tokens_out) *n_tokens_out = count;
}

/* ---- state.json ------------------------------------------------------------------------------ */

typedef struct train_state {
    int64_t step, tokens_seen, opt_step;
    uint64_t data_rng;
    uint64_t seed;
    int64_t seq_len, micro_batch, grad_accum, steps;
    bool bf16_moments; /* "adam_moments": "bf16" (absent in older checkpoints: fp32) */
} train_state;

static char *state_to_json(const train_state *s) {
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
    cJSON_AddStringToObject(o, "adam_moments", s->bf16_moments ? "bf16" : "fp32");
    cJSON_AddStringToObject(o, "format", "flatmoe-state-1");
    char *txt = cJSON_Print(o);
    cJSON_Delete(o);
    size_t n = strlen(txt);
    char *out = fm_malloc(n + 2);
    if (out) { memcpy(out, txt, n); out[n] = '\n'; out[n + 1] = 0; }
    cJSON_free(txt);
    return out;
}

static fm_status state_from_json(const char *path, train_state *s) {
    cJSON *o;
    FM_TRY(read_json_file(path, &o));
    const cJSON *rng = cJSON_GetObjectItemCaseSensitive(o, "data_rng_state");
    const cJSON *seed = cJSON_GetObjectItemCaseSensitive(o, "seed");
    s->step = json_i64(o, "step", -1);
    s->opt_step = json_i64(o, "optimizer_step", -1);
    s->tokens_seen = json_i64(o, "tokens_seen", 0);
    s->seq_len = json_i64(o, "seq_len", 0);
    s->micro_batch = json_i64(o, "micro_batch", 0);
    s->grad_accum = json_i64(o, "grad_accum", 0);
    s->steps = json_i64(o, "steps", 0);
    const cJSON *mom = cJSON_GetObjectItemCaseSensitive(o, "adam_moments");
    s->bf16_moments = cJSON_IsString(mom) && strcmp(mom->valuestring, "bf16") == 0;
    fm_status st = FM_OK;
    if (s->step < 0 || s->opt_step < 0 || !cJSON_IsString(rng) || !cJSON_IsString(seed))
        st = fm_error(FM_ERR_FORMAT, "%s: expected fields step, optimizer_step, data_rng_state and seed", path);
    else {
        s->data_rng = strtoull(rng->valuestring, NULL, 16);
        s->seed = strtoull(seed->valuestring, NULL, 10);
    }
    cJSON_Delete(o);
    return st;
}

/* Keeps only the metrics lines of steps <= last_step (a resumed run rewrites what came after
 * its checkpoint). */
static fm_status truncate_metrics(const char *path, int64_t last_step) {
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

/* ---- the loop -------------------------------------------------------------------------------- */

typedef struct run {
    const fm_train_opts *o;
    fm_config cfg;
    char *config_json;
    fm_backend be;
    bool be_ok;
    fm_model m;
    bool model_ok;
    fm_adamw opt;
    fm_dataset train_all, train, val, val_own;
    fm_named_tensor *named;
    char (*names)[160];
    FILE *metrics;
    fm_plan plan;
    bool *rc;
    struct fetch_src *fetch; /* [4 * n_tensors]: save sources on a device backend */
    fm_arena results;        /* pinned: (G + 1) copies of the model's device results, read at the step's end */
    int64_t *n_valid;        /* [G] valid targets of each micro-batch (counted on the host) */
} run;

/* Measured high-water mark of every arena (painted at layout) next to its planned bound. */
/* dev_used, dev_total: the device's memory in use and its size (0: no device to report). */
static void report_memory(const run *r, size_t dev_used, size_t dev_total) {
    const fm_model *m = &r->m;
    printf("memory: %-22s %14s %14s %7s\n", "live set", "bound (B)", "high-water (B)", "used");
    for (int i = 0; i < FM_PLAN_SETS; i++) {
        if (i == FM_LIVE_COUNT) {
            printf("memory: %-22s %14zu %14s %7s\n", "attention tiles", r->plan.bytes[i], "(backend)", "");
            continue;
        }
        size_t hw = i == FM_LIVE_MODEL_STATE ? m->arena[i].high : fm_arena_touched(&m->arena[i]);
        printf("memory: %-22s %14zu %14zu %6.1f%%\n", fm_live_set_names[i], r->plan.bytes[i], hw,
               r->plan.bytes[i] ? 100.0 * (double)hw / (double)r->plan.bytes[i] : 0.0);
    }
    if (dev_total > 0)
        printf("memory: device in use %.1f MiB of %.1f MiB (plan %.1f MiB; the rest is the CUDA context and "
               "libraries)\n", dev_used / 1048576.0, dev_total / 1048576.0, r->plan.total / 1048576.0);
    fflush(stdout);
}

/* A tensor of the backend's fp32 buffers, fetched to the host when the writer reaches it. */
typedef struct fetch_src {
    const fm_backend *be;
    const void *src;
    int64_t numel;
    bool bf16;   /* src holds bf16: widened to fp32 */
} fetch_src;

static void fetch_from_backend(void *ctx, float *buf) {
    const fetch_src *f = ctx;
    if (!f->bf16) {
        f->be->ops->copy(f->be->ctx, buf, f->src, sizeof(float) * (size_t)f->numel, FM_COPY_D2H);
        return;
    }
    /* the bf16 values land in the upper half of buf and widen in increasing order: element i's
     * 4 bytes end at or before the first bf16 value not yet read */
    const size_t n = (size_t)f->numel;
    uint16_t *h = (uint16_t *)((char *)buf + 2 * n);
    f->be->ops->copy(f->be->ctx, h, f->src, 2 * n, FM_COPY_D2H);
    for (size_t i = 0; i < n; i++) buf[i] = fm_bf16_to_f32(h[i]);
}

/* Names the table's tensors of a [n_params] buffer of dtype as fp32 tensors (host memory and
 * fp32: data pointers; otherwise fetched one tensor at a time while writing, bf16 widened
 * exactly, so no host copy of the whole state is made). */
static void name_state(run *r, const void *base, fm_dtype dtype, const char *prefix, int slot) {
    fm_model *m = &r->m;
    const int n = m->n_tensors;
    const bool direct = m->be.ops->host_memory && dtype == FM_DTYPE_F32;
    model_named(m, direct ? base : NULL, prefix, r->named + slot * n, r->names + slot * n);
    if (direct) return;
    for (int i = 0; i < n; i++) {
        fetch_src *f = &r->fetch[slot * n + i];
        f->be = &m->be;
        f->src = (const char *)base + (size_t)m->table[i].offset * fm_dtype_size(dtype);
        f->numel = m->table[i].numel;
        f->bf16 = dtype == FM_DTYPE_BF16;
        r->named[slot * n + i].data = NULL;
        r->named[slot * n + i].fetch = fetch_from_backend;
        r->named[slot * n + i].fetch_ctx = f;
    }
}

static fm_status save_checkpoint(run *r, const train_state *ts) {
    fm_model *m = &r->m;
    const int n = m->n_tensors;
    /* fp32 master (as model.safetensors and master.*), m, v */
    name_state(r, m->master, FM_DTYPE_F32, "", 0);
    name_state(r, m->master, FM_DTYPE_F32, "master.", 1);
    name_state(r, r->opt.m, r->opt.moments_dtype, "exp_avg.", 2); /* bf16 moments: widened */
    name_state(r, r->opt.v, r->opt.moments_dtype, "exp_avg_sq.", 3);
    char *state = state_to_json(ts);
    fm_status s = state ? FM_OK : fm_error(FM_ERR_NOMEM, "out of memory writing state.json");
    char dir[4096];
    if (s == FM_OK)
        s = fm_ckpt_write(r->o->out_dir, ts->step, r->named, n, r->named + n, 3 * n, r->config_json, state, dir,
                          sizeof dir);
    fm_free(state);
    if (s == FM_OK && !r->o->quiet) printf("saved checkpoint %s\n", dir);
    return s;
}

static fm_status load_checkpoint(run *r, const char *dir, train_state *ts) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, FM_CKPT_STATE_FILE);
    FM_TRY(state_from_json(path, ts));
    snprintf(path, sizeof path, "%s/%s", dir, FM_CKPT_OPTIM_FILE);
    /* the fp32 master from the optimizer file (model.safetensors holds the same values) */
    FM_TRY(load_fp32(&r->m, path, "master.", r->m.master));
    if ((void *)r->m.master != (void *)r->m.params)
        r->m.be.ops->convert(r->m.be.ctx, r->m.params, FM_ACT_DTYPE, r->m.master, FM_DTYPE_F32, r->m.n_params);
    /* bf16 moments: narrowed to nearest even, exact for moments a bf16 run saved */
    FM_TRY(load_fp32_as(&r->m, path, "exp_avg.", r->opt.m, r->opt.moments_dtype));
    FM_TRY(load_fp32_as(&r->m, path, "exp_avg_sq.", r->opt.v, r->opt.moments_dtype));
    r->opt.step = ts->opt_step;
    return FM_OK;
}

static void run_free(run *r) {
    if (r->metrics) fclose(r->metrics);
    fm_arena_free(&r->results); /* before the backend whose memory it is */
    if (r->model_ok) fm_model_free(&r->m);
    if (r->be_ok) fm_backend_default_free(&r->be);
    fm_dataset_free(&r->val_own);
    fm_dataset_free(&r->train_all);
    fm_free(r->config_json);
    fm_free(r->named);
    fm_free(r->names);
    fm_free(r->rc);
    fm_free(r->fetch);
    fm_free(r->n_valid);
}

static fm_status train_impl(run *r) {
    const fm_train_opts *o = r->o;
    if (o->n_data < 1) return fm_error(FM_ERR_ARG, "--data: give at least one text file or llm.c token shard");
    if (!o->out_dir || !*o->out_dir) return fm_error(FM_ERR_ARG, "--out: give a run folder");
    if (o->seq_len < 1 || o->micro_batch < 1 || o->grad_accum < 1 || o->steps < 1)
        return fm_error(FM_ERR_ARG, "--seq-len, --micro-batch, --grad-accum and --steps must be >= 1");
    if (!(o->lr > 0) || !isfinite(o->lr) || !(o->min_lr >= 0) || !(o->min_lr <= o->lr))
        return fm_error(FM_ERR_ARG, "--lr must be finite and > 0, and --min-lr in [0, lr] (found lr %g, min-lr %g)", o->lr,
                        o->min_lr);
    if (o->warmup < 0 || !(o->weight_decay >= 0) || !isfinite(o->weight_decay) || !(o->grad_clip >= 0) ||
        !isfinite(o->grad_clip))
        return fm_error(FM_ERR_ARG, "--warmup, --weight-decay and --grad-clip must be finite and >= 0 (found %lld, %g, %g)",
                        (long long)o->warmup, o->weight_decay, o->grad_clip);
    if (!(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1) || !(o->adam_eps > 0))
        return fm_error(FM_ERR_ARG, "--beta1 and --beta2 must be in [0, 1) (found %g, %g)", o->beta1, o->beta2);
    if (o->eval_every < 0 || o->eval_batches < 0 || o->save_every < 0 || o->log_every < 0 || o->exit_after < 0)
        return fm_error(FM_ERR_ARG, "--eval-every, --eval-batches, --save-every, --log-every and --exit-after must be >= 0");
    if (o->max_position_embeddings < 0 || o->max_position_embeddings > (1LL << 30))
        return fm_error(FM_ERR_ARG, "--max-position-embeddings must be in [1, 2^30] (0 keeps the config's), found %lld",
                        (long long)o->max_position_embeddings);
    if (o->att_tile_q < 0 || o->att_tile_q > 4096 || o->att_tile_kv < 0 || o->att_tile_kv > 4096)
        return fm_error(FM_ERR_ARG, "--attention-tile-q/-kv must be in [1, 4096] (0 = 64), found %lld x %lld",
                        (long long)o->att_tile_q, (long long)o->att_tile_kv);
    if (o->no_checkpoint && o->exit_after > 0)
        return fm_error(FM_ERR_ARG, "--exit-after stops with a checkpoint to resume from, but --no-checkpoint writes "
                        "none; drop one of them");
    if (!(o->val_fraction > 0 && o->val_fraction < 1) && o->n_val_data == 0)
        return fm_error(FM_ERR_ARG, "--val-fraction must be in (0, 1), found %g", o->val_fraction);

    /* Resume point. */
    char ckpt[4096] = "";
    int64_t ckpt_step = -1;
    if (o->resume) {
        if (fm_ckpt_find_latest(o->out_dir, ckpt, sizeof ckpt, &ckpt_step) != FM_OK) {
            ckpt[0] = 0;
            ckpt_step = -1;
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
        if (!ckpt[0] && !o->quiet) printf("--resume: no checkpoint in %s yet; starting from step 0\n", o->out_dir);
    } else {
        char probe[4096];
        if (fm_ckpt_find_latest(o->out_dir, probe, sizeof probe, NULL) == FM_OK)
            return fm_error(FM_ERR_ARG, "--out %s already holds checkpoints (latest %s); pass --resume to continue "
                            "that run, or choose a new --out folder", o->out_dir, probe);
    }

    /* Config: from --config, checked against the checkpoint's when resuming. */
    if (ckpt[0]) {
        char p[4200];
        snprintf(p, sizeof p, "%s/%s", ckpt, FM_CKPT_CONFIG_FILE);
        FM_TRY(fm_config_load(&r->cfg, p));
        if (o->config_path) {
            fm_config given;
            FM_TRY(fm_config_load(&given, o->config_path));
            if (o->max_position_embeddings > 0) given.max_position_embeddings = o->max_position_embeddings;
            char *a = fm_config_to_json(&given), *b = fm_config_to_json(&r->cfg);
            bool same = a && b && !strcmp(a, b);
            fm_free(a);
            fm_free(b);
            if (!same) {
                if (given.max_position_embeddings != r->cfg.max_position_embeddings) {
                    bool only = true; /* is it the only difference? */
                    fm_config g2 = given;
                    g2.max_position_embeddings = r->cfg.max_position_embeddings;
                    char *x = fm_config_to_json(&g2), *y = fm_config_to_json(&r->cfg);
                    only = x && y && !strcmp(x, y);
                    fm_free(x);
                    fm_free(y);
                    if (only)
                        return fm_error(FM_ERR_CONFIG, "--config %s has max_position_embeddings %lld but the checkpoint "
                                        "%s was trained with %lld; pass --max-position-embeddings %lld (or drop "
                                        "--config)", o->config_path, (long long)given.max_position_embeddings, p,
                                        (long long)r->cfg.max_position_embeddings,
                                        (long long)r->cfg.max_position_embeddings);
                }
                const char *field = given.vocab_size != r->cfg.vocab_size ? "vocab_size"
                                  : given.hidden_size != r->cfg.hidden_size ? "hidden_size"
                                  : given.num_hidden_layers != r->cfg.num_hidden_layers ? "num_hidden_layers"
                                  : given.num_experts != r->cfg.num_experts ? "the expert count"
                                  : given.moe_intermediate_size != r->cfg.moe_intermediate_size ? "the expert width"
                                  : given.model_type != r->cfg.model_type ? "model_type" : "a field";
                return fm_error(FM_ERR_CONFIG, "--config %s differs from the checkpoint's %s (%s differs); resume with "
                                "the same model config (or drop --config to use the checkpoint's)", o->config_path, p,
                                field);
            }
        }
    } else {
        if (!o->config_path) return fm_error(FM_ERR_ARG, "--config: required (a Hugging Face config.json)");
        FM_TRY(fm_config_load(&r->cfg, o->config_path));
    }
    if (o->max_position_embeddings > 0) r->cfg.max_position_embeddings = o->max_position_embeddings;
    r->config_json = fm_config_to_json(&r->cfg);
    const fm_config *c = &r->cfg;
    if (o->seq_len > c->max_position_embeddings)
        return fm_error(FM_ERR_ARG, "--seq-len %lld exceeds max_position_embeddings (%lld) of the model config; "
                        "use --seq-len <= %lld, or raise the limit with --max-position-embeddings", (long long)o->seq_len,
                        (long long)c->max_position_embeddings, (long long)c->max_position_embeddings);

    FM_TRY(fm_plan_check_shape(c, o->micro_batch, o->seq_len));

    /* Data. */
    FM_TRY(fm_dataset_load(&r->train_all, o->data, o->n_data, c->vocab_size));
    if (o->n_val_data > 0) {
        FM_TRY(fm_dataset_load(&r->val_own, o->val_data, o->n_val_data, c->vocab_size));
        r->train = r->train_all;
        r->train.owns = false;
        r->val = r->val_own;
        r->val.owns = false;
    } else {
        FM_TRY(fm_dataset_split(&r->train_all, o->val_fraction, &r->train, &r->val));
    }
    FM_TRY(fm_dataset_check_windows(&r->train, o->seq_len, "training data"));
    FM_TRY(fm_dataset_check_windows(&r->val, o->seq_len, "validation data"));

    /* Plan: every live set's bound, from the config and flags alone, before any allocation. */
    const int64_t L = c->num_hidden_layers;
    bool *rc = r->rc = fm_malloc((size_t)L);
    if (!rc) return fm_error(FM_ERR_NOMEM, "out of memory for the recompute table (%lld layers)", (long long)L);
    FM_TRY(fm_parse_recompute(o->recompute, L, rc));
    fm_plan_req req = {*c, o->micro_batch, o->seq_len, o->grad_accum, rc,
                       o->moe_chunk_tokens > 0 ? o->moe_chunk_tokens : 0,
                       o->ce_block_tokens > 0 ? o->ce_block_tokens : 0,
                       o->ce_block_vocab > 0 ? o->ce_block_vocab : 0, o->threads, o->att_tile_q, o->att_tile_kv,
                       FM_PLAN_TARGET_BUILD, o->gpu_workspace, o->bf16_moments};
    fm_plan plan;
    /* The budget: --mem-budget, else (CUDA) the device's free memory less a reserve. */
    size_t budget = o->mem_budget, dev_total = 0;
    const char *budget_flag = "--mem-budget";
    if (budget == 0) {
        FM_TRY(fm_backend_default_memory_budget(&budget, &dev_total));
        budget_flag = "the GPU's free memory less 1.5 GiB (no --mem-budget given)";
    }
    if (!o->recompute && o->moe_chunk_tokens < 0 && o->ce_block_tokens < 0 && o->ce_block_vocab < 0 && budget > 0) {
        FM_TRY(fm_plan_choose(&req, budget, rc, &plan));
    } else {
        fm_plan_compute(&req, &plan);
        FM_TRY(fm_plan_check(&plan, budget, budget_flag));
    }
    if (!o->quiet && o->mem_budget == 0 && budget > 0)
        printf("memory budget: %.1f MiB (the GPU's %.1f MiB, its free memory less 1.5 GiB; --mem-budget sets it)\n",
               budget / 1048576.0, dev_total / 1048576.0);
    r->plan = plan;

    /* Backend, model, optimizer: allocated from the plan. */
    FM_TRY(fm_backend_default_init_tiles(&r->be, o->threads, c->head_dim, o->att_tile_q, o->att_tile_kv,
                                         plan.gpu_workspace));
    r->be_ok = true;
    FM_TRY(fm_model_create(&r->m, c, r->be, fm_adamw_state_bytes(fm_config_num_params(c), o->bf16_moments)));
    r->model_ok = true;
    fm_model *m = &r->m;
    const fm_layout_opts lo = {req.recompute, req.moe_chunk_tokens, req.ce_block_tokens, req.ce_block_vocab};
    FM_TRY(fm_model_layout(m, o->micro_batch, o->seq_len, &lo));
    for (int i = 0; i < FM_LIVE_COUNT; i++)
        if (m->arena[i].capacity != fm_arena_round(plan.bytes[i])) {
            char msg[200];
            snprintf(msg, sizeof msg, "the %s arena holds %zu bytes but the plan says %zu", fm_live_set_names[i],
                     m->arena[i].capacity, plan.bytes[i]);
            fm_abort(__FILE__, __LINE__, msg);
        }
    fm_adamw_init(&r->opt, m, o->beta1, o->beta2, o->adam_eps, o->weight_decay, o->bf16_moments);
    const int64_t n_res = fm_model_results_count(c);
    FM_TRY(fm_arena_init_backend_kind(&r->results, "step results", (size_t)(o->grad_accum + 1) * (size_t)n_res * 8,
                                      &r->be, FM_BUFFER_PINNED));
    double *res = fm_arena_alloc(&r->results, (size_t)(o->grad_accum + 1) * (size_t)n_res * 8);
    r->n_valid = fm_malloc(sizeof(int64_t) * (size_t)o->grad_accum);
    if (!r->n_valid) return fm_error(FM_ERR_NOMEM, "out of memory for the step's counters");
    fm_schedule sched;
    fm_schedule_init(&sched, m);
    r->named = fm_malloc(sizeof(fm_named_tensor) * (size_t)(4 * m->n_tensors));
    r->names = fm_malloc(sizeof(*r->names) * (size_t)(4 * m->n_tensors));
    r->fetch = fm_malloc(sizeof(*r->fetch) * (size_t)(4 * m->n_tensors));
    if (!r->named || !r->names || !r->fetch) return fm_error(FM_ERR_NOMEM, "out of memory for the tensor name table");

    train_state ts = {0};
    fm_rng data_rng;
    if (ckpt[0]) {
        FM_TRY(load_checkpoint(r, ckpt, &ts));
        data_rng.state = ts.data_rng;
        if (ts.seq_len != o->seq_len || ts.micro_batch != o->micro_batch || ts.grad_accum != o->grad_accum)
            fprintf(stderr, "warning: resuming with --seq-len/--micro-batch/--grad-accum %lld/%lld/%lld, but the "
                    "checkpoint was trained with %lld/%lld/%lld: the run will not match an uninterrupted one\n",
                    (long long)o->seq_len, (long long)o->micro_batch, (long long)o->grad_accum,
                    (long long)ts.seq_len, (long long)ts.micro_batch, (long long)ts.grad_accum);
        if (ts.bf16_moments != o->bf16_moments)
            fprintf(stderr, "warning: resuming with %s Adam moments, but the checkpoint was trained with %s: the run "
                    "will not match an uninterrupted one (%s to continue it as it was)\n",
                    o->bf16_moments ? "bf16" : "fp32", ts.bf16_moments ? "--bf16-moments" : "fp32 moments",
                    ts.bf16_moments ? "pass --bf16-moments" : "drop --bf16-moments");
        if (!o->quiet) printf("resumed from %s (step %lld)\n", ckpt, (long long)ts.step);
    } else {
        FM_TRY(fm_model_init_weights(m, o->seed));
        fm_rng_seed(&data_rng, o->seed ^ 0xDA7A5EEDull);
        ts.seed = o->seed;
    }
    ts.seq_len = o->seq_len;
    ts.micro_batch = o->micro_batch;
    ts.bf16_moments = o->bf16_moments;
    ts.grad_accum = o->grad_accum;
    ts.steps = o->steps;

    /* Run folder and metrics. */
    FM_TRY(fm_mkdirs(o->out_dir));
    char mpath[4200];
    snprintf(mpath, sizeof mpath, "%s/metrics.jsonl", o->out_dir);
    FM_TRY(truncate_metrics(mpath, ckpt[0] ? ts.step : -1));
    r->metrics = fopen(mpath, "a");
    if (!r->metrics) return fm_error(FM_ERR_IO, "%s: cannot open for appending: %s", mpath, strerror(errno));

    const int64_t tokens_per_step = o->micro_batch * o->seq_len * o->grad_accum;
    if (!o->quiet) {
        printf("model %s: %lld parameters (%lld active per token), %lld layers, %lld experts top-%lld\n",
               c->model_type_name, (long long)m->n_params, (long long)fm_config_num_active_params(c),
               (long long)c->num_hidden_layers, (long long)c->num_experts, (long long)c->num_experts_per_tok);
        printf("data: train %lld tokens, validation %lld tokens; %lld tokens per step (%lld x %lld x %lld)\n",
               (long long)r->train.n_tokens, (long long)r->val.n_tokens, (long long)tokens_per_step,
               (long long)o->micro_batch, (long long)o->seq_len, (long long)o->grad_accum);
        printf("plan: %.1f MiB =", plan.total / 1048576.0);
        for (int i = 0; i < FM_PLAN_SETS; i++)
            printf("%s %s %.1f", i ? "," : "", i < FM_LIVE_COUNT ? fm_live_set_names[i] : "attention tiles",
                   plan.bytes[i] / 1048576.0);
        printf("; recompute %lld of %lld layers, MoE %s", (long long)plan.n_recomputed, (long long)L,
               req.moe_chunk_tokens > 0 ? "chunked" : "unchunked");
        if (req.moe_chunk_tokens > 0) printf(" (%lld chunks of <= %lld tokens)", (long long)plan.moe_K, (long long)plan.moe_c_eff);
        printf(", vocabulary %s", lo.ce_block_tokens > 0 || lo.ce_block_vocab > 0 ? "linear cross-entropy" : "plain logits");
        printf(", AdamW moments %s\n", o->bf16_moments ? "bf16" : "fp32");
        printf("flops per token: model %.4e, hardware %.4e (with the recomputed forwards)\n", plan.flops_model_token,
               plan.flops_hw_token);
        fflush(stdout);
    }

    double phase_discard[FM_PHASE_COUNT];
    (void)m->be.ops->prof_collect(m->be.ctx, phase_discard); /* the profile starts with step 1 */
    const double t0 = now_s();
    const int64_t first = ts.step + 1;
    int64_t ran = 0;
    uint64_t syncs0 = m->be.ops->host_sync_count(m->be.ctx);
    for (int64_t step = first; step <= o->steps; step++) {
        const double ts0 = now_s();
        fm_phase_mark(&m->be, FM_PHASE_OPTIMIZER);
        m->be.ops->mem_set(m->be.ctx, m->grads, 0, sizeof(fm_act) * (size_t)m->n_params);
        double ce = 0, aux = 0, z = 0;
        for (int64_t g = 0; g < o->grad_accum; g++) {
            fm_dataset_sample_batch(&r->train, &data_rng, o->micro_batch, o->seq_len, m->h_tokens, m->h_targets);
            FM_TRY(fm_schedule_train_step(&sched, m, 1.0f / (float)o->grad_accum, NULL));
            r->n_valid[g] = m->n_valid;
            /* the micro-batch's losses to pinned memory, read at the step's one sync point */
            m->be.ops->copy_async(m->be.ctx, res + g * n_res, m->results, (size_t)n_res * 8, FM_COPY_D2H,
                                  FM_STREAM_COMPUTE);
        }
        fm_phase_mark(&m->be, FM_PHASE_OPTIMIZER);
        fm_grad_sumsq(m, m->results + FM_RESULT_SUMSQ);
        double *gres = res + o->grad_accum * n_res;
        m->be.ops->copy_async(m->be.ctx, gres, m->results, (size_t)n_res * 8, FM_COPY_D2H, FM_STREAM_COMPUTE);
        m->be.ops->stream_sync(m->be.ctx, FM_STREAM_COMPUTE); /* sync point "step end": losses and grad norm */
        FM_TRY(m->be.ops->status(m->be.ctx));
        for (int64_t g = 0; g < o->grad_accum; g++) {
            fm_loss l;
            fm_model_loss_from_results(m, res + g * n_res, r->n_valid[g], &l);
            if (!isfinite(l.ce) || !isfinite(l.aux) || !isfinite(l.z))
                return fm_error(FM_ERR_NUMERIC, "step %lld: the loss is not finite (cross-entropy %g, aux %g, z %g); "
                                "training stopped and no checkpoint was written for this step (the last good "
                                "one in %s stays); lower --lr or raise --warmup", (long long)step, l.ce, l.aux, l.z,
                                o->out_dir);
            ce += l.ce / (double)o->grad_accum;
            aux += l.aux / (double)o->grad_accum;
            z += l.z / (double)o->grad_accum;
        }
        const double gnorm = sqrt(gres[FM_RESULT_SUMSQ]);
        if (!isfinite(gnorm))
            return fm_error(FM_ERR_NUMERIC, "step %lld: the gradient norm is not finite (%g); training stopped and no "
                            "checkpoint was written for this step (the last good one in %s stays); lower --lr",
                            (long long)step, gnorm, o->out_dir);
        const float clip = (o->grad_clip > 0 && gnorm > o->grad_clip) ? (float)(o->grad_clip / gnorm) : 1.0f;
        const double lr = fm_lr_at(step, o->steps, o->warmup, o->lr, o->min_lr);
        fm_adamw_step(&r->opt, m, lr, clip);
        m->be.ops->sync(m->be.ctx); /* the step's time includes its update */
        double phase_ms[FM_PHASE_COUNT];
        const bool profiled = m->be.ops->prof_collect(m->be.ctx, phase_ms);
        fm_phase_mark(&m->be, FM_PHASE_OTHER);
        const uint64_t syncs1 = m->be.ops->host_sync_count(m->be.ctx), step_syncs = syncs1 - syncs0;
        ts.step = step;
        ts.opt_step = r->opt.step;
        ts.tokens_seen += tokens_per_step;
        ts.data_rng = data_rng.state;
        ran++;

        const double t1 = now_s();
        const double step_s = t1 - ts0, elapsed = t1 - t0;
        const double tok_s = (double)tokens_per_step / step_s;
        const double eta = elapsed / (double)ran * (double)(o->steps - step);
        double val = NAN;
        const bool last = step == o->steps || (o->exit_after > 0 && ran == o->exit_after);
        if ((o->eval_every > 0 && step % o->eval_every == 0) || last) fm_evaluate(m, &r->val, o->eval_batches, &val, NULL);
        if (!o->quiet && (step % (o->log_every > 0 ? o->log_every : 1) == 0 || last || !isnan(val))) {
            char el[32], et[32];
            fmt_hms(el, sizeof el, elapsed);
            fmt_hms(et, sizeof et, eta);
            printf("step %6lld/%lld | loss %.4f | aux %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | %s elapsed | ETA %s",
                   (long long)step, (long long)o->steps, ce, aux, lr, gnorm, tok_s, el, et);
            if (!isnan(val)) printf(" | val loss %.4f", val);
            printf("\n");
            if (profiled) {
                double tot = 0;
                for (int i = 0; i < FM_PHASE_COUNT; i++) tot += phase_ms[i];
                printf("profile step %lld: %.1f ms =", (long long)step, tot);
                for (int i = 0; i < FM_PHASE_COUNT; i++)
                    printf("%s %s %.1f (%.0f%%)", i ? "," : "", fm_phase_name(i), phase_ms[i],
                           tot > 0 ? 100.0 * phase_ms[i] / tot : 0.0);
                printf("; host syncs %llu\n", (unsigned long long)step_syncs);
            }
            fflush(stdout);
        }
        fprintf(r->metrics, "{\"step\":%lld,\"loss\":%.17g,\"aux_loss\":%.17g,\"z_loss\":%.17g,\"lr\":%.17g,"
                "\"grad_norm\":%.17g,\"tokens\":%lld,\"tokens_per_s\":%.1f,\"step_s\":%.6f,\"elapsed_s\":%.3f",
                (long long)step, ce, aux, z, lr, gnorm, (long long)ts.tokens_seen, tok_s, step_s, elapsed);
        if (!isnan(val)) fprintf(r->metrics, ",\"val_loss\":%.17g", val);
        fprintf(r->metrics, ",\"host_syncs\":%llu", (unsigned long long)step_syncs);
        if (profiled) {
            fprintf(r->metrics, ",\"phase_ms\":{");
            for (int i = 0; i < FM_PHASE_COUNT; i++)
                fprintf(r->metrics, "%s\"%s\":%.3f", i ? "," : "", fm_phase_name(i), phase_ms[i]);
            fprintf(r->metrics, "}");
        }
        if (o->report_memory && (ran == 1 || last)) {
            fprintf(r->metrics, ",\"memory\":{");
            for (int i = 0; i < FM_LIVE_COUNT; i++)
                fprintf(r->metrics, "%s\"%s\":{\"bound\":%zu,\"high_water\":%zu}", i ? "," : "", fm_live_set_names[i],
                        r->plan.bytes[i], i == FM_LIVE_MODEL_STATE ? m->arena[i].high : fm_arena_touched(&m->arena[i]));
            fprintf(r->metrics, "}");
            size_t dfree = 0, dtotal = 0;
            if (fm_backend_default_device_memory(&dfree, &dtotal) != FM_OK) dfree = dtotal = 0;
            if (dtotal > 0)
                fprintf(r->metrics, ",\"device_used_bytes\":%zu,\"device_total_bytes\":%zu", dtotal - dfree, dtotal);
            if (!o->quiet) report_memory(r, dtotal - dfree, dtotal);
            double discard[FM_PHASE_COUNT]; /* the report's read-back is not the next step's time */
            (void)m->be.ops->prof_collect(m->be.ctx, discard);
        }
        fprintf(r->metrics, "}\n");
        fflush(r->metrics);

        if (!o->no_checkpoint && ((o->save_every > 0 && step % o->save_every == 0) || last)) {
            /* An update can overflow the weights while the loss and gradients it came from were
             * finite: never save such weights as the last good checkpoint. */
            m->be.ops->sumsq(m->be.ctx, m->results + FM_RESULT_SUMSQ, m->params, m->n_params, false);
            double wsq;
            m->be.ops->stream_sync(m->be.ctx, FM_STREAM_COMPUTE); /* sync point "checkpoint" */
            m->be.ops->copy(m->be.ctx, &wsq, m->results + FM_RESULT_SUMSQ, sizeof wsq, FM_COPY_D2H);
            if (!isfinite(wsq))
                return fm_error(FM_ERR_NUMERIC, "step %lld: the weights are no longer finite after the optimizer update "
                                "(sum of squares %g); no checkpoint was written for this step (the last good one in %s "
                                "stays); lower --lr or raise --warmup", (long long)step, wsq, o->out_dir);
            FM_TRY(save_checkpoint(r, &ts));
        }
        if (o->exit_after > 0 && ran == o->exit_after) break;
        syncs0 = m->be.ops->host_sync_count(m->be.ctx); /* evaluation, reports and saving are not the step's */
    }
    return FM_OK;
}

fm_status fm_train(const fm_train_opts *o) {
    fm_train_opts oo = *o;
    if (oo.resume && oo.steps == 0) { /* --steps not given: the run's own total, from its latest checkpoint */
        char ck[4096], p[4200];
        train_state ts = {0};
        oo.steps = 1000;
        if (fm_ckpt_find_latest(oo.out_dir, ck, sizeof ck, NULL) == FM_OK) {
            snprintf(p, sizeof p, "%s/%s", ck, FM_CKPT_STATE_FILE);
            if (state_from_json(p, &ts) == FM_OK && ts.steps > 0) oo.steps = ts.steps;
        }
        if (!oo.quiet) printf("--resume: --steps %lld (the run's total; --steps sets another)\n", (long long)oo.steps);
    }
    o = &oo;
    run r;
    memset(&r, 0, sizeof r);
    r.o = o;
    fm_status s = train_impl(&r);
    run_free(&r);
    return s;
}
