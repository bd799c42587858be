/* The streamed AdamW (train/fm_offload_adamw.h) on the CPU backend: over the same gradients,
 * N steps give weights, master, m and v bit-identical to fm_adamw_ops, for bucket sizes smaller
 * than a tensor, not dividing the parameter count, and larger than the model; S = 1, 2, 3 slots;
 * fp32 and bf16 moments; the whole table in one step_range or in pieces; every bucket streamed
 * (F = 1) or only the last ceil(F nb) (--optimizer-offload-fraction F = 1/2, 1/3, 0.01: the first
 * buckets' state on the device, updated by the same op: the same bits by construction), with a
 * checkpoint's view taken mid-run and the device's resident master spoiled after it (the next step
 * must copy the host's in). The device and host bounds equal the arenas' capacities and the plan's. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_offload_adamw.h"
#include "plan/fm_plan.h"
#include "train/fm_offload_adamw.h"

static fm_backend g_be;

static fm_config small_config(void) {
    fm_config c;
    memset(&c, 0, sizeof c);
    c.model_type = FM_MODEL_OLMOE;
    snprintf(c.model_type_name, sizeof c.model_type_name, "olmoe");
    c.vocab_size = 40; c.hidden_size = 24; c.moe_intermediate_size = 12; c.num_hidden_layers = 3;
    c.num_attention_heads = 4; c.num_key_value_heads = 2; c.head_dim = 6; c.max_position_embeddings = 64;
    c.num_experts = 5; c.num_experts_per_tok = 2; c.rope_theta = 10000; c.rms_norm_eps = 1e-5;
    c.norm_topk_prob = false; c.router_aux_loss_coef = 0.01; c.router_z_loss_coef = 0.001;
    c.initializer_range = 0.3; c.qk_norm = FM_QK_NORM_FULL;
    return c;
}

/* Gradients of step s: the same values for both runs. */
static void fill_grads(fm_model *m, int s) {
    fm_rng r;
    fm_rng_seed(&r, 1000 + (uint64_t)s);
    for (int64_t i = 0; i < m->p.n_params; i++) m->p.grads[i] = (float)(fm_rng_uniform(&r) * 2.0 - 1.0) * 0.1f;
}

static int g_case = 0;

/* Element i of a split state (fm_optim_state.dev): the device part's, or the host part's. */
static const void *split_at(const fm_optim_state *st, int64_t i, size_t es) {
    return i < st->dev_len ? (const char *)st->dev + (size_t)i * es : (const char *)st->base + (size_t)(i - st->dev_len) * es;
}

/* Whether split state st holds the same bytes as ref [n] of es-byte elements. */
static bool split_equal(const fm_optim_state *st, const void *ref, int64_t n, size_t es) {
    const int64_t d = st->dev_len < n ? st->dev_len : n;
    if (d > 0 && memcmp(st->dev, ref, (size_t)d * es)) return false;
    return !memcmp(split_at(st, d, es), (const char *)ref + (size_t)d * es, (size_t)(n - d) * es);
}

