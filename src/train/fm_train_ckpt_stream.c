/* The sharded trainers' checkpoints through one bounded staging buffer (fm_train_ckpt_stream.h:
 * the design, the owners of a piece, the bound). */
#include <stdlib.h>
#include <string.h>

#include "../io/fm_checkpoint.h"
#include "fm_train_internal.h"

size_t fm_ckpt_stage_bound(int64_t max_numel, int64_t chunk) {
    if (chunk <= 0) chunk = FM_CKPT_CHUNK_ELEMS;
    const int64_t ce = max_numel < chunk ? (max_numel > 0 ? max_numel : 1) : chunk;
    return 8 * (size_t)ce;
}

int64_t fm_ckpt_max_tensor_numel(const fm_config *c) {
    const int64_t H = c->hidden_size;
    const int64_t cand[6] = {c->vocab_size * H, c->num_attention_heads * c->head_dim * H, c->moe_intermediate_size * H,
                             c->num_experts * H,
                             fm_config_num_moe_layers(c) < c->num_hidden_layers ? c->dense_intermediate_size * H : 0,
                             fm_config_shared_width(c) * H};
    int64_t mx = 1;
    for (int i = 0; i < 6; i++) mx = cand[i] > mx ? cand[i] : mx;
    return mx;
}

int64_t fm_ckpt_chunk_elems(const fm_test_hooks *h) { /* test hook: many pieces per tensor */
    return h && h->ckpt_chunk_elems > 0 ? h->ckpt_chunk_elems : FM_CKPT_CHUNK_ELEMS;
}

/* ---- what a state is and who holds its elements --------------------------------------------- */

/* How a state's elements lie on the ranks. */
typedef enum st_kind {
    K_TABLE = 0, /* base in this rank's table layout, [m->p.n_params]; tensor i held whole by the ranks that have it */
    K_SHARD12,   /* ZeRO-1/2: base is this rank's [shard_len], flat [shard_begin, shard_end) */
    K_FULL12,    /* ZeRO-1/2's fp32 master beside bf16 weights: table layout, current on the shard's owner */
    K_ZERO3      /* ZeRO-3: base is this rank's shard [S] (fm_zero3.h) */
} st_kind;

typedef struct st_desc {
    const void *base;
    fm_dtype dtype;
    bool host; /* host memory (else the backend's) */
    st_kind kind;
    const void *dev; /* dev_len > 0 (K_TABLE only): elements [0, dev_len) at dev (backend memory), element
                        i >= dev_len at base + (i - dev_len) (fm_optim_state.dev) */
    int64_t dev_len;
} st_desc;

typedef struct fm_ckpt_src {
    run *r;
    int slot, i;
} fm_ckpt_src;

static const fm_hf_table *full_table(const run *r) { return r->ep.full_ok ? &r->ep_hf.t : &r->hf.t; }

static int64_t numel_of(const fm_hf_param *p) { return p->ndim == 1 ? p->shape[0] : p->shape[0] * p->shape[1]; }

/* ZeRO-3's group of flat element p of this rank's table. */
static int z3_group(const fm_zero3 *z, int64_t p) {
    int g = 0;
    while (g + 1 < z->n_groups && z->begin[g + 1] <= p) g++;
    return g;
}

/* The owner (world rank) of element a of full tensor i in state s, how many elements from a
 * (at most n) it owns in one run, and its element offset in s->base (meaningful on the owner). */
static void segment(const run *r, const st_desc *s, int i, int64_t a, int64_t n, int *owner, int64_t *len,
                    int64_t *pos) {
    const fm_ckpt_stage *c = &r->cst;
    const int64_t lo = c->lo[i];
    *owner = c->owner[i];
    *len = n;
    *pos = lo + a;
    if (s->kind == K_SHARD12 || s->kind == K_FULL12) {
        const int64_t S = r->ps.shard_len, p = lo + a, q = p / S, end = (q + 1) * S;
        *owner = (int)q;
        *len = end - p < n ? end - p : n;
        *pos = s->kind == K_SHARD12 ? p - q * S : p;
    } else if (s->kind == K_ZERO3) {
        const fm_zero3 *z = &r->z3;
        if (c->shared[i]) { /* the pieces of its group */
            const int64_t p = lo + a;
            const int g = z3_group(z, p);
            const int64_t k = p - z->begin[g], q = k / z->piece[g], end = z->begin[g] + (q + 1) * z->piece[g];
            *owner = c->z3world[q];
            *len = end - p < n ? end - p : n;
            *pos = z->local[g] + k % z->piece[g];
        } else if (lo >= 0) { /* a whole part (this rank's experts) */
            const int g = z3_group(z, lo);
            *pos = z->wlocal[g] + (lo + a - (z->begin[g + 1] - z->keep[g]));
        }
    }
}

