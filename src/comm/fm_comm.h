/* The communicator table (DESIGN.md §3 and §6): a struct of function pointers over an opaque
 * context, in the manner of backend/fm_backend.h. A model block, bounded operator or schedule
 * policy never calls MPI or NCCL: it calls this table. Implementations: self (fm_comm_self.c,
 * one rank; every collective is the identity or a copy), mpi (fm_comm_mpi.c, CPU ranks, or
 * host-staged backend memory) and nccl (fm_comm_nccl.c and fm_comm_nccl.h: GPU ranks, device
 * memory on the backend's stream).
 *
 * Conventions for every collective:
 * - Counts and displacements are in ELEMENTS of the collective's dtype, int64_t, >= 0. A buffer
 *   may be NULL only when the count it holds is 0.
 * - Buffers live in the communicator's memory, fixed at creation: host memory, or the memory of
 *   the fm_backend the communicator was created over (device memory on a GPU; NCCL reads and
 *   writes it on the backend's stream). fm_comm_mem_is_host() says which. The host variants
 *   (all_reduce_host and the fm_comm_allreduce_* wrappers) take host memory on every
 *   communicator (values the host needs: losses, norms, counts); an implementation over device
 *   memory stages them through a buffer fixed at creation, so they hold at most
 *   FM_COMM_HOST_MAX_ELEMS elements.
 * - Send and receive buffers do not overlap, except in the in-place forms each op names.
 *   Implementations reject a partial overlap with FM_ERR_ARG (the self communicator checks it,
 *   so a misuse fails on one rank before it corrupts memory on many).
 * - Every rank calls every collective in the same order with matching arguments (MPI/NCCL's
 *   rule); a rank with nothing to contribute (zero tokens) still calls it with counts 0.
 * - timeout_s: seconds the collective may wait for the other ranks before it fails; 0 means the
 *   communicator's default (set at creation); negative or NaN is FM_ERR_ARG.
 * - Every collective returns an fm_status. A failure fills the message (fm_errmsg) naming the
 *   rank, the collective, its arguments and what happened, e.g.
 *     "rank 3 of 8: all_reduce(fp64 sum, 16 elements) timed out after 30 s"
 *   Errors: FM_ERR_ARG (bad arguments: negative counts, counts that disagree with the
 *   communicator's size, NULL buffers with nonzero counts, partial overlaps, a bad root, dtype
 *   or op), FM_ERR_UNSUPPORTED (a dtype/op pair the implementation cannot serve), FM_ERR_IO (a
 *   transport error or a timeout; the run must stop on every rank).
 * - Collectives are blocking from the caller's view: on return the receive buffer is final for
 *   host memory, and ordered before later work on the backend's stream for device memory. The
 *   one exception is all_to_all_v_async (below), whose completion the caller orders with join.
 *
 * Sources: the semantics are MPI 4.0's (MPI_Allreduce, MPI_Reduce_scatter_block,
 * MPI_Allgather, MPI_Alltoallv, MPI_Bcast, MPI_Barrier, MPI_Comm_split) with NCCL's in-place
 * conventions for reduce-scatter and all-gather (ncclReduceScatter / ncclAllGather:
 * recvbuff == sendbuff + rank * recvcount, and sendbuff == recvbuff + rank * sendcount).
 */
#ifndef FM_COMM_H
#define FM_COMM_H

#include "../core/fm_core.h"

