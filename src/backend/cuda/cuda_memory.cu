/* The CUDA backend's memory, stream and event ops (fm_backend.h): mem_alloc (cuda_vmm.cu's blocks,
 * or cudaMalloc where the device has no VMM; zero-filled), mem_free, mem_set, copy (synchronous:
 * issued on the compute stream, then waited for), the buffer kinds (device, pinned, host),
 * copy_async on the streams, set_op_stream, the event pool (record, wait, sync), stream_sync and
 * sync, status (the sticky first error and the device-error flags) and the count of host waits.
 * Allocation is for launch time; no op of a step allocates.
 * Every host wait (copy, event_sync, stream_sync, sync) adds one to host_syncs, and goes through
 * host_wait (the wait hook's watchdog, when one is set). The accessors for code that must order
 * its own CUDA work with the backend's (the nccl communicator): fm_cuda_backend_stream, _device,
 * _set_wait_hook (fm_backend_cuda.h).
 */
#include "cuda_internal.h"
#include "cuda_vmm.h"

#include <cstdio>
#include <cstring>
#include <ctime>
#include <sched.h>

namespace {

/* The direction from the pointers themselves (unified virtual addressing, every 64-bit CUDA
 * device): a copy whose "device" side is pinned host memory (the streamed optimizer's master
 * weights, uploaded at launch) is then still right. The caller's kind documents intent only. */
cudaMemcpyKind memcpy_kind(fm_copy_kind kind) {
    (void)kind;
    return cudaMemcpyDefault;
}

cudaStream_t stream_of(fm_cuda_ctx *c, fm_stream s) {
    FM_ASSERT(s >= 0 && s < FM_STREAM_COUNT);
    switch (s) {
    case FM_STREAM_COPY_IN: return c->copy_in;
    case FM_STREAM_COPY_OUT: return c->copy_out;
    case FM_STREAM_UPDATE: return c->update;
    case FM_STREAM_OPT_COPY_IN: return c->opt_in;
    case FM_STREAM_OPT_COPY_OUT: return c->opt_out;
    case FM_STREAM_OPS: return c->stream;
    default: return c->compute;
    }
}

cudaEvent_t event_of(fm_cuda_ctx *c, int event) {
    FM_ASSERT(event >= 0 && event < FM_EVENT_POOL);
    return c->events[event];
}

/* The device-error flags the kernels raised (cuda_internal.h), as the context's error; their
 * stores are visible on the host once the kernels completed, i.e. after a sync point. */
void check_flags(fm_cuda_ctx *c) {
    if (c->err != FM_OK || !c->flags_host) return;
    static const char *const what[FM_CUDA_FLAGS] = {
        "a top-k expert id is outside [0,E)", "a target is outside [0,V) and not ignore_index",
        "a target is outside [0,V) and not ignore_index", "?"};
    static const char *const op[FM_CUDA_FLAGS] = {"moe_route_index", "cross_entropy", "lce_finalize", "?"};
    for (int i = 0; i < FM_CUDA_FLAGS; i++)
        if (c->flags_host[i]) {
            c->err = FM_ERR_ARG;
            snprintf(c->err_msg, sizeof c->err_msg, "CUDA backend: %s: %s (found on the device: a caller bug)", op[i],
                     what[i]);
            return;
        }
}

/* The host waits for stream s (ev NULL) or event ev: cudaStreamSynchronize / cudaEventSynchronize,
 * unless a wait hook is set (fm_cuda_backend_set_wait_hook): then the hook is asked first and
 * between polls of the stream or event (cudaStreamQuery / cudaEventQuery; sched_yield for the
 * first second, then 1 ms sleeps), so that work which will never finish (a collective whose peer
 * died) ends the wait with the hook's error, recorded as the context's (status returns it),
 * instead of hanging. Once the hook answers idle (nothing of its own is pending on the device),
 * the rest is the blocking wait, so a hook costs nothing when no collective is in flight.
 * Returns false when the wait failed (the error is recorded). */
bool host_wait(fm_cuda_ctx *c, cudaStream_t s, cudaEvent_t ev) {
    if (c->wait_hook) {
        struct timespec t0;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (;;) {
            bool idle = false;
            const fm_status st = c->wait_hook(c->wait_hook_arg, &idle);
            if (st != FM_OK) {
                if (c->err == FM_OK) {
                    c->err = st;
                    snprintf(c->err_msg, sizeof c->err_msg, "%s", fm_errmsg());
                }
                return false;
            }
            if (idle) break;
            const cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(s);
            if (e == cudaSuccess) return true;
            if (e != cudaErrorNotReady) return FM_CUDA_OK(c, e);
            struct timespec t;
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec) < 1.0) {
                sched_yield();
            } else {
                const struct timespec ms = {0, 1000000L};
                nanosleep(&ms, NULL);
            }
        }
    }
    return ev ? FM_CUDA_OK(c, cudaEventSynchronize(ev)) : FM_CUDA_OK(c, cudaStreamSynchronize(s));
}

} // namespace

