/* Backend options: everything a backend is created with (fm_cpu_backend_init_opts,
 * fm_cuda_backend_init, fm_backend_default_init_opts), and the engine's strategy options that
 * travel with them (the EP chunk schedule, the calibration folder). No library code reads the
 * environment (DESIGN.md §3): the CLI maps the FLATMOE_* variables onto these fields
 * (fm_backend_opts_from_env, src/cli/cli_env.c) through fm_backend_opts_set below, which parses
 * one variable's value. Fields a backend has no use for are ignored by it (the CPU ignores the
 * CUDA fields and the reverse). Plain C, no CUDA headers. */
#ifndef FM_BACKEND_OPTS_H
#define FM_BACKEND_OPTS_H

#include "../core/fm_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which implementation serves the CUDA attention (cuda_attention.h). */
typedef enum fm_attention_path {
    FM_ATTENTION_AUTO = 0,     /* cuDNN's fused attention where it serves the shape, else ours */
    FM_ATTENTION_FALLBACK = 1, /* always our kernels (bitwise deterministic; cuDNN's backward is not) */
    FM_ATTENTION_CUDNN = 2,    /* cuDNN where it serves the shape, else ours (today the same as auto) */
} fm_attention_path;

/* How the CUDA backend runs a dispatch's expert GEMMs (expert_linear_fwd/bwd in fm_backend.h). */
typedef enum fm_expert_gemm {
    FM_EXPERT_GEMM_AUTO = 0,    /* the trainer and `plan` resolve it before the backend is created
                                 * (plan/fm_expert_choice.h): sm90 where the calibration table
                                 * projects it faster, else cublas; a backend created with auto
                                 * runs cublas */
    FM_EXPERT_GEMM_LOOP = 1,    /* one cuBLAS call per expert */
    FM_EXPERT_GEMM_GROUPED = 2, /* every expert in the grouped call */
    FM_EXPERT_GEMM_SM90 = 3,    /* our sync-free wgmma kernel (backend/cuda/sm90/gg_sm90.h) where it
                                 * serves the shape: the expert offsets stay on the device, so a
                                 * dispatch does not wait for the host; cuBLAS (cublas) elsewhere */
    FM_EXPERT_GEMM_CUBLAS = 4,  /* one grouped cuBLAS call, experts of >= 1024 rows in calls of their
                                 * own (what auto ran before it could choose sm90) */
} fm_expert_gemm;

/* The schedule of the CUDA backend's FP8 grouped GEMM (backend/cuda/sm90/gg_sm90_fp8.h,
 * fm_gg8_launch's schedule): the kernel lab's versions (dev/cuda/grouped_gemm/README.md). */
typedef enum fm_fp8_gemm {
    FM_FP8_GEMM_V3 = 0,  /* the lab's v3 (validated on the H200, 2026-12-01) */
    FM_FP8_GEMM_V5 = 1,  /* v5: promotion overlapped with the next k-block's MMAs + a TMA-store
                          * epilogue with one C buffer: the default (validated on the H200,
                          * 2026-12-02, and the fastest there: bench/RESULTS.md, session 11) */
    FM_FP8_GEMM_V5A = 2, /* v5a: v5's TMA-store epilogue alone (v3's promotion) */
    FM_FP8_GEMM_V5B = 3, /* v5b: v5's overlapped promotion alone (v3's register epilogue) */
    FM_FP8_GEMM_V5C = 4, /* v5c: v5 with two C buffers (the old C loads a tile early: dW) */
} fm_fp8_gemm;

