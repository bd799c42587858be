/* Ring-DTP: the linear cross-entropy (fm_linear_ce.h) over the P ranks of a communicator, each
 * rank keeping its own N_r tokens and one vocabulary shard of the LM head, never an N x V tensor
 * and never the whole head on one rank (DESIGN.md §2 "vocabulary projection", §6). Source:
 * Ring-DTP (arXiv 2609.14306, REFERENCES.md "Ring form across P ranks"): over P rounds every
 * token block meets every shard once; the activations move when the tokens per rank are at most
 * a shard's rows (N <= V/P), otherwise the weight shards move. Each meeting runs the one-rank
 * operator's block steps (fm_linear_ce_fold_range / fm_linear_ce_grad_range) on the backend's
 * ops; the ring only decides who holds what and moves it.
 *
 * Shards: with S = ceil(V / P), rank r holds the head rows [r S, min(V, (r+1) S)) (HF layout
 * [vocab, hidden]); the last shards are smaller and may be empty (V = 9, P = 4: 3, 3, 3, 0).
 * fm_lce_ring_shard gives the range. Targets are global vocabulary ids in [0, V).
 *
 * The objective is fm_linear_ce's, summed over every rank's tokens: per token
 *   loss_t = lse_t - l_{t,y_t},  J = sum over all ranks' tokens of w_t (loss_t + z_loss lse_t^2),
 * with lse over the whole vocabulary; the gradients are grad_scale * dJ/dh for the rank's own
 * tokens and grad_scale * dJ/dW for its own shard. Exact against fm_linear_ce run on one rank
 * over all tokens with the whole head, up to floating-point reassociation (the shards are folded
 * in ring order; CPU fp32: ~1e-7 relative); with P = 1 the same op sequence as fm_linear_ce, so
 * the same bits.
 *
 * Modes (per call, the same on every rank):
 *   ACTIVATIONS  the token blocks travel: rank r's message is its targets, token weights, the
 *                running state m, z, tgt (and ent) [N_r] and h [N_r,H], in backward also its dh
 *                accumulator [N_r,H]. Forward: P rounds (P - 1 hops to the successor r + 1),
 *                the last leaving each block's finished state one rank short of home; backward
 *                goes the other way (P - 1 hops to the predecessor) and ends at home with dh;
 *                a forward-only call instead sends the state home in one more, small hop.
 *   WEIGHTS      the shards travel: W_s [rows_s,H], in backward also its dW accumulator
 *                [rows_s,H]. Forward: P rounds (P - 1 hops to the successor), each rank folding
 *                the visiting shard into its own tokens' state [N_r]; backward: P rounds the
 *                other way (P - 1 hops), each shard ending at home with the others'
 *                contributions, added to dW.
 *   AUTO         ACTIVATIONS when max_r N_r <= S (the largest shard's rows), else WEIGHTS: the
 *                smaller of the two messages moves (fm_lce_ring_choose).
 * Messages go through fm_comm_all_to_all_v with bytes for the successor (or predecessor) only
 * and zero counts elsewhere (the communicator table has no send/recv): one collective per hop.
 * Byte counts per hop must fit in int for the MPI communicator (FM_ERR_ARG otherwise).
 *
 * The trainer runs it under --vocab-parallel ring (README "Vocabulary parallelism"): the model's
 * head (model/fm_head.c) calls it over the world with the rank's shard rows of the LM head and
 * of its gradient, and the vocabulary live set is laid out for fm_linear_ce_ring_bound_bytes
 * (fm_model_vocab_ring_bytes), which the plan prints and --report-memory's high-water mark meets.
 */
#ifndef FM_LINEAR_CE_RING_H
#define FM_LINEAR_CE_RING_H

#include "../comm/fm_comm.h"
#include "fm_linear_ce.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The most ranks a ring takes (its host-side count arrays live on the stack). */
#define FM_LCE_RING_MAX_RANKS 512

