/* Flat parameter buffer <-> Hugging Face safetensors tensors (see fm_hf_weights.h): naming the
 * table's tensors, opening a model's files (one file, or a folder with an index and shards) and
 * reading the table from them. */
#include "fm_hf_weights.h"

#include "../core/fm_log.h"
#include "fm_mxfp4.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

fm_status fm_hf_name_tensors(const fm_hf_table *t, const float *base, const char *prefix,
                             fm_named_tensor *out, char (*names)[FM_HF_NAME_CAP]) {
    for (int i = 0; i < t->n_params; i++) {
        const fm_hf_param *p = &t->params[i];
        if (snprintf(names[i], FM_HF_NAME_CAP, "%s%s", prefix, p->name) >= FM_HF_NAME_CAP)
            return fm_error(FM_ERR_ARG, "tensor name '%s%s' is longer than %d characters", prefix, p->name,
                            FM_HF_NAME_CAP - 1);
        out[i].name = names[i];
        out[i].data = base ? base + p->offset : NULL;
        out[i].fetch = NULL;
        out[i].fetch_ctx = NULL;
        out[i].fetch_range = NULL;
        out[i].stage = NULL;
        out[i].stage_len = 0;
        out[i].ndim = p->ndim;
        memset(out[i].shape, 0, sizeof out[i].shape);
        for (int d = 0; d < p->ndim; d++) out[i].shape[d] = p->shape[d];
    }
    return FM_OK;
}

/* ---- opening a model's files ---------------------------------------------------------------- */

void fm_hf_files_close(fm_hf_files *f) {
    if (!f) return;
    for (int i = 0; i < f->n; i++) fm_st_close(&f->st[i]);
    fm_free(f->st);
    memset(f, 0, sizeof *f);
}

static bool is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static bool is_file(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

static fm_status read_text(const char *path, char **out) {
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) return fm_error(FM_ERR_IO, "%s: cannot open", path);
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *s = n >= 0 ? fm_malloc((size_t)n + 1) : NULL;
    if (!s) {
        fclose(fp);
        return fm_error(FM_ERR_NOMEM, "%s: cannot read %ld bytes", path, n);
    }
    size_t got = fread(s, 1, (size_t)n, fp);
    fclose(fp);
    s[got] = 0;
    *out = s;
    return FM_OK;
}

/* Opens the shards of DIR/model.safetensors.index.json. */
static fm_status open_index(fm_hf_files *f, const char *dir, const char *index) {
    char *text;
    FM_TRY(read_text(index, &text));
    cJSON *j = cJSON_Parse(text);
    fm_free(text);
    const cJSON *wm = j ? cJSON_GetObjectItemCaseSensitive(j, "weight_map") : NULL;
    fm_status s = FM_OK;
    if (!cJSON_IsObject(wm)) {
        cJSON_Delete(j);
        return fm_error(FM_ERR_FORMAT, "%s: %s; expected a JSON object with a \"weight_map\" object (tensor name -> "
                        "shard file), as transformers' save_pretrained writes it", index,
                        j ? "no \"weight_map\" object" : "malformed JSON");
    }
    int n_entries = cJSON_GetArraySize(wm);
    const char **shards = fm_malloc(sizeof(char *) * (size_t)(n_entries > 0 ? n_entries : 1));
    int n_shards = 0;
    if (!shards) s = fm_error(FM_ERR_NOMEM, "%s: out of memory", index);
    for (const cJSON *e = wm->child; e && s == FM_OK; e = e->next) {
        if (!cJSON_IsString(e) || !e->valuestring[0] || e->valuestring[0] == '/' || strstr(e->valuestring, "..")) {
            s = fm_error(FM_ERR_FORMAT, "%s: weight_map[\"%s\"] must name a shard file in the folder (a relative "
                         "name such as \"model-00001-of-00002.safetensors\")", index, e->string ? e->string : "?");
            break;
        }
        int k = 0;
        while (k < n_shards && strcmp(shards[k], e->valuestring)) k++;
        if (k == n_shards) shards[n_shards++] = e->valuestring;
    }
    if (s == FM_OK && n_shards == 0)
        s = fm_error(FM_ERR_FORMAT, "%s: weight_map is empty; expected at least one tensor", index);
    if (s == FM_OK && !(f->st = fm_malloc(sizeof(fm_safetensors) * (size_t)n_shards)))
        s = fm_error(FM_ERR_NOMEM, "%s: out of memory", index);
    for (int k = 0; k < n_shards && s == FM_OK; k++) {
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", dir, shards[k]);
        s = fm_st_open(&f->st[k], p);
        if (s == FM_OK) f->n = k + 1;
    }
    for (const cJSON *e = wm->child; e && s == FM_OK; e = e->next) { /* the index must tell the truth */
        int k = 0;
        while (strcmp(shards[k], e->valuestring)) k++;
        if (!fm_st_find(&f->st[k], e->string))
            s = fm_error(FM_ERR_FORMAT, "%s: places tensor '%s' in %s, but that shard does not hold it; the index "
                         "and the shards do not belong together: save the model again", index, e->string,
                         f->st[k].path);
    }
    fm_free(shards);
    cJSON_Delete(j);
    return s;
}

