#include "fm_calib.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "../io/fm_atomic.h"

void fm_calib_add(fm_calib_curve *cv, double x, double rate) {
    if (cv->n >= FM_CALIB_MAX_POINTS) return;
    cv->x[cv->n] = x;
    cv->rate[cv->n] = rate;
    cv->n++;
}

double fm_calib_rate(const fm_calib_curve *cv, double x) {
    if (cv->n == 0) return 1.0; /* a caller bug: tables are validated to have points */
    if (x <= cv->x[0] || cv->n == 1) return cv->rate[0];
    if (x >= cv->x[cv->n - 1]) return cv->rate[cv->n - 1];
    int i = 1;
    while (cv->x[i] < x) i++;
    const double t = (log(x) - log(cv->x[i - 1])) / (log(cv->x[i]) - log(cv->x[i - 1]));
    return cv->rate[i - 1] + t * (cv->rate[i] - cv->rate[i - 1]);
}

static void curve(fm_calib_curve *cv, int n, const double *x, const double *r) {
    cv->n = 0;
    for (int i = 0; i < n; i++) fm_calib_add(cv, x[i], r[i]);
}

void fm_calib_default(fm_calib *c, const char *backend) {
    memset(c, 0, sizeof *c);
    if (backend && !strcmp(backend, "cuda")) {
        /* An NVIDIA H200 (bf16), from issue 10's measurements: attention at cuDNN's ceiling near
         * 524 TFLOP/s at long T, the host link at 55 GB/s alone and 48 GB/s each way at once,
         * the AdamW step 58 ms for 28 B x 6.9e9 parameters; GEMM and grouped-GEMM curves are
         * estimates (docs/plan.md). Replace with `flatmoe-cuda calibrate`. */
        snprintf(c->backend, sizeof c->backend, "cuda");
        snprintf(c->device, sizeof c->device, "NVIDIA H200 (built-in estimate)");
        snprintf(c->kind, sizeof c->kind, "h200");
        c->act_bytes = 2;
        c->peak_flops = 989e12;
        const double gm[] = {1024, 4096, 16384, 65536}, gr[] = {350e12, 550e12, 650e12, 700e12};
        curve(&c->gemm, 4, gm, gr);
        const double em[] = {16, 64, 256, 1024, 4096}, ef[] = {60e12, 180e12, 380e12, 520e12, 600e12},
                     eb[] = {50e12, 160e12, 340e12, 470e12, 550e12};
        curve(&c->expert_fwd, 5, em, ef);
        curve(&c->expert_bwd, 5, em, eb);
        const double at[] = {1024, 4096, 16384, 65536, 262144}, af[] = {200e12, 380e12, 480e12, 520e12, 530e12},
                     ab[] = {150e12, 300e12, 400e12, 450e12, 470e12};
        curve(&c->att_fwd, 5, at, af);
        curve(&c->att_bwd, 5, at, ab);
        c->elementwise_bw = 3.0e12;
        c->dispatch_bw = 2.0e12;
        c->adamw_bw = 3.3e12;
        c->h2d = c->d2h = 55e9;
        c->h2d_duplex = c->d2h_duplex = 48e9;
        c->context_bytes = 1.5 * 1073741824.0; /* the former fixed reserve */
        c->host_pinnable_bytes = 112.0 * 1073741824.0;
    } else {
        snprintf(c->backend, sizeof c->backend, "cpu");
        snprintf(c->device, sizeof c->device, "CPU (built-in estimate)");
        snprintf(c->kind, sizeof c->kind, "cpu");
        c->act_bytes = 4;
        c->peak_flops = 5e10;
        const double gm[] = {256, 4096}, gr[] = {2e10, 3e10};
        curve(&c->gemm, 2, gm, gr);
        const double em[] = {16, 256}, er[] = {1e10, 2e10};
        curve(&c->expert_fwd, 2, em, er);
        curve(&c->expert_bwd, 2, em, er);
        const double at[] = {256, 4096}, ar[] = {4e9, 6e9};
        curve(&c->att_fwd, 2, at, ar);
        curve(&c->att_bwd, 2, at, ar);
        c->elementwise_bw = c->dispatch_bw = c->adamw_bw = 5e9;
        c->h2d = c->d2h = c->h2d_duplex = c->d2h_duplex = 5e9;
    }
    fm_calib_mesh_link_default(c, c->backend);
    snprintf(c->source, sizeof c->source, "built-in default (%s; docs/plan.md)", c->device);
}