typedef enum fm_lce_ring_mode {
    FM_LCE_RING_AUTO = 0,    /* the rule above */
    FM_LCE_RING_ACTIVATIONS, /* move the token blocks */
    FM_LCE_RING_WEIGHTS,     /* move the weight shards */
} fm_lce_ring_mode;

/* "auto", "activations", "weights" ("?" otherwise). */
const char *fm_lce_ring_mode_name(fm_lce_ring_mode mode);

typedef struct fm_lce_ring_opts {
    fm_lce_opts lce;       /* blocks, ignore_index, z-loss, and for this rank's OWN tokens: token
                              weights [N_r], out_logprob [N_r], out_entropy [N_r] (fm_linear_ce.h) */
    fm_lce_ring_mode mode; /* AUTO, or force one mode (tests, experiments) */
    double timeout_s;      /* each collective's timeout (fm_comm.h); 0: the communicator's */
} fm_lce_ring_opts;

/* fm_lce_opts_default() and AUTO, the communicator's timeout. */
fm_lce_ring_opts fm_lce_ring_opts_default(void);

/* Rank r's shard of a V-row head over P ranks: rows [*first_row, *first_row + *rows). */
void fm_lce_ring_shard(int64_t V, int P, int r, int64_t *first_row, int64_t *rows);

/* The mode AUTO picks for the largest rank's token count n_max: ACTIVATIONS when
 * n_max <= ceil(V / P), else WEIGHTS. */
fm_lce_ring_mode fm_lce_ring_choose(int64_t n_max, int64_t V, int P);

/* The bound of fm_linear_ce_ring: bytes it takes from its workspace arena, at most, on a rank of
 * a group whose largest token count is n_max, for the planner. With Nb = min(block_tokens,
 * n_max), Vb = min(block_vocab, S), S = ceil(V / P), a = the act element's bytes, round() as
 * fm_arena_alloc rounds, and B = 2 buffers when P > 1 (the message in flight and the receive
 * buffer), else 1 (ACTIVATIONS: the state's home) or 0 (WEIGHTS):
 *   strip       = fm_linear_ce_strip_bytes_a(Nb, Vb, a)          (the one-rank op's strip; its
 *                 act copy, where a != 4, only when dh or dW is wanted)
 *   ACTIVATIONS : strip + B * msg(n_max), msg(n) = round(4n) targets [+ round(4n) weights]
 *                 + (3 [+ 1 entropy]) round(4n) state + round(n H a) h [+ round(n H a) dh]
 *   WEIGHTS     : strip + B * (round(S H a) W_s [+ round(S H a) dW accumulator])
 *                 + (3 [+ 1 entropy]) round(4 n_max) state of the own tokens
 * Brackets: only with token weights / out_entropy in opts, dh / dW wanted. mode AUTO: the mode
 * fm_lce_ring_choose(n_max, V, P) picks. opts NULL: defaults (no weights, no entropy). 0 when
 * n_max == 0 (nothing is taken). Independent of the other ranks' counts and of N_total. */
size_t fm_linear_ce_ring_bound_bytes(fm_lce_ring_mode mode, int64_t n_max, int64_t H, int64_t V, int P,
                                     bool want_dh, bool want_dW, const fm_lce_opts *opts);
/* The same for an act element of act_bytes bytes (to plan another build's run). */
size_t fm_linear_ce_ring_bound_bytes_a(fm_lce_ring_mode mode, int64_t n_max, int64_t H, int64_t V, int P,
                                       bool want_dh, bool want_dW, const fm_lce_opts *opts, size_t act_bytes);

/* What a call did (optional output). */
typedef struct fm_lce_ring_info {
    fm_lce_ring_mode mode; /* the mode run (never AUTO) */
    int64_t n_total;       /* tokens over the group */
    int64_t n_max;         /* the largest rank's tokens */
    int64_t shard_rows;    /* S = ceil(V / P) */
    int hops;              /* ring exchanges this call made */
    size_t bytes_sent;     /* bytes this rank sent in them */
    size_t ws_bytes;       /* bytes it took from ws (<= fm_linear_ce_ring_bound_bytes) */
} fm_lce_ring_info;

