/* mem_alloc's device memory through the CUDA driver's virtual memory management, and the sleep pair
 * mem_release / mem_restore (fm_backend.h; cuda_vmm.h has the contract and the sizes). The host
 * table: one vmm_block per live block (its reserved range and one handle per physical chunk, 0
 * while the chunk is released), in a list owned by the context (c->vmm). Launch and sleep time
 * only: nothing here runs inside a step.
 * The driver's functions are found at init through the runtime (cudaGetDriverEntryPointByVersion,
 * the driver cudart itself loaded), not linked: a binary that links libcuda.so.1 does not start
 * where no driver is installed, and flatmoe-cuda must still say "no CUDA driver or device; use
 * the CPU build" there, as cudart's lazy loading of the driver lets it. */
#include "cuda_internal.h"
#include "cuda_vmm.h"

#include <cuda.h>

#include <cstdio>
#include <cstring>

namespace {

struct vmm_block {
    CUdeviceptr base;
    size_t bytes;                    /* asked by mem_alloc */
    size_t size;                     /* reserved and backed: bytes rounded up to the minimum granularity */
    int64_t n;                       /* chunks: n - 1 of vmm_state.chunk bytes, the last the rest */
    CUmemGenericAllocationHandle *h; /* [n]; 0: released (unmapped) */
    vmm_block *next;
};

/* The driver calls used here (cuda.h's prototypes), resolved at init. */
struct driver {
    decltype(&::cuGetErrorString) GetErrorString;
    decltype(&::cuDeviceGet) DeviceGet;
    decltype(&::cuDeviceGetAttribute) DeviceGetAttribute;
    decltype(&::cuMemGetAllocationGranularity) MemGetAllocationGranularity;
    decltype(&::cuMemAddressReserve) MemAddressReserve;
    decltype(&::cuMemAddressFree) MemAddressFree;
    decltype(&::cuMemCreate) MemCreate;
    decltype(&::cuMemRelease) MemRelease;
    decltype(&::cuMemMap) MemMap;
    decltype(&::cuMemUnmap) MemUnmap;
    decltype(&::cuMemSetAccess) MemSetAccess;
};

/* *fn = the driver's `name` at this toolkit's version; false when the driver has none. */
template <class F> bool entry(const char *name, F *fn) {
    void *p = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, CUDART_VERSION, cudaEnableDefault, &q);
#else
    const cudaError_t e = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess) (void)cudaGetLastError();
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !p) return false;
    *fn = reinterpret_cast<F>(p);
    return true;
}

bool resolve(driver *d) {
    return entry("cuGetErrorString", &d->GetErrorString) && entry("cuDeviceGet", &d->DeviceGet) &&
           entry("cuDeviceGetAttribute", &d->DeviceGetAttribute) &&
           entry("cuMemGetAllocationGranularity", &d->MemGetAllocationGranularity) &&
           entry("cuMemAddressReserve", &d->MemAddressReserve) && entry("cuMemAddressFree", &d->MemAddressFree) &&
           entry("cuMemCreate", &d->MemCreate) && entry("cuMemRelease", &d->MemRelease) &&
           entry("cuMemMap", &d->MemMap) && entry("cuMemUnmap", &d->MemUnmap) &&
           entry("cuMemSetAccess", &d->MemSetAccess);
}

struct vmm_state {
    driver cu;                /* the driver's calls */
    bool on;                  /* new blocks through VMM (fm_cuda_vmm_set_enabled) */
    size_t gran;              /* the minimum granularity: a block's size is a multiple of it */
    size_t chunk;             /* a full chunk: FM_CUDA_VMM_CHUNK_BYTES rounded up to the recommended granularity */
    CUmemAllocationProp prop; /* pinned device memory on c->device */
    CUmemAccessDesc access;   /* read and write by c->device */
    vmm_block *blocks;
};

vmm_state *state_of(fm_cuda_ctx *c) { return static_cast<vmm_state *>(c->vmm); }

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

/* Records a failed driver call `call` as the context's error (FM_ERR_NOMEM for out of memory) with
 * `what` added to the driver's message; false unless r is CUDA_SUCCESS. */
