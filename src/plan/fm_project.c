#include "fm_project.h"

#include <math.h>
#include <string.h>

#include "../bounded/fm_linear_ce.h"
#include "../bounded/fm_linear_ce_ring.h"
#include "fm_mesh_bound.h"

const char *const fm_proj_phase_names[FM_PROJ_PHASES] = {
    "attention", "dense GEMMs", "expert GEMMs", "memory traffic", "LM head + loss",
    "recompute", "MoE chunk recompute", "offload (unhidden)", "optimizer",
    "ZeRO-3 gather/scatter", "EP all-to-all", "SP all-to-all", "vocab ring"};

double fm_project_adamw_bytes(int a, bool bf16_moments, int master_recipe) {
    const double mv = bf16_moments ? 2.0 : 4.0;
    if (master_recipe != FM_MASTER_FP32) /* g read, p read and written; Kahan's buffer read and written */
        return 3.0 * a + (master_recipe == FM_MASTER_BF16_KAHAN ? 4.0 : 0.0) + 4.0 * mv;
    /* g read, p written (a each), master read+written when the weights are not the master
     * (a != 4; on the CPU p is the master, read and written), m and v read and written */
    const double w = a == 4 ? 4.0 + 8.0 : 2.0 * a + 8.0;
    return w + 4.0 * mv;
}

static double act_bytes_of(const fm_plan_req *r) {
    if (r->target == FM_PLAN_TARGET_CPU) return 4;
    if (r->target == FM_PLAN_TARGET_CUDA) return 2;
    return (double)sizeof(fm_act);
}

/* Seconds of `flops` at `rate` FLOP/s (0 FLOPs: 0). */
static double at(double flops, double rate) { return flops > 0 ? flops / rate : 0.0; }

/* The expert GEMMs of one layer's forward (*f) and backward (*b), seconds per micro-batch, in
 * the sm90 form (the table's sm90 curves; cuBLAS's when it has none) or cuBLAS's: 2 N k 3 H I
 * FLOPs forward at expert_fwd(rpe), twice that backward at expert_bwd(rpe). */
double fm_project_rows_per_expert(const fm_plan_req *r, const fm_plan *p) {
    const fm_config *c = &r->cfg;
    const int64_t sp = r->mesh.on ? r->mesh.sp : r->sp > 1 ? r->sp : 1;
    const int64_t ep = r->mesh.on ? r->mesh.ep : r->ep > 1 ? r->ep : 1; /* an owner gets rows from ep sources */
    const double N = (double)r->B * (double)(r->T / sp);
    const double c_eff = r->moe_chunk_tokens > 0 ? (double)p->moe_c_eff : N;
    return (double)c->num_experts_per_tok * c_eff * (double)ep / (double)(c->num_experts > 0 ? c->num_experts : 1);
}

/* --expert-precision fp8 on E4M3 codes timed at the table's fp8 curves (the run's path where the
 * table has them). */
static bool fp8_curves(const fm_plan_req *r, const fm_calib *cb) {
    return r->expert_fp8 && r->expert_fp8_codes && cb->expert_fwd_fp8.n > 0 && cb->expert_bwd_fp8.n > 0;
}

double fm_project_fp8_weight_quant_s(const fm_plan_req *r, const fm_calib *cb) {
    if (!fp8_curves(r, cb)) return 0;
    const fm_config *c = &r->cfg;
    const int64_t ep = r->mesh.on ? r->mesh.ep : r->ep > 1 ? r->ep : 1;
    const double elems = 3.0 * (double)(c->num_experts / ep) * (double)c->hidden_size * (double)c->moe_intermediate_size;
    return 4.0 * elems / (cb->fp8_weight_quant_bw > 0 ? cb->fp8_weight_quant_bw : cb->elementwise_bw);
}

double fm_project_fp8_weight_sets(const fm_plan_req *r, const fm_plan *p) {
    const double L = (double)r->cfg.num_hidden_layers, nr = (double)p->n_recomputed;
    const double ga = (double)(r->grad_accum > 0 ? r->grad_accum : 1);
    if (r->layout.expert_fp8_cache) return L / ga;
    const int64_t last = r->cfg.num_hidden_layers - 1;
    const bool last_rc = last >= 0 && r->recompute && r->recompute[last];
    return L + nr + fmax(0.0, L - nr - (last_rc ? 0.0 : 1.0));
}

