/* Our FP8 grouped expert GEMM for Hopper (sm_90a) and its quantization kernels: the kernel lab's v3
 * (dev/cuda/grouped_gemm/v3_fp8.cuh, validated on the H200: SNR 29-30 dB against bf16, >= 55 dB
 * against its FP8 reference, every TMA box's alignment checked), promoted. The lab stays the place
 * to develop the next version.
 *
 * Operands are E4M3 codes with fp32 power-of-two scales in backend/fm_fp8_layout.h's byte layouts
 * (one buffer per operand: codes, then scales at the *_scales_at offsets; a weight buffer holds
 * Wq, WqT at fm_fp8_weight_t_at, then the scales), quantized by backend/fm_fp8.h's recipe with
 * its functions (fm_fp8_scale_exp, fm_fp8_ldexp, fm_e4m3_encode; the quantizers use the hardware's
 * E4M3 conversion, proven to give the same bits: gg_sm90_fp8_quant.cu), so the codes and scales
 * equal the CPU backend's bit for bit. Algorithm: DeepSeek-V3 §3.3 (arXiv 2412.19437): 1 x 128 tiles of
 * activations, 128 x 128 blocks of weights, 128 x 1 token tiles for the weight gradient, each
 * 128-deep k-block's partial sum taken by wgmma in fp32 and promoted (times the two scales) into
 * an fp32 total in registers; one rounding to bf16 (nearest even) at the store.
 *
 * The three products over E experts; expert e owns rows [offs[e], offs[e+1]) (offs int64 [E+1],
 * offs[0] = 0, nondecreasing, offs[E] <= rcap; any m_e may be 0, one may own every row), read by
 * the kernels where the device reads them (device memory, or pinned host memory through unified
 * addressing, after its writer in stream order): nothing waits for the host.
 *   kind 0: y_e  [m_e,out] = x_e W_e^T               A8 x's rows operand (K = in), B8 W's weight operand
 *   kind 1: dx_e [m_e,in]  = beta dx_e + dy_e W_e    A8 dy's rows operand (K = out), B8 W's (its WqT)
 *   kind 2: dW_e [out,in]  = beta dW_e + dy_e^T x_e  A8 dy's tokens operand (C = out), B8 x's (C = in)
 * C is bf16 (y, dx [rows, N] row-major; dW [E, out, in]). beta 0 overwrites C without reading it;
 * kind 0 ignores beta (0); kind 2 with m_e = 0 and beta 1 leaves dW_e untouched (no tile).
 *
 * Served shapes (fm_gg8_serves): in, out multiples of 128, 1 <= E <= 256, rcap, kcap =
 * fm_fp8_kcap(rcap, E), E*in and E*out below 2^31 (TMA coordinates are int32). Every pointer
 * 16-byte aligned (TMA; the kernels' vector loads), C 4-byte aligned (16 under the v5 schedules'
 * TMA epilogues). Plain C interface; the .cu is compiled for sm_90a only (CMakeLists.txt:
 * flatmoe_cuda_sm90). Nothing allocates, nothing synchronizes with the host; no state is kept
 * between calls (the persistent grid is the caller's sm_count), so two devices in one process are
 * fine. Every launch returns cudaSuccess, cudaErrorInvalidValue (a shape not served, a misaligned
 * or NULL pointer, kind outside 0..2, a schedule outside fm_gg8_launch's, sm_count < 1, a tensor
 * map the driver refuses), cudaErrorNotSupported (no cuTensorMapEncodeTiled entry point in the
 * driver), cudaErrorInvalidConfiguration (the GEMM kernel was compiled with fewer registers than
 * its setmaxnreg split needs: it would hang), or the launch's error. */
#ifndef FM_GG_SM90_FP8_H
#define FM_GG_SM90_FP8_H

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Whether the GEMM serves E experts of in -> out features over operands of rcap rows. */
bool fm_gg8_serves(int64_t E, int64_t in, int64_t out, int64_t rcap);

/* One product (kind 0, 1, 2 above) on stream: persistent, sm_count CTAs of 384 threads (one
 * producer warpgroup issuing TMA into a ring of stages, two consumer warpgroups of 64 rows), about
 * 200 KiB of shared memory each. A8, B8: fm_fp8_layout.h buffers of rcap rows (kind 2: kcap =
 * fm_fp8_kcap(rcap, E) tokens); the TMA descriptors are built on the host for each call.
 * Kinds 0, 1 with rcap == 0 launch nothing. schedule: the kernel, one of fm_backend_opts.h's
 * fm_fp8_gemm values (FLATMOE_FP8_GEMM, read once at the backend's creation): 0 v3 (the lab's v3,
 * validated on the H200; 6 stages, register epilogue), 1 v5, 2 v5a, 3 v5b, 4 v5c (the lab's v5
 * variants, gg_sm90_fp8_v5.cuh: promotion overlapped with the MMAs and / or a TMA-store epilogue;
 * all validated on the H200 by test_cuda_fp8_codes, 2026-12-02; v5, the fastest, is the default); the same results up to fp32 summation order. Another value is
 * cudaErrorInvalidValue, and so is a C that is not 16-byte aligned under v5, v5a, v5c (their
 * epilogue stores C by TMA). */
