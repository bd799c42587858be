/* libflatmoe's routes (include/flatmoe.h: flatmoe_logprobs_ex's routed_experts, flatmoe_batch's
 * routed_experts; src/capi/flatmoe_replay.c, the backend's router_replay), on a micro config with
 * a dense layer between two MoE layers (mlp_only_layers [1]: the routes' layer axis skips it), CPU:
 *  - the routes taken are each token's top-k of the router's probabilities, found here by a plain
 *    selection over the layer's saved probabilities (decreasing, ties to the lower id);
 *  - replaying the router's own routes is bit-identical to no replay: log-probs and entropies, and
 *    the weights after two train steps;
 *  - replaying other routes equals the forced routing of the test hook (fm_router.h force_route)
 *    where the two coincide: bit for bit without norm_topk_prob (both weigh by the probabilities
 *    themselves), and with it within the stated tolerance (the hook sums in double);
 *  - the gradient of a PG step under replay, router weights included, against finite differences;
 *  - out-of-range and duplicate ids refused naming the token, the MoE layer and the value;
 *  - under adversarial replayed routes (every token to experts 0 and 1), the expert-dispatch live
 *    set's measured high-water mark stays within its planned bound, as under the router's routes.
 * The same for glm4_moe's sigmoid router (DeepSeek-V3's: 6 experts in 3 groups keeping 2,
 * routed_scaling_factor 2.5, layer 0 dense, a shared expert; a random e_score_correction_bias so
 * the selection is not the scores' order): own routes bit-identical to no replay, other routes
 * equal to forced routing (bitwise without norm_topk_prob, within the tolerance with it), and the
 * PG gradient under replay (the gates: the scores at the given experts, no bias, no group mask,
 * normalized, times the scaling) against finite differences. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "capi/fm_capi.h"
#include "core/fm_rng.h"
#include "fm_test.h"

static const char *CFG_FMT =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", \"vocab_size\": 100,\n"
    " \"hidden_size\": 32, \"intermediate_size\": 48, \"moe_intermediate_size\": 32, \"num_hidden_layers\": 3,\n"
    " \"num_attention_heads\": 2, \"num_key_value_heads\": 2, \"head_dim\": 16, \"hidden_act\": \"silu\",\n"
    " \"max_position_embeddings\": 64, \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-06, \"attention_bias\": false,\n"
    " \"num_experts\": 6, \"num_experts_per_tok\": 2, \"norm_topk_prob\": %s, \"decoder_sparse_step\": 1,\n"
    " \"mlp_only_layers\": [1], \"router_aux_loss_coef\": 0.01, \"initializer_range\": 0.2,\n"
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"float32\"}\n";

/* glm4_moe: layer 0 dense (first_k_dense_replace), MoE layers 1 and 2 (Glm4MoeConfig's fields) */
static const char *CFG_GLM_FMT =
    "{\"architectures\": [\"Glm4MoeForCausalLM\"], \"model_type\": \"glm4_moe\", \"vocab_size\": 100,\n"
    " \"hidden_size\": 32, \"intermediate_size\": 48, \"moe_intermediate_size\": 32, \"num_hidden_layers\": 3,\n"
    " \"num_attention_heads\": 2, \"num_key_value_heads\": 2, \"head_dim\": 16, \"max_position_embeddings\": 64,\n"
    " \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-06, \"n_routed_experts\": 6, \"n_shared_experts\": 1,\n"
    " \"num_experts_per_tok\": 2, \"n_group\": 3, \"topk_group\": 2, \"first_k_dense_replace\": 1,\n"
    " \"routed_scaling_factor\": 2.5, \"norm_topk_prob\": %s, \"initializer_range\": 0.2,\n"
    " \"tie_word_embeddings\": false}\n";

enum { E = 6, K = 2, LM = 2, NT = 44, NS = 4, NFULL = 48 };
static char cfg_norm[64], cfg_plain[64], glm_norm[64], glm_plain[64], threads_s[16];
static int64_t moe_layer[LM] = {0, 2}; /* the MoE layers of the config under test */

