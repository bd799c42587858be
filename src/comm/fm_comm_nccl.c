/* The NCCL communicator (fm_comm_nccl.h): GPU ranks over a non-blocking NCCL communicator, its
 * collectives issued on the CUDA backend's op stream and tracked with a ring of CUDA events, so
 * that every one of them either completes or fails by its deadline (the header says when the
 * check runs). The argument checks and messages are the self and mpi communicators' (fm_comm.c's
 * helpers), so a misuse fails the same way on every implementation. This file: the collectives and
 * the async exchanges; fm_comm_nccl_create.c: creation, split, destruction (and, without NCCL, the
 * functions that say so); fm_comm_nccl_internal.h: what the two share.
 * Sources: NCCL 2.28's API documentation (communicator creation with ncclConfig_t, non-blocking
 * communicators, ncclCommGetAsyncError/ncclCommAbort for fault tolerance, ncclCommSplit, group
 * calls of ncclSend/ncclRecv for all-to-all); CUDA's event and stream queries. */
#include "fm_comm_nccl.h"

#include "../backend/fm_backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *fm_comm_nccl_check_name(fm_comm_nccl_check c) {
    return c == FM_COMM_NCCL_CHECK_COLLECTIVE ? "collective" : c == FM_COMM_NCCL_CHECK_DEFERRED ? "deferred" : "?";
}

fm_status fm_comm_nccl_check_parse(const char *s, fm_comm_nccl_check *out) {
    if (s && !strcmp(s, "deferred")) *out = FM_COMM_NCCL_CHECK_DEFERRED;
    else if (s && !strcmp(s, "collective")) *out = FM_COMM_NCCL_CHECK_COLLECTIVE;
    else return fm_error(FM_ERR_ARG, "--comm-check \"%s\": expected deferred or collective", s ? s : "(null)");
    return FM_OK;
}

#ifdef FM_HAVE_NCCL

#include "fm_comm_nccl_internal.h"

#include <sched.h>
#include <time.h>

/* ---- time, failure ----------------------------------------------------------------------------- */

double fm_nccl_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Between polls: nothing for the first few (small collectives finish there), then sched_yield
 * (a rank's host thread has nothing else to do while it waits, and a sleep's timer slack would
 * add tens of microseconds per collective), and 1 ms sleeps once it has waited a while. */
void fm_nccl_nap(long polls) {
    if (polls < 16) return;
    if (polls < 200000) {
        sched_yield();
        return;
    }
    const struct timespec ts = {0, 1000000L};
    nanosleep(&ts, NULL);
}

/* Aborts the communicator (ncclCommAbort: NCCL's kernels on the stream exit, so later host waits
 * return) and keeps `msg` as the reason every later call reports. Returns FM_ERR_IO with it. */
fm_status fm_nccl_broke_with(nccl_ctx *n, const char *msg) {
    if (!n->broken) {
        snprintf(n->broke, sizeof n->broke, "%s", msg);
        n->broken = true;
        if (n->comm) (void)ncclCommAbort(n->comm);
        n->comm = NULL;
        n->pending = 0; /* the events may never complete now: nothing is waited for any more */
    }
    return fm_error(FM_ERR_IO, "%s", n->broke);
}

/* An NCCL call of `what` failed with r: the communicator is aborted (its state is unknown). */
fm_status fm_nccl_failed(nccl_ctx *n, const char *what, const char *call, ncclResult_t r) {
    const char *last = n->comm ? ncclGetLastError(n->comm) : NULL;
    BROKE(n, "rank %d of %d (nccl): %s: %s failed: %s%s%s%s; the communicator is aborted and the job must stop",
          n->rank, n->size, what, call, ncclGetErrorString(r), last && *last ? " (" : "", last ? last : "",
          last && *last ? ")" : "");
}

/* The host side of an NCCL call that returned r: a non-blocking communicator may answer
 * ncclInProgress while it still processes the call on the host; that is polled with
 * ncclCommGetAsyncError until it settles or timeout_s passes. */
