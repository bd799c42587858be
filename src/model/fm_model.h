/* The MoE decoder (DESIGN.md §4), written against the backend op table:
 *
 *   tokens -> embedding -> L x [ RMSNorm -> causal GQA attention (RoPE, optional QK-norm)
 *   -> +residual -> RMSNorm -> router (softmax, top-k) -> SwiGLU experts (dropless) -> +residual ]
 *   -> final RMSNorm -> LM head -> cross-entropy (+ load-balancing and z losses)
 *
 * A model is three parts (issue 24's model split) and what they share (the config, the backend,
 * the router's options):
 *   m->p     the parameters (fm_params.h): the parameter table in Hugging Face names and the
 *            views of the flat weight, gradient and master buffers. Built from the config alone
 *            (fm_model_create_ep: and the rank's slice of the experts); checkpoint I/O, the
 *            parameter store, the optimizer, ZeRO-3's groups and the weight init use only this.
 *   m->a     the activations (fm_acts.h): the layout of one (B, T) shape into one arena per live
 *            set (fm_model_layout; the same code measures the planner's bytes, so the bytes
 *            planned are the bytes allocated), the token and target buffers, the results.
 *   m->mesh  the communicators (fm_model_mesh.h): dp x sp, the sp group, the vocabulary ring,
 *            the ep group, with their degrees and ranks; set by the caller before the layout.
 * The batch is an argument of the step (fm_batch.h), never a field; the layer and head
 * functions below return fm_status. The schedule (schedule/fm_schedule.h) passes fm_model. */
#ifndef FM_MODEL_H
#define FM_MODEL_H

#include "../backend/fm_backend.h"
#include "fm_acts.h"
#include "fm_batch.h"
#include "fm_config.h"
#include "fm_model_mesh.h"
#include "fm_params.h"
#include "fm_router.h"

typedef struct fm_model {
    fm_config cfg;
    fm_backend be;
    fm_router_opts router; /* the router's options, from the config */
    fm_model_params p;     /* the parameters (fm_params.h) */
    fm_model_acts a;       /* the activations of the laid-out shape (fm_acts.h; fm_model_layout) */
    fm_model_mesh mesh;    /* the communicators (fm_model_mesh.h) */
} fm_model;

/* Creates a model of config cfg on backend be: the parameter table (fm_params_create with ep 1,
 * rank 0: every expert) and the per-layer recompute flags; no parameter memory (the parameter
 * store's, train/fm_param_store.h, bound with fm_params_bind) and no activations (fm_model_layout);
 * the mesh zeroed (one rank). Errors: FM_ERR_NOMEM. */
fm_status fm_model_create(fm_model *m, const fm_config *cfg, fm_backend be);

/* The same for rank ep_rank of an expert-parallel group of ep ranks (m->p holds E/ep experts of
 * each layer, fm_params_create). Errors: as fm_params_create (FM_ERR_ARG naming --ep;
 * FM_ERR_NOMEM). */
fm_status fm_model_create_ep(fm_model *m, const fm_config *cfg, fm_backend be, int ep, int ep_rank);


/* Lays out and allocates activation memory for micro-batch B x sequence T (opts NULL: no
 * recompute, plain MoE). Errors: FM_ERR_ARG if T > max_position_embeddings (names --seq-len)
 * or B, T < 1, or n_offloaded_boundaries outside [0, L] (names --offload-boundaries); FM_ERR_NOMEM naming the live set. May be called again with another shape
 * (frees the previous layout). With opts->sp > 1 (sequence parallelism): T is the local slice,
 * sp x T must be within max_position_embeddings, the config must pass fm_attn_sp_check and
 * m->mesh.sp_comm must have sp ranks (FM_ERR_ARG otherwise). */
fm_status fm_model_layout(fm_model *m, int64_t B, int64_t T, const fm_layout_opts *opts);

/* Bytes each live set needs for this config and shape, measured by running the layout code
 * over measuring arenas (no allocation), so the plan and the allocation cannot drift apart.
 * bytes[FM_LIVE_COUNT]; model state counts weights and gradients only. */
void fm_model_plan_bytes(const fm_config *cfg, int64_t B, int64_t T, const fm_layout_opts *opts,
                         size_t bytes[FM_LIVE_COUNT]);

/* Frees the layout (fm_model_layout), the parameter table (fm_params_free) and the recompute
 * flags, and zeroes m; the bound parameter buffers and the communicators are their owners'.
 * Safe on a zeroed m. */
void fm_model_free(fm_model *m);