static void run_case(int64_t bucket, int slots, bool bf16, int pieces, double F) {
    const fm_config c = small_config();
    const int steps = 4;
    /* the reference: AdamW over the store's master (on the CPU: the weights) */
    fm_oa_fixture f;
    fm_oa_fixture_create_f(&f, &c, &g_be, bucket, slots, bf16, F);
    const int64_t n = f.n, R = f.oo.resident;
    CHECK(f.off.p.master == f.oo.h_master && (void *)f.off.p.master != (void *)f.off.p.params);
    /* the split: the last ceil(F nb) whole buckets stream, the first stay */
    const int64_t bw = bucket < n ? bucket : n, nb = (n + bw - 1) / bw;
    const int64_t sb = F >= 1 ? nb : (int64_t)ceil(F * (double)nb - 1e-9) < 1 ? 1 : (int64_t)ceil(F * (double)nb - 1e-9);
    CHECK_MSG(R == (nb - sb) * bw && R < n, "F %g bucket %lld: %lld resident, expected %lld", F, (long long)bucket,
              (long long)R, (long long)((nb - sb) * bw));
    /* bounds: the arenas hold exactly the formula's bytes, and so does the plan */
    size_t host = 0;
    const size_t dev = fm_offload_model_state_bound(&c, sizeof(fm_act), bf16, bucket, slots, F, &host, NULL);
    CHECK_MSG(f.ops.arena.capacity == fm_arena_round(dev), "device arena %zu, bound %zu", f.ops.arena.capacity, dev);
    CHECK(f.ops.arena.capacity == f.ops.arena.used);
    CHECK_MSG(f.oo.host.capacity == fm_arena_round(host), "host arena %zu, bound %zu", f.oo.host.capacity, host);
    CHECK(f.oo.host.capacity == f.oo.host.used);
    CHECK(host == fm_arena_round((size_t)n * 4) + 2 * fm_arena_round((size_t)(n - R) * (bf16 ? 2 : 4)));
    fm_plan_req req;
    memset(&req, 0, sizeof req);
    req.cfg = c; req.B = 1; req.T = 8; req.grad_accum = 1; req.bf16_moments = bf16;
    req.model_state_bytes = fm_model_state_bound; req.offload_optimizer = true; req.offload_bucket = bucket;
    req.offload_slots = slots; req.offload_state_bytes = fm_offload_model_state_bound; req.offload_fraction = F;
    fm_plan p;
    fm_plan_compute(&req, &p);
    CHECK(p.bytes[FM_LIVE_MODEL_STATE] == dev && p.host_bytes == host && p.host_optimizer_bytes == host);
    CHECK(p.offload_resident == R && p.offload_buckets == nb && p.offload_streamed_buckets == sb);

    FM_ASSERT(fm_model_init_weights(&f.ref, 7) == FM_OK);
    FM_ASSERT(fm_model_init_weights(&f.off, 7) == FM_OK);
    CHECK(!memcmp(f.ref.p.params, f.off.p.params, sizeof(float) * (size_t)n));
    CHECK(!memcmp(f.ref.p.master, f.off.p.master, sizeof(float) * (size_t)n));
    bool mixed = false;
    for (int i = 1; i < f.ref.p.n_tensors; i++) mixed |= f.ref.p.table[i].decay != f.ref.p.table[0].decay;
    CHECK(mixed); /* the table has both weight-decay flags */
    fm_optim_state st[3];
    for (int s = 1; s <= steps; s++) {
        fill_grads(&f.ref, s);
        fill_grads(&f.off, s);
        const double lr = 1e-2 * s;
        const float clip = s == 2 ? 0.37f : 1.0f;
        fm_adamw_ops.step_begin(&f.ra);
        fm_adamw_ops.step_range(&f.ra, &f.ref, 0, f.ref.p.n_tensors, lr, clip);
        fm_offload_adamw_ops.step_begin(&f.oo);
        for (int k = 0; k < pieces; k++) /* the table in `pieces` ranges (layer-wise callers) */
            fm_offload_adamw_ops.step_range(&f.oo, &f.off, (int)((int64_t)f.off.p.n_tensors * k / pieces),
                                            (int)((int64_t)f.off.p.n_tensors * (k + 1) / pieces), lr, clip);
        g_be.ops->sync(g_be.ctx);
        if (s == 2 && R > 0) {
            /* a checkpoint's view after step 2: the resident master copied back into the host's (the
             * model's master view whole), then, as a load would write the host's, the device copy is
             * spoiled: the next step must take the host's (the pull) for the bits to hold */
            CHECK(fm_offload_adamw_ops.state_tensors(&f.oo, st, 3) == 3);
            CHECK(!memcmp(f.ref.p.master, f.oo.h_master, sizeof(float) * (size_t)n));
            memset(f.oo.d_res_master, 0xff, (size_t)R * sizeof(float));
        }
    }
    const size_t mb = bf16 ? 2 : 4;
    CHECK(fm_offload_adamw_ops.state_tensors(&f.oo, st, 3) == 3); /* the view: the host's master whole again */
    CHECK(!strcmp(st[2].prefix, "master.") && st[2].base == f.oo.h_master && st[2].host && st[2].dev_len == 0);
    CHECK(!strcmp(st[0].prefix, "exp_avg.") && !strcmp(st[1].prefix, "exp_avg_sq."));
    CHECK(st[0].dev_len == R && st[1].dev_len == R && st[0].base == f.oo.h_m && st[0].host);
    const bool w_ok = !memcmp(f.ref.p.params, f.off.p.params, sizeof(float) * (size_t)n);
    const bool ms_ok = !memcmp(f.ref.p.master, f.oo.h_master, sizeof(float) * (size_t)n);
    const bool m_ok = split_equal(&st[0], f.ra.m, n, mb), v_ok = split_equal(&st[1], f.ra.v, n, mb);
    CHECK_MSG(w_ok && ms_ok && m_ok && v_ok, "bucket %lld slots %d %s pieces %d F %g: weights %d master %d m %d v %d",
              (long long)bucket, slots, bf16 ? "bf16" : "fp32", pieces, F, w_ok, ms_ok, m_ok, v_ok);
    CHECK(f.oa.step == steps);
    /* the state moved: not a vacuous comparison (in both parts of a split) */
    double dm = 0, dr = 0;
    for (int64_t i = 0; i < n; i++) {
        const float v = bf16 ? 0 : *(const float *)split_at(&st[0], i, 4);
        dm += fabs(v);
        if (i < R) dr += fabs(v);
    }
    CHECK(bf16 || (dm > 0 && (R == 0 || dr > 0)));
    fm_oa_fixture_free(&f);
    g_case++;
}

