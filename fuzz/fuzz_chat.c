/* libFuzzer harness: the chat-template renderer (prep/fm_jinja.h), the Jinja subset `prepare`
 * applies to a tokenizer folder's chat_template (issue 28). The input is a template's text: it is
 * parsed, and a template that parses is rendered over a fixed conversation (a system turn, two
 * user/assistant exchanges, an assistant tool call and a tool reply, tools given) with and without
 * add_generation_prompt. Invariants: parse and render either succeed or fail with a status and a
 * message, never crash, hang or leak; a successful render gives a NUL-terminated text of the
 * length it states. */
#include <cjson/cJSON.h>

#include "fm_fuzz.h"
#include "prep/fm_jinja.h"

static const char *const VARS =
    "{\"messages\":[{\"role\":\"system\",\"content\":\"You are terse.\"},"
    "{\"role\":\"user\",\"content\":\"Hi there\"},{\"role\":\"assistant\",\"content\":\"Hello.\"},"
    "{\"role\":\"user\",\"content\":\"Weather in Paris?\"},"
    "{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"type\":\"function\",\"function\":"
    "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}}]},"
    "{\"role\":\"tool\",\"content\":\"18C, clear\"},{\"role\":\"assistant\",\"content\":\"18C and clear.\"}],"
    "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather\","
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}}}}}],"
    "\"bos_token\":\"<s>\",\"eos_token\":\"</s>\",\"add_generation_prompt\":false}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 65536) return 0; /* real templates are a few KiB; longer inputs only slow the search */
    static cJSON *vars;
    if (!vars) {
        vars = cJSON_Parse(VARS);
        FUZZ_CHECK(vars != NULL, "the harness's variables do not parse");
    }
    fm_jinja *t = NULL;
    if (fm_jinja_parse((const char *)data, size, "chat_template", &t) != FM_OK) {
        FUZZ_CHECK(t == NULL, "a failed parse returned a template");
        return 0;
    }
    for (int gen = 0; gen < 2; gen++) {
        cJSON_ReplaceItemInObjectCaseSensitive(vars, "add_generation_prompt", cJSON_CreateBool(gen));
        char *text = NULL;
        size_t len = 0;
        if (fm_jinja_render(t, vars, &text, &len) == FM_OK) {
            FUZZ_CHECK(text != NULL && strlen(text) <= len, "a render's text is not the length it states");
            fm_free(text);
        }
    }
    fm_jinja_free(t);
    return 0;
}