fm_status fm_nccl_settle(nccl_ctx *n, const char *what, const char *call, ncclResult_t r, double timeout_s) {
    const double t0 = fm_nccl_now_s();
    for (long polls = 0; r == ncclInProgress; polls++) {
        ncclResult_t a = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(n->comm, &a);
        if (q != ncclSuccess) return fm_nccl_failed(n, what, "ncclCommGetAsyncError", q);
        r = a;
        if (r != ncclInProgress) break;
        if (fm_nccl_now_s() - t0 > timeout_s)
            BROKE(n, "rank %d of %d (nccl): %s: %s still in progress on the host after %g s (timeout); the "
                  "communicator is aborted and the job must stop", n->rank, n->size, what, call, timeout_s);
        fm_nccl_nap(polls);
    }
    return r == ncclSuccess ? FM_OK : fm_nccl_failed(n, what, call, r);
}

/* Pops the collectives that completed; fails on an asynchronous NCCL error or on a pending
 * collective's passed deadline. Never waits. */
fm_status fm_nccl_poll(nccl_ctx *n) {
    if (n->broken) return fm_error(FM_ERR_IO, "%s", n->broke);
    while (n->pending > 0) {
        const cudaError_t e = cudaEventQuery(n->ev[n->head]);
        if (e == cudaErrorNotReady) break;
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            BROKE(n, "rank %d of %d (nccl): %s: cudaEventQuery failed: %s; the communicator is aborted and the job "
                  "must stop", n->rank, n->size, n->what[n->head], cudaGetErrorString(e));
        }
        n->head = (n->head + 1) % PENDING;
        n->pending--;
    }
    ncclResult_t a = ncclSuccess;
    if (ncclCommGetAsyncError(n->comm, &a) == ncclSuccess && a != ncclSuccess && a != ncclInProgress) {
        const char *last = ncclGetLastError(n->comm);
        BROKE(n, "rank %d of %d (nccl): %s: NCCL reported an asynchronous error: %s%s%s%s (another rank failed or "
              "died, or the transport broke); the communicator is aborted and the job must stop", n->rank, n->size,
              n->pending ? n->what[n->head] : "after the last collective", ncclGetErrorString(a),
              last && *last ? " (" : "", last ? last : "", last && *last ? ")" : "");
    }
    /* every pending one's deadline (a later collective may have a shorter timeout than the oldest) */
    const double now = n->pending > 0 ? fm_nccl_now_s() : 0;
    for (int j = 0; j < n->pending; j++) {
        const int i = (n->head + j) % PENDING;
        if (now - n->t_enq[i] > n->tmo[i] && cudaEventQuery(n->ev[i]) == cudaErrorNotReady) /* two streams:
                                       a later one may complete before the head */
            BROKE(n, "rank %d of %d (nccl): %s did not complete within its timeout of %g s (another rank did not "
                  "join it, or died); the communicator is aborted and the job must stop", n->rank, n->size,
                  n->what[i], n->tmo[i]);
    }
    return FM_OK;
}

/* Waits until no collective is pending (or fails: fm_nccl_poll's errors). timeout_s > 0 also bounds
 * this wait as a whole. */
fm_status fm_nccl_wait_all(nccl_ctx *n, double timeout_s) {
    const double t0 = fm_nccl_now_s();
    for (long polls = 0;; polls++) {
        FM_TRY(fm_nccl_poll(n));
        if (n->pending == 0) return FM_OK;
        if (timeout_s > 0 && fm_nccl_now_s() - t0 > timeout_s)
            BROKE(n, "rank %d of %d (nccl): wait: %s did not complete within %g s (another rank did not join it, "
                  "or died); the communicator is aborted and the job must stop", n->rank, n->size,
                  n->what[n->head], timeout_s);
        fm_nccl_nap(polls);
    }
}

