/* The per-token coefficients of the train step's losses (include/flatmoe.h flatmoe_loss_spec;
 * docs/rl.md): after the forward, log p_t of every loss token is known, and each loss below is a
 * sum of per-token terms l_t(log p_t) times an aggregation weight a_t, so dL/dlog p_t = a_t
 * dl_t/dlog p_t = c_t. The linear CE's backward then takes w_t = -c_t as its token weights (its
 * loss_t is -log p_t; the gradient wrt token t's logits is c_t (onehot - softmax)).
 *
 * Sources of the formulas:
 *  - SFT: l_t = -log p_t, the cross-entropy of next-token prediction.
 *  - PPO's clipped surrogate: Schulman et al. 2017, "Proximal Policy Optimization Algorithms"
 *    (arXiv 1707.06347), eq. 7: L^CLIP = E[min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)], r_t =
 *    exp(log p_t - log p_old_t); minimized here as l_t = max(-r_t A_t, -clip(r_t) A_t).
 *  - Clip-higher (separate eps_low, eps_high): DAPO, Yu et al. 2025 (arXiv 2503.14476) §3.1.
 *  - GRPO's per-token surrogate and its seq-mean-token-mean aggregation: Shao et al. 2024,
 *    DeepSeekMath (arXiv 2402.03300) eq. 3; seq-mean-token-sum: Liu et al. 2025, Dr. GRPO (arXiv
 *    2503.20783); token-mean: DAPO §3.3 (token-level policy-gradient loss).
 *  - Dual clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL" (arXiv
 *    1912.09729) eq. 5: for A_t < 0, l_t = min(l_t, -c A_t) (verl's clip_ratio_c).
 *  - Truncated importance sampling against the rollout engine's log-probs: Yao et al. 2025, "Your
 *    Efficient RL Framework Secretly Brings You Off-Policy RL Training" (fengyao.notion.site), and
 *    Espeholt et al. 2018 (IMPALA, arXiv 1802.01561) for the truncation: the detached weight
 *    min(exp(log p_old_t - log p_rollout_t), C) multiplies l_t.
 *  - KL to a reference: Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx):
 *    k1 = log p - log p_ref (gradient 1), k3 = exp(log p_ref - log p) - (log p_ref - log p) - 1
 *    (gradient 1 - exp(log p_ref - log p)); added as kl_coef k_t to l_t (GRPO's form, eq. 4).
 * Everything here is fp64 on the host; c_t is rounded to fp32 once, as the token weight. */
#include <math.h>
#include <string.h>

#include "fm_capi.h"

flatmoe_loss_spec flatmoe_loss_spec_default(void) {
    flatmoe_loss_spec s;
    memset(&s, 0, sizeof s);
    s.loss = FLATMOE_LOSS_SFT;
    s.agg = FLATMOE_AGG_TOKEN_MEAN;
    s.clip_low = 0.2;
    s.clip_high = 0.2;
    return s;
}

