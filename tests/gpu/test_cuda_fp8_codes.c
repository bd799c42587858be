/* The CUDA backend's FP8 expert GEMMs on E4M3 codes (fm_backend.h: expert_fp8_serves,
 * fp8_quant_weight / _rows / _tokens, expert_fp8_gemm; backend/cuda/sm90/gg_sm90_fp8.h, the kernel
 * lab's v3) against host references built from backend/fm_fp8.h and backend/fm_fp8_layout.h
 * (fp8_codes_ref.h, shared with test_cuda_fp8_fused.c, which checks the fused quantizers).
 * Label gpu; skipped (77) without a CUDA device of compute capability 9.0.
 *
 * Cases: E = 4..8 experts, in/out 128..512, uneven groups with empty ones, one group owning every
 * row, groups starting at odd rows and rows not a multiple of 4 (the row-scale TMA box's rule),
 * rcap above offsets[E] (rows past it must stay unwritten), fewer rows than one 128-row tile,
 * offsets in pinned host memory (as the dispatcher passes them) and in device memory, E = 1.
 * (a) Every byte of the rows and weight buffers (codes, scales, the unwritten rows and padding,
 *     which start as a sentinel) and every byte of the tokens buffers (the groups' tiles' codes
 *     and scales, zero tails included; tiles past the groups' and the padding the sentinel) equals
 *     the reference: scale 2^fm_fp8_scale_exp(amax) as fp32 (ldexpf),
 *     code fm_e4m3_encode(ldexpf(v, -e)) on the bf16 value, a tile with a NaN or inf scale NaN and
 *     codes 0x7F; a separate case puts NaN and inf into tiles, and two "corners" cases fill every
 *     tile of every tiling with the values where a fast conversion could differ: each E4M3 value
 *     and each rounding tie (exactly, and one bf16 ulp either side) times the tile's scale (an
 *     anchor 448 2^G in every 128 along rows and columns fixes the scale), E4M3 subnormals, values
 *     whose scaled product is an fp32 subnormal, negative zeros, all-zero tiles, amax from 2^-133
 *     (scale 2^-141) to bf16's largest (2^120), scales whose inverse is not an fp32 (2^-128) and an
 *     amax just past 448 2^G (450: the next binade's scale).
 * (b) Each GEMM kind against an fp64 sum over the reference's decoded codes times scales:
 *     |gpu - ref| <= 1e-2 rms(ref) + 2^-8 |ref| per element (the second term: the one rounding to
 *     bf16; the first: the fp32 partial sums inside wgmma. Quantization itself is not in this
 *     error: the reference is quantized the same way; against the unquantized product the error
 *     is ~3% of the rms, which this bound would reject). beta 0 over NaN (C must not be read),
 *     beta 1 over random old values; rows at or past offsets[E] of y and dx untouched; kind 2's
 *     empty experts bit for bit untouched with beta 1, exactly zero with beta 0.
 * (b) runs for each GEMM schedule (FLATMOE_FP8_GEMM's v3, v5, v5a, v5b, v5c: a backend created
 * with each fp8_gemm option), v3 first; every message names the schedule ("[v5] kind 0 ..."), and
 * (a) is checked once, with v3. FLATMOE_TEST_FP8_SCHEDULES=v3,v5 (a comma-separated list) limits
 * the v5 variants run (v3 always runs first).
 * Then (unless FLATMOE_TEST_NO_BENCH=1) timings at OLMoE's expert shape, FP8 against the bf16 sm90
 * kernel, v3 after its checks and each v5 variant after its own (with its speed-up over v3), and
 * all the GEMM lines together at the end. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "backend/fm_backend_opts.h"
#include "backend/fm_fp8.h"
#include "backend/fm_fp8_layout.h"
#include "core/fm_rng.h"
#include "gpu_test.h"
#include "fp8_codes_ref.h"

static fm_rng g_rng;

/* The GEMM schedules (fm_backend_opts.h's fm_fp8_gemm), v3 first; g_gbe: the backend created with
 * the schedule under test (g_be for v3), g_si its index. */
#define N_SCHED 5
static const fm_fp8_gemm g_sched[N_SCHED] = {FM_FP8_GEMM_V3, FM_FP8_GEMM_V5B, FM_FP8_GEMM_V5A, FM_FP8_GEMM_V5,
                                             FM_FP8_GEMM_V5C};
static fm_backend g_bes[N_SCHED];
static fm_backend *g_gbe = &g_be;
static int g_si = 0;

/* "[v5] what" (a static buffer: one label at a time) */
static const char *lbl(const char *what) {
    static char b[256];
    snprintf(b, sizeof b, "[%s] %s", fm_fp8_gemm_name(g_sched[g_si]), what);
    return b;
}

/* ---- device helpers ---- */

static void up_bits(void *d, const uint16_t *h, int64_t n) { g_be.ops->copy(g_be.ctx, d, h, (size_t)n * 2, FM_COPY_H2D); }

/* rows x cols bf16 normals of `scale`, each row scaled by 2^(-2..2) (so the tiles' scales differ). */
static float *randn(int64_t rows, int64_t cols, double scale) {
    float *x = fnew(rows * cols);
    for (int64_t r = 0; r < rows; r++) {
        const double rs = scale * ldexp(1.0, (int)fm_rng_below(&g_rng, 5) - 2);
        for (int64_t j = 0; j < cols; j++) x[r * cols + j] = (float)(rs * fm_rng_normal(&g_rng));
    }
    gt_round_bf16(x, rows * cols);
    return x;
}

