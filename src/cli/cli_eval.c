/* flatmoe eval: validation loss and perplexity of a checkpoint on files. With a tokenizer
 * (--tokenizer DIR, else the checkpoint folder's tokenizer.json) text files are encoded with it
 * (one file = one document, then EOS, as `flatmoe prepare` does) into temporary shards; without
 * one, text is bytes. llm.c shards are read as they are either way. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/fm_backend_default.h"
#include "cli.h"
#include "comm/fm_comm.h"
#include "data/fm_data.h"
#include "tok/fm_tokenizer.h"
#include "train/fm_trainer.h"

/* True when path starts like an llm.c shard (>= 1024 bytes, a known magic). */
static bool looks_like_shard(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    unsigned char h[4];
    struct stat st;
    bool yes = fstat(fileno(f), &st) == 0 && st.st_size >= FM_SHARD_HEADER_BYTES && fread(h, 1, 4, f) == 4;
    fclose(f);
    if (!yes) return false;
    const uint32_t magic = (uint32_t)h[0] | ((uint32_t)h[1] << 8) | ((uint32_t)h[2] << 16) | ((uint32_t)h[3] << 24);
    return magic == FM_SHARD_MAGIC_V1 || magic == FM_SHARD_MAGIC_V7;
}

/* Encodes each text file of data[0..n) with tok into tmpdir/NNN.bin and points data[i] at it
 * (paths in names[FM_SPEC_MAX_FILES][4200]). */
static fm_status tokenize_text_files(fm_tokenizer *tok, const char **data, int n, const char *tmpdir,
                                     char (*names)[4200]) {
    for (int i = 0; i < n; i++) {
        if (looks_like_shard(data[i])) continue;
        FILE *f = fopen(data[i], "rb");
        if (!f) return fm_error(FM_ERR_IO, "%s: cannot open data file; check the path given to --data", data[i]);
        fseek(f, 0, SEEK_END);
        const long sz = ftell(f);
        fseek(f, 0, SEEK_SET);
        char *buf = fm_malloc((size_t)(sz > 0 ? sz : 0) + 1);
        const size_t got = buf ? fread(buf, 1, (size_t)(sz > 0 ? sz : 0), f) : 0;
        fclose(f);
        if (!buf) return fm_error(FM_ERR_NOMEM, "%s: out of memory for %ld bytes", data[i], sz);
        fm_status js = fm_data_refuse_json(data[i], buf, got); /* chat data goes through prepare */
        if (js) {
            fm_free(buf);
            return js;
        }
        int32_t *ids = NULL;
        int64_t n_ids = 0, cap = 0;
        fm_status s = fm_tokenizer_encode_append(tok, buf, got, &ids, &n_ids, &cap);
        fm_free(buf);
        if (!s && tok->eos_id >= 0) { /* the EOS after the document */
            int32_t *w = fm_malloc(sizeof *w * (size_t)(n_ids + 1));
            if (!w) s = fm_error(FM_ERR_NOMEM, "eval: out of memory for %lld tokens", (long long)n_ids + 1);
            else {
                if (n_ids) memcpy(w, ids, sizeof *w * (size_t)n_ids);
                w[n_ids++] = tok->eos_id;
                fm_free(ids);
                ids = w;
            }
        }
        snprintf(names[i], 4200, "%s/%03d.bin", tmpdir, i);
        if (!s && n_ids == 0) s = fm_error(FM_ERR_ARG, "%s: holds no text to score", data[i]);
        if (!s) s = fm_shard_write(names[i], ids, n_ids, 7);
        fm_free(ids);
        if (s) return s;
        data[i] = names[i];
    }
    return FM_OK;
}

static void remove_tmp(const char *tmpdir, int n) {
    char p[4200];
    for (int i = 0; i < n; i++) {
        snprintf(p, sizeof p, "%s/%03d.bin", tmpdir, i);
        unlink(p);
    }
    rmdir(tmpdir);
}

