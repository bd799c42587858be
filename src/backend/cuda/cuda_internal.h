/* Internals shared by the CUDA backend's files (CUDA C, not a public header): the context, the
 * checked-call macros, the fm_cuda_<entry> functions each file contributes to the op table that
 * cuda_backend.cu assembles, and (cuda_common.cuh, included at the end) the device and host
 * helpers the files share. Compiled with FM_ACT_BF16: fm_act is bf16 (reinterpret as
 * __nv_bfloat16 in kernels). One op family per file:
 *   cuda_backend.cu     the table, init, free, errors  cuda_memory.cu   memory, buffers, streams, events, syncs
 *   cuda_vmm.cu         mem_alloc's blocks through the VMM driver API; mem_release / mem_restore (sleep)
 *   cuda_gemm.cu        gemm, grouped expert GEMMs     cuda_profile.cu  phase timing (events)
 *   cuda_elementwise.cu add, sumsq, SwiGLU, convert    cuda_router.cu   router softmax/top-k, stats
 *   cuda_embedding.cu   embedding                      cuda_permute.cu  route index, gather/combine, rows
 *   cuda_norm.cu        RMSNorm                        cuda_loss.cu     cross-entropy, linear-CE strips
 *   cuda_rope.cu        RoPE                           cuda_adamw.cu    AdamW
 *   cuda_bias.cu        linear layers' biases (add, gradient)
 *   cuda_slice.cu       head slices (multi-head latent attention's q/k/v assembly)
 *   cuda_attention.cu   attention dispatch and state; cuda_attention_cudnn.cu the cuDNN graph path;
 *   cuda_attention_fwd.cu / _bwd.cu our own kernels (the fallback forward and backward);
 *   cuda_router_force.cu the forced routing of the FLATMOE_TEST_FORCE_ROUTE test hook;
 *   cuda_router_replay.cu routing replay (R3): given experts, the current router's weights;
 *   cuda_router_softmax_group.cu DeepSeek-V2's router (softmax, group-limited greedy, scaling). */
#ifndef FM_CUDA_INTERNAL_H
#define FM_CUDA_INTERNAL_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "fm_backend_cuda.h" /* and fm_backend_plan.h: the workspace sizes */

typedef struct fm_cuda_ctx {
    int device;
    cudaStream_t stream;           /* the op stream: every op is issued on it; compute or update
                                      (set_op_stream) */
    cudaStream_t compute;          /* FM_STREAM_COMPUTE, non-blocking */
    cudaStream_t update;           /* FM_STREAM_UPDATE (the optimizer overlap's updates), non-blocking */
    cudaStream_t copy_in;          /* FM_STREAM_COPY_IN (host to device copies), non-blocking */
    cudaStream_t copy_out;         /* FM_STREAM_COPY_OUT (device to host copies), non-blocking */
    cudaStream_t opt_in, opt_out;  /* FM_STREAM_OPT_COPY_IN/OUT (the streamed optimizer's copies), non-blocking */
    cudaEvent_t events[FM_EVENT_POOL]; /* the event pool (timing disabled), each recorded once at init */
    int events_made;               /* how many of events[] exist (init's error paths) */
    cublasHandle_t cublas;
    cublasLtHandle_t cublaslt;
    void *lt_workspace;            /* cuBLASLt workspace, fixed at init */
    size_t lt_workspace_bytes;
    cudnnHandle_t cudnn;
    void *cudnn_workspace;         /* cuDNN workspace, fixed at init */
    size_t cudnn_workspace_bytes;
    int64_t max_head_dim;
    void *att_state;               /* owned by cuda_attention.cu (graph cache, fallback scratch) */
    void *scratch;                 /* FM_CUDA_SCRATCH_BYTES of device memory: reductions, group pointers */
    void *vmm;                     /* mem_alloc's VMM allocator (cuda_vmm.cu: its block table); NULL: the
                                    * device has no virtual memory management, mem_alloc is cudaMalloc */
    /* Device-found argument errors (a top-k id outside [0,E), a target outside [0,V)): pinned,
     * mapped host ints the kernels set to 1 (plain stores: every writer writes 1) through
     * flags_dev, and status reads on the host after a sync point. Sticky: never cleared. */
    volatile int *flags_host;      /* [FM_CUDA_FLAGS] */
    int *flags_dev;                /* the same memory as the device sees it */
    fm_expert_gemm expert_gemm;    /* the expert GEMMs' form (fm_backend_opts.h), fixed at init */
    fm_fp8_gemm fp8_gemm;          /* the FP8 expert GEMM's schedule (FLATMOE_FP8_GEMM), fixed at init */
    int sm_count;                  /* the device's multiprocessors (the sm90 kernel's persistent grid) */
    int update_blocks;             /* > 0: AdamW on the update stream uses at most this many blocks, and the
                                    * update stream runs at the lowest priority (FLATMOE_UPDATE_BLOCKS) */
    /* profiling (the profile option at init): a pool of timing events recorded on the stream at
     * each phase mark, summed per phase at collect */
    cudaEvent_t *prof_ev;          /* [prof_cap], NULL when profiling is off */
    unsigned char *prof_phase;     /* [prof_cap]: the phase that starts at each event */
    int prof_n, prof_cap;
    double prof_acc[FM_PHASE_COUNT]; /* milliseconds per phase folded so far */
    uint64_t host_syncs;           /* times the host waited for the device (host_sync_count) */
    /* The host-wait watchdog (fm_cuda_backend_set_wait_hook; NULL: none): while set, every host
     * wait asks it and, unless it answers idle, polls the stream or event and asks again between
     * polls; a non-OK return ends the wait and becomes the context's error. The nccl
     * communicator's deferred mode sets it. */
    fm_status (*wait_hook)(void *arg, bool *idle);
    void *wait_hook_arg;
    /* The first device error since creation (sticky; fm_backend.h's status): FM_OK when none. */
    fm_status err;
    char err_msg[768];             /* names the failing call, its error, file and line */
} fm_cuda_ctx;

