/* FP8 (E4M3) blockwise fake quantization: the numerics of FP8 expert GEMMs (--expert-precision
 * fp8), as plain C shared by the CPU backend, the CUDA kernels (backend/cuda/cuda_fp8.cu, which
 * include this header so both compute the same bits) and the tests.
 *
 * DESIGN. The recipe is DeepSeek-V3's fine-grained quantization (arXiv 2412.19437 §3.3):
 * activations and output gradients in 1 x 128 tiles along a GEMM's K dimension, weights in
 * 128 x 128 blocks, the weight gradient's operands in 128 x 1 tiles along the rows (its K), with
 * fp32 accumulation. Each tile (block) has one scale; we use power-of-two scales (UE8M0, as
 * DeepSeek-V3.1 and the OCP MX formats do): s = 2^e with e the smallest integer such that
 * amax <= 448 * 2^e (s = 2^ceil(log2(amax / 448)), computed exactly from amax's exponent, never
 * through a rounded division); an all-zero tile gets s = 1. A value x becomes
 *     q(x) = s * e4m3(x / s)
 * with e4m3() the round-to-nearest-even E4M3 conversion below. Because x / s and s * v are exact
 * (powers of two) and an E4M3 value has 4 significant bits, q(x) is exactly representable in
 * fp32 and in bf16: "fake quant" (quantize, dequantize, then the plain GEMM with fp32
 * accumulation) equals the FP8 GEMM with per-tile scales up to the order of the fp32 sums.
 * (Exception, far outside training's range: a tile whose scale puts q(x) below fp32's normal
 * range, amax < 2^-117 or so, rounds q(x) once more to an fp32 subnormal.)
 *
 * E4M3 (the OCP "E4M3FN" format, NVIDIA's __nv_fp8_e4m3): 1 sign, 4 exponent bits (bias 7),
 * 3 mantissa bits, subnormals (smallest 2^-9 = 0.001953125), largest finite 448, no infinity,
 * NaN = S.1111.111. Conversion here: round to nearest, ties to even, then SATURATE: a magnitude
 * that rounds above 448 becomes 448 (449 -> 448, 464 -> 448 (a tie, to even), 480 and up -> 448;
 * as __NV_SATFINITE does). With the block scale no scaled value exceeds 448, so saturation only
 * matters for the conversion on its own. Non-finite input: NaN and +-inf convert to NaN, and a
 * tile holding any non-finite value comes out all NaN (the error propagates as NaN into the
 * GEMM and the loss, where the trainer's non-finite-loss check stops the run; the quantizer
 * itself has no status to return inside a step).
 *
 * Everything is header-only (static inline, __host__ __device__ under nvcc) so the CUDA kernels
 * and the C reference are literally the same code.
 */
#ifndef FM_FP8_H
#define FM_FP8_H

#include <stdint.h>

#include <math.h>
#include <string.h>

#ifdef __CUDACC__
#define FM_FP8_HD static __host__ __device__ __forceinline__
#else
#define FM_FP8_HD static inline
#endif

#define FM_FP8_TILE 128       /* tile length (1 x 128, 128 x 1) and weight block side (128 x 128) */
#define FM_FP8_E4M3_MAX 448.0f

