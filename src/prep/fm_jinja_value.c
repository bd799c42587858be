/* The Jinja subset's values (fm_jinja_internal.h): the arena, construction from JSON, Python's
 * truth, equality, str() and json.dumps forms, and the filters, tests and methods of the subset
 * (fm_jinja.h lists them; their meaning is Jinja2's builtin filters and tests, jinja2/filters.py
 * and jinja2/tests.py, and Python's str and dict methods). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fm_jinja_internal.h"

/* ---- arena ---- */
struct jblock { struct jblock *next; size_t used, cap; max_align_t data[]; };

void *ja_alloc(jarena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    struct jblock *b = a->head;
    if (!b || b->used + n > b->cap) {
        const size_t cap = n > ((size_t)1 << 16) ? n : ((size_t)1 << 16);
        b = malloc(sizeof *b + cap);
        if (!b) {
            a->oom = true;
            return NULL;
        }
        b->next = a->head, b->used = 0, b->cap = cap;
        a->head = b;
    }
    void *p = (char *)b->data + b->used;
    b->used += n;
    memset(p, 0, n);
    return p;
}

char *ja_strndup(jarena *a, const char *s, size_t n) {
    char *p = ja_alloc(a, n + 1);
    if (p) memcpy(p, s, n);
    return p;
}

void ja_free(jarena *a) {
    for (struct jblock *b = a->head, *n; b; b = n) {
        n = b->next;
        free(b);
    }
    a->head = NULL;
}

/* ---- values ---- */
jv jv_undef(const char *name) { jv v = {JV_UNDEF, {0}, name}; return v; }
jv jv_none(void) { jv v = {JV_NONE, {0}, NULL}; return v; }
jv jv_bool(bool b) { jv v = {JV_BOOL, {.b = b}, NULL}; return v; }
jv jv_int(int64_t i) { jv v = {JV_INT, {.i = i}, NULL}; return v; }
jv jv_float(double f) { jv v = {JV_FLOAT, {.f = f}, NULL}; return v; }
jv jv_str(const char *p, size_t n) { jv v = {JV_STR, {.s = {p, n}}, NULL}; return v; }
jv jv_str_copy(jarena *a, const char *p, size_t n) {
    char *c = ja_strndup(a, p, n);
    return c ? jv_str(c, n) : jv_str("", 0);
}
jv jv_list(jarena *a) { jv v = {JV_LIST, {.l = ja_alloc(a, sizeof(jlist))}, NULL}; return v; }
jv jv_dict(jarena *a) { jv v = {JV_DICT, {.d = ja_alloc(a, sizeof(jdict))}, NULL}; return v; }

bool jl_push(jarena *a, jlist *l, jv v) {
    if (!l) return false;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 8;
        jv *n = ja_alloc(a, sizeof *n * cap);
        if (!n) return false;
        if (l->n) memcpy(n, l->v, sizeof *n * l->n);
        l->v = n, l->cap = cap;
    }
    l->v[l->n++] = v;
    return true;
}

bool jd_set(jarena *a, jdict *d, const char *k, size_t kn, jv v) {
    if (!d) return false;
    for (size_t i = 0; i < d->n; i++)
        if (d->key[i].u.s.n == kn && !memcmp(d->key[i].u.s.p, k, kn)) {
            d->val[i] = v;
            return true;
        }
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 8;
        jv *nk = ja_alloc(a, sizeof *nk * cap), *nv = ja_alloc(a, sizeof *nv * cap);
        if (!nk || !nv) return false;
        if (d->n) memcpy(nk, d->key, sizeof *nk * d->n), memcpy(nv, d->val, sizeof *nv * d->n);
        d->key = nk, d->val = nv, d->cap = cap;
    }
    d->key[d->n] = jv_str_copy(a, k, kn);
    d->val[d->n++] = v;
    return true;
}

jv jd_get(const jdict *d, const char *k, size_t kn) {
    for (size_t i = 0; d && i < d->n; i++)
        if (d->key[i].u.s.n == kn && !memcmp(d->key[i].u.s.p, k, kn)) return d->val[i];
    return jv_undef(NULL);
}

