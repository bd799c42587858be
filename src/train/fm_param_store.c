/* The parameter store (fm_param_store.h). */
#include "fm_param_store.h"

size_t fm_param_store_bytes(const fm_config *cfg, size_t a) {
    const int64_t n = fm_config_num_params(cfg);
    size_t b = 2 * fm_arena_round((size_t)n * a);
    if (a != sizeof(float)) b += fm_arena_round((size_t)n * sizeof(float));
    return b;
}

size_t fm_param_store_bytes_no_master(const fm_config *cfg, size_t a) {
    return 2 * fm_arena_round((size_t)fm_config_num_params(cfg) * a);
}

/* The store's layout in its arena (the same walk for a measuring arena). */
static void layout(fm_param_store *ps, fm_arena *a, int64_t n_params) {
    const size_t n = (size_t)n_params;
    ps->weights = fm_arena_alloc(a, n * sizeof(fm_act));
    ps->grads = fm_arena_alloc(a, n * sizeof(fm_act));
    if (ps->host_master) return; /* the optimizer's */
    ps->master = sizeof(fm_act) == sizeof(float) ? (float *)(void *)ps->weights : fm_arena_alloc(a, n * sizeof(float));
}

size_t fm_param_store_measure(int64_t n_params) {
    fm_param_store ps = {0};
    fm_arena a;
    fm_arena_init_measure(&a, "model state");
    layout(&ps, &a, n_params);
    return a.used;
}

static fm_status create(fm_param_store *ps, fm_model *m, size_t optimizer_bytes, float *host_master) {
    memset(ps, 0, sizeof *ps);
    ps->host_master = host_master != NULL;
    ps->n_params = m->n_params;
    ps->rank = 0;
    ps->world = 1;
    ps->shard_begin = 0;
    ps->shard_end = m->n_params;
    const size_t state = host_master ? fm_param_store_bytes_no_master(&m->cfg, sizeof(fm_act))
                                     : fm_param_store_bytes(&m->cfg, sizeof(fm_act)),
                 total = state + optimizer_bytes;
    ps->be = m->be;
    fm_status st = fm_arena_init_backend(&ps->arena, fm_live_set_names[FM_LIVE_MODEL_STATE], total, &ps->be);
    if (st)
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the model state (%lld parameters, %.3f GiB); "
                        "use a smaller config%s", (long long)m->n_params, total / 1073741824.0,
                        optimizer_bytes ? ", or --bf16-moments" : "");
    layout(ps, &ps->arena, m->n_params);
    if (host_master) ps->master = host_master;
    fm_model_bind_params(m, ps->weights, ps->grads, ps->master);
    m->master_host = host_master != NULL;
    return FM_OK;
}

fm_status fm_param_store_create(fm_param_store *ps, fm_model *m, size_t optimizer_bytes) {
    return create(ps, m, optimizer_bytes, NULL);
}

fm_status fm_param_store_create_host_master(fm_param_store *ps, fm_model *m, size_t optimizer_bytes, float *master) {
    FM_ASSERT(master);
    return create(ps, m, optimizer_bytes, master);
}

void *fm_param_store_take(fm_param_store *ps, size_t bytes) { return fm_arena_alloc(&ps->arena, bytes); }

void fm_param_store_free(fm_param_store *ps) {
    fm_arena_free(&ps->arena);
    memset(ps, 0, sizeof *ps);
}
