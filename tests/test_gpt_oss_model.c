/* gpt_oss's whole model on the CPU (issue 26): a small config with sliding and full layers,
 * attention sinks, q/k/v/o biases, the router's bias, the experts' biases and the clamped SwiGLU
 * (swiglu_limit small enough that some gates and ups are clamped):
 *   - every tensor's gradient (sinks, router bias, expert biases included) against central
 *     differences of the loss along a random direction (tests/test_model.c's check: eps 1e-2,
 *     relative 2e-2, directions that flip the routing or move a gate or up across the clamp's
 *     limit redrawn; some are clamped at the base point);
 *   - full recompute gives the same gradients bit for bit (the same ops on the same inputs);
 *   - the chunked MoE and the plain twin: the loss within 1e-6 and the gradients within 1e-6
 *     relative (the row grouping of the expert GEMMs and the per-expert bias sums differ:
 *     reassociation only);
 *   - the planned bounds equal the arenas' high-water marks within [90%, 100%];
 *   - what is refused: --sp, --expert-precision fp8. */
#include <math.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "model/fm_model.h"
#include "schedule/fm_schedule.h"

static fm_backend g_be;

static const char *k_cfg =
    "{\"model_type\": \"gpt_oss\", \"vocab_size\": 40, \"hidden_size\": 24, \"intermediate_size\": 12, "
    "\"num_hidden_layers\": 3, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 6, "
    "\"max_position_embeddings\": 64, \"num_local_experts\": 5, \"num_experts_per_tok\": 2, \"sliding_window\": 3, "
    "\"layer_types\": [\"sliding_attention\", \"full_attention\", \"sliding_attention\"], \"swiglu_limit\": 3.0, "
    "\"output_router_logits\": true, \"router_aux_loss_coef\": 0.3, \"initializer_range\": 0.3, "
    "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 16, "
    "\"truncate\": false}}";

static fm_config load_cfg(void) {
    fm_config c;
    fm_status s = fm_config_parse(&c, k_cfg, "gpt_oss_small.json");
    CHECK_MSG(s == FM_OK, "%s", fm_errmsg());
    return c;
}

/* init, then every bias (zero at init) drawn small so that it matters */
static void init_model(fm_model *m, uint64_t seed) {
    fm_model_init_weights(m, seed);
    fm_rng r;
    fm_rng_seed(&r, seed + 100);
    for (int i = 0; i < m->p.n_tensors; i++) {
        const fm_param *p = &m->p.table[i];
        const size_t n = strlen(p->name);
        if (n > 5 && !strcmp(p->name + n - 5, ".bias"))
            for (int64_t j = 0; j < p->numel; j++) m->p.params[p->offset + j] = (float)(0.2 * fm_rng_normal(&r));
    }
}

static double total_loss(fm_model *m) {
    fm_loss l;
    fm_schedule_default_forward(m, fm_test_batch_of(m), &l);
    return l.ce + l.aux + l.z;
}

static void save_routing(fm_model *m, int32_t *saved) {
    const int64_t nk = m->a.N * m->cfg.num_experts_per_tok;
    for (int64_t l = 0; l < m->cfg.num_hidden_layers; l++)
        memcpy(saved + l * nk, m->a.acts[l].router.topk_idx, sizeof(int32_t) * (size_t)nk);
}

static bool same_routing(fm_model *m, const int32_t *saved) {
    const int64_t nk = m->a.N * m->cfg.num_experts_per_tok;
    for (int64_t l = 0; l < m->cfg.num_hidden_layers; l++)
        if (memcmp(saved + l * nk, m->a.acts[l].router.topk_idx, sizeof(int32_t) * (size_t)nk)) return false;
    return true;
}

/* The clamp's side of every gate and up of the plain twin's saved dispatch (the loss is not
 * differentiable where one crosses its limit): 2 bits per element into mask [L * R * I], and the
 * count of clamped elements. */
