/* flatmoe plan: memory per live set, FLOPs and the projected step time for a config and shape,
 * without running; under a budget, the knobs chosen to fit it (plan/fm_choose.h). The flags are
 * train's (the run spec's rows of plan) plus the planner's own; the request is derived from them
 * as train derives it (train/fm_train_plan.h), or, for a mesh (--world, or --ep/--sp without
 * --zero), one rank of it (plan/fm_mesh.h). With --backend cuda there is always a verdict: the
 * device is --device-mem, a --gpu preset, or the local GPU. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "backend/fm_backend_default.h"
#include "backend/fm_backend_opts.h"
#include "bounded/fm_linear_ce.h"
#include "cli.h"
#include "plan/fm_choose.h"
#include "plan/fm_mesh.h"
#include "plan/fm_plan.h"
#include "plan/fm_plan_device.h"
#include "plan/fm_plan_report.h"
#include "capi/fm_capi.h"
#include "train/fm_train_ckpt_stream.h"
#include "run/fm_spec_check.h"
#include "train/fm_threads.h"
#include "train/fm_train_plan.h"

/* Device memory of the --gpu presets: what cudaMemGetInfo reports as the total of an 80 GB H100
 * SXM (81559 MiB) and of a 141 GB H200 (143771 MiB), as nvidia-smi lists them. */
#define PLAN_H100_BYTES ((size_t)81559 << 20)
#define PLAN_H200_BYTES ((size_t)143771 << 20)

/* One plan in the making: the spec, the trainer's options as planned, and what each step adds. */
typedef struct plan_ctx {
    const fm_run_spec *spec;
    fm_train_opts o;           /* the trainer's options (dp, zero resolved for the trainer's run) */
    fm_config cfg;             /* --config with --max-position-embeddings */
    bool mesh, choose_ep, choose_sp, cuda, cross, measured, json;
    fm_mesh_dims mesh_dims;
    fm_plan_target target;
    fm_train_plan tp;
    fm_device_budget dev;
    fm_calib cal;
    char note[1400];           /* the calibration's line */
    char gpu_note[400];        /* --gpu h100 planned at the H200's rates */
    size_t dev_mem, budget, host_budget, context;
    char what[400];            /* how the budget was formed */
    const char *gpu_name;      /* --gpu's device name ("NVIDIA H100"), or NULL */
    const char *gpu;           /* --gpu, or "h200" when a CUDA plan names no device and has no GPU here */
    fm_expert_ask eask;        /* the expert GEMMs' question (plan/fm_expert_choice.h) */
    bool verdict_only;         /* the implicit H200: a verdict on the flags as given, no knob chosen */
    fm_llep_opts mesh_llep;    /* a mesh's --llep (the request's own ep is 1: the mesh adds EP) */
} plan_ctx;

