/* Dense layers among MoE layers (qwen3_moe's decoder_sparse_step / mlp_only_layers;
 * model/fm_dense_mlp.h, model/fm_config.h):
 *   - the config decides which layers are MoE as transformers' Qwen3MoeDecoderLayer does;
 *   - the dense SwiGLU MLP against a plain fp64 twin, forward and every gradient;
 *   - the parameter table (Hugging Face names, no router in a dense layer) and the parameter count
 *     of a real config against the count written out from transformers' module shapes;
 *   - recompute bit-identical to none, the chunked MoE against the plain twin, with dense layers;
 *   - every live set's arena equal to its bound formula and filled by a step (painted high-water).
 * The whole model's gradient by finite differences with dense layers is test_model's. */
#include <math.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "model/fm_dense_mlp.h"
#include "model/fm_model.h"
#include "schedule/fm_schedule.h"

static fm_backend g_be;

static void test_layer_rule(void) {
    fm_config c;
    /* (i + 1) % step == 0 and i not in mlp_only_layers; entries past the last layer are ignored */
    CHECK(fm_config_parse(&c, "{\"model_type\":\"qwen3_moe\",\"num_hidden_layers\":6,\"decoder_sparse_step\":2,"
                          "\"mlp_only_layers\":[3,9]}", "rule.json") == FM_OK);
    const bool want[6] = {false, true, false, false, false, true};
    for (int l = 0; l < 6; l++) CHECK_MSG(fm_config_layer_is_moe(&c, l) == want[l], "layer %d", l);
    CHECK(fm_config_num_moe_layers(&c) == 2);
    CHECK(c.dense_intermediate_size == 6144); /* Qwen3MoeConfig's intermediate_size */
    /* refused: no MoE layer left; the fields outside qwen3_moe; a bad step or entry */
    CHECK(fm_config_parse(&c, "{\"model_type\":\"qwen3_moe\",\"num_hidden_layers\":2,\"mlp_only_layers\":[0,1]}",
                          "none.json") == FM_ERR_CONFIG && strstr(fm_errmsg(), "no layer is an MoE layer"));
    CHECK(fm_config_parse(&c, "{\"model_type\":\"olmoe\",\"mlp_only_layers\":[0]}", "o.json") == FM_ERR_UNSUPPORTED &&
          strstr(fm_errmsg(), "only qwen3_moe reads"));
    CHECK(fm_config_parse(&c, "{\"model_type\":\"mixtral\",\"decoder_sparse_step\":2}", "m.json") == FM_ERR_UNSUPPORTED);
    CHECK(fm_config_parse(&c, "{\"model_type\":\"qwen3_moe\",\"decoder_sparse_step\":0}", "z.json") == FM_ERR_CONFIG &&
          strstr(fm_errmsg(), "decoder_sparse_step"));
    CHECK(fm_config_parse(&c, "{\"model_type\":\"qwen3_moe\",\"mlp_only_layers\":[-1]}", "n.json") == FM_ERR_CONFIG &&
          strstr(fm_errmsg(), "mlp_only_layers"));
    CHECK(fm_config_parse(&c, "{\"model_type\":\"qwen3_moe\",\"mlp_only_layers\":[0],\"intermediate_size\":0}",
                          "i.json") == FM_ERR_CONFIG && strstr(fm_errmsg(), "\"intermediate_size\" must be positive"));
    /* to_json keeps them: the canonical text parses back to the same layers */
    CHECK(fm_config_parse(&c, "{\"model_type\":\"qwen3_moe\",\"num_hidden_layers\":6,\"decoder_sparse_step\":2,"
                          "\"mlp_only_layers\":[3],\"intermediate_size\":100}", "rt.json") == FM_OK);
    char *j = fm_config_to_json(&c);
    fm_config back;
    CHECK(j && fm_config_parse(&back, j, "back") == FM_OK);
    for (int l = 0; l < 6; l++) CHECK(fm_config_layer_is_moe(&back, l) == want[l]);
    CHECK(back.dense_intermediate_size == 100);
    fm_free(j);
}

/* ---- the dense MLP against a plain fp64 twin ---------------------------------------------- */

static double silu(double g) { return g / (1.0 + exp(-g)); }

/* Relative error ||a - b|| / ||b||. */
static double rel(const float *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static void fill(fm_rng *r, float *x, int64_t n, double s) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(s * fm_rng_normal(r));
}

