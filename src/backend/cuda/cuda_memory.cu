/* The CUDA backend's memory ops (fm_backend.h): mem_alloc (cudaMalloc, zero-filled), mem_free,
 * mem_set, copy (synchronous: issued on the stream, then waited for), sync and the count of host
 * waits. Used at launch and for small transfers; no op of a step allocates.
 */
#include "cuda_internal.h"

extern "C" {

/* cudaMalloc (256-byte aligned) and zero-filled; NULL when the device is out of memory (the
 * error is cleared so the context stays usable). */
void *fm_cuda_mem_alloc(void *ctx, size_t bytes) {
    fm_cuda_ctx *c = ctx_of(ctx);
    void *p = NULL;
    const cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        if (e != cudaErrorMemoryAllocation) fm_cuda_fail("cudaMalloc(&p, bytes)", cudaGetErrorString(e), __FILE__, __LINE__);
        (void)cudaGetLastError();
        return NULL;
    }
    FM_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes ? bytes : 1, c->stream));
    FM_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return p;
}

void fm_cuda_mem_free(void *ctx, void *p) {
    (void)ctx;
    if (p) FM_CUDA_CHECK(cudaFree(p)); /* cudaFree waits for the device */
}

void fm_cuda_mem_set(void *ctx, void *dst, int byte, size_t bytes) {
    if (bytes) FM_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, ctx_of(ctx)->stream));
}

/* Synchronous: issued on the stream (so it follows every op before it), then waited for. */
void fm_cuda_copy(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (bytes == 0 || dst == src) return;
    const cudaMemcpyKind k = kind == FM_COPY_H2D   ? cudaMemcpyHostToDevice
                             : kind == FM_COPY_D2H ? cudaMemcpyDeviceToHost
                                                   : cudaMemcpyDeviceToDevice;
    FM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, k, c->stream));
    FM_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    c->host_syncs++;
}

void fm_cuda_sync(void *ctx) {
    FM_CUDA_CHECK(cudaStreamSynchronize(ctx_of(ctx)->stream));
    ctx_of(ctx)->host_syncs++;
}

uint64_t fm_cuda_host_sync_count(void *ctx) { return ctx_of(ctx)->host_syncs; }

} /* extern "C" */
