/* The CUDA backend's FP8 fake quantization (backend/cuda/cuda_fp8.h: quant_fp8_rows, _blocks,
 * _cols_grouped) against the C reference (backend/fm_fp8.h) bit for bit: the same bf16 inputs,
 * the reference computed in fp32 on their values and rounded to bf16 (exact: an E4M3 value times
 * a power of two is a bf16 value), every output bit compared (NaN to NaN). Random blocks and
 * adversarial ones: an all-zero tile, one huge value (the rest flushed), values in E4M3's
 * subnormal range after scaling, bf16 subnormals, a NaN and an inf (their tile all NaN),
 * ties of the rounding, partial last tiles (cols 300 = 128 + 128 + 44; 200 x 150 blocks; groups
 * of 200, 0, 77, 1 and 300 rows), in place (y = x) as well. Each op runs twice: the same bits. */
#include "backend/fm_fp8.h"
#include "core/fm_rng.h"
#include "gpu_test.h"

static fm_backend g_be;
static fm_rng g_rng;

/* Fills x [n] with normals of `scale` and a few adversarial values, rounded to bf16. */
static void fill(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)fm_rng_normal(&g_rng) * scale;
    gt_round_bf16(x, n);
}

/* Compares the device result d [n] (bf16) with ref [n] (fp32 reference) bit for bit. */
static int compare(const char *what, const void *d, const float *ref, int64_t n) {
    uint16_t *h = fm_malloc((size_t)n * 2 + 2);
    g_be.ops->stream_sync(g_be.ctx, FM_STREAM_COMPUTE);
    g_be.ops->copy(g_be.ctx, h, d, (size_t)n * 2, FM_COPY_D2H);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t want = gt_f32_to_bf16(ref[i]);
        const bool both_nan = isnan(gt_bf16_to_f32(h[i])) && isnan(ref[i]);
        if (h[i] != want && !both_nan) {
            if (first < 0) first = i;
            bad++;
        }
    }
    CHECK_MSG(bad == 0, "%s: %lld of %lld differ (first at %lld: gpu %a, reference %a)", what, (long long)bad,
              (long long)n, (long long)first, first >= 0 ? gt_bf16_to_f32(h[first]) : 0.0f, first >= 0 ? ref[first] : 0.0f);
    fm_free(h);
    return bad == 0;
}

static void test_rows(void) {
    const int64_t R = 9, C = 300;
    float *x = fnew(R * C), *ref = fnew(R * C);
    fill(x, R * C, 1.0f);
    for (int64_t j = 0; j < 128; j++) x[1 * C + j] = 0.0f;                 /* an all-zero tile */
    x[2 * C + 5] = 3e4f;                                                    /* one huge value */
    for (int64_t j = 128; j < 256; j++) x[3 * C + j] = ldexpf(x[3 * C + j], -20); /* small, one big: subnormal range */
    x[3 * C + 200] = 448.0f;
    for (int64_t j = 0; j < 128; j++) x[4 * C + j] = ldexpf(1.0f + (float)(j % 8) / 8.0f, -130); /* bf16 subnormals */
    x[5 * C + 10] = NAN;
    x[5 * C + 260] = INFINITY;
    for (int64_t j = 0; j < 128; j++) x[6 * C + j] = (float)(j % 16) * 0.0625f + 1.03125f; /* ties after scaling */
    x[6 * C + 0] = 448.0f;
    gt_round_bf16(x, R * C);
    fm_fp8_ref_rows(ref, x, R, C);
    fm_act *dx = gt_upload(&g_be, x, R * C, FM_DTYPE_BF16), *dy = gt_upload(&g_be, x, R * C, FM_DTYPE_BF16);
    g_be.ops->quant_fp8_rows(g_be.ctx, dy, dx, R, C);
    compare("rows", dy, ref, R * C);
    g_be.ops->quant_fp8_rows(g_be.ctx, dy, dx, R, C);
    compare("rows, again", dy, ref, R * C);
    g_be.ops->quant_fp8_rows(g_be.ctx, dx, dx, R, C); /* in place */
    compare("rows, in place", dx, ref, R * C);
    /* a large random tensor */
    const int64_t R2 = 1000, C2 = 2048;
    float *x2 = fnew(R2 * C2), *ref2 = fnew(R2 * C2);
    fill(x2, R2 * C2, 0.05f);
    fm_fp8_ref_rows(ref2, x2, R2, C2);
    fm_act *d2 = gt_upload(&g_be, x2, R2 * C2, FM_DTYPE_BF16);
    g_be.ops->quant_fp8_rows(g_be.ctx, d2, d2, R2, C2);
    compare("rows 1000 x 2048", d2, ref2, R2 * C2);
    g_be.ops->mem_free(g_be.ctx, dx); g_be.ops->mem_free(g_be.ctx, dy); g_be.ops->mem_free(g_be.ctx, d2);
    free(x); free(ref); free(x2); free(ref2);
}