int cmd_eval(int argc, char **argv) {
    static fm_run_spec sp; /* the flags (run/fm_spec_flags.c rows of eval) */
    fm_spec_default(&sp, FM_CMD_EVAL);
    int r = cli_parse_spec("eval", "--ckpt DIR --data FILES [flags]", argc, argv, &sp);
    if (r) return r == 1 ? 0 : r;
    const char *ckpt_arg = sp.infer.ckpt, *tok_arg = sp.infer.tokenizer;
    const char **data = sp.data_files;
    const int n_data = sp.train.n_data, threads = sp.train.threads;
    const int64_t seq_len = sp.train.seq_len, micro_batch = sp.train.micro_batch, max_batches = sp.infer.max_batches;
    int rank = 0, size = 1; /* under mpirun / srun: rank 0 evaluates the checkpoint on every window and prints its loss once; the others have nothing to add */
    if (fm_comm_launcher(&rank, &size, NULL) == FM_OK && rank != 0) return 0;
    if (!ckpt_arg) return cli_usage_error("eval", "%s", "--ckpt is required");
    if (n_data == 0) return cli_usage_error("eval", "%s", "--data is required");
    if (micro_batch < 1 || seq_len < 0 || max_batches < 0)
        return cli_usage_error("eval", "%s", "--micro-batch must be >= 1, --seq-len and --max-batches >= 0");
    char ckpt[4096];
    fm_status s = cli_resolve_ckpt(ckpt_arg, ckpt, sizeof ckpt);
    if (s) return cli_fail("eval", s);
    fm_config cfg;
    char cpath[4200];
    snprintf(cpath, sizeof cpath, "%s/config.json", ckpt);
    if ((s = fm_config_load(&cfg, cpath))) return cli_fail("eval", s);
    char tpath[4200];
    struct stat st;
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", ckpt);
    if (!tok_arg && stat(tpath, &st) == 0) tok_arg = tpath;
    fm_dataset ds;
    if (tok_arg) {
        static char names[FM_SPEC_MAX_FILES][4200];
        char tmpdir[] = "/tmp/flatmoe-eval-XXXXXX";
        fm_tokenizer tok;
        if ((s = fm_tokenizer_load(&tok, tok_arg))) return cli_fail("eval", s);
        if ((s = cli_tokenizer_fits(&tok, cfg.vocab_size, cpath, tok_arg != tpath ? ckpt : NULL))) {
            fm_tokenizer_free(&tok);
            return cli_fail("eval", s);
        }
        if (!mkdtemp(tmpdir)) s = fm_error(FM_ERR_IO, "eval: cannot create a temporary folder in /tmp");
        if (!s) s = tokenize_text_files(&tok, data, n_data, tmpdir, names);
        fm_tokenizer_free(&tok);
        if (!s) s = fm_dataset_load(&ds, data, n_data, cfg.vocab_size);
        remove_tmp(tmpdir, n_data);
        if (s) return cli_fail("eval", s);
    } else if ((s = fm_dataset_load(&ds, data, n_data, cfg.vocab_size))) return cli_fail("eval", s);
    fm_backend be;
    if ((s = cli_backend_default_init(&be, threads, cfg.head_dim))) return cli_fail("eval", s);
    fm_model m;
    fm_param_store ps;
    memset(&ps, 0, sizeof ps);
    fm_trained_info trained;
    if ((s = fm_load_for_inference(&m, &ps, ckpt, be, micro_batch, seq_len, &trained))) return cli_fail("eval", s);
    if ((s = fm_dataset_check_windows(&ds, m.a.T_cap, "--data"))) return cli_fail("eval", s);
    double loss;
    int64_t ntok;
    if ((s = fm_evaluate(&m, &ds, max_batches, &loss, &ntok))) {
        fm_dataset_free(&ds);
        fm_model_free(&m);
        fm_param_store_free(&ps);
        fm_backend_default_free(&be);
        return cli_fail("eval", s);
    }
    printf("checkpoint %s\ndata %s\ntokens scored %lld (windows of %lld)\nloss %.4f nats/token\nperplexity %.3f\n", ckpt,
           ds.desc, (long long)ntok, (long long)m.a.T_cap, loss, exp(loss));
    if (trained.expert_fp8)
        printf("experts: native precision (the checkpoint trained with --expert-precision fp8; eval does not "
               "quantize: train's own evaluation does)\n");
    if (ntok == 0) {
        fprintf(stderr, "flatmoe eval: error: %s: no target to score: every target of the windows read is masked "
                "(the data's loss mask) or ignored; give data with unmasked targets, or more --max-batches\n",
                ds.desc);
        return 1;
    }
    if (!isfinite(loss)) {
        fprintf(stderr, "flatmoe eval: error: %s: the loss is not finite (%g); the checkpoint's weights are damaged "
                "or diverged\n", ckpt, loss);
        return 1;
    }
    fm_model_free(&m);
    fm_param_store_free(&ps);
    fm_backend_default_free(&be);
    fm_dataset_free(&ds);
    return 0;
}
