/* Linear cross-entropy with an online log-sum-exp: the LM head (logits = h W^T) fused with the
 * softmax cross-entropy, never holding the N x V logits (DESIGN.md §2, "vocabulary projection").
 * Tokens go in blocks of Nb, the vocabulary in blocks of Vb; the only scratch is one Nb x Vb fp32
 * strip and O(Nb) per-token state, whatever N and V. Sources: Wijmans et al., "Cut Your Losses in
 * Large-Vocabulary Language Models" (arXiv 2411.09009); Liger-Kernel's fused linear
 * cross-entropy (z-loss, ignore_index); the online softmax of Milakov & Gimelshein 2018
 * (arXiv 1805.02867). The plain twin, fm_linear_ce_plain, builds the full logits and is used by
 * tests and --verify.
 *
 * Objective, per token t with target y_t != ignore_index and weight w_t:
 *   lse_t  = log sum_v exp(l_tv),  l_tv = h_t . W_v     (natural log, fp32 logits)
 *   loss_t = lse_t - l_{t,y_t}                           (nats)
 *   J      = sum_t w_t (loss_t + z_loss * lse_t^2)
 * and the gradients written are grad_scale * dJ/dh, grad_scale * dJ/dW. Ignored tokens add
 * nothing to J and get zero gradient rows.
 */
#ifndef FM_LINEAR_CE_H
#define FM_LINEAR_CE_H

#include "../backend/fm_backend.h"
#include "../core/fm_arena.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Block sizes used when fm_lce_opts asks for 0 (or opts is NULL): 1024 tokens x 4096 vocabulary
 * entries, a 16 MiB fp32 strip. (CPU, H 512, V 32768, 2 threads: Nb 1024 ran the GEMMs as fast
 * as the plain twin's, Nb 256 at ~60% of that, the dW GEMM's K being Nb.) */
#define FM_LCE_DEFAULT_BLOCK_TOKENS 1024
#define FM_LCE_DEFAULT_BLOCK_VOCAB 4096

typedef struct fm_lce_opts {
    int64_t block_tokens, block_vocab; /* Nb, Vb (tokens, vocabulary entries); <= 0: default */
    int32_t ignore_index;              /* targets equal to it are not counted (HF: -100) */
    float z_loss;                      /* z-loss coefficient s: adds s * lse^2 per token; 0: off */
    const float *token_weight;         /* [N] fp32 per-token loss weights w_t; NULL: all 1 */
    float *out_logprob;                /* [N] fp32 log p(target) = -loss_t (0 if ignored); NULL: skip */
    float *out_entropy;                /* [N] fp32 softmax entropy (nats), every token; NULL: skip */
    /* The k largest log-probs of every token and their ids (NeMo-RL's and vLLM's top-k log-probs),
     * from a running top-k of the logits merged across the vocabulary blocks (lce_topk_fold: never
     * N x V; ties to the lower id), then log p = logit - lse as the target's log-prob is formed
     * (lce_topk_finalize). topk 0: off. With topk >= 1 both outputs are [N, topk], ASSIGNED, every
     * token (ignored ones too). One rank only (the ring does not take them). */
    int64_t topk;
    float *out_topk_logprob;           /* [N, topk] fp32 (nats), decreasing per token */
    int32_t *out_topk_id;              /* [N, topk] int32 vocabulary ids */
    /* An entropy term in the objective (the RL head's entropy bonus): J += sum_t ent_weight_t H_t,
     * H_t the softmax entropy of token t's logits; its gradient (lce_strip_grad_ent: -p (log p + H)
     * per logit) joins the backward. ent_value [N] fp32: H_t as the forward computed it (out_entropy
     * of a forward over the same h and W). Both NULL: off. One rank only. */
    const float *ent_weight, *ent_value;
} fm_lce_opts;

/* Options with defaults: default blocks, ignore_index -100, no z-loss, no weights, no extra
 * outputs. */
fm_lce_opts fm_lce_opts_default(void);

/* The bound of fm_linear_ce (bytes it takes from its workspace arena, at most), for the planner:
 * one Nb x Vb fp32 strip and four [Nb] fp32 per-token vectors, each rounded as fm_arena_alloc
 * rounds. The formula is written next to its definition in fm_linear_ce.c. Independent of N and
 * V (the run uses min(Nb, N) x min(Vb, V), never more). Block sizes <= 0 mean the defaults. */
