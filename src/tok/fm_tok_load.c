/* Reading tokenizer.json (the `tokenizers` serialization: tokenizer/serialization.rs and each
 * component's serde form) into the tables of fm_tok_internal.h, the EOS lookup, and the small
 * public accessors. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fm_tok_internal.h"

#define GPT2_REGEX "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

static fm_status read_file(const char *path, char **out, size_t *n) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return fm_error(FM_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return fm_error(FM_ERR_IO, "%s: not a regular file", path);
    }
    char *buf = fm_malloc((size_t)st.st_size + 1);
    if (!buf) {
        fclose(f);
        return fm_error(FM_ERR_NOMEM, "%s: out of memory for %lld bytes", path, (long long)st.st_size);
    }
    size_t got = fread(buf, 1, (size_t)st.st_size, f);
    fclose(f);
    if (got != (size_t)st.st_size) {
        fm_free(buf);
        return fm_error(FM_ERR_IO, "%s: read %zu of %lld bytes", path, got, (long long)st.st_size);
    }
    buf[got] = 0;
    *out = buf;
    *n = got;
    return FM_OK;
}

static char *dup_str(const char *s, size_t n) {
    char *d = fm_malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

/* A boolean field: def when absent or null. */
static bool get_bool(const cJSON *o, const char *k, bool def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : def;
}

static const char *get_str(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static const char *type_of(const cJSON *o) {
    const char *t = get_str(o, "type");
    return t ? t : "(no type)";
}

static fm_status unsupported(const struct fm_tok_impl *t, const char *what, const char *type, const char *supported) {
    return fm_error(FM_ERR_UNSUPPORTED, "%s: %s type \"%s\" is not supported by flatmoe's tokenizer (supported: %s)",
                    t->file, what, type, supported);
}

/* {"String": s} or {"Regex": r}. */
static fm_status parse_pattern(struct fm_tok_impl *t, const cJSON *o, fm_pattern *p, const char *what) {
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(o, "pattern");
    const char *lit = get_str(pat, "String"), *re = get_str(pat, "Regex");
    if (!lit && !re)
        return fm_error(FM_ERR_FORMAT, "%s: %s: expected \"pattern\": {\"String\": ...} or {\"Regex\": ...}", t->file, what);
    return fm_pattern_compile(p, lit, lit ? NULL : re, t->file, what);
}

static fm_status grow_ops(void **v, int n, size_t size) {
    void *w = fm_malloc((size_t)(n + 1) * size);
    if (!w) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for the pipeline");
    if (n) memcpy(w, *v, (size_t)n * size);
    fm_free(*v);
    *v = w;
    return FM_OK;
}

static uint32_t first_cp(const char *s) {
    uint32_t cp = 0;
    if (s && *s) fm_utf8_next((const unsigned char *)s, strlen(s), &cp);
    return cp;
}

static fm_status parse_normalizer(struct fm_tok_impl *t, const cJSON *o) {
    if (!o || cJSON_IsNull(o)) return FM_OK;
    const char *ty = type_of(o);
    if (!strcmp(ty, "Sequence")) {
        const cJSON *it;
        cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(o, "normalizers")) FM_TRY(parse_normalizer(t, it));
        return FM_OK;
    }
    fm_norm_op op = {0};
    if (!strcmp(ty, "NFC")) op.kind = FM_NORM_NFC;
    else if (!strcmp(ty, "Prepend")) {
        const char *p = get_str(o, "prepend");
        if (!p) return fm_error(FM_ERR_FORMAT, "%s: normalizer Prepend: missing the string \"prepend\"", t->file);
        op.kind = FM_NORM_PREPEND;
        op.s_len = strlen(p);
        if (!(op.s = dup_str(p, op.s_len))) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory");
    } else if (!strcmp(ty, "Replace")) {
        const char *c = get_str(o, "content");
        if (!c) return fm_error(FM_ERR_FORMAT, "%s: normalizer Replace: missing the string \"content\"", t->file);
        op.kind = FM_NORM_REPLACE;
        op.s_len = strlen(c);
        if (!(op.s = dup_str(c, op.s_len))) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory");
        const fm_status s = parse_pattern(t, o, &op.pat, "normalizer Replace");
        if (s) {
            fm_free(op.s);
            return s;
        }
    } else return unsupported(t, "normalizer", ty, "NFC, Prepend, Replace, Sequence");
    const fm_status s = grow_ops((void **)&t->norm, t->n_norm, sizeof op);
    if (s) {
        fm_pattern_free(&op.pat);
        fm_free(op.s);
        return s;
    }
    t->norm[t->n_norm++] = op;
    return FM_OK;
}

