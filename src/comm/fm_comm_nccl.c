/* The NCCL communicator (fm_comm_nccl.h): GPU ranks over a non-blocking NCCL communicator, its
 * collectives issued on the CUDA backend's op stream and tracked with a ring of CUDA events, so
 * that every one of them either completes or fails by its deadline (the header says when the
 * check runs). The argument checks and messages are the self and mpi communicators' (fm_comm.c's
 * helpers), so a misuse fails the same way on every implementation. Without NCCL (FM_HAVE_NCCL
 * undefined: the CPU build, or a CUDA build where CMake found no NCCL) the file gives the
 * functions that say so.
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

#ifndef FM_HAVE_NCCL

bool fm_comm_nccl_built(void) { return false; }
fm_status fm_comm_nccl_world(fm_comm *out, const struct fm_backend *be, double default_timeout_s,
                             fm_comm_nccl_check check) {
    (void)be, (void)default_timeout_s, (void)check;
    if (out) out->ops = NULL, out->ctx = NULL;
    return fm_error(FM_ERR_UNSUPPORTED, "the nccl communicator is not in this build (it needs the CUDA build, "
                    "-DFLATMOE_CUDA=ON, with nccl.h and libnccl found by CMake)");
}
bool fm_comm_nccl_usable(const struct fm_backend *be, int local_size, char *why, size_t why_n) {
    (void)be, (void)local_size;
    if (why && why_n) snprintf(why, why_n, "NCCL is not in this build");
    return false;
}

#else

#include <cuda_runtime.h>
#include <nccl.h>
#include <sched.h>
#include <time.h>

#include "../backend/cuda/fm_backend_cuda.h"

#define PENDING FM_COMM_NCCL_PENDING
#define STAGE_BYTES ((size_t)256) /* the barrier's one value */

typedef struct nccl_ctx {
    ncclComm_t comm;      /* NULL once aborted (broken) or destroyed */
    ncclComm_t split_out; /* where a non-blocking split's job stores the child (it may do so late) */
    int rank, size, device;
    fm_backend be;
    fm_comm_nccl_check check;
    double default_timeout;
    bool broken;          /* aborted after a failure or a timeout: every later call fails */
    char broke[640];      /* the failure's message */
    void *stage;          /* device [STAGE_BYTES]: the barrier's value */
    fm_comm host;         /* several ranks: the mpi communicator (host memory) of the same ranks, for
                             all_reduce_host; empty on one rank */
    /* the ring of enqueued collectives not yet seen complete: [head, head + pending) mod PENDING */
    cudaEvent_t ev[PENDING];
    int n_ev;
    int head, pending;
    double t_enq[PENDING], tmo[PENDING];
    char what[PENDING][112];
    /* the async exchanges (fm_comm_ops.mark): their stream and the ring of order events */
    cudaStream_t cs;      /* the communication stream (non-blocking); NULL until created */
    cudaEvent_t order[FM_COMM_ASYNC_RING];
    int n_order, next_order;
} nccl_ctx;

/* ---- the live communicators: the backend's wait hook checks every one of them -------------- */

#define LIVE_MAX 64
static nccl_ctx *live[LIVE_MAX];
static int n_live;

static fm_status poll_ctx(nccl_ctx *n);

/* The backend's wait hook (fm_cuda_backend_set_wait_hook): the first failure of any live
 * communicator (a deadline passed, an asynchronous NCCL error); *idle when none has a collective
 * pending (the backend then waits the ordinary, blocking way). Never waits. */
static fm_status watch_all(void *arg, bool *idle) {
    (void)arg;
    *idle = true;
    for (int i = 0; i < n_live; i++) {
        FM_TRY(poll_ctx(live[i]));
        if (live[i]->pending > 0) *idle = false;
    }
    return FM_OK;
}

