/* Token data sets: loading a list of sources, views, windows and the rank-aware cursor. See
 * fm_data.h for the formats and the API contract; one source is read by fm_data_files.c. */
#include "fm_data_internal.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* The part holding token g of the concatenation (binary search over the parts' starts). */
static int part_of(const fm_dataset *ds, int64_t g) {
    int lo = 0, hi = ds->n_parts - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (ds->parts[mid].start <= g) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static void convert(const fm_data_part *p, int64_t i0, int64_t n, int32_t *dst) {
#define CV(T)                                                              \
    do {                                                                   \
        const T *x = (const T *)p->tokens + i0;                            \
        for (int64_t i = 0; i < n; i++) dst[i] = (int32_t)x[i];            \
    } while (0)
    switch (p->type) {
    case FM_TOK_U8: CV(uint8_t); break;
    case FM_TOK_I8: CV(int8_t); break;
    case FM_TOK_U16: CV(uint16_t); break;
    case FM_TOK_I16: CV(int16_t); break;
    case FM_TOK_U32: CV(uint32_t); break;
    case FM_TOK_I32: memcpy(dst, (const int32_t *)p->tokens + i0, sizeof(int32_t) * (size_t)n); break;
    default: CV(int64_t); break;
    }
#undef CV
}

/* dst[0..n) = tokens [start, start + n) of the data set (relative to ds->begin); with `masked`,
 * a token whose mask byte is 0 becomes FM_IGNORE_INDEX. */
static void copy_range(const fm_dataset *ds, int64_t start, int64_t n, int32_t *dst, bool masked) {
    int64_t g = ds->begin + start;
    int k = part_of(ds, g);
    while (n > 0) {
        const fm_data_part *p = &ds->parts[k];
        const int64_t i0 = g - p->start, m = p->n - i0 < n ? p->n - i0 : n;
        convert(p, i0, m, dst);
        if (masked && p->mask)
            for (int64_t i = 0; i < m; i++)
                if (!p->mask[i0 + i]) dst[i] = FM_IGNORE_INDEX;
        if (p->map) fm_data_part_drop(p, i0, m); /* the window is copied: its pages leave the RSS */
        dst += m;
        g += m;
        n -= m;
        k++;
    }
}

void fm_dataset_tokens(const fm_dataset *ds, int64_t start, int64_t n, int32_t *dst) {
    FM_ASSERT(ds && dst && start >= 0 && n >= 0 && start + n <= ds->n_tokens);
    if (n > 0) copy_range(ds, start, n, dst, false);
}

void fm_dataset_targets(const fm_dataset *ds, int64_t start, int64_t n, int32_t *dst) {
    FM_ASSERT(ds && dst && start >= 0 && n >= 0 && start + n <= ds->n_tokens);
    if (n > 0) copy_range(ds, start, n, dst, true);
}

int fm_dataset_mask_at(const fm_dataset *ds, int64_t i) {
    FM_ASSERT(ds && i >= 0 && i < ds->n_tokens);
    const int64_t g = ds->begin + i;
    const fm_data_part *p = &ds->parts[part_of(ds, g)];
    return p->mask ? p->mask[g - p->start] : 1;
}

void fm_dataset_free(fm_dataset *ds) {
    if (!ds) return;
    if (ds->docs_owned) fm_free(ds->docs);
    if (ds->owns) {
        for (int i = 0; i < ds->n_parts; i++) fm_data_part_release(&ds->parts[i]);
        fm_free(ds->parts);
    }
    memset(ds, 0, sizeof *ds);
}

/* Appends printf text to desc at *at, truncating at the buffer's end. */
static void desc_add(char *desc, size_t cap, size_t *at, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
#include <stdarg.h>
static void desc_add(char *desc, size_t cap, size_t *at, const char *fmt, ...) {
    if (*at >= cap - 1) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(desc + *at, cap - *at, fmt, ap);
    va_end(ap);
    if (k > 0) *at = *at + (size_t)k < cap - 1 ? *at + (size_t)k : cap - 1;
}

fm_status fm_dataset_load(fm_dataset *ds, const char *const *paths, int n_paths, int64_t vocab_size) {
    FM_ASSERT(ds != NULL);
    memset(ds, 0, sizeof *ds);
    if (n_paths <= 0 || paths == NULL)
        return fm_error(FM_ERR_ARG, "data: no files given (n_paths = %d); expected at least one text file, llm.c "
                        "shard or Megatron PREFIX: pass --data PATH", n_paths);
    if (vocab_size < 1 || vocab_size > ((int64_t)1 << 31))
        return fm_error(FM_ERR_ARG, "data: vocab_size is %" PRId64 "; expected 1 .. 2^31; check the model "
                        "config's vocab_size", vocab_size);
    fm_dataset d = {0};
    d.parts = fm_malloc(sizeof(fm_data_part) * (size_t)n_paths);
    if (!d.parts) return fm_error(FM_ERR_NOMEM, "data: out of memory for %d file entries", n_paths);
    d.owns = true;
    d.world = 1;
    fm_status s = FM_OK;
    int n_kind[3] = {0, 0, 0}, n_v1 = 0, n_v7 = 0, n_mask = 0, first_text = -1, first_tok = -1;
    int64_t total = 0;
    for (int i = 0; i < n_paths; i++) {
        if (!paths[i]) {
            s = fm_error(FM_ERR_ARG, "data: file %d of %d is NULL; expected a path", i + 1, n_paths);
            goto fail;
        }
        fm_src_kind kind;
        int version;
        char mpath[4200];
        s = fm_data_open_source(paths[i], vocab_size, &d.parts[i], &kind, &version, mpath, sizeof mpath);
        if (s != FM_OK) goto fail;
        d.n_parts = i + 1;
        d.parts[i].start = total;
        total += d.parts[i].n;
        n_kind[kind]++;
        if (kind == FM_SRC_TEXT && first_text < 0) first_text = i;
        if (kind != FM_SRC_TEXT && first_tok < 0) first_tok = i;
        if (first_text >= 0 && first_tok >= 0) {
            s = fm_error(FM_ERR_ARG, "data: cannot mix byte-level text and token files: %s is text but %s holds "
                         "token ids; expected every file of one data set to be the same kind: tokenize the text "
                         "(`flatmoe prepare`) or pass only text files", paths[first_text], paths[first_tok]);
            goto fail;
        }
        if (kind == FM_SRC_TEXT && vocab_size < 256) {
            s = fm_error(FM_ERR_ARG, "%s: byte-level text needs vocab_size >= 256 (one token per byte), but "
                         "vocab_size is %" PRId64 "; use a config with vocab_size >= 256 or tokenize the "
                         "text into llm.c shards", paths[i], vocab_size);
            goto fail;
        }
        n_v1 += version == 1;
        n_v7 += version == 7;
        n_mask += mpath[0] != 0;
    }
    d.n_tokens = total;
    d.has_mask = n_mask > 0;
    if ((s = fm_dataset_build_docs(&d))) goto fail;
    size_t at = 0;
    char *desc = d.desc;
    const size_t cap = sizeof d.desc;
    if (n_kind[FM_SRC_TEXT]) {
        desc_add(desc, cap, &at, "%d text file%s, %" PRId64 " tokens (bytes)", n_paths, n_paths == 1 ? "" : "s", total);
    } else {
        const int ns = n_kind[FM_SRC_SHARD], nm = n_kind[FM_SRC_MEGATRON];
        if (ns)
            desc_add(desc, cap, &at, "%d llm.c shard%s (%s)", ns, ns == 1 ? "" : "s",
                     n_v7 == 0 ? "v1 uint16" : n_v1 == 0 ? "v7 uint32" : "v1 uint16 + v7 uint32");
        if (nm) desc_add(desc, cap, &at, "%s%d Megatron data set%s", ns ? " + " : "", nm, nm == 1 ? "" : "s");
        desc_add(desc, cap, &at, ", %" PRId64 " tokens, memory-mapped", total);
        if (n_mask) desc_add(desc, cap, &at, ", loss mask on %d of %d", n_mask, n_paths);
        if (d.docs) desc_add(desc, cap, &at, ", %" PRId64 " documents", d.n_docs);
    }
    *ds = d;
    return FM_OK;
fail:
    fm_dataset_free(&d);
    return s;
}

fm_status fm_dataset_from_tokens(fm_dataset *ds, const int32_t *tokens, int64_t n, const char *desc) {
    FM_ASSERT(ds != NULL);
    memset(ds, 0, sizeof *ds);
    if (n < 1 || !tokens) return fm_error(FM_ERR_ARG, "data: %" PRId64 " tokens; expected >= 1", n);
    ds->parts = fm_malloc(sizeof(fm_data_part));
    if (!ds->parts) return fm_error(FM_ERR_NOMEM, "data: out of memory");
    memset(ds->parts, 0, sizeof(fm_data_part));
    ds->parts[0].tokens = tokens;
    ds->parts[0].type = FM_TOK_I32;
    ds->parts[0].n = n;
    ds->n_parts = 1;
    ds->n_tokens = n;
    ds->owns = true;
    ds->world = 1;
    snprintf(ds->desc, sizeof ds->desc, "%s", desc ? desc : "tokens");
    return FM_OK;
}

/* Copies src into dst[256] with a prefix, truncating src as needed without compiler warnings. */
static void view_desc(char *dst, size_t cap, const char *what, int64_t n, const char *src) {
    int k = snprintf(dst, cap, "%s of %" PRId64 " tokens from ", what, n);
    if (k < 0 || (size_t)k >= cap) return;
    size_t room = cap - (size_t)k - 1, len = strlen(src);
    if (len > room) len = room;
    memcpy(dst + k, src, len);
    dst[(size_t)k + len] = '\0';
}

fm_status fm_dataset_split(const fm_dataset *all, double val_fraction, fm_dataset *train, fm_dataset *val) {
    FM_ASSERT(all && train && val);
    if (!(val_fraction > 0.0 && val_fraction < 1.0))
        return fm_error(FM_ERR_ARG, "validation fraction is %g; expected a value in (0, 1), e.g. 0.1; "
                        "or pass --val-data", val_fraction);
    int64_t n = all->n_tokens;
    int64_t n_val = (int64_t)llround((double)n * val_fraction);
    int64_t n_train = n - n_val;
    if (n_val < 1 || n_train < 1)
        return fm_error(FM_ERR_ARG, "data: splitting %" PRId64 " tokens with validation fraction %g leaves "
                        "%" PRId64 " training and %" PRId64 " validation tokens; expected both > 0: "
                        "use more data, another fraction, or pass --val-data",
                        n, val_fraction, n_train, n_val);
    fm_dataset t = *all, v = *all;
    t.owns = v.owns = false;
    t.n_tokens = n_train;
    v.begin = all->begin + n_train;
    v.n_tokens = n_val;
    view_desc(t.desc, sizeof t.desc, "train split", n_train, all->desc);
    view_desc(v.desc, sizeof v.desc, "validation split", n_val, all->desc);
    fm_status s = fm_dataset_view_docs(all, &t);
    if (s == FM_OK) s = fm_dataset_view_docs(all, &v);
    if (s != FM_OK) {
        fm_dataset_free(&t); /* views: only their document tables */
        fm_dataset_free(&v);
        return s;
    }
    *train = t;
    *val = v;
    return FM_OK;
}

fm_status fm_dataset_set_ranks(fm_dataset *ds, int rank, int world) {
    FM_ASSERT(ds != NULL);
    if (world < 1 || rank < 0 || rank >= world)
        return fm_error(FM_ERR_ARG, "data: rank %d of %d ranks; expected 0 <= rank < ranks", rank, world);
    ds->rank = rank;
    ds->world = world;
    return FM_OK;
}

fm_status fm_dataset_set_seq_slice(fm_dataset *ds, int part, int parts) {
    FM_ASSERT(ds != NULL);
    if (parts < 1 || part < 0 || part >= parts)
        return fm_error(FM_ERR_ARG, "data: sequence slice %d of %d; expected 0 <= slice < slices", part, parts);
    ds->seq_part = part;
    ds->seq_parts = parts;
    return FM_OK;
}

/* The slice of a window of T tokens this data set keeps: its offset and length. */
static void seq_slice(const fm_dataset *ds, int64_t T, int64_t *off, int64_t *len) {
    const int64_t P = ds->seq_parts > 0 ? ds->seq_parts : 1;
    FM_ASSERT(T % P == 0 && ds->seq_part >= 0 && ds->seq_part < P);
    *len = T / P;
    *off = (int64_t)ds->seq_part * *len;
}

fm_status fm_dataset_check_windows(const fm_dataset *ds, int64_t seq_len, const char *what) {
    FM_ASSERT(ds != NULL);
    if (!what) what = "data";
    if (seq_len < 1)
        return fm_error(FM_ERR_ARG, "--seq-len is %" PRId64 "; expected >= 1", seq_len);
    if (ds->n_tokens < seq_len + 1)
        return fm_error(FM_ERR_ARG, "%s: %" PRId64 " tokens, but --seq-len %" PRId64 " needs at least %" PRId64
                        "; use a shorter --seq-len or more data", what, ds->n_tokens, seq_len, seq_len + 1);
    return FM_OK;
}

void fm_dataset_sample_batch(const fm_dataset *ds, fm_rng *rng, int64_t B, int64_t T,
                             int32_t *inputs, int32_t *targets) {
    FM_ASSERT(ds && rng && inputs && targets);
    FM_ASSERT(B >= 1 && T >= 1);
    FM_ASSERT(ds->n_tokens >= T + 1);
    const int world = ds->world > 0 ? ds->world : 1;
    FM_ASSERT(ds->rank >= 0 && ds->rank < world);
    const uint64_t n_starts = (uint64_t)(ds->n_tokens - T); /* s in [0, n_tokens - T - 1] */
    const int64_t mine = (int64_t)ds->rank * B;
    int64_t off, len;
    seq_slice(ds, T, &off, &len);
    for (int64_t j = 0; j < (int64_t)world * B; j++) {
        const int64_t s = (int64_t)fm_rng_below(rng, n_starts);
        if (j < mine || j >= mine + B) continue; /* another rank's window */
        const int64_t b = j - mine;
        copy_range(ds, s + off, len, inputs + b * len, false);
        copy_range(ds, s + off + 1, len, targets + b * len, true);
    }
}

int64_t fm_dataset_eval_windows(const fm_dataset *ds, int64_t T) {
    FM_ASSERT(ds != NULL && T >= 1);
    if (ds->n_tokens < 1) return 0;
    return (ds->n_tokens - 1) / T;
}

void fm_dataset_eval_batch(const fm_dataset *ds, int64_t first_window, int64_t B, int64_t T,
                           int32_t *inputs, int32_t *targets, int64_t *n_filled) {
    FM_ASSERT(ds && inputs && targets && n_filled);
    FM_ASSERT(B >= 1 && T >= 1 && first_window >= 0);
    int64_t nw = fm_dataset_eval_windows(ds, T);
    int64_t rows = 0, off, len;
    seq_slice(ds, T, &off, &len);
    for (int64_t w = first_window; w < nw && rows < B; w++, rows++) {
        copy_range(ds, w * T + off, len, inputs + rows * len, false);
        copy_range(ds, w * T + off + 1, len, targets + rows * len, true);
    }
    *n_filled = rows;
}
