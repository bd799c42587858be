/* The MoE decoder (DESIGN.md §4), written against the backend op table:
 *
 *   tokens -> embedding -> L x [ RMSNorm -> causal GQA attention (RoPE, optional QK-norm)
 *   -> +residual -> RMSNorm -> router (softmax, top-k) -> SwiGLU experts (dropless) -> +residual ]
 *   -> final RMSNorm -> LM head -> cross-entropy (+ load-balancing and z losses)
 *
 * Parameters live in one flat fp32 buffer in a fixed order (fm_param table, Hugging Face names);
 * gradients in a second buffer of the same layout. Per-expert weights are stored stacked:
 * gate and up [E, I, H], down [E, H, I]; expert e's HF tensor is the e-th slice.
 *
 * Activation memory is laid out once for a (micro-batch B, sequence T) shape, into arenas:
 * checkpoint boundaries (the L+1 residual-stream tensors [N,H]), saved layer activations (one
 * set per layer that is not recomputed, plus one shared set if any layer is recomputed), the
 * backward working set, and the vocabulary projection (logits [N,V]). The same layout code
 * runs in "measure" mode for the planner, so the bytes planned are the bytes allocated. */
#ifndef FM_MODEL_H
#define FM_MODEL_H

#include "../backend/fm_backend.h"
#include "../bounded/fm_moe_dispatch.h"
#include "../bounded/fm_moe_ep.h"
#include "../core/fm_arena.h"
#include "fm_attn_sp.h"
#include "fm_batch.h"
#include "fm_config.h"
#include "fm_router.h"

typedef struct fm_param {
    char name[128];   /* Hugging Face tensor name */
    int ndim;
    int64_t shape[2];
    int64_t offset;   /* elements into the flat buffer */
    int64_t numel;
    bool decay;       /* AdamW weight decay applies (false for norm weights) */
} fm_param;

/* Pointers into one flat buffer (weights or gradients) for one layer. */
typedef struct fm_layer_ptrs {
    fm_act *ln1, *wq, *wk, *wv, *wo, *q_norm, *k_norm, *ln2, *router;
    fm_act *w_gate, *w_up, *w_down; /* [E,I,H], [E,I,H], [E,H,I] */
} fm_layer_ptrs;

typedef struct fm_model_ptrs {
    fm_act *embed;    /* [V,H] */
    fm_act *final_norm;
    fm_act *lm_head;  /* [V,H]; == embed when tied */
    fm_layer_ptrs *layers;
} fm_model_ptrs;

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
    fm_router_saved router;      /* probs [N,E], lse [N], top-k [N,k], statistics [E] (fm_router.h) */
    fm_moe_routes moe;           /* plain MoE twin only: the layer's dispatch (expert dispatch set) */
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

