/* FLATMOE_EXPERT_GEMM=auto's choice between the sm90 expert GEMM and cuBLAS (plan/fm_expert_choice.h)
 * on synthetic calibration tables: sm90 faster -> sm90, slower or tied -> cuBLAS, no sm90 curves,
 * an unserved shape, --ep 2, another device or the CPU -> cuBLAS (or the CPU's own); forced forms;
 * the crossover by rows per expert (the chunk decides it); prepare/fit/finish: the chooser's
 * projection times the form finish settles on; the printed line and the JSON. */
#include <stdio.h>
#include <string.h>

#include "fm_test.h"
#include "plan/fm_choose.h"
#include "plan/fm_expert_choice.h"
#include "plan/fm_plan.h"
#include "plan/fm_project.h"
#include "train/fm_offload_adamw.h"
#include "train/fm_optim.h"

/* The OLMoE-1B-7B request at B x T, unchunked, no recompute, one micro-batch. */
static void olmoe_req(fm_plan_req *r, int64_t B, int64_t T) {
    memset(r, 0, sizeof *r);
    CHECK(fm_config_load(&r->cfg, "configs/olmoe-1b-7b.json") == FM_OK);
    r->B = B, r->T = T, r->grad_accum = 1;
    r->target = FM_PLAN_TARGET_CUDA;
    r->model_state_bytes = fm_model_state_bound;
    r->offload_state_bytes = fm_offload_model_state_bound; /* the chooser may stream the optimizer */
    r->offload_bucket = FM_OFFLOAD_DEFAULT_BUCKET, r->offload_slots = 2;
}

/* The CUDA default table with flat expert curves: cuBLAS at cub FLOP/s (forward and backward),
 * sm90 at s9 (0: no sm90 curves). */
static void table(fm_calib *c, double cub, double s9) {
    fm_calib_default(c, "cuda");
    c->expert_fwd.n = c->expert_bwd.n = c->expert_fwd_sm90.n = c->expert_bwd_sm90.n = 0;
    fm_calib_add(&c->expert_fwd, 512, cub);
    fm_calib_add(&c->expert_bwd, 512, cub);
    if (s9 > 0) {
        fm_calib_add(&c->expert_fwd_sm90, 512, s9);
        fm_calib_add(&c->expert_bwd_sm90, 512, s9);
    }
}

static void choose(const fm_plan_req *r, const fm_calib *c, fm_expert_gemm want, bool cuda, bool dev,
                   fm_expert_choice *ch) {
    fm_plan p;
    fm_plan_compute(r, &p);
    const fm_expert_ask a = {want, cuda, dev};
    fm_expert_choose(r, &p, &a, c, ch);
}

