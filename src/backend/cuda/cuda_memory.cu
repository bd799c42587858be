/* The CUDA backend's memory, stream and event ops (fm_backend.h): mem_alloc (cudaMalloc,
 * zero-filled), mem_free, mem_set, copy (synchronous: issued on the compute stream, then waited
 * for), the buffer kinds (device, pinned, host), copy_async on the streams, set_op_stream, the event pool
 * (record, wait, sync), stream_sync and sync, status (the sticky first error and the device-error
 * flags) and the count of host waits. Allocation is for launch time; no op of a step allocates.
 * Every host wait (copy, event_sync, stream_sync, sync) adds one to host_syncs.
 */
#include "cuda_internal.h"

#include <cstdio>
#include <cstring>

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

} // namespace

extern "C" {

/* cudaMalloc (256-byte aligned) and zero-filled; NULL when it cannot (out of memory, or another
 * error, which is recorded; the out-of-memory error is cleared so the context stays usable).
 * Launch time: the zero fill is waited for (not counted as a host sync, like the CPU's malloc). */
void *fm_cuda_mem_alloc(void *ctx, size_t bytes) {
    fm_cuda_ctx *c = ctx_of(ctx);
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
    if (p) FM_CUDA_CHECK(ctx_of(ctx), cudaFree(p)); /* cudaFree waits for the device */
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
    FM_CUDA_CHECK(c, cudaStreamSynchronize(c->stream));
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
    FM_CUDA_CHECK(c, cudaEventSynchronize(ev));
}

void fm_cuda_stream_sync(void *ctx, fm_stream stream) {
    fm_cuda_ctx *c = ctx_of(ctx);
    const cudaStream_t s = stream_of(c, stream);
    c->host_syncs++;
    FM_CUDA_CHECK(c, cudaStreamSynchronize(s));
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

/* All four streams; one host sync. */
void fm_cuda_sync(void *ctx) {
    fm_cuda_ctx *c = ctx_of(ctx);
    c->host_syncs++;
    FM_CUDA_CHECK(c, cudaStreamSynchronize(c->compute));
    FM_CUDA_CHECK(c, cudaStreamSynchronize(c->update));
    FM_CUDA_CHECK(c, cudaStreamSynchronize(c->copy_in));
    FM_CUDA_CHECK(c, cudaStreamSynchronize(c->copy_out));
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

} /* extern "C" */
