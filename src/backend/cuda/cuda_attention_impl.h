/* Internals of the CUDA attention (C++ only): the launchers of our own kernels in
 * cuda_attention_fwd.cu and cuda_attention_bwd.cu, called by the dispatcher in cuda_attention.cu.
 *
 * Layouts are fm_backend.h's: q, out, dq, dout [B,T,nh,hd]; k, v, dk, dv [B,T,nkv,hd];
 * lse [B,nh,T] (natural log of the scaled scores' sum of exponentials). Causal, grouped-query
 * (query head h reads kv head h / (nh/nkv)), scale 1/sqrt(hd). kv_start [B*T] device int32 or
 * NULL: query (b,t) sees keys kv_start[b*T+t] .. t (packed documents, fm_backend.h). */
#ifndef FM_CUDA_ATTENTION_IMPL_H
#define FM_CUDA_ATTENTION_IMPL_H

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

/* Raises the dynamic shared-memory limit of the tiled kernels (once, at init): the forward's
 * (cuda_attention_fwd.cu), then fm_att_flash_bwd_setup's (the backward's, cuda_attention_bwd.cu). */
cudaError_t fm_att_flash_setup(void);
cudaError_t fm_att_flash_bwd_setup(void);

/* Which of our kernels serves a shape: 1 = the tiled tensor-core kernels (hd even, hd <= 128,
 * 4-byte aligned pointers), 0 = the scalar kernels (anything else). */
int fm_att_flash_ok(int64_t hd, const void *const *ptrs, int nptrs);

/* Forward: out and lse assigned. */
void fm_att_flash_fwd(cudaStream_t s, __nv_bfloat16 *out, float *lse, const __nv_bfloat16 *q,
                      const __nv_bfloat16 *k, const __nv_bfloat16 *v, int64_t B, int64_t T,
                      int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start);
/* Backward: dq, dk, dv assigned, deterministically (no atomics): one block per (b, kv head,
 * key tile) owns its dk, dv rows over the whole query-head group; one block per (b, head,
 * query tile) owns its dq rows. */
void fm_att_flash_bwd(cudaStream_t s, __nv_bfloat16 *dq, __nv_bfloat16 *dk, __nv_bfloat16 *dv,
                      const __nv_bfloat16 *dout, const __nv_bfloat16 *q, const __nv_bfloat16 *k,
                      const __nv_bfloat16 *v, const __nv_bfloat16 *out, const float *lse,
                      int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start);

/* The scalar kernels (any hd, any alignment; slow, O(T^2 hd) without tensor cores). */
void fm_att_simple_fwd(cudaStream_t s, __nv_bfloat16 *out, float *lse, const __nv_bfloat16 *q,
                       const __nv_bfloat16 *k, const __nv_bfloat16 *v, int64_t B, int64_t T,
                       int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start);
void fm_att_simple_bwd(cudaStream_t s, __nv_bfloat16 *dq, __nv_bfloat16 *dk, __nv_bfloat16 *dv,
                       const __nv_bfloat16 *dout, const __nv_bfloat16 *q, const __nv_bfloat16 *k,
                       const __nv_bfloat16 *v, const __nv_bfloat16 *out, const float *lse,
                       int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start);

#endif
