/* The CUDA backend's FP8 fake quantization ops (fm_backend.h quant_fp8_*; the recipe, rounding
 * and non-finite rule: backend/fm_fp8.h, whose code the kernels run, so they give the C
 * reference's bits on the same bf16 input). bf16 in, bf16 out (the E4M3 value times its
 * power-of-two scale is exact in bf16); y may alias x. Issued on the context's stream; launch
 * errors are recorded in the context (fm_cuda_status). Algorithm: DeepSeek-V3 §3.3 (arXiv
 * 2412.19437), fine-grained 1 x 128 / 128 x 128 / 128 x 1 tiles with UE8M0 scales.
 *   fm_cuda_quant_fp8_rows: x [rows, cols], 1 x 128 tiles along each row; one warp per tile,
 *     the tile's amax by a warp butterfly (__shfl_xor_sync), 4 elements per lane.
 *   fm_cuda_quant_fp8_blocks: mats x [rows, cols], 128 x 128 blocks; one 256-thread block per
 *     block, amax by warp butterflies and a shared-memory tree.
 *   fm_cuda_quant_fp8_cols_grouped: x [offsets[E], cols], 128 x 1 tiles along each group's rows
 *     (offsets host int64 [E+1]); one launch per non-empty group, one thread per column and
 *     128-row tile (coalesced across the columns), amax by a loop over the tile's rows. */
#ifndef FM_CUDA_FP8_H
#define FM_CUDA_FP8_H

#include "../fm_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

void fm_cuda_quant_fp8_rows(void *ctx, fm_act *y, const fm_act *x, int64_t rows, int64_t cols);
void fm_cuda_quant_fp8_blocks(void *ctx, fm_act *y, const fm_act *x, int64_t mats, int64_t rows, int64_t cols);
void fm_cuda_quant_fp8_cols_grouped(void *ctx, fm_act *y, const fm_act *x, const int64_t *offsets, int64_t E,
                                    int64_t cols);

/* The FP8 expert GEMMs on E4M3 codes (fm_backend.h: expert_fp8_serves, fp8_quant_weight, _rows,
 * _tokens, expert_fp8_gemm; cuda_fp8_gemm.cu over sm90/gg_sm90_fp8.h, the kernel lab's v3): the
 * contract's signatures, buffers in backend/fm_fp8_layout.h's layouts. expert_fp8_serves: the
 * expert_gemm option auto or sm90, an sm_90 device (fm_gg_sm90_device_ok) and the shapes
 * (fm_fp8_layer_serves, backend/fm_fp8_layout.h: the planner's and the CPU's rule too). A shape outside the kernels' is
 * recorded as FM_ERR_ARG; launch errors as FM_ERR_UNSUPPORTED (fm_cuda_status). */
bool fm_cuda_expert_fp8_serves(void *ctx, int64_t E, int64_t H, int64_t I, int64_t rows_max);
void fm_cuda_fp8_quant_weight(void *ctx, void *w8, const fm_act *W, int64_t E, int64_t out, int64_t in);
void fm_cuda_fp8_quant_rows(void *ctx, void *a8, const fm_act *a, const int64_t *offsets, int64_t rcap, int64_t E,
                            int64_t K);
void fm_cuda_fp8_quant_tokens(void *ctx, void *t8, const fm_act *a, const int64_t *offsets, int64_t rcap, int64_t E,
                              int64_t C);
void fm_cuda_expert_fp8_gemm(void *ctx, int kind, fm_act *C, float beta, const void *A8, const void *B8,
                             const int64_t *offsets, int64_t rcap, int64_t E, int64_t in, int64_t out);
/* The fused quantizations (fm_backend.h: fp8_quant_dual, fp8_swiglu_bwd_quant,
 * fp8_swiglu_fwd_quant; sm90/gg_sm90_fp8_fused.cu). */
void fm_cuda_fp8_quant_dual(void *ctx, void *a8, void *t8, const fm_act *a, const int64_t *offsets, int64_t rcap,
                            int64_t E, int64_t K);
void fm_cuda_fp8_swiglu_bwd_quant(void *ctx, void *dg8, void *du8, void *dgT8, void *duT8, const fm_act *dout,
                                  const fm_act *gate, const fm_act *up, const int64_t *offsets, int64_t rcap,
                                  int64_t E, int64_t I);
void fm_cuda_fp8_swiglu_fwd_quant(void *ctx, fm_act *out, void *a8, const fm_act *gate, const fm_act *up,
                                  const int64_t *offsets, int64_t rcap, int64_t E, int64_t I);

#ifdef __cplusplus
}
#endif
#endif
