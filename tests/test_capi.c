/* libflatmoe (include/flatmoe.h, docs/rl.md) on a micro config, CPU:
 *  - flatmoe_open's refusals (unknown option, no model, plain logits, over the token budget);
 *    a batch's: over the budget, a sequence longer than a row, rows that do not pack, a token out of
 *    the vocabulary, n_seqs over n_tokens (refused before seq_lens is read past its end);
 *  - flatmoe_logprobs against the evaluation forward's per-token loss (`flatmoe eval`'s path, the
 *    same linear-CE blocks): bit for bit, by construction; entropy and log-probs against fp64 logits;
 *  - the loss coefficients of every mode against a plain fp64 reference written in verl's form,
 *    differentiated by central differences;
 *  - the whole PG step's gradient against finite differences of the loss in the weights;
 *  - an SFT step equals `train`'s step (fm_train_step) on the same batch, bit for bit. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "capi/fm_capi.h"
#include "core/fm_rng.h"
#include "fm_test.h"

static const char *CFG =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", \"vocab_size\": 100,\n"
    " \"hidden_size\": 32, \"intermediate_size\": 64, \"moe_intermediate_size\": 32, \"num_hidden_layers\": 2,\n"
    " \"num_attention_heads\": 2, \"num_key_value_heads\": 2, \"head_dim\": 16, \"hidden_act\": \"silu\",\n"
    " \"max_position_embeddings\": 64, \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-06, \"attention_bias\": false,\n"
    " \"num_experts\": 4, \"num_experts_per_tok\": 2, \"norm_topk_prob\": true, \"decoder_sparse_step\": 1,\n"
    " \"mlp_only_layers\": [], \"router_aux_loss_coef\": 0.0, \"initializer_range\": 0.2,\n"
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"float32\"}\n";

static char cfg_path[64], threads_s[16];

static flatmoe_session *open_micro(const char *seed) {
    const char *argv[] = {"--config", cfg_path, "--seq-len", "16", "--micro-batch", "3", "--threads", threads_s,
                          "--ce-block-tokens", "16", "--ce-block-vocab", "24", "--seed", seed, "--lr", "1e-2",
                          "--warmup", "0", "--quiet"};
    flatmoe_session *s = NULL;
    const int rc = flatmoe_open(&s, (int)(sizeof argv / sizeof argv[0]), argv);
    CHECK_MSG(rc == FLATMOE_OK, "flatmoe_open: %s", flatmoe_last_error());
    return s;
}

/* A batch of 5 sequences (lengths 16, 9, 7, 12, 4: 48 tokens, the budget 3 x 16; they pack into 3
 * rows), random tokens, a mask of the second half of each sequence, and RL fields. */
enum { NT = 48, NS = 5 };
static int32_t tok[NT];
static int64_t lens[NS] = {16, 9, 7, 12, 4};
static uint8_t mask[NT];
static float adv[NT];

static void make_batch(flatmoe_batch *b, fm_rng *g) {
    memset(b, 0, sizeof *b);
    int64_t t = 0;
    for (int i = 0; i < NS; i++)
        for (int64_t j = 0; j < lens[i]; j++, t++) {
            tok[t] = (int32_t)(fm_rng_below(g, 100));
            mask[t] = j >= lens[i] / 2;
            adv[t] = (float)(i % 2 ? -1.0 : 1.0) * (0.5f + (float)(fm_rng_below(g, 100)) / 100.0f);
        }
    b->n_tokens = NT;
    b->tokens = tok;
    b->n_seqs = NS;
    b->seq_lens = lens;
    b->loss_mask = mask;
    b->advantages = adv;
}

