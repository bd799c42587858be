/* The Jinja subset's evaluator (fm_jinja.h): statements and expressions of the tree
 * (fm_jinja_internal.h) rendered into text. Scoping follows Jinja2: a for loop's body is a scope
 * of its own, one per iteration (a `set` inside does not outlive it; namespace() objects carry
 * state out), if blocks are not scopes. An undefined name or attribute is Jinja2's default
 * Undefined: printed as "", false, iterated as empty, an error in arithmetic. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "fm_jinja_internal.h"

#define MAX_SCOPES 64
#define MAX_MACROS 64

struct jctx {
    jarena a;
    jbuf out;
    jdict *scope[MAX_SCOPES];
    int n_scope;
    int lo; /* in a macro's body: its first frame (frames 2 .. lo-1, the caller's, are not seen); else 0 */
    int ctl; /* 1: break, 2: continue pending */
    const jstmt *macro[MAX_MACROS]; /* the macros defined so far */
    int n_macro;
    const fm_jinja *t;
};

jarena *jctx_arena(jctx *c) { return &c->a; }
const char *jctx_name(const jctx *c) { return c->t->name; }

static fm_status oom(void) { return fm_error(FM_ERR_NOMEM, "chat template: out of memory"); }

static fm_status err(const jctx *c, int line, const char *fmt, const char *a, const char *b) {
    char m[400];
    snprintf(m, sizeof m, fmt, a, b);
    return fm_error(FM_ERR_FORMAT, "chat template %s, line %d: %s", c->t->name, line, m);
}

static jv lookup(const jctx *c, const char *name) {
    for (int i = c->n_scope; i-- > 0;) {
        if (i >= 2 && i < c->lo) continue; /* a macro sees its frames, the template's top level and the variables */
        jv v = jd_get(c->scope[i], name, strlen(name));
        if (v.k != JV_UNDEF) return v;
    }
    return jv_undef(name);
}

static fm_status eval(jctx *c, const jexpr *e, jv *out);

/* Evaluated arguments of e into a[], kw names in kw[]. */
static fm_status eval_args(jctx *c, const jexpr *e, jv *a) {
    for (int i = 0; i < e->nargs; i++) FM_TRY(eval(c, e->args[i], &a[i]));
    return FM_OK;
}

static int64_t norm_index(int64_t i, size_t n) { return i < 0 ? i + (int64_t)n : i; }

/* obj[key] (Jinja2's getitem, then getattr: a missing key is undefined) */
static jv subscript(jctx *c, jv o, jv k) {
    if (o.k == JV_DICT && k.k == JV_STR) return jd_get(o.u.d, k.u.s.p, k.u.s.n);
    if ((o.k == JV_LIST || o.k == JV_STR) && (k.k == JV_INT || k.k == JV_BOOL)) {
        const size_t n = o.k == JV_LIST ? o.u.l->n : o.u.s.n;
        const int64_t i = norm_index(k.k == JV_INT ? k.u.i : k.u.b, n);
        if (i < 0 || i >= (int64_t)n) return jv_undef(NULL);
        return o.k == JV_LIST ? o.u.l->v[i] : jv_str(o.u.s.p + i, 1);
    }
    (void)c;
    return jv_undef(NULL);
}

