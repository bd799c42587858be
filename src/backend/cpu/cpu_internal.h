/* Internals shared by the CPU backend's files (not a public header): the context, the attention
 * scratch layout, and the op functions each file contributes to the table in cpu_backend.c.
 *
 * Determinism (the trainer promises bit-exact resume): every op computes each output element in
 * one fixed order. Parallel loops partition OUTPUTS (rows, columns, attention heads) among
 * threads and never split a sum across threads, except the double-precision reductions (sumsq,
 * ...), which use a fixed number of chunks independent of the thread count and a sequential
 * combine. No atomics. So the results do not even depend on the thread count, only on the
 * BLAS kernel (OpenBLAS partitions C among threads, never K).
 */
#ifndef FM_CPU_INTERNAL_H
#define FM_CPU_INTERNAL_H

#include "fm_backend_cpu.h"

/* Attention tiles (FlashAttention-2 block sizes Br x Bc): 64 x 64 fits L1/L2 at hd <= 128. */
#define FM_CPU_ATT_BR 64 /* default tiles (fm_cpu_backend_init) */
#define FM_CPU_ATT_BC 64

/* Fixed chunk count of the double-precision reductions (sumsq): the sum is the sequential sum
 * of FM_CPU_RED_CHUNKS partial sums, each over a fixed contiguous range, whatever the threads. */
#define FM_CPU_RED_CHUNKS 256

/* ---- a vectorized exp (GCC/Clang vector extensions: SSE on x86-64, NEON on aarch64) -------
 * libm's expf is scalar and dominated attention at hd <= 64 and the vocabulary softmax.
 * fm_cpu_exp4 is Cephes' expf (S. Moshier, Cephes Math Library, expf.c): n = round(x log2 e),
 * r = x - n ln 2 (in two parts, C1 + C2), exp(r) by a degree-7 polynomial, times 2^n built in
 * the exponent bits. Max relative error 1.4 ulp on [-87, 88]; x < -87.3 gives exactly 0 (no
 * denormals; so does -inf), x > 88 gives exp(88) = 1.65e38 (no inf). Pure arithmetic, so the
 * same bits on every call. */
typedef float fm_cpu_v4f __attribute__((vector_size(16)));
typedef int32_t fm_cpu_v4i __attribute__((vector_size(16)));

static inline fm_cpu_v4f fm_cpu_v4f_splat(float a) { return (fm_cpu_v4f){a, a, a, a}; }

/* mask ? a : b, lane by lane (mask lanes are 0 or -1). */
static inline fm_cpu_v4f fm_cpu_v4f_select(fm_cpu_v4i mask, fm_cpu_v4f a, fm_cpu_v4f b) {
    return (fm_cpu_v4f)(((fm_cpu_v4i)a & mask) | ((fm_cpu_v4i)b & ~mask));
}

static inline fm_cpu_v4f fm_cpu_exp4(fm_cpu_v4f x) {
    const fm_cpu_v4f hi = fm_cpu_v4f_splat(88.0f), lo = fm_cpu_v4f_splat(-87.3f);
    const fm_cpu_v4i under = x < lo;
    fm_cpu_v4f xc = fm_cpu_v4f_select(x > hi, hi, x);
    xc = fm_cpu_v4f_select(under, lo, xc);
    const fm_cpu_v4f fx = xc * 1.44269504088896341f + 0.5f;
    fm_cpu_v4i n = __builtin_convertvector(fx, fm_cpu_v4i); /* truncation toward zero */
    n += (fm_cpu_v4i)(__builtin_convertvector(n, fm_cpu_v4f) > fx); /* -1: floor for fx < 0 */
    const fm_cpu_v4f fn = __builtin_convertvector(n, fm_cpu_v4f);
    const fm_cpu_v4f r = xc - fn * 0.693359375f - fn * -2.12194440e-4f;
    fm_cpu_v4f y = fm_cpu_v4f_splat(1.9875691500e-4f);
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const fm_cpu_v4f p2 = (fm_cpu_v4f)((n + 127) << 23);
    return fm_cpu_v4f_select(under, fm_cpu_v4f_splat(0.0f), y * p2);
}

/* exp(x) of one float, the same bits as the lanes of fm_cpu_exp4. */
static inline float fm_cpu_expf(float x) { return fm_cpu_exp4(fm_cpu_v4f_splat(x))[0]; }

/* y[i] = exp(x[i] - sub) for i < n (y may equal x, or be NULL to only sum); returns
 * sum_i exp(x[i] - sub), added in four lanes (i mod 4) combined as (l0 + l1) + (l2 + l3): a
 * fixed order for a given n. */
