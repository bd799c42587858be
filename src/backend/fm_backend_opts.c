/* Backend options (fm_backend_opts.h): defaults, the FLATMOE_* variables' values, JSON. */
#include "fm_backend_opts.h"

#include <stdio.h>
#include <stdlib.h>

fm_backend_opts fm_backend_opts_default(void) {
    fm_backend_opts o;
    memset(&o, 0, sizeof o);
    o.threads = 0;
    o.max_head_dim = 128;
    o.tile_q = o.tile_kv = 0;
    o.gpu_workspace = 0;
    o.attention = FM_ATTENTION_AUTO;
    o.attention_verbose = false;
    o.expert_gemm = FM_EXPERT_GEMM_AUTO;
    o.fp8_gemm = FM_FP8_GEMM_V5;
    o.profile = false;
    o.update_blocks = 0;
    o.ep_schedule = 0;
    o.cpu_fp8_codes = false;
    o.vmm = true;
    o.calib_dir = NULL;
    return o;
}

/* A value among names[] (n of them), mapped to vals[]; *set = false when the value is NULL or
 * empty. */
static fm_status val_choice(const char *var, const char *v, const char *const *names, const int *vals, int n,
                            const char *accepted, int *out, bool *set) {
    *set = false;
    if (!v || !v[0]) return FM_OK;
    for (int i = 0; i < n; i++)
        if (strcmp(v, names[i]) == 0) {
            *out = vals[i];
            *set = true;
            return FM_OK;
        }
    return fm_error(FM_ERR_ARG, "%s=%s: expected %s", var, v, accepted);
}

static fm_status val_bool(const char *var, const char *v, bool *out) {
    static const char *const names[] = {"0", "1", "false", "true", "off", "on", "no", "yes"};
    static const int vals[] = {0, 1, 0, 1, 0, 1, 0, 1};
    int x = 0;
    bool set = false;
    FM_TRY(val_choice(var, v, names, vals, 8, "0 or 1 (also false/true, off/on, no/yes)", &x, &set));
    if (set) *out = x != 0;
    return FM_OK;
}

/* Decimal digits alone, their value in [lo, hi] (lo >= 0); a NULL or empty value keeps *out. */
static fm_status val_int(const char *var, const char *v, int lo, int hi, int *out) {
    if (!v || !v[0]) return FM_OK;
    long x = 0;
    bool ok = strlen(v) <= 9;
    for (const char *p = v; ok && *p; p++) {
        ok = *p >= '0' && *p <= '9';
        x = 10 * x + (*p - '0');
    }
    if (!ok || x < lo || x > hi)
        return fm_error(FM_ERR_ARG, "%s=%s: expected an integer in [%d, %d]", var, v, lo, hi);
    *out = (int)x;
    return FM_OK;
}

const char *const fm_backend_opts_vars[] = {"FLATMOE_PROFILE",     "FLATMOE_ATTENTION", "FLATMOE_ATTENTION_VERBOSE",
                                            "FLATMOE_EXPERT_GEMM", "FLATMOE_FP8_GEMM",  "FLATMOE_UPDATE_BLOCKS",
                                            "FLATMOE_EP_SCHEDULE", "FLATMOE_TEST_FP8_CODES", "FLATMOE_CUDA_VMM",
                                            "FLATMOE_CALIB_DIR",
                                            NULL};

