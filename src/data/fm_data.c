/* Token data sources: see fm_data.h for the formats and the API contract. */
#define _FILE_OFFSET_BITS 64
#define _POSIX_C_SOURCE 200809L
#include "fm_data.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FM_DATA_CHUNK_BYTES ((size_t)1 << 20) /* read/write buffer */
#define FM_DATA_SNIFF_BYTES ((size_t)64 << 10) /* text files: NUL check over this prefix */

typedef enum { KIND_TEXT = 0, KIND_SHARD = 1 } file_kind;

typedef struct file_info {
    file_kind kind;
    int version;      /* shards: 1 or 7 */
    int token_bytes;  /* shards: 2 or 4; text: 1 */
    int64_t file_size;
    int64_t n_tokens;
} file_info;

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static void put_le32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

/* Opens `path` for reading and returns its size; the file must be a regular file. */
static fm_status open_regular(const char *path, FILE **out, int64_t *size) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return fm_error(FM_ERR_IO, "%s: cannot open data file: %s; check the path given to --data/--val-data",
                        path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        int e = errno;
        fclose(f);
        return fm_error(FM_ERR_IO, "%s: cannot stat data file: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        fclose(f);
        return fm_error(FM_ERR_IO, "%s: expected a regular file (text or llm.c shard), found %s; "
                        "pass the files themselves, not a directory or device",
                        path, S_ISDIR(st.st_mode) ? "a directory" : "a non-regular file");
    }
    *out = f;
    *size = (int64_t)st.st_size;
    return FM_OK;
}

/* Reads exactly n bytes or reports why not. */
static fm_status read_exact(FILE *f, const char *path, void *buf, size_t n, int64_t offset) {
    size_t got = fread(buf, 1, n, f);
    if (got == n) return FM_OK;
    if (ferror(f))
        return fm_error(FM_ERR_IO, "%s: read error at byte %" PRId64 ": %s", path, offset + (int64_t)got,
                        strerror(errno));
    return fm_error(FM_ERR_IO, "%s: file ended at byte %" PRId64 " while %zu more bytes were expected; "
                    "was it changed while loading?", path, offset + (int64_t)got, n - got);
}

/* Pass 1: detects the kind of one file and validates everything but the token ids.
 * buf must hold FM_DATA_SNIFF_BYTES. */
static fm_status probe_file(const char *path, unsigned char *buf, file_info *fi) {
    memset(fi, 0, sizeof *fi);
    FILE *f;
    int64_t size;
    FM_TRY(open_regular(path, &f, &size));
    fi->file_size = size;
    if (size == 0) {
        fclose(f);
        return fm_error(FM_ERR_FORMAT, "%s: empty file; expected byte-level text or an llm.c token shard, "
                        "found 0 bytes; remove it from the data list", path);
    }
    size_t sniff = size < (int64_t)FM_DATA_SNIFF_BYTES ? (size_t)size : FM_DATA_SNIFF_BYTES;
    fm_status s = read_exact(f, path, buf, sniff, 0);
    fclose(f);
    if (s != FM_OK) return s;

    unsigned char first4[4] = {0, 0, 0, 0};
    memcpy(first4, buf, sniff < 4 ? sniff : 4);
    int32_t magic = (int32_t)le32(first4);
    bool is_magic = magic == FM_SHARD_MAGIC_V1 || magic == FM_SHARD_MAGIC_V7;

    if (is_magic && size >= 4 && size < FM_SHARD_HEADER_BYTES)
        return fm_error(FM_ERR_FORMAT, "%s: truncated llm.c shard: starts with magic %d but has only %" PRId64
                        " bytes; expected at least the %d-byte header plus tokens; re-export or re-download it",
                        path, magic, size, FM_SHARD_HEADER_BYTES);

    if (is_magic) {
        int32_t version = (int32_t)le32(buf + 4);
        int32_t count = (int32_t)le32(buf + 8);
        int want_version = magic == FM_SHARD_MAGIC_V1 ? 1 : 7;
        int token_bytes = magic == FM_SHARD_MAGIC_V1 ? 2 : 4;
        if (version != want_version)
            return fm_error(FM_ERR_FORMAT, "%s: llm.c shard with magic %d must have version %d (%s tokens) "
                            "in header[1], found version %d; the file is corrupt or from another tool: "
                            "re-export it with version %d",
                            path, magic, want_version, token_bytes == 2 ? "uint16" : "uint32", version,
                            want_version);
        if (count <= 0)
            return fm_error(FM_ERR_FORMAT, "%s: llm.c shard header[2] (token count) is %d; expected > 0; "
                            "the shard is empty or corrupt: re-export it or drop it from the data list",
                            path, count);
        int64_t want = FM_SHARD_HEADER_BYTES + (int64_t)count * token_bytes;
        if (size < want)
            return fm_error(FM_ERR_FORMAT, "%s: truncated llm.c shard: header says %d tokens of %d bytes, so "
                            "the file should be %" PRId64 " bytes, found %" PRId64 " (%" PRId64 " missing); "
                            "re-export or re-download it",
                            path, count, token_bytes, want, size, want - size);
        if (size > want)
            return fm_error(FM_ERR_FORMAT, "%s: llm.c shard has %" PRId64 " trailing bytes: header says %d "
                            "tokens of %d bytes, so the file should be %" PRId64 " bytes, found %" PRId64 "; "
                            "the header count is wrong or data was appended: re-export it",
                            path, size - want, count, token_bytes, want, size);
        fi->kind = KIND_SHARD;
        fi->version = want_version;
        fi->token_bytes = token_bytes;
        fi->n_tokens = count;
        return FM_OK;
    }

    const unsigned char *nul = memchr(buf, 0, sniff);
    if (nul)
        return fm_error(FM_ERR_FORMAT, "%s: not UTF-8 text and not an llm.c shard (first int32 = %d; expected "
                        "magic %d or %d); found a NUL byte at offset %td; pass a text file or an llm.c "
                        "token shard",
                        path, magic, FM_SHARD_MAGIC_V1, FM_SHARD_MAGIC_V7, nul - buf);
    fi->kind = KIND_TEXT;
    fi->version = 0;
    fi->token_bytes = 1;
    fi->n_tokens = size;
    return FM_OK;
}

