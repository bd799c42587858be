/* The FP8 expert path's fused quantizers (gg_sm90_fp8.h: fm_gg8_quant_dual, fm_gg8_swiglu_bwd_quant,
 * fm_gg8_swiglu_fwd_quant): each writes exactly the bytes of the unfused sequence it replaces
 * (fm_gg8_quant_rows / fm_gg8_quant_tokens over the bf16 tensor the elementwise op would have
 * stored), reading its inputs once. The bits: a tile is coded by the same device code as the
 * unfused kernels (gg_sm90_fp8_quant.cuh: amax on the bf16 bits, the scale exponent, the hardware
 * cvt; gg_sm90_fp8_quant.cu's header comment says why those are fm_fp8.h's bits), over the same
 * 128 values; SwiGLU's values come from cuda_swiglu.cuh, the expressions cuda_elementwise.cu's
 * swiglu_fwd / swiglu_bwd evaluate, rounded to bf16 by the same conversion (nearest even) before
 * they are coded, as the stored tensor would be. tests/gpu/test_cuda_fp8_codes.c compares every
 * output byte with the unfused ops' and with the C reference.
 *
 * Kernels:
 *  dual_tiles<NIN> (quant_dual: NIN 1; swiglu_bwd_quant: NIN 3): quant_tokens_t's persistent design
 *    (gg_sm90_fp8_quant.cu): CTAs over the (128-token block, 128-channel block) items of the
 *    groups (no tile mixes two groups), cp.async bringing the next item's NIN 128 x 128 bf16 tiles
 *    (32 KiB each, tokens past the group zero-filled) into one of two shared stages while the
 *    current one is coded. NIN 3 (dout, gate, up) first turns the stage into dgate, dup in place
 *    (over gate, up; tokens past the group 0), each thread 8 chunks of 8 values. Then for each
 *    coded tile: the rows operand's 1 x 128 tiles of the tile's valid tokens (a half warp a token:
 *    one 16-byte shared load a lane, quant_rows' amax shuffles and 8-byte code stores; every real
 *    row lies in exactly one group's token block, so each is written once) and the tokens
 *    operand's 128 x 1 tiles (qt_code, quant_tokens_t's own). Shared memory: 64 KiB (NIN 1),
 *    192 KiB (NIN 3).
 *  swiglu_fwd_rows: quant_rows' grid-stride loop (a half warp per 1 x 128 tile, 4 tiles in flight),
 *    loading gate's and up's 16 bytes, storing the 8 bf16 outputs (16 bytes) and coding them. */
#include "gg_sm90_fp8.h"

#include "../cuda_swiglu.cuh"
#include "gg_sm90_fp8_quant.cuh"

namespace {

/* ---- the rows operand of a staged tile ---- */

/* Rows r.t0 + tok (tok < r.valid) of the staged tile tb, columns r.c0 .. r.c0 + 127, into the rows
 * operand q [rcap, K], s [K/128][rpad]: half warp h = threadIdx.x / 16 takes tokens h + 16 i, lane
 * l the tile's columns 8 l .. 8 l + 7 (logical words 4 l .. 4 l + 3: contiguous and 16-byte
 * aligned under qt_word's swizzle, which XORs multiples of 8). The whole warp runs every step (the
 * shuffles); only valid tokens store. */
__device__ __forceinline__ void rows_code(const uint32_t *tb, const qt_item &r, int64_t K, int64_t rpad, uint8_t *q,
                                          float *s) {
    const int l = threadIdx.x & 15, h = threadIdx.x >> 4;
    const int64_t cb = r.c0 / 128;
#pragma unroll 2
    for (int i = 0; i < QT_THREADS / 32; i++) {
        const int tok = h + 16 * i;
        const uint4 v = *reinterpret_cast<const uint4 *>(tb + qt_word(tok, 4 * l));
        const row_codes t = row_tile_code(v);
        if (tok < r.valid) {
            const int64_t row = r.t0 + tok;
            *reinterpret_cast<uint2 *>(q + row * K + r.c0 + 8 * l) = t.c;
            if (l == 0) s[cb * rpad + row] = tile_scale(t.am, t.e);
        }
    }
}

/* Two bf16 of a word as floats (lo, hi) and back (nearest even: store8's conversion). */
__device__ __forceinline__ uint32_t bf2_of(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&h);
}

/* The SwiGLU backward over a staged stage (dout at st, gate at st + QT_BUF_WORDS, up at
 * st + 2 QT_BUF_WORDS, the same swizzle): dgate over gate, dup over up, in place (each thread
 * reads and writes only its own chunks); tokens at or past valid set to 0. */
