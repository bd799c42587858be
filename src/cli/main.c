/* flatmoe command line: train | sample | eval. Parsing and printing only; the work is in the
 * library. Every flag is --name VALUE or --name=VALUE; unknown flags are errors. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/fm_backend_default.h"
#include "core/fm_rng.h"
#include "data/fm_data.h"
#include "io/fm_checkpoint.h"
#include "plan/fm_plan.h"
#include "train/fm_trainer.h"
#include "schedule/fm_schedule.h"

#define MAX_FILES 256

typedef enum { F_STR, F_I64, F_F64, F_U64, F_INT, F_BOOL, F_FILES } flag_kind;

typedef struct flag {
    const char *name;
    flag_kind kind;
    void *ptr;
    int *count; /* F_FILES: number of files */
    const char *help;
} flag;

static int usage_error(const char *cmd, const char *fmt, const char *arg) {
    fprintf(stderr, "flatmoe %s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\nRun 'flatmoe %s --help' for the flags.\n", cmd);
    return 2;
}

static void print_help(const char *cmd, const char *synopsis, const flag *flags, int n) {
    printf("usage: flatmoe %s %s\n\nflags:\n", cmd, synopsis);
    for (int i = 0; i < n; i++) printf("  --%-18s %s\n", flags[i].name, flags[i].help);
    printf("  --%-18s %s\n", "help", "print this help");
}

/* Returns 0 on success, 1 if help was printed, 2 on a usage error (message printed). */
static int parse_flags(const char *cmd, const char *synopsis, int argc, char **argv, flag *flags, int n) {
    for (int i = 0; i < argc; i++) {
        char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            print_help(cmd, synopsis, flags, n);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) return usage_error(cmd, "unexpected argument '%s' (flags start with --)", a);
        char name[64];
        const char *eq = strchr(a + 2, '=');
        size_t len = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
        if (len >= sizeof name) return usage_error(cmd, "unknown flag '%s'", a);
        memcpy(name, a + 2, len);
        name[len] = 0;
        flag *f = NULL;
        for (int j = 0; j < n; j++)
            if (!strcmp(flags[j].name, name)) f = &flags[j];
        if (!f) return usage_error(cmd, "unknown flag '--%s'", name);
        if (f->kind == F_BOOL) {
            if (eq) return usage_error(cmd, "flag '--%s' takes no value", name);
            *(bool *)f->ptr = true;
            continue;
        }
        if (f->kind == F_FILES) {
            const char **list = f->ptr;
            if (eq) {
                if (*f->count >= MAX_FILES) return usage_error(cmd, "too many files for '--%s' (at most 256)", name);
                list[(*f->count)++] = eq + 1;
            }
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
                if (*f->count >= MAX_FILES) return usage_error(cmd, "too many files for '--%s' (at most 256)", name);
                list[(*f->count)++] = argv[++i];
            }
            if (*f->count == 0) return usage_error(cmd, "flag '--%s' needs at least one file", name);
            continue;
        }
        const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (!v) return usage_error(cmd, "flag '--%s' needs a value", name);
        char *end = NULL;
        errno = 0;
        if (f->kind == F_STR) { /* any text, the empty string included (e.g. --prompt "") */
            *(const char **)f->ptr = v;
            continue;
        }
        bool bad = !*v || (f->kind == F_U64 && *v == '-');
        long lv;
        switch (f->kind) {
        case F_I64: *(int64_t *)f->ptr = strtoll(v, &end, 10); break;
        case F_INT:
            lv = strtol(v, &end, 10);
            bad |= lv < -1000000 || lv > 1000000;
            *(int *)f->ptr = (int)lv;
            break;
        case F_U64: *(uint64_t *)f->ptr = strtoull(v, &end, 10); break;
        case F_F64:
            *(double *)f->ptr = strtod(v, &end);
            bad |= !isfinite(*(double *)f->ptr);
            break;
        default: break;
        }
        if (bad || *end || errno) {
            fprintf(stderr, "flatmoe %s: flag '--%s' expects %s, found '%s'\n", cmd, name,
                    f->kind == F_F64 ? "a finite number" : f->kind == F_U64 ? "a non-negative integer" : "an integer", v);
            return 2;
        }
    }
    return 0;
}

