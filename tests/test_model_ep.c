/* The model under expert parallelism and the vocabulary ring, at the level of the schedule
 * (src/model, src/schedule): errors come back as the step's status, and every expert precision
 * runs with --ep.
 *
 * 1. Errors: a communicator that fails its next collective (locally, on every rank alike, before
 *    any MPI call: no rank is left waiting) is armed between the forward and the backward; the
 *    backward must return its FM_ERR_IO (the vocabulary ring's in the head's backward, the EP
 *    operator's in a layer's backward), not FM_OK with the error parked in a field.
 * 2. Exactness (every expert precision: the backend's native, fp8 emulated, fp8 codes under the
 *    CPU's test hook, fm_backend_opts.cpu_fp8_codes): ep ranks each run their own sequence through a
 *    model holding E/ep experts (chunk cap c, K chunks); the reference is the one-rank model over
 *    all ranks' sequences together (B = ep) with the cap ep * c, so K is the same. With N_r even
 *    per rank and the strided chunks, chunk j of the reference holds chunk j of every rank, and an
 *    owner's rows of one expert come in the reference's order (source 0's in token order, then
 *    source 1's ...), so the fp8 tiles (128 rows of one expert per column tile, one row per row
 *    tile) and the quantized values are the same: what differs is only which rows share one
 *    expert GEMM and the order of the fp32 sums (dense gradients: summed over the ranks, here by
 *    an all-reduce). Compared: the loss (relative 1e-6), every dense gradient summed over the
 *    ranks and this rank's experts' gradients against the reference's (normalized error, max
 *    |got - ref| / max |ref|, <= 1e-5: fp32 reassociation over at most a few hundred terms of
 *    magnitude ~1). Each precision also runs with least-loaded placement (lambda 1, pieces of one
 *    row: the placement moves rows, checked), whose hosted experts the glue runs in the same
 *    precision (fp8: their weights quantized by the table from the weights received): the same
 *    bounds, but fp8's expert gradients at LLEP_FP8_EXPERT_TOL (below: the wgrad tiles split);
 *    and the expert arena is the EP bound with its LLEP part (native EP's plus the hosted
 *    experts' own fp8 operands, the table's working set).
 * Modes (argv[1]): all (under mpirun: tests/mpi_comm.sh np2, ctest mpi_model_ep_np2); anything else
 * (or a build without MPI): skipped, exit 77. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "comm/fm_comm.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "model/fm_experts.h"
#include "schedule/fm_schedule.h"
#include "train/fm_param_store.h"

/* fp8 with least-loaded placement, the experts' weight gradients against one rank: the forward
 * and the dgrads quantize per row (1 x 128) and per weight block (128 x 128), whichever rank runs
 * a row (the loss and the dense gradients keep their bounds below), but the wgrads' 128 x 1
 * column tiles run over one expert's rows at one rank, and a spilled expert's rows split between
 * its native rank and a helper: a tile's power-of-two scale may then change, each quantized
 * operand moves within its E4M3 rounding (2^-4 relative each side), and a product of two by at
 * most 4 x 2^-4 = 0.25 of its magnitude. Bound: normalized error 0.25 (measured on this test:
 * 0 emulated, 8.6e-7 on codes, where the split tiles kept their scales). */
#define LLEP_FP8_EXPERT_TOL 0.25

static fm_backend g_be, g_be_codes; /* g_be_codes: the CPU backend with the FP8 codes hook on */
static int g_rank, g_world;

/* ---- a communicator that fails its next collective once armed --------------------------------- */

static const fm_comm_ops *g_inner;
static fm_comm_ops g_failing;
static bool g_armed;
static int g_failed_calls;

static fm_status fail_now(void) {
    g_armed = false;
    g_failed_calls++;
    return fm_error(FM_ERR_IO, "rank %d: a planted failure of the next collective", g_rank);
}
static fm_status f_a2a(void *ctx, const void *send, const int64_t *sc, const int64_t *sd, void *recv,
                       const int64_t *rc, const int64_t *rd, fm_comm_dtype t, double to) {
    if (g_armed) return fail_now();
    return g_inner->all_to_all_v(ctx, send, sc, sd, recv, rc, rd, t, to);
}
static fm_status f_arh(void *ctx, void *buf, int64_t count, fm_comm_dtype t, fm_comm_op op, double to) {
    if (g_armed) return fail_now();
    return g_inner->all_reduce_host(ctx, buf, count, t, op, to);
}
static fm_status f_ar(void *ctx, const void *send, void *recv, int64_t count, fm_comm_dtype t, fm_comm_op op,
                      double to) {
    if (g_armed) return fail_now();
    return g_inner->all_reduce(ctx, send, recv, count, t, op, to);
}

