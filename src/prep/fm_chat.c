/* A tokenizer folder's chat template: load, render, and the assistant's spans (fm_chat.h). */
#define _POSIX_C_SOURCE 200809L
#include "fm_chat.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static fm_status read_file(const char *path, char **buf, size_t *n, bool *missing) {
    *buf = NULL;
    *missing = false;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (errno == ENOENT) {
            *missing = true;
            return FM_OK;
        }
        return fm_error(FM_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return fm_error(FM_ERR_IO, "%s: expected a regular file", path);
    }
    *buf = fm_malloc((size_t)st.st_size + 1);
    if (!*buf) {
        fclose(f);
        return fm_error(FM_ERR_NOMEM, "%s: out of memory for its %lld bytes", path, (long long)st.st_size);
    }
    *n = fread(*buf, 1, (size_t)st.st_size, f);
    fclose(f);
    (*buf)[*n] = '\0';
    if (*n != (size_t)st.st_size) {
        fm_free(*buf);
        *buf = NULL;
        return fm_error(FM_ERR_IO, "%s: read %zu of %lld bytes", path, *n, (long long)st.st_size);
    }
    return FM_OK;
}

/* A special token field: a string or {"content": string}. */
static const char *token_text(const cJSON *v) {
    if (cJSON_IsString(v)) return v->valuestring;
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(v, "content");
    return cJSON_IsString(c) ? c->valuestring : NULL;
}

