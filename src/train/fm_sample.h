/* Text generation from a trained model: autoregressive sampling of one token at a time with a
 * softmax temperature and top-k truncation (Fan, Lewis & Dauphin, "Hierarchical Neural Story
 * Generation", arXiv 1805.04833, for top-k), or greedy decoding at temperature 0.
 *
 * Each token runs a full forward over the last min(n, T_cap) tokens of the sequence (no KV
 * cache): the window slides once the sequence is longer than the model's laid-out length.
 * Prompts are token ids (fm_sampler_init_ids, e.g. from a tokenizer) or byte-level text
 * (fm_sampler_init: each byte of the text is one token). */
#ifndef FM_SAMPLE_H
#define FM_SAMPLE_H

#include <stddef.h>

#include "../core/fm_rng.h"
#include "../model/fm_model.h"

typedef struct fm_sample_opts {
    double temperature;  /* >= 0; 0: greedy (the most likely token, the lowest id on ties) */
    int64_t top_k;       /* >= 0; sample among the k most likely tokens; 0 (or >= V): all */
    uint64_t seed;       /* seed of the sampling RNG (fm_rng) */
} fm_sample_opts;

/* A generation in progress. Fields are read-only for callers. */
typedef struct fm_sampler {
    fm_model *m;
    fm_sample_opts o;
    fm_rng rng;
    int32_t *seq;        /* [cap] the prompt's tokens, then the generated ones */
    int64_t n, cap;      /* tokens in seq; its capacity (prompt + max_new + 1) */
    int64_t max_new, generated; /* tokens asked for; generated so far */
    float *row;          /* [V] logits of the last position */
    float *probs;        /* [V] unnormalized probabilities of the candidates */
    int32_t *order;      /* [V] candidate token ids, most likely first within the top k */
} fm_sampler;

/* Starts a generation of up to max_new tokens after `prompt` (prompt_len bytes, each byte one
 * token; an empty prompt starts from a newline token, which is not part of the text) on model m,
 * whose activations must be laid out for micro-batch >= 1 (e.g. fm_load_for_inference with
 * B = 1); m must outlive the sampler. Allocates the sequence (prompt_len + max_new + 1 int32)
 * and three [V] buffers on the host.
 * Errors: FM_ERR_ARG for a negative max_new, temperature or top_k; FM_ERR_UNSUPPORTED when a
 * prompt byte is not below vocab_size ("prompt byte 200 is not below vocab_size 128");
 * FM_ERR_NOMEM. On error nothing is left allocated. */
fm_status fm_sampler_init(fm_sampler *s, fm_model *m, const char *prompt, size_t prompt_len, int64_t max_new,
                          const fm_sample_opts *o);

/* As fm_sampler_init with the prompt given as n token ids (n >= 1).
 * Errors: FM_ERR_ARG for n < 1 or negative max_new, temperature or top_k; FM_ERR_UNSUPPORTED when
 * a prompt id is outside [0, vocab_size) ("prompt token 3 has id 70000, not below vocab_size
 * 50304": the tokenizer does not belong to the model); FM_ERR_NOMEM. */
fm_status fm_sampler_init_ids(fm_sampler *s, fm_model *m, const int32_t *ids, int64_t n, int64_t max_new,
                              const fm_sample_opts *o);

/* Generates the next token: a forward of the model over the last min(n, T_cap) tokens, then
 * fm_sample_pick on the last position's logits; appends it and writes it to *token (an id in
 * [0, V)). Allocates nothing. Errors: FM_ERR_ARG when max_new tokens were already generated;
 * FM_ERR_NUMERIC when a logit is NaN or infinite (naming the token id and the value; nothing is
 * appended), as `eval` refuses a non-finite loss. */
fm_status fm_sampler_next(fm_sampler *s, int32_t *token);

/* Releases what fm_sampler_init allocated (not the model). Safe on a zeroed sampler. */
void fm_sampler_free(fm_sampler *s);

/* Picks a token from logits[V] (fp32): at temperature 0 the arg-max (first on ties); otherwise
 * the k = top_k (V when 0 or >= V) largest logits are selected (partial selection sort, in
 * order, the first on ties), weighted exp((logit - max) / temperature), and one is drawn with
 * one fm_rng_uniform_d from rng (the last candidate if rounding leaves the draw past the sum).
 * probs[V] and order[V] are scratch. Allocates nothing. */
int32_t fm_sample_pick(const float *logits, int64_t V, double temperature, int64_t top_k, fm_rng *rng, float *probs,
                       int32_t *order);

/* fm_sample_pick with nucleus (top-p) truncation after top-k (Holtzman et al., "The Curious Case
 * of Neural Text Degeneration", arXiv 1904.09751): top_p >= 1 (or temperature 0) is exactly
 * fm_sample_pick, the same draws. top_p in (0, 1): the k candidates are sorted by logit (heap
 * sort, the lower id first on ties), weighted as above, and the smallest prefix whose weight
 * reaches top_p of their sum (at least one token) is kept; one fm_rng_uniform_d draws among it.
 * probs[V] and order[V] are scratch. Allocates nothing. */
int32_t fm_sample_pick_p(const float *logits, int64_t V, double temperature, int64_t top_k, double top_p, fm_rng *rng,
                         float *probs, int32_t *order);

#endif
