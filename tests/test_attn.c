/* The attention parts of issue 26 (model/fm_config.h, model/fm_rope.h, model/fm_layer.c):
 *   - config.json: attention_bias (q/k/v/o biases for qwen3_moe and olmoe, refused for mixtral),
 *     rope_scaling / rope_parameters (yarn, linear; the others refused naming the supported ones),
 *     partial_rotary_factor (refused where transformers rotates the whole head), canonical text
 *     round trip, the parameter count;
 *   - YaRN's inverse frequencies and attention factor against golden values from transformers'
 *     formulas in fp64 (tools/rope_golden.py), the cos/sin tables against them, the default tables
 *     bit for bit the formula flatmoe used before;
 *   - the parameter table: bias names, shapes, no decay, zero init, --ep ranks drawing the one-rank
 *     model's weights;
 *   - the whole model's gradient by finite differences with non-zero biases (every model_type, and
 *     partial rotary + YaRN), and layer 0's attention input against a plain fp64 RoPE of its
 *     projections (partial rotary with YaRN tables, positions t). */
#include <math.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "model/fm_model.h"
#include "model/fm_rope.h"
#include "schedule/fm_schedule.h"

static fm_backend g_be;

/* ---- config.json ------------------------------------------------------------------------------ */

static void parse_ok(fm_config *c, const char *json) {
    const fm_status s = fm_config_parse(c, json, "attn.json");
    CHECK_MSG(s == FM_OK, "%s: %s", json, s ? fm_errmsg() : "");
}

static void parse_bad(const char *json, fm_status want, const char *needle) {
    fm_config c;
    const fm_status s = fm_config_parse(&c, json, "attn.json");
    CHECK_MSG(s == want && strstr(fm_errmsg(), needle), "%s: status %d, message '%s' (wanted '%s')", json, (int)s,
              s ? fm_errmsg() : "", needle);
}

/* The canonical text parses back to the same canonical text. */
static void round_trip(const fm_config *c) {
    char *a = fm_config_to_json(c);
    fm_config back;
    CHECK(a && fm_config_parse(&back, a, "canonical") == FM_OK);
    char *b = fm_config_to_json(&back);
    CHECK_MSG(a && b && !strcmp(a, b), "canonical round trip:\n%s\nvs\n%s", a, b);
    CHECK(back.attention_bias == c->attention_bias && back.attention_o_bias == c->attention_o_bias &&
          back.rope_scaling.type == c->rope_scaling.type && back.rope_scaling.factor == c->rope_scaling.factor &&
          back.rope_scaling.original_max_position_embeddings == c->rope_scaling.original_max_position_embeddings);
    fm_free(a);
    fm_free(b);
}