/* The device-error flags (c->flags_host / flags_dev), one per op that validates indices. */
enum { FM_CUDA_FLAG_ROUTE = 0, FM_CUDA_FLAG_CE = 1, FM_CUDA_FLAG_LCE = 2, FM_CUDA_FLAGS = 4 };

/* c->scratch is FM_CUDA_SCRATCH_BYTES (fm_backend_plan.h). Its last FM_CUDA_GROUP_PTR_BYTES hold
 * the device pointer arrays of the grouped expert GEMM (3 arrays of FM_CUDA_GROUP_MAX pointers);
 * reductions use the bytes below. Ops never wait for the host, so scratch is safe to reuse only
 * because every user is on the compute stream: a later op's writes are ordered after an earlier
 * op's reads (including the asynchronous copy of moe_route_index's offsets out of it). */
#define FM_CUDA_GROUP_MAX 128
#define FM_CUDA_GROUP_PTR_BYTES ((size_t)4096)
#define FM_CUDA_REDUCE_BYTES (FM_CUDA_SCRATCH_BYTES - FM_CUDA_GROUP_PTR_BYTES)

/* Checked calls inside ops (fm_backend.h: ops do not abort on a device error). A failure records
 * the first error of the context (fm_cuda_record: status, the call's text, its error string, file
 * and line; later ones are dropped) and RETURNS from the enclosing void function: the step is
 * lost anyway, and the trainer reads `status` at the end of it. FM_CUDA_OK and friends are the
 * expressions (true when the call succeeded) for functions that return a value.
 * FM_CUDA_LAUNCH_CHECK follows a kernel launch (cudaGetLastError, which also clears it). */
#define FM_CUDA_OK(c, call) fm_cuda_check_rt((c), (call), #call, __FILE__, __LINE__)
#define FM_CUBLAS_OK(c, call) fm_cuda_check_blas((c), (call), #call, __FILE__, __LINE__)
#define FM_CUDNN_OK(c, call) fm_cuda_check_dnn((c), (call), #call, __FILE__, __LINE__)
#define FM_CUDA_CHECK(c, call)                                                                 \
    do {                                                                                       \
        if (!FM_CUDA_OK(c, call)) return;                                                      \
    } while (0)
#define FM_CUBLAS_CHECK(c, call)                                                               \
    do {                                                                                       \
        if (!FM_CUBLAS_OK(c, call)) return;                                                    \
    } while (0)
#define FM_CUDNN_CHECK(c, call)                                                                \
    do {                                                                                       \
        if (!FM_CUDNN_OK(c, call)) return;                                                     \
    } while (0)
#define FM_CUDA_LAUNCH_CHECK(c) FM_CUDA_CHECK(c, cudaGetLastError())

