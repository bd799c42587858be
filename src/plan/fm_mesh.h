/* Planning a mesh (DESIGN.md §6, issue 11 item 6): the degrees dp, ep, sp of `flatmoe plan
 * --world N` (or given with --dp/--ep/--sp), checked against the model, and the chooser that fixes
 * each degree by its own binding constraint instead of sweeping every combination:
 *   ep  by expert memory: the smallest ep dividing num_experts and the world for which some plan
 *       fits at the largest valid sp (the activations as small as the mesh can make them, so
 *       what is left to fit is the model state, which ep shrinks: fm_mesh_bound.h);
 *   sp  only when the local sequence does not fit: the smallest sp (dividing the world, the
 *       query heads and the sequence; key/value heads divisible by it, or dividing it) that
 *       fits at that ep (1 when the whole sequence fits on a rank);
 *   dp  the rest: world / sp.
 * Around that point the few candidates {ep, the next larger ep} x {sp, the next larger sp} are
 * each planned per rank with the single-rank chooser (fm_choose.h: recompute, offload, chunks),
 * and the fastest that fits is chosen: the most projected tokens/s (not the least step time: a
 * step holds dp x micro-batch sequences, so candidates with another dp have other steps). Per-rank bounds and collective
 * times: fm_mesh_bound.h.
 */
#ifndef FM_MESH_H
#define FM_MESH_H

#include <stdio.h>

#include "fm_choose.h"
#include "fm_mesh_bound.h"

#define FM_MESH_MAX_CANDS 8

/* The mesh flags as given (0: not given). */
typedef struct fm_mesh_flags {
    int64_t world;         /* --world: ranks (GPUs) */
    int64_t dp, ep, sp;    /* --dp, --ep, --sp */
    int64_t gpus_per_node; /* --gpus-per-node (0: 8) */
} fm_mesh_flags;

/* Checks degrees against the model and the sequence: dp, ep, sp >= 1; ep divides num_experts and
 * dp x sp; sp divides num_attention_heads and seq_len; num_key_value_heads divisible by sp or
 * dividing it (replicated k/v heads). Errors: FM_ERR_ARG naming the flag, the value expected, the
 * one found and the fix. */
fm_status fm_mesh_check(const fm_config *cfg, int64_t T, const fm_mesh_dims *m);

/* The mesh of the flags: with --world, --dp and --sp (given) must make dp x sp = world and fix
 * each other (--dp alone fixes sp = world / dp); a degree not given is left to the chooser
 * (*choose_ep, *choose_sp true, the field 1 meanwhile). Without --world: world = dp x sp (each
 * default 1), ep default 1, nothing chosen. m->on is set. Errors: FM_ERR_ARG (dp x sp != world,
 * dp not dividing world, a degree < 1, --gpus-per-node < 1) naming flag, expected, found and fix;
 * those of fm_mesh_check for a mesh given whole. */
fm_status fm_mesh_from_flags(const fm_config *cfg, int64_t T, const fm_mesh_flags *f, fm_mesh_dims *m, bool *choose_ep,
                             bool *choose_sp);

/* One candidate mesh, planned per rank by the single-rank chooser. */
typedef struct fm_mesh_cand {
    fm_mesh_dims m;
    bool fits;
    fm_plan plan;
    fm_projection proj;
} fm_mesh_cand;

typedef struct fm_mesh_choice {
    int64_t world;
    int64_t ep0, sp0;   /* the binding-constraint point (0: not found) */
    bool chose_ep, chose_sp;
    int n;              /* candidates planned */
    int best;           /* the chosen one; -1: none fits */
    fm_mesh_cand cand[FM_MESH_MAX_CANDS];
} fm_mesh_choice;

/* Chooses the free degrees of req->mesh (dp x sp = world, gpus_per_node set; choose_ep /
 * choose_sp say which are free) as this header says, planning each point with fm_plan_fit(req, o,
 * rc) (rc: the recompute tables' storage, [2L]); o->budget must be > 0 when a degree is free. On
 * return req holds the chosen candidate (its mesh and the knobs fm_plan_fit picked), *out every
 * candidate planned. Errors: FM_ERR_NOMEM when no mesh of the world fits (the message names the
 * largest ep and sp tried and fm_plan_fit's verdict at that point; req holds it); FM_ERR_ARG
 * when the world admits no valid ep or sp (e.g. world 6 for 8 experts), naming it. */
fm_status fm_mesh_choose(fm_plan_req *req, const fm_choose_opts *o, bool *rc, bool choose_ep, bool choose_sp,
                         fm_mesh_choice *out);

/* Prints the candidates (degrees, per-rank device and host GiB, fits, projected step, tokens/s,
 * MFU) and the choice, for `flatmoe plan`. */
void fm_mesh_print_choice(const fm_mesh_choice *ch, FILE *f);

#endif
