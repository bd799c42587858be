/* The FP8 expert path's quantizers (gg_sm90_fp8.h: fm_gg8_quant_weight, fm_gg8_quant_rows,
 * fm_gg8_quant_tokens): bf16 -> E4M3 codes + fp32 power-of-two scales in backend/fm_fp8_layout.h's
 * byte layouts, bit for bit the codes and scales of backend/fm_fp8.h's recipe (the CPU backend's
 * cpu_fp8_gemm.c): a tile's scale is 2^e, e = fm_fp8_scale_exp(amax) (0 for an all-zero tile),
 * stored as fp32; each value v is coded as fm_e4m3_encode(fm_fp8_ldexp(v, -e)); a tile holding a
 * non-finite value has scale NaN and every code 0x7F.
 *
 * Fast path, and why it gives those bits (tests/test_fp8_convert.c proves the conversion on the
 * host over every bf16 value and every e the recipe can produce; tests/gpu/test_cuda_fp8_codes.c
 * compares every output byte with the C reference on the device, corner values included):
 *  - amax on the bf16 bits: |v| is v's bits & 0x7FFF; on non-negative IEEE values integer order is
 *    value order, so the integer max (two lanes at a time, __vmaxu2) is the bits of the reference's
 *    float amax, and a max >= 0x7F80 means the tile holds an inf or NaN (the reference's "bad"). The
 *    exponent comes from those bits (gg_sm90_fp8_rule.h: fm_fp8_scale_exp without frexpf).
 *  - the code: with k = -e (e in [-141, 120] for bf16 inputs, so k/2 and k - k/2 within
 *    fm_fp8_pow2's range) the kernel forms f = (|v| 2^(k/2)) 2^(k - k/2), fm_fp8_ldexp(|v|, -e)'s two
 *    products in its order, and converts f with the hardware's cvt.rn.satfinite.e4m3x2.f32 (round to
 *    nearest even onto E4M3, subnormals included, saturating at 448), then ORs in v's sign bit.
 *    fm_e4m3_encode(fm_fp8_ldexp(v, -e)) is exactly sign(v) | that conversion of |f|: for normal
 *    fp32 f both are round-to-nearest-even of the same value (the two products are exact there);
 *    an fp32-subnormal f (|v 2^-e| < 2^-126, however the products round) is code 0 for both, far
 *    below E4M3's half-smallest 2^-10; the sign is v's on both sides (fm_e4m3_encode keeps the sign
 *    of zero, NaN never reaches the conversion: such a tile's codes are all 0x7F); |f| <= 448 in a
 *    tile, so saturation never acts (the host proof checks it anyway, over every e).
 *
 * Kernels (each bandwidth-bound: 16-byte coalesced loads, enough of them in flight, coalesced stores):
 *  quant_rows: a grid-stride loop, 16 lanes (a half warp) per 1 x 128 tile (one 16-byte load each),
 *    4 tiles per half warp in flight (64 bytes a thread), 8-byte code stores (128 contiguous bytes a
 *    tile), the tile's scale from its first lane; the grid fills the SMs (occupancy query).
 *  quant_weight: a CTA per 128 x 128 block, thread t loads 8 rows x 8 columns (eight 16-byte loads,
 *    all in flight: 32 KiB a CTA), writes Wq as 8-byte row pieces (16 lanes = one 128-byte row),
 *    transposes its 8 x 8 codes in registers (byte permutes) into a swizzled shared tile (no bank
 *    conflicts), from which WqT leaves as 16-byte stores (8 lanes = one 128-byte row).
 *  quant_tokens: persistent CTAs (the offsets are read once a CTA: they may live in pinned host
 *    memory), each over (128-token block, 128-channel block) items: cp.async brings the next item's
 *    32 KiB into one of two shared buffers (zero-filling tokens past the group) while the current
 *    one is coded; a thread codes 2 channels x 32 tokens, its 4 lanes of a channel pair together
 *    hold the channel's 128 tokens (amax: 2 shuffles), and each channel leaves as 16-byte stores (4
 *    lanes = 64 contiguous bytes).
 * The device pieces (a tile's coding, the tokens items, staging, qt_code) live in
 * gg_sm90_fp8_quant.cuh, shared with the fused quantizers (gg_sm90_fp8_fused.cu). */
#include "gg_sm90_fp8.h"

#include "gg_sm90_fp8_quant.cuh"

