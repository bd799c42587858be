/* Autoregressive sampling (see fm_sample.h). */
#include "fm_sample.h"

#include "../schedule/fm_schedule.h"

#include <math.h>
#include <string.h>

int32_t fm_sample_pick(const float *lg, int64_t V, double temperature, int64_t top_k, fm_rng *rng, float *probs,
                       int32_t *order) {
    int32_t next = 0;
    if (temperature == 0) {
        for (int64_t v = 1; v < V; v++)
            if (lg[v] > lg[next]) next = (int32_t)v;
        return next;
    }
    /* top-k: keep the k largest logits (k = V when 0). */
    int64_t kk = top_k > 0 && top_k < V ? top_k : V;
    for (int64_t v = 0; v < V; v++) order[v] = (int32_t)v;
    for (int64_t i = 0; i < kk && kk < V; i++) { /* partial selection sort */
        int64_t best = i;
        for (int64_t j = i + 1; j < V; j++)
            if (lg[order[j]] > lg[order[best]]) best = j;
        int32_t t = order[i]; order[i] = order[best]; order[best] = t;
    }
    double mx = -INFINITY, sum = 0;
    for (int64_t i = 0; i < kk; i++) if (lg[order[i]] > mx) mx = lg[order[i]];
    for (int64_t i = 0; i < kk; i++) { probs[i] = (float)exp((lg[order[i]] - mx) / temperature); sum += probs[i]; }
    double u = fm_rng_uniform_d(rng) * sum, acc = 0;
    next = order[kk - 1];
    for (int64_t i = 0; i < kk; i++) {
        acc += probs[i];
        if (u < acc) { next = order[i]; break; }
    }
    return next;
}

/* order[i] before order[j]: the larger logit, the lower id on ties. */
static bool before(const float *lg, int32_t i, int32_t j) { return lg[i] > lg[j] || (lg[i] == lg[j] && i < j); }

/* Sifts order[root] down a max-heap of before() over order[0, end) (the root: the one that comes last). */
static void sift_down(const float *lg, int32_t *order, int64_t root, int64_t end) {
    for (;;) {
        int64_t c = 2 * root + 1;
        if (c >= end) return;
        if (c + 1 < end && before(lg, order[c], order[c + 1])) c++;
        if (!before(lg, order[root], order[c])) return;
        const int32_t t = order[root]; order[root] = order[c]; order[c] = t;
        root = c;
    }
}

/* Heap sort of order[0, n) into before()'s order: the largest logit first. */
static void sort_candidates(const float *lg, int32_t *order, int64_t n) {
    for (int64_t i = n / 2 - 1; i >= 0; i--) sift_down(lg, order, i, n);
    for (int64_t end = n - 1; end > 0; end--) {
        const int32_t t = order[0]; order[0] = order[end]; order[end] = t;
        sift_down(lg, order, 0, end);
    }
}

int32_t fm_sample_pick_p(const float *lg, int64_t V, double temperature, int64_t top_k, double top_p, fm_rng *rng,
                         float *probs, int32_t *order) {
    if (temperature == 0 || !(top_p < 1)) return fm_sample_pick(lg, V, temperature, top_k, rng, probs, order);
    const int64_t kk = top_k > 0 && top_k < V ? top_k : V;
    for (int64_t v = 0; v < V; v++) order[v] = (int32_t)v;
    for (int64_t i = 0; i < kk && kk < V; i++) { /* the k largest first, as fm_sample_pick */
        int64_t best = i;
        for (int64_t j = i + 1; j < V; j++)
            if (lg[order[j]] > lg[order[best]]) best = j;
        const int32_t t = order[i]; order[i] = order[best]; order[best] = t;
    }
    sort_candidates(lg, order, kk);
    const double mx = lg[order[0]];
    double sum = 0;
    for (int64_t i = 0; i < kk; i++) { probs[i] = (float)exp((lg[order[i]] - mx) / temperature); sum += probs[i]; }
    double keep = 0;
    int64_t n = 0;
    while (n < kk && (n == 0 || keep < top_p * sum)) keep += probs[n++];
    double u = fm_rng_uniform_d(rng) * keep, acc = 0;
    int32_t next = order[n - 1];
    for (int64_t i = 0; i < n; i++) {
        acc += probs[i];
        if (u < acc) { next = order[i]; break; }
    }
    return next;
}

