/* The MPI communicator (fm_comm.h, fm_comm_mpi_world): one process per rank, over a duplicate of
 * MPI_COMM_WORLD and its splits. Every collective checks its arguments by the table's contract
 * (the same checks and messages as the self communicator, so a misuse fails on every rank before
 * anything is sent), posts the nonblocking MPI form and polls it against the timeout. Memory:
 * host (or host-backed backend) buffers go to MPI directly; other backend memory is staged
 * through two host buffers fixed at creation, in chunks (fm_comm.h says how).
 * Sources: MPI 4.0 (the nonblocking collectives of §5.12, MPI_Comm_split §6.4, error handlers
 * §9.3); the in-place conventions are NCCL's (fm_comm.h). Without MPI (FM_HAVE_MPI undefined) the
 * file gives the functions that say so. */
#include "fm_comm.h"

#include "../backend/fm_backend.h"

#ifndef FM_HAVE_MPI

bool fm_comm_mpi_built(void) { return false; }
fm_status fm_comm_mpi_world(fm_comm *out, const fm_backend *be, double default_timeout_s, size_t stage_bytes) {
    (void)be, (void)default_timeout_s, (void)stage_bytes;
    if (out) out->ops = NULL, out->ctx = NULL;
    return fm_error(FM_ERR_UNSUPPORTED, "the MPI communicator is not in this build (CMake found no MPI: install "
                    "libopenmpi-dev and openmpi-bin, then configure again)");
}
fm_status fm_comm_mpi_finalize(void) { return FM_OK; }
void fm_comm_mpi_abort(int code) { (void)code; }
fm_status fm_comm_mpi_local(int *local_rank, int *local_size) {
    *local_rank = 0, *local_size = 1;
    return fm_error(FM_ERR_UNSUPPORTED, "the node-local rank needs MPI, which is not in this build (install "
                    "libopenmpi-dev and openmpi-bin, then configure again)");
}

#else

#include <limits.h>
#include <stdio.h>
#include <mpi.h>
#include <time.h>

typedef struct mpi_ctx {
    MPI_Comm comm;
    int rank, size;
    fm_backend be;       /* be.ops NULL: host memory */
    bool staged;         /* be's memory is not host memory: stage through sa/sb */
    bool broken;         /* a collective timed out or failed: its request may still be pending */
    double default_timeout;
    size_t stage_bytes;  /* bytes of sa and of sb (staged, or in-place reduce_scatter) */
    unsigned char *sa, *sb;
    int *ic[4];          /* all_to_all_v's int counts and displacements [size] each */
} mpi_ctx;

static MPI_Datatype mpi_type(fm_comm_dtype t) {
    switch (t) {
    case FM_COMM_F32: return MPI_FLOAT;
    case FM_COMM_F64: return MPI_DOUBLE;
    case FM_COMM_I64: return MPI_INT64_T;
    case FM_COMM_BF16: return MPI_UINT16_T; /* moved, never reduced */
    default: return MPI_BYTE;
    }
}
/* bf16 reductions: MPI has no bf16 type, so they are user operations on MPI_UINT16_T elements,
 * created once MPI is initialized (fm_comm_mpi_world) and freed by fm_comm_mpi_finalize. Each
 * combination of two partial results widens both to fp32, adds (or takes the max) and rounds
 * to nearest even: a sum over W ranks is rounded W - 1 times in MPI's order (NCCL rounds once
 * per element), so bf16 sums here are for tests; exact when the partial sums are bf16 values. */
static MPI_Op bf16_sum_op = MPI_OP_NULL, bf16_max_op = MPI_OP_NULL;

static void bf16_sum_fn(void *in, void *inout, int *len, MPI_Datatype *dt) {
    (void)dt;
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++) b[i] = fm_f32_to_bf16(fm_bf16_to_f32(a[i]) + fm_bf16_to_f32(b[i]));
}
static void bf16_max_fn(void *in, void *inout, int *len, MPI_Datatype *dt) {
    (void)dt;
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++)
        if (fm_bf16_to_f32(a[i]) > fm_bf16_to_f32(b[i])) b[i] = a[i];
}

