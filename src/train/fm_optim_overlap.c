/* The optimizer overlap: per-group updates on the update stream (fm_optim_overlap.h). */
#include "fm_optim_overlap.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The layer a tensor name belongs to ("model.layers.<l>."), or -1. */
static int64_t layer_of(const char *name) {
    const char *p = "model.layers.";
    if (strncmp(name, p, strlen(p))) return -1;
    return strtoll(name + strlen(p), NULL, 10);
}

fm_status fm_optim_overlap_init(fm_optim_overlap *o, const fm_model *m) {
    memset(o, 0, sizeof *o);
    const int64_t L = m->cfg.num_hidden_layers;
    if (FM_EVENT_OVERLAP0 + L + 2 > FM_EVENT_POOL)
        return fm_error(FM_ERR_ARG, "optimizer overlap: %lld layers need %lld update events, the event pool has %d "
                        "past FM_EVENT_OVERLAP0; run with --no-optimizer-overlap", (long long)L, (long long)(L + 2),
                        FM_EVENT_POOL - FM_EVENT_OVERLAP0);
    o->n_groups = (int)L + 2;
    o->t0 = fm_malloc(sizeof(int) * (size_t)(o->n_groups + 1));
    if (!o->t0) return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the optimizer overlap's %d groups", o->n_groups);
    /* group of each tensor: 0 before the layers, 1 + l in layer l, L + 1 after them; the table
     * must visit them in that order (it is the forward order) */
    int g = 0;
    o->t0[0] = 0;
    for (int i = 0; i < m->p.n_tensors; i++) {
        const int64_t l = layer_of(m->p.table[i].name);
        const int gi = l >= 0 ? (int)(1 + l) : (g == 0 ? 0 : (int)L + 1);
        if (gi < g || gi > (int)L + 1 || (i > 0 && m->p.table[i].offset < m->p.table[i - 1].offset)) {
            fm_optim_overlap_free(o);
            return fm_error(FM_ERR_ARG, "optimizer overlap: tensor %d (%s) is out of forward order in the parameter "
                            "table; run with --no-optimizer-overlap", i, m->p.table[i].name);
        }
        while (g < gi) o->t0[++g] = i;
    }
    while (g < (int)L + 1) o->t0[++g] = m->p.n_tensors;
    o->t0[L + 2] = m->p.n_tensors;
    return FM_OK;
}

void fm_optim_overlap_free(fm_optim_overlap *o) {
    fm_free(o->t0);
    memset(o, 0, sizeof *o);
}

void fm_optim_overlap_attach(const fm_optim_overlap *o, fm_schedule *s) {
    (void)o;
    s->param_ready = true;
    s->param_event0 = FM_EVENT_OVERLAP0;
}

void fm_optim_overlap_issue(fm_optim_overlap *o, fm_model *m, const fm_optimizer_ops *optim, void *opt, double lr,
                            float clip) {
    const fm_ops *ops = m->be.ops;
    void *ctx = m->be.ctx;
    /* the update stream starts after everything issued on compute so far (the backward, the
     * gradient norm); the host has already waited for it at the step-end sync point, so this
     * orders nothing new, but it keeps the pipeline right without that sync */
    ops->event_record(ctx, FM_EVENT_OVERLAP0 + o->n_groups - 1, FM_STREAM_COMPUTE);
    ops->event_wait(ctx, FM_STREAM_UPDATE, FM_EVENT_OVERLAP0 + o->n_groups - 1);
    ops->set_op_stream(ctx, FM_STREAM_UPDATE);
    for (int g = 0; g < o->n_groups; g++) {
        const int a = o->t0[g], b = o->t0[g + 1];
        if (b > a) {
            optim->step_range(opt, m, a, b, lr, clip);
            const int64_t e0 = m->p.table[a].offset, e1 = m->p.table[b - 1].offset + m->p.table[b - 1].numel;
            ops->mem_set(ctx, m->p.grads + e0, 0, sizeof(fm_act) * (size_t)(e1 - e0));
        }
        ops->event_record(ctx, FM_EVENT_OVERLAP0 + g, FM_STREAM_UPDATE);
    }
    ops->set_op_stream(ctx, FM_STREAM_COMPUTE);
    o->grads_zeroed = true; /* every group's, the whole flat buffer */
    o->in_flight = true;
}

void fm_optim_overlap_flush(fm_optim_overlap *o, fm_model *m) {
    if (!o->in_flight) return;
    /* the groups run in order on one stream: the last one's event covers them all */
    m->be.ops->event_wait(m->be.ctx, FM_STREAM_COMPUTE, FM_EVENT_OVERLAP0 + o->n_groups - 1);
    o->in_flight = false;
}
