/* The planner: its hand-written bound formulas equal the bytes the layout code takes (measured
 * with measuring arenas) for every shipped config and a range of flags, so the plan and the
 * allocation cannot drift apart; hand arithmetic for a few live sets and for the step-time
 * projection; the chooser (both budgets, fast and slow links, fixed flags, the advice);
 * calibration tables; budgets and their messages; byte parsing. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "fm_test.h"
#include "backend/cuda/fm_backend_cuda.h"
#include "plan/fm_choose.h"
#include "plan/fm_plan.h"
#include "plan/fm_project.h"
#include "train/fm_offload_adamw.h"
#include "train/fm_optim.h"

static int g_keep_att = 0; /* check_formulas_match_layout: 1 = every recomputed layer keeps attention,
                              2 = every other one (keep-attention, schedule/fm_recompute.h) */

static void check_formulas_match_layout(const char *path, int64_t B, int64_t T, int64_t chunk, int nr, int64_t cbt,
                                        int64_t cbv) {
    fm_plan_req req;
    memset(&req, 0, sizeof req);
    req.model_state_bytes = fm_model_state_bound; /* the trainer's answer (train/fm_optim.h) */
    CHECK(fm_config_load(&req.cfg, path) == FM_OK);
    const int64_t L = req.cfg.num_hidden_layers;
    bool rc[L];
    bool keep[L];
    for (int64_t l = 0; l < L; l++) rc[l] = l < nr;
    for (int64_t l = 0; l < L; l++) keep[l] = g_keep_att == 1 || (g_keep_att == 2 && l % 2 == 0);
    req.B = B;
    req.T = T;
    req.recompute = rc;
    req.keep_attention = keep;
    req.moe_chunk_tokens = chunk;
    req.ce_block_tokens = cbt;
    req.ce_block_vocab = cbv;
    req.threads = 2;
    fm_plan p;
    fm_plan_compute(&req, &p);
    size_t measured[FM_LIVE_COUNT];
    fm_layout_opts lo = {rc, chunk, cbt, cbv, 0, keep};
    fm_model_plan_bytes(&req.cfg, B, T, &lo, measured);
    /* model state: the parameter store's layout, measured, and AdamW's two moments */
    measured[FM_LIVE_MODEL_STATE] = fm_param_store_measure(fm_config_num_params(&req.cfg)) +
                                    fm_adamw_state_bytes(fm_config_num_params(&req.cfg), false);
    for (int i = 0; i < FM_LIVE_COUNT; i++)
        CHECK_MSG(fm_arena_round(p.bytes[i]) == fm_arena_round(measured[i]),
                  "%s B=%lld T=%lld chunk=%lld recompute=%d keep-attention=%d: %s planned %zu, laid out %zu", path,
                  (long long)B, (long long)T, (long long)chunk, nr, g_keep_att, fm_live_set_names[i], p.bytes[i],
                  measured[i]);
}

static void test_formulas(void) {
    const char *cfgs[] = {"configs/tiny.json", "configs/olmoe-1b-7b.json", "configs/qwen3-30b-a3b.json",
                          "configs/mixtral-8x7b.json", "tests/data/micro.json"};
    for (int i = 0; i < 5; i++) {
        check_formulas_match_layout(cfgs[i], 1, 64, 0, 0, 0, 0);
        check_formulas_match_layout(cfgs[i], 2, 33, 0, 2, 16, 0);
        check_formulas_match_layout(cfgs[i], 3, 17, 5, 0, 0, 100);
        check_formulas_match_layout(cfgs[i], 1, 128, 16, 3, 32, 512);
        check_formulas_match_layout(cfgs[i], 1, 100, 1000, 1, 0, 0);
    }
    /* keep-attention: the recomputed layers' own att and lse (all of them, then every other one) */
    for (g_keep_att = 1; g_keep_att <= 2; g_keep_att++)
        for (int i = 0; i < 5; i++) {
            check_formulas_match_layout(cfgs[i], 1, 64, 0, 0, 0, 0);
            check_formulas_match_layout(cfgs[i], 2, 33, 0, 2, 16, 0);
            check_formulas_match_layout(cfgs[i], 3, 17, 5, 3, 0, 100);
            check_formulas_match_layout(cfgs[i], 1, 128, 16, 1000, 32, 512); /* every layer */
            check_formulas_match_layout(cfgs[i], 1, 100, 1000, 1, 0, 0);
        }
    g_keep_att = 0;
}

/* Keep-attention on OLMoE-1B-7B at 128K tokens on the CUDA target (bf16): per layer it adds
 * att [N, 2048] bf16 + lse [16, N] fp32 (640 MiB at 128K) to full recompute's layer activations,
 * and its hardware FLOPs drop by the attention forward of every layer, 2 x 2048 x T per token. */
