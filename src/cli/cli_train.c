/* flatmoe train: flags into fm_train_opts, then fm_train. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "io/fm_checkpoint.h"
#include "comm/fm_comm.h"
#include "comm/fm_comm_nccl.h"
#include "plan/fm_plan.h"
#include "train/fm_signal.h"
#include "train/fm_trainer.h"

/* Whether argv names `flag` ("--steps" or "--steps=..."). */
static bool flag_given(int argc, char **argv, const char *flag) {
    const size_t n = strlen(flag);
    for (int i = 1; i < argc; i++)
        if (!strncmp(argv[i], flag, n) && (argv[i][n] == 0 || argv[i][n] == '=')) return true;
    return false;
}

int cmd_train(int argc, char **argv) {
    fm_train_opts o;
    fm_train_opts_default(&o);
    /* "not given" for the memory flags (fm_train_opts' -1 means: choose), told apart from a given -1 */
    o.moe_chunk_tokens = o.ce_block_tokens = o.ce_block_vocab = INT64_MIN;
    const double dflt_lr = o.lr, dflt_min_lr = o.min_lr; /* "not given" for the schedule (--resume keeps the run's) */
    const int64_t dflt_warmup = o.warmup;
    o.lr = o.min_lr = NAN;
    o.warmup = INT64_MIN;
    static const char *data[MAX_FILES], *val[MAX_FILES];
    const char *mem_budget = NULL, *gpu_ws = NULL, *host_mem = NULL, *comm = NULL, *comm_check = NULL;
    const char *vocab_par = NULL, *expert_prec = NULL;
    flag flags[] = {
        {"config", F_STR, &o.config_path, NULL, "Hugging Face config.json of the model (required unless --resume or --init-from)"},
        {"init-from", F_STR, &o.init_from, NULL, "start from a Hugging Face model folder: its config.json and weights (model.safetensors, or model.safetensors.index.json and its shards; fp32, bf16 or fp16); the optimizer starts fresh; --resume wins when --out has a checkpoint (off)"},
        {"data", F_FILES, data, &o.n_data, "training files: UTF-8 text (byte tokens), llm.c .bin shards (memory-mapped; a FILE.mask sidecar masks targets) or Megatron PREFIX (.bin/.idx)"},
        {"val-data", F_FILES, val, &o.n_val_data, "validation files (default: the last --val-fraction of --data)"},
        {"val-fraction", F_F64, &o.val_fraction, NULL, "share of --data held out when no --val-data (0.1)"},
        {"seq-len", F_I64, &o.seq_len, NULL, "tokens per sequence (128)"},
        {"micro-batch", F_I64, &o.micro_batch, NULL, "sequences per micro-batch (16)"},
        {"grad-accum", F_I64, &o.grad_accum, NULL, "micro-batches per optimizer step (1)"},
        {"steps", F_I64, &o.steps, NULL, "optimizer steps in total (1000; with --resume, the run's own total)"},
        {"lr", F_F64, &o.lr, NULL, "peak learning rate (2e-3)"},
        {"min-lr", F_F64, &o.min_lr, NULL, "learning rate at the end of the cosine decay (2e-4)"},
        {"warmup", F_I64, &o.warmup, NULL, "linear warmup steps (50)"},
        {"weight-decay", F_F64, &o.weight_decay, NULL, "AdamW decoupled weight decay, not on norms (0.1)"},
        {"grad-clip", F_F64, &o.grad_clip, NULL, "global gradient-norm clip, 0 = off (1.0)"},
        {"beta1", F_F64, &o.beta1, NULL, "AdamW beta1 (0.9)"},
        {"beta2", F_F64, &o.beta2, NULL, "AdamW beta2 (0.95)"},
        {"expert-precision", F_STR, &expert_prec, NULL, "bf16 | fp8: fp8 runs the MoE expert GEMMs (gate+up, down; forward, dgrad, wgrad) on operands fake-quantized to E4M3 with power-of-two block scales (DeepSeek-V3's 1x128 activation / 128x128 weight / 128x1 wgrad tiles), fp32 accumulation. On an sm_90 GPU (H100, H200) with hidden and intermediate sizes multiples of 128 the GEMMs run on real E4M3 codes (our FP8 grouped GEMM, sync-free; FLATMOE_EXPERT_GEMM=cublas|grouped|loop keep the emulation); elsewhere the recipe's numerics are emulated on the native GEMMs (not its speed). metrics.jsonl's header says which (expert_fp8_path). bf16 = the backend's native precision (fp32 on the CPU build); not with --ep > 1"},
        {"fp8-weight-cache", F_BOOL, &o.fp8_weight_cache, NULL, "with --expert-precision fp8 on E4M3 codes: keep every layer's quantized expert weights for the step (quantized once a step instead of at every forward, backward and recompute; (L - 1) x 6 E H I bytes more in the expert live set: 11.25 GiB for OLMoE-1B-7B) (default: kept when the plan still fits with them, its other knobs unchanged)"},
        {"no-fp8-weight-cache", F_BOOL, &o.no_fp8_weight_cache, NULL, "with --expert-precision fp8 on E4M3 codes: never keep every layer's weight codes (quantize them at each use, the least memory) (the planner's choice)"},
        {"bf16-moments", F_BOOL, &o.bf16_moments, NULL, "keep the AdamW moments m and v in bf16 (4 instead of 8 bytes per parameter; the update is computed in fp32, checkpoints hold them as fp32) (off)"},
        {"no-optimizer-overlap", F_BOOL, &o.no_optimizer_overlap, NULL, "run the update after the backward, with the step waiting for it, instead of layer by layer on a side stream while the next step's forward runs (the same weights either way) (overlapped)"},
        {"offload-optimizer", F_BOOL, &o.offload_optimizer, NULL, "the streamed AdamW: fp32 master, Adam m and v in pinned host memory (12 B/param, 8 with --bf16-moments), streamed through device slots bucket by bucket; the device keeps weights and grads (checkpoints unchanged) (off)"},
        {"offload-optimizer-bucket", F_I64, &o.offload_optimizer_bucket, NULL, "parameters per bucket of --offload-optimizer, 0 = 100M (at most the model's count) (0)"},
        {"offload-optimizer-slots", F_I64, &o.offload_optimizer_slots, NULL, "device staging slots of --offload-optimizer, in [1, 16] (2)"},
        {"seed", F_U64, &o.seed, NULL, "seed of the weights and the data order (1337)"},
        {"threads", F_INT, &o.threads, NULL, "CPU threads, 0 = the cores not busy with other work at the start, or OMP_NUM_THREADS when set (0)"},
        {"out", F_STR, &o.out_dir, NULL, "run folder: checkpoints and metrics.jsonl (runs/tiny)"},
        {"resume", F_BOOL, &o.resume, NULL, "continue from the latest checkpoint in --out (refused when its model.safetensors disagrees with the optimizer's master copy)"},
        {"resume-trust-optimizer", F_BOOL, &o.resume_trust_optimizer, NULL, "with --resume: take the weights from optimizer.safetensors' master copy even when model.safetensors disagrees with it (off)"},
        {"eval-every", F_I64, &o.eval_every, NULL, "validation every N steps, 0 = only at the end (250)"},
        {"eval-batches", F_I64, &o.eval_batches, NULL, "micro-batches per validation, 0 = all (20)"},
        {"save-every", F_I64, &o.save_every, NULL, "checkpoint every N steps or every --save-every-minutes, whichever comes first, and at the end; 0 = no step cadence (1000)"},
        {"save-every-minutes", F_F64, &o.save_every_minutes, NULL, "checkpoint when M minutes of wall time have passed since the last one; 0 = off (30)"},
        {"expert-counts-every", F_I64, &o.expert_counts_every, NULL, "write the full tokens-per-expert counts of every layer into the step's metrics record every N steps; 0 = never (the per-layer max/mean is in every record) (100)"},
        {"peak-flops", F_F64, &o.peak_flops, NULL, "the device's peak FLOP/s for the MFU in metrics.jsonl, e.g. 989e12 (0: from the GPU's name, H100/H200 989e12; none on the CPU)"},
        {"log-every", F_I64, &o.log_every, NULL, "print a step line every N steps (1)"},
        {"exit-after", F_I64, &o.exit_after, NULL, "stop after N steps of this invocation, with a checkpoint (0 = off)"},
        {"recompute", F_STR, &o.recompute, NULL, "none | full | layer ids, e.g. 0,2: recompute those layers in backward (none, or chosen under --mem-budget)"},
        {"no-recompute-keep-attention", F_BOOL, &o.no_recompute_keep_attention, NULL, "recomputed layers run their attention forward again (full recompute; otherwise the chooser may keep attention outputs where they fit) (chosen)"},
        {"recompute-keep-attention", F_BOOL, &o.recompute_keep_attention, NULL, "the recomputed layers (--recompute, or chosen under --mem-budget) keep their attention output and log-sum-exp (N x heads x head_dim activations + B x heads x T fp32 per layer) and never run the attention forward again in backward (off)"},
        {"moe-chunk-tokens", F_I64, &o.moe_chunk_tokens, NULL, "MoE in strided chunks of <= N tokens, recomputed in backward; 0 = unchunked (0, or chosen under --mem-budget)"},
        {"mem-budget", F_STR, &mem_budget, NULL, "device memory for the planned live sets (e.g. 16GiB): the memory knobs not given are chosen to fit it and --host-mem-budget at the least projected step time; refused before allocating if nothing fits (default: none on the CPU; on a GPU its free memory less the measured library growth)"},
        {"host-mem-budget", F_STR, &host_mem, NULL, "pinned host memory the plan may use (offloaded boundaries, streamed optimizer), e.g. 100GiB; 0 forbids offload (default: MemAvailable less max(4 GiB, MemTotal/10), divided among the ranks on this node)"},
        {"ce-block-tokens", F_I64, &o.ce_block_tokens, NULL, "linear cross-entropy token block, never N x V logits (0 = plain logits, or chosen under --mem-budget)"},
        {"ce-block-vocab", F_I64, &o.ce_block_vocab, NULL, "linear cross-entropy vocabulary block (either block flag > 0 turns the linear cross-entropy on, the other then defaults: 1024 tokens, 4096 vocabulary; both 0 = plain logits)"},
        {"attention-tile-q", F_I64, &o.att_tile_q, NULL, "CPU attention tile: query rows, 1..4096 (64)"},
        {"attention-tile-kv", F_I64, &o.att_tile_kv, NULL, "CPU attention tile: key columns, 1..4096 (64)"},
        {"gpu-workspace", F_STR, &gpu_ws, NULL, "CUDA: bytes of the cuDNN workspace, e.g. 256MiB (default: the planner sizes it for the attention backward at this length, at most 1 GiB; smaller splits the backward into head chunks)"},
        {"report-memory", F_BOOL, &o.report_memory, NULL, "print each live set's measured high-water mark next to its bound (unless --quiet; always in metrics.jsonl)"},
        {"quiet", F_BOOL, &o.quiet, NULL, "no per-step lines (metrics.jsonl is still written)"},
        {"max-position-embeddings", F_I64, &o.max_position_embeddings, NULL, "override the config's max_position_embeddings (1..2^30; 0 keeps it), e.g. to train past it; saved in the checkpoint's config"},
        {"offload-boundaries", F_STR, &o.offload_boundaries, NULL, "N | all: keep checkpoint boundaries 0..N-1 in pinned host memory, copied out in forward and prefetched in backward; the device keeps L+1-N+min(N,2) of them; all = L (every boundary but the head's); 0 = off (0)"},
        {"no-checkpoint", F_BOOL, &o.no_checkpoint, NULL, "write no checkpoint, not even at the end (benchmarks)"},
        {"dp", F_INT, &o.dp, NULL, "data-parallel ranks, 0 = every rank of the launch (mpirun/srun); --micro-batch is per rank (0)"},
        {"zero", F_INT, &o.zero, NULL, "0: every rank keeps the whole optimizer state (gradients all-reduced); 1: ZeRO-1/2, Adam m and v sharded over the dp x sp ranks by parameter range, gradients reduce-scattered to their owner, weights all-gathered after the update; 3: ZeRO-3, weights, gradients, fp32 master and Adam state sharded over the dp x sp ranks by parameter group (beside --ep each rank's experts whole), each layer's weights all-gathered just before it runs (the next one prefetched) and its gradients reduce-scattered after its backward (one rank: 0) (0)"},
        {"sp", F_INT, &o.sp, NULL, "Ulysses sequence-parallel ranks per sequence: the world is dp x sp ranks, each sp rank holds seq-len/sp tokens of every sequence and attention runs head-sharded over the whole sequence (seq-len and num_attention_heads divisible by sp; num_key_value_heads divisible by sp or dividing it); with --zero 0, 1 or 3 (ZeRO shards over all dp x sp ranks); beside --ep the expert-parallel groups are drawn from the same dp x sp ranks (1)"},
        {"comm-timeout", F_F64, &o.comm_timeout, NULL, "seconds a collective waits for the other ranks before the run stops, 0 = 300 (0)"},
        {"comm", F_STR, &comm, NULL, "auto | mpi | nccl: the communicator; auto = none on one rank, nccl on several when this is the CUDA build with NCCL and every rank on a node has its own GPU, mpi otherwise (host-staged on GPUs) (auto)"},
        {"comm-check", F_STR, &comm_check, NULL, "deferred | collective: when nccl collectives are checked against --comm-timeout: at the step's existing sync points (deferred), or each one waited for at once, a host sync per collective (deferred)"},
        {"ep", F_INT, &o.ep, NULL, "expert-parallel ranks: each holds num_experts/N experts (weights, grads, Adam state) and tokens reach them by capped all-to-all-v chunks; N divides the ranks (dp x sp) and num_experts; with --zero 0 or 3 (1)"},
        {"ep-cap-tokens", F_I64, &o.ep_cap_tokens, NULL, "--ep: tokens each rank sends per dispatch chunk (the receive buffers hold ep x cap x min(k, E/ep) rows whatever the router does); 0 = --moe-chunk-tokens, or chosen under --mem-budget, else the whole micro-batch (0)"},
        {"llep", F_BOOL, &o.llep, NULL, "--ep: least-loaded expert placement (LLEP): when the busiest rank's routed rows exceed --llep-lambda x the mean, the heaviest experts' rows spill to the least-loaded ranks, which get those experts' weights (off)"},
        {"llep-lambda", F_F64, &o.llep_lambda, NULL, "--llep: the imbalance (busiest rank's rows over the mean) that triggers the placement, >= 1 (1.3)"},
        {"llep-min-piece", F_I64, &o.llep_min_piece, NULL, "--llep: the smallest range of rows that spills to another rank (1024)"},
        {"vocab-parallel", F_STR, &vocab_par, NULL, "off | ring: ring = Ring-DTP, the vocabulary-parallel linear cross-entropy over every rank (dp x sp): each rank keeps its own tokens and V/P rows of the LM head, and over P rounds every token block meets every shard (activations move when tokens per rank <= V/P, else the weight shards); the vocabulary live set is the ring's bound; needs the linear CE (1024 x 4096 blocks unless --ce-block-* are given); with --zero 0, 1 or 3 (under 3 the head is still gathered whole, each rank computing with its rows) (off)"},
    };
    int r = cli_parse_flags("train", "(--config C | --init-from DIR) --data FILES [flags]", argc, argv, flags, sizeof flags / sizeof flags[0]);
    if (r) return r == 1 ? 0 : r;
    if (o.resume) { /* the checkpoint's total and shape (fm_train), unless given */
        if (!flag_given(argc, argv, "--steps")) o.steps = 0;
        if (!flag_given(argc, argv, "--seq-len")) o.seq_len = 0;
        if (!flag_given(argc, argv, "--micro-batch")) o.micro_batch = 0;
        if (!flag_given(argc, argv, "--grad-accum")) o.grad_accum = 0;
    }
    o.data = data;
    o.val_data = o.n_val_data ? val : NULL;
    o.lr_given = !isnan(o.lr), o.min_lr_given = !isnan(o.min_lr), o.warmup_given = o.warmup != INT64_MIN;
    if (!o.lr_given) o.lr = dflt_lr;
    if (!o.min_lr_given) o.min_lr = dflt_min_lr;
    if (!o.warmup_given) o.warmup = dflt_warmup;
    fm_status s;
    if (mem_budget && (s = fm_parse_bytes(mem_budget, "--mem-budget", &o.mem_budget))) return cli_fail("train", s);
    if (mem_budget && o.mem_budget == 0) return cli_usage_error("train", "%s", "--mem-budget must be > 0 (omit it for no budget)");
    if (host_mem && (s = fm_parse_bytes(host_mem, "--host-mem-budget", &o.host_mem_budget))) return cli_fail("train", s);
    o.host_mem_budget_given = host_mem != NULL;
    if (gpu_ws && (s = fm_parse_bytes(gpu_ws, "--gpu-workspace", &o.gpu_workspace))) return cli_fail("train", s);
    fm_comm_kind ck = FM_COMM_KIND_AUTO;
    fm_comm_nccl_check cc = FM_COMM_NCCL_CHECK_DEFERRED;
    if (comm && (s = fm_comm_kind_parse(comm, &ck))) return cli_fail("train", s);
    if (comm_check && (s = fm_comm_nccl_check_parse(comm_check, &cc))) return cli_fail("train", s);
    if (vocab_par && !strcmp(vocab_par, "ring")) o.vocab_parallel = FM_VOCAB_PARALLEL_RING;
    else if (vocab_par && strcmp(vocab_par, "off") != 0)
        return cli_usage_error("train", "--vocab-parallel: expected off or ring, found '%s'", vocab_par);
    if (expert_prec && !strcmp(expert_prec, "fp8")) o.expert_fp8 = true;
    else if (expert_prec && strcmp(expert_prec, "bf16") != 0)
        return cli_usage_error("train", "--expert-precision: expected bf16 or fp8, found '%s'", expert_prec);
    o.comm_kind = (int)ck;
    o.comm_check = (int)cc;
    if (o.threads < 0) return cli_usage_error("train", "%s", "--threads must be >= 0 (0 = all cores)");
    int64_t *mem_flags[3] = {&o.moe_chunk_tokens, &o.ce_block_tokens, &o.ce_block_vocab};
    for (int i = 0; i < 3; i++) {
        if (*mem_flags[i] == INT64_MIN) *mem_flags[i] = -1; /* not given: chosen under a budget, else 0 */
        else if (*mem_flags[i] < 0) {
            char v[32];
            snprintf(v, sizeof v, "%lld", (long long)*mem_flags[i]);
            return cli_usage_error("train", "--moe-chunk-tokens, --ce-block-tokens and --ce-block-vocab must be >= 0, found %s", v);
        }
    }
    if ((s = fm_backend_opts_from_env(&o.backend))) return cli_fail("train", s); /* FLATMOE_* -> init options */
    if ((s = cli_test_hooks_from_env(&o.test_hooks))) return cli_fail("train", s); /* FLATMOE_TEST_* */
    o.threads_env = cli_threads_env(); /* OMP_NUM_THREADS, the node's ranks: --threads 0's choice */
    int rank = 0, size = 1; /* many ranks: rank 0 prints what every rank would */
    (void)fm_comm_launcher(&rank, &size, NULL);
    static char init_dir[4096]; /* --init-from a flatmoe run folder: its latest checkpoint (an HF-format folder) */
    if (o.init_from) {
        char probe[4200];
        snprintf(probe, sizeof probe, "%s/config.json", o.init_from);
        if (access(probe, R_OK) != 0 && fm_ckpt_find_latest(o.init_from, init_dir, sizeof init_dir, NULL) == FM_OK) {
            if (!o.quiet && rank == 0) printf("--init-from %s: its latest checkpoint, %s\n", o.init_from, init_dir);
            o.init_from = init_dir;
        }
    }
    fm_stop_install(); /* SIGINT/SIGTERM: finish the step, save, exit 128 + signal; a second one: at once */
    s = fm_train(&o);
    /* many ranks: a failure on one rank ends every rank (the message names this one); success
     * finalizes MPI when the world initialized it */
    if (s && size > 1) {
        fflush(stdout);
        fprintf(stderr, "flatmoe train: error on rank %d of %d: %s\nflatmoe train: rank %d ends the job (MPI_Abort)\n",
                rank, size, fm_errmsg(), rank);
        fflush(stderr);
        fm_comm_mpi_abort(s == FM_ERR_ARG ? 2 : 1);
        return s == FM_ERR_ARG ? 2 : 1;
    }
    if (!s && fm_comm_mpi_finalize() != FM_OK) return cli_fail("train", FM_ERR_IO);
    if (s) return cli_fail("train", s);
    const int sig = fm_stop_requested(); /* stopped by SIGINT/SIGTERM after a checkpoint: 128 + signal */
    return sig ? 128 + sig : 0;
}