/* Room in the ring for one more collective: waits (under the oldest one's deadline) while full. */
static fm_status reserve(nccl_ctx *n) {
    for (long polls = 0;; polls++) {
        FM_TRY(fm_nccl_poll(n));
        if (n->pending < PENDING) return FM_OK;
        fm_nccl_nap(polls);
    }
}

/* Records the enqueued collective `what` (its event on stream s, now, its timeout), then, in the
 * COLLECTIVE mode, waits for it. */
static fm_status enqueued(nccl_ctx *n, const char *what, double timeout_s, cudaStream_t s) {
    const int i = (n->head + n->pending) % PENDING;
    const cudaError_t e = cudaEventRecord(n->ev[i], s);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        BROKE(n, "rank %d of %d (nccl): %s: cudaEventRecord failed: %s; the communicator is aborted and the job must "
              "stop", n->rank, n->size, what, cudaGetErrorString(e));
    }
    n->t_enq[i] = fm_nccl_now_s();
    n->tmo[i] = timeout_s;
    snprintf(n->what[i], sizeof n->what[i], "%s", what);
    n->pending++;
    return n->check == FM_COMM_NCCL_CHECK_COLLECTIVE ? fm_nccl_wait_all(n, 0) : FM_OK;
}

/* ---- argument checks ----------------------------------------------------------------------------- */

static ncclDataType_t nccl_type(fm_comm_dtype t) {
    switch (t) {
    case FM_COMM_F32: return ncclFloat32;
    case FM_COMM_F64: return ncclFloat64;
    case FM_COMM_I64: return ncclInt64;
    case FM_COMM_BF16: return ncclBfloat16;
    default: return ncclUint8;
    }
}
static ncclRedOp_t nccl_op(fm_comm_op op) { return op == FM_COMM_MAX ? ncclMax : ncclSum; }

/* FM_ERR_ARG unless buf (count > 0 elements) is device (or managed) memory. */
static fm_status check_device(const nccl_ctx *n, const char *what, const char *name, const void *buf, int64_t count) {
    if (count == 0 || !buf) return FM_OK;
    struct cudaPointerAttributes a;
    const cudaError_t e = cudaPointerGetAttributes(&a, buf);
    if (e != cudaSuccess) (void)cudaGetLastError();
    if (e != cudaSuccess || (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged))
        return fm_error(FM_ERR_ARG, "rank %d of %d (nccl): %s: the %s buffer %p is host memory, not the backend's "
                        "device memory (the nccl communicator's buffers are device memory; fm_comm_mem_is_host() is "
                        "false; host values go through all_reduce_host)", n->rank, n->size, what, name, buf);
    return FM_OK;
}

/* The checks every collective starts with (timeout, types, an aborted communicator), then `what`
 * and the stream `st` it is issued on. */
#define NCCL_BEGIN(name, dtype, op, count)                                                             \
    nccl_ctx *n = ctx;                                                                                 \
    char what[112];                                                                                    \
    fm_comm_describe(what, sizeof what, (name), (dtype), (op), (count));                               \
    double to;                                                                                         \
    FM_TRY(fm_comm_check_timeout(n->rank, n->size, what, timeout_s, n->default_timeout, &to));         \
    FM_TRY(fm_comm_check_type(n->rank, n->size, what, (dtype), (op)));                                 \
    if (n->broken)                                                                                     \
        return fm_error(FM_ERR_IO, "rank %d of %d (nccl): %s: an earlier failure aborted this "        \
                        "communicator (%s)", n->rank, n->size, what, n->broke);                        \
    const cudaStream_t st = (cudaStream_t)fm_cuda_backend_stream(&n->be, FM_STREAM_OPS)

/* Issues `call` (an NCCL enqueue returning ncclResult_t) after making room, settles it, records it. */
#define NCCL_RUN(n, what, to, call_name, call)                                                         \
    do {                                                                                               \
        FM_TRY(reserve(n));                                                                            \
        FM_TRY(fm_nccl_settle((n), (what), (call_name), (call), (to)));                                        \
        FM_TRY(enqueued((n), (what), (to), st));                                                       \
    } while (0)