void fm_calib_mesh_link_default(fm_calib *c, const char *backend) {
    const bool cuda = backend && !strcmp(backend, "cuda");
    c->intra_node_bw = cuda ? 450e9 : 5e9;
    c->inter_node_bw = cuda ? 50e9 : 5e9;
    c->mesh_link_measured = false;
}

/* ---- JSON ---------------------------------------------------------------------------------- */

static fm_status need_num(const cJSON *o, const char *key, const char *path, bool positive, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v))
        return fm_error(FM_ERR_FORMAT, "%s: \"%s\" must be a number%s; re-run `flatmoe calibrate --out %s`", path, key,
                        v ? "" : " (missing)", path);
    const double d = v->valuedouble;
    if (!isfinite(d) || (positive ? !(d > 0) : !(d >= 0)))
        return fm_error(FM_ERR_FORMAT, "%s: \"%s\" is %g but must be finite and %s; re-run `flatmoe calibrate --out %s`",
                        path, key, d, positive ? "> 0" : ">= 0", path);
    *out = d;
    return FM_OK;
}

static fm_status need_str(const cJSON *o, const char *key, const char *path, char *dst, size_t n) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsString(v))
        return fm_error(FM_ERR_FORMAT, "%s: \"%s\" must be a string%s; re-run `flatmoe calibrate --out %s`", path, key,
                        v ? "" : " (missing)", path);
    snprintf(dst, n, "%s", v->valuestring);
    return FM_OK;
}

/* "key": [{"<xname>": x, "flops": rate}, ...] */
static fm_status need_curve(const cJSON *o, const char *key, const char *xname, const char *path, fm_calib_curve *cv) {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, key);
    const int n = cJSON_IsArray(a) ? cJSON_GetArraySize(a) : -1;
    if (n < 1 || n > FM_CALIB_MAX_POINTS)
        return fm_error(FM_ERR_FORMAT, "%s: \"%s\" must be an array of 1 to %d {\"%s\": .., \"flops\": ..} points, found "
                        "%s; re-run `flatmoe calibrate --out %s`", path, key, FM_CALIB_MAX_POINTS, xname,
                        n < 0 ? (a ? "another type" : "nothing") : "too many or none", path);
    cv->n = 0;
    for (int i = 0; i < n; i++) {
        const cJSON *p = cJSON_GetArrayItem(a, i);
        char what[96];
        snprintf(what, sizeof what, "%s[%d]", key, i);
        if (!cJSON_IsObject(p))
            return fm_error(FM_ERR_FORMAT, "%s: %s must be an object {\"%s\": .., \"flops\": ..}", path, what, xname);
        double x, r;
        fm_status s = need_num(p, xname, path, true, &x);
        if (s == FM_OK) s = need_num(p, "flops", path, true, &r);
        if (s) return fm_error(s, "%s (in %s)", fm_errmsg(), what);
        if (i > 0 && !(x > cv->x[i - 1]))
            return fm_error(FM_ERR_FORMAT, "%s: %s: \"%s\" %g must be larger than the point before (%g): the points "
                            "go in ascending order", path, what, xname, x, cv->x[i - 1]);
        fm_calib_add(cv, x, r);
    }
    return FM_OK;
}

