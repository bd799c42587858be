/* The CPU backend: fp32, C11 + OpenMP + BLAS (cblas_sgemm). The reference for every other
 * backend. */
#ifndef FM_BACKEND_CPU_H
#define FM_BACKEND_CPU_H
#include "../fm_backend.h"

/* Creates a CPU backend that runs on `threads` OpenMP threads (0: OpenMP's default) and whose
 * attention scratch fits head_dim <= max_head_dim. Sets the thread count of OpenMP and of the
 * BLAS library. Errors: FM_ERR_ARG (threads < 0, max_head_dim < 1), FM_ERR_NOMEM. */
fm_status fm_cpu_backend_init(fm_backend *b, int threads, int64_t max_head_dim);
/* The same with the attention's tile of tile_q query rows x tile_kv key columns (the default is
 * 64 x 64); its per-thread scratch grows with tile_q * (tile_kv + head_dim). FM_ERR_ARG outside
 * [1, 4096]. */
fm_status fm_cpu_backend_init_tiles(fm_backend *b, int threads, int64_t max_head_dim, int64_t tile_q,
                                    int64_t tile_kv);
void fm_cpu_backend_free(fm_backend *b);

/* Bytes of scratch the CPU backend allocates at init for `threads` threads and max_head_dim
 * (the attention tiles); the planner adds this to the workspace live set. */
size_t fm_cpu_backend_scratch_bytes(int threads, int64_t max_head_dim);
size_t fm_cpu_backend_scratch_bytes_tiles(int threads, int64_t max_head_dim, int64_t tile_q, int64_t tile_kv);

#endif