static fm_comm failing_wrap(const fm_comm *c) {
    g_inner = c->ops;
    g_failing = *c->ops;
    g_failing.all_to_all_v = f_a2a;
    g_failing.all_reduce_host = f_arh;
    g_failing.all_reduce = f_ar;
    g_failing.mark = NULL, g_failing.all_to_all_v_async = NULL, g_failing.join = NULL; /* blocking */
    const fm_comm w = {&g_failing, c->ctx};
    return w;
}

/* ---- models ------------------------------------------------------------------------------------ */

typedef struct run_model {
    fm_model m;
    fm_param_store ps;
} run_model;

/* The test config: 4 experts (ep 2 divides them), k 2; H and I 128 for the fp8 codes' tiles. */
static fm_config test_config(bool wide) {
    fm_config c = fm_test_small_config(FM_MODEL_QWEN3_MOE, 2, false, 2);
    c.num_experts = 4;
    if (wide) {
        c.hidden_size = 128;
        c.moe_intermediate_size = 128;
        c.head_dim = 32;
        c.initializer_range = 0.05;
    }
    return c;
}

/* Model of ep ranks (this one `rank`; ep 1: all experts) laid out for B x T, with the chunk cap c
 * and lo's other fields; comm (the batch's ranks), ep_comm and vocab_comm set before the layout.
 * Weights: the one-rank model's from seed, by name (an ep model takes its experts' rows). */
static void model_make(run_model *r, const fm_config *c, int ep, int rank, int64_t B, int64_t T, fm_layout_opts lo,
                       const fm_comm *comm, const fm_comm *ep_comm, const fm_comm *vocab_comm, uint64_t seed) {
    memset(r, 0, sizeof *r);
    FM_ASSERT(fm_model_create_ep(&r->m, c, g_be, ep, rank) == FM_OK);
    FM_ASSERT(fm_param_store_create(&r->ps, &r->m, 0) == FM_OK);
    fm_model full;
    FM_ASSERT(fm_model_create(&full, c, g_be) == FM_OK);
    float *wf = malloc(sizeof(float) * (size_t)full.p.n_params), *we = malloc(sizeof(float) * (size_t)r->m.p.n_params);
    fm_params_init_weights_host(&full.p, seed, wf);
    for (int i = 0; i < r->m.p.n_tensors; i++) {
        const fm_param *p = &r->m.p.table[i], *q = fm_params_find(&full.p, p->name);
        FM_ASSERT(q && q->numel == p->numel);
        memcpy(we + p->offset, wf + q->offset, sizeof(float) * (size_t)p->numel);
    }
    fm_model_upload_master(&r->m, we);
    free(wf), free(we);
    fm_model_free(&full);
    r->m.mesh.comm = comm;
    r->m.mesh.moe_ep_comm = ep > 1 ? ep_comm : NULL;
    r->m.mesh.vocab_comm = vocab_comm;
    lo.ep = ep, lo.ep_rank = rank;
    CHECK_MSG(fm_model_layout(&r->m, B, T, &lo) == FM_OK, "layout: %s", fm_errmsg());
}

static void model_free(run_model *r) {
    fm_param_store_free(&r->ps);
    fm_model_free(&r->m);
}

/* Sequence s of the test's batch (T tokens and targets from seed and s). */
static void fill_seq(int32_t *tok, int32_t *tgt, int64_t T, int64_t V, uint64_t seed, int64_t s) {
    fm_rng r;
    fm_rng_seed(&r, seed * 1000 + (uint64_t)s);
    for (int64_t i = 0; i < T; i++) {
        tok[i] = (int32_t)fm_rng_below(&r, (uint64_t)V);
        tgt[i] = (int32_t)fm_rng_below(&r, (uint64_t)V);
    }
}

/* ---- 1. errors come back from the backward ------------------------------------------------------- */