/* ---- decoding the reference images ---- */

/* rows image -> values [R, K] (fp64) */
static double *dec_rows(const uint8_t *img, int64_t R, int64_t rcap, int64_t K) {
    const float *s = (const float *)(img + fm_fp8_rows_scales_at(rcap, K));
    const int64_t rpad = fm_fp8_rpad(rcap);
    double *v = dnew(R * K);
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < K; k++) v[r * K + k] = (double)fm_e4m3_decode(img[r * K + k]) * s[(k / 128) * rpad + r];
    return v;
}
/* weight image -> W values [E, out, in] (from Wq) */
static double *dec_weight(const uint8_t *img, int64_t E, int64_t out, int64_t in) {
    const float *s = (const float *)(img + fm_fp8_weight_scales_at(E, out, in));
    double *v = dnew(E * out * in);
    for (int64_t e = 0; e < E; e++)
        for (int64_t n = 0; n < out; n++)
            for (int64_t k = 0; k < in; k++) {
                const int64_t i = (e * out + n) * in + k;
                v[i] = (double)fm_e4m3_decode(img[i]) * s[(e * (out / 128) + n / 128) * (in / 128) + k / 128];
            }
    return v;
}
/* tokens image -> values [C, kcap] (tiles past the groups' zero) */
static double *dec_tokens(const uint8_t *img, int64_t ntiles, int64_t kcap, int64_t C) {
    const float *s = (const float *)(img + fm_fp8_tokens_scales_at(kcap, C));
    double *v = dnew(C * kcap);
    for (int64_t c = 0; c < C; c++)
        for (int64_t t = 0; t < ntiles * 128; t++) v[c * kcap + t] = (double)fm_e4m3_decode(img[c * kcap + t]) * s[(t / 128) * C + c];
    return v;
}

/* ---- GEMM checks ---- */

/* got (bf16 bits) against ref over the elements where mask is 1: the bound of the header. */
static void check_close(const char *what, const uint16_t *got, const double *ref, const uint8_t *mask, int64_t n) {
    double ss = 0;
    int64_t cnt = 0;
    for (int64_t i = 0; i < n; i++)
        if (mask[i]) ss += ref[i] * ref[i], cnt++;
    const double rms = cnt ? sqrt(ss / (double)cnt) : 0.0;
    int64_t bad = 0, first = -1;
    double worst = 0, used = 0; /* the largest |err| / rms, and |err| / bound */
    for (int64_t i = 0; i < n; i++) {
        if (!mask[i]) continue;
        const double g = gt_bf16_to_f32(got[i]), d = fabs(g - ref[i]), tol = 1e-2 * rms + ldexp(fabs(ref[i]), -8);
        if (!(d <= tol)) {
            if (first < 0) first = i;
            bad++;
        }
        if (rms > 0 && d / rms > worst) worst = d / rms;
        if (tol > 0 && d / tol > used) used = d / tol;
    }
    CHECK_MSG(bad == 0 && cnt > 0, "%s: %lld of %lld elements outside 1e-2 rms + 2^-8 |ref| (rms %g; first at %lld: gpu %g, "
              "reference %g)", what, (long long)bad, (long long)cnt, rms, (long long)first,
              first >= 0 ? gt_bf16_to_f32(got[first]) : 0.0, first >= 0 ? ref[first] : 0.0);
    printf("  %s: %lld elements, worst |err| %.2e rms (%.2f of the bound)\n", what, (long long)cnt, worst, used);
}

/* Elements where mask is 0 keep the bits `want`. */
static void check_untouched(const char *what, const uint16_t *got, const uint16_t *want, const uint8_t *mask, int64_t n) {
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (!mask[i] && got[i] != want[i]) {
            if (first < 0) first = i;
            bad++;
        }
    CHECK_MSG(bad == 0, "%s: %lld elements changed that must stay untouched (first at %lld: 0x%04x, was 0x%04x)", what,
              (long long)bad, (long long)first, first >= 0 ? got[first] : 0, first >= 0 ? want[first] : 0);
}

/* Runs kind with the schedule under test (g_gbe) on a C buffer preset to `init` (bf16 bits [n])
 * and returns the result (bits [n]). */
static uint16_t *run_gemm(int kind, float beta, const uint16_t *init, int64_t n, const void *A8, const void *B8,
                          const int64_t *off, int64_t rcap, int64_t E, int64_t in, int64_t out) {
    void *dC = dev_bytes(n * 2);
    up_bits(dC, init, n);
    g_be.ops->stream_sync(g_be.ctx, FM_STREAM_COMPUTE); /* the upload and the quantizers, then g_gbe's stream */
    g_gbe->ops->expert_fp8_gemm(g_gbe->ctx, kind, dC, beta, A8, B8, off, rcap, E, in, out);
    g_gbe->ops->stream_sync(g_gbe->ctx, FM_STREAM_COMPUTE);
    uint16_t *h = malloc((size_t)n * 2);
    down_bytes(h, dC, n * 2);
    g_be.ops->mem_free(g_be.ctx, dC);
    return h;
}

