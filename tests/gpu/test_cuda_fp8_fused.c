/* The CUDA backend's fused FP8 quantizations (fm_backend.h: fp8_quant_dual, fp8_swiglu_bwd_quant,
 * fp8_swiglu_fwd_quant; backend/cuda/sm90/gg_sm90_fp8_fused.cu) against the ops they replace and
 * the host reference (fp8_codes_ref.h, from backend/fm_fp8.h and backend/fm_fp8_layout.h). Label
 * gpu; skipped (77) without a CUDA device of compute capability 9.0.
 *
 * Cases: test_cuda_fp8_codes.c's quantizer cases (uneven groups with empty ones, one group owning
 * every row, odd starts, fewer rows than a tile, rcap above offsets[E], E = 1, offsets in pinned
 * host and in device memory, NaN and inf in tiles, the "corners" values in every tiling), C the
 * case's `in`. Every output buffer starts as a sentinel and is compared whole, byte for byte:
 *  - fp8_quant_dual(a): its rows and tokens operands equal the reference's of a (ref_rows,
 *    ref_tokens: rows past offsets[E], token tiles past the groups' and the padding unwritten);
 *  - fp8_swiglu_bwd_quant(dout, gate, up): its four operands equal those of the sequence it
 *    replaces on the device (swiglu_bwd into bf16 dgate, dup, then fp8_quant_rows and
 *    fp8_quant_tokens of each), and the reference's of those dgate, dup (the SwiGLU values are
 *    the device's expf: the host's differs in the last bit, so the reference quantizes the
 *    device's bf16 values);
 *  - fp8_swiglu_fwd_quant(gate, up): out equal to swiglu_fwd's bit for bit (rows past offsets[E]
 *    the sentinel), its rows operand equal to fp8_quant_rows(out)'s and to the reference's.
 * In the corners cases dout carries the corner values, gate 0 and up 2, so dgate = (dout 2) 0.5 =
 * dout exactly (inf where dout 2 overflows: every rounding corner reaches the fused coder) and dup
 * is +-0; the forward's gate is 32
 * (sigmoid exactly 1) and up the corners, so out = 32 up exactly (bf16's largest overflows: an
 * inf tile).
 * Then (unless FLATMOE_TEST_NO_BENCH=1) each fused op timed beside the unfused sequence at OLMoE's
 * expert shape (64 experts, hidden 2048, intermediate 1024, 32768 rows): ms and the ratio. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "backend/fm_fp8.h"
#include "backend/fm_fp8_layout.h"
#include "core/fm_rng.h"
#include "fp8_codes_ref.h"
#include "gpu_test.h"

static fm_rng g_rng;

/* ---- device helpers ---- */

static uint8_t *down(const void *d, int64_t n) {
    uint8_t *h = host_sentinel(n);
    down_bytes(h, d, n);
    return h;
}
/* rows x cols bf16 normals of `scale`, each row scaled by 2^(-2..2) (the tiles' scales differ). */
static float *randn(int64_t rows, int64_t cols, double scale) {
    float *x = fnew(rows * cols > 0 ? rows * cols : 1);
    for (int64_t r = 0; r < rows; r++) {
        const double rs = scale * ldexp(1.0, (int)fm_rng_below(&g_rng, 5) - 2);
        for (int64_t j = 0; j < cols; j++) x[r * cols + j] = (float)(rs * fm_rng_normal(&g_rng));
    }
    gt_round_bf16(x, rows * cols);
    return x;
}
/* bf16 bits [n] on the host -> floats */
static float *bits_to_f(const uint8_t *b, int64_t n) {
    float *x = fnew(n > 0 ? n : 1);
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, b + 2 * i, 2);
        x[i] = gt_bf16_to_f32(h);
    }
    return x;
}

typedef struct fused_case {
    const char *name;
    int64_t E, C, rcap;
    int64_t m[8];
    bool pinned, nonfinite, corners;
} fused_case;

