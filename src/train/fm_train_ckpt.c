/* Checkpoint glue of the trainer: the model's table for the Hugging Face mapping, state.json,
 * metrics.jsonl on resume, saving and loading a run's checkpoint, and loading a checkpoint's
 * weights for inference. The tensors themselves are read and named by io/fm_hf_weights. */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../io/fm_checkpoint.h"
#include "fm_train_internal.h"

/* ---- the model's table for the Hugging Face mapping ----------------------------------------- */

fm_status fm_train_hf_init(fm_train_hf *h, const fm_model *m) {
    const fm_config *c = &m->cfg;
    const int64_t L = c->num_hidden_layers;
    memset(h, 0, sizeof *h);
    h->params = fm_malloc(sizeof(fm_hf_param) * (size_t)(m->n_tensors > 0 ? m->n_tensors : 1));
    h->experts = fm_malloc(sizeof(fm_hf_experts) * (size_t)(L > 0 ? L : 1));
    if (!h->params || !h->experts) {
        fm_train_hf_free(h);
        return fm_error(FM_ERR_NOMEM, "out of memory for the tensor table (%d tensors)", m->n_tensors);
    }
    for (int i = 0; i < m->n_tensors; i++) {
        const fm_param *p = &m->table[i];
        h->params[i] = (fm_hf_param){p->name, p->ndim, {p->shape[0], p->shape[1]}, p->offset};
    }
    for (int64_t l = 0; l < L; l++) { /* a table-only model without a layout (--ep's full table) has none */
        int64_t g = 0, u = 0, d = 0;
        if (m->offsets) fm_model_layer_expert_offsets(m, l, &g, &u, &d);
        h->experts[l] = (fm_hf_experts){g, u, d};
    }
    h->t = (fm_hf_table){h->params, m->n_tensors, L, m->E_loc > 0 ? m->E_loc : c->num_experts, c->hidden_size,
                         c->moe_intermediate_size,
                         c->model_type == FM_MODEL_MIXTRAL ? "block_sparse_moe" : "mlp", h->experts,
                         c->tie_word_embeddings, c->model_type_name};
    return FM_OK;
}

void fm_train_hf_free(fm_train_hf *h) {
    fm_free(h->params);
    fm_free(h->experts);
    memset(h, 0, sizeof *h);
}

/* ---- loading tensors into backend buffers --------------------------------------------------- */

/* fm_hf_read, except that under expert parallelism (m->ep > 1: the table holds this rank's
 * experts) the other ranks' experts in the file are skipped, not an error. */
static fm_status hf_read(const fm_model *m, const fm_hf_table *t, const char *path, const char *prefix, float *base) {
    if (m->ep <= 1) return fm_hf_read(t, path, prefix, base);
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
    float *stage = fm_malloc(sizeof(float) * (size_t)m->n_params);
    if (!stage) return fm_error(FM_ERR_NOMEM, "%s: cannot stage %lld values on the host", path, (long long)m->n_params);
    fm_status s = hf_read(m, t, path, prefix, stage);
    if (s == FM_OK && dtype == FM_DTYPE_BF16) {
        uint16_t *h = (uint16_t *)stage; /* narrowing in increasing order never overtakes the reads */
        for (int64_t i = 0; i < m->n_params; i++) h[i] = fm_f32_to_bf16(stage[i]);
    }
    if (s == FM_OK && host) memcpy(dst, stage, fm_dtype_size(dtype) * (size_t)m->n_params);
    else if (s == FM_OK) m->be.ops->copy(m->be.ctx, dst, stage, fm_dtype_size(dtype) * (size_t)m->n_params, FM_COPY_H2D);
    fm_free(stage);
    return s;
}

static fm_status load_fp32_as(fm_model *m, const fm_hf_table *t, const char *path, const char *prefix, void *dst,
                              fm_dtype dtype) {
    return load_fp32_as_ex(m, t, path, prefix, dst, dtype, false);
}

