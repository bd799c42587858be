/* The training loop (DESIGN.md §4): micro-batches with gradient accumulation, global-norm
 * clipping, AdamW with warmup + cosine schedule, evaluation, checkpoints and exact resume,
 * one metrics line per step. Also the checkpoint loading shared by `sample` and `eval`.
 * The parts are in src/train/fm_train_*.c (listed in fm_train_internal.h); one step alone is
 * fm_train_step (fm_train_step.h). */
#ifndef FM_TRAINER_H
#define FM_TRAINER_H
#include "../core/fm_test_hooks.h"
#include "fm_threads.h"
#include "../model/fm_model.h"
#include "fm_optim.h"
#include "fm_param_store.h"

typedef struct fm_train_opts {
    const char *config_path;      /* --config (may be NULL with --resume: taken from the checkpoint) */
    const char *const *data;      /* --data files */
    int n_data;
    const char *const *val_data;  /* --val-data files (NULL: hold out val_fraction of --data) */
    int n_val_data;
    double val_fraction;          /* --val-fraction, default 0.1 */
    int64_t seq_len, micro_batch, grad_accum;
    int64_t steps;                /* total optimizer steps; 0 with resume: the checkpoint's (else 1000) */
    double lr, min_lr;
    int64_t warmup;
    double weight_decay, grad_clip, beta1, beta2, adam_eps;
    uint64_t seed;
    int threads;
    const char *out_dir;
    bool resume;
    int64_t eval_every, eval_batches, log_every;
    int64_t save_every;           /* --save-every: a checkpoint every N steps (1000; 0: no step cadence) */
    double save_every_minutes;    /* --save-every-minutes: a checkpoint when M minutes of wall time have
                                     passed since the last one (or the start), whichever of the two comes
                                     first (30; 0: off). The last step always saves; --no-checkpoint none */
    int64_t expert_counts_every;  /* --expert-counts-every: the full [L][E] tokens-per-expert counts in
                                     the metrics record every N steps (100; 0: never); the per-layer
                                     max/mean is in every step record */
    double moe_router_bias_update_rate; /* --moe-router-bias-update-rate: aux-loss-free balancing's rate
                                     (train/fm_router_bias.h; 0: the bias stays as loaded) */
    double moe_seq_aux_loss_coeff; /* --moe-seq-aux-loss-coeff: alpha of the sigmoid router's sequence-
                                     wise balance loss (model/fm_router.h seq_aux_coef; 0: off) */
    double peak_flops;            /* --peak-flops: the device's peak FLOP/s for "mfu" (0: from the GPU's
                                     name, H100/H200 989e12 bf16 dense; none on the CPU: "mfu" null) */
    int64_t exit_after;           /* stop (and save) after this many steps in this invocation; 0: no */
    const char *recompute;        /* "none", "full" or a comma list of layer ids; NULL: chosen */
    bool no_recompute_keep_attention; /* --no-recompute-keep-attention: recomputed layers never keep their
                                     attention (the chooser may not pick it) */
    bool recompute_keep_attention; /* --recompute-keep-attention: the recomputed layers (given or
                                     chosen) keep their attention output and lse, and their
                                     recompute skips the attention forward (schedule/fm_recompute.h) */
    int64_t moe_chunk_tokens;     /* 0: plain MoE; c: chunks of <= c tokens; -1: chosen */
    int64_t ce_block_tokens, ce_block_vocab; /* -1: chosen; both 0: plain logits; else linear CE */
    size_t mem_budget;            /* --mem-budget bytes; 0: none. With neither --recompute nor
                                     --moe-chunk-tokens nor --ce-block-* the planner chooses
                                     them to fit it. */
    size_t host_mem_budget;       /* --host-mem-budget bytes of pinned host memory (offloaded boundaries,
                                     streamed optimizer); used when host_mem_budget_given, else what
                                     the host can pin (plan/fm_choose.h: fm_host_mem_budget_default) */
    bool host_mem_budget_given;
    bool lr_given, min_lr_given, warmup_given; /* --lr, --min-lr, --warmup given: a --resume keeps
                                                  the run's own schedule (state.json) for the others */
    int64_t att_tile_q, att_tile_kv; /* --attention-tile-q/-kv (0: 64) */
    size_t gpu_workspace;         /* --gpu-workspace: CUDA cuDNN workspace bytes (0: planned) */
    fm_backend_opts backend;      /* the backend's init options (attention path, expert-GEMM strategy,
                                     profiling): the CLI maps the FLATMOE_* variables onto them
                                     (fm_backend_opts_from_env); threads, tiles, head_dim and the
                                     workspace come from the fields above and the plan. Recorded in
                                     metrics.jsonl ("backend") on the first step of each invocation. */
    bool bf16_moments;            /* --bf16-moments: AdamW m and v in bf16 (checkpoints keep fp32) */
    int master_weights;           /* --master-weights: fm_master_recipe (backend/fm_adamw_lowp.h): 0 fp32
                                     master, 1 bf16-kahan, 2 bf16-sr (checkpoints keep fp32) */
    bool expert_fp8;              /* --expert-precision fp8: the expert GEMMs' operands fake-quantized
                                     to blockwise E4M3 (model/fm_experts_fp8.h); false: bf16, the
                                     backend's native precision (fp32 on the CPU) */
    fm_layout_opts layout;        /* the layout knobs the flag table writes straight into the model's
                                     own options (model/fm_acts.h); they travel whole to the plan
                                     request (fm_plan_req.layout) and to fm_model_layout, which adds
                                     the ones the run derives (recompute, chunk cap, mesh, fp8 path).
                                     A new layout knob: a row, a field there, its use and its bound.
                                     Today: expert_fp8_cache, --fp8-weight-cache: with fp8 on E4M3
                                     codes, every layer's expert weight codes kept for the step
                                     (quantized once a step, not at each forward and backward):
                                     (L - 1) x 6 E H I bytes more. With neither it nor
                                     no_fp8_weight_cache, the planner keeps them when its plan still
                                     fits with them (fm_plan_req.expert_fp8_cache_auto) */
    bool no_fp8_weight_cache;     /* --no-fp8-weight-cache: never keep them (quantize at each use);
                                     fm_train refuses either flag with bf16 experts (FM_ERR_ARG), and
                                     layout.expert_fp8_cache where the fast path does not run, naming why */
    bool offload_optimizer;       /* --offload-optimizer: the streamed AdamW (train/fm_offload_adamw.h):
                                     master, m, v in pinned host memory */
    int64_t offload_optimizer_bucket; /* --offload-optimizer-bucket: parameters per bucket (0: 100M,
                                     at most the model's parameter count) */
    int64_t offload_optimizer_slots;  /* --offload-optimizer-slots: device staging slots, [1, 16] (2) */
    double optimizer_offload_fraction; /* --optimizer-offload-fraction F in (0, 1]: the last ceil(F nb)
                                     buckets stream, the first keep their state on the device; -1: not
                                     given (the chooser picks it under a budget, else 1); needs
                                     offload_optimizer (fm_train_opts_check_flags refuses it alone) */
    bool report_memory;           /* --report-memory: measured high-water marks vs the plan */
    bool no_optimizer_overlap;    /* --no-optimizer-overlap: the update runs after the backward and the
                                     step waits for it (train/fm_optim_overlap.h; default: overlapped) */
    bool quiet;                   /* no per-step lines on stdout */
    bool no_checkpoint;           /* --no-checkpoint: write no checkpoint at all (benchmarks) */
    int64_t max_position_embeddings; /* > 0: overrides the config's (RoPE has no hard limit) */
    const char *offload_boundaries; /* --offload-boundaries: NULL/"0" off, N in [0, L], or "all" (= L):
                                     boundaries 0 .. N-1 to pinned host memory (schedule/fm_sco.h) */
    const char *init_from;        /* --init-from DIR: a Hugging Face model folder (config.json and
                                     model.safetensors or model.safetensors.index.json + shards):
                                     the config and the initial weights of a fresh run (optimizer at
                                     step 0); ignored (with a note) when --resume finds a checkpoint */
    bool resume_trust_optimizer;  /* --resume-trust-optimizer: resume from optimizer.safetensors'
                                     master copy even when model.safetensors disagrees with it */
    /* Many ranks (README "Many ranks"): the world is the launcher's (comm/fm_comm.h,
     * fm_comm_world_create); micro_batch is per data-parallel rank. */
    int dp;                       /* --dp: data-parallel degree; 0: the world size W (sp = ep = 1) */
    int zero;                     /* --zero: 0 replicas (gradients all-reduced); 1 ZeRO-1/2: Adam
                                     moments sharded by parameter range over the world's dp x sp
                                     ranks, gradients reduce-scattered to their owner, updated
                                     weights all-gathered; 3 ZeRO-3: weights, gradients, master and
                                     moments sharded by parameter group over the dp x sp ranks (each
                                     rank's experts whole beside --ep), each group gathered just in
                                     time (train/fm_zero3.h) */
    double comm_timeout;          /* --comm-timeout: seconds a collective waits (0: 300) */
    int sp;                       /* --sp: Ulysses sequence-parallel degree, >= 1 (1: off). The world
                                     is dp x sp ranks; the sp ranks of one data-parallel rank read
                                     the same sequences and each keeps a contiguous seq_len/sp slice
                                     of every one (model/fm_attn_sp.h); with --zero 0, 1 or 3 (the
                                     shards over all dp x sp ranks), beside --ep or not (not --zero 1) */
    int comm_kind;                /* --comm: fm_comm_kind (comm/fm_comm.h; 0 auto: self on one rank,
                                     nccl when every rank has its own GPU, else mpi) */
    int comm_check;               /* --comm-check: fm_comm_nccl_check (comm/fm_comm_nccl.h; 0 deferred:
                                     nccl collectives checked at the step's sync points) */
    /* Expert parallelism (train/fm_train_ep.h, bounded/fm_moe_ep.h). */
    int ep;                       /* --ep: expert-parallel degree, >= 1, dividing the world
                                     (dp x sp) and num_experts (1: off) */
    int64_t ep_cap_tokens;        /* --ep-cap-tokens: tokens per source per dispatch chunk; 0: chosen
                                     (--moe-chunk-tokens, or the chooser's chunk under a budget, else
                                     the micro-batch's N: one chunk) */
    bool llep;                    /* --llep: least-loaded expert placement (LLEP) */
    double llep_lambda;           /* --llep-lambda: the imbalance that triggers it (1.3) */
    int64_t llep_min_piece;       /* --llep-min-piece: smallest spilled range of rows (1024) */
    /* Ring-DTP (--vocab-parallel ring; bounded/fm_linear_ce_ring.h, README "Many ranks"): the
     * linear cross-entropy over the world's P = dp x sp ranks, each keeping its own tokens and
     * the head rows fm_lce_ring_shard gives it (V/P of them); the vocabulary live set is the
     * ring's bound. Needs the linear CE (blocks > 0; the defaults when neither --ce-block flag is
     * given). Where the head lives: --zero 0/1 every rank's replica, of which the ring reads and
     * writes only the rank's rows (the others' gradient rows stay zero, so the usual all-reduce or
     * reduce-scatter of the gradients sums the shards: exact); --zero 3 the head group is still
     * gathered whole before the head as without the flag (tied or untied), the ring computes on
     * the rank's rows of the gathered slot and the reduce-scatter sums the shards' gradient rows:
     * the activation memory is the ring's, the head's gather slot is not saved (yet). Beside
     * --sp and --ep alike. One rank: the one-rank linear CE (the same operator at P = 1). */
    int vocab_parallel;           /* FM_VOCAB_PARALLEL_* */
    const char *spec_json;        /* the run spec as a JSON object by flag name (run/fm_run_spec.h:
                                     the flags given or restored), saved as each checkpoint's
                                     state.json "spec" so --resume restores it; NULL: none */
    /* ---- documents, epochs, TensorBoard (issue 28; data/fm_pack.h, train/fm_train_data.h,
     * train/fm_tensorboard.h) ---- */
    int pack;                     /* --pack: FM_PACK_* (auto: on when the training data has a document
                                     index and the run fine-tunes, --init-from; a resume keeps the
                                     run's own) */
    int pack_long;                /* --pack-long: FM_PACK_LONG_* (a document longer than --seq-len) */
    int64_t epochs;               /* --epochs: > 0: passes over the training data, --steps derived from
                                     them; 0: --steps */
    const char *tensorboard;      /* --tensorboard DIR: TensorBoard scalar event files there (NULL: none) */
    fm_test_hooks test_hooks;     /* tests only (core/fm_test_hooks.h; the CLI fills it from FLATMOE_TEST_*):
                                     not a flag, not saved in state.json */
    fm_threads_env threads_env;   /* --threads 0: OMP_NUM_THREADS and the node's rank count, as the CLI
                                     read them (train/fm_threads.h; zeroed: none) */
} fm_train_opts;

