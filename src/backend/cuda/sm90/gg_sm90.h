/* Our grouped expert GEMM for Hopper (sm_90a): warpgroup MMA (wgmma) fed by the tensor memory
 * accelerator (TMA), a persistent tile scheduler that reads each expert's row offset from memory
 * the device reads (device memory, or pinned host memory through unified addressing), so nothing
 * waits for the host. Promoted from the kernel lab's v2 (dev/cuda/grouped_gemm: its validator and
 * timer, bench/RESULTS.md 2026-12-01 session 7 for the H200's rates: its v4, ping-pong consumers
 * and a TMA epilogue); the lab stays the place to develop the next version.
 *
 * The three products of training over E experts; expert e owns rows [offs[e], offs[e+1]) of the
 * row tensors (offs int64 [E+1], offs[0] = 0, nondecreasing, offs[E] <= rcap; any m_e may be 0;
 * one expert may own every row). W is [E, out, in] (Hugging Face layout), bf16 everywhere, fp32
 * accumulation, one rounding to bf16 (nearest even) at the store:
 *   kind 0 (fwd): y_e [m_e,out]  = x_e [m_e,in] W_e^T
 *   kind 1 (dx):  dx_e [m_e,in]  = beta dx_e + dy_e [m_e,out] W_e
 *   kind 2 (dW):  dW_e [out,in]  = beta dW_e + dy_e^T x_e          (empty e with beta 1: untouched)
 * beta 0 overwrites C without reading it.
 *
 * Served shapes (fm_gg_sm90_serves): in and out multiples of 128, 1 <= E <= 256, rcap and E*out
 * below 2^31 (TMA coordinates are int32 rows); every index product is int64, so the row tensors
 * may hold more than 2^31 elements. The caller keeps the cuBLAS path (cuda_gemm.cu) for the rest.
 * Plain C interface; the .cu is compiled for sm_90a only (CMakeLists.txt: flatmoe_cuda_sm90). */
#ifndef FM_GG_SM90_H
#define FM_GG_SM90_H

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fm_gg_problem {
    int kind;            /* 0 fwd, 1 dx, 2 dW */
    const void *A;       /* bf16; kind 0: x [rcap,in]; kinds 1, 2: dy [rcap,out] */
    const void *B;       /* bf16; kinds 0, 1: W [E,out,in]; kind 2: x [rcap,in] */
    void *C;             /* bf16; kind 0: y [rcap,out]; 1: dx [rcap,in]; 2: dW [E,out,in] */
    const int64_t *offs; /* [E+1], readable by the device when the kernel runs (stream order) */
    int E;
    int64_t in, out;     /* the layer's input and output features */
    int64_t rcap;        /* rows of the row tensors (>= offs[E]; the caller's n*k) */
    float beta;          /* kinds 1, 2 (kind 0: ignored, 0) */
} fm_gg_problem;

/* Whether the kernel serves E experts of in -> out features over row tensors of rcap rows. */
bool fm_gg_sm90_serves(int64_t E, int64_t in, int64_t out, int64_t rcap);

/* Whether device `device` can run it (compute capability 9.0: H100, H200). Errors: none (false). */
bool fm_gg_sm90_device_ok(int device);

/* Launches one product p on stream (persistent: sm_count CTAs of 384 threads, one per SM; ~196 KiB
 * of shared memory each). Nothing allocates; the three TMA descriptors are built on the host for
 * each call (cuTensorMapEncodeTiled, through cudaGetDriverEntryPointByVersion: no -lcuda).
 * rcap == 0 launches nothing. Returns cudaSuccess, cudaErrorInvalidValue for a shape it does not
 * serve or a descriptor the driver refuses, cudaErrorNotSupported without the driver entry point,
 * or the launch's error. */
cudaError_t fm_gg_sm90_launch(const fm_gg_problem *p, int sm_count, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