static MPI_Op mpi_op_for(fm_comm_op op, fm_comm_dtype t) {
    if (t == FM_COMM_BF16) return op == FM_COMM_MAX ? bf16_max_op : bf16_sum_op;
    return op == FM_COMM_MAX ? MPI_MAX : MPI_SUM;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* FM_ERR_IO naming the MPI call and MPI's text for rc; marks the communicator broken. */
static fm_status mpi_fail(mpi_ctx *m, const char *what, const char *call, int rc) {
    char text[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "MPI error %d", rc);
    m->broken = true;
    return fm_error(FM_ERR_IO, "rank %d of %d: %s: %s failed: %s", m->rank, m->size, what, call, text);
}

/* Polls *req until it completes or timeout_s passes: MPI_Test without sleeping for the first
 * ~100 us (small collectives finish there), then with sleeps growing to 1 ms. */
static fm_status mpi_wait(mpi_ctx *m, MPI_Request *req, const char *what, double timeout_s) {
    const double t0 = now_s();
    for (long polls = 0;; polls++) {
        int done = 0;
        const int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(m, what, "MPI_Test", rc);
        if (done) return FM_OK;
        const double el = now_s() - t0;
        if (el >= timeout_s) {
            m->broken = true;
            return fm_error(FM_ERR_IO, "rank %d of %d: %s timed out after %g s (another rank did not join it or "
                            "died; the request is abandoned: stop the job, e.g. fm_comm_mpi_abort)", m->rank, m->size,
                            what, timeout_s);
        }
        if (el > 1e-4) {
            double sl = el / 64 < 1e-3 ? el / 64 : 1e-3;
            if (sl < 2e-5) sl = 2e-5;
            const struct timespec ts = {0, (long)(sl * 1e9)};
            nanosleep(&ts, NULL);
        }
    }
}

/* Posts a request with `post` (an MPI_I* call's return code) and waits for it. */
#define MPI_RUN(m, what, to, call_name, post)                                     \
    do {                                                                          \
        MPI_Request req_ = MPI_REQUEST_NULL;                                      \
        const int rc_ = (post);                                                   \
        if (rc_ != MPI_SUCCESS) return mpi_fail((m), (what), (call_name), rc_);   \
        FM_TRY(mpi_wait((m), &req_, (what), (to)));                               \
    } while (0)

/* dst <- src, bytes, between host memory and the communicator's memory (kind as fm_copy_kind). */
static void xcopy(const mpi_ctx *m, void *dst, const void *src, size_t bytes, fm_copy_kind kind) {
    if (bytes == 0 || dst == src) return;
    if (m->staged) m->be.ops->copy(m->be.ctx, dst, src, bytes, kind);
    else memmove(dst, src, bytes);
}

/* The checks every collective starts with (timeout, types, a broken communicator), then `what`. */
#define MPI_BEGIN(name, dtype, op, count)                                                              \
    mpi_ctx *m = ctx;                                                                                  \
    char what[128];                                                                                    \
    fm_comm_describe(what, sizeof what, (name), (dtype), (op), (count));                               \
    double to;                                                                                         \
    FM_TRY(fm_comm_check_timeout(m->rank, m->size, what, timeout_s, m->default_timeout, &to));         \
    FM_TRY(fm_comm_check_type(m->rank, m->size, what, (dtype), (op)));                                 \
    if (m->broken)                                                                                     \
        return fm_error(FM_ERR_IO, "rank %d of %d: %s: an earlier collective on this communicator "    \
                        "failed or timed out; the job must stop", m->rank, m->size, what)

static fm_status check_reducible(const mpi_ctx *m, const char *what, fm_comm_dtype t) {
    if (t == FM_COMM_BF16 && (bf16_sum_op == MPI_OP_NULL || bf16_max_op == MPI_OP_NULL))
        return fm_error(FM_ERR_UNSUPPORTED, "rank %d of %d: %s: the bf16 reduction operations were not created "
                        "(MPI_Op_create failed at fm_comm_mpi_world)", m->rank, m->size, what);
    return FM_OK;
}

static fm_status check_int(const mpi_ctx *m, const char *what, const char *name, int64_t v) {
    if (v > INT_MAX)
        return fm_error(FM_ERR_ARG, "rank %d of %d: %s: %s %lld does not fit MPI's int count (at most %d); split "
                        "the collective", m->rank, m->size, what, name, (long long)v, INT_MAX);
    return FM_OK;
}

/* Elements of size es per chunk when `per` chunk-sized blocks share one staging buffer. */
static int64_t chunk_elems(const mpi_ctx *m, size_t es, int per) {
    const int64_t k = (int64_t)(m->stage_bytes / (es * (size_t)per)), lim = INT_MAX / per; /* q * k fits int */
    return k > lim ? lim : k;
}

/* ---- collectives ------------------------------------------------------------------------------ */

static int mpi_rank(void *ctx) { return ((mpi_ctx *)ctx)->rank; }
static int mpi_size(void *ctx) { return ((mpi_ctx *)ctx)->size; }
static bool mpi_mem_is_host(void *ctx) { return ((mpi_ctx *)ctx)->be.ops == NULL; }
static double mpi_default_timeout(void *ctx) { return ((mpi_ctx *)ctx)->default_timeout; }

static fm_status mpi_all_reduce(void *ctx, const void *send, void *recv, int64_t count, fm_comm_dtype dtype,
                                fm_comm_op op, double timeout_s) {
    MPI_BEGIN("all_reduce", dtype, (int)op, count);
    FM_TRY(fm_comm_check_buf(m->rank, m->size, what, "send", send, count));
    FM_TRY(fm_comm_check_buf(m->rank, m->size, what, "recv", recv, count));
    FM_TRY(check_reducible(m, what, dtype));
    const size_t es = fm_comm_dtype_size(dtype);
    if (send != recv)
        FM_TRY(fm_comm_check_disjoint(m->rank, m->size, what, "send", send, (size_t)count * es, "recv", recv,
                                      (size_t)count * es));
    if (count == 0) return FM_OK; /* every rank has count 0: nothing to agree on */
    if (!m->staged) {
        FM_TRY(check_int(m, what, "count", count));
        MPI_RUN(m, what, to, "MPI_Iallreduce",
                MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, (int)count, mpi_type(dtype), mpi_op_for(op, dtype),
                               m->comm, &req_));
        return FM_OK;
    }
    const int64_t k = chunk_elems(m, es, 1);
    for (int64_t o = 0; o < count; o += k) {
        const int64_t n = count - o < k ? count - o : k;
        xcopy(m, m->sa, (const char *)send + (size_t)o * es, (size_t)n * es, FM_COPY_D2H);
        MPI_RUN(m, what, to, "MPI_Iallreduce",
                MPI_Iallreduce(MPI_IN_PLACE, m->sa, (int)n, mpi_type(dtype), mpi_op_for(op, dtype), m->comm, &req_));
        xcopy(m, (char *)recv + (size_t)o * es, m->sa, (size_t)n * es, FM_COPY_H2D);
    }
    return FM_OK;
}

