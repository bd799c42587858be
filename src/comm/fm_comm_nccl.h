/* The NCCL communicator (fm_comm_nccl*.c): GPU ranks, one GPU per rank, behind the table of
 * fm_comm.h. Built when FLATMOE_CUDA=ON and CMake finds NCCL (nccl.h and libnccl); otherwise
 * these functions exist, fm_comm_nccl_built() is false and fm_comm_nccl_world returns
 * FM_ERR_UNSUPPORTED. This header includes neither nccl.h nor cuda_runtime.h.
 *
 * Buffers are the CUDA backend's device memory (fm_comm_mem_is_host() is false); every collective
 * is issued on the backend's op stream (fm_cuda_backend_stream(be, FM_STREAM_OPS)), so it is
 * ordered after the ops that wrote its input and before the ops issued after it, without a host
 * wait. A buffer that is host memory (pageable or pinned) is FM_ERR_ARG naming it
 * (cudaPointerGetAttributes): NCCL reads device memory only. The host variants
 * (all_reduce_host, the fm_comm_allreduce_* wrappers) need no GPU: on one rank they are the
 * value itself; on several they go through MPI on the host (the mpi communicator of the same
 * ranks that carried the unique id, kept, and split along with this one; its timeouts and
 * messages are fm_comm_mpi_world's). So a host reduction (the batch's valid-target count) neither
 * waits for the backend's streams nor adds a host sync.
 * Mapping: all_reduce -> ncclAllReduce, reduce_scatter -> ncclReduceScatter, all_gather ->
 * ncclAllGather (NCCL's in-place forms are fm_comm.h's), broadcast -> ncclBroadcast, all_to_all_v
 * -> ncclSend/ncclRecv pairs in one ncclGroupStart/ncclGroupEnd (a pair with count 0 is left
 * out, so a rank with zero tokens posts nothing but still calls), barrier -> a one-element
 * all_reduce of a device scratch value followed by a wait. Reductions: sum and max of fp32,
 * fp64, int64 and bf16 (bf16 summed by NCCL in its own order; fm_comm.h).
 *
 * Async exchanges (fm_comm_ops.mark / all_to_all_v_async / join): the communicator owns a
 * communication stream (cudaStreamNonBlocking, made at creation) and a ring of
 * FM_COMM_ASYNC_RING order events. mark records one on the backend's op stream;
 * all_to_all_v_async makes the communication stream wait for the mark (cudaStreamWaitEvent;
 * -1: a mark of the op stream's point now), issues the same ncclSend/ncclRecv group there, and
 * records the ticket's event on it; join makes the op stream wait for that event. The
 * communication stream is FIFO: an exchange starts after every earlier async one. NCCL keeps a
 * communicator's operations in issue order whatever stream they are on, and every rank issues
 * them in the same order, so the two streams cannot deadlock. Its completion is tracked in the
 * same ring of pending events, with the same deadlines and aborts (a deadline counts as missed
 * only if that collective's own event has not completed: with two streams a later collective can
 * finish before the oldest). In the COLLECTIVE check mode the host waits for it as for any other
 * collective (no overlap).
 *
 * Timeouts and failures: the communicator is non-blocking (ncclConfig_t.blocking = 0), so no
 * NCCL call blocks the host: a call that returns ncclInProgress is polled with
 * ncclCommGetAsyncError against the deadline. Completion on the device is tracked with one CUDA
 * event per enqueued collective (a ring of FM_COMM_NCCL_PENDING, created at creation: no
 * allocation in a step), each with its description, enqueue time and timeout. A collective that
 * has not completed by its deadline, or an asynchronous NCCL error (a peer's failure, a network
 * error: ncclCommGetAsyncError), aborts the communicator (ncclCommAbort, which also makes the
 * NCCL kernels on the stream exit, so later host waits return) and returns FM_ERR_IO:
 *   "rank 1 of 2 (nccl): all_reduce(bf16 sum, 1024 elements) did not complete within 30 s ..."
 * An aborted communicator fails every later collective with FM_ERR_IO; the process must stop
 * (the CLI then ends the job: fm_comm_mpi_abort).
 *
 * When the check happens (fm_comm_nccl_check):
 * - COLLECTIVE: each collective polls its event (cudaEventQuery, with short sleeps) and the
 *   asynchronous error until it completes or its deadline passes. This is a host
 *   synchronization per collective (the host waits for the stream up to the collective, the
 *   ops before it included): simple and exact about which call failed; for tests and for code
 *   whose results the host reads at once anyway.
 * - DEFERRED: collectives are only enqueued (the host waits only when the ring of pending
 *   events is full, for the oldest one, under its deadline). The deadlines and the
 *   asynchronous error are checked by the CUDA backend's own host waits: the communicator sets
 *   the backend's wait hook (fm_cuda_backend_set_wait_hook), so the trainer's existing sync
 *   points (the step end's stream_sync, the MoE dispatch's offsets, synchronous copies) poll
 *   and call it, and a collective that never completes turns into the backend's error at that
 *   sync point (the trainer checks status() right after it) instead of a hang; fm_comm_wait()
 *   checks on demand. No host sync is added to a step. The trainer uses this mode.
 * In both modes a collective's deadline runs from when it was enqueued, so it also covers the
 * work queued before it on the stream (a backward still running when the gradient all-reduce is
 * issued): --comm-timeout must exceed that (the default 300 s does, by far).
 *
 * NVLink multicast: NCCL_NVLS_ENABLE is set to 0 in the environment before NCCL initializes,
 * unless the user set it (its value as handed to fm_comm_env_set). NVLS (NVLink SHARP) reserves
 * multicast objects of the NVSwitch fabric per communicator, a resource shared by every job on
 * the node; on the shared H200 machines it
 * must stay off (it can fail or starve other tenants' jobs, and NVLS buffers take device memory
 * the plan does not count). Set NCCL_NVLS_ENABLE=1 yourself on a machine of your own.
 *
 * Sources: NCCL 2.28's API (ncclCommInitRankConfig, non-blocking communicators and
 * ncclCommGetAsyncError/ncclCommAbort as its "Fault tolerance" section describes them,
 * ncclCommSplit, group calls for point-to-point all-to-all as in its "Point-to-point
 * communication" examples). */