static fm_status parse_scheme(struct fm_tok_impl *t, const cJSON *o, fm_prepend_scheme *out, const char *what) {
    const char *s = get_str(o, "prepend_scheme");
    if (!s) {
        *out = get_bool(o, "add_prefix_space", true) ? FM_PREPEND_ALWAYS : FM_PREPEND_NEVER;
        return FM_OK;
    }
    if (!strcmp(s, "always")) *out = FM_PREPEND_ALWAYS;
    else if (!strcmp(s, "first")) *out = FM_PREPEND_FIRST;
    else if (!strcmp(s, "never")) *out = FM_PREPEND_NEVER;
    else return fm_error(FM_ERR_FORMAT, "%s: %s prepend_scheme \"%s\"; expected always, first or never", t->file, what, s);
    return FM_OK;
}

static fm_status parse_pretok(struct fm_tok_impl *t, const cJSON *o) {
    if (!o || cJSON_IsNull(o)) return FM_OK;
    const char *ty = type_of(o);
    if (!strcmp(ty, "Sequence")) {
        const cJSON *it;
        cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(o, "pretokenizers")) FM_TRY(parse_pretok(t, it));
        return FM_OK;
    }
    fm_pre_op op = {0};
    if (!strcmp(ty, "ByteLevel")) {
        op.kind = FM_PRE_BYTELEVEL;
        op.add_prefix_space = get_bool(o, "add_prefix_space", true);
        op.use_regex = get_bool(o, "use_regex", true);
        if (op.use_regex) FM_TRY(fm_pattern_compile(&op.pat, NULL, GPT2_REGEX, t->file, "pre_tokenizer ByteLevel"));
    } else if (!strcmp(ty, "Split")) {
        op.kind = FM_PRE_SPLIT;
        op.invert = get_bool(o, "invert", false);
        const char *b = get_str(o, "behavior");
        static const char *names[] = {"Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
        int k = 0;
        while (k < 5 && !(b && !strcmp(b, names[k]))) k++;
        if (k == 5) /* checked before the pattern is compiled, so nothing is left to free */
            return fm_error(FM_ERR_FORMAT, "%s: pre_tokenizer Split behavior \"%s\"; expected Isolated, Removed, "
                            "MergedWithPrevious, MergedWithNext or Contiguous", t->file, b ? b : "(missing)");
        op.behavior = (fm_split_behavior)k;
        FM_TRY(parse_pattern(t, o, &op.pat, "pre_tokenizer Split"));
    } else if (!strcmp(ty, "Metaspace")) {
        op.kind = FM_PRE_METASPACE;
        const char *r = get_str(o, "replacement");
        if (!r) r = "\xE2\x96\x81";
        uint32_t cp = first_cp(r);
        op.repl_len = fm_utf8_put(op.repl, cp ? cp : 0x2581);
        FM_TRY(parse_scheme(t, o, &op.scheme, "pre_tokenizer Metaspace"));
        op.split = get_bool(o, "split", true);
    } else return unsupported(t, "pre_tokenizer", ty, "ByteLevel, Split, Metaspace, Sequence");
    const fm_status s = grow_ops((void **)&t->pre, t->n_pre, sizeof op);
    if (s) {
        fm_pattern_free(&op.pat);
        return s;
    }
    t->pre[t->n_pre++] = op;
    return FM_OK;
}

