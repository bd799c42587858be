/* The backends' workspaces for the planner (fm_backend_plan.h). */
#include "fm_backend_plan.h"
#include <stdint.h>

#ifndef FM_ACT_BF16
#include "cpu/fm_backend_cpu.h" /* the CPU build: its backend's tile arithmetic */
#endif

size_t fm_cuda_backend_workspace_bytes_for(size_t cudnn_workspace_bytes) {
    return FM_CUDA_LT_WORKSPACE_BYTES + (cudnn_workspace_bytes ? cudnn_workspace_bytes : FM_CUDA_DEFAULT_WORKSPACE_BYTES) +
           FM_CUDA_SCRATCH_BYTES;
}

size_t fm_cuda_attention_chunk_need(bool bwd, int64_t b, int64_t h, int64_t T, int64_t hd, int64_t grp) {
    if (!bwd) return (size_t)64 << 10;
    const size_t acc = (size_t)(b * h * T * hd) * 4, rows = (size_t)(b * h * T) * 4;
    size_t e = ((acc + 255) & ~(size_t)255) + ((rows + 255) & ~(size_t)255);
    if (grp > 1) e += acc;
    return e + ((size_t)1 << 20);
}

bool fm_cuda_attention_pick_chunks(size_t cap, bool bwd, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                                   int64_t *Bc, int64_t *nkvc) {
    const int64_t grp = nh / nkv;
    for (int64_t b = B; b >= 1; b--)
        if (B % b == 0 && fm_cuda_attention_chunk_need(bwd, b, nh, T, hd, grp) <= cap) {
            *Bc = b, *nkvc = nkv;
            return true;
        }
    for (int64_t k = nkv - 1; k >= 1; k--)
        if (nkv % k == 0 && fm_cuda_attention_chunk_need(bwd, 1, k * grp, T, hd, grp) <= cap) {
            *Bc = 1, *nkvc = k;
            return true;
        }
    return false;
}

size_t fm_cuda_cudnn_workspace_auto(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
    if (nkv < 1 || nh % nkv != 0) nkv = nh; /* a config the parser refuses; plan as without GQA */
    const int64_t grp = nh / nkv;
    int64_t Bc = 1, kc = 1;
    size_t need = fm_cuda_attention_pick_chunks(FM_CUDA_CUDNN_WORKSPACE_CAP, true, B, T, nh, nkv, hd, &Bc, &kc)
                      ? fm_cuda_attention_chunk_need(true, Bc, kc * grp, T, hd, grp)
                      : fm_cuda_attention_chunk_need(true, 1, grp, T, hd, grp);
    if (need < FM_CUDA_DEFAULT_WORKSPACE_BYTES) need = FM_CUDA_DEFAULT_WORKSPACE_BYTES;
    const size_t mib = (size_t)1 << 20;
    return (need + mib - 1) / mib * mib;
}

void fm_backend_plan_workspaces(fm_backend_kind kind, const fm_backend_plan_req *r, fm_backend_plan_info *out) {
    FM_ASSERT(r && out);
    memset(out, 0, sizeof *out);
    if (kind == FM_BACKEND_KIND_CUDA) {
        out->known = true;
        out->cudnn_workspace = r->gpu_workspace ? r->gpu_workspace
                                                : fm_cuda_cudnn_workspace_auto(r->B, r->T, r->nh, r->nkv, r->hd);
        out->lt_workspace = FM_CUDA_LT_WORKSPACE_BYTES;
        out->scratch = FM_CUDA_SCRATCH_BYTES;
        out->total = fm_cuda_backend_workspace_bytes_for(out->cudnn_workspace);
        out->memory_reserve = FM_CUDA_MEMORY_RESERVE;
        return;
    }
#ifndef FM_ACT_BF16
    out->known = true;
    out->attention_tiles = fm_cpu_backend_scratch_bytes_tiles(r->threads, r->hd, r->tile_q > 0 ? r->tile_q : 64,
                                                              r->tile_kv > 0 ? r->tile_kv : 64);
    out->total = out->attention_tiles;
#endif
}

bool fm_cuda_sm90_expert_gemm_serves(int64_t E, int64_t H, int64_t I, int64_t rows_max) {
    const int64_t wide = H > I ? H : I;
    return E >= 1 && E <= 256 && H >= 128 && I >= 128 && H % 128 == 0 && I % 128 == 0 && rows_max >= 0 &&
           rows_max < INT32_MAX && E * wide < INT32_MAX;
}
