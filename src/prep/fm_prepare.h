/* Data preparation (`flatmoe prepare`): text and JSONL files tokenized into llm.c token shards
 * (version 7: magic 20240801, uint32 tokens; see data/fm_data.h) with a per-token loss mask.
 *
 * Documents:
 *   plain text (.txt, or --format text): one file is one document, encoded whole;
 *   JSONL (.jsonl / .json, or --format jsonl): one JSON object per line (blank lines skipped):
 *     {"text": T}                      a document, every token a loss target;
 *     {"prompt": P, "completion": C}   P then C, each encoded on its own; P's tokens masked;
 *     {"messages": [{"role": R, "content": X, ...}, ...], "tools": [...]}  a chat. R must be one
 *         of system, user, assistant, tool (after role_map; else an error naming the line, the
 *         role and the accepted ones). With a chat template (o->chat: the tokenizer folder's, see
 *         prep/fm_chat.h) the whole conversation is rendered by it and encoded as one text (the
 *         ids of transformers' apply_chat_template(tokenize=True)); the loss targets are the
 *         assistant spans of fm_chat.h (every token with loss_all); no EOS is added (the template
 *         ends its turns). Without one, flatmoe's own form, each part encoded on its own:
 *         "<|R|>\n" (masked), then "X\n" (a loss target only when R is "assistant"), message
 *         after message, then EOS.
 *   Each other document is followed by the tokenizer's EOS token (unless no_eos), a loss target
 *   except after a chat whose last message is not the assistant's. Documents run on across
 *   shards. A chat with no loss target at all is kept and counted (st->no_loss).
 *   Encoding each part on its own keeps the mask boundaries exact; a sentencepiece-style
 *   tokenizer (Prepend "▁") gives each part its own leading "▁".
 *
 * Output, for shard k = 0, 1, ...: PREFIX_%06d.bin (k), an llm.c v7 shard of up to shard_tokens
 * tokens, and, when any record of the run is prompt/completion or chat, PREFIX_%06d.bin.mask
 * (written by fm_mask_write, data/fm_data.h): 8 bytes "FMMASK01", uint64 little-endian n_tokens
 * (the shard's count), n_tokens bytes: byte i is 1 when token i is a loss target (counted when it
 * is predicted), 0 when it is masked. A run of text only writes no masks. And PREFIX_%06d.bin.docs,
 * the shard's document index (fm_docs_write, data/fm_data.h "Document index"): the first token of
 * every document in the shard (a text file is one document, a JSONL record one); a document that
 * runs on into the next shard starts that shard's index at 0, so it is cut there.
 * Every file is written under a ".part" name and renamed only after the whole input was read and
 * written without error; on any error the .part files are removed, so no partial output is left.
 * On success the outputs of an earlier run with the same prefix that this one did not replace are
 * removed (they would be read with the new shards): a .mask beside a shard that now has none, and
 * the shards PREFIX_k.bin (with .mask, .docs) for k = the shards written, + 1, ... while they exist
 * (counted in st->stale).
 */
#ifndef FM_PREPARE_H
#define FM_PREPARE_H

#include "../core/fm_core.h"
#include "../tok/fm_tokenizer.h"

typedef enum { FM_PREP_AUTO = 0, FM_PREP_TEXT, FM_PREP_JSONL } fm_prep_format;

typedef struct fm_prepare_stats {
    int64_t documents;     /* documents (files or JSONL records) */
    int64_t tokens;        /* tokens written, EOS included */
    int64_t masked;        /* tokens with mask byte 0 */
    int64_t shards;        /* shards written (or being written) */
    int64_t bytes;         /* input bytes read */
    int64_t no_loss;       /* chat / prompt records with no loss target */
    int64_t bad_records;   /* malformed records skipped (skip_bad) */
    int64_t dropped;       /* messages dropped by role_map */
    int64_t stale;         /* shards of an earlier run past the last one written, removed */
    double seconds;        /* since the start */
    const char *file;      /* the file being read */
} fm_prepare_stats;

typedef struct fm_prepare_opts {
    const char *const *inputs; /* [n_inputs] input files */
    int n_inputs;
    const char *out_prefix;    /* shards are out_prefix_000000.bin, ... */
    int64_t shard_tokens;      /* tokens per shard, >= 1 (the last shard may hold fewer) */
    fm_prep_format format;     /* AUTO: by extension (.jsonl / .json: JSONL; anything else: text) */
    bool no_eos;               /* no EOS after documents */
    const struct fm_chat_template *chat; /* the tokenizer's chat template, or NULL (flatmoe's own form) */
    bool loss_all;             /* chat records: every token a loss target, not only the assistant's */
    /* "FROM=TO,FROM2=TO2,...": roles renamed before the check (TO empty: the message is dropped),
     * e.g. "bot=assistant,human=user,narrator="; NULL: none */
    const char *role_map;
    bool skip_bad;             /* a malformed record (FM_ERR_FORMAT) is a counted warning, not an error */
    /* Called about every progress_s seconds (and once at the end) with the running totals; NULL:
     * never. The library prints nothing. */
    void (*progress)(const fm_prepare_stats *st, void *ctx);
    void *ctx;
    double progress_s;
} fm_prepare_opts;

/* Tokenizes o->inputs with tok into shards (see above); *st gets the totals.
 * The folder of out_prefix is created (with its parents) when missing.
 * Errors: FM_ERR_ARG (no inputs, shard_tokens < 1, no EOS token while !no_eos, no tokens at all,
 * an id above uint32, a malformed role_map); FM_ERR_IO (an input missing or unreadable, a shard not writable: naming the
 * file); FM_ERR_FORMAT (a malformed JSON line or a record of no known form, naming the file and
 * the line; an unknown role; the chat template's raise_exception: with skip_bad each of these is a
 * warning through fm_log and the record is skipped); FM_ERR_UNSUPPORTED (a template construct
 * outside the subset); those of the tokenizer; FM_ERR_NOMEM. On error no output file is left. */
fm_status fm_prepare(fm_tokenizer *tok, const fm_prepare_opts *o, fm_prepare_stats *st);

#endif
