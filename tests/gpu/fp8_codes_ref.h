/* The host references of the FP8 code operands for the GPU tests of the FP8 expert path
 * (test_cuda_fp8_codes.c, test_cuda_fp8_fused.c): each layout built here from backend/fm_fp8.h's
 * recipe and backend/fm_fp8_layout.h's byte layouts (ref_rows, ref_weight, ref_tokens), the byte
 * comparison, and the "corners" inputs (every tiling's tiles filled with the values where a fast
 * conversion could differ; test_cuda_fp8_codes.c's header lists them). Static functions and data
 * (each test its own copy); needs fm_test.h's CHECK_MSG and gpu_test.h's bf16 helpers. */
#ifndef FM_FP8_CODES_REF_H
#define FM_FP8_CODES_REF_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/fm_fp8.h"
#include "backend/fm_fp8_layout.h"
#include "gpu_test.h"

#define SENTINEL 0xA5
#define BF16_NAN 0x7FC0u

static inline float f_nan(void) { return fm_fp8_u2f(0x7FC00000u); }

/* The test's CUDA backend (fp8_test_backend starts it) and its byte helpers: device buffers (at
 * least 1 byte), preset to SENTINEL or not, host buffers preset to SENTINEL, and a device-to-host
 * copy after the compute stream's work. */
static fm_backend g_be;
static void *dev_bytes(int64_t n) {
    void *d = g_be.ops->mem_alloc(g_be.ctx, (size_t)(n > 0 ? n : 1));
    FM_ASSERT(d != NULL);
    return d;
}
static void *dev_sentinel(int64_t n) {
    void *d = dev_bytes(n);
    g_be.ops->mem_set(g_be.ctx, d, SENTINEL, (size_t)n);
    return d;
}
static uint8_t *host_sentinel(int64_t n) {
    uint8_t *h = malloc((size_t)(n > 0 ? n : 1));
    FM_ASSERT(h != NULL);
    memset(h, SENTINEL, (size_t)n);
    return h;
}
static void down_bytes(void *h, const void *d, int64_t n) {
    g_be.ops->stream_sync(g_be.ctx, FM_STREAM_COMPUTE);
    g_be.ops->copy(g_be.ctx, h, d, (size_t)n, FM_COPY_D2H);
}

/* The CUDA backend on device 0 with the default options (expert_gemm auto: the FP8 ops are served
 * on sm_90) but FP8 GEMM schedule `sched` (test_cuda_fp8_codes runs v3 on it first; the default is
 * v5, so a test that took the default would time v5 as "v3") for an FP8 GPU test: 0 when *be is ready; 77 (ctest's SKIP_RETURN_CODE) when there is
 * no device or it is not compute capability 9.0, said on stdout; 1 when the backend fails, said on
 * stderr. */
static inline int fp8_test_backend(fm_backend *be, fm_fp8_gemm sched) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* each line out before a kernel that could hang */
    fm_backend_opts o = fm_backend_opts_default();
    o.fp8_gemm = sched;
    const fm_status st = fm_cuda_backend_init(be, 0, &o);
    if (st == FM_ERR_UNSUPPORTED) {
        printf("skipped: %s\n", fm_errmsg());
        return 77;
    }
    if (st != FM_OK) {
        fprintf(stderr, "cuda backend: %s\n", fm_errmsg());
        return 1;
    }
    if (fm_cuda_expert_sm90_device_ok(0) != 1) {
        printf("skipped: device 0 is not compute capability 9.0: the FP8 expert path's sm_90a kernels do not run\n");
        fm_cuda_backend_free(be);
        return 77;
    }
    return 0;
}

/* ---- host reference quantization (fm_fp8.h) ---- */

/* One tile of n values x[i * xs] -> codes q[i * qs] and *scale. */
static inline void ref_tile(const float *x, int64_t n, int64_t xs, uint8_t *q, int64_t qs, float *scale) {
    float amax = 0.0f;
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i * xs]);
        if (!(a <= 3.4028235e38f)) bad = 1;
        else if (a > amax) amax = a;
    }
    const int e = fm_fp8_scale_exp(amax);
    *scale = bad ? f_nan() : ldexpf(1.0f, e);
    for (int64_t i = 0; i < n; i++) q[i * qs] = bad ? (uint8_t)0x7F : fm_e4m3_encode(ldexpf(x[i * xs], -e));
}

