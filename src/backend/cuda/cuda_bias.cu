/* The CUDA backend's linear-layer biases (fm_backend.h bias_add, bias_grad): y[n,j] += b[j] after a
 * GEMM, and db[j] += sum_n dy[n,j], the sum in fp32 in a fixed order (deterministic: the same bits
 * on every call).
 *
 * Element types: fm_act is bf16 in this build (FM_ACT_BF16), read here as __nv_bfloat16. Every
 * kernel does its arithmetic in fp32 and rounds to bf16 once, to nearest even, when it stores an
 * fm_act. Every launch goes on the context's stream and is checked; nothing allocates after init.
 */
#include "cuda_internal.h"

namespace {

/* One thread per element of y [N,D]. */
__global__ void bias_add_kernel(bf16 *y, const bf16 *b, int64_t D, int64_t total) {
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x)
        st(y + e, ld(y + e) + ld(b + e % D));
}

/* Column sums of dy [N,D]: a block of BIAS_COLS x BIAS_LANES threads owns BIAS_COLS adjacent
 * columns (coalesced rows); lane r sums rows r, r + BIAS_LANES, ... in order, then lane 0 adds the
 * BIAS_LANES partials in lane order: a fixed summation order for any N. */
enum { BIAS_COLS = 32, BIAS_LANES = 8 };
__global__ void bias_grad_kernel(bf16 *db, const bf16 *dy, int64_t N, int64_t D) {
    __shared__ float part[BIAS_LANES][BIAS_COLS];
    const int cx = threadIdx.x % BIAS_COLS, lane = threadIdx.x / BIAS_COLS;
    const int64_t j = (int64_t)blockIdx.x * BIAS_COLS + cx;
    float acc = 0.0f;
    if (j < D)
        for (int64_t n = lane; n < N; n += BIAS_LANES) acc += ld(dy + n * D + j);
    part[lane][cx] = acc;
    __syncthreads();
    if (lane == 0 && j < D) {
        float s = 0.0f;
        for (int r = 0; r < BIAS_LANES; r++) s += part[r][cx];
        st(db + j, ld(db + j) + s);
    }
}

} // namespace

extern "C" {

void fm_cuda_bias_add(void *ctx, fm_act *y, const fm_act *b, int64_t N, int64_t D) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && D >= 0);
    const int64_t total = N * D;
    if (total == 0) return;
    bias_add_kernel<<<ew_blocks(total), EW_THREADS, 0, c->stream>>>(BF(y), CBF(b), D, total);
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_bias_grad(void *ctx, fm_act *db, const fm_act *dy, int64_t N, int64_t D) {
    fm_cuda_ctx *c = ctx_of(ctx);
    FM_ASSERT(N >= 0 && D >= 0);
    if (D == 0) return;
    const int64_t blocks = (D + BIAS_COLS - 1) / BIAS_COLS;
    bias_grad_kernel<<<(unsigned)blocks, BIAS_COLS * BIAS_LANES, 0, c->stream>>>(BF(db), CBF(dy), N, D);
    FM_CUDA_LAUNCH_CHECK(c);
}

} /* extern "C" */
