/* Aux-loss-free balancing: the selection bias moved after each step (fm_router_bias.h). */
#include "fm_router_bias.h"

#include <math.h>
#include <stdio.h>

fm_status fm_router_bias_check(const fm_model *m, double rate, bool no_master) {
    if (!(rate >= 0) || !isfinite(rate))
        return fm_error(FM_ERR_ARG, "--moe-router-bias-update-rate %g: expected a finite rate >= 0 (DeepSeek-V3 and "
                        "Megatron-Core use 1e-3)", rate);
    if (rate == 0) return FM_OK;
    if (!m->cfg.router_sigmoid)
        return fm_error(FM_ERR_ARG, "--moe-router-bias-update-rate %g: the %s model has no selection bias (only the "
                        "sigmoid router of glm4_moe has e_score_correction_bias); drop the flag", rate,
                        m->cfg.model_type_name);
    if (m->p.master_host)
        return fm_error(FM_ERR_UNSUPPORTED, "--moe-router-bias-update-rate with the optimizer state streamed "
                        "(--offload-optimizer / --optimizer-offload-fraction, or chosen by the planner): the bias's "
                        "fp32 master is held by the streamed optimizer's buckets, which the update does not reach; "
                        "give --optimizer-offload-fraction 0 or drop the flag");
    if (no_master)
        return fm_error(FM_ERR_UNSUPPORTED, "--moe-router-bias-update-rate with a bf16 master recipe (--master-weights "
                        "bf16-kahan / bf16-sr): the bias would be moved in bf16, where a step of %g is lost by "
                        "rounding once |bias| >= 0.5; use --master-weights fp32", rate);
    return FM_OK;
}

/* Where flat parameter p lives in this rank's arrays: *local, and whether this rank holds it
 * (replicated: every rank, at p; ZeRO-3: the owner of p's piece, fm_zero3.h's layout). */
static bool held(const fm_zero3 *z, int64_t p, int64_t *local) {
    if (!z) {
        *local = p;
        return true;
    }
    int g = 0;
    while (g + 1 < z->n_groups && z->begin[g + 1] <= p) g++;
    const int64_t i = p - z->begin[g];
    FM_ASSERT(i < z->begin[g + 1] - z->begin[g] - z->keep[g]); /* the bias is sharded, never a whole part */
    *local = z->local[g] + i % z->piece[g];
    return (int)(i / z->piece[g]) == z->rank;
}

/* Elements [0, n) of this rank's master at local offset loc moved by d[0..n) (fp32), and the
 * weights converted from them. tmp [n] floats of host scratch. */
static void move_run(fm_model *m, int64_t loc, const float *d, int64_t n, float *tmp) {
    const fm_ops *ops = m->be.ops;
    float *master = m->p.master + loc;
    fm_act *w = m->p.params + loc;
    float *h = ops->host_memory ? master : tmp;
    if (!ops->host_memory) ops->copy(m->be.ctx, h, master, sizeof(float) * (size_t)n, FM_COPY_D2H);
    for (int64_t e = 0; e < n; e++) h[e] += d[e];
    if (!ops->host_memory) ops->copy(m->be.ctx, master, h, sizeof(float) * (size_t)n, FM_COPY_H2D);
    if ((void *)master != (void *)w) ops->convert(m->be.ctx, w, FM_ACT_DTYPE, master, FM_DTYPE_F32, n);
}

void fm_router_bias_update(fm_model *m, const fm_zero3 *z3, const int64_t *counts, double rate, float *tmp) {
    if (rate == 0) return;
    const fm_config *c = &m->cfg;
    const int64_t E = c->num_experts;
    const fm_ops *ops = m->be.ops;
    FM_ASSERT(E <= 4096);
    float d[E];
    /* sync point "router bias" (a GPU only): every stream, so the step's optimizer (on its update
     * stream, or overlapped with the backward) has written the master before it is read here */
    if (!ops->host_memory) ops->sync(m->be.ctx);
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        if (!m->p.w.layers[l].router_bias || !fm_config_layer_is_moe(c, l)) continue;
        char name[96];
        snprintf(name, sizeof name, "model.layers.%lld.mlp.gate.e_score_correction_bias", (long long)l);
        const fm_param *bp = fm_params_find(&m->p, name);
        FM_ASSERT(bp && bp->numel == E);
        const int64_t *load = counts + l * E;
        int64_t sum = 0;
        for (int64_t e = 0; e < E; e++) sum += load[e];
        const double mean = (double)sum / (double)E;
        for (int64_t e = 0; e < E; e++) {
            const double dl = mean - (double)load[e];
            d[e] = (float)(rate * (dl > 0 ? 1.0 : dl < 0 ? -1.0 : 0.0));
        }
        /* the runs of the bias this rank holds, contiguous in its arrays */
        for (int64_t e = 0; e < E;) {
            int64_t loc, next;
            if (!held(z3, bp->offset + e, &loc)) {
                e++;
                continue;
            }
            int64_t n = 1;
            while (e + n < E && held(z3, bp->offset + e + n, &next) && next == loc + n) n++;
            move_run(m, loc, d + e, n, tmp);
            e += n;
        }
    }
}
