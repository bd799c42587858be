/* The run spec (run/fm_run_spec.h): the flag table's defaults equal fm_train_opts_default's (the
 * two places a default could drift), fm_spec_set by name (values, given bits, errors naming the
 * flag and value), the trainer options' view of "not given", the state.json round trip with its
 * override and error paths, and fm_spec_check's refusals shared by train and plan. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fm_test.h"
#include "core/fm_log.h"
#include "run/fm_run_spec.h"
#include "run/fm_spec_check.h"
#include "run/fm_spec_resume.h"

static char g_log[4096]; /* the lines fm_log gave, appended */

static void log_sink(void *user, fm_log_level level, const char *text) {
    (void)user, (void)level;
    strncat(g_log, text, sizeof g_log - strlen(g_log) - 1);
}

/* Every train row with a default sets what fm_train_opts_default sets (a library user of
 * fm_train and the CLI start from the same run). */
static void test_defaults(void) {
    static fm_run_spec s;
    fm_spec_default(&s, FM_CMD_TRAIN);
    fm_train_opts d;
    fm_train_opts_default(&d);
    const fm_train_opts o = fm_spec_train_opts(&s);
    CHECK(o.seq_len == d.seq_len && o.micro_batch == d.micro_batch && o.grad_accum == d.grad_accum);
    CHECK(o.steps == d.steps && o.lr == d.lr && o.min_lr == d.min_lr && o.warmup == d.warmup);
    CHECK(o.weight_decay == d.weight_decay && o.grad_clip == d.grad_clip && o.beta1 == d.beta1 && o.beta2 == d.beta2);
    CHECK(o.seed == d.seed && o.eval_every == d.eval_every && o.eval_batches == d.eval_batches);
    CHECK(o.save_every == d.save_every && o.save_every_minutes == d.save_every_minutes && o.val_fraction == d.val_fraction);
    CHECK(!strcmp(o.out_dir, d.out_dir) && o.ep == d.ep && o.sp == d.sp && o.llep_lambda == d.llep_lambda);
    CHECK(o.moe_chunk_tokens == -1 && o.ce_block_tokens == -1 && o.ce_block_vocab == -1); /* chosen */
    CHECK(!o.lr_given && !o.host_mem_budget_given && !fm_spec_given(&s, "lr"));
    fm_spec_free(&s);
    /* eval's rows: the trained length (0), 8 windows; plan's: --seq-len required (0), 1 sequence */
    fm_spec_default(&s, FM_CMD_EVAL);
    CHECK(s.train.seq_len == 0 && s.train.micro_batch == 8);
    fm_spec_default(&s, FM_CMD_PLAN);
    CHECK(s.train.seq_len == 0 && s.train.micro_batch == 1);
    CHECK(fm_spec_check(&s) != FM_OK && strstr(fm_errmsg(), "--config is required"));
    /* prepare, calibrate and report: their own structs, from their own rows (--out is three rows) */
    fm_spec_default(&s, FM_CMD_PREPARE);
    CHECK(s.prepare.shard_tokens == 100000000 && !strcmp(s.prepare.format, "auto") && !s.prepare.tokenizer);
    CHECK(fm_spec_set(&s, "input", "a.txt") == FM_OK && fm_spec_set(&s, "input", "b.jsonl") == FM_OK);
    CHECK(s.prepare.n_inputs == 2 && !strcmp(s.prepare.inputs[1], "b.jsonl") && s.train.n_data == 0);
    CHECK(fm_spec_set(&s, "out", "shards/x") == FM_OK && !strcmp(s.prepare.out, "shards/x"));
    CHECK(fm_spec_set(&s, "lr", "1e-3") == FM_ERR_ARG); /* not a flag of prepare */
    fm_spec_free(&s);
    fm_spec_default(&s, FM_CMD_CALIBRATE);
    CHECK(!s.calibrate.out && !s.calibrate.backend && !s.calibrate.quick && s.calibrate.threads == 0);
    CHECK(fm_spec_set(&s, "threads", "x") == FM_ERR_ARG && strstr(fm_errmsg(), "'--threads' expects an integer"));
    fm_spec_free(&s);
    fm_spec_default(&s, FM_CMD_REPORT);
    CHECK(!strcmp(s.report.format, "png") && !s.report.out && !fm_spec_find("input", FM_CMD_REPORT));
}

