/* Backend options (fm_backend_opts.h) and the plan-facing workspace descriptor (fm_backend_plan.h):
 * defaults, the FLATMOE_* variables' values and their errors, the JSON fragment, the CPU init taking the
 * options, and the workspace bytes against the figures the formulas give by hand. */
#include <stdlib.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "backend/fm_backend_default.h"
#include "backend/fm_backend_opts.h"
#include "backend/fm_backend_plan.h"
#include "fm_test.h"

static const char *const k_vars[] = {"FLATMOE_PROFILE", "FLATMOE_ATTENTION", "FLATMOE_ATTENTION_VERBOSE",
                                     "FLATMOE_EXPERT_GEMM", "FLATMOE_FP8_GEMM", "FLATMOE_UPDATE_BLOCKS"};

static void clear_env(void) {
    for (size_t i = 0; i < sizeof k_vars / sizeof k_vars[0]; i++) unsetenv(k_vars[i]);
}

static void test_defaults(void) {
    const fm_backend_opts o = fm_backend_opts_default();
    CHECK(o.threads == 0 && o.max_head_dim == 128 && o.tile_q == 0 && o.tile_kv == 0 && o.gpu_workspace == 0);
    CHECK(o.attention == FM_ATTENTION_AUTO && !o.attention_verbose && o.expert_gemm == FM_EXPERT_GEMM_AUTO);
    CHECK(!o.profile && o.update_blocks == 0 && o.fp8_gemm == FM_FP8_GEMM_V5);
    CHECK(strcmp(fm_fp8_gemm_name(FM_FP8_GEMM_V5C), "v5c") == 0 && strcmp(fm_fp8_gemm_name((fm_fp8_gemm)9), "?") == 0);
    CHECK(strcmp(fm_attention_path_name(FM_ATTENTION_FALLBACK), "fallback") == 0);
    CHECK(strcmp(fm_expert_gemm_name(FM_EXPERT_GEMM_GROUPED), "grouped") == 0);
    CHECK(strcmp(fm_expert_gemm_name((fm_expert_gemm)9), "?") == 0);
}

/* Maps var=value over the defaults (fm_backend_opts_set, as the CLI's fm_backend_opts_from_env
 * does for each variable); *o the result. */
static fm_status from(const char *var, const char *value, fm_backend_opts *o) {
    *o = fm_backend_opts_default();
    return fm_backend_opts_set(o, var, value);
}

