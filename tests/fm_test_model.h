/* Models for tests: a model and its parameter store (train/fm_param_store.h: the model state,
 * weights and grads only, no optimizer) created and freed together. */
#ifndef FM_TEST_MODEL_H
#define FM_TEST_MODEL_H
#include "model/fm_model.h"
#include "train/fm_param_store.h"

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
