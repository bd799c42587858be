/* The planner (DESIGN.md §2): from the configuration and the run flags alone, a byte bound for
 * every live set, their sum, and the FLOPs of a step. Runs no model, reads no data. The chooser
 * that fits the budgets is fm_choose.h, the step-time projection fm_project.h, the printed
 * report fm_plan_report.h.
 *
 * Each live set's bound comes from the function that owns it: the model's (boundaries, layer
 * activations, working set, plain vocabulary projection), the bounded operators' (expert
 * dispatch: fm_moe_routes_bytes / fm_moe_ws_bytes), the optimizer's and the backend's
 * (attention tiles). The trainer allocates exactly these bytes (its layout is checked against
 * this plan by test_plan).
 */
#ifndef FM_PLAN_H
#define FM_PLAN_H

#include <stdio.h>

#include "../model/fm_model.h"

/* The planner's live sets: the model's arenas plus the backend's attention scratch. */
#define FM_PLAN_ATTENTION FM_LIVE_COUNT
#define FM_PLAN_SETS (FM_LIVE_COUNT + 1)

/* The backend a plan is for: this build's, or another (so a CPU machine can plan a GPU run). */
typedef enum fm_plan_target {
    FM_PLAN_TARGET_BUILD = 0, /* this binary's backend */
    FM_PLAN_TARGET_CPU,       /* fp32 activations, CPU attention tiles */
    FM_PLAN_TARGET_CUDA,      /* bf16 activations, the CUDA backend's fixed workspaces */
} fm_plan_target;

/* The mesh a rank is one of (DESIGN.md §6; plan/fm_mesh.h plans and chooses it). A zeroed one
 * (on false): one rank, the plan as before. world = dp x sp ranks; ep divides the world; rank
 * layout: sp innermost (rank = dp_index x sp + sp_index), ep groups blocks of ep consecutive ranks. */
typedef struct fm_mesh_dims {
    bool on;               /* plan one rank of this mesh (ZeRO-3 over dp x sp) */
    int64_t dp, ep, sp;    /* data-parallel, expert-parallel and sequence-parallel degrees (>= 1) */
    int64_t gpus_per_node; /* ranks per node: which links the collectives cross (>= 1) */
} fm_mesh_dims;

/* How the model state is laid out over the ranks: the arguments the model-state bound is asked
 * with (fm_plan_req.model_state_bytes). A zeroed one: one rank, every expert. */
typedef struct fm_state_layout {
    int ranks; /* ranks of the world the state may be sharded over (dp x sp; 0 or 1: one) */
    int zero;  /* ZeRO stage: 0 replicas, 1 Adam state sharded, 3 everything sharded */
    int ep;    /* expert-parallel degree (0 or 1: every rank holds every expert) */
    int master_recipe; /* fm_master_recipe (backend/fm_adamw_lowp.h, --master-weights): 0 fp32 master */
} fm_state_layout;

