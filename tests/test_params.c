/* The model split (issue 24): the parameter table stands alone. Built from a config (and an
 * expert-parallel slice) with no backend, no activation layout and no communicator: this file
 * includes model/fm_params.h only. Checked against what is computed another way:
 *   - n_params against fm_config_num_params (the config's closed formula, fm_config.c) for the
 *     shipped real configs, whose counts are also pinned to the published ones;
 *   - the table is a partition of [0, n_params) in order, and its numels add up to n_params;
 *   - the parameter groups (fm_params_group_begin) are contiguous, start at 0 and end at n_params;
 *   - under --ep the ranks' tables hold fm_params_ep_num_params each, every non-expert tensor,
 *     and their experts together are the one-rank table's, each exactly once, in order;
 *   - the initial weights of a rank's expert equal the one-rank table's for the same name. */
#include <string.h>

#include "fm_test.h"
#include "model/fm_params.h"

/* Partition and groups of one table. */
static void check_table(const fm_model_params *p, const char *what) {
    int64_t off = 0, sum = 0;
    bool in_order = true;
    for (int i = 0; i < p->n_tensors; i++) {
        const fm_param *t = &p->table[i];
        if (t->offset != off) in_order = false;
        off = t->offset + t->numel;
        sum += t->numel;
        const int64_t want = t->ndim == 1 ? t->shape[0] : t->shape[0] * t->shape[1];
        if (t->numel != want) in_order = false;
    }
    CHECK_MSG(in_order && off == p->n_params && sum == p->n_params,
              "%s: the table's %d tensors end at %lld, add up to %lld, n_params %lld", what, p->n_tensors,
              (long long)off, (long long)sum, (long long)p->n_params);
    const int64_t L = p->cfg.num_hidden_layers;
    bool groups = fm_params_group_begin(p, 0) == 0 && fm_params_group_begin(p, L + 2) == p->n_params;
    for (int64_t g = 0; g < L + 2; g++)
        if (fm_params_group_begin(p, g) >= fm_params_group_begin(p, g + 1)) groups = false;
    CHECK_MSG(groups, "%s: parameter groups not contiguous over [0, n_params)", what);
}

static void test_real_tables(void) {
    struct { const char *path; int64_t params; } c[] = {
        {"configs/olmoe-1b-7b.json", 6919161856LL},
        {"configs/qwen3-30b-a3b.json", 30532122624LL},
        {"configs/mixtral-8x7b.json", 46702792704LL},
        /* Qwen3-235B-A22B: 235.09e9 from its shapes (the model card: 235B, 234B without the
         * embeddings; 233,848,970,752 here) */
        {"configs/qwen3-235b-a22b.json", 235093634560LL},
        {"configs/tiny.json", 0},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        fm_config cfg;
        fm_status s = fm_config_load(&cfg, c[i].path);
        CHECK_MSG(s == FM_OK, "%s: %s", c[i].path, fm_errmsg());
        if (s) continue;
        fm_model_params p;
        CHECK(fm_params_create(&p, &cfg, 1, 0) == FM_OK);
        CHECK_MSG(p.n_params == fm_config_num_params(&cfg), "%s: table %lld params, config %lld", c[i].path,
                  (long long)p.n_params, (long long)fm_config_num_params(&cfg));
        if (c[i].params) CHECK(p.n_params == c[i].params);
        CHECK(p.ep == 1 && p.E_loc == cfg.num_experts && p.params == NULL && p.grads == NULL);
        check_table(&p, c[i].path);
        printf("  %-28s %lld parameters in %d tensors, the table alone\n", c[i].path, (long long)p.n_params,
               p.n_tensors);
        fm_params_free(&p);
    }
}

/* GLM-4.5-Air (configs/glm-4.5-air.json, its config.json as published: attention_bias true,
 * partial_rotary_factor 0.5): the table's count from its shapes: 106,852,251,264 (106,851,591,808
 * without the q/k/v biases, which add 46 x (96 + 2 x 8) x 128 = 659,456: 106.85e9, the model card's
 * "106B total"); active 12,803,372,672 (the card's "12B active"); the MTP layer
 * (num_nextn_predict_layers 1) is neither counted nor built. */