static void test_keep_attention(void) {
    fm_plan_req req;
    memset(&req, 0, sizeof req);
    req.model_state_bytes = fm_model_state_bound;
    CHECK(fm_config_load(&req.cfg, "configs/olmoe-1b-7b.json") == FM_OK);
    req.B = 1;
    req.T = 131072;
    req.target = FM_PLAN_TARGET_CUDA;
    req.moe_chunk_tokens = 4096;
    bool rc[16], keep[16];
    for (int l = 0; l < 16; l++) rc[l] = keep[l] = true;
    req.recompute = rc;
    fm_plan f, k;
    fm_plan_compute(&req, &f);
    req.keep_attention = keep;
    fm_plan_compute(&req, &k);
    CHECK(f.n_keep_attention == 0 && k.n_keep_attention == 16 && k.n_recomputed == 16);
    const double N = 131072;
    CHECK_CLOSE((double)(k.bytes[FM_LIVE_LAYER_ACTS] - f.bytes[FM_LIVE_LAYER_ACTS]), 16 * (N * 2048 * 2 + 16 * N * 4),
                1e-12);
    CHECK(k.total - f.total == k.bytes[FM_LIVE_LAYER_ACTS] - f.bytes[FM_LIVE_LAYER_ACTS]);
    CHECK_CLOSE(f.flops_hw_token - k.flops_hw_token, 16 * 2.0 * 2048 * N, 1e-12);
    CHECK(k.flops_model_token == f.flops_model_token);
    /* keep flags where nothing is recomputed: the plain plan */
    for (int l = 0; l < 16; l++) rc[l] = false;
    fm_plan_compute(&req, &k);
    req.keep_attention = NULL;
    fm_plan_compute(&req, &f);
    CHECK(k.n_keep_attention == 0 && k.total == f.total && k.flops_hw_token == f.flops_hw_token);
}

/* Hand arithmetic for OLMoE-1B-7B at micro-batch 1, seq-len 4096. */
static void test_hand_arithmetic(void) {
    fm_plan_req req;
    memset(&req, 0, sizeof req);
    req.model_state_bytes = fm_model_state_bound; /* the trainer's answer (train/fm_optim.h) */
    CHECK(fm_config_load(&req.cfg, "configs/olmoe-1b-7b.json") == FM_OK);
    req.B = 1;
    req.T = 4096;
    req.threads = 1;
    fm_plan p;
    fm_plan_compute(&req, &p);
    const double N = 4096, H = 2048, V = 50304, k = 8, I = 1024, L = 16;
    CHECK(p.n_params == 6919161856LL);
    CHECK_CLOSE((double)p.bytes[FM_LIVE_MODEL_STATE], 16.0 * 6919161856.0, 1e-9);
    /* 17 boundaries of N x H fp32, plus tokens, targets, the packed documents' positions and
     * starts ([N] int32 each, laid out whatever the data), the RoPE tables (4096 x 64 x 2) and the
     * micro-batch's device results (4 + 2 x 16 doubles = 288 bytes, 320 rounded to 64) */
    CHECK_CLOSE((double)p.bytes[FM_LIVE_BOUNDARIES], 17 * N * H * 4 + 4 * N * 4 + 2 * 4096 * 64 * 4 + 320, 1e-12);
    /* vocabulary projection: logits N x V dominate */
    CHECK_CLOSE((double)p.bytes[FM_LIVE_VOCAB], N * V * 4 + N * H * 4 + 2 * N * 4, 1e-12);
    /* plain expert dispatch: per layer N*k routes x (2H + 3I) fp32 + indices; plus one backward */
    double per_route = (2 * H + 3 * I) * 4 + 8;
    double expect = L * (N * k * per_route) + N * k * (2 * H + 3 * I) * 4; /* offsets live in host memory */
    CHECK_CLOSE((double)p.bytes[FM_LIVE_EXPERT], expect, 1e-6);
    /* FLOPs: 6 * active + 6 * L * 2048 * 4096 */
    CHECK_CLOSE(p.flops_model_token, 6.0 * (double)p.n_active + 6.0 * 16 * 2048 * 4096, 1e-12);
    CHECK(p.flops_hw_token == p.flops_model_token);
    /* chunked: 16 layers' dispatches become one chunk's */
    req.moe_chunk_tokens = 512;
    fm_plan q;
    fm_plan_compute(&req, &q);
    CHECK(q.moe_K == 8 && q.moe_c_eff == 512);
    CHECK(q.bytes[FM_LIVE_EXPERT] * 50 < p.bytes[FM_LIVE_EXPERT]);
    CHECK_CLOSE(q.flops_hw_token - q.flops_model_token, 16 * 2 * 8 * 3 * 2048.0 * 1024, 1e-12);
    /* linear CE: one 1024 x 4096 fp32 strip + 3 per-token vectors (m, z, tgt: the trainer asks for
     * no entropy), instead of N x V logits */
    req.ce_block_tokens = 1024;
    req.ce_block_vocab = 4096;
    fm_plan_compute(&req, &q);
    CHECK_CLOSE((double)q.bytes[FM_LIVE_VOCAB], N * H * 4 + 2 * N * 4 + 1024 * 4096 * 4.0 + 3 * 1024 * 4, 1e-12);
    /* blocks larger than the batch or the vocabulary are clamped to N x V, as the call clamps them */
    req.ce_block_tokens = 8192;
    req.ce_block_vocab = 65536;
    fm_plan_compute(&req, &q);
    CHECK_CLOSE((double)q.bytes[FM_LIVE_VOCAB], N * H * 4 + 2 * N * 4 + N * V * 4.0 + 3 * N * 4, 1e-12);
    CHECK_CLOSE(q.flops_hw_token - p.flops_hw_token, 2 * 8 * 3 * 2048.0 * 1024 * 16 + 2 * V * H, 1e-12);
    req.ce_block_tokens = req.ce_block_vocab = 0;
}

