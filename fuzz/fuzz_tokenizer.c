/* libFuzzer harness: tokenizer.json loading and encode/decode (src/tok). Input: a length-prefixed
 * piece (fm_fuzz.h fuzz_take) that is the tokenizer.json, then the rest: the text to encode, also
 * read as int32 ids to decode. A loaded tokenizer must give the same ids through both encode
 * entry points (a fixed buffer, and the growable append), ids inside its vocabulary, and a
 * decode of any ids, in range or not. */
#include "fm_fuzz.h"
#include "tok/fm_tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *p = data, *json;
    size_t n = size, lj;
    fuzz_take(&p, &n, &json, &lj);
    const char *path = fuzz_write("tokenizer.json", json, lj);
    fm_tokenizer tk;
    if (fm_tokenizer_load(&tk, path) != FM_OK) {
        FUZZ_CHECK(tk.impl == NULL, "a refused tokenizer was left loaded");
        return 0;
    }
    const char *text = (const char *)p;
    int32_t *ids = NULL;
    int64_t n_ids = 0, cap = 0;
    fm_status s = fm_tokenizer_encode_append(&tk, text, n, &ids, &n_ids, &cap);
    if (s == FM_OK) {
        for (int64_t i = 0; i < n_ids; i++)
            FUZZ_CHECK(ids[i] >= 0 && ids[i] < tk.vocab_size, "id %d of %lld", ids[i], (long long)tk.vocab_size);
        int32_t fixed[16];
        int64_t n2 = -1;
        s = fm_tokenizer_encode(&tk, text, n, fixed, 16, &n2);
        FUZZ_CHECK(n2 == n_ids && (n2 <= 16 ? s == FM_OK : s == FM_ERR_ARG), "encode gave %lld ids (%d), append %lld",
                   (long long)n2, s, (long long)n_ids);
        for (int64_t i = 0; i < n2 && i < 16; i++) FUZZ_CHECK(fixed[i] == ids[i], "id %lld differs", (long long)i);
        char *out;
        size_t len;
        for (int skip = 0; skip < 2; skip++) {
            FUZZ_CHECK(fm_tokenizer_decode(&tk, ids, n_ids, skip, &out, &len) == FM_OK, "decode: %s", fm_errmsg());
            FUZZ_CHECK(strlen(out) <= len, "decode's length");
            fm_free(out);
        }
    } else FUZZ_CHECK(s != FM_ERR_ARG, "encode_append: %s", fm_errmsg());
    fm_free(ids);
    /* any ids, in range or not */
    int32_t raw[64];
    const int64_t k = (int64_t)(n / 4 < 64 ? n / 4 : 64);
    if (k) memcpy(raw, p, (size_t)k * 4);
    char *out;
    size_t len;
    if (fm_tokenizer_decode(&tk, raw, k, false, &out, &len) == FM_OK) fm_free(out);
    for (int64_t i = 0; i < k; i++) (void)fm_tokenizer_id_to_token(&tk, raw[i]);
    fm_tokenizer_free(&tk);
    return 0;
}
