/* libflatmoe's sampling for rollouts (include/flatmoe.h flatmoe_generate): every prompt with its
 * completion so far packed as one batch (fm_capi_pack), one forward per round (fm_capi_forward),
 * the logits of each unfinished sequence's last position from the final hidden state and the LM
 * head in vocabulary blocks (the linear CE's strip memory), and the engine's sampler
 * (src/train/fm_sample.h) drawing the next tokens; then one more forward gives the completions'
 * log-probs exactly as flatmoe_logprobs does. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../bounded/fm_linear_ce.h"
#include "../train/fm_sample.h"
#include "fm_capi.h"

flatmoe_sample_spec flatmoe_sample_spec_default(void) {
    const flatmoe_sample_spec sp = {16, 1.0, 0, 1.0, 0, -1};
    return sp;
}

/* The logits [V] (host fp32) of model position p after the last forward: xf[p] W^T in vocabulary
 * blocks of Vb, each through one [Vb] fp32 strip taken from the vocabulary live set's arena (the
 * linear CE's scratch, free between its calls: within its planned bound) and copied back. A sync
 * point per block. */
static void logits_at(flatmoe_session *s, int64_t p, float *row) {
    fm_model *m = &s->r.m;
    const fm_ops *ops = m->be.ops;
    const int64_t H = s->r.cfg.hidden_size, V = s->r.cfg.vocab_size;
    int64_t vb = m->a.ce_block_vocab > 0 ? m->a.ce_block_vocab : FM_LCE_DEFAULT_BLOCK_VOCAB;
    vb = vb < V ? vb : V;
    fm_arena *ws = &m->a.arena[FM_LIVE_VOCAB];
    const size_t used0 = ws->used;
    float *S = fm_arena_alloc(ws, sizeof(float) * (size_t)vb);
    for (int64_t v0 = 0; v0 < V; v0 += vb) {
        const int64_t n = V - v0 < vb ? V - v0 : vb;
        ops->gemm(m->be.ctx, false, true, 1, n, H, 1.0f, m->a.xf + p * H, H, m->p.w.lm_head + v0 * H, H, 0.0f, S,
                  FM_DTYPE_F32, n);
        ops->stream_sync(m->be.ctx, FM_STREAM_COMPUTE); /* sync point "sampling logits" */
        ops->copy(m->be.ctx, row + v0, S, sizeof(float) * (size_t)n, FM_COPY_D2H);
    }
    ws->used = used0;
}

/* The batch of every prompt with its first done[i] completion tokens (the caller's rows), or with
 * `pad` tokens of 0 each when pad >= 0 (the budget check). */
static void build(flatmoe_session *s, const int32_t *prompts, int64_t n_p, const int64_t *plen, const int32_t *out,
                  const int64_t *done, int64_t max_new, int64_t pad, flatmoe_batch *b) {
    fm_capi_gen *g = &s->gen;
    int64_t t = 0, q = 0;
    for (int64_t i = 0; i < n_p; i++) {
        g->start[i] = t;
        memcpy(g->tok + t, prompts + q, sizeof(int32_t) * (size_t)plen[i]);
        t += plen[i];
        q += plen[i];
        const int64_t k = pad >= 0 ? pad : done[i];
        for (int64_t j = 0; j < k; j++) g->tok[t++] = pad >= 0 ? 0 : out[i * max_new + j];
        g->lens[i] = plen[i] + k;
    }
    memset(b, 0, sizeof *b);
    b->n_tokens = t;
    b->tokens = g->tok;
    b->n_seqs = n_p;
    b->seq_lens = g->lens;
}

static fm_status check_args(const flatmoe_session *s, const int32_t *prompts, int64_t n_p, const int64_t *plen,
                            const flatmoe_sample_spec *sp, const int32_t *out, const int64_t *out_lens) {
    if (!s || !sp || !out || !out_lens || !prompts || !plen)
        return fm_error(FM_ERR_ARG, "flatmoe_generate: %s is NULL", !s ? "the session" : !sp ? "spec" : !out ? "out_tokens"
                        : !out_lens ? "out_lens" : !prompts ? "prompts" : "prompt_lens");
    const int64_t V = s->r.cfg.vocab_size;
    if (n_p < 1 || n_p > s->budget)
        return fm_error(FM_ERR_ARG, "flatmoe_generate: n_prompts is %lld; expected 1 .. %lld (the token budget)",
                        (long long)n_p, (long long)s->budget);
    if (sp->max_new < 1 || sp->max_new >= s->T || !(sp->temperature >= 0) || !isfinite(sp->temperature) ||
        sp->top_k < 0 || !(sp->top_p > 0 && sp->top_p <= 1) || sp->stop_token < -1 || sp->stop_token >= V)
        return fm_error(FM_ERR_ARG, "flatmoe_generate: spec max_new %lld, temperature %g, top_k %lld, top_p %g, "
                        "stop_token %d; expected max_new 1 .. %lld (below --seq-len), temperature >= 0, top_k >= 0, top_p "
                        "in (0, 1], stop_token -1 or a token id below %lld", (long long)sp->max_new, sp->temperature,
                        (long long)sp->top_k, sp->top_p, sp->stop_token, (long long)s->T - 1, (long long)V);
    int64_t total = 0;
    for (int64_t i = 0; i < n_p; i++) {
        if (plen[i] < 1 || plen[i] > s->T)
            return fm_error(FM_ERR_ARG, "flatmoe_generate: prompt_lens[%lld] is %lld; expected 1 .. %lld (--seq-len)",
                            (long long)i, (long long)plen[i], (long long)s->T);
        total += plen[i] + sp->max_new;
    }
    if (total > s->budget)
        return fm_error(FM_ERR_ARG, "flatmoe_generate: %lld prompts of %lld tokens with max_new %lld each need %lld "
                        "tokens, over the session's token budget of %lld (--micro-batch %lld x --seq-len %lld); send "
                        "fewer prompts per call, a smaller max_new, or open the session with a larger --micro-batch",
                        (long long)n_p, (long long)(total - n_p * sp->max_new), (long long)sp->max_new,
                        (long long)total, (long long)s->budget, (long long)s->B, (long long)s->T);
    return FM_OK;
}

