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
 * The experts behind one interface (the fm_moe_experts table below): this file's native table and
 * fm_experts_fp8.h's two (fp8 emulated, fp8 codes); fm_experts_select picks one from the dims'
 * precision fields. The MoE glue (fm_moe_layer.c) is the only caller of the tables, on one rank
 * and under expert parallelism alike (where the EP operator delivers each chunk's rows at their
 * owner and the glue runs the table on them). */
#ifndef FM_EXPERTS_H
#define FM_EXPERTS_H

#include "../bounded/fm_moe_dispatch.h"

/* ---- the experts behind one interface (Megatron-Core's GroupedMLP / SequentialMLP behind one
 * forward(permuted_tokens, tokens_per_expert); ggml's supports_op) ----------------------------
 * One table per expert precision: the backend's native experts (fm_act: bf16 on CUDA, fp32 on the
 * CPU), fp8 emulated, fp8 on E4M3 codes; fm_experts_select picks the table of a fm_moe_dims. Only
 * the MoE glue (model/fm_moe_layer.c) calls a table: on one rank between the dispatcher's dispatch
 * and combine, under expert parallelism on the rows the EP operator's pass delivers
 * (bounded/fm_moe_ep.h's fm_moe_ep_work: it moves rows and never calls an expert). Every function
 * runs over the expert-major rows of one dispatch (r: offsets [E+1] host, xe [R,H], ...; R =
 * n*d->k rows, E = d->E the experts this call sees). */
typedef struct fm_moe_experts {
    const char *name; /* "native", "fp8 emulated", "fp8 codes" (messages, logs) */
    /* Whether this precision runs on backend be for dims d over dispatches of up to rows_max rows,
     * under ep ranks of expert parallelism (1: none) with least-loaded placement when llep.
     * FM_OK, or FM_ERR_UNSUPPORTED naming what is missing and the fix (the flag to change). */
    fm_status (*serves)(const fm_backend *be, const fm_moe_dims *d, int64_t rows_max, int ep, bool llep);
    /* Bytes of the precision's own working set for dispatches of `rows` rows (its quantized
     * operands, fm_moe_ws's q_* or w8/a8/t8), beyond the native buffers; 0 for the native table.
     * act_bytes: sizeof(fm_act) of the build the plan is for. The bound of fm_moe_ws_fp8_layout. */
    size_t (*ws_bytes)(const fm_moe_dims *d, int64_t rows, size_t act_bytes);
    /* The layer's weights as the GEMMs read them, once per layer call before the chunk loop (and,
     * under least-loaded placement, once per work for the experts hosted in a chunk): *wq := w
     * (native), or the quantized copies in ws (fp8; with `backward` the copy of the forward or
     * recompute just before is kept: fm_experts_fp8.h). No errors. */
    void (*weights)(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *w, fm_moe_ws *ws,
                    fm_moe_weights *wq, bool backward);
    /* r->h_gate, h_up, h_act [R,I] and r->ye [R,H] (assigned) from r->xe [R,H], n tokens' R =
     * n*d->k rows, with the weights of `weights`. */
    void (*forward)(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *wq, fm_moe_routes *r,
                    fm_moe_ws *ws, int64_t n);
    /* From ws->dye [R,H]: ws->dxe [R,H] assigned, the weight gradients g accumulated (+=), reading
     * the forward's r->xe, h_gate, h_up, h_act; ws->dact, dh_gate, dh_up as scratch. */
    void (*backward)(const fm_backend *be, const fm_moe_dims *d, const fm_moe_weights *wq, const fm_moe_grads *g,
                     const fm_moe_routes *r, fm_moe_ws *ws, int64_t n);
} fm_moe_experts;

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