static flatmoe_session *open_s(const char *cfg, const char *chunk) {
    const char *argv[] = {"--config", cfg, "--seq-len", "16", "--micro-batch", "3", "--threads", threads_s,
                          "--ce-block-tokens", "16", "--ce-block-vocab", "24", "--seed", "13", "--lr", "1e-2",
                          "--warmup", "0", "--quiet", "--moe-chunk-tokens", chunk};
    flatmoe_session *s = NULL;
    const int rc = flatmoe_open(&s, (int)(sizeof argv / sizeof argv[0]), argv);
    CHECK_MSG(rc == FLATMOE_OK, "flatmoe_open: %s", flatmoe_last_error());
    if (s && s->r.m.cfg.router_sigmoid) { /* a fixed selection bias (the same in every session) */
        fm_model *m = &s->r.m;
        for (int li = 0; li < LM; li++) {
            fm_act *b = m->p.w.layers[moe_layer[li]].router_bias;
            FM_ASSERT(b);
            for (int e = 0; e < E; e++) b[e] = 0.05f * (float)((e * 7 + li * 3) % 5) - 0.1f;
            if (m->p.master && (void *)m->p.master != (void *)m->p.params)
                memcpy(m->p.master + (b - m->p.params), b, sizeof(float) * E);
        }
    }
    return s;
}

static int32_t tok[NFULL];
static int64_t lens[NS] = {16, 10, 6, 12};
static uint8_t mask[NFULL];
static float adv[NFULL], old[NFULL];

/* Sequences of 16, 10, 6 and 12 tokens (44: the third row padded), or with full, 16 in the last (48:
 * no padding). */
static void make_batch(flatmoe_batch *b, fm_rng *g, bool full) {
    memset(b, 0, sizeof *b);
    lens[3] = full ? 16 : 12;
    for (int64_t t = 0, i = 0; i < NS; i++)
        for (int64_t j = 0; j < lens[i]; j++, t++) {
            tok[t] = (int32_t)fm_rng_below(g, 100);
            mask[t] = j >= 2;
            adv[t] = (float)((double)fm_rng_below(g, 3000) / 1000.0 - 1.5);
        }
    b->n_tokens = full ? NFULL : NT;
    b->tokens = tok;
    b->n_seqs = NS;
    b->seq_lens = lens;
    b->loss_mask = mask;
    b->advantages = adv;
}

/* Random distinct routes [NT, LM, K]. */
static void random_routes(int32_t *r, fm_rng *g) {
    for (int64_t i = 0; i < NT * LM; i++) {
        r[i * K] = (int32_t)fm_rng_below(g, E);
        do r[i * K + 1] = (int32_t)fm_rng_below(g, E);
        while (r[i * K + 1] == r[i * K]);
    }
}

/* The routes taken against a plain selection over each MoE layer's saved probabilities; the info's
 * axes; a dense layer in the middle has no entry. (The softmax router: the sigmoid one's selection
 * is its op's, tested in tests/test_router_sigmoid.c.) */
static void test_routes_taken(fm_rng *g) {
    flatmoe_session *s = open_s(cfg_norm, "0");
    if (!s) return;
    flatmoe_info info;
    CHECK(flatmoe_get_info(s, &info) == FLATMOE_OK && info.num_moe_layers == LM && info.top_k == K &&
          info.num_layers == 3);
    CHECK(flatmoe_abi_version() == FLATMOE_ABI_VERSION);
    flatmoe_batch b;
    make_batch(&b, g, false);
    static float lp[NT], lp0[NT];
    static int32_t routes[NT * LM * K];
    memset(routes, 0xff, sizeof routes);
    CHECK(flatmoe_logprobs_ex(s, &b, lp, NULL, routes, 0, NULL, NULL) == FLATMOE_OK);
    CHECK(flatmoe_logprobs(s, &b, lp0, NULL) == FLATMOE_OK);
    CHECK_MSG(!memcmp(lp, lp0, sizeof lp), "flatmoe_logprobs_ex's log-probs differ from flatmoe_logprobs's");
    int bad = 0;
    for (int li = 0; li < LM; li++) {
        const float *probs = s->r.m.a.acts[moe_layer[li]].router.probs;
        for (int64_t t = 0; t < NT; t++) {
            const float *p = probs + s->pos_of[t] * E;
            int32_t want[K];
            for (int j = 0; j < K; j++) { /* the j-th largest, ties to the lower id */
                int best = -1;
                for (int e = 0; e < E; e++) {
                    bool taken = false;
                    for (int i = 0; i < j; i++) taken |= want[i] == e;
                    if (!taken && (best < 0 || p[e] > p[best])) best = e;
                }
                want[j] = best;
            }
            bad += memcmp(want, routes + (t * LM + li) * K, sizeof want) != 0;
        }
    }
    CHECK_MSG(bad == 0, "%d of %d token-layer routes differ from the top-%d of the router's probabilities", bad,
              NT * LM, K);
    flatmoe_close(s);
}