/* The mesh or the trainer's run: which one the degrees ask for, and its checks. */
static fm_status plan_degrees(plan_ctx *x) {
    const fm_run_spec *s = x->spec;
    fm_train_opts *o = &x->o;
    const bool zero_given = fm_spec_given(s, "zero"), world = fm_spec_given(s, "world");
    const int64_t ep = fm_spec_given(s, "ep") ? o->ep : 0, sp = fm_spec_given(s, "sp") ? o->sp : 0;
    /* --zero 0, 1 or 3 with --ep and/or --sp (no --world): the trainer's own run (train --ep/--sp
     * --zero Z over dp x sp ranks), exact to its arenas; --world, or --ep/--sp without --zero, the mesh
     * (--gpus-per-node alone: no mesh; --dp W --zero 3 alone: the trainer's ZeRO-3) */
    const bool trainer_mp = (sp > 1 || ep > 1) && zero_given && !world;
    x->mesh = world || ((ep > 1 || sp > 1) && !trainer_mp);
    if (!x->mesh) {
        /* --dp not given: one data-parallel rank; beside --ep with --zero 0 (whose bounds do not depend
         * on it) the fewest that make dp x sp a multiple of ep, as train's launch must */
        if (o->dp == 0) o->dp = 1;
        if (trainer_mp && !fm_spec_given(s, "dp") && o->zero == 0 && ep > 1)
            while ((o->dp * (sp > 1 ? sp : 1)) % ep) o->dp++;
        if (!trainer_mp) o->sp = 1; /* --sp 1 / --ep 1 given alone: one rank's */
        return FM_OK;
    }
    if (zero_given && o->zero != 3)
        return fm_error(FM_ERR_ARG, "--zero with --world/--ep/--sp: expected 3 (the mesh plan is ZeRO-3 over dp x sp), "
                        "found %d; drop --zero or give --zero 3", o->zero);
    if (o->expert_fp8)
        return fm_error(FM_ERR_ARG, "--expert-precision fp8 with a mesh plan (--world, or --sp without --zero): the FP8 "
                        "experts are not built for a mesh plan yet; plan one rank with --zero 0 (or drop --world/--sp), "
                        "or use --expert-precision bf16");
    const fm_mesh_flags mf = {world ? s->planner.world : 0, fm_spec_given(s, "dp") ? o->dp : 0, ep, sp,
                              fm_spec_given(s, "gpus-per-node") ? s->planner.gpus_per_node : 0};
    FM_TRY(fm_mesh_from_flags(&x->cfg, o->seq_len, &mf, &x->mesh_dims, &x->choose_ep, &x->choose_sp));
    if ((x->choose_ep || x->choose_sp) && !fm_spec_given(s, "device-mem") && !fm_spec_given(s, "mem-budget") &&
        !fm_spec_given(s, "gpu"))
        return fm_error(FM_ERR_ARG, "--world without all of --dp/--sp and --ep: the chooser needs a budget: give "
                        "--device-mem (e.g. 141GiB), --gpu h100|h200 or --mem-budget, or give the degrees");
    const int64_t W = x->mesh_dims.dp * x->mesh_dims.sp;
    if (!x->choose_ep && x->mesh_dims.ep > 1 && fm_spec_given(s, "moe-chunk-tokens") && o->moe_chunk_tokens == 0)
        return fm_error(FM_ERR_ARG, "--ep > 1 with --moe-chunk-tokens 0: expected a cap > 0 (expert parallelism "
                        "dispatches in capped chunks), found 0; give a cap or drop the flag");
    const bool bt = fm_spec_given(s, "ce-block-tokens"), bv = fm_spec_given(s, "ce-block-vocab");
    if (W > 1 && bt && bv && o->ce_block_tokens == 0 && o->ce_block_vocab == 0)
        return fm_error(FM_ERR_ARG, "--ce-block-tokens 0 --ce-block-vocab 0 (plain logits) on a mesh: expected blocks > 0 "
                        "(the vocabulary is the Ring-DTP linear cross-entropy over dp x sp ranks); drop the flags");
    if (W > 1 && !bt && !bv) { /* the ring is the only vocabulary projection: default blocks */
        o->ce_block_tokens = FM_LCE_DEFAULT_BLOCK_TOKENS;
        o->ce_block_vocab = FM_LCE_DEFAULT_BLOCK_VOCAB;
    }
    /* the request is one rank's, as the trainer's with one rank; the mesh adds its own terms (and
     * with --llep the hosted experts' weights to its EP dispatch: fm_mesh_plan_sets) */
    x->mesh_llep = fm_train_ep_llep(o);
    o->dp = 1, o->zero = 0, o->ep = 1, o->sp = 1, o->llep = false, o->ep_cap_tokens = 0;
    o->vocab_parallel = FM_VOCAB_PARALLEL_OFF;
    return FM_OK;
}

