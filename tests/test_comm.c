/* The communicator table (src/comm) on the one-rank communicator: every collective, out of place
 * and in place where the header allows it, on host memory and on backend memory (a CPU backend
 * whose copy op counts its calls, so the backend path is proven to be taken), each against the
 * result computed here from the collective's definition over the ranks (one rank: the reduction
 * of one contribution, the gather of one block); receive buffers are poisoned and guarded by
 * sentinel elements on both sides, so an unwritten element or a write out of range fails. Also:
 * the host-value wrappers, bad arguments and their messages, the message format, and the
 * process groups per mesh axis. */
#include <math.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "comm/fm_comm.h"
#include "comm/fm_comm_nccl.h"
#include "fm_test.h"

enum { GUARD = 4 };

/* ---- a backend whose copy counts its calls (the CPU backend underneath) -------------------- */

static fm_ops g_counting_ops;
static const fm_ops *g_cpu_ops;
static int g_copies;
static void counting_copy(void *ctx, void *dst, const void *src, size_t bytes, fm_copy_kind kind) {
    g_copies++;
    CHECK_MSG(kind == FM_COPY_D2D, "self communicator copied with kind %d, expected D2D", (int)kind);
    g_cpu_ops->copy(ctx, dst, src, bytes, kind);
}

/* ---- buffers: host (malloc) or backend (mem_alloc) -------------------------------------------- */

typedef struct membuf {
    const fm_backend *be; /* NULL: host */
    unsigned char *p;     /* GUARD elements, n elements, GUARD elements */
    size_t es;
    int64_t n;
} membuf;

static membuf mb_new(const fm_backend *be, int64_t n, size_t es) {
    membuf m = {be, NULL, es, n};
    const size_t bytes = (size_t)(n + 2 * GUARD) * es;
    m.p = be ? be->ops->mem_alloc(be->ctx, bytes) : malloc(bytes);
    FM_ASSERT(m.p);
    memset(m.p, 0xEE, bytes); /* sentinels and poison: 0xEE bytes */
    return m;
}
static void *mb_data(const membuf *m) { return m->p + GUARD * m->es; }
static void mb_free(membuf *m) {
    if (m->be) m->be->ops->mem_free(m->be->ctx, m->p);
    else free(m->p);
}
static void mb_write(membuf *m, int64_t off, const void *src, int64_t n) {
    memcpy(m->p + (size_t)(GUARD + off) * m->es, src, (size_t)n * m->es); /* the CPU backend's memory is host memory */
}
/* The sentinel bytes around the data are intact. */
static bool mb_guards_ok(const membuf *m) {
    for (size_t i = 0; i < GUARD * m->es; i++)
        if (m->p[i] != 0xEE || m->p[(size_t)(GUARD + m->n) * m->es + i] != 0xEE) return false;
    return true;
}

/* ---- reference: the collective's definition over `ranks` contributions -------------------- */

static const fm_comm_dtype k_reduce_types[] = {FM_COMM_F32, FM_COMM_F64, FM_COMM_I64};

/* out[i] = op over r < ranks of in[r][i], computed in the element type (one rank: in[0][i]). */
static void ref_reduce(void *out, const void *const *in, int ranks, int64_t n, fm_comm_dtype t, fm_comm_op op) {
    for (int64_t i = 0; i < n; i++) {
        if (t == FM_COMM_F32) {
            float acc = op == FM_COMM_SUM ? -0.0f : -INFINITY; /* -0: the identity of +, even for -0 */
            for (int r = 0; r < ranks; r++) {
                const float v = ((const float *)in[r])[i];
                acc = op == FM_COMM_SUM ? acc + v : (v > acc ? v : acc);
            }
            ((float *)out)[i] = acc;
        } else if (t == FM_COMM_F64) {
            double acc = op == FM_COMM_SUM ? -0.0 : -INFINITY;
            for (int r = 0; r < ranks; r++) {
                const double v = ((const double *)in[r])[i];
                acc = op == FM_COMM_SUM ? acc + v : (v > acc ? v : acc);
            }
            ((double *)out)[i] = acc;
        } else {
            int64_t acc = op == FM_COMM_SUM ? 0 : INT64_MIN;
            for (int r = 0; r < ranks; r++) {
                const int64_t v = ((const int64_t *)in[r])[i];
                acc = op == FM_COMM_SUM ? acc + v : (v > acc ? v : acc);
            }
            ((int64_t *)out)[i] = acc;
        }
    }
}

