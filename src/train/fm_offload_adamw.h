/* OffloadStreamAdamW (arXiv 2609.14306): AdamW whose fp32 master weights and Adam moments live in
 * pinned host memory and stream through S device staging slots of beta parameters each, bucket
 * by bucket along the flat parameter order.
 *
 * Per bucket b of up to beta parameters (a range of elements; the backend's adamw is launched
 * once per contiguous run of tensors with the same weight-decay flag inside it), in slot
 * s = b mod S:
 *   copy-in stream:  waits for the copy-out that last used slot s; master, m, v host -> slot;
 *   compute stream:  waits for that copy-in; adamw on the slot (gradients from the parameter
 *                    store's grads, weights written in place into the store's weights);
 *   copy-out stream: waits for that update; master, m, v slot -> host.
 * The copy streams are the optimizer's own (FM_STREAM_OPT_COPY_IN/OUT): under the optimizer
 * overlap a step's whole state traffic is queued at once, and the next forward's checkpoint
 * offload (src/schedule/fm_sco.c, FM_STREAM_COPY_OUT) must not wait behind it.
 * Events (fm_backend.h): FM_EVENT_FIRST_FREE + 8 + 3 s + {0 copy-in done, 1 update done,
 * 2 copy-out done}; src/schedule/fm_sco.c uses FM_EVENT_FIRST_FREE + 0..3, so ours start at +8.
 * Global-norm clipping is exact: the clip scale is step_range's argument, computed before.
 *
 * Bounds (DESIGN.md §2), with a = bytes per fm_act (2 on CUDA, 4 on the CPU) and mb = moment
 * bytes (4, or 2 with bf16 moments), n = params, beta' = min(beta, n):
 *   device: the parameter store without its master, 2 r(n a) (4 B/param on CUDA, 8 on the CPU),
 *           plus staging S (r(beta' 4) + 2 r(beta' mb)) (fm_offload_adamw_state_bytes);
 *   host (pinned): r(n 4) + 2 r(n mb): 12 B/param, 8 with bf16 moments
 *           (fm_offload_adamw_host_bytes). r() rounds to the arena's alignment.
 *
 * The CPU build: fm_act is fp32, so the store's weights could be the master; the streamed
 * optimizer still keeps its own master in its host arena (the model's master view points at it,
 * as on CUDA) and writes the weights from it each step (adamw with a master: w = master,
 * p = w). Every element goes through the same fp32 operations as fm_adamw_ops, so weights,
 * master, m and v are bit-identical to it (tests/test_offload_adamw.c).
 *
 * Partial offload (--optimizer-offload-fraction F; the anchor: Megatron-Core's
 * --optimizer-cpu-offload --optimizer-offload-fraction, megatron/core/optimizer/cpu_offloading/
 * hybrid_optimizer.py, which offloads whole tensors in parameter order until F of the count is on
 * the host and updates them with a CPU AdamW): of the nb = ceil(n / beta) buckets of the flat
 * order, the last s = ceil(F nb) (at least 1) stream as above; the first nb - s keep their fp32
 * master, m and v resident on the device, R = (nb - s) beta parameters [0, R), and are updated
 * there by the same adamw op over the same elements with the same arguments, so weights, master,
 * m and v are bit-identical to F = 1 and to fm_adamw_ops by construction. The first buckets are
 * the resident ones: the next forward needs the embedding and the first layers first. Bounds with
 * R resident (R = 0: the whole state streams, the formulas above), beta'' = min(beta, n - R):
 *   device: 2 r(n a) + r(R 4) + 2 r(R mb) + S (r(beta'' 4) + 2 r(beta'' mb));
 *   host (pinned): r(n 4) + 2 r((n - R) mb): the moments of the streamed part only; the master
 *           stays whole on the host, as the model's master view (m->p.master: the weights' init,
 *           --init-from and checkpoint loads write it and the weights are converted from it),
 *           its resident part a mirror: the device's copy is the one updated; state_tensors copies
 *           it back to the host (a synchronous copy: call it after a sync, as a checkpoint does)
 *           and the next step_begin copies the host's in again (the host's is then the newer:
 *           after the init, a load or a save; one copy of r(R 4) bytes, waited on by the first
 *           resident update through FM_OFFLOAD_PULL_EVENT).
 *
 * Checkpoints: state_tensors names "master.", "exp_avg." and "exp_avg_sq." in host memory
 * (fm_optim_state.host); with R > 0 the moments' first R elements are the device's
 * (fm_optim_state.dev, dev_len). The checkpoint format is fm_adamw_ops's, so a run may switch
 * the offload on or off, or change F or the bucket, on resume. */
#ifndef FM_OFFLOAD_ADAMW_H
#define FM_OFFLOAD_ADAMW_H
#include "../plan/fm_plan.h"
#include "fm_optim.h"