typedef struct fm_model {
    fm_config cfg;
    fm_backend be;
    int64_t n_params;
    int n_tensors;
    fm_param *table;      /* n_tensors entries */
    fm_act *params, *grads; /* backend memory, [n_params] each: the parameter store's (bound) */
    float *master;        /* fp32 master weights [n_params]: params itself when fm_act is fp32 */
    bool master_host;     /* master is (pinned) host memory: the streamed optimizer's, not the backend's */
    int64_t o_embed, o_norm, o_head; /* offsets of the embedding, final norm and LM head */
    void *offsets;        /* [L] per-layer tensor offsets (fm_model.c) */
    fm_model_ptrs w, g;   /* views of params and grads */

    /* Active shape (B, T, N = B*T) and the shape the activations were laid out for; a forward
     * may run any B <= B_cap, T <= T_cap (fm_model_set_shape), e.g. when sampling. */
    int64_t B, T, N;
    int64_t B_cap, T_cap;
    bool *recompute;      /* [L]: layer's activations are recomputed in backward */
    bool *keep_attention; /* [L]: a recomputed layer with its own attention output and lse
                             (kept to backward, never recomputed); false where not recomputed */
    float *rope_cos, *rope_sin; /* [T, hd/2] backend memory */
    int32_t *tokens, *targets;  /* [N] backend memory (uploaded from the batch, fm_batch.h) */
    int32_t *pin_tokens, *pin_targets; /* [N] pinned staging of the upload (host arena) */
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
    bool moe_fp8_cache;         /* with moe_fp8_codes: every layer's weight codes kept for the step */
    bool *moe_fp8_fresh;        /* [L] (moe_fp8_cache): layer l's codes are its weights' (host) */
    fm_moe_ws moe_ws;           /* expert-dispatch working set */
    fm_router_opts router;      /* the router's options, from the config */
    const fm_comm *comm;        /* the ranks that see this batch's tokens (dp x sp), backend memory:
                                   the valid-target count, the loss sums and the router statistics
                                   are reduced over it; NULL: this rank alone (tests, inference) */
    /* Ulysses sequence parallelism (fm_attn_sp.h; fm_layout_opts.sp > 1): this rank holds
     * positions [sp_rank T, (sp_rank + 1) T) of each of the B sequences (T the local length, the
     * full one sp x T); RoPE is by global position (the tables start at sp_rank T) and attention
     * runs through sp_attn's all-to-alls over sp_comm. Everything else runs on the local tokens. */
    const fm_comm *sp_comm;     /* the sp group over the backend's memory; set before fm_model_layout
                                   with opts->sp > 1 (NULL: no sequence parallelism) */
    int sp, sp_rank;            /* degree (1: none) and this rank's index in the group */
    fm_attn_sp sp_attn;         /* its buffers and tables, in the working-set live set */
    fm_act *xf; float *rstd_f;  /* [N,H], [N] */
    fm_act *logits;             /* [N,V] (plain vocabulary projection; NULL under linear CE) */
    float *token_loss;          /* [N] */
    /* Ring-DTP (--vocab-parallel ring, README "Many ranks"; bounded/fm_linear_ce_ring.h): with
     * vocab_P > 1 the linear cross-entropy runs as fm_linear_ce_ring over vocab_comm (P ranks,
     * this one vocab_rank): this rank's N tokens meet every rank's V/P head shard; it reads and
     * writes only its own shard's rows [vocab_first, vocab_first + vocab_rows) of w.lm_head and
     * g.lm_head (fm_lce_ring_shard), the rows of the others' gradient stay as they were (zero
     * after the step's zeroing: the trainer's all-reduce of the head gradient sums the shards),
     * and the loss sums it writes are already the group's (not reduced again over m->comm).
     * vocab_P 0 or 1: the one-rank fm_linear_ce with the whole head. */
    const fm_comm *vocab_comm;  /* the ring's ranks (the world), backend memory; set before the layout */
    int vocab_P, vocab_rank;
    int64_t vocab_first, vocab_rows;

    /* Expert parallelism (--ep, README "Many ranks"; bounded/fm_moe_ep.h): with ep > 1 the table
     * holds this rank's E_loc = E/ep experts of every layer (experts ep_rank*E_loc .., under their
     * global Hugging Face names; fm_model_create_ep) and the MoE block runs fm_moe_ep_forward /
     * backward over moe_ep_comm with the working set moe_ep_ws (the expert-dispatch live set,
     * laid out by fm_model_layout) instead of the local dispatch. ep 1: all experts, local. */
    int ep, ep_rank;
    int64_t E_loc;
    const fm_comm *moe_ep_comm; /* the ep group (backend memory); NULL: the local MoE */
    fm_llep_opts moe_llep;      /* least-loaded placement (--llep); .on false: plain EP */
    fm_moe_ep_ws moe_ep_ws;
    int32_t *moe_ep_counts_host; /* [N*k] host copy of top-k ids for the expert-load counts when the
                                   backend's memory is not host memory (fm_malloc'd at layout) */

    fm_arena arena[FM_LIVE_COUNT]; /* the activation live sets; [FM_LIVE_MODEL_STATE] stays empty: the
                                     model state is the parameter store's (train/fm_param_store.h) */
    fm_arena host_arena;        /* pinned host memory the step shares with the device (MoE expert
                                   offsets, the token upload's staging) */

    /* ---- packed documents (fm_batch.pos / doc_start; issue 28) ---------------------------
     * Laid out always (2 x [N] int32 in the boundary live set, 2 x [N] pinned), so the bound
     * does not depend on the data; used when the uploaded batch carries documents. */
    int32_t *doc_pos, *doc_start;         /* [N] backend memory: RoPE positions, attention starts */
    int32_t *pin_doc_pos, *pin_doc_start; /* [N] pinned staging of their upload (host arena) */
    bool docs;                  /* the last uploaded batch carried documents: RoPE and attention
                                   read doc_pos / doc_start (else NULL: causal, positions t) */
} fm_model;

/* Builds the parameter table (names, shapes, offsets into the flat parameter buffer) of a config
 * on backend `be`. Allocates no parameter memory: the model state is the parameter store's
 * (train/fm_param_store.h), which binds its buffers with fm_model_bind_params. Errors:
 * FM_ERR_NOMEM. */
fm_status fm_model_create(fm_model *m, const fm_config *cfg, fm_backend be);

/* The same for rank ep_rank of an expert-parallel group of ep ranks: the table holds every
 * non-expert tensor and, of each layer's experts, only ep_rank*E/ep .. (ep_rank+1)*E/ep - 1
 * (stacked [E/ep, I, H] / [E/ep, H, I], rows named by their global expert index), so the
 * parameter store, the optimizer and the gradients hold E/ep experts (the model-state bound of
 * fm_model_ep_num_params). ep 1 is fm_model_create. Errors: FM_ERR_ARG when ep < 1, ep does not
 * divide num_experts or ep_rank is outside [0, ep) (naming --ep and the fix); FM_ERR_NOMEM. */