static void expert_layer_s(const fm_plan_req *r, const fm_plan *p, const fm_calib *cb, bool sm90, double *f, double *b) {
    const fm_config *c = &r->cfg;
    const int64_t sp = r->mesh.on ? r->mesh.sp : r->sp > 1 ? r->sp : 1;
    const double N = (double)r->B * (double)(r->T / sp), rpe = fm_project_rows_per_expert(r, p);
    const double exp_flops = 2.0 * N * (double)c->num_experts_per_tok * 3.0 * (double)c->hidden_size *
                             (double)c->moe_intermediate_size;
    /* --expert-precision fp8 on E4M3 codes: the table's fp8 curves (quantization included) less
     * the one layer's weight quantization each point holds (calibrate quantizes the weights at
     * every product; the run does so fm_project_fp8_weight_sets times, charged apart), else the
     * sm90 kernel's (the same sync-free schedule at bf16 rates), else cuBLAS's */
    if (fp8_curves(r, cb)) {
        const double wq = fm_project_fp8_weight_quant_s(r, cb);
        *f = fmax(0.0, at(exp_flops, fm_calib_rate(&cb->expert_fwd_fp8, rpe)) - wq);
        *b = fmax(0.0, at(2.0 * exp_flops, fm_calib_rate(&cb->expert_bwd_fp8, rpe)) - wq);
        return;
    }
    const bool s9 = (sm90 || (r->expert_fp8 && r->expert_fp8_codes)) && cb->expert_fwd_sm90.n > 0 &&
                    cb->expert_bwd_sm90.n > 0;
    *f = at(exp_flops, fm_calib_rate(s9 ? &cb->expert_fwd_sm90 : &cb->expert_fwd, rpe));
    *b = at(2.0 * exp_flops, fm_calib_rate(s9 ? &cb->expert_bwd_sm90 : &cb->expert_bwd, rpe));
}

double fm_project_expert_s(const fm_plan_req *r, const fm_plan *p, const fm_calib *cb, bool sm90) {
    double f = 0, b = 0;
    expert_layer_s(r, p, cb, sm90, &f, &b);
    const double L = (double)r->cfg.num_hidden_layers, nr = (double)p->n_recomputed;
    const double ga = (double)(r->grad_accum > 0 ? r->grad_accum : 1);
    /* every layer's forward and backward, the recomputed layers' forward again, and under chunked
     * MoE the other layers' expert forward again (fm_project's EXPERTS, RECOMPUTE, MOE_RECOMPUTE);
     * fp8 on codes: the weight quantizations apart */
    return ga * (L * (f + b) + nr * f + (r->moe_chunk_tokens > 0 ? (L - nr) * f : 0.0) +
                 fm_project_fp8_weight_sets(r, p) * fm_project_fp8_weight_quant_s(r, cb));
}

bool fm_project_expert_sm90(const fm_plan_req *r, const fm_plan *p, const fm_calib *cb) {
    if (cb->expert_fwd_sm90.n == 0 || cb->expert_bwd_sm90.n == 0) return false;
    if (r->expert_sync_free) return true;
    if (!r->expert_gemm_auto || r->ep > 1 || (r->mesh.on && r->mesh.ep > 1)) return false; /* --ep: cuBLAS */
    return fm_project_expert_s(r, p, cb, true) < fm_project_expert_s(r, p, cb, false); /* ties: cuBLAS */
}