static fm_status parse_decoder(struct fm_tok_impl *t, const cJSON *o) {
    if (!o || cJSON_IsNull(o)) return FM_OK;
    t->has_decoder = true;
    const char *ty = type_of(o);
    if (!strcmp(ty, "Sequence")) {
        const cJSON *it;
        cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(o, "decoders")) FM_TRY(parse_decoder(t, it));
        return FM_OK;
    }
    fm_dec_op op = {0};
    if (!strcmp(ty, "ByteLevel")) op.kind = FM_DEC_BYTELEVEL;
    else if (!strcmp(ty, "ByteFallback")) op.kind = FM_DEC_BYTEFALLBACK;
    else if (!strcmp(ty, "Fuse")) op.kind = FM_DEC_FUSE;
    else if (!strcmp(ty, "Replace")) {
        const char *c = get_str(o, "content");
        if (!c) return fm_error(FM_ERR_FORMAT, "%s: decoder Replace: missing the string \"content\"", t->file);
        op.kind = FM_DEC_REPLACE;
        op.s_len = strlen(c);
        if (!(op.s = dup_str(c, op.s_len))) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory");
        const fm_status s = parse_pattern(t, o, &op.pat, "decoder Replace");
        if (s) {
            fm_free(op.s);
            return s;
        }
    } else if (!strcmp(ty, "Strip")) {
        op.kind = FM_DEC_STRIP;
        op.content = first_cp(get_str(o, "content"));
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, "start"), *b = cJSON_GetObjectItemCaseSensitive(o, "stop");
        if (cJSON_IsNull(a)) a = NULL;
        if (cJSON_IsNull(b)) b = NULL;
        if ((a && !(cJSON_IsNumber(a) && a->valuedouble >= 0 && a->valuedouble <= 2147483647.0)) ||
            (b && !(cJSON_IsNumber(b) && b->valuedouble >= 0 && b->valuedouble <= 2147483647.0)))
            return fm_error(FM_ERR_FORMAT, "%s: decoder Strip: \"start\" and \"stop\" must be counts in 0 .. 2^31-1",
                            t->file);
        op.start = a ? (int64_t)a->valuedouble : 0;
        op.stop = b ? (int64_t)b->valuedouble : 0;
    } else if (!strcmp(ty, "Metaspace")) {
        op.kind = FM_DEC_METASPACE;
        const char *r = get_str(o, "replacement");
        op.content = r ? first_cp(r) : 0x2581;
        FM_TRY(parse_scheme(t, o, &op.scheme, "decoder Metaspace"));
    } else return unsupported(t, "decoder", ty, "ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence");
    const fm_status s = grow_ops((void **)&t->dec, t->n_dec, sizeof op);
    if (s) {
        fm_pattern_free(&op.pat);
        fm_free(op.s);
        return s;
    }
    t->dec[t->n_dec++] = op;
    return FM_OK;
}

/* id -> string table entry (the first writer wins: added tokens are written first). */
static fm_status set_id_str(struct fm_tok_impl *t, int64_t id, const char *s, size_t n) {
    if (id < 0 || id >= t->n_ids)
        return fm_error(FM_ERR_FORMAT, "%s: token \"%s\" has id %lld, outside 0 .. %lld", t->file, s, (long long)id,
                        (long long)t->n_ids - 1);
    if (t->id_str[id]) return FM_OK;
    t->id_str[id] = (char *)(uintptr_t)(t->id_pool.n + 1); /* offset + 1, fixed up below */
    t->id_len[id] = (uint32_t)n;
    FM_TRY(fm_buf_put(&t->id_pool, s, n));
    return fm_buf_put(&t->id_pool, "", 1); /* the NUL */
}

