/* libFuzzer harness: a checkpoint's state.json on --resume: the trainer's fields
 * (train/fm_train_ckpt.c fm_train_state_read) and the run spec restored from it
 * (run/fm_spec_resume.c fm_spec_restore_json, over a train spec with nothing given). The input is
 * the file (read both ways: as state.json, and as the "spec" object itself). A state that reads
 * must hold its fields inside the ranges fm_train_state_read states; a restored spec must write
 * back (fm_spec_to_json) to a text that restores again. */
#include "fm_fuzz.h"
#include "run/fm_run_spec.h"
#include "run/fm_spec_resume.h"
#include "train/fm_train_internal.h"

/* Restores the spec from text; a spec that restores writes back to a text that restores too. */
static void restore(const char *text) {
    fm_run_spec s;
    fm_spec_default(&s, FM_CMD_TRAIN);
    if (fm_spec_restore_json(&s, text, "state.json", false) == FM_OK) {
        char *back = fm_spec_to_json(&s);
        FUZZ_CHECK(back != NULL, "fm_spec_to_json failed");
        fm_run_spec t;
        fm_spec_default(&t, FM_CMD_TRAIN);
        const fm_status st = fm_spec_restore_json(&t, back, "state.json (written back)", false);
        FUZZ_CHECK(st == FM_OK, "the written-back spec does not restore: %s\n%s", fm_errmsg(), back);
        fm_spec_free(&t);
        free(back);
    }
    fm_spec_free(&s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = fuzz_str(data, size);
    const char *path = fuzz_write("state.json", data, size);
    train_state ts;
    memset(&ts, 0, sizeof ts);
    if (fm_train_state_read(path, &ts) == FM_OK) {
        FUZZ_CHECK(ts.step >= 0 && ts.opt_step >= 0 && ts.micro_batch >= 0 && ts.micro_batch <= (1 << 20) &&
                   ts.dp >= 1 && ts.dp <= (1 << 20) && ts.grad_accum >= 0 && ts.grad_accum <= (1 << 20) &&
                   ts.seq_len >= 0 && ts.seq_len <= (1 << 30) && ts.threads >= 0 && ts.threads <= 1000000,
                   "a state read outside its ranges");
    }
    restore(text);
    free(text);
    return 0;
}
