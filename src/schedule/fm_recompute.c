/* The recompute policy (fm_recompute.h). */
#include "fm_recompute.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

fm_status fm_recompute_parse(const char *spec, int64_t L, bool *rc) {
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

int64_t fm_recompute_count(const fm_recompute_policy *p) {
    int64_t r = 0;
    for (int64_t l = 0; l < p->L; l++) r += fm_recompute_layer(p, l);
    return r;
}

int64_t fm_recompute_saved_sets(const fm_recompute_policy *p) {
    const int64_t r = fm_recompute_count(p);
    return p->L - r + (r > 0 ? 1 : 0);
}

int64_t fm_recompute_keep_attention_count(const fm_recompute_policy *p) {
    int64_t r = 0;
    for (int64_t l = 0; l < p->L; l++) r += fm_recompute_keeps_attention(p, l);
    return r;
}

fm_status fm_recompute_keep_attention_fill(bool on, bool spec_given, const bool *rc, int64_t L, bool *keep) {
    bool any = false;
    for (int64_t l = 0; l < L; l++) {
        keep[l] = on;
        any |= rc && rc[l];
    }
    if (on && spec_given && !any)
        return fm_error(FM_ERR_ARG, "--recompute-keep-attention keeps the attention output of recomputed layers, but "
                        "--recompute recomputes none; name the layers (--recompute full or layer ids) or drop the flag");
    return FM_OK;
}
