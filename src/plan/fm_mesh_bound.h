/* The per-rank bounds of a mesh (DESIGN.md §2 and §6) and the time of its collectives at the
 * calibration table's link rates: what fm_plan_compute and fm_project add when the request's
 * mesh is on. The chooser over mesh degrees is fm_mesh.h.
 *
 * Symbols: W = dp x sp (the ZeRO-3 group and the vocabulary ring: every rank of the world),
 * Θ_exp = L E 3 H I expert parameters, Θ_ne = Θ - Θ_exp the others (attention, router, norms,
 * embedding, LM head), U the largest ZeRO-3 gather unit (one layer's non-expert parameters, or
 * the embedding V x H), a the activation bytes, N_loc = B T / sp tokens on this rank.
 *
 * Model state (our choice, documented in README "plan for a mesh"): the non-expert parameters are
 * sharded ZeRO-3 over all W = dp x sp ranks (the sp ranks of a sequence hold the same weights, so
 * they join the data-parallel ranks' sharding group: the largest group, the smallest shard); each
 * rank holds its E/ep experts whole (weights, grads, master, moments), replicated over the W/ep
 * ranks of its expert-data-parallel group, whose expert gradients are all-reduced once per step.
 * So the expert state falls only with ep, which is what lets the chooser fix ep by expert memory.
 *   device = bpp x (ceil(Θ_ne / W) + Θ_exp / ep) + 3 r(U a)   (W > 1: two gathered slots of bf16
 *            weights, the layer in use and the next, prefetched, + one slot of full gradients
 *            before their reduce-scatter), bpp = 16 B/param (12 with bf16 moments);
 *   --offload-optimizer: device 2a per param (weight, grad) + slots x bucket x 16 B of staging,
 *            host 4 + 2 x (4 | 2) per param (master, m, v).
 * Expert dispatch: ep > 1: fm_moe_ep_bound_bytes (the capped strided chunks: R_max = ep c
 *   min(k, E/ep) rows per direction whatever the router does); ep = 1: the one-rank operator's.
 * Vocabulary: W > 1: the Ring-DTP bound fm_linear_ce_ring_bound_bytes_a over P = W ranks (AUTO
 *   mode for n_max = N_loc) + the final norm's N_loc x H and two [N_loc] fp32 vectors.
 * Communication buffers (new set): sp > 1: Ulysses' head-sharded full-sequence q, o and their
 *   gradients [B T, heads/sp x hd] and k, v and theirs [B T, kv_loc x hd] (8 tensors, live
 *   together in a layer's backward), + one all-to-all staging buffer [N_loc, heads x hd];
 *   W > 1: the ZeRO-3 reduce-scatter's output, one layer's shard r(ceil(U / W) a);
 *   + FM_MESH_NCCL_GROUP_BYTES per process group of more than one rank (nominal: NCCL's own
 *   FIFOs; not measured).
 */
#ifndef FM_MESH_BOUND_H
#define FM_MESH_BOUND_H

#include "fm_calib.h"
#include "fm_plan.h"
#include "fm_project.h"

/* NCCL's own buffers per communicator, nominal: NCCL_BUFFSIZE (4 MiB) x 8 channels x send and
 * receive. Not measured: the run measures its communicators at start. */
#define FM_MESH_NCCL_GROUP_BYTES ((size_t)64 << 20)

/* Key/value heads one sp rank holds: num_key_value_heads / sp when sp divides it, else 1 (a head
 * replicated on the sp / nkv ranks whose query heads use it). sp >= 1. */
int64_t fm_mesh_kv_heads(const fm_config *cfg, int64_t sp);

/* Parameters of the experts (L x E x 3 x H x I) and of the largest ZeRO-3 gather unit (one
 * layer's non-expert parameters, or the embedding's V x H). */
int64_t fm_mesh_expert_params(const fm_config *cfg);
int64_t fm_mesh_gather_unit(const fm_config *cfg);

/* Overwrites the mesh rank's live sets in *p (computed by fm_plan_compute from r, r->mesh.on):
 * model state, expert dispatch, vocabulary, and the communication buffers (p->comm_bytes), with
 * their formulas; host_bytes and host_optimizer_bytes per rank; n_params_rank. Not totalled
 * here. r->mesh must have passed fm_mesh_check. Never fails. */
void fm_mesh_plan_sets(const fm_plan_req *r, fm_plan *p);

/* Seconds of collectives over a group of g ranks whose members span `span` consecutive ranks
 * (g for a contiguous group, the world for a strided one), gpus_per_node ranks per node, at c's
 * links (intra_node_bw within a node, inter_node_bw across; B/s per GPU per direction). Ring
 * algorithms (all-gather, reduce-scatter: (g-1)/g of `bytes`, the gathered or the scattered
 * whole; all-reduce twice that) run at the slowest link they cross; an all-to-all of `bytes`
 * sent per rank moves bytes/g to each peer, on-node and off-node peers at once, the slower
 * side deciding. Latency is not counted (nominal links; see fm_project.h). g <= 1: 0. */
double fm_mesh_ring_s(double bytes, int64_t g, int64_t span, int64_t gpus_per_node, const fm_calib *c);
double fm_mesh_all_to_all_s(double bytes, int64_t g, int64_t span, int64_t gpus_per_node, const fm_calib *c);

/* One layer's compute seconds by part, per micro-batch, as fm_project computed them; head: the
 * LM head and loss of the micro-batch. */
typedef struct fm_mesh_layer_times {
    double att_f, att_b, dense_f, dense_b, exp_f, exp_b, mem_f, head;
} fm_mesh_layer_times;

/* The mesh's collectives per step, less what compute hides (fm_project.h states the model):
 * sets o->sec[FM_PROJ_ZERO3 .. FM_PROJ_RING] for the request r (mesh on), its plan p and the
 * layer times t at c's links. Called by fm_project before it sums the phases. Never fails. */
void fm_mesh_project_comm(const fm_plan_req *r, const fm_plan *p, const fm_calib *c, const fm_mesh_layer_times *t,
                          fm_projection *o);

#endif
