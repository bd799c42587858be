/* Test fixture for tests/cli_init_from.sh: turns a flatmoe checkpoint folder (config.json and an
 * fp32 model.safetensors) into a Hugging Face style model folder in another layout, or a broken
 * one, without Python:
 *   fm_hf_fixture SRC_DIR OUT_DIR [--dtype f32|bf16|f16] [--shards N] [--fuse]
 *                 [--drop NAME] [--reshape NAME] [--retype NAME] [--extra NAME]
 *   --dtype    store every tensor in this dtype (bf16 and f16 rounded to nearest even)
 *   --shards   write model-0000k-of-0000N.safetensors and model.safetensors.index.json
 *   --fuse     experts fused per layer, as transformers 5 saves them: <moe>.experts.gate_up_proj
 *              [E, 2I, H] and <moe>.experts.down_proj [E, H, I]
 *   --drop     leave tensor NAME out; --reshape: store it with one more row (zeros);
 *   --retype   store it as I32; --extra: add an unused F32 tensor NAME of shape [2]
 *   fm_hf_fixture shard OUT.bin TEXT MASK [I=V ...]
 *              an llm.c v7 shard of TEXT's bytes (token I set to V), and with MASK "tail" a loss
 *              mask OUT.bin.mask that masks the targets of the second half of the tokens
 *              (MASK "none": no mask file)
 * The safetensors files are written here byte by byte (the format of io/fm_safetensors.h), so the
 * reader is tested against a writer that is not its own. */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/fm_core.h"
#include "data/fm_data.h"
#include "io/fm_safetensors.h"

typedef struct tensor {
    char name[256];
    int ndim;
    int64_t shape[3];
    float *data;
    const char *dtype; /* "F32", "BF16", "F16", "I32" */
} tensor;

static tensor g_t[4096];
static int g_n;

static void die(const char *msg, const char *arg) {
    fprintf(stderr, "fm_hf_fixture: %s%s%s\n", msg, arg ? ": " : "", arg ? arg : "");
    exit(2);
}

