/* libflatmoe's save, weight export and sampling (include/flatmoe.h; docs/rl.md):
 *  - flatmoe_save then a session opened with --ckpt continues bit for bit: 2 steps, save, reopen,
 *    2 steps equals 4 steps in one session (the weights, every element; the step);
 *  - flatmoe_export_weights reassembled equals the saved model.safetensors narrowed to bf16
 *    (fm_f32_to_bf16), every tensor, at a bucket 1 byte smaller than the largest tensor (that one
 *    split, every other whole, no bucket over its size), at 2 bytes (one element a piece) and at a
 *    huge size (one bucket); 1 byte and a failing callback refused;
 *  - flatmoe_generate: the same seed gives the same completions; their log-probs equal
 *    flatmoe_logprobs on prompt + completion bit for bit (the same forward by construction);
 *    greedy picks the token whose flatmoe_logprobs is the largest over the whole vocabulary (the
 *    sampling logits, formed apart from the linear CE, against it: within a derived tolerance);
 *    top-k and top-p draw only from their candidate sets; the budget refusal;
 *  - flatmoe_sleep then flatmoe_wake (3 x 16 and 8 x 64 tokens: the live sets' arenas span pages
 *    there, so their released pages come back as zeros and only the carved parts copied back): the
 *    model state NaN or released while asleep (mincore: its pages not resident), calls refused, the
 *    next step bit for bit that of a session that did not sleep. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <sys/stat.h>
#include <unistd.h>

#include "capi/fm_capi.h"
#include "core/fm_rng.h"
#include "io/fm_checkpoint.h"
#include "io/fm_safetensors.h"
#include "fm_test.h"

static const char *CFG =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", \"vocab_size\": 100,\n"
    " \"hidden_size\": 32, \"intermediate_size\": 64, \"moe_intermediate_size\": 32, \"num_hidden_layers\": 2,\n"
    " \"num_attention_heads\": 2, \"num_key_value_heads\": 2, \"head_dim\": 16, \"hidden_act\": \"silu\",\n"
    " \"max_position_embeddings\": 64, \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-06, \"attention_bias\": false,\n"
    " \"num_experts\": 4, \"num_experts_per_tok\": 2, \"norm_topk_prob\": true, \"decoder_sparse_step\": 1,\n"
    " \"mlp_only_layers\": [], \"router_aux_loss_coef\": 0.01, \"initializer_range\": 0.2,\n"
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"float32\"}\n";
static char cfg_path[64], run_dir[64], threads_s[16];
enum { V = 100 };

/* A micro session: the model from --config (fresh weights), or from --ckpt DIR when ckpt is set;
 * micro_batch rows of 16 tokens. */
static const char *seq_len_s = "16"; /* open_micro's --seq-len (test_sleep_wake widens it) */
static flatmoe_session *open_micro(const char *ckpt, const char *micro_batch) {
    const char *argv[] = {ckpt ? "--ckpt" : "--config", ckpt ? ckpt : cfg_path, "--seq-len", seq_len_s, "--micro-batch",
                          micro_batch, "--threads", threads_s, "--ce-block-tokens", "16", "--ce-block-vocab", "24",
                          "--seed", "11", "--lr", "1e-2", "--warmup", "1", "--steps", "10", "--quiet"};
    flatmoe_session *s = NULL;
    const int rc = flatmoe_open(&s, (int)(sizeof argv / sizeof argv[0]), argv);
    CHECK_MSG(rc == FLATMOE_OK, "flatmoe_open: %s", flatmoe_last_error());
    return s;
}

enum { MT = 44, MS = 4 };
static int32_t mtok[MT];
static int64_t mlens[MS] = {16, 10, 6, 12};
static uint8_t mmask[MT];
static float madv[MT];

