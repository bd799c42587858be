/* The device a run trains on, for its records: the GPU's name and its peak dense bf16 FLOP/s
 * (the denominator of MFU, as DESIGN.md §9 and bench/RESULTS.md use it). */
#ifndef FM_DEVICE_INFO_H
#define FM_DEVICE_INFO_H

#include <stddef.h>

/* The first NVIDIA GPU's model name ("NVIDIA H200"), from the driver's
 * /proc/driver/nvidia/gpus/<bus id>/information ("Model:" line; the lowest bus id, which is CUDA
 * device 0 under CUDA_DEVICE_ORDER=PCI_BUS_ID), into name[cap]. Returns 0 when found, -1
 * otherwise (no NVIDIA driver: name is ""). */
int fm_device_gpu_name(char *name, size_t cap);

/* Peak dense bf16 tensor FLOP/s of a GPU by its name: H100 and H200 (SXM) 989e12, A100 312e12,
 * L40S 362e12 (NVIDIA's data sheets, without sparsity); 0 for a name not in the table. */
double fm_device_peak_flops(const char *name);

#endif
