/* Packed documents on the engine of this build (issue 28): three documents of 5, 13 and 9 tokens
 * packed into one row of 32 (positions restarting, attention stopping at each start: fm_batch.h
 * pos / doc_start) against the same documents each in its own padded row of 16 (plain causal
 * rows): the same per-token losses, mean loss and gradients. Built twice by CMake from this one
 * source, as test_cuda_model.c: test_cuda_model_pack (label gpu) on the CUDA backend, fm_act bf16,
 * our attention kernels (packed batches never go to cuDNN: cuda_attention.cu), and
 * test_model_pack_ab on the CPU backend, fp32 (so the test itself runs where there is no GPU).
 * For each model_type (test_cuda_model.c's small GPU-shaped configs), plain and with chunked MoE,
 * recompute and the linear cross-entropy.
 *
 * Tolerances. fp32 (CPU): the same operations on the same values in another order only (tiles and
 * GEMM blockings at other row offsets): 1e-6 relative (DESIGN.md §5) for losses, as tests/test_pack.c;
 * gradients at 5e-6 (below).
 * bf16 (CUDA): the packed row's attention tiles see other key partitions, so the running maximum
 * and the probabilities P rounded to bf16 (u = 2^-8) differ per element, and cuBLAS may pick
 * other kernels for 32 and 48 rows (fp32 accumulation order, which flips a bf16 rounding of an
 * output). Each is an unbiased rounding of relative size u; through 3 layers of chained products
 * (attention, projections, experts, the head) the normalized error of the gradient is a few u:
 * bounded by 8u = 3.1e-2, as test_cuda_model.c bounds chained roundings; per-token losses move
 * by about u times the logits' spread: 2e-2 absolute (the losses are ~5), the mean by 5e-3
 * relative. The router's load-balancing and z losses are off: they average over every token of
 * the micro-batch, padding included, which differs between the two layouts by construction. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/fm_backend_default.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "model/fm_model.h"
#include "schedule/fm_schedule.h"

#ifdef FM_ACT_BF16
#define PK_TOK_ABS 2e-2
#define PK_MEAN_REL 5e-3
#define PK_GRAD 3.1e-2
#else
#define PK_TOK_ABS 1e-6 /* times max(1, |loss|) */
#define PK_MEAN_REL 1e-6
#define PK_GRAD 5e-6 /* the gradients: sums of up to K = 64 terms reassociated by the other row
                        offsets' GEMM blockings, gamma_64 = 64 u = 3.8e-6 (Higham 3.1), as
                        test_model_ab bounds them; measured 6.9e-7 here (tests/test_pack.c keeps
                        1e-6 on its own smaller shapes) */
#endif

static fm_backend g_be;

enum { NDOC = 3, T_ROW = 32, T_PAD = 16, NTOK = 27 };
static const int64_t DOC_LEN[NDOC] = {5, 13, 9};

static fm_config pk_config(fm_model_type t) {
    fm_config c;
    memset(&c, 0, sizeof c);
    c.model_type = t;
    snprintf(c.model_type_name, sizeof c.model_type_name, "%s",
             t == FM_MODEL_QWEN3_MOE ? "qwen3_moe" : t == FM_MODEL_OLMOE ? "olmoe" : "mixtral");
    c.vocab_size = 200;
    c.hidden_size = 64;
    c.moe_intermediate_size = 32;
    c.num_hidden_layers = 3;
    c.num_attention_heads = t == FM_MODEL_QWEN3_MOE ? 8 : 4;
    c.num_key_value_heads = t == FM_MODEL_OLMOE ? 4 : 2;
    c.head_dim = t == FM_MODEL_OLMOE ? 8 : 16;
    c.max_position_embeddings = 1024;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.rope_theta = 10000;
    c.rms_norm_eps = 1e-5;
    c.norm_topk_prob = t != FM_MODEL_OLMOE;
    c.tie_word_embeddings = t == FM_MODEL_MIXTRAL;
    c.initializer_range = 0.1;
    c.qk_norm = t == FM_MODEL_QWEN3_MOE ? FM_QK_NORM_PER_HEAD : t == FM_MODEL_OLMOE ? FM_QK_NORM_FULL : FM_QK_NORM_NONE;
    return c;
}

