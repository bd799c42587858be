/* Selective checkpoint offload (schedule/fm_sco.h) on the CPU backend:
 * - for each model_type, with and without recompute of some layers, plain and chunked MoE, two
 *   accumulated micro-batches with n_off = 1, 2 and L offloaded boundaries give loss and
 *   gradients bit-identical (memcmp) to no offload;
 * - the slots are really refilled from the host: a hook added after the policy poisons both slots
 *   at the end of forward, and another checks at BEFORE_BACKWARD(l) (before a recompute) that
 *   boundary l is back, bit for bit as forward left it;
 * - the boundaries arena holds exactly the policy's formula (and the planner's bytes), its painted
 *   high-water mark lies within it and reaches its last tensor; the host arena holds n_off
 *   boundaries; copies out and in are n_off per micro-batch;
 * - forward alone (evaluation) needs no policy; backward without it is refused;
 * - bad --offload-boundaries values name the flag, the value and the range. */
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "plan/fm_plan.h"
#include "schedule/fm_sco.h"
#include "train/fm_optim.h"

static fm_backend g_be;
enum { L_ = 4, B_ = 2, T_ = 8 };

static fm_config small_config(fm_model_type t) { return fm_test_small_config(t, L_, false, 2); }
static void fill_batch(fm_model *m, uint64_t seed) { fm_test_fill_batch(m, seed, -1); }



static void make_model(fm_model *m, const fm_config *c, const bool *rc, int64_t chunk, int64_t n_off) {
    FM_ASSERT(fm_test_model_create(m, c, g_be) == FM_OK);
    fm_layout_opts lo = {rc, chunk, 0, 0, n_off};
    FM_ASSERT(fm_model_layout(m, B_, T_, &lo) == FM_OK);
    FM_ASSERT(fm_model_init_weights(m, 11) == FM_OK);
    memset(m->p.grads, 0, sizeof(float) * (size_t)m->p.n_params);
}

/* A hook added after the policy: saves each boundary as forward leaves it, poisons the slots at
 * the end of forward, and checks at BEFORE_BACKWARD(l) that boundary l is back. */
typedef struct checker {
    int64_t n_off, N, H;
    float *saved;      /* [L][N*H] */
    int restored_ok, restored_bad, events;
} checker;

static fm_status check_hook(void *user, fm_model *m, fm_hook_point p, int64_t l) {
    checker *k = user;
    const size_t nb = sizeof(float) * (size_t)(k->N * k->H);
    k->events++;
    if (p == FM_HOOK_AFTER_FORWARD && l < k->n_off) memcpy(k->saved + l * k->N * k->H, fm_model_boundary(m, l), nb);
    if (p == FM_HOOK_AFTER_FORWARD && l == m->cfg.num_hidden_layers - 1) /* every copy-out has been issued */
        for (int64_t s = 0; s < k->n_off && s < 2; s++)
            for (int64_t i = 0; i < k->N * k->H; i++) fm_model_boundary(m, s)[i] = (float)NAN;
    if (p == FM_HOOK_BEFORE_BACKWARD && l < k->n_off) {
        if (!memcmp(k->saved + l * k->N * k->H, fm_model_boundary(m, l), nb)) k->restored_ok++;
        else k->restored_bad++;
    }
    return FM_OK;
}

/* A hook added before the policy: counts its calls (the policy must not disturb the others). */
static fm_status count_hook(void *user, fm_model *m, fm_hook_point p, int64_t l) {
    (void)m; (void)p; (void)l;
    (*(int *)user)++;
    return FM_OK;
}

/* Two accumulated micro-batches (different tokens), as the trainer runs them. */
static fm_status two_steps(fm_schedule *s, fm_model *m, fm_loss *out) {
    fill_batch(m, 21);
    FM_TRY(fm_schedule_train_step(s, m, fm_test_batch_of(m), 0.5f, out));
    fill_batch(m, 22);
    return fm_schedule_train_step(s, m, fm_test_batch_of(m), 0.5f, out + 1);
}