/* Pass 2: reads one probed file's tokens into dst[0 .. fi->n_tokens). buf holds
 * FM_DATA_CHUNK_BYTES. */
static fm_status read_file_tokens(const char *path, const file_info *fi, int64_t vocab_size,
                                  unsigned char *buf, int32_t *dst) {
    FILE *f;
    int64_t size;
    FM_TRY(open_regular(path, &f, &size));
    fm_status s = FM_OK;
    if (size != fi->file_size) {
        s = fm_error(FM_ERR_IO, "%s: file size changed while loading (%" PRId64 " bytes, then %" PRId64 "); "
                     "do not write data files during a run", path, fi->file_size, size);
        goto done;
    }
    int64_t offset = 0;
    if (fi->kind == KIND_SHARD) {
        if (fseeko(f, FM_SHARD_HEADER_BYTES, SEEK_SET) != 0) {
            s = fm_error(FM_ERR_IO, "%s: cannot seek past the shard header: %s", path, strerror(errno));
            goto done;
        }
        offset = FM_SHARD_HEADER_BYTES;
    }
    const int tb = fi->token_bytes;
    const int64_t per_chunk = (int64_t)(FM_DATA_CHUNK_BYTES / (size_t)tb);
    for (int64_t i0 = 0; i0 < fi->n_tokens; i0 += per_chunk) {
        int64_t n = fi->n_tokens - i0 < per_chunk ? fi->n_tokens - i0 : per_chunk;
        s = read_exact(f, path, buf, (size_t)n * (size_t)tb, offset);
        if (s != FM_OK) goto done;
        offset += n * tb;
        if (tb == 1) {
            for (int64_t i = 0; i < n; i++) dst[i0 + i] = (int32_t)buf[i];
            continue; /* bytes < 256 <= vocab_size, checked by the caller */
        }
        for (int64_t i = 0; i < n; i++) {
            const unsigned char *p = buf + i * tb;
            uint32_t id = tb == 2 ? ((uint32_t)p[0] | ((uint32_t)p[1] << 8)) : le32(p);
            if ((int64_t)id >= vocab_size) {
                s = fm_error(FM_ERR_FORMAT, "%s: token %" PRId64 " (0-based) has id %" PRIu32 ", but vocab_size "
                             "is %" PRId64 "; expected ids < vocab_size: tokenize with this model's tokenizer "
                             "or use a config with a larger vocab_size",
                             path, i0 + i, id, vocab_size);
                goto done;
            }
            dst[i0 + i] = (int32_t)id;
        }
    }
done:
    fclose(f);
    return s;
}

