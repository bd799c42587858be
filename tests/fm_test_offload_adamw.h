/* The streamed-AdamW A/B fixture, shared by tests/test_offload_adamw.c (the CPU backend) and
 * tests/gpu/test_cuda_model_offload_adamw.c (the CUDA one): two models of one config on one
 * backend, `ref` stepped by fm_adamw_ops over its own parameter store, `off` by the streamed
 * AdamW (train/fm_offload_adamw.h) over a host master (fm_param_store_create_host_master), with
 * the same AdamW hyper-parameters (betas 0.9, 0.95, eps 1e-8, weight decay 0.1; bf16: bf16
 * moments). Each test then fills both with the same weights and gradients, steps both, and
 * compares the bits. */
#ifndef FM_TEST_OFFLOAD_ADAMW_H
#define FM_TEST_OFFLOAD_ADAMW_H
#include "fm_test.h"
#include "train/fm_offload_adamw.h"

typedef struct fm_oa_fixture {
    fm_model ref, off;
    fm_adamw ra, oa;         /* ref's AdamW; off's hyper-parameters (oo steps them) */
    fm_param_store rps, ops; /* ref's store; off's, over oo.h_master */
    fm_offload_adamw oo;
    int64_t n;               /* parameters */
} fm_oa_fixture;

/* Builds the pair for `bucket` parameters per bucket, `slots` staging slots and offload fraction
 * F in (0, 1] (--optimizer-offload-fraction; valid arguments: the bad ones are test_offload_adamw's
 * test_bad_args); every step asserted. */
static inline void fm_oa_fixture_create_f(fm_oa_fixture *f, const fm_config *c, fm_backend *be, int64_t bucket,
                                          int slots, bool bf16, double F) {
    FM_ASSERT(fm_model_create(&f->ref, c, *be) == FM_OK && fm_model_create(&f->off, c, *be) == FM_OK);
    f->n = f->ref.p.n_params;
    fm_adamw_config(&f->ra, 0.9, 0.95, 1e-8, 0.1, bf16);
    fm_adamw_config(&f->oa, 0.9, 0.95, 1e-8, 0.1, bf16);
    FM_ASSERT(fm_param_store_create(&f->rps, &f->ref, fm_adamw_ops.state_bytes(&f->ra, f->n)) == FM_OK);
    fm_adamw_ops.init(&f->ra, &f->rps, be);
    FM_ASSERT(fm_offload_adamw_create_split(&f->oo, &f->oa, f->n, bucket, slots, F, be) == FM_OK);
    FM_ASSERT(fm_param_store_create_host_master(&f->ops, &f->off, fm_offload_adamw_ops.state_bytes(&f->oo, f->n),
                                                f->oo.h_master) == FM_OK);
    fm_offload_adamw_ops.init(&f->oo, &f->ops, be);
}

/* The same with every bucket streamed (F = 1). */
static inline void fm_oa_fixture_create(fm_oa_fixture *f, const fm_config *c, fm_backend *be, int64_t bucket,
                                        int slots, bool bf16) {
    fm_oa_fixture_create_f(f, c, be, bucket, slots, bf16, 1.0);
}

static inline void fm_oa_fixture_free(fm_oa_fixture *f) {
    fm_param_store_free(&f->ops);
    fm_param_store_free(&f->rps);
    fm_offload_adamw_free(&f->oo);
    fm_model_free(&f->off);
    fm_model_free(&f->ref);
}
#endif