#ifdef __cplusplus
extern "C" {
#endif

/* Records a failure as the context's first error (a no-op when one is recorded already):
 * status (FM_ERR_NOMEM for out-of-memory errors, FM_ERR_UNSUPPORTED otherwise, FM_ERR_ARG for
 * device-found argument errors) and "CUDA backend: <call> failed: <what> (<file>:<line>)". */
void fm_cuda_record(fm_cuda_ctx *c, fm_status status, const char *call, const char *what, const char *file,
                    int line);
/* The checked-call functions behind FM_CUDA_OK / FM_CUBLAS_OK / FM_CUDNN_OK: true on success;
 * otherwise record the error (fm_cuda_record) and return false. */
bool fm_cuda_check_rt(fm_cuda_ctx *c, cudaError_t e, const char *call, const char *file, int line);
bool fm_cuda_check_blas(fm_cuda_ctx *c, cublasStatus_t s, const char *call, const char *file, int line);
bool fm_cuda_check_dnn(fm_cuda_ctx *c, cudnnStatus_t s, const char *call, const char *file, int line);

/* Each file's table entries: each has the signature of its fm_ops entry (fm_backend.h, whose
 * comments give the contract) and is named fm_cuda_<entry>. */

/* cuda_gemm.cu */
void fm_cuda_gemm(void *ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const fm_act *A, int64_t lda, const fm_act *B, int64_t ldb, float beta, void *C, fm_dtype c_type,
                  int64_t ldc);
void fm_cuda_expert_linear_fwd(void *ctx, fm_act *y, const fm_act *x, const fm_act *W, const int64_t *offsets,
                               int64_t E, int64_t in, int64_t out);
void fm_cuda_expert_linear_bwd(void *ctx, fm_act *dx, float beta, fm_act *dW, const fm_act *dy, const fm_act *x,
                               const fm_act *W, const int64_t *offsets, int64_t E, int64_t in, int64_t out);
bool fm_cuda_expert_sync_free(void *ctx, int64_t E, int64_t H, int64_t I, int64_t rows_max);
void fm_cuda_expert_linear_fwd_dev(void *ctx, fm_act *y, const fm_act *x, const fm_act *W, const int64_t *offsets,
                                   int64_t rows, int64_t E, int64_t in, int64_t out);
void fm_cuda_expert_linear_bwd_dev(void *ctx, fm_act *dx, float beta, fm_act *dW, const fm_act *dy, const fm_act *x,
                                   const fm_act *W, const int64_t *offsets, int64_t rows, int64_t E, int64_t in,
                                   int64_t out);

/* cuda_elementwise.cu */
void fm_cuda_add(void *ctx, fm_act *y, const fm_act *x, int64_t n);
void fm_cuda_sumsq(void *ctx, double *out, const fm_act *x, int64_t n, bool accumulate);
void fm_cuda_swiglu_fwd(void *ctx, fm_act *out, const fm_act *gate, const fm_act *up, int64_t n);
/* cuda_attention_ext.cu: attention with sinks and sliding windows (attention_ext_fwd / _bwd). */
void fm_cuda_attention_ext_fwd(void *ctx, fm_act *out, float *lse, const fm_act *q, const fm_act *k, const fm_act *v,
                               int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start,
                               const fm_act *sinks, int64_t window);
void fm_cuda_attention_ext_bwd(void *ctx, fm_act *dq, fm_act *dk, fm_act *dv, fm_act *dsinks, const fm_act *dout,
                               const fm_act *q, const fm_act *k, const fm_act *v, const fm_act *out, const float *lse,
                               int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start,
                               const fm_act *sinks, int64_t window);
/* cuda_gpt_oss.cu: GPT-OSS's clamped SwiGLU (swiglu_clamp_fwd / _bwd), bias_add_f32. */
void fm_cuda_bias_add_f32(void *ctx, float *y, const fm_act *b, int64_t N, int64_t D);
void fm_cuda_swiglu_clamp_fwd(void *ctx, fm_act *out, const fm_act *gate, const fm_act *up, int64_t n, float limit,
                              float alpha);
void fm_cuda_swiglu_clamp_bwd(void *ctx, fm_act *dgate, fm_act *dup, const fm_act *dout, const fm_act *gate,
                              const fm_act *up, int64_t n, float limit, float alpha);
void fm_cuda_swiglu_bwd(void *ctx, fm_act *dgate, fm_act *dup, const fm_act *dout, const fm_act *gate,
                        const fm_act *up, int64_t n);
void fm_cuda_convert(void *ctx, void *dst, fm_dtype dst_type, const void *src, fm_dtype src_type, int64_t n);

/* cuda_embedding.cu */
void fm_cuda_embedding_fwd(void *ctx, fm_act *out, const int32_t *tokens, const fm_act *wte, int64_t N, int64_t H);
void fm_cuda_embedding_bwd(void *ctx, fm_act *dwte, const fm_act *dout, const int32_t *tokens, int64_t N,
                           int64_t H);

/* cuda_norm.cu */
void fm_cuda_rmsnorm_fwd(void *ctx, fm_act *out, float *rstd, const fm_act *x, const fm_act *w, int64_t N,
                         int64_t D, float eps);
void fm_cuda_rmsnorm_bwd(void *ctx, fm_act *dx, fm_act *dw, const fm_act *dout, const fm_act *x, const fm_act *w,
                         const float *rstd, int64_t N, int64_t D);

/* cuda_rope.cu */
void fm_cuda_rope_fwd(void *ctx, fm_act *x, const float *cos_tab, const float *sin_tab, int64_t B, int64_t T,
                      int64_t nh, int64_t hd, int64_t rd, const int32_t *pos);
void fm_cuda_rope_bwd(void *ctx, fm_act *dx, const float *cos_tab, const float *sin_tab, int64_t B, int64_t T,
                      int64_t nh, int64_t hd, int64_t rd, const int32_t *pos);

/* cuda_slice.cu: head slices (multi-head latent attention's assembly; fm_backend.h head_slice) */
void fm_cuda_head_slice(void *ctx, fm_act *dst, fm_slice dst_at, const fm_act *src, fm_slice src_at, int64_t N,
                        int64_t nh, int64_t d, int perm, float alpha, bool accumulate);

/* cuda_bias.cu */
void fm_cuda_bias_add(void *ctx, fm_act *y, const fm_act *b, int64_t N, int64_t D);
void fm_cuda_bias_grad(void *ctx, fm_act *db, const fm_act *dy, int64_t N, int64_t D);

/* cuda_adamw.cu */
void fm_cuda_adamw(void *ctx, fm_act *p, const fm_act *g, float *master, void *m, void *v, fm_dtype mv_dtype,
                   int64_t n, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                   float grad_scale);
void fm_cuda_adamw_bf16w(void *ctx, fm_act *p, const fm_act *g, uint16_t *comp, void *m, void *v, fm_dtype mv_dtype,
                         int64_t n, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                         float grad_scale, uint64_t sr_key, int64_t idx0);

/* cuda_memory.cu: memory, buffers, streams, events, syncs, status */
void *fm_cuda_mem_alloc(void *ctx, size_t bytes);
void fm_cuda_mem_free(void *ctx, void *p);
void fm_cuda_mem_set(void *ctx, void *dst, int byte, size_t bytes);
void fm_cuda_copy(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind);
void *fm_cuda_buffer_alloc(void *ctx, fm_buffer_kind kind, size_t bytes);
void fm_cuda_buffer_free(void *ctx, fm_buffer_kind kind, void *p);
void fm_cuda_copy_async(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind, fm_stream stream);
void fm_cuda_event_record(void *ctx, int event, fm_stream stream);
void fm_cuda_event_wait(void *ctx, fm_stream stream, int event);
void fm_cuda_event_sync(void *ctx, int event);
void fm_cuda_stream_sync(void *ctx, fm_stream stream);
void fm_cuda_set_op_stream(void *ctx, fm_stream stream);
void fm_cuda_sync(void *ctx);
fm_status fm_cuda_status(void *ctx);
uint64_t fm_cuda_host_sync_count(void *ctx);

/* cuda_vmm.cu: device memory reserved, backed and mapped through the CUDA driver's virtual memory
 * management (cuda_vmm.h has the contract). fm_cuda_vmm_init at init (FM_OK and c->vmm NULL where
 * the device has none; FM_ERR_NOMEM for the table); fm_cuda_vmm_destroy at free (every block left
 * is freed); fm_cuda_vmm_alloc: a zero-filled block, NULL when it cannot (out of memory: nothing
 * recorded; another error recorded); fm_cuda_vmm_free: false when p is not one of its blocks. */
fm_status fm_cuda_vmm_init(fm_cuda_ctx *c);
void fm_cuda_vmm_destroy(fm_cuda_ctx *c);
void *fm_cuda_vmm_alloc(fm_cuda_ctx *c, size_t bytes);
bool fm_cuda_vmm_free(fm_cuda_ctx *c, void *p);
size_t fm_cuda_mem_release(void *ctx, void *p, size_t bytes);
bool fm_cuda_mem_restore(void *ctx, void *p, size_t bytes);

/* cuda_profile.cu: the table's entries, and the event pool (created at init when profiling,
 * destroyed by free; fm_cuda_prof_free takes a half-built pool too). */
void fm_cuda_prof_mark(void *ctx, fm_phase phase);
bool fm_cuda_prof_collect(void *ctx, double *ms);
fm_status fm_cuda_prof_init(fm_cuda_ctx *c);
void fm_cuda_prof_free(fm_cuda_ctx *c);

/* cuda_attention.cu: attention ops and their state (called by init/free in cuda_backend.cu). */
fm_status fm_cuda_attention_init(fm_cuda_ctx *c, const fm_backend_opts *o);
void fm_cuda_attention_free(fm_cuda_ctx *c);
void fm_cuda_attention_fwd(void *ctx, fm_act *out, float *lse, const fm_act *q, const fm_act *k,
                           const fm_act *v, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                           const int32_t *kv_start);
void fm_cuda_attention_bwd(void *ctx, fm_act *dq, fm_act *dk, fm_act *dv, const fm_act *dout,
                           const fm_act *q, const fm_act *k, const fm_act *v, const fm_act *out,
                           const float *lse, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                           const int32_t *kv_start);

/* cuda_router.cu */
void fm_cuda_router_fwd(void *ctx, float *probs, float *lse, int32_t *topk_idx, float *topk_w,
                        const float *logits, int64_t N, int64_t E, int64_t k, bool norm_topk);
void fm_cuda_router_bwd(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                        float z_scale, const float *probs, const float *lse, const int32_t *topk_idx,
                        const float *topk_w, int64_t N, int64_t E, int64_t k, bool norm_topk);
void fm_cuda_router_stats(void *ctx, float *count, float *prob_sum, double *lse_sq, const float *probs,
                          const float *lse, const int32_t *topk_idx, int64_t N, int64_t E, int64_t k);
void fm_cuda_router_loss_terms(void *ctx, double *terms, const float *count, const float *prob_sum,
                               const double *lse_sq, int64_t N, int64_t E);
void fm_cuda_router_aux_grad(void *ctx, float *dprobs, const float *count, double coef, int64_t N, int64_t E);

/* cuda_router_sigmoid.cu: the sigmoid, group-limited, bias-corrected router (fm_backend.h) */
void fm_cuda_router_sigmoid_fwd(void *ctx, float *scores, float *lse, int32_t *topk_idx, float *topk_w,
                                const float *logits, const fm_act *bias, int64_t N, int64_t E, int64_t k,
                                int64_t n_group, int64_t topk_group, bool norm_topk, float scaling);
void fm_cuda_router_sigmoid_bwd(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                                const float *scores, const int32_t *topk_idx, int64_t N, int64_t E, int64_t k,
                                bool norm_topk, float scaling);
/* cuda_router_softmax_group.cu: DeepSeek-V2's softmax router, greedy or group-limited (fm_backend.h) */
void fm_cuda_router_softmax_group_fwd(void *ctx, float *probs, float *lse, int32_t *topk_idx, float *topk_w,
                                      const float *logits, int64_t N, int64_t E, int64_t k, int64_t n_group,
                                      int64_t topk_group, float scaling);
void fm_cuda_router_softmax_group_bwd(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                                      float z_scale, const float *probs, const float *lse, const int32_t *topk_idx,
                                      int64_t N, int64_t E, int64_t k, float scaling);
/* cuda_router_seq_aux.cu: the sigmoid router's sequence-wise balance loss (fm_backend.h) */
void fm_cuda_router_seq_aux_fwd(void *ctx, double *term, const float *scores, const int32_t *topk_idx,
                                const int32_t *doc_start, int64_t B, int64_t T, int64_t E, int64_t k, double coef);
void fm_cuda_router_seq_aux_bwd(void *ctx, float *dlogits, const float *scores, const int32_t *topk_idx,
                                const int32_t *doc_start, int64_t B, int64_t T, int64_t E, int64_t k, double coef);
/* cuda_router_force.cu: the forced routing of FLATMOE_TEST_FORCE_ROUTE (fm_backend.h router_force) */
void fm_cuda_router_force(void *ctx, int32_t *topk_idx, float *topk_w, const float *probs, int64_t N, int64_t E,
                          int64_t k, int64_t first, int percent, bool norm_topk, float scaling);
/* cuda_router_replay.cu: routing replay (fm_backend.h router_replay) */
void fm_cuda_router_replay(void *ctx, int32_t *topk_idx, float *topk_w, const float *probs, const int32_t *replay,
                           int64_t N, int64_t E, int64_t k, bool norm_topk, float eps, float scaling);

/* cuda_permute.cu */
void fm_cuda_moe_route_index(void *ctx, int64_t *offsets, int32_t *row_route, int32_t *route_row,
                             const int32_t *topk_idx, int64_t N, int64_t E, int64_t k);
/* moe_count_add (fm_backend.h): counts [E] pinned host memory, offsets [E+1] device-readable. */
void fm_cuda_moe_count_add(void *ctx, int64_t *counts, const int64_t *offsets, int64_t E);
void fm_cuda_moe_gather(void *ctx, fm_act *xe, const fm_act *x, const int32_t *row_route, int64_t R,
                        int64_t k, int64_t H);
void fm_cuda_moe_gather_bwd(void *ctx, fm_act *dx, const fm_act *dxe, const int32_t *route_row, int64_t N,
                            int64_t k, int64_t H);
void fm_cuda_moe_combine_fwd(void *ctx, fm_act *out, const fm_act *ye, const float *topk_w,
                             const int32_t *route_row, int64_t N, int64_t k, int64_t H);
void fm_cuda_moe_combine_bwd(void *ctx, fm_act *dye, float *dtopk_w, const fm_act *dout, const fm_act *ye,
                             const float *topk_w, const int32_t *route_row, int64_t N, int64_t k, int64_t H);
void fm_cuda_gather_rows(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n, int64_t row_bytes);
void fm_cuda_scatter_rows(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n, int64_t row_bytes);

/* cuda_loss.cu */
void fm_cuda_cross_entropy(void *ctx, float *loss, fm_act *dlogits, const fm_act *logits, const int32_t *targets,
                           int64_t N, int64_t V, float grad_scale, int32_t ignore_index, double *sum);
void fm_cuda_lce_fold(void *ctx, float *m, float *z, float *tgt, float *ent, const float *strip,
                      const int32_t *targets, int64_t Nb, int64_t Vb, int64_t v0, bool first);
void fm_cuda_lce_finalize(void *ctx, float *loss, float *logprob, float *entropy, double *sums, const float *m,
                          const float *z, const float *tgt, const float *ent, const int32_t *targets,
                          const float *weights, int64_t Nb, int64_t V, int32_t ignore_index);
void fm_cuda_lce_strip_grad(void *ctx, float *grad, const float *strip, const float *m, const float *z,
                            const int32_t *targets, const float *weights, int64_t Nb, int64_t Vb, int64_t v0,
                            int32_t ignore_index, float grad_scale, float z_coef);
/* cuda_lce_ent.cu: the logit gradient with the entropy term (fm_backend.h lce_strip_grad_ent) */
void fm_cuda_lce_strip_grad_ent(void *ctx, float *grad, const float *strip, const float *m, const float *z,
                                const int32_t *targets, const float *weights, const float *ent_w, const float *ent,
                                int64_t Nb, int64_t Vb, int64_t v0, int32_t ignore_index, float grad_scale,
                                float z_coef);
/* cuda_lce_topk.cu: the running top-k of the logits across vocabulary blocks (fm_backend.h lce_topk_*) */
void fm_cuda_lce_topk_fold(void *ctx, float *topv, int32_t *topi, const float *strip, int64_t Nb, int64_t Vb,
                           int64_t v0, int64_t k, bool first);
void fm_cuda_lce_topk_finalize(void *ctx, float *out_lp, int32_t *out_id, const float *topv, const int32_t *topi,
                               const float *m, const float *z, int64_t Nb, int64_t k);

#ifdef __cplusplus
}
#endif

#include "cuda_common.cuh"
#endif
