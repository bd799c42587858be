/* The model's mesh (issue 24's model split; DESIGN.md §3 model/): the communicators a model's
 * forward and backward reduce over or exchange through, with their degrees and this rank's
 * index (model/fm_model.h: m->mesh). The caller (train/, the tests) sets the communicators
 * before fm_model_layout, which checks their sizes against fm_layout_opts and fills in the
 * degrees and ranks. All NULL (a zeroed mesh): one rank, no parallelism. Not the planner's
 * fm_mesh (plan/fm_mesh.h: the degrees a run is launched with). */
#ifndef FM_MODEL_MESH_H
#define FM_MODEL_MESH_H

#include "../bounded/fm_moe_llep.h"
#include "../comm/fm_comm.h"

typedef struct fm_model_mesh {
    const fm_comm *comm;        /* the ranks that see this batch's tokens (dp x sp), backend memory:
                                   the valid-target count, the loss sums and the router statistics
                                   are reduced over it; NULL: this rank alone (tests, inference) */
    /* Ulysses sequence parallelism (fm_attn_sp.h; fm_layout_opts.sp > 1): this rank holds
     * positions [sp_rank T, (sp_rank + 1) T) of each of the B sequences (T the local length, the
     * full one sp x T); RoPE is by global position (the tables start at sp_rank T) and attention
     * runs through sp_attn's all-to-alls over sp_comm. Everything else runs on the local tokens. */
    const fm_comm *sp_comm;     /* the sp group over the backend's memory; set before fm_model_layout
                                   with opts->sp > 1 (NULL: no sequence parallelism) */
    int sp, sp_rank;            /* degree (1: none) and this rank's index in the group */
    /* Ring-DTP (--vocab-parallel ring, README "Many ranks"; bounded/fm_linear_ce_ring.h): with
     * vocab_P > 1 the linear cross-entropy runs as fm_linear_ce_ring over vocab_comm (P ranks,
     * this one vocab_rank): this rank's N tokens meet every rank's V/P head shard; it reads and
     * writes only its own shard's rows [vocab_first, vocab_first + vocab_rows) of w.lm_head and
     * g.lm_head (fm_lce_ring_shard), the rows of the others' gradient stay as they were (zero
     * after the step's zeroing: the trainer's all-reduce of the head gradient sums the shards),
     * and the loss sums it writes are already the group's (not reduced again over m->comm).
     * vocab_P 0 or 1: the one-rank fm_linear_ce with the whole head. */
    const fm_comm *vocab_comm;  /* the ring's ranks (the world), backend memory; set before the layout */
    int vocab_P, vocab_rank;
    int64_t vocab_first, vocab_rows;

    /* Expert parallelism (--ep, README "Many ranks"; bounded/fm_moe_ep.h): with p.ep > 1 the
     * parameter table holds this rank's E_loc = E/ep experts of every layer (fm_params.h) and the
     * MoE block runs fm_moe_ep_forward / backward over moe_ep_comm (a group of p.ep ranks, this
     * one p.ep_rank) with the working set a.moe_ep_ws instead of the local dispatch. */
    const fm_comm *moe_ep_comm; /* the ep group (backend memory); NULL: the local MoE */
    fm_llep_opts moe_llep;      /* least-loaded placement (--llep); .on false: plain EP */
} fm_model_mesh;

#endif