static void test_blocks(void) {
    const int64_t M = 3, BR = 200, BC = 150, n = M * BR * BC;
    float *w = fnew(n), *ref = fnew(n);
    fill(w, n, 0.02f);
    for (int64_t i = 0; i < 128; i++)
        for (int64_t j = 0; j < 128; j++) w[i * BC + j] = 0.0f; /* matrix 0, block (0,0): zeros */
    w[1 * BR * BC + 150 * BC + 140] = 50.0f;                     /* matrix 1, block (1,1): one huge */
    w[2 * BR * BC + 10 * BC + 10] = NAN;                         /* matrix 2, block (0,0): NaN */
    gt_round_bf16(w, n);
    fm_fp8_ref_blocks(ref, w, M, BR, BC);
    fm_act *dw = gt_upload(&g_be, w, n, FM_DTYPE_BF16), *dq = gt_upload(&g_be, w, n, FM_DTYPE_BF16);
    g_be.ops->quant_fp8_blocks(g_be.ctx, dq, dw, M, BR, BC);
    compare("blocks", dq, ref, n);
    g_be.ops->quant_fp8_blocks(g_be.ctx, dw, dw, M, BR, BC);
    compare("blocks, in place", dw, ref, n);
    /* OLMoE's expert shape: 8 of its 64 experts, [1024, 2048] */
    const int64_t E = 8, O = 1024, K = 2048, n2 = E * O * K;
    float *w2 = fnew(n2), *ref2 = fnew(n2);
    fill(w2, n2, 0.02f);
    fm_fp8_ref_blocks(ref2, w2, E, O, K);
    fm_act *d2 = gt_upload(&g_be, w2, n2, FM_DTYPE_BF16);
    g_be.ops->quant_fp8_blocks(g_be.ctx, d2, d2, E, O, K);
    compare("blocks 8 x 1024 x 2048", d2, ref2, n2);
    g_be.ops->mem_free(g_be.ctx, dw); g_be.ops->mem_free(g_be.ctx, dq); g_be.ops->mem_free(g_be.ctx, d2);
    free(w); free(ref); free(w2); free(ref2);
}

static void test_cols_grouped(void) {
    const int64_t E = 5, off[6] = {0, 200, 200, 277, 278, 578}, R = off[E], C = 160;
    float *x = fnew(R * C), *ref = fnew(R * C);
    fill(x, R * C, 1.0f);
    for (int64_t i = 0; i < 128; i++) x[i * C + 3] = 0.0f;   /* group 0, tile 0, column 3: zeros */
    x[199 * C + 7] = 1e4f;                                    /* group 0's partial tile, column 7: huge */
    x[250 * C + 9] = NAN;                                     /* group 2, column 9 */
    x[277 * C + 11] = 5.0f;                                   /* group 3: one row */
    for (int64_t i = 278; i < 406; i++) x[i * C + 13] = ldexpf(x[i * C + 13], -30);
    x[300 * C + 13] = 1.0f;
    gt_round_bf16(x, R * C);
    fm_fp8_ref_cols_grouped(ref, x, off, E, C);
    fm_act *dx = gt_upload(&g_be, x, R * C, FM_DTYPE_BF16), *dy = gt_upload(&g_be, x, R * C, FM_DTYPE_BF16);
    g_be.ops->quant_fp8_cols_grouped(g_be.ctx, dy, dx, off, E, C);
    compare("cols grouped", dy, ref, R * C);
    g_be.ops->quant_fp8_cols_grouped(g_be.ctx, dx, dx, off, E, C);
    compare("cols grouped, in place", dx, ref, R * C);
    g_be.ops->mem_free(g_be.ctx, dx); g_be.ops->mem_free(g_be.ctx, dy);
    free(x); free(ref);
}

int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(8));
    const fm_status st = gt_cuda_init(&g_be, 0, 128, 0);
    CHECK_MSG(st == FM_OK, "fm_cuda_backend_init: %s", fm_errmsg());
    if (st != FM_OK) return fm_test_finish();
    test_rows();
    test_blocks();
    test_cols_grouped();
    CHECK(g_be.ops->status(g_be.ctx) == FM_OK);
    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
