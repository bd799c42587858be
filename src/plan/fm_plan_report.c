#include "fm_plan_report.h"

#include "../bounded/fm_linear_ce.h"

#include <stdlib.h>
#include <string.h>

static int largest_set(const fm_plan *p) {
    int best = 0;
    for (int i = 1; i < FM_PLAN_SETS; i++)
        if (p->bytes[i] > p->bytes[best]) best = i;
    return best;
}

static void human(char *buf, size_t n, size_t bytes) {
    snprintf(buf, n, "%.3f", bytes / 1073741824.0);
}

/* The trainer's flags that reproduce plan p of request r (one rank's knobs; a mesh adds its
 * degrees), into buf[cap]. */
/* The --max-position-embeddings a train line of request r must carry: the one given, else the
 * sequence length when it exceeds the config's; 0: none. */
static int64_t train_max_pos(const fm_plan_req *r) {
    if (r->max_position_embeddings_flag > 0) return r->max_position_embeddings_flag;
    return r->T > r->cfg.max_position_embeddings ? r->T : 0;
}

int fm_plan_state_bytes_per_param(const fm_plan_req *r) {
    const int a = r->target == FM_PLAN_TARGET_CPU ? 4 : r->target == FM_PLAN_TARGET_CUDA ? 2 : (int)sizeof(fm_act);
    const fm_master_recipe rc = (fm_master_recipe)r->state_layout.master_recipe;
    return 2 * a + fm_master_extra_bytes(rc, a) + (r->bf16_moments ? 4 : 8);
}

void fm_plan_offload_fraction_text(const fm_plan *p, char *buf, size_t n) {
    const double F = p->offload_buckets > 0 ? (double)p->offload_streamed_buckets / (double)p->offload_buckets : 1.0;
    for (int prec = 4; prec <= 17; prec++) { /* the fewest digits that give the same bucket count again */
        snprintf(buf, n, "%.*g", prec, F);
        if (fm_offload_streamed_buckets(p->offload_buckets, 1, strtod(buf, NULL)) == p->offload_streamed_buckets) return;
    }
}

/* " --llep" and its non-default knobs when the plan's EP bound counts the hosted experts (the
 * launch must keep them), else "". */
static const char *llep_flags(const fm_plan_req *r, char *buf, size_t cap) {
    buf[0] = 0;
    if (!r->llep || !r->llep->on) return buf;
    const fm_llep_opts dl = fm_llep_defaults();
    int n = snprintf(buf, cap, " --llep");
    if (r->llep->lambda != dl.lambda && n > 0 && (size_t)n < cap)
        n += snprintf(buf + n, cap - (size_t)n, " --llep-lambda %g", r->llep->lambda);
    if (r->llep->min_piece != dl.min_piece && n > 0 && (size_t)n < cap)
        snprintf(buf + n, cap - (size_t)n, " --llep-min-piece %lld", (long long)r->llep->min_piece);
    return buf;
}

