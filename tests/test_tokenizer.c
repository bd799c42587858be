/* Tests for src/tok: hand-made tokenizer.json files in each family's format with ids worked out
 * by hand; the goldens of tests/data/tok (made with Hugging Face `tokenizers` by
 * tools/tok_golden.py: every corpus file's ids token for token and its decode); UTF-8 repair as
 * Python's bytes.decode('utf-8', 'replace'); bad inputs. */
#define _GNU_SOURCE
#include "fm_test.h"
#include "tok/fm_tokenizer.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <unistd.h>

static char g_dir[64];

static const char *tpath(const char *name) {
    static char bufs[8][256];
    static int k = 0;
    char *p = bufs[k++ % 8];
    snprintf(p, 256, "%s/%s", g_dir, name);
    return p;
}

static void write_text(const char *path, const char *s) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(2); }
    fputs(s, f);
    fclose(f);
}

static char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    b[*n] = 0;
    fclose(f);
    return b;
}

/* GPT-2's byte -> character table, written out independently of src/tok: the printable bytes
 * map to themselves, the rest to U+0100.. in order. Appends its UTF-8 to out. */
static void gpt2_char(unsigned b, char *out) {
    unsigned cp = b, k = 0;
    const int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    if (!printable) {
        for (unsigned x = 0; x < b; x++) k += !((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174));
        cp = 256 + k;
    }
    char u[5] = {0};
    if (cp < 0x80) u[0] = (char)cp;
    else { u[0] = (char)(0xC0 | (cp >> 6)); u[1] = (char)(0x80 | (cp & 0x3F)); }
    strcat(out, u);
}

/* The 256 byte characters as a JSON vocab body "c": id (id = the byte). */
static void byte_vocab(char *out) {
    out[0] = 0;
    for (unsigned b = 0; b < 256; b++) {
        char key[8] = {0};
        gpt2_char(b, key);
        char item[48];
        if (!strcmp(key, "\"") || !strcmp(key, "\\")) snprintf(item, sizeof item, "\"\\%s\": %u,", key, b);
        else snprintf(item, sizeof item, "\"%s\": %u,", key, b);
        strcat(out, item);
    }
}

static int64_t enc(fm_tokenizer *t, const char *s, int32_t *ids, int64_t cap) {
    int64_t n = -1;
    fm_status st = fm_tokenizer_encode(t, s, strlen(s), ids, cap, &n);
    CHECK_MSG(st == FM_OK, "encode \"%s\": %s", s, fm_errmsg());
    return n;
}

static void check_ids(fm_tokenizer *t, const char *s, const int32_t *want, int64_t nw) {
    int32_t got[256];
    int64_t n = enc(t, s, got, 256);
    int same = n == nw;
    for (int64_t i = 0; same && i < n; i++) same = got[i] == want[i];
    CHECK_MSG(same, "\"%s\": %lld ids, expected %lld (first %d vs %d)", s, (long long)n, (long long)nw,
              n > 0 ? got[0] : -1, nw > 0 ? want[0] : -1);
}

static void check_decode(fm_tokenizer *t, const int32_t *ids, int64_t n, bool skip, const char *want) {
    char *text;
    size_t len;
    CHECK(fm_tokenizer_decode(t, ids, n, skip, &text, &len) == FM_OK);
    CHECK_MSG(len == strlen(want) && !memcmp(text, want, len), "decode: \"%s\", expected \"%s\"", text, want);
    fm_free(text);
}