static void test_from_env(void) {
    fm_backend_opts o;
    o = fm_backend_opts_default();
    o.profile = true; /* unset (NULL) or empty values keep the fields */
    o.expert_gemm = FM_EXPERT_GEMM_LOOP;
    for (int i = 0; fm_backend_opts_vars[i]; i++) {
        CHECK(fm_backend_opts_set(&o, fm_backend_opts_vars[i], NULL) == FM_OK);
        CHECK(fm_backend_opts_set(&o, fm_backend_opts_vars[i], "") == FM_OK);
    }
    CHECK(o.profile && o.expert_gemm == FM_EXPERT_GEMM_LOOP && o.ep_schedule == 0 && !o.cpu_fp8_codes && !o.calib_dir);
    CHECK(fm_backend_opts_set(&o, "FLATMOE_NOPE", "1") == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "unknown variable FLATMOE_NOPE"), "%s", fm_errmsg());

    CHECK(from("FLATMOE_PROFILE", "1", &o) == FM_OK && o.profile);
    CHECK(from("FLATMOE_PROFILE", "yes", &o) == FM_OK && o.profile);
    CHECK(from("FLATMOE_PROFILE", "0", &o) == FM_OK && !o.profile);
    CHECK(from("FLATMOE_PROFILE", "", &o) == FM_OK && !o.profile);
    CHECK(from("FLATMOE_PROFILE", "maybe", &o) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "FLATMOE_PROFILE=maybe") && strstr(fm_errmsg(), "0 or 1"), "%s", fm_errmsg());

    CHECK(from("FLATMOE_ATTENTION", "cudnn", &o) == FM_OK && o.attention == FM_ATTENTION_CUDNN);
    CHECK(from("FLATMOE_ATTENTION", "fallback", &o) == FM_OK && o.attention == FM_ATTENTION_FALLBACK);
    CHECK(from("FLATMOE_ATTENTION", "flash", &o) == FM_OK && o.attention == FM_ATTENTION_FALLBACK);
    CHECK(from("FLATMOE_ATTENTION", "ours", &o) == FM_OK && o.attention == FM_ATTENTION_FALLBACK);
    CHECK(from("FLATMOE_ATTENTION", "auto", &o) == FM_OK && o.attention == FM_ATTENTION_AUTO);
    CHECK(from("FLATMOE_ATTENTION", "cuDNN", &o) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "FLATMOE_ATTENTION=cuDNN") && strstr(fm_errmsg(), "auto, cudnn or fallback"), "%s",
              fm_errmsg());

    CHECK(from("FLATMOE_ATTENTION_VERBOSE", "1", &o) == FM_OK && o.attention_verbose);
    CHECK(from("FLATMOE_ATTENTION_VERBOSE", "2", &o) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "FLATMOE_ATTENTION_VERBOSE=2"), "%s", fm_errmsg());

    CHECK(from("FLATMOE_EXPERT_GEMM", "loop", &o) == FM_OK && o.expert_gemm == FM_EXPERT_GEMM_LOOP);
    CHECK(from("FLATMOE_EXPERT_GEMM", "grouped", &o) == FM_OK && o.expert_gemm == FM_EXPERT_GEMM_GROUPED);
    CHECK(from("FLATMOE_EXPERT_GEMM", "sm90", &o) == FM_OK && o.expert_gemm == FM_EXPERT_GEMM_SM90);
    CHECK(strcmp(fm_expert_gemm_name(FM_EXPERT_GEMM_SM90), "sm90") == 0);
    CHECK(from("FLATMOE_EXPERT_GEMM", "cublas", &o) == FM_OK && o.expert_gemm == FM_EXPERT_GEMM_CUBLAS);
    CHECK(strcmp(fm_expert_gemm_name(FM_EXPERT_GEMM_CUBLAS), "cublas") == 0);
    CHECK(from("FLATMOE_EXPERT_GEMM", "auto", &o) == FM_OK && o.expert_gemm == FM_EXPERT_GEMM_AUTO);
    CHECK(from("FLATMOE_EXPERT_GEMM", "batched", &o) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "FLATMOE_EXPERT_GEMM=batched") &&
                  strstr(fm_errmsg(), "auto, cublas, loop, grouped or sm90"), "%s", fm_errmsg());

    CHECK(from("FLATMOE_FP8_GEMM", "v5", &o) == FM_OK && o.fp8_gemm == FM_FP8_GEMM_V5);
    CHECK(from("FLATMOE_FP8_GEMM", "v5a", &o) == FM_OK && o.fp8_gemm == FM_FP8_GEMM_V5A);
    CHECK(from("FLATMOE_FP8_GEMM", "v5b", &o) == FM_OK && o.fp8_gemm == FM_FP8_GEMM_V5B);
    CHECK(from("FLATMOE_FP8_GEMM", "v5c", &o) == FM_OK && o.fp8_gemm == FM_FP8_GEMM_V5C);
    CHECK(from("FLATMOE_FP8_GEMM", "v3", &o) == FM_OK && o.fp8_gemm == FM_FP8_GEMM_V3);
    CHECK(from("FLATMOE_FP8_GEMM", "", &o) == FM_OK && o.fp8_gemm == FM_FP8_GEMM_V5);
    CHECK(from("FLATMOE_FP8_GEMM", "v4", &o) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "FLATMOE_FP8_GEMM=v4") && strstr(fm_errmsg(), "v3, v5, v5a, v5b or v5c"), "%s",
              fm_errmsg());

    CHECK(from("FLATMOE_UPDATE_BLOCKS", "264", &o) == FM_OK && o.update_blocks == 264);
    CHECK(from("FLATMOE_UPDATE_BLOCKS", "0", &o) == FM_OK && o.update_blocks == 0);
    CHECK(from("FLATMOE_UPDATE_BLOCKS", "1048576", &o) == FM_OK && o.update_blocks == 1048576);
    const char *bad[] = {"-1", "1048577", "12x", "x", " 5"};
    for (int i = 0; i < 5; i++) {
        CHECK(from("FLATMOE_UPDATE_BLOCKS", bad[i], &o) == FM_ERR_ARG && o.update_blocks == 0);
        CHECK_MSG(strstr(fm_errmsg(), "FLATMOE_UPDATE_BLOCKS=") && strstr(fm_errmsg(), "[0, 1048576]"), "%s",
                  fm_errmsg());
    }

    /* the EP chunk schedule: the operator's enum values; another word -1, not an error here (the
     * operator refuses it at its first chunk on every rank, tests/test_moe_ep.c) */
    CHECK(from("FLATMOE_EP_SCHEDULE", "auto", &o) == FM_OK && o.ep_schedule == 0);
    CHECK(from("FLATMOE_EP_SCHEDULE", "serial", &o) == FM_OK && o.ep_schedule == 1);
    CHECK(from("FLATMOE_EP_SCHEDULE", "pipelined", &o) == FM_OK && o.ep_schedule == 2);
    CHECK(from("FLATMOE_EP_SCHEDULE", "overlap", &o) == FM_OK && o.ep_schedule == -1);

    CHECK(from("FLATMOE_TEST_FP8_CODES", "1", &o) == FM_OK && o.cpu_fp8_codes);
    CHECK(from("FLATMOE_TEST_FP8_CODES", "0", &o) == FM_OK && !o.cpu_fp8_codes);
    CHECK(from("FLATMOE_TEST_FP8_CODES", "yes", &o) == FM_ERR_ARG && !o.cpu_fp8_codes);
    CHECK_MSG(strstr(fm_errmsg(), "FLATMOE_TEST_FP8_CODES=yes: expected 1"), "%s", fm_errmsg());

    CHECK(o.vmm && from("FLATMOE_CUDA_VMM", "0", &o) == FM_OK && !o.vmm);
    CHECK(from("FLATMOE_CUDA_VMM", "on", &o) == FM_OK && o.vmm);
    CHECK(from("FLATMOE_CUDA_VMM", "2", &o) == FM_ERR_ARG && o.vmm);

    const char dir[] = "/tmp/calib";
    CHECK(from("FLATMOE_CALIB_DIR", dir, &o) == FM_OK && o.calib_dir == dir); /* kept, not copied */
}

