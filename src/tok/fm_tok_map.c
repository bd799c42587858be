/* The tokenizer's containers (byte buffers, hash maps, piece lists), UTF-8 helpers and GPT-2's
 * byte <-> unicode table. See fm_tok_internal.h. */
#include <stdlib.h>
#include <string.h>

#include "fm_tok_internal.h"

/* ---- byte buffer ---- */

/* The growable scratch of the tokenizer uses realloc (no zero fill: a big text's buffers are
 * grown, not cleared; untouched pages cost nothing); it is never part of a training step. */
fm_status fm_buf_reserve(fm_buf *b, size_t extra) {
    if (b->n + extra <= b->cap) return FM_OK;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + extra) cap *= 2;
    char *p = fm_fault_hit() ? NULL : realloc(b->p, cap);
    if (!p) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for a %zu-byte buffer", cap);
    b->p = p;
    b->cap = cap;
    return FM_OK;
}

fm_status fm_buf_put(fm_buf *b, const void *src, size_t n) {
    FM_TRY(fm_buf_reserve(b, n + 1));
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
    b->p[b->n] = 0; /* always NUL-terminated past n */
    return FM_OK;
}

void fm_buf_free(fm_buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* ---- hashing: 8 bytes at a time, a multiply-xorshift mix (after MurmurHash3's finalizer) ---- */

static inline uint64_t mix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

uint64_t fm_tok_hash(const char *s, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (n * 0x100000001b3ULL);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        h = (h ^ w) * 0x9e3779b97f4a7c15ULL;
        h ^= h >> 29;
    }
    uint64_t w = 0;
    for (size_t k = 0; i + k < n; k++) w |= (uint64_t)(unsigned char)s[i + k] << (8 * k);
    h = mix64(h ^ w);
    return h ? h : 1;
}

/* ---- string map ---- */

static fm_status strmap_grow(fm_strmap *m) {
    size_t cap = m->cap ? m->cap * 2 : 1024;
    fm_strmap_slot *s = fm_malloc(cap * sizeof *s);
    if (!s) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for a %zu-slot hash table", cap);
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->slot[i].hash) continue;
        size_t j = m->slot[i].hash & (cap - 1);
        while (s[j].hash) j = (j + 1) & (cap - 1);
        s[j] = m->slot[i];
    }
    fm_free(m->slot);
    m->slot = s;
    m->cap = cap;
    return FM_OK;
}

fm_status fm_strmap_put(fm_strmap *m, const char *key, size_t n, int32_t v0, int32_t v1) {
    if (2 * (m->n + 1) > m->cap) FM_TRY(strmap_grow(m));
    const uint64_t h = fm_tok_hash(key, n);
    size_t j = h & (m->cap - 1);
    for (; m->slot[j].hash; j = (j + 1) & (m->cap - 1)) {
        fm_strmap_slot *e = &m->slot[j];
        if (e->hash == h && e->len == n && !memcmp(m->pool.p + e->off, key, n)) {
            e->v0 = v0;
            e->v1 = v1;
            return FM_OK;
        }
    }
    const size_t off = m->pool.n;
    FM_TRY(fm_buf_put(&m->pool, key, n));
    m->slot[j] = (fm_strmap_slot){h, off, (uint32_t)n, v0, v1};
    m->n++;
    return FM_OK;
}

const fm_strmap_slot *fm_strmap_get(const fm_strmap *m, const char *key, size_t n) {
    if (!m->cap) return NULL;
    const uint64_t h = fm_tok_hash(key, n);
    for (size_t j = h & (m->cap - 1); m->slot[j].hash; j = (j + 1) & (m->cap - 1)) {
        const fm_strmap_slot *e = &m->slot[j];
        if (e->hash == h && e->len == n && !memcmp(m->pool.p + e->off, key, n)) return e;
    }
    return NULL;
}

void fm_strmap_clear(fm_strmap *m) {
    if (m->slot) memset(m->slot, 0, m->cap * sizeof *m->slot);
    m->n = 0;
    m->pool.n = 0;
}

void fm_strmap_free(fm_strmap *m) {
    fm_free(m->slot);
    fm_buf_free(&m->pool);
    memset(m, 0, sizeof *m);
}

/* ---- pair map ---- */

static fm_status pairmap_grow(fm_pairmap *m) {
    size_t cap = m->cap ? m->cap * 2 : 1024;
    fm_pairmap_slot *s = fm_malloc(cap * sizeof *s);
    if (!s) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for a %zu-slot merge table", cap);
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->slot[i].key) continue;
        size_t j = mix64(m->slot[i].key) & (cap - 1);
        while (s[j].key) j = (j + 1) & (cap - 1);
        s[j] = m->slot[i];
    }
    fm_free(m->slot);
    m->slot = s;
    m->cap = cap;
    return FM_OK;
}