/* Python slice o[a:b:s] of a list or a string (bytes). */
static fm_status slice(jctx *c, const jexpr *e, jv o, jv *out) {
    jv lo = jv_none(), hi = jv_none(), st = jv_none();
    if (e->b) FM_TRY(eval(c, e->b, &lo));
    if (e->c) FM_TRY(eval(c, e->c, &hi));
    if (e->args[0]) FM_TRY(eval(c, e->args[0], &st));
    if (o.k != JV_LIST && o.k != JV_STR) return err(c, e->line, "a slice of a %s; expected a list or a string%s", jv_kind_name(o.k), "");
    const int64_t n = (int64_t)(o.k == JV_LIST ? o.u.l->n : o.u.s.n);
    const int64_t step = st.k == JV_INT ? st.u.i : 1;
    if (step == 0) return err(c, e->line, "a slice step of 0%s%s", "", "");
    int64_t a, b;
    if (step > 0) {
        a = lo.k == JV_INT ? norm_index(lo.u.i, (size_t)n) : 0;
        b = hi.k == JV_INT ? norm_index(hi.u.i, (size_t)n) : n;
        a = a < 0 ? 0 : a > n ? n : a;
        b = b < 0 ? 0 : b > n ? n : b;
    } else {
        a = lo.k == JV_INT ? norm_index(lo.u.i, (size_t)n) : n - 1;
        b = hi.k == JV_INT ? norm_index(hi.u.i, (size_t)n) : -1;
        a = a < -1 ? -1 : a > n - 1 ? n - 1 : a;
        b = b < -1 ? -1 : b > n - 1 ? n - 1 : b;
    }
    if (o.k == JV_STR && step == 1) {
        *out = jv_str(o.u.s.p + a, b > a ? (size_t)(b - a) : 0);
        return FM_OK;
    }
    jv l = jv_list(&c->a);
    jbuf sb = {0};
    for (int64_t i = a; step > 0 ? i < b : i > b; i += step) {
        if (o.k == JV_LIST) jl_push(&c->a, l.u.l, o.u.l->v[i]);
        else jb_put(&sb, o.u.s.p + i, 1);
    }
    if (o.k == JV_STR) {
        *out = jv_str_copy(&c->a, sb.p ? sb.p : "", sb.n);
        fm_free(sb.p);
    } else *out = l;
    return FM_OK;
}

