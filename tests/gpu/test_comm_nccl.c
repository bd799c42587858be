/* The nccl communicator (src/comm/fm_comm_nccl.c) on GPU ranks (label gpu), checked against host
 * computations of the same collectives:
 *   test_comm_nccl one       one rank (no MPI): every collective, both check modes
 *   test_comm_nccl all       under mpirun -np W (one GPU per rank: W <= the GPUs; skips, exit 77,
 *                            with fewer): the same at W ranks, with a rank that sends and receives
 *                            nothing in all_to_all_v
 *   test_comm_nccl timeout   under mpirun -np 2 (2+ GPUs): rank 1 never joins; rank 0's
 *                            collective must fail with FM_ERR_IO naming the rank, the collective
 *                            and the timeout, in the collective mode and, in the deferred mode, at
 *                            the backend's stream_sync (its wait hook)
 *   test_comm_nccl devices   prints the number of CUDA devices (tests/gpu/nccl_comm.sh's skip)
 * Every value is a small integer or half-integer, so fp32, fp64 and int64 sums are exact in any
 * order, and bf16 sums of W <= 8 such values are exact too: results compare bit for bit.
 * tests/gpu/nccl_comm.sh runs the multi-rank modes (mpirun flags, the skip on one GPU). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/fm_comm.h"
#include "comm/fm_comm_nccl.h"
#include "gpu_test.h"

static int R, W;        /* this rank, the ranks */
static bool nvls_user; /* NCCL_NVLS_ENABLE was set before the test started */

/* The test value of rank q at index i in dtype t, as a double (exact in every dtype). */
static double val(int q, int64_t i, fm_comm_dtype t) {
    const double v = (double)((q * 7 + i * 3) % 11) - 5.0 + (t == FM_COMM_I64 ? 0.0 : 0.5 * (double)(i % 2));
    return t == FM_COMM_I64 ? v * 1000.0 + (double)i : v;
}

/* Host buffer [n] of dtype t from doubles, and back. */
static void pack(void *dst, const double *x, int64_t n, fm_comm_dtype t) {
    for (int64_t i = 0; i < n; i++) {
        if (t == FM_COMM_F32) ((float *)dst)[i] = (float)x[i];
        else if (t == FM_COMM_F64) ((double *)dst)[i] = x[i];
        else if (t == FM_COMM_I64) ((int64_t *)dst)[i] = (int64_t)x[i];
        else if (t == FM_COMM_BF16) ((uint16_t *)dst)[i] = gt_f32_to_bf16((float)x[i]);
        else ((unsigned char *)dst)[i] = (unsigned char)((int64_t)x[i] & 0xff);
    }
}
static double unpack1(const void *src, int64_t i, fm_comm_dtype t) {
    if (t == FM_COMM_F32) return ((const float *)src)[i];
    if (t == FM_COMM_F64) return ((const double *)src)[i];
    if (t == FM_COMM_I64) return (double)((const int64_t *)src)[i];
    if (t == FM_COMM_BF16) return gt_bf16_to_f32(((const uint16_t *)src)[i]);
    return ((const unsigned char *)src)[i];
}

/* Device buffer of n elements of t holding rank q's values from index offset i0 (NULL values: zeros). */
static void *dev_vals(const fm_backend *be, int q, int64_t i0, int64_t n, fm_comm_dtype t, bool zeros) {
    const size_t es = fm_comm_dtype_size(t);
    void *d = be->ops->mem_alloc(be->ctx, (size_t)n * es + 256);
    FM_ASSERT(d);
    if (!zeros && n > 0) {
        double *x = dnew(n);
        for (int64_t i = 0; i < n; i++) x[i] = val(q, i0 + i, t);
        void *h = malloc((size_t)n * es);
        pack(h, x, n, t);
        be->ops->copy(be->ctx, d, h, (size_t)n * es, FM_COPY_H2D);
        free(h), free(x);
    }
    return d;
}