fm_status fm_calib_load(fm_calib *c, const char *path) {
    memset(c, 0, sizeof *c);
    FILE *f = fopen(path, "rb");
    if (!f) return fm_error(FM_ERR_IO, "%s: cannot open the calibration table: %s", path, strerror(errno));
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? 2 * cap : 16384;
            if (cap > ((size_t)16 << 20)) {
                free(buf);
                fclose(f);
                return fm_error(FM_ERR_FORMAT, "%s: larger than 16 MiB: not a calibration table", path);
            }
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return fm_error(FM_ERR_NOMEM, "%s: out of memory reading it", path);
            }
            buf = nb;
        }
        const size_t got = fread(buf + len, 1, 4096, f);
        len += got;
        if (got < 4096) break;
    }
    const bool err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return fm_error(FM_ERR_IO, "%s: read error", path);
    }
    buf[len] = 0;
    cJSON *j = cJSON_Parse(buf);
    free(buf);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return fm_error(FM_ERR_FORMAT, "%s: not a JSON object (a calibration table is the JSON `flatmoe calibrate` "
                        "writes); re-run `flatmoe calibrate --out %s`", path, path);
    }
    fm_status s = FM_OK;
    char fmt[64] = "";
    double ver = 0, ab = 0;
    const cJSON *rates = NULL, *link = NULL, *mesh = NULL;
    if ((s = need_str(j, "format", path, fmt, sizeof fmt))) goto out;
    if (strcmp(fmt, FM_CALIB_FORMAT)) {
        s = fm_error(FM_ERR_FORMAT, "%s: \"format\" is \"%s\", expected \"%s\"", path, fmt, FM_CALIB_FORMAT);
        goto out;
    }
    if ((s = need_num(j, "version", path, true, &ver))) goto out;
    if (ver != FM_CALIB_VERSION) {
        s = fm_error(FM_ERR_FORMAT, "%s: \"version\" is %g but this flatmoe reads version %d; re-run `flatmoe "
                     "calibrate --out %s`", path, ver, FM_CALIB_VERSION, path);
        goto out;
    }
    if ((s = need_str(j, "backend", path, c->backend, sizeof c->backend))) goto out;
    if (strcmp(c->backend, "cpu") && strcmp(c->backend, "cuda")) {
        s = fm_error(FM_ERR_FORMAT, "%s: \"backend\" is \"%s\", expected \"cpu\" or \"cuda\"", path, c->backend);
        goto out;
    }
    if ((s = need_str(j, "device", path, c->device, sizeof c->device))) goto out;
    if ((s = need_str(j, "kind", path, c->kind, sizeof c->kind))) goto out;
    if ((s = need_num(j, "act_bytes", path, true, &ab))) goto out;
    c->act_bytes = (int)ab;
    if ((s = need_num(j, "peak_flops", path, true, &c->peak_flops))) goto out;
    if ((s = need_num(j, "context_bytes", path, false, &c->context_bytes))) goto out;
    if ((s = need_num(j, "host_pinnable_bytes", path, false, &c->host_pinnable_bytes))) goto out;
    if ((s = need_curve(j, "gemm", "m", path, &c->gemm))) goto out;
    if ((s = need_curve(j, "expert_fwd", "rows_per_expert", path, &c->expert_fwd))) goto out;
    if ((s = need_curve(j, "expert_bwd", "rows_per_expert", path, &c->expert_bwd))) goto out;
    c->expert_fwd_sm90.n = c->expert_bwd_sm90.n = 0; /* optional: measured with FLATMOE_EXPERT_GEMM=sm90 */
    c->expert_fwd_fp8.n = c->expert_bwd_fp8.n = 0;   /* optional: measured where the fp8 code ops run */
    if (cJSON_GetObjectItemCaseSensitive(j, "expert_fwd_fp8") &&
        ((s = need_curve(j, "expert_fwd_fp8", "rows_per_expert", path, &c->expert_fwd_fp8)) ||
         (s = need_curve(j, "expert_bwd_fp8", "rows_per_expert", path, &c->expert_bwd_fp8))))
        goto out;
    if (cJSON_GetObjectItemCaseSensitive(j, "expert_fwd_sm90") &&
        ((s = need_curve(j, "expert_fwd_sm90", "rows_per_expert", path, &c->expert_fwd_sm90)) ||
         (s = need_curve(j, "expert_bwd_sm90", "rows_per_expert", path, &c->expert_bwd_sm90))))
        goto out;
    if ((s = need_curve(j, "attention_fwd", "t", path, &c->att_fwd))) goto out;
    if ((s = need_curve(j, "attention_bwd", "t", path, &c->att_bwd))) goto out;
    rates = cJSON_GetObjectItemCaseSensitive(j, "bandwidth");
    if (!cJSON_IsObject(rates)) {
        s = fm_error(FM_ERR_FORMAT, "%s: \"bandwidth\" must be an object of B/s figures (elementwise, dispatch, adamw)",
                     path);
        goto out;
    }
    if ((s = need_num(rates, "elementwise", path, true, &c->elementwise_bw))) goto out;
    if ((s = need_num(rates, "dispatch", path, true, &c->dispatch_bw))) goto out;
    if ((s = need_num(rates, "adamw", path, true, &c->adamw_bw))) goto out;
    c->fp8_weight_quant_bw = 0; /* optional: measured where the fp8 code ops run */
    if (cJSON_GetObjectItemCaseSensitive(rates, "fp8_weight_quant") &&
        (s = need_num(rates, "fp8_weight_quant", path, true, &c->fp8_weight_quant_bw)))
        goto out;
    link = cJSON_GetObjectItemCaseSensitive(j, "link");
    if (!cJSON_IsObject(link)) {
        s = fm_error(FM_ERR_FORMAT, "%s: \"link\" must be an object of B/s figures (h2d, d2h, h2d_duplex, d2h_duplex)",
                     path);
        goto out;
    }
    if ((s = need_num(link, "h2d", path, true, &c->h2d))) goto out;
    if ((s = need_num(link, "d2h", path, true, &c->d2h))) goto out;
    if ((s = need_num(link, "h2d_duplex", path, true, &c->h2d_duplex))) goto out;
    if ((s = need_num(link, "d2h_duplex", path, true, &c->d2h_duplex))) goto out;
    /* optional (tables written before the mesh planner have none): the nominal links */
    fm_calib_mesh_link_default(c, c->backend);
    mesh = cJSON_GetObjectItemCaseSensitive(j, "mesh_link");
    if (mesh) {
        if (!cJSON_IsObject(mesh)) {
            s = fm_error(FM_ERR_FORMAT, "%s: \"mesh_link\" must be an object of B/s figures (intra_node, inter_node) "
                         "and \"measured\" (true or false); remove it for the nominal figures", path);
            goto out;
        }
        if ((s = need_num(mesh, "intra_node", path, true, &c->intra_node_bw))) goto out;
        if ((s = need_num(mesh, "inter_node", path, true, &c->inter_node_bw))) goto out;
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(mesh, "measured");
        if (m && !cJSON_IsBool(m)) {
            s = fm_error(FM_ERR_FORMAT, "%s: \"mesh_link\".\"measured\" must be true or false", path);
            goto out;
        }
        c->mesh_link_measured = m && cJSON_IsTrue(m);
    }
    snprintf(c->source, sizeof c->source, "%s", path);
