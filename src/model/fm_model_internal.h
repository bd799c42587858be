/* Internals shared by the model's files (not a public header). */
#ifndef FM_MODEL_INTERNAL_H
#define FM_MODEL_INTERNAL_H
#include "fm_model.h"

/* Frees the activation arenas, the layer tables and the host staging of the current layout
 * (fm_layout.c); safe on a model with no layout. */
void fm_model_free_layout(fm_model *m);

#endif