static void test_config(void) {
    fm_config c;
    parse_ok(&c, "{\"model_type\":\"olmoe\"}"); /* transformers' defaults: no biases, default RoPE */
    CHECK(!c.attention_bias && !c.attention_o_bias && c.rope_scaling.type == FM_ROPE_DEFAULT &&
          c.partial_rotary_factor == 1.0 && fm_config_rotary_dim(&c) == c.head_dim);
    const int64_t plain = fm_config_num_params(&c);
    parse_ok(&c, "{\"model_type\":\"olmoe\",\"attention_bias\":true}");
    CHECK(c.attention_bias && c.attention_o_bias); /* OlmoeAttention: q, k, v, o with the one flag */
    const int64_t H = c.hidden_size, qd = c.num_attention_heads * c.head_dim, kd = c.num_key_value_heads * c.head_dim;
    CHECK(fm_config_num_params(&c) == plain + c.num_hidden_layers * (qd + 2 * kd + H));
    round_trip(&c);
    parse_ok(&c, "{\"model_type\":\"qwen3_moe\",\"attention_bias\":true,\"num_hidden_layers\":2}");
    CHECK(c.attention_bias && c.attention_o_bias); /* Qwen3MoeAttention: the same */
    round_trip(&c);
    parse_ok(&c, "{\"model_type\":\"mixtral\",\"attention_bias\":false}");
    parse_bad("{\"model_type\":\"mixtral\",\"attention_bias\":true}", FM_ERR_UNSUPPORTED, "Mixtral attention has no biases");
    parse_bad("{\"model_type\":\"qwen3_moe\",\"attention_bias\":1}", FM_ERR_FORMAT, "\"attention_bias\" must be true or false");

    /* YaRN as Qwen3 writes it: factor from the field (not max_position_embeddings / original) */
    parse_ok(&c, "{\"model_type\":\"qwen3_moe\",\"max_position_embeddings\":40960,\"rope_scaling\":{\"rope_type\":"
                 "\"yarn\",\"factor\":4.0,\"original_max_position_embeddings\":32768}}");
    const fm_rope_scaling *r = &c.rope_scaling;
    CHECK(r->type == FM_ROPE_YARN && r->factor == 4.0 && r->original_max_position_embeddings == 32768 &&
          r->beta_fast == 32 && r->beta_slow == 1 && r->truncate && r->mscale == 0 && r->attention_factor == 0);
    CHECK(fabs(fm_rope_attention_factor(&c) - (0.1 * log(4.0) + 1.0)) < 1e-15);
    round_trip(&c);
    /* the older "type" key; original absent: the file's max_position_embeddings, kept when the
     * max changes later (--max-position-embeddings) */
    parse_ok(&c, "{\"model_type\":\"olmoe\",\"max_position_embeddings\":4096,\"rope_scaling\":{\"type\":\"yarn\","
                 "\"factor\":2,\"beta_fast\":0,\"mscale\":0.7,\"mscale_all_dim\":0.9,\"truncate\":false}}");
    CHECK(r->type == FM_ROPE_YARN && r->original_max_position_embeddings == 4096 && r->beta_fast == 32 &&
          !r->truncate && r->mscale == 0.7 && r->mscale_all_dim == 0.9);
    CHECK(fabs(fm_rope_attention_factor(&c) - (0.07 * log(2.0) + 1.0) / (0.09 * log(2.0) + 1.0)) < 1e-15);
    round_trip(&c);
    { /* --max-position-embeddings on it: refused at setup, naming the field to add (the written
       * config would read the new max as the original context); with the field: written back */
        const char *txt = "{\"model_type\":\"olmoe\",\"max_position_embeddings\":4096,\"rope_scaling\":"
                          "{\"rope_type\":\"yarn\",\"factor\":2}}";
        parse_ok(&c, txt);
        c.max_position_embeddings = 8192;
        char *out = NULL;
        CHECK(fm_config_json_as_read(txt, &c, "y.json", &out) == FM_ERR_ARG &&
              strstr(fm_errmsg(), "add \"original_max_position_embeddings\": 4096"));
        const char *txt2 = "{\"model_type\":\"olmoe\",\"max_position_embeddings\":4096,\"rope_scaling\":"
                           "{\"rope_type\":\"yarn\",\"factor\":2,\"original_max_position_embeddings\":4096}}";
        parse_ok(&c, txt2);
        c.max_position_embeddings = 8192;
        CHECK(fm_config_json_as_read(txt2, &c, "y2.json", &out) == FM_OK && out && strstr(out, "8192"));
        fm_config back;
        CHECK(out && fm_config_parse(&back, out, "y2 back") == FM_OK &&
              back.rope_scaling.original_max_position_embeddings == 4096 && back.max_position_embeddings == 8192);
        fm_free(out);
    }
    /* transformers 5's rope_parameters, factor absent: max_position_embeddings / original */
    parse_ok(&c, "{\"model_type\":\"mixtral\",\"max_position_embeddings\":8192,\"rope_parameters\":{\"rope_type\":"
                 "\"yarn\",\"rope_theta\":500000.0,\"original_max_position_embeddings\":2048,\"attention_factor\":1.5}}");
    CHECK(r->type == FM_ROPE_YARN && r->factor == 4.0 && c.rope_theta == 500000.0 && fm_rope_attention_factor(&c) == 1.5);
    round_trip(&c);
    parse_ok(&c, "{\"model_type\":\"qwen3_moe\",\"rope_scaling\":{\"rope_type\":\"linear\",\"factor\":2.0}}");
    CHECK(r->type == FM_ROPE_LINEAR && r->factor == 2.0 && fm_rope_attention_factor(&c) == 1.0);
    round_trip(&c);
    parse_ok(&c, "{\"model_type\":\"qwen3_moe\",\"rope_scaling\":null,\"rope_parameters\":{\"rope_type\":\"default\","
                 "\"rope_theta\":1000000.0}}");
    CHECK(r->type == FM_ROPE_DEFAULT && c.rope_theta == 1e6);
    /* refused: other rope types (naming the supported ones), missing or bad values */
    parse_bad("{\"model_type\":\"qwen3_moe\",\"rope_scaling\":{\"rope_type\":\"dynamic\",\"factor\":2.0}}",
              FM_ERR_UNSUPPORTED, "supports only \"default\", \"linear\" and \"yarn\"");
    parse_bad("{\"model_type\":\"qwen3_moe\",\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8.0}}",
              FM_ERR_UNSUPPORTED, "rope_scaling.rope_type is \"llama3\"");
    parse_bad("{\"model_type\":\"qwen3_moe\",\"rope_scaling\":{\"rope_type\":\"yarn\"}}", FM_ERR_CONFIG,
              "needs \"factor\"");
    parse_bad("{\"model_type\":\"qwen3_moe\",\"rope_scaling\":{\"factor\":2.0}}", FM_ERR_FORMAT, "has no \"rope_type\"");
    parse_bad("{\"model_type\":\"qwen3_moe\",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":-2}}", FM_ERR_CONFIG,
              "\"factor\" must be positive");
    parse_bad("{\"model_type\":\"qwen3_moe\",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":2,"
              "\"original_max_position_embeddings\":-5}}", FM_ERR_CONFIG, "original_max_position_embeddings");
    parse_bad("{\"model_type\":\"qwen3_moe\",\"rope_scaling\":\"yarn\"}", FM_ERR_FORMAT, "must be an object");
    parse_bad("{\"model_type\":\"qwen3_moe\",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":2,\"truncate\":1}}",
              FM_ERR_FORMAT, "truncate");
    /* partial rotary: these three rotate the whole head (glm4_moe will read it) */
    parse_bad("{\"model_type\":\"qwen3_moe\",\"partial_rotary_factor\":0.5}", FM_ERR_UNSUPPORTED,
              "rotates the whole head");
    parse_ok(&c, "{\"model_type\":\"qwen3_moe\",\"partial_rotary_factor\":1.0}");
    /* fm_config_rotary_dim: Python's int() of head_dim x factor */
    c.head_dim = 128;
    c.partial_rotary_factor = 0.5;
    CHECK(fm_config_rotary_dim(&c) == 64);
    c.partial_rotary_factor = 0;
    CHECK(fm_config_rotary_dim(&c) == 128);
}

