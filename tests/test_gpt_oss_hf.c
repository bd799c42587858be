/* gpt_oss's Hugging Face folders loaded into flatmoe's parameter table (io/fm_hf_weights.h, issue
 * 26): the test writes, from known values, a model.safetensors in transformers' GptOss layout
 * (fused experts: gate_up_proj [E, H, 2I] with gate and up interleaved along 2I, its bias [E, 2I],
 * down_proj [E, I, H], down_proj_bias [E, H]; sinks, router weight and bias, q/k/v/o biases) in
 * fp32 and in bf16, and one whose experts are MXFP4 blocks and scales as the released checkpoints
 * hold them (built here from chosen E2M1 codes and E8M0 exponents, so every value is known
 * exactly), reads each with fm_hf_read_files and checks every parameter bit for bit against the
 * values it wrote (each reading is an exact permutation or an exact dequantization; the bf16
 * file's values are bf16 numbers). Bad input: an E8M0 scale of 255 (NaN), scales missing beside
 * their blocks, a gate_up_proj of the wrong orientation — each refused with the tensor named. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/fm_rng.h"
#include "fm_test.h"
#include "io/fm_hf_weights.h"
#include "model/fm_params.h"

static const char *k_cfg =
    "{\"model_type\": \"gpt_oss\", \"vocab_size\": 16, \"hidden_size\": 96, \"intermediate_size\": 32, "
    "\"num_hidden_layers\": 2, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 16, "
    "\"num_local_experts\": 3, \"num_experts_per_tok\": 2, \"max_position_embeddings\": 64}";

/* ---- a minimal safetensors writer with any dtype (the library writes F32 only) -------------- */
typedef struct st_item {
    char name[160];
    const char *dtype; /* "F32", "BF16", "U8" */
    int ndim;
    int64_t shape[4];
    void *data;
    size_t bytes;
} st_item;

static void write_st(const char *path, st_item *it, int n) {
    char *hdr = malloc(1 << 20);
    size_t at = 0, off = 0;
    at += (size_t)sprintf(hdr + at, "{");
    for (int i = 0; i < n; i++) {
        at += (size_t)sprintf(hdr + at, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", i ? "," : "", it[i].name, it[i].dtype);
        for (int d = 0; d < it[i].ndim; d++) at += (size_t)sprintf(hdr + at, "%s%lld", d ? "," : "", (long long)it[i].shape[d]);
        at += (size_t)sprintf(hdr + at, "],\"data_offsets\":[%zu,%zu]}", off, off + it[i].bytes);
        off += it[i].bytes;
    }
    at += (size_t)sprintf(hdr + at, "}");
    while (at % 8) hdr[at++] = ' ';
    FILE *f = fopen(path, "wb");
    const uint64_t hl = at;
    fwrite(&hl, 8, 1, f);
    fwrite(hdr, 1, at, f);
    for (int i = 0; i < n; i++) fwrite(it[i].data, 1, it[i].bytes, f);
    fclose(f);
    free(hdr);
}

static uint16_t bf16_of(float x) { uint32_t u; memcpy(&u, &x, 4); return (uint16_t)(u >> 16); }
static float bf16_round(float x) { uint32_t u; memcpy(&u, &x, 4); u &= 0xFFFF0000u; memcpy(&x, &u, 4); return x; }

static st_item item(const char *name, const char *dtype, int ndim, const int64_t *shape, const float *vals) {
    st_item t;
    memset(&t, 0, sizeof t);
    snprintf(t.name, sizeof t.name, "%s", name);
    t.dtype = dtype;
    t.ndim = ndim;
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) t.shape[d] = shape[d], n *= shape[d];
    const bool bf = !strcmp(dtype, "BF16");
    t.bytes = (size_t)n * (bf ? 2 : 4);
    t.data = malloc(t.bytes);
    for (int64_t i = 0; i < n; i++) {
        if (bf) ((uint16_t *)t.data)[i] = bf16_of(vals[i]);
        else ((float *)t.data)[i] = vals[i];
    }
    return t;
}

static const float k_e2m1[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -.5f, -1, -1.5f, -2, -3, -4, -6};