jv jv_from_json(jarena *a, const cJSON *j) {
    if (!j || cJSON_IsNull(j)) return jv_none();
    if (cJSON_IsBool(j)) return jv_bool(cJSON_IsTrue(j));
    if (cJSON_IsNumber(j)) {
        const double d = j->valuedouble;
        /* cJSON keeps no integer/float distinction: a whole number within 2^53 is an int (so a
         * JSON 1.0 reads as 1) */
        if (d == floor(d) && fabs(d) < 9007199254740992.0)
            return jv_int((int64_t)d);
        return jv_float(d);
    }
    if (cJSON_IsString(j)) return jv_str(j->valuestring, strlen(j->valuestring));
    if (cJSON_IsArray(j)) {
        jv l = jv_list(a);
        const cJSON *e;
        cJSON_ArrayForEach(e, j) jl_push(a, l.u.l, jv_from_json(a, e));
        return l;
    }
    jv d = jv_dict(a);
    const cJSON *e;
    cJSON_ArrayForEach(e, j) jd_set(a, d.u.d, e->string, strlen(e->string), jv_from_json(a, e));
    return d;
}

bool jv_truthy(jv v) {
    switch (v.k) {
    case JV_BOOL: return v.u.b;
    case JV_INT: return v.u.i != 0;
    case JV_FLOAT: return v.u.f != 0;
    case JV_STR: return v.u.s.n > 0;
    case JV_LIST: return v.u.l && v.u.l->n > 0;
    case JV_DICT: return v.u.d && v.u.d->n > 0;
    default: return false;
    }
}

static bool is_num(jv v) { return v.k == JV_INT || v.k == JV_FLOAT || v.k == JV_BOOL; }
static double num(jv v) { return v.k == JV_FLOAT ? v.u.f : v.k == JV_INT ? (double)v.u.i : (double)v.u.b; }

bool jv_equal(jv a, jv b) {
    if (is_num(a) && is_num(b)) return num(a) == num(b);
    if (a.k != b.k) return false;
    switch (a.k) {
    case JV_UNDEF: case JV_NONE: return true;
    case JV_STR: return a.u.s.n == b.u.s.n && !memcmp(a.u.s.p, b.u.s.p, a.u.s.n);
    case JV_LIST:
        if (a.u.l->n != b.u.l->n) return false;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!jv_equal(a.u.l->v[i], b.u.l->v[i])) return false;
        return true;
    case JV_DICT:
        if (a.u.d->n != b.u.d->n) return false;
        for (size_t i = 0; i < a.u.d->n; i++)
            if (!jv_equal(a.u.d->val[i], jd_get(b.u.d, a.u.d->key[i].u.s.p, a.u.d->key[i].u.s.n))) return false;
        return true;
    default: return false;
    }
}

const char *jv_kind_name(jkind k) {
    static const char *n[] = {"undefined", "none", "boolean", "integer", "float", "string", "list", "dict"};
    return n[k];
}

/* ---- text ---- */
void jb_put(jbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = fm_malloc(cap);
        if (!p) {
            b->oom = true;
            return;
        }
        if (b->n) memcpy(p, b->p, b->n);
        fm_free(b->p);
        b->p = p, b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}
void jb_puts(jbuf *b, const char *s) { jb_put(b, s, strlen(s)); }

/* Python's repr of a float: the shortest digits that read back (%.17g trimmed), with ".0" when
 * whole. */
static void put_float(jbuf *b, double f) {
    char t[40];
    if (isnan(f)) { jb_puts(b, "NaN"); return; }
    if (isinf(f)) { jb_puts(b, f > 0 ? "Infinity" : "-Infinity"); return; }
    for (int p = 1; p <= 17; p++) {
        snprintf(t, sizeof t, "%.*g", p, f);
        if (strtod(t, NULL) == f) break;
    }
    if (!strpbrk(t, ".eEn")) strcat(t, ".0");
    jb_puts(b, t);
}

