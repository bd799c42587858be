/* config.json kept as read (fm_config.h: fm_config_read_text, fm_config_json_as_read): the text of
 * the file a run's model came from, with only the fields flatmoe changes put in. The text itself
 * is kept, not a re-serialisation, so every field flatmoe does not read (bos_token_id,
 * eos_token_id, torch_dtype, architectures, rope_parameters, ...), every number's spelling
 * (10000.0 stays a float for transformers' strict config classes) and the key order survive. */
#include "fm_config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

void fm_config_json_add_float(void *obj, const char *key, double v) {
    char buf[64];
    snprintf(buf, sizeof buf, "%.15g", v);
    if (strtod(buf, NULL) != v) snprintf(buf, sizeof buf, "%.17g", v);
    if (!strpbrk(buf, ".eEn")) strcat(buf, ".0");
    cJSON_AddItemToObject((cJSON *)obj, key, cJSON_CreateRaw(buf));
}

fm_status fm_config_read_text(const char *path, char **text) {
    *text = NULL;
    struct stat sb;
    if (stat(path, &sb) == 0 && !S_ISREG(sb.st_mode))
        return fm_error(FM_ERR_IO, "%s: is not a file; expected a Hugging Face config.json", path);
    FILE *f = fopen(path, "rb");
    if (!f) return fm_error(FM_ERR_IO, "%s: cannot open the model config: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (n < 0 || n > (1 << 24)) {
        fclose(f);
        return fm_error(FM_ERR_FORMAT, "%s: expected a config.json of at most 16 MiB, found %ld bytes", path, n);
    }
    char *t = fm_malloc((size_t)n + 1);
    if (!t) { fclose(f); return fm_error(FM_ERR_NOMEM, "%s: out of memory reading the config", path); }
    size_t got = fread(t, 1, (size_t)n, f);
    fclose(f);
    if (got != (size_t)n) { fm_free(t); return fm_error(FM_ERR_IO, "%s: short read", path); }
    t[n] = 0;
    *text = t;
    return FM_OK;
}

/* ---- a scanner over the top-level object's members (the text cJSON already accepted) -------- */

static size_t skip_ws(const char *s, size_t i) {
    while (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r') i++;
    return i;
}

/* s[i] == '"': the index just past the string's closing quote. */
static size_t skip_string(const char *s, size_t i) {
    for (i++; s[i] && s[i] != '"'; i++)
        if (s[i] == '\\' && s[i + 1]) i++;
    return s[i] ? i + 1 : i;
}

/* The index just past the value starting at s[i] (object, array, string or scalar). */
static size_t skip_value(const char *s, size_t i) {
    if (s[i] == '"') return skip_string(s, i);
    if (s[i] == '{' || s[i] == '[') {
        int depth = 0;
        while (s[i]) {
            if (s[i] == '"') { i = skip_string(s, i); continue; }
            if (s[i] == '{' || s[i] == '[') depth++;
            else if (s[i] == '}' || s[i] == ']') {
                if (--depth == 0) return i + 1;
            }
            i++;
        }
        return i;
    }
    while (s[i] && s[i] != ',' && s[i] != '}' && s[i] != ']' && s[i] != ' ' && s[i] != '\n' && s[i] != '\r' &&
           s[i] != '\t')
        i++;
    return i;
}

/* The top-level member `key`'s value as [*beg, *end) of s; false when absent. *open: the index
 * just past the top-level '{'. */
static bool find_member(const char *s, const char *key, size_t *beg, size_t *end, size_t *open) {
    size_t i = skip_ws(s, 0);
    if (s[i] != '{') return false;
    *open = ++i;
    const size_t klen = strlen(key);
    for (;;) {
        i = skip_ws(s, i);
        if (s[i] != '"') return false; /* '}' (or malformed): no such member */
        const size_t k0 = i + 1;
        i = skip_string(s, i);
        const bool match = i - 1 - k0 == klen && !strncmp(s + k0, key, klen);
        i = skip_ws(s, i);
        if (s[i] != ':') return false;
        i = skip_ws(s, i + 1);
        const size_t v0 = i;
        i = skip_value(s, i);
        if (match) {
            *beg = v0;
            *end = i;
            return true;
        }
        i = skip_ws(s, i);
        if (s[i] != ',') return false;
        i++;
    }
}

/* text with the top-level member key's value set to the integer v (replaced where present,
 * else inserted as the object's first member), in a new fm_malloc'd string. */
static char *set_int_member(const char *text, const char *key, int64_t v) {
    size_t beg, end, open = 0;
    char num[32];
    snprintf(num, sizeof num, "%lld", (long long)v);
    const bool present = find_member(text, key, &beg, &end, &open);
    char ins[160];
    if (!present) { /* first member: "key": v, (the object holds model_type at least) */
        snprintf(ins, sizeof ins, "\n  \"%s\": %s,", key, num);
        beg = end = open;
    }
    const char *put = present ? num : ins;
    const size_t n = strlen(text), np = strlen(put);
    char *out = fm_malloc(n - (end - beg) + np + 1);
    if (!out) return NULL;
    memcpy(out, text, beg);
    memcpy(out + beg, put, np);
    memcpy(out + beg + np, text + end, n - end + 1);
    return out;
}

fm_status fm_config_json_as_read(const char *text, const fm_config *cfg, const char *path, char **out) {
    *out = NULL;
    fm_config orig;
    FM_TRY(fm_config_parse(&orig, text, path));
    /* the fields flatmoe changes (docs/formats.md): max_position_embeddings, which
     * --max-position-embeddings sets; every other field must be the file's */
    fm_config same = *cfg;
    same.max_position_embeddings = orig.max_position_embeddings;
    char *a = fm_config_to_json(&same), *b = fm_config_to_json(&orig);
    const bool differs = !a || !b || strcmp(a, b) != 0;
    fm_free(a);
    fm_free(b);
    if (differs)
        return fm_error(FM_ERR_ARG, "%s: the model config differs from the file in a field other than "
                        "max_position_embeddings; only that field is written back changed", path);
    /* YaRN without original_max_position_embeddings: flatmoe fixed it at the file's max
     * (fm_config.h); a changed max written back would move transformers' (and a reload's) */
    if (cfg->max_position_embeddings != orig.max_position_embeddings && orig.rope_scaling.type == FM_ROPE_YARN &&
        !strstr(text, "\"original_max_position_embeddings\""))
        return fm_error(FM_ERR_ARG, "%s: max_position_embeddings changed to %lld (--max-position-embeddings) with YaRN "
                        "RoPE, but the config's rope_scaling has no original_max_position_embeddings, which then "
                        "reads as max_position_embeddings (%lld in the file); add \"original_max_position_embeddings\": "
                        "%lld to rope_scaling, or keep max_position_embeddings", path,
                        (long long)cfg->max_position_embeddings, (long long)orig.max_position_embeddings,
                        (long long)orig.max_position_embeddings);
    char *t = NULL;
    if (cfg->max_position_embeddings != orig.max_position_embeddings)
        t = set_int_member(text, "max_position_embeddings", cfg->max_position_embeddings);
    else {
        const size_t n = strlen(text);
        t = fm_malloc(n + 1);
        if (t) memcpy(t, text, n + 1);
    }
    if (!t) return fm_error(FM_ERR_NOMEM, "%s: out of memory keeping the config text", path);
    *out = t;
    return FM_OK;
}