fm_status fm_hf_files_open(fm_hf_files *f, const char *path) {
    memset(f, 0, sizeof *f);
    fm_status s;
    if (!is_dir(path)) {
        if (!(f->st = fm_malloc(sizeof(fm_safetensors)))) return fm_error(FM_ERR_NOMEM, "%s: out of memory", path);
        s = fm_st_open(&f->st[0], path);
        if (s == FM_OK) f->n = 1;
        snprintf(f->where, sizeof f->where, "%s", path);
    } else {
        char one[4300], index[4300];
        snprintf(one, sizeof one, "%s/model.safetensors", path);
        snprintf(index, sizeof index, "%s/model.safetensors.index.json", path);
        if (is_file(one)) {
            if (!(f->st = fm_malloc(sizeof(fm_safetensors)))) return fm_error(FM_ERR_NOMEM, "%s: out of memory", one);
            s = fm_st_open(&f->st[0], one);
            if (s == FM_OK) f->n = 1;
            snprintf(f->where, sizeof f->where, "%s", one);
        } else if (is_file(index)) {
            s = open_index(f, path, index);
            snprintf(f->where, sizeof f->where, "%s", index);
        } else {
            return fm_error(FM_ERR_IO, "%s: holds neither model.safetensors nor model.safetensors.index.json; expected "
                            "a Hugging Face model folder (save_pretrained with safetensors) or a flatmoe checkpoint "
                            "folder", path);
        }
    }
    if (s != FM_OK) fm_hf_files_close(f);
    return s;
}

/* ---- reading the table ---------------------------------------------------------------------- */

static const char *fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t at = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (at < cap) snprintf(buf + at, cap - at, "]");
    return buf;
}

/* A reading in progress: the files, which of their tensors were used, the options. */
typedef struct reader {
    const fm_hf_table *t;
    const fm_hf_files *f;
    bool **used;  /* [f->n][n_tensors of file] */
    const fm_hf_read_opts *o;
} reader;

/* The file holding `name` (its index in *k and the tensor), or NULL. */
static const fm_st_tensor *find(const reader *r, const char *name, int *k) {
    for (int i = 0; i < r->f->n; i++) {
        const fm_st_tensor *x = fm_st_find(&r->f->st[i], name);
        if (x) {
            *k = i;
            return x;
        }
    }
    return NULL;
}

/* The closest name of any file to `name` (the longest shared prefix). */
static const char *closest(const reader *r, const char *name) {
    const char *best = NULL;
    size_t best_len = 0;
    for (int k = 0; k < r->f->n; k++)
        for (int i = 0; i < r->f->st[k].n_tensors; i++) {
            const char *c = r->f->st[k].tensors[i].name;
            size_t n = 0;
            while (c[n] && c[n] == name[n]) n++;
            if (!best || n > best_len) {
                best = c;
                best_len = n;
            }
        }
    return best;
}

