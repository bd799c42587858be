#define _GNU_SOURCE
#include "fm_safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fm_atomic.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "fm_safetensors assumes a little-endian host (safetensors data is little-endian)"
#endif

/* Python's safetensors refuses headers over 100 MB; so do we (a larger value means the file is
 * not safetensors at all, e.g. a pickle or a text file). */
#define ST_MAX_HEADER ((uint64_t)100 * 1000 * 1000)
/* JSON numbers are doubles: integers are exact below 2^53. */
#define ST_MAX_JSON_INT 9007199254740992.0

static const struct {
    const char *name;
    size_t size;
} k_dtypes[FM_ST_DTYPE_COUNT] = {
    [FM_ST_F32] = {"F32", 4},          [FM_ST_F16] = {"F16", 2},   [FM_ST_BF16] = {"BF16", 2},
    [FM_ST_F64] = {"F64", 8},          [FM_ST_I32] = {"I32", 4},   [FM_ST_I64] = {"I64", 8},
    [FM_ST_I16] = {"I16", 2},          [FM_ST_I8] = {"I8", 1},     [FM_ST_U8] = {"U8", 1},
    [FM_ST_U16] = {"U16", 2},          [FM_ST_U32] = {"U32", 4},   [FM_ST_U64] = {"U64", 8},
    [FM_ST_BOOL] = {"BOOL", 1},        [FM_ST_F8_E4M3] = {"F8_E4M3", 1},
    [FM_ST_F8_E5M2] = {"F8_E5M2", 1},
};

const char *fm_st_dtype_name(int dtype) {
    return dtype >= 0 && dtype < FM_ST_DTYPE_COUNT ? k_dtypes[dtype].name : "?";
}

size_t fm_st_dtype_size(int dtype) {
    return dtype >= 0 && dtype < FM_ST_DTYPE_COUNT ? k_dtypes[dtype].size : 0;
}

static int dtype_from_name(const char *s) {
    for (int i = 0; i < FM_ST_DTYPE_COUNT; i++)
        if (strcmp(s, k_dtypes[i].name) == 0) return i;
    return -1;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s);
    char *p = fm_malloc(n + 1);
    if (p) memcpy(p, s, n + 1);
    return p;
}

/* "[64, 128]" into buf (truncated with "..." if it does not fit). */
static const char *fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t len = 0;
    int w = snprintf(buf, cap, "[");
    len = (size_t)w;
    for (int i = 0; i < ndim && len < cap; i++) {
        w = snprintf(buf + len, cap - len, "%s%" PRId64, i ? ", " : "", shape[i]);
        if (w < 0) break;
        len += (size_t)w;
    }
    if (len < cap) snprintf(buf + len, cap - len, "]");
    return buf;
}

/* numel of a shape, false on int64 overflow. ndim 0 is a scalar (1 element). */
static bool shape_numel(int ndim, const int64_t *shape, uint64_t *out) {
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return false;
        if (__builtin_mul_overflow(n, (uint64_t)shape[i], &n)) return false;
    }
    if (n > (uint64_t)INT64_MAX) return false;
    *out = n;
    return true;
}

/* A JSON number that is a non-negative integer exactly representable as a double. */
static bool json_uint(const cJSON *item, uint64_t *out) {
    if (!cJSON_IsNumber(item)) return false;
    double v = item->valuedouble;
    if (!(v >= 0.0) || v > ST_MAX_JSON_INT || v != floor(v)) return false;
    *out = (uint64_t)v;
    return true;
}

/* ----------------------------------------------------------------------------------------- */
/* Reading                                                                                   */