/* Replay of the router's own routes: the same bits, forward and two train steps. */
static void test_replay_own(fm_rng *g, const char *cfg) {
    flatmoe_session *a = open_s(cfg, "0"), *r = open_s(cfg, "0");
    if (!a || !r) return;
    flatmoe_batch b;
    make_batch(&b, g, false);
    static float lpa[NT], lpr[NT], ena[NT], enr[NT];
    static int32_t own[NT * LM * K], back[NT * LM * K];
    CHECK(flatmoe_logprobs_ex(a, &b, lpa, ena, own, 0, NULL, NULL) == FLATMOE_OK);
    flatmoe_batch br = b;
    br.routed_experts = own;
    CHECK(flatmoe_logprobs_ex(r, &br, lpr, enr, back, 0, NULL, NULL) == FLATMOE_OK);
    CHECK_MSG(!memcmp(lpa, lpr, sizeof lpa) && !memcmp(ena, enr, sizeof ena),
              "replay of the router's own routes changed the log-probs or entropies");
    CHECK(!memcmp(own, back, sizeof own));
    flatmoe_loss_spec sp = flatmoe_loss_spec_default();
    sp.loss = FLATMOE_LOSS_PG;
    sp.agg = FLATMOE_AGG_SEQ_MEAN_TOKEN_MEAN;
    for (int step = 1; step <= 2; step++) {
        CHECK(flatmoe_logprobs_ex(a, &b, lpa, NULL, own, 0, NULL, NULL) == FLATMOE_OK); /* the current router's routes */
        flatmoe_step_stats sa, sr;
        CHECK(flatmoe_train_step(a, &b, &sp, &sa) == FLATMOE_OK);
        CHECK(flatmoe_train_step(r, &br, &sp, &sr) == FLATMOE_OK);
        fm_step_ws_flush(&a->r.step, &a->r.m);
        fm_step_ws_flush(&r->r.step, &r->r.m);
        CHECK_MSG(sa.loss == sr.loss && sa.grad_norm == sr.grad_norm && sa.router_aux == sr.router_aux,
                  "step %d: loss %.17g / %.17g, grad norm %.17g / %.17g, aux %.17g / %.17g", step, sa.loss, sr.loss,
                  sa.grad_norm, sr.grad_norm, sa.router_aux, sr.router_aux);
        const bool same = !memcmp(a->r.m.p.params, r->r.m.p.params, sizeof(fm_act) * (size_t)a->r.m.p.n_params);
        CHECK_MSG(same, "step %d: the weights after a replay of the router's own routes differ from no replay", step);
    }
    flatmoe_close(a);
    flatmoe_close(r);
}

