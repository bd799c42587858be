/* RoPE tables per rope type (fm_rope.h): default, linear, YaRN. */
#include "fm_rope.h"

#include <math.h>

int64_t fm_config_rotary_dim(const fm_config *c) {
    if (c->mla) return c->qk_rope_head_dim; /* MLA: q_pe and k_pe only (model/fm_mla.h) */
    const double f = c->partial_rotary_factor;
    if (!(f > 0) || f >= 1) return c->head_dim;
    return (int64_t)((double)c->head_dim * f); /* Python's int(): truncation */
}

/* YaRN's m(s, k) (transformers' get_mscale). */
static double yarn_mscale(double s, double k) { return s <= 1 ? 1.0 : 0.1 * k * log(s) + 1.0; }

double fm_rope_attention_factor(const fm_config *c) {
    const fm_rope_scaling *r = &c->rope_scaling;
    if (r->type != FM_ROPE_YARN) return 1.0;
    if (r->attention_factor != 0) return r->attention_factor;
    if (r->mscale != 0 && r->mscale_all_dim != 0)
        return yarn_mscale(r->factor, r->mscale) / yarn_mscale(r->factor, r->mscale_all_dim);
    return yarn_mscale(r->factor, 1.0);
}

/* The YaRN correction dim of b rotations over the original context (transformers'
 * find_correction_dim). */
static double yarn_correction_dim(double b, double rd, double theta, double omax) {
    return rd * log(omax / (b * 2.0 * 3.14159265358979323846)) / (2.0 * log(theta));
}

/* YaRN's ramp bounds [low, high] over the rotated dims' pairs (transformers'
 * find_correction_range and linear_ramp_factor's guard). */
static void yarn_range(const fm_config *c, int64_t rd, double *low, double *high) {
    const fm_rope_scaling *r = &c->rope_scaling;
    const double omax = (double)r->original_max_position_embeddings;
    double lo = yarn_correction_dim(r->beta_fast, (double)rd, c->rope_theta, omax);
    double hi = yarn_correction_dim(r->beta_slow, (double)rd, c->rope_theta, omax);
    if (r->truncate) {
        lo = floor(lo);
        hi = ceil(hi);
    }
    lo = fmax(lo, 0.0);
    hi = fmin(hi, (double)(rd - 1));
    if (lo == hi) hi += 0.001; /* transformers: "prevent singularity" */
    *low = lo;
    *high = hi;
}

/* inv_freq[i] (fm_rope_inv_freq), low/high YaRN's range (unread for the other types). */
static double inv_freq_at(const fm_config *c, int64_t rd, int64_t i, double low, double high) {
    const fm_rope_scaling *r = &c->rope_scaling;
    const double extrap = pow(c->rope_theta, -2.0 * (double)i / (double)rd);
    if (r->type == FM_ROPE_LINEAR) return extrap / r->factor;
    if (r->type != FM_ROPE_YARN) return extrap;
    const double ramp = fmin(fmax(((double)i - low) / (high - low), 0.0), 1.0);
    return extrap / r->factor * ramp + extrap * (1.0 - ramp);
}

void fm_rope_inv_freq(const fm_config *c, double *inv) {
    const int64_t rd = fm_config_rotary_dim(c);
    double low = 0, high = 1;
    if (c->rope_scaling.type == FM_ROPE_YARN) yarn_range(c, rd, &low, &high);
    for (int64_t i = 0; i < rd / 2; i++) inv[i] = inv_freq_at(c, rd, i, low, high);
}

void fm_rope_tables_host(const fm_config *c, int64_t T, float *cos_tab, float *sin_tab) {
    const int64_t rd = fm_config_rotary_dim(c), half = rd / 2;
    double low = 0, high = 1;
    if (c->rope_scaling.type == FM_ROPE_YARN) yarn_range(c, rd, &low, &high);
    const bool scaled = c->rope_scaling.type == FM_ROPE_YARN;
    const double af = fm_rope_attention_factor(c);
    for (int64_t i = 0; i < half; i++) {
        const double inv = inv_freq_at(c, rd, i, low, high);
        for (int64_t t = 0; t < T; t++) {
            const double ang = (double)t * inv;
            cos_tab[t * half + i] = (float)(scaled ? cos(ang) * af : cos(ang));
            sin_tab[t * half + i] = (float)(scaled ? sin(ang) * af : sin(ang));
        }
    }
}