namespace {

/* ---- 1 x 128 row tiles ---- */

constexpr int QR_THREADS = 256, QR_UNROLL = 4; /* tiles a half warp has in flight */

/* a [R, K] bf16 (R = min(offs[E], rcap), read here) -> q [rcap, K] e4m3 and s [K/128][rpad] fp32.
 * Tile w (row w / nb, column block w % nb) is the 256 bytes at a + 128 w; half h of warp gw takes
 * tiles base + u * 2 nwarps + h (u < QR_UNROLL), base stepping by QR_UNROLL * 2 nwarps: the loop
 * is warp-uniform (the shuffles need both halves). */
__global__ void __launch_bounds__(QR_THREADS) quant_rows(const bf16 *a, int64_t K, const int64_t *offs, int E,
                                                         int64_t rcap, int64_t rpad, uint8_t *q, float *s) {
    __shared__ int64_t s_rows;
    if (threadIdx.x == 0) {
        const int64_t r = offs[E];
        s_rows = r < rcap ? r : rcap;
    }
    __syncthreads();
    const int64_t nb = K / 128, nt = s_rows * nb;
    const int l = threadIdx.x & 15, h = (threadIdx.x >> 4) & 1;
    const int64_t gw = ((int64_t)blockIdx.x * QR_THREADS + threadIdx.x) >> 5, stride = (int64_t)gridDim.x * (QR_THREADS / 32) * 2;
    const uint4 *src = reinterpret_cast<const uint4 *>(a);
    for (int64_t base = 2 * gw; base < nt; base += QR_UNROLL * stride) {
        uint4 v[QR_UNROLL];
#pragma unroll
        for (int u = 0; u < QR_UNROLL; u++) {
            const int64_t w = base + u * stride + h;
            v[u] = w < nt ? __ldg(src + w * 16 + l) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < QR_UNROLL; u++) {
            const int64_t w = base + u * stride + h;
            const row_codes t = row_tile_code(v[u]);
            if (w < nt) {
                *reinterpret_cast<uint2 *>(q + w * 128 + l * 8) = t.c;
                if (l == 0) { /* 32-bit division where it fits (the 64-bit one is a long routine) */
                    const int64_t r = nt <= 0xFFFFFFFFll ? (int64_t)((uint32_t)w / (uint32_t)nb) : w / nb, b = w - r * nb;
                    s[b * rpad + r] = tile_scale(t.am, t.e);
                }
            }
        }
    }
}

/* ---- 128 x 128 weight blocks ---- */

/* The 4 x 4 byte transpose: a_r holds row r's bytes (columns 0..3); t_k gets column k's (rows 0..3). */
__device__ __forceinline__ void transpose4(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t *t) {
    const uint32_t p0 = __byte_perm(a0, a1, 0x5140), p1 = __byte_perm(a0, a1, 0x7362);
    const uint32_t p2 = __byte_perm(a2, a3, 0x5140), p3 = __byte_perm(a2, a3, 0x7362);
    t[0] = __byte_perm(p0, p2, 0x5410), t[1] = __byte_perm(p0, p2, 0x7632);
    t[2] = __byte_perm(p1, p3, 0x5410), t[3] = __byte_perm(p1, p3, 0x7632);
}

/* W [E*out, in] bf16 -> Wq [E*out, in], WqT [E*in, out] (W_e^T, the same codes), sW
 * [E][out/128][in/128]. Grid (in/128, out/128, E), 256 threads: thread t has rows 8 (t/16) .. +7,
 * columns 8 (t%16) .. +7 of the block. */
__global__ void __launch_bounds__(256) quant_weight(const bf16 *W, int64_t out, int64_t in, uint8_t *Wq, uint8_t *WqT,
                                                    float *sW) {
    /* the block's codes by column: row j = column j, 16 chunks of 8 rows (8 bytes); chunk m (rows
     * 8m .. 8m+7) stored at m ^ (j / 8), so each store phase and each 16-byte read phase hits 32
     * distinct banks */
    __shared__ __align__(16) uint2 qt[128][16];
    __shared__ uint32_t wmax[8];
    const int64_t e = blockIdx.z, n0 = (int64_t)blockIdx.y * 128, k0 = (int64_t)blockIdx.x * 128;
    const int t = threadIdx.x, cg = t & 15, rq = t >> 4;
    const bf16 *src = W + (e * out + n0 + 8 * rq) * in + k0 + 8 * cg;
    uint4 v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = __ldg(reinterpret_cast<const uint4 *>(src + i * in));
    uint32_t am = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) am = amax2(amax2(amax2(amax2(am, v[i].x), v[i].y), v[i].z), v[i].w);
    am = __reduce_max_sync(0xffffffffu, amax_of2(am));
    if ((t & 31) == 0) wmax[t >> 5] = am;
    __syncthreads();
    am = wmax[0];
#pragma unroll
    for (int i = 1; i < 8; i++) am = max(am, wmax[i]);
    const int ex = tile_exp(am);
    const bool bad = tile_bad(am);
    const qscale sc = qscale_of(ex);
    uint32_t c[8][2]; /* row i's codes: columns 0..3, 4..7 */
    uint8_t *dst = Wq + (e * out + n0 + 8 * rq) * in + k0 + 8 * cg;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        c[i][0] = bad ? BAD4 : enc4(v[i].x, v[i].y, sc);
        c[i][1] = bad ? BAD4 : enc4(v[i].z, v[i].w, sc);
        *reinterpret_cast<uint2 *>(dst + i * in) = make_uint2(c[i][0], c[i][1]);
    }
