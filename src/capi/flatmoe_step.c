/* libflatmoe's batch work (include/flatmoe.h): a caller's packed sequences into the model's rows,
 * the forward that reads back per-token log-probs and entropies, and the train step whose
 * backward runs the linear CE with per-token coefficients as its token weights. */
#include <math.h>
#include <string.h>

#include "../train/fm_threads.h"
#include "fm_capi.h"

/* The batch's fields against a vocabulary of V and a token budget of B rows of T. */
static fm_status check_batch(const flatmoe_batch *b, int64_t B, int64_t T, int64_t V) {
    const int64_t budget = B * T;
    if (!b) return fm_error(FM_ERR_ARG, "batch: NULL; pass a flatmoe_batch");
    if (b->n_tokens < 1 || !b->tokens || b->n_seqs < 1 || !b->seq_lens)
        return fm_error(FM_ERR_ARG, "batch: n_tokens %lld, n_seqs %lld, tokens %s, seq_lens %s; expected n_tokens and "
                        "n_seqs >= 1 and both arrays set", (long long)b->n_tokens, (long long)b->n_seqs,
                        b->tokens ? "set" : "NULL", b->seq_lens ? "set" : "NULL");
    if (b->n_tokens > budget)
        return fm_error(FM_ERR_ARG, "batch: %lld tokens, over the session's token budget of %lld (--micro-batch %lld x "
                        "--seq-len %lld, the plan's shape); split the batch, or open the session with a larger "
                        "--micro-batch", (long long)b->n_tokens, (long long)budget, (long long)B, (long long)T);
    if (b->n_seqs > b->n_tokens) /* before reading seq_lens: a garbage n_seqs must not walk past the array */
        return fm_error(FM_ERR_ARG, "batch: n_seqs %lld is more than n_tokens %lld; expected n_seqs <= n_tokens (every "
                        "sequence has >= 1 token): n_seqs is the length of seq_lens", (long long)b->n_seqs,
                        (long long)b->n_tokens);
    int64_t sum = 0;
    for (int64_t i = 0; i < b->n_seqs; i++) {
        const int64_t l = b->seq_lens[i];
        if (l < 1 || l > T)
            return fm_error(FM_ERR_ARG, "batch: seq_lens[%lld] is %lld; expected 1 .. %lld (--seq-len: a sequence fills "
                            "at most one row); shorten it, or open the session with a larger --seq-len", (long long)i,
                            (long long)l, (long long)T);
        sum += l;
    }
    if (sum != b->n_tokens)
        return fm_error(FM_ERR_ARG, "batch: seq_lens sum to %lld but n_tokens is %lld; they must be equal",
                        (long long)sum, (long long)b->n_tokens);
    for (int64_t t = 0; t < b->n_tokens; t++)
        if (b->tokens[t] < 0 || b->tokens[t] >= V)
            return fm_error(FM_ERR_ARG, "batch: tokens[%lld] is %d; expected 0 .. %lld (the model's vocab_size %lld)",
                            (long long)t, b->tokens[t], (long long)V - 1, (long long)V);
    return FM_OK;
}

/* Padding from offset `from` to the row's end: a document of its own, no targets. */
static void pad_row(fm_batch *fb, int64_t row, int64_t from, int64_t T) {
    for (int64_t o = from; o < T; o++) {
        const int64_t p = row * T + o;
        fb->tokens[p] = 0;
        fb->targets[p] = -100;
        fb->doc_start[p] = (int32_t)from;
        fb->pos[p] = (int32_t)(o - from);
    }
}

