/* Expert parallelism in the trainer (--ep N; README "Many ranks"; DESIGN.md §6): the groups, the
 * model-state bound, the gradients' reduction and the checkpoint gather of a run whose experts
 * are partitioned over ep ranks. The MoE operator itself is bounded/fm_moe_ep.h; the model's
 * table of this rank's experts is fm_model_create_ep.
 *
 * Layout over the W = dp x sp ranks of the world (--sp: Ulysses, world rank r = dp_index x sp +
 * sp_index): the ep group of world rank r is the contiguous block [r - r % ep, + ep) (comm/fm_comm.h,
 * fm_comm_group_create), whatever sequence slices its ranks hold (the dispatch works per token,
 * wherever the token lives: an ep group may be one sequence's sp ranks, several dp ranks, or
 * both), and r owns experts (r % ep) * E/ep .. + E/ep - 1 of every layer. Each rank's MoE runs on
 * its own B x T/sp tokens. Non-expert parameters are replicas over the world, their gradients
 * all-reduced over all W ranks (dp x sp: the sp ranks hold other tokens of the same sequences);
 * an expert's gradient already holds the sum over its ep group's tokens (the dispatch brought
 * them to its owner), and is all-reduced over the W/ep ranks that hold the same experts (world
 * ranks with the same r % ep: the "expert-data-parallel" group; none when W == ep). The router's
 * statistics stay reduced over the world (every rank that sees the batch's tokens), so the aux
 * loss is the one-rank run's on the same global batch.
 *
 * ZeRO-1/2 (--zero 1) and the streamed optimizer (--offload-optimizer) are refused with --ep > 1:
 * both shard or stream the flat parameter range as if every rank held the same tensors. --zero 3
 * with --ep shards only the non-expert parameters, over all W = dp x sp ranks (beside --sp too),
 * and keeps each rank's experts whole (its
 * gradients' reduction, norm and checkpoint gather are train/fm_zero3.h's, then fm_train_ep_gather). */
#ifndef FM_TRAIN_EP_H
#define FM_TRAIN_EP_H

#include "../comm/fm_comm.h"
#include "../model/fm_model.h"
#include "fm_trainer.h"

typedef struct fm_train_ep {
    int ep;                 /* the degree (1: no expert parallelism; nothing below is set) */
    int rank;               /* this rank's index in its ep group (world rank % ep) */
    int world_rank, world;  /* this rank of the world, and W */
    fm_comm_group group;    /* the mesh dp x ep x sp over the world (backend memory) */
    bool group_ok;
    fm_comm edp;            /* the ranks holding the same experts (W/ep of them; backend memory) */
    bool edp_ok;
    fm_comm host_world;     /* the world over host memory: the checkpoint gather */
    bool host_ok;
    fm_model_params full;   /* the parameter table of all E experts (no memory bound): the names
                               and layout of the checkpoint's full tensors */
    bool full_ok;
} fm_train_ep;

/* The checks of --ep and its options against the world size W and the config c, before any
 * allocation. Errors: FM_ERR_ARG naming the flag, the expected and found values and the fix: ep
 * < 1; ep not dividing W; ep not dividing num_experts; --zero 1 or --offload-optimizer with ep >
 * 1; --ep-cap-tokens < 0, or given together with another --moe-chunk-tokens; --llep or
 * --llep-lambda/--llep-min-piece without ep > 1, lambda < 1, min_piece < 1. */
fm_status fm_train_ep_check(const fm_train_opts *o, const fm_config *c, int W);

/* The least-loaded placement options of o (fm_llep_defaults, on when --llep, lambda and
 * min_piece from the flags). */
fm_llep_opts fm_train_ep_llep(const fm_train_opts *o);

/* The model-state live set's per-rank bound with this rank's E/ep experts (ep = lay->ep;
 * replicas over dp, AdamW): the parameter store's weights, grads (and the fp32 master when
 * a != 4) and AdamW's m and v, of fm_params_ep_num_params(cfg, ep) parameters, each buffer rounded
 * as the arenas round; desc (200 bytes) the formula. The plan request's model_state_bytes under
 * --ep (the same signature as fm_model_state_bound). */
size_t fm_train_ep_model_state_bound(const fm_config *cfg, const fm_state_layout *lay, size_t a, bool bf16_moments,
                                     char desc[200]);

/* Sets up x over the world communicator (backend memory) of dp x sp ranks for degree ep > 1 (ep
 * divides dp x sp) and model m (created with fm_model_create_ep(.., ep, world_rank % ep)): the
 * mesh groups dp x ep x sp, the expert-data-parallel group, the host-memory world for
 * checkpoints, the full table; points m->mesh.moe_ep_comm at the ep group. A collective call on world.
 * Errors: the communicators' (FM_ERR_ARG: dp x sp is not the world size, or ep does not divide
 * it; FM_ERR_IO, FM_ERR_UNSUPPORTED), FM_ERR_NOMEM. */
fm_status fm_train_ep_init(fm_train_ep *x, const fm_comm *world, int dp, int ep, int sp, fm_model *m);
void fm_train_ep_free(fm_train_ep *x);

/* The accumulated gradients summed as the header says (non-expert ranges over dp, each layer's
 * experts over the expert-data-parallel group), then their global sum of squares into
 * m->a.results[FM_RESULT_SUMSQ] on every rank: the experts' squares summed over the ep group (each
 * expert counted once), plus the replicated tensors' squares. dp: the world. A collective call on
 * dp, the ep and edp groups. Errors: the communicators'. */
fm_status fm_train_ep_reduce_grads(fm_model *m, const fm_comm *dp, const fm_train_ep *x);

/* A checkpoint's full tensor from the owners: src [m->p.n_params] of dtype (F32 or BF16; backend
 * memory, or host memory when host) in this rank's table layout; on world rank 0 *full gets a
 * new host fp32 buffer [x->full.n_params] in the full table's layout (bf16 widened exactly), the
 * experts of every ep rank of its group in place; NULL elsewhere. A collective call on the host
 * world (every rank calls it). Errors: FM_ERR_NOMEM, the communicator's. */
fm_status fm_train_ep_gather(const fm_train_ep *x, const fm_model *m, const void *src, fm_dtype dtype, bool host,
                             float **full);

/* The expert dispatch's measured high-water marks against the bound (the --report-memory line):
 * "ep dispatch: rows received per chunk high X of R_max R; sent high S" into buf. */
void fm_train_ep_report(const fm_model *m, char *buf, size_t n);

#endif