static fm_status parse_model(struct fm_tok_impl *t, const cJSON *m, const cJSON *added) {
    if (!cJSON_IsObject(m)) return fm_error(FM_ERR_FORMAT, "%s: missing the \"model\" object", t->file);
    const char *ty = get_str(m, "type");
    if (ty && strcmp(ty, "BPE")) return unsupported(t, "model", ty, "BPE");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(m, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(m, "merges");
    if (!cJSON_IsObject(vocab) || !cJSON_IsArray(merges))
        return fm_error(FM_ERR_FORMAT, "%s: model: expected \"vocab\" (an object) and \"merges\" (an array)", t->file);
    const char *bad[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int k = 0; k < 2; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(m, bad[k]);
        if (v && !cJSON_IsNull(v) && !(cJSON_IsString(v) && !*v->valuestring))
            return fm_error(FM_ERR_UNSUPPORTED, "%s: model.%s is set; flatmoe's BPE supports only null", t->file, bad[k]);
    }
    const cJSON *dp = cJSON_GetObjectItemCaseSensitive(m, "dropout");
    if (cJSON_IsNumber(dp) && dp->valuedouble != 0)
        return fm_error(FM_ERR_UNSUPPORTED, "%s: model.dropout %g; flatmoe encodes deterministically (null or 0)",
                        t->file, dp->valuedouble);
    t->byte_fallback = get_bool(m, "byte_fallback", false);
    t->fuse_unk = get_bool(m, "fuse_unk", false);
    t->ignore_merges = get_bool(m, "ignore_merges", false);
    /* ids: the vocab's, then the added tokens' */
    int64_t max_id = -1;
    const cJSON *it;
    cJSON_ArrayForEach(it, vocab) {
        if (!cJSON_IsNumber(it) || it->valuedouble < 0 || it->valuedouble > 2147483647.0)
            return fm_error(FM_ERR_FORMAT, "%s: model.vocab[\"%s\"]: expected an id in 0 .. 2^31-1", t->file, it->string);
        if ((int64_t)it->valuedouble > max_id) max_id = (int64_t)it->valuedouble;
    }
    cJSON_ArrayForEach(it, added) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "id");
        if (!cJSON_IsNumber(id) || !(id->valuedouble >= 0 && id->valuedouble <= 2147483647.0) || !get_str(it, "content"))
            return fm_error(FM_ERR_FORMAT, "%s: added_tokens: each needs an \"id\" in 0 .. 2^31-1 and a \"content\" "
                            "string", t->file);
        if ((int64_t)id->valuedouble > max_id) max_id = (int64_t)id->valuedouble;
    }
    t->n_ids = max_id + 1;
    t->id_str = fm_malloc((size_t)(t->n_ids + 1) * sizeof *t->id_str);
    t->id_len = fm_malloc((size_t)(t->n_ids + 1) * sizeof *t->id_len);
    if (!t->id_str || !t->id_len) return fm_error(FM_ERR_NOMEM, "%s: out of memory for %lld ids", t->file, (long long)t->n_ids);
    /* added tokens */
    int na = cJSON_GetArraySize(added);
    t->added = fm_malloc((size_t)(na + 1) * sizeof *t->added);
    if (!t->added) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory");
    cJSON_ArrayForEach(it, added) {
        const char *c = get_str(it, "content");
        fm_added *a = &t->added[t->n_added];
        a->len = strlen(c);
        if (a->len == 0) continue;
        if (!(a->content = dup_str(c, a->len))) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory");
        a->norm = NULL;
        a->id = (int32_t)cJSON_GetObjectItemCaseSensitive(it, "id")->valuedouble;
        a->special = get_bool(it, "special", false);
        a->lstrip = get_bool(it, "lstrip", false);
        a->rstrip = get_bool(it, "rstrip", false);
        a->single_word = get_bool(it, "single_word", false);
        a->normalized = get_bool(it, "normalized", !a->special);
        t->n_added++; /* counted before the calls below can fail, so fm_tok_impl_free frees its content */
        FM_TRY(fm_strmap_put(&t->added_map, a->content, a->len, t->n_added - 1, a->id));
        FM_TRY(set_id_str(t, a->id, a->content, a->len));
    }
    cJSON_ArrayForEach(it, vocab) {
        const size_t n = strlen(it->string);
        FM_TRY(fm_strmap_put(&t->vocab, it->string, n, (int32_t)it->valuedouble, 0));
        FM_TRY(set_id_str(t, (int64_t)it->valuedouble, it->string, n));
    }
    for (int64_t i = 0; i < t->n_ids; i++)
        if (t->id_str[i]) t->id_str[i] = t->id_pool.p + ((uintptr_t)t->id_str[i] - 1);
    /* merges: "a b" strings (lines starting "#version" skipped) or ["a", "b"] pairs */
    fm_buf pair = {0};
    int32_t rank = 0;
    fm_status st = FM_OK;
    cJSON_ArrayForEach(it, merges) {
        const char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        if (cJSON_IsString(it)) {
            const char *s = it->valuestring, *sp = strchr(s, ' ');
            if (!strncmp(s, "#version", 8)) continue;
            if (!sp || strchr(sp + 1, ' ')) {
                st = fm_error(FM_ERR_FORMAT, "%s: model.merges[%d] \"%s\": expected two tokens separated by one space",
                              t->file, rank, s);
                break;
            }
            a = s, la = (size_t)(sp - s), b = sp + 1, lb = strlen(b);
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 && cJSON_IsString(cJSON_GetArrayItem(it, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 1))) {
            a = cJSON_GetArrayItem(it, 0)->valuestring, la = strlen(a);
            b = cJSON_GetArrayItem(it, 1)->valuestring, lb = strlen(b);
        } else {
            st = fm_error(FM_ERR_FORMAT, "%s: model.merges[%d]: expected \"a b\" or [\"a\", \"b\"]", t->file, rank);
            break;
        }
        const fm_strmap_slot *ea = fm_strmap_get(&t->vocab, a, la), *eb = fm_strmap_get(&t->vocab, b, lb);
        pair.n = 0;
        if ((st = fm_buf_put(&pair, a, la)) || (st = fm_buf_put(&pair, b, lb))) break;
        const fm_strmap_slot *en = fm_strmap_get(&t->vocab, pair.p, pair.n);
        if (!ea || !eb || !en) {
            st = fm_error(FM_ERR_FORMAT, "%s: model.merges[%d]: token \"%.*s\" is not in model.vocab", t->file, rank,
                          (int)(!ea ? la : !eb ? lb : pair.n), !ea ? a : !eb ? b : pair.p);
            break;
        }
        if ((st = fm_pairmap_put(&t->merges, ea->v0, eb->v0, rank, en->v0))) break;
        rank++;
    }
    fm_buf_free(&pair);
    FM_TRY(st);
    /* byte fallback tokens and the unk token */
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        const fm_strmap_slot *e = fm_strmap_get(&t->vocab, name, 6);
        t->byte_id[b] = e ? e->v0 : -1;
    }
    for (uint32_t cp = 0; cp < 0x800; cp++) {
        char u[4];
        const size_t l = fm_utf8_put(u, cp);
        const fm_strmap_slot *e = fm_strmap_get(&t->vocab, u, l);
        t->cp_id[cp] = e ? e->v0 : -1;
    }
    const char *unk = get_str(m, "unk_token");
    t->unk_id = -1;
    if (unk) {
        const fm_strmap_slot *e = fm_strmap_get(&t->vocab, unk, strlen(unk));
        t->unk_id = e ? e->v0 : -2;
        if (!(t->unk_name = dup_str(unk, strlen(unk)))) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory");
    }
    return FM_OK;
}