/* MXFP4 blocks and scales of rows x cols random values, and the values (out [rows, cols]). */
static void mx_make(fm_rng *r, int64_t rows, int64_t cols, uint8_t *blk, uint8_t *scl, float *out) {
    const int64_t G = cols / 32;
    for (int64_t i = 0; i < rows * G; i++) {
        scl[i] = (uint8_t)(120 + fm_rng_below(r, 10));
        for (int j = 0; j < 16; j++) {
            const uint8_t lo = (uint8_t)fm_rng_below(r, 16), hi = (uint8_t)fm_rng_below(r, 16);
            blk[i * 16 + j] = (uint8_t)(lo | hi << 4);
            out[i * 32 + 2 * j] = ldexpf(k_e2m1[lo], scl[i] - 127);
            out[i * 32 + 2 * j + 1] = ldexpf(k_e2m1[hi], scl[i] - 127);
        }
    }
}

typedef struct fixture {
    fm_config cfg;
    fm_model_params p;
    fm_hf_param *hp;
    fm_hf_experts *ex, *eb;
    fm_hf_table t;
} fixture;

static void fixture_init(fixture *x) {
    CHECK(fm_config_parse(&x->cfg, k_cfg, "oss_hf.json") == FM_OK);
    CHECK(fm_params_create(&x->p, &x->cfg, 1, 0) == FM_OK);
    const int64_t L = x->cfg.num_hidden_layers;
    x->hp = malloc(sizeof(fm_hf_param) * (size_t)x->p.n_tensors);
    x->ex = malloc(sizeof(fm_hf_experts) * (size_t)L);
    x->eb = malloc(sizeof(fm_hf_experts) * (size_t)L);
    for (int i = 0; i < x->p.n_tensors; i++) {
        const fm_param *q = &x->p.table[i];
        x->hp[i] = (fm_hf_param){q->name, q->ndim, {q->shape[0], q->shape[1]}, q->offset};
    }
    for (int64_t l = 0; l < L; l++) {
        fm_params_layer_expert_offsets(&x->p, l, &x->ex[l].gate, &x->ex[l].up, &x->ex[l].down);
        fm_params_layer_expert_bias_offsets(&x->p, l, &x->eb[l].gate, &x->eb[l].up, &x->eb[l].down);
    }
    x->t = (fm_hf_table){x->hp, x->p.n_tensors, L, x->cfg.num_experts, x->cfg.hidden_size, x->cfg.moe_intermediate_size,
                         "mlp", x->ex, false, "gpt_oss", 0, x->eb};
}

static void fixture_free(fixture *x) {
    free(x->hp), free(x->ex), free(x->eb);
    fm_params_free(&x->p);
}

/* Whether table tensor i is one of layer l's experts' weights or biases (written fused). */
static bool is_expert(const fixture *x, int i) {
    const fm_param *q = &x->p.table[i];
    return strstr(q->name, ".mlp.experts.") != NULL;
}

/* Writes the HF file of `want` (flatmoe layout) to path: non-expert tensors as themselves, the
 * experts fused in GptOss's layout (dtype for the float tensors; mx: gate_up_proj and down_proj
 * as MXFP4, whose values want already holds, with blocks/scales given). bad: 1 a scale of 255,
 * 2 no down_proj_scales, 3 gate_up_proj written [E, 2I, H]. */
