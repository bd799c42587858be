/* flatmoe sample: generate text from a checkpoint (the sampler is train/fm_sample). With a
 * tokenizer (--tokenizer DIR, else the checkpoint folder's tokenizer.json) the prompt is encoded
 * with it, the output decoded, and generation stops at its EOS token; without one, each byte is a
 * token (byte-level models). */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "backend/fm_backend_default.h"
#include "cli.h"
#include "comm/fm_comm.h"
#include "prep/fm_chat.h"
#include "tok/fm_tokenizer.h"
#include "train/fm_sample.h"
#include "train/fm_trainer.h"

/* --tokenizer, else CKPT/tokenizer.json when present; *have = whether one was loaded. */
static fm_status sample_tokenizer(const char *flag, const char *ckpt, fm_tokenizer *tok, bool *have) {
    *have = false;
    char path[4200];
    struct stat st;
    if (!flag) {
        snprintf(path, sizeof path, "%s/tokenizer.json", ckpt);
        if (stat(path, &st) != 0) return FM_OK;
        flag = path;
    }
    FM_TRY(fm_tokenizer_load(tok, flag));
    *have = true;
    return FM_OK;
}

/* --chat: the prompt (and --system) rendered by the chat template of the tokenizer's folder with
 * the generation prompt, into *out (fm_malloc'd). Errors: no template in the folder (FM_ERR_ARG,
 * naming it); those of fm_chat_template_load and fm_chat_render. */
static fm_status chat_prompt(const char *tok_path, const char *system, const char *prompt, char **out, size_t *n) {
    fm_chat_template ct;
    FM_TRY(fm_chat_template_load(&ct, tok_path));
    if (!ct.t) {
        fm_chat_template_free(&ct);
        return fm_error(FM_ERR_ARG, "--chat: %s has no chat template (chat_template in tokenizer_config.json, or "
                        "chat_template.jinja); give a tokenizer folder with one, or leave --chat out", tok_path);
    }
    cJSON *msgs = cJSON_CreateArray(), *m;
    if (system && (m = cJSON_CreateObject())) {
        cJSON_AddStringToObject(m, "role", "system");
        cJSON_AddStringToObject(m, "content", system);
        cJSON_AddItemToArray(msgs, m);
    }
    if ((m = cJSON_CreateObject())) {
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", prompt);
        cJSON_AddItemToArray(msgs, m);
    }
    fm_status s = fm_chat_render(&ct, msgs, NULL, true, out, n);
    cJSON_Delete(msgs);
    fm_chat_template_free(&ct);
    return s;
}

/* Prints the decode of seq[0..n) beyond its first *printed bytes, holding back a trailing U+FFFD
 * (a character whose bytes are not all generated yet). */
static fm_status print_new_text(fm_tokenizer *tok, const int32_t *seq, int64_t n, size_t *printed, bool final) {
    char *text;
    size_t len;
    FM_TRY(fm_tokenizer_decode(tok, seq, n, false, &text, &len));
    size_t end = len;
    if (!final && end >= 3 && !memcmp(text + end - 3, "\xEF\xBF\xBD", 3)) end -= 3;
    if (end > *printed) {
        fwrite(text + *printed, 1, end - *printed, stdout);
        *printed = end;
    }
    fm_free(text);
    fflush(stdout);
    return FM_OK;
}

