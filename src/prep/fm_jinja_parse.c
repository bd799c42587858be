/* The Jinja subset's lexer and parser (fm_jinja.h): template text -> statements and expressions
 * (fm_jinja_internal.h). Whitespace control follows Jinja2 with trim_blocks and lstrip_blocks on
 * (the transformers environment): a block or comment tag's first following newline is dropped,
 * spaces and tabs before one at the start of a line are dropped, and "-" on a tag strips all the
 * white space on that side. The expression grammar and its precedence are Jinja2's
 * (jinja2/parser.py: parse_condexpr, or, and, not, compare, math1, concat, math2, pow, unary with
 * postfix, filters and tests). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fm_jinja_internal.h"

typedef enum { T_TEXT, T_BLOCK, T_VAR, T_END, T_NAME, T_STR, T_INT, T_FLOAT, T_OP, T_EOF } ttype;

typedef struct tok {
    ttype t;
    const char *p; size_t n; /* T_TEXT / T_NAME / T_OP: the source; T_STR: the unescaped text (arena) */
    int64_t i; double f;
    int line;
} tok;

typedef struct parser {
    jarena *a;
    const char *name;
    tok *toks; int n, cap, at;
    int depth; /* nesting of expressions and blocks, bounded (MAX_DEPTH) so no input overflows the stack */
    bool oom;
} parser;

#define MAX_DEPTH 200

static fm_status perr(const parser *P, int line, fm_status code, const char *what) {
    return fm_error(code, "chat template %s, line %d: %s", P->name, line, what);
}

static bool push_tok(parser *P, tok t) {
    if (P->n == P->cap) {
        int cap = P->cap ? 2 * P->cap : 256;
        tok *n = realloc(P->toks, (size_t)cap * sizeof *n);
        if (!n) return false;
        P->toks = n;
        P->cap = cap;
    }
    P->toks[P->n++] = t;
    return true;
}

static int line_of(const char *src, const char *p) {
    int l = 1;
    for (const char *q = src; q < p; q++) l += *q == '\n';
    return l;
}

static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static bool is_id0(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool is_id(char c) { return is_id0(c) || (c >= '0' && c <= '9'); }

/* A string literal at s (quote q) into the arena; *end past it. */
static fm_status lex_string(parser *P, const char *src, const char *s, const char *e, const char **end, tok *t) {
    const char q = *s++;
    char *out = ja_alloc(P->a, (size_t)(e - s) + 1);
    if (!out) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    size_t n = 0;
    while (s < e && *s != q) {
        char c = *s++;
        if (c == '\\' && s < e) {
            c = *s++;
            switch (c) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case '0': c = '\0'; break;
            case '\\': case '\'': case '"': break;
            default: out[n++] = '\\'; break; /* kept as written, as Python does for unknown escapes */
            }
        }
        out[n++] = c;
    }
    if (s >= e) return perr(P, line_of(src, s), FM_ERR_FORMAT, "unterminated string literal");
    *end = s + 1;
    t->t = T_STR, t->p = out, t->n = n;
    return FM_OK;
}

/* The tokens of one tag body src[s..e). */
static fm_status lex_tag(parser *P, const char *src, const char *s, const char *e) {
    static const char *ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "=", "(",
                                ")", "[", "]", "{", "}", ".", ",", ":", "|", NULL};
    while (s < e) {
        if (is_ws(*s)) { s++; continue; }
        tok t = {0};
        t.line = line_of(src, s);
        if (*s == '\'' || *s == '"') {
            FM_TRY(lex_string(P, src, s, e, &s, &t));
        } else if (*s >= '0' && *s <= '9') {
            char *q;
            const char *d = s;
            while (d < e && (*d >= '0' && *d <= '9')) d++;
            if (d < e && *d == '.' && d + 1 < e && d[1] >= '0' && d[1] <= '9') {
                t.t = T_FLOAT, t.f = strtod(s, &q);
            } else {
                t.t = T_INT, t.i = strtoll(s, &q, 10);
            }
            s = q;
        } else if (is_id0(*s)) {
            t.t = T_NAME, t.p = s;
            while (s < e && is_id(*s)) s++;
            t.n = (size_t)(s - t.p);
        } else {
            int k = 0;
            for (; ops[k]; k++)
                if (!strncmp(s, ops[k], strlen(ops[k]))) break;
            if (!ops[k]) {
                char m[80];
                snprintf(m, sizeof m, "unexpected character '%c' in a tag", *s);
                return perr(P, t.line, FM_ERR_FORMAT, m);
            }
            t.t = T_OP, t.p = s, t.n = strlen(ops[k]);
            s += t.n;
        }
        if (!push_tok(P, t)) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    }
    return FM_OK;
}