static void test_errors(const fm_comm *world) {
    const fm_config c = test_config(false);
    const int64_t T = 8;
    fm_comm bad = failing_wrap(world);
    { /* the vocabulary ring's error in the head's backward */
        fm_layout_opts lo;
        memset(&lo, 0, sizeof lo);
        lo.ce_block_tokens = 4, lo.ce_block_vocab = 16, lo.vocab_ring = g_world;
        run_model r;
        model_make(&r, &c, 1, 0, 1, T, lo, NULL, NULL, &bad, 7);
        fm_batch *b = fm_test_batch_of(&r.m);
        fill_seq(b->tokens, b->targets, T, c.vocab_size, 7, g_rank);
        fm_loss l;
        CHECK_MSG(fm_schedule_default_forward(&r.m, b, &l) == FM_OK, "ring forward: %s", fm_errmsg());
        CHECK(isfinite(l.ce) && l.ce > 0);
        g_armed = true, g_failed_calls = 0;
        const fm_status st = fm_schedule_default_backward(&r.m, 1.0f);
        CHECK_MSG(st == FM_ERR_IO && strstr(fm_errmsg(), "planted") && g_failed_calls == 1,
                  "the ring's error in the head's backward: got %s (%s), %d failed calls", fm_status_name(st),
                  fm_errmsg(), g_failed_calls);
        g_armed = false;
        model_free(&r);
    }
    { /* the EP operator's error in a layer's backward */
        fm_layout_opts lo;
        memset(&lo, 0, sizeof lo);
        lo.moe_chunk_tokens = 4;
        run_model r;
        model_make(&r, &c, g_world, g_rank, 1, T, lo, NULL, &bad, NULL, 8);
        fm_batch *b = fm_test_batch_of(&r.m);
        fill_seq(b->tokens, b->targets, T, c.vocab_size, 8, g_rank);
        CHECK_MSG(fm_schedule_default_forward(&r.m, b, NULL) == FM_OK, "ep forward: %s", fm_errmsg());
        g_armed = true, g_failed_calls = 0;
        const fm_status st = fm_schedule_default_backward(&r.m, 1.0f);
        CHECK_MSG(st == FM_ERR_IO && strstr(fm_errmsg(), "planted") && strstr(fm_errmsg(), "moe_ep backward") &&
                      g_failed_calls == 1,
                  "the EP error in a layer's backward: got %s (%s), %d failed calls", fm_status_name(st), fm_errmsg(),
                  g_failed_calls);
        g_armed = false;
        /* the same through the fused step (fm_schedule_default_train_step) */
        g_armed = true;
        CHECK(fm_schedule_default_train_step(&r.m, b, 1.0f, NULL) == FM_ERR_IO && strstr(fm_errmsg(), "planted"));
        g_armed = false;
        model_free(&r);
    }
    /* the group still works: every rank failed at the same call, before any MPI traffic */
    int64_t one = 1;
    CHECK(fm_comm_allreduce_sum_i64(world, &one, 1, 30) == FM_OK && one == g_world);
}

/* ---- 2. every expert precision with --ep against one rank ------------------------------------ */

typedef enum prec { PREC_NATIVE, PREC_FP8_EMU, PREC_FP8_CODES } prec;
static const char *const prec_names[] = {"native", "fp8 emulated", "fp8 codes"};

/* max |got - ref| / max |ref| over n values */
static double nerr(const float *got, const float *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num = fmax(num, fabs((double)got[i] - (double)ref[i]));
        den = fmax(den, fabs((double)ref[i]));
    }
    return den > 0 ? num / den : num;
}