/* Replay of experts first, first+1 (mod E) for every token against the test hook's forced routing. */
static void test_replay_equals_forced(fm_rng *g, const char *cfg, bool bitwise) {
    flatmoe_session *f = open_s(cfg, "0"), *r = open_s(cfg, "0");
    if (!f || !r) return;
    const int64_t first = 4;
    f->r.m.router.force_route = true; /* what FLATMOE_TEST_FORCE_ROUTE=4 sets (fm_train_setup.c) */
    f->r.m.router.force_first = first;
    f->r.m.router.force_percent = 100;
    flatmoe_batch b;
    make_batch(&b, g, true); /* no padding: the hook forces every position, replay only the batch's tokens */
    static int32_t forced[NFULL * LM * K], taken[NFULL * LM * K];
    for (int64_t i = 0; i < NFULL * LM; i++)
        for (int j = 0; j < K; j++) forced[i * K + j] = (int32_t)((first + j) % E);
    flatmoe_batch br = b;
    br.routed_experts = forced;
    static float lpf[NFULL], lpr[NFULL], enf[NFULL], enr[NFULL];
    CHECK(flatmoe_logprobs_ex(f, &b, lpf, enf, taken, 0, NULL, NULL) == FLATMOE_OK);
    CHECK_MSG(!memcmp(taken, forced, sizeof forced), "the forced session's routes taken are not the forced routes");
    CHECK(flatmoe_logprobs(r, &br, lpr, enr) == FLATMOE_OK);
    double worst = 0;
    for (int64_t t = 0; t < NFULL; t++) worst = fmax(worst, fabs((double)lpf[t] - lpr[t]));
    if (bitwise) {
        CHECK_MSG(!memcmp(lpf, lpr, sizeof lpf) && !memcmp(enf, enr, sizeof enf),
                  "replay of the forced routes differs from forced routing (norm_topk_prob false): worst %.3g", worst);
        flatmoe_loss_spec sp = flatmoe_loss_spec_default();
        flatmoe_step_stats sf, sr;
        CHECK(flatmoe_train_step(f, &b, &sp, &sf) == FLATMOE_OK && flatmoe_train_step(r, &br, &sp, &sr) == FLATMOE_OK);
        fm_step_ws_flush(&f->r.step, &f->r.m);
        fm_step_ws_flush(&r->r.step, &r->r.m);
        CHECK_MSG(!memcmp(f->r.m.p.params, r->r.m.p.params, sizeof(fm_act) * (size_t)f->r.m.p.n_params),
                  "a train step under replay differs from one under forced routing");
    } else {
        /* norm_topk_prob: the hook divides by a double sum rounded once, replay (as router_fwd) by an
         * fp32 sum: each gate weight within 2 ulp (2 x 6e-8 relative) of the other. A relative gate
         * change d moves the MoE output by at most d |y|, and this micro model's log-probs move by
         * O(1) per unit of relative change of a layer's output (its gradients are O(1)), so the
         * log-probs agree to ~1e-6; 1e-5 absolute leaves a margin and fails a wrong weight (any other
         * normalization moves them by > 1e-2). */
        CHECK_MSG(worst <= 1e-5, "replay vs forced routing (norm_topk_prob true): log-probs differ by %.3g > 1e-5",
                  worst);
    }
    printf("replay == forced routing (%s, norm_topk_prob %s): worst log-prob difference %.3g\n",
           f->r.m.cfg.model_type_name, bitwise ? "false" : "true", worst);
    flatmoe_close(f);
    flatmoe_close(r);
}

/* The spec's loss at the session's weights, the batch's routes replayed. */
static double loss_at(flatmoe_session *s, const flatmoe_batch *b, const flatmoe_loss_spec *sp) {
    flatmoe_step_stats st;
    FM_ASSERT(fm_capi_pack(s, b, false) == FM_OK);
    fm_capi_call_begin(s, b, false, false); /* the forward's switches (replay with b's routes) */
    FM_ASSERT(fm_capi_forward(s, b) == FM_OK);
    fm_capi_call_end(s);
    FM_ASSERT(fm_pg_coefs(sp, b, b->n_tokens, s->logp, s->ent, s->in_loss, s->seq_of, s->seq_count, s->coef, &st) ==
              FM_OK);
    return st.loss;
}

/* The PG step's gradient under replay of other routes, against central differences; the router
 * weights (whose gradient reaches them only through the replayed gates) among the checked ones. */