static int64_t clamp_mask(fm_model *m, unsigned char *mask) {
    const fm_config *c = &m->cfg;
    const int64_t RI = m->a.N * c->num_experts_per_tok * c->moe_intermediate_size;
    const float lim = (float)c->swiglu_limit;
    int64_t n = 0;
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        const float *g = m->a.acts[l].moe.h_gate, *u = m->a.acts[l].moe.h_up;
        for (int64_t i = 0; i < RI; i++) {
            const unsigned char b = (unsigned char)((g[i] > lim) | (u[i] > lim) << 1 | (u[i] < -lim) << 2);
            mask[l * RI + i] = b;
            n += b != 0;
        }
    }
    return n;
}

static void test_grad(void) {
    fm_config cfg = load_cfg();
    fm_model m;
    CHECK(fm_test_model_create(&m, &cfg, g_be) == FM_OK);
    CHECK(fm_model_layout(&m, 2, 7, NULL) == FM_OK);
    init_model(&m, 11);
    fm_test_fill_batch(&m, 12, 3);
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    fm_loss base;
    fm_schedule_default_forward(&m, fm_test_batch_of(&m), &base);
    fm_schedule_default_backward(&m, 1.0f);
    /* the clamp is exercised: some gate or up of the last dispatch beyond the limit */
    const int64_t nk = m.a.N * cfg.num_experts_per_tok;
    int32_t *routing = fm_malloc(sizeof(int32_t) * (size_t)(nk * cfg.num_hidden_layers));
    save_routing(&m, routing);
    const int64_t RI = m.a.N * cfg.num_experts_per_tok * cfg.moe_intermediate_size * cfg.num_hidden_layers;
    unsigned char *mask = fm_malloc((size_t)RI), *mask2 = fm_malloc((size_t)RI);
    const int64_t clamped = clamp_mask(&m, mask);
    printf("gpt_oss: %lld of %lld expert gates/ups clamped at the base point\n", (long long)clamped, (long long)RI);
    CHECK(clamped > 0 && clamped < RI / 2);
    float *dir = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
    fm_rng r;
    fm_rng_seed(&r, 13);
    int bad = 0, checked = 0;
    double worst = 0;
    const double eps = 1e-2;
    for (int i = 0; i < m.p.n_tensors; i++) {
        const fm_param *p = &m.p.table[i];
        float *w = m.p.params + p->offset;
        const float *g = m.p.grads + p->offset;
        for (int attempt = 0; attempt < 8; attempt++) {
            double nrm = 0, an = 0;
            for (int64_t j = 0; j < p->numel; j++) dir[j] = (float)fm_rng_normal(&r), nrm += (double)dir[j] * dir[j];
            nrm = sqrt(nrm);
            for (int64_t j = 0; j < p->numel; j++) dir[j] = (float)(dir[j] / nrm), an += (double)g[j] * dir[j];
            float *orig = fm_malloc(sizeof(float) * (size_t)p->numel);
            memcpy(orig, w, sizeof(float) * (size_t)p->numel);
            for (int64_t j = 0; j < p->numel; j++) w[j] = (float)(orig[j] + eps * dir[j]);
            const double lp = total_loss(&m);
            bool ok = same_routing(&m, routing);
            clamp_mask(&m, mask2);
            ok = ok && !memcmp(mask, mask2, (size_t)RI);
            for (int64_t j = 0; j < p->numel; j++) w[j] = (float)(orig[j] - eps * dir[j]);
            const double lm = total_loss(&m);
            ok = ok && same_routing(&m, routing);
            clamp_mask(&m, mask2);
            ok = ok && !memcmp(mask, mask2, (size_t)RI); /* a clamp crossed its limit: redraw */
            memcpy(w, orig, sizeof(float) * (size_t)p->numel);
            fm_free(orig);
            if (!ok) continue;
            const double fd = (lp - lm) / (2 * eps), err = fabs(fd - an) / fmax(fabs(an), 2e-3);
            worst = err > worst ? err : worst;
            if (err > 2e-2) {
                bad++;
                fprintf(stderr, "  gpt_oss %s: finite difference %.6g vs analytic %.6g (rel err %.3g)\n", p->name, fd,
                        an, err);
            }
            checked++;
            break;
        }
    }
    printf("gpt_oss: %d of %d tensors checked by finite differences, worst relative error %.2e\n", checked,
           m.p.n_tensors, worst);
    CHECK_MSG(bad == 0, "gpt_oss: %d tensors with a wrong gradient", bad);
    CHECK_MSG(checked >= m.p.n_tensors - 2, "gpt_oss: only %d of %d tensors could be checked", checked, m.p.n_tensors);
    /* the new tensors are in the table, with gradients */
    CHECK(fm_params_find(&m.p, "model.layers.0.self_attn.sinks") && fm_params_find(&m.p, "model.layers.2.mlp.router.bias") &&
          fm_params_find(&m.p, "model.layers.1.mlp.experts.4.down_proj.bias") &&
          fm_params_find(&m.p, "model.layers.1.mlp.router.weight"));
    CHECK(m.p.n_params == fm_config_num_params(&cfg));
    fm_free(dir);
    fm_free(routing);
    fm_free(mask);
    fm_free(mask2);
    fm_test_model_free(&m);
}

