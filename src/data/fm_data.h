/* Token data sources (DESIGN.md §7): byte-level text, llm.c token shards and Megatron-LM indexed
 * datasets, with optional per-token loss masks; random training windows drawn by a rank-aware
 * cursor and sequential evaluation windows.
 *
 * Formats, detected per file (fm_data_files.c reads them):
 *   llm.c shard: a file of >= 1024 bytes whose first little-endian int32 is a magic number.
 *     Header: 256 little-endian int32. header[0] = magic, header[1] = version, header[2] = token
 *     count. Magic 20240520 goes with version 1 and uint16 tokens; magic 20240801 with version 7
 *     and uint32 tokens. The tokens (little-endian) start at byte 1024 and fill the file exactly.
 *     Memory-mapped read-only (no copy of the corpus in RAM).
 *   Megatron-LM indexed dataset ("MMIDIDX", megatron/core/datasets/indexed_dataset.py): given as
 *     PREFIX, PREFIX.bin or PREFIX.idx. PREFIX.idx: 9 bytes "MMIDIDX\0\0", uint64 version 1,
 *     uint8 dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
 *     8 uint16; the float codes are refused: they hold no token ids), uint64 number of sequences
 *     S, uint64 number of document indices D, int32 sizes[S] (tokens per sequence), int64
 *     pointers[S] (byte offsets into PREFIX.bin), int64 doc_idx[D] (optionally int8 modes[S]
 *     after it, ignored). The sequences must lie back to back from byte 0 (as Megatron's
 *     IndexedDatasetBuilder writes them); their tokens, in order, are the data set's. PREFIX.bin
 *     is memory-mapped.
 *   byte-level text: anything else without NUL bytes in its first 64 KiB; each byte is one token
 *     0..255 (the model's vocab_size must be at least 256). Read into memory (text is small).
 *
 * Loss masks: a shard or Megatron data set may have a sidecar mask file, looked up as P.mask for
 * a shard P (e.g. data_000000.bin.mask), else P with its ".bin" replaced by ".mask"
 * (data_000000.mask); for a Megatron PREFIX: PREFIX.mask, else PREFIX.bin.mask. Format: 8 bytes
 * "FMMASK01", uint64 little-endian n_tokens (must equal the tokens of its file), then n_tokens
 * bytes, each 0 or 1: byte i = 1 if token i is a loss target when it appears as a target, 0 if
 * not. A target whose mask byte is 0 is written as FM_IGNORE_INDEX (-100), which the loss skips
 * (the mean is over the valid targets). Files without a mask: every target counts.
 *
 * Document index (issue 28): a shard P may have a sidecar P.docs (else P with ".bin" replaced by
 * ".docs"), written by `flatmoe prepare`: 8 bytes "FMDOCS01" (the format's version is its last
 * two characters), uint64 little-endian n_tokens (must equal its shard's), uint64 n_docs (1 ..
 * n_tokens), then n_docs uint64 start offsets: token index of each document's first token,
 * strictly increasing from 0, each < n_tokens (document d spans [start d, start d+1), the last
 * to the end). Every field is checked on read. A Megatron data set's documents are its own:
 * doc_idx groups its sequences into documents (document d: sequences doc_idx[d] ..
 * doc_idx[d+1]-1; doc_idx must start at 0, not decrease and end at the sequence count), as
 * Megatron's GPTDataset reads them. Text files have none. In a data set where some part has an
 * index, a part without one is one document. The data set's table (docs) holds every
 * document's first token in its own coordinates (fm_dataset_doc_len gives lengths); the packer
 * (fm_pack.h) fills rows with whole documents from it.
 *
 * The files of one data set are concatenated in the order given; a window may span two files.
 * Batches are row-major [B, T] int32: row b, position t at index b*T + t. targets[b][t] is the
 * token after inputs[b][t] in the data (or -100 where masked).
 *
 * Memory: mapped files cost no RSS when loaded: the load checks every token id (and mask byte)
 * in 64 MiB pieces and drops each piece from the process's page tables after checking it
 * (madvise MADV_DONTNEED; the pages stay in the page cache). Windows drawn later bring their pages
 * back as file-backed, reclaimable memory. A mapped file must not be truncated during a run
 * (reads past its new end raise SIGBUS).
 */