static fm_status pread_all(const fm_safetensors *st, void *buf, size_t n, uint64_t off,
                           const char *what) {
    char *p = buf;
    size_t done = 0;
    while (done < n) {
        ssize_t r = pread(st->fd, p + done, n - done, (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return fm_error(FM_ERR_IO, "%s: cannot read %s at file byte %" PRIu64 ": %s", st->path,
                            what, off + done, strerror(errno));
        }
        if (r == 0)
            return fm_error(FM_ERR_IO,
                            "%s: file ended at byte %" PRIu64 " while reading %s (the file "
                            "changed since it was opened?)",
                            st->path, off + done, what);
        done += (size_t)r;
    }
    return FM_OK;
}

static int cmp_tensor_name(const void *a, const void *b) {
    const fm_st_tensor *x = *(fm_st_tensor *const *)a, *y = *(fm_st_tensor *const *)b;
    return strcmp(x->name, y->name);
}

static int cmp_tensor_begin(const void *a, const void *b) {
    const fm_st_tensor *x = *(fm_st_tensor *const *)a, *y = *(fm_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

void fm_st_close(fm_safetensors *st) {
    if (!st) return;
    if (st->path && st->fd >= 0) close(st->fd); /* a zeroed struct has no path */
    if (st->tensors)
        for (int i = 0; i < st->n_tensors; i++) fm_free(st->tensors[i].name);
    if (st->meta)
        for (int i = 0; i < 2 * st->n_meta; i++) fm_free(st->meta[i]);
    fm_free(st->tensors);
    fm_free(st->by_name);
    fm_free(st->meta);
    fm_free(st->path);
    memset(st, 0, sizeof *st);
    st->fd = -1;
}

/* Parses one header entry {"dtype","shape","data_offsets"} into t (name already set). */
static fm_status parse_entry(const fm_safetensors *st, const cJSON *e, fm_st_tensor *t) {
    const char *P = st->path, *N = t->name;
    if (!cJSON_IsObject(e))
        return fm_error(FM_ERR_FORMAT,
                        "%s: header entry for tensor '%s' must be a JSON object with dtype, shape "
                        "and data_offsets",
                        P, N);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *of = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt))
        return fm_error(FM_ERR_FORMAT, "%s: tensor '%s' has %s dtype; expected a string such as \"F32\"",
                        P, N, dt ? "a non-string" : "no");
    t->dtype = dtype_from_name(dt->valuestring);
    if (t->dtype < 0)
        return fm_error(FM_ERR_FORMAT,
                        "%s: tensor '%s' has unknown dtype \"%s\"; expected one of F32, F16, BF16, "
                        "F64, I64, I32, I16, I8, U64, U32, U16, U8, BOOL, F8_E4M3, F8_E5M2",
                        P, N, dt->valuestring);
    if (!cJSON_IsArray(sh))
        return fm_error(FM_ERR_FORMAT, "%s: tensor '%s' has %s shape; expected an array of sizes",
                        P, N, sh ? "a non-array" : "no");
    int nd = cJSON_GetArraySize(sh);
    if (nd > FM_ST_MAX_DIMS)
        return fm_error(FM_ERR_FORMAT, "%s: tensor '%s' has %d dimensions; at most %d are supported",
                        P, N, nd, FM_ST_MAX_DIMS);
    t->ndim = nd;
    int d = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, sh) {
        uint64_t v;
        if (!json_uint(it, &v))
            return fm_error(FM_ERR_FORMAT,
                            "%s: tensor '%s' shape[%d] is not a non-negative integer", P, N, d);
        t->shape[d++] = (int64_t)v;
    }
    if (!cJSON_IsArray(of) || cJSON_GetArraySize(of) != 2)
        return fm_error(FM_ERR_FORMAT,
                        "%s: tensor '%s' needs data_offsets [begin, end]; found %s", P, N,
                        !of ? "none" : !cJSON_IsArray(of) ? "a non-array" : "an array of the wrong length");
    if (!json_uint(cJSON_GetArrayItem(of, 0), &t->begin) ||
        !json_uint(cJSON_GetArrayItem(of, 1), &t->end))
        return fm_error(FM_ERR_FORMAT,
                        "%s: tensor '%s' data_offsets must be non-negative integers", P, N);
    if (t->begin > t->end)
        return fm_error(FM_ERR_FORMAT,
                        "%s: tensor '%s' has data_offsets [%" PRIu64 ", %" PRIu64 "] with begin > end",
                        P, N, t->begin, t->end);
    uint64_t numel, bytes;
    char sbuf[160];
    if (!shape_numel(t->ndim, t->shape, &numel) ||
        __builtin_mul_overflow(numel, (uint64_t)fm_st_dtype_size(t->dtype), &bytes))
        return fm_error(FM_ERR_FORMAT, "%s: tensor '%s' shape %s overflows a 64-bit byte count", P,
                        N, fmt_shape(sbuf, sizeof sbuf, t->ndim, t->shape));
    if (t->end - t->begin != bytes)
        return fm_error(FM_ERR_FORMAT,
                        "%s: tensor '%s' is %s %s = %" PRIu64 " bytes, but its data_offsets [%" PRIu64
                        ", %" PRIu64 ") span %" PRIu64 " bytes (corrupt header)",
                        P, N, fm_st_dtype_name(t->dtype),
                        fmt_shape(sbuf, sizeof sbuf, t->ndim, t->shape), bytes, t->begin, t->end,
                        t->end - t->begin);
    if (t->end > st->data_bytes)
        return fm_error(FM_ERR_FORMAT,
                        "%s: tensor '%s' needs bytes [%" PRIu64 ", %" PRIu64 ") but the file's data "
                        "section has only %" PRIu64 " bytes (file truncated?)",
                        P, N, t->begin, t->end, st->data_bytes);
    return FM_OK;
}