fm_status fm_capi_pack_rows(const flatmoe_batch *b, int64_t B, int64_t T, int64_t V, bool with_targets_all,
                            fm_batch *fb, int64_t *pos_of, int32_t *seq_of, uint8_t *in_loss) {
    FM_ASSERT(B >= 1 && T >= 1 && fb && pos_of && seq_of && in_loss);
    FM_TRY(check_batch(b, B, T, V));
    int64_t row = 0, off = 0, t0 = 0;
    for (int64_t i = 0; i < b->n_seqs; i++) { /* first fit, in order */
        const int64_t l = b->seq_lens[i];
        if (off + l > T) {
            pad_row(fb, row, off, T);
            row++;
            off = 0;
        }
        if (row >= B)
            return fm_error(FM_ERR_ARG, "batch: sequences 0 .. %lld do not pack into the %lld rows of %lld tokens of the "
                            "token budget (--micro-batch %lld x --seq-len %lld = %lld; packing leaves the ends of rows "
                            "empty); send the rest in another batch, or open the session with a larger --micro-batch",
                            (long long)i, (long long)B, (long long)T, (long long)B, (long long)T,
                            (long long)(B * T));
        for (int64_t j = 0; j < l; j++) {
            const int64_t t = t0 + j, p = row * T + off + j;
            pos_of[t] = p;
            seq_of[t] = (int32_t)i;
            in_loss[t] = j > 0 && (!b->loss_mask || b->loss_mask[t]);
            fb->tokens[p] = b->tokens[t];
            fb->doc_start[p] = (int32_t)off;
            fb->pos[p] = (int32_t)j;
        }
        for (int64_t j = 0; j < l; j++) { /* position of token t predicts token t + 1 of the sequence */
            const int64_t t = t0 + j, p = pos_of[t];
            const bool has_next = j + 1 < l;
            fb->targets[p] = has_next && (with_targets_all || in_loss[t + 1]) ? b->tokens[t + 1] : -100;
        }
        off += l;
        t0 += l;
    }
    pad_row(fb, row, off, T);
    for (int64_t r = row + 1; r < B; r++) pad_row(fb, r, 0, T);
    return FM_OK;
}

fm_status fm_capi_pack(flatmoe_session *s, const flatmoe_batch *b, bool with_targets_all) {
    FM_TRY(fm_capi_awake(s, "batch"));
    FM_TRY(fm_capi_pack_rows(b, s->B, s->T, s->r.cfg.vocab_size, with_targets_all, &s->fb, s->pos_of, s->seq_of,
                             s->in_loss));
    return fm_capi_routes_stage(s, b); /* the replayed routes, at the packed positions */
}

void fm_capi_call_begin(flatmoe_session *s, const flatmoe_batch *b, bool weighted, bool ent_bonus) {
    fm_model *m = &s->r.m;
    fm_threads_set(s->threads); /* this session's count, whatever another session set since */
    const bool replay = b && b->routed_experts;
    const fm_rl_call c = {.outputs = true, .weighted = weighted, .ent_bonus = weighted && ent_bonus,
                          .replay = replay, .record = !replay && m->a.rl_routes != NULL};
    m->a.rl = c;
}

void fm_capi_call_end(flatmoe_session *s) { memset(&s->r.m.a.rl, 0, sizeof s->r.m.a.rl); }

fm_status fm_capi_agree(flatmoe_session *s, fm_status local, const char *what) {
    if (s->r.n_ranks <= 1) return local;
    char msg[2048] = ""; /* this rank's own message outlives the collective */
    if (local != FM_OK) snprintf(msg, sizeof msg, "%s", fm_errmsg());
    int64_t bad = local != FM_OK;
    FM_TRY(fm_comm_allreduce_sum_i64(&s->r.world, &bad, 1, 0));
    if (local != FM_OK) return fm_error(local, "rank %d of %d: %s", s->r.rank, s->r.n_ranks, msg);
    if (bad)
        return fm_error(FM_ERR_ARG, "%s: %lld of the %d ranks refused their part of this call (each names its input in "
                        "its own message); no rank ran it", what, (long long)bad, s->r.n_ranks);
    return FM_OK;
}

fm_status fm_capi_one_rank(const flatmoe_session *s, const char *what) {
    if (s->r.n_ranks <= 1) return FM_OK;
    return fm_error(FM_ERR_UNSUPPORTED, "%s: not in this slice for a session of several ranks (this one has %d); call "
                    "it from a one-rank session (docs/rl.md, \"Many ranks\")", what, s->r.n_ranks);
}

