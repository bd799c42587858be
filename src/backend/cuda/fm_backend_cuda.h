/* The CUDA backend: bf16 activations and weights (fm_act = bf16 in this build, FM_ACT_BF16),
 * fp32 accumulation, fp32 router logits/probabilities, log-sum-exps and optimizer state; cuBLAS /
 * cuBLASLt GEMMs; cuDNN fused flash attention (our own tiled kernel where cuDNN refuses a shape);
 * our kernels for everything else. Ops are issued on the compute stream and never wait for the
 * host (results the host needs land in device or pinned memory, read after stream_sync or
 * event_sync, which host_sync_count counts). Every CUDA, cuBLAS and cuDNN call is checked; a
 * failure inside an op does not abort: the context keeps the first one (the call's text, its
 * error, file and line) and `status` returns it; invalid indices found on the device (a top-k id
 * outside [0,E), a target outside [0,V)) are reported by `status` after the next sync point as
 * FM_ERR_ARG. All memory comes from mem_alloc / buffer_alloc at launch (cuda_vmm.h, cudaHostAlloc);
 * library workspaces are sized at init; nothing allocates inside a step. Built with
 * -DFLATMOE_CUDA=ON for sm_90 (H100/H200). */
#ifndef FM_BACKEND_CUDA_H
#define FM_BACKEND_CUDA_H
#include "../fm_backend.h"
#include "../fm_backend_plan.h" /* the workspace arithmetic, shared with the planner */

#ifdef __cplusplus
extern "C" {
#endif

/* Creates a CUDA backend on device `device` (0-based) with four streams (compute, update, copy-in,
 * copy-out; non-blocking), a pool of FM_EVENT_POOL events (each recorded once, so a sync on one
 * returns at once until it is recorded again), a cuBLAS(Lt) handle and a cuDNN handle, a fixed FM_CUDA_LT_WORKSPACE_BYTES cuBLASLt workspace, a cuDNN workspace of
 * o->gpu_workspace bytes (0: FM_CUDA_DEFAULT_WORKSPACE_BYTES; the planner sizes it for a run
 * with fm_cuda_cudnn_workspace_auto), and attention able to serve head_dim <= o->max_head_dim.
 * From o it also takes the attention path and its verbosity, the expert-GEMM strategy and
 * profiling (fm_backend_opts.h; the CPU fields are ignored); o NULL: fm_backend_opts_default().
 * The backend reads no environment variable. Errors: FM_ERR_UNSUPPORTED (no CUDA device, or not
 * sm_90), FM_ERR_NOMEM (a workspace), FM_ERR_ARG (device < 0 or absent, max_head_dim < 1, an
 * option outside its enum); each message names the failing call or value. */
fm_status fm_cuda_backend_init(fm_backend *b, int device, const fm_backend_opts *o);
void fm_cuda_backend_free(fm_backend *b);

/* Free and total bytes of device `device`'s memory now (cudaMemGetInfo). Errors:
 * FM_ERR_UNSUPPORTED (no CUDA device or driver), naming the call. */
fm_status fm_cuda_device_memory(int device, size_t *free_bytes, size_t *total_bytes);

/* Bytes of device memory the backend holds itself (workspaces, scratch), for the planner:
 * fm_cuda_backend_workspace_bytes_for (fm_backend_plan.h, the plan-facing arithmetic). */
size_t fm_cuda_backend_workspace_bytes(int64_t max_head_dim, size_t cudnn_workspace_bytes);

/* ---- accessors for code that orders its own CUDA work with the backend's (the nccl
 * communicator, comm/fm_comm_nccl.c). They take any fm_backend and answer "not CUDA" for others,
 * so callers need no cast. */

/* The cudaStream_t of `stream` (FM_STREAM_OPS: the op stream now, compute or update), as void *
 * so that this header needs no cuda_runtime.h; NULL when b is not a CUDA backend. */
void *fm_cuda_backend_stream(const fm_backend *b, fm_stream stream);
/* The CUDA device index b was created on; -1 when b is not a CUDA backend. */
int fm_cuda_backend_device(const fm_backend *b);
/* Sets (hook non-NULL) or clears the host-wait watchdog: while set, every host wait of the
 * backend (copy, event_sync, stream_sync, sync) first calls hook(arg, &idle); unless it sets idle
 * (nothing of the hook's owner is pending on the device: the ordinary blocking wait follows), the
 * wait polls the stream or event instead of blocking and calls the hook between polls
 * (sched_yield for the first second, then every 1 ms). A non-OK return ends the wait and becomes
 * the backend's sticky error (status returns it, with the hook's fm_errmsg), so the caller's
 * existing sync points fail instead of hanging on device work that will never finish (a
 * collective whose peer died). The hook must not wait for the device. Returns false (nothing
 * set) when b is not a CUDA backend. */
bool fm_cuda_backend_set_wait_hook(const fm_backend *b, fm_status (*hook)(void *arg, bool *idle), void *arg);
/* The number of CUDA devices this process sees (cudaGetDeviceCount). Errors: FM_ERR_UNSUPPORTED
 * (no driver or device; *count = 0), naming the call. */
fm_status fm_cuda_device_count(int *count);
/* Whether device `device` can run the sm90 expert GEMM (FLATMOE_EXPERT_GEMM=sm90: compute
 * capability 9.0 and this build's sm_90a kernel; backend/cuda/sm90/gg_sm90.h
 * fm_gg_sm90_device_ok): 1 yes, 0 no, -1 no such device (no driver, or device out of range).
 * Creates no context. Used by plan/fm_expert_choice.h's callers before a backend exists. */
int fm_cuda_expert_sm90_device_ok(int device);

#ifdef __cplusplus
}
#endif
#endif