/* Bound formulas of the live sets the model owns, in bytes (each buffer rounded to 64 as the
 * arenas round), for activations of act_bytes bytes (sizeof(fm_act) for this build; 2 or 4 to
 * plan another build's run). Written out by hand from the buffers' shapes; test_plan checks them against
 * the measured layout. Boundaries: tokens, targets, RoPE tables and the L+1 residual-stream
 * tensors [N,H]. Layer activations: ONE layer's saved set (the attention inputs and outputs,
 * norms, router probabilities and top-k). Working set: one layer's backward buffers. Vocab
 * (plain): final norm output, logits [N,V] and per-token loss. */
/* Boundaries include the chunked MoE's token order [N] int32 when moe_chunked. */
size_t fm_model_boundary_bytes_chunked(const fm_config *c, int64_t B, int64_t T, bool moe_chunked, size_t act_bytes);
/* The same with n_tensors residual-stream tensors [N,H] instead of L+1 (the offload policy's
 * count, fm_sco_device_boundaries). */
size_t fm_model_boundary_bytes_n(const fm_config *c, int64_t B, int64_t T, bool moe_chunked, int64_t n_tensors,
                                 size_t act_bytes);
/* The same for one rank of sp sequence-parallel ranks (T: its slice; sp >= 1): the packed
 * documents' starts and the RoPE tables cover the whole rows of sp T tokens (fm_attn_sp.h). */
size_t fm_model_boundary_bytes_sp(const fm_config *c, int64_t B, int64_t T, int64_t sp, bool moe_chunked,
                                  int64_t n_tensors, size_t act_bytes);
/* Residual-stream tensors the layout allocates with n_off offloaded boundaries (0 <= n_off <= L):
 * L+1 - n_off + min(n_off, 2). The offload policy's bound (schedule/fm_sco.h) is this count. */
int64_t fm_model_boundary_tensors(int64_t L, int64_t n_off);
size_t fm_model_layer_acts_bytes(const fm_config *c, int64_t B, int64_t T, size_t act_bytes);
/* A keep-attention layer's own buffers (schedule/fm_recompute.h): the attention output
 * [B*T, heads*head_dim] act_bytes each and its log-sum-exp [B, heads, T] fp32, each rounded. */
size_t fm_model_kept_attention_bytes(const fm_config *c, int64_t B, int64_t T, size_t act_bytes);
/* A dense layer's saved set (fm_model_layer_acts_bytes less the router's part). */
size_t fm_model_dense_layer_acts_bytes(const fm_config *c, int64_t B, int64_t T, size_t act_bytes);
/* The saved sets a layout takes for the recompute policy recompute [L] (NULL: none): *n_moe of
 * an MoE layer's shape (fm_model_layer_acts_bytes, and under the plain MoE twin a saved
 * dispatch each) and *n_dense of a dense layer's (fm_model_dense_layer_acts_bytes): one per
 * layer not recomputed, plus one shared by the recomputed layers, MoE-shaped when any of them
 * is MoE. */
void fm_model_saved_sets(const fm_config *c, const bool *recompute, int64_t *n_moe, int64_t *n_dense);
size_t fm_model_working_set_bytes(const fm_config *c, int64_t N, size_t act_bytes);
size_t fm_model_vocab_plain_bytes(const fm_config *c, int64_t N, size_t act_bytes);
/* Vocabulary projection by the linear cross-entropy: final-norm output, rstd and per-token loss,
 * plus what the operator takes for N tokens and this vocabulary (fm_linear_ce_call_bytes_a: the
 * blocks clamped to N x V, no entropy vector), so the measured high-water mark meets it. */
size_t fm_model_vocab_linear_bytes(const fm_config *c, int64_t N, int64_t block_tokens, int64_t block_vocab,
                                   size_t act_bytes);

/* What the RL head adds to the linear CE's vocabulary live set (fm_layout_opts.rl_head): the
 * per-token weights, entropies and entropy weights [N] fp32, the routes taken or replayed [L_moe, N, k] int32, with
 * topk = K >= 1 the top-K log-probs and ids [N, K] and the operator's running top-K, and the operator's entropy state for the blocks
 * clamped to N (fm_linear_ce_call_bytes_a with the entropy less without it). */
size_t fm_model_vocab_rl_bytes(const fm_config *c, int64_t N, int64_t block_tokens, int64_t block_vocab,
                               int64_t topk, size_t act_bytes);

