/* The CUDA backend's rotary position embedding (Su et al. 2021; fm_backend.h), HF "rotate_half"
 * layout: the forward rotation and its transpose, in place, of the first rd dims of each head
 * (rd < hd: partial rotary, the rest untouched); positions t, or pos[b*T+t] for packed documents.
 *
 * Element types: fm_act is bf16 in this build (FM_ACT_BF16), read here as __nv_bfloat16. Every
 * kernel does its arithmetic in fp32 (fp64 where a comment says so) and rounds to bf16 once, to
 * nearest even, when it stores an fm_act. Every launch goes on the context's stream and is
 * checked; nothing allocates after init.
 */
#include "cuda_internal.h"

namespace {

/* One thread per pair (x[i], x[i+rd/2]) of each head (stride hd) of x [B,T,nh,hd]; sign = -1
 * applies the transpose. */
__global__ void rope_kernel(bf16 *x, const float *cos_tab, const float *sin_tab, const int32_t *pos, int64_t T,
                            int64_t nh, int64_t half, int64_t hd, int64_t total, float sign) {
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = e % half, vec = e / half, t = pos ? (int64_t)pos[vec / nh] : (vec / nh) % T;
        bf16 *a = x + vec * hd;
        const float cs = cos_tab[t * half + i], sn = sign * sin_tab[t * half + i];
        const float x0 = ld(a + i), x1 = ld(a + i + half);
        st(a + i, x0 * cs - x1 * sn);
        st(a + i + half, x1 * cs + x0 * sn);
    }
}

/* The same, 8 pairs per thread with 16-byte accesses (half % 8 == 0, hd % 8 == 0, x 16-byte
 * aligned). */
__global__ void rope_vec_kernel(bf16 *x, const float *cos_tab, const float *sin_tab, const int32_t *pos, int64_t T,
                                int64_t nh, int64_t half, int64_t hd, int64_t total8, float sign) {
    const int64_t g8 = half / 8;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total8;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i0 = 8 * (e % g8), vec = e / g8, t = pos ? (int64_t)pos[vec / nh] : (vec / nh) % T;
        bf16 *a = x + vec * hd + i0, *b = a + half;
        const float *ct = cos_tab + t * half + i0, *stab = sin_tab + t * half + i0;
        float x0[8], x1[8], y0[8], y1[8];
        load8(a, x0);
        load8(b, x1);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float cs = ct[k], sn = sign * stab[k];
            y0[k] = x0[k] * cs - x1[k] * sn;
            y1[k] = x1[k] * cs + x0[k] * sn;
        }
        store8(a, y0);
        store8(b, y1);
    }
}

static void rope_launch(fm_cuda_ctx *c, fm_act *x, const float *cos_tab, const float *sin_tab, int64_t B, int64_t T,
                        int64_t nh, int64_t hd, int64_t rd, const int32_t *pos, float sign) {
    FM_ASSERT(B >= 0 && T >= 0 && nh >= 0 && hd >= 0 && rd % 2 == 0 && rd >= 2 && rd <= hd);
    const int64_t half = rd / 2, total = B * T * nh * half;
    if (total == 0) return;
    if (half % 8 == 0 && hd % 8 == 0 && aligned16(x))
        rope_vec_kernel<<<ew_blocks(total / 8), EW_THREADS, 0, c->stream>>>(BF(x), cos_tab, sin_tab, pos, T, nh,
                                                                             half, hd, total / 8, sign);
    else
        rope_kernel<<<ew_blocks(total), EW_THREADS, 0, c->stream>>>(BF(x), cos_tab, sin_tab, pos, T, nh, half, hd,
                                                                     total, sign);
    FM_CUDA_LAUNCH_CHECK(c);
}

} // namespace

extern "C" {

void fm_cuda_rope_fwd(void *ctx, fm_act *x, const float *cos_tab, const float *sin_tab, int64_t B, int64_t T,
                      int64_t nh, int64_t hd, int64_t rd, const int32_t *pos) {
    rope_launch(ctx_of(ctx), x, cos_tab, sin_tab, B, T, nh, hd, rd, pos, 1.0f);
}

void fm_cuda_rope_bwd(void *ctx, fm_act *dx, const float *cos_tab, const float *sin_tab, int64_t B, int64_t T,
                      int64_t nh, int64_t hd, int64_t rd, const int32_t *pos) {
    rope_launch(ctx_of(ctx), dx, cos_tab, sin_tab, B, T, nh, hd, rd, pos, -1.0f);
}

} /* extern "C" */
