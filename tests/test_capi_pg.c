/* libflatmoe's losses (include/flatmoe.h flatmoe_loss_spec; src/capi/flatmoe_pg.c):
 *  - the per-token coefficients c_t = dL/dlog p_t and the loss of every mode (SFT and the
 *    clipped surrogate; clip-low/high, dual clip, truncated IS, KL k1/k3; the three aggregations)
 *    against a plain fp64 reference written in verl's form (core_algos.compute_policy_loss,
 *    agg_loss), differentiated by central differences; the clip statistics against its counts;
 *  - the gradient of a whole PG step (forward, coefficients, the linear CE's weighted backward,
 *    the layers') against finite differences of the loss in the weights, on a micro config;
 *  - an SFT step equals `train`'s step (fm_train_step) on the same packed batch, bit for bit. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "capi/fm_capi.h"
#include "core/fm_rng.h"
#include "fm_test.h"

static double unif(fm_rng *g, double a, double b) { return a + (b - a) * (double)fm_rng_below(g, 1u << 30) / (double)(1u << 30); }

/* ---- the reference: one function of the log-probs, in verl's form ---- */

typedef struct ref_batch {
    int64_t n, n_seqs;
    const int32_t *seq_of;
    const uint8_t *in_loss;
    const float *adv, *old, *roll, *ref;
} ref_batch;

static double ref_loss(const flatmoe_loss_spec *sp, const ref_batch *rb, const double *lp) {
    double tok_l[256], seq_sum[64] = {0}, seq_n[64] = {0}, tot = 0, m = 0;
    for (int64_t t = 0; t < rb->n; t++) {
        if (!rb->in_loss[t]) continue;
        double l;
        if (sp->loss == FLATMOE_LOSS_SFT) l = -lp[t];
        else {
            const double A = rb->adv[t], ratio = exp(lp[t] - rb->old[t]);
            const double lo = 1.0 - sp->clip_low, hi = 1.0 + sp->clip_high;
            const double pg1 = -A * ratio, pg2 = -A * (ratio < lo ? lo : ratio > hi ? hi : ratio);
            const double clipped = pg1 > pg2 ? pg1 : pg2;
            l = clipped;
            if (sp->clip_dual > 0) {
                const double pg3 = -A * sp->clip_dual;
                l = A < 0 ? (pg3 < clipped ? pg3 : clipped) : clipped;
            }
            if (sp->tis_cap > 0) {
                const double w = exp((double)rb->old[t] - (double)rb->roll[t]);
                l *= w < sp->tis_cap ? w : sp->tis_cap;
            }
        }
        if (sp->kl == FLATMOE_KL_K1) l += sp->kl_coef * (lp[t] - rb->ref[t]);
        if (sp->kl == FLATMOE_KL_K3) {
            const double d = (double)rb->ref[t] - lp[t];
            l += sp->kl_coef * (exp(d) - d - 1.0);
        }
        tok_l[t] = l;
        seq_sum[rb->seq_of[t]] += l;
        seq_n[rb->seq_of[t]] += 1;
        tot += l;
        m += 1;
    }
    if (sp->agg == FLATMOE_AGG_TOKEN_MEAN) return tot / m;
    double s = 0, S = 0;
    for (int64_t i = 0; i < rb->n_seqs; i++) {
        if (seq_n[i] == 0) continue;
        s += sp->agg == FLATMOE_AGG_SEQ_MEAN_TOKEN_SUM ? seq_sum[i] : seq_sum[i] / seq_n[i];
        S += 1;
    }
    (void)tok_l;
    return s / S;
}

enum { N = 200, NSEQ = 12 };

