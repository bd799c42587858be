/* The BPE model on one word: initial symbols (characters, or <0xNN> byte tokens with
 * byte_fallback, or the unk token, fused when fuse_unk), then merges in rank order. The rules are
 * those of `tokenizers` models/bpe/model.rs merge_word and word.rs merge_all: a binary heap of
 * candidate pairs ordered by (rank, position), stale candidates skipped when the pair at their
 * position no longer makes their new id. A cache maps words seen before to their ids. */
#include <string.h>

#include "fm_tok_internal.h"

#define FM_TOK_CACHE_MAX_WORDS 200000 /* the cache is cleared when it holds this many words */
#define FM_TOK_CACHE_MAX_LEN 256      /* longer words are not cached */

static bool cand_less(const fm_merge_cand *a, const fm_merge_cand *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(fm_merge_cand *h, size_t *n, fm_merge_cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static fm_merge_cand heap_pop(fm_merge_cand *h, size_t *n) {
    fm_merge_cand top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const fm_merge_cand *best = &last;
        if (l < *n && cand_less(&h[l], best)) { m = l; best = &h[l]; }
        if (r < *n && cand_less(&h[r], best)) { m = r; best = &h[r]; }
        if (m == i) break;
        h[i] = h[m];
        i = m;
    }
    if (*n) h[i] = last;
    return top;
}

static fm_status grow_scratch(struct fm_tok_impl *t, size_t n) {
    if (n <= t->sym_cap) return FM_OK;
    size_t cap = t->sym_cap ? t->sym_cap : 64;
    while (cap < n) cap *= 2;
    fm_sym *s = fm_malloc(cap * sizeof *s);
    fm_merge_cand *h = fm_malloc(2 * cap * sizeof *h); /* at most n initial + 2 per merge, merges < n */
    if (!s || !h) {
        fm_free(s);
        fm_free(h);
        return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for a %zu-symbol word", n);
    }
    fm_free(t->sym);
    fm_free(t->heap);
    t->sym = s;
    t->heap = h;
    t->sym_cap = cap;
    t->heap_cap = 2 * cap;
    return FM_OK;
}

static void sym_add(struct fm_tok_impl *t, size_t *ns, int32_t id, int32_t len) {
    fm_sym *s = &t->sym[*ns];
    s->id = id;
    s->len = len;
    s->prev = (int32_t)*ns - 1;
    s->next = (int32_t)*ns + 1;
    (*ns)++;
}

static void push_pair(struct fm_tok_impl *t, size_t *nh, int32_t pos, int32_t a, int32_t b) {
    const fm_pairmap_slot *m = fm_pairmap_get(&t->merges, a, b);
    if (m) heap_push(t->heap, nh, (fm_merge_cand){m->rank, pos, m->new_id});
}

/* merge_word + merge_all: the ids of w[0..n) into t->word_ids[0..*out_n). */
static fm_status merge_word(struct fm_tok_impl *t, const char *w, size_t n, size_t *out_n) {
    FM_TRY(grow_scratch(t, n + 1));
    size_t ns = 0;
    int32_t unk_id = -1, unk_len = 0; /* a pending unk symbol */
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int cl = fm_utf8_next((const unsigned char *)w + i, n - i, &cp);
        if (cl <= 0) { cl = 1; cp = (unsigned char)w[i]; }
        int32_t id;
        if (cl <= 2) id = t->cp_id[cp < 0x800 ? cp : 0x7FF];
        else {
            const fm_strmap_slot *e = fm_strmap_get(&t->vocab, w + i, (size_t)cl);
            id = e ? e->v0 : -1;
        }
        if (id >= 0) {
            if (unk_id >= 0) { sym_add(t, &ns, unk_id, unk_len); unk_id = -1; }
            sym_add(t, &ns, id, cl);
        } else {
            bool done = false;
            if (t->byte_fallback) {
                bool all = true;
                for (int k = 0; k < cl; k++) all = all && t->byte_id[(unsigned char)w[i + k]] >= 0;
                if (all) {
                    for (int k = 0; k < cl; k++) sym_add(t, &ns, t->byte_id[(unsigned char)w[i + k]], 1);
                    done = true;
                }
            }
            if (!done && t->unk_id != -1) {
                if (t->unk_id == -2)
                    return fm_error(FM_ERR_FORMAT, "%s: model.unk_token \"%s\" is needed (for a character the vocab lacks) "
                                    "but is not in model.vocab; add it to the vocab", t->file, t->unk_name);
                if (unk_id >= 0 && t->fuse_unk) unk_len += cl;
                else {
                    if (unk_id >= 0) sym_add(t, &ns, unk_id, unk_len);
                    unk_id = t->unk_id;
                    unk_len = cl;
                }
            }
        }
        i += (size_t)cl;
    }
    if (unk_id >= 0) sym_add(t, &ns, unk_id, unk_len);
    if (ns) t->sym[ns - 1].next = -1;

    size_t nh = 0;
    for (size_t i = 0; i + 1 < ns; i++) push_pair(t, &nh, (int32_t)i, t->sym[i].id, t->sym[i + 1].id);
    while (nh) {
        const fm_merge_cand top = heap_pop(t->heap, &nh);
        fm_sym *cur = &t->sym[top.pos];
        if (cur->len == 0 || cur->next < 0) continue;
        fm_sym *right = &t->sym[cur->next];
        const fm_pairmap_slot *m = fm_pairmap_get(&t->merges, cur->id, right->id);
        if (!m || m->new_id != top.new_id) continue; /* a stale candidate */
        cur->id = top.new_id;
        cur->len += right->len;
        cur->next = right->next;
        right->len = 0;
        if (cur->next >= 0) t->sym[cur->next].prev = top.pos;
        if (cur->prev >= 0) push_pair(t, &nh, cur->prev, t->sym[cur->prev].id, cur->id);
        if (cur->next >= 0) push_pair(t, &nh, top.pos, cur->id, t->sym[cur->next].id);
    }
    if (ns > t->word_cap) {
        fm_free(t->word_ids);
        t->word_cap = 0;
        t->word_ids = fm_malloc(2 * ns * sizeof(int32_t));
        if (!t->word_ids) return fm_error(FM_ERR_NOMEM, "tokenizer: out of memory for a %zu-symbol word", ns);
        t->word_cap = 2 * ns;
    }
    size_t k = 0;
    for (size_t i = 0; i < ns; i++)
        if (t->sym[i].len) t->word_ids[k++] = t->sym[i].id;
    *out_n = k;
    return FM_OK;
}