/* n distinct values of type t (negative ones too, so max is not trivially the last). */
static void fill_values(void *x, int64_t n, fm_comm_dtype t, int salt) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t v = ((i * 7919 + salt * 104729) % 2001) - 1000;
        if (t == FM_COMM_F32) ((float *)x)[i] = (float)v * 0.37f;
        else if (t == FM_COMM_F64) ((double *)x)[i] = (double)v * 1e-3 + 1e10 * (i == 3);
        else if (t == FM_COMM_I64) ((int64_t *)x)[i] = v * 1000000007LL;
        else ((unsigned char *)x)[i * fm_comm_dtype_size(t)] = (unsigned char)v; /* first byte */
    }
}

/* ---- every collective, on one memory kind ---------------------------------------------------- */

static void test_collectives(const fm_comm *c, const fm_backend *be, const char *mem) {
    const int64_t n = 37;
    const int W = fm_comm_size(c), r = fm_comm_rank(c);
    CHECK(W == 1 && r == 0);
    unsigned char src[64 * 8], want[64 * 8];
    /* all_reduce: every type and op, out of place and in place */
    for (size_t ti = 0; ti < sizeof k_reduce_types / sizeof k_reduce_types[0]; ti++)
        for (int op = 0; op < FM_COMM_OP_COUNT; op++)
            for (int inplace = 0; inplace < 2; inplace++) {
                const fm_comm_dtype t = k_reduce_types[ti];
                const size_t es = fm_comm_dtype_size(t);
                fill_values(src, n, t, (int)(ti * 2 + op));
                const void *contrib[1] = {src};
                ref_reduce(want, contrib, W, n, t, (fm_comm_op)op);
                membuf s = mb_new(be, n, es), d = mb_new(be, n, es);
                mb_write(&s, 0, src, n);
                void *recv = inplace ? mb_data(&s) : mb_data(&d);
                const fm_status st = fm_comm_all_reduce(c, mb_data(&s), recv, n, t, (fm_comm_op)op, 0);
                CHECK_MSG(st == FM_OK, "%s all_reduce: %s", mem, fm_errmsg());
                CHECK_MSG(!memcmp(recv, want, (size_t)n * es), "%s all_reduce(%s %s) %s: result differs", mem,
                          fm_comm_dtype_name(t), fm_comm_op_name((fm_comm_op)op), inplace ? "in place" : "out of place");
                CHECK_MSG(mb_guards_ok(&s) && mb_guards_ok(&d), "%s all_reduce: wrote outside its buffers", mem);
                if (!inplace) CHECK_MSG(!memcmp(mb_data(&s), src, (size_t)n * es), "%s all_reduce changed send", mem);
                mb_free(&s), mb_free(&d);
            }
    /* bf16 sum: a copy on one rank */
    {
        uint16_t h[5] = {0x3f80, 0xbf80, 0x4049, 0x0001, 0x7f80};
        membuf s = mb_new(be, 5, 2), d = mb_new(be, 5, 2);
        mb_write(&s, 0, h, 5);
        CHECK(fm_comm_all_reduce(c, mb_data(&s), mb_data(&d), 5, FM_COMM_BF16, FM_COMM_SUM, 1.0) == FM_OK);
        CHECK(!memcmp(mb_data(&d), h, 10) && mb_guards_ok(&d));
        mb_free(&s), mb_free(&d);
    }
    /* reduce_scatter: send [W * rc]; rank r gets block r reduced over ranks */
    for (int inplace = 0; inplace < 2; inplace++) {
        const int64_t rc = 11;
        fill_values(src, W * rc, FM_COMM_F32, 5);
        const void *contrib[1] = {(const float *)(const void *)src + r * rc};
        ref_reduce(want, contrib, W, rc, FM_COMM_F32, FM_COMM_SUM);
        membuf s = mb_new(be, W * rc, 4), d = mb_new(be, rc, 4);
        mb_write(&s, 0, src, W * rc);
        void *recv = inplace ? (float *)mb_data(&s) + r * rc : mb_data(&d);
        CHECK_MSG(fm_comm_reduce_scatter(c, mb_data(&s), recv, rc, FM_COMM_F32, FM_COMM_SUM, 0) == FM_OK, "%s: %s",
                  mem, fm_errmsg());
        CHECK_MSG(!memcmp(recv, want, (size_t)rc * 4) && mb_guards_ok(&s) && mb_guards_ok(&d),
                  "%s reduce_scatter %s: result differs", mem, inplace ? "in place" : "out of place");
        mb_free(&s), mb_free(&d);
    }
    /* all_gather: recv[q * sc + i] = send_q[i] */
    for (int inplace = 0; inplace < 2; inplace++) {
        const int64_t sc = 13;
        fill_values(src, sc, FM_COMM_I64, 6);
        for (int q = 0; q < W; q++) memcpy(want + (size_t)(q * sc) * 8, src, (size_t)sc * 8); /* one rank: q = r */
        membuf s = mb_new(be, sc, 8), d = mb_new(be, W * sc, 8);
        void *send = inplace ? (int64_t *)mb_data(&d) + r * sc : mb_data(&s);
        memcpy(send, src, (size_t)sc * 8);
        CHECK_MSG(fm_comm_all_gather(c, send, mb_data(&d), sc, FM_COMM_I64, 0) == FM_OK, "%s: %s", mem, fm_errmsg());
        CHECK_MSG(!memcmp(mb_data(&d), want, (size_t)(W * sc) * 8) && mb_guards_ok(&s) && mb_guards_ok(&d),
                  "%s all_gather %s: result differs", mem, inplace ? "in place" : "out of place");
        mb_free(&s), mb_free(&d);
    }
    /* all_to_all_v with displacements: the block to self lands at recv_displs[0], the rest of
     * recv keeps its bytes */
    {
        const int64_t ns = 20, nr = 25, cnt = 9, sd = 3, rd = 11;
        fill_values(src, ns, FM_COMM_F64, 7);
        membuf s = mb_new(be, ns, 8), d = mb_new(be, nr, 8);
        mb_write(&s, 0, src, ns);
        unsigned char before[32 * 8];
        memcpy(before, mb_data(&d), (size_t)nr * 8);
        memcpy(want, before, (size_t)nr * 8);
        memcpy(want + rd * 8, src + sd * 8, (size_t)cnt * 8);
        const int64_t scount[1] = {cnt}, sdisp[1] = {sd}, rcount[1] = {cnt}, rdisp[1] = {rd};
        CHECK_MSG(fm_comm_all_to_all_v(c, mb_data(&s), scount, sdisp, mb_data(&d), rcount, rdisp, FM_COMM_F64, 0) ==
                      FM_OK, "%s: %s", mem, fm_errmsg());
        CHECK_MSG(!memcmp(mb_data(&d), want, (size_t)nr * 8) && mb_guards_ok(&d), "%s all_to_all_v: result differs",
                  mem);
        /* zero counts, NULL buffers: nothing */
        const int64_t zero[1] = {0};
        CHECK(fm_comm_all_to_all_v(c, NULL, zero, zero, NULL, zero, zero, FM_COMM_BYTE, 0) == FM_OK);
        /* bytes, odd sizes */
        const int64_t bc[1] = {5}, bs[1] = {1}, br[1] = {2};
        memcpy(want, mb_data(&d), 16);
        memcpy(want + 2, (const unsigned char *)mb_data(&s) + 1, 5);
        CHECK(fm_comm_all_to_all_v(c, mb_data(&s), bc, bs, mb_data(&d), bc, br, FM_COMM_BYTE, 0) == FM_OK);
        CHECK_MSG(!memcmp(mb_data(&d), want, 16), "%s all_to_all_v (bytes): result differs", mem);
        mb_free(&s), mb_free(&d);
    }
    /* broadcast from root 0 */
    for (int inplace = 0; inplace < 2; inplace++) {
        const int64_t cnt = 17;
        fill_values(src, cnt, FM_COMM_F32, 8);
        membuf s = mb_new(be, cnt, 4), d = mb_new(be, cnt, 4);
        mb_write(&s, 0, src, cnt);
        void *recv = inplace ? mb_data(&s) : mb_data(&d);
        CHECK_MSG(fm_comm_broadcast(c, mb_data(&s), recv, cnt, FM_COMM_F32, 0, 0) == FM_OK, "%s: %s", mem,
                  fm_errmsg());
        CHECK_MSG(!memcmp(recv, src, (size_t)cnt * 4) && mb_guards_ok(&s) && mb_guards_ok(&d),
                  "%s broadcast %s: result differs", mem, inplace ? "in place" : "out of place");
        mb_free(&s), mb_free(&d);
    }
    CHECK(fm_comm_barrier(c, 0) == FM_OK);
    CHECK(fm_comm_barrier(c, 2.5) == FM_OK);
    /* zero counts with NULL buffers are valid everywhere */
    CHECK(fm_comm_all_reduce(c, NULL, NULL, 0, FM_COMM_F64, FM_COMM_MAX, 0) == FM_OK);
    CHECK(fm_comm_reduce_scatter(c, NULL, NULL, 0, FM_COMM_I64, FM_COMM_SUM, 0) == FM_OK);
    CHECK(fm_comm_all_gather(c, NULL, NULL, 0, FM_COMM_BF16, 0) == FM_OK);
    CHECK(fm_comm_broadcast(c, NULL, NULL, 0, FM_COMM_BYTE, 0, 0) == FM_OK);
}