#ifdef __cplusplus
extern "C" {
#endif

struct fm_backend;

/* Element types of a collective. Reductions (all_reduce, reduce_scatter) take F32, F64, I64 and
 * BF16 (bf16 summed in fp32 and rounded once per element by NCCL; the self communicator only
 * copies); data movement (all_gather, all_to_all_v, broadcast) takes every type, BYTE included. */
typedef enum fm_comm_dtype {
    FM_COMM_F32 = 0,
    FM_COMM_F64,
    FM_COMM_I64,
    FM_COMM_BF16,
    FM_COMM_BYTE,
    FM_COMM_DTYPE_COUNT
} fm_comm_dtype;

typedef enum fm_comm_op { FM_COMM_SUM = 0, FM_COMM_MAX, FM_COMM_OP_COUNT } fm_comm_op;

/* Bytes of one element (0 for an invalid dtype); names as messages print them ("fp64", "sum"). */
size_t fm_comm_dtype_size(fm_comm_dtype t);
const char *fm_comm_dtype_name(fm_comm_dtype t);
const char *fm_comm_op_name(fm_comm_op op);

/* The default timeout of a communicator created with default_timeout_s = 0: 300 s. */
#define FM_COMM_DEFAULT_TIMEOUT_S 300.0
/* The most elements all_reduce_host (and the fm_comm_allreduce_* wrappers) take in one call. */
#define FM_COMM_HOST_MAX_ELEMS 4096

typedef struct fm_comm fm_comm;

typedef struct fm_comm_ops {
    const char *name; /* "self", "mpi", "nccl" */

    /* This rank's index in [0, size) and the number of ranks. */
    int (*rank)(void *ctx);
    int (*size)(void *ctx);
    /* Whether collective buffers are host memory (true) or the creating backend's memory. */
    bool (*mem_is_host)(void *ctx);
    /* The timeout a collective called with timeout_s = 0 gets, seconds (> 0). */
    double (*default_timeout)(void *ctx);

    /* recv[i] = op over ranks r of send_r[i], i < count, on every rank. In place: send == recv.
     * The sum's order over ranks is the implementation's (NCCL: ring or tree); max is exact. */
    fm_status (*all_reduce)(void *ctx, const void *send, void *recv, int64_t count, fm_comm_dtype dtype,
                            fm_comm_op op, double timeout_s);
    /* all_reduce in place on HOST memory buf [count], count <= FM_COMM_HOST_MAX_ELEMS. */
    fm_status (*all_reduce_host)(void *ctx, void *buf, int64_t count, fm_comm_dtype dtype, fm_comm_op op,
                                 double timeout_s);
    /* send [size * recv_count]; rank r receives recv[i] = op over ranks q of send_q[r * recv_count + i],
     * i < recv_count (ZeRO-3's gradient reduce-scatter). In place: recv == send + rank * recv_count
     * (elements). */
    fm_status (*reduce_scatter)(void *ctx, const void *send, void *recv, int64_t recv_count, fm_comm_dtype dtype,
                                fm_comm_op op, double timeout_s);
    /* send [send_count]; recv [size * send_count] with recv[r * send_count + i] = send_r[i] on every
     * rank (ZeRO-3's weight gather). In place: send == recv + rank * send_count (elements). */
    fm_status (*all_gather)(void *ctx, const void *send, void *recv, int64_t send_count, fm_comm_dtype dtype,
                            double timeout_s);
    /* Personalized exchange (expert dispatch and combine; sequence <-> heads). send_counts,
     * send_displs, recv_counts, recv_displs: HOST int64 arrays [size]. Rank p sends
     * send[send_displs[q] .. + send_counts[q]) to rank q, which places it at
     * recv[recv_displs[p] .. + recv_counts[p]); so send_counts[q] on p must equal recv_counts[p]
     * on q (FM_ERR_ARG where the implementation can see it disagree: always on one rank). Regions
     * of one buffer may not overlap each other; send and recv may not overlap (no in-place). */
    fm_status (*all_to_all_v)(void *ctx, const void *send, const int64_t *send_counts, const int64_t *send_displs,
                              void *recv, const int64_t *recv_counts, const int64_t *recv_displs,
                              fm_comm_dtype dtype, double timeout_s);
    /* recv [count] = send [count] of rank root, on every rank; send is read on root only (may be
     * NULL elsewhere). In place: send == recv on root. */
    fm_status (*broadcast)(void *ctx, const void *send, void *recv, int64_t count, fm_comm_dtype dtype, int root,
                           double timeout_s);
    /* Returns once every rank has called it (or fails on the timeout). */
    fm_status (*barrier)(void *ctx, double timeout_s);

    /* A new communicator of the ranks that pass the same color (>= 0), ordered by key, then by
     * rank here (MPI_Comm_split); a collective call. *out is the caller's to fm_comm_free. Its
     * memory kind and default timeout are this communicator's. Errors: FM_ERR_ARG (color < 0),
     * FM_ERR_NOMEM. */
    fm_status (*split)(void *ctx, int color, int key, fm_comm *out);
    /* Frees the context (not a collective call on self; on mpi/nccl every rank calls it). */
    void (*destroy)(void *ctx);

    /* Optional (NULL: every collective is complete when it returns, as on self and mpi): waits
     * until every collective issued so far on this communicator has completed, or fails on the
     * first one whose timeout passed or that failed (FM_ERR_IO, naming it). The nccl
     * communicator's deferred mode (fm_comm_nccl.h) enqueues collectives without waiting; this is
     * its explicit check (the backend's host waits check too). timeout_s: as the collectives'
     * (0: each pending collective's own deadline). Not a collective call. */
    fm_status (*wait)(void *ctx, double timeout_s);

    /* ---- asynchronous all-to-all-v on a communication stream (optional: all three or none).
     * NULL (the self and mpi communicators, whose collectives are blocking and host-staged): the
     * fm_comm_mark / fm_comm_all_to_all_v_async / fm_comm_join wrappers below run the blocking
     * all_to_all_v at once -- the same result, complete on return, no overlap. The nccl
     * communicator (fm_comm_nccl.h) issues the exchange on a stream of its own, ordered against
     * the backend's op stream by CUDA events, so an expert-parallel chunk's exchange runs while
     * the op stream computes (fm_moe_ep.h "Overlap").
     * mark: *mark := the point the backend's op stream has reached now (the host does not wait).
     * all_to_all_v_async: all_to_all_v's exchange (same arguments, checks, errors, timeout and
     *   result), issued on the communication stream: it starts once the op stream has reached
     *   `after` (a mark; -1: the point it has reached now) and the communicator's earlier async
     *   exchanges are done; the host does not wait. The four count/displacement arrays are read
     *   before it returns (the caller may rewrite them). *ticket names its completion. Until
     *   join(*ticket) has been called, work issued on the op stream must not write `send` nor
     *   read or write `recv` (the caller double-buffers them).
     * join: work issued on the op stream from now on waits for exchange `ticket` and every async
     *   exchange issued before it (the host does not wait).
     * Marks and tickets are slots of a ring of FM_COMM_ASYNC_RING events: each stays valid while
     * fewer than FM_COMM_ASYNC_RING further marks and tickets are made. Not collective calls
     * (mark, join); all_to_all_v_async is one, in the order of every other collective. */
    fm_status (*mark)(void *ctx, int *mark);
    fm_status (*all_to_all_v_async)(void *ctx, const void *send, const int64_t *send_counts,
                                    const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                    const int64_t *recv_displs, fm_comm_dtype dtype, double timeout_s, int after,
                                    int *ticket);
    fm_status (*join)(void *ctx, int ticket);
} fm_comm_ops;

/* The events of the async exchanges' ring (fm_comm_ops.mark). */
#define FM_COMM_ASYNC_RING 64

/* A communicator: its table and its context. */
struct fm_comm {
    const fm_comm_ops *ops;
    void *ctx;
};

/* ---- calls through the table --------------------------------------------------------------- */

static inline int fm_comm_rank(const fm_comm *c) { return c->ops->rank(c->ctx); }
static inline int fm_comm_size(const fm_comm *c) { return c->ops->size(c->ctx); }
static inline bool fm_comm_mem_is_host(const fm_comm *c) { return c->ops->mem_is_host(c->ctx); }

static inline fm_status fm_comm_all_reduce(const fm_comm *c, const void *send, void *recv, int64_t count,
                                           fm_comm_dtype dtype, fm_comm_op op, double timeout_s) {
    return c->ops->all_reduce(c->ctx, send, recv, count, dtype, op, timeout_s);
}
static inline fm_status fm_comm_reduce_scatter(const fm_comm *c, const void *send, void *recv, int64_t recv_count,
                                               fm_comm_dtype dtype, fm_comm_op op, double timeout_s) {
    return c->ops->reduce_scatter(c->ctx, send, recv, recv_count, dtype, op, timeout_s);
}
static inline fm_status fm_comm_all_gather(const fm_comm *c, const void *send, void *recv, int64_t send_count,
                                           fm_comm_dtype dtype, double timeout_s) {
    return c->ops->all_gather(c->ctx, send, recv, send_count, dtype, timeout_s);
}
static inline fm_status fm_comm_all_to_all_v(const fm_comm *c, const void *send, const int64_t *send_counts,
                                             const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                             const int64_t *recv_displs, fm_comm_dtype dtype, double timeout_s) {
    return c->ops->all_to_all_v(c->ctx, send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype,
                                timeout_s);
}
static inline fm_status fm_comm_broadcast(const fm_comm *c, const void *send, void *recv, int64_t count,
                                          fm_comm_dtype dtype, int root, double timeout_s) {
    return c->ops->broadcast(c->ctx, send, recv, count, dtype, root, timeout_s);
}
static inline fm_status fm_comm_barrier(const fm_comm *c, double timeout_s) {
    return c->ops->barrier(c->ctx, timeout_s);
}

/* Whether c issues all_to_all_v_async on a stream of its own (false: the wrappers below are the
 * blocking collective). */
static inline bool fm_comm_has_async(const fm_comm *c) { return c->ops->all_to_all_v_async != NULL; }
/* fm_comm_ops.mark, or *mark = -1 (nothing to mark) when c has no async exchanges. */
static inline fm_status fm_comm_mark(const fm_comm *c, int *mark) {
    if (c->ops->mark) return c->ops->mark(c->ctx, mark);
    *mark = -1;
    return FM_OK;
}
/* fm_comm_ops.all_to_all_v_async, or (no async exchanges) all_to_all_v itself, complete on
 * return, with *ticket = -1. */
static inline fm_status fm_comm_all_to_all_v_async(const fm_comm *c, const void *send, const int64_t *send_counts,
                                                   const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                                   const int64_t *recv_displs, fm_comm_dtype dtype, double timeout_s,
                                                   int after, int *ticket) {
    if (c->ops->all_to_all_v_async)
        return c->ops->all_to_all_v_async(c->ctx, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                                          dtype, timeout_s, after, ticket);
    *ticket = -1;
    return c->ops->all_to_all_v(c->ctx, send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype,
                                timeout_s);
}
/* fm_comm_ops.join; FM_OK at once for ticket < 0 or a communicator without async exchanges. */
static inline fm_status fm_comm_join(const fm_comm *c, int ticket) {
    return ticket >= 0 && c->ops->join ? c->ops->join(c->ctx, ticket) : FM_OK;
}

/* c->ops->wait when the communicator has one, else FM_OK at once (fm_comm_ops.wait). */
static inline fm_status fm_comm_wait(const fm_comm *c, double timeout_s) {
    return c && c->ops && c->ops->wait ? c->ops->wait(c->ctx, timeout_s) : FM_OK;
}

/* Frees c's context (NULL or an empty communicator: nothing) and empties *c. */
void fm_comm_free(fm_comm *c);

/* ---- host-value wrappers (the trainer: loss sums, gradient norms, token counts, overflow
 * flags). In place on host memory vals [n], n <= FM_COMM_HOST_MAX_ELEMS; errors: those of
 * all_reduce_host. ---------------------------------------------------------------------------- */
fm_status fm_comm_allreduce_sum_f64(const fm_comm *c, double *vals, int64_t n, double timeout_s);
fm_status fm_comm_allreduce_max_f64(const fm_comm *c, double *vals, int64_t n, double timeout_s);
fm_status fm_comm_allreduce_sum_f32(const fm_comm *c, float *vals, int64_t n, double timeout_s);
fm_status fm_comm_allreduce_max_f32(const fm_comm *c, float *vals, int64_t n, double timeout_s);
fm_status fm_comm_allreduce_sum_i64(const fm_comm *c, int64_t *vals, int64_t n, double timeout_s);
fm_status fm_comm_allreduce_max_i64(const fm_comm *c, int64_t *vals, int64_t n, double timeout_s);

/* ---- process groups per mesh axis (DESIGN.md §6) -------------------------------------------- */

typedef enum fm_mesh_axis {
    FM_AXIS_WORLD = 0, /* every rank */
    FM_AXIS_DP,        /* data parallel: ZeRO-3 sharding of weights, grads and optimizer state */
    FM_AXIS_EP,        /* expert parallel: all-to-all dispatch */
    FM_AXIS_SP,        /* sequence parallel: attention's all-to-all between sequence and heads */
    FM_AXIS_COUNT
} fm_mesh_axis;

/* "world", "dp", "ep", "sp" ("?" otherwise). */
const char *fm_mesh_axis_name(fm_mesh_axis axis);

/* One axis of the mesh: its name, its degree (ranks along it) and the communicator over the
 * ranks that share this rank's coordinates on every other axis. */
typedef struct fm_process_group {
    fm_mesh_axis axis;
    const char *name; /* fm_mesh_axis_name(axis) */
    int degree;       /* == fm_comm_size(&comm) */
    fm_comm comm;
} fm_process_group;

/* Every axis of this rank's mesh; g.axis[FM_AXIS_X] is axis X (axis[FM_AXIS_WORLD].comm is the
 * world communicator the group was made from, not owned by the group). */
typedef struct fm_comm_group {
    fm_process_group axis[FM_AXIS_COUNT];
} fm_comm_group;

/* The groups of the mesh dp x ep x sp over `world` (degrees >= 1); a collective call on world.
 * The world has W = dp * sp ranks; expert parallelism reuses them: ep divides W.
 * Rank layout (world rank r): r = dp_index * sp + sp_index. The sp group of r is the sp ranks
 * with its dp_index (contiguous: [dp_index * sp, + sp)); the dp group is the dp ranks with its
 * sp_index (stride sp); the ep group is the contiguous block of ep ranks [r / ep * ep, + ep).
 * Each axis's communicator orders its ranks by world rank. With one rank every degree is 1 and
 * every axis is a split of world. The group keeps a copy of *world (the caller keeps ownership
 * of it) and owns the axes' communicators: free it with fm_comm_group_free. Errors: FM_ERR_ARG
 * (a degree < 1, dp * sp != W, ep not dividing W: naming them), FM_ERR_UNSUPPORTED (the world's
 * split gave a communicator of another size than the axis's degree: the self communicator
 * asked for a mesh over several ranks), FM_ERR_NOMEM, the split's errors; on error *g is
 * empty. */
fm_status fm_comm_group_create(fm_comm_group *g, const fm_comm *world, int dp, int ep, int sp);
void fm_comm_group_free(fm_comm_group *g);

/* ---- the one-rank communicator (fm_comm_self.c) --------------------------------------------- */

/* Creates the communicator of one rank (rank 0 of 1). be == NULL: buffers are host memory and
 * copies are memmove; be != NULL: buffers are be's memory and copies are be->ops->copy
 * (FM_COPY_D2D), so device pointers work; be must outlive the communicator. default_timeout_s:
 * the timeout of a collective called with 0 (0 here: FM_COMM_DEFAULT_TIMEOUT_S). Every
 * collective checks its arguments by the contract above and then is the identity or one copy:
 * all_reduce, reduce_scatter, all_gather and broadcast copy count elements from send to recv
 * (nothing when in place); all_to_all_v checks send_counts[0] == recv_counts[0] and copies
 * that block; barrier returns. Errors: FM_ERR_ARG (out NULL, negative or NaN timeout),
 * FM_ERR_NOMEM. */
fm_status fm_comm_self_create(fm_comm *out, const struct fm_backend *be, double default_timeout_s);

/* ---- the MPI communicator (fm_comm_mpi.c; CPU ranks, one process per rank) -------------------
 * Built when CMake finds MPI (find_package(MPI COMPONENTS C), Open MPI in CI); otherwise these
 * functions exist and fm_comm_mpi_world returns FM_ERR_UNSUPPORTED. This header never includes
 * mpi.h.
 *
 * Buffers: be == NULL: host memory, handed to MPI as they are. be whose memory is host memory
 * (be->ops->host_memory, the CPU backend): the same, but fm_comm_mem_is_host() is false (the
 * buffers are the backend's). be whose memory is not host memory (a GPU): every collective is
 * staged through two host buffers of stage_bytes each, fixed at creation, in chunks, with the
 * backend's synchronous copy (D2H, the MPI collective on the host copy, H2D) -- so several ranks
 * can share one GPU in tests; each copy is a host sync, so this path is for tests, not speed.
 * In-place reduce_scatter is staged on host memory too (MPI's MPI_IN_PLACE form puts the result
 * at offset 0, not at rank * recv_count).
 *
 * Timeouts: every collective posts the nonblocking MPI form (MPI_Iallreduce,
 * MPI_Ireduce_scatter_block, MPI_Iallgather, MPI_Ialltoallv, MPI_Ibcast, MPI_Ibarrier) and polls
 * MPI_Test, with short sleeps, until it completes or the timeout passes. On a timeout it returns
 * FM_ERR_IO ("rank 1 of 4: all_reduce(fp64 sum, 4 elements) timed out after 2 s ..."): the
 * request is ABANDONED, still pending, and may still write its buffers; the communicator is
 * marked broken (every later collective on it fails with FM_ERR_IO, destroy then leaks its
 * context and staging buffers rather than free memory MPI may write), and the process must
 * stop: call fm_comm_mpi_abort, which takes every rank down (MPI_Abort). The communicators use
 * MPI_ERRORS_RETURN, so a transport error comes back as FM_ERR_IO with MPI_Error_string's text.
 *
 * Counts: MPI counts are int. A count, or a count or displacement of all_to_all_v, that does not
 * fit in int (after staging's chunking, where it applies) is FM_ERR_ARG naming it.
 * Reductions: sum and max of fp32, fp64 and int64 (MPI_SUM, MPI_MAX; the sum's order is
 * MPI's); bf16 sum and max as MPI user operations on 16-bit elements: each combination of two
 * partial results is computed in fp32 and rounded to bf16 (W - 1 roundings in MPI's order, where
 * NCCL rounds once: for tests, exact when every partial sum is a bf16 value). all_to_all_v on staged memory first
 * agrees on the largest block with one extra all-reduce (max) and moves it in rounds. */

/* The default staging size per buffer of a communicator over non-host backend memory. */
#define FM_COMM_MPI_STAGE_BYTES ((size_t)4 << 20)

/* Whether this build has the MPI communicator. */
bool fm_comm_mpi_built(void);
/* A communicator over every process of the MPI job (a duplicate of MPI_COMM_WORLD, so each call
 * gives an independent communicator). Calls MPI_Init_thread (MPI_THREAD_FUNNELED) when MPI is
 * not initialized yet; a collective call. be: as above (must outlive the communicator; needs a
 * copy op). default_timeout_s: 0 means FM_COMM_DEFAULT_TIMEOUT_S. stage_bytes: the size of each
 * of the two staging buffers (0: FM_COMM_MPI_STAGE_BYTES; at least 8 * ranks; only allocated
 * when staging applies). Errors: FM_ERR_ARG (out NULL, a negative timeout, a backend without a
 * copy op, stage_bytes too small), FM_ERR_UNSUPPORTED (no MPI in this build; MPI finalized;
 * MPI_Init_thread gave less than MPI_THREAD_FUNNELED), FM_ERR_IO (an MPI call failed),
 * FM_ERR_NOMEM. */
fm_status fm_comm_mpi_world(fm_comm *out, const struct fm_backend *be, double default_timeout_s,
                            size_t stage_bytes);
/* MPI_Finalize, when MPI is initialized and not yet finalized (otherwise nothing); a collective
 * call: free every mpi communicator first. Errors: FM_ERR_IO. */
fm_status fm_comm_mpi_finalize(void);
/* This process's rank and the number of ranks on its node, by
 * MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED) (initializes MPI as fm_comm_mpi_world
 * does). Errors: FM_ERR_UNSUPPORTED (no MPI in this build, MPI finalized), FM_ERR_IO (an MPI call
 * failed). */
fm_status fm_comm_mpi_local(int *local_rank, int *local_size);
/* Takes the whole job down: MPI_Abort(MPI_COMM_WORLD, code). For the CLI after a collective
 * failed (a timeout leaves a request pending: the process cannot continue). Returns only when
 * MPI is not built or not initialized (the caller then exits). */
void fm_comm_mpi_abort(int code);

/* ---- the launcher's environment (fm_comm.c) ---------------------------------------------------
 * comm never reads the environment (DESIGN.md §3): the client reads these variables and hands
 * their values over once, at start, before any call that uses them (fm_comm_launcher,
 * fm_comm_local, fm_comm_world_create, fm_comm_world_create_kind, fm_comm_nccl_world). The CLI
 * does so in main (src/cli/cli_env.c, cli_comm_env_install). Until then every variable reads as
 * unset: rank 0 of 1, no node-local rank, NVLink multicast turned off. */
enum { FM_COMM_ENV_COUNT = 13 };
/* OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, PMI_RANK, PMI_SIZE, SLURM_PROCID, SLURM_NTASKS,
 * OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS,
 * SLURM_LOCALID, SLURM_NTASKS_PER_NODE, NCCL_NVLS_ENABLE, in that order. */
extern const char *const fm_comm_env_names[FM_COMM_ENV_COUNT];
/* Hands comm the variables' values: values[i] is fm_comm_env_names[i]'s (NULL: unset), copied
 * (the caller's strings may go). Replaces what an earlier call handed. Not thread-safe: call it
 * before other threads use comm. Errors: FM_ERR_NOMEM (nothing changed). */
fm_status fm_comm_env_set(const char *const values[FM_COMM_ENV_COUNT]);
/* The value handed for `name` (one of fm_comm_env_names), NULL when unset, not handed, or not
 * one of them. */
const char *fm_comm_env_get(const char *name);

/* ---- the run's world (fm_comm.c): from the launcher ------------------------------------------
 * The rank and size the launcher gave this process, from its environment as handed to
 * fm_comm_env_set (read before MPI is initialized, so a one-rank run never initializes MPI):
 * OMPI_COMM_WORLD_RANK/SIZE (Open MPI's mpirun), PMI_RANK/SIZE (MPICH, Intel MPI, srun --mpi=pmi2), SLURM_PROCID/SLURM_NTASKS (srun),
 * in that order; none of them: rank 0 of 1. *source gets the variables' family ("OMPI_COMM_WORLD",
 * "PMI", "SLURM", or "none"). Errors: FM_ERR_ARG when a variable is not an integer or the rank is
 * outside [0, size), naming it. */
fm_status fm_comm_launcher(int *rank, int *size, const char **source);

/* The world communicator of a run: with more than one rank by fm_comm_launcher, the MPI
 * communicator (fm_comm_mpi_world over be, checked to have the launcher's rank and size); with one
 * rank, the self communicator over be (bit-identical to a build without MPI). default_timeout_s as
 * fm_comm_self_create. Errors: FM_ERR_UNSUPPORTED (several ranks but no MPI in this build: naming
 * the fix), FM_ERR_IO (MPI's rank/size disagree with the launcher's), those of the creators. */
fm_status fm_comm_world_create(fm_comm *out, const struct fm_backend *be, double default_timeout_s);

/* ---- choosing the communicator (fm_comm.c): `flatmoe train --comm auto|mpi|nccl` -------------- */

typedef enum fm_comm_kind {
    FM_COMM_KIND_AUTO = 0, /* self on one rank; several: nccl when usable (fm_comm_nccl_usable), else mpi */
    FM_COMM_KIND_MPI,      /* the mpi communicator, even on one rank (host-staged on a GPU) */
    FM_COMM_KIND_NCCL,     /* the nccl communicator, even on one rank */
    FM_COMM_KIND_COUNT
} fm_comm_kind;

/* "auto", "mpi", "nccl" ("?" otherwise). */
const char *fm_comm_kind_name(fm_comm_kind k);
/* *out = the kind named s ("auto", "mpi" or "nccl"). Errors: FM_ERR_ARG naming s and the choices. */
fm_status fm_comm_kind_parse(const char *s, fm_comm_kind *out);

/* This process's rank among the launch's ranks on its node, and their number: from
 * OMPI_COMM_WORLD_LOCAL_RANK/_LOCAL_SIZE (Open MPI), MPI_LOCALRANKID/MPI_LOCALNRANKS (MPICH's
 * Hydra), SLURM_LOCALID/SLURM_NTASKS_PER_NODE (srun, when the latter is a plain number), in that
 * order; otherwise, with several ranks and MPI built, by MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)
 * (fm_comm_mpi_local; initializes MPI); one rank: 0 of 1. *source names where it came from
 * (may be NULL). Errors: FM_ERR_ARG (a variable that is not a rank in [0, size)), FM_ERR_UNSUPPORTED
 * (several ranks, no local-rank variable and no MPI), those of fm_comm_mpi_local. */
fm_status fm_comm_local(int *local_rank, int *local_size, const char **source);

/* The world communicator of kind `kind` (auto: as fm_comm_kind's comment; the choice is written to
 * *chosen when chosen is not NULL). nccl's check mode: `check` (fm_comm_nccl.h). With
 * FM_COMM_KIND_AUTO and one rank this is fm_comm_world_create exactly (the self communicator).
 * Errors: those of fm_comm_world_create, fm_comm_mpi_world and fm_comm_nccl_world; FM_ERR_ARG for
 * a bad kind; FM_ERR_UNSUPPORTED for `nccl` in a build without it (naming the fix). */
fm_status fm_comm_world_create_kind(fm_comm *out, const struct fm_backend *be, double default_timeout_s,
                                    fm_comm_kind kind, int nccl_check, fm_comm_kind *chosen);

/* ---- for implementations (fm_comm.c): argument checks and messages --------------------------- */

/* Describes a collective call as messages print it: "all_reduce(fp64 sum, 16 elements)"
 * (op < 0: no op; count < 0: no count). Returns buf. */
const char *fm_comm_describe(char *buf, size_t n, const char *collective, fm_comm_dtype dtype, int op, int64_t count);
/* The effective timeout: timeout_s, or dflt when timeout_s == 0. FM_ERR_ARG when timeout_s < 0
 * or NaN, with "rank R of S: WHAT: timeout ... must be >= 0 (0: the default, D s)". */
fm_status fm_comm_check_timeout(int rank, int size, const char *what, double timeout_s, double dflt, double *eff);
/* FM_ERR_ARG unless dtype is a valid fm_comm_dtype and op (< 0: a collective without one) a
 * valid fm_comm_op. */
fm_status fm_comm_check_type(int rank, int size, const char *what, fm_comm_dtype dtype, int op);
/* FM_ERR_ARG unless count >= 0 and (count == 0 or buf != NULL); names the buffer ("send"). */
fm_status fm_comm_check_buf(int rank, int size, const char *what, const char *buf_name, const void *buf,
                            int64_t count);
/* The arguments of all_to_all_v on rank r of W (the communicator's table, fm_comm_h): the four
 * count/displacement host arrays of W elements non-NULL and >= 0, the self-block's send and
 * receive counts equal, the buffers present for their totals, the send and receive blocks'
 * byte extents disjoint. tag follows "rank R of W" in the messages ("" or " (nccl)"). Gives
 * total[0] / total[1], the elements sent / received, and *biggest, the largest send count.
 * Errors: FM_ERR_ARG naming the array, element and value. */
fm_status fm_comm_check_all_to_all_v(int r, int W, const char *tag, const char *what, const void *send,
                                     const int64_t *send_counts, const int64_t *send_displs, const void *recv,
                                     const int64_t *recv_counts, const int64_t *recv_displs, fm_comm_dtype dtype,
                                     int64_t total[2], int64_t *biggest);
/* The extents of reduce_scatter (send_whole: send holds W blocks of count elements, recv one) or
 * all_gather (recv holds the W blocks, send one) on rank r of W: W * count must not overflow, and
 * the one-block buffer is either rank r's block of the whole one (the in-place form: *in_place)
 * or disjoint from it. tag follows "rank R of W" in the overflow message ("" or " (nccl)").
 * Errors: FM_ERR_ARG (the overflow; fm_comm_check_disjoint's, naming "send" and "recv"). */
fm_status fm_comm_check_blocks(int r, int W, const char *tag, const char *what, const void *send, const void *recv,
                               int64_t count, fm_comm_dtype dtype, bool send_whole, bool *in_place);
/* FM_ERR_ARG when the byte ranges [a, a+na) and [b, b+nb) overlap (empty ranges never do). */
fm_status fm_comm_check_disjoint(int rank, int size, const char *what, const char *a_name, const void *a, size_t na,
                                 const char *b_name, const void *b, size_t nb);

#ifdef __cplusplus
}
#endif
#endif
