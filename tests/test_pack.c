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
#include "data/fm_pack.h"
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
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    fm_loss l;
    CHECK(fm_schedule_default_forward(&m, &b, &l) == FM_OK);
    /* per-token losses (plain logits only: the linear CE keeps none) */
    o->loss = fm_malloc(sizeof(float) * 27);
    int64_t k = 0;
    for (int d = 0; d < NDOC; d++)
        for (int64_t j = 0; j < DOC_LEN[d]; j++) o->loss[k++] = ce_block ? 0.0f : m.a.token_loss[where[d][j]];
    CHECK(fm_schedule_default_backward(&m, 1.0f) == FM_OK);
    o->ce = l.ce;
    o->n_valid = l.n_valid;
    o->grads = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
    memcpy(o->grads, m.p.grads, sizeof(float) * (size_t)m.p.n_params);
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
            const double gd = rel_diff(p.grads, q.grads, m.p.n_params);
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

/* ---- the packer (data/fm_pack.h) ------------------------------------------------------------ */

enum { PK_N = 400, PK_T = 24, PK_ROWS = 3 };

/* A data set of tokens 0 .. PK_N-1 (each its own index, so a batch shows where it came from) in
 * documents of lengths 1 .. 40 (one of 1: skipped; several longer than a row). */
static int32_t g_pk_tok[PK_N];
static int64_t g_pk_docs[64];
static void pk_data(fm_dataset *ds) {
    for (int i = 0; i < PK_N; i++) g_pk_tok[i] = i;
    CHECK(fm_dataset_from_tokens(ds, g_pk_tok, PK_N, "packer test") == FM_OK);
    int64_t n = 0, at = 0;
    static const int64_t len[] = {7, 1, 30, 12, 3, 40, 9, 24, 25, 2, 18, 5};
    while (at < PK_N) {
        g_pk_docs[n] = at;
        at += len[n % 12];
        n++;
    }
    ds->docs = g_pk_docs;
    ds->n_docs = n;
}

/* Checks a batch: each row is documents' pieces then padding; a piece is consecutive data
 * tokens, each target the next token (within its document), positions from 0, doc_start the
 * piece's first column; seen[x] counts data token x as an input. */
static int64_t pk_check_batch(const fm_dataset *ds, const int32_t *tok, const int32_t *tgt, const int32_t *pos,
                              const int32_t *st, int64_t rows, int *seen) {
    int64_t valid = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < PK_T; t++) {
            const int64_t i = r * PK_T + t;
            CHECK(st[i] <= t && pos[i] == t - st[i]);
            if (tgt[i] == -100) continue; /* padding (token 0 of no document) */
            valid++;
            seen[tok[i]]++;
            CHECK_MSG(tgt[i] == tok[i] + 1, "row %lld col %lld: target %d after token %d", (long long)r, (long long)t,
                      tgt[i], tok[i]);
            if (pos[i] > 0) CHECK(tok[i] == tok[i - 1] + 1);
            /* the target stays in the token's document */
            int64_t d = 0;
            while (d + 1 < ds->n_docs && ds->docs[d + 1] <= tok[i]) d++;
            CHECK(tgt[i] < ds->docs[d] + fm_dataset_doc_len(ds, d));
        }
    return valid;
}

