/* Linear cross-entropy: the blocked operator against its plain twin on the CPU backend —
 * wall time, GFLOP/s and arena peak (bytes) of each. Usage:
 *   cmake --build build --target flatmoe_lib &&
 *   cc -O2 -fopenmp -Isrc bench/bench_linear_ce.c build/libflatmoe_lib.a -lopenblas -lcjson -lm \
 *      -o build/bench_linear_ce && build/bench_linear_ce [N H V Nb Vb]
 * FLOPs: 2 N V H per logits pass; the blocked operator does 4 passes with backward (logits
 * twice, dh, dW), the plain twin 3. Built by CMake with the other bench_* targets. */
#include "backend/cpu/fm_backend_cpu.h"
#include "bounded/fm_linear_ce.h"
#include "core/fm_rng.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    int64_t N = 2048, H = 512, V = 32768, Nb = 256, Vb = 4096;
    if (argc == 6) {
        N = atoll(argv[1]); H = atoll(argv[2]); V = atoll(argv[3]);
        Nb = atoll(argv[4]); Vb = atoll(argv[5]);
    }
    fm_backend be;
    if (fm_cpu_backend_init(&be, 0, 64) != FM_OK) return 1;
    fm_rng rng;
    fm_rng_seed(&rng, 1);
    float *h = fm_malloc((size_t)(N * H) * 4), *W = fm_malloc((size_t)(V * H) * 4);
    float *dh = fm_malloc((size_t)(N * H) * 4), *dW = fm_malloc((size_t)(V * H) * 4);
    float *loss = fm_malloc((size_t)N * 4);
    int32_t *tg = fm_malloc((size_t)N * 4);
    if (!h || !W || !dh || !dW || !loss || !tg) return 1;
    for (int64_t i = 0; i < N * H; i++) h[i] = (float)fm_rng_normal(&rng);
    for (int64_t i = 0; i < V * H; i++) W[i] = (float)(0.03 * fm_rng_normal(&rng));
    for (int64_t n = 0; n < N; n++) tg[n] = (int32_t)fm_rng_below(&rng, (uint64_t)V);
    fm_lce_opts o = fm_lce_opts_default();
    o.block_tokens = Nb;
    o.block_vocab = Vb;
    const double f1 = 2.0 * (double)N * (double)V * (double)H;
    printf("N %lld H %lld V %lld Nb %lld Vb %lld\n", (long long)N, (long long)H, (long long)V,
           (long long)Nb, (long long)Vb);
    for (int plain = 0; plain < 2; plain++) {
        fm_arena ws;
        const size_t cap = plain ? fm_linear_ce_plain_bytes(N, V) : fm_linear_ce_bound_bytes(Nb, Vb);
        if (fm_arena_init(&ws, "vocabulary projection", cap) != FM_OK) {
            printf("%s: %s\n", plain ? "plain" : "blocked", fm_errmsg());
            continue;
        }
        double best = 1e30, ce = 0;
        for (int rep = 0; rep < 2; rep++) {
            const double t0 = now();
            double sums[2];
            (plain ? fm_linear_ce_plain : fm_linear_ce)(&be, &ws, loss, dh, dW, h, W, tg, N, H, V, 1.0f / (float)N, &o,
                                                        sums);
            ce = fm_linear_ce_read(&be, sums, 0.0f, NULL);
            const double t = now() - t0;
            best = t < best ? t : best;
        }
        const double flops = (plain ? 3 : 4) * f1;
        printf("%-7s loss %.6f  %.3f s  %.1f GFLOP/s  %.1f tok/s  arena high %zu bytes (%.2f MiB)\n",
               plain ? "plain" : "blocked", ce / (double)N, best, flops / best * 1e-9,
               (double)N / best, ws.high, ws.high / 1048576.0);
        fm_arena_free(&ws);
    }
    fm_cpu_backend_free(&be);
    return 0;
}
