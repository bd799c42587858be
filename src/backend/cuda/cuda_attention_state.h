/* The CUDA attention's state (C++ only), shared by the dispatcher (cuda_attention.cu) and the
 * cuDNN graph path (cuda_attention_cudnn.cu): the chosen path, the last paths taken, cuDNN's last
 * refusal and the cache of cuDNN plans, one per shape, built at its first call. */
#ifndef FM_CUDA_ATTENTION_STATE_H
#define FM_CUDA_ATTENTION_STATE_H

#include "cuda_attention.h"
#include "cuda_internal.h"

#ifndef FM_ATTENTION_NO_CUDNN
#define FM_ATT_CUDNN 1
#else
#define FM_ATT_CUDNN 0
#endif

#if FM_ATT_CUDNN
typedef cudnnBackendDescriptor_t BD;

enum { ATT_MAX_DESC = 160, ATT_MAX_PLANS = 16 };

/* The shape of one cuDNN call: B batch elements and nh query heads (nkv kv heads) of tensors
 * laid out with NH query heads and NKV kv heads per token (a chunk of a larger call, or all). */
typedef struct att_geom {
    int64_t B, T, nh, nkv, hd, NH, NKV;
} att_geom;

typedef struct att_plan {
    bool used, ok;
    int bwd, variant;
    att_geom geo;
    BD plan;
    int64_t ws;        /* the plan's own workspace */
    size_t off_dqacc;  /* backward: offsets of its fp32 tensors in c->cudnn_workspace */
    size_t off_dsum;
    size_t total;      /* bytes of c->cudnn_workspace in use */
    BD desc[ATT_MAX_DESC];
    int ndesc;
    uint64_t last_use;
} att_plan;
#endif

typedef struct att_state {
    fm_cuda_att_path path;
    int verbose;
    const char *last_fwd, *last_bwd;
    char note[768];
#if FM_ATT_CUDNN
    att_plan plans[ATT_MAX_PLANS];
    uint64_t tick;
#endif
} att_state;

#if FM_ATT_CUDNN
/* Runs one direction on cuDNN (cuda_attention_cudnn.cu), chunk by chunk; false: cuDNN does not
 * serve this call (nothing usable was written) and our kernels must. *nchunks: the calls made. */
bool fm_att_cudnn_run(fm_cuda_ctx *c, att_state *st, bool bwd, bf16 *out, float *lse, bf16 *dq, bf16 *dk, bf16 *dv,
                      const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *o, int64_t B,
                      int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t *nchunks);
/* Releases every cached plan. */
void fm_att_cudnn_free(att_state *st);
#endif

#endif
