/* Internal to src/tok: the tokenizer's tables, the pipeline stages and the small containers they
 * share. See fm_tokenizer.h for the pipeline. Nothing here is part of the public API. */
#ifndef FM_TOK_INTERNAL_H
#define FM_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "fm_tokenizer.h"

/* ---- containers (fm_tok_map.c) ------------------------------------------------------------- */

/* A growable byte buffer. */
typedef struct fm_buf {
    char *p;
    size_t n, cap;
} fm_buf;
fm_status fm_buf_reserve(fm_buf *b, size_t extra); /* room for `extra` more bytes (FM_ERR_NOMEM) */
fm_status fm_buf_put(fm_buf *b, const void *src, size_t n);
void fm_buf_free(fm_buf *b);

/* Byte string -> (int32, int32) map, open addressing (linear probing, power-of-two table, load
 * <= 1/2). Keys are copied into the map's own pool. */
typedef struct fm_strmap_slot {
    uint64_t hash; /* 0: empty */
    uint64_t off;  /* key bytes in pool */
    uint32_t len;
    int32_t v0, v1;
} fm_strmap_slot;
typedef struct fm_strmap {
    fm_strmap_slot *slot;
    size_t cap, n; /* slots; used */
    fm_buf pool;
} fm_strmap;
uint64_t fm_tok_hash(const char *s, size_t n); /* never 0 */
/* Inserts or overwrites key -> (v0, v1). */
fm_status fm_strmap_put(fm_strmap *m, const char *key, size_t n, int32_t v0, int32_t v1);
/* The slot of key, or NULL. */
const fm_strmap_slot *fm_strmap_get(const fm_strmap *m, const char *key, size_t n);
void fm_strmap_clear(fm_strmap *m); /* drops every key, keeps the table */
void fm_strmap_free(fm_strmap *m);

/* (id, id) -> (rank, new id) map for merges. */
typedef struct fm_pairmap_slot {
    uint64_t key; /* ((a << 32) | b) + 1; 0: empty */
    int32_t rank, new_id;
} fm_pairmap_slot;
typedef struct fm_pairmap {
    fm_pairmap_slot *slot;
    size_t cap, n;
} fm_pairmap;
fm_status fm_pairmap_put(fm_pairmap *m, int32_t a, int32_t b, int32_t rank, int32_t new_id);
const fm_pairmap_slot *fm_pairmap_get(const fm_pairmap *m, int32_t a, int32_t b);
void fm_pairmap_free(fm_pairmap *m);

/* ---- pieces of text between the stages ------------------------------------------------------ */

/* One piece: bytes [off, off + len) of its list's buffer; id >= 0 when it is an added token
 * (already tokenized), else -1; at_start: the piece begins at byte 0 of the original text (what
 * Metaspace's prepend_scheme "first" looks at). */
typedef struct fm_piece {
    size_t off, len;
    int32_t id;
    bool at_start;
} fm_piece;
typedef struct fm_pieces {
    fm_buf text;
    fm_piece *v;
    size_t n, cap;
} fm_pieces;
/* Appends a piece with bytes s[0..n) (copied). Empty text pieces are dropped, as `tokenizers`
 * drops empty splits. */
fm_status fm_pieces_add(fm_pieces *p, const char *s, size_t n, int32_t id, bool at_start);
void fm_pieces_reset(fm_pieces *p);
void fm_pieces_free(fm_pieces *p);

/* ---- components ---------------------------------------------------------------------------- */

typedef enum { FM_NORM_NFC, FM_NORM_PREPEND, FM_NORM_REPLACE } fm_norm_kind;
typedef enum { FM_PRE_SPLIT, FM_PRE_BYTELEVEL, FM_PRE_METASPACE } fm_pre_kind;
typedef enum { FM_SPLIT_ISOLATED, FM_SPLIT_REMOVED, FM_SPLIT_PREV, FM_SPLIT_NEXT, FM_SPLIT_CONTIGUOUS } fm_split_behavior;
typedef enum { FM_DEC_BYTELEVEL, FM_DEC_REPLACE, FM_DEC_BYTEFALLBACK, FM_DEC_FUSE, FM_DEC_STRIP, FM_DEC_METASPACE } fm_dec_kind;
typedef enum { FM_PREPEND_ALWAYS, FM_PREPEND_FIRST, FM_PREPEND_NEVER } fm_prepend_scheme;