/* A GPU run planned from this build: bf16 activations, the CUDA workspaces. */
static void test_cuda_target(void) {
    fm_plan_req req;
    memset(&req, 0, sizeof req);
    req.model_state_bytes = fm_model_state_bound; /* the trainer's answer (train/fm_optim.h) */
    CHECK(fm_config_load(&req.cfg, "configs/olmoe-1b-7b.json") == FM_OK);
    req.B = 1;
    req.T = 4096;
    req.target = FM_PLAN_TARGET_CUDA;
    fm_plan g, c;
    fm_plan_compute(&req, &g);
    req.target = FM_PLAN_TARGET_CPU;
    fm_plan_compute(&req, &c);
    /* 16 B/param either way; boundaries in bf16: 17 x 4096 x 2048 x 2 + tokens, targets, document
     * positions and starts + RoPE tables */
    CHECK(g.bytes[FM_LIVE_MODEL_STATE] == c.bytes[FM_LIVE_MODEL_STATE]);
    CHECK(g.bytes[FM_LIVE_BOUNDARIES] == 17ull * 4096 * 2048 * 2 + 4 * 4096 * 4 + 2 * 4096 * 64 * 4 + 320);
    CHECK(g.bytes[FM_LIVE_LAYER_ACTS] < c.bytes[FM_LIVE_LAYER_ACTS]);
    /* cuDNN workspace sized for a 4K backward: 16 x 4096 x 128 x 4 B dQ + rows + 1 MiB < 64 MiB,
     * so the 64 MiB floor; + cuBLASLt 32 MiB + 16 MiB scratch */
    CHECK(g.gpu_workspace == (size_t)64 << 20);
    CHECK(g.bytes[FM_PLAN_ATTENTION] == (size_t)112 << 20);
    /* what flatmoe-cuda's own plan printed for this shape at 0b76194 (bench/RESULTS.md), less the
     * two [N,H] bf16 buffers the working set has dropped since (the recompute scratch, and d ln1
     * now in the free q-gradient buffer): 2 x 4096 x 2048 x 2 bytes, less the cuBLASLt
     * workspace's 64 -> 32 MiB, and less ln1 and ln2 per saved layer (16 x 2 x 16 MiB: formed
     * again in backward) and d att (16 MiB: in the dead incoming gradient), plus the device
     * results of a micro-batch (320 bytes with the boundaries), plus the packed documents'
     * positions and starts (2 x 4096 int32 with the boundaries, issue 28) */
    CHECK_MSG(g.total == 122175856896ull - 2 * 4096ull * 2048 * 2 - (32ull << 20) - (528ull << 20) + 320 + 2 * 4096 * 4,
              "cuda-target total %zu", g.total);
    /* 256K: a 4-head chunk's need under the 1 GiB cap: 4 x 262144 x 128 x 4 + 4 x 262144 x 4 + 1 MiB */
    req.T = 262144;
    req.target = FM_PLAN_TARGET_CUDA;
    fm_plan_compute(&req, &g);
    CHECK_MSG(g.gpu_workspace == (512ull + 4 + 1) << 20, "256K cuDNN workspace %zu", g.gpu_workspace);
    CHECK(fm_cuda_cudnn_workspace_auto(1, 262144, 16, 16, 128) == g.gpu_workspace);
    /* GQA (4 query heads a kv head) at 1M tokens: one kv group already needs 2 x 4 x 2^20 x 128 x 4 B
     * (+ rows + 1 MiB) > 1 GiB, which is still what is planned (cuDNN serves it; no fallback) */
    CHECK(fm_cuda_cudnn_workspace_auto(1, 1 << 20, 8, 2, 128) == (4096ull + 16 + 1) << 20);
    /* --bf16-moments: m and v at 2 B each, 4 B/param less than fp32 moments (each rounded to the
     * arena's alignment), nothing else changes */
    req.T = 4096;
    fm_plan_compute(&req, &c);
    req.bf16_moments = true;
    fm_plan_compute(&req, &g);
    const size_t np = (size_t)fm_config_num_params(&req.cfg);
    CHECK_MSG(c.bytes[FM_LIVE_MODEL_STATE] - g.bytes[FM_LIVE_MODEL_STATE] ==
                  2 * (fm_arena_round(np * 4) - fm_arena_round(np * 2)),
              "bf16 moments: model state %zu vs %zu", g.bytes[FM_LIVE_MODEL_STATE], c.bytes[FM_LIVE_MODEL_STATE]);
    CHECK(c.total - g.total == c.bytes[FM_LIVE_MODEL_STATE] - g.bytes[FM_LIVE_MODEL_STATE]);
}