static fm_status binop(jctx *c, const jexpr *e, jv x, jv y, jv *out) {
    const jop op = e->op;
    if (op == OP_CONCAT) {
        jbuf b = {0};
        jv_to_text(&b, x);
        jv_to_text(&b, y);
        *out = jv_str_copy(&c->a, b.p ? b.p : "", b.n);
        fm_free(b.p);
        return b.oom ? oom() : FM_OK;
    }
    if (op == OP_EQ || op == OP_NE) {
        *out = jv_bool(jv_equal(x, y) == (op == OP_EQ));
        return FM_OK;
    }
    if (op == OP_IN || op == OP_NOTIN) {
        bool in = false;
        if (y.k == JV_STR && x.k != JV_STR)
            return err(c, e->line, "'in' of a %s in a string; expected a string on its left%s", jv_kind_name(x.k), "");
        if (y.k == JV_STR) {
            for (size_t i = 0; !in && i + x.u.s.n <= y.u.s.n; i++) in = !memcmp(y.u.s.p + i, x.u.s.p, x.u.s.n);
        } else if (y.k == JV_LIST) {
            for (size_t i = 0; !in && i < y.u.l->n; i++) in = jv_equal(x, y.u.l->v[i]);
        } else if (y.k == JV_DICT) {
            in = x.k == JV_STR && jd_get(y.u.d, x.u.s.p, x.u.s.n).k != JV_UNDEF;
        } else if (y.k != JV_UNDEF) return err(c, e->line, "'in' needs a string, list or dict on its right, found %s%s", jv_kind_name(y.k), "");
        *out = jv_bool(in == (op == OP_IN));
        return FM_OK;
    }
    const bool xn = x.k == JV_INT || x.k == JV_FLOAT || x.k == JV_BOOL, yn = y.k == JV_INT || y.k == JV_FLOAT || y.k == JV_BOOL;
    if (op >= OP_LT && op <= OP_GE) {
        int cmp;
        if (xn && yn) {
            const double a = x.k == JV_FLOAT ? x.u.f : x.k == JV_INT ? (double)x.u.i : x.u.b;
            const double b = y.k == JV_FLOAT ? y.u.f : y.k == JV_INT ? (double)y.u.i : y.u.b;
            cmp = a < b ? -1 : a > b;
        } else if (x.k == JV_STR && y.k == JV_STR) {
            const size_t m = x.u.s.n < y.u.s.n ? x.u.s.n : y.u.s.n;
            cmp = memcmp(x.u.s.p, y.u.s.p, m);
            if (!cmp) cmp = x.u.s.n < y.u.s.n ? -1 : x.u.s.n > y.u.s.n;
        } else return err(c, e->line, "cannot compare %s with %s", jv_kind_name(x.k), jv_kind_name(y.k));
        *out = jv_bool(op == OP_LT ? cmp < 0 : op == OP_LE ? cmp <= 0 : op == OP_GT ? cmp > 0 : cmp >= 0);
        return FM_OK;
    }
    if (op == OP_ADD && x.k == JV_STR && y.k == JV_STR) {
        char *p = ja_alloc(&c->a, x.u.s.n + y.u.s.n + 1);
        if (!p) return oom();
        memcpy(p, x.u.s.p, x.u.s.n);
        memcpy(p + x.u.s.n, y.u.s.p, y.u.s.n);
        *out = jv_str(p, x.u.s.n + y.u.s.n);
        return FM_OK;
    }
    if (op == OP_MUL && ((x.k == JV_STR && y.k == JV_INT) || (x.k == JV_INT && y.k == JV_STR))) { /* 'ab' * 3 */
        const jv str = x.k == JV_STR ? x : y;
        const int64_t k = x.k == JV_INT ? x.u.i : y.u.i;
        if (k > 0 && str.u.s.n * (size_t)k > ((size_t)1 << 24))
            return err(c, e->line, "a string repeated past 16 MiB%s%s", "", "");
        jbuf b = {0};
        for (int64_t i = 0; i < k; i++) jb_put(&b, str.u.s.p, str.u.s.n);
        *out = jv_str_copy(&c->a, b.p ? b.p : "", b.n);
        fm_free(b.p);
        return b.oom ? oom() : FM_OK;
    }
    if (op == OP_ADD && x.k == JV_LIST && y.k == JV_LIST) {
        jv l = jv_list(&c->a);
        for (size_t i = 0; i < x.u.l->n; i++) jl_push(&c->a, l.u.l, x.u.l->v[i]);
        for (size_t i = 0; i < y.u.l->n; i++) jl_push(&c->a, l.u.l, y.u.l->v[i]);
        *out = l;
        return FM_OK;
    }
    if (!xn || !yn) {
        char m[160];
        snprintf(m, sizeof m, "%s and %s%s%s", jv_kind_name(x.k), jv_kind_name(y.k),
                 x.k == JV_UNDEF && x.name ? " (undefined: " : y.k == JV_UNDEF && y.name ? " (undefined: " : "",
                 x.k == JV_UNDEF && x.name ? x.name : y.k == JV_UNDEF && y.name ? y.name : "");
        return err(c, e->line, "an arithmetic operator on %s%s", m, (x.k == JV_UNDEF && x.name) || (y.k == JV_UNDEF && y.name) ? ")" : "");
    }
    const bool ints = x.k != JV_FLOAT && y.k != JV_FLOAT;
    const int64_t xi = x.k == JV_INT ? x.u.i : x.u.b, yi = y.k == JV_INT ? y.u.i : y.u.b;
    const double xf = x.k == JV_FLOAT ? x.u.f : (double)xi, yf = y.k == JV_FLOAT ? y.u.f : (double)yi;
    if ((op == OP_DIV || op == OP_FLOORDIV || op == OP_MOD) && yf == 0) return err(c, e->line, "division by zero%s%s", "", "");
    switch (op) {
    case OP_ADD: *out = ints ? jv_int(xi + yi) : jv_float(xf + yf); break;
    case OP_SUB: *out = ints ? jv_int(xi - yi) : jv_float(xf - yf); break;
    case OP_MUL: *out = ints ? jv_int(xi * yi) : jv_float(xf * yf); break;
    case OP_DIV: *out = jv_float(xf / yf); break;
    case OP_FLOORDIV: *out = ints ? jv_int((int64_t)floor((double)xi / (double)yi)) : jv_float(floor(xf / yf)); break;
    case OP_MOD: *out = ints ? jv_int(((xi % yi) + yi) % yi) : jv_float(xf - yf * floor(xf / yf)); break;
    default: *out = ints && yi >= 0 ? jv_int((int64_t)pow((double)xi, (double)yi)) : jv_float(pow(xf, yf)); break;
    }
    return FM_OK;
}

static fm_status run_body(jctx *c, const jbody *b);
static fm_status push_scope(jctx *c, int line);