static void test_coefs(fm_rng *g) {
    static float lp[N], adv[N], old[N], roll[N], refl[N];
    static uint8_t mask[N], in_loss[N];
    static int32_t seq_of[N], toks[N];
    static int64_t lens[NSEQ], cnt[NSEQ];
    static double coef[N], lpd[N];
    int64_t t = 0;
    for (int i = 0; i < NSEQ; i++) {
        lens[i] = i == NSEQ - 1 ? N - t : 4 + (int64_t)fm_rng_below(g, 20);
        for (int64_t j = 0; j < lens[i]; j++, t++) {
            seq_of[t] = i;
            toks[t] = 0;
            mask[t] = i == 3 ? 0 : fm_rng_below(g, 4) != 0; /* sequence 3 has no loss token */
            in_loss[t] = j > 0 && mask[t];
            lp[t] = (float)unif(g, -4.0, -0.05);
            adv[t] = (float)unif(g, -2.0, 2.0);
            double d; /* lp - old: ratios from e^-0.7 to e^1.5 (the dual clip at 3 is reached), kept 1e-3 off every kink */
            do d = unif(g, -0.7, 1.5);
            while (fabs(exp(d) - 0.8) < 1e-3 || fabs(exp(d) - 1.2) < 1e-3 || fabs(exp(d) - 1.28) < 1e-3 ||
                   fabs(exp(d) - 3.0) < 1e-3);
            old[t] = (float)(lp[t] - d);
            roll[t] = (float)(old[t] + unif(g, -1.0, 1.0)); /* TIS weights on both sides of the cap 2 */
            refl[t] = (float)(lp[t] + unif(g, -0.5, 0.5));
        }
    }
    flatmoe_batch b = {N, toks, NSEQ, lens, mask, adv, old, roll, refl};
    const ref_batch rb = {N, NSEQ, seq_of, in_loss, adv, old, roll, refl};
    for (t = 0; t < N; t++) lpd[t] = lp[t];
    int modes = 0;
    for (int loss = 0; loss < 2; loss++)
        for (int agg = 0; agg < 3; agg++)
            for (int clip = 0; clip < 2; clip++)
                for (int tis = 0; tis < 2; tis++)
                    for (int kl = 0; kl < 3; kl++) {
                        if (loss == FLATMOE_LOSS_SFT && (clip || tis)) continue;
                        flatmoe_loss_spec sp = flatmoe_loss_spec_default();
                        sp.loss = loss, sp.agg = agg, sp.kl = kl, sp.kl_coef = 0.05;
                        if (clip) sp.clip_high = 0.28, sp.clip_dual = 3.0;
                        if (tis) sp.tis_cap = 2.0;
                        flatmoe_step_stats st;
                        memset(&st, 0, sizeof st);
                        CHECK(fm_pg_coefs(&sp, &b, N, lp, NULL, in_loss, seq_of, cnt, coef, &st) == FM_OK);
                        const double L = ref_loss(&sp, &rb, lpd);
                        /* token-mean's 1/|M| is rounded to fp32 (as train's 1/valid): 2^-24 relative */
                        CHECK_CLOSE(st.loss, L, 1e-6);
                        double worst = 0, cmax = 0;
                        for (t = 0; t < N; t++) cmax = fabs(coef[t]) > cmax ? fabs(coef[t]) : cmax;
                        for (t = 0; t < N; t++) { /* central differences: truncation h^2 L''' ~ 1e-12, rounding 1e-16 / h */
                            const double h = 1e-5, x = lpd[t];
                            lpd[t] = x + h;
                            const double up = ref_loss(&sp, &rb, lpd);
                            lpd[t] = x - h;
                            const double dn = ref_loss(&sp, &rb, lpd);
                            lpd[t] = x;
                            const double fd = (up - dn) / (2 * h), d = fabs(fd - coef[t]);
                            worst = d > worst ? d : worst;
                            if (!in_loss[t]) CHECK(coef[t] == 0.0);
                        }
                        CHECK_MSG(worst <= 1e-7 * (1.0 + cmax) + 1e-6 * cmax, "mode loss %d agg %d clip %d tis %d kl %d: "
                                  "coefficient off by %.3g (largest %.3g)", loss, agg, clip, tis, kl, worst, cmax);
                        if (loss == FLATMOE_LOSS_PG) { /* the statistics against the reference's own counts */
                            int64_t lo = 0, hi = 0, dual = 0, M = 0;
                            for (t = 0; t < N; t++) {
                                if (!in_loss[t]) continue;
                                const double r = exp(lpd[t] - old[t]), A = adv[t];
                                M++;
                                lo += A < 0 && r < 1 - sp.clip_low;
                                hi += A > 0 && r > 1 + sp.clip_high;
                                dual += sp.clip_dual > 0 && A < 0 && r > sp.clip_dual;
                            }
                            CHECK(st.n_loss_tokens == M && st.n_loss_seqs == NSEQ - 1);
                            CHECK_CLOSE(st.clip_frac_low, (double)lo / (double)M, 1e-12);
                            CHECK_CLOSE(st.clip_frac_high, (double)hi / (double)M, 1e-12);
                            CHECK_CLOSE(st.dual_clip_frac, (double)dual / (double)M, 1e-12);
                            if (clip) CHECK(dual > 0 && lo > 0 && hi > 0); /* every branch was taken */
                        }
                        modes++;
                    }
    printf("coefficients: %d modes against the fp64 reference\n", modes);
    /* on-policy (old NULL): ratio 1, so the surrogate's coefficient is -A a_t */
    flatmoe_loss_spec sp = flatmoe_loss_spec_default();
    sp.loss = FLATMOE_LOSS_PG;
    b.old_logprobs = NULL;
    flatmoe_step_stats st;
    CHECK(fm_pg_coefs(&sp, &b, N, lp, NULL, in_loss, seq_of, cnt, coef, &st) == FM_OK);
    const double a = (double)(1.0f / (float)st.n_loss_tokens);
    int64_t bad = 0;
    for (t = 0; t < N; t++) bad += in_loss[t] && coef[t] != -(double)adv[t] * a;
    CHECK(bad == 0 && st.ratio_mean == 1.0 && st.clip_frac == 0);
    /* refusals: a PG spec without advantages, a KL without reference log-probs, a bad clip */
    b.advantages = NULL;
    CHECK(fm_pg_coefs(&sp, &b, N, lp, NULL, in_loss, seq_of, cnt, coef, &st) == FM_ERR_ARG);
    b.advantages = adv;
    b.ref_logprobs = NULL;
    sp.kl = FLATMOE_KL_K3;
    CHECK(fm_pg_coefs(&sp, &b, N, lp, NULL, in_loss, seq_of, cnt, coef, &st) == FM_ERR_ARG);
    sp.kl = FLATMOE_KL_NONE;
    sp.clip_dual = 0.5;
    CHECK(fm_pg_coefs(&sp, &b, N, lp, NULL, in_loss, seq_of, cnt, coef, &st) == FM_ERR_ARG);
}

