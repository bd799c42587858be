/* Buffer types over a backend (fm_backend.h): the arena-facing view of the backend's memory
 * kinds. The buffer type's context is the fm_backend itself (which outlives its arenas). */
#include "fm_backend.h"

#include <stdio.h>
#include <string.h>

static const fm_backend *be_of(void *ctx) { return (const fm_backend *)ctx; }

static void *dev_alloc(void *ctx, size_t n) { return be_of(ctx)->ops->buffer_alloc(be_of(ctx)->ctx, FM_BUFFER_DEVICE, n); }
static void dev_free(void *ctx, void *p) { be_of(ctx)->ops->buffer_free(be_of(ctx)->ctx, FM_BUFFER_DEVICE, p); }
static void dev_fill(void *ctx, void *dst, int byte, size_t n) { be_of(ctx)->ops->mem_set(be_of(ctx)->ctx, dst, byte, n); }
static void dev_read(void *ctx, void *dst, const void *src, size_t n) {
    be_of(ctx)->ops->copy(be_of(ctx)->ctx, dst, src, n, FM_COPY_D2H);
}
static void *pin_alloc(void *ctx, size_t n) { return be_of(ctx)->ops->buffer_alloc(be_of(ctx)->ctx, FM_BUFFER_PINNED, n); }
static void pin_free(void *ctx, void *p) { be_of(ctx)->ops->buffer_free(be_of(ctx)->ctx, FM_BUFFER_PINNED, p); }
static void *host_alloc(void *ctx, size_t n) { return be_of(ctx)->ops->buffer_alloc(be_of(ctx)->ctx, FM_BUFFER_HOST, n); }
static void host_free(void *ctx, void *p) { be_of(ctx)->ops->buffer_free(be_of(ctx)->ctx, FM_BUFFER_HOST, p); }

fm_buffer_type fm_backend_buffer_type(const fm_backend *be, fm_buffer_kind kind) {
    const fm_buffer_type host = fm_buffer_type_host(); /* fill and read of host-visible memory */
    fm_buffer_type t = host;
    t.ctx = (void *)be;
    static const char *const kinds[FM_BUFFER_KINDS] = {"device", "pinned host", "host"};
    FM_ASSERT(kind >= 0 && kind < FM_BUFFER_KINDS);
    snprintf(t.name, sizeof t.name, "%s %s", be->ops->name, kinds[kind]);
    if (kind == FM_BUFFER_DEVICE) {
        t.alloc = dev_alloc;
        t.free = dev_free;
        t.fill = be->ops->host_memory ? host.fill : dev_fill;
        t.read = be->ops->host_memory ? host.read : dev_read;
        t.host_visible = be->ops->host_memory;
    } else {
        t.alloc = kind == FM_BUFFER_PINNED ? pin_alloc : host_alloc;
        t.free = kind == FM_BUFFER_PINNED ? pin_free : host_free;
        t.host_visible = true;
    }
    return t;
}

fm_status fm_arena_init_backend_kind(fm_arena *a, const char *name, size_t capacity, const fm_backend *be,
                                     fm_buffer_kind kind) {
    const fm_buffer_type t = fm_backend_buffer_type(be, kind);
    return fm_arena_init_buffer(a, name, capacity, &t);
}