static int64_t numel(const tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

static uint16_t to_f16(float f) { /* binary32 -> binary16, nearest even */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) {
        float v;
        memcpy(&v, &ax, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(v * 16777216.0f));
    }
    uint32_t h = ((ax >> 23) - 112u) << 10 | ((ax & 0x7fffffu) >> 13), rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

static size_t esize(const char *dt) { return !strcmp(dt, "F32") || !strcmp(dt, "I32") ? 4 : 2; }

/* Writes tensors idx[0..n) of g_t to path. */
static void write_st(const char *path, const int *idx, int n) {
    char *hdr = malloc(1 << 20);
    size_t at = (size_t)sprintf(hdr, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        const tensor *t = &g_t[idx[i]];
        uint64_t bytes = (uint64_t)numel(t) * esize(t->dtype);
        at += (size_t)sprintf(hdr + at, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t->name, t->dtype);
        for (int d = 0; d < t->ndim; d++) at += (size_t)sprintf(hdr + at, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        at += (size_t)sprintf(hdr + at, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                              (unsigned long long)(off + bytes));
        off += bytes;
    }
    at += (size_t)sprintf(hdr + at, "}");
    while (at % 8) hdr[at++] = ' ';
    FILE *f = fopen(path, "wb");
    if (!f) die("cannot create", path);
    uint64_t len = at;
    unsigned char lb[8];
    for (int i = 0; i < 8; i++) lb[i] = (unsigned char)(len >> (8 * i));
    fwrite(lb, 1, 8, f);
    fwrite(hdr, 1, at, f);
    for (int i = 0; i < n; i++) {
        const tensor *t = &g_t[idx[i]];
        const int64_t m = numel(t);
        for (int64_t j = 0; j < m; j++) {
            const float v = t->data[j];
            if (!strcmp(t->dtype, "F32")) fwrite(&v, 4, 1, f);
            else if (!strcmp(t->dtype, "I32")) { int32_t k = (int32_t)lrintf(v * 1000.0f); fwrite(&k, 4, 1, f); }
            else { uint16_t h = !strcmp(t->dtype, "BF16") ? fm_f32_to_bf16(v) : to_f16(v); fwrite(&h, 2, 1, f); }
        }
    }
    if (fclose(f) != 0) die("write failed", path);
    free(hdr);
}

static tensor *find(const char *name) {
    for (int i = 0; i < g_n; i++)
        if (!strcmp(g_t[i].name, name)) return &g_t[i];
    return NULL;
}

/* Replaces each layer's per-expert tensors by the fused pair. */
static void fuse(void) {
    for (int i = 0; i < g_n; i++) {
        char *p = strstr(g_t[i].name, ".experts.0.gate_proj.weight");
        if (!p) continue;
        char base[160], nm[256];
        snprintf(base, sizeof base, "%.*s", (int)(p - g_t[i].name), g_t[i].name);
        const int64_t I = g_t[i].shape[0], H = g_t[i].shape[1];
        int E = 0;
        for (;; E++) {
            snprintf(nm, sizeof nm, "%s.experts.%d.gate_proj.weight", base, E);
            if (!find(nm)) break;
        }
        float *gu = malloc(sizeof(float) * (size_t)(E * 2 * I * H)), *dn = malloc(sizeof(float) * (size_t)(E * H * I));
        for (int e = 0; e < E; e++) {
            snprintf(nm, sizeof nm, "%s.experts.%d.gate_proj.weight", base, e);
            tensor *g = find(nm);
            snprintf(nm, sizeof nm, "%s.experts.%d.up_proj.weight", base, e);
            tensor *u = find(nm);
            snprintf(nm, sizeof nm, "%s.experts.%d.down_proj.weight", base, e);
            tensor *d = find(nm);
            if (!g || !u || !d) die("incomplete experts in", base);
            memcpy(gu + e * 2 * I * H, g->data, sizeof(float) * (size_t)(I * H));
            memcpy(gu + e * 2 * I * H + I * H, u->data, sizeof(float) * (size_t)(I * H));
            memcpy(dn + e * H * I, d->data, sizeof(float) * (size_t)(H * I));
            g->name[0] = u->name[0] = d->name[0] = 0; /* dropped below */
        }
        tensor *a = &g_t[g_n++], *b = &g_t[g_n++];
        *a = (tensor){.ndim = 3, .shape = {E, 2 * I, H}, .data = gu, .dtype = g_t[i].dtype};
        snprintf(a->name, sizeof a->name, "%s.experts.gate_up_proj", base);
        *b = (tensor){.ndim = 3, .shape = {E, H, I}, .data = dn, .dtype = g_t[i].dtype};
        snprintf(b->name, sizeof b->name, "%s.experts.down_proj", base);
    }
    int w = 0;
    for (int i = 0; i < g_n; i++) {
        if (g_t[i].name[0]) g_t[w++] = g_t[i];
        else free(g_t[i].data);
    }
    g_n = w;
}

static int shard_mode(int argc, char **argv) {
    if (argc < 5) die("usage: fm_hf_fixture shard OUT.bin TEXT none|tail [I=V ...]", NULL);
    FILE *f = fopen(argv[3], "rb");
    if (!f) die("cannot open", argv[3]);
    static unsigned char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    int32_t *tok = malloc(sizeof(int32_t) * n);
    uint8_t *mask = malloc(n);
    for (size_t i = 0; i < n; i++) {
        tok[i] = buf[i];
        mask[i] = i <= n / 2;
    }
    for (int i = 5; i < argc; i++) {
        long at = -1, v = -1;
        if (sscanf(argv[i], "%ld=%ld", &at, &v) != 2 || at < 0 || (size_t)at >= n) die("bad I=V", argv[i]);
        tok[at] = (int32_t)v;
    }
    if (fm_shard_write(argv[2], tok, (int64_t)n, 7) != FM_OK) die(fm_errmsg(), NULL);
    char mp[4200];
    snprintf(mp, sizeof mp, "%s.mask", argv[2]);
    remove(mp);
    if (!strcmp(argv[4], "tail") && fm_mask_write(mp, mask, (int64_t)n) != FM_OK) die(fm_errmsg(), NULL);
    free(tok);
    free(mask);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "shard")) return shard_mode(argc, argv);
    if (argc < 3) die("usage: fm_hf_fixture SRC_DIR OUT_DIR [--dtype D] [--shards N] [--fuse] [--drop|--reshape|--retype|--extra NAME]", NULL);
    const char *src = argv[1], *out = argv[2], *dtype = "F32";
    int shards = 0, do_fuse = 0;
    const char *drop = NULL, *reshape = NULL, *retype = NULL, *extra = NULL;
    for (int i = 3; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--fuse")) { do_fuse = 1; continue; }
        if (!v) die("missing value for", a);
        i++;
        if (!strcmp(a, "--dtype")) dtype = !strcmp(v, "bf16") ? "BF16" : !strcmp(v, "f16") ? "F16" : "F32";
        else if (!strcmp(a, "--shards")) shards = atoi(v);
        else if (!strcmp(a, "--drop")) drop = v;
        else if (!strcmp(a, "--reshape")) reshape = v;
        else if (!strcmp(a, "--retype")) retype = v;
        else if (!strcmp(a, "--extra")) extra = v;
        else die("unknown flag", a);
    }
    char p[4400];
    snprintf(p, sizeof p, "%s/model.safetensors", src);
    fm_safetensors st;
    if (fm_st_open(&st, p) != FM_OK) die(fm_errmsg(), NULL);
    for (int i = 0; i < st.n_tensors; i++) {
        tensor *t = &g_t[g_n++];
        snprintf(t->name, sizeof t->name, "%s", st.tensors[i].name);
        t->ndim = st.tensors[i].ndim;
        for (int d = 0; d < t->ndim; d++) t->shape[d] = st.tensors[i].shape[d];
        t->data = malloc(sizeof(float) * (size_t)numel(t));
        t->dtype = dtype;
        if (fm_st_read_f32(&st, t->name, t->data, t->ndim, t->shape) != FM_OK) die(fm_errmsg(), NULL);
    }
    fm_st_close(&st);
    if (do_fuse) fuse();
    if (drop) {
        tensor *t = find(drop);
        if (!t) die("no tensor to drop", drop);
        t->name[0] = 0;
        free(t->data);
        t->data = NULL;
        int w = 0;
        for (int i = 0; i < g_n; i++)
            if (g_t[i].name[0]) g_t[w++] = g_t[i];
        g_n = w;
    }
    if (reshape) {
        tensor *t = find(reshape);
        if (!t) die("no tensor to reshape", reshape);
        int64_t row = numel(t) / t->shape[0];
        t->data = realloc(t->data, sizeof(float) * (size_t)(numel(t) + row));
        memset(t->data + numel(t), 0, sizeof(float) * (size_t)row);
        t->shape[0]++;
    }
    if (retype) {
        tensor *t = find(retype);
        if (!t) die("no tensor to retype", retype);
        t->dtype = "I32";
    }
    if (extra) {
        tensor *t = &g_t[g_n++];
        snprintf(t->name, sizeof t->name, "%s", extra);
        t->ndim = 1;
        t->shape[0] = 2;
        t->data = calloc(2, sizeof(float));
        t->dtype = "F32";
    }
    mkdir(out, 0755);
    char cmd[9000];
    snprintf(cmd, sizeof cmd, "cp '%s/config.json' '%s/config.json'", src, out);
    if (system(cmd) != 0) die("cannot copy config.json", src);
    int *idx = malloc(sizeof(int) * (size_t)g_n);
    if (shards <= 0) {
        for (int i = 0; i < g_n; i++) idx[i] = i;
        snprintf(p, sizeof p, "%s/model.safetensors", out);
        write_st(p, idx, g_n);
        free(idx);
        return 0;
    }
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", out);
    FILE *ix = fopen(p, "w");
    if (!ix) die("cannot create", p);
    fprintf(ix, "{\n  \"metadata\": {\"total_size\": 0},\n  \"weight_map\": {");
    int first = 1;
    for (int k = 0; k < shards; k++) {
        int n = 0;
        for (int i = k * g_n / shards; i < (k + 1) * g_n / shards; i++) idx[n++] = i;
        char name[64];
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", k + 1, shards);
        snprintf(p, sizeof p, "%s/%s", out, name);
        write_st(p, idx, n);
        for (int i = 0; i < n; i++) {
            fprintf(ix, "%s\n    \"%s\": \"%s\"", first ? "" : ",", g_t[idx[i]].name, name);
            first = 0;
        }
    }
    fprintf(ix, "\n  }\n}\n");
    fclose(ix);
    free(idx);
    return 0;
}