static inline float fm_cpu_exp_sub_sum(float *y, const float *x, float sub, int64_t n) {
    const fm_cpu_v4f s4 = fm_cpu_v4f_splat(sub);
    fm_cpu_v4f acc = fm_cpu_v4f_splat(0.0f);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        fm_cpu_v4f v;
        __builtin_memcpy(&v, x + i, sizeof v);
        v = fm_cpu_exp4(v - s4);
        if (y) __builtin_memcpy(y + i, &v, sizeof v);
        acc += v;
    }
    if (i < n) {
        float t[4] = {0, 0, 0, 0};
        for (int64_t j = 0; j < n - i; j++) t[j] = x[i + j];
        fm_cpu_v4f v;
        __builtin_memcpy(&v, t, sizeof v);
        v = fm_cpu_exp4(v - s4);
        __builtin_memcpy(t, &v, sizeof v);
        for (int64_t j = n - i; j < 4; j++) t[j] = 0.0f;
        if (y)
            for (int64_t j = 0; j < n - i; j++) y[i + j] = t[j];
        __builtin_memcpy(&v, t, sizeof v);
        acc += v;
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

/* max(init, x[0..n)), four lanes then combined; NaN elements are skipped. */
static inline float fm_cpu_max(const float *x, int64_t n, float init) {
    fm_cpu_v4f m = fm_cpu_v4f_splat(init);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        fm_cpu_v4f v;
        __builtin_memcpy(&v, x + i, sizeof v);
        m = fm_cpu_v4f_select(v > m, v, m);
    }
    float r = init;
    for (int j = 0; j < 4; j++) r = m[j] > r ? m[j] : r;
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    return r;
}

typedef struct fm_cpu_ctx {
    int threads;          /* OpenMP team size of every parallel region (>= 1) */
    int64_t max_head_dim; /* attention scratch fits hd <= max_head_dim */
    size_t att_stride;    /* floats of attention scratch per thread (a multiple of 16) */
    float *att_scratch;   /* threads * att_stride floats, 64-byte aligned per thread */
    int64_t att_br, att_bc; /* attention tile: query rows x key columns */
    bool prof_on;         /* FLATMOE_PROFILE=1 at creation: per-phase wall-clock times */
    int prof_phase;       /* the phase being charged */
    double prof_last;     /* wall-clock seconds at the last mark */
    double prof_acc[FM_PHASE_COUNT]; /* seconds per phase since the last collect */
    uint64_t host_syncs;      /* calls that would make the host wait on a device (host_sync_count) */
    bool fp8_codes;           /* serve the FP8 code path (fm_backend_opts.cpu_fp8_codes: a test hook) */
} fm_cpu_ctx;

/* Floats of attention scratch one thread needs for head_dim <= max_head_dim and Br x Bc tiles
 * (see cpu_attention.c for the layout), rounded up to whole 64-byte lines. */
size_t fm_cpu_att_scratch_floats(int64_t max_head_dim, int64_t br, int64_t bc);

/* cpu_attention.c */
void fm_cpu_attention_fwd(void *ctx, float *out, float *lse, const float *q, const float *k,
                          const float *v, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                          int64_t hd, const int32_t *kv_start);
void fm_cpu_attention_bwd(void *ctx, float *dq, float *dk, float *dv, const float *dout,
                          const float *q, const float *k, const float *v, const float *out,
                          const float *lse, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                          int64_t hd, const int32_t *kv_start);
/* with attention sinks and a sliding window (fm_backend.h attention_ext_fwd / _bwd) */
void fm_cpu_attention_ext_fwd(void *ctx, float *out, float *lse, const float *q, const float *k, const float *v,
                              int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start,
                              const float *sinks, int64_t window);
void fm_cpu_attention_ext_bwd(void *ctx, float *dq, float *dk, float *dv, float *dsinks, const float *dout,
                              const float *q, const float *k, const float *v, const float *out, const float *lse,
                              int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start,
                              const float *sinks, int64_t window);

/* cpu_moe.c: router and dropless permutation */
void fm_cpu_router_fwd(void *ctx, float *probs, float *lse, int32_t *topk_idx, float *topk_w,
                       const float *logits, int64_t N, int64_t E, int64_t k, bool norm_topk);
void fm_cpu_router_bwd(void *ctx, float *dlogits, const float *dtopk_w,
                       const float *dprobs_per_expert, float z_scale, const float *probs,
                       const float *lse, const int32_t *topk_idx, const float *topk_w, int64_t N,
                       int64_t E, int64_t k, bool norm_topk);
void fm_cpu_router_loss_terms(void *ctx, double *terms, const float *count, const float *prob_sum,
                              const double *lse_sq, int64_t N, int64_t E);
