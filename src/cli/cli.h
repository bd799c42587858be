/* flatmoe command line: what the command files share. Every flag is --name VALUE or
 * --name=VALUE; unknown flags are errors. Exit codes: 0 success, 1 a failure of the work,
 * 2 a usage error (bad flag, or FM_ERR_ARG from the library). */
#ifndef FM_CLI_H
#define FM_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/fm_core.h"
#include "backend/fm_backend_default.h"
#include "backend/fm_backend_opts.h"
#include "core/fm_test_hooks.h"
#include "train/fm_threads.h"
#include "run/fm_run_spec.h"
#include "tok/fm_tokenizer.h"

/* Parses argv[0..argc) of `flatmoe cmd` into the run spec s (made by fm_spec_default for the
 * command) through the flag table (run/fm_spec_flags.c): --name VALUE and --name=VALUE, file
 * lists up to the next --flag, the nearest flag suggested for an unknown one. Returns 0 on
 * success, 1 if help was printed (--help or -h: "usage: flatmoe cmd synopsis" and one line per
 * flag, its default from the table), 2 on a usage error (message printed to stderr). */
int cli_parse_spec(const char *cmd, const char *synopsis, int argc, char **argv, fm_run_spec *s);
/* Prints `flatmoe cmd`'s help to stdout: "usage: flatmoe cmd synopsis", then one line per row of
 * the flag table whose commands include cmd_bit (FM_CMD_*), its default from the table, then
 * --help. Never fails. */
void cli_print_spec_help(const char *cmd, unsigned cmd_bit, const char *synopsis);

/* Prints "flatmoe cmd: <fmt with arg>" and the --help hint to stderr; returns 2. */
int cli_usage_error(const char *cmd, const char *fmt, const char *arg);

/* Prints "flatmoe cmd: error: <fm_errmsg()>" to stderr (after flushing stdout); returns 2 for
 * FM_ERR_ARG, else 1. */
int cli_fail(const char *cmd, fm_status s);

/* --ckpt: a checkpoint folder (it holds model.safetensors) or a run folder (its latest step_*
 * checkpoint), copied to out[cap]. Errors: those of fm_ckpt_find_latest, with a message naming
 * both readings. */
fm_status cli_resolve_ckpt(const char *dir, char *out, size_t cap);
/* Refuses a tokenizer that does not fit the model (cli_tok_check.c): tok->vocab_size (1 + its
 * largest id) above model_vocab (the config's vocab_size; model_path names the model in the
 * message) or below 90% of it (a model pads its vocabulary by a few percent at most), or, when
 * own_dir is not NULL and holds a tokenizer.json (the checkpoint's own), a
 * vocabulary size different from that one's. Errors: FM_ERR_ARG naming both sizes and the fix;
 * those of fm_tokenizer_load for own_dir's tokenizer. */
fm_status cli_tokenizer_fits(const fm_tokenizer *tok, int64_t model_vocab, const char *model_path, const char *own_dir);
/* Levenshtein distance of a and b (insert, delete, substitute: 1 each; names up to 63 bytes). */
int cli_edit_distance(const char *a, const char *b);

/* ---- the environment (cli_env.c): read here, handed down as values ---- */

/* Fills *h from the FLATMOE_TEST_* variables (unset or empty: every hook off):
 *   FLATMOE_TEST_FORCE_ROUTE   FIRST or FIRST:PCT        -> force_route, force_first, force_percent
 *   FLATMOE_TEST_SIGNAL_AFTER  RANK:STEP (integers >= 0) -> signal_after, signal_rank, signal_step
 *   FLATMOE_TEST_CKPT_CHUNK    N >= 1                    -> ckpt_chunk_elems
 *   FLATMOE_TEST_CKPT_RESAVE   0|1                       -> ckpt_resave
 * (FLATMOE_TEST_FP8_CODES is a backend option: fm_backend_opts_from_env below.)
 * Errors: FM_ERR_ARG naming the variable, its value and the form expected. */
fm_status cli_test_hooks_from_env(fm_test_hooks *h);

/* Sets the fields of *o the FLATMOE_* variables name (fm_backend_opts_vars: FLATMOE_PROFILE,
 * FLATMOE_ATTENTION, FLATMOE_ATTENTION_VERBOSE, FLATMOE_EXPERT_GEMM, FLATMOE_FP8_GEMM,
 * FLATMOE_UPDATE_BLOCKS, FLATMOE_EP_SCHEDULE, FLATMOE_TEST_FP8_CODES, FLATMOE_CALIB_DIR), each
 * value parsed by fm_backend_opts_set; unset or empty ones keep the field. Errors: FM_ERR_ARG
 * naming the variable, the value found and the values accepted (o is then partly updated). */
fm_status fm_backend_opts_from_env(fm_backend_opts *o);

/* This build's backend (fm_backend_default_init_opts) with the defaults, the FLATMOE_* variables
 * over them (fm_backend_opts_from_env), then threads and max_head_dim: what `sample` and `eval`
 * create. Errors: those of fm_backend_opts_from_env and of the init. */
fm_status cli_backend_default_init(fm_backend *b, int threads, int64_t max_head_dim);

/* OMP_NUM_THREADS and the node's rank count (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS,
 * SLURM_NTASKS_PER_NODE) for the thread choice (train/fm_threads.h); values that are not positive
 * integers are ignored, as before (never fails). */
fm_threads_env cli_threads_env(void);

/* Hands comm/ the launcher's variables (fm_comm_env_names: rank and size, node-local rank and
 * size, NCCL_NVLS_ENABLE) once, at start (main). Errors: FM_ERR_NOMEM. */
fm_status cli_comm_env_install(void);

/* The commands: argv holds the arguments after the command's name. Each returns the exit code. */
int cmd_train(int argc, char **argv);
int cmd_sample(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_plan(int argc, char **argv);
int cmd_calibrate(int argc, char **argv);
int cmd_report(int argc, char **argv); /* cli_report.c: a run folder's curves through gnuplot */
int cmd_prepare(int argc, char **argv);

#endif
