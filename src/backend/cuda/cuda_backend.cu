/* The CUDA backend (fm_backend_cuda.h): the op table, assembled from the fm_cuda_<entry> functions
 * of the op-family files (cuda_internal.h lists them); the sticky error record behind the
 * checked-call macros; and init / free: the device checks, the four streams (compute, update, copy-in,
 * copy-out) and the event pool, the device-error flags, the cuBLAS(Lt) and cuDNN handles and every
 * workspace, all sized here from the options (fm_backend_opts.h) and never again.
 */
#include "cuda_internal.h"
#include "cuda_fp8.h"
#include "cuda_vmm.h"
#include "sm90/gg_sm90.h"

#include <cstdio>
#include <cstring>

/* ---- errors (sticky: the first one is kept; fm_backend.h's status) ------------------------------ */

extern "C" void fm_cuda_record(fm_cuda_ctx *c, fm_status status, const char *call, const char *what,
                               const char *file, int line) {
    if (c->err != FM_OK) return;
    c->err = status;
    snprintf(c->err_msg, sizeof c->err_msg, "CUDA backend: %s failed: %s (%s:%d)", call, what ? what : "(no message)",
             file, line);
}

extern "C" bool fm_cuda_check_rt(fm_cuda_ctx *c, cudaError_t e, const char *call, const char *file, int line) {
    if (e == cudaSuccess) return true;
    fm_cuda_record(c, e == cudaErrorMemoryAllocation ? FM_ERR_NOMEM : FM_ERR_UNSUPPORTED, call, cudaGetErrorString(e),
                   file, line);
    (void)cudaGetLastError(); /* a non-sticky error must not be reported again by the next launch check */
    return false;
}

extern "C" bool fm_cuda_check_blas(fm_cuda_ctx *c, cublasStatus_t s, const char *call, const char *file, int line) {
    if (s == CUBLAS_STATUS_SUCCESS) return true;
    fm_cuda_record(c, s == CUBLAS_STATUS_ALLOC_FAILED ? FM_ERR_NOMEM : FM_ERR_UNSUPPORTED, call,
                   cublasGetStatusString(s), file, line);
    return false;
}

extern "C" bool fm_cuda_check_dnn(fm_cuda_ctx *c, cudnnStatus_t s, const char *call, const char *file, int line) {
    if (s == CUDNN_STATUS_SUCCESS) return true;
    fm_cuda_record(c, s == CUDNN_STATUS_ALLOC_FAILED ? FM_ERR_NOMEM : FM_ERR_UNSUPPORTED, call, cudnnGetErrorString(s),
                   file, line);
    return false;
}

/* ---- the table ----------------------------------------------------------------------------- */

