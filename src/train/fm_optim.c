/* AdamW behind the optimizer interface, the gradients' sum of squares, the learning-rate
 * schedule (fm_optim.h). */
#include "fm_optim.h"
#include "fm_zero3.h"

#include <math.h>
#include <stdio.h>

size_t fm_adamw_state_bytes(int64_t n_params, bool bf16_moments) {
    return 2 * fm_arena_round((size_t)n_params * (bf16_moments ? 2 : sizeof(float)));
}

size_t fm_adamw_recipe_bytes(int64_t n_params, fm_master_recipe recipe) {
    return recipe == FM_MASTER_BF16_KAHAN ? fm_arena_round((size_t)n_params * 2) : 0;
}

void fm_adamw_round_weights(float *w, int64_t n) {
    for (int64_t i = 0; i < n; i++) w[i] = fm_bf16_to_f32(fm_f32_to_bf16(w[i]));
}

/* The bound of one rank or ZeRO-1/2 under a bf16 recipe: weights and grads (padded to W S when
 * sharded), the recipe's buffer and the moments of S parameters (S = n unsharded). */
static size_t bf16_recipe_bound(const fm_config *cfg, size_t a, int W, bool bf16_moments, fm_master_recipe rc,
                                char desc[200]) {
    const int64_t n = fm_config_num_params(cfg), S = fm_param_store_shard_len(n, W);
    const int per = 2 * (int)a + fm_master_extra_bytes(rc, (int)a) + (bf16_moments ? 4 : 8);
    if (desc) {
        if (W > 1)
            snprintf(desc, 200, "%d B/param (%s weight, grad) x %lld params + %s%s Adam m, v x %lld params (--master-"
                     "weights %s; ZeRO-1/2: 1/%d shard)", 2 * (int)a, a == 4 ? "fp32" : "bf16", (long long)n,
                     rc == FM_MASTER_BF16_KAHAN ? "bf16 Kahan buffer, " : "", bf16_moments ? "bf16" : "fp32",
                     (long long)S, fm_master_recipe_name(rc), W);
        else
            snprintf(desc, 200, "%d B/param (%s weight, grad%s; %s Adam m, v; --master-weights %s) x %lld params", per,
                     a == 4 ? "fp32 holding bf16" : "bf16", rc == FM_MASTER_BF16_KAHAN ? ", bf16 Kahan buffer" : "",
                     bf16_moments ? "bf16" : "fp32", fm_master_recipe_name(rc), (long long)n);
    }
    return fm_param_store_bytes_recipe(cfg, a, W, rc) + fm_adamw_state_bytes(S, bf16_moments) +
           fm_adamw_recipe_bytes(S, rc);
}

size_t fm_model_state_bound(const fm_config *cfg, const fm_state_layout *lay, size_t a, bool bf16_moments,
                            char desc[200]) {
    const int64_t n = fm_config_num_params(cfg);
    const fm_master_recipe rc = lay ? (fm_master_recipe)lay->master_recipe : FM_MASTER_FP32;
    /* one rank unless ZeRO-1/2 or ZeRO-3 over several */
    const int bound_world = lay && lay->zero && lay->ranks > 1 ? lay->ranks : 1;
    const int bound_zero = bound_world > 1 ? lay->zero : 0;
    if (bound_world > 1 && bound_zero == 3) return fm_zero3_state_bytes(cfg, a, bound_world, bf16_moments, desc);
    if (rc != FM_MASTER_FP32) return bf16_recipe_bound(cfg, a, bound_world, bf16_moments, rc, desc);
    if (bound_world > 1) { /* ZeRO-1/2: weights and grads whole (padded), master whole on bf16 builds, m, v / W */
        const int W = bound_world;
        const int64_t S = fm_param_store_shard_len(n, W);
        if (desc)
            snprintf(desc, 200, "%s x %lld params + Adam m, v (%s) x %lld params (ZeRO-1/2: 1/%d shard)",
                     a == 4 ? "8 B/param (fp32 weight, grad)" : "8 B/param (bf16 weight, grad; fp32 master)",
                     (long long)n, bf16_moments ? "bf16" : "fp32", (long long)S, W);
        return fm_param_store_bytes_sharded(cfg, a, W) + fm_adamw_state_bytes(S, bf16_moments);
    }
    if (desc)
        snprintf(desc, 200, "%s x %lld params",
                 a == 4 ? (bf16_moments ? "12 B/param (fp32 weight, grad; bf16 Adam m, v)"
                                        : "16 B/param (fp32 weight, grad, Adam m, v)")
                        : (bf16_moments ? "12 B/param (bf16 weight, grad, Adam m, v; fp32 master)"
                                        : "16 B/param (bf16 weight, grad; fp32 master, Adam m, v)"),
                 (long long)n);
    return fm_param_store_bytes(cfg, a) + fm_adamw_state_bytes(n, bf16_moments);
}

