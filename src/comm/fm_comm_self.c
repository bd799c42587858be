/* The one-rank communicator (fm_comm.h, fm_comm_self_create): rank 0 of 1. Every collective
 * checks its arguments by the table's contract, as a multi-rank implementation would, and then
 * is the identity or one copy (memmove on host memory, the backend's D2D copy on backend
 * memory). It never waits, so it never times out. */
#include "fm_comm.h"

#include "../backend/fm_backend.h"

typedef struct self_ctx {
    fm_backend be; /* be.ops NULL: host memory */
    double default_timeout;
} self_ctx;

static int self_rank(void *ctx) { (void)ctx; return 0; }
static int self_size(void *ctx) { (void)ctx; return 1; }
static bool self_mem_is_host(void *ctx) { return ((self_ctx *)ctx)->be.ops == NULL; }
static double self_default_timeout(void *ctx) { return ((self_ctx *)ctx)->default_timeout; }

/* dst[0..bytes) = src[0..bytes) in the communicator's memory (nothing when dst == src). */
static void self_copy(const self_ctx *s, void *dst, const void *src, size_t bytes) {
    if (bytes == 0 || dst == src) return;
    if (s->be.ops) s->be.ops->copy(s->be.ctx, dst, src, bytes, FM_COPY_D2D);
    else memmove(dst, src, bytes);
}

/* The checks every collective starts with: timeout, types, then the description `what`. */
#define SELF_BEGIN(name, dtype, op, count)                                                             \
    self_ctx *s = ctx;                                                                                 \
    char what[128];                                                                                    \
    fm_comm_describe(what, sizeof what, (name), (dtype), (op), (count));                               \
    double eff_timeout;                                                                                \
    FM_TRY(fm_comm_check_timeout(0, 1, what, timeout_s, s->default_timeout, &eff_timeout));            \
    (void)eff_timeout;                                                                                 \
    FM_TRY(fm_comm_check_type(0, 1, what, (dtype), (op)))

/* send -> recv of count elements: in place (send == recv) or disjoint. */
static fm_status copy_or_in_place(const self_ctx *s, const char *what, const void *send, void *recv, int64_t count,
                                  fm_comm_dtype dtype) {
    FM_TRY(fm_comm_check_buf(0, 1, what, "send", send, count));
    FM_TRY(fm_comm_check_buf(0, 1, what, "recv", recv, count));
    const size_t bytes = (size_t)count * fm_comm_dtype_size(dtype);
    if (send != recv) FM_TRY(fm_comm_check_disjoint(0, 1, what, "send", send, bytes, "recv", recv, bytes));
    self_copy(s, recv, send, bytes);
    return FM_OK;
}

static fm_status self_all_reduce(void *ctx, const void *send, void *recv, int64_t count, fm_comm_dtype dtype,
                                 fm_comm_op op, double timeout_s) {
    SELF_BEGIN("all_reduce", dtype, (int)op, count);
    return copy_or_in_place(s, what, send, recv, count, dtype);
}

static fm_status self_all_reduce_host(void *ctx, void *buf, int64_t count, fm_comm_dtype dtype, fm_comm_op op,
                                      double timeout_s) {
    SELF_BEGIN("all_reduce_host", dtype, (int)op, count);
    FM_TRY(fm_comm_check_buf(0, 1, what, "host", buf, count));
    if (count > FM_COMM_HOST_MAX_ELEMS)
        return fm_error(FM_ERR_ARG, "rank 0 of 1: %s: at most %d elements per call (FM_COMM_HOST_MAX_ELEMS)", what,
                        FM_COMM_HOST_MAX_ELEMS);
    return FM_OK; /* the sum or max over one rank is the value itself */
}

static fm_status self_reduce_scatter(void *ctx, const void *send, void *recv, int64_t recv_count,
                                     fm_comm_dtype dtype, fm_comm_op op, double timeout_s) {
    SELF_BEGIN("reduce_scatter", dtype, (int)op, recv_count);
    /* send holds size * recv_count = recv_count elements; rank 0's block starts at send + 0, so
     * the in-place form recv == send + rank * recv_count is recv == send. */
    return copy_or_in_place(s, what, send, recv, recv_count, dtype);
}

static fm_status self_all_gather(void *ctx, const void *send, void *recv, int64_t send_count, fm_comm_dtype dtype,
                                 double timeout_s) {
    SELF_BEGIN("all_gather", dtype, -1, send_count);
    /* recv holds size * send_count = send_count elements; in place: send == recv + 0. */
    return copy_or_in_place(s, what, send, recv, send_count, dtype);
}