/* ---- YaRN against transformers' formulas (tools/rope_golden.py) ------------------------------- */

typedef struct golden { int i; double inv; } golden;

static void check_yarn(const char *name, int64_t dim, double theta, double factor, int64_t omax, double bf, double bs,
                       double ms, double msa, bool trunc, double af, const golden *g, int ng) {
    fm_config c;
    memset(&c, 0, sizeof c);
    c.head_dim = dim;
    c.rope_theta = theta;
    c.partial_rotary_factor = 1.0;
    c.rope_scaling = (fm_rope_scaling){FM_ROPE_YARN, factor, omax, bf, bs, ms, msa, 0, trunc};
    double inv[64];
    fm_rope_inv_freq(&c, inv);
    /* fp64 on both sides, the same formula: only libm's pow/log differ (a few ulps) */
    double worst = 0;
    for (int k = 0; k < ng; k++) worst = fmax(worst, fabs(inv[g[k].i] - g[k].inv) / g[k].inv);
    const double eaf = fabs(fm_rope_attention_factor(&c) - af);
    printf("yarn %s: inv_freq worst relative error %.2e over %d golden values, attention factor error %.1e\n", name,
           worst, ng, eaf);
    CHECK_MSG(worst < 1e-12 && eaf < 1e-13, "yarn %s", name);
    /* the tables: cos and sin of t inv_freq, times the attention factor, rounded to fp32 once */
    const int64_t T = 9, half = dim / 2;
    float *ct = fm_malloc(sizeof(float) * (size_t)(T * half)), *st = fm_malloc(sizeof(float) * (size_t)(T * half));
    fm_rope_tables_host(&c, T, ct, st);
    double werr = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < half; i++) {
            werr = fmax(werr, fabs(ct[t * half + i] - cos((double)t * inv[i]) * af));
            werr = fmax(werr, fabs(st[t * half + i] - sin((double)t * inv[i]) * af));
        }
    CHECK_MSG(werr < 2 * 6e-8 * fmax(af, 1.0), "yarn %s tables: error %.2e (fp32 rounding: 6e-8)", name, werr);
    fm_free(ct);
    fm_free(st);
}

