/* deepseek_v2 (model/fm_config_deepseek_v2.c, the router's FM_ROUTER_SCORE_SOFTMAX_GROUP):
 * - DeepseekV2Config's defaults (transformers 5's configuration_deepseek_v2.py) from a file with only
 *   model_type and num_experts_per_tok, and every refusal naming its field;
 * - tests/data/deepseek_v2_tiny.json (group_limited_greedy, q_lora_rank) and deepseek_v2_lite_tiny.json
 *   (greedy, q_lora_rank null) parse to the router options transformers' DeepseekV2Moe runs (softmax
 *   scores, groups only when limited, routed_scaling_factor, never renormalized), MLA with the
 *   interleaved pairs and the softmax factor m(factor, mscale_all_dim)^2; the canonical config.json
 *   parses back to the same model; the parameter table has no e_score_correction_bias;
 * - fm_router_forward through the CPU op: routing replay of the router's own routes gives its bits,
 *   replay of other routes weighs them as prob x scaling; the forced-routing test hook likewise;
 *   the sequence-wise balance loss is refused with a message naming why.
 * The router op itself: tests/test_router_softmax_group.c; whole-model gradients: tests/test_model.c. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "model/fm_mla.h"
#include "model/fm_model.h"
#include "model/fm_router.h"

static fm_backend g_be;

static void test_defaults_and_refusals(void) {
    fm_config c;
    CHECK(fm_config_parse(&c, "{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6}", "d.json") == FM_OK);
    CHECK(c.model_type == FM_MODEL_DEEPSEEK_V2 && c.vocab_size == 32000 && c.hidden_size == 4096 &&
          c.dense_intermediate_size == 11008 && c.moe_intermediate_size == 1407 && c.num_hidden_layers == 32 &&
          c.num_attention_heads == 32 && c.num_key_value_heads == 32 && c.max_position_embeddings == 2048 &&
          c.rms_norm_eps == 1e-6 && c.rope_theta == 10000.0 && c.num_experts == 64 && c.num_experts_per_tok == 6 &&
          c.n_shared_experts == 2 && c.first_k_dense_replace == 0 && c.routed_scaling_factor == 1.0 &&
          !c.router_group_limited && !c.norm_topk_prob && !c.router_sigmoid && c.mla && c.q_lora_rank == 1536 &&
          c.kv_lora_rank == 512 && c.qk_nope_head_dim == 128 && c.qk_rope_head_dim == 64 && c.v_head_dim == 128 &&
          c.head_dim == 192 && c.rope_interleave && c.router_aux_loss_coef == 0 && !c.tie_word_embeddings);
    CHECK(fm_config_num_moe_layers(&c) == 32);
    fm_router_opts o = fm_router_opts_from_config(&c);
    CHECK(o.score == FM_ROUTER_SCORE_SOFTMAX_GROUP && o.n_group == 1 && o.topk_group == 1 && !o.norm_topk &&
          o.scaling == 1.0f && o.top_k == 6 && o.num_experts == 64);
    /* norm_topk_prob true is read and not used (DeepseekV2Moe never renormalizes); rope_interleave
     * false is ignored (DeepseekV2Attention always rotates the pairs) */
    CHECK(fm_config_parse(&c, "{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"norm_topk_prob\": true,"
                              " \"rope_interleave\": false}", "d.json") == FM_OK);
    o = fm_router_opts_from_config(&c);
    CHECK(c.norm_topk_prob && !o.norm_topk && c.rope_interleave);
    const char *bad[][2] = {
        {"{\"model_type\": \"deepseek_v2\"}", "\"num_experts_per_tok\" is absent"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": null}", "\"num_experts_per_tok\" is null"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"topk_method\": \"noaux_tc\"}", "\"noaux_tc\""},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"topk_method\": \"gready\"}", "\"gready\""},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"scoring_func\": \"sigmoid\"}", "\"scoring_func\""},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"moe_layer_freq\": 2}", "\"moe_layer_freq\" is 2"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"n_shared_experts\": null}", "\"n_shared_experts\" is null"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"topk_method\": \"group_limited_greedy\"}",
         "\"n_group\" is absent"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"topk_method\": \"group_limited_greedy\", "
         "\"n_group\": 8, \"topk_group\": null}", "\"topk_group\" is null"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"topk_method\": \"group_limited_greedy\", "
         "\"n_group\": 7, \"topk_group\": 3}", "\"n_group\" (7)"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"topk_method\": \"group_limited_greedy\", "
         "\"n_group\": 8, \"topk_group\": 9}", "\"topk_group\" (9)"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 30, \"topk_method\": \"group_limited_greedy\", "
         "\"n_group\": 8, \"topk_group\": 3}", "num_experts_per_tok (30) exceeds"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"routed_scaling_factor\": 0}", "\"routed_scaling_factor\""},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"first_k_dense_replace\": 32}", "\"first_k_dense_replace\" (32)"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"attention_bias\": true}", "\"attention_bias\" is true"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"mlp_bias\": true}", "\"mlp_bias\" is true"},
        {"{\"model_type\": \"deepseek_v2\", \"num_experts_per_tok\": 6, \"head_dim\": 192}", "deepseek_v2's head_dim"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fm_status s = fm_config_parse(&c, bad[i][0], "bad.json");
        CHECK_MSG(s != FM_OK && strstr(fm_errmsg(), bad[i][1]) && strstr(fm_errmsg(), "bad.json"),
                  "%s: expected a refusal naming %s, got %s", bad[i][0], bad[i][1], s == FM_OK ? "FM_OK" : fm_errmsg());
        printf("refused: %s\n", fm_errmsg());
    }
}

