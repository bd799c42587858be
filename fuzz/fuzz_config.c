/* libFuzzer harness: config.json (model/fm_config.c, fm_config_parse). The input is the file's
 * text. A config that parses must write back (fm_config_to_json) to a text that parses to the
 * same sizes: the reader accepts nothing its own writer cannot repeat. */
#include "fm_fuzz.h"
#include "model/fm_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = fuzz_str(data, size);
    fm_config c;
    if (fm_config_parse(&c, text, "config.json") == FM_OK) {
        FUZZ_CHECK(c.hidden_size > 0 && c.num_experts_per_tok <= c.num_experts && c.head_dim > 0 &&
                   c.head_dim <= (1LL << 30) && c.vocab_size <= (1LL << 30), "a parsed config out of its ranges");
        char *back = fm_config_to_json(&c);
        FUZZ_CHECK(back != NULL, "fm_config_to_json failed");
        fm_config d;
        const fm_status st = fm_config_parse(&d, back, "config.json (written back)");
        FUZZ_CHECK(st == FM_OK, "the written-back config does not parse: %s\n%s", fm_errmsg(), back);
        FUZZ_CHECK(d.model_type == c.model_type && d.hidden_size == c.hidden_size && d.vocab_size == c.vocab_size &&
                   d.num_hidden_layers == c.num_hidden_layers && d.num_experts == c.num_experts &&
                   d.num_experts_per_tok == c.num_experts_per_tok && d.head_dim == c.head_dim &&
                   d.moe_intermediate_size == c.moe_intermediate_size &&
                   d.num_key_value_heads == c.num_key_value_heads,
                   "the written-back config differs:\n%s", back);
        fm_free(back);
    }
    free(text);
    return 0;
}