/* Whether name is a macro defined so far or a global function of the subset. */
static bool is_function(const jctx *c, const char *name) {
    static const char *const globals[] = {"raise_exception", "namespace", "dict", "range", "strftime_now", NULL};
    for (int i = 0; globals[i]; i++)
        if (!strcmp(globals[i], name)) return true;
    for (int i = 0; i < c->n_macro; i++)
        if (!strcmp(c->macro[i]->var, name)) return true;
    return false;
}

/* A macro's call (Jinja2's Macro.__call__): positional arguments, then name=value ones, bind its
 * parameters (a missing one takes its default, else is undefined); the body renders in a frame of
 * its own, and its text is the value. */
static fm_status call_macro(jctx *c, const jstmt *m, const jexpr *e, const jv *a, jv *out) {
    const jexpr *p = m->e;
    int npos = 0;
    while (npos < e->nargs && !e->kw[npos]) npos++;
    if (npos > p->nargs)
        return fm_error(FM_ERR_FORMAT, "chat template %s, line %d: macro %s takes %d arguments, given %d", c->t->name,
                        e->line, m->var, p->nargs, npos);
    for (int k = npos; k < e->nargs; k++) {
        int i = 0;
        while (i < p->nargs && strcmp(e->kw[k], p->kw[i] ? p->kw[i] : p->args[i]->name)) i++;
        if (i == p->nargs) return err(c, e->line, "macro %s has no parameter '%s'", m->var, e->kw[k]);
    }
    FM_TRY(push_scope(c, e->line));
    const int lo = c->lo;
    c->lo = c->n_scope - 1;
    jdict *f = c->scope[c->lo];
    fm_status s = FM_OK;
    for (int i = 0; i < p->nargs && !s; i++) {
        const char *pn = p->kw[i] ? p->kw[i] : p->args[i]->name;
        jv v = jv_undef(pn);
        bool have = i < npos;
        if (have) v = a[i];
        for (int k = npos; k < e->nargs; k++)
            if (!strcmp(e->kw[k], pn)) v = a[k], have = true;
        if (!have && p->kw[i]) s = eval(c, p->args[i], &v);
        if (!s && !jd_set(&c->a, f, pn, strlen(pn), v)) s = oom();
    }
    const jbuf caller = c->out;
    c->out = (jbuf){0};
    if (!s) s = run_body(c, &m->body);
    c->ctl = 0;
    jbuf text = c->out;
    c->out = caller;
    c->lo = lo;
    c->n_scope--;
    if (!s && text.oom) s = oom();
    if (!s) *out = jv_str_copy(&c->a, text.p ? text.p : "", text.n);
    fm_free(text.p);
    return s;
}

