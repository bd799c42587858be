/* The step-time projection (DESIGN.md §2, docs/plan.md "Projected step time"): each phase of a
 * training step from its FLOPs and bytes at the rates of a calibration table (fm_calib.h),
 * summed into a projected step time, tokens/s and MFU. Pure arithmetic: no device, no I/O.
 *
 * Per micro-batch of N = B T tokens, per layer (qd = heads x head_dim, kd = kv_heads x head_dim,
 * a the activation bytes):
 *   attention      forward 2 B T^2 qd FLOPs at att_fwd(T), backward 5 B T^2 qd at att_bwd(T)
 *   dense GEMMs    q/k/v/o and router, 2 N H (qd + 2 kd) + 2 N qd H + 2 N H E forward, twice that
 *                  backward, at gemm(N)
 *   expert GEMMs   2 N k 3 H I forward at expert_fwd(k c / E), twice that backward at
 *                  expert_bwd(k c / E), c the MoE chunk's tokens (N unchunked); the sm90
 *                  curves instead when req->expert_sync_free and the table has them, or under
 *                  req->expert_gemm_auto when they project this plan's experts faster
 *                  (fm_project_expert_sm90)
 *   memory traffic RMSNorms, residual adds, RoPE, router softmax, SwiGLU at elementwise_bw;
 *                  gather and combine at dispatch_bw; backward twice the forward's bytes
 *   recompute      a recomputed layer's forward again (without attention when it keeps it); a
 *                  non-recomputed layer under chunked MoE its expert forward again
 *   head           LM head 2 N H V forward + 4 N H V backward at gemm(rows), rows N (plain) or the
 *                  CE token block (linear CE, whose logits are formed twice); the loss's bytes
 *   offload        per offloaded boundary: N H a out at d2h in forward, hidden behind the next
 *                  layer's forward, and in at h2d in backward, hidden behind that layer's
 *                  recompute and backward: only the excess counts
 * Per step: grad_accum micro-batches, then the optimizer: on device P x fm_project_adamw_bytes at
 * adamw_bw (+ 2 a P at elementwise_bw: gradient zeroing and norm); streamed, the host link both
 * ways at the duplex rates against the GPU AdamW, pipelined over S >= 2 slots (the slower of them
 * plus one bucket's fill), serial with one slot.
 * With the optimizer overlap (fm_plan_req.optimizer_overlap) the update runs beside the next
 * step's forward: the on-device AdamW, bound by HBM bandwidth like the short-sequence forward, is
 * hidden only by the layers' attention forward; the streamed one, bound by the host link, by the
 * whole forward of the layers; only the excess counts.
 *
 * A mesh rank (req->mesh.on; fm_mesh_bound.h for the links): its N = B T / sp tokens everywhere,
 * but attention over the whole T with heads / sp (2 B T^2 qd / sp forward); expert GEMM rows per
 * expert k c ep / E (each owner gets c tokens' rows from every ep source, router balanced); the
 * optimizer over the rank's parameters (fm_plan.n_params_rank); MFU against world x peak. The
 * collectives, per micro-batch, and what hides them (assumptions, not measurements):
 *   ZeRO-3       per layer, all-gather of its non-expert weights (a x params) over W in forward
 *                and again in backward, reduce-scatter of its gradients in backward; layer l+1's
 *                gather runs on the communication stream during layer l's forward, l-1's gather
 *                and l's reduce-scatter during l's backward: only the excess over that layer's
 *                compute counts; the embedding's gather and reduce-scatter are not hidden. The
 *                experts' gradients (Θ_exp / ep) are all-reduced over the W / ep ranks holding the
 *                same experts once per step, hidden behind the last micro-batch's backward.
 *   EP           per layer 6 row all-to-alls of N k H a bytes (dispatch and combine forward; the
 *                recomputed dispatch, its return, dye out and dx back in backward), 2 more per
 *                recomputed layer; chunk i+1's exchange overlaps chunk i's expert GEMMs
 *                (PipelinedLLEP's schedule, issue 11 item 3; the CPU operator does not overlap
 *                yet): excess over the expert GEMMs counts, plus one chunk's exchange (the
 *                pipeline's fill); K = 1 hides nothing.
 *   SP           per layer, forward q, k, v to heads and o back, backward q, k, v, o again, do
 *                to heads and dq, dk, dv back: 6 (qd + kd') N a bytes x (sp-1)/sp (kd' the k/v
 *                width sent, sp x hd when k/v heads are replicated); on the critical path
 *                (attention waits for them): never hidden.
 *   ring         P - 1 hops each way of the Ring-DTP message (activations: N (H a + 16) forward,
 *                N (2 H a + 16) backward; weights: V/P H a, twice in backward), double-buffered
 *                behind the head's block GEMMs: the excess counts, plus the first hop.
 * Links: ring collectives at the slowest link of the group (inter_node_bw when it spans more than
 * gpus_per_node ranks), all-to-all by its on-node and off-node peers at once; no latency term
 * (small messages are rare here: the smallest are a layer's weights or a chunk's rows).
 */
#ifndef FM_PROJECT_H
#define FM_PROJECT_H

#include "fm_calib.h"
#include "fm_plan.h"

