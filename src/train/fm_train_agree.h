/* Every rank of a launch must train with the same flags and config: ranks started with different
 * --micro-batch, --seed or --ep (an MPMD launch, an edited script on one node) would otherwise run
 * different collectives (a hang until --comm-timeout) or silently diverge. */
#ifndef FM_TRAIN_AGREE_H
#define FM_TRAIN_AGREE_H

#include "../comm/fm_comm.h"
#include "../model/fm_config.h"
#include "fm_trainer.h"

/* Compares the flags that shape the run (shape, schedule, seed, mesh degrees, memory knobs, the
 * model's main dimensions) over the world: one all-reduce (max) of 2 x (the table's length) int64 in host memory
 * (each value and its bitwise complement, so min and max come from one call); doubles compare
 * by their bits, strings by a 63-bit FNV-1a hash. A collective: every rank calls it. Errors:
 * FM_ERR_ARG naming the first flag that differs, this rank's value and the ranks' range; the
 * communicator's. One rank (or world NULL): FM_OK. */
fm_status fm_train_agree(const fm_comm *world, const fm_train_opts *o, const fm_config *c);

#endif
