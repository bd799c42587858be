/* The parameter store (fm_param_store.h). */
#include "fm_param_store.h"

#include "fm_zero3.h"

size_t fm_param_store_bytes(const fm_config *cfg, size_t a) {
    const int64_t n = fm_config_num_params(cfg);
    size_t b = 2 * fm_arena_round((size_t)n * a);
    if (a != sizeof(float)) b += fm_arena_round((size_t)n * sizeof(float));
    return b;
}

size_t fm_param_store_bytes_no_master(const fm_config *cfg, size_t a) {
    return 2 * fm_arena_round((size_t)fm_config_num_params(cfg) * a);
}

int64_t fm_param_store_shard_len(int64_t n_params, int world) {
    if (world <= 1) return n_params;
    const int64_t s = (n_params + world - 1) / world;
    return (s + FM_SHARD_ALIGN - 1) / FM_SHARD_ALIGN * FM_SHARD_ALIGN;
}

size_t fm_param_store_bytes_sharded(const fm_config *cfg, size_t a, int world) {
    if (world <= 1) return fm_param_store_bytes(cfg, a);
    const int64_t n = fm_config_num_params(cfg), n_alloc = fm_param_store_shard_len(n, world) * world;
    size_t b = 2 * fm_arena_round((size_t)n_alloc * a);
    if (a != sizeof(float)) b += fm_arena_round((size_t)n * sizeof(float));
    return b;
}

size_t fm_param_store_bytes_recipe(const fm_config *cfg, size_t a, int world, fm_master_recipe recipe) {
    if (recipe == FM_MASTER_FP32) return fm_param_store_bytes_sharded(cfg, a, world);
    const int64_t n = fm_config_num_params(cfg), n_alloc = fm_param_store_shard_len(n, world) * (world > 1 ? world : 1);
    return 2 * fm_arena_round((size_t)n_alloc * a);
}

/* The store's layout in its arena (the same walk for a measuring arena): weights and grads of
 * n_alloc elements, the master of n_params. */
static void layout_n(fm_param_store *ps, fm_arena *a, int64_t n_params, int64_t n_alloc) {
    const size_t n = (size_t)n_params, na = (size_t)n_alloc;
    ps->weights = fm_arena_alloc(a, na * sizeof(fm_act));
    ps->grads = fm_arena_alloc(a, na * sizeof(fm_act));
    if (ps->host_master) return; /* the optimizer's */
    if (ps->no_master) { /* a bf16 recipe: the weights are the master (an alias, fm_act elements) */
        ps->master = (float *)(void *)ps->weights;
        return;
    }
    ps->master = sizeof(fm_act) == sizeof(float) ? (float *)(void *)ps->weights : fm_arena_alloc(a, n * sizeof(float));
}

static void layout(fm_param_store *ps, fm_arena *a, int64_t n_params) { layout_n(ps, a, n_params, n_params); }

size_t fm_param_store_measure(int64_t n_params) {
    fm_param_store ps = {0};
    fm_arena a;
    fm_arena_init_measure(&a, "model state");
    layout(&ps, &a, n_params);
    return a.used;
}

static fm_status create(fm_param_store *ps, fm_model *m, size_t optimizer_bytes, float *host_master, int rank,
                        int world, bool no_master) {
    memset(ps, 0, sizeof *ps);
    ps->host_master = host_master != NULL;
    ps->no_master = no_master && sizeof(fm_act) != sizeof(float); /* fp32 weights are their own master */
    ps->n_params = m->p.n_params;
    ps->rank = rank;
    ps->world = world;
    ps->sharded = world > 1;
    ps->shard_len = fm_param_store_shard_len(m->p.n_params, world);
    ps->n_alloc = ps->shard_len * world;
    ps->shard_begin = (int64_t)rank * ps->shard_len;
    if (ps->shard_begin > m->p.n_params) ps->shard_begin = m->p.n_params;
    ps->shard_end = ps->shard_begin + ps->shard_len < m->p.n_params ? ps->shard_begin + ps->shard_len : m->p.n_params;
    /* fm_param_store_bytes(_sharded, _no_master) of the table's count (with --ep, fm_model_create_ep's
     * E/ep experts: fewer than the config's) */
    const size_t na = (size_t)ps->n_alloc, a = sizeof(fm_act);
    const size_t state = 2 * fm_arena_round(na * a) +
                         (host_master || ps->no_master || a == sizeof(float)
                              ? 0
                              : fm_arena_round((size_t)m->p.n_params * sizeof(float))),
                 total = state + optimizer_bytes;
    ps->be = m->be;
    fm_status st = fm_arena_init_backend(&ps->arena, fm_live_set_names[FM_LIVE_MODEL_STATE], total, &ps->be);
    if (st)
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the model state (%lld parameters, %.3f GiB); "
                        "use a smaller config%s", (long long)m->p.n_params, total / 1073741824.0,
                        optimizer_bytes ? ", or --bf16-moments" : "");
    layout_n(ps, &ps->arena, m->p.n_params, ps->n_alloc);
    if (ps->n_alloc > m->p.n_params) { /* the padding: zeros that every reduce and gather carries */
        const size_t pad = (size_t)(ps->n_alloc - m->p.n_params) * sizeof(fm_act);
        ps->be.ops->mem_set(ps->be.ctx, ps->weights + m->p.n_params, 0, pad);
        ps->be.ops->mem_set(ps->be.ctx, ps->grads + m->p.n_params, 0, pad);
    }
    if (host_master) ps->master = host_master;
    fm_params_bind(&m->p, ps->weights, ps->grads, ps->master);
    m->p.master_host = host_master != NULL;
    return FM_OK;
}

