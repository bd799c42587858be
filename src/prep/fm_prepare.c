/* Data preparation: see fm_prepare.h for the document forms and the output files. */
#define _POSIX_C_SOURCE 200809L
#include "fm_prepare.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../core/fm_log.h"
#include "../data/fm_data.h"
#include "fm_chat.h"

#define MAX_ROLE_MAP 32
#define MAX_SPANS 1024 /* assistant messages of one conversation */

typedef struct prep {
    fm_tokenizer *tok;
    const fm_prepare_opts *o;
    int32_t *shard;    /* [shard_tokens] the shard being filled */
    uint8_t *mask;     /* [shard_tokens] its mask bytes */
    int64_t n_shard, cap_shard; /* tokens in it; its capacity (grown up to shard_tokens) */
    int32_t *ids;      /* one part's ids (growable) */
    int64_t n_ids, cap_ids;
    uint8_t *tmask;    /* the mask of one templated chat (grown with the ids) */
    int64_t cap_tmask;
    size_t *span_start, *span_end; /* [MAX_SPANS] */
    bool *span_content;
    char map_from[MAX_ROLE_MAP][64], map_to[MAX_ROLE_MAP][64];
    int n_map;
    bool any_masked_form; /* a prompt/completion or chat record was seen */
    int64_t renamed;      /* shards already under their final names */
    fm_prepare_stats st;
    double t0, last;
    char path[4200];
    /* ---- the document index of the shard being filled (issue 28; data/fm_data.h FMDOCS01) */
    int64_t *docs;        /* [n_docs] shard-local first token of each document in it */
    int64_t n_docs, cap_docs;
    bool doc_begin;       /* the next token pushed starts a document */
} prep;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void part_name(const prep *p, int64_t k, const char *suffix, char *out, size_t cap) {
    snprintf(out, cap, "%s_%06lld.bin%s", p->o->out_prefix, (long long)k, suffix);
}

/* Writes the current shard and its mask as .part files. */
static fm_status flush_shard(prep *p) {
    if (p->n_shard == 0) return FM_OK;
    char path[4300];
    part_name(p, p->st.shards, ".part", path, sizeof path);
    FM_TRY(fm_shard_write(path, p->shard, p->n_shard, 7));
    part_name(p, p->st.shards, ".mask.part", path, sizeof path);
    FM_TRY(fm_mask_write(path, p->mask, p->n_shard));
    part_name(p, p->st.shards, ".docs.part", path, sizeof path);
    FM_TRY(fm_docs_write(path, p->docs, p->n_docs, p->n_shard));
    p->st.shards++;
    p->n_shard = 0;
    p->n_docs = 0;
    return FM_OK;
}

/* Records a document starting at the shard's next token (a document running on from the previous
 * shard starts this one's index at 0: shards are read alone too). */
static fm_status doc_mark(prep *p) {
    if (p->n_docs == p->cap_docs) {
        const int64_t cap = p->cap_docs ? 2 * p->cap_docs : 1024;
        int64_t *d = fm_malloc(sizeof(int64_t) * (size_t)cap);
        if (!d) return fm_error(FM_ERR_NOMEM, "prepare: out of memory for %lld document starts", (long long)cap);
        if (p->n_docs) memcpy(d, p->docs, sizeof(int64_t) * (size_t)p->n_docs);
        fm_free(p->docs);
        p->docs = d;
        p->cap_docs = cap;
    }
    p->docs[p->n_docs++] = p->n_shard;
    p->doc_begin = false;
    return FM_OK;
}

