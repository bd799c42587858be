/* Aux-loss-free load balancing: the selection bias moved after each step (fm_router_bias.h). */
#include "fm_router_bias.h"

#include <math.h>

fm_status fm_router_bias_check(const fm_model *m, double rate, bool zero3, bool no_master) {
    if (!(rate >= 0) || !isfinite(rate))
        return fm_error(FM_ERR_ARG, "--moe-router-bias-update-rate %g: expected a finite rate >= 0 (DeepSeek-V3 and "
                        "Megatron-Core use 1e-3)", rate);
    if (rate == 0) return FM_OK;
    if (!m->cfg.router_sigmoid)
        return fm_error(FM_ERR_ARG, "--moe-router-bias-update-rate %g: the %s model has no selection bias (only the "
                        "sigmoid router of glm4_moe has e_score_correction_bias); drop the flag", rate,
                        m->cfg.model_type_name);
    if (zero3)
        return fm_error(FM_ERR_UNSUPPORTED, "--moe-router-bias-update-rate with --zero 3: the bias update does not "
                        "reach ZeRO-3's shards yet; use --zero 0 (or --ep) or drop the flag");
    if (m->p.master_host)
        return fm_error(FM_ERR_UNSUPPORTED, "--moe-router-bias-update-rate with the optimizer state in host memory "
                        "(--optimizer-offload-fraction, or chosen by the planner): not supported yet; give "
                        "--optimizer-offload-fraction 0 or drop the flag");
    if (no_master)
        return fm_error(FM_ERR_UNSUPPORTED, "--moe-router-bias-update-rate with a bf16 master recipe (--master-weights "
                        "bf16-kahan / bf16-sr): the bias needs fp32 master weights; use --master-weights fp32");
    return FM_OK;
}

void fm_router_bias_update(fm_model *m, const int64_t *counts, double rate, float *tmp) {
    if (rate == 0) return;
    const fm_config *c = &m->cfg;
    const int64_t E = c->num_experts;
    const fm_ops *ops = m->be.ops;
    /* sync point "router bias" (a GPU only): every stream, so the step's optimizer (on its update
     * stream, or overlapped with the backward) has written the master before it is read here */
    if (!ops->host_memory) ops->sync(m->be.ctx);
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        fm_act *b = m->p.w.layers[l].router_bias;
        if (!b || !fm_config_layer_is_moe(c, l)) continue;
        const int64_t *load = counts + l * E;
        int64_t sum = 0;
        for (int64_t e = 0; e < E; e++) sum += load[e];
        const double mean = (double)sum / (double)E;
        float *master = m->p.master + (b - m->p.params);
        float *h = ops->host_memory ? master : tmp;
        if (!ops->host_memory) ops->copy(m->be.ctx, h, master, sizeof(float) * (size_t)E, FM_COPY_D2H);
        for (int64_t e = 0; e < E; e++) {
            const double d = mean - (double)load[e];
            h[e] += (float)(rate * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0));
        }
        if (!ops->host_memory) ops->copy(m->be.ctx, master, h, sizeof(float) * (size_t)E, FM_COPY_H2D);
        if ((void *)master != (void *)b) ops->convert(m->be.ctx, b, FM_ACT_DTYPE, master, FM_DTYPE_F32, E);
    }
}
