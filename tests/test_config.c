/* Config tests (model/fm_config.h): a config.json that leaves a field out builds transformers'
 * default for its model_type. The expected values below are written out by hand from
 * transformers' config classes (Qwen3MoeConfig, OlmoeConfig, MixtralConfig in
 * src/transformers/models/<type>/configuration_<type>.py; rope_theta the class's default_theta),
 * not read from flatmoe's table, so a wrong table entry fails here. */
#include <string.h>

#include "fm_test.h"
#include "model/fm_config.h"

typedef struct want {
    const char *type;
    int64_t vocab, hidden, dense_inter, expert_inter, layers, heads, kv, max_pos, experts, topk;
    double theta, eps, aux;
} want;

static const want k_want[] = {
    /* Qwen3MoeConfig: intermediate_size 6144 is the dense MLP's, moe_intermediate_size 768 the experts' */
    {"qwen3_moe", 151936, 2048, 6144, 768, 24, 32, 4, 32768, 128, 8, 10000.0, 1e-6, 0.001},
    /* OlmoeConfig: num_key_value_heads None -> num_attention_heads */
    {"olmoe", 50304, 2048, 0, 2048, 16, 16, 16, 4096, 64, 8, 10000.0, 1e-5, 0.01},
    /* MixtralConfig: max_position_embeddings 4096 * 32, default_theta 1e6 */
    {"mixtral", 32000, 4096, 0, 14336, 32, 32, 8, 131072, 8, 2, 1e6, 1e-5, 0.001},
};

/* {"model_type": T} alone: every field is transformers' default. */
static void test_all_defaults(void) {
    for (size_t i = 0; i < sizeof k_want / sizeof k_want[0]; i++) {
        const want *w = &k_want[i];
        char json[128];
        snprintf(json, sizeof json, "{\"model_type\": \"%s\"}", w->type);
        fm_config c;
        fm_status s = fm_config_parse(&c, json, "defaults.json");
        CHECK_MSG(s == FM_OK, "%s: %s", w->type, fm_errmsg());
        if (s) continue;
        CHECK_MSG(c.vocab_size == w->vocab && c.hidden_size == w->hidden && c.num_hidden_layers == w->layers &&
                      c.num_attention_heads == w->heads && c.num_key_value_heads == w->kv &&
                      c.max_position_embeddings == w->max_pos && c.num_experts == w->experts &&
                      c.num_experts_per_tok == w->topk && c.moe_intermediate_size == w->expert_inter &&
                      c.dense_intermediate_size == w->dense_inter,
                  "%s: V %lld H %lld L %lld nh %lld nkv %lld P %lld E %lld k %lld I %lld Id %lld", w->type,
                  (long long)c.vocab_size, (long long)c.hidden_size, (long long)c.num_hidden_layers,
                  (long long)c.num_attention_heads, (long long)c.num_key_value_heads,
                  (long long)c.max_position_embeddings, (long long)c.num_experts, (long long)c.num_experts_per_tok,
                  (long long)c.moe_intermediate_size, (long long)c.dense_intermediate_size);
        CHECK_MSG(c.rope_theta == w->theta && c.rms_norm_eps == w->eps && c.router_aux_loss_coef == w->aux,
                  "%s: theta %g eps %g aux %g", w->type, c.rope_theta, c.rms_norm_eps, c.router_aux_loss_coef);
        /* the same for every type: 0.02, untied, no z-loss, head_dim H / nh, every layer MoE */
        CHECK(c.initializer_range == 0.02 && !c.tie_word_embeddings && c.router_z_loss_coef == 0.0);
        CHECK(c.head_dim == w->hidden / w->heads);
        CHECK(c.decoder_sparse_step == 1 && fm_config_num_moe_layers(&c) == w->layers);
        CHECK(c.norm_topk_prob == !strcmp(w->type, "mixtral")); /* mixtral always renormalizes */
    }
}

/* The fields whose default differs between model types, each left out of an otherwise given
 * config: the kv heads (qwen3_moe 4, mixtral 8, olmoe the attention heads), rope_theta,
 * rms_norm_eps, router_aux_loss_coef, the expert count and top-k, max_position_embeddings. */
static void test_defaulted_fields(void) {
    static const char *const given[] = {
        "{\"model_type\":\"qwen3_moe\",\"vocab_size\":256,\"hidden_size\":64,\"num_hidden_layers\":2,"
        "\"num_attention_heads\":8,\"moe_intermediate_size\":32}",
        "{\"model_type\":\"olmoe\",\"vocab_size\":256,\"hidden_size\":64,\"num_hidden_layers\":2,"
        "\"num_attention_heads\":8,\"intermediate_size\":32}",
        "{\"model_type\":\"mixtral\",\"vocab_size\":256,\"hidden_size\":64,\"num_hidden_layers\":2,"
        "\"num_attention_heads\":8,\"intermediate_size\":32}",
    };
    for (int i = 0; i < 3; i++) {
        const want *w = &k_want[i];
        fm_config c;
        fm_status s = fm_config_parse(&c, given[i], "given.json");
        CHECK_MSG(s == FM_OK, "%s: %s", w->type, fm_errmsg());
        if (s) continue;
        const int64_t kv = i == 1 ? 8 : w->kv; /* olmoe: the given num_attention_heads */
        CHECK_MSG(c.num_key_value_heads == kv, "%s: %lld kv heads, transformers builds %lld", w->type,
                  (long long)c.num_key_value_heads, (long long)kv);
        CHECK(c.hidden_size == 64 && c.num_attention_heads == 8 && c.head_dim == 8 && c.moe_intermediate_size == 32);
        CHECK(c.rope_theta == w->theta && c.rms_norm_eps == w->eps && c.router_aux_loss_coef == w->aux);
        CHECK(c.num_experts == w->experts && c.num_experts_per_tok == w->topk && c.max_position_embeddings == w->max_pos);
    }
    /* a defaulted kv-head count that does not divide the heads: the message says it was defaulted */
    fm_config c;
    fm_status s = fm_config_parse(&c, "{\"model_type\":\"mixtral\",\"hidden_size\":64,\"num_attention_heads\":4}",
                                  "kv.json");
    CHECK(s == FM_ERR_CONFIG);
    CHECK_MSG(strstr(fm_errmsg(), "num_key_value_heads (8, transformers' default") && strstr(fm_errmsg(), "kv.json") &&
                  strstr(fm_errmsg(), "give num_key_value_heads"),
              "message: %s", fm_errmsg());
    /* given explicitly, the value wins over the default */
    CHECK(fm_config_parse(&c, "{\"model_type\":\"qwen3_moe\",\"num_attention_heads\":8,\"num_key_value_heads\":8}",
                          "kv8.json") == FM_OK);
    CHECK(c.num_key_value_heads == 8);
    /* null is transformers' None: MixtralConfig's and OlmoeConfig's __post_init__ make it the heads
     * (mixtral: not the absent field's 8) */
    CHECK(fm_config_parse(&c, "{\"model_type\":\"mixtral\",\"num_attention_heads\":4,\"num_key_value_heads\":null}",
                          "null.json") == FM_OK);
    CHECK(c.num_key_value_heads == 4);
    CHECK(fm_config_parse(&c, "{\"model_type\":\"olmoe\",\"num_attention_heads\":4,\"num_key_value_heads\":null}",
                          "null.json") == FM_OK);
    CHECK(c.num_key_value_heads == 4);
}

int main(void) {
    test_all_defaults();
    test_defaulted_fields();
    return fm_test_finish();
}
