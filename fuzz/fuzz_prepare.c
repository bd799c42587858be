/* libFuzzer harness: prepare's JSONL reader (prep/fm_prepare.c, fm_prepare with format JSONL).
 * Input: byte 0 sets the shard size (1 + byte % 64 tokens: documents then run across shards),
 * byte 1 bit 0 no_eos, the rest is the .jsonl file. The tokenizer is fixed: byte fallback over
 * <0x00>..<0xFF>, the letters, a few merges, "</s>" as EOS. Every shard that prepare writes must
 * load again (data/fm_data.h fm_dataset_load) with ids inside the vocabulary and its mask, and
 * together hold the token count prepare reported; on an error no output file may be left. */
#include <dirent.h>

#include "fm_fuzz.h"
#include "data/fm_data.h"
#include "prep/fm_prepare.h"
#include "tok/fm_tokenizer.h"

static fm_tokenizer g_tok;
static bool g_ready;

static void setup(void) {
    char json[16384];
    size_t at = (size_t)snprintf(json, sizeof json, "{\"added_tokens\":[{\"id\":300,\"content\":\"</s>\",\"special\":true}],"
                                                   "\"model\":{\"type\":\"BPE\",\"byte_fallback\":true,\"vocab\":{");
    for (int b = 0; b < 256; b++) at += (size_t)snprintf(json + at, sizeof json - at, "\"<0x%02X>\":%d,", b, b);
    for (int c = 0; c < 26; c++) at += (size_t)snprintf(json + at, sizeof json - at, "\"%c\":%d,", 'a' + c, 256 + c);
    snprintf(json + at, sizeof json - at, "\"ab\":282,\"abc\":283,\"th\":284},\"merges\":[\"a b\",\"ab c\",\"t h\"]}}");
    FUZZ_CHECK(fm_tokenizer_load(&g_tok, fuzz_write("tokenizer.json", json, strlen(json))) == FM_OK, "%s", fm_errmsg());
    FUZZ_CHECK(g_tok.eos_id == 300, "EOS %d", g_tok.eos_id);
    g_ready = true;
}

/* The names in the scratch folder that start with "out_", removed; returns how many. */
static int clean_outputs(void) {
    DIR *d = opendir(fuzz_dir());
    FUZZ_CHECK(d != NULL, "opendir");
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, "out_", 4)) {
            unlink(fuzz_path(e->d_name));
            n++;
        }
    closedir(d);
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    if (!g_ready) setup();
    const char *in = fuzz_write("in.jsonl", data + 2, size - 2);
    char prefix[256];
    snprintf(prefix, sizeof prefix, "%s", fuzz_path("out"));
    fm_prepare_opts o = {0};
    const char *inputs[1] = {in};
    o.inputs = inputs;
    o.n_inputs = 1;
    o.out_prefix = prefix;
    o.shard_tokens = 1 + data[0] % 64;
    o.format = FM_PREP_JSONL;
    o.no_eos = data[1] & 1;
    fm_prepare_stats st;
    memset(&st, 0, sizeof st);
    if (fm_prepare(&g_tok, &o, &st) != FM_OK) {
        FUZZ_CHECK(clean_outputs() == 0, "a refused input left output files");
        return 0;
    }
    FUZZ_CHECK(st.shards >= 1 && st.tokens >= 1 && st.masked <= st.tokens, "%lld shards, %lld tokens, %lld masked",
               (long long)st.shards, (long long)st.tokens, (long long)st.masked);
    int64_t total = 0;
    for (int64_t k = 0; k < st.shards; k++) {
        char name[64];
        snprintf(name, sizeof name, "out_%06lld.bin", (long long)k);
        const char *paths[1] = {fuzz_path(name)};
        fm_dataset ds;
        FUZZ_CHECK(fm_dataset_load(&ds, paths, 1, g_tok.vocab_size) == FM_OK, "shard %lld: %s", (long long)k, fm_errmsg());
        FUZZ_CHECK(ds.n_tokens <= o.shard_tokens, "shard of %lld tokens", (long long)ds.n_tokens);
        total += ds.n_tokens;
        fm_dataset_free(&ds);
    }
    FUZZ_CHECK(total == st.tokens, "the shards hold %lld tokens, prepare said %lld", (long long)total, (long long)st.tokens);
    clean_outputs();
    return 0;
}
