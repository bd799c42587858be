/* The integer pieces of the CUDA quantizers' fast path (gg_sm90_fp8_quant.cu), as plain C shared
 * with the host proof tests/test_fp8_convert.c, so the proof checks the code the kernels run.
 *
 * The kernels take a tile's amax on the bf16 bit patterns (|v| is v's bits without the sign bit;
 * on non-negative IEEE values integer order is value order, and bits >= 0x7F80 are inf or NaN),
 * so no float comparison (and no denormal flushing) is involved; this header turns that amax into
 * the recipe's scale exponent (fm_fp8.h's fm_fp8_scale_exp) without frexpf.
 *
 * Header-only (static inline; __host__ __device__ under nvcc). */
#ifndef FM_GG_SM90_FP8_RULE_H
#define FM_GG_SM90_FP8_RULE_H

#include <stdint.h>

#ifdef __CUDACC__
#define FM_FP8R_HD static __host__ __device__ __forceinline__
#else
#define FM_FP8R_HD static inline
#endif

/* bf16 bit patterns of |v| at or above this are inf or NaN */
#define FM_FP8R_BF16_NONFINITE 0x7F80u

/* fm_fp8_scale_exp(amax) for amax = the bf16 value with bits ab (0 <= ab < 0x7F80: +0, a subnormal
 * or a finite normal), computed from the bits: the smallest e with amax <= 448 * 2^e (0 for
 * amax == 0). frexp writes amax = m 2^p, m in [0.5, 1), and the recipe takes e = p - 9 if
 * m <= 0.875 (448 = 0.875 * 2^9), else p - 8. Normal (exponent field E > 0): amax = 1.f 2^(E-127),
 * so p = E - 126 and m <= 0.875 iff 1.f <= 1.75 iff the 23-bit fraction f <= 0x600000.
 * Subnormal: amax = F 2^-149 (F the fraction, h its top bit): p = h - 148, m = F / 2^(h+1), and
 * m <= 0.875 iff 8 F <= 7 2^(h+1). tests/test_fp8_convert.c checks this equals
 * fm_fp8_scale_exp on every finite non-negative bf16 value. */
FM_FP8R_HD int fm_fp8r_scale_exp_bf16(uint32_t ab) {
    if (ab == 0) return 0;
    const uint32_t u = ab << 16, ebits = u >> 23, frac = u & 0x7FFFFFu;
    if (ebits == 0) {
        int h = 0;
        while ((frac >> (h + 1)) != 0) h++; /* frac's top bit (at most 22 steps; subnormal tiles only) */
        const int p = h - 148;
        return (uint64_t)frac * 8u <= (uint64_t)7u << (h + 1) ? p - 9 : p - 8;
    }
    const int p = (int)ebits - 126;
    return frac <= 0x600000u ? p - 9 : p - 8;
}

#endif
