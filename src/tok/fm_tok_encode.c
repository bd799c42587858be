/* Encoding: UTF-8 repair, the added tokens (tokenizers' added_vocabulary.rs find_matches and
 * extract_and_normalize), the normalizer, the pre-tokenizer and the BPE model, in that order. */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "fm_tok_internal.h"

/* Unicode White_Space (PropList.txt), what Rust's regex \s matches. */
static bool is_white_space(uint32_t c) {
    return (c >= 0x9 && c <= 0xD) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* Rust regex's \w: Alphabetic, marks, decimal numbers, connector punctuation (approximated with
 * the general categories L*, Nl, M*, Nd, Pc). */
static bool is_word_char(uint32_t c) {
    switch (utf8proc_category((utf8proc_int32_t)c)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_PC:
        return true;
    default:
        return false;
    }
}

/* The code point that ends s[0..n) and its start (n > 0, valid UTF-8). */
static uint32_t last_char(const char *s, size_t n, size_t *start) {
    size_t i = n - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
    uint32_t cp = 0xFFFD;
    fm_utf8_next((const unsigned char *)s + i, n - i, &cp);
    *start = i;
    return cp;
}

static size_t skip_space_fwd(const char *s, size_t n, size_t i) {
    while (i < n) {
        uint32_t cp;
        int l = fm_utf8_next((const unsigned char *)s + i, n - i, &cp);
        if (l <= 0 || !is_white_space(cp)) break;
        i += (size_t)l;
    }
    return i;
}

static size_t skip_space_back(const char *s, size_t i) {
    while (i > 0) {
        size_t st;
        if (!is_white_space(last_char(s, i, &st))) break;
        i = st;
    }
    return i;
}

/* The longest added token of `set` at s[pos..n): its index in t->added, or -1. */
static int match_at(const struct fm_tok_impl *t, const fm_added_set *set, bool use_norm, const char *s, size_t n,
                    size_t pos) {
    const unsigned char c = (unsigned char)s[pos];
    for (int32_t k = set->first[c]; k < set->first[c + 1]; k++) {
        const fm_added *a = &t->added[set->order[k]];
        const char *p = use_norm ? a->norm : a->content;
        const size_t l = use_norm ? a->norm_len : a->len;
        if (l <= n - pos && !memcmp(s + pos, p, l)) return set->order[k];
    }
    return -1;
}

/* find_matches of added_vocabulary.rs over s[0..n): the splits (byte ranges; id >= 0 for an added
 * token) into t->sp[which][0..*ns), covering s in order. */
static fm_status split_added(struct fm_tok_impl *t, int which, const char *s, size_t n, size_t *ns) {
    const fm_added_set *set = which ? &t->norm_set : &t->raw_set;
    const bool use_norm = which == 1;
    *ns = 0;
    size_t start_offset = 0, pos = 0;
    while (pos < n && set->n) {
        const unsigned char c0 = (unsigned char)s[pos];
        const int k = set->first[c0] < set->first[c0 + 1] ? match_at(t, set, use_norm, s, n, pos) : -1;
        if (k < 0) {
            pos++;
            continue;
        }
        const fm_added *a = &t->added[k];
        size_t start = pos, stop = pos + (use_norm ? a->norm_len : a->len);
        pos = stop;
        if (a->single_word) {
            size_t st;
            const bool start_space = start == 0 || !is_word_char(last_char(s, start, &st));
            uint32_t cp = 0;
            if (stop < n) fm_utf8_next((const unsigned char *)s + stop, n - stop, &cp);
            const bool stop_space = stop == n || !is_word_char(cp);
            if (!start_space || !stop_space) continue;
        }
        if (a->lstrip) {
            const size_t nst = skip_space_back(s, start);
            start = nst > start_offset ? nst : start_offset;
        }
        if (a->rstrip) stop = skip_space_fwd(s, n, stop);
        if (*ns + 2 > t->sp_cap[which]) {
            size_t cap = t->sp_cap[which] ? 2 * t->sp_cap[which] : 64;
            struct fm_split *v = fm_fault_hit() ? NULL : realloc(t->sp[which], cap * sizeof *v);
            if (!v) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for %zu added-token splits", cap);
            t->sp[which] = v;
            t->sp_cap[which] = cap;
        }
        if (start_offset < start) t->sp[which][(*ns)++] = (struct fm_split){start_offset, start, -1};
        t->sp[which][(*ns)++] = (struct fm_split){start, stop, a->id};
        start_offset = stop;
    }
    if (start_offset < n) {
        if (*ns + 1 > t->sp_cap[which]) {
            size_t cap = t->sp_cap[which] ? 2 * t->sp_cap[which] : 64;
            struct fm_split *v = fm_fault_hit() ? NULL : realloc(t->sp[which], cap * sizeof *v);
            if (!v) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for %zu added-token splits", cap);
            t->sp[which] = v;
            t->sp_cap[which] = cap;
        }
        t->sp[which][(*ns)++] = (struct fm_split){start_offset, n, -1};
    }
    return FM_OK;
}