typedef struct fp8_case {
    const char *name;
    int64_t E, in, out, rcap;
    int64_t m[8];
    bool pinned; /* offsets in pinned host memory, else device memory */
    bool nonfinite; /* put NaN and inf into tiles; quantizers only */
    bool corners;   /* corner values (corner_acts, corner_weight) in every tiling; quantizers only */
} fp8_case;

static void run_case(const fp8_case *tc) {
    const int64_t E = tc->E, in = tc->in, out = tc->out, rcap = tc->rcap, kcap = fm_fp8_kcap(rcap, E);
    int64_t off[9], pblk[9];
    off[0] = 0;
    for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + tc->m[e];
    const int64_t R = off[E];
    FM_ASSERT(R <= rcap);
    pblk_of(pblk, off, E);
    printf("[%s] %s: E %lld, in %lld, out %lld, rows %lld of rcap %lld, offsets in %s memory\n",
           fm_fp8_gemm_name(g_sched[g_si]), tc->name, (long long)E, (long long)in, (long long)out, (long long)R,
           (long long)rcap, tc->pinned ? "pinned host" : "device");

    float *x = randn(R, in, 1.0), *dy = randn(R, out, 0.5), *W = randn(E * out, in, 0.05);
    if (tc->corners) {
        corner_acts(x, in, off, pblk, E, 1);
        corner_acts(dy, out, off, pblk, E, 4);
        corner_weight(W, E, out, in);
    }
    if (tc->nonfinite) {
        x[0 * in + 10] = f_nan();           /* row 0, tile 0; tokens: group 0, channel 10 */
        x[(R - 1) * in + 200] = INFINITY;   /* the last row, tile 1 */
        dy[3 * out + 130] = -INFINITY;
        W[(1 * out + 5) * in + 129] = f_nan(); /* expert 1, block (0, 1) */
    }
    int64_t *doff;
    if (tc->pinned) {
        doff = g_be.ops->buffer_alloc(g_be.ctx, FM_BUFFER_PINNED, sizeof(int64_t) * (size_t)(E + 1));
        FM_ASSERT(doff != NULL);
        memcpy(doff, off, sizeof(int64_t) * (size_t)(E + 1));
    } else {
        doff = dev_bytes((int64_t)sizeof(int64_t) * (E + 1));
        g_be.ops->copy(g_be.ctx, doff, off, sizeof(int64_t) * (size_t)(E + 1), FM_COPY_H2D);
    }
    fm_act *dX = gt_upload(&g_be, x, R * in, FM_DTYPE_BF16), *dDY = gt_upload(&g_be, dy, R * out, FM_DTYPE_BF16);
    fm_act *dW = gt_upload(&g_be, W, E * out * in, FM_DTYPE_BF16);

    /* (a) the quantizers */
    const int64_t nw = fm_fp8_weight_bytes(E, out, in), nxr = fm_fp8_rows_bytes(rcap, in), nyr = fm_fp8_rows_bytes(rcap, out);
    const int64_t nyt = fm_fp8_tokens_bytes(kcap, out), nxt = fm_fp8_tokens_bytes(kcap, in);
    void *w8 = dev_sentinel(nw), *xr8 = dev_sentinel(nxr), *yr8 = dev_sentinel(nyr), *yt8 = dev_sentinel(nyt),
         *xt8 = dev_sentinel(nxt);
    g_be.ops->fp8_quant_weight(g_be.ctx, w8, dW, E, out, in);
    g_be.ops->fp8_quant_rows(g_be.ctx, xr8, dX, doff, rcap, E, in);
    g_be.ops->fp8_quant_rows(g_be.ctx, yr8, dDY, doff, rcap, E, out);
    g_be.ops->fp8_quant_tokens(g_be.ctx, yt8, dDY, doff, rcap, E, out);
    g_be.ops->fp8_quant_tokens(g_be.ctx, xt8, dX, doff, rcap, E, in);
    CHECK_BACKEND_OK(&g_be);

    uint8_t *rw = host_sentinel(nw), *rxr = host_sentinel(nxr), *ryr = host_sentinel(nyr), *ryt = host_sentinel(nyt),
            *rxt = host_sentinel(nxt);
    ref_weight(rw, W, E, out, in);
    ref_rows(rxr, x, R, rcap, in);
    ref_rows(ryr, dy, R, rcap, out);
    ref_tokens(ryt, dy, off, E, kcap, out);
    ref_tokens(rxt, x, off, E, kcap, in);
    uint8_t *gw = host_sentinel(nw), *gxr = host_sentinel(nxr), *gyr = host_sentinel(nyr), *gyt = host_sentinel(nyt),
            *gxt = host_sentinel(nxt);
    down_bytes(gw, w8, nw), down_bytes(gxr, xr8, nxr), down_bytes(gyr, yr8, nyr), down_bytes(gyt, yt8, nyt),
        down_bytes(gxt, xt8, nxt);
    const int64_t nt = pblk[E];
    if (g_si == 0) { /* the quantizers: checked once, with the first schedule */
        same_bytes("fp8_quant_weight: Wq, WqT, scales (the whole buffer)", gw, rw, nw, 0);
        same_bytes("fp8_quant_rows x: codes, scales, unwritten rows (the whole buffer)", gxr, rxr, nxr, 0);
        same_bytes("fp8_quant_rows dy: the whole buffer", gyr, ryr, nyr, 0);
        /* tokens: every channel's codes of the groups' tiles (zero tails included), and their scales */
        struct { const char *what; const uint8_t *g, *r; int64_t C, n; } tk[2] = {
            {"fp8_quant_tokens dy", gyt, ryt, out, nyt}, {"fp8_quant_tokens x", gxt, rxt, in, nxt}};
        for (int i = 0; i < 2; i++) {
            int ok = 1;
            for (int64_t c = 0; c < tk[i].C && ok; c++)
                ok = same_bytes(tk[i].what, tk[i].g + c * kcap, tk[i].r + c * kcap, nt * 128, c * kcap);
            const int64_t so = fm_fp8_tokens_scales_at(kcap, tk[i].C);
            same_bytes(tk[i].what, tk[i].g + so, tk[i].r + so, nt * tk[i].C * 4, so);
            /* the whole buffer: token tiles past the groups' (pblk[E] .. kcap/128), their scales and the
             * padding stay the sentinel (nothing written past the groups' tiles) */
            if (ok) same_bytes(tk[i].what, tk[i].g, tk[i].r, tk[i].n, 0);
        }
    }

    if (!tc->nonfinite && !tc->corners) {
        /* (b) the GEMMs, on the reference's decoded values */
        double *xd = dec_rows(rxr, R, rcap, in), *yd = dec_rows(ryr, R, rcap, out), *wd = dec_weight(rw, E, out, in);
        double *ytd = dec_tokens(ryt, nt, kcap, out), *xtd = dec_tokens(rxt, nt, kcap, in);
        int64_t *grp = calloc((size_t)(R > 0 ? R : 1), sizeof(int64_t));
        for (int64_t e = 0; e < E; e++)
            for (int64_t r = off[e]; r < off[e + 1]; r++) grp[r] = e;

        /* kind 0: y [rcap, out], rows < R */
        const int64_t ny = rcap * out;
        double *ref = dnew(ny);
        uint8_t *mask = calloc((size_t)ny, 1);
        uint16_t *init = malloc((size_t)ny * 2);
        for (int64_t i = 0; i < ny; i++) init[i] = BF16_NAN;
        for (int64_t r = 0; r < R; r++)
            for (int64_t o = 0; o < out; o++) {
                const double *xr = xd + r * in, *wr = wd + (grp[r] * out + o) * in;
                double s = 0;
                for (int64_t k = 0; k < in; k++) s += xr[k] * wr[k];
                ref[r * out + o] = s, mask[r * out + o] = 1;
            }
        uint16_t *got = run_gemm(0, 0.0f, init, ny, xr8, w8, doff, rcap, E, in, out);
        check_close(lbl("kind 0 (y = x W^T)"), got, ref, mask, ny);
        check_untouched(lbl("kind 0: rows at or past offsets[E]"), got, init, mask, ny);
        free(got), free(ref), free(mask), free(init);

        /* kind 1: dx [rcap, in] = beta dx + dy W, rows < R */
        const int64_t nx = rcap * in;
        double *sum = dnew(nx);
        mask = calloc((size_t)nx, 1);
        for (int64_t r = 0; r < R; r++)
            for (int64_t i = 0; i < in; i++) {
                const double *yr = yd + r * out, *wc = wd + grp[r] * out * in + i;
                double s = 0;
                for (int64_t o = 0; o < out; o++) s += yr[o] * wc[o * in];
                sum[r * in + i] = s, mask[r * in + i] = 1;
            }
        init = malloc((size_t)nx * 2);
        for (int64_t i = 0; i < nx; i++) init[i] = BF16_NAN;
        got = run_gemm(1, 0.0f, init, nx, yr8, w8, doff, rcap, E, in, out);
        check_close(lbl("kind 1 (dx = dy W), beta 0 over NaN"), got, sum, mask, nx);
        check_untouched(lbl("kind 1, beta 0: rows at or past offsets[E]"), got, init, mask, nx);
        free(got);
        ref = dnew(nx);
        for (int64_t i = 0; i < nx; i++)
            if (mask[i]) {
                const float old = (float)(0.5 * fm_rng_normal(&g_rng));
                init[i] = gt_f32_to_bf16(old);
                ref[i] = (double)gt_bf16_to_f32(init[i]) + sum[i];
            }
        got = run_gemm(1, 1.0f, init, nx, yr8, w8, doff, rcap, E, in, out);
        check_close(lbl("kind 1, beta 1 over random values"), got, ref, mask, nx);
        check_untouched(lbl("kind 1, beta 1: rows at or past offsets[E]"), got, init, mask, nx);
        free(got), free(ref), free(sum), free(mask), free(init);

        /* kind 2: dW [E, out, in] = beta dW + dy^T x, over each group's tokens */
        const int64_t nW = E * out * in;
        sum = dnew(nW);
        mask = calloc((size_t)nW, 1);
        for (int64_t e = 0; e < E; e++) {
            const int64_t me = off[e + 1] - off[e], t0 = pblk[e] * 128;
            for (int64_t o = 0; o < out; o++)
                for (int64_t i = 0; i < in; i++) {
                    const double *a = ytd + o * kcap + t0, *b = xtd + i * kcap + t0;
                    double s = 0;
                    for (int64_t j = 0; j < me; j++) s += a[j] * b[j];
                    sum[(e * out + o) * in + i] = s, mask[(e * out + o) * in + i] = me > 0;
                }
        }
        init = malloc((size_t)nW * 2);
        for (int64_t i = 0; i < nW; i++) init[i] = BF16_NAN;
        got = run_gemm(2, 0.0f, init, nW, yt8, xt8, doff, rcap, E, in, out);
        check_close(lbl("kind 2 (dW = dy^T x), beta 0 over NaN"), got, sum, mask, nW);
        int64_t nz = 0;
        for (int64_t i = 0; i < nW; i++) nz += !mask[i] && got[i] != 0;
        CHECK_MSG(nz == 0, "[%s] kind 2, beta 0: %lld elements of empty experts are not +0", fm_fp8_gemm_name(g_sched[g_si]),
                  (long long)nz);
        free(got);
        ref = dnew(nW);
        for (int64_t i = 0; i < nW; i++) {
            init[i] = gt_f32_to_bf16((float)(0.01 * fm_rng_normal(&g_rng)));
            ref[i] = (double)gt_bf16_to_f32(init[i]) + sum[i];
        }
        got = run_gemm(2, 1.0f, init, nW, yt8, xt8, doff, rcap, E, in, out);
        check_close(lbl("kind 2, beta 1 over random values"), got, ref, mask, nW);
        check_untouched(lbl("kind 2, beta 1: the empty experts' dW_e"), got, init, mask, nW);
        free(got), free(ref), free(sum), free(mask), free(init);
        free(xd), free(yd), free(wd), free(ytd), free(xtd), free(grp);
    }
    CHECK_BACKEND_OK(&g_be);
    if (g_gbe != &g_be) {
        const fm_status gs = g_gbe->ops->status(g_gbe->ctx);
        CHECK_MSG(gs == FM_OK, "[%s] %s: the GEMM backend's status %s: %s", fm_fp8_gemm_name(g_sched[g_si]), tc->name,
                  fm_status_name(gs), gs == FM_OK ? "" : fm_errmsg());
    }

    free(rw), free(rxr), free(ryr), free(ryt), free(rxt), free(gw), free(gxr), free(gyr), free(gyt), free(gxt);
    void *dbufs[8] = {w8, xr8, yr8, yt8, xt8, dX, dDY, dW};
    for (int i = 0; i < 8; i++) g_be.ops->mem_free(g_be.ctx, dbufs[i]);
    if (tc->pinned) g_be.ops->buffer_free(g_be.ctx, FM_BUFFER_PINNED, doff);
    else g_be.ops->mem_free(g_be.ctx, doff);
    free(x), free(dy), free(W);
}

