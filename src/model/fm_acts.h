/* The model's activations (issue 24's model split; DESIGN.md §3 model/): the layout of one
 * micro-batch shape (B, T) into arenas, one per live set (DESIGN.md §2): checkpoint boundaries
 * (the L+1 residual-stream tensors [N,H]), saved layer activations (one set per layer that is not
 * recomputed, plus one shared set if any layer is recomputed), the expert dispatch's working set,
 * the backward working set, and the vocabulary projection (logits [N,V] or the linear
 * cross-entropy's strip); the token and target buffers with their pinned staging, the RoPE
 * tables and the device results. Laid out by fm_model_layout (model/fm_model.h: m->a) from the
 * config, the shape and fm_layout_opts; the same layout code runs in "measure" mode for the
 * planner (fm_model_plan_bytes), so the bytes planned are the bytes allocated. */
#ifndef FM_ACTS_H
#define FM_ACTS_H

#include "../backend/fm_backend.h"
#include "../bounded/fm_moe_dispatch.h"
#include "../bounded/fm_moe_ep.h"
#include "../core/fm_arena.h"
#include "fm_attn_sp.h"
#include "fm_config.h"
#include "fm_dense_mlp.h"
#include "fm_mla.h"
#include "fm_router.h"

/* Saved activations of one layer's forward (what its backward reads). The two RMSNorm outputs
 * (ln1, ln2 [N,H]) are not saved: the forward writes them into free working-set buffers and the
 * backward forms them again from the saved input (x, x_mid) into the buffer of its own output dx,
 * which is free until its last op (one memory-bound norm each; bit-identical). */
typedef struct fm_layer_acts {
    float *rstd1;                /* [N] */
    fm_act *q, *k, *v;           /* projections before QK-norm/RoPE: [N,nh*hd], [N,nkv*hd] x2 */
    fm_act *qr, *kr;             /* after QK-norm and RoPE: attention inputs */
    float *rstd_q, *rstd_k;      /* QK-norm rstd ([N*nh] per head, [N] full) */
    fm_act *att; float *lse;     /* [N,nh*hd], [B,nh,T] (sequence parallelism: lse head-sharded
                                    [B,nh/sp,sp T], fm_attn_sp.h) */
    fm_act *x_mid;               /* [N,H] residual after attention */
    float *rstd2;                /* [N] */
    fm_router_saved router;      /* probs [N,E], lse [N], top-k [N,k], statistics [E] (fm_router.h);
                                    NULL each in a dense layer's set (no router) */
    fm_moe_routes moe;           /* plain MoE twin only: the layer's dispatch (expert dispatch set) */
    fm_mla_saved mla;            /* multi-head latent attention's latents (fm_mla.h; NULL each without) */
} fm_layer_acts;

/* Backward working set: one layer at a time. */
typedef struct fm_bwd_ws {
    fm_act *dx_a, *dx_b, *dtmp, *dln;     /* [N,H] */
    fm_act *dln1;                         /* [N,H], or NULL: then d ln1 reuses dq/datt (qd >= H) */
    fm_act *dq, *dk, *dv;                 /* [N,nh*hd], [N,nkv*hd] x2 */
    fm_act *datt;                         /* [N,nh*hd], or NULL: then d att reuses the layer's
                                             incoming-gradient buffer, dead by then (qd <= H) */
    float *dtopk_w;                       /* [N,k] */
    float *dlogits_r;                     /* [N,E] fp32: router logits in forward, their grad in backward */
    fm_act *dlogits_act;                  /* [N,E] fm_act copy for the router GEMMs (aliases
                                             dlogits_r when fm_act is fp32) */
    float *dprobs_e;                      /* [E] */
    fm_dense_mlp_ws dense;                /* dense layers' SwiGLU MLP (fm_dense_mlp.h): 5 x [N,Id],
                                             NULL each when every layer is MoE */
    fm_mla_ws mla;                        /* multi-head latent attention's buffers (fm_mla.h; NULL
                                             each without) */
} fm_bwd_ws;