/* A synthetic calibration table: every FLOP rate `flops`, every bandwidth `bw`, the link `link`. */
static void synth_calib(fm_calib *c, double flops, double bw, double link) {
    memset(c, 0, sizeof *c);
    snprintf(c->backend, sizeof c->backend, "cuda");
    snprintf(c->source, sizeof c->source, "synthetic");
    c->act_bytes = 2;
    c->peak_flops = flops;
    fm_calib_curve *cv[5] = {&c->gemm, &c->expert_fwd, &c->expert_bwd, &c->att_fwd, &c->att_bwd};
    for (int i = 0; i < 5; i++) fm_calib_add(cv[i], 1024, flops);
    c->elementwise_bw = c->dispatch_bw = c->adamw_bw = bw;
    c->h2d = c->d2h = c->h2d_duplex = c->d2h_duplex = link;
}

static void olmoe_req(fm_plan_req *req, int64_t T, fm_plan_target tgt) {
    memset(req, 0, sizeof *req);
    req->model_state_bytes = fm_model_state_bound;
    req->offload_state_bytes = fm_offload_model_state_bound;
    req->offload_bucket = FM_OFFLOAD_DEFAULT_BUCKET;
    req->offload_slots = 2;
    CHECK(fm_config_load(&req->cfg, "configs/olmoe-1b-7b.json") == FM_OK);
    req->B = 1;
    req->T = T;
    req->grad_accum = 1;
    req->threads = 1;
    req->target = tgt;
}

/* The projection's arithmetic by hand: OLMoE at 4K on the CPU target (a = 4), plain plan, every
 * FLOP at 1e12/s, every byte at 1e11/s. */