static fm_status mpi_all_reduce_host(void *ctx, void *buf, int64_t count, fm_comm_dtype dtype, fm_comm_op op,
                                     double timeout_s) {
    MPI_BEGIN("all_reduce_host", dtype, (int)op, count);
    FM_TRY(fm_comm_check_buf(m->rank, m->size, what, "host", buf, count));
    if (count > FM_COMM_HOST_MAX_ELEMS)
        return fm_error(FM_ERR_ARG, "rank %d of %d: %s: at most %d elements per call (FM_COMM_HOST_MAX_ELEMS)",
                        m->rank, m->size, what, FM_COMM_HOST_MAX_ELEMS);
    FM_TRY(check_reducible(m, what, dtype));
    if (count == 0) return FM_OK;
    MPI_RUN(m, what, to, "MPI_Iallreduce",
            MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, mpi_type(dtype), mpi_op_for(op, dtype), m->comm, &req_));
    return FM_OK;
}

static fm_status mpi_reduce_scatter(void *ctx, const void *send, void *recv, int64_t recv_count,
                                    fm_comm_dtype dtype, fm_comm_op op, double timeout_s) {
    MPI_BEGIN("reduce_scatter", dtype, (int)op, recv_count);
    const int W = m->size;
    FM_TRY(fm_comm_check_buf(m->rank, W, what, "send", send, recv_count));
    FM_TRY(fm_comm_check_buf(m->rank, W, what, "recv", recv, recv_count));
    FM_TRY(check_reducible(m, what, dtype));
    bool in_place;
    FM_TRY(fm_comm_check_blocks(m->rank, W, "", what, send, recv, recv_count, dtype, true, &in_place));
    const size_t es = fm_comm_dtype_size(dtype), rb = (size_t)recv_count * es;
    if (recv_count == 0) return FM_OK;
    if (!m->staged && !in_place) {
        FM_TRY(check_int(m, what, "recv_count", recv_count));
        MPI_RUN(m, what, to, "MPI_Ireduce_scatter_block",
                MPI_Ireduce_scatter_block(send, recv, (int)recv_count, mpi_type(dtype), mpi_op_for(op, dtype), m->comm, &req_));
        return FM_OK;
    }
    /* staged (or in place): blocks [o, o + n) of every rank's part gathered into sa, reduced into sb */
    const int64_t k = chunk_elems(m, es, W);
    for (int64_t o = 0; o < recv_count; o += k) {
        const int64_t n = recv_count - o < k ? recv_count - o : k;
        for (int q = 0; q < W; q++)
            xcopy(m, m->sa + (size_t)q * (size_t)n * es, (const char *)send + (size_t)q * rb + (size_t)o * es,
                  (size_t)n * es, FM_COPY_D2H);
        MPI_RUN(m, what, to, "MPI_Ireduce_scatter_block",
                MPI_Ireduce_scatter_block(m->sa, m->sb, (int)n, mpi_type(dtype), mpi_op_for(op, dtype), m->comm, &req_));
        xcopy(m, (char *)recv + (size_t)o * es, m->sb, (size_t)n * es, FM_COPY_H2D);
    }
    return FM_OK;
}

