/* The device pieces shared by the FP8 quantizers (gg_sm90_fp8_quant.cu: quant_rows, quant_weight,
 * quant_tokens_t) and the fused ones (gg_sm90_fp8_fused.cu): one tile's scale and codes on the bf16
 * bits (gg_sm90_fp8_quant.cu's header comment: why they are the recipe's bits), the tokens
 * operand's item list, staging (cp.async into a swizzled shared buffer) and coding, and the host's
 * checks. One copy of each, so a fused kernel codes a tile with exactly the code the unfused one
 * runs. Internal to the sm90 FP8 sources (an anonymous namespace: each .cu its own copy). */
#ifndef FM_GG_SM90_FP8_QUANT_CUH
#define FM_GG_SM90_FP8_QUANT_CUH

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../../fm_fp8.h"
#include "../../fm_fp8_layout.h"
#include "gg_sm90_fp8_rule.h"

namespace {

typedef __nv_bfloat16 bf16;

constexpr int MAX_E = 256;
constexpr uint32_t ABS2 = 0x7FFF7FFFu; /* two bf16 magnitudes */
constexpr uint32_t BAD4 = 0x7F7F7F7Fu; /* four NaN codes */

/* ---- one tile's scale and codes ---- */

/* The two factors of fm_fp8_ldexp(x, -e): 2^(k/2), 2^(k - k/2), k = -e. */
struct qscale {
    float m1, m2;
};
__device__ __forceinline__ qscale qscale_of(int e) {
    const int k = -e, k1 = k / 2, k2 = k - k1;
    return {fm_fp8_pow2(k1), fm_fp8_pow2(k2)};
}
/* fm_fp8_ldexp(|x|, -e), the same two products in the same order */
__device__ __forceinline__ float qmag(float x, qscale s) { return (fabsf(x) * s.m1) * s.m2; }
/* E4M3 codes of two non-negative finite floats (lo -> bits 0..7, hi -> 8..15): cvt.rn.satfinite */
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

/* The codes of 4 bf16 values x.lo, x.hi, y.lo, y.hi (bytes 0..3): magnitudes, then the sign bits
 * (each value's top bit: bytes 1 and 3 of x and y). */
__device__ __forceinline__ uint32_t enc4(uint32_t x, uint32_t y, qscale s) {
    const uint32_t c = e4m3x2(qmag(bf_lo(x), s), qmag(bf_hi(x), s)) | e4m3x2(qmag(bf_lo(y), s), qmag(bf_hi(y), s)) << 16;
    return c | (__byte_perm(x, y, 0x7531) & 0x80808080u);
}
/* The largest magnitude's bits of two bf16 lanes folded into m (two 16-bit lanes) */
__device__ __forceinline__ uint32_t amax2(uint32_t m, uint32_t w) { return __vmaxu2(m, w & ABS2); }
__device__ __forceinline__ uint32_t amax_of2(uint32_t m) { return max(m & 0xFFFFu, m >> 16); }

/* A tile's exponent (0 for a bad tile: its codes are replaced) and stored scale from its amax bits */
__device__ __forceinline__ bool tile_bad(uint32_t ab) { return ab >= FM_FP8R_BF16_NONFINITE; }
__device__ __forceinline__ int tile_exp(uint32_t ab) { return tile_bad(ab) ? 0 : fm_fp8r_scale_exp_bf16(ab); }
__device__ __forceinline__ float tile_scale(uint32_t ab, int e) {
    return tile_bad(ab) ? __uint_as_float(0x7FC00000u) : fm_fp8_ldexp(1.0f, e); /* exact: e >= -141 */
}

/* One 1 x 128 rows tile held by a half warp, 8 bf16 a lane in v (every lane of the warp calls it:
 * the amax is shuffled within each half): this lane's 8 codes, and the tile's amax bits and
 * exponent (tile_scale(am, e) is its stored scale). quant_rows, and the fused rows codings of
 * gg_sm90_fp8_fused.cu. */
struct row_codes {
    uint2 c;
    uint32_t am;
    int e;
};
__device__ __forceinline__ row_codes row_tile_code(uint4 v) {
    uint32_t am = amax_of2(amax2(amax2(amax2(amax2(0u, v.x), v.y), v.z), v.w));
#pragma unroll
    for (int o = 8; o; o >>= 1) am = max(am, __shfl_xor_sync(0xffffffffu, am, o)); /* within the half */
    const int e = tile_exp(am);
    const qscale sc = qscale_of(e);
    uint2 c = make_uint2(enc4(v.x, v.y, sc), enc4(v.z, v.w, sc));
    if (tile_bad(am)) c = make_uint2(BAD4, BAD4);
    return {c, am, e};
}


/* ---- 128 x 1 token tiles ---- */

constexpr int QT_THREADS = 256;
constexpr int QT_BUF_WORDS = 128 * 64;        /* 128 tokens x 128 channels of bf16, as 64 words a token */
constexpr int QT_SMEM = 2 * QT_BUF_WORDS * 4; /* two buffers: 64 KiB */

/* pblk[e] = sum_{e' < e} ceil(m_e' / 128) (fm_fp8_layout.h's tokens layout) by one warp: lane l
 * sums groups 8l .. 8l+7, a warp scan joins the lanes. */
__device__ inline void pblk_scan(int *pblk, const int64_t *offs, int E, int lane) {
    int run[8], tot = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int g = lane * 8 + k;
        tot += g < E ? (int)((offs[g + 1] - offs[g] + 127) / 128) : 0;
        run[k] = tot;
    }
    int inc = tot;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    const int excl = inc - tot;
#pragma unroll
    for (int k = 0; k < 8; k++)
        if (lane * 8 + k < E) pblk[lane * 8 + k + 1] = excl + run[k];
    if (lane == 0) pblk[0] = 0;
}

