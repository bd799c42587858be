/* libflatmoe's sleep and wake (include/flatmoe.h flatmoe_sleep; docs/rl.md "Sleep and wake").
 *
 * Sleep: every device arena of the session -- the model state (the parameter store's arena:
 * weights, gradients, the fp32 master and the optimizer state that lives in it;
 * train/fm_param_store.h) and the activation live sets (model/fm_acts.h) -- has its carved part
 * (`used` bytes: everything a later step reads that was written before it; the transient parts
 * are carved again and written before they are read) copied to one host buffer; then each arena's
 * memory is poisoned with 0xff (every fp32 and bf16 value a NaN until wake) and given back to the
 * system where the backend can (ops->mem_release: the physical pages go, the addresses stay, so
 * every pointer into the arenas stays valid; released pages read as zeros, the rest as NaN). Wake: each released arena backed again
 * (ops->mem_restore, zero-filled), the carved parts copied back: the next step is bit for bit a
 * step without sleep (tests/test_capi_io.c). The host buffer's bytes are the arenas' carved bytes
 * (at most the plan's device total). What stays on the device: the backend's own workspaces
 * (the BLAS and cuDNN workspaces, the reduction scratch) and the context. The CUDA backend's
 * release unmaps the arenas' physical chunks (backend/cuda/cuda_vmm.h), so while asleep their
 * addresses are reserved but not mapped: nothing may touch them (the calls are refused).
 * The idea of keeping the addresses while the memory goes: vLLM's sleep mode and
 * torch_memory_saver (CUDA virtual memory management: cuMemUnmap / cuMemMap). */
#include <string.h>

#include "fm_capi.h"

fm_status fm_capi_awake(const flatmoe_session *s, const char *what) {
    if (s->sleep_host)
        return fm_error(FM_ERR_ARG, "%s: the session is asleep (flatmoe_sleep); call flatmoe_wake first", what);
    return FM_OK;
}

/* The session's device arenas (those with memory) into out[FM_LIVE_COUNT]; returns their count. */
static int device_arenas(flatmoe_session *s, fm_arena **out) {
    int n = 0;
    if (s->r.ps.arena.base) out[n++] = &s->r.ps.arena; /* FM_LIVE_MODEL_STATE */
    for (int i = 1; i < FM_LIVE_COUNT; i++)
        if (s->r.m.a.arena[i].base) out[n++] = &s->r.m.a.arena[i];
    return n;
}

/* The arenas backed again (when released) and their carved parts copied back from host, in
 * device_arenas' order. Errors: the backend's status; FM_ERR_NOMEM when the device has no room to
 * back an arena again (nothing copied back: a later call backs the rest). */
static fm_status restore(flatmoe_session *s, const uint8_t *host, bool released) {
    const fm_ops *ops = s->r.m.be.ops;
    void *ctx = s->r.m.be.ctx;
    fm_arena *ar[FM_LIVE_COUNT];
    const int n = device_arenas(s, ar);
    for (int i = 0; released && ops->mem_restore && i < n; i++)
        if (!ops->mem_restore(ctx, ar[i]->base, ar[i]->capacity)) {
            FM_TRY(ops->status(ctx));
            return fm_error(FM_ERR_NOMEM, "flatmoe_wake: no device memory to back the %s arena's %zu bytes again (the "
                            "memory given back at sleep is in use elsewhere, e.g. by an inference engine that has not "
                            "slept); free it and call flatmoe_wake again: the session stays asleep", ar[i]->name,
                            ar[i]->capacity);
        }
    FM_TRY(ops->status(ctx));
    for (int i = 0; i < n; i++) {
        ops->copy(ctx, ar[i]->base, host, ar[i]->used, FM_COPY_H2D);
        host += ar[i]->used;
    }
    return ops->status(ctx);
}

int flatmoe_sleep(flatmoe_session *s) {
    if (!s) return fm_error(FM_ERR_ARG, "flatmoe_sleep: the session is NULL");
    FM_TRY(fm_capi_awake(s, "flatmoe_sleep"));
    FM_TRY(fm_capi_one_rank(s, "flatmoe_sleep"));
    run *r = &s->r;
    fm_step_ws_flush(&r->step, &r->m); /* an overlapped update still in flight lands first */
    const fm_ops *ops = r->m.be.ops;
    fm_arena *ar[FM_LIVE_COUNT];
    const int n = device_arenas(s, ar);
    size_t bytes = 0;
    for (int i = 0; i < n; i++) bytes += ar[i]->used;
    uint8_t *host = fm_malloc(bytes ? bytes : 1);
    if (!host)
        return fm_error(FM_ERR_NOMEM, "flatmoe_sleep: cannot allocate %zu bytes of host memory for the device arenas' "
                        "contents (the model state: weights, gradients, master, optimizer state; and the live sets' "
                        "carved parts)", bytes);
    ops->stream_sync(r->m.be.ctx, FM_STREAM_COMPUTE); /* sync point "sleep" */
    size_t at = 0, released = 0;
    for (int i = 0; i < n; i++) {
        ops->copy(r->m.be.ctx, host + at, ar[i]->base, ar[i]->used, FM_COPY_D2H);
        at += ar[i]->used;
    }
    fm_status st = ops->status(r->m.be.ctx);
    for (int i = 0; i < n && st == FM_OK; i++) {
        ops->mem_set(r->m.be.ctx, ar[i]->base, 0xff, ar[i]->capacity); /* NaN until wake, where it stays */
        released += ops->mem_release ? ops->mem_release(r->m.be.ctx, ar[i]->base, ar[i]->capacity) : 0;
        st = ops->status(r->m.be.ctx);
    }
    if (st != FM_OK) { /* released arenas are backed again before the error returns: the session stays usable */
        (void)restore(s, host, released > 0);
        fm_free(host);
        return st;
    }
    s->sleep_host = host;
    s->sleep_bytes = bytes;
    s->sleep_released = released;
    return FLATMOE_OK;
}

int flatmoe_wake(flatmoe_session *s) {
    if (!s) return fm_error(FM_ERR_ARG, "flatmoe_wake: the session is NULL");
    if (!s->sleep_host) return fm_error(FM_ERR_ARG, "flatmoe_wake: the session is awake; flatmoe_sleep it first");
    run *r = &s->r;
    FM_TRY(restore(s, s->sleep_host, s->sleep_released > 0)); /* failed: still asleep, wake may be called again */
    fm_model_fp8_cache_invalidate(&r->m); /* --fp8-weight-cache: from the restored weights */
    fm_free(s->sleep_host);
    s->sleep_host = NULL;
    s->sleep_bytes = s->sleep_released = 0;
    return FLATMOE_OK;
}
