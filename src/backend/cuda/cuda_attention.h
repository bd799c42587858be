/* Test and diagnostics hooks of the CUDA attention (cuda_attention.cu); plain C, no CUDA headers.
 * `ctx` is the CUDA backend's context (fm_backend.ctx of fm_cuda_backend_init).
 *
 * Two implementations serve attention_fwd / attention_bwd:
 *   "cudnn"  cuDNN's fused flash attention, driven through the cuDNN 9 graph (backend) API, one
 *            plan per shape built at the first call of that shape and cached; used when cuDNN
 *            accepts the shape (hd % 8 == 0, 16-byte aligned tensors) and its tensors fit the
 *            backend's fixed cuDNN workspace ("cudnn-chunked": the call was split over batch
 *            elements or kv-head groups so that the backward's fp32 dQ accumulator fits);
 *   "flash"  our own tiled tensor-core FlashAttention-2 kernels (cuda_attention_fwd.cu,
 *            cuda_attention_bwd.cu): deterministic, hd even and <= 128;
 *   "simple" our scalar kernels: any hd (slow), used when "flash" cannot serve the shape.
 * The attention option of the backend's init (fm_backend_opts.h: auto | cudnn | fallback;
 * FLATMOE_ATTENTION through fm_backend_opts_from_env) picks the path (default: cudnn where it
 * can, else ours); attention_verbose (FLATMOE_ATTENTION_VERBOSE=1) prints why cuDNN refused a
 * shape. The cuDNN path (cuda_attention_cudnn.cu) is compiled unless FM_ATTENTION_NO_CUDNN is
 * defined. */
#ifndef FM_CUDA_ATTENTION_H
#define FM_CUDA_ATTENTION_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fm_cuda_att_path {
    FM_CUDA_ATT_AUTO = 0,     /* cuDNN where it serves the shape, else ours */
    FM_CUDA_ATT_FALLBACK = 1, /* always ours */
    FM_CUDA_ATT_CUDNN = 2,    /* cuDNN where it serves the shape, else ours (same as AUTO) */
} fm_cuda_att_path;

void fm_cuda_attention_set_path(void *ctx, fm_cuda_att_path path);
fm_cuda_att_path fm_cuda_attention_get_path(void *ctx);
/* "cudnn", "cudnn-chunked", "flash" or "simple": what served the last forward (backward = false) or backward
 * call; "" before the first. */
const char *fm_cuda_attention_last(void *ctx, bool backward);
/* Why cuDNN last refused a shape ("" if it never did), e.g. the failing call and cuDNN's message. */
const char *fm_cuda_attention_cudnn_note(void *ctx);
/* Bytes of cuDNN workspace (fm_cuda_backend_init's workspace_bytes) with which cuDNN serves the
 * backward of this shape in one call (whole = true), or at all, in its smallest chunks (one batch
 * element, one kv head and its nh/nkv query heads; whole = false): the fp32 dQ accumulator and
 * row sums, with GQA also the per-query-head bf16 dK and dV, plus 1 MiB. With less, the backward
 * runs on our kernels (about 4.5x slower on an H200). The forward needs 64 KiB. 0 when the cuDNN
 * path is compiled out. E.g. T = 16384, hd = 128: 9 MiB for MHA, 129 MiB for 8 query heads per
 * kv head (whole: 130 MiB for nh = 16 MHA). */
size_t fm_cuda_attention_cudnn_workspace(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, bool whole);
/* cuDNN's runtime version (e.g. 91900), 0 when the cuDNN path is compiled out. */
long fm_cuda_attention_cudnn_version(void);

#ifdef __cplusplus
}
#endif
#endif
