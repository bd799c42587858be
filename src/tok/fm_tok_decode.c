/* Decoding: ids to token strings, then the decoder chain over the list of strings (each decoder's
 * decode_chain in `tokenizers` decoders/ and pre_tokenizers/byte_level.rs, metaspace.rs), then
 * the strings joined. */
#include <string.h>

#include "fm_tok_internal.h"

/* Tokens live in an fm_pieces list with id 0 (kept even when empty). */
static fm_status tok_add(fm_pieces *p, const char *s, size_t n) { return fm_pieces_add(p, s, n, 0, false); }

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* "<0xNN>" (u8::from_str_radix on the two characters: hex digits, or '+' then one digit) -> byte. */
static int byte_token(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) || s[5] != '>') return -1;
    if (s[3] == '+') return hexval(s[4]);
    const int hi = hexval(s[3]), lo = hexval(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

static bool valid_utf8(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int l = fm_utf8_next((const unsigned char *)s + i, n - i, &cp);
        if (l <= 0) return false;
        i += (size_t)l;
    }
    return true;
}

static fm_status dec_one(struct fm_tok_impl *t, const fm_dec_op *op, const fm_pieces *in, fm_pieces *out) {
    fm_buf *b = &t->tmp;
    b->n = 0;
    if (op->kind == FM_DEC_BYTELEVEL || op->kind == FM_DEC_FUSE) {
        for (size_t i = 0; i < in->n; i++) {
            const char *s = in->text.p + in->v[i].off;
            const size_t n = in->v[i].len;
            if (op->kind == FM_DEC_FUSE) {
                FM_TRY(fm_buf_put(b, s, n));
                continue;
            }
            const size_t mark = b->n;
            bool all = true;
            for (size_t j = 0; j < n && all;) {
                uint32_t cp;
                int l = fm_utf8_next((const unsigned char *)s + j, n - j, &cp);
                const int by = l > 0 && cp < 324 ? t->bl_dec[cp] : -1;
                if (by < 0) all = false;
                else {
                    const char c = (char)by;
                    FM_TRY(fm_buf_put(b, &c, 1));
                    j += (size_t)l;
                }
            }
            if (!all) {
                b->n = mark;
                FM_TRY(fm_buf_put(b, s, n));
            }
        }
        if (op->kind == FM_DEC_FUSE) return tok_add(out, b->p ? b->p : "", b->n);
        /* String::from_utf8_lossy: the same maximal-subpart rule as the input side */
        FM_TRY(fm_buf_reserve(&t->tmp2, 3 * b->n + 1));
        t->tmp2.n = fm_utf8_sanitize(b->p ? b->p : "", b->n, t->tmp2.p);
        return tok_add(out, t->tmp2.p ? t->tmp2.p : "", t->tmp2.n);
    }
    if (op->kind == FM_DEC_BYTEFALLBACK) {
        size_t pending = 0; /* bytes of consecutive <0xNN> tokens in b */
        for (size_t i = 0; i <= in->n; i++) {
            const char *s = i < in->n ? in->text.p + in->v[i].off : "";
            const size_t n = i < in->n ? in->v[i].len : 0;
            const int by = i < in->n ? byte_token(s, n) : -1;
            if (by >= 0) {
                const char c = (char)by;
                FM_TRY(fm_buf_put(b, &c, 1));
                pending++;
                continue;
            }
            if (pending) {
                if (valid_utf8(b->p, b->n)) FM_TRY(tok_add(out, b->p, b->n));
                else
                    for (size_t k = 0; k < pending; k++) FM_TRY(tok_add(out, "\xEF\xBF\xBD", 3));
                b->n = 0;
                pending = 0;
            }
            if (i < in->n) FM_TRY(tok_add(out, s, n));
        }
        return FM_OK;
    }
    for (size_t i = 0; i < in->n; i++) {
        const char *s = in->text.p + in->v[i].off;
        const size_t n = in->v[i].len;
        b->n = 0;
        if (op->kind == FM_DEC_REPLACE) {
            FM_TRY(fm_pattern_replace((fm_pattern *)&op->pat, s, n, op->s, op->s_len, b));
        } else if (op->kind == FM_DEC_STRIP) {
            size_t a = 0, e = n;
            for (int64_t k = 0; k < op->start && a < n; k++) {
                uint32_t cp;
                int l = fm_utf8_next((const unsigned char *)s + a, n - a, &cp);
                if (l <= 0 || cp != op->content) break;
                a += (size_t)l;
            }
            for (int64_t k = 0; k < op->stop && e > a; k++) {
                size_t st = e - 1;
                while (st > a && ((unsigned char)s[st] & 0xC0) == 0x80) st--;
                uint32_t cp;
                int l = fm_utf8_next((const unsigned char *)s + st, e - st, &cp);
                if (l <= 0 || cp != op->content) break;
                e = st;
            }
            FM_TRY(fm_buf_put(b, s + a, e - a));
        } else { /* METASPACE */
            for (size_t j = 0; j < n;) {
                uint32_t cp;
                int l = fm_utf8_next((const unsigned char *)s + j, n - j, &cp);
                if (l <= 0) l = 1;
                if (l > 0 && cp == op->content) {
                    if (!(i == 0 && op->scheme != FM_PREPEND_NEVER)) FM_TRY(fm_buf_put(b, " ", 1));
                } else FM_TRY(fm_buf_put(b, s + j, (size_t)l));
                j += (size_t)l;
            }
        }
        FM_TRY(tok_add(out, b->p ? b->p : "", b->n));
    }
    return FM_OK;
}