static void test_bit_identical(fm_model_type t, const bool *rc, int64_t chunk) {
    const fm_config c = small_config(t);
    const int64_t N = B_ * T_, H = c.hidden_size;
    fm_model ref;
    make_model(&ref, &c, rc, chunk, 0);
    fm_schedule sr;
    fm_schedule_init(&sr, &ref);
    fm_loss lr[2];
    CHECK(two_steps(&sr, &ref, lr) == FM_OK);
    const int64_t offs[3] = {1, 2, L_};
    for (int i = 0; i < 3; i++) {
        const int64_t n_off = offs[i];
        fm_model m;
        make_model(&m, &c, rc, chunk, n_off);
        CHECK(m.a.n_offloaded_boundaries == n_off);
        /* the boundaries arena: exactly the policy's count of [N,H] tensors, as the planner says */
        const size_t a = sizeof(fm_act);
        const size_t want = fm_model_boundary_bytes_n(&c, B_, T_, chunk > 0, fm_sco_device_boundaries(L_, n_off), a);
        CHECK_MSG(m.a.arena[FM_LIVE_BOUNDARIES].capacity == fm_arena_round(want), "%s n_off %lld: arena %zu, formula %zu",
                  c.model_type_name, (long long)n_off, m.a.arena[FM_LIVE_BOUNDARIES].capacity, want);
        CHECK(fm_sco_device_boundaries(L_, n_off) == fm_model_boundary_tensors(L_, n_off));
        fm_plan_req req;
        memset(&req, 0, sizeof req);
        req.cfg = c; req.B = B_; req.T = T_; req.grad_accum = 2; req.recompute = rc; req.moe_chunk_tokens = chunk;
        req.model_state_bytes = fm_model_state_bound; req.n_offloaded_boundaries = n_off;
        fm_plan plan;
        fm_plan_compute(&req, &plan);
        CHECK(plan.bytes[FM_LIVE_BOUNDARIES] == want);
        CHECK(plan.host_bytes == fm_sco_host_bytes(N, H, n_off, a));

        fm_sco p;
        CHECK(fm_sco_create(&p, &m) == FM_OK);
        CHECK(p.host.capacity == fm_arena_round((size_t)n_off * fm_arena_round((size_t)(N * H) * a)));
        CHECK(p.host.capacity == plan.host_bytes);
        fm_schedule s;
        fm_schedule_init(&s, &m);
        int before = 0;
        checker k = {n_off, N, H, fm_malloc(sizeof(float) * (size_t)(L_ * N * H)), 0, 0, 0};
        CHECK(fm_schedule_add_hook(&s, count_hook, &before) == FM_OK);
        CHECK(fm_sco_attach(&p, &s) == FM_OK);
        CHECK(fm_schedule_add_hook(&s, check_hook, &k) == FM_OK);
        fm_loss l[2];
        CHECK(two_steps(&s, &m, l) == FM_OK);
        for (int g = 0; g < 2; g++)
            CHECK_MSG(!memcmp(&l[g], &lr[g], sizeof l[g]), "%s n_off %lld: loss %.17g vs %.17g", c.model_type_name,
                      (long long)n_off, l[g].ce + l[g].aux + l[g].z, lr[g].ce + lr[g].aux + lr[g].z);
        CHECK_MSG(!memcmp(m.p.grads, ref.p.grads, sizeof(float) * (size_t)m.p.n_params),
                  "%s n_off %lld recompute %d chunk %lld: gradients differ", c.model_type_name, (long long)n_off,
                  rc != NULL, (long long)chunk);
        CHECK(before == 2 * 4 * L_ && k.events == 2 * 4 * L_);
        CHECK_MSG(k.restored_ok == 2 * n_off && k.restored_bad == 0, "restored %d ok, %d bad", k.restored_ok,
                  k.restored_bad);
        CHECK(p.copies_out == (uint64_t)(2 * n_off) && p.copies_in == (uint64_t)(2 * n_off));
        CHECK(p.host.high == p.host.capacity);
        /* the painted high-water mark: within the arena, and up to its last tensor (boundary L) */
        const size_t touched = fm_arena_touched(&m.a.arena[FM_LIVE_BOUNDARIES]);
        CHECK(touched <= m.a.arena[FM_LIVE_BOUNDARIES].capacity);
        CHECK(touched > m.a.arena[FM_LIVE_BOUNDARIES].capacity - fm_arena_round((size_t)(N * H) * a));
        fm_free(k.saved);
        fm_sco_free(&p);
        fm_test_model_free(&m);
    }
    fm_test_model_free(&ref);
}