fm_status fm_pairmap_put(fm_pairmap *m, int32_t a, int32_t b, int32_t rank, int32_t new_id) {
    if (2 * (m->n + 1) > m->cap) FM_TRY(pairmap_grow(m));
    const uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    size_t j = mix64(key) & (m->cap - 1);
    for (; m->slot[j].key; j = (j + 1) & (m->cap - 1))
        if (m->slot[j].key == key) break;
    if (!m->slot[j].key) m->n++;
    m->slot[j] = (fm_pairmap_slot){key, rank, new_id};
    return FM_OK;
}

const fm_pairmap_slot *fm_pairmap_get(const fm_pairmap *m, int32_t a, int32_t b) {
    if (!m->cap) return NULL;
    const uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    for (size_t j = mix64(key) & (m->cap - 1); m->slot[j].key; j = (j + 1) & (m->cap - 1))
        if (m->slot[j].key == key) return &m->slot[j];
    return NULL;
}

void fm_pairmap_free(fm_pairmap *m) {
    fm_free(m->slot);
    memset(m, 0, sizeof *m);
}

/* ---- pieces ---- */

fm_status fm_pieces_add(fm_pieces *p, const char *s, size_t n, int32_t id, bool at_start) {
    if (n == 0 && id < 0) return FM_OK;
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        fm_piece *v = fm_fault_hit() ? NULL : realloc(p->v, cap * sizeof *v);
        if (!v) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for %zu pieces", cap);
        p->v = v;
        p->cap = cap;
    }
    const size_t off = p->text.n;
    FM_TRY(fm_buf_put(&p->text, s, n));
    p->v[p->n++] = (fm_piece){off, n, id, at_start};
    return FM_OK;
}

void fm_pieces_reset(fm_pieces *p) {
    p->n = 0;
    p->text.n = 0;
}

void fm_pieces_free(fm_pieces *p) {
    fm_buf_free(&p->text);
    free(p->v);
    memset(p, 0, sizeof *p);
}

/* ---- UTF-8 ---- */

int fm_utf8_next(const unsigned char *s, size_t n, uint32_t *cp) {
    const unsigned char c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    int len;
    uint32_t v;
    unsigned char lo = 0x80, hi = 0xBF; /* the allowed range of the second byte (Table 3-7) */
    if (c >= 0xC2 && c <= 0xDF) { len = 2; v = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3; v = c & 0x0F;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4; v = c & 0x07;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else return 0;
    if (n < (size_t)len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    v = (v << 6) | (s[1] & 0x3F);
    for (int k = 2; k < len; k++) {
        if ((s[k] & 0xC0) != 0x80) return 0;
        v = (v << 6) | (s[k] & 0x3F);
    }
    *cp = v;
    return len;
}

size_t fm_utf8_put(char *out, uint32_t cp) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) { o[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) { o[0] = (unsigned char)(0xC0 | (cp >> 6)); o[1] = (unsigned char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* The maximal subpart at an invalid position: the lead byte plus the continuation bytes that
 * still fit a well-formed sequence (Table 3-7); at least 1. */
static size_t maximal_subpart(const unsigned char *s, size_t n) {
    const unsigned char c = s[0];
    int len;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    else return 1;
    size_t k = 1;
    if (k < n && (size_t)k < (size_t)len && s[1] >= lo && s[1] <= hi) {
        k = 2;
        while (k < n && k < (size_t)len && (s[k] & 0xC0) == 0x80) k++;
    }
    return k;
}

size_t fm_utf8_sanitize(const char *in, size_t n, char *out) {
    const unsigned char *s = (const unsigned char *)in;
    size_t i = 0, o = 0;
    while (i < n) {
        /* ASCII runs, 8 bytes at a time */
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ULL) break;
            memcpy(out + o, s + i, 8);
            i += 8;
            o += 8;
        }
        if (i >= n) break;
        uint32_t cp;
        int len = fm_utf8_next(s + i, n - i, &cp);
        if (len > 0) {
            memcpy(out + o, s + i, (size_t)len);
            i += (size_t)len;
            o += (size_t)len;
        } else {
            i += maximal_subpart(s + i, n - i);
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
        }
    }
    return o;
}

/* ---- GPT-2 bytes <-> unicode ---- */

static bool printable_byte(unsigned b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

uint32_t fm_bytelevel_char(unsigned char b) {
    if (printable_byte(b)) return b;
    uint32_t k = 0;
    for (unsigned x = 0; x < b; x++) k += !printable_byte(x);
    return 256 + k;
}

int fm_bytelevel_byte(uint32_t cp) {
    if (cp < 256) return printable_byte(cp) ? (int)cp : -1;
    if (cp >= 256 + 68) return -1;
    uint32_t k = cp - 256;
    for (unsigned x = 0; x < 256; x++)
        if (!printable_byte(x) && k-- == 0) return (int)x;
    return -1;
}
