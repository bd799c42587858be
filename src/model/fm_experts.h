/* The routed experts of an MoE layer (Megatron-Core's GroupedMLP / SequentialMLP behind one
 * forward(permuted_tokens, tokens_per_expert)): E SwiGLU MLPs (Shazeer 2020, arXiv 2002.05202)
 * over the expert-major rows of a dispatch (fm_moe_routes: expert e owns rows
 * [offsets[e], offsets[e+1]) of xe), y_e = (silu(x_e G_e^T) * (x_e U_e^T)) D_e^T, with
 * gate G and up U [E,I,H] and down D [E,H,I] (stacked Hugging Face per-expert weights).
 * fm_act everywhere, fp32 accumulation. Each projection is one grouped call over all experts
 * (fm_expert_linear_fwd/bwd: the backend's grouped GEMM, or one GEMM per expert); the backend's
 * expert-GEMM strategy (auto | loop | grouped) is a backend init option. An expert with no rows
 * gets no GEMM and leaves its weight gradient as it was. */
#ifndef FM_EXPERTS_H
#define FM_EXPERTS_H

#include "../bounded/fm_moe_dispatch.h"

/* r->h_gate, h_up, h_act [R,I] and r->ye [R,H] (assigned) from r->xe [R,H], R = n*k rows. */
void fm_experts_forward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, fm_moe_routes *r,
                        int64_t n);

/* From dye [R,H] (ws->dye): ws->dxe [R,H] assigned (the permuted input gradient), ws->dact,
 * dh_gate, dh_up as scratch, and the weight gradients g accumulated (+=), reading the forward's
 * r->xe, h_gate, h_up, h_act. */
void fm_experts_backward(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, const fm_moe_grads *g,
                         const fm_moe_routes *r, fm_moe_ws *ws, int64_t n);

#endif
