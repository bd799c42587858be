/* The backend op table (DESIGN.md §3): a struct of function pointers over an opaque context, in the manner of
 * ggml's backend interface. The model layer calls only these; the CPU backend (backend/cpu, C11 + OpenMP + BLAS,
 * fp32) is the reference every other backend is tested against.
 *
 * Conventions for every op:
 * - Tensors are dense, row-major, contiguous. Shapes are written [rows, cols]; activations are [N, D] with N = B*T
 *   tokens (token n = b*T + t). Element counts are int64_t.
 * - `fm_act *` is the build's activation/parameter element (fp32 on the CPU, bf16 on CUDA); `float *` is fp32 in
 *   every build.
 * - Backward: ACTIVATION gradients are ASSIGNED (=), PARAMETER gradients ACCUMULATE (+=) (llm.c's convention),
 *   unless an op's comment says otherwise.
 * - Pointers live in the backend's memory (host memory on the CPU). Integer index tensors are int32_t. Outputs
 *   never alias inputs unless the comment allows it.
 * - Ops do not allocate: any scratch an op needs was sized when the context was created.
 * - Ops never wait for the host and never make the host wait (DESIGN.md §4): every op is issued on the compute
 *   stream; results the host needs (reductions, losses, the MoE expert offsets) land in backend or pinned memory
 *   and are read after a named sync point (stream_sync or event_sync), which host_sync_count counts. On the CPU
 *   every op completes before it returns.
 * - Failure: ops do not abort on a device error (a library call that fails, a kernel that cannot launch): the
 *   context records the first one (sticky) and `status` returns it at the end of a step, so all ranks can stop
 *   together. Argument errors that are caller bugs are asserted.
 */
#ifndef FM_BACKEND_H
#define FM_BACKEND_H

#include "../core/fm_arena.h"
#include "../core/fm_core.h"
#include "fm_adamw_lowp.h"   /* the state recipes of adamw_bf16w */
#include "fm_backend_opts.h" /* what a backend is created with */

