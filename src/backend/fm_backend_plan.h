/* What each backend holds for itself, for the planner (DESIGN.md §4): the plan-facing description
 * of the backends' workspaces. Plain C, no CUDA headers, compiled into every build, so a GPU run
 * can be planned from the CPU build and the reverse. The CUDA backend sizes its workspaces and
 * splits its cuDNN attention calls with these same functions (fm_backend_cuda.h includes this
 * header), so the plan and the backend cannot drift. */
#ifndef FM_BACKEND_PLAN_H
#define FM_BACKEND_PLAN_H

#include "../core/fm_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the CUDA backend's fixed workspaces (bytes) ----------------------------------------------- */
#define FM_CUDA_DEFAULT_WORKSPACE_BYTES ((size_t)64 << 20) /* cuDNN workspace when none is planned */
#define FM_CUDA_LT_WORKSPACE_BYTES ((size_t)32 << 20)      /* cuBLAS/cuBLASLt (NVIDIA's Hopper advice) */
#define FM_CUDA_SCRATCH_BYTES ((size_t)16 << 20)           /* reductions, grouped-GEMM pointers */
#define FM_CUDA_CUDNN_WORKSPACE_CAP ((size_t)1 << 30)      /* fm_cuda_cudnn_workspace_auto's ceiling */
/* What a run leaves free of the device's memory when the planner takes its budget from the
 * device: the CUDA context's later growth, library kernels loaded on first use, cuDNN plans. */
#define FM_CUDA_MEMORY_RESERVE ((size_t)3 << 29) /* 1.5 GiB */

/* Bytes of device memory a CUDA backend with a cuDNN workspace of cudnn_workspace_bytes (0: the
 * default 64 MiB) holds: cuBLASLt + cuDNN workspaces + the reduction scratch. */
size_t fm_cuda_backend_workspace_bytes_for(size_t cudnn_workspace_bytes);

/* cuDNN workspace bytes one fused-attention call over b batch elements and h query heads of
 * T tokens needs (grp = query heads per kv head): the forward 64 KiB; the backward its fp32 dQ
 * accumulator b*h*T*hd*4 and row sums b*h*T*4 (256-byte aligned), with GQA (grp > 1) the
 * expanded fp32 dK/dV b*h*T*hd*4, plus 1 MiB for the rest of the plan's workspace. A call whose
 * need exceeds the workspace is split into chunks (batch elements, then kv-head groups) that fit
 * (cuda_attention_cudnn.cu); below one kv group it falls back to flatmoe's own kernels. */
size_t fm_cuda_attention_chunk_need(bool bwd, int64_t b, int64_t h, int64_t T, int64_t hd, int64_t grp);

/* Splits an attention call into chunks whose cuDNN tensors fit `cap` bytes of workspace: the
 * whole call, else Bc batch elements with every head (Bc the largest divisor of B that fits),
 * else one batch element and nkvc kv heads with their query heads (nkvc the largest divisor of
 * nkv that fits). false: not even one kv group fits. Used by the attention and the planner. */
bool fm_cuda_attention_pick_chunks(size_t cap, bool bwd, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                                   int64_t *Bc, int64_t *nkvc);

/* The cuDNN workspace the planner gives a run of micro-batch B, T tokens, nh query and nkv kv
 * heads of head_dim hd: the need of the chunk fm_cuda_attention_pick_chunks picks under
 * FM_CUDA_CUDNN_WORKSPACE_CAP, at least one kv group's need (so cuDNN always serves the
 * backward) and at least FM_CUDA_DEFAULT_WORKSPACE_BYTES, rounded up to whole MiB. E.g. OLMoE
 * (16 heads of 128): 64 MiB at 4K tokens, 130 MiB at 16K, 517 MiB at 64K (whole), 128K (8 heads
 * a chunk) and 256K (4 heads). A config with nkv < 1 or nh % nkv != 0 is planned as nkv = nh. */
size_t fm_cuda_cudnn_workspace_auto(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd);

/* Whether the CUDA backend's sm90 grouped expert GEMM (FLATMOE_EXPERT_GEMM=sm90;
 * backend/cuda/sm90/gg_sm90.h, whose launch checks the same) serves an MoE layer of E experts,
 * hidden H and intermediate I over dispatches of up to rows_max rows: both products (H -> I and
 * I -> H) need multiples of 128 of at least 128, 1 <= E <= 256, and int32 TMA coordinates (rows_max
 * and E * max(H, I) below 2^31). Plain arithmetic, so the planner on the CPU build answers as the
 * backend does. */
bool fm_cuda_sm90_expert_gemm_serves(int64_t E, int64_t H, int64_t I, int64_t rows_max);

/* ---- the descriptor ------------------------------------------------------------------------- */

typedef enum fm_backend_kind { FM_BACKEND_KIND_CPU = 0, FM_BACKEND_KIND_CUDA = 1 } fm_backend_kind;

/* The run shape and options that size a backend's workspaces. */
typedef struct fm_backend_plan_req {
    int64_t B, T;          /* micro-batch and tokens per sequence */
    int64_t nh, nkv, hd;   /* query heads, kv heads, head_dim */
    int threads;           /* CPU: threads (0: OpenMP's default) */
    int64_t tile_q, tile_kv; /* CPU: attention tile (0: 64) */
    size_t gpu_workspace;  /* CUDA: the cuDNN workspace in bytes, 0: sized for the shape */
} fm_backend_plan_req;

/* What a backend holds, bytes. */
typedef struct fm_backend_plan_info {
    bool known;             /* false: this build cannot size that backend (the CPU backend's tiles
                             * asked of the CUDA build, which carries no CPU backend); all else 0 */
    size_t cudnn_workspace; /* CUDA: the cuDNN workspace, as given or fm_cuda_cudnn_workspace_auto */
    size_t lt_workspace;    /* CUDA: cuBLAS/cuBLASLt, FM_CUDA_LT_WORKSPACE_BYTES */
    size_t scratch;         /* CUDA: reduction scratch, FM_CUDA_SCRATCH_BYTES */
    size_t attention_tiles; /* CPU: every thread's flash-attention tiles */
    size_t total;           /* all of the above: the plan's "attention tiles" live set */
    size_t memory_reserve;  /* CUDA: left free of a device budget, FM_CUDA_MEMORY_RESERVE; CPU 0 */
} fm_backend_plan_info;

/* Fills *out for backend `kind` and the run *r. Never fails (a shape the backend would refuse is
 * the init's or the shape check's business). */
void fm_backend_plan_workspaces(fm_backend_kind kind, const fm_backend_plan_req *r, fm_backend_plan_info *out);

#ifdef __cplusplus
}
#endif
#endif
