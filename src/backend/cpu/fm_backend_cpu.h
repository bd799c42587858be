/* The CPU backend: fp32, C11 + OpenMP + BLAS (cblas_sgemm). The reference for every other
 * backend. */
#ifndef FM_BACKEND_CPU_H
#define FM_BACKEND_CPU_H
#include "../fm_backend.h"

/* Creates a CPU backend from the options (fm_backend_opts.h; the CUDA fields are ignored; NULL:
 * fm_backend_opts_default()): it runs on o->threads OpenMP threads (0: OpenMP's default), its
 * attention scratch fits head_dim <= o->max_head_dim with a tile of o->tile_q query rows x
 * o->tile_kv key columns (0: 64 each; the per-thread scratch grows with tile_q * (tile_kv +
 * head_dim)), and it times phases when o->profile. Sets the thread count of OpenMP and of the
 * BLAS library. Reads no environment variable. Errors: FM_ERR_ARG (threads < 0, max_head_dim < 1,
 * a tile side outside [1, 4096]), FM_ERR_NOMEM. */
fm_status fm_cpu_backend_init_opts(fm_backend *b, const fm_backend_opts *o);
/* The same with threads and max_head_dim, 64 x 64 tiles and no profiling. */
fm_status fm_cpu_backend_init(fm_backend *b, int threads, int64_t max_head_dim);
/* The same with a tile of tile_q x tile_kv, each in [1, 4096] (0 is FM_ERR_ARG here). */
fm_status fm_cpu_backend_init_tiles(fm_backend *b, int threads, int64_t max_head_dim, int64_t tile_q,
                                    int64_t tile_kv);
void fm_cpu_backend_free(fm_backend *b);

/* Bytes of scratch the CPU backend allocates at init for `threads` threads and max_head_dim
 * (the attention tiles); the planner adds this to the workspace live set. */
size_t fm_cpu_backend_scratch_bytes(int threads, int64_t max_head_dim);
size_t fm_cpu_backend_scratch_bytes_tiles(int threads, int64_t max_head_dim, int64_t tile_q, int64_t tile_kv);

#endif
