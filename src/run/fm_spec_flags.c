/* The flag table (fm_run_spec.h): one row per flag of every command. Adding a knob is one row
 * here (and the field in the options struct of the module that uses it). The default a row
 * names is the one --help shows and fm_spec_default sets. A name may have one row per group of
 * commands where the meaning or default differs (--seq-len: train's 128, plan's required,
 * eval's the trained length); each row names its commands. */
#include <stddef.h>

#include "fm_run_spec.h"

#define O(f) offsetof(fm_run_spec, f)
#define T FM_CMD_TRAIN
#define P FM_CMD_PLAN
#define E FM_CMD_EVAL
#define S FM_CMD_SAMPLE
#define PREP FM_CMD_PREPARE
#define CAL FM_CMD_CALIBRATE
#define REP FM_CMD_REPORT
#define RUN FM_SPEC_RUN
#define FIXED FM_SPEC_FIXED
#define NOW FM_SPEC_INVOCATION /* also the launch's own flags (--dp, --zero, --sp, --ep, --comm, --vocab-parallel):
                                  a resume may run on another number of ranks, so they are given anew */

/* a plain value flag: name, kind, field, default, note, help, commands, life */
#define V(n, k, f, d, note, h, c, l) {n, k, O(f), 0, 0, NULL, d, note, h, c, l}
#define FILES(n, f, cnt, note, h, c, l) {n, FM_SPEC_FILES, O(f), O(cnt), 0, NULL, NULL, note, h, c, l}
#define CHOICE(n, f, w, ch, d, h, c, l) {n, FM_SPEC_CHOICE, O(f), 0, w, ch, d, NULL, h, c, l}

static const char *const precision_choices[] = {"bf16", "fp8", NULL};
static const char *const vocab_choices[] = {"off", "ring", NULL};
static const char *const master_choices[] = {"fp32", "bf16-kahan", "bf16-sr", NULL}; /* fm_master_recipe's order */
static const char *const comm_choices[] = {"auto", "mpi", "nccl", NULL};           /* fm_comm_kind's order */
static const char *const comm_check_choices[] = {"deferred", "collective", NULL}; /* fm_comm_nccl_check's */
static const char *const pack_choices[] = {"auto", "on", "off", "pad", NULL};     /* FM_PACK_* */
static const char *const pack_long_choices[] = {"split", "refuse", NULL};         /* FM_PACK_LONG_* */

