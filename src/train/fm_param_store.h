/* The parameter store (DESIGN.md §3, train/): owner of the model-state live set — the bf16 (or,
 * on the CPU, fp32) weights and gradients, the fp32 master weights, and the optimizer's state
 * taken from the same arena — and the range of the flat parameters this rank holds.
 *
 * W = 1, or replicas over dp (--zero 0): the store holds the whole replica, shard [0, n_params).
 * ZeRO-1/2 over W ranks (the world's dp x sp: under --sp every rank holds the same weights;
 * fm_param_store_create_sharded, --zero 1): rank r owns the
 * flat range [r S, min((r + 1) S, n_params)), S = ceil(n_params / W) rounded up to a multiple of
 * FM_SHARD_ALIGN elements (so every shard starts 128-byte aligned for the backend's vector
 * kernels; the last ranks may own fewer, or no, parameters); the weights and gradients
 * stay whole but are padded to W S elements (zeros past n_params), so that the gradients'
 * reduce-scatter and the weights' all-gather are equal blocks in place; the optimizer keeps the
 * state of the shard only (S elements). ZeRO-3 (fm_param_store_create_zero3, --zero 3;
 * train/fm_zero3.h): the weights, grads and master are this rank's shard only, S elements of
 * per-group pieces, beside two gather slots and one group's full gradients.
 *
 * Bound (the model-state live set, DESIGN.md §2): weights and grads 2 * r(n_params * a) plus the
 * master r(n_params * 4) when a != 4 (a = bytes per fm_act), plus the optimizer's state
 * (fm_optimizer_ops.state_bytes): 16 B/param with fp32 AdamW moments and bf16 weights. */
#ifndef FM_PARAM_STORE_H
#define FM_PARAM_STORE_H

#include "../model/fm_model.h"

typedef struct fm_param_store {
    int64_t n_params;            /* all parameters of the model (the table's) */
    int rank, world;             /* this rank of the data-parallel world (0 of 1 today) */
    int64_t shard_begin, shard_end; /* the flat range this rank owns: [0, n_params) for W = 1 */
    int64_t shard_len;           /* S: elements per rank's block (n_params unsharded); shard_end -
                                    shard_begin may be shorter on the last ranks (0 when S r >= n) */
    int64_t n_alloc;             /* elements of weights and grads: n_params, or W S when sharded */
    bool sharded;                /* fm_param_store_create_sharded with W > 1 */
    fm_act *weights, *grads;     /* [n_params] backend memory */
    float *master;               /* [n_params] fp32 master weights; == weights when fm_act is fp32;
                                    the optimizer's (host) memory in the no-master mode */
    bool host_master;            /* fm_param_store_create_host_master: master is not in the arena */
    bool no_master;              /* fm_param_store_create_bf16 on a bf16 build: no fp32 master; master
                                    aliases the weights (fm_act elements, not fp32) */
    bool zero3;                  /* fm_param_store_create_zero3: weights, grads, master [shard_len]
                                    (shard_begin 0: the optimizer's state is the shard's) */
    fm_act *slot[2], *gbuf;      /* ZeRO-3: the gather slots [slot_len] and the gradient buffer [gbuf_len] */
    int64_t slot_len, gbuf_len;
    fm_arena arena;              /* the model-state live set (backend memory) */
    fm_backend be;               /* the backend of the arena (a copy: the store may outlive the model) */
} fm_param_store;

/* Bytes of weights, grads and master for a config, activations of act_bytes (sizeof(fm_act) for
 * this build; 2 or 4 to plan another build's run), without the optimizer's state. */
size_t fm_param_store_bytes(const fm_config *cfg, size_t act_bytes);

/* Bytes of weights and grads only, 2 r(n_params * act_bytes): the store without its master, for
 * an optimizer that keeps the fp32 master itself (the streamed AdamW, fm_offload_adamw.h). */
size_t fm_param_store_bytes_no_master(const fm_config *cfg, size_t act_bytes);

/* The bytes the store's layout takes for n_params in this build, measured by running it over a
 * measuring arena (test_plan checks fm_param_store_bytes against it). */
size_t fm_param_store_measure(int64_t n_params);

/* Allocates the model-state arena for model m (its table and backend) with optimizer_bytes more
 * for the optimizer (fm_param_store_take), lays out weights, grads and master, zeroes them and
 * binds them into m (fm_params_bind). W = 1. Errors: FM_ERR_NOMEM naming the model state's
 * size and the fix. */