static int fail(const char *cmd, fm_status s) {
    fflush(stdout);
    fprintf(stderr, "flatmoe %s: error: %s\n", cmd, fm_errmsg());
    return s == FM_ERR_ARG ? 2 : 1;
}

/* ---- train ----------------------------------------------------------------------------------- */

static int cmd_train(int argc, char **argv) {
    fm_train_opts o;
    fm_train_opts_default(&o);
    static const char *data[MAX_FILES], *val[MAX_FILES];
    const char *mem_budget = NULL, *gpu_ws = NULL;
    flag flags[] = {
        {"config", F_STR, &o.config_path, NULL, "Hugging Face config.json of the model (required unless --resume)"},
        {"data", F_FILES, data, &o.n_data, "training files: UTF-8 text (byte tokens) or llm.c .bin shards"},
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
        {"bf16-moments", F_BOOL, &o.bf16_moments, NULL, "keep the AdamW moments m and v in bf16 (4 instead of 8 bytes per parameter; the update is computed in fp32, checkpoints hold them as fp32) (off)"},
        {"seed", F_U64, &o.seed, NULL, "seed of the weights and the data order (1337)"},
        {"threads", F_INT, &o.threads, NULL, "CPU threads, 0 = all cores (0)"},
        {"out", F_STR, &o.out_dir, NULL, "run folder: checkpoints and metrics.jsonl (runs/tiny)"},
        {"resume", F_BOOL, &o.resume, NULL, "continue from the latest checkpoint in --out"},
        {"eval-every", F_I64, &o.eval_every, NULL, "validation every N steps, 0 = only at the end (250)"},
        {"eval-batches", F_I64, &o.eval_batches, NULL, "micro-batches per validation, 0 = all (20)"},
        {"save-every", F_I64, &o.save_every, NULL, "checkpoint every N steps, 0 = only at the end (0)"},
        {"log-every", F_I64, &o.log_every, NULL, "print a step line every N steps (1)"},
        {"exit-after", F_I64, &o.exit_after, NULL, "stop after N steps of this invocation, with a checkpoint (0 = off)"},
        {"recompute", F_STR, &o.recompute, NULL, "none | full | layer ids, e.g. 0,2: recompute those layers in backward (none, or chosen under --mem-budget)"},
        {"moe-chunk-tokens", F_I64, &o.moe_chunk_tokens, NULL, "MoE in strided chunks of <= N tokens, recomputed in backward; 0 = unchunked (0, or chosen under --mem-budget)"},
        {"mem-budget", F_STR, &mem_budget, NULL, "fail before allocating if the plan exceeds this (e.g. 16GiB); with no other memory flag, choose them to fit (no budget)"},
        {"ce-block-tokens", F_I64, &o.ce_block_tokens, NULL, "linear cross-entropy token block, never N x V logits (0 = plain logits, or chosen under --mem-budget)"},
        {"ce-block-vocab", F_I64, &o.ce_block_vocab, NULL, "linear cross-entropy vocabulary block (4096 when --ce-block-tokens is set; 0 = plain logits)"},
        {"attention-tile-q", F_I64, &o.att_tile_q, NULL, "CPU attention tile: query rows, 1..4096 (64)"},
        {"attention-tile-kv", F_I64, &o.att_tile_kv, NULL, "CPU attention tile: key columns, 1..4096 (64)"},
        {"gpu-workspace", F_STR, &gpu_ws, NULL, "CUDA: bytes of the cuDNN workspace, e.g. 256MiB (default: the planner sizes it for the attention backward at this length, at most 1 GiB; smaller splits the backward into head chunks)"},
        {"report-memory", F_BOOL, &o.report_memory, NULL, "print each live set's measured high-water mark next to its bound (unless --quiet; always in metrics.jsonl)"},
        {"quiet", F_BOOL, &o.quiet, NULL, "no per-step lines (metrics.jsonl is still written)"},
        {"max-position-embeddings", F_I64, &o.max_position_embeddings, NULL, "override the config's max_position_embeddings (1..2^30; 0 keeps it), e.g. to train past it; saved in the checkpoint's config"},
        {"no-checkpoint", F_BOOL, &o.no_checkpoint, NULL, "write no checkpoint, not even at the end (benchmarks)"},
    };
    int r = parse_flags("train", "--config C --data FILES [flags]", argc, argv, flags, sizeof flags / sizeof flags[0]);
    if (r) return r == 1 ? 0 : r;
    bool steps_given = false;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--steps") || !strncmp(argv[i], "--steps=", 8)) steps_given = true;
    if (o.resume && !steps_given) o.steps = 0; /* the checkpoint's total (fm_train) */
    o.data = data;
    o.val_data = o.n_val_data ? val : NULL;
    fm_status s;
    if (mem_budget && (s = fm_parse_bytes(mem_budget, "--mem-budget", &o.mem_budget))) return fail("train", s);
    if (mem_budget && o.mem_budget == 0) return usage_error("train", "%s", "--mem-budget must be > 0 (omit it for no budget)");
    if (gpu_ws && (s = fm_parse_bytes(gpu_ws, "--gpu-workspace", &o.gpu_workspace))) return fail("train", s);
    if (o.threads < 0) return usage_error("train", "%s", "--threads must be >= 0 (0 = all cores)");
    if (o.moe_chunk_tokens < -1 || o.ce_block_tokens < -1 || o.ce_block_vocab < -1)
        return usage_error("train", "%s", "--moe-chunk-tokens, --ce-block-tokens and --ce-block-vocab must be >= 0");
    s = fm_train(&o);
    return s ? fail("train", s) : 0;
}