/* Reads tensor `name` of shape [ndim] into dst, checking presence, shape and dtype first. */
static fm_status read_tensor(reader *r, const char *name, float *dst, int ndim, const int64_t *shape) {
    int k = 0;
    const fm_st_tensor *x = find(r, name, &k);
    char a[160], b[160];
    if (!x) {
        const char *c = closest(r, name);
        return fm_error(FM_ERR_FORMAT, "%s: no tensor named '%s' (expected shape %s for this %s model%s%s%s); a missing "
                        "tensor is never initialized at random: save the complete model again, or check that "
                        "config.json belongs to these weights", r->f->where, name, fmt_shape(a, sizeof a, ndim, shape),
                        r->t->model_desc, c ? "; the closest name is '" : "", c ? c : "", c ? "'" : "");
    }
    const char *path = r->f->st[k].path;
    bool same = x->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = x->shape[i] == shape[i];
    if (!same)
        return fm_error(FM_ERR_FORMAT, "%s: tensor '%s' has the wrong shape: expected %s, found %s (dtype %s); the weights "
                        "were written for a different config: check that config.json (hidden_size, num_experts, "
                        "moe_intermediate_size, ...) belongs to them", path, name, fmt_shape(a, sizeof a, ndim, shape),
                        fmt_shape(b, sizeof b, x->ndim, x->shape), fm_st_dtype_name(x->dtype));
    const bool fl = x->dtype == FM_ST_F32 || x->dtype == FM_ST_BF16 || x->dtype == FM_ST_F16 || x->dtype == FM_ST_F64;
    if (!fl)
        return fm_error(FM_ERR_FORMAT, "%s: tensor '%s' (shape %s) has dtype %s; expected F32, BF16 or F16 (F64 is read "
                        "too)%s", path, name, fmt_shape(a, sizeof a, ndim, shape), fm_st_dtype_name(x->dtype),
                        r->o && r->o->float_only ? ": save the model in one of them, e.g. "
                        "model.to(torch.bfloat16).save_pretrained(DIR), without quantization" : "");
    FM_TRY(fm_st_read_f32(&r->f->st[k], name, dst, ndim, shape));
    r->used[k][x - r->f->st[k].tensors] = true;
    return FM_OK;
}

/* Reads layer l's fused expert tensors into the stacked gate, up and down buffers; tmp holds
 * E*2I*H floats. */
static fm_status read_fused(reader *r, const char *prefix, int64_t l, float *tmp, float *base) {
    const fm_hf_table *t = r->t;
    const int64_t E = t->n_experts, H = t->hidden, I = t->expert_width;
    const int64_t gu_shape[3] = {E, 2 * I, H}, d_shape[3] = {E, H, I};
    char name[256];
    snprintf(name, sizeof name, "%smodel.layers.%lld.%s.experts.gate_up_proj", prefix, (long long)l, t->moe_module);
    FM_TRY(read_tensor(r, name, tmp, 3, gu_shape));
    const fm_hf_experts *x = &t->experts[l];
    for (int64_t e = 0; e < E; e++) {
        memcpy(base + x->gate + e * I * H, tmp + e * 2 * I * H, sizeof(float) * (size_t)(I * H));
        memcpy(base + x->up + e * I * H, tmp + e * 2 * I * H + I * H, sizeof(float) * (size_t)(I * H));
    }
    snprintf(name, sizeof name, "%smodel.layers.%lld.%s.experts.down_proj", prefix, (long long)l, t->moe_module);
    return read_tensor(r, name, base + x->down, 3, d_shape);
}

/* ---- gpt_oss's fused experts (fm_hf_weights.h) ---------------------------------------------- */