/* ---- the model: the micro config of test_capi.c (router aux loss 0: the loss is the spec's alone) ---- */

static const char *CFG =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", \"vocab_size\": 100,\n"
    " \"hidden_size\": 32, \"intermediate_size\": 64, \"moe_intermediate_size\": 32, \"num_hidden_layers\": 2,\n"
    " \"num_attention_heads\": 2, \"num_key_value_heads\": 2, \"head_dim\": 16, \"hidden_act\": \"silu\",\n"
    " \"max_position_embeddings\": 64, \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-06, \"attention_bias\": false,\n"
    " \"num_experts\": 4, \"num_experts_per_tok\": 2, \"norm_topk_prob\": true, \"decoder_sparse_step\": 1,\n"
    " \"mlp_only_layers\": [], \"router_aux_loss_coef\": 0.0, \"initializer_range\": 0.2,\n"
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"float32\"}\n";
static char cfg_path[64], threads_s[16];

static flatmoe_session *open_micro(void) {
    const char *argv[] = {"--config", cfg_path, "--seq-len", "16", "--micro-batch", "3", "--threads", threads_s,
                          "--ce-block-tokens", "16", "--ce-block-vocab", "24", "--seed", "11", "--lr", "1e-2",
                          "--warmup", "0", "--quiet"};
    flatmoe_session *s = NULL;
    const int rc = flatmoe_open(&s, (int)(sizeof argv / sizeof argv[0]), argv);
    CHECK_MSG(rc == FLATMOE_OK, "flatmoe_open: %s", flatmoe_last_error());
    return s;
}

enum { MT = 44, MS = 4 };
static int32_t mtok[MT];
static int64_t mlens[MS] = {16, 10, 6, 12};
static uint8_t mmask[MT];
static float madv[MT], mold[MT], mroll[MT], mref[MT], mlp[MT];

static void model_batch(flatmoe_batch *b, fm_rng *g) {
    memset(b, 0, sizeof *b);
    for (int64_t t = 0, i = 0; i < MS; i++)
        for (int64_t j = 0; j < mlens[i]; j++, t++) {
            mtok[t] = (int32_t)fm_rng_below(g, 100);
            mmask[t] = j >= 2;
            madv[t] = (float)unif(g, -1.5, 1.5);
        }
    b->n_tokens = MT;
    b->tokens = mtok;
    b->n_seqs = MS;
    b->seq_lens = mlens;
    b->loss_mask = mmask;
    b->advantages = madv;
}