/* Grows the shard buffers to hold `need` tokens (at most shard_tokens). */
static fm_status reserve(prep *p, int64_t need) {
    if (need <= p->cap_shard) return FM_OK;
    int64_t cap = p->cap_shard ? p->cap_shard : 1 << 16;
    while (cap < need) cap *= 2;
    if (cap > p->o->shard_tokens) cap = p->o->shard_tokens;
    int32_t *s = fm_malloc((size_t)cap * sizeof *s);
    uint8_t *m = fm_malloc((size_t)cap);
    if (!s || !m) {
        fm_free(s);
        fm_free(m);
        return fm_error(FM_ERR_NOMEM, "prepare: out of memory for a %lld-token shard; lower --shard-tokens", (long long)cap);
    }
    if (p->n_shard) {
        memcpy(s, p->shard, (size_t)p->n_shard * sizeof *s);
        memcpy(m, p->mask, (size_t)p->n_shard);
    }
    fm_free(p->shard);
    fm_free(p->mask);
    p->shard = s;
    p->mask = m;
    p->cap_shard = cap;
    return FM_OK;
}

/* Appends ids with mask byte m (or, when masks is not NULL, masks[i] each), flushing full shards. */
static fm_status push_masks(prep *p, const int32_t *ids, int64_t n, uint8_t m, const uint8_t *masks) {
    while (n > 0) {
        const int64_t room = p->o->shard_tokens - p->n_shard, k = n < room ? n : room;
        FM_TRY(reserve(p, p->n_shard + k));
        if (k > 0 && (p->doc_begin || p->n_shard == 0)) FM_TRY(doc_mark(p));
        memcpy(p->shard + p->n_shard, ids, (size_t)k * sizeof *ids);
        if (masks) {
            memcpy(p->mask + p->n_shard, masks, (size_t)k);
            for (int64_t i = 0; i < k; i++) p->st.masked += !masks[i];
            masks += k;
        } else {
            memset(p->mask + p->n_shard, m, (size_t)k);
            if (!m) p->st.masked += k;
        }
        p->n_shard += k;
        p->st.tokens += k;
        ids += k;
        n -= k;
        if (p->n_shard == p->o->shard_tokens) FM_TRY(flush_shard(p));
    }
    return FM_OK;
}

static fm_status push(prep *p, const int32_t *ids, int64_t n, uint8_t m) { return push_masks(p, ids, n, m, NULL); }

/* Encodes one part of a document and appends it with mask byte m. */
static fm_status part(prep *p, const char *s, size_t n, uint8_t m) {
    p->n_ids = 0;
    FM_TRY(fm_tokenizer_encode_append(p->tok, s, n, &p->ids, &p->n_ids, &p->cap_ids));
    return push(p, p->ids, p->n_ids, m);
}

/* Ends a document: EOS with mask byte eos_mask (eos_mask < 0 or no_eos: none), the progress. */
static fm_status end_document(prep *p, int eos_mask) {
    p->st.documents++;
    if (!p->o->no_eos && eos_mask >= 0) FM_TRY(push(p, &p->tok->eos_id, 1, (uint8_t)eos_mask));
    p->doc_begin = true;
    const double t = now_s();
    if (p->o->progress && t - p->last >= p->o->progress_s) {
        p->last = t;
        p->st.seconds = t - p->t0;
        p->o->progress(&p->st, p->o->ctx);
    }
    return FM_OK;
}

static fm_status read_whole(const char *path, char **buf, size_t *n) {
    *buf = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return fm_error(FM_ERR_IO, "%s: cannot open input: %s; check the path given to --input", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return fm_error(FM_ERR_IO, "%s: expected a regular file (text or JSONL), found %s", path,
                        S_ISDIR(st.st_mode) ? "a directory" : "something else");
    }
    *buf = fm_malloc((size_t)st.st_size + 1);
    if (!*buf) {
        fclose(f);
        return fm_error(FM_ERR_NOMEM, "%s: out of memory for its %lld bytes", path, (long long)st.st_size);
    }
    *n = fread(*buf, 1, (size_t)st.st_size, f);
    const bool bad = *n != (size_t)st.st_size;
    fclose(f);
    if (bad) {
        fm_free(*buf);
        *buf = NULL;
        return fm_error(FM_ERR_IO, "%s: read %zu of %lld bytes", path, *n, (long long)st.st_size);
    }
    return FM_OK;
}