static void live_add(nccl_ctx *n) {
    if (n_live < LIVE_MAX) live[n_live++] = n;
    if (n->check == FM_COMM_NCCL_CHECK_DEFERRED) (void)fm_cuda_backend_set_wait_hook(&n->be, watch_all, NULL);
}

static void live_remove(nccl_ctx *n) {
    int j = 0;
    bool deferred_left = false;
    for (int i = 0; i < n_live; i++)
        if (live[i] != n) {
            live[j++] = live[i];
            if (live[i]->check == FM_COMM_NCCL_CHECK_DEFERRED && live[i]->be.ctx == n->be.ctx) deferred_left = true;
        }
    n_live = j;
    if (n->check == FM_COMM_NCCL_CHECK_DEFERRED && !deferred_left) (void)fm_cuda_backend_set_wait_hook(&n->be, NULL, NULL);
}

/* ---- time, failure ----------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Between polls: nothing for the first few (small collectives finish there), then sched_yield
 * (a rank's host thread has nothing else to do while it waits, and a sleep's timer slack would
 * add tens of microseconds per collective), and 1 ms sleeps once it has waited a while. */
static void nap(long polls) {
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
static fm_status broke_with(nccl_ctx *n, const char *msg) {
    if (!n->broken) {
        snprintf(n->broke, sizeof n->broke, "%s", msg);
        n->broken = true;
        if (n->comm) (void)ncclCommAbort(n->comm);
        n->comm = NULL;
        n->pending = 0; /* the events may never complete now: nothing is waited for any more */
    }
    return fm_error(FM_ERR_IO, "%s", n->broke);
}

#define BROKE(n, ...)                                                                                  \
    do {                                                                                               \
        char m_[640];                                                                                  \
        snprintf(m_, sizeof m_, __VA_ARGS__);                                                          \
        return broke_with((n), m_);                                                                    \
    } while (0)

/* An NCCL call of `what` failed with r: the communicator is aborted (its state is unknown). */
static fm_status nccl_failed(nccl_ctx *n, const char *what, const char *call, ncclResult_t r) {
    const char *last = n->comm ? ncclGetLastError(n->comm) : NULL;
    BROKE(n, "rank %d of %d (nccl): %s: %s failed: %s%s%s%s; the communicator is aborted and the job must stop",
          n->rank, n->size, what, call, ncclGetErrorString(r), last && *last ? " (" : "", last ? last : "",
          last && *last ? ")" : "");
}

/* The host side of an NCCL call that returned r: a non-blocking communicator may answer
 * ncclInProgress while it still processes the call on the host; that is polled with
 * ncclCommGetAsyncError until it settles or timeout_s passes. */
static fm_status settle(nccl_ctx *n, const char *what, const char *call, ncclResult_t r, double timeout_s) {
    const double t0 = now_s();
    for (long polls = 0; r == ncclInProgress; polls++) {
        ncclResult_t a = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(n->comm, &a);
        if (q != ncclSuccess) return nccl_failed(n, what, "ncclCommGetAsyncError", q);
        r = a;
        if (r != ncclInProgress) break;
        if (now_s() - t0 > timeout_s)
            BROKE(n, "rank %d of %d (nccl): %s: %s still in progress on the host after %g s (timeout); the "
                  "communicator is aborted and the job must stop", n->rank, n->size, what, call, timeout_s);
        nap(polls);
    }
    return r == ncclSuccess ? FM_OK : nccl_failed(n, what, call, r);
}

/* Pops the collectives that completed; fails on an asynchronous NCCL error or on a pending
 * collective's passed deadline. Never waits. */
static fm_status poll_ctx(nccl_ctx *n) {
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
    const double now = n->pending > 0 ? now_s() : 0;
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

/* Waits until no collective is pending (or fails: poll_ctx's errors). timeout_s > 0 also bounds
 * this wait as a whole. */
static fm_status wait_all(nccl_ctx *n, double timeout_s) {
    const double t0 = now_s();
    for (long polls = 0;; polls++) {
        FM_TRY(poll_ctx(n));
        if (n->pending == 0) return FM_OK;
        if (timeout_s > 0 && now_s() - t0 > timeout_s)
            BROKE(n, "rank %d of %d (nccl): wait: %s did not complete within %g s (another rank did not join it, "
                  "or died); the communicator is aborted and the job must stop", n->rank, n->size,
                  n->what[n->head], timeout_s);
        nap(polls);
    }
}

/* Room in the ring for one more collective: waits (under the oldest one's deadline) while full. */
static fm_status reserve(nccl_ctx *n) {
    for (long polls = 0;; polls++) {
        FM_TRY(poll_ctx(n));
        if (n->pending < PENDING) return FM_OK;
        nap(polls);
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
    n->t_enq[i] = now_s();
    n->tmo[i] = timeout_s;
    snprintf(n->what[i], sizeof n->what[i], "%s", what);
    n->pending++;
    return n->check == FM_COMM_NCCL_CHECK_COLLECTIVE ? wait_all(n, 0) : FM_OK;
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
        FM_TRY(settle((n), (what), (call_name), (call), (to)));                                        \
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
    if (recv_count > INT64_MAX / W)
        return fm_error(FM_ERR_ARG, "rank %d of %d (nccl): %s: %d x %lld elements overflow", n->rank, W, what, W,
                        (long long)recv_count);
    const size_t rb = (size_t)recv_count * fm_comm_dtype_size(dtype);
    const bool in_place = recv == (const char *)send + (size_t)n->rank * rb; /* NCCL's in-place form */
    if (!in_place) FM_TRY(fm_comm_check_disjoint(n->rank, W, what, "send", send, (size_t)W * rb, "recv", recv, rb));
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
    if (send_count > INT64_MAX / W)
        return fm_error(FM_ERR_ARG, "rank %d of %d (nccl): %s: %d x %lld elements overflow", n->rank, W, what, W,
                        (long long)send_count);
    const size_t sb = (size_t)send_count * fm_comm_dtype_size(dtype);
    const bool in_place = send == (const char *)recv + (size_t)n->rank * sb; /* NCCL's in-place form */
    if (!in_place) FM_TRY(fm_comm_check_disjoint(n->rank, W, what, "send", send, sb, "recv", recv, (size_t)W * sb));
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
    if (e != ncclSuccess) return nccl_failed(n, what, "ncclGroupStart", e);
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
    if (first != ncclSuccess) return nccl_failed(n, what, first_call, first);
    FM_TRY(settle(n, what, "ncclGroupEnd", e, to));
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
    return wait_all(n, 0);
}

static fm_status nccl_wait(void *ctx, double timeout_s) {
    nccl_ctx *n = ctx;
    double to;
    FM_TRY(fm_comm_check_timeout(n->rank, n->size, "wait", timeout_s, 0, &to));
    return wait_all(n, timeout_s);
}

/* ---- creation, split, destruction ------------------------------------------------------------- */

static void nccl_destroy(void *ctx) {
    nccl_ctx *n = ctx;
    if (!n) return;
    live_remove(n);
    if (n->comm && wait_all(n, n->default_timeout) == FM_OK) {
        /* ncclCommFinalize flushes the communicator's work; non-blocking: polled, bounded */
        const fm_status s = settle(n, "destroy", "ncclCommFinalize", ncclCommFinalize(n->comm), n->default_timeout);
        if (s == FM_OK && n->comm) (void)ncclCommDestroy(n->comm);
        n->comm = NULL;
    }
    /* broken: ncclCommAbort already freed the communicator */
    for (int i = 0; i < n->n_ev; i++) (void)cudaEventDestroy(n->ev[i]);
    for (int i = 0; i < n->n_order; i++) (void)cudaEventDestroy(n->order[i]);
    if (n->cs) (void)cudaStreamDestroy(n->cs);
    if (n->stage) n->be.ops->mem_free(n->be.ctx, n->stage);
    fm_comm_free(&n->host);
    fm_free(n);
}

static fm_status nccl_split(void *ctx, int color, int key, fm_comm *out);

static const fm_comm_ops nccl_ops = {
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
    .split = nccl_split,
    .destroy = nccl_destroy,
    .wait = nccl_wait,
    .mark = nccl_mark,
    .all_to_all_v_async = nccl_all_to_all_v_async,
    .join = nccl_join,
};

/* A context over the initialized communicator `comm` and *host, the mpi communicator of the same
 * ranks (empty on one rank; both taken over: aborted and freed on error). */
static fm_status nccl_new(fm_comm *out, ncclComm_t comm, fm_comm *host, const fm_backend *be, double default_timeout,
                          fm_comm_nccl_check check) {
    nccl_ctx *n = fm_malloc(sizeof *n);
    if (!n) {
        (void)ncclCommAbort(comm);
        fm_comm_free(host);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the nccl communicator");
    }
    memset(n, 0, sizeof *n);
    n->comm = comm;
    n->host = *host;
    host->ops = NULL, host->ctx = NULL;
    n->be = *be;
    n->device = fm_cuda_backend_device(be);
    n->check = check;
    n->default_timeout = default_timeout;
    ncclResult_t r = ncclCommUserRank(comm, &n->rank);
    if (r == ncclSuccess) r = ncclCommCount(comm, &n->size);
    if (r != ncclSuccess) {
        const fm_status s = nccl_failed(n, "create", "ncclCommUserRank/ncclCommCount", r);
        nccl_destroy(n);
        return s;
    }
    for (; n->n_ev < PENDING; n->n_ev++)
        if (cudaEventCreateWithFlags(&n->ev[n->n_ev], cudaEventDisableTiming) != cudaSuccess) {
            (void)cudaGetLastError();
            const fm_status s = broke_with(n, "nccl communicator: cudaEventCreateWithFlags failed (the ring of "
                                           "completion events)");
            nccl_destroy(n);
            return s == FM_OK ? FM_ERR_IO : s;
        }
    for (; n->n_order < FM_COMM_ASYNC_RING; n->n_order++)
        if (cudaEventCreateWithFlags(&n->order[n->n_order], cudaEventDisableTiming) != cudaSuccess) {
            (void)cudaGetLastError();
            const fm_status s = broke_with(n, "nccl communicator: cudaEventCreateWithFlags failed (the async "
                                           "exchanges' order events)");
            nccl_destroy(n);
            return s == FM_OK ? FM_ERR_IO : s;
        }
    if (cudaStreamCreateWithFlags(&n->cs, cudaStreamNonBlocking) != cudaSuccess) {
        (void)cudaGetLastError();
        n->cs = NULL;
        const fm_status s = broke_with(n, "nccl communicator: cudaStreamCreateWithFlags failed (the communication "
                                       "stream)");
        nccl_destroy(n);
        return s == FM_OK ? FM_ERR_IO : s;
    }
    n->stage = be->ops->mem_alloc(be->ctx, STAGE_BYTES);
    if (!n->stage) {
        (void)broke_with(n, "nccl communicator: no device memory for its barrier's value");
        nccl_destroy(n);
        return fm_error(FM_ERR_NOMEM, "rank %d of %d (nccl): cannot allocate the %zu-byte device buffer of the "
                        "barrier", n->rank, n->size, STAGE_BYTES);
    }
    live_add(n);
    out->ops = &nccl_ops;
    out->ctx = n;
    return FM_OK;
}

/* Polls a communicator being created (ncclCommInitRankConfig, ncclCommSplit: non-blocking) until
 * it is ready or timeout_s passes; aborts it on failure. */
static fm_status wait_ready(ncclComm_t comm, ncclResult_t r, int rank, int size, const char *what, double timeout_s) {
    const double t0 = now_s();
    for (long polls = 0; r == ncclInProgress; polls++) {
        ncclResult_t a = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(comm, &a);
        r = q != ncclSuccess ? q : a;
        if (r != ncclInProgress) break;
        if (now_s() - t0 > timeout_s) {
            (void)ncclCommAbort(comm);
            return fm_error(FM_ERR_IO, "rank %d of %d (nccl): %s did not complete within %g s (another rank did not "
                            "join it, or died); aborted", rank, size, what, timeout_s);
        }
        nap(polls);
    }
    if (r != ncclSuccess) {
        const char *last = comm ? ncclGetLastError(comm) : NULL;
        char msg[512];
        snprintf(msg, sizeof msg, "rank %d of %d (nccl): %s failed: %s%s%s%s", rank, size, what, ncclGetErrorString(r),
                 last && *last ? " (" : "", last ? last : "", last && *last ? ")" : "");
        if (comm) (void)ncclCommAbort(comm);
        return fm_error(FM_ERR_IO, "%s", msg);
    }
    return FM_OK;
}

static ncclConfig_t nonblocking_config(void) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0; /* no NCCL call blocks the host: every wait is ours, under a deadline */
    cfg.commName = "flatmoe";
    return cfg;
}

static fm_status nccl_split(void *ctx, int color, int key, fm_comm *out) {
    nccl_ctx *n = ctx;
    if (!out) return fm_error(FM_ERR_ARG, "rank %d of %d (nccl): split: out is NULL", n->rank, n->size);
    out->ops = NULL;
    out->ctx = NULL;
    if (color < 0)
        return fm_error(FM_ERR_ARG, "rank %d of %d (nccl): split(color %d): color must be >= 0", n->rank, n->size,
                        color);
    char what[80];
    snprintf(what, sizeof what, "split(color %d, key %d)", color, key);
    if (n->broken)
        return fm_error(FM_ERR_IO, "rank %d of %d (nccl): %s: an earlier failure aborted this communicator (%s)",
                        n->rank, n->size, what, n->broke);
    FM_TRY(wait_all(n, 0)); /* the parent's pending work first: a split is a collective of the parent */
    fm_comm host = {0};   /* the host values' mpi communicator, split the same way */
    if (n->host.ops) FM_TRY(n->host.ops->split(n->host.ctx, color, key, &host));
    ncclConfig_t cfg = nonblocking_config();
    if (n->size == 1) {
        /* One rank: the child is a fresh one-rank communicator of its own id. NCCL 2.28.3's
         * ncclCommSplit fails on a one-rank parent (its bootstrapSplit returns ncclInternalError,
         * init.cc:1519; measured on the H200, test_comm_nccl), and a split of one rank has
         * nothing to agree on. */
        ncclUniqueId id;
        ncclComm_t nc = NULL;
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r == ncclSuccess) r = ncclCommInitRankConfig(&nc, 1, id, 0, &cfg);
        if (r != ncclSuccess && r != ncclInProgress) {
            if (nc) (void)ncclCommAbort(nc);
            fm_comm_free(&host);
            return fm_error(FM_ERR_IO, "rank 0 of 1 (nccl): %s: the one-rank child (ncclGetUniqueId, "
                            "ncclCommInitRankConfig) failed: %s", what, ncclGetErrorString(r));
        }
        const fm_status s1 = wait_ready(nc, r, 0, 1, what, n->default_timeout);
        if (s1 != FM_OK) {
            fm_comm_free(&host);
            return s1;
        }
        if (host.ops) fm_comm_free(&host);
        return nccl_new(out, nc, &host, &n->be, n->default_timeout, n->check);
    }
    n->split_out = NULL;
    ncclResult_t r = ncclCommSplit(n->comm, color, key, &n->split_out, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        fm_comm_free(&host);
        return nccl_failed(n, what, "ncclCommSplit", r);
    }
    /* A non-blocking split runs as a job of the parent: NCCL stores the child into nc only when
     * that job completes (init.cc: "*newcomm should be NCCL_COMM_NULL until comm split fully
     * complete"), and the parent answers ncclInProgress until then. So poll the parent first,
     * re-reading nc, then the child's own creation. */
    const double t0 = now_s();
    for (long polls = 0; r == ncclInProgress && !__atomic_load_n(&n->split_out, __ATOMIC_ACQUIRE); polls++) {
        ncclResult_t a = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(n->comm, &a);
        r = q != ncclSuccess ? q : a;
        if (r != ncclInProgress) break;
        if (now_s() - t0 > n->default_timeout) {
            fm_comm_free(&host);
            BROKE(n, "rank %d of %d (nccl): %s did not complete within %g s (another rank did not join it, or died); "
                  "the communicator is aborted and the job must stop", n->rank, n->size, what, n->default_timeout);
        }
        nap(polls);
    }
    ncclComm_t nc = __atomic_load_n(&n->split_out, __ATOMIC_ACQUIRE);
    n->split_out = NULL;
    if (r != ncclSuccess && r != ncclInProgress) {
        fm_comm_free(&host);
        return nccl_failed(n, what, "ncclCommSplit (the parent's split job)", r);
    }
    if (!nc) {
        fm_comm_free(&host);
        BROKE(n, "rank %d of %d (nccl): %s completed without a communicator (NCCL made none for color %d)", n->rank,
              n->size, what, color);
    }
    /* the child's own state: polled until ready */
    const fm_status s = wait_ready(nc, ncclInProgress, n->rank, n->size, what, n->default_timeout);
    if (s != FM_OK) {
        fm_comm_free(&host);
        return s;
    }
    if (host.ops && fm_comm_size(&host) == 1) fm_comm_free(&host); /* one rank: host values need no one */
    return nccl_new(out, nc, &host, &n->be, n->default_timeout, n->check);
}

/* NCCL_NVLS_ENABLE=0 unless the user set it (fm_comm_nccl.h: NVLink multicast stays off). */
static void nvls_off(void) {
    const char *v = getenv("NCCL_NVLS_ENABLE");
    if (!v || !*v) setenv("NCCL_NVLS_ENABLE", "0", 1);
}

bool fm_comm_nccl_built(void) { return true; }

bool fm_comm_nccl_usable(const fm_backend *be, int local_size, char *why, size_t why_n) {
    char tmp[8];
    if (!why || !why_n) why = tmp, why_n = sizeof tmp;
    if (fm_cuda_backend_device(be) < 0) {
        snprintf(why, why_n, "the backend is %s, not cuda", be && be->ops && be->ops->name ? be->ops->name : "none");
        return false;
    }
    int count = 0;
    if (fm_cuda_device_count(&count) != FM_OK || count < local_size) {
        snprintf(why, why_n, "%d ranks on this node share %d GPU%s (NCCL needs a GPU per rank; the mpi communicator "
                 "stages through the host instead)", local_size, count, count == 1 ? "" : "s");
        return false;
    }
    return true;
}

fm_status fm_comm_nccl_world(fm_comm *out, const fm_backend *be, double default_timeout_s, fm_comm_nccl_check check) {
    if (!out) return fm_error(FM_ERR_ARG, "fm_comm_nccl_world: out is NULL");
    out->ops = NULL;
    out->ctx = NULL;
    if (!(default_timeout_s >= 0))
        return fm_error(FM_ERR_ARG, "fm_comm_nccl_world: default timeout %g s must be >= 0 (0: %g s)",
                        default_timeout_s, FM_COMM_DEFAULT_TIMEOUT_S);
    if (check != FM_COMM_NCCL_CHECK_COLLECTIVE && check != FM_COMM_NCCL_CHECK_DEFERRED)
        return fm_error(FM_ERR_ARG, "fm_comm_nccl_world: unknown check mode %d (expected collective or deferred)",
                        (int)check);
    const int device = fm_cuda_backend_device(be);
    if (device < 0)
        return fm_error(FM_ERR_ARG, "fm_comm_nccl_world: the nccl communicator needs the CUDA backend, found %s (use "
                        "the mpi communicator for CPU ranks)", be && be->ops && be->ops->name ? be->ops->name : "none");
    const double to = default_timeout_s == 0 ? FM_COMM_DEFAULT_TIMEOUT_S : default_timeout_s;
    nvls_off();
    int rank, size;
    const char *src;
    FM_TRY(fm_comm_launcher(&rank, &size, &src));
    cudaError_t ce = cudaSetDevice(device);
    if (ce != cudaSuccess)
        return fm_error(FM_ERR_IO, "rank %d of %d (nccl): cudaSetDevice(%d) failed: %s", rank, size, device,
                        cudaGetErrorString(ce));
    /* [0]: rank 0 made the id (1) or not (0); [1..]: the id */
    unsigned char msg[1 + sizeof(ncclUniqueId)];
    memset(msg, 0, sizeof msg);
    char id_err[200] = "";
    if (rank == 0) {
        ncclUniqueId id;
        const ncclResult_t r = ncclGetUniqueId(&id);
        msg[0] = r == ncclSuccess;
        if (r == ncclSuccess) memcpy(msg + 1, &id, sizeof id);
        else snprintf(id_err, sizeof id_err, "%s", ncclGetErrorString(r));
    }
    fm_comm host = {0}; /* several ranks: the id's broadcast and, kept, the host values' communicator */
    if (size > 1) {
        if (!fm_comm_mpi_built())
            return fm_error(FM_ERR_UNSUPPORTED, "rank %d of %d (%s_*): the nccl communicator's unique id travels over "
                            "MPI, which is not in this build (install libopenmpi-dev and openmpi-bin, configure "
                            "again)", rank, size, src);
        FM_TRY(fm_comm_mpi_world(&host, NULL, to, 0));
        if (fm_comm_rank(&host) != rank || fm_comm_size(&host) != size) {
            const int r2 = fm_comm_rank(&host), n2 = fm_comm_size(&host);
            fm_comm_free(&host);
            return fm_error(FM_ERR_IO, "the launcher says rank %d of %d (%s_*) but MPI says rank %d of %d: launch "
                            "with the mpirun/srun of the MPI flatmoe was built with", rank, size, src, r2, n2);
        }
        const fm_status s = fm_comm_broadcast(&host, msg, msg, (int64_t)sizeof msg, FM_COMM_BYTE, 0, to);
        if (s != FM_OK) {
            fm_comm_free(&host);
            return s;
        }
    }
    if (!msg[0]) {
        fm_comm_free(&host);
        return fm_error(FM_ERR_IO, "rank %d of %d (nccl): rank 0 could not create NCCL's unique id (ncclGetUniqueId: "
                        "%s)", rank, size, rank == 0 ? id_err : "see rank 0's message");
    }
    ncclUniqueId id;
    memcpy(&id, msg + 1, sizeof id);
    ncclConfig_t cfg = nonblocking_config();
    ncclComm_t comm = NULL;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        if (comm) (void)ncclCommAbort(comm);
        fm_comm_free(&host);
        return fm_error(FM_ERR_IO, "rank %d of %d (nccl): ncclCommInitRankConfig failed: %s", rank, size,
                        ncclGetErrorString(r));
    }
    char what[64];
    snprintf(what, sizeof what, "ncclCommInitRankConfig on device %d", device);
    const fm_status s = wait_ready(comm, r, rank, size, what, to);
    if (s != FM_OK) {
        fm_comm_free(&host);
        return s;
    }
    return nccl_new(out, comm, &host, be, to, check);
}

#endif /* FM_HAVE_NCCL */