/* A state split at dev_len (st_desc.dev): the part [pos, pos + *n) on one side of the split, as
 * a plain descriptor *one at element *at; *n shortened to the side's end. */
static void split_side(const st_desc *s, int64_t pos, int64_t *n, st_desc *one, int64_t *at) {
    *one = *s;
    one->dev = NULL, one->dev_len = 0;
    *at = pos;
    if (s->dev_len <= 0) return;
    if (pos < s->dev_len) {
        one->base = s->dev, one->host = false;
        if (pos + *n > s->dev_len) *n = s->dev_len - pos;
    } else {
        *at = pos - s->dev_len;
    }
}

/* Elements [pos, pos + n) of state s (one side of a split) into dst (fp32; bf16 widened exactly). */
static void fetch_side(const run *r, const st_desc *s, int64_t pos, int64_t n, float *dst) {
    const fm_backend *be = &r->m.be;
    const bool host = s->host || be->ops->host_memory;
    const size_t es = fm_dtype_size(s->dtype);
    const char *src = (const char *)s->base + es * (size_t)pos;
    if (s->dtype == FM_DTYPE_F32) {
        if (host) memcpy(dst, src, 4 * (size_t)n);
        else be->ops->copy(be->ctx, dst, src, 4 * (size_t)n, FM_COPY_D2H);
        return;
    }
    /* bf16 in the upper half, widened in increasing order (never overtakes the unread values) */
    uint16_t *h = (uint16_t *)((char *)dst + 2 * (size_t)n);
    if (host) memcpy(h, src, 2 * (size_t)n);
    else be->ops->copy(be->ctx, h, src, 2 * (size_t)n, FM_COPY_D2H);
    for (int64_t k = 0; k < n; k++) dst[k] = fm_bf16_to_f32(h[k]);
}

/* Elements [pos, pos + n) of state s into dst: one piece per side of a split state. */
static void fetch_local(const run *r, const st_desc *s, int64_t pos, int64_t n, float *dst) {
    for (int64_t done = 0; done < n;) {
        st_desc one;
        int64_t at, k = n - done;
        split_side(s, pos + done, &k, &one, &at);
        fetch_side(r, &one, at, k, dst + done);
        done += k;
    }
}

static void note_high(fm_ckpt_stage *c, size_t used) {
    if (used > c->high) c->high = used;
}

/* Piece [a, a + n) of full tensor i of state s into out [n] on rank 0 (a collective of the
 * host world; out unused elsewhere). */
static fm_status gather_piece(run *r, const st_desc *s, int i, int64_t a, int64_t n, float *out) {
    fm_ckpt_stage *c = &r->cst;
    const int W = r->n_ranks, me = r->rank;
    if (W <= 1) {
        int q;
        int64_t len, pos;
        segment(r, s, i, a, n, &q, &len, &pos);
        FM_ASSERT(q == 0);
        for (int64_t off = 0; off < n; off += len) {
            segment(r, s, i, a + off, n - off, &q, &len, &pos);
            fetch_local(r, s, pos, len, out + off);
        }
        note_high(c, 4 * (size_t)n);
        return FM_OK;
    }
    int64_t *sc = c->cnt, *sd = c->cnt + W, *rc = c->cnt + 2 * W, *rd = c->cnt + 3 * W;
    memset(c->cnt, 0, sizeof(int64_t) * 4 * (size_t)W);
    size_t used = me == 0 ? 4 * (size_t)n : 0;
    for (int64_t off = 0; off < n;) {
        int q;
        int64_t len, pos;
        segment(r, s, i, a + off, n - off, &q, &len, &pos);
        FM_ASSERT(q >= 0 && q < W && rc[q] == 0 && len > 0); /* each owner holds one run of a piece */
        if (me == 0) rc[q] = len, rd[q] = off;
        if (q == me) {
            fetch_local(r, s, pos, len, c->send);
            sc[0] = len;
            used += 4 * (size_t)len;
        }
        off += len;
    }
    if (me != 0) memset(rc, 0, sizeof(int64_t) * (size_t)W);
    note_high(c, used);
    return fm_comm_all_to_all_v(&c->host, c->send, sc, sd, me == 0 ? out : c->recv, rc, rd, FM_COMM_F32, c->timeout_s);
}