const fm_spec_flag fm_spec_flags[] = {
    /* ---- the model source ---- */
    V("config", FM_SPEC_STR, train.config_path, NULL, NULL,
      "Hugging Face config.json of the model (train: required unless --resume or --init-from; plan: required)", T | P,
      NOW),
    V("init-from", FM_SPEC_STR, train.init_from, NULL, "off",
      "start from a Hugging Face model folder: its config.json and weights (model.safetensors, or "
      "model.safetensors.index.json and its shards; fp32, bf16 or fp16); the optimizer starts fresh; --resume wins "
      "when --out has a checkpoint", T, NOW),
    /* ---- data ---- */
    FILES("data", data_files, train.n_data, NULL,
          "training files: UTF-8 text (byte tokens), llm.c .bin shards (memory-mapped; a FILE.mask sidecar masks "
          "targets) or Megatron PREFIX (.bin/.idx) (plan: named in its launch line)", T | P, RUN),
    FILES("val-data", val_files, train.n_val_data, "the last --val-fraction of --data", "validation files", T, RUN),
    V("val-fraction", FM_SPEC_F64, train.val_fraction, "0.1", NULL, "share of --data held out when no --val-data", T,
      FIXED),
    /* ---- documents and epochs (issue 28; data/fm_pack.h) ---- */
    CHOICE("pack", train.pack, 4, pack_choices, "auto",
           "auto | on | off | pad: on = each row of a micro-batch filled with whole documents (first-fit in a seeded "
           "order per epoch), the rest padding, attention never crossing a document and positions restarting in each; "
           "pad = one document per row; off = windows at random offsets of the token stream; auto = on when the "
           "training data has a document index (`flatmoe prepare` writes one; Megatron data sets have theirs) and the "
           "run fine-tunes (--init-from), else off", T, FIXED),
    CHOICE("pack-long", train.pack_long, 4, pack_long_choices, "split",
           "split | refuse: a document with more tokens than --seq-len is cut into pieces of --seq-len (each its own "
           "sequence), or refused with its index and length", T, FIXED),
    V("epochs", FM_SPEC_I64, train.epochs, "0", NULL,
      "passes over the training data instead of --steps: packed, every document once per epoch in a seeded order; "
      "off, as many tokens as the data holds; the steps they take are counted at the start; 0 = --steps", T, FIXED),
    V("tensorboard", FM_SPEC_STR, train.tensorboard, NULL, "off",
      "write TensorBoard scalar event files into DIR (loss, lr, grad norm, tokens/s, MFU, expert load, memory): "
      "`tensorboard --logdir DIR`", T, RUN),
    /* ---- shape ---- */
    V("seq-len", FM_SPEC_I64, train.seq_len, "128", NULL, "tokens per sequence", T, FIXED),
    V("seq-len", FM_SPEC_I64, train.seq_len, NULL, NULL, "tokens per sequence (required)", P, NOW),
    V("micro-batch", FM_SPEC_I64, train.micro_batch, "16", "8 with --init-from", "sequences per micro-batch (per data-parallel rank)",
      T, FIXED),
    V("micro-batch", FM_SPEC_I64, train.micro_batch, "1", NULL, "sequences per micro-batch (per data-parallel rank)",
      P, NOW),
    V("grad-accum", FM_SPEC_I64, train.grad_accum, "1", NULL, "micro-batches per optimizer step", T | P, FIXED),
    /* ---- the loop ---- */
    V("steps", FM_SPEC_I64, train.steps, "1000", "with --resume, the run's own total", "optimizer steps in total", T,
      RUN),
    /* ---- the optimizer ---- */
    V("lr", FM_SPEC_F64, train.lr, "2e-3", "2e-5 with --init-from", "peak learning rate", T, RUN),
    V("min-lr", FM_SPEC_F64, train.min_lr, "2e-4", "0 with --init-from", "learning rate at the end of the cosine decay", T, RUN),
    V("warmup", FM_SPEC_I64, train.warmup, "50", "0 with --init-from", "linear warmup steps", T, RUN),
    V("weight-decay", FM_SPEC_F64, train.weight_decay, "0.1", "0 with --init-from", "AdamW decoupled weight decay, not on norms", T,
      RUN),
    V("grad-clip", FM_SPEC_F64, train.grad_clip, "1.0", NULL, "global gradient-norm clip, 0 = off", T, RUN),
    V("beta1", FM_SPEC_F64, train.beta1, "0.9", NULL, "AdamW beta1", T, RUN),
    V("beta2", FM_SPEC_F64, train.beta2, "0.95", NULL, "AdamW beta2", T, RUN),
    /* ---- experts ---- */
    CHOICE("expert-precision", train.expert_fp8, 1, precision_choices, "bf16",
           "bf16 | fp8: fp8 runs the MoE expert GEMMs (gate+up, down; forward, dgrad, wgrad) on operands "
           "fake-quantized to E4M3 with power-of-two block scales (DeepSeek-V3's 1x128 activation / 128x128 weight / "
           "128x1 wgrad tiles), fp32 accumulation. On an sm_90 GPU (H100, H200) with hidden and intermediate sizes "
           "multiples of 128 the GEMMs run on real E4M3 codes (our FP8 grouped GEMM, sync-free; "
           "FLATMOE_EXPERT_GEMM=cublas|grouped|loop keep the emulation); elsewhere the recipe's numerics are emulated "
           "on the native GEMMs (not its speed). metrics.jsonl's header says which (expert_fp8_path). bf16 = the "
           "backend's native precision (fp32 on the CPU build). Every precision runs with --ep and --llep (the codes "
           "where the backend serves a rank's E/ep experts)",
           T | P, FIXED),
    V("fp8-weight-cache", FM_SPEC_BOOL, train.layout.expert_fp8_cache, NULL,
      "default: kept when the plan still fits with them, its other knobs unchanged",
      "with --expert-precision fp8 on E4M3 codes: keep every layer's quantized expert weights for the step "
      "(quantized once a step instead of at every forward, backward and recompute; (L - 1) x 6 E H I bytes more in "
      "the expert live set: 11.25 GiB for OLMoE-1B-7B)", T | P, RUN),
    V("no-fp8-weight-cache", FM_SPEC_BOOL, train.no_fp8_weight_cache, NULL, "the planner's choice",
      "with --expert-precision fp8 on E4M3 codes: never keep every layer's weight codes (quantize them at each use, "
      "the least memory)", T | P, RUN),
    /* ---- optimizer state ---- */
    V("bf16-moments", FM_SPEC_BOOL, train.bf16_moments, NULL, "off",
      "keep the AdamW moments m and v in bf16 (4 instead of 8 bytes per parameter; the update is computed in fp32, "
      "checkpoints hold them as fp32)", T | P, FIXED),
    CHOICE("master-weights", train.master_weights, 4, master_choices, "fp32",
           "fp32 | bf16-kahan | bf16-sr: the weights' precision in the optimizer (a state recipe; it changes the "
           "numerics, and the plan never picks it for you). fp32: an fp32 master copy beside the bf16 weights "
           "(16 B/param, 12 with --bf16-moments). bf16-kahan: bf16 weights plus a bf16 Kahan compensation buffer "
           "(14 B/param, 10). bf16-sr: bf16 weights updated with stochastic rounding, its random bits a hash of "
           "(--seed, step, parameter index), so runs repeat and resume exactly (12 B/param, 8: the bytes of a bf16 "
           "AdamW). On the CPU build the weights are kept at bf16 values. Checkpoints hold fp32 weights and load "
           "under any recipe. Not yet with --offload-optimizer, --zero 3 or --ep",
           T | P, FIXED),
    V("no-optimizer-overlap", FM_SPEC_BOOL, train.no_optimizer_overlap, NULL, "overlapped",
      "run the update after the backward, with the step waiting for it, instead of layer by layer on a side stream "
      "while the next step's forward runs (the same weights either way)", T | P, RUN),
    V("offload-optimizer", FM_SPEC_BOOL, train.offload_optimizer, NULL, "off",
      "the streamed AdamW: fp32 master, Adam m and v in pinned host memory (12 B/param, 8 with --bf16-moments), "
      "streamed through device slots bucket by bucket; the device keeps weights and grads (checkpoints unchanged)",
      T | P, RUN),
    V("offload-optimizer-bucket", FM_SPEC_I64, train.offload_optimizer_bucket, "0", NULL,
      "parameters per bucket of --offload-optimizer, 0 = 100M (at most the model's count)", T | P, RUN),
    V("offload-optimizer-slots", FM_SPEC_I64, train.offload_optimizer_slots, "2", NULL,
      "device staging slots of --offload-optimizer, in [1, 16]", T | P, RUN),
    V("optimizer-offload-fraction", FM_SPEC_F64, train.optimizer_offload_fraction, NULL,
      "the plan's choice under a budget (the least that fits), else 1",
      "with --offload-optimizer: the share F in (0, 1] of its buckets that stream from the host, the last "
      "ceil(F x buckets); the first keep master, m and v on the device, updated there by the same AdamW op (the same "
      "bits as F = 1). Less F: fewer bytes over the host link each step, more device memory", T | P, RUN),
    V("seed", FM_SPEC_U64, train.seed, "1337", NULL, "seed of the weights and the data order", T, FIXED),
    V("threads", FM_SPEC_INT, train.threads, "0", NULL,
      "CPU threads, 0 = the cores not busy with other work at the start, or OMP_NUM_THREADS when set", T | P, FIXED),
    /* ---- the run folder and its cadence ---- */
    V("out", FM_SPEC_STR, train.out_dir, "runs/tiny", "runs/ft-NAME with --init-from NAME", "run folder: checkpoints and metrics.jsonl", T, NOW),
    V("resume", FM_SPEC_BOOL, train.resume, NULL, NULL,
      "continue from the latest checkpoint in --out, with the run's own flags (its state.json; a flag given again "
      "overrides its value) (refused when its model.safetensors disagrees with the optimizer's master copy)", T, NOW),
    V("resume-trust-optimizer", FM_SPEC_BOOL, train.resume_trust_optimizer, NULL, "off",
      "with --resume: take the weights from optimizer.safetensors' master copy even when model.safetensors "
      "disagrees with it", T, NOW),
    V("eval-every", FM_SPEC_I64, train.eval_every, "250", NULL, "validation every N steps, 0 = only at the end", T,
      RUN),
    V("eval-batches", FM_SPEC_I64, train.eval_batches, "20", NULL, "micro-batches per validation, 0 = all", T, RUN),
    V("save-every", FM_SPEC_I64, train.save_every, "1000", NULL,
      "checkpoint every N steps or every --save-every-minutes, whichever comes first, and at the end; 0 = no step "
      "cadence", T, RUN),
    V("save-every-minutes", FM_SPEC_F64, train.save_every_minutes, "30", NULL,
      "checkpoint when M minutes of wall time have passed since the last one; 0 = off", T, RUN),
    V("expert-counts-every", FM_SPEC_I64, train.expert_counts_every, "100", NULL,
      "write the full tokens-per-expert counts of every layer into the step's metrics record every N steps; 0 = "
      "never (the per-layer max/mean is in every record)", T, RUN),
    V("moe-router-bias-update-rate", FM_SPEC_F64, train.moe_router_bias_update_rate, "0", NULL,
      "aux-loss-free balancing (DeepSeek-V3; glm4_moe's sigmoid router): after each step every MoE layer's "
      "e_score_correction_bias moves by R * sign(mean load - expert load), the step's loads over every micro-batch "
      "and rank; 0 = the bias stays as loaded; Megatron-Core's default when enabled is 1e-3", T, RUN),
    V("moe-seq-aux-loss-coeff", FM_SPEC_F64, train.moe_seq_aux_loss_coeff, "0", NULL,
      "alpha of DeepSeek-V3's complementary sequence-wise balance loss (glm4_moe's sigmoid router; Megatron-Core's "
      "seq_aux_loss): per sequence, or per document when the batch is packed, alpha * sum_i f_i P_i, averaged over "
      "the sequences and the MoE layers, reported as aux_loss; 0 = off; DeepSeek-V3 used 1e-4", T, RUN),
    V("peak-flops", FM_SPEC_F64, train.peak_flops, "0", "from the GPU's name, H100/H200 989e12; none on the CPU",
      "the device's peak FLOP/s for the MFU in metrics.jsonl, e.g. 989e12", T, RUN),
    V("log-every", FM_SPEC_I64, train.log_every, "1", NULL, "print a step line every N steps", T, RUN),
    V("exit-after", FM_SPEC_I64, train.exit_after, "0", NULL,
      "stop after N steps of this invocation, with a checkpoint (0 = off)", T, NOW),
    /* ---- memory knobs ---- */
    V("recompute", FM_SPEC_STR, train.recompute, NULL, "none, or chosen under --mem-budget",
      "none | full | layer ids, e.g. 0,2: recompute those layers in backward", T | P, RUN),
    V("no-recompute-keep-attention", FM_SPEC_BOOL, train.no_recompute_keep_attention, NULL, "chosen",
      "recomputed layers run their attention forward again (full recompute; otherwise the chooser may keep "
      "attention outputs where they fit)", T | P, RUN),
    V("recompute-keep-attention", FM_SPEC_BOOL, train.recompute_keep_attention, NULL, "off",
      "the recomputed layers (--recompute, or chosen under --mem-budget) keep their attention output and "
      "log-sum-exp (N x heads x head_dim activations + B x heads x T fp32 per layer) and never run the attention "
      "forward again in backward", T | P, RUN),
    V("moe-chunk-tokens", FM_SPEC_I64, train.moe_chunk_tokens, NULL, "0, or chosen under --mem-budget",
      "MoE in strided chunks of <= N tokens, recomputed in backward; 0 = unchunked", T | P, RUN),
    V("mem-budget", FM_SPEC_BYTES, train.mem_budget, NULL,
      "default: none on the CPU; on a GPU its free memory less the measured library growth",
      "device memory for the planned live sets (e.g. 16GiB): the memory knobs not given are chosen to fit it and "
      "--host-mem-budget at the least projected step time; refused before allocating if nothing fits", T | P, RUN),
    V("host-mem-budget", FM_SPEC_BYTES, train.host_mem_budget, NULL,
      "default: MemTotal less max(4 GiB, MemTotal/10) less what other processes hold (their anonymous resident "
      "memory and shared memory; not MemAvailable, which lags a release of pinned memory), divided among the ranks "
      "on this node; planning --backend cuda from the CPU build: the calibration table's figure",
      "pinned host memory the plan may use (offloaded boundaries, streamed optimizer), e.g. 100GiB; 0 forbids "
      "offload", T | P, RUN),
    V("ce-block-tokens", FM_SPEC_I64, train.ce_block_tokens, NULL, "0 = plain logits, or chosen under --mem-budget",
      "linear cross-entropy token block, never N x V logits", T | P, RUN),
    V("ce-block-vocab", FM_SPEC_I64, train.ce_block_vocab, NULL, NULL,
      "linear cross-entropy vocabulary block (either block flag > 0 turns the linear cross-entropy on, the other "
      "then defaults: 1024 tokens, 4096 vocabulary; both 0 = plain logits)", T | P, RUN),
    V("attention-tile-q", FM_SPEC_I64, train.att_tile_q, NULL, "64", "CPU attention tile: query rows, 1..4096", T | P,
      RUN),
    V("attention-tile-kv", FM_SPEC_I64, train.att_tile_kv, NULL, "64", "CPU attention tile: key columns, 1..4096",
      T | P, RUN),
    V("gpu-workspace", FM_SPEC_BYTES, train.gpu_workspace, NULL,
      "default: the planner sizes it for the attention backward at this length, at most 1 GiB; smaller splits the "
      "backward into head chunks", "CUDA: bytes of the cuDNN workspace, e.g. 256MiB", T | P, RUN),
    V("report-memory", FM_SPEC_BOOL, train.report_memory, NULL, NULL,
      "print each live set's measured high-water mark next to its bound (unless --quiet; always in metrics.jsonl)", T,
      NOW),
    V("quiet", FM_SPEC_BOOL, train.quiet, NULL, NULL, "no per-step lines (metrics.jsonl is still written)", T, NOW),
    V("max-position-embeddings", FM_SPEC_I64, train.max_position_embeddings, NULL, NULL,
      "override the config's max_position_embeddings (1..2^30; 0 keeps it), e.g. to train past it; saved in the "
      "checkpoint's config", T | P, FIXED),
    V("offload-boundaries", FM_SPEC_STR, train.offload_boundaries, NULL, "0",
      "N | all: keep checkpoint boundaries 0..N-1 in pinned host memory, copied out in forward and prefetched in "
      "backward; the device keeps L+1-N+min(N,2) of them; all = L (every boundary but the head's); 0 = off", T | P,
      RUN),
    V("no-checkpoint", FM_SPEC_BOOL, train.no_checkpoint, NULL, NULL,
      "write no checkpoint, not even at the end (benchmarks)", T, NOW),
    /* ---- parallelism ---- */
    V("dp", FM_SPEC_INT, train.dp, "0", NULL,
      "data-parallel ranks, 0 = every rank of the launch (mpirun/srun); --micro-batch is per rank (plan: the ranks "
      "the bounds are per rank of; with --world a mesh degree)", T | P, NOW),
    V("zero", FM_SPEC_INT, train.zero, "0", "plan: 3 with a mesh",
      "0: every rank keeps the whole optimizer state (gradients all-reduced); 1: ZeRO-1/2, Adam m and v sharded "
      "over the dp x sp ranks by parameter range, gradients reduce-scattered to their owner, weights all-gathered "
      "after the update; 3: ZeRO-3, weights, gradients, fp32 master and Adam state sharded over the dp x sp ranks by "
      "parameter group (beside --ep each rank's experts whole), each layer's weights all-gathered just before it "
      "runs (the next one prefetched) and its gradients reduce-scattered after its backward (one rank: 0)", T | P,
      NOW),
    V("sp", FM_SPEC_INT, train.sp, "1", NULL,
      "Ulysses sequence-parallel ranks per sequence: the world is dp x sp ranks, each sp rank holds seq-len/sp "
      "tokens of every sequence and attention runs head-sharded over the whole sequence (seq-len and "
      "num_attention_heads divisible by sp; num_key_value_heads divisible by sp or dividing it); with --zero 0, 1 or "
      "3 (ZeRO shards over all dp x sp ranks); beside --ep the expert-parallel groups are drawn from the same dp x sp "
      "ranks", T | P, NOW),
    V("comm-timeout", FM_SPEC_F64, train.comm_timeout, "0", NULL,
      "seconds a collective waits for the other ranks before the run stops, 0 = 300", T, RUN),
    CHOICE("comm", train.comm_kind, 4, comm_choices, "auto",
           "auto | mpi | nccl: the communicator; auto = none on one rank, nccl on several when this is the CUDA build "
           "with NCCL and every rank on a node has its own GPU, mpi otherwise (host-staged on GPUs)", T, NOW),
    CHOICE("comm-check", train.comm_check, 4, comm_check_choices, "deferred",
           "deferred | collective: when nccl collectives are checked against --comm-timeout: at the step's existing "
           "sync points (deferred), or each one waited for at once, a host sync per collective", T, NOW),
    V("ep", FM_SPEC_INT, train.ep, "1", "plan: chosen with --world",
      "expert-parallel ranks: each holds num_experts/N experts (weights, grads, Adam state) and tokens reach them by "
      "capped all-to-all-v chunks; N divides the ranks (dp x sp) and num_experts; with --zero 0 or 3", T | P, NOW),
    V("ep-cap-tokens", FM_SPEC_I64, train.ep_cap_tokens, "0", NULL,
      "--ep: tokens each rank sends per dispatch chunk (the receive buffers hold ep x cap x min(k, E/ep) rows "
      "whatever the router does); 0 = --moe-chunk-tokens, or chosen under --mem-budget, else the whole micro-batch",
      T | P, NOW),
    V("llep", FM_SPEC_BOOL, train.llep, NULL, "off",
      "--ep: least-loaded expert placement (LLEP): when the busiest rank's routed rows exceed --llep-lambda x the "
      "mean, the heaviest experts' rows spill to the least-loaded ranks, which get those experts' weights (and biases: gpt_oss)", T | P,
      NOW),
    V("llep-lambda", FM_SPEC_F64, train.llep_lambda, "1.3", NULL,
      "--llep: the imbalance (busiest rank's rows over the mean) that triggers the placement, >= 1", T | P, RUN),
    V("llep-min-piece", FM_SPEC_I64, train.llep_min_piece, "1024", NULL,
      "--llep: the smallest range of rows that spills to another rank", T | P, RUN),
    CHOICE("vocab-parallel", train.vocab_parallel, 4, vocab_choices, "off",
           "off | ring: ring = Ring-DTP, the vocabulary-parallel linear cross-entropy over every rank (dp x sp): each "
           "rank keeps its own tokens and V/P rows of the LM head, and over P rounds every token block meets every "
           "shard (activations move when tokens per rank <= V/P, else the weight shards); the vocabulary live set is "
           "the ring's bound; needs the linear CE (1024 x 4096 blocks unless --ce-block-* are given); with --zero 0, 1 "
           "or 3 (under 3 the head is still gathered whole, each rank computing with its rows)", T | P, NOW),
    /* ---- the library's own (include/flatmoe.h flatmoe_open; docs/rl.md) ---- */
    V("logprobs-topk", FM_SPEC_I64, library.logprobs_topk, "0", NULL,
      "libflatmoe sessions only (flatmoe_open; `train` refuses a non-zero value): the most top-k log-probs per token "
      "flatmoe_logprobs_ex may ask for, 0 .. 64 (their [tokens, K] buffers are planned); 0 = none", T | P, NOW),
    V("kv-cache", FM_SPEC_BOOL, library.kv_cache, NULL, "off: each round runs the whole prefix",
      "libflatmoe sessions only (`train` refuses it): flatmoe_generate keeps a key/value cache of every layer for the "
      "token budget, allocated at open (CPU build, one rank, softmax router)", T | P, NOW),
    V("library", FM_SPEC_BOOL, library.plan, NULL, "off: plan `train`",
      "plan a libflatmoe session (flatmoe_open with these flags) instead of `train`: the RL head's buffers in the "
      "vocabulary set, --logprobs-topk and --kv-cache allowed, and the session's host scratch (the batch, per-token "
      "arrays, routes, sampling scratch, the KV cache) printed as its own line (docs/rl.md)", P, NOW),
    /* ---- the planner's own ---- */
    V("device-mem", FM_SPEC_BYTES, planner.device_mem, NULL,
      "--gpu's, else (--backend cuda) the local GPU's, else no verdict",
      "the device's memory, e.g. 141GiB: for --backend cuda the CUDA context and libraries are taken off it "
      "(measured on a GPU build, else the calibration table's figure) and 256 MiB for kernels loaded later, as train "
      "does on that GPU; with it, the knobs not given are chosen", P, NOW),
    V("gpu", FM_SPEC_STR, planner.gpu, NULL, "none",
      "h100 | h200: plan for that GPU (--backend cuda; an 80 GB H100's or a 141 GB H200's memory, and its calibration "
      "table from configs/calib/ when there: an H100 without its own table takes the H200's, said so)", P, NOW),
    V("calib", FM_SPEC_STR, planner.calib, NULL, "configs/calib/<kind>.json, else a built-in table",
      "calibration table for the projected step time", P, NOW),
    V("backend", FM_SPEC_STR, planner.backend, NULL, "this binary's backend", "plan for cpu (fp32) or cuda (bf16)", P,
      NOW),
    V("world", FM_SPEC_I64, planner.world, NULL, "off",
      "ranks (GPUs) of a mesh: plan one rank of it; the degrees not given (--dp/--sp, --ep) are chosen under the "
      "budget (plan/fm_mesh.h)", P, NOW),
    V("gpus-per-node", FM_SPEC_I64, planner.gpus_per_node, NULL, "8",
      "ranks per node, for which links the mesh's collectives cross (NVLink within, InfiniBand across)", P, NOW),
    V("json", FM_SPEC_BOOL, planner.json, NULL, NULL, "print one JSON object instead of the table", P, NOW),
    /* ---- the checkpoint readers (eval, sample) ---- */
    V("ckpt", FM_SPEC_STR, infer.ckpt, NULL, "required", "checkpoint folder, or run folder (its latest checkpoint)",
      E | S, NOW),
    FILES("data", data_files, train.n_data, "required", "files to score: text or llm.c shards", E, NOW),
    V("seq-len", FM_SPEC_I64, train.seq_len, NULL, "the trained --seq-len", "tokens per window", E, NOW),
    V("micro-batch", FM_SPEC_I64, train.micro_batch, "8", NULL, "windows per forward", E, NOW),
    V("max-batches", FM_SPEC_I64, infer.max_batches, "0", NULL, "stop after N micro-batches, 0 = all windows", E, NOW),
    V("prompt", FM_SPEC_STR, infer.prompt, "\n", NULL, "text to continue", S, NOW),
    V("tokenizer", FM_SPEC_STR, infer.tokenizer, NULL, "the checkpoint's tokenizer.json, else bytes",
      "tokenizer.json or a folder with one (eval encodes text files with it)", E | S, NOW),
    V("ignore-eos", FM_SPEC_BOOL, infer.ignore_eos, NULL, "off: stop there",
      "with a tokenizer: go on past its EOS token", S, NOW),
    V("chat", FM_SPEC_BOOL, infer.chat, NULL, "off: the prompt as plain text",
      "render --prompt as a user turn with the tokenizer folder's chat template and its generation prompt "
      "(add_generation_prompt), as transformers' apply_chat_template does", S, NOW),
    V("system", FM_SPEC_STR, infer.system, NULL, "none", "with --chat: a system turn before the prompt", S, NOW),
    V("max-new-tokens", FM_SPEC_I64, infer.max_new_tokens, "256", NULL, "tokens to generate", S, NOW),
    V("temperature", FM_SPEC_F64, infer.temperature, "0.8", NULL, "softmax temperature, 0 = greedy", S, NOW),
    V("top-k", FM_SPEC_I64, infer.top_k, "0", NULL, "sample among the k most likely tokens, 0 = all", S, NOW),
    V("seed", FM_SPEC_U64, train.seed, "1337", NULL, "sampling seed", S, NOW),
    V("context", FM_SPEC_I64, infer.context, NULL, "the trained --seq-len", "context window in tokens", S, NOW),
    V("threads", FM_SPEC_INT, train.threads, "0", NULL, "CPU threads, 0 = all cores", E | S, NOW),
    /* ---- prepare: text and JSONL files -> token shards ---- */
    V("tokenizer", FM_SPEC_STR, prepare.tokenizer, NULL, "required",
      "folder with tokenizer.json (a Hugging Face model folder), or the file", PREP, NOW),
    FILES("input", prepare.inputs, prepare.n_inputs, "required",
          "text files (one file = one document) and JSONL files", PREP, NOW),
    V("out", FM_SPEC_STR, prepare.out, NULL, "required",
      "shard prefix: writes PREFIX_000000.bin, ... (and .bin.mask for prompt/chat data)", PREP, NOW),
    V("shard-tokens", FM_SPEC_I64, prepare.shard_tokens, "100000000", NULL, "tokens per shard", PREP, NOW),
    V("format", FM_SPEC_STR, prepare.format, "auto", NULL,
      "text | jsonl | auto: .jsonl/.json are JSONL, the rest text", PREP, NOW),
    V("no-eos", FM_SPEC_BOOL, prepare.no_eos, NULL, "off", "no EOS token after each document", PREP, NOW),
    V("decode", FM_SPEC_STR, prepare.decode, NULL, NULL,
      "instead: print the text of this shard (with --tokenizer)", PREP, NOW),
    V("show-mask", FM_SPEC_BOOL, prepare.show_mask, NULL, "off",
      "with --decode: wrap masked (prompt) tokens in [[ ]]", PREP, NOW),
    /* prepare's chat records (issue 28: the tokenizer's chat template) */
    V("loss-on", FM_SPEC_STR, prepare.loss_on, "assistant", NULL,
      "assistant | all: the chat tokens that are loss targets (assistant: the assistant's turns and their end "
      "marker; all: every token)", PREP, NOW),
    V("role-map", FM_SPEC_STR, prepare.role_map, NULL, "none",
      "FROM=TO,...: rename chat roles before the check (roles accepted: system, user, assistant, tool); TO empty "
      "drops those messages, e.g. bot=assistant,human=user,narrator=", PREP, NOW),
    V("skip-bad-records", FM_SPEC_BOOL, prepare.skip_bad_records, NULL, "off: stop at the first",
      "a malformed JSONL line (bad JSON, unknown form or role, refused by the template) is a counted warning", PREP,
      NOW),
    V("no-chat-template", FM_SPEC_BOOL, prepare.no_chat_template, NULL, "off: the folder's template when it has one",
      "render chats in flatmoe's own form (<|role|> lines) even when the tokenizer folder has a chat_template", PREP,
      NOW),
    /* ---- calibrate: this backend's rates for plan ---- */
    V("out", FM_SPEC_STR, calibrate.out, NULL, "required",
      "the calibration table to write, e.g. configs/calib/h200.json", CAL, NOW),
    V("backend", FM_SPEC_STR, calibrate.backend, NULL, NULL,
      "cpu or cuda: must be this binary's (flatmoe is cpu, flatmoe-cuda cuda)", CAL, NOW),
    V("quick", FM_SPEC_BOOL, calibrate.quick, NULL, "off", "fewer, smaller shapes (the CPU in well under a minute)",
      CAL, NOW),
    V("threads", FM_SPEC_INT, calibrate.threads, "0", NULL, "CPU threads, 0 = all cores", CAL, NOW),
    /* ---- report: a run folder's curves (RUN_DIR is positional, set by the command) ---- */
    V("out", FM_SPEC_STR, report.out, NULL, "RUN_DIR/report",
      "folder for the images, data files and gnuplot script", REP, NOW),
    V("format", FM_SPEC_STR, report.format, "png", NULL, "png | svg", REP, NOW),
};

const int fm_spec_n_flags = (int)(sizeof fm_spec_flags / sizeof fm_spec_flags[0]);

_Static_assert(sizeof fm_spec_flags / sizeof fm_spec_flags[0] <= FM_SPEC_MAX_ROWS,
               "the flag table outgrew FM_SPEC_MAX_ROWS (fm_run_spec.h): raise it");
