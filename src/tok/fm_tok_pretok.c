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
    if (!p->md) return fm_error(FM_ERR_NOMEM, "%s: out of memory for the regex of %s", file, what);
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

/* ---- pre-tokenizers ---- */

static fm_status seg_push(struct fm_tok_impl *t, size_t *ns, size_t a, size_t b, bool match) {
    if (*ns == t->seg_cap) {
        size_t cap = t->seg_cap ? 2 * t->seg_cap : 256;
        struct fm_seg *v = fm_malloc(cap * sizeof *v);
        if (!v) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for %zu splits", cap);
        if (*ns) memcpy(v, t->seg, *ns * sizeof *v);
        fm_free(t->seg);
        t->seg = v;
        t->seg_cap = cap;
    }
    t->seg[(*ns)++] = (struct fm_seg){a, b, match};
    return FM_OK;
}

/* NormalizedString::split(pattern, behavior) of s[0..n) into out (pieces of text). */
static fm_status split_text(struct fm_tok_impl *t, fm_pattern *pat, bool invert, fm_split_behavior beh, const char *s,
                            size_t n, bool at_start, fm_pieces *out) {
    size_t ns = 0;
    if (n == 0) return FM_OK; /* one empty split, dropped */
    size_t prev = 0, from = 0, ms, me;
    int r;
    while (from <= n && (r = fm_pattern_find(pat, s, n, from, &ms, &me)) > 0) {
        if (prev != ms) FM_TRY(seg_push(t, &ns, prev, ms, false));
        FM_TRY(seg_push(t, &ns, ms, me, true));
        prev = me;
        if (me >= n) break;
        from = me > ms ? me : me + char_len(s, n, me);
    }
    if (r < 0) return FM_ERR_FORMAT;
    if (prev != n) FM_TRY(seg_push(t, &ns, prev, n, false));
    if (invert)
        for (size_t i = 0; i < ns; i++) t->seg[i].match = !t->seg[i].match;
    /* the behaviour, in place: seg[i].match becomes "remove" */
    size_t m = 0;
    bool prev_match = false;
    switch (beh) {
    case FM_SPLIT_ISOLATED:
        for (size_t i = 0; i < ns; i++) t->seg[i].match = false;
        m = ns;
        break;
    case FM_SPLIT_REMOVED:
        m = ns;
        break;
    case FM_SPLIT_CONTIGUOUS:
    case FM_SPLIT_PREV:
        for (size_t i = 0; i < ns; i++) {
            const struct fm_seg g = t->seg[i];
            const bool merge = beh == FM_SPLIT_CONTIGUOUS ? g.match == prev_match : g.match && !prev_match;
            if (merge && m > 0) t->seg[m - 1].b = g.b;
            else t->seg[m++] = (struct fm_seg){g.a, g.b, false};
            prev_match = g.match;
        }
        break;
    case FM_SPLIT_NEXT: /* right to left, then reversed */
        for (size_t i = ns; i-- > 0;) {
            const struct fm_seg g = t->seg[i];
            if (g.match && !prev_match && m > 0) t->seg[ns - m].a = g.a;
            else { t->seg[ns - 1 - m] = (struct fm_seg){g.a, g.b, false}; m++; }
            prev_match = g.match;
        }
        memmove(t->seg, t->seg + ns - m, m * sizeof *t->seg);
        break;
    }
    for (size_t i = 0; i < m; i++)
        if (!t->seg[i].match)
            FM_TRY(fm_pieces_add(out, s + t->seg[i].a, t->seg[i].b - t->seg[i].a, -1, at_start && t->seg[i].a == 0));
    return FM_OK;
}

/* Appends the GPT-2 byte-level form of s[0..n) (each byte one character) as one piece. */
static fm_status bytelevel_map(struct fm_tok_impl *t, const char *s, size_t n, bool at_start, fm_pieces *out) {
    fm_buf *b = &t->tmp2;
    b->n = 0;
    FM_TRY(fm_buf_reserve(b, 2 * n + 1));
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = (unsigned char)s[i];
        memcpy(b->p + b->n, t->bl_enc[c], 2);
        b->n += t->bl_len[c];
    }
    return fm_pieces_add(out, b->p, b->n, -1, at_start);
}

/* One pre-tokenizer over one text piece. */
static fm_status pre_one(struct fm_tok_impl *t, fm_pre_op *op, const char *s, size_t n, bool at_start,
                         fm_pieces *out) {
    if (op->kind == FM_PRE_SPLIT) return split_text(t, &op->pat, op->invert, op->behavior, s, n, at_start, out);
    fm_buf *b = &t->tmp;
    if (op->kind == FM_PRE_BYTELEVEL) {
        if (op->add_prefix_space && !(n > 0 && s[0] == ' ')) {
            b->n = 0;
            FM_TRY(fm_buf_put(b, " ", 1));
            FM_TRY(fm_buf_put(b, s, n));
            s = b->p;
            n = b->n;
        }
        if (!op->use_regex) return bytelevel_map(t, s, n, at_start, out);
        /* Isolated split with the GPT-2 regex, then each split mapped */
        size_t from = 0, prev = 0, ms, me;
        int r;
        while (from <= n && (r = fm_pattern_find(&op->pat, s, n, from, &ms, &me)) > 0) {
            if (prev != ms) FM_TRY(bytelevel_map(t, s + prev, ms - prev, at_start && prev == 0, out));
            if (me > ms) FM_TRY(bytelevel_map(t, s + ms, me - ms, at_start && ms == 0, out));
            prev = me;
            if (me >= n) break;
            from = me > ms ? me : me + char_len(s, n, me);
        }
        if (r < 0) return FM_ERR_FORMAT;
        if (prev < n) FM_TRY(bytelevel_map(t, s + prev, n - prev, at_start && prev == 0, out));
        return FM_OK;
    }
    /* Metaspace: ' ' -> replacement, the prefix, then a MergedWithNext split on the replacement */
    b->n = 0;
    const bool starts = n >= op->repl_len && !memcmp(s, op->repl, op->repl_len);
    const bool starts_space = n > 0 && s[0] == ' ';
    if (!starts && !starts_space &&
        (op->scheme == FM_PREPEND_ALWAYS || (op->scheme == FM_PREPEND_FIRST && at_start)))
        FM_TRY(fm_buf_put(b, op->repl, op->repl_len));
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') FM_TRY(fm_buf_put(b, op->repl, op->repl_len));
        else FM_TRY(fm_buf_put(b, s + i, 1));
    }
    if (!op->split) return fm_pieces_add(out, b->p, b->n, -1, at_start);
    fm_pattern lit = {.lit = op->repl, .lit_len = op->repl_len};
    /* b is t->tmp: split_text reads it and writes pieces elsewhere */
    return split_text(t, &lit, false, FM_SPLIT_NEXT, b->p, b->n, at_start, out);
}

fm_status fm_tok_pretokenize(struct fm_tok_impl *t, fm_pieces *in, fm_pieces *tmp) {
    for (int k = 0; k < t->n_pre; k++) {
        fm_pieces_reset(tmp);
        for (size_t i = 0; i < in->n; i++) {
            const fm_piece *p = &in->v[i];
            if (p->id >= 0) FM_TRY(fm_pieces_add(tmp, "", 0, p->id, false));
            else FM_TRY(pre_one(t, &t->pre[k], in->text.p + p->off, p->len, p->at_start, tmp));
        }
        fm_pieces x = *in; *in = *tmp; *tmp = x;
    }
    return FM_OK;
}