/* ---- host-value wrappers --------------------------------------------------------------------- */

static void test_wrappers(const fm_comm *c) {
    double d[4] = {1.5, -2.0, 1e300, -0.0}, d0[4];
    float f[3] = {3.0f, -1.0f, 0.25f}, f0[3];
    int64_t i[3] = {INT64_MAX, -7, 0}, i0[3];
    memcpy(d0, d, sizeof d), memcpy(f0, f, sizeof f), memcpy(i0, i, sizeof i);
    /* one rank: the sum and the max of one contribution are the contribution */
    const void *cd[1] = {d0}, *cf[1] = {f0}, *ci[1] = {i0};
    double wd[4];
    float wf[3];
    int64_t wi[3];
    CHECK(fm_comm_allreduce_sum_f64(c, d, 4, 0) == FM_OK);
    ref_reduce(wd, cd, 1, 4, FM_COMM_F64, FM_COMM_SUM);
    CHECK(!memcmp(d, wd, sizeof d));
    CHECK(fm_comm_allreduce_max_f64(c, d, 4, 0) == FM_OK);
    ref_reduce(wd, cd, 1, 4, FM_COMM_F64, FM_COMM_MAX);
    CHECK(!memcmp(d, wd, sizeof d));
    CHECK(fm_comm_allreduce_sum_f32(c, f, 3, 0) == FM_OK && fm_comm_allreduce_max_f32(c, f, 3, 10) == FM_OK);
    ref_reduce(wf, cf, 1, 3, FM_COMM_F32, FM_COMM_SUM);
    CHECK(!memcmp(f, wf, sizeof f));
    CHECK(fm_comm_allreduce_sum_i64(c, i, 3, 0) == FM_OK && fm_comm_allreduce_max_i64(c, i, 3, 0) == FM_OK);
    ref_reduce(wi, ci, 1, 3, FM_COMM_I64, FM_COMM_MAX);
    CHECK(!memcmp(i, wi, sizeof i));
    CHECK(fm_comm_allreduce_sum_f64(c, NULL, 0, 0) == FM_OK);
    CHECK(fm_comm_allreduce_sum_f64(c, NULL, 2, 0) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "rank 0 of 1: all_reduce_host(fp64 sum, 2 elements): host buffer is NULL"),
              "message: %s", fm_errmsg());
    double *big = calloc(FM_COMM_HOST_MAX_ELEMS + 1, sizeof(double));
    CHECK(fm_comm_allreduce_max_f64(c, big, FM_COMM_HOST_MAX_ELEMS, 0) == FM_OK);
    CHECK(fm_comm_allreduce_max_f64(c, big, FM_COMM_HOST_MAX_ELEMS + 1, 0) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "FM_COMM_HOST_MAX_ELEMS"), "message: %s", fm_errmsg());
    free(big);
}