static fm_ops make_cuda_ops(void) {
    fm_ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.host_memory = false;
    o.gemm = fm_cuda_gemm;
    o.expert_linear_fwd = fm_cuda_expert_linear_fwd;
    o.expert_linear_bwd = fm_cuda_expert_linear_bwd;
    o.expert_sync_free = fm_cuda_expert_sync_free;
    o.expert_linear_fwd_dev = fm_cuda_expert_linear_fwd_dev;
    o.expert_linear_bwd_dev = fm_cuda_expert_linear_bwd_dev;
    o.moe_count_add = fm_cuda_moe_count_add;
    o.quant_fp8_rows = fm_cuda_quant_fp8_rows; /* cuda_fp8.h */
    o.quant_fp8_blocks = fm_cuda_quant_fp8_blocks;
    o.quant_fp8_cols_grouped = fm_cuda_quant_fp8_cols_grouped;
    o.expert_fp8_serves = fm_cuda_expert_fp8_serves; /* cuda_fp8.h: the FP8 expert GEMMs (sm90/gg_sm90_fp8.h) */
    o.fp8_quant_weight = fm_cuda_fp8_quant_weight;
    o.fp8_quant_rows = fm_cuda_fp8_quant_rows;
    o.fp8_quant_tokens = fm_cuda_fp8_quant_tokens;
    o.expert_fp8_gemm = fm_cuda_expert_fp8_gemm;
    o.fp8_quant_dual = fm_cuda_fp8_quant_dual;
    o.fp8_swiglu_bwd_quant = fm_cuda_fp8_swiglu_bwd_quant;
    o.fp8_swiglu_fwd_quant = fm_cuda_fp8_swiglu_fwd_quant;
    o.add = fm_cuda_add;
    o.sumsq = fm_cuda_sumsq;
    o.embedding_fwd = fm_cuda_embedding_fwd;
    o.embedding_bwd = fm_cuda_embedding_bwd;
    o.rmsnorm_fwd = fm_cuda_rmsnorm_fwd;
    o.rmsnorm_bwd = fm_cuda_rmsnorm_bwd;
    o.rope_fwd = fm_cuda_rope_fwd;
    o.rope_bwd = fm_cuda_rope_bwd;
    o.bias_add = fm_cuda_bias_add;
    o.bias_grad = fm_cuda_bias_grad;
    o.attention_fwd = fm_cuda_attention_fwd;
    o.attention_bwd = fm_cuda_attention_bwd;
    o.swiglu_fwd = fm_cuda_swiglu_fwd;
    o.swiglu_bwd = fm_cuda_swiglu_bwd;
    o.swiglu_clamp_fwd = fm_cuda_swiglu_clamp_fwd;
    o.swiglu_clamp_bwd = fm_cuda_swiglu_clamp_bwd;
    o.bias_add_f32 = fm_cuda_bias_add_f32;
    o.attention_ext_fwd = fm_cuda_attention_ext_fwd;
    o.attention_ext_bwd = fm_cuda_attention_ext_bwd;
    o.router_fwd = fm_cuda_router_fwd;
    o.router_bwd = fm_cuda_router_bwd;
    o.router_stats = fm_cuda_router_stats;
    o.router_loss_terms = fm_cuda_router_loss_terms;
    o.router_aux_grad = fm_cuda_router_aux_grad;
    o.router_force = fm_cuda_router_force;
    o.router_sigmoid_fwd = fm_cuda_router_sigmoid_fwd;
    o.router_sigmoid_bwd = fm_cuda_router_sigmoid_bwd;
    o.router_replay = fm_cuda_router_replay;
    o.router_softmax_group_fwd = fm_cuda_router_softmax_group_fwd;
    o.router_softmax_group_bwd = fm_cuda_router_softmax_group_bwd;
    o.router_seq_aux_fwd = fm_cuda_router_seq_aux_fwd;
    o.router_seq_aux_bwd = fm_cuda_router_seq_aux_bwd;
    o.moe_route_index = fm_cuda_moe_route_index;
    o.moe_gather = fm_cuda_moe_gather;
    o.moe_gather_bwd = fm_cuda_moe_gather_bwd;
    o.moe_combine_fwd = fm_cuda_moe_combine_fwd;
    o.moe_combine_bwd = fm_cuda_moe_combine_bwd;
    o.gather_rows = fm_cuda_gather_rows;
    o.head_slice = fm_cuda_head_slice;
    o.scatter_rows = fm_cuda_scatter_rows;
    o.cross_entropy = fm_cuda_cross_entropy;
    o.adamw = fm_cuda_adamw;
    o.adamw_bf16w = fm_cuda_adamw_bf16w;
    o.lce_fold = fm_cuda_lce_fold;
    o.lce_finalize = fm_cuda_lce_finalize;
    o.lce_strip_grad = fm_cuda_lce_strip_grad;
    o.lce_strip_grad_ent = fm_cuda_lce_strip_grad_ent;
    o.lce_topk_fold = fm_cuda_lce_topk_fold;
    o.lce_topk_finalize = fm_cuda_lce_topk_finalize;
    o.mem_alloc = fm_cuda_mem_alloc;
    o.mem_free = fm_cuda_mem_free;
    o.mem_set = fm_cuda_mem_set;
    o.mem_release = fm_cuda_mem_release; /* cuda_vmm.cu: 0 (nothing given back) without VMM */
    o.mem_restore = fm_cuda_mem_restore;
    o.copy = fm_cuda_copy;
    o.convert = fm_cuda_convert;
    o.buffer_alloc = fm_cuda_buffer_alloc;
    o.buffer_free = fm_cuda_buffer_free;
    o.copy_async = fm_cuda_copy_async;
    o.event_record = fm_cuda_event_record;
    o.event_wait = fm_cuda_event_wait;
    o.event_sync = fm_cuda_event_sync;
    o.stream_sync = fm_cuda_stream_sync;
    o.set_op_stream = fm_cuda_set_op_stream;
    o.sync = fm_cuda_sync;
    o.status = fm_cuda_status;
    o.host_sync_count = fm_cuda_host_sync_count;
    o.prof_mark = fm_cuda_prof_mark;
    o.prof_collect = fm_cuda_prof_collect;
    return o;
}

