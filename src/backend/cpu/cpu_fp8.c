/* The CPU backend's FP8 fake quantization (fm_backend.h quant_fp8_*): fp32 in and out, the
 * C reference of backend/fm_fp8.h tile by tile (DeepSeek-V3 §3.3 tiles, UE8M0 scales). Each tile
 * is independent, so the threads split the tiles and the bits do not depend on the thread count. */
#include "cpu_internal.h"

#include "../fm_fp8.h"

#define T8 FM_FP8_TILE

static inline int cpu_threads(void *ctx) { return ((const fm_cpu_ctx *)ctx)->threads; }

void fm_cpu_quant_fp8_rows(void *ctx, float *y, const float *x, int64_t rows, int64_t cols) {
    FM_ASSERT(rows >= 0 && cols >= 0);
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (rows * cols >= 65536)
    for (int64_t i = 0; i < rows; i++) fm_fp8_ref_rows(y + i * cols, x + i * cols, 1, cols);
}

void fm_cpu_quant_fp8_blocks(void *ctx, float *y, const float *x, int64_t mats, int64_t rows, int64_t cols) {
    FM_ASSERT(mats >= 0 && rows >= 0 && cols >= 0);
    const int64_t br = (rows + T8 - 1) / T8, bc = (cols + T8 - 1) / T8, nb = mats * br * bc;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (mats * rows * cols >= 65536)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t m = b / (br * bc), rem = b % (br * bc), i0 = (rem / bc) * T8, j0 = (rem % bc) * T8;
        const int64_t o = m * rows * cols + i0 * cols + j0;
        fm_fp8_quant_tile(y + o, x + o, rows - i0 < T8 ? rows - i0 : T8, cols - j0 < T8 ? cols - j0 : T8, cols);
    }
}

void fm_cpu_quant_fp8_cols_grouped(void *ctx, float *y, const float *x, const int64_t *offsets, int64_t E,
                                   int64_t cols) {
    FM_ASSERT(E >= 0 && cols >= 0);
    for (int64_t g = 0; g < E; g++) {
        const int64_t r0 = offsets[g], r1 = offsets[g + 1];
        for (int64_t i = r0; i < r1; i += T8) {
            const int64_t nr = r1 - i < T8 ? r1 - i : T8;
#pragma omp parallel for num_threads(cpu_threads(ctx)) schedule(static) if (nr * cols >= 65536)
            for (int64_t j = 0; j < cols; j++) fm_fp8_quant_tile(y + i * cols + j, x + i * cols + j, nr, 1, cols);
        }
    }
}