static fm_status fetch_cb(void *ctx, int64_t first, int64_t count, float *stage) {
    fm_ckpt_src *f = ctx;
    const st_desc *s = (const st_desc *)f->r->cst.states + f->slot;
    return gather_piece(f->r, s, f->i, first, count, stage);
}

/* ---- set-up ---------------------------------------------------------------------------------- */

fm_status fm_ckpt_stage_init(run *r) {
    fm_ckpt_stage *c = &r->cst;
    const fm_hf_table *t = full_table(r);
    const int n = t->n_params, W = r->n_ranks;
    memset(c, 0, sizeof *c);
    int64_t mx = 1;
    for (int i = 0; i < n; i++) mx = numel_of(&t->params[i]) > mx ? numel_of(&t->params[i]) : mx;
    c->bytes = fm_ckpt_stage_bound(mx, fm_ckpt_chunk_elems(&r->o->test_hooks));
    c->chunk = (int64_t)(c->bytes / 8);
    c->n_full = n;
    c->send = fm_malloc(c->bytes);
    c->recv = c->send ? c->send + c->chunk : NULL;
    c->cnt = fm_malloc(sizeof(int64_t) * 4 * (size_t)(W > 0 ? W : 1));
    c->owner = fm_malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    c->shared = fm_malloc(sizeof(bool) * (size_t)(n > 0 ? n : 1));
    c->lo = fm_malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    c->src = fm_malloc(sizeof(fm_ckpt_src) * (size_t)(FM_CKPT_MAX_STATES * (n > 0 ? n : 1)));
    c->states = fm_malloc(sizeof(st_desc) * FM_CKPT_MAX_STATES);
    const int zw = r->zero3 ? r->z3.W : 1;
    c->z3world = fm_malloc(sizeof(int) * (size_t)zw);
    if (!c->send || !c->cnt || !c->owner || !c->shared || !c->lo || !c->src || !c->states || !c->z3world)
        return fm_error(FM_ERR_NOMEM, "rank %d of %d: out of memory for the checkpoint staging (%zu bytes) and its "
                        "tables", r->rank, W, c->bytes);
    for (int i = 0; i < n; i++) {
        const fm_param *p = fm_params_find(&r->m.p, t->params[i].name);
        c->lo[i] = p ? p->offset : -1;
        c->owner[i] = 0;
        c->shared[i] = true;
    }
    for (int i = 0; i < zw; i++) c->z3world[i] = i;
    if (W <= 1) return FM_OK;
    const double dflt = r->world.ops->default_timeout(r->world.ctx);
    FM_TRY(fm_comm_mpi_world(&c->host, NULL, dflt, 0));
    c->host_ok = true;
    c->timeout_s = dflt > FM_CKPT_SAVE_TIMEOUT_S ? dflt : FM_CKPT_SAVE_TIMEOUT_S;
    /* who holds what: the lowest world rank holding each tensor (max of W - rank), and whether
     * every rank holds it (the count), in batches the host all-reduce takes */
    enum { B = FM_COMM_HOST_MAX_ELEMS / 2 };
    int64_t v[2 * B];
    for (int i0 = 0; i0 < n; i0 += B) {
        const int k = n - i0 < B ? n - i0 : B;
        for (int j = 0; j < k; j++) v[j] = c->lo[i0 + j] >= 0 ? W - r->rank : 0;
        FM_TRY(fm_comm_allreduce_max_i64(&c->host, v, k, 0));
        for (int j = 0; j < k; j++) c->owner[i0 + j] = (int)(W - v[j]);
        for (int j = 0; j < k; j++) v[j] = c->lo[i0 + j] >= 0;
        FM_TRY(fm_comm_allreduce_sum_i64(&c->host, v, k, 0));
        for (int j = 0; j < k; j++) c->shared[i0 + j] = v[j] == W;
    }
    if (r->zero3) { /* ZeRO-3 rank q's lowest world rank (its dp communicator may be a part of the world) */
        FM_ASSERT(zw <= B);
        for (int q = 0; q < zw; q++) v[q] = r->z3.rank == q ? W - r->rank : 0;
        FM_TRY(fm_comm_allreduce_max_i64(&c->host, v, zw, 0));
        for (int q = 0; q < zw; q++) c->z3world[q] = (int)(W - v[q]);
    }
    return FM_OK;
}