/* A pattern: a literal string (re == NULL) or a compiled PCRE2 regex (UTF | UCP, JIT when
 * available). */
typedef struct fm_pattern {
    char *lit;
    size_t lit_len;
    pcre2_code *re;
    pcre2_match_data *md;
    pcre2_match_context *mc; /* with a JIT stack of up to 8 MiB (long whitespace runs) */
    pcre2_jit_stack *js;
} fm_pattern;

typedef struct fm_norm_op {
    fm_norm_kind kind;
    fm_pattern pat;    /* REPLACE */
    char *s;           /* PREPEND: the prefix; REPLACE: the content */
    size_t s_len;
} fm_norm_op;

typedef struct fm_pre_op {
    fm_pre_kind kind;
    fm_pattern pat;             /* SPLIT; BYTELEVEL with use_regex: the GPT-2 regex */
    fm_split_behavior behavior; /* SPLIT */
    bool invert;                /* SPLIT */
    bool add_prefix_space, use_regex; /* BYTELEVEL */
    char repl[8];               /* METASPACE: the replacement character, UTF-8 */
    size_t repl_len;
    fm_prepend_scheme scheme;   /* METASPACE */
    bool split;                 /* METASPACE */
} fm_pre_op;

typedef struct fm_dec_op {
    fm_dec_kind kind;
    fm_pattern pat;          /* REPLACE */
    char *s;                 /* REPLACE: the content */
    size_t s_len;
    uint32_t content;        /* STRIP: the code point; METASPACE: the replacement */
    int64_t start, stop;     /* STRIP */
    fm_prepend_scheme scheme; /* METASPACE */
} fm_dec_op;

typedef struct fm_added {
    char *content;
    size_t len;
    char *norm; /* normalized content (normalized tokens), else NULL */
    size_t norm_len;
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
} fm_added;

/* Leftmost-longest matcher over a set of added tokens: by first byte, the tokens longest first. */
typedef struct fm_added_set {
    int32_t *order;      /* indexes into impl->added, grouped by first byte, longest first */
    int32_t first[257];  /* order[first[c] .. first[c + 1]) start with byte c */
    int n;
} fm_added_set;

/* One symbol of a word being merged: a linked list over the word's initial symbols. */
typedef struct fm_sym {
    int32_t id, prev, next, len; /* len 0: merged into its left neighbour */
} fm_sym;
typedef struct fm_merge_cand {
    int32_t rank, pos, new_id;
} fm_merge_cand;

struct fm_tok_impl {
    char file[4096];
    /* model */
    fm_strmap vocab;        /* token bytes -> (id, -) */
    char **id_str;          /* [n_ids] NUL-terminated token strings (model vocab or added), or NULL */
    uint32_t *id_len;       /* [n_ids] */
    int64_t n_ids;
    fm_buf id_pool;
    fm_pairmap merges;
    bool byte_fallback, fuse_unk, ignore_merges;
    int32_t unk_id;         /* -1: no unk token; -2: named but not in the vocab */
    char *unk_name;
    int32_t byte_id[256];   /* <0xNN> tokens, -1 when absent */
    int32_t cp_id[0x800];   /* the vocab id of each one-character token below U+0800, or -1 */
    /* added tokens */
    fm_added *added;
    int n_added;
    fm_strmap added_map;    /* content -> (index in added, id) */
    fm_added_set raw_set, norm_set;
    /* pipeline */
    fm_norm_op *norm;
    int n_norm;
    fm_pre_op *pre;
    int n_pre;
    fm_dec_op *dec;
    int n_dec;
    bool has_decoder;
    /* No pre-tokenizer, "▁" in the vocab and in no token but as its first character: a word may
     * be cut before each "▁" without changing its BPE (no merge can span the cut), which keeps a
     * sentencepiece-style document from being one long word. */
    bool cut_at_metaspace;
    /* encoding state and scratch */
    fm_strmap cache;        /* word bytes -> (offset, count) in cache_ids */
    int32_t *cache_ids;
    size_t cache_n, cache_cap;
    fm_buf clean, tmp, tmp2;
    fm_pieces pa, pb;       /* decode's token lists */
    fm_sym *sym;
    size_t sym_cap;
    fm_merge_cand *heap;
    size_t heap_cap;
    int32_t *word_ids;
    size_t word_cap;
    struct fm_tok_level { /* the pre-tokenizer's scratch, one per op (they run nested) */
        fm_buf buf, map;
        struct fm_seg { size_t a, b; bool match; } *seg;
        size_t seg_cap;
    } *lv;
    struct fm_split { size_t a, b; int32_t id; } *sp[2]; /* added-token splits: raw, normalized */
    size_t sp_cap[2];
    fm_buf norm_out;
    /* GPT-2 byte-level table: byte -> its character's UTF-8 (bl_len bytes); code point -> byte */
    char bl_enc[256][3];
    uint8_t bl_len[256];
    int16_t bl_dec[324];
};