/* Loads the weights (with the name prefix) into the fp32 master and refreshes the fm_act weights. */
static fm_status load_master(fm_model *m, const fm_hf_table *t, const char *path, const char *prefix) {
    FM_TRY(load_fp32_as(m, t, path, prefix, m->master, FM_DTYPE_F32));
    if ((void *)m->master != (void *)m->params)
        m->be.ops->convert(m->be.ctx, m->params, FM_ACT_DTYPE, m->master, FM_DTYPE_F32, m->n_params);
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

static int64_t json_i64(const cJSON *o, const char *key, int64_t dflt) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(it) ? (int64_t)it->valuedouble : dflt;
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
    /* the sampling cursor (fm_dataset_sample_batch): the RNG state is all of it; rank, world and
     * the training tokens say what it was drawn over */
    cJSON *cur = cJSON_AddObjectToObject(o, "data_cursor");
    snprintf(hex, sizeof hex, "%016" PRIx64, s->data_rng);
    cJSON_AddStringToObject(cur, "rng_state", hex);
    cJSON_AddNumberToObject(cur, "rank", r->train.rank);
    cJSON_AddNumberToObject(cur, "world", r->train.world);
    cJSON_AddNumberToObject(cur, "train_tokens", (double)r->train.n_tokens);
    cJSON_AddNumberToObject(o, "data_parallel", (double)(s->dp > 0 ? s->dp : 1));
    cJSON_AddStringToObject(o, "format", "flatmoe-state-1");
    char *txt = cJSON_Print(o);
    cJSON_Delete(o);
    size_t n = strlen(txt);
    char *out = fm_malloc(n + 2);
    if (out) { memcpy(out, txt, n); out[n] = '\n'; out[n + 1] = 0; }
    cJSON_free(txt);
    return out;
}

