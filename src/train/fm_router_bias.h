/* Aux-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437 §2.1.2; Megatron-Core's
 * --moe-router-enable-expert-bias / --moe-router-bias-update-rate): after each optimizer step,
 * every MoE layer's selection bias (e_score_correction_bias, the sigmoid router's: fm_router.h)
 * moves by a fixed rate against the step's load,
 *   b_e += rate * sign(mean_e' load_e' - load_e),
 * with load_e the routes to expert e over the step's micro-batches and every rank (the trainer's
 * expert-load counts, all-reduced over the world before this runs), so every rank computes the
 * same bias. The bias steers the selection only (its gradient is zero; the optimizer leaves it as
 * it is: fm_params.h's buffer), and is saved and restored with the weights under its Hugging Face
 * name.
 *
 * Under ZeRO-3 (--zero 3, train/fm_zero3.h) the bias is a few elements of its layer's group,
 * sharded like the rest: the loads are the same on every rank (all-reduced), so each rank moves
 * the elements of the bias that lie in its own shard (master and weights) and the next gather
 * assembles exactly the replicated update; no collective is added. */
#ifndef FM_ROUTER_BIAS_H
#define FM_ROUTER_BIAS_H

#include "../model/fm_model.h"
#include "fm_zero3.h"

/* Whether the update can run on this model's state: the bias in an fp32 master in backend memory,
 * replicated or in ZeRO-3's shards. Refused: the streamed optimizer's master (--offload-optimizer,
 * m->p.master_host: each bucket's fp32 master lives in pinned host memory or, for the resident
 * fraction, in the optimizer's own device buffer, so the model's master pointer is not where the
 * bias's master is between saves; moving it needs the optimizer's bucket map, not built), and the
 * bf16 weights-only recipes (no_master: the bias would be a bf16 value moved by +-rate, and a bf16
 * step of 1e-3 is lost entirely by round-to-nearest once |b| >= 0.5, whose half-ulp is 2^-9 =
 * 0.00195, so the bias would stall; the recipe's Kahan buffer or stochastic rounding would have to
 * carry it). Errors: FM_ERR_UNSUPPORTED naming the option that prevents it and the fix; FM_ERR_ARG
 * for a rate that is negative or not finite, or a positive rate on a model without the sigmoid
 * router (naming --moe-router-bias-update-rate). rate 0: FM_OK whatever the model. */
fm_status fm_router_bias_check(const fm_model *m, double rate, bool no_master);

/* The update above on every MoE layer of m with a selection bias, from counts [L][E] (host, the
 * step's routes per expert of every layer over every rank; a dense layer's row unread), in fp32
 * arithmetic on the master: b + (float)(rate * sign), then the weights converted from the master
 * (on a GPU: a sync of every stream first, then a copy to and from the device per run of the
 * bias's elements this rank holds: host syncs at the step's end, after the optimizer, only when
 * rate > 0). z3: ZeRO-3's layout when the model's master and weights are its shards (NULL:
 * replicated); only the elements this rank owns are moved. tmp [E] floats of host scratch.
 * Nothing when rate is 0. */
void fm_router_bias_update(fm_model *m, const fm_zero3 *z3, const int64_t *counts, double rate, float *tmp);

#endif