static void test_glm4_air(void) {
    char *text = NULL;
    CHECK(fm_config_read_text("configs/glm-4.5-air.json", &text) == FM_OK);
    if (!text) return;
    fm_config cfg;
    fm_status s = fm_config_parse(&cfg, text, "glm-4.5-air.json");
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    fm_free(text);
    if (s) return;
    CHECK(cfg.attention_bias && !cfg.attention_o_bias && cfg.partial_rotary_factor == 0.5 &&
          fm_config_rotary_dim(&cfg) == 64);
    CHECK(cfg.model_type == FM_MODEL_GLM4_MOE && cfg.router_sigmoid && cfg.n_shared_experts == 1 &&
          cfg.first_k_dense_replace == 1 && fm_config_num_moe_layers(&cfg) == 45 && cfg.num_nextn_predict_layers == 1);
    fm_model_params pp;
    CHECK(fm_params_create(&pp, &cfg, 1, 0) == FM_OK);
    CHECK_MSG(pp.n_params == 106852251264LL && fm_config_num_params(&cfg) == pp.n_params,
              "GLM-4.5-Air: %lld parameters in the table, %lld by the config", (long long)pp.n_params,
              (long long)fm_config_num_params(&cfg));
    CHECK_MSG(fm_config_num_active_params(&cfg) == 12803372672LL, "GLM-4.5-Air: %lld active",
              (long long)fm_config_num_active_params(&cfg));
    CHECK(fm_params_find(&pp, "model.layers.45.mlp.gate.e_score_correction_bias") != NULL &&
          fm_params_find(&pp, "model.layers.0.mlp.gate_proj.weight") != NULL &&
          fm_params_find(&pp, "model.layers.1.mlp.shared_experts.down_proj.weight") != NULL &&
          fm_params_find(&pp, "model.layers.46.mlp.gate.weight") == NULL);
    check_table(&pp, "configs/glm-4.5-air.json");
    printf("  %-28s %lld parameters (active %lld) in %d tensors\n", "configs/glm-4.5-air.json",
           (long long)pp.n_params, (long long)fm_config_num_active_params(&cfg), pp.n_tensors);
    fm_params_free(&pp);
}

/* The deepseek_v2 configs (configs/deepseek-v2-lite.json and configs/deepseek-v2.json; their sources:
 * docs/models.md): counts from their shapes, checked against the same sum written out by hand in
 * Python (embeddings 2 V H; per layer MLA and two norms; layer 0's dense MLP; per MoE layer the
 * router, E experts and the 2 x moe_intermediate_size shared MLP; the final norm).
 * DeepSeek-V2-Lite: 15,706,484,224 (the model card's "15.7B total"), active 2,451,435,008 without
 * the embedding lookup ("2.4B activated"; 2,661,150,208 with it). DeepSeek-V2: 235,741,434,880
 * ("236B total"), active 20,851,512,320 ("21B activated"; 21,375,800,320 with the embedding). */
