/* The CUDA backend's profiling (fm_backend.h's prof_mark / prof_collect): where a step's time goes.
 * Each mark records an event of a pool created at init on the stream (no sync); collect waits
 * for the last one (a host sync, counted) and sums the intervals between events per phase; a
 * failing call is recorded as the context's error (status) and the fold stops there. Nothing allocates after
 * init; without the profile option both ops are no-ops.
 */
#include "cuda_internal.h"

#include <cstring>

namespace {

/* Events in the pool: a fold (one wait) every FM_CUDA_PROF_EVENTS - 1 marks. */
constexpr int FM_CUDA_PROF_EVENTS = 16384;

/* Waits for the last recorded event and folds the intervals between the pool's events into
 * prof_acc; the last event becomes the pool's first. */
static void prof_fold(fm_cuda_ctx *c) {
    if (c->prof_n < 1) return;
    c->host_syncs++;
    FM_CUDA_CHECK(c, cudaEventSynchronize(c->prof_ev[c->prof_n - 1]));
    for (int i = 1; i < c->prof_n; i++) {
        float ms = 0;
        FM_CUDA_CHECK(c, cudaEventElapsedTime(&ms, c->prof_ev[i - 1], c->prof_ev[i]));
        c->prof_acc[c->prof_phase[i - 1]] += ms;
    }
    cudaEvent_t last = c->prof_ev[c->prof_n - 1];
    c->prof_ev[c->prof_n - 1] = c->prof_ev[0];
    c->prof_ev[0] = last;
    c->prof_phase[0] = c->prof_phase[c->prof_n - 1];
    c->prof_n = 1;
}

} // namespace

extern "C" {

void fm_cuda_prof_mark(void *ctx, fm_phase phase) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (!c->prof_ev) return;
    if (c->prof_n == c->prof_cap) prof_fold(c);
    if (c->prof_n == c->prof_cap) return; /* the fold failed (recorded): no slot */
    FM_CUDA_CHECK(c, cudaEventRecord(c->prof_ev[c->prof_n], c->stream));
    c->prof_phase[c->prof_n++] = (unsigned char)phase;
}

bool fm_cuda_prof_collect(void *ctx, double *ms) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (!c->prof_ev) return false;
    fm_cuda_prof_mark(ctx, c->prof_n ? (fm_phase)c->prof_phase[c->prof_n - 1] : FM_PHASE_OTHER);
    prof_fold(c);
    for (int i = 0; i < FM_PHASE_COUNT; i++) {
        ms[i] = c->prof_acc[i];
        c->prof_acc[i] = 0;
    }
    return true;
}

/* The event pool, created by init when the profile option is on: FM_CUDA_PROF_EVENTS events
 * and their phases, the first event recorded now (phase "other"). Errors: FM_ERR_NOMEM (the host
 * arrays), FM_ERR_UNSUPPORTED (cudaEventCreate); a half-built pool is for fm_cuda_prof_free. */
fm_status fm_cuda_prof_init(fm_cuda_ctx *c) {
    cudaError_t e;
    c->prof_cap = FM_CUDA_PROF_EVENTS;
    c->prof_ev = static_cast<cudaEvent_t *>(fm_malloc(sizeof(cudaEvent_t) * (size_t)c->prof_cap));
    c->prof_phase = static_cast<unsigned char *>(fm_malloc((size_t)c->prof_cap));
    if (!c->prof_ev || !c->prof_phase)
        return fm_error(FM_ERR_NOMEM, "cuda backend: cannot allocate the profiling event pool");
    memset(c->prof_ev, 0, sizeof(cudaEvent_t) * (size_t)c->prof_cap);
    for (int i = 0; i < c->prof_cap; i++)
        if ((e = cudaEventCreate(&c->prof_ev[i])) != cudaSuccess)
            return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaEventCreate for profiling failed: %s",
                            cudaGetErrorString(e));
    if ((e = cudaEventRecord(c->prof_ev[0], c->stream)) != cudaSuccess)
        return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaEventRecord for profiling failed: %s",
                        cudaGetErrorString(e));
    c->prof_phase[0] = FM_PHASE_OTHER;
    c->prof_n = 1;
    return FM_OK;
}

/* Destroys whatever part of the pool exists (errors ignored: the context is going away). */
void fm_cuda_prof_free(fm_cuda_ctx *c) {
    if (c->prof_ev) {
        for (int i = 0; i < c->prof_cap; i++)
            if (c->prof_ev[i]) (void)cudaEventDestroy(c->prof_ev[i]);
        fm_free(c->prof_ev);
    }
    fm_free(c->prof_phase);
    c->prof_ev = NULL;
    c->prof_phase = NULL;
}

} /* extern "C" */
