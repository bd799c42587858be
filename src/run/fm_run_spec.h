/* The run spec (DESIGN.md §3, run/): every option of every command in one struct, filled from
 * one flag table (fm_spec_flags.c: name, value kind, place in the spec, default, help, the
 * commands that take it, and whether a checkpoint fixes it). The CLI parses argv with the table;
 * a library user sets options by name (fm_spec_set). The cross-flag rules are fm_spec_check
 * (fm_spec_check.c), the planner's request fm_spec_plan_request (fm_spec_plan.c), and the spec
 * travels in each checkpoint's state.json ("spec", fm_spec_resume.c), from which
 * `train --out DIR --resume` restores it.
 *
 * A flag's "given" bit says whether the user (or a restored state.json) set it: there are no
 * sentinel values. */
#ifndef FM_RUN_SPEC_H
#define FM_RUN_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../train/fm_trainer.h"

#define FM_SPEC_MAX_FILES 256 /* files one file-list flag takes */
#define FM_SPEC_MAX_ROWS 192  /* rows of the flag table (a static check in fm_spec_flags.c) */

/* The commands a row serves (a bit set). */
enum {
    FM_CMD_TRAIN = 1 << 0,
    FM_CMD_PLAN = 1 << 1,
    FM_CMD_EVAL = 1 << 2,
    FM_CMD_SAMPLE = 1 << 3,
    FM_CMD_PREPARE = 1 << 4,
    FM_CMD_CALIBRATE = 1 << 5,
    FM_CMD_REPORT = 1 << 6,
};

/* A value's kind. STR: const char * (any text, "" included); I64: int64_t; INT: int in
 * [-1e6, 1e6]; U64: uint64_t; F64: a finite double; BOOL: bool set by the bare flag (no value);
 * FILES: a list of paths (the following arguments up to the next --flag) into a
 * const char *[FM_SPEC_MAX_FILES] with its count (int) at count_offset; BYTES: size_t from a
 * byte count (fm_parse_bytes: 16GiB, 100MB, 0); CHOICE: one of the row's choices, stored as its
 * index in an integer of `width` bytes (1: bool/uint8, 4: int). */
typedef enum fm_spec_kind {
    FM_SPEC_STR,
    FM_SPEC_I64,
    FM_SPEC_INT,
    FM_SPEC_U64,
    FM_SPEC_F64,
    FM_SPEC_BOOL,
    FM_SPEC_FILES,
    FM_SPEC_BYTES,
    FM_SPEC_CHOICE,
} fm_spec_kind;

/* What a checkpoint makes of a flag (train only). */
typedef enum fm_spec_life {
    FM_SPEC_RUN = 0,    /* saved in state.json; a resume restores it, a value given again overrides
                           it with a line saying so */
    FM_SPEC_FIXED,      /* saved; it changes what the checkpoint means (shape, precision, seed...):
                           a resume restores it, and a different value given again keeps today's
                           refusal or warning */
    FM_SPEC_INVOCATION, /* this invocation only (--resume, --exit-after, --quiet...): not saved */
} fm_spec_life;

/* One row of the flag table. */
typedef struct fm_spec_flag {
    const char *name;           /* without "--" */
    fm_spec_kind kind;
    size_t offset;              /* of the value in fm_run_spec */
    size_t count_offset;        /* FILES: of the int count in fm_run_spec */
    unsigned char width;        /* CHOICE: bytes of the integer the index goes to (1 or 4) */
    const char *const *choices; /* CHOICE: the values, NULL-terminated */
    const char *dflt;           /* the default as the flag's text (parsed into the spec by
                                   fm_spec_default; shown by --help); NULL: zero / unset */
    const char *dflt_note;      /* shown after the default in --help when the default is not a plain
                                   value ("chosen under --mem-budget"); NULL: none */
    const char *help;           /* one line, without the default */
    unsigned cmds;              /* FM_CMD_* bits */
    fm_spec_life life;
} fm_spec_flag;

