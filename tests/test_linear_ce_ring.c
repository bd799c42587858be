/* Ring-DTP (src/bounded/fm_linear_ce_ring.c) against the one-rank linear CE.
 *
 * Every rank builds the whole problem from the case's seed (all tokens' h, targets, weights, the
 * whole head W), runs fm_linear_ce on it alone (the reference: the one-rank operator over the
 * gathered problem), then its own part through the ring: its N_r tokens (counts differ per rank,
 * one rank has none and passes NULL buffers) and its shard of W. Compared: the per-token loss,
 * logprob and entropy of its tokens, dh of its tokens, dW of its shard (pre-filled: accumulated),
 * and the group's sums, to normalized error 1e-6 (max |got - ref| / max |ref|); with one rank
 * (the self communicator, or an MPI communicator of one rank) the same BITS. Shapes: V not a
 * multiple of the vocabulary block, shards of unequal size and an empty shard (V = 9 over 4
 * ranks: 3, 3, 3, 0), several token blocks, ignore_index targets, token weights, z-loss; both
 * modes forced and AUTO (checked against the rule); forward only, dh only, dW only.
 * Bound: the arena is exactly fm_linear_ce_ring_bound_bytes(group's largest N) bytes, painted;
 * the high-water mark and the bytes written stay within it, equal it on the rank with the most
 * tokens, ws->used is restored, and a measuring arena records the same peak.
 * Errors: one rank's bad argument (or an argument that differs between ranks) fails the call
 * with FM_ERR_ARG on every rank, never a hang.
 * Modes (argv[1]): self (default: the self communicator, no MPI), all (under mpirun: the world,
 * its split into single ranks and, with 4 ranks, into pairs; a host-staged communicator). */
#include "backend/cpu/fm_backend_cpu.h"
#include "bounded/fm_linear_ce.h"
#include "bounded/fm_linear_ce_ring.h"
#include "comm/fm_comm.h"
#include "core/fm_rng.h"
#include "fm_test.h"

static fm_backend g_be;
static int g_world_rank;

typedef struct ring_case {
    const char *name;
    int64_t H, V, Nb, Vb;
    int64_t n[8];    /* tokens per rank, by rank % 8 */
    double ignore_p; /* fraction of ignore_index targets */
    bool weights, zloss, outputs, dh, dW;
    fm_lce_ring_mode mode;
    uint64_t seed;
} ring_case;

static double nerr_f(const float *got, const float *ref, int64_t n) {
    double num = 0, den = 1e-30;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) return INFINITY;
        const double d = fabs((double)got[i] - ref[i]);
        num = d > num ? d : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return num / den;
}
static void fill(fm_rng *g, float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * fm_rng_normal(g));
}

