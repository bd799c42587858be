/* Validation loss over sequential windows of a dataset. Many ranks (m->mesh.comm over W ranks, rank
 * q): a batch is W x B windows, of which rank q scores [q B, (q + 1) B) (windows past the end are
 * padding with no targets: the rank still takes part), so the loss is one rank's at W x B.
 * Sequence parallelism (m->mesh.sp = P > 1; world rank q = d P + s): the windows are P T long, a batch
 * is W/P x B of them, data-parallel rank d scores [d B, (d + 1) B) and sp rank s keeps slice s of
 * each (the data set's sequence slice, fm_dataset_set_seq_slice, set by the trainer). */
#include <math.h>

#include "../comm/fm_comm.h"

#include "../data/fm_data.h"
#include "../schedule/fm_schedule.h"
#include "fm_trainer.h"

fm_status fm_evaluate(fm_model *m, const fm_dataset *ds, int64_t max_batches, double *mean_loss,
                      int64_t *n_tokens_out) {
    return fm_evaluate_sched(NULL, m, ds, max_batches, mean_loss, n_tokens_out);
}

fm_status fm_evaluate_sched(fm_schedule *s, fm_model *m, const fm_dataset *ds, int64_t max_batches, double *mean_loss,
                            int64_t *n_tokens_out) {
    const int64_t sp = m->mesh.sp > 1 ? m->mesh.sp : 1, B = m->a.B, T = m->a.T, Tw = T * sp; /* T: this rank's slice */
    fm_model_fp8_cache_invalidate(m); /* --fp8-weight-cache: the weights after the last update */
    const int64_t nwin = fm_dataset_eval_windows(ds, Tw);
    const int64_t W = (m->mesh.comm ? fm_comm_size(m->mesh.comm) : 1) / sp, q = (m->mesh.comm ? fm_comm_rank(m->mesh.comm) : 0) / sp;
    double sum = 0;
    int64_t count = 0, batches = 0;
    fm_batch b; /* the evaluation's own batch, host memory for the call */
    FM_TRY(fm_batch_alloc(&b, B, T, true));
    fm_status st = FM_OK;
    for (int64_t w = 0; w < nwin; w += B * W) {
        if (max_batches > 0 && batches >= max_batches) break;
        int64_t filled = 0;
        fm_dataset_eval_batch(ds, w + q * B, B, Tw, b.tokens, b.targets, &filled);
        for (int64_t i = filled * T; i < B * T; i++) {
            b.tokens[i] = 0;
            b.targets[i] = -100;
        }
        fm_loss l;
        st = s ? fm_schedule_forward(s, m, &b, &l) : fm_schedule_default_forward(m, &b, &l);
        if (st != FM_OK) break;
        sum += l.ce * (double)l.n_valid;
        count += l.n_valid;
        batches++;
    }
    fm_batch_free(&b);
    FM_TRY(st);
    *mean_loss = count ? sum / (double)count : NAN;
    if (n_tokens_out) *n_tokens_out = count;
    return FM_OK;
}

