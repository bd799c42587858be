/* GPT-OSS's router (transformers' GptOssTopKRouter): a Linear with a bias, logits = x W^T + b
 * (fp32), the top-k logits softmaxed. flatmoe's softmax router with norm_topk computes the same
 * weights (softmax over all E, top-k, divided by their sum: exp(l_i) / sum over the k of
 * exp(l_j)), so this is fm_router_forward / fm_router_backward with the bias added to the logits
 * and its gradient, the column sums of the logit gradient. */
#ifndef FM_ROUTER_OSS_H
#define FM_ROUTER_OSS_H

#include "fm_router.h"

/* fm_router_forward's contract (fm_router.h) for the softmax router, with logits [N,E] fp32 =
 * x W^T + b, b [E] fm_act. Errors: fm_router_forward's; FM_ERR_UNSUPPORTED when the backend has no
 * bias_add_f32 or the router is not the softmax one. */
fm_status fm_router_oss_forward(const fm_backend *be, const fm_router_opts *o, const fm_comm *comm, float *logits,
                                fm_router_saved *s, double *lse_sq, double *terms, const fm_act *x, const fm_act *W,
                                const fm_act *b, int64_t N, int64_t H, const int32_t *replay);

/* After fm_router_backward (which leaves the fm_act logit gradient in dlogits_act [N,E]):
 * db [E] += sum over n of dlogits_act[n,:] (bias_grad). */
void fm_router_oss_bias_backward(const fm_backend *be, fm_act *db, const fm_act *dlogits_act, int64_t N, int64_t E);

#endif