extern "C" {

/* A VMM block (cuda_vmm.h: reserved, backed and mapped in chunks, so mem_release can give its
 * memory back; aligned to the granularity, 2 MiB) where the device has VMM, else cudaMalloc
 * (256-byte aligned); zero-filled. NULL when it cannot (out of memory, or another error, which is
 * recorded; the out-of-memory error is cleared so the context stays usable). Launch time: the
 * zero fill is waited for (not counted as a host sync, like the CPU's malloc). */
void *fm_cuda_mem_alloc(void *ctx, size_t bytes) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (fm_cuda_vmm_info(ctx, NULL, NULL)) return fm_cuda_vmm_alloc(c, bytes);
    void *p = NULL;
    const cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (e != cudaErrorMemoryAllocation)
            fm_cuda_record(c, FM_ERR_UNSUPPORTED, "cudaMalloc", cudaGetErrorString(e), __FILE__, __LINE__);
        return NULL;
    }
    if (!FM_CUDA_OK(c, cudaMemsetAsync(p, 0, bytes ? bytes : 1, c->stream)) ||
        !FM_CUDA_OK(c, cudaStreamSynchronize(c->stream))) {
        (void)cudaFree(p);
        return NULL;
    }
    return p;
}

void fm_cuda_mem_free(void *ctx, void *p) {
    if (!p || fm_cuda_vmm_free(ctx_of(ctx), p)) return; /* a VMM block: waited for, unmapped, released */
    FM_CUDA_CHECK(ctx_of(ctx), cudaFree(p)); /* cudaFree waits for the device */
}

void fm_cuda_mem_set(void *ctx, void *dst, int byte, size_t bytes) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (bytes) FM_CUDA_CHECK(c, cudaMemsetAsync(dst, byte, bytes, c->stream));
}

/* Synchronous: issued on the compute stream (so it follows every op before it), then waited for;
 * a host sync. */
void fm_cuda_copy(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (bytes == 0 || dst == src) return;
    c->host_syncs++;
    FM_CUDA_CHECK(c, cudaMemcpyAsync(dst, src, bytes, memcpy_kind(kind), c->stream));
    (void)host_wait(c, c->stream, NULL);
}

/* DEVICE: mem_alloc. PINNED: cudaHostAlloc (page-aligned), zero-filled on the host. HOST:
 * fm_malloc (zero-filled; 64-byte aligned, as every kind of the CPU backend). NULL when it
 * cannot (the CUDA error is cleared, not recorded: the caller reports FM_ERR_NOMEM naming the
 * live set). */
void *fm_cuda_buffer_alloc(void *ctx, fm_buffer_kind kind, size_t bytes) {
    FM_ASSERT(kind >= 0 && kind < FM_BUFFER_KINDS);
    if (kind == FM_BUFFER_DEVICE) return fm_cuda_mem_alloc(ctx, bytes);
    const size_t n = bytes ? bytes : 1;
    void *p = NULL;
    if (kind == FM_BUFFER_PINNED) {
        if (cudaHostAlloc(&p, n, cudaHostAllocDefault) != cudaSuccess) {
            (void)cudaGetLastError();
            return NULL;
        }
        memset(p, 0, n);
        return p;
    }
    return fm_malloc(n); /* zero-filled */
}

void fm_cuda_buffer_free(void *ctx, fm_buffer_kind kind, void *p) {
    FM_ASSERT(kind >= 0 && kind < FM_BUFFER_KINDS);
    if (!p) return;
    if (kind == FM_BUFFER_DEVICE) fm_cuda_mem_free(ctx, p);
    else if (kind == FM_BUFFER_PINNED) FM_CUDA_CHECK(ctx_of(ctx), cudaFreeHost(p)); /* waits for the device */
    else fm_free(p);
}

/* cudaMemcpyAsync on `stream` (the host side should be pinned: pageable memory makes the copy
 * synchronous with respect to the host). */
void fm_cuda_copy_async(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind, fm_stream stream) {
    fm_cuda_ctx *c = ctx_of(ctx);
    const cudaStream_t s = stream_of(c, stream);
    if (bytes == 0 || dst == src) return;
    FM_CUDA_CHECK(c, cudaMemcpyAsync(dst, src, bytes, memcpy_kind(kind), s));
}