fm_status fm_capi_forward(flatmoe_session *s, const flatmoe_batch *b) {
    fm_model *m = &s->r.m;
    const fm_ops *ops = m->be.ops;
    fm_model_fp8_cache_invalidate(m); /* --fp8-weight-cache: the weights after the last update */
    FM_TRY(fm_schedule_forward(&s->r.step.sched, m, &s->fb, NULL));
    ops->stream_sync(m->be.ctx, FM_STREAM_COMPUTE); /* sync point "log-probs": the head's per-token outputs */
    const size_t bytes = sizeof(float) * (size_t)s->budget;
    ops->copy(m->be.ctx, s->tok_loss, m->a.token_loss, bytes, FM_COPY_D2H);
    ops->copy(m->be.ctx, s->tok_ent, m->a.rl_entropy, bytes, FM_COPY_D2H);
    FM_TRY(ops->status(m->be.ctx));
    for (int64_t t = 0; t < b->n_tokens; t++) {
        const bool first = t == 0 || s->seq_of[t - 1] != s->seq_of[t];
        const int64_t p = first ? 0 : s->pos_of[t - 1];
        s->logp[t] = first ? 0.0f : -s->tok_loss[p]; /* log p = -loss, as the operator writes both */
        s->ent[t] = first ? 0.0f : s->tok_ent[p];
    }
    return FM_OK;
}

int flatmoe_logprobs(flatmoe_session *s, const flatmoe_batch *b, float *logprobs, float *entropy) {
    if (!s) return fm_error(FM_ERR_ARG, "flatmoe_logprobs: the session is NULL");
    FM_TRY(fm_capi_awake(s, "flatmoe_logprobs"));
    const fm_status ok = logprobs ? fm_capi_pack(s, b, true) /* a refusing rank still joins the agreement */
                                  : fm_error(FM_ERR_ARG, "flatmoe_logprobs: logprobs is NULL; pass an [n_tokens] fp32 array");
    FM_TRY(fm_capi_agree(s, ok, "flatmoe_logprobs")); /* many ranks: each its own batch */
    fm_capi_call_begin(s, b, false, false);
    const fm_status st = fm_capi_forward(s, b);
    fm_capi_call_end(s);
    FM_TRY(st);
    memcpy(logprobs, s->logp, sizeof(float) * (size_t)b->n_tokens);
    if (entropy) memcpy(entropy, s->ent, sizeof(float) * (size_t)b->n_tokens);
    return FLATMOE_OK;
}

/* The backward of the last forward with token weights -c_t at the positions that predict each
 * loss token, then the step's reduction; the micro-batch's results into the step workspace. */
static fm_status weighted_backward(flatmoe_session *s, const flatmoe_batch *b) {
    fm_model *m = &s->r.m;
    fm_step_ws *w = &s->r.step;
    memset(s->weight, 0, sizeof(float) * (size_t)s->budget);
    for (int64_t t = 0; t < b->n_tokens; t++)
        if (s->in_loss[t]) s->weight[s->pos_of[t - 1]] = (float)-s->coef[t]; /* w = -dL/dlog p: loss_t = -log p_t */
    /* a blocking copy (sync point "token weights"): the host made them after the forward's read-back */
    m->be.ops->copy(m->be.ctx, m->a.rl_weight, s->weight, sizeof(float) * (size_t)s->budget, FM_COPY_H2D);
    if (m->a.rl.ent_bonus) { /* dL/dH_t at the position that predicts token t (the entropy's own position) */
        memset(s->ent_weight, 0, sizeof(float) * (size_t)s->budget);
        for (int64_t t = 0; t < b->n_tokens; t++)
            if (s->in_loss[t]) s->ent_weight[s->pos_of[t - 1]] = (float)s->ent_coef[t];
        m->be.ops->copy(m->be.ctx, m->a.rl_ent_weight, s->ent_weight, sizeof(float) * (size_t)s->budget, FM_COPY_H2D);
    }
    FM_TRY(fm_schedule_backward(&w->sched, m, 1.0f)); /* the call's switches: weighted (fm_capi_call_begin) */
    w->n_valid[0] = m->a.n_valid;
    m->be.ops->copy_async(m->be.ctx, w->res, m->a.results, (size_t)w->n_res * sizeof(double), FM_COPY_D2H,
                          FM_STREAM_COMPUTE);
    return fm_train_step_reduce(m, &s->r.world, w);
}