fm_status fm_dataset_load(fm_dataset *ds, const char *const *paths, int n_paths, int64_t vocab_size) {
    FM_ASSERT(ds != NULL);
    memset(ds, 0, sizeof *ds);
    if (n_paths <= 0 || paths == NULL)
        return fm_error(FM_ERR_ARG, "data: no files given (n_paths = %d); expected at least one text file or "
                        "llm.c shard: pass --data PATH", n_paths);
    if (vocab_size < 1 || vocab_size > ((int64_t)1 << 31))
        return fm_error(FM_ERR_ARG, "data: vocab_size is %" PRId64 "; expected 1 .. 2^31; check the model "
                        "config's vocab_size", vocab_size);

    file_info *info = fm_malloc(sizeof(file_info) * (size_t)n_paths);
    unsigned char *buf = fm_malloc(FM_DATA_CHUNK_BYTES);
    if (!info || !buf) {
        fm_free(info);
        fm_free(buf);
        return fm_error(FM_ERR_NOMEM, "data: cannot allocate %zu bytes of loader buffers for %d files",
                        FM_DATA_CHUNK_BYTES + sizeof(file_info) * (size_t)n_paths, n_paths);
    }

    fm_status s = FM_OK;
    int32_t *tokens = NULL;
    int64_t total = 0;
    int n_v1 = 0, n_v7 = 0;
    for (int i = 0; i < n_paths; i++) {
        if (!paths[i]) {
            s = fm_error(FM_ERR_ARG, "data: file %d of %d is NULL; expected a path", i + 1, n_paths);
            goto fail;
        }
        s = probe_file(paths[i], buf, &info[i]);
        if (s != FM_OK) goto fail;
        if (info[i].kind != info[0].kind) {
            int t = info[i].kind == KIND_TEXT ? i : 0, sh = info[i].kind == KIND_TEXT ? 0 : i;
            s = fm_error(FM_ERR_ARG, "data: cannot mix byte-level text and llm.c shards: %s is text but %s is "
                         "an llm.c shard; expected every file of one data set to be the same kind: tokenize "
                         "the text into shards or pass only text files",
                         paths[t], paths[sh]);
            goto fail;
        }
        if (info[i].kind == KIND_TEXT && vocab_size < 256) {
            s = fm_error(FM_ERR_ARG, "%s: byte-level text needs vocab_size >= 256 (one token per byte), but "
                         "vocab_size is %" PRId64 "; use a config with vocab_size >= 256 or tokenize the "
                         "text into llm.c shards", paths[i], vocab_size);
            goto fail;
        }
        if (info[i].version == 1) n_v1++;
        if (info[i].version == 7) n_v7++;
        total += info[i].n_tokens;
    }
    if ((uint64_t)total > SIZE_MAX / sizeof(int32_t)) {
        s = fm_error(FM_ERR_NOMEM, "data: %" PRId64 " tokens do not fit in host memory on this platform", total);
        goto fail;
    }
    tokens = fm_malloc((size_t)total * sizeof(int32_t));
    if (!tokens) {
        s = fm_error(FM_ERR_NOMEM, "data: cannot allocate %" PRId64 " bytes for %" PRId64 " tokens from %d "
                     "file(s); use fewer or smaller data files", total * (int64_t)sizeof(int32_t), total,
                     n_paths);
        goto fail;
    }
    int64_t at = 0;
    for (int i = 0; i < n_paths; i++) {
        s = read_file_tokens(paths[i], &info[i], vocab_size, buf, tokens + at);
        if (s != FM_OK) goto fail;
        at += info[i].n_tokens;
    }
    FM_ASSERT(at == total);

    ds->tokens = tokens;
    ds->n_tokens = total;
    ds->owns = true;
    if (info[0].kind == KIND_TEXT)
        snprintf(ds->desc, sizeof ds->desc, "%d text file%s, %" PRId64 " tokens (bytes)", n_paths,
                 n_paths == 1 ? "" : "s", total);
    else
        snprintf(ds->desc, sizeof ds->desc, "%d llm.c shard%s (%s), %" PRId64 " tokens", n_paths,
                 n_paths == 1 ? "" : "s",
                 n_v7 == 0 ? "v1 uint16" : n_v1 == 0 ? "v7 uint32" : "v1 uint16 + v7 uint32", total);
    fm_free(info);
    fm_free(buf);
    return FM_OK;

fail:
    fm_free(tokens);
    fm_free(info);
    fm_free(buf);
    memset(ds, 0, sizeof *ds);
    return s;
}