static fm_status self_all_to_all_v(void *ctx, const void *send, const int64_t *send_counts,
                                   const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                   const int64_t *recv_displs, fm_comm_dtype dtype, double timeout_s) {
    SELF_BEGIN("all_to_all_v", dtype, -1, -1);
    if (!send_counts || !send_displs || !recv_counts || !recv_displs)
        return fm_error(FM_ERR_ARG, "rank 0 of 1: %s: send_counts, send_displs, recv_counts and recv_displs must be "
                        "host arrays of 1 element (the communicator's size), found %s NULL", what,
                        !send_counts ? "send_counts" : !send_displs ? "send_displs" : !recv_counts ? "recv_counts"
                                                                                                     : "recv_displs");
    const int64_t sc = send_counts[0], rc = recv_counts[0], sd = send_displs[0], rd = recv_displs[0];
    if (sc < 0 || rc < 0)
        return fm_error(FM_ERR_ARG, "rank 0 of 1: %s: %s[0] = %lld is negative", what,
                        sc < 0 ? "send_counts" : "recv_counts", (long long)(sc < 0 ? sc : rc));
    if (sd < 0 || rd < 0)
        return fm_error(FM_ERR_ARG, "rank 0 of 1: %s: %s[0] = %lld is negative", what,
                        sd < 0 ? "send_displs" : "recv_displs", (long long)(sd < 0 ? sd : rd));
    if (sc != rc)
        return fm_error(FM_ERR_ARG, "rank 0 of 1: %s: rank 0 sends %lld elements to itself (send_counts[0]) but "
                        "expects %lld from itself (recv_counts[0]); they must be equal", what, (long long)sc,
                        (long long)rc);
    FM_TRY(fm_comm_check_buf(0, 1, what, "send", send, sc));
    FM_TRY(fm_comm_check_buf(0, 1, what, "recv", recv, rc));
    const size_t es = fm_comm_dtype_size(dtype), bytes = (size_t)sc * es;
    if (bytes == 0) return FM_OK;
    const char *src = (const char *)send + (size_t)sd * es;
    char *dst = (char *)recv + (size_t)rd * es;
    FM_TRY(fm_comm_check_disjoint(0, 1, what, "send block", src, bytes, "recv block", dst, bytes));
    self_copy(s, dst, src, bytes);
    return FM_OK;
}

static fm_status self_broadcast(void *ctx, const void *send, void *recv, int64_t count, fm_comm_dtype dtype, int root,
                                double timeout_s) {
    SELF_BEGIN("broadcast", dtype, -1, count);
    if (root != 0)
        return fm_error(FM_ERR_ARG, "rank 0 of 1: %s: root %d is not a rank (expected 0)", what, root);
    return copy_or_in_place(s, what, send, recv, count, dtype);
}

static fm_status self_barrier(void *ctx, double timeout_s) {
    self_ctx *s = ctx;
    double eff;
    return fm_comm_check_timeout(0, 1, "barrier()", timeout_s, s->default_timeout, &eff);
}

static void self_destroy(void *ctx) { fm_free(ctx); }

static fm_status self_split(void *ctx, int color, int key, fm_comm *out);

static const fm_comm_ops self_ops = {
    .name = "self",
    .rank = self_rank,
    .size = self_size,
    .mem_is_host = self_mem_is_host,
    .default_timeout = self_default_timeout,
    .all_reduce = self_all_reduce,
    .all_reduce_host = self_all_reduce_host,
    .reduce_scatter = self_reduce_scatter,
    .all_gather = self_all_gather,
    .all_to_all_v = self_all_to_all_v,
    .broadcast = self_broadcast,
    .barrier = self_barrier,
    .split = self_split,
    .destroy = self_destroy,
};

static fm_status self_new(fm_comm *out, const fm_backend *be, double default_timeout_s) {
    self_ctx *s = fm_malloc(sizeof *s);
    if (!s) return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the self communicator");
    if (be) s->be = *be;
    s->default_timeout = default_timeout_s;
    out->ops = &self_ops;
    out->ctx = s;
    return FM_OK;
}

static fm_status self_split(void *ctx, int color, int key, fm_comm *out) {
    (void)key;
    self_ctx *s = ctx;
    if (!out) return fm_error(FM_ERR_ARG, "rank 0 of 1: split: out is NULL");
    out->ops = NULL;
    out->ctx = NULL;
    if (color < 0) return fm_error(FM_ERR_ARG, "rank 0 of 1: split(color %d): color must be >= 0", color);
    return self_new(out, s->be.ops ? &s->be : NULL, s->default_timeout);
}

fm_status fm_comm_self_create(fm_comm *out, const fm_backend *be, double default_timeout_s) {
    if (!out) return fm_error(FM_ERR_ARG, "fm_comm_self_create: out is NULL");
    out->ops = NULL;
    out->ctx = NULL;
    if (!(default_timeout_s >= 0))
        return fm_error(FM_ERR_ARG, "fm_comm_self_create: default timeout %g s must be >= 0 (0: %g s)",
                        default_timeout_s, FM_COMM_DEFAULT_TIMEOUT_S);
    if (be && (!be->ops || !be->ops->copy))
        return fm_error(FM_ERR_ARG, "fm_comm_self_create: the backend has no copy op");
    return self_new(out, be, default_timeout_s == 0 ? FM_COMM_DEFAULT_TIMEOUT_S : default_timeout_s);
}