/* ---- collectives ------------------------------------------------------------------------------ */

static int nccl_rank(void *ctx) { return ((nccl_ctx *)ctx)->rank; }
static int nccl_size(void *ctx) { return ((nccl_ctx *)ctx)->size; }
static bool nccl_mem_is_host(void *ctx) { (void)ctx; return false; }
static double nccl_default_timeout(void *ctx) { return ((nccl_ctx *)ctx)->default_timeout; }

static fm_status nccl_all_reduce(void *ctx, const void *send, void *recv, int64_t count, fm_comm_dtype dtype,
                                 fm_comm_op op, double timeout_s) {
    NCCL_BEGIN("all_reduce", dtype, (int)op, count);
    FM_TRY(fm_comm_check_buf(n->rank, n->size, what, "send", send, count));
    FM_TRY(fm_comm_check_buf(n->rank, n->size, what, "recv", recv, count));
    const size_t bytes = (size_t)count * fm_comm_dtype_size(dtype);
    if (send != recv) FM_TRY(fm_comm_check_disjoint(n->rank, n->size, what, "send", send, bytes, "recv", recv, bytes));
    if (count == 0) return FM_OK; /* every rank has count 0 (matching arguments): nothing to agree on */
    FM_TRY(check_device(n, what, "send", send, count));
    FM_TRY(check_device(n, what, "recv", recv, count));
    NCCL_RUN(n, what, to, "ncclAllReduce",
             ncclAllReduce(send, recv, (size_t)count, nccl_type(dtype), nccl_op(op), n->comm, st));
    return FM_OK;
}

/* Host values need no GPU: over MPI on the host (the same ranks' mpi communicator, kept from the
 * unique id's broadcast), and the value itself on one rank. So a host reduction neither waits for
 * the backend's streams nor adds a host sync. */
static fm_status nccl_all_reduce_host(void *ctx, void *buf, int64_t count, fm_comm_dtype dtype, fm_comm_op op,
                                      double timeout_s) {
    NCCL_BEGIN("all_reduce_host", dtype, (int)op, count);
    (void)st;
    FM_TRY(fm_comm_check_buf(n->rank, n->size, what, "host", buf, count));
    if (count > FM_COMM_HOST_MAX_ELEMS)
        return fm_error(FM_ERR_ARG, "rank %d of %d (nccl): %s: at most %d elements per call (FM_COMM_HOST_MAX_ELEMS)",
                        n->rank, n->size, what, FM_COMM_HOST_MAX_ELEMS);
    if (count == 0 || n->size == 1) return FM_OK; /* the sum or max over one rank is the value itself */
    return n->host.ops->all_reduce_host(n->host.ctx, buf, count, dtype, op, to);
}

static fm_status nccl_reduce_scatter(void *ctx, const void *send, void *recv, int64_t recv_count,
                                     fm_comm_dtype dtype, fm_comm_op op, double timeout_s) {
    NCCL_BEGIN("reduce_scatter", dtype, (int)op, recv_count);
    const int W = n->size;
    FM_TRY(fm_comm_check_buf(n->rank, W, what, "send", send, recv_count));
    FM_TRY(fm_comm_check_buf(n->rank, W, what, "recv", recv, recv_count));
    bool in_place; /* NCCL's in-place form: recv is this rank's block of send */
    FM_TRY(fm_comm_check_blocks(n->rank, W, " (nccl)", what, send, recv, recv_count, dtype, true, &in_place));
    if (recv_count == 0) return FM_OK;
    FM_TRY(check_device(n, what, "send", send, recv_count));
    FM_TRY(check_device(n, what, "recv", recv, recv_count));
    NCCL_RUN(n, what, to, "ncclReduceScatter",
             ncclReduceScatter(send, recv, (size_t)recv_count, nccl_type(dtype), nccl_op(op), n->comm, st));
    return FM_OK;
}

