/* The MPI communicator (src/comm/fm_comm_mpi.c), run under mpirun by tests/mpi_comm.sh. Every
 * rank fills its send buffers from its own rank and computes the expected result itself from the
 * collective's definition (what every other rank sent is a function of that rank's index), so no
 * result is taken from MPI to check MPI. Values are small integers (times a power of two in
 * floating point), so sums are exact whatever MPI's order. Receive buffers are poisoned and
 * guarded by sentinels. Three memory kinds: host memory, a CPU backend (host-backed: direct), and
 * a CPU backend that claims device memory with a counting copy op and a 256-byte staging size
 * (the host-staged path, in many chunks). Modes (argv[1]):
 *   all      every collective, in and out of place; zero-element ranks; bad arguments; split;
 *            process groups for the meshes the rank count allows
 *   timeout  rank 0 skips an all_reduce: the others must fail with FM_ERR_IO within ~2 s naming
 *            rank and collective; the result is agreed on a second communicator and rank 0 ends
 *            the job with fm_comm_mpi_abort(0 or 1)
 *   killed   rank 1 _exit(3)s before a collective: the others must not hang (the script checks
 *            that mpirun ends, non-zero, within its bound) */
#include <math.h>
#include <time.h>
#include <unistd.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "comm/fm_comm.h"
#include "fm_test.h"

enum { GUARD = 4 };
static int R, W; /* this rank, the world's size */

static fm_ops g_staged_ops; /* the CPU backend, claiming non-host memory, copies counted */
static const fm_ops *g_cpu_ops;
static long g_copies;
static void counting_copy(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind) {
    g_copies++;
    g_cpu_ops->copy(ctx, dst, src, bytes, kind);
}

/* ---- guarded buffers --------------------------------------------------------------------------- */

typedef struct gbuf {
    unsigned char *p;
    size_t es;
    int64_t n;
} gbuf;
static gbuf gb_new(int64_t n, size_t es) {
    gbuf g = {malloc((size_t)(n + 2 * GUARD) * es), es, n};
    FM_ASSERT(g.p);
    memset(g.p, 0xEE, (size_t)(n + 2 * GUARD) * es);
    return g;
}
static void *gb(const gbuf *g) { return g->p + GUARD * g->es; }
static bool gb_guards_ok(const gbuf *g) {
    for (size_t i = 0; i < GUARD * g->es; i++)
        if (g->p[i] != 0xEE || g->p[(size_t)(GUARD + g->n) * g->es + i] != 0xEE) return false;
    return true;
}

/* The value rank q contributes at index i, as an integer (exact in fp32 and fp64 below 2^24). */
static int64_t val(int q, int64_t i, int salt) { return ((i * 7919 + q * 104729 + salt * 31) % 2001) - 1000; }
static void put(void *x, int64_t i, fm_comm_dtype t, int64_t v) {
    if (t == FM_COMM_F32) ((float *)x)[i] = (float)v * 0.25f;
    else if (t == FM_COMM_F64) ((double *)x)[i] = (double)v * 0.5;
    else if (t == FM_COMM_I64) ((int64_t *)x)[i] = v * 1000000007LL;
    else if (t == FM_COMM_BF16) ((uint16_t *)x)[i] = (uint16_t)(v & 0xffff);
    else ((unsigned char *)x)[i] = (unsigned char)v;
}
/* Fills x[0..n) with rank q's contribution. */
static void fill(void *x, int64_t n, fm_comm_dtype t, int q, int salt) {
    for (int64_t i = 0; i < n; i++) put(x, i, t, val(q, i, salt));
}
/* want[i] = op over q < W of val(q, i0 + i, salt). */
static void expect_reduce(void *want, int64_t n, int64_t i0, fm_comm_dtype t, fm_comm_op op, int salt) {
    for (int64_t i = 0; i < n; i++) {
        int64_t acc = op == FM_COMM_SUM ? 0 : INT64_MIN;
        for (int q = 0; q < W; q++) {
            const int64_t v = val(q, i0 + i, salt);
            acc = op == FM_COMM_SUM ? acc + v : (v > acc ? v : acc);
        }
        put(want, i, t, acc);
    }
}

