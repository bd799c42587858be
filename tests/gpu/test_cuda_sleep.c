/* Sleep on the GPU (label gpu; issue 29): the CUDA backend's mem_release / mem_restore over its
 * VMM blocks (src/backend/cuda/cuda_vmm.h), then a libflatmoe session's flatmoe_sleep / flatmoe_wake.
 *  - the backend: blocks of several chunks and of one short chunk, zero-filled at mem_alloc; a
 *    release of a range that holds one whole chunk gives back exactly that chunk (its neighbours
 *    keep their pattern) and cudaMemGetInfo's free memory grows by it (within 4 MiB); a restore
 *    backs it again zero-filled; releasing whole blocks gives back their rounded size, a second
 *    time nothing, a range under one chunk nothing; the restored memory reads as zeros and takes
 *    copies, mem_set and a kernel (add); a partly released block freed; free memory back to where
 *    it started; the cudaMalloc fallback (the test hook) gives nothing back and keeps its contents;
 *  - the session (a qwen3_moe of 7.4M parameters, 8 x 128 tokens, --mem-budget 4GiB so both
 *    sessions plan alike, FLATMOE_ATTENTION=fallback's deterministic kernels): two SFT steps, sleep, the device's free memory grown by at least 90%
 *    of the session's device arenas' bytes, calls refused while asleep, wake refused while the
 *    device is full (cudaMalloc of all but half the memory given back; still asleep), wake, free
 *    memory back, two more steps: losses, gradient norms, weights and master bit for bit a session's that
 *    did not sleep. Prints the release, the free memory and the sleep and wake times.
 * Exit 77 (skipped) after the fallback checks where the device has no VMM. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "backend/cuda/cuda_attention.h"
#include "backend/cuda/cuda_vmm.h"
#include "capi/fm_capi.h"
#include "core/fm_rng.h"
#include "gpu_test.h"

#define MiB ((size_t)1 << 20)

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static size_t dev_free(void) {
    size_t f = 0, t = 0;
    CHECK_MSG(fm_cuda_device_memory(0, &f, &t) == FM_OK, "cudaMemGetInfo: %s", fm_errmsg());
    return f;
}

/* |a - b| <= tol */
static bool near(size_t a, size_t b, size_t tol) { return a > b ? a - b <= tol : b - a <= tol; }

/* ---- the backend ---------------------------------------------------------------------------- */

static fm_backend BE;
static const fm_ops *OPS;
static void *CTX;

static uint32_t pat(size_t i, uint32_t tag) { return (uint32_t)(i * 2654435761u) ^ tag; }

/* Block p [0, bytes) := the pattern of tag (uint32 words). */
static void fill(void *p, size_t bytes, uint32_t tag) {
    uint32_t *h = fm_malloc(bytes);
    FM_ASSERT(h);
    for (size_t i = 0; i < bytes / 4; i++) h[i] = pat(i, tag);
    OPS->copy(CTX, p, h, bytes, FM_COPY_H2D);
    fm_free(h);
}

/* Counts the words of [off, off + bytes) of block p (off, bytes multiples of 4) that differ from
 * the pattern of tag (tag 0 with zero: from 0). */
static size_t differ(const void *p, size_t off, size_t bytes, uint32_t tag, bool zero) {
    uint32_t *h = fm_malloc(bytes + 4);
    FM_ASSERT(h);
    OPS->copy(CTX, h, (const uint8_t *)p + off, bytes, FM_COPY_D2H);
    size_t bad = 0;
    for (size_t i = 0; i < bytes / 4; i++) bad += h[i] != (zero ? 0u : pat(off / 4 + i, tag));
    fm_free(h);
    return bad;
}

/* The cudaMalloc path (a device without VMM, here the test hook): nothing given back, the
 * contents kept. */
static void test_fallback(void) {
    const bool had = fm_cuda_vmm_set_enabled(CTX, false);
    CHECK(!fm_cuda_vmm_info(CTX, NULL, NULL));
    const size_t n = 3 * MiB + 256;
    void *p = OPS->mem_alloc(CTX, n);
    CHECK_MSG(p != NULL, "fallback mem_alloc: %s", fm_errmsg());
    if (p) {
        CHECK(differ(p, 0, n, 0, true) == 0);
        fill(p, n, 0xfa11u);
        CHECK(OPS->mem_release(CTX, p, n) == 0);
        CHECK(differ(p, 0, n, 0xfa11u, false) == 0);
        OPS->mem_free(CTX, p);
    }
    (void)fm_cuda_vmm_set_enabled(CTX, had);
    CHECK_BACKEND_OK(&BE);
}

