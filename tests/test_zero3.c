/* ZeRO-3 (train/fm_zero3.h) on the CPU backend:
 *  - the shard arithmetic, for groups of sizes that are and are not multiples of W, a group
 *    smaller than W (the ranks past it own padding only) and W = 1 .. 8: pieces aligned and
 *    covering each group once, the owner of every parameter, pack/unpack inverse with zero
 *    padding, a group's all-gather (the W pieces concatenated) equal to its flat range then
 *    zeros, a reduce-scatter (each rank's block the sum over ranks); the planned bytes of a
 *    config equal the store's layout for its model, tied and untied;
 *  - the whole parts of --zero 3 beside --ep (test_keep);
 *  - the hook on one rank (the self communicator, W = 1: gathers are copies, reduce-scatters the
 *    identity): 2 steps of G micro-batches through the schedule with the group hook against the
 *    default schedule on a plain store: the losses, the gradients and, after the update
 *    (fm_zero3_update against the whole table's), the weights and Adam moments bit-identical when
 *    each gradient is one contribution (G = 1, untied); with G = 2 or a tied head the shard adds
 *    each micro-batch's (and the head's and embedding's) reduce-scattered gradient where the
 *    table accumulates in place, so they agree to fp32 rounding (1e-5 of each buffer's scale,
 *    losses 1e-6 relative; the gradients' sum of squares 1e-12 when exact, else 1e-6); before each
 *    layer's forward both that layer and the next group are in the slots (the prefetch is issued
 *    before the layer computes); one reduce-scatter per group per
 *    micro-batch (tied: one more, the head's part of the embedding's gradient). */
#include <stdio.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "comm/fm_comm.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "schedule/fm_schedule.h"
#include "train/fm_zero3.h"

static fm_backend g_be;

