/* A tokenizer folder's chat template (issue 28 item 2): loaded from chat_template.jinja when the
 * folder has one, else tokenizer_config.json's "chat_template" (a string, or a list of
 * {"name", "template"}: the one named "default"), rendered by the Jinja subset (fm_jinja.h) as
 * transformers' apply_chat_template does (variables: messages, tools when given,
 * add_generation_prompt, and the special tokens of tokenizer_config.json: bos_token, eos_token,
 * unk_token, pad_token, each a string or {"content": ...}).
 *
 * The assistant's spans (the text a loss is taken on) are found by rendering, the approach of
 * TRL's prompt-completion SFT (trl/trainer/sft_trainer.py: the prompt rendered with
 * add_generation_prompt, the completion = what the full render adds) and of transformers'
 * return_assistant_tokens_mask (which needs {% generation %} tags most templates lack): for an
 * assistant message k,
 *   start = the length of the common prefix of the full render and the render of messages[:k]
 *           with add_generation_prompt = true (where the model starts to write); when that render
 *           is not a prefix of the full one (the template renders earlier messages differently
 *           once later ones follow, as GPT-OSS drops an analysis turn before a final answer),
 *           the end of the generation prompt's first occurrence in the full render from there;
 *   end   = where message k's content ends in the full render: the first byte that differs when
 *           that content is rendered with one more character ("\x01") appended;
 *           a message without string content (tool calls only), or whose content the template
 *           does not show (GPT-OSS drops an earlier turn's text), ends at start.
 * The token spans (fm_chat_token_mask) then take the special token right after the end (the
 * template's end of turn, which the model must learn to write), and for a message without
 * content every token up to and including the first end-of-turn special token (eos_token or one
 * of <|im_end|>, <|eot_id|>, <|eom_id|>, <|end|>, <|return|>, <|call|> (GPT-OSS), <|endoftext|>, <|end_of_text|>,
 * <｜end▁of▁sentence｜>, </s>). */
#ifndef FM_CHAT_H
#define FM_CHAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "../core/fm_core.h"
#include "../tok/fm_tokenizer.h"
#include "fm_jinja.h"

typedef struct fm_chat_template {
    fm_jinja *t;         /* NULL: the folder has no chat template */
    cJSON *specials;     /* {"bos_token": "...", ...}: the template's special-token variables */
    char path[4200];     /* the file the template came from */
} fm_chat_template;

/* Loads the chat template of a tokenizer folder (dir; a path to a tokenizer.json file: its
 * folder). No template in the folder: FM_OK with ct->t NULL. Errors: FM_ERR_IO (a file present
 * but unreadable), FM_ERR_FORMAT (malformed tokenizer_config.json, a chat_template of the wrong
 * type, a template syntax error: naming the file and the line), FM_ERR_UNSUPPORTED (a construct
 * outside the Jinja subset, named with its line), FM_ERR_NOMEM. */
fm_status fm_chat_template_load(fm_chat_template *ct, const char *dir);
void fm_chat_template_free(fm_chat_template *ct);

/* Renders messages (a JSON array of {"role", "content", ...}) and tools (a JSON array or NULL)
 * with add_generation_prompt; *text fm_malloc'd, NUL-terminated, *len bytes. Errors: those of
 * fm_jinja_render (a raise_exception in the template is FM_ERR_FORMAT with its message). */
fm_status fm_chat_render(const fm_chat_template *ct, const cJSON *messages, const cJSON *tools, bool gen,
                         char **text, size_t *len);

/* The byte spans of the assistant messages of messages in their full render full[0..n) (see
 * above): span i is [start[i], end[i]) with has_content[i]; *n_spans = the assistant messages
 * (at most cap). Errors: those of fm_chat_render; FM_ERR_ARG (more than cap assistant messages);
 * FM_ERR_FORMAT (the template is not prefix-stable and the message's generation prompt is not
 * found after the messages before it, naming the message). */
fm_status fm_chat_assistant_spans(const fm_chat_template *ct, const cJSON *messages, const cJSON *tools,
                                  const char *full, size_t n, size_t *start, size_t *end, bool *has_content,
                                  int cap, int *n_spans);

/* The loss mask of the full render's ids[0..n_ids) (mask[i] = 1: a loss target): each span's
 * tokens, found by encoding full[0..boundary) and comparing ids (a token that straddles a
 * boundary is in the span), plus the end-of-turn special token as said above. Errors: those of
 * the tokenizer. */
fm_status fm_chat_token_mask(fm_tokenizer *tok, const fm_chat_template *ct, const char *full, const int32_t *ids,
                             int64_t n_ids, const size_t *start, const size_t *end, const bool *has_content,
                             int n_spans, uint8_t *mask);

#endif