void fm_adamw_config(fm_adamw *opt, double beta1, double beta2, double eps, double weight_decay, bool bf16_moments) {
    memset(opt, 0, sizeof *opt);
    opt->moments_dtype = bf16_moments ? FM_DTYPE_BF16 : FM_DTYPE_F32;
    opt->beta1 = beta1;
    opt->beta2 = beta2;
    opt->eps = eps;
    opt->weight_decay = weight_decay;
}

void fm_adamw_set_recipe(fm_adamw *opt, fm_master_recipe recipe, uint64_t seed) {
    opt->recipe = recipe;
    opt->seed = seed;
}

static size_t adamw_state_bytes(const void *self, int64_t n_params) {
    const fm_adamw *opt = self;
    return fm_adamw_state_bytes(n_params, opt->moments_dtype == FM_DTYPE_BF16) +
           fm_adamw_recipe_bytes(n_params, opt->recipe);
}

static void adamw_init(void *self, fm_param_store *ps, const fm_backend *be) {
    fm_adamw *opt = self;
    opt->state_begin = ps->sharded ? ps->shard_begin : 0;
    opt->state_len = ps->sharded ? ps->shard_len : ps->n_params;
    const size_t bytes = (size_t)opt->state_len * fm_dtype_size(opt->moments_dtype);
    opt->m = fm_param_store_take(ps, bytes);
    opt->v = fm_param_store_take(ps, bytes);
    be->ops->mem_set(be->ctx, opt->m, 0, bytes);
    be->ops->mem_set(be->ctx, opt->v, 0, bytes);
    opt->comp = NULL;
    if (opt->recipe == FM_MASTER_BF16_KAHAN) { /* the compensation starts at zero (and stays so on a
                                                   resume from a checkpoint without one) */
        opt->comp = fm_param_store_take(ps, (size_t)opt->state_len * 2);
        be->ops->mem_set(be->ctx, opt->comp, 0, (size_t)opt->state_len * 2);
    }
    opt->step = 0;
}

static void adamw_step_begin(void *self) { ((fm_adamw *)self)->step++; }

/* One launch over n parameters from flat index idx (the state element s): the fp32-master adamw op,
 * or adamw_bf16w under a bf16 recipe (master ignored: there is none). */
static void adamw_launch(const fm_adamw *opt, fm_model *m, fm_act *w, const fm_act *g, float *master, int64_t s,
                         int64_t idx, int64_t n, double lr, float wd, float bc1, float bc2, float grad_scale) {
    const size_t mo = (size_t)s * fm_dtype_size(opt->moments_dtype);
    if (opt->recipe == FM_MASTER_FP32)
        m->be.ops->adamw(m->be.ctx, w, g, master, (char *)opt->m + mo, (char *)opt->v + mo, opt->moments_dtype, n,
                         (float)lr, (float)opt->beta1, (float)opt->beta2, (float)opt->eps, wd, bc1, bc2, grad_scale);
    else
        m->be.ops->adamw_bf16w(m->be.ctx, w, g, opt->comp ? opt->comp + s : NULL, (char *)opt->m + mo,
                               (char *)opt->v + mo, opt->moments_dtype, n, (float)lr, (float)opt->beta1,
                               (float)opt->beta2, (float)opt->eps, wd, bc1, bc2, grad_scale,
                               fm_sr_key(opt->seed, opt->step), idx);
}

static void adamw_step_range(void *self, fm_model *m, int t0, int t1, double lr, float grad_scale) {
    fm_adamw *opt = self;
    FM_ASSERT(opt->step > 0 && t0 >= 0 && t1 <= m->p.n_tensors);
    const float bc1 = (float)(1.0 - pow(opt->beta1, (double)opt->step));
    const float bc2 = (float)(1.0 - pow(opt->beta2, (double)opt->step));
    /* Consecutive tensors with the same decay flag form one launch. */
    int i = t0;
    while (i < t1) {
        const bool decay = m->p.table[i].decay;
        const int64_t off = m->p.table[i].offset;
        int64_t n = 0;
        int j = i;
        while (j < t1 && m->p.table[j].decay == decay && m->p.table[j].offset == off + n) {
            n += m->p.table[j].numel;
            j++;
        }
        float *master = (void *)m->p.master == (void *)m->p.params ? NULL : m->p.master + off;
        adamw_launch(opt, m, m->p.params + off, m->p.grads + off, master, off, off, n, lr,
                     decay ? (float)opt->weight_decay : 0.0f, bc1, bc2, grad_scale);
        i = j;
    }
}

