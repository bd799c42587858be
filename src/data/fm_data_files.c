/* One data source: byte-level text (read into memory), an llm.c shard or a Megatron-LM indexed
 * data set (memory-mapped), and its loss-mask sidecar. Formats: fm_data.h. */
#define _GNU_SOURCE
#include "fm_data_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SNIFF_BYTES ((size_t)64 << 10)  /* text files: NUL check over this prefix */
#define CHECK_PIECE ((size_t)64 << 20)  /* mapped bytes checked, then dropped from RSS, at a time */
#define MEGATRON_MAGIC "MMIDIDX\0\0"
#define FM_MEGATRON_MAX_TOKENS (INT64_C(1) << 56)
#define MEGATRON_HEADER_BYTES 34        /* 9 magic + 8 version + 1 dtype + 8 sequences + 8 documents */

size_t fm_token_type_size(int t) {
    switch (t) {
    case FM_TOK_U8: case FM_TOK_I8: return 1;
    case FM_TOK_U16: case FM_TOK_I16: return 2;
    case FM_TOK_U32: case FM_TOK_I32: return 4;
    case FM_TOK_I64: return 8;
    default: return 0;
    }
}

static const char *type_name(int t) {
    static const char *n[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "int64"};
    return t >= 0 && t <= FM_TOK_I64 ? n[t] : "?";
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t le64(const unsigned char *p) { return (uint64_t)le32(p) | ((uint64_t)le32(p + 4) << 32); }

void fm_data_part_release(fm_data_part *p) {
    if (p->map) munmap(p->map, p->map_bytes);
    if (p->mask_map) munmap(p->mask_map, p->mask_map_bytes);
    fm_free(p->heap);
    fm_free(p->doc_starts);
    memset(p, 0, sizeof *p);
}

/* Opens `path` read-only; it must be a regular file. `what` names it in messages. */
static fm_status open_regular(const char *path, const char *what, int *fd_out, int64_t *size) {
    *fd_out = -1;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return fm_error(FM_ERR_IO, "%s: cannot open %s: %s; check the path given to --data/--val-data", path, what,
                        strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return fm_error(FM_ERR_IO, "%s: cannot stat %s: %s", path, what, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return fm_error(FM_ERR_IO, "%s: expected a regular file (text, llm.c shard or Megatron .bin/.idx), found %s; "
                        "pass the files themselves, not a directory or device",
                        path, S_ISDIR(st.st_mode) ? "a directory" : "a non-regular file");
    }
    *fd_out = fd;
    *size = (int64_t)st.st_size;
    return FM_OK;
}

/* Reads exactly n bytes at offset off or reports why not. */
static fm_status pread_exact(int fd, const char *path, void *buf, size_t n, int64_t off) {
    size_t got = 0;
    while (got < n) {
        ssize_t k = pread(fd, (char *)buf + got, n - got, (off_t)(off + (int64_t)got));
        if (k < 0 && errno == EINTR) continue;
        if (k < 0)
            return fm_error(FM_ERR_IO, "%s: read error at byte %" PRId64 ": %s", path, off + (int64_t)got,
                            strerror(errno));
        if (k == 0)
            return fm_error(FM_ERR_IO, "%s: file ended at byte %" PRId64 " while %zu more bytes were expected; "
                            "was it changed while loading?", path, off + (int64_t)got, n - got);
        got += (size_t)k;
    }
    return FM_OK;
}

static fm_status map_fd(int fd, const char *path, size_t bytes, void **out) {
    void *m = mmap(NULL, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
        *out = NULL;
        return fm_error(FM_ERR_IO, "%s: cannot memory-map %zu bytes: %s", path, bytes, strerror(errno));
    }
    *out = m;
    return FM_OK;
}

/* Drops map bytes [off, off + len), widened to whole 2 MiB blocks (the largest page-cache folio
 * a fault maps at once), from this process's page tables: they stay in the page cache and come
 * back on the next read. */
static void drop_pages(void *map, size_t map_bytes, size_t off, size_t len) {
    const size_t blk = (size_t)2 << 20, pg = (size_t)sysconf(_SC_PAGESIZE);
    size_t a = off / blk * blk, b = (off + len + blk - 1) / blk * blk;
    const size_t end = (map_bytes + pg - 1) / pg * pg;
    if (b > end) b = end;
    if (b > a) (void)madvise((char *)map + a, b - a, MADV_DONTNEED);
}

void fm_data_part_drop(const fm_data_part *p, int64_t i0, int64_t n) {
    const size_t es = fm_token_type_size(p->type);
    if (p->map) {
        const size_t off = (size_t)((const char *)p->tokens - (const char *)p->map) + (size_t)i0 * es;
        drop_pages(p->map, p->map_bytes, off, (size_t)n * es);
    }
    if (p->mask_map) drop_pages(p->mask_map, p->mask_map_bytes, FM_MASK_HEADER_BYTES + (size_t)i0, (size_t)n);
}

/* min and max of n elements of type t at p. */
static void min_max(const void *p, int t, int64_t n, int64_t *mn, int64_t *mx) {
    int64_t lo = INT64_MAX, hi = INT64_MIN;
#define MM(T)                                            \
    do {                                                 \
        const T *x = p;                                  \
        T l = x[0], h = x[0];                            \
        for (int64_t i = 1; i < n; i++) {                \
            l = x[i] < l ? x[i] : l;                     \
            h = x[i] > h ? x[i] : h;                     \
        }                                                \
        lo = (int64_t)l;                                 \
        hi = (int64_t)h;                                 \
    } while (0)
    switch (t) {
    case FM_TOK_U8: MM(uint8_t); break;
    case FM_TOK_I8: MM(int8_t); break;
    case FM_TOK_U16: MM(uint16_t); break;
    case FM_TOK_I16: MM(int16_t); break;
    case FM_TOK_U32: MM(uint32_t); break;
    case FM_TOK_I32: MM(int32_t); break;
    default: MM(int64_t); break;
    }
#undef MM
    *mn = lo;
    *mx = hi;
}

static int64_t token_at(const void *p, int t, int64_t i) {
    switch (t) {
    case FM_TOK_U8: return ((const uint8_t *)p)[i];
    case FM_TOK_I8: return ((const int8_t *)p)[i];
    case FM_TOK_U16: return ((const uint16_t *)p)[i];
    case FM_TOK_I16: return ((const int16_t *)p)[i];
    case FM_TOK_U32: return ((const uint32_t *)p)[i];
    case FM_TOK_I32: return ((const int32_t *)p)[i];
    default: return ((const int64_t *)p)[i];
    }
}

/* Checks every token id of a mapped part against [0, vocab_size), a piece at a time, dropping
 * each checked piece from RSS. */
static fm_status check_ids(const char *path, const fm_data_part *p, int64_t vocab_size) {
    const size_t es = fm_token_type_size(p->type);
    const int64_t per = (int64_t)(CHECK_PIECE / es);
    const size_t base_off = (size_t)((const char *)p->tokens - (const char *)p->map);
    (void)madvise(p->map, p->map_bytes, MADV_SEQUENTIAL);
    for (int64_t i0 = 0; i0 < p->n; i0 += per) {
        const int64_t n = p->n - i0 < per ? p->n - i0 : per;
        const void *x = (const char *)p->tokens + (size_t)i0 * es;
        int64_t mn, mx;
        min_max(x, p->type, n, &mn, &mx);
        if (mn < 0 || mx >= vocab_size) {
            for (int64_t i = 0; i < n; i++) {
                int64_t id = token_at(x, p->type, i);
                if (id < 0 || id >= vocab_size)
                    return fm_error(FM_ERR_FORMAT, "%s: token %" PRId64 " (0-based) has id %" PRId64 ", but "
                                    "vocab_size is %" PRId64 "; expected ids in [0, vocab_size): tokenize with this "
                                    "model's tokenizer or use a config with a larger vocab_size",
                                    path, i0 + i, id, vocab_size);
            }
        }
        drop_pages(p->map, p->map_bytes, base_off + (size_t)i0 * es, (size_t)n * es);
    }
    (void)madvise(p->map, p->map_bytes, MADV_RANDOM);
    return FM_OK;
}

/* ---- loss masks ------------------------------------------------------------------------------ */

/* out = a followed by b (cap bytes); false (out "") when it does not fit. */
static bool join(char *out, size_t cap, const char *a, size_t a_len, const char *b) {
    const size_t bl = strlen(b);
    if (a_len + bl + 1 > cap) {
        out[0] = 0;
        return false;
    }
    memcpy(out, a, a_len);
    memcpy(out + a_len, b, bl + 1);
    return true;
}

static bool is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

/* The mask sidecar of `base` (a shard path or a Megatron prefix; fm_data.h), or "" when none. */
static void find_mask(const char *base, bool megatron, char *out, size_t cap) {
    out[0] = 0;
    char a[4200], b[4200];
    join(a, sizeof a, base, strlen(base), ".mask");
    if (megatron) join(b, sizeof b, base, strlen(base), ".bin.mask");
    else if (ends_with(base, ".bin")) join(b, sizeof b, base, strlen(base) - 4, ".mask");
    else b[0] = 0;
    if (a[0] && is_file(a)) join(out, cap, a, strlen(a), "");
    else if (b[0] && is_file(b)) join(out, cap, b, strlen(b), "");
}

/* The document index of shard `base` (fm_data.h): base.docs, else base with ".bin" replaced by
 * ".docs"; "" when none. */
static void find_docs(const char *base, char *out, size_t cap) {
    char a[4200], b[4200] = "";
    join(a, sizeof a, base, strlen(base), ".docs");
    if (ends_with(base, ".bin")) join(b, sizeof b, base, strlen(base) - 4, ".docs");
    out[0] = 0;
    if (is_file(a)) snprintf(out, cap, "%s", a);
    else if (b[0] && is_file(b)) snprintf(out, cap, "%s", b);
}

/* Megatron's documents (fm_data.h): doc_idx [D] groups the S sequences of `sizes` [S] into
 * documents; their first tokens into p->doc_starts (empty documents skipped). */
static fm_status megatron_docs(const char *idx, const unsigned char *sizes, uint64_t S, const unsigned char *doc_idx,
                               uint64_t D, fm_data_part *p) {
    if (D < 2) return FM_OK; /* no document boundaries: the data set is one stream */
    int64_t *st = fm_malloc(sizeof(int64_t) * (size_t)(D - 1));
    if (!st) return fm_error(FM_ERR_NOMEM, "%s: out of memory for %" PRIu64 " document starts", idx, D - 1);
    int64_t n = 0, tok = 0; /* documents kept, tokens before sequence `seq` */
    uint64_t seq = 0;
    for (uint64_t d = 0; d < D; d++) {
        const uint64_t at = le64(doc_idx + 8 * d);
        if ((d == 0 && at != 0) || at < seq || at > S || (d == D - 1 && at != S)) {
            fm_free(st);
            return fm_error(FM_ERR_FORMAT, "%s: doc_idx[%" PRIu64 "] is %" PRIu64 "; expected doc_idx to start at 0, "
                            "never decrease and end at the %" PRIu64 " sequences; the index is corrupt: build it again",
                            idx, d, at, S);
        }
        for (; seq < at; seq++) tok += (int32_t)le32(sizes + 4 * seq);
        /* document d starts at token tok; an empty one (same start as the one before) is skipped */
        if (d + 1 < D && (n == 0 || tok > st[n - 1])) st[n++] = tok;
    }
    while (n > 1 && st[n - 1] >= tok) n--; /* empty documents at the end */
    p->doc_starts = st;
    p->n_docs = n;
    return FM_OK;
}

/* Maps and checks the mask file for a part of p->n tokens from `data_path`. */
static fm_status open_mask(const char *mpath, const char *data_path, fm_data_part *p) {
    int fd;
    int64_t size;
    FM_TRY(open_regular(mpath, "loss-mask file", &fd, &size));
    unsigned char hdr[FM_MASK_HEADER_BYTES];
    fm_status s = FM_OK;
    if (size < FM_MASK_HEADER_BYTES) {
        s = fm_error(FM_ERR_FORMAT, "%s: loss-mask file of %" PRId64 " bytes; expected the %d-byte header (\"%s\" and "
                     "the token count) and one byte per token of %s; rewrite it with `flatmoe prepare` or remove it",
                     mpath, size, FM_MASK_HEADER_BYTES, FM_MASK_MAGIC, data_path);
        goto out;
    }
    if ((s = pread_exact(fd, mpath, hdr, sizeof hdr, 0))) goto out;
    if (memcmp(hdr, FM_MASK_MAGIC, 8) != 0) {
        s = fm_error(FM_ERR_FORMAT, "%s: not a loss-mask file: expected magic \"%s\" in its first 8 bytes; it sits next "
                     "to %s as its mask sidecar: rewrite it with `flatmoe prepare`, or move it away to train on every "
                     "token", mpath, FM_MASK_MAGIC, data_path);
        goto out;
    }
    const uint64_t n = le64(hdr + 8);
    if (n != (uint64_t)p->n) {
        s = fm_error(FM_ERR_FORMAT, "%s: loss mask for %" PRIu64 " tokens, but %s holds %" PRId64 " tokens; expected "
                     "the same count: the mask belongs to another version of the data: prepare both again",
                     mpath, n, data_path, p->n);
        goto out;
    }
    if (size != FM_MASK_HEADER_BYTES + (int64_t)n) {
        s = fm_error(FM_ERR_FORMAT, "%s: loss mask of %" PRIu64 " tokens should be %" PRId64 " bytes, found %" PRId64
                     "; the file is truncated or has trailing bytes: prepare it again", mpath, n,
                     (int64_t)(FM_MASK_HEADER_BYTES + n), size);
        goto out;
    }
    if ((s = map_fd(fd, mpath, (size_t)size, &p->mask_map))) goto out;
    p->mask_map_bytes = (size_t)size;
    p->mask = (const uint8_t *)p->mask_map + FM_MASK_HEADER_BYTES;
    for (uint64_t i0 = 0; i0 < n && s == FM_OK; i0 += CHECK_PIECE) {
        const uint64_t k = n - i0 < CHECK_PIECE ? n - i0 : CHECK_PIECE;
        for (uint64_t i = 0; i < k; i++)
            if (p->mask[i0 + i] > 1) {
                s = fm_error(FM_ERR_FORMAT, "%s: mask byte %" PRIu64 " (token %" PRIu64 ") is %u; expected 0 (not a "
                             "loss target) or 1 (a target): prepare the mask again", mpath, i0 + i, i0 + i,
                             (unsigned)p->mask[i0 + i]);
                break;
            }
        drop_pages(p->mask_map, p->mask_map_bytes, FM_MASK_HEADER_BYTES + i0, k);
    }
out:
    close(fd);
    return s;
}

/* ---- Megatron-LM indexed data sets ---------------------------------------------------------- */

/* The prefix of a Megatron data set named by `path` (PREFIX, PREFIX.bin or PREFIX.idx) when
 * PREFIX.idx starts with the MMIDIDX magic; else false. */
static bool megatron_prefix(const char *path, char *prefix, size_t cap) {
    size_t n = strlen(path);
    if (ends_with(path, ".bin") || ends_with(path, ".idx")) n -= 4;
    else if (is_file(path)) return false; /* a file of its own: a shard or text */
    if (n + 5 > cap) return false;
    memcpy(prefix, path, n);
    prefix[n] = 0;
    char idx[4200];
    if (!join(idx, sizeof idx, prefix, n, ".idx")) return false;
    FILE *f = fopen(idx, "rb");
    if (!f) return false;
    char magic[9];
    bool ok = fread(magic, 1, 9, f) == 9 && !memcmp(magic, MEGATRON_MAGIC, 9);
    fclose(f);
    return ok;
}

static fm_status open_megatron(const char *prefix, int64_t vocab_size, fm_data_part *p) {
    char idx[4200], bin[4200];
    if (!join(idx, sizeof idx, prefix, strlen(prefix), ".idx") || !join(bin, sizeof bin, prefix, strlen(prefix), ".bin"))
        return fm_error(FM_ERR_ARG, "%s: path too long", prefix);
    int fd;
    int64_t size;
    FM_TRY(open_regular(idx, "Megatron index", &fd, &size));
    void *im = NULL;
    fm_status s = FM_OK;
    if (size < MEGATRON_HEADER_BYTES) {
        s = fm_error(FM_ERR_FORMAT, "%s: Megatron index of %" PRId64 " bytes; expected at least the %d-byte header; "
                     "the file is truncated: build it again", idx, size, MEGATRON_HEADER_BYTES);
        close(fd);
        return s;
    }
    s = map_fd(fd, idx, (size_t)size, &im);
    close(fd);
    if (s) return s;
    const unsigned char *h = im;
    const uint64_t version = le64(h + 9), S = le64(h + 18), D = le64(h + 26);
    const int code = h[17];
    static const int types[9] = {-1, FM_TOK_U8, FM_TOK_I8, FM_TOK_I16, FM_TOK_I32, FM_TOK_I64, -1, -1, FM_TOK_U16};
    const uint64_t want = MEGATRON_HEADER_BYTES + 12 * S + 8 * D;
    if (version != 1) {
        s = fm_error(FM_ERR_FORMAT, "%s: Megatron index version %" PRIu64 "; expected 1 (the MMIDIDX format of "
                     "megatron/core/datasets/indexed_dataset.py)", idx, version);
    } else if (code < 1 || code > 8 || types[code] < 0) {
        s = fm_error(FM_ERR_FORMAT, "%s: Megatron dtype code %d; expected a token type: 1 uint8, 2 int8, 3 int16, "
                     "4 int32, 5 int64 or 8 uint16 (6 float64 and 7 float32 hold no token ids)", idx, code);
    } else if (S == 0 || S > ((uint64_t)1 << 40) || D > ((uint64_t)1 << 40) ||
               ((uint64_t)size != want && (uint64_t)size != want + S)) {
        s = fm_error(FM_ERR_FORMAT, "%s: Megatron index of %" PRId64 " bytes for %" PRIu64 " sequences and %" PRIu64
                     " document indices; expected %" PRIu64 " bytes (or %" PRIu64 " with sequence modes) and at least "
                     "one sequence; the file is truncated or corrupt: build it again",
                     idx, size, S, D, want, want + S);
    }
    if (s) {
        munmap(im, (size_t)size);
        return s;
    }
    p->type = types[code];
    const size_t es = fm_token_type_size(p->type);
    const unsigned char *sizes = h + MEGATRON_HEADER_BYTES, *ptrs = sizes + 4 * S;
    s = megatron_docs(idx, sizes, S, ptrs + 8 * S, D, p);
    if (s) {
        munmap(im, (size_t)size);
        return s;
    }
    int64_t total = 0;
    for (uint64_t i = 0; i < S && !s; i++) {
        int32_t len = (int32_t)le32(sizes + 4 * i);
        int64_t ptr = (int64_t)le64(ptrs + 8 * i);
        if (len < 0 || ptr != total * (int64_t)es)
            s = fm_error(FM_ERR_FORMAT, "%s: sequence %" PRIu64 " has %d tokens at byte %" PRId64 "; expected a "
                         "length >= 0 at byte %" PRId64 ", right after the sequence before it (flatmoe reads data "
                         "sets whose sequences lie back to back, as IndexedDatasetBuilder writes them)",
                         idx, i, len, ptr, total * (int64_t)es);
        total += len;
        if (!s && total > FM_MEGATRON_MAX_TOKENS) /* total * es below stays inside int64 */
            s = fm_error(FM_ERR_FORMAT, "%s: the sequence lengths of sequences 0 .. %" PRIu64 " add up to %" PRId64
                         " tokens; expected at most 2^56 in one data set (the index is corrupt: build it again)",
                         idx, i, total);
    }
    munmap(im, (size_t)size);
    if (s) return s;
    if (total < 1) return fm_error(FM_ERR_FORMAT, "%s: the Megatron data set holds no tokens; expected at least one", idx);

    FM_TRY(open_regular(bin, "Megatron data", &fd, &size));
    if (size != total * (int64_t)es) {
        close(fd);
        return fm_error(FM_ERR_FORMAT, "%s: %" PRId64 " bytes, but its index %s describes %" PRId64 " %s tokens = %" PRId64
                        " bytes; the two files do not belong together or one is truncated: build them again",
                        bin, size, idx, total, type_name(p->type), total * (int64_t)es);
    }
    s = map_fd(fd, bin, (size_t)size, &p->map);
    close(fd);
    if (s) return s;
    p->map_bytes = (size_t)size;
    p->tokens = p->map;
    p->n = total;
    return check_ids(bin, p, vocab_size);
}

/* ---- llm.c shards and text ------------------------------------------------------------------ */

/* The first byte of buf past a UTF-8 byte order mark and white space, or 0. */
static char first_char(const unsigned char *buf, size_t n) {
    size_t i = n >= 3 && !memcmp(buf, "\xEF\xBB\xBF", 3) ? 3 : 0;
    while (i < n && (buf[i] == ' ' || buf[i] == '\t' || buf[i] == '\r' || buf[i] == '\n')) i++;
    return i < n ? (char)buf[i] : 0;
}

/* Whether a "text" file is JSON or JSONL (chat data that `flatmoe prepare` should tokenize,
 * issue 28): its first non-blank byte is '{' or '[' and either its name ends in .json / .jsonl
 * or its first non-blank line ends (white space aside) in '}' or ']'. */
static bool looks_like_json(const char *path, const unsigned char *buf, size_t n) {
    const char c = first_char(buf, n);
    if (c != '{' && c != '[') return false;
    if (ends_with(path, ".json") || ends_with(path, ".jsonl")) return true;
    const unsigned char *a = memchr(buf, c, n); /* the first line holding it */
    const unsigned char *nl = memchr(a, '\n', n - (size_t)(a - buf));
    const unsigned char *e = nl ? nl : buf + n;
    while (e > a && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r')) e--;
    return e > a && (e[-1] == '}' || e[-1] == ']');
}

fm_status fm_data_refuse_json(const char *path, const void *buf, size_t n) {
    const unsigned char *b = buf;
    if (!looks_like_json(path, b, n)) return FM_OK;
    /* prepare reads a file by its name's extension: another name needs --format jsonl */
    const bool named = ends_with(path, ".json") || ends_with(path, ".jsonl");
    return fm_error(FM_ERR_FORMAT, "%s: looks like JSON/JSONL (it starts with '%c'), not text to train on byte by "
                    "byte; tokenize it first with `flatmoe prepare --tokenizer MODEL_DIR --input %s%s --out PREFIX` "
                    "and pass --data PREFIX_000000.bin (docs/fine-tuning.md; if it is plain text that only starts "
                    "like JSON, prepare it with --format text)", path, first_char(b, n), path,
                    named ? "" : " --format jsonl");
}

static fm_status open_shard_or_text(const char *path, int64_t vocab_size, fm_data_part *p, fm_src_kind *kind,
                                    int *version) {
    int fd;
    int64_t size;
    FM_TRY(open_regular(path, "data file", &fd, &size));
    fm_status s = FM_OK;
    unsigned char *buf = NULL;
    if (size == 0) {
        s = fm_error(FM_ERR_FORMAT, "%s: empty file; expected byte-level text, an llm.c token shard or a Megatron "
                     ".bin/.idx pair, found 0 bytes; remove it from the data list", path);
        goto out;
    }
    const size_t sniff = size < (int64_t)SNIFF_BYTES ? (size_t)size : SNIFF_BYTES;
    unsigned char head[FM_SHARD_HEADER_BYTES] = {0};
    const size_t nh = sniff < sizeof head ? sniff : sizeof head;
    if ((s = pread_exact(fd, path, head, nh, 0))) goto out;
    const int32_t magic = (int32_t)le32(head);
    const bool is_magic = size >= 4 && (magic == FM_SHARD_MAGIC_V1 || magic == FM_SHARD_MAGIC_V7);
    if (is_magic && size < FM_SHARD_HEADER_BYTES) {
        s = fm_error(FM_ERR_FORMAT, "%s: truncated llm.c shard: starts with magic %d but has only %" PRId64
                     " bytes; expected at least the %d-byte header plus tokens; re-export or re-download it",
                     path, magic, size, FM_SHARD_HEADER_BYTES);
        goto out;
    }
    if (is_magic) {
        int32_t ver = (int32_t)le32(head + 4), count = (int32_t)le32(head + 8);
        int want_version = magic == FM_SHARD_MAGIC_V1 ? 1 : 7, tb = magic == FM_SHARD_MAGIC_V1 ? 2 : 4;
        if (ver != want_version) {
            s = fm_error(FM_ERR_FORMAT, "%s: llm.c shard with magic %d must have version %d (%s tokens) in header[1], "
                         "found version %d; the file is corrupt or from another tool: re-export it with version %d",
                         path, magic, want_version, tb == 2 ? "uint16" : "uint32", ver, want_version);
            goto out;
        }
        if (count <= 0) {
            s = fm_error(FM_ERR_FORMAT, "%s: llm.c shard header[2] (token count) is %d; expected > 0; the shard is "
                         "empty or corrupt: re-export it or drop it from the data list", path, count);
            goto out;
        }
        int64_t want = FM_SHARD_HEADER_BYTES + (int64_t)count * tb;
        if (size < want) {
            s = fm_error(FM_ERR_FORMAT, "%s: truncated llm.c shard: header says %d tokens of %d bytes, so the file "
                         "should be %" PRId64 " bytes, found %" PRId64 " (%" PRId64 " missing); re-export or "
                         "re-download it", path, count, tb, want, size, want - size);
            goto out;
        }
        if (size > want) {
            s = fm_error(FM_ERR_FORMAT, "%s: llm.c shard has %" PRId64 " trailing bytes: header says %d tokens of %d "
                         "bytes, so the file should be %" PRId64 " bytes, found %" PRId64 "; the header count is wrong "
                         "or data was appended: re-export it", path, size - want, count, tb, want, size);
            goto out;
        }
        if ((s = map_fd(fd, path, (size_t)size, &p->map))) goto out;
        p->map_bytes = (size_t)size;
        p->tokens = (const char *)p->map + FM_SHARD_HEADER_BYTES;
        p->type = tb == 2 ? FM_TOK_U16 : FM_TOK_U32;
        p->n = count;
        *kind = FM_SRC_SHARD;
        *version = want_version;
        s = check_ids(path, p, vocab_size);
        goto out;
    }
    /* text: read whole, then the NUL check over its first 64 KiB */
    if ((uint64_t)size > SIZE_MAX / 2 || !(buf = fm_malloc((size_t)size))) {
        s = fm_error(FM_ERR_NOMEM, "%s: cannot allocate %" PRId64 " bytes for a text file; tokenize it into shards "
                     "with `flatmoe prepare`", path, size);
        goto out;
    }
    if ((s = pread_exact(fd, path, buf, (size_t)size, 0))) goto out;
    const unsigned char *nul = memchr(buf, 0, sniff);
    if (nul) {
        s = fm_error(FM_ERR_FORMAT, "%s: not UTF-8 text and not an llm.c shard (first int32 = %d; expected magic %d or "
                     "%d); found a NUL byte at offset %td; pass a text file, an llm.c token shard or a Megatron "
                     "PREFIX", path, magic, FM_SHARD_MAGIC_V1, FM_SHARD_MAGIC_V7, nul - buf);
        goto out;
    }
    if ((s = fm_data_refuse_json(path, buf, (size_t)size))) goto out;
    p->heap = buf;
    buf = NULL;
    p->tokens = p->heap;
    p->type = FM_TOK_U8;
    p->n = size;
    *kind = FM_SRC_TEXT;
    *version = 0;
out:
    fm_free(buf);
    close(fd);
    return s;
}

fm_status fm_data_open_source(const char *path, int64_t vocab_size, fm_data_part *p, fm_src_kind *kind,
                              int *version, char *mask_path, size_t cap) {
    memset(p, 0, sizeof *p);
    mask_path[0] = 0;
    *version = 0;
    char prefix[4200];
    fm_status s;
    const bool mega = megatron_prefix(path, prefix, sizeof prefix);
    if (mega) {
        *kind = FM_SRC_MEGATRON;
        s = open_megatron(prefix, vocab_size, p);
    } else {
        s = open_shard_or_text(path, vocab_size, p, kind, version);
    }
    if (s == FM_OK && *kind != FM_SRC_TEXT) {
        find_mask(mega ? prefix : path, mega, mask_path, cap);
        if (mask_path[0]) s = open_mask(mask_path, path, p);
        char dpath[4200];
        if (!mega && s == FM_OK) {
            find_docs(path, dpath, sizeof dpath);
            if (dpath[0]) s = fm_docs_read(dpath, path, p->n, &p->doc_starts, &p->n_docs);
        }
    }
    if (s != FM_OK) fm_data_part_release(p);
    return s;
}