/* Where encoded ids go: a fixed buffer (grow false) or a growable fm_malloc'd one. */
typedef struct sink {
    int32_t **ids;
    int64_t n, cap;
    bool grow;
} sink;

static fm_status sink_put(sink *k, const int32_t *ids, size_t m) {
    if (m == 0) return FM_OK; /* a word of no ids: *k->ids may still be NULL */
    if (k->n + (int64_t)m > k->cap && k->grow) {
        int64_t cap = k->cap ? k->cap : 1024;
        while (cap < k->n + (int64_t)m) cap *= 2;
        int32_t *v = fm_malloc((size_t)cap * sizeof *v);
        if (!v) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for %lld token ids", (long long)cap);
        if (k->n) memcpy(v, *k->ids, (size_t)k->n * sizeof *v);
        fm_free(*k->ids);
        *k->ids = v;
        k->cap = cap;
    }
    if (k->n + (int64_t)m <= k->cap) memcpy(*k->ids + k->n, ids, m * sizeof *ids);
    else
        for (size_t i = 0; i < m && k->n + (int64_t)i < k->cap; i++) (*k->ids)[k->n + (int64_t)i] = ids[i];
    k->n += (int64_t)m;
    return FM_OK;
}

/* A word from the pre-tokenizer: the BPE model (the whole word, or its parts cut before each "▁"
 * when that cannot change the result), into the sink. */
static fm_status on_word(struct fm_tok_impl *t, const char *w, size_t n, void *ctx) {
    sink *k = ctx;
    size_t a = 0;
    while (a < n) {
        size_t e = n;
        if (t->cut_at_metaspace)
            for (size_t j = a + 1; j + 3 <= n; j++)
                if (w[j] == '\xE2' && w[j + 1] == '\x96' && w[j + 2] == '\x81') { e = j; break; }
        int32_t *ids;
        size_t m;
        FM_TRY(fm_tok_bpe_word(t, w + a, e - a, &ids, &m));
        FM_TRY(sink_put(k, ids, m));
        a = e;
    }
    return FM_OK;
}

static fm_status encode(fm_tokenizer *tk, const char *text, size_t n, sink *k) {
    struct fm_tok_impl *t = tk->impl;
    FM_ASSERT(t != NULL);
    /* 0. UTF-8 repair */
    t->clean.n = 0;
    FM_TRY(fm_buf_reserve(&t->clean, 3 * n + 1));
    t->clean.n = fm_utf8_sanitize(text, n, t->clean.p);
    /* 1. the added tokens of the raw text */
    size_t n1;
    FM_TRY(split_added(t, 0, t->clean.p, t->clean.n, &n1));
    for (size_t i = 0; i < n1; i++) {
        const struct fm_split r = t->sp[0][i];
        if (r.id >= 0) {
            FM_TRY(sink_put(k, &r.id, 1));
            continue;
        }
        /* 2. the normalizer, then the normalized added tokens */
        const char *s = t->clean.p + r.a;
        size_t len = r.b - r.a;
        if (t->n_norm) {
            FM_TRY(fm_tok_normalize(t, s, len, &t->norm_out));
            s = t->norm_out.p;
            len = t->norm_out.n;
        }
        size_t n2;
        FM_TRY(split_added(t, 1, s, len, &n2));
        for (size_t j = 0; j < n2; j++) {
            const struct fm_split q = t->sp[1][j];
            if (q.id >= 0) FM_TRY(sink_put(k, &q.id, 1));
            /* 3. the pre-tokenizer, 4. the model */
            else FM_TRY(fm_tok_pretok_run(t, s + q.a, q.b - q.a, r.a == 0 && q.a == 0, on_word, k));
        }
    }
    return FM_OK;
}

fm_status fm_tokenizer_encode(fm_tokenizer *tk, const char *text, size_t n, int32_t *out, int64_t cap,
                              int64_t *n_out) {
    int32_t *buf = out;
    sink k = {&buf, 0, cap, false};
    *n_out = 0;
    FM_TRY(encode(tk, text, n, &k));
    *n_out = k.n;
    if (k.n > cap)
        return fm_error(FM_ERR_ARG, "tokenizer: the text has %lld tokens, more than the %lld the output holds",
                        (long long)k.n, (long long)cap);
    return FM_OK;
}

fm_status fm_tokenizer_encode_append(fm_tokenizer *tk, const char *text, size_t n, int32_t **ids, int64_t *n_ids,
                                     int64_t *cap) {
    sink k = {ids, *n_ids, *cap, true};
    fm_status s = encode(tk, text, n, &k);
    *cap = k.cap;
    if (s == FM_OK) *n_ids = k.n;
    return s;
}