void fm_plan_train_flags(const fm_plan_req *r, const fm_plan *p, char *buf, size_t cap) {
    const fm_config *c = &r->cfg;
    char llep[80];
    const int64_t L = c->num_hidden_layers;
    size_t at = 0;
#define PUT(...) (at += at < cap ? (size_t)snprintf(buf + at, cap - at, __VA_ARGS__) : 0)
    buf[0] = 0;
    PUT("--seq-len %lld --micro-batch %lld --recompute ", (long long)r->T, (long long)r->B);
    if (p->n_recomputed == 0) PUT("none");
    else if (p->n_recomputed == L) PUT("full");
    else
        for (int64_t l = 0, k = 0; l < L; l++)
            if (r->recompute && r->recompute[l]) PUT("%s%lld", k++ ? "," : "", (long long)l);
    if (p->n_recomputed > 0)
        PUT("%s", p->n_keep_attention == p->n_recomputed ? " --recompute-keep-attention"
                  : p->n_keep_attention == 0 ? " --no-recompute-keep-attention" : "");
    PUT(" --moe-chunk-tokens %lld", (long long)r->moe_chunk_tokens);
    if (r->ce_block_tokens > 0 || r->ce_block_vocab > 0)
        PUT(" --ce-block-tokens %lld --ce-block-vocab %lld",
            (long long)(r->ce_block_tokens > 0 ? r->ce_block_tokens : FM_LCE_DEFAULT_BLOCK_TOKENS),
            (long long)(r->ce_block_vocab > 0 ? r->ce_block_vocab : FM_LCE_DEFAULT_BLOCK_VOCAB));
    else PUT(" --ce-block-tokens 0 --ce-block-vocab 0");
    PUT(" --offload-boundaries %lld", (long long)p->n_offloaded_boundaries);
    if (r->offload_optimizer) PUT(" --offload-optimizer");
    if (r->offload_optimizer && !r->mesh.on && p->offload_streamed_buckets < p->offload_buckets) {
        char fr[32];
        fm_plan_offload_fraction_text(p, fr, sizeof fr);
        PUT(" --optimizer-offload-fraction %s", fr);
    }
    if (r->bf16_moments) PUT(" --bf16-moments");
    if (r->state_layout.master_recipe != FM_MASTER_FP32)
        PUT(" --master-weights %s", fm_master_recipe_name((fm_master_recipe)r->state_layout.master_recipe));
    if (r->expert_fp8) PUT(" --expert-precision fp8");
    /* the cache either way on the codes path: without the flag, train chooses it against its own
     * budget (none on the CPU build, the GPU's free memory on CUDA), not this plan's */
    if (r->expert_fp8_codes) PUT(r->layout.expert_fp8_cache ? " --fp8-weight-cache" : " --no-fp8-weight-cache");
    if (r->ep > 1) PUT(" --ep %d", r->ep);
    if (r->ep > 1) PUT("%s", llep_flags(r, llep, sizeof llep));
    if (r->sp > 1) PUT(" --sp %lld", (long long)r->sp);
    if (!r->mesh.on && (r->train_dp > 1 || r->train_zero > 0)) {
        if (r->train_dp > 1) PUT(" --dp %d", r->train_dp);
        if (r->train_zero > 0) PUT(" --zero %d", r->train_zero);
    }
    if (r->vocab_ring > 1 && !r->mesh.on) PUT(" --vocab-parallel ring");
    if (train_max_pos(r)) PUT(" --max-position-embeddings %lld", (long long)train_max_pos(r));
    /* the CPU target: the thread count the attention scratch was planned for (train's --threads 0
     * may find other cores busy, and so another bound) */
    const bool cpu = r->target == FM_PLAN_TARGET_CPU || (r->target == FM_PLAN_TARGET_BUILD && sizeof(fm_act) == 4);
    if (cpu && r->threads > 0) PUT(" --threads %d", r->threads);
    const fm_mesh_dims *m = &r->mesh;
    if (m->on)
        PUT(" --zero 3 --dp %lld --ep %lld --sp %lld%s", (long long)m->dp, (long long)m->ep, (long long)m->sp,
            m->dp * m->sp > 1 ? " --vocab-parallel ring" : "");
#undef PUT
}

