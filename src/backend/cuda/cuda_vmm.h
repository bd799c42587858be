/* The CUDA backend's device memory through the driver's virtual memory management (cuda_vmm.cu);
 * plain C, no CUDA headers. `ctx` is the CUDA backend's context (fm_backend.ctx of
 * fm_cuda_backend_init).
 *
 * mem_alloc (fm_backend.h) reserves an address range (cuMemAddressReserve) of the bytes asked
 * rounded up to the device's minimum allocation granularity (cuMemGetAllocationGranularity: 2 MiB
 * on an H100/H200), backs it with physical chunks (cuMemCreate) of FM_CUDA_VMM_CHUNK_BYTES rounded
 * up to the recommended granularity, the last chunk shorter (a multiple of the minimum), maps them
 * (cuMemMap), makes them readable and writable by the device (cuMemSetAccess) and zero-fills the
 * range. A host-side table keeps each block's range and its chunks' handles, so that:
 *   mem_release(p, bytes) unmaps and releases (cuMemUnmap, cuMemRelease) the chunks that lie wholly
 *     inside [p, p + bytes) -- a range reaching the end of the bytes asked takes the rounding tail
 *     with it -- after waiting for the device, and returns the bytes given back; the addresses stay
 *     reserved, unmapped: the device must not touch them until mem_restore (a kernel or copy that
 *     does fails with an illegal address, which ends the context);
 *   mem_restore(p, bytes) backs the released chunks that meet [p, p + bytes) again (new physical
 *     memory at the same addresses) and zero-fills them and the range, waiting for the fill; false,
 *     nothing recorded, when the device has no memory for a chunk (those backed so far stay);
 *   mem_free unmaps, releases and frees the range after waiting for the device.
 * The rounding is device overhead outside the plan's live sets: at most one granularity (2 MiB)
 * per block, as cudaMalloc's own rounding of large allocations to 2 MiB pages before (docs/rl.md
 * "Sleep and wake on the GPU", docs/plan.md "Budgets").
 * Where the device has no virtual memory management
 * (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED == 0) mem_alloc is cudaMalloc, as it was,
 * and mem_release gives nothing back (returns 0). The idea: vLLM's sleep mode (CuMemAllocator) and
 * torch_memory_saver; the calls: CUDA C Programming Guide, "Virtual Memory Management". */
#ifndef FM_CUDA_VMM_H
#define FM_CUDA_VMM_H
#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A block's physical chunk (before rounding up to the recommended granularity): the smallest
 * range mem_release gives back inside a large block, and few enough cuMemCreate calls at launch
 * (80 GB: 2,560 chunks). */
#define FM_CUDA_VMM_CHUNK_BYTES ((size_t)32 << 20)

/* Whether mem_alloc's new blocks come from the VMM path (the device supports it and the test hook
 * below has not turned it off); *granularity gets the rounding of a block's bytes and *chunk its
 * full chunks' bytes (both 0 without VMM; either pointer may be NULL). */
bool fm_cuda_vmm_info(void *ctx, size_t *granularity, size_t *chunk);
/* Test hook: mem_alloc's blocks from now on through VMM (on, where the device supports it) or
 * cudaMalloc (off: the fallback path, as on a device without VMM). Blocks already allocated keep
 * their kind. Returns whether the device supports VMM. */
bool fm_cuda_vmm_set_enabled(void *ctx, bool on);

#ifdef __cplusplus
}
#endif
#endif