/* The rows layout of a [R, K] into img (fm_fp8_rows_bytes(rcap, K) bytes, preset to SENTINEL). */
static inline void ref_rows(uint8_t *img, const float *a, int64_t R, int64_t rcap, int64_t K) {
    float *s = (float *)(img + fm_fp8_rows_scales_at(rcap, K));
    const int64_t rpad = fm_fp8_rpad(rcap);
    for (int64_t r = 0; r < R; r++)
        for (int64_t b = 0; b < K / 128; b++) ref_tile(a + r * K + b * 128, 128, 1, img + r * K + b * 128, 1, &s[b * rpad + r]);
}

/* The weight layout of W [E, out, in] into img (fm_fp8_weight_bytes bytes). */
static inline void ref_weight(uint8_t *img, const float *W, int64_t E, int64_t out, int64_t in) {
    uint8_t *wt = img + fm_fp8_weight_t_at(E, out, in);
    float *s = (float *)(img + fm_fp8_weight_scales_at(E, out, in));
    for (int64_t e = 0; e < E; e++)
        for (int64_t nb = 0; nb < out / 128; nb++)
            for (int64_t kb = 0; kb < in / 128; kb++) {
                float amax = 0.0f;
                int bad = 0;
                const float *w0 = W + (e * out + nb * 128) * in + kb * 128;
                for (int64_t i = 0; i < 128; i++)
                    for (int64_t j = 0; j < 128; j++) {
                        const float a = fabsf(w0[i * in + j]);
                        if (!(a <= 3.4028235e38f)) bad = 1;
                        else if (a > amax) amax = a;
                    }
                const int ex = fm_fp8_scale_exp(amax);
                s[(e * (out / 128) + nb) * (in / 128) + kb] = bad ? f_nan() : ldexpf(1.0f, ex);
                for (int64_t i = 0; i < 128; i++)
                    for (int64_t j = 0; j < 128; j++) {
                        const uint8_t c = bad ? (uint8_t)0x7F : fm_e4m3_encode(ldexpf(w0[i * in + j], -ex));
                        img[(e * out + nb * 128 + i) * in + kb * 128 + j] = c;
                        wt[(e * in + kb * 128 + j) * out + nb * 128 + i] = c;
                    }
            }
}

/* pblk[e] = sum_{e' < e} ceil(m_e' / 128) */
static inline void pblk_of(int64_t *pblk, const int64_t *off, int64_t E) {
    pblk[0] = 0;
    for (int64_t e = 0; e < E; e++) pblk[e + 1] = pblk[e] + (off[e + 1] - off[e] + 127) / 128;
}

/* The tokens layout of a [off[E], C] into img (fm_fp8_tokens_bytes(kcap, C) bytes). */
static inline void ref_tokens(uint8_t *img, const float *a, const int64_t *off, int64_t E, int64_t kcap, int64_t C) {
    float *s = (float *)(img + fm_fp8_tokens_scales_at(kcap, C));
    int64_t pblk[257];
    pblk_of(pblk, off, E);
    for (int64_t e = 0; e < E; e++)
        for (int64_t b = 0; b < pblk[e + 1] - pblk[e]; b++) {
            const int64_t t0 = off[e] + 128 * b, n = off[e + 1] - t0 < 128 ? off[e + 1] - t0 : 128, tb = pblk[e] + b;
            for (int64_t c = 0; c < C; c++) {
                uint8_t *q = img + c * kcap + tb * 128;
                ref_tile(a + t0 * C + c, n, C, q, 1, &s[tb * C + c]);
                for (int64_t j = n; j < 128; j++) q[j] = 0; /* the zero tail */
            }
        }
}

/* Compares n bytes of got and want; reports the first difference. */
static inline int same_bytes(const char *what, const uint8_t *got, const uint8_t *want, int64_t n, int64_t base) {
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (got[i] != want[i]) {
            if (first < 0) first = i;
            bad++;
        }
    CHECK_MSG(bad == 0, "%s: %lld of %lld bytes differ (first at byte %lld: gpu 0x%02x, reference 0x%02x)", what,
              (long long)bad, (long long)n, (long long)(base + first), first >= 0 ? got[first] : 0,
              first >= 0 ? want[first] : 0);
    return bad == 0;
}

/* ---- corner values (the "corners" cases: the quantizers' fast path at every rounding corner) ---- */

/* Scaled values a tile's codes see (multiples of its scale 2^G): every non-negative E4M3 value,
 * every midpoint between neighbours (a tie: to the even code), values around half the smallest
 * subnormal, zero. */