/* The backend planned for (--gpu implies cuda), the device and its rates, and the experts' path. */
static fm_status plan_device(plan_ctx *x) {
    const fm_run_spec *s = x->spec;
    const char *backend = s->planner.backend, *gpu = x->gpu = s->planner.gpu;
    x->target = FM_PLAN_TARGET_BUILD;
    if (backend && !strcmp(backend, "cpu")) x->target = FM_PLAN_TARGET_CPU;
    else if (backend && !strcmp(backend, "cuda")) x->target = FM_PLAN_TARGET_CUDA;
    else if (backend) return fm_error(FM_ERR_ARG, "--backend: expected cpu or cuda, found '%s'", backend);
    if (gpu && strcmp(gpu, "h100") != 0 && strcmp(gpu, "h200") != 0)
        return fm_error(FM_ERR_ARG, "--gpu: expected h100 or h200, found '%s'", gpu);
    if (gpu && x->target == FM_PLAN_TARGET_CPU)
        return fm_error(FM_ERR_ARG, "--gpu %s with --backend cpu: a GPU preset plans the CUDA backend; drop --backend "
                        "cpu (or --gpu)", gpu);
    if (gpu && fm_spec_given(s, "device-mem"))
        return fm_error(FM_ERR_ARG, "--gpu %s and --device-mem both give the device's memory; keep one", gpu);
    if (gpu) x->target = FM_PLAN_TARGET_CUDA, x->gpu_name = !strcmp(gpu, "h100") ? "NVIDIA H100" : "NVIDIA H200";
    x->cuda = x->target == FM_PLAN_TARGET_CUDA || (x->target == FM_PLAN_TARGET_BUILD && sizeof(fm_act) != 4);
    x->cross = x->target == FM_PLAN_TARGET_CUDA ? sizeof(fm_act) == 4 : x->target == FM_PLAN_TARGET_CPU ? sizeof(fm_act) != 4 : false;
    /* the CPU's attention scratch is per thread: --threads 0 resolved as train resolves it (the
     * cores not busy now, or OMP_NUM_THREADS; fm_threads.h), and the train flags line names it */
    if (!x->cuda && x->o.threads == 0) {
        const fm_threads_env te = cli_threads_env();
        x->o.threads = fm_threads_auto(150, &te, NULL);
    }
    /* a GPU build planning its own GPU (--device-mem, or no device given): measure the context */
    if (x->cuda && !x->cross && !gpu && !fm_spec_given(s, "mem-budget")) {
        const fm_status ms = fm_device_budget_measure(x->cfg.head_dim, &x->dev);
        x->measured = ms == FM_OK && x->dev.total > 0;
        if (!x->measured && fm_spec_given(s, "device-mem"))
            fprintf(stderr, "note: could not measure the CUDA context on this machine (%s); using the calibration "
                    "table's figure\n", fm_errmsg());
    }
    if (x->cuda && !gpu && !x->measured && !fm_spec_given(s, "device-mem") && !fm_spec_given(s, "mem-budget")) {
        gpu = x->gpu = "h200", x->gpu_name = "NVIDIA H200"; /* always a verdict: the calibrated GPU, said so */
        x->verdict_only = true;
        snprintf(x->gpu_note, sizeof x->gpu_note, "device: no --gpu, --device-mem or --mem-budget and no GPU here: the "
                 "verdict is for an H200, on the flags as given (--gpu h200 also chooses the memory knobs not given; "
                 "--gpu h100 or --device-mem for another device)");
    }
    const char *calib_device = x->gpu_name ? x->gpu_name : x->measured ? x->dev.name : NULL;
    FM_TRY(fm_calib_find(&x->cal, s->planner.calib, x->o.backend.calib_dir, x->cuda ? "cuda" : "cpu", calib_device, x->note));
    if (gpu && !strcmp(gpu, "h100") && !s->planner.calib && strstr(x->note, "no calibration table")) {
        FM_TRY(fm_calib_find(&x->cal, NULL, x->o.backend.calib_dir, "cuda", "NVIDIA H200", x->note)); /* the H200's rates, said so */
        snprintf(x->gpu_note + strlen(x->gpu_note), sizeof x->gpu_note - strlen(x->gpu_note), "--gpu h100: no H100 calibration table (configs/calib/h100.json); "
                 "the projected times use the H200's rates");
    }
    return FM_OK;
}

/* The budgets: the device (--device-mem, --gpu, or the local GPU, less the CUDA context and
 * libraries), or --mem-budget; the host (--host-mem-budget, this host's, or the calibrated
 * machine's for a cross plan; a mesh's ranks on one node share it). */