static void test_blocks(size_t gran, size_t chunk) {
    const size_t f0 = dev_free();
    const size_t na = 3 * chunk + MiB + 100, sa = (na + gran - 1) / gran * gran; /* 4 chunks, the last short */
    const size_t nb = 5 * MiB + 4, sb = (nb + gran - 1) / gran * gran;          /* one short chunk */
    const size_t nc = 4096;                                                      /* a bystander */
    uint8_t *a = OPS->mem_alloc(CTX, na), *b = OPS->mem_alloc(CTX, nb), *c = OPS->mem_alloc(CTX, nc);
    CHECK_MSG(a && b && c, "mem_alloc: %s", fm_errmsg());
    if (!a || !b || !c) return;
    CHECK_MSG(((uintptr_t)a % gran) == 0 && ((uintptr_t)b % gran) == 0, "blocks aligned to the granularity");
    CHECK(differ(a, 0, na & ~(size_t)3, 0, true) == 0 && differ(b, 0, nb & ~(size_t)3, 0, true) == 0);
    const size_t f1 = dev_free();
    CHECK_MSG(f0 - f1 >= sa + sb && f0 - f1 <= sa + sb + gran + 4 * MiB,
              "allocating %zu + %zu + %zu bytes took %zu of free memory (rounded: %zu + %zu + one granularity)", na, nb,
              nc, f0 - f1, sa, sb);
    fill(a, na & ~(size_t)3, 0xa1u);
    fill(b, nb & ~(size_t)3, 0xb2u);
    fill(c, nc, 0xc3u);

    /* [chunk/2, chunk/2 + 2 chunk) holds chunk 1 whole and halves of chunks 0 and 2 */
    const size_t r1 = OPS->mem_release(CTX, a + chunk / 2, 2 * chunk);
    CHECK_MSG(r1 == chunk, "released %zu bytes of a range holding one whole chunk of %zu", r1, chunk);
    const size_t f2 = dev_free();
    CHECK_MSG(near(f2 - f1, chunk, 4 * MiB), "free memory grew by %zu for a release of %zu", f2 - f1, r1);
    CHECK(differ(a, 0, chunk, 0xa1u, false) == 0);                                    /* chunk 0 kept */
    CHECK(differ(a, 2 * chunk, (na & ~(size_t)3) - 2 * chunk, 0xa1u, false) == 0);   /* chunks 2, 3 kept */
    CHECK(OPS->mem_release(CTX, a + 4096, 4096) == 0);                                /* under one chunk */
    OPS->mem_restore(CTX, a + chunk / 2, 2 * chunk); /* chunk 1 backed again; the range zeroed */
    CHECK_BACKEND_OK(&BE);
    CHECK(near(dev_free(), f1, 4 * MiB));
    CHECK(differ(a, 0, chunk / 2, 0xa1u, false) == 0);
    CHECK(differ(a, chunk / 2, 2 * chunk, 0, true) == 0);
    CHECK(differ(a, chunk / 2 + 2 * chunk, (na & ~(size_t)3) - chunk / 2 - 2 * chunk, 0xa1u, false) == 0);

    /* whole blocks (the bytes asked: the rounding tail goes with them), as sleep releases arenas */
    const size_t ra = OPS->mem_release(CTX, a, na), rb = OPS->mem_release(CTX, b, nb);
    CHECK_MSG(ra == sa && rb == sb, "released %zu and %zu, expected the rounded sizes %zu and %zu", ra, rb, sa, sb);
    CHECK(OPS->mem_release(CTX, a, na) == 0); /* nothing left to give */
    const size_t f3 = dev_free();
    CHECK_MSG(near(f3 - f1, sa + sb, 4 * MiB), "free memory grew by %zu for releases of %zu", f3 - f1, sa + sb);
    CHECK(differ(c, 0, nc, 0xc3u, false) == 0); /* the bystander */
    OPS->mem_restore(CTX, a, na);
    OPS->mem_restore(CTX, b, nb);
    CHECK_BACKEND_OK(&BE);
    CHECK(near(dev_free(), f1, 4 * MiB));
    CHECK(differ(a, 0, na & ~(size_t)3, 0, true) == 0 && differ(b, 0, nb & ~(size_t)3, 0, true) == 0);
    /* the restored memory takes copies, mem_set and kernels: b's bf16 [n] += a's */
    const int64_t n = (int64_t)(nb / 2);
    OPS->mem_set(CTX, a, 0x3f, (size_t)n * 2); /* 0x3f3f: 0.746... */
    fill(b, (size_t)n * 2 & ~(size_t)3, 0);    /* pat(i, 0): arbitrary bf16 pairs */
    OPS->add(CTX, (fm_act *)b, (const fm_act *)a, n);
    float *x = fm_malloc(sizeof(float) * (size_t)n), *y = fm_malloc(sizeof(float) * (size_t)n);
    uint16_t *h = fm_malloc((size_t)n * 2 + 4);
    for (size_t i = 0; i < (size_t)n / 2; i++) memcpy(h + 2 * i, &(uint32_t){pat(i, 0)}, 4);
    gt_download(&BE, y, b, n & ~(int64_t)1, FM_DTYPE_BF16);
    size_t bad = 0;
    for (int64_t i = 0; i < (n & ~(int64_t)1); i++) {
        x[i] = gt_bf16_to_f32(gt_f32_to_bf16(gt_bf16_to_f32(h[i]) + gt_bf16_to_f32(0x3f3f)));
        bad += !(x[i] == y[i] || (isnan(x[i]) && isnan(y[i])));
    }
    CHECK_MSG(bad == 0, "add on restored memory: %zu of %lld elements differ from the host's sum", bad, (long long)n);
    fm_free(x);
    fm_free(y);
    fm_free(h);

    /* a block freed while partly released (a session closed asleep) */
    const size_t nd = 2 * chunk;
    void *d = OPS->mem_alloc(CTX, nd);
    CHECK(d != NULL && OPS->mem_release(CTX, d, chunk) == chunk);
    OPS->mem_free(CTX, d);
    OPS->mem_free(CTX, a);
    OPS->mem_free(CTX, b);
    OPS->mem_free(CTX, c);
    CHECK_BACKEND_OK(&BE);
    const size_t f4 = dev_free();
    CHECK_MSG(near(f4, f0, 4 * MiB), "free memory %zu after every free, %zu before the first alloc", f4, f0);
    printf("backend: granularity %zu, chunk %zu; released 1 chunk of a %zu-byte block then whole blocks of %zu and "
           "%zu bytes: free memory +%.1f MiB, +%.1f MiB\n", gran, chunk, na, sa, sb, (f2 - f1) / 1048576.0,
           (f3 - f1) / 1048576.0);
}