int cmd_sample(int argc, char **argv) {
    static fm_run_spec sp; /* the flags (run/fm_spec_flags.c rows of sample) */
    fm_spec_default(&sp, FM_CMD_SAMPLE);
    int r = cli_parse_spec("sample", "--ckpt DIR [--prompt TEXT] [flags]", argc, argv, &sp);
    if (r) return r == 1 ? 0 : r;
    const char *ckpt_arg = sp.infer.ckpt, *prompt = sp.infer.prompt, *tok_arg = sp.infer.tokenizer;
    const int64_t max_new = sp.infer.max_new_tokens, top_k = sp.infer.top_k, ctx_len = sp.infer.context;
    const double temperature = sp.infer.temperature;
    const uint64_t seed = sp.train.seed;
    const int threads = sp.train.threads;
    const bool ignore_eos = sp.infer.ignore_eos;
    int rank = 0, size = 1; /* under mpirun / srun: rank 0 samples and prints the text once; the others have nothing to add */
    if (fm_comm_launcher(&rank, &size, NULL) == FM_OK && rank != 0) return 0;
    if (!ckpt_arg) return cli_usage_error("sample", "%s", "--ckpt is required");
    if (max_new < 0 || top_k < 0 || temperature < 0 || ctx_len < 0)
        return cli_usage_error("sample", "%s", "--max-new-tokens, --top-k, --temperature and --context must be >= 0");
    char ckpt[4096];
    fm_status s = cli_resolve_ckpt(ckpt_arg, ckpt, sizeof ckpt);
    if (s) return cli_fail("sample", s);
    fm_tokenizer tok;
    bool have_tok;
    if ((s = sample_tokenizer(tok_arg, ckpt, &tok, &have_tok))) return cli_fail("sample", s);
    if (sp.infer.chat && !have_tok)
        return cli_fail("sample", fm_error(FM_ERR_ARG, "--chat needs a tokenizer with a chat template: %s has no "
                                           "tokenizer.json; give --tokenizer DIR", ckpt));
    char *rendered = NULL;
    size_t rendered_n = 0;
    if (sp.infer.chat) { /* the prompt becomes the template's text up to the assistant's turn */
        if ((s = chat_prompt(tok_arg ? tok_arg : ckpt, sp.infer.system, prompt, &rendered, &rendered_n))) {
            fm_tokenizer_free(&tok);
            return cli_fail("sample", s);
        }
        prompt = rendered;
    }
    int32_t *ids = NULL;
    int64_t n_ids = 0, cap_ids = 0;
    if (have_tok) {
        if ((s = fm_tokenizer_encode_append(&tok, prompt, strlen(prompt), &ids, &n_ids, &cap_ids))) {
            fm_tokenizer_free(&tok);
            fm_free(rendered);
            return cli_fail("sample", s);
        }
        if (n_ids == 0 && tok.eos_id >= 0) { /* an empty prompt: start after an end of document */
            fm_free(ids);
            if (!(ids = fm_malloc(sizeof *ids))) s = fm_error(FM_ERR_NOMEM, "sample: out of memory");
            else ids[n_ids++] = tok.eos_id;
        }
    }
    fm_backend be;
    fm_config cfg;
    char cpath[4200];
    snprintf(cpath, sizeof cpath, "%s/config.json", ckpt);
    if (!s) s = fm_config_load(&cfg, cpath);
    if (!s && have_tok) s = cli_tokenizer_fits(&tok, cfg.vocab_size, cpath, tok_arg ? ckpt : NULL);
    if (!s) s = cli_backend_default_init(&be, threads, cfg.head_dim);
    if (s) {
        fm_free(ids);
        fm_free(rendered);
        if (have_tok) fm_tokenizer_free(&tok);
        return cli_fail("sample", s);
    }
    fm_model m;
    fm_param_store ps;
    memset(&ps, 0, sizeof ps);
    fm_sampler smp;
    memset(&smp, 0, sizeof smp);
    bool loaded = false;
    if ((s = fm_load_for_inference(&m, &ps, ckpt, be, 1, ctx_len, NULL)) == FM_OK) {
        loaded = true;
        const fm_sample_opts so = {temperature, top_k, seed};
        s = have_tok ? fm_sampler_init_ids(&smp, &m, ids, n_ids, max_new, &so)
                     : fm_sampler_init(&smp, &m, prompt, strlen(prompt), max_new, &so);
    }
    if (!s) {
        fwrite(prompt, 1, strlen(prompt), stdout);
        size_t printed = 0, base = 0;
        const int64_t n_prompt = smp.n;
        if (have_tok) { /* the prompt's own decode: what is printed after it is new */
            char *text;
            if ((s = fm_tokenizer_decode(&tok, smp.seq, n_prompt, false, &text, &base)) == FM_OK) fm_free(text);
            printed = base;
        }
        bool at_eos = false;
        for (int64_t step = 0; s == FM_OK && step < max_new; step++) {
            int32_t next;
            if ((s = fm_sampler_next(&smp, &next))) break;
            if (have_tok) {
                if ((at_eos = next == tok.eos_id && !ignore_eos)) break;
                s = print_new_text(&tok, smp.seq, smp.n, &printed, false);
            } else if (next < 256) putchar(next);
            else printf("<%d>", next);
            fflush(stdout);
        }
        if (have_tok && s == FM_OK) s = print_new_text(&tok, smp.seq, smp.n - (at_eos ? 1 : 0), &printed, true);
        putchar('\n');
    }
    fm_sampler_free(&smp);
    if (loaded) {
        fm_model_free(&m);
        fm_param_store_free(&ps);
    }
    fm_backend_default_free(&be);
    fm_free(ids);
    fm_free(rendered);
    if (have_tok) fm_tokenizer_free(&tok);
    return s ? cli_fail("sample", s) : 0;
}