void fm_ckpt_stage_free(run *r) {
    fm_ckpt_stage *c = &r->cst;
    if (c->host_ok) fm_comm_free(&c->host);
    fm_free(c->send);
    fm_free(c->cnt);
    fm_free(c->owner);
    fm_free(c->shared);
    fm_free(c->lo);
    fm_free(c->src);
    fm_free(c->states);
    fm_free(c->z3world);
    memset(c, 0, sizeof *c);
}

/* ---- save ------------------------------------------------------------------------------------ */

/* The optimizer's own fp32 master among its state tensors ("master."), or NULL. */
static const fm_optim_state *master_of(const fm_optim_state *os, int n) {
    for (int i = 0; i < n; i++)
        if (!strcmp(os[i].prefix, "master.")) return &os[i];
    return NULL;
}

/* The states of a save in file order: master (model file), master (optimizer file), then the
 * optimizer's other states; their prefixes into pre. Returns the count. */
static int save_states(run *r, const fm_optim_state *os, int nos, st_desc *sd, const char **pre) {
    fm_model *m = &r->m;
    const fm_optim_state *ms = master_of(os, nos);
    const st_kind sk = r->zero3 ? K_ZERO3 : r->ps.sharded ? K_SHARD12 : K_TABLE;
    st_desc master;
    if (r->ps.no_master) master = (st_desc){m->p.params, FM_ACT_DTYPE, false, K_TABLE}; /* a bf16 recipe: the weights */
    else if (r->zero3) master = (st_desc){r->z3.master, FM_DTYPE_F32, false, K_ZERO3};
    else if (ms) master = (st_desc){ms->base, FM_DTYPE_F32, ms->host, sk};
    else if (r->ps.sharded && (void *)m->p.master != (void *)m->p.params)
        master = (st_desc){m->p.master, FM_DTYPE_F32, false, K_FULL12};
    else master = (st_desc){m->p.master, FM_DTYPE_F32, false, K_TABLE};
    int k = 0;
    sd[k] = master, pre[k++] = "";
    sd[k] = master, pre[k++] = "master.";
    for (int i = 0; i < nos && k < FM_CKPT_MAX_STATES; i++)
        if (&os[i] != ms)
            sd[k] = (st_desc){os[i].base, os[i].dtype, os[i].host, sk, os[i].dev, os[i].dev_len}, pre[k++] = os[i].prefix;
    return k;
}

bool fm_ckpt_stream_wanted(const run *r, const fm_optim_state *os, int nos) {
    if (r->n_ranks > 1 || r->zero3 || r->ep.full_ok) return true;
    if (!r->m.be.ops->host_memory) return true; /* a device's buffers: through the staging */
    for (int i = 0; i < nos; i++)
        if (os[i].dtype != FM_DTYPE_F32 || os[i].dev_len > 0) return true; /* narrowed, or split */
    return false; /* one rank's fp32 host buffers: the writer reads them in place */
}