/* A run folder (use its latest checkpoint) or a checkpoint folder. */
static fm_status resolve_ckpt(const char *dir, char *out, size_t cap) {
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/%s", dir, FM_CKPT_MODEL_FILE);
    FILE *f = fopen(probe, "rb");
    if (f) {
        fclose(f);
        snprintf(out, cap, "%s", dir);
        return FM_OK;
    }
    fm_status s = fm_ckpt_find_latest(dir, out, cap, NULL);
    if (s) return fm_error(s, "--ckpt %s: neither a checkpoint folder (no %s) nor a run folder with step_* checkpoints",
                           dir, FM_CKPT_MODEL_FILE);
    return FM_OK;
}

/* ---- sample ---------------------------------------------------------------------------------- */

static int cmd_sample(int argc, char **argv) {
    const char *ckpt_arg = NULL, *prompt = "\n";
    int64_t max_new = 256, top_k = 0, ctx_len = 0;
    double temperature = 0.8;
    uint64_t seed = 1337;
    int threads = 0;
    flag flags[] = {
        {"ckpt", F_STR, &ckpt_arg, NULL, "checkpoint folder, or run folder (its latest checkpoint) (required)"},
        {"prompt", F_STR, &prompt, NULL, "text to continue (byte-level models) (a newline)"},
        {"max-new-tokens", F_I64, &max_new, NULL, "tokens to generate (256)"},
        {"temperature", F_F64, &temperature, NULL, "softmax temperature, 0 = greedy (0.8)"},
        {"top-k", F_I64, &top_k, NULL, "sample among the k most likely tokens, 0 = all (0)"},
        {"seed", F_U64, &seed, NULL, "sampling seed (1337)"},
        {"context", F_I64, &ctx_len, NULL, "context window in tokens (default: the trained --seq-len)"},
        {"threads", F_INT, &threads, NULL, "CPU threads, 0 = all cores (0)"},
    };
    int r = parse_flags("sample", "--ckpt DIR [--prompt TEXT] [flags]", argc, argv, flags, sizeof flags / sizeof flags[0]);
    if (r) return r == 1 ? 0 : r;
    if (!ckpt_arg) return usage_error("sample", "%s", "--ckpt is required");
    if (max_new < 0 || top_k < 0 || temperature < 0 || ctx_len < 0)
        return usage_error("sample", "%s", "--max-new-tokens, --top-k, --temperature and --context must be >= 0");
    char ckpt[4096];
    fm_status s = resolve_ckpt(ckpt_arg, ckpt, sizeof ckpt);
    if (s) return fail("sample", s);
    fm_backend be;
    fm_config cfg;
    char cpath[4200];
    snprintf(cpath, sizeof cpath, "%s/config.json", ckpt);
    if ((s = fm_config_load(&cfg, cpath))) return fail("sample", s);
    if ((s = fm_backend_default_init(&be, threads, cfg.head_dim))) return fail("sample", s);
    fm_model m;
    if ((s = fm_load_for_inference(&m, ckpt, be, 1, ctx_len, NULL))) {
        fm_backend_default_free(&be);
        return fail("sample", s);
    }
    const int64_t T = m.T_cap, V = cfg.vocab_size;
    size_t plen = strlen(prompt);
    int64_t cap = (int64_t)plen + max_new + 1;
    int32_t *seq = fm_malloc(sizeof(int32_t) * (size_t)cap);
    float *probs = fm_malloc(sizeof(float) * (size_t)V);
    int32_t *order = fm_malloc(sizeof(int32_t) * (size_t)V);
    float *row = fm_malloc(sizeof(float) * (size_t)V);
    int64_t n = 0;
    for (size_t i = 0; i < plen; i++) {
        int32_t t = (unsigned char)prompt[i];
        if (t >= V) {
            fprintf(stderr, "flatmoe sample: error: prompt byte %d is not below vocab_size %lld\n", t, (long long)V);
            return 1;
        }
        seq[n++] = t;
    }
    if (n == 0) seq[n++] = '\n';
    fwrite(prompt, 1, plen, stdout);
    fm_rng rng;
    fm_rng_seed(&rng, seed);
    for (int64_t step = 0; step < max_new; step++) {
        int64_t len = n < T ? n : T;
        fm_model_set_shape(&m, 1, len);
        memcpy(m.h_tokens, seq + n - len, sizeof(int32_t) * (size_t)len);
        fm_schedule_default_forward(&m, false, NULL);
        fm_model_logits_row(&m, len - 1, row);
        const float *lg = row;
        int32_t next = 0;
        if (temperature == 0) {
            for (int64_t v = 1; v < V; v++)
                if (lg[v] > lg[next]) next = (int32_t)v;
        } else {
            /* top-k: keep the k largest logits (k = V when 0). */
            int64_t kk = top_k > 0 && top_k < V ? top_k : V;
            for (int64_t v = 0; v < V; v++) order[v] = (int32_t)v;
            for (int64_t i = 0; i < kk && kk < V; i++) { /* partial selection sort */
                int64_t best = i;
                for (int64_t j = i + 1; j < V; j++)
                    if (lg[order[j]] > lg[order[best]]) best = j;
                int32_t t = order[i]; order[i] = order[best]; order[best] = t;
            }
            double mx = -INFINITY, sum = 0;
            for (int64_t i = 0; i < kk; i++) if (lg[order[i]] > mx) mx = lg[order[i]];
            for (int64_t i = 0; i < kk; i++) { probs[i] = (float)exp((lg[order[i]] - mx) / temperature); sum += probs[i]; }
            double u = fm_rng_uniform_d(&rng) * sum, acc = 0;
            next = order[kk - 1];
            for (int64_t i = 0; i < kk; i++) {
                acc += probs[i];
                if (u < acc) { next = order[i]; break; }
            }
        }
        seq[n++] = next;
        if (next < 256) putchar(next);
        else printf("<%d>", next);
        fflush(stdout);
    }
    putchar('\n');
    fm_free(seq);
    fm_free(probs);
    fm_free(order);
    fm_free(row);
    fm_model_free(&m);
    fm_backend_default_free(&be);
    return 0;
}