fm_status fm_chat_template_load(fm_chat_template *ct, const char *dir_in) {
    memset(ct, 0, sizeof *ct);
    char dir[4096], path[4200];
    snprintf(dir, sizeof dir, "%s", dir_in);
    struct stat st;
    if (stat(dir, &st) == 0 && S_ISREG(st.st_mode)) { /* a tokenizer.json: its folder */
        char *slash = strrchr(dir, '/');
        if (slash) *slash = '\0';
        else snprintf(dir, sizeof dir, ".");
    }
    if (!(ct->specials = cJSON_CreateObject())) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    char *cfg_text = NULL, *jinja = NULL;
    size_t n = 0, jn = 0;
    bool missing, jmissing;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    fm_status s = read_file(path, &cfg_text, &n, &missing);
    cJSON *cfg = NULL;
    const char *src = NULL;
    size_t src_n = 0;
    if (!s && !missing) {
        if (!(cfg = cJSON_ParseWithLength(cfg_text, n)) || !cJSON_IsObject(cfg))
            s = fm_error(FM_ERR_FORMAT, "%s: malformed JSON; expected the tokenizer's config object", path);
        static const char *const names[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
        for (int i = 0; !s && i < 4; i++) {
            const char *t = token_text(cJSON_GetObjectItemCaseSensitive(cfg, names[i]));
            if (t && !cJSON_AddStringToObject(ct->specials, names[i], t)) s = fm_error(FM_ERR_NOMEM, "out of memory");
        }
        const cJSON *tmpl = s ? NULL : cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
        if (cJSON_IsString(tmpl)) src = tmpl->valuestring, src_n = strlen(src);
        else if (cJSON_IsArray(tmpl)) { /* [{"name": "default", "template": ...}, ...] */
            const cJSON *e;
            cJSON_ArrayForEach(e, tmpl) {
                const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name");
                const cJSON *tt = cJSON_GetObjectItemCaseSensitive(e, "template");
                if (cJSON_IsString(nm) && !strcmp(nm->valuestring, "default") && cJSON_IsString(tt))
                    src = tt->valuestring, src_n = strlen(src);
            }
            if (!src) s = fm_error(FM_ERR_FORMAT, "%s: chat_template is a list without a template named \"default\"", path);
        } else if (tmpl && !cJSON_IsNull(tmpl))
            s = fm_error(FM_ERR_FORMAT, "%s: chat_template must be a string or a list of {\"name\", \"template\"}", path);
        if (src) snprintf(ct->path, sizeof ct->path, "%s", path);
    }
    char jpath[4200];
    snprintf(jpath, sizeof jpath, "%s/chat_template.jinja", dir);
    if (!s) s = read_file(jpath, &jinja, &jn, &jmissing);
    if (!s && !jmissing) { /* the newer layout wins, as in transformers */
        src = jinja, src_n = jn;
        snprintf(ct->path, sizeof ct->path, "%s", jpath);
    }
    if (!s && src) s = fm_jinja_parse(src, src_n, ct->path, &ct->t);
    cJSON_Delete(cfg);
    fm_free(cfg_text);
    fm_free(jinja);
    if (s) fm_chat_template_free(ct);
    return s;
}

void fm_chat_template_free(fm_chat_template *ct) {
    fm_jinja_free(ct->t);
    cJSON_Delete(ct->specials);
    memset(ct, 0, sizeof *ct);
}

fm_status fm_chat_render(const fm_chat_template *ct, const cJSON *messages, const cJSON *tools, bool gen,
                         char **text, size_t *len) {
    cJSON *vars = cJSON_Duplicate(ct->specials, true);
    if (!vars) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    /* the variables reference the caller's arrays (not copied): detached before the delete */
    cJSON *m = cJSON_CreateArrayReference(messages ? messages->child : NULL);
    cJSON *t = tools ? cJSON_CreateArrayReference(tools->child) : NULL;
    cJSON_AddItemToObject(vars, "messages", m);
    if (t) cJSON_AddItemToObject(vars, "tools", t);
    cJSON_AddBoolToObject(vars, "add_generation_prompt", gen);
    fm_status s = fm_jinja_render(ct->t, vars, text, len);
    cJSON_Delete(vars);
    return s;
}

static size_t common_prefix(const char *a, size_t an, const char *b, size_t bn) {
    size_t i = 0;
    while (i < an && i < bn && a[i] == b[i]) i++;
    return i;
}

/* A copy of messages[:k] (NULL: out of memory). */
static cJSON *prefix_of(const cJSON *messages, int k) {
    cJSON *prefix = cJSON_CreateArray();
    for (int i = 0; prefix && i < k; i++) cJSON_AddItemToArray(prefix, cJSON_Duplicate(cJSON_GetArrayItem(messages, i), true));
    return prefix;
}

/* Where assistant message k starts when the render of messages[:k] with the generation prompt
 * (txt[0..tn)) is not a prefix of the full render (the template renders earlier messages
 * differently once later ones follow: GPT-OSS drops an assistant's analysis before a final
 * answer): the end of the generation prompt's first occurrence in full from *p, where the two
 * renders part. prefix (owned) is messages[:k]. Errors: FM_ERR_FORMAT (no generation prompt to
 * find, naming the message), those of fm_chat_render. */
static fm_status unstable_start(const fm_chat_template *ct, cJSON *prefix, const cJSON *tools, const char *full,
                                size_t n, const char *txt, size_t tn, int k, size_t *p) {
    char *t0 = NULL;
    size_t n0 = 0;
    fm_status s = prefix ? fm_chat_render(ct, prefix, tools, false, &t0, &n0) : fm_error(FM_ERR_NOMEM, "out of memory");
    cJSON_Delete(prefix);
    if (s) return s;
    const char *gen = txt + n0, *hit = NULL; /* the generation prompt: what add_generation_prompt adds */
    const size_t gn = tn - n0;
    if (n0 < tn && common_prefix(txt, tn, t0, n0) == n0)
        for (size_t i = *p; !hit && i + gn <= n; i++)
            if (!memcmp(full + i, gen, gn)) hit = full + i;
    fm_free(t0);
    if (!hit)
        return fm_error(FM_ERR_FORMAT, "messages[%d]: the chat template renders the messages before it differently "
                        "when it follows them (not prefix-stable), and its generation prompt is not found after "
                        "them: the assistant's turn cannot be located; give --loss-on all, or --no-chat-template", k);
    *p = (size_t)(hit - full) + gn;
    return FM_OK;
}

fm_status fm_chat_assistant_spans(const fm_chat_template *ct, const cJSON *messages, const cJSON *tools,
                                  const char *full, size_t n, size_t *start, size_t *end, bool *has_content,
                                  int cap, int *n_spans) {
    *n_spans = 0;
    const int n_msg = cJSON_GetArraySize(messages);
    cJSON *copy = cJSON_Duplicate(messages, true);
    if (!copy) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    fm_status s = FM_OK;
    for (int k = 0; k < n_msg && !s; k++) {
        cJSON *msg = cJSON_GetArrayItem(copy, k);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(msg, "role");
        if (!cJSON_IsString(role) || strcmp(role->valuestring, "assistant")) continue;
        if (*n_spans == cap) {
            s = fm_error(FM_ERR_ARG, "a conversation of more than %d assistant messages", cap);
            break;
        }
        /* the prefix: messages[:k] with the generation prompt */
        cJSON *prefix = prefix_of(messages, k);
        char *txt = NULL;
        size_t tn = 0;
        s = prefix ? fm_chat_render(ct, prefix, tools, true, &txt, &tn) : fm_error(FM_ERR_NOMEM, "out of memory");
        cJSON_Delete(prefix);
        if (s) break;
        size_t p = common_prefix(full, n, txt, tn);
        if (p < tn) s = unstable_start(ct, prefix_of(messages, k), tools, full, n, txt, tn, k, &p);
        fm_free(txt);
        if (s) break;
        size_t e = p;
        cJSON *content = cJSON_GetObjectItemCaseSensitive(msg, "content");
        bool hc = cJSON_IsString(content) && content->valuestring[0];
        if (hc) { /* the content with one more character: where the render first differs */
            const size_t cl = strlen(content->valuestring);
            char *alt = malloc(cl + 2); /* cJSON's allocator frees it */
            if (!alt) {
                s = fm_error(FM_ERR_NOMEM, "out of memory");
                break;
            }
            memcpy(alt, content->valuestring, cl);
            alt[cl] = '\x01', alt[cl + 1] = '\0';
            char *old = content->valuestring;
            content->valuestring = alt;
            s = fm_chat_render(ct, copy, tools, false, &txt, &tn);
            content->valuestring = old;
            free(alt);
            if (s) break;
            e = common_prefix(full, n, txt, tn);
            const bool unseen = e == n && tn == n; /* the template does not show this content */
            fm_free(txt);
            if (e < p) e = p;
            if (unseen) hc = false, e = p;
        }
        start[*n_spans] = p, end[*n_spans] = e, has_content[*n_spans] = hc;
        (*n_spans)++;
    }
    cJSON_Delete(copy);
    return s;
}

/* Tokens of full[0..pos) that agree with ids: the index of the first token at or past pos (a
 * token straddling pos counts as past it when `straddle_in`, i.e. the boundary is an end). */
static fm_status token_boundary(fm_tokenizer *tok, const char *full, size_t pos, const int32_t *ids, int64_t n_ids,
                                bool straddle_in, int64_t *out) {
    int32_t *pre = NULL;
    int64_t np = 0, cap = 0;
    fm_status s = pos ? fm_tokenizer_encode_append(tok, full, pos, &pre, &np, &cap) : FM_OK;
    if (s) {
        fm_free(pre);
        return s;
    }
    int64_t k = 0;
    while (k < np && k < n_ids && pre[k] == ids[k]) k++;
    fm_free(pre);
    *out = k < np && straddle_in && k < n_ids ? k + 1 : k;
    return FM_OK;
}

static bool end_of_turn(const fm_tokenizer *tok, const fm_chat_template *ct, int32_t id) {
    if (!fm_tokenizer_is_special(tok, id)) return false;
    const char *t = fm_tokenizer_id_to_token(tok, id);
    if (!t) return false;
    const cJSON *eos = cJSON_GetObjectItemCaseSensitive(ct->specials, "eos_token");
    if (cJSON_IsString(eos) && !strcmp(eos->valuestring, t)) return true;
    static const char *const ends[] = {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|return|>", "<|call|>",
                                       "<|endoftext|>",
                                       "<|end_of_text|>", "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>",
                                       "</s>", NULL};
    for (int i = 0; ends[i]; i++)
        if (!strcmp(ends[i], t)) return true;
    return false;
}

fm_status fm_chat_token_mask(fm_tokenizer *tok, const fm_chat_template *ct, const char *full, const int32_t *ids,
                             int64_t n_ids, const size_t *start, const size_t *end, const bool *has_content,
                             int n_spans, uint8_t *mask) {
    for (int i = 0; i < n_spans; i++) {
        int64_t a, b;
        FM_TRY(token_boundary(tok, full, start[i], ids, n_ids, false, &a));
        if (has_content[i]) {
            FM_TRY(token_boundary(tok, full, end[i], ids, n_ids, true, &b));
            if (b < n_ids && fm_tokenizer_is_special(tok, ids[b])) b++; /* the turn's end marker */
        } else {
            b = a;
            while (b < n_ids && !end_of_turn(tok, ct, ids[b])) b++;
            if (b < n_ids) b++;
        }
        for (int64_t k = a; k < b && k < n_ids; k++) mask[k] = 1;
    }
    return FM_OK;
}
