/* The host's memory as the default --host-mem-budget sees it (issue 25 item 5; plan/fm_choose.h's
 * fm_host_mem_budget_default): what the machine has, what other processes hold, and who holds it.
 *
 * Why not MemAvailable: right after another process frees pinned memory (a run that pinned 79 GB of
 * optimizer state), /proc/meminfo's MemAvailable lags the release for a while (measured on the
 * H100 machine, 2026-12-07: 35 GiB available at the start of the next run, 124 GiB a minute
 * later), so a default that follows it refuses a run that fits. The memory other processes hold
 * is read instead from what they map: each live process's anonymous resident memory (RssAnon of
 * /proc/PID/status, which includes its pinned buffers) plus the shared memory (Shmem, tmpfs), none
 * of which the kernel can reclaim; the page cache is not counted (it gives way). Pages shared
 * between processes are counted once per process: the estimate errs toward less budget. */
#ifndef FM_HOST_MEM_H
#define FM_HOST_MEM_H

#include <stddef.h>
#include <sys/types.h>

typedef struct fm_host_mem {
    double total;     /* MemTotal, bytes */
    double available; /* MemAvailable, bytes (reported, not used by the default) */
    double shmem;     /* Shmem, bytes */
    double held;      /* RssAnon summed over the other live processes, plus shmem, bytes */
    int n_top;        /* the largest holders (RssAnon), largest first */
    pid_t top_pid[3];
    char top_name[3][32];
    double top_bytes[3];
} fm_host_mem;

/* Reads /proc/meminfo and every /proc/PID/status (this process excluded: its own buffers are
 * planned). Returns 0, or -1 when /proc/meminfo cannot be read (*m zeroed). */
int fm_host_mem_read(fm_host_mem *m);

/* The default reserve for the operating system and what the estimate misses:
 * max(4 GiB, MemTotal / 10), bytes. */
double fm_host_mem_reserve(double total);

/* One sentence on who holds the host's memory, for a refusal: "host memory: 125.8 GiB in all, 40.1
 * GiB held by other processes (the largest: PID 1234 python3 36.0 GiB, ...), 12.0 GiB reserved;
 * MemAvailable now 70.2 GiB". Never fails (says so when /proc cannot be read). */
void fm_host_mem_describe(char *buf, size_t n);

#endif