/* Reads U8 tensor `name` (MXFP4 blocks or scales) of the files, marking it used. */
static fm_status read_u8(reader *r, const char *name, uint8_t *dst, int ndim, const int64_t *shape) {
    int k = 0;
    const fm_st_tensor *x = find(r, name, &k);
    if (!x) return fm_error(FM_ERR_FORMAT, "%s: no tensor named '%s' (an MXFP4 tensor's blocks and scales come in "
                            "pairs)", r->f->where, name);
    FM_TRY(fm_st_read_u8(&r->f->st[k], name, dst, ndim, shape));
    r->used[k][x - r->f->st[k].tensors] = true;
    return FM_OK;
}

/* Expert matrix `proj` of layer l as fp32 rows [E, rows, cols] (rows x cols the MXFP4 layout's:
 * gate_up 2I x H, down H x I) into tmp, from NAME_blocks / NAME_scales; *n_mx counts the tensors
 * dequantized. Returns FM_OK with *found false when the file has no MXFP4 form of it. */
static fm_status read_mxfp4(reader *r, const char *base_name, int64_t E, int64_t rows, int64_t cols, float *tmp,
                            bool *found, int *n_mx) {
    char bn[288], sn[288];
    snprintf(bn, sizeof bn, "%s_blocks", base_name);
    snprintf(sn, sizeof sn, "%s_scales", base_name);
    int k;
    *found = find(r, bn, &k) != NULL;
    if (!*found) return FM_OK;
    if (cols % 32)
        return fm_error(FM_ERR_FORMAT, "%s: '%s' is MXFP4, whose blocks hold 32 values, but the row length %lld (from "
                        "config.json) is not a multiple of 32", r->f->where, bn, (long long)cols);
    const int64_t G = cols / 32, bshape[4] = {E, rows, G, 16}, sshape[3] = {E, rows, G};
    uint8_t *blk = fm_malloc((size_t)(E * rows * G * 16)), *scl = fm_malloc((size_t)(E * rows * G));
    fm_status s = blk && scl ? FM_OK : fm_error(FM_ERR_NOMEM, "%s: out of memory for '%s'", r->f->where, bn);
    if (s == FM_OK) s = read_u8(r, bn, blk, 4, bshape);
    if (s == FM_OK) s = read_u8(r, sn, scl, 3, sshape);
    if (s == FM_OK) s = fm_mxfp4_dequant(tmp, blk, scl, E * rows, G, bn);
    fm_free(blk);
    fm_free(scl);
    if (s == FM_OK) (*n_mx)++;
    return s;
}

/* Layer l's gpt_oss experts into the stacked gate, up, down and their biases; tmp holds
 * E*2I*H floats. */
