/* flatmoe prepare: text and JSONL files -> llm.c token shards with loss masks (the work is
 * prep/fm_prepare), and --decode to read a shard back as text. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "data/fm_data.h"
#include "prep/fm_chat.h"
#include "prep/fm_prepare.h"
#include "tok/fm_tokenizer.h"

static void progress(const fm_prepare_stats *st, void *ctx) {
    (void)ctx;
    if (!st->file) return; /* the final call: the summary is printed by the command */
    const double mb = (double)st->bytes / 1e6;
    fprintf(stderr, "prepare: %s | %lld documents | %lld tokens | %lld shards | %.1f MB | %.2f MB/s\n", st->file,
            (long long)st->documents, (long long)st->tokens, (long long)st->shards, mb,
            st->seconds > 0 ? mb / st->seconds : 0.0);
}

/* --decode SHARD: the shard's tokens as text; with --show-mask the masked runs (mask byte 0 in
 * the shard's .mask sidecar, when it has one) are wrapped in "[[" and "]]". */
static int decode_shard(fm_tokenizer *tok, const char *path, bool show_mask) {
    const char *paths[1] = {path};
    FILE *probe = fopen(path, "rb"); /* before the loader, whose message names --data */
    if (!probe)
        return cli_fail("prepare", fm_error(FM_ERR_IO, "--decode %s: cannot open the shard: %s; give a shard that "
                                                       "`flatmoe prepare --out` wrote", path, strerror(errno)));
    fclose(probe);
    fm_dataset ds;
    fm_status s = fm_dataset_load(&ds, paths, 1, tok->vocab_size);
    if (s) return cli_fail("prepare", s);
    int32_t *ids = fm_malloc(sizeof *ids * (size_t)ds.n_tokens);
    if (!ids) {
        fm_dataset_free(&ds);
        return cli_fail("prepare", fm_error(FM_ERR_NOMEM, "%s: out of memory for its tokens", path));
    }
    fm_dataset_tokens(&ds, 0, ds.n_tokens, ids);
    const bool masks = show_mask && ds.has_mask;
    for (int64_t i = 0; i < ds.n_tokens && s == FM_OK;) {
        const int m = masks ? fm_dataset_mask_at(&ds, i) : 1;
        int64_t j = i + 1;
        while (j < ds.n_tokens && (!masks || fm_dataset_mask_at(&ds, j) == m)) j++;
        char *text;
        size_t len;
        if ((s = fm_tokenizer_decode(tok, ids + i, j - i, false, &text, &len))) break;
        if (!m) fputs("[[", stdout);
        fwrite(text, 1, len, stdout);
        if (!m) fputs("]]", stdout);
        fm_free(text);
        i = j;
    }
    fm_free(ids);
    fm_dataset_free(&ds);
    return s ? cli_fail("prepare", s) : 0;
}

int cmd_prepare(int argc, char **argv) {
    static fm_run_spec sp; /* the flags (run/fm_spec_flags.c rows of prepare) */
    fm_spec_default(&sp, FM_CMD_PREPARE);
    int r = cli_parse_spec("prepare", "--tokenizer DIR --input FILES --out SHARD_PREFIX [flags]", argc, argv, &sp);
    if (r) return r == 1 ? 0 : r;
    const fm_spec_prepare *p = &sp.prepare;
    const char *tok_dir = p->tokenizer, *out = p->out, *format = p->format, *decode = p->decode;
    const char *const *inputs = p->inputs;
    const int n_inputs = p->n_inputs;
    const int64_t shard_tokens = p->shard_tokens;
    const bool no_eos = p->no_eos, show_mask = p->show_mask;
    if (!tok_dir) return cli_usage_error("prepare", "%s", "--tokenizer is required");
    fm_prep_format fmt = FM_PREP_AUTO;
    if (!strcmp(format, "text")) fmt = FM_PREP_TEXT;
    else if (!strcmp(format, "jsonl")) fmt = FM_PREP_JSONL;
    else if (strcmp(format, "auto")) return cli_usage_error("prepare", "--format %s: expected text, jsonl or auto", format);
    if (!decode && (n_inputs == 0 || !out)) return cli_usage_error("prepare", "%s", "--input and --out are required");
    if (shard_tokens < 1) return cli_usage_error("prepare", "%s", "--shard-tokens must be >= 1");
    fm_tokenizer tok;
    fm_status s = fm_tokenizer_load(&tok, tok_dir);
    if (s) return cli_fail("prepare", s);
    if (decode) {
        int rc = decode_shard(&tok, decode, show_mask);
        fm_tokenizer_free(&tok);
        return rc;
    }
    if (strcmp(p->loss_on, "assistant") && strcmp(p->loss_on, "all")) {
        fm_tokenizer_free(&tok);
        return cli_usage_error("prepare", "--loss-on %s: expected assistant or all", p->loss_on);
    }
    fm_chat_template ct = {0};
    if (!p->no_chat_template && (s = fm_chat_template_load(&ct, tok_dir))) {
        fm_tokenizer_free(&tok);
        return cli_fail("prepare", s);
    }
    if (ct.t) printf("chat records: rendered with the chat template of %s\n", ct.path);
    fm_prepare_opts o = {.inputs = inputs, .n_inputs = n_inputs, .out_prefix = out, .shard_tokens = shard_tokens,
                         .format = fmt, .no_eos = no_eos, .chat = ct.t ? &ct : NULL,
                         .loss_all = !strcmp(p->loss_on, "all"), .role_map = p->role_map,
                         .skip_bad = p->skip_bad_records, .progress = progress, .ctx = NULL, .progress_s = 1.0};
    fm_prepare_stats st;
    s = fm_prepare(&tok, &o, &st);
    fm_chat_template_free(&ct);
    fm_tokenizer_free(&tok);
    if (s) return cli_fail("prepare", s);
    const double mb = (double)st.bytes / 1e6;
    printf("prepared %lld documents: %lld tokens (%lld masked), %lld shard%s %s_%06d.bin%s in %.2f s (%.1f MB, %.2f MB/s)\n",
           (long long)st.documents, (long long)st.tokens, (long long)st.masked, (long long)st.shards,
           st.shards == 1 ? "" : "s", out, 0, st.shards > 1 ? " ..." : "", st.seconds, mb,
           st.seconds > 0 ? mb / st.seconds : 0.0);
    if (st.no_loss)
        printf("note: %lld record%s without a loss target (no assistant turn, or an empty completion): kept, they only "
               "give context\n", (long long)st.no_loss, st.no_loss == 1 ? "" : "s");
    if (st.stale)
        printf("removed %lld shard%s of an earlier prepare to %s (past the last one written now)\n", (long long)st.stale,
               st.stale == 1 ? "" : "s", out);
    if (st.dropped) printf("--role-map dropped %lld message%s\n", (long long)st.dropped, st.dropped == 1 ? "" : "s");
    if (st.bad_records)
        printf("warning: %lld malformed record%s skipped (--skip-bad-records; each named above)\n",
               (long long)st.bad_records, st.bad_records == 1 ? "" : "s");
    return 0;
}
