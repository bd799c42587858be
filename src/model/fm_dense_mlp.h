/* The dense SwiGLU MLP of a dense layer (qwen3_moe's Qwen3MoeMLP on the layers that
 * decoder_sparse_step / mlp_only_layers make dense; model/fm_config.h):
 *   y = down( silu(x Wg^T) * (x Wu^T) ),  Wg, Wu [Id,H], Wd [H,Id] (Hugging Face layout)
 * (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6; transformers' Qwen2MoeMLP). Through
 * the op table's GEMMs and SwiGLU ops only, so every backend runs it.
 *
 * Nothing is saved between forward and backward: the backward forms gate and up again from x
 * (two GEMMs, as the chunked MoE recomputes its chunks), so a dense layer's saved set is its
 * attention's alone. Its working set, one layer at a time (the backward working-set live set,
 * fm_model_working_set_bytes): five [N,Id] buffers, gate, up, h (its gradient after the down
 * projection's weight gradient), dgate, dup: 5 N Id b bytes. */
#ifndef FM_DENSE_MLP_H
#define FM_DENSE_MLP_H

#include "../backend/fm_backend.h"

/* The working set: five [N,Id] fm_act buffers (backend memory), laid out by fm_layout.c. */
typedef struct fm_dense_mlp_ws {
    fm_act *gate, *up, *h, *dgate, *dup;
} fm_dense_mlp_ws;

/* Number of [N,Id] buffers in the working set. */
#define FM_DENSE_MLP_WS_BUFFERS 5

/* Forward: y [N,H] (assigned) from x [N,H], weights wg, wu [Id,H] and wd [H,Id]; ws's gate, up
 * and h are written. y must not alias x. */
void fm_dense_mlp_forward(const fm_backend *be, fm_act *y, const fm_act *x, const fm_act *wg, const fm_act *wu,
                          const fm_act *wd, int64_t N, int64_t H, int64_t Id, const fm_dense_mlp_ws *ws);

/* Backward: dx [N,H] ASSIGNED, gg, gu [Id,H] and gd [H,Id] ACCUMULATED (+=), from dy [N,H] and
 * the forward's input x [N,H] (gate and up formed again in ws). dx must alias neither x nor dy. */
void fm_dense_mlp_backward(const fm_backend *be, fm_act *dx, fm_act *gg, fm_act *gu, fm_act *gd, const fm_act *dy,
                           const fm_act *x, const fm_act *wg, const fm_act *wu, const fm_act *wd, int64_t N, int64_t H,
                           int64_t Id, const fm_dense_mlp_ws *ws);

#endif
