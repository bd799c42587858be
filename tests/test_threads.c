/* The default thread count's busy-core rule (train/fm_threads.h): the decision on synthetic
 * /proc/stat deltas, and fm_threads_auto with a thread of this process spinning, which must not
 * count as another process's work (a pthread BLAS pool spinning at start halved the count). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fm_test.h"
#include "train/fm_threads.h"

static void test_rule(void) {
    const unsigned long long tot[4] = {100, 100, 100, 0};
    const unsigned long long busy[4] = {90, 50, 51, 0};
    CHECK(fm_threads_count_busy(4, busy, tot, NULL, NULL) == 2); /* 90 and 51 of 100; exactly half is not busy */
    const unsigned long long self[4] = {80, 0, 0, 0};
    CHECK(fm_threads_count_busy(4, busy, tot, self, NULL) == 1);  /* 90 - 80 of it ours: cpu 0 is free */
    const unsigned long long more[4] = {200, 0, 0, 0};
    CHECK(fm_threads_count_busy(4, busy, tot, more, NULL) == 1); /* more of ours than the CPU's busy: 0, not a wrap */
    const unsigned char mask[4] = {1, 1, 0, 1};
    CHECK(fm_threads_count_busy(4, busy, tot, NULL, mask) == 1); /* cpu 2 outside the mask */
}

static atomic_int g_stop;
static void *spin(void *arg) {
    (void)arg;
    volatile unsigned long long x = 0;
    while (!atomic_load(&g_stop)) x++;
    return NULL;
}

static void test_own_thread(void) {
    fm_threads_probe base, with; /* no environment (ctest's OMP_NUM_THREADS would be taken as given) */
    fm_threads_auto(150, NULL, &base);
    if (base.allowed < 2 || base.busy > 0) { /* no free core to see, or others' load: nothing to compare */
        printf("skipped the spinning-thread check: %d CPUs allowed, %d busy\n", base.allowed, base.busy);
        return;
    }
    pthread_t t;
    atomic_store(&g_stop, 0);
    FM_ASSERT(pthread_create(&t, NULL, spin, NULL) == 0);
    int busy = 1;
    for (int tries = 0; tries < 3 && busy > 0; tries++) { /* another process's load may come and go */
        fm_threads_auto(150, NULL, &with);
        busy = with.busy;
    }
    atomic_store(&g_stop, 1);
    pthread_join(t, NULL);
    CHECK_MSG(busy == 0, "a spinning thread of this process counted as a busy core (%d of %d)", busy, with.allowed);
    /* all of them, but 1 under OpenBLAS's pthread build (its pool contends with OpenMP's) */
    CHECK(with.blas_pthreads == fm_threads_blas_pthreads());
    CHECK(with.threads == (with.blas_pthreads ? 1 : with.allowed) || with.local_ranks > 1);
}

/* The environment's values as the CLI hands them (fm_threads_env): OMP_NUM_THREADS used as given;
 * ranks sharing an unbound node divide the cores (never below 1); none: the probe alone. */
static void test_env(void) {
    fm_threads_probe none, p;
    fm_threads_auto(0, NULL, &none);
    CHECK(!none.from_env && none.local_ranks == 1 && none.threads >= 1);
    const fm_threads_env omp = {3, 1};
    CHECK(fm_threads_auto(0, &omp, &p) == 3 && p.from_env && p.threads == 3);
    const fm_threads_env ranks = {0, 4};
    fm_threads_auto(0, &ranks, &p);
    CHECK(!p.from_env && p.local_ranks == 4);
    CHECK_MSG(p.threads >= 1 && p.threads <= none.threads, "%d threads with 4 local ranks, %d alone", p.threads,
              none.threads);
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (!none.blas_pthreads && none.allowed >= online && none.threads >= 4)
        CHECK_MSG(p.threads == none.threads / 4, "%d threads with 4 local ranks, %d alone", p.threads, none.threads);
    const fm_threads_env zero = {0, 0}; /* a zeroed struct says nothing */
    fm_threads_auto(0, &zero, &p);
    CHECK(!p.from_env && p.local_ranks == 1 && p.threads == none.threads);
}

int main(void) {
    test_rule();
    test_env();
    test_own_thread();
    return fm_test_finish();
}
