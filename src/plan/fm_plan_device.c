#include "fm_plan_device.h"

#include <stdio.h>
#include <string.h>

#include "../backend/fm_backend_default.h"

#ifdef FM_ACT_BF16
#include <cuda_runtime_api.h>

void fm_device_name(char *buf, size_t n) {
    struct cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) == cudaSuccess) snprintf(buf, n, "%.127s", p.name);
    else snprintf(buf, n, "CUDA device (unknown)");
}
#else
void fm_device_name(char *buf, size_t n) {
    snprintf(buf, n, "CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "model name", 10)) {
            const char *c = strchr(line, ':');
            if (c) {
                c++;
                while (*c == ' ' || *c == '\t') c++;
                snprintf(buf, n, "%s", c);
                char *nl = strchr(buf, '\n');
                if (nl) *nl = 0;
            }
            break;
        }
    }
    fclose(f);
}
#endif

/* One op of each family the step uses, at a small shape, so their kernels are loaded. */
static void warm_ops(const fm_backend *be, int64_t hd, void **bufs, int nbuf) {
    const fm_ops *o = be->ops;
    void *ctx = be->ctx;
    const int64_t T = 256, nh = 2, H = nh * hd, E = 4, k = 2;
    fm_act *q = bufs[0], *kk = bufs[1], *v = bufs[2], *out = bufs[3], *dq = bufs[4], *dk = bufs[5], *dv = bufs[6];
    float *lse = bufs[7];
    (void)nbuf;
    o->gemm(ctx, false, true, T, H, H, 1.0f, q, H, kk, H, 0.0f, out, FM_ACT_DTYPE, H);
    o->gemm(ctx, false, false, T, H, H, 1.0f, q, H, kk, H, 0.0f, out, FM_ACT_DTYPE, H);
    o->gemm(ctx, true, false, H, H, T, 1.0f, q, H, kk, H, 1.0f, out, FM_ACT_DTYPE, H);
    o->gemm(ctx, false, true, T, E, H, 1.0f, q, H, kk, H, 0.0f, lse, FM_DTYPE_F32, E);
    o->attention_fwd(ctx, out, lse, q, kk, v, 1, T, nh, nh, hd, NULL);
    o->attention_bwd(ctx, dq, dk, dv, out, q, kk, v, out, lse, 1, T, nh, nh, hd, NULL);
    int64_t *offs = bufs[8];
    for (int64_t e = 0; e <= E; e++) offs[e] = e * (T / E);
    fm_expert_linear_fwd(be, out, q, kk, offs, E, hd, hd);
    fm_expert_linear_bwd(be, dq, 0.0f, dk, out, q, kk, offs, E, hd, hd);
    o->add(ctx, out, q, T * H);
    o->swiglu_fwd(ctx, out, q, kk, T * H);
    o->rmsnorm_fwd(ctx, out, lse, q, kk, T, H, 1e-6f);
    float *fbuf = bufs[9];
    const int64_t n = (T > H ? T : H) * H;
    o->adamw(ctx, out, q, sizeof(fm_act) == 4 ? NULL : fbuf, fbuf + n, fbuf + 2 * n, FM_DTYPE_F32, T * H,
             1e-4f, 0.9f, 0.95f, 1e-8f, 0.0f, 0.1f, 0.05f, 1.0f);
    (void)k;
    o->sync(ctx);
}

fm_status fm_device_budget_measure(int64_t head_dim, fm_device_budget *d) {
    memset(d, 0, sizeof *d);
    size_t f0 = 0, total = 0;
    FM_TRY(fm_backend_default_device_memory(&f0, &total)); /* creates the CUDA context */
    if (total == 0) return FM_OK;                             /* the CPU build */
    fm_device_name(d->name, sizeof d->name);
    d->total = total;
    d->free_start = f0;
    const int64_t hd = head_dim > 0 ? head_dim : 128;
    fm_backend_opts bo = fm_backend_opts_default();
    bo.max_head_dim = hd;
    fm_backend be;
    FM_TRY(fm_backend_default_init_opts(&be, &bo));
    const size_t ws = fm_backend_default_scratch_bytes_tiles(0, hd, 0, 0, 0); /* the probe's own workspaces */
    const int64_t T = 256, H = 2 * hd, n = (T > H ? T : H) * H; /* elements: [T,H] and [H,H] fit */
    void *bufs[10] = {0};
    const size_t a = (size_t)n * sizeof(fm_act);
    const size_t sz[10] = {a, a, a, a, a, a, a, (size_t)T * 8 * 4, 0, (size_t)3 * n * 4};
    bool ok = true;
    for (int i = 0; i < 10; i++) {
        if (i == 8) bufs[i] = be.ops->buffer_alloc(be.ctx, FM_BUFFER_PINNED, 64 * sizeof(int64_t));
        else bufs[i] = be.ops->mem_alloc(be.ctx, sz[i]);
        ok = ok && bufs[i];
    }
    if (ok) warm_ops(&be, hd, bufs, 10);
    fm_status st = be.ops->status(be.ctx);
    for (int i = 0; i < 10; i++)
        if (bufs[i]) {
            if (i == 8) be.ops->buffer_free(be.ctx, FM_BUFFER_PINNED, bufs[i]);
            else be.ops->mem_free(be.ctx, bufs[i]);
        }
    size_t f1 = 0, t1 = 0;
    if (st == FM_OK) st = fm_backend_default_device_memory(&f1, &t1);
    fm_backend_default_free(&be);
    if (!ok) return fm_error(FM_ERR_NOMEM, "measuring the device's memory: the probe's small buffers could not be allocated");
    if (st) return st;
    /* the probe's workspaces are planned (attention tiles): add them back */
    d->free_libs = f1 + ws < f0 ? f1 + ws : f0;
    d->library_bytes = f0 - d->free_libs;
    d->context_bytes = total - d->free_libs;
    d->budget = d->free_libs > FM_PLAN_LATE_LOAD_MARGIN ? d->free_libs - FM_PLAN_LATE_LOAD_MARGIN : 0;
    return FM_OK;
}