/* fm_capi_grads inside its call (the switches set by the caller). */
static fm_status grads_in_call(flatmoe_session *s, const flatmoe_batch *b, const flatmoe_loss_spec *spec,
                               flatmoe_step_stats *st) {
    fm_model *m = &s->r.m;
    fm_step_ws *w = &s->r.step;
    fm_train_step_zero_grads(m, w);
    FM_TRY(fm_capi_forward(s, b));
    FM_TRY(fm_pg_coefs_ranks(spec, b, b->n_tokens, s->logp, s->ent, s->in_loss, s->seq_of, s->seq_count,
                             &s->r.world, s->coef, st)); /* |M|, |S| over every rank's batch */
    if (m->a.rl.ent_bonus) fm_pg_entropy_coefs(spec, b->n_tokens, s->in_loss, s->seq_of, s->seq_count, st, s->ent_coef);
    FM_TRY(weighted_backward(s, b));
    fm_loss l;
    fm_model_loss_from_results(m, w->res, w->n_valid[0], &l);
    st->router_aux = l.aux;
    st->router_z = l.z;
    return FM_OK;
}

fm_status fm_capi_grads(flatmoe_session *s, const flatmoe_batch *b, const flatmoe_loss_spec *spec,
                        flatmoe_step_stats *st) {
    memset(st, 0, sizeof *st);
    fm_status ok = spec ? fm_capi_pack(s, b, false) /* targets where the next token is in the loss: train's targets */
                        : fm_error(FM_ERR_ARG, "flatmoe_train_step: spec is NULL; pass a flatmoe_loss_spec "
                                   "(flatmoe_loss_spec_default())");
    if (ok == FM_OK) ok = fm_pg_check(spec, b, b->n_tokens, s->in_loss); /* the spec and its arrays, before any model work */
    FM_TRY(fm_capi_agree(s, ok, "flatmoe_train_step")); /* many ranks: every rank's batch accepted, or none runs */
    fm_capi_call_begin(s, b, true, spec->entropy_coef != 0);
    const fm_status r = grads_in_call(s, b, spec, st);
    fm_capi_call_end(s);
    return r;
}

int flatmoe_train_step(flatmoe_session *s, const flatmoe_batch *b, const flatmoe_loss_spec *spec,
                       flatmoe_step_stats *out) {
    if (!s) return fm_error(FM_ERR_ARG, "flatmoe_train_step: the session is NULL");
    FM_TRY(fm_capi_awake(s, "flatmoe_train_step"));
    flatmoe_step_stats st;
    FM_TRY(fm_capi_grads(s, b, spec, &st));
    const int64_t step = s->ts.step + 1;
    if (!isfinite(st.loss) || !isfinite(st.router_aux) || !isfinite(st.router_z))
        return fm_error(FM_ERR_NUMERIC, "flatmoe_train_step: step %lld: the loss is not finite (loss %g, router aux %g, "
                        "z %g); the weights were not updated; lower --lr, or check the batch's advantages and "
                        "log-probs", (long long)step, st.loss, st.router_aux, st.router_z);
    const fm_status ap = fm_train_step_apply(&s->r.m, s->r.optim, s->r.opt_self, &s->r.world, &s->r.step, &s->o, step,
                                             &st.grad_norm, &st.lr);
    if (ap == FM_ERR_NUMERIC) /* the gradient norm, checked before any update (train's message speaks of its run) */
        return fm_error(FM_ERR_NUMERIC, "flatmoe_train_step: step %lld: the gradient norm is not finite (the loss %g "
                        "was); the weights were not updated; lower the loss spec's coefficients (kl_coef %g, "
                        "entropy_coef %g), the advantages' scale or --lr", (long long)step, st.loss, spec->kl_coef,
                        spec->entropy_coef);
    FM_TRY(ap);
    s->ts.step = step;
    st.step = step;
    if (out) *out = st;
    return FLATMOE_OK;
}