/* A mesh plan's launch line: the same knobs as train flags (train --zero 3 over dp x sp ranks). */
static void print_mesh_launch(const fm_plan_req *r, const fm_plan *p, const fm_plan_report *x, FILE *f) {
    const fm_mesh_dims *m = &r->mesh;
    const int64_t L = r->cfg.num_hidden_layers;
    fprintf(f, "\nlaunch: %s -np %lld %s train --config %s --data %s --seq-len %lld --micro-batch %lld --zero 3 "
            "--dp %lld --ep %lld --sp %lld", x->mpirun ? x->mpirun : "mpirun", (long long)(m->dp * m->sp),
            x->exe ? x->exe
            : r->target == FM_PLAN_TARGET_CUDA || (r->target == FM_PLAN_TARGET_BUILD && sizeof(fm_act) != 4)
                ? "flatmoe-cuda" : "flatmoe",
            x->config_path ? x->config_path : "CONFIG", x->data ? x->data : "DATA", (long long)r->T, (long long)r->B, (long long)m->dp,
            (long long)m->ep, (long long)m->sp);
    fprintf(f, " --recompute ");
    if (p->n_recomputed == 0) fprintf(f, "none");
    else if (p->n_recomputed == L) fprintf(f, "full");
    else
        for (int64_t l = 0, k = 0; l < L; l++)
            if (r->recompute && r->recompute[l]) fprintf(f, "%s%lld", k++ ? "," : "", (long long)l);
    if (p->n_recomputed > 0)
        fprintf(f, p->n_keep_attention == p->n_recomputed ? " --recompute-keep-attention"
                   : p->n_keep_attention == 0 ? " --no-recompute-keep-attention" : "");
    fprintf(f, " --moe-chunk-tokens %lld --ce-block-tokens %lld --ce-block-vocab %lld --offload-boundaries %lld%s%s",
            (long long)r->moe_chunk_tokens,
            (long long)(r->ce_block_tokens > 0 ? r->ce_block_tokens : FM_LCE_DEFAULT_BLOCK_TOKENS),
            (long long)(r->ce_block_vocab > 0 ? r->ce_block_vocab : FM_LCE_DEFAULT_BLOCK_VOCAB),
            (long long)p->n_offloaded_boundaries, r->offload_optimizer ? " --offload-optimizer" : "",
            r->bf16_moments ? " --bf16-moments" : "");
    if (r->state_layout.master_recipe != FM_MASTER_FP32)
        fprintf(f, " --master-weights %s", fm_master_recipe_name((fm_master_recipe)r->state_layout.master_recipe));
    if (m->ep > 1) {
        char llep[80];
        fprintf(f, "%s", llep_flags(r, llep, sizeof llep));
    }
    if (train_max_pos(r)) fprintf(f, " --max-position-embeddings %lld", (long long)train_max_pos(r));
    if (m->dp * m->sp > 1) fprintf(f, " --vocab-parallel ring");
    fprintf(f, "\n");
    /* where the trainer of this tree departs from this plan (README "Vocabulary parallelism") */
    if (m->dp * m->sp > 1)
        fprintf(f, "note: under --zero 3 the trainer gathers the head group whole before the Ring-DTP ring (this "
                "plan keeps each rank's vocabulary shard only), so its model state holds one head gather more; "
                "train prints its own plan at launch (this plan's flags without --world plan that run)\n");
}

/* plan --library: the session's own options appended to flags[cap] (fm_plan_train_flags'), whose
 * buffers the bounds count: --logprobs-topk K and --kv-cache, when given. */
static void session_flags(const fm_plan_req *r, const fm_plan_report *x, char *flags, size_t cap) {
    size_t at = strlen(flags);
    if (r->layout.rl_topk > 0 && at < cap)
        at += (size_t)snprintf(flags + at, cap - at, " --logprobs-topk %lld", (long long)r->layout.rl_topk);
    if (x->library_kv_bytes && at < cap) snprintf(flags + at, cap - at, " --kv-cache");
}

