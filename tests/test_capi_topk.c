/* libflatmoe's top-k log-probs (include/flatmoe.h flatmoe_logprobs_ex; the linear CE's running
 * top-k, src/bounded/fm_linear_ce.c and backend lce_topk_*), on a micro config (vocabulary 100 in
 * blocks of 24: five blocks, the last partial, so the top-k is merged across blocks), CPU:
 *  - against fp64 logits from the head's own input and weights: the j-th log-prob within the
 *    derived tolerance of the fp64 j-th largest (order statistics move by at most the largest
 *    perturbation), each id's fp64 log-prob within twice that of it (a near-tie may swap two ids),
 *    the ids distinct; where a top id is the token, its log-prob bits equal flatmoe_logprobs's;
 *  - a smaller k is the prefix of a larger one; the first token of a sequence gets -inf and -1;
 *  - the vocabulary live set's painted high-water within its planned bound (the top-k buffers
 *    planned at open; never N x V);
 *  - refusals: topk over the session's --logprobs-topk, a NULL output, --logprobs-topk out of range. */
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
    " \"mlp_only_layers\": [], \"router_aux_loss_coef\": 0.01, \"initializer_range\": 0.2,\n"
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"float32\"}\n";

enum { V = 100, KMAX = 8, NT = 44, NS = 4 };
static char cfg_path[64], threads_s[16];

static flatmoe_session *open_s(const char *topk) {
    const char *argv[] = {"--config", cfg_path, "--seq-len", "16", "--micro-batch", "3", "--threads", threads_s,
                          "--ce-block-tokens", "16", "--ce-block-vocab", "24", "--seed", "17", "--quiet",
                          "--logprobs-topk", topk};
    flatmoe_session *s = NULL;
    const int rc = flatmoe_open(&s, (int)(sizeof argv / sizeof argv[0]), argv);
    CHECK_MSG(rc == FLATMOE_OK, "flatmoe_open: %s", flatmoe_last_error());
    return s;
}

static int32_t tok[NT];
static int64_t lens[NS] = {16, 10, 6, 12};

static void make_batch(flatmoe_batch *b, fm_rng *g) {
    memset(b, 0, sizeof *b);
    for (int64_t t = 0; t < NT; t++) tok[t] = (int32_t)fm_rng_below(g, V);
    b->n_tokens = NT;
    b->tokens = tok;
    b->n_seqs = NS;
    b->seq_lens = lens;
}