/* The spec's loss at the session's current weights (forward and coefficients, no backward). */
static double loss_at(flatmoe_session *s, const flatmoe_batch *b, const flatmoe_loss_spec *sp) {
    flatmoe_step_stats st;
    FM_ASSERT(fm_capi_pack(s, b, false) == FM_OK);
    fm_capi_call_begin(s, b, false, false); /* the forward's switches, as flatmoe_logprobs sets them */
    FM_ASSERT(fm_capi_forward(s, b) == FM_OK);
    fm_capi_call_end(s);
    FM_ASSERT(fm_pg_coefs(sp, b, b->n_tokens, s->logp, s->ent, s->in_loss, s->seq_of, s->seq_count, s->coef, &st) ==
              FM_OK);
    return st.loss;
}

/* ent_coef != 0: with the entropy bonus (l_t -= c H_t; its gradient through the logits, the
 * backend's lce_strip_grad_ent), large enough that its share of the gradient exceeds the tolerance:
 * the largest change of a checked gradient against the step without it is printed and required to
 * be over 10x the tolerance, so a missing or wrong entropy gradient fails. */
static double g_noent[16];
static int64_t g_pick[16];

static void test_step_grad(fm_rng *g, double ent_coef) {
    flatmoe_session *s = open_micro();
    if (!s) return;
    flatmoe_batch b;
    model_batch(&b, g);
    CHECK(flatmoe_logprobs(s, &b, mlp, NULL) == FLATMOE_OK);
    for (int64_t t = 0; t < MT; t++) { /* behaviour, rollout and reference log-probs near the current ones */
        double d;
        do d = unif(g, -0.6, 0.6);
        while (fabs(exp(d) - 0.8) < 0.02 || fabs(exp(d) - 1.28) < 0.02);
        mold[t] = (float)(mlp[t] - d);
        mroll[t] = (float)(mold[t] + unif(g, -0.3, 0.3));
        mref[t] = (float)(mlp[t] + unif(g, -0.3, 0.3));
    }
    b.old_logprobs = mold;
    b.rollout_logprobs = mroll;
    b.ref_logprobs = mref;
    flatmoe_loss_spec sp = flatmoe_loss_spec_default();
    sp.loss = FLATMOE_LOSS_PG;
    sp.agg = FLATMOE_AGG_SEQ_MEAN_TOKEN_MEAN;
    sp.clip_high = 0.28;
    sp.clip_dual = 3.0;
    sp.tis_cap = 2.0;
    sp.kl = FLATMOE_KL_K3;
    sp.kl_coef = 0.1;
    sp.entropy_coef = ent_coef;
    flatmoe_step_stats st;
    CHECK(fm_capi_grads(s, &b, &sp, &st) == FM_OK);
    if (ent_coef != 0) { /* the loss term: the spec's without the bonus, less c times the aggregated entropy */
        flatmoe_loss_spec s0 = sp;
        s0.entropy_coef = 0;
        const double l0 = loss_at(s, &b, &s0);
        double agg = 0, nseq = 0;
        for (int64_t t = 0, i = 0; i < MS; i++) { /* seq-mean-token-mean of the entropies over the mask */
            double sum = 0, cnt = 0;
            for (int64_t j = 0; j < mlens[i]; j++, t++)
                if (j > 0 && mmask[t]) sum += s->ent[t], cnt += 1;
            if (cnt > 0) agg += sum / cnt, nseq += 1;
        }
        CHECK_CLOSE(st.loss, l0 - ent_coef * agg / nseq, 1e-9);
    }
    fm_model *m = &s->r.m;
    const int64_t P = m->p.n_params;
    float *gr = malloc(sizeof(float) * (size_t)P);
    memcpy(gr, m->p.grads, sizeof(float) * (size_t)P);
    float *w = (float *)m->p.params;
    /* the 8 largest gradients and 8 drawn among those above 1% of the largest */
    int64_t *pick = g_pick; /* the same weights with and without the entropy bonus (the first call picks) */
    double gmax = 0;
    for (int64_t i = 0; i < P; i++) gmax = fmax(gmax, fabs(gr[i]));
    for (int k = 0; k < 8 && ent_coef == 0; k++) {
        int64_t best = 0;
        for (int64_t i = 0; i < P; i++) {
            bool taken = false;
            for (int q = 0; q < k; q++) taken |= pick[q] == i;
            if (!taken && fabs(gr[i]) > fabs(gr[best])) best = i;
        }
        pick[k] = best;
    }
    for (int k = 8; k < 16 && ent_coef == 0; k++) {
        int64_t i;
        do i = (int64_t)fm_rng_below(g, (uint64_t)P);
        while (fabs(gr[i]) < 0.01 * gmax);
        pick[k] = i;
    }
    int bad = 0;
    double worst = 0, moved = 0;
    for (int k = 0; k < 16; k++) {
        const int64_t i = pick[k];
        const float x = w[i];
        const float h = 1e-3f;
        w[i] = x + h;
        const double up = loss_at(s, &b, &sp);
        w[i] = x - h;
        const double dn = loss_at(s, &b, &sp);
        w[i] = x;
        const double fd = (up - dn) / (double)(2 * h);
        /* central differences in fp32 weights: truncation h^2 |L'''| and the forward's fp32 rounding
         * (~1e-6 of the loss) over 2h, measured at under 0.4% of the gradient here: 2% of the gradient
         * plus 1e-3 of the largest one (a wrong sign, branch or missing term fails it; a small scale
         * error is test_sft_equals_train's to catch, bit for bit) */
        const double tol = 0.02 * fabs(gr[i]) + 1e-3 * gmax, d = fabs(fd - gr[i]);
        if (ent_coef == 0) g_noent[k] = gr[i];
        else moved = fmax(moved, fabs(gr[i] - g_noent[k]) / tol);
        worst = d / tol > worst ? d / tol : worst;
        if (d > tol) {
            bad++;
            fprintf(stderr, "param %lld: gradient %.6g, finite difference %.6g\n", (long long)i, gr[i], fd);
        }
    }
    CHECK_MSG(bad == 0, "%d of 16 gradients off their finite differences (entropy_coef %g)", bad, ent_coef);
    if (ent_coef != 0)
        CHECK_MSG(moved > 10, "the entropy bonus moved the checked gradients by only %.3g of the tolerance", moved);
    printf("PG step gradient vs finite differences: 16 weights, worst %.3g of the tolerance (clip %.2f, dual %.2f, tis "
           "%.3f, kl %.4f, entropy_coef %g: the gradients moved by up to %.3g tolerances)\n", worst, st.clip_frac,
           st.dual_clip_frac, st.tis_mean, st.kl, ent_coef, moved);
    free(gr);
    flatmoe_close(s);
}