static fm_status parse_metadata(fm_safetensors *st, const cJSON *m) {
    if (!cJSON_IsObject(m))
        return fm_error(FM_ERR_FORMAT, "%s: __metadata__ must be a JSON object of strings", st->path);
    int n = cJSON_GetArraySize(m);
    st->meta = fm_malloc(sizeof(char *) * 2 * (size_t)(n > 0 ? n : 1));
    if (!st->meta)
        return fm_error(FM_ERR_NOMEM, "%s: out of memory for %d metadata entries", st->path, n);
    const cJSON *it;
    cJSON_ArrayForEach(it, m) {
        if (!cJSON_IsString(it))
            return fm_error(FM_ERR_FORMAT,
                            "%s: __metadata__ value for key '%s' is not a string (safetensors "
                            "metadata maps strings to strings)",
                            st->path, it->string);
        char *k = dup_str(it->string), *v = dup_str(it->valuestring);
        if (!k || !v) {
            fm_free(k);
            fm_free(v);
            return fm_error(FM_ERR_NOMEM, "%s: out of memory for metadata", st->path);
        }
        st->meta[2 * st->n_meta] = k;
        st->meta[2 * st->n_meta + 1] = v;
        st->n_meta++;
    }
    return FM_OK;
}

static fm_status parse_header(fm_safetensors *st, const char *hdr, size_t len) {
    const char *P = st->path;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, len, &end, false);
    if (root && end) {
        /* Only padding may follow the JSON value (spaces by the spec; NULs from some writers). */
        const char *q = end;
        while (q < hdr + len && (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r' || *q == '\0')) q++;
        if (q < hdr + len) {
            cJSON_Delete(root);
            return fm_error(FM_ERR_FORMAT,
                            "%s: header has unexpected text after its JSON object at byte %zu of "
                            "%zu (near \"%.24s\"); corrupt header",
                            P, (size_t)(q - hdr), len, q);
        }
    }
    if (!root) {
        const char *ep = cJSON_GetErrorPtr();
        if (ep && ep >= hdr && ep <= hdr + len)
            return fm_error(FM_ERR_FORMAT,
                            "%s: header is not valid JSON (error at byte %zu of %zu, near \"%.24s\"); "
                            "not a safetensors file, or a corrupt one",
                            P, (size_t)(ep - hdr), len, ep);
        return fm_error(FM_ERR_FORMAT, "%s: header (%zu bytes) is not valid JSON", P, len);
    }
    fm_status s = FM_OK;
    fm_st_tensor **order = NULL;
    if (!cJSON_IsObject(root)) {
        s = fm_error(FM_ERR_FORMAT, "%s: header must be a JSON object {name: {...}}; found another "
                                    "JSON value", P);
        goto done;
    }
    int n = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, root) if (strcmp(it->string, "__metadata__") != 0) n++;
    size_t cap = (size_t)(n > 0 ? n : 1);
    st->tensors = fm_malloc(sizeof(fm_st_tensor) * cap);
    st->by_name = fm_malloc(sizeof(int) * cap);
    order = fm_malloc(sizeof(fm_st_tensor *) * cap);
    if (!st->tensors || !st->by_name || !order) {
        s = fm_error(FM_ERR_NOMEM, "%s: out of memory for a header of %d tensors", P, n);
        goto done;
    }
    bool seen_meta = false;
    cJSON_ArrayForEach(it, root) {
        if (strcmp(it->string, "__metadata__") == 0) {
            if (seen_meta) {
                s = fm_error(FM_ERR_FORMAT, "%s: __metadata__ appears twice in the header", P);
                goto done;
            }
            seen_meta = true;
            if ((s = parse_metadata(st, it)) != FM_OK) goto done;
            continue;
        }
        fm_st_tensor *t = &st->tensors[st->n_tensors];
        t->name = dup_str(it->string);
        if (!t->name) {
            s = fm_error(FM_ERR_NOMEM, "%s: out of memory for tensor names", P);
            goto done;
        }
        st->n_tensors++;
        if ((s = parse_entry(st, it, t)) != FM_OK) goto done;
    }
    /* Names must be unique (JSON objects can repeat keys; cJSON keeps both). */
    for (int i = 0; i < n; i++) order[i] = &st->tensors[i];
    qsort(order, (size_t)n, sizeof *order, cmp_tensor_name);
    for (int i = 0; i < n; i++) {
        st->by_name[i] = (int)(order[i] - st->tensors);
        if (i > 0 && strcmp(order[i - 1]->name, order[i]->name) == 0) {
            s = fm_error(FM_ERR_FORMAT, "%s: tensor name '%s' appears twice in the header", P,
                         order[i]->name);
            goto done;
        }
    }
    /* Byte ranges must not overlap. Empty tensors occupy no bytes and overlap nothing. */
    qsort(order, (size_t)n, sizeof *order, cmp_tensor_begin);
    const fm_st_tensor *prev = NULL;
    for (int i = 0; i < n; i++) {
        const fm_st_tensor *t = order[i];
        if (t->begin == t->end) continue;
        if (prev && t->begin < prev->end) {
            s = fm_error(FM_ERR_FORMAT,
                         "%s: tensors '%s' (bytes [%" PRIu64 ", %" PRIu64 ")) and '%s' (bytes [%" PRIu64
                         ", %" PRIu64 ")) overlap in the data section (corrupt header)",
                         P, prev->name, prev->begin, prev->end, t->name, t->begin, t->end);
            goto done;
        }
        if (!prev || t->end > prev->end) prev = t;
    }
done:
    fm_free(order);
    cJSON_Delete(root);
    return s;
}