void fm_cpu_router_aux_grad(void *ctx, float *dprobs, const float *count, double coef, int64_t N, int64_t E);
void fm_cpu_router_stats(void *ctx, float *count, float *prob_sum, double *lse_sq, const float *probs,
                           const float *lse, const int32_t *topk_idx, int64_t N, int64_t E,
                           int64_t k);
/* cpu_router_sigmoid.c: the sigmoid, group-limited, bias-corrected router (fm_backend.h) */
void fm_cpu_router_sigmoid_fwd(void *ctx, float *scores, float *lse, int32_t *topk_idx, float *topk_w,
                               const float *logits, const fm_act *bias, int64_t N, int64_t E, int64_t k,
                               int64_t n_group, int64_t topk_group, bool norm_topk, float scaling);
void fm_cpu_router_sigmoid_bwd(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                               const float *scores, const int32_t *topk_idx, int64_t N, int64_t E, int64_t k,
                               bool norm_topk, float scaling);
/* cpu_router_seq_aux.c: the sigmoid router's sequence-wise balance loss (fm_backend.h) */
void fm_cpu_router_seq_aux_fwd(void *ctx, double *term, const float *scores, const int32_t *topk_idx,
                               const int32_t *doc_start, int64_t B, int64_t T, int64_t E, int64_t k, double coef);
void fm_cpu_router_seq_aux_bwd(void *ctx, float *dlogits, const float *scores, const int32_t *topk_idx,
                               const int32_t *doc_start, int64_t B, int64_t T, int64_t E, int64_t k, double coef);
/* cpu_router_force.c: the forced routing of FLATMOE_TEST_FORCE_ROUTE (fm_backend.h router_force) */
void fm_cpu_router_force(void *ctx, int32_t *topk_idx, float *topk_w, const float *probs, int64_t N, int64_t E,
                         int64_t k, int64_t first, int percent, bool norm_topk, float scaling);
/* cpu_router_softmax_group.c: DeepSeek-V2's softmax router, greedy or group-limited (fm_backend.h) */
void fm_cpu_router_softmax_group_fwd(void *ctx, float *probs, float *lse, int32_t *topk_idx, float *topk_w,
                                     const float *logits, int64_t N, int64_t E, int64_t k, int64_t n_group,
                                     int64_t topk_group, float scaling);
void fm_cpu_router_softmax_group_bwd(void *ctx, float *dlogits, const float *dtopk_w, const float *dprobs_per_expert,
                                     float z_scale, const float *probs, const float *lse, const int32_t *topk_idx,
                                     int64_t N, int64_t E, int64_t k, float scaling);
/* cpu_router_replay.c: routing replay, the given experts weighted as the router weighs its own (fm_backend.h) */
void fm_cpu_router_replay(void *ctx, int32_t *topk_idx, float *topk_w, const float *probs, const int32_t *replay,
                          int64_t N, int64_t E, int64_t k, bool norm_topk, float eps, float scaling);
void fm_cpu_moe_route_index(void *ctx, int64_t *offsets, int32_t *row_route, int32_t *route_row,
                            const int32_t *topk_idx, int64_t N, int64_t E, int64_t k);
void fm_cpu_moe_gather(void *ctx, float *xe, const float *x, const int32_t *row_route, int64_t R,
                       int64_t k, int64_t H);
void fm_cpu_moe_gather_bwd(void *ctx, float *dx, const float *dxe, const int32_t *route_row,
                           int64_t N, int64_t k, int64_t H);
void fm_cpu_moe_combine_fwd(void *ctx, float *out, const float *ye, const float *topk_w,
                            const int32_t *route_row, int64_t N, int64_t k, int64_t H);
void fm_cpu_moe_combine_bwd(void *ctx, float *dye, float *dtopk_w, const float *dout,
                            const float *ye, const float *topk_w, const int32_t *route_row,
                            int64_t N, int64_t k, int64_t H);

/* cpu_slice.c: head slices (multi-head latent attention's assembly; fm_backend.h head_slice). */
void fm_cpu_head_slice(void *ctx, float *dst, fm_slice dst_at, const float *src, fm_slice src_at, int64_t N,
                       int64_t nh, int64_t d, int perm, float alpha, bool accumulate);

/* cpu_rows.c: row gather/scatter for the chunked MoE dispatch. */
void fm_cpu_gather_rows(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n,
                        int64_t row_bytes);
void fm_cpu_scatter_rows(void *ctx, void *dst, const void *src, const int32_t *idx, int64_t n,
                         int64_t row_bytes);

/* cpu_lce.c: the strip ops of linear cross-entropy (fm_backend.h, bounded/fm_linear_ce.c). */
void fm_cpu_lce_fold(void *ctx, float *m, float *z, float *tgt, float *ent, const float *strip,
                     const int32_t *targets, int64_t Nb, int64_t Vb, int64_t v0, bool first);
