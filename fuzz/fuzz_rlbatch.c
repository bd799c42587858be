/* libFuzzer harness: libflatmoe's RL batch (include/flatmoe.h flatmoe_batch, issue 29), as
 * flatmoe_logprobs and flatmoe_train_step take it from a caller, without a model: the validator
 * and packer fm_capi_pack_rows (src/capi/flatmoe_step.c) into B rows of T positions over a
 * vocabulary of V, then, for a batch that packs, the loss's validator and per-token coefficients
 * fm_pg_coefs (src/capi/flatmoe_pg.c) with a fuzzed loss spec and fuzzed per-token arrays.
 *
 * Input: a header piece (fm_fuzz.h fuzz_take) of 16 bytes (missing bytes read 0): B - 1 (mod 4),
 * T - 1 (mod 32), V - 1, flags (bit 0 targets at every position, 1 tokens NULL, 2 seq_lens NULL,
 * 3 loss_mask NULL, 4 advantages NULL, 5 old_logprobs NULL, 6 rollout_logprobs NULL,
 * 7 ref_logprobs NULL), the n_tokens mode (mod 4: the tokens given, that +- a byte, 0, a huge
 * value), a byte of delta, the n_seqs mode (mod 4: the lengths given, 0, -1, more than given),
 * loss, agg, kl (each a byte - 1: -1 .. 254), then clip_low, clip_high, clip_dual, tis_cap,
 * kl_coef (each an index into a table of values, NaN and infinities included). Then pieces: the
 * tokens (a byte each, token = byte - 2), the sequence lengths (a byte each, length = byte - 1),
 * the loss mask (raw bytes), and the per-token floats (4 bytes each: logp, advantages, old,
 * rollout, ref interleaved per token; the model's logp made finite and <= 0 as the model writes
 * it). Arrays shorter than their stated counts repeat their piece (the caller's arrays hold what
 * the batch states: the validator may read that much, no more).
 *
 * Invariants: a refused batch or spec is an error with a message; a batch that packs holds every
 * caller token once, in order, at its sequence's position with the model's batch valid
 * (fm_batch_check: tokens, targets, positions, document starts), the targets the contract gives
 * and padding without targets; coefficients that come back are 0 outside the loss, count the
 * loss tokens and sequences, keep the clip fractions in [0, 1], and are finite with the loss when
 * every input is moderate (log-probs in [-50, 0], |A| and the spec's values <= 1e6). */
#include <math.h>

#include "fm_fuzz.h"
#include "capi/fm_capi.h"

#define MAXB 4
#define MAXT 32
#define MAXN (MAXB * MAXT)
#define MAXS 512 /* sequence lengths given at most (more than the budget: the validator must refuse) */

static const double VALS[16] = {0, 0.2, 0.28, 1, 3, 2, -0.1, 0.999999, 1e6, 1e300, -0.0, 5e-324,
                                NAN, INFINITY, -INFINITY, -3};