/* Settings only the planner reads (flatmoe plan). */
typedef struct fm_spec_planner {
    size_t device_mem;          /* --device-mem: the device's memory; 0: none */
    const char *gpu;            /* --gpu h100 | h200: a preset device (its memory and calibration) */
    const char *calib;          /* --calib: a calibration table (default configs/calib/<kind>.json) */
    const char *backend;        /* --backend cpu | cuda (NULL: this build's) */
    int64_t world;              /* --world: ranks of a mesh (given: plan one rank of it) */
    int64_t gpus_per_node;      /* --gpus-per-node (8 when a mesh) */
    bool json;                  /* --json: one JSON object instead of the table */
} fm_spec_planner;

/* Settings of the checkpoint readers (flatmoe eval, sample). */
typedef struct fm_spec_infer {
    const char *ckpt;           /* --ckpt: a checkpoint or run folder */
    const char *tokenizer;      /* --tokenizer */
    const char *prompt;         /* sample --prompt */
    bool ignore_eos;            /* sample --ignore-eos */
    bool chat;                  /* sample --chat: the prompt as a user turn of the chat template */
    const char *system;         /* sample --system: with --chat, a system turn first */
    int64_t max_new_tokens;     /* sample --max-new-tokens */
    double temperature;         /* sample --temperature */
    int64_t top_k;              /* sample --top-k */
    int64_t context;            /* sample --context (0: the trained seq_len) */
    int64_t max_batches;        /* eval --max-batches (0: all) */
} fm_spec_infer;

/* flatmoe prepare's settings (text and JSONL files -> token shards; cli_prepare.c). */
typedef struct fm_spec_prepare {
    const char *tokenizer;                   /* --tokenizer: folder with tokenizer.json, or the file */
    const char *inputs[FM_SPEC_MAX_FILES];   /* --input: text and JSONL files */
    int n_inputs;
    const char *out;                         /* --out: shard prefix */
    int64_t shard_tokens;                    /* --shard-tokens */
    const char *format;                      /* --format text | jsonl | auto (checked by the command) */
    bool no_eos;                             /* --no-eos */
    const char *decode;                      /* --decode SHARD: print its text instead */
    bool show_mask;                          /* --show-mask (with --decode) */
    const char *loss_on;                     /* --loss-on assistant | all (checked by the command) */
    const char *role_map;                    /* --role-map FROM=TO,... */
    bool skip_bad_records;                   /* --skip-bad-records */
    bool no_chat_template;                   /* --no-chat-template: flatmoe's own chat form */
} fm_spec_prepare;

/* flatmoe calibrate's settings (cli_calibrate.c). */
typedef struct fm_spec_calibrate {
    const char *out;                         /* --out: the calibration table to write */
    const char *backend;                     /* --backend cpu | cuda: must be this binary's (NULL: not given) */
    bool quick;                              /* --quick */
    int threads;                             /* --threads, 0 = all cores */
} fm_spec_calibrate;

/* flatmoe report's settings (cli_report.c). run_dir is the positional RUN_DIR, set by the
 * command, not by a row. */
typedef struct fm_spec_report {
    const char *run_dir;                     /* RUN_DIR (positional) */
    const char *out;                         /* --out: folder of the images (NULL: RUN_DIR/report) */
    const char *format;                      /* --format png | svg (checked by the command) */
} fm_spec_report;

/* The library's own options (include/flatmoe.h flatmoe_open): rows of `train` that the command
 * refuses (fm_spec_check) unless `session` is set, as flatmoe_open sets it, or `plan` (plan --library). */