static float g_pat[2 * 127 + 4];
static int g_npat, g_nmid; /* patterns; the midpoints are g_pat[0 .. g_nmid) */
static inline void pat_init(void) {
    g_npat = 0;
    for (int c = 0; c < 126; c++) g_pat[g_npat++] = 0.5f * (fm_e4m3_decode((uint8_t)c) + fm_e4m3_decode((uint8_t)(c + 1)));
    g_nmid = g_npat;
    for (int c = 0; c < 127; c++) g_pat[g_npat++] = fm_e4m3_decode((uint8_t)c);
    g_pat[g_npat++] = ldexpf(1.0f, -11), g_pat[g_npat++] = ldexpf(0.75f, -10), g_pat[g_npat++] = ldexpf(1.25f, -10);
    g_pat[g_npat++] = 0.0f;
}
static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
/* Tile classes: the exponent G of the anchor 448 2^G that one element of every 128 (along a row and
 * along a column: position c % 128 == 7 r % 128) holds, so the tile's scale is 2^G and the
 * patterns times 2^G are exact ties after scaling. */
enum { C_ZERO, C_ONE, C_TINY, C_MIN, C_HUGE, C_MAX, C_450, C_NOREP, C_SMALL, C_COUNT };
static const int g_cls_G[C_COUNT] = {0, 0, -138, -141, 119, 119, 3, -128, -40};
/* The bf16 value of element (r, c) of a tile of class cls (h: a hash of the element). */
static inline float corner_value(int cls, int64_t r, int64_t c, uint64_t h) {
    const int anchor = c % 128 == (7 * r) % 128;
    const int neg = (int)(h >> 16 & 1);
    if (cls == C_ZERO) return neg ? -0.0f : 0.0f; /* an all-zero tile with negative zeros */
    if (cls == C_MIN) { /* amax 2^-133 (bf16's smallest subnormal): e = -141 */
        if (anchor) return ldexpf(1.0f, -133);
        return h % 3 == 0 ? (neg ? -ldexpf(1.0f, -133) : ldexpf(1.0f, -133)) : (neg ? -0.0f : 0.0f);
    }
    if (cls == C_MAX && anchor) return gt_bf16_to_f32(0x7F7Fu); /* bf16's largest: e = 120 */
    const int G = g_cls_G[cls];
    if (anchor) return ldexpf(cls == C_450 ? 450.0f : 448.0f, G); /* 450 > 448: the scale one binade up */
    /* tiny values in tiles of large scale: products below fp32's normal range (or 0) */
    if ((cls == C_ONE || cls == C_HUGE || cls == C_450 || cls == C_SMALL) && (h >> 20) % 11 == 0) {
        static const float tiny_m[4] = {1.0f, 3.0f, 128.0f, 192.0f}; /* times 2^-133: 2^-133, 3 2^-133, 2^-126, 1.5 2^-126 */
        const float t = ldexpf(tiny_m[(h >> 24) & 3], -133);
        return neg ? -t : t;
    }
    const int k = (int)((h >> 32) % (uint64_t)g_npat);
    uint16_t b = gt_f32_to_bf16(ldexpf(g_pat[k], G));
    const int var = (int)((h >> 40) % 3); /* a midpoint exactly, or one bf16 ulp above / below */
    if (k < g_nmid && (b & 0x7FFFu) != 0) b = (uint16_t)(var == 1 ? b + 1 : var == 2 ? b - 1 : b);
    if (neg) b |= 0x8000u;
    return gt_bf16_to_f32(b);
}
/* Activations a [R, C] over groups off: a tile class per (token tile, 128-column block), so that
 * every 1 x 128 row tile and every 128 x 1 token tile lies in one class. */
static inline void corner_acts(float *a, int64_t C, const int64_t *off, const int64_t *pblk, int64_t E, int salt) {
    for (int64_t g = 0; g < E; g++)
        for (int64_t r = off[g]; r < off[g + 1]; r++) {
            const int64_t tb = pblk[g] + (r - off[g]) / 128;
            for (int64_t c = 0; c < C; c++) {
                const int cls = (int)((tb * 5 + (c / 128) * 3 + salt) % C_COUNT);
                a[r * C + c] = corner_value(cls, r, c, mix64((uint64_t)(r * C + c) * 8 + (uint64_t)salt));
            }
        }
}
/* W [E*out, in]: a class per 128 x 128 block */
static inline void corner_weight(float *W, int64_t E, int64_t out, int64_t in) {
    for (int64_t r = 0; r < E * out; r++)
        for (int64_t c = 0; c < in; c++) {
            const int64_t e = r / out, nb = r % out / 128, kb = c / 128;
            const int cls = (int)((e * 7 + nb * 3 + kb + 1) % C_COUNT);
            W[r * in + c] = corner_value(cls, r, c, mix64((uint64_t)(r * in + c) * 8 + 7));
        }
}

#endif
