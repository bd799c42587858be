/* The streamed AdamW (train/fm_offload_adamw.h) on this build's backend (the CUDA one under
 * flatmoe_cuda_lib: pinned host state, copy-in/copy-out streams, events): over the same
 * gradients, 3 steps give bf16 weights, fp32 master and Adam m, v bit-identical to fm_adamw_ops
 * (the adamw kernel is elementwise, so launching it per bucket changes no bit), for buckets
 * smaller than a tensor and not dividing the parameter count, 1-3 slots, fp32 and bf16 moments;
 * every bucket streamed, or the first ones' state resident on the device
 * (--optimizer-offload-fraction F = 0.5, 0.01: the resident master copied in from the pinned host
 * master at the first step, and back by state_tensors). */
#include <stdio.h>
#include <string.h>

#include "backend/fm_backend_default.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_offload_adamw.h"
#include "train/fm_offload_adamw.h"

static fm_backend g_be;

static fm_config small_config(void) {
    fm_config c;
    memset(&c, 0, sizeof c);
    c.model_type = FM_MODEL_OLMOE;
    snprintf(c.model_type_name, sizeof c.model_type_name, "olmoe");
    c.vocab_size = 64; c.hidden_size = 32; c.moe_intermediate_size = 16; c.num_hidden_layers = 2;
    c.num_attention_heads = 4; c.num_key_value_heads = 2; c.head_dim = 8; c.max_position_embeddings = 64;
    c.num_experts = 4; c.num_experts_per_tok = 2; c.rope_theta = 10000; c.rms_norm_eps = 1e-5;
    c.initializer_range = 0.3; c.qk_norm = FM_QK_NORM_FULL;
    return c;
}

static void *download(const void *src, size_t bytes) {
    void *h = fm_malloc(bytes);
    FM_ASSERT(h);
    g_be.ops->copy(g_be.ctx, h, src, bytes, FM_COPY_D2H);
    return h;
}