static fm_status plan_budgets(plan_ctx *x) {
    const fm_run_spec *s = x->spec;
    x->dev_mem = s->planner.device_mem;
    const char *dev_from = "--device-mem";
    if (!x->dev_mem && x->gpu_name) x->dev_mem = !strcmp(x->gpu, "h100") ? PLAN_H100_BYTES : PLAN_H200_BYTES,
                                     dev_from = !strcmp(x->gpu, "h100") ? "--gpu h100" : "--gpu h200";
    if (!x->dev_mem && x->measured && !fm_spec_given(s, "mem-budget")) x->dev_mem = x->dev.total, dev_from = "this GPU's";
    if (x->cuda && !x->dev_mem && !fm_spec_given(s, "mem-budget"))
        return fm_error(FM_ERR_ARG, "--backend cuda: no device to plan for (no GPU here); give --gpu h100 or --gpu h200, "
                        "or --device-mem BYTES (e.g. 141GiB), or --mem-budget for the planned sets alone");
    x->budget = x->o.mem_budget;
    if (x->dev_mem) {
        if (x->cuda) {
            x->context = (x->measured ? x->dev.context_bytes : (size_t)x->cal.context_bytes) + FM_PLAN_LATE_LOAD_MARGIN;
            snprintf(x->what, sizeof x->what, "%s %.1f MiB less %.1f MiB of CUDA context and libraries (%s) and %.0f MiB "
                     "for kernels loaded later", dev_from, x->dev_mem / 1048576.0,
                     (x->context - FM_PLAN_LATE_LOAD_MARGIN) / 1048576.0,
                     x->measured ? "measured on this GPU" : "the calibration table's figure",
                     FM_PLAN_LATE_LOAD_MARGIN / 1048576.0);
        } else {
            snprintf(x->what, sizeof x->what, "--device-mem");
        }
        if (x->dev_mem <= x->context)
            return fm_error(FM_ERR_ARG, "--device-mem %.1f MiB is not more than the CUDA context and libraries (%.1f MiB): "
                            "give the device's whole memory, e.g. 141GiB for an H200", x->dev_mem / 1048576.0,
                            x->context / 1048576.0);
        x->budget = x->dev_mem - x->context;
    } else if (x->budget) {
        snprintf(x->what, sizeof x->what, "--mem-budget");
    }
    x->host_budget = fm_spec_given(s, "host-mem-budget") ? x->o.host_mem_budget : FM_HOST_BUDGET_UNLIMITED;
    if (!fm_spec_given(s, "host-mem-budget")) { /* this host's, or the calibrated machine's for a cross plan */
        const size_t h = x->cross || x->gpu_name ? (size_t)x->cal.host_pinnable_bytes : fm_host_mem_budget_default();
        if (h > 0) x->host_budget = h;
    }
    if (x->mesh) { /* a mesh's ranks on one node share its host memory */
        const int64_t W = x->mesh_dims.dp * x->mesh_dims.sp;
        const int64_t per_node = W < x->mesh_dims.gpus_per_node ? W : x->mesh_dims.gpus_per_node;
        if (x->host_budget != FM_HOST_BUDGET_UNLIMITED && per_node > 1) {
            x->host_budget /= (size_t)per_node;
            fprintf(x->json ? stderr : stdout, "host budget per rank: %.3f GiB (the node's, shared by its %lld ranks)\n",
                    x->host_budget / 1073741824.0, (long long)per_node);
        }
    }
    return FM_OK;
}

/* The request (train/fm_train_plan.h, as train derives it; a mesh: one rank's, plus the mesh),
 * the experts' path for the device. */