fm_status fm_st_open(fm_safetensors *st, const char *path) {
    memset(st, 0, sizeof *st);
    st->fd = -1;
    if (!path) return fm_error(FM_ERR_ARG, "fm_st_open: NULL path");
    st->path = dup_str(path);
    if (!st->path) return fm_error(FM_ERR_NOMEM, "%s: out of memory", path);
    fm_status s = FM_OK;
    char *hdr = NULL;
    st->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (st->fd < 0) {
        s = fm_error(FM_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        goto fail;
    }
    struct stat sb;
    if (fstat(st->fd, &sb) != 0) {
        s = fm_error(FM_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        s = fm_error(FM_ERR_IO, "%s: not a regular file (expected a .safetensors file)", path);
        goto fail;
    }
    st->file_bytes = (uint64_t)sb.st_size;
    if (st->file_bytes < 8) {
        s = fm_error(FM_ERR_FORMAT,
                     "%s: file is %" PRIu64 " bytes, shorter than the 8-byte header length that "
                     "starts a safetensors file (empty or truncated file?)",
                     path, st->file_bytes);
        goto fail;
    }
    unsigned char lenb[8];
    if ((s = pread_all(st, lenb, 8, 0, "the header length")) != FM_OK) goto fail;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | lenb[i];
    if (hlen > st->file_bytes - 8) {
        s = fm_error(FM_ERR_FORMAT,
                     "%s: header length field says %" PRIu64 " bytes but only %" PRIu64 " bytes "
                     "follow it (truncated file, or not a safetensors file)",
                     path, hlen, st->file_bytes - 8);
        goto fail;
    }
    if (hlen > ST_MAX_HEADER) {
        s = fm_error(FM_ERR_FORMAT,
                     "%s: header length field says %" PRIu64 " bytes, over the 100 MB limit of "
                     "safetensors (not a safetensors file?)",
                     path, hlen);
        goto fail;
    }
    st->data_start = 8 + hlen;
    st->data_bytes = st->file_bytes - st->data_start;
    hdr = fm_malloc((size_t)hlen + 1);
    if (!hdr) {
        s = fm_error(FM_ERR_NOMEM, "%s: out of memory for a %" PRIu64 "-byte header", path, hlen);
        goto fail;
    }
    if ((s = pread_all(st, hdr, (size_t)hlen, 8, "the header")) != FM_OK) goto fail;
    hdr[hlen] = '\0';
    if ((s = parse_header(st, hdr, (size_t)hlen)) != FM_OK) goto fail;
    fm_free(hdr);
    return FM_OK;
fail:
    fm_free(hdr);
    fm_st_close(st);
    return s;
}

const fm_st_tensor *fm_st_find(const fm_safetensors *st, const char *name) {
    if (!st || !st->tensors || !name) return NULL;
    int lo = 0, hi = st->n_tensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        const fm_st_tensor *t = &st->tensors[st->by_name[mid]];
        int c = strcmp(name, t->name);
        if (c == 0) return t;
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return NULL;
}

const char *fm_st_metadata(const fm_safetensors *st, const char *key) {
    if (!st || !key) return NULL;
    for (int i = 0; i < st->n_meta; i++)
        if (strcmp(st->meta[2 * i], key) == 0) return st->meta[2 * i + 1];
    return NULL;
}

/* The tensor name sharing the longest prefix with `name` (for "did you mean" messages). */
static const char *closest_name(const fm_safetensors *st, const char *name) {
    const char *best = NULL;
    size_t best_len = 0;
    for (int i = 0; i < st->n_tensors; i++) {
        const char *c = st->tensors[i].name;
        size_t k = 0;
        while (c[k] && c[k] == name[k]) k++;
        if (!best || k > best_len) {
            best = c;
            best_len = k;
        }
    }
    return best;
}

/* IEEE 754 binary16 -> binary32, exact (subnormals, inf and NaN payloads included). */
static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        float f = (float)man * 0x1p-24f; /* subnormal or zero: man * 2^-24, exact in fp32 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The tensor `name` of st after the checks of fm_st_read_f32 (present, the expected shape). */
static fm_status find_checked(const fm_safetensors *st, const char *name, int ndim, const int64_t *shape,
                              const fm_st_tensor **out) {
    if (!st || !st->path || !name)
        return fm_error(FM_ERR_ARG, "fm_st_read_f32: no open file or no tensor name");
    if (ndim < 0 || ndim > FM_ST_MAX_DIMS || (ndim > 0 && !shape))
        return fm_error(FM_ERR_ARG, "fm_st_read_f32(%s, '%s'): expected ndim 0..%d with a shape; "
                                    "got ndim %d", st->path, name, FM_ST_MAX_DIMS, ndim);
    const fm_st_tensor *t = fm_st_find(st, name);
    if (!t) {
        const char *c = closest_name(st, name);
        if (c)
            return fm_error(FM_ERR_FORMAT,
                            "%s: no tensor named '%s' (the file holds %d tensors; the closest name "
                            "is '%s'; is this checkpoint from another model type?)",
                            st->path, name, st->n_tensors, c);
        return fm_error(FM_ERR_FORMAT, "%s: no tensor named '%s' (the file holds no tensors)",
                        st->path, name);
    }
    bool same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (!same) {
        char a[160], b[160];
        return fm_error(FM_ERR_FORMAT,
                        "%s: tensor '%s' has the wrong shape: expected %s, found %s (checkpoint "
                        "written for a different config?)",
                        st->path, name, fmt_shape(a, sizeof a, ndim, shape),
                        fmt_shape(b, sizeof b, t->ndim, t->shape));
    }
    *out = t;
    return FM_OK;
}

/* Elements [first, first + numel) of tensor t into dst, converted to fp32. */
static fm_status read_span(const fm_safetensors *st, const fm_st_tensor *t, const char *name, uint64_t first,
                           uint64_t numel, float *dst) {
    size_t esz = fm_st_dtype_size(t->dtype);
    if (numel > 0 && !dst)
        return fm_error(FM_ERR_ARG, "fm_st_read_f32(%s, '%s'): NULL destination", st->path, name);
    uint64_t off = st->data_start + t->begin + first * esz;
    char what[320];
    snprintf(what, sizeof what, "tensor '%s'", name);
    switch (t->dtype) {
    case FM_ST_F32:
        return pread_all(st, dst, (size_t)(numel * 4), off, what);
    case FM_ST_F16:
    case FM_ST_BF16:
    case FM_ST_F64: break;
    default:
        return fm_error(FM_ERR_FORMAT,
                        "%s: tensor '%s' is %s; expected a float dtype (F32, F16, BF16, F64) to "
                        "read as fp32",
                        st->path, name, fm_st_dtype_name(t->dtype));
    }
    enum { CHUNK = 64 * 1024 };
    uint64_t raw[CHUNK / 8]; /* uint64 for alignment of every element type */
    size_t per = CHUNK / esz;
    for (uint64_t i = 0; i < numel; i += per) {
        size_t m = (size_t)(numel - i < per ? numel - i : per);
        FM_TRY(pread_all(st, raw, m * esz, off + i * esz, what));
        float *o = dst + i;
        if (t->dtype == FM_ST_F64) {
            const double *r = (const double *)raw;
            for (size_t j = 0; j < m; j++) o[j] = (float)r[j];
        } else if (t->dtype == FM_ST_F16) {
            const uint16_t *r = (const uint16_t *)raw;
            for (size_t j = 0; j < m; j++) o[j] = f16_to_f32(r[j]);
        } else {
            const uint16_t *r = (const uint16_t *)raw;
            for (size_t j = 0; j < m; j++) o[j] = bf16_to_f32(r[j]);
        }
    }
    return FM_OK;
}

fm_status fm_st_read_f32(const fm_safetensors *st, const char *name, float *dst, int ndim,
                         const int64_t *shape) {
    const fm_st_tensor *t;
    FM_TRY(find_checked(st, name, ndim, shape, &t));
    const size_t esz = fm_st_dtype_size(t->dtype);
    return read_span(st, t, name, 0, esz ? (t->end - t->begin) / esz : 0, dst);
}

fm_status fm_st_read_f32_range(const fm_safetensors *st, const char *name, int64_t first, int64_t count, float *dst,
                               int ndim, const int64_t *shape) {
    const fm_st_tensor *t;
    FM_TRY(find_checked(st, name, ndim, shape, &t));
    const size_t esz = fm_st_dtype_size(t->dtype);
    const int64_t numel = esz ? (int64_t)((t->end - t->begin) / esz) : 0;
    if (first < 0 || count < 0 || first > numel || count > numel - first)
        return fm_error(FM_ERR_ARG, "%s: tensor '%s': elements [%lld, %lld) are outside its %lld elements", st->path,
                        name, (long long)first, (long long)(first + count), (long long)numel);
    return read_span(st, t, name, (uint64_t)first, (uint64_t)count, dst);
}

/* ----------------------------------------------------------------------------------------- */
/* Writing                                                                                   */

/* A growable string in fm_malloc memory; `bad` records an allocation failure. */
typedef struct sbuf {
    char *p;
    size_t len, cap;
    bool bad;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->bad) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->len + n + 1) cap *= 2;
        char *q = fm_malloc(cap);
        if (!q) {
            b->bad = true;
            return;
        }
        if (b->len) memcpy(q, b->p, b->len);
        fm_free(b->p);
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

/* A JSON string literal, escaped (RFC 8259 §7). Bytes >= 0x80 pass through as UTF-8. */
static void sb_json_str(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') {
            char e[2] = {'\\', (char)*c};
            sb_put(b, e, 2);
        } else if (*c < 0x20) {
            char e[8];
            snprintf(e, sizeof e, "\\u%04x", *c);
            sb_put(b, e, 6);
        } else {
            sb_put(b, (const char *)c, 1);
        }
    }
    sb_put(b, "\"", 1);
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Checks the caller's tensors and metadata; fills bytes[i]. */
static fm_status check_write_args(const char *path, const fm_named_tensor *t, int n,
                                  const char *const *kv, uint64_t *bytes) {
    char sbuf_[160];
    for (int i = 0; i < n; i++) {
        if (!t[i].name || !t[i].name[0])
            return fm_error(FM_ERR_ARG, "%s: tensor %d has an empty name", path, i);
        if (strcmp(t[i].name, "__metadata__") == 0)
            return fm_error(FM_ERR_ARG, "%s: tensor %d is named '__metadata__', which safetensors "
                                        "reserves for metadata", path, i);
        if (t[i].ndim < 0 || t[i].ndim > FM_ST_MAX_DIMS)
            return fm_error(FM_ERR_ARG, "%s: tensor '%s' has ndim %d; expected 0..%d", path,
                            t[i].name, t[i].ndim, FM_ST_MAX_DIMS);
        uint64_t numel;
        if (!shape_numel(t[i].ndim, t[i].shape, &numel) || numel > (uint64_t)INT64_MAX / 4)
            return fm_error(FM_ERR_ARG, "%s: tensor '%s' has an invalid shape %s (negative or "
                                        "overflowing size)",
                            path, t[i].name, fmt_shape(sbuf_, sizeof sbuf_, t[i].ndim, t[i].shape));
        if (numel > 0 && !t[i].data && !t[i].fetch && !(t[i].fetch_range && t[i].stage && t[i].stage_len > 0))
            return fm_error(FM_ERR_ARG, "%s: tensor '%s' has %" PRIu64 " elements but NULL data",
                            path, t[i].name, numel);
        bytes[i] = numel * 4;
    }
    for (int i = 0; kv && kv[i]; i += 2)
        if (!kv[i + 1])
            return fm_error(FM_ERR_ARG, "%s: metadata key '%s' has no value (expected key, value, "
                                        "..., NULL)", path, kv[i]);
    return FM_OK;
}