void fm_project(const fm_plan_req *r, const fm_plan *p, const fm_calib *cb, fm_projection *o) {
    memset(o, 0, sizeof *o);
    const fm_config *c = &r->cfg;
    const double a = act_bytes_of(r);
    const bool mesh = r->mesh.on;
    const double sp = mesh ? (double)r->mesh.sp : r->sp > 1 ? (double)r->sp : 1.0;
    const double B = (double)r->B, T = (double)r->T, N = B * (double)(r->T / (int64_t)sp), H = (double)c->hidden_size;
    const double L = (double)c->num_hidden_layers, E = (double)c->num_experts, k = (double)c->num_experts_per_tok;
    const double I = (double)c->moe_intermediate_size, V = (double)c->vocab_size;
    const double qd = (double)(c->num_attention_heads * c->head_dim), kd = (double)(c->num_key_value_heads * c->head_dim);
    const double nr = (double)p->n_recomputed, nka = (double)p->n_keep_attention;
    const bool chunked = r->moe_chunk_tokens > 0;

    /* one layer's forward, by part */
    const double att_f = at(2.0 * B * T * T * qd / sp, fm_calib_rate(&cb->att_fwd, T));
    const double att_b = at(5.0 * B * T * T * qd / sp, fm_calib_rate(&cb->att_bwd, T));
    const double dense_flops = 2.0 * N * H * (qd + 2.0 * kd) + 2.0 * N * qd * H + 2.0 * N * H * E;
    const double gemm_rate = fm_calib_rate(&cb->gemm, N);
    const double dense_f = at(dense_flops, gemm_rate), dense_b = at(2.0 * dense_flops, gemm_rate);
    /* the expert GEMMs: the sm90 kernel's curves when the run uses it (forced, or auto where the
     * table projects it faster: fm_project_expert_sm90), else cuBLAS's */
    o->expert_sm90 = fm_project_expert_sm90(r, p, cb);
    double exp_f = 0, exp_b = 0;
    expert_layer_s(r, p, cb, o->expert_sm90, &exp_f, &exp_b);
    /* bytes: 2 RMSNorms (read x, write y), 2 residual adds (3 tensors), RoPE in place on q and k,
     * router probabilities (fp32 N x E: logits in, probs out, read by top-k), SwiGLU (gate, up,
     * out over N k I); the dispatch's gather (x rows read k times, xe written) and combine (ye
     * read, out written) */
    const double elem_bytes = N * H * a * (4.0 + 6.0) + 2.0 * N * (qd + kd) * a + 12.0 * N * E + 3.0 * N * k * I * a;
    const double disp_bytes = N * k * H * a * 3.0 + N * H * a;
    const double mem_f = elem_bytes / cb->elementwise_bw + disp_bytes / cb->dispatch_bw;
    const double swiglu_disp = 3.0 * N * k * I * a / cb->elementwise_bw + disp_bytes / cb->dispatch_bw;

    double mb[FM_PROJ_PHASES] = {0};
    mb[FM_PROJ_ATTENTION] = L * (att_f + att_b);
    /* dense layers (qwen3_moe's decoder_sparse_step / mlp_only_layers): the SwiGLU MLP's GEMMs
     * instead of the experts': 6 N H Id forward, 12 backward + 4 forming gate and up again
     * (model/fm_dense_mlp.h) */
    const double Lm = (double)fm_config_num_moe_layers(c), Id = (double)c->dense_intermediate_size;
    const double Is = (double)fm_config_shared_width(c); /* the shared experts: the same MLP on every MoE layer */
    const double mlp_fb = (L - Lm) * at(22.0 * N * H * Id, gemm_rate) + (Is > 0 ? Lm * at(22.0 * N * H * Is, gemm_rate) : 0);
    mb[FM_PROJ_DENSE] = L * (dense_f + dense_b) + mlp_fb;
    /* fp8 on codes: exp_f, exp_b without the weights' quantization, charged here as often as the
     * run quantizes them (once a step with the weight cache) */
    mb[FM_PROJ_EXPERTS] = Lm * (exp_f + exp_b) + fm_project_fp8_weight_sets(r, p) * fm_project_fp8_weight_quant_s(r, cb);
    mb[FM_PROJ_MEMORY] = L * 3.0 * mem_f;
    /* recomputed forwards: the whole layer, less attention where kept */
    mb[FM_PROJ_RECOMPUTE] = nr * (dense_f + exp_f + mem_f) + (nr - nka) * att_f;
    if (chunked) mb[FM_PROJ_MOE_RECOMPUTE] = (L - nr) * (exp_f + swiglu_disp);

    /* head: final norm, embedding gather/scatter, LM head, loss */
    const bool lce = r->ce_block_tokens > 0 || r->ce_block_vocab > 0;
    const double nb = lce ? (double)(r->ce_block_tokens > 0 ? r->ce_block_tokens : FM_LCE_DEFAULT_BLOCK_TOKENS) : N;
    const double head_rate = fm_calib_rate(&cb->gemm, nb < N ? nb : N);
    double head = at((lce ? 8.0 : 6.0) * N * H * V, head_rate);
    /* plain: logits written, read by the loss, gradient written in place, read by 2 GEMMs; linear
     * CE: the fp32 strip written and folded in forward, written, turned into its gradient and read
     * in backward (a != 4: its act copy too) */
    head += (lce ? N * V * (4.0 * 5.0 + (a != 4 ? 2.0 * a : 0.0)) : N * V * a * 5.0) / cb->elementwise_bw;
    head += 8.0 * N * H * a / cb->elementwise_bw;
    mb[FM_PROJ_HEAD] = head;

    /* checkpoint offload: boundary l (< n_off) leaves during layer l+1's forward and comes back
     * during layer l+1's backward (with its recompute) */
    const double n_off = (double)p->n_offloaded_boundaries;
    if (n_off > 0) {
        const double bytes = N * H * a;
        const double t_out = bytes / cb->d2h, t_in = bytes / cb->h2d;
        const double layer_f = att_f + dense_f + exp_f + mem_f;
        const double layer_b = att_b + dense_b + exp_b + 2.0 * mem_f;
        double excess = 0;
        for (int64_t l = 0; l < p->n_offloaded_boundaries; l++) {
            /* the layer that hides boundary l's copies: l+1 (the head's work for the last one) */
            const bool rec = l + 1 < (int64_t)L && r->recompute && r->recompute[l + 1];
            const bool keep = rec && r->keep_attention && r->keep_attention[l + 1];
            const double hide_f = l + 1 < (int64_t)L ? layer_f : head;
            const double hide_b = (l + 1 < (int64_t)L ? layer_b : head) + (rec ? layer_f - (keep ? att_f : 0) : 0);
            excess += fmax(0.0, t_out - hide_f) + fmax(0.0, t_in - hide_b);
        }
        mb[FM_PROJ_OFFLOAD] = excess;
        o->offload_copy_s = n_off * (t_out + t_in);
    }

    const double ga = (double)(r->grad_accum > 0 ? r->grad_accum : 1);
    for (int i = 0; i < FM_PROJ_PHASES; i++) o->sec[i] = ga * mb[i]; /* the optimizer's is set below */
    o->offload_copy_s *= ga;

    /* optimizer */
    /* the parameters this rank updates: a mesh's per-rank count; the trainer's run under --ep
     * (E/ep experts per rank) and ZeRO (--zero 1 and 3: 1/W of everything; --zero 3 beside --ep:
     * 1/W of the non-expert part and the rank's whole E/ep experts), W = dp x sp */
    double P = (double)(mesh ? p->n_params_rank : p->n_params);
    if (!mesh) {
        const double Wz = (double)(r->train_dp > 1 ? r->train_dp : 1) * sp, epd = r->ep > 1 ? (double)r->ep : 1.0;
        const double Pexp = (double)fm_config_num_moe_layers(&r->cfg) * E * 3.0 * H * I, Pne = P - Pexp;
        if (r->train_zero == 1 && Wz > 1) P = P / Wz;
        else if (r->train_zero == 3 && Wz > 1) P = epd > 1 ? Pne / Wz + Pexp / epd : P / Wz;
        else if (epd > 1) P = Pne + Pexp / epd;
    }
    const double adam_b = fm_project_adamw_bytes((int)a, r->bf16_moments, r->state_layout.master_recipe);
    const double t_gpu = P * adam_b / cb->adamw_bw;
    double t_opt = 2.0 * a * P / cb->elementwise_bw; /* gradient zeroing and global norm */
    if (r->offload_optimizer) {
        /* --optimizer-offload-fraction: only the streamed part Ps crosses the link; the resident
         * part is updated on the device as the on-device AdamW is (a mesh streams all of it) */
        const double Ps = mesh || p->n_params <= 0 ? P : P * (double)(p->n_params - p->offload_resident) / (double)p->n_params;
        const double per = 4.0 + 2.0 * (r->bf16_moments ? 2.0 : 4.0); /* master, m, v each way */
        const double beta = fmin((double)(r->offload_bucket > 0 ? r->offload_bucket : 1), Ps);
        t_opt += (P - Ps) * adam_b / cb->adamw_bw;
        if (r->offload_slots >= 2) {
            const double up = Ps * per / cb->h2d_duplex, down = Ps * per / cb->d2h_duplex;
            const double fill = beta * (per / cb->h2d + adam_b / cb->adamw_bw + per / cb->d2h);
            t_opt += fmax(fmax(up, down), Ps * adam_b / cb->adamw_bw) + fill;
            o->opt_link_s = fmax(up, down);
        } else {
            t_opt += Ps * (per / cb->h2d + adam_b / cb->adamw_bw + per / cb->d2h);
            o->opt_link_s = Ps * per * (1.0 / cb->h2d + 1.0 / cb->d2h);
        }
    } else {
        t_opt += t_gpu;
    }
    if (r->optimizer_overlap) { /* on the update stream while the next step's first forward runs */
        /* The on-device AdamW is bound by HBM bandwidth, and so are the short-sequence GEMMs,
         * norms and dispatch beside it (measured on the H200: no gain at 4K-16K), so only the
         * compute-bound attention forward hides it; the streamed one waits on the host link,
         * which the whole forward hides. */
        const double hide = r->offload_optimizer ? L * (att_f + dense_f + exp_f + mem_f) : L * att_f;
        t_opt = fmax(0.0, t_opt - hide);
    }
    o->sec[FM_PROJ_OPTIMIZER] = t_opt;
    if (mesh) {
        const fm_mesh_layer_times lt = {att_f, att_b, dense_f, dense_b, exp_f, exp_b, mem_f, head};
        fm_mesh_project_comm(r, p, cb, &lt, o);
    }
    for (int i = 0; i < FM_PROJ_PHASES; i++) o->step_s += o->sec[i];
    const double tokens = (double)p->tokens_per_step;
    o->tokens_per_s = o->step_s > 0 ? tokens / o->step_s : 0;
    /* the devices the step's tokens run on: a mesh's dp x sp, the trainer's run's --dp x --sp (MFU per device) */
    const double world = mesh ? (double)(r->mesh.dp * r->mesh.sp) : (double)(r->train_dp > 1 ? r->train_dp : 1) * sp;
    o->mfu = o->step_s > 0 && cb->peak_flops > 0 ? p->flops_model_token * tokens / o->step_s / cb->peak_flops / world : 0;
}
