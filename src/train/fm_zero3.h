/* ZeRO-3 over the world's ranks (--zero 3; ZeRO: Rajbhandari et al., arXiv 1910.02054,
 * stage 3 "P_os+g+p"; the per-unit flat shards and the just-in-time gather with one unit
 * prefetched are PyTorch FSDP's, arXiv 2304.11277): every rank keeps only its shard of the
 * weights (fm_act), the gradients, the fp32 master and the Adam moments; a parameter group's
 * full weights exist only while that group computes.
 *
 * The ranks. W is the whole world, dp x sp ranks (the trainer binds the world communicator): under
 * Ulysses sequence parallelism (--sp) every rank holds the same weights and contributes the
 * gradient of its own slice of the sequence, so the gradient is the sum over all W ranks and the
 * shards, gathers and reduce-scatters span them all, as torchtitan shards FSDP over dp_shard x cp
 * and Megatron-LM's distributed optimizer over dp x cp. Without --sp, W = dp.
 *
 * Shards. The flat parameter vector is cut into the model's parameter groups (model/fm_model.h:
 * group 0 the embedding (and the tied LM head), group 1 + l layer l, group L + 1 the final norm
 * and the untied head), n_g elements each. Group g is padded to W p_g elements, p_g = ceil(n_g /
 * W) rounded up to FM_SHARD_ALIGN (so each piece starts 128-byte aligned), and rank r owns its
 * piece [r p_g, (r + 1) p_g) of it: the group's flat elements [b_g + r p_g, min(b_g + (r + 1)
 * p_g, b_g + n_g)), then zeros (a rank may own only padding when W p_g > n_g, e.g. the final norm
 * on many ranks). A rank's shard is its pieces in group order: [S] elements, S = sum_g p_g,
 * piece g at local offset o_g = sum_{g' < g} p_g'. Gathering group g is one all-gather of
 * p_g elements into a [W p_g] slot, which then holds the group's flat range from its first
 * element (the model's views are pointed there, fm_params_bind_group); its gradients are one
 * reduce-scatter of a [W p_g] buffer whose block r is added to piece g of rank r's shard.
 *
 * The schedule (a group hook, fm_zero3_hook; schedule/fm_schedule.h): before the embedding,
 * the embedding is gathered and layer 0 prefetched; before layer l's forward, layer l is there
 * (or gathered) and layer l + 1 (or the head) is gathered into the other slot before layer l
 * computes; before the head, the head (and, tied, the embedding) are gathered; after the head's
 * backward its gradients are reduce-scattered; before layer l's backward (and its recompute) layer
 * l is gathered and layer l - 1 prefetched, layer l's gradients accumulate into the zeroed
 * full-size buffer, and after its backward they are reduce-scattered into the shard (the buffer
 * is then reused by the next group); the embedding's backward likewise. With tied embeddings the
 * head's contribution to the embedding's gradient is reduce-scattered after the head and the
 * embedding's own after its backward (the gradient is their sum). On the CPU with MPI every
 * collective is blocking; the prefetch is issued before the layer computes, so a communicator
 * with a stream of its own overlaps it.
 *
 * Bound (per rank, the model-state live set): the shard, 2 a S (weights, grads) + 4 S (master,
 * a != 4) + the optimizer's state of S parameters (8 S with fp32 moments) = 16 S on bf16 builds,
 * S ~ Θ / W (beside --ep: Θ_non-expert / W + the rank's experts, Θ_experts / ep); plus two gather slots of max_g W p_g fm_act each and one gradient buffer of as many
 * (tied: at least W (p_0 + p_{L+1}), the head's two groups at once). All of it is in the parameter
 * store's arena (fm_param_store_create_zero3), planned by fm_zero3_state_bytes; nothing is
 * allocated in a step.
 *
 * Beside expert parallelism (--zero 3 --ep N; the mesh planner's layout, plan/fm_mesh_bound.c):
 * each layer group's trailing range [w_gate, end) holds this rank's E/ep experts (fm_model_create_ep),
 * and those elements are kept whole on the rank instead of sharded: group g's keep_g trailing
 * elements follow all the pieces in the shard (at local offset w_g = sum_g' p_g' + sum_{g' < g}
 * keep_g'), so the shard is [S] = [sum_g p_g + sum_g keep_g]; gathers, reduce-scatters and the
 * slots cover only the pieces (attention, norms, router; embedding and head), and the model's
 * expert views point into the whole part (fm_zero3_hook rebinds them after each group bind). The
 * experts' gradients accumulate there; before the norm they are all-reduced over the
 * expert-data-parallel group (fm_zero3_set_edp: the W/ep ranks holding the same experts), and
 * the norm counts them on one rank of each such group (world rank < ep). AdamW updates them whole.
 *
 * Exactness: the global gradient norm is the fp64 sum of squares of the shard gradients (padding
 * is zero) all-reduced over the W ranks, so each parameter is counted once (the pieces partition
 * the flat range; a whole part on one rank of its edp group); AdamW is elementwise, so the shard
 * update is the replica's update restricted to the shard (tests/mpi_train.sh, mpi_train_sp.sh,
 * mpi_train_epsp.sh: the losses of one rank to 1e-6, with --sp and --ep beside). */