out:
    cJSON_Delete(j);
    return s;
}

static void put_curve(cJSON *j, const char *key, const char *xname, const fm_calib_curve *cv) {
    cJSON *a = cJSON_AddArrayToObject(j, key);
    for (int i = 0; i < cv->n; i++) {
        cJSON *p = cJSON_CreateObject();
        cJSON_AddNumberToObject(p, xname, cv->x[i]);
        cJSON_AddNumberToObject(p, "flops", cv->rate[i]);
        cJSON_AddItemToArray(a, p);
    }
}

fm_status fm_calib_save(const fm_calib *c, const char *path) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "format", FM_CALIB_FORMAT);
    cJSON_AddNumberToObject(j, "version", FM_CALIB_VERSION);
    cJSON_AddStringToObject(j, "backend", c->backend);
    cJSON_AddStringToObject(j, "device", c->device);
    cJSON_AddStringToObject(j, "kind", c->kind);
    cJSON_AddNumberToObject(j, "act_bytes", c->act_bytes);
    cJSON_AddNumberToObject(j, "peak_flops", c->peak_flops);
    cJSON_AddNumberToObject(j, "context_bytes", c->context_bytes);
    cJSON_AddNumberToObject(j, "host_pinnable_bytes", c->host_pinnable_bytes);
    put_curve(j, "gemm", "m", &c->gemm);
    put_curve(j, "expert_fwd", "rows_per_expert", &c->expert_fwd);
    put_curve(j, "expert_bwd", "rows_per_expert", &c->expert_bwd);
    if (c->expert_fwd_sm90.n > 0 && c->expert_bwd_sm90.n > 0) {
        put_curve(j, "expert_fwd_sm90", "rows_per_expert", &c->expert_fwd_sm90);
        put_curve(j, "expert_bwd_sm90", "rows_per_expert", &c->expert_bwd_sm90);
    }
    if (c->expert_fwd_fp8.n > 0 && c->expert_bwd_fp8.n > 0) {
        put_curve(j, "expert_fwd_fp8", "rows_per_expert", &c->expert_fwd_fp8);
        put_curve(j, "expert_bwd_fp8", "rows_per_expert", &c->expert_bwd_fp8);
    }
    put_curve(j, "attention_fwd", "t", &c->att_fwd);
    put_curve(j, "attention_bwd", "t", &c->att_bwd);
    cJSON *b = cJSON_AddObjectToObject(j, "bandwidth");
    cJSON_AddNumberToObject(b, "elementwise", c->elementwise_bw);
    cJSON_AddNumberToObject(b, "dispatch", c->dispatch_bw);
    cJSON_AddNumberToObject(b, "adamw", c->adamw_bw);
    if (c->fp8_weight_quant_bw > 0) cJSON_AddNumberToObject(b, "fp8_weight_quant", c->fp8_weight_quant_bw);
    cJSON *l = cJSON_AddObjectToObject(j, "link");
    cJSON_AddNumberToObject(l, "h2d", c->h2d);
    cJSON_AddNumberToObject(l, "d2h", c->d2h);
    cJSON_AddNumberToObject(l, "h2d_duplex", c->h2d_duplex);
    cJSON_AddNumberToObject(l, "d2h_duplex", c->d2h_duplex);
    if (c->intra_node_bw > 0 && c->inter_node_bw > 0) {
        cJSON *m = cJSON_AddObjectToObject(j, "mesh_link");
        cJSON_AddNumberToObject(m, "intra_node", c->intra_node_bw);
        cJSON_AddNumberToObject(m, "inter_node", c->inter_node_bw);
        cJSON_AddBoolToObject(m, "measured", c->mesh_link_measured);
    }
    char *text = cJSON_Print(j);
    cJSON_Delete(j);
    if (!text) return fm_error(FM_ERR_NOMEM, "%s: out of memory formatting the calibration table", path);
    fm_atomic_file af;
    fm_status s = fm_atomic_open(&af, path);
    if (s == FM_OK) s = fm_atomic_write(&af, text, strlen(text));
    if (s == FM_OK) s = fm_atomic_write(&af, "\n", 1);
    if (s == FM_OK) s = fm_atomic_commit(&af);
    else fm_atomic_abort(&af);
    free(text);
    return s;
}

