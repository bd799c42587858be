/* The optimizer overlap (train/fm_optim_overlap.h) on the CPU backend:
 *  - the groups: embedding, each layer's tensors, norm (+ untied head), for every model_type,
 *    tied and untied; a table out of forward order and too many layers are refused;
 *  - exactness: 3 steps of 2 accumulated micro-batches through the schedule, the update issued
 *    group by group (with the gradients zeroed by it and not at the next step's start) against
 *    the serial step (zero, forward/backward, the whole table at once): weights and Adam m, v
 *    bit-identical (memcmp), for the on-device AdamW and for the streamed AdamW (bucket 7);
 *  - the pipeline, seen through a probe op table: every update kernel and gradient zeroing is
 *    issued on the update stream and covers all parameters once per step, the op stream is the
 *    compute stream again afterwards, and every forward of the next step waits for group 0 before
 *    the embedding, group 1 + l before layer l and group L + 1 before the head, in that order. */
#include <stdio.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "schedule/fm_schedule.h"
#include "train/fm_offload_adamw.h"
#include "train/fm_optim_overlap.h"

#define B_ 2
#define T_ 8
#define L_ 3

static fm_backend g_be;        /* the CPU backend */
static fm_backend g_probe;     /* the same context with the probe's op table */
static fm_ops g_probe_ops;
static const fm_ops *g_cpu;

/* What the probe saw. */
static struct {
    fm_stream op_stream;
    int n_wait;                /* compute-stream waits on overlap events, in order */
    int waits[64];
    int adamw_update, adamw_compute; /* adamw launches per op stream */
    size_t zeroed_update;      /* bytes mem_set on the update stream */
} g_seen;

static void probe_set_op_stream(void *ctx, fm_stream s) {
    g_seen.op_stream = s;
    g_cpu->set_op_stream(ctx, s);
}

static void probe_event_wait(void *ctx, fm_stream s, int ev) {
    if (s == FM_STREAM_COMPUTE && ev >= FM_EVENT_OVERLAP0 && g_seen.n_wait < 64)
        g_seen.waits[g_seen.n_wait++] = ev - FM_EVENT_OVERLAP0;
    g_cpu->event_wait(ctx, s, ev);
}