static fm_status nccl_all_gather(void *ctx, const void *send, void *recv, int64_t send_count, fm_comm_dtype dtype,
                                 double timeout_s) {
    NCCL_BEGIN("all_gather", dtype, -1, send_count);
    const int W = n->size;
    FM_TRY(fm_comm_check_buf(n->rank, W, what, "send", send, send_count));
    FM_TRY(fm_comm_check_buf(n->rank, W, what, "recv", recv, send_count));
    bool in_place; /* NCCL's in-place form: send is this rank's block of recv */
    FM_TRY(fm_comm_check_blocks(n->rank, W, " (nccl)", what, send, recv, send_count, dtype, false, &in_place));
    if (send_count == 0) return FM_OK;
    FM_TRY(check_device(n, what, "send", send, send_count));
    FM_TRY(check_device(n, what, "recv", recv, send_count));
    NCCL_RUN(n, what, to, "ncclAllGather",
             ncclAllGather(send, recv, (size_t)send_count, nccl_type(dtype), n->comm, st));
    return FM_OK;
}

/* all_to_all_v's checks and its ncclSend/ncclRecv group on stream st (the op stream, or the
 * communication stream of the async form, which `pre` prepares once the checks passed and
 * something is to be sent: it makes st wait for the op stream's mark). */
static fm_status a2a_issue(nccl_ctx *n, const char *what, double to, cudaStream_t st, const void *send,
                           const int64_t *send_counts, const int64_t *send_displs, void *recv,
                           const int64_t *recv_counts, const int64_t *recv_displs, fm_comm_dtype dtype,
                           fm_status (*pre)(nccl_ctx *, const char *, int), int after) {
    const int W = n->size, r = n->rank;
    int64_t total[2], biggest;
    FM_TRY(fm_comm_check_all_to_all_v(r, W, " (nccl)", what, send, send_counts, send_displs, recv, recv_counts,
                                      recv_displs, dtype, total, &biggest));
    const size_t es = fm_comm_dtype_size(dtype);
    /* a rank with nothing to send or receive posts nothing: NCCL's point-to-point calls pair
     * per peer, and every peer's count toward it is 0 as well (matching arguments) */
    if (total[0] == 0 && total[1] == 0) return FM_OK;
    FM_TRY(check_device(n, what, "send", send, total[0]));
    FM_TRY(check_device(n, what, "recv", recv, total[1]));
    FM_TRY(reserve(n));
    if (pre) FM_TRY(pre(n, what, after));
    const ncclDataType_t ty = nccl_type(dtype);
    ncclResult_t e = ncclGroupStart();
    if (e != ncclSuccess) return fm_nccl_failed(n, what, "ncclGroupStart", e);
    ncclResult_t first = ncclSuccess;
    const char *first_call = "";
    for (int q = 0; q < W; q++) {
        if (send_counts[q] > 0 && first == ncclSuccess) {
            e = ncclSend((const char *)send + (size_t)send_displs[q] * es, (size_t)send_counts[q], ty, q, n->comm, st);
            if (e != ncclSuccess && e != ncclInProgress) first = e, first_call = "ncclSend";
        }
        if (recv_counts[q] > 0 && first == ncclSuccess) {
            e = ncclRecv((char *)recv + (size_t)recv_displs[q] * es, (size_t)recv_counts[q], ty, q, n->comm, st);
            if (e != ncclSuccess && e != ncclInProgress) first = e, first_call = "ncclRecv";
        }
    }
    e = ncclGroupEnd(); /* the group is always closed, even after a failed call inside it */
    if (first != ncclSuccess) return fm_nccl_failed(n, what, first_call, first);
    FM_TRY(fm_nccl_settle(n, what, "ncclGroupEnd", e, to));
    return enqueued(n, what, to, st);
}