static void test_replay_grad(fm_rng *g, const char *cfg) {
    flatmoe_session *s = open_s(cfg, "0");
    if (!s) return;
    /* the router's own losses off: the FD below differentiates the spec's loss alone */
    s->r.m.router.aux_loss_coef = 0;
    s->r.m.router.z_loss_coef = 0;
    flatmoe_batch b;
    make_batch(&b, g, false);
    static int32_t routes[NT * LM * K];
    random_routes(routes, g);
    b.routed_experts = routes;
    static float lp[NT];
    CHECK(flatmoe_logprobs(s, &b, lp, NULL) == FLATMOE_OK);
    for (int64_t t = 0; t < NT; t++) /* ratios in [0.905, 1.105]: inside the clip range, away from its edges */
        old[t] = lp[t] - (float)((double)fm_rng_below(g, 2001) / 10000.0 - 0.1);
    b.old_logprobs = old;
    flatmoe_loss_spec sp = flatmoe_loss_spec_default();
    sp.loss = FLATMOE_LOSS_PG;
    sp.agg = FLATMOE_AGG_TOKEN_MEAN;
    flatmoe_step_stats st;
    CHECK(fm_capi_grads(s, &b, &sp, &st) == FM_OK);
    fm_model *m = &s->r.m;
    const int64_t P = m->p.n_params;
    float *gr = malloc(sizeof(float) * (size_t)P);
    memcpy(gr, m->p.grads, sizeof(float) * (size_t)P);
    float *w = (float *)m->p.params;
    double gmax = 0;
    for (int64_t i = 0; i < P; i++) gmax = fmax(gmax, fabs(gr[i]));
    /* 6 largest router-weight gradients of each MoE layer, and 8 drawn among all above 1% of the largest */
    int64_t pick[20];
    int np = 0;
    for (int li = 0; li < LM; li++) {
        const int64_t off = (float *)m->p.w.layers[moe_layer[li]].router - w, n = E * m->cfg.hidden_size;
        for (int q = 0; q < 6; q++) {
            int64_t best = -1;
            for (int64_t i = off; i < off + n; i++) {
                bool taken = false;
                for (int z = 0; z < np; z++) taken |= pick[z] == i;
                if (!taken && (best < 0 || fabs(gr[i]) > fabs(gr[best]))) best = i;
            }
            pick[np++] = best;
        }
    }
    while (np < 20) {
        const int64_t i = (int64_t)fm_rng_below(g, (uint64_t)P);
        if (fabs(gr[i]) >= 0.01 * gmax) pick[np++] = i;
    }
    int bad = 0;
    double worst = 0, router_max = 0;
    for (int q = 0; q < np; q++) {
        const int64_t i = pick[q];
        const float x = w[i], h = 1e-3f;
        w[i] = x + h;
        const double up = loss_at(s, &b, &sp);
        w[i] = x - h;
        const double dn = loss_at(s, &b, &sp);
        w[i] = x;
        const double fd = (up - dn) / (double)(2 * h);
        if (q < 12) router_max = fmax(router_max, fabs(gr[i]));
        /* test_capi_pg.c's tolerance (central differences in fp32 weights): 2% of the gradient plus
         * 1e-3 of the largest; the routes are fixed, so the loss is smooth in every weight */
        const double tol = 0.02 * fabs(gr[i]) + 1e-3 * gmax, d = fabs(fd - gr[i]);
        worst = fmax(worst, d / tol);
        if (d > tol) {
            bad++;
            fprintf(stderr, "param %lld: gradient %.6g, finite difference %.6g\n", (long long)i, gr[i], fd);
        }
    }
    CHECK_MSG(bad == 0, "%d of %d gradients under replay off their finite differences", bad, np);
    CHECK_MSG(router_max > 0.01 * gmax, "the router weights' gradient under replay is %.3g (largest %.3g): the gates "
              "do not reach the router", router_max, gmax);
    printf("replay PG gradient vs finite differences (%s): %d weights (12 router), worst %.3g of the tolerance\n",
           m->cfg.model_type_name, np, worst);
    free(gr);
    flatmoe_close(s);
}