static void test_arith(void) {
    /* groups: 130 (not a multiple of anything), 64, 5 (smaller than most W), 1000, 7 */
    const int64_t sizes[5] = {130, 64, 5, 1000, 7};
    int64_t begin[6] = {0};
    for (int g = 0; g < 5; g++) begin[g + 1] = begin[g] + sizes[g];
    const int64_t n = begin[5];
    float full[1206], back[1206];
    for (int64_t i = 0; i < n; i++) full[i] = (float)(i + 1);
    const int Ws[5] = {1, 2, 3, 4, 8};
    for (int wi = 0; wi < 5; wi++) {
        const int W = Ws[wi];
        fm_zero3 z;
        CHECK(fm_zero3_layout(&z, begin, 5, false, 0, W) == FM_OK);
        int64_t S = 0, mx = 0;
        for (int g = 0; g < 5; g++) {
            CHECK(z.piece[g] % FM_SHARD_ALIGN == 0 && (int64_t)W * z.piece[g] >= sizes[g]);
            CHECK((int64_t)W * (z.piece[g] - FM_SHARD_ALIGN) < sizes[g]); /* no whole aligned block wasted per rank */
            CHECK(z.local[g] == S);
            S += z.piece[g];
            if (z.piece[g] > mx) mx = z.piece[g];
        }
        CHECK(z.shard_len == S && z.slot_len == W * mx && z.gbuf_len == z.slot_len && z.n_params == n);
        static float local[8][1600];
        FM_ASSERT(S <= 1600);
        memset(back, 0, sizeof back);
        for (int q = 0; q < W; q++) {
            fm_zero3_pack(&z, q, full, local[q], sizeof(float));
            fm_zero3_unpack(&z, q, local[q], back, sizeof(float));
        }
        CHECK_MSG(!memcmp(full, back, sizeof(float) * (size_t)n), "W %d: pack/unpack is not the identity", W);
        for (int64_t p = 0; p < n; p++) {
            int q;
            int64_t o;
            fm_zero3_owner(&z, p, &q, &o);
            CHECK_MSG(q >= 0 && q < W && o >= 0 && o < S && local[q][o] == full[p], "W %d: parameter %lld", W,
                      (long long)p);
        }
        for (int g = 0; g < 5; g++) { /* the all-gather of group g: its range, then zeros */
            bool ok = true, tail = true;
            for (int q = 0; q < W; q++)
                for (int64_t j = 0; j < z.piece[g]; j++) {
                    const int64_t e = (int64_t)q * z.piece[g] + j;
                    const float v = local[q][z.local[g] + j];
                    if (e < sizes[g]) ok &= v == full[begin[g] + e];
                    else tail &= v == 0.0f;
                }
            CHECK_MSG(ok && tail, "W %d group %d: the gathered group is not its range then zeros", W, g);
            if (sizes[g] <= (int64_t)(W - 1) * z.piece[g]) { /* the last rank owns padding only */
                int64_t f = 0;
                for (int64_t j = 0; j < z.piece[g]; j++) f += local[W - 1][z.local[g] + j] != 0.0f;
                CHECK(f == 0);
            }
        }
        /* reduce-scatter: rank q's full gradient of group 3 is (q + 1) x full; block r of the sum
         * is the owner's piece of (sum_q (q + 1)) x full */
        const int g = 3;
        const float mult = (float)(W * (W + 1) / 2);
        for (int r = 0; r < W; r++)
            for (int64_t j = 0; j < z.piece[g]; j++) {
                const int64_t e = (int64_t)r * z.piece[g] + j;
                float sum = 0;
                for (int q = 0; q < W; q++) sum += e < sizes[g] ? (float)(q + 1) * full[begin[g] + e] : 0.0f;
                const float want = e < sizes[g] ? mult * local[r][z.local[g] + j] : 0.0f;
                if (sum != want) {
                    CHECK_MSG(0, "W %d: reduce-scatter element %lld of rank %d", W, (long long)j, r);
                    r = W;
                    break;
                }
            }
        fm_zero3_free(&z);
    }
    /* a bad layout */
    fm_zero3 z;
    CHECK(fm_zero3_layout(&z, begin, 5, false, 2, 2) == FM_ERR_ARG && strstr(fm_errmsg(), "rank 2 of 2"));
    int64_t bad[3] = {0, 10, 5};
    CHECK(fm_zero3_layout(&z, bad, 2, false, 0, 2) == FM_ERR_ARG && strstr(fm_errmsg(), "group 1"));
    /* the plan's bytes from a config equal the store's for its model */
    for (int tied = 0; tied < 2; tied++)
        for (int W = 1; W <= 8; W *= 2) {
            const fm_config c = fm_test_small_config(FM_MODEL_QWEN3_MOE, 3, tied, 2);
            fm_model m;
            FM_ASSERT(fm_model_create(&m, &c, g_be) == FM_OK);
            CHECK(fm_zero3_layout_params(&z, &m.p, W - 1, W) == FM_OK);
            CHECK(z.tied == (bool)tied && z.n_groups == 5 && z.begin[5] == m.p.n_params);
            const size_t want = fm_zero3_store_bytes(&z, 4) + fm_adamw_state_bytes(z.shard_len, false);
            char desc[200];
            CHECK_MSG(fm_zero3_state_bytes(&c, 4, W, false, desc) == want, "tied %d W %d: planned %zu, laid out %zu",
                      tied, W, fm_zero3_state_bytes(&c, 4, W, false, NULL), want);
            CHECK(strstr(desc, "ZeRO-3") != NULL);
            if (tied) CHECK(z.gbuf_len >= (int64_t)W * (z.piece[0] + z.piece[4]));
            fm_zero3_free(&z);
            fm_model_free(&m);
        }
}

/* --zero 3 beside --ep (the whole parts): a layout whose layer groups keep their trailing
 * experts whole: the pieces cover only each group's head, the whole parts follow all pieces in
 * group order on every rank, pack/unpack over the ranks is the identity (each rank's own whole
 * part), the slots are sized by the pieces only; bad keeps refused; and the planned bytes of a
 * config with ep = 2, 4 equal the store's layout for fm_model_create_ep's model, tied and untied
 * (world rank < ep counts the whole parts). */