static void run_case(const fused_case *tc) {
    const fm_ops *O = g_be.ops;
    void *ctx = g_be.ctx;
    const int64_t E = tc->E, C = tc->C, rcap = tc->rcap, kcap = fm_fp8_kcap(rcap, E);
    int64_t off[9], pblk[9];
    off[0] = 0;
    for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + tc->m[e];
    const int64_t R = off[E];
    FM_ASSERT(R <= rcap);
    pblk_of(pblk, off, E);
    printf("%s: E %lld, C %lld, rows %lld of rcap %lld, offsets in %s memory\n", tc->name, (long long)E, (long long)C,
           (long long)R, (long long)rcap, tc->pinned ? "pinned host" : "device");
    /* a: dual's input and the backward's dout; g, u: the backward's gate, up; gf, u: the forward's */
    float *a = randn(R, C, 1.0), *g = randn(R, C, 2.0), *ub = randn(R, C, 1.0), *u = randn(R, C, 1.0);
    float *gf = randn(R, C, 2.0);
    if (tc->corners) {
        corner_acts(a, C, off, pblk, E, 1);
        corner_acts(u, C, off, pblk, E, 4);
        for (int64_t i = 0; i < R * C; i++) g[i] = 0.0f, ub[i] = 2.0f, gf[i] = 32.0f;
    }
    if (tc->nonfinite) {
        a[0 * C + 10] = f_nan(), a[(R - 1) * C + 200 % C] = INFINITY;
        g[3 * C + 130 % C] = -INFINITY, ub[5 * C + 7] = f_nan(), u[6 * C + 9] = f_nan(), gf[7 * C + 1] = INFINITY;
        g[9 * C + 2] = -100.0f, gf[9 * C + 3] = 1e30f; /* sigmoid 0; out overflows bf16 */
    }
    int64_t *doff;
    if (tc->pinned) {
        doff = O->buffer_alloc(ctx, FM_BUFFER_PINNED, sizeof(int64_t) * (size_t)(E + 1));
        FM_ASSERT(doff != NULL);
        memcpy(doff, off, sizeof(int64_t) * (size_t)(E + 1));
    } else {
        doff = dev_bytes((int64_t)sizeof(int64_t) * (E + 1));
        O->copy(ctx, doff, off, sizeof(int64_t) * (size_t)(E + 1), FM_COPY_H2D);
    }
    fm_act *dA = gt_upload(&g_be, a, R * C, FM_DTYPE_BF16), *dG = gt_upload(&g_be, g, R * C, FM_DTYPE_BF16);
    fm_act *dU = gt_upload(&g_be, u, R * C, FM_DTYPE_BF16), *dGf = gt_upload(&g_be, gf, R * C, FM_DTYPE_BF16);
    fm_act *dUb = gt_upload(&g_be, ub, R * C, FM_DTYPE_BF16);
    const int64_t nr = fm_fp8_rows_bytes(rcap, C), nt = fm_fp8_tokens_bytes(kcap, C), nb = rcap * C * 2;

    /* fp8_quant_dual against the reference of a */
    void *q = dev_sentinel(nr), *t = dev_sentinel(nt);
    O->fp8_quant_dual(ctx, q, t, dA, doff, rcap, E, C);
    uint8_t *rq = host_sentinel(nr), *rt = host_sentinel(nt);
    ref_rows(rq, a, R, rcap, C);
    ref_tokens(rt, a, off, E, kcap, C);
    uint8_t *gq = down(q, nr), *gtk = down(t, nt);
    same_bytes("fp8_quant_dual: rows operand (the whole buffer)", gq, rq, nr, 0);
    same_bytes("fp8_quant_dual: tokens operand (the whole buffer)", gtk, rt, nt, 0);
    free(rq), free(rt), free(gq), free(gtk);
    O->mem_free(ctx, q), O->mem_free(ctx, t);

    /* fp8_swiglu_bwd_quant against swiglu_bwd + 4 quantizations, and the reference of its dgate, dup */
    void *dDG = dev_sentinel(nb), *dDU = dev_sentinel(nb), *uq[4], *fq[4];
    const int64_t n4[4] = {nr, nr, nt, nt};
    for (int i = 0; i < 4; i++) uq[i] = dev_sentinel(n4[i]), fq[i] = dev_sentinel(n4[i]);
    O->swiglu_bwd(ctx, dDG, dDU, dA, dG, dUb, R * C);
    O->fp8_quant_rows(ctx, uq[0], dDG, doff, rcap, E, C);
    O->fp8_quant_rows(ctx, uq[1], dDU, doff, rcap, E, C);
    O->fp8_quant_tokens(ctx, uq[2], dDG, doff, rcap, E, C);
    O->fp8_quant_tokens(ctx, uq[3], dDU, doff, rcap, E, C);
    O->fp8_swiglu_bwd_quant(ctx, fq[0], fq[1], fq[2], fq[3], dA, dG, dUb, doff, rcap, E, C);
    uint8_t *hdg = down(dDG, nb), *hdu = down(dDU, nb);
    float *fdg = bits_to_f(hdg, R * C), *fdu = bits_to_f(hdu, R * C);
    if (tc->corners) { /* dgate = (dout 2) 0.5 = dout exactly (inf where dout 2 overflows): the corners reach the coder */
        int64_t nd = 0;
        for (int64_t i = 0; i < R * C; i++) {
            const float want = (a[i] * 2.0f) * 0.5f;
            nd += memcmp(&fdg[i], &want, 4) != 0;
        }
        CHECK_MSG(nd == 0, "%s: swiglu_bwd's dgate differs from dout at %lld elements (gate 0, up 2)", tc->name, (long long)nd);
    }
    static const char *what[4] = {"dgate rows operand", "dup rows operand", "dgate tokens operand", "dup tokens operand"};
    for (int i = 0; i < 4; i++) {
        uint8_t *gu = down(uq[i], n4[i]), *gf8 = down(fq[i], n4[i]), *ref = host_sentinel(n4[i]);
        const float *src = i % 2 ? fdu : fdg;
        if (i < 2) ref_rows(ref, src, R, rcap, C);
        else ref_tokens(ref, src, off, E, kcap, C);
        char m[192];
        snprintf(m, sizeof m, "fp8_swiglu_bwd_quant: %s against swiglu_bwd + the quantizer (whole buffer)", what[i]);
        same_bytes(m, gf8, gu, n4[i], 0);
        snprintf(m, sizeof m, "fp8_swiglu_bwd_quant: %s against the reference of swiglu_bwd's values", what[i]);
        same_bytes(m, gf8, ref, n4[i], 0);
        free(gu), free(gf8), free(ref);
        O->mem_free(ctx, uq[i]), O->mem_free(ctx, fq[i]);
    }
    free(hdg), free(hdu), free(fdg), free(fdu);

    /* fp8_swiglu_fwd_quant against swiglu_fwd + fp8_quant_rows, and the reference of out */
    void *o1 = dev_sentinel(nb), *o2 = dev_sentinel(nb), *q1 = dev_sentinel(nr), *q2 = dev_sentinel(nr);
    O->swiglu_fwd(ctx, o1, dGf, dU, R * C);
    O->fp8_quant_rows(ctx, q1, o1, doff, rcap, E, C);
    O->fp8_swiglu_fwd_quant(ctx, o2, q2, dGf, dU, doff, rcap, E, C);
    uint8_t *h1 = down(o1, nb), *h2 = down(o2, nb), *g1 = down(q1, nr), *g2 = down(q2, nr), *ref = host_sentinel(nr);
    float *fo = bits_to_f(h1, R * C);
    ref_rows(ref, fo, R, rcap, C);
    if (tc->corners) { /* out = 32 up exactly (or inf) */
        int64_t nd = 0;
        for (int64_t i = 0; i < R * C; i++) {
            const float want = gt_bf16_to_f32(gt_f32_to_bf16(32.0f * u[i]));
            nd += !(fo[i] == want || (isinf(want) && isinf(fo[i]))) && !(u[i] == 0.0f && fo[i] == 0.0f);
        }
        CHECK_MSG(nd == 0, "%s: swiglu_fwd's out is not 32 up at %lld elements (gate 32)", tc->name, (long long)nd);
    }
    same_bytes("fp8_swiglu_fwd_quant: out against swiglu_fwd (rows past offsets[E] the sentinel)", h2, h1, nb, 0);
    same_bytes("fp8_swiglu_fwd_quant: rows operand against fp8_quant_rows(out) (whole buffer)", g2, g1, nr, 0);
    same_bytes("fp8_swiglu_fwd_quant: rows operand against the reference of out", g2, ref, nr, 0);
    free(h1), free(h2), free(g1), free(g2), free(ref), free(fo);
    void *d[8] = {o1, o2, q1, q2, dDG, dDU, dA, dG};
    for (int i = 0; i < 8; i++) O->mem_free(ctx, d[i]);
    O->mem_free(ctx, dU), O->mem_free(ctx, dGf), O->mem_free(ctx, dUb);
    CHECK_BACKEND_OK(&g_be);
    if (tc->pinned) O->buffer_free(ctx, FM_BUFFER_PINNED, doff);
    else O->mem_free(ctx, doff);
    free(a), free(g), free(ub), free(u), free(gf);
}