/* A call: a method (obj.name(...)), a macro or a global function. */
static fm_status call(jctx *c, const jexpr *e, jv *out) {
    jv a[64];
    FM_TRY(eval_args(c, e, a));
    const jexpr *f = e->a;
    if (f->k == E_ATTR) {
        jv o;
        FM_TRY(eval(c, f->a, &o));
        return jv_method(c, o, f->name, a, e->kw, e->nargs, e->line, out);
    }
    const char *name = f->k == E_NAME ? f->name : "(expression)";
    for (int i = c->n_macro; i-- > 0;)
        if (!strcmp(c->macro[i]->var, name)) return call_macro(c, c->macro[i], e, a, out);
    if (!strcmp(name, "strftime_now")) { /* transformers' global: the local time now, as datetime.strftime */
        if (e->nargs < 1 || a[0].k != JV_STR) return err(c, e->line, "strftime_now() takes a format string%s%s", "", "");
        char fmt[128], buf[512];
        snprintf(fmt, sizeof fmt, "%.*s", (int)a[0].u.s.n, a[0].u.s.p);
        const time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        const size_t k = strftime(buf, sizeof buf, fmt, &tm);
        *out = jv_str_copy(&c->a, buf, k);
        return c->a.oom ? oom() : FM_OK;
    }
    if (!strcmp(name, "raise_exception")) {
        jbuf b = {0};
        if (e->nargs) jv_to_text(&b, a[0]);
        fm_status s = fm_error(FM_ERR_FORMAT, "chat template %s, line %d: the template refused the conversation: %s",
                               c->t->name, e->line, b.p ? b.p : "");
        fm_free(b.p);
        return s;
    }
    if (!strcmp(name, "namespace") || !strcmp(name, "dict")) {
        jv d = jv_dict(&c->a);
        if (!d.u.d) return oom();
        d.u.d->ns = true;
        for (int i = 0; i < e->nargs; i++) {
            if (e->kw[i]) jd_set(&c->a, d.u.d, e->kw[i], strlen(e->kw[i]), a[i]);
            else if (a[i].k == JV_DICT)
                for (size_t k = 0; k < a[i].u.d->n; k++)
                    jd_set(&c->a, d.u.d, a[i].u.d->key[k].u.s.p, a[i].u.d->key[k].u.s.n, a[i].u.d->val[k]);
        }
        *out = d;
        return FM_OK;
    }
    if (!strcmp(name, "range")) {
        int64_t lo = 0, hi = 0, st = 1;
        for (int i = 0; i < e->nargs; i++)
            if (a[i].k != JV_INT) return err(c, e->line, "range() takes integers, found %s%s", jv_kind_name(a[i].k), "");
        if (e->nargs == 1) hi = a[0].u.i;
        else if (e->nargs >= 2) lo = a[0].u.i, hi = a[1].u.i;
        if (e->nargs == 3) st = a[2].u.i;
        if (st == 0 || (hi - lo) / st > 1000000) return err(c, e->line, "range() with a step of 0 or over 1e6 items%s%s", "", "");
        jv l = jv_list(&c->a);
        for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st) jl_push(&c->a, l.u.l, jv_int(i));
        *out = l;
        return FM_OK;
    }
    return fm_error(FM_ERR_UNSUPPORTED, "chat template %s, line %d: unsupported function '%s' (the subset has "
                    "the template's macros, namespace, range, raise_exception, dict, strftime_now and the methods of "
                    "fm_jinja.h)", c->t->name, e->line, name);
}

static fm_status eval(jctx *c, const jexpr *e, jv *out) {
    jv x, y;
    switch (e->k) {
    case E_LIT: *out = e->lit; return FM_OK;
    case E_NAME: *out = lookup(c, e->name); return FM_OK;
    case E_ATTR:
        FM_TRY(eval(c, e->a, &x));
        *out = x.k == JV_DICT ? jd_get(x.u.d, e->name, strlen(e->name)) : jv_undef(e->name);
        if (out->k == JV_UNDEF) out->name = e->name;
        return FM_OK;
    case E_INDEX:
        FM_TRY(eval(c, e->a, &x));
        FM_TRY(eval(c, e->b, &y));
        *out = subscript(c, x, y);
        return FM_OK;
    case E_SLICE: FM_TRY(eval(c, e->a, &x)); return slice(c, e, x, out);
    case E_CALL: return call(c, e, out);
    case E_FILTER: {
        jv a[64];
        FM_TRY(eval(c, e->a, &x));
        FM_TRY(eval_args(c, e, a));
        return jv_filter(c, e->name, x, a, e->kw, e->nargs, e->line, out);
    }
    case E_TEST: {
        jv a[64];
        bool t;
        FM_TRY(eval(c, e->a, &x));
        FM_TRY(eval_args(c, e, a));
        if (x.k == JV_UNDEF && e->a->k == E_NAME && is_function(c, e->a->name)) x = jv_bool(true); /* `f is defined` */
        FM_TRY(jv_test(c, e->name, x, a, e->nargs, e->line, &t));
        *out = jv_bool(t != e->negate);
        return FM_OK;
    }
    case E_NEG:
        FM_TRY(eval(c, e->a, &x));
        if (x.k == JV_INT) *out = jv_int(-x.u.i);
        else if (x.k == JV_FLOAT) *out = jv_float(-x.u.f);
        else return err(c, e->line, "unary minus on a %s%s", jv_kind_name(x.k), "");
        return FM_OK;
    case E_NOT: FM_TRY(eval(c, e->a, &x)); *out = jv_bool(!jv_truthy(x)); return FM_OK;
    case E_AND: case E_OR: /* Python's: the deciding operand itself */
        FM_TRY(eval(c, e->a, &x));
        if (jv_truthy(x) == (e->k == E_OR)) { *out = x; return FM_OK; }
        return eval(c, e->b, out);
    case E_COND:
        FM_TRY(eval(c, e->a, &x));
        if (jv_truthy(x)) return eval(c, e->b, out);
        if (e->c) return eval(c, e->c, out);
        *out = jv_undef(NULL);
        return FM_OK;
    case E_BIN:
        FM_TRY(eval(c, e->a, &x));
        FM_TRY(eval(c, e->b, &y));
        return binop(c, e, x, y, out);
    case E_LIST: case E_DICT: {
        jv r = e->k == E_LIST ? jv_list(&c->a) : jv_dict(&c->a);
        for (int i = 0; i < e->nargs; i++) {
            FM_TRY(eval(c, e->args[i], &x));
            if (e->k == E_LIST) jl_push(&c->a, r.u.l, x);
            else {
                FM_TRY(eval(c, e->args[++i], &y));
                if (x.k != JV_STR) return err(c, e->line, "a dict literal's key must be a string, found %s%s", jv_kind_name(x.k), "");
                jd_set(&c->a, r.u.d, x.u.s.p, x.u.s.n, y);
            }
        }
        *out = r;
        return c->a.oom ? oom() : FM_OK;
    }
    }
    return err(c, e->line, "unknown expression%s%s", "", "");
}

