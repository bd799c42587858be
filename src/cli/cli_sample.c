/* flatmoe sample: generate text from a checkpoint (the sampler is train/fm_sample). */
#include <stdio.h>
#include <string.h>

#include "backend/fm_backend_default.h"
#include "cli.h"
#include "train/fm_sample.h"
#include "train/fm_trainer.h"

int cmd_sample(int argc, char **argv) {
    const char *ckpt_arg = NULL, *prompt = "\n";
    int64_t max_new = 256, top_k = 0, ctx_len = 0;
    double temperature = 0.8;
    uint64_t seed = 1337;
    int threads = 0;
    flag flags[] = {
        {"ckpt", F_STR, &ckpt_arg, NULL, "checkpoint folder, or run folder (its latest checkpoint) (required)"},
        {"prompt", F_STR, &prompt, NULL, "text to continue (byte-level models) (a newline)"},
        {"max-new-tokens", F_I64, &max_new, NULL, "tokens to generate (256)"},
        {"temperature", F_F64, &temperature, NULL, "softmax temperature, 0 = greedy (0.8)"},
        {"top-k", F_I64, &top_k, NULL, "sample among the k most likely tokens, 0 = all (0)"},
        {"seed", F_U64, &seed, NULL, "sampling seed (1337)"},
        {"context", F_I64, &ctx_len, NULL, "context window in tokens (default: the trained --seq-len)"},
        {"threads", F_INT, &threads, NULL, "CPU threads, 0 = all cores (0)"},
    };
    int r = cli_parse_flags("sample", "--ckpt DIR [--prompt TEXT] [flags]", argc, argv, flags, sizeof flags / sizeof flags[0]);
    if (r) return r == 1 ? 0 : r;
    if (!ckpt_arg) return cli_usage_error("sample", "%s", "--ckpt is required");
    if (max_new < 0 || top_k < 0 || temperature < 0 || ctx_len < 0)
        return cli_usage_error("sample", "%s", "--max-new-tokens, --top-k, --temperature and --context must be >= 0");
    char ckpt[4096];
    fm_status s = cli_resolve_ckpt(ckpt_arg, ckpt, sizeof ckpt);
    if (s) return cli_fail("sample", s);
    fm_backend be;
    fm_config cfg;
    char cpath[4200];
    snprintf(cpath, sizeof cpath, "%s/config.json", ckpt);
    if ((s = fm_config_load(&cfg, cpath))) return cli_fail("sample", s);
    if ((s = fm_backend_default_init(&be, threads, cfg.head_dim))) return cli_fail("sample", s);
    fm_model m;
    fm_param_store ps;
    memset(&ps, 0, sizeof ps);
    if ((s = fm_load_for_inference(&m, &ps, ckpt, be, 1, ctx_len, NULL))) {
        fm_backend_default_free(&be);
        return cli_fail("sample", s);
    }
    const fm_sample_opts so = {temperature, top_k, seed};
    fm_sampler smp;
    if ((s = fm_sampler_init(&smp, &m, prompt, strlen(prompt), max_new, &so))) {
        fm_model_free(&m);
    fm_param_store_free(&ps);
        fm_backend_default_free(&be);
        return cli_fail("sample", s);
    }
    fwrite(prompt, 1, strlen(prompt), stdout);
    for (int64_t step = 0; step < max_new; step++) {
        int32_t next;
        if ((s = fm_sampler_next(&smp, &next))) break;
        if (next < 256) putchar(next);
        else printf("<%d>", next);
        fflush(stdout);
    }
    putchar('\n');
    fm_sampler_free(&smp);
    fm_model_free(&m);
    fm_param_store_free(&ps);
    fm_backend_default_free(&be);
    return s ? cli_fail("sample", s) : 0;
}