#ifndef FM_ZERO3_H
#define FM_ZERO3_H

#include "../comm/fm_comm.h"
#include "../schedule/fm_schedule.h"
#include "fm_optim.h"
#include "fm_param_store.h"

typedef struct fm_zero3 {
    int W, rank;          /* the ranks the shards span (the world: dp x sp) and this rank */
    int64_t L;
    int n_groups;         /* L + 2 */
    bool tied;            /* tie_word_embeddings: the head's weight is group 0's */
    int64_t n_params;
    int64_t *begin;       /* [n_groups + 1]: group g is flat [begin[g], begin[g + 1]) */
    int64_t *piece;       /* [n_groups]: p_g */
    int64_t *local;       /* [n_groups]: o_g, the piece's offset in the shard */
    int64_t *keep;        /* [n_groups]: trailing elements of group g kept whole (its experts; 0: none) */
    int64_t *wlocal;      /* [n_groups]: offset of group g's whole part in the shard */
    int64_t piece_total;  /* sum_g p_g: the shard's sharded part; the whole parts follow it */
    int64_t shard_len;    /* S: piece_total + sum_g keep_g */
    int64_t slot_len;     /* elements of one gather slot: max_g W p_g */
    int64_t gbuf_len;     /* elements of the full-size gradient buffer */
    /* bound by fm_zero3_bind: the store's buffers and the dp communicator */
    fm_act *weights, *grads; /* [S] this rank's shard */
    float *master;           /* [S] fp32 master; == weights when fm_act is fp32 */
    fm_act *slot[2];         /* [slot_len] each: gathered weights */
    fm_act *gbuf;            /* [gbuf_len]: one group's full gradients */
    const fm_comm *dp;       /* the W ranks (the trainer's world, dp x sp) */
    const fm_comm *edp;      /* the ranks holding the same whole parts (NULL: none; fm_zero3_set_edp) */
    bool whole_sq;           /* this rank counts the whole parts in the norms (one rank per edp group) */
    int slot_group[2];       /* the group each slot holds (-1: none) */
    uint64_t slot_used[2], clock; /* least recently used slot is evicted */
    int64_t gathers, reduce_scatters; /* counts, for tests and the report */
} fm_zero3;

/* p(n) = ceil(n / W) rounded up to FM_SHARD_ALIGN: the piece of a group of n elements. */
int64_t fm_zero3_piece_len(int64_t n, int W);

/* The layout of W ranks over groups of the given flat starts: begin [n_groups + 1] (begin[0] =
 * 0, non-decreasing; begin[n_groups] = n_params), tied as the model's. rank in [0, W). Copies
 * begin. Errors: FM_ERR_ARG (W < 1, rank out of range, n_groups < 2, begin not non-decreasing),
 * FM_ERR_NOMEM. */
fm_status fm_zero3_layout(fm_zero3 *z, const int64_t *begin, int n_groups, bool tied, int rank, int W);

/* The same with keep [n_groups] (NULL: all zero): group g's last keep[g] elements (0 <= keep[g]
 * <= its size; only layer groups, 1..n_groups - 2, may keep) stay whole on the rank, after the
 * pieces (the header's --ep layout); whole_sq as the struct's. Errors: as fm_zero3_layout, and
 * FM_ERR_ARG for a keep out of range. */
fm_status fm_zero3_layout_keep(fm_zero3 *z, const int64_t *begin, const int64_t *keep, int n_groups, bool tied, int rank,
                               int W, bool whole_sq);

/* The same for the groups of parameter table pp (fm_params_group_begin; a model's m->p). The
 * table of one of several expert-parallel ranks (pp->ep > 1, fm_params_create) keeps each layer's
 * experts [w_gate, end) whole, and world rank `rank` < pp->ep counts them in the norms. Errors: as
 * fm_zero3_layout. */
fm_status fm_zero3_layout_params(fm_zero3 *z, const fm_model_params *pp, int rank, int W);

/* Frees the layout's tables (not the store's buffers: fm_param_store_free). Safe on a zeroed z. */
void fm_zero3_free(fm_zero3 *z);

/* Bytes of the store's part (shard weights, grads, master on a != 4, two slots, the gradient
 * buffer; each rounded as the arena rounds) for activations of a bytes. */
size_t fm_zero3_store_bytes(const fm_zero3 *z, size_t a);

/* The model-state bound of --zero 3 over W ranks for a config (fm_model_state_bound's; the
 * groups' sizes from the config: V H, each layer's, H (+ V H untied)): fm_zero3_store_bytes plus
 * AdamW's moments of S parameters; desc (200 bytes, may be NULL) gets the formula. */
size_t fm_zero3_state_bytes(const fm_config *cfg, size_t a, int W, bool bf16_moments, char desc[200]);