/* ---- bad arguments ----------------------------------------------------------------------------- */

#define EXPECT_ARG(call, needle)                                                                         \
    do {                                                                                                 \
        const fm_status st_ = (call);                                                                    \
        CHECK_MSG(st_ == FM_ERR_ARG, "%s: expected FM_ERR_ARG, got %s (%s)", #call, fm_status_name(st_), \
                  fm_errmsg());                                                                          \
        CHECK_MSG(strstr(fm_errmsg(), (needle)) != NULL, "%s: message '%s' lacks '%s'", #call, fm_errmsg(), \
                  (needle));                                                                             \
    } while (0)

static void test_bad_args(const fm_comm *c) {
    float a[16] = {0}, b[16] = {0};
    memcpy(b, a, sizeof a);
    EXPECT_ARG(fm_comm_all_reduce(c, a, b, -3, FM_COMM_F32, FM_COMM_SUM, 0),
               "rank 0 of 1: all_reduce(fp32 sum): send count -3 is negative");
    EXPECT_ARG(fm_comm_all_reduce(c, NULL, b, 16, FM_COMM_F64, FM_COMM_SUM, 0),
               "rank 0 of 1: all_reduce(fp64 sum, 16 elements): send buffer is NULL with 16 elements");
    EXPECT_ARG(fm_comm_all_reduce(c, a, NULL, 1, FM_COMM_F32, FM_COMM_MAX, 0),
               "all_reduce(fp32 max, 1 element): recv buffer is NULL with 1 element");
    EXPECT_ARG(fm_comm_all_reduce(c, a, a + 1, 8, FM_COMM_F32, FM_COMM_SUM, 0), "overlaps");
    EXPECT_ARG(fm_comm_all_reduce(c, a, b, 4, FM_COMM_BYTE, FM_COMM_SUM, 0), "bytes cannot be reduced");
    EXPECT_ARG(fm_comm_all_reduce(c, a, b, 4, (fm_comm_dtype)42, FM_COMM_SUM, 0), "unknown element type 42");
    EXPECT_ARG(fm_comm_all_reduce(c, a, b, 4, FM_COMM_F32, (fm_comm_op)9, 0), "unknown reduction 9");
    EXPECT_ARG(fm_comm_all_reduce(c, a, b, 4, FM_COMM_F32, FM_COMM_SUM, -1.0),
               "all_reduce(fp32 sum, 4 elements): timeout -1 s must be >= 0 (0: the default, 300 s)");
    EXPECT_ARG(fm_comm_all_reduce(c, a, b, 4, FM_COMM_F32, FM_COMM_SUM, NAN), "timeout nan s");
    EXPECT_ARG(fm_comm_reduce_scatter(c, a, a + 2, 4, FM_COMM_F32, FM_COMM_SUM, 0), "overlaps");
    EXPECT_ARG(fm_comm_reduce_scatter(c, a, b, -1, FM_COMM_I64, FM_COMM_MAX, 0),
               "reduce_scatter(int64 max): send count -1 is negative");
    EXPECT_ARG(fm_comm_all_gather(c, a, NULL, 3, FM_COMM_BF16, 0),
               "all_gather(bf16, 3 elements): recv buffer is NULL");
    EXPECT_ARG(fm_comm_broadcast(c, a, b, 4, FM_COMM_F32, 1, 0), "broadcast(fp32, 4 elements): root 1 is not a rank");
    EXPECT_ARG(fm_comm_broadcast(c, a, b, 4, FM_COMM_F32, -1, 0), "root -1");
    EXPECT_ARG(fm_comm_barrier(c, -5), "rank 0 of 1: barrier(): timeout -5 s");
    /* all_to_all_v: counts that disagree with one rank, negative counts and displacements, NULL
     * arrays, NULL buffers with counts, blocks that overlap */
    const int64_t c4[1] = {4}, c5[1] = {5}, z[1] = {0}, m1[1] = {-1}, d2[1] = {2};
    EXPECT_ARG(fm_comm_all_to_all_v(c, a, c4, z, b, c5, z, FM_COMM_F32, 0),
               "rank 0 of 1: all_to_all_v(fp32): rank 0 sends 4 elements to itself (send_counts[0]) but expects 5");
    EXPECT_ARG(fm_comm_all_to_all_v(c, a, m1, z, b, m1, z, FM_COMM_F32, 0), "send_counts[0] = -1 is negative");
    EXPECT_ARG(fm_comm_all_to_all_v(c, a, c4, z, b, c4, m1, FM_COMM_F32, 0), "recv_displs[0] = -1 is negative");
    EXPECT_ARG(fm_comm_all_to_all_v(c, a, c4, NULL, b, c4, z, FM_COMM_F32, 0), "found send_displs NULL");
    EXPECT_ARG(fm_comm_all_to_all_v(c, NULL, c4, z, b, c4, z, FM_COMM_F32, 0), "send buffer is NULL with 4 elements");
    EXPECT_ARG(fm_comm_all_to_all_v(c, a, c4, z, a, c4, d2, FM_COMM_F32, 0), "send block");
    /* a rejected call wrote nothing */
    bool untouched = true;
    for (int i = 0; i < 16; i++) untouched &= a[i] == 0.0f && b[i] == 0.0f;
    CHECK_MSG(untouched, "a rejected collective wrote its buffers");
    /* creation */
    fm_comm x;
    EXPECT_ARG(fm_comm_self_create(&x, NULL, -1), "default timeout -1 s must be >= 0");
    CHECK(x.ops == NULL && x.ctx == NULL);
    EXPECT_ARG(fm_comm_self_create(NULL, NULL, 0), "out is NULL");
    fm_comm s2;
    EXPECT_ARG(c->ops->split(c->ctx, -2, 0, &s2), "split(color -2): color must be >= 0");
    CHECK(s2.ops == NULL && s2.ctx == NULL);
}