void fm_cuda_event_record(void *ctx, int event, fm_stream stream) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_CUDA_CHECK(c, cudaEventRecord(event_of(c, event), stream_of(c, stream)));
}

void fm_cuda_event_wait(void *ctx, fm_stream stream, int event) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_CUDA_CHECK(c, cudaStreamWaitEvent(stream_of(c, stream), event_of(c, event), 0));
}

void fm_cuda_event_sync(void *ctx, int event) {
    fm_cuda_ctx *c = ctx_of(ctx);
    const cudaEvent_t ev = event_of(c, event);
    c->host_syncs++;
    (void)host_wait(c, NULL, ev);
}

void fm_cuda_stream_sync(void *ctx, fm_stream stream) {
    fm_cuda_ctx *c = ctx_of(ctx);
    const cudaStream_t s = stream_of(c, stream);
    c->host_syncs++;
    (void)host_wait(c, s, NULL);
}

/* The op stream moves to compute or update; cuBLAS and cuDNN follow it. */
void fm_cuda_set_op_stream(void *ctx, fm_stream stream) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(stream == FM_STREAM_COMPUTE || stream == FM_STREAM_UPDATE);
    const cudaStream_t s = stream_of(c, stream);
    if (s == c->stream) return;
    c->stream = s;
    if (cublasSetStream(c->cublas, s) != CUBLAS_STATUS_SUCCESS && c->err == FM_OK) {
        c->err = FM_ERR_UNSUPPORTED;
        snprintf(c->err_msg, sizeof c->err_msg, "cuda backend: cublasSetStream failed in set_op_stream");
    }
    if (cudnnSetStream(c->cudnn, s) != CUDNN_STATUS_SUCCESS && c->err == FM_OK) {
        c->err = FM_ERR_UNSUPPORTED;
        snprintf(c->err_msg, sizeof c->err_msg, "cuda backend: cudnnSetStream failed in set_op_stream");
    }
}

/* All six streams; one host sync. */
void fm_cuda_sync(void *ctx) {
    fm_cuda_ctx *c = ctx_of(ctx);
    c->host_syncs++;
    const cudaStream_t all[6] = {c->compute, c->update, c->copy_in, c->copy_out, c->opt_in, c->opt_out};
    for (int i = 0; i < 6; i++)
        if (!host_wait(c, all[i], NULL)) return;
}

/* The first recorded error (with its message through fm_error), else a raised device-error flag
 * (FM_ERR_ARG; visible once the kernel that raised it completed, i.e. after a sync point), else
 * FM_OK. Does not wait for the device. */
fm_status fm_cuda_status(void *ctx) {
    fm_cuda_ctx *c = ctx_of(ctx);
    check_flags(c);
    if (c->err == FM_OK) return FM_OK;
    return fm_error(c->err, "%s", c->err_msg);
}

uint64_t fm_cuda_host_sync_count(void *ctx) { return ctx_of(ctx)->host_syncs; }

/* ---- accessors (fm_backend_cuda.h) ---- */

static fm_cuda_ctx *cuda_ctx_of_backend(const fm_backend *b) {
    return b && b->ops && b->ops->name && !strcmp(b->ops->name, "cuda") ? ctx_of(b->ctx) : NULL;
}

void *fm_cuda_backend_stream(const fm_backend *b, fm_stream stream) {
    fm_cuda_ctx *c = cuda_ctx_of_backend(b);
    if (!c || stream < 0 || stream >= FM_STREAM_COUNT) return NULL;
    return (void *)stream_of(c, stream);
}

int fm_cuda_backend_device(const fm_backend *b) {
    const fm_cuda_ctx *c = cuda_ctx_of_backend(b);
    return c ? c->device : -1;
}

bool fm_cuda_backend_set_wait_hook(const fm_backend *b, fm_status (*hook)(void *arg, bool *idle), void *arg) {
    fm_cuda_ctx *c = cuda_ctx_of_backend(b);
    if (!c) return false;
    c->wait_hook = hook;
    c->wait_hook_arg = hook ? arg : NULL;
    return true;
}

fm_status fm_cuda_device_count(int *count) {
    *count = 0;
    const cudaError_t e = cudaGetDeviceCount(count);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *count = 0;
        return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaGetDeviceCount failed: %s (no CUDA driver or device)",
                        cudaGetErrorString(e));
    }
    return FM_OK;
}

} /* extern "C" */
