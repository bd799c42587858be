/* Packed documents (issue 28; model/fm_batch.h pos and doc_start, the backend's kv_start and
 * RoPE positions): three documents of different lengths packed into one row give the same
 * per-token losses, mean loss and gradients as the same documents each in its own padded row,
 * for each model_type, plain and with recompute, chunked MoE and the linear cross-entropy.
 *
 * Tolerance (CPU fp32): the packed row runs the same operations on the same values, but the
 * attention's key tiles and the GEMMs see other row offsets and tile shapes (zeros added at the
 * masked keys, other blockings in OpenBLAS), so only the summation order differs. Reassociating a
 * sum of n fp32 terms moves it by at most about n * 2^-24 of the sum of magnitudes; with the
 * longest sum here (a GEMM or attention row of <= 48 terms, chained over 2 layers) that is well
 * under 1e-5, and the measured differences are at the 1e-7 level. The check is DESIGN.md §5's
 * rule for a reassociation: relative 1e-6 per-token loss (against max(1, |loss|)), normalized
 * 1e-6 on the whole gradient vector. The router's load-balancing and z losses are off here:
 * they average over every token of the micro-batch, padding included, so they differ between a
 * row of 48 padded tokens and three rows of 16 by construction, not by a bug.
 *
 * The documents' own checks: fm_batch_check refuses a doc_start that goes backwards or skips,
 * and a pos beyond its token. */
#include <math.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "model/fm_model.h"
#include "schedule/fm_schedule.h"

static fm_backend g_be;

enum { NDOC = 3, T_ROW = 32, T_PAD = 16 };
static const int64_t DOC_LEN[NDOC] = {5, 13, 9}; /* 27 tokens: the packed row has 5 of padding */

typedef struct run_out {
    double ce;
    int64_t n_valid;
    float *loss; /* per-token loss of each document's tokens, in document order [27] */
    float *grads;
} run_out;

