/* libFuzzer harness: safetensors files (io/fm_safetensors.c): fm_st_open's header checks, then
 * reads. The input is the whole file. fm_st_open promises that a file it opens holds no malformed
 * tensor, so every float tensor of an opened file must then read (whole, and a range of it), and
 * an integer one must be refused as FM_ERR_FORMAT, never crash. */
#include "fm_fuzz.h"
#include "io/fm_safetensors.h"

#define FUZZ_MAX_ELEMS (1 << 16) /* read tensors of up to this many elements */

static float g_buf[FUZZ_MAX_ELEMS];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_write("t.safetensors", data, size);
    fm_safetensors st;
    if (fm_st_open(&st, path) != FM_OK) {
        FUZZ_CHECK(st.tensors == NULL && st.fd < 0, "a refused file was left open");
        return 0;
    }
    for (int i = 0; i < st.n_tensors; i++) {
        const fm_st_tensor *t = &st.tensors[i];
        FUZZ_CHECK(fm_st_find(&st, t->name) == t, "fm_st_find(%s) does not find it", t->name);
        int64_t numel = 1;
        for (int d = 0; d < t->ndim && numel <= FUZZ_MAX_ELEMS; d++) numel *= t->shape[d];
        FUZZ_CHECK(t->end - t->begin == (uint64_t)numel * fm_st_dtype_size(t->dtype) || numel > FUZZ_MAX_ELEMS,
                   "%s: %lld elements in %llu bytes", t->name, (long long)numel,
                   (unsigned long long)(t->end - t->begin));
        if (numel > FUZZ_MAX_ELEMS) continue;
        const bool is_float = t->dtype == FM_ST_F32 || t->dtype == FM_ST_F16 || t->dtype == FM_ST_BF16 ||
                              t->dtype == FM_ST_F64;
        fm_status s = fm_st_read_f32(&st, t->name, g_buf, t->ndim, t->shape);
        FUZZ_CHECK(is_float ? s == FM_OK : s == FM_ERR_FORMAT, "%s: read: %s", t->name, fm_errmsg());
        if (numel > 1) {
            s = fm_st_read_f32_range(&st, t->name, numel / 2, numel - numel / 2, g_buf, t->ndim, t->shape);
            FUZZ_CHECK(is_float ? s == FM_OK : s == FM_ERR_FORMAT, "%s: range read: %s", t->name, fm_errmsg());
            s = fm_st_read_f32_range(&st, t->name, numel / 2, numel, g_buf, t->ndim, t->shape);
            FUZZ_CHECK(s != FM_OK, "%s: a range past the tensor was read", t->name);
        }
    }
    for (int i = 0; i < st.n_meta; i++) FUZZ_CHECK(fm_st_metadata(&st, st.meta[2 * i]) != NULL, "metadata key lost");
    fm_st_close(&st);
    return 0;
}