fm_status fm_st_write(const char *path, const fm_named_tensor *t, int n,
                      const char *const *metadata_kv) {
    if (!path || !*path) return fm_error(FM_ERR_ARG, "fm_st_write: empty output path");
    if (n < 0 || (n > 0 && !t))
        return fm_error(FM_ERR_ARG, "%s: invalid tensor list (n = %d)", path, n);
    fm_status s = FM_OK;
    size_t cap = (size_t)(n > 0 ? n : 1);
    void *bounce = NULL;
    size_t bounce_cap = 0;
    uint64_t *bytes = fm_malloc(sizeof(uint64_t) * cap);
    const char **names = fm_malloc(sizeof(char *) * cap);
    sbuf h = {0};
    fm_atomic_file f = {.fd = -1};
    if (!bytes || !names) {
        s = fm_error(FM_ERR_NOMEM, "%s: out of memory for a header of %d tensors", path, n);
        goto done;
    }
    if ((s = check_write_args(path, t, n, metadata_kv, bytes)) != FM_OK) goto done;
    for (int i = 0; i < n; i++) names[i] = t[i].name;
    qsort(names, (size_t)n, sizeof *names, cmp_str_ptr);
    for (int i = 1; i < n; i++)
        if (strcmp(names[i - 1], names[i]) == 0) {
            s = fm_error(FM_ERR_ARG, "%s: tensor name '%s' is given twice", path, names[i]);
            goto done;
        }

    /* Header: {"__metadata__":{...},"name":{"dtype":"F32","shape":[...],"data_offsets":[b,e]},...} */
    bool has_format = false;
    for (int i = 0; metadata_kv && metadata_kv[i]; i += 2)
        if (strcmp(metadata_kv[i], "format") == 0) has_format = true;
    sb_str(&h, "{\"__metadata__\":{");
    bool first = true;
    if (!has_format) {
        sb_str(&h, "\"format\":\"pt\"");
        first = false;
    }
    for (int i = 0; metadata_kv && metadata_kv[i]; i += 2) {
        if (!first) sb_str(&h, ",");
        first = false;
        sb_json_str(&h, metadata_kv[i]);
        sb_str(&h, ":");
        sb_json_str(&h, metadata_kv[i + 1]);
    }
    sb_str(&h, "}");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        char num[64];
        sb_str(&h, ",");
        sb_json_str(&h, t[i].name);
        sb_str(&h, ":{\"dtype\":\"F32\",\"shape\":[");
        for (int d = 0; d < t[i].ndim; d++) {
            snprintf(num, sizeof num, "%s%" PRId64, d ? "," : "", t[i].shape[d]);
            sb_str(&h, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off,
                 off + bytes[i]);
        sb_str(&h, num);
        off += bytes[i];
    }
    sb_str(&h, "}");
    while (!h.bad && h.len % 8 != 0) sb_str(&h, " "); /* data buffer starts 8-byte aligned */
    if (h.bad) {
        s = fm_error(FM_ERR_NOMEM, "%s: out of memory building the header", path);
        goto done;
    }

    unsigned char lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)((uint64_t)h.len >> (8 * i));
    if ((s = fm_atomic_open(&f, path)) != FM_OK) goto done;
    if ((s = fm_atomic_write(&f, lenb, 8)) != FM_OK) goto done;
    if ((s = fm_atomic_write(&f, h.p, h.len)) != FM_OK) goto done;
    for (int i = 0; i < n; i++) {
        const void *src = t[i].data;
        if (!src && bytes[i] > 0 && t[i].fetch_range) { /* streamed through the caller's stage */
            const int64_t numel = (int64_t)(bytes[i] / 4);
            for (int64_t a = 0; a < numel && s == FM_OK; a += t[i].stage_len) {
                const int64_t cnt = numel - a < t[i].stage_len ? numel - a : t[i].stage_len;
                s = t[i].fetch_range(t[i].fetch_ctx, a, cnt, t[i].stage);
                if (s == FM_OK) s = fm_atomic_write(&f, t[i].stage, 4 * (size_t)cnt);
            }
            if (s != FM_OK) goto done;
            continue;
        }
        if (!src && bytes[i] > 0) { /* a fetched tensor: through one bounce buffer, grown as needed */
            if (bytes[i] > bounce_cap) {
                fm_free(bounce);
                bounce_cap = (size_t)bytes[i];
                bounce = fm_malloc(bounce_cap);
                if (!bounce) {
                    s = fm_error(FM_ERR_NOMEM, "%s: cannot allocate %zu bytes to stage tensor '%s'", path, bounce_cap,
                                 t[i].name);
                    goto done;
                }
            }
            t[i].fetch(t[i].fetch_ctx, bounce);
            src = bounce;
        }
        if ((s = fm_atomic_write(&f, src, (size_t)bytes[i])) != FM_OK) goto done;
    }
    s = fm_atomic_commit(&f);
done:
    if (s != FM_OK) fm_atomic_abort(&f);
    fm_free(h.p);
    fm_free(names);
    fm_free(bounce);
    fm_free(bytes);
    return s;
}