/* Template text -> tokens, with the whitespace control applied to the text between tags. */
static fm_status lex(parser *P, const char *src, size_t len) {
    const char *p = src, *end = src + len;
    if (len && end[-1] == '\n') end--; /* keep_trailing_newline = False */
    if (end > src && end[-1] == '\r' && len && src[len - 1] == '\n') end--;
    int strip_next = 0; /* 1: trim_blocks (one newline), 2: '-' (all white space) */
    while (p < end) {
        const char *o = p;
        while (o + 1 < end && !(o[0] == '{' && (o[1] == '{' || o[1] == '%' || o[1] == '#'))) o++;
        if (o + 1 >= end) o = end;
        const char *ts = p, *te = o;
        if (strip_next == 2) while (ts < te && is_ws(*ts)) ts++;
        else if (strip_next == 1) {
            if (ts < te && *ts == '\n') ts++;
            else if (te - ts >= 2 && ts[0] == '\r' && ts[1] == '\n') ts += 2;
        }
        strip_next = 0;
        if (o < end) {
            const char kind = o[1];
            const bool minus = o + 2 < end && o[2] == '-', plus = o + 2 < end && o[2] == '+';
            if (minus) while (te > ts && is_ws(te[-1])) te--;
            else if ((kind == '%' || kind == '#') && !plus) { /* lstrip_blocks */
                const char *q = te;
                while (q > ts && (q[-1] == ' ' || q[-1] == '\t')) q--;
                if (q == src || q[-1] == '\n') te = q; /* at a line's start in the source */
            }
        }
        if (te > ts) {
            tok t = {T_TEXT, ts, (size_t)(te - ts), 0, 0, line_of(src, ts)};
            if (!push_tok(P, t)) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        }
        if (o >= end) break;
        const char kind = o[1];
        const char *b = o + 2;
        if (b < end && (*b == '-' || *b == '+')) b++;
        const char *close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
        const char *c = b;
        while (c + 1 < end && !(c[0] == close[0] && c[1] == close[1])) {
            if (kind != '#' && (*c == '\'' || *c == '"')) { /* skip strings: they may hold a closer */
                const char q = *c++;
                while (c < end && *c != q) c += *c == '\\' ? 2 : 1;
            }
            c++;
        }
        if (c + 1 >= end) {
            char m[80];
            snprintf(m, sizeof m, "a tag opened with '{%c' is never closed with '%s'", kind, close);
            return perr(P, line_of(src, o), FM_ERR_FORMAT, m);
        }
        const bool rminus = c > b && c[-1] == '-';
        const char *be = rminus ? c - 1 : c;
        if (kind != '#') {
            tok t = {kind == '{' ? T_VAR : T_BLOCK, o, 2, 0, 0, line_of(src, o)};
            if (!push_tok(P, t)) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
            FM_TRY(lex_tag(P, src, b, be));
            tok e = {T_END, c, 2, 0, 0, line_of(src, c)};
            if (!push_tok(P, e)) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        }
        strip_next = rminus ? 2 : kind != '{' ? 1 : 0;
        p = c + 2;
    }
    tok t = {T_EOF, end, 0, 0, 0, line_of(src, end)};
    if (!push_tok(P, t)) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    return FM_OK;
}

