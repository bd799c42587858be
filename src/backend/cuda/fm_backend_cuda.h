/* The CUDA backend: bf16 activations and weights (fm_act = bf16 in this build, FM_ACT_BF16),
 * fp32 accumulation, fp32 router logits/probabilities, log-sum-exps and optimizer state; cuBLAS /
 * cuBLASLt GEMMs; cuDNN fused flash attention (our own tiled kernel where cuDNN refuses a shape);
 * our kernels for everything else. Every CUDA, cuBLAS and cuDNN call is checked; a failure aborts
 * with the call's text, file and line. All memory comes from mem_alloc at launch (cudaMalloc);
 * library workspaces are sized at init; nothing allocates inside a step. Built with
 * -DFLATMOE_CUDA=ON for sm_90 (H100/H200). */
#ifndef FM_BACKEND_CUDA_H
#define FM_BACKEND_CUDA_H
#include "../fm_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Creates a CUDA backend on device `device` (0-based) with one stream, a cuBLAS(Lt) handle and a
 * cuDNN handle, a fixed FM_CUDA_LT_WORKSPACE_BYTES cuBLASLt workspace, a cuDNN workspace of
 * `cudnn_workspace_bytes` (0: FM_CUDA_DEFAULT_WORKSPACE_BYTES; the planner sizes it for a run
 * with fm_cuda_cudnn_workspace_auto), and attention able to serve head_dim <= max_head_dim.
 * Errors: FM_ERR_UNSUPPORTED (no CUDA device, or not sm_90), FM_ERR_NOMEM (a workspace),
 * FM_ERR_ARG; each message names the failing call. */
fm_status fm_cuda_backend_init(fm_backend *b, int device, int64_t max_head_dim, size_t cudnn_workspace_bytes);
void fm_cuda_backend_free(fm_backend *b);

/* Free and total bytes of device `device`'s memory now (cudaMemGetInfo). Errors:
 * FM_ERR_UNSUPPORTED (no CUDA device or driver), naming the call. */
fm_status fm_cuda_device_memory(int device, size_t *free_bytes, size_t *total_bytes);

/* What a run leaves free of the device's memory when the planner takes its budget from the
 * device: the CUDA context's later growth, library kernels loaded on first use, cuDNN plans. */
#define FM_CUDA_MEMORY_RESERVE ((size_t)3 << 29) /* 1.5 GiB */

/* Bytes of device memory the backend holds itself (workspaces, scratch), for the planner. */
size_t fm_cuda_backend_workspace_bytes(int64_t max_head_dim, size_t cudnn_workspace_bytes);

/* The same arithmetic as inlines, for planning a GPU run from any build. */
#define FM_CUDA_DEFAULT_WORKSPACE_BYTES ((size_t)64 << 20)  /* cuDNN workspace when none is planned */
#define FM_CUDA_LT_WORKSPACE_BYTES ((size_t)32 << 20)       /* cuBLAS/cuBLASLt (NVIDIA's Hopper advice) */
#define FM_CUDA_SCRATCH_BYTES_PUBLIC ((size_t)16 << 20)
#define FM_CUDA_CUDNN_WORKSPACE_CAP ((size_t)1 << 30)       /* the auto size's ceiling */
static inline size_t fm_cuda_backend_workspace_bytes_for(size_t cudnn_workspace_bytes) {
    return FM_CUDA_LT_WORKSPACE_BYTES + (cudnn_workspace_bytes ? cudnn_workspace_bytes : FM_CUDA_DEFAULT_WORKSPACE_BYTES) +
           FM_CUDA_SCRATCH_BYTES_PUBLIC;
}

/* cuDNN workspace bytes one fused-attention call over b batch elements and h query heads of
 * T tokens needs (grp = query heads per kv head): the forward 64 KiB; the backward its fp32 dQ
 * accumulator b*h*T*hd*4 and row sums b*h*T*4 (256-byte aligned), with GQA (grp > 1) the
 * expanded fp32 dK/dV b*h*T*hd*4, plus 1 MiB for the rest of the plan's workspace. A call whose
 * need exceeds the workspace is split into chunks (batch elements, then kv-head groups) that fit
 * (cuda_attention.cu); below one kv group it falls back to flatmoe's own kernels. */
static inline size_t fm_cuda_attention_chunk_need(bool bwd, int64_t b, int64_t h, int64_t T, int64_t hd, int64_t grp) {
    if (!bwd) return (size_t)64 << 10;
    const size_t acc = (size_t)(b * h * T * hd) * 4, rows = (size_t)(b * h * T) * 4;
    size_t e = ((acc + 255) & ~(size_t)255) + ((rows + 255) & ~(size_t)255);
    if (grp > 1) e += acc;
    return e + ((size_t)1 << 20);
}

/* Splits an attention call into chunks whose cuDNN tensors fit `cap` bytes of workspace: the
 * whole call, else Bc batch elements with every head (Bc the largest divisor of B that fits),
 * else one batch element and nkvc kv heads with their query heads (nkvc the largest divisor of
 * nkv that fits). false: not even one kv group fits. Used by the attention and the planner. */
static inline bool fm_cuda_attention_pick_chunks(size_t cap, bool bwd, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                                                 int64_t hd, int64_t *Bc, int64_t *nkvc) {
    const int64_t grp = nh / nkv;
    for (int64_t b = B; b >= 1; b--)
        if (B % b == 0 && fm_cuda_attention_chunk_need(bwd, b, nh, T, hd, grp) <= cap) {
            *Bc = b, *nkvc = nkv;
            return true;
        }
    for (int64_t k = nkv - 1; k >= 1; k--)
        if (nkv % k == 0 && fm_cuda_attention_chunk_need(bwd, 1, k * grp, T, hd, grp) <= cap) {
            *Bc = 1, *nkvc = k;
            return true;
        }
    return false;
}

/* The cuDNN workspace the planner gives a run of micro-batch B, T tokens, nh query and nkv kv
 * heads of head_dim hd: the need of the chunk fm_cuda_attention_pick_chunks picks under
 * FM_CUDA_CUDNN_WORKSPACE_CAP, at least one kv group's need (so cuDNN always serves the
 * backward) and at least FM_CUDA_DEFAULT_WORKSPACE_BYTES, rounded up to whole MiB. E.g. OLMoE
 * (16 heads of 128): 64 MiB at 4K tokens, 130 MiB at 16K, 517 MiB at 64K (whole), 128K (8 heads
 * a chunk) and 256K (4 heads). */
static inline size_t fm_cuda_cudnn_workspace_auto(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
    if (nkv < 1 || nh % nkv != 0) nkv = nh; /* a config the parser refuses; plan as without GQA */
    const int64_t grp = nh / nkv;
    int64_t Bc = 1, kc = 1;
    size_t need = fm_cuda_attention_pick_chunks(FM_CUDA_CUDNN_WORKSPACE_CAP, true, B, T, nh, nkv, hd, &Bc, &kc)
                      ? fm_cuda_attention_chunk_need(true, Bc, kc * grp, T, hd, grp)
                      : fm_cuda_attention_chunk_need(true, 1, grp, T, hd, grp);
    if (need < FM_CUDA_DEFAULT_WORKSPACE_BYTES) need = FM_CUDA_DEFAULT_WORKSPACE_BYTES;
    const size_t mib = (size_t)1 << 20;
    return (need + mib - 1) / mib * mib;
}

#ifdef __cplusplus
}
#endif
#endif