/* Runs case c on comm (P ranks); returns false when a check failed (all checks print). */
static void run_case(const fm_comm *comm, const ring_case *c, const char *comm_name) {
    const int P = fm_comm_size(comm), r = fm_comm_rank(comm);
    const int64_t H = c->H, V = c->V;
    int64_t n[64], n_total = 0, n_max = 0, my0 = 0;
    FM_ASSERT(P <= 64);
    for (int q = 0; q < P; q++) {
        n[q] = c->n[q % 8];
        if (q < r) my0 += n[q];
        n_total += n[q];
        n_max = n[q] > n_max ? n[q] : n_max;
    }
    const int64_t N = n[r];
    int64_t off, rows;
    fm_lce_ring_shard(V, P, r, &off, &rows);

    /* the whole problem, the same on every rank */
    fm_rng g;
    fm_rng_seed(&g, c->seed);
    float *h = fnew(n_total * H), *W = fnew(V * H), *wt = fnew(n_total), *dW0 = fnew(V * H);
    int32_t *tg = inew(n_total);
    fill(&g, h, n_total * H, 1.0);
    fill(&g, W, V * H, 0.5);
    fill(&g, dW0, V * H, 0.01); /* the size of the increments: accumulation, without cancellation */
    for (int64_t t = 0; t < n_total; t++) {
        tg[t] = fm_rng_uniform_d(&g) < c->ignore_p ? -100 : (int32_t)fm_rng_below(&g, (uint64_t)V);
        wt[t] = 0.25f + fm_rng_uniform(&g);
    }
    fm_lce_opts lo = fm_lce_opts_default();
    lo.block_tokens = c->Nb;
    lo.block_vocab = c->Vb;
    lo.z_loss = c->zloss ? 1e-3f : 0.0f;
    const float gs = n_total ? 1.0f / (float)n_total : 1.0f;

    /* the reference: one rank, all tokens, the whole head */
    float *loss_ref = fnew(n_total), *lp_ref = fnew(n_total), *ent_ref = fnew(n_total);
    float *dh_ref = fnew(n_total * H), *dW_ref = fnew(V * H);
    memcpy(dW_ref, dW0, sizeof(float) * (size_t)(V * H));
    fm_lce_opts ref_o = lo;
    ref_o.token_weight = c->weights ? wt : NULL;
    ref_o.out_logprob = c->outputs ? lp_ref : NULL;
    ref_o.out_entropy = c->outputs ? ent_ref : NULL;
    fm_arena ref_ws;
    FM_ASSERT(fm_arena_init(&ref_ws, "reference", fm_linear_ce_bound_bytes(c->Nb, c->Vb)) == FM_OK);
    double sums_ref[2] = {0, 0};
    if (n_total > 0)
        fm_linear_ce(&g_be, &ref_ws, loss_ref, c->dh ? dh_ref : NULL, c->dW ? dW_ref : NULL, h, W, tg, n_total, H, V,
                     gs, &ref_o, sums_ref);

    /* this rank's part through the ring; a rank without tokens passes NULL for them */
    float *loss = N ? fnew(N) : NULL, *lp = N ? fnew(N) : NULL, *ent = N ? fnew(N) : NULL;
    float *dh = N && c->dh ? fnew(N * H) : NULL, *dW = rows && c->dW ? fnew(rows * H) : NULL;
    for (int64_t i = 0; dh && i < N * H; i++) dh[i] = NAN; /* ASSIGNED: every element written */
    if (dW) memcpy(dW, dW0 + off * H, sizeof(float) * (size_t)(rows * H));
    fm_lce_ring_opts ro = fm_lce_ring_opts_default();
    ro.lce = lo;
    ro.lce.token_weight = c->weights && N ? wt + my0 : NULL;
    ro.lce.out_logprob = c->outputs ? lp : NULL;
    ro.lce.out_entropy = c->outputs ? ent : NULL;
    ro.mode = c->mode;
    ro.timeout_s = 30;
    fm_lce_opts bound_o = lo;
    bound_o.token_weight = c->weights ? wt : NULL; /* non-NULL: "with weights" */
    bound_o.out_entropy = c->outputs ? ent_ref : NULL;
    const size_t bound = fm_linear_ce_ring_bound_bytes(c->mode, n_max, H, V, P, c->dh, c->dW, &bound_o);
    fm_arena ws;
    FM_ASSERT(fm_arena_init(&ws, "ring", bound ? bound : 64) == FM_OK);
    fm_arena_paint(&ws);
    double sums[2] = {-1, -1};
    fm_lce_ring_info info;
    memset(&info, 0, sizeof info);
    const fm_status st = fm_linear_ce_ring(&g_be, comm, &ws, loss, c->dh ? dh : NULL, c->dW ? dW : NULL,
                                           N ? h + my0 * H : NULL, rows ? W + off * H : NULL, N ? tg + my0 : NULL,
                                           N, H, V, gs, &ro, sums, &info);
    CHECK_MSG(st == FM_OK, "%s %s rank %d: %s", comm_name, c->name, r, fm_errmsg());

    char tag[160];
    snprintf(tag, sizeof tag, "%s P=%d %s rank %d (N %lld, shard [%lld,+%lld), %s)", comm_name, P, c->name, r,
             (long long)N, (long long)off, (long long)rows, fm_lce_ring_mode_name(info.mode));
    const fm_lce_ring_mode want_mode = c->mode != FM_LCE_RING_AUTO ? c->mode : fm_lce_ring_choose(n_max, V, P);
    CHECK_MSG(info.mode == want_mode && info.n_total == n_total && info.n_max == n_max, "%s: info mode %s n_total %lld",
              tag, fm_lce_ring_mode_name(info.mode), (long long)info.n_total);
    const int want_hops = n_max == 0 || P == 1 ? 0
                          : c->dh || c->dW   ? 2 * (P - 1)
                          : want_mode == FM_LCE_RING_ACTIVATIONS ? P : P - 1;
    CHECK_MSG(info.hops == want_hops, "%s: %d hops, expected %d", tag, info.hops, want_hops);

    /* results */
    if (P == 1) { /* the one-rank operator's op sequence: the same bits */
        bool same = memcmp(sums, sums_ref, sizeof sums) == 0;
        same = same && (!N || !memcmp(loss, loss_ref, sizeof(float) * (size_t)N));
        same = same && (!dh || !memcmp(dh, dh_ref, sizeof(float) * (size_t)(N * H)));
        same = same && (!dW || !memcmp(dW, dW_ref, sizeof(float) * (size_t)(rows * H)));
        same = same && (!c->outputs || !N || (!memcmp(lp, lp_ref, sizeof(float) * (size_t)N) &&
                                              !memcmp(ent, ent_ref, sizeof(float) * (size_t)N)));
        CHECK_MSG(same, "%s: not bit-identical to fm_linear_ce (sums %.17g vs %.17g)", tag, sums[0], sums_ref[0]);
    }
    const double tol = 1e-6;
    CHECK_MSG(fabs(sums[0] - sums_ref[0]) <= tol * fmax(fabs(sums_ref[0]), 1e-30) &&
              fabs(sums[1] - sums_ref[1]) <= tol * fmax(fabs(sums_ref[1]), 1e-30),
              "%s: sums %.9g %.9g vs one-rank %.9g %.9g", tag, sums[0], sums[1], sums_ref[0], sums_ref[1]);
    if (N) {
        const double el = nerr_f(loss, loss_ref + my0, N);
        CHECK_MSG(el <= tol, "%s: loss nerr %.3g", tag, el);
        if (c->outputs) {
            const double e1 = nerr_f(lp, lp_ref + my0, N), e2 = nerr_f(ent, ent_ref + my0, N);
            CHECK_MSG(e1 <= tol && e2 <= tol, "%s: logprob nerr %.3g, entropy nerr %.3g", tag, e1, e2);
        }
    }
    if (dh) {
        const double e = nerr_f(dh, dh_ref + my0 * H, N * H);
        CHECK_MSG(e <= tol, "%s: dh nerr %.3g", tag, e);
    }
    if (dW) {
        /* dW carries the pre-fill: compare the increments, the part the operator computed */
        float *inc = fnew(rows * H), *inc_ref = fnew(rows * H);
        for (int64_t i = 0; i < rows * H; i++) {
            inc[i] = dW[i] - dW0[off * H + i];
            inc_ref[i] = dW_ref[off * H + i] - dW0[off * H + i];
        }
        const double e = nerr_f(inc, inc_ref, rows * H), e_abs = nerr_f(dW, dW_ref + off * H, rows * H);
        CHECK_MSG(e <= tol && e_abs <= tol, "%s: dW increment nerr %.3g, dW nerr %.3g", tag, e, e_abs);
        free(inc);
        free(inc_ref);
    }

    /* bound: the peak and the bytes written, and the measuring arena */
    const size_t touched = fm_arena_touched(&ws);
    CHECK_MSG(ws.used == 0 && ws.high <= bound && touched <= bound && info.ws_bytes == ws.high,
              "%s: arena used %zu high %zu touched %zu bound %zu info %zu", tag, ws.used, ws.high, touched, bound,
              info.ws_bytes);
    const bool fullest = N == n_max; /* this rank's own state, where WEIGHTS keeps it, is the largest */
    CHECK_MSG(!fullest || ws.high == bound, "%s: the rank with the most tokens took %zu of a bound of %zu", tag,
              ws.high, bound);
    fm_arena meas;
    fm_arena_init_measure(&meas, "ring measure");
    CHECK(fm_linear_ce_ring(&g_be, comm, &meas, loss, c->dh ? dh : NULL, c->dW ? dW : NULL, N ? h + my0 * H : NULL,
                            rows ? W + off * H : NULL, N ? tg + my0 : NULL, N, H, V, gs, &ro, NULL, NULL) == FM_OK);
    CHECK_MSG(meas.high == ws.high && meas.used == 0, "%s: measured %zu, ran %zu", tag, meas.high, ws.high);

    /* the group's valid count */
    int64_t valid = -1, valid_ref = 0;
    for (int64_t t = 0; t < n_total; t++) valid_ref += tg[t] != -100;
    CHECK(fm_linear_ce_ring_valid_count(comm, N ? tg + my0 : NULL, N, -100, 30, &valid) == FM_OK && valid == valid_ref);

    fm_arena_free(&ws);
    fm_arena_free(&ref_ws);
    free(h), free(W), free(wt), free(dW0), free(tg), free(loss_ref), free(lp_ref), free(ent_ref), free(dh_ref);
    free(dW_ref), free(loss), free(lp), free(ent), free(dh), free(dW);
}