fm_status fm_tokenizer_decode(fm_tokenizer *tk, const int32_t *ids, int64_t n, bool skip_special, char **text,
                              size_t *len) {
    struct fm_tok_impl *t = tk->impl;
    FM_ASSERT(t != NULL);
    *text = NULL;
    *len = 0;
    fm_pieces *a = &t->pa, *b = &t->pb;
    fm_pieces_reset(a);
    for (int64_t i = 0; i < n; i++) {
        const int32_t id = ids[i];
        if (id < 0 || id >= t->n_ids || !t->id_str[id]) continue;
        const char *s = t->id_str[id];
        size_t l = t->id_len[id];
        const fm_strmap_slot *e = fm_strmap_get(&t->added_map, s, l);
        if (e && e->v1 == id) {
            const fm_added *ad = &t->added[e->v0];
            if (skip_special && ad->special) continue;
            if (ad->norm && (ad->norm_len != ad->len || memcmp(ad->norm, ad->content, ad->len))) {
                s = ad->norm;
                l = ad->norm_len;
            }
        } else if (skip_special && e && t->added[e->v0].special) {
            continue; /* a model token spelled like a special token */
        }
        FM_TRY(tok_add(a, s, l));
    }
    fm_buf out = {0};
    if (!t->has_decoder) {
        for (size_t i = 0; i < a->n; i++) {
            if (i) FM_TRY(fm_buf_put(&out, " ", 1));
            FM_TRY(fm_buf_put(&out, a->text.p + a->v[i].off, a->v[i].len));
        }
    } else {
        for (int k = 0; k < t->n_dec; k++) {
            fm_pieces_reset(b);
            fm_status s = dec_one(t, &t->dec[k], a, b);
            if (s) return s;
            fm_pieces *x = a; a = b; b = x;
        }
        for (size_t i = 0; i < a->n; i++) {
            fm_status s = fm_buf_put(&out, a->text.p + a->v[i].off, a->v[i].len);
            if (s) { fm_buf_free(&out); return s; }
        }
    }
    char *res = fm_malloc(out.n + 1); /* the caller's copy, from fm_malloc */
    if (!res) {
        fm_buf_free(&out);
        return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for %zu bytes of decoded text", out.n);
    }
    if (out.n) memcpy(res, out.p, out.n);
    *text = res;
    *len = out.n;
    fm_buf_free(&out);
    return FM_OK;
}