#ifndef FM_DATA_H
#define FM_DATA_H

#include "../core/fm_core.h"
#include "../core/fm_rng.h"

#ifdef __cplusplus
extern "C" {
#endif

/* llm.c shard constants. */
#define FM_SHARD_HEADER_INTS 256
#define FM_SHARD_HEADER_BYTES 1024
#define FM_SHARD_MAGIC_V1 20240520 /* version 1, uint16 tokens */
#define FM_SHARD_MAGIC_V7 20240801 /* version 7, uint32 tokens */

/* Document-index sidecar constants. */
#define FM_DOCS_MAGIC "FMDOCS01"
#define FM_DOCS_HEADER_BYTES 24

/* Loss-mask sidecar constants. */
#define FM_MASK_MAGIC "FMMASK01"
#define FM_MASK_HEADER_BYTES 16
#define FM_IGNORE_INDEX (-100) /* a target the loss skips (Hugging Face's ignore_index) */

/* Element type of a part's tokens. */
typedef enum fm_token_type {
    FM_TOK_U8 = 0, FM_TOK_I8, FM_TOK_U16, FM_TOK_I16, FM_TOK_U32, FM_TOK_I32, FM_TOK_I64
} fm_token_type;

/* One file's tokens (or a caller's array) inside a data set. */
typedef struct fm_data_part {
    const void *tokens;     /* [n] little-endian elements of `type` (in a map, the heap, or the caller's) */
    int type;               /* fm_token_type */
    int64_t start;          /* index of its first token in the data set's concatenation */
    int64_t n;              /* tokens */
    const uint8_t *mask;    /* [n] bytes 0/1, or NULL: every target counts */
    void *map;              /* mmap of the token file (NULL: none) */
    size_t map_bytes;
    void *mask_map;         /* mmap of the mask file (NULL: none) */
    size_t mask_map_bytes;
    void *heap;             /* tokens read into memory (text), freed with the data set */
    int64_t *doc_starts;    /* [n_docs] heap: its documents' first tokens (part-local), or NULL: no index */
    int64_t n_docs;
} fm_data_part;

typedef struct fm_dataset {
    fm_data_part *parts;  /* [n_parts], in data order; shared with views */
    int n_parts;
    int64_t begin;        /* this data set's first token in the parts' concatenation (views: > 0) */
    int64_t n_tokens;     /* number of tokens */
    bool owns;            /* true: the parts (maps, heap tokens, the array) are released by
                             fm_dataset_free; false: a view (fm_dataset_split) of a data set that
                             must outlive it */
    bool has_mask;        /* some part carries a loss mask */
    int rank, world;      /* the sampling cursor: this rank and the number of ranks (0 and 1 after
                             loading; fm_dataset_set_ranks) */
    int seq_part, seq_parts; /* sequence parallelism: the slice of every window this rank keeps
                             (0 and 1 after loading: the whole window; fm_dataset_set_seq_slice) */
    char desc[256];       /* human-readable summary, e.g. "3 text files, 1115394 tokens (bytes)" */
    int64_t *docs;        /* [n_docs] first token of each document (this data set's coordinates,
                             increasing from 0), or NULL: the data has no document index */
    int64_t n_docs;
    bool docs_owned;      /* docs is this data set's own (freed by fm_dataset_free) */
} fm_dataset;

/* Loads and concatenates `n_paths` data sources (in the order given): text files are read into
 * memory, shards and Megatron data sets are memory-mapped, each with its mask sidecar if one
 * exists. Every file must have the same kind (all text, or shards and Megatron data sets; shard
 * versions 1 and 7 may be mixed). Token ids are checked against vocab_size (>= 1, <= 2^31).
 * On error *ds is left empty (parts NULL, n_tokens 0) and nothing needs freeing.
 * Errors: FM_ERR_ARG (n_paths <= 0, bad vocab_size, text with vocab_size < 256, text mixed with
 * token files); FM_ERR_IO (missing/unreadable/not a regular file, mmap failure, with strerror);
 * FM_ERR_FORMAT (bad magic/version pair, truncated shard or trailing bytes, count <= 0, token id
 * >= vocab_size (or negative) naming the file, token index and id, empty file, NUL bytes in what
 * is not a shard; a Megatron index with a bad magic, version, dtype code, sizes or pointers that
 * are not back to back, or a .bin of the wrong size; a mask with the wrong magic, a token count
 * that differs from its file's, a wrong size, or a byte that is not 0 or 1, naming the file and
 * the offset); FM_ERR_NOMEM. */
fm_status fm_dataset_load(fm_dataset *ds, const char *const *paths, int n_paths, int64_t vocab_size);

/* The guard against training or scoring chat data as raw text (issue 28): buf (n bytes, the
 * file's start or whole) of the text file `path` looks like JSON or JSONL when its first
 * non-blank byte (past a UTF-8 BOM) is '{' or '[' and either the name ends in .json / .jsonl or
 * that first line ends in '}' or ']'. fm_dataset_load applies it to every text file; eval applies
 * it before tokenizing a text file. Errors: FM_ERR_FORMAT naming the file, the byte found and the
 * `flatmoe prepare` command to run instead. */
fm_status fm_data_refuse_json(const char *path, const void *buf, size_t n);

/* A data set over the caller's tokens[0..n) (int32, which must outlive it; no mask): for tests
 * and tools. owns = true (of its one-part table only). Errors: FM_ERR_ARG (n < 1), FM_ERR_NOMEM. */
fm_status fm_dataset_from_tokens(fm_dataset *ds, const int32_t *tokens, int64_t n, const char *desc);

/* Copies tokens [start, start + n) of the data set into dst as int32 (mask not applied).
 * Precondition (asserted): 0 <= start, n >= 0, start + n <= ds->n_tokens. */
void fm_dataset_tokens(const fm_dataset *ds, int64_t start, int64_t n, int32_t *dst);

/* The same as targets: a token whose mask byte is 0 becomes FM_IGNORE_INDEX. */
void fm_dataset_targets(const fm_dataset *ds, int64_t start, int64_t n, int32_t *dst);

/* Tokens of document d (0 <= d < ds->n_docs; asserted, with ds->docs non-NULL). */
int64_t fm_dataset_doc_len(const fm_dataset *ds, int64_t d);

/* Writes a document index (format above) for a shard of n_tokens tokens: n_docs starts,
 * increasing from 0, each < n_tokens; atomic (`path`.tmp renamed). Errors: FM_ERR_FORMAT for
 * starts that are not so (naming the document); FM_ERR_IO. */
fm_status fm_docs_write(const char *path, const int64_t *starts, int64_t n_docs, int64_t n_tokens);

/* The mask byte of token i (1 when the data set has no mask there).
 * Precondition (asserted): 0 <= i < ds->n_tokens. */
int fm_dataset_mask_at(const fm_dataset *ds, int64_t i);

/* Splits `all` into two views (owns = false, sharing all's parts; `all` must outlive them):
 * val = the last round(n_tokens * val_fraction) tokens, train = the tokens before them. For runs
 * that give no separate validation data. The views keep all's ranks, and each its own table of
 * all's documents (one cut at the split starts a document in val). FM_ERR_NOMEM.
 * Errors: FM_ERR_ARG when val_fraction is not in (0, 1) or either part would be empty. */
fm_status fm_dataset_split(const fm_dataset *all, double val_fraction, fm_dataset *train, fm_dataset *val);

/* Sets the sampling cursor's ranks: this process is rank `rank` of `world` data-parallel ranks
 * (fm_dataset_sample_batch). Errors: FM_ERR_ARG unless 0 <= rank < world. */
fm_status fm_dataset_set_ranks(fm_dataset *ds, int rank, int world);

/* Sequence parallelism (Ulysses, model/fm_attn_sp.h): this process keeps slice `part` of `parts`
 * of every window: of a window of T tokens, positions [part T/parts, (part + 1) T/parts), so a
 * batch of B windows fills [B, T/parts] rows (fm_dataset_sample_batch, fm_dataset_eval_batch:
 * T must then be divisible by parts, asserted). The windows drawn do not change: the sp ranks of
 * one data-parallel rank (the same fm_dataset_set_ranks) read the same windows. parts = 1: the
 * whole window (the default). Errors: FM_ERR_ARG unless 0 <= part < parts. */
fm_status fm_dataset_set_seq_slice(fm_dataset *ds, int part, int parts);

/* Checks that the data holds at least one window of seq_len inputs plus the shifted target,
 * i.e. n_tokens >= seq_len + 1. `what` names the data in the message ("validation data").
 * Errors: FM_ERR_ARG when seq_len < 1 or the data is too short (message says how many tokens it
 * has, how many --seq-len needs, and the fix). */
fm_status fm_dataset_check_windows(const fm_dataset *ds, int64_t seq_len, const char *what);

/* The rank-aware cursor. Each call draws the global batch of world*B windows, starts s in
 * [0, n_tokens - T - 1] drawn from rng in order (world*B draws of fm_rng_below(rng,
 * n_tokens - T)), the same on every rank; rank r keeps windows r*B .. r*B + B-1 as its rows
 * 0 .. B-1: inputs[b*T+t] = token[s+t], targets[b*T+t] = token[s+t+1], or FM_IGNORE_INDEX where
 * that target's mask byte is 0. With world = 1 this is B draws, one per row in row order. Every
 * rank's RNG stays identical, so the RNG state (saved in state.json) is the whole cursor, and the
 * global batch does not depend on how it is split over ranks. With a sequence slice
 * (fm_dataset_set_seq_slice: part p of P) each row keeps positions [p T/P, (p + 1) T/P) of its
 * window and rows are T/P long: inputs[b*(T/P) + t] = token[s + p T/P + t].
 * Precondition (asserted): B >= 1, T >= 1, n_tokens >= T + 1 (see fm_dataset_check_windows). */
void fm_dataset_sample_batch(const fm_dataset *ds, fm_rng *rng, int64_t B, int64_t T,
                             int32_t *inputs, int32_t *targets);

/* Number of non-overlapping evaluation windows of T tokens: (n_tokens - 1) / T (window w covers
 * inputs tokens[w*T .. w*T+T-1] and targets one further). 0 when the data is too short.
 * Precondition (asserted): T >= 1. */
int64_t fm_dataset_eval_windows(const fm_dataset *ds, int64_t T);

/* Fills up to B rows of inputs and targets ([B, T] int32 each) with the sequential windows
 * first_window, first_window + 1, ... (window w starts at token w*T), stopping at the last window;
 * masked targets are FM_IGNORE_INDEX (not rank-aware: every rank fills the same windows; a
 * sequence slice applies as in fm_dataset_sample_batch: rows of T/P);
 * *n_filled = number of rows written (0 when first_window >=
 * fm_dataset_eval_windows). Rows past *n_filled are left untouched.
 * Precondition (asserted): B >= 1, T >= 1, first_window >= 0. */
void fm_dataset_eval_batch(const fm_dataset *ds, int64_t first_window, int64_t B, int64_t T,
                           int32_t *inputs, int32_t *targets, int64_t *n_filled);

/* Releases what the data set owns (maps, heap tokens, its part table) and resets *ds to empty.
 * Safe on an empty or already-freed data set and on views (which free nothing). */
void fm_dataset_free(fm_dataset *ds);

/* Writes n tokens as an llm.c shard: version 1 (magic 20240520, uint16 tokens, ids 0..65535) or
 * version 7 (magic 20240801, uint32 tokens, ids >= 0). Writes `path`.tmp and renames it to `path`,
 * so a reader never sees a partial file; on failure the .tmp file is removed.
 * Errors: FM_ERR_ARG (version not 1 or 7; n < 1 or n > INT32_MAX; a token id out of range for the
 * version, naming its index); FM_ERR_IO (open/write/close/rename failed, with strerror; also
 * when fault injection hits before a write); FM_ERR_NOMEM. */
fm_status fm_shard_write(const char *path, const int32_t *tokens, int64_t n, int version);

/* Writes a loss-mask sidecar (format above) of n bytes mask[i] in {0, 1} to `path` (atomic:
 * `path`.tmp renamed). Errors: FM_ERR_ARG (n < 1, a byte not 0/1, naming its index); FM_ERR_IO. */
fm_status fm_mask_write(const char *path, const uint8_t *mask, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