static const ring_case g_cases[] = {
    /* name           H   V   Nb Vb  tokens per rank               ign   wts  zl   out  dh    dW    mode */
    {"act", 16, 37, 4, 8, {13, 0, 7, 21, 5, 9, 1, 2}, 0.2, false, false, false, true, true, FM_LCE_RING_ACTIVATIONS, 11},
    {"weights", 16, 37, 4, 8, {13, 0, 7, 21, 5, 9, 1, 2}, 0.2, false, false, false, true, true, FM_LCE_RING_WEIGHTS, 12},
    {"act-all-opts", 12, 45, 3, 7, {6, 11, 0, 4, 3, 8, 2, 5}, 0.3, true, true, true, true, true,
     FM_LCE_RING_ACTIVATIONS, 13},
    {"weights-all-opts", 12, 45, 3, 7, {6, 11, 0, 4, 3, 8, 2, 5}, 0.3, true, true, true, true, true,
     FM_LCE_RING_WEIGHTS, 14},
    {"act-empty-shard", 8, 9, 2, 2, {3, 0, 5, 2, 1, 4, 2, 3}, 0.1, true, true, true, true, true,
     FM_LCE_RING_ACTIVATIONS, 15},
    {"weights-empty-shard", 8, 9, 2, 2, {3, 0, 5, 2, 1, 4, 2, 3}, 0.1, true, true, true, true, true,
     FM_LCE_RING_WEIGHTS, 16},
    {"act-fwd-only", 16, 37, 4, 8, {13, 0, 7, 21, 5, 9, 1, 2}, 0.2, true, true, true, false, false,
     FM_LCE_RING_ACTIVATIONS, 17},
    {"weights-fwd-only", 16, 37, 4, 8, {13, 0, 7, 21, 5, 9, 1, 2}, 0.2, true, true, true, false, false,
     FM_LCE_RING_WEIGHTS, 18},
    {"act-dh-only", 16, 37, 5, 6, {9, 0, 3, 12, 5, 9, 1, 2}, 0.2, true, false, false, true, false,
     FM_LCE_RING_ACTIVATIONS, 19},
    {"weights-dW-only", 16, 37, 5, 6, {9, 0, 3, 12, 5, 9, 1, 2}, 0.2, true, false, false, false, true,
     FM_LCE_RING_WEIGHTS, 20},
    {"auto-small-n", 16, 64, 4, 8, {3, 0, 5, 2, 4, 1, 3, 2}, 0.2, false, true, false, true, true, FM_LCE_RING_AUTO,
     21},
    {"auto-large-n", 16, 21, 8, 4, {40, 0, 33, 25, 17, 29, 31, 9}, 0.2, false, true, false, true, true,
     FM_LCE_RING_AUTO, 22},
    {"all-ignored", 8, 19, 4, 4, {5, 0, 3, 7, 2, 1, 1, 1}, 1.0, false, false, true, true, true, FM_LCE_RING_AUTO, 23},
    {"no-tokens", 8, 19, 4, 4, {0, 0, 0, 0, 0, 0, 0, 0}, 0.0, false, false, false, true, true, FM_LCE_RING_AUTO, 24},
};