static const fm_ops fm_cuda_ops = make_cuda_ops();

/* ---- init, free ---------------------------------------------------------------------------- */

static size_t resolve_workspace(size_t workspace_bytes) {
    return workspace_bytes ? workspace_bytes : FM_CUDA_DEFAULT_WORKSPACE_BYTES;
}

extern "C" size_t fm_cuda_backend_workspace_bytes(int64_t max_head_dim, size_t workspace_bytes) {
    (void)max_head_dim; /* attention's own state (cuda_attention.cu) is not counted here */
    return fm_cuda_backend_workspace_bytes_for(workspace_bytes); /* cuBLASLt + cuDNN, reduction scratch */
}

extern "C" fm_status fm_cuda_device_memory(int device, size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = *total_bytes = 0;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaMemGetInfo(free_bytes, total_bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaMemGetInfo on device %d failed: %s (no usable CUDA device; "
                        "use the CPU build)", device, cudaGetErrorString(e));
    }
    return FM_OK;
}

/* Releases whatever part of a context exists (init's error paths and free). Errors here are
 * ignored: the context is going away and may be half built. */
static void ctx_destroy(fm_cuda_ctx *c, bool attention_up) {
    if (!c) return;
    if (c->compute) (void)cudaStreamSynchronize(c->compute);
    if (c->update) (void)cudaStreamSynchronize(c->update);
    if (c->copy_in) (void)cudaStreamSynchronize(c->copy_in);
    if (c->copy_out) (void)cudaStreamSynchronize(c->copy_out);
    if (c->opt_in) (void)cudaStreamSynchronize(c->opt_in);
    if (c->opt_out) (void)cudaStreamSynchronize(c->opt_out);
    if (attention_up) fm_cuda_attention_free(c);
    fm_cuda_vmm_destroy(c); /* frees VMM blocks still live (their owners normally free them first) */
    fm_cuda_prof_free(c);
    if (c->cudnn) (void)cudnnDestroy(c->cudnn);
    if (c->cublaslt) (void)cublasLtDestroy(c->cublaslt);
    if (c->cublas) (void)cublasDestroy(c->cublas);
    if (c->lt_workspace) (void)cudaFree(c->lt_workspace);
    if (c->cudnn_workspace) (void)cudaFree(c->cudnn_workspace);
    if (c->scratch) (void)cudaFree(c->scratch);
    if (c->flags_host) (void)cudaFreeHost((void *)c->flags_host);
    for (int i = 0; i < c->events_made; i++) (void)cudaEventDestroy(c->events[i]);
    if (c->opt_out) (void)cudaStreamDestroy(c->opt_out);
    if (c->opt_in) (void)cudaStreamDestroy(c->opt_in);
    if (c->copy_out) (void)cudaStreamDestroy(c->copy_out);
    if (c->copy_in) (void)cudaStreamDestroy(c->copy_in);
    if (c->update) (void)cudaStreamDestroy(c->update);
    if (c->compute) (void)cudaStreamDestroy(c->compute);
    (void)cudaGetLastError();
    fm_free(c);
}

/* Device allocation for init: FM_ERR_NOMEM naming what it was for. */
static fm_status init_alloc(void **p, size_t bytes, const char *what, int device) {
    const cudaError_t e = cudaMalloc(p, bytes);
    if (e == cudaSuccess) return FM_OK;
    *p = NULL;
    (void)cudaGetLastError();
    return fm_error(FM_ERR_NOMEM, "cuda backend: cudaMalloc of %zu bytes for the %s on device %d failed: %s", bytes,
                    what, device, cudaGetErrorString(e));
}

