/* What the planner needs to know of the machine it runs on: the device's name, and on a GPU the
 * memory a run can plan for, MEASURED (docs/plan.md "Budgets"): the device's free memory with the
 * CUDA context up, less what the libraries take once their handles exist and their kernels are
 * loaded (a probe backend is created, runs each op family once at a small shape, and is freed).
 * The backend's own workspaces are not part of that growth: the plan counts them (attention
 * tiles). */
#ifndef FM_PLAN_DEVICE_H
#define FM_PLAN_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "../core/fm_core.h"

/* Kernels the probe does not load (other shapes' cuBLAS/cuDNN kernels, loaded lazily later):
 * kept free on top of the measured growth. It also covers the device arenas' rounding up to the
 * allocation granularity (backend/cuda/cuda_vmm.h: under 2 MiB for each of the FM_LIVE_COUNT
 * arenas and the communicator's small buffer, 16 MiB at most), which cudaMemGetInfo sees and the
 * plan's live sets do not count, as cudaMalloc's 2 MiB pages before. */
#define FM_PLAN_LATE_LOAD_MARGIN ((size_t)256 << 20)

typedef struct fm_device_budget {
    char name[128];        /* the device's name ("" on the CPU build) */
    size_t total;          /* device bytes (cudaMemGetInfo) */
    size_t free_start;     /* free with the CUDA context created, before the libraries */
    size_t free_libs;      /* free with a probe backend's handles and kernels loaded (its
                              workspaces and buffers not counted) */
    size_t library_bytes;  /* free_start - free_libs: what cuBLAS, cuDNN and the loaded kernels took */
    size_t context_bytes;  /* total - free_libs: everything a run cannot plan for on an idle GPU
                              (context, libraries, kernels, other processes) */
    size_t budget;         /* free_libs less FM_PLAN_LATE_LOAD_MARGIN: the default --mem-budget */
} fm_device_budget;

/* Measures this build's device (head_dim: the model's, for the attention probe). The CPU build:
 * all zero (no budget: host memory is not planned) and FM_OK. Errors: those of the CUDA backend's
 * creation and of cudaMemGetInfo (no usable GPU), with their messages. Takes about a second on a
 * GPU. */
fm_status fm_device_budget_measure(int64_t head_dim, fm_device_budget *out);

/* The device's name: cudaGetDeviceProperties on the CUDA build, /proc/cpuinfo's "model name" on
 * the CPU build ("CPU" when unknown). */
void fm_device_name(char *buf, size_t n);

#endif