static void test_deepseek_v2(void) {
    struct { const char *path; int64_t params, active; bool q_lora, grp; } c[] = {
        {"configs/deepseek-v2-lite.json", 15706484224LL, 2451435008LL, false, false},
        {"configs/deepseek-v2.json", 235741434880LL, 20851512320LL, true, true},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        fm_config cfg;
        fm_status s = fm_config_load(&cfg, c[i].path);
        CHECK_MSG(s == FM_OK, "%s: %s", c[i].path, fm_errmsg());
        if (s) continue;
        CHECK(cfg.model_type == FM_MODEL_DEEPSEEK_V2 && cfg.mla && !cfg.router_sigmoid && (cfg.q_lora_rank > 0) == c[i].q_lora &&
              cfg.router_group_limited == c[i].grp && cfg.head_dim == 192 && fm_config_rotary_dim(&cfg) == 64 &&
              fm_config_num_moe_layers(&cfg) == cfg.num_hidden_layers - 1 && cfg.n_shared_experts == 2);
        fm_model_params pp;
        CHECK(fm_params_create(&pp, &cfg, 1, 0) == FM_OK);
        CHECK_MSG(pp.n_params == c[i].params && fm_config_num_params(&cfg) == pp.n_params,
                  "%s: %lld parameters in the table, %lld by the config", c[i].path, (long long)pp.n_params,
                  (long long)fm_config_num_params(&cfg));
        CHECK_MSG(fm_config_num_active_params(&cfg) == c[i].active, "%s: %lld active", c[i].path,
                  (long long)fm_config_num_active_params(&cfg));
        CHECK(fm_params_find(&pp, "model.layers.1.mlp.gate.e_score_correction_bias") == NULL &&
              fm_params_find(&pp, "model.layers.1.mlp.shared_experts.up_proj.weight")->shape[0] ==
                  2 * cfg.moe_intermediate_size);
        check_table(&pp, c[i].path);
        printf("  %-28s %lld parameters (active %lld) in %d tensors\n", c[i].path, (long long)pp.n_params,
               (long long)fm_config_num_active_params(&cfg), pp.n_tensors);
        fm_params_free(&pp);
    }
}

/* The deepseek_v3 configs (configs/deepseek-v3.json and configs/moonlight-16b-a3b.json, their
 * config.json as published but quantization_config and auto_map): counts from their shapes.
 * DeepSeek-V3: 671,026,419,200 (the paper's and the model card's "671B total"; the MTP layer,
 * num_nextn_predict_layers 1, neither counted nor built: the hub's 685B includes its 14B), active
 * 36,625,618,432 without the embedding lookup (37,552,242,688 with its 926,624,256: the card's
 * "37B activated"). Moonlight-16B-A3B (q_lora_rank null): 15,960,110,208 ("16B"), active
 * 2,579,231,872 (2,914,776,192 with the embedding: "3B"). */