static const char *str_field(const cJSON *o, const char *k, bool *present) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    *present = v != NULL;
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* ---- chat records ---- */

/* The role map "FROM=TO,..." into p->map_from / map_to. */
static fm_status parse_role_map(prep *p, const char *map) {
    for (const char *q = map; q && *q;) {
        const char *comma = strchr(q, ','), *e = comma ? comma : q + strlen(q), *eq = memchr(q, '=', (size_t)(e - q));
        if (!eq || eq == q || eq - q >= 64 || e - eq - 1 >= 64 || p->n_map == MAX_ROLE_MAP)
            return fm_error(FM_ERR_ARG, "--role-map '%s': expected FROM=TO pairs separated by commas (TO empty: drop "
                            "the message; at most %d pairs, names under 64 bytes), e.g. bot=assistant,narrator=",
                            map, MAX_ROLE_MAP);
        snprintf(p->map_from[p->n_map], 64, "%.*s", (int)(eq - q), q);
        snprintf(p->map_to[p->n_map], 64, "%.*s", (int)(e - eq - 1), eq + 1);
        p->n_map++;
        q = comma ? comma + 1 : e;
    }
    return FM_OK;
}

/* The accepted role an unknown one most likely means (for the hint of the error), or NULL:
 * another case of an accepted role, or a name other data sets use (OpenAI's developer and
 * function, ShareGPT's human and gpt, Gemini's model, Llama 3.1's ipython). */
static const char *likely_role(const char *r) {
    static const char *const alias[][2] = {{"developer", "system"}, {"human", "user"}, {"gpt", "assistant"},
                                           {"bot", "assistant"}, {"model", "assistant"}, {"ai", "assistant"},
                                           {"function", "tool"}, {"ipython", "tool"}, {"observation", "tool"},
                                           {"system", "system"}, {"user", "user"}, {"assistant", "assistant"},
                                           {"tool", "tool"}};
    for (size_t i = 0; i < sizeof alias / sizeof alias[0]; i++)
        if (!strcasecmp(r, alias[i][0])) return alias[i][1];
    return NULL;
}

/* The record's messages with the role map applied and the roles checked, as a new array (*out,
 * the caller deletes it); plain: each content must be a string (flatmoe's own form). */
static fm_status chat_messages(prep *p, const cJSON *msgs, bool plain, const char *file, int64_t line, cJSON **out) {
    static const char *const accepted[] = {"system", "user", "assistant", "tool", NULL};
    *out = NULL;
    if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0)
        return fm_error(FM_ERR_FORMAT, "%s:%lld: \"messages\" must be a non-empty array of {\"role\", \"content\"}",
                        file, (long long)line);
    cJSON *m = cJSON_Duplicate(msgs, true);
    if (!m) return fm_error(FM_ERR_NOMEM, "prepare: out of memory for a record");
    int k = 0, dropped = 0;
    for (cJSON *e = m->child, *next; e; e = next, k++) {
        next = e->next;
        cJSON *role = cJSON_GetObjectItemCaseSensitive(e, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsObject(e) || !cJSON_IsString(role) || (plain && !cJSON_IsString(content))) {
            cJSON_Delete(m);
            return fm_error(FM_ERR_FORMAT, "%s:%lld: messages[%d] needs a \"role\" string and a \"content\" %s", file,
                            (long long)line, k, plain ? "string" : "(a string, or null beside tool_calls)");
        }
        for (int i = 0; i < p->n_map; i++)
            if (!strcmp(role->valuestring, p->map_from[i])) {
                if (!p->map_to[i][0]) break;
                cJSON_SetValuestring(role, p->map_to[i]);
                break;
            }
        bool drop = false;
        for (int i = 0; i < p->n_map; i++) drop |= !p->map_to[i][0] && !strcmp(role->valuestring, p->map_from[i]);
        if (drop) {
            cJSON_Delete(cJSON_DetachItemViaPointer(m, e));
            dropped++;
            continue;
        }
        int a = 0;
        while (accepted[a] && strcmp(accepted[a], role->valuestring)) a++;
        if (!accepted[a]) {
            const char *to = likely_role(role->valuestring);
            fm_status s = fm_error(FM_ERR_FORMAT, "%s:%lld: messages[%d] has role \"%.100s\"; accepted: system, user, "
                                   "assistant, tool; rename or drop other roles with --role-map (e.g. --role-map "
                                   "%.100s=%s, or %.100s= to drop those messages)", file, (long long)line, k,
                                   role->valuestring, role->valuestring, to ? to : "assistant", role->valuestring);
            cJSON_Delete(m);
            return s;
        }
    }
    if (!m->child) {
        cJSON_Delete(m);
        return fm_error(FM_ERR_FORMAT, "%s:%lld: no message is left after --role-map dropped %d", file, (long long)line,
                        dropped);
    }
    p->st.dropped += dropped;
    *out = m;
    return FM_OK;
}

