/* Arenas: one fixed block per live set, allocated once at launch (DESIGN.md §2; SQLite mem5's
 * "fixed memory after start-up" habit). fm_arena_alloc carves 64-byte-aligned pieces from it and
 * records the high-water mark, reported next to the planned bound. Nothing in a training step
 * allocates from the system: a step only takes from arenas and resets their transient part. */
#ifndef FM_ARENA_H
#define FM_ARENA_H
#include "fm_core.h"

/* Where an arena's memory comes from (ggml's buffer type): a kind of memory of some backend, as
 * a table of functions over its context, so core/ never includes a backend. */
typedef struct fm_buffer_type {
    char name[32];                   /* "cuda device", "cuda pinned", "host", ... (messages) */
    void *ctx;
    void *(*alloc)(void *ctx, size_t bytes);          /* zero-filled; NULL when it cannot */
    void (*free)(void *ctx, void *p);
    void (*fill)(void *ctx, void *dst, int byte, size_t bytes);           /* launch time */
    void (*read)(void *ctx, void *host_dst, const void *src, size_t bytes); /* reports */
    bool host_visible;               /* the host may dereference the memory */
} fm_buffer_type;

/* Ordinary host memory (fm_malloc), the type of fm_arena_init's arenas. */
fm_buffer_type fm_buffer_type_host(void);

typedef struct fm_arena {
    char name[48];   /* live-set name, as printed in the plan ("checkpoint boundaries") */
    uint8_t *base;   /* memory of `buft` */
    fm_buffer_type buft;
    size_t capacity; /* bytes, fixed at init */
    size_t used;     /* bytes handed out since the last reset */
    size_t high;     /* high-water mark of `used`, bytes */
} fm_arena;

/* Allocates `capacity` bytes of host memory for the live set `name`. Errors: FM_ERR_NOMEM
 * naming the live set and the bytes asked for. */
fm_status fm_arena_init(fm_arena *a, const char *name, size_t capacity);

/* The same from a buffer type (backend/fm_backend.h: fm_arena_init_backend gives device or
 * pinned memory of a backend). Errors: FM_ERR_NOMEM naming the live set, the bytes and the
 * buffer type. */
fm_status fm_arena_init_buffer(fm_arena *a, const char *name, size_t capacity, const fm_buffer_type *buft);

/* Returns `bytes` (rounded up to 64) from the arena. An overrun is a planning bug, not a user
 * error: it aborts with the arena's name, capacity and the request. */
void *fm_arena_alloc(fm_arena *a, size_t bytes);

/* Rounds a byte count the way fm_arena_alloc does; planners sum these. */
static inline size_t fm_arena_round(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

/* Marks everything handed out as free again (the high-water mark stays). */
static inline void fm_arena_reset(fm_arena *a) { a->used = 0; }

/* Measure mode: an arena with no memory and unbounded capacity. fm_arena_alloc returns fake,
 * never-dereferenced pointers and `used`/`high` count the bytes, so a layout function run over
 * measuring arenas gives the exact bytes the real layout will take. */
void fm_arena_init_measure(fm_arena *a, const char *name);
static inline bool fm_arena_is_measure(const fm_arena *a) { return a->base == NULL && a->capacity == SIZE_MAX; }

/* Measured high-water mark by painting (SQLite's memsys "fill" habit): fm_arena_paint fills the
 * whole arena with the byte 0xA5; fm_arena_touched returns 1 + the offset of the highest byte
 * that is no longer 0xA5, i.e. how far into the arena anything was actually written since the
 * paint, whatever was carved. (A write of exactly 0xA5 bytes at the very top would read as
 * untouched: for fp32 data that is the value -2.9e-16, in every byte of a word.) */
void fm_arena_paint(fm_arena *a);
size_t fm_arena_touched(const fm_arena *a);

void fm_arena_free(fm_arena *a);

#endif