static void test_keep(void) {
    const int64_t sizes[4] = {130, 1000, 700, 7}, keep[4] = {0, 600, 512, 0};
    int64_t begin[5] = {0};
    for (int g = 0; g < 4; g++) begin[g + 1] = begin[g] + sizes[g];
    const int64_t n = begin[4];
    static float full[1837], back[1837], local[4][2400];
    for (int64_t i = 0; i < n; i++) full[i] = (float)(i + 1);
    for (int W = 1; W <= 4; W++) {
        fm_zero3 z;
        CHECK(fm_zero3_layout_keep(&z, begin, keep, 4, false, 0, W, true) == FM_OK);
        int64_t P = 0, mx = 0;
        for (int g = 0; g < 4; g++) {
            CHECK(z.keep[g] == keep[g] && z.piece[g] == fm_zero3_piece_len(sizes[g] - keep[g], W) && z.local[g] == P);
            P += z.piece[g];
            mx = z.piece[g] > mx ? z.piece[g] : mx;
        }
        CHECK(z.piece_total == P && z.shard_len == P + 600 + 512 && z.wlocal[1] == P && z.wlocal[2] == P + 600);
        CHECK(z.slot_len == W * mx && z.whole_sq);
        FM_ASSERT(z.shard_len <= 2400);
        memset(back, 0, sizeof back);
        for (int q = 0; q < W; q++) {
            fm_zero3 zq;
            FM_ASSERT(fm_zero3_layout_keep(&zq, begin, keep, 4, false, q, W, q == 0) == FM_OK);
            fm_zero3_pack(&zq, q, full, local[q], sizeof(float));
            for (int g = 1; g <= 2; g++) /* the whole part: the group's last keep[g] elements, on every rank */
                CHECK(!memcmp(local[q] + zq.wlocal[g], full + begin[g + 1] - keep[g], sizeof(float) * (size_t)keep[g]));
            fm_zero3_unpack(&zq, q, local[q], back, sizeof(float));
            fm_zero3_free(&zq);
        }
        CHECK_MSG(!memcmp(full, back, sizeof(float) * (size_t)n), "keep, W %d: pack/unpack is not the identity", W);
        fm_zero3_free(&z);
    }
    fm_zero3 z;
    const int64_t bad_keep[4] = {0, 1001, 0, 0}, head_keep[4] = {10, 0, 0, 0};
    CHECK(fm_zero3_layout_keep(&z, begin, bad_keep, 4, false, 0, 2, false) == FM_ERR_ARG && strstr(fm_errmsg(), "group 1"));
    CHECK(fm_zero3_layout_keep(&z, begin, head_keep, 4, false, 0, 2, false) == FM_ERR_ARG && strstr(fm_errmsg(), "group 0"));
    for (int tied = 0; tied < 2; tied++)
        for (int ep = 2; ep <= 4; ep *= 2)
            for (int W = ep; W <= 8; W *= 2) {
                fm_config c = fm_test_small_config(FM_MODEL_QWEN3_MOE, 3, tied, 2);
                c.num_experts = 4; /* divisible by ep */
                fm_model m;
                FM_ASSERT(fm_model_create_ep(&m, &c, g_be, ep, (W - 1) % ep) == FM_OK);
                CHECK(fm_zero3_layout_params(&z, &m.p, W - 1, W) == FM_OK);
                const int64_t span = 3 * (c.num_experts / ep) * c.hidden_size * c.moe_intermediate_size;
                CHECK(z.keep[0] == 0 && z.keep[1] == span && z.keep[c.num_hidden_layers] == span &&
                      z.keep[c.num_hidden_layers + 1] == 0 && z.whole_sq == (W - 1 < ep));
                const size_t want = fm_zero3_store_bytes(&z, 4) + fm_adamw_state_bytes(z.shard_len, false);
                char desc[200];
                CHECK_MSG(fm_zero3_state_bytes_ep(&c, 4, W, ep, false, desc) == want,
                          "tied %d ep %d W %d: planned %zu, laid out %zu", tied, ep, W,
                          fm_zero3_state_bytes_ep(&c, 4, W, ep, false, NULL), want);
                CHECK(strstr(desc, "experts / ep") != NULL);
                fm_zero3_free(&z);
                fm_model_free(&m);
            }
}

/* Checks, at BEFORE_FORWARD of layer l (added after the ZeRO-3 hook), that layer l and the group
 * after it are both in the slots: the next group's gather was issued before layer l computes. */