/* ---- timings (FLATMOE_TEST_NO_BENCH=1 skips them) ---- */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
/* The mean seconds of 10 calls on backend be after 2 warm-up calls (host clock around a sync). */
#define TIME_IT(be, dt, call)                                  \
    do {                                                       \
        for (int w_ = 0; w_ < 2; w_++) call;                   \
        (be)->ops->sync((be)->ctx);                            \
        const double t0_ = now_s();                            \
        for (int r_ = 0; r_ < 10; r_++) call;                  \
        (be)->ops->sync((be)->ctx);                            \
        (dt) = (now_s() - t0_) / 10;                           \
    } while (0)

/* OLMoE's expert layer (64 experts, hidden 2048, intermediate 1024, 4096 tokens x top-8: 512 rows
 * an expert), its gate/up product H -> I: each FP8 op, then the three FP8 products against the
 * bf16 sm90 kernel's (expert_linear_fwd_dev / _bwd_dev) on the same shape; bench_gemms times the
 * FP8 products again under each v5 schedule. The buffers live from bench_open to bench_close. */
static const int64_t B_E = 64, B_H = 2048, B_I = 1024, B_R = 4096 * 8;
static struct {
    bool open;
    int64_t *off;
    fm_act *W, *dW, *x, *dx, *dy, *y;
    void *w8, *xr, *yr, *xt, *yt;
    double v3[3];          /* v3's y, dx, dW seconds */
    double t[N_SCHED][3];  /* each schedule's (0: not timed) */
} g_b;
static double bench_flop(void) { return 2.0 * (double)B_R * (double)B_H * (double)B_I; }