static void run_cases(const fm_comm *comm, const char *comm_name) {
    for (size_t i = 0; i < sizeof g_cases / sizeof g_cases[0]; i++) run_case(comm, &g_cases[i], comm_name);
}

/* ---- errors: one rank's bad argument fails the call on every rank -------------------------- */

static void expect_all(const fm_comm *comm, fm_status got, fm_status want, const char *what) {
    CHECK_MSG(got == want, "rank %d of %d: %s: got %s (%s), expected %s", fm_comm_rank(comm), fm_comm_size(comm),
              what, fm_status_name(got), fm_errmsg(), fm_status_name(want));
}

static void test_errors(const fm_comm *comm) {
    const int P = fm_comm_size(comm), r = fm_comm_rank(comm);
    const int64_t H = 4, V = 10, N = 3;
    int64_t off, rows;
    fm_lce_ring_shard(V, P, r, &off, &rows);
    float h[12] = {0}, W[40] = {0}, loss[3], dh[12], dW[40];
    int32_t tg[3] = {1, 2, 3};
    double sums[2];
    fm_arena ws;
    FM_ASSERT(fm_arena_init(&ws, "ring errors", 1 << 16) == FM_OK);
    fm_lce_ring_opts ro = fm_lce_ring_opts_default();
    ro.timeout_s = 30;
    const fm_act *Ws = rows ? W : NULL;
    /* the last rank passes a negative N: every rank fails, none hangs */
    fm_status s = fm_linear_ce_ring(&g_be, comm, &ws, loss, dh, dW, h, Ws, tg, r == P - 1 ? -1 : N, H, V, 1, &ro,
                                    sums, NULL);
    expect_all(comm, s, FM_ERR_ARG, "a negative N on the last rank");
    if (r == P - 1) CHECK(strstr(fm_errmsg(), "N = -1 tokens"));
    else CHECK(strstr(fm_errmsg(), "was given bad arguments"));
    /* V differs on rank 0 */
    s = fm_linear_ce_ring(&g_be, comm, &ws, loss, dh, dW, h, Ws, tg, N, H, r == 0 && P > 1 ? V + 1 : V, 1, &ro, sums,
                          NULL);
    if (P > 1) {
        expect_all(comm, s, FM_ERR_ARG, "V differing on rank 0");
        CHECK(strstr(fm_errmsg(), "V differs between the ranks"));
    }
    /* token weights on rank 0 only (every rank has tokens) */
    float wt[3] = {1, 1, 1};
    ro.lce.token_weight = r == 0 ? wt : NULL;
    s = fm_linear_ce_ring(&g_be, comm, &ws, loss, dh, dW, h, Ws, tg, N, H, V, 1, &ro, sums, NULL);
    if (P > 1) {
        expect_all(comm, s, FM_ERR_ARG, "token weights on rank 0 only");
        CHECK(strstr(fm_errmsg(), "token_weight is given on some ranks"));
    }
    ro.lce.token_weight = NULL;
    /* a bad mode; NULL targets with tokens */
    ro.mode = (fm_lce_ring_mode)7;
    expect_all(comm, fm_linear_ce_ring(&g_be, comm, &ws, loss, dh, dW, h, Ws, tg, N, H, V, 1, &ro, sums, NULL),
               FM_ERR_ARG, "mode 7");
    ro.mode = FM_LCE_RING_AUTO;
    expect_all(comm, fm_linear_ce_ring(&g_be, comm, &ws, loss, dh, dW, h, Ws, r == 0 ? NULL : tg, N, H, V, 1, &ro,
                                       sums, NULL), FM_ERR_ARG, "NULL targets on rank 0");
    /* and the ring still works afterwards */
    expect_all(comm, fm_linear_ce_ring(&g_be, comm, &ws, loss, dh, dW, h, Ws, tg, N, H, V, 1, &ro, sums, NULL), FM_OK,
               "good arguments after the bad ones");
    CHECK(ws.used == 0);
    int64_t valid;
    expect_all(comm, fm_linear_ce_ring_valid_count(comm, r == 0 ? NULL : tg, N, -100, 30, &valid), FM_ERR_ARG,
               "valid_count with NULL targets on rank 0");
    fm_arena_free(&ws);
}