#pragma unroll
    for (int hh = 0; hh < 2; hh++) { /* columns 4 hh .. 4 hh + 3 */
        uint32_t lo[4], hi[4];   /* rows 0..3, 4..7 of each column */
        transpose4(c[0][hh], c[1][hh], c[2][hh], c[3][hh], lo);
        transpose4(c[4][hh], c[5][hh], c[6][hh], c[7][hh], hi);
#pragma unroll
        for (int k = 0; k < 4; k++) qt[8 * cg + 4 * hh + k][rq ^ cg] = make_uint2(lo[k], hi[k]);
    }
    if (t == 0) sW[(e * (out / 128) + blockIdx.y) * (in / 128) + blockIdx.x] = tile_scale(am, ex);
    __syncthreads();
    /* W_e^T row k0 + j (an in channel), 16 bytes p (out channels n0 + 16p .. +15): logical chunks
     * 2p, 2p+1, stored as the pair p ^ (x/2), swapped when x = j/8 is odd */
#pragma unroll
    for (int it = 0; it < 4; it++) {
        const int idx = it * 256 + t, j = idx >> 3, p = idx & 7, x = j >> 3;
        uint4 val = *reinterpret_cast<const uint4 *>(&qt[j][2 * (p ^ (x >> 1))]);
        if (x & 1) val = make_uint4(val.z, val.w, val.x, val.y);
        *reinterpret_cast<uint4 *>(WqT + (e * in + k0 + j) * out + n0 + 16 * p) = val;
    }
}


/* a [R, C] bf16 with groups offs -> aT [C, kcap] e4m3 (token-major, group e's tokens from token
 * block pblk[e], the tail of its last block zero) and sT [kcap/128][C] fp32. Persistent: CTA
 * blockIdx.x takes items blockIdx.x + k gridDim.x of the pblk[E] x (C/128) items, two in flight. */