static void test_mlp_plain_twin(void) {
    const int64_t N = 13, H = 24, Id = 40;
    fm_rng r;
    fm_rng_seed(&r, fm_test_seed(5));
    float *x = fm_malloc(sizeof(float) * (size_t)(N * H)), *dy = fm_malloc(sizeof(float) * (size_t)(N * H));
    float *wg = fm_malloc(sizeof(float) * (size_t)(Id * H)), *wu = fm_malloc(sizeof(float) * (size_t)(Id * H));
    float *wd = fm_malloc(sizeof(float) * (size_t)(H * Id)), *y = fm_malloc(sizeof(float) * (size_t)(N * H));
    float *dx = fm_malloc(sizeof(float) * (size_t)(N * H));
    float *gg = fm_malloc(sizeof(float) * (size_t)(Id * H)), *gu = fm_malloc(sizeof(float) * (size_t)(Id * H));
    float *gd = fm_malloc(sizeof(float) * (size_t)(H * Id));
    float *buf = fm_malloc(sizeof(float) * (size_t)(FM_DENSE_MLP_WS_BUFFERS * N * Id));
    fm_dense_mlp_ws ws = {buf, buf + N * Id, buf + 2 * N * Id, buf + 3 * N * Id, buf + 4 * N * Id};
    fill(&r, x, N * H, 1.0);
    fill(&r, dy, N * H, 1.0);
    fill(&r, wg, Id * H, 0.3);
    fill(&r, wu, Id * H, 0.3);
    fill(&r, wd, H * Id, 0.3);
    for (int64_t i = 0; i < Id * H; i++) gg[i] = gu[i] = gd[i] = 0.5f; /* accumulated into */
    fm_dense_mlp_forward(&g_be, y, x, wg, wu, wd, N, H, Id, &ws);
    fm_dense_mlp_backward(&g_be, dx, gg, gu, gd, dy, x, wg, wu, wd, N, H, Id, &ws);
    /* the twin: the same arithmetic written out per element in double */
    double *ry = calloc((size_t)(N * H), sizeof(double)), *rdx = calloc((size_t)(N * H), sizeof(double));
    double *rgg = calloc((size_t)(Id * H), sizeof(double)), *rgu = calloc((size_t)(Id * H), sizeof(double));
    double *rgd = calloc((size_t)(H * Id), sizeof(double));
    for (int64_t i = 0; i < Id * H; i++) rgg[i] = rgu[i] = rgd[i] = 0.5;
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < Id; j++) {
            double g = 0, u = 0, dh = 0;
            for (int64_t h = 0; h < H; h++) {
                g += (double)x[n * H + h] * wg[j * H + h];
                u += (double)x[n * H + h] * wu[j * H + h];
            }
            const double hval = silu(g) * u, s = 1.0 / (1.0 + exp(-g));
            for (int64_t h = 0; h < H; h++) {
                ry[n * H + h] += hval * wd[h * Id + j];
                dh += (double)dy[n * H + h] * wd[h * Id + j];
                rgd[h * Id + j] += (double)dy[n * H + h] * hval;
            }
            const double dg = dh * u * s * (1.0 + g * (1.0 - s)), du = dh * silu(g);
            for (int64_t h = 0; h < H; h++) {
                rdx[n * H + h] += dg * wg[j * H + h] + du * wu[j * H + h];
                rgg[j * H + h] += dg * x[n * H + h];
                rgu[j * H + h] += du * x[n * H + h];
            }
        }
    /* fp32 GEMMs over at most max(H, Id, N) = 40 terms: each sum within 40 u |terms| (u = 2^-24),
     * and the SwiGLU's few fp32 ops on top; 1e-5 relative is ~40x that, far below any wrong term */
    const double tol = 1e-5;
    const double ey = rel(y, ry, N * H), edx = rel(dx, rdx, N * H), eg = rel(gg, rgg, Id * H), eu = rel(gu, rgu, Id * H),
                 ed = rel(gd, rgd, H * Id);
    printf("dense MLP vs fp64 twin: y %.2e, dx %.2e, d gate %.2e, d up %.2e, d down %.2e\n", ey, edx, eg, eu, ed);
    CHECK(ey < tol && edx < tol && eg < tol && eu < tol && ed < tol);
    free(ry); free(rdx); free(rgg); free(rgu); free(rgd);
    fm_free(x); fm_free(dy); fm_free(wg); fm_free(wu); fm_free(wd); fm_free(y); fm_free(dx);
    fm_free(gg); fm_free(gu); fm_free(gd); fm_free(buf);
}

/* ---- the parameter table and a real config's count ---------------------------------------- */

