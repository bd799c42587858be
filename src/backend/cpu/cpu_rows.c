/* Row gather and scatter (any element type): the token movement of the chunked MoE dispatch.
 * Each output row is written by one thread, with memcpy: exact and deterministic. */
#include <string.h>

#include "cpu_internal.h"

void fm_cpu_gather_rows(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n,
                        int64_t row_bytes) {
    (void)ctx;
    char *d = dst;
    const char *s = src;
#pragma omp parallel for schedule(static) if (n * row_bytes > 65536)
    for (int64_t i = 0; i < n; i++) memcpy(d + i * row_bytes, s + (int64_t)idx[i] * row_bytes, (size_t)row_bytes);
}

void fm_cpu_scatter_rows(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n,
                         int64_t row_bytes) {
    (void)ctx;
    char *d = dst;
    const char *s = src;
#pragma omp parallel for schedule(static) if (n * row_bytes > 65536)
    for (int64_t i = 0; i < n; i++) memcpy(d + (int64_t)idx[i] * row_bytes, s + i * row_bytes, (size_t)row_bytes);
}