static fm_status check_spec(const flatmoe_loss_spec *sp, const flatmoe_batch *b) {
    if (sp->loss != FLATMOE_LOSS_SFT && sp->loss != FLATMOE_LOSS_PG)
        return fm_error(FM_ERR_ARG, "loss spec: loss %d; expected FLATMOE_LOSS_SFT (0) or FLATMOE_LOSS_PG (1)", sp->loss);
    if (sp->agg < FLATMOE_AGG_TOKEN_MEAN || sp->agg > FLATMOE_AGG_SEQ_MEAN_TOKEN_MEAN)
        return fm_error(FM_ERR_ARG, "loss spec: agg %d; expected token-mean (0), seq-mean-token-sum (1) or "
                        "seq-mean-token-mean (2)", sp->agg);
    if (sp->kl < FLATMOE_KL_NONE || sp->kl > FLATMOE_KL_K3)
        return fm_error(FM_ERR_ARG, "loss spec: kl %d; expected none (0), k1 (1) or k3 (2)", sp->kl);
    if (!(sp->clip_low >= 0 && sp->clip_low < 1) || !(sp->clip_high >= 0) || !isfinite(sp->clip_high))
        return fm_error(FM_ERR_ARG, "loss spec: clip_low %g, clip_high %g; expected clip_low in [0, 1) and clip_high "
                        ">= 0 (PPO 0.2 / 0.2, DAPO 0.2 / 0.28)", sp->clip_low, sp->clip_high);
    if (!(sp->clip_dual == 0 || (sp->clip_dual > 1 && isfinite(sp->clip_dual))))
        return fm_error(FM_ERR_ARG, "loss spec: clip_dual %g; expected 0 (off) or a finite c > 1 (e.g. 3)", sp->clip_dual);
    if (!(sp->tis_cap >= 0) || !isfinite(sp->tis_cap))
        return fm_error(FM_ERR_ARG, "loss spec: tis_cap %g; expected 0 (off) or a finite cap > 0 (e.g. 2)", sp->tis_cap);
    if (!(sp->kl_coef >= 0) || !isfinite(sp->kl_coef))
        return fm_error(FM_ERR_ARG, "loss spec: kl_coef %g; expected a finite value >= 0", sp->kl_coef);
    if (!isfinite(sp->entropy_coef))
        return fm_error(FM_ERR_ARG, "loss spec: entropy_coef %g; expected a finite value (0: off; verl's "
                        "entropy_coeff, e.g. 0.001)", sp->entropy_coef);
    const bool pg = sp->loss == FLATMOE_LOSS_PG;
    if (pg && !b->advantages)
        return fm_error(FM_ERR_ARG, "batch: advantages is NULL, but the loss is the policy gradient; give A_t per token");
    if (pg && sp->tis_cap > 0 && !b->rollout_logprobs)
        return fm_error(FM_ERR_ARG, "batch: rollout_logprobs is NULL, but tis_cap is %g (truncated importance "
                        "sampling); give the rollout engine's log-probs, or set tis_cap 0", sp->tis_cap);
    if (sp->kl != FLATMOE_KL_NONE && !b->ref_logprobs)
        return fm_error(FM_ERR_ARG, "batch: ref_logprobs is NULL, but the spec asks for a KL term; give the reference "
                        "model's log-probs, or set kl FLATMOE_KL_NONE");
    return FM_OK;
}

fm_status fm_pg_check(const flatmoe_loss_spec *spec, const flatmoe_batch *b, int64_t n, const uint8_t *in_loss) {
    FM_TRY(check_spec(spec, b));
    const bool pg = spec->loss == FLATMOE_LOSS_PG;
    const struct {
        const char *name, *fix;
        const float *a;
        bool used;
    } arr[4] = {
        {"advantages", "recompute them (a group whose rewards are all equal has a reward std of 0: add an epsilon to "
         "the std, or give those tokens A = 0)", b->advantages, pg},
        {"old_logprobs", "give the behaviour policy's log-probs of the tokens it sampled", b->old_logprobs, pg},
        {"rollout_logprobs", "give the rollout engine's log-probs of the tokens it sampled", b->rollout_logprobs,
         pg && spec->tis_cap > 0},
        {"ref_logprobs", "give the reference model's log-probs (a token it gives probability 0 has no finite KL)",
         b->ref_logprobs, spec->kl != FLATMOE_KL_NONE},
    };
    for (int k = 0; k < 4; k++) {
        if (!arr[k].used || !arr[k].a) continue;
        for (int64_t t = 0; t < n; t++)
            if (in_loss[t] && !isfinite(arr[k].a[t]))
                return fm_error(FM_ERR_ARG, "batch: %s[%lld] is %g, at a token in the loss; expected a finite value "
                                "there: %s", arr[k].name, (long long)t, (double)arr[k].a[t], arr[k].fix);
    }
    return FM_OK;
}

/* l_t and dl_t/dlog p_t of the policy term of one token (PG: clip, dual clip, TIS), and the
 * token's clip counts. */
typedef struct pg_tok {
    double l, g, ratio, tis;
    int clip_low, clip_high, dual;
} pg_tok;