static void test_json(void) {
    char buf[FM_BACKEND_OPTS_JSON_MAX];
    fm_backend_opts o = fm_backend_opts_default();
    CHECK(fm_backend_opts_json(&o, buf, sizeof buf) == FM_OK);
    CHECK_MSG(strcmp(buf, "{\"threads\":0,\"max_head_dim\":128,\"tile_q\":0,\"tile_kv\":0,\"gpu_workspace\":0,"
                          "\"attention\":\"auto\",\"attention_verbose\":false,\"expert_gemm\":\"auto\","
                          "\"fp8_gemm\":\"v5\",\"profile\":false,\"update_blocks\":0,\"vmm\":true}") == 0,
              "%s", buf);
    /* the widest values still fit the documented maximum */
    o.threads = -2147483647 - 1;
    o.max_head_dim = o.tile_q = o.tile_kv = INT64_MIN;
    o.gpu_workspace = SIZE_MAX;
    o.attention = FM_ATTENTION_FALLBACK;
    o.attention_verbose = o.profile = true;
    o.expert_gemm = FM_EXPERT_GEMM_GROUPED;
    o.fp8_gemm = FM_FP8_GEMM_V5C;
    o.update_blocks = -2147483647 - 1;
    o.vmm = false;
    CHECK_MSG(fm_backend_opts_json(&o, buf, sizeof buf) == FM_OK, "%s", fm_errmsg());
    CHECK(strstr(buf, "\"attention\":\"fallback\",\"attention_verbose\":true,\"expert_gemm\":\"grouped\","
                      "\"fp8_gemm\":\"v5c\",\"profile\":true,\"update_blocks\":-2147483648,\"vmm\":false}") != NULL);
    char small[16] = "x";
    CHECK(fm_backend_opts_json(&o, small, sizeof small) == FM_ERR_ARG && small[0] == '\0');
}