typedef enum fm_live_set {
    FM_LIVE_MODEL_STATE,   /* weights, grads (+ optimizer state, added by the trainer) */
    FM_LIVE_BOUNDARIES,    /* checkpoint boundaries: residual stream per layer */
    FM_LIVE_LAYER_ACTS,    /* saved attention and router activations of non-recomputed layers
                              (+ one shared set for the recomputed ones) */
    FM_LIVE_EXPERT,        /* expert dispatch: the plain twin's saved dispatches and backward
                              buffers, or one chunk's forward+backward working set */
    FM_LIVE_WORKING_SET,   /* backward working set of one layer (attention and residual grads) */
    FM_LIVE_VOCAB,         /* final norm, logits [N,V] and their gradient */
    FM_LIVE_COUNT
} fm_live_set;

extern const char *const fm_live_set_names[FM_LIVE_COUNT];

/* How activations are laid out: which layers are recomputed, and the MoE chunking. */
typedef struct fm_layout_opts {
    const bool *recompute;     /* [L] or NULL (none): layers recomputed in backward */
    int64_t moe_chunk_tokens;  /* 0: plain twin (all routes at once, saved per layer); c > 0:
                                  chunks of <= c tokens, recomputed in backward (--moe-chunk-tokens) */
    int64_t ce_block_tokens;   /* 0 and ce_block_vocab 0: plain logits [N,V]; otherwise the
                                  linear cross-entropy (bounded/fm_linear_ce) with blocks of
                                  ce_block_tokens x ce_block_vocab (0 = its default) */
    int64_t ce_block_vocab;
    int64_t n_offloaded_boundaries; /* 0: L+1 boundary tensors; n in [1, L]: boundaries 0 .. n-1
                                  share min(n, 2) rotating slots (L+1 - n + min(n, 2) tensors in
                                  all), for the checkpoint offload policy (schedule/fm_sco.h,
                                  --offload-boundaries), which must then be attached to the
                                  schedule for backward; forward alone needs no policy */
    const bool *keep_attention; /* [L] or NULL (none): recomputed layers that keep their own
                                  attention output att [N, heads*head_dim] and lse [B, heads, T]
                                  (schedule/fm_recompute.h: keep-attention); ignored where
                                  recompute[l] is false */
    int ep, ep_rank;           /* expert parallelism (0 or 1: none): the expert-dispatch live set is
                                  fm_moe_ep_ws_layout's for the cap moe_chunk_tokens (> 0 required),
                                  instead of the local dispatch's; fm_model_layout requires the
                                  model's own ep and ep_rank (fm_model_create_ep) */
    const fm_llep_opts *llep;  /* least-loaded placement with ep > 1 (NULL or .on false: plain EP) */
    int64_t sp;                /* Ulysses sequence-parallel degree (0 or 1: none). > 1: T is this
                                  rank's slice of every sequence (the full length sp x T), m->sp_comm
                                  must be a group of sp ranks, and the working set holds
                                  fm_attn_sp_bytes more (the head-sharded q/k/v/o, their gradients,
                                  the all-to-all blocks and index tables) */
    int vocab_ring;            /* Ring-DTP over this many ranks (0 or 1: none; > 1 needs the linear
                                  CE, ce_block_* > 0, and fm_model_layout requires m->vocab_comm of
                                  that size): the vocabulary live set holds the ring's bound
                                  (fm_model_vocab_ring_bytes) instead of the one-rank strip */
    bool expert_fp8;           /* --expert-precision fp8: the expert GEMMs on blockwise-E4M3
                                  fake-quantized operands (model/fm_experts_fp8.h); the expert
                                  live set holds the quantized copies (fm_moe_ws_bytes; under ep > 1
                                  the owner's, fm_moe_ep_bound's fp8 part). The experts' table must
                                  serve the backend (model/fm_experts.h: fm_moe_experts.serves, the
                                  backend's quant_fp8_* ops; llep too); the expert GEMMs then
                                  run on the host offsets (never sync-free) */
    bool expert_fp8_codes;     /* with expert_fp8: the fast path on E4M3 codes (the backend's
                                  fp8 code ops; the codes table's serves, fm_backend_fp8_codes_serves
                                  for E (under ep: E/ep) experts, must hold, else fm_model_layout
                                  fails): the expert live set holds the code
                                  operands instead (fm_moe_ws_bytes); sync-free where the backend
                                  adds the expert-load counts on the device */
    bool expert_fp8_cache;     /* with expert_fp8_codes: the weight codes of every layer kept for
                                  a step (fm_moe_ws's w8_cache: L x 3 weight operands instead of
                                  one set), quantized at a layer's first use after
                                  fm_model_fp8_cache_invalidate (the trainer: each step and each
                                  evaluation) */
    bool rl_head;              /* the RL head (include/flatmoe.h, docs/rl.md): the vocabulary live set
                                  also holds per-token loss weights and entropies [N] fp32 each
                                  (rl_weight, rl_entropy), the linear CE's entropy state and
                                  the routes [L_moe, N, k] int32 (rl_routes)
                                  (fm_model_vocab_rl_bytes); needs the linear CE (ce_block_* > 0)
                                  and one vocabulary rank (vocab_ring 0) */
    int64_t rl_topk;           /* with rl_head: K >= 1 adds the forward's top-K log-probs and ids
                                  [N, K] (rl_topk_lp, rl_topk_id) and the linear CE's running top-K
                                  (fm_linear_ce_topk_bytes); 0: none */
} fm_layout_opts;