/* ---- the parser ---- */

static tok *peek(parser *P) { return &P->toks[P->at]; }
static bool is_op(const tok *t, const char *op) { return t->t == T_OP && t->n == strlen(op) && !memcmp(t->p, op, t->n); }
static bool is_name(const tok *t, const char *w) { return t->t == T_NAME && t->n == strlen(w) && !memcmp(t->p, w, t->n); }
static bool accept_op(parser *P, const char *op) {
    if (!is_op(peek(P), op)) return false;
    P->at++;
    return true;
}
static bool accept_name(parser *P, const char *w) {
    if (!is_name(peek(P), w)) return false;
    P->at++;
    return true;
}
static fm_status expect_op(parser *P, const char *op) {
    if (accept_op(P, op)) return FM_OK;
    char m[96];
    snprintf(m, sizeof m, "expected '%s', found '%.*s'", op, (int)(peek(P)->t == T_EOF ? 3 : peek(P)->n),
             peek(P)->t == T_EOF ? "end" : peek(P)->p);
    return perr(P, peek(P)->line, FM_ERR_FORMAT, m);
}
static fm_status expect_name(parser *P, const char **out) {
    tok *t = peek(P);
    if (t->t != T_NAME) return perr(P, t->line, FM_ERR_FORMAT, "expected a name");
    P->at++;
    *out = ja_strndup(P->a, t->p, t->n);
    return *out ? FM_OK : fm_error(FM_ERR_NOMEM, "chat template: out of memory");
}

static jexpr *node(parser *P, ekind k, int line) {
    jexpr *e = ja_alloc(P->a, sizeof *e);
    if (e) e->k = k, e->line = line;
    return e;
}

static fm_status parse_expr(parser *P, jexpr **out);

/* (args) of a call, filter or test: positional and name=value. */
static fm_status parse_args(parser *P, jexpr *e) {
    jexpr *args[64];
    const char *kw[64];
    int n = 0;
    while (!accept_op(P, ")")) {
        if (n && !accept_op(P, ",")) return expect_op(P, ")");
        if (accept_op(P, ")")) break; /* a trailing comma */
        if (n == 64) return perr(P, peek(P)->line, FM_ERR_UNSUPPORTED, "more than 64 arguments");
        kw[n] = NULL;
        if (peek(P)->t == T_NAME && is_op(&P->toks[P->at + 1], "=")) {
            FM_TRY(expect_name(P, &kw[n]));
            P->at++;
        }
        FM_TRY(parse_expr(P, &args[n]));
        n++;
    }
    e->args = ja_alloc(P->a, sizeof *e->args * (size_t)(n ? n : 1));
    e->kw = ja_alloc(P->a, sizeof *e->kw * (size_t)(n ? n : 1));
    if (!e->args || !e->kw) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    memcpy(e->args, args, sizeof *args * (size_t)n);
    memcpy(e->kw, kw, sizeof *kw * (size_t)n);
    e->nargs = n;
    return FM_OK;
}

/* A list of expressions up to closer (lists, tuples, dict items when dict). */
static fm_status parse_seq(parser *P, jexpr *e, const char *closer, bool dict) {
    jexpr *items[512];
    int n = 0;
    while (!accept_op(P, closer)) {
        if (n && !accept_op(P, ",")) return expect_op(P, closer);
        if (accept_op(P, closer)) break;
        if (n + 2 > 512) return perr(P, peek(P)->line, FM_ERR_UNSUPPORTED, "a literal of more than 256 items");
        FM_TRY(parse_expr(P, &items[n++]));
        if (dict) {
            FM_TRY(expect_op(P, ":"));
            FM_TRY(parse_expr(P, &items[n++]));
        }
    }
    e->args = ja_alloc(P->a, sizeof *e->args * (size_t)(n ? n : 1));
    if (!e->args) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    memcpy(e->args, items, sizeof *items * (size_t)n);
    e->nargs = n;
    return FM_OK;
}