/* flatmoe's own chat form (no chat template): "<|R|>\n" masked, "X\n" a target when R is the
 * assistant's, then EOS. */
static fm_status chat_plain(prep *p, const cJSON *m) {
    bool last_assistant = false, any = false;
    const cJSON *e;
    cJSON_ArrayForEach(e, m) {
        const char *role = cJSON_GetObjectItemCaseSensitive(e, "role")->valuestring;
        const char *content = cJSON_GetObjectItemCaseSensitive(e, "content")->valuestring;
        char head[256];
        int hn = snprintf(head, sizeof head, "<|%s|>\n", role);
        last_assistant = !strcmp(role, "assistant");
        any |= last_assistant;
        FM_TRY(part(p, head, (size_t)hn, p->o->loss_all ? 1 : 0));
        const size_t cl = strlen(content); /* content and its newline as one part */
        char *buf = fm_malloc(cl + 2);
        if (!buf) return fm_error(FM_ERR_NOMEM, "prepare: out of memory for a %zu-byte message", cl);
        memcpy(buf, content, cl);
        buf[cl] = '\n';
        fm_status s = part(p, buf, cl + 1, last_assistant || p->o->loss_all ? 1 : 0);
        fm_free(buf);
        FM_TRY(s);
    }
    if (!any && !p->o->loss_all) p->st.no_loss++;
    return end_document(p, last_assistant || p->o->loss_all ? 1 : 0);
}

/* The tokenizer's chat template: the whole conversation rendered and encoded as one text, the
 * assistant spans (prep/fm_chat.h) the loss targets. */
static fm_status chat_template(prep *p, const cJSON *m, const cJSON *tools, const char *file, int64_t line) {
    char *full = NULL;
    size_t n = 0;
    int ns = 0;
    fm_status s = fm_chat_render(p->o->chat, m, tools, false, &full, &n);
    if (!s && !p->o->loss_all)
        s = fm_chat_assistant_spans(p->o->chat, m, tools, full, n, p->span_start, p->span_end, p->span_content,
                                    MAX_SPANS, &ns);
    if (s) {
        fm_free(full);
        if (s == FM_ERR_NOMEM) return s;
        char msg[1024]; /* fm_error formats into the buffer fm_errmsg reads */
        snprintf(msg, sizeof msg, "%s", fm_errmsg());
        /* the record's line too: an unsupported construct met only on some records stays an error */
        return fm_error(s == FM_ERR_UNSUPPORTED ? s : FM_ERR_FORMAT, "%s:%lld: %s", file, (long long)line, msg);
    }
    p->n_ids = 0;
    s = fm_tokenizer_encode_append(p->tok, full, n, &p->ids, &p->n_ids, &p->cap_ids);
    if (!s && p->n_ids > p->cap_tmask) {
        fm_free(p->tmask);
        p->cap_tmask = p->cap_ids;
        if (!(p->tmask = fm_malloc((size_t)p->cap_tmask))) s = fm_error(FM_ERR_NOMEM, "prepare: out of memory for a mask");
    }
    if (!s) {
        memset(p->tmask, p->o->loss_all ? 1 : 0, (size_t)p->n_ids);
        if (!p->o->loss_all)
            s = fm_chat_token_mask(p->tok, p->o->chat, full, p->ids, p->n_ids, p->span_start, p->span_end,
                                   p->span_content, ns, p->tmask);
    }
    fm_free(full);
    FM_TRY(s);
    bool any = false;
    for (int64_t i = 0; i < p->n_ids && !any; i++) any = p->tmask[i];
    if (!any) p->st.no_loss++;
    FM_TRY(push_masks(p, p->ids, p->n_ids, 0, p->tmask));
    return end_document(p, -1); /* the template ends its turns */
}