/* The RL head's per-call switches (include/flatmoe.h; docs/rl.md): what one library call
 * (flatmoe_logprobs, flatmoe_train_step, flatmoe_generate) asks of the model. The library sets
 * the whole struct once at the start of a call (fm_capi_call_begin, src/capi/fm_capi.h) and
 * zeroes it at the call's end (fm_capi_call_end); in between it does not change. Each switch is
 * read only in its phase, so one value serves the call's forward, backward and any recompute:
 *   outputs   the head's forward (its linear CE without gradients) writes each position's entropy
 *             to rl_entropy and, with rl_topk_lp, its top-K log-probs and ids;
 *   weighted  the head's backward (its linear CE with gradients) weighs token t by rl_weight[t]
 *             with gradient scale `scale` (not scale / valid targets: the weights carry the whole
 *             per-token coefficient), the host having filled rl_weight after the forward;
 *   ent_bonus with weighted: that backward adds the entropy bonus (rl_ent_weight, rl_entropy);
 *   replay    each MoE layer's router replays its slice of rl_routes (forward and recompute);
 *   record    (not with replay) each MoE layer's forward copies its top-k ids into its slice.
 * All false (the zero struct): the trainer's own step, which never sets them. */
typedef struct fm_rl_call {
    bool outputs, weighted, ent_bonus, replay, record;
} fm_rl_call;

