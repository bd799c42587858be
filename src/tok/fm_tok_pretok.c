/* Patterns (literal or PCRE2), the normalizers and the pre-tokenizers. The semantics are those of
 * Hugging Face `tokenizers` (normalizers/, pre_tokenizers/, tokenizer/normalizer.rs
 * NormalizedString::split and pattern.rs find_matches), reimplemented. */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "fm_tok_internal.h"

/* ---- patterns ---- */

fm_status fm_pattern_compile(fm_pattern *p, const char *lit, const char *regex, const char *file, const char *what) {
    memset(p, 0, sizeof *p);
    if (lit) {
        p->lit_len = strlen(lit);
        p->lit = fm_malloc(p->lit_len + 1);
        if (!p->lit) return fm_error(FM_ERR_NOMEM, "%s: out of memory for the pattern of %s", file, what);
        memcpy(p->lit, lit, p->lit_len + 1);
        return FM_OK;
    }
    int err;
    PCRE2_SIZE eoff;
    p->re = pcre2_compile((PCRE2_SPTR)regex, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err, &eoff, NULL);
    if (!p->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return fm_error(FM_ERR_FORMAT, "%s: %s: PCRE2 cannot compile the regex /%s/ at offset %zu: %s", file, what,
                        regex, (size_t)eoff, (const char *)msg);
    }
    if (pcre2_jit_compile(p->re, PCRE2_JIT_COMPLETE) == 0) {
        p->mc = pcre2_match_context_create(NULL);
        p->js = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
        if (p->mc && p->js) pcre2_jit_stack_assign(p->mc, NULL, p->js);
    }
    p->md = pcre2_match_data_create_from_pattern(p->re, NULL);
    if (!p->md) {
        fm_pattern_free(p);
        return fm_error(FM_ERR_NOMEM, "%s: out of memory for the regex of %s", file, what);
    }
    return FM_OK;
}

void fm_pattern_free(fm_pattern *p) {
    fm_free(p->lit);
    if (p->md) pcre2_match_data_free(p->md);
    if (p->re) pcre2_code_free(p->re);
    if (p->mc) pcre2_match_context_free(p->mc);
    if (p->js) pcre2_jit_stack_free(p->js);
    memset(p, 0, sizeof *p);
}

int fm_pattern_find(fm_pattern *p, const char *s, size_t n, size_t from, size_t *ms, size_t *me) {
    if (!p->re) {
        if (p->lit_len == 0 || n < p->lit_len) return 0;
        const char c0 = p->lit[0];
        for (size_t i = from; i + p->lit_len <= n; i++) {
            const char *q = memchr(s + i, c0, n - p->lit_len + 1 - i);
            if (!q) return 0;
            i = (size_t)(q - s);
            if (!memcmp(q, p->lit, p->lit_len)) {
                *ms = i;
                *me = i + p->lit_len;
                return 1;
            }
        }
        return 0;
    }
    int rc = pcre2_match(p->re, (PCRE2_SPTR)s, n, from, PCRE2_NO_UTF_CHECK, p->md, p->mc);
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        fm_error(FM_ERR_FORMAT, "tokenizer: PCRE2 match failed on a %zu-byte piece of text: %s", n, (const char *)msg);
        return -1;
    }
    const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(p->md);
    *ms = ov[0];
    *me = ov[1];
    return 1;
}

/* Bytes of the UTF-8 character at s[i] (1 at the end or on a stray byte). */
static size_t char_len(const char *s, size_t n, size_t i) {
    uint32_t cp;
    int l = i < n ? fm_utf8_next((const unsigned char *)s + i, n - i, &cp) : 1;
    return l > 0 ? (size_t)l : 1;
}

fm_status fm_pattern_replace(fm_pattern *p, const char *s, size_t n, const char *rep, size_t rn, fm_buf *out) {
    out->n = 0;
    FM_TRY(fm_buf_reserve(out, n + 1));
    size_t prev = 0, from = 0, ms, me;
    int r;
    while (from <= n && (r = fm_pattern_find(p, s, n, from, &ms, &me)) > 0) {
        FM_TRY(fm_buf_put(out, s + prev, ms - prev));
        FM_TRY(fm_buf_put(out, rep, rn));
        prev = me;
        from = me > ms ? me : me + char_len(s, n, me);
        if (me == ms && me < n) { /* empty match: keep the character it stood before */
            FM_TRY(fm_buf_put(out, s + me, from - me));
            prev = from;
        }
        if (me >= n) break;
    }
    if (r < 0) return FM_ERR_FORMAT;
    if (prev < n) FM_TRY(fm_buf_put(out, s + prev, n - prev));
    else FM_TRY(fm_buf_put(out, "", 0));
    return FM_OK;
}

/* ---- normalizers ---- */

/* True when s has no code point >= U+0300 (no byte >= 0xCC): such text is already NFC (every
 * NFC_Quick_Check No or Maybe character is U+0300 or above). */
