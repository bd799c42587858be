/* What the data files share (not a public API):
 *   fm_data.c        the data set: loading a list, views, windows and the cursor
 *   fm_data_files.c  one source: text, an llm.c shard or a Megatron data set, and its mask
 *   fm_data_write.c  writing shards and masks
 *   fm_docs.c        document indexes: the FMDOCS01 sidecar, the data set's document table */
#ifndef FM_DATA_INTERNAL_H
#define FM_DATA_INTERNAL_H

#include "fm_data.h"

/* What one source is. */
typedef enum { FM_SRC_TEXT = 0, FM_SRC_SHARD = 1, FM_SRC_MEGATRON = 2 } fm_src_kind;

/* Opens the data source `path` into *p (start left 0): text read into p->heap, a shard or a
 * Megatron data set (path = PREFIX, PREFIX.bin or PREFIX.idx) mapped, its token ids checked
 * against vocab_size (text: vocab_size >= 256 is the caller's check), and its mask sidecar, if
 * any, mapped and checked. *kind gets the source's kind, *version the shard version (1 or 7;
 * 0 otherwise), *mask_path (cap bytes) the mask file used, "" when none. On error nothing is
 * left open. Errors: as fm_dataset_load's, naming the file. */
fm_status fm_data_open_source(const char *path, int64_t vocab_size, fm_data_part *p, fm_src_kind *kind,
                              int *version, char *mask_path, size_t cap);

/* Releases what one part holds (maps, heap) and zeroes it. */
void fm_data_part_release(fm_data_part *p);

/* Drops the pages holding tokens [i0, i0 + n) of a mapped part (and their mask bytes) from the
 * process's RSS (madvise MADV_DONTNEED over the 2 MiB blocks around them; they stay in the page
 * cache). No-op for parts that are not mapped. */
void fm_data_part_drop(const fm_data_part *p, int64_t i0, int64_t n);

/* Reads the document index `path` beside data_path (a part of n_tokens tokens) into *starts
 * (fm_malloc'd [*n_docs]). Errors: FM_ERR_IO, FM_ERR_FORMAT (magic, token count, document count,
 * truncation, trailing bytes, starts out of order or range; each naming the file and the fix),
 * FM_ERR_NOMEM. */
fm_status fm_docs_read(const char *path, const char *data_path, int64_t n_tokens, int64_t **starts, int64_t *n_docs);

/* Checks n_docs starts of an index for n_tokens tokens (fm_data.h); `what` names it. FM_ERR_FORMAT. */
fm_status fm_docs_check(const char *what, const int64_t *starts, int64_t n_docs, int64_t n_tokens);

/* ds->docs from its parts' indexes (none when no part has one). FM_ERR_NOMEM. */
fm_status fm_dataset_build_docs(fm_dataset *ds);

/* v's own document table: all's documents within the view v (begin and n_tokens set). FM_ERR_NOMEM. */
fm_status fm_dataset_view_docs(const fm_dataset *all, fm_dataset *v);

/* Bytes per element of a token type. */
size_t fm_token_type_size(int type);

#endif