static void test_projection_by_hand(void) {
    fm_plan_req req;
    olmoe_req(&req, 4096, FM_PLAN_TARGET_CPU);
    fm_plan p;
    fm_plan_compute(&req, &p);
    fm_calib c;
    synth_calib(&c, 1e12, 1e11, 1e10);
    fm_projection pr;
    fm_project(&req, &p, &c, &pr);
    const double N = 4096, T = 4096, H = 2048, qd = 2048, kd = 2048, E = 64, k = 8, I = 1024, V = 50304, L = 16, a = 4;
    const double R = 1e12, bw = 1e11;
    CHECK_CLOSE(pr.sec[FM_PROJ_ATTENTION], L * 7.0 * T * T * qd / R, 1e-12); /* 2 fwd + 5 bwd */
    CHECK_CLOSE(pr.sec[FM_PROJ_DENSE], L * 3.0 * (2 * N * H * (qd + 2 * kd) + 2 * N * qd * H + 2 * N * H * E) / R, 1e-12);
    CHECK_CLOSE(pr.sec[FM_PROJ_EXPERTS], L * 3.0 * 2 * N * k * 3 * H * I / R, 1e-12);
    const double elem = N * H * a * 10 + 2 * N * (qd + kd) * a + 12 * N * E + 3 * N * k * I * a;
    const double disp = N * k * H * a * 3 + N * H * a;
    CHECK_CLOSE(pr.sec[FM_PROJ_MEMORY], L * 3.0 * (elem + disp) / bw, 1e-12);
    CHECK_CLOSE(pr.sec[FM_PROJ_HEAD], 6 * N * H * V / R + (5 * N * V * a + 8 * N * H * a) / bw, 1e-12);
    CHECK(pr.sec[FM_PROJ_RECOMPUTE] == 0 && pr.sec[FM_PROJ_MOE_RECOMPUTE] == 0 && pr.sec[FM_PROJ_OFFLOAD] == 0);
    const double P = (double)p.n_params;
    CHECK_CLOSE(pr.sec[FM_PROJ_OPTIMIZER], P * 28 / bw + 2 * a * P / bw, 1e-12);
    double sum = 0;
    for (int i = 0; i < FM_PROJ_PHASES; i++) sum += pr.sec[i];
    CHECK_CLOSE(pr.step_s, sum, 1e-12);
    CHECK_CLOSE(pr.tokens_per_s, N / sum, 1e-12);
    CHECK_CLOSE(pr.mfu, p.flops_model_token * N / sum / 1e12, 1e-12);
    /* ZeRO over 8 ranks: each updates (zeroes, norms) 1/8 of the parameters; beside --ep 4 under
     * --zero 3, 1/8 of the non-expert part and a quarter of the experts; --zero 0 --ep 4: a quarter
     * of the experts and all the rest */
    {
        fm_plan_req z = req;
        z.train_dp = 8, z.train_zero = 3;
        fm_projection zr;
        fm_project(&z, &p, &c, &zr);
        CHECK_CLOSE(zr.sec[FM_PROJ_OPTIMIZER], (P / 8) * 28 / bw + 2 * a * (P / 8) / bw, 1e-12);
        z.train_zero = 1;
        fm_project(&z, &p, &c, &zr);
        CHECK_CLOSE(zr.sec[FM_PROJ_OPTIMIZER], (P / 8) * 28 / bw + 2 * a * (P / 8) / bw, 1e-12);
        const double Pexp = L * E * 3 * H * I, Pz3 = (P - Pexp) / 8 + Pexp / 4, Pz0 = (P - Pexp) + Pexp / 4;
        z.train_zero = 3, z.ep = 4;
        fm_project(&z, &p, &c, &zr);
        CHECK_CLOSE(zr.sec[FM_PROJ_OPTIMIZER], Pz3 * 28 / bw + 2 * a * Pz3 / bw, 1e-12);
        z.train_zero = 0;
        fm_project(&z, &p, &c, &zr);
        CHECK_CLOSE(zr.sec[FM_PROJ_OPTIMIZER], Pz0 * 28 / bw + 2 * a * Pz0 / bw, 1e-12);
    }
    /* full recompute: every layer's forward once more, attention included */
    bool rc[16];
    for (int l = 0; l < 16; l++) rc[l] = true;
    req.recompute = rc;
    fm_plan q;
    fm_plan_compute(&req, &q);
    fm_projection qr;
    fm_project(&req, &q, &c, &qr);
    CHECK_CLOSE(qr.sec[FM_PROJ_RECOMPUTE], pr.sec[FM_PROJ_ATTENTION] * 2 / 7 + pr.sec[FM_PROJ_DENSE] / 3 +
                pr.sec[FM_PROJ_EXPERTS] / 3 + pr.sec[FM_PROJ_MEMORY] / 3, 1e-12);
    /* the streamed optimizer on a slow link: the link both ways at the duplex rate dominates */
    req.recompute = NULL;
    req.offload_optimizer = true;
    fm_plan_compute(&req, &q);
    fm_project(&req, &q, &c, &qr);
    const double beta = fmin((double)FM_OFFLOAD_DEFAULT_BUCKET, P);
    CHECK_CLOSE(qr.sec[FM_PROJ_OPTIMIZER], 2 * a * P / bw + P * 12 / 1e10 + beta * (12 / 1e10 + 28 / bw + 12 / 1e10), 1e-12);
    /* the sm90 expert curves: used only when the request says the run uses them and the table has them */
    {
        fm_calib s9 = c;
        fm_calib_add(&s9.expert_fwd_sm90, 1024, 2e12);
        fm_calib_add(&s9.expert_bwd_sm90, 1024, 4e12);
        fm_plan_req r9 = req;
        r9.offload_optimizer = false;
        fm_plan p9;
        fm_plan_compute(&r9, &p9);
        fm_projection a9, b9;
        fm_project(&r9, &p9, &s9, &a9); /* not asked: the cuBLAS curves */
        CHECK_CLOSE(a9.sec[FM_PROJ_EXPERTS], pr.sec[FM_PROJ_EXPERTS], 1e-12);
        r9.expert_sync_free = true;
        fm_project(&r9, &p9, &s9, &b9);
        CHECK_CLOSE(b9.sec[FM_PROJ_EXPERTS], L * 2 * N * k * 3 * H * I * (1 / 2e12 + 2 / 4e12), 1e-12);
        fm_project(&r9, &p9, &c, &b9); /* asked, but the table has none: the cuBLAS curves */
        CHECK_CLOSE(b9.sec[FM_PROJ_EXPERTS], pr.sec[FM_PROJ_EXPERTS], 1e-12);
    }
    /* fp8 on E4M3 codes at the table's fp8 curves: each point holds one layer's weight
     * quantization (12 E H I bytes, at fp8_weight_quant_bw, else elementwise_bw), taken out and
     * charged once a step with the weight cache; without it at each forward and recompute and at
     * the backward of the layers neither recomputed nor last */
    {
        fm_calib c8 = c;
        fm_calib_add(&c8.expert_fwd_fp8, 1024, 2e12);
        fm_calib_add(&c8.expert_bwd_fp8, 1024, 4e12);
        c8.fp8_weight_quant_bw = 4e11;
        fm_plan_req r8 = req;
        r8.offload_optimizer = false;
        r8.expert_fp8 = r8.expert_fp8_codes = true;
        fm_plan p8;
        fm_plan_compute(&r8, &p8);
        const double wq = 12.0 * E * H * I / 4e11, gemm = 2 * N * k * 3 * H * I * (1 / 2e12 + 2 / 4e12);
        CHECK_CLOSE(fm_project_fp8_weight_quant_s(&r8, &c8), wq, 1e-12);
        fm_projection a8;
        fm_project(&r8, &p8, &c8, &a8); /* no cache, no recompute: L forwards, L - 1 backwards */
        CHECK(fm_project_fp8_weight_sets(&r8, &p8) == 2 * L - 1);
        CHECK_CLOSE(a8.sec[FM_PROJ_EXPERTS], L * (gemm - 2 * wq) + (2 * L - 1) * wq, 1e-12);
        CHECK_CLOSE(fm_project_expert_s(&r8, &p8, &c8, false), a8.sec[FM_PROJ_EXPERTS], 1e-12);
        r8.layout.expert_fp8_cache = true; /* the cache: once a step, over grad_accum micro-batches */
        r8.grad_accum = 4;
        fm_project(&r8, &p8, &c8, &a8);
        CHECK_CLOSE(a8.sec[FM_PROJ_EXPERTS], 4 * L * (gemm - 2 * wq) + L * wq, 1e-12);
        r8.layout.expert_fp8_cache = false, r8.grad_accum = 1;
        bool rc8[16] = {false}; /* layers 0, 1 and the last recomputed: their backwards reuse */
        rc8[0] = rc8[1] = rc8[15] = true;
        r8.recompute = rc8;
        fm_plan_compute(&r8, &p8);
        CHECK(p8.n_recomputed == 3 && fm_project_fp8_weight_sets(&r8, &p8) == L + 3 + (L - 3));
        rc8[15] = false;
        fm_plan_compute(&r8, &p8);
        CHECK(fm_project_fp8_weight_sets(&r8, &p8) == L + 2 + (L - 2 - 1));
        c8.fp8_weight_quant_bw = 0; /* a table without the rate: elementwise's */
        CHECK_CLOSE(fm_project_fp8_weight_quant_s(&r8, &c8), 12.0 * E * H * I / bw, 1e-12);
        r8.expert_fp8_codes = false; /* the emulation: no fp8 curves, no weight term */
        CHECK(fm_project_fp8_weight_quant_s(&r8, &c8) == 0);
    }
    /* the log-T interpolation */
    fm_calib_curve cv = {0};
    fm_calib_add(&cv, 1024, 100);
    fm_calib_add(&cv, 4096, 300);
    CHECK_CLOSE(fm_calib_rate(&cv, 2048), 200, 1e-12);
    CHECK(fm_calib_rate(&cv, 10) == 100 && fm_calib_rate(&cv, 1e9) == 300);
}

