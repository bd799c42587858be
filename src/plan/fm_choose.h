/* The chooser (DESIGN.md §2, docs/plan.md "The chooser"): fits two budgets, device memory and
 * pinned host memory, and among the plans that fit takes the one of least projected step time
 * (fm_project.h). The knobs it picks, unless the user fixed them: the recomputed layer count
 * (the first n layers) and whether they keep their attention, the offloaded checkpoint
 * boundaries, the optimizer's placement (on device, or streamed from pinned host memory), the MoE
 * chunk, and plain logits or the linear cross-entropy. --bf16-moments and --master-weights (they
 * change the numbers), the shape and the rank count are never chosen (fm_plan_recipe_note names a
 * faster recipe, with its projected time); when nothing fits, the advice names each of
 * them, and each freed knob, that would make it fit, each one checked by planning with it.
 */
#ifndef FM_CHOOSE_H
#define FM_CHOOSE_H

#include "fm_calib.h"
#include "fm_plan.h"
#include "fm_project.h"

#define FM_HOST_BUDGET_UNLIMITED SIZE_MAX

typedef struct fm_choose_opts {
    size_t budget;            /* device bytes for the planned live sets; 0: none (nothing is
                                 chosen: the plan is the flags' as given) */
    const char *budget_name;  /* for messages, e.g. "--mem-budget" */
    size_t host_budget;       /* pinned host bytes the plan may use; FM_HOST_BUDGET_UNLIMITED */
    const char *host_budget_name;
    const fm_calib *calib;    /* rates for the projection (required) */
    /* the knobs the user gave (fixed as in req); the others are chosen */
    bool fix_recompute, fix_keep_attention, fix_offload_boundaries, fix_offload_optimizer, fix_moe_chunk, fix_ce;
    bool fix_offload_fraction; /* --optimizer-offload-fraction given: req->offload_fraction as it is */
} fm_choose_opts;

/* Plans `req` within the budgets. With a device budget, the free knobs are chosen (a search over
 * recompute 0, 2..L with and without keep-attention, the fewest offloaded boundaries that fit,
 * the optimizer on device or streamed (streamed: the fewest streamed buckets that fit, the least
 * --optimizer-offload-fraction, searched with the boundaries offloaded at their most when free and
 * the boundaries' count then searched at it; never for a mesh), MoE chunks unchunked, N, N/2, ... down to
 * FM_PLAN_MIN_CHUNK (and, only when nothing fits so, FM_PLAN_MIN_CHUNK/2 ... 1), plain or linear
 * CE) for the least projected step time, and written into req
 * (recompute and keep-attention point into rc_storage [2L]). Without one, req is planned as given
 * and only the host budget is checked. Then, with req->expert_fp8_cache_auto, the FP8 weight cache
 * is turned on (req->layout.expert_fp8_cache) if that plan still fits with it. *out gets the plan, *proj
 * its projection.
 * Errors: FM_ERR_NOMEM when nothing fits: the message names the budget, the need, the largest
 * live set, and the advice (fm_plan_advise); req then holds the smallest plan tried. */
fm_status fm_plan_fit(fm_plan_req *req, const fm_choose_opts *o, bool *rc_storage, fm_plan *out, fm_projection *proj);

/* The knobs that would make `req` (as the user gave it; the free knobs per o) fit, each checked
 * by fitting again with it alone: the fixed chooser knobs freed, --bf16-moments, --fp8-weight-cache
 * dropped, the streamed optimizer, a smaller --micro-batch or --seq-len (the largest that fits), and the rank count
 * ZeRO-3 would need (text only: multi-rank training is not built yet). Writes a sentence into
 * buf ("nothing short of a larger budget fits" when none). Never fails. */
void fm_plan_advise(const fm_plan_req *req, const fm_choose_opts *o, char *buf, size_t n);

/* A note when a state recipe of fewer bytes per parameter (--master-weights bf16-kahan | bf16-sr,
 * --bf16-moments; DESIGN.md §5: it changes the numerics, so the chooser never picks it) fits the
 * budgets and projects a step faster than step_s (by more than 1%), each planned with the chooser
 * (the streamed optimizer off for a bf16 recipe) and named with its projected step time. buf gets
 * "" when none is (or for a mesh, --ep or ZeRO-3, where the recipes do not run yet). */
void fm_plan_recipe_note(const fm_plan_req *req, const fm_choose_opts *o, double step_s, char *buf, size_t n);

/* The default --host-mem-budget of this host: MemTotal less a reserve of max(4 GiB, MemTotal / 10)
 * (the operating system and what the estimate misses) less the memory other processes hold (their
 * anonymous resident memory, pinned buffers included, and the shared memory: plan/fm_host_mem.h).
 * Not MemAvailable: that lags a release of pinned memory by another process for a minute or more
 * (issue 25: 35 GiB right after a run freed 79 GB, 124 GiB a minute later). RLIMIT_MEMLOCK is not
 * applied: cudaHostAlloc's pinned memory is not charged to it, and the CPU build's "pinned" buffers
 * are ordinary memory. 0 when /proc/meminfo cannot be read. A refusal over the host budget names
 * what holds the memory (fm_host_mem_describe). */
size_t fm_host_mem_budget_default(void);

#endif