/* The same beside expert parallelism of degree ep (ep <= 1: fm_zero3_state_bytes): each layer's
 * E/ep experts, 3 (E/ep) H I elements, kept whole (the header's --ep layout), the rest sharded. */
size_t fm_zero3_state_bytes_ep(const fm_config *cfg, size_t a, int W, int ep, bool bf16_moments, char desc[200]);

/* The plan's model-state callback (fm_model_state_bound's signature) for --zero 3 --ep: the
 * non-expert parameters sharded over lay->ranks, lay->ep's share of the experts whole
 * (fm_zero3_state_bytes_ep). */
size_t fm_zero3_ep_model_state_bound(const fm_config *cfg, const fm_state_layout *lay, size_t a, bool bf16_moments,
                                     char desc[200]);

/* Host packing (checkpoints, the initial weights; also the unit test's reference): rank q's
 * shard local [S] (elements of es bytes) from the full table-layout vector full [n_params], zeros
 * in the padding; and its inverse, rank q's valid elements written back into full. */
void fm_zero3_pack(const fm_zero3 *z, int q, const void *full, void *local, size_t es);
void fm_zero3_unpack(const fm_zero3 *z, int q, const void *local, void *full, size_t es);

/* Which rank owns flat parameter p, and where in its shard (for tests). */
void fm_zero3_owner(const fm_zero3 *z, int64_t p, int *rank, int64_t *local);

/* Points z at store ps's ZeRO-3 buffers (fm_param_store_create_zero3) and communicator dp (W
 * ranks, this rank z->rank: the trainer's world of dp x sp ranks), and the model's
 * master/params/grads pointers at the shard. */
void fm_zero3_bind(fm_zero3 *z, fm_model *m, const fm_param_store *ps, const fm_comm *dp);

/* The expert-data-parallel group edp (backend memory; NULL or one rank: none) over which the
 * whole parts' gradients are all-reduced in fm_zero3_grad_sumsq. */
void fm_zero3_set_edp(fm_zero3 *z, const fm_comm *edp);

/* The schedule's group hook (fm_schedule_add_group_hook with user = z): the gathers, prefetches,
 * gradient zeroing and reduce-scatters of the header's comment. Errors: the communicator's. */
fm_status fm_zero3_hook(void *user, fm_model *m, fm_hook_point p, int64_t layer);

/* Forgets what the slots hold (after the weights changed: each step's update, a load). */
void fm_zero3_invalidate(fm_zero3 *z);

/* The step's parts: zero the shard's gradients; the global sum of squares of the gradients
 * (fp64, into *dev_out, backend memory) as the sum over ranks of their shards' (the whole parts
 * first all-reduced over edp, then counted on the ranks with whole_sq); the sum of
 * squares of the weights likewise (a checkpoint's finite check); the optimizer's update of this
 * rank's pieces (optim->step_at over each piece's valid elements, after step_begin) at lr with
 * gradient scale clip. Errors: the communicator's; FM_ERR_UNSUPPORTED when the optimizer has no
 * step_at. */
void fm_zero3_zero_grads(fm_zero3 *z, fm_model *m);
fm_status fm_zero3_grad_sumsq(fm_zero3 *z, fm_model *m, double *dev_out);
fm_status fm_zero3_weight_sumsq(fm_zero3 *z, fm_model *m, double *dev_out);
fm_status fm_zero3_update(fm_zero3 *z, fm_model *m, const fm_optimizer_ops *optim, void *opt, double lr, float clip);

/* Checkpoints. fm_zero3_gather_full: every rank's shard `local` ([S] of dtype F32 or BF16,
 * backend memory) into a full table-layout host vector [n_params] of dtype on rank 0 (*full,
 * allocated here; NULL on the other ranks), a collective of dp: group by group all-gathered into
 * the two gather slots (adjacent, so 2 slot_len fm_act hold W p_g fp32 values; no device memory
 * beyond the plan) and copied out on rank 0 (with its own whole parts); the slots then hold no group.
 * fm_zero3_gather_all: the same, every rank getting the full vector of its table with its own
 * whole parts (the --ep checkpoint then gathers the experts, fm_train_ep_gather). fm_zero3_scatter_full: this rank's shard [S] of dtype
 * (backend memory) from a full fp32 host vector (bf16: rounded to nearest even).
 * fm_zero3_set_master: the shard master from full fp32 weights, and the fm_act weights from it.
 * Errors: FM_ERR_NOMEM, the communicator's. */
fm_status fm_zero3_gather_full(fm_zero3 *z, const fm_model *m, const void *local, fm_dtype dtype, void **full);
fm_status fm_zero3_gather_all(fm_zero3 *z, const fm_model *m, const void *local, fm_dtype dtype, void **full);
fm_status fm_zero3_scatter_full(fm_zero3 *z, fm_model *m, const float *full, void *local, fm_dtype dtype);
fm_status fm_zero3_set_master(fm_zero3 *z, fm_model *m, const float *full);

#endif
