/* Models for tests: a model and its parameter store (train/fm_param_store.h: the model state,
 * weights and grads only, no optimizer) created and freed together. */
#ifndef FM_TEST_MODEL_H
#define FM_TEST_MODEL_H
#include <stdio.h>
#include <string.h>

#include "core/fm_rng.h"
#include "model/fm_model.h"
#include "train/fm_param_store.h"

/* The CPU tests' small model of each model_type: vocabulary 40, hidden 24, 4 heads of 6 (2 kv
 * heads), 5 experts of width 12, top-k k, `layers` layers; large router-loss coefficients so
 * their gradients are visible, and large weights (std 0.3) so gradients sit well above fp32
 * noise. tied: the LM head is the embedding. */
static inline fm_config fm_test_small_config(fm_model_type t, int64_t layers, bool tied, int64_t k) {
    fm_config c;
    memset(&c, 0, sizeof c);
    c.model_type = t;
    snprintf(c.model_type_name, sizeof c.model_type_name, "%s",
             t == FM_MODEL_QWEN3_MOE ? "qwen3_moe" : t == FM_MODEL_OLMOE ? "olmoe" : "mixtral");
    c.vocab_size = 40;
    c.hidden_size = 24;
    c.moe_intermediate_size = 12;
    c.num_hidden_layers = layers;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 6;
    c.max_position_embeddings = 64;
    c.num_experts = 5;
    c.num_experts_per_tok = k;
    c.rope_theta = 10000;
    c.rms_norm_eps = 1e-5;
    c.norm_topk_prob = t != FM_MODEL_OLMOE;
    c.tie_word_embeddings = tied;
    c.router_aux_loss_coef = 0.3;
    c.router_z_loss_coef = 0.05;
    c.initializer_range = 0.3;
    c.qk_norm = t == FM_MODEL_QWEN3_MOE ? FM_QK_NORM_PER_HEAD : t == FM_MODEL_OLMOE ? FM_QK_NORM_FULL : FM_QK_NORM_NONE;
    return c;
}

/* Makes c's layers dense as qwen3_moe's decoder_sparse_step 2 and mlp_only_layers [0] do
 * (layers 0, 2, 4, ... dense; model/fm_config.h), the dense MLP of width Id. */
static inline void fm_test_dense_layers(fm_config *c, int64_t Id) {
    c->decoder_sparse_step = 2;
    memset(c->mlp_only_mask, 0, sizeof c->mlp_only_mask);
    c->mlp_only_mask[0] = 1;
    c->dense_intermediate_size = Id;
}

/* The batch of model m in the tests (model/fm_batch.h: the batch is an argument of the step, not
 * a field of the model): one host batch per model address, of m's active shape (allocated again
 * when the shape changes), alive until the test ends. */
#define FM_TEST_BATCH_SLOTS 32
static struct {
    const fm_model *m;
    fm_batch b;
} fm_test_batch_slots[FM_TEST_BATCH_SLOTS];

static inline fm_batch *fm_test_batch_of(const fm_model *m) {
    int free_slot = -1;
    for (int i = 0; i < FM_TEST_BATCH_SLOTS; i++) {
        if (fm_test_batch_slots[i].m == m) {
            fm_batch *b = &fm_test_batch_slots[i].b;
            if (b->B != m->a.B || b->T != m->a.T) {
                fm_batch_free(b);
                FM_ASSERT(fm_batch_alloc(b, m->a.B, m->a.T, true) == FM_OK);
            }
            return b;
        }
        if (!fm_test_batch_slots[i].m && free_slot < 0) free_slot = i;
    }
    FM_ASSERT(free_slot >= 0); /* more than FM_TEST_BATCH_SLOTS model addresses */
    fm_test_batch_slots[free_slot].m = m;
    FM_ASSERT(fm_batch_alloc(&fm_test_batch_slots[free_slot].b, m->a.B, m->a.T, true) == FM_OK);
    return &fm_test_batch_slots[free_slot].b;
}

/* m's test batch without its targets (a forward for the logits only). */
static inline fm_batch fm_test_batch_tokens(const fm_model *m) {
    fm_batch b = *fm_test_batch_of(m);
    b.targets = NULL;
    return b;
}

/* Random tokens and targets of m's batch (fm_test_batch_of) from `seed`; target `ignored` (-1:
 * none) is -100. */
static inline void fm_test_fill_batch(fm_model *m, uint64_t seed, int64_t ignored) {
    fm_batch *b = fm_test_batch_of(m);
    fm_rng r;
    fm_rng_seed(&r, seed);
    for (int64_t i = 0; i < m->a.N; i++) {
        b->tokens[i] = (int32_t)fm_rng_below(&r, (uint64_t)m->cfg.vocab_size);
        b->targets[i] = (int32_t)fm_rng_below(&r, (uint64_t)m->cfg.vocab_size);
    }
    if (ignored >= 0) b->targets[ignored] = -100;
}

#define FM_TEST_MODEL_SLOTS 16
static struct {
    const fm_model *m;
    fm_param_store ps;
} fm_test_model_slots[FM_TEST_MODEL_SLOTS];

/* fm_model_create plus a parameter store bound into it. */
static inline fm_status fm_test_model_create(fm_model *m, const fm_config *c, fm_backend be) {
    FM_TRY(fm_model_create(m, c, be));
    for (int i = 0; i < FM_TEST_MODEL_SLOTS; i++)
        if (!fm_test_model_slots[i].m) {
            fm_status s = fm_param_store_create(&fm_test_model_slots[i].ps, m, 0);
            if (s) {
                fm_model_free(m);
                return s;
            }
            fm_test_model_slots[i].m = m;
            return FM_OK;
        }
    FM_ASSERT(!"more than FM_TEST_MODEL_SLOTS test models alive");
    return FM_ERR_NOMEM;
}

/* fm_model_free and the store's free. */
static inline void fm_test_model_free(fm_model *m) {
    for (int i = 0; i < FM_TEST_MODEL_SLOTS; i++)
        if (fm_test_model_slots[i].m == m) {
            fm_param_store_free(&fm_test_model_slots[i].ps);
            fm_test_model_slots[i].m = NULL;
        }
    fm_model_free(m);
}
#endif