fm_status fm_param_store_create(fm_param_store *ps, fm_model *m, size_t optimizer_bytes);

/* The same without the device master: weights and grads only (fm_param_store_bytes_no_master)
 * plus optimizer_bytes; the model's master view (m->p.master, ps->master) is bound to `master`
 * [n_params] fp32, memory the optimizer owns (pinned host memory for the streamed AdamW), also
 * on the CPU build, where the fp32 weights are then a separate copy written from it. The weights'
 * init and checkpoint loads write that master and convert it into the weights. Errors: as
 * fm_param_store_create. */
fm_status fm_param_store_create_host_master(fm_param_store *ps, fm_model *m, size_t optimizer_bytes, float *master);

/* ZeRO-1/2 (the header's comment): the store of rank `rank` of `world` data-parallel ranks,
 * weights and grads [world * S] (padding zeroed), master whole (fp32 builds: the weights), and
 * optimizer_bytes for the shard's optimizer state. world == 1 is fm_param_store_create. Errors:
 * as fm_param_store_create. */
fm_status fm_param_store_create_sharded(fm_param_store *ps, fm_model *m, int rank, int world, size_t optimizer_bytes);

/* ZeRO-3 (train/fm_zero3.h): the store of rank z->rank of z->W: weights and grads [z->shard_len]
 * fm_act (zeroed), the master [z->shard_len] fp32 (fp32 builds: the weights), the two gather
 * slots [z->slot_len] and the gradient buffer [z->gbuf_len], fm_zero3_store_bytes(z) in all, and
 * optimizer_bytes for the shard's optimizer state. m's master/params/grads point at the shard;
 * its views are the schedule hook's to bind (fm_zero3_bind, fm_params_bind_group). Errors: as
 * fm_param_store_create. */
struct fm_zero3;
fm_status fm_param_store_create_zero3(fm_param_store *ps, fm_model *m, const struct fm_zero3 *z, size_t optimizer_bytes);

#define FM_SHARD_ALIGN 64

/* S = ceil(n_params / world) rounded up to FM_SHARD_ALIGN, the elements of one rank's block
 * (n_params when world == 1). */
int64_t fm_param_store_shard_len(int64_t n_params, int world);

/* Bytes of weights, grads and master of the sharded store (fm_param_store_bytes for world 1). */
size_t fm_param_store_bytes_sharded(const fm_config *cfg, size_t act_bytes, int world);

/* Bytes of weights, grads and master of the store a state recipe (--master-weights) runs with
 * over `world` ZeRO-1/2 ranks (1: unsharded): fm_param_store_bytes_sharded for fp32; a bf16
 * recipe has no master: 2 r(n_alloc * act_bytes), n_alloc = world * S (n unsharded). */
size_t fm_param_store_bytes_recipe(const fm_config *cfg, size_t act_bytes, int world, fm_master_recipe recipe);

/* The store of a bf16 recipe (--master-weights bf16-kahan | bf16-sr): as fm_param_store_create
 * (world 1) or _sharded, without the fp32 master: m->p.master and ps->master alias the weights
 * (on the fp32 build that is the existing layout; on a bf16 build ps->no_master says the alias
 * holds fm_act, and weights are written with fm_param_store_upload_f32). Errors: as
 * fm_param_store_create. */
fm_status fm_param_store_create_bf16(fm_param_store *ps, fm_model *m, int rank, int world, size_t optimizer_bytes);

/* The initial or loaded weights w [n_params] fp32 (host memory) into the store's model: through
 * the master (fm_model_upload_master), or, with no master (no_master), rounded to bf16 on the
 * host and copied in pieces of 1M elements (a 2 MiB host staging, freed before it returns).
 * Errors: FM_ERR_NOMEM (the staging). */
fm_status fm_param_store_upload_f32(const fm_param_store *ps, fm_model *m, const float *w);

/* `bytes` of the model-state arena for the optimizer's state (backend memory, 64-byte aligned).
 * Taking more than fm_param_store_create was given is a planning bug (aborts). */
void *fm_param_store_take(fm_param_store *ps, size_t bytes);

/* Frees the arena (before the backend is freed). Safe on a zeroed store. */
void fm_param_store_free(fm_param_store *ps);

#endif