/* The two tiny test configs: the router the file asks for, MLA's YaRN factor, the canonical
 * form, the parameter table. */
static void test_tiny_files(void) {
    const char *files[2] = {"tests/data/deepseek_v2_tiny.json", "tests/data/deepseek_v2_lite_tiny.json"};
    for (int f = 0; f < 2; f++) {
        fm_config c;
        CHECK_MSG(fm_config_load(&c, files[f]) == FM_OK, "%s: %s", files[f], fm_errmsg());
        const bool grp = f == 0;
        fm_router_opts o = fm_router_opts_from_config(&c);
        CHECK(c.router_group_limited == grp && o.score == FM_ROUTER_SCORE_SOFTMAX_GROUP && !o.norm_topk &&
              o.n_group == (grp ? 4 : 1) && o.topk_group == (grp ? 2 : 1) && o.scaling == (grp ? 16.0f : 1.0f) &&
              o.top_k == 3 && c.n_shared_experts == 2 && c.first_k_dense_replace == 1 && c.q_lora_rank == (grp ? 24 : 0));
        const double ms = 0.1 * 0.707 * log(4.0) + 1.0; /* yarn_get_mscale(4, mscale_all_dim 0.707) */
        CHECK(fabs(fm_mla_softmax_factor(&c) - ms * ms) < 1e-12);
        char *js = fm_config_to_json(&c);
        fm_config c2;
        CHECK(js && fm_config_parse(&c2, js, "canonical") == FM_OK && c2.model_type == FM_MODEL_DEEPSEEK_V2 &&
              c2.router_group_limited == grp && c2.n_group == c.n_group && c2.topk_group == c.topk_group &&
              c2.routed_scaling_factor == c.routed_scaling_factor && c2.q_lora_rank == c.q_lora_rank &&
              fm_config_num_params(&c2) == fm_config_num_params(&c));
        CHECK(js && strstr(js, "DeepseekV2ForCausalLM") && !strstr(js, "rope_interleave") && !strstr(js, "\"head_dim\""));
        fm_free(js);
        fm_model m;
        CHECK(fm_test_model_create(&m, &c, g_be) == FM_OK);
        CHECK(m.p.n_params == fm_config_num_params(&c));
        CHECK(fm_params_find(&m.p, "model.layers.1.mlp.gate.weight") != NULL);
        CHECK(fm_params_find(&m.p, "model.layers.1.mlp.gate.e_score_correction_bias") == NULL);
        CHECK(fm_params_find(&m.p, "model.layers.1.mlp.shared_experts.gate_proj.weight")->shape[0] == 2 * 32);
        CHECK(fm_params_find(&m.p, "model.layers.0.mlp.gate_proj.weight")->shape[0] == 96);
        fm_test_model_free(&m);
    }
}