fm_status fm_model_create_ep(fm_model *m, const fm_config *cfg, fm_backend be, int ep, int ep_rank);

/* Parameters of one rank's table under expert parallelism of degree ep (E % ep == 0):
 * fm_config_num_params less L * (E - E/ep) * 3 * H * I (the other ranks' experts). */
int64_t fm_model_ep_num_params(const fm_config *cfg, int ep);

/* Points the model at its parameters: weights and grads [n_params] fm_act and the fp32 master
 * weights [n_params] (== weights when fm_act is fp32), backend memory in the table's layout
 * (fm_param.offset); sets the per-layer views m->w and m->g. */
void fm_model_bind_params(fm_model *m, fm_act *weights, fm_act *grads, float *master);

/* Parameter groups (ZeRO-3's unit of gathering, train/fm_zero3.h; the optimizer overlap's
 * groups): group 0 the embedding (with tied embeddings also the LM head), group 1 + l layer l,
 * group L + 1 the final norm and the untied LM head; each a contiguous range of the flat buffer,
 * in forward order. fm_model_group_begin gives group g's first flat offset (g = L + 2:
 * n_params, the end). fm_model_bind_group points the weight views (weights non-NULL) and the
 * gradient views (grads non-NULL) of group g at buffers that hold the group's range from its
 * first element, [fm_model_group_begin(g + 1) - fm_model_group_begin(g)] fm_act each, leaving
 * the other groups' views as they were (ZeRO-3 points them at its gather slots). */
int64_t fm_model_group_begin(const fm_model *m, int64_t g);
void fm_model_bind_group(fm_model *m, int64_t g, fm_act *weights, fm_act *grads);

/* Flat offsets (elements) of layer l's stacked expert weights gate [E,I,H], up [E,I,H] and down
 * [E,H,I] (the Hugging Face mapping's experts, io/fm_hf_weights.h). */
void fm_model_layer_expert_offsets(const fm_model *m, int64_t l, int64_t *gate, int64_t *up, int64_t *down);

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
} fm_layout_opts;

/* Lays out and allocates activation memory for micro-batch B x sequence T (opts NULL: no
 * recompute, plain MoE). Errors: FM_ERR_ARG if T > max_position_embeddings (names --seq-len)
 * or B, T < 1, or n_offloaded_boundaries outside [0, L] (names --offload-boundaries); FM_ERR_NOMEM naming the live set. May be called again with another shape
 * (frees the previous layout). With opts->sp > 1 (sequence parallelism): T is the local slice,
 * sp x T must be within max_position_embeddings, the config must pass fm_attn_sp_check and
 * m->sp_comm must have sp ranks (FM_ERR_ARG otherwise). */
fm_status fm_model_layout(fm_model *m, int64_t B, int64_t T, const fm_layout_opts *opts);

/* Bytes each live set needs for this config and shape, measured by running the layout code
 * over measuring arenas (no allocation), so the plan and the allocation cannot drift apart.
 * bytes[FM_LIVE_COUNT]; model state counts weights and gradients only. */
void fm_model_plan_bytes(const fm_config *cfg, int64_t B, int64_t T, const fm_layout_opts *opts,
                         size_t bytes[FM_LIVE_COUNT]);

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
/* Residual-stream tensors the layout allocates with n_off offloaded boundaries (0 <= n_off <= L):
 * L+1 - n_off + min(n_off, 2). The offload policy's bound (schedule/fm_sco.h) is this count. */
int64_t fm_model_boundary_tensors(int64_t L, int64_t n_off);
size_t fm_model_layer_acts_bytes(const fm_config *c, int64_t B, int64_t T, size_t act_bytes);
/* A keep-attention layer's own buffers (schedule/fm_recompute.h): the attention output
 * [B*T, heads*head_dim] act_bytes each and its log-sum-exp [B, heads, T] fp32, each rounded. */
size_t fm_model_kept_attention_bytes(const fm_config *c, int64_t B, int64_t T, size_t act_bytes);
size_t fm_model_working_set_bytes(const fm_config *c, int64_t N, size_t act_bytes);
size_t fm_model_vocab_plain_bytes(const fm_config *c, int64_t N, size_t act_bytes);
/* Vocabulary projection by the linear cross-entropy: final-norm output, rstd and per-token loss,
 * plus what the operator takes for N tokens and this vocabulary (fm_linear_ce_call_bytes_a: the
 * blocks clamped to N x V, no entropy vector), so the measured high-water mark meets it. */