static fm_status mpi_all_gather(void *ctx, const void *send, void *recv, int64_t send_count, fm_comm_dtype dtype,
                                double timeout_s) {
    MPI_BEGIN("all_gather", dtype, -1, send_count);
    const int W = m->size;
    FM_TRY(fm_comm_check_buf(m->rank, W, what, "send", send, send_count));
    FM_TRY(fm_comm_check_buf(m->rank, W, what, "recv", recv, send_count));
    bool in_place;
    FM_TRY(fm_comm_check_blocks(m->rank, W, "", what, send, recv, send_count, dtype, false, &in_place));
    const size_t es = fm_comm_dtype_size(dtype), sb = (size_t)send_count * es;
    if (send_count == 0) return FM_OK;
    if (!m->staged) {
        FM_TRY(check_int(m, what, "send_count", send_count));
        /* MPI's in-place all-gather reads this rank's block from recv + rank * send_count: ours */
        MPI_RUN(m, what, to, "MPI_Iallgather",
                MPI_Iallgather(in_place ? MPI_IN_PLACE : send, (int)send_count, mpi_type(dtype), recv,
                               (int)send_count, mpi_type(dtype), m->comm, &req_));
        return FM_OK;
    }
    const int64_t k = chunk_elems(m, es, W);
    for (int64_t o = 0; o < send_count; o += k) {
        const int64_t n = send_count - o < k ? send_count - o : k;
        xcopy(m, m->sa, (const char *)send + (size_t)o * es, (size_t)n * es, FM_COPY_D2H);
        MPI_RUN(m, what, to, "MPI_Iallgather",
                MPI_Iallgather(m->sa, (int)n, mpi_type(dtype), m->sb, (int)n, mpi_type(dtype), m->comm, &req_));
        for (int q = 0; q < W; q++)
            xcopy(m, (char *)recv + (size_t)q * sb + (size_t)o * es, m->sb + (size_t)q * (size_t)n * es,
                  (size_t)n * es, FM_COPY_H2D);
    }
    return FM_OK;
}

