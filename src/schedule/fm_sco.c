/* Selective checkpoint offload, the schedule policy (fm_sco.h). */
#include "fm_sco.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

fm_status fm_sco_parse(const char *spec, int64_t L, int64_t *n_off) {
    *n_off = 0;
    if (!spec || !*spec) return FM_OK;
    if (!strcmp(spec, "all")) {
        *n_off = L;
        return FM_OK;
    }
    char *end;
    errno = 0;
    long long v = strtoll(spec, &end, 10);
    if (end == spec || *end || errno || v < 0 || v > L)
        return fm_error(FM_ERR_ARG, "--offload-boundaries: found '%s'; expected an integer in 0 .. %lld (0 = off; the "
                        "model has %lld layers, and boundary %lld, the head's input, stays on the device) or 'all' "
                        "(= %lld)", spec, (long long)L, (long long)L, (long long)L, (long long)L);
    *n_off = v;
    return FM_OK;
}

int64_t fm_sco_device_boundaries(int64_t L, int64_t n_off) {
    /* the offloaded ones share min(n_off, 2) slots; the others keep a tensor each */
    return L + 1 - n_off + (n_off < 2 ? n_off : 2);
}

size_t fm_sco_host_bytes(int64_t N, int64_t H, int64_t n_off, size_t act_bytes) {
    return (size_t)n_off * fm_arena_round((size_t)N * (size_t)H * act_bytes);
}

fm_status fm_sco_create(fm_sco *p, fm_model *m) {
    memset(p, 0, sizeof *p);
    p->L = m->cfg.num_hidden_layers;
    p->n_off = m->a.n_offloaded_boundaries;
    FM_ASSERT(p->n_off >= 0 && p->n_off <= p->L); /* checked by fm_model_layout */
    p->bytes = (size_t)m->a.B_cap * (size_t)m->a.T_cap * (size_t)m->cfg.hidden_size * sizeof(fm_act);
    const int base = FM_EVENT_FIRST_FREE + FM_SCO_EVENT_BASE;
    p->ev_compute = base;
    p->ev_out = base + 1;
    p->ev_slot[0] = base + 2;
    p->ev_slot[1] = base + 3;
    p->in_flight[0] = p->in_flight[1] = -1;
    if (p->n_off == 0) return FM_OK;
    const size_t host = fm_sco_host_bytes(m->a.B_cap * m->a.T_cap, m->cfg.hidden_size, p->n_off, sizeof(fm_act));
    p->host_b = fm_malloc(sizeof(fm_act *) * (size_t)p->n_off);
    if (!p->host_b) return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the offload table (%lld boundaries)",
                                    (long long)p->n_off);
    fm_status st = fm_arena_init_backend_kind(&p->host, "offloaded boundaries", host, &m->be, FM_BUFFER_PINNED);
    if (st) {
        fm_sco_free(p);
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate %.3f GiB of pinned host memory for %lld offloaded "
                        "boundaries (--offload-boundaries); offload fewer", host / 1073741824.0, (long long)p->n_off);
    }
    for (int64_t l = 0; l < p->n_off; l++) p->host_b[l] = fm_arena_alloc(&p->host, p->bytes);
    return FM_OK;
}

fm_status fm_sco_attach(fm_sco *p, fm_schedule *s) {
    FM_TRY(fm_schedule_add_hook(s, fm_sco_hook, p));
    s->restores_boundaries = p->n_off;
    return FM_OK;
}

/* Issues the copy of boundary l from the host into its slot on the copy-in stream, after
 * compute's last use of the slot and after every copy-out (the host copy is complete). */
static void copy_in(fm_sco *p, fm_model *m, int64_t l) {
    const fm_ops *o = m->be.ops;
    void *c = m->be.ctx;
    const int s = (int)(l % 2);
    o->event_record(c, p->ev_compute, FM_STREAM_COMPUTE);
    o->event_wait(c, FM_STREAM_COPY_IN, p->ev_compute);
    o->event_wait(c, FM_STREAM_COPY_IN, p->ev_out);
    o->copy_async(c, fm_model_boundary(m, l), p->host_b[l], (size_t)m->a.N * (size_t)m->cfg.hidden_size * sizeof(fm_act),
                  FM_COPY_H2D, FM_STREAM_COPY_IN);
    o->event_record(c, p->ev_slot[s], FM_STREAM_COPY_IN);
    p->in_flight[s] = l;
    p->copies_in++;
}

fm_status fm_sco_hook(void *user, fm_model *m, fm_hook_point point, int64_t l) {
    fm_sco *p = user;
    if (p->n_off == 0) return FM_OK;
    const fm_ops *o = m->be.ops;
    void *c = m->be.ctx;
    switch (point) {
    case FM_HOOK_BEFORE_FORWARD:
        /* layer l writes boundary l+1: its slot must be done with its last copy */
        if (l + 1 < p->n_off) o->event_wait(c, FM_STREAM_COMPUTE, p->ev_slot[(l + 1) % 2]);
        break;
    case FM_HOOK_AFTER_FORWARD:
        if (l < p->n_off) { /* layer l was boundary l's last reader in forward */
            o->event_record(c, p->ev_compute, FM_STREAM_COMPUTE);
            o->event_wait(c, FM_STREAM_COPY_OUT, p->ev_compute);
            o->copy_async(c, p->host_b[l], fm_model_boundary(m, l),
                          (size_t)m->a.N * (size_t)m->cfg.hidden_size * sizeof(fm_act), FM_COPY_D2H, FM_STREAM_COPY_OUT);
            o->event_record(c, p->ev_slot[l % 2], FM_STREAM_COPY_OUT);
            o->event_record(c, p->ev_out, FM_STREAM_COPY_OUT);
            p->copies_out++;
        }
        break;
    case FM_HOOK_BEFORE_BACKWARD:
        if (l == p->L - 1) p->in_flight[0] = p->in_flight[1] = -1; /* a new backward */
        if (l < p->n_off) {
            if (p->in_flight[l % 2] != l) copy_in(p, m, l); /* no layer above prefetched it */
            o->event_wait(c, FM_STREAM_COMPUTE, p->ev_slot[l % 2]);
        }
        if (l >= 1 && l - 1 < p->n_off) copy_in(p, m, l - 1); /* arrives while layer l runs */
        break;
    default:
        break;
    }
    return FM_OK;
}

void fm_sco_free(fm_sco *p) {
    fm_arena_free(&p->host);
    fm_free(p->host_b);
    p->host_b = NULL;
}