static void write_hf(const fixture *x, const float *want, const char *path, const char *dtype, bool mx,
                     uint8_t *const *gu_b, uint8_t *const *gu_s, uint8_t *const *d_b, uint8_t *const *d_s, int bad) {
    const int64_t E = x->cfg.num_experts, H = x->cfg.hidden_size, I = x->cfg.moe_intermediate_size;
    const int64_t L = x->cfg.num_hidden_layers;
    st_item *it = calloc((size_t)(x->p.n_tensors + 8 * L), sizeof(st_item));
    int n = 0;
    for (int i = 0; i < x->p.n_tensors; i++) {
        if (is_expert(x, i)) continue;
        const fm_param *q = &x->p.table[i];
        it[n++] = item(q->name, dtype, q->ndim, q->shape, want + q->offset);
    }
    float *tmp = malloc(sizeof(float) * (size_t)(E * 2 * I * H));
    char name[160];
    for (int64_t l = 0; l < L; l++) {
        const fm_hf_experts *g = &x->ex[l], *b = &x->eb[l];
        if (mx) {
            const int64_t sb[4] = {E, 2 * I, H / 32, 16}, ss[3] = {E, 2 * I, H / 32};
            const int64_t db[4] = {E, H, I / 32, 16}, ds[3] = {E, H, I / 32};
            if (bad == 1) gu_s[l][5] = 255;
            snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.gate_up_proj_blocks", (long long)l);
            it[n] = (st_item){"", "U8", 4, {sb[0], sb[1], sb[2], sb[3]}, gu_b[l], (size_t)(E * 2 * I * H / 2)};
            snprintf(it[n++].name, 160, "%s", name);
            snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.gate_up_proj_scales", (long long)l);
            it[n] = (st_item){"", "U8", 3, {ss[0], ss[1], ss[2]}, gu_s[l], (size_t)(E * 2 * I * H / 32)};
            snprintf(it[n++].name, 160, "%s", name);
            snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.down_proj_blocks", (long long)l);
            it[n] = (st_item){"", "U8", 4, {db[0], db[1], db[2], db[3]}, d_b[l], (size_t)(E * H * I / 2)};
            snprintf(it[n++].name, 160, "%s", name);
            if (bad != 2) {
                snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.down_proj_scales", (long long)l);
                it[n] = (st_item){"", "U8", 3, {ds[0], ds[1], ds[2]}, d_s[l], (size_t)(E * H * I / 32)};
                snprintf(it[n++].name, 160, "%s", name);
            }
        } else {
            for (int64_t e = 0; e < E; e++) /* [E, H, 2I], interleaved; bad 3: [E, 2I, H] */
                for (int64_t h = 0; h < H; h++)
                    for (int64_t i = 0; i < I; i++) {
                        tmp[(e * H + h) * 2 * I + 2 * i] = want[g->gate + (e * I + i) * H + h];
                        tmp[(e * H + h) * 2 * I + 2 * i + 1] = want[g->up + (e * I + i) * H + h];
                    }
            snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.gate_up_proj", (long long)l);
            const int64_t s3[3] = {E, bad == 3 ? 2 * I : H, bad == 3 ? H : 2 * I};
            it[n++] = item(name, dtype, 3, s3, tmp);
            for (int64_t e = 0; e < E; e++) /* [E, I, H] */
                for (int64_t i = 0; i < I; i++)
                    for (int64_t h = 0; h < H; h++) tmp[(e * I + i) * H + h] = want[g->down + (e * H + h) * I + i];
            snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.down_proj", (long long)l);
            const int64_t d3[3] = {E, I, H};
            it[n++] = item(name, dtype, 3, d3, tmp);
        }
        for (int64_t e = 0; e < E; e++)
            for (int64_t i = 0; i < I; i++) {
                tmp[e * 2 * I + 2 * i] = want[b->gate + e * I + i];
                tmp[e * 2 * I + 2 * i + 1] = want[b->up + e * I + i];
            }
        snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.gate_up_proj_bias", (long long)l);
        const int64_t s2[2] = {E, 2 * I};
        it[n++] = item(name, dtype, 2, s2, tmp);
        snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.down_proj_bias", (long long)l);
        const int64_t d2[2] = {E, H};
        it[n++] = item(name, dtype, 2, d2, want + b->down);
    }
    write_st(path, it, n);
    for (int i = 0; i < n; i++)
        if (strcmp(it[i].dtype, "U8")) free(it[i].data);
    free(it);
    free(tmp);
}

static fm_status read_back(const fixture *x, const char *path, float *got) {
    fm_hf_files f;
    FM_TRY(fm_hf_files_open(&f, path));
    for (int64_t i = 0; i < x->p.n_params; i++) got[i] = NAN;
    const fm_status s = fm_hf_read_files(&x->t, &f, "", got, NULL);
    fm_hf_files_close(&f);
    return s;
}