/* The checks and allocations both initializers share; the prompt is copied by the caller. */
static fm_status sampler_alloc(fm_sampler *s, fm_model *m, int64_t prompt_len, int64_t max_new, const fm_sample_opts *o) {
    memset(s, 0, sizeof *s);
    if (max_new < 0 || !(o->temperature >= 0) || o->top_k < 0)
        return fm_error(FM_ERR_ARG, "sampling: max_new, temperature and top_k must be >= 0 (found %lld, %g, %lld)",
                        (long long)max_new, o->temperature, (long long)o->top_k);
    const int64_t V = m->cfg.vocab_size;
    s->m = m;
    s->o = *o;
    s->cap = prompt_len + max_new + 1;
    s->max_new = max_new;
    s->seq = fm_malloc(sizeof(int32_t) * (size_t)s->cap);
    s->probs = fm_malloc(sizeof(float) * (size_t)V);
    s->order = fm_malloc(sizeof(int32_t) * (size_t)V);
    s->row = fm_malloc(sizeof(float) * (size_t)V);
    if (!s->seq || !s->probs || !s->order || !s->row) {
        fm_sampler_free(s);
        return fm_error(FM_ERR_NOMEM, "sampling: out of memory for %lld tokens and the [%lld] logits",
                        (long long)(prompt_len + max_new + 1), (long long)V);
    }
    fm_rng_seed(&s->rng, o->seed);
    return FM_OK;
}

fm_status fm_sampler_init(fm_sampler *s, fm_model *m, const char *prompt, size_t prompt_len, int64_t max_new,
                          const fm_sample_opts *o) {
    memset(s, 0, sizeof *s);
    const int64_t V = m->cfg.vocab_size;
    for (size_t i = 0; i < prompt_len; i++) {
        const int32_t t = (unsigned char)prompt[i];
        if (t >= V) return fm_error(FM_ERR_UNSUPPORTED, "prompt byte %d is not below vocab_size %lld", t, (long long)V);
    }
    FM_TRY(sampler_alloc(s, m, (int64_t)prompt_len, max_new, o));
    for (size_t i = 0; i < prompt_len; i++) s->seq[s->n++] = (unsigned char)prompt[i];
    if (s->n == 0) s->seq[s->n++] = '\n';
    return FM_OK;
}

fm_status fm_sampler_init_ids(fm_sampler *s, fm_model *m, const int32_t *ids, int64_t n, int64_t max_new,
                              const fm_sample_opts *o) {
    memset(s, 0, sizeof *s);
    const int64_t V = m->cfg.vocab_size;
    if (n < 1) return fm_error(FM_ERR_ARG, "sampling: the prompt has no tokens; give a non-empty prompt");
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= V)
            return fm_error(FM_ERR_UNSUPPORTED, "prompt token %lld has id %d, not below vocab_size %lld: the tokenizer "
                            "does not belong to this model (give the model's own with --tokenizer)", (long long)i, ids[i],
                            (long long)V);
    FM_TRY(sampler_alloc(s, m, n, max_new, o));
    memcpy(s->seq, ids, sizeof(int32_t) * (size_t)n);
    s->n = n;
    return FM_OK;
}

fm_status fm_sampler_next(fm_sampler *s, int32_t *token) {
    if (s->generated >= s->max_new)
        return fm_error(FM_ERR_ARG, "sampling: the %lld tokens asked for are generated", (long long)s->max_new);
    fm_model *m = s->m;
    const int64_t T = m->a.T_cap, len = s->n < T ? s->n : T;
    fm_model_set_shape(m, 1, len);
    const fm_batch b = {s->seq + s->n - len, NULL, 1, len}; /* the window's tokens, no targets */
    FM_TRY(fm_schedule_default_forward(m, &b, NULL));
    fm_model_logits_row(m, len - 1, s->row);
    for (int64_t v = 0; v < m->cfg.vocab_size; v++)
        if (!isfinite(s->row[v]))
            return fm_error(FM_ERR_NUMERIC, "sampling: the logit of token %lld is %g at generated token %lld: the "
                            "checkpoint's weights are damaged or diverged", (long long)v, (double)s->row[v],
                            (long long)s->generated + 1);
    const int32_t next = fm_sample_pick(s->row, m->cfg.vocab_size, s->o.temperature, s->o.top_k, &s->rng, s->probs,
                                        s->order);
    s->seq[s->n++] = next;
    s->generated++;
    *token = next;
    return FM_OK;
}

void fm_sampler_free(fm_sampler *s) {
    fm_free(s->seq);
    fm_free(s->probs);
    fm_free(s->order);
    fm_free(s->row);
    memset(s, 0, sizeof *s);
}