static fm_status parse_primary(parser *P, jexpr **out) {
    tok *t = peek(P);
    jexpr *e = NULL;
    if (t->t == T_STR || t->t == T_INT || t->t == T_FLOAT) {
        P->at++;
        if (!(e = node(P, E_LIT, t->line))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        e->lit = t->t == T_STR ? jv_str(t->p, t->n) : t->t == T_INT ? jv_int(t->i) : jv_float(t->f);
        while (t->t == T_STR && peek(P)->t == T_STR) { /* adjacent literals concatenate */
            tok *u = peek(P);
            P->at++;
            char *s = ja_alloc(P->a, e->lit.u.s.n + u->n + 1);
            if (!s) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
            memcpy(s, e->lit.u.s.p, e->lit.u.s.n);
            memcpy(s + e->lit.u.s.n, u->p, u->n);
            e->lit = jv_str(s, e->lit.u.s.n + u->n);
        }
    } else if (t->t == T_NAME) {
        P->at++;
        if (!(e = node(P, E_LIT, t->line))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        if (is_name(t, "true") || is_name(t, "True")) e->lit = jv_bool(true);
        else if (is_name(t, "false") || is_name(t, "False")) e->lit = jv_bool(false);
        else if (is_name(t, "none") || is_name(t, "None")) e->lit = jv_none();
        else {
            e->k = E_NAME;
            if (!(e->name = ja_strndup(P->a, t->p, t->n))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        }
    } else if (is_op(t, "(")) {
        P->at++;
        FM_TRY(parse_expr(P, &e));
        if (is_op(peek(P), ",")) { /* a tuple: a list */
            jexpr *l = node(P, E_LIST, t->line);
            if (!l) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
            P->at++;
            FM_TRY(parse_seq(P, l, ")", false));
            jexpr **all = ja_alloc(P->a, sizeof *all * (size_t)(l->nargs + 1));
            if (!all) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
            all[0] = e;
            memcpy(all + 1, l->args, sizeof *all * (size_t)l->nargs);
            l->args = all, l->nargs++;
            e = l;
        } else FM_TRY(expect_op(P, ")"));
    } else if (is_op(t, "[") || is_op(t, "{")) {
        P->at++;
        const bool dict = is_op(t, "{");
        if (!(e = node(P, dict ? E_DICT : E_LIST, t->line))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        FM_TRY(parse_seq(P, e, dict ? "}" : "]", dict));
    } else {
        char m[96];
        snprintf(m, sizeof m, "expected a value, found '%.*s'", (int)(t->t == T_EOF || t->t == T_END ? 6 : t->n),
                 t->t == T_EOF || t->t == T_END ? "tag end" : t->p);
        return perr(P, t->line, FM_ERR_FORMAT, m);
    }
    *out = e;
    return FM_OK;
}

/* .attr, [index], [a:b:c], (call) after a primary. */
static fm_status parse_postfix(parser *P, jexpr **io) {
    for (;;) {
        tok *t = peek(P);
        jexpr *e;
        if (is_op(t, ".")) {
            P->at++;
            if (!(e = node(P, E_ATTR, t->line))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
            if (peek(P)->t == T_INT) { /* x.0: an index */
                e->k = E_INDEX;
                if (!(e->b = node(P, E_LIT, t->line))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
                e->b->lit = jv_int(peek(P)->i);
                P->at++;
            } else FM_TRY(expect_name(P, &e->name));
        } else if (is_op(t, "[")) {
            P->at++;
            if (!(e = node(P, E_INDEX, t->line))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
            jexpr *part[3] = {NULL, NULL, NULL};
            int k = 0;
            bool slice = false;
            for (;;) {
                if (!is_op(peek(P), ":") && !is_op(peek(P), "]")) FM_TRY(parse_expr(P, &part[k]));
                if (accept_op(P, ":")) {
                    slice = true;
                    if (++k == 3) return perr(P, t->line, FM_ERR_FORMAT, "a slice has at most two ':'");
                    continue;
                }
                FM_TRY(expect_op(P, "]"));
                break;
            }
            if (slice) {
                e->k = E_SLICE;
                e->b = part[0], e->c = part[1];
                if (!(e->args = ja_alloc(P->a, sizeof *e->args))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
                e->args[0] = part[2];
            } else {
                if (!part[0]) return perr(P, t->line, FM_ERR_FORMAT, "an empty subscript []");
                e->b = part[0];
            }
        } else if (is_op(t, "(")) {
            P->at++;
            if (!(e = node(P, E_CALL, t->line))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
            FM_TRY(parse_args(P, e));
        } else return FM_OK;
        e->a = *io;
        *io = e;
    }
}

/* | filter(args) and is [not] test [arg] after a unary operand. */
static fm_status parse_filters(parser *P, jexpr **io) {
    for (;;) {
        tok *t = peek(P);
        jexpr *e;
        if (is_op(t, "|")) {
            P->at++;
            if (!(e = node(P, E_FILTER, t->line))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
            FM_TRY(expect_name(P, &e->name));
            if (accept_op(P, "(")) FM_TRY(parse_args(P, e));
        } else if (is_name(t, "is")) {
            P->at++;
            if (!(e = node(P, E_TEST, t->line))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
            e->negate = accept_name(P, "not");
            if (accept_name(P, "none") || accept_name(P, "None")) e->name = "none";
            else if (accept_name(P, "true") || accept_name(P, "True")) e->name = "true";
            else if (accept_name(P, "false") || accept_name(P, "False")) e->name = "false";
            else FM_TRY(expect_name(P, &e->name));
            if (accept_op(P, "(")) FM_TRY(parse_args(P, e));
            else {
                tok *u = peek(P); /* one bare argument: is divisibleby 3, is sameas x */
                if (u->t == T_STR || u->t == T_INT || u->t == T_FLOAT ||
                    (u->t == T_NAME && !is_name(u, "and") && !is_name(u, "or") && !is_name(u, "if") &&
                     !is_name(u, "else") && !is_name(u, "is") && !is_name(u, "in") && !is_name(u, "not"))) {
                    jexpr *arg;
                    FM_TRY(parse_primary(P, &arg));
                    FM_TRY(parse_postfix(P, &arg));
                    e->args = ja_alloc(P->a, sizeof *e->args);
                    if (!e->args) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
                    e->args[0] = arg, e->nargs = 1;
                }
            }
        } else return FM_OK;
        e->a = *io;
        *io = e;
    }
}

static fm_status parse_unary(parser *P, jexpr **out) {
    tok *t = peek(P);
    if (is_op(t, "-") || is_op(t, "+")) {
        P->at++;
        jexpr *e = node(P, E_NEG, t->line);
        if (!e) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        if (++P->depth > MAX_DEPTH) return perr(P, t->line, FM_ERR_UNSUPPORTED, "expressions or blocks nested deeper than 200");
        FM_TRY(parse_unary(P, &e->a));
        P->depth--;
        if (is_op(t, "+")) *out = e->a;
        else *out = e;
        return FM_OK;
    }
    FM_TRY(parse_primary(P, out));
    FM_TRY(parse_postfix(P, out));
    return parse_filters(P, out);
}

/* Binary levels, lowest first: math1 (+ -), concat (~), math2 (* / // %), pow (**). */
static fm_status parse_bin(parser *P, int level, jexpr **out) {
    static const char *ops[4][5] = {{"+", "-", NULL}, {"~", NULL}, {"*", "/", "//", "%", NULL}, {"**", NULL}};
    static const jop codes[4][4] = {{OP_ADD, OP_SUB}, {OP_CONCAT}, {OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD}, {OP_POW}};
    if (level == 4) return parse_unary(P, out);
    FM_TRY(parse_bin(P, level + 1, out));
    for (;;) {
        int k = 0;
        for (; ops[level][k]; k++)
            if (is_op(peek(P), ops[level][k])) break;
        if (!ops[level][k]) return FM_OK;
        jexpr *e = node(P, E_BIN, peek(P)->line);
        if (!e) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        P->at++;
        e->op = codes[level][k];
        e->a = *out;
        FM_TRY(parse_bin(P, level + 1, &e->b));
        *out = e;
    }
}

static fm_status parse_compare(parser *P, jexpr **out) {
    FM_TRY(parse_bin(P, 0, out));
    for (;;) {
        tok *t = peek(P);
        jop op;
        if (is_op(t, "==")) op = OP_EQ;
        else if (is_op(t, "!=")) op = OP_NE;
        else if (is_op(t, "<")) op = OP_LT;
        else if (is_op(t, "<=")) op = OP_LE;
        else if (is_op(t, ">")) op = OP_GT;
        else if (is_op(t, ">=")) op = OP_GE;
        else if (is_name(t, "in")) op = OP_IN;
        else if (is_name(t, "not") && is_name(&P->toks[P->at + 1], "in")) op = OP_NOTIN, P->at++;
        else return FM_OK;
        P->at++;
        jexpr *e = node(P, E_BIN, t->line);
        if (!e) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        e->op = op, e->a = *out;
        FM_TRY(parse_bin(P, 0, &e->b));
        *out = e;
    }
}

static fm_status parse_not(parser *P, jexpr **out) {
    tok *t = peek(P);
    if (is_name(t, "not")) {
        P->at++;
        jexpr *e = node(P, E_NOT, t->line);
        if (!e) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        if (++P->depth > MAX_DEPTH) return perr(P, t->line, FM_ERR_UNSUPPORTED, "expressions or blocks nested deeper than 200");
        FM_TRY(parse_not(P, &e->a));
        P->depth--;
        *out = e;
        return FM_OK;
    }
    return parse_compare(P, out);
}

static fm_status parse_andor(parser *P, bool or, jexpr **out) {
    FM_TRY(or ? parse_andor(P, false, out) : parse_not(P, out));
    while (is_name(peek(P), or ? "or" : "and")) {
        jexpr *e = node(P, or ? E_OR : E_AND, peek(P)->line);
        if (!e) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        P->at++;
        e->a = *out;
        FM_TRY(or ? parse_andor(P, false, &e->b) : parse_not(P, &e->b));
        *out = e;
    }
    return FM_OK;
}

static fm_status parse_expr_in(parser *P, jexpr **out);

static fm_status parse_expr(parser *P, jexpr **out) {
    if (++P->depth > MAX_DEPTH) return perr(P, peek(P)->line, FM_ERR_UNSUPPORTED, "expressions or blocks nested deeper than 200");
    fm_status s = parse_expr_in(P, out);
    P->depth--;
    return s;
}

static fm_status parse_expr_in(parser *P, jexpr **out) {
    FM_TRY(parse_andor(P, true, out));
    while (is_name(peek(P), "if")) { /* x if c [else y] */
        jexpr *e = node(P, E_COND, peek(P)->line);
        if (!e) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        P->at++;
        e->b = *out;
        FM_TRY(parse_andor(P, true, &e->a));
        if (accept_name(P, "else")) FM_TRY(parse_expr(P, &e->c));
        *out = e;
    }
    return FM_OK;
}

/* ---- statements ---- */

static bool body_push(parser *P, jbody *b, jstmt *s) {
    if (b->n == b->cap) {
        int cap = b->cap ? 2 * b->cap : 8;
        jstmt **n = ja_alloc(P->a, sizeof *n * (size_t)cap);
        if (!n) return false;
        if (b->n) memcpy(n, b->s, sizeof *n * (size_t)b->n);
        b->s = n, b->cap = cap;
    }
    b->s[b->n++] = s;
    return true;
}

static fm_status parse_body(parser *P, jbody *b, const char *const *ends, int *which);

static fm_status end_tag(parser *P) {
    if (peek(P)->t == T_END) {
        P->at++;
        return FM_OK;
    }
    return perr(P, peek(P)->line, FM_ERR_FORMAT, "expected the end of the tag ('%}')");
}

/* The statement after "{%" whose keyword is at P->at. */
static fm_status parse_stmt(parser *P, jstmt *s) {
    tok *kw = peek(P);
    s->line = kw->line;
    if (accept_name(P, "if")) {
        s->k = S_IF;
        FM_TRY(parse_expr(P, &s->e));
        FM_TRY(end_tag(P));
        static const char *const ends[] = {"elif", "else", "endif", NULL};
        int w;
        FM_TRY(parse_body(P, &s->body, ends, &w));
        if (w == 0) { /* elif: a nested if in the else branch */
            jstmt *n = ja_alloc(P->a, sizeof *n);
            if (!n || !body_push(P, &s->els, n)) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
            P->at--; /* re-read "elif" as "if" */
            P->toks[P->at].p = "if", P->toks[P->at].n = 2;
            return parse_stmt(P, n);
        }
        if (w == 1) {
            FM_TRY(end_tag(P));
            static const char *const endif[] = {"endif", NULL};
            FM_TRY(parse_body(P, &s->els, endif, &w));
        }
        return end_tag(P);
    }
    if (accept_name(P, "for")) {
        s->k = S_FOR;
        FM_TRY(expect_name(P, &s->var));
        if (accept_op(P, ",")) FM_TRY(expect_name(P, &s->var2));
        if (!accept_name(P, "in")) return perr(P, s->line, FM_ERR_FORMAT, "expected 'in' after the for loop's target");
        FM_TRY(parse_andor(P, true, &s->e)); /* not parse_expr: its `if` is the loop's filter */
        if (accept_name(P, "if")) FM_TRY(parse_expr(P, &s->cond));
        if (accept_name(P, "recursive")) return perr(P, s->line, FM_ERR_UNSUPPORTED, "unsupported construct 'for ... recursive'");
        FM_TRY(end_tag(P));
        static const char *const ends[] = {"else", "endfor", NULL};
        int w;
        FM_TRY(parse_body(P, &s->body, ends, &w));
        if (w == 0) {
            FM_TRY(end_tag(P));
            static const char *const endfor[] = {"endfor", NULL};
            FM_TRY(parse_body(P, &s->els, endfor, &w));
        }
        return end_tag(P);
    }
    if (accept_name(P, "set")) {
        FM_TRY(expect_name(P, &s->var));
        s->k = S_SET;
        if (accept_op(P, ".")) {
            s->k = S_SETATTR;
            FM_TRY(expect_name(P, &s->attr));
        }
        if (is_op(peek(P), ",")) return perr(P, s->line, FM_ERR_UNSUPPORTED, "unsupported construct 'set a, b = ...' (tuple assignment)");
        if (peek(P)->t == T_END) return perr(P, s->line, FM_ERR_UNSUPPORTED, "unsupported construct '{% set x %}...{% endset %}' (block assignment)");
        FM_TRY(expect_op(P, "="));
        FM_TRY(parse_expr(P, &s->e));
        return end_tag(P);
    }
    if (accept_name(P, "break") || accept_name(P, "continue")) {
        s->k = is_name(kw, "break") ? S_BREAK : S_CONTINUE;
        return end_tag(P);
    }
    if (accept_name(P, "macro")) { /* {% macro name(a, b=default) %} ... {% endmacro %} */
        s->k = S_MACRO;
        FM_TRY(expect_name(P, &s->var));
        if (!(s->e = node(P, E_CALL, s->line))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        FM_TRY(expect_op(P, "("));
        FM_TRY(parse_args(P, s->e));
        for (int i = 0; i < s->e->nargs; i++)
            if (!s->e->kw[i] && s->e->args[i]->k != E_NAME)
                return perr(P, s->line, FM_ERR_FORMAT, "a macro's parameters are names, each with an optional = default");
        FM_TRY(end_tag(P));
        static const char *const ends[] = {"endmacro", NULL};
        int w;
        FM_TRY(parse_body(P, &s->body, ends, &w));
        return end_tag(P);
    }
    if (accept_name(P, "generation")) { /* transformers' assistant marker: its body, as an if true */
        FM_TRY(end_tag(P));
        s->k = S_IF;
        if (!(s->e = node(P, E_LIT, s->line))) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        s->e->lit = jv_bool(true);
        static const char *const ends[] = {"endgeneration", NULL};
        int w;
        FM_TRY(parse_body(P, &s->body, ends, &w));
        return end_tag(P);
    }
    char m[160];
    if (kw->t == T_NAME)
        snprintf(m, sizeof m, "unsupported construct '{%% %.*s %%}' (the subset: if/elif/else, for, set, macro, "
                 "break, continue, generation)", (int)kw->n, kw->p);
    else snprintf(m, sizeof m, "expected a statement keyword after '{%%'");
    return perr(P, kw->line, kw->t == T_NAME ? FM_ERR_UNSUPPORTED : FM_ERR_FORMAT, m);
}

/* Statements up to a "{% END %}" of ends (NULL-terminated; NULL ends: the template's end).
 * *which = the index of the keyword that ended it (P->at then past the keyword). */
static fm_status parse_body(parser *P, jbody *b, const char *const *ends, int *which) {
    if (P->depth > MAX_DEPTH) return perr(P, peek(P)->line, FM_ERR_UNSUPPORTED, "expressions or blocks nested deeper than 200");
    for (;;) {
        tok *t = peek(P);
        if (t->t == T_EOF) {
            if (!ends) return FM_OK;
            char m[96];
            int last = 0;
            while (ends[last + 1]) last++;
            snprintf(m, sizeof m, "the template ends inside a block: expected '{%% %s %%}'", ends[last]);
            return perr(P, t->line, FM_ERR_FORMAT, m);
        }
        jstmt *s = ja_alloc(P->a, sizeof *s);
        if (!s) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
        s->line = t->line;
        P->at++;
        if (t->t == T_TEXT) {
            s->k = S_TEXT, s->text = t->p, s->n = t->n;
        } else if (t->t == T_VAR) {
            s->k = S_OUT;
            FM_TRY(parse_expr(P, &s->e));
            if (peek(P)->t != T_END) return perr(P, peek(P)->line, FM_ERR_FORMAT, "expected '}}' after the expression");
            P->at++;
        } else if (t->t == T_BLOCK) {
            for (int k = 0; ends && ends[k]; k++)
                if (accept_name(P, ends[k])) {
                    *which = k;
                    return FM_OK;
                }
            P->depth++;
            fm_status st = parse_stmt(P, s);
            P->depth--;
            FM_TRY(st);
        } else return perr(P, t->line, FM_ERR_FORMAT, "unexpected token outside a tag");
        if (!body_push(P, b, s)) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    }
}

fm_status fm_jinja_parse(const char *src, size_t n, const char *name, fm_jinja **out) {
    *out = NULL;
    fm_jinja *t = fm_malloc(sizeof *t);
    if (!t) return fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name ? name : "(template)");
    parser P = {&t->arena, t->name, NULL, 0, 0, 0, false};
    /* the source is kept: text tokens point into a copy in the arena */
    char *copy = ja_alloc(&t->arena, n + 1);
    fm_status s = copy ? FM_OK : fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    if (!s) {
        memcpy(copy, src, n);
        s = lex(&P, copy, n);
    }
    if (!s) s = parse_body(&P, &t->root, NULL, NULL);
    if (!s && t->arena.oom) s = fm_error(FM_ERR_NOMEM, "chat template: out of memory");
    free(P.toks);
    if (s) {
        fm_jinja_free(t);
        return s;
    }
    *out = t;
    return FM_OK;
}

void fm_jinja_free(fm_jinja *t) {
    if (!t) return;
    ja_free(&t->arena);
    fm_free(t);
}
