/* safetensors: read (validated, with conversion to fp32) and write (fp32, atomic).
 *
 * Format (https://github.com/huggingface/safetensors, "Format" section of README.md):
 *   bytes [0, 8)        N, the header length, uint64 little-endian
 *   bytes [8, 8+N)      a UTF-8 JSON object:
 *                         {"NAME": {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [b, e]},
 *                          ..., "__metadata__": {"key": "value", ...}}   (metadata optional)
 *   bytes [8+N, EOF)    the data buffer; a tensor occupies buffer bytes [b, e), row-major,
 *                       little-endian, e - b = numel(shape) * sizeof(dtype).
 *
 * Files written here load with Python's `safetensors` and `transformers` (DESIGN.md §7): tensors
 * are packed contiguously from offset 0 in the order given, the header is padded with spaces so
 * the data buffer starts at a multiple of 8 bytes, and __metadata__ carries "format": "pt" unless
 * the caller sets "format" itself (transformers refuses archives without it).
 *
 * Errors (DESIGN.md §8) name the file, what was expected, what was found and, where it helps, the
 * fix. Host byte order must be little-endian (checked at compile time).
 */
#ifndef FM_SAFETENSORS_H
#define FM_SAFETENSORS_H

#include "../core/fm_core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FM_ST_MAX_DIMS 8

/* Element types, named as safetensors spells them (fm_st_dtype_name). */
typedef enum fm_st_dtype {
    FM_ST_F32 = 0,
    FM_ST_F16,
    FM_ST_BF16,
    FM_ST_F64,
    FM_ST_I32,
    FM_ST_I64,
    FM_ST_I16,
    FM_ST_I8,
    FM_ST_U8,
    FM_ST_U16,
    FM_ST_U32,
    FM_ST_U64,
    FM_ST_BOOL,
    FM_ST_F8_E4M3,
    FM_ST_F8_E5M2,
    FM_ST_DTYPE_COUNT
} fm_st_dtype;

/* "F32", "BF16", ...; "?" for an out-of-range value. */
const char *fm_st_dtype_name(int dtype);
/* Bytes per element (1, 2, 4 or 8); 0 for an out-of-range value. */
size_t fm_st_dtype_size(int dtype);

/* One tensor of an open file. begin/end are byte offsets into the data buffer (not the file);
 * ndim is 0..FM_ST_MAX_DIMS (0: a scalar of one element); shape[ndim..7] are 0. */
typedef struct fm_st_tensor {
    char *name;
    int dtype; /* fm_st_dtype */
    int ndim;
    int64_t shape[FM_ST_MAX_DIMS];
    uint64_t begin, end;
} fm_st_tensor;

/* An open safetensors file: the parsed header and a descriptor for reading tensor data. Fields
 * are read-only for callers; tensors[] is in header order. */
typedef struct fm_safetensors {
    char *path;
    int fd;                /* -1 when closed */
    uint64_t file_bytes;
    uint64_t data_start;   /* file offset of the data buffer: 8 + header length */
    uint64_t data_bytes;   /* file_bytes - data_start */
    fm_st_tensor *tensors;
    int n_tensors;
    int *by_name;          /* indices into tensors[], sorted by name (for fm_st_find) */
    char **meta;           /* __metadata__ as key0, value0, key1, value1, ... */
    int n_meta;            /* number of key/value pairs */
} fm_safetensors;

/* Opens `path`, reads its header and validates all of it, so that later reads cannot find a
 * malformed tensor. Checks, each with FM_ERR_FORMAT and a message naming the file (and the tensor):
 *   - the file is shorter than 8 bytes, or the header length exceeds the file (or 100 MB);
 *   - the header is not a JSON object, or an entry lacks dtype/shape/data_offsets or has the
 *     wrong JSON types, a negative or non-integer number, more than FM_ST_MAX_DIMS dimensions,
 *     or __metadata__ is not an object of strings;
 *   - an unknown dtype; a tensor name that appears twice;
 *   - data_offsets with begin > end, end - begin != numel * dtype size, two tensors whose byte
 *     ranges overlap, or an end beyond the data buffer (a truncated file).
 * FM_ERR_IO when the file cannot be opened or read; FM_ERR_NOMEM when the header does not fit.
 * On error *st is left closed (fm_st_close on it is a no-op). Close an opened file with
 * fm_st_close. Holes between tensors and trailing bytes are accepted. */
fm_status fm_st_open(fm_safetensors *st, const char *path);