/* The start of a persistent kernel over a groups' token tiles (every thread of the CTA calls it):
 * offs[0 .. E] into s_offs (one parallel read a CTA: offs may live in pinned host memory), then
 * pblk (pblk_scan, by warp 0). */
__device__ __forceinline__ void qt_groups(int64_t *s_offs, int *pblk, const int64_t *offs, int E) {
    for (int i = threadIdx.x; i <= E; i += blockDim.x) s_offs[i] = offs[i];
    __syncthreads();
    if ((threadIdx.x >> 5) == 0) pblk_scan(pblk, s_offs, E, threadIdx.x & 31);
    __syncthreads();
}

/* Item it: token block b = it / ncb, channel block it % ncb; the group of b (the last e with
 * pblk[e] <= b), its first token t0 and its valid tokens (<= 128). */
struct qt_item {
    int64_t b, c0, t0;
    int valid;
};
__device__ inline qt_item qt_item_of(int64_t it, int ncb, const int64_t *offs, const int *pblk, int E) {
    qt_item r;
    r.b = it / ncb, r.c0 = (it - r.b * ncb) * 128;
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (pblk[mid] <= r.b) lo = mid;
        else hi = mid - 1;
    }
    r.t0 = offs[lo] + (r.b - pblk[lo]) * 128;
    const int64_t left = offs[lo + 1] - r.t0;
    r.valid = (int)(left < 128 ? left : 128);
    return r;
}

/* Word w of token tok in a buffer: w ^ 8 ((tok / 16) % 4) (the readers' lanes then hit 32 banks). */
__device__ __forceinline__ int qt_word(int tok, int w) { return tok * 64 + (w ^ (8 * ((tok >> 4) & 3))); }

/* cp.async of item r's 128 x 128 bf16 into the buffer at shared address sbuf: 16 bytes a copy, 16
 * copies a token; tokens past r.valid are zero-filled (source size 0, nothing read). */
__device__ inline void qt_issue(const bf16 *a, int64_t C, const qt_item &r, uint32_t sbuf) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int idx = i * QT_THREADS + threadIdx.x, tok = idx >> 4, q16 = idx & 15;
        const bool ok = tok < r.valid;
        const bf16 *g = ok ? a + (r.t0 + tok) * C + r.c0 + q16 * 8 : a;
        const uint32_t sa = sbuf + 4u * (uint32_t)qt_word(tok, q16 * 4);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(g), "r"(ok ? 16 : 0) : "memory");
    }
}