static void bench_open(void) {
    const int64_t E = B_E, H = B_H, I = B_I, R = B_R, kcap = fm_fp8_kcap(R, E);
    const fm_ops *O = g_be.ops;
    void *ctx = g_be.ctx;
    printf("timings: E %lld, in %lld, out %lld, %lld rows (%lld an expert)\n", (long long)E, (long long)H, (long long)I,
           (long long)R, (long long)(R / E));
    g_b.off = O->buffer_alloc(ctx, FM_BUFFER_PINNED, sizeof(int64_t) * (size_t)(E + 1));
    FM_ASSERT(g_b.off != NULL);
    for (int64_t e = 0; e <= E; e++) g_b.off[e] = e * (R / E);
    float *h = fnew(E * I * H);
    for (int64_t i = 0; i < E * I * H; i++) h[i] = 0.05f * (fm_rng_uniform(&g_rng) - 0.5f);
    g_b.W = gt_upload(&g_be, h, E * I * H, FM_DTYPE_BF16), g_b.dW = dev_bytes(E * I * H * 2);
    g_b.x = gt_upload(&g_be, h, R * H, FM_DTYPE_BF16), g_b.dx = dev_bytes(R * H * 2); /* R H < E I H */
    g_b.dy = gt_upload(&g_be, h, R * I, FM_DTYPE_BF16), g_b.y = dev_bytes(R * I * 2);
    free(h);
    g_b.w8 = dev_bytes(fm_fp8_weight_bytes(E, I, H)), g_b.xr = dev_bytes(fm_fp8_rows_bytes(R, H));
    g_b.yr = dev_bytes(fm_fp8_rows_bytes(R, I)), g_b.xt = dev_bytes(fm_fp8_tokens_bytes(kcap, H));
    g_b.yt = dev_bytes(fm_fp8_tokens_bytes(kcap, I));
    double t;
    TIME_IT(&g_be, t, O->fp8_quant_weight(ctx, g_b.w8, g_b.W, E, I, H));
    printf("  fp8_quant_weight [%lld, %lld, %lld]        %8.3f ms  %6.0f GB/s\n", (long long)E, (long long)I, (long long)H,
           t * 1e3, (double)(E * I * H * 4) / t * 1e-9);
    TIME_IT(&g_be, t, O->fp8_quant_rows(ctx, g_b.xr, g_b.x, g_b.off, R, E, H));
    printf("  fp8_quant_rows x [%lld, %lld]               %8.3f ms  %6.0f GB/s\n", (long long)R, (long long)H, t * 1e3,
           (double)(R * H * 3) / t * 1e-9);
    TIME_IT(&g_be, t, O->fp8_quant_tokens(ctx, g_b.xt, g_b.x, g_b.off, R, E, H));
    printf("  fp8_quant_tokens x [%lld, %lld]             %8.3f ms  %6.0f GB/s\n", (long long)R, (long long)H, t * 1e3,
           (double)(R * H * 3) / t * 1e-9);
    O->fp8_quant_rows(ctx, g_b.yr, g_b.dy, g_b.off, R, E, I);
    O->fp8_quant_tokens(ctx, g_b.yt, g_b.dy, g_b.off, R, E, I);
    O->sync(ctx);
    g_b.open = true;
}