/* The tensor called `name`, or NULL. O(log n_tensors). */
const fm_st_tensor *fm_st_find(const fm_safetensors *st, const char *name);

/* The __metadata__ value for `key`, or NULL. */
const char *fm_st_metadata(const fm_safetensors *st, const char *key);

/* Reads tensor `name` into dst (numel fp32 values, row-major), converting F16, BF16 (exact) and
 * F64 (rounded to nearest; beyond fp32 range becomes +-inf) to fp32; F32 is copied bit-exactly.
 * `shape` holds `ndim` expected dimensions, which must match the file's exactly.
 * Errors: FM_ERR_FORMAT when the tensor is missing ("no tensor named ..." plus the closest name
 * in the file), when the shape differs ("expected [64, 128], found [64, 96]"), or when the dtype
 * is not a float type this reader converts (integer, bool, fp8); FM_ERR_IO when the read fails
 * (the file changed since fm_st_open). Reads in 64 KiB pieces; allocates nothing. */
fm_status fm_st_read_f32(const fm_safetensors *st, const char *name, float *dst, int ndim,
                         const int64_t *shape);

/* Reads elements [first, first + count) (row-major, 0 <= first, first + count <= numel) of
 * tensor `name` into dst [count] fp32, converting as fm_st_read_f32 does (one pread of the byte
 * range [begin + first * size, + count * size) for F32; 64 KiB pieces otherwise), so a rank reads
 * only its shard of a tensor. shape as fm_st_read_f32's. Errors: those of fm_st_read_f32, and
 * FM_ERR_ARG naming the tensor when the range is outside it. Allocates nothing. */
fm_status fm_st_read_f32_range(const fm_safetensors *st, const char *name, int64_t first, int64_t count, float *dst,
                               int ndim, const int64_t *shape);

/* Releases everything fm_st_open made and zeroes *st. Safe on a closed or zeroed struct. */
void fm_st_close(fm_safetensors *st);

/* An fp32 tensor to write: `data` holds numel(shape) values, row-major. Or, with data NULL and
 * `fetch` set, the writer calls fetch(fetch_ctx, buf) to fill a bounce buffer with the values
 * just before writing them (a device-resident tensor streams through one tensor's worth of host
 * memory instead of being staged whole). Or, with data NULL and `fetch_range` set (it wins over
 * fetch), the writer streams the tensor through the caller's buffer stage [stage_len fp32]:
 * for first = 0, stage_len, 2 stage_len, ... < numel it calls fetch_range(fetch_ctx, first,
 * count = min(stage_len, numel - first), stage) to fill stage[0, count) with the elements
 * [first, first + count) and writes them, in this order, allocating nothing (the sharded
 * trainers' checkpoints: rank 0 receives each range from its owner, train/fm_train_ckpt_stream.c).
 * A fetch_range error ends the write with that status (the .tmp file removed). */
typedef struct fm_named_tensor {
    const char *name;
    const float *data;
    int ndim; /* 0..FM_ST_MAX_DIMS */
    int64_t shape[FM_ST_MAX_DIMS];
    void (*fetch)(void *fetch_ctx, float *buf);
    void *fetch_ctx;
    fm_status (*fetch_range)(void *fetch_ctx, int64_t first, int64_t count, float *stage);
    float *stage;       /* [stage_len]: fetch_range's buffer, the caller's */
    int64_t stage_len;  /* > 0 with fetch_range */
} fm_named_tensor;

/* Writes the n tensors t[0..n) as F32 to `path`, packed in the order given, with the optional
 * string metadata `metadata_kv` = {key0, value0, key1, value1, ..., NULL} (NULL for none; a
 * "format": "pt" pair is added unless a "format" key is given).
 * Atomic: the bytes go to "<path>.tmp", which is flushed, fsync'ed and renamed to `path`, and the
 * parent folder is fsync'ed; on any failure the .tmp file is removed and an existing `path` is
 * untouched. Every write, fsync and rename first consults fm_fault_hit() (fault injection).
 * Errors: FM_ERR_ARG for an empty, duplicate or reserved ("__metadata__") name, ndim outside
 * 0..8, a negative dimension, NULL data for a non-empty tensor or a size overflow;
 * FM_ERR_IO (path and errno text) when a write fails; FM_ERR_NOMEM when the header does not fit. */
fm_status fm_st_write(const char *path, const fm_named_tensor *t, int n,
                      const char *const *metadata_kv);

#ifdef __cplusplus
}
#endif
#endif
