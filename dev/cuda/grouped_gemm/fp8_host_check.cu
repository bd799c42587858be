/* Host-only check of the FP8 version's CPU parts (fp8_ref.h), runs without a GPU:
 *   make -C dev/cuda/grouped_gemm check
 * 1. e4m3_encode against a brute-force nearest code (ties to the even code, saturation at 448)
 *    and against NVIDIA's own conversion (cuda_fp8.h's host path of __nv_cvt_float_to_fp8,
 *    satfinite, E4M3), over every bf16 bit pattern and 2^20 random floats; e4m3_decode against
 *    cuda_fp8.h for all 256 codes.
 * 2. block quantization: the block's amax codes to +-448; every element dequantizes within half a
 *    step (2^-4 relative for normals, 2^-10 scale below), zero blocks to zero.
 * 3. snr_acc: a 1% relative error is 40 dB, exact is +inf, a NaN fails a >= test.
 * 4. the SNR the lab's v3 should show: the fp8 products (fwd, dx, dW with token blocks per
 *    group) of the lab's own inputs (gg_val3, the same seeds) in double against the exact bf16
 *    product, at E 3, H 512, I 256 with uneven groups; each must reach the lab's bound (25 dB).
 * Exit 0 if all hold, 1 otherwise (each failure printed).
 */
#include "fp8_ref.h"
#include "gg_inputs.h"
#include <cuda_fp8.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

static int g_fail = 0;
#define EXPECT(c, ...)                                                                                                  \
    do {                                                                                                               \
        if (!(c)) {                                                                                                    \
            if (g_fail++ < 20) printf("FAIL " __VA_ARGS__), printf("\n");                                             \
        }                                                                                                              \
    } while (0)

static uint8_t brute(float x) { /* the nearest finite code, ties to the even code; beyond 448 -> 448 */
    if (x != x) return 0x7F;
    const double a = std::fabs((double)x);
    int best = 0;
    double bd = 1e300;
    for (int c = 0; c <= 0x7E; c++) {
        const double d = std::fabs((double)e4m3_decode((uint8_t)c) - a);
        if (d < bd || (d == bd && (c & 1) == 0)) bd = d, best = c;
    }
    return (uint8_t)((std::signbit(x) ? 0x80 : 0) | best);
}
static uint8_t nvconv(float x) { return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }

static uint64_t rs = 88172645463325252ull;
static uint64_t rnext() { return rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17; }

static void check_codec() {
    for (int c = 0; c < 256; c++) {
        __nv_fp8_e4m3 q;
        q.__x = (__nv_fp8_storage_t)c;
        const float want = (float)q, got = e4m3_decode((uint8_t)c);
        EXPECT((want != want && got != got) || want == got, "decode 0x%02x: got %g want %g", c, got, want);
    }
    std::vector<float> xs;
    for (uint32_t b = 0; b < 65536; b++) {
        const uint32_t u = b << 16;
        float f;
        memcpy(&f, &u, 4);
        xs.push_back(f);
    }
    for (int i = 0; i < (1 << 20); i++) { /* exponents around e4m3's range, random mantissas */
        const uint32_t u = (uint32_t)(rnext() & 0x807FFFFFu) | ((uint32_t)(100 + rnext() % 45) << 23);
        float f;
        memcpy(&f, &u, 4);
        xs.push_back(f);
    }
    for (float f : {0.0f, -0.0f, 448.0f, 464.0f, 463.99f, 480.0f, 1e30f, -1e30f, INFINITY, -INFINITY, 0.015625f, 0.0009765625f,
                    0.00048828125f, 0.000488281f, 0.00146484375f, 240.0f, 232.0f, 248.0f})
        xs.push_back(f);
    long long nb = 0, nn = 0;
    for (float x : xs) {
        if (std::isinf(x) || (x == x && std::fabs(x) > 1e4f)) { /* outside the brute force's meaning: saturation */
            EXPECT(e4m3_encode(x) == (uint8_t)((std::signbit(x) ? 0x80 : 0) | 0x7E), "encode(%g) does not saturate", x);
            continue;
        }
        const uint8_t g = e4m3_encode(x), b = brute(x), n = nvconv(x);
        if (x != x) {
            EXPECT(g == 0x7F && (n & 0x7F) == 0x7F, "encode(NaN) = 0x%02x, cuda_fp8.h 0x%02x", g, n);
            continue;
        }
        nb += g != b, nn += g != n;
        EXPECT(g == b, "encode(%.9g) = 0x%02x, nearest-even 0x%02x", x, g, b);
        EXPECT(g == n, "encode(%.9g) = 0x%02x, cuda_fp8.h 0x%02x", x, g, n);
    }
    printf("codec: %zu inputs, %lld differ from the brute force, %lld from cuda_fp8.h\n", xs.size(), nb, nn);
}