static fm_status push_scope(jctx *c, int line) {
    if (c->n_scope == MAX_SCOPES) return err(c, line, "for loops and macro calls nested deeper than 60%s%s", "", "");
    jv d = jv_dict(&c->a);
    if (!d.u.d) return oom();
    c->scope[c->n_scope++] = d.u.d;
    return FM_OK;
}

static fm_status run_for(jctx *c, const jstmt *s) {
    jv it, items;
    FM_TRY(eval(c, s->e, &it));
    if (it.k == JV_UNDEF || it.k == JV_NONE) it = jv_list(&c->a); /* Undefined iterates as empty */
    if (it.k == JV_DICT) { /* its keys */
        jv l = jv_list(&c->a);
        for (size_t i = 0; i < it.u.d->n; i++) jl_push(&c->a, l.u.l, it.u.d->key[i]);
        it = l;
    } else if (it.k == JV_STR) {
        jv l = jv_list(&c->a);
        for (size_t i = 0; i < it.u.s.n; i++) jl_push(&c->a, l.u.l, jv_str(it.u.s.p + i, 1));
        it = l;
    } else if (it.k != JV_LIST) return err(c, s->line, "a for loop over a %s; expected a list, dict or string%s", jv_kind_name(it.k), "");
    items = it;
    if (s->cond) { /* the loop's `if`: filtered first, so loop.length counts what is iterated */
        items = jv_list(&c->a);
        for (size_t i = 0; i < it.u.l->n; i++) {
            FM_TRY(push_scope(c, s->line));
            jd_set(&c->a, c->scope[c->n_scope - 1], s->var, strlen(s->var), it.u.l->v[i]);
            jv keep;
            fm_status st = eval(c, s->cond, &keep);
            c->n_scope--;
            FM_TRY(st);
            if (jv_truthy(keep)) jl_push(&c->a, items.u.l, it.u.l->v[i]);
        }
    }
    const size_t n = items.u.l->n;
    for (size_t i = 0; i < n; i++) {
        FM_TRY(push_scope(c, s->line));
        jdict *f = c->scope[c->n_scope - 1];
        const jv x = items.u.l->v[i];
        if (s->var2) {
            if (x.k != JV_LIST || x.u.l->n != 2)
                return err(c, s->line, "for %s, ... unpacks pairs, found a %s", s->var, jv_kind_name(x.k));
            jd_set(&c->a, f, s->var, strlen(s->var), x.u.l->v[0]);
            jd_set(&c->a, f, s->var2, strlen(s->var2), x.u.l->v[1]);
        } else jd_set(&c->a, f, s->var, strlen(s->var), x);
        jv loop = jv_dict(&c->a);
        if (!loop.u.d) return oom();
        jd_set(&c->a, loop.u.d, "index", 5, jv_int((int64_t)i + 1));
        jd_set(&c->a, loop.u.d, "index0", 6, jv_int((int64_t)i));
        jd_set(&c->a, loop.u.d, "revindex", 8, jv_int((int64_t)(n - i)));
        jd_set(&c->a, loop.u.d, "revindex0", 9, jv_int((int64_t)(n - i - 1)));
        jd_set(&c->a, loop.u.d, "first", 5, jv_bool(i == 0));
        jd_set(&c->a, loop.u.d, "last", 4, jv_bool(i + 1 == n));
        jd_set(&c->a, loop.u.d, "length", 6, jv_int((int64_t)n));
        jd_set(&c->a, loop.u.d, "previtem", 8, i ? items.u.l->v[i - 1] : jv_undef("loop.previtem"));
        jd_set(&c->a, loop.u.d, "nextitem", 8, i + 1 < n ? items.u.l->v[i + 1] : jv_undef("loop.nextitem"));
        jd_set(&c->a, f, "loop", 4, loop);
        fm_status st = run_body(c, &s->body);
        c->n_scope--;
        FM_TRY(st);
        if (c->a.oom) return oom();
        if (c->ctl == 1) {
            c->ctl = 0;
            break;
        }
        c->ctl = 0;
    }
    if (n == 0) return run_body(c, &s->els);
    return FM_OK;
}