__global__ void __launch_bounds__(QT_THREADS) quant_tokens_t(const bf16 *a, int64_t C, const int64_t *offs, int E,
                                                             int64_t kcap, uint8_t *aT, float *sT) {
    extern __shared__ __align__(16) uint32_t tbuf[]; /* [2][QT_BUF_WORDS] */
    __shared__ int64_t s_offs[MAX_E + 1];
    __shared__ int pblk[MAX_E + 1];
    qt_groups(s_offs, pblk, offs, E);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ncb = (int)(C / 128);
    const int64_t nitems = (int64_t)pblk[E] * ncb;
    const uint32_t sb0 = (uint32_t)__cvta_generic_to_shared(tbuf);
    /* this thread: channels 2 cp, 2 cp + 1 of the item, tokens s 64 + 16 q + (0..15) for s = 0, 1 */
    const int cp = warp * 8 + (lane >> 2), q = lane & 3;

    int64_t it = blockIdx.x;
    int buf = 0;
    if (it < nitems) qt_issue(a, C, qt_item_of(it, ncb, s_offs, pblk, E), sb0);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    for (; it < nitems; it += gridDim.x, buf ^= 1) {
        const int64_t next = it + gridDim.x;
        if (next < nitems) qt_issue(a, C, qt_item_of(next, ncb, s_offs, pblk, E), sb0 + (uint32_t)((buf ^ 1) * QT_BUF_WORDS * 4));
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        asm volatile("cp.async.wait_group 1;\n" ::: "memory"); /* item it's copies (this thread's) landed */
        __syncthreads();                                       /* everyone's */
        const qt_item r = qt_item_of(it, ncb, s_offs, pblk, E);
        const uint32_t *tb = tbuf + buf * QT_BUF_WORDS;
        qt_code(tb, r, C, kcap, aT, sT, cp, q);
        __syncthreads(); /* buffer buf is refilled by the next iteration's issue */
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

} // namespace

extern "C" {

cudaError_t fm_gg8_quant_weight(void *w8, const void *W, int64_t E, int64_t out, int64_t in, cudaStream_t stream) {
    if (!groups_ok(E) || out < 128 || in < 128 || out % 128 || in % 128 || out / 128 > 65535 || !w8 || !W || !aligned(w8, 16) ||
        !aligned(W, 16))
        return cudaErrorInvalidValue;
    uint8_t *b = static_cast<uint8_t *>(w8);
    quant_weight<<<dim3((unsigned)(in / 128), (unsigned)(out / 128), (unsigned)E), 256, 0, stream>>>(
        static_cast<const bf16 *>(W), out, in, b, b + fm_fp8_weight_t_at(E, out, in),
        reinterpret_cast<float *>(b + fm_fp8_weight_scales_at(E, out, in)));
    return cudaGetLastError();
}

cudaError_t fm_gg8_quant_rows(void *a8, const void *a, const int64_t *offs, int64_t rcap, int64_t E, int64_t K,
                              int sm_count, cudaStream_t stream) {
    if (!groups_ok(E) || K < 128 || K % 128 || rcap < 0 || rcap >= INT32_MAX || sm_count < 1 || !offs || !a8 ||
        !aligned(a8, 16) || !aligned(a, 16))
        return cudaErrorInvalidValue;
    if (rcap == 0) return cudaSuccess;
    int ctas = 0;
    cudaError_t err = resident_ctas(quant_rows, QR_THREADS, 0, &ctas);
    if (err != cudaSuccess) return err;
    const int64_t per_cta = (QR_THREADS / 16) * QR_UNROLL, need = (rcap * (K / 128) + per_cta - 1) / per_cta;
    const int grid = (int)(need < ctas ? need : ctas);
    uint8_t *b = static_cast<uint8_t *>(a8);
    quant_rows<<<grid, QR_THREADS, 0, stream>>>(static_cast<const bf16 *>(a), K, offs, (int)E, rcap, fm_fp8_rpad(rcap), b,
                                               reinterpret_cast<float *>(b + fm_fp8_rows_scales_at(rcap, K)));
    return cudaGetLastError();
}

cudaError_t fm_gg8_quant_tokens(void *t8, const void *a, const int64_t *offs, int64_t rcap, int64_t E, int64_t C,
                                cudaStream_t stream) {
    if (!groups_ok(E) || C < 128 || C % 128 || C / 128 > 65535 || rcap < 0 || fm_fp8_kcap(rcap, E) >= INT32_MAX ||
        !offs || !t8 || !aligned(t8, 16) || !aligned(a, 16))
        return cudaErrorInvalidValue;
    if (rcap == 0) return cudaSuccess; /* no group has a token */
    const int64_t kcap = fm_fp8_kcap(rcap, E);
    /* per call, not cached: the attribute belongs to the current device's copy of the kernel */
    cudaError_t err = cudaFuncSetAttribute(quant_tokens_t, cudaFuncAttributeMaxDynamicSharedMemorySize, QT_SMEM);
    int ctas = 0;
    if (err == cudaSuccess) err = resident_ctas(quant_tokens_t, QT_THREADS, QT_SMEM, &ctas);
    if (err != cudaSuccess) return err;
    const int64_t need = (kcap / 128) * (C / 128); /* items at most */
    const int grid = (int)(need < ctas ? need : ctas);
    uint8_t *b = static_cast<uint8_t *>(t8);
    quant_tokens_t<<<grid, QT_THREADS, QT_SMEM, stream>>>(static_cast<const bf16 *>(a), C, offs, (int)E, kcap, b,
                                                          reinterpret_cast<float *>(b + fm_fp8_tokens_scales_at(kcap, C)));
    return cudaGetLastError();
}

} /* extern "C" */
