/* Benchmark: the chunked MoE dispatch (bounded operator) against its plain twin on the CPU.
 * One MoE layer's forward + backward at N tokens; routing random or adversarial (every token
 * to the same top-k experts). Reports time and the measured peak of the expert-dispatch memory
 * (painted arena: the highest byte actually written) next to the planned bound.
 *
 *   bench_moe [N ...]        default N = 8192 16384 32768
 * Environment: FM_BENCH_H, FM_BENCH_I, FM_BENCH_E, FM_BENCH_K, FM_BENCH_CHUNK (defaults 512,
 * 512, 16, 2, 1024), OMP_NUM_THREADS. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "model/fm_moe_layer.h"
#include "core/fm_rng.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int64_t env_i(const char *k, int64_t d) {
    const char *v = getenv(k);
    return v ? atoll(v) : d;
}

static void fill(float *x, int64_t n, fm_rng *r, float s) {
    for (int64_t i = 0; i < n; i++) x[i] = s * (float)(fm_rng_uniform(r) * 2.0 - 1.0);
}

int main(int argc, char **argv) {
    const int64_t H = env_i("FM_BENCH_H", 512), I = env_i("FM_BENCH_I", 512), E = env_i("FM_BENCH_E", 16),
                  k = env_i("FM_BENCH_K", 2), chunk = env_i("FM_BENCH_CHUNK", 1024);
    int64_t Ns[16] = {8192, 16384, 32768};
    int nN = 3;
    if (argc > 1) {
        nN = 0;
        for (int i = 1; i < argc && nN < 16; i++) Ns[nN++] = atoll(argv[i]);
    }
    fm_backend be;
    if (fm_cpu_backend_init(&be, 0, 64)) { fprintf(stderr, "%s\n", fm_errmsg()); return 1; }
    const fm_moe_dims d = {H, I, E, k};
    fm_rng r;
    fm_rng_seed(&r, 1);
    float *wg = fm_malloc(sizeof(float) * (size_t)(E * I * H)), *wu = fm_malloc(sizeof(float) * (size_t)(E * I * H)),
          *wd = fm_malloc(sizeof(float) * (size_t)(E * H * I));
    float *gg = fm_malloc(sizeof(float) * (size_t)(E * I * H)), *gu = fm_malloc(sizeof(float) * (size_t)(E * I * H)),
          *gd = fm_malloc(sizeof(float) * (size_t)(E * H * I));
    fill(wg, E * I * H, &r, 0.05f);
    fill(wu, E * I * H, &r, 0.05f);
    fill(wd, E * H * I, &r, 0.05f);
    const fm_moe_weights w = {wg, wu, wd};
    const fm_moe_grads g = {gg, gu, gd};
    printf("MoE layer fwd+bwd, H=%lld I=%lld E=%lld top-%lld, chunk %lld tokens, %d threads\n", (long long)H,
           (long long)I, (long long)E, (long long)k, (long long)chunk, omp_get_max_threads());
    printf("%8s %-12s %-8s %10s %16s %16s\n", "N", "routing", "form", "time (s)", "peak (MiB)", "bound (MiB)");
    for (int ni = 0; ni < nN; ni++) {
        const int64_t N = Ns[ni];
        float *x = fm_malloc(sizeof(float) * (size_t)(N * H)), *y = fm_malloc(sizeof(float) * (size_t)(N * H)),
              *dy = fm_malloc(sizeof(float) * (size_t)(N * H)), *dx = fm_malloc(sizeof(float) * (size_t)(N * H));
        int32_t *idx = fm_malloc(sizeof(int32_t) * (size_t)(N * k));
        float *tw = fm_malloc(sizeof(float) * (size_t)(N * k)), *dtw = fm_malloc(sizeof(float) * (size_t)(N * k));
        fill(x, N * H, &r, 1.0f);
        fill(dy, N * H, &r, 1.0f);
        for (int adv = 0; adv < 2; adv++) {
            for (int64_t n = 0; n < N; n++)
                for (int64_t j = 0; j < k; j++) {
                    idx[n * k + j] = adv ? (int32_t)j : (int32_t)((fm_rng_below(&r, (uint64_t)(E / k)) * k + j) % E);
                    tw[n * k + j] = 1.0f / (float)k;
                }
            for (int chunked = 0; chunked < 2; chunked++) {
                int64_t K, c_eff;
                fm_moe_chunks(N, chunked ? chunk : 0, &K, &c_eff);
                const size_t a_ = sizeof(fm_act);
                size_t bound = (chunked ? fm_arena_round(fm_moe_ws_bytes(&d, c_eff, true, a_))
                                        : fm_moe_routes_bytes(&d, N, a_) + fm_moe_ws_bytes(&d, N, false, a_)) +
                               fm_moe_routes_host_bytes(&d);
                fm_arena a;
                if (fm_arena_init(&a, "expert dispatch", bound)) { fprintf(stderr, "%s\n", fm_errmsg()); return 1; }
                fm_arena_paint(&a);
                fm_moe_routes saved;
                fm_moe_ws ws;
                if (!chunked) fm_moe_routes_layout(&saved, &a, NULL, &d, N);
                fm_moe_ws_layout(&ws, &a, NULL, &d, chunked ? c_eff : N, chunked);
                int32_t *order = fm_malloc(sizeof(int32_t) * (size_t)N);
                fm_moe_chunk_order(order, N, K);
                double t0 = now();
                fm_moe_routes *sv = chunked ? NULL : &saved;
                FM_ASSERT(fm_moe_forward(&be, &d, &w, y, x, idx, tw, N, K, order, sv, &ws) == FM_OK);
                FM_ASSERT(fm_moe_backward(&be, &d, &w, &g, dx, dtw, dy, x, idx, tw, N, K, order, sv, &ws) == FM_OK);
                fm_free(order);
                double t = now() - t0;
                printf("%8lld %-12s %-8s %10.3f %16.1f %16.1f\n", (long long)N, adv ? "adversarial" : "random",
                       chunked ? "chunked" : "plain", t, fm_arena_touched(&a) / 1048576.0, bound / 1048576.0);
                fflush(stdout);
                fm_arena_free(&a);
            }
        }
        fm_free(x); fm_free(y); fm_free(dy); fm_free(dx); fm_free(idx); fm_free(tw); fm_free(dtw);
    }
    fm_cpu_backend_free(&be);
    return 0;
}