static void run_case(int64_t bucket, int slots, bool bf16, double F) {
    const fm_config c = small_config();
    fm_oa_fixture f;
    fm_oa_fixture_create_f(&f, &c, &g_be, bucket, slots, bf16, F);
    const int64_t n = f.n, R = f.oo.resident;
    CHECK(F >= 1 || bucket >= n || R > 0);
    /* the same initial master in both; the weights converted from it */
    float *w0 = fm_malloc(sizeof(float) * (size_t)n), *g = fm_malloc(sizeof(float) * (size_t)n);
    fm_rng r;
    fm_rng_seed(&r, 5);
    for (int64_t i = 0; i < n; i++) w0[i] = (fm_rng_uniform(&r) - 0.5f) * 0.2f;
    g_be.ops->copy(g_be.ctx, f.ref.p.master, w0, sizeof(float) * (size_t)n, FM_COPY_H2D);
    g_be.ops->convert(g_be.ctx, f.ref.p.params, FM_ACT_DTYPE, f.ref.p.master, FM_DTYPE_F32, n);
    memcpy(f.oo.h_master, w0, sizeof(float) * (size_t)n); /* pinned host memory */
    g_be.ops->convert(g_be.ctx, f.off.p.params, FM_ACT_DTYPE, f.ref.p.master, FM_DTYPE_F32, n);
    for (int s = 1; s <= 3; s++) {
        for (int64_t i = 0; i < n; i++) g[i] = (fm_rng_uniform(&r) - 0.5f) * 0.1f;
        /* the gradients in the act dtype: uploaded as fp32 (launch-time memory, a test) and converted */
        float *dg = g_be.ops->mem_alloc(g_be.ctx, sizeof(float) * (size_t)n);
        g_be.ops->copy(g_be.ctx, dg, g, sizeof(float) * (size_t)n, FM_COPY_H2D);
        g_be.ops->convert(g_be.ctx, f.ref.p.grads, FM_ACT_DTYPE, dg, FM_DTYPE_F32, n);
        g_be.ops->convert(g_be.ctx, f.off.p.grads, FM_ACT_DTYPE, dg, FM_DTYPE_F32, n);
        g_be.ops->sync(g_be.ctx);
        g_be.ops->mem_free(g_be.ctx, dg);
        fm_adamw_ops.step_begin(&f.ra);
        fm_adamw_ops.step_range(&f.ra, &f.ref, 0, f.ref.p.n_tensors, 1e-2 * s, s == 2 ? 0.5f : 1.0f);
        fm_offload_adamw_ops.step_begin(&f.oo);
        fm_offload_adamw_ops.step_range(&f.oo, &f.off, 0, f.off.p.n_tensors, 1e-2 * s, s == 2 ? 0.5f : 1.0f);
        g_be.ops->sync(g_be.ctx);
        CHECK(g_be.ops->status(g_be.ctx) == FM_OK);
    }
    const size_t mb = bf16 ? 2 : 4;
    fm_optim_state st[3]; /* the checkpoint's view: the resident master back in the host's */
    CHECK(fm_offload_adamw_ops.state_tensors(&f.oo, st, 3) == 3 && st[0].dev_len == R);
    if (R > 0) { /* the resident moments: the device's [0, R), then the host's */
        void *dm = download(f.oo.d_res_m, mb * (size_t)R), *dv = download(f.oo.d_res_v, mb * (size_t)R);
        void *hm = fm_malloc(mb * (size_t)n), *hv = fm_malloc(mb * (size_t)n);
        FM_ASSERT(hm && hv);
        memcpy(hm, dm, mb * (size_t)R), memcpy(hv, dv, mb * (size_t)R);
        memcpy((char *)hm + mb * (size_t)R, f.oo.h_m, mb * (size_t)(n - R));
        memcpy((char *)hv + mb * (size_t)R, f.oo.h_v, mb * (size_t)(n - R));
        void *rmm = download(f.ra.m, mb * (size_t)n), *rvv = download(f.ra.v, mb * (size_t)n);
        CHECK_MSG(!memcmp(rmm, hm, mb * (size_t)n) && !memcmp(rvv, hv, mb * (size_t)n),
                  "F %g bucket %lld: the split moments differ", F, (long long)bucket);
        fm_free(dm); fm_free(dv); fm_free(hm); fm_free(hv); fm_free(rmm); fm_free(rvv);
    }
    void *rp = download(f.ref.p.params, sizeof(fm_act) * (size_t)n), *op = download(f.off.p.params, sizeof(fm_act) * (size_t)n);
    void *rm = download(f.ref.p.master, sizeof(float) * (size_t)n);
    void *rmm = download(f.ra.m, mb * (size_t)n), *rvv = download(f.ra.v, mb * (size_t)n);
    const bool w_ok = !memcmp(rp, op, sizeof(fm_act) * (size_t)n), ms_ok = !memcmp(rm, f.oo.h_master, 4 * (size_t)n);
    const bool m_ok = R > 0 || !memcmp(rmm, f.oo.h_m, mb * (size_t)n), v_ok = R > 0 || !memcmp(rvv, f.oo.h_v, mb * (size_t)n);
    CHECK_MSG(w_ok && ms_ok && m_ok && v_ok, "bucket %lld slots %d %s F %g: weights %d master %d m %d v %d",
              (long long)bucket, slots, bf16 ? "bf16" : "fp32", F, w_ok, ms_ok, m_ok, v_ok);
    fm_free(rp); fm_free(op); fm_free(rm); fm_free(rmm); fm_free(rvv); fm_free(w0); fm_free(g);
    fm_oa_fixture_free(&f);
}

int main(void) {
    FM_ASSERT(fm_backend_default_init(&g_be, 2, 64) == FM_OK);
    const int64_t buckets[3] = {7, 1001, 1 << 30};
    for (int b = 0; b < 3; b++)
        for (int s = 1; s <= 3; s++)
            for (int h = 0; h < 2; h++) run_case(buckets[b], s, h == 1, 1.0);
    for (int b = 0; b < 2; b++) /* --optimizer-offload-fraction */
        for (int h = 0; h < 2; h++) {
            run_case(buckets[b], 1 + b + h, h == 1, 0.5);
            run_case(buckets[b], 2, h == 1, 0.01);
        }
    fm_backend_default_free(&g_be);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