#ifdef __cplusplus
extern "C" {
#endif

/* Element types. fm_act is the type of activations, weights and their gradients in this build:
 * fp32 for the CPU backend, bf16 (FM_ACT_BF16, the CUDA build) for the GPU. The model, the
 * bounded operators and the trainer are written once against fm_act and compiled per build;
 * they never read or write an fm_act themselves (only ops do), so on a GPU they hold device
 * pointers. Router logits and probabilities, log-sum-exps, RMSNorm rstd, top-k weights, losses,
 * optimizer state and the linear-CE strip are fp32 in every build. */
#ifdef FM_ACT_BF16
typedef struct fm_act { uint16_t bits; } fm_act; /* bf16: a struct so host code cannot do arithmetic on it */
#define FM_ACT_DTYPE FM_DTYPE_BF16
#else
typedef float fm_act;
#define FM_ACT_DTYPE FM_DTYPE_F32
#endif

typedef enum fm_dtype { FM_DTYPE_F32 = 0, FM_DTYPE_BF16 = 1 } fm_dtype;

/* Phases of a training step, for the per-phase time breakdown (prof_mark / prof_collect). */
typedef enum fm_phase {
    FM_PHASE_OTHER = 0,  /* embedding, token upload, anything unmarked */
    FM_PHASE_ATTENTION,  /* the attention kernels (attention_fwd / attention_bwd) */
    FM_PHASE_DENSE,      /* q/k/v/o projections, RMSNorm, QK-norm, RoPE, residual adds */
    FM_PHASE_ROUTER,     /* router GEMM, softmax/top-k, load-balancing statistics, router backward */
    FM_PHASE_DISPATCH,   /* MoE permutation: route index, gather, combine, chunk row moves */
    FM_PHASE_EXPERTS,    /* expert GEMMs and SwiGLU (--expert-precision fp8 on E4M3 codes: the GEMMs alone,
                          * the SwiGLU fused into fp8_quant's ops; emulated: the GEMMs and the SwiGLU) */
    FM_PHASE_LOSS,       /* LM head and cross-entropy (plain or linear) */
    FM_PHASE_OPTIMIZER,  /* gradient zeroing, gradient norm, AdamW */
    FM_PHASE_FP8_QUANT,  /* --expert-precision fp8: the expert operands' and weights' quantization
                          * (on the codes path the SwiGLU too, fused with it; model/fm_experts_fp8.c) */
    FM_PHASE_COUNT
} fm_phase;

static inline const char *fm_phase_name(int p) {
    static const char *const names[FM_PHASE_COUNT] = {"other",    "attention", "dense", "router",   "dispatch",
                                                      "experts",  "loss",      "optimizer", "fp8_quant"};
    return p >= 0 && p < FM_PHASE_COUNT ? names[p] : "?";
}

/* Buffer types (ggml's buffer types): where a live set's memory comes from. */
typedef enum fm_buffer_kind {
    FM_BUFFER_DEVICE = 0, /* the backend's memory (device memory on a GPU; mem_alloc) */
    FM_BUFFER_PINNED,     /* host memory the device reads and writes asynchronously (cudaHostAlloc) */
    FM_BUFFER_HOST,       /* ordinary host memory */
    FM_BUFFER_KINDS
} fm_buffer_kind;

/* Streams: ops run on the op stream, FM_STREAM_COMPUTE unless set_op_stream moved it to
 * FM_STREAM_UPDATE (a second compute stream: the optimizer overlap updates layer l on it while
 * the next step's forward runs on compute); copies may run on the copy-in (host to device) and
 * copy-out (device to host) streams, ordered against the others with events. The streamed
 * optimizer's copies have a pair of copy streams of their own (FM_STREAM_OPT_COPY_IN/OUT): it
 * issues a whole step's state traffic at once, and on the shared pair the next forward's
 * checkpoint-offload copies would queue behind all of it. FM_STREAM_OPS names whichever stream the
 * op stream is now (for code such as the streamed optimizer that records and waits on the stream
 * its own ops run on). */
typedef enum fm_stream {
    FM_STREAM_COMPUTE = 0,
    FM_STREAM_COPY_IN,
    FM_STREAM_COPY_OUT,
    FM_STREAM_UPDATE,
    FM_STREAM_OPT_COPY_IN,
    FM_STREAM_OPT_COPY_OUT,
    FM_STREAM_OPS,
    FM_STREAM_COUNT
} fm_stream;

/* Events: a fixed pool of FM_EVENT_POOL created at init, named by index; the users of the
 * indices below are fixed, the rest are for schedule policies (checkpoint offload, ...). */
#define FM_EVENT_POOL 256
/* The most expert groups of the group-limited router (router_sigmoid_fwd; n_group). */
#define FM_ROUTER_MAX_GROUPS 64
/* The most experts of the sequence-wise balance loss (router_seq_aux_fwd: its per-segment sums). */
#define FM_ROUTER_MAX_SEQ_AUX_E 2048
enum {
    FM_EVENT_TOKENS = 0,   /* the micro-batch's token/target upload is done (its host batch may be rewritten) */
    FM_EVENT_FIRST_FREE = 8,
    FM_EVENT_OVERLAP0 = 128, /* the optimizer overlap: event 128 + g = group g's update is done
                                (train/fm_optim_overlap.h), up to FM_EVENT_POOL */
};

typedef enum fm_copy_kind {
    FM_COPY_H2D, /* host -> backend memory */
    FM_COPY_D2H, /* backend -> host memory */
    FM_COPY_D2D, /* backend -> backend memory */
} fm_copy_kind;

/* Where a head slice lies in an [N, ...] buffer (head_slice): row stride ld, head stride hs,
 * first column off, in elements. */
typedef struct fm_slice {
    int64_t ld, hs, off;
} fm_slice;

enum { FM_SLICE_PLAIN = 0, FM_SLICE_DEINTERLEAVE = 1, FM_SLICE_INTERLEAVE = 2 };

typedef struct fm_ops {
    const char *name;  /* "cpu", "cuda" */
    bool host_memory;  /* the backend's memory is host memory (the CPU): no staging needed */

    /* ---- dense linear algebra ------------------------------------------------------------ */

    /* C[M,N] = alpha * op(A) @ op(B) + beta * C, accumulated in fp32. op(A) is [M,K] (A is [K,M]
     * when trans_a), op(B) is [K,N] (B is [N,K] when trans_b). lda/ldb/ldc are row strides in
     * elements. A and B are fm_act; C is fm_act or fp32 (c_type: FM_ACT_DTYPE or FM_DTYPE_F32).
     * A linear layer y = x W^T with HF weight W [out,in] is gemm(0,1, N,out,in, 1,x,in,W,in,
     * 0,y,out); dx = dy W is gemm(0,0, N,in,out, ...); dW += dy^T x is gemm(1,0, out,in,N,
     * 1, dy,out, x,in, 1, dW,in). CPU: cblas_sgemm. */
    void (*gemm)(void *ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const fm_act *A, int64_t lda, const fm_act *B, int64_t ldb, float beta, void *C,
                 fm_dtype c_type, int64_t ldc);

    /* ---- grouped expert GEMMs (MoE) -------------------------------------------------------
     * E experts' linear layers over the expert-major row layout of a dispatch: expert e owns rows
     * [offsets[e], offsets[e+1]) (m_e rows; offsets is host int64 [E+1], offsets[0] = 0) of x,
     * y, dx, dy, and its weight W_e = W + e*out*in is [out,in] (HF layout); dW likewise. fm_act
     * everywhere, fp32 accumulation. An expert with m_e = 0 is skipped: it has no rows, and its
     * dW_e is left as it was (zero gradient); one expert may own every row.
     *   expert_linear_fwd: y_e [m_e,out] = x_e [m_e,in] W_e^T
     *   expert_linear_bwd: dx_e [m_e,in] = beta*dx_e + dy_e W_e (skipped when dx is NULL);
     *                      dW_e [out,in] += dy_e^T x_e (skipped when dW is NULL; x is then unread)
     * Either may be NULL: fm_expert_linear_fwd/bwd below then loop over gemm, one call per
     * expert (the CPU). CUDA: one grouped cuBLAS call per product (cublasGemmGroupedBatchedEx),
     * experts with many rows get their own gemm; the expert_gemm option (fm_backend_opts.h,
     * FLATMOE_EXPERT_GEMM=loop|grouped) forces one form; sm90 (forced, or auto's choice where the
     * calibration table projects it faster: plan/fm_expert_choice.h) runs the _dev ops below. */
    void (*expert_linear_fwd)(void *ctx, fm_act *y, const fm_act *x, const fm_act *W, const int64_t *offsets,
                              int64_t E, int64_t in, int64_t out);
    void (*expert_linear_bwd)(void *ctx, fm_act *dx, float beta, fm_act *dW, const fm_act *dy, const fm_act *x,
                              const fm_act *W, const int64_t *offsets, int64_t E, int64_t in, int64_t out);

    /* ---- sync-free expert GEMMs (optional; NULL: the backend has none) ---------------------
     * expert_sync_free: whether this backend runs an MoE layer of E experts, hidden H and
     * intermediate I over dispatches of up to rows_max rows through the _dev ops below (the
     * expert_gemm option asked for it, the device and the shapes are served). When it does, the
     * dispatcher does not wait for moe_route_index's offsets: the _dev ops read them where the
     * device reads them (the same pinned host array, through unified addressing, after
     * moe_route_index's copy in stream order), and the expert-load counts are added on the
     * device (moe_count_add).
     * expert_linear_fwd_dev / _bwd_dev: expert_linear_fwd/bwd's contract, with `offsets`
     * device-readable and `rows` (= offsets[E], known to the caller as n*k) the rows of x, y, dx,
     * dy. CUDA: backend/cuda/sm90/gg_sm90.h.
     * moe_count_add: counts[e] += offsets[e+1] - offsets[e], e < E, on the stream; counts is pinned
     * host memory (buffer_alloc FM_BUFFER_PINNED), read by the host after a sync point. */
    bool (*expert_sync_free)(void *ctx, int64_t E, int64_t H, int64_t I, int64_t rows_max);
    void (*expert_linear_fwd_dev)(void *ctx, fm_act *y, const fm_act *x, const fm_act *W, const int64_t *offsets,
                                  int64_t rows, int64_t E, int64_t in, int64_t out);
    void (*expert_linear_bwd_dev)(void *ctx, fm_act *dx, float beta, fm_act *dW, const fm_act *dy, const fm_act *x,
                                  const fm_act *W, const int64_t *offsets, int64_t rows, int64_t E, int64_t in,
                                  int64_t out);
    void (*moe_count_add)(void *ctx, int64_t *counts, const int64_t *offsets, int64_t E);

    /* ---- FP8 fake quantization (optional; NULL: the backend has none) ----------------------
     * The numerics of blockwise FP8 expert GEMMs (--expert-precision fp8): y = q(x), each tile
     * with its power-of-two scale, every value rounded to E4M3 and scaled back (backend/fm_fp8.h:
     * the recipe, the rounding, the non-finite rule; DeepSeek-V3 §3.3). fm_act in and out; y may
     * alias x. The same bits on every backend for the same input (CUDA: the header's code in
     * kernels, bf16 in and out; CPU: fp32).
     *   quant_fp8_rows: x [rows, cols] in 1 x 128 tiles along each row (activations, dy: K = cols)
     *   quant_fp8_blocks: mats matrices [rows, cols] in 128 x 128 blocks (expert weights [E,out,in])
     *   quant_fp8_cols_grouped: x [offsets[E], cols] in 128 x 1 tiles along the rows of each group
     *     [offsets[g], offsets[g+1]) (offsets: host int64 [E+1], as expert_linear_fwd's; the
     *     weight gradient's operands, K = a group's rows) */
    void (*quant_fp8_rows)(void *ctx, fm_act *y, const fm_act *x, int64_t rows, int64_t cols);
    void (*quant_fp8_blocks)(void *ctx, fm_act *y, const fm_act *x, int64_t mats, int64_t rows, int64_t cols);
    void (*quant_fp8_cols_grouped)(void *ctx, fm_act *y, const fm_act *x, const int64_t *offsets, int64_t E,
                                   int64_t cols);

    /* ---- FP8 expert GEMMs on E4M3 codes (optional; NULL: the backend has none) ---------------
     * The fast path of --expert-precision fp8 (model/fm_experts_fp8.c): the operands quantized
     * into E4M3 codes with fp32 power-of-two scales, in backend/fm_fp8_layout.h's byte layouts
     * (a code times its scale is exactly the value quant_fp8_* gives: fm_fp8.h's recipe and
     * bits), then the grouped products with each 128-deep k-block's partial sum taken in fp32 and
     * scaled into an fp32 total (DeepSeek-V3 §3.3's promotion), one rounding to fm_act at the
     * store. offsets and rows as the _dev ops (device-readable int64 [E+1], offsets[E] <= rcap,
     * the buffers' row capacity); nothing waits for the host. Every K, in, out, C a multiple of
     * 128, E <= 256 (fm_fp8_layer_serves, the one shape rule of every backend and the planner).
     *   expert_fp8_serves: whether this backend runs a layer of E experts, hidden H, intermediate
     *     I over dispatches of up to rows_max rows through these ops (CUDA: sm_90 and the shapes;
     *     CPU: only under the test hook FLATMOE_TEST_FP8_CODES=1, as the layouts' reference)
     *   fp8_quant_weight: W [E, out, in] -> w8 (weight layout: Wq, WqT, scales)
     *   fp8_quant_rows: a [offsets[E], K] -> a8 (rows layout of rcap rows); rows past offsets[E]
     *     are not written (the GEMMs never read them)
     *   fp8_quant_tokens: a [offsets[E], C] -> t8 (tokens layout, kcap = fm_fp8_kcap(rcap, E))
     *   expert_fp8_gemm, kind 0: y_e [m_e,out] = x_e W_e^T (beta ignored: y is overwritten); A8
     *     x's rows operand (K = in), B8 W's weight operand. kind 1: dx_e [m_e,in] = beta dx_e + dy_e W_e; A8 dy's rows operand
     *     (K = out), B8 W's weight operand (its WqT). kind 2: dW_e [out,in] = beta dW_e + dy_e^T
     *     x_e; A8 dy's tokens operand (C = out), B8 x's (C = in); an empty expert with beta 1
     *     leaves dW_e as it was. beta 0 overwrites C without reading it.
     * The fused quantizations (each gives exactly the bytes of the composed ops it replaces, in
     * the same layouts; fewer reads of the bf16 tensors, fewer launches; the CPU's are those
     * compositions, the executable spec):
     *   fp8_quant_dual: a [offsets[E], K] -> a8 (rows layout, K columns) and t8 (tokens layout,
     *     C = K): fp8_quant_rows(a8, a) and fp8_quant_tokens(t8, a) from one read of a
     *   fp8_swiglu_bwd_quant: from dout, the saved gate, up [offsets[E], I], the SwiGLU backward's
     *     dgate, dup exactly as swiglu_bwd gives them (the same formula and fm_act rounding), never
     *     stored as fm_act: dg8, du8 their rows operands (K = I), dgT8, duT8 their tokens operands
     *     (C = I); = swiglu_bwd(dgate, dup, ...) then fp8_quant_rows and fp8_quant_tokens of each
     *   fp8_swiglu_fwd_quant: out [offsets[E], I] = swiglu_fwd(gate, up) (written: the backward
     *     reads it) and a8 its rows operand (K = I); = swiglu_fwd then fp8_quant_rows(a8, out)
     *   Rows at or past offsets[E] are not written (rows operands, out); a tokens operand is
     *   written as fp8_quant_tokens writes it. Every output distinct from every input; K, I
     *   multiples of 128, 1 <= E <= 256, fm_fp8_kcap(rcap, E) < 2^31 (a shape outside is the
     *   backend's recorded FM_ERR_ARG on CUDA, an assertion on the CPU, as the ops above). */
    bool (*expert_fp8_serves)(void *ctx, int64_t E, int64_t H, int64_t I, int64_t rows_max);
    void (*fp8_quant_weight)(void *ctx, void *w8, const fm_act *W, int64_t E, int64_t out, int64_t in);
    void (*fp8_quant_rows)(void *ctx, void *a8, const fm_act *a, const int64_t *offsets, int64_t rcap, int64_t E,
                           int64_t K);
    void (*fp8_quant_tokens)(void *ctx, void *t8, const fm_act *a, const int64_t *offsets, int64_t rcap, int64_t E,
                             int64_t C);
    void (*expert_fp8_gemm)(void *ctx, int kind, fm_act *C, float beta, const void *A8, const void *B8,
                            const int64_t *offsets, int64_t rcap, int64_t E, int64_t in, int64_t out);
    void (*fp8_quant_dual)(void *ctx, void *a8, void *t8, const fm_act *a, const int64_t *offsets, int64_t rcap,
                           int64_t E, int64_t K);
    void (*fp8_swiglu_bwd_quant)(void *ctx, void *dg8, void *du8, void *dgT8, void *duT8, const fm_act *dout,
                                 const fm_act *gate, const fm_act *up, const int64_t *offsets, int64_t rcap,
                                 int64_t E, int64_t I);
    void (*fp8_swiglu_fwd_quant)(void *ctx, fm_act *out, void *a8, const fm_act *gate, const fm_act *up,
                                 const int64_t *offsets, int64_t rcap, int64_t E, int64_t I);

    /* ---- elementwise / reductions -------------------------------------------------------- */

    /* y[i] += x[i], i < n. */
    void (*add)(void *ctx, fm_act *y, const fm_act *x, int64_t n);
    /* Sum of squares of x[0..n), accumulated in double, into *out (backend memory): assigned, or
     * added to it when accumulate (so a sum over several tensors is one device scalar). The
     * same input gives the same bits on every call. */
    void (*sumsq)(void *ctx, double *out, const fm_act *x, int64_t n, bool accumulate);

    /* ---- embedding ----------------------------------------------------------------------- */

    /* out[n,:] = wte[tokens[n],:]. out [N,H], tokens [N] (each in [0,V)), wte [V,H]. */
    void (*embedding_fwd)(void *ctx, fm_act *out, const int32_t *tokens, const fm_act *wte, int64_t N,
                          int64_t H);
    /* dwte[tokens[n],:] += dout[n,:]. Deterministic (fixed summation order per row). */
    void (*embedding_bwd)(void *ctx, fm_act *dwte, const fm_act *dout, const int32_t *tokens, int64_t N,
                          int64_t H);

    /* ---- RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x^2) + eps) * w --------------- */

    /* out [N,D], rstd [N] (saved 1/sqrt(mean(x^2)+eps)), x [N,D], w [D]. Also used for QK-norm:
     * per head (qwen3_moe: N = tokens*heads, D = head_dim) or over the whole projection
     * (olmoe: N = tokens, D = heads*head_dim). */
    void (*rmsnorm_fwd)(void *ctx, fm_act *out, float *rstd, const fm_act *x, const fm_act *w, int64_t N,
                        int64_t D, float eps);
    /* dx [N,D] assigned, dw [D] accumulated, from dout [N,D] and the saved x, w, rstd. */
    void (*rmsnorm_bwd)(void *ctx, fm_act *dx, fm_act *dw, const fm_act *dout, const fm_act *x,
                        const fm_act *w, const float *rstd, int64_t N, int64_t D);

    /* ---- rotary position embedding (Su et al. 2021), HF "rotate_half" layout -------------- */

    /* In place on x [B,T,nh,hd]: the first rd dims of each head (rd even, 2 <= rd <= hd; rd < hd
     * is partial rotary, GPT-NeoX's / glm4_moe's layout) are rotated, the other hd - rd dims pass
     * through unchanged: for i < rd/2 with c = cos_tab[p*rd/2+i], s = sin_tab[...]:
     * (x[i], x[i+rd/2]) <- (x[i]*c - x[i+rd/2]*s, x[i+rd/2]*c + x[i]*s), p the position of
     * token (b,t): pos[b*T+t] (device int32 [B*T], each in [0, T_max); packed documents restart
     * at 0 in each document, fm_batch.h), or t when pos is NULL. cos_tab/sin_tab [T_max, rd/2]
     * with T <= T_max (model/fm_rope.h: YaRN's attention factor is folded into them). */
    void (*rope_fwd)(void *ctx, fm_act *x, const float *cos_tab, const float *sin_tab, int64_t B,
                     int64_t T, int64_t nh, int64_t hd, int64_t rd, const int32_t *pos);
    /* In place on the gradient dx [B,T,nh,hd]: the transpose rotation of the first rd dims (exact
     * for any tables, not only c^2 + s^2 = 1), the rest unchanged; same pos. */
    void (*rope_bwd)(void *ctx, fm_act *dx, const float *cos_tab, const float *sin_tab, int64_t B,
                     int64_t T, int64_t nh, int64_t hd, int64_t rd, const int32_t *pos);

    /* ---- biases of linear layers (attention q/k/v/o projections, model/fm_layer.c) ---------- */

    /* y[n,j] += b[j] for n < N, j < D (y [N,D], b [D]): after the GEMM y = x W^T. */
    void (*bias_add)(void *ctx, fm_act *y, const fm_act *b, int64_t N, int64_t D);
    /* db[j] += sum over n < N of dy[n,j] (dy [N,D], db [D]), accumulated in fp32 or wider in a
     * fixed order (the same bits on every call). */
    void (*bias_grad)(void *ctx, fm_act *db, const fm_act *dy, int64_t N, int64_t D);

    /* ---- head slices (multi-head latent attention's q/k/v assembly, model/fm_mla.c) --------- */

    /* For n < N, h < nh, j < d: dst[n dst.ld + h dst.hs + dst.off + j] = alpha src[n src.ld +
     * h src.hs + src.off + p(j)] (added to dst when accumulate), p by perm (FM_SLICE_*): identity;
     * DEINTERLEAVE p(j) = 2j for j < d/2, else 2(j - d/2) + 1 (d even: the pair order of
     * transformers' apply_rotary_pos_emb_interleave, DeepSeek-V3's rope_interleave); INTERLEAVE
     * its inverse. src NULL: zeros. src.hs 0 broadcasts one slice to every head; dst.hs 0 sums
     * the nh heads' values into one slice, in the order h = 0 .. nh-1 (assigned, or added to dst
     * when accumulate): the broadcast's backward. Arithmetic in fp32 (alpha 1: a plain copy, exact);
     * dst and src do not overlap. Strides in elements. */
    void (*head_slice)(void *ctx, fm_act *dst, fm_slice dst_at, const fm_act *src, fm_slice src_at, int64_t N,
                       int64_t nh, int64_t d, int perm, float alpha, bool accumulate);

    /* ---- causal grouped-query attention, tiled with an online softmax ---------------------
     * (Dao et al., FlashAttention 1 and 2, arXiv 2205.14135 and 2307.08691). Memory grows with
     * T*hd, never T^2: scratch is a fixed per-thread tile set sized at context creation.
     * q [B,T,nh,hd], k and v [B,T,nkv,hd], out [B,T,nh,hd], lse [B,nh,T] (natural-log
     * log-sum-exp of each query's scaled scores, saved for backward). Query head h reads kv
     * head h / (nh/nkv). Scale 1/sqrt(hd).
     * kv_start: device int32 [B*T] or NULL. Query (b,t) sees keys kv_start[b*T+t] .. t of its row
     * (the first token of its document: packed documents, FlashAttention's varlen mask, never
     * across a boundary); each row's values are non-decreasing, with kv_start[b*T+t] either
     * kv_start[b*T+t-1] or t (documents contiguous; checked by fm_batch_check). NULL: keys 0..t
     * (causal, bit for bit today's result). */
    void (*attention_fwd)(void *ctx, fm_act *out, float *lse, const fm_act *q, const fm_act *k,
                          const fm_act *v, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                          const int32_t *kv_start);
    /* dq, dk, dv assigned (same shapes as q, k, v), from dout and the saved q, k, v, out, lse;
     * kv_start as the forward's. */
    void (*attention_bwd)(void *ctx, fm_act *dq, fm_act *dk, fm_act *dv, const fm_act *dout,
                          const fm_act *q, const fm_act *k, const fm_act *v, const fm_act *out,
                          const float *lse, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                          int64_t hd, const int32_t *kv_start);
    /* attention_fwd / _bwd with GPT-OSS's attention sinks and sliding window (transformers'
     * GptOssAttention, eager_attention_forward; masking_utils.sliding_window_overlay):
     *   window W > 0: query t sees keys max(kv_start, t - W + 1) .. t (W keys, itself included);
     *     W = 0: attention_fwd's keys;
     *   sinks [nh] (NULL: none): head h's softmax runs over [scores, sinks[h]] and the sink's
     *     column is dropped: P_tj = exp(s_tj - lse_t), lse_t = log(sum_j exp(s_tj) + exp(sinks[h]))
     *     (lse [B,nh,T] includes the sink, so the backward recomputes P from it as before).
     * Backward: dq, dk, dv ASSIGNED as attention_bwd's; dsinks [nh] ACCUMULATED (+=, a parameter
     * gradient): dsinks[h] += -sum over (b,t) of exp(sinks[h] - lse[b,h,t]) (dO . O)[b,t,h]
     * (the sink's column of dS = P (dP - D) with dP = 0); skipped when sinks or dsinks is NULL.
     * With sinks NULL and W 0: attention_fwd's / _bwd's results (the CPU's bit for bit; CUDA: other kernels). NULL in a
     * backend without them. */
    void (*attention_ext_fwd)(void *ctx, fm_act *out, float *lse, const fm_act *q, const fm_act *k, const fm_act *v,
                              int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start,
                              const fm_act *sinks, int64_t window);
    void (*attention_ext_bwd)(void *ctx, fm_act *dq, fm_act *dk, fm_act *dv, fm_act *dsinks, const fm_act *dout,
                              const fm_act *q, const fm_act *k, const fm_act *v, const fm_act *out, const float *lse,
                              int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start,
                              const fm_act *sinks, int64_t window);

    /* ---- SwiGLU (Shazeer 2020): out = silu(gate) * up ------------------------------------- */

    /* out, gate, up: n elements each. */
    void (*swiglu_fwd)(void *ctx, fm_act *out, const fm_act *gate, const fm_act *up, int64_t n);
    /* dgate, dup assigned, from dout and the saved gate, up. */
    void (*swiglu_bwd)(void *ctx, fm_act *dgate, fm_act *dup, const fm_act *dout, const fm_act *gate,
                       const fm_act *up, int64_t n);

    /* ---- the clamped SwiGLU of GPT-OSS (transformers' GptOssExperts; OpenAI's gpt-oss
     * reference swiglu), per element in fp32, limit > 0, alpha > 0:
     *   g' = min(g, limit), u' = clamp(u, -limit, limit) (NaN stays NaN),
     *   out = (u' + 1) * g' * sigmoid(alpha * g').
     * gate and up are separate arrays of n elements each: Hugging Face's interleaved gate_up_proj
     * (gate = [..., ::2], up = [..., 1::2]) is split at load (io/fm_hf_weights.c), so the op
     * never sees the interleaving. NULL in a backend without it. */
    void (*swiglu_clamp_fwd)(void *ctx, fm_act *out, const fm_act *gate, const fm_act *up, int64_t n, float limit,
                             float alpha);
    /* y[n,j] += b[j] for n < N, j < D: y [N,D] fp32 (router logits), b [D] fm_act (GPT-OSS's
     * router Linear bias; its gradient is bias_grad's over the fm_act logit gradient). NULL in a
     * backend without it. */
    void (*bias_add_f32)(void *ctx, float *y, const fm_act *b, int64_t N, int64_t D);
    /* dgate, dup ASSIGNED, from dout and the saved gate, up: with s = sigmoid(alpha g'),
     *   dgate = dout (u' + 1) s (1 + alpha g' (1 - s)) where g <= limit, else 0;
     *   dup   = dout g' s where -limit <= u <= limit, else 0
     * (torch.clamp's gradient: 1 inside the closed interval, 0 outside). */
    void (*swiglu_clamp_bwd)(void *ctx, fm_act *dgate, fm_act *dup, const fm_act *dout, const fm_act *gate,
                             const fm_act *up, int64_t n, float limit, float alpha);

    /* ---- router: softmax over experts, top-k ---------------------------------------------- */

    /* logits [N,E] fp32 -> probs [N,E] = softmax(logits), lse [N] = logsumexp(logits),
     * topk_idx [N,k] (experts in decreasing probability; ties go to the lower expert id),
     * topk_w [N,k] = probs of those experts, divided by their sum when norm_topk. */
    void (*router_fwd)(void *ctx, float *probs, float *lse, int32_t *topk_idx, float *topk_w,
                       const float *logits, int64_t N, int64_t E, int64_t k, bool norm_topk);
    /* dlogits [N,E] ASSIGNED: the gradient through softmax of
     *   (a) dtopk_w [N,k] through the top-k selection (and renormalization when norm_topk),
     *   (b) dprobs_per_expert [E] (may be NULL): a gradient g_e added to d probs[n,e] for every
     *       token n (this is how the load-balancing loss E*sum_e f_e*P_e reaches the router:
     *       g_e = coef*E*f_e/N, with f_e held constant as in Switch Transformer),
     *   (c) z_scale (may be 0): the router z-loss z_scale * sum_n lse[n]^2 (ST-MoE, Zoph et al.
     *       2022), whose gradient is 2*z_scale*lse[n]*probs[n,e]. */
    void (*router_bwd)(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                       float z_scale, const float *probs, const float *lse, const int32_t *topk_idx,
                       const float *topk_w, int64_t N, int64_t E, int64_t k, bool norm_topk);
    /* Per-expert statistics for the load-balancing loss: count[e] = number of (token, slot)
     * routes to e (as float), prob_sum[e] = sum_n probs[n,e], and *lse_sq = sum_n lse[n]^2
     * (double). count, prob_sum [E], lse_sq [1], assigned, backend memory. */
    void (*router_stats)(void *ctx, float *count, float *prob_sum, double *lse_sq, const float *probs,
                         const float *lse, const int32_t *topk_idx, int64_t N, int64_t E, int64_t k);
    /* One layer's router loss terms (Switch Transformer's E * sum_e f_e P_e, f_e = count_e / N,
     * P_e = prob_sum_e / N, summed over e ascending in double; the z-loss's mean lse^2 =
     * lse_sq / N) into terms[0], terms[1] (backend memory, assigned). */
    void (*router_loss_terms)(void *ctx, double *terms, const float *count, const float *prob_sum,
                              const double *lse_sq, int64_t N, int64_t E);
    /* The load-balancing loss's gradient on every probability of expert e (f_e held constant):
     * dprobs[e] = (float)(coef * E * (count_e / N) / N), in double, ASSIGNED; dprobs, count [E]
     * backend memory; coef = router_aux_loss_coef * loss scale / L. */
    void (*router_aux_grad)(void *ctx, float *dprobs, const float *count, double coef, int64_t N, int64_t E);
    /* Forced routing (a test hook: FLATMOE_TEST_FORCE_ROUTE, fm_router.h), run after router_fwd:
     * token n in [0,N) is forced when n*percent/100 < (n+1)*percent/100 in integer arithmetic
     * (percent in [0,100] of the tokens, spread evenly; 100: every token, 0: none); a forced
     * token's topk_idx[n,j] = (first + j) mod E and topk_w[n,j] = probs[n, that expert], j < k
     * (k <= E: k distinct experts), divided by their sum (accumulated in double, j ascending;
     * the quotient in double, rounded once to float) when norm_topk, then times scaling in fp32
     * (the sigmoid router's routed_scaling_factor; the softmax router passes 1, an exact no-op);
     * the other tokens' rows are left as router_fwd wrote them. probs [N,E] fp32, topk_idx [N,k]
     * int32, topk_w [N,k] fp32, backend memory; first >= 0. The same bits on every backend
     * (cpu_router_force.c, cuda_router_force.cu). NULL in a backend without it. */
    void (*router_force)(void *ctx, int32_t *topk_idx, float *topk_w, const float *probs, int64_t N, int64_t E,
                         int64_t k, int64_t first, int percent, bool norm_topk, float scaling);
    /* Replayed routing (routing replay, R3: a rollout engine's routes given with the batch;
     * fm_router.h), run after router_fwd: token n whose row replay[n*k .. n*k+k) starts with an id
     * >= 0 gets topk_idx[n,j] = replay[n*k+j] (the given order) and topk_w[n,j] = probs[n, that
     * expert], divided when norm_topk by (their sum accumulated in fp32 in j order + eps), then
     * times scaling in fp32 — the scoring's own arithmetic, operation for operation, so replaying
     * the router's own routes gives its bits: router_fwd's with eps 0 and scaling 1 (both exact
     * no-ops), router_sigmoid_fwd's with eps 1e-20f and scaling = routed_scaling_factor (probs then
     * holds the sigmoid scores: the gates use no bias and no group mask); a row starting with -1
     * (padding) keeps the router's. The ids of a replayed row must be in [0,E) and distinct (the
     * caller checks them: src/capi/flatmoe_replay.c). probs [N,E] fp32, replay, topk_idx [N,k]
     * int32, topk_w [N,k] fp32, backend memory. cpu_router_replay.c, cuda_router_replay.cu. NULL in
     * a backend without it. */
    void (*router_replay)(void *ctx, int32_t *topk_idx, float *topk_w, const float *probs, const int32_t *replay,
                          int64_t N, int64_t E, int64_t k, bool norm_topk, float eps, float scaling);

    /* ---- the sigmoid router (DeepSeek-V3, arXiv 2412.19437 §2.1.2; transformers'
     * Glm4MoeTopkRouter / DeepseekV3TopkRouter), per token n, in fp32:
     *   scores[n,e] = sigmoid(logits[n,e]);  choice c_e = scores[n,e] + bias[e] (selection only);
     *   n_group > 1: group g's score = the sum of its 2 largest c (E/n_group experts per group,
     *     contiguous), the topk_group best groups kept (ties: lower group id), c_e := 0.0 for every
     *     expert of the other groups (transformers' masked_fill with 0.0, not -inf);
     *   topk_idx [N,k] = the k largest c (decreasing; ties: lower id; NaN last);
     *   topk_w [N,k] = scores at those experts, divided by (their sum in j order + 1e-20) when
     *     norm_topk, times scaling (routed_scaling_factor);
     *   lse [N] = logsumexp(logits[n]) (router_stats' z-loss statistic, as router_fwd).
     * logits, scores [N,E] fp32, bias [E] fm_act (e_score_correction_bias; NULL: zeros), backend
     * memory. 1 <= k <= topk_group * E / n_group, n_group divides E, n_group <=
     * FM_ROUTER_MAX_GROUPS, E / n_group >= 2 when n_group > 1. NULL in a backend without it. */
    void (*router_sigmoid_fwd)(void *ctx, float *scores, float *lse, int32_t *topk_idx, float *topk_w,
                               const float *logits, const fm_act *bias, int64_t N, int64_t E, int64_t k,
                               int64_t n_group, int64_t topk_group, bool norm_topk, float scaling);
    /* dlogits [N,E] ASSIGNED: the gradient through the sigmoid of
     *   (a) dtopk_w [N,k] (NULL: none) through the chosen scores: ds_j = scaling * dtopk_w_j, or
     *       with norm_topk (S = sum_j scores[idx_j] + 1e-20, in double)
     *       ds_j = scaling (dtopk_w_j - sum_i dtopk_w_i scores[idx_i] / S) / S;
     *   (b) dprobs_per_expert [E] (NULL: none), added to ds_e of every expert;
     * dlogits[n,e] = s_e (1 - s_e) ds_e. The bias and the selection get no gradient. */
    void (*router_sigmoid_bwd)(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                               const float *scores, const int32_t *topk_idx, int64_t N, int64_t E, int64_t k,
                               bool norm_topk, float scaling);
    /* The complementary sequence-wise balance loss of the sigmoid router (DeepSeek-V3, arXiv
     * 2412.19437 §2.1.2 eq. 17-20; Megatron-Core's --moe-router-load-balancing-type seq_aux_loss),
     * over segments of the N = B*T tokens: each row of T tokens, or with doc_start ([N] int32,
     * backend memory, fm_batch.h's row-local first token of each token's document; NULL: rows)
     * each document (a run of equal doc_start in a row; padding is a document too). Segment s of
     * T_s tokens: c_i = its routes to expert i (topk_idx [N,k]), f_i = E c_i / (k T_s),
     * P_i = (1/T_s) sum_t sh_{t,i}, sh_{t,i} = scores[t,i] / (sum_j scores[t,j] + 1e-20) (all E
     * experts, no bias), l_s = sum_i f_i P_i. In double, segments in order, experts ascending.
     * fwd: *term (backend memory, one double, ASSIGNED) = coef * sum_s l_s.
     * bwd: dlogits [N,E] fp32 += coef * s_j (1 - s_j) (g_j - sum_i g_i sh_i) / (sum_i s_i + 1e-20)
     *   for each token of s, g_i = E c_i / (k T_s^2) = d l_s / d sh_{t,i} (c_i held constant: the
     *   selection has no gradient). scores [N,E] fp32. E <= FM_ROUTER_MAX_SEQ_AUX_E. NULL in a
     *   backend without them (cpu_router_seq_aux.c, cuda_router_seq_aux.cu). */
    void (*router_seq_aux_fwd)(void *ctx, double *term, const float *scores, const int32_t *topk_idx,
                               const int32_t *doc_start, int64_t B, int64_t T, int64_t E, int64_t k, double coef);
    void (*router_seq_aux_bwd)(void *ctx, float *dlogits, const float *scores, const int32_t *topk_idx,
                               const int32_t *doc_start, int64_t B, int64_t T, int64_t E, int64_t k, double coef);

    /* ---- DeepSeek-V2's router (arXiv 2405.04434 §2.2; transformers' DeepseekV2Moe; the contract in
     * full: cpu_router_softmax_group.c): router_fwd's probs and lse; n_group > 1: the topk_group groups
     * of largest max prob kept, the others' experts chosen as 0.0; topk_idx [N,k] the k largest
     * choices (ties: lower id); topk_w their probs x scaling, never renormalized. bwd: dlogits ASSIGNED,
     * router_bwd's (no renormalization) with dtopk_w x scaling. NULL in a backend without them. */
    void (*router_softmax_group_fwd)(void *ctx, float *probs, float *lse, int32_t *topk_idx, float *topk_w,
                                     const float *logits, int64_t N, int64_t E, int64_t k, int64_t n_group,
                                     int64_t topk_group, float scaling);
    void (*router_softmax_group_bwd)(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                                     float z_scale, const float *probs, const float *lse, const int32_t *topk_idx,
                                     int64_t N, int64_t E, int64_t k, float scaling);

    /* ---- MoE permutation (dropless) --------------------------------------------------------
     * R = N*k routes; route r = n*k + j is token n's j-th choice. The permuted ("expert-major")
     * layout puts the rows of expert e at [offsets[e], offsets[e+1]), in increasing route order
     * (a stable counting sort), so it is deterministic. */

    /* offsets [E+1] (int64, pinned host memory: the expert GEMM sizes the host reads), row_route
     * [R] (permuted row -> route), route_row [R] (route -> permuted row). The offsets are
     * written by a copy on the compute stream: the host reads them only after a sync point
     * (stream_sync(FM_STREAM_COMPUTE); fm_moe_dispatch names it). */
    void (*moe_route_index)(void *ctx, int64_t *offsets, int32_t *row_route, int32_t *route_row,
                            const int32_t *topk_idx, int64_t N, int64_t E, int64_t k);
    /* xe[r,:] = x[row_route[r]/k, :]. xe [R,H], x [N,H]. */
    void (*moe_gather)(void *ctx, fm_act *xe, const fm_act *x, const int32_t *row_route, int64_t R,
                       int64_t k, int64_t H);
    /* dx[n,:] = sum_j dxe[route_row[n*k+j],:] (assigned; j ascending). */
    void (*moe_gather_bwd)(void *ctx, fm_act *dx, const fm_act *dxe, const int32_t *route_row,
                           int64_t N, int64_t k, int64_t H);
    /* out[n,:] = sum_j topk_w[n*k+j] * ye[route_row[n*k+j],:] (assigned; j ascending). */
    void (*moe_combine_fwd)(void *ctx, fm_act *out, const fm_act *ye, const float *topk_w,
                            const int32_t *route_row, int64_t N, int64_t k, int64_t H);
    /* dye[route_row[n*k+j],:] = topk_w[n*k+j] * dout[n,:] and
     * dtopk_w[n*k+j] = dot(dout[n,:], ye[route_row[n*k+j],:]), both assigned. */
    void (*moe_combine_bwd)(void *ctx, fm_act *dye, float *dtopk_w, const fm_act *dout, const fm_act *ye,
                            const float *topk_w, const int32_t *route_row, int64_t N, int64_t k,
                            int64_t H);

    /* ---- row movement (chunked MoE dispatch) ---------------------------------------------- */

    /* dst row i = src row idx[i], for i < n; rows are row_bytes bytes (any element type). */
    void (*gather_rows)(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n,
                        int64_t row_bytes);
    /* dst row idx[i] = src row i, for i < n (idx distinct, so no two writes meet). */
    void (*scatter_rows)(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n,
                         int64_t row_bytes);

    /* ---- loss ------------------------------------------------------------------------------ */

    /* Softmax cross-entropy over logits [N,V]. loss [N] = logsumexp(logits[n]) -
     * logits[n, targets[n]] (0 where targets[n] == ignore_index). dlogits [N,V] (may alias
     * logits) = grad_scale * (softmax - onehot), rows of ignored targets zero. *sum (backend
     * memory, assigned) = the sum of loss over non-ignored tokens (double). Targets outside
     * [0,V) other than ignore_index are a caller bug. */
    void (*cross_entropy)(void *ctx, float *loss, fm_act *dlogits, const fm_act *logits,
                          const int32_t *targets, int64_t N, int64_t V, float grad_scale,
                          int32_t ignore_index, double *sum);

    /* ---- optimizer ------------------------------------------------------------------------- */

    /* AdamW (Loshchilov & Hutter 2019) over n elements, in place on the fp32 master weights w,
     * m, v:  g' = g * grad_scale; m = b1*m + (1-b1)*g'; v = b2*v + (1-b2)*g'^2;
     *   w -= lr * ( (m/bc1) / (sqrt(v/bc2) + eps) + wd * w )
     * with bc1 = 1 - b1^step, bc2 = 1 - b2^step supplied by the caller (wd = 0 for norms).
     * master [n] fp32, or NULL when p itself is the fp32 master (fm_act = fp32, the CPU): then
     * w = p; otherwise w = master and p = round-to-nearest(w) afterwards (bf16 weights).
     * m, v [n] of mv_dtype: FM_DTYPE_F32, or FM_DTYPE_BF16 (Megatron's --exp-avg-dtype bf16):
     * read as fp32, updated in fp32, stored rounded to nearest even (the arithmetic is the fp32
     * path's; only the stored moments are rounded). */
    void (*adamw)(void *ctx, fm_act *p, const fm_act *g, float *master, void *m, void *v, fm_dtype mv_dtype,
                  int64_t n, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                  float grad_scale);

    /* AdamW on bf16 weights without an fp32 master (--master-weights bf16-kahan | bf16-sr;
     * fm_adamw_lowp.h gives the recipes and their sources). The moments and the step are adamw's,
     * in fp32, from w = p rounded to bf16 (on the CUDA build p is bf16; the CPU build's fp32 p
     * holds bf16 values, so the rounding is exact there too):
     *   d = -(lr * ((m/bc1) / (sqrt(v/bc2) + eps) + wd * w))
     * comp [n] bf16 bits (Kahan): c = comp + d; p = bf16(w + c); comp = bf16(c - (p - w)).
     * comp NULL (stochastic rounding): p = fm_sr_round_bits(w + d, fm_sr_bits(sr_key, idx0 + i)),
     * i the element, idx0 its flat parameter index, so every split of a tensor into launches gives
     * the same bits. Rounding to bf16 is to nearest even (bf16(x)). Every operation is rounded on
     * its own (no FMA): the CPU and CUDA backends give the same bits. p on the CPU build stores
     * the bf16 value widened to fp32. m, v as adamw's. */
    void (*adamw_bf16w)(void *ctx, fm_act *p, const fm_act *g, uint16_t *comp, void *m, void *v, fm_dtype mv_dtype,
                        int64_t n, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                        float grad_scale, uint64_t sr_key, int64_t idx0);

    /* ---- linear cross-entropy strips (bounded/fm_linear_ce.c) ------------------------------
     * The vocabulary projection never holds N x V logits (DESIGN.md §2): the caller forms one
     * fp32 strip S [Nb,Vb] = h_blk W_blk^T with gemm (Nb token rows; vocabulary columns
     * [v0, v0+Vb), row stride Vb) and these ops fold it into O(Nb) per-token state, finish the
     * state into per-token outputs, or turn a recomputed strip into the logit gradient.
     * Per-token state, fp32 [Nb] each, for the columns folded so far:
     *   m   running max of the logits,      z   sum_i exp(l_i - m),
     *   tgt the target's logit,             ent sum_i exp(l_i - m) * (l_i - m),
     * so lse = m + log z, p_i = exp(l_i - m) / z, entropy = -sum_i p_i log p_i = log z - ent/z.
     * Online log-sum-exp: Milakov & Gimelshein 2018 (arXiv 1805.02867); blocked linear CE:
     * Wijmans et al., Cut Your Losses (arXiv 2411.09009), Liger-Kernel's fused linear CE. */

    /* Folds strip [Nb,Vb] (columns [v0, v0+Vb)) into m, z, tgt, ent [Nb]:
     *   m' = max(m, max_i S_i);  z' = z exp(m - m') + sum_i exp(S_i - m');
     *   ent' = exp(m - m') (ent + (m - m') z) + sum_i exp(S_i - m') (S_i - m');
     *   tgt = S[r, targets[r] - v0] when targets[r] is in [v0, v0+Vb), else unchanged.
     * first = true ASSIGNS the state from this strip alone (m = -inf, z = ent = 0, tgt = NaN
     * before folding), false folds into it; any block order works once a first block started
     * it. ent may be NULL (entropy not wanted). targets [Nb] int32: values outside the block
     * (ignore_index included) are skipped. NaN logits propagate into z. */
    void (*lce_fold)(void *ctx, float *m, float *z, float *tgt, float *ent, const float *strip,
                     const int32_t *targets, int64_t Nb, int64_t Vb, int64_t v0, bool first);
    /* Finishes a token block after all its vocabulary columns were folded (V in all), from
     * m, z, tgt [Nb] and ent [Nb] (may be NULL when entropy is NULL). ASSIGNS
     *   loss [Nb]     = lse - tgt (0 where targets[r] == ignore_index),
     *   logprob [Nb]  = tgt - lse = -loss (0 where ignored); may be NULL,
     *   entropy [Nb]  = log z - ent / z, for every row (ignored ones too); may be NULL;
     * and ADDS to sums[0] the sum over non-ignored rows of w_r * loss_r and to sums[1] the sum
     * over non-ignored rows of w_r * lse_r^2 (each block's sums in double, added in row order,
     * then added to sums[] — so token blocks accumulate in block order); sums [2] backend
     * memory; weights [Nb] fp32, NULL for all 1. Targets outside [0,V) other than ignore_index are a caller bug
     * (asserted). */
    void (*lce_finalize)(void *ctx, float *loss, float *logprob, float *entropy, double *sums,
                         const float *m, const float *z, const float *tgt, const float *ent,
                         const int32_t *targets, const float *weights, int64_t Nb, int64_t V,
                         int32_t ignore_index);
    /* The logit gradient of one strip [Nb,Vb] (columns [v0, v0+Vb)), from its rows' finished
     * m, z [Nb]: with p = exp(S - m) / z and lse = m + log z,
     *   grad[r,i] = grad_scale * w_r * ((1 + 2 z_coef lse_r) p_ri - [v0 + i == targets[r]]),
     * the gradient of w_r * (loss_r + z_coef * lse_r^2) (z-loss: ST-MoE, Zoph et al. 2022,
     * arXiv 2202.08906, as in Liger-Kernel); rows with targets[r] == ignore_index are zero.
     * grad [Nb,Vb] ASSIGNED, may alias strip. weights [Nb] fp32, NULL for all 1. */
    void (*lce_strip_grad)(void *ctx, float *grad, const float *strip, const float *m,
                           const float *z, const int32_t *targets, const float *weights,
                           int64_t Nb, int64_t Vb, int64_t v0, int32_t ignore_index,
                           float grad_scale, float z_coef);
    /* lce_strip_grad with an entropy term (the RL head's entropy bonus, fm_linear_ce's ent_weight):
     *   grad[r,i] = lce_strip_grad's + grad_scale * ent_w_r * dH_r/dS_ri,
     *   dH_r/dS_ri = -p_ri (log p_ri + H_r),  log p_ri = S_ri - lse_r,  p_ri = exp(log p_ri),
     * the gradient of sum_r ent_w_r H_r, H_r = lse_r - sum_i p_ri S_ri the row's entropy (ent [Nb]
     * fp32, the forward's, lce_finalize's entropy of the same logits). (dH/dS_i = -p_i (S_i - E_p[S])
     * and E_p[S] = lse - H: the entropy of a softmax differentiated; the term of verl's actor loss
     * pg_loss - entropy_coeff * agg_loss(entropy), verl/workers/actor/dp_actor.py.) Rows with targets[r] == ignore_index are zero (as
     * lce_strip_grad's). grad [Nb,Vb] ASSIGNED, may alias strip; ent_w, ent [Nb] fp32. */
    void (*lce_strip_grad_ent)(void *ctx, float *grad, const float *strip, const float *m, const float *z,
                               const int32_t *targets, const float *weights, const float *ent_w, const float *ent,
                               int64_t Nb, int64_t Vb, int64_t v0, int32_t ignore_index, float grad_scale,
                               float z_coef);
    /* The k largest logits of each row (the top-k log-probs of the RL head; fm_linear_ce's out_topk_*), folded
     * strip by strip: strip [Nb,Vb] (columns [v0, v0+Vb)) merged into the running topv [Nb,k] fp32 (logits,
     * decreasing) and topi [Nb,k] int32 (their vocabulary ids), in the strict order (logit descending, id
     * ascending), so the result does not depend on the order of the blocks; first = true ASSIGNS (-inf and -1
     * before folding). A NaN logit never enters. k >= 1. */
    void (*lce_topk_fold)(void *ctx, float *topv, int32_t *topi, const float *strip, int64_t Nb, int64_t Vb,
                          int64_t v0, int64_t k, bool first);
    /* The top-k log-probs from the folded logits and the rows' finished m, z [Nb]: out_lp[r,j] = -((m_r -
     * topv[r,j]) + log z_r) in double, rounded once (lce_finalize's form of log p, so a top id equal to the target
     * gives the target's log-prob bits), out_id[r,j] = topi[r,j]; out_lp, out_id [Nb,k] ASSIGNED (rows with fewer
     * than k finite logits: -inf, -1). */
    void (*lce_topk_finalize)(void *ctx, float *out_lp, int32_t *out_id, const float *topv, const int32_t *topi,
                              const float *m, const float *z, int64_t Nb, int64_t k);

    /* ---- memory: used at launch (arenas, weights) and for small transfers; no op of a step
     * allocates. Pointers from mem_alloc are the backend's (device memory on a GPU). -------- */

    /* bytes of backend memory, 256-byte aligned and zero-filled; NULL when it cannot. */
    void *(*mem_alloc)(void *ctx, size_t bytes);
    void (*mem_free)(void *ctx, void *p);
    /* dst[0..bytes) = byte. */
    void (*mem_set)(void *ctx, void *dst, int byte, size_t bytes);
    /* Sleep (capi/flatmoe_sleep.c): mem_release gives the pages under [p, p + bytes) of a mem_alloc block back,
     * addresses kept, returning the bytes given back (0: none; their contents are lost); mem_restore backs the
     * range again, zero-filled (false: no memory now, not recorded). NULL: cannot. CPU: madvise; CUDA: cuda_vmm.h */
    size_t (*mem_release)(void *ctx, void *p, size_t bytes);
    bool (*mem_restore)(void *ctx, void *p, size_t bytes);
    /* bytes from src to dst; kind says which side is host memory. Synchronous: for launch-time uploads and
     * reports, never inside a step (it counts as a host sync). */
    void (*copy)(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind);
    /* Memory of a buffer kind (zero-filled, 256-byte aligned; NULL when it cannot): DEVICE is mem_alloc's; PINNED
     * is host memory the device copies to and from asynchronously; HOST is fm_malloc's. Launch time only. */
    void *(*buffer_alloc)(void *ctx, fm_buffer_kind kind, size_t bytes);
    void (*buffer_free)(void *ctx, fm_buffer_kind kind, void *p);
    /* Asynchronous copy on `stream`, ordered after what was issued on that stream before it; the host side must
     * be pinned memory (FM_BUFFER_PINNED) and stay untouched until an event recorded after it completes. */
    void (*copy_async)(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind, fm_stream stream);
    /* event (index < FM_EVENT_POOL) := the point `stream` has reached. */
    void (*event_record)(void *ctx, int event, fm_stream stream);
    /* Work issued on `stream` from now on waits for `event` (the host does not wait). */
    void (*event_wait)(void *ctx, fm_stream stream, int event);
    /* The host waits for `event` (a sync point: counted by host_sync_count). */
    void (*event_sync)(void *ctx, int event);
    /* The host waits for everything issued on `stream` (a sync point, counted). */
    void (*stream_sync)(void *ctx, fm_stream stream);
    /* n elements, src_type -> dst_type (fp32 <-> the act type, round to nearest even). dst and
     * src may be the same buffer when the types have the same size. */
    void (*convert)(void *ctx, void *dst, fm_dtype dst_type, const void *src, fm_dtype src_type, int64_t n);
    /* Ops issued from now on run on `stream` (FM_STREAM_COMPUTE, the default, or
     * FM_STREAM_UPDATE); the libraries' handles follow. Ops that share the backend's reduction
     * scratch (sumsq, router_stats, cross_entropy, ...) must stay on FM_STREAM_COMPUTE: only
     * elementwise ops (adamw, mem_set, convert) may run on FM_STREAM_UPDATE. Issues nothing. */
    void (*set_op_stream)(void *ctx, fm_stream stream);
    /* Waits for everything issued so far on every stream (a no-op on the CPU). */
    void (*sync)(void *ctx);
    /* The first device error since creation (sticky), with its message set by fm_error naming
     * the failing call; FM_OK when none. Checked at the end of each step. */
    fm_status (*status)(void *ctx);
    /* Times the host has waited for the device since creation: every sync, stream_sync,
     * event_sync and synchronous copy, and profiling's event waits. The CPU, which has no device
     * to wait for, counts the same calls, so the count is the same on both backends and CI can
     * test it. The trainer prints the count per step. */
    uint64_t (*host_sync_count)(void *ctx);

    /* ---- profiling: where a step's time goes. Enabled by the profile option at backend
     * creation (fm_backend_opts.h; FLATMOE_PROFILE=1 through fm_backend_opts_from_env);
     * otherwise both are no-ops (collect returns false).
     * The CPU times with the wall clock; CUDA with events on its stream (no sync until collect),
     * from a pool created at init, so profiling allocates nothing in a step either. */

    /* From now until the next mark, time is charged to `phase`. */
    void (*prof_mark)(void *ctx, fm_phase phase);
    /* Waits for the work issued so far and ASSIGNS ms[FM_PHASE_COUNT], the milliseconds charged
     * to each phase since the previous collect (or creation); the current phase continues.
     * Returns false (ms untouched) when profiling is off. */
    bool (*prof_collect)(void *ctx, double *ms);
} fm_ops;

static inline size_t fm_dtype_size(fm_dtype t) { return t == FM_DTYPE_BF16 ? 2 : 4; }


/* A backend instance: its op table and its context. */
typedef struct fm_backend {
    const fm_ops *ops;
    void *ctx;
} fm_backend;

/* The backend's buffer of `kind` as an arena buffer type (core/fm_arena.h), so arenas allocate
 * from it without core/ knowing the backend. */
fm_buffer_type fm_backend_buffer_type(const fm_backend *be, fm_buffer_kind kind);

/* An arena of `capacity` bytes of the backend's memory of `kind` for the live set `name`.
 * Errors: FM_ERR_NOMEM naming the live set, the bytes and the memory kind. */
fm_status fm_arena_init_backend_kind(fm_arena *a, const char *name, size_t capacity, const fm_backend *be,
                                     fm_buffer_kind kind);
/* The same of device memory (FM_BUFFER_DEVICE). */
static inline fm_status fm_arena_init_backend(fm_arena *a, const char *name, size_t capacity, const fm_backend *be) {
    return fm_arena_init_backend_kind(a, name, capacity, be, FM_BUFFER_DEVICE);
}

/* Charges the time from here on to `phase` (see prof_mark). */
static inline void fm_phase_mark(const fm_backend *be, fm_phase phase) { be->ops->prof_mark(be->ctx, phase); }

/* A linear layer with HF weights W [out,in], through the table's gemm:
 *   fm_linear_fwd: y [n,out] = x [n,in] W^T (y of type y_type: fm_act, or fp32 e.g. router logits)
 *   fm_linear_bwd: dx [n,in] = beta*dx + alpha * dy W (skipped when dx is NULL), dW += alpha * dy^T x */
static inline void fm_linear_fwd(const fm_backend *be, void *y, fm_dtype y_type, const fm_act *x, const fm_act *W,
                                 int64_t n, int64_t in, int64_t out) {
    be->ops->gemm(be->ctx, false, true, n, out, in, 1.0f, x, in, W, in, 0.0f, y, y_type, out);
}

static inline void fm_linear_bwd(const fm_backend *be, fm_act *dx, float beta, fm_act *dW, const fm_act *dy,
                                 const fm_act *x, const fm_act *W, int64_t n, int64_t in, int64_t out, float alpha) {
    if (dx) be->ops->gemm(be->ctx, false, false, n, in, out, alpha, dy, out, W, in, beta, dx, FM_ACT_DTYPE, in);
    be->ops->gemm(be->ctx, true, false, out, in, n, alpha, dy, out, x, in, 1.0f, dW, FM_ACT_DTYPE, in);
}

/* Whether be runs the FP8 experts' fast path (the fp8 code ops, above) for E experts of hidden H,
 * intermediate I over dispatches of up to rows_max rows: every op present and expert_fp8_serves. */
static inline bool fm_backend_fp8_codes_serves(const fm_backend *be, int64_t E, int64_t H, int64_t I,
                                               int64_t rows_max) {
    const fm_ops *o = be->ops;
    return o->expert_fp8_serves && o->fp8_quant_weight && o->fp8_quant_rows && o->fp8_quant_tokens &&
           o->expert_fp8_gemm && o->fp8_quant_dual && o->fp8_swiglu_bwd_quant && o->fp8_swiglu_fwd_quant &&
           o->expert_fp8_serves(be->ctx, E, H, I, rows_max);
}

/* The table's expert_linear_fwd/bwd, or one fm_linear call per expert with rows when the table
 * has none (same contract; see expert_linear_fwd). */
static inline void fm_expert_linear_fwd(const fm_backend *be, fm_act *y, const fm_act *x, const fm_act *W,
                                        const int64_t *offsets, int64_t E, int64_t in, int64_t out) {
    if (be->ops->expert_linear_fwd) {
        be->ops->expert_linear_fwd(be->ctx, y, x, W, offsets, E, in, out);
        return;
    }
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
        if (m == 0) continue;
        fm_linear_fwd(be, y + r0 * out, FM_ACT_DTYPE, x + r0 * in, W + e * out * in, m, in, out);
    }
}

static inline void fm_expert_linear_bwd(const fm_backend *be, fm_act *dx, float beta, fm_act *dW, const fm_act *dy,
                                        const fm_act *x, const fm_act *W, const int64_t *offsets, int64_t E,
                                        int64_t in, int64_t out) {
    if (be->ops->expert_linear_bwd) {
        be->ops->expert_linear_bwd(be->ctx, dx, beta, dW, dy, x, W, offsets, E, in, out);
        return;
    }
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
        if (m == 0) continue;
        if (!dW) { /* the dgrad alone */
            if (dx)
                be->ops->gemm(be->ctx, false, false, m, in, out, 1.0f, dy + r0 * out, out, W + e * out * in, in, beta,
                              dx + r0 * in, FM_ACT_DTYPE, in);
            continue;
        }
        fm_linear_bwd(be, dx ? dx + r0 * in : NULL, beta, dW + e * out * in, dy + r0 * out, x + r0 * in,
                      W + e * out * in, m, in, out, 1.0f);
    }
}

#ifdef __cplusplus
}
#endif
#endif