/* The next token of every unfinished sequence after one forward of the batch b. */
static fm_status round_once(flatmoe_session *s, const flatmoe_batch *b, int64_t n_p, const flatmoe_sample_spec *sp,
                            fm_rng *rng, int32_t *out, int64_t *out_lens, bool *any) {
    fm_capi_gen *g = &s->gen;
    const int64_t V = s->r.cfg.vocab_size;
    FM_TRY(fm_capi_pack(s, b, true));
    FM_TRY(fm_capi_forward(s, b));
    *any = false;
    for (int64_t i = 0; i < n_p; i++) {
        const int64_t k = out_lens[i];
        if (k >= sp->max_new || (k > 0 && out[i * sp->max_new + k - 1] == sp->stop_token)) continue;
        logits_at(s, s->pos_of[g->start[i] + b->seq_lens[i] - 1], g->row);
        for (int64_t v = 0; v < V; v++)
            if (!isfinite(g->row[v]))
                return fm_error(FM_ERR_NUMERIC, "flatmoe_generate: the logit of token %lld is %g for prompt %lld at "
                                "completion token %lld: the weights diverged (check the last steps' losses)",
                                (long long)v, (double)g->row[v], (long long)i, (long long)k);
        out[i * sp->max_new + k] = fm_sample_pick_p(g->row, V, sp->temperature, sp->top_k, sp->top_p, rng, g->probs,
                                                    g->order);
        out_lens[i] = k + 1;
        *any = true;
    }
    return FM_OK;
}

/* Draws sequence i's next token from the final-normed hidden state h [H] (the LM head over the
 * whole vocabulary into the sampler's row, host memory: the KV path's CPU build). */
static fm_status kv_draw(flatmoe_session *s, const float *h, int64_t i, const flatmoe_sample_spec *sp, fm_rng *rng,
                         int32_t *out, int64_t *out_lens) {
    fm_capi_gen *g = &s->gen;
    const int64_t V = s->r.cfg.vocab_size, k = out_lens[i];
    fm_linear_fwd(&s->r.m.be, g->row, FM_DTYPE_F32, (const fm_act *)h, s->r.m.p.w.lm_head, 1, s->r.cfg.hidden_size,
                  V); /* fp32 on the CPU build, the only one with the cache (fm_capi_kv_check) */
    for (int64_t v = 0; v < V; v++)
        if (!isfinite(g->row[v]))
            return fm_error(FM_ERR_NUMERIC, "flatmoe_generate: the logit of token %lld is %g for prompt %lld at "
                            "completion token %lld: the weights diverged (check the last steps' losses)",
                            (long long)v, (double)g->row[v], (long long)i, (long long)k);
    out[i * sp->max_new + k] = fm_sample_pick_p(g->row, V, sp->temperature, sp->top_k, sp->top_p, rng, g->probs,
                                                g->order);
    out_lens[i] = k + 1;
    return FM_OK;
}

/* The rounds through the KV cache (--kv-cache; flatmoe_kv.c): one pass over every prompt (sequence
 * i's tokens at cache slots base_i + position, base_i = sum over j < i of prompt_lens[j] + max_new:
 * within the budget, as checked), then one pass per round over each unfinished sequence's last
 * token; the draws in round_once's order (sequences in order, one RNG), so only the logits' fp32
 * rounding differs from the whole-prefix rounds. */