/* The sequence-wise balance loss of glm4_moe's router (--moe-seq-aux-loss-coeff; fm_router.h
 * seq_aux_coef) through the whole model, on the session's packed batch (segments = its documents,
 * padding included): the reported aux loss against a plain recompute from each MoE layer's saved
 * scores and routes (alpha x the mean over MoE layers of the mean over documents of
 * sum_i f_i P_i), and its gradient in the weights (the gradient with alpha minus the one without)
 * against central differences of that loss, the routes replayed so the selection stays fixed. */
static double seq_aux_recompute(const flatmoe_session *s, double alpha) {
    const fm_model *m = &s->r.m;
    const int64_t B = s->B, T = s->T;
    const int32_t *doc = s->fb.doc_start;
    double layers = 0;
    for (int li = 0; li < LM; li++) {
        const float *sc = m->a.acts[moe_layer[li]].router.probs;
        const int32_t *idx = m->a.acts[moe_layer[li]].router.topk_idx;
        double sum = 0;
        int64_t nseg = 0;
        for (int64_t r = 0; r < B; r++)
            for (int64_t t = 0; t < T;) {
                int64_t u = t + 1;
                while (u < T && doc[r * T + u] == doc[r * T + t]) u++;
                const double Ts = (double)(u - t);
                for (int e = 0; e < E; e++) {
                    double c = 0, P = 0;
                    for (int64_t n = r * T + t; n < r * T + u; n++) {
                        double z = 1e-20;
                        for (int j = 0; j < E; j++) z += sc[n * E + j];
                        P += sc[n * E + e] / z;
                        for (int j = 0; j < K; j++) c += idx[n * K + j] == e;
                    }
                    sum += (E * c / (K * Ts)) * (P / Ts);
                }
                nseg++;
                t = u;
            }
        layers += sum / (double)nseg;
    }
    return alpha * layers / LM;
}

static double seq_aux_at(flatmoe_session *s, const flatmoe_batch *b) {
    FM_ASSERT(fm_capi_pack(s, b, false) == FM_OK);
    fm_capi_call_begin(s, b, false, false); /* the forward's switches (replay with b's routes) */
    FM_ASSERT(fm_capi_forward(s, b) == FM_OK);
    fm_capi_call_end(s);
    fm_loss l;
    fm_model_loss_from_results(&s->r.m, s->r.m.a.results, 1, &l);
    return l.aux;
}

