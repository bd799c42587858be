/* The tokenizer API in a build without PCRE2 and utf8proc (CMake found neither libpcre2-dev nor
 * libutf8proc-dev): loading reports FM_ERR_UNSUPPORTED with the fix; nothing else is reachable
 * without a loaded tokenizer. Only this file of src/tok is compiled then. */
#include <string.h>

#include "fm_tokenizer.h"

fm_status fm_tokenizer_load(fm_tokenizer *t, const char *path) {
    memset(t, 0, sizeof *t);
    t->eos_id = -1;
    return fm_error(FM_ERR_UNSUPPORTED, "%s: this flatmoe was built without tokenizer support (PCRE2 and utf8proc "
                    "were not found); install libpcre2-dev and libutf8proc-dev and build again", path);
}
fm_status fm_tokenizer_encode(fm_tokenizer *t, const char *text, size_t n, int32_t *out, int64_t cap, int64_t *n_out) {
    *n_out = 0;
    return fm_error(FM_ERR_UNSUPPORTED, "tokenizer support is not built");
}
fm_status fm_tokenizer_encode_append(fm_tokenizer *t, const char *text, size_t n, int32_t **ids, int64_t *n_ids,
                                     int64_t *cap) {
    return fm_error(FM_ERR_UNSUPPORTED, "tokenizer support is not built");
}
fm_status fm_tokenizer_decode(fm_tokenizer *t, const int32_t *ids, int64_t n, bool skip_special, char **text,
                              size_t *len) {
    *text = NULL;
    *len = 0;
    return fm_error(FM_ERR_UNSUPPORTED, "tokenizer support is not built");
}
int32_t fm_tokenizer_token_to_id(const fm_tokenizer *t, const char *token) { return -1; }
const char *fm_tokenizer_id_to_token(const fm_tokenizer *t, int32_t id) { return NULL; }
bool fm_tokenizer_is_special(const fm_tokenizer *t, int32_t id) { return false; }
void fm_tokenizer_free(fm_tokenizer *t) { memset(t, 0, sizeof *t); t->eos_id = -1; }
size_t fm_utf8_sanitize(const char *in, size_t n, char *out) {
    memcpy(out, in, n);
    return n;
}