static void test_deepseek(void) {
    struct { const char *path; int64_t params, active, moe_layers; bool q_lora; } c[] = {
        {"configs/deepseek-v3.json", 671026419200LL, 36625618432LL, 58, true},
        {"configs/moonlight-16b-a3b.json", 15960110208LL, 2579231872LL, 26, false},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        fm_config cfg;
        fm_status s = fm_config_load(&cfg, c[i].path);
        CHECK_MSG(s == FM_OK, "%s: %s", c[i].path, fm_errmsg());
        if (s) continue;
        CHECK(cfg.mla && cfg.router_sigmoid && (cfg.q_lora_rank > 0) == c[i].q_lora && cfg.head_dim == 192 &&
              fm_config_rotary_dim(&cfg) == 64 && fm_config_num_moe_layers(&cfg) == c[i].moe_layers);
        fm_model_params pp;
        CHECK(fm_params_create(&pp, &cfg, 1, 0) == FM_OK);
        CHECK_MSG(pp.n_params == c[i].params && fm_config_num_params(&cfg) == pp.n_params,
                  "%s: %lld parameters in the table, %lld by the config", c[i].path, (long long)pp.n_params,
                  (long long)fm_config_num_params(&cfg));
        CHECK_MSG(fm_config_num_active_params(&cfg) == c[i].active, "%s: %lld active", c[i].path,
                  (long long)fm_config_num_active_params(&cfg));
        CHECK((fm_params_find(&pp, "model.layers.0.self_attn.q_a_layernorm.weight") != NULL) == c[i].q_lora &&
              fm_params_find(&pp, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight")->shape[0] == 576 &&
              fm_params_find(&pp, "model.layers.0.self_attn.kv_b_proj.weight")->shape[1] == 512 &&
              fm_params_find(&pp, "model.layers.0.self_attn.k_proj.weight") == NULL);
        check_table(&pp, c[i].path);
        printf("  %-28s %lld parameters (active %lld) in %d tensors\n", c[i].path, (long long)pp.n_params,
               (long long)fm_config_num_active_params(&cfg), pp.n_tensors);
        fm_params_free(&pp);
    }
}

/* --ep: each rank's table against the one-rank table. */
static void test_ep_tables(const char *path, int ep) {
    fm_config cfg;
    const fm_status s = fm_config_load(&cfg, path);
    CHECK_MSG(s == FM_OK, "%s (run from the repository root)", fm_errmsg());
    if (s) return;
    fm_model_params full;
    CHECK(fm_params_create(&full, &cfg, 1, 0) == FM_OK);
    int *seen = calloc((size_t)full.n_tensors, sizeof(int));
    for (int r = 0; r < ep; r++) {
        fm_model_params p;
        CHECK(fm_params_create(&p, &cfg, ep, r) == FM_OK);
        CHECK_MSG(p.n_params == fm_params_ep_num_params(&cfg, ep), "%s --ep %d rank %d: %lld params, expected %lld",
                  path, ep, r, (long long)p.n_params, (long long)fm_params_ep_num_params(&cfg, ep));
        check_table(&p, path);
        int last = -1;
        bool ordered = true, found = true;
        for (int i = 0; i < p.n_tensors; i++) {
            const fm_param *q = fm_params_find(&full, p.table[i].name);
            if (!q) { found = false; continue; }
            const int j = (int)(q - full.table);
            if (j <= last) ordered = false;
            last = j;
            if (strstr(q->name, ".experts.")) seen[j]++;
            else seen[j] = 1;
            if (q->numel != p.table[i].numel) found = false;
        }
        CHECK_MSG(found && ordered, "%s --ep %d rank %d: the table is not a subsequence of the one-rank table", path,
                  ep, r);
        if (r == ep - 1 && p.n_tensors > 0) { /* the last tensor of an expert, drawn by both tables */
            int e = -1;
            for (int i = p.n_tensors - 1; i >= 0 && e < 0; i--)
                if (strstr(p.table[i].name, ".experts.")) e = i;
            CHECK(e >= 0);
            const fm_param *q = fm_params_find(&full, p.table[e].name);
            const int64_t n = p.table[e].numel < 64 ? p.table[e].numel : 64;
            float a[64], b[64];
            fm_params_init_weights_range(&p, 7, e, 0, n, a);
            fm_params_init_weights_range(&full, 7, (int)(q - full.table), 0, n, b);
            CHECK_MSG(memcmp(a, b, sizeof(float) * (size_t)n) == 0, "%s --ep %d: %s's initial weights differ", path, ep,
                      q->name);
        }
        fm_params_free(&p);
    }
    bool once = true;
    for (int j = 0; j < full.n_tensors; j++)
        if (seen[j] != 1) once = false;
    CHECK_MSG(once, "%s --ep %d: every tensor of the one-rank table once among the ranks", path, ep);
    free(seen);
    fm_params_free(&full);
}

static void test_bad_ep(void) {
    fm_config cfg;
    CHECK(fm_config_load(&cfg, "configs/tiny.json") == FM_OK);
    fm_model_params p;
    CHECK(fm_params_create(&p, &cfg, (int)cfg.num_experts + 1, 0) == FM_ERR_ARG);
    CHECK(strstr(fm_errmsg(), "--ep") != NULL);
    CHECK(p.table == NULL && p.n_params == 0);
    CHECK(fm_params_create(&p, &cfg, 1, 1) == FM_ERR_ARG);
}

int main(void) {
    test_real_tables();
    test_ep_tables("configs/tiny.json", 2);
    test_ep_tables("configs/olmoe-1b-7b.json", 8);
    test_ep_tables("tests/data/glm4_tiny.json", 2); /* the bias and shared experts before the experts */
    test_ep_tables("tests/data/glm4_tiny.json", 4);
    test_glm4_air();
    test_ep_tables("tests/data/deepseek_v3_tiny.json", 2); /* MLA's tensors before the experts */
    test_ep_tables("tests/data/deepseek_v3_tiny_noq.json", 4);
    test_deepseek();
    test_deepseek_v2();
    test_ep_tables("tests/data/deepseek_v2_tiny.json", 4); /* no selection bias; two shared experts */
    test_bad_ep();
    return fm_test_finish();
}