/* Number of elements of d (dtype t) that differ from want [n]; the first miss is printed. */
static int64_t misses(const fm_backend *be, const void *d, const double *want, int64_t n, fm_comm_dtype t,
                      const char *what) {
    const size_t es = fm_comm_dtype_size(t);
    void *h = malloc((size_t)(n > 0 ? n : 1) * es);
    be->ops->copy(be->ctx, h, d, (size_t)n * es, FM_COPY_D2H);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const double g = unpack1(h, i, t);
        double w = want[i];
        if (t == FM_COMM_BF16) w = gt_bf16_to_f32(gt_f32_to_bf16((float)w));
        if (t == FM_COMM_F32) w = (float)w;
        if (t == FM_COMM_BYTE) w = (double)((int64_t)w & 0xff);
        if (g != w) {
            if (bad == 0) fprintf(stderr, "rank %d: %s: element %lld is %.9g, expected %.9g\n", R, what, (long long)i, g, w);
            bad++;
        }
    }
    free(h);
    return bad;
}

/* In the deferred mode the collectives are only enqueued: the check is the communicator's wait
 * (the trainer's is its stream_sync, through the wait hook). */
static void settle(const fm_comm *c, const fm_backend *be) {
    CHECK(fm_comm_wait(c, 0) == FM_OK);
    be->ops->stream_sync(be->ctx, FM_STREAM_COMPUTE);
    CHECK(be->ops->status(be->ctx) == FM_OK);
}

static void test_all_reduce(const fm_comm *c, const fm_backend *be) {
    static const fm_comm_dtype types[4] = {FM_COMM_F32, FM_COMM_F64, FM_COMM_I64, FM_COMM_BF16};
    const int64_t n = 1000;
    for (int ti = 0; ti < 4; ti++)
        for (int op = 0; op < FM_COMM_OP_COUNT; op++)
            for (int in_place = 0; in_place < 2; in_place++) {
                const fm_comm_dtype t = types[ti];
                void *send = dev_vals(be, R, 0, n, t, false);
                void *recv = in_place ? send : dev_vals(be, 0, 0, n, t, true);
                double *want = dnew(n);
                for (int64_t i = 0; i < n; i++) {
                    double a = val(0, i, t);
                    for (int q = 1; q < W; q++) a = op == FM_COMM_SUM ? a + val(q, i, t) : fmax(a, val(q, i, t));
                    want[i] = a;
                }
                const fm_status s = fm_comm_all_reduce(c, send, recv, n, t, (fm_comm_op)op, 0);
                CHECK_MSG(s == FM_OK, "all_reduce %s %s: %s", fm_comm_dtype_name(t), fm_comm_op_name(op), fm_errmsg());
                settle(c, be);
                char what[80];
                snprintf(what, sizeof what, "all_reduce(%s %s%s)", fm_comm_dtype_name(t), fm_comm_op_name(op),
                         in_place ? ", in place" : "");
                CHECK(misses(be, recv, want, n, t, what) == 0);
                if (!in_place) be->ops->mem_free(be->ctx, recv);
                be->ops->mem_free(be->ctx, send);
                free(want);
            }
}