fm_status fm_tok_bpe_word(struct fm_tok_impl *t, const char *w, size_t n, int32_t **ids, size_t *n_ids) {
    *ids = t->word_ids;
    *n_ids = 0;
    if (n == 0) return FM_OK;
    if (t->ignore_merges) {
        const fm_strmap_slot *e = fm_strmap_get(&t->vocab, w, n);
        if (e) {
            t->word_ids[0] = e->v0; /* word_cap >= 1 from load */
            *ids = t->word_ids;
            *n_ids = 1;
            return FM_OK;
        }
    }
    const bool cacheable = n <= FM_TOK_CACHE_MAX_LEN;
    if (cacheable) {
        const fm_strmap_slot *e = fm_strmap_get(&t->cache, w, n);
        if (e) {
            *ids = t->cache_ids + e->v0;
            *n_ids = (size_t)e->v1;
            return FM_OK;
        }
    }
    size_t k = 0;
    FM_TRY(merge_word(t, w, n, &k));
    *ids = t->word_ids;
    *n_ids = k;
    if (!cacheable || k == 0) return FM_OK; /* a word of no ids (no unk, no byte fallback) is not cached */
    if (t->cache.n >= FM_TOK_CACHE_MAX_WORDS) {
        fm_strmap_clear(&t->cache);
        t->cache_n = 0;
    }
    if (t->cache_n + k > t->cache_cap) {
        size_t cap = t->cache_cap ? 2 * t->cache_cap : 1 << 16;
        while (cap < t->cache_n + k) cap *= 2;
        int32_t *v = fm_malloc(cap * sizeof *v);
        if (!v) return FM_OK; /* no room: leave the word uncached */
        if (t->cache_n) memcpy(v, t->cache_ids, t->cache_n * sizeof *v);
        fm_free(t->cache_ids);
        t->cache_ids = v;
        t->cache_cap = cap;
    }
    memcpy(t->cache_ids + t->cache_n, t->word_ids, k * sizeof(int32_t));
    FM_TRY(fm_strmap_put(&t->cache, w, n, (int32_t)t->cache_n, (int32_t)k));
    t->cache_n += k;
    *ids = t->cache_ids + t->cache_n - k;
    return FM_OK;
}