/* ---- messages, timeouts ----------------------------------------------------------------------- */

static void test_messages(void) {
    char buf[128];
    CHECK(!strcmp(fm_comm_describe(buf, sizeof buf, "all_reduce", FM_COMM_F64, FM_COMM_SUM, 16),
                  "all_reduce(fp64 sum, 16 elements)"));
    CHECK(!strcmp(fm_comm_describe(buf, sizeof buf, "all_gather", FM_COMM_BF16, -1, 1), "all_gather(bf16, 1 element)"));
    CHECK(!strcmp(fm_comm_describe(buf, sizeof buf, "all_to_all_v", FM_COMM_I64, -1, -1), "all_to_all_v(int64)"));
    CHECK(fm_comm_dtype_size(FM_COMM_F32) == 4 && fm_comm_dtype_size(FM_COMM_F64) == 8 &&
          fm_comm_dtype_size(FM_COMM_I64) == 8 && fm_comm_dtype_size(FM_COMM_BF16) == 2 &&
          fm_comm_dtype_size(FM_COMM_BYTE) == 1 && fm_comm_dtype_size(FM_COMM_DTYPE_COUNT) == 0);
    double eff = -1;
    CHECK(fm_comm_check_timeout(3, 8, "all_reduce(fp64 sum, 16 elements)", 0, 30, &eff) == FM_OK && eff == 30);
    CHECK(fm_comm_check_timeout(3, 8, "x", 7.5, 30, &eff) == FM_OK && eff == 7.5);
    CHECK(fm_comm_check_timeout(3, 8, "all_reduce(fp64 sum, 16 elements)", -2, 30, &eff) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "rank 3 of 8: all_reduce(fp64 sum, 16 elements): timeout -2 s"), "message: %s",
              fm_errmsg());
    CHECK(fm_comm_check_disjoint(0, 1, "x", "a", buf, 8, "b", buf + 8, 8) == FM_OK); /* adjacent is fine */
    CHECK(fm_comm_check_disjoint(0, 1, "x", "a", buf, 9, "b", buf + 8, 8) == FM_ERR_ARG);
    CHECK(fm_comm_check_disjoint(0, 1, "x", "a", buf, 0, "b", buf, 8) == FM_OK);     /* empty */
    fm_comm c;
    CHECK(fm_comm_self_create(&c, NULL, 12.5) == FM_OK);
    CHECK(c.ops->default_timeout(c.ctx) == 12.5);
    float f = 1.0f;
    CHECK(fm_comm_all_reduce(&c, &f, &f, 1, FM_COMM_F32, FM_COMM_SUM, -1) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "(0: the default, 12.5 s)"), "message: %s", fm_errmsg());
    fm_comm_free(&c);
    CHECK(c.ops == NULL && c.ctx == NULL);
    fm_comm_free(&c);   /* empty: nothing */
    fm_comm_free(NULL); /* nothing */
}