static bool below_u0300(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n; i++)
        if (u[i] >= 0xCC) return false;
    return true;
}

fm_status fm_tok_normalize(struct fm_tok_impl *t, const char *s, size_t n, fm_buf *out) {
    out->n = 0;
    FM_TRY(fm_buf_put(out, s, n));
    for (int k = 0; k < t->n_norm; k++) {
        const fm_norm_op *op = &t->norm[k];
        fm_buf *tmp = &t->tmp2;
        if (op->kind == FM_NORM_NFC) {
            if (below_u0300(out->p, out->n)) continue;
            utf8proc_uint8_t *dst = NULL;
            utf8proc_ssize_t m = utf8proc_map((const utf8proc_uint8_t *)out->p, (utf8proc_ssize_t)out->n, &dst,
                                              UTF8PROC_STABLE | UTF8PROC_COMPOSE);
            if (m < 0)
                return fm_error(FM_ERR_FORMAT, "tokenizer: NFC normalization failed: %s", utf8proc_errmsg(m));
            out->n = 0;
            fm_status st = fm_buf_put(out, dst, (size_t)m);
            free(dst);
            FM_TRY(st);
        } else if (op->kind == FM_NORM_PREPEND) {
            if (out->n == 0) continue;
            tmp->n = 0;
            FM_TRY(fm_buf_put(tmp, op->s, op->s_len));
            FM_TRY(fm_buf_put(tmp, out->p, out->n));
            fm_buf x = *out; *out = *tmp; *tmp = x;
        } else {
            FM_TRY(fm_pattern_replace((fm_pattern *)&op->pat, out->p, out->n, op->s, op->s_len, tmp));
            fm_buf x = *out; *out = *tmp; *tmp = x;
        }
    }
    return FM_OK;
}

/* ---- pre-tokenizers ----
 * Depth first: op k splits or transforms its piece and hands each result to op k + 1, the last
 * op to the word callback. `tokenizers` runs each op over all pieces before the next op; the
 * words and their order are the same, and the scratch stays the size of one piece. */

typedef struct pre_ctx {
    fm_word_fn fn;
    void *ctx;
} pre_ctx;

static fm_status run_level(struct fm_tok_impl *t, int k, const char *s, size_t n, bool at_start, const pre_ctx *c);

static fm_status seg_push(struct fm_tok_level *L, size_t *ns, size_t a, size_t b, bool match) {
    if (*ns == L->seg_cap) {
        size_t cap = L->seg_cap ? 2 * L->seg_cap : 256;
        struct fm_seg *v = fm_fault_hit() ? NULL : realloc(L->seg, cap * sizeof *v);
        if (!v) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for %zu splits", cap);
        L->seg = v;
        L->seg_cap = cap;
    }
    L->seg[(*ns)++] = (struct fm_seg){a, b, match};
    return FM_OK;
}

/* NormalizedString::split(pattern, behavior) of s[0..n); each resulting non-empty piece goes to
 * level k + 1. Isolated streams; the other behaviours collect the matches first. */
static fm_status split_text(struct fm_tok_impl *t, int k, fm_pattern *pat, bool invert, fm_split_behavior beh,
                            const char *s, size_t n, bool at_start, const pre_ctx *c) {
    if (n == 0) return FM_OK; /* one empty split, dropped */
    struct fm_tok_level *L = &t->lv[k];
    const bool stream = beh == FM_SPLIT_ISOLATED;
    size_t ns = 0, prev = 0, from = 0, ms, me;
    int r;
    while (from <= n && (r = fm_pattern_find(pat, s, n, from, &ms, &me)) > 0) {
        if (stream) {
            if (prev != ms) FM_TRY(run_level(t, k + 1, s + prev, ms - prev, at_start && prev == 0, c));
            if (me > ms) FM_TRY(run_level(t, k + 1, s + ms, me - ms, at_start && ms == 0, c));
        } else {
            if (prev != ms) FM_TRY(seg_push(L, &ns, prev, ms, false));
            FM_TRY(seg_push(L, &ns, ms, me, true));
        }
        prev = me;
        if (me >= n) break;
        from = me > ms ? me : me + char_len(s, n, me);
    }
    if (r < 0) return FM_ERR_FORMAT;
    if (stream) return prev < n ? run_level(t, k + 1, s + prev, n - prev, at_start && prev == 0, c) : FM_OK;
    if (prev != n) FM_TRY(seg_push(L, &ns, prev, n, false));
    if (invert)
        for (size_t i = 0; i < ns; i++) L->seg[i].match = !L->seg[i].match;
    /* the behaviour, in place: seg[i].match becomes "remove" */
    struct fm_seg *g = L->seg;
    size_t m = 0;
    bool prev_match = false;
    switch (beh) {
    case FM_SPLIT_ISOLATED: /* streamed above (an inverted Isolated split is the same split) */
    case FM_SPLIT_REMOVED:
        m = ns;
        break;
    case FM_SPLIT_CONTIGUOUS:
    case FM_SPLIT_PREV:
        for (size_t i = 0; i < ns; i++) {
            const struct fm_seg x = g[i];
            const bool merge = beh == FM_SPLIT_CONTIGUOUS ? x.match == prev_match : x.match && !prev_match;
            if (merge && m > 0) g[m - 1].b = x.b;
            else g[m++] = (struct fm_seg){x.a, x.b, false};
            prev_match = x.match;
        }
        break;
    case FM_SPLIT_NEXT: /* right to left, then reversed */
        for (size_t i = ns; i-- > 0;) {
            const struct fm_seg x = g[i];
            if (x.match && !prev_match && m > 0) g[ns - m].a = x.a;
            else { g[ns - 1 - m] = (struct fm_seg){x.a, x.b, false}; m++; }
            prev_match = x.match;
        }
        memmove(g, g + ns - m, m * sizeof *g);
        break;
    }
    /* deeper levels have their own scratch, so g stays valid while they run */
    for (size_t i = 0; i < m; i++)
        if (!g[i].match && g[i].b > g[i].a)
            FM_TRY(run_level(t, k + 1, s + g[i].a, g[i].b - g[i].a, at_start && g[i].a == 0, c));
    return FM_OK;
}