fm_status fm_ckpt_stream_prepare(run *r, const fm_optim_state *os, int nos, int *n_slots) {
    fm_ckpt_stage *c = &r->cst;
    st_desc *sd = c->states;
    const char *pre[FM_CKPT_MAX_STATES];
    const int k = save_states(r, os, nos, sd, pre);
    const fm_hf_table *t = full_table(r);
    const int n = t->n_params;
    *n_slots = k;
    /* every rank names them: rank 0 reads through them (the writer, or the library's export), and the
     * library's export walks them on the other ranks too, each read the same collective (gather_piece) */
    for (int s = 0; s < k; s++) {
        FM_TRY(fm_hf_name_tensors(t, NULL, pre[s], r->named + s * n, r->names + s * n));
        for (int i = 0; i < n; i++) {
            fm_named_tensor *nt = &r->named[s * n + i];
            c->src[s * n + i] = (fm_ckpt_src){r, s, i};
            nt->data = NULL;
            nt->fetch_range = fetch_cb;
            nt->fetch_ctx = &c->src[s * n + i];
            nt->stage = c->recv;
            nt->stage_len = c->chunk;
        }
    }
    return FM_OK;
}

fm_status fm_ckpt_stream_serve(run *r, int n_slots) {
    const fm_ckpt_stage *c = &r->cst;
    const fm_hf_table *t = full_table(r);
    for (int s = 0; s < n_slots; s++)
        for (int i = 0; i < t->n_params; i++) {
            const int64_t numel = numel_of(&t->params[i]);
            for (int64_t a = 0; a < numel; a += c->chunk)
                FM_TRY(gather_piece(r, (const st_desc *)c->states + s, i, a, numel - a < c->chunk ? numel - a : c->chunk,
                                    NULL));
        }
    return FM_OK;
}

/* ---- load ------------------------------------------------------------------------------------ */

/* Narrows n fp32 values in place to dtype and stores them at element pos of state s (one side of
 * a split). */
static void store_side(const run *r, const st_desc *s, int64_t pos, float *v, int64_t n) {
    const fm_backend *be = &r->m.be;
    const bool host = s->host || be->ops->host_memory;
    const size_t es = fm_dtype_size(s->dtype);
    if (s->dtype == FM_DTYPE_BF16) {
        uint16_t *h = (uint16_t *)v; /* narrowing in increasing order never overtakes the reads */
        for (int64_t k = 0; k < n; k++) h[k] = fm_f32_to_bf16(v[k]);
    }
    char *dst = (char *)s->base + es * (size_t)pos;
    if (host) memcpy(dst, v, es * (size_t)n);
    else be->ops->copy(be->ctx, dst, v, es * (size_t)n, FM_COPY_H2D);
}

/* The same for state s: one piece per side of a split state. */
static void store_local(const run *r, const st_desc *s, int64_t pos, float *v, int64_t n) {
    for (int64_t done = 0; done < n;) {
        st_desc one;
        int64_t at, k = n - done;
        split_side(s, pos + done, &k, &one, &at);
        store_side(r, &one, at, v + done, k);
        done += k;
    }
}

/* The ranges of this rank's table tensor p that state kind k stores here: *nr of them, elements
 * [a[j], b[j]) of the tensor at element dest[j] of the state's buffer. */
static int own_ranges(const run *r, st_kind k, const fm_param *p, int64_t a[2], int64_t b[2], int64_t dest[2]) {
    const int64_t o = p->offset, e = o + p->numel;
    if (k == K_SHARD12) {
        const int64_t lo = o > r->ps.shard_begin ? o : r->ps.shard_begin, hi = e < r->ps.shard_end ? e : r->ps.shard_end;
        if (hi <= lo) return 0;
        a[0] = lo - o, b[0] = hi - o, dest[0] = lo - r->ps.shard_begin;
        return 1;
    }
    if (k == K_ZERO3) {
        const fm_zero3 *z = &r->z3;
        const int g = z3_group(z, o);
        const int64_t wb = z->begin[g + 1] - z->keep[g];
        if (z->keep[g] > 0 && o >= wb) { /* whole part */
            a[0] = 0, b[0] = p->numel, dest[0] = z->wlocal[g] + (o - wb);
            return 1;
        }
        const int64_t vb = z->begin[g] + (int64_t)z->rank * z->piece[g];
        const int64_t ve0 = vb + z->piece[g], ve = ve0 < wb ? ve0 : wb;
        const int64_t lo = o > vb ? o : vb, hi = e < ve ? e : ve;
        if (hi <= lo) return 0;
        a[0] = lo - o, b[0] = hi - o, dest[0] = z->local[g] + (lo - vb);
        return 1;
    }
    a[0] = 0, b[0] = p->numel, dest[0] = o;
    return 1;
}