static void check_blocks() {
    std::vector<float> v(128);
    long long n = 0;
    for (int t = 0; t < 2000; t++) {
        const int ex = (int)(rnext() % 40) - 20;
        for (int i = 0; i < 128; i++) v[i] = (float)(((double)(rnext() % 2000001) / 1e6 - 1.0) * std::ldexp(1.0, ex));
        if (t % 100 == 0) std::fill(v.begin(), v.end(), 0.0f);
        float amax = 0.0f;
        int at = 0;
        for (int i = 0; i < 128; i++)
            if (std::fabs(v[i]) > amax) amax = std::fabs(v[i]), at = i;
        const float s = fp8_scale(amax);
        if (amax > 0.0f) EXPECT((fp8_code(v[at], s) & 0x7F) == 0x7E, "amax element codes 0x%02x, not +-448", fp8_code(v[at], s));
        for (int i = 0; i < 128; i++) {
            const double back = (double)e4m3_decode(fp8_code(v[i], s)) * s, err = std::fabs(back - v[i]);
            const double bound = std::max(std::fabs((double)v[i]) / 16.0, (double)s / 1024.0) * 1.0001;
            EXPECT(err <= bound || (amax == 0.0f && back == 0.0), "block %d elem %d: %g -> %g (scale %g)", t, i, v[i], back, s);
            n++;
        }
    }
    printf("blocks: %lld elements within half a step\n", n);
}

static void check_snr() {
    snr_acc a, b, c;
    for (int i = 0; i < 1000; i++) {
        const double r = std::sin(0.1 * i) + 0.5;
        a.add(r, r * 1.01), b.add(r, r);
    }
    c.add(1.0, NAN);
    EXPECT(std::fabs(a.db() - 40.0) < 1e-9, "snr of a 1%% error: %g dB, want 40", a.db());
    EXPECT(std::isinf(b.db()) && b.db() > 0, "snr of exact: %g, want +inf", b.db());
    EXPECT(!(c.db() >= 25.0), "snr with a NaN passes a >= 25 test (%g)", c.db());
    printf("snr: 1%% error %.3f dB, exact %g\n", a.db(), b.db());
}

/* The lab's v3 math on its own inputs, small: E 3 groups of {70, 0, 200} rows, H 512, I 256 ("gu":
 * in H, out I). Returns the SNR of fp8 vs exact per product. */