/* ---- every collective on one communicator ------------------------------------------------------ */

static const fm_comm_dtype k_red[] = {FM_COMM_F32, FM_COMM_F64, FM_COMM_I64};

static void test_collectives(const fm_comm *c, const char *mem) {
    CHECK(fm_comm_size(c) == W && fm_comm_rank(c) == R);
    const int64_t sizes[2] = {37, 1000};
    for (int si = 0; si < 2; si++)
        for (int ti = 0; ti < 3; ti++)
            for (int op = 0; op < FM_COMM_OP_COUNT; op++)
                for (int ip = 0; ip < 2; ip++) {
                    const int64_t n = sizes[si];
                    const fm_comm_dtype t = k_red[ti];
                    const size_t es = fm_comm_dtype_size(t);
                    gbuf s = gb_new(n, es), d = gb_new(n, es), want = gb_new(n, es);
                    fill(gb(&s), n, t, R, ti * 2 + op);
                    expect_reduce(gb(&want), n, 0, t, (fm_comm_op)op, ti * 2 + op);
                    void *recv = ip ? gb(&s) : gb(&d);
                    const fm_status st = fm_comm_all_reduce(c, gb(&s), recv, n, t, (fm_comm_op)op, 0);
                    CHECK_MSG(st == FM_OK, "%s: %s", mem, fm_errmsg());
                    CHECK_MSG(!memcmp(recv, gb(&want), (size_t)n * es) && gb_guards_ok(&s) && gb_guards_ok(&d),
                              "rank %d %s all_reduce(%s %s, %lld) %s: result differs", R, mem, fm_comm_dtype_name(t),
                              fm_comm_op_name((fm_comm_op)op), (long long)n, ip ? "in place" : "out of place");
                    free(s.p), free(d.p), free(want.p);
                }
    /* host-value wrappers */
    {
        double v[3] = {(double)R, -(double)R, 0.5}, wmax[3] = {W - 1, 0, 0.5};
        CHECK(fm_comm_allreduce_sum_f64(c, v, 3, 0) == FM_OK);
        CHECK_MSG(v[0] == W * (W - 1) / 2.0 && v[1] == -v[0] && v[2] == 0.5 * W, "rank %d sum_f64 %g %g %g", R, v[0],
                  v[1], v[2]);
        v[0] = R, v[1] = -R, v[2] = 0.5;
        CHECK(fm_comm_allreduce_max_f64(c, v, 3, 0) == FM_OK && !memcmp(v, wmax, sizeof v));
        int64_t i[2] = {R + 1, INT64_MIN + R};
        CHECK(fm_comm_allreduce_max_i64(c, i, 2, 0) == FM_OK && i[0] == W && i[1] == INT64_MIN + W - 1);
        float f = (float)R;
        CHECK(fm_comm_allreduce_sum_f32(c, &f, 1, 0) == FM_OK && f == (float)(W * (W - 1) / 2));
    }
    /* reduce_scatter: rank q's block r holds val(q, r * rc + i) */
    for (int ip = 0; ip < 2; ip++)
        for (int ti = 0; ti < 3; ti += 2) {
            const int64_t rc = 45; /* several staging chunks at 2 ranks too */
            const fm_comm_dtype t = k_red[ti];
            const fm_comm_op op = ti ? FM_COMM_MAX : FM_COMM_SUM;
            const size_t es = fm_comm_dtype_size(t);
            gbuf s = gb_new(W * rc, es), d = gb_new(rc, es), want = gb_new(rc, es);
            fill(gb(&s), W * rc, t, R, 5);
            expect_reduce(gb(&want), rc, R * rc, t, op, 5);
            void *recv = ip ? (char *)gb(&s) + (size_t)(R * rc) * es : gb(&d);
            CHECK_MSG(fm_comm_reduce_scatter(c, gb(&s), recv, rc, t, op, 0) == FM_OK, "%s: %s", mem, fm_errmsg());
            CHECK_MSG(!memcmp(recv, gb(&want), (size_t)rc * es) && gb_guards_ok(&s) && gb_guards_ok(&d),
                      "rank %d %s reduce_scatter(%s) %s: result differs", R, mem, fm_comm_dtype_name(t),
                      ip ? "in place" : "out of place");
            if (ip) /* the other blocks of send are left as they were */
                for (int q = 0; q < W; q++) {
                    if (q == R) continue;
                    gbuf ref = gb_new(W * rc, es);
                    fill(gb(&ref), W * rc, t, R, 5);
                    CHECK_MSG(!memcmp((char *)gb(&s) + (size_t)(q * rc) * es, (char *)gb(&ref) + (size_t)(q * rc) * es,
                                      (size_t)rc * es), "rank %d %s in-place reduce_scatter changed block %d", R, mem, q);
                    free(ref.p);
                }
            free(s.p), free(d.p), free(want.p);
        }
    /* all_gather: recv[q * sc + i] = val(q, i); int64 and bytes */
    for (int ip = 0; ip < 2; ip++)
        for (int bi = 0; bi < 2; bi++) {
            const int64_t sc = bi ? 301 : 13;
            const fm_comm_dtype t = bi ? FM_COMM_BYTE : FM_COMM_I64;
            const size_t es = fm_comm_dtype_size(t);
            gbuf s = gb_new(sc, es), d = gb_new(W * sc, es), want = gb_new(W * sc, es);
            for (int q = 0; q < W; q++) fill((char *)gb(&want) + (size_t)(q * sc) * es, sc, t, q, 6);
            void *send = ip ? (char *)gb(&d) + (size_t)(R * sc) * es : gb(&s);
            fill(send, sc, t, R, 6);
            CHECK_MSG(fm_comm_all_gather(c, send, gb(&d), sc, t, 0) == FM_OK, "%s: %s", mem, fm_errmsg());
            CHECK_MSG(!memcmp(gb(&d), gb(&want), (size_t)(W * sc) * es) && gb_guards_ok(&s) && gb_guards_ok(&d),
                      "rank %d %s all_gather(%s) %s: result differs", R, mem, fm_comm_dtype_name(t),
                      ip ? "in place" : "out of place");
            free(s.p), free(d.p), free(want.p);
        }
    /* all_to_all_v: p sends cnt(p, q) elements to q, value p * 100000 + q * 1000 + j; the last rank
     * sends and receives nothing; blocks have gaps between them (which must keep their bytes) */
    for (int bi = 0; bi < 2; bi++) {
        const fm_comm_dtype t = bi ? FM_COMM_BYTE : FM_COMM_F64;
        const size_t es = fm_comm_dtype_size(t);
#define CNT(p, q) ((p) == W - 1 || (q) == W - 1 ? 0 : ((p) * 3 + (q) * 5) % 7 + 1 + 60 * bi)
        int64_t sc[8], sd[8], rc[8], rd[8], ns = 0, nr = 0;
        for (int q = 0; q < W; q++) {
            sd[q] = ns + 1, sc[q] = CNT(R, q), ns += sc[q] + 1;
            rd[q] = nr + 2, rc[q] = CNT(q, R), nr += rc[q] + 2;
        }
        gbuf s = gb_new(ns, es), d = gb_new(nr, es), want = gb_new(nr, es);
        for (int q = 0; q < W; q++)
            for (int64_t j = 0; j < sc[q]; j++) put(gb(&s), sd[q] + j, t, R * 100000 + q * 1000 + j);
        memcpy(gb(&want), gb(&d), (size_t)nr * es);
        for (int p = 0; p < W; p++)
            for (int64_t j = 0; j < rc[p]; j++) put(gb(&want), rd[p] + j, t, p * 100000 + R * 1000 + j);
        const bool empty = R == W - 1;
        CHECK_MSG(fm_comm_all_to_all_v(c, empty ? NULL : gb(&s), sc, sd, empty ? NULL : gb(&d), rc, rd, t, 0) == FM_OK,
                  "%s: %s", mem, fm_errmsg());
        CHECK_MSG(!memcmp(gb(&d), gb(&want), (size_t)nr * es) && gb_guards_ok(&d), "rank %d %s all_to_all_v(%s): "
                  "result differs", R, mem, fm_comm_dtype_name(t));
        free(s.p), free(d.p), free(want.p);
#undef CNT
    }
    /* broadcast from the first and the last rank, in place on the root and out of place */
    for (int ri = 0; ri < 2; ri++)
        for (int ip = 0; ip < 2; ip++) {
            const int root = ri ? W - 1 : 0;
            const int64_t n = 517;
            gbuf s = gb_new(n, 4), d = gb_new(n, 4), want = gb_new(n, 4);
            fill(gb(&want), n, FM_COMM_F32, root, 8);
            if (R == root) fill(gb(&s), n, FM_COMM_F32, root, 8);
            void *recv = ip && R == root ? gb(&s) : gb(&d);
            CHECK_MSG(fm_comm_broadcast(c, R == root ? gb(&s) : NULL, recv, n, FM_COMM_F32, root, 0) == FM_OK,
                      "%s: %s", mem, fm_errmsg());
            CHECK_MSG(!memcmp(recv, gb(&want), (size_t)n * 4) && gb_guards_ok(&d), "rank %d %s broadcast(root %d) %s: "
                      "result differs", R, mem, root, ip ? "in place" : "out of place");
            free(s.p), free(d.p), free(want.p);
        }
    CHECK_MSG(fm_comm_barrier(c, 0) == FM_OK && fm_comm_barrier(c, 10) == FM_OK, "%s", fm_errmsg());
    /* zero counts, NULL buffers */
    CHECK(fm_comm_all_reduce(c, NULL, NULL, 0, FM_COMM_F64, FM_COMM_MAX, 0) == FM_OK);
    CHECK(fm_comm_reduce_scatter(c, NULL, NULL, 0, FM_COMM_I64, FM_COMM_SUM, 0) == FM_OK);
    CHECK(fm_comm_all_gather(c, NULL, NULL, 0, FM_COMM_BF16, 0) == FM_OK);
    CHECK(fm_comm_broadcast(c, NULL, NULL, 0, FM_COMM_BYTE, 0, 0) == FM_OK);
    /* bf16 reductions (user operations; exact on small integers): sum of rank + 1 and 2 (rank + 1),
     * max of rank, all-reduce and in-place reduce-scatter */
    uint16_t h[2] = {fm_f32_to_bf16((float)(R + 1)), fm_f32_to_bf16((float)(2 * R + 2))}, h2[2];
    CHECK_MSG(fm_comm_all_reduce(c, h, h2, 2, FM_COMM_BF16, FM_COMM_SUM, 0) == FM_OK, "%s", fm_errmsg());
    CHECK_MSG(fm_bf16_to_f32(h2[0]) == (float)(W * (W + 1) / 2) && fm_bf16_to_f32(h2[1]) == (float)(W * (W + 1)),
              "rank %d: bf16 all_reduce sum gave %g, %g", R, fm_bf16_to_f32(h2[0]), fm_bf16_to_f32(h2[1]));
    h[0] = fm_f32_to_bf16((float)R);
    CHECK_MSG(fm_comm_all_reduce(c, h, h, 1, FM_COMM_BF16, FM_COMM_MAX, 0) == FM_OK, "%s", fm_errmsg());
    CHECK_MSG(fm_bf16_to_f32(h[0]) == (float)(W - 1), "rank %d: bf16 max gave %g", R, fm_bf16_to_f32(h[0]));
    uint16_t rs[8];
    for (int q = 0; q < W; q++) rs[q] = fm_f32_to_bf16((float)(q + R)); /* block q: q + R on rank R */
    CHECK_MSG(fm_comm_reduce_scatter(c, rs, rs + R, 1, FM_COMM_BF16, FM_COMM_SUM, 0) == FM_OK, "%s", fm_errmsg());
    CHECK_MSG(fm_bf16_to_f32(rs[R]) == (float)(W * R + W * (W - 1) / 2), "rank %d: bf16 reduce_scatter gave %g", R,
              fm_bf16_to_f32(rs[R]));
    /* bf16 moves */
    gbuf hb = gb_new(W * 3, 2);
    fill((char *)gb(&hb) + R * 6, 3, FM_COMM_BF16, R, 9);
    CHECK(fm_comm_all_gather(c, (char *)gb(&hb) + R * 6, gb(&hb), 3, FM_COMM_BF16, 0) == FM_OK);
    for (int q = 0; q < W; q++) {
        uint16_t w[3];
        fill(w, 3, FM_COMM_BF16, q, 9);
        CHECK(!memcmp((char *)gb(&hb) + q * 6, w, 6));
    }
    free(hb.p);
}