cudaError_t fm_gg8_launch(int schedule, int kind, void *C, float beta, const void *A8, const void *B8,
                          const int64_t *offs, int64_t rcap, int64_t E, int64_t in, int64_t out, int sm_count,
                          cudaStream_t stream);

/* W [E, out, in] bf16 -> w8 (the weight layout of fm_fp8_weight_bytes(E, out, in) bytes: Wq
 * [E*out, in], WqT [E*in, out] (each W_e^T, the same codes), scales [E][out/128][in/128]). One
 * 256-thread CTA per 128 x 128 block (gg_sm90_fp8_quant.cu). out, in multiples of 128, 1 <= E <= 256. */
cudaError_t fm_gg8_quant_weight(void *w8, const void *W, int64_t E, int64_t out, int64_t in, cudaStream_t stream);

/* a [offs[E], K] bf16 -> a8 (the rows layout of fm_fp8_rows_bytes(rcap, K) bytes: codes [rcap, K],
 * scales [K/128][fm_fp8_rpad(rcap)]); rows at or past offs[E] (read on the device, clamped to
 * rcap) are not written. Half a warp per 1 x 128 tile, a grid-stride loop over CTAs of 256 threads
 * as many as the device holds at once (sm_count is checked, the grid comes from an occupancy
 * query). K a multiple of 128, 1 <= E <= 256, rcap < 2^31; rcap == 0 launches nothing. */
cudaError_t fm_gg8_quant_rows(void *a8, const void *a, const int64_t *offs, int64_t rcap, int64_t E, int64_t K,
                              int sm_count, cudaStream_t stream);

/* a [offs[E], C] bf16 -> t8 (the tokens layout of fm_fp8_tokens_bytes(kcap, C) bytes, kcap =
 * fm_fp8_kcap(rcap, E): codes [C, kcap], group e's tokens from token 128 pblk[e], its last tile
 * zero past its rows; scales [kcap/128][C]). Tiles past the last group's are not written.
 * Persistent CTAs of 256 threads with 64 KiB of dynamic shared memory, as many as the device holds
 * at once, over the (128-token, 128-channel) blocks of the groups. C a multiple of 128, C/128 <=
 * 65535, 1 <= E <= 256, kcap < 2^31. */
cudaError_t fm_gg8_quant_tokens(void *t8, const void *a, const int64_t *offs, int64_t rcap, int64_t E, int64_t C,
                                cudaStream_t stream);

/* The fused quantizers (gg_sm90_fp8_fused.cu): each gives exactly the bytes of the unfused
 * sequence it replaces, reading its bf16 inputs once. Shapes as fm_gg8_quant_tokens's (the
 * columns a multiple of 128 and C/128 <= 65535, 1 <= E <= 256, kcap < 2^31; swiglu_fwd_quant: as
 * fm_gg8_quant_rows's); every pointer 16-byte aligned and non-NULL; rcap == 0 launches nothing.
 *   fm_gg8_quant_dual: a [offs[E], K] -> a8 (fm_gg8_quant_rows's layout and rows) and t8
 *     (fm_gg8_quant_tokens's, C = K); persistent CTAs of 256 threads, 64 KiB of dynamic shared
 *     memory, over the groups' (128-token, 128-channel) blocks, each block's rows operand and
 *     tokens operand coded from one staged copy.
 *   fm_gg8_swiglu_bwd_quant: dgate, dup of swiglu_bwd (dout, gate, up [offs[E], I]; rounded to
 *     bf16 as it stores them, never stored here) -> their rows operands dg8, du8 (K = I) and tokens
 *     operands dgT8, duT8 (C = I); the same CTAs with three inputs staged (192 KiB: one CTA an SM).
 *   fm_gg8_swiglu_fwd_quant: out [offs[E], I] = swiglu_fwd(gate, up) (bf16, rows at or past
 *     offs[E] not written) and a8 its rows operand; quant_rows' grid-stride design. */
cudaError_t fm_gg8_quant_dual(void *a8, void *t8, const void *a, const int64_t *offs, int64_t rcap, int64_t E,
                              int64_t K, cudaStream_t stream);
cudaError_t fm_gg8_swiglu_bwd_quant(void *dg8, void *du8, void *dgT8, void *duT8, const void *dout, const void *gate,
                                    const void *up, const int64_t *offs, int64_t rcap, int64_t E, int64_t I,
                                    cudaStream_t stream);
cudaError_t fm_gg8_swiglu_fwd_quant(void *out, void *a8, const void *gate, const void *up, const int64_t *offs,
                                    int64_t rcap, int64_t E, int64_t I, int sm_count, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
