/* The CPU backend's head slices (fm_backend.h head_slice): the strided copies that assemble
 * multi-head latent attention's q, k and padded v from the projections and take them apart in
 * backward (model/fm_mla.c). One thread per row n; within a row the heads in order h = 0 .. nh-1,
 * so a summed slice (dst.hs 0) adds in a fixed order: the same bits for any thread count. */
#include "cpu_internal.h"

/* The source column of destination column j (fm_backend.h: FM_SLICE_*). */
static inline int64_t slice_src_col(int perm, int64_t j, int64_t d) {
    if (perm == FM_SLICE_DEINTERLEAVE) return j < d / 2 ? 2 * j : 2 * (j - d / 2) + 1;
    if (perm == FM_SLICE_INTERLEAVE) return j % 2 == 0 ? j / 2 : d / 2 + j / 2;
    return j;
}

void fm_cpu_head_slice(void *ctx, float *dst, fm_slice da, const float *src, fm_slice sa, int64_t N, int64_t nh,
                       int64_t d, int perm, float alpha, bool accumulate) {
    (void)ctx;
    FM_ASSERT(N >= 0 && nh >= 1 && d >= 0 && (perm == FM_SLICE_PLAIN || d % 2 == 0));
#pragma omp parallel for schedule(static) if (N * nh * d >= 8192)
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < nh; h++) {
            float *y = dst + n * da.ld + h * da.hs + da.off;
            const float *x = src ? src + n * sa.ld + h * sa.hs + sa.off : NULL;
            const bool add = accumulate || (da.hs == 0 && h > 0); /* a summed slice: the later heads add */
            for (int64_t j = 0; j < d; j++) {
                const float v = x ? alpha * x[slice_src_col(perm, j, d)] : 0.0f;
                y[j] = add ? y[j] + v : v;
            }
        }
}