void fm_plan_print(const fm_plan_req *r, const fm_plan *p, const fm_plan_report *x, FILE *f) {
    const size_t budget = x->budget;
    const fm_config *c = &r->cfg;
    fprintf(f, "model %s: %lld parameters, %lld active per token; L = %lld, H = %lld, E = %lld, top-%lld, V = %lld\n",
            c->model_type_name, (long long)p->n_params, (long long)p->n_active, (long long)c->num_hidden_layers,
            (long long)c->hidden_size, (long long)c->num_experts, (long long)c->num_experts_per_tok,
            (long long)c->vocab_size);
    fprintf(f, "shape: micro-batch %lld x seq-len %lld = %lld tokens; recompute %lld of %lld layers",
            (long long)r->B, (long long)r->T, (long long)(r->B * r->T), (long long)p->n_recomputed,
            (long long)c->num_hidden_layers);
    if (p->n_keep_attention > 0)
        fprintf(f, " (%lld keep their attention output)", (long long)p->n_keep_attention);
    fprintf(f, "; MoE %s", r->ep > 1 ? "dispatched over ep" : r->moe_chunk_tokens > 0 ? "chunked" : "unchunked (plain)");
    if (r->moe_chunk_tokens > 0 || r->ep > 1)
        fprintf(f, ", %lld chunks of <= %lld tokens", (long long)p->moe_K, (long long)p->moe_c_eff);
    if (r->expert_fp8)
        fprintf(f, ", expert GEMMs fp8 (blockwise E4M3, %s%s)", r->expert_fp8_codes ? "on E4M3 codes" : "emulated",
                r->layout.expert_fp8_cache ? ", every layer's weight codes kept" : "");
    fprintf(f, "; vocabulary %s", (r->ce_block_tokens > 0 || r->ce_block_vocab > 0) ? "linear cross-entropy" : "plain logits");
    if (r->vocab_ring > 1 && !r->mesh.on)
        fprintf(f, " as Ring-DTP over %lld ranks (V/P = %lld head rows each)", (long long)r->vocab_ring,
                (long long)((c->vocab_size + r->vocab_ring - 1) / r->vocab_ring));
    fprintf(f, "; %lld offloaded boundaries; optimizer %s", (long long)p->n_offloaded_boundaries,
            r->offload_optimizer ? "streamed from pinned host memory (--offload-optimizer)" : "on the device");
    if (r->offload_optimizer && !r->mesh.on) { /* --optimizer-offload-fraction: what streams, what stays */
        const double per = 4.0 + 2.0 * (r->bf16_moments ? 2.0 : 4.0); /* master, m, v */
        char fr[32];
        fm_plan_offload_fraction_text(p, fr, sizeof fr);
        fprintf(f, ", offload fraction %s: the last %lld of %lld buckets stream (%.2f GiB of state each way a step), "
                "the first %lld parameters' state stays on the device (%.2f GiB)", fr,
                (long long)p->offload_streamed_buckets, (long long)p->offload_buckets,
                (double)(p->n_params - p->offload_resident) * per / 1073741824.0, (long long)p->offload_resident,
                (double)p->offload_resident * per / 1073741824.0);
    }
    fprintf(f, "; state recipe: master weights %s, moments %s (%d B/param)",
            fm_master_recipe_name((fm_master_recipe)r->state_layout.master_recipe), r->bf16_moments ? "bf16" : "fp32",
            fm_plan_state_bytes_per_param(r));
    if (r->sp > 1) /* Ulysses: the bounds are per rank, of its slice */
        fprintf(f, "; sequence parallel over %lld ranks (%lld tokens of each sequence per rank)", (long long)r->sp,
                (long long)(r->T / r->sp));
    if (r->ep > 1) /* the trainer's expert parallelism: this rank's experts, the capped dispatch */
        fprintf(f, "; expert parallel over %d ranks (%lld experts per rank)", r->ep,
                (long long)(c->num_experts / r->ep));
    /* the same knobs as train flags, to copy; none when the plan does not fit (train would refuse them) */
    const bool host_over = x->host_budget != FM_HOST_BUDGET_UNLIMITED && p->host_bytes > x->host_budget;
    const bool fits = (!budget || p->total <= budget) && !host_over;
    const fm_mesh_dims *m = &r->mesh;
    char flags[1200];
    fm_plan_train_flags(r, p, flags, sizeof flags);
    if (x->library_host_bytes) session_flags(r, x, flags, sizeof flags);
    const char *what = x->library_host_bytes ? "flatmoe_open flags" : "train flags"; /* plan --library: a session */
    if (fits) fprintf(f, "\n%s: %s", what, flags);
    else fprintf(f, "\n%s: none (this plan does not fit: see below)", what);
    if (m->on)
        fprintf(f, "\nmesh: world %lld = dp %lld x sp %lld, ep %lld (%lld GPUs per node); the bounds below are PER RANK: "
                "N = micro-batch x seq-len / sp = %lld local tokens", (long long)(m->dp * m->sp), (long long)m->dp,
                (long long)m->sp, (long long)m->ep, (long long)m->gpus_per_node, (long long)(r->B * (r->T / m->sp)));
    else if (fits && !x->library_host_bytes) { /* the trainer's run: the launch line, runnable as printed once DATA names the data
                      * (over its dp x sp ranks when it has several) */
        const int64_t W = (int64_t)r->state_layout.ranks;
        if (W > 1) fprintf(f, "\nlaunch: %s -np %lld", x->mpirun ? x->mpirun : "mpirun", (long long)W);
        fprintf(f, W > 1 ? " %s train --config %s --data %s %s" : "\nlaunch: %s train --config %s --data %s %s",
                x->exe ? x->exe
                : r->target == FM_PLAN_TARGET_CUDA || (r->target == FM_PLAN_TARGET_BUILD && sizeof(fm_act) != 4)
                    ? "flatmoe-cuda" : "flatmoe",
                x->config_path ? x->config_path : "CONFIG", x->data ? x->data : "DATA", flags);
    }
    fprintf(f, "\n\n%-24s %20s %12s   %s\n", "live set", "bytes", "GiB", "bound");
    char g[32];
    for (int i = 0; i < FM_PLAN_SETS; i++) {
        human(g, sizeof g, p->bytes[i]);
        fprintf(f, "%-24s %20zu %12s   %s\n", fm_plan_set_name(i), p->bytes[i], g, p->inputs[i]);
    }
    if (m->on) {
        human(g, sizeof g, p->comm_bytes);
        fprintf(f, "%-24s %20zu %12s   %s\n", "communication buffers", p->comm_bytes, g, p->comm_inputs);
    }
    human(g, sizeof g, p->total);
    fprintf(f, "%-24s %20zu %12s\n", "total", p->total, g);
    const bool host_limited = x->host_budget != FM_HOST_BUDGET_UNLIMITED;
    if (p->host_bytes > 0) {
        human(g, sizeof g, p->host_bytes);
        char what[300] = "";
        if (p->n_offloaded_boundaries > 0)
            snprintf(what, sizeof what, "%lld offloaded boundaries x N x H x %d B", (long long)p->n_offloaded_boundaries,
                     r->target == FM_PLAN_TARGET_CPU ? 4 : r->target == FM_PLAN_TARGET_CUDA ? 2 : (int)sizeof(fm_act));
        if (p->host_optimizer_bytes > 0 && p->offload_resident > 0 && !r->mesh.on)
            snprintf(what + strlen(what), sizeof what - strlen(what), "%soptimizer: fp32 master 4 B x %lld params + Adam "
                     "m, v %d B x %lld streamed params", what[0] ? " + " : "", (long long)p->n_params,
                     r->bf16_moments ? 4 : 8, (long long)(p->n_params - p->offload_resident));
        else if (p->host_optimizer_bytes > 0)
            snprintf(what + strlen(what), sizeof what - strlen(what), "%soptimizer %s x %lld params (fp32 master, Adam "
                     "m, v)", what[0] ? " + " : "", r->bf16_moments ? "8 B/param" : "12 B/param",
                     (long long)(r->mesh.on ? p->n_params_rank : p->n_params));
        if (!what[0]) snprintf(what, sizeof what, "nothing offloaded");
        char hb[64] = "";
        if (host_limited) snprintf(hb, sizeof hb, "; host budget %.3f GiB", x->host_budget / 1073741824.0);
        fprintf(f, "%-24s %20zu %12s   %s (not in the device total%s)\n", "host (pinned):", p->host_bytes, g, what, hb);
    }
    if (x->ckpt_stage_bytes) { /* the sharded checkpoints' host staging (the caller's figure): per rank, not pinned */
        const size_t cs = x->ckpt_stage_bytes;
        human(g, sizeof g, cs);
        fprintf(f, "%-24s %20zu %12s   8 B x min(%lld-element pieces, largest tensor %lld) (host, per rank, not in the "
                "device total)\n", "checkpoint staging:", cs, g, (long long)x->ckpt_chunk_elems,
                (long long)x->ckpt_max_numel);
    }
    if (x->library_host_bytes) { /* plan --library: the session's host arena (the caller's figure) */
        human(g, sizeof g, x->library_host_bytes);
        char kv[64] = "";
        if (x->library_kv_bytes) snprintf(kv, sizeof kv, ", %.1f MiB of it the KV cache", x->library_kv_bytes / 1048576.0);
        fprintf(f, "%-24s %20zu %12s   the batch, per-token arrays, routes, top-k and sampling scratch of %lld tokens%s "
                "(host, one arena at flatmoe_open, not in the device total)\n", "library host scratch:",
                x->library_host_bytes, g, (long long)(r->B * r->T), kv);
    }
    if (budget) {
        char b[32];
        human(b, sizeof b, budget);
        char how[400] = "";
        if (x->budget_what) snprintf(how, sizeof how, " (%s)", x->budget_what);
        if (p->total <= budget) fprintf(f, "fits in %s GiB%s (%.1f%% used)", b, how, 100.0 * (double)p->total / (double)budget);
        else fprintf(f, "DOES NOT FIT in %s GiB%s: largest live set %s", b, how, fm_plan_set_name(largest_set(p)));
        if (host_limited && p->host_bytes > x->host_budget) fprintf(f, "; host memory DOES NOT FIT its budget");
        fprintf(f, "\n");
    } else if (host_limited && p->host_bytes > x->host_budget) {
        fprintf(f, "host memory DOES NOT FIT: %.3f GiB pinned against a host budget of %.3f GiB\n",
                p->host_bytes / 1073741824.0, x->host_budget / 1073741824.0);
    }
    fprintf(f, "\nFLOPs per token: model %.4g = 6 x N_active (%lld) + 6 x L x (heads x head_dim) x seq-len (causal "
            "attention); hardware %.4g (+ recomputed forwards, less keep-attention layers' attention)\n", p->flops_model_token, (long long)p->n_active,
            p->flops_hw_token);
    fprintf(f, "FLOPs per step (%lld tokens): model %.4g, hardware %.4g\n", (long long)p->tokens_per_step,
            p->flops_model_token * (double)p->tokens_per_step, p->flops_hw_token * (double)p->tokens_per_step);
    if (x->proj) {
        const fm_projection *pr = x->proj;
        fprintf(f, "\nprojected step: %.4g s, %.0f tokens/s, MFU %.1f%% of %.4g TFLOP/s (rates: %s)\n", pr->step_s,
                pr->tokens_per_s, 100.0 * pr->mfu, x->calib ? x->calib->peak_flops / 1e12 : 0.0,
                x->calib ? x->calib->source : "?");
        for (int i = 0; i < FM_PROJ_PHASES; i++)
            if (pr->sec[i] > 0)
                fprintf(f, "  %-22s %12.4g s %6.1f%%\n", fm_proj_phase_names[i], pr->sec[i],
                        100.0 * pr->sec[i] / pr->step_s);
        if (pr->offload_copy_s > 0)
            fprintf(f, "  (checkpoint offload copies %.4g s in all, %.4g s of it not hidden)\n", pr->offload_copy_s,
                    pr->sec[FM_PROJ_OFFLOAD]);
        if (pr->opt_link_s > 0)
            fprintf(f, "  (streamed optimizer: host link %.4g s for the %lld streamed parameters)\n", pr->opt_link_s,
                    (long long)(p->n_params - p->offload_resident));
        if (x->expert) {
            char line[600];
            fm_expert_choice_line(x->expert, line, sizeof line);
            fprintf(f, "%s\n", line);
        }
        if (!m->on && r->state_layout.ranks > 1)
            fprintf(f, "  (compute only: the collectives of this run over %d ranks are not projected; plan it with "
                    "--world %d and the same --dp/--ep/--sp for them)\n", r->state_layout.ranks, r->state_layout.ranks);
        if (m->on && x->calib)
            fprintf(f, "  (collectives at %s links: %.0f GB/s within a node, %.0f GB/s across, per GPU per direction; "
                    "only the time compute does not hide is counted: fm_project.h)\n",
                    x->calib->mesh_link_measured ? "measured" : "NOMINAL (not measured)", x->calib->intra_node_bw / 1e9,
                    x->calib->inter_node_bw / 1e9);
    }
    if (m->on && !fits) /* no launch line for a plan that does not fit: it would be refused */
        fprintf(f, "\nlaunch: none (this mesh does not fit: see above)\n");
    else if (m->on)
        print_mesh_launch(r, p, x, f);
}