/* The bound formula's pieces for one shape, written out (fm_linear_ce_ring.h). */
static void test_bound_formula(void) {
    const int64_t H = 64, V = 1000, P = 4, S = 250, n = 100;
    const size_t strip = fm_arena_round(100 * 250 * 4); /* Nb = min(1024, 100), Vb = min(4096, 250) */
    const size_t msg = 5 * fm_arena_round(100 * 4) + 2 * fm_arena_round(100 * 64 * 4); /* tg, m, z, tgt + h, dh */
    CHECK(fm_linear_ce_ring_bound_bytes(FM_LCE_RING_ACTIVATIONS, n, H, V, P, true, false, NULL) ==
          strip + 2 * (msg - fm_arena_round(100 * 4)));
    CHECK(fm_linear_ce_ring_bound_bytes(FM_LCE_RING_WEIGHTS, n, H, V, P, true, true, NULL) ==
          strip + 2 * 2 * fm_arena_round(S * H * 4) + 3 * fm_arena_round(100 * 4));
    CHECK(fm_linear_ce_ring_bound_bytes(FM_LCE_RING_AUTO, n, H, V, P, true, true, NULL) ==
          fm_linear_ce_ring_bound_bytes(FM_LCE_RING_ACTIVATIONS, n, H, V, P, true, true, NULL));
    CHECK(fm_lce_ring_choose(250, V, 4) == FM_LCE_RING_ACTIVATIONS && fm_lce_ring_choose(251, V, 4) == FM_LCE_RING_WEIGHTS);
    CHECK(fm_linear_ce_ring_bound_bytes(FM_LCE_RING_WEIGHTS, 0, H, V, P, true, true, NULL) == 0);
    /* bf16 elements: half the messages, plus the strip's act copy */
    CHECK(fm_linear_ce_ring_bound_bytes_a(FM_LCE_RING_WEIGHTS, n, H, V, P, false, true, NULL, 2) ==
          fm_arena_round(100 * 250 * 4) + fm_arena_round(100 * 250 * 2) + 2 * 2 * fm_arena_round(S * H * 2) +
              3 * fm_arena_round(100 * 4));
    /* forward only: no act copy of the strip, no accumulator */
    CHECK(fm_linear_ce_ring_bound_bytes_a(FM_LCE_RING_WEIGHTS, n, H, V, P, false, false, NULL, 2) ==
          fm_arena_round(100 * 250 * 4) + 2 * fm_arena_round(S * H * 2) + 3 * fm_arena_round(100 * 4));
    int64_t b, rows, total = 0;
    for (int r = 0; r < 4; r++) {
        fm_lce_ring_shard(9, 4, r, &b, &rows);
        CHECK(b == (r < 3 ? 3 * r : 9) && rows == (r < 3 ? 3 : 0));
        total += rows;
    }
    CHECK(total == 9);
}

