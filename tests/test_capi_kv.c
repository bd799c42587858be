/* flatmoe_generate's KV cache (--kv-cache; src/capi/flatmoe_kv.c, docs/rl.md), CPU:
 *  - two configs: olmoe (micro.json: QK-norm over the whole q and k, tied embeddings, norm_topk_prob
 *    false) and qwen3_moe with a dense layer between two MoE layers (QK-norm per head,
 *    norm_topk_prob true, sharp logits from initializer_range 0.2);
 *  - the same weights with and without the cache: flatmoe_generate gives the same tokens and lengths
 *    for greedy and sampled decoding (temperature 1, top-k, top-p, a stop token) on several seeds,
 *    and the same completion log-probs bit for bit (those come from the same whole-sequence forward
 *    in both). The tokens agree because the cached logits equal the whole-prefix ones within fp32
 *    reassociation and no draw here falls within that of a boundary: not by construction, so the
 *    logits are checked directly too:
 *  - the cached decoder's log-probs over whole sequences (one pass, then the same sequences fed a
 *    token at a time after a prompt pass) against flatmoe_logprobs's whole-prefix forward: within
 *    1e-4 (attention in double here against the flash tiles in fp32, the expert sums in another
 *    order: a few fp32 ulps of each layer's output, through 2-3 layers; measured and printed);
 *  - the cache's bytes are its bound formula's (kv_formula below: flatmoe_kv.c's pieces, each rounded
 *    to 64 bytes), the session's one host arena is fm_capi_host_bytes (what `flatmoe plan --library`
 *    prints) and holds the cache's share beside the rest; and the refusals: --kv-cache
 *    with the sigmoid router (glm4_moe) names it; `train` refuses --kv-cache (tests/cli_* cover the
 *    CLI; here the spec check). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "capi/fm_capi.h"
#include "run/fm_spec_check.h"
#include "core/fm_rng.h"
#include "fm_test.h"

static const char *QWEN_DENSE =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", \"vocab_size\": 100,\n"
    " \"hidden_size\": 32, \"intermediate_size\": 48, \"moe_intermediate_size\": 32, \"num_hidden_layers\": 3,\n"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16, \"hidden_act\": \"silu\",\n"
    " \"max_position_embeddings\": 64, \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-06, \"attention_bias\": false,\n"
    " \"num_experts\": 6, \"num_experts_per_tok\": 2, \"norm_topk_prob\": true, \"decoder_sparse_step\": 1,\n"
    " \"mlp_only_layers\": [1], \"router_aux_loss_coef\": 0.01, \"initializer_range\": 0.2,\n"
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"float32\"}\n";

enum { NP = 3, MAXNEW = 12, MAXTOK = 128 };

static flatmoe_session *open_cfg(const char *cfg, bool kv) {
    const char *argv[] = {"--config", cfg, "--seq-len", "32", "--micro-batch", "3", "--threads", "2",
                          "--ce-block-tokens", "16", "--ce-block-vocab", "24", "--seed", "5", "--quiet", "--kv-cache"};
    flatmoe_session *s = NULL;
    const int argc = (int)(sizeof argv / sizeof argv[0]) - (kv ? 0 : 1);
    const int rc = flatmoe_open(&s, argc, argv);
    CHECK_MSG(rc == FLATMOE_OK, "flatmoe_open(%s%s): %s", cfg, kv ? " --kv-cache" : "", flatmoe_last_error());
    return rc == FLATMOE_OK ? s : NULL;
}

/* The cached decoder's log-probs of tok [n] (one sequence, positions 0 .. n-1) into lp [n] (0 at
 * the first): a pass over the first `split` tokens, then one token per pass (split = n: one pass). */