static bool fits_both(const fm_plan *p, size_t budget, size_t host) { return p->total <= budget && p->host_bytes <= host; }

static void test_chooser(void) {
    const size_t GiB = (size_t)1 << 30;
    fm_plan_req req;
    olmoe_req(&req, 32768, FM_PLAN_TARGET_CUDA);
    const int64_t L = req.cfg.num_hidden_layers;
    bool rc[2 * 16];
    fm_calib fast, slow, def;
    synth_calib(&fast, 5e14, 3e12, 1e30);
    synth_calib(&slow, 5e14, 3e12, 1e3);
    fm_calib_default(&def, "cuda");
    /* the reference: no recompute, 4096-token chunks, linear CE; budget 3 GiB under it */
    fm_plan_req r0 = req;
    r0.moe_chunk_tokens = 4096;
    r0.ce_block_tokens = 1024;
    r0.ce_block_vocab = 4096;
    fm_plan ref;
    fm_plan_compute(&r0, &ref);
    const size_t budget = ref.total - 3 * GiB;
    fm_choose_opts o = {budget, "--mem-budget", FM_HOST_BUDGET_UNLIMITED, "--host-mem-budget", &fast};
    fm_plan p;
    fm_projection pr;
    /* a link that costs nothing: offload rather than recompute */
    fm_plan_req r = req;
    CHECK(fm_plan_fit(&r, &o, rc, &p, &pr) == FM_OK);
    CHECK(fits_both(&p, budget, SIZE_MAX));
    CHECK_MSG(p.n_recomputed == 0 && (r.offload_optimizer || p.n_offloaded_boundaries > 0),
              "fast link: recompute %lld, offload optimizer %d, boundaries %lld", (long long)p.n_recomputed,
              r.offload_optimizer, (long long)p.n_offloaded_boundaries);
    /* a link of 1 kB/s: recompute rather than offload */
    o.calib = &slow;
    r = req;
    CHECK(fm_plan_fit(&r, &o, rc, &p, &pr) == FM_OK);
    CHECK(fits_both(&p, budget, SIZE_MAX));
    CHECK_MSG(p.n_recomputed > 0 && !r.offload_optimizer && p.n_offloaded_boundaries == 0,
              "slow link: recompute %lld, offload optimizer %d, boundaries %lld", (long long)p.n_recomputed,
              r.offload_optimizer, (long long)p.n_offloaded_boundaries);
    /* a host budget that forbids offload: recompute, even with the free link */
    o.calib = &fast;
    o.host_budget = 0;
    r = req;
    CHECK(fm_plan_fit(&r, &o, rc, &p, &pr) == FM_OK);
    CHECK(p.host_bytes == 0 && p.n_recomputed > 0 && !r.offload_optimizer);
    /* the choice is the fastest: no other fitting point of a grid is faster (default table) */
    o.calib = &def;
    o.host_budget = 8 * GiB;
    r = req;
    CHECK(fm_plan_fit(&r, &o, rc, &p, &pr) == FM_OK);
    CHECK(fits_both(&p, budget, 8 * GiB));
    printf("olmoe-1b-7b at 32K in %.1f GiB (host 8 GiB): recompute %lld (%lld keep attention), chunk %lld, %lld "
           "boundaries offloaded, optimizer %s, projected %.3f s\n", budget / 1073741824.0, (long long)p.n_recomputed,
           (long long)p.n_keep_attention, (long long)r.moe_chunk_tokens, (long long)p.n_offloaded_boundaries,
           r.offload_optimizer ? "streamed" : "on device", pr.step_s);
    for (int64_t nr = 0; nr <= L; nr += 3)
        for (int64_t chunk = 0; chunk <= 32768; chunk = chunk ? chunk * 4 : 512)
            for (int ka = 0; ka < 2; ka++) {
                bool rc2[32];
                fm_plan_req q = req;
                for (int64_t l = 0; l < L; l++) rc2[l] = l < nr, rc2[L + l] = ka;
                q.recompute = rc2;
                q.keep_attention = rc2 + L;
                q.moe_chunk_tokens = chunk;
                q.ce_block_tokens = 1024;
                fm_plan qp;
                fm_plan_compute(&q, &qp);
                if (!fits_both(&qp, budget, 8 * GiB)) continue;
                fm_projection qq;
                fm_project(&q, &qp, &def, &qq);
                CHECK_MSG(pr.step_s <= qq.step_s * (1 + 1e-12), "chosen %.4f s, but recompute %lld chunk %lld: %.4f s",
                          pr.step_s, (long long)nr, (long long)chunk, qq.step_s);
            }
    /* user-given flags are never changed: recompute none, unchunked, the optimizer on the device */
    fm_choose_opts f = o;
    f.calib = &fast;
    f.host_budget = FM_HOST_BUDGET_UNLIMITED;
    f.fix_recompute = f.fix_offload_optimizer = true;
    bool none[32] = {false};
    r = req;
    r.recompute = none;
    r.keep_attention = none + L;
    fm_status st = fm_plan_fit(&r, &f, rc, &p, &pr);
    CHECK(p.n_recomputed == 0 && !r.offload_optimizer && r.recompute == none);
    if (st == FM_OK) CHECK(fits_both(&p, budget, SIZE_MAX));
    f.fix_moe_chunk = f.fix_ce = f.fix_offload_boundaries = true; /* everything fixed, as given (plain) */
    r = req;
    r.recompute = none;
    CHECK(fm_plan_fit(&r, &f, rc, &p, &pr) == FM_ERR_NOMEM);
    CHECK(r.moe_chunk_tokens == 0 && r.ce_block_tokens == 0 && r.n_offloaded_boundaries == 0 && !r.offload_optimizer);
    CHECK_MSG(strstr(fm_errmsg(), "drop --recompute") && strstr(fm_errmsg(), "--seq-len") &&
                  strstr(fm_errmsg(), "ranks"), "%s", fm_errmsg());
    /* no budget: nothing is chosen (the CPU trainer without --mem-budget) */
    fm_choose_opts nb = {0, "--mem-budget", FM_HOST_BUDGET_UNLIMITED, "--host-mem-budget", &def};
    r = req;
    CHECK(fm_plan_fit(&r, &nb, rc, &p, &pr) == FM_OK);
    CHECK(r.recompute == NULL && r.moe_chunk_tokens == 0 && r.ce_block_tokens == 0 && !r.offload_optimizer &&
          r.n_offloaded_boundaries == 0);
    /* adversarial budgets: 1 GiB cannot hold even one rank's share of the rest; no knob is named */
    fm_choose_opts t = {GiB, "--mem-budget", FM_HOST_BUDGET_UNLIMITED, "--host-mem-budget", &def};
    r = req;
    CHECK(fm_plan_fit(&r, &t, rc, &p, &pr) == FM_ERR_NOMEM);
    const char *msg = fm_errmsg();
    CHECK_MSG(strstr(msg, "--mem-budget") && strstr(msg, "No single knob") && !strstr(msg, "fit with"), "%s", msg);
    /* 100 GiB with no host memory: the fp32 model state (103 GiB) does not fit; bf16 moments do,
     * and so would ranks; a shorter sequence would not */
    fm_choose_opts h = {100 * GiB, "--mem-budget", 0, "--host-mem-budget", &def};
    r = req;
    CHECK(fm_plan_fit(&r, &h, rc, &p, &pr) == FM_ERR_NOMEM);
    msg = fm_errmsg();
    CHECK_MSG(strstr(msg, "--bf16-moments") && strstr(msg, "2 ranks") && !strstr(msg, "--seq-len"), "%s", msg);
    /* each item of the advice works: bf16 moments fit */
    r = req;
    r.bf16_moments = true;
    CHECK(fm_plan_fit(&r, &h, rc, &p, &pr) == FM_OK && p.total <= 100 * GiB);
    /* check() names the budget flag */
    fm_plan_compute(&req, &p);
    CHECK(fm_plan_check(&p, p.total - 1, "--mem-budget") == FM_ERR_NOMEM);
    CHECK(strstr(fm_errmsg(), "--mem-budget") != NULL);
    CHECK(fm_plan_check(&p, p.total, "--mem-budget") == FM_OK);
}

