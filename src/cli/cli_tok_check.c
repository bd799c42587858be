/* The tokenizer against the model it feeds (issue 28 item 3): a tokenizer with ids the model's
 * vocabulary lacks, one far smaller than that vocabulary (whose samples would be the ids it cannot
 * decode, printed as nothing), or one given to sample/eval that is not the checkpoint's own, is refused at
 * load, before any text is made (it would give a garbage sample or a meaningless loss). */
#include <stdio.h>
#include <sys/stat.h>

#include "cli.h"

fm_status cli_tokenizer_fits(const fm_tokenizer *tok, int64_t model_vocab, const char *model_path,
                             const char *own_dir) {
    if (tok->vocab_size > model_vocab)
        return fm_error(FM_ERR_ARG, "tokenizer %s has ids up to %lld (vocabulary %lld) but the model %s has vocab_size "
                        "%lld: the tokenizer is not this model's; give the model's own tokenizer (its folder's "
                        "tokenizer.json) or a model whose vocab_size is at least %lld", tok->path,
                        (long long)tok->vocab_size - 1, (long long)tok->vocab_size, model_path, (long long)model_vocab,
                        (long long)tok->vocab_size);
    /* far smaller: the model's vocabulary is not padding of this one (models pad by a few percent at
     * most: Qwen3 151669 of 151936, GPT-OSS 200019 of 201088, DeepSeek-V2 100015 of 102400) */
    if (tok->vocab_size * 10 < model_vocab * 9)
        return fm_error(FM_ERR_ARG, "tokenizer %s has a vocabulary of %lld but the model %s has vocab_size %lld: "
                        "%.0f%% of the model's ids are no token of it (a model pads its vocabulary by a few percent "
                        "at most), so the tokenizer is not this model's; give the model's own tokenizer (its folder's "
                        "tokenizer.json)", tok->path, (long long)tok->vocab_size, model_path, (long long)model_vocab,
                        100.0 * (double)(model_vocab - tok->vocab_size) / (double)model_vocab);
    if (!own_dir) return FM_OK;
    char own[4200];
    struct stat st;
    snprintf(own, sizeof own, "%s/tokenizer.json", own_dir);
    if (stat(own, &st) != 0) return FM_OK;
    fm_tokenizer mine;
    fm_status s = fm_tokenizer_load(&mine, own);
    if (s) return s;
    const int64_t v = mine.vocab_size;
    fm_tokenizer_free(&mine);
    if (v != tok->vocab_size)
        return fm_error(FM_ERR_ARG, "--tokenizer %s has a vocabulary of %lld but the checkpoint's own %s has %lld: it "
                        "is not the tokenizer the model was trained with; leave --tokenizer out (the checkpoint's is "
                        "used) or give the matching one", tok->path, (long long)tok->vocab_size, own, (long long)v);
    return FM_OK;
}
