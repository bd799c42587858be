/* Causal grouped-query attention of the CUDA backend (fm_backend.h's attention_fwd/_bwd): the
 * dispatcher and its state. cuDNN's fused flash attention (cuda_attention_cudnn.cu) where cuDNN
 * serves the shape and the attention option allows it, our own FlashAttention-2 kernels
 * (cuda_attention_fwd.cu, cuda_attention_bwd.cu) everywhere else, the scalar kernels where those
 * cannot serve the shape; see cuda_attention.h for the paths and their switches. Packed documents
 * (kv_start non-NULL, fm_backend.h) always take our own kernels: the cuDNN graphs are built for
 * the causal mask only (cuDNN 9's ragged offsets and padding masks are not wired yet). */
#include "cuda_attention_impl.h"
#include "cuda_attention_state.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

namespace {

att_state *state_of(void *ctx) {
    fm_cuda_ctx *c = (fm_cuda_ctx *)ctx;
    return (att_state *)c->att_state;
}

void check_shape(const fm_cuda_ctx *c, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
    FM_ASSERT(B >= 0 && T >= 0 && nh >= 1 && nkv >= 1 && hd >= 1);
    FM_ASSERT(nh % nkv == 0);
    FM_ASSERT(hd <= c->max_head_dim);
    FM_ASSERT(B * nh <= 65535 && T <= INT_MAX / 2 && nh * hd <= INT_MAX);
}

bool flash_ok(int64_t hd, const void *a, const void *b, const void *cc, const void *d, const void *e = NULL,
              const void *f = NULL, const void *g = NULL, const void *h = NULL) {
    const void *p[8] = {a, b, cc, d, e ? e : a, f ? f : a, g ? g : a, h ? h : a};
    return fm_att_flash_ok(hd, p, 8) != 0;
}

} // namespace