static fm_status read_oss(reader *r, const char *prefix, int64_t l, float *tmp, float *base, int *n_mx) {
    const fm_hf_table *t = r->t;
    const int64_t E = t->n_experts, H = t->hidden, I = t->expert_width;
    const fm_hf_experts *x = &t->experts[l], *b = &t->expert_bias[l];
    char name[256];
    bool mx;
    snprintf(name, sizeof name, "%smodel.layers.%lld.mlp.experts.gate_up_proj", prefix, (long long)l);
    FM_TRY(read_mxfp4(r, name, E, 2 * I, H, tmp, &mx, n_mx));
    if (mx) { /* [E, 2I, H]: row 2i gate, 2i+1 up */
        for (int64_t e = 0; e < E; e++)
            for (int64_t i = 0; i < I; i++) {
                memcpy(base + x->gate + (e * I + i) * H, tmp + (e * 2 * I + 2 * i) * H, sizeof(float) * (size_t)H);
                memcpy(base + x->up + (e * I + i) * H, tmp + (e * 2 * I + 2 * i + 1) * H, sizeof(float) * (size_t)H);
            }
    } else { /* [E, H, 2I] */
        const int64_t shape[3] = {E, H, 2 * I};
        FM_TRY(read_tensor(r, name, tmp, 3, shape));
        for (int64_t e = 0; e < E; e++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < I; i++) {
                    base[x->gate + (e * I + i) * H + h] = tmp[(e * H + h) * 2 * I + 2 * i];
                    base[x->up + (e * I + i) * H + h] = tmp[(e * H + h) * 2 * I + 2 * i + 1];
                }
    }
    snprintf(name, sizeof name, "%smodel.layers.%lld.mlp.experts.gate_up_proj_bias", prefix, (long long)l);
    const int64_t gb_shape[2] = {E, 2 * I};
    FM_TRY(read_tensor(r, name, tmp, 2, gb_shape));
    for (int64_t e = 0; e < E; e++)
        for (int64_t i = 0; i < I; i++) {
            base[b->gate + e * I + i] = tmp[e * 2 * I + 2 * i];
            base[b->up + e * I + i] = tmp[e * 2 * I + 2 * i + 1];
        }
    snprintf(name, sizeof name, "%smodel.layers.%lld.mlp.experts.down_proj", prefix, (long long)l);
    FM_TRY(read_mxfp4(r, name, E, H, I, base + x->down, &mx, n_mx)); /* [E, H, I]: flatmoe's layout */
    if (!mx) { /* [E, I, H] */
        const int64_t shape[3] = {E, I, H};
        FM_TRY(read_tensor(r, name, tmp, 3, shape));
        for (int64_t e = 0; e < E; e++)
            for (int64_t i = 0; i < I; i++)
                for (int64_t h = 0; h < H; h++) base[x->down + (e * H + h) * I + i] = tmp[(e * I + i) * H + h];
    }
    snprintf(name, sizeof name, "%smodel.layers.%lld.mlp.experts.down_proj_bias", prefix, (long long)l);
    const int64_t db_shape[2] = {E, H};
    return read_tensor(r, name, base + b->down, 2, db_shape);
}

/* Lists (or refuses) the tensors of the files with the prefix that were not read. */
static fm_status check_extras(const reader *r, const char *prefix) {
    const size_t plen = strlen(prefix);
    int n_extra = 0;
    size_t at = 0;
    char *out = r->o ? r->o->extra : NULL;
    const size_t cap = r->o ? r->o->extra_cap : 0;
    char list[1024] = "";
    size_t lat = 0;
    for (int k = 0; k < r->f->n; k++)
        for (int i = 0; i < r->f->st[k].n_tensors; i++) {
            const char *n = r->f->st[k].tensors[i].name;
            if (r->used[k][i] || strncmp(n, prefix, plen)) continue;
            if (r->t->tied_lm_head && !strcmp(n + plen, "lm_head.weight")) continue; /* tied: the embedding is read */
            if (r->t->skip_layers_from > 0 && !strncmp(n + plen, "model.layers.", 13)) { /* MTP layers: skipped */
                char *end = NULL;
                const long long l = strtoll(n + plen + 13, &end, 10);
                if (end && *end == '.' && l >= r->t->skip_layers_from) continue;
            }
            if (!out)
                return fm_error(FM_ERR_FORMAT, "%s: tensor '%s' is not a parameter of this %s model (%d tensors "
                                "expected); was the file written for another config?", r->f->st[k].path, n,
                                r->t->model_desc, r->t->n_params);
            if (n_extra < 8 && lat < sizeof list - 1)
                lat += (size_t)snprintf(list + lat, sizeof list - lat, "%s'%s'", n_extra ? ", " : "", n);
            if (lat >= sizeof list) lat = sizeof list - 1;
            n_extra++;
        }
    if (out && cap > 0) {
        out[0] = 0;
        if (n_extra > 0)
            at = (size_t)snprintf(out, cap, "%d tensor%s of %s %s not a parameter of this %s model and %s ignored: %s%s",
                                  n_extra, n_extra == 1 ? "" : "s", r->f->where, n_extra == 1 ? "is" : "are",
                                  r->t->model_desc, n_extra == 1 ? "was" : "were", list,
                                  n_extra > 8 ? ", ..." : "");
        (void)at;
    }
    return FM_OK;
}