fm_status fm_backend_opts_set(fm_backend_opts *o, const char *name, const char *v) {
    FM_ASSERT(o && name);
    int x = 0;
    bool set = false;
    if (!strcmp(name, "FLATMOE_PROFILE")) return val_bool(name, v, &o->profile);
    if (!strcmp(name, "FLATMOE_ATTENTION")) {
        static const char *const names[] = {"auto", "cudnn", "fallback", "flash", "ours"};
        static const int vals[] = {FM_ATTENTION_AUTO, FM_ATTENTION_CUDNN, FM_ATTENTION_FALLBACK, FM_ATTENTION_FALLBACK,
                                   FM_ATTENTION_FALLBACK};
        FM_TRY(val_choice(name, v, names, vals, 5, "auto, cudnn or fallback (flash and ours mean fallback)", &x, &set));
        if (set) o->attention = (fm_attention_path)x;
        return FM_OK;
    }
    if (!strcmp(name, "FLATMOE_ATTENTION_VERBOSE")) return val_bool(name, v, &o->attention_verbose);
    if (!strcmp(name, "FLATMOE_EXPERT_GEMM")) {
        static const char *const names[] = {"auto", "cublas", "loop", "grouped", "sm90"};
        static const int vals[] = {FM_EXPERT_GEMM_AUTO, FM_EXPERT_GEMM_CUBLAS, FM_EXPERT_GEMM_LOOP,
                                   FM_EXPERT_GEMM_GROUPED, FM_EXPERT_GEMM_SM90};
        FM_TRY(val_choice(name, v, names, vals, 5, "auto, cublas, loop, grouped or sm90", &x, &set));
        if (set) o->expert_gemm = (fm_expert_gemm)x;
        return FM_OK;
    }
    if (!strcmp(name, "FLATMOE_FP8_GEMM")) {
        static const char *const names[] = {"v3", "v5", "v5a", "v5b", "v5c"};
        static const int vals[] = {FM_FP8_GEMM_V3, FM_FP8_GEMM_V5, FM_FP8_GEMM_V5A, FM_FP8_GEMM_V5B, FM_FP8_GEMM_V5C};
        FM_TRY(val_choice(name, v, names, vals, 5, "v3, v5, v5a, v5b or v5c", &x, &set));
        if (set) o->fp8_gemm = (fm_fp8_gemm)x;
        return FM_OK;
    }
    if (!strcmp(name, "FLATMOE_UPDATE_BLOCKS")) return val_int(name, v, 0, 1 << 20, &o->update_blocks);
    if (!strcmp(name, "FLATMOE_EP_SCHEDULE")) { /* another value: refused by the operator, on every rank alike */
        if (!v || !*v || !strcmp(v, "auto")) o->ep_schedule = 0;
        else if (!strcmp(v, "serial")) o->ep_schedule = 1;
        else if (!strcmp(v, "pipelined")) o->ep_schedule = 2;
        else o->ep_schedule = -1;
        return FM_OK;
    }
    if (!strcmp(name, "FLATMOE_TEST_FP8_CODES")) {
        static const char *const names[] = {"0", "1"};
        static const int vals[] = {0, 1};
        FM_TRY(val_choice(name, v, names, vals, 2, "1 (the CPU serves the FP8 code path) or 0 (unset: 0)", &x, &set));
        if (set) o->cpu_fp8_codes = x != 0;
        return FM_OK;
    }
    if (!strcmp(name, "FLATMOE_CUDA_VMM")) return val_bool(name, v, &o->vmm);
    if (!strcmp(name, "FLATMOE_CALIB_DIR")) {
        if (v && *v) o->calib_dir = v;
        return FM_OK;
    }
    return fm_error(FM_ERR_ARG, "backend options: unknown variable %s (expected one of fm_backend_opts_vars)", name);
}

const char *fm_attention_path_name(fm_attention_path p) {
    switch (p) {
    case FM_ATTENTION_AUTO: return "auto";
    case FM_ATTENTION_CUDNN: return "cudnn";
    case FM_ATTENTION_FALLBACK: return "fallback";
    }
    return "?";
}

const char *fm_expert_gemm_name(fm_expert_gemm g) {
    switch (g) {
    case FM_EXPERT_GEMM_AUTO: return "auto";
    case FM_EXPERT_GEMM_LOOP: return "loop";
    case FM_EXPERT_GEMM_GROUPED: return "grouped";
    case FM_EXPERT_GEMM_SM90: return "sm90";
    case FM_EXPERT_GEMM_CUBLAS: return "cublas";
    }
    return "?";
}

const char *fm_fp8_gemm_name(fm_fp8_gemm g) {
    switch (g) {
    case FM_FP8_GEMM_V3: return "v3";
    case FM_FP8_GEMM_V5: return "v5";
    case FM_FP8_GEMM_V5A: return "v5a";
    case FM_FP8_GEMM_V5B: return "v5b";
    case FM_FP8_GEMM_V5C: return "v5c";
    }
    return "?";
}

fm_status fm_backend_opts_json(const fm_backend_opts *o, char *buf, size_t cap) {
    FM_ASSERT(o && (buf || cap == 0));
    const int n = snprintf(buf, cap,
                           "{\"threads\":%d,\"max_head_dim\":%lld,\"tile_q\":%lld,\"tile_kv\":%lld,\"gpu_workspace\":%zu,"
                           "\"attention\":\"%s\",\"attention_verbose\":%s,\"expert_gemm\":\"%s\",\"fp8_gemm\":\"%s\",\"profile\":%s,"
                           "\"update_blocks\":%d,\"vmm\":%s}",
                           o->threads, (long long)o->max_head_dim, (long long)o->tile_q, (long long)o->tile_kv,
                           o->gpu_workspace, fm_attention_path_name(o->attention),
                           o->attention_verbose ? "true" : "false", fm_expert_gemm_name(o->expert_gemm),
                           fm_fp8_gemm_name(o->fp8_gemm), o->profile ? "true" : "false", o->update_blocks,
                           o->vmm ? "true" : "false");
    if (n < 0 || (size_t)n >= cap) {
        if (cap) buf[0] = '\0';
        return fm_error(FM_ERR_ARG, "backend options as JSON: %d bytes do not fit the %zu-byte buffer", n + 1, cap);
    }
    return FM_OK;
}