extern "C" {

fm_status fm_cuda_attention_init(fm_cuda_ctx *c, const fm_backend_opts *o) {
    att_state *st = (att_state *)calloc(1, sizeof(att_state));
    if (!st) return fm_error(FM_ERR_NOMEM, "attention state: out of host memory");
    st->last_fwd = st->last_bwd = "";
    st->path = o->attention == FM_ATTENTION_FALLBACK ? FM_CUDA_ATT_FALLBACK
               : o->attention == FM_ATTENTION_CUDNN  ? FM_CUDA_ATT_CUDNN
                                                     : FM_CUDA_ATT_AUTO;
    st->verbose = o->attention_verbose;
    cudaError_t e = fm_att_flash_setup();
    if (e != cudaSuccess) {
        free(st);
        return fm_error(FM_ERR_UNSUPPORTED, "attention kernels: cudaFuncSetAttribute: %s", cudaGetErrorString(e));
    }
    c->att_state = st;
    return FM_OK;
}

void fm_cuda_attention_free(fm_cuda_ctx *c) {
    att_state *st = (att_state *)c->att_state;
    if (!st) return;
#if FM_ATT_CUDNN
    fm_att_cudnn_free(st);
#endif
    free(st);
    c->att_state = NULL;
}

void fm_cuda_attention_fwd(void *ctx, fm_act *out, float *lse, const fm_act *q, const fm_act *k, const fm_act *v,
                           int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start) {
    fm_cuda_ctx *c = (fm_cuda_ctx *)ctx;
    att_state *st = state_of(ctx);
    check_shape(c, B, T, nh, nkv, hd);
    if (B == 0 || T == 0) return;
    bf16 *o = (bf16 *)out;
    const bf16 *qq = (const bf16 *)q, *kk = (const bf16 *)k, *vv = (const bf16 *)v;
#if FM_ATT_CUDNN
    int64_t chunks = 0;
    if (st->path != FM_CUDA_ATT_FALLBACK && !kv_start && /* packed documents: our kernels (below) */
        fm_att_cudnn_run(c, st, false, o, lse, NULL, NULL, NULL, NULL, qq, kk, vv, NULL, B, T, nh, nkv, hd, &chunks)) {
        st->last_fwd = chunks > 1 ? "cudnn-chunked" : "cudnn";
        return;
    }
#endif
    if (flash_ok(hd, o, qq, kk, vv, lse)) {
        fm_att_flash_fwd(c->stream, o, lse, qq, kk, vv, B, T, nh, nkv, hd, kv_start);
        st->last_fwd = "flash";
    } else {
        fm_att_simple_fwd(c->stream, o, lse, qq, kk, vv, B, T, nh, nkv, hd, kv_start);
        st->last_fwd = "simple";
    }
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_attention_bwd(void *ctx, fm_act *dq, fm_act *dk, fm_act *dv, const fm_act *dout, const fm_act *q,
                           const fm_act *k, const fm_act *v, const fm_act *out, const float *lse, int64_t B, int64_t T,
                           int64_t nh, int64_t nkv, int64_t hd, const int32_t *kv_start) {
    fm_cuda_ctx *c = (fm_cuda_ctx *)ctx;
    att_state *st = state_of(ctx);
    check_shape(c, B, T, nh, nkv, hd);
    if (B == 0 || T == 0) return;
    bf16 *gq = (bf16 *)dq, *gk = (bf16 *)dk, *gv = (bf16 *)dv;
    const bf16 *go = (const bf16 *)dout, *qq = (const bf16 *)q, *kk = (const bf16 *)k, *vv = (const bf16 *)v,
               *oo = (const bf16 *)out;
#if FM_ATT_CUDNN
    int64_t chunks = 0;
    if (st->path != FM_CUDA_ATT_FALLBACK && !kv_start &&
        fm_att_cudnn_run(c, st, true, NULL, (float *)lse, gq, gk, gv, go, qq, kk, vv, oo, B, T, nh, nkv, hd, &chunks)) {
        st->last_bwd = chunks > 1 ? "cudnn-chunked" : "cudnn";
        return;
    }
#endif
    if (flash_ok(hd, gq, gk, gv, go, qq, kk, vv, oo) && flash_ok(hd, lse, lse, lse, lse)) {
        fm_att_flash_bwd(c->stream, gq, gk, gv, go, qq, kk, vv, oo, lse, B, T, nh, nkv, hd, kv_start);
        st->last_bwd = "flash";
    } else {
        fm_att_simple_bwd(c->stream, gq, gk, gv, go, qq, kk, vv, oo, lse, B, T, nh, nkv, hd, kv_start);
        st->last_bwd = "simple";
    }
    FM_CUDA_LAUNCH_CHECK(c);
}

void fm_cuda_attention_set_path(void *ctx, fm_cuda_att_path path) { state_of(ctx)->path = path; }
fm_cuda_att_path fm_cuda_attention_get_path(void *ctx) { return state_of(ctx)->path; }
const char *fm_cuda_attention_last(void *ctx, bool backward) {
    att_state *st = state_of(ctx);
    return backward ? st->last_bwd : st->last_fwd;
}
const char *fm_cuda_attention_cudnn_note(void *ctx) { return state_of(ctx)->note; }
size_t fm_cuda_attention_cudnn_workspace(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, bool whole) {
#if FM_ATT_CUDNN
    FM_ASSERT(nkv >= 1 && nh % nkv == 0);
    const int64_t grp = nh / nkv;
    return whole ? fm_cuda_attention_chunk_need(true, B, nh, T, hd, grp)
                 : fm_cuda_attention_chunk_need(true, 1, grp, T, hd, grp);
#else
    (void)B, (void)T, (void)nh, (void)nkv, (void)hd, (void)whole;
    return 0;
#endif
}

long fm_cuda_attention_cudnn_version(void) {
#if FM_ATT_CUDNN
    return (long)cudnnGetVersion();
#else
    return 0;
#endif
}

} /* extern "C" */
