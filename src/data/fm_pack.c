/* Document-aware batches: the packer (fm_pack.h for the contract and the algorithm). */
#include "fm_pack.h"

#include <inttypes.h>
#include <string.h>

#include "../core/fm_rng.h"

/* Training positions of document d: its tokens less one (the last has no next token). */
static int64_t doc_units(const fm_dataset *ds, int64_t d) {
    const int64_t n = fm_dataset_doc_len(ds, d);
    return n > 1 ? n - 1 : 0;
}

/* order = the Fisher-Yates permutation of epoch p->epoch (Knuth, TAOCP vol. 2, 3.4.2, algorithm P). */
static void shuffle(fm_packer *p) {
    const int64_t n = p->ds->n_docs;
    for (int64_t i = 0; i < n; i++) p->order[i] = i;
    fm_rng r;
    fm_rng_seed(&r, p->seed ^ 0x9ACC3D0C5ull ^ ((uint64_t)p->epoch * 0xD1B54A32D192ED03ull));
    for (int64_t i = n - 1; i > 0; i--) {
        const int64_t j = (int64_t)fm_rng_below(&r, (uint64_t)(i + 1));
        const int64_t t = p->order[i];
        p->order[i] = p->order[j];
        p->order[j] = t;
    }
}

fm_status fm_packer_init(fm_packer *p, const fm_dataset *ds, int64_t T, int64_t rows_cap, bool pad, bool split_long,
                         uint64_t seed) {
    memset(p, 0, sizeof *p);
    if (!ds->docs)
        return fm_error(FM_ERR_ARG, "--pack: the training data (%s) has no document index; expected shards written by "
                        "`flatmoe prepare` (each with its .docs file) or a Megatron data set; or train with --pack off",
                        ds->desc);
    if (T < 1 || rows_cap < 1)
        return fm_error(FM_ERR_ARG, "--pack: rows of %" PRId64 " tokens, %" PRId64 " rows; expected both >= 1", T,
                        rows_cap);
    int64_t useful = 0;
    for (int64_t d = 0; d < ds->n_docs; d++) {
        const int64_t u = doc_units(ds, d);
        useful += u > 0;
        if (!split_long && u > T)
            return fm_error(FM_ERR_ARG, "--pack-long refuse: document %" PRId64 " (token %" PRId64 " of the training "
                            "data) has %" PRId64 " tokens, %" PRId64 " training positions, more than a row of --seq-len %"
                            PRId64 "; give --pack-long split to cut it into rows, a --seq-len of at least %" PRId64
                            ", or remove it from the data", d, ds->docs[d], u + 1, u, T, u);
    }
    if (useful == 0)
        return fm_error(FM_ERR_ARG, "--pack: none of the %" PRId64 " documents of the training data has two tokens "
                        "(a token and its target); check the data", ds->n_docs);
    p->order = fm_malloc(sizeof(int64_t) * (size_t)ds->n_docs);
    p->used = fm_malloc(sizeof(int64_t) * (size_t)rows_cap);
    if (!p->order || !p->used) {
        fm_packer_free(p);
        return fm_error(FM_ERR_NOMEM, "--pack: out of memory for the order of %" PRId64 " documents", ds->n_docs);
    }
    p->ds = ds;
    p->T = T;
    p->rows_cap = rows_cap;
    p->pad = pad;
    p->split_long = split_long;
    p->seed = seed;
    shuffle(p);
    return FM_OK;
}

fm_status fm_packer_seek(fm_packer *p, int64_t epoch, int64_t next, int64_t done) {
    bool bad = epoch < 0 || next < 0 || next > p->ds->n_docs || done < 0 || (next == p->ds->n_docs && done > 0);
    if (!bad && epoch != p->epoch) {
        p->epoch = epoch;
        shuffle(p);
    }
    if (!bad && next < p->ds->n_docs && done > 0 && done >= doc_units(p->ds, p->order[next])) bad = true;
    if (bad)
        return fm_error(FM_ERR_ARG, "data cursor: epoch %" PRId64 ", document %" PRId64 ", position %" PRId64
                        "; expected a document below %" PRId64 " and a position inside it: the checkpoint was made "
                        "with other training data", epoch, next, done, p->ds->n_docs);
    p->next = next;
    p->done = done;
    return FM_OK;
}

/* Puts positions [p->done, p->done + c) of document d into row `row` at its fill level. */
static void place(const fm_packer *p, int64_t d, int64_t row, int64_t c, int32_t *tokens, int32_t *targets,
                  int32_t *pos, int32_t *doc_start) {
    const int64_t at = row * p->T + p->used[row], first = p->ds->docs[d] + p->done;
    fm_dataset_tokens(p->ds, first, c, tokens + at);
    fm_dataset_targets(p->ds, first + 1, c, targets + at);
    for (int64_t i = 0; i < c; i++) {
        pos[at + i] = (int32_t)i;
        doc_start[at + i] = (int32_t)p->used[row];
    }
}

int64_t fm_packer_fill(fm_packer *p, int64_t rows, int32_t *tokens, int32_t *targets, int32_t *pos,
                       int32_t *doc_start) {
    FM_ASSERT(rows >= 1 && rows <= p->rows_cap);
    const int64_t T = p->T, n = p->ds->n_docs;
    for (int64_t r = 0; r < rows; r++) p->used[r] = 0;
    int64_t epoch = -1;
    bool placed = false;
    for (;;) {
        if (p->next == n) { /* the epoch's end: the batch ends here, or the next epoch starts it */
            if (placed) break;
            p->epoch++;
            p->next = p->done = 0;
            shuffle(p);
        }
        const int64_t d = p->order[p->next], units = doc_units(p->ds, d);
        if (units == 0) { /* a one-token document: nothing to learn */
            p->next++;
            continue;
        }
        const int64_t rem = units - p->done, c = rem < T ? rem : T; /* rem <= T unless split_long */
        int64_t row = -1;
        for (int64_t r = 0; r < rows && row < 0; r++)
            if (p->pad ? p->used[r] == 0 : T - p->used[r] >= c) row = r;
        if (row < 0) break; /* first-fit: it opens the next batch */
        if (epoch < 0) epoch = p->epoch;
        if (tokens) place(p, d, row, c, tokens, targets, pos, doc_start);
        p->used[row] += c;
        p->done += c;
        if (p->done == units) {
            p->next++;
            p->done = 0;
        }
        placed = true;
    }
    if (tokens) /* the rest of each row: a padding document (token 0, no target) */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t t = p->used[r]; t < T; t++) {
                tokens[r * T + t] = 0;
                targets[r * T + t] = FM_IGNORE_INDEX;
                pos[r * T + t] = (int32_t)(t - p->used[r]);
                doc_start[r * T + t] = (int32_t)p->used[r];
            }
    return epoch;
}

fm_status fm_packer_count(const fm_packer *p, int64_t rows, int64_t epochs, int64_t *batches) {
    fm_packer q;
    FM_TRY(fm_packer_init(&q, p->ds, p->T, rows, p->pad, p->split_long, p->seed));
    int64_t k = 0;
    while (q.epoch < epochs) {
        const int64_t e = fm_packer_fill(&q, rows, NULL, NULL, NULL, NULL);
        if (e >= epochs) break;
        k++;
        if (q.next == q.ds->n_docs && q.epoch == epochs - 1) break; /* the last epoch is done */
    }
    fm_packer_free(&q);
    *batches = k;
    return FM_OK;
}

void fm_packer_free(fm_packer *p) {
    fm_free(p->order);
    fm_free(p->used);
    memset(p, 0, sizeof *p);
}