static fm_status nccl_all_to_all_v(void *ctx, const void *send, const int64_t *send_counts,
                                   const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                   const int64_t *recv_displs, fm_comm_dtype dtype, double timeout_s) {
    NCCL_BEGIN("all_to_all_v", dtype, -1, -1);
    return a2a_issue(n, what, to, st, send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype, NULL, 0);
}

/* ---- async exchanges on the communication stream (fm_comm_ops.mark) ---------------------------- */

/* The next slot of the order ring, recorded on stream s. */
static fm_status order_record(nccl_ctx *n, const char *what, cudaStream_t s, int *slot) {
    const int i = n->next_order;
    n->next_order = (n->next_order + 1) % FM_COMM_ASYNC_RING;
    const cudaError_t e = cudaEventRecord(n->order[i], s);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        BROKE(n, "rank %d of %d (nccl): %s: cudaEventRecord (order event %d) failed: %s; the communicator is "
              "aborted and the job must stop", n->rank, n->size, what, i, cudaGetErrorString(e));
    }
    *slot = i;
    return FM_OK;
}

static fm_status check_slot(const nccl_ctx *n, const char *what, const char *name, int slot) {
    if (slot < 0 || slot >= FM_COMM_ASYNC_RING)
        return fm_error(FM_ERR_ARG, "rank %d of %d (nccl): %s: %s %d is not a slot of the async ring (expected "
                        "0..%d, or -1 where allowed)", n->rank, n->size, what, name, slot, FM_COMM_ASYNC_RING - 1);
    return FM_OK;
}

static fm_status nccl_mark(void *ctx, int *mark) {
    nccl_ctx *n = ctx;
    if (n->broken)
        return fm_error(FM_ERR_IO, "rank %d of %d (nccl): mark: an earlier failure aborted this communicator (%s)",
                        n->rank, n->size, n->broke);
    return order_record(n, "mark", (cudaStream_t)fm_cuda_backend_stream(&n->be, FM_STREAM_OPS), mark);
}

/* The communication stream waits for the op stream's mark `after` (-1: its point now). */
static fm_status comm_after(nccl_ctx *n, const char *what, int after) {
    if (after < 0) FM_TRY(order_record(n, what, (cudaStream_t)fm_cuda_backend_stream(&n->be, FM_STREAM_OPS), &after));
    const cudaError_t e = cudaStreamWaitEvent(n->cs, n->order[after], 0);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        BROKE(n, "rank %d of %d (nccl): %s: cudaStreamWaitEvent (the communication stream after mark %d) failed: %s; "
              "the communicator is aborted and the job must stop", n->rank, n->size, what, after, cudaGetErrorString(e));
    }
    return FM_OK;
}

static fm_status nccl_all_to_all_v_async(void *ctx, const void *send, const int64_t *send_counts,
                                         const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                         const int64_t *recv_displs, fm_comm_dtype dtype, double timeout_s, int after,
                                         int *ticket) {
    NCCL_BEGIN("all_to_all_v_async", dtype, -1, -1);
    (void)st;
    if (!ticket) return fm_error(FM_ERR_ARG, "rank %d of %d (nccl): %s: ticket is NULL", n->rank, n->size, what);
    *ticket = -1;
    if (after != -1) FM_TRY(check_slot(n, what, "mark", after));
    FM_TRY(a2a_issue(n, what, to, n->cs, send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype,
                     comm_after, after));
    /* the ticket: the communication stream's point now (an exchange of nothing on this rank has
     * nothing of its own to wait for, but the ticket still orders every earlier one) */
    return order_record(n, what, n->cs, ticket);
}