#define FM_OFFLOAD_MAX_SLOTS 16
#define FM_OFFLOAD_DEFAULT_BUCKET 100000000LL /* parameters per bucket (100M) */
#define FM_OFFLOAD_EVENT0 (FM_EVENT_FIRST_FREE + 8) /* after fm_sco.c's 4 events */
/* the resident master's copy-in (after the slots' 3 x 16 events; below fm_moe_ep.h's) */
#define FM_OFFLOAD_PULL_EVENT (FM_OFFLOAD_EVENT0 + 3 * FM_OFFLOAD_MAX_SLOTS)

typedef struct fm_offload_adamw {
    fm_adamw *adam;          /* hyper-parameters, moments dtype and the step counter (m, v unused) */
    int64_t bucket, n_params; /* beta' = min(beta, n_params) */
    int slots;
    fm_backend be;
    int64_t resident;        /* R: parameters [0, R) keep their state on the device (whole buckets) */
    fm_arena host;           /* pinned: master [n] fp32, m, v [n - R] of moments dtype (element i of
                                h_m, h_v is parameter R + i) */
    float *h_master;
    void *h_m, *h_v;
    float *d_res_master;     /* [R] the resident master, m, v (from the store's arena; NULL when R = 0) */
    void *d_res_m, *d_res_v;
    bool pull;               /* the host master's [0, R) is newer than d_res_master: copy it in at
                                the next step_begin */
    bool pull_wait;          /* that copy is issued: the first resident update waits for it */
    float *d_master[FM_OFFLOAD_MAX_SLOTS]; /* staging slots [beta'] (taken from the store's arena) */
    void *d_m[FM_OFFLOAD_MAX_SLOTS], *d_v[FM_OFFLOAD_MAX_SLOTS];
    int64_t bucket_no;       /* buckets issued so far: the slot rotation continues across calls */
    bool used[FM_OFFLOAD_MAX_SLOTS]; /* slot has a copy-out event to wait for */
    bool step_fresh;         /* step_begin ran and no bucket of the step was issued yet: the step's
                                first copy-in waits for the previous step's last copy-out (the copy-out
                                stream is in order, so that covers every write of the host state) */
} fm_offload_adamw;

extern const fm_optimizer_ops fm_offload_adamw_ops;

/* Device bytes of the staging slots (taken from the parameter store's arena by init):
 * S (r(beta' 4) + 2 r(beta' mb)), beta' = min(bucket, n_params). */
size_t fm_offload_adamw_state_bytes(int64_t n_params, int64_t bucket, int64_t slots, bool bf16_moments);
/* Pinned host bytes: r(n 4) + 2 r(n mb). */
size_t fm_offload_adamw_host_bytes(int64_t n_params, bool bf16_moments);

/* (the split of fraction F into buckets: fm_offload_buckets ... in plan/fm_plan.h) */
/* Device bytes with R resident: r(R 4) + 2 r(R mb) + S (r(beta'' 4) + 2 r(beta'' mb)),
 * beta'' = min(bucket, n - R) (R in [0, n)). */
size_t fm_offload_adamw_state_bytes_split(int64_t n_params, int64_t bucket, int64_t slots, bool bf16_moments,
                                          int64_t resident);
/* Pinned host bytes with R resident: r(n 4) + 2 r((n - R) mb). */
size_t fm_offload_adamw_host_bytes_split(int64_t n_params, bool bf16_moments, int64_t resident);

/* Configures over adam (its hyper-parameters and step; fm_adamw_config first) and allocates the
 * pinned host arena for n_params (zeroed). bucket >= 1 parameters, slots in [1, 16]. Errors:
 * FM_ERR_ARG for bad bucket/slots, FM_ERR_NOMEM naming the host bytes. The host master is
 * opt->h_master: give it to fm_param_store_create_host_master. */
fm_status fm_offload_adamw_create(fm_offload_adamw *opt, fm_adamw *adam, int64_t n_params, int64_t bucket,
                                  int64_t slots, const fm_backend *be);
/* The same with the last ceil(F nb) buckets streamed and the first resident (F in (0, 1]; 1: as
 * fm_offload_adamw_create). Errors: as fm_offload_adamw_create, and FM_ERR_ARG for F outside
 * (0, 1] naming --optimizer-offload-fraction. */
fm_status fm_offload_adamw_create_split(fm_offload_adamw *opt, fm_adamw *adam, int64_t n_params, int64_t bucket,
                                        int64_t slots, double fraction, const fm_backend *be);
/* Frees the host arena (before the backend). Safe on a zeroed struct. */
void fm_offload_adamw_free(fm_offload_adamw *opt);

/* The model-state live set's device bound with the streamed optimizer (the plan's
 * offload_state_bytes): the store without master, the resident state of fraction F's resident
 * buckets (F <= 0 or >= 1: none) and the staging; *host gets the host bytes; desc (200 bytes) the
 * formula in words. */
size_t fm_offload_model_state_bound(const fm_config *cfg, size_t act_bytes, bool bf16_moments, int64_t bucket,
                                    int64_t slots, double fraction, size_t *host, char desc[200]);
#endif
