/* libFuzzer harness: packed documents (issue 28): a data set with document boundaries read from
 * files (an llm.c shard with its FMDOCS01 index, data/fm_docs.c; a Megatron .bin/.idx whose
 * doc_idx groups sequences into documents, data/fm_data_files.c; each with or without a loss mask,
 * optionally beside a second part or split into train/validation views), then the packer
 * (data/fm_pack.h) over it: init, a seek to a fuzzed cursor (a checkpoint's), batches filled, and
 * the dry-run count.
 *
 * Input: 12 bytes, then the files as pieces (fm_fuzz.h fuzz_take). Byte 0 the layout (mod 4:
 * shard + .docs, shard + .docs + mask, Megatron, Megatron + mask); byte 1 the vocabulary size
 * (mod 3: 256, 50257, 65536); byte 2 T - 1 (mod 48); byte 3 rows - 1 (mod 8); byte 4 flags (bit 0
 * pad, 1 --pack-long split, 2 split the data (validation 1/4), 3 pack the validation view, 4 seek,
 * 5 a second part: a copy of the first, a shard without an index or the Megatron pair again);
 * bytes 5-8 the seed; bytes 9-11 the seek's epoch (mod 4), document (mod n_docs + 2) and position
 * (mod 2T + 2). Pieces: the shard or .idx, then the .docs or .bin, then the mask.
 *
 * Invariants: a refused data set or packer is an error with a message; a batch is a valid model
 * batch (fm_batch_check: tokens, targets -100 or in the vocabulary, positions restarting at each
 * document, document starts), each row filled to at most T with whole documents or pieces
 * (pad: one per row), within a document a target is the next position's token or -100, the rest
 * of a row is padding without targets; epochs never go back or skip one; from epoch 0 an epoch's
 * batches place every training position of the data once (their count, and a checksum of the
 * (input, target) pairs against the data set's own tokens and targets); the dry-run count equals
 * the batches filled. */
#include "fm_fuzz.h"
#include "data/fm_pack.h"
#include "model/fm_batch.h"

#define MAXT 48
#define MAXR 8
#define MAXBATCH 4096

/* A training position's (input, target) pair mixed into 64 bits; summed (wrapping, so in any
 * order) over an epoch it is a checksum of the multiset of pairs placed. */
static uint64_t pair_hash(int32_t tok, int32_t tgt) {
    uint64_t h = (uint64_t)(uint32_t)tok * 0x9E3779B97F4A7C15ull ^ (uint64_t)(uint32_t)tgt * 0xC2B2AE3D27D4EB4Full;
    h ^= h >> 31;
    return h * 0xBF58476D1CE4E5B9ull;
}

/* The training positions of the data (each document's tokens less one) and the checksum of their
 * (input, target) pairs, read straight from the data set. */
static int64_t units(const fm_dataset *ds, uint64_t *sum) {
    int64_t u = 0;
    *sum = 0;
    int32_t tok[256], tgt[256];
    for (int64_t d = 0; d < ds->n_docs; d++) {
        const int64_t n = fm_dataset_doc_len(ds, d) - 1;
        for (int64_t i0 = 0; i0 < n; i0 += 256) {
            const int64_t k = n - i0 < 256 ? n - i0 : 256;
            fm_dataset_tokens(ds, ds->docs[d] + i0, k, tok);
            fm_dataset_targets(ds, ds->docs[d] + i0 + 1, k, tgt);
            for (int64_t i = 0; i < k; i++) *sum += pair_hash(tok[i], tgt[i]);
        }
        u += n > 0 ? n : 0;
    }
    return u;
}