bool cu_ok(fm_cuda_ctx *c, CUresult r, const char *call, const char *what, const char *file, int line) {
    if (r == CUDA_SUCCESS) return true;
    const char *msg = NULL;
    if (state_of(c)->cu.GetErrorString(r, &msg) != CUDA_SUCCESS || !msg) msg = "(unknown driver error)";
    char text[320];
    snprintf(text, sizeof text, "%s%s%s", msg, what && what[0] ? "; " : "", what ? what : "");
    fm_cuda_record(c, r == CUDA_ERROR_OUT_OF_MEMORY ? FM_ERR_NOMEM : FM_ERR_UNSUPPORTED, call, text, file, line);
    return false;
}
#define CU_OK(c, r, call, what) cu_ok((c), (r), (call), (what), __FILE__, __LINE__)

size_t chunk_off(const vmm_state *v, int64_t i) { return (size_t)i * v->chunk; }
size_t chunk_len(const vmm_state *v, const vmm_block *b, int64_t i) {
    const size_t off = chunk_off(v, i);
    return b->size - off < v->chunk ? b->size - off : v->chunk;
}

/* Chunk i backed, mapped and made accessible. Returns the driver's result (its handle stays 0
 * unless it is mapped) and in *call the name of the call that failed; nothing is recorded here. */
CUresult map_chunk(const vmm_state *v, vmm_block *b, int64_t i, const char **call) {
    const CUdeviceptr at = b->base + chunk_off(v, i);
    const size_t len = chunk_len(v, b, i);
    CUmemGenericAllocationHandle h = 0;
    *call = "cuMemCreate";
    CUresult r = v->cu.MemCreate(&h, len, &v->prop, 0);
    if (r != CUDA_SUCCESS) return r;
    *call = "cuMemMap";
    if ((r = v->cu.MemMap(at, len, 0, h, 0)) != CUDA_SUCCESS) {
        (void)v->cu.MemRelease(h);
        return r;
    }
    *call = "cuMemSetAccess";
    if ((r = v->cu.MemSetAccess(at, len, &v->access, 1)) != CUDA_SUCCESS) {
        (void)v->cu.MemUnmap(at, len);
        (void)v->cu.MemRelease(h);
        return r;
    }
    b->h[i] = h;
    return CUDA_SUCCESS;
}

/* Chunks [i0, i1) that are mapped unmapped and released; the bytes given back (failures recorded
 * when c is set, the chunk then left as it is). */
size_t unmap_chunks(fm_cuda_ctx *c, const vmm_state *v, vmm_block *b, int64_t i0, int64_t i1) {
    size_t given = 0;
    for (int64_t i = i0; i < i1; i++) {
        if (!b->h[i]) continue;
        const size_t len = chunk_len(v, b, i);
        const CUresult r = v->cu.MemUnmap(b->base + chunk_off(v, i), len);
        if (r != CUDA_SUCCESS) {
            if (c) (void)CU_OK(c, r, "cuMemUnmap", "mem_release or mem_free: unmapping a chunk");
            continue;
        }
        (void)v->cu.MemRelease(b->h[i]); /* the mapping was the last user: the physical memory goes */
        b->h[i] = 0;
        given += len;
    }
    return given;
}

void block_free(vmm_state *v, vmm_block *b) {
    (void)unmap_chunks(NULL, v, b, 0, b->n);
    if (b->base) (void)v->cu.MemAddressFree(b->base, b->size);
    fm_free(b->h);
    fm_free(b);
}

/* The block whose reserved range holds p (NULL: none, e.g. cudaMalloc's memory). */
vmm_block *find(const vmm_state *v, const void *p) {
    const CUdeviceptr a = (CUdeviceptr)(uintptr_t)p;
    for (vmm_block *b = v ? v->blocks : NULL; b; b = b->next)
        if (a >= b->base && a < b->base + b->size) return b;
    return NULL;
}

/* [lo, hi): the byte offsets of [p, p + bytes) inside block b, the rounding tail taken when the
 * range reaches the end of the bytes asked. */