/* ---- eval ------------------------------------------------------------------------------------ */

static int cmd_eval(int argc, char **argv) {
    const char *ckpt_arg = NULL;
    static const char *data[MAX_FILES];
    int n_data = 0, threads = 0;
    int64_t seq_len = 0, micro_batch = 8, max_batches = 0;
    flag flags[] = {
        {"ckpt", F_STR, &ckpt_arg, NULL, "checkpoint folder, or run folder (its latest checkpoint) (required)"},
        {"data", F_FILES, data, &n_data, "files to score: text or llm.c shards (required)"},
        {"seq-len", F_I64, &seq_len, NULL, "tokens per window (default: the trained --seq-len)"},
        {"micro-batch", F_I64, &micro_batch, NULL, "windows per forward (8)"},
        {"max-batches", F_I64, &max_batches, NULL, "stop after N micro-batches, 0 = all windows (0)"},
        {"threads", F_INT, &threads, NULL, "CPU threads, 0 = all cores (0)"},
    };
    int r = parse_flags("eval", "--ckpt DIR --data FILES [flags]", argc, argv, flags, sizeof flags / sizeof flags[0]);
    if (r) return r == 1 ? 0 : r;
    if (!ckpt_arg) return usage_error("eval", "%s", "--ckpt is required");
    if (n_data == 0) return usage_error("eval", "%s", "--data is required");
    if (micro_batch < 1 || seq_len < 0 || max_batches < 0)
        return usage_error("eval", "%s", "--micro-batch must be >= 1, --seq-len and --max-batches >= 0");
    char ckpt[4096];
    fm_status s = resolve_ckpt(ckpt_arg, ckpt, sizeof ckpt);
    if (s) return fail("eval", s);
    fm_config cfg;
    char cpath[4200];
    snprintf(cpath, sizeof cpath, "%s/config.json", ckpt);
    if ((s = fm_config_load(&cfg, cpath))) return fail("eval", s);
    fm_dataset ds;
    if ((s = fm_dataset_load(&ds, data, n_data, cfg.vocab_size))) return fail("eval", s);
    fm_backend be;
    if ((s = fm_backend_default_init(&be, threads, cfg.head_dim))) return fail("eval", s);
    fm_model m;
    if ((s = fm_load_for_inference(&m, ckpt, be, micro_batch, seq_len, NULL))) return fail("eval", s);
    if ((s = fm_dataset_check_windows(&ds, m.T_cap, "--data"))) return fail("eval", s);
    double loss;
    int64_t ntok;
    fm_evaluate(&m, &ds, max_batches, &loss, &ntok);
    printf("checkpoint %s\ndata %s\ntokens scored %lld (windows of %lld)\nloss %.4f nats/token\nperplexity %.3f\n", ckpt,
           ds.desc, (long long)ntok, (long long)m.T_cap, loss, exp(loss));
    if (!isfinite(loss)) {
        fprintf(stderr, "flatmoe eval: error: %s: the loss is not finite (%g); the checkpoint's weights are damaged "
                "or diverged\n", ckpt, loss);
        return 1;
    }
    fm_model_free(&m);
    fm_backend_default_free(&be);
    fm_dataset_free(&ds);
    return 0;
}

