/* The Jinja subset's filters, tests and methods (fm_jinja.h lists them): Jinja2's builtin filters
 * and tests (jinja2/filters.py, jinja2/tests.py) and Python's str / dict methods, on the values of
 * fm_jinja_internal.h. Anything else is FM_ERR_UNSUPPORTED naming it and the line. */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fm_jinja_internal.h"

static fm_status unsupported(jctx *c, int line, const char *what, const char *name) {
    return fm_error(FM_ERR_UNSUPPORTED, "chat template %s, line %d: unsupported %s '%s' (fm_jinja.h lists the subset "
                    "flatmoe implements)", jctx_name(c), line, what, name);
}

static fm_status type_error(jctx *c, int line, const char *what, jv v) {
    return fm_error(FM_ERR_FORMAT, "chat template %s, line %d: %s, found %s%s%s", jctx_name(c), line, what,
                    jv_kind_name(v.k), v.k == JV_UNDEF && v.name ? " " : "", v.k == JV_UNDEF && v.name ? v.name : "");
}

static bool eq(const char *a, const char *b) { return !strcmp(a, b); }
static bool sp(char ch) { return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\f' || ch == '\v'; }

/* strip / lstrip / rstrip: chars (a string) or white space when none */
static jv strip(jv s, const jv *chars, bool left, bool right) {
    const char *p = s.u.s.p;
    size_t a = 0, e = s.u.s.n;
    const bool ws = !chars || chars->k != JV_STR;
    #define IN(ch) (ws ? sp(ch) : memchr(chars->u.s.p, (ch), chars->u.s.n) != NULL)
    if (left) while (a < e && IN(p[a])) a++;
    if (right) while (e > a && IN(p[e - 1])) e--;
    #undef IN
    return jv_str(p + a, e - a);
}

static jv case_map(jarena *A, jv s, int mode) { /* 0 lower, 1 upper, 2 capitalize, 3 title (ASCII) */
    char *o = ja_alloc(A, s.u.s.n + 1);
    if (!o) return s;
    bool start = true;
    for (size_t i = 0; i < s.u.s.n; i++) {
        const unsigned char ch = (unsigned char)s.u.s.p[i];
        int r = ch;
        if (mode == 0) r = tolower(ch);
        else if (mode == 1) r = toupper(ch);
        else if (mode == 2) r = i == 0 ? toupper(ch) : tolower(ch);
        else r = start ? toupper(ch) : tolower(ch);
        start = !isalnum(ch);
        o[i] = (char)r;
    }
    return jv_str(o, s.u.s.n);
}

static const char *find(const char *h, size_t hn, const char *n, size_t nn) {
    if (nn == 0) return h;
    for (size_t i = 0; i + nn <= hn; i++)
        if (!memcmp(h + i, n, nn)) return h + i;
    return NULL;
}

static jv replace(jarena *A, jv s, jv from, jv to) {
    jbuf b = {0};
    size_t i = 0;
    if (from.u.s.n == 0) return s;
    for (const char *f; (f = find(s.u.s.p + i, s.u.s.n - i, from.u.s.p, from.u.s.n));) {
        jb_put(&b, s.u.s.p + i, (size_t)(f - s.u.s.p) - i);
        jb_put(&b, to.u.s.p, to.u.s.n);
        i = (size_t)(f - s.u.s.p) + from.u.s.n;
    }
    jb_put(&b, s.u.s.p + i, s.u.s.n - i);
    jv r = jv_str_copy(A, b.p ? b.p : "", b.n);
    fm_free(b.p);
    return r;
}

static jv split(jarena *A, jv s, const jv *sep, int64_t maxsplit) {
    jv l = jv_list(A);
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, i = 0;
    if (!sep || sep->k != JV_STR) { /* runs of white space, none at the ends */
        while (i < n) {
            while (i < n && sp(p[i])) i++;
            if (i >= n) break;
            size_t j = i;
            if (maxsplit >= 0 && (int64_t)l.u.l->n == maxsplit) j = n;
            else while (j < n && !sp(p[j])) j++;
            jl_push(A, l.u.l, jv_str(p + i, j - i));
            i = j;
        }
        return l;
    }
    for (const char *f; (maxsplit < 0 || (int64_t)l.u.l->n < maxsplit) &&
                        (f = find(p + i, n - i, sep->u.s.p, sep->u.s.n)) && sep->u.s.n;) {
        jl_push(A, l.u.l, jv_str(p + i, (size_t)(f - p) - i));
        i = (size_t)(f - p) + sep->u.s.n;
    }
    jl_push(A, l.u.l, jv_str(p + i, n - i));
    return l;
}

static bool starts(jv s, jv x, bool end) {
    if (x.k == JV_LIST) {
        for (size_t i = 0; i < x.u.l->n; i++)
            if (starts(s, x.u.l->v[i], end)) return true;
        return false;
    }
    if (x.k != JV_STR || x.u.s.n > s.u.s.n) return false;
    return !memcmp(s.u.s.p + (end ? s.u.s.n - x.u.s.n : 0), x.u.s.p, x.u.s.n);
}

static jv items_of(jarena *A, jv d) {
    jv l = jv_list(A);
    for (size_t i = 0; i < d.u.d->n; i++) {
        jv pair = jv_list(A);
        jl_push(A, pair.u.l, d.u.d->key[i]);
        jl_push(A, pair.u.l, d.u.d->val[i]);
        jl_push(A, l.u.l, pair);
    }
    return l;
}

/* the list of an iterable: a list, a dict's keys, a string's characters (bytes of UTF-8 kept
 * together) */
static jv as_list(jarena *A, jv v) {
    if (v.k == JV_LIST) return v;
    jv l = jv_list(A);
    if (v.k == JV_DICT)
        for (size_t i = 0; i < v.u.d->n; i++) jl_push(A, l.u.l, v.u.d->key[i]);
    else if (v.k == JV_STR)
        for (size_t i = 0; i < v.u.s.n;) {
            size_t j = i + 1;
            while (j < v.u.s.n && ((unsigned char)v.u.s.p[j] & 0xC0) == 0x80) j++;
            jl_push(A, l.u.l, jv_str(v.u.s.p + i, j - i));
            i = j;
        }
    return l;
}

static jv attr_of(jv v, jv name) {
    if (v.k != JV_DICT || name.k != JV_STR) return jv_undef(NULL);
    return jd_get(v.u.d, name.u.s.p, name.u.s.n);
}

/* A method the value's type lacks: a method of the subset on a value of another type is the data's
 * fault (e.g. a message's content that is a list or null where the template expects a string), a
 * type error as in Jinja2; any other name is outside the subset. */
static fm_status wrong_type(jctx *c, jv o, const char *m, int line) {
    static const char *const str_methods[] = {"startswith", "endswith", "strip", "lstrip", "rstrip", "split", "lower",
                                              "upper", "capitalize", "title", "replace", "find", "count", NULL};
    static const char *const dict_methods[] = {"items", "keys", "values", "get", NULL};
    char what[96];
    for (int i = 0; str_methods[i]; i++)
        if (eq(m, str_methods[i])) {
            snprintf(what, sizeof what, "the string method '%s' needs a string", m);
            return type_error(c, line, what, o);
        }
    for (int i = 0; dict_methods[i]; i++)
        if (eq(m, dict_methods[i])) {
            snprintf(what, sizeof what, "the dict method '%s' needs a dict", m);
            return type_error(c, line, what, o);
        }
    return unsupported(c, line, o.k == JV_STR ? "string method" : o.k == JV_DICT ? "dict method"
                       : o.k == JV_LIST ? "list method" : "method", m);
}

fm_status jv_method(jctx *c, jv o, const char *m, const jv *a, const char *const *kw, int n, int line, jv *out) {
    (void)kw;
    jarena *A = jctx_arena(c);
    if (o.k == JV_STR) {
        const bool sarg = n >= 1 && a[0].k == JV_STR;
        if (eq(m, "startswith") || eq(m, "endswith")) {
            if (n < 1) return type_error(c, line, "startswith/endswith need an argument", o);
            *out = jv_bool(starts(o, a[0], eq(m, "endswith")));
        } else if (eq(m, "strip") || eq(m, "lstrip") || eq(m, "rstrip")) {
            *out = strip(o, n ? &a[0] : NULL, m[0] != 'r', m[0] != 'l');
        } else if (eq(m, "split")) {
            *out = split(A, o, n ? &a[0] : NULL, n > 1 && a[1].k == JV_INT ? a[1].u.i : -1);
        } else if (eq(m, "lower") || eq(m, "upper") || eq(m, "capitalize") || eq(m, "title")) {
            *out = case_map(A, o, m[0] == 'l' ? 0 : m[0] == 'u' ? 1 : m[0] == 'c' ? 2 : 3);
        } else if (eq(m, "replace")) {
            if (n < 2 || !sarg || a[1].k != JV_STR) return type_error(c, line, "replace needs two strings", o);
            *out = replace(A, o, a[0], a[1]);
        } else if (eq(m, "find") || eq(m, "count")) {
            if (!sarg) return type_error(c, line, "find/count need a string", o);
            if (eq(m, "find")) {
                const char *f = find(o.u.s.p, o.u.s.n, a[0].u.s.p, a[0].u.s.n);
                *out = jv_int(f ? (int64_t)(f - o.u.s.p) : -1);
            } else {
                int64_t k = 0;
                size_t i = 0;
                for (const char *f; a[0].u.s.n && (f = find(o.u.s.p + i, o.u.s.n - i, a[0].u.s.p, a[0].u.s.n)); k++)
                    i = (size_t)(f - o.u.s.p) + a[0].u.s.n;
                *out = jv_int(k);
            }
        } else return wrong_type(c, o, m, line);
        return FM_OK;
    }
    if (o.k == JV_DICT) {
        if (eq(m, "items")) *out = items_of(A, o);
        else if (eq(m, "keys") || eq(m, "values")) {
            jv l = jv_list(A);
            for (size_t i = 0; i < o.u.d->n; i++) jl_push(A, l.u.l, m[0] == 'k' ? o.u.d->key[i] : o.u.d->val[i]);
            *out = l;
        } else if (eq(m, "get")) {
            if (n < 1) return type_error(c, line, "get needs a key", o);
            *out = attr_of(o, a[0]);
            if (out->k == JV_UNDEF) *out = n > 1 ? a[1] : jv_none();
        } else return wrong_type(c, o, m, line);
        return FM_OK;
    }
    if (o.k == JV_UNDEF) return type_error(c, line, "a method called on an undefined value", o);
    return wrong_type(c, o, m, line);
}

static fm_status select_attr(jctx *c, jv v, const jv *a, int n, int line, bool reject, jv *out) {
    jarena *A = jctx_arena(c);
    if (n < 1) return type_error(c, line, "selectattr/rejectattr need an attribute", v);
    if (!jv_truthy(v)) v = jv_list(A); /* Jinja2's select_or_reject: a false value (none, undefined) selects nothing */
    else if (v.k == JV_DICT) v = as_list(A, v);
    else if (v.k != JV_LIST) return type_error(c, line, "selectattr/rejectattr need a list", v);
    if (!v.u.l) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    jv l = jv_list(A);
    for (size_t i = 0; i < v.u.l->n; i++) {
        jv x = attr_of(v.u.l->v[i], a[0]);
        bool t;
        if (n < 2) t = jv_truthy(x);
        else if (a[1].k != JV_STR) return type_error(c, line, "the test of selectattr must be a name", a[1]);
        else {
            char name[64];
            snprintf(name, sizeof name, "%.*s", (int)a[1].u.s.n, a[1].u.s.p);
            FM_TRY(jv_test(c, name, x, a + 2, n - 2, line, &t));
        }
        if (t != reject) jl_push(A, l.u.l, v.u.l->v[i]);
    }
    *out = l;
    return FM_OK;
}

fm_status jv_filter(jctx *c, const char *f, jv v, const jv *a, const char *const *kw, int n, int line, jv *out) {
    jarena *A = jctx_arena(c);
    if (eq(f, "safe")) *out = v;
    else if (eq(f, "trim")) { /* Jinja2's do_trim: str(value).strip(): undefined is "", none "None" */
        if (v.k != JV_STR) {
            jbuf b = {0};
            jv_to_text(&b, v);
            v = jv_str_copy(A, b.p ? b.p : "", b.n);
            fm_free(b.p);
        }
        *out = strip(v, n ? &a[0] : NULL, true, true);
    } else if (eq(f, "length") || eq(f, "count")) {
        *out = jv_int(v.k == JV_STR ? (int64_t)as_list(A, v).u.l->n : v.k == JV_LIST ? (int64_t)v.u.l->n
                      : v.k == JV_DICT ? (int64_t)v.u.d->n : 0);
        if (v.k != JV_STR && v.k != JV_LIST && v.k != JV_DICT && v.k != JV_UNDEF)
            return type_error(c, line, "length needs a string, list or dict", v);
    } else if (eq(f, "tojson")) {
        int indent = -1;
        for (int i = 0; i < n; i++)
            if ((!kw[i] || eq(kw[i], "indent")) && a[i].k == JV_INT) indent = (int)a[i].u.i;
        jbuf b = {0};
        jv_to_json(&b, v, indent, 0);
        if (b.oom) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        *out = jv_str_copy(A, b.p ? b.p : "", b.n);
        fm_free(b.p);
    } else if (eq(f, "string")) {
        jbuf b = {0};
        jv_to_text(&b, v);
        *out = jv_str_copy(A, b.p ? b.p : "", b.n);
        fm_free(b.p);
    } else if (eq(f, "upper") || eq(f, "lower") || eq(f, "capitalize") || eq(f, "title")) {
        if (v.k != JV_STR) return type_error(c, line, "a case filter needs a string", v);
        *out = case_map(A, v, f[0] == 'l' ? 0 : f[0] == 'u' ? 1 : f[0] == 'c' ? 2 : 3);
    } else if (eq(f, "first") || eq(f, "last")) {
        jv l = as_list(A, v);
        *out = l.u.l->n ? l.u.l->v[f[0] == 'f' ? 0 : l.u.l->n - 1] : jv_undef(NULL);
    } else if (eq(f, "join")) {
        jv l = as_list(A, v);
        jbuf b = {0};
        for (size_t i = 0; i < l.u.l->n; i++) {
            if (i && n && a[0].k == JV_STR) jb_put(&b, a[0].u.s.p, a[0].u.s.n);
            jv_to_text(&b, l.u.l->v[i]);
        }
        *out = jv_str_copy(A, b.p ? b.p : "", b.n);
        fm_free(b.p);
    } else if (eq(f, "default") || eq(f, "d")) {
        const bool boolean = n > 1 && jv_truthy(a[1]);
        *out = (v.k == JV_UNDEF || (boolean && !jv_truthy(v))) ? (n ? a[0] : jv_str("", 0)) : v;
    } else if (eq(f, "list")) *out = as_list(A, v);
    else if (eq(f, "items")) {
        if (v.k != JV_DICT) return type_error(c, line, "items needs a dict", v);
        *out = items_of(A, v);
    } else if (eq(f, "reverse")) {
        if (v.k == JV_STR) {
            char *o = ja_alloc(A, v.u.s.n + 1);
            for (size_t i = 0; o && i < v.u.s.n; i++) o[i] = v.u.s.p[v.u.s.n - 1 - i];
            *out = jv_str(o ? o : "", o ? v.u.s.n : 0);
        } else {
            jv l = as_list(A, v), r = jv_list(A);
            for (size_t i = l.u.l->n; i-- > 0;) jl_push(A, r.u.l, l.u.l->v[i]);
            *out = r;
        }
    } else if (eq(f, "int")) {
        *out = jv_int(v.k == JV_STR ? strtoll(v.u.s.p, NULL, 10) : v.k == JV_FLOAT ? (int64_t)v.u.f
                      : v.k == JV_INT ? v.u.i : v.k == JV_BOOL ? v.u.b : 0);
    } else if (eq(f, "float")) {
        *out = jv_float(v.k == JV_STR ? strtod(v.u.s.p, NULL) : v.k == JV_FLOAT ? v.u.f
                        : v.k == JV_INT ? (double)v.u.i : 0.0);
    } else if (eq(f, "abs")) {
        *out = v.k == JV_INT ? jv_int(v.u.i < 0 ? -v.u.i : v.u.i) : jv_float(fabs(v.k == JV_FLOAT ? v.u.f : 0.0));
    } else if (eq(f, "replace")) {
        if (v.k != JV_STR || n < 2 || a[0].k != JV_STR || a[1].k != JV_STR)
            return type_error(c, line, "replace needs a string and two string arguments", v);
        *out = replace(A, v, a[0], a[1]);
    } else if (eq(f, "map")) {
        const jv *attr = NULL;
        for (int i = 0; i < n; i++)
            if (kw[i] && eq(kw[i], "attribute")) attr = &a[i];
        if (!attr) return unsupported(c, line, "form of filter", "map without attribute=");
        jv l = as_list(A, v), r = jv_list(A);
        for (size_t i = 0; i < l.u.l->n; i++) jl_push(A, r.u.l, attr_of(l.u.l->v[i], *attr));
        *out = r;
    } else if (eq(f, "selectattr") || eq(f, "rejectattr")) {
        return select_attr(c, v, a, n, line, f[0] == 'r', out);
    } else if (eq(f, "unique")) {
        jv l = as_list(A, v), r = jv_list(A);
        for (size_t i = 0; i < l.u.l->n; i++) {
            bool seen = false;
            for (size_t k = 0; k < r.u.l->n && !seen; k++) seen = jv_equal(r.u.l->v[k], l.u.l->v[i]);
            if (!seen) jl_push(A, r.u.l, l.u.l->v[i]);
        }
        *out = r;
    } else return unsupported(c, line, "filter", f);
    return A->oom ? fm_error(FM_ERR_NOMEM, "chat template: out of memory") : FM_OK;
}

fm_status jv_test(jctx *c, const char *t, jv v, const jv *a, int n, int line, bool *out) {
    if (eq(t, "defined")) *out = v.k != JV_UNDEF;
    else if (eq(t, "undefined")) *out = v.k == JV_UNDEF;
    else if (eq(t, "none")) *out = v.k == JV_NONE;
    else if (eq(t, "string")) *out = v.k == JV_STR;
    else if (eq(t, "number")) *out = v.k == JV_INT || v.k == JV_FLOAT;
    else if (eq(t, "integer")) *out = v.k == JV_INT;
    else if (eq(t, "float")) *out = v.k == JV_FLOAT;
    else if (eq(t, "boolean")) *out = v.k == JV_BOOL;
    else if (eq(t, "true")) *out = v.k == JV_BOOL && v.u.b;
    else if (eq(t, "false")) *out = v.k == JV_BOOL && !v.u.b;
    else if (eq(t, "mapping")) *out = v.k == JV_DICT;
    else if (eq(t, "iterable")) *out = v.k == JV_LIST || v.k == JV_DICT || v.k == JV_STR;
    else if (eq(t, "sequence")) *out = v.k == JV_LIST || v.k == JV_STR || v.k == JV_DICT;
    else if (eq(t, "odd") || eq(t, "even")) {
        if (v.k != JV_INT) return type_error(c, line, "odd/even need an integer", v);
        *out = (v.u.i % 2 != 0) == (t[0] == 'o');
    } else if (eq(t, "divisibleby")) {
        if (v.k != JV_INT || n < 1 || a[0].k != JV_INT || a[0].u.i == 0)
            return type_error(c, line, "divisibleby needs integers", v);
        *out = v.u.i % a[0].u.i == 0;
    } else if (eq(t, "eq") || eq(t, "equalto") || eq(t, "==") || eq(t, "sameas")) {
        if (n < 1) return type_error(c, line, "an equality test needs an argument", v);
        *out = jv_equal(v, a[0]);
    } else if (eq(t, "ne") || eq(t, "!=")) {
        if (n < 1) return type_error(c, line, "an inequality test needs an argument", v);
        *out = !jv_equal(v, a[0]);
    } else return unsupported(c, line, "test", t);
    return FM_OK;
}