__device__ __forceinline__ void swiglu_bwd_stage(uint32_t *st, int valid) {
    uint4 *d4 = reinterpret_cast<uint4 *>(st), *g4 = reinterpret_cast<uint4 *>(st + QT_BUF_WORDS),
          *u4 = reinterpret_cast<uint4 *>(st + 2 * QT_BUF_WORDS);
#pragma unroll 2
    for (int i = 0; i < QT_BUF_WORDS / 4 / QT_THREADS; i++) {
        const int j = i * QT_THREADS + threadIdx.x; /* chunk j: token j / 16 (16 chunks of 4 words a token) */
        const uint4 d = d4[j], g = g4[j], u = u4[j];
        const uint32_t dw[4] = {d.x, d.y, d.z, d.w}, gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
        uint32_t og[4], ou[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float dg0, du0, dg1, du1;
            fm_swiglu_bwd1(bf_lo(dw[k]), bf_lo(gw[k]), bf_lo(uw[k]), &dg0, &du0);
            fm_swiglu_bwd1(bf_hi(dw[k]), bf_hi(gw[k]), bf_hi(uw[k]), &dg1, &du1);
            og[k] = bf2_of(dg0, dg1), ou[k] = bf2_of(du0, du1);
        }
        const bool ok = (j >> 4) < valid;
        g4[j] = ok ? make_uint4(og[0], og[1], og[2], og[3]) : make_uint4(0, 0, 0, 0);
        u4[j] = ok ? make_uint4(ou[0], ou[1], ou[2], ou[3]) : make_uint4(0, 0, 0, 0);
    }
}

/* The outputs of dual_tiles: per coded tile d (< 1 for NIN 1, < 2 for NIN 3), its rows operand
 * (q[d], s[d]) and tokens operand (t[d], st[d]). */
struct dual_out {
    uint8_t *q[2];
    float *s[2];
    uint8_t *t[2];
    float *st[2];
};

/* a[0 .. NIN) [R, C] bf16 with groups offs -> the outputs (above). NIN 1: a[0] coded as is; NIN 3:
 * (dout, gate, up) -> dgate (d 0), dup (d 1). Persistent: CTA blockIdx.x takes items blockIdx.x + k
 * gridDim.x of the pblk[E] x (C/128) items, two in flight. */