/* ZeRO-3: zeros in the padding of this rank's pieces of state s. */
static void zero_padding(run *r, const st_desc *s) {
    fm_ckpt_stage *c = &r->cst;
    const fm_zero3 *z = &r->z3;
    for (int g = 0; g < z->n_groups; g++) {
        const int64_t vb = z->begin[g] + (int64_t)z->rank * z->piece[g], wb = z->begin[g + 1] - z->keep[g];
        int64_t v = wb - vb;
        v = v < 0 ? 0 : v > z->piece[g] ? z->piece[g] : v;
        for (int64_t x = v; x < z->piece[g]; x += c->chunk) {
            const int64_t n = z->piece[g] - x < c->chunk ? z->piece[g] - x : c->chunk;
            memset(c->send, 0, 4 * (size_t)n);
            store_local(r, s, z->local[g] + x, c->send, n);
        }
    }
}

/* How many tensors of st carry prefix (non-empty: the optimizer file holds master., exp_avg., ...). */
static int count_prefix(const fm_safetensors *st, const char *prefix) {
    const size_t n = strlen(prefix);
    int k = 0;
    for (int i = 0; i < st->n_tensors; i++) {
        const char *nm = st->tensors[i].name;
        if (!strncmp(nm, prefix, n)) k++;
    }
    return k;
}

/* Loads state s (prefix) of this rank from the open optimizer file; model (NULL: no check) is
 * model.safetensors, checked range by range against the values read. */
static fm_status load_state(run *r, const fm_safetensors *opt, const fm_safetensors *model, const st_desc *s,
                            const char *prefix) {
    fm_model *m = &r->m;
    fm_ckpt_stage *c = &r->cst;
    const int want = full_table(r)->n_params, have = count_prefix(opt, prefix);
    if (have != want)
        return fm_error(FM_ERR_FORMAT, "%s holds %d tensors named '%s*'; the model (all its experts) has %d: the "
                        "checkpoint was written for another config, or the file was changed", opt->path, have, prefix,
                        want);
    char name[FM_HF_NAME_CAP + 16];
    for (int j = 0; j < m->p.n_tensors; j++) {
        const fm_param *p = &m->p.table[j];
        int64_t a[2], b[2], d[2];
        const int nr = own_ranges(r, s->kind, p, a, b, d);
        snprintf(name, sizeof name, "%s%s", prefix, p->name);
        for (int q = 0; q < nr; q++)
            for (int64_t x = a[q]; x < b[q]; x += c->chunk) {
                const int64_t n = b[q] - x < c->chunk ? b[q] - x : c->chunk;
                FM_TRY(fm_st_read_f32_range(opt, name, x, n, c->send, p->ndim, p->shape));
                note_high(c, 4 * (size_t)n * (model ? 2 : 1));
                if (model) {
                    const fm_st_tensor *t = fm_st_find(model, p->name);
                    FM_TRY(fm_st_read_f32_range(model, p->name, x, n, c->recv, p->ndim, p->shape));
                    for (int64_t k = 0; k < n; k++)
                        if (!fm_train_same_rounded(c->send[k], c->recv[k], t->dtype))
                            return fm_error(FM_ERR_FORMAT, "--resume: %s disagrees with the optimizer's master copy at "
                                            "tensor '%s', element %lld: %.9g in the file, %.9g in the master (stored as "
                                            "%s); the weights were changed after the checkpoint was written, or the "
                                            "file is damaged: %s", model->path, p->name, (long long)(x + k),
                                            (double)c->recv[k], (double)c->send[k], fm_st_dtype_name(t->dtype),
                                            FM_TRAIN_RESUME_HOW);
                }
                store_local(r, s, d[q] + x - a[q], c->send, n);
            }
    }
    if (s->kind == K_ZERO3) zero_padding(r, s);
    return FM_OK;
}