static fm_status chat_record(prep *p, const cJSON *j, const cJSON *msgs, const char *file, int64_t line) {
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(j, "tools");
    if (tools && !cJSON_IsArray(tools) && !cJSON_IsNull(tools))
        return fm_error(FM_ERR_FORMAT, "%s:%lld: \"tools\" must be an array of tool descriptions", file, (long long)line);
    cJSON *m;
    FM_TRY(chat_messages(p, msgs, !p->o->chat, file, line, &m));
    p->any_masked_form = true;
    fm_status s = p->o->chat ? chat_template(p, m, cJSON_IsArray(tools) ? tools : NULL, file, line) : chat_plain(p, m);
    cJSON_Delete(m);
    return s;
}

/* One JSONL record. */
static fm_status record(prep *p, const cJSON *j, const char *file, int64_t line) {
    if (!cJSON_IsObject(j))
        return fm_error(FM_ERR_FORMAT, "%s:%lld: expected a JSON object per line, found another JSON value", file,
                        (long long)line);
    bool has_text, has_prompt, has_compl;
    const char *text = str_field(j, "text", &has_text);
    const char *prompt = str_field(j, "prompt", &has_prompt), *compl = str_field(j, "completion", &has_compl);
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(j, "messages");
    if (has_prompt || has_compl) {
        if (!prompt || !compl)
            return fm_error(FM_ERR_FORMAT, "%s:%lld: a prompt/completion record needs both \"prompt\" and \"completion\" "
                            "as strings", file, (long long)line);
        p->any_masked_form = true;
        if (!compl[0] && p->o->no_eos) p->st.no_loss++;
        FM_TRY(part(p, prompt, strlen(prompt), 0));
        FM_TRY(part(p, compl, strlen(compl), 1));
        return end_document(p, 1);
    }
    if (msgs) return chat_record(p, j, msgs, file, line);
    if (has_text) {
        if (!text) return fm_error(FM_ERR_FORMAT, "%s:%lld: \"text\" must be a string", file, (long long)line);
        FM_TRY(part(p, text, strlen(text), 1));
        return end_document(p, 1);
    }
    char keys[256] = "";
    const cJSON *c;
    cJSON_ArrayForEach(c, j) {
        if (strlen(keys) + strlen(c->string) + 3 >= sizeof keys) break;
        if (keys[0]) strcat(keys, ", ");
        strcat(keys, c->string);
    }
    return fm_error(FM_ERR_FORMAT, "%s:%lld: a record with none of the known keys (found: %s); expected {\"text\": ...}, "
                    "{\"prompt\": ..., \"completion\": ...} or {\"messages\": [...]}", file, (long long)line,
                    keys[0] ? keys : "no keys");
}