/* The tokens operand's codes and scales of item r from its staged buffer tb (token-major 128 x 128
 * bf16, qt_word's swizzle, tokens past r.valid zero): this thread codes channels 2 cp, 2 cp + 1 of
 * the item, tokens s 64 + 16 q + (0..15) for s = 0, 1 (cp = warp * 8 + lane / 4, q = lane % 4;
 * every lane of the warp takes part: the amax shuffles). aT [C, kcap] e4m3, sT [kcap/128][C]. */
__device__ __forceinline__ void qt_code(const uint32_t *tb, const qt_item &r, int64_t C, int64_t kcap, uint8_t *aT,
                                        float *sT, int cp, int q) {
    uint32_t w[32];
#pragma unroll
    for (int k = 0; k < 32; k++) w[k] = tb[qt_word((k >> 4) * 64 + q * 16 + (k & 15), cp)];
    uint32_t am = 0;
#pragma unroll
    for (int k = 0; k < 32; k++) am = amax2(am, w[k]);
    am = __vmaxu2(am, __shfl_xor_sync(0xffffffffu, am, 1));
    am = __vmaxu2(am, __shfl_xor_sync(0xffffffffu, am, 2)); /* the 4 lanes of the pair: 128 tokens */
    const uint32_t alo = am & 0xFFFFu, ahi = am >> 16;
    const int elo = tile_exp(alo), ehi = tile_exp(ahi);
    const qscale slo = qscale_of(elo), shi = qscale_of(ehi);
    uint8_t *dlo = aT + (r.c0 + 2 * cp) * kcap + r.b * 128 + q * 16, *dhi = dlo + kcap;
#pragma unroll
    for (int s = 0; s < 2; s++) {
        uint32_t clo[4], chi[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const uint32_t w0 = w[s * 16 + 4 * k], w1 = w[s * 16 + 4 * k + 1], w2 = w[s * 16 + 4 * k + 2],
                           w3 = w[s * 16 + 4 * k + 3];
            const uint32_t p01 = __byte_perm(w0, w1, 0x7351), p23 = __byte_perm(w2, w3, 0x7351); /* the sign bytes */
            clo[k] = (e4m3x2(qmag(bf_lo(w0), slo), qmag(bf_lo(w1), slo)) |
                      e4m3x2(qmag(bf_lo(w2), slo), qmag(bf_lo(w3), slo)) << 16) |
                     (__byte_perm(p01, p23, 0x5410) & 0x80808080u);
            chi[k] = (e4m3x2(qmag(bf_hi(w0), shi), qmag(bf_hi(w1), shi)) |
                      e4m3x2(qmag(bf_hi(w2), shi), qmag(bf_hi(w3), shi)) << 16) |
                     (__byte_perm(p01, p23, 0x7632) & 0x80808080u);
        }
        if (tile_bad(alo) || tile_bad(ahi)) { /* NaN codes on the valid tokens, the tail stays 0 */
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int t0 = s * 64 + q * 16 + 4 * k;
                uint32_t msk = 0;
#pragma unroll
                for (int bb = 0; bb < 4; bb++) msk |= t0 + bb < r.valid ? 0xFFu << (8 * bb) : 0u;
                if (tile_bad(alo)) clo[k] = BAD4 & msk;
                if (tile_bad(ahi)) chi[k] = BAD4 & msk;
            }
        }
        *reinterpret_cast<uint4 *>(dlo + s * 64) = make_uint4(clo[0], clo[1], clo[2], clo[3]);
        *reinterpret_cast<uint4 *>(dhi + s * 64) = make_uint4(chi[0], chi[1], chi[2], chi[3]);
    }
    if (q == 0) *reinterpret_cast<float2 *>(sT + r.b * C + r.c0 + 2 * cp) = make_float2(tile_scale(alo, elo), tile_scale(ahi, ehi));
}

/* ---- host side ---- */

/* p is a multiple of a bytes */
inline bool aligned(const void *p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }
inline bool groups_ok(int64_t E) { return E >= 1 && E <= MAX_E; }

/* CTAs of kernel fn (threads, dynamic smem) resident on the current device at once, at least 1 */
template <typename F> cudaError_t resident_ctas(F fn, int threads, int smem, int *n) {
    int dev = 0, sms = 0, per = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, fn, threads, (size_t)smem);
    *n = (sms > 0 ? sms : 1) * (per > 0 ? per : 1);
    return err;
}

} // namespace
#endif