/* SFT (token-mean) through the library against fm_train_step on the same packed batch. */
static void test_sft_equals_train(fm_rng *g) {
    flatmoe_session *a = open_micro(), *t = open_micro();
    if (!a || !t) return;
    flatmoe_batch b;
    model_batch(&b, g);
    const flatmoe_loss_spec sp = flatmoe_loss_spec_default();
    for (int step = 1; step <= 2; step++) {
        flatmoe_step_stats st;
        CHECK(flatmoe_train_step(a, &b, &sp, &st) == FLATMOE_OK);
        CHECK(fm_capi_pack(t, &b, false) == FM_OK);
        fm_step_stats ts;
        CHECK(fm_train_step(&t->r.m, t->r.optim, t->r.opt_self, &t->r.world, &t->r.step, &t->fb, &t->o, step, &ts) ==
              FM_OK);
        fm_step_ws_flush(&a->r.step, &a->r.m);
        fm_step_ws_flush(&t->r.step, &t->r.m);
        CHECK(st.step == step && st.lr == ts.lr);
        CHECK_CLOSE(st.pg_loss, ts.ce, 1e-6); /* fp64 sum of fp32 log-probs vs the operator's sums */
        CHECK_MSG(st.grad_norm == ts.gnorm, "step %d: grad norm %.17g vs train's %.17g", step, st.grad_norm, ts.gnorm);
        const int same = memcmp(a->r.m.p.params, t->r.m.p.params, sizeof(fm_act) * (size_t)a->r.m.p.n_params) == 0;
        CHECK_MSG(same, "step %d: the weights after the library's SFT step differ from train's", step);
    }
    flatmoe_close(a);
    flatmoe_close(t);
}

/* The loss's validator (fm_pg_check, before any model work; found by fuzz/fuzz_rlbatch.c's
 * review, 2026-12-07): a non-finite value of an array the spec reads, at a loss token, is refused
 * naming the array and the token (before: accepted, and a NaN advantage cost a forward and a
 * backward before the step's loss came out NaN; an old log-prob of -inf, a clipped ratio of +inf,
 * went through as a finite loss); at a token outside the loss, or in an array the spec does not
 * read, it is not looked at. */