template <int NIN>
__global__ void __launch_bounds__(QT_THREADS) dual_tiles(const bf16 *a0, const bf16 *a1, const bf16 *a2, int64_t C,
                                                         const int64_t *offs, int E, int64_t kcap, int64_t rpad,
                                                         dual_out o) {
    extern __shared__ __align__(16) uint32_t tbuf[]; /* [2][NIN][QT_BUF_WORDS] */
    __shared__ int64_t s_offs[MAX_E + 1];
    __shared__ int pblk[MAX_E + 1];
    qt_groups(s_offs, pblk, offs, E);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ncb = (int)(C / 128);
    const int64_t nitems = (int64_t)pblk[E] * ncb;
    const uint32_t sb0 = (uint32_t)__cvta_generic_to_shared(tbuf), stage = NIN * QT_BUF_WORDS * 4;
    const int cp = warp * 8 + (lane >> 2), q = lane & 3; /* qt_code's channel pair and quarter */
    const bf16 *in[3] = {a0, a1, a2};

    int64_t it = blockIdx.x;
    int buf = 0;
    if (it < nitems) {
        const qt_item r = qt_item_of(it, ncb, s_offs, pblk, E);
#pragma unroll
        for (int k = 0; k < NIN; k++) qt_issue(in[k], C, r, sb0 + (uint32_t)(k * QT_BUF_WORDS * 4));
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    for (; it < nitems; it += gridDim.x, buf ^= 1) {
        const int64_t next = it + gridDim.x;
        if (next < nitems) {
            const qt_item rn = qt_item_of(next, ncb, s_offs, pblk, E);
#pragma unroll
            for (int k = 0; k < NIN; k++)
                qt_issue(in[k], C, rn, sb0 + (uint32_t)(buf ^ 1) * stage + (uint32_t)(k * QT_BUF_WORDS * 4));
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        asm volatile("cp.async.wait_group 1;\n" ::: "memory"); /* item it's copies (this thread's) landed */
        __syncthreads();                                       /* everyone's */
        const qt_item r = qt_item_of(it, ncb, s_offs, pblk, E);
        uint32_t *st = tbuf + buf * NIN * QT_BUF_WORDS;
        if constexpr (NIN == 3) {
            swiglu_bwd_stage(st, r.valid);
            __syncthreads();
        }
#pragma unroll
        for (int d = 0; d < (NIN == 3 ? 2 : 1); d++) {
            const uint32_t *tb = st + (NIN == 3 ? 1 + d : 0) * QT_BUF_WORDS;
            rows_code(tb, r, C, rpad, o.q[d], o.s[d]);
            qt_code(tb, r, C, kcap, o.t[d], o.st[d], cp, q);
        }
        __syncthreads(); /* stage buf is refilled by the next iteration's issue */
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

/* ---- SwiGLU forward with its rows operand ---- */

constexpr int SF_THREADS = 256, SF_UNROLL = 4; /* tiles a half warp has in flight */

/* out [R, I] = swiglu(gate, up) bf16 and its rows operand q [rcap, I], s [I/128][rpad], R =
 * min(offs[E], rcap) (read here). quant_rows' tiling: tile w (row w / nb, column block w % nb) is
 * the 256 bytes at 128 w; half h of warp gw takes tiles base + u * 2 nwarps + h. */
__global__ void __launch_bounds__(SF_THREADS) swiglu_fwd_rows(bf16 *out, const bf16 *gate, const bf16 *up, int64_t I,
                                                              const int64_t *offs, int E, int64_t rcap, int64_t rpad,
                                                              uint8_t *q, float *s) {
    __shared__ int64_t s_rows;
    if (threadIdx.x == 0) {
        const int64_t r = offs[E];
        s_rows = r < rcap ? r : rcap;
    }
    __syncthreads();
    const int64_t nb = I / 128, nt = s_rows * nb;
    const int l = threadIdx.x & 15, h = (threadIdx.x >> 4) & 1;
    const int64_t gw = ((int64_t)blockIdx.x * SF_THREADS + threadIdx.x) >> 5, stride = (int64_t)gridDim.x * (SF_THREADS / 32) * 2;
    const uint4 *g16 = reinterpret_cast<const uint4 *>(gate), *u16 = reinterpret_cast<const uint4 *>(up);
    uint4 *o16 = reinterpret_cast<uint4 *>(out);
    for (int64_t base = 2 * gw; base < nt; base += SF_UNROLL * stride) {
        uint4 gv[SF_UNROLL], uv[SF_UNROLL];
#pragma unroll
        for (int u = 0; u < SF_UNROLL; u++) {
            const int64_t w = base + u * stride + h;
            gv[u] = w < nt ? __ldg(g16 + w * 16 + l) : make_uint4(0, 0, 0, 0);
            uv[u] = w < nt ? __ldg(u16 + w * 16 + l) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < SF_UNROLL; u++) {
            const int64_t w = base + u * stride + h;
            const uint32_t gw4[4] = {gv[u].x, gv[u].y, gv[u].z, gv[u].w}, uw4[4] = {uv[u].x, uv[u].y, uv[u].z, uv[u].w};
            uint32_t ow[4];
#pragma unroll
            for (int k = 0; k < 4; k++)
                ow[k] = bf2_of(fm_swiglu_fwd1(bf_lo(gw4[k]), bf_lo(uw4[k])), fm_swiglu_fwd1(bf_hi(gw4[k]), bf_hi(uw4[k])));
            const uint4 v = make_uint4(ow[0], ow[1], ow[2], ow[3]);
            const row_codes t = row_tile_code(v);
            if (w < nt) {
                o16[w * 16 + l] = v;
                *reinterpret_cast<uint2 *>(q + w * 128 + l * 8) = t.c;
                if (l == 0) { /* 32-bit division where it fits (the 64-bit one is a long routine) */
                    const int64_t r = nt <= 0xFFFFFFFFll ? (int64_t)((uint32_t)w / (uint32_t)nb) : w / nb, b = w - r * nb;
                    s[b * rpad + r] = tile_scale(t.am, t.e);
                }
            }
        }
    }
}

/* Whether C (K, I) and rcap are served with E groups (quant_tokens' rule; the rows operand's is weaker) */
bool fused_shape_ok(int64_t E, int64_t rcap, int64_t C) {
    return groups_ok(E) && C >= 128 && C % 128 == 0 && C / 128 <= 65535 && rcap >= 0 && fm_fp8_kcap(rcap, E) < INT32_MAX;
}

/* Launches dual_tiles<NIN> over rcap rows of C channels. */
template <int NIN>
cudaError_t launch_dual(const void *a0, const void *a1, const void *a2, const int64_t *offs, int64_t rcap, int64_t E,
                        int64_t C, const dual_out &o, cudaStream_t stream) {
    constexpr int smem = 2 * NIN * QT_BUF_WORDS * 4;
    const int64_t kcap = fm_fp8_kcap(rcap, E);
    /* per call, not cached: the attribute belongs to the current device's copy of the kernel */
    cudaError_t err = cudaFuncSetAttribute(dual_tiles<NIN>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    int ctas = 0;
    if (err == cudaSuccess) err = resident_ctas(dual_tiles<NIN>, QT_THREADS, smem, &ctas);
    if (err != cudaSuccess) return err;
    const int64_t need = (kcap / 128) * (C / 128); /* items at most */
    const int grid = (int)(need < ctas ? need : ctas);
    dual_tiles<NIN><<<grid, QT_THREADS, smem, stream>>>(static_cast<const bf16 *>(a0), static_cast<const bf16 *>(a1),
                                                        static_cast<const bf16 *>(a2), C, offs, (int)E, kcap,
                                                        fm_fp8_rpad(rcap), o);
    return cudaGetLastError();
}

} // namespace

extern "C" {

cudaError_t fm_gg8_quant_dual(void *a8, void *t8, const void *a, const int64_t *offs, int64_t rcap, int64_t E,
                              int64_t K, cudaStream_t stream) {
    if (!fused_shape_ok(E, rcap, K) || !offs || !a8 || !t8 || !aligned(a8, 16) || !aligned(t8, 16) || !aligned(a, 16))
        return cudaErrorInvalidValue;
    if (rcap == 0) return cudaSuccess; /* no group has a row */
    uint8_t *q = static_cast<uint8_t *>(a8), *t = static_cast<uint8_t *>(t8);
    dual_out o = {};
    o.q[0] = q, o.s[0] = reinterpret_cast<float *>(q + fm_fp8_rows_scales_at(rcap, K));
    o.t[0] = t, o.st[0] = reinterpret_cast<float *>(t + fm_fp8_tokens_scales_at(fm_fp8_kcap(rcap, E), K));
    return launch_dual<1>(a, a, a, offs, rcap, E, K, o, stream);
}

cudaError_t fm_gg8_swiglu_bwd_quant(void *dg8, void *du8, void *dgT8, void *duT8, const void *dout, const void *gate,
                                    const void *up, const int64_t *offs, int64_t rcap, int64_t E, int64_t I,
                                    cudaStream_t stream) {
    if (!fused_shape_ok(E, rcap, I) || !offs || !dg8 || !du8 || !dgT8 || !duT8 || !aligned(dg8, 16) ||
        !aligned(du8, 16) || !aligned(dgT8, 16) || !aligned(duT8, 16) || !aligned(dout, 16) || !aligned(gate, 16) ||
        !aligned(up, 16))
        return cudaErrorInvalidValue;
    if (rcap == 0) return cudaSuccess;
    const int64_t kcap = fm_fp8_kcap(rcap, E);
    uint8_t *q[2] = {static_cast<uint8_t *>(dg8), static_cast<uint8_t *>(du8)};
    uint8_t *t[2] = {static_cast<uint8_t *>(dgT8), static_cast<uint8_t *>(duT8)};
    dual_out o;
    for (int d = 0; d < 2; d++) {
        o.q[d] = q[d], o.s[d] = reinterpret_cast<float *>(q[d] + fm_fp8_rows_scales_at(rcap, I));
        o.t[d] = t[d], o.st[d] = reinterpret_cast<float *>(t[d] + fm_fp8_tokens_scales_at(kcap, I));
    }
    return launch_dual<3>(dout, gate, up, offs, rcap, E, I, o, stream);
}

cudaError_t fm_gg8_swiglu_fwd_quant(void *out, void *a8, const void *gate, const void *up, const int64_t *offs,
                                    int64_t rcap, int64_t E, int64_t I, int sm_count, cudaStream_t stream) {
    if (!groups_ok(E) || I < 128 || I % 128 || rcap < 0 || rcap >= INT32_MAX || sm_count < 1 || !offs || !out || !a8 ||
        !aligned(out, 16) || !aligned(a8, 16) || !aligned(gate, 16) || !aligned(up, 16))
        return cudaErrorInvalidValue;
    if (rcap == 0) return cudaSuccess;
    int ctas = 0;
    cudaError_t err = resident_ctas(swiglu_fwd_rows, SF_THREADS, 0, &ctas);
    if (err != cudaSuccess) return err;
    const int64_t per_cta = (SF_THREADS / 16) * SF_UNROLL, need = (rcap * (I / 128) + per_cta - 1) / per_cta;
    const int grid = (int)(need < ctas ? need : ctas);
    uint8_t *b = static_cast<uint8_t *>(a8);
    swiglu_fwd_rows<<<grid, SF_THREADS, 0, stream>>>(static_cast<bf16 *>(out), static_cast<const bf16 *>(gate),
                                                     static_cast<const bf16 *>(up), I, offs, (int)E, rcap,
                                                     fm_fp8_rpad(rcap), b,
                                                     reinterpret_cast<float *>(b + fm_fp8_rows_scales_at(rcap, I)));
    return cudaGetLastError();
}

} /* extern "C" */