static fm_status jsonl_file(prep *p, const char *file, const char *buf, size_t n) {
    int64_t line = 0;
    size_t i0 = n >= 3 && !memcmp(buf, "\xEF\xBB\xBF", 3) ? 3 : 0; /* a UTF-8 byte order mark */
    p->st.bytes += (int64_t)i0;
    for (size_t i = i0; i < n;) {
        const char *nl = memchr(buf + i, '\n', n - i);
        const size_t e = nl ? (size_t)(nl - buf) : n;
        line++;
        size_t a = i;
        while (a < e && (buf[a] == ' ' || buf[a] == '\t' || buf[a] == '\r')) a++;
        if (a < e) {
            const char *end = NULL;
            cJSON *j = cJSON_ParseWithLengthOpts(buf + a, e - a, &end, false);
            bool trailing = false;
            if (j && end) {
                const char *q = end;
                while (q < buf + e && (*q == ' ' || *q == '\t' || *q == '\r')) q++;
                trailing = q < buf + e;
            }
            fm_status s;
            if (!j || trailing) { /* cJSON's end: where parsing stopped (the error) or the object ended */
                const long long col = end && end >= buf + i && end <= buf + e ? (long long)(end - (buf + i)) + 1 : 0;
                s = fm_error(FM_ERR_FORMAT, "%s:%lld: malformed JSON %s column %lld; expected one JSON object per "
                             "line%s", file, (long long)line, trailing ? "(text after the object) from" : "at", col,
                             p->o->skip_bad ? "" : " (--skip-bad-records skips such lines with a warning)");
            }
            else s = record(p, j, file, line);
            cJSON_Delete(j);
            if (s == FM_ERR_FORMAT && p->o->skip_bad) { /* nothing of the record was written: checked first */
                fm_log(FM_LOG_WARN, "warning: prepare: record skipped: %s\n", fm_errmsg());
                p->st.bad_records++;
                s = FM_OK;
            }
            FM_TRY(s);
        }
        p->st.bytes += (int64_t)(e - i) + (nl ? 1 : 0);
        i = e + 1;
    }
    return FM_OK;
}

static bool is_jsonl(const char *path) {
    const char *dot = strrchr(path, '.');
    return dot && (!strcmp(dot, ".jsonl") || !strcmp(dot, ".json"));
}

static fm_status run(prep *p) {
    const fm_prepare_opts *o = p->o;
    for (int i = 0; i < o->n_inputs; i++) {
        const char *file = o->inputs[i];
        p->st.file = file;
        char *buf;
        size_t n = 0;
        FM_TRY(read_whole(file, &buf, &n));
        const bool jl = o->format == FM_PREP_JSONL || (o->format == FM_PREP_AUTO && is_jsonl(file));
        fm_status s;
        if (jl) s = jsonl_file(p, file, buf, n);
        else {
            s = part(p, buf, n, 1);
            p->st.bytes += (int64_t)n;
            if (!s) s = end_document(p, 1);
        }
        fm_free(buf);
        FM_TRY(s);
    }
    FM_TRY(flush_shard(p));
    if (p->st.tokens == 0 && p->st.bad_records)
        return fm_error(FM_ERR_FORMAT, "prepare: every record was malformed (%lld skipped, each named above); no "
                        "tokens were made: fix the records", (long long)p->st.bad_records);
    if (p->st.tokens == 0)
        return fm_error(FM_ERR_ARG, "prepare: the inputs hold no text (no tokens were made); give non-empty files");
    /* everything was written: the final names */
    char from[4300], to[4300];
    for (int64_t k = 0; k < p->st.shards; k++) {
        part_name(p, k, ".part", from, sizeof from);
        part_name(p, k, "", to, sizeof to);
        if (rename(from, to) != 0)
            return fm_error(FM_ERR_IO, "%s: cannot rename %s to it: %s", to, from, strerror(errno));
        p->renamed = k + 1;
        part_name(p, k, ".mask.part", from, sizeof from);
        part_name(p, k, ".mask", to, sizeof to);
        if (!p->any_masked_form) {
            unlink(from);
            unlink(to); /* an earlier run's mask would be read with this shard */
        } else if (rename(from, to) != 0)
            return fm_error(FM_ERR_IO, "%s: cannot rename %s to it: %s", to, from, strerror(errno));
        part_name(p, k, ".docs.part", from, sizeof from);
        part_name(p, k, ".docs", to, sizeof to);
        if (rename(from, to) != 0)
            return fm_error(FM_ERR_IO, "%s: cannot rename %s to it: %s", to, from, strerror(errno));
    }
    /* an earlier run's shards past the last one (with their sidecars) would be read with these
     * by --data PREFIX_*.bin: removed */
    for (int64_t k = p->st.shards;; k++) {
        part_name(p, k, "", to, sizeof to);
        struct stat sb;
        if (stat(to, &sb) != 0) break;
        unlink(to);
        part_name(p, k, ".mask", to, sizeof to);
        unlink(to);
        part_name(p, k, ".docs", to, sizeof to);
        unlink(to);
        p->st.stale++;
    }
    return FM_OK;
}

