/* The grouped GEMM lab's inputs: a hash of (tensor seed, flat index), recomputed by the CPU
 * references so that nothing big is copied back. Host and device (nvcc), or host only (a C++
 * compiler: the host check).
 *
 * gg_val: multiples of 1/8 in [-1, 1] (17 levels): every fp32 sum of products is exact, so the
 *   bf16 versions' only error is the final rounding.
 * gg_val3: the FP8 version's inputs, multiples of 1/128 in [-1, 1] (257 levels, up to 7
 *   significant bits, from the same hash) times a power of two that varies by row (2^-2 .. 2^1,
 *   a hash of the row) and by column (x8 on every 61st column, "outlier channels"): block
 *   amaxes then differ from block to block and inside a 128 x 128 weight block, so a scale read
 *   from the wrong block shows; every value is still exact in bf16 and every product sum exact in
 *   double (the bf16 reference of the SNR: products are multiples of 2^-18 below 2^8, so sums of
 *   up to 2^26 of them need at most 52 bits). More bits than E4M3's 4 so that the quantization
 *   rounds: with the power-of-two block scales (fp8_ref.h) gg_val's 1/8 multiples (at most 4
 *   significant bits) would be coded exactly and the v3 checks would never see a rounding.
 */
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define GG_HD __host__ __device__
#else
#define GG_HD
#endif

GG_HD inline uint64_t gg_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
GG_HD inline float gg_val(uint32_t seed, uint64_t i) {
    const uint64_t z = gg_mix(i + 0x9E3779B97F4A7C15ull * (seed + 1));
    return (float)((int)(z % 17) - 8) * 0.125f;
}
/* element (row, col) of a [rows, cols] tensor (flat index row * cols + col) */
GG_HD inline float gg_val3(uint32_t seed, int64_t row, int64_t col, int64_t cols) {
    const int e = (int)(gg_mix((uint64_t)row * 0x2545F4914F6CDD1Dull + seed) % 4) - 2 + (col % 61 == 7 ? 3 : 0);
    const float m = e >= 0 ? (float)(1 << e) : 1.0f / (float)(1 << -e);
    const uint64_t z = gg_mix((uint64_t)(row * cols + col) + 0x9E3779B97F4A7C15ull * (seed + 1));
    return (float)((int)(z % 257) - 128) * 0.0078125f * m;
}