/* Copies src into dst[256] with a prefix, truncating src as needed without compiler warnings. */
static void view_desc(char *dst, size_t cap, const char *what, int64_t n, const char *src) {
    int k = snprintf(dst, cap, "%s of %" PRId64 " tokens from ", what, n);
    if (k < 0 || (size_t)k >= cap) return;
    size_t room = cap - (size_t)k - 1, len = strlen(src);
    if (len > room) len = room;
    memcpy(dst + k, src, len);
    dst[(size_t)k + len] = '\0';
}

fm_status fm_dataset_split(const fm_dataset *all, double val_fraction, fm_dataset *train, fm_dataset *val) {
    FM_ASSERT(all && train && val);
    if (!(val_fraction > 0.0 && val_fraction < 1.0))
        return fm_error(FM_ERR_ARG, "validation fraction is %g; expected a value in (0, 1), e.g. 0.1; "
                        "or pass --val-data", val_fraction);
    int64_t n = all->n_tokens;
    int64_t n_val = (int64_t)llround((double)n * val_fraction);
    int64_t n_train = n - n_val;
    if (n_val < 1 || n_train < 1)
        return fm_error(FM_ERR_ARG, "data: splitting %" PRId64 " tokens with validation fraction %g leaves "
                        "%" PRId64 " training and %" PRId64 " validation tokens; expected both > 0: "
                        "use more data, another fraction, or pass --val-data",
                        n, val_fraction, n_train, n_val);
    fm_dataset t = {.tokens = all->tokens, .n_tokens = n_train, .owns = false};
    fm_dataset v = {.tokens = all->tokens + n_train, .n_tokens = n_val, .owns = false};
    view_desc(t.desc, sizeof t.desc, "train split", n_train, all->desc);
    view_desc(v.desc, sizeof v.desc, "validation split", n_val, all->desc);
    *train = t;
    *val = v;
    return FM_OK;
}

fm_status fm_dataset_check_windows(const fm_dataset *ds, int64_t seq_len, const char *what) {
    FM_ASSERT(ds != NULL);
    if (!what) what = "data";
    if (seq_len < 1)
        return fm_error(FM_ERR_ARG, "--seq-len is %" PRId64 "; expected >= 1", seq_len);
    if (ds->n_tokens < seq_len + 1)
        return fm_error(FM_ERR_ARG, "%s: %" PRId64 " tokens, but --seq-len %" PRId64 " needs at least %" PRId64
                        "; use a shorter --seq-len or more data", what, ds->n_tokens, seq_len, seq_len + 1);
    return FM_OK;
}

void fm_dataset_sample_batch(const fm_dataset *ds, fm_rng *rng, int64_t B, int64_t T,
                             int32_t *inputs, int32_t *targets) {
    FM_ASSERT(ds && rng && inputs && targets);
    FM_ASSERT(B >= 1 && T >= 1);
    FM_ASSERT(ds->n_tokens >= T + 1);
    const uint64_t n_starts = (uint64_t)(ds->n_tokens - T); /* s in [0, n_tokens - T - 1] */
    for (int64_t b = 0; b < B; b++) {
        int64_t s = (int64_t)fm_rng_below(rng, n_starts);
        const int32_t *src = ds->tokens + s;
        memcpy(inputs + b * T, src, (size_t)T * sizeof(int32_t));
        memcpy(targets + b * T, src + 1, (size_t)T * sizeof(int32_t));
    }
}

int64_t fm_dataset_eval_windows(const fm_dataset *ds, int64_t T) {
    FM_ASSERT(ds != NULL && T >= 1);
    if (ds->n_tokens < 1) return 0;
    return (ds->n_tokens - 1) / T;
}

void fm_dataset_eval_batch(const fm_dataset *ds, int64_t first_window, int64_t B, int64_t T,
                           int32_t *inputs, int32_t *targets, int64_t *n_filled) {
    FM_ASSERT(ds && inputs && targets && n_filled);
    FM_ASSERT(B >= 1 && T >= 1 && first_window >= 0);
    int64_t nw = fm_dataset_eval_windows(ds, T);
    int64_t rows = 0;
    for (int64_t w = first_window; w < nw && rows < B; w++, rows++) {
        const int32_t *src = ds->tokens + w * T;
        memcpy(inputs + rows * T, src, (size_t)T * sizeof(int32_t));
        memcpy(targets + rows * T, src + 1, (size_t)T * sizeof(int32_t));
    }
    *n_filled = rows;
}