/* ---- choosing the communicator: --comm, --comm-check, the node-local rank -------------------- */

/* Hands comm the launcher variables kv (name, value, ..., NULL); every other one unset. */
static void launcher_env(const char *const *kv) {
    const char *vals[FM_COMM_ENV_COUNT] = {0};
    for (int k = 0; kv[k]; k += 2)
        for (int i = 0; i < FM_COMM_ENV_COUNT; i++)
            if (!strcmp(kv[k], fm_comm_env_names[i])) vals[i] = kv[k + 1];
    FM_ASSERT(fm_comm_env_set(vals) == FM_OK);
}

static void test_choice(const fm_backend *cpu) {
    fm_comm_kind k = FM_COMM_KIND_COUNT;
    CHECK(fm_comm_kind_parse("nccl", &k) == FM_OK && k == FM_COMM_KIND_NCCL);
    CHECK(fm_comm_kind_parse("mpi", &k) == FM_OK && k == FM_COMM_KIND_MPI);
    CHECK(fm_comm_kind_parse("auto", &k) == FM_OK && k == FM_COMM_KIND_AUTO);
    EXPECT_ARG(fm_comm_kind_parse("gloo", &k), "--comm \"gloo\": expected auto, mpi or nccl");
    CHECK(!strcmp(fm_comm_kind_name(FM_COMM_KIND_NCCL), "nccl") && !strcmp(fm_comm_kind_name(FM_COMM_KIND_COUNT), "?"));
    fm_comm_nccl_check nc = FM_COMM_NCCL_CHECK_DEFERRED;
    CHECK(fm_comm_nccl_check_parse("collective", &nc) == FM_OK && nc == FM_COMM_NCCL_CHECK_COLLECTIVE);
    CHECK(fm_comm_nccl_check_parse("deferred", &nc) == FM_OK && nc == FM_COMM_NCCL_CHECK_DEFERRED);
    EXPECT_ARG(fm_comm_nccl_check_parse("never", &nc), "expected deferred or collective");
    /* the node-local rank from each launcher's variables (as the CLI hands them over,
     * fm_comm_env_set), in order; a bad one named */
    int lr = -1, ls = -1;
    const char *src = NULL;
    launcher_env((const char *const[]){"MPI_LOCALRANKID", "2", "MPI_LOCALNRANKS", "4", NULL});
    CHECK(fm_comm_local(&lr, &ls, &src) == FM_OK && lr == 2 && ls == 4 && !strcmp(src, "MPICH"));
    launcher_env((const char *const[]){"MPI_LOCALRANKID", "2", "MPI_LOCALNRANKS", "4", "OMPI_COMM_WORLD_LOCAL_RANK", "1",
                                       "OMPI_COMM_WORLD_LOCAL_SIZE", "3", NULL});
    CHECK(fm_comm_local(&lr, &ls, &src) == FM_OK && lr == 1 && ls == 3 && !strcmp(src, "OMPI")); /* Open MPI first */
    launcher_env((const char *const[]){"MPI_LOCALRANKID", "2", "MPI_LOCALNRANKS", "4", "OMPI_COMM_WORLD_LOCAL_RANK", "3",
                                       "OMPI_COMM_WORLD_LOCAL_SIZE", "3", NULL});
    EXPECT_ARG(fm_comm_local(&lr, &ls, &src), "OMPI_COMM_WORLD_LOCAL_RANK = 3 and OMPI_COMM_WORLD_LOCAL_SIZE = 3");
    launcher_env((const char *const[]){"SLURM_LOCALID", "1", "SLURM_NTASKS_PER_NODE", "2", NULL});
    CHECK(fm_comm_local(&lr, &ls, &src) == FM_OK && lr == 1 && ls == 2 && !strcmp(src, "SLURM"));
    /* not a plain count: not used; one rank here */
    launcher_env((const char *const[]){"SLURM_LOCALID", "1", "SLURM_NTASKS_PER_NODE", "2(x3)", NULL});
    CHECK(fm_comm_local(&lr, &ls, &src) == FM_OK && lr == 0 && ls == 1 && !strcmp(src, "none"));
    /* the launcher's rank and size; a bad one named */
    int R = -1, W = -1;
    launcher_env((const char *const[]){"PMI_RANK", "1", "PMI_SIZE", "3", "SLURM_PROCID", "0", "SLURM_NTASKS", "2", NULL});
    CHECK(fm_comm_launcher(&R, &W, &src) == FM_OK && R == 1 && W == 3 && !strcmp(src, "PMI")); /* PMI before Slurm */
    launcher_env((const char *const[]){"OMPI_COMM_WORLD_RANK", "x", "OMPI_COMM_WORLD_SIZE", "2", NULL});
    EXPECT_ARG(fm_comm_launcher(&R, &W, &src), "environment variable OMPI_COMM_WORLD_RANK = \"x\"");
    CHECK(fm_comm_env_get("OMPI_COMM_WORLD_SIZE") && !strcmp(fm_comm_env_get("OMPI_COMM_WORLD_SIZE"), "2"));
    CHECK(fm_comm_env_get("PMI_RANK") == NULL && fm_comm_env_get("HOME") == NULL); /* unset; not comm's */
    launcher_env((const char *const[]){NULL});
    CHECK(fm_comm_launcher(&R, &W, &src) == FM_OK && R == 0 && W == 1 && !strcmp(src, "none"));
    CHECK(fm_comm_local(&lr, &ls, &src) == FM_OK && lr == 0 && ls == 1);
    /* one rank, auto: exactly the self communicator; nccl needs a CUDA backend (and the build) */
    fm_comm c;
    fm_comm_kind chosen = FM_COMM_KIND_COUNT;
    CHECK(fm_comm_world_create_kind(&c, cpu, 0, FM_COMM_KIND_AUTO, 0, &chosen) == FM_OK);
    CHECK(chosen == FM_COMM_KIND_AUTO && !strcmp(c.ops->name, "self") && fm_comm_size(&c) == 1);
    CHECK(fm_comm_wait(&c, 0) == FM_OK); /* no wait op: every collective is complete on return */
    fm_comm_free(&c);
    char why[200] = "";
    CHECK(!fm_comm_nccl_usable(cpu, 1, why, sizeof why) && why[0]);
    const fm_status s = fm_comm_world_create_kind(&c, cpu, 0, FM_COMM_KIND_NCCL, 0, &chosen);
    CHECK(s != FM_OK && chosen == FM_COMM_KIND_NCCL && c.ops == NULL);
    CHECK_MSG(fm_comm_nccl_built() ? strstr(fm_errmsg(), "needs the CUDA backend") != NULL
                                   : strstr(fm_errmsg(), "built without NCCL") != NULL, "message: %s", fm_errmsg());
    EXPECT_ARG(fm_comm_world_create_kind(&c, cpu, 0, FM_COMM_KIND_COUNT, 0, NULL), "unknown communicator kind");
}

