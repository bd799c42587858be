/* What the expert-parallel MoE's files share (not a public API: the operator is fm_moe_ep.h's):
 *   fm_moe_ep.c        the layout and its bound, the schedule's choice, a pass's begin and steps
 *                      (fm_moe_ep_next; the serial schedule's stages)
 *   fm_moe_ep_chunk.c  one chunk's phases: the count table agreed and checked, the placement, the
 *                      exchanges source <-> owner, a spilled chunk's weights and gradients, the
 *                      work handed to the glue
 *   fm_moe_ep_pipe.c   the pipelined schedule's stages (fm_moe_ep.h "Overlap") */
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

/* Points the per-chunk views of w at chunk j's sets (fm_moe_ep_ws; one set: set 0 always). */
void fm_ep_view(fm_moe_ep_ws *w, int64_t j);

/* ---- one chunk's phases (fm_moe_ep_chunk.c) ----------------------------------------------------- */

/* Wraps a communicator failure `st` with the operator and chunk j (1-based in the message). */
fm_status fm_ep_comm_fail(const fm_moe_ep_pass *c, fm_status st, int64_t j);

/* Agrees on chunk j's counts (n tokens here, `err` this rank's EP_ERR_* flag) and checks them:
 * on every rank the same table, so the same verdict. Sets the all-to-all counts and displacements
 * of the forward direction (source -> owner), the placement (plain or least-loaded) and the
 * owner's permutation and local offsets; *R := the rows this rank receives. Errors: FM_ERR_ARG
 * naming the first offending rank (its schedule, cap, placement options, K, a chunk over the cap,
 * its rows to one rank over c * min(k, E/ep)); the communicator's, wrapped by fm_ep_comm_fail. */
fm_status fm_ep_agree(const fm_moe_ep_pass *c, int64_t j, int64_t n, int64_t err, int64_t *R);

/* Chunk j's rows source -> owner (to_owner: send_* out of `send`, recv_* into `recv`) or back,
 * issued on the communicator's stream after the op stream's mark `after`
 * (fm_comm_all_to_all_v_async); *ticket names its completion. Errors: the communicator's. */
fm_status fm_ep_exchange_async(const fm_moe_ep_pass *c, int64_t j, bool to_owner, const fm_act *send, fm_act *recv,
                               int after, int *ticket);

/* The source's rows out of ws->src.xe into the computing ranks' ws->recv (to_owners), and
 * ws->recv back into ws->src.ye (from_owners); a spilled chunk packs and unpacks them by computing
 * rank. Blocking all-to-all-v. Errors: the communicator's. */
fm_status fm_ep_to_owners(const fm_moe_ep_pass *c, int64_t j);
fm_status fm_ep_from_owners(const fm_moe_ep_pass *c, int64_t j);

/* A spilled chunk's hosted experts' weight gradients back to their native ranks, added into g
 * there. Errors: the communicator's. */
fm_status fm_ep_grads_back(const fm_moe_ep_pass *c, int64_t j, const fm_moe_grads *g);

/* Fills c->work for chunk j's rows at this rank (R of them, kind): part 1 the own experts'
 * (ws->exp.offsets[E_loc] rows), part 2 (a spilled chunk) the hosted experts' views; in a
 * BACKWARD work of a spilled chunk the hosted gradients zeroed. The views are those of the
 * current set (fm_ep_view). Returns &c->work. */
fm_moe_ep_work *fm_ep_work(fm_moe_ep_pass *c, int64_t j, int64_t R, fm_moe_ep_work_kind kind);

/* Chunk j's dispatch phase: its n tokens `tok` gathered and dispatched, the counts agreed and the
 * placement made, a spilled chunk's weights sent to their helpers, the rows sent to their
 * computing ranks and gathered expert-major there (ws->exp.xe); *R := the rows this rank computes.
 * Errors: fm_ep_agree's and the communicator's. */
fm_status fm_ep_chunk_dispatch(const fm_moe_ep_pass *c, int64_t j, const int32_t *tok, int64_t n, int64_t err,
                               int64_t *R);

/* Chunk j's return after its FORWARD work (R rows): the outputs into the receive buffer and back
 * to their sources, into ws->src.ye (the source's expert-major layout over all E experts).
 * Errors: the communicator's. */
fm_status fm_ep_chunk_return(const fm_moe_ep_pass *c, int64_t j, int64_t R);

/* ---- the pipelined schedule (fm_moe_ep_pipe.c) ---------------------------------------------------- */

/* Whether this pass runs the pipelined schedule: two sets, plain EP, and the schedule pipelined
 * (or auto on a communicator with async exchanges). */
bool fm_ep_pipelined(const fm_moe_ep_pass *c);

/* The pipelined schedule's stages (fm_moe_ep.h "Overlap"; c->err the chunk-0 flag):
 *   fm_ep_pipe_begin      chunk 0 routed and its exchange out issued (c->pipe set);
 *   fm_ep_pipe_fwd_work   chunk j+1's routing and dispatch, chunk j's rows joined and gathered:
 *                         its FORWARD work;
 *   fm_ep_pipe_fwd_done   after it: chunk j's outputs into the receive buffer, chunk j+1's
 *                         agreement and exchange out, chunk j's outputs back; in a forward pass
 *                         chunk j-1's combine; in a backward pass chunk j's combine backward, dye
 *                         out and joined at the owner: its BACKWARD work;
 *   fm_ep_pipe_bwd_done   after it: chunk j's input gradients back, chunk j-1's dispatch backward;
 *   fm_ep_pipe_end        the last chunk's combine (forward) or dispatch backward (backward).
 * *work (when an argument): the next work. Errors: fm_ep_agree's and the communicator's. */
fm_status fm_ep_pipe_begin(fm_moe_ep_pass *c);
fm_status fm_ep_pipe_fwd_work(fm_moe_ep_pass *c, int64_t j, fm_moe_ep_work **work);
fm_status fm_ep_pipe_fwd_done(fm_moe_ep_pass *c, int64_t j, fm_moe_ep_work **work);
fm_status fm_ep_pipe_bwd_done(fm_moe_ep_pass *c, int64_t j);
fm_status fm_ep_pipe_end(fm_moe_ep_pass *c);

/* Chunk j's tokens (c->ch[j % 3]: n, tok; c->start advanced). */
void fm_ep_chunk_setup(fm_moe_ep_pass *c, int64_t j);

#endif