static float get_f32(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

/* a[0 .. n) from piece (len bytes, `each` bytes per element) repeated; 0 when the piece is empty */
static const uint8_t *elem(const uint8_t *piece, size_t len, size_t each, size_t i) {
    static const uint8_t zero[8];
    const size_t k = len / each;
    return k ? piece + each * (i % k) : zero;
}

static bool moderate(double x, double lim) { return isfinite(x) && fabs(x) <= lim; }

/* Checks what a packed batch must hold (the header's comment). */
static void check_packed(const flatmoe_batch *b, int64_t B, int64_t T, int64_t V, bool all, const fm_batch *fb,
                         const int64_t *pos_of, const int32_t *seq_of, const uint8_t *in_loss) {
    const int64_t N = B * T;
    FUZZ_CHECK(b->n_tokens >= 1 && b->n_tokens <= N && b->n_seqs >= 1, "a batch of %lld tokens, %lld sequences packed",
               (long long)b->n_tokens, (long long)b->n_seqs);
    FUZZ_CHECK(fm_batch_check(fb, B, T, V) == FM_OK, "the packed batch is not valid: %s", fm_errmsg());
    bool seen[MAXN] = {false};
    int64_t t = 0, prev_end = -1;
    for (int64_t i = 0; i < b->n_seqs; i++) {
        const int64_t l = b->seq_lens[i];
        FUZZ_CHECK(l >= 1 && l <= T && t + l <= b->n_tokens, "sequence %lld of %lld tokens at %lld", (long long)i,
                   (long long)l, (long long)t);
        const int64_t p0 = pos_of[t], row = p0 / T, off = p0 % T;
        FUZZ_CHECK(off + l <= T, "sequence %lld crosses a row", (long long)i);
        /* first fit, in order: a sequence starts a new row only when it does not fit the last one */
        if (prev_end >= 0 && p0 != prev_end)
            FUZZ_CHECK(off == 0 && row == prev_end / T + (prev_end % T != 0) && prev_end % T + l > T,
                       "sequence %lld at %lld after a sequence ending at %lld", (long long)i, (long long)p0,
                       (long long)prev_end);
        for (int64_t j = 0; j < l; j++, t++) {
            const int64_t p = pos_of[t];
            FUZZ_CHECK(p == p0 + j && p >= 0 && p < N && !seen[p], "token %lld at position %lld", (long long)t,
                       (long long)p);
            seen[p] = true;
            FUZZ_CHECK(seq_of[t] == i, "token %lld in sequence %d, not %lld", (long long)t, seq_of[t], (long long)i);
            FUZZ_CHECK(fb->tokens[p] == b->tokens[t] && fb->pos[p] == j && fb->doc_start[p] == off,
                       "token %lld: %d at position %d, document start %d", (long long)t, fb->tokens[p], fb->pos[p],
                       fb->doc_start[p]);
            const bool loss = j > 0 && (!b->loss_mask || b->loss_mask[t]);
            FUZZ_CHECK(in_loss[t] == loss, "token %lld: in_loss %d", (long long)t, in_loss[t]);
        }
        for (int64_t j = 0; j < l; j++) {
            const int64_t u = t - l + j, p = pos_of[u];
            const bool next = j + 1 < l && (all || in_loss[u + 1]);
            FUZZ_CHECK(fb->targets[p] == (next ? b->tokens[u + 1] : -100), "token %lld: target %d", (long long)u,
                       fb->targets[p]);
        }
        prev_end = p0 + l;
    }
    FUZZ_CHECK(t == b->n_tokens, "the sequences hold %lld of %lld tokens", (long long)t, (long long)b->n_tokens);
    for (int64_t p = 0; p < N; p++)
        if (!seen[p])
            FUZZ_CHECK(fb->targets[p] == -100, "padding position %lld has target %d", (long long)p, fb->targets[p]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *p = data, *hp, *tp, *sp, *mp, *fp;
    size_t n = size, hl, tl, sl, ml, fl;
    fuzz_take(&p, &n, &hp, &hl);
    fuzz_take(&p, &n, &tp, &tl);
    fuzz_take(&p, &n, &sp, &sl);
    fuzz_take(&p, &n, &mp, &ml);
    fuzz_take(&p, &n, &fp, &fl);
    uint8_t h[16] = {0};
    memcpy(h, hp, hl < 16 ? hl : 16);
    const int64_t B = 1 + h[0] % MAXB, T = 1 + h[1] % MAXT, V = 1 + h[2], N = B * T;
    const uint8_t fl_ = h[3];
    const bool all = fl_ & 1;
    if (tl > MAXN + 8) tl = MAXN + 8;
    if (sl > MAXS) sl = MAXS;

    flatmoe_batch b;
    memset(&b, 0, sizeof b);
    switch (h[4] % 4) {
    case 0: b.n_tokens = (int64_t)tl; break;
    case 1: b.n_tokens = (int64_t)tl + (int8_t)h[5]; break;
    case 2: b.n_tokens = 0; break;
    default: b.n_tokens = INT64_MAX - h[5]; break;
    }
    switch (h[6] % 4) {
    case 0: b.n_seqs = (int64_t)sl; break;
    case 1: b.n_seqs = 0; break;
    case 2: b.n_seqs = -1; break;
    default: b.n_seqs = (int64_t)sl + h[5] % 16; break;
    }
    /* the caller's arrays hold n_tokens (n_seqs) elements when that is a size the validator may
     * read: within the budget (tokens) or what was given (lengths); else none (it must refuse first) */
    const int64_t nt = b.n_tokens >= 1 && b.n_tokens <= N ? b.n_tokens : 0, ns = b.n_seqs >= 1 ? b.n_seqs : 0;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)(nt + 1));
    int64_t *lens = malloc(sizeof(int64_t) * (size_t)(ns + 1));
    uint8_t *mask = malloc((size_t)nt + 1);
    float *f = malloc(sizeof(float) * 5 * (size_t)(nt + 1));
    FUZZ_CHECK(tok && lens && mask && f, "out of memory");
    for (int64_t i = 0; i < nt; i++) {
        tok[i] = (int32_t)*elem(tp, tl, 1, (size_t)i) - 2;
        mask[i] = *elem(mp, ml, 1, (size_t)i);
    }
    for (int64_t i = 0; i < ns; i++) lens[i] = (int64_t)*elem(sp, sl, 1, (size_t)i) - 1;
    float *logp = f, *adv = f + nt, *old = f + 2 * nt, *roll = f + 3 * nt, *ref = f + 4 * nt;
    for (int64_t i = 0; i < 5 * nt; i++) {
        const int64_t t = i / 5, k = i % 5;
        float x = get_f32(elem(fp, fl, 4, (size_t)i));
        if (k == 0) x = isfinite(x) ? -fabsf(x) : -1.0f; /* the model's log p: finite, <= 0 */
        f[k * nt + t] = x;
    }
    b.tokens = fl_ & 2 ? NULL : tok;
    b.seq_lens = fl_ & 4 ? NULL : lens;
    b.loss_mask = fl_ & 8 ? NULL : mask;
    b.advantages = fl_ & 16 ? NULL : adv;
    b.old_logprobs = fl_ & 32 ? NULL : old;
    b.rollout_logprobs = fl_ & 64 ? NULL : roll;
    b.ref_logprobs = fl_ & 128 ? NULL : ref;

    static int32_t ftok[MAXN], ftgt[MAXN], fpos[MAXN], fds[MAXN], seq_of[MAXN];
    static int64_t pos_of[MAXN], seq_count[MAXN];
    static uint8_t in_loss[MAXN];
    static double coef[MAXN];
    fm_batch fb = {.tokens = ftok, .targets = ftgt, .B = B, .T = T, .pos = fpos, .doc_start = fds};
    (void)fm_error(FM_ERR_ARG, "%s", ""); /* no message: a refusal must write one */
    if (fm_capi_pack_rows(&b, B, T, V, all, &fb, pos_of, seq_of, in_loss) != FM_OK) {
        FUZZ_CHECK(fm_errmsg()[0] != 0, "a refused batch without a message");
        goto out;
    }
    check_packed(&b, B, T, V, all, &fb, pos_of, seq_of, in_loss);

    flatmoe_loss_spec spec = flatmoe_loss_spec_default();
    spec.loss = (int)h[7] - 1;
    spec.agg = (int)h[8] - 1;
    spec.kl = (int)h[9] - 1;
    spec.clip_low = VALS[h[10] % 16];
    spec.clip_high = VALS[h[11] % 16];
    spec.clip_dual = VALS[h[12] % 16];
    spec.tis_cap = VALS[h[13] % 16];
    spec.kl_coef = VALS[h[14] % 16];
    flatmoe_step_stats st;
    memset(&st, 0, sizeof st);
    const float *ent = h[15] & 1 ? NULL : logp;
    (void)fm_error(FM_ERR_ARG, "%s", "");
    if (fm_pg_coefs(&spec, &b, b.n_tokens, logp, ent, in_loss, seq_of, seq_count, coef, &st) != FM_OK) {
        FUZZ_CHECK(fm_errmsg()[0] != 0, "a refused spec without a message");
        goto out;
    }
    int64_t M = 0, S = 0;
    bool mod = moderate(spec.clip_low, 1e6) && moderate(spec.clip_high, 1e6) && moderate(spec.clip_dual, 1e6) &&
               moderate(spec.tis_cap, 1e6) && moderate(spec.kl_coef, 1e6);
    for (int64_t t = 0; t < b.n_tokens; t++) {
        if (!in_loss[t]) {
            FUZZ_CHECK(coef[t] == 0, "token %lld outside the loss has coefficient %g", (long long)t, coef[t]);
            continue;
        }
        M++;
        const bool pg = spec.loss == FLATMOE_LOSS_PG;
        mod = mod && logp[t] >= -50 && (!pg || moderate(adv[t], 1e6)) &&
              (!pg || !b.old_logprobs || (old[t] >= -50 && old[t] <= 0)) &&
              (!pg || spec.tis_cap == 0 || (roll[t] >= -50 && roll[t] <= 0)) &&
              (spec.kl == FLATMOE_KL_NONE || (ref[t] >= -50 && ref[t] <= 0));
    }
    for (int64_t i = 0, t = 0; i < b.n_seqs; t += b.seq_lens[i], i++) {
        bool any = false;
        for (int64_t j = 0; j < b.seq_lens[i]; j++) any |= in_loss[t + j];
        S += any;
    }
    FUZZ_CHECK(st.n_loss_tokens == M && M >= 1 && st.n_loss_seqs == S, "loss tokens %lld (counted %lld), sequences "
               "%lld (counted %lld)", (long long)st.n_loss_tokens, (long long)M, (long long)st.n_loss_seqs,
               (long long)S);
    const double fr[4] = {st.clip_frac, st.clip_frac_low, st.clip_frac_high, st.dual_clip_frac};
    for (int i = 0; i < 4; i++) FUZZ_CHECK(fr[i] >= 0 && fr[i] <= 1, "clip fraction %d is %g", i, fr[i]);
    if (mod) {
        FUZZ_CHECK(isfinite(st.loss) && isfinite(st.pg_loss) && isfinite(st.kl), "moderate inputs, loss %g (pg %g, "
                   "kl %g)", st.loss, st.pg_loss, st.kl);
        for (int64_t t = 0; t < b.n_tokens; t++)
            FUZZ_CHECK(isfinite(coef[t]), "moderate inputs, token %lld's coefficient %g", (long long)t, coef[t]);
    }
out:
    free(tok);
    free(lens);
    free(mask);
    free(f);
    return 0;
}
