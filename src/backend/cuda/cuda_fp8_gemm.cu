/* The CUDA backend's FP8 expert GEMMs on E4M3 codes (fm_backend.h: expert_fp8_serves,
 * fp8_quant_weight / _rows / _tokens, expert_fp8_gemm; declared in cuda_fp8.h): thin wrappers over
 * the sm_90a kernels of sm90/gg_sm90_fp8.h (the kernel lab's v3 and v5, promoted; the GEMM's schedule is
 * the context's fp8_gemm option, FLATMOE_FP8_GEMM, fixed at init), on the context's op stream. The
 * byte layouts are backend/fm_fp8_layout.h's; the codes and scales are fm_fp8.h's, bit for bit the
 * CPU backend's. Nothing here allocates or waits for the host: the offsets are read
 * by the kernels where the device reads them (device memory, or the dispatcher's pinned host
 * array through unified addressing). A shape the kernels do not serve (the caller skipped
 * expert_fp8_serves) is recorded as FM_ERR_ARG naming the op and the shape; a launch error
 * through FM_CUDA_CHECK (FM_ERR_UNSUPPORTED, the CUDA error's text), as the sm90 bf16 path's. */
#include "cuda_internal.h"

#include "../fm_fp8_layout.h"
#include "cuda_fp8.h"
#include "sm90/gg_sm90.h"
#include "sm90/gg_sm90_fp8.h"

#include <cstdio>

namespace {

/* Records FM_ERR_ARG for an op called with a shape outside its kernels' (the context's first error). */
void not_served(fm_cuda_ctx *c, const char *op, const char *what, const char *file, int line) {
    fm_cuda_record(c, FM_ERR_ARG, op, what, file, line);
}

} // namespace

extern "C" {

bool fm_cuda_expert_fp8_serves(void *ctx, int64_t E, int64_t H, int64_t I, int64_t rows_max) {
    const fm_cuda_ctx *c = ctx_of(ctx);
    /* FLATMOE_EXPERT_GEMM=cublas|loop|grouped keep the fake-quantization emulation (the plain twin) */
    if (c->expert_gemm != FM_EXPERT_GEMM_AUTO && c->expert_gemm != FM_EXPERT_GEMM_SM90) return false;
    if (c->sm_count <= 0 || !fm_gg_sm90_device_ok(c->device)) return false;
    /* gate/up map H -> I, down I -> H: every product and quantizer of both must be served */
    return fm_fp8_layer_serves(E, H, I, rows_max);
}

void fm_cuda_fp8_quant_weight(void *ctx, void *w8, const fm_act *W, int64_t E, int64_t out, int64_t in) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (!fm_gg8_serves(E, in, out, 0)) {
        char m[160];
        snprintf(m, sizeof m, "E %lld, out %lld, in %lld: expected 1 <= E <= 256 and out, in multiples of 128",
                 (long long)E, (long long)out, (long long)in);
        return not_served(c, "fp8_quant_weight", m, __FILE__, __LINE__);
    }
    FM_CUDA_CHECK(c, fm_gg8_quant_weight(w8, W, E, out, in, c->stream));
}

void fm_cuda_fp8_quant_rows(void *ctx, void *a8, const fm_act *a, const int64_t *offsets, int64_t rcap, int64_t E,
                            int64_t K) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (!fm_gg8_serves(E, K, 128, rcap)) {
        char m[192];
        snprintf(m, sizeof m, "E %lld, rcap %lld, K %lld: expected 1 <= E <= 256, rcap < 2^31 and K a multiple of 128",
                 (long long)E, (long long)rcap, (long long)K);
        return not_served(c, "fp8_quant_rows", m, __FILE__, __LINE__);
    }
    FM_CUDA_CHECK(c, fm_gg8_quant_rows(a8, a, offsets, rcap, E, K, c->sm_count, c->stream));
}

void fm_cuda_fp8_quant_tokens(void *ctx, void *t8, const fm_act *a, const int64_t *offsets, int64_t rcap, int64_t E,
                              int64_t C) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (!fm_gg8_serves(E, C, 128, rcap)) {
        char m[192];
        snprintf(m, sizeof m,
                 "E %lld, rcap %lld, C %lld: expected 1 <= E <= 256, fm_fp8_kcap(rcap, E) < 2^31 and C a multiple of 128",
                 (long long)E, (long long)rcap, (long long)C);
        return not_served(c, "fp8_quant_tokens", m, __FILE__, __LINE__);
    }
    FM_CUDA_CHECK(c, fm_gg8_quant_tokens(t8, a, offsets, rcap, E, C, c->stream));
}

void fm_cuda_expert_fp8_gemm(void *ctx, int kind, fm_act *C, float beta, const void *A8, const void *B8,
                             const int64_t *offsets, int64_t rcap, int64_t E, int64_t in, int64_t out) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (kind < 0 || kind > 2 || !fm_gg8_serves(E, in, out, rcap)) {
        char m[224];
        snprintf(m, sizeof m,
                 "kind %d, E %lld, in %lld, out %lld, rcap %lld: expected kind 0, 1 or 2, 1 <= E <= 256, in and out "
                 "multiples of 128, rcap and fm_fp8_kcap(rcap, E) below 2^31",
                 kind, (long long)E, (long long)in, (long long)out, (long long)rcap);
        return not_served(c, "expert_fp8_gemm", m, __FILE__, __LINE__);
    }
    FM_CUDA_CHECK(c, fm_gg8_launch((int)c->fp8_gemm, kind, C, beta, A8, B8, offsets, rcap, E, in, out, c->sm_count,
                                   c->stream));
}

} /* extern "C" */
