/* Aux-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437 §2.1.2; Megatron-Core's
 * --moe-router-enable-expert-bias / --moe-router-bias-update-rate): after each optimizer step,
 * every MoE layer's selection bias (e_score_correction_bias, the sigmoid router's: fm_router.h)
 * moves by a fixed rate against the step's load,
 *   b_e += rate * sign(mean_e' load_e' - load_e),
 * with load_e the routes to expert e over the step's micro-batches and every rank (the trainer's
 * expert-load counts, all-reduced over the world before this runs), so every rank computes the
 * same bias. The bias steers the selection only (its gradient is zero; the optimizer leaves it as
 * it is: fm_params.h's buffer), and is saved and restored with the weights under its Hugging Face
 * name. */
#ifndef FM_ROUTER_BIAS_H
#define FM_ROUTER_BIAS_H

#include "../model/fm_model.h"

/* Whether the update can run on this model's state: the bias in an fp32 master in backend memory
 * (not ZeRO-3's shards, not the streamed optimizer's host master, not a bf16 weights-only
 * recipe). Errors: FM_ERR_UNSUPPORTED naming the option that prevents it and the fix; FM_ERR_ARG
 * for a rate that is negative or not finite, or a positive rate on a model without the sigmoid
 * router (naming --moe-router-bias-update-rate). rate 0: FM_OK whatever the model. */
fm_status fm_router_bias_check(const fm_model *m, double rate, bool zero3, bool no_master);

/* The update above on every MoE layer of m with a selection bias, from counts [L][E] (host, the
 * step's routes per expert of every layer over every rank; a dense layer's row unread), in fp32
 * arithmetic on the master: b + (float)(rate * sign), then the weights converted from the master
 * (on a GPU: a sync of every stream first, then a copy to and from the device per layer: host
 * syncs at the step's end, after the optimizer, only when rate > 0). tmp [E] floats of host
 * scratch. Nothing when rate is 0. */
void fm_router_bias_update(fm_model *m, const int64_t *counts, double rate, float *tmp);

#endif