/* Tables: a round trip, and bad ones give errors naming the field. */
static void test_calib_files(void) {
    fm_calib c, d;
    fm_calib_default(&c, "cuda");
    char path[64]; /* this process's own: test suites of other checkouts run beside it */
    snprintf(path, sizeof path, "/tmp/flatmoe-test-calib-%d.json", (int)getpid());
    CHECK(fm_calib_save(&c, path) == FM_OK);
    CHECK(fm_calib_load(&d, path) == FM_OK);
    CHECK(d.att_fwd.n == c.att_fwd.n && d.att_fwd.rate[2] == c.att_fwd.rate[2] && d.h2d == c.h2d &&
          d.context_bytes == c.context_bytes && !strcmp(d.kind, "h200"));
    struct { const char *text, *needle; } bad[] = {
        {"not json", "not a JSON object"},
        {"{\"format\":\"something\"}", "\"format\""},
        {"{\"format\":\"flatmoe-calibration\",\"version\":2}", "version"},
        {"{\"format\":\"flatmoe-calibration\",\"version\":1,\"backend\":\"tpu\"}", "\"backend\""},
        {"{\"format\":\"flatmoe-calibration\",\"version\":1,\"backend\":\"cpu\",\"device\":\"x\",\"kind\":\"cpu\","
         "\"act_bytes\":4,\"peak_flops\":-1}", "\"peak_flops\""},
        {"{\"format\":\"flatmoe-calibration\",\"version\":1,\"backend\":\"cpu\",\"device\":\"x\",\"kind\":\"cpu\","
         "\"act_bytes\":4,\"peak_flops\":1,\"context_bytes\":0,\"host_pinnable_bytes\":0,\"gemm\":[{\"m\":4,\"flops\":1},"
         "{\"m\":2,\"flops\":1}]}", "ascending"},
        {"{\"format\":\"flatmoe-calibration\",\"version\":1,\"backend\":\"cpu\",\"device\":\"x\",\"kind\":\"cpu\","
         "\"act_bytes\":4,\"peak_flops\":1,\"context_bytes\":0,\"host_pinnable_bytes\":0}", "\"gemm\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        FILE *f = fopen(path, "w");
        fputs(bad[i].text, f);
        fclose(f);
        CHECK(fm_calib_load(&d, path) == FM_ERR_FORMAT);
        CHECK_MSG(strstr(fm_errmsg(), bad[i].needle) && strstr(fm_errmsg(), path), "case %zu: %s", i, fm_errmsg());
    }
    /* the optional sm90 expert curves: absent in the default table, kept through save and load */
    CHECK(d.expert_fwd_sm90.n == 0 && d.expert_bwd_sm90.n == 0);
    fm_calib_add(&c.expert_fwd_sm90, 512, 6e14);
    fm_calib_add(&c.expert_bwd_sm90, 512, 5e14);
    CHECK(fm_calib_save(&c, path) == FM_OK);
    CHECK(fm_calib_load(&d, path) == FM_OK);
    CHECK(d.expert_fwd_sm90.n == 1 && d.expert_fwd_sm90.rate[0] == 6e14 && d.expert_bwd_sm90.rate[0] == 5e14);
    /* the optional fp8 weight-quantization rate: absent (0) by default, kept through save and load */
    CHECK(d.fp8_weight_quant_bw == 0);
    c.fp8_weight_quant_bw = 3.8e12;
    CHECK(fm_calib_save(&c, path) == FM_OK);
    CHECK(fm_calib_load(&d, path) == FM_OK);
    CHECK(d.fp8_weight_quant_bw == 3.8e12);
    remove(path);
    CHECK(fm_calib_load(&d, "/nonexistent/calib.json") == FM_ERR_IO);
    char kind[32];
    fm_calib_kind_of("cuda", "NVIDIA H200", kind);
    CHECK(!strcmp(kind, "h200"));
    fm_calib_kind_of("cuda", "NVIDIA GH200 480GB", kind);
    CHECK(!strcmp(kind, "gh200"));
    fm_calib_kind_of("cpu", "AMD EPYC", kind);
    CHECK(!strcmp(kind, "cpu"));
}

static void test_parse_bytes(void) {
    size_t b;
    CHECK(fm_parse_bytes("16GiB", "--x", &b) == FM_OK && b == ((size_t)16 << 30));
    CHECK(fm_parse_bytes("16G", "--x", &b) == FM_OK && b == ((size_t)16 << 30));
    CHECK(fm_parse_bytes("1.5MiB", "--x", &b) == FM_OK && b == 1572864);
    CHECK(fm_parse_bytes("80GB", "--x", &b) == FM_OK && b == 80000000000ULL);
    CHECK(fm_parse_bytes("1234", "--x", &b) == FM_OK && b == 1234);
    CHECK(fm_parse_bytes("12 parsecs", "--x", &b) == FM_ERR_ARG);
    CHECK(strstr(fm_errmsg(), "--x") != NULL);
    CHECK(fm_parse_bytes("lots", "--x", &b) == FM_ERR_ARG);
}

int main(void) {
    test_formulas();
    test_keep_attention();
    test_hand_arithmetic();
    test_projection_by_hand();
    test_chooser();
    test_calib_files();
    test_cuda_target();
    test_parse_bytes();
    return fm_test_finish();
}
