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
 * cuDNN handle, fixed workspaces of `workspace_bytes` (0: 64 MiB) for cuBLASLt and cuDNN, and
 * attention able to serve head_dim <= max_head_dim. Errors: FM_ERR_UNSUPPORTED (no CUDA device,
 * or not sm_90), FM_ERR_NOMEM (a workspace), FM_ERR_ARG; each message names the failing call. */
fm_status fm_cuda_backend_init(fm_backend *b, int device, int64_t max_head_dim, size_t workspace_bytes);
void fm_cuda_backend_free(fm_backend *b);

/* Bytes of device memory the backend holds itself (workspaces, scratch), for the planner. */
size_t fm_cuda_backend_workspace_bytes(int64_t max_head_dim, size_t workspace_bytes);

/* The same arithmetic as an inline, for planning a GPU run from any build: cuBLASLt and cuDNN
 * workspaces of workspace_bytes each (0: 64 MiB) and a 16 MiB reduction scratch. */
#define FM_CUDA_DEFAULT_WORKSPACE_BYTES ((size_t)64 << 20)
#define FM_CUDA_SCRATCH_BYTES_PUBLIC ((size_t)16 << 20)
static inline size_t fm_cuda_backend_workspace_bytes_for(size_t workspace_bytes) {
    return 2 * (workspace_bytes ? workspace_bytes : FM_CUDA_DEFAULT_WORKSPACE_BYTES) + FM_CUDA_SCRATCH_BYTES_PUBLIC;
}

#ifdef __cplusplus
}
#endif
#endif