static void pg_batch(flatmoe_batch *b, fm_rng *g) {
    memset(b, 0, sizeof *b);
    for (int64_t t = 0, i = 0; i < MS; i++)
        for (int64_t j = 0; j < mlens[i]; j++, t++) {
            mtok[t] = (int32_t)fm_rng_below(g, V);
            mmask[t] = j >= 2;
            madv[t] = (float)fm_rng_below(g, 3) - 1.0f;
        }
    b->n_tokens = MT;
    b->tokens = mtok;
    b->n_seqs = MS;
    b->seq_lens = mlens;
    b->loss_mask = mmask;
    b->advantages = madv;
}

/* A PG step with a ratio off 1 (old log-probs shifted) and the router's loss: AdamW's moments and
 * the step's schedule all matter to what follows. */
static void step(flatmoe_session *s, flatmoe_batch *b) {
    static float old[MT];
    CHECK(flatmoe_logprobs(s, b, old, NULL) == FLATMOE_OK);
    for (int64_t t = 0; t < MT; t++) old[t] -= 0.05f * (float)(t % 5);
    b->old_logprobs = old;
    flatmoe_loss_spec sp = flatmoe_loss_spec_default();
    sp.loss = FLATMOE_LOSS_PG;
    sp.agg = FLATMOE_AGG_SEQ_MEAN_TOKEN_MEAN;
    sp.clip_high = 0.28;
    flatmoe_step_stats st;
    CHECK_MSG(flatmoe_train_step(s, b, &sp, &st) == FLATMOE_OK, "train_step: %s", flatmoe_last_error());
    b->old_logprobs = NULL;
}

static bool same_weights(flatmoe_session *a, flatmoe_session *b) {
    fm_step_ws_flush(&a->r.step, &a->r.m);
    fm_step_ws_flush(&b->r.step, &b->r.m);
    const fm_model_params *p = &a->r.m.p, *q = &b->r.m.p;
    return p->n_params == q->n_params && !memcmp(p->params, q->params, sizeof(fm_act) * (size_t)p->n_params) &&
           !memcmp(p->master, q->master, sizeof(float) * (size_t)p->n_params);
}

static void test_save_resume(fm_rng *g) {
    flatmoe_session *a = open_micro(NULL, "3");
    if (!a) return;
    flatmoe_batch b;
    pg_batch(&b, g);
    step(a, &b);
    step(a, &b);
    CHECK(flatmoe_save(NULL, run_dir) == FLATMOE_ERR_ARG && flatmoe_save(a, "") == FLATMOE_ERR_ARG);
    CHECK_MSG(flatmoe_save(a, run_dir) == FLATMOE_OK, "flatmoe_save: %s", flatmoe_last_error());
    char path[160];
    const char *files[] = {"model.safetensors", "optimizer.safetensors", "config.json", "state.json"};
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/step_000002/%s", run_dir, files[i]);
        CHECK_MSG(access(path, R_OK) == 0, "%s missing", path);
    }
    snprintf(path, sizeof path, "%s/.tmp.step_000002", run_dir);
    CHECK_MSG(access(path, F_OK) != 0, "%s left behind", path);
    char *state = NULL;
    snprintf(path, sizeof path, "%s/step_000002/state.json", run_dir);
    CHECK(fm_ckpt_read_text(path, &state) == FM_OK && state && strstr(state, "\"spec\"") &&
          strstr(state, "\"step\":\t2"));
    fm_free(state);
    step(a, &b);
    step(a, &b);
    flatmoe_session *c = open_micro(run_dir, "3"); /* the run folder: its latest step */
    if (!c) return;
    flatmoe_info info;
    CHECK(flatmoe_get_info(c, &info) == FLATMOE_OK && info.step == 2);
    step(c, &b);
    step(c, &b);
    CHECK(flatmoe_get_info(c, &info) == FLATMOE_OK && info.step == 4);
    CHECK_MSG(same_weights(a, c), "2 steps, save, reopen, 2 steps differ from 4 steps");
    printf("save: 2 steps + save + --ckpt + 2 steps == 4 steps, weights and master bit for bit\n");
    flatmoe_close(c);
    flatmoe_close(a);
}