/* Creates the folder of prefix (and its parents) when missing. */
static fm_status make_parent(const char *prefix) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s", prefix);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir) return FM_OK;
    *slash = '\0';
    for (char *q = dir + 1;; q++) {
        const bool end = *q == '\0';
        if (*q == '/' || end) {
            *q = '\0';
            struct stat st;
            if (stat(dir, &st) != 0 && mkdir(dir, 0777) != 0 && errno != EEXIST)
                return fm_error(FM_ERR_IO, "%s: cannot create the output folder: %s; check --out", dir, strerror(errno));
            if (stat(dir, &st) == 0 && !S_ISDIR(st.st_mode))
                return fm_error(FM_ERR_IO, "%s: exists and is not a folder; --out %s needs it to be one", dir, prefix);
            if (end) break;
            *q = '/';
        }
    }
    return FM_OK;
}

fm_status fm_prepare(fm_tokenizer *tok, const fm_prepare_opts *o, fm_prepare_stats *st) {
    memset(st, 0, sizeof *st);
    if (o->n_inputs < 1 || !o->out_prefix)
        return fm_error(FM_ERR_ARG, "prepare: give at least one input file and an output prefix");
    if (o->shard_tokens < 1 || o->shard_tokens > INT32_MAX)
        return fm_error(FM_ERR_ARG, "prepare: --shard-tokens %lld; expected 1 .. %d", (long long)o->shard_tokens, INT32_MAX);
    if (!o->no_eos && tok->eos_id < 0)
        return fm_error(FM_ERR_ARG, "%s: the tokenizer has no EOS token (none in tokenizer_config.json, "
                        "generation_config.json, config.json or the special tokens); add eos_token to the folder's "
                        "tokenizer_config.json or pass --no-eos", tok->path);
    prep p;
    memset(&p, 0, sizeof p);
    p.tok = tok;
    p.o = o;
    p.t0 = p.last = now_s();
    p.doc_begin = true;
    fm_status s = parse_role_map(&p, o->role_map);
    if (!s) s = make_parent(o->out_prefix);
    if (!s && o->chat) {
        p.span_start = fm_malloc(sizeof *p.span_start * MAX_SPANS);
        p.span_end = fm_malloc(sizeof *p.span_end * MAX_SPANS);
        p.span_content = fm_malloc(sizeof *p.span_content * MAX_SPANS);
        if (!p.span_start || !p.span_end || !p.span_content) s = fm_error(FM_ERR_NOMEM, "prepare: out of memory");
    }
    if (!s) s = run(&p);
    if (s) { /* no partial output: the .part files (and any already renamed) go */
        char path[4300];
        for (int64_t k = 0; k <= p.st.shards; k++) {
            const char *suffix[] = {".part", ".part.tmp", ".mask.part", ".mask.part.tmp", ".docs.part",
                                    ".docs.part.tmp", "", ".mask", ".docs"};
            for (int j = 0; j < (k < p.renamed ? 9 : 6); j++) {
                part_name(&p, k, suffix[j], path, sizeof path);
                unlink(path);
            }
        }
    }
    p.st.seconds = now_s() - p.t0;
    p.st.file = NULL;
    *st = p.st;
    if (!s && o->progress) o->progress(st, o->ctx);
    fm_free(p.shard);
    fm_free(p.mask);
    fm_free(p.ids);
    fm_free(p.tmask);
    fm_free(p.span_start);
    fm_free(p.span_end);
    fm_free(p.span_content);
    fm_free(p.docs);
    return s;
}