/* The added tokens of one kind (normalized or not) by first byte, longest first. */
static fm_status build_set(struct fm_tok_impl *t, fm_added_set *s, bool normalized) {
    s->order = fm_malloc((size_t)(t->n_added + 1) * sizeof *s->order);
    if (!s->order) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory");
    int cnt[257] = {0};
    for (int i = 0; i < t->n_added; i++) {
        const fm_added *a = &t->added[i];
        const size_t l = normalized ? a->norm_len : a->len;
        if (a->normalized == normalized && l > 0) cnt[(unsigned char)(normalized ? a->norm : a->content)[0]]++;
    }
    s->first[0] = 0;
    for (int c = 0; c < 256; c++) s->first[c + 1] = s->first[c] + cnt[c];
    int fill[256];
    for (int c = 0; c < 256; c++) fill[c] = s->first[c];
    for (int i = 0; i < t->n_added; i++) {
        const fm_added *a = &t->added[i];
        const size_t l = normalized ? a->norm_len : a->len;
        if (a->normalized != normalized || l == 0) continue;
        const int c = (unsigned char)(normalized ? a->norm : a->content)[0];
        int j = fill[c]++;
        while (j > s->first[c]) { /* insertion by length, longest first; stable */
            const fm_added *b = &t->added[s->order[j - 1]];
            if ((normalized ? b->norm_len : b->len) >= l) break;
            s->order[j] = s->order[j - 1];
            j--;
        }
        s->order[j] = i;
        s->n++;
    }
    return FM_OK;
}