/* ---- timings ---- */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
/* The mean seconds of 10 runs of `call` after 2 warm-up runs (host clock around a sync). */
#define TIME_IT(dt, call)                                      \
    do {                                                       \
        for (int w_ = 0; w_ < 2; w_++) { call; }               \
        g_be.ops->sync(g_be.ctx);                              \
        const double t0_ = now_s();                            \
        for (int r_ = 0; r_ < 10; r_++) { call; }              \
        g_be.ops->sync(g_be.ctx);                              \
        (dt) = (now_s() - t0_) / 10;                           \
    } while (0)

static void line(const char *what, double fused, double unfused, double bytes) {
    printf("  %-52s fused %7.3f ms (%5.0f GB/s)  unfused %7.3f ms  fused/unfused %.2f\n", what, fused * 1e3,
           bytes / fused * 1e-9, unfused * 1e3, fused / unfused);
}

/* OLMoE-1B-7B at 4K tokens: 64 experts, H 2048, I 1024, 32768 rows (512 an expert) */
static void bench(void) {
    const fm_ops *O = g_be.ops;
    void *ctx = g_be.ctx;
    const int64_t E = 64, H = 2048, I = 1024, R = 4096 * 8, kcap = fm_fp8_kcap(R, E);
    printf("timings: E %lld, H %lld, I %lld, %lld rows (%lld an expert); GB/s: the fused op's bf16 reads + "
           "code writes\n", (long long)E, (long long)H, (long long)I, (long long)R, (long long)(R / E));
    int64_t *off = O->buffer_alloc(ctx, FM_BUFFER_PINNED, sizeof(int64_t) * (size_t)(E + 1));
    FM_ASSERT(off != NULL);
    for (int64_t e = 0; e <= E; e++) off[e] = e * (R / E);
    float *h = fnew(R * H);
    for (int64_t i = 0; i < R * H; i++) h[i] = (float)fm_rng_normal(&g_rng);
    fm_act *x = gt_upload(&g_be, h, R * H, FM_DTYPE_BF16), *dout = gt_upload(&g_be, h, R * I, FM_DTYPE_BF16);
    fm_act *gate = gt_upload(&g_be, h + R * I, R * I, FM_DTYPE_BF16), *up = gt_upload(&g_be, h + 7, R * I, FM_DTYPE_BF16);
    free(h);
    fm_act *dg = dev_bytes(R * I * 2), *du = dev_bytes(R * I * 2), *out = dev_bytes(R * I * 2);
    void *rH = dev_bytes(fm_fp8_rows_bytes(R, H)), *tH = dev_bytes(fm_fp8_tokens_bytes(kcap, H));
    void *rI0 = dev_bytes(fm_fp8_rows_bytes(R, I)), *rI1 = dev_bytes(fm_fp8_rows_bytes(R, I));
    void *tI0 = dev_bytes(fm_fp8_tokens_bytes(kcap, I)), *tI1 = dev_bytes(fm_fp8_tokens_bytes(kcap, I));
    double f, u;
    TIME_IT(f, O->fp8_quant_dual(ctx, rH, tH, x, off, R, E, H));
    TIME_IT(u, (O->fp8_quant_rows(ctx, rH, x, off, R, E, H), O->fp8_quant_tokens(ctx, tH, x, off, R, E, H)));
    line("fp8_quant_dual dy [32768, 2048] vs rows + tokens", f, u, (double)(R * H) * 4);
    TIME_IT(f, O->fp8_swiglu_bwd_quant(ctx, rI0, rI1, tI0, tI1, dout, gate, up, off, R, E, I));
    TIME_IT(u, (O->swiglu_bwd(ctx, dg, du, dout, gate, up, R * I), O->fp8_quant_rows(ctx, rI0, dg, off, R, E, I),
                O->fp8_quant_tokens(ctx, tI0, dg, off, R, E, I), O->fp8_quant_rows(ctx, rI1, du, off, R, E, I),
                O->fp8_quant_tokens(ctx, tI1, du, off, R, E, I)));
    line("fp8_swiglu_bwd_quant [32768, 1024] vs swiglu_bwd + 4", f, u, (double)(R * I) * 10);
    TIME_IT(f, O->fp8_swiglu_fwd_quant(ctx, out, rI0, gate, up, off, R, E, I));
    TIME_IT(u, (O->swiglu_fwd(ctx, out, gate, up, R * I), O->fp8_quant_rows(ctx, rI0, out, off, R, E, I)));
    line("fp8_swiglu_fwd_quant [32768, 1024] vs swiglu_fwd + rows", f, u, (double)(R * I) * 7);
    CHECK_BACKEND_OK(&g_be);
    void *d[12] = {x, dout, gate, up, dg, du, out, rH, tH, rI0, rI1, tI0};
    for (int i = 0; i < 12; i++) O->mem_free(ctx, d[i]);
    O->mem_free(ctx, tI1);
    O->buffer_free(ctx, FM_BUFFER_PINNED, off);
}

