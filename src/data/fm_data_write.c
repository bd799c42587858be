/* Writing llm.c shards and loss-mask sidecars (formats: fm_data.h). */
#define _FILE_OFFSET_BITS 64
#define _POSIX_C_SOURCE 200809L
#include "../io/fm_atomic.h"
#include "fm_data_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define FM_DATA_CHUNK_BYTES ((size_t)1 << 20) /* write buffer */

static void put_le32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
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

fm_status fm_mask_write(const char *path, const uint8_t *mask, int64_t n) {
    FM_ASSERT(path != NULL);
    if (n < 1) return fm_error(FM_ERR_ARG, "%s: a loss mask of %" PRId64 " tokens; expected >= 1", path, n);
    FM_ASSERT(mask != NULL);
    for (int64_t i = 0; i < n; i++)
        if (mask[i] > 1)
            return fm_error(FM_ERR_ARG, "%s: mask byte %" PRId64 " is %u; expected 0 (not a loss target) or 1", path, i,
                            (unsigned)mask[i]);
    /* header, then the bytes: the atomic writer's temporary name, fsync, rename and fault points */
    unsigned char hdr[FM_MASK_HEADER_BYTES];
    memcpy(hdr, FM_MASK_MAGIC, 8);
    put_le32(hdr + 8, (uint32_t)(uint64_t)n);
    put_le32(hdr + 12, (uint32_t)((uint64_t)n >> 32));
    fm_atomic_file f;
    FM_TRY(fm_atomic_open(&f, path));
    FM_TRY(fm_atomic_write(&f, hdr, sizeof hdr)); /* a failed write aborts the file */
    FM_TRY(fm_atomic_write(&f, mask, (size_t)n));
    return fm_atomic_commit(&f);
}