/* sleep, wake: the next steps equal a session's that did not sleep; while asleep the model state
 * is NaN or released (the copy back is what restores it: the CPU backend gives the arenas' whole
 * pages back, checked with mincore) and the calls are refused */
static void test_sleep_wake(fm_rng *g, const char *seq_len, const char *micro_batch) {
    seq_len_s = seq_len;
    flatmoe_session *a = open_micro(NULL, micro_batch), *c = open_micro(NULL, micro_batch);
    seq_len_s = "16";
    if (!a || !c) return;
    flatmoe_batch b;
    pg_batch(&b, g);
    step(a, &b);
    step(c, &b);
    CHECK(flatmoe_wake(a) == FLATMOE_ERR_ARG);
    CHECK_MSG(flatmoe_sleep(a) == FLATMOE_OK, "sleep: %s", flatmoe_last_error());
    CHECK(flatmoe_sleep(a) == FLATMOE_ERR_ARG && strstr(flatmoe_last_error(), "asleep"));
    const float w0 = a->r.m.p.master[0];
    CHECK_MSG(isnan(w0) || w0 == 0.0f, "the model state while asleep: %g, expected NaN (poisoned) or 0 (released)",
              (double)w0);
    /* the CPU backend gives the arenas' whole pages back (madvise): the model state's interior
     * pages are no longer resident (mincore), and what was given back is most of the arenas */
    const fm_arena *ms = &a->r.ps.arena;
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    const uintptr_t p0 = ((uintptr_t)ms->base + pg - 1) & ~(uintptr_t)(pg - 1);
    const uintptr_t p1 = ((uintptr_t)ms->base + ms->capacity) & ~(uintptr_t)(pg - 1);
    size_t resident = 0, pages = p1 > p0 ? (p1 - p0) / pg : 0;
    unsigned char vec[4096];
    CHECK_MSG(pages >= 8 && pages <= sizeof vec && mincore((void *)p0, p1 - p0, vec) == 0,
              "mincore over the model state's %zu pages", pages);
    for (size_t i = 0; i < pages && i < sizeof vec; i++) resident += vec[i] & 1;
    CHECK_MSG(resident == 0 && a->sleep_released >= (p1 - p0) && a->sleep_released <= a->sleep_bytes + 64 * 4096,
              "asleep: %zu of the model state's %zu interior pages resident; %zu bytes released, %zu copied",
              resident, pages, a->sleep_released, a->sleep_bytes);
    const size_t copied = a->sleep_bytes, released = a->sleep_released;
    float lp[MT];
    CHECK(flatmoe_logprobs(a, &b, lp, NULL) == FLATMOE_ERR_ARG && strstr(flatmoe_last_error(), "flatmoe_wake"));
    CHECK(flatmoe_save(a, run_dir) == FLATMOE_ERR_ARG && flatmoe_export_weights(a, 64, NULL, NULL) == FLATMOE_ERR_ARG);
    CHECK_MSG(flatmoe_wake(a) == FLATMOE_OK, "wake: %s", flatmoe_last_error());
    CHECK(same_weights(a, c));
    step(a, &b);
    step(c, &b);
    CHECK_MSG(same_weights(a, c), "a step after sleep and wake differs from one without");
    printf("sleep/wake at %s x %s tokens: %zu bytes copied, %zu released (the model state's %zu pages not resident), the next step bit "
           "for bit as without sleep\n", micro_batch, seq_len, copied, released, pages);
    flatmoe_close(a);
    flatmoe_close(c);
}

/* ---- export ---- */

typedef struct reasm {
    fm_safetensors st;
    uint16_t **got;   /* [n_tensors] the reassembled bf16 */
    int64_t **seen;   /* [n_tensors] elements received, per element count (each must be 1) */
    int64_t bucket_bytes, max_used, buckets, pieces, split_tensors;
    int fail_at;      /* the callback returns 7 at this bucket (-1: never) */
    int bad;
} reasm;