/* ---- the session ---------------------------------------------------------------------------- */

static const char *CFG =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", \"vocab_size\": 512,\n"
    " \"hidden_size\": 256, \"intermediate_size\": 512, \"moe_intermediate_size\": 256, \"num_hidden_layers\": 4,\n"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 64, \"hidden_act\": \"silu\",\n"
    " \"max_position_embeddings\": 256, \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-06, \"attention_bias\": false,\n"
    " \"num_experts\": 8, \"num_experts_per_tok\": 2, \"norm_topk_prob\": true, \"decoder_sparse_step\": 1,\n"
    " \"mlp_only_layers\": [], \"router_aux_loss_coef\": 0.01, \"initializer_range\": 0.02,\n"
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\"}\n";
enum { V = 512, NS = 16, NT = 8 * 128 };
static char cfg_path[64];
static int32_t tok[NT];
static int64_t lens[NS];

static flatmoe_session *open_session(void) {
    const char *argv[] = {"--config", cfg_path, "--seq-len", "128", "--micro-batch", "8", "--seed", "29", "--lr",
                          "1e-3", "--warmup", "1", "--steps", "10", "--mem-budget", "4GiB", "--quiet"};
    flatmoe_session *s = NULL;
    const int rc = flatmoe_open(&s, (int)(sizeof argv / sizeof argv[0]), argv);
    CHECK_MSG(rc == FLATMOE_OK, "flatmoe_open: %s", flatmoe_last_error());
    if (s) fm_cuda_attention_set_path(s->r.m.be.ctx, FM_CUDA_ATT_FALLBACK); /* deterministic backward */
    return s;
}

/* NS sequences in pairs that fill a row of 128 but for a gap of 0 to 2 tokens (first fit packs
 * pair r into row r: no later sequence fits a gap) */