static void test_reduce_scatter_all_gather(const fm_comm *c, const fm_backend *be) {
    const int64_t k = 333;
    static const fm_comm_dtype types[2] = {FM_COMM_F32, FM_COMM_BF16};
    for (int ti = 0; ti < 2; ti++)
        for (int in_place = 0; in_place < 2; in_place++) {
            const fm_comm_dtype t = types[ti];
            const size_t es = fm_comm_dtype_size(t);
            void *send = dev_vals(be, R, 0, (int64_t)W * k, t, false);
            void *recv = in_place ? (char *)send + (size_t)R * (size_t)k * es : dev_vals(be, 0, 0, k, t, true);
            double *want = dnew(k);
            for (int64_t i = 0; i < k; i++)
                for (int q = 0; q < W; q++) want[i] += val(q, (int64_t)R * k + i, t);
            CHECK_MSG(fm_comm_reduce_scatter(c, send, recv, k, t, FM_COMM_SUM, 0) == FM_OK, "reduce_scatter: %s",
                      fm_errmsg());
            settle(c, be);
            CHECK(misses(be, recv, want, k, t, in_place ? "reduce_scatter (in place)" : "reduce_scatter") == 0);
            if (!in_place) be->ops->mem_free(be->ctx, recv);
            be->ops->mem_free(be->ctx, send);
            free(want);
        }
    static const fm_comm_dtype gtypes[3] = {FM_COMM_F32, FM_COMM_I64, FM_COMM_BYTE};
    for (int ti = 0; ti < 3; ti++)
        for (int in_place = 0; in_place < 2; in_place++) {
            const fm_comm_dtype t = gtypes[ti];
            const size_t es = fm_comm_dtype_size(t);
            void *recv = dev_vals(be, 0, 0, (int64_t)W * k, t, true);
            void *send = in_place ? (char *)recv + (size_t)R * (size_t)k * es : dev_vals(be, R, 0, k, t, false);
            if (in_place) { /* this rank's block already in place */
                void *mine = dev_vals(be, R, 0, k, t, false);
                be->ops->copy(be->ctx, send, mine, (size_t)k * es, FM_COPY_D2D);
                be->ops->mem_free(be->ctx, mine);
            }
            double *want = dnew((int64_t)W * k);
            for (int q = 0; q < W; q++)
                for (int64_t i = 0; i < k; i++) want[(int64_t)q * k + i] = val(q, i, t);
            CHECK_MSG(fm_comm_all_gather(c, send, recv, k, t, 0) == FM_OK, "all_gather: %s", fm_errmsg());
            settle(c, be);
            CHECK(misses(be, recv, want, (int64_t)W * k, t, in_place ? "all_gather (in place)" : "all_gather") == 0);
            if (!in_place) be->ops->mem_free(be->ctx, send);
            be->ops->mem_free(be->ctx, recv);
            free(want);
        }
}

static void test_broadcast(const fm_comm *c, const fm_backend *be) {
    const int64_t n = 77;
    const int root = W - 1;
    void *buf = dev_vals(be, R, 0, n, FM_COMM_F64, R != root); /* root's values; zeros elsewhere */
    double *want = dnew(n);
    for (int64_t i = 0; i < n; i++) want[i] = val(root, i, FM_COMM_F64);
    CHECK_MSG(fm_comm_broadcast(c, R == root ? buf : NULL, buf, n, FM_COMM_F64, root, 0) == FM_OK, "broadcast: %s",
              fm_errmsg());
    settle(c, be);
    CHECK(misses(be, buf, want, n, FM_COMM_F64, "broadcast (in place on root)") == 0);
    be->ops->mem_free(be->ctx, buf);
    free(want);
}

/* Rank p sends cnt(p, q) elements to q; zero_rank (>= 0) sends and receives nothing. */
static int64_t cnt(int p, int q, int zero_rank) {
    if (p == zero_rank || q == zero_rank) return 0;
    return (int64_t)((p * 5 + q * 3 + 1) % 7) * 11;
}

/* async: the send buffer is written by copy_async on the op stream (from pinned memory) and the
 * exchange runs on the communicator's stream after a mark of that point
 * (fm_comm_all_to_all_v_async), joined before the synchronous read-back on the op stream: the
 * mark and the join must order the two streams (a missing wait reads zeros or stale rows). */