static int on_bucket(void *user, const flatmoe_weight_piece *p, int n) {
    reasm *r = user;
    if (r->buckets == r->fail_at) return 7;
    int64_t used = 0;
    const char *next = n > 0 ? (const char *)p[0].data : NULL;
    for (int k = 0; k < n; k++) {
        used += p[k].nbytes;
        if ((const char *)p[k].data != next) r->bad++; /* one after another in one buffer */
        next = (const char *)p[k].data + p[k].nbytes;
        const fm_st_tensor *t = fm_st_find(&r->st, p[k].name);
        if (!t || p[k].dtype != FLATMOE_DTYPE_BF16 || p[k].offset % 2 || p[k].nbytes % 2 || p[k].nbytes <= 0) {
            r->bad++;
            continue;
        }
        const int i = (int)(t - r->st.tensors);
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= t->shape[d];
        if (p[k].ndim != t->ndim || p[k].shape[0] != t->shape[0] || (t->ndim > 1 && p[k].shape[1] != t->shape[1]) ||
            p[k].tensor_bytes != 2 * numel || p[k].offset + p[k].nbytes > 2 * numel) {
            r->bad++;
            continue;
        }
        if (p[k].nbytes != p[k].tensor_bytes && p[k].offset == 0) r->split_tensors++;
        memcpy((char *)r->got[i] + p[k].offset, p[k].data, (size_t)p[k].nbytes);
        for (int64_t e = p[k].offset / 2; e < (p[k].offset + p[k].nbytes) / 2; e++) r->seen[i][e]++;
        r->pieces++;
    }
    if (used > r->bucket_bytes) r->bad++;
    r->max_used = used > r->max_used ? used : r->max_used;
    r->buckets++;
    return 0;
}

/* Exports s at bucket_bytes and compares with the file; returns the status. */
static int export_check(flatmoe_session *s, reasm *r, int64_t bucket_bytes, const char *what) {
    const int n = r->st.n_tensors;
    r->bucket_bytes = bucket_bytes;
    r->max_used = r->buckets = r->pieces = r->split_tensors = 0;
    r->bad = 0;
    for (int i = 0; i < n; i++) {
        int64_t numel = 1;
        for (int d = 0; d < r->st.tensors[i].ndim; d++) numel *= r->st.tensors[i].shape[d];
        memset(r->got[i], 0xff, 2 * (size_t)numel);
        memset(r->seen[i], 0, sizeof(int64_t) * (size_t)numel);
    }
    const int rc = flatmoe_export_weights(s, bucket_bytes, on_bucket, r);
    if (rc != FLATMOE_OK) return rc;
    int wrong = 0, missing = 0;
    for (int i = 0; i < n; i++) {
        const fm_st_tensor *t = &r->st.tensors[i];
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= t->shape[d];
        float *f = malloc(sizeof(float) * (size_t)numel);
        FM_ASSERT(fm_st_read_f32(&r->st, t->name, f, t->ndim, t->shape) == FM_OK);
        for (int64_t e = 0; e < numel; e++) {
            missing += r->seen[i][e] != 1;
            wrong += r->got[i][e] != fm_f32_to_bf16(f[e]);
        }
        free(f);
    }
    CHECK_MSG(r->bad == 0 && missing == 0 && wrong == 0, "%s: %d bad pieces, %d elements not received once, %d differ "
              "from model.safetensors in bf16", what, r->bad, missing, wrong);
    printf("export %s (bucket %lld bytes): %lld buckets, %lld pieces, %lld tensors split, largest bucket %lld bytes: "
           "equal to model.safetensors in bf16\n", what, (long long)bucket_bytes, (long long)r->buckets,
           (long long)r->pieces, (long long)r->split_tensors, (long long)r->max_used);
    return rc;
}