/* Checks one batch of `rows` rows; returns the positions it placed and adds their pairs to *sum. */
static int64_t check_batch(const fm_packer *pk, int64_t rows, int64_t V, int32_t *tok, int32_t *tgt, int32_t *pos,
                           int32_t *ds_, uint64_t *sum) {
    const int64_t T = pk->T;
    fm_batch fb = {.tokens = tok, .targets = tgt, .B = rows, .T = T, .pos = pos, .doc_start = ds_};
    FUZZ_CHECK(fm_batch_check(&fb, rows, T, V) == FM_OK, "an invalid packed batch: %s", fm_errmsg());
    int64_t placed = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t used = pk->used[r], at = r * T;
        FUZZ_CHECK(used >= 0 && used <= T, "row %lld filled to %lld of %lld", (long long)r, (long long)used,
                   (long long)T);
        placed += used;
        if (pk->pad && used > 0)
            FUZZ_CHECK(ds_[at + used - 1] == 0, "pad mode: row %lld holds two documents", (long long)r);
        for (int64_t t = 0; t < T; t++) {
            if (t >= used) {
                FUZZ_CHECK(tgt[at + t] == FM_IGNORE_INDEX && ds_[at + t] == used, "row %lld: padding at %lld has "
                           "target %d, document start %d", (long long)r, (long long)t, tgt[at + t], ds_[at + t]);
                continue;
            }
            *sum += pair_hash(tok[at + t], tgt[at + t]);
            if (t + 1 < used && ds_[at + t + 1] == ds_[at + t])
                FUZZ_CHECK(tgt[at + t] == FM_IGNORE_INDEX || tgt[at + t] == tok[at + t + 1], "row %lld position %lld: "
                           "target %d, next token %d", (long long)r, (long long)t, tgt[at + t], tok[at + t + 1]);
        }
    }
    return placed;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 12) return 0;
    static const int64_t vocabs[3] = {256, 50257, 65536};
    const int layout = data[0] % 4;
    const int64_t V = vocabs[data[1] % 3], T = 1 + data[2] % MAXT, rows = 1 + data[3] % MAXR;
    const uint8_t fl = data[4];
    const uint64_t seed =
        (uint64_t)data[5] | (uint64_t)data[6] << 8 | (uint64_t)data[7] << 16 | (uint64_t)data[8] << 24;
    const uint8_t *p = data + 12, *a, *b, *c;
    size_t n = size - 12, la, lb, lc;
    fuzz_take(&p, &n, &a, &la);
    fuzz_take(&p, &n, &b, &lb);
    fuzz_take(&p, &n, &c, &lc);
    static const char *const stale[] = {"d.docs", "d.mask", "d.bin.mask", "d.idx",
                                        "e.bin",  "f.idx",  "f.bin",      "f.bin.mask"};
    for (size_t i = 0; i < sizeof stale / sizeof *stale; i++) unlink(fuzz_path(stale[i]));
    const char *paths[2];
    paths[1] = NULL;
    if (layout < 2) {
        paths[0] = fuzz_write("d.bin", a, la);
        fuzz_write("d.docs", b, lb);
        if (layout == 1) fuzz_write("d.mask", c, lc);
        if (fl & 32) paths[1] = fuzz_write("e.bin", a, la);
    } else {
        fuzz_write("d.idx", a, la);
        paths[0] = fuzz_write("d.bin", b, lb);
        if (layout == 3) fuzz_write("d.bin.mask", c, lc);
        if (fl & 32) {
            fuzz_write("f.idx", a, la);
            paths[1] = fuzz_write("f.bin", b, lb);
            if (layout == 3) fuzz_write("f.bin.mask", c, lc);
        }
    }
    fm_dataset all, tr, va;
    (void)fm_error(FM_ERR_ARG, "%s", "");
    if (fm_dataset_load(&all, paths, paths[1] ? 2 : 1, V) != FM_OK) {
        FUZZ_CHECK(fm_errmsg()[0] != 0, "a refused data set without a message");
        return 0;
    }
    const fm_dataset *ds = &all;
    bool split = false;
    if ((fl & 4) && fm_dataset_split(&all, 0.25, &tr, &va) == FM_OK) {
        split = true;
        ds = fl & 8 ? &va : &tr;
    }
    if (ds->docs) {
        FUZZ_CHECK(ds->n_docs >= 1 && ds->docs[0] == 0, "a document table of %lld documents from %lld",
                   (long long)ds->n_docs, (long long)(ds->n_docs ? ds->docs[0] : -1));
        for (int64_t d = 1; d < ds->n_docs; d++)
            FUZZ_CHECK(ds->docs[d] > ds->docs[d - 1] && ds->docs[d] < ds->n_tokens, "document %lld starts at %lld",
                       (long long)d, (long long)ds->docs[d]);
    }
    fm_packer pk;
    (void)fm_error(FM_ERR_ARG, "%s", "");
    if (fm_packer_init(&pk, ds, T, rows, fl & 1, fl & 2, seed) != FM_OK) {
        FUZZ_CHECK(fm_errmsg()[0] != 0, "a refused packer without a message");
        goto out;
    }
    const bool seek = fl & 16;
    if (seek && fm_packer_seek(&pk, data[9] % 4, data[10] % (ds->n_docs + 2), data[11] % (2 * T + 2)) != FM_OK)
        FUZZ_CHECK(fm_errmsg()[0] != 0, "a refused seek without a message");
    static int32_t tok[MAXR * MAXT], tgt[MAXR * MAXT], pos[MAXR * MAXT], dst[MAXR * MAXT];
    uint64_t want_sum, got_sum = 0;
    const int64_t per_epoch = units(ds, &want_sum);
    int64_t epoch = -1, in_epoch = 0, filled = 0;
    bool two = false; /* epochs 0 and 1 filled whole */
    for (int64_t k = 0; k < MAXBATCH; k++) {
        const int64_t e = fm_packer_fill(&pk, rows, tok, tgt, pos, dst);
        FUZZ_CHECK(e >= 0 && e >= epoch && (epoch < 0 || e <= epoch + 1), "batch %lld of epoch %lld after epoch %lld",
                   (long long)k, (long long)e, (long long)epoch);
        if (e != epoch) {
            /* from epoch 0's start, a whole epoch places every training position once */
            if (!seek && epoch >= 0)
                FUZZ_CHECK(in_epoch == per_epoch && got_sum == want_sum, "epoch %lld placed %lld of %lld positions "
                           "(pair checksum %s)", (long long)epoch, (long long)in_epoch, (long long)per_epoch,
                           got_sum == want_sum ? "equal" : "differs");
            if (e >= 2) {
                two = epoch == 1;
                break;
            }
            epoch = e;
            in_epoch = 0;
            got_sum = 0;
        }
        const int64_t placed = check_batch(&pk, rows, V, tok, tgt, pos, dst, &got_sum);
        FUZZ_CHECK(placed >= 1, "an empty batch");
        in_epoch += placed;
        filled++;
    }
    if (!seek && two) {
        int64_t count = -1;
        FUZZ_CHECK(fm_packer_count(&pk, rows, 2, &count) == FM_OK, "count: %s", fm_errmsg());
        FUZZ_CHECK(count == filled, "the dry run counts %lld batches in 2 epochs, %lld were filled", (long long)count,
                   (long long)filled);
    }
    fm_packer_free(&pk);
out:
    if (split) {
        fm_dataset_free(&tr);
        fm_dataset_free(&va);
    }
    fm_dataset_free(&all);
    return 0;
}