/* Forward alone needs no policy (the rotating slots hold what the next layer reads); backward
 * without the policy is refused before anything runs. */
static void test_without_policy(void) {
    const fm_config c = small_config(FM_MODEL_OLMOE);
    fm_model ref, m;
    make_model(&ref, &c, NULL, 0, 0);
    make_model(&m, &c, NULL, 0, L_);
    fill_batch(&ref, 5);
    fill_batch(&m, 5);
    fm_loss a, b;
    fm_schedule_default_forward(&ref, fm_test_batch_of(&ref), &a);
    fm_schedule_default_forward(&m, fm_test_batch_of(&m), &b);
    CHECK(!memcmp(&a, &b, sizeof a));
    fm_schedule s;
    fm_schedule_init(&s, &m);
    CHECK(fm_schedule_train_step(&s, &m, fm_test_batch_of(&m), 1.0f, &b) == FM_ERR_ARG);
    CHECK(strstr(fm_errmsg(), "offloads 4 boundaries") != NULL);
    CHECK(fm_schedule_backward(&s, &m, 1.0f) == FM_ERR_ARG);
    /* n_off = 0 attaches a policy that does nothing */
    fm_sco p;
    CHECK(fm_sco_create(&p, &ref) == FM_OK && p.host.capacity == 0);
    fm_sco_free(&p);
    /* the layout refuses more than L */
    fm_layout_opts bad = {NULL, 0, 0, 0, L_ + 1};
    CHECK(fm_model_layout(&m, B_, T_, &bad) == FM_ERR_ARG);
    CHECK(strstr(fm_errmsg(), "--offload-boundaries") && strstr(fm_errmsg(), "found 5") && strstr(fm_errmsg(), "0 .. 4"));
    fm_test_model_free(&ref);
    fm_test_model_free(&m);
}

static void test_parse(void) {
    int64_t n = -7;
    CHECK(fm_sco_parse(NULL, 4, &n) == FM_OK && n == 0);
    CHECK(fm_sco_parse("", 4, &n) == FM_OK && n == 0);
    CHECK(fm_sco_parse("0", 4, &n) == FM_OK && n == 0);
    CHECK(fm_sco_parse("3", 4, &n) == FM_OK && n == 3);
    CHECK(fm_sco_parse("all", 4, &n) == FM_OK && n == 4);
    CHECK(fm_sco_parse("4", 4, &n) == FM_OK && n == 4);
    const char *bad[] = {"5", "-1", "x", "2x", "1.5", "ALL"};
    for (int i = 0; i < 6; i++) {
        CHECK(fm_sco_parse(bad[i], 4, &n) == FM_ERR_ARG);
        char found[32];
        snprintf(found, sizeof found, "found '%s'", bad[i]);
        CHECK_MSG(strstr(fm_errmsg(), "--offload-boundaries") && strstr(fm_errmsg(), found) &&
                  strstr(fm_errmsg(), "0 .. 4"), "%s", fm_errmsg());
    }
    /* the bound: L+1 - n + min(n, 2) */
    CHECK(fm_sco_device_boundaries(16, 0) == 17);
    CHECK(fm_sco_device_boundaries(16, 1) == 17);
    CHECK(fm_sco_device_boundaries(16, 2) == 17);
    CHECK(fm_sco_device_boundaries(16, 3) == 16);
    CHECK(fm_sco_device_boundaries(16, 16) == 3);
    CHECK(fm_sco_host_bytes(10, 3, 2, 4) == 2 * 128);
}

int main(void) {
    FM_ASSERT(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    const fm_model_type types[3] = {FM_MODEL_QWEN3_MOE, FM_MODEL_OLMOE, FM_MODEL_MIXTRAL};
    const bool rc[L_] = {false, true, true, false};
    for (int t = 0; t < 3; t++) {
        test_bit_identical(types[t], NULL, 0);
        test_bit_identical(types[t], rc, 0);
        test_bit_identical(types[t], rc, 5);
        test_bit_identical(types[t], NULL, 5);
    }
    test_without_policy();
    test_parse();
    fm_cpu_backend_free(&g_be);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