static pg_tok pg_token(const flatmoe_loss_spec *sp, const flatmoe_batch *b, int64_t t, double lp) {
    pg_tok r = {0};
    if (sp->loss == FLATMOE_LOSS_SFT) {
        r.l = -lp;
        r.g = -1.0;
        r.ratio = r.tis = 1.0;
        return r;
    }
    const double A = b->advantages[t];
    const double old = b->old_logprobs ? (double)b->old_logprobs[t] : lp; /* NULL: on-policy, detached */
    const double ratio = exp(lp - old);
    r.ratio = ratio;
    r.clip_high = A > 0 && ratio > 1.0 + sp->clip_high; /* -clip(r) A is the larger term: constant */
    r.clip_low = A < 0 && ratio < 1.0 - sp->clip_low;
    if (r.clip_high) r.l = -(1.0 + sp->clip_high) * A;
    else if (r.clip_low) r.l = -(1.0 - sp->clip_low) * A;
    else {
        r.l = -ratio * A;
        r.g = -ratio * A; /* d(-r A)/dlog p = -r A */
    }
    if (sp->clip_dual > 0 && A < 0 && r.l > -sp->clip_dual * A) { /* dual clip: held at -c A */
        r.l = -sp->clip_dual * A;
        r.g = 0;
        r.dual = 1;
    }
    r.tis = 1.0;
    if (sp->tis_cap > 0) {
        const double w = exp(old - (double)b->rollout_logprobs[t]);
        r.tis = w < sp->tis_cap ? w : sp->tis_cap;
        r.l *= r.tis;
        r.g *= r.tis;
    }
    return r;
}

/* k(log p, ref) and its derivative (Schulman 2020's k1, k3). */
static void kl_token(int kind, double lp, double ref, double *k, double *dk) {
    if (kind == FLATMOE_KL_K1) {
        *k = lp - ref;
        *dk = 1.0;
    } else {
        const double d = ref - lp, e = exp(d);
        *k = e - d - 1.0;
        *dk = 1.0 - e;
    }
}

/* Token t's aggregation weight a_t (docs/rl.md): 1/|M| (fp32-rounded, as train's), 1/|S|, or
 * 1/(|S| |M_s|); inv_m the first, S the sequences with a loss token, cnt its sequence's. */
static double agg_weight(int agg, double inv_m, int64_t S, int64_t cnt) {
    return agg == FLATMOE_AGG_TOKEN_MEAN ? inv_m
         : agg == FLATMOE_AGG_SEQ_MEAN_TOKEN_SUM ? 1.0 / (double)S
                                                 : 1.0 / ((double)S * (double)cnt);
}

void fm_pg_entropy_coefs(const flatmoe_loss_spec *spec, int64_t n, const uint8_t *in_loss, const int32_t *seq_of,
                         const int64_t *seq_count, const flatmoe_step_stats *st, double *ent_coef) {
    const double inv_m = (double)(1.0f / (float)st->n_loss_tokens);
    for (int64_t t = 0; t < n; t++)
        ent_coef[t] = in_loss[t] ? -spec->entropy_coef * agg_weight(spec->agg, inv_m, st->n_loss_seqs,
                                                                    seq_count[seq_of[t]])
                                 : 0.0;
}

fm_status fm_pg_coefs(const flatmoe_loss_spec *spec, const flatmoe_batch *b, int64_t n, const float *logp,
                      const float *ent, const uint8_t *in_loss, const int32_t *seq_of, int64_t *seq_count,
                      double *coef, flatmoe_step_stats *st) {
    return fm_pg_coefs_ranks(spec, b, n, logp, ent, in_loss, seq_of, seq_count, NULL, coef, st);
}

