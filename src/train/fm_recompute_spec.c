/* The --recompute spec: which layers' activations are recomputed in backward. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "fm_trainer.h"

fm_status fm_parse_recompute(const char *spec, int64_t L, bool *rc) {
    for (int64_t l = 0; l < L; l++) rc[l] = false;
    if (!spec || !strcmp(spec, "none") || !*spec) return FM_OK;
    if (!strcmp(spec, "full")) {
        for (int64_t l = 0; l < L; l++) rc[l] = true;
        return FM_OK;
    }
    const char *p = spec;
    while (*p) {
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || (*end && *end != ','))
            return fm_error(FM_ERR_ARG, "--recompute \"%s\": expected none, full, or comma-separated layer ids "
                            "(e.g. 0,2,5)", spec);
        if (v < 0 || v >= L)
            return fm_error(FM_ERR_ARG, "--recompute: layer id %lld is out of range; the model has layers 0..%lld",
                            v, (long long)L - 1);
        if (rc[v]) return fm_error(FM_ERR_ARG, "--recompute: layer %lld is listed twice", v);
        rc[v] = true;
        if (*end == ',' && !end[1]) return fm_error(FM_ERR_ARG, "--recompute \"%s\": trailing comma", spec);
        p = *end ? end + 1 : end;
    }
    return FM_OK;
}