static void test_all_to_all_v(const fm_comm *c, const fm_backend *be, int zero_rank, bool async) {
    static const fm_comm_dtype types[2] = {FM_COMM_F32, FM_COMM_BF16};
    for (int ti = 0; ti < 2; ti++) {
        const fm_comm_dtype t = types[ti];
        int64_t *sc = calloc(4 * (size_t)W, sizeof(int64_t)), *sd = sc + W, *rc = sc + 2 * W, *rd = sc + 3 * W;
        int64_t ns = 0, nr = 0;
        for (int q = 0; q < W; q++) {
            sc[q] = cnt(R, q, zero_rank), sd[q] = ns, ns += sc[q];
            rc[q] = cnt(q, R, zero_rank), rd[q] = nr + 1, nr += rc[q] + 1; /* a gap of one before each block */
        }
        /* rank R's send buffer: element j of block q is val(R, 1000 * q + j) */
        double *x = dnew(ns > 0 ? ns : 1);
        for (int q = 0; q < W; q++)
            for (int64_t j = 0; j < sc[q]; j++) x[sd[q] + j] = val(R, 1000 * q + j, t);
        const size_t es = fm_comm_dtype_size(t);
        void *send = be->ops->mem_alloc(be->ctx, (size_t)ns * es + 256);
        void *recv = be->ops->mem_alloc(be->ctx, (size_t)nr * es + 256); /* zero-filled: the gaps stay 0 */
        void *h = async ? be->ops->buffer_alloc(be->ctx, FM_BUFFER_PINNED, (size_t)(ns > 0 ? ns : 1) * es)
                        : malloc((size_t)(ns > 0 ? ns : 1) * es);
        pack(h, x, ns, t);
        if (async) be->ops->copy_async(be->ctx, send, h, (size_t)ns * es, FM_COPY_H2D, FM_STREAM_OPS);
        else be->ops->copy(be->ctx, send, h, (size_t)ns * es, FM_COPY_H2D);
        double *want = dnew(nr > 0 ? nr : 1);
        for (int p = 0; p < W; p++)
            for (int64_t j = 0; j < rc[p]; j++) want[rd[p] + j] = val(p, 1000 * R + j, t);
        fm_status s;
        if (async) {
            int mark = -1, ticket = -1;
            CHECK(fm_comm_has_async(c));
            s = fm_comm_mark(c, &mark);
            CHECK_MSG(s == FM_OK && mark >= 0, "mark: %s", fm_errmsg());
            if (s == FM_OK)
                s = fm_comm_all_to_all_v_async(c, ns ? send : NULL, sc, sd, nr ? recv : NULL, rc, rd, t, 0, mark,
                                               &ticket);
            CHECK_MSG(s != FM_OK || ticket >= 0, "all_to_all_v_async gave no ticket");
            /* the counts are read before it returns: rewriting them now changes nothing */
            for (int q = 0; q < W; q++) sc[q] = rc[q] = -1;
            if (s == FM_OK) s = fm_comm_join(c, ticket);
        } else {
            s = fm_comm_all_to_all_v(c, ns ? send : NULL, sc, sd, nr ? recv : NULL, rc, rd, t, 0);
        }
        CHECK_MSG(s == FM_OK, "all_to_all_v%s (%s, zero rank %d): %s", async ? "_async" : "", fm_comm_dtype_name(t),
                  zero_rank, fm_errmsg());
        char what[80];
        snprintf(what, sizeof what, "all_to_all_v%s(%s, zero rank %d)", async ? "_async" : "", fm_comm_dtype_name(t),
                 zero_rank);
        if (!async) settle(c, be);
        CHECK(misses(be, recv, want, nr, t, what) == 0); /* async: read on the op stream, ordered by the join alone */
        if (async) settle(c, be);
        be->ops->mem_free(be->ctx, send), be->ops->mem_free(be->ctx, recv);
        if (async) be->ops->buffer_free(be->ctx, FM_BUFFER_PINNED, h);
        else free(h);
        free(x), free(want), free(sc);
    }
}

