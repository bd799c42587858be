/* The CUDA quantizers' fast conversion (src/backend/cuda/sm90/gg_sm90_fp8_quant.cu) against the
 * recipe's (backend/fm_fp8.h), proven on the host over every input it can see.
 *
 * The kernels code a bf16 value v of a tile with scale exponent e as
 *     sign(v) << 7  |  cvt.rn.satfinite.e4m3x2.f32( (|v| 2^(k/2)) 2^(k - k/2) ),  k = -e,
 * where the hardware conversion is emulated here by its rule, written from the format's definition
 * and independently of fm_fp8.h: the nearest of E4M3's 127 non-negative finite values (E = 0:
 * M 2^-9; E = 1..15 (not the NaN code 0x7F): (8 + M) 2^(E-10)), a tie to the even code (IEEE's even
 * significand), anything above 448 to 448 (satfinite); fp32 subnormal inputs round the same way
 * (to 0, being far below 2^-10), so whether the hardware flushes them does not matter.
 * Checks:
 *  - for EVERY finite bf16 v (65,280 patterns) and EVERY e the recipe can produce from a bf16 amax
 *    (computed here over all of them: [-141, 120]) -- beyond the pairs a tile can hold (e >=
 *    fm_fp8_scale_exp(|v|)), all but those whose scaled value overflows fp32 -- that formula equals fm_e4m3_encode(
 *    fm_fp8_ldexp(v, -e)) (the CPU backend's code) and fm_e4m3_encode(ldexpf(v, -e)) (the GPU
 *    test's reference), counting the ties, E4M3-subnormal results, fp32-subnormal products and
 *    saturated values among them (each must occur: the sweep reaches every corner);
 *  - the kernels' amax on bits: integer order of the magnitudes' bits is value order, bits >=
 *    0x7F80 are exactly the non-finite values, and fm_fp8r_scale_exp_bf16 (gg_sm90_fp8_rule.h)
 *    equals fm_fp8_scale_exp on every finite non-negative bf16 value;
 *  - the emulated rule on known values (so it is not the code under test restated). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "backend/cuda/sm90/gg_sm90_fp8_rule.h"
#include "backend/fm_fp8.h"
#include "fm_test.h"

static double g_val[127]; /* the value of each non-negative finite code 0x00 .. 0x7E */

static void table_init(void) {
    for (int c = 0; c < 127; c++) {
        const int E = c >> 3, M = c & 7;
        g_val[c] = E == 0 ? ldexp((double)M, -9) : ldexp((double)(8 + M), E - 10);
    }
}

/* cvt.rn.satfinite to E4M3 of a >= 0 finite (the rule above) */
static uint8_t hw_e4m3(float a) {
    const double x = (double)a;
    if (x >= 448.0) return 0x7E;
    int lo = 0, hi = 126; /* the largest c with g_val[c] <= x */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (g_val[mid] <= x) lo = mid;
        else hi = mid - 1;
    }
    if (g_val[lo] == x) return (uint8_t)lo;
    const double mid2 = g_val[lo] + g_val[lo + 1]; /* twice the midpoint (exact) */
    if (2.0 * x < mid2) return (uint8_t)lo;
    if (2.0 * x > mid2) return (uint8_t)(lo + 1);
    return (uint8_t)((lo & 1) ? lo + 1 : lo);
}

static float bf16_value(uint32_t b) { return fm_fp8_u2f(b << 16); }

/* The kernels' code of bf16 bits b in a tile of exponent e (qmag, e4m3x2, the sign bit) */
static uint8_t fast_code(uint32_t b, int e) {
    const int k = -e, k1 = k / 2, k2 = k - k1;
    const float f = (fabsf(bf16_value(b)) * fm_fp8_pow2(k1)) * fm_fp8_pow2(k2);
    return (uint8_t)(((b >> 8) & 0x80u) | hw_e4m3(f));
}