typedef struct fm_plan_req {
    fm_config cfg;
    int64_t B, T;              /* micro-batch, sequence length */
    int64_t grad_accum;        /* for tokens and FLOPs per step */
    const bool *recompute;     /* [L] or NULL: none */
    int64_t moe_chunk_tokens;  /* 0: plain MoE twin */
    int64_t ce_block_tokens, ce_block_vocab; /* both 0: plain logits; else linear CE blocks */
    int threads;               /* CPU threads (attention scratch is per thread); 0: all */
    int64_t att_tile_q, att_tile_kv; /* CPU attention tile (0: 64 x 64) */
    fm_plan_target target;     /* the backend the run will use (default: this build's) */
    size_t gpu_workspace;      /* CUDA: bytes of the cuDNN workspace (0: the planner sizes it) */
    bool bf16_moments;         /* AdamW moments in bf16 (4 B/param) instead of fp32 (8) */
    /* The model-state live set's bound for activations of act_bytes over the layout `lay`
     * (&state_layout below; the parameter store's and the optimizer's, train/fm_optim.h:
     * fm_model_state_bound), desc (200 bytes) its formula in words. The planner asks its caller:
     * plan/ sits below train/ and includes nothing of it. Required. */
    size_t (*model_state_bytes)(const fm_config *cfg, const fm_state_layout *lay, size_t act_bytes, bool bf16_moments,
                                char desc[200]);
    fm_state_layout state_layout; /* the arguments model_state_bytes is called with */
    int64_t n_offloaded_boundaries; /* checkpoint offload (schedule/fm_sco.h, --offload-boundaries):
                                       boundaries 0 .. n-1 on the host, 2 device slots; 0: off */
    /* The streamed AdamW (train/fm_offload_adamw.h, --offload-optimizer): master, m, v on the
     * host; the model state's device bound is then offload_state_bytes's (the store without
     * master plus the staging slots), and its host bytes join host_bytes. */
    bool offload_optimizer;
    int64_t offload_bucket, offload_slots; /* parameters per bucket (>= 1), staging slots */
    double offload_fraction;    /* --optimizer-offload-fraction F: the last ceil(F nb) buckets stream,
                                   the first keep their state on the device (fm_offload_resident_params);
                                   0 or 1: all stream. The chooser picks it unless fix_offload_fraction */
    /* Required when offload_optimizer (train/fm_offload_adamw.h: fm_offload_model_state_bound). */
    size_t (*offload_state_bytes)(const fm_config *cfg, size_t act_bytes, bool bf16_moments, int64_t bucket,
                                  int64_t slots, double fraction, size_t *host, char desc[200]);
    const bool *keep_attention; /* [L] or NULL: recomputed layers that keep their attention output
                                   and lse (schedule/fm_recompute.h, --recompute-keep-attention);
                                   the chooser keeps it as given and picks recompute under it */
    int train_dp, train_zero;   /* the trainer run's --dp and --zero: the "train flags" line, and the
                                   step's tokens (dp x B x T x grad_accum) and the devices its MFU
                                   is per (0: not given, one; the bounds come from model_state_bytes) */
    bool expert_sync_free;      /* CUDA: the expert GEMMs run as the sm90 kernel (FLATMOE_EXPERT_GEMM=sm90
                                   where fm_cuda_sm90_expert_gemm_serves, or auto's choice): the
                                   projection times them at the calibration's sm90 curves when the
                                   table has them */
    bool expert_gemm_auto;      /* CUDA, FLATMOE_EXPERT_GEMM=auto with the sm90 kernel a candidate
                                   (fm_expert_choice_prepare, plan/fm_expert_choice.h): the projection
                                   times the expert GEMMs in whichever form the table projects faster
                                   at this plan's rows per expert (fm_project_expert_s; ties cuBLAS),
                                   so the chooser weighs each candidate chunk at its better form;
                                   fm_expert_choice_finish settles it into expert_sync_free */
    bool expert_fp8;            /* --expert-precision fp8: the expert live set holds the quantized
                                   weights and operands (fm_moe_ws_bytes's fp8 term; not with ep > 1) */
    bool expert_fp8_codes;      /* with expert_fp8: the E4M3 code operands of the fast path instead
                                   of the emulation's copies (fm_layout_opts.expert_fp8_codes) */
    fm_layout_opts layout;      /* the layout knobs given as the model takes them (model/fm_acts.h;
                                   the trainer copies its flags' struct whole): read here are
                                   layout.expert_fp8_cache (with expert_fp8_codes: every layer's
                                   weight codes kept for the step); the fields above that the
                                   chooser picks (recompute, chunk cap, CE blocks, ...) are not yet
                                   moved in */
    bool expert_fp8_cache_auto; /* with expert_fp8_codes and !layout.expert_fp8_cache: fm_plan_fit turns
                                   the cache on when the plan it chose still fits with it, its other
                                   knobs unchanged (neither --fp8-weight-cache nor
                                   --no-fp8-weight-cache given) */
    bool optimizer_overlap;     /* the update overlaps the next step's forward (train/fm_optim_overlap.h):
                                   the projection counts only the part of the optimizer's time
                                   longer than one micro-batch's forward */
    fm_mesh_dims mesh;          /* on: the plan is per rank of this mesh; T stays the whole
                                   sequence (each rank holds T / sp of its tokens) and
                                   model_state_bytes is not asked (fm_mesh_plan_sets) */
    /* Expert parallelism (--ep; bounded/fm_moe_ep.h). ep > 1: the expert-dispatch live set is
     * the EP operator's chunk working set, fm_moe_ep_bound_bytes for the cap c = moe_chunk_tokens
     * (0: N, one chunk) and llep, its host part joins the pinned host bytes the model's layout
     * takes; the model state's bound is model_state_bytes's, which the caller gives for this
     * rank's E/ep experts (train/fm_train_ep.h). 0 or 1: the local dispatch. */
    int ep;
    const fm_llep_opts *llep;   /* least-loaded placement (NULL or .on false: plain EP) */
    int64_t sp;                 /* Ulysses sequence parallelism (model/fm_attn_sp.h, --sp; 0 or 1:
                                   off): every activation live set is this rank's T/sp tokens per
                                   sequence; the working set adds the head-sharded attention
                                   buffers and the all-to-all blocks (fm_attn_sp_bytes); the
                                   attention workspace is planned for [B, T, nh/sp heads]. T must
                                   be divisible by sp (fm_attn_sp_check) */
    int64_t max_position_embeddings_flag; /* the run's --max-position-embeddings (0: not given): the
                                   train flags line repeats it (cfg holds the value already) */
    int64_t vocab_ring;         /* the trainer's --vocab-parallel ring over this many ranks (the world,
                                   dp x sp; 0 or 1: off; needs the linear CE's blocks > 0): the
                                   vocabulary live set is Ring-DTP's bound, fm_model_vocab_ring_bytes
                                   (one V/P x H shard or one token block in flight, never the whole
                                   head's strip); not with mesh.on (a mesh always plans the ring) */
} fm_plan_req;