/* ---- plan ------------------------------------------------------------------------------------ */

static int cmd_plan(int argc, char **argv) {
    const char *config = NULL, *recompute = NULL, *device_mem = NULL, *backend = NULL, *gpu_ws_plan = NULL;
    int64_t seq_len = 0, micro_batch = 1, grad_accum = 1, chunk = -1, ce_bt = -1, ce_bv = -1, tq = 0, tkv = 0;
    int threads = 0;
    bool json = false, bf16m = false;
    flag flags[] = {
        {"config", F_STR, &config, NULL, "Hugging Face config.json of the model (required)"},
        {"seq-len", F_I64, &seq_len, NULL, "tokens per sequence (required)"},
        {"micro-batch", F_I64, &micro_batch, NULL, "sequences per micro-batch (1)"},
        {"grad-accum", F_I64, &grad_accum, NULL, "micro-batches per step, for the per-step FLOPs (1)"},
        {"recompute", F_STR, &recompute, NULL, "none | full | layer ids (default: chosen to fit --device-mem)"},
        {"moe-chunk-tokens", F_I64, &chunk, NULL, "MoE chunk size, 0 = unchunked (default: chosen to fit --device-mem)"},
        {"ce-block-tokens", F_I64, &ce_bt, NULL, "linear cross-entropy token block (default: chosen to fit --device-mem)"},
        {"ce-block-vocab", F_I64, &ce_bv, NULL, "linear cross-entropy vocabulary block"},
        {"device-mem", F_STR, &device_mem, NULL, "memory budget, e.g. 16GiB (default: no verdict; with it, knobs are chosen)"},
        {"mem-budget", F_STR, &device_mem, NULL, "the same as --device-mem (train's name for it)"},
        {"threads", F_INT, &threads, NULL, "CPU threads, for the attention tiles (0 = all cores)"},
        {"attention-tile-q", F_I64, &tq, NULL, "CPU attention tile: query rows (64)"},
        {"attention-tile-kv", F_I64, &tkv, NULL, "CPU attention tile: key columns (64)"},
        {"gpu-workspace", F_STR, &gpu_ws_plan, NULL, "CUDA: bytes of the cuDNN workspace (default: sized by the planner)"},
        {"backend", F_STR, &backend, NULL, "plan for cpu (fp32) or cuda (bf16) (this binary's backend)"},
        {"bf16-moments", F_BOOL, &bf16m, NULL, "AdamW moments in bf16 (4 instead of 8 bytes per parameter) (off)"},
        {"json", F_BOOL, &json, NULL, "print one JSON object instead of the table"},
    };
    int r = parse_flags("plan", "--config C --seq-len S [--micro-batch B] [--device-mem BYTES] [flags]", argc, argv, flags,
                        sizeof flags / sizeof flags[0]);
    if (r) return r == 1 ? 0 : r;
    if (!config) return usage_error("plan", "%s", "--config is required");
    if (seq_len < 1 || micro_batch < 1 || grad_accum < 1)
        return usage_error("plan", "%s", "--seq-len (required), --micro-batch and --grad-accum must be >= 1");
    if (chunk < -1 || ce_bt < -1 || ce_bv < -1)
        return usage_error("plan", "%s", "--moe-chunk-tokens, --ce-block-tokens and --ce-block-vocab must be >= 0");
    fm_plan_req req;
    memset(&req, 0, sizeof req);
    fm_status s = fm_config_load(&req.cfg, config);
    if (s) return fail("plan", s);
    size_t budget = 0;
    if (device_mem && (s = fm_parse_bytes(device_mem, "--device-mem", &budget))) return fail("plan", s);
    if ((s = fm_plan_check_shape(&req.cfg, micro_batch, seq_len))) return fail("plan", s);
    const int64_t L = req.cfg.num_hidden_layers;
    bool *rc = fm_malloc((size_t)L);
    if ((s = fm_recompute_parse(recompute, L, rc))) return fail("plan", s);
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
    if (gpu_ws_plan && (s = fm_parse_bytes(gpu_ws_plan, "--gpu-workspace", &req.gpu_workspace))) return fail("plan", s);
    if (backend && !strcmp(backend, "cpu")) req.target = FM_PLAN_TARGET_CPU;
    else if (backend && !strcmp(backend, "cuda")) req.target = FM_PLAN_TARGET_CUDA;
    else if (backend) return usage_error("plan", "--backend: expected cpu or cuda, found '%s'", backend);
    if (tq < 0 || tkv < 0 || tq > 4096 || tkv > 4096)
        return usage_error("plan", "%s", "--attention-tile-q/-kv must be in [1, 4096] (0 = 64)");
    fm_plan p;
    s = FM_OK;
    if (!recompute && chunk < 0 && ce_bt < 0 && ce_bv < 0 && budget) s = fm_plan_choose(&req, budget, rc, &p);
    else fm_plan_compute(&req, &p);
    if (seq_len > req.cfg.max_position_embeddings)
        fprintf(stderr, "note: --seq-len %lld exceeds the config's max_position_embeddings (%lld); train needs "
                "--max-position-embeddings to run it\n",
                (long long)seq_len, (long long)req.cfg.max_position_embeddings);
    if (json) fm_plan_print_json(&req, &p, budget, stdout);
    else fm_plan_print(&req, &p, budget, stdout);
    fm_free(rc);
    if (s) return fail("plan", s);
    return budget && p.total > budget ? 1 : 0;
}

static void top_help(void) {
    printf("flatmoe: train Mixture-of-Experts language models with every memory peak bounded at launch\n\n"
           "usage: flatmoe <command> [flags]\n\ncommands:\n"
           "  train    train a model from a Hugging Face config.json on text or token shards\n"
           "  sample   generate text from a checkpoint\n"
           "  eval     validation loss and perplexity of a checkpoint on files\n"
           "  plan     memory per live set and FLOPs for a config and shape, without running\n\n"
           "'flatmoe <command> --help' lists a command's flags.\n");
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        top_help();
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "train")) return cmd_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "sample")) return cmd_sample(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return cmd_eval(argc - 2, argv + 2);
    if (!strcmp(cmd, "plan")) return cmd_plan(argc - 2, argv + 2);
    fprintf(stderr, "flatmoe: unknown command '%s'; expected train, sample, eval or plan ('flatmoe --help')\n", cmd);
    return 2;
}
