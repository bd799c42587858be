/* fm_device_info.h: the GPU's name from the NVIDIA driver's /proc files, and a peak table. */
#define _DEFAULT_SOURCE
#include "fm_device_info.h"

#include <dirent.h>
#include <stdio.h>
#include <string.h>

int fm_device_gpu_name(char *name, size_t cap) {
    if (cap) name[0] = 0;
    DIR *d = opendir("/proc/driver/nvidia/gpus");
    if (!d) return -1;
    char best[256] = "";
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        if (!best[0] || strcmp(e->d_name, best) < 0) snprintf(best, sizeof best, "%s", e->d_name);
    }
    closedir(d);
    if (!best[0]) return -1;
    char path[400], line[256];
    snprintf(path, sizeof path, "/proc/driver/nvidia/gpus/%s/information", best);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int found = -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "Model:", 6) != 0) continue;
        char *v = line + 6;
        while (*v == ' ' || *v == '\t') v++;
        size_t n = strcspn(v, "\r\n");
        while (n > 0 && (v[n - 1] == ' ' || v[n - 1] == '\t')) n--;
        if (cap) {
            if (n >= cap) n = cap - 1;
            memcpy(name, v, n);
            name[n] = 0;
        }
        found = 0;
        break;
    }
    fclose(f);
    return found;
}

double fm_device_peak_flops(const char *name) {
    static const struct {
        const char *key;
        double peak;
    } table[] = {{"H200", 989e12}, {"H100", 989e12}, {"A100", 312e12}, {"L40S", 362e12}};
    if (!name) return 0;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strstr(name, table[i].key)) return table[i].peak;
    return 0;
}