int main(void) {
    const int rc = fp8_test_backend(&g_be, fm_backend_opts_default().fp8_gemm);
    if (rc) return rc;
    const fm_ops *O = g_be.ops;
    const bool have = O->fp8_quant_dual && O->fp8_swiglu_bwd_quant && O->fp8_swiglu_fwd_quant;
    CHECK_MSG(have, "the CUDA backend's op table lacks a fused FP8 op");
    if (!have) return fm_test_finish();
    CHECK_MSG(fm_backend_fp8_codes_serves(&g_be, 8, 256, 512, 4096), "fm_backend_fp8_codes_serves is false on sm_90");
    fm_rng_seed(&g_rng, fm_test_seed(20261202));
    pat_init();
    static const fused_case cases[] = {
        {"uneven", 4, 256, 400, {130, 0, 257, 1}, true, false, false},
        {"one expert owns all", 8, 512, 300, {0, 0, 0, 300, 0, 0, 0, 0}, false, false, false},
        {"odd starts", 5, 128, 461, {1, 128, 0, 77, 255}, true, false, false},
        {"odd starts, two empty", 6, 384, 401, {3, 200, 0, 0, 129, 64}, true, false, false},
        {"few rows", 4, 128, 43, {10, 0, 29, 1}, false, false, false},
        {"non-finite tiles", 2, 256, 203, {130, 70}, true, true, false},
        {"corners", 4, 512, 1100, {300, 0, 513, 270}, true, false, true},
        {"corners, short groups", 6, 256, 500, {5, 130, 0, 1, 128, 200}, false, false, true},
        {"one group, corners", 1, 384, 133, {130}, true, false, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
    if (!getenv("FLATMOE_TEST_NO_BENCH")) bench();
    /* a shape outside the kernels is the op's recorded error */
    O->fp8_quant_dual(g_be.ctx, NULL, NULL, NULL, NULL, 10, 4, 100);
    CHECK(O->status(g_be.ctx) == FM_ERR_ARG);
    fm_cuda_backend_free(&g_be);
    return fm_test_finish();
}