static void test_export(void) {
    flatmoe_session *s = open_micro(run_dir, "3"); /* the weights of step 2's checkpoint */
    if (!s) return;
    reasm r = {0};
    r.fail_at = -1;
    char path[160];
    snprintf(path, sizeof path, "%s/step_000002/model.safetensors", run_dir);
    CHECK(fm_st_open(&r.st, path) == FM_OK);
    const int n = r.st.n_tensors;
    r.got = calloc((size_t)n, sizeof *r.got);
    r.seen = calloc((size_t)n, sizeof *r.seen);
    int64_t largest = 0, total = 0;
    for (int i = 0; i < n; i++) {
        int64_t numel = 1;
        for (int d = 0; d < r.st.tensors[i].ndim; d++) numel *= r.st.tensors[i].shape[d];
        r.got[i] = malloc(2 * (size_t)numel);
        r.seen[i] = malloc(sizeof(int64_t) * (size_t)numel);
        largest = 2 * numel > largest ? 2 * numel : largest;
        total += 2 * numel;
    }
    int largest_count = 0; /* tensors of the largest size: each split in two at largest - 1 */
    for (int i = 0; i < n; i++) {
        int64_t numel = 1;
        for (int d = 0; d < r.st.tensors[i].ndim; d++) numel *= r.st.tensors[i].shape[d];
        largest_count += 2 * numel == largest;
    }
    CHECK(export_check(s, &r, largest - 1, "1 byte under the largest tensor") == FLATMOE_OK);
    CHECK_MSG(r.split_tensors == largest_count && r.pieces == n + largest_count, "split %lld (expected %d), pieces %lld",
              (long long)r.split_tensors, largest_count, (long long)r.pieces);
    CHECK(export_check(s, &r, largest, "at the largest tensor") == FLATMOE_OK);
    CHECK(r.split_tensors == 0 && r.pieces == n);
    CHECK(export_check(s, &r, 2, "one element") == FLATMOE_OK);
    CHECK(r.buckets == total / 2 && r.max_used == 2);
    CHECK(export_check(s, &r, INT64_MAX, "huge") == FLATMOE_OK);
    CHECK(r.buckets == 1 && r.max_used == total && r.pieces == n);
    CHECK(flatmoe_export_weights(s, 1, on_bucket, &r) == FLATMOE_ERR_ARG && strstr(flatmoe_last_error(), "bucket_bytes"));
    CHECK(flatmoe_export_weights(s, 1024, NULL, &r) == FLATMOE_ERR_ARG);
    r.fail_at = 2;
    r.buckets = 0;
    CHECK(flatmoe_export_weights(s, 1024, on_bucket, &r) == FLATMOE_ERR_IO && strstr(flatmoe_last_error(), "returned 7"));
    for (int i = 0; i < n; i++) {
        free(r.got[i]);
        free(r.seen[i]);
    }
    free(r.got);
    free(r.seen);
    fm_st_close(&r.st);
    flatmoe_close(s);
}

/* ---- sampling ---- */