/* ---- stages ---------------------------------------------------------------------------------- */

/* GPT-2's byte <-> unicode table (bytes_to_unicode in openai/gpt-2 encoder.py): printable
 * Latin-1 bytes map to themselves, the other 68 to U+0100 + k in byte order. */
uint32_t fm_bytelevel_char(unsigned char b);
int fm_bytelevel_byte(uint32_t cp); /* the byte of a code point, or -1 */

/* UTF-8: the length of the valid sequence at s (n bytes left), or 0 when invalid; *cp its code
 * point. */
int fm_utf8_next(const unsigned char *s, size_t n, uint32_t *cp);
size_t fm_utf8_put(char *out, uint32_t cp); /* 1..4 bytes */

/* Compiles a pattern from a tokenizer.json {"String": s} or {"Regex": r} object (fm_tok_load.c).
 * `what` names the field for messages. */
fm_status fm_pattern_compile(fm_pattern *p, const char *lit, const char *regex, const char *file, const char *what);
void fm_pattern_free(fm_pattern *p);
/* Finds the first match of p in s[from..n): *ms, *me its byte range. Returns 1 when found, 0
 * when none, -1 on a PCRE2 failure (message set: FM_ERR_FORMAT naming the PCRE2 error). */
int fm_pattern_find(fm_pattern *p, const char *s, size_t n, size_t from, size_t *ms, size_t *me);
/* Replaces every match of p in s[0..n) with rep[0..rn) into out (reset first). */
fm_status fm_pattern_replace(fm_pattern *p, const char *s, size_t n, const char *rep, size_t rn, fm_buf *out);

/* Normalizes s[0..n) with the normalizer ops into out (reset first; not t->tmp2, its scratch).
 * (fm_tok_pretok.c) */
fm_status fm_tok_normalize(struct fm_tok_impl *t, const char *s, size_t n, fm_buf *out);
/* Where the pre-tokenizer's words go: the BPE model and the output (fm_tok_encode.c). */
typedef fm_status (*fm_word_fn)(struct fm_tok_impl *t, const char *w, size_t n, void *ctx);
/* Runs the pre-tokenizer ops depth first over s[0..n) (a normalized piece; at_start: it begins
 * at byte 0 of the original text) and calls fn on each word, in order. (fm_tok_pretok.c) */
fm_status fm_tok_pretok_run(struct fm_tok_impl *t, const char *s, size_t n, bool at_start, fm_word_fn fn, void *ctx);
/* BPE of one word w[0..n): *ids points at its *n_ids ids (in the cache or t->word_ids; valid
 * until the next call). (fm_tok_bpe.c) */
fm_status fm_tok_bpe_word(struct fm_tok_impl *t, const char *w, size_t n, int32_t **ids, size_t *n_ids);

/* Loading (fm_tok_load.c): parses the tokenizer.json text into t. */
fm_status fm_tok_parse(struct fm_tok_impl *t, const char *json, size_t n);
void fm_tok_impl_free(struct fm_tok_impl *t);

#endif