fm_status fm_ckpt_stream_load(run *r, const char *dir, bool verify) {
    fm_model *m = &r->m;
    char path[4200];
    fm_safetensors opt = {0}, model = {0};
    snprintf(path, sizeof path, "%s/%s", dir, FM_CKPT_OPTIM_FILE);
    FM_TRY(fm_st_open(&opt, path));
    fm_status s = FM_OK;
    if (verify) {
        snprintf(path, sizeof path, "%s/%s", dir, FM_CKPT_MODEL_FILE);
        s = fm_st_open(&model, path);
    }
    fm_optim_state os[3];
    const int nos = r->optim->state_tensors(r->opt_self, os, 3);
    const fm_optim_state *ms = master_of(os, nos);
    const st_kind sk = r->zero3 ? K_ZERO3 : r->ps.sharded ? K_SHARD12 : K_TABLE;
    /* the master: the shard's (ZeRO-3), the optimizer's own, or the model's full one (ZeRO-1/2
     * keeps full weights on every rank) */
    st_desc master = r->ps.no_master ? (st_desc){m->p.params, FM_ACT_DTYPE, false, K_TABLE}
                     : r->zero3 ? (st_desc){r->z3.master, FM_DTYPE_F32, false, K_ZERO3}
                     : ms     ? (st_desc){ms->base, FM_DTYPE_F32, ms->host, K_TABLE}
                              : (st_desc){m->p.master, FM_DTYPE_F32, false, K_TABLE};
    if (s == FM_OK) s = load_state(r, &opt, verify ? &model : NULL, &master, "master.");
    if (s == FM_OK) {
        if (r->zero3) {
            if ((void *)r->z3.master != (void *)r->z3.weights)
                m->be.ops->convert(m->be.ctx, r->z3.weights, FM_ACT_DTYPE, r->z3.master, FM_DTYPE_F32, r->z3.shard_len);
            fm_zero3_invalidate(&r->z3);
        } else if ((void *)m->p.master != (void *)m->p.params) {
            m->be.ops->convert(m->be.ctx, m->p.params, FM_ACT_DTYPE, m->p.master, FM_DTYPE_F32, m->p.n_params);
        }
    }
    for (int i = 0; i < nos && s == FM_OK; i++)
        if (&os[i] != ms && !(!strcmp(os[i].prefix, FM_KAHAN_PREFIX) && count_prefix(&opt, FM_KAHAN_PREFIX) == 0)) {
            /* (a checkpoint of another recipe has no Kahan buffer: it stays at zero) */
            const st_desc d = {os[i].base, os[i].dtype, os[i].host, sk, os[i].dev, os[i].dev_len};
            s = load_state(r, &opt, NULL, &d, os[i].prefix);
        }
    fm_st_close(&model);
    fm_st_close(&opt);
    return s;
}

/* ---- ZeRO-3's initial weights ---------------------------------------------------------------- */

fm_status fm_ckpt_stream_init_zero3(run *r, uint64_t seed) {
    fm_model *m = &r->m;
    fm_ckpt_stage *c = &r->cst;
    const fm_zero3 *z = &r->z3;
    const st_desc s = {z->master, FM_DTYPE_F32, false, K_ZERO3};
    for (int j = 0; j < m->p.n_tensors; j++) { /* this rank's ranges only: the draw is counter-based */
        int64_t a[2], b[2], d[2];
        const int nr = own_ranges(r, K_ZERO3, &m->p.table[j], a, b, d);
        for (int q = 0; q < nr; q++)
            for (int64_t x = a[q]; x < b[q]; x += c->chunk) {
                const int64_t n = b[q] - x < c->chunk ? b[q] - x : c->chunk;
                fm_params_init_weights_range(&m->p, seed, j, x, n, c->send);
                note_high(c, 4 * (size_t)n);
                store_local(r, &s, d[q] + x - a[q], c->send, n);
            }
    }
    zero_padding(r, &s);
    if ((void *)z->master != (void *)z->weights)
        m->be.ops->convert(m->be.ctx, z->weights, FM_ACT_DTYPE, z->master, FM_DTYPE_F32, z->shard_len);
    fm_zero3_invalidate(&r->z3);
    return FM_OK;
}