static void test_bad_args(void) {
    fm_adamw a;
    fm_adamw_config(&a, 0.9, 0.95, 1e-8, 0.1, false);
    fm_offload_adamw o;
    CHECK(fm_offload_adamw_create(&o, &a, 100, 0, 2, &g_be) == FM_ERR_ARG);
    CHECK(fm_offload_adamw_create(&o, &a, 100, 10, 0, &g_be) == FM_ERR_ARG);
    CHECK(fm_offload_adamw_create(&o, &a, 100, 10, FM_OFFLOAD_MAX_SLOTS + 1, &g_be) == FM_ERR_ARG);
    CHECK(fm_offload_adamw_create_split(&o, &a, 100, 10, 2, 0.0, &g_be) == FM_ERR_ARG);
    CHECK(fm_offload_adamw_create_split(&o, &a, 100, 10, 2, 1.5, &g_be) == FM_ERR_ARG);
    CHECK(fm_offload_adamw_create_split(&o, &a, 100, 10, 2, NAN, &g_be) == FM_ERR_ARG);
    /* the split: ceil(F nb) buckets stream, at least one; F = s / nb gives s again */
    CHECK(fm_offload_buckets(100, 10) == 10 && fm_offload_buckets(101, 10) == 11 && fm_offload_buckets(5, 10) == 1);
    CHECK(fm_offload_streamed_buckets(100, 10, 0.5) == 5 && fm_offload_streamed_buckets(100, 10, 0.51) == 6);
    CHECK(fm_offload_streamed_buckets(100, 10, 1e-6) == 1 && fm_offload_streamed_buckets(100, 10, 1.0) == 10);
    CHECK(fm_offload_resident_params(101, 10, 0.5) == 50 && fm_offload_resident_params(5, 10, 0.5) == 0);
    for (int64_t nb = 1; nb <= 2000; nb += 7)
        for (int64_t s = 1; s <= nb; s += 1 + nb / 13)
            CHECK(fm_offload_streamed_buckets(nb, 1, (double)s / (double)nb) == s);
    /* staging uses min(bucket, params) */
    CHECK(fm_offload_adamw_state_bytes(100, 1000, 2, false) == fm_offload_adamw_state_bytes(100, 100, 2, false));
    CHECK(fm_offload_adamw_state_bytes(1000, 100, 3, true) == 3 * (fm_arena_round(400) + 2 * fm_arena_round(200)));
}

int main(void) {
    FM_ASSERT(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    fm_model probe;
    const fm_config c = small_config();
    FM_ASSERT(fm_model_create(&probe, &c, g_be) == FM_OK);
    const int64_t n = probe.p.n_params;
    int64_t smallest = n;
    for (int i = 0; i < probe.p.n_tensors; i++)
        if (probe.p.table[i].numel > 1 && probe.p.table[i].numel < smallest) smallest = probe.p.table[i].numel;
    fm_model_free(&probe);
    /* one smaller than any tensor, one not dividing the parameter count, one larger than the model */
    int64_t odd = n / 7 + 1;
    while (n % odd == 0) odd++;
    const int64_t buckets[4] = {smallest > 2 ? smallest - 1 : 1, 97, odd, n + 5};
    CHECK(n % 97 != 0 && n % odd != 0);
    for (int b = 0; b < 4; b++)
        for (int s = 1; s <= 3; s++)
            for (int h = 0; h < 2; h++) run_case(buckets[b], s, h == 1, 1 + (b + s) % 3, 1.0);
    /* --optimizer-offload-fraction: half, a third, a sliver of the buckets streamed; resident parts
     * that end inside a tensor and one a tensor boundary away */
    const double fr[3] = {0.5, 1.0 / 3.0, 0.01};
    for (int b = 0; b < 3; b++)
        for (int k = 0; k < 3; k++)
            for (int h = 0; h < 2; h++) run_case(buckets[b], 1 + (b + k) % 3, h == 1, 1 + (b + k) % 3, fr[k]);
    test_bad_args();
    fm_cpu_backend_free(&g_be);
    printf("%d cases; %d passed, %d failed\n", g_case, fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