static fm_status kv_rounds(flatmoe_session *s, const int32_t *prompts, int64_t n_p, const int64_t *plen,
                           const flatmoe_sample_spec *sp, int32_t *out, int64_t *out_lens) {
    fm_capi_gen *g = &s->gen;
    fm_capi_kv *kv = &s->kv;
    const int64_t M = sp->max_new, H = s->r.cfg.hidden_size;
    fm_rng rng;
    fm_rng_seed(&rng, sp->seed);
    int64_t n = 0, base = 0;
    for (int64_t i = 0; i < n_p; i++) { /* the prompts' pass */
        g->start[i] = base;
        for (int64_t j = 0; j < plen[i]; j++, n++) {
            g->tok[n] = prompts[n];
            kv->pos[n] = (int32_t)j;
            kv->slot[n] = base + j;
            kv->first[n] = base;
        }
        base += plen[i] + M;
    }
    FM_TRY(fm_capi_kv_pass(s, g->tok, n));
    for (int64_t i = 0, last = -1; i < n_p; i++) {
        last += plen[i];
        FM_TRY(kv_draw(s, kv->ln + last * H, i, sp, &rng, out, out_lens));
    }
    for (int64_t r = 1; r < M; r++) {
        n = 0;
        for (int64_t i = 0; i < n_p; i++) { /* each unfinished sequence's last token */
            const int64_t k = out_lens[i];
            if (k >= M || out[i * M + k - 1] == sp->stop_token) continue;
            g->tok[n] = out[i * M + k - 1];
            kv->pos[n] = (int32_t)(plen[i] + k - 1);
            kv->slot[n] = g->start[i] + plen[i] + k - 1;
            kv->first[n] = g->start[i];
            g->lens[n++] = i;
        }
        if (n == 0) break;
        FM_TRY(fm_capi_kv_pass(s, g->tok, n));
        for (int64_t t = 0; t < n; t++) FM_TRY(kv_draw(s, kv->ln + t * H, g->lens[t], sp, &rng, out, out_lens));
    }
    return FM_OK;
}

/* The sampling rounds, then (out_logprobs set) the forward over the prompts with their completions
 * whose log-probs the caller reads from s->logp. */
static fm_status rounds(flatmoe_session *s, const int32_t *prompts, int64_t n_prompts, const int64_t *prompt_lens,
                        const flatmoe_sample_spec *spec, int32_t *out_tokens, int64_t *out_lens, float *out_logprobs,
                        flatmoe_batch *b) {
    const int64_t M = spec->max_new;
    if (s->kv.on) FM_TRY(kv_rounds(s, prompts, n_prompts, prompt_lens, spec, out_tokens, out_lens));
    fm_rng rng;
    fm_rng_seed(&rng, spec->seed);
    bool any = !s->kv.on; /* the whole-prefix rounds (without --kv-cache) */
    for (int64_t k = 0; k < M && any; k++) {
        build(s, prompts, n_prompts, prompt_lens, out_tokens, out_lens, M, -1, b);
        FM_TRY(round_once(s, b, n_prompts, spec, &rng, out_tokens, out_lens, &any));
    }
    if (!out_logprobs) return FM_OK;
    build(s, prompts, n_prompts, prompt_lens, out_tokens, out_lens, M, -1, b);
    FM_TRY(fm_capi_pack(s, b, true)); /* flatmoe_logprobs' own path on the same sequences */
    return fm_capi_forward(s, b);
}

int flatmoe_generate(flatmoe_session *s, const int32_t *prompts, int64_t n_prompts, const int64_t *prompt_lens,
                     const flatmoe_sample_spec *spec, int32_t *out_tokens, int64_t *out_lens, float *out_logprobs) {
    FM_TRY(check_args(s, prompts, n_prompts, prompt_lens, spec, out_tokens, out_lens));
    FM_TRY(fm_capi_awake(s, "flatmoe_generate"));
    FM_TRY(fm_capi_one_rank(s, "flatmoe_generate"));
    const int64_t M = spec->max_new;
    flatmoe_batch b;
    build(s, prompts, n_prompts, prompt_lens, NULL, NULL, M, M, &b); /* the longest batch: the tokens and packing */
    const fm_status fits = fm_capi_pack(s, &b, true);
    if (fits != FM_OK) {
        char msg[2048]; /* the message outlives the next fm_error */
        snprintf(msg, sizeof msg, "%s", fm_errmsg());
        return fm_error(fits, "flatmoe_generate: the prompts with max_new %lld tokens each: %s", (long long)M, msg);
    }
    for (int64_t i = 0; i < n_prompts * M; i++) out_tokens[i] = -1;
    for (int64_t i = 0; i < n_prompts; i++) out_lens[i] = 0;
    fm_capi_call_begin(s, NULL, false, false); /* the forwards' entropies and routes, as flatmoe_logprobs' */
    const fm_status st = rounds(s, prompts, n_prompts, prompt_lens, spec, out_tokens, out_lens, out_logprobs, &b);
    fm_capi_call_end(s);
    FM_TRY(st);
    if (!out_logprobs) return FLATMOE_OK;
    for (int64_t i = 0; i < n_prompts; i++)
        for (int64_t j = 0; j < M; j++)
            out_logprobs[i * M + j] = j < out_lens[i] ? s->logp[s->gen.start[i] + prompt_lens[i] + j] : 0.0f;
    return FLATMOE_OK;
}
