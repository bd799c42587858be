/* The CUDA backend's embedding (fm_backend.h): the forward copies rows of wte; the backward
 * stable-sorts the tokens (CUB radix sort, whose output is unique) and sums each vocabulary row's
 * tokens in increasing n, so it is deterministic (no floating-point atomics).
 *
 * Element types: fm_act is bf16 in this build (FM_ACT_BF16), read here as __nv_bfloat16. Every
 * kernel does its arithmetic in fp32 (fp64 where a comment says so) and rounds to bf16 once, to
 * nearest even, when it stores an fm_act. Every launch goes on the context's stream and is
 * checked; nothing allocates after init.
 */
#include "cuda_internal.h"

#include <cub/cub.cuh>
#include <climits>

namespace {

/* Block (x: token n, y: column slice): out[n, :] = wte[tokens[n], :]. A negative token id is a
 * caller bug: the kernel traps (the CPU backend asserts). */
__global__ void embedding_fwd_kernel(bf16 *out, const int32_t *tokens, const bf16 *wte, int64_t H, bool vec) {
    const int64_t n = blockIdx.x;
    const int32_t t = tokens[n];
    if (t < 0) __trap();
    const bf16 *src = wte + (int64_t)t * H;
    bf16 *dst = out + n * H;
    if (vec) {
        const int64_t nv = H / 8;
        for (int64_t v = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; v < nv; v += (int64_t)gridDim.y * blockDim.x)
            reinterpret_cast<uint4 *>(dst)[v] = reinterpret_cast<const uint4 *>(src)[v];
    } else {
        for (int64_t j = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; j < H; j += (int64_t)gridDim.y * blockDim.x)
            dst[j] = src[j];
    }
}

__global__ void iota_kernel(int32_t *v, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        v[i] = (int32_t)i;
}

/* After a stable sort of the tokens of rows [n0, n0+n): skey [n] the sorted token ids, sidx [n]
 * their row offsets (increasing within equal ids). Block x = a sorted position; only the first
 * position of each run of equal ids works: its threads (y: column slices) add the run's dout
 * rows in increasing n to the fp32 value of dwte's row and store it once. */
__global__ void embedding_bwd_kernel(bf16 *dwte, const bf16 *dout, const int32_t *skey, const int32_t *sidx,
                                     int64_t n, int64_t n0, int64_t H) {
    const int64_t i = blockIdx.x;
    const int32_t t = skey[i];
    if (i > 0 && skey[i - 1] == t) return;
    if (t < 0) __trap();
    for (int64_t j = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; j < H; j += (int64_t)gridDim.y * blockDim.x) {
        bf16 *d = dwte + (int64_t)t * H + j;
        float acc = ld(d);
        for (int64_t s = i; s < n && skey[s] == t; s++) acc += ld(dout + (n0 + sidx[s]) * H + j);
        st(d, acc);
    }
}

/* Largest token chunk embedding_bwd sorts at once (3 int32 arrays + CUB's temporary storage must
 * fit c->scratch); longer inputs go in chunks of increasing n, each rounded to bf16 once. */
static const int64_t EMB_CHUNK = (int64_t)1 << 18;

} // namespace

extern "C" {

void fm_cuda_embedding_fwd(void *ctx, fm_act *out, const int32_t *tokens, const fm_act *wte, int64_t N,
                           int64_t H) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && H >= 0);
    if (N == 0 || H == 0) return;
    FM_ASSERT(N <= INT_MAX);
    const bool vec = H % 8 == 0 && aligned16(out) && aligned16(wte);
    const int64_t per_row = vec ? H / 8 : H;
    int64_t gy = (per_row + EW_THREADS - 1) / EW_THREADS;
    if (gy > 64) gy = 64;
    embedding_fwd_kernel<<<dim3((unsigned)N, (unsigned)gy), EW_THREADS, 0, c->stream>>>(BF(out), tokens, CBF(wte),
                                                                                          H, vec);
    FM_CUDA_LAUNCH_CHECK(c);
}

/* dwte[tokens[n], :] += dout[n, :], deterministic: each dwte element sums its tokens' rows in
 * increasing n in fp32, starting from its old value, and is rounded once. The token ids are
 * stable-sorted (cub::DeviceRadixSort::SortPairs on (id, n), whose output is unique), so no
 * floating-point atomics and no order that depends on scheduling. */
void fm_cuda_embedding_bwd(void *ctx, fm_act *dwte, const fm_act *dout, const int32_t *tokens, int64_t N,
                           int64_t H) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && H >= 0);
    if (N == 0 || H == 0) return;
    int64_t chunk = N < EMB_CHUNK ? N : EMB_CHUNK;
    size_t temp = 0, arr = 0;
    for (;;) {
        FM_CUDA_CHECK(c, cub::DeviceRadixSort::SortPairs(nullptr, temp, (const int32_t *)nullptr, (int32_t *)nullptr,
                                                      (const int32_t *)nullptr, (int32_t *)nullptr, (int)chunk, 0,
                                                      32, c->stream));
        arr = ((size_t)chunk * sizeof(int32_t) + 255) & ~(size_t)255;
        if (3 * arr + temp <= FM_CUDA_REDUCE_BYTES) break;
        FM_ASSERT(chunk > 1024);
        chunk /= 2;
    }
    char *base = static_cast<char *>(c->scratch);
    int32_t *skey = reinterpret_cast<int32_t *>(base), *iota = reinterpret_cast<int32_t *>(base + arr),
            *sidx = reinterpret_cast<int32_t *>(base + 2 * arr);
    void *tmp = base + 3 * arr;
    int64_t gy = (H + EW_THREADS - 1) / EW_THREADS;
    if (gy > 64) gy = 64;
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        const int64_t n = N - n0 < chunk ? N - n0 : chunk;
        iota_kernel<<<ew_blocks(n), EW_THREADS, 0, c->stream>>>(iota, n);
        FM_CUDA_LAUNCH_CHECK(c);
        size_t t = temp;
        FM_CUDA_CHECK(c, cub::DeviceRadixSort::SortPairs(tmp, t, tokens + n0, skey, iota, sidx, (int)n, 0, 32,
                                                      c->stream));
        embedding_bwd_kernel<<<dim3((unsigned)n, (unsigned)gy), EW_THREADS, 0, c->stream>>>(
            BF(dwte), CBF(dout), skey, sidx, n, n0, H);
        FM_CUDA_LAUNCH_CHECK(c);
    }
}

} /* extern "C" */