static void test_generate(void) {
    flatmoe_session *s = open_micro(run_dir, "13"); /* 208 tokens: V sequences of 2 */
    if (!s) return;
    enum { NP = 5, MAXN = 6 };
    const int32_t prompts[] = {7, 3, 9, 1, 2, 3, 4, 5, 8, 8, 60, 61, 62, 99, 0};
    const int64_t plen[NP] = {3, 2, 4, 1, 5};
    int32_t out[NP * MAXN], out2[NP * MAXN];
    int64_t lens[NP], lens2[NP];
    float lp[NP * MAXN], lp2[NP * MAXN];
    flatmoe_sample_spec sp = flatmoe_sample_spec_default();
    sp.max_new = MAXN;
    sp.seed = 42;
    sp.temperature = 1.5;
    CHECK_MSG(flatmoe_generate(s, prompts, NP, plen, &sp, out, lens, lp) == FLATMOE_OK, "generate: %s",
              flatmoe_last_error());
    CHECK(flatmoe_generate(s, prompts, NP, plen, &sp, out2, lens2, lp2) == FLATMOE_OK);
    CHECK_MSG(!memcmp(out, out2, sizeof out) && !memcmp(lens, lens2, sizeof lens) && !memcmp(lp, lp2, sizeof lp),
              "the same seed gave other completions");
    sp.seed = 43;
    CHECK(flatmoe_generate(s, prompts, NP, plen, &sp, out2, lens2, NULL) == FLATMOE_OK);
    CHECK_MSG(memcmp(out, out2, sizeof out) != 0, "seeds 42 and 43 gave the same %d tokens", NP * MAXN);
    /* log-probs: flatmoe_logprobs on prompt + completion */
    int32_t tok[64];
    int64_t sl[NP], n = 0, q = 0;
    for (int i = 0; i < NP; i++) {
        CHECK(lens[i] == MAXN);
        for (int64_t j = 0; j < plen[i]; j++) tok[n++] = prompts[q++];
        for (int64_t j = 0; j < lens[i]; j++) tok[n++] = out[i * MAXN + j];
        sl[i] = plen[i] + lens[i];
    }
    float ref[64];
    flatmoe_batch b = {0};
    b.n_tokens = n, b.tokens = tok, b.n_seqs = NP, b.seq_lens = sl;
    CHECK(flatmoe_logprobs(s, &b, ref, NULL) == FLATMOE_OK);
    int diff = 0;
    for (int64_t i = 0, t = 0; i < NP; t += sl[i], i++)
        for (int64_t j = 0; j < lens[i]; j++) diff += memcmp(&ref[t + plen[i] + j], &lp[i * MAXN + j], 4) != 0;
    CHECK_MSG(diff == 0, "%d completion log-probs differ from flatmoe_logprobs", diff);
    /* stop token: every completion that drew it ends there */
    sp.seed = 42;
    sp.stop_token = out[2];
    CHECK(flatmoe_generate(s, prompts, NP, plen, &sp, out2, lens2, lp2) == FLATMOE_OK);
    CHECK(lens2[0] == 3 && out2[2] == sp.stop_token && out2[3] == -1 && lp2[3] == 0.0f);
    sp.stop_token = -1;

    /* greedy, top-k and top-p from the prompt [7] against flatmoe_logprobs of every next token */
    int32_t all[2 * V];
    int64_t two[V];
    float lpv[2 * V];
    for (int v = 0; v < V; v++) all[2 * v] = 7, all[2 * v + 1] = v, two[v] = 2;
    flatmoe_batch bv = {0};
    bv.n_tokens = 2 * V, bv.tokens = all, bv.n_seqs = V, bv.seq_lens = two;
    CHECK(flatmoe_logprobs(s, &bv, lpv, NULL) == FLATMOE_OK);
    int32_t rank_of[V], by[V];
    for (int v = 0; v < V; v++) by[v] = v;
    for (int i = 0; i < V; i++) /* by[]: tokens by log-prob, the largest first */
        for (int j = i + 1; j < V; j++)
            if (lpv[2 * by[j] + 1] > lpv[2 * by[i] + 1]) { const int32_t t = by[i]; by[i] = by[j]; by[j] = t; }
    for (int i = 0; i < V; i++) rank_of[by[i]] = i;
    const int32_t p7[64] = {7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
                            7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7};
    int64_t one[64];
    int32_t o64[64];
    int64_t l64[64];
    for (int i = 0; i < 64; i++) one[i] = 1;
    sp.max_new = 1;
    sp.temperature = 0;
    CHECK(flatmoe_generate(s, p7, 1, one, &sp, o64, l64, NULL) == FLATMOE_OK);
    /* the sampling logits (xf W^T, one row's gemm) and the linear CE's (a block's gemm) agree to fp32
     * rounding of H = 32 products: |dz| <= 2 H u max|h||w| per logit, well under 1e-4 nats here;
     * a token within 1e-4 of the best counts as the best */
    CHECK_MSG(lpv[2 * o64[0] + 1] >= lpv[2 * by[0] + 1] - 1e-4f, "greedy drew %d (log-prob %g), the best is %d (%g)",
              o64[0], lpv[2 * o64[0] + 1], by[0], lpv[2 * by[0] + 1]);
    sp.temperature = 1.0;
    sp.top_k = 3;
    int out_of_k = 0, out_of_p = 0, distinct = 0, seen[V] = {0};
    for (int rep = 0; rep < 4; rep++) {
        sp.seed = 100 + (uint64_t)rep;
        CHECK(flatmoe_generate(s, p7, 64, one, &sp, o64, l64, NULL) == FLATMOE_OK);
        for (int i = 0; i < 64; i++) out_of_k += rank_of[o64[i]] >= 3 && lpv[2 * o64[i] + 1] < lpv[2 * by[2] + 1] - 1e-4f;
    }
    CHECK_MSG(out_of_k == 0, "top-k 3 drew %d tokens outside the 3 most likely", out_of_k);
    sp.top_k = 0;
    sp.top_p = 0.5; /* the nucleus: the most likely tokens until their probability reaches 0.5 */
    double cum = 0;
    int nucleus = 0;
    while (cum < 0.5) cum += exp(lpv[2 * by[nucleus++] + 1]);
    for (int rep = 0; rep < 4; rep++) {
        sp.seed = 200 + (uint64_t)rep;
        CHECK(flatmoe_generate(s, p7, 64, one, &sp, o64, l64, NULL) == FLATMOE_OK);
        for (int i = 0; i < 64; i++) {
            out_of_p += rank_of[o64[i]] >= nucleus + 1; /* one past the edge: a near tie in fp32 */
            distinct += !seen[o64[i]];
            seen[o64[i]] = 1;
        }
    }
    CHECK_MSG(out_of_p == 0, "top-p 0.5 drew %d tokens outside the nucleus of %d", out_of_p, nucleus);
    CHECK_MSG(distinct >= (nucleus < 3 ? nucleus : 3), "top-p drew only %d distinct tokens of a nucleus of %d", distinct,
              nucleus);
    printf("generate: deterministic per seed, log-probs == flatmoe_logprobs bit for bit; greedy is the argmax; top-k 3 "
           "and top-p 0.5 (nucleus %d tokens, %d drawn) stay in their sets\n", nucleus, distinct);
    /* refusals */
    sp.max_new = 16;
    CHECK(flatmoe_generate(s, p7, 1, one, &sp, o64, l64, NULL) == FLATMOE_ERR_ARG && strstr(flatmoe_last_error(), "max_new"));
    sp.max_new = 4;
    sp.top_p = 0;
    CHECK(flatmoe_generate(s, p7, 1, one, &sp, o64, l64, NULL) == FLATMOE_ERR_ARG && strstr(flatmoe_last_error(), "top_p"));
    sp.top_p = 1;
    int32_t big[64];
    int64_t blen[64];
    for (int i = 0; i < 64; i++) big[i] = 5, blen[i] = 1;
    int32_t bo[64 * 4];
    int64_t bl[64];
    CHECK(flatmoe_generate(s, big, 64, blen, &sp, bo, bl, NULL) == FLATMOE_ERR_ARG &&
          strstr(flatmoe_last_error(), "token budget of 208"));
    flatmoe_close(s);
}

int main(void) {
    snprintf(threads_s, sizeof threads_s, "%d", fm_test_threads(2));
    snprintf(cfg_path, sizeof cfg_path, "/tmp/flatmoe-capi-io-%d.json", (int)getpid());
    snprintf(run_dir, sizeof run_dir, "/tmp/flatmoe-capi-io-%d", (int)getpid());
    FILE *f = fopen(cfg_path, "w");
    if (!f || fputs(CFG, f) < 0 || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s\n", cfg_path);
        return 1;
    }
    fm_rng g;
    fm_rng_seed(&g, fm_test_seed(2930));
    test_save_resume(&g);
    test_export();
    test_sleep_wake(&g, "16", "3");
    test_sleep_wake(&g, "64", "8");
    test_generate();
    unlink(cfg_path);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", run_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", run_dir);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed != 0;
}