/* A v5 variant's GEMM lines (si > 0), beside v3's; nothing when it was not timed. */
static void bench_print(int si) {
    const double flop = bench_flop(), *f = g_b.t[si], *v = g_b.v3;
    const char *nm = fm_fp8_gemm_name(g_sched[si]);
    if (f[0] <= 0 || v[0] <= 0) return;
    printf("  fp8 y = x W^T %-3s %8.3f ms %6.0f TFLOP/s   v3 %8.3f ms: %.2fx v3's speed\n", nm, f[0] * 1e3,
           flop / f[0] * 1e-12, v[0] * 1e3, v[0] / f[0]);
    printf("  fp8 dx, dW    %-3s %8.3f ms %6.0f TFLOP/s   v3 %8.3f ms: %.2fx (dx %.3f ms, dW %.3f ms; v3 dx %.3f ms, dW %.3f "
           "ms: %.2fx, %.2fx)\n",
           nm, (f[1] + f[2]) * 1e3, 2 * flop / (f[1] + f[2]) * 1e-12, (v[1] + v[2]) * 1e3, (v[1] + v[2]) / (f[1] + f[2]),
           f[1] * 1e3, f[2] * 1e3, v[1] * 1e3, v[2] * 1e3, v[1] / f[1], v[2] / f[2]);
}

/* The three FP8 products under schedule si (g_bes[si]; dx beta 0, dW beta 1 as training runs
 * them). Not timed when the schedule's backend has an error already. */
static void bench_gemms(int si) {
    fm_backend *b = &g_bes[si];
    const fm_ops *O = b->ops;
    void *ctx = b->ctx;
    const int64_t E = B_E, H = B_H, I = B_I, R = B_R;
    if (!g_b.open || O->status(ctx) != FM_OK) return;
    double *f = g_b.t[si];
    TIME_IT(b, f[0], O->expert_fp8_gemm(ctx, 0, g_b.y, 0.0f, g_b.xr, g_b.w8, g_b.off, R, E, H, I));
    TIME_IT(b, f[1], O->expert_fp8_gemm(ctx, 1, g_b.dx, 0.0f, g_b.yr, g_b.w8, g_b.off, R, E, H, I));
    TIME_IT(b, f[2], O->expert_fp8_gemm(ctx, 2, g_b.dW, 1.0f, g_b.yt, g_b.xt, g_b.off, R, E, H, I));
    const fm_status st = O->status(ctx);
    CHECK_MSG(st == FM_OK, "[%s] timings: backend status %s: %s", fm_fp8_gemm_name(g_sched[si]), fm_status_name(st),
              st == FM_OK ? "" : fm_errmsg());
    if (st != FM_OK) f[0] = f[1] = f[2] = 0;
    if (si == 0) memcpy(g_b.v3, f, sizeof g_b.v3);
}