fm_status fm_param_store_create(fm_param_store *ps, fm_model *m, size_t optimizer_bytes) {
    return create(ps, m, optimizer_bytes, NULL, 0, 1, false);
}

fm_status fm_param_store_create_bf16(fm_param_store *ps, fm_model *m, int rank, int world, size_t optimizer_bytes) {
    FM_ASSERT(world >= 1 && rank >= 0 && rank < world);
    return create(ps, m, optimizer_bytes, NULL, rank, world, true);
}

fm_status fm_param_store_upload_f32(const fm_param_store *ps, fm_model *m, const float *w) {
    if (!ps->no_master) {
        fm_model_upload_master(m, w);
        return FM_OK;
    }
    /* bf16 weights with no master: rounded on the host (nearest even, as the convert op) in
     * pieces of 1M, then copied */
    const int64_t piece = (int64_t)1 << 20, n = m->p.n_params;
    uint16_t *h = fm_malloc(sizeof(uint16_t) * (size_t)(n < piece ? n : piece));
    if (!h) return fm_error(FM_ERR_NOMEM, "memory: cannot stage the bf16 weights on the host (%lld bytes)",
                            (long long)(2 * (n < piece ? n : piece)));
    for (int64_t a = 0; a < n; a += piece) {
        const int64_t k = n - a < piece ? n - a : piece;
        for (int64_t i = 0; i < k; i++) h[i] = fm_f32_to_bf16(w[a + i]);
        m->be.ops->copy(m->be.ctx, (uint16_t *)(void *)m->p.params + a, h, 2 * (size_t)k, FM_COPY_H2D);
    }
    m->be.ops->stream_sync(m->be.ctx, FM_STREAM_COMPUTE); /* h is freed next */
    fm_free(h);
    return FM_OK;
}

fm_status fm_param_store_create_sharded(fm_param_store *ps, fm_model *m, int rank, int world, size_t optimizer_bytes) {
    FM_ASSERT(world >= 1 && rank >= 0 && rank < world);
    return create(ps, m, optimizer_bytes, NULL, rank, world, false);
}

fm_status fm_param_store_create_host_master(fm_param_store *ps, fm_model *m, size_t optimizer_bytes, float *master) {
    FM_ASSERT(master);
    return create(ps, m, optimizer_bytes, master, 0, 1, false);
}

fm_status fm_param_store_create_zero3(fm_param_store *ps, fm_model *m, const fm_zero3 *z, size_t optimizer_bytes) {
    memset(ps, 0, sizeof *ps);
    FM_ASSERT(z->n_params == m->p.n_params);
    ps->n_params = m->p.n_params;
    ps->rank = z->rank;
    ps->world = z->W;
    ps->sharded = true;
    ps->zero3 = true;
    ps->shard_begin = 0; /* the optimizer's state element i is shard element i */
    ps->shard_len = ps->shard_end = ps->n_alloc = z->shard_len;
    ps->slot_len = z->slot_len;
    ps->gbuf_len = z->gbuf_len;
    const size_t total = fm_zero3_store_bytes(z, sizeof(fm_act)) + optimizer_bytes;
    ps->be = m->be;
    if (fm_arena_init_backend(&ps->arena, fm_live_set_names[FM_LIVE_MODEL_STATE], total, &ps->be))
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the ZeRO-3 model state (%lld of %lld parameters on "
                        "this rank, %.3f GiB); use more ranks or a smaller config%s", (long long)z->shard_len,
                        (long long)m->p.n_params, total / 1073741824.0, optimizer_bytes ? ", or --bf16-moments" : "");
    /* the walk fm_zero3_store_bytes counts */
    const size_t S = (size_t)z->shard_len, a = sizeof(fm_act);
    ps->weights = fm_arena_alloc(&ps->arena, S * a);
    ps->grads = fm_arena_alloc(&ps->arena, S * a);
    ps->master = a == sizeof(float) ? (float *)(void *)ps->weights : fm_arena_alloc(&ps->arena, S * sizeof(float));
    ps->slot[0] = fm_arena_alloc(&ps->arena, (size_t)z->slot_len * a);
    ps->slot[1] = fm_arena_alloc(&ps->arena, (size_t)z->slot_len * a);
    ps->gbuf = fm_arena_alloc(&ps->arena, (size_t)z->gbuf_len * a);
    ps->be.ops->mem_set(ps->be.ctx, ps->weights, 0, S * a);
    ps->be.ops->mem_set(ps->be.ctx, ps->grads, 0, S * a);
    if ((void *)ps->master != (void *)ps->weights) ps->be.ops->mem_set(ps->be.ctx, ps->master, 0, S * sizeof(float));
    m->p.params = ps->weights;
    m->p.grads = ps->grads;
    m->p.master = ps->master;
    m->p.master_host = false;
    return FM_OK;
}

void *fm_param_store_take(fm_param_store *ps, size_t bytes) { return fm_arena_alloc(&ps->arena, bytes); }

void fm_param_store_free(fm_param_store *ps) {
    fm_arena_free(&ps->arena);
    memset(ps, 0, sizeof *ps);
}
