/* What the trainer's files share (not a public API): the state of one training run, the
 * state.json record, and the functions of each part:
 *   fm_train_opts.c      defaults and validation of fm_train_opts
 *   fm_train_setup.c     resume point, config, data, plan and allocation of a run
 *   fm_train_step.c      one optimizer step (fm_train_step.h)
 *   fm_train_loop.c      fm_train: the loop, evaluation, save and exit cadence
 *   fm_train_metrics.c   what a run prints and writes to metrics.jsonl
 *   fm_train_ckpt.c      state.json, checkpoints, resume, loading weights for inference
 *   fm_evaluate.c        validation loss
 *   fm_recompute_spec.c  the --recompute spec */
#ifndef FM_TRAIN_INTERNAL_H
#define FM_TRAIN_INTERNAL_H

#include <stdio.h>

#include "../core/fm_log.h"
#include "../core/fm_rng.h"
#include "../data/fm_data.h"
#include "../io/fm_hf_weights.h"
#include "../plan/fm_expert_choice.h"
#include "../plan/fm_plan.h"
#include "../comm/fm_comm.h"
#include "../schedule/fm_sco.h"
#include "fm_offload_adamw.h"
#include "fm_train_ep.h"
#include "fm_train_step.h"
#include "fm_trainer.h"
#include "fm_zero3.h"
#include "fm_train_ckpt_stream.h"
#include "fm_train_data.h"

/* The model's parameter table as the Hugging Face mapping (io/fm_hf_weights.h) reads it; the
 * rows' names point into the model's table. */
typedef struct fm_train_hf {
    fm_hf_table t;
    fm_hf_param *params;     /* [n_tensors] */
    fm_hf_experts *experts;  /* [L] */
    fm_hf_experts *expert_bias; /* [L] gpt_oss's expert biases (fm_hf_table.expert_bias), else NULL */
} fm_train_hf;

/* Builds h from the parameter table pp (a model's m->p, or a table alone: --ep's full one;
 * it must outlive h). Errors: FM_ERR_NOMEM. */
fm_status fm_train_hf_init(fm_train_hf *h, const fm_model_params *pp);
void fm_train_hf_free(fm_train_hf *h);

/* Trainer state saved in state.json. */
typedef struct train_state {
    int64_t step, tokens_seen, opt_step;
    uint64_t data_rng;
    uint64_t seed;
    int64_t seq_len, micro_batch, grad_accum, steps;
    int64_t threads; /* the CPU threads the run trained with (results depend on the count); 0: unknown */
    bool bf16_moments; /* "adam_moments": "bf16" (absent in older checkpoints: fp32) */
    int master_weights; /* "master_weights": fm_master_recipe (absent in older checkpoints: fp32) */
    bool expert_fp8;   /* "expert_precision": "fp8" (absent in older checkpoints: bf16) */
    int64_t dp;        /* "data_parallel": the data-parallel ranks micro_batch was per (absent: 1) */
    double lr, min_lr; /* "schedule": the run's peak and final learning rate (absent: NAN) */
    int64_t warmup;    /* "schedule": its warmup steps (absent: -1) */
    /* ---- packed documents (issue 28): "data_cursor" "pack", "epoch", "document", "position" */
    int pack_mode;     /* FM_PACK_ON / PAD / OFF of the run (absent: 0, older checkpoints: off) */
    int64_t pk_epoch, pk_next, pk_done; /* the packer's cursor after the step (fm_pack.h) */
} train_state;


/* One training run: everything fm_train allocates, released by fm_train_run_free. */
typedef struct run {
    const fm_train_opts *o;
    fm_config cfg;
    char *config_json;
    fm_backend be;
    bool be_ok;
    fm_model m;
    bool model_ok;
    fm_adamw opt;                   /* AdamW's hyper-parameters and step (the streamed AdamW's too) */
    fm_offload_adamw oopt;          /* --offload-optimizer: the streamed AdamW over opt */
    void *opt_self;                 /* the optimizer's self: &opt or &oopt */
    fm_dataset train_all, train, val, val_own;
    fm_train_hf hf;
    fm_named_tensor *named;         /* [4 * n_tensors]: the tensors of a checkpoint */
    char (*names)[FM_HF_NAME_CAP];  /* [4 * n_tensors] */
    FILE *metrics;
    fm_plan plan;
    bool *rc;
    fm_step_ws step;                /* the step's schedule and pinned results (fm_train_step.h) */
    fm_param_store ps;              /* the model-state live set: weights, grads, master, optimizer state */
    const fm_optimizer_ops *optim;  /* the optimizer's interface over r->opt */
    fm_comm world;                  /* the run's ranks (fm_comm_world_create over the backend: mpi with
                                       several ranks, self with one); with sp = ep = 1 it is also
                                       the dp group and m->mesh.comm */
    int rank, n_ranks;              /* this rank of the world (the launcher's); only rank 0 writes
                                       metrics.jsonl, step lines and checkpoint files */
    fm_backend_opts backend_opts;   /* what the backend was created with (metrics.jsonl "backend") */
    fm_expert_choice expert_choice; /* the expert GEMMs' form and why (plan/fm_expert_choice.h; the
                                       metrics header's "expert_gemm") */
    bool world_ok;
    fm_comm_group mesh;             /* --sp > 1: the dp x sp mesh over world (its sp group is
                                       m->mesh.sp_comm); gradients, losses and router statistics still
                                       reduce over the whole world */
    bool mesh_ok;
    int sp;                         /* the sequence-parallel degree (1: none) */
    char tokenizer_dir[4096];       /* the last checkpoint written with a tokenizer (copy_tokenizer) */
    fm_sco sco;                     /* checkpoint offload (--offload-boundaries; n_off 0: off, no hook) */
    bool zero3;                     /* --zero 3 over several ranks: z3 and ps are the shards (fm_zero3.h) */
    fm_zero3 z3;
    fm_schedule eval_sched;         /* ZeRO-3: evaluation's forwards with z3's gathering hook */
    fm_train_ep ep;                 /* expert parallelism (--ep; ep.ep 1 or 0: off) */
    fm_train_hf ep_hf;              /* --ep: the full table (ep.full) as the checkpoint writer names it */
    fm_ckpt_stage cst;              /* the checkpoint staging (fm_train_ckpt_stream.h), from fm_train_ckpt_init */
    /* ---- documents, epochs, TensorBoard (issue 28) ---- */
    fm_train_opts *o_rw;            /* o itself, writable: --epochs sets steps once the data is loaded */
    fm_train_data data;             /* the data draw: windows or packed documents (fm_train_data.h) */
    struct fm_tensorboard *tb;      /* --tensorboard: the event file writer (fm_tensorboard.h), or NULL */
} run;

