/* Fine-tuning defaults (issue 28 item 4): `train --init-from DIR` starts from a trained model, so
 * the from-scratch defaults (lr 2e-3, weight decay 0.1, micro-batch 16, --out runs/tiny) are wrong
 * for it. The values taken instead are those of Hugging Face TRL's SFTConfig (trl/trainer/
 * sft_config.py: learning_rate 2e-5) and the transformers TrainingArguments it extends
 * (training_args.py: weight_decay 0.0, warmup_steps 0, per_device_train_batch_size 8, a schedule
 * that decays to 0). */
#ifndef FM_SPEC_FINETUNE_H
#define FM_SPEC_FINETUNE_H

#include <stddef.h>

#include "fm_run_spec.h"

/* With --init-from given (train) and --out not given, sets --out runs/ft-NAME (NAME: the last
 * component of the --init-from path), marked given; called before fm_spec_resume, so that
 * `--init-from DIR --resume` finds the run it started. said[cap] gets the line saying so ("" when
 * not set). Errors: FM_ERR_NOMEM. */
fm_status fm_spec_finetune_out(fm_run_spec *s, char *said, size_t cap);

/* With --init-from given (train) and a flag of the list below neither given nor restored from a
 * checkpoint, sets it to its fine-tuning value and marks it given (so state.json keeps it and a
 * --resume restores it):
 *   --lr 2e-5, --min-lr 0, --weight-decay 0, --warmup 0, --micro-batch 8.
 * Called after fm_spec_resume, and only when the run starts (not when --resume continues a
 * checkpoint: the run keeps its own values, restored or the defaults it began with). said[cap] gets one line naming the values taken ("" when none: no
 * --init-from, or every one given). Errors: those of fm_spec_set (none for these values). */
fm_status fm_spec_finetune_defaults(fm_run_spec *s, char *said, size_t cap);

#endif