static void test_rule(void) {
    fm_plan_req r;
    olmoe_req(&r, 1, 4096);
    const double L = 16, N = 4096, k = 8, H = 2048, I = 1024, F = 2 * N * k * 3 * H * I; /* forward FLOPs a layer */
    fm_calib c;
    fm_expert_choice ch;
    /* sm90 faster: sm90, both times by hand (forward + twice the FLOPs backward, every layer) */
    table(&c, 300e12, 600e12);
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(ch.sm90 && ch.gemm == FM_EXPERT_GEMM_SM90 && ch.why == FM_EXPERT_WHY_FASTER && ch.projected);
    CHECK_CLOSE(ch.sm90_s, L * 3 * F / 600e12, 1e-12);
    CHECK_CLOSE(ch.cublas_s, L * 3 * F / 300e12, 1e-12);
    CHECK_CLOSE(ch.rows_per_expert, 512, 1e-12); /* k N / E = 8 x 4096 / 64 */
    CHECK(strcmp(fm_expert_choice_form(&ch), "sm90") == 0);
    /* slower, and tied: cuBLAS (the backend's cublas form) */
    table(&c, 600e12, 300e12);
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_CUBLAS && ch.why == FM_EXPERT_WHY_NOT_FASTER && ch.projected);
    CHECK(ch.sm90_s > ch.cublas_s && strcmp(fm_expert_choice_form(&ch), "cublas") == 0);
    table(&c, 500e12, 500e12);
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_CUBLAS && ch.why == FM_EXPERT_WHY_NOT_FASTER);
    /* no sm90 curves: cuBLAS, nothing projected */
    table(&c, 300e12, 0);
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_CUBLAS && ch.why == FM_EXPERT_WHY_NO_CURVES && !ch.projected);
    /* the rest with sm90 faster, so only the failed condition can make it cuBLAS */
    table(&c, 300e12, 600e12);
    fm_plan_req f = r;
    f.expert_fp8 = true; /* --expert-precision fp8: the emulation feeds cuBLAS */
    choose(&f, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_CUBLAS && ch.why == FM_EXPERT_WHY_FP8);
    {
        char line[512];
        fm_expert_choice_line(&ch, line, sizeof line);
        CHECK_MSG(strstr(line, "expert GEMM: cuBLAS") && strstr(line, "fp8"), "%s", line);
    }
    fm_plan_req u = r;
    u.cfg.moe_intermediate_size = 1000; /* not a multiple of 128: the kernel does not serve it */
    choose(&u, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_CUBLAS && ch.why == FM_EXPERT_WHY_SHAPE);
    u = r;
    u.ep = 2; /* --ep 2 */
    choose(&u, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_CUBLAS && ch.why == FM_EXPERT_WHY_EP && ch.ep == 2);
    u = r;
    u.mesh.on = true, u.mesh.dp = 2, u.mesh.ep = 2, u.mesh.sp = 1, u.mesh.gpus_per_node = 8; /* a mesh's ep */
    choose(&u, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(!ch.sm90 && ch.why == FM_EXPERT_WHY_EP);
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, true, false, &ch); /* not compute capability 9.0 */
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_CUBLAS && ch.why == FM_EXPERT_WHY_DEVICE);
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, false, false, &ch); /* the CPU build */
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_AUTO && ch.why == FM_EXPERT_WHY_NOT_CUDA);
    CHECK(strcmp(fm_expert_choice_form(&ch), "cpu") == 0);
    /* forced: as asked, whatever the table says; sm90 runs only where it serves */
    choose(&r, &c, FM_EXPERT_GEMM_GROUPED, true, true, &ch);
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_GROUPED && ch.why == FM_EXPERT_WHY_FORCED);
    CHECK(strcmp(fm_expert_choice_form(&ch), "grouped") == 0);
    choose(&r, &c, FM_EXPERT_GEMM_CUBLAS, true, true, &ch);
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_CUBLAS && ch.why == FM_EXPERT_WHY_FORCED && ch.projected);
    table(&c, 600e12, 300e12);
    choose(&r, &c, FM_EXPERT_GEMM_SM90, true, true, &ch);
    CHECK(ch.sm90 && ch.gemm == FM_EXPERT_GEMM_SM90 && ch.why == FM_EXPERT_WHY_FORCED);
    choose(&u, &c, FM_EXPERT_GEMM_SM90, true, true, &ch); /* forced beside a mesh's ep: cuBLAS */
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_SM90 && ch.why == FM_EXPERT_WHY_EP);
    u = r;
    u.cfg.hidden_size = 2000;
    choose(&u, &c, FM_EXPERT_GEMM_SM90, true, true, &ch);
    CHECK(!ch.sm90 && ch.gemm == FM_EXPERT_GEMM_SM90 && ch.why == FM_EXPERT_WHY_SHAPE);
    CHECK(strcmp(fm_expert_choice_form(&ch), "cublas") == 0);
}

/* A crossover like the H200's: sm90 faster at 512 rows per expert, cuBLAS at 4,096. */
static void crossover(fm_calib *c) {
    fm_calib_default(c, "cuda");
    c->expert_fwd.n = c->expert_bwd.n = c->expert_fwd_sm90.n = c->expert_bwd_sm90.n = 0;
    fm_calib_add(&c->expert_fwd, 512, 300e12), fm_calib_add(&c->expert_fwd, 4096, 640e12);
    fm_calib_add(&c->expert_bwd, 512, 260e12), fm_calib_add(&c->expert_bwd, 4096, 640e12);
    fm_calib_add(&c->expert_fwd_sm90, 512, 520e12), fm_calib_add(&c->expert_fwd_sm90, 4096, 580e12);
    fm_calib_add(&c->expert_bwd_sm90, 512, 470e12), fm_calib_add(&c->expert_bwd_sm90, 4096, 550e12);
}

static void test_rows_per_expert(void) {
    fm_calib c;
    crossover(&c);
    fm_plan_req r;
    fm_expert_choice ch;
    olmoe_req(&r, 1, 32768); /* unchunked: 4,096 rows per expert */
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(!ch.sm90 && ch.why == FM_EXPERT_WHY_NOT_FASTER && ch.rows_per_expert == 4096);
    r.moe_chunk_tokens = 4096; /* the same run in 4,096-token MoE chunks: 512 rows per expert */
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(ch.sm90 && ch.why == FM_EXPERT_WHY_FASTER && ch.rows_per_expert == 512);
    /* the chunked times count the experts' forward again (the MoE chunk recompute) */
    fm_plan p;
    fm_plan_compute(&r, &p);
    const double F = 2.0 * 32768 * 8 * 3 * 2048 * 1024;
    CHECK_CLOSE(fm_project_expert_s(&r, &p, &c, true), 16 * (2 * F / 520e12 + 2 * F / 470e12), 1e-12);
    fm_plan_req g = r;
    g.grad_accum = 3; /* per step: the micro-batches' sum */
    CHECK_CLOSE(fm_project_expert_s(&g, &p, &c, false), 3 * 16 * (2 * F / 300e12 + 2 * F / 260e12), 1e-12);
}