/* ---- bad arguments: the same bad call on every rank, refused before anything is sent ---------- */

#define EXPECT(code, call, needle)                                                                        \
    do {                                                                                                  \
        const fm_status st_ = (call);                                                                     \
        CHECK_MSG(st_ == (code), "rank %d: %s: expected %s, got %s (%s)", R, #call, fm_status_name(code), \
                  fm_status_name(st_), fm_errmsg());                                                      \
        CHECK_MSG(strstr(fm_errmsg(), (needle)) != NULL, "rank %d: %s: message '%s' lacks '%s'", R, #call,  \
                  fm_errmsg(), (needle));                                                                 \
    } while (0)

static void test_bad_args(const fm_comm *c) {
    float a[64] = {0}, b[64] = {0};
    char pre[32];
    snprintf(pre, sizeof pre, "rank %d of %d: ", R, W);
    char need[256];
    snprintf(need, sizeof need, "%sall_reduce(fp32 sum): send count -3 is negative", pre);
    EXPECT(FM_ERR_ARG, fm_comm_all_reduce(c, a, b, -3, FM_COMM_F32, FM_COMM_SUM, 0), need);
    EXPECT(FM_ERR_ARG, fm_comm_all_reduce(c, a, a + 1, 8, FM_COMM_F32, FM_COMM_SUM, 0), "overlaps");
    EXPECT(FM_ERR_ARG, fm_comm_all_reduce(c, a, b, 4, FM_COMM_BYTE, FM_COMM_SUM, 0), "bytes cannot be reduced");
    EXPECT(FM_ERR_ARG, fm_comm_all_reduce(c, a, b, 4, FM_COMM_F32, FM_COMM_SUM, -1),
           "all_reduce(fp32 sum, 4 elements): timeout -1 s must be >= 0");
    EXPECT(FM_ERR_ARG, fm_comm_reduce_scatter(c, a, a + 1, 4, FM_COMM_F32, FM_COMM_SUM, 0), "overlaps");
    snprintf(need, sizeof need, "%sbroadcast(fp32, 4 elements): root %d is not a rank (expected 0..%d)", pre, W, W - 1);
    EXPECT(FM_ERR_ARG, fm_comm_broadcast(c, a, b, 4, FM_COMM_F32, W, 0), need);
    EXPECT(FM_ERR_ARG, fm_comm_barrier(c, -5), "barrier(): timeout -5 s");
    int64_t cnt[8], z[8] = {0}, big[8];
    for (int q = 0; q < W; q++) cnt[q] = 1, big[q] = 0;
    int64_t rc2[8];
    memcpy(rc2, cnt, sizeof cnt);
    rc2[R] = 2;
    snprintf(need, sizeof need, "%sall_to_all_v(fp32): rank %d sends 1 elements to itself (send_counts[%d]) but "
             "expects 2", pre, R, R);
    EXPECT(FM_ERR_ARG, fm_comm_all_to_all_v(c, a, cnt, z, b, rc2, z, FM_COMM_F32, 0), need);
    cnt[W - 1] = -1;
    EXPECT(FM_ERR_ARG, fm_comm_all_to_all_v(c, a, cnt, z, b, cnt, z, FM_COMM_F32, 0), "is negative");
    cnt[W - 1] = 1;
    EXPECT(FM_ERR_ARG, fm_comm_all_to_all_v(c, a, cnt, NULL, b, cnt, z, FM_COMM_F32, 0), "found send_displs NULL");
    if (fm_comm_mem_is_host(c)) { /* the direct path hands int counts to MPI */
        big[W - 1] = (int64_t)1 << 31;
        EXPECT(FM_ERR_ARG, fm_comm_all_to_all_v(c, a, z, big, b, z, z, FM_COMM_BYTE, 0),
               "send_displs[" );
        CHECK_MSG(strstr(fm_errmsg(), "2147483648 does not fit MPI's int count"), "%s", fm_errmsg());
    }
    EXPECT(FM_ERR_ARG, fm_comm_all_to_all_v(c, a, cnt, z, a, cnt, z, FM_COMM_F32, 0), "overlaps");
    bool untouched = true;
    for (int i = 0; i < 64; i++) untouched &= a[i] == 0.0f && b[i] == 0.0f;
    CHECK_MSG(untouched, "rank %d: a rejected collective wrote its buffers", R);
    fm_comm s2;
    EXPECT(FM_ERR_ARG, c->ops->split(c->ctx, -2, 0, &s2), "split(color -2): color must be >= 0");
    CHECK(fm_comm_barrier(c, 10) == FM_OK); /* still in step after the refusals */
}