static void test_seq_aux(fm_rng *g) {
    flatmoe_session *s = open_s(glm_norm, "0");
    if (!s) return;
    const double alpha = 0.5;
    flatmoe_batch b;
    make_batch(&b, g, false);
    static int32_t routes[NT * LM * K];
    random_routes(routes, g);
    b.routed_experts = routes;
    flatmoe_loss_spec sp = flatmoe_loss_spec_default();
    sp.loss = FLATMOE_LOSS_PG;
    fm_model *m = &s->r.m;
    const int64_t P = m->p.n_params;
    float *g0 = malloc(sizeof(float) * (size_t)P), *g1 = malloc(sizeof(float) * (size_t)P);
    flatmoe_step_stats st;
    m->router.seq_aux_coef = 0;
    CHECK(fm_capi_grads(s, &b, &sp, &st) == FM_OK);
    CHECK_MSG(st.router_aux == 0, "alpha 0: aux loss %.3g", st.router_aux);
    memcpy(g0, m->p.grads, sizeof(float) * (size_t)P);
    m->router.seq_aux_coef = alpha;
    CHECK(fm_capi_grads(s, &b, &sp, &st) == FM_OK);
    memcpy(g1, m->p.grads, sizeof(float) * (size_t)P);
    const double want = seq_aux_recompute(s, alpha);
    CHECK_MSG(st.router_aux > 0 && fabs(st.router_aux - want) <= 1e-9 * want,
              "sequence-wise aux loss %.17g, recomputed %.17g", st.router_aux, want);
    /* the 12 largest gradient differences among the router weights of both MoE layers */
    float *w = (float *)m->p.params;
    int64_t pick[12];
    double dmax = 0;
    for (int q = 0; q < 12; q++) {
        int64_t best = -1;
        for (int li = 0; li < LM; li++) {
            const int64_t off = (float *)m->p.w.layers[moe_layer[li]].router - w, n = E * m->cfg.hidden_size;
            for (int64_t i = off; i < off + n; i++) {
                bool taken = false;
                for (int z = 0; z < q; z++) taken |= pick[z] == i;
                if (!taken && (best < 0 || fabs(g1[i] - g0[i]) > fabs(g1[best] - g0[best]))) best = i;
            }
        }
        pick[q] = best;
        dmax = fmax(dmax, fabs(g1[best] - g0[best]));
    }
    int bad = 0;
    double worst = 0;
    for (int q = 0; q < 12; q++) {
        const int64_t i = pick[q];
        const float x = w[i], h = 1e-2f;
        w[i] = x + h;
        const double up = seq_aux_at(s, &b);
        w[i] = x - h;
        const double dn = seq_aux_at(s, &b);
        w[i] = x;
        const double fd = (up - dn) / (double)(2 * h), gr = (double)g1[i] - (double)g0[i];
        /* the difference of two fp32 gradients (O(1)) carries ~1e-7 of rounding, the central
         * difference at h 1e-2 an O(h^2) error of ~1e-7 here (the loss is smooth with the routes
         * fixed; measured worst 1e-6 absolute): 0.1% + 1e-3 of the largest difference */
        const double tol = 1e-3 * fabs(gr) + 1e-3 * dmax, d = fabs(fd - gr);
        worst = fmax(worst, d / tol);
        if (d > tol) {
            bad++;
            fprintf(stderr, "router weight %lld: aux gradient %.6g, finite difference %.6g\n", (long long)i, gr, fd);
        }
    }
    CHECK_MSG(bad == 0, "%d of 12 sequence-wise aux gradients off their finite differences", bad);
    CHECK_MSG(dmax > 1e-4, "the sequence-wise loss's gradient on the router is %.3g", dmax);
    printf("sequence-wise aux loss (glm4_moe, alpha %g): %.6g (recomputed %.6g); gradient vs finite differences: "
           "worst %.3g of the tolerance, largest %.3g\n", alpha, st.router_aux, want, worst, dmax);
    free(g0), free(g1);
    flatmoe_close(s);
}

static void test_refusals(fm_rng *g) {
    flatmoe_session *s = open_s(cfg_norm, "0");
    if (!s) return;
    flatmoe_batch b;
    make_batch(&b, g, false);
    static int32_t routes[NT * LM * K];
    static float lp[NT];
    random_routes(routes, g);
    b.routed_experts = routes;
    routes[(5 * LM + 1) * K + 1] = E; /* token 5, MoE layer 1, slot 1 */
    CHECK(flatmoe_logprobs(s, &b, lp, NULL) == FLATMOE_ERR_ARG);
    CHECK_MSG(strstr(flatmoe_last_error(), "token 5, MoE layer 1, slot 1] is 6") != NULL, "%s", flatmoe_last_error());
    routes[(5 * LM + 1) * K + 1] = -3;
    CHECK(flatmoe_logprobs(s, &b, lp, NULL) == FLATMOE_ERR_ARG);
    CHECK_MSG(strstr(flatmoe_last_error(), "is -3") != NULL, "%s", flatmoe_last_error());
    routes[(5 * LM + 1) * K + 1] = routes[(5 * LM + 1) * K]; /* a duplicate */
    flatmoe_step_stats st;
    const flatmoe_loss_spec sp = flatmoe_loss_spec_default();
    CHECK(flatmoe_train_step(s, &b, &sp, &st) == FLATMOE_ERR_ARG);
    char want[96];
    snprintf(want, sizeof want, "token 5, MoE layer 1] holds expert %d twice", routes[(5 * LM + 1) * K]);
    CHECK_MSG(strstr(flatmoe_last_error(), want) != NULL, "%s", flatmoe_last_error());
    CHECK(s->ts.step == 0); /* refused before any update */
    flatmoe_close(s);
}