fm_status fm_tok_parse(struct fm_tok_impl *t, const char *json, size_t n) {
    cJSON *root = cJSON_ParseWithLength(json, n);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        return fm_error(FM_ERR_FORMAT, "%s: malformed JSON near byte %lld; expected a Hugging Face tokenizer.json",
                        t->file, at ? (long long)(at - json) : -1LL);
    }
    fm_status s = FM_OK;
    if (!cJSON_IsObject(root)) s = fm_error(FM_ERR_FORMAT, "%s: expected a JSON object (a tokenizer.json)", t->file);
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (!s && added && !cJSON_IsArray(added) && !cJSON_IsNull(added))
        s = fm_error(FM_ERR_FORMAT, "%s: \"added_tokens\" must be an array", t->file);
    if (!s) s = parse_model(t, cJSON_GetObjectItemCaseSensitive(root, "model"), added);
    if (!s) s = parse_normalizer(t, cJSON_GetObjectItemCaseSensitive(root, "normalizer"));
    if (!s) s = parse_pretok(t, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"));
    if (!s) s = parse_decoder(t, cJSON_GetObjectItemCaseSensitive(root, "decoder"));
    cJSON_Delete(root);
    FM_TRY(s);
    for (int i = 0; i < t->n_added; i++) { /* normalized contents, with the whole normalizer */
        fm_added *a = &t->added[i];
        if (!a->normalized) continue;
        FM_TRY(fm_tok_normalize(t, a->content, a->len, &t->tmp));
        if (!(a->norm = dup_str(t->tmp.p ? t->tmp.p : "", t->tmp.n))) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory");
        a->norm_len = t->tmp.n;
    }
    if (t->n_pre == 0 && fm_strmap_get(&t->vocab, "\xE2\x96\x81", 3)) {
        t->cut_at_metaspace = true;
        for (size_t i = 0; i < t->vocab.cap && t->cut_at_metaspace; i++) {
            const fm_strmap_slot *e = &t->vocab.slot[i];
            if (!e->hash || e->len < 4) continue;
            const char *k = t->vocab.pool.p + e->off;
            for (uint32_t j = 1; j + 3 <= e->len; j++)
                if (!memcmp(k + j, "\xE2\x96\x81", 3)) { t->cut_at_metaspace = false; break; }
        }
    }
    FM_TRY(build_set(t, &t->raw_set, false));
    FM_TRY(build_set(t, &t->norm_set, true));
    for (int b = 0; b < 256; b++) {
        t->bl_len[b] = (uint8_t)fm_utf8_put(t->bl_enc[b], fm_bytelevel_char((unsigned char)b));
    }
    for (int c = 0; c < 324; c++) t->bl_dec[c] = (int16_t)fm_bytelevel_byte((uint32_t)c);
    t->lv = fm_malloc((size_t)(t->n_pre + 1) * sizeof *t->lv);
    if (!t->lv) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory");
    t->word_ids = fm_malloc(64 * sizeof(int32_t));
    if (!t->word_ids) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory");
    t->word_cap = 64;
    return FM_OK;
}

void fm_tok_impl_free(struct fm_tok_impl *t) {
    if (!t) return;
    fm_strmap_free(&t->vocab);
    fm_free(t->id_str);
    fm_free(t->id_len);
    fm_buf_free(&t->id_pool);
    fm_pairmap_free(&t->merges);
    fm_free(t->unk_name);
    for (int i = 0; i < t->n_added; i++) {
        fm_free(t->added[i].content);
        fm_free(t->added[i].norm);
    }
    fm_free(t->added);
    fm_strmap_free(&t->added_map);
    fm_free(t->raw_set.order);
    fm_free(t->norm_set.order);
    for (int i = 0; i < t->n_norm; i++) { fm_pattern_free(&t->norm[i].pat); fm_free(t->norm[i].s); }
    fm_free(t->norm);
    for (int i = 0; i < t->n_pre; i++) fm_pattern_free(&t->pre[i].pat);
    fm_free(t->pre);
    for (int i = 0; i < t->n_dec; i++) { fm_pattern_free(&t->dec[i].pat); fm_free(t->dec[i].s); }
    fm_free(t->dec);
    fm_strmap_free(&t->cache);
    fm_free(t->cache_ids);
    fm_buf_free(&t->clean);
    fm_buf_free(&t->tmp);
    fm_buf_free(&t->tmp2);
    fm_pieces_free(&t->pa);
    fm_pieces_free(&t->pb);
    for (int i = 0; t->lv && i < t->n_pre; i++) {
        fm_buf_free(&t->lv[i].buf);
        fm_buf_free(&t->lv[i].map);
        free(t->lv[i].seg);
    }
    fm_free(t->lv);
    free(t->sp[0]);
    free(t->sp[1]);
    fm_buf_free(&t->norm_out);
    fm_free(t->sym);
    fm_free(t->heap);
    fm_free(t->word_ids);
    fm_free(t);
}

/* ---- EOS ---- */