/* The update of flat parameters [p0, p1) whose weights, grads and master start at w, g, ms
 * (element p0; ms NULL: the weights are the master), moments at state element s0: runs of
 * consecutive tensors with one decay flag, clipped to the range, one launch each. */
static void adamw_flat(fm_adamw *opt, fm_model *m, int64_t p0, int64_t p1, fm_act *w, const fm_act *g, float *ms,
                       int64_t s0, double lr, float grad_scale) {
    FM_ASSERT(opt->step > 0 && s0 >= 0 && s0 + (p1 - p0) <= opt->state_len && p0 <= p1);
    const float bc1 = (float)(1.0 - pow(opt->beta1, (double)opt->step));
    const float bc2 = (float)(1.0 - pow(opt->beta2, (double)opt->step));
    int i = 0;
    while (i < m->p.n_tensors && m->p.table[i].offset + m->p.table[i].numel <= p0) i++;
    while (i < m->p.n_tensors && m->p.table[i].offset < p1) {
        const bool decay = m->p.table[i].decay;
        int64_t a = m->p.table[i].offset < p0 ? p0 : m->p.table[i].offset, b = m->p.table[i].offset + m->p.table[i].numel;
        int j = i + 1;
        while (j < m->p.n_tensors && m->p.table[j].decay == decay && m->p.table[j].offset == b && b < p1)
            b += m->p.table[j++].numel;
        if (b > p1) b = p1;
        adamw_launch(opt, m, w + (a - p0), g + (a - p0), ms ? ms + (a - p0) : NULL, s0 + (a - p0), a, b - a, lr,
                     decay ? (float)opt->weight_decay : 0.0f, bc1, bc2, grad_scale);
        i = j;
    }
}

/* ZeRO-1/2: [p0, p1) of m's buffers, the moments at (parameter - state_begin). */
static void adamw_step_shard(void *self, fm_model *m, int64_t p0, int64_t p1, double lr, float grad_scale) {
    fm_adamw *opt = self;
    FM_ASSERT(p0 >= opt->state_begin && p1 <= opt->state_begin + opt->state_len);
    float *master = (void *)m->p.master == (void *)m->p.params ? NULL : m->p.master + p0;
    adamw_flat(opt, m, p0, p1, m->p.params + p0, m->p.grads + p0, master, p0 - opt->state_begin, lr, grad_scale);
}

static void adamw_step_at(void *self, fm_model *m, int64_t p0, int64_t p1, fm_act *w, const fm_act *g, float *master,
                          int64_t s0, double lr, float grad_scale) {
    adamw_flat(self, m, p0, p1, w, g, master, s0, lr, grad_scale);
}

static int adamw_state_tensors(void *self, fm_optim_state *out, int cap) {
    fm_adamw *opt = self;
    FM_ASSERT(cap >= 3);
    out[0] = (fm_optim_state){"exp_avg.", opt->m, opt->moments_dtype, false};
    out[1] = (fm_optim_state){"exp_avg_sq.", opt->v, opt->moments_dtype, false};
    if (!opt->comp) return 2;
    out[2] = (fm_optim_state){FM_KAHAN_PREFIX, opt->comp, FM_DTYPE_BF16, false};
    return 3;
}

const fm_optimizer_ops fm_adamw_ops = {"adamw", adamw_state_bytes, adamw_init, adamw_step_begin, adamw_step_range,
                                       adamw_state_tensors, adamw_step_shard, adamw_step_at};

void fm_grad_sumsq(fm_model *m, double *out) { m->be.ops->sumsq(m->be.ctx, out, m->p.grads, m->p.n_params, false); }

double fm_lr_at(int64_t s, int64_t total, int64_t warmup, double lr, double min_lr) {
    if (warmup > 0 && s <= warmup) return lr * (double)s / (double)warmup;
    if (total <= warmup) return lr;
    double p = (double)(s - warmup) / (double)(total - warmup);
    if (p > 1) p = 1;
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + cos(3.14159265358979323846 * p));
}
