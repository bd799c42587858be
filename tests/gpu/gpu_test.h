/* Helpers for the CUDA op tests (compiled with FM_ACT_BF16): host bf16 <-> fp32, device buffers
 * through the backend's memory ops, and the normalized error of a result against a reference.
 * Tests build inputs in fp32 on the host, round them to bf16 (so the reference sees exactly the
 * values the GPU sees), run the op, and compare against an fp64 host reference. */
#ifndef FM_GPU_TEST_H
#define FM_GPU_TEST_H
#include <math.h>
#include <string.h>

#include "backend/cuda/fm_backend_cuda.h"
#include "backend/fm_backend.h"
#include "core/fm_core.h"
#include "fm_test.h"

/* A CUDA backend on `device` for the tests: the default options with the FLATMOE_* variables
 * applied (fm_backend_opts_from_env: FLATMOE_EXPERT_GEMM, FLATMOE_ATTENTION_VERBOSE, ...), head_dim
 * <= max_head_dim and a cuDNN workspace of `workspace` bytes (0: 64 MiB). Errors: those of
 * fm_backend_opts_from_env and fm_cuda_backend_init. */
static inline fm_status gt_cuda_init(fm_backend *b, int device, int64_t max_head_dim, size_t workspace) {
    fm_backend_opts o = fm_backend_opts_default();
    FM_TRY(fm_backend_opts_from_env(&o));
    o.max_head_dim = max_head_dim;
    o.gpu_workspace = workspace;
    return fm_cuda_backend_init(b, device, &o);
}

static inline uint16_t gt_f32_to_bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float gt_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* Rounds x[0..n) to bf16 values in place (fp32 storage). */
static inline void gt_round_bf16(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = gt_bf16_to_f32(gt_f32_to_bf16(x[i]));
}
/* Device copy of n fp32 values as bf16 (act) or fp32. */
static inline void *gt_upload(const fm_backend *be, const float *x, int64_t n, fm_dtype t) {
    void *d = be->ops->mem_alloc(be->ctx, (size_t)n * fm_dtype_size(t) + 256);
    if (t == FM_DTYPE_F32) be->ops->copy(be->ctx, d, x, (size_t)n * 4, FM_COPY_H2D);
    else {
        uint16_t *h = fm_malloc((size_t)n * 2 + 2);
        for (int64_t i = 0; i < n; i++) h[i] = gt_f32_to_bf16(x[i]);
        be->ops->copy(be->ctx, d, h, (size_t)n * 2, FM_COPY_H2D);
        fm_free(h);
    }
    return d;
}
static inline void gt_download(const fm_backend *be, float *x, const void *d, int64_t n, fm_dtype t) {
    if (t == FM_DTYPE_F32) be->ops->copy(be->ctx, x, d, (size_t)n * 4, FM_COPY_D2H);
    else {
        uint16_t *h = fm_malloc((size_t)n * 2 + 2);
        be->ops->copy(be->ctx, h, d, (size_t)n * 2, FM_COPY_D2H);
        for (int64_t i = 0; i < n; i++) x[i] = gt_bf16_to_f32(h[i]);
        fm_free(h);
    }
}
/* Normalized error sqrt(sum (a-b)^2 / sum b^2) (ggml's nmse, square-rooted); NaN in a -> inf. */
static inline double gt_nerr(const float *a, const double *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i])) return INFINITY;
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return sqrt(num / (den > 0 ? den : 1e-300));
}
/* Tolerances by output dtype: bf16 outputs carry ~2^-9 relative rounding; fp32 outputs computed
 * from bf16 inputs with fp32 accumulation match an fp64 reference on the same inputs to ~1e-5. */
#define GT_TOL_BF16 1e-2
#define GT_TOL_F32 1e-4
#endif