fm_status fm_pg_coefs_ranks(const flatmoe_loss_spec *spec, const flatmoe_batch *b, int64_t n, const float *logp,
                            const float *ent, const uint8_t *in_loss, const int32_t *seq_of, int64_t *seq_count,
                            const fm_comm *comm, double *coef, flatmoe_step_stats *st) {
    FM_TRY(fm_pg_check(spec, b, n, in_loss));
    if (spec->entropy_coef != 0 && !ent)
        return fm_error(FM_ERR_ARG, "fm_pg_coefs: entropy_coef %g without the entropies; pass ent", spec->entropy_coef);
    int64_t M = 0, S = 0;
    memset(seq_count, 0, sizeof(int64_t) * (size_t)b->n_seqs);
    for (int64_t t = 0; t < n; t++)
        if (in_loss[t]) {
            M++;
            S += seq_count[seq_of[t]]++ == 0;
        }
    const bool many = comm && fm_comm_size(comm) > 1;
    if (many) { /* every rank's loss tokens and sequences: the aggregation's denominators (verl's global batch) */
        int64_t cnt[2] = {M, S};
        FM_TRY(fm_comm_allreduce_sum_i64(comm, cnt, 2, 0));
        M = cnt[0], S = cnt[1];
    }
    if (M == 0)
        return fm_error(FM_ERR_ARG, "batch: no token is in the loss%s (loss_mask is 0 everywhere but at sequences' "
                        "first tokens, which have no log-prob); give a mask with response tokens",
                        many ? " on any rank" : "");
    /* token-mean's 1/|M| rounded to fp32 as `train`'s 1/valid is, so SFT's step equals train's bit for bit */
    const double inv_m = (double)(1.0f / (float)M);
    double pg = 0, kl = 0, kl_mean = 0, ent_sum = 0, ent_agg = 0, ratio_sum = 0, tis_sum = 0;
    int64_t n_lo = 0, n_hi = 0, n_dual = 0;
    for (int64_t t = 0; t < n; t++) {
        coef[t] = 0;
        if (!in_loss[t]) continue;
        const double lp = logp[t];
        const int64_t cnt = seq_count[seq_of[t]];
        const double a = agg_weight(spec->agg, inv_m, S, cnt);
        const pg_tok p = pg_token(spec, b, t, lp);
        double g = p.g;
        pg += a * p.l;
        if (spec->kl != FLATMOE_KL_NONE) {
            double k, dk;
            kl_token(spec->kl, lp, (double)b->ref_logprobs[t], &k, &dk);
            kl += a * spec->kl_coef * k;
            kl_mean += k;
            g += spec->kl_coef * dk;
        }
        coef[t] = a * g;
        ent_sum += ent ? (double)ent[t] : 0.0;
        ent_agg += ent ? a * (double)ent[t] : 0.0;
        ratio_sum += p.ratio;
        tis_sum += p.tis;
        n_lo += p.clip_low;
        n_hi += p.clip_high;
        n_dual += p.dual;
    }
    if (many) { /* the sums over every rank's tokens (the aggregated terms are already global-weighted) */
        double v[10] = {pg, kl, ent_agg, kl_mean, ent_sum, ratio_sum, tis_sum, (double)n_lo, (double)n_hi,
                        (double)n_dual};
        FM_TRY(fm_comm_allreduce_sum_f64(comm, v, 10, 0));
        pg = v[0], kl = v[1], ent_agg = v[2], kl_mean = v[3], ent_sum = v[4], ratio_sum = v[5], tis_sum = v[6];
        n_lo = (int64_t)v[7], n_hi = (int64_t)v[8], n_dual = (int64_t)v[9];
    }
    st->pg_loss = pg;
    st->loss = pg + kl - spec->entropy_coef * ent_agg; /* the entropy bonus: l_t -= c H_t */
    st->kl = kl_mean / (double)M;
    st->entropy = ent_sum / (double)M;
    st->ratio_mean = ratio_sum / (double)M;
    st->tis_mean = tis_sum / (double)M;
    st->clip_frac_low = (double)n_lo / (double)M;
    st->clip_frac_high = (double)n_hi / (double)M;
    st->clip_frac = (double)(n_lo + n_hi) / (double)M;
    st->dual_clip_frac = (double)n_dual / (double)M;
    st->n_loss_tokens = M;
    st->n_loss_seqs = S;
    return FM_OK;
}