/* GPT-NeoX style (OLMoE): ByteLevel with the GPT-2 regex, "a b" merges, a special token. */
static void test_bytelevel(void) {
    static char vocab[8192], json[16384];
    byte_vocab(vocab);
    snprintf(json, sizeof json,
             "{\"version\": \"1.0\", \"added_tokens\": [{\"id\": 259, \"content\": \"<|endoftext|>\", \"single_word\": false,"
             " \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true},"
             " {\"id\": 260, \"content\": \"<m>\", \"lstrip\": true, \"rstrip\": true, \"normalized\": false, \"special\": true},"
             " {\"id\": 261, \"content\": \"hehe\", \"single_word\": true, \"normalized\": false, \"special\": false}],"
             " \"normalizer\": null, \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false,"
             " \"trim_offsets\": true, \"use_regex\": true}, \"post_processor\": null,"
             " \"decoder\": {\"type\": \"ByteLevel\"}, \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null,"
             " \"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, \"fuse_unk\": false, \"byte_fallback\": false,"
             " \"vocab\": {%s \"\xC4\xA0t\": 256, \"he\": 257, \"\xC4\xA0the\": 258, \"<|endoftext|>\": 259},"
             " \"merges\": [\"#version: 0.2\", \"\xC4\xA0 t\", \"h e\", \"\xC4\xA0t he\"]}}", vocab);
    write_text(tpath("bl.json"), json);
    fm_tokenizer t;
    CHECK_MSG(fm_tokenizer_load(&t, tpath("bl.json")) == FM_OK, "%s", fm_errmsg());
    if (!t.impl) return;
    CHECK(t.vocab_size == 262);
    CHECK(t.eos_id == 259); /* the special <|endoftext|> */
    /* " the" -> Ġ t h e -> Ġt (rank 0), he (1), Ġthe (2); "xhehe": x he he (the single-word
     * added token "hehe" is not taken inside a word); the special token whole */
    check_ids(&t, " the<|endoftext|>xhehe", (int32_t[]){258, 259, 'x', 257, 257}, 5);
    check_ids(&t, "hehe", (int32_t[]){261}, 1);
    check_ids(&t, "x hehe!", (int32_t[]){'x', ' ', 261, '!'}, 4); /* " " is Ġ, id 32 */
    /* lstrip and rstrip: <m> takes the spaces on both sides */
    check_ids(&t, "a  <m>  b", (int32_t[]){'a', 260, 'b'}, 3);
    /* the GPT-2 regex: "it's" -> "it" "'s"; "  x" -> " " " x" (\s+(?!\S) leaves the last space) */
    check_ids(&t, "it's", (int32_t[]){'i', 't', '\'', 's'}, 4);
    check_ids(&t, "  the", (int32_t[]){' ', 258}, 2); /* the space byte's character Ġ has id 32 here */
    check_ids(&t, "", NULL, 0);
    /* a byte outside ASCII: its GPT-2 character's id is the byte */
    check_ids(&t, "\xC3\xA9", (int32_t[]){0xC3, 0xA9}, 2);
    check_decode(&t, (int32_t[]){258, 259, 257, 0xC3, 0xA9}, 5, false, " the<|endoftext|>he\xC3\xA9");
    check_decode(&t, (int32_t[]){258, 259, 257}, 3, true, " thehe");
    check_decode(&t, (int32_t[]){0xC3}, 1, false, "\xEF\xBF\xBD"); /* a lone lead byte: U+FFFD */
    CHECK(fm_tokenizer_token_to_id(&t, "he") == 257);
    CHECK(fm_tokenizer_token_to_id(&t, "nope") == -1);
    CHECK(fm_tokenizer_is_special(&t, 259) && !fm_tokenizer_is_special(&t, 258));
    /* the growable variant appends */
    int32_t *ids = NULL;
    int64_t n = 0, cap = 0;
    CHECK(fm_tokenizer_encode_append(&t, " the", 4, &ids, &n, &cap) == FM_OK);
    CHECK(fm_tokenizer_encode_append(&t, "hehe", 4, &ids, &n, &cap) == FM_OK);
    CHECK(n == 2 && ids[0] == 258 && ids[1] == 261); /* "hehe" alone is the single-word token */
    fm_free(ids);
    /* a short output buffer: FM_ERR_ARG and the full count */
    int32_t two[2];
    int64_t need;
    CHECK(fm_tokenizer_encode(&t, "a b c d", 7, two, 2, &need) == FM_ERR_ARG && need == 7); /* a Ġ b Ġ c Ġ d */
    fm_tokenizer_free(&t);
    fm_tokenizer_free(&t); /* twice is safe */
}