/* ---- split and process groups ------------------------------------------------------------------ */

static void test_split(const fm_comm *c) {
    fm_comm s;
    CHECK_MSG(c->ops->split(c->ctx, R % 2, -R, &s) == FM_OK, "%s", fm_errmsg());
    const int n = (W - R % 2 + 1) / 2; /* ranks of my parity */
    CHECK_MSG(fm_comm_size(&s) == n, "rank %d: split size %d, expected %d", R, fm_comm_size(&s), n);
    CHECK_MSG(fm_comm_rank(&s) == n - 1 - R / 2, "rank %d: split rank %d (key -rank reverses)", R, fm_comm_rank(&s));
    int64_t v = R;
    CHECK(fm_comm_allreduce_sum_i64(&s, &v, 1, 0) == FM_OK);
    int64_t want = 0;
    for (int q = R % 2; q < W; q += 2) want += q;
    CHECK_MSG(v == want, "rank %d: sum over the split %lld, expected %lld", R, (long long)v, (long long)want);
    CHECK(fm_comm_mem_is_host(&s) == fm_comm_mem_is_host(c));
    fm_comm_free(&s);
}

static void test_group(const fm_comm *world, int dp, int ep, int sp) {
    fm_comm_group g;
    const fm_status st = fm_comm_group_create(&g, world, dp, ep, sp);
    CHECK_MSG(st == FM_OK, "rank %d: group (%d, %d, %d): %s", R, dp, ep, sp, fm_errmsg());
    if (st != FM_OK) return;
    /* the layout of fm_comm.h: r = dp_index * sp + sp_index */
    const int di = R / sp, si = R % sp;
    const int deg[FM_AXIS_COUNT] = {W, dp, ep, sp};
    const int rank_in[FM_AXIS_COUNT] = {R, di, R % ep, si};
    for (int a = 0; a < FM_AXIS_COUNT; a++) {
        const fm_process_group *p = &g.axis[a];
        CHECK_MSG(p->degree == deg[a] && fm_comm_size(&p->comm) == deg[a] && fm_comm_rank(&p->comm) == rank_in[a],
                  "rank %d (%d,%d,%d) axis %s: degree %d rank %d, expected %d, %d", R, dp, ep, sp, p->name, p->degree,
                  fm_comm_rank(&p->comm), deg[a], rank_in[a]);
        int64_t v[2] = {R, 1}, want = 0;
        for (int q = 0; q < W; q++) {
            const bool member = a == FM_AXIS_WORLD || (a == FM_AXIS_DP && q % sp == si) ||
                                (a == FM_AXIS_EP && q / ep == R / ep) || (a == FM_AXIS_SP && q / sp == di);
            want += member ? q : 0;
        }
        CHECK(fm_comm_allreduce_sum_i64(&p->comm, v, 2, 0) == FM_OK);
        CHECK_MSG(v[0] == want && v[1] == deg[a], "rank %d (%d,%d,%d) axis %s: sum of members %lld (want %lld), "
                  "count %lld", R, dp, ep, sp, p->name, (long long)v[0], (long long)want, (long long)v[1]);
    }
    fm_comm_group_free(&g);
}