void fm_cpu_lce_finalize(void *ctx, float *loss, float *logprob, float *entropy, double *sums,
                           const float *m, const float *z, const float *tgt, const float *ent,
                           const int32_t *targets, const float *weights, int64_t Nb, int64_t V,
                           int32_t ignore_index);
void fm_cpu_lce_strip_grad(void *ctx, float *grad, const float *strip, const float *m,
                           const float *z, const int32_t *targets, const float *weights,
                           int64_t Nb, int64_t Vb, int64_t v0, int32_t ignore_index,
                           float grad_scale, float z_coef);
/* cpu_lce_ent.c: the logit gradient with the entropy term (fm_backend.h lce_strip_grad_ent) */
void fm_cpu_lce_strip_grad_ent(void *ctx, float *grad, const float *strip, const float *m, const float *z,
                               const int32_t *targets, const float *weights, const float *ent_w, const float *ent,
                               int64_t Nb, int64_t Vb, int64_t v0, int32_t ignore_index, float grad_scale,
                               float z_coef);
/* cpu_lce_topk.c: the running top-k of the logits across vocabulary blocks (fm_backend.h lce_topk_*) */
void fm_cpu_lce_topk_fold(void *ctx, float *topv, int32_t *topi, const float *strip, int64_t Nb, int64_t Vb,
                          int64_t v0, int64_t k, bool first);
void fm_cpu_lce_topk_finalize(void *ctx, float *out_lp, int32_t *out_id, const float *topv, const int32_t *topi,
                              const float *m, const float *z, int64_t Nb, int64_t k);

/* cpu_fp8.c: FP8 fake quantization (fm_backend.h quant_fp8_*; backend/fm_fp8.h's reference) */
void fm_cpu_quant_fp8_rows(void *ctx, float *y, const float *x, int64_t rows, int64_t cols);
void fm_cpu_quant_fp8_blocks(void *ctx, float *y, const float *x, int64_t mats, int64_t rows, int64_t cols);
void fm_cpu_quant_fp8_cols_grouped(void *ctx, float *y, const float *x, const int64_t *offsets, int64_t E,
                                   int64_t cols);
/* cpu_fp8_gemm.c: the FP8 code ops (fm_backend.h; the layouts' reference) */
bool fm_cpu_expert_fp8_serves(void *ctx, int64_t E, int64_t H, int64_t I, int64_t rows_max);
void fm_cpu_fp8_quant_weight(void *ctx, void *w8, const float *W, int64_t E, int64_t out, int64_t in);
void fm_cpu_fp8_quant_rows(void *ctx, void *a8, const float *a, const int64_t *offsets, int64_t rcap, int64_t E,
                           int64_t K);
void fm_cpu_fp8_quant_tokens(void *ctx, void *t8, const float *a, const int64_t *offsets, int64_t rcap, int64_t E,
                             int64_t C);
void fm_cpu_expert_fp8_gemm(void *ctx, int kind, float *C, float beta, const void *A8, const void *B8,
                            const int64_t *offsets, int64_t rcap, int64_t E, int64_t in, int64_t out);
void fm_cpu_fp8_quant_dual(void *ctx, void *a8, void *t8, const float *a, const int64_t *offsets, int64_t rcap,
                           int64_t E, int64_t K);
void fm_cpu_fp8_swiglu_bwd_quant(void *ctx, void *dg8, void *du8, void *dgT8, void *duT8, const float *dout,
                                 const float *gate, const float *up, const int64_t *offsets, int64_t rcap, int64_t E,
                                 int64_t I);
void fm_cpu_fp8_swiglu_fwd_quant(void *ctx, float *out, void *a8, const float *gate, const float *up,
                                 const int64_t *offsets, int64_t rcap, int64_t E, int64_t I);
/* cpu_backend.c: SwiGLU (fm_backend.h swiglu_fwd / swiglu_bwd; each element's value does not
 * depend on its position or on n, so the fused fp8 ops call them on a tile's values) */
void fm_cpu_swiglu_fwd(void *ctx, float *out, const float *gate, const float *up, int64_t n);
/* cpu_gpt_oss.c: GPT-OSS's clamped SwiGLU (fm_backend.h swiglu_clamp_fwd / _bwd), bias_add_f32. */
void fm_cpu_bias_add_f32(void *ctx, float *y, const float *b, int64_t N, int64_t D);
void fm_cpu_swiglu_clamp_fwd(void *ctx, float *out, const float *gate, const float *up, int64_t n, float limit,
                             float alpha);
void fm_cpu_swiglu_clamp_bwd(void *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                             const float *up, int64_t n, float limit, float alpha);
void fm_cpu_swiglu_bwd(void *ctx, float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                       int64_t n);

#endif