static void test_packer(void) {
    fm_dataset ds;
    pk_data(&ds);
    int64_t units = 0;
    for (int64_t d = 0; d < ds.n_docs; d++) units += fm_dataset_doc_len(&ds, d) - 1;
    fm_packer p;
    CHECK(fm_packer_init(&p, &ds, PK_T, PK_ROWS, false, false, 9) == FM_ERR_ARG); /* refuse: 40 > 24 */
    CHECK_MSG(strstr(fm_errmsg(), "--pack-long split") != NULL, "%s", fm_errmsg());
    for (int pad = 0; pad < 2; pad++) {
        CHECK(fm_packer_init(&p, &ds, PK_T, PK_ROWS, pad, true, 9) == FM_OK);
        int32_t tok[PK_ROWS * PK_T], tgt[PK_ROWS * PK_T], pos[PK_ROWS * PK_T], st[PK_ROWS * PK_T];
        int seen[PK_N] = {0};
        int64_t valid = 0, batches = 0;
        while (p.epoch == 0) {
            const int64_t e = fm_packer_fill(&p, PK_ROWS, tok, tgt, pos, st);
            if (e != 0) break;
            batches++;
            valid += pk_check_batch(&ds, tok, tgt, pos, st, PK_ROWS, seen);
            if (p.next == ds.n_docs) break;
        }
        /* one epoch: every training position exactly once */
        CHECK_MSG(valid == units, "pad %d: %lld targets in an epoch, expected %lld", pad, (long long)valid,
                  (long long)units);
        for (int64_t d = 0; d < ds.n_docs; d++) {
            const int64_t a = ds.docs[d], n = fm_dataset_doc_len(&ds, d);
            for (int64_t x = a; x < a + n; x++) CHECK(seen[x] == (x < a + n - 1 ? 1 : 0));
        }
        int64_t counted = 0;
        CHECK(fm_packer_count(&p, PK_ROWS, 1, &counted) == FM_OK);
        CHECK_MSG(counted == batches, "pad %d: fm_packer_count %lld, filled %lld", pad, (long long)counted,
                  (long long)batches);
        int64_t two = 0;
        CHECK(fm_packer_count(&p, PK_ROWS, 2, &two) == FM_OK);
        CHECK(two > counted && two <= 2 * counted + 1);
        /* packing uses fewer rows than padding */
        if (pad == 0) CHECK(batches * PK_ROWS * PK_T < units * 2);
        fm_packer_free(&p);
    }
    /* the cursor is the whole state: seek to a mid-epoch cursor, the same batches follow */
    fm_packer a, b;
    CHECK(fm_packer_init(&a, &ds, PK_T, PK_ROWS, false, true, 21) == FM_OK);
    CHECK(fm_packer_init(&b, &ds, PK_T, PK_ROWS, false, true, 21) == FM_OK);
    int32_t t1[PK_ROWS * PK_T], g1[PK_ROWS * PK_T], p1[PK_ROWS * PK_T], s1[PK_ROWS * PK_T];
    int32_t t2[PK_ROWS * PK_T], g2[PK_ROWS * PK_T], p2[PK_ROWS * PK_T], s2[PK_ROWS * PK_T];
    for (int i = 0; i < 11; i++) fm_packer_fill(&a, PK_ROWS, t1, g1, p1, s1); /* into the second epoch */
    CHECK(a.epoch >= 1);
    CHECK(fm_packer_seek(&b, a.epoch, a.next, a.done) == FM_OK);
    for (int i = 0; i < 6; i++) {
        const int64_t ea = fm_packer_fill(&a, PK_ROWS, t1, g1, p1, s1), eb = fm_packer_fill(&b, PK_ROWS, t2, g2, p2, s2);
        CHECK(ea == eb && !memcmp(t1, t2, sizeof t1) && !memcmp(g1, g2, sizeof g1) && !memcmp(p1, p2, sizeof p1) &&
              !memcmp(s1, s2, sizeof s1));
    }
    /* another seed, another order; epochs differ in order */
    CHECK(fm_packer_seek(&b, 0, 0, 0) == FM_OK);
    fm_packer c;
    CHECK(fm_packer_init(&c, &ds, PK_T, PK_ROWS, false, true, 22) == FM_OK);
    fm_packer_fill(&b, PK_ROWS, t1, g1, p1, s1);
    fm_packer_fill(&c, PK_ROWS, t2, g2, p2, s2);
    CHECK(memcmp(t1, t2, sizeof t1) != 0);
    CHECK(fm_packer_seek(&b, 0, ds.n_docs + 1, 0) == FM_ERR_ARG);
    fm_packer_free(&a), fm_packer_free(&b), fm_packer_free(&c);
    ds.docs = NULL; /* the test's own table */
    fm_dataset_free(&ds);
}

int main(void) {
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    test_batch_check();
    test_packer();
    test_packed_vs_padded();
    test_packing_matters();
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