/* The JSON of dir/name, or NULL when absent or malformed (these files are optional). */
static cJSON *load_json(const char *dir, const char *name) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *buf;
    size_t n;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fclose(f);
    if (read_file(path, &buf, &n)) return NULL;
    cJSON *j = cJSON_ParseWithLength(buf, n);
    fm_free(buf);
    return j;
}

static int32_t find_eos(fm_tokenizer *tk, const char *dir) {
    int32_t id = -1;
    cJSON *j = load_json(dir, "tokenizer_config.json");
    if (j) {
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "eos_token");
        const char *s = cJSON_IsString(e) ? e->valuestring : get_str(e, "content");
        if (s) id = fm_tokenizer_token_to_id(tk, s);
        cJSON_Delete(j);
        if (id >= 0) return id;
    }
    const char *files[] = {"generation_config.json", "config.json"};
    for (int k = 0; k < 2 && id < 0; k++) {
        if (!(j = load_json(dir, files[k]))) continue;
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "eos_token_id");
        if (cJSON_IsArray(e)) e = cJSON_GetArrayItem(e, 0);
        if (cJSON_IsNumber(e) && e->valuedouble >= 0 && e->valuedouble < (double)tk->vocab_size) id = (int32_t)e->valuedouble;
        cJSON_Delete(j);
    }
    if (id >= 0) return id;
    const char *names[] = {"<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>"};
    for (int k = 0; k < 5; k++) {
        const fm_strmap_slot *e = fm_strmap_get(&tk->impl->added_map, names[k], strlen(names[k]));
        if (e && tk->impl->added[e->v0].special) return e->v1;
    }
    return -1;
}

fm_status fm_tokenizer_load(fm_tokenizer *tk, const char *path) {
    memset(tk, 0, sizeof *tk);
    tk->eos_id = -1;
    char dir[4096];
    struct stat st;
    if (stat(path, &st) != 0)
        return fm_error(FM_ERR_IO, "%s: cannot open the tokenizer: %s; give a tokenizer.json or a folder holding one",
                        path, strerror(errno));
    if (S_ISDIR(st.st_mode)) {
        snprintf(dir, sizeof dir, "%s", path);
        snprintf(tk->path, sizeof tk->path, "%s/tokenizer.json", path);
    } else {
        snprintf(tk->path, sizeof tk->path, "%s", path);
        snprintf(dir, sizeof dir, "%s", path);
        char *sl = strrchr(dir, '/');
        if (sl) *sl = 0;
        else snprintf(dir, sizeof dir, ".");
    }
    char *json;
    size_t n;
    fm_status s = read_file(tk->path, &json, &n);
    if (s) return s;
    struct fm_tok_impl *t = fm_malloc(sizeof *t);
    if (!t) {
        fm_free(json);
        return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory");
    }
    snprintf(t->file, sizeof t->file, "%s", tk->path);
    s = fm_tok_parse(t, json, n);
    fm_free(json);
    if (s) {
        fm_tok_impl_free(t);
        return s;
    }
    tk->impl = t;
    tk->vocab_size = t->n_ids;
    tk->eos_id = find_eos(tk, dir);
    return FM_OK;
}

void fm_tokenizer_free(fm_tokenizer *tk) {
    if (!tk) return;
    fm_tok_impl_free(tk->impl);
    memset(tk, 0, sizeof *tk);
    tk->eos_id = -1;
}

int32_t fm_tokenizer_token_to_id(const fm_tokenizer *tk, const char *token) {
    const struct fm_tok_impl *t = tk->impl;
    const size_t n = strlen(token);
    const fm_strmap_slot *e = fm_strmap_get(&t->added_map, token, n);
    if (e) return e->v1;
    e = fm_strmap_get(&t->vocab, token, n);
    return e ? e->v0 : -1;
}

const char *fm_tokenizer_id_to_token(const fm_tokenizer *tk, int32_t id) {
    const struct fm_tok_impl *t = tk->impl;
    return id >= 0 && id < t->n_ids ? t->id_str[id] : NULL;
}

bool fm_tokenizer_is_special(const fm_tokenizer *tk, int32_t id) {
    const struct fm_tok_impl *t = tk->impl;
    if (id < 0 || id >= t->n_ids || !t->id_str[id]) return false;
    const fm_strmap_slot *e = fm_strmap_get(&t->added_map, t->id_str[id], t->id_len[id]);
    return e && e->v1 == id && t->added[e->v0].special;
}