/* Every token to experts 0 and 1 (the most skewed routing there is), chunked dispatch: the expert
 * live set's painted high-water mark within its bound, A/B against the router's own routes. */
static void test_adversarial_bound(fm_rng *g) {
    for (int adv_routes = 0; adv_routes <= 1; adv_routes++) {
        flatmoe_session *s = open_s(cfg_norm, "8");
        if (!s) return;
        flatmoe_batch b;
        make_batch(&b, g, false);
        static int32_t routes[NT * LM * K];
        for (int64_t i = 0; i < NT * LM; i++) routes[i * K] = 0, routes[i * K + 1] = 1;
        if (adv_routes) b.routed_experts = routes;
        fm_arena *ex = &s->r.m.a.arena[FM_LIVE_EXPERT];
        fm_arena_paint(ex);
        const flatmoe_loss_spec sp = flatmoe_loss_spec_default();
        flatmoe_step_stats st;
        CHECK(flatmoe_train_step(s, &b, &sp, &st) == FLATMOE_OK);
        static int32_t taken[NT * LM * K];
        static float lp[NT];
        CHECK(flatmoe_logprobs_ex(s, &b, lp, NULL, taken, 0, NULL, NULL) == FLATMOE_OK);
        const size_t hw = fm_arena_touched(ex), cap = ex->capacity, plan = s->r.plan.bytes[FM_LIVE_EXPERT];
        CHECK_MSG(hw > 0 && hw <= cap && cap <= plan, "%s routes: expert dispatch high-water %zu, arena %zu, plan %zu",
                  adv_routes ? "adversarial replayed" : "the router's", hw, cap, plan);
        printf("expert dispatch under %s routes: high-water %zu of the planned %zu bytes\n",
               adv_routes ? "adversarial replayed (all to experts 0, 1)" : "the router's own", hw, plan);
        flatmoe_close(s);
    }
}

static bool write_cfg(char *path, size_t cap, const char *tag, const char *fmt, const char *norm) {
    snprintf(path, cap, "/tmp/flatmoe-capi-replay-%s-%d.json", tag, (int)getpid());
    FILE *f = fopen(path, "w");
    return f && fprintf(f, fmt, norm) > 0 && fclose(f) == 0;
}

int main(void) {
    const unsigned long long seed = fm_test_seed(2931);
    snprintf(threads_s, sizeof threads_s, "%d", fm_test_threads(2));
    if (!write_cfg(cfg_norm, sizeof cfg_norm, "norm", CFG_FMT, "true") ||
        !write_cfg(cfg_plain, sizeof cfg_plain, "plain", CFG_FMT, "false") ||
        !write_cfg(glm_norm, sizeof glm_norm, "glmnorm", CFG_GLM_FMT, "true") ||
        !write_cfg(glm_plain, sizeof glm_plain, "glmplain", CFG_GLM_FMT, "false")) {
        fprintf(stderr, "cannot write the configs in /tmp\n");
        return 1;
    }
    fm_rng g;
    fm_rng_seed(&g, seed);
    test_routes_taken(&g);
    test_replay_own(&g, cfg_norm);
    test_replay_equals_forced(&g, cfg_plain, true);
    test_replay_equals_forced(&g, cfg_norm, false);
    test_replay_grad(&g, cfg_norm);
    test_refusals(&g);
    test_adversarial_bound(&g);
    moe_layer[0] = 1; /* glm4_moe's sigmoid router: layer 0 dense */
    test_replay_own(&g, glm_norm);
    test_replay_equals_forced(&g, glm_plain, true);
    test_replay_equals_forced(&g, glm_norm, false);
    test_replay_grad(&g, glm_norm);
    test_seq_aux(&g);
    unlink(cfg_norm);
    unlink(cfg_plain);
    unlink(glm_norm);
    unlink(glm_plain);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed != 0;
}
