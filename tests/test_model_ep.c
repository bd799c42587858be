/* The model under expert parallelism and the vocabulary ring, at the level of the schedule
 * (src/model, src/schedule): errors come back as the step's status, and every expert precision
 * runs with --ep.
 *
 * 1. Errors: a communicator that fails its next collective (locally, on every rank alike, before
 *    any MPI call: no rank is left waiting) is armed between the forward and the backward; the
 *    backward must return its FM_ERR_IO (the vocabulary ring's in the head's backward, the EP
 *    operator's in a layer's backward), not FM_OK with the error parked in a field.
 * 2. Exactness (every expert precision: the backend's native, fp8 emulated, fp8 codes under the
 *    CPU's test hook FLATMOE_TEST_FP8_CODES=1): ep ranks each run their own sequence through a
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
 *    magnitude ~1).
 * Modes (argv[1]): all (under mpirun: tests/mpi_comm.sh np2, ctest mpi_model_ep_np2); anything else
 * (or a build without MPI): skipped, exit 77. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "comm/fm_comm.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "schedule/fm_schedule.h"
#include "train/fm_param_store.h"

static fm_backend g_be;
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
    float *wf = malloc(sizeof(float) * (size_t)full.n_params), *we = malloc(sizeof(float) * (size_t)r->m.n_params);
    fm_model_init_weights_host(&full, seed, wf);
    for (int i = 0; i < r->m.n_tensors; i++) {
        const fm_param *p = &r->m.table[i], *q = fm_model_find_param(&full, p->name);
        FM_ASSERT(q && q->numel == p->numel);
        memcpy(we + p->offset, wf + q->offset, sizeof(float) * (size_t)p->numel);
    }
    fm_model_upload_master(&r->m, we);
    free(wf), free(we);
    fm_model_free(&full);
    r->m.comm = comm;
    r->m.moe_ep_comm = ep > 1 ? ep_comm : NULL;
    r->m.vocab_comm = vocab_comm;
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

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "self";
    FM_ASSERT(fm_cpu_backend_init(&g_be, 1, 64) == FM_OK);
    if (!strcmp(mode, "self") || !fm_comm_mpi_built()) {
        printf("test_model_ep runs under mpirun (tests/mpi_comm.sh np2: mpi_model_ep_np2): skipped\n");
        fm_cpu_backend_free(&g_be);
        return 77;
    }
    fm_comm world;
    FM_ASSERT(fm_comm_mpi_world(&world, NULL, 0, 0) == FM_OK);
    g_world = fm_comm_size(&world);
    g_rank = fm_comm_rank(&world);
    test_errors(&world);
    int64_t fails = fm_test_failed;
    CHECK(fm_comm_allreduce_sum_i64(&world, &fails, 1, 30) == FM_OK);
    fm_comm_free(&world);
    CHECK(fm_comm_mpi_finalize() == FM_OK);
    fm_cpu_backend_free(&g_be);
    printf("rank %d of %d: ", g_rank, g_world);
    const int rc = fm_test_finish();
    return rc ? rc : fails ? 1 : 0;
}