/* fm_router_forward on the CPU backend: replay and the forced-routing hook under the V2 router. */
static void test_replay_and_force(void) {
    enum { N = 24, H = 8, E = 8, K = 3 };
    fm_config c;
    CHECK(fm_config_load(&c, "tests/data/deepseek_v2_tiny.json") == FM_OK);
    fm_router_opts o = fm_router_opts_from_config(&c);
    fm_rng r;
    fm_rng_seed(&r, 7);
    static float x[N * H], W[E * H], logits[N * E], probs[N * E], lse[N], tw[N * K], tw2[N * K], count[E], ps[E];
    static int32_t idx[N * K], idx2[N * K], replay[N * K];
    double lse_sq, terms[2];
    for (int i = 0; i < N * H; i++) x[i] = (float)fm_rng_normal(&r);
    for (int i = 0; i < E * H; i++) W[i] = (float)fm_rng_normal(&r);
    fm_router_saved s = {probs, lse, idx, tw, count, ps};
    CHECK(fm_router_forward(&g_be, &o, NULL, logits, &s, &lse_sq, terms, x, W, NULL, NULL, N, H, NULL, NULL) == FM_OK);
    memcpy(idx2, idx, sizeof idx);
    memcpy(tw2, tw, sizeof tw);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < K; j++) CHECK(tw[n * K + j] == probs[n * E + idx[n * K + j]] * 16.0f);
    /* replay of the router's own routes: its bits */
    memcpy(replay, idx2, sizeof replay);
    CHECK(fm_router_forward(&g_be, &o, NULL, logits, &s, &lse_sq, terms, x, W, NULL, NULL, N, H, replay, NULL) == FM_OK);
    CHECK_MSG(!memcmp(idx, idx2, sizeof idx) && !memcmp(tw, tw2, sizeof tw), "replay of the own routes changed them");
    /* replay of other routes (rows 0-11; the rest padding, -1): prob x scaling, never renormalized */
    for (int n = 0; n < N; n++)
        for (int j = 0; j < K; j++) replay[n * K + j] = n < 12 ? (n + 3 * j + 1) % E : -1;
    CHECK(fm_router_forward(&g_be, &o, NULL, logits, &s, &lse_sq, terms, x, W, NULL, NULL, N, H, replay, NULL) == FM_OK);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < K; j++) {
            const int e = n < 12 ? replay[n * K + j] : idx2[n * K + j];
            CHECK(idx[n * K + j] == e && tw[n * K + j] == probs[n * E + e] * 16.0f);
        }
    /* the forced-routing hook: experts 5, 6, 7 on every token, prob x scaling */
    o.force_route = true;
    o.force_first = 5;
    o.force_percent = 100;
    CHECK(fm_router_forward(&g_be, &o, NULL, logits, &s, &lse_sq, terms, x, W, NULL, NULL, N, H, NULL, NULL) == FM_OK);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < K; j++) {
            CHECK(idx[n * K + j] == 5 + j);
            CHECK_CLOSE(tw[n * K + j], probs[n * E + 5 + j] * 16.0f, 1e-6 * 16);
        }
    /* the sequence-wise balance loss: refused for the softmax router, naming why */
    o.force_route = false;
    CHECK(fm_router_seq_aux_check(&o, 1e-4, 1) != FM_OK && strstr(fm_errmsg(), "deepseek_v2"));
    printf("refused: %s\n", fm_errmsg());
}

int main(void) {
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    test_defaults_and_refusals();
    test_tiny_files();
    test_replay_and_force();
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