static void test_groups(const fm_comm *world) {
    if (W == 2) {
        test_group(world, 2, 2, 1);
        test_group(world, 1, 1, 2);
        test_group(world, 1, 2, 2);
    }
    if (W == 4) {
        test_group(world, 2, 4, 2);
        test_group(world, 2, 2, 2);
        test_group(world, 4, 2, 1);
        test_group(world, 1, 4, 4);
    }
    fm_comm_group g;
    char need[160];
    snprintf(need, sizeof need, "rank %d of %d: mesh degrees dp 3, ep 1, sp 1: dp x sp = 3 ranks, but %d ranks", R, W,
             W);
    EXPECT(FM_ERR_ARG, fm_comm_group_create(&g, world, 3, 1, 1), need);
    snprintf(need, sizeof need, "ep 3 does not divide dp x sp = %d ranks", W);
    EXPECT(FM_ERR_ARG, fm_comm_group_create(&g, world, W, 3, 1), need);
    EXPECT(FM_ERR_ARG, fm_comm_group_create(&g, world, W, 0, 1), "must each be >= 1");
}

/* ---- modes --------------------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int mode_timeout(const fm_comm *world) {
    fm_comm aux; /* a second communicator, to agree on the result after world is broken */
    CHECK(world->ops->split(world->ctx, 0, R, &aux) == FM_OK);
    CHECK(fm_comm_barrier(world, 30) == FM_OK);
    int64_t fails = 0;
    if (R != 0) {
        double v[4] = {1, 2, 3, 4};
        const double t0 = now_s();
        const fm_status st = fm_comm_all_reduce(world, v, v, 4, FM_COMM_F64, FM_COMM_SUM, 2.0);
        const double el = now_s() - t0;
        char need[128];
        snprintf(need, sizeof need, "rank %d of %d: all_reduce(fp64 sum, 4 elements) timed out after 2 s", R, W);
        CHECK_MSG(st == FM_ERR_IO, "rank %d: expected FM_ERR_IO, got %s", R, fm_status_name(st));
        CHECK_MSG(strstr(fm_errmsg(), need), "rank %d: message '%s' lacks '%s'", R, fm_errmsg(), need);
        CHECK_MSG(el >= 1.9 && el < 6.0, "rank %d: returned after %.2f s, expected about 2 s", R, el);
        printf("rank %d: after %.2f s: %s\n", R, el, fm_errmsg());
        /* the communicator is broken now */
        EXPECT(FM_ERR_IO, fm_comm_barrier(world, 1), "an earlier collective on this communicator failed");
        fails = fm_test_failed;
    }
    CHECK_MSG(fm_comm_allreduce_sum_i64(&aux, &fails, 1, 30) == FM_OK, "%s", fm_errmsg());
    if (R == 0) {
        printf("timeout test: %s (%lld failed checks on ranks 1..%d)\n", fails ? "FAILED" : "passed",
               (long long)fails, W - 1);
        fflush(stdout);
        fm_comm_mpi_abort(fails ? 1 : 0); /* world has abandoned requests: end the job */
    }
    fflush(stdout);
    sleep(60); /* rank 0's abort ends this process */
    return 1;
}