#ifndef FM_COMM_NCCL_H
#define FM_COMM_NCCL_H

#include "fm_comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Collectives that may be pending (enqueued, not yet seen complete) per communicator. */
#define FM_COMM_NCCL_PENDING 256

typedef enum fm_comm_nccl_check {
    FM_COMM_NCCL_CHECK_DEFERRED = 0, /* enqueue only; checked at the backend's host waits (the trainer) */
    FM_COMM_NCCL_CHECK_COLLECTIVE,   /* each collective waits for its completion (a host sync) */
} fm_comm_nccl_check;

/* "deferred", "collective" ("?" otherwise). */
/* *out = the mode named s ("deferred" or "collective"). Errors: FM_ERR_ARG naming s. */
fm_status fm_comm_nccl_check_parse(const char *s, fm_comm_nccl_check *out);
const char *fm_comm_nccl_check_name(fm_comm_nccl_check c);

/* Whether this build has the NCCL communicator. */
bool fm_comm_nccl_built(void);

/* The communicator over every rank of the launch (fm_comm_launcher's rank and size), on the CUDA
 * backend be's device (be must be a CUDA backend and outlive the communicator). One rank:
 * ncclGetUniqueId and ncclCommInitRankConfig with one rank, no MPI. Several ranks: rank 0's
 * ncclGetUniqueId travels to the others by MPI (a host-memory mpi communicator, fm_comm_mpi_world,
 * kept for the host values; MPI is initialized when it is not), with a flag so that a rank 0
 * that failed to make the id fails every rank at once; then ncclCommInitRankConfig (non-blocking)
 * polled against the default timeout. A collective call. default_timeout_s: 0 means
 * FM_COMM_DEFAULT_TIMEOUT_S; it also bounds the initialization. check: when collectives are
 * checked (above). Errors: FM_ERR_UNSUPPORTED (no NCCL in this build; several ranks and no MPI),
 * FM_ERR_ARG (out NULL, be not a CUDA backend, a negative timeout, a bad check), FM_ERR_IO (an
 * NCCL or CUDA call failed or the initialization timed out, naming it and the rank; MPI's rank or
 * size disagree with the launcher's), FM_ERR_NOMEM. */
fm_status fm_comm_nccl_world(fm_comm *out, const struct fm_backend *be, double default_timeout_s,
                             fm_comm_nccl_check check);

/* Whether `--comm auto` may use NCCL for a run of local_size ranks on this node over be: NCCL is
 * built, be is a CUDA backend and every local rank has a GPU of its own (local_size <= the
 * number of CUDA devices; NCCL cannot put two ranks on one GPU). When not, why gets the reason
 * (why may be NULL). */
bool fm_comm_nccl_usable(const struct fm_backend *be, int local_size, char *why, size_t why_n);

#ifdef __cplusplus
}
#endif
#endif