extern "C" fm_status fm_cuda_backend_init(fm_backend *b, int device, const fm_backend_opts *o) {
    if (!b) return fm_error(FM_ERR_ARG, "fm_cuda_backend_init: backend pointer is NULL");
    b->ops = NULL;
    b->ctx = NULL;
    const fm_backend_opts defaults = fm_backend_opts_default();
    if (!o) o = &defaults;
    const int64_t max_head_dim = o->max_head_dim;
    const size_t workspace_bytes = o->gpu_workspace;
    if (o->attention != FM_ATTENTION_AUTO && o->attention != FM_ATTENTION_CUDNN && o->attention != FM_ATTENTION_FALLBACK)
        return fm_error(FM_ERR_ARG, "cuda backend: attention option %d: expected auto, cudnn or fallback",
                        (int)o->attention);
    if (o->expert_gemm != FM_EXPERT_GEMM_AUTO && o->expert_gemm != FM_EXPERT_GEMM_LOOP &&
        o->expert_gemm != FM_EXPERT_GEMM_GROUPED && o->expert_gemm != FM_EXPERT_GEMM_SM90 &&
        o->expert_gemm != FM_EXPERT_GEMM_CUBLAS)
        return fm_error(FM_ERR_ARG, "cuda backend: expert_gemm option %d: expected auto, cublas, loop, grouped or sm90",
                        (int)o->expert_gemm);
    if (o->fp8_gemm != FM_FP8_GEMM_V3 && o->fp8_gemm != FM_FP8_GEMM_V5 && o->fp8_gemm != FM_FP8_GEMM_V5A &&
        o->fp8_gemm != FM_FP8_GEMM_V5B && o->fp8_gemm != FM_FP8_GEMM_V5C)
        return fm_error(FM_ERR_ARG, "cuda backend: fp8_gemm option (FLATMOE_FP8_GEMM) %d: expected v3, v5, v5a, v5b or v5c",
                        (int)o->fp8_gemm);
    if (o->update_blocks < 0)
        return fm_error(FM_ERR_ARG, "cuda backend: update_blocks (FLATMOE_UPDATE_BLOCKS) must be >= 0, got %d",
                        o->update_blocks);
    if (device < 0) return fm_error(FM_ERR_ARG, "cuda backend: device must be >= 0, got %d", device);
    if (max_head_dim < 1)
        return fm_error(FM_ERR_ARG, "cuda backend: max_head_dim must be >= 1, got %lld", (long long)max_head_dim);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return fm_error(FM_ERR_UNSUPPORTED,
                        "cuda backend: cudaGetDeviceCount failed: %s (no CUDA driver or device on this machine; "
                        "use the CPU build)",
                        cudaGetErrorString(e));
    }
    if (count == 0)
        return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: no CUDA device found (use the CPU build)");
    if (device >= count)
        return fm_error(FM_ERR_ARG, "cuda backend: device %d requested but only %d CUDA device(s) present (0..%d)",
                        device, count, count - 1);
    cudaDeviceProp prop;
    e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess)
        return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaGetDeviceProperties(%d) failed: %s", device,
                        cudaGetErrorString(e));
    if (prop.major != 9)
        return fm_error(FM_ERR_UNSUPPORTED,
                        "cuda backend: device %d (%s) has compute capability %d.%d, but this build's kernels are "
                        "for sm_90 (Hopper: H100/H200) only; run on a Hopper GPU or use the CPU build",
                        device, prop.name, prop.major, prop.minor);
    if (o->expert_gemm == FM_EXPERT_GEMM_SM90 && !fm_gg_sm90_device_ok(device))
        return fm_error(FM_ERR_UNSUPPORTED,
                        "cuda backend: FLATMOE_EXPERT_GEMM=sm90 needs compute capability 9.0 (H100/H200) for its "
                        "sm_90a kernel; device %d (%s) has %d.%d: use FLATMOE_EXPERT_GEMM=auto",
                        device, prop.name, prop.major, prop.minor);
    e = cudaSetDevice(device);
    if (e != cudaSuccess)
        return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaSetDevice(%d) failed: %s", device, cudaGetErrorString(e));

    fm_cuda_ctx *c = static_cast<fm_cuda_ctx *>(fm_malloc(sizeof *c));
    if (!c) return fm_error(FM_ERR_NOMEM, "cuda backend: cannot allocate the context (%zu bytes)", sizeof *c);
    memset(c, 0, sizeof *c);
    c->device = device;
    c->max_head_dim = max_head_dim;
    c->expert_gemm = o->expert_gemm;
    c->fp8_gemm = o->fp8_gemm;
    c->sm_count = prop.multiProcessorCount;
    c->update_blocks = o->update_blocks;
    const size_t ws = resolve_workspace(workspace_bytes);
    fm_status s = FM_OK;

    {
        /* FLATMOE_UPDATE_BLOCKS > 0: the compute stream at the device's highest priority and the
         * update stream at its lowest, so the block scheduler serves the next step's forward first
         * while the optimizer overlap's update runs beside it; priorities order kernels only (copies
         * are the copy engines'). Otherwise every stream at the default priority. */
        int least = 0, greatest = 0;
        if (o->update_blocks > 0 && (e = cudaDeviceGetStreamPriorityRange(&least, &greatest)) != cudaSuccess) {
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaDeviceGetStreamPriorityRange failed: %s",
                         cudaGetErrorString(e));
            goto fail;
        }
        cudaStream_t *streams[6] = {&c->compute, &c->copy_in, &c->copy_out, &c->update, &c->opt_in, &c->opt_out};
        const int prio[6] = {greatest, 0, 0, least, 0, 0};
        for (int i = 0; i < 6; i++)
            if ((e = o->update_blocks > 0 ? cudaStreamCreateWithPriority(streams[i], cudaStreamNonBlocking, prio[i])
                                          : cudaStreamCreateWithFlags(streams[i], cudaStreamNonBlocking)) != cudaSuccess) {
                *streams[i] = NULL;
                s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaStreamCreate (stream %d of 6) failed: %s",
                             i, cudaGetErrorString(e));
                goto fail;
            }
        c->stream = c->compute;
    }
    /* The event pool: each event recorded once now on the compute stream, so a sync on an event
     * never recorded since (FM_EVENT_TOKENS before the first micro-batch) returns at once. */
    for (int i = 0; i < FM_EVENT_POOL; i++) {
        if ((e = cudaEventCreateWithFlags(&c->events[i], cudaEventDisableTiming)) != cudaSuccess) {
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaEventCreateWithFlags (event %d of the pool) failed: %s",
                         i, cudaGetErrorString(e));
            goto fail;
        }
        c->events_made = i + 1;
        if ((e = cudaEventRecord(c->events[i], c->stream)) != cudaSuccess) {
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaEventRecord (event %d of the pool) failed: %s", i,
                         cudaGetErrorString(e));
            goto fail;
        }
    }
    {
        void *flags = NULL, *flags_dev = NULL;
        if ((e = cudaHostAlloc(&flags, sizeof(int) * FM_CUDA_FLAGS, cudaHostAllocMapped)) != cudaSuccess) {
            s = fm_error(FM_ERR_NOMEM, "cuda backend: cudaHostAlloc (mapped) of the %zu-byte error flags failed: %s",
                         sizeof(int) * FM_CUDA_FLAGS, cudaGetErrorString(e));
            goto fail;
        }
        memset(flags, 0, sizeof(int) * FM_CUDA_FLAGS);
        c->flags_host = static_cast<volatile int *>(flags);
        /* The device's view of the flags: cudaHostGetDevicePointer, which needs the context's
         * map-host flag; without it, under unified addressing (every 64-bit process) host memory
         * from cudaHostAlloc is reachable from the device through the host pointer itself. */
        if ((e = cudaHostGetDevicePointer(&flags_dev, flags, 0)) != cudaSuccess) {
            (void)cudaGetLastError();
            if (!prop.unifiedAddressing) {
                s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaHostGetDevicePointer of the error flags failed: %s "
                             "(and device %d has no unified addressing)", cudaGetErrorString(e), device);
                goto fail;
            }
            flags_dev = flags;
        }
        c->flags_dev = static_cast<int *>(flags_dev);
    }
    if ((s = fm_cuda_vmm_init(c)) != FM_OK) goto fail; /* mem_alloc's VMM allocator, where the device has VMM */
    if (!o->vmm) fm_cuda_vmm_set_enabled(c, false);      /* FLATMOE_CUDA_VMM=0: cudaMalloc */
    if ((s = init_alloc(&c->lt_workspace, FM_CUDA_LT_WORKSPACE_BYTES, "cuBLAS/cuBLASLt workspace", device)) != FM_OK)
        goto fail;
    c->lt_workspace_bytes = FM_CUDA_LT_WORKSPACE_BYTES;
    if ((s = init_alloc(&c->cudnn_workspace, ws, "cuDNN workspace", device)) != FM_OK) goto fail;
    c->cudnn_workspace_bytes = ws;
    if ((s = init_alloc(&c->scratch, FM_CUDA_SCRATCH_BYTES, "reduction scratch", device)) != FM_OK) goto fail;
    {
        cublasStatus_t bs;
        if ((bs = cublasCreate(&c->cublas)) != CUBLAS_STATUS_SUCCESS) {
            c->cublas = NULL;
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cublasCreate failed: %s", cublasGetStatusString(bs));
            goto fail;
        }
        if ((bs = cublasSetStream(c->cublas, c->stream)) != CUBLAS_STATUS_SUCCESS ||
            (bs = cublasSetWorkspace(c->cublas, c->lt_workspace, c->lt_workspace_bytes)) != CUBLAS_STATUS_SUCCESS ||
            (bs = cublasSetPointerMode(c->cublas, CUBLAS_POINTER_MODE_HOST)) != CUBLAS_STATUS_SUCCESS ||
            (bs = cublasSetMathMode(c->cublas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS) {
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: configuring the cuBLAS handle failed: %s",
                         cublasGetStatusString(bs));
            goto fail;
        }
        if ((bs = cublasLtCreate(&c->cublaslt)) != CUBLAS_STATUS_SUCCESS) {
            c->cublaslt = NULL;
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cublasLtCreate failed: %s", cublasGetStatusString(bs));
            goto fail;
        }
    }
    {
        cudnnStatus_t ds;
        if ((ds = cudnnCreate(&c->cudnn)) != CUDNN_STATUS_SUCCESS) {
            c->cudnn = NULL;
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudnnCreate failed: %s (is libcudnn 9 installed?)",
                         cudnnGetErrorString(ds));
            goto fail;
        }
        if ((ds = cudnnSetStream(c->cudnn, c->stream)) != CUDNN_STATUS_SUCCESS) {
            s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudnnSetStream failed: %s", cudnnGetErrorString(ds));
            goto fail;
        }
    }
    if (o->profile && (s = fm_cuda_prof_init(c)) != FM_OK) goto fail;
    if ((s = fm_cuda_attention_init(c, o)) != FM_OK) goto fail;
    if ((e = cudaStreamSynchronize(c->stream)) != cudaSuccess) { /* the pool's first records, the memsets */
        s = fm_error(FM_ERR_UNSUPPORTED, "cuda backend: cudaStreamSynchronize after init failed: %s",
                     cudaGetErrorString(e));
        ctx_destroy(c, true);
        return s;
    }
    c->err = FM_OK;
    b->ops = &fm_cuda_ops;
    b->ctx = c;
    return FM_OK;
fail:
    ctx_destroy(c, false);
    return s;
}

extern "C" void fm_cuda_backend_free(fm_backend *b) {
    if (!b) return;
    fm_cuda_ctx *c = static_cast<fm_cuda_ctx *>(b->ctx);
    if (c) {
        (void)cudaSetDevice(c->device); /* errors ignored: the context is going away (ctx_destroy waits) */
        ctx_destroy(c, true);
    }
    b->ctx = NULL;
    b->ops = NULL;
}


extern "C" int fm_cuda_expert_sm90_device_ok(int device) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
        (void)cudaGetLastError();
        return -1; /* no device to ask */
    }
    return fm_gg_sm90_device_ok(device) ? 1 : 0;
}
