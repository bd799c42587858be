/* `flatmoe calibrate`: measures the rates of a calibration table (fm_calib.h) on this build's
 * backend, through the op table only (backend/fm_backend.h), so the same code runs on the CPU
 * build and on flatmoe-cuda: dense GEMMs at model shapes, grouped expert GEMMs forward and
 * backward by rows per expert, causal attention forward and backward by T on one sequence (16
 * heads of 128 as OLMoE; the CPU only short T), the MoE gather and combine, an elementwise op,
 * the AdamW step, and the host link (copy_async device <-> pinned, each direction alone and both
 * at once). Each figure: one warm-up, then the median (GPU) or minimum (CPU) of a few repeats, each ended by a sync and
 * timed with the wall clock. On a GPU it also measures the CUDA context and libraries' memory
 * (fm_plan_device.h). Buffers are allocated per measurement at launch-time ops and freed.
 */
#ifndef FM_CALIBRATE_H
#define FM_CALIBRATE_H

#include "../backend/fm_backend_opts.h"
#include "fm_calib.h"

typedef struct fm_calibrate_opts {
    bool quick;    /* fewer and smaller shapes (the CPU in well under a minute) */
    int threads;   /* CPU threads (0: all) */
    /* progress, one line per figure (may be NULL): library code does not print */
    void (*log)(void *user, const char *line);
    void *user;
    /* the backend's options over which threads, head_dim, profiling and the cuDNN workspace are
     * set here (the CLI's FLATMOE_* variables: FLATMOE_EXPERT_GEMM=sm90 measures the sm90 expert
     * curves too); NULL: the defaults */
    const fm_backend_opts *backend;
} fm_calibrate_opts;

/* Measures a table into *out (backend, device, kind, rates, context and host figures). Errors:
 * the backend's creation (no GPU, ...), FM_ERR_NOMEM when a buffer cannot be allocated (the
 * message names it and its size), a backend error raised by an op (its status), each naming
 * what was being measured. */
fm_status fm_calibrate_run(const fm_calibrate_opts *o, fm_calib *out);

#endif