static void test_host_and_misuse(const fm_comm *c, const fm_backend *be) {
    double v[3] = {R + 1.0, -(double)R, 0.5};
    CHECK_MSG(fm_comm_allreduce_sum_f64(c, v, 3, 0) == FM_OK, "allreduce_sum_f64: %s", fm_errmsg());
    CHECK(v[0] == W * (W + 1) / 2.0 && v[1] == -(W * (W - 1) / 2.0) && v[2] == 0.5 * W);
    int64_t m = 10 * R;
    CHECK(fm_comm_allreduce_max_i64(c, &m, 1, 0) == FM_OK && m == 10 * (W - 1));
    CHECK(fm_comm_barrier(c, 0) == FM_OK);
    /* a host buffer is refused by name (on every rank alike, before anything is enqueued) */
    float host[4] = {1, 2, 3, 4};
    void *d = be->ops->mem_alloc(be->ctx, 64);
    CHECK(fm_comm_all_reduce(c, host, d, 4, FM_COMM_F32, FM_COMM_SUM, 0) == FM_ERR_ARG &&
          strstr(fm_errmsg(), "host memory"));
    CHECK(fm_comm_all_reduce(c, d, d, 4, FM_COMM_F32, FM_COMM_SUM, -1) == FM_ERR_ARG);
    CHECK(fm_comm_all_reduce(c, d, d, 0, FM_COMM_F32, FM_COMM_SUM, 0) == FM_OK); /* count 0: nothing */
    CHECK(fm_comm_all_reduce(c, d, (char *)d + 4, 4, FM_COMM_F32, FM_COMM_SUM, 0) == FM_ERR_ARG); /* overlap */
    be->ops->mem_free(be->ctx, d);
    /* a split (every rank one color): the same ranks, and it works */
    fm_comm sub = {0};
    CHECK_MSG(c->ops->split(c->ctx, 0, W - 1 - R, &sub) == FM_OK, "split: %s", fm_errmsg());
    if (sub.ops) {
        CHECK(fm_comm_size(&sub) == W && fm_comm_rank(&sub) == W - 1 - R);
        double s2 = 1.0;
        CHECK(fm_comm_allreduce_sum_f64(&sub, &s2, 1, 0) == FM_OK && s2 == W);
        fm_comm_free(&sub);
    }
}

static int device_count(void) {
    int n = 0;
    return fm_cuda_device_count(&n) == FM_OK ? n : 0;
}

static void suite(const fm_backend *be, fm_comm_nccl_check check) {
    fm_comm c;
    const fm_status s = fm_comm_nccl_world(&c, be, 60, check);
    CHECK_MSG(s == FM_OK, "fm_comm_nccl_world (%s): %s", fm_comm_nccl_check_name(check), fm_errmsg());
    if (s != FM_OK) return;
    printf("rank %d of %d: nccl communicator, %s checks\n", fm_comm_rank(&c), fm_comm_size(&c),
           fm_comm_nccl_check_name(check));
    CHECK(fm_comm_rank(&c) == R && fm_comm_size(&c) == W && !fm_comm_mem_is_host(&c));
    if (!nvls_user) { /* NVLink multicast off unless the user set NCCL_NVLS_ENABLE */
        const char *v = getenv("NCCL_NVLS_ENABLE");
        CHECK_MSG(v && !strcmp(v, "0"), "NCCL_NVLS_ENABLE is \"%s\", expected \"0\"", v ? v : "(unset)");
    }
    test_all_reduce(&c, be);
    test_reduce_scatter_all_gather(&c, be);
    test_broadcast(&c, be);
    for (int async = 0; async < 2; async++) {
        test_all_to_all_v(&c, be, -1, async);
        test_all_to_all_v(&c, be, 0, async); /* rank 0 sends and receives nothing, yet calls */
        if (W > 1) test_all_to_all_v(&c, be, W - 1, async);
    }
    test_host_and_misuse(&c, be);
    fm_comm_free(&c);
}