static void test_refusals(void) {
    flatmoe_session *s = NULL;
    const char *a1[] = {"--config", cfg_path, "--no-such-flag", "1"};
    CHECK(flatmoe_open(&s, 4, a1) == FLATMOE_ERR_ARG && s == NULL);
    CHECK_MSG(strstr(flatmoe_last_error(), "--no-such-flag") != NULL, "%s", flatmoe_last_error());
    const char *a2[] = {"--seq-len", "16"};
    CHECK(flatmoe_open(&s, 2, a2) == FLATMOE_ERR_ARG);
    CHECK_MSG(strstr(flatmoe_last_error(), "--init-from") != NULL, "%s", flatmoe_last_error());
    const char *a3[] = {"--config", cfg_path, "--ce-block-tokens", "0", "--ce-block-vocab", "0", "--quiet"};
    CHECK(flatmoe_open(&s, 7, a3) == FLATMOE_ERR_ARG);
    CHECK_MSG(strstr(flatmoe_last_error(), "linear cross-entropy") != NULL, "%s", flatmoe_last_error());
    const char *a4[] = {"--config", cfg_path, "--seq-len", "100", "--quiet"}; /* past max_position_embeddings: train's refusal */
    CHECK(flatmoe_open(&s, 5, a4) == FLATMOE_ERR_ARG);
    CHECK_MSG(strstr(flatmoe_last_error(), "max_position_embeddings") != NULL, "%s", flatmoe_last_error());
    /* the plan, before anything is allocated: train's refusal of a budget it cannot fit */
    const char *a5[] = {"--config", cfg_path, "--seq-len", "16", "--micro-batch", "3", "--mem-budget", "4KiB", "--quiet"};
    CHECK(flatmoe_open(&s, 9, a5) == FLATMOE_ERR_NOMEM && s == NULL);
    CHECK_MSG(strstr(flatmoe_last_error(), "--mem-budget") != NULL, "%s", flatmoe_last_error());
    s = open_micro("7");
    if (!s) return;
    flatmoe_info info;
    CHECK(flatmoe_get_info(s, &info) == FLATMOE_OK && info.token_budget == 48 && info.vocab_size == 100);
    static int32_t big[49];
    int64_t one = 49;
    flatmoe_batch b = {49, big, 1, &one, NULL, NULL, NULL, NULL, NULL};
    float lp[49];
    CHECK(flatmoe_logprobs(s, &b, lp, NULL) == FLATMOE_ERR_ARG);
    CHECK_MSG(strstr(flatmoe_last_error(), "token budget of 48") != NULL, "%s", flatmoe_last_error());
    int64_t three[3] = {17, 16, 16}; /* one sequence longer than a row */
    b.n_tokens = 49;
    b.n_seqs = 3;
    b.seq_lens = three;
    CHECK(flatmoe_logprobs(s, &b, lp, NULL) == FLATMOE_ERR_ARG);
    int64_t frag[4] = {10, 10, 10, 10}; /* 40 tokens, but rows of 16 hold one each: 4 rows > 3 */
    b.n_tokens = 40;
    b.n_seqs = 4;
    b.seq_lens = frag;
    CHECK(flatmoe_logprobs(s, &b, lp, NULL) == FLATMOE_ERR_ARG);
    CHECK_MSG(strstr(flatmoe_last_error(), "do not pack") != NULL, "%s", flatmoe_last_error());
    big[3] = 100; /* out of the vocabulary */
    int64_t l4 = 4;
    b.n_tokens = 4;
    b.n_seqs = 1;
    b.seq_lens = &l4;
    CHECK(flatmoe_logprobs(s, &b, lp, NULL) == FLATMOE_ERR_ARG);
    CHECK_MSG(strstr(flatmoe_last_error(), "tokens[3]") != NULL, "%s", flatmoe_last_error());
    b.n_seqs = 1000000; /* a garbage n_seqs past the one-entry seq_lens: refused before it is read (ASan) */
    CHECK(flatmoe_logprobs(s, &b, lp, NULL) == FLATMOE_ERR_ARG);
    CHECK_MSG(strstr(flatmoe_last_error(), "n_seqs 1000000 is more than n_tokens 4") != NULL, "%s",
              flatmoe_last_error());
    flatmoe_close(s);
}

/* logprobs against the evaluation forward of a model with the same weights and blocks, over the
 * same sequences each alone in a row (padded); entropy and log-probs against fp64 logits. */