fm_status fm_hf_read_files(const fm_hf_table *t, const fm_hf_files *f, const char *prefix, float *base,
                           const fm_hf_read_opts *opts) {
    const int64_t L = t->n_layers, E = t->n_experts, H = t->hidden, I = t->expert_width;
    reader r = {t, f, NULL, opts};
    fm_status s = FM_OK;
    bool *fused = fm_malloc((size_t)(L > 0 ? L : 1));
    r.used = fm_malloc(sizeof(bool *) * (size_t)(f->n > 0 ? f->n : 1));
    if (r.used) memset(r.used, 0, sizeof(bool *) * (size_t)(f->n > 0 ? f->n : 1));
    float *tmp = NULL;
    int n_mx = 0; /* gpt_oss's MXFP4 tensors dequantized */
    if (!fused || !r.used) s = fm_error(FM_ERR_NOMEM, "%s: out of memory", f->where);
    for (int k = 0; k < f->n && s == FM_OK; k++) {
        const size_t n = (size_t)(f->st[k].n_tensors > 0 ? f->st[k].n_tensors : 1);
        if (!(r.used[k] = fm_malloc(n))) s = fm_error(FM_ERR_NOMEM, "%s: out of memory", f->where);
        else memset(r.used[k], 0, n);
    }
    char name[256];
    for (int64_t l = 0; l < L && s == FM_OK; l++) {
        fused[l] = false;
        if (t->experts[l].gate < 0) continue; /* a dense layer */
        snprintf(name, sizeof name, "%smodel.layers.%lld.%s.experts.gate_up_proj", prefix, (long long)l, t->moe_module);
        int k;
        fused[l] = find(&r, name, &k) != NULL;
        if (t->expert_bias && !fused[l]) { /* gpt_oss: MXFP4 blocks and scales */
            strcat(name, "_blocks");
            fused[l] = find(&r, name, &k) != NULL;
        }
        if (!fused[l]) continue;
        if (!tmp && !(tmp = fm_malloc(sizeof(float) * (size_t)(E * 2 * I * H)))) {
            s = fm_error(FM_ERR_NOMEM, "%s: out of memory reading fused experts", f->where);
            break;
        }
        s = t->expert_bias ? read_oss(&r, prefix, l, tmp, base, &n_mx) : read_fused(&r, prefix, l, tmp, base);
    }
    fm_free(tmp);
    if (s == FM_OK && n_mx > 0)
        fm_log(FM_LOG_INFO, "%s: %d expert tensors stored in MXFP4 (blocks and scales) dequantized to fp32 at load "
               "(exact); training keeps them at full precision", f->where, n_mx);
    for (int i = 0; i < t->n_params && s == FM_OK; i++) {
        const fm_hf_param *p = &t->params[i];
        bool in_fused = false;
        for (int64_t l = 0; l < L && !in_fused; l++) {
            const int64_t lo = t->experts[l].gate, hi = t->experts[l].down + E * H * I;
            in_fused = fused[l] && p->offset >= lo && p->offset < hi;
            if (t->expert_bias && fused[l] && t->expert_bias[l].gate >= 0) /* and gpt_oss's expert biases */
                in_fused = in_fused || (p->offset >= t->expert_bias[l].gate && p->offset < t->expert_bias[l].down + E * H);
        }
        if (in_fused) continue;
        snprintf(name, sizeof name, "%s%s", prefix, p->name);
        s = read_tensor(&r, name, base + p->offset, p->ndim, p->shape);
    }
    if (s == FM_OK) s = check_extras(&r, prefix);
    for (int k = 0; r.used && k < f->n; k++) fm_free(r.used[k]);
    fm_free(r.used);
    fm_free(fused);
    return s;
}

fm_status fm_hf_read(const fm_hf_table *t, const char *path, const char *prefix, float *base) {
    fm_hf_files f;
    FM_TRY(fm_hf_files_open(&f, path));
    fm_status s = fm_hf_read_files(t, &f, prefix, base, NULL);
    fm_hf_files_close(&f);
    return s;
}