static void probe_adamw(void *ctx, fm_act *p, const fm_act *g, float *master, void *m, void *v, fm_dtype mv,
                        int64_t n, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2,
                        float grad_scale) {
    if (g_seen.op_stream == FM_STREAM_UPDATE) g_seen.adamw_update++;
    else g_seen.adamw_compute++;
    g_cpu->adamw(ctx, p, g, master, m, v, mv, n, lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
}

static void probe_mem_set(void *ctx, void *dst, int byte, size_t bytes) {
    if (g_seen.op_stream == FM_STREAM_UPDATE) g_seen.zeroed_update += bytes;
    g_cpu->mem_set(ctx, dst, byte, bytes);
}

static void test_groups(void) {
    const fm_model_type types[3] = {FM_MODEL_QWEN3_MOE, FM_MODEL_OLMOE, FM_MODEL_MIXTRAL};
    for (int t = 0; t < 3; t++)
        for (int tied = 0; tied < 2; tied++) {
            const fm_config c = fm_test_small_config(types[t], L_, tied, 2);
            fm_model m;
            FM_ASSERT(fm_model_create(&m, &c, g_be) == FM_OK);
            fm_optim_overlap o;
            CHECK(fm_optim_overlap_init(&o, &m) == FM_OK);
            CHECK(o.n_groups == L_ + 2 && o.t0[0] == 0 && o.t0[o.n_groups] == m.p.n_tensors);
            CHECK(o.t0[1] == 1 && !strcmp(m.p.table[0].name, "model.embed_tokens.weight"));
            for (int g = 1; g <= L_; g++) {
                char pre[64];
                snprintf(pre, sizeof pre, "model.layers.%d.", g - 1);
                CHECK(o.t0[g + 1] > o.t0[g]);
                bool all = true;
                for (int i = o.t0[g]; i < o.t0[g + 1]; i++) all &= !strncmp(m.p.table[i].name, pre, strlen(pre));
                CHECK_MSG(all, "group %d holds a tensor of another layer", g);
            }
            CHECK(o.t0[L_ + 2] - o.t0[L_ + 1] == (tied ? 1 : 2));
            CHECK(!strcmp(m.p.table[o.t0[L_ + 1]].name, "model.norm.weight"));
            fm_optim_overlap_free(&o);
            /* out of forward order: a layer-1 tensor before layer 0's */
            fm_param save = m.p.table[1];
            snprintf(m.p.table[1].name, sizeof m.p.table[1].name, "model.layers.1.input_layernorm.weight");
            CHECK(fm_optim_overlap_init(&o, &m) == FM_ERR_ARG && strstr(fm_errmsg(), "--no-optimizer-overlap"));
            m.p.table[1] = save;
            m.cfg.num_hidden_layers = FM_EVENT_POOL; /* more layers than events */
            CHECK(fm_optim_overlap_init(&o, &m) == FM_ERR_ARG && strstr(fm_errmsg(), "update events"));
            m.cfg.num_hidden_layers = L_;
            fm_model_free(&m);
        }
}

/* One model with its optimizer: on-device AdamW, or the streamed one (bucket 7). */
typedef struct trained {
    fm_model m;
    fm_param_store ps;
    fm_adamw a;
    fm_offload_adamw oo;
    bool offload;
    const fm_optimizer_ops *ops;
    void *self;
    fm_schedule sched;
    fm_optim_overlap ov;
} trained;

static void trained_create(trained *t, const fm_config *c, fm_backend be, bool offload) {
    memset(t, 0, sizeof *t);
    FM_ASSERT(fm_model_create(&t->m, c, be) == FM_OK);
    fm_adamw_config(&t->a, 0.9, 0.95, 1e-8, 0.1, false);
    t->offload = offload;
    if (offload) {
        FM_ASSERT(fm_offload_adamw_create(&t->oo, &t->a, t->m.p.n_params, 7, 2, &be) == FM_OK);
        FM_ASSERT(fm_param_store_create_host_master(&t->ps, &t->m, fm_offload_adamw_ops.state_bytes(&t->oo, t->m.p.n_params),
                                                    t->oo.h_master) == FM_OK);
        t->ops = &fm_offload_adamw_ops;
        t->self = &t->oo;
    } else {
        FM_ASSERT(fm_param_store_create(&t->ps, &t->m, fm_adamw_ops.state_bytes(&t->a, t->m.p.n_params)) == FM_OK);
        t->ops = &fm_adamw_ops;
        t->self = &t->a;
    }
    t->ops->init(t->self, &t->ps, &be);
    FM_ASSERT(fm_model_init_weights(&t->m, 11) == FM_OK);
    FM_ASSERT(fm_model_layout(&t->m, B_, T_, NULL) == FM_OK);
    fm_schedule_init(&t->sched, &t->m);
}

static void trained_free(trained *t) {
    fm_optim_overlap_free(&t->ov);
    fm_param_store_free(&t->ps);
    if (t->offload) fm_offload_adamw_free(&t->oo);
    fm_model_free(&t->m);
}

static void test_exact(fm_model_type type, bool offload) {
    const fm_config c = fm_test_small_config(type, L_, false, 2);
    trained ser, ovl;
    trained_create(&ser, &c, g_be, false);
    trained_create(&ovl, &c, g_probe, offload);
    CHECK(fm_optim_overlap_init(&ovl.ov, &ovl.m) == FM_OK);
    fm_optim_overlap_attach(&ovl.ov, &ovl.sched);
    const int64_t n = ser.m.p.n_params;
    for (int s = 1; s <= 3; s++) {
        memset(&g_seen, 0, sizeof g_seen);
        /* serial: zero, two micro-batches, the whole table */
        ser.m.be.ops->mem_set(ser.m.be.ctx, ser.m.p.grads, 0, sizeof(fm_act) * (size_t)n);
        if (!ovl.ov.grads_zeroed) ovl.m.be.ops->mem_set(ovl.m.be.ctx, ovl.m.p.grads, 0, sizeof(fm_act) * (size_t)n);
        CHECK(ovl.ov.grads_zeroed == (s > 1));
        ovl.ov.grads_zeroed = false;
        for (int g = 0; g < 2; g++) {
            fm_test_fill_batch(&ser.m, 100 * (uint64_t)s + (uint64_t)g, g == 1 ? 3 : -1);
            fm_test_fill_batch(&ovl.m, 100 * (uint64_t)s + (uint64_t)g, g == 1 ? 3 : -1);
            CHECK(fm_schedule_train_step(&ser.sched, &ser.m, fm_test_batch_of(&ser.m), 0.5f, NULL) == FM_OK);
            const int w0 = g_seen.n_wait;
            CHECK(fm_schedule_train_step(&ovl.sched, &ovl.m, fm_test_batch_of(&ovl.m), 0.5f, NULL) == FM_OK);
            bool order = g_seen.n_wait - w0 == L_ + 2;
            for (int i = 0; order && i < L_ + 2; i++) order = g_seen.waits[w0 + i] == i;
            CHECK_MSG(order, "step %d micro-batch %d: the forward waited on %d overlap events, not groups 0..%d in order",
                      s, g, g_seen.n_wait - w0, L_ + 1);
        }
        CHECK(!memcmp(ser.m.p.grads, ovl.m.p.grads, sizeof(fm_act) * (size_t)n));
        const double lr = 1e-2 * s;
        const float clip = s == 2 ? 0.5f : 1.0f;
        ser.ops->step_begin(ser.self);
        ser.ops->step_range(ser.self, &ser.m, 0, ser.m.p.n_tensors, lr, clip);
        ovl.ops->step_begin(ovl.self);
        g_seen.adamw_update = g_seen.adamw_compute = 0;
        g_seen.zeroed_update = 0;
        fm_optim_overlap_issue(&ovl.ov, &ovl.m, ovl.ops, ovl.self, lr, clip);
        CHECK(g_seen.op_stream == FM_STREAM_COMPUTE && g_seen.adamw_update > 0 && g_seen.adamw_compute == 0);
        CHECK_MSG(g_seen.zeroed_update == sizeof(fm_act) * (size_t)n, "zeroed %zu of %zu gradient bytes",
                  g_seen.zeroed_update, sizeof(fm_act) * (size_t)n);
        CHECK(ovl.ov.in_flight && ovl.ov.grads_zeroed);
        fm_optim_overlap_flush(&ovl.ov, &ovl.m);
        CHECK(!ovl.ov.in_flight);
        bool zero = true;
        for (int64_t i = 0; i < n; i++) zero &= ovl.m.p.grads[i] == 0.0f;
        CHECK(zero);
    }
    CHECK_MSG(!memcmp(ser.m.p.params, ovl.m.p.params, sizeof(fm_act) * (size_t)n), "%s %s: weights differ",
              c.model_type_name, offload ? "streamed" : "on-device");
    const void *om = offload ? ovl.oo.h_m : ovl.a.m, *ov = offload ? ovl.oo.h_v : ovl.a.v;
    CHECK(!memcmp(ser.a.m, om, sizeof(float) * (size_t)n) && !memcmp(ser.a.v, ov, sizeof(float) * (size_t)n));
    trained_free(&ser);
    trained_free(&ovl);
}

int main(void) {
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    g_cpu = g_be.ops;
    g_probe_ops = *g_be.ops;
    g_probe_ops.set_op_stream = probe_set_op_stream;
    g_probe_ops.event_wait = probe_event_wait;
    g_probe_ops.adamw = probe_adamw;
    g_probe_ops.mem_set = probe_mem_set;
    g_probe = g_be;
    g_probe.ops = &g_probe_ops;
    test_groups();
    const fm_model_type types[3] = {FM_MODEL_QWEN3_MOE, FM_MODEL_OLMOE, FM_MODEL_MIXTRAL};
    for (int t = 0; t < 3; t++) {
        test_exact(types[t], false);
        test_exact(types[t], true);
    }
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