static fm_status plan_request(plan_ctx *x) {
    fm_train_opts *o = &x->o;
    const int W = o->dp * (o->sp > 1 ? o->sp : 1); /* the trainer's ranks: dp x sp */
    FM_TRY(fm_train_plan_request(o, &x->cfg, W, o->sp, x->target, &x->tp));
    fm_plan_req *req = &x->tp.req;
    if (x->mesh) {
        req->mesh = x->mesh_dims;
        req->optimizer_overlap = false; /* a ZeRO-3 shard's update ends before the next forward gathers it */
        req->train_dp = 0, req->train_zero = 0;
        if (x->mesh_llep.on) req->llep = &x->mesh_llep;
    }
    fm_expert_ask eask = {FM_EXPERT_GEMM_AUTO, x->cuda, true};
    fm_expert_ask *ea = &x->eask;
    eask.requested = o->backend.expert_gemm; /* FLATMOE_EXPERT_GEMM, as train reads it (plan/fm_expert_choice.h) */
    eask.cpu_fp8_codes = o->backend.cpu_fp8_codes; /* the test hook FLATMOE_TEST_FP8_CODES=1 */
    /* the sm90 expert GEMM's device: this GPU when planning it, else (a cross plan, a preset, or no
     * device to ask) the table's, whose sm90 curves were measured running the kernel */
    if (x->cuda && !x->cross && !x->gpu_name && fm_backend_default_expert_sm90_ok() == 0) eask.device_sm90 = false;
    *ea = eask;
    return fm_train_plan_experts(&x->tp, o, ea, &x->cal);
}

/* The launch line's binary (this one; a plan for the other build: its name, flatmoe or
 * flatmoe-cuda) and --data files (plan's --data, else DATA), so the line runs as printed. */
static void launch_words(const plan_ctx *x, char *exe, size_t exe_cap, char *data, size_t data_cap) {
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    exe[0] = data[0] = 0;
    if (n > 0) {
        self[n] = 0;
        char *slash = strrchr(self, '/');
        if (!x->cross && slash) snprintf(exe, exe_cap, "%s", self); /* a cross plan: the other build's name */
    }
    size_t at = 0;
    for (int i = 0; i < x->o.n_data && at < data_cap; i++)
        at += (size_t)snprintf(data + at, data_cap - at, "%s%s", i ? " " : "", x->spec->data_files[i]);
}