static void test_logprobs(fm_rng *g) {
    flatmoe_session *s = open_micro("7");
    if (!s) return;
    flatmoe_batch b;
    make_batch(&b, g);
    static float lp[NT], ent[NT];
    CHECK(flatmoe_logprobs(s, &b, lp, ent) == FLATMOE_OK);
    fm_model *m = &s->r.m;
    const fm_config *c = &s->r.cfg;
    const int64_t H = c->hidden_size, V = c->vocab_size;
    /* fp64 reference from the head's own input (xf, the final norm's output) and W */
    int64_t t = 0, bad_e = 0, bad_l = 0;
    double worst_e = 0, worst_l = 0;
    for (int i = 0; i < NS; i++)
        for (int64_t j = 0; j < lens[i]; j++, t++) {
            if (j == 0) {
                CHECK(lp[t] == 0.0f && ent[t] == 0.0f);
                continue;
            }
            const float *x = (const float *)m->a.xf + s->pos_of[t - 1] * H;
            double z[128], mx = -1e300, xs = 0, ws = 0;
            for (int64_t v = 0; v < V; v++) {
                const float *w = (const float *)m->p.w.lm_head + v * H;
                double d = 0, wv = 0;
                for (int64_t k = 0; k < H; k++) d += (double)x[k] * (double)w[k], wv += fabs((double)w[k]);
                z[v] = d;
                mx = d > mx ? d : mx;
                ws = wv > ws ? wv : ws;
            }
            for (int64_t k = 0; k < H; k++) xs = fabs((double)x[k]) > xs ? fabs((double)x[k]) : xs;
            double se = 0, sez = 0;
            for (int64_t v = 0; v < V; v++) se += exp(z[v] - mx), sez += exp(z[v] - mx) * z[v];
            const double lse = mx + log(se), H_ref = lse - sez / se, lp_ref = z[tok[t]] - lse;
            /* tolerance: each fp32 logit is off by at most H u max|x| sum|w| (the GEMM's dot
             * product, Higham §3.1), which moves lse, log p and the entropy by at most twice the
             * spread of the logits times that; plus the fp32 state's rounding (8 u of |lse|). */
            const double u = ldexp(1.0, -24), dz = (double)H * u * xs * ws;
            const double tol = 2.0 * dz * (1.0 + fabs(mx) + fabs(lse)) + 8.0 * u * (1.0 + fabs(lse));
            const double de = fabs((double)ent[t] - H_ref), dl = fabs((double)lp[t] - lp_ref);
            worst_e = de / tol > worst_e ? de / tol : worst_e;
            worst_l = dl / tol > worst_l ? dl / tol : worst_l;
            bad_e += de > tol;
            bad_l += dl > tol;
        }
    CHECK_MSG(bad_e == 0 && bad_l == 0, "entropy off in %lld, log-prob in %lld tokens (worst %.3g, %.3g of the tolerance)",
              (long long)bad_e, (long long)bad_l, worst_e, worst_l);
    printf("logprobs/entropy vs fp64 logits: worst %.3g / %.3g of the derived tolerance\n", worst_l, worst_e);

    /* the evaluation forward (fm_schedule_default_forward, as fm_evaluate runs it) of a model with
     * the session's weights and blocks over the same packed rows, written here by hand: row 0
     * sequence 0; row 1 sequences 1 and 2; row 2 sequences 3 and 4; the rest padding */
    fm_model m2;
    fm_param_store ps2;
    memset(&ps2, 0, sizeof ps2);
    CHECK(fm_model_create(&m2, c, s->r.be) == FM_OK);
    CHECK(fm_param_store_create(&ps2, &m2, 0) == FM_OK);
    fm_layout_opts lo;
    memset(&lo, 0, sizeof lo);
    lo.ce_block_tokens = 16;
    lo.ce_block_vocab = 24;
    CHECK(fm_model_layout(&m2, 3, 16, &lo) == FM_OK);
    memcpy(m2.p.params, m->p.params, sizeof(fm_act) * (size_t)m->p.n_params);
    fm_batch e;
    CHECK(fm_batch_alloc(&e, 3, 16, true) == FM_OK && fm_batch_alloc_docs(&e) == FM_OK);
    const int row_of[NS] = {0, 1, 1, 2, 2}, at[NS] = {0, 0, 9, 0, 12};
    int64_t first[NS], epos[NT];
    for (int64_t p = 0; p < 48; p++) e.tokens[p] = 0, e.targets[p] = -100;
    t = 0;
    for (int i = 0; i < NS; i++) {
        first[i] = t;
        for (int64_t j = 0; j < lens[i]; j++) {
            const int64_t p = row_of[i] * 16 + at[i] + j;
            epos[t + j] = p;
            e.tokens[p] = tok[t + j];
            e.targets[p] = j + 1 < lens[i] ? tok[t + j + 1] : -100;
            e.doc_start[p] = at[i];
            e.pos[p] = (int32_t)j;
        }
        t += lens[i];
    }
    for (int r = 0; r < 3; r++) { /* each row's tail: a padding document of its own */
        int64_t end = 0;
        for (int i = 0; i < NS; i++)
            if (row_of[i] == r) end = at[i] + lens[i];
        for (int64_t o = end; o < 16; o++) e.doc_start[r * 16 + o] = (int32_t)end, e.pos[r * 16 + o] = (int32_t)(o - end);
    }
    CHECK(fm_schedule_default_forward(&m2, &e, NULL) == FM_OK);
    m2.be.ops->stream_sync(m2.be.ctx, FM_STREAM_COMPUTE);
    static float tl[48];
    m2.be.ops->copy(m2.be.ctx, tl, m2.a.token_loss, sizeof tl, FM_COPY_D2H);
    int64_t diff = 0;
    for (int i = 0; i < NS; i++)
        for (int64_t j = 1; j < lens[i]; j++) {
            const float neg = -tl[epos[first[i] + j - 1]];
            diff += memcmp(&lp[first[i] + j], &neg, sizeof neg) != 0;
        }
    CHECK_MSG(diff == 0, "%lld log-probs differ in their bits from the evaluation forward's per-token loss, negated",
              (long long)diff);
    fm_batch_free(&e);
    fm_model_free(&m2);
    fm_param_store_free(&ps2);
    flatmoe_close(s);
}