fm_status fm_train_state_read(const char *path, train_state *s) {
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
    s->threads = json_i64(o, "threads", 0);
    s->dp = json_i64(o, "data_parallel", 1);
    const cJSON *sch = cJSON_GetObjectItemCaseSensitive(o, "schedule");
    const cJSON *lr = cJSON_GetObjectItemCaseSensitive(sch, "lr"), *mlr = cJSON_GetObjectItemCaseSensitive(sch, "min_lr");
    s->lr = cJSON_IsNumber(lr) ? lr->valuedouble : NAN;
    s->min_lr = cJSON_IsNumber(mlr) ? mlr->valuedouble : NAN;
    s->warmup = cJSON_IsObject(sch) ? json_i64(sch, "warmup", -1) : -1;
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

/* A tensor of the backend's fp32 buffers, fetched to the host when the writer reaches it. */
typedef struct fm_fetch_src {
    const fm_backend *be;
    const void *src;
    int64_t numel;
    bool bf16;   /* src holds bf16: widened to fp32 */
    bool host;   /* src is host memory (the streamed optimizer's pinned state) */
} fm_fetch_src;

static void fetch_from_backend(void *ctx, float *buf) {
    const fm_fetch_src *f = ctx;
    if (f->host && !f->bf16) {
        memcpy(buf, f->src, sizeof(float) * (size_t)f->numel);
        return;
    }
    if (!f->bf16) {
        f->be->ops->copy(f->be->ctx, buf, f->src, sizeof(float) * (size_t)f->numel, FM_COPY_D2H);
        return;
    }
    /* the bf16 values land in the upper half of buf and widen in increasing order: element i's
     * 4 bytes end at or before the first bf16 value not yet read */
    const size_t n = (size_t)f->numel;
    uint16_t *h = (uint16_t *)((char *)buf + 2 * n);
    if (f->host) memcpy(h, f->src, 2 * n);
    else f->be->ops->copy(f->be->ctx, h, f->src, 2 * n, FM_COPY_D2H);
    for (size_t i = 0; i < n; i++) buf[i] = fm_bf16_to_f32(h[i]);
}

/* Names the table's tensors of a [n_params] buffer of dtype as fp32 tensors (host memory and
 * fp32: data pointers; otherwise fetched one tensor at a time while writing, bf16 widened
 * exactly, so no host copy of the whole state is made). */
static fm_status name_state(run *r, const fm_hf_table *t, const void *base, fm_dtype dtype, bool host,
                            const char *prefix, int slot) {
    fm_model *m = &r->m;
    const int n = t->n_params;
    const bool direct = (host || m->be.ops->host_memory) && dtype == FM_DTYPE_F32;
    FM_TRY(fm_hf_name_tensors(t, direct ? base : NULL, prefix, r->named + slot * n, r->names + slot * n));
    if (direct) return FM_OK;
    FM_ASSERT(t == &r->hf.t); /* fetched from the backend: this rank's table (the gathered full one is host fp32) */
    for (int i = 0; i < n; i++) {
        fm_fetch_src *f = &r->fetch[slot * n + i];
        f->be = &m->be;
        f->src = (const char *)base + (size_t)m->table[i].offset * fm_dtype_size(dtype);
        f->numel = m->table[i].numel;
        f->bf16 = dtype == FM_DTYPE_BF16;
        f->host = host;
        r->named[slot * n + i].data = NULL;
        r->named[slot * n + i].fetch = fetch_from_backend;
        r->named[slot * n + i].fetch_ctx = f;
    }
    return FM_OK;
}

/* The optimizer's own fp32 master among its state tensors ("master."), or NULL. */
static const fm_optim_state *optim_master(const fm_optim_state *os, int n) {
    for (int i = 0; i < n; i++)
        if (!strcmp(os[i].prefix, "master.")) return &os[i];
    return NULL;
}

fm_status fm_train_ckpt_init(run *r) {
    const int n = r->ep.full_ok ? r->ep.full.n_tensors : r->m.n_tensors; /* --ep: the full table's names */
    r->named = fm_malloc(sizeof(fm_named_tensor) * (size_t)(4 * n));
    r->names = fm_malloc(sizeof(*r->names) * (size_t)(4 * n));
    r->fetch = fm_malloc(sizeof(*r->fetch) * (size_t)(4 * n));
    if (!r->named || !r->names || !r->fetch) return fm_error(FM_ERR_NOMEM, "out of memory for the tensor name table");
    if (r->ep.full_ok) FM_TRY(fm_train_hf_init(&r->ep_hf, &r->ep.full)); /* --ep: the checkpoint's full names */
    return fm_train_hf_init(&r->hf, &r->m);
}

static fm_status save_named(run *r, const train_state *ts, fm_optim_state *os, int nos, const float *gmaster,
                            const fm_hf_table *t);

/* ---- many ranks: rank 0 writes; ZeRO-1/2's shards gathered to it, loaded by each owner ---- */

/* The shards of a sharded optimizer state (os->base: this rank's [shard_len] of os->dtype) into
 * full [n_params] host buffers on rank 0 (*full, allocated here; NULL elsewhere); a collective
 * of r->world. Errors: FM_ERR_NOMEM, the communicator's. */
static fm_status gather_state(run *r, const void *shard, fm_dtype dtype, void **full) {
    const fm_param_store *ps = &r->ps;
    const int W = r->n_ranks;
    const size_t es = fm_dtype_size(dtype);
    *full = NULL;
    int64_t *cnt = fm_malloc(sizeof(int64_t) * 4 * (size_t)W);
    if (!cnt) return fm_error(FM_ERR_NOMEM, "rank %d of %d: memory for the checkpoint gather's counts", r->rank, W);
    int64_t *sc = cnt, *sd = cnt + W, *rc = cnt + 2 * W, *rd = cnt + 3 * W;
    for (int q = 0; q < W; q++) {
        const int64_t b = (int64_t)q * ps->shard_len, e = b + ps->shard_len;
        sc[q] = sd[q] = 0;
        rd[q] = b < ps->n_params ? b : ps->n_params;
        rc[q] = r->rank == 0 ? (e < ps->n_params ? e : ps->n_params) - rd[q] : 0;
    }
    sc[0] = ps->shard_end - ps->shard_begin;
    fm_status st = FM_OK;
    if (r->rank == 0 && !(*full = fm_malloc(es * (size_t)ps->n_params)))
        st = fm_error(FM_ERR_NOMEM, "rank 0 of %d: cannot gather %lld optimizer values for the checkpoint on the host",
                      W, (long long)ps->n_params);
    /* an allocation failure on rank 0 returns before the collective: the CLI then ends every rank */
    if (st == FM_OK)
        st = fm_comm_all_to_all_v(&r->world, shard, sc, sd, *full, rc, rd,
                                  dtype == FM_DTYPE_BF16 ? FM_COMM_BF16 : FM_COMM_F32, 0);
    fm_free(cnt);
    if (st != FM_OK) fm_free(*full), *full = NULL;
    return st;
}

/* ZeRO-3: the full fp32 tensors of path with the prefix into a new host buffer *out [n_params]. */
static fm_status read_full(run *r, const char *path, const char *prefix, float **out) {
    *out = fm_malloc(sizeof(float) * (size_t)r->m.n_params);
    if (!*out) return fm_error(FM_ERR_NOMEM, "%s: cannot stage %lld values on the host", path, (long long)r->m.n_params);
    const fm_status s = hf_read(&r->m, &r->hf.t, path, prefix, *out); /* --ep: this rank's experts of the file's */
    if (s != FM_OK) fm_free(*out), *out = NULL;
    return s;
}

/* ZeRO-3: this rank's shard of the optimizer state os from the full tensors of path (any world size). */
static fm_status load_state_zero3(run *r, const char *path, const fm_optim_state *os) {
    float *full;
    FM_TRY(read_full(r, path, os->prefix, &full));
    const fm_status s = fm_zero3_scatter_full(&r->z3, &r->m, full, os->base, os->dtype);
    fm_free(full);
    return s;
}

/* Loads the optimizer state os (this rank's shard of a sharded store) from the full tensors of
 * path: the whole fp32 tensor staged on the host, this rank's range copied (bf16: narrowed). */
static fm_status load_state_shard(run *r, const char *path, const fm_optim_state *os) {
    const fm_param_store *ps = &r->ps;
    float *stage = fm_malloc(sizeof(float) * (size_t)ps->n_params);
    if (!stage) return fm_error(FM_ERR_NOMEM, "%s: cannot stage %lld values on the host", path, (long long)ps->n_params);
    fm_status s = fm_hf_read(&r->hf.t, path, os->prefix, stage);
    const int64_t len = ps->shard_end - ps->shard_begin;
    const float *src = stage + ps->shard_begin;
    if (s == FM_OK && os->dtype == FM_DTYPE_BF16) {
        uint16_t *h = (uint16_t *)stage; /* narrowing in increasing order never overtakes the reads */
        for (int64_t i = 0; i < len; i++) h[i] = fm_f32_to_bf16(src[i]);
        src = stage;
    }
    const size_t bytes = fm_dtype_size(os->dtype) * (size_t)len;
    if (s == FM_OK && (os->host || r->m.be.ops->host_memory)) memmove(os->base, src, bytes);
    else if (s == FM_OK) r->m.be.ops->copy(r->m.be.ctx, os->base, src, bytes, FM_COPY_H2D);
    fm_free(stage);
    return s;
}

/* --zero 3 --ep: the full tensors of master and of each optimizer state os[i] from the shards
 * (every rank's table in full, fm_zero3_gather_all) and the experts from their owners
 * (fm_train_ep_gather), written by rank 0; a collective of the world. Errors: as the gathers',
 * save_named's. */
static fm_status save_zero3_ep(run *r, const train_state *ts, fm_optim_state *os, int nos) {
    fm_model *m = &r->m;
    float *gathered[3] = {NULL, NULL, NULL}, *gmaster = NULL;
    fm_status st = FM_OK;
    for (int i = -1; i < nos && st == FM_OK; i++) { /* -1: the master */
        const void *src = i < 0 ? (const void *)r->z3.master : os[i].base;
        const fm_dtype dt = i < 0 ? FM_DTYPE_F32 : os[i].dtype;
        void *local = NULL;
        st = fm_zero3_gather_all(&r->z3, m, src, dt, &local);
        float *g = NULL;
        if (st == FM_OK) st = fm_train_ep_gather(&r->ep, m, local, dt, true, &g);
        fm_free(local);
        if (i < 0) gmaster = g;
        else gathered[i] = g, os[i].base = g, os[i].host = true, os[i].dtype = FM_DTYPE_F32;
    }
    if (st == FM_OK && r->rank == 0) st = save_named(r, ts, os, nos, gmaster, &r->ep_hf.t);
    for (int i = 0; i < nos; i++) fm_free(gathered[i]);
    fm_free(gmaster);
    return st;
}

static fm_status save_checkpoint(run *r, const train_state *ts) {
    fm_model *m = &r->m;
    /* fp32 master (as model.safetensors and master.*: the model's, or the optimizer's when it
     * names one), m, v */
    fm_optim_state os[3];
    const int nos = r->optim->state_tensors(r->opt_self, os, 3);
    void *gathered[3] = {NULL, NULL, NULL};
    float *gmaster = NULL;
    if (r->ep.full_ok && r->zero3) return save_zero3_ep(r, ts, os, nos);
    if (r->ep.full_ok) { /* --ep: full tensors, the experts gathered from their owners to rank 0 */
        fm_status st = fm_train_ep_gather(&r->ep, m, m->master, FM_DTYPE_F32, false, &gmaster);
        for (int i = 0; i < nos && st == FM_OK; i++) {
            float *g = NULL;
            st = fm_train_ep_gather(&r->ep, m, os[i].base, os[i].dtype, os[i].host, &g);
            gathered[i] = g;
            os[i].base = g, os[i].host = true, os[i].dtype = FM_DTYPE_F32;
        }
        if (st == FM_OK && r->rank == 0) st = save_named(r, ts, os, nos, gmaster, &r->ep_hf.t);
        for (int i = 0; i < nos; i++) fm_free(gathered[i]);
        fm_free(gmaster);
        return st;
    }
    if (r->zero3) { /* ZeRO-3: every rank's shards of master, m, v; rank 0 names the full host copies */
        fm_status st = FM_OK;
        for (int i = 0; i < nos && st == FM_OK; i++) {
            st = fm_zero3_gather_full(&r->z3, m, os[i].base, os[i].dtype, &gathered[i]);
            os[i].base = gathered[i], os[i].host = true;
        }
        void *g = NULL;
        if (st == FM_OK) st = fm_zero3_gather_full(&r->z3, m, r->z3.master, FM_DTYPE_F32, &g);
        gmaster = g;
        if (st != FM_OK) {
            for (int i = 0; i < nos; i++) fm_free(gathered[i]);
            fm_free(gmaster);
            return st;
        }
    } else if (r->ps.sharded) { /* ZeRO-1/2: every rank sends its shards; rank 0 names the full host copies */
        for (int i = 0; i < nos; i++) {
            FM_TRY(gather_state(r, os[i].base, os[i].dtype, &gathered[i]));
            os[i].base = gathered[i], os[i].host = true;
        }
        if ((void *)m->master != (void *)m->params) { /* bf16 weights: the owners' master ranges */
            void *g = NULL;
            fm_status st = gather_state(r, m->master + r->ps.shard_begin, FM_DTYPE_F32, &g);
            gmaster = g;
            if (st != FM_OK) {
                for (int i = 0; i < nos; i++) fm_free(gathered[i]);
                return st;
            }
        }
    }
    if (r->rank != 0) return FM_OK; /* rank 0 writes the files */
    fm_status s = save_named(r, ts, os, nos, gmaster, &r->hf.t);
    for (int i = 0; i < nos; i++) fm_free(gathered[i]);
    fm_free(gmaster);
    return s;
}

/* The tokenizer beside the weights (sample and eval find it there; transformers loads the folder
 * with it): tokenizer.json and its companions from the run's last checkpoint that has them (the
 * resumed one, or the last saved), else from --init-from's folder, each written atomically into
 * the new checkpoint folder `dir`. None there: nothing to copy. Errors: FM_ERR_IO (the copy). */
static fm_status copy_tokenizer(run *r, const char *dir) {
    static const char *const names[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                        "generation_config.json"};
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

/* Rank 0's part: names master, m, v (gmaster: the gathered master, host memory; NULL: the
 * model's) and writes the checkpoint. */
static fm_status save_named(run *r, const train_state *ts, fm_optim_state *os, int nos, const float *gmaster,
                            const fm_hf_table *t) {
    fm_model *m = &r->m;
    const int n = t->n_params;
    const fm_optim_state *ms = optim_master(os, nos);
    const void *master = gmaster ? (const void *)gmaster : ms ? ms->base : m->master;
    const bool mhost = gmaster || (ms && ms->host);
    FM_TRY(name_state(r, t, master, FM_DTYPE_F32, mhost, "", 0));
    FM_TRY(name_state(r, t, master, FM_DTYPE_F32, mhost, "master.", 1));
    for (int i = 0, k = 2; i < nos; i++) /* bf16: widened */
        if (&os[i] != ms) FM_TRY(name_state(r, t, os[i].base, os[i].dtype, os[i].host, os[i].prefix, k++));
    char *state = state_to_json(r, ts);
    fm_status s = state ? FM_OK : fm_error(FM_ERR_NOMEM, "out of memory writing state.json");
    char dir[4096];
    if (s == FM_OK)
        s = fm_ckpt_write(r->o->out_dir, ts->step, r->named, n, r->named + n, 3 * n, r->config_json, state, dir,
                          sizeof dir);
    fm_free(state);
    if (s == FM_OK) s = copy_tokenizer(r, dir);
    if (s == FM_OK && !r->o->quiet) printf("saved checkpoint %s\n", dir);
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
static bool same_rounded(float master, float stored, int dtype) {
    uint32_t a, b;
    if (dtype == FM_ST_BF16) return fm_f32_to_bf16(master) == fm_f32_to_bf16(stored);
    if (dtype == FM_ST_F16) return f32_to_f16(master) == f32_to_f16(stored);
    memcpy(&a, &master, 4); /* F32 (and F64, read rounded to fp32): bit for bit */
    memcpy(&b, &stored, 4);
    return a == b;
}

/* --resume: model.safetensors must hold the optimizer's master copy (already in r->m.master):
 * the table's names and shapes, each value equal to the master rounded to the stored dtype, and
 * nothing else. Reads one tensor at a time. Errors: FM_ERR_FORMAT naming the first tensor that
 * differs, and how to proceed. */
static fm_status verify_model_file(run *r, const char *dir, bool master_on_host) {
    fm_model *m = &r->m;
    char path[4200], a[96], b[96];
    snprintf(path, sizeof path, "%s/%s", dir, FM_CKPT_MODEL_FILE);
    fm_safetensors st;
    fm_status s = fm_st_open(&st, path);
    if (s != FM_OK) return s;
    int64_t max_numel = 1;
    for (int i = 0; i < m->n_tensors; i++) max_numel = m->table[i].numel > max_numel ? m->table[i].numel : max_numel;
    float *file = fm_malloc(sizeof(float) * (size_t)max_numel);
    float *mst = master_on_host ? NULL : fm_malloc(sizeof(float) * (size_t)max_numel);
    const char *how = "pass --resume-trust-optimizer to resume from the optimizer's master copy (optimizer.safetensors) "
                      "anyway, or --init-from with that folder and a new --out to start a run from the edited weights, "
                      "or move the folder away to resume from the checkpoint before it";
    if (!file || (!master_on_host && !mst)) s = fm_error(FM_ERR_NOMEM, "%s: out of memory checking it", path);
    for (int i = 0; i < m->n_tensors && s == FM_OK; i++) {
        const fm_param *p = &m->table[i];
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
        if ((s = fm_st_read_f32(&st, p->name, file, p->ndim, p->shape))) break;
        const float *w = m->master + p->offset;
        if (!master_on_host) {
            m->be.ops->copy(m->be.ctx, mst, w, sizeof(float) * (size_t)p->numel, FM_COPY_D2H);
            w = mst;
        }
        for (int64_t j = 0; j < p->numel; j++)
            if (!same_rounded(w[j], file[j], t->dtype)) {
                s = fm_error(FM_ERR_FORMAT, "--resume: %s disagrees with the optimizer's master copy at tensor '%s', element "
                             "%lld: %.9g in the file, %.9g in the master (stored as %s); the weights were changed after "
                             "the checkpoint was written, or the file is damaged: %s", path, p->name, (long long)j,
                             (double)file[j], (double)w[j], fm_st_dtype_name(t->dtype), how);
                break;
            }
    }
    /* --ep: the file holds every rank's experts, the table this rank's */
    const int64_t n_expect = m->n_tensors + (int64_t)(m->ep - 1) * m->cfg.num_hidden_layers * 3 * m->E_loc;
    if (s == FM_OK && st.n_tensors != n_expect) { /* every table tensor is there: name one it lacks */
        for (int i = 0; i < st.n_tensors && s == FM_OK; i++)
            if (m->ep <= 1 && !fm_model_find_param(m, st.tensors[i].name))
                s = fm_error(FM_ERR_FORMAT, "--resume: %s holds tensor '%s', which is not a parameter of this model; the "
                             "file was changed after the checkpoint was written: %s", path, st.tensors[i].name, how);
        if (s == FM_OK && m->ep > 1)
            s = fm_error(FM_ERR_FORMAT, "--resume: %s holds %d tensors; the model with all its experts has %lld: the "
                         "file was changed after the checkpoint was written: %s", path, st.n_tensors,
                         (long long)n_expect, how);
    }
    fm_free(file);
    fm_free(mst);
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
            const int64_t w = json_i64(cur, "world", 1), nt = json_i64(cur, "train_tokens", -1);
            if (w != r->train.world && r->rank == 0) /* rank 0 speaks for all: the same on every rank */
                fprintf(stderr, "note: --resume: the checkpoint's data cursor was drawn over %lld rank(s), this run has "
                        "%d: the same sequences are drawn, split over other ranks (the global batch is micro-batch x "
                        "data-parallel ranks; a warning follows if that changed)\n", (long long)w, r->train.world);
            if (nt >= 0 && nt != r->train.n_tokens && r->rank == 0)
                fprintf(stderr, "warning: --resume: the training data holds %lld tokens, the checkpoint's was %lld: the "
                        "data order will not match an uninterrupted run\n", (long long)r->train.n_tokens, (long long)nt);
        }
        cJSON_Delete(so);
    }
    snprintf(path, sizeof path, "%s/%s", dir, FM_CKPT_OPTIM_FILE);
    /* the fp32 master from the optimizer file (model.safetensors holds the same values): into the
     * model's master, or the optimizer's (host) one, then converted into the weights */
    fm_optim_state os[3];
    const int nos = r->optim->state_tensors(r->opt_self, os, 3);
    const fm_optim_state *ms = optim_master(os, nos);
    float *z3_full = NULL; /* ZeRO-3: the full master, checked, then this rank's shard taken from it */
    if (r->zero3) {
        FM_TRY(read_full(r, path, "master.", &z3_full));
    } else if (ms) {
        FM_TRY(load_fp32_as_ex(&r->m, &r->hf.t, path, "master.", ms->base, FM_DTYPE_F32, ms->host));
        /* the weights from it (the model's master view is this memory: fm_param_store_create_host_master) */
        FM_ASSERT((const void *)r->m.master == ms->base);
        r->m.be.ops->convert(r->m.be.ctx, r->m.params, FM_ACT_DTYPE, r->m.master, FM_DTYPE_F32, r->m.n_params);
    } else {
        FM_TRY(load_master(&r->m, &r->hf.t, path, "master."));
    }
    if (r->o->resume_trust_optimizer) {
        if (!r->o->quiet) printf("--resume-trust-optimizer: %s/%s is not checked against the master copy\n", dir,
                                 FM_CKPT_MODEL_FILE);
    } else if (r->zero3) { /* checked against the full host copy */
        float *shard = r->m.master;
        r->m.master = z3_full;
        const fm_status s = verify_model_file(r, dir, true);
        r->m.master = shard;
        if (s != FM_OK) fm_free(z3_full);
        FM_TRY(s);
    } else {
        FM_TRY(verify_model_file(r, dir, r->m.be.ops->host_memory || (ms && ms->host)));
    }
    if (r->zero3) {
        const fm_status s = fm_zero3_set_master(&r->z3, &r->m, z3_full);
        fm_free(z3_full);
        FM_TRY(s);
    }
    /* bf16 moments: narrowed to nearest even, exact for moments a bf16 run saved; ZeRO-1/2: this
     * rank's range of the full tensors (any world size) */
    for (int i = 0; i < nos; i++)
        if (&os[i] != ms) {
            if (r->zero3) FM_TRY(load_state_zero3(r, path, &os[i]));
            else if (r->ps.sharded) FM_TRY(load_state_shard(r, path, &os[i]));
            else FM_TRY(load_fp32_as_ex(&r->m, &r->hf.t, path, os[i].prefix, os[i].base, os[i].dtype, os[i].host));
        }
    r->opt.step = ts->opt_step;
    return FM_OK;
}

/* ---- loading a checkpoint for inference ----------------------------------------------------- */

fm_status fm_load_for_inference(fm_model *m, fm_param_store *ps, const char *ckpt_dir, fm_backend be, int64_t B, int64_t T,
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
    FM_TRY(fm_model_create(m, &cfg, be));
    fm_status s = fm_param_store_create(ps, m, 0);
    if (s == FM_OK) s = fm_model_layout(m, B, T, NULL);
    fm_train_hf hf = {0};
    if (s == FM_OK) s = fm_train_hf_init(&hf, m);
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
#define FM_SAVE_BARRIER_TIMEOUT_S (4.0 * 3600.0)
fm_status fm_train_save_checkpoint(run *r, const train_state *ts) {
    const fm_status s = save_checkpoint(r, ts);
    if (s != FM_OK || r->n_ranks <= 1) return s;
    const double t = r->o->comm_timeout > FM_SAVE_BARRIER_TIMEOUT_S ? r->o->comm_timeout : FM_SAVE_BARRIER_TIMEOUT_S;
    return fm_comm_barrier(&r->world, t);
}