static void test_cpu_init(void) {
    fm_backend b;
    fm_backend_opts o = fm_backend_opts_default();
    double ms[FM_PHASE_COUNT];
    o.threads = 1;
    o.max_head_dim = 64;
    CHECK(fm_cpu_backend_init_opts(&b, &o) == FM_OK);
    CHECK(!b.ops->prof_collect(b.ctx, ms)); /* profiling off */
    fm_cpu_backend_free(&b);
    o.profile = true;
    CHECK(fm_cpu_backend_init_opts(&b, &o) == FM_OK);
    CHECK(b.ops->prof_collect(b.ctx, ms));
    fm_cpu_backend_free(&b);
    CHECK(fm_cpu_backend_init_opts(&b, NULL) == FM_OK); /* the defaults */
    fm_cpu_backend_free(&b);
    o.tile_q = -1;
    CHECK(fm_cpu_backend_init_opts(&b, &o) == FM_ERR_ARG);
    o.tile_q = 4097;
    CHECK(fm_cpu_backend_init_opts(&b, &o) == FM_ERR_ARG);
    o.tile_q = 32;
    o.threads = -1;
    CHECK(fm_cpu_backend_init_opts(&b, &o) == FM_ERR_ARG);

    /* the default backend's old entry points read no environment (the CLI maps FLATMOE_* itself) */
    clear_env();
    setenv("FLATMOE_PROFILE", "1", 1);
    setenv("FLATMOE_EXPERT_GEMM", "fast", 1);
    CHECK(fm_backend_default_init(&b, 1, 64) == FM_OK);
    CHECK(!b.ops->prof_collect(b.ctx, ms));
    fm_backend_default_free(&b);
    CHECK(fm_backend_default_init_tiles(&b, 1, 64, 0, -3, 0) == FM_OK); /* <= 0: the default tile */
    CHECK(!b.ops->prof_collect(b.ctx, ms));
    fm_backend_default_free(&b);
    clear_env();
    o = fm_backend_opts_default(); /* the options say it */
    o.threads = 1, o.max_head_dim = 64, o.profile = true;
    CHECK(fm_backend_default_init_opts(&b, &o) == FM_OK);
    CHECK(b.ops->prof_collect(b.ctx, ms));
    fm_backend_default_free(&b);
}