static fm_status prefetch_probe(void *user, fm_model *m, fm_hook_point p, int64_t l) {
    (void)m;
    const fm_zero3 *z = user;
    if (p == FM_HOOK_BEFORE_FORWARD) {
        const int a = (int)l + 1, b = (int)l + 2;
        const bool ok = (z->slot_group[0] == a && z->slot_group[1] == b) || (z->slot_group[0] == b && z->slot_group[1] == a);
        CHECK_MSG(ok, "before layer %lld's forward the slots hold groups %d and %d, not %d and %d", (long long)l,
                  z->slot_group[0], z->slot_group[1], a, b);
    }
    return FM_OK;
}

/* max |x - y| / max |x| over n floats. */
static double rel_diff(const float *x, const float *y, int64_t n) {
    double d = 0, mx = 0;
    for (int64_t i = 0; i < n; i++) {
        const double e = x[i] > y[i] ? (double)x[i] - y[i] : (double)y[i] - x[i];
        if (e > d) d = e;
        if (x[i] > mx) mx = x[i];
        if (-x[i] > mx) mx = -x[i];
    }
    return mx > 0 ? d / mx : d;
}

/* Bit-identical when exact, else within tol of x's scale. */
#define SAME(x, y, n, exact, tol, what)                                                                               \
    CHECK_MSG((exact) ? !memcmp(x, y, sizeof(float) * (size_t)(n)) : rel_diff(x, y, n) <= (tol),                      \
              "tied %d G %d step %d: %s differ by %.3g of their scale", tied, G, s, what, rel_diff(x, y, n))