static int64_t make_batch(flatmoe_batch *b, fm_rng *g) {
    memset(b, 0, sizeof *b);
    int64_t n = 0;
    for (int r = 0; r < NS / 2; r++) {
        lens[2 * r] = 40 + (int64_t)fm_rng_below(g, 48);
        lens[2 * r + 1] = 128 - lens[2 * r] - r % 3;
        n += lens[2 * r] + lens[2 * r + 1];
    }
    for (int64_t t = 0; t < n; t++) tok[t] = (int32_t)fm_rng_below(g, V);
    b->n_tokens = n;
    b->tokens = tok;
    b->n_seqs = NS;
    b->seq_lens = lens;
    return n;
}

static void sft_step(flatmoe_session *s, const flatmoe_batch *b, flatmoe_step_stats *st) {
    const flatmoe_loss_spec sp = flatmoe_loss_spec_default(); /* SFT, token-mean */
    CHECK_MSG(flatmoe_train_step(s, b, &sp, st) == FLATMOE_OK, "train_step: %s", flatmoe_last_error());
}

static bool same_stats(const flatmoe_step_stats *x, const flatmoe_step_stats *y) {
    return !memcmp(&x->loss, &y->loss, sizeof x->loss) && !memcmp(&x->grad_norm, &y->grad_norm, sizeof x->grad_norm) &&
           !memcmp(&x->router_aux, &y->router_aux, sizeof x->router_aux) && x->step == y->step;
}

/* The weights and the fp32 master of a and b, read back, equal bit for bit. */
static bool same_weights(flatmoe_session *a, flatmoe_session *b) {
    fm_step_ws_flush(&a->r.step, &a->r.m);
    fm_step_ws_flush(&b->r.step, &b->r.m);
    const fm_model_params *p = &a->r.m.p, *q = &b->r.m.p;
    if (p->n_params != q->n_params) return false;
    const size_t n = (size_t)p->n_params;
    uint8_t *x = fm_malloc(4 * n), *y = fm_malloc(4 * n);
    FM_ASSERT(x && y);
    const fm_ops *oa = a->r.m.be.ops, *ob = b->r.m.be.ops;
    oa->copy(a->r.m.be.ctx, x, p->params, sizeof(fm_act) * n, FM_COPY_D2H);
    ob->copy(b->r.m.be.ctx, y, q->params, sizeof(fm_act) * n, FM_COPY_D2H);
    bool same = !memcmp(x, y, sizeof(fm_act) * n);
    if (p->master && q->master && (void *)p->master != (void *)p->params) {
        oa->copy(a->r.m.be.ctx, x, p->master, 4 * n, FM_COPY_D2H);
        ob->copy(b->r.m.be.ctx, y, q->master, 4 * n, FM_COPY_D2H);
        same = same && !memcmp(x, y, 4 * n);
    }
    fm_free(x);
    fm_free(y);
    return same;
}

