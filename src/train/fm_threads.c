/* The default thread count of a run (fm_threads.h): affinity less busy cores. */
#define _GNU_SOURCE
#include "fm_threads.h"

#include <dirent.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_CPUS 1024

/* Per-CPU busy and total jiffies from /proc/stat ("cpuN user nice system idle iowait irq softirq
 * steal ..."); idle and iowait count as idle. Returns the number of CPU lines read, 0 on failure. */
static int read_stat(unsigned long long *busy, unsigned long long *total, int cap) {
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return 0;
    char line[512];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "cpu", 3) != 0 || line[3] < '0' || line[3] > '9') continue;
        int id;
        unsigned long long v[8] = {0};
        if (sscanf(line + 3, "%d %llu %llu %llu %llu %llu %llu %llu %llu", &id, &v[0], &v[1], &v[2], &v[3], &v[4],
                   &v[5], &v[6], &v[7]) < 5 || id < 0 || id >= cap)
            continue;
        unsigned long long t = 0;
        for (int i = 0; i < 8; i++) t += v[i];
        total[id] = t;
        busy[id] = t - v[3] - v[4];
        if (id + 1 > n) n = id + 1;
    }
    fclose(f);
    return n;
}

/* This process's own threads' CPU time: tid[i], ticks[i] (utime + stime, in the clock ticks
 * /proc/stat counts) and cpu[i] (the CPU it last ran on), from /proc/self/task/<tid>/stat. Returns
 * the threads read (at most cap), 0 without /proc. cpu may be NULL. */
#define MAX_TASKS 512
static int read_self(int *tid, unsigned long long *ticks, int *cpu, int cap) {
    DIR *d = opendir("/proc/self/task");
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while (n < cap && (e = readdir(d)) != NULL) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        char path[300], line[1024];
        snprintf(path, sizeof path, "/proc/self/task/%s/stat", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        const char *got = fgets(line, sizeof line, f);
        fclose(f);
        const char *p = got ? strrchr(line, ')') : NULL; /* the name may hold spaces: fields after it */
        if (!p) continue;
        /* after ")": state (field 3), then fields 4.. ; utime 14, stime 15, processor 39 */
        unsigned long long ut = 0, st = 0;
        int proc = -1, field = 3;
        for (const char *q = p + 2; *q && field <= 39; field++) {
            if (field == 14) ut = strtoull(q, NULL, 10);
            if (field == 15) st = strtoull(q, NULL, 10);
            if (field == 39) proc = atoi(q);
            const char *sp = strchr(q, ' ');
            if (!sp) break;
            q = sp + 1;
        }
        tid[n] = atoi(e->d_name), ticks[n] = ut + st;
        if (cpu) cpu[n] = proc;
        n++;
    }
    closedir(d);
    return n;
}

int fm_threads_count_busy(int n, const unsigned long long *dbusy, const unsigned long long *dtotal,
                          const unsigned long long *dself, const unsigned char *allowed) {
    int busy = 0;
    for (int c = 0; c < n; c++) {
        if (allowed && !allowed[c]) continue;
        const unsigned long long own = dself ? dself[c] : 0;
        const unsigned long long other = dbusy[c] > own ? dbusy[c] - own : 0;
        if (dtotal[c] > 0 && 2 * other > dtotal[c]) busy++;
    }
    return busy;
}

/* OpenBLAS's "parallel" kind (0 sequential, 1 pthreads, 2 OpenMP); weak: absent where no
 * OpenBLAS is linked */
int openblas_get_parallel(void) __attribute__((weak));

int fm_threads_blas_pthreads(void) { return openblas_get_parallel && openblas_get_parallel() == 1 ? 1 : 0; }

void openblas_set_num_threads(int num_threads) __attribute__((weak)); /* weak: absent where no OpenBLAS is linked */

void fm_threads_set(int threads) {
    if (threads < 1) return;
#ifdef _OPENMP
    omp_set_num_threads(threads);
#endif
    if (openblas_set_num_threads) openblas_set_num_threads(threads);
}

int fm_threads_get(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

int fm_threads_auto(int sample_ms, const fm_threads_env *env, fm_threads_probe *p) {
    fm_threads_probe q = {0};
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    CPU_ZERO(&set);
    int have_mask = sched_getaffinity(0, sizeof set, &set) == 0;
    q.allowed = have_mask ? CPU_COUNT(&set) : (int)(online > 0 ? online : 1);
    if (q.allowed < 1) q.allowed = 1;
    if (env && env->omp_num_threads > 0) {
        q.threads = env->omp_num_threads;
        q.from_env = 1;
        if (p) *p = q;
        return q.threads;
    }
    if (sample_ms > 0) {
        static unsigned long long b0[MAX_CPUS], t0[MAX_CPUS], b1[MAX_CPUS], t1[MAX_CPUS], db[MAX_CPUS], dt[MAX_CPUS],
            ds[MAX_CPUS], k0[MAX_TASKS], k1[MAX_TASKS];
        static int id0[MAX_TASKS], id1[MAX_TASKS], c1[MAX_TASKS];
        static unsigned char ok[MAX_CPUS];
        const int m0 = read_self(id0, k0, NULL, MAX_TASKS); /* the CPU that counts is the last one, read after */
        int n0 = read_stat(b0, t0, MAX_CPUS);
        struct timespec ts = {sample_ms / 1000, (long)(sample_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        int n1 = read_stat(b1, t1, MAX_CPUS);
        const int m1 = read_self(id1, k1, c1, MAX_TASKS);
        int n = n0 < n1 ? n0 : n1;
        for (int c = 0; c < n; c++) {
            db[c] = b1[c] - b0[c], dt[c] = t1[c] - t0[c], ds[c] = 0;
            ok[c] = !have_mask || CPU_ISSET(c, &set);
        }
        /* this process's own threads (a BLAS library's pool spinning at start, say) are not
         * another process's work: each one's time over the sample is taken off the CPU it ran on */
        for (int i = 0; i < m1; i++) {
            unsigned long long before = 0;
            for (int j = 0; j < m0; j++)
                if (id0[j] == id1[i]) before = k0[j];
            if (c1[i] >= 0 && c1[i] < n && k1[i] > before) ds[c1[i]] += k1[i] - before;
        }
        q.busy = fm_threads_count_busy(n, db, dt, ds, ok);
    }
    q.threads = q.allowed - q.busy;
    /* ranks of one launch on this node that share the whole machine (no binding): each takes its
     * share, or they oversubscribe the cores together (measured: 4 ranks on 2 cores with 2 threads
     * each trained 55x slower than with 1: bench/RESULTS.md); a launcher that binds ranks gives each a smaller mask */
    q.local_ranks = env && env->local_ranks > 1 ? env->local_ranks : 1;
    if (q.local_ranks > 1 && online > 0 && q.allowed >= (int)online) q.threads /= q.local_ranks;
    q.blas_pthreads = fm_threads_blas_pthreads();
    if (q.blas_pthreads) q.threads = 1; /* its pool and our OpenMP threads contend (fm_threads.h) */
    if (q.threads < 1) q.threads = 1;
    if (p) *p = q;
    return q.threads;
}
