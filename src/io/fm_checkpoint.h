/* Checkpoint folders (DESIGN.md §7): one folder per saved step,
 *
 *   RUN_DIR/step_NNNNNN/          NNNNNN = the step, zero-padded to 6 digits (more when larger)
 *       model.safetensors         fp32 weights under Hugging Face tensor names (loads in transformers)
 *       optimizer.safetensors     fp32 optimizer state (e.g. Adam moments), names chosen by the trainer
 *       config.json               the model config, verbatim
 *       state.json                trainer state (step, data cursor, RNG), verbatim
 *
 * written first as RUN_DIR/.tmp.step_NNNNNN/ and renamed when complete, so a folder named
 * step_NNNNNN is always complete and a crash or failed write leaves at most a .tmp.* folder that
 * readers ignore and the next write of that step removes. (One crash window: while an existing
 * step_NNNNNN is being replaced, it sits at .tmp.old.step_NNNNNN for the time of one rename; a
 * crash there makes readers fall back to the previous step, and the next write of step NNNNNN
 * puts the old folder back before starting.)
 */
#ifndef FM_CHECKPOINT_H
#define FM_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "../core/fm_core.h"
#include "fm_safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FM_CKPT_MODEL_FILE "model.safetensors"
#define FM_CKPT_OPTIM_FILE "optimizer.safetensors"
#define FM_CKPT_CONFIG_FILE "config.json"
#define FM_CKPT_STATE_FILE "state.json"

/* Writes the checkpoint of `step` (>= 0) under run_dir (created, with its parents, if missing):
 * model[0..n_model) to model.safetensors and optim[0..n_optim) to optimizer.safetensors (F32,
 * metadata "format": "pt" and "step": "<step>"), config_json and state_json verbatim. Every file
 * is fsync'ed in RUN_DIR/.tmp.step_NNNNNN/, the folder is fsync'ed and renamed to
 * RUN_DIR/step_NNNNNN, and run_dir is fsync'ed. An existing step_NNNNNN is first moved aside to
 * RUN_DIR/.tmp.old.step_NNNNNN and deleted only after the new folder is in place (moved back if the
 * rename fails). On success the final folder path is copied to out_dir (NULL to skip; FM_ERR_ARG,
 * before anything is written, when out_cap is too small).
 * On any failure the temporary folder is removed and any existing checkpoint is left intact.
 * Errors: FM_ERR_ARG (bad argument, path too long), FM_ERR_IO (names the path and the errno text;
 * fault injection through fm_fault_hit() before every mkdir, write, fsync and rename),
 * FM_ERR_NOMEM. If the final fsync of run_dir fails after the rename, FM_ERR_IO says that the
 * checkpoint is in place but may not be durable. */
fm_status fm_ckpt_write(const char *run_dir, int64_t step, const fm_named_tensor *model,
                        int n_model, const fm_named_tensor *optim, int n_optim,
                        const char *config_json, const char *state_json, char *out_dir,
                        size_t out_cap);

/* Finds the checkpoint with the highest step in run_dir: a folder named step_<digits> that holds
 * all four files. .tmp.* folders, other names and incomplete folders are ignored. Copies its path
 * to out_dir (NULL to skip) and its step to *out_step (NULL to skip).
 * Errors: FM_ERR_IO when run_dir cannot be read or holds no checkpoint (the message says so and
 * what was expected); FM_ERR_ARG when out_cap is too small. */
fm_status fm_ckpt_find_latest(const char *run_dir, char *out_dir, size_t cap, int64_t *out_step);

/* Reads the whole file at `path` (config.json, state.json: small text files) into a new
 * NUL-terminated string, *out_text, to be released with fm_free. Byte count = strlen unless the
 * file holds NUL bytes. Errors: FM_ERR_IO when the file is missing, unreadable or not a regular
 * file (path and errno text); FM_ERR_NOMEM. *out_text is NULL on error. */
fm_status fm_ckpt_read_text(const char *path, char **out_text);

/* Creates the folder `path` and its missing parents ("mkdir -p"). Errors: FM_ERR_IO naming the
 * path (exists as a file, permission denied, ...), FM_ERR_ARG (path too long). */
fm_status fm_mkdirs(const char *path);

/* Lists the step_<digits> folders of run_dir that are not complete checkpoints (a file missing)
 * and whose step is above `above`: the first such folder's path goes to out (cap bytes) and the
 * missing file's name to *missing. Returns true if one exists. */
bool fm_ckpt_find_incomplete(const char *run_dir, int64_t above, char *out, size_t cap, const char **missing);

/* Replaces `path` atomically with the n bytes at data: writes "<path>.tmp", fsyncs it, renames it
 * over path and fsyncs the folder. On failure the .tmp file is removed and an existing `path` is
 * untouched. For small files (metrics snapshots, exports, config.json, state.json).
 * Errors: FM_ERR_ARG (empty or too long path), FM_ERR_IO (path and errno text; fault injection
 * before the create, write, fsync and rename). */
fm_status fm_write_file_atomic(const char *path, const void *data, size_t n);

#ifdef __cplusplus
}
#endif
#endif