static void test_params(void) {
    fm_config c = fm_test_small_config(FM_MODEL_QWEN3_MOE, 4, false, 2);
    fm_test_dense_layers(&c, 20);
    fm_model_params p;
    CHECK(fm_params_create(&p, &c, 1, 0) == FM_OK);
    CHECK(fm_params_find(&p, "model.layers.0.mlp.gate_proj.weight") && fm_params_find(&p, "model.layers.2.mlp.down_proj.weight"));
    CHECK(!fm_params_find(&p, "model.layers.0.mlp.gate.weight") && !fm_params_find(&p, "model.layers.0.mlp.experts.0.up_proj.weight"));
    CHECK(fm_params_find(&p, "model.layers.1.mlp.gate.weight") && !fm_params_find(&p, "model.layers.1.mlp.gate_proj.weight"));
    const fm_param *d = fm_params_find(&p, "model.layers.2.mlp.down_proj.weight");
    CHECK(d && d->shape[0] == 24 && d->shape[1] == 20);
    CHECK(p.n_params == fm_config_num_params(&c));
    fm_params_free(&p);
    /* --ep 5: every rank's table holds its expert of the MoE layers and the whole dense layers;
     * the initial weights are the one-rank model's */
    fm_model_params full, part;
    CHECK(fm_params_create(&full, &c, 1, 0) == FM_OK && fm_params_create(&part, &c, 5, 3) == FM_OK);
    CHECK(part.n_params == fm_params_ep_num_params(&c, 5));
    float *wf = fm_malloc(sizeof(float) * (size_t)full.n_params), *wp = fm_malloc(sizeof(float) * (size_t)part.n_params);
    fm_params_init_weights_host(&full, 9, wf);
    fm_params_init_weights_host(&part, 9, wp);
    int same = 0;
    for (int i = 0; i < part.n_tensors; i++) {
        const fm_param *q = &part.table[i], *f = fm_params_find(&full, q->name);
        same += f && f->numel == q->numel && !memcmp(wf + f->offset, wp + q->offset, sizeof(float) * (size_t)q->numel);
    }
    CHECK_MSG(same == part.n_tensors, "--ep 5 rank 3: %d of %d tensors drew the one-rank model's weights", same, part.n_tensors);
    fm_free(wf);
    fm_free(wp);
    fm_params_free(&full);
    fm_params_free(&part);

    /* Qwen3-30B-A3B with dense layers 0, 2, 4, ... (decoder_sparse_step 2,
     * mlp_only_layers [0]): the count of transformers' Qwen3MoeForCausalLM modules, written out
     * from their shapes: embed_tokens V H, lm_head V H, norm H; per layer q_proj (nh hd) H,
     * k_proj, v_proj (nkv hd) H, o_proj H (nh hd), q_norm, k_norm hd, two layer norms H; an MoE
     * layer's gate E H and experts E 3 H I; a dense layer's Qwen3MoeMLP 3 H intermediate_size */
    fm_config q;
    CHECK(fm_config_load(&q, "configs/qwen3-30b-a3b.json") == FM_OK);
    q.decoder_sparse_step = 2;
    q.mlp_only_mask[0] = 1;
    const int64_t V = 151936, H = 2048, L = 48, nh = 32, nkv = 4, hd = 128, E = 128, I = 768, Id = 6144;
    CHECK(q.vocab_size == V && q.hidden_size == H && q.num_hidden_layers == L && q.dense_intermediate_size == Id);
    const int64_t attn = nh * hd * H + 2 * nkv * hd * H + H * nh * hd + 2 * hd + 2 * H;
    const int64_t n_moe = 24; /* layers 1, 3, ..., 47 */
    const int64_t want = 2 * V * H + H + L * attn + n_moe * (E * H + E * 3 * H * I) + (L - n_moe) * 3 * H * Id;
    CHECK_MSG(fm_config_num_params(&q) == want, "dense Qwen3-30B-A3B: %lld parameters, transformers' modules %lld",
              (long long)fm_config_num_params(&q), (long long)want);
    const int64_t active = V * H + H + L * attn + n_moe * (E * H + 8 * 3 * H * I) + (L - n_moe) * 3 * H * Id;
    CHECK(fm_config_num_active_params(&q) == active);
}

/* ---- a step with dense layers: recompute, chunked MoE, the bounds ------------------------- */