static fm_status run_body(jctx *c, const jbody *b) {
    for (int i = 0; i < b->n && !c->ctl; i++) {
        const jstmt *s = b->s[i];
        jv v;
        switch (s->k) {
        case S_TEXT: jb_put(&c->out, s->text, s->n); break;
        case S_OUT: FM_TRY(eval(c, s->e, &v)); jv_to_text(&c->out, v); break;
        case S_IF: FM_TRY(eval(c, s->e, &v)); FM_TRY(run_body(c, jv_truthy(v) ? &s->body : &s->els)); break;
        case S_FOR: FM_TRY(run_for(c, s)); break;
        case S_SET:
            FM_TRY(eval(c, s->e, &v));
            if (!jd_set(&c->a, c->scope[c->n_scope - 1], s->var, strlen(s->var), v)) return oom();
            break;
        case S_SETATTR: {
            jv ns = lookup(c, s->var);
            if (ns.k != JV_DICT || !ns.u.d->ns)
                return err(c, s->line, "set %s.attr needs %s to be a namespace() object", s->var, s->var);
            FM_TRY(eval(c, s->e, &v));
            if (!jd_set(&c->a, ns.u.d, s->attr, strlen(s->attr), v)) return oom();
            break;
        }
        case S_MACRO: /* defined from here on (a later one of the same name wins) */
            if (c->n_macro == MAX_MACROS) return err(c, s->line, "more than 64 macros%s%s", "", "");
            c->macro[c->n_macro++] = s;
            break;
        case S_BREAK: c->ctl = 1; break;
        case S_CONTINUE: c->ctl = 2; break;
        }
        if (c->out.oom || c->a.oom) return oom();
    }
    return FM_OK;
}

fm_status fm_jinja_render(const fm_jinja *t, const cJSON *vars, char **text, size_t *len) {
    *text = NULL;
    *len = 0;
    jctx *c = fm_malloc(sizeof *c);
    if (!c) return oom();
    memset(c, 0, sizeof *c);
    c->t = t;
    fm_status s = push_scope(c, 0);
    if (!s && vars) {
        const cJSON *e;
        cJSON_ArrayForEach(e, vars) jd_set(&c->a, c->scope[0], e->string, strlen(e->string), jv_from_json(&c->a, e));
        if (c->a.oom) s = oom();
    }
    if (!s) s = push_scope(c, 0); /* the template's own top-level sets */
    if (!s) s = run_body(c, &t->root);
    if (!s) jb_put(&c->out, "", 0); /* a NUL-terminated empty text at least */
    if (!s && c->out.oom) s = oom();
    if (!s) {
        *text = c->out.p;
        *len = c->out.n;
    } else fm_free(c->out.p);
    ja_free(&c->a);
    fm_free(c);
    return s;
}