static void test_set_by_name(void) {
    static fm_run_spec s;
    fm_spec_default(&s, FM_CMD_TRAIN);
    CHECK(fm_spec_set(&s, "lr", "1e-5") == FM_OK && s.train.lr == 1e-5 && fm_spec_given(&s, "lr"));
    CHECK(fm_spec_train_opts(&s).lr_given);
    CHECK(fm_spec_set(&s, "mem-budget", "2GiB") == FM_OK && s.train.mem_budget == ((size_t)2 << 30));
    CHECK(fm_spec_set(&s, "expert-precision", "fp8") == FM_OK && s.train.expert_fp8);
    CHECK(fm_spec_set(&s, "vocab-parallel", "ring") == FM_OK && s.train.vocab_parallel == FM_VOCAB_PARALLEL_RING);
    CHECK(fm_spec_set(&s, "bf16-moments", "true") == FM_OK && s.train.bf16_moments);
    CHECK(fm_spec_set(&s, "data", "a.txt") == FM_OK && fm_spec_set(&s, "data", "b.txt") == FM_OK && s.train.n_data == 2);
    const fm_train_opts o = fm_spec_train_opts(&s);
    CHECK(o.data[1] && !strcmp(o.data[1], "b.txt") && !o.val_data);
    CHECK(fm_spec_set(&s, "moe-chunk-tokens", "0") == FM_OK && fm_spec_train_opts(&s).moe_chunk_tokens == 0);
    CHECK(fm_spec_set(&s, "lr", "fast") == FM_ERR_ARG && strstr(fm_errmsg(), "'--lr' expects a finite number, found 'fast'"));
    CHECK(fm_spec_set(&s, "lr", "inf") == FM_ERR_ARG);
    CHECK(fm_spec_set(&s, "seed", "-1") == FM_ERR_ARG && strstr(fm_errmsg(), "a non-negative integer"));
    CHECK(fm_spec_set(&s, "vocab-parallel", "tensor") == FM_ERR_ARG &&
          strstr(fm_errmsg(), "--vocab-parallel: expected off or ring, found 'tensor'"));
    CHECK(fm_spec_set(&s, "comm", "gloo") == FM_ERR_ARG && strstr(fm_errmsg(), "expected auto, mpi or nccl"));
    CHECK(fm_spec_set(&s, "device-mem", "1GiB") == FM_ERR_ARG); /* a plan flag, not train's */
    CHECK(fm_spec_set(&s, "learning-rate", "1") == FM_ERR_ARG && strstr(fm_errmsg(), "'learning-rate'"));
    char d[200];
    fm_spec_default_text(fm_spec_find("steps", FM_CMD_TRAIN), d, sizeof d);
    CHECK(!strcmp(d, "1000; with --resume, the run's own total"));
    fm_spec_free(&s);
}

/* The spec to JSON and back: the flags given travel, the others stay defaults; a flag given
 * again overrides with a line; a bad value names the file, field and value. */
