#include "fm_arena.h"

#include <stdio.h>
#include <string.h>

static void *host_alloc(void *ctx, size_t bytes) {
    (void)ctx;
    return fm_malloc(bytes);
}
static void host_free(void *ctx, void *p) {
    (void)ctx;
    fm_free(p);
}
static void host_fill(void *ctx, void *dst, int byte, size_t bytes) {
    (void)ctx;
    memset(dst, byte, bytes);
}
static void host_read(void *ctx, void *dst, const void *src, size_t bytes) {
    (void)ctx;
    memcpy(dst, src, bytes);
}

fm_buffer_type fm_buffer_type_host(void) {
    fm_buffer_type t = {"host", NULL, host_alloc, host_free, host_fill, host_read, true};
    return t;
}

fm_status fm_arena_init(fm_arena *a, const char *name, size_t capacity) {
    memset(a, 0, sizeof *a);
    snprintf(a->name, sizeof a->name, "%s", name);
    a->capacity = fm_arena_round(capacity);
    a->buft = fm_buffer_type_host();
    a->base = fm_malloc(a->capacity);
    if (!a->base)
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate %zu bytes (%.3f GiB) for the %s arena; "
                        "lower --seq-len or --micro-batch", a->capacity, a->capacity / 1073741824.0, name);
    return FM_OK;
}

fm_status fm_arena_init_buffer(fm_arena *a, const char *name, size_t capacity, const fm_buffer_type *buft) {
    memset(a, 0, sizeof *a);
    snprintf(a->name, sizeof a->name, "%s", name);
    a->capacity = fm_arena_round(capacity);
    a->buft = *buft;
    a->base = fm_fault_hit() ? NULL : buft->alloc(buft->ctx, a->capacity);
    if (!a->base)
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate %zu bytes (%.3f GiB) of %s memory for the %s arena; "
                        "lower --seq-len or --micro-batch, or see flatmoe plan", a->capacity,
                        a->capacity / 1073741824.0, buft->name, name);
    return FM_OK;
}

void *fm_arena_alloc(fm_arena *a, size_t bytes) {
    size_t r = fm_arena_round(bytes);
    if (a->capacity == SIZE_MAX && a->base == NULL) { /* measure mode */
        void *fake = (void *)(uintptr_t)(64 + a->used);
        a->used += r;
        if (a->used > a->high) a->high = a->used;
        return fake;
    }
    if (a->used + r > a->capacity) {
        char msg[256];
        snprintf(msg, sizeof msg, "arena '%s' overrun: %zu used + %zu asked > %zu planned", a->name,
                 a->used, r, a->capacity);
        fm_abort(__FILE__, __LINE__, msg);
    }
    void *p = a->base + a->used;
    a->used += r;
    if (a->used > a->high) a->high = a->used;
    return p;
}

void fm_arena_init_measure(fm_arena *a, const char *name) {
    memset(a, 0, sizeof *a);
    snprintf(a->name, sizeof a->name, "%s", name);
    a->capacity = SIZE_MAX;
}

void fm_arena_free(fm_arena *a) {
    if (a->base && a->buft.free) a->buft.free(a->buft.ctx, a->base);
    a->base = NULL;
    a->capacity = a->used = 0;
}

void fm_arena_paint(fm_arena *a) {
    if (!a->base) return;
    a->buft.fill(a->buft.ctx, a->base, 0xA5, a->capacity);
}

/* The last byte that is not paint ends the touched prefix. On a device the arena is read back
 * in windows from its end (a report, never in a step), so a mostly-touched arena costs one
 * window, not a host copy of the whole arena. */
static size_t last_unpainted(const uint8_t *h, size_t n) {
    const uint64_t paint = 0xA5A5A5A5A5A5A5A5ull;
    const uint64_t *w = (const uint64_t *)h;
    size_t i = n / 8;
    while (i > 0 && w[i - 1] == paint) i--;
    size_t b = i * 8;
    while (b > 0 && h[b - 1] == 0xA5) b--;
    return b; /* 0: all paint */
}

size_t fm_arena_touched(const fm_arena *a) {
    if (!a->base) return 0;
    const size_t n = a->capacity; /* a multiple of 64 */
    if (a->buft.host_visible) return last_unpainted(a->base, n);
    const size_t win = (size_t)64 << 20;
    uint8_t *host = fm_malloc(n < win ? n : win);
    if (!host) return a->capacity;
    size_t r = 0;
    for (size_t end = n; end > 0;) {
        const size_t len = end < win ? end : win, start = end - len;
        a->buft.read(a->buft.ctx, host, (const uint8_t *)a->base + start, len);
        const size_t b = last_unpainted(host, len);
        if (b > 0) {
            r = start + b;
            break;
        }
        end = start;
    }
    fm_free(host);
    return r;
}
