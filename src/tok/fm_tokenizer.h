/* Hugging Face tokenizers (tokenizer.json) for the byte-level BPE families flatmoe trains: OLMoE
 * (GPT-NeoX style: ByteLevel pre-tokenizer with the GPT-2 regex, ByteLevel decoder), Qwen3 (NFC,
 * a Split regex then ByteLevel without regex) and Mixtral (sentencepiece-style BPE with byte
 * fallback: Prepend/Replace normalizers, <0xNN> tokens, Replace/ByteFallback/Fuse/Strip decoder).
 *
 * The pipeline is the one of Hugging Face `tokenizers` (Rust crate, tokenizers/src/tokenizer/
 * mod.rs encode_single_sequence, added_vocabulary.rs, models/bpe/), reimplemented here:
 *   0. invalid UTF-8 in the input: each maximal invalid subpart becomes U+FFFD (Unicode §3.9
 *      "U+FFFD substitution of maximal subparts", what Python's bytes.decode('utf-8', 'replace')
 *      does, which is how text reaches `tokenizers` from Python);
 *   1. added tokens with normalized = false are split out of the raw text, leftmost-longest
 *      (with their lstrip / rstrip / single_word rules);
 *   2. each remaining piece is normalized (NFC through utf8proc, Prepend, Replace, Sequence), and
 *      added tokens with normalized = true (their content normalized the same way) are split out;
 *   3. each remaining piece is pre-tokenized (Split with a PCRE2 regex or a string, ByteLevel,
 *      Metaspace, Sequence) into words;
 *   4. each word goes through the BPE model: its characters (or <0xNN> byte tokens, or the unk
 *      token) are merged pair by pair, the lowest merge rank first and the leftmost on ties
 *      (Sennrich et al., arXiv 1508.07909), with a linked list of symbols and a binary heap of
 *      candidate pairs; words already seen come from a cache.
 * No post-processor is applied (no BOS is added): ids are those of
 * `tokenizer.encode(text, add_special_tokens=False).ids`.
 *
 * Components read; any other is FM_ERR_UNSUPPORTED naming the component and the file:
 *   model: BPE (vocab, merges as "a b" strings or ["a", "b"] pairs, byte_fallback, unk_token,
 *     fuse_unk, ignore_merges; continuing_subword_prefix / end_of_word_suffix must be null,
 *     dropout null or 0);
 *   normalizer: null, NFC, Prepend, Replace (String or Regex pattern), Sequence;
 *   pre_tokenizer: null, ByteLevel (add_prefix_space, use_regex: the GPT-2 regex; trim_offsets
 *     changes only offsets), Split (Regex or String pattern; behavior Isolated, Removed,
 *     MergedWithPrevious, MergedWithNext, Contiguous; invert), Metaspace (replacement,
 *     prepend_scheme always / first / never or the older add_prefix_space, split), Sequence;
 *   decoder: null (tokens joined by spaces), ByteLevel, Replace, ByteFallback, Fuse, Strip,
 *     Metaspace, Sequence.
 * The post_processor is ignored (encode adds no special tokens).
 */
#ifndef FM_TOKENIZER_H
#define FM_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/fm_core.h"

#ifdef __cplusplus
extern "C" {
#endif

struct fm_tok_impl;

typedef struct fm_tokenizer {
    struct fm_tok_impl *impl; /* NULL when not loaded */
    int64_t vocab_size;       /* 1 + the largest id of the model's vocab and the added tokens */
    int32_t eos_id;           /* the end-of-sequence token, or -1 when none could be found */
    char path[4096];          /* the tokenizer.json read */
} fm_tokenizer;

/* Loads `path`: a tokenizer.json file, or a folder holding one. The EOS id is, in this order:
 * the folder's tokenizer_config.json "eos_token" (a string or {"content": ...}), its
 * generation_config.json "eos_token_id", its config.json "eos_token_id" (an int or a list: the
 * first), else the first special added token among <|endoftext|>, </s>, <|end_of_text|>, <eos>,
 * <|im_end|>; -1 when none. On error *t is left empty (impl NULL) and nothing needs freeing.
 * Errors: FM_ERR_IO (missing / unreadable file, naming it); FM_ERR_FORMAT (malformed JSON, a
 * missing or ill-typed field, a merge or unk token missing from the vocab, a regex PCRE2 refuses:
 * each naming the file and the field); FM_ERR_UNSUPPORTED (a component type or option listed
 * above as unsupported, naming it and the file); FM_ERR_NOMEM. */
fm_status fm_tokenizer_load(fm_tokenizer *t, const char *path);

/* Encodes n bytes of text (any bytes: invalid UTF-8 is replaced first, see above) into
 * out[0..cap) int32 ids; *n_out = the number of ids the text has, also when it exceeds cap (then
 * only the first cap are written and FM_ERR_ARG is returned, so a caller may retry with a larger
 * buffer). Not thread-safe on one tokenizer (the word cache and scratch are shared).
 * Errors: FM_ERR_ARG (cap too small, as said); FM_ERR_FORMAT (the unk token is needed but missing
 * from the vocab); FM_ERR_NOMEM. */
fm_status fm_tokenizer_encode(fm_tokenizer *t, const char *text, size_t n, int32_t *out, int64_t cap,
                              int64_t *n_out);

/* Encodes and appends the ids to *ids (int32, fm_malloc'd or NULL; capacity *cap, grown by
 * doubling), *n += the number of ids. Errors: those of fm_tokenizer_encode but FM_ERR_ARG;
 * FM_ERR_NOMEM (then *ids still holds the earlier ids). */
fm_status fm_tokenizer_encode_append(fm_tokenizer *t, const char *text, size_t n, int32_t **ids, int64_t *n_ids,
                                     int64_t *cap);

/* Decodes ids[0..n) to text, as tokenizer.decode(ids, skip_special_tokens) in `tokenizers`
 * 0.23: each id becomes its token string (an added token's content, or its normalized form when
 * it is normalized and the normalizer changes it), special added tokens are dropped when
 * skip_special, then the decoder runs. *text is fm_malloc'd, NUL-terminated, *len bytes (the
 * caller fm_frees it). Ids outside the vocabulary are skipped, as `tokenizers` does.
 * Errors: FM_ERR_NOMEM. */
fm_status fm_tokenizer_decode(fm_tokenizer *t, const int32_t *ids, int64_t n, bool skip_special, char **text,
                              size_t *len);

/* The id of a token string (the model's vocab or an added token), or -1. */
int32_t fm_tokenizer_token_to_id(const fm_tokenizer *t, const char *token);

/* The token string of an id (NUL-terminated, owned by the tokenizer), or NULL when none. */
const char *fm_tokenizer_id_to_token(const fm_tokenizer *t, int32_t id);

/* True when id is a special added token. */
bool fm_tokenizer_is_special(const fm_tokenizer *t, int32_t id);

/* Releases the tokenizer. Safe on an empty or freed one. */
void fm_tokenizer_free(fm_tokenizer *t);

/* Replaces each maximal invalid subpart of in[0..n) with U+FFFD (EF BF BD) into out (capacity at
 * least 3n bytes); returns the bytes written. The Unicode Standard §3.9 (Table 3-7 for the well
 * formed sequences), the rule of Python's bytes.decode('utf-8', errors='replace'). */
size_t fm_utf8_sanitize(const char *in, size_t n, char *out);

#ifdef __cplusplus
}
#endif
#endif
