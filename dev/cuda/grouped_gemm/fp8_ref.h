/* Host reference of the FP8 version (v3_fp8.cuh): the E4M3 code, block quantization and the SNR.
 * Plain C++ (no CUDA needed): used by the lab driver's validator, by fp8_host_check.cu, and (the
 * FM_FP8_HD helpers) by v3_fp8.cuh's quantization kernels.
 *
 * One definition with the engine: the E4M3 rounding and the block scale are src/backend/fm_fp8.h's
 * (included below; the engine's --expert-precision fp8 recipe), not a copy.
 *
 * E4M3 (OCP 8-bit floating point, "FN" variant as in NVIDIA's __nv_fp8_e4m3): 1 sign, 4 exponent
 * (bias 7), 3 mantissa bits; no infinities, 0x7F/0xFF NaN; largest 448 = 1.75 * 2^8, smallest
 * normal 2^-6, subnormals m * 2^-9. fm_e4m3_encode rounds to nearest, ties to even, and saturates
 * finite values to +-448, as the kernels' cvt.rn.satfinite.e4m3x2.f32 does (fp8_host_check proves
 * the two equal on every bf16 pattern and 2^20 random floats); NaN and infinities -> NaN (the
 * kernels never convert those: a non-finite tile is coded NaN before any conversion).
 *
 * Block quantization (the DeepSeek-V3 recipe, arXiv 2412.19437 section 3.3, with power-of-two
 * scales, UE8M0-style, as fm_fp8.h): over a block (1 x 128 of an activation row, 128 tokens of one
 * channel for the weight gradient's operands, 128 x 128 of a weight), amax = max |v| and the scale
 * s = 2^e, e = fm_fp8_scale_exp(amax) the smallest integer with amax <= 448 * 2^e (computed exactly
 * from amax's exponent: s = 2^ceil(log2(amax / 448))); a block of zeros gets s = 1 and codes 0.
 * Each element is coded as e4m3(v * 2^-e) (an exact scaling, fm_fp8_ldexp), so amax codes into
 * [224, 448] and decode(code) * s is exactly the engine's fake-quantized value fm_fp8_fake(v, e).
 * A block holding a non-finite value has scale NaN and every code 0x7F (NaN): the engine's
 * quantizer makes such a tile all NaN. The scales are stored as fp32 (2^e, exact; e >= -149
 * holds for bf16 inputs, whose amax >= 2^-133 gives e >= -141); the GEMM multiplies by them.
 * The kernels do the same operations, so the codes and scales agree bit for bit.
 */
#pragma once
#include "../../../src/backend/fm_fp8.h"

#include <cmath>
#include <cstdint>
#include <cstring>

/* float -> e4m3 code: fm_e4m3_encode (round to nearest even, saturating; NaN, +-inf -> 0x7F | sign). */
inline uint8_t e4m3_encode(float x) { return fm_e4m3_encode(x); }

/* e4m3 code -> value (NaN for 0x7F/0xFF): fm_e4m3_decode. */
inline float e4m3_decode(uint8_t c) { return fm_e4m3_decode(c); }

/* A block's amax with v folded in; a non-finite v makes it +inf (fmaxf alone would drop a NaN). */
FM_FP8_HD float fp8_amax_fold(float amax, float v) {
    const float a = fabsf(v);
    return fmaxf(amax, a <= 3.4028235e38f ? a : fm_fp8_u2f(0x7F800000u));
}

/* Whether a block with this folded amax held a non-finite value. */
FM_FP8_HD bool fp8_block_bad(float amax) { return !(amax <= 3.4028235e38f); }

/* 2^e as fp32, exact for e in [-149, 127] (fp32 subnormal below -126). */
FM_FP8_HD float fp8_scale_of_exp(int e) { return fm_fp8_ldexp(1.0f, e); }

/* The scale of a block with folded amax: 2^fm_fp8_scale_exp(amax) (1 for amax 0); NaN if bad. */
FM_FP8_HD float fp8_scale(float amax) {
    return fp8_block_bad(amax) ? fm_fp8_u2f(0x7FC00000u) : fp8_scale_of_exp(fm_fp8_scale_exp(amax));
}

/* The exponent e of a scale s = 2^e (fp8_scale's finite values, subnormal ones included). */
inline int fp8_exp_of_scale(float s) {
    int p;
    (void)std::frexp(s, &p);
    return p - 1;
}

/* The code of v in a block of scale s: e4m3(v * 2^-e) for s = 2^e; NaN scale (a bad block): 0x7F. */
inline uint8_t fp8_code(float v, float s) {
    return s == s ? fm_e4m3_encode(fm_fp8_ldexp(v, -fp8_exp_of_scale(s))) : (uint8_t)0x7F;
}

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