#define FM_SPEC_TOPK_MAX 64 /* --logprobs-topk's most (include/flatmoe.h FLATMOE_TOPK_MAX) */
typedef struct fm_spec_library {
    int64_t logprobs_topk;                   /* --logprobs-topk K: the top-k log-probs' buffers, 0 .. 64 */
    bool kv_cache;                           /* --kv-cache: flatmoe_generate's KV cache */
    bool session;                            /* set by flatmoe_open, never by a flag */
    bool plan;                               /* plan --library: plan a session (the library's rows allowed) */
} fm_spec_library;

/* The run spec. `train` is the trainer's options (train/fm_trainer.h: shape, optimizer, memory
 * knobs, experts, parallelism, loop and checkpoint cadence, data, model source); the file lists
 * live in data_files / val_files (fm_spec_train_opts points train.data at them). */
typedef struct fm_run_spec {
    unsigned cmd;                 /* the FM_CMD_* the spec was made for (fm_spec_default) */
    fm_train_opts train;
    fm_spec_planner planner;
    fm_spec_infer infer;
    fm_spec_prepare prepare;
    fm_spec_calibrate calibrate;
    fm_spec_report report;
    fm_spec_library library;
    const char *data_files[FM_SPEC_MAX_FILES];
    const char *val_files[FM_SPEC_MAX_FILES];
    uint64_t given[(FM_SPEC_MAX_ROWS + 63) / 64]; /* by row index */
    uint64_t restored[(FM_SPEC_MAX_ROWS + 63) / 64]; /* set from a checkpoint's state.json */
    char **owned;                 /* strings copied by fm_spec_set (freed by fm_spec_free) */
    int n_owned, cap_owned;
} fm_run_spec;

/* The flag table and its row count. */
extern const fm_spec_flag fm_spec_flags[];
extern const int fm_spec_n_flags;

/* Sets every option to command cmd's defaults (the rows of cmd, in table order; then
 * fm_train_opts_default's values for the trainer fields no row of cmd sets). */
void fm_spec_default(fm_run_spec *s, unsigned cmd);
/* Frees what fm_spec_set copied. */
void fm_spec_free(fm_run_spec *s);

/* The row of flag `name` for command cmd (FM_CMD_*), or NULL. */
const fm_spec_flag *fm_spec_find(const char *name, unsigned cmd);
/* Row index of f in fm_spec_flags. */
int fm_spec_row(const fm_spec_flag *f);

/* Sets option `name` (a flag of s->cmd, without "--") from its text form, as the command line
 * would (BOOL: "true"/"1" or "false"/"0"; FILES: one path, appended), copying the text, and
 * marks it given. Errors: FM_ERR_ARG naming the flag, the value found and the form expected
 * ("--lr expects a finite number, found 'x'"); an unknown name: FM_ERR_ARG naming it. */
fm_status fm_spec_set(fm_run_spec *s, const char *name, const char *value);
/* The same for row f, with the text not copied (it must outlive s: argv). */
fm_status fm_spec_set_row(fm_run_spec *s, const fm_spec_flag *f, const char *value, bool copy);

/* Whether flag `name` was given (or restored) for s->cmd. */
bool fm_spec_given(const fm_run_spec *s, const char *name);
bool fm_spec_row_given(const fm_run_spec *s, int row);
void fm_spec_mark_given(fm_run_spec *s, int row, bool given);

/* Writes row f's value as text into out[cap] (the form fm_spec_set reads; FILES: the first
 * file; BOOL: "true"/"false"). */
void fm_spec_format(const fm_run_spec *s, const fm_spec_flag *f, char *out, size_t cap);

/* The trainer's options of s: s->train with the file lists pointed at s's storage and the
 * fields that tell "given" from "not given" filled from the given bits (lr_given, ...; the
 * memory knobs not given: -1, chosen). The result points into s. */
fm_train_opts fm_spec_train_opts(const fm_run_spec *s);

/* What --help shows as row f's default, into out[cap]: "dflt", "note" or "dflt; note" (a
 * newline shown as \\n); "" when the row has neither. */
void fm_spec_default_text(const fm_spec_flag *f, char *out, size_t cap);

#endif
