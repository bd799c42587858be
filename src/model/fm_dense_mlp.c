/* The dense SwiGLU MLP (fm_dense_mlp.h): forward, and backward that forms gate and up again. */
#include "fm_dense_mlp.h"

static void project_in(const fm_backend *be, const fm_act *x, const fm_act *wg, const fm_act *wu, int64_t N, int64_t H,
                       int64_t Id, const fm_dense_mlp_ws *ws) {
    fm_linear_fwd(be, ws->gate, FM_ACT_DTYPE, x, wg, N, H, Id);
    fm_linear_fwd(be, ws->up, FM_ACT_DTYPE, x, wu, N, H, Id);
    be->ops->swiglu_fwd(be->ctx, ws->h, ws->gate, ws->up, N * Id);
}

void fm_dense_mlp_forward(const fm_backend *be, fm_act *y, const fm_act *x, const fm_act *wg, const fm_act *wu,
                          const fm_act *wd, int64_t N, int64_t H, int64_t Id, const fm_dense_mlp_ws *ws) {
    project_in(be, x, wg, wu, N, H, Id, ws);
    fm_linear_fwd(be, y, FM_ACT_DTYPE, ws->h, wd, N, Id, H);
}

void fm_dense_mlp_backward(const fm_backend *be, fm_act *dx, fm_act *gg, fm_act *gu, fm_act *gd, const fm_act *dy,
                           const fm_act *x, const fm_act *wg, const fm_act *wu, const fm_act *wd, int64_t N, int64_t H,
                           int64_t Id, const fm_dense_mlp_ws *ws) {
    project_in(be, x, wg, wu, N, H, Id, ws);
    /* down: gd += dy^T h (h read), then dh = dy Wd into h's buffer (h dead) */
    fm_linear_bwd(be, NULL, 0.0f, gd, dy, ws->h, wd, N, Id, H, 1.0f);
    be->ops->gemm(be->ctx, false, false, N, Id, H, 1.0f, dy, H, wd, Id, 0.0f, ws->h, FM_ACT_DTYPE, Id);
    be->ops->swiglu_bwd(be->ctx, ws->dgate, ws->dup, ws->h, ws->gate, ws->up, N * Id);
    /* gate and up: dx = dgate Wg + dup Wu (assigned, then accumulated), gg += dgate^T x, gu += dup^T x */
    fm_linear_bwd(be, dx, 0.0f, gg, ws->dgate, x, wg, N, H, Id, 1.0f);
    fm_linear_bwd(be, dx, 1.0f, gu, ws->dup, x, wu, N, H, Id, 1.0f);
}