/* ---- process groups ---------------------------------------------------------------------------- */

static int two_rank(void *ctx) { (void)ctx; return 1; }
static int two_size(void *ctx) { (void)ctx; return 2; }

static void test_groups(const fm_comm *world) {
    fm_comm_group g;
    CHECK_MSG(fm_comm_group_create(&g, world, 1, 1, 1) == FM_OK, "%s", fm_errmsg());
    const char *names[FM_AXIS_COUNT] = {"world", "dp", "ep", "sp"};
    for (int a = 0; a < FM_AXIS_COUNT; a++) {
        const fm_process_group *p = &g.axis[a];
        CHECK(p->axis == (fm_mesh_axis)a && !strcmp(p->name, names[a]) && !strcmp(fm_mesh_axis_name(p->axis), names[a]));
        CHECK(p->degree == 1 && p->comm.ops && fm_comm_size(&p->comm) == 1 && fm_comm_rank(&p->comm) == 0);
        CHECK(!strcmp(p->comm.ops->name, "self"));
        if (a == FM_AXIS_WORLD) CHECK(p->comm.ctx == world->ctx);
        else CHECK(p->comm.ctx != world->ctx && p->comm.ctx != g.axis[(a % 3) + 1].comm.ctx);
        double v[2] = {2.5, -1.0};
        CHECK(fm_comm_allreduce_sum_f64(&p->comm, v, 2, 0) == FM_OK && v[0] == 2.5 && v[1] == -1.0);
    }
    CHECK(!strcmp(fm_mesh_axis_name(FM_AXIS_COUNT), "?"));
    fm_comm_group_free(&g);
    for (int a = 0; a < FM_AXIS_COUNT; a++) CHECK(g.axis[a].comm.ctx == NULL);
    CHECK(world->ctx != NULL); /* the world is the caller's */
    EXPECT_ARG(fm_comm_group_create(&g, world, 2, 1, 1), "mesh degrees dp 2, ep 1, sp 1 need more ranks than the 1");
    EXPECT_ARG(fm_comm_group_create(&g, world, 1, 0, 1), "must each be >= 1");
    EXPECT_ARG(fm_comm_group_create(&g, NULL, 1, 1, 1), "no world communicator");
    /* a world that claims two ranks but splits like self: degrees that disagree with its size
     * are refused before any split; a valid mesh is refused when a split gives the wrong size
     * (the meshes over real ranks are tests/test_comm_mpi.c's) */
    fm_comm_ops two = *world->ops;
    two.rank = two_rank;
    two.size = two_size;
    fm_comm w2 = {&two, world->ctx};
    EXPECT_ARG(fm_comm_group_create(&g, &w2, 1, 1, 1), "rank 1 of 2: mesh degrees dp 1, ep 1, sp 1: dp x sp = 1 "
               "ranks, but 2 ranks are running");
    EXPECT_ARG(fm_comm_group_create(&g, &w2, 2, 3, 1), "rank 1 of 2: mesh degrees dp 2, ep 3, sp 1: ep 3 does not "
               "divide dp x sp = 2 ranks");
    const fm_status st = fm_comm_group_create(&g, &w2, 2, 1, 1);
    CHECK(st == FM_ERR_UNSUPPORTED);
    CHECK_MSG(strstr(fm_errmsg(), "rank 1 of 2: the dp axis's split of the 'self' world communicator has 1 rank, "
                     "expected 2"), "message: %s", fm_errmsg());
    for (int a = 0; a < FM_AXIS_COUNT; a++) CHECK(g.axis[a].comm.ctx == NULL);
}