static int cmp_desc(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void test_topk(fm_rng *g) {
    flatmoe_session *s = open_s("8");
    if (!s) return;
    flatmoe_batch b;
    make_batch(&b, g);
    static float lp[NT], tl[NT * KMAX], tl3[NT * 3];
    static int32_t ti[NT * KMAX], ti3[NT * 3];
    fm_arena *voc = &s->r.m.a.arena[FM_LIVE_VOCAB];
    fm_arena_paint(voc);
    CHECK(flatmoe_logprobs_ex(s, &b, lp, NULL, NULL, KMAX, tl, ti) == FLATMOE_OK);
    const size_t hw = fm_arena_touched(voc), cap = voc->capacity, plan = s->r.plan.bytes[FM_LIVE_VOCAB];
    CHECK_MSG(hw > 0 && hw <= cap && cap <= plan, "vocabulary live set: high-water %zu, arena %zu, plan %zu", hw, cap,
              plan);
    const fm_model *m = &s->r.m;
    const int64_t H = s->r.cfg.hidden_size;
    int64_t bad_v = 0, bad_i = 0, bad_bits = 0, hits = 0;
    double worst = 0;
    for (int64_t t = 0, i = 0; i < NS; i++)
        for (int64_t j = 0; j < lens[i]; j++, t++) {
            if (j == 0) {
                for (int q = 0; q < KMAX; q++) bad_v += !(isinf(tl[t * KMAX + q]) && tl[t * KMAX + q] < 0 && ti[t * KMAX + q] == -1);
                continue;
            }
            const float *x = (const float *)m->a.xf + s->pos_of[t - 1] * H;
            double z[V], srt[V], mx = -1e300, xs = 0, ws = 0;
            for (int64_t v = 0; v < V; v++) {
                const float *w = (const float *)m->p.w.lm_head + v * H;
                double d = 0, wv = 0;
                for (int64_t k = 0; k < H; k++) d += (double)x[k] * (double)w[k], wv += fabs((double)w[k]);
                z[v] = d;
                mx = d > mx ? d : mx;
                ws = wv > ws ? wv : ws;
            }
            for (int64_t k = 0; k < H; k++) xs = fmax(xs, fabs((double)x[k]));
            double se = 0;
            for (int64_t v = 0; v < V; v++) se += exp(z[v] - mx);
            const double lse = mx + log(se);
            for (int64_t v = 0; v < V; v++) srt[v] = z[v] - lse;
            qsort(srt, V, sizeof(double), cmp_desc);
            /* test_capi.c's tolerance: each fp32 logit off by at most H u max|x| sum|w| (Higham §3.1),
             * moving a log-prob by at most twice the spread times that, plus the fp32 state's 8 u |lse| */
            const double u = ldexp(1.0, -24), dz = (double)H * u * xs * ws;
            const double tol = 2.0 * dz * (1.0 + fabs(mx) + fabs(lse)) + 8.0 * u * (1.0 + fabs(lse));
            for (int q = 0; q < KMAX; q++) {
                const float v = tl[t * KMAX + q];
                const int32_t id = ti[t * KMAX + q];
                const double d = fabs((double)v - srt[q]);
                worst = fmax(worst, d / tol);
                bad_v += d > tol;
                bool dup = false;
                for (int p = 0; p < q; p++) dup |= ti[t * KMAX + p] == id;
                bad_i += id < 0 || id >= V || dup || fabs((z[id] - lse) - srt[q]) > 2 * tol;
                if (id == tok[t]) {
                    hits++;
                    bad_bits += memcmp(&v, &lp[t], sizeof v) != 0;
                }
            }
        }
    CHECK_MSG(bad_v == 0 && bad_i == 0, "top-%d log-probs: %lld values and %lld ids off the fp64 reference (worst %.3g "
              "of the tolerance)", KMAX, (long long)bad_v, (long long)bad_i, worst);
    CHECK_MSG(bad_bits == 0, "%lld of %lld top ids equal to the token: log-prob bits differ from flatmoe_logprobs's",
              (long long)bad_bits, (long long)hits);
    printf("top-%d log-probs vs fp64 logits: worst %.3g of the derived tolerance (%lld tokens among their top-%d)\n",
           KMAX, worst, (long long)hits, KMAX);
    CHECK(flatmoe_logprobs_ex(s, &b, lp, NULL, NULL, 3, tl3, ti3) == FLATMOE_OK);
    int bad_prefix = 0;
    for (int64_t t = 0; t < NT; t++)
        bad_prefix += memcmp(tl3 + t * 3, tl + t * KMAX, 3 * sizeof(float)) || memcmp(ti3 + t * 3, ti + t * KMAX, 3 * 4);
    CHECK_MSG(bad_prefix == 0, "%d tokens' top-3 are not the prefix of their top-%d", bad_prefix, KMAX);
    /* refusals */
    CHECK(flatmoe_logprobs_ex(s, &b, lp, NULL, NULL, KMAX + 1, tl, ti) == FLATMOE_ERR_ARG);
    CHECK_MSG(strstr(flatmoe_last_error(), "--logprobs-topk 9") != NULL, "%s", flatmoe_last_error());
    CHECK(flatmoe_logprobs_ex(s, &b, lp, NULL, NULL, 2, tl, NULL) == FLATMOE_ERR_ARG);
    flatmoe_close(s);
    flatmoe_session *z = open_s("0");
    if (z) {
        CHECK(flatmoe_logprobs_ex(z, &b, lp, NULL, NULL, 1, tl, ti) == FLATMOE_ERR_ARG);
        flatmoe_close(z);
    }
    const char *bad[] = {"--config", cfg_path, "--logprobs-topk", "65", "--quiet"};
    flatmoe_session *n = NULL;
    CHECK(flatmoe_open(&n, 5, bad) == FLATMOE_ERR_ARG && !n);
    CHECK_MSG(strstr(flatmoe_last_error(), "--logprobs-topk 65") != NULL, "%s", flatmoe_last_error());
}

int main(void) {
    const unsigned long long seed = fm_test_seed(2932);
    snprintf(threads_s, sizeof threads_s, "%d", fm_test_threads(2));
    snprintf(cfg_path, sizeof cfg_path, "/tmp/flatmoe-capi-topk-%d.json", (int)getpid());
    FILE *f = fopen(cfg_path, "w");
    if (!f || fputs(CFG, f) < 0 || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s\n", cfg_path);
        return 1;
    }
    fm_rng g;
    fm_rng_seed(&g, seed);
    test_topk(&g);
    unlink(cfg_path);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed != 0;
}
