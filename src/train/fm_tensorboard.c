/* TensorBoard scalar event files: a TFRecord writer and a minimal Event encoder (fm_tensorboard.h
 * for the format and its sources). */
#define _POSIX_C_SOURCE 200809L
#include "fm_tensorboard.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../io/fm_checkpoint.h"

struct fm_tensorboard {
    FILE *f;
    char path[4400];
    unsigned char ev[FM_TB_EVENT_BYTES]; /* the Event being built */
    size_t n;
    unsigned char sum[FM_TB_EVENT_BYTES]; /* its Summary (values), copied in at the end */
    size_t ns;
    bool overflow;
};

/* CRC-32C (Castagnoli), bitwise over a 256-entry table of the reflected polynomial 0x82F63B78. */
static uint32_t crc_table[256];
static void crc_init(void) {
    if (crc_table[1]) return;
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
}

uint32_t fm_tensorboard_masked_crc(const void *data, size_t n) {
    crc_init();
    const unsigned char *p = data;
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    c ^= 0xFFFFFFFFu;
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

/* ---- protobuf wire format ---- */

static size_t put_varint(unsigned char *p, uint64_t v) {
    size_t n = 0;
    do {
        unsigned char b = v & 0x7F;
        v >>= 7;
        p[n++] = b | (v ? 0x80 : 0);
    } while (v);
    return n;
}

static void put_le(unsigned char *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* Appends one TFRecord of data[0..n) to the file. */
static fm_status write_record(fm_tensorboard *tb, const unsigned char *data, size_t n) {
    unsigned char h[12], t[4];
    put_le(h, (uint64_t)n, 8);
    put_le(h + 8, fm_tensorboard_masked_crc(h, 8), 4);
    put_le(t, fm_tensorboard_masked_crc(data, n), 4);
    if (fwrite(h, 1, 12, tb->f) != 12 || fwrite(data, 1, n, tb->f) != n || fwrite(t, 1, 4, tb->f) != 4 ||
        fflush(tb->f) != 0)
        return fm_error(FM_ERR_IO, "%s: cannot write a TensorBoard record: %s; check free disk space", tb->path,
                        strerror(errno));
    return FM_OK;
}

/* The Event's head: wall_time (field 1, 64-bit) and step (field 2, varint). */
static size_t event_head(unsigned char *p, int64_t step, double wall) {
    size_t n = 0;
    uint64_t bits;
    memcpy(&bits, &wall, 8);
    p[n++] = 0x09;
    put_le(p + n, bits, 8);
    n += 8;
    p[n++] = 0x10;
    n += put_varint(p + n, (uint64_t)step);
    return n;
}

static double now_wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

fm_status fm_tensorboard_open(fm_tensorboard **out, const char *dir) {
    *out = NULL;
    fm_status ms = fm_mkdirs(dir);
    if (ms) {
        char why[1024];
        snprintf(why, sizeof why, "%s", fm_errmsg());
        return fm_error(ms, "--tensorboard %s: cannot make the folder: %s; name a folder for the event files", dir, why);
    }
    fm_tensorboard *tb = fm_malloc(sizeof *tb);
    if (!tb) return fm_error(FM_ERR_NOMEM, "--tensorboard: out of memory for the event writer");
    memset(tb, 0, sizeof *tb);
    char host[256] = "localhost";
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = 0;
    const double wall = now_wall();
    /* one new file per invocation, as TensorFlow's writer names them (time, host, pid, a counter):
     * a resumed run started within the same second gets its own file, never the earlier one's */
    for (int k = 0; k < 1000 && !tb->f; k++) {
        snprintf(tb->path, sizeof tb->path, "%s/events.out.tfevents.%lld.%s.%ld.%d", dir, (long long)wall, host,
                 (long)getpid(), k);
        tb->f = fopen(tb->path, "wbx");
        if (!tb->f && errno != EEXIST) break;
    }
    if (!tb->f) {
        fm_status s = fm_error(FM_ERR_IO, "%s: cannot create the TensorBoard event file: %s; check that --tensorboard "
                               "names a writable folder", tb->path, strerror(errno));
        fm_free(tb);
        return s;
    }
    /* the first record: file_version (field 3) "brain.Event:2", as every TensorFlow writer starts */
    static const char ver[] = "brain.Event:2";
    size_t n = event_head(tb->ev, 0, wall);
    tb->ev[n++] = 0x1A;
    n += put_varint(tb->ev + n, sizeof ver - 1);
    memcpy(tb->ev + n, ver, sizeof ver - 1);
    n += sizeof ver - 1;
    fm_status s = write_record(tb, tb->ev, n);
    if (s) {
        fm_tensorboard_close(tb);
        return s;
    }
    *out = tb;
    return FM_OK;
}

void fm_tensorboard_begin(fm_tensorboard *tb, int64_t step, double wall_time) {
    tb->n = event_head(tb->ev, step, wall_time > 0 ? wall_time : now_wall());
    tb->ns = 0;
    tb->overflow = false;
}

fm_status fm_tensorboard_add(fm_tensorboard *tb, const char *tag, double value) {
    const size_t tl = strlen(tag);
    if (tl > 200) return fm_error(FM_ERR_ARG, "TensorBoard tag of %zu bytes (%.40s...); expected at most 200", tl, tag);
    /* Value: tag (field 1, length-delimited), simple_value (field 2, 32-bit float) */
    unsigned char v[256];
    size_t k = 0;
    v[k++] = 0x0A;
    k += put_varint(v + k, tl);
    memcpy(v + k, tag, tl);
    k += tl;
    v[k++] = 0x15;
    const float f = (float)value;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    put_le(v + k, bits, 4);
    k += 4;
    /* Summary: value (field 1, repeated, length-delimited) */
    if (tb->ns + k + 12 > sizeof tb->sum) {
        tb->overflow = true;
        return fm_error(FM_ERR_ARG, "TensorBoard: the step's Event is full (%d bytes): scalar %s dropped",
                        FM_TB_EVENT_BYTES, tag);
    }
    tb->sum[tb->ns++] = 0x0A;
    tb->ns += put_varint(tb->sum + tb->ns, k);
    memcpy(tb->sum + tb->ns, v, k);
    tb->ns += k;
    return FM_OK;
}

fm_status fm_tensorboard_end(fm_tensorboard *tb) {
    /* Event.summary (field 5, length-delimited) */
    if (tb->n + 12 + tb->ns > sizeof tb->ev)
        return fm_error(FM_ERR_ARG, "TensorBoard: the step's Event does not fit %d bytes", FM_TB_EVENT_BYTES);
    tb->ev[tb->n++] = 0x2A;
    tb->n += put_varint(tb->ev + tb->n, tb->ns);
    memcpy(tb->ev + tb->n, tb->sum, tb->ns);
    tb->n += tb->ns;
    return write_record(tb, tb->ev, tb->n);
}

const char *fm_tensorboard_path(const fm_tensorboard *tb) { return tb->path; }

void fm_tensorboard_close(fm_tensorboard *tb) {
    if (!tb) return;
    if (tb->f) fclose(tb->f);
    fm_free(tb);
}