int main(void) {
    table_init();
    /* the emulated rule on known values */
    CHECK(hw_e4m3(448.0f) == 0x7E && hw_e4m3(449.0f) == 0x7E && hw_e4m3(464.0f) == 0x7E && hw_e4m3(1e30f) == 0x7E);
    CHECK(hw_e4m3(416.0f) == 0x7D && hw_e4m3(432.0f) == 0x7E); /* 432: the tie 416 | 448 goes to the even 0x7E */
    CHECK(hw_e4m3(1.0f) == 0x38 && hw_e4m3(1.0625f) == 0x38 && hw_e4m3(1.1875f) == 0x3A); /* ties to even */
    CHECK(hw_e4m3(ldexpf(1.0f, -9)) == 0x01 && hw_e4m3(ldexpf(1.0f, -10)) == 0x00 && hw_e4m3(ldexpf(3.0f, -10)) == 0x02);
    CHECK(hw_e4m3(ldexpf(1.0f, -6)) == 0x08 && hw_e4m3(ldexpf(15.0f, -10)) == 0x08); /* 7.5 2^-9: the tie 0x07 | 0x08 */
    CHECK(hw_e4m3(ldexpf(1.0f, -126)) == 0 && hw_e4m3(ldexpf(1.0f, -149)) == 0 && hw_e4m3(0.0f) == 0);

    /* amax on bits */
    int order_ok = 1, bad_ok = 1, exp_ok = 1, emin = 1000, emax = -1000;
    for (uint32_t ab = 0; ab <= 0x7FFFu; ab++) {
        const float a = bf16_value(ab);
        const int nonfinite = !(a <= 3.4028235e38f);
        if (nonfinite != (ab >= FM_FP8R_BF16_NONFINITE)) bad_ok = 0;
        if (nonfinite) continue;
        if (ab > 0 && !(a > bf16_value(ab - 1))) order_ok = 0;
        const int e = fm_fp8_scale_exp(a);
        if (fm_fp8r_scale_exp_bf16(ab) != e) {
            if (exp_ok) fprintf(stderr, "scale exponent of bf16 0x%04x (%g): bits %d, fm_fp8_scale_exp %d\n", ab, (double)a,
                                fm_fp8r_scale_exp_bf16(ab), e);
            exp_ok = 0;
        }
        if (ab > 0) emin = e < emin ? e : emin, emax = e > emax ? e : emax;
    }
    CHECK_MSG(order_ok, "the bits of finite bf16 magnitudes are not in value order");
    CHECK_MSG(bad_ok, "bits >= 0x%04x are not exactly the non-finite bf16 magnitudes", FM_FP8R_BF16_NONFINITE);
    CHECK_MSG(exp_ok, "fm_fp8r_scale_exp_bf16 differs from fm_fp8_scale_exp");
    CHECK_MSG(emin == -141 && emax == 120, "bf16 amax gives scale exponents [%d, %d], expected [-141, 120]", emin, emax);
    printf("scale exponents of bf16 tiles: [%d, %d]\n", emin, emax);

    /* every finite bf16 value at every exponent */
    int64_t n = 0, in_tiles = 0, overflow = 0, outside_bad = 0, diff_cpu = 0, diff_ref = 0, ties = 0, sub8 = 0, sub32 = 0, sat = 0;
    for (int e = emin; e <= emax; e++)
        for (uint32_t b = 0; b <= 0xFFFFu; b++) {
            if ((b & 0x7FFFu) >= FM_FP8R_BF16_NONFINITE) continue;
            const float v = bf16_value(b);
            /* a tile holding v has amax >= |v|, so e >= fm_fp8_scale_exp(|v|) and |v| 2^-e <= 448; past
             * that domain the scaled value may overflow fp32 (inf: fm_e4m3_encode's NaN, the
             * hardware's 448), which no tile can produce: skipped (and counted) */
            const int in_tile = e >= fm_fp8_scale_exp(fabsf(v));
            if (!(fabsf(fm_fp8_ldexp(v, -e)) <= 3.4028235e38f)) {
                if (in_tile) outside_bad++;
                overflow++;
                continue;
            }
            in_tiles += in_tile;
            const uint8_t got = fast_code(b, e), cpu = fm_e4m3_encode(fm_fp8_ldexp(v, -e)),
                          ref = fm_e4m3_encode(ldexpf(v, -e));
            n++;
            if (got != cpu) {
                if (!diff_cpu) fprintf(stderr, "bf16 0x%04x at e %d: fast 0x%02x, fm_e4m3_encode 0x%02x\n", b, e, got, cpu);
                diff_cpu++;
            }
            if (got != ref) diff_ref++;
            /* what the sweep reached (on the exact scaled value t = |v| 2^-e) */
            const double t = ldexp(fabs((double)v), -e);
            if (t > 448.0) sat++;
            else if (t > 0 && t < ldexp(1.0, -126)) sub32++;
            else if (t > 0 && t < ldexp(1.0, -6)) sub8++;
            if (t > 0 && t < 448.0) {
                const uint8_t c = hw_e4m3((float)t);
                if (c < 0x7E && 2.0 * t == g_val[c] + g_val[c + 1]) ties++;
                else if (c > 0 && 2.0 * t == g_val[c] + g_val[c - 1]) ties++;
            }
        }
    CHECK_MSG(outside_bad == 0, "%lld pairs inside a tile's range overflow fp32", (long long)outside_bad);
    CHECK_MSG(diff_cpu == 0, "%lld of %lld (value, exponent) pairs: the fast code differs from fm_e4m3_encode(fm_fp8_ldexp(v, -e))",
              (long long)diff_cpu, (long long)n);
    CHECK_MSG(diff_ref == 0, "%lld of %lld pairs: the fast code differs from fm_e4m3_encode(ldexpf(v, -e))", (long long)diff_ref,
              (long long)n);
    CHECK_MSG(ties > 0 && sub8 > 0 && sub32 > 0 && sat > 0, "the sweep missed a corner: ties %lld, E4M3 subnormals %lld, "
              "fp32 subnormals %lld, saturated %lld", (long long)ties, (long long)sub8, (long long)sub32, (long long)sat);
    printf("%lld (bf16 value, exponent) pairs compared (%lld of them possible in a tile; %lld skipped: the scaled value "
           "overflows fp32): %lld ties, %lld E4M3-subnormal, %lld fp32-subnormal, %lld saturated\n",
           (long long)n, (long long)in_tiles, (long long)overflow, (long long)ties, (long long)sub8, (long long)sub32,
           (long long)sat);
    return fm_test_finish();
}