typedef struct fm_backend_opts {
    int threads;                 /* CPU: OpenMP and BLAS threads, >= 0 (0: OpenMP's default) */
    int64_t max_head_dim;        /* both: attention serves head_dim <= this, >= 1 */
    int64_t tile_q, tile_kv;     /* CPU: attention tile, query rows x key columns, each 0 (the default
                                  * 64) or in [1, 4096] */
    size_t gpu_workspace;        /* CUDA: cuDNN workspace in bytes (0: FM_CUDA_DEFAULT_WORKSPACE_BYTES,
                                  * 64 MiB; the planner sizes it with fm_cuda_cudnn_workspace_auto) */
    fm_attention_path attention; /* CUDA: FLATMOE_ATTENTION */
    bool attention_verbose;      /* CUDA: print cuDNN's plan choices and refusals to stderr
                                  * (FLATMOE_ATTENTION_VERBOSE) */
    fm_expert_gemm expert_gemm;  /* CUDA: FLATMOE_EXPERT_GEMM */
    fm_fp8_gemm fp8_gemm;        /* CUDA: FLATMOE_FP8_GEMM (the FP8 expert GEMM's schedule) */
    bool profile;                /* both: time each phase (prof_mark / prof_collect; FLATMOE_PROFILE) */
    int update_blocks;           /* CUDA: FLATMOE_UPDATE_BLOCKS, >= 0. 0 (the default): the update stream
                                  * (the optimizer overlap's, FM_STREAM_UPDATE) runs at the compute
                                  * stream's priority and AdamW launches its usual grid. n > 0: the
                                  * compute stream gets the device's highest priority, the update stream
                                  * its lowest, and an AdamW launched on the update stream uses at most n
                                  * blocks of 256 threads, so the next step's forward is not starved of
                                  * multiprocessors by the update it overlaps. The same elements get the
                                  * same arithmetic either way: the weights are bit-identical. */
    int ep_schedule;             /* engine: FLATMOE_EP_SCHEDULE, the expert-parallel MoE's chunk schedule
                                  * (bounded/fm_moe_ep.h's fm_moe_ep_schedule, same values: 0 auto, 1
                                  * serial, 2 pipelined); -1: the variable held another value, which the
                                  * operator refuses at its first chunk on every rank of the group (a
                                  * run without --ep never asks) */
    bool cpu_fp8_codes;          /* CPU: the test hook FLATMOE_TEST_FP8_CODES=1 (read into
                                  * this option by the CLI): the CPU backend serves the FP8 code path with its C
                                  * reference of the E4M3 code GEMMs, as an sm_90 GPU does */
    bool vmm;                    /* CUDA: FLATMOE_CUDA_VMM (default true): device memory from the
                                  * VMM driver API where the device has it, so that sleep gives it back
                                  * (backend/cuda/cuda_vmm.h); false: cudaMalloc, sleep keeps it */
    const char *calib_dir;       /* engine: FLATMOE_CALIB_DIR, a folder searched first for the
                                  * calibration table <kind>.json (plan/fm_calib.h, fm_calib_find);
                                  * NULL: none. Not owned: the string must outlive the options. */
} fm_backend_opts;

/* threads 0, max_head_dim 128, tiles 0 x 0 (64 x 64), gpu_workspace 0 (64 MiB), attention auto,
 * not verbose, expert GEMMs auto, FP8 GEMM v5, no profiling, update_blocks 0, EP schedule auto,
 * no CPU FP8 codes, VMM on, no calibration folder. */
fm_backend_opts fm_backend_opts_default(void);

/* The variables fm_backend_opts_set takes, in the order the CLI applies them (NULL-terminated):
 *   FLATMOE_PROFILE            0|1 (also false|true, off|on, no|yes)   -> profile
 *   FLATMOE_ATTENTION          auto|cudnn|fallback (flash, ours: fallback) -> attention
 *   FLATMOE_ATTENTION_VERBOSE  0|1 (as FLATMOE_PROFILE)                -> attention_verbose
 *   FLATMOE_EXPERT_GEMM        auto|cublas|loop|grouped|sm90            -> expert_gemm
 *   FLATMOE_FP8_GEMM           v3|v5|v5a|v5b|v5c                        -> fp8_gemm
 *   FLATMOE_UPDATE_BLOCKS      an integer in [0, 1048576]               -> update_blocks
 *   FLATMOE_EP_SCHEDULE        auto|serial|pipelined (another value: -1) -> ep_schedule
 *   FLATMOE_TEST_FP8_CODES     0|1                                      -> cpu_fp8_codes
 *   FLATMOE_CUDA_VMM           0|1 (as FLATMOE_PROFILE)                -> vmm
 *   FLATMOE_CALIB_DIR          a folder (the pointer is kept)           -> calib_dir */
extern const char *const fm_backend_opts_vars[];

/* Sets the field variable `name` maps to (the table above) from its value `value`; a NULL or
 * empty value keeps the field. The value is parsed here, never read from the environment: the
 * CLI passes the variable's value (src/cli/cli_env.c's fm_backend_opts_from_env), a test its own.
 * Errors: FM_ERR_ARG for a value outside the forms above, naming the variable, the value found
 * and the values accepted (FLATMOE_EP_SCHEDULE excepted: -1, refused by the operator); FM_ERR_ARG
 * for a name not in the table. */
fm_status fm_backend_opts_set(fm_backend_opts *o, const char *name, const char *value);

/* "auto", "cudnn", "fallback"; "auto", "loop", "grouped", "sm90", "cublas"; "v3", "v5", "v5a",
 * "v5b", "v5c"; "?" outside the enums. */
const char *fm_attention_path_name(fm_attention_path p);
const char *fm_expert_gemm_name(fm_expert_gemm g);
const char *fm_fp8_gemm_name(fm_fp8_gemm g);

/* Enough for fm_backend_opts_json's object with any field values. */
#define FM_BACKEND_OPTS_JSON_MAX 384

/* Writes the options as one JSON object (no newline, NUL-terminated) into buf[cap], e.g.
 *   {"threads":0,"max_head_dim":128,"tile_q":0,"tile_kv":0,"gpu_workspace":0,"attention":"auto",
 *    "attention_verbose":false,"expert_gemm":"auto","fp8_gemm":"v5","profile":false,"update_blocks":0,
 *    "vmm":true}
 * for a metrics.jsonl line (`,"backend_opts":` followed by it). Errors: FM_ERR_ARG when it does
 * not fit (buf then holds ""; FM_BACKEND_OPTS_JSON_MAX always fits). */
fm_status fm_backend_opts_json(const fm_backend_opts *o, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