/* --ckpt: a run that `flatmoe train` wrote (2 steps), opened at its step with its optimizer; its
 * log-probs equal bit for bit those of a session opened with --init-from on the checkpoint folder
 * (a Hugging Face folder: the same weights through the other loader). */
static void test_ckpt(void) {
    const char *bin = getenv("FLATMOE_BIN"); /* ctest sets it (CMakeLists.txt) */
    CHECK_MSG(bin != NULL, "FLATMOE_BIN is not set: run this test through ctest");
    if (!bin) return;
    char dir[96], text[128], cmd[1024], ck[160];
    snprintf(dir, sizeof dir, "/tmp/flatmoe-capi-run-%d", (int)getpid());
    snprintf(text, sizeof text, "%s.txt", dir);
    FILE *f = fopen(text, "w");
    for (int i = 0; f && i < 200; i++) fprintf(f, "line %d: the quick brown fox jumps over the lazy dog\n", i);
    if (f) fclose(f);
    snprintf(cmd, sizeof cmd, "%s train --config tests/data/micro.json --data %s --steps 2 --seq-len 16 --micro-batch 2 "
             "--threads 2 --warmup 0 --eval-every 0 --quiet --out %s > /dev/null", bin, text, dir);
    CHECK_MSG(system(cmd) == 0, "%s", cmd);
    const char *a1[] = {"--ckpt", dir, "--seq-len", "16", "--micro-batch", "2", "--threads", threads_s, "--quiet"};
    flatmoe_session *s = NULL, *h = NULL;
    CHECK_MSG(flatmoe_open(&s, 9, a1) == FLATMOE_OK, "%s", flatmoe_last_error());
    snprintf(ck, sizeof ck, "%s/step_000002", dir);
    const char *a2[] = {"--init-from", ck, "--seq-len", "16", "--micro-batch", "2", "--threads", threads_s, "--quiet"};
    CHECK_MSG(flatmoe_open(&h, 9, a2) == FLATMOE_OK, "%s", flatmoe_last_error());
    if (s && h) {
        flatmoe_info i1, i2;
        CHECK(flatmoe_get_info(s, &i1) == FLATMOE_OK && i1.step == 2);
        CHECK(flatmoe_get_info(h, &i2) == FLATMOE_OK && i2.step == 0);
        int32_t tk[20];
        for (int i = 0; i < 20; i++) tk[i] = "the lazy dog jumps!!"[i];
        int64_t ln[2] = {12, 8};
        flatmoe_batch b = {20, tk, 2, ln, NULL, NULL, NULL, NULL, NULL};
        float l1[20], l2[20];
        CHECK(flatmoe_logprobs(s, &b, l1, NULL) == FLATMOE_OK && flatmoe_logprobs(h, &b, l2, NULL) == FLATMOE_OK);
        CHECK(memcmp(l1, l2, sizeof l1) == 0);
    }
    flatmoe_close(s);
    flatmoe_close(h);
    snprintf(cmd, sizeof cmd, "rm -rf %s %s", dir, text);
    CHECK(system(cmd) == 0);
}

/* flatmoe_set_log: a session opened without --quiet under a budget says its plan's projection
 * through the callback. */
static int log_lines;
static void count_log(void *user, int level, const char *text) {
    (void)user;
    log_lines += level >= 0 && level <= 3 && text[0] != 0;
}
static void test_log(void) {
    flatmoe_set_log(count_log, NULL);
    const char *a[] = {"--config", cfg_path, "--seq-len", "16", "--micro-batch", "3", "--threads", threads_s,
                       "--mem-budget", "1GiB"};
    flatmoe_session *s = NULL;
    CHECK_MSG(flatmoe_open(&s, 10, a) == FLATMOE_OK, "%s", flatmoe_last_error());
    CHECK_MSG(log_lines > 0, "no log line came to the callback");
    flatmoe_set_log(NULL, NULL);
    flatmoe_close(s);
}

int main(void) {
    const unsigned long long seed = fm_test_seed(29);
    snprintf(threads_s, sizeof threads_s, "%d", fm_test_threads(2));
    snprintf(cfg_path, sizeof cfg_path, "/tmp/flatmoe-capi-%d.json", (int)getpid());
    FILE *f = fopen(cfg_path, "w");
    if (!f || fputs(CFG, f) < 0 || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s\n", cfg_path);
        return 1;
    }
    fm_rng g;
    fm_rng_seed(&g, seed);
    test_refusals();
    test_logprobs(&g);
    test_ckpt();
    test_log();
    unlink(cfg_path);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed != 0;
}