typedef struct fm_model_acts {
    fm_layout_opts opts;  /* the options the layout was made with: those given to fm_model_layout,
                             resolved (expert_fp8_codes and _cache only where expert_fp8 holds,
                             vocab_ring the ring's size or 0) and with its pointers at the model's
                             own copies (recompute, keep_attention, mesh.moe_llep) */
    /* Active shape (B, T, N = B*T) and the shape the activations were laid out for; a forward
     * may run any B <= B_cap, T <= T_cap (fm_model_set_shape), e.g. when sampling. */
    int64_t B, T, N;
    int64_t B_cap, T_cap;
    bool *recompute;      /* [L]: layer's activations are recomputed in backward */
    bool *keep_attention; /* [L]: a recomputed layer with its own attention output and lse
                             (kept to backward, never recomputed); false where not recomputed */
    float *rope_cos, *rope_sin; /* [T, rd/2] backend memory (rd = fm_config_rotary_dim; model/fm_rope.h) */
    int32_t *tokens, *targets;  /* [N] backend memory (uploaded from the batch, fm_batch.h) */
    int32_t *pin_tokens, *pin_targets; /* [N] pinned staging of the upload (host arena) */
    /* Packed documents (fm_batch.pos / doc_start; issue 28): laid out always (2 x [N] int32 in the
     * boundary live set, 2 x [N] pinned), so the bound does not depend on the data; used when the
     * uploaded batch carries documents. */
    int32_t *doc_pos, *doc_start;         /* [N] backend memory: RoPE positions, attention starts */
    int32_t *pin_doc_pos, *pin_doc_start; /* [N] pinned staging of their upload (host arena) */
    int64_t n_seg;              /* the last uploaded batch's segments for the router's sequence-wise
                                   loss (fm_router_segs): its documents (counted on the host), or B */
    bool docs;                  /* the last uploaded batch carried documents: RoPE and attention
                                   read doc_pos / doc_start (else NULL: causal, positions t) */
    double *pin_results;        /* [fm_model_results_count] pinned copy of results (host arena) */
    double *results;            /* [fm_model_results_count] backend memory: the micro-batch's
                                   device results (FM_RESULT_*), read after a sync point */
    int32_t *moe_chunk_order;   /* [N] backend memory: chunk-major token order (chunked MoE) */
    fm_act **boundary;          /* [L+1] pointers, each [N,H]; with n_offloaded_boundaries = n > 0,
                                   boundary l < n points at rotating slot l % 2 (layout), which the
                                   offload policy (schedule/fm_sco.h) refills in backward */
    int64_t n_offloaded_boundaries; /* boundaries 0 .. n-1 live in 2 rotating device slots (1 when
                                   n = 1) and on the host; 0: every boundary has its own tensor */
    fm_layer_acts *acts;        /* [L]: acts[l] is layer l's saved set (shared if recomputed) */
    fm_bwd_ws ws;
    int64_t moe_chunk_tokens;   /* 0: plain MoE twin */
    bool linear_ce;             /* vocabulary projection by the linear cross-entropy */
    int64_t ce_block_tokens, ce_block_vocab;
    int64_t n_valid;            /* valid targets of the last forward */
    int64_t moe_K;              /* chunks per micro-batch (1 for the plain twin) */
    bool moe_sync_free;         /* the backend's expert GEMMs read the offsets on the device
                                   (fm_backend.h expert_sync_free; set by fm_model_layout): no host
                                   wait per dispatch */
    bool moe_fp8;               /* --expert-precision fp8 (fm_layout_opts.expert_fp8; fm_experts_fp8.h) */
    bool moe_fp8_codes;         /* with moe_fp8: the backend's FP8 code ops run the expert GEMMs
                                   (fm_layout_opts.expert_fp8_codes; fm_experts_fp8.h) */
    bool *moe_fp8_fresh;        /* [L] (opts.expert_fp8_cache): layer l's codes are its weights' (host) */
    fm_moe_ws moe_ws;           /* expert-dispatch working set */
    fm_attn_sp sp_attn;         /* its buffers and tables, in the working-set live set */
    fm_act *xf; float *rstd_f;  /* [N,H], [N] */
    fm_act *logits;             /* [N,V] (plain vocabulary projection; NULL under linear CE) */
    float *token_loss;          /* [N] */
    /* The RL head's buffers (fm_layout_opts.rl_head; NULL otherwise), read and written as the
     * per-call switches in `rl` say (fm_rl_call, above): rl_weight [N] fp32, the backward's token
     * weights; rl_entropy [N] fp32, the forward's entropy of each position's next-token
     * distribution; rl_ent_weight [N] fp32, the entropy bonus's per-token weights (the backward's
     * linear CE adds sum_t rl_ent_weight[t] H_t, H_t in rl_entropy, to the objective:
     * fm_lce_opts.ent_weight); rl_routes [L_moe, N, k] int32 (the MoE layers in model order, dense
     * layers have no slice): the routes replayed (fm_router_forward's replay: rows starting with
     * -1 keep the router's choice) or recorded; rl_topk_lp [N, K] fp32, rl_topk_id [N, K] int32
     * (K = opts.rl_topk; NULL when 0): each position's K largest log-probs and ids. All backend
     * memory in the vocabulary live set. */
    float *rl_weight, *rl_entropy, *rl_ent_weight;
    int32_t *rl_routes;
    float *rl_topk_lp;
    int32_t *rl_topk_id;
    fm_rl_call rl; /* the current library call's switches; all false outside one (the trainer) */
    fm_moe_ep_ws moe_ep_ws;     /* expert parallelism's working set (the expert-dispatch live set;
                                   bounded/fm_moe_ep.h), laid out when p.ep > 1 */
    int32_t *moe_ep_counts_host; /* [N*k] host copy of top-k ids for the expert-load counts when the
                                   backend's memory is not host memory (fm_malloc'd at layout) */

    fm_arena arena[FM_LIVE_COUNT]; /* the activation live sets; [FM_LIVE_MODEL_STATE] stays empty: the
                                     model state is the parameter store's (train/fm_param_store.h) */
    fm_arena host_arena;        /* pinned host memory the step shares with the device (MoE expert
                                   offsets, the token upload's staging) */
} fm_model_acts;

#endif