static void check_expected_snr() {
    const int E = 3, in = 512, out = 256;
    const std::vector<int64_t> offs = {0, 70, 70, 270};
    const int64_t R = offs[E];
    enum { SX = 11, SW = 12, SDY = 13 }; /* fp8_lab.cuh's SEED3_* */
    /* quantized copies, dequantized to double: xd (1 x 128 along in), dyd (along out), Wd (128 x 128) */
    auto rowq = [&](uint32_t seed, int64_t cols, std::vector<double> &d) {
        d.assign((size_t)(R * cols), 0.0);
        std::vector<float> v(128);
        for (int64_t r = 0; r < R; r++)
            for (int64_t b = 0; b < cols / 128; b++) {
                float amax = 0.0f;
                for (int k = 0; k < 128; k++) v[k] = gg_val3(seed, r, b * 128 + k, cols), amax = std::max(amax, std::fabs(v[k]));
                const float s = fp8_scale(amax);
                for (int k = 0; k < 128; k++) d[r * cols + b * 128 + k] = (double)e4m3_decode(fp8_code(v[k], s)) * s;
            }
    };
    std::vector<double> xd, dyd, Wd((size_t)E * out * in), xtd((size_t)R * in), dytd((size_t)R * out);
    rowq(SX, in, xd), rowq(SDY, out, dyd);
    for (int e = 0; e < E; e++)
        for (int nb = 0; nb < out / 128; nb++)
            for (int kb = 0; kb < in / 128; kb++) {
                float amax = 0.0f;
                for (int r = 0; r < 128; r++)
                    for (int k = 0; k < 128; k++) amax = std::max(amax, std::fabs(gg_val3(SW, e * out + nb * 128 + r, kb * 128 + k, in)));
                const float s = fp8_scale(amax);
                for (int r = 0; r < 128; r++)
                    for (int k = 0; k < 128; k++) {
                        const int64_t n = nb * 128 + r, kk = kb * 128 + k;
                        Wd[((size_t)e * out + n) * in + kk] = (double)e4m3_decode(fp8_code(gg_val3(SW, e * out + n, kk, in), s)) * s;
                    }
            }
    /* dW's operands: 128 tokens of one channel, blocks from each group's first row */
    auto colq = [&](uint32_t seed, int64_t cols, std::vector<double> &d) {
        for (int e = 0; e < E; e++)
            for (int64_t t0 = offs[e]; t0 < offs[e + 1]; t0 += 128)
                for (int64_t c = 0; c < cols; c++) {
                    const int64_t n = std::min<int64_t>(128, offs[e + 1] - t0);
                    float amax = 0.0f;
                    for (int64_t t = 0; t < n; t++) amax = std::max(amax, std::fabs(gg_val3(seed, t0 + t, c, cols)));
                    const float s = fp8_scale(amax);
                    for (int64_t t = 0; t < n; t++)
                        d[(t0 + t) * cols + c] = (double)e4m3_decode(fp8_code(gg_val3(seed, t0 + t, c, cols), s)) * s;
                }
    };
    colq(SX, in, xtd), colq(SDY, out, dytd);
    auto grp = [&](int64_t r) { int e = 0; while (offs[e + 1] <= r) e++; return e; };
    snr_acc s[3];
    for (int64_t r = 0; r < R; r++)
        for (int64_t n = 0; n < out; n++) {
            double q = 0, x = 0;
            const int e = grp(r);
            for (int64_t k = 0; k < in; k++)
                q += xd[r * in + k] * Wd[((size_t)e * out + n) * in + k],
                    x += (double)gg_val3(SX, r, k, in) * gg_val3(SW, e * out + n, k, in);
            s[0].add(x, q);
        }
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < in; k++) {
            double q = 0, x = 0;
            const int e = grp(r);
            for (int64_t n = 0; n < out; n++)
                q += dyd[r * out + n] * Wd[((size_t)e * out + n) * in + k],
                    x += (double)gg_val3(SDY, r, n, out) * gg_val3(SW, e * out + n, k, in);
            s[1].add(x, q);
        }
    for (int e = 0; e < E; e++)
        for (int64_t n = 0; n < out; n++)
            for (int64_t k = 0; k < in; k += 3) {
                double q = 0, x = 0;
                for (int64_t r = offs[e]; r < offs[e + 1]; r++)
                    q += dytd[r * out + n] * xtd[r * in + k], x += (double)gg_val3(SDY, r, n, out) * gg_val3(SX, r, k, in);
                if (offs[e + 1] > offs[e]) s[2].add(x, q);
            }
    const char *names[3] = {"fwd", "dx", "dW"};
    for (int i = 0; i < 3; i++) {
        printf("expected v3 SNR %-3s %.1f dB over %lld elements\n", names[i], s[i].db(), s[i].n);
        EXPECT(s[i].db() >= 25.0, "the fp8 %s of the lab's inputs has SNR %.1f dB < 25", names[i], s[i].db());
    }
}

int main() {
    check_codec();
    check_blocks();
    check_snr();
    check_expected_snr();
    printf("# %s: %d failure(s)\n", g_fail ? "FAILED" : "fp8 host check passed", g_fail);
    return g_fail ? 1 : 0;
}