size_t fm_linear_ce_bound_bytes(int64_t block_tokens, int64_t block_vocab);
/* The same for an activation element of act_bytes bytes (to plan another build's run). */
size_t fm_linear_ce_bound_bytes_a(int64_t block_tokens, int64_t block_vocab, size_t act_bytes);
/* What one fm_linear_ce call over N >= 0 tokens and a V >= 1 entry vocabulary takes from its
 * arena: the bound above with the blocks clamped to min(Nb, N) x min(Vb, V), as the call clamps
 * them, and the entropy vector only when want_entropy (the call takes it only when
 * opts->out_entropy is set). With at least one full token block the call's high-water mark is
 * this (the last [Nb] vector's 64-byte rounding aside), so a planner sized by it has no slack;
 * never more than fm_linear_ce_bound_bytes_a. Block sizes <= 0 mean the defaults. */
size_t fm_linear_ce_call_bytes_a(int64_t block_tokens, int64_t block_vocab, int64_t N, int64_t V, bool want_entropy,
                                 size_t act_bytes);

/* What the top-k outputs (fm_lce_opts.topk = k >= 1) add to one call over N tokens: the running
 * top-k of a token block, topv [Nb',k] fp32 and topi [Nb',k] int32 with Nb' = min(Nb, N), each
 * rounded as fm_arena_alloc rounds; 0 for k <= 0. (The plain twin takes them for all N.) */
size_t fm_linear_ce_topk_bytes(int64_t block_tokens, int64_t N, int64_t k);

/* Bytes the plain twin takes from its arena for N tokens and a V-entry vocabulary: the N x V
 * fp32 logits and their N x V fp32 gradient, plus the four [N] fp32 per-token vectors, each
 * arena-rounded. */
size_t fm_linear_ce_plain_bytes(int64_t N, int64_t V);

/* Linear cross-entropy, blocked (the bounded operator).
 *   loss   [N]   fp32 out, ASSIGNED: loss_t = lse_t - l_{t,y_t} (nats), 0 for ignored tokens
 *   dh     [N,H] fm_act out, ASSIGNED: grad_scale * dJ/dh (ignored rows 0); NULL: not computed
 *   dW     [V,H] fm_act out, ACCUMULATED (+=): grad_scale * dJ/dW; NULL: not computed
 *          (dh and dW both NULL: forward only, one pass)
 *   h      [N,H] fm_act, the final-norm output; W [V,H] fm_act, the LM head (HF layout [vocab, hidden])
 *   targets [N] int32 in [0,V) or opts->ignore_index
 *   grad_scale multiplies every gradient (e.g. 1 / valid tokens / accumulation steps)
 *   opts   block sizes, ignore_index, z-loss, weights, optional outputs; NULL: defaults
 *   sums   [2] double, backend memory, ASSIGNED: sums[0] = sum over non-ignored tokens of
 *          w_t * loss_t (nats; without the z term), sums[1] = sum over them of w_t * lse_t^2 (the
 *          z term is z_loss * sums[1]); read them after a sync point (fm_linear_ce_read).
 * Issues work only: no host synchronization (DESIGN.md §4).
 * Scratch: taken from `ws` with fm_arena_alloc (at most fm_linear_ce_bound_bytes), and ws->used
 * is set back to its value at entry before returning, so ws->high records the operator's peak.
 * Never calls malloc. With a measuring arena (fm_arena_init_measure) it only records the
 * allocations and computes nothing.
 * Errors: none returned; an arena overrun aborts (a planning bug), targets outside [0,V) other
 * than ignore_index and negative sizes are asserted.
 * Algorithm: per token block, pass 1 forms each strip S = h_blk W_blk^T (gemm) and folds it
 * into the running max, sum and target logit (lce_fold), then lce_finalize writes the per-token
 * outputs; pass 2 recomputes each strip, turns it into G = grad_scale w ((1 + 2 s lse) p -
 * onehot) (lce_strip_grad), and contracts dh_blk += G W_blk, dW_blk += G^T h_blk (gemm).
 * Cost: 4 N V H multiply-adds with backward (the logits twice), 1 without. */