static fm_status mpi_all_to_all_v(void *ctx, const void *send, const int64_t *send_counts,
                                  const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                  const int64_t *recv_displs, fm_comm_dtype dtype, double timeout_s) {
    MPI_BEGIN("all_to_all_v", dtype, -1, -1);
    const int W = m->size, r = m->rank;
    int64_t total[2], biggest;
    FM_TRY(fm_comm_check_all_to_all_v(r, W, "", what, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                                      dtype, total, &biggest));
    const int64_t *arr[4] = {send_counts, send_displs, recv_counts, recv_displs};
    static const char *const names[4] = {"send_counts", "send_displs", "recv_counts", "recv_displs"};
    if (!m->staged) /* MPI's own counts and displacements are int */
        for (int a = 0; a < 4; a++)
            for (int q = 0; q < W; q++) {
                char nm[48];
                snprintf(nm, sizeof nm, "%s[%d] =", names[a], q);
                FM_TRY(check_int(m, what, nm, arr[a][q]));
            }
    const size_t es = fm_comm_dtype_size(dtype);
    if (!m->staged) {
        for (int a = 0; a < 4; a++)
            for (int q = 0; q < W; q++) m->ic[a][q] = (int)arr[a][q];
        MPI_RUN(m, what, to, "MPI_Ialltoallv",
                MPI_Ialltoallv(total[0] ? send : m->ic[0], m->ic[0], m->ic[1], mpi_type(dtype),
                               total[1] ? recv : m->ic[2], m->ic[2], m->ic[3], mpi_type(dtype), m->comm, &req_));
        return FM_OK;
    }
    /* staged: rounds of at most k elements per pair; every rank needs the same number of rounds,
     * so the largest block over all ranks is agreed first */
    MPI_RUN(m, what, to, "MPI_Iallreduce",
            MPI_Iallreduce(MPI_IN_PLACE, &biggest, 1, MPI_INT64_T, MPI_MAX, m->comm, &req_));
    const int64_t k = chunk_elems(m, es, W);
    for (int64_t o = 0; o < biggest; o += k) {
        for (int q = 0; q < W; q++) {
            const int64_t sn = send_counts[q] - o <= 0 ? 0 : send_counts[q] - o < k ? send_counts[q] - o : k;
            const int64_t rn = recv_counts[q] - o <= 0 ? 0 : recv_counts[q] - o < k ? recv_counts[q] - o : k;
            m->ic[0][q] = (int)sn, m->ic[1][q] = (int)(q * k), m->ic[2][q] = (int)rn, m->ic[3][q] = (int)(q * k);
            xcopy(m, m->sa + (size_t)(q * k) * es, (const char *)send + (size_t)(send_displs[q] + o) * es,
                  (size_t)sn * es, FM_COPY_D2H);
        }
        MPI_RUN(m, what, to, "MPI_Ialltoallv",
                MPI_Ialltoallv(m->sa, m->ic[0], m->ic[1], mpi_type(dtype), m->sb, m->ic[2], m->ic[3], mpi_type(dtype),
                               m->comm, &req_));
        for (int q = 0; q < W; q++)
            xcopy(m, (char *)recv + (size_t)(recv_displs[q] + o) * es, m->sb + (size_t)(q * k) * es,
                  (size_t)m->ic[2][q] * es, FM_COPY_H2D);
    }
    return FM_OK;
}

static fm_status mpi_broadcast(void *ctx, const void *send, void *recv, int64_t count, fm_comm_dtype dtype, int root,
                               double timeout_s) {
    MPI_BEGIN("broadcast", dtype, -1, count);
    const int W = m->size, r = m->rank;
    if (root < 0 || root >= W)
        return fm_error(FM_ERR_ARG, "rank %d of %d: %s: root %d is not a rank (expected 0..%d)", r, W, what, root,
                        W - 1);
    if (r == root) FM_TRY(fm_comm_check_buf(r, W, what, "send", send, count));
    FM_TRY(fm_comm_check_buf(r, W, what, "recv", recv, count));
    const size_t es = fm_comm_dtype_size(dtype), bytes = (size_t)count * es;
    if (r == root && send != recv) FM_TRY(fm_comm_check_disjoint(r, W, what, "send", send, bytes, "recv", recv, bytes));
    if (count == 0) return FM_OK;
    if (!m->staged) {
        FM_TRY(check_int(m, what, "count", count));
        if (r == root) memcpy(recv, send, bytes * (send != recv));
        MPI_RUN(m, what, to, "MPI_Ibcast", MPI_Ibcast(recv, (int)count, mpi_type(dtype), root, m->comm, &req_));
        return FM_OK;
    }
    const int64_t k = chunk_elems(m, es, 1);
    for (int64_t o = 0; o < count; o += k) {
        const int64_t n = count - o < k ? count - o : k;
        if (r == root) xcopy(m, m->sa, (const char *)send + (size_t)o * es, (size_t)n * es, FM_COPY_D2H);
        MPI_RUN(m, what, to, "MPI_Ibcast", MPI_Ibcast(m->sa, (int)n, mpi_type(dtype), root, m->comm, &req_));
        xcopy(m, (char *)recv + (size_t)o * es, m->sa, (size_t)n * es, FM_COPY_H2D);
    }
    return FM_OK;
}

static fm_status mpi_barrier(void *ctx, double timeout_s) {
    mpi_ctx *m = ctx;
    double to;
    FM_TRY(fm_comm_check_timeout(m->rank, m->size, "barrier()", timeout_s, m->default_timeout, &to));
    if (m->broken)
        return fm_error(FM_ERR_IO, "rank %d of %d: barrier(): an earlier collective on this communicator failed or "
                        "timed out; the job must stop", m->rank, m->size);
    MPI_RUN(m, "barrier()", to, "MPI_Ibarrier", MPI_Ibarrier(m->comm, &req_));
    return FM_OK;
}

