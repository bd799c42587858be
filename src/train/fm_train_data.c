/* The training data's draw: windows or packed documents, and epochs (fm_train_data.h). */
#include "fm_train_data.h"

#include <string.h>

#include "../core/fm_log.h"

const char *fm_train_data_mode_name(int mode) {
    return mode == FM_PACK_ON ? "on" : mode == FM_PACK_PAD ? "pad" : "off";
}

fm_status fm_train_data_init(fm_train_data *d, const fm_train_opts *o, const fm_dataset *train, int dp, int dp_rank,
                             int resumed_mode, fm_batch *batches, int64_t *steps) {
    memset(d, 0, sizeof *d);
    d->dp = dp > 0 ? dp : 1;
    d->dp_rank = dp_rank;
    d->n_tokens = train->n_tokens;
    int mode = o->pack;
    if (mode == FM_PACK_AUTO) {
        mode = resumed_mode > 0 ? resumed_mode : train->docs && o->init_from ? FM_PACK_ON : FM_PACK_OFF;
    }
    d->mode = mode;
    *steps = o->steps;
    const int64_t rows = (int64_t)d->dp * o->micro_batch;
    if (mode != FM_PACK_OFF) {
        FM_TRY(fm_packer_init(&d->pk, train, o->seq_len, rows, mode == FM_PACK_PAD, o->pack_long == FM_PACK_LONG_SPLIT,
                              o->seed));
        const size_t n = (size_t)(rows * o->seq_len);
        d->sp = train->seq_parts > 1 ? train->seq_parts : 1;
        d->sp_rank = d->sp > 1 ? train->seq_part : 0;
        if ((d->dp > 1 || d->sp > 1) && !(d->global = fm_malloc(4 * sizeof(int32_t) * n))) {
            fm_train_data_free(d);
            return fm_error(FM_ERR_NOMEM, "--pack: out of memory for the global batch (%zu tokens)", n);
        }
        for (int64_t g = 0; g < o->grad_accum; g++)
            if (!batches[g].pos) FM_TRY(fm_batch_alloc_docs_sp(&batches[g], d->sp, d->sp_rank));
    }
    if (o->epochs > 0) {
        if (mode != FM_PACK_OFF) {
            int64_t mb = 0;
            FM_TRY(fm_packer_count(&d->pk, rows, o->epochs, &mb));
            *steps = (mb + o->grad_accum - 1) / o->grad_accum;
        } else {
            const int64_t per_step = rows * o->seq_len * o->grad_accum;
            *steps = (o->epochs * train->n_tokens + per_step - 1) / per_step;
        }
        if (*steps < 1) *steps = 1;
    }
    return FM_OK;
}

fm_status fm_train_data_seek(fm_train_data *d, int64_t epoch, int64_t next, int64_t done) {
    if (d->mode == FM_PACK_OFF) return FM_OK;
    return fm_packer_seek(&d->pk, epoch, next, done);
}

void fm_train_data_draw(fm_train_data *d, const fm_train_opts *o, const fm_dataset *train, fm_rng *data_rng,
                        fm_batch *batches, int64_t tokens_before) {
    if (d->mode == FM_PACK_OFF) { /* this rank's windows of the one-rank draw of W x micro_batch */
        for (int64_t g = 0; g < o->grad_accum; g++)
            fm_dataset_sample_batch(train, data_rng, o->micro_batch, o->seq_len, batches[g].tokens, batches[g].targets);
        d->epoch = 1 + tokens_before / (d->n_tokens > 0 ? d->n_tokens : 1);
        return;
    }
    const int64_t B = o->micro_batch, T = o->seq_len, rows = (int64_t)d->dp * B, n = rows * T, mine = B * T;
    for (int64_t g = 0; g < o->grad_accum; g++) {
        fm_batch *b = &batches[g];
        int64_t e;
        if (d->dp == 1 && d->sp == 1) {
            e = fm_packer_fill(&d->pk, rows, b->tokens, b->targets, b->pos, b->doc_start);
        } else { /* every rank fills the global batch; rank q keeps rows [q B, (q + 1) B), and under
                  * sequence parallelism positions [s Tl, (s + 1) Tl) of each, but whole rows of
                  * document starts (the attention runs over whole rows: fm_batch.h) */
            int32_t *tk = d->global, *tg = tk + n, *ps = tg + n, *st = ps + n;
            e = fm_packer_fill(&d->pk, rows, tk, tg, ps, st);
            const int64_t off = (int64_t)d->dp_rank * mine, Tl = T / d->sp, t0 = (int64_t)d->sp_rank * Tl;
            const size_t rb = sizeof(int32_t) * (size_t)Tl;
            for (int64_t r = 0; r < B; r++) {
                memcpy(b->tokens + r * Tl, tk + off + r * T + t0, rb);
                memcpy(b->targets + r * Tl, tg + off + r * T + t0, rb);
                memcpy(b->pos + r * Tl, ps + off + r * T + t0, rb);
            }
            memcpy(b->doc_start, st + off, sizeof(int32_t) * (size_t)mine);
        }
        if (g == 0) d->epoch = e + 1;
    }
}

void fm_train_data_free(fm_train_data *d) {
    fm_packer_free(&d->pk);
    fm_free(d->global);
    memset(d, 0, sizeof *d);
}