static int mode_killed(const fm_comm *world) {
    CHECK(fm_comm_barrier(world, 30) == FM_OK);
    if (R == 1) {
        printf("rank 1: exiting abruptly with status 3\n");
        fflush(stdout);
        _exit(3);
    }
    double v = 1;
    const fm_status st = fm_comm_all_reduce(world, &v, &v, 1, FM_COMM_F64, FM_COMM_SUM, 20);
    printf("rank %d: all_reduce returned %s: %s\n", R, fm_status_name(st), fm_errmsg());
    return st == FM_OK ? 0 : 2; /* st == FM_OK is impossible: the script fails on exit 0 of the job */
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "all";
    if (!fm_comm_mpi_built()) {
        fm_comm x;
        CHECK(fm_comm_mpi_world(&x, NULL, 0, 0) == FM_ERR_UNSUPPORTED && x.ops == NULL);
        printf("the mpi communicator is not in this build: skipped\n");
        return fm_test_failed ? 1 : 77;
    }
    fm_comm world;
    FM_ASSERT(fm_comm_mpi_world(&world, NULL, 0, 0) == FM_OK);
    R = fm_comm_rank(&world), W = fm_comm_size(&world);
    FM_ASSERT(W <= 8);
    if (!strcmp(mode, "timeout")) return mode_timeout(&world);
    if (!strcmp(mode, "killed")) return mode_killed(&world);

    CHECK(!strcmp(world.ops->name, "mpi") && fm_comm_mem_is_host(&world));
    CHECK(world.ops->default_timeout(world.ctx) == FM_COMM_DEFAULT_TIMEOUT_S);
    test_collectives(&world, "host");
    test_bad_args(&world);
    test_split(&world);
    test_groups(&world);

    /* a host-backed backend: direct, no copies */
    fm_backend cpu;
    CHECK(fm_cpu_backend_init(&cpu, 1, 64) == FM_OK);
    g_cpu_ops = cpu.ops;
    g_staged_ops = *cpu.ops;
    g_staged_ops.copy = counting_copy;
    fm_backend direct = {&g_staged_ops, cpu.ctx};
    fm_comm dc;
    CHECK(fm_comm_mpi_world(&dc, &direct, 7.5, 0) == FM_OK);
    CHECK(!fm_comm_mem_is_host(&dc) && dc.ops->default_timeout(dc.ctx) == 7.5);
    g_copies = 0;
    test_collectives(&dc, "backend (host memory)");
    CHECK_MSG(g_copies == 0, "rank %d: the host-backed backend was copied %ld times", R, g_copies);
    fm_comm_free(&dc);

    /* a backend claiming device memory: staged through 256-byte host buffers */
    g_staged_ops.host_memory = false;
    fm_backend staged = {&g_staged_ops, cpu.ctx};
    fm_comm sc;
    CHECK(fm_comm_mpi_world(&sc, &staged, 0, 256) == FM_OK);
    g_copies = 0;
    test_collectives(&sc, "backend (staged)");
    CHECK_MSG(g_copies > 100, "rank %d: the staged communicator copied %ld times", R, g_copies);
    test_bad_args(&sc);
    test_split(&sc);
    fm_comm_free(&sc);
    fm_comm bad;
    /* the message's rank count is read before the context is freed (a use after free under
     * AddressSanitizer before the fix; freed memory's bytes need not hold the count) */
    char want_small[96];
    snprintf(want_small, sizeof want_small, "4 bytes are too small for %d ranks", W);
    EXPECT(FM_ERR_ARG, fm_comm_mpi_world(&bad, &staged, 0, 4), want_small);
    EXPECT(FM_ERR_ARG, fm_comm_mpi_world(&bad, NULL, -1, 0), "default timeout -1 s must be >= 0");
    fm_cpu_backend_free(&cpu);

    /* every rank's verdict, so one rank's failure fails the job's exit status everywhere */
    int64_t fails = fm_test_failed;
    CHECK(fm_comm_allreduce_sum_i64(&world, &fails, 1, 30) == FM_OK);
    fm_comm_free(&world);
    CHECK(fm_comm_mpi_finalize() == FM_OK);
    printf("rank %d of %d: ", R, W);
    const int rc = fm_test_finish();
    return rc ? rc : fails ? 1 : 0;
}
