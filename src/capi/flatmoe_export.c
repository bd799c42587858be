/* libflatmoe's weight export (include/flatmoe.h flatmoe_export_weights): the checkpoint's model
 * tensors (names, shapes, order: the writer's table, src/train/fm_train_ckpt_stream.c), read from
 * the fp32 master through the session's checkpoint staging, narrowed to bf16 (fm_f32_to_bf16,
 * round to nearest even) into one host bucket and handed to the caller's callback. */
#include <string.h>

#include "fm_capi.h"

/* The export's walk: the bucket, its pieces and the callback. */
typedef struct exporter {
    uint16_t *buf;                  /* [cap] bf16 elements */
    int64_t cap, used;              /* elements */
    flatmoe_weight_piece *pieces;   /* [n_tensors] */
    int n_pieces;
    int64_t bucket;                 /* buckets sent */
    flatmoe_bucket_fn fn;
    void *user;
    const fm_comm *world;           /* many ranks: the session's (rank 0 calls fn); NULL: one rank */
    int rank;
} exporter;

static fm_status flush(exporter *x) {
    if (x->n_pieces == 0) return FM_OK;
    int64_t rc = x->rank == 0 ? x->fn(x->user, x->pieces, x->n_pieces) : 0; /* the pieces are whole on rank 0 only */
    if (x->world) FM_TRY(fm_comm_allreduce_sum_i64(x->world, &rc, 1, 0)); /* rank 0's verdict: every rank stops */
    if (rc != 0)
        return fm_error(FM_ERR_IO, "flatmoe_export_weights: the callback returned %lld at bucket %lld (counted from 0; "
                        "%d pieces); the export stopped there: the consumer has only part of the weights", (long long)rc,
                        (long long)x->bucket, x->n_pieces);
    x->bucket++;
    x->used = 0;
    x->n_pieces = 0;
    return FM_OK;
}

/* Elements [a, a + n) of tensor t into the bucket at x->used, through the staging in pieces of at
 * most the staging's length, narrowed to bf16; one piece entry. */
static fm_status put_piece(exporter *x, const fm_named_tensor *t, int64_t numel, int64_t a, int64_t n) {
    uint16_t *dst = x->buf + x->used;
    for (int64_t k = 0; k < n; k += t->stage_len) {
        const int64_t c = n - k < t->stage_len ? n - k : t->stage_len;
        FM_TRY(t->fetch_range(t->fetch_ctx, a + k, c, t->stage));
        for (int64_t j = 0; j < c; j++) dst[k + j] = fm_f32_to_bf16(t->stage[j]);
    }
    flatmoe_weight_piece *p = &x->pieces[x->n_pieces++];
    memset(p, 0, sizeof *p);
    p->name = t->name;
    p->dtype = FLATMOE_DTYPE_BF16;
    p->ndim = t->ndim;
    p->shape[0] = t->shape[0];
    p->shape[1] = t->ndim > 1 ? t->shape[1] : 0;
    p->tensor_bytes = 2 * numel;
    p->offset = 2 * a;
    p->nbytes = 2 * n;
    p->data = dst;
    x->used += n;
    return FM_OK;
}

static int64_t numel_of(const fm_named_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

/* Every tensor of the model file, in order, bucket by bucket (the filling rule of flatmoe.h). */
static fm_status walk(exporter *x, const fm_named_tensor *ts, int n) {
    for (int i = 0; i < n; i++) {
        const int64_t numel = numel_of(&ts[i]);
        if (numel <= x->cap) { /* whole, in one bucket */
            if (x->used + numel > x->cap) FM_TRY(flush(x));
            FM_TRY(put_piece(x, &ts[i], numel, 0, numel));
            continue;
        }
        FM_TRY(flush(x)); /* larger than a bucket: full buckets of it, then its tail */
        for (int64_t a = 0; a < numel; a += x->cap) {
            const int64_t k = numel - a < x->cap ? numel - a : x->cap;
            FM_TRY(put_piece(x, &ts[i], numel, a, k));
            if (k == x->cap) FM_TRY(flush(x));
        }
    }
    return flush(x);
}

int flatmoe_export_weights(flatmoe_session *s, int64_t bucket_bytes, flatmoe_bucket_fn fn, void *user) {
    if (!s || !fn) return fm_error(FM_ERR_ARG, "flatmoe_export_weights: %s is NULL", s ? "fn" : "the session");
    if (bucket_bytes < 2)
        return fm_error(FM_ERR_ARG, "flatmoe_export_weights: bucket_bytes is %lld; a bucket must hold at least one "
                        "bf16 element (2 bytes); give the inference engine's bucket size (e.g. 512 MiB)",
                        (long long)bucket_bytes);
    FM_TRY(fm_capi_awake(s, "flatmoe_export_weights"));
    run *r = &s->r;
    fm_step_ws_flush(&r->step, &r->m); /* an overlapped update still in flight lands first */
    fm_optim_state os[3];
    const int nos = r->optim->state_tensors(r->opt_self, os, 3);
    int slots;
    FM_TRY(fm_ckpt_stream_prepare(r, os, nos, &slots)); /* r->named[0, n): the model file's tensors */
    const int n = r->cst.n_full; /* the checkpoint table's tensors */
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += numel_of(&r->named[i]);
    exporter x = {0};
    x.cap = bucket_bytes / 2 < total ? bucket_bytes / 2 : total;
    x.fn = fn;
    x.user = user;
    x.world = r->n_ranks > 1 ? &r->world : NULL; /* the staging's reads are collectives (rank 0 gets the values) */
    x.rank = r->rank;
    x.buf = fm_malloc(2 * (size_t)x.cap);
    x.pieces = fm_malloc(sizeof *x.pieces * (size_t)(n > 0 ? n : 1));
    fm_status st = FM_OK;
    if (!x.buf || !x.pieces)
        st = fm_error(FM_ERR_NOMEM, "flatmoe_export_weights: cannot allocate the bucket (%lld bytes) and its table of "
                      "%d pieces; give a smaller bucket_bytes", (long long)(2 * x.cap), n);
    if (st == FM_OK) st = walk(&x, r->named, n);
    fm_free(x.buf);
    fm_free(x.pieces);
    return st;
}
