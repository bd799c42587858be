/* Host reference of the FP8 version (v3_fp8.cuh): the E4M3 code, block quantization and the SNR.
 * Plain C++ (no CUDA): used by the lab driver's validator and by fp8_host_check.cu.
 *
 * E4M3 (OCP 8-bit floating point, "FN" variant as in NVIDIA's __nv_fp8_e4m3): 1 sign, 4 exponent
 * (bias 7), 3 mantissa bits; no infinities, 0x7F/0xFF NaN; largest 448 = 1.75 * 2^8, smallest
 * normal 2^-6, subnormals m * 2^-9. Encoding rounds to nearest, ties to even, and saturates
 * finite values (and infinities) to +-448, as the kernels' cvt.rn.satfinite.e4m3x2.f32 does.
 *
 * Block quantization (the DeepSeek-V3 recipe, arXiv 2412.19437 section 3.3): over a block (1 x 128
 * of an activation row, 128 tokens of one channel for the weight gradient's operands, 128 x 128
 * of a weight), amax = max |v| and scale = amax / 448 (fp32 division); each element is coded as
 * e4m3(v / scale) (fp32 division), and v ~ decode(code) * scale. A block of zeros has scale 0
 * and codes 0. The kernels do the same fp32 operations (IEEE division: no fast math), so the
 * codes and scales agree bit for bit.
 */
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

/* float -> e4m3 code (round to nearest even, saturating). NaN -> 0x7F. */
inline uint8_t e4m3_encode(float x) {
    if (x != x) return 0x7F;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    const double a = std::fabs((double)x);
    if (a >= 448.0) return sign | 0x7E; /* satfinite (infinities too) */
    uint32_t code;
    if (a < 0.015625) { /* below 2^-6: subnormal steps of 2^-9; q == 8 is the smallest normal, code 8 */
        code = (uint32_t)std::nearbyint(a * 512.0);
    } else {
        int e;
        const double f = std::frexp(a, &e); /* a = f 2^e, f in [0.5, 1) */
        const int ex = e - 1;               /* a = (2f) 2^ex, 2f in [1, 2), ex in [-6, 8] */
        uint32_t m = (uint32_t)std::nearbyint((2.0 * f - 1.0) * 8.0);
        int ee = ex + 7;
        if (m == 8) m = 0, ee++;
        code = ((uint32_t)ee << 3) | m;
        if (code > 0x7E) code = 0x7E; /* 448 < a < 464 rounds to 448 anyway; 480 does not exist */
    }
    return sign | (uint8_t)code;
}

/* e4m3 code -> value (NaN for 0x7F/0xFF). */
inline float e4m3_decode(uint8_t c) {
    const int ex = (c >> 3) & 15, m = c & 7;
    if (ex == 15 && m == 7) return NAN;
    const double v = ex == 0 ? m * (1.0 / 512.0) : (1.0 + m / 8.0) * std::ldexp(1.0, ex - 7);
    return (float)((c & 0x80) ? -v : v);
}

/* The scale of a block with max |v| = amax (fp32, as the kernels). */
inline float fp8_scale(float amax) { return amax / 448.0f; }

/* The code of v in a block of scale s (s == 0: the block is zero). */
inline uint8_t fp8_code(float v, float s) { return s > 0.0f ? e4m3_encode(v / s) : (uint8_t)0; }

/* Signal-to-noise ratio in dB of an approximation against a reference: 10 log10(sum ref^2 /
 * sum (got - ref)^2) over the compared elements (the form of Primus-Turbo's check_snr). Exact
 * agreement gives +inf; no signal (sum ref^2 == 0) gives -inf unless the error is zero too. */
struct snr_acc {
    double sig = 0.0, err = 0.0;
    long long n = 0;
    void add(double ref, double got) { sig += ref * ref, err += (got - ref) * (got - ref), n++; }
    double db() const {
        if (err == 0.0) return INFINITY;
        if (sig == 0.0) return -INFINITY;
        return 10.0 * std::log10(sig / err);
    }
};