FM_FP8_HD uint32_t fm_fp8_f2u(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

FM_FP8_HD float fm_fp8_u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* 2^k as fp32, k in [-126, 127]. */
FM_FP8_HD float fm_fp8_pow2(int k) { return fm_fp8_u2f((uint32_t)(k + 127) << 23); }

/* x * 2^k, exact whenever the result is a normal fp32 (one fp32 rounding if it is subnormal):
 * two multiplications by powers of two, the first one exact. k in [-252, 252] (each half within
 * fm_fp8_pow2's [-126, 127]); the scale exponents used here stay within +-157. */
FM_FP8_HD float fm_fp8_ldexp(float x, int k) {
    const int k1 = k / 2, k2 = k - k1;
    return (x * fm_fp8_pow2(k1)) * fm_fp8_pow2(k2);
}

/* The E4M3 value nearest to v (ties to even), saturated to +-448, as fp32; NaN/inf -> NaN.
 * Bit-level on v's fp32 fields: value = sig * 2^(ea - 23) with the implicit bit in sig; the
 * E4M3 quantum is 2^(ea - 3) for normals (ea >= -6) and 2^-9 for subnormals; the dropped bits
 * decide the rounding. fp32 subnormal inputs (< 2^-126) round to +-0. */
FM_FP8_HD float fm_e4m3_round(float v) {
    const uint32_t u = fm_fp8_f2u(v), sign = u & 0x80000000u, a = u & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return fm_fp8_u2f(0x7FC00000u | sign);
    const int ebits = (int)(a >> 23);
    if (ebits == 0) return fm_fp8_u2f(sign);
    const int ea = ebits - 127;
    const uint32_t sig = (a & 0x7FFFFFu) | 0x800000u;
    const int qe = (ea > -6 ? ea : -6) - 3; /* exponent of the quantum */
    const int s = qe - (ea - 23);           /* dropped bits: 20 (normals) or 14 - ea >= 21 (subnormals) */
    uint32_t q = 0;
    if (s <= 24) {
        q = sig >> s;
        const uint32_t rem = sig & ((1u << s) - 1u), half = 1u << (s - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
    }
    float r = (float)q * fm_fp8_pow2(qe); /* q <= 16, qe in [-9, 124]: exact */
    if (r > FM_FP8_E4M3_MAX) r = FM_FP8_E4M3_MAX;
    return fm_fp8_u2f(fm_fp8_f2u(r) | sign);
}

/* The E4M3 byte of v (fm_e4m3_round's value): S.EEEE.MMM, bias 7; NaN -> 0x7F | sign. */
FM_FP8_HD uint8_t fm_e4m3_encode(float v) {
    const float r = fm_e4m3_round(v);
    const uint32_t u = fm_fp8_f2u(r), sign = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint8_t)(0x7Fu | sign);
    if (a == 0) return (uint8_t)sign;
    const int ea = (int)(a >> 23) - 127;
    if (ea < -6) { /* subnormal: r = m * 2^-9, m in 1..7 */
        const uint32_t m = (uint32_t)(fm_fp8_u2f(a) * 512.0f);
        return (uint8_t)(sign | m);
    }
    return (uint8_t)(sign | (uint32_t)(ea + 7) << 3 | ((a >> 20) & 7u));
}

/* The fp32 value of an E4M3 byte (0x7F / 0xFF: NaN). */
FM_FP8_HD float fm_e4m3_decode(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24, e = (b >> 3) & 15u, m = b & 7u;
    if (e == 15u && m == 7u) return fm_fp8_u2f(0x7FC00000u | sign);
    const float mag = e == 0 ? (float)m * fm_fp8_pow2(-9) : (float)(8u + m) * fm_fp8_pow2((int)e - 10);
    return fm_fp8_u2f(fm_fp8_f2u(mag) | sign);
}

/* The block scale's exponent: the smallest integer e with amax <= 448 * 2^e, for amax > 0
 * finite (amax = m 2^p, m in [0.5, 1); 448 = 0.875 * 2^9); 0 (s = 1) for amax == 0. Exact. */
FM_FP8_HD int fm_fp8_scale_exp(float amax) {
    if (!(amax > 0.0f)) return 0;
    int p;
    const float m = frexpf(amax, &p);
    return m <= 0.875f ? p - 9 : p - 8;
}

/* q(x) for one value of a tile with scale 2^e. */
FM_FP8_HD float fm_fp8_fake(float x, int e) { return fm_fp8_ldexp(fm_e4m3_round(fm_fp8_ldexp(x, -e)), e); }

#ifndef __CUDACC__
/* The C reference over one fp32 tile: y[i*ld + j] = q(x[i*ld + j]) for i < rows, j < cols, with
 * one scale for the whole tile (all NaN if any element is non-finite). y may alias x. */
static inline void fm_fp8_quant_tile(float *y, const float *x, int64_t rows, int64_t cols, int64_t ld) {
    float amax = 0.0f;
    int bad = 0;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            const float a = fabsf(x[i * ld + j]);
            if (!(a <= 3.4028235e38f)) bad = 1; /* NaN or inf */
            else if (a > amax) amax = a;
        }
    const int e = fm_fp8_scale_exp(amax);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) y[i * ld + j] = bad ? NAN : fm_fp8_fake(x[i * ld + j], e);
}

/* The three tilings of the recipe over fp32 (the CPU backend's ops and the tests' reference):
 * rows: x [rows, cols] in 1 x 128 tiles along each row (the last one of a row shorter);
 * blocks: mats matrices [rows, cols] in 128 x 128 blocks (partial at the edges);
 * cols_grouped: x [offsets[E], cols] in 128 x 1 tiles along the rows of each group
 *   [offsets[g], offsets[g+1]) (a group's last tile shorter; an empty group has none). */
static inline void fm_fp8_ref_rows(float *y, const float *x, int64_t rows, int64_t cols) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j += FM_FP8_TILE)
            fm_fp8_quant_tile(y + i * cols + j, x + i * cols + j, 1,
                              cols - j < FM_FP8_TILE ? cols - j : FM_FP8_TILE, cols);
}

static inline void fm_fp8_ref_blocks(float *y, const float *x, int64_t mats, int64_t rows, int64_t cols) {
    for (int64_t m = 0; m < mats; m++)
        for (int64_t i = 0; i < rows; i += FM_FP8_TILE)
            for (int64_t j = 0; j < cols; j += FM_FP8_TILE) {
                const int64_t o = m * rows * cols + i * cols + j;
                fm_fp8_quant_tile(y + o, x + o, rows - i < FM_FP8_TILE ? rows - i : FM_FP8_TILE,
                                  cols - j < FM_FP8_TILE ? cols - j : FM_FP8_TILE, cols);
            }
}

static inline void fm_fp8_ref_cols_grouped(float *y, const float *x, const int64_t *offsets, int64_t E,
                                           int64_t cols) {
    for (int64_t g = 0; g < E; g++)
        for (int64_t i = offsets[g]; i < offsets[g + 1]; i += FM_FP8_TILE) {
            const int64_t nr = offsets[g + 1] - i < FM_FP8_TILE ? offsets[g + 1] - i : FM_FP8_TILE;
            for (int64_t j = 0; j < cols; j++) fm_fp8_quant_tile(y + i * cols + j, x + i * cols + j, nr, 1, cols);
        }
}
#endif

#endif