static void kv_logprobs(flatmoe_session *s, const int32_t *tok, int64_t n, int64_t split, double *lp) {
    fm_capi_kv *kv = &s->kv;
    const int64_t H = s->r.cfg.hidden_size, V = s->r.cfg.vocab_size;
    static float row[4096];
    lp[0] = 0;
    for (int64_t a = 0; a < n;) {
        const int64_t b = a == 0 ? split : a + 1;
        for (int64_t t = a; t < b; t++) kv->pos[t - a] = (int32_t)t, kv->slot[t - a] = t, kv->first[t - a] = 0;
        FM_ASSERT(fm_capi_kv_pass(s, tok + a, b - a) == FM_OK);
        for (int64_t t = a; t < b && t + 1 < n; t++) {
            fm_linear_fwd(&s->r.m.be, row, FM_DTYPE_F32, kv->ln + (t - a) * H, s->r.m.p.w.lm_head, 1, H, V);
            double mx = row[0], sum = 0;
            for (int64_t v = 1; v < V; v++) mx = row[v] > mx ? row[v] : mx;
            for (int64_t v = 0; v < V; v++) sum += exp((double)row[v] - mx);
            lp[t + 1] = (double)row[tok[t + 1]] - mx - log(sum);
        }
        a = b;
    }
}

/* flatmoe_kv.c's bound: K, V [L, N, nkv hd], one pass's scratch over N tokens, one token's SwiGLU;
 * fp32 but pos (int32), slot and first (int64), topk_idx (int32); each piece rounded to 64 bytes. */
static size_t kv_formula(const fm_config *c, int64_t N) {
    const int64_t H = c->hidden_size, L = c->num_hidden_layers, nh = c->num_attention_heads, k = c->num_experts_per_tok;
    const int64_t qd = nh * c->head_dim, kd = c->num_key_value_heads * c->head_dim, E = c->num_experts;
    const int64_t I = c->moe_intermediate_size > c->dense_intermediate_size ? c->moe_intermediate_size
                                                                            : c->dense_intermediate_size;
    const int64_t f32[] = {L * N * kd, L * N * kd, N * H, N * H, N * H, N * qd, N * qd, N * kd, N * kd, N * E, N * E,
                           N * nh, N /* pos, int32 */, 3 * I + H, N * k /* topk_idx, int32 */, N * k, N};
    size_t sum = 2 * fm_arena_round(sizeof(int64_t) * (size_t)N); /* slot, first */
    for (size_t i = 0; i < sizeof f32 / sizeof f32[0]; i++) sum += fm_arena_round(4 * (size_t)f32[i]);
    return sum;
}