/* The same under Ring-DTP over P > 1 ranks (--vocab-parallel ring): final-norm output, rstd and
 * per-token loss, plus fm_linear_ce_ring_bound_bytes_a for this rank's N tokens as the group's
 * largest count (every rank of a training run holds N = B x T/sp), with dh and dW wanted, no
 * token weights or entropy, the mode AUTO picks (one V/P x H shard and its dW accumulator in
 * flight and received when the weights move; the N-token block, its dh and state when the
 * activations do). The forward-only call (evaluation) takes at most this. */
size_t fm_model_vocab_ring_bytes(const fm_config *c, int64_t N, int64_t block_tokens, int64_t block_vocab, int P,
                                 size_t act_bytes);

/* Sets the active micro-batch and sequence length for the next forward/backward, within the
 * laid-out capacity (asserted). Tokens and targets are then read as [B,T]. */
void fm_model_set_shape(fm_model *m, int64_t B, int64_t T);

/* The initial weights (fm_params_init_weights_host's: Normal(0, initializer_range) for matrices
 * and embeddings, 1 for norm weights, the HF init) drawn on the host in fp32 and uploaded into
 * the bound parameters (fm_model_upload_master). Errors: FM_ERR_NOMEM for the host staging. */
fm_status fm_model_init_weights(fm_model *m, uint64_t seed);
/* Host <-> backend transfer of the fp32 master weights (n_params floats, table layout); upload
 * also refreshes the fm_act weights. */
void fm_model_upload_master(fm_model *m, const float *host);
void fm_model_download_master(const fm_model *m, float *host);

/* Row `row` of the last plain forward's logits as fp32 on the host (V floats). */
void fm_model_logits_row(const fm_model *m, int64_t row, float *host);

/* The device results of a micro-batch (doubles, m->a.results): the loss sums and each layer's
 * router loss terms, written by the step's ops and read by the host only after a sync point
 * (fm_model_read_loss, or a copy_async of the whole block into pinned memory that the trainer
 * reads at the step's end). */
enum {
    FM_RESULT_CE = 0,     /* sum over valid targets of the cross-entropy (nats) */
    FM_RESULT_ZSQ = 1,    /* sum of lse^2 (linear CE; unused by the model's loss) */
    FM_RESULT_SUMSQ = 2,  /* a sum of squares (the trainer's gradient norm) */
    FM_RESULT_SCRATCH = 3, /* router_stats' lse^2 sum, consumed by router_loss_terms */
    FM_RESULT_LAYERS = 4  /* layer l's aux term at 4 + 2l, its z term at 5 + 2l */
};
static inline int64_t fm_model_results_count(const fm_config *c) { return FM_RESULT_LAYERS + 2 * c->num_hidden_layers; }

/* Losses of one micro-batch. */
typedef struct fm_loss {
    double ce;       /* mean cross-entropy over non-ignored targets, nats per token */
    double aux;      /* router_aux_loss_coef * mean over layers of E * sum_e f_e P_e */
    double z;        /* router_z_loss_coef * mean over layers of mean_n lse_n^2 */
    int64_t n_valid; /* targets that count */
} fm_loss;

/* ---- the model's pieces, for the schedule (schedule/fm_schedule.h owns the loop over layers,
 * its order and its hooks). A micro-batch's training step is
 *   embed_forward; layer_forward(l) for l < L; head_train;
 *   for l = L-1 .. 0: [layer_forward(l) into the free gradient buffer if l is recomputed;
 *                      layer_recompute(l, .., true) if it keeps its attention]
 *                     layer_backward(l, dy, dx), swapping dy and dx;  embed_backward(dy)
 * with dy = grad_buffer(0), dx = grad_buffer(1) at the start. Parameter gradients accumulate
 * (+=), scaled by `scale` (1/G for G-step accumulation); activation gradients are assigned. */

/* Uploads the batch b's tokens [B,T] (and its targets, when b->targets) and embeds the tokens
 * into boundary 0. The upload goes through pinned staging asynchronously; the host first waits
 * for the previous upload to finish (a sync point, FM_EVENT_TOKENS), so callers may rewrite
 * their batch whenever they like after the call. Errors: FM_ERR_ARG (fm_batch_check) when b's
 * shape is not the active one (m->a.B x m->a.T) or a token or target is out of range. */
