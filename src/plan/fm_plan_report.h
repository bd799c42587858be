/* `flatmoe plan`'s report: the memory table (bytes, GiB, formula per live set), the host bytes
 * against the host budget, the verdict, the FLOPs, and the projected step time by phase with
 * tokens/s and MFU; as text or as one JSON object. */
#ifndef FM_PLAN_REPORT_H
#define FM_PLAN_REPORT_H

#include <stdio.h>

#include "fm_calib.h"
#include "fm_choose.h"
#include "fm_expert_choice.h"
#include "fm_plan.h"
#include "fm_project.h"

typedef struct fm_plan_report {
    size_t budget;            /* device bytes for the planned sets; 0: no verdict */
    const char *budget_what;  /* how the budget was formed, printed after it (may be NULL) */
    size_t device_mem;        /* --device-mem as given (0: none) */
    size_t context_bytes;     /* the CUDA context and libraries, taken off device_mem (0: none) */
    size_t host_budget;       /* pinned host bytes allowed; FM_HOST_BUDGET_UNLIMITED: none */
    const fm_projection *proj; /* may be NULL: no time lines */
    const fm_calib *calib;    /* the projection's table (its source and peak are printed) */
    const char *config_path;  /* mesh plans: the --config of the printed launch line (NULL: C) */
    const fm_expert_choice *expert; /* CUDA plans: the expert GEMMs' form (fm_expert_choice.h), printed
                                       as its line after the projection and as "expert_gemm" in the
                                       JSON; NULL: neither */
    const char *exe;          /* the launch line's binary (NULL: flatmoe, or flatmoe-cuda for a CUDA plan) */
    const char *data;         /* the launch line's --data files (NULL: DATA) */
    const char *mpirun;       /* the launcher of a launch line over several ranks, as the caller
                                 knows it ("mpirun", or "mpirun --allow-run-as-root" for root;
                                 NULL: "mpirun") */
    /* The sharded checkpoints' host staging (train/fm_train_ckpt_stream.h, whose bound the caller
     * asks: plan/ includes nothing of train/): bytes per rank, the piece size in elements, and the
     * largest tensor's elements, for its line (all 0: no line, and "checkpoint_staging_bytes" 0) */
    size_t ckpt_stage_bytes;
    int64_t ckpt_chunk_elems, ckpt_max_numel;
    /* plan --library: a libflatmoe session's host scratch (capi/flatmoe_host.c's bound, which the
     * caller asks) and the KV cache's share of it; 0: no line, and no "library_host_bytes" */
    size_t library_host_bytes, library_kv_bytes;
} fm_plan_report;

/* The trainer's flags that reproduce plan p of request r ("--seq-len ... --recompute ..."; a mesh
 * adds --zero 3 and its degrees), into buf[cap] (truncated at cap). Never fails. */
/* The state recipe's bytes per parameter on one rank (DESIGN.md §2 "model state"): weights and
 * grads (2 act_bytes of the plan's target), the recipe's master or Kahan buffer
 * (fm_master_extra_bytes), Adam m and v (8, or 4 with bf16 moments): 16, 14, 12, 10 or 8 on a
 * bf16 target. */
int fm_plan_state_bytes_per_param(const fm_plan_req *r);

void fm_plan_train_flags(const fm_plan_req *r, const fm_plan *p, char *buf, size_t cap);

/* The streamed optimizer's offload fraction of plan p, s / nb (offload_streamed_buckets of
 * offload_buckets), as text of the fewest significant digits (4 to 17) that give s buckets again
 * as --optimizer-offload-fraction (fm_offload_streamed_buckets), into buf[n]. */
void fm_plan_offload_fraction_text(const fm_plan *p, char *buf, size_t n);

/* Prints the report as text. A mesh plan (req->mesh.on) adds its degrees, the communication
 * buffers' row, the collectives' phases and a copy-paste launch line (mpirun -np W ... --zero 3
 * --dp --ep --sp); a one-rank plan its launch line (exe train --config --data and the train
 * flags). A plan that does not fit its budgets prints neither flags nor launch line. */
void fm_plan_print(const fm_plan_req *req, const fm_plan *p, const fm_plan_report *x, FILE *f);
/* The same as one JSON object (one line); a mesh plan adds "mesh" (degrees), the
 * "communication buffers" live set and the collectives' phases. */
void fm_plan_print_json(const fm_plan_req *req, const fm_plan *p, const fm_plan_report *x, FILE *f);

#endif