/* The GPT-2 byte-level form of s[0..n) (each byte one character), on to level k + 1. */
static fm_status bytelevel_map(struct fm_tok_impl *t, int k, const char *s, size_t n, bool at_start, const pre_ctx *c) {
    fm_buf *b = &t->lv[k].map;
    b->n = 0;
    FM_TRY(fm_buf_reserve(b, 2 * n + 2));
    char *o = b->p;
    for (size_t i = 0; i < n; i++) {
        const unsigned char ch = (unsigned char)s[i];
        o[0] = t->bl_enc[ch][0];
        o[1] = t->bl_enc[ch][1];
        o += t->bl_len[ch];
    }
    b->n = (size_t)(o - b->p);
    return run_level(t, k + 1, b->p, b->n, at_start, c);
}

static fm_status run_level(struct fm_tok_impl *t, int k, const char *s, size_t n, bool at_start, const pre_ctx *c) {
    if (n == 0) return FM_OK;
    if (k == t->n_pre) return c->fn(t, s, n, c->ctx);
    fm_pre_op *op = &t->pre[k];
    if (op->kind == FM_PRE_SPLIT) return split_text(t, k, &op->pat, op->invert, op->behavior, s, n, at_start, c);
    fm_buf *b = &t->lv[k].buf;
    if (op->kind == FM_PRE_BYTELEVEL) {
        if (op->add_prefix_space && s[0] != ' ') {
            b->n = 0;
            FM_TRY(fm_buf_put(b, " ", 1));
            FM_TRY(fm_buf_put(b, s, n));
            s = b->p;
            n = b->n;
        }
        if (!op->use_regex) return bytelevel_map(t, k, s, n, at_start, c);
        /* an Isolated split with the GPT-2 regex, each piece mapped */
        size_t from = 0, prev = 0, ms, me;
        int r;
        while (from <= n && (r = fm_pattern_find(&op->pat, s, n, from, &ms, &me)) > 0) {
            if (prev != ms) FM_TRY(bytelevel_map(t, k, s + prev, ms - prev, at_start && prev == 0, c));
            if (me > ms) FM_TRY(bytelevel_map(t, k, s + ms, me - ms, at_start && ms == 0, c));
            prev = me;
            if (me >= n) break;
            from = me > ms ? me : me + char_len(s, n, me);
        }
        if (r < 0) return FM_ERR_FORMAT;
        return prev < n ? bytelevel_map(t, k, s + prev, n - prev, at_start && prev == 0, c) : FM_OK;
    }
    /* Metaspace: ' ' -> the replacement, the prefix, then a MergedWithNext split on the replacement */
    b->n = 0;
    const bool starts = n >= op->repl_len && !memcmp(s, op->repl, op->repl_len);
    if (!starts && s[0] != ' ' && (op->scheme == FM_PREPEND_ALWAYS || (op->scheme == FM_PREPEND_FIRST && at_start)))
        FM_TRY(fm_buf_put(b, op->repl, op->repl_len));
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') FM_TRY(fm_buf_put(b, op->repl, op->repl_len));
        else FM_TRY(fm_buf_put(b, s + i, 1));
    }
    if (!op->split) return run_level(t, k + 1, b->p, b->n, at_start, c);
    fm_pattern lit = {.lit = op->repl, .lit_len = op->repl_len};
    return split_text(t, k, &lit, false, FM_SPLIT_NEXT, b->p, b->n, at_start, c);
}

fm_status fm_tok_pretok_run(struct fm_tok_impl *t, const char *s, size_t n, bool at_start, fm_word_fn fn, void *ctx) {
    const pre_ctx c = {fn, ctx};
    return run_level(t, 0, s, n, at_start, &c);
}