typedef struct fm_plan {
    size_t bytes[FM_PLAN_SETS];     /* bound per live set */
    char inputs[FM_PLAN_SETS][200]; /* the formula and its inputs, for printing */
    size_t total;
    int64_t n_params, n_active;
    int64_t n_recomputed;           /* layers recomputed in backward */
    int64_t n_keep_attention;       /* of them, layers that keep their attention (no attention
                                       forward in their recompute) */
    int64_t moe_K, moe_c_eff;       /* chunks, tokens per chunk */
    int64_t tokens_per_step;
    double flops_model_token;       /* 6*N_active + 6*L*nh*hd*T/2*2 (causal) per token */
    double flops_hw_token;          /* + recomputed forwards (layers, less the attention forward of
                                       keep-attention layers; MoE chunks) */
    size_t gpu_workspace;           /* CUDA: the cuDNN workspace the run creates (0 on the CPU) */
    bool bf16_moments;              /* the request's AdamW moments are bf16 */
    size_t host_bytes;              /* pinned host memory: the offloaded boundaries (fm_sco_host_bytes)
                                       plus the streamed optimizer's state; not in total, which is
                                       device memory */
    size_t host_optimizer_bytes;    /* of host_bytes, the streamed optimizer's (0: not offloaded) */
    int64_t offload_buckets, offload_streamed_buckets; /* the streamed optimizer's nb and s (0: not offloaded) */
    int64_t offload_resident;       /* its parameters whose state stays on the device, [0, R) */
    int64_t n_offloaded_boundaries;
    /* mesh plans only (req->mesh.on; 0 otherwise): the communication buffers' bound (in total),
     * its formula, and the parameters this rank updates (its ZeRO-3 shard and its experts) */
    size_t comm_bytes;
    char comm_inputs[200];
    int64_t n_params_rank;
} fm_plan;

/* Checks that a shape is one flatmoe can index: B, T >= 1, B*T*top-k routes < 2^31 (int32 route
 * ids), B*T*vocab < 2^62. Errors: FM_ERR_ARG naming --seq-len/--micro-batch. */
fm_status fm_plan_check_shape(const fm_config *cfg, int64_t B, int64_t T);

/* Computes the plan. Never fails for a parsed config and a shape that passed
 * fm_plan_check_shape. */
void fm_plan_compute(const fm_plan_req *req, fm_plan *out);

/* budget == 0: always fits. Otherwise FM_ERR_NOMEM with a message naming the total, the budget
 * (`flag_budget` names it) and the largest live set; fm_plan_fit (fm_choose.h) adds the advice. */
fm_status fm_plan_check(const fm_plan *p, size_t budget, const char *flag_budget);

/* The name of live set i (< FM_PLAN_SETS): fm_live_set_names, or "attention tiles". */
const char *fm_plan_set_name(int i);

/* The streamed optimizer's buckets (train/fm_offload_adamw.h, --optimizer-offload-fraction F):
 * the flat order in nb = ceil(n / beta') buckets, beta' = min(bucket, n) (n, bucket >= 1). */
int64_t fm_offload_buckets(int64_t n_params, int64_t bucket);
/* The buckets that stream for fraction F, the last ones: ceil(F nb) in [1, nb] (F <= 0 or >= 1:
 * all of them). F nb is rounded up past a 1e-9 slack, so F = s / nb gives s again. */
int64_t fm_offload_streamed_buckets(int64_t n_params, int64_t bucket, double fraction);
/* R, the parameters [0, R) whose state stays on the device for fraction F: (nb - s) beta'. */
int64_t fm_offload_resident_params(int64_t n_params, int64_t bucket, double fraction);

/* Smallest MoE chunk the chooser considers (tokens); --moe-chunk-tokens may go lower. */
#define FM_PLAN_MIN_CHUNK 256

/* Parses a byte count: a number with an optional suffix B, K/KiB, M/MiB, G/GiB, T/TiB (powers
 * of 1024) or KB, MB, GB, TB (powers of 1000). Errors: FM_ERR_ARG naming `flag`. */
fm_status fm_parse_bytes(const char *s, const char *flag, size_t *out);

#endif
