/* The host's memory as the default --host-mem-budget sees it (fm_host_mem.h). */
#include "fm_host_mem.h"

#include <ctype.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

double fm_host_mem_reserve(double total) {
    const double r = total / 10.0, floor = 4.0 * 1073741824.0;
    return r > floor ? r : floor;
}

/* RssAnon (bytes) and Name of /proc/<pid>/status; -1 when it cannot be read (a process gone). */
static double proc_rss_anon(const char *pid, char name[32]) {
    char path[300], line[256];
    snprintf(path, sizeof path, "/proc/%s/status", pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    double kb = 0;
    name[0] = 0;
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "Name:", 5)) {
            sscanf(line + 5, " %31s", name);
        } else if (!strncmp(line, "RssAnon:", 8)) {
            sscanf(line + 8, " %lf", &kb);
            break;
        }
    }
    fclose(f);
    return kb * 1024.0;
}

int fm_host_mem_read(fm_host_mem *m) {
    memset(m, 0, sizeof *m);
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    double v, total = -1, avail = -1, shmem = 0;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemTotal: %lf kB", &v) == 1) total = v * 1024.0;
        if (sscanf(line, "MemAvailable: %lf kB", &v) == 1) avail = v * 1024.0;
        if (sscanf(line, "Shmem: %lf kB", &v) == 1) shmem = v * 1024.0;
    }
    fclose(f);
    if (total < 0 || avail < 0) return -1;
    m->total = total, m->available = avail, m->shmem = shmem, m->held = shmem;
    DIR *d = opendir("/proc");
    if (!d) return 0;
    char self[32];
    snprintf(self, sizeof self, "%ld", (long)getpid());
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!isdigit((unsigned char)e->d_name[0]) || !strcmp(e->d_name, self)) continue;
        char name[32];
        const double b = proc_rss_anon(e->d_name, name);
        if (b <= 0) continue;
        m->held += b;
        int k = m->n_top < 3 ? m->n_top++ : 3; /* insert into the top three, largest first */
        while (k > 0 && m->top_bytes[k - 1] < b) {
            if (k < 3) m->top_pid[k] = m->top_pid[k - 1], m->top_bytes[k] = m->top_bytes[k - 1],
                       memcpy(m->top_name[k], m->top_name[k - 1], 32);
            k--;
        }
        if (k < 3) {
            m->top_pid[k] = (pid_t)strtol(e->d_name, NULL, 10);
            m->top_bytes[k] = b;
            memcpy(m->top_name[k], name, 32);
        }
    }
    closedir(d);
    return 0;
}

void fm_host_mem_describe(char *buf, size_t n) {
    fm_host_mem m;
    if (fm_host_mem_read(&m) != 0) {
        snprintf(buf, n, "host memory: /proc/meminfo cannot be read");
        return;
    }
    const double G = 1073741824.0;
    int len = snprintf(buf, n, "host memory: %.1f GiB in all, %.1f GiB held by other processes and shared memory",
                       m.total / G, m.held / G);
    for (int i = 0; i < m.n_top && len > 0 && (size_t)len < n; i++)
        len += snprintf(buf + len, n - (size_t)len, "%s PID %ld %s %.1f GiB", i ? "," : " (the largest:",
                        (long)m.top_pid[i], m.top_name[i], m.top_bytes[i] / G);
    if (len > 0 && (size_t)len < n)
        snprintf(buf + len, n - (size_t)len, "%s, %.1f GiB reserved; MemAvailable now %.1f GiB", m.n_top ? ")" : "",
                 fm_host_mem_reserve(m.total) / G, m.available / G);
}