int cmd_plan(int argc, char **argv) {
    static fm_run_spec spec; /* train's flags that shape a plan, and the planner's own (run/fm_spec_flags.c) */
    fm_spec_default(&spec, FM_CMD_PLAN);
    int r = cli_parse_spec("plan", "--config C --seq-len S [--micro-batch B] [--gpu h100|h200 | --device-mem BYTES] [flags]",
                           argc, argv, &spec);
    if (r) return r == 1 ? 0 : r;
    static plan_ctx x;
    memset(&x, 0, sizeof x);
    x.spec = &spec;
    x.o = fm_spec_train_opts(&spec);
    x.json = spec.planner.json;
    if (spec.library.plan) { /* a session's plan: what flatmoe_open sets before its run (capi/flatmoe_session.c
                              * session_options: the RL head laid out, the linear CE's blocks unless given) */
        x.o.layout.rl_head = true;
        x.o.layout.rl_topk = spec.library.logprobs_topk;
        if (x.o.ce_block_tokens < 0) x.o.ce_block_tokens = FM_LCE_DEFAULT_BLOCK_TOKENS;
        if (x.o.ce_block_vocab < 0) x.o.ce_block_vocab = FM_LCE_DEFAULT_BLOCK_VOCAB;
    }
    fm_status s = fm_spec_check(&spec);
    if (!s) s = fm_backend_opts_from_env(&x.o.backend); /* FLATMOE_*: the expert GEMM, the calibration folder */
    if (!s) s = fm_config_load(&x.cfg, x.o.config_path);
    if (!s && x.o.max_position_embeddings > 0) x.cfg.max_position_embeddings = x.o.max_position_embeddings; /* train's */
    if (!s) s = fm_plan_check_shape(&x.cfg, x.o.micro_batch, x.o.seq_len);
    if (!s) s = plan_degrees(&x);
    if (!s) s = plan_device(&x);
    if (!s) s = plan_budgets(&x);
    if (!s) s = plan_request(&x);
    if (s) {
        fm_train_plan_free(&x.tp);
        return cli_fail("plan", s);
    }
    fprintf(x.json ? stderr : stdout, "%s\n", x.note);
    if (x.gpu_note[0]) fprintf(x.json ? stderr : stdout, "%s\n", x.gpu_note);
    fm_plan_req *req = &x.tp.req;
    fm_choose_opts co = fm_train_plan_choose_opts(
        &x.tp, &x.o, x.budget, x.what[0] ? x.what : "--mem-budget", x.host_budget,
        fm_spec_given(&spec, "host-mem-budget") ? "--host-mem-budget"
                                                 : "the host budget (--host-mem-budget; default: what the host can pin)",
        &x.cal);
    if (x.verdict_only) /* a verdict on the knobs as given (their defaults), none chosen */
        co.fix_recompute = co.fix_keep_attention = co.fix_offload_boundaries = co.fix_offload_optimizer =
            co.fix_moe_chunk = co.fix_ce = co.fix_offload_fraction = true;
    if (x.mesh && (x.choose_ep || x.choose_sp)) {
        fm_mesh_choice *ch = fm_malloc(sizeof *ch);
        s = ch ? fm_mesh_choose(req, &co, x.tp.rc, x.choose_ep, x.choose_sp, ch) : FM_ERR_NOMEM;
        if (s == FM_OK) fm_mesh_print_choice(ch, x.json ? stderr : stdout);
        fm_free(ch);
        if (s) {
            fm_train_plan_free(&x.tp);
            return cli_fail("plan", s);
        }
    }
    fm_plan p;
    fm_projection proj;
    s = fm_plan_fit(req, &co, x.tp.rc, &p, &proj);
    fm_expert_choice ech;
    fm_expert_choice_finish(req, &p, &x.eask, &x.cal, &ech); /* the form at the chosen chunk, as train decides it */
    if (x.o.seq_len > x.cfg.max_position_embeddings && x.o.max_position_embeddings == 0)
        fprintf(stderr, "note: --seq-len %lld exceeds the config's max_position_embeddings (%lld); train needs "
                "--max-position-embeddings to run it\n", (long long)x.o.seq_len, (long long)x.cfg.max_position_embeddings);
    fm_plan_report rep = {x.budget, x.what[0] ? x.what : NULL, x.dev_mem, x.context, x.host_budget, &proj, &x.cal,
                          x.o.config_path, x.cuda ? &ech : NULL};
    static char exe[4200], data[8192];
    launch_words(&x, exe, sizeof exe, data, sizeof data);
    rep.exe = exe[0] ? exe : NULL;
    rep.mpirun = geteuid() == 0 ? "mpirun --allow-run-as-root" : "mpirun"; /* Open MPI refuses root without it */
    rep.ckpt_max_numel = fm_ckpt_max_tensor_numel(&x.cfg); /* the checkpoints' host staging (train/) */
    rep.ckpt_chunk_elems = FM_CKPT_CHUNK_ELEMS;
    rep.ckpt_stage_bytes = fm_ckpt_stage_bound(rep.ckpt_max_numel, rep.ckpt_chunk_elems);
    rep.data = data[0] ? data : NULL;
    if (spec.library.plan) /* the session's host scratch, as flatmoe_open allocates it (capi/flatmoe_host.c) */
        rep.library_host_bytes = fm_capi_host_bytes(&x.cfg, x.o.micro_batch, x.o.seq_len, spec.library.logprobs_topk,
                                                    spec.library.kv_cache, &rep.library_kv_bytes);
    if (x.json) fm_plan_print_json(req, &p, &rep, stdout);
    else fm_plan_print(req, &p, &rep, stdout);
    if (s == FM_OK) { /* a cheaper state recipe that would be faster: named, never chosen */
        char note[1200];
        fm_plan_recipe_note(req, &co, proj.step_s, note, sizeof note);
        if (note[0]) fprintf(x.json ? stderr : stdout, "%s\n", note);
    }
    fm_train_plan_free(&x.tp);
    if (s) return cli_fail("plan", s);
    return 0;
}
