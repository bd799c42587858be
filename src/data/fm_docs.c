/* Document indexes (fm_data.h "Document index"): the FMDOCS01 sidecar beside an llm.c shard,
 * written by `flatmoe prepare` and read with its shard, and the data set's document table built
 * from the parts' indexes (Megatron data sets bring theirs in the .idx, fm_data_files.c). */
#include "fm_data_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "../io/fm_atomic.h"

static uint64_t get_le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static void put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

fm_status fm_docs_check(const char *what, const int64_t *starts, int64_t n_docs, int64_t n_tokens) {
    if (n_docs < 1)
        return fm_error(FM_ERR_FORMAT, "%s: a document index of %" PRId64 " documents; expected at least one", what,
                        n_docs);
    for (int64_t d = 0; d < n_docs; d++) {
        const int64_t lo = d == 0 ? 0 : starts[d - 1] + 1;
        if ((d == 0 && starts[0] != 0) || starts[d] < lo || starts[d] >= n_tokens)
            return fm_error(FM_ERR_FORMAT, "%s: document %" PRId64 " starts at token %" PRId64 "; expected %s (the "
                            "starts increase from 0 and stay below the %" PRId64 " tokens of the data): the index "
                            "belongs to another version of the data: prepare both again", what, d, starts[d],
                            d == 0 ? "0" : "a start after the previous one", n_tokens);
    }
    return FM_OK;
}

fm_status fm_docs_write(const char *path, const int64_t *starts, int64_t n_docs, int64_t n_tokens) {
    FM_ASSERT(path && starts);
    FM_TRY(fm_docs_check(path, starts, n_docs, n_tokens));
    unsigned char hdr[FM_DOCS_HEADER_BYTES];
    memcpy(hdr, FM_DOCS_MAGIC, 8);
    put_le64(hdr + 8, (uint64_t)n_tokens);
    put_le64(hdr + 16, (uint64_t)n_docs);
    fm_atomic_file f;
    FM_TRY(fm_atomic_open(&f, path));
    FM_TRY(fm_atomic_write(&f, hdr, sizeof hdr)); /* a failed write aborts the file */
    unsigned char buf[8 * 512];
    for (int64_t d0 = 0; d0 < n_docs; d0 += 512) {
        const int64_t k = n_docs - d0 < 512 ? n_docs - d0 : 512;
        for (int64_t i = 0; i < k; i++) put_le64(buf + 8 * i, (uint64_t)starts[d0 + i]);
        FM_TRY(fm_atomic_write(&f, buf, (size_t)(8 * k)));
    }
    return fm_atomic_commit(&f);
}