void fm_calib_kind_of(const char *backend, const char *name, char kind[32]) {
    if (!backend || strcmp(backend, "cuda")) {
        snprintf(kind, 32, "cpu");
        return;
    }
    if (!name || !*name) {
        snprintf(kind, 32, "h200");
        return;
    }
    static const char *const known[] = {"H200", "H100", "H800", "H20", "A100", "A800", "L40S", "B200", "GH200", "GB200"};
    /* longest match first: "GH200" before "H200" */
    int best = -1;
    for (int i = 0; i < (int)(sizeof known / sizeof known[0]); i++)
        if (strstr(name, known[i]) && (best < 0 || strlen(known[i]) > strlen(known[best]))) best = i;
    int n = 0;
    if (best >= 0) {
        for (const char *p = known[best]; *p && n < 31; p++) kind[n++] = (char)tolower((unsigned char)*p);
    } else { /* the last word of the name, lowercased, alphanumerics only */
        const char *w = strrchr(name, ' ');
        for (const char *p = w ? w + 1 : name; *p && n < 31; p++)
            if (isalnum((unsigned char)*p)) kind[n++] = (char)tolower((unsigned char)*p);
        if (n == 0) kind[n++] = 'g', kind[n++] = 'p', kind[n++] = 'u';
    }
    kind[n] = 0;
}

static bool exists(const char *p) { return access(p, R_OK) == 0; }

fm_status fm_calib_find(fm_calib *c, const char *path, const char *dir, const char *backend, const char *device_name,
                        char note[1400]) {
    note[0] = 0;
    if (path) {
        FM_TRY(fm_calib_load(c, path));
        snprintf(note, 1400, "projection: calibration table %s (%s)", path, c->device);
        return FM_OK;
    }
    char kind[32], p[600];
    fm_calib_kind_of(backend, device_name, kind);
    if (dir && *dir) { /* FLATMOE_CALIB_DIR */
        snprintf(p, sizeof p, "%s/%s.json", dir, kind);
        if (exists(p)) {
            FM_TRY(fm_calib_load(c, p));
            snprintf(note, 1400, "projection: calibration table %s (%s)", p, c->device);
            return FM_OK;
        }
    }
    /* next to the binary: <repo>/build/flatmoe (any build folder) -> <repo>/configs/calib; an
     * installed PREFIX/bin/flatmoe -> PREFIX/share/flatmoe/calib (`cmake --install`, CMakeLists.txt) */
    static const char *const rel[2] = {"../configs/calib", "../share/flatmoe/calib"};
    char exe[512];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    char *slash = n > 0 ? (exe[n] = 0, strrchr(exe, '/')) : NULL;
    if (slash) *slash = 0;
    for (int i = 0; slash && i < 2; i++) {
        snprintf(p, sizeof p, "%s/%s/%s.json", exe, rel[i], kind);
        if (exists(p)) {
            FM_TRY(fm_calib_load(c, p));
            snprintf(note, 1400, "projection: calibration table %s (%s)", p, c->device);
            return FM_OK;
        }
    }
    fm_calib_default(c, backend);
    snprintf(note, 1400, "projection: no calibration table for %s (configs/calib/%s.json not found next to the binary; "
             "`flatmoe calibrate` writes one): using the %s", backend ? backend : "cpu", kind, c->source);
    return FM_OK;
}