static void test_yarn_golden(void) {
    /* Qwen3's recipe: head_dim 128, theta 1e6, factor 4, original 32768 */
    static const golden qwen3[] = {{0, 1.0}, {23, 0.006978305848598663}, {24, 0.005375321490790102},
                                   {30, 0.0010643609812470017}, {32, 0.0006029411764705882},
                                   {40, 4.445698525097307e-05}, {41, 3.582531425592407e-05}, {63, 3.102344401879299e-07}};
    check_yarn("qwen3", 128, 1e6, 4.0, 32768, 32, 1, 0, 0, true, 1.138629436111989, qwen3, 8);
    /* DeepSeek-V3's: rope dim 64, theta 1e4, factor 40, original 4096, mscale = mscale_all_dim = 1 */
    static const golden ds[] = {{10, 0.056234132519034905}, {11, 0.03900692656714386}, {16, 0.0055},
                                {22, 0.0001778279410038922}, {23, 3.33380358040831e-05}, {31, 3.33380358040831e-06}};
    check_yarn("deepseek", 64, 1e4, 40.0, 4096, 32, 1, 1.0, 1.0, true, 1.0, ds, 6);
    /* mscale 0.707 / mscale_all_dim 1, truncate false, beta 16/2 */
    static const golden ms[] = {{0, 1.0}, {1, 0.120533993843296}, {2, 0.0125}, {3, 0.003952847075210474},
                                {7, 3.952847075210474e-05}};
    check_yarn("mscale", 16, 1e4, 8.0, 64, 16, 2, 0.707, 1.0, false, 0.9495608824621653, ms, 5);
}

/* The default type's tables are the formula flatmoe used before the RoPE kinds, bit for bit (so
 * no feature on = the same arithmetic); partial rotary uses rd in the exponent (transformers'
 * dim = int(head_dim x partial_rotary_factor)); linear divides inv_freq by the factor. */
static void test_default_tables(void) {
    fm_config c = fm_test_small_config(FM_MODEL_QWEN3_MOE, 1, false, 2);
    c.head_dim = 16;
    c.rope_theta = 12345.0;
    const int64_t T = 11;
    float ct[11 * 8], st[11 * 8];
    fm_rope_tables_host(&c, T, ct, st);
    bool same = true;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < 8; i++) {
            const double ang = (double)t * pow(c.rope_theta, -2.0 * (double)i / (double)c.head_dim);
            same = same && ct[t * 8 + i] == (float)cos(ang) && st[t * 8 + i] == (float)sin(ang);
        }
    CHECK_MSG(same, "default RoPE tables differ from the pre-issue-26 formula");
    c.partial_rotary_factor = 0.5; /* rd 8: 4 columns, exponent over 8 */
    c.rope_scaling = (fm_rope_scaling){FM_ROPE_LINEAR, 3.0, 0, 0, 0, 0, 0, 0, true};
    fm_rope_tables_host(&c, T, ct, st);
    double err = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < 4; i++) {
            const double ang = (double)t * pow(c.rope_theta, -2.0 * (double)i / 8.0) / 3.0;
            err = fmax(err, fabs(ct[t * 4 + i] - cos(ang)) + fabs(st[t * 4 + i] - sin(ang)));
        }
    CHECK_MSG(err < 2e-7, "partial + linear tables: error %.2e", err);
}

