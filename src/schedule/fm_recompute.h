/* Recompute, a schedule policy: which layers keep only their input boundary and run their
 * forward again in backward (Chen et al. 2016, arXiv 1604.06174; Korthikanti et al. 2022,
 * arXiv 2205.05198 §4 for per-layer selection; Primus/Megatron's per-layer recompute IDs).
 *
 * A layer's policy is one of
 *   none            its own saved set; nothing runs again;
 *   full            the shared saved set; backward runs the whole layer forward again;
 *   keep-attention  the shared saved set, but the attention output att [N, H_attn] and its
 *                   log-sum-exp lse [B, heads, T] are the layer's own and persist to backward;
 *                   backward runs the norms, projections, QK-norm, RoPE and the MoE block again
 *                   but never the attention forward (the inverse of Korthikanti et al.'s
 *                   selective recompute: at long context attention is most of the step, and its
 *                   output is small next to the MoE block's saved state).
 *
 * Bound (the layer-activations live set, DESIGN.md §2): a kept layer holds its own saved set;
 * all recomputed layers share one; a keep-attention layer adds its own att and lse, so
 *   layer activations = (L - r + (r > 0 ? 1 : 0)) x (one layer's saved set)
 *                     + r_att x (round(N x H_attn x b) + round(B x heads x T x 4))
 * with r recomputed layers of which r_att keep attention, b the activation's bytes and round
 * the arenas' rounding (fm_arena_round); the same count of saved dispatches for the plain MoE
 * twin. Gradients are bit-identical to no recompute: the recomputed forward is the same
 * arithmetic on the same boundary, and a kept attention output is the one the forward made. */
#ifndef FM_RECOMPUTE_H
#define FM_RECOMPUTE_H

#include "../core/fm_core.h"

typedef struct fm_recompute_policy {
    const bool *layers; /* [L]: true = recomputed in backward; NULL = none */
    int64_t L;
    const bool *keep_attention; /* [L] or NULL (none): a recomputed layer with true keeps its
                                   attention output and lse (keep-attention); ignored where
                                   layers[l] is false */
} fm_recompute_policy;

/* Parses "none", "full" or comma-separated layer ids in [0, L) (e.g. "0,2,5") into rc [L].
 * NULL or "" is none. Errors: FM_ERR_ARG naming the bad item (not a number, out of range, listed
 * twice, trailing comma). */
fm_status fm_recompute_parse(const char *spec, int64_t L, bool *rc);

/* Layers recomputed, and the saved sets the policy keeps: L - r + (r > 0). */
int64_t fm_recompute_count(const fm_recompute_policy *p);
int64_t fm_recompute_saved_sets(const fm_recompute_policy *p);
/* Recomputed layers that keep their attention (r_att of the bound). */
int64_t fm_recompute_keep_attention_count(const fm_recompute_policy *p);

/* The keep-attention flag (--recompute-keep-attention): fills keep [L] with `on` for every
 * layer. Errors: FM_ERR_ARG when on and the recompute spec was given and recomputes no layer
 * ("--recompute none": nothing to keep attention for). `spec_given`: the user named
 * --recompute (else the planner chooses the layers and keep-attention applies to its choice). */
fm_status fm_recompute_keep_attention_fill(bool on, bool spec_given, const bool *rc, int64_t L, bool *keep);

static inline bool fm_recompute_layer(const fm_recompute_policy *p, int64_t l) { return p->layers && p->layers[l]; }
/* Layer l is recomputed and keeps its attention (its recompute skips the attention forward). */
static inline bool fm_recompute_keeps_attention(const fm_recompute_policy *p, int64_t l) {
    return fm_recompute_layer(p, l) && p->keep_attention && p->keep_attention[l];
}

#endif