static double rel_diff(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        const double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

/* The documents' tokens and targets, the same for both layouts: doc d's token j. */
static void doc_token(uint64_t seed, int d, int64_t j, int64_t V, int32_t *tok, int32_t *tgt) {
    fm_rng r;
    fm_rng_seed(&r, seed * 1000003u + (uint64_t)d * 1009u + (uint64_t)j);
    *tok = (int32_t)fm_rng_below(&r, (uint64_t)V);
    *tgt = j == DOC_LEN[d] - 1 ? -100 : (int32_t)fm_rng_below(&r, (uint64_t)V); /* the last: no next token */
}

/* One forward and backward of the documents, packed (one row of T_ROW with pos and doc_start)
 * or padded (NDOC rows of T_PAD, no document fields: plain causal rows). */
static void run(fm_config *cfg, bool packed, int64_t chunk, int64_t ce_block, bool recompute, run_out *o) {
    const int64_t B = packed ? 1 : NDOC, T = packed ? T_ROW : T_PAD, V = cfg->vocab_size;
    const int64_t L = cfg->num_hidden_layers;
    fm_model m;
    CHECK(fm_test_model_create(&m, cfg, g_be) == FM_OK);
    bool rc[8] = {false};
    for (int64_t l = 0; l < L; l++) rc[l] = recompute && l % 2 == 0;
    fm_layout_opts lo = {rc, chunk, ce_block, ce_block ? 7 : 0};
    CHECK(fm_model_layout(&m, B, T, &lo) == FM_OK);
    fm_model_init_weights(&m, 5);
    fm_batch b;
    CHECK(fm_batch_alloc(&b, B, T, true) == FM_OK);
    if (packed) CHECK(fm_batch_alloc_docs(&b) == FM_OK);
    int64_t where[NDOC][T_PAD]; /* the batch index of doc d's token j */
    for (int64_t i = 0; i < B * T; i++) b.targets[i] = -100; /* padding: token 0, no loss */
    int64_t off = 0;
    for (int d = 0; d < NDOC; d++) {
        for (int64_t j = 0; j < DOC_LEN[d]; j++) {
            const int64_t i = packed ? off + j : d * T + j;
            doc_token(77, d, j, V, &b.tokens[i], &b.targets[i]);
            where[d][j] = i;
            if (packed) {
                b.pos[i] = (int32_t)j;
                b.doc_start[i] = (int32_t)off;
            }
        }
        off += DOC_LEN[d];
    }
    if (packed) /* the rest of the row: the padding document */
        for (int64_t i = off; i < T; i++) {
            b.pos[i] = (int32_t)(i - off);
            b.doc_start[i] = (int32_t)off;
        }
    CHECK(fm_batch_check(&b, B, T, V) == FM_OK);
    memset(m.grads, 0, sizeof(float) * (size_t)m.n_params);
    fm_loss l;
    CHECK(fm_schedule_default_forward(&m, &b, &l) == FM_OK);
    /* per-token losses (plain logits only: the linear CE keeps none) */
    o->loss = fm_malloc(sizeof(float) * 27);
    int64_t k = 0;
    for (int d = 0; d < NDOC; d++)
        for (int64_t j = 0; j < DOC_LEN[d]; j++) o->loss[k++] = ce_block ? 0.0f : m.token_loss[where[d][j]];
    CHECK(fm_schedule_default_backward(&m, 1.0f) == FM_OK);
    o->ce = l.ce;
    o->n_valid = l.n_valid;
    o->grads = fm_malloc(sizeof(float) * (size_t)m.n_params);
    memcpy(o->grads, m.grads, sizeof(float) * (size_t)m.n_params);
    fm_batch_free(&b);
    fm_test_model_free(&m);
}

static void test_packed_vs_padded(void) {
    const fm_model_type types[3] = {FM_MODEL_QWEN3_MOE, FM_MODEL_OLMOE, FM_MODEL_MIXTRAL};
    struct { int64_t chunk, ce; bool rc; } variants[] = {{0, 0, false}, {7, 0, true}, {0, 8, false}};
    for (int t = 0; t < 3; t++)
        for (int v = 0; v < 3; v++) {
            fm_config cfg = fm_test_small_config(types[t], 2, t == 1, 2);
            cfg.router_aux_loss_coef = 0.0;
            cfg.router_z_loss_coef = 0.0;
            run_out p, q;
            run(&cfg, true, variants[v].chunk, variants[v].ce, variants[v].rc, &p);
            run(&cfg, false, variants[v].chunk, variants[v].ce, variants[v].rc, &q);
            CHECK_MSG(p.n_valid == q.n_valid && p.n_valid == 24, "%s: %lld vs %lld valid targets (expected 24)",
                      cfg.model_type_name, (long long)p.n_valid, (long long)q.n_valid);
            CHECK_MSG(fabs(p.ce - q.ce) <= 1e-6 * fmax(1.0, fabs(q.ce)), "%s variant %d: mean loss %.9g packed vs "
                      "%.9g padded", cfg.model_type_name, v, p.ce, q.ce);
            double worst = 0;
            for (int i = 0; i < 27; i++) {
                const double e = fabs((double)p.loss[i] - q.loss[i]) / fmax(1.0, fabs(q.loss[i]));
                worst = e > worst ? e : worst;
            }
            CHECK_MSG(worst <= 1e-6, "%s variant %d: per-token loss differs by %.3g", cfg.model_type_name, v, worst);
            fm_model m;
            CHECK(fm_test_model_create(&m, &cfg, g_be) == FM_OK);
            const double gd = rel_diff(p.grads, q.grads, m.n_params);
            fm_test_model_free(&m);
            CHECK_MSG(gd <= 1e-6, "%s variant %d: gradients differ by %.3g (normalized)", cfg.model_type_name, v, gd);
            printf("  %s chunk %lld ce %lld rc %d: loss %.9g / %.9g, worst token %.2g, grads %.2g\n",
                   cfg.model_type_name, (long long)variants[v].chunk, (long long)variants[v].ce, variants[v].rc, p.ce,
                   q.ce, worst, gd);
            fm_free(p.loss), fm_free(q.loss), fm_free(p.grads), fm_free(q.grads);
        }
}

/* Packing changes the result: the same row without the documents (attention across the
 * boundaries, positions running on) gives a different loss, so the check above can fail. */
static void test_packing_matters(void) {
    fm_config cfg = fm_test_small_config(FM_MODEL_QWEN3_MOE, 2, false, 2);
    cfg.router_aux_loss_coef = 0.0;
    cfg.router_z_loss_coef = 0.0;
    run_out p, q;
    run(&cfg, true, 0, 0, false, &p);
    run(&cfg, false, 0, 0, false, &q);
    /* doc 1's tokens attend doc 0 when packed without documents: run it without pos/doc_start */
    fm_model m;
    CHECK(fm_test_model_create(&m, &cfg, g_be) == FM_OK);
    CHECK(fm_model_layout(&m, 1, T_ROW, NULL) == FM_OK);
    fm_model_init_weights(&m, 5);
    fm_batch b;
    CHECK(fm_batch_alloc(&b, 1, T_ROW, true) == FM_OK);
    for (int64_t i = 0; i < T_ROW; i++) b.targets[i] = -100;
    int64_t off = 0;
    for (int d = 0; d < NDOC; d++) {
        for (int64_t j = 0; j < DOC_LEN[d]; j++) doc_token(77, d, j, cfg.vocab_size, &b.tokens[off + j], &b.targets[off + j]);
        off += DOC_LEN[d];
    }
    fm_loss l;
    CHECK(fm_schedule_default_forward(&m, &b, &l) == FM_OK);
    CHECK_MSG(fabs(l.ce - q.ce) > 1e-4, "without documents the loss %.9g should differ from the padded %.9g", l.ce,
              q.ce);
    fm_batch_free(&b);
    fm_test_model_free(&m);
    fm_free(p.loss), fm_free(q.loss), fm_free(p.grads), fm_free(q.grads);
}

static void test_batch_check(void) {
    fm_batch b;
    CHECK(fm_batch_alloc(&b, 2, 6, true) == FM_OK);
    CHECK(fm_batch_alloc_docs(&b) == FM_OK);
    CHECK(fm_batch_check(&b, 2, 6, 10) == FM_OK);
    b.doc_start[3] = 2; /* neither the previous token's (0) nor 3 */
    CHECK(fm_batch_check(&b, 2, 6, 10) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "position 3") != NULL, "%s", fm_errmsg());
    b.doc_start[3] = 3;
    b.pos[3] = 0;
    b.doc_start[4] = 3;
    b.pos[4] = 1;
    b.doc_start[5] = 3;
    b.pos[5] = 2;
    CHECK(fm_batch_check(&b, 2, 6, 10) == FM_OK);
    b.pos[5] = 6; /* beyond its token */
    CHECK(fm_batch_check(&b, 2, 6, 10) == FM_ERR_ARG);
    b.pos[5] = 2;
    b.doc_start[6] = 1; /* row 1 starts with a document at 0 */
    CHECK(fm_batch_check(&b, 2, 6, 10) == FM_ERR_ARG);
    b.doc_start[6] = 0;
    int32_t *keep = b.pos;
    b.pos = NULL; /* both or neither */
    CHECK(fm_batch_check(&b, 2, 6, 10) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "both") != NULL, "%s", fm_errmsg());
    b.pos = keep;
    fm_batch_free(&b);
}

int main(void) {
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    test_batch_check();
    test_packed_vs_padded();
    test_packing_matters();
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