size_t fm_model_vocab_linear_bytes(const fm_config *c, int64_t N, int64_t block_tokens, int64_t block_vocab,
                                   size_t act_bytes);

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


/* Normal(0, initializer_range) for matrices and embeddings, 1 for norm weights (HF init),
 * generated on the host in fp32 and uploaded. */
fm_status fm_model_init_weights(fm_model *m, uint64_t seed);
/* The same initial fp32 weights drawn into host memory w [n_params] (table layout) only: nothing
 * uploaded (ZeRO-3 scatters them to the ranks' shards). */
void fm_model_init_weights_host(const fm_model *m, uint64_t seed, float *w);
/* Elements [first, first + count) of table tensor i of the initial weights above into out
 * [count] (the same values as fm_model_init_weights_host's; ZeRO-3 draws only its shard). */
void fm_model_init_weights_range(const fm_model *m, uint64_t seed, int i, int64_t first, int64_t count, float *out);

/* Host <-> backend transfer of the fp32 master weights (n_params floats, table layout); upload
 * also refreshes the fm_act weights. */
void fm_model_upload_master(fm_model *m, const float *host);
void fm_model_download_master(const fm_model *m, float *host);

/* Row `row` of the last plain forward's logits as fp32 on the host (V floats). */
void fm_model_logits_row(const fm_model *m, int64_t row, float *host);

/* The device results of a micro-batch (doubles, m->results): the loss sums and each layer's
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
 * shape is not the active one (m->B x m->T) or a token or target is out of range. */
fm_status fm_model_embed_forward(fm_model *m, const fm_batch *b);
/* Layer l's forward from boundary l into y [N,H] (boundary l+1, or the free gradient buffer
 * when the schedule recomputes the layer in backward), saving into layer l's saved set (shared
 * by the recomputed layers). The router's loss terms of the layer land in m->results at
 * FM_RESULT_LAYERS + 2l (fm_router.h). Errors: m->comm's (the router statistics' all-reduce),
 * m->sp_comm's (attention's all-to-alls under sequence parallelism). */
fm_status fm_model_layer_forward(fm_model *m, int64_t l, fm_act *y);
/* The recompute of layer l in backward: fm_model_layer_forward again into y, except that with
 * skip_attention the attention forward does not run and the layer's kept att and lse (written
 * by its forward) are read as they are (the keep-attention policy; q, k, v are still formed
 * again, attention's backward reads them). Bit-identical to the forward's saved set. Errors:
 * FM_ERR_ARG when skip_attention and the layout keeps no attention output for layer l
 * (m->keep_attention[l] false); m->comm's. */
fm_status fm_model_layer_recompute(fm_model *m, int64_t l, fm_act *y, bool skip_attention);
/* Layer l's backward from its output gradient dy [N,H] (clobbered) into dx [N,H] (assigned),
 * reading boundary l and the layer's saved set (recomputed by the schedule first if the layer is
 * recomputed). dy and dx are the two gradient buffers. Errors: with sequence parallelism, the
 * sp group's (attention's all-to-alls); under expert parallelism the EP operator's
 * (fm_moe_ep_backward: the same on every rank of the ep group); FM_OK otherwise. */
fm_status fm_model_layer_backward(fm_model *m, int64_t l, fm_act *dy, fm_act *dx, float scale);
/* Final norm of boundary L and the loss: plain logits (and, with targets, the cross-entropy and
 * its gradient formed in place), or the linear cross-entropy (targets required). The loss sum
 * lands in m->results[FM_RESULT_CE]; sets r->n_valid (and m->n_valid), counted on the host.
 * With m->comm both are the batch's: the count and the loss sum are all-reduced over its ranks
 * (the gradient's mean is over the batch's valid targets). b: the batch of the last
 * fm_model_embed_forward (its targets counted on the host; b->targets NULL: no targets, logits
 * only). Errors: the communicator's. */
fm_status fm_model_head_forward(fm_model *m, const fm_batch *b, fm_loss *r);
/* Backward of the head after fm_model_head_forward with targets: the LM head's gradient
 * (accumulated) and the gradient of boundary L into grad buffer 0. Errors: under Ring-DTP
 * (m->vocab_P > 1) the ring's (its communicator's, or arguments that differ between the ranks);
 * FM_OK otherwise. */
fm_status fm_model_head_backward(fm_model *m, float scale);
/* Forward and backward of the head in one call (what training runs): the same results as
 * head_forward + head_backward, but the linear cross-entropy runs once, fused. The loss sums
 * land in m->results (read them after a sync point); r->n_valid is set. */
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
 * out (the last forward's losses, m->n_valid targets). */
void fm_model_read_loss(fm_model *m, fm_loss *out);

/* Looks up a parameter by HF name; NULL if absent. */
const fm_param *fm_model_find_param(const fm_model *m, const char *name);

#endif
