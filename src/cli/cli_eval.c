/* flatmoe eval: validation loss and perplexity of a checkpoint on files. */
#include <math.h>
#include <stdio.h>

#include "backend/fm_backend_default.h"
#include "cli.h"
#include "data/fm_data.h"
#include "train/fm_trainer.h"

int cmd_eval(int argc, char **argv) {
    const char *ckpt_arg = NULL;
    static const char *data[MAX_FILES];
    int n_data = 0, threads = 0;
    int64_t seq_len = 0, micro_batch = 8, max_batches = 0;
    flag flags[] = {
        {"ckpt", F_STR, &ckpt_arg, NULL, "checkpoint folder, or run folder (its latest checkpoint) (required)"},
        {"data", F_FILES, data, &n_data, "files to score: text or llm.c shards (required)"},
        {"seq-len", F_I64, &seq_len, NULL, "tokens per window (default: the trained --seq-len)"},
        {"micro-batch", F_I64, &micro_batch, NULL, "windows per forward (8)"},
        {"max-batches", F_I64, &max_batches, NULL, "stop after N micro-batches, 0 = all windows (0)"},
        {"threads", F_INT, &threads, NULL, "CPU threads, 0 = all cores (0)"},
    };
    int r = cli_parse_flags("eval", "--ckpt DIR --data FILES [flags]", argc, argv, flags, sizeof flags / sizeof flags[0]);
    if (r) return r == 1 ? 0 : r;
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
    fm_dataset ds;
    if ((s = fm_dataset_load(&ds, data, n_data, cfg.vocab_size))) return cli_fail("eval", s);
    fm_backend be;
    if ((s = fm_backend_default_init(&be, threads, cfg.head_dim))) return cli_fail("eval", s);
    fm_model m;
    fm_param_store ps;
    memset(&ps, 0, sizeof ps);
    if ((s = fm_load_for_inference(&m, &ps, ckpt, be, micro_batch, seq_len, NULL))) return cli_fail("eval", s);
    if ((s = fm_dataset_check_windows(&ds, m.T_cap, "--data"))) return cli_fail("eval", s);
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
           ds.desc, (long long)ntok, (long long)m.T_cap, loss, exp(loss));
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