static int finish(const fm_comm *world) {
    int64_t fails = fm_test_failed; /* every rank's verdict, so one rank's failure fails the job */
    if (world) CHECK(fm_comm_allreduce_sum_i64(world, &fails, 1, 30) == FM_OK);
    printf("rank %d: ", g_world_rank);
    const int rc = fm_test_finish();
    return rc ? rc : (fails ? 1 : 0);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "self";
    FM_ASSERT(fm_cpu_backend_init(&g_be, 1, 64) == FM_OK);
    if (!strcmp(mode, "self")) {
        fm_comm self;
        FM_ASSERT(fm_comm_self_create(&self, NULL, 0) == FM_OK);
        test_bound_formula();
        run_cases(&self, "self");
        test_errors(&self);
        fm_comm_free(&self);
        const int rc = finish(NULL);
        fm_cpu_backend_free(&g_be);
        return rc;
    }
    if (strcmp(mode, "all") != 0) {
        fprintf(stderr, "usage: test_linear_ce_ring [self|all]   (all: under mpirun)\n");
        return 2;
    }
    if (!fm_comm_mpi_built()) {
        printf("the mpi communicator is not in this build: skipped\n");
        return 77;
    }
    fm_comm world;
    FM_ASSERT(fm_comm_mpi_world(&world, NULL, 30, 0) == FM_OK);
    g_world_rank = fm_comm_rank(&world);
    const int W = fm_comm_size(&world);
    run_cases(&world, "mpi");
    test_errors(&world);
    fm_comm one, pair;
    FM_ASSERT(world.ops->split(world.ctx, g_world_rank, 0, &one) == FM_OK); /* P = 1 over MPI: the same bits */
    run_cases(&one, "mpi-single");
    fm_comm_free(&one);
    if (W == 4) {
        FM_ASSERT(world.ops->split(world.ctx, g_world_rank / 2, 0, &pair) == FM_OK);
        run_cases(&pair, "mpi-pair");
        fm_comm_free(&pair);
    }
    /* a backend claiming device memory: the communicator stages through 256-byte host buffers */
    fm_ops staged_ops = *g_be.ops;
    staged_ops.host_memory = false;
    const fm_backend cpu = g_be;
    g_be.ops = &staged_ops;
    fm_comm staged;
    FM_ASSERT(fm_comm_mpi_world(&staged, &g_be, 30, 256) == FM_OK);
    run_case(&staged, &g_cases[2], "mpi-staged");
    run_case(&staged, &g_cases[3], "mpi-staged");
    fm_comm_free(&staged);
    /* a host-memory communicator over it: refused on every rank */
    {
        float loss[1];
        double sums[2];
        fm_arena ws;
        FM_ASSERT(fm_arena_init(&ws, "ring", 4096) == FM_OK);
        expect_all(&world, fm_linear_ce_ring(&g_be, &world, &ws, loss, NULL, NULL, NULL, NULL, NULL, 0, 4, 8, 1, NULL,
                                             sums, NULL), FM_ERR_ARG, "a host communicator over device memory");
        fm_arena_free(&ws);
    }
    g_be = cpu;
    const int rc = finish(&world);
    fm_comm_free(&world);
    FM_ASSERT(fm_comm_mpi_finalize() == FM_OK);
    fm_cpu_backend_free(&g_be);
    return rc;
}