static void put_repr_str(jbuf *b, jv v) { /* Python repr of a str: '...' */
    jb_put(b, "'", 1);
    for (size_t i = 0; i < v.u.s.n; i++) {
        const char c = v.u.s.p[i];
        if (c == '\'' || c == '\\') jb_put(b, "\\", 1);
        if (c == '\n') jb_puts(b, "\\n");
        else jb_put(b, &c, 1);
    }
    jb_put(b, "'", 1);
}

static void put_repr(jbuf *b, jv v) {
    if (v.k == JV_STR) put_repr_str(b, v);
    else jv_to_text(b, v);
}

void jv_to_text(jbuf *b, jv v) {
    char t[32];
    switch (v.k) {
    case JV_UNDEF: return;
    case JV_NONE: jb_puts(b, "None"); return;
    case JV_BOOL: jb_puts(b, v.u.b ? "True" : "False"); return;
    case JV_INT: snprintf(t, sizeof t, "%lld", (long long)v.u.i); jb_puts(b, t); return;
    case JV_FLOAT: put_float(b, v.u.f); return;
    case JV_STR: jb_put(b, v.u.s.p, v.u.s.n); return;
    case JV_LIST:
        jb_put(b, "[", 1);
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i) jb_puts(b, ", ");
            put_repr(b, v.u.l->v[i]);
        }
        jb_put(b, "]", 1);
        return;
    case JV_DICT:
        jb_put(b, "{", 1);
        for (size_t i = 0; i < v.u.d->n; i++) {
            if (i) jb_puts(b, ", ");
            put_repr_str(b, v.u.d->key[i]);
            jb_puts(b, ": ");
            put_repr(b, v.u.d->val[i]);
        }
        jb_put(b, "}", 1);
        return;
    }
}

static void put_json_str(jbuf *b, const char *s, size_t n) {
    jb_put(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = (unsigned char)s[i];
        char t[8];
        if (c == '"' || c == '\\') { t[0] = '\\', t[1] = (char)c; jb_put(b, t, 2); }
        else if (c == '\n') jb_puts(b, "\\n");
        else if (c == '\r') jb_puts(b, "\\r");
        else if (c == '\t') jb_puts(b, "\\t");
        else if (c == '\b') jb_puts(b, "\\b");
        else if (c == '\f') jb_puts(b, "\\f");
        else if (c < 0x20 || c == 0x7f) {
            snprintf(t, sizeof t, "\\u%04x", c);
            jb_puts(b, t);
        } else jb_put(b, (const char *)&c, 1);
    }
    jb_put(b, "\"", 1);
}

static void newline_indent(jbuf *b, int indent, int depth) {
    jb_put(b, "\n", 1);
    for (int i = 0; i < indent * depth; i++) jb_put(b, " ", 1);
}

void jv_to_json(jbuf *b, jv v, int indent, int depth) {
    switch (v.k) {
    case JV_UNDEF: case JV_NONE: jb_puts(b, "null"); return;
    case JV_BOOL: jb_puts(b, v.u.b ? "true" : "false"); return;
    case JV_INT: case JV_FLOAT: jv_to_text(b, v); return;
    case JV_STR: put_json_str(b, v.u.s.p, v.u.s.n); return;
    case JV_LIST: case JV_DICT: {
        const bool list = v.k == JV_LIST;
        const size_t n = list ? v.u.l->n : v.u.d->n;
        jb_put(b, list ? "[" : "{", 1);
        for (size_t i = 0; i < n; i++) {
            if (i) jb_put(b, ",", 1);
            if (indent >= 0) newline_indent(b, indent, depth + 1);
            else if (i) jb_put(b, " ", 1);
            if (list) jv_to_json(b, v.u.l->v[i], indent, depth + 1);
            else {
                put_json_str(b, v.u.d->key[i].u.s.p, v.u.d->key[i].u.s.n);
                jb_puts(b, ": ");
                jv_to_json(b, v.u.d->val[i], indent, depth + 1);
            }
        }
        if (indent >= 0 && n) newline_indent(b, indent, depth);
        jb_put(b, list ? "]" : "}", 1);
        return;
    }
    }
}