void range_of(const vmm_block *b, const void *p, size_t bytes, size_t *lo, size_t *hi) {
    *lo = (size_t)((CUdeviceptr)(uintptr_t)p - b->base);
    const size_t room = b->size - *lo;
    *hi = *lo + (bytes < room ? bytes : room);
    if (*hi >= b->bytes) *hi = b->size;
}

} // namespace

extern "C" {

fm_status fm_cuda_vmm_init(fm_cuda_ctx *c) {
    c->vmm = NULL;
    vmm_state *v = static_cast<vmm_state *>(fm_malloc(sizeof *v));
    if (!v) return fm_error(FM_ERR_NOMEM, "cuda backend: cannot allocate the VMM allocator's table (%zu bytes)", sizeof *v);
    memset(v, 0, sizeof *v);
    CUdevice dev = 0;
    int supported = 0;
    if (!resolve(&v->cu) || v->cu.DeviceGet(&dev, c->device) != CUDA_SUCCESS ||
        v->cu.DeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) !=
            CUDA_SUCCESS ||
        !supported) {
        fm_free(v);
        return FM_OK; /* cudaMalloc, as before */
    }
    v->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    v->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    v->prop.location.id = c->device;
    v->access.location = v->prop.location;
    v->access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    size_t rec = 0;
    if (v->cu.MemGetAllocationGranularity(&v->gran, &v->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS ||
        v->gran == 0) {
        fm_free(v);
        return FM_OK; /* no granularity to round to: cudaMalloc */
    }
    if (v->cu.MemGetAllocationGranularity(&rec, &v->prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS ||
        rec == 0)
        rec = v->gran;
    v->chunk = round_up(round_up(FM_CUDA_VMM_CHUNK_BYTES, rec), v->gran);
    v->on = true;
    c->vmm = v;
    return FM_OK;
}

void fm_cuda_vmm_destroy(fm_cuda_ctx *c) {
    vmm_state *v = state_of(c);
    if (!v) return;
    (void)cudaDeviceSynchronize(); /* nothing in flight may use a block left */
    while (v->blocks) {
        vmm_block *b = v->blocks;
        v->blocks = b->next;
        block_free(v, b);
    }
    fm_free(v);
    c->vmm = NULL;
}

/* Out of memory (a reservation or a chunk): NULL with nothing recorded, as cudaMalloc's path; any
 * other driver error is recorded. */
void *fm_cuda_vmm_alloc(fm_cuda_ctx *c, size_t bytes) {
    vmm_state *v = state_of(c);
    FM_ASSERT(v && v->on);
    const size_t size = round_up(bytes ? bytes : 1, v->gran);
    const int64_t n = (int64_t)((size + v->chunk - 1) / v->chunk);
    vmm_block *b = static_cast<vmm_block *>(fm_malloc(sizeof *b));
    CUmemGenericAllocationHandle *h =
        static_cast<CUmemGenericAllocationHandle *>(fm_malloc(sizeof *h * (size_t)n)); /* zero-filled */
    if (!b || !h) {
        fm_free(b);
        fm_free(h);
        return NULL;
    }
    memset(b, 0, sizeof *b);
    b->bytes = bytes;
    b->size = size;
    b->n = n;
    b->h = h;
    char what[160];
    snprintf(what, sizeof what, "mem_alloc of %zu bytes (%zu reserved, %lld chunks)", bytes, size, (long long)n);
    const char *call = "cuMemAddressReserve";
    CUresult r = v->cu.MemAddressReserve(&b->base, size, 0, 0, 0);
    for (int64_t i = 0; r == CUDA_SUCCESS && i < n; i++) r = map_chunk(v, b, i, &call);
    if (r != CUDA_SUCCESS) {
        if (r != CUDA_ERROR_OUT_OF_MEMORY) (void)CU_OK(c, r, call, what);
        block_free(v, b);
        return NULL;
    }
    void *p = (void *)(uintptr_t)b->base;
    if (!FM_CUDA_OK(c, cudaMemsetAsync(p, 0, size, c->stream)) || !FM_CUDA_OK(c, cudaStreamSynchronize(c->stream))) {
        block_free(v, b);
        return NULL;
    }
    b->next = v->blocks;
    v->blocks = b;
    return p;
}

bool fm_cuda_vmm_free(fm_cuda_ctx *c, void *p) {
    vmm_state *v = state_of(c);
    const CUdeviceptr a = (CUdeviceptr)(uintptr_t)p;
    for (vmm_block **at = v ? &v->blocks : NULL; at && *at; at = &(*at)->next) {
        if ((*at)->base != a) continue;
        vmm_block *b = *at;
        *at = b->next;
        (void)FM_CUDA_OK(c, cudaDeviceSynchronize()); /* as cudaFree: no work in flight may use it */
        block_free(v, b);
        return true;
    }
    return false;
}

size_t fm_cuda_mem_release(void *ctx, void *p, size_t bytes) {
    fm_cuda_ctx *c = ctx_of(ctx);
    vmm_state *v = state_of(c);
    vmm_block *b = find(v, p);
    if (!b || bytes == 0) return 0; /* cudaMalloc's memory (no VMM): nothing given back */
    size_t lo, hi;
    range_of(b, p, bytes, &lo, &hi);
    const int64_t i0 = (int64_t)((lo + v->chunk - 1) / v->chunk); /* the first chunk starting at or after lo */
    const int64_t i1 = hi == b->size ? b->n : (int64_t)(hi / v->chunk); /* chunks ending at or before hi */
    if (i0 >= i1) return 0;
    /* every stream's work that touches the range (sleep's poison fill among it) done first */
    if (!FM_CUDA_OK(c, cudaDeviceSynchronize())) return 0;
    return unmap_chunks(c, v, b, i0, i1);
}

/* Out of memory for a chunk: false with nothing recorded (the chunks backed so far stay; a later
 * call backs the rest); another driver error: recorded, false. */
bool fm_cuda_mem_restore(void *ctx, void *p, size_t bytes) {
    fm_cuda_ctx *c = ctx_of(ctx);
    vmm_state *v = state_of(c);
    vmm_block *b = find(v, p);
    if (bytes == 0) return true;
    if (b) { /* the released chunks that meet [lo, hi) backed; zeroed: the range and those chunks whole */
        size_t lo, hi;
        range_of(b, p, bytes, &lo, &hi);
        size_t z0 = lo, z1 = hi;
        for (int64_t i = (int64_t)(lo / v->chunk); i < b->n && chunk_off(v, i) < hi; i++) {
            if (b->h[i]) continue;
            const char *call = NULL;
            const CUresult r = map_chunk(v, b, i, &call);
            if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
            if (r != CUDA_SUCCESS) {
                char what[160];
                snprintf(what, sizeof what, "mem_restore: backing %zu bytes at offset %zu of a %zu-byte block again",
                         chunk_len(v, b, i), chunk_off(v, i), b->size);
                return CU_OK(c, r, call, what);
            }
            if (chunk_off(v, i) < z0) z0 = chunk_off(v, i);
            if (chunk_off(v, i) + chunk_len(v, b, i) > z1) z1 = chunk_off(v, i) + chunk_len(v, b, i);
        }
        p = (void *)(uintptr_t)(b->base + z0);
        bytes = z1 - z0;
    }
    return FM_CUDA_OK(c, cudaMemsetAsync(p, 0, bytes, c->stream)) && FM_CUDA_OK(c, cudaStreamSynchronize(c->stream));
}

bool fm_cuda_vmm_info(void *ctx, size_t *granularity, size_t *chunk) {
    const vmm_state *v = state_of(ctx_of(ctx));
    const bool on = v && v->on;
    if (granularity) *granularity = on ? v->gran : 0;
    if (chunk) *chunk = on ? v->chunk : 0;
    return on;
}

bool fm_cuda_vmm_set_enabled(void *ctx, bool on) {
    vmm_state *v = state_of(ctx_of(ctx));
    if (v) v->on = on;
    return v != NULL;
}

} /* extern "C" */