/* v3's products and the bf16 sm90 kernel's */
static void bench_v3(void) {
    const fm_ops *O = g_be.ops;
    void *ctx = g_be.ctx;
    const int64_t E = B_E, H = B_H, I = B_I, R = B_R;
    const double flop = bench_flop();
    bench_gemms(0);
    const double f0 = g_b.v3[0], f1 = g_b.v3[1], f2 = g_b.v3[2];
    double b0, b12;
    TIME_IT(&g_be, b0, O->expert_linear_fwd_dev(ctx, g_b.y, g_b.x, g_b.W, g_b.off, R, E, H, I));
    TIME_IT(&g_be, b12, O->expert_linear_bwd_dev(ctx, g_b.dx, 0.0f, g_b.dW, g_b.dy, g_b.x, g_b.W, g_b.off, R, E, H, I));
    printf("  fp8 y = x W^T v3  %8.3f ms %6.0f TFLOP/s   bf16 sm90 %8.3f ms %6.0f TFLOP/s\n", f0 * 1e3,
           flop / f0 * 1e-12, b0 * 1e3, flop / b0 * 1e-12);
    printf("  fp8 dx, dW    v3  %8.3f ms %6.0f TFLOP/s   bf16 sm90 %8.3f ms %6.0f TFLOP/s (dx %.3f ms, dW %.3f ms)\n",
           (f1 + f2) * 1e3, 2 * flop / (f1 + f2) * 1e-12, b12 * 1e3, 2 * flop / b12 * 1e-12, f1 * 1e3, f2 * 1e3);
    CHECK_BACKEND_OK(&g_be);
}

static void bench_close(void) {
    if (!g_b.open) return;
    const fm_ops *O = g_be.ops;
    void *d[11] = {g_b.W, g_b.dW, g_b.x, g_b.dx, g_b.dy, g_b.y, g_b.w8, g_b.xr, g_b.yr, g_b.xt, g_b.yt};
    for (int i = 0; i < 11; i++) O->mem_free(g_be.ctx, d[i]);
    O->buffer_free(g_be.ctx, FM_BUFFER_PINNED, g_b.off);
    g_b.open = false;
}

/* expert_fp8_serves on a backend created with expert_gemm `g` for a served shape. */
static int serves_with(fm_expert_gemm g) {
    fm_backend b;
    fm_backend_opts o = fm_backend_opts_default();
    o.expert_gemm = g;
    if (fm_cuda_backend_init(&b, 0, &o) != FM_OK) return -1;
    const int r = b.ops->expert_fp8_serves(b.ctx, 8, 256, 512, 4096) ? 1 : 0;
    fm_cuda_backend_free(&b);
    return r;
}