static void test_hook_exact(bool tied, bool recompute_all, int G) {
    const int64_t L = 3, B = 2, T = 8;
    const fm_config c = fm_test_small_config(FM_MODEL_OLMOE, L, tied, 2);
    bool rc[3] = {recompute_all, recompute_all, recompute_all};
    const fm_layout_opts lo = {rc, 0, 0, 0, 0, NULL};
    /* the reference: a plain store, the default schedule */
    fm_model a;
    fm_param_store aps;
    fm_adamw aopt;
    FM_ASSERT(fm_model_create(&a, &c, g_be) == FM_OK);
    fm_adamw_config(&aopt, 0.9, 0.95, 1e-8, 0.1, false);
    FM_ASSERT(fm_param_store_create(&aps, &a, fm_adamw_ops.state_bytes(&aopt, a.p.n_params)) == FM_OK);
    fm_adamw_ops.init(&aopt, &aps, &g_be);
    FM_ASSERT(fm_model_init_weights(&a, 5) == FM_OK);
    FM_ASSERT(fm_model_layout(&a, B, T, &lo) == FM_OK);
    fm_schedule as;
    fm_schedule_init(&as, &a);
    /* ZeRO-3 on one rank */
    fm_model b;
    fm_param_store bps;
    fm_adamw bopt;
    fm_zero3 z;
    fm_comm self;
    FM_ASSERT(fm_comm_self_create(&self, &g_be, 0) == FM_OK);
    FM_ASSERT(fm_model_create(&b, &c, g_be) == FM_OK);
    FM_ASSERT(fm_zero3_layout_params(&z, &b.p, 0, 1) == FM_OK);
    fm_adamw_config(&bopt, 0.9, 0.95, 1e-8, 0.1, false);
    FM_ASSERT(fm_param_store_create_zero3(&bps, &b, &z, fm_adamw_ops.state_bytes(&bopt, z.shard_len)) == FM_OK);
    CHECK(bps.arena.capacity == fm_arena_round(fm_zero3_state_bytes(&c, 4, 1, false, NULL)));
    fm_adamw_ops.init(&bopt, &bps, &g_be);
    fm_zero3_bind(&z, &b, &bps, &self);
    float *w = fm_malloc(sizeof(float) * (size_t)b.p.n_params);
    fm_params_init_weights_host(&b.p, 5, w);
    CHECK(fm_zero3_set_master(&z, &b, w) == FM_OK);
    FM_ASSERT(fm_model_layout(&b, B, T, &lo) == FM_OK);
    fm_schedule bs;
    fm_schedule_init(&bs, &b);
    CHECK(fm_schedule_add_group_hook(&bs, fm_zero3_hook, &z) == FM_OK);
    CHECK(fm_schedule_add_hook(&bs, prefetch_probe, &z) == FM_OK);
    const int64_t n = a.p.n_params;
    float *full = fm_malloc(sizeof(float) * (size_t)n);
    const bool exact = G == 1 && !tied;
    for (int s = 1; s <= 2; s++) {
        a.be.ops->mem_set(a.be.ctx, a.p.grads, 0, sizeof(fm_act) * (size_t)n);
        fm_zero3_zero_grads(&z, &b);
        for (int g = 0; g < G; g++) {
            fm_test_fill_batch(&a, 10 * (uint64_t)s + (uint64_t)g, 3);
            fm_test_fill_batch(&b, 10 * (uint64_t)s + (uint64_t)g, 3);
            fm_loss la, lb;
            const int64_t rs0 = z.reduce_scatters;
            CHECK(fm_schedule_train_step(&as, &a, fm_test_batch_of(&a), 1.0f / (float)G, &la) == FM_OK);
            CHECK(fm_schedule_train_step(&bs, &b, fm_test_batch_of(&b), 1.0f / (float)G, &lb) == FM_OK);
            const bool same = la.ce == lb.ce && la.aux == lb.aux && la.z == lb.z;
            const double rel = (la.ce > lb.ce ? la.ce - lb.ce : lb.ce - la.ce) / la.ce;
            CHECK_MSG(exact || s == 1 ? same : rel <= 1e-6, "step %d micro-batch %d: losses %.9g %.9g", s, g, la.ce,
                      lb.ce);
            CHECK(z.reduce_scatters - rs0 == L + 2 + (tied ? 1 : 0));
        }
        memset(full, 0, sizeof(float) * (size_t)n);
        fm_zero3_unpack(&z, 0, z.grads, full, sizeof(float));
        SAME(full, a.p.grads, n, exact, 1e-5, "the shard's gradients");
        fm_adamw_ops.step_begin(&aopt);
        fm_adamw_ops.step_range(&aopt, &a, 0, a.p.n_tensors, 1e-2, s == 2 ? 0.5f : 1.0f);
        CHECK(fm_zero3_update(&z, &b, &fm_adamw_ops, &bopt, 1e-2, s == 2 ? 0.5f : 1.0f) == FM_OK);
        fm_zero3_unpack(&z, 0, z.weights, full, sizeof(float));
        SAME(full, a.p.params, n, exact, 1e-5, "the weights");
        fm_zero3_unpack(&z, 0, bopt.m, full, sizeof(float));
        SAME(full, aopt.m, n, exact, 1e-5, "Adam m");
        fm_zero3_unpack(&z, 0, bopt.v, full, sizeof(float));
        SAME(full, aopt.v, n, exact, 1e-5, "Adam v");
    }
    /* the global norm's sum of squares of the shard (padding zero) is the table's */
    double qa, qb;
    fm_grad_sumsq(&a, &qa);
    CHECK(fm_zero3_grad_sumsq(&z, &b, &qb) == FM_OK);
    CHECK_MSG((qa > qb ? qa - qb : qb - qa) <= (exact ? 1e-12 : 1e-6) * qa, "sum of squares %.17g vs %.17g", qa, qb);
    /* a checkpoint's round trip on one rank: the full master and back */
    void *g = NULL;
    CHECK(fm_zero3_gather_full(&z, &b, z.master, FM_DTYPE_F32, &g) == FM_OK && g);
    fm_zero3_unpack(&z, 0, z.master, full, sizeof(float));
    CHECK(g && !memcmp(g, full, sizeof(float) * (size_t)n));
    const int s = 2;
    SAME((const float *)g, a.p.master, n, exact, 1e-5, "the gathered master");
    fm_free(g);
    fm_free(full);
    fm_free(w);
    fm_model_free(&b);
    fm_param_store_free(&bps);
    fm_zero3_free(&z);
    fm_comm_free(&self);
    fm_model_free(&a);
    fm_param_store_free(&aps);
}

int main(void) {
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    test_arith();
    test_keep();
    test_hook_exact(false, false, 1);
    test_hook_exact(false, true, 1);
    test_hook_exact(false, false, 2);
    test_hook_exact(true, false, 1);
    test_hook_exact(true, true, 2);
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