/* prepare, the chooser, finish: the chooser's projection times each candidate at its faster
 * form, and the projection it returns is the one of the form finish settles on. */
static void test_prepare_fit_finish(void) {
    fm_calib c;
    crossover(&c);
    for (int t = 0; t < 3; t++) {
        const int64_t T = t == 0 ? 4096 : t == 1 ? 32768 : 65536;
        fm_plan_req r;
        olmoe_req(&r, 1, T);
        const int64_t L = r.cfg.num_hidden_layers;
        bool rc[2 * 16];
        CHECK(L == 16);
        memset(rc, 0, sizeof rc);
        r.recompute = rc, r.keep_attention = rc + L;
        const fm_expert_ask a = {FM_EXPERT_GEMM_AUTO, true, true};
        fm_expert_choice_prepare(&r, &a, &c);
        CHECK(r.expert_gemm_auto && !r.expert_sync_free);
        /* an H200's budget, every knob free */
        const fm_choose_opts co = {(size_t)139 << 30, "--mem-budget", FM_HOST_BUDGET_UNLIMITED, "--host-mem-budget", &c,
                                   false, false, false, false, false, false};
        fm_plan p;
        fm_projection pr;
        CHECK(fm_plan_fit(&r, &co, rc, &p, &pr) == FM_OK);
        fm_expert_choice ch;
        fm_expert_choice_finish(&r, &p, &a, &c, &ch);
        CHECK(!r.expert_gemm_auto && r.expert_sync_free == ch.sm90);
        CHECK_MSG(pr.expert_sm90 == ch.sm90, "T %lld: the chooser timed sm90 %d, finish chose %d", (long long)T,
                  (int)pr.expert_sm90, (int)ch.sm90);
        fm_projection again;
        fm_project(&r, &p, &c, &again);
        CHECK_CLOSE(again.step_s, pr.step_s, 1e-12);
        /* the chosen form's time is the projection's expert GEMMs (their forward and backward; the
         * recomputed forwards beside them in the recompute phases) */
        const double chosen = ch.sm90 ? ch.sm90_s : ch.cublas_s;
        if (p.n_recomputed == 0 && r.moe_chunk_tokens <= 0) CHECK_CLOSE(again.sec[FM_PROJ_EXPERTS], chosen, 1e-12);
        else CHECK(again.sec[FM_PROJ_EXPERTS] < chosen);
        if (T == 4096) CHECK(ch.sm90); /* 512 rows per expert */
    }
    /* forced sm90: prepare sets expert_sync_free, no auto */
    fm_plan_req r;
    olmoe_req(&r, 1, 4096);
    const fm_expert_ask f = {FM_EXPERT_GEMM_SM90, true, true};
    fm_expert_choice_prepare(&r, &f, &c);
    CHECK(r.expert_sync_free && !r.expert_gemm_auto);
    /* auto without sm90 curves, or on another device: neither */
    fm_calib n;
    table(&n, 300e12, 0);
    const fm_expert_ask a = {FM_EXPERT_GEMM_AUTO, true, true}, d = {FM_EXPERT_GEMM_AUTO, true, false};
    fm_expert_choice_prepare(&r, &a, &n);
    CHECK(!r.expert_sync_free && !r.expert_gemm_auto);
    fm_expert_choice_prepare(&r, &d, &c);
    CHECK(!r.expert_sync_free && !r.expert_gemm_auto);
    /* the projection under auto keeps --ep on cuBLAS even when sm90 would be faster */
    fm_expert_choice_prepare(&r, &a, &c);
    fm_plan p;
    fm_plan_compute(&r, &p);
    CHECK(fm_project_expert_sm90(&r, &p, &c));
    r.ep = 2;
    CHECK(!fm_project_expert_sm90(&r, &p, &c));
}