static void run_config(const char *name, const char *cfg) {
    flatmoe_session *a = open_cfg(cfg, false), *b = open_cfg(cfg, true);
    if (!a || !b) return;
    size_t kvb = 0;
    const size_t hb = fm_capi_host_bytes(&b->r.cfg, b->B, b->T, 0, true, &kvb);
    CHECK(!a->kv.on && b->kv.on && b->kv.bytes == kv_formula(&b->r.cfg, b->budget) && kvb == b->kv.bytes);
    CHECK_MSG(b->host.capacity == hb && b->host.used == hb && a->host.used + kvb == hb &&
              a->host.used == fm_capi_host_bytes(&a->r.cfg, a->B, a->T, 0, false, NULL),
              "%s: the session's host arena: %zu and %zu bytes used, fm_capi_host_bytes %zu with a %zu-byte cache",
              name, a->host.used, b->host.used, hb, kvb);
    const int64_t V = b->r.cfg.vocab_size;
    fm_rng g;
    fm_rng_seed(&g, 17);
    const int64_t plen[NP] = {5, 9, 3};
    int32_t prompts[17];
    for (int i = 0; i < 17; i++) prompts[i] = (int32_t)fm_rng_below(&g, (uint32_t)V);
    const struct { double temp; int64_t top_k; double top_p; uint64_t seed; int32_t stop; } cases[] = {
        {0, 0, 1, 0, -1}, {1, 0, 1, 1, -1}, {1, 0, 1, 2, -1}, {0.8, 5, 1, 3, -1}, {1, 0, 0.9, 4, 7}, {1, 0, 1, 5, 3}};
    static int32_t ta[NP * MAXNEW], tb[NP * MAXNEW];
    static float la[NP * MAXNEW], lb[NP * MAXNEW];
    int64_t na[NP], nb[NP];
    int same_tok = 0, n_cases = (int)(sizeof cases / sizeof cases[0]);
    for (int c = 0; c < n_cases; c++) {
        flatmoe_sample_spec sp = flatmoe_sample_spec_default();
        sp.max_new = MAXNEW, sp.temperature = cases[c].temp, sp.top_k = cases[c].top_k, sp.top_p = cases[c].top_p;
        sp.seed = cases[c].seed, sp.stop_token = cases[c].stop;
        CHECK_MSG(flatmoe_generate(a, prompts, NP, plen, &sp, ta, na, la) == FLATMOE_OK, "%s", flatmoe_last_error());
        CHECK_MSG(flatmoe_generate(b, prompts, NP, plen, &sp, tb, nb, lb) == FLATMOE_OK, "%s", flatmoe_last_error());
        const bool tok = !memcmp(ta, tb, sizeof ta) && !memcmp(na, nb, sizeof na);
        same_tok += tok;
        CHECK_MSG(tok, "%s case %d: the cached generation's tokens differ from the whole-prefix one's", name, c);
        CHECK_MSG(!tok || !memcmp(la, lb, sizeof la), "%s case %d: the completion log-probs differ", name, c);
    }
    /* the cached decoder's log-probs against the whole-prefix forward's, on the last case's sequences */
    double worst = 0;
    int64_t q = 0;
    for (int i = 0; i < NP; i++) {
        int32_t seq[64];
        const int64_t n = plen[i] + na[i];
        memcpy(seq, prompts + q, sizeof(int32_t) * (size_t)plen[i]);
        memcpy(seq + plen[i], ta + i * MAXNEW, sizeof(int32_t) * (size_t)na[i]);
        q += plen[i];
        flatmoe_batch bt = {0};
        bt.n_tokens = n, bt.tokens = seq, bt.n_seqs = 1, bt.seq_lens = &n;
        float ref[64];
        CHECK_MSG(flatmoe_logprobs(a, &bt, ref, NULL) == FLATMOE_OK, "%s", flatmoe_last_error());
        for (int pass = 0; pass < 2; pass++) { /* one pass; the prompt, then a token at a time */
            double lp[64];
            kv_logprobs(b, seq, n, pass == 0 ? n : plen[i], lp);
            for (int64_t t = 1; t < n; t++) worst = fmax(worst, fabs(lp[t] - (double)ref[t]));
        }
    }
    printf("%s: %d of %d generations the same with and without the cache; cached log-probs vs the whole-prefix "
           "forward: worst |d| %.2e (tolerance 1e-4)\n", name, same_tok, n_cases, worst);
    CHECK_MSG(worst <= 1e-4, "%s: the cached decoder's log-probs differ by %.3e", name, worst);
    flatmoe_close(a);
    flatmoe_close(b);
}

int main(void) {
    const char *src = getenv("FLATMOE_SOURCE_DIR");
    char micro[4096], glm[4096], qwen[64] = "/tmp/fm_test_capi_kv_XXXXXX";
    snprintf(micro, sizeof micro, "%s/tests/data/micro.json", src ? src : ".");
    snprintf(glm, sizeof glm, "%s/tests/data/glm4_tiny.json", src ? src : ".");
    const int fd = mkstemp(qwen);
    FM_ASSERT(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs(QWEN_DENSE, f);
    fclose(f);
    run_config("olmoe (micro.json)", micro);
    run_config("qwen3_moe with a dense layer", qwen);
    remove(qwen);
    /* the refusals */
    const char *argv[] = {"--config", glm, "--seq-len", "16", "--micro-batch", "1", "--quiet", "--kv-cache"};
    flatmoe_session *s = NULL;
    CHECK(flatmoe_open(&s, 8, argv) == FLATMOE_ERR_UNSUPPORTED && s == NULL);
    CHECK_MSG(strstr(flatmoe_last_error(), "sigmoid router") != NULL, "%s", flatmoe_last_error());
    fm_run_spec sp;
    fm_spec_default(&sp, FM_CMD_TRAIN);
    CHECK(fm_spec_set(&sp, "config", micro) == FM_OK && fm_spec_set(&sp, "kv-cache", "true") == FM_OK);
    CHECK(fm_spec_check(&sp) == FM_ERR_ARG && strstr(fm_errmsg(), "--kv-cache") != NULL);
    fm_spec_free(&sp);
    return fm_test_finish();
}