static void test_state_json(void) {
    static fm_run_spec a, b;
    fm_spec_default(&a, FM_CMD_TRAIN);
    CHECK(fm_spec_set(&a, "data", "x.txt") == FM_OK && fm_spec_set(&a, "eval-every", "2") == FM_OK);
    CHECK(fm_spec_set(&a, "lr", "0.003") == FM_OK && fm_spec_set(&a, "exit-after", "3") == FM_OK);
    CHECK(fm_spec_set(&a, "llep-lambda", "1.25") == FM_OK && fm_spec_set(&a, "seed", "18446744073709551615") == FM_OK);
    char *js = fm_spec_to_json(&a);
    CHECK(js && strstr(js, "\"eval-every\":2") && !strstr(js, "exit-after") && !strstr(js, "save-every"));
    fm_log_set(log_sink, NULL);
    fm_spec_default(&b, FM_CMD_TRAIN);
    CHECK(fm_spec_set(&b, "eval-every", "5") == FM_OK);
    g_log[0] = 0;
    CHECK(fm_spec_restore_json(&b, js, "state.json", true) == FM_OK);
    CHECK(strstr(g_log, "--eval-every 5 overrides the run's 2") != NULL);
    CHECK(b.train.eval_every == 5 && b.train.n_data == 1 && !strcmp(b.data_files[0], "x.txt"));
    CHECK(b.train.llep_lambda == 1.25 && b.train.seed == UINT64_MAX && b.train.exit_after == 0);
    /* --lr is fm_train's to restore from the state's own schedule (with its line): left out here */
    CHECK(!fm_spec_given(&b, "lr") && !fm_spec_train_opts(&b).lr_given);
    fm_spec_free(&b);
    fm_spec_default(&b, FM_CMD_TRAIN);
    CHECK(fm_spec_restore_json(&b, "{\"eval-every\": \"often\"}", "run/step_000002/state.json", false) == FM_ERR_FORMAT);
    CHECK(strstr(fm_errmsg(), "run/step_000002/state.json: \"spec\" field \"eval-every\" has the value 'often'") != NULL);
    /* a number past int64 is refused as text, not converted (an undefined cast before issue 27) */
    CHECK(fm_spec_restore_json(&b, "{\"eval-every\": 1e300}", "s.json", false) == FM_ERR_FORMAT &&
          strstr(fm_errmsg(), "\"eval-every\" has the value '1.0000000000000001e+300'"));
    CHECK(fm_spec_restore_json(&b, "{\"eval-every\": -1e19}", "s.json", false) == FM_ERR_FORMAT);
    CHECK(fm_spec_restore_json(&b, "{\"colour\": 1}", "s.json", false) == FM_ERR_FORMAT &&
          strstr(fm_errmsg(), "\"colour\" is not a flag of train"));
    CHECK(fm_spec_restore_json(&b, "{\"data\": 3}", "s.json", false) == FM_ERR_FORMAT &&
          strstr(fm_errmsg(), "expected a list of file names"));
    fm_log_set(fm_log_stdio, NULL);
    free(js);
    fm_spec_free(&a);
    fm_spec_free(&b);
}

/* One rule, two commands: the same refusal and message from train's and plan's spec. */
static void test_check_shared(void) {
    static fm_run_spec t, p;
    fm_spec_default(&t, FM_CMD_TRAIN);
    fm_spec_default(&p, FM_CMD_PLAN);
    CHECK(fm_spec_set(&p, "config", "c.json") == FM_OK && fm_spec_set(&p, "seq-len", "64") == FM_OK);
    const char *pairs[][2] = {{"zero", "1"}, {"offload-optimizer", "true"}};
    for (int i = 0; i < 2; i++) {
        CHECK(fm_spec_set(&t, pairs[i][0], pairs[i][1]) == FM_OK && fm_spec_set(&p, pairs[i][0], pairs[i][1]) == FM_OK);
    }
    char mt[600], mp[600];
    CHECK(fm_spec_check(&t) == FM_ERR_ARG);
    snprintf(mt, sizeof mt, "%s", fm_errmsg());
    CHECK(fm_spec_check(&p) == FM_ERR_ARG);
    snprintf(mp, sizeof mp, "%s", fm_errmsg());
    CHECK(!strcmp(mt, mp) && strstr(mt, "--zero 1 and --offload-optimizer do not go together"));
    fm_spec_free(&t);
    fm_spec_free(&p);
}

int main(void) {
    test_defaults();
    test_set_by_name();
    test_state_json();
    test_check_shared();
    return fm_test_finish();
}
