/* flatmoe plan: memory per live set, FLOPs and the projected step time for a config and shape,
 * without running; under a budget, the knobs chosen to fit it (plan/fm_choose.h). */
#include <stdio.h>
#include <string.h>

#include "backend/fm_backend_default.h"
#include "backend/fm_backend_opts.h"
#include "backend/fm_backend_plan.h"
#include "bounded/fm_linear_ce.h"
#include "cli.h"
#include "plan/fm_choose.h"
#include "plan/fm_mesh.h"
#include "plan/fm_plan.h"
#include "plan/fm_plan_device.h"
#include "plan/fm_plan_report.h"
#include "schedule/fm_recompute.h"
#include "schedule/fm_sco.h"
#include "train/fm_offload_adamw.h"
#include "train/fm_threads.h"
#include "train/fm_train_ep.h"
#include "train/fm_trainer.h"
#include "train/fm_zero3.h"

int cmd_plan(int argc, char **argv) {
    const char *config = NULL, *recompute = NULL, *offload = NULL, *device_mem = NULL, *backend = NULL, *gpu_ws_plan = NULL;
    const char *mem_budget = NULL, *host_mem = NULL, *calib_path = NULL, *vocab_par = NULL,
               *expert_prec = NULL;
    int64_t seq_len = 0, micro_batch = 1, grad_accum = 1, chunk = INT64_MIN, ce_bt = INT64_MIN, ce_bv = INT64_MIN, tq = 0, tkv = 0;
    int threads = 0;
    bool json = false, bf16m = false, offopt = false, keep_att = false, no_keep = false, no_overlap = false, fp8_cache = false,
         no_fp8_cache = false;
    int64_t off_bucket = 0, off_slots = 2;
    int dp = 0, zero = -1;                                        /* 0, -1: not given */
    int64_t world = -1, ep = -1, sp = -1, gpus_per_node = -1;     /* -1: not given (0 afterwards) */
    flag flags[] = {
        {"config", F_STR, &config, NULL, "Hugging Face config.json of the model (required)"},
        {"seq-len", F_I64, &seq_len, NULL, "tokens per sequence (required)"},
        {"micro-batch", F_I64, &micro_batch, NULL, "sequences per micro-batch (1)"},
        {"grad-accum", F_I64, &grad_accum, NULL, "micro-batches per step, for the per-step FLOPs (1)"},
        {"recompute", F_STR, &recompute, NULL, "none | full | layer ids (default: chosen under a budget)"},
        {"no-recompute-keep-attention", F_BOOL, &no_keep, NULL, "recomputed layers run their attention forward again: the chooser may not keep attention (train's flag) (chosen)"},
        {"recompute-keep-attention", F_BOOL, &keep_att, NULL, "the recomputed layers keep their attention output and lse; their recompute skips the attention forward (off)"},
        {"moe-chunk-tokens", F_I64, &chunk, NULL, "MoE chunk size, 0 = unchunked (default: chosen to fit --device-mem)"},
        {"ce-block-tokens", F_I64, &ce_bt, NULL, "linear cross-entropy token block (default: chosen to fit --device-mem)"},
        {"ce-block-vocab", F_I64, &ce_bv, NULL, "linear cross-entropy vocabulary block"},
        {"device-mem", F_STR, &device_mem, NULL, "the device's memory, e.g. 141GiB: for --backend cuda the CUDA context and libraries are taken off it (measured on a GPU build, else the calibration table's figure) and 256 MiB for kernels loaded later, as train does on that GPU; with it, the knobs not given are chosen (default: no verdict)"},
        {"mem-budget", F_STR, &mem_budget, NULL, "the budget for the planned live sets themselves (train's --mem-budget); the knobs not given are chosen"},
        {"host-mem-budget", F_STR, &host_mem, NULL, "pinned host memory the plan may use (offloaded boundaries, streamed optimizer), e.g. 100GiB; 0 forbids offload (default: this host's MemAvailable less max(4 GiB, MemTotal/10); planning --backend cuda from the CPU build: the calibration table's figure)"},
        {"calib", F_STR, &calib_path, NULL, "calibration table for the projected step time (default: configs/calib/<kind>.json, else a built-in table)"},
        {"threads", F_INT, &threads, NULL, "CPU threads, for the attention tiles (0 = all cores)"},
        {"attention-tile-q", F_I64, &tq, NULL, "CPU attention tile: query rows (64)"},
        {"attention-tile-kv", F_I64, &tkv, NULL, "CPU attention tile: key columns (64)"},
        {"gpu-workspace", F_STR, &gpu_ws_plan, NULL, "CUDA: bytes of the cuDNN workspace (default: sized by the planner)"},
        {"backend", F_STR, &backend, NULL, "plan for cpu (fp32) or cuda (bf16) (this binary's backend)"},
        {"expert-precision", F_STR, &expert_prec, NULL, "bf16 | fp8: plan train's --expert-precision fp8 (the expert live set holds, emulated, the quantized weights, 3 E H I elements, and two N k max(H,I) operand buffers; on E4M3 codes, train's path where it serves, their code operands, backend/fm_fp8_layout.h) (bf16)"},
        {"fp8-weight-cache", F_BOOL, &fp8_cache, NULL, "plan train's --fp8-weight-cache (with fp8 on E4M3 codes: every layer's weight codes kept, (L - 1) x 6 E H I bytes more) (default, as train's: kept when the plan still fits with them)"},
        {"no-fp8-weight-cache", F_BOOL, &no_fp8_cache, NULL, "plan train's --no-fp8-weight-cache (never keep them) (the planner's choice)"},
        {"bf16-moments", F_BOOL, &bf16m, NULL, "AdamW moments in bf16 (4 instead of 8 bytes per parameter) (off)"},
        {"offload-boundaries", F_STR, &offload, NULL, "N | all: boundaries 0..N-1 in pinned host memory (train's flag; 0 = off)"},
        {"no-optimizer-overlap", F_BOOL, &no_overlap, NULL, "project the update after the backward instead of beside the next forward (train's flag) (overlapped)"},
        {"offload-optimizer", F_BOOL, &offopt, NULL, "the streamed AdamW: master, Adam m, v in pinned host memory (train's flag) (off)"},
        {"offload-optimizer-bucket", F_I64, &off_bucket, NULL, "parameters per bucket of --offload-optimizer, 0 = 100M (0)"},
        {"offload-optimizer-slots", F_I64, &off_slots, NULL, "device staging slots of --offload-optimizer, in [1, 16] (2)"},
        {"dp", F_INT, &dp, NULL, "data-parallel ranks the bounds are per rank of (train's --dp; with --zero 1 the Adam state is 1/(dp x sp), with --zero 3 the shards too; with --world a mesh degree) (1)"},
        {"zero", F_INT, &zero, NULL, "0: replicas; 1: ZeRO-1/2, Adam m and v sharded over the --dp x --sp ranks; 3: ZeRO-3, weights, grads, master and Adam state sharded over the --dp x --sp ranks (experts whole beside --ep), two layers gathered (train's flag); with --world, or --ep/--sp without --zero, the mesh plan is ZeRO-3 over dp x sp (0; 3 with a mesh)"},
        {"world", F_I64, &world, NULL, "ranks (GPUs) of a mesh: plan one rank of it; the degrees not given (--dp/--sp, --ep) are chosen under the budget (plan/fm_mesh.h) (off)"},
        {"ep", F_I64, &ep, NULL, "expert-parallel degree: divides num_experts and dp x sp (train's flag; with --zero 0 or 3 and no --world: the trainer's --ep run, E/ep experts per rank, exact to its arenas; else the mesh's) (chosen with --world, else 1)"},
        {"sp", F_I64, &sp, NULL, "sequence-parallel (Ulysses) degree: divides the heads and --seq-len (train's flag; with --zero 0, 1 or 3 and no --world: the trainer's --sp run (beside --ep when given), exact to its arenas; else the mesh's) (chosen with --world, else 1)"},
        {"gpus-per-node", F_I64, &gpus_per_node, NULL, "ranks per node, for which links the mesh's collectives cross (NVLink within, InfiniBand across) (8)"},
        {"json", F_BOOL, &json, NULL, "print one JSON object instead of the table"},
        {"vocab-parallel", F_STR, &vocab_par, NULL, "off | ring: plan train's --vocab-parallel ring, the vocabulary live set as Ring-DTP's bound over dp x sp ranks (a mesh plan always has it) (off)"},
    };
    int r = cli_parse_flags("plan", "--config C --seq-len S [--micro-batch B] [--device-mem BYTES] [flags]", argc, argv, flags,
                        sizeof flags / sizeof flags[0]);
    if (r) return r == 1 ? 0 : r;
    if (!config) return cli_usage_error("plan", "%s", "--config is required");
    if (seq_len < 1 || micro_batch < 1 || grad_accum < 1)
        return cli_usage_error("plan", "%s", "--seq-len (required), --micro-batch and --grad-accum must be >= 1");
    int64_t *mem_flags[3] = {&chunk, &ce_bt, &ce_bv}; /* INT64_MIN: not given (chosen to fit) */
    for (int i = 0; i < 3; i++) {
        if (*mem_flags[i] == INT64_MIN) *mem_flags[i] = -1;
        else if (*mem_flags[i] < 0) {
            char v[32];
            snprintf(v, sizeof v, "%lld", (long long)*mem_flags[i]);
            return cli_usage_error("plan", "--moe-chunk-tokens, --ce-block-tokens and --ce-block-vocab must be >= 0, found %s", v);
        }
    }
    fm_plan_req req;
    memset(&req, 0, sizeof req);
    fm_status s = fm_config_load(&req.cfg, config);
    if (s) return cli_fail("plan", s);
    if (device_mem && mem_budget)
        return cli_usage_error("plan", "%s", "give --device-mem (the device's memory) or --mem-budget (the planned sets' budget), not both");
    size_t dev_mem = 0, budget = 0, host_budget = FM_HOST_BUDGET_UNLIMITED;
    if (device_mem && (s = fm_parse_bytes(device_mem, "--device-mem", &dev_mem))) return cli_fail("plan", s);
    if (mem_budget && (s = fm_parse_bytes(mem_budget, "--mem-budget", &budget))) return cli_fail("plan", s);
    if (host_mem && (s = fm_parse_bytes(host_mem, "--host-mem-budget", &host_budget))) return cli_fail("plan", s);
    if ((s = fm_plan_check_shape(&req.cfg, micro_batch, seq_len))) return cli_fail("plan", s);
    const int64_t L = req.cfg.num_hidden_layers;
    bool *rc = fm_malloc((size_t)(2 * L)); /* recompute [L], keep-attention [L] */
    if ((s = fm_recompute_parse(recompute, L, rc))) return cli_fail("plan", s);
    if (keep_att && no_keep)
        return cli_usage_error("plan", "%s", "--recompute-keep-attention and --no-recompute-keep-attention: give one");
    if ((s = fm_recompute_keep_attention_fill(keep_att, recompute != NULL, rc, L, rc + L))) return cli_fail("plan", s);
    req.keep_attention = rc + L;
    if ((s = fm_sco_parse(offload, L, &req.n_offloaded_boundaries))) return cli_fail("plan", s);
    req.B = micro_batch;
    req.T = seq_len;
    req.grad_accum = grad_accum;
    req.recompute = rc;
    req.moe_chunk_tokens = chunk > 0 ? chunk : 0;
    req.ce_block_tokens = ce_bt > 0 ? ce_bt : 0;
    req.ce_block_vocab = ce_bv > 0 ? ce_bv : 0;
    req.threads = threads;
    req.att_tile_q = tq;
    req.att_tile_kv = tkv;
    req.bf16_moments = bf16m;
    if (expert_prec && !strcmp(expert_prec, "fp8")) req.expert_fp8 = true;
    else if (expert_prec && strcmp(expert_prec, "bf16") != 0)
        return cli_usage_error("plan", "--expert-precision: expected bf16 or fp8, found '%s'", expert_prec);
    /* --zero 0, 1 or 3 with --ep and/or --sp (no --world): the trainer's own run (train --ep/--sp
     * --zero Z over dp x sp ranks), exact to its arenas; --world, or --ep/--sp without --zero, the mesh */
    { /* the degrees given must be >= 1 (train refuses --ep 0 and --sp 0 too); left out: 0 below */
        const char *names[5] = {"--world", "--dp", "--ep", "--sp", "--gpus-per-node"};
        int64_t *vals[5] = {&world, NULL, &ep, &sp, &gpus_per_node};
        const int64_t dpv = dp;
        for (int i = 0; i < 5; i++) {
            const int64_t v = vals[i] ? *vals[i] : dpv;
            const bool given = vals[i] ? v != -1 : v != 0;
            if (given && v < 1) {
                char msg[120];
                snprintf(msg, sizeof msg, "%s %lld", names[i], (long long)v);
                return cli_usage_error("plan", "the mesh's degrees must be >= 1 (or left out), found %s; give a positive "
                                       "value or leave the flag out", msg);
            }
            if (vals[i] && v == -1) *vals[i] = 0;
        }
    }
    const bool trainer_mp = (sp > 1 || ep > 1) && zero != -1 && world == 0;
    const bool mesh = world > 0 || ((ep > 1 || sp > 1) && !trainer_mp); /* --gpus-per-node alone: no mesh; --dp W --zero 3 alone: the trainer's ZeRO-3 */
    bool choose_ep = false, choose_sp = false;
    if (mesh) { /* one rank of a mesh: ZeRO-3 over dp x sp, experts over ep (plan/fm_mesh.h) */
        if (zero != -1 && zero != 3)
            return cli_usage_error("plan", "%s", "--zero with --world/--ep/--sp: expected 3 (the mesh plan is ZeRO-3 over "
                                   "dp x sp), found 0 or 1; drop --zero or give --zero 3");
        const fm_mesh_flags mf = {world, dp, ep, sp, gpus_per_node};
        if ((s = fm_mesh_from_flags(&req.cfg, seq_len, &mf, &req.mesh, &choose_ep, &choose_sp))) return cli_fail("plan", s);
        const int64_t W = req.mesh.dp * req.mesh.sp;
        if ((choose_ep || choose_sp) && !device_mem && !mem_budget)
            return cli_usage_error("plan", "%s", "--world without all of --dp/--sp and --ep: the chooser needs a budget: "
                                   "give --device-mem (e.g. 141GiB) or --mem-budget, or give the degrees");
        if (!choose_ep && req.mesh.ep > 1 && chunk == 0)
            return cli_usage_error("plan", "%s", "--ep > 1 with --moe-chunk-tokens 0: expected a cap > 0 (expert "
                                   "parallelism dispatches in capped chunks), found 0; give a cap or drop the flag");
        if (W > 1 && ce_bt == 0 && ce_bv == 0)
            return cli_usage_error("plan", "%s", "--ce-block-tokens 0 --ce-block-vocab 0 (plain logits) on a mesh: expected "
                                   "blocks > 0 (the vocabulary is the Ring-DTP linear cross-entropy over dp x sp ranks); "
                                   "drop the flags");
        if (W > 1 && ce_bt < 0 && ce_bv < 0) { /* the ring is the only vocabulary projection: default blocks */
            ce_bt = FM_LCE_DEFAULT_BLOCK_TOKENS;
            ce_bv = FM_LCE_DEFAULT_BLOCK_VOCAB;
            req.ce_block_tokens = ce_bt;
            req.ce_block_vocab = ce_bv;
        }
        dp = 1;
        zero = 0;
    } else if (dp == 0) {
        dp = 1;
    }
    if (zero == -1) zero = 0;
    char found[24];
    snprintf(found, sizeof found, "%d", dp < 1 ? dp : zero);
    if (dp < 1) return cli_usage_error("plan", "--dp must be >= 1, found %s", found);
    if (zero != 0 && zero != 1 && zero != 3)
        return cli_usage_error("plan", "--zero must be 0, 1 or 3 (ZeRO-2 is --zero 1's gradient sharding), found %s",
                               found);
    if (!mesh) req.train_dp = dp, req.train_zero = zero; /* the train flags line */
    if (req.expert_fp8 && (ep > 1 || mesh))
        return cli_usage_error("plan", "%s",
                               ep > 1 ? "--expert-precision fp8 with --ep > 1: the FP8 experts are not built for "
                                        "expert parallelism yet; drop --ep or use --expert-precision bf16"
                                      : "--expert-precision fp8 with a mesh plan (--world, or --sp without --zero): "
                                        "the FP8 experts are not built for a mesh plan yet; plan one rank with "
                                        "--zero 0 (or drop --world/--sp), or use --expert-precision bf16");
    if (vocab_par && strcmp(vocab_par, "ring") != 0 && strcmp(vocab_par, "off") != 0)
        return cli_usage_error("plan", "--vocab-parallel: expected off or ring, found '%s'", vocab_par);
    if (vocab_par && !strcmp(vocab_par, "ring") && !mesh) { /* train's Ring-DTP over its dp x sp ranks */
        if (ce_bt == 0 && ce_bv == 0)
            return cli_usage_error("plan", "%s", "--vocab-parallel ring with --ce-block-tokens 0 --ce-block-vocab 0 (plain "
                                   "logits): the ring is the linear cross-entropy; give blocks > 0 or leave both out");
        if (ce_bt <= 0 && ce_bv <= 0) { /* train's defaults for the flag */
            ce_bt = FM_LCE_DEFAULT_BLOCK_TOKENS;
            ce_bv = FM_LCE_DEFAULT_BLOCK_VOCAB;
            req.ce_block_tokens = ce_bt;
            req.ce_block_vocab = ce_bv;
        }
        const int64_t P = (int64_t)dp * (sp > 1 ? sp : 1);
        req.vocab_ring = P > 1 ? P : 0;
    }
    if (zero == 3 && offopt) return cli_usage_error("plan", "%s", "--zero 3 and --offload-optimizer do not go together yet");
    if (zero && offopt) return cli_usage_error("plan", "%s", "--zero 1 and --offload-optimizer do not go together yet");
    /* the trainer's ranks: dp x sp (train's world; ZeRO shards over all of them, fm_zero3.h) */
    const int ranks = trainer_mp && sp > 1 ? dp * (int)sp : dp;
    fm_model_state_bound_set_dp(ranks, zero); /* the model state's per-rank bound (train/fm_optim.h) */
    req.model_state_bytes = fm_model_state_bound;
    if (trainer_mp) { /* the trainer's --ep/--sp run over dp x sp ranks, exact to its arenas */
        if (sp > 1) { /* Ulysses: seq-len/sp tokens per rank, the head-sharded attention buffers */
            if ((s = fm_attn_sp_check(&req.cfg, sp, req.T))) return cli_fail("plan", s);
            req.sp = sp;
        }
        if (ep > 1) { /* E/ep experts per rank, the capped EP dispatch (train/fm_train_ep.h) */
            if (req.cfg.num_experts % ep != 0)
                return cli_fail("plan", fm_error(FM_ERR_ARG, "--ep %lld does not divide num_experts %lld of the model "
                                                 "config (each rank holds E/ep experts); use an --ep that divides it",
                                                 (long long)ep, (long long)req.cfg.num_experts));
            if (offopt) return cli_usage_error("plan", "%s", "--offload-optimizer with --ep is not supported yet");
            if (zero == 1)
                return cli_usage_error("plan", "%s", "--zero 1 with --ep: the trainer refuses it (ZeRO-1/2 treats the flat "
                                       "parameters as the same tensors on every rank); give --zero 0 or --zero 3");
            if (zero == 3 && ranks % ep != 0) {
                char v[120];
                snprintf(v, sizeof v, "%lld does not divide the %d ranks (--dp %d x --sp %lld)", (long long)ep, ranks, dp,
                         (long long)(sp > 1 ? sp : 1));
                return cli_usage_error("plan", "--ep %s (expert-parallel groups are drawn from the trainer's dp x sp "
                                       "ranks); give a --dp that makes dp x sp a multiple of --ep", v);
            }
            req.ep = (int)ep;
            fm_train_ep_bound_set((int)ep);
            req.model_state_bytes = fm_train_ep_model_state_bound;
            if (zero == 3 && ranks > 1) { /* the non-expert parameters sharded over dp x sp, E/ep experts whole */
                fm_zero3_ep_bound_set(ranks, (int)ep);
                req.model_state_bytes = fm_zero3_ep_model_state_bound;
            }
        }
    }
    if (off_bucket < 0 || off_slots < 1 || off_slots > 16)
        return cli_usage_error("plan", "%s", "--offload-optimizer-bucket must be >= 0 (0 = 100M) and --offload-optimizer-slots in [1, 16]");
    req.offload_optimizer = offopt;
    /* a mesh: the update of a ZeRO-3 shard must end before the next forward gathers it: not overlapped */
    req.optimizer_overlap = !no_overlap && !(zero && ranks > 1) && !mesh;
    req.offload_bucket = off_bucket > 0 ? off_bucket : FM_OFFLOAD_DEFAULT_BUCKET;
    req.offload_slots = off_slots;
    req.offload_state_bytes = fm_offload_model_state_bound;
    if (gpu_ws_plan && (s = fm_parse_bytes(gpu_ws_plan, "--gpu-workspace", &req.gpu_workspace))) return cli_fail("plan", s);
    if (backend && !strcmp(backend, "cpu")) req.target = FM_PLAN_TARGET_CPU;
    else if (backend && !strcmp(backend, "cuda")) req.target = FM_PLAN_TARGET_CUDA;
    else if (backend) return cli_usage_error("plan", "--backend: expected cpu or cuda, found '%s'", backend);
    if (tq < 0 || tkv < 0 || tq > 4096 || tkv > 4096)
        return cli_usage_error("plan", "%s", "--attention-tile-q/-kv must be in [1, 4096] (0 = 64)");
    /* the device and the rates: this build's device when planning for it, else the table's */
    const bool cuda = req.target == FM_PLAN_TARGET_CUDA || (req.target == FM_PLAN_TARGET_BUILD && sizeof(fm_act) != 4);
    /* the CPU's attention scratch is per thread: --threads 0 resolved as train resolves it (the
     * cores not busy now, or OMP_NUM_THREADS; fm_threads.h), and the train flags line names it */
    if (!cuda && req.threads == 0) {
        const fm_threads_env te = cli_threads_env();
        req.threads = fm_threads_auto(150, &te, NULL);
    }
    fm_expert_ask eask = {FM_EXPERT_GEMM_AUTO, cuda, true};
    fm_backend_opts bo = fm_backend_opts_default();
    { /* FLATMOE_EXPERT_GEMM, as train reads it (plan/fm_expert_choice.h decides the form below) */
        if ((s = fm_backend_opts_from_env(&bo))) return cli_fail("plan", s);
        eask.requested = bo.expert_gemm;
        eask.cpu_fp8_codes = bo.cpu_fp8_codes; /* the test hook FLATMOE_TEST_FP8_CODES=1 */
    }
    const bool cross = req.target == FM_PLAN_TARGET_CUDA ? sizeof(fm_act) == 4 : req.target == FM_PLAN_TARGET_CPU ? sizeof(fm_act) != 4 : false;
    fm_device_budget dev = {0};
    bool measured = false;
    if (cuda && !cross && dev_mem) { /* a GPU build planning its own GPU: measure the context */
        fm_status ms = fm_device_budget_measure(req.cfg.head_dim, &dev);
        measured = ms == FM_OK && dev.total > 0;
        if (!measured) fprintf(stderr, "note: could not measure the CUDA context on this machine (%s); using the calibration table's figure\n", fm_errmsg());
    }
    fm_calib cal;
    char note[1400];
    if ((s = fm_calib_find(&cal, calib_path, bo.calib_dir, cuda ? "cuda" : "cpu", measured ? dev.name : NULL, note))) return cli_fail("plan", s);
    fprintf(json ? stderr : stdout, "%s\n", note);
    /* the sm90 expert GEMM's device: this GPU when planning it, else (a cross plan, or no device
     * to ask) the table's, whose sm90 curves were measured running the kernel */
    if (cuda && !cross && fm_backend_default_expert_sm90_ok() == 0) eask.device_sm90 = false;
    req.expert_fp8_codes = fm_expert_fp8_codes(&req, &eask); /* fp8: the codes' buffers or the emulation's */
    if (fp8_cache && no_fp8_cache)
        return cli_usage_error("plan", "%s", "--fp8-weight-cache and --no-fp8-weight-cache both given: keep one, or "
                               "neither (then the planner keeps every layer's weight codes when its plan still fits with them)");
    if (fp8_cache && !req.expert_fp8_codes) {
        char why[320], msg[640];
        fm_expert_fp8_codes_why(&req, &eask, why, sizeof why);
        snprintf(msg, sizeof msg, "%s%s", req.expert_fp8 ? "its fp8 experts are emulated, since " : "", why);
        return cli_usage_error("plan", "--fp8-weight-cache keeps the E4M3 weight codes of --expert-precision fp8's "
                               "fast path, which this plan does not run: %s; drop --fp8-weight-cache", msg);
    }
    if (no_fp8_cache && !req.expert_fp8)
        return cli_usage_error("plan", "%s", "--no-fp8-weight-cache is for --expert-precision fp8's weight codes, but "
                               "--expert-precision is bf16; drop --no-fp8-weight-cache or pass --expert-precision fp8");
    req.expert_fp8_cache = fp8_cache;
    req.expert_fp8_cache_auto = req.expert_fp8_codes && !fp8_cache && !no_fp8_cache;
    fm_expert_choice_prepare(&req, &eask, &cal); /* the chooser weighs each candidate at its faster form */
    size_t context = 0;
    char what[400] = "";
    if (dev_mem) {
        if (cuda) {
            context = (measured ? dev.context_bytes : (size_t)cal.context_bytes) + FM_PLAN_LATE_LOAD_MARGIN;
            snprintf(what, sizeof what, "--device-mem %.1f MiB less %.1f MiB of CUDA context and libraries (%s) and %.0f MiB "
                     "for kernels loaded later", dev_mem / 1048576.0, (context - FM_PLAN_LATE_LOAD_MARGIN) / 1048576.0,
                     measured ? "measured on this GPU" : "the calibration table's figure", FM_PLAN_LATE_LOAD_MARGIN / 1048576.0);
        } else {
            snprintf(what, sizeof what, "--device-mem");
        }
        if (dev_mem <= context)
            return cli_fail("plan", fm_error(FM_ERR_ARG, "--device-mem %s is not more than the CUDA context and libraries "
                                             "(%.1f MiB): give the device's whole memory, e.g. 141GiB for an H200",
                                             device_mem, context / 1048576.0));
        budget = dev_mem - context;
    } else if (budget) {
        snprintf(what, sizeof what, "--mem-budget");
    }
    if (!host_mem) { /* the default host budget: this host's, or the calibrated machine's for a cross plan */
        const size_t h = cross ? (size_t)cal.host_pinnable_bytes : fm_host_mem_budget_default();
        if (h > 0) host_budget = h;
    }
    int64_t per_node = 1; /* a mesh's ranks on one node share its host memory */
    if (mesh) {
        const int64_t W = req.mesh.dp * req.mesh.sp;
        per_node = W < req.mesh.gpus_per_node ? W : req.mesh.gpus_per_node;
        if (host_budget != FM_HOST_BUDGET_UNLIMITED && per_node > 1) host_budget /= (size_t)per_node;
    }
    fm_choose_opts co = {budget, what[0] ? what : "--mem-budget", host_budget,
                         host_mem ? "--host-mem-budget" : "the host budget (--host-mem-budget; default: what the host can pin)",
                         &cal, recompute != NULL, keep_att || no_keep, offload != NULL, offopt || req.ep > 1, /* --ep: no streamed AdamW, as train */
                         chunk >= 0, ce_bt >= 0 || ce_bv >= 0};
    fm_plan p;
    fm_projection proj;
    if (mesh && per_node > 1)
        fprintf(json ? stderr : stdout, "host budget per rank: %.3f GiB (the node's, shared by its %lld ranks)\n",
                host_budget == FM_HOST_BUDGET_UNLIMITED ? 0.0 : host_budget / 1073741824.0, (long long)per_node);
    if (mesh && (choose_ep || choose_sp)) {
        fm_mesh_choice *ch = fm_malloc(sizeof *ch);
        s = fm_mesh_choose(&req, &co, rc, choose_ep, choose_sp, ch);
        if (s == FM_OK) fm_mesh_print_choice(ch, json ? stderr : stdout);
        fm_free(ch);
        if (s) {
            fm_free(rc);
            return cli_fail("plan", s);
        }
    }
    s = fm_plan_fit(&req, &co, rc, &p, &proj);
    fm_expert_choice ech;
    fm_expert_choice_finish(&req, &p, &eask, &cal, &ech); /* the form at the chosen chunk, as train decides it */
    if (seq_len > req.cfg.max_position_embeddings)
        fprintf(stderr, "note: --seq-len %lld exceeds the config's max_position_embeddings (%lld); train needs "
                "--max-position-embeddings to run it\n",
                (long long)seq_len, (long long)req.cfg.max_position_embeddings);
    const fm_plan_report x = {budget, what[0] ? what : NULL, dev_mem, context, host_budget, &proj, &cal, config,
                              cuda ? &ech : NULL};
    if (json) fm_plan_print_json(&req, &p, &x, stdout);
    else fm_plan_print(&req, &p, &x, stdout);
    fm_free(rc);
    if (s) return cli_fail("plan", s);
    return 0;
}