/* ---- creation, split, destruction ------------------------------------------------------------- */

static void mpi_destroy(void *ctx) {
    mpi_ctx *m = ctx;
    if (!m) return;
    if (m->broken) return; /* a request may still write sa/sb or use comm: leak them (fm_comm.h) */
    if (m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
    fm_free(m->sa), fm_free(m->sb);
    for (int a = 0; a < 4; a++) fm_free(m->ic[a]);
    fm_free(m);
}

static fm_status mpi_split(void *ctx, int color, int key, fm_comm *out);

static const fm_comm_ops mpi_ops = {
    .name = "mpi",
    .rank = mpi_rank,
    .size = mpi_size,
    .mem_is_host = mpi_mem_is_host,
    .default_timeout = mpi_default_timeout,
    .all_reduce = mpi_all_reduce,
    .all_reduce_host = mpi_all_reduce_host,
    .reduce_scatter = mpi_reduce_scatter,
    .all_gather = mpi_all_gather,
    .all_to_all_v = mpi_all_to_all_v,
    .broadcast = mpi_broadcast,
    .barrier = mpi_barrier,
    .split = mpi_split,
    .destroy = mpi_destroy,
};

/* A context over `comm` (taken over: freed on error). */
static fm_status mpi_new(fm_comm *out, MPI_Comm comm, const fm_backend *be, double default_timeout, size_t stage) {
    mpi_ctx *m = fm_malloc(sizeof *m);
    if (!m) {
        MPI_Comm_free(&comm);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the mpi communicator");
    }
    memset(m, 0, sizeof *m);
    m->comm = comm;
    MPI_Comm_rank(comm, &m->rank);
    MPI_Comm_size(comm, &m->size);
    int rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) {
        const fm_status st = mpi_fail(m, "create", "MPI_Comm_set_errhandler", rc);
        m->broken = false;
        mpi_destroy(m);
        return st;
    }
    if (be) m->be = *be;
    m->staged = be && !be->ops->host_memory;
    m->default_timeout = default_timeout;
    m->stage_bytes = stage;
    if (stage < (size_t)8 * (size_t)m->size) {
        const int size = m->size; /* read before mpi_destroy frees m */
        mpi_destroy(m);
        return fm_error(FM_ERR_ARG, "mpi communicator: staging buffers of %zu bytes are too small for %d ranks (at "
                        "least 8 bytes per rank)", stage, size);
    }
    /* staging buffers: always (in-place reduce_scatter on host memory uses them too) */
    m->sa = fm_malloc(stage), m->sb = fm_malloc(stage);
    bool ok = m->sa && m->sb;
    for (int a = 0; a < 4; a++) ok &= (m->ic[a] = fm_malloc(sizeof(int) * (size_t)m->size)) != NULL;
    if (!ok) {
        mpi_destroy(m);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the mpi communicator's buffers (2 x %zu bytes)",
                        stage);
    }
    out->ops = &mpi_ops;
    out->ctx = m;
    return FM_OK;
}

static fm_status mpi_split(void *ctx, int color, int key, fm_comm *out) {
    mpi_ctx *m = ctx;
    if (!out) return fm_error(FM_ERR_ARG, "rank %d of %d: split: out is NULL", m->rank, m->size);
    out->ops = NULL;
    out->ctx = NULL;
    if (color < 0)
        return fm_error(FM_ERR_ARG, "rank %d of %d: split(color %d): color must be >= 0", m->rank, m->size, color);
    char what[64];
    snprintf(what, sizeof what, "split(color %d, key %d)", color, key);
    if (m->broken)
        return fm_error(FM_ERR_IO, "rank %d of %d: %s: an earlier collective on this communicator failed or timed "
                        "out; the job must stop", m->rank, m->size, what);
    MPI_Comm nc = MPI_COMM_NULL;
    const int rc = MPI_Comm_split(m->comm, color, key, &nc); /* blocking: MPI 4.0 has no split with a timeout */
    if (rc != MPI_SUCCESS) return mpi_fail(m, what, "MPI_Comm_split", rc);
    return mpi_new(out, nc, m->be.ops ? &m->be : NULL, m->default_timeout, m->stage_bytes);
}