static float act_to_f32(const void *raw, int64_t i) {
#ifdef FM_ACT_BF16
    uint16_t h;
    memcpy(&h, (const char *)raw + 2 * i, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
#else
    float f;
    memcpy(&f, (const char *)raw + 4 * i, 4);
    return f;
#endif
}

typedef struct pk_out {
    double ce;
    int64_t n_valid;
    float loss[NTOK]; /* per-token loss of each document token, in document order (plain logits) */
    float *g;         /* [n_params] gradients as fp32 */
    int64_t n;
} pk_out;

static void doc_token(int d, int64_t j, int32_t *tok, int32_t *tgt) {
    fm_rng r;
    fm_rng_seed(&r, 77u * 1000003u + (uint64_t)d * 1009u + (uint64_t)j);
    *tok = (int32_t)fm_rng_below(&r, 200);
    *tgt = j == DOC_LEN[d] - 1 ? -100 : (int32_t)fm_rng_below(&r, 200);
}

static void run(const fm_config *cfg, bool packed, int64_t chunk, int64_t ce, bool rc_on, pk_out *o) {
    const int64_t B = packed ? 1 : NDOC, T = packed ? T_ROW : T_PAD;
    fm_model m;
    CHECK(fm_test_model_create(&m, cfg, g_be) == FM_OK);
    bool rc[3] = {rc_on, false, rc_on};
    fm_layout_opts lo = {rc, chunk, ce, ce ? 64 : 0, 0, false};
    CHECK(fm_model_layout(&m, B, T, &lo) == FM_OK);
    CHECK(fm_model_init_weights(&m, 9) == FM_OK);
    fm_batch b;
    CHECK(fm_batch_alloc(&b, B, T, true) == FM_OK);
    if (packed) CHECK(fm_batch_alloc_docs(&b) == FM_OK);
    for (int64_t i = 0; i < B * T; i++) b.targets[i] = -100;
    int64_t where[NTOK], k = 0, off = 0;
    for (int d = 0; d < NDOC; d++) {
        for (int64_t j = 0; j < DOC_LEN[d]; j++) {
            const int64_t i = packed ? off + j : d * T + j;
            doc_token(d, j, &b.tokens[i], &b.targets[i]);
            where[k++] = i;
            if (packed) b.pos[i] = (int32_t)j, b.doc_start[i] = (int32_t)off;
        }
        off += DOC_LEN[d];
    }
    if (packed)
        for (int64_t i = off; i < T; i++) b.pos[i] = (int32_t)(i - off), b.doc_start[i] = (int32_t)off;
    const size_t gb = sizeof(fm_act) * (size_t)m.p.n_params;
    m.be.ops->mem_set(m.be.ctx, m.p.grads, 0, gb);
    fm_loss l;
    CHECK(fm_schedule_default_forward(&m, &b, &l) == FM_OK);
    memset(o->loss, 0, sizeof o->loss);
    if (!ce) {
        float *tl = malloc(sizeof(float) * (size_t)m.a.N);
        FM_ASSERT(tl);
        m.be.ops->copy(m.be.ctx, tl, m.a.token_loss, sizeof(float) * (size_t)m.a.N, FM_COPY_D2H);
        for (int i = 0; i < NTOK; i++) o->loss[i] = tl[where[i]];
        free(tl);
    }
    CHECK(fm_schedule_default_backward(&m, 1.0f) == FM_OK);
    void *raw = malloc(gb);
    o->g = malloc(sizeof(float) * (size_t)m.p.n_params);
    FM_ASSERT(raw && o->g);
    m.be.ops->copy(m.be.ctx, raw, m.p.grads, gb, FM_COPY_D2H);
    for (int64_t i = 0; i < m.p.n_params; i++) o->g[i] = act_to_f32(raw, i);
    free(raw);
    o->n = m.p.n_params;
    o->ce = l.ce;
    o->n_valid = l.n_valid;
    fm_batch_free(&b);
    fm_test_model_free(&m);
}

static double nerr(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

int main(void) {
    fm_backend_opts bo = fm_backend_opts_default();
    bo.threads = 0;
    bo.max_head_dim = 16;
    bo.attention = FM_ATTENTION_FALLBACK;
    fm_status s = fm_backend_default_init_opts(&g_be, &bo);
    CHECK_MSG(s == FM_OK, "backend init: %s", fm_errmsg());
    if (s) return fm_test_finish();
    printf("backend %s\n", g_be.ops->name);
    const fm_model_type types[3] = {FM_MODEL_QWEN3_MOE, FM_MODEL_OLMOE, FM_MODEL_MIXTRAL};
    struct { int64_t chunk, ce; bool rc; } var[3] = {{0, 0, false}, {8, 0, true}, {0, 16, false}};
    for (int t = 0; t < 3; t++)
        for (int v = 0; v < 3; v++) {
            const fm_config cfg = pk_config(types[t]);
            pk_out p, q;
            run(&cfg, true, var[v].chunk, var[v].ce, var[v].rc, &p);
            run(&cfg, false, var[v].chunk, var[v].ce, var[v].rc, &q);
            double worst = 0;
            for (int i = 0; i < NTOK; i++) {
                const double e = fabs((double)p.loss[i] - q.loss[i]);
#ifdef FM_ACT_BF16
                worst = fmax(worst, e);
#else
                worst = fmax(worst, e / fmax(1.0, fabs(q.loss[i])));
#endif
            }
            const double ge = nerr(p.g, q.g, p.n), me = fabs(p.ce - q.ce) / fmax(1.0, fabs(q.ce));
            printf("  %-9s chunk %2lld ce %2lld rc %d: loss %.6f / %.6f, worst token %.2e, grads %.2e\n",
                   cfg.model_type_name, (long long)var[v].chunk, (long long)var[v].ce, var[v].rc, p.ce, q.ce, worst,
                   ge);
            CHECK_MSG(p.n_valid == q.n_valid && p.n_valid == NTOK - NDOC, "%s: valid targets %lld vs %lld",
                      cfg.model_type_name, (long long)p.n_valid, (long long)q.n_valid);
            CHECK_MSG(me <= PK_MEAN_REL, "%s variant %d: mean loss %.9g vs %.9g", cfg.model_type_name, v, p.ce, q.ce);
            CHECK_MSG(worst <= PK_TOK_ABS, "%s variant %d: per-token loss differs by %.3g", cfg.model_type_name, v,
                      worst);
            CHECK_MSG(ge <= PK_GRAD, "%s variant %d: gradients differ by %.3g (normalized)", cfg.model_type_name, v, ge);
            free(p.g), free(q.g);
        }
    fm_backend_default_free(&g_be);
    return fm_test_finish();
}
