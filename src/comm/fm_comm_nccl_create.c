/* The NCCL communicator's creation (the world over the launcher's ranks, the unique id carried by
 * MPI), split and destruction (fm_comm_nccl.h), and the live communicators the CUDA backend's wait
 * hook checks; the collectives are fm_comm_nccl.c's. Without NCCL (FM_HAVE_NCCL undefined: the CPU
 * build, or a CUDA build where CMake found no NCCL) the file gives the functions that say so.
 * Sources: NCCL 2.28's API documentation (ncclCommInitRankConfig with ncclConfig_t, non-blocking
 * communicators polled with ncclCommGetAsyncError, ncclCommSplit, ncclCommFinalize/Destroy/Abort). */
#include "fm_comm_nccl.h"

#include "../backend/fm_backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

#include "fm_comm_nccl_internal.h"

/* ---- the live communicators: the backend's wait hook checks every one of them -------------- */

#define LIVE_MAX 64
static nccl_ctx *live[LIVE_MAX];
static int n_live;


/* The backend's wait hook (fm_cuda_backend_set_wait_hook): the first failure of any live
 * communicator (a deadline passed, an asynchronous NCCL error); *idle when none has a collective
 * pending (the backend then waits the ordinary, blocking way). Never waits. */
static fm_status watch_all(void *arg, bool *idle) {
    (void)arg;
    *idle = true;
    for (int i = 0; i < n_live; i++) {
        FM_TRY(fm_nccl_poll(live[i]));
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
/* ---- creation, split, destruction ------------------------------------------------------------- */

void fm_nccl_destroy(void *ctx) {
    nccl_ctx *n = ctx;
    if (!n) return;
    live_remove(n);
    if (n->comm && fm_nccl_wait_all(n, n->default_timeout) == FM_OK) {
        /* ncclCommFinalize flushes the communicator's work; non-blocking: polled, bounded */
        const fm_status s = fm_nccl_settle(n, "destroy", "ncclCommFinalize", ncclCommFinalize(n->comm), n->default_timeout);
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
        const fm_status s = fm_nccl_failed(n, "create", "ncclCommUserRank/ncclCommCount", r);
        fm_nccl_destroy(n);
        return s;
    }
    for (; n->n_ev < PENDING; n->n_ev++)
        if (cudaEventCreateWithFlags(&n->ev[n->n_ev], cudaEventDisableTiming) != cudaSuccess) {
            (void)cudaGetLastError();
            const fm_status s = fm_nccl_broke_with(n, "nccl communicator: cudaEventCreateWithFlags failed (the ring of "
                                           "completion events)");
            fm_nccl_destroy(n);
            return s == FM_OK ? FM_ERR_IO : s;
        }
    for (; n->n_order < FM_COMM_ASYNC_RING; n->n_order++)
        if (cudaEventCreateWithFlags(&n->order[n->n_order], cudaEventDisableTiming) != cudaSuccess) {
            (void)cudaGetLastError();
            const fm_status s = fm_nccl_broke_with(n, "nccl communicator: cudaEventCreateWithFlags failed (the async "
                                           "exchanges' order events)");
            fm_nccl_destroy(n);
            return s == FM_OK ? FM_ERR_IO : s;
        }
    if (cudaStreamCreateWithFlags(&n->cs, cudaStreamNonBlocking) != cudaSuccess) {
        (void)cudaGetLastError();
        n->cs = NULL;
        const fm_status s = fm_nccl_broke_with(n, "nccl communicator: cudaStreamCreateWithFlags failed (the communication "
                                       "stream)");
        fm_nccl_destroy(n);
        return s == FM_OK ? FM_ERR_IO : s;
    }
    n->stage = be->ops->mem_alloc(be->ctx, STAGE_BYTES);
    if (!n->stage) {
        (void)fm_nccl_broke_with(n, "nccl communicator: no device memory for its barrier's value");
        fm_nccl_destroy(n);
        return fm_error(FM_ERR_NOMEM, "rank %d of %d (nccl): cannot allocate the %zu-byte device buffer of the "
                        "barrier", n->rank, n->size, STAGE_BYTES);
    }
    live_add(n);
    out->ops = &fm_nccl_ops;
    out->ctx = n;
    return FM_OK;
}

/* Polls a communicator being created (ncclCommInitRankConfig, ncclCommSplit: non-blocking) until
 * it is ready or timeout_s passes; aborts it on failure. */
static fm_status wait_ready(ncclComm_t comm, ncclResult_t r, int rank, int size, const char *what, double timeout_s) {
    const double t0 = fm_nccl_now_s();
    for (long polls = 0; r == ncclInProgress; polls++) {
        ncclResult_t a = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(comm, &a);
        r = q != ncclSuccess ? q : a;
        if (r != ncclInProgress) break;
        if (fm_nccl_now_s() - t0 > timeout_s) {
            (void)ncclCommAbort(comm);
            return fm_error(FM_ERR_IO, "rank %d of %d (nccl): %s did not complete within %g s (another rank did not "
                            "join it, or died); aborted", rank, size, what, timeout_s);
        }
        fm_nccl_nap(polls);
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

fm_status fm_nccl_split(void *ctx, int color, int key, fm_comm *out) {
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
    FM_TRY(fm_nccl_wait_all(n, 0)); /* the parent's pending work first: a split is a collective of the parent */
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
        return fm_nccl_failed(n, what, "ncclCommSplit", r);
    }
    /* A non-blocking split runs as a job of the parent: NCCL stores the child into nc only when
     * that job completes (init.cc: "*newcomm should be NCCL_COMM_NULL until comm split fully
     * complete"), and the parent answers ncclInProgress until then. So poll the parent first,
     * re-reading nc, then the child's own creation. */
    const double t0 = fm_nccl_now_s();
    for (long polls = 0; r == ncclInProgress && !__atomic_load_n(&n->split_out, __ATOMIC_ACQUIRE); polls++) {
        ncclResult_t a = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(n->comm, &a);
        r = q != ncclSuccess ? q : a;
        if (r != ncclInProgress) break;
        if (fm_nccl_now_s() - t0 > n->default_timeout) {
            fm_comm_free(&host);
            BROKE(n, "rank %d of %d (nccl): %s did not complete within %g s (another rank did not join it, or died); "
                  "the communicator is aborted and the job must stop", n->rank, n->size, what, n->default_timeout);
        }
        fm_nccl_nap(polls);
    }
    ncclComm_t nc = __atomic_load_n(&n->split_out, __ATOMIC_ACQUIRE);
    n->split_out = NULL;
    if (r != ncclSuccess && r != ncclInProgress) {
        fm_comm_free(&host);
        return fm_nccl_failed(n, what, "ncclCommSplit (the parent's split job)", r);
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

/* NCCL_NVLS_ENABLE=0 unless the user set it (fm_comm_nccl.h: NVLink multicast stays off). The
 * user's value is the one the client handed (fm_comm_env_set); NCCL reads the environment itself,
 * so the override is written there. */
static void nvls_off(void) {
    const char *v = fm_comm_env_get("NCCL_NVLS_ENABLE");
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
