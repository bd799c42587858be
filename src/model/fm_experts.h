/* The routed experts of an MoE layer (Megatron-Core's GroupedMLP / SequentialMLP behind one
 * forward(permuted_tokens, tokens_per_expert)): E SwiGLU MLPs (Shazeer 2020, arXiv 2002.05202)
 * over the expert-major rows of a dispatch (fm_moe_routes: expert e owns rows
 * [offsets[e], offsets[e+1]) of xe), y_e = (silu(x_e G_e^T) * (x_e U_e^T)) D_e^T, with
 * gate G and up U [E,I,H] and down D [E,H,I] (stacked Hugging Face per-expert weights).
 * fm_act everywhere, fp32 accumulation. Each projection is one grouped call over all experts
 * (fm_expert_linear_fwd/bwd: the backend's grouped GEMM, or one GEMM per expert); the backend's
 * expert-GEMM strategy (auto | loop | grouped) is a backend init option. An expert with no rows
 * gets no GEMM and leaves its weight gradient as it was.
 *
 * The experts behind one interface (bounded/fm_moe_dispatch.h's fm_moe_experts table): this
 * file's native table and fm_experts_fp8.h's two (fp8 emulated, fp8 codes); fm_experts_select
 * picks one from the dims' precision fields. The MoE glue (fm_moe_layer.c) is the only caller of
 * the tables, on one rank and under expert parallelism alike (where it hands the table to the EP
 * operator, which runs it at the owner of the rows). */
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

/* The backend's native experts (fm_act: bf16 on CUDA, fp32 on the CPU): the two functions
 * above; serves every backend and shape (FM_OK), no working set of its own (ws_bytes 0), the
 * weights as they are. */
extern const fm_moe_experts fm_experts_native;

/* The table of d's precision: fm_experts_native without d->fp8, else fm_experts_fp8_codes with
 * d->fp8_codes, else fm_experts_fp8_emulated (fm_experts_fp8.h). Never NULL. */
const fm_moe_experts *fm_experts_select(const fm_moe_dims *d);

#endif