/* mpirun -np 2: rank 1 never joins; rank 0 must fail in time with a clear message. */
static void timeout_test(const fm_backend *be) {
    fm_comm a, b;
    CHECK_MSG(fm_comm_nccl_world(&a, be, 5, FM_COMM_NCCL_CHECK_COLLECTIVE) == FM_OK, "world a: %s", fm_errmsg());
    CHECK_MSG(fm_comm_nccl_world(&b, be, 5, FM_COMM_NCCL_CHECK_DEFERRED) == FM_OK, "world b: %s", fm_errmsg());
    if (R == 1) {
        printf("rank 1: not joining (sleeping 12 s)\n");
        fflush(stdout);
        sleep(12);
        (void)fm_comm_mpi_finalize(); /* a clean exit for mpirun; the communicators are left as they are */
        _exit(0);
    }
    void *d = dev_vals(be, R, 0, 16, FM_COMM_F32, false);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    fm_status s = fm_comm_all_reduce(&a, d, d, 16, FM_COMM_F32, FM_COMM_SUM, 2);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double el = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("rank 0: collective mode: status %s after %.2f s: %s\n", fm_status_name(s), el, fm_errmsg());
    CHECK(s == FM_ERR_IO && el >= 1.9 && el < 10);
    CHECK(strstr(fm_errmsg(), "rank 0 of 2") && strstr(fm_errmsg(), "all_reduce(fp32 sum, 16 elements)") &&
          strstr(fm_errmsg(), "2 s"));
    CHECK(fm_comm_barrier(&a, 1) == FM_ERR_IO && strstr(fm_errmsg(), "aborted")); /* stays failed */
    fm_comm_free(&a); /* else its failure fails every host wait of the backend at once (the watchdog) */
    /* deferred: enqueued at once; the backend's stream_sync (its wait hook) ends in the error */
    clock_gettime(CLOCK_MONOTONIC, &t0);
    s = fm_comm_all_reduce(&b, d, d, 16, FM_COMM_F32, FM_COMM_MAX, 2);
    CHECK_MSG(s == FM_OK, "deferred all_reduce should only enqueue: %s", fm_errmsg());
    be->ops->stream_sync(be->ctx, FM_STREAM_COMPUTE);
    s = be->ops->status(be->ctx);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    el = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("rank 0: deferred mode: backend status %s after %.2f s: %s\n", fm_status_name(s), el, fm_errmsg());
    CHECK(s == FM_ERR_IO && el >= 1.9 && el < 10);
    CHECK(strstr(fm_errmsg(), "rank 0 of 2") && strstr(fm_errmsg(), "all_reduce(fp32 max, 16 elements)") &&
          strstr(fm_errmsg(), "2 s"));
    fm_comm_free(&b);
    printf("timeout test: %s\n", fm_test_failed ? "FAILED" : "passed");
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "one";
    nvls_user = getenv("NCCL_NVLS_ENABLE") != NULL;
    { /* the launcher's variables, handed to comm as the CLI hands them (comm reads no environment) */
        const char *vals[FM_COMM_ENV_COUNT];
        for (int i = 0; i < FM_COMM_ENV_COUNT; i++) vals[i] = getenv(fm_comm_env_names[i]);
        if (fm_comm_env_set(vals) != FM_OK) {
            fprintf(stderr, "fm_comm_env_set: %s\n", fm_errmsg());
            return 1;
        }
    }
    if (!strcmp(mode, "devices")) {
        printf("%d\n", device_count());
        return 0;
    }
    if (!fm_comm_nccl_built()) {
        printf("the nccl communicator is not in this build: skipped\n");
        return 77;
    }
    int lr = 0, ls = 1;
    if (fm_comm_launcher(&R, &W, NULL) != FM_OK || fm_comm_local(&lr, &ls, NULL) != FM_OK) {
        fprintf(stderr, "launcher: %s\n", fm_errmsg());
        return 1;
    }
    if (!strcmp(mode, "one") && W != 1) {
        fprintf(stderr, "mode one runs without mpirun (found %d ranks)\n", W);
        return 2;
    }
    const int ndev = device_count();
    if (ls > ndev) {
        printf("rank %d of %d: %d ranks on this node but %d GPU%s: NCCL needs a GPU per rank; skipped\n", R, W, ls,
               ndev, ndev == 1 ? "" : "s");
        return 77;
    }
    fm_backend be;
    if (gt_cuda_init(&be, lr, 64, 0) != FM_OK) {
        fprintf(stderr, "rank %d: CUDA backend on device %d: %s\n", R, lr, fm_errmsg());
        return 1;
    }
    if (!strcmp(mode, "timeout")) {
        if (W != 2) {
            fprintf(stderr, "mode timeout runs under mpirun -np 2 (found %d ranks)\n", W);
            return 2;
        }
        timeout_test(&be);
    } else {
        suite(&be, FM_COMM_NCCL_CHECK_COLLECTIVE);
        suite(&be, FM_COMM_NCCL_CHECK_DEFERRED);
    }
    fm_cuda_backend_free(&be);
    if (W > 1) (void)fm_comm_mpi_finalize();
    printf("rank %d: %d passed, %d failed\n", R, fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