static double rel_diff(const float *a, const float *b, int64_t n) {
    double num = 0, den = 1e-30;
    for (int64_t i = 0; i < n; i++) num += fabs((double)a[i] - b[i]), den += fabs((double)b[i]);
    return num / den;
}

static void run_step(const fm_config *cfg, int64_t chunk, const bool *rc, float **grads, double *loss) {
    fm_model m;
    CHECK(fm_test_model_create(&m, cfg, g_be) == FM_OK);
    fm_layout_opts lo = {rc, chunk, 0, 0};
    CHECK(fm_model_layout(&m, 2, 11, &lo) == FM_OK);
    init_model(&m, 5);
    fm_test_fill_batch(&m, 6, 3);
    memset(m.p.grads, 0, sizeof(float) * (size_t)m.p.n_params);
    fm_loss l;
    fm_schedule_default_forward(&m, fm_test_batch_of(&m), &l);
    fm_schedule_default_backward(&m, 1.0f);
    *loss = l.ce + l.aux + l.z;
    for (int i = 1; i < FM_LIVE_COUNT; i++) {
        const size_t hw = fm_arena_touched(&m.a.arena[i]), cap = m.a.arena[i].capacity;
        CHECK_MSG(hw <= cap && hw * 10 >= cap * 9, "gpt_oss chunk %lld: %s high-water %zu vs bound %zu",
                  (long long)chunk, fm_live_set_names[i], hw, cap);
    }
    *grads = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
    memcpy(*grads, m.p.grads, sizeof(float) * (size_t)m.p.n_params);
    fm_test_model_free(&m);
}

static void test_recompute_and_chunks(void) {
    const fm_config cfg = load_cfg();
    const int64_t n = fm_config_num_params(&cfg);
    float *ref, *g;
    double ref_loss, loss;
    run_step(&cfg, 0, NULL, &ref, &ref_loss);
    const bool rc[3] = {true, true, true};
    run_step(&cfg, 0, rc, &g, &loss);
    CHECK_MSG(loss == ref_loss && !memcmp(g, ref, sizeof(float) * (size_t)n), "gpt_oss: full recompute differs");
    fm_free(g);
    const int64_t chunks[3] = {1, 4, 22};
    for (int c = 0; c < 3; c++) {
        run_step(&cfg, chunks[c], NULL, &g, &loss);
        CHECK_MSG(fabs(loss - ref_loss) <= 1e-6 * fabs(ref_loss), "gpt_oss chunk %lld: loss %.17g vs plain %.17g",
                  (long long)chunks[c], loss, ref_loss);
        const double e = rel_diff(g, ref, n);
        CHECK_MSG(e < 1e-6, "gpt_oss chunk %lld: gradients differ from the plain twin by %g", (long long)chunks[c], e);
        fm_free(g);
    }
    fm_free(ref);
}

static void test_refused(void) {
    const fm_config cfg = load_cfg();
    fm_model m;
    CHECK(fm_test_model_create(&m, &cfg, g_be) == FM_OK);
    fm_layout_opts lo = {0};
    lo.expert_fp8 = true;
    CHECK(fm_model_layout(&m, 2, 8, &lo) == FM_ERR_UNSUPPORTED && strstr(fm_errmsg(), "--expert-precision"));
    fm_test_model_free(&m);
}

int main(void) {
    fm_rng seed_only;
    fm_rng_seed(&seed_only, fm_test_seed(0));
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    test_grad();
    test_recompute_and_chunks();
    test_refused();
    fm_cpu_backend_free(&g_be);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