/* ---- the parameter table ------------------------------------------------------------------------ */

static void test_params(void) {
    fm_config c = fm_test_small_config(FM_MODEL_QWEN3_MOE, 2, false, 2);
    c.attention_bias = c.attention_o_bias = true;
    fm_model_params p;
    CHECK(fm_params_create(&p, &c, 1, 0) == FM_OK);
    const char *names[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    const int64_t len[4] = {4 * 6, 2 * 6, 2 * 6, 24};
    for (int l = 0; l < 2; l++)
        for (int i = 0; i < 4; i++) {
            char n[96];
            snprintf(n, sizeof n, "model.layers.%d.self_attn.%s.bias", l, names[i]);
            const fm_param *b = fm_params_find(&p, n);
            CHECK_MSG(b && b->ndim == 1 && b->shape[0] == len[i] && !b->decay, "%s", n);
            /* right after its weight in the flat buffer */
            snprintf(n, sizeof n, "model.layers.%d.self_attn.%s.weight", l, names[i]);
            const fm_param *w = fm_params_find(&p, n);
            CHECK_MSG(w && b && w->offset + w->numel == b->offset, "%s", n);
        }
    CHECK(p.n_params == fm_config_num_params(&c));
    /* o bias alone (GPT-OSS's layout switch) */
    fm_config o = c;
    o.attention_bias = false;
    fm_model_params po;
    CHECK(fm_params_create(&po, &o, 1, 0) == FM_OK);
    CHECK(!fm_params_find(&po, "model.layers.0.self_attn.q_proj.bias") &&
          fm_params_find(&po, "model.layers.0.self_attn.o_proj.bias") && po.n_params == fm_config_num_params(&o));
    fm_params_free(&po);
    /* init: biases 0, norms 1; --ep 5 rank 3 draws the one-rank model's values for every tensor */
    fm_model_params part;
    CHECK(fm_params_create(&part, &c, 5, 3) == FM_OK && part.n_params == fm_params_ep_num_params(&c, 5));
    float *wf = fm_malloc(sizeof(float) * (size_t)p.n_params), *wp = fm_malloc(sizeof(float) * (size_t)part.n_params);
    fm_params_init_weights_host(&p, 9, wf);
    fm_params_init_weights_host(&part, 9, wp);
    const fm_param *bq = fm_params_find(&p, "model.layers.1.self_attn.q_proj.bias");
    bool zero = true;
    for (int64_t j = 0; j < bq->numel; j++) zero = zero && wf[bq->offset + j] == 0.0f;
    CHECK_MSG(zero, "biases must start at 0 (transformers' _init_weights)");
    int diff = 0;
    for (int i = 0; i < part.n_tensors; i++) {
        const fm_param *a = &part.table[i], *f = fm_params_find(&p, a->name);
        if (!f || memcmp(wp + a->offset, wf + f->offset, sizeof(float) * (size_t)a->numel)) diff++;
    }
    CHECK_MSG(diff == 0, "--ep 5 rank 3: %d tensors differ from the one-rank model's", diff);
    fm_free(wf);
    fm_free(wp);
    fm_params_free(&part);
    fm_params_free(&p);
}

/* ---- the whole model by finite differences ------------------------------------------------------ */

static double total_loss(fm_model *m) {
    fm_loss l;
    fm_schedule_default_forward(m, fm_test_batch_of(m), &l);
    return l.ce + l.aux + l.z;
}

static void routes(fm_model *m, int32_t *out) {
    const int64_t nk = m->a.N * m->cfg.num_experts_per_tok;
    for (int64_t l = 0; l < m->cfg.num_hidden_layers; l++)
        if (m->a.acts[l].router.topk_idx) memcpy(out + l * nk, m->a.acts[l].router.topk_idx, sizeof(int32_t) * (size_t)nk);
}

/* Biases drawn from Normal(0, 0.3) (they start at 0), so they shape the forward being checked. */
static void random_biases(fm_model *m, uint64_t seed) {
    fm_rng r;
    fm_rng_seed(&r, seed);
    for (int i = 0; i < m->p.n_tensors; i++) {
        const fm_param *p = &m->p.table[i];
        if (strstr(p->name, ".bias"))
            for (int64_t j = 0; j < p->numel; j++) m->p.params[p->offset + j] = (float)(0.3 * fm_rng_normal(&r));
    }
}

/* Every tensor's directional derivative along a random unit direction, central differences vs the
 * analytic gradient (test_model.c's check, with non-zero biases); directions that change the
 * top-k routing are redrawn. eps 1e-2 on weights of std 0.3: the curvature term is ~1e-4
 * relative, fp32 loss noise ~1e-7 / 1e-2; 2e-2 relative (floor 2e-3 absolute) separates a wrong
 * or missing term from both. */
static void check_grad(fm_config cfg, const char *label, uint64_t seed) {
    fm_model m;
    CHECK(fm_test_model_create(&m, &cfg, g_be) == FM_OK);
    CHECK(fm_model_layout(&m, 2, 7, NULL) == FM_OK);
    fm_model_init_weights(&m, seed);
    random_biases(&m, seed + 3);
    fm_test_fill_batch(&m, seed + 1, 3);
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    fm_loss base;
    fm_schedule_default_forward(&m, fm_test_batch_of(&m), &base);
    fm_schedule_default_backward(&m, 1.0f);
    const int64_t nk = m.a.N * cfg.num_experts_per_tok, L = cfg.num_hidden_layers;
    int32_t *r0 = fm_malloc(sizeof(int32_t) * (size_t)(nk * L)), *r1 = fm_malloc(sizeof(int32_t) * (size_t)(nk * L));
    memset(r0, 0, sizeof(int32_t) * (size_t)(nk * L));
    routes(&m, r0);
    float *dir = fm_malloc(sizeof(float) * (size_t)m.p.n_params), *orig = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
    fm_rng r;
    fm_rng_seed(&r, seed + 2);
    int bad = 0, checked = 0, biases = 0;
    double worst = 0;
    const double eps = 1e-2;
    for (int i = 0; i < m.p.n_tensors; i++) {
        const fm_param *p = &m.p.table[i];
        float *w = m.p.params + p->offset;
        const float *g = m.p.grads + p->offset;
        for (int attempt = 0; attempt < 8; attempt++) {
            double nrm = 0, an = 0;
            for (int64_t j = 0; j < p->numel; j++) { dir[j] = (float)fm_rng_normal(&r); nrm += (double)dir[j] * dir[j]; }
            nrm = sqrt(nrm);
            for (int64_t j = 0; j < p->numel; j++) { dir[j] = (float)(dir[j] / nrm); an += (double)g[j] * dir[j]; }
            memcpy(orig, w, sizeof(float) * (size_t)p->numel);
            for (int64_t j = 0; j < p->numel; j++) w[j] = (float)(orig[j] + eps * dir[j]);
            const double lp = total_loss(&m);
            memset(r1, 0, sizeof(int32_t) * (size_t)(nk * L));
            routes(&m, r1);
            bool same = !memcmp(r0, r1, sizeof(int32_t) * (size_t)(nk * L));
            for (int64_t j = 0; j < p->numel; j++) w[j] = (float)(orig[j] - eps * dir[j]);
            const double lm = total_loss(&m);
            memset(r1, 0, sizeof(int32_t) * (size_t)(nk * L));
            routes(&m, r1);
            same = same && !memcmp(r0, r1, sizeof(int32_t) * (size_t)(nk * L));
            memcpy(w, orig, sizeof(float) * (size_t)p->numel);
            if (!same) continue;
            const double fd = (lp - lm) / (2 * eps), err = fabs(fd - an) / fmax(fabs(an), 2e-3);
            worst = fmax(worst, err);
            if (err > 2e-2) {
                bad++;
                fprintf(stderr, "  %s %s: finite difference %.6g vs analytic %.6g (rel err %.3g)\n", label, p->name, fd,
                        an, err);
            }
            checked++;
            biases += strstr(p->name, ".bias") != NULL;
            break;
        }
    }
    printf("%s: %d tensors (%d biases) checked by finite differences, worst relative error %.2e\n", label, checked,
           biases, worst);
    CHECK_MSG(bad == 0, "%s: %d tensors with a wrong gradient", label, bad);
    CHECK_MSG(checked >= m.p.n_tensors - 2, "%s: only %d of %d tensors checked", label, checked, m.p.n_tensors);
    fm_free(dir);
    fm_free(orig);
    fm_free(r0);
    fm_free(r1);
    fm_test_model_free(&m);
}

/* qwen3_moe, head_dim 8 (q/k/v [32] > hidden 24), rotary over half of each head, YaRN with an
 * original context of 4 positions (the ramp falls inside the 2 rotated pairs' range for T = 7). */
static fm_config partial_yarn_config(void) {
    fm_config c = fm_test_small_config(FM_MODEL_QWEN3_MOE, 2, false, 2);
    c.head_dim = 8;
    c.partial_rotary_factor = 0.5;
    c.rope_theta = 50.0;
    c.rope_scaling = (fm_rope_scaling){FM_ROPE_YARN, 4.0, 4, 32, 1, 0, 0, 0, true};
    return c;
}

/* Layer 0's attention input qr (after QK-norm and RoPE) against a plain fp64 twin of its saved
 * projection q: the per-head RMSNorm (weights 1 at init), then the first rd dims rotated by the
 * YaRN angles t inv_freq times the attention factor (fm_rope_inv_freq, checked against the golden
 * values above), dims rd .. hd-1 untouched. fp32 norm and rotation: 1e-5 relative. */
static void test_model_rope(void) {
    fm_config c = partial_yarn_config();
    fm_model m;
    CHECK(fm_test_model_create(&m, &c, g_be) == FM_OK);
    const int64_t B = 2, T = 7, nh = c.num_attention_heads, hd = c.head_dim, rd = fm_config_rotary_dim(&c);
    CHECK(rd == 4);
    CHECK(fm_model_layout(&m, B, T, NULL) == FM_OK);
    fm_model_init_weights(&m, 5);
    fm_test_fill_batch(&m, 6, -1);
    fm_loss l;
    fm_schedule_default_forward(&m, fm_test_batch_of(&m), &l);
    double inv[2];
    fm_rope_inv_freq(&c, inv);
    const double af = fm_rope_attention_factor(&c);
    CHECK(af > 1.1); /* 0.1 ln 4 + 1 */
    const float *q = m.a.acts[0].q, *qr = m.a.acts[0].qr;
    double num = 0, den = 0;
    bool pass_same = true;
    for (int64_t n = 0; n < B * T; n++)
        for (int64_t h = 0; h < nh; h++) {
            const float *x = q + (n * nh + h) * hd, *y = qr + (n * nh + h) * hd;
            double ss = 0, z[8] = {0};
            for (int64_t i = 0; i < hd; i++) ss += (double)x[i] * x[i];
            const double rs = 1.0 / sqrt(ss / (double)hd + c.rms_norm_eps);
            for (int64_t i = 0; i < hd; i++) z[i] = x[i] * rs;
            double ref[8];
            memcpy(ref, z, sizeof ref);
            const double t = (double)(n % T);
            for (int64_t i = 0; i < rd / 2; i++) {
                const double cs = cos(t * inv[i]) * af, sn = sin(t * inv[i]) * af;
                ref[i] = z[i] * cs - z[i + rd / 2] * sn;
                ref[i + rd / 2] = z[i + rd / 2] * cs + z[i] * sn;
            }
            for (int64_t i = 0; i < hd; i++) {
                num += (y[i] - ref[i]) * (y[i] - ref[i]);
                den += ref[i] * ref[i];
            }
            for (int64_t i = rd; i < hd; i++) pass_same = pass_same && fabs(y[i] - z[i]) <= 1e-6 * fabs(z[i]) + 1e-7;
        }
    const double err = sqrt(num / den);
    printf("model RoPE (partial rotary rd %lld of %lld, YaRN): layer 0 q vs fp64 twin %.2e\n", (long long)rd,
           (long long)hd, err);
    CHECK(err < 1e-5);
    CHECK_MSG(pass_same, "the dims past rotary_dim must be the normed projection, unrotated");
    fm_test_model_free(&m);
}

/* Every live set's arena equals its bound formula with biases and partial rotary (the RoPE tables
 * [T, rd/2] in the boundary set; the biases in the model state, from the config's count). */
static void test_layout_bounds(void) {
    fm_config c = partial_yarn_config();
    c.attention_bias = c.attention_o_bias = true;
    const int64_t B = 2, T = 40, N = B * T, L = c.num_hidden_layers; /* tables of 2 x 160 B, not 2 x 320 */
    const size_t a = sizeof(fm_act);
    const fm_moe_dims d = {c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok};
    size_t want[FM_LIVE_COUNT];
    want[FM_LIVE_BOUNDARIES] = fm_model_boundary_bytes_chunked(&c, B, T, false, a);
    want[FM_LIVE_LAYER_ACTS] = (size_t)L * fm_model_layer_acts_bytes(&c, B, T, a);
    want[FM_LIVE_EXPERT] = (size_t)L * fm_moe_routes_bytes(&d, N, a) + fm_moe_ws_bytes(&d, N, false, a);
    want[FM_LIVE_WORKING_SET] = fm_model_working_set_bytes(&c, N, a);
    want[FM_LIVE_VOCAB] = fm_model_vocab_plain_bytes(&c, N, a);
    fm_model m;
    CHECK(fm_test_model_create(&m, &c, g_be) == FM_OK);
    CHECK(fm_model_layout(&m, B, T, NULL) == FM_OK);
    for (int i = 1; i < FM_LIVE_COUNT; i++)
        CHECK_MSG(m.a.arena[i].capacity == fm_arena_round(want[i]), "%s: arena %zu bytes, formula %zu",
                  fm_live_set_names[i], m.a.arena[i].capacity, want[i]);
    CHECK(m.p.n_params == fm_config_num_params(&c));
    CHECK(fm_param_store_bytes(&m.cfg, a) == fm_param_store_measure(m.p.n_params));
    fm_test_model_free(&m);
}

int main(void) {
    const uint64_t seed = fm_test_seed(26);
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    test_config();
    test_yarn_golden();
    test_default_tables();
    test_params();
    fm_config c = fm_test_small_config(FM_MODEL_QWEN3_MOE, 2, false, 2);
    c.attention_bias = c.attention_o_bias = true;
    check_grad(c, "qwen3_moe + q/k/v/o biases", seed);
    c = fm_test_small_config(FM_MODEL_OLMOE, 2, false, 3);
    c.attention_bias = c.attention_o_bias = true;
    check_grad(c, "olmoe + q/k/v/o biases", seed + 10);
    c = fm_test_small_config(FM_MODEL_MIXTRAL, 2, true, 2); /* no QK-norm: RoPE in place on the biased projections */
    c.attention_bias = c.attention_o_bias = true;
    check_grad(c, "mixtral-shaped + q/k/v/o biases", seed + 20);
    c = fm_test_small_config(FM_MODEL_QWEN3_MOE, 2, false, 2);
    c.attention_o_bias = true; /* o alone (GPT-OSS's switch without q/k/v) */
    check_grad(c, "qwen3_moe + o bias only", seed + 30);
    c = partial_yarn_config();
    c.attention_bias = c.attention_o_bias = true;
    check_grad(c, "qwen3_moe + biases + partial rotary + YaRN", seed + 40);
    test_model_rope();
    test_layout_bounds();
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