void fm_plan_print_json(const fm_plan_req *r, const fm_plan *p, const fm_plan_report *x, FILE *f) {
    const size_t budget = x->budget;
    fprintf(f, "{\"model_type\":\"%s\",\"params\":%lld,\"active_params\":%lld,\"micro_batch\":%lld,\"seq_len\":%lld,\"sp\":%lld,\"ep\":%lld,"
            "\"recomputed_layers\":%lld,\"keep_attention_layers\":%lld,\"moe_chunk_tokens\":%lld,\"moe_chunks\":%lld,\"ce_block_tokens\":%lld,"
            "\"ce_block_vocab\":%lld,\"adam_moments\":\"%s\",\"expert_precision\":\"%s\",\"live_sets\":{",
            r->cfg.model_type_name, (long long)p->n_params, (long long)p->n_active, (long long)r->B, (long long)r->T,
            (long long)(r->sp > 1 ? r->sp : 1), (long long)(r->ep > 1 ? r->ep : 1), (long long)p->n_recomputed, (long long)p->n_keep_attention, (long long)r->moe_chunk_tokens, (long long)p->moe_K,
            (long long)r->ce_block_tokens, (long long)r->ce_block_vocab, r->bf16_moments ? "bf16" : "fp32",
            r->expert_fp8 ? "fp8" : "bf16");
    for (int i = 0; i < FM_PLAN_SETS; i++) fprintf(f, "%s\"%s\":%zu", i ? "," : "", fm_plan_set_name(i), p->bytes[i]);
    if (r->mesh.on) fprintf(f, ",\"communication buffers\":%zu", p->comm_bytes);
    const bool host_ok = x->host_budget == FM_HOST_BUDGET_UNLIMITED || p->host_bytes <= x->host_budget;
    fprintf(f, "},\"total_bytes\":%zu,\"budget_bytes\":%zu,\"fits\":%s,\"flops_per_token_model\":%.17g,"
            "\"flops_per_token_hardware\":%.17g,\"tokens_per_step\":%lld,\"offloaded_boundaries\":%lld,"
            "\"host_pinned_bytes\":%zu,\"offload_optimizer\":%s,\"device_mem_bytes\":%zu,\"context_bytes\":%zu",
            p->total, budget, ((budget == 0 || p->total <= budget) && host_ok) ? "true" : "false", p->flops_model_token,
            p->flops_hw_token, (long long)p->tokens_per_step, (long long)p->n_offloaded_boundaries, p->host_bytes,
            r->offload_optimizer ? "true" : "false", x->device_mem, x->context_bytes);
    if (r->offload_optimizer && !r->mesh.on) { /* --optimizer-offload-fraction: the split */
        const double per = 4.0 + 2.0 * (r->bf16_moments ? 2.0 : 4.0);
        char fr[32];
        fm_plan_offload_fraction_text(p, fr, sizeof fr);
        fprintf(f, ",\"optimizer_offload\":{\"fraction\":%s,\"buckets\":%lld,\"streamed_buckets\":%lld,"
                "\"resident_params\":%lld,\"resident_bytes\":%.0f,\"streamed_bytes\":%.0f,\"link_s\":%.6g}", fr,
                (long long)p->offload_buckets, (long long)p->offload_streamed_buckets, (long long)p->offload_resident,
                (double)p->offload_resident * per, (double)(p->n_params - p->offload_resident) * per,
                x->proj ? x->proj->opt_link_s : 0.0);
    }
    if (x->host_budget != FM_HOST_BUDGET_UNLIMITED) fprintf(f, ",\"host_budget_bytes\":%zu", x->host_budget);
    fprintf(f, ",\"checkpoint_staging_bytes\":%zu", /* per rank, host, not pinned (the text's line) */
            x->ckpt_stage_bytes);
    if (x->library_host_bytes)
        fprintf(f, ",\"library_host_bytes\":%zu,\"library_kv_bytes\":%zu", x->library_host_bytes, x->library_kv_bytes);
    fprintf(f, ",\"master_weights\":\"%s\",\"state_bytes_per_param\":%d",
            fm_master_recipe_name((fm_master_recipe)r->state_layout.master_recipe), fm_plan_state_bytes_per_param(r));
    if (r->mesh.on)
        fprintf(f, ",\"mesh\":{\"world\":%lld,\"dp\":%lld,\"ep\":%lld,\"sp\":%lld,\"gpus_per_node\":%lld,"
                "\"params_rank\":%lld}", (long long)(r->mesh.dp * r->mesh.sp), (long long)r->mesh.dp, (long long)r->mesh.ep,
                (long long)r->mesh.sp, (long long)r->mesh.gpus_per_node, (long long)p->n_params_rank);
    char ej[FM_EXPERT_CHOICE_JSON_MAX];
    if (x->expert && fm_expert_choice_json(x->expert, ej, sizeof ej) == FM_OK) fprintf(f, ",\"expert_gemm\":%s", ej);
    /* fp8: which path the expert live set was planned for (metrics.jsonl's header key) */
    if (r->expert_fp8) fprintf(f, ",\"expert_fp8_path\":\"%s\"", r->expert_fp8_codes ? "codes" : "emulated");
    if (r->expert_fp8) fprintf(f, ",\"fp8_weight_cache\":%s", r->layout.expert_fp8_cache ? "true" : "false");
    if (x->proj) {
        const fm_projection *pr = x->proj;
        fprintf(f, ",\"projected\":{\"step_s\":%.6g,\"tokens_per_s\":%.6g,\"mfu\":%.6g,\"peak_flops\":%.6g,"
                "\"calibration\":\"", pr->step_s, pr->tokens_per_s, pr->mfu, x->calib ? x->calib->peak_flops : 0.0);
        for (const char *c = x->calib ? x->calib->source : ""; *c; c++)
            if (*c == '"' || *c == '\\') fprintf(f, "\\%c", *c);
            else if ((unsigned char)*c >= 0x20) fputc(*c, f);
        fprintf(f, "\",\"phases_s\":{");
        const int nph = r->mesh.on ? FM_PROJ_PHASES : FM_PROJ_OPTIMIZER + 1; /* one rank: as before */
        for (int i = 0; i < nph; i++) fprintf(f, "%s\"%s\":%.6g", i ? "," : "", fm_proj_phase_names[i], pr->sec[i]);
        fprintf(f, "}}");
    }
    fprintf(f, "}\n");
}