void fm_linear_ce(const fm_backend *be, fm_arena *ws, float *loss, fm_act *dh, fm_act *dW,
                  const fm_act *h, const fm_act *W, const int32_t *targets, int64_t N, int64_t H,
                  int64_t V, float grad_scale, const fm_lce_opts *opts, double *sums);

/* The plain twin: the same arguments, outputs and conventions, computed by materializing the
 * full N x V logits and their N x V gradient in `ws` (fm_linear_ce_plain_bytes(N, V)); block
 * sizes in opts are ignored. The same strip ops run on one N x V block, then dh = G W and
 * dW += G^T h as single gemms. Equal to fm_linear_ce up to floating-point reassociation
 * (CPU fp32: relative 1e-6). */
void fm_linear_ce_plain(const fm_backend *be, fm_arena *ws, float *loss, fm_act *dh, fm_act *dW,
                        const fm_act *h, const fm_act *W, const int32_t *targets, int64_t N,
                        int64_t H, int64_t V, float grad_scale, const fm_lce_opts *opts,
                        double *sums);

/* ---- block-level steps (fm_linear_ce is built from them; the vocabulary ring,
 * fm_linear_ce_ring.h, runs them on each shard it meets) ------------------------------------- */

/* The scratch of one token block x vocabulary block: S [nb,vb] fp32 (the logits, then in place
 * their gradient) and, where fm_act is not fp32 and backward is wanted, Sa [nb,vb] fm_act (the
 * gradient as a GEMM operand; NULL otherwise). nb, vb: the block sizes it was made for. */
typedef struct fm_lce_strip {
    float *S;
    fm_act *Sa;
    int64_t nb, vb;
} fm_lce_strip;

/* Takes a strip of nb x vb from ws (fm_arena_alloc; a measuring arena gives fake pointers). */
fm_lce_strip fm_linear_ce_strip_alloc(fm_arena *ws, int64_t nb, int64_t vb, bool backward);
/* Bytes fm_linear_ce_strip_alloc takes at most (backward, fm_act of act_bytes bytes):
 * round(nb vb 4) + (act_bytes == 4 ? 0 : round(nb vb act_bytes)). */
size_t fm_linear_ce_strip_bytes_a(int64_t nb, int64_t vb, size_t act_bytes);

/* Pass 1 of one token block over a range of vocabulary rows: for each vocabulary block of
 * st->vb rows of W [v_count,H] (the rows [v_begin, v_begin + v_count) of the head; fm_act),
 * S = hb W_blk^T (gemm, hb [nb,H] fm_act, nb <= st->nb), folded into m, z, tgt, ent [nb] fp32
 * (lce_fold, column offset v_begin + v, so targets [nb] are global vocabulary ids). first: the
 * range's first block ASSIGNS the state (the token block's first range), else every block folds
 * into it. ent may be NULL. Issues work only. */
void fm_linear_ce_fold_range(const fm_backend *be, const fm_lce_strip *st, float *m, float *z, float *tgt,
                             float *ent, const fm_act *hb, const int32_t *tb, int64_t nb, const fm_act *W,
                             int64_t v_begin, int64_t v_count, int64_t H, bool first);

/* Pass 2 of one token block over the same kind of range, from its finished m, z [nb]: each
 * strip is recomputed, turned into G (lce_strip_grad: grad_scale, weights wb [nb] or NULL,
 * z_loss, ignore_index) and contracted: dh [nb,H] fm_act (=, then +=) G W_blk when dh_first
 * (the token block's first contribution), else += (dh NULL: skipped); dW [v_count,H] fm_act
 * (the range's rows) += G^T hb (NULL: skipped). Issues work only. */
void fm_linear_ce_grad_range(const fm_backend *be, const fm_lce_strip *st, const float *m, const float *z,
                             const fm_act *hb, const int32_t *tb, const float *wb, int64_t nb, const fm_act *W,
                             int64_t v_begin, int64_t v_count, int64_t H, int32_t ignore_index, float grad_scale,
                             float z_loss, fm_act *dh, bool dh_first, fm_act *dW);

/* A named sync point for callers that want the result now (tests, tools): waits for the
 * compute stream, reads sums [2] (backend memory) and returns sums[0]; *z_term (may be NULL) =
 * z_loss * sums[1]. */
double fm_linear_ce_read(const fm_backend *be, const double *sums, float z_loss, double *z_term);

#ifdef __cplusplus
}
#endif
#endif