/* Qwen3 style: NFC, Split(regex, Isolated) then ByteLevel without regex, [a, b] merges. */
static void test_qwen_style(void) {
    static char vocab[8192], json[16384];
    byte_vocab(vocab);
    snprintf(json, sizeof json,
             "{\"added_tokens\": [{\"id\": 258, \"content\": \"<|im_end|>\", \"special\": true, \"normalized\": false}],"
             " \"normalizer\": {\"type\": \"NFC\"}, \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": ["
             "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|"
             "\\\\p{N}| ?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"}, \"behavior\": \"Isolated\","
             " \"invert\": false}, {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}]},"
             " \"decoder\": {\"type\": \"ByteLevel\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {%s"
             " \"\xC3\x83\xC2\xA9\": 256, \"T'\": 257, \"<|im_end|>\": 258}, \"merges\": [[\"\xC3\x83\", \"\xC2\xA9\"], [\"T\", \"'\"]]}}",
             vocab);
    write_text(tpath("qw.json"), json);
    fm_tokenizer t;
    CHECK_MSG(fm_tokenizer_load(&t, tpath("qw.json")) == FM_OK, "%s", fm_errmsg());
    if (!t.impl) return;
    /* NFC: e + U+0301 -> U+00E9 (C3 A9) -> "Ã©" -> merged (256) */
    check_ids(&t, "e\xCC\x81", (int32_t[]){256}, 1);
    check_ids(&t, "\xC3\xA9", (int32_t[]){256}, 1);
    /* "IT'S": the regex's (?i:'s) splits "'S" from "IT", so the merge T + ' never applies */
    check_ids(&t, "IT'S", (int32_t[]){'I', 'T', '\'', 'S'}, 4);
    /* digits one by one; the special token inside text */
    check_ids(&t, "12<|im_end|>", (int32_t[]){'1', '2', 258}, 3);
    check_decode(&t, (int32_t[]){256, 258}, 2, false, "\xC3\xA9<|im_end|>");
    fm_tokenizer_free(&t);
}

/* Mixtral / Llama style: Prepend + Replace normalizers, byte fallback, fuse_unk, the sentencepiece
 * decoder chain. */
static void mixtral_json(char *json, size_t cap, bool byte_fallback) {
    char vocab[16384] = "\"<unk>\": 0, \"<s>\": 1, \"</s>\": 2,";
    for (int b = 0; b < 256; b++) {
        char item[32];
        snprintf(item, sizeof item, " \"<0x%02X>\": %d,", b, 3 + b);
        strcat(vocab, item);
    }
    snprintf(json, cap,
             "{\"added_tokens\": [{\"id\": 265, \"content\": \"XY\", \"special\": false, \"normalized\": true},"
             " {\"id\": 0, \"content\": \"<unk>\", \"special\": true, \"normalized\": false},"
             " {\"id\": 1, \"content\": \"<s>\", \"special\": true, \"normalized\": false},"
             " {\"id\": 2, \"content\": \"</s>\", \"special\": true, \"normalized\": false}],"
             " \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", \"prepend\": \"\xE2\x96\x81\"},"
             " {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"\xE2\x96\x81\"}]},"
             " \"pre_tokenizer\": null, \"decoder\": {\"type\": \"Sequence\", \"decoders\": ["
             "{\"type\": \"Replace\", \"pattern\": {\"String\": \"\xE2\x96\x81\"}, \"content\": \" \"}, {\"type\": \"ByteFallback\"},"
             " {\"type\": \"Fuse\"}, {\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}]},"
             " \"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"fuse_unk\": true, \"byte_fallback\": %s,"
             " \"vocab\": {%s \"\xE2\x96\x81\": 259, \"h\": 260, \"i\": 261, \"\xE2\x96\x81h\": 262, \"hi\": 263, \"\xE2\x96\x81hi\": 264},"
             " \"merges\": [[\"\xE2\x96\x81\", \"h\"], [\"h\", \"i\"], [\"\xE2\x96\x81h\", \"i\"]]}}",
             byte_fallback ? "true" : "false", vocab);
}

