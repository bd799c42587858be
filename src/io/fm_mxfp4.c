/* MXFP4 blocks and scales to fp32 (fm_mxfp4.h). */
#include "fm_mxfp4.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* E2M1 (OCP MX v1.0 §5.3.3): sign, 2 exponent bits (bias 1), 1 mantissa bit. */
static const float k_e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

fm_status fm_mxfp4_dequant(float *out, const uint8_t *blocks, const uint8_t *scales, int64_t rows, int64_t G,
                           const char *what) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < G; g++) {
            const int s = scales[r * G + g];
            if (s == 255)
                return fm_error(FM_ERR_FORMAT, "%s: row %lld block %lld has the E8M0 scale 255 (NaN); expected an "
                                "MXFP4 checkpoint's exponent in [0, 254]", what, (long long)r, (long long)g);
            const uint8_t *b = blocks + (r * G + g) * 16;
            float *o = out + (r * G + g) * 32;
            for (int j = 0; j < 16; j++) {
                o[2 * j] = ldexpf(k_e2m1[b[j] & 15], s - 127);
                o[2 * j + 1] = ldexpf(k_e2m1[b[j] >> 4], s - 127);
                if (!isfinite(o[2 * j]) || !isfinite(o[2 * j + 1]))
                    return fm_error(FM_ERR_FORMAT, "%s: row %lld block %lld: the scale 2^%d makes a value infinite in "
                                    "fp32", what, (long long)r, (long long)g, s - 127);
            }
        }
    return FM_OK;
}

fm_status fm_st_read_u8(const fm_safetensors *st, const char *name, uint8_t *dst, int ndim, const int64_t *shape) {
    const fm_st_tensor *t = fm_st_find(st, name);
    if (!t) return fm_error(FM_ERR_FORMAT, "%s: no tensor named '%s'", st->path, name);
    bool same = t->ndim == ndim && t->dtype == FM_ST_U8;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (!same) {
        char a[128] = "", b[128] = "";
        size_t ia = 0, ib = 0;
        for (int i = 0; i < ndim; i++) ia += (size_t)snprintf(a + ia, sizeof a - ia, "%s%" PRId64, i ? ", " : "", shape[i]);
        for (int i = 0; i < t->ndim; i++)
            ib += (size_t)snprintf(b + ib, sizeof b - ib, "%s%" PRId64, i ? ", " : "", t->shape[i]);
        return fm_error(FM_ERR_FORMAT, "%s: tensor '%s': expected U8 [%s] (MXFP4 blocks or scales), found %s [%s]",
                        st->path, name, a, fm_st_dtype_name(t->dtype), b);
    }
    uint64_t n = t->end - t->begin, done = 0;
    while (done < n) {
        const ssize_t got = pread(st->fd, dst + done, (size_t)(n - done), (off_t)(st->data_start + t->begin + done));
        if (got <= 0)
            return fm_error(FM_ERR_IO, "%s: reading tensor '%s': %s", st->path, name,
                            got < 0 ? strerror(errno) : "unexpected end of file");
        done += (uint64_t)got;
    }
    return FM_OK;
}
