/* TensorBoard scalar event files (`train --tensorboard DIR`), written by hand: no TensorFlow,
 * no protobuf library, no new run-time dependency.
 *
 * The file, DIR/events.out.tfevents.<unix seconds>.<host>.flatmoe, is a TFRecord stream
 * (TensorFlow's tensorflow/core/lib/io/record_writer.cc, the format TensorBoard's
 * tensorboard/summary/writer/record_writer.py writes): each record is
 *   uint64 length (little-endian), uint32 masked CRC-32C of those 8 bytes, the data,
 *   uint32 masked CRC-32C of the data,
 * with CRC-32C the Castagnoli CRC (reflected polynomial 0x82F63B78, RFC 3720 B.4) and
 * masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (tensorflow/core/lib/hash/crc32c.h, Mask).
 * Each record's data is an Event protocol buffer (tensorflow/core/util/event.proto):
 *   double wall_time = 1; int64 step = 2; string file_version = 3 (the first record:
 *   "brain.Event:2"); Summary summary = 5;
 * Summary (tensorflow/core/framework/summary.proto): repeated Value value = 1; Value:
 *   string tag = 1; float simple_value = 2.
 * Encoded by the protobuf wire format (protobuf.dev/programming-guides/encoding): a key
 * varint (field << 3 | wire type: 0 varint, 1 64-bit, 2 length-delimited, 5 32-bit), then the
 * value. One Event per step holds all of the step's scalars.
 *
 * The writer's buffer is fixed at open (FM_TB_EVENT_BYTES): a step's scalars that would not fit
 * are dropped with an error from fm_tensorboard_add, never a reallocation in the loop. */
#ifndef FM_TENSORBOARD_H
#define FM_TENSORBOARD_H

#include <stdint.h>

#include "../core/fm_core.h"

#define FM_TB_EVENT_BYTES 65536 /* one step's Event: ~40 bytes a scalar, > 1000 scalars */

typedef struct fm_tensorboard fm_tensorboard;

/* Creates DIR (and its parents) and the event file in it, and writes the file_version record.
 * Errors: FM_ERR_IO naming the path and strerror; FM_ERR_NOMEM. *tb is NULL on error. */
fm_status fm_tensorboard_open(fm_tensorboard **tb, const char *dir);

/* Starts the Event of `step` at wall_time (seconds since the Unix epoch). */
void fm_tensorboard_begin(fm_tensorboard *tb, int64_t step, double wall_time);

/* Adds a scalar (tag: e.g. "train/loss", at most 200 bytes) to the Event begun. Errors:
 * FM_ERR_ARG when the Event's buffer is full or the tag too long (the scalar is dropped). */
fm_status fm_tensorboard_add(fm_tensorboard *tb, const char *tag, double value);

/* Writes the Event as one record and flushes the file. Errors: FM_ERR_IO (strerror). */
fm_status fm_tensorboard_end(fm_tensorboard *tb);

/* The event file's path. */
const char *fm_tensorboard_path(const fm_tensorboard *tb);

/* Closes the file and frees tb. Safe on NULL. */
void fm_tensorboard_close(fm_tensorboard *tb);

/* The masked CRC-32C of n bytes (exposed for the tests' reader). */
uint32_t fm_tensorboard_masked_crc(const void *data, size_t n);

#endif
