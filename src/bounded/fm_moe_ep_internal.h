/* What the expert-parallel MoE's files share (not a public API: the operator is fm_moe_ep.h's):
 *   fm_moe_ep.c        the layout and its bound, the schedule's choice, the two passes (the serial
 *                      schedule's loop)
 *   fm_moe_ep_chunk.c  one chunk's phases: the count table agreed and checked, the placement, the
 *                      exchanges source <-> owner, a spilled chunk's weights and gradients
 *   fm_moe_ep_pipe.c   the pipelined schedule (fm_moe_ep.h "Overlap") */
#ifndef FM_MOE_EP_INTERNAL_H
#define FM_MOE_EP_INTERNAL_H

#include "fm_moe_ep.h"

#ifdef FM_ACT_BF16
#define EP_ACT_DTYPE FM_COMM_BF16
#else
#define EP_ACT_DTYPE FM_COMM_F32
#endif

/* The count table: per rank, E counts then these five: its K, its chunk size, an error flag, its
 * cap c and a fingerprint of its placement options and schedule (the layouts must agree: checked, so a
 * mismatch fails on every rank alike instead of desynchronizing the exchanges). */
enum { T_K = 0, T_N, T_ERR, T_C, T_OPTS, T_EXTRA };
/* Error flags a rank puts in the table at chunk 0 (agreed, so every rank fails together). */
enum { EP_ERR_NONE = 0, EP_ERR_K_SMALL = 1, EP_ERR_K_BAD = 2, EP_ERR_SCHEDULE = 3 };

/* One call of the operator: its arguments, the agreed chunk count and the schedule it runs. */
typedef struct ep_call {
    const fm_backend *be;
    const fm_comm *comm;
    const fm_moe_dims *d;
    const fm_moe_experts *ex; /* the experts (the glue's table; fm_moe_dispatch.h) */
    fm_moe_dims dl;           /* the dims they see at the owner (fm_moe_ep_local_dims) */
    const fm_moe_weights *w;
    fm_moe_ep_ws *ws;
    double timeout_s;
    const char *what; /* "forward" | "backward" */
    int64_t K;
    bool pipe;        /* the pipelined schedule: the permutation goes up by copy_async */
} ep_call;

/* Points the per-chunk views of w at chunk j's sets (fm_moe_ep_ws; one set: set 0 always). */
void fm_ep_view(fm_moe_ep_ws *w, int64_t j);

/* ---- one chunk's phases (fm_moe_ep_chunk.c) ----------------------------------------------------- */

/* Wraps a communicator failure `st` with the operator and chunk j (1-based in the message). */
fm_status fm_ep_comm_fail(const ep_call *c, fm_status st, int64_t j);

/* Agrees on chunk j's counts (n tokens here, `err` this rank's EP_ERR_* flag) and checks them:
 * on every rank the same table, so the same verdict. Sets the all-to-all counts and displacements
 * of the forward direction (source -> owner), the placement (plain or least-loaded) and the
 * owner's permutation and local offsets; *R := the rows this rank receives. Errors: FM_ERR_ARG
 * naming the first offending rank (its schedule, cap, placement options, K, a chunk over the cap,
 * its rows to one rank over c * min(k, E/ep)); the communicator's, wrapped by fm_ep_comm_fail. */
fm_status fm_ep_agree(const ep_call *c, int64_t j, int64_t n, int64_t err, int64_t *R);

/* Chunk j's rows source -> owner (to_owner: send_* out of `send`, recv_* into `recv`) or back,
 * issued on the communicator's stream after the op stream's mark `after`
 * (fm_comm_all_to_all_v_async); *ticket names its completion. Errors: the communicator's. */
fm_status fm_ep_exchange_async(const ep_call *c, int64_t j, bool to_owner, const fm_act *send, fm_act *recv,
                               int after, int *ticket);

/* The source's rows out of ws->src.xe into the computing ranks' ws->recv (to_owners), and
 * ws->recv back into ws->src.ye (from_owners); a spilled chunk packs and unpacks them by computing
 * rank. Blocking all-to-all-v. Errors: the communicator's. */
fm_status fm_ep_to_owners(const ep_call *c, int64_t j);
fm_status fm_ep_from_owners(const ep_call *c, int64_t j);

/* A spilled chunk's hosted experts' weight gradients back to their native ranks, added into g
 * there. Errors: the communicator's. */
fm_status fm_ep_grads_back(const ep_call *c, int64_t j, const fm_moe_grads *g);

/* The hosted experts' part of a spilled chunk's rows, after the native experts' Rn rows (returned):
 * views of the owner's buffers and of the hosted weights and gradients, and their dims. */
int64_t fm_ep_hosted(const ep_call *c, fm_moe_routes *hv, fm_moe_ws *hw, fm_moe_weights *wv, fm_moe_grads *gv,
                     fm_moe_dims *dv);

/* Chunk j's forward up to the combine: its n tokens `tok` gathered and dispatched, the counts
 * agreed and the placement made, the rows run through the experts at their computing ranks and
 * the outputs back in ws->src.ye; *R := the rows this rank computed. Errors: fm_ep_agree's and
 * the communicator's. */
fm_status fm_ep_chunk_experts(const ep_call *c, int64_t j, const fm_act *x, const int32_t *topk_idx,
                              const float *topk_w, const int32_t *tok, int64_t n, int64_t err, int64_t *R);

/* ---- the pipelined schedule (fm_moe_ep_pipe.c) ---------------------------------------------------- */

/* Whether this call runs the pipelined schedule: two sets, plain EP, and FLATMOE_EP_SCHEDULE
 * pipelined (or auto on a communicator with async exchanges). */
bool fm_ep_pipelined(const ep_call *c);

/* fm_moe_ep_forward and fm_moe_ep_backward under the pipelined schedule, with their arguments
 * (already checked: c->K set, err the chunk-0 flag). Errors: those of fm_ep_agree and the
 * communicator's. */
fm_status fm_ep_pipe_forward(ep_call *c, fm_act *y, const fm_act *x, const int32_t *topk_idx, const float *topk_w,
                             int64_t N, const int32_t *chunk_tokens, int64_t err);
fm_status fm_ep_pipe_backward(ep_call *c, const fm_moe_grads *g, fm_act *dx, float *dtopk_w, const fm_act *dy,
                              const fm_act *x, const int32_t *topk_idx, const float *topk_w, int64_t N,
                              const int32_t *chunk_tokens, int64_t err);

#endif
