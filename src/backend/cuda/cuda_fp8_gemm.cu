/* The CUDA backend's FP8 expert GEMMs on E4M3 codes (fm_backend.h: expert_fp8_serves,
 * fp8_quant_weight / _rows / _tokens, expert_fp8_gemm, the fused fp8_quant_dual /
 * fp8_swiglu_bwd_quant / fp8_swiglu_fwd_quant; declared in cuda_fp8.h): thin wrappers over
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

/* The fused quantizations: the shape rule of fp8_quant_tokens (rcap, E and the columns), K or I. */
static bool fused_served(fm_cuda_ctx *c, const char *op, int64_t rcap, int64_t E, int64_t C) {
    if (fm_gg8_serves(E, C, 128, rcap)) return true;
    char m[192];
    snprintf(m, sizeof m,
             "E %lld, rcap %lld, columns %lld: expected 1 <= E <= 256, fm_fp8_kcap(rcap, E) < 2^31 and the columns a "
             "multiple of 128",
             (long long)E, (long long)rcap, (long long)C);
    not_served(c, op, m, __FILE__, __LINE__);
    return false;
}

void fm_cuda_fp8_quant_dual(void *ctx, void *a8, void *t8, const fm_act *a, const int64_t *offsets, int64_t rcap,
                            int64_t E, int64_t K) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (!fused_served(c, "fp8_quant_dual", rcap, E, K)) return;
    FM_CUDA_CHECK(c, fm_gg8_quant_dual(a8, t8, a, offsets, rcap, E, K, c->stream));
}

void fm_cuda_fp8_swiglu_bwd_quant(void *ctx, void *dg8, void *du8, void *dgT8, void *duT8, const fm_act *dout,
                                  const fm_act *gate, const fm_act *up, const int64_t *offsets, int64_t rcap,
                                  int64_t E, int64_t I) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (!fused_served(c, "fp8_swiglu_bwd_quant", rcap, E, I)) return;
    FM_CUDA_CHECK(c, fm_gg8_swiglu_bwd_quant(dg8, du8, dgT8, duT8, dout, gate, up, offsets, rcap, E, I, c->stream));
}

void fm_cuda_fp8_swiglu_fwd_quant(void *ctx, fm_act *out, void *a8, const fm_act *gate, const fm_act *up,
                                  const int64_t *offsets, int64_t rcap, int64_t E, int64_t I) {
    fm_cuda_ctx *c = ctx_of(ctx);
    if (!fused_served(c, "fp8_swiglu_fwd_quant", rcap, E, I)) return;
    FM_CUDA_CHECK(c, fm_gg8_swiglu_fwd_quant(out, a8, gate, up, offsets, rcap, E, I, c->sm_count, c->stream));
}

} /* extern "C" */
