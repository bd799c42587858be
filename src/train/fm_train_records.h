/* The run-level records of a training run in metrics.jsonl (beyond fm_train_internal.h's step
 * record): the header record that opens each invocation, the expert load and MFU of each step,
 * and the summary record that closes it. Written by fm_train_records.c (the step record itself
 * by fm_train_metrics.c), kept by the loop (fm_train_loop.c).
 *
 * metrics.jsonl, one JSON object per line, each with "type":
 *   "header"   once per invocation, first: flatmoe version and commit, config, every option,
 *              the plan, seed, host; "step" is the step it starts after (0, or the resume point),
 *              so a later resume keeps it (fm_train_truncate_metrics keeps "step" <= the
 *              checkpoint's).
 *   "step"     one per optimizer step (the fields the README lists).
 *   "summary"  once per invocation, last: validation losses, tokens, steps, time, mean tokens/s,
 *              each live set's high-water mark; it has no "step" field, so a resume drops it
 *              with the steps it no longer covers and writes its own. */
#ifndef FM_TRAIN_RECORDS_H
#define FM_TRAIN_RECORDS_H

#include "fm_train_internal.h"

typedef struct fm_run_records {
    /* expert load of the current step: tokens per expert per layer, summed over its
     * micro-batches' forwards (fm_moe_ws.counts, set by the loop's schedule hook) */
    int64_t *counts;         /* [L][E] host */
    double *load;            /* [L]: max over experts / mean over experts of counts */
    float *bias_tmp;         /* [E]: aux-loss-free balancing's host copy of one layer's bias (fm_router_bias.h) */
    int64_t L, E;
    /* MFU */
    double peak_flops;       /* FLOP/s; 0: unknown (mfu null) */
    char device[128];        /* the GPU's name, "" on the CPU */
    int threads;             /* CPU threads of the run (resolved) */
    int threads_busy;        /* cores another process kept busy when the default was chosen (-1: given) */
    /* the invocation's totals, for the summary */
    int64_t first_step, last_step, steps_run, tokens_run;
    double step_s_sum;       /* seconds inside steps (no evaluation, no saving) */
    double elapsed_s;
    double final_val, best_val; /* NAN: none */
    int64_t best_val_step;
    int stopped_by;          /* the signal that stopped the run, 0: none */
    char last_ckpt[4200];    /* the last checkpoint written by this invocation, "" none */
} fm_run_records;

/* Writes the header record (no allocation concerns: once, before step 1). resume_step: the
 * step the run continues after (0 fresh). Errors: FM_ERR_NOMEM (building the JSON), FM_ERR_IO. */
fm_status fm_train_metrics_header(run *r, const fm_run_records *rec, int64_t resume_step);

/* Adds "expert_load_max_mean" [L] (always), "expert_counts" [L][E] (when full) and "mfu" (null
 * when rec->peak_flops is 0) to the open step record of a step that took step_s seconds. */
void fm_train_metrics_step_extra(run *r, const fm_run_records *rec, double step_s, int64_t tokens_per_step,
                                 bool full);

/* Writes the summary record and prints the summary line (unless --quiet). Each live set's bound
 * and measured high-water mark (fm_arena_touched, as --report-memory measures them) go into
 * "memory". */
void fm_train_metrics_summary(run *r, const fm_run_records *rec);

#endif