static fm_status nccl_join(void *ctx, int ticket) {
    nccl_ctx *n = ctx;
    FM_TRY(check_slot(n, "join", "ticket", ticket));
    if (n->broken)
        return fm_error(FM_ERR_IO, "rank %d of %d (nccl): join: an earlier failure aborted this communicator (%s)",
                        n->rank, n->size, n->broke);
    const cudaError_t e =
        cudaStreamWaitEvent((cudaStream_t)fm_cuda_backend_stream(&n->be, FM_STREAM_OPS), n->order[ticket], 0);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        BROKE(n, "rank %d of %d (nccl): join(ticket %d): cudaStreamWaitEvent failed: %s; the communicator is aborted "
              "and the job must stop", n->rank, n->size, ticket, cudaGetErrorString(e));
    }
    return FM_OK;
}

static fm_status nccl_broadcast(void *ctx, const void *send, void *recv, int64_t count, fm_comm_dtype dtype, int root,
                                double timeout_s) {
    NCCL_BEGIN("broadcast", dtype, -1, count);
    const int W = n->size, r = n->rank;
    if (root < 0 || root >= W)
        return fm_error(FM_ERR_ARG, "rank %d of %d (nccl): %s: root %d is not a rank (expected 0..%d)", r, W, what,
                        root, W - 1);
    if (r == root) FM_TRY(fm_comm_check_buf(r, W, what, "send", send, count));
    FM_TRY(fm_comm_check_buf(r, W, what, "recv", recv, count));
    const size_t bytes = (size_t)count * fm_comm_dtype_size(dtype);
    if (r == root && send != recv) FM_TRY(fm_comm_check_disjoint(r, W, what, "send", send, bytes, "recv", recv, bytes));
    if (count == 0) return FM_OK;
    if (r == root) FM_TRY(check_device(n, what, "send", send, count));
    FM_TRY(check_device(n, what, "recv", recv, count));
    const void *src = r == root ? send : recv; /* read on root only */
    NCCL_RUN(n, what, to, "ncclBroadcast",
             ncclBroadcast(src, recv, (size_t)count, nccl_type(dtype), root, n->comm, st));
    return FM_OK;
}

/* A one-element max all-reduce of the staging buffer, waited for: every rank has reached it. */
static fm_status nccl_barrier(void *ctx, double timeout_s) {
    nccl_ctx *n = ctx;
    const char *what = "barrier()";
    double to;
    FM_TRY(fm_comm_check_timeout(n->rank, n->size, what, timeout_s, n->default_timeout, &to));
    if (n->broken)
        return fm_error(FM_ERR_IO, "rank %d of %d (nccl): %s: an earlier failure aborted this communicator (%s)",
                        n->rank, n->size, what, n->broke);
    const cudaStream_t st = (cudaStream_t)fm_cuda_backend_stream(&n->be, FM_STREAM_OPS);
    NCCL_RUN(n, what, to, "ncclAllReduce",
             ncclAllReduce(n->stage, n->stage, 1, ncclFloat32, ncclMax, n->comm, st));
    return fm_nccl_wait_all(n, 0);
}

static fm_status nccl_wait(void *ctx, double timeout_s) {
    nccl_ctx *n = ctx;
    double to;
    FM_TRY(fm_comm_check_timeout(n->rank, n->size, "wait", timeout_s, 0, &to));
    return fm_nccl_wait_all(n, timeout_s);
}

const fm_comm_ops fm_nccl_ops = {
    .name = "nccl",
    .rank = nccl_rank,
    .size = nccl_size,
    .mem_is_host = nccl_mem_is_host,
    .default_timeout = nccl_default_timeout,
    .all_reduce = nccl_all_reduce,
    .all_reduce_host = nccl_all_reduce_host,
    .reduce_scatter = nccl_reduce_scatter,
    .all_gather = nccl_all_gather,
    .all_to_all_v = nccl_all_to_all_v,
    .broadcast = nccl_broadcast,
    .barrier = nccl_barrier,
    .split = fm_nccl_split,
    .destroy = fm_nccl_destroy,
    .wait = nccl_wait,
    .mark = nccl_mark,
    .all_to_all_v_async = nccl_all_to_all_v_async,
    .join = nccl_join,
};

#endif /* FM_HAVE_NCCL */
