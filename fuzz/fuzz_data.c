/* libFuzzer harness: training data files (data/fm_data_files.c, fm_dataset_load): llm.c shards
 * (versions 1 and 7), Megatron .bin/.idx pairs, text, each with or without a loss-mask sidecar.
 * Input: byte 0 the layout (mod 5: text, shard, shard + mask, Megatron, Megatron + mask), byte 1
 * the vocabulary size (mod 5: 256, 300, 50257, 65536, 2^31), then the files as length-prefixed
 * pieces (fm_fuzz.h fuzz_take: the shard or .idx, then the .bin or mask, then the Megatron mask).
 * A data set that loads must yield every token below the vocabulary size and mask bytes 0 or 1. */
#include "fm_fuzz.h"
#include "core/fm_rng.h"
#include "data/fm_data.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    static const int64_t vocabs[5] = {256, 300, 50257, 65536, INT64_C(1) << 31};
    const int layout = data[0] % 5;
    const int64_t vocab = vocabs[data[1] % 5];
    const uint8_t *p = data + 2, *a, *b, *c;
    size_t n = size - 2, la, lb, lc;
    fuzz_take(&p, &n, &a, &la);
    fuzz_take(&p, &n, &b, &lb);
    fuzz_take(&p, &n, &c, &lc);
    const char *path;
    unlink(fuzz_path("d.bin.mask")), unlink(fuzz_path("d.mask")), unlink(fuzz_path("d.idx"));
    switch (layout) {
    case 0: path = fuzz_write("d.txt", a, la); break;
    case 1: path = fuzz_write("d.bin", a, la); break;
    case 2: path = fuzz_write("d.bin", a, la); fuzz_write("d.mask", b, lb); break;
    case 3: fuzz_write("d.idx", a, la); path = fuzz_write("d.bin", b, lb); break;
    default: fuzz_write("d.idx", a, la); path = fuzz_write("d.bin", b, lb); fuzz_write("d.bin.mask", c, lc); break;
    }
    fm_dataset ds;
    const char *paths[1] = {path};
    if (fm_dataset_load(&ds, paths, 1, vocab) != FM_OK) {
        FUZZ_CHECK(ds.parts == NULL && ds.n_tokens == 0, "a refused data set was left loaded");
        return 0;
    }
    FUZZ_CHECK(ds.n_tokens >= 1, "a data set of %lld tokens", (long long)ds.n_tokens);
    int32_t tok[64];
    const int64_t k = ds.n_tokens < 64 ? ds.n_tokens : 64;
    fm_dataset_tokens(&ds, 0, k, tok);
    for (int64_t i = 0; i < k; i++) FUZZ_CHECK(tok[i] >= 0 && tok[i] < vocab, "token %lld is %d", (long long)i, tok[i]);
    fm_dataset_tokens(&ds, ds.n_tokens - k, k, tok);
    for (int64_t i = 0; i < k; i++) FUZZ_CHECK(tok[i] >= 0 && tok[i] < vocab, "token %lld from the end is %d", (long long)i, tok[i]);
    for (int64_t i = 0; i < k; i++) {
        const int m = fm_dataset_mask_at(&ds, ds.n_tokens - 1 - i);
        FUZZ_CHECK(m == 0 || m == 1, "mask %d", m);
    }
    if (fm_dataset_check_windows(&ds, 4, "data") == FM_OK) {
        fm_rng r;
        fm_rng_seed(&r, 1);
        int32_t in[8], tg[8];
        fm_dataset_sample_batch(&ds, &r, 2, 4, in, tg);
        for (int i = 0; i < 8; i++)
            FUZZ_CHECK(in[i] >= 0 && in[i] < vocab && ((tg[i] >= 0 && tg[i] < vocab) || tg[i] == FM_IGNORE_INDEX),
                       "batch position %d: input %d target %d", i, in[i], tg[i]);
    }
    if (ds.n_tokens >= 4) {
        fm_dataset tr, va;
        if (fm_dataset_split(&ds, 0.25, &tr, &va) == FM_OK) {
            FUZZ_CHECK(tr.n_tokens + va.n_tokens == ds.n_tokens, "the split lost tokens");
            fm_dataset_free(&tr);
            fm_dataset_free(&va);
        }
    }
    fm_dataset_free(&ds);
    return 0;
}
