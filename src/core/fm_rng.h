/* Deterministic random numbers: splitmix64 (Steele, Lea, Flood, "Fast splittable pseudorandom
 * number generators", OOPSLA 2014). The whole state is one uint64, so it is saved in
 * state.json and a resumed run continues the same stream bit for bit. */
#ifndef FM_RNG_H
#define FM_RNG_H
#include <stdint.h>

typedef struct fm_rng { uint64_t state; } fm_rng;

static inline void fm_rng_seed(fm_rng *r, uint64_t seed) { r->state = seed ^ 0x9E3779B97F4A7C15ull; }

static inline uint64_t fm_rng_u64(fm_rng *r) {
    uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1) with 24 bits (float) or 53 bits (double). */
static inline float fm_rng_uniform(fm_rng *r) { return (float)(fm_rng_u64(r) >> 40) * (1.0f / 16777216.0f); }
static inline double fm_rng_uniform_d(fm_rng *r) { return (double)(fm_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }

/* Uniform integer in [0, n), n > 0 (Lemire's multiply-shift; bias < n/2^64, negligible). */
static inline uint64_t fm_rng_below(fm_rng *r, uint64_t n) {
    return (uint64_t)(((unsigned __int128)fm_rng_u64(r) * n) >> 64);
}

/* Standard normal by Box-Muller; consumes two draws, caches nothing (state stays one word). */
double fm_rng_normal(fm_rng *r);

#endif