fm_status fm_docs_read(const char *path, const char *data_path, int64_t n_tokens, int64_t **starts, int64_t *n_docs) {
    *starts = NULL;
    *n_docs = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return fm_error(FM_ERR_IO, "%s: cannot open the document index: %s", path, strerror(errno));
    unsigned char hdr[FM_DOCS_HEADER_BYTES];
    fm_status s = FM_OK;
    int64_t *st = NULL;
    uint64_t nt = 0, nd = 0;
    if (fread(hdr, 1, sizeof hdr, f) != sizeof hdr || memcmp(hdr, FM_DOCS_MAGIC, 8) != 0) {
        s = fm_error(FM_ERR_FORMAT, "%s: not a document index: expected the %d-byte header starting \"%s\"; it sits "
                     "next to %s as its index: write it again with `flatmoe prepare`, or move it away to train without "
                     "document boundaries", path, FM_DOCS_HEADER_BYTES, FM_DOCS_MAGIC, data_path);
        goto out;
    }
    nt = get_le64(hdr + 8);
    nd = get_le64(hdr + 16);
    if ((int64_t)nt != n_tokens) {
        s = fm_error(FM_ERR_FORMAT, "%s: document index for %" PRIu64 " tokens, but %s holds %" PRId64 "; expected "
                     "the same count: the index belongs to another version of the data: prepare both again", path, nt,
                     data_path, n_tokens);
        goto out;
    }
    if (nd < 1 || nd > (uint64_t)n_tokens) {
        s = fm_error(FM_ERR_FORMAT, "%s: %" PRIu64 " documents in %" PRId64 " tokens; expected 1 .. the token count",
                     path, nd, n_tokens);
        goto out;
    }
    st = fm_malloc(sizeof(int64_t) * (size_t)nd);
    if (!st) {
        s = fm_error(FM_ERR_NOMEM, "%s: out of memory for %" PRIu64 " document starts", path, nd);
        goto out;
    }
    unsigned char buf[8 * 512];
    for (uint64_t d0 = 0; d0 < nd && !s; d0 += 512) {
        const uint64_t k = nd - d0 < 512 ? nd - d0 : 512;
        if (fread(buf, 8, (size_t)k, f) != (size_t)k) {
            s = fm_error(FM_ERR_FORMAT, "%s: truncated: %" PRIu64 " document starts announced, the file ends before "
                         "start %" PRIu64 "; prepare the data again", path, nd, d0);
            break;
        }
        for (uint64_t i = 0; i < k; i++) st[d0 + i] = (int64_t)get_le64(buf + 8 * i);
    }
    if (!s && fgetc(f) != EOF)
        s = fm_error(FM_ERR_FORMAT, "%s: trailing bytes after the %" PRIu64 " document starts; expected %" PRIu64
                     " bytes in all: prepare the data again", path, nd, (uint64_t)FM_DOCS_HEADER_BYTES + 8 * nd);
    if (!s) s = fm_docs_check(path, st, (int64_t)nd, n_tokens);
out:
    fclose(f);
    if (s) fm_free(st);
    else {
        *starts = st;
        *n_docs = (int64_t)nd;
    }
    return s;
}

fm_status fm_dataset_build_docs(fm_dataset *ds) {
    int64_t total = 0;
    bool any = false;
    for (int i = 0; i < ds->n_parts; i++) {
        const fm_data_part *p = &ds->parts[i];
        any |= p->doc_starts != NULL;
        total += p->doc_starts ? p->n_docs : 1; /* a part without an index: one document */
    }
    if (!any) return FM_OK;
    ds->docs = fm_malloc(sizeof(int64_t) * (size_t)total);
    if (!ds->docs) return fm_error(FM_ERR_NOMEM, "data: out of memory for %" PRId64 " document starts", total);
    int64_t k = 0;
    for (int i = 0; i < ds->n_parts; i++) {
        const fm_data_part *p = &ds->parts[i];
        if (!p->doc_starts) ds->docs[k++] = p->start;
        else
            for (int64_t d = 0; d < p->n_docs; d++) ds->docs[k++] = p->start + p->doc_starts[d];
    }
    ds->n_docs = total;
    ds->docs_owned = true;
    return FM_OK;
}

fm_status fm_dataset_view_docs(const fm_dataset *all, fm_dataset *v) {
    v->docs = NULL;
    v->n_docs = 0;
    v->docs_owned = false;
    if (!all->docs) return FM_OK;
    /* all's documents in [v->begin, v->begin + n) (all's coordinates start at all->begin), plus a
     * document at the view's first token when one runs into it */
    const int64_t lo = v->begin - all->begin, hi = lo + v->n_tokens;
    int64_t n = 0;
    for (int64_t d = 0; d < all->n_docs; d++) n += all->docs[d] > lo && all->docs[d] < hi;
    v->docs = fm_malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!v->docs) return fm_error(FM_ERR_NOMEM, "data: out of memory for %" PRId64 " document starts", n + 1);
    int64_t k = 0;
    v->docs[k++] = 0;
    for (int64_t d = 0; d < all->n_docs; d++)
        if (all->docs[d] > lo && all->docs[d] < hi) v->docs[k++] = all->docs[d] - lo;
    v->n_docs = k;
    v->docs_owned = true;
    return FM_OK;
}

int64_t fm_dataset_doc_len(const fm_dataset *ds, int64_t d) {
    FM_ASSERT(ds->docs && d >= 0 && d < ds->n_docs);
    return (d + 1 < ds->n_docs ? ds->docs[d + 1] : ds->n_tokens) - ds->docs[d];
}