/* Live set i's measured high-water mark in bytes (the parameter store's arena for model state,
 * the model's arena otherwise), as --report-memory, metrics.jsonl and run.json report it. */
static inline size_t fm_run_live_high(const run *r, int i) {
    return i == FM_LIVE_MODEL_STATE ? r->ps.arena.high : fm_arena_touched(&r->m.a.arena[i]);
}

/* Pinned host bytes in use: the offloaded boundaries and the streamed optimizer's state. */
static inline size_t fm_run_host_pinned_used(const run *r) { return r->sco.host.high + r->oopt.host.high; }

/* The arena of live set i: the parameter store's for the model state, the model's otherwise. */
static inline const fm_arena *fm_train_arena(const run *r, int i) {
    return i == FM_LIVE_MODEL_STATE ? &r->ps.arena : &r->m.a.arena[i];
}

/* ---- fm_train_ckpt_stream.c (fm_train_ckpt_stream.h: the design and the bound) ---- */

/* Allocates r->cst (8 C_e bytes and the owner tables; several ranks: its host world, and a
 * collective of the world that learns who holds each tensor). After the model, store and
 * ZeRO-3 layout exist. Errors: FM_ERR_NOMEM, the communicator's. */
fm_status fm_ckpt_stage_init(run *r);
void fm_ckpt_stage_free(run *r);
/* Whether a save streams through the staging (several ranks, ZeRO-3, --ep, a device backend or
 * a bf16 state); false: one rank's fp32 host buffers, named in place. */
bool fm_ckpt_stream_wanted(const run *r, const fm_optim_state *os, int nos);
/* Names the save's states (master twice, then the optimizer's others: *n_slots) with the
 * streaming fetch (r->named [n_slots x n_full]) on every rank: each fetch is a collective whose
 * values land on rank 0 (the writer there, fm_ckpt_stream_serve on the others; or every rank
 * walking the same fetches, as the library's export does). */
fm_status fm_ckpt_stream_prepare(run *r, const fm_optim_state *os, int nos, int *n_slots);
/* Ranks other than 0, while rank 0 writes: send their parts of every piece in file order (a
 * collective with rank 0's writer). Errors: the communicator's. */
fm_status fm_ckpt_stream_serve(run *r, int n_slots);
/* Loads this rank's part of the master (then its fm_act weights) and of every optimizer state
 * from dir/optimizer.safetensors by ranges; verify: each range of the master checked against
 * dir/model.safetensors rounded to its dtype. Errors: FM_ERR_FORMAT (a missing tensor, a shape,
 * a count of a prefix's tensors, a value that differs: naming it), FM_ERR_IO. */
fm_status fm_ckpt_stream_load(run *r, const char *dir, bool verify);
/* ZeRO-3's initial weights (fm_params_init_weights_host's values) drawn range by range into this
 * rank's shard master (padding zero) through the staging, then its fm_act weights. */
fm_status fm_ckpt_stream_init_zero3(run *r, uint64_t seed);
/* fm_train_ckpt.c: whether a value read from a file stored as dtype (fm_st_dtype) equals the
 * master value rounded to it; and how to proceed when model.safetensors disagrees. */
bool fm_train_same_rounded(float master, float stored, int dtype);
#define FM_TRAIN_RESUME_HOW "pass --resume-trust-optimizer to resume from the optimizer's master copy (optimizer.safetensors) " \
    "anyway, or --init-from with that folder and a new --out to start a run from the edited weights, or move the folder " \
    "away to resume from the checkpoint before it"

