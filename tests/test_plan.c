/* The planner: its hand-written bound formulas equal the bytes the layout code takes (measured
 * with measuring arenas) for every shipped config and a range of flags, so the plan and the
 * allocation cannot drift apart; hand arithmetic for a few live sets; the chooser; budgets and
 * their messages; byte parsing. */
#include <string.h>

#include "fm_test.h"
#include "backend/cuda/fm_backend_cuda.h"
#include "plan/fm_plan.h"
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
    /* 17 boundaries of N x H fp32, plus tokens, targets, the RoPE tables (4096 x 64 x 2) and the
     * micro-batch's device results (4 + 2 x 16 doubles = 288 bytes, 320 rounded to 64) */
    CHECK_CLOSE((double)p.bytes[FM_LIVE_BOUNDARIES], 17 * N * H * 4 + 2 * N * 4 + 2 * 4096 * 64 * 4 + 320, 1e-12);
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
    /* linear CE: one 1024 x 4096 fp32 strip + 4 per-token vectors, instead of N x V logits */
    req.ce_block_tokens = 1024;
    req.ce_block_vocab = 4096;
    fm_plan_compute(&req, &q);
    CHECK_CLOSE((double)q.bytes[FM_LIVE_VOCAB], N * H * 4 + 2 * N * 4 + 1024 * 4096 * 4.0 + 4 * 1024 * 4, 1e-12);
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
    /* 16 B/param either way; boundaries in bf16: 17 x 4096 x 2048 x 2 + tokens + RoPE tables */
    CHECK(g.bytes[FM_LIVE_MODEL_STATE] == c.bytes[FM_LIVE_MODEL_STATE]);
    CHECK(g.bytes[FM_LIVE_BOUNDARIES] == 17ull * 4096 * 2048 * 2 + 2 * 4096 * 4 + 2 * 4096 * 64 * 4 + 320);
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
     * results of a micro-batch (320 bytes with the boundaries) */
    CHECK_MSG(g.total == 122175856896ull - 2 * 4096ull * 2048 * 2 - (32ull << 20) - (528ull << 20) + 320,
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

static void test_chooser(void) {
    fm_plan_req req;
    memset(&req, 0, sizeof req);
    req.model_state_bytes = fm_model_state_bound; /* the trainer's answer (train/fm_optim.h) */
    CHECK(fm_config_load(&req.cfg, "configs/qwen3-30b-a3b.json") == FM_OK);
    const int64_t L = req.cfg.num_hidden_layers;
    bool rc[L];
    req.B = 1;
    req.T = 32768;
    req.threads = 1;
    fm_plan free_plan;
    fm_plan_compute(&req, &free_plan);
    /* A budget the plain plan fits: nothing recomputed, unchunked. */
    fm_plan p;
    CHECK(fm_plan_choose(&req, free_plan.total + 1, rc, &p) == FM_OK);
    CHECK(p.n_recomputed == 0 && req.moe_chunk_tokens == 0);
    /* Model state + a little: needs chunking and recompute; the choice fits and is minimal. */
    size_t budget = free_plan.bytes[FM_LIVE_MODEL_STATE] + ((size_t)40 << 30);
    CHECK(fm_plan_choose(&req, budget, rc, &p) == FM_OK);
    CHECK(p.total <= budget);
    printf("qwen3-30b-a3b at 32K tokens in %.1f GiB: %lld recomputed layers, chunk %lld tokens, total %.2f GiB\n",
           budget / 1073741824.0, (long long)p.n_recomputed, (long long)req.moe_chunk_tokens, p.total / 1073741824.0);
    if (p.n_recomputed > 0) {
        /* one fewer recomputed layer (with the smallest chunk) must not fit */
        bool rc2[L];
        for (int64_t l = 0; l < L; l++) rc2[l] = l < p.n_recomputed - 1 - (p.n_recomputed == 2);
        fm_plan_req r2 = req;
        r2.recompute = rc2;
        r2.moe_chunk_tokens = 1;
        fm_plan q;
        fm_plan_compute(&r2, &q);
        CHECK(q.total > budget);
    }
    /* Chunks of >= FM_PLAN_EFFICIENT_CHUNK tokens come first: OLMoE at 128K in the H200's
     * budget recomputes more layers rather than cut the MoE chunk below 4096 tokens (the
     * measured slow choice was 11 layers with 512-token chunks). */
    {
        fm_plan_req o;
        memset(&o, 0, sizeof o);
        o.model_state_bytes = fm_model_state_bound;
        CHECK(fm_config_load(&o.cfg, "configs/olmoe-1b-7b.json") == FM_OK);
        bool orc[64];
        o.B = 1;
        o.T = 131072;
        o.target = FM_PLAN_TARGET_CUDA;
        fm_plan op;
        CHECK(fm_plan_choose(&o, (size_t)141093 << 20, orc, &op) == FM_OK);
        CHECK_MSG(o.moe_chunk_tokens >= FM_PLAN_EFFICIENT_CHUNK, "chunk %lld", (long long)o.moe_chunk_tokens);
        CHECK(op.total <= (size_t)141093 << 20 && op.n_recomputed < 16);
    }
    /* Too small for anything: a clear error naming the live set and the knob. */
    CHECK(fm_plan_choose(&req, (size_t)1 << 30, rc, &p) == FM_ERR_NOMEM);
    CHECK(strstr(fm_errmsg(), "model state") != NULL);
    /* check() names the budget flag and the knob. */
    req.recompute = NULL;
    req.moe_chunk_tokens = 0;
    fm_plan_compute(&req, &p);
    CHECK(fm_plan_check(&p, p.total - 1, "--mem-budget") == FM_ERR_NOMEM);
    CHECK(strstr(fm_errmsg(), "--mem-budget") != NULL);
    CHECK(fm_plan_check(&p, p.total, "--mem-budget") == FM_OK);
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
    test_chooser();
    test_cuda_target();
    test_parse_bytes();
    return fm_test_finish();
}