static void test_words(void) {
    fm_plan_req r;
    olmoe_req(&r, 1, 4096);
    fm_calib c;
    table(&c, 300e12, 600e12);
    fm_expert_choice ch;
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    char line[600], js[FM_EXPERT_CHOICE_JSON_MAX];
    fm_expert_choice_line(&ch, line, sizeof line);
    char want[200];
    snprintf(want, sizeof want, "expert GEMM: sm90 (auto: projected %.1f ms per step against cuBLAS %.1f ms at 512 rows",
             1e3 * ch.sm90_s, 1e3 * ch.cublas_s);
    CHECK_MSG(strstr(line, want) && strstr(line, "FLATMOE_EXPERT_GEMM forces one"), "%s", line);
    CHECK(fm_expert_choice_json(&ch, js, sizeof js) == FM_OK);
    CHECK_MSG(strstr(js, "\"form\":\"sm90\",\"requested\":\"auto\",\"why\":\"faster\"") && strstr(js, "\"rows_per_expert\":512"),
              "%s", js);
    table(&c, 300e12, 0);
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    fm_expert_choice_line(&ch, line, sizeof line);
    CHECK_MSG(strstr(line, "expert GEMM: cuBLAS (auto: the calibration table has no sm90 curves"), "%s", line);
    CHECK(fm_expert_choice_json(&ch, js, sizeof js) == FM_OK && strstr(js, "\"sm90_s\":null,\"cublas_s\":null"));
    CHECK(fm_expert_choice_json(&ch, js, 10) == FM_ERR_ARG && js[0] == 0);
    choose(&r, &c, FM_EXPERT_GEMM_LOOP, true, true, &ch);
    fm_expert_choice_line(&ch, line, sizeof line);
    CHECK_MSG(strcmp(line, "expert GEMM: loop (FLATMOE_EXPERT_GEMM=loop)") == 0, "%s", line);
}

/* --expert-precision fp8's path (fm_expert_fp8_codes): codes on an sm_90 CUDA run with auto or
 * sm90, else emulated; the form and the line say so. */
static void test_fp8_codes(void) {
    fm_plan_req r;
    olmoe_req(&r, 1, 4096);
    const fm_expert_ask auto90 = {FM_EXPERT_GEMM_AUTO, true, true}, sm90 = {FM_EXPERT_GEMM_SM90, true, true},
                        cub = {FM_EXPERT_GEMM_CUBLAS, true, true}, grp = {FM_EXPERT_GEMM_GROUPED, true, true},
                        other = {FM_EXPERT_GEMM_AUTO, true, false}, cpu = {FM_EXPERT_GEMM_AUTO, false, false};
    CHECK(!fm_expert_fp8_codes(&r, &auto90)); /* no fp8 */
    r.expert_fp8 = true;
    CHECK(fm_expert_fp8_codes(&r, &auto90) && fm_expert_fp8_codes(&r, &sm90));
    CHECK(!fm_expert_fp8_codes(&r, &cub) && !fm_expert_fp8_codes(&r, &grp) && !fm_expert_fp8_codes(&r, &other));
    CHECK(!fm_expert_fp8_codes(&r, &cpu));
    const fm_expert_ask cpu_codes = {FM_EXPERT_GEMM_AUTO, false, false, true}; /* the test hook FLATMOE_TEST_FP8_CODES=1 */
    CHECK(fm_expert_fp8_codes(&r, &cpu_codes));
    r.ep = 2; /* under --ep the owner's E/ep experts over ep x B T x min(k, E/ep) rows */
    CHECK(fm_expert_fp8_codes(&r, &auto90) && fm_expert_fp8_codes(&r, &cpu_codes));
    CHECK(!fm_expert_fp8_codes(&r, &cub) && !fm_expert_fp8_codes(&r, &cpu));
    r.ep = 1;
    r.cfg.moe_intermediate_size = 1000; /* not a multiple of 128 */
    CHECK(!fm_expert_fp8_codes(&r, &auto90));
    r.cfg.moe_intermediate_size = 1024;
    r.expert_fp8_codes = fm_expert_fp8_codes(&r, &auto90);
    fm_calib c;
    table(&c, 300e12, 600e12);
    fm_expert_choice ch;
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(ch.fp8_codes && strcmp(fm_expert_choice_form(&ch), "fp8-sm90") == 0 && !ch.sm90);
    char why[400];
    fm_expert_choice_why(&ch, why, sizeof why);
    CHECK_MSG(strstr(why, "E4M3 codes") != NULL, "%s", why);
    r.expert_fp8_codes = false;
    choose(&r, &c, FM_EXPERT_GEMM_AUTO, true, true, &ch);
    CHECK(!ch.fp8_codes && strcmp(fm_expert_choice_form(&ch), "cublas") == 0);
}

int main(void) {
    test_rule();
    test_fp8_codes();
    test_rows_per_expert();
    test_prepare_fit_finish();
    test_words();
    return fm_test_finish();
}