/* --pack (the flag table's order): auto, on (whole documents packed into rows), off (windows at
 * random offsets of the token stream), pad (one document per row: packing's plain twin). */
enum { FM_PACK_AUTO = 0, FM_PACK_ON = 1, FM_PACK_OFF = 2, FM_PACK_PAD = 3 };
/* --pack-long: split a document longer than a row into pieces of a row, or refuse the data. */
enum { FM_PACK_LONG_SPLIT = 0, FM_PACK_LONG_REFUSE = 1 };

/* --vocab-parallel: off (every rank projects its tokens on the whole head) or ring (Ring-DTP). */
enum { FM_VOCAB_PARALLEL_OFF = 0, FM_VOCAB_PARALLEL_RING = 1 };

/* Sets every option to its default (the values the CLI's --help names). */
void fm_train_opts_default(fm_train_opts *o);

/* Whom fm_train_opts_check_flags checks for: a training run (the shape and --val-fraction too)
 * or a plan (flatmoe plan: the shape is checked by the planner). */
typedef enum { FM_TRAIN_CHECK_TRAIN = 0, FM_TRAIN_CHECK_PLAN } fm_train_check_for;
/* The trainer's rules over its options that need no file (each value in range; the flags that
 * do not go together: --zero 1/3 with --offload-optimizer, fp8 with --ep, both fp8 weight-cache
 * forms, the ring with plain logits, ...). Called by fm_train (through fm_train_opts_check, which
 * adds --data and --out) and by the run spec's fm_spec_check (run/fm_spec_check.h), so train and
 * plan refuse the same combinations with the same message. Errors: FM_ERR_ARG naming the flags,
 * the values found and the fix. */
