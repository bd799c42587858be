/* libflatmoe's sleep and wake (include/flatmoe.h flatmoe_sleep): the model-state live set (the
 * parameter store's arena: weights, gradients, the fp32 master and the optimizer state that lives
 * in it; train/fm_param_store.h) copied to host memory and back. This slice copies and poisons;
 * it does not yet give the device memory back (the layout's pointers into the arena must stay
 * valid: that needs an allocator that keeps the addresses, e.g. CUDA's virtual memory management,
 * as vLLM's sleep mode does). */
#include <string.h>

#include "fm_capi.h"

fm_status fm_capi_awake(const flatmoe_session *s, const char *what) {
    if (s->sleep_host)
        return fm_error(FM_ERR_ARG, "%s: the session is asleep (flatmoe_sleep); call flatmoe_wake first", what);
    return FM_OK;
}

int flatmoe_sleep(flatmoe_session *s) {
    if (!s) return fm_error(FM_ERR_ARG, "flatmoe_sleep: the session is NULL");
    FM_TRY(fm_capi_awake(s, "flatmoe_sleep"));
    FM_TRY(fm_capi_one_rank(s, "flatmoe_sleep"));
    run *r = &s->r;
    fm_step_ws_flush(&r->step, &r->m); /* an overlapped update still in flight lands first */
    const fm_ops *ops = r->m.be.ops;
    fm_arena *a = &r->ps.arena;
    const size_t bytes = a->used;
    void *host = fm_malloc(bytes ? bytes : 1);
    if (!host)
        return fm_error(FM_ERR_NOMEM, "flatmoe_sleep: cannot allocate %zu bytes of host memory for the model state "
                        "(weights, gradients, master, optimizer state)", bytes);
    ops->stream_sync(r->m.be.ctx, FM_STREAM_COMPUTE); /* sync point "sleep" */
    ops->copy(r->m.be.ctx, host, a->base, bytes, FM_COPY_D2H);
    ops->mem_set(r->m.be.ctx, a->base, 0xff, bytes); /* every fp32 and bf16 value: a NaN until wake */
    const fm_status st = ops->status(r->m.be.ctx);
    if (st != FM_OK) {
        fm_free(host);
        return st;
    }
    s->sleep_host = host;
    s->sleep_bytes = bytes;
    return FLATMOE_OK;
}

int flatmoe_wake(flatmoe_session *s) {
    if (!s) return fm_error(FM_ERR_ARG, "flatmoe_wake: the session is NULL");
    if (!s->sleep_host) return fm_error(FM_ERR_ARG, "flatmoe_wake: the session is awake; flatmoe_sleep it first");
    run *r = &s->r;
    r->m.be.ops->copy(r->m.be.ctx, r->ps.arena.base, s->sleep_host, s->sleep_bytes, FM_COPY_H2D);
    FM_TRY(r->m.be.ops->status(r->m.be.ctx));
    fm_model_fp8_cache_invalidate(&r->m); /* --fp8-weight-cache: from the restored weights */
    fm_free(s->sleep_host);
    s->sleep_host = NULL;
    s->sleep_bytes = 0;
    return FLATMOE_OK;
}
