/* Least-loaded expert placement for one dispatch chunk (LLEP, arXiv 2601.17111), as the
 * expert-parallel MoE (fm_moe_ep.h) uses it: a pure host computation over the chunk's routed
 * load per expert, which every rank of the ep group holds (the agreed count table), so every
 * rank computes the same plan and no extra collective decides it.
 *
 * Rule: with T rows routed in the chunk over P ranks, if the busiest rank's native load (the
 * rows of its own E/P experts) is at most lambda * T / P, nothing moves (plain expert
 * parallelism). Otherwise, with capacity m = ceil(alpha * T / P) rows per rank, the experts are
 * visited from most to least loaded (ties: lower index first); each expert's native rank keeps
 * what fits under m (rows [0, keep) of the expert, in source-major route order), and the rest is
 * spilled in contiguous ranges to the least-loaded ranks (ties: lower rank), each range
 * min(rest, m - load of the helper) rows, raised to min_piece when smaller (no piece under
 * min_piece rows; a rest under min_piece stays native). A helper takes at most max_foreign
 * experts per chunk, and never more rows than keep it within R_max (its own experts' rows
 * counted in full), so the receive buffer bound of plain EP (ep * c * min(k, E/ep) rows) still
 * holds. What no helper can take stays native. The native rank's rows of an expert are one
 * range [0, native_len), its helpers' ranges follow in the order they were placed. Helpers
 * receive the expert's weights from the native rank and send its weight gradients back. */
#ifndef FM_MOE_LLEP_H
#define FM_MOE_LLEP_H

#include "../core/fm_arena.h"

/* The placement options (fm_moe_ep_ws_layout takes them; on = false: plain EP always). */
typedef struct fm_llep_opts {
    bool on;
    double lambda;       /* imbalance that triggers placement (1.3) */
    double alpha;        /* capacity per rank as a multiple of the mean load (1.0) */
    int64_t min_piece;   /* smallest spilled range, rows (the paper's 1024 tokens; >= 1) */
    int64_t max_foreign; /* experts a rank may host for others in one chunk (F >= 1) */
} fm_llep_opts;

/* The paper's defaults: on, lambda 1.3, alpha 1.0, min_piece 1024, max_foreign 2. */
fm_llep_opts fm_llep_defaults(void);

/* A chunk's placement (host memory, laid out once for P ranks, E experts, F = max_foreign). */
typedef struct fm_llep_plan {
    int P, F;
    int64_t E, El;
    bool spill;             /* false: every expert's rows stay with its native rank */
    int64_t *native_len;    /* [E]: rows [0, native_len[e]) of expert e stay native */
    int64_t *piece_start;   /* [E+1]: expert e's spilled ranges are pieces [piece_start[e], piece_start[e+1]) */
    int32_t *piece_rank;    /* [P*F]: the helper of a piece */
    int64_t *piece_len;     /* [P*F]: its rows (ranges follow native_len in piece order) */
    int32_t *nforeign;      /* [P]: experts hosted by each rank */
    int32_t *foreign;       /* [P*F]: rank h's hosted experts, ascending, at foreign[h*F ..] */
    int64_t *rows;          /* [P]: rows each rank computes in this chunk */
    int64_t *work;          /* [2P + E] scratch */
    int32_t *tmp_expert, *tmp_rank; /* [P*F] scratch: pieces in placing order */
    int64_t *tmp_len;       /* [P*F] */
} fm_llep_plan;

/* Host bytes of a plan (each array rounded as fm_arena_alloc rounds). */
size_t fm_llep_plan_bytes(int P, int64_t E, int64_t F);
/* Lays out a plan for P ranks, E experts (E % P == 0), F hosted experts per rank, from `host`. */
void fm_llep_plan_layout(fm_llep_plan *pl, fm_arena *host, int P, int64_t E, int64_t F);

/* Places one chunk: load [E] rows per expert (>= 0), rows_max the receive bound per rank. */
void fm_llep_place(fm_llep_plan *pl, const int64_t *load, int64_t rows_max, const fm_llep_opts *o);

/* The rows of expert e that rank q computes: the range [*start, *start + *len) of e's rows in
 * source-major route order (0 rows when q does not compute e). */
void fm_llep_range(const fm_llep_plan *pl, int64_t e, int q, int64_t *start, int64_t *len);

/* Rank q's compute slots: its native experts q*El .. (q+1)*El-1, then its hosted experts in
 * ascending order; slot s's expert (s < El + nforeign[q]). */
static inline int64_t fm_llep_slot_expert(const fm_llep_plan *pl, int q, int64_t s) {
    return s < pl->El ? q * pl->El + s : pl->foreign[(int64_t)q * pl->F + (s - pl->El)];
}

#endif