static void test_exact(const fm_comm *world, prec p, int64_t K, bool pipelined, bool cache, const fm_llep_opts *llep) {
    const int W = g_world;
    const fm_config c = test_config(p == PREC_FP8_CODES);
    const int64_t T = 8, c_tok = T / K; /* each rank: one sequence of T tokens, K chunks of c_tok */
    const fm_backend be_saved = g_be;
    if (p == PREC_FP8_CODES) g_be = g_be_codes; /* the CPU's codes path (the test hook, fm_backend_opts.cpu_fp8_codes) */
    fm_layout_opts lo;
    memset(&lo, 0, sizeof lo);
    lo.expert_fp8 = p != PREC_NATIVE;
    lo.expert_fp8_codes = p == PREC_FP8_CODES;
    lo.expert_fp8_cache = cache; /* --fp8-weight-cache (codes only): every layer's codes kept */
    lo.moe_chunk_tokens = c_tok;
    lo.llep = llep;
    run_model e, r;
    model_make(&e, &c, W, g_rank, 1, T, lo, world, world, NULL, 21);
    e.m.a.moe_ep_ws.schedule = pipelined ? FM_MOE_EP_PIPELINED : FM_MOE_EP_SERIAL;
    lo.moe_chunk_tokens = W * c_tok; /* the reference: all W sequences, the same K */
    lo.llep = NULL;
    model_make(&r, &c, 1, 0, W, T, lo, NULL, NULL, NULL, 21);
    CHECK(e.m.a.moe_K == K && r.m.a.moe_K == K);
    CHECK(e.m.a.moe_fp8 == (p != PREC_NATIVE) && e.m.a.moe_fp8_codes == (p == PREC_FP8_CODES) && !e.m.a.moe_sync_free &&
          e.m.a.opts.expert_fp8_cache == cache);
    /* plan = allocation: the expert live set is the EP bound with the fp8 part, as the planner asks it */
    const fm_moe_dims md = {c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, false,
                            lo.expert_fp8, lo.expert_fp8_codes, cache ? c.num_hidden_layers : 0};
    fm_moe_ep_bound eb;
    const size_t bound = fm_arena_round(fm_moe_ep_bound_bytes(&md, W, c_tok, sizeof(fm_act), llep, &eb));
    CHECK_MSG(e.m.a.arena[FM_LIVE_EXPERT].capacity == bound && (p == PREC_NATIVE) == (eb.fp8 == 0),
              "%s: the expert arena holds %zu bytes, the EP bound %zu (fp8 part %zu)", prec_names[p],
              e.m.a.arena[FM_LIVE_EXPERT].capacity, bound, eb.fp8);
    if (p != PREC_NATIVE) { /* the fp8 part is the experts table's working set at the owner */
        const fm_moe_dims dl = fm_moe_ep_local_dims(&md, W);
        CHECK(eb.fp8 == fm_experts_select(&dl)->ws_bytes(&dl, eb.rows_max, sizeof(fm_act)) && eb.fp8 > 0);
    }
    /* batches: rank q's sequence is sequence q of the reference */
    fm_batch *be = fm_test_batch_of(&e.m), *br = fm_test_batch_of(&r.m);
    for (int q = 0; q < W; q++) fill_seq(br->tokens + q * T, br->targets + q * T, T, c.vocab_size, 33, q);
    fill_seq(be->tokens, be->targets, T, c.vocab_size, 33, g_rank);
    fm_loss le, lr;
    fm_model_fp8_cache_invalidate(&e.m); /* as the trainer does at each step's start */
    fm_model_fp8_cache_invalidate(&r.m);
    memset(e.m.p.grads, 0, sizeof(fm_act) * (size_t)e.m.p.n_params);
    memset(r.m.p.grads, 0, sizeof(fm_act) * (size_t)r.m.p.n_params);
    CHECK_MSG(fm_schedule_default_train_step(&e.m, be, 1.0f, &le) == FM_OK, "%s ep step: %s", prec_names[p],
              fm_errmsg());
    CHECK_MSG(fm_schedule_default_train_step(&r.m, br, 1.0f, &lr) == FM_OK, "%s reference step: %s", prec_names[p],
              fm_errmsg());
    CHECK(e.m.a.arena[FM_LIVE_EXPERT].high <= bound);
    if (pipelined) CHECK(e.m.a.moe_ep_ws.pipelined_calls > 0);
    if (llep) { /* the placement moved rows (lambda 1, pieces of 1 row: any imbalance spills); the bound's LLEP part
                 * is native EP's plus, under fp8, the hosted experts' own operands (the table's working set) */
        fm_moe_ep_bound nb;
        const fm_moe_dims mn = {md.H, md.I, md.E, md.k}, dh = fm_moe_ep_hosted_dims(&md, llep->max_foreign);
        fm_moe_ep_bound_bytes(&mn, W, c_tok, sizeof(fm_act), llep, &nb);
        CHECK_MSG(e.m.a.moe_ep_ws.llep_chunks > 0 &&
                  eb.llep == nb.llep + fm_experts_select(&dh)->ws_bytes(&dh, eb.rows_max, sizeof(fm_act)) &&
                  (p == PREC_NATIVE) == (eb.llep == nb.llep),
                  "%s LLEP: %lld chunk passes moved rows, llep bound %zu (native %zu)", prec_names[p],
                  (long long)e.m.a.moe_ep_ws.llep_chunks, eb.llep, nb.llep);
    }
    const double rel_ce = fabs(le.ce - lr.ce) / fabs(lr.ce), rel_aux = fabs(le.aux - lr.aux) / fabs(lr.aux);
    CHECK_MSG(le.n_valid == lr.n_valid && rel_ce <= 2e-6 && rel_aux <= 2e-6 && fabs(le.z - lr.z) <= 2e-6 * fabs(lr.z),
              "%s K %lld: loss ce %.9g aux %.9g z %.9g (ep) vs %.9g %.9g %.9g (one rank)", prec_names[p], (long long)K,
              le.ce, le.aux, le.z, lr.ce, lr.aux, lr.z);
    /* gradients: the dense ones summed over the ranks, this rank's experts' as they are */
    float *g = malloc(sizeof(float) * (size_t)e.m.p.n_params);
    memcpy(g, e.m.p.grads, sizeof(float) * (size_t)e.m.p.n_params);
    CHECK(fm_comm_all_reduce(world, g, g, e.m.p.n_params, FM_COMM_F32, FM_COMM_SUM, 30) == FM_OK);
    double worst_dense = 0, worst_expert = 0;
    for (int i = 0; i < e.m.p.n_tensors; i++) {
        const fm_param *pe = &e.m.p.table[i], *pr = fm_params_find(&r.m.p, pe->name);
        FM_ASSERT(pr && pr->numel == pe->numel);
        const bool expert = strstr(pe->name, ".experts.") != NULL;
        const float *got = expert ? e.m.p.grads + pe->offset : g + pe->offset;
        const double err = nerr(got, r.m.p.grads + pr->offset, pe->numel);
        if (expert) worst_expert = fmax(worst_expert, err);
        else worst_dense = fmax(worst_dense, err);
        CHECK_MSG(err <= (expert && llep && p != PREC_NATIVE ? LLEP_FP8_EXPERT_TOL : 1e-5),
                  "%s K %lld%s%s%s: gradient of %s: normalized error %.3g", prec_names[p], (long long)K,
                  pipelined ? " pipelined" : "", cache ? " cache" : "", llep ? " llep" : "", pe->name, err);
    }
    if (g_rank == 0)
        printf("%s%s, ep %d, K %lld%s: ce %.9g (one rank %.9g); worst normalized gradient error: dense %.2g, "
               "experts %.2g\n", prec_names[p], cache ? " (weight cache)" : "", W, (long long)K,
               pipelined ? " (pipelined)" : llep ? " (LLEP)" : "", le.ce, lr.ce, worst_dense, worst_expert);
    free(g);
    model_free(&e);
    model_free(&r);
    g_be = be_saved;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "self";
    FM_ASSERT(fm_cpu_backend_init(&g_be, 1, 64) == FM_OK);
    fm_backend_opts bo = fm_backend_opts_default();
    bo.threads = 1, bo.max_head_dim = 64, bo.cpu_fp8_codes = true;
    FM_ASSERT(fm_cpu_backend_init_opts(&g_be_codes, &bo) == FM_OK);
    if (!strcmp(mode, "self") || !fm_comm_mpi_built()) {
        printf("test_model_ep runs under mpirun (tests/mpi_comm.sh np2: mpi_model_ep_np2): skipped\n");
        fm_cpu_backend_free(&g_be_codes);
        fm_cpu_backend_free(&g_be);
        return 77;
    }
    fm_comm world;
    FM_ASSERT(fm_comm_mpi_world(&world, NULL, 0, 0) == FM_OK);
    g_world = fm_comm_size(&world);
    g_rank = fm_comm_rank(&world);
    test_errors(&world);
    fm_llep_opts ll = fm_llep_defaults(); /* any imbalance spills, in pieces down to one row */
    ll.lambda = 1.0, ll.min_piece = 1;
    for (int p = PREC_NATIVE; p <= PREC_FP8_CODES; p++) {
        test_exact(&world, (prec)p, 1, false, false, NULL);
        test_exact(&world, (prec)p, 2, false, false, NULL);
        test_exact(&world, (prec)p, 2, true, false, NULL);
        test_exact(&world, (prec)p, 2, false, false, &ll);
    }
    test_exact(&world, PREC_FP8_CODES, 2, true, true, NULL);
    test_exact(&world, PREC_FP8_CODES, 2, false, true, &ll);
    int64_t fails = fm_test_failed;
    CHECK(fm_comm_allreduce_sum_i64(&world, &fails, 1, 30) == FM_OK);
    fm_comm_free(&world);
    CHECK(fm_comm_mpi_finalize() == FM_OK);
    fm_cpu_backend_free(&g_be_codes);
    fm_cpu_backend_free(&g_be);
    printf("rank %d of %d: ", g_rank, g_world);
    const int rc = fm_test_finish();
    return rc ? rc : fails ? 1 : 0;
}
