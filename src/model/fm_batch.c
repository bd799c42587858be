/* A micro-batch in host memory (fm_batch.h). */
#include "fm_batch.h"

#include <string.h>

fm_status fm_batch_alloc(fm_batch *b, int64_t B, int64_t T, bool targets) {
    memset(b, 0, sizeof *b);
    if (B < 1 || T < 1)
        return fm_error(FM_ERR_ARG, "batch: %lld sequences of %lld tokens; expected both >= 1", (long long)B,
                        (long long)T);
    const size_t bytes = sizeof(int32_t) * (size_t)(B * T);
    b->tokens = fm_malloc(bytes);
    b->targets = targets ? fm_malloc(bytes) : NULL;
    if (!b->tokens || (targets && !b->targets)) {
        fm_batch_free(b);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate a batch of %lld x %lld tokens (%zu bytes%s)",
                        (long long)B, (long long)T, bytes, targets ? " twice" : "");
    }
    memset(b->tokens, 0, bytes);
    if (targets) memset(b->targets, 0, bytes);
    b->B = B;
    b->T = T;
    return FM_OK;
}

fm_status fm_batch_alloc_docs(fm_batch *b) { return fm_batch_alloc_docs_sp(b, 1, 0); }

fm_status fm_batch_alloc_docs_sp(fm_batch *b, int64_t sp, int64_t sp_rank) {
    FM_ASSERT(b->tokens && b->B >= 1 && b->T >= 1 && sp >= 1 && sp_rank >= 0 && sp_rank < sp);
    const size_t bytes = sizeof(int32_t) * (size_t)(b->B * b->T), fbytes = bytes * (size_t)sp;
    int32_t *pos = fm_malloc(bytes), *start = fm_malloc(fbytes);
    if (!pos || !start) {
        fm_free(pos);
        fm_free(start);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the document positions of a batch of %lld x %lld "
                        "tokens (%zu + %zu bytes)", (long long)b->B, (long long)b->T, bytes, fbytes);
    }
    for (int64_t i = 0; i < b->B * b->T; i++) pos[i] = (int32_t)(sp_rank * b->T + i % b->T);
    memset(start, 0, fbytes);
    b->pos = pos;
    b->doc_start = start;
    b->T_full = sp > 1 ? sp * b->T : 0;
    b->t0 = sp > 1 ? sp_rank * b->T : 0;
    return FM_OK;
}

void fm_batch_free(fm_batch *b) {
    fm_free(b->tokens);
    fm_free(b->targets);
    fm_free(b->pos);
    fm_free(b->doc_start);
    memset(b, 0, sizeof *b);
}

fm_status fm_batch_check(const fm_batch *b, int64_t B, int64_t T, int64_t V) {
    if (b->B != B || b->T != T)
        return fm_error(FM_ERR_ARG, "batch: %lld x %lld tokens, but the model's active shape is %lld x %lld; set the "
                        "model's shape to the batch's (fm_model_set_shape) or pass a batch of its shape",
                        (long long)b->B, (long long)b->T, (long long)B, (long long)T);
    if (!b->tokens) return fm_error(FM_ERR_ARG, "batch: no tokens (tokens is NULL)");
    const int64_t N = B * T;
    for (int64_t i = 0; i < N; i++)
        if (b->tokens[i] < 0 || b->tokens[i] >= V)
            return fm_error(FM_ERR_ARG, "batch: token %lld (sequence %lld, position %lld) is %d; expected an id in "
                            "[0, %lld) (vocab_size): the data's tokenizer does not match the model",
                            (long long)i, (long long)(i / T), (long long)(i % T), b->tokens[i], (long long)V);
    if (b->targets)
        for (int64_t i = 0; i < N; i++)
            if (b->targets[i] != -100 && (b->targets[i] < 0 || b->targets[i] >= V))
                return fm_error(FM_ERR_ARG, "batch: target %lld (sequence %lld, position %lld) is %d; expected an id "
                                "in [0, %lld) (vocab_size) or -100 (no loss)", (long long)i, (long long)(i / T),
                                (long long)(i % T), b->targets[i], (long long)V);
    if (!b->pos != !b->doc_start)
        return fm_error(FM_ERR_ARG, "batch: %s is set but %s is NULL; packed documents need both (or neither)",
                        b->pos ? "pos" : "doc_start", b->pos ? "doc_start" : "pos");
    const int64_t Tf = b->T_full > 0 ? b->T_full : T, t0 = b->T_full > 0 ? b->t0 : 0;
    if (b->doc_start && (Tf % T || t0 < 0 || t0 + T > Tf || t0 % T))
        return fm_error(FM_ERR_ARG, "batch: a slice of positions %lld .. %lld of rows of %lld tokens; expected "
                        "T_full a multiple of T (%lld) and the slice inside it at a multiple of T", (long long)t0,
                        (long long)(t0 + T - 1), (long long)Tf, (long long)T);
    if (b->doc_start)
        for (int64_t i = 0; i < B * Tf; i++) {
            const int64_t t = i % Tf, s = b->doc_start[i];
            const bool ok = t == 0 ? s == 0 : (s == b->doc_start[i - 1] || s == t);
            if (!ok)
                return fm_error(FM_ERR_ARG, "batch: sequence %lld, position %lld: doc_start %lld; expected doc_start "
                                "the previous token's or %lld (a new document), %s", (long long)(i / Tf), (long long)t,
                                (long long)s, (long long)t, t == 0 ? "0 at position 0" : "documents contiguous");
        }
    if (b->pos)
        for (int64_t i = 0; i < N; i++) {
            const int64_t t = t0 + i % T;
            if (b->pos[i] < 0 || b->pos[i] > t)
                return fm_error(FM_ERR_ARG, "batch: sequence %lld, position %lld: pos %d; expected pos in [0, %lld]",
                                (long long)(i / T), (long long)t, b->pos[i], (long long)t);
        }
    return FM_OK;
}
