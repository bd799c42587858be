/* Byte layouts of the E4M3 operands of the FP8 expert GEMMs (fm_backend.h: fp8_quant_* and
 * expert_fp8_gemm, the fast path of --expert-precision fp8). Pure functions of the shapes, shared
 * by the planner (the bytes of the working set), the model (model/fm_experts_fp8.c: where each
 * buffer starts) and the backends (CPU: cpu_fp8_gemm.c; CUDA: cuda/sm90/gg_sm90_fp8.cu).
 *
 * The recipe is fm_fp8.h's (DeepSeek-V3 §3.3 tiles, power-of-two scales, the same bits: a code
 * decoded (fm_e4m3_decode) times its scale is exactly the value quant_fp8_* gives). Hopper's
 * FP8 wgmma reads both operands K-major only, so every product's operands have their reduction
 * dimension contiguous (the layouts of the kernel lab's v3, dev/cuda/grouped_gemm/v3_fp8.cuh):
 *
 *   rows operand (x or dy for y = x W^T and dx = dy W; K = its columns, a multiple of 128):
 *       codes  [rcap, K] e4m3, row r's tile b = columns 128b .. 128b+127
 *       scales [K/128][rpad] fp32 at fm_fp8_rows_scales_at (scale-major: one tile column's
 *              row scales contiguous, so one TMA box brings a 128-row tile's scales)
 *   weight operand (W [E, out, in], out and in multiples of 128):
 *       Wq  [E*out, in] e4m3 (W's layout), WqT [E*in, out] e4m3 at fm_fp8_weight_t_at (each
 *       W_e^T: the same codes, transposed), scales [E][out/128][in/128] fp32 at
 *       fm_fp8_weight_scales_at (block (n, k) of W_e; W_e^T's block (k, n) is the same one)
 *   tokens operand (x or dy of dW = dy^T x, token-major; C = its channels, a multiple of 128):
 *       codes  [C, kcap] e4m3: channel c's tokens of group e start at token 128 * pblk[e],
 *              pblk[e] = sum_{e' < e} ceil(m_e' / 128), so no 128-token tile mixes two groups;
 *              a group's last tile is zero past its rows
 *       scales [kcap/128][C] fp32 at fm_fp8_tokens_scales_at (tile b's channel scales)
 *       kcap = round_up(rcap, 128) + 128 E bounds the padded tokens (each group pads < 128).
 *
 * rcap is the rows the operand buffers hold (the dispatch's n*k); offsets[E] <= rcap. Scale
 * arrays start at multiples of 256 bytes (TMA wants 16). Every count is int64. */
#ifndef FM_FP8_LAYOUT_H
#define FM_FP8_LAYOUT_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __CUDACC__
#define FM_FP8L_HD static __host__ __device__ __forceinline__
#else
#define FM_FP8L_HD static inline
#endif

#define FM_FP8_LAYOUT_ALIGN 256

FM_FP8L_HD int64_t fm_fp8_round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Scale rows of a rows operand: rcap rounded up to 4 (16-byte scale boxes). */
FM_FP8L_HD int64_t fm_fp8_rpad(int64_t rcap) { return fm_fp8_round_up(rcap, 4); }

/* Padded tokens of a tokens operand of rcap rows over E groups. */
FM_FP8L_HD int64_t fm_fp8_kcap(int64_t rcap, int64_t E) { return fm_fp8_round_up(rcap, 128) + 128 * E; }

FM_FP8L_HD int64_t fm_fp8_rows_scales_at(int64_t rcap, int64_t K) {
    return fm_fp8_round_up(rcap * K, FM_FP8_LAYOUT_ALIGN);
}
FM_FP8L_HD int64_t fm_fp8_rows_bytes(int64_t rcap, int64_t K) {
    return fm_fp8_rows_scales_at(rcap, K) + (K / 128) * fm_fp8_rpad(rcap) * 4;
}

FM_FP8L_HD int64_t fm_fp8_weight_t_at(int64_t E, int64_t out, int64_t in) { return E * out * in; }
FM_FP8L_HD int64_t fm_fp8_weight_scales_at(int64_t E, int64_t out, int64_t in) {
    return fm_fp8_round_up(2 * E * out * in, FM_FP8_LAYOUT_ALIGN);
}
FM_FP8L_HD int64_t fm_fp8_weight_bytes(int64_t E, int64_t out, int64_t in) {
    return fm_fp8_weight_scales_at(E, out, in) + E * (out / 128) * (in / 128) * 4;
}

FM_FP8L_HD int64_t fm_fp8_tokens_scales_at(int64_t kcap, int64_t C) {
    return fm_fp8_round_up(C * kcap, FM_FP8_LAYOUT_ALIGN);
}
FM_FP8L_HD int64_t fm_fp8_tokens_bytes(int64_t kcap, int64_t C) {
    return fm_fp8_tokens_scales_at(kcap, C) + (kcap / 128) * C * 4;
}

/* Whether these layouts take a layer of hidden H and intermediate I: both multiples of 128. */
FM_FP8L_HD bool fm_fp8_layout_serves(int64_t H, int64_t I) { return H > 0 && I > 0 && H % 128 == 0 && I % 128 == 0; }

/* Whether the FP8 code ops take a layer of E experts, hidden H, intermediate I over dispatches of
 * up to rows_max rows (one rule for the planner, the CPU's reference ops and the CUDA kernels):
 * the layouts serve H and I, 1 <= E <= 256, and the rows, the padded tokens and E * max(H, I) stay
 * below 2^31 (the kernels' TMA coordinates are int32). */
FM_FP8L_HD bool fm_fp8_layer_serves(int64_t E, int64_t H, int64_t I, int64_t rows_max) {
    const int64_t M = H > I ? H : I;
    return fm_fp8_layout_serves(H, I) && E >= 1 && E <= 256 && rows_max >= 0 && rows_max < INT32_MAX &&
           fm_fp8_kcap(rows_max, E) < INT32_MAX && E * M < INT32_MAX;
}

/* The working set of one MoE dispatch of rcap rows on this path (model/fm_experts_fp8.c): the
 * three weight operands (gate, up [E,I,H]; down [E,H,I]), one rows operand and two tokens
 * operands of max(H, I) columns (x's, dy's), and dup's rows and tokens operands of I columns
 * (fp8_swiglu_bwd_quant writes dgate's and dup's at once, while x's tokens operand serves both
 * wgrads); each buffer rounded up to `round` bytes (the arena's rounding). */
FM_FP8L_HD int64_t fm_fp8_dev_ws_bytes(int64_t E, int64_t H, int64_t I, int64_t rcap, int64_t round) {
    const int64_t M = H > I ? H : I, kcap = fm_fp8_kcap(rcap, E);
    return 2 * fm_fp8_round_up(fm_fp8_weight_bytes(E, I, H), round) +
           fm_fp8_round_up(fm_fp8_weight_bytes(E, H, I), round) + fm_fp8_round_up(fm_fp8_rows_bytes(rcap, M), round) +
           2 * fm_fp8_round_up(fm_fp8_tokens_bytes(kcap, M), round) + fm_fp8_round_up(fm_fp8_rows_bytes(rcap, I), round) +
           fm_fp8_round_up(fm_fp8_tokens_bytes(kcap, I), round);
}

#endif
