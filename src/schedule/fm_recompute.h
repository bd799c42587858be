/* Recompute, a schedule policy: which layers keep only their input boundary and run their
 * forward again in backward (Chen et al. 2016, arXiv 1604.06174; Korthikanti et al. 2022,
 * arXiv 2205.05198 §4 for per-layer selection; Primus/Megatron's per-layer recompute IDs).
 *
 * Bound (the layer-activations live set, DESIGN.md §2): a kept layer holds its own saved set;
 * all recomputed layers share one, so
 *   layer activations = (L - r + (r > 0 ? 1 : 0)) x (one layer's saved set)
 * with r recomputed layers (and the same count of saved dispatches for the plain MoE twin).
 * Gradients are bit-identical to no recompute: the recomputed forward is the same arithmetic on
 * the same boundary. */
#ifndef FM_RECOMPUTE_H
#define FM_RECOMPUTE_H

#include "../core/fm_core.h"

typedef struct fm_recompute_policy {
    const bool *layers; /* [L]: true = recomputed in backward; NULL = none */
    int64_t L;
} fm_recompute_policy;

/* Parses "none", "full" or comma-separated layer ids in [0, L) (e.g. "0,2,5") into rc [L].
 * NULL or "" is none. Errors: FM_ERR_ARG naming the bad item (not a number, out of range, listed
 * twice, trailing comma). */
fm_status fm_recompute_parse(const char *spec, int64_t L, bool *rc);

/* Layers recomputed, and the saved sets the policy keeps: L - r + (r > 0). */
int64_t fm_recompute_count(const fm_recompute_policy *p);
int64_t fm_recompute_saved_sets(const fm_recompute_policy *p);

static inline bool fm_recompute_layer(const fm_recompute_policy *p, int64_t l) { return p->layers && p->layers[l]; }

#endif