typedef enum fm_proj_phase {
    FM_PROJ_ATTENTION = 0, /* attention forward + backward (first forward only) */
    FM_PROJ_DENSE,         /* q/k/v/o projections and the router, forward + backward */
    FM_PROJ_EXPERTS,       /* grouped expert GEMMs, forward + backward */
    FM_PROJ_MEMORY,        /* elementwise, norms, RoPE, SwiGLU, dispatch traffic */
    FM_PROJ_HEAD,          /* LM head and cross-entropy (plain or linear) */
    FM_PROJ_RECOMPUTE,     /* recomputed layer forwards (attention included unless kept) */
    FM_PROJ_MOE_RECOMPUTE, /* the chunked MoE's expert forward again */
    FM_PROJ_OFFLOAD,       /* checkpoint-offload copies that their layer's compute does not hide */
    FM_PROJ_OPTIMIZER,     /* AdamW (on device or streamed), gradient zeroing and norm */
    /* mesh plans only (fm_plan_req.mesh.on): the collectives' time that compute does not hide */
    FM_PROJ_ZERO3,         /* ZeRO-3 all-gathers and reduce-scatters, the experts' all-reduce */
    FM_PROJ_EP,            /* expert-parallel dispatch and combine all-to-alls */
    FM_PROJ_SP,            /* Ulysses all-to-alls (sequence <-> heads) */
    FM_PROJ_RING,          /* the vocabulary ring's hops */
    FM_PROJ_PHASES
} fm_proj_phase;

extern const char *const fm_proj_phase_names[FM_PROJ_PHASES];

typedef struct fm_projection {
    double sec[FM_PROJ_PHASES]; /* per step (micro-batch phases times grad_accum) */
    double step_s;              /* their sum */
    double tokens_per_s;        /* tokens per step / step_s */
    double mfu;                 /* model FLOPs per step / step_s / peak_flops */
    double opt_link_s;          /* streamed optimizer: the link's share (0 on device) */
    double offload_copy_s;      /* checkpoint offload: all copy time, hidden or not */
    bool expert_sm90;           /* the expert GEMMs were timed at the sm90 curves
                                   (fm_project_expert_sm90) */
} fm_projection;

/* Bytes of device traffic per parameter of one AdamW step (read g, write p, read+write master
 * when a != 4, read+write m and v): 28 with fp32 moments on both builds, 20 with bf16 moments.
 * A bf16 state recipe (master_recipe, fm_master_recipe): read g, read+write p, read+write Kahan's
 * buffer (bf16-kahan), read+write m and v: 22 / 14 (Kahan), 18 / 10 (stochastic rounding) on bf16. */
double fm_project_adamw_bytes(int act_bytes, bool bf16_moments, int master_recipe);

/* Rows per expert of one MoE dispatch of plan p: k c ep / E, c the chunk's tokens (p->moe_c_eff,
 * N = B T / sp unchunked), ep the mesh's (1 off a mesh). */
double fm_project_rows_per_expert(const fm_plan_req *req, const fm_plan *p);

/* Seconds per step of the expert GEMMs alone (forward, backward, and the forwards recomputed:
 * the recomputed layers' and, chunked, every other layer's), the part of fm_project's expert GEMMs,
 * recompute and MoE chunk recompute phases they make up, at the table's sm90 curves (sm90 true;
 * cuBLAS's when the table has none) or its cuBLAS curves (expert_fwd/bwd). Never fails. */
double fm_project_expert_s(const fm_plan_req *req, const fm_plan *p, const fm_calib *c, bool sm90);

/* Whether fm_project times the expert GEMMs at the sm90 curves: the table has both and either
 * req->expert_sync_free (the run uses the kernel) or req->expert_gemm_auto, no --ep (req->ep and
 * a mesh's ep <= 1) and fm_project_expert_s(sm90) < fm_project_expert_s(cuBLAS) (ties: cuBLAS). */
bool fm_project_expert_sm90(const fm_plan_req *req, const fm_plan *p, const fm_calib *c);

/* Projects the step of plan `p` (computed from `req` by fm_plan_compute) at the rates of `c`.
 * The activation element size is the plan's target's. Never fails. */
void fm_project(const fm_plan_req *req, const fm_plan *p, const fm_calib *c, fm_projection *out);

/* --expert-precision fp8 on E4M3 codes at the table's fp8 curves: seconds of one layer's expert
 * weight quantization (gate, up, down: 3 (E/ep) H I elements, 4 bytes each, at c's
 * fp8_weight_quant_bw, elementwise_bw when the table has none); 0 on any other path. Each fp8 curve
 * point holds one such quantization (fm_calibrate.c), which the projection takes out and charges
 * fm_project_fp8_weight_sets times instead. Never fails. */
double fm_project_fp8_weight_quant_s(const fm_plan_req *req, const fm_calib *c);

/* Layer weight-code sets the run quantizes per micro-batch (model/fm_experts_fp8.c): with the
 * weight cache (req->layout.expert_fp8_cache) each layer's once a step, L / grad_accum; without it one at
 * each forward and recompute, and one at the backward of each layer that is not recomputed, but
 * the last layer's (its forward ran just before: fm_moe_ws.w8_holds). Never fails. */
double fm_project_fp8_weight_sets(const fm_plan_req *req, const fm_plan *p);

#endif