/* ---- fm_train_opts.c ---- */

/* The checks of the options that need no file: FM_ERR_ARG naming the flag. */
fm_status fm_train_opts_check(const fm_train_opts *o);

/* ---- fm_train_setup.c ---- */

/* Checks the options, finds the resume point (ckpt: the checkpoint folder, "" for a fresh run),
 * loads config and data, makes the plan, allocates backend, model and optimizer, and loads the
 * checkpoint or initializes the weights; fills *ts and *data_rng for the first step, opens
 * metrics.jsonl and prints the run's header. Errors: those of each part, message set. */
fm_status fm_train_setup(run *r, train_state *ts, fm_rng *data_rng);
void fm_train_run_free(run *r);
/* The same path for the library session (include/flatmoe.h, src/capi/): the options' checks, the
 * config (ckpt: a checkpoint folder, whose config, weights, optimizer and state are loaded; "" for
 * --init-from or --config), the plan fitted to the budgets before anything is allocated, then
 * backend, model, optimizer and weights; no data, no run folder, no metrics.jsonl, one rank.
 * Errors: those of each part (the plan's refusals as fm_train_setup gives them); FM_ERR_ARG under a
 * launcher of several ranks. */
fm_status fm_train_setup_session(run *r, const char *ckpt, train_state *ts);

/* ---- fm_train_metrics.c ---- */

/* The header lines of a run: model, data, plan and FLOPs per token. tokens_per_step: one
 * data-parallel rank's (micro-batch x seq-len x grad-accum); the line gives every rank's. */
void fm_train_print_header(const run *r, const fm_plan_req *req, int64_t tokens_per_step);
/* One report line built in pieces before it goes to the logging callback whole (core/fm_log.h:
 * a line per call). fm_line_add appends printf-formatted text; text past the buffer is cut. */
typedef struct fm_line {
    char buf[8192];
    size_t n;
} fm_line;
void fm_line_add(fm_line *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* What one step measured, for its lines and its metrics.jsonl record. */
typedef struct fm_step_report {
    int64_t step;
    double ce, aux, z, lr, gnorm;
    double tok_s, step_s, elapsed, eta;
    double val;                    /* NAN: no validation this step */
    const double *phase_ms;        /* [FM_PHASE_COUNT], or NULL: no profile */
    uint64_t host_syncs;
    int64_t tokens_seen;
    bool first;                    /* the first step of this invocation: the record names the backend options */
    int64_t epoch;                 /* 1-based epoch of the step (packed data or --epochs), 0: none shown */
} fm_step_report;

/* The step line (and the profile line when phase_ms is set) on stdout. */
void fm_train_print_step(const run *r, const fm_step_report *s);

/* Opens the step's metrics.jsonl record (no closing brace: fm_train_metrics_memory may add to it,
 * fm_train_metrics_end closes and flushes it). */
void fm_train_metrics_begin(run *r, const fm_step_report *s);

/* Adds every live set's bound and high-water mark (and the device's memory) to the open record,
 * and prints the memory report unless --quiet. */
void fm_train_metrics_memory(run *r);
void fm_train_metrics_end(run *r);

/* ---- fm_train_ckpt.c ---- */

/* Reads state.json at path into *s. Every field is range-checked (fm_train_ckpt.c: step,
 * optimizer_step, tokens_seen, steps and schedule.warmup in [0, 2^53]; seq_len in [1, 2^30];
 * micro_batch, grad_accum and data_parallel in [1, 2^20]; threads in [0, 10^6]; schedule.lr in
 * (0, 1e6], min_lr in [0, 1e6]; data_rng_state and seed unsigned 64-bit digit strings), a field
 * missing from older checkpoints taking its "absent" value (train_state's comments).
 * Errors: FM_ERR_IO (unreadable); FM_ERR_FORMAT naming the file, the field, the value found and
 * the range (or the missing fields). */
fm_status fm_train_state_read(const char *path, train_state *s);

/* Keeps only the metrics lines of steps <= last_step (a resumed run rewrites what came after
 * its checkpoint; -1 keeps none). A missing file is not an error. Errors: FM_ERR_NOMEM, FM_ERR_IO. */
fm_status fm_train_truncate_metrics(const char *path, int64_t last_step);

/* Allocates the run's tables for saving and loading checkpoints (names, the Hugging Face table
 * of r->m, the checkpoint staging r->cst: fm_ckpt_stage_init, a collective of the world with
 * several ranks; released by fm_train_run_free). Errors: FM_ERR_NOMEM, the communicator's. */
fm_status fm_train_ckpt_init(run *r);

/* Writes the checkpoint of ts->step into the run folder (weights, master, moments, config,
 * state) and prints its folder unless --quiet. Errors: those of fm_ckpt_write. */
fm_status fm_train_save_checkpoint(run *r, const train_state *ts);

/* Reads the checkpoint folder dir into the run's model and optimizer and its state into *ts.
 * Errors: FM_ERR_IO/FORMAT naming the file. */
fm_status fm_train_load_checkpoint(run *r, const char *dir, train_state *ts);

#endif
