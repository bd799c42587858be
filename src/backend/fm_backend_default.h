/* The backend of this build: the CPU backend (fm_act = fp32), or the CUDA backend in the bf16
 * build (FM_ACT_BF16, -DFLATMOE_CUDA=ON's flatmoe-cuda). The CLI and the trainer create backends
 * only through these, so the same code serves both builds. */
#ifndef FM_BACKEND_DEFAULT_H
#define FM_BACKEND_DEFAULT_H
#include "fm_backend.h"

/* Many ranks on one node: the CUDA build's backends (and its device-memory queries) use device
 * local_rank mod the number of devices this process sees (*device gets it; may be NULL), instead
 * of device 0; call it before anything creates a CUDA context (the trainer does, with the
 * node-local rank of comm/fm_comm.h's fm_comm_local). Ranks beyond the device count share GPUs
 * round-robin (the mpi communicator serves them; NCCL cannot). The CPU build: nothing (*device =
 * -1). Errors: FM_ERR_UNSUPPORTED (no CUDA device), FM_ERR_ARG (local_rank < 0). */
fm_status fm_backend_default_select_device(int local_rank, int *device);
/* Creates this build's backend from the options (fm_backend_opts.h; NULL: the defaults): the
 * CPU backend (fm_cpu_backend_init_opts) or the CUDA backend on device 0, or the one
 * fm_backend_default_select_device chose (fm_cuda_backend_init). Reads no environment variable.
 * Errors: those of the backend's init. */
fm_status fm_backend_default_init_opts(fm_backend *b, const fm_backend_opts *o);
/* threads: CPU threads (0: all; ignored on CUDA); max_head_dim: the attention's head_dim bound.
 * The other options are the defaults (fm_backend_opts_default; no environment variable is read:
 * a client that honours FLATMOE_* maps them itself, as the CLI's cli_backend_default_init does,
 * and calls fm_backend_default_init_opts). Errors: those of the init. */
fm_status fm_backend_default_init(fm_backend *b, int threads, int64_t max_head_dim);
/* The same with the CPU attention's tile (query rows x key columns; <= 0: the default 64; ignored
 * on CUDA) and the CUDA backend's cuDNN workspace in bytes (0: 64 MiB; ignored on the CPU). A
 * larger cuDNN workspace lets cuDNN serve the attention backward of long GQA sequences that
 * would otherwise fall back to our kernels. */
fm_status fm_backend_default_init_tiles(fm_backend *b, int threads, int64_t max_head_dim, int64_t tile_q,
                                        int64_t tile_kv, size_t gpu_workspace);
void fm_backend_default_free(fm_backend *b);
/* The memory budget a run on this build's backend gets when none is given: on CUDA the device's
 * free memory less FM_CUDA_MEMORY_RESERVE (*budget; *total the device's size); on the CPU 0
 * (no budget: the operating system's memory is not planned). Errors: those of
 * fm_cuda_device_memory. */
fm_status fm_backend_default_memory_budget(size_t *budget, size_t *total);
/* The device's free and total bytes now (CUDA: cudaMemGetInfo, so the whole device's use, the
 * CUDA context and libraries included); both 0 on the CPU. */
fm_status fm_backend_default_device_memory(size_t *free_bytes, size_t *total);
/* Whether this build's device (the one fm_backend_default_init_opts would use) runs the sm90
 * expert GEMM (fm_cuda_expert_sm90_device_ok): 1 yes, 0 no, -1 no device to ask; the CPU build 0.
 * Asked before the backend is created, to resolve FLATMOE_EXPERT_GEMM=auto
 * (plan/fm_expert_choice.h). */
int fm_backend_default_expert_sm90_ok(void);
/* Bytes the backend holds itself (attention tiles, library workspaces), for the planner. */
size_t fm_backend_default_scratch_bytes_tiles(int threads, int64_t max_head_dim, int64_t tile_q, int64_t tile_kv,
                                              size_t gpu_workspace);

#endif