static void test_mixtral_style(void) {
    static char json[32768];
    mixtral_json(json, sizeof json, true);
    write_text(tpath("mx.json"), json);
    fm_tokenizer t;
    CHECK_MSG(fm_tokenizer_load(&t, tpath("mx.json")) == FM_OK, "%s", fm_errmsg());
    if (!t.impl) return;
    CHECK(t.eos_id == 2);
    /* "▁hi▁hi": ▁h at 0 and 3 (rank 0), then ▁hi twice (rank 2); hi (rank 1) goes stale */
    check_ids(&t, "hi hi", (int32_t[]){264, 264}, 2);
    /* the special token is split out of the raw text; each side gets its own "▁" */
    check_ids(&t, "hi<s>hi", (int32_t[]){264, 1, 264}, 3);
    /* é is not in the vocab: its bytes C3 A9 as <0xC3> <0xA9> */
    check_ids(&t, "\xC3\xA9", (int32_t[]){259, 3 + 0xC3, 3 + 0xA9}, 3);
    check_decode(&t, (int32_t[]){264, 1, 264}, 3, false, "hi<s> hi");
    check_decode(&t, (int32_t[]){264, 1, 264}, 3, true, "hi hi");
    check_decode(&t, (int32_t[]){259, 3 + 0xC3, 3 + 0xA9}, 3, false, "\xC3\xA9");
    check_decode(&t, (int32_t[]){3 + 0xC3, 264}, 2, false, "\xEF\xBF\xBD hi"); /* a lone byte: U+FFFD per byte */
    /* a normalized added token: matched as its normalized form "▁XY" in the normalized text */
    check_ids(&t, "a XY", (int32_t[]){259, 3 + 'a', 265}, 3);
    check_ids(&t, "XY", (int32_t[]){265}, 1);
    check_ids(&t, "aXY", (int32_t[]){259, 3 + 'a', 3 + 'X', 3 + 'Y'}, 4);
    check_decode(&t, (int32_t[]){259, 3 + 'a', 265}, 3, false, "a XY"); /* "▁XY" decodes with its space */
    fm_tokenizer_free(&t);
    /* without byte fallback: unknown characters become <unk>, consecutive ones fused */
    mixtral_json(json, sizeof json, false);
    write_text(tpath("mx2.json"), json);
    CHECK_MSG(fm_tokenizer_load(&t, tpath("mx2.json")) == FM_OK, "%s", fm_errmsg());
    if (!t.impl) return;
    check_ids(&t, "\xC3\xA9\xC3\xA9hi", (int32_t[]){259, 0, 263}, 3);
    fm_tokenizer_free(&t);
}

/* bytes.decode('utf-8', errors='replace') on each case, written out by hand from the Unicode
 * maximal-subpart rule (Python 3 gives the same). */