fm_status fm_model_embed_forward(fm_model *m, const fm_batch *b);
/* Layer l's forward from boundary l into y [N,H] (boundary l+1, or the free gradient buffer
 * when the schedule recomputes the layer in backward), saving into layer l's saved set (shared
 * by the recomputed layers). The router's loss terms of the layer land in m->a.results at
 * FM_RESULT_LAYERS + 2l (fm_router.h). Errors: m->mesh.comm's (the router statistics' all-reduce),
 * m->mesh.sp_comm's (attention's all-to-alls under sequence parallelism). */
fm_status fm_model_layer_forward(fm_model *m, int64_t l, fm_act *y);
/* The recompute of layer l in backward: fm_model_layer_forward again into y, except that with
 * skip_attention the attention forward does not run and the layer's kept att and lse (written
 * by its forward) are read as they are (the keep-attention policy; q, k, v are still formed
 * again, attention's backward reads them). Bit-identical to the forward's saved set. Errors:
 * FM_ERR_ARG when skip_attention and the layout keeps no attention output for layer l
 * (m->a.keep_attention[l] false); m->mesh.comm's. */
fm_status fm_model_layer_recompute(fm_model *m, int64_t l, fm_act *y, bool skip_attention);
/* Layer l's backward from its output gradient dy [N,H] (clobbered) into dx [N,H] (assigned),
 * reading boundary l and the layer's saved set (recomputed by the schedule first if the layer is
 * recomputed). dy and dx are the two gradient buffers. Errors: with sequence parallelism, the
 * sp group's (attention's all-to-alls); under expert parallelism the EP operator's
 * (fm_moe_ep_backward: the same on every rank of the ep group); FM_OK otherwise. */
fm_status fm_model_layer_backward(fm_model *m, int64_t l, fm_act *dy, fm_act *dx, float scale);
/* Final norm of boundary L and the loss: plain logits (and, with targets, the cross-entropy and
 * its gradient formed in place), or the linear cross-entropy (targets required). The loss sum
 * lands in m->a.results[FM_RESULT_CE]; sets r->n_valid (and m->a.n_valid), counted on the host.
 * With m->mesh.comm both are the batch's: the count and the loss sum are all-reduced over its ranks
 * (the gradient's mean is over the batch's valid targets). b: the batch of the last
 * fm_model_embed_forward (its targets counted on the host; b->targets NULL: no targets, logits
 * only). Errors: the communicator's. */
fm_status fm_model_head_forward(fm_model *m, const fm_batch *b, fm_loss *r);
/* Backward of the head after fm_model_head_forward with targets: the LM head's gradient
 * (accumulated) and the gradient of boundary L into grad buffer 0. Errors: under Ring-DTP
 * (m->mesh.vocab_P > 1) the ring's (its communicator's, or arguments that differ between the ranks);
 * FM_OK otherwise. */
fm_status fm_model_head_backward(fm_model *m, float scale);
/* Forward and backward of the head in one call (what training runs): the same results as
 * head_forward + head_backward, but the linear cross-entropy runs once, fused. The loss sums
 * land in m->a.results (read them after a sync point); r->n_valid is set. */
fm_status fm_model_head_train(fm_model *m, const fm_batch *b, float scale, fm_loss *r);
/* Backward of the embedding from the gradient of boundary 0 (accumulated into its weight).
 * Errors: none today (FM_OK); a status so that the schedule treats every piece alike. */
fm_status fm_model_embed_backward(fm_model *m, const fm_act *dx0);
/* The residual-stream boundary l in [0, L] ([N,H]), and the two [N,H] gradient buffers
 * (i = 0, 1) of the backward. */
fm_act *fm_model_boundary(fm_model *m, int64_t l);

/* --fp8-weight-cache (fm_layout_opts.expert_fp8_cache): marks every layer's cached expert weight
 * codes stale, so each layer quantizes its weights again at its next forward or backward. The
 * trainer calls it wherever the weights may have changed since: at the start of each training
 * step (the previous step's update, overlapped or not, completes before a layer's forward reads
 * its weights) and of each evaluation. No-op without the cache. */
void fm_model_fp8_cache_invalidate(fm_model *m);
fm_act *fm_model_grad_buffer(fm_model *m, int i);

/* The micro-batch's losses from a host copy of its results (fm_model_results_count doubles)
 * and its valid-target count: ce = results[CE] / n_valid; aux and z from the layers' terms
 * summed in layer order (fm_router_losses). */
void fm_model_loss_from_results(const fm_model *m, const double *results, int64_t n_valid, fm_loss *out);

/* A named sync point: waits for the compute stream, copies the results to the host and fills
 * out (the last forward's losses, m->a.n_valid targets). */
void fm_model_read_loss(fm_model *m, fm_loss *out);


#endif