int main(void) {
    const int rc = fp8_test_backend(&g_be, g_sched[0]) /* v3 */;
    if (rc) return rc;
    const fm_ops *O = g_be.ops;
    const bool have = O->expert_fp8_serves && O->fp8_quant_weight && O->fp8_quant_rows && O->fp8_quant_tokens &&
                      O->expert_fp8_gemm;
    CHECK_MSG(have, "the CUDA backend's op table lacks an FP8 code op");
    if (!have) return fm_test_finish();
    CHECK_MSG(O->expert_fp8_serves(g_be.ctx, 8, 256, 512, 4096), "expert_fp8_serves is false on an sm_90 device");
    /* the shapes and the option */
    CHECK(!O->expert_fp8_serves(g_be.ctx, 8, 100, 512, 4096));
    CHECK(!O->expert_fp8_serves(g_be.ctx, 8, 256, 200, 4096));
    CHECK(!O->expert_fp8_serves(g_be.ctx, 257, 256, 512, 4096));
    CHECK(!O->expert_fp8_serves(g_be.ctx, 8, 256, 512, (int64_t)1 << 31));
    CHECK(O->expert_fp8_serves(g_be.ctx, 256, 2048, 768, 65536));
    CHECK(serves_with(FM_EXPERT_GEMM_SM90) == 1);
    CHECK(serves_with(FM_EXPERT_GEMM_CUBLAS) == 0);
    CHECK(serves_with(FM_EXPERT_GEMM_LOOP) == 0);
    CHECK(serves_with(FM_EXPERT_GEMM_GROUPED) == 0);

    /* the schedule option: an unknown value is refused at creation */
    {
        fm_backend bad;
        fm_backend_opts ob = fm_backend_opts_default();
        ob.fp8_gemm = (fm_fp8_gemm)9;
        CHECK(fm_cuda_backend_init(&bad, 0, &ob) == FM_ERR_ARG);
        CHECK_MSG(strstr(fm_errmsg(), "FLATMOE_FP8_GEMM") != NULL, "%s", fm_errmsg());
    }
    /* a backend per schedule (g_be is v3's); FLATMOE_TEST_FP8_SCHEDULES limits the v5 variants */
    const char *only = getenv("FLATMOE_TEST_FP8_SCHEDULES");
    bool run_si[N_SCHED];
    g_bes[0] = g_be;
    for (int si = 0; si < N_SCHED; si++) {
        run_si[si] = si == 0;
        if (si == 0) continue;
        const char *nm = fm_fp8_gemm_name(g_sched[si]);
        if (only && only[0]) { /* nm as a whole comma-separated item */
            const size_t n = strlen(nm);
            for (const char *q = only; (q = strstr(q, nm)) != NULL; q += n)
                if ((q == only || q[-1] == ',') && (q[n] == ',' || q[n] == '\0')) run_si[si] = true;
            if (!run_si[si]) continue;
        }
        fm_backend_opts os = fm_backend_opts_default();
        os.fp8_gemm = g_sched[si];
        const fm_status bs = fm_cuda_backend_init(&g_bes[si], 0, &os);
        CHECK_MSG(bs == FM_OK, "[%s] cuda backend: %s", nm, fm_errmsg());
        run_si[si] = bs == FM_OK;
    }

    fm_rng_seed(&g_rng, fm_test_seed(20261201));
    pat_init();
    static const fp8_case cases[] = {
        /* empty expert 1; expert 2 starts at row 130 (not a multiple of 4), expert 3 at odd row 387 */
        {"uneven", 4, 256, 384, 400, {130, 0, 257, 1}, true, false, false},
        /* one expert owns every row; the others are empty */
        {"one expert owns all", 8, 512, 128, 300, {0, 0, 0, 300, 0, 0, 0, 0}, false, false, false},
        /* experts at odd rows 1, 129 (twice: an empty one between), 206 */
        {"odd starts", 5, 128, 512, 461, {1, 128, 0, 77, 255}, true, false, false},
        {"odd starts, two empty", 6, 384, 256, 401, {3, 200, 0, 0, 129, 64}, true, false, false},
        /* fewer rows than a tile, rpad (44) shorter than the row-scale box (132): TMA fills the rest */
        {"few rows", 4, 128, 256, 43, {10, 0, 29, 1}, false, false, false},
        /* more k-blocks (v5's overlapped chunks: kind 0 9 = 8 + 1, kind 1 5 = 4 + 1, kind 2 2, 1, 2)
         * and whole 128-row tiles (v5's TMA-store epilogue) beside a partial one */
        {"long K, whole tiles", 3, 1152, 640, 700, {256, 128, 205}, false, false, false},
        {"non-finite tiles (quantizers)", 2, 256, 256, 203, {130, 70}, true, true, false},
        /* rounding ties, E4M3 subnormals, fp32-subnormal products, amax 2^-133 .. bf16's largest,
         * all-zero tiles with -0, a scale one binade up (450): every tiling, every corner */
        {"corners (quantizers)", 4, 512, 256, 1100, {300, 0, 513, 270}, true, false, true},
        {"corners, short groups (quantizers)", 6, 256, 384, 500, {5, 130, 0, 1, 128, 200}, false, false, true},
        /* E = 1: one group, rcap (133) neither a multiple of 4 nor of 128 and above offsets[E] (130):
         * two token tiles, the second of 2 tokens; row-scale padding past rpad's rows unwritten */
        {"one group, corners (quantizers)", 1, 384, 128, 133, {130}, true, false, true},
    };
    const bool bench_on = !getenv("FLATMOE_TEST_NO_BENCH");
    /* v3 first (its checks and timings are printed before any v5 kernel runs), then each v5
     * variant: its checks, then its timings beside v3's */
    for (int si = 0; si < N_SCHED; si++) {
        if (!run_si[si]) continue;
        g_si = si, g_gbe = si == 0 ? &g_be : &g_bes[si];
        printf("== schedule %s (FLATMOE_FP8_GEMM=%s)\n", fm_fp8_gemm_name(g_sched[si]), fm_fp8_gemm_name(g_sched[si]));
        fflush(stdout);
        const int failed0 = fm_test_failed;
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            if (si == 0 || (!cases[i].nonfinite && !cases[i].corners)) run_case(&cases[i]); /* quantizer-only cases once */
        printf("== schedule %s: %s\n", fm_fp8_gemm_name(g_sched[si]), fm_test_failed == failed0 ? "every GEMM check passed" : "FAILED");
        if (bench_on) {
            if (si == 0) bench_open(), bench_v3();
            else bench_gemms(si), bench_print(si);
        }
        fflush(stdout);
    }
    if (bench_on && g_b.open) { /* every schedule's GEMM lines together */
        printf("timings, every schedule (E %lld, in %lld, out %lld, %lld rows):\n", (long long)B_E, (long long)B_H,
               (long long)B_I, (long long)B_R);
        const double flop = bench_flop();
        const double *v = g_b.v3;
        if (v[0] > 0)
            printf("  fp8 y = x W^T v3  %8.3f ms %6.0f TFLOP/s; fp8 dx, dW v3  %8.3f ms (dx %.3f ms, dW %.3f ms)\n", v[0] * 1e3,
                   flop / v[0] * 1e-12, (v[1] + v[2]) * 1e3, v[1] * 1e3, v[2] * 1e3);
        for (int si = 1; si < N_SCHED; si++) bench_print(si);
        bench_close();
    }
    for (int si = 1; si < N_SCHED; si++)
        if (run_si[si]) fm_cuda_backend_free(&g_bes[si]);

    /* a shape outside the kernels is an error of the op, recorded in the context */
    O->expert_fp8_gemm(g_be.ctx, 0, NULL, 0.0f, NULL, NULL, NULL, 10, 4, 100, 128);
    CHECK(O->status(g_be.ctx) == FM_ERR_ARG);
    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