void fm_dataset_free(fm_dataset *ds) {
    if (!ds) return;
    if (ds->owns) fm_free(ds->tokens);
    memset(ds, 0, sizeof *ds);
}

/* Writes n bytes, consulting fault injection first. */
static fm_status write_bytes(FILE *f, const char *tmp, const void *p, size_t n) {
    if (fm_fault_hit())
        return fm_error(FM_ERR_IO, "%s: write failed: injected fault (fm_fault_set)", tmp);
    if (fwrite(p, 1, n, f) != n)
        return fm_error(FM_ERR_IO, "%s: write of %zu bytes failed: %s; check free disk space and permissions",
                        tmp, n, strerror(errno));
    return FM_OK;
}

fm_status fm_shard_write(const char *path, const int32_t *tokens, int64_t n, int version) {
    FM_ASSERT(path != NULL);
    if (version != 1 && version != 7)
        return fm_error(FM_ERR_ARG, "%s: llm.c shard version %d; expected 1 (uint16 tokens) or 7 (uint32 "
                        "tokens)", path, version);
    if (n < 1 || n > INT32_MAX)
        return fm_error(FM_ERR_ARG, "%s: %" PRId64 " tokens; an llm.c shard holds 1 .. %d tokens (int32 count "
                        "in header[2]): split the data over several shards", path, n, INT32_MAX);
    FM_ASSERT(tokens != NULL);
    const int64_t max_id = version == 1 ? 65535 : INT32_MAX;
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] > max_id)
            return fm_error(FM_ERR_ARG, "%s: token %" PRId64 " has id %" PRId32 "; a version %d shard holds ids "
                            "0 .. %" PRId64 "%s", path, i, tokens[i], version, max_id,
                            version == 1 ? ": write version 7 for larger vocabularies" : "");

    size_t plen = strlen(path);
    char *tmp = fm_malloc(plen + 5);
    unsigned char *buf = fm_malloc(FM_DATA_CHUNK_BYTES);
    if (!tmp || !buf) {
        fm_free(tmp);
        fm_free(buf);
        return fm_error(FM_ERR_NOMEM, "%s: cannot allocate shard write buffers", path);
    }
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp", 5);

    fm_status s = FM_OK;
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        s = fm_error(FM_ERR_IO, "%s: cannot create: %s; check that the folder exists and is writable", tmp,
                     strerror(errno));
        goto out;
    }
    memset(buf, 0, FM_SHARD_HEADER_BYTES);
    put_le32(buf + 0, (uint32_t)(version == 1 ? FM_SHARD_MAGIC_V1 : FM_SHARD_MAGIC_V7));
    put_le32(buf + 4, (uint32_t)version);
    put_le32(buf + 8, (uint32_t)n);
    s = write_bytes(f, tmp, buf, FM_SHARD_HEADER_BYTES);
    const int tb = version == 1 ? 2 : 4;
    const int64_t per_chunk = (int64_t)(FM_DATA_CHUNK_BYTES / (size_t)tb);
    for (int64_t i0 = 0; s == FM_OK && i0 < n; i0 += per_chunk) {
        int64_t m = n - i0 < per_chunk ? n - i0 : per_chunk;
        for (int64_t i = 0; i < m; i++) {
            uint32_t id = (uint32_t)tokens[i0 + i];
            unsigned char *p = buf + i * tb;
            if (tb == 2) {
                p[0] = (unsigned char)id;
                p[1] = (unsigned char)(id >> 8);
            } else {
                put_le32(p, id);
            }
        }
        s = write_bytes(f, tmp, buf, (size_t)m * (size_t)tb);
    }
    if (s == FM_OK && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        s = fm_error(FM_ERR_IO, "%s: flush failed: %s; check free disk space", tmp, strerror(errno));
    if (fclose(f) != 0 && s == FM_OK)
        s = fm_error(FM_ERR_IO, "%s: close failed: %s; check free disk space", tmp, strerror(errno));
    if (s == FM_OK && rename(tmp, path) != 0)
        s = fm_error(FM_ERR_IO, "%s: cannot rename %s to it: %s", path, tmp, strerror(errno));
    if (s != FM_OK) remove(tmp);
out:
    fm_free(tmp);
    fm_free(buf);
    return s;
}
