/* Flat parameter buffer <-> Hugging Face safetensors tensors (see fm_hf_weights.h). */
#include "fm_hf_weights.h"

#include <stdio.h>
#include <string.h>

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
        out[i].ndim = p->ndim;
        memset(out[i].shape, 0, sizeof out[i].shape);
        for (int d = 0; d < p->ndim; d++) out[i].shape[d] = p->shape[d];
    }
    return FM_OK;
}

static bool table_has(const fm_hf_table *t, const char *name) {
    for (int i = 0; i < t->n_params; i++)
        if (!strcmp(t->params[i].name, name)) return true;
    return false;
}

/* Reads layer l's fused expert tensors into the stacked gate, up and down buffers; tmp holds
 * E*2I*H floats. */
static fm_status read_fused(const fm_hf_table *t, fm_safetensors *st, const char *prefix, int64_t l, float *tmp,
                            float *base) {
    const int64_t E = t->n_experts, H = t->hidden, I = t->expert_width;
    const int64_t gu_shape[3] = {E, 2 * I, H}, d_shape[3] = {E, H, I};
    char name[256];
    snprintf(name, sizeof name, "%smodel.layers.%lld.%s.experts.gate_up_proj", prefix, (long long)l, t->moe_module);
    fm_status s = fm_st_read_f32(st, name, tmp, 3, gu_shape);
    const fm_hf_experts *x = &t->experts[l];
    for (int64_t e = 0; e < E && s == FM_OK; e++) {
        memcpy(base + x->gate + e * I * H, tmp + e * 2 * I * H, sizeof(float) * (size_t)(I * H));
        memcpy(base + x->up + e * I * H, tmp + e * 2 * I * H + I * H, sizeof(float) * (size_t)(I * H));
    }
    snprintf(name, sizeof name, "%smodel.layers.%lld.%s.experts.down_proj", prefix, (long long)l, t->moe_module);
    if (s == FM_OK) s = fm_st_read_f32(st, name, base + x->down, 3, d_shape);
    return s;
}

fm_status fm_hf_read(const fm_hf_table *t, const char *path, const char *prefix, float *base) {
    const int64_t L = t->n_layers, E = t->n_experts, H = t->hidden, I = t->expert_width;
    fm_safetensors st;
    FM_TRY(fm_st_open(&st, path));
    fm_status s = FM_OK;
    char name[256];
    int consumed = 0;
    bool *fused = fm_malloc((size_t)(L > 0 ? L : 1));
    float *tmp = NULL;
    if (!fused) {
        fm_st_close(&st);
        return fm_error(FM_ERR_NOMEM, "%s: out of memory", path);
    }
    for (int64_t l = 0; l < L && s == FM_OK; l++) {
        snprintf(name, sizeof name, "%smodel.layers.%lld.%s.experts.gate_up_proj", prefix, (long long)l, t->moe_module);
        fused[l] = fm_st_find(&st, name) != NULL;
        if (!fused[l]) continue;
        if (!tmp && !(tmp = fm_malloc(sizeof(float) * (size_t)(E * 2 * I * H)))) {
            s = fm_error(FM_ERR_NOMEM, "%s: out of memory reading fused experts", path);
            break;
        }
        s = read_fused(t, &st, prefix, l, tmp, base);
        consumed += 2;
    }
    fm_free(tmp);
    for (int i = 0; i < t->n_params && s == FM_OK; i++) {
        const fm_hf_param *p = &t->params[i];
        bool in_fused = false;
        for (int64_t l = 0; l < L && !in_fused; l++) {
            const int64_t lo = t->experts[l].gate, hi = t->experts[l].down + E * H * I;
            in_fused = fused[l] && p->offset >= lo && p->offset < hi;
        }
        if (in_fused) continue;
        snprintf(name, sizeof name, "%s%s", prefix, p->name);
        s = fm_st_read_f32(&st, name, base + p->offset, p->ndim, p->shape);
        consumed++;
    }
    int in_file = 0;
    const size_t plen = strlen(prefix);
    for (int i = 0; i < st.n_tensors; i++)
        if (!strncmp(st.tensors[i].name, prefix, plen) &&
            !(t->tied_lm_head && !strcmp(st.tensors[i].name + plen, "lm_head.weight")))
            in_file++;
    if (s == FM_OK && in_file != consumed) { /* find one tensor the table does not have, to name it */
        for (int i = 0; i < st.n_tensors && s == FM_OK; i++) {
            const char *n = st.tensors[i].name;
            if (strncmp(n, prefix, plen) || strstr(n, ".experts.gate_up_proj") || strstr(n, ".experts.down_proj")) continue;
            if (!table_has(t, n + plen) && !(t->tied_lm_head && !strcmp(n + plen, "lm_head.weight")))
                s = fm_error(FM_ERR_FORMAT, "%s: tensor '%s' is not a parameter of this %s model (%d tensors "
                             "expected); was the file written for another config?", path, n, t->model_desc,
                             t->n_params);
        }
        if (s == FM_OK)
            s = fm_error(FM_ERR_FORMAT, "%s: holds %d tensors where this model reads %d; was the file written for "
                         "another config?", path, in_file, consumed);
    }
    fm_st_close(&st);
    fm_free(fused);
    return s;
}
