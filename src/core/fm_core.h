/* flatmoe core: status codes, error messages, always-on asserts, checked host allocation.
 *
 * Convention (DESIGN.md §8): library code returns an fm_status and fills a message with
 * fm_error(); only the CLI prints it and exits. A message names the input, what was expected,
 * what was found and the fix. Internal invariants use FM_ASSERT, which is never compiled out.
 */
#ifndef FM_CORE_H
#define FM_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fm_status {
    FM_OK = 0,
    FM_ERR_ARG,         /* bad command-line flag or function argument */
    FM_ERR_IO,          /* a file could not be opened, read, written or renamed */
    FM_ERR_FORMAT,      /* a file's contents are malformed (JSON, safetensors, token shard) */
    FM_ERR_CONFIG,      /* a model config is inconsistent or unsupported */
    FM_ERR_NOMEM,       /* a host or device allocation failed, or a plan does not fit */
    FM_ERR_NUMERIC,     /* a NaN or inf loss or gradient */
    FM_ERR_UNSUPPORTED, /* a valid request this build cannot serve */
} fm_status;

/* Sets the thread's last error message (printf format) and returns `status` unchanged, so
 * callers write `return fm_error(FM_ERR_IO, "%s: cannot open: %s", path, strerror(errno));`. */
fm_status fm_error(fm_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The message of the last fm_error() on this thread ("" if none). Valid until the next call. */
const char *fm_errmsg(void);

/* Short name of a status code ("FM_ERR_IO"). */
const char *fm_status_name(fm_status status);

#ifdef __cplusplus
#define FM_NORETURN [[noreturn]] /* CUDA sources include this header as C++ */
#else
#define FM_NORETURN _Noreturn
#endif

/* Prints "flatmoe: internal error at FILE:LINE: MSG" to stderr and aborts. */
FM_NORETURN void fm_abort(const char *file, int line, const char *msg);

#define FM_ASSERT(cond)                                                        \
    do {                                                                       \
        if (!(cond)) fm_abort(__FILE__, __LINE__, "assertion failed: " #cond); \
    } while (0)

/* Propagates a non-OK status to the caller. */
#define FM_TRY(expr)                     \
    do {                                 \
        fm_status fm_try_s_ = (expr);    \
        if (fm_try_s_ != FM_OK) return fm_try_s_; \
    } while (0)

/* Host allocation, 64-byte aligned, zero-filled. Returns NULL on failure (the caller turns that
 * into FM_ERR_NOMEM naming what it was for). Subject to fault injection, below. */
void *fm_malloc(size_t bytes);
void fm_free(void *ptr);

/* Fault injection for tests (SQLite's test_malloc habit): after fm_fault_set(n), the n-th
 * following call of fm_fault_hit() (1-based) reports a failure; n = 0 disables. fm_malloc()
 * calls it before every allocation and file writers before each write, close and rename; true
 * means: treat this allocation or write as failed. */
void fm_fault_set(int64_t n);
bool fm_fault_hit(void);

/* bf16 bits <-> fp32 on the host: widening is exact; narrowing rounds to nearest even (NaN stays
 * a quiet NaN), as __float2bfloat16_rn does on the GPU. */
static inline float fm_bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t fm_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __cplusplus
}
#endif
#endif