static void step(const fm_config *cfg, const bool *rc, int64_t chunk, float **grads, double *loss) {
    fm_model m;
    CHECK(fm_test_model_create(&m, cfg, g_be) == FM_OK);
    fm_layout_opts lo = {rc, chunk, 0, 0};
    CHECK(fm_model_layout(&m, 2, 9, &lo) == FM_OK);
    fm_model_init_weights(&m, 11);
    fm_test_fill_batch(&m, 12, 3);
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    fm_loss l;
    CHECK(fm_schedule_default_forward(&m, fm_test_batch_of(&m), &l) == FM_OK);
    CHECK(fm_schedule_default_backward(&m, 1.0f) == FM_OK);
    *loss = l.ce + l.aux + l.z;
    *grads = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
    memcpy(*grads, m.p.grads, sizeof(float) * (size_t)m.p.n_params);
    /* every arena holds its bound formula's bytes, and the step wrote all of it */
    const int64_t N = 18;
    int64_t sm, sd;
    fm_model_saved_sets(cfg, rc, &sm, &sd);
    const size_t a = sizeof(fm_act);
    const fm_moe_dims md = {cfg->hidden_size, cfg->moe_intermediate_size, cfg->num_experts, cfg->num_experts_per_tok};
    int64_t K, ce;
    fm_moe_chunks(N, chunk, &K, &ce);
    size_t want[FM_LIVE_COUNT];
    want[FM_LIVE_BOUNDARIES] = fm_model_boundary_bytes_chunked(cfg, 2, 9, chunk > 0, a);
    want[FM_LIVE_LAYER_ACTS] = (size_t)sm * fm_model_layer_acts_bytes(cfg, 2, 9, a) +
                               (size_t)sd * fm_model_dense_layer_acts_bytes(cfg, 2, 9, a);
    want[FM_LIVE_EXPERT] = chunk > 0 ? fm_moe_ws_bytes(&md, ce, true, a)
                                     : (size_t)sm * fm_moe_routes_bytes(&md, N, a) + fm_moe_ws_bytes(&md, N, false, a);
    want[FM_LIVE_WORKING_SET] = fm_model_working_set_bytes(cfg, N, a);
    want[FM_LIVE_VOCAB] = fm_model_vocab_plain_bytes(cfg, N, a);
    for (int i = 1; i < FM_LIVE_COUNT; i++) {
        const size_t hw = fm_arena_touched(&m.a.arena[i]), cap = m.a.arena[i].capacity;
        CHECK_MSG(cap == fm_arena_round(want[i]), "%s: arena %zu, formula %zu", fm_live_set_names[i], cap, want[i]);
        CHECK_MSG(hw <= cap && hw + 64 >= cap, "%s: the step wrote %zu of its %zu bytes", fm_live_set_names[i], hw, cap);
    }
    fm_test_model_free(&m);
}

static void test_step(void) {
    fm_config c = fm_test_small_config(FM_MODEL_QWEN3_MOE, 4, false, 2);
    fm_test_dense_layers(&c, 20);
    const int64_t P = fm_config_num_params(&c);
    float *ref, *g;
    double ref_loss, loss;
    step(&c, NULL, 0, &ref, &ref_loss);
    /* recompute: every layer, the dense ones only (a dense-shaped shared set), an MoE one */
    const bool rcs[3][4] = {{1, 1, 1, 1}, {1, 0, 1, 0}, {0, 1, 0, 0}};
    for (int i = 0; i < 3; i++) {
        step(&c, rcs[i], 0, &g, &loss);
        CHECK_MSG(loss == ref_loss && !memcmp(g, ref, sizeof(float) * (size_t)P), "recompute %d: not bit-identical", i);
        fm_free(g);
    }
    /* the chunked MoE against the plain twin (as test_model's: 1e-6 relative, reassociation) */
    step(&c, NULL, 5, &g, &loss);
    double num = 0, den = 0;
    for (int64_t i = 0; i < P; i++) {
        num += ((double)g[i] - ref[i]) * ((double)g[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    CHECK_CLOSE(loss, ref_loss, 1e-6);
    CHECK_MSG(sqrt(num / den) < 1e-6, "chunked: gradients differ by %g", sqrt(num / den));
    fm_free(g);
    /* the dense layers' weights got gradients, and the router losses average the MoE layers */
    fm_model_params p;
    CHECK(fm_params_create(&p, &c, 1, 0) == FM_OK);
    const fm_param *dg = fm_params_find(&p, "model.layers.2.mlp.gate_proj.weight");
    double s = 0;
    for (int64_t i = 0; dg && i < dg->numel; i++) s += fabs(ref[dg->offset + i]);
    CHECK(s > 0);
    fm_params_free(&p);
    fm_free(ref);
}

int main(void) {
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    test_layer_rule();
    test_mlp_plain_twin();
    test_params();
    test_step();
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
