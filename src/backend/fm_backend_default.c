#include "fm_backend_default.h"
#include "fm_backend_plan.h" /* FM_CUDA_MEMORY_RESERVE */

#ifdef FM_ACT_BF16
#include "cuda/fm_backend_cuda.h"

static int default_device = 0; /* fm_backend_default_select_device */

fm_status fm_backend_default_select_device(int local_rank, int *device) {
    int count = 0;
    FM_TRY(fm_cuda_device_count(&count));
    if (count < 1) return fm_error(FM_ERR_UNSUPPORTED, "cuda backend: no CUDA device found (use the CPU build)");
    if (local_rank < 0) return fm_error(FM_ERR_ARG, "node-local rank %d must be >= 0", local_rank);
    default_device = local_rank % count;
    if (device) *device = default_device;
    return FM_OK;
}
fm_status fm_backend_default_init_opts(fm_backend *b, const fm_backend_opts *o) {
    return fm_cuda_backend_init(b, default_device, o);
}
size_t fm_backend_default_scratch_bytes_tiles(int threads, int64_t max_head_dim, int64_t tq, int64_t tkv,
                                              size_t gpu_workspace) {
    (void)threads;
    (void)tq;
    (void)tkv;
    return fm_cuda_backend_workspace_bytes(max_head_dim, gpu_workspace);
}
void fm_backend_default_free(fm_backend *b) { fm_cuda_backend_free(b); }
int fm_backend_default_expert_sm90_ok(void) { return fm_cuda_expert_sm90_device_ok(default_device); }
fm_status fm_backend_default_device_memory(size_t *free_bytes, size_t *total) {
    return fm_cuda_device_memory(default_device, free_bytes, total);
}

#else
#include "cpu/fm_backend_cpu.h"

fm_status fm_backend_default_select_device(int local_rank, int *device) {
    (void)local_rank;
    if (device) *device = -1;
    return FM_OK;
}
fm_status fm_backend_default_init_opts(fm_backend *b, const fm_backend_opts *o) { return fm_cpu_backend_init_opts(b, o); }
void fm_backend_default_free(fm_backend *b) { fm_cpu_backend_free(b); }
int fm_backend_default_expert_sm90_ok(void) { return 0; }
fm_status fm_backend_default_device_memory(size_t *free_bytes, size_t *total) {
    *free_bytes = *total = 0;
    return FM_OK;
}
size_t fm_backend_default_scratch_bytes_tiles(int threads, int64_t max_head_dim, int64_t tq, int64_t tkv,
                                              size_t gpu_workspace) {
    (void)gpu_workspace;
    return fm_cpu_backend_scratch_bytes_tiles(threads, max_head_dim, tq > 0 ? tq : 64, tkv > 0 ? tkv : 64);
}
#endif

/* Both builds: the defaults, then the arguments (no environment: the CLI maps the FLATMOE_*
 * variables itself and calls fm_backend_default_init_opts). */
fm_status fm_backend_default_init_tiles(fm_backend *b, int threads, int64_t max_head_dim, int64_t tq, int64_t tkv,
                                        size_t gpu_workspace) {
    fm_backend_opts o = fm_backend_opts_default();
    o.threads = threads;
    o.max_head_dim = max_head_dim;
    o.tile_q = tq > 0 ? tq : 0; /* <= 0: the default tile, as always */
    o.tile_kv = tkv > 0 ? tkv : 0;
    o.gpu_workspace = gpu_workspace;
    return fm_backend_default_init_opts(b, &o);
}
fm_status fm_backend_default_init(fm_backend *b, int threads, int64_t max_head_dim) {
    return fm_backend_default_init_tiles(b, threads, max_head_dim, 0, 0, 0);
}

/* Both builds: the device's free memory less the CUDA reserve (0 on the CPU, which reports none). */
fm_status fm_backend_default_memory_budget(size_t *budget, size_t *total) {
    size_t f = 0;
    *budget = 0;
    FM_TRY(fm_backend_default_device_memory(&f, total));
    *budget = f > FM_CUDA_MEMORY_RESERVE ? f - FM_CUDA_MEMORY_RESERVE : 0;
    return FM_OK;
}
