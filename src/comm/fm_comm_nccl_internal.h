/* What the nccl communicator's files share (not a public API; built with FM_HAVE_NCCL only, as it
 * includes cuda_runtime.h and nccl.h):
 *   fm_comm_nccl.c         the ring of pending collectives, their deadlines and failures, the
 *                          collectives and async exchanges, the ops table
 *   fm_comm_nccl_create.c  creation (the world, nccl_new), split, destruction, the live
 *                          communicators the backend's wait hook checks */
#ifndef FM_COMM_NCCL_INTERNAL_H
#define FM_COMM_NCCL_INTERNAL_H

#include "fm_comm_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>

#include "../backend/cuda/fm_backend_cuda.h"
#include "../backend/fm_backend.h"

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

/* Aborts the communicator (ncclCommAbort: NCCL's kernels on the stream exit, so later host waits
 * return) and keeps `msg` as the reason every later call reports. Returns FM_ERR_IO with it. */
fm_status fm_nccl_broke_with(nccl_ctx *n, const char *msg);

/* fm_nccl_broke_with of a printf-formatted message, returned from the calling function. */
#define BROKE(n, ...)                                                                                  \
    do {                                                                                               \
        char m_[640];                                                                                  \
        snprintf(m_, sizeof m_, __VA_ARGS__);                                                          \
        return fm_nccl_broke_with((n), m_);                                                            \
    } while (0)

/* Seconds on the monotonic clock. */
double fm_nccl_now_s(void);

/* Between polls (the polls-th of a wait): nothing, then sched_yield, then 1 ms sleeps. */
void fm_nccl_nap(long polls);

/* An NCCL call `call` of `what` failed with r: the communicator is aborted (its state is unknown);
 * returns FM_ERR_IO with NCCL's error string and last error. */
fm_status fm_nccl_failed(nccl_ctx *n, const char *what, const char *call, ncclResult_t r);

/* The host side of an NCCL call that returned r: ncclInProgress is polled with
 * ncclCommGetAsyncError until it settles or timeout_s passes (then the communicator is aborted:
 * FM_ERR_IO); a failure is fm_nccl_failed's. */
fm_status fm_nccl_settle(nccl_ctx *n, const char *what, const char *call, ncclResult_t r, double timeout_s);

/* Pops the collectives that completed; fails (FM_ERR_IO, the communicator aborted) on an
 * asynchronous NCCL error or on a pending collective's passed deadline. Never waits. */
fm_status fm_nccl_poll(nccl_ctx *n);

/* Waits until no collective is pending (or fails: fm_nccl_poll's errors). timeout_s > 0 also
 * bounds this wait as a whole. */
fm_status fm_nccl_wait_all(nccl_ctx *n, double timeout_s);

/* The communicator's table (fm_comm_nccl.c); its split and destroy are fm_comm_nccl_create.c's. */
extern const fm_comm_ops fm_nccl_ops;
fm_status fm_nccl_split(void *ctx, int color, int key, fm_comm *out);
void fm_nccl_destroy(void *ctx);

#endif
