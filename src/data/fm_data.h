/* Token data sources (DESIGN.md §7): byte-level text and llm.c token shards, loaded whole into
 * host memory as int32 token ids, with random training windows and sequential eval windows.
 *
 * Formats, detected per file:
 *   llm.c shard: a file of >= 1024 bytes whose first little-endian int32 is a magic number.
 *     Header: 256 little-endian int32. header[0] = magic, header[1] = version, header[2] = token
 *     count. Magic 20240520 goes with version 1 and uint16 tokens; magic 20240801 with version 7
 *     and uint32 tokens. The tokens (little-endian) start at byte 1024 and fill the file exactly.
 *   byte-level text: anything else without NUL bytes in its first 64 KiB; each byte is one token
 *     0..255, so the model's vocab_size must be at least 256.
 *
 * Batches are row-major [B, T] int32: row b, position t at index b*T + t. targets[b][t] is the
 * token after inputs[b][t] in the data.
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

typedef struct fm_dataset {
    int32_t *tokens;  /* [n_tokens] token ids, each in [0, vocab_size) */
    int64_t n_tokens; /* number of tokens */
    bool owns;        /* true: tokens was allocated by fm_dataset_load and is freed by fm_dataset_free;
                         false: a view into another dataset (fm_dataset_split), which must outlive it */
    char desc[256];   /* human-readable summary, e.g. "3 text files, 1115394 tokens (bytes)" */
} fm_dataset;

/* Loads and concatenates `n_paths` files (in the order given) into ds->tokens (owned).
 * Every file must have the same kind (all text or all llm.c shards; shard versions 1 and 7 may be
 * mixed). Token ids are checked against vocab_size (>= 1, <= 2^31). On error *ds is left empty
 * (tokens NULL, n_tokens 0) and nothing needs freeing.
 * Errors: FM_ERR_ARG (n_paths <= 0, bad vocab_size, text with vocab_size < 256, text mixed with
 * shards); FM_ERR_IO (missing/unreadable/not a regular file, with strerror); FM_ERR_FORMAT (bad
 * magic/version pair, truncated shard or trailing bytes, count <= 0, token id >= vocab_size naming
 * the file, token index and id, empty file, NUL bytes in what is not a shard); FM_ERR_NOMEM. */
fm_status fm_dataset_load(fm_dataset *ds, const char *const *paths, int n_paths, int64_t vocab_size);

/* Splits `all` into two views (owns = false, pointing into all->tokens; `all` must outlive them):
 * val = the last round(n_tokens * val_fraction) tokens, train = the tokens before them. For runs
 * that give no separate validation data.
 * Errors: FM_ERR_ARG when val_fraction is not in (0, 1) or either part would be empty. */
fm_status fm_dataset_split(const fm_dataset *all, double val_fraction, fm_dataset *train, fm_dataset *val);

/* Checks that the data holds at least one window of seq_len inputs plus the shifted target,
 * i.e. n_tokens >= seq_len + 1. `what` names the data in the message ("validation data").
 * Errors: FM_ERR_ARG when seq_len < 1 or the data is too short (message says how many tokens it
 * has, how many --seq-len needs, and the fix). */
fm_status fm_dataset_check_windows(const fm_dataset *ds, int64_t seq_len, const char *what);

/* Fills inputs and targets ([B, T] int32 each) with B windows at uniform random starts
 * s in [0, n_tokens - T - 1], drawn from rng one per row in row order (B draws of
 * fm_rng_below(rng, n_tokens - T)): inputs[b*T+t] = tokens[s+t], targets[b*T+t] = tokens[s+t+1].
 * Deterministic given the RNG state, so saving the RNG state saves the data cursor.
 * Precondition (asserted): B >= 1, T >= 1, n_tokens >= T + 1 (see fm_dataset_check_windows). */
void fm_dataset_sample_batch(const fm_dataset *ds, fm_rng *rng, int64_t B, int64_t T,
                             int32_t *inputs, int32_t *targets);

/* Number of non-overlapping evaluation windows of T tokens: (n_tokens - 1) / T (window w covers
 * inputs tokens[w*T .. w*T+T-1] and targets one further). 0 when the data is too short.
 * Precondition (asserted): T >= 1. */
int64_t fm_dataset_eval_windows(const fm_dataset *ds, int64_t T);

/* Fills up to B rows of inputs and targets ([B, T] int32 each) with the sequential windows
 * first_window, first_window + 1, ... (window w starts at token w*T), stopping at the last window;
 * *n_filled = number of rows written (0 when first_window >= fm_dataset_eval_windows). Rows past
 * *n_filled are left untouched.
 * Precondition (asserted): B >= 1, T >= 1, first_window >= 0. */
void fm_dataset_eval_batch(const fm_dataset *ds, int64_t first_window, int64_t B, int64_t T,
                           int32_t *inputs, int32_t *targets, int64_t *n_filled);

/* Frees the tokens if owned and resets *ds to empty. Safe on an empty or already-freed dataset
 * and on views (which free nothing). */
void fm_dataset_free(fm_dataset *ds);

/* Writes n tokens as an llm.c shard: version 1 (magic 20240520, uint16 tokens, ids 0..65535) or
 * version 7 (magic 20240801, uint32 tokens, ids >= 0). Writes `path`.tmp and renames it to `path`,
 * so a reader never sees a partial file; on failure the .tmp file is removed.
 * Errors: FM_ERR_ARG (version not 1 or 7; n < 1 or n > INT32_MAX; a token id out of range for the
 * version, naming its index); FM_ERR_IO (open/write/close/rename failed, with strerror; also
 * when fault injection hits before a write); FM_ERR_NOMEM. */
fm_status fm_shard_write(const char *path, const int32_t *tokens, int64_t n, int version);

#ifdef __cplusplus
}
#endif
#endif
