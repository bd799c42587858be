#include "fm_model.h"

#include "fm_model_internal.h"

#include <stdio.h>
#include <string.h>


const char *const fm_live_set_names[FM_LIVE_COUNT] = {
    "model state", "checkpoint boundaries", "layer activations", "expert dispatch",
    "layer working set", "vocabulary projection",
};

/* ------------------------------------------------------------------------------------------ */
/* Parameter table                                                                             */
/* ------------------------------------------------------------------------------------------ */

fm_status fm_model_create(fm_model *m, const fm_config *cfg, fm_backend be) {
    return fm_model_create_ep(m, cfg, be, 1, 0);
}

fm_status fm_model_create_ep(fm_model *m, const fm_config *cfg, fm_backend be, int ep, int ep_rank) {
    memset(m, 0, sizeof *m);
    FM_TRY(fm_params_create(&m->p, cfg, ep, ep_rank));
    m->cfg = *cfg;
    m->be = be;
    m->router = fm_router_opts_from_config(cfg);
    const int64_t L = cfg->num_hidden_layers;
    m->a.recompute = fm_malloc((size_t)(2 * L)); /* recompute [L], then keep_attention [L] */
    m->a.keep_attention = m->a.recompute ? m->a.recompute + L : NULL;
    if (!m->a.recompute) {
        fm_model_free(m);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the per-layer recompute flags (%lld layers)",
                        (long long)L);
    }
    return FM_OK;
}

void fm_model_upload_master(fm_model *m, const float *host) {
    const size_t n = (size_t)m->p.n_params;
    if ((const void *)host != (const void *)m->p.master)
        m->be.ops->copy(m->be.ctx, m->p.master, host, n * sizeof(float), FM_COPY_H2D);
    if ((void *)m->p.master != (void *)m->p.params)
        m->be.ops->convert(m->be.ctx, m->p.params, FM_ACT_DTYPE, m->p.master, FM_DTYPE_F32, (int64_t)n);
}

void fm_model_download_master(const fm_model *m, float *host) {
    m->be.ops->copy(m->be.ctx, host, m->p.master, (size_t)m->p.n_params * sizeof(float), FM_COPY_D2H);
}

fm_status fm_model_init_weights(fm_model *m, uint64_t seed) {
    /* drawn straight into the master when the host can write it (the CPU's, or the streamed
     * optimizer's pinned one: no second 4 B/param host copy next to it) */
    const bool host = m->be.ops->host_memory || m->p.master_host;
    float *w = host ? m->p.master : fm_malloc(sizeof(float) * (size_t)m->p.n_params);
    if (!w) return fm_error(FM_ERR_NOMEM, "memory: cannot stage %lld initial weights on the host", (long long)m->p.n_params);
    fm_params_init_weights_host(&m->p, seed, w);
    fm_model_upload_master(m, w);
    if (!host) fm_free(w);
    return FM_OK;
}

void fm_model_set_shape(fm_model *m, int64_t B, int64_t T) {
    FM_ASSERT(B >= 1 && T >= 1 && B <= m->a.B_cap && T <= m->a.T_cap);
    FM_ASSERT(m->a.moe_chunk_tokens == 0 || B * T == m->a.B_cap * m->a.T_cap); /* chunk order is for N_cap */
    m->a.B = B;
    m->a.T = T;
    m->a.N = B * T;
}

void fm_model_logits_row(const fm_model *m, int64_t row, float *host) {
    const int64_t V = m->cfg.vocab_size;
    FM_ASSERT(m->a.logits && row >= 0 && row < m->a.N);
    if (sizeof(fm_act) == sizeof(float)) {
        m->be.ops->copy(m->be.ctx, host, m->a.logits + row * V, sizeof(float) * (size_t)V, FM_COPY_D2H);
        return;
    }
    /* bf16 -> fp32 on the host: the high half of the fp32 bits (sampling, not a training step) */
    uint16_t *tmp = fm_malloc(sizeof(uint16_t) * (size_t)V);
    FM_ASSERT(tmp);
    m->be.ops->copy(m->be.ctx, tmp, m->a.logits + row * V, sizeof(uint16_t) * (size_t)V, FM_COPY_D2H);
    for (int64_t v = 0; v < V; v++) {
        uint32_t u = (uint32_t)tmp[v] << 16;
        memcpy(&host[v], &u, sizeof u);
    }
    fm_free(tmp);
}

void fm_model_free(fm_model *m) {
    fm_model_free_layout(m);
    fm_params_free(&m->p);
    fm_free(m->a.recompute);
    fm_free(m->a.moe_ep_counts_host);
    memset(m, 0, sizeof *m);
}