/* The linear cross-entropy over the ranks of `comm` (a collective call: every rank calls it with
 * the same V, H, options and which gradients it wants; a rank with N = 0 takes part).
 *   loss     [N] fp32 out, ASSIGNED: this rank's tokens' loss_t (0 where ignored); NULL if N = 0
 *   dh       [N,H] fm_act out, ASSIGNED: grad_scale dJ/dh of this rank's tokens; NULL: not computed
 *   dW_shard [rows,H] fm_act out, ACCUMULATED (+=): grad_scale dJ/dW of this rank's shard
 *            (fm_lce_ring_shard's rows); NULL: not computed (both NULL: forward only)
 *   h        [N,H] fm_act, this rank's final-norm output; W_shard [rows,H] fm_act, its shard
 *   targets  [N] int32 global ids in [0,V) or opts->lce.ignore_index
 *   N        this rank's tokens (>= 0; may differ per rank); H, V: hidden size, WHOLE vocabulary
 *   grad_scale multiplies every gradient (e.g. 1 / the group's valid tokens:
 *            fm_linear_ce_ring_valid_count)
 *   sums     [2] double, backend memory, ASSIGNED on every rank: the GROUP's sum of w_t loss_t
 *            and of w_t lse_t^2 over non-ignored tokens (fm_linear_ce's sums, all-reduced);
 *            read after a sync point (fm_linear_ce_read)
 *   info     optional, filled on success
 * Memory: buffers are backend memory and the communicator's memory must be the backend's (a
 * communicator created over `be`, or a host-memory communicator on a host-memory backend such
 * as the CPU). Scratch from `ws` (fm_arena_alloc, at most fm_linear_ce_ring_bound_bytes with
 * the group's largest N), ws->used restored on return, so ws->high records the peak. With a
 * measuring arena it still makes the first exchange (a collective), records the allocations
 * and computes nothing. Never calls malloc.
 * Host side: one all-reduce of host int64 values (every rank's N, the agreed arguments), then
 * one all_to_all_v per hop and one all-reduce of sums. Over device memory with a non-NCCL
 * communicator (host-staged MPI) each hop first waits for the compute stream.
 * Errors (the same status on every rank): FM_ERR_ARG (this rank's arguments are bad — N < 0,
 * H < 1, V < 1, a NULL buffer that must hold data, sums NULL, the communicator's memory is host
 * memory over a device backend — or another rank's are: the message names the first such rank;
 * or V, H, the mode, the blocks, ignore_index, z_loss, token weights or out_entropy given, or
 * the gradients wanted differ between ranks; or P > FM_LCE_RING_MAX_RANKS), and the
 * communicator's errors (FM_ERR_IO: a transport error or timeout, naming rank and collective).
 * After a communicator error the outputs are undefined. An arena overrun aborts (a planning
 * bug), as in fm_linear_ce. */
fm_status fm_linear_ce_ring(const fm_backend *be, const fm_comm *comm, fm_arena *ws, float *loss, fm_act *dh,
                            fm_act *dW_shard, const fm_act *h, const fm_act *W_shard, const int32_t *targets,
                            int64_t N, int64_t H, int64_t V, float grad_scale, const fm_lce_ring_opts *opts,
                            double *sums, fm_lce_ring_info *info);

/* The group's count of targets other than ignore_index: targets_host [N] int32 in HOST memory
 * (the data loader's copy), summed over comm (a collective call; fm_comm_allreduce_sum_i64).
 * The trainer needs it before the ring, for grad_scale = 1 / valid. Errors: FM_ERR_ARG (N < 0,
 * targets_host NULL with N > 0, valid NULL), the communicator's. */
fm_status fm_linear_ce_ring_valid_count(const fm_comm *comm, const int32_t *targets_host, int64_t N,
                                        int32_t ignore_index, double timeout_s, int64_t *valid);

#ifdef __cplusplus
}
#endif
#endif
