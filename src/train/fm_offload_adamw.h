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
 * Checkpoints: state_tensors names "master.", "exp_avg." and "exp_avg_sq." in host memory
 * (fm_optim_state.host); the checkpoint format is fm_adamw_ops's, so a run may switch the
 * offload on or off on resume. */
#ifndef FM_OFFLOAD_ADAMW_H
#define FM_OFFLOAD_ADAMW_H
#include "fm_optim.h"

#define FM_OFFLOAD_MAX_SLOTS 16
#define FM_OFFLOAD_DEFAULT_BUCKET 100000000LL /* parameters per bucket (100M) */
#define FM_OFFLOAD_EVENT0 (FM_EVENT_FIRST_FREE + 8) /* after fm_sco.c's 4 events */

typedef struct fm_offload_adamw {
    fm_adamw *adam;          /* hyper-parameters, moments dtype and the step counter (m, v unused) */
    int64_t bucket, n_params; /* beta' = min(beta, n_params) */
    int slots;
    fm_backend be;
    fm_arena host;           /* pinned: master [n] fp32, m, v [n] of moments dtype */
    float *h_master;
    void *h_m, *h_v;
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

/* Configures over adam (its hyper-parameters and step; fm_adamw_config first) and allocates the
 * pinned host arena for n_params (zeroed). bucket >= 1 parameters, slots in [1, 16]. Errors:
 * FM_ERR_ARG for bad bucket/slots, FM_ERR_NOMEM naming the host bytes. The host master is
 * opt->h_master: give it to fm_param_store_create_host_master. */
fm_status fm_offload_adamw_create(fm_offload_adamw *opt, fm_adamw *adam, int64_t n_params, int64_t bucket,
                                  int64_t slots, const fm_backend *be);
/* Frees the host arena (before the backend). Safe on a zeroed struct. */
void fm_offload_adamw_free(fm_offload_adamw *opt);

/* The model-state live set's device bound with the streamed optimizer (the plan's
 * offload_state_bytes): the store without master plus the staging; *host gets the host bytes;
 * desc (200 bytes) the formula in words. */
size_t fm_offload_model_state_bound(const fm_config *cfg, size_t act_bytes, bool bf16_moments, int64_t bucket,
                                    int64_t slots, size_t *host, char desc[200]);
#endif