static void test_utf8(void) {
    struct { const char *in; size_t n; const char *want; } c[] = {
        {"a\xff" "b", 3, "a\xEF\xBF\xBD" "b"},
        {"\xc0\xaf", 2, "\xEF\xBF\xBD\xEF\xBF\xBD"},                          /* overlong: 2 */
        {"\xed\xa0\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},          /* surrogate: 3 */
        {"\xe6\x97 x", 4, "\xEF\xBF\xBD x"},                                  /* truncated: 1 */
        {"\xf0\x9f\x98", 3, "\xEF\xBF\xBD"},                                  /* truncated 4-byte: 1 */
        {"\xe0\x80\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},          /* E0 needs A0..BF */
        {"\xf4\x90\x80\x80", 4, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* > U+10FFFF */
        {"\xf8\x88\x80\x80\x80", 5, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
        {"ok \xe2\x82\xac \xf0\x9f\x98\x80", 11, "ok \xe2\x82\xac \xf0\x9f\x98\x80"},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        char out[64];
        size_t n = fm_utf8_sanitize(c[i].in, c[i].n, out);
        CHECK_MSG(n == strlen(c[i].want) && !memcmp(out, c[i].want, n), "case %zu: %zu bytes", i, n);
    }
}

static void expect_load_error(const char *name, const char *json, fm_status want, const char *needle) {
    if (json) write_text(tpath(name), json);
    fm_tokenizer t;
    fm_status s = fm_tokenizer_load(&t, json ? tpath(name) : name);
    CHECK_MSG(s == want && t.impl == NULL, "%s: status %d, expected %d", name, s, want);
    CHECK_MSG(strstr(fm_errmsg(), needle) != NULL, "%s: message \"%s\" lacks \"%s\"", name, fm_errmsg(), needle);
    fm_tokenizer_free(&t);
}

static void test_bad_inputs(void) {
    expect_load_error("/nonexistent/tokenizer.json", NULL, FM_ERR_IO, "/nonexistent/tokenizer.json");
    expect_load_error(g_dir, NULL, FM_ERR_IO, "tokenizer.json"); /* a folder without one */
    expect_load_error("bad.json", "{\"model\": {\"vocab\": {", FM_ERR_FORMAT, "malformed JSON");
    const char *model = "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\"]}";
    char j[1024];
    snprintf(j, sizeof j, "{\"normalizer\": {\"type\": \"Lowercase\"}, %s}", model);
    expect_load_error("lower.json", j, FM_ERR_UNSUPPORTED, "normalizer type \"Lowercase\"");
    snprintf(j, sizeof j, "{\"pre_tokenizer\": {\"type\": \"Whitespace\"}, %s}", model);
    expect_load_error("ws.json", j, FM_ERR_UNSUPPORTED, "pre_tokenizer type \"Whitespace\"");
    snprintf(j, sizeof j, "{\"decoder\": {\"type\": \"WordPiece\"}, %s}", model);
    expect_load_error("wp.json", j, FM_ERR_UNSUPPORTED, "decoder type \"WordPiece\"");
    expect_load_error("uni.json", "{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}", FM_ERR_UNSUPPORTED,
                      "model type \"Unigram\"");
    expect_load_error("merge.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\"]}}",
                      FM_ERR_FORMAT, "\"ab\" is not in model.vocab");
    snprintf(j, sizeof j, "{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}, \"behavior\": \"Isolated\"}, %s}", model);
    expect_load_error("re.json", j, FM_ERR_FORMAT, "PCRE2 cannot compile");
    /* and the file is named in each message */
    expect_load_error("lower2.json", "{\"normalizer\": {\"type\": \"NFKC\"}, \"model\": {\"vocab\": {}, \"merges\": []}}",
                      FM_ERR_UNSUPPORTED, "lower2.json");
}

/* Findings of the fuzzing of 2026-12-07 (issue 27), each failing under AddressSanitizer/UBSan before
 * its fix (scripts/test.sh's sanitized pass): a Split pre-tokenizer whose behavior is missing or
 * unknown leaked its compiled pattern (a PCRE2 code with a Regex); a word of no ids (no unk_token,
 * no byte fallback, a character outside the vocabulary) passed NULL to memcpy; and every
 * allocation failure of a load frees what the load had made (LeakSanitizer would name it). */
static void test_fuzz_findings(void) {
    expect_load_error("split_nobeh.json", "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},"
                      "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"String\":\" \"}}}", FM_ERR_FORMAT,
                      "Split behavior \"(missing)\"");
    expect_load_error("split_badbeh.json", "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},"
                      "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\s+\"},\"behavior\":\"Nope\"}}",
                      FM_ERR_FORMAT, "Split behavior \"Nope\"");
    expect_load_error("added_big.json", "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},"
                      "\"added_tokens\":[{\"id\":1e300,\"content\":\"x\"}]}", FM_ERR_FORMAT, "0 .. 2^31-1");
    expect_load_error("strip_big.json", "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},"
                      "\"decoder\":{\"type\":\"Strip\",\"content\":\" \",\"start\":1e300,\"stop\":0}}", FM_ERR_FORMAT,
                      "decoder Strip");
    /* a word of no ids */
    write_text(tpath("noids.json"), "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}");
    fm_tokenizer t;
    CHECK(fm_tokenizer_load(&t, tpath("noids.json")) == FM_OK);
    int32_t buf[8];
    CHECK(enc(&t, "z", buf, 8) == 0);
    CHECK(enc(&t, "z", NULL, 0) == 0); /* twice: the second from the word cache, were it cached */
    const int32_t a2[] = {0, 0};
    check_ids(&t, "aza", a2, 2);
    int32_t *ids = NULL;
    int64_t n = 0, cap = 0;
    CHECK(fm_tokenizer_encode_append(&t, "zz", 2, &ids, &n, &cap) == FM_OK && n == 0 && ids == NULL);
    CHECK(fm_tokenizer_encode_append(&t, "a", 1, &ids, &n, &cap) == FM_OK && n == 1 && ids && ids[0] == 0);
    fm_free(ids);
    check_decode(&t, NULL, 0, false, "");
    fm_tokenizer_free(&t);
    /* every allocation failure of a load with each kind of pattern and added tokens: an error, no leak */
    write_text(tpath("full.json"),
               "{\"added_tokens\":[{\"id\":2,\"content\":\"<s>\",\"special\":true},{\"id\":3,\"content\":\"xy\"}],"
               "\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},"
               "\"content\":\"a\"},{\"type\":\"Prepend\",\"prepend\":\"a\"}]},"
               "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"b+\"},\"behavior\":\"Isolated\"},"
               "\"decoder\":{\"type\":\"Replace\",\"pattern\":{\"Regex\":\"a\"},\"content\":\" \"},"
               "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"ab\":4},\"merges\":[\"a b\"]}}");
    int failures = 0;
    for (int64_t k = 1; k < 10000; k++) {
        fm_fault_set(k);
        const fm_status st = fm_tokenizer_load(&t, tpath("full.json"));
        fm_fault_set(0);
        if (st == FM_OK) break;
        CHECK_MSG(st == FM_ERR_NOMEM && t.impl == NULL, "allocation %lld failing: status %d (%s)", (long long)k, st,
                  fm_errmsg());
        failures++;
    }
    CHECK_MSG(failures > 10 && t.impl != NULL, "the load made %d allocations before it succeeded", failures);
    fm_tokenizer_free(&t);
}

/* Split behaviours on a hand-made tokenizer with no merges: each piece of "a-b--c" becomes ids. */
static void test_split_behaviors(void) {
    static const char *beh[] = {"Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
    /* vocab: single characters and the pieces each behaviour makes */
    static const int32_t want[5][8] = {
        {0, 2, 1, 2, 2, 3, -1},  /* a - b - - c */
        {0, 1, 3, -1},           /* a b c */
        {4, 5, 2, 3, -1},        /* a- b- - c */
        {0, 6, 2, 7, -1},        /* a -b - -c */
        {0, 2, 1, 8, 3, -1},     /* a - b -- c */
    };
    for (int k = 0; k < 5; k++) {
        char j[1024];
        snprintf(j, sizeof j, "{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"String\": \"-\"}, \"behavior\": \"%s\"},"
                 " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"-\": 2, \"c\": 3, \"a-\": 4, \"b-\": 5,"
                 " \"-b\": 6, \"-c\": 7, \"--\": 8}, \"merges\": [\"a -\", \"b -\", \"- b\", \"- c\", \"- -\"]}}", beh[k]);
        write_text(tpath("split.json"), j);
        fm_tokenizer t;
        CHECK_MSG(fm_tokenizer_load(&t, tpath("split.json")) == FM_OK, "%s", fm_errmsg());
        if (!t.impl) continue;
        int64_t nw = 0;
        while (want[k][nw] >= 0) nw++;
        printf("split %s\n", beh[k]);
        check_ids(&t, "a-b--c", want[k], nw);
        fm_tokenizer_free(&t);
    }
}

/* EOS: tokenizer_config.json's eos_token, else config.json's eos_token_id, else a special token. */
static void test_eos(void) {
    char dir[128], cmd[512];
    snprintf(dir, sizeof dir, "%s/eosdir", g_dir);
    snprintf(cmd, sizeof cmd, "mkdir -p %s && cp %s %s/tokenizer.json", dir, tpath("bl.json"), dir);
    CHECK(system(cmd) == 0);
    fm_tokenizer t;
    CHECK(fm_tokenizer_load(&t, dir) == FM_OK && t.eos_id == 259);
    fm_tokenizer_free(&t);
    snprintf(cmd, sizeof cmd, "%s/config.json", dir);
    write_text(cmd, "{\"eos_token_id\": [258, 1]}");
    CHECK(fm_tokenizer_load(&t, dir) == FM_OK && t.eos_id == 258);
    fm_tokenizer_free(&t);
    snprintf(cmd, sizeof cmd, "%s/tokenizer_config.json", dir);
    write_text(cmd, "{\"eos_token\": {\"content\": \"he\"}}");
    CHECK(fm_tokenizer_load(&t, dir) == FM_OK && t.eos_id == 257);
    fm_tokenizer_free(&t);
}

/* The goldens: every corpus file, each family, ids token for token and the decode. */
static void test_goldens(void) {
    const char *root = getenv("FLATMOE_SOURCE_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/data/tok/golden.json", root ? root : ".");
    size_t n;
    char *js = read_all(path, &n);
    CHECK_MSG(js != NULL, "%s is missing (tools/tok_golden.py makes it)", path);
    if (!js) return;
    cJSON *g = cJSON_ParseWithLength(js, n);
    free(js);
    CHECK(g != NULL);
    const cJSON *ids = cJSON_GetObjectItem(g, "ids"), *dec = cJSON_GetObjectItem(g, "decode"), *fam;
    int files = 0;
    cJSON_ArrayForEach(fam, ids) {
        char tdir[1024];
        snprintf(tdir, sizeof tdir, "%s/tests/data/tok/%s", root ? root : ".", fam->string);
        fm_tokenizer t;
        fm_status st = fm_tokenizer_load(&t, tdir);
        CHECK_MSG(st == FM_OK, "%s: %s", tdir, fm_errmsg());
        if (st) continue;
        const cJSON *file;
        cJSON_ArrayForEach(file, fam) {
            char cpath[1200];
            snprintf(cpath, sizeof cpath, "%s/tests/data/tok/corpus/%s", root ? root : ".", file->string);
            size_t len;
            char *text = read_all(cpath, &len);
            CHECK_MSG(text != NULL, "%s missing", cpath);
            if (!text) continue;
            int32_t *got = NULL;
            int64_t ng = 0, cap = 0;
            CHECK(fm_tokenizer_encode_append(&t, text, len, &got, &ng, &cap) == FM_OK);
            const int nw = cJSON_GetArraySize(file);
            int64_t first_diff = -1;
            for (int64_t i = 0; i < (ng > nw ? ng : nw) && first_diff < 0; i++)
                if (i >= ng || i >= nw || got[i] != (int32_t)cJSON_GetArrayItem(file, (int)i)->valuedouble) first_diff = i;
            CHECK_MSG(first_diff < 0, "%s / %s: %lld ids vs golden %d, first difference at %lld (ours %d, golden %d)",
                      fam->string, file->string, (long long)ng, nw, (long long)first_diff,
                      first_diff < ng ? got[first_diff] : -1,
                      first_diff < nw ? (int)cJSON_GetArrayItem(file, (int)first_diff)->valuedouble : -1);
            /* decode the golden ids (skip_special_tokens=False) */
            int32_t *gi = malloc(sizeof(int32_t) * (size_t)(nw + 1));
            for (int i = 0; i < nw; i++) gi[i] = (int32_t)cJSON_GetArrayItem(file, i)->valuedouble;
            char *out;
            size_t olen;
            CHECK(fm_tokenizer_decode(&t, gi, nw, false, &out, &olen) == FM_OK);
            const cJSON *want = cJSON_GetObjectItem(cJSON_GetObjectItem(dec, fam->string), file->string);
            CHECK_MSG(cJSON_IsString(want) && strlen(want->valuestring) == olen && !memcmp(out, want->valuestring, olen),
                      "%s / %s: decode differs (%zu bytes vs %zu)", fam->string, file->string, olen,
                      cJSON_IsString(want) ? strlen(want->valuestring) : 0);
            fm_free(out);
            free(gi);
            fm_free(got);
            free(text);
            files++;
        }
        fm_tokenizer_free(&t);
    }
    printf("goldens: %d corpus files checked\n", files);
    CHECK(files >= 3 * 8);
    cJSON_Delete(g);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/fm_test_tok_XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    test_utf8();
    test_bytelevel();
    test_eos();
    test_qwen_style();
    test_mixtral_style();
    test_split_behaviors();
    test_bad_inputs();
    test_fuzz_findings();
    test_goldens();
    int rc = fm_test_finish();
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    return rc;
}