int main(void) {
    fm_rng r;
    fm_rng_seed(&r, fm_test_seed(20261207));
    fixture x;
    fixture_init(&x);
    const int64_t n = x.p.n_params, E = x.cfg.num_experts, H = x.cfg.hidden_size, I = x.cfg.moe_intermediate_size;
    const int64_t L = x.cfg.num_hidden_layers;
    float *want = malloc(sizeof(float) * (size_t)n), *got = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) want[i] = bf16_round((float)fm_rng_normal(&r)); /* bf16 numbers: exact in both */
    char path[256];
    const char *tmpdir = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    /* fp32 and bf16 fused files */
    const char *dts[2] = {"F32", "BF16"};
    for (int d = 0; d < 2; d++) {
        snprintf(path, sizeof path, "%s/fm_oss_hf_%d_%s.safetensors", tmpdir, (int)getpid(), dts[d]);
        write_hf(&x, want, path, dts[d], false, NULL, NULL, NULL, NULL, 0);
        const fm_status s = read_back(&x, path, got);
        CHECK_MSG(s == FM_OK, "%s: %s", dts[d], fm_errmsg());
        CHECK_MSG(s == FM_OK && !memcmp(got, want, sizeof(float) * (size_t)n), "%s: the values read are not the ones "
                  "written", dts[d]);
        remove(path);
    }
    /* MXFP4 experts: the values of chosen codes and exponents */
    uint8_t *gu_b[2], *gu_s[2], *d_b[2], *d_s[2];
    float *tmp = malloc(sizeof(float) * (size_t)(E * 2 * I * H));
    for (int64_t l = 0; l < L; l++) {
        gu_b[l] = malloc((size_t)(E * 2 * I * H / 2)), gu_s[l] = malloc((size_t)(E * 2 * I * H / 32));
        d_b[l] = malloc((size_t)(E * H * I / 2)), d_s[l] = malloc((size_t)(E * H * I / 32));
        int64_t g, u, dn;
        fm_params_layer_expert_offsets(&x.p, l, &g, &u, &dn);
        mx_make(&r, E * 2 * I, H, gu_b[l], gu_s[l], tmp); /* rows [E, 2I] of H: 2i gate, 2i+1 up */
        for (int64_t e = 0; e < E; e++)
            for (int64_t i = 0; i < I; i++) {
                memcpy(want + g + (e * I + i) * H, tmp + (e * 2 * I + 2 * i) * H, sizeof(float) * (size_t)H);
                memcpy(want + u + (e * I + i) * H, tmp + (e * 2 * I + 2 * i + 1) * H, sizeof(float) * (size_t)H);
            }
        mx_make(&r, E * H, I, d_b[l], d_s[l], want + dn); /* rows [E, H] of I: flatmoe's down */
    }
    snprintf(path, sizeof path, "%s/fm_oss_hf_%d_mx.safetensors", tmpdir, (int)getpid());
    write_hf(&x, want, path, "BF16", true, gu_b, gu_s, d_b, d_s, 0);
    fm_status s = read_back(&x, path, got);
    CHECK_MSG(s == FM_OK, "mxfp4: %s", fm_errmsg());
    int64_t diff = 0;
    for (int64_t i = 0; i < n; i++) diff += memcmp(&got[i], &want[i], 4) != 0;
    CHECK_MSG(s == FM_OK && diff == 0, "mxfp4: %lld values differ from the ones encoded", (long long)diff);
    /* bad input */
    write_hf(&x, want, path, "F32", true, gu_b, gu_s, d_b, d_s, 2);
    s = read_back(&x, path, got);
    CHECK_MSG(s == FM_ERR_FORMAT && strstr(fm_errmsg(), "down_proj_scales"), "missing scales: %s", fm_errmsg());
    write_hf(&x, want, path, "F32", true, gu_b, gu_s, d_b, d_s, 1);
    s = read_back(&x, path, got);
    CHECK_MSG(s == FM_ERR_FORMAT && strstr(fm_errmsg(), "255") && strstr(fm_errmsg(), "gate_up_proj_blocks"),
              "NaN scale: %s", fm_errmsg());
    write_hf(&x, want, path, "F32", false, NULL, NULL, NULL, NULL, 3);
    s = read_back(&x, path, got);
    CHECK_MSG(s == FM_ERR_FORMAT && strstr(fm_errmsg(), "gate_up_proj") && strstr(fm_errmsg(), "wrong shape"),
              "transposed gate_up_proj: %s", fm_errmsg());
    remove(path);
    for (int64_t l = 0; l < L; l++) free(gu_b[l]), free(gu_s[l]), free(d_b[l]), free(d_s[l]);
    free(tmp), free(want), free(got);
    fixture_free(&x);
    printf("%d passed, %d failed\n", fm_test_passed, fm_test_failed);
    return fm_test_failed ? 1 : 0;
}