/* MPI initialized once: MPI_Init_thread at MPI_THREAD_FUNNELED unless the process did it already.
 * `who` names the caller in the messages; check_level: a thread level below FUNNELED is refused.
 * Errors: FM_ERR_UNSUPPORTED (MPI already finalized, the thread level), FM_ERR_IO (MPI_Init_thread). */
static fm_status mpi_init(const char *who, bool check_level) {
    int inited = 0, finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return fm_error(FM_ERR_UNSUPPORTED, "%s: MPI is already finalized", who);
    MPI_Initialized(&inited);
    if (!inited) {
        int provided = 0;
        const int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
        if (rc != MPI_SUCCESS) return fm_error(FM_ERR_IO, "%s: MPI_Init_thread failed (code %d)", who, rc);
        if (check_level && provided < MPI_THREAD_FUNNELED)
            return fm_error(FM_ERR_UNSUPPORTED, "%s: MPI provides thread level %d, below MPI_THREAD_FUNNELED", who,
                            provided);
    }
    return FM_OK;
}

bool fm_comm_mpi_built(void) { return true; }

fm_status fm_comm_mpi_world(fm_comm *out, const fm_backend *be, double default_timeout_s, size_t stage_bytes) {
    if (!out) return fm_error(FM_ERR_ARG, "fm_comm_mpi_world: out is NULL");
    out->ops = NULL;
    out->ctx = NULL;
    if (!(default_timeout_s >= 0))
        return fm_error(FM_ERR_ARG, "fm_comm_mpi_world: default timeout %g s must be >= 0 (0: %g s)",
                        default_timeout_s, FM_COMM_DEFAULT_TIMEOUT_S);
    if (be && (!be->ops || !be->ops->copy))
        return fm_error(FM_ERR_ARG, "fm_comm_mpi_world: the backend has no copy op");
    FM_TRY(mpi_init("fm_comm_mpi_world", true));
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    if (bf16_sum_op == MPI_OP_NULL && MPI_Op_create(bf16_sum_fn, 1, &bf16_sum_op) != MPI_SUCCESS)
        bf16_sum_op = MPI_OP_NULL; /* bf16 reductions then fail with FM_ERR_UNSUPPORTED (check_reducible) */
    if (bf16_max_op == MPI_OP_NULL && MPI_Op_create(bf16_max_fn, 1, &bf16_max_op) != MPI_SUCCESS)
        bf16_max_op = MPI_OP_NULL;
    MPI_Comm dup = MPI_COMM_NULL;
    const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    if (rc != MPI_SUCCESS) {
        char text[MPI_MAX_ERROR_STRING] = "";
        int len = 0;
        MPI_Error_string(rc, text, &len);
        return fm_error(FM_ERR_IO, "fm_comm_mpi_world: MPI_Comm_dup failed: %s", text);
    }
    return mpi_new(out, dup, be, default_timeout_s == 0 ? FM_COMM_DEFAULT_TIMEOUT_S : default_timeout_s,
                   stage_bytes ? stage_bytes : FM_COMM_MPI_STAGE_BYTES);
}

fm_status fm_comm_mpi_local(int *local_rank, int *local_size) {
    *local_rank = 0, *local_size = 1;
    FM_TRY(mpi_init("fm_comm_mpi_local", false));
    MPI_Comm node = MPI_COMM_NULL;
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    int rc = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    if (rc != MPI_SUCCESS) return fm_error(FM_ERR_IO, "fm_comm_mpi_local: MPI_Comm_split_type failed (code %d)", rc);
    MPI_Comm_rank(node, local_rank);
    MPI_Comm_size(node, local_size);
    MPI_Comm_free(&node);
    return FM_OK;
}

fm_status fm_comm_mpi_finalize(void) {
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (!inited || finalized) return FM_OK;
    if (bf16_sum_op != MPI_OP_NULL) MPI_Op_free(&bf16_sum_op);
    if (bf16_max_op != MPI_OP_NULL) MPI_Op_free(&bf16_max_op);
    const int rc = MPI_Finalize();
    if (rc != MPI_SUCCESS) return fm_error(FM_ERR_IO, "fm_comm_mpi_finalize: MPI_Finalize failed (code %d)", rc);
    return FM_OK;
}

void fm_comm_mpi_abort(int code) {
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (inited && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
}

#endif /* FM_HAVE_MPI */