static void test_nonfinite_inputs(void) {
    int32_t toks[6] = {1, 2, 3, 4, 5, 6};
    int64_t lens[2] = {3, 3}, cnt[2];
    uint8_t mask[6] = {0, 1, 1, 0, 0, 1}, in_loss[6] = {0, 1, 1, 0, 0, 1};
    int32_t seq_of[6] = {0, 0, 0, 1, 1, 1};
    float lp[6] = {0, -1, -2, 0, -1, -0.5f}, adv[6] = {0, 1, -1, 0, 0, 2}, old[6] = {0, -1.1f, -2, 0, -1, -0.4f};
    float roll[6] = {0, -1, -2, 0, -1, -0.5f}, refl[6] = {0, -1, -2, 0, -1, -0.5f};
    double coef[6];
    flatmoe_step_stats st;
    flatmoe_batch b = {6, toks, 2, lens, mask, adv, old, roll, refl};
    flatmoe_loss_spec sp = flatmoe_loss_spec_default();
    sp.loss = FLATMOE_LOSS_PG;
    sp.tis_cap = 2;
    sp.kl = FLATMOE_KL_K3;
    sp.kl_coef = 0.1;
    CHECK(fm_pg_coefs(&sp, &b, 6, lp, NULL, in_loss, seq_of, cnt, coef, &st) == FM_OK);
    struct { float *a; int t; const char *name; } cases[] = {
        {adv, 2, "advantages[2]"}, {old, 5, "old_logprobs[5]"}, {roll, 1, "rollout_logprobs[1]"},
        {refl, 2, "ref_logprobs[2]"}};
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    for (int c = 0; c < 4; c++)
        for (int k = 0; k < 3; k++) {
            const float keep = cases[c].a[cases[c].t];
            cases[c].a[cases[c].t] = bad[k];
            const fm_status s = fm_pg_coefs(&sp, &b, 6, lp, NULL, in_loss, seq_of, cnt, coef, &st);
            CHECK_MSG(s == FM_ERR_ARG && strstr(fm_errmsg(), cases[c].name) != NULL, "%s = %g: status %d, %s",
                      cases[c].name, (double)bad[k], (int)s, fm_errmsg());
            CHECK(fm_pg_check(&sp, &b, 6, in_loss) == FM_ERR_ARG);
            cases[c].a[cases[c].t] = keep;
        }
    adv[0] = NAN, old[3] = -INFINITY, roll[4] = NAN, refl[0] = INFINITY; /* outside the loss: not read */
    CHECK_MSG(fm_pg_coefs(&sp, &b, 6, lp, NULL, in_loss, seq_of, cnt, coef, &st) == FM_OK, "%s", fm_errmsg());
    sp.tis_cap = 0, sp.kl = FLATMOE_KL_NONE;
    roll[1] = NAN, refl[1] = NAN; /* arrays this spec does not read */
    CHECK_MSG(fm_pg_coefs(&sp, &b, 6, lp, NULL, in_loss, seq_of, cnt, coef, &st) == FM_OK, "%s", fm_errmsg());
    sp.loss = FLATMOE_LOSS_SFT;
    adv[1] = NAN, old[1] = NAN; /* SFT reads none */
    CHECK_MSG(fm_pg_coefs(&sp, &b, 6, lp, NULL, in_loss, seq_of, cnt, coef, &st) == FM_OK, "%s", fm_errmsg());
}

int main(void) {
    const unsigned long long seed = fm_test_seed(2029);
    snprintf(threads_s, sizeof threads_s, "%d", fm_test_threads(2));
    snprintf(cfg_path, sizeof cfg_path, "/tmp/flatmoe-capi-pg-%d.json", (int)getpid());
    FILE *f = fopen(cfg_path, "w");
    if (!f || fputs(CFG, f) < 0 || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s\n", cfg_path);
        return 1;
    }
    fm_rng g;
    fm_rng_seed(&g, seed);
    test_coefs(&g);
    test_nonfinite_inputs();
    fm_rng g2 = g; /* the same batch for both */
    test_step_grad(&g, 0.0);
    test_step_grad(&g2, 0.5);
    test_sft_equals_train(&g);
    unlink(cfg_path);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed != 0;
}