static void test_plan_workspaces(void) {
    const size_t MiB = (size_t)1 << 20;
    fm_backend_plan_info w;
    /* OLMoE's attention (16 heads of 128, no GQA), one sequence */
    fm_backend_plan_req r = {.B = 1, .T = 4096, .nh = 16, .nkv = 16, .hd = 128, .threads = 2};
    fm_backend_plan_workspaces(FM_BACKEND_KIND_CUDA, &r, &w);
    CHECK(w.known && w.cudnn_workspace == 64 * MiB && w.lt_workspace == 32 * MiB && w.scratch == 16 * MiB);
    CHECK(w.total == (64 + 32 + 16) * MiB && w.memory_reserve == 1536 * MiB && w.attention_tiles == 0);
    /* 16K: dQ accumulator 16*16384*128*4 = 128 MiB, row sums 1 MiB, + 1 MiB = 130 MiB */
    r.T = 16384;
    fm_backend_plan_workspaces(FM_BACKEND_KIND_CUDA, &r, &w);
    CHECK(w.cudnn_workspace == 130 * MiB && w.total == (130 + 48) * MiB);
    CHECK(w.cudnn_workspace == fm_cuda_cudnn_workspace_auto(1, 16384, 16, 16, 128));
    r.T = 65536; /* 512 + 4 + 1 */
    fm_backend_plan_workspaces(FM_BACKEND_KIND_CUDA, &r, &w);
    CHECK(w.cudnn_workspace == 517 * MiB);
    r.gpu_workspace = 256 * MiB; /* as given */
    fm_backend_plan_workspaces(FM_BACKEND_KIND_CUDA, &r, &w);
    CHECK(w.cudnn_workspace == 256 * MiB && w.total == (256 + 48) * MiB);
    CHECK(w.total == fm_cuda_backend_workspace_bytes_for(256 * MiB));
    CHECK(fm_cuda_backend_workspace_bytes_for(0) == (64 + 48) * MiB);
    /* chunks at 64K tokens: the whole backward needs 517 MiB; 300 MiB takes 8 of the 16 heads
     * (256 + 2 + 1 = 259 MiB); two sequences in 600 MiB go one at a time */
    int64_t Bc = 0, kc = 0;
    CHECK(fm_cuda_attention_pick_chunks(300 * MiB, true, 1, 65536, 16, 16, 128, &Bc, &kc) && Bc == 1 && kc == 8);
    CHECK(fm_cuda_attention_pick_chunks(600 * MiB, true, 2, 65536, 16, 16, 128, &Bc, &kc) && Bc == 1 && kc == 16);
    CHECK(!fm_cuda_attention_pick_chunks(MiB, true, 1, 65536, 16, 16, 128, &Bc, &kc));
    CHECK(fm_cuda_attention_chunk_need(false, 4, 16, 65536, 128, 1) == 64 * 1024);

    /* the CPU: every thread's tiles, as the CPU backend allocates them */
    r.tile_q = 0, r.tile_kv = 32;
    fm_backend_plan_workspaces(FM_BACKEND_KIND_CPU, &r, &w);
    CHECK(w.known && w.cudnn_workspace == 0 && w.memory_reserve == 0);
    CHECK(w.attention_tiles == fm_cpu_backend_scratch_bytes_tiles(2, 128, 64, 32) && w.total == w.attention_tiles);
    CHECK(w.total > 0);
}

/* The sm90 expert GEMM's served shapes, as the planner and the CUDA backend both ask them. */
static void test_sm90_serves(void) {
    CHECK(fm_cuda_sm90_expert_gemm_serves(64, 2048, 1024, 4096 * 8));  /* OLMoE-1B-7B */
    CHECK(fm_cuda_sm90_expert_gemm_serves(128, 2048, 768, 32768 * 8)); /* Qwen3-30B-A3B */
    CHECK(fm_cuda_sm90_expert_gemm_serves(8, 4096, 14336, 65536 * 2)); /* Mixtral-8x7B */
    CHECK(!fm_cuda_sm90_expert_gemm_serves(8, 64, 32, 100));           /* tiny test configs: cuBLAS */
    CHECK(!fm_cuda_sm90_expert_gemm_serves(64, 2048, 1000, 100));      /* I not a multiple of 128 */
    CHECK(!fm_cuda_sm90_expert_gemm_serves(257, 2048, 1024, 100));     /* more experts than the kernel's 256 */
    CHECK(!fm_cuda_sm90_expert_gemm_serves(64, 2048, 1024, (int64_t)1 << 31)); /* TMA rows are int32 */
    CHECK(fm_cuda_sm90_expert_gemm_serves(64, 2048, 1024, 0));          /* no rows: nothing to launch */
}

int main(void) {
    test_defaults();
    test_from_env();
    test_json();
    test_sm90_serves();
    test_cpu_init();
    test_plan_workspaces();
    return fm_test_finish();
}