static void test_session(fm_rng *g) {
    snprintf(cfg_path, sizeof cfg_path, "/tmp/flatmoe-cuda-sleep-%d.json", (int)getpid());
    FILE *f = fopen(cfg_path, "w");
    if (!f || fputs(CFG, f) < 0 || fclose(f) != 0) {
        CHECK_MSG(false, "cannot write %s", cfg_path);
        return;
    }
    flatmoe_session *a = open_session(), *c = open_session();
    if (!a || !c) {
        flatmoe_close(a);
        flatmoe_close(c);
        unlink(cfg_path);
        return;
    }
    flatmoe_batch b;
    const int64_t n = make_batch(&b, g);
    flatmoe_step_stats sa, sc;
    for (int i = 0; i < 2; i++) {
        sft_step(a, &b, &sa);
        sft_step(c, &b, &sc);
        CHECK_MSG(same_stats(&sa, &sc), "step %d without sleep: loss %.17g vs %.17g (the GPU step is not "
                  "deterministic here; sleep is not yet involved)", i + 1, sa.loss, sc.loss);
    }
    size_t arenas = 0; /* the device arenas flatmoe_sleep releases (flatmoe_sleep.c device_arenas) */
    if (a->r.ps.arena.base) arenas += a->r.ps.arena.capacity;
    for (int i = 1; i < FM_LIVE_COUNT; i++)
        if (a->r.m.a.arena[i].base) arenas += a->r.m.a.arena[i].capacity;
    const size_t f0 = dev_free();
    const double t0 = now_s();
    CHECK_MSG(flatmoe_sleep(a) == FLATMOE_OK, "sleep: %s", flatmoe_last_error());
    const double t1 = now_s();
    const size_t f1 = dev_free();
    CHECK_MSG(f1 > f0 && (double)(f1 - f0) >= 0.9 * (double)arenas,
              "asleep: free memory grew by %zu bytes, expected at least 90%% of the arenas' %zu", f1 > f0 ? f1 - f0 : 0,
              arenas);
    CHECK_MSG(a->sleep_released >= arenas, "released %zu bytes of arenas of %zu", a->sleep_released, arenas);
    float lp[NT];
    CHECK(flatmoe_logprobs(a, &b, lp, NULL) == FLATMOE_ERR_ARG && strstr(flatmoe_last_error(), "flatmoe_wake"));
    /* wake with the memory taken (all but half of what sleep gave back): refused, still asleep */
    void *hog = NULL;
    const size_t grab = f1 - a->sleep_released / 2;
    if (cudaMalloc(&hog, grab) == cudaSuccess) {
        CHECK_MSG(flatmoe_wake(a) == FLATMOE_ERR_NOMEM && strstr(flatmoe_last_error(), "call flatmoe_wake again"),
                  "wake with %zu bytes free: %s", dev_free(), flatmoe_last_error());
        CHECK(flatmoe_logprobs(a, &b, lp, NULL) == FLATMOE_ERR_ARG); /* asleep */
        CHECK(cudaFree(hog) == cudaSuccess);
    } else {
        (void)cudaGetLastError();
        printf("NOTE: could not take %zu bytes to fill the device: wake's out-of-memory refusal not tested\n", grab);
    }
    const double t2 = now_s();
    CHECK_MSG(flatmoe_wake(a) == FLATMOE_OK, "wake: %s", flatmoe_last_error());
    const double t3 = now_s();
    const size_t f2 = dev_free();
    CHECK_MSG(near(f2, f0, 8 * MiB), "awake: free memory %zu, %zu before sleep", f2, f0);
    CHECK_MSG(same_weights(a, c), "the weights after wake differ from the session's that did not sleep");
    for (int i = 0; i < 2; i++) {
        sft_step(a, &b, &sa);
        sft_step(c, &b, &sc);
        CHECK_MSG(same_stats(&sa, &sc), "step %d after wake: loss %.17g vs %.17g without sleep, grad norm %.17g vs "
                  "%.17g", i + 3, sa.loss, sc.loss, sa.grad_norm, sc.grad_norm);
    }
    CHECK_MSG(same_weights(a, c), "the weights two steps after wake differ from the session's that did not sleep");
    printf("session: arenas %.1f MiB, released %.1f MiB, copied %.1f MiB; free memory +%.1f MiB asleep; sleep %.1f ms, "
           "wake %.1f ms; %lld tokens a step, steps 3-4 bit for bit as without sleep (loss %.9g)\n", arenas / 1048576.0,
           a->sleep_released / 1048576.0, (double)(a->sleep_bytes) / 1048576.0, (f1 - f0) / 1048576.0,
           1e3 * (t1 - t0), 1e3 * (t3 - t2), (long long)n, sa.loss);
    flatmoe_close(a);
    flatmoe_close(c);
    unlink(cfg_path);
}

int main(void) {
    const fm_status st = gt_cuda_init(&BE, 0, 128, 0);
    CHECK_MSG(st == FM_OK, "fm_cuda_backend_init: %s", fm_errmsg());
    if (st != FM_OK) return fm_test_finish();
    OPS = BE.ops;
    CTX = BE.ctx;
    size_t gran = 0, chunk = 0;
    const bool vmm = fm_cuda_vmm_info(CTX, &gran, &chunk);
    /* the plan's margin covers each device arena's rounding on the assumption of <= 2 MiB (docs/plan.md) */
    CHECK_MSG(!vmm || (gran >= 4096 && gran <= 2 * MiB && chunk % gran == 0 && chunk >= FM_CUDA_VMM_CHUNK_BYTES),
              "VMM granularity %zu, chunk %zu: expected a granularity of at most 2 MiB and a chunk of whole "
              "granularities, at least FM_CUDA_VMM_CHUNK_BYTES", gran, chunk);
    test_fallback();
    if (vmm) test_blocks(gran, chunk);
    fm_cuda_backend_free(&BE);
    if (!vmm) {
        printf("this device has no CUDA virtual memory management: the cudaMalloc fallback checked, sleep's release "
               "NOT tested (skipped)\n");
        const int rc = fm_test_finish();
        return rc ? rc : 77;
    }
    fm_rng g;
    fm_rng_seed(&g, fm_test_seed(2929));
    test_session(&g);
    return fm_test_finish();
}
