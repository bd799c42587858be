/* gpt_oss config tests (model/fm_config_gpt_oss.c): GptOssConfig's defaults for a file that leaves
 * fields out, layer_types and sliding_window, the clamped SwiGLU's fields, the load-balancing loss
 * only with output_router_logits, the default YaRN rope_parameters, bad input named, the config
 * written back as read, and the parameter counts of configs/gpt-oss-20b.json and
 * gpt-oss-120b.json against the model card's (OpenAI, gpt-oss-120b & gpt-oss-20b Model Card,
 * 2025, Table 1: 20b 20.91B total / 3.61B active, 120b 116.83B / 5.13B; its total counts the
 * embedding and the unembedding, its active count the unembedding but not the embedding, as
 * flatmoe's does). The expected values are written out by hand from configuration_gpt_oss.py and
 * the shapes of modeling_gpt_oss.py, not read from flatmoe's table. */
#include <string.h>

#include "fm_test.h"
#include "model/fm_config.h"

static void test_defaults(void) {
    fm_config c;
    fm_status s = fm_config_parse(&c, "{\"model_type\": \"gpt_oss\"}", "oss.json");
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    if (s) return;
    CHECK(c.model_type == FM_MODEL_GPT_OSS);
    CHECK(c.vocab_size == 201088 && c.hidden_size == 2880 && c.moe_intermediate_size == 2880);
    CHECK(c.num_hidden_layers == 36 && c.num_experts == 128 && c.num_experts_per_tok == 4);
    CHECK(c.num_attention_heads == 64 && c.num_key_value_heads == 8 && c.head_dim == 64);
    CHECK(c.max_position_embeddings == 131072 && c.rope_theta == 150000.0 && c.rms_norm_eps == 1e-5);
    CHECK(c.attention_bias && c.attention_o_bias && c.attention_sinks && c.router_linear_bias && c.expert_bias);
    CHECK(c.sliding_window == 128 && c.swiglu_limit == 7.0 && c.swiglu_alpha == 1.702);
    CHECK(c.norm_topk_prob && !c.tie_word_embeddings && c.initializer_range == 0.02);
    CHECK(c.router_aux_loss_coef == 0.0); /* output_router_logits false by default */
    for (int64_t l = 0; l < 36; l++) CHECK(fm_config_layer_is_sliding(&c, l) == (l % 2 == 0));
    CHECK(fm_config_num_moe_layers(&c) == 36);
    const fm_rope_scaling *r = &c.rope_scaling;
    CHECK(r->type == FM_ROPE_YARN && r->factor == 32.0 && r->beta_fast == 32.0 && r->beta_slow == 1.0 &&
          !r->truncate && r->original_max_position_embeddings == 4096);
}

static void test_fields(void) {
    fm_config c;
    const char *j = "{\"model_type\": \"gpt_oss\", \"num_hidden_layers\": 3, \"hidden_size\": 64, "
                    "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16, \"num_local_experts\": 8, "
                    "\"num_experts_per_tok\": 2, \"intermediate_size\": 32, \"sliding_window\": 5, "
                    "\"layer_types\": [\"full_attention\", \"sliding_attention\", \"sliding_attention\"], "
                    "\"swiglu_limit\": 3.5, \"output_router_logits\": true, \"router_aux_loss_coef\": 0.9, "
                    "\"rope_scaling\": null, \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 500.0}}";
    fm_status s = fm_config_parse(&c, j, "oss.json");
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    if (s) return;
    CHECK(!fm_config_layer_is_sliding(&c, 0) && fm_config_layer_is_sliding(&c, 1) && fm_config_layer_is_sliding(&c, 2));
    CHECK(c.sliding_window == 5 && c.swiglu_limit == 3.5 && c.router_aux_loss_coef == 0.9);
    CHECK(c.rope_scaling.type == FM_ROPE_DEFAULT && c.rope_theta == 500.0); /* a file's RoPE wins */
    CHECK(c.num_experts == 8 && c.head_dim == 16);
    /* the canonical form reads back as the same model */
    char *t = fm_config_to_json(&c);
    fm_config d;
    CHECK(t && fm_config_parse(&d, t, "canonical.json") == FM_OK);
    char *t2 = t ? fm_config_to_json(&d) : NULL;
    CHECK(t && t2 && !strcmp(t, t2));
    CHECK(t && strstr(t, "\"GptOssForCausalLM\"") && strstr(t, "\"num_local_experts\"") && strstr(t, "\"sliding_window\""));
    /* written back as read: the file's own text */
    char *out = NULL;
    CHECK(fm_config_json_as_read(j, &c, "oss.json", &out) == FM_OK && out && !strcmp(out, j));
    fm_free(out);
    fm_free(t);
    fm_free(t2);
    /* num_experts (GptOssConfig's attribute_map) is read when num_local_experts is absent */
    CHECK(fm_config_parse(&c, "{\"model_type\": \"gpt_oss\", \"num_experts\": 16}", "a.json") == FM_OK &&
          c.num_experts == 16);
}

