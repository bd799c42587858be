/* State recipes of the optimizer (--master-weights; DESIGN.md §2 "model state", §5) and the
 * counter-based random bits of stochastic rounding, shared by the CPU and CUDA backends' AdamW on
 * bf16 weights (fm_backend.h: adamw_bf16w) and by the planner (bytes per parameter).
 *
 * - FM_MASTER_FP32: an fp32 master copy beside the fm_act weights (today's default; on the CPU
 *   build the fp32 weights are their own master).
 * - FM_MASTER_BF16_KAHAN: bf16 weights and a bf16 compensation buffer; the update is added with
 *   Kahan summation (Zamirai et al. 2020, "Revisiting BFloat16 Training", arXiv 2010.06192, §4;
 *   the form of optimi's and torchao's AdamW: c += d; w' = bf16(w + c); c += w - w').
 * - FM_MASTER_BF16_SR: bf16 weights updated with stochastic rounding (Zamirai et al. §4): w + d in
 *   fp32, rounded up with probability (dropped low 16 bits) / 2^16, so that E[w'] = w + d.
 *
 * The random bits are a pure function of (seed, step, flat parameter index): SplitMix64's
 * finalizer (Steele, Lea & Flood 2014, "Fast Splittable Pseudorandom Number Generators") over the
 * key and the index, so any split of the parameters into launches, buckets or shards gives the
 * same bits, runs are reproducible and a resume (which restores the step) is exact. */
#ifndef FM_ADAMW_LOWP_H
#define FM_ADAMW_LOWP_H

#include <stdint.h>

#ifdef __CUDACC__
#define FM_LOWP_FN __host__ __device__ __forceinline__
#else
#define FM_LOWP_FN static inline
#endif

typedef enum fm_master_recipe {
    FM_MASTER_FP32 = 0,       /* fp32 master weights (the flag's order: "fp32") */
    FM_MASTER_BF16_KAHAN = 1, /* "bf16-kahan" */
    FM_MASTER_BF16_SR = 2     /* "bf16-sr" */
} fm_master_recipe;

/* SplitMix64's output function (the finalizer of Steele et al. 2014). */
FM_LOWP_FN uint64_t fm_lowp_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The key of one optimizer step: seed (the run's --seed) and the 1-based step. */
FM_LOWP_FN uint64_t fm_sr_key(uint64_t seed, int64_t step) {
    return fm_lowp_mix64(seed ^ fm_lowp_mix64((uint64_t)step + 0x9e3779b97f4a7c15ull));
}

/* 16 random bits (in [0, 65535]) for flat parameter index idx under key. */
FM_LOWP_FN uint32_t fm_sr_bits(uint64_t key, int64_t idx) {
    return (uint32_t)(fm_lowp_mix64(key + ((uint64_t)idx + 1u) * 0x9e3779b97f4a7c15ull) >> 48);
}

/* bf16 bits of the fp32 value with bits u, rounded stochastically with the 16 random bits r:
 * the dropped low half plus r carries into the kept half with probability low / 2^16 (the
 * magnitude rounds up; sign-symmetric, so unbiased). NaN and infinity round to nearest even. */
FM_LOWP_FN uint16_t fm_sr_round_bits(uint32_t u, uint32_t r) {
    if ((u & 0x7fffffffu) >= 0x7f800000u) return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : u >> 16);
    return (uint16_t)((u + (r & 0xffffu)) >> 16);
}

/* Bytes per parameter the recipe keeps for the weights' precision beyond the fm_act weights and
 * gradients (act_bytes each): the fp32 master (4; 0 where act_bytes is 4: the weights are it),
 * Kahan's bf16 buffer (2), or nothing (stochastic rounding). */
FM_LOWP_FN int fm_master_extra_bytes(fm_master_recipe r, int act_bytes) {
    return r == FM_MASTER_BF16_KAHAN ? 2 : r == FM_MASTER_BF16_SR ? 0 : act_bytes == 4 ? 0 : 4;
}

/* The recipe's flag value ("fp32", "bf16-kahan", "bf16-sr"). */
FM_LOWP_FN const char *fm_master_recipe_name(fm_master_recipe r) {
    return r == FM_MASTER_BF16_KAHAN ? "bf16-kahan" : r == FM_MASTER_BF16_SR ? "bf16-sr" : "fp32";
}

#endif