fm_status fm_train_opts_check_flags(const fm_train_opts *o, fm_train_check_for what);

/* Runs training. Errors: any status from loading config/data/checkpoints (message set), and
 * FM_ERR_NUMERIC when the loss or gradient norm stops being finite (no checkpoint is written
 * for that step; the last good one stays). */
fm_status fm_train(const fm_train_opts *o);


/* What a checkpoint's state.json says of the run that wrote it (zero / false when absent). */
typedef struct fm_trained_info {
    int64_t seq_len; /* the trained sequence length */
    bool expert_fp8; /* trained with --expert-precision fp8 (inference runs the native precision) */
} fm_trained_info;

/* Loads a checkpoint folder's config.json and model.safetensors into a new model on backend
 * `be`, laid out for micro-batch B and sequence T (T = 0: the checkpoint's trained seq_len from
 * state.json, or max_position_embeddings). *trained (may be NULL) gets state.json's fields. The
 * weights live in *ps (a parameter store without optimizer state, created here): free it with
 * fm_param_store_free after fm_model_free. Errors: FM_ERR_IO/FORMAT/CONFIG with the file named,
 * FM_ERR_NOMEM. */
fm_status fm_load_for_inference(fm_model *m, fm_param_store *ps, const char *ckpt_dir, fm_backend be, int64_t B, int64_t T,
                                fm_trained_info *trained);

/* Validation loss of the model over up to max_batches micro-batches of sequential windows of
 * `ds` (0: all windows). Writes mean nats/token; n_tokens_out gets the tokens scored. Errors:
 * the model's communicator's. */
struct fm_dataset;
fm_status fm_evaluate(fm_model *m, const struct fm_dataset *ds, int64_t max_batches, double *mean_loss,
                      int64_t *n_tokens_out);
/* The same with schedule s for the forwards (NULL: m's default schedule; ZeRO-3 passes one with
 * its gathering hook, train/fm_zero3.h). Errors: a hook's, the model's communicator's. */
struct fm_schedule;
fm_status fm_evaluate_sched(struct fm_schedule *s, fm_model *m, const struct fm_dataset *ds, int64_t max_batches,
                            double *mean_loss, int64_t *n_tokens_out);

#endif