int main(void) {
    fm_comm host;
    CHECK(fm_comm_self_create(&host, NULL, 0) == FM_OK);
    CHECK(!strcmp(host.ops->name, "self") && fm_comm_mem_is_host(&host));
    CHECK(host.ops->default_timeout(host.ctx) == FM_COMM_DEFAULT_TIMEOUT_S);
    test_collectives(&host, NULL, "host");
    test_wrappers(&host);
    test_bad_args(&host);
    test_messages();
    test_groups(&host);

    /* backend memory: every copy goes through the backend's copy op */
    fm_backend cpu;
    CHECK(fm_cpu_backend_init(&cpu, 1, 64) == FM_OK);
    g_cpu_ops = cpu.ops;
    test_choice(&cpu);
    g_counting_ops = *cpu.ops;
    g_counting_ops.copy = counting_copy;
    fm_backend be = {&g_counting_ops, cpu.ctx};
    fm_comm dev;
    CHECK(fm_comm_self_create(&dev, &be, 0) == FM_OK);
    CHECK(!fm_comm_mem_is_host(&dev));
    g_copies = 0;
    test_collectives(&dev, &be, "backend");
    /* out-of-place all_reduce 3 types x 2 ops, bf16, reduce_scatter, all_gather, all_to_all_v x2,
     * broadcast: one copy each; in-place forms none */
    CHECK_MSG(g_copies == 6 + 1 + 1 + 1 + 2 + 1, "backend copies: %d", g_copies);
    fm_comm split;
    CHECK(dev.ops->split(dev.ctx, 0, 5, &split) == FM_OK && !fm_comm_mem_is_host(&split));
    fm_comm_free(&split);
    fm_backend nocopy_be = {NULL, NULL};
    fm_comm x;
    EXPECT_ARG(fm_comm_self_create(&x, &nocopy_be, 0), "the backend has no copy op");
    fm_comm_free(&dev);
    fm_cpu_backend_free(&cpu);
    fm_comm_free(&host);
    return fm_test_finish();
}