static void expect_error(const char *json, fm_status want, const char *needle) {
    fm_config c;
    fm_status s = fm_config_parse(&c, json, "bad.json");
    CHECK_MSG(s == want && strstr(fm_errmsg(), needle) && strstr(fm_errmsg(), "bad.json"), "status %d, message: %s",
              (int)s, fm_errmsg());
}

static void test_errors(void) {
    expect_error("{\"model_type\": \"gpt_oss\", \"num_hidden_layers\": 2, \"layer_types\": [\"full_attention\"]}",
                 FM_ERR_CONFIG, "layer_types");
    expect_error("{\"model_type\": \"gpt_oss\", \"num_hidden_layers\": 1, \"layer_types\": [\"local\"]}",
                 FM_ERR_CONFIG, "\"local\"");
    expect_error("{\"model_type\": \"gpt_oss\", \"num_hidden_layers\": 2, \"sliding_window\": null}", FM_ERR_CONFIG,
                 "sliding_window");
    expect_error("{\"model_type\": \"gpt_oss\", \"sliding_window\": 2.5}", FM_ERR_FORMAT, "sliding_window");
    expect_error("{\"model_type\": \"gpt_oss\", \"swiglu_limit\": -1}", FM_ERR_CONFIG, "swiglu_limit");
    expect_error("{\"model_type\": \"gpt_oss\", \"layer_types\": \"full\"}", FM_ERR_FORMAT, "layer_types");
    /* every layer full: no window needed */
    fm_config c;
    CHECK(fm_config_parse(&c, "{\"model_type\": \"gpt_oss\", \"num_hidden_layers\": 1, \"sliding_window\": null, "
                              "\"layer_types\": [\"full_attention\"]}", "ok.json") == FM_OK);
}

/* The released configs: counts from their shapes, summed by hand per component. */
static void test_real_counts(void) {
    static const struct {
        const char *path;
        long long total, active;
    } k[] = {
        /* 20b (L 24, E 32): attention 24 x 26,550,144 (q, k, v, o weights and biases, 64 sinks) =
         * 637,203,456; MLP 24 x (router 92,192 + experts 32 x 24,891,840) = 19,119,145,728;
         * embedding + unembedding 2 x 201,088 x 2,880 = 1,158,266,880; norms 141,120 */
        {"configs/gpt-oss-20b.json", 20914757184LL, 3608307264LL},
        /* 120b (L 36, E 128): attention 955,805,184; MLP 36 x 3,186,524,288 = 114,714,874,368;
         * embeddings 1,158,266,880; norms 210,240 */
        {"configs/gpt-oss-120b.json", 116829156672LL, 5132849472LL},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        fm_config c;
        fm_status s = fm_config_load(&c, k[i].path);
        CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
        if (s) continue;
        CHECK_MSG(fm_config_num_params(&c) == k[i].total && fm_config_num_active_params(&c) == k[i].active,
                  "%s: %lld total, %lld active", k[i].path, (long long)fm_config_num_params(&c),
                  (long long)fm_config_num_active_params(&c));
        CHECK(c.router_aux_loss_coef == 0.0); /* 0.9 in the file, output_router_logits false */
        printf("  %-26s %lld parameters (active %lld)\n", k[i].path, (long long)fm_config_num_params(&c),
               (long long)fm_config_num_active_params(&c));
    }
}

int main(void) {
    test_defaults();
    test_fields();
    test_errors();
    test_real_counts();
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
