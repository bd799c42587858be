/* The Jinja subset's parts (fm_jinja.h): the arena, values, tokens, the syntax tree, and the
 * entry points the lexer/parser (fm_jinja_parse.c), the evaluator (fm_jinja_eval.c) and the value
 * operations (fm_jinja_value.c) share. */
#ifndef FM_JINJA_INTERNAL_H
#define FM_JINJA_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fm_jinja.h"

/* ---- arena: everything of one parse or one render, freed at once ---- */
typedef struct jarena {
    struct jblock *head;
    bool oom; /* an allocation failed (the caller reports FM_ERR_NOMEM) */
} jarena;
void *ja_alloc(jarena *a, size_t n); /* zeroed; NULL (and a->oom) when out of memory */
char *ja_strndup(jarena *a, const char *s, size_t n);
void ja_free(jarena *a);

/* ---- values ---- */
typedef enum { JV_UNDEF, JV_NONE, JV_BOOL, JV_INT, JV_FLOAT, JV_STR, JV_LIST, JV_DICT } jkind;

typedef struct jv {
    jkind k;
    union {
        bool b;
        int64_t i;
        double f;
        struct { const char *p; size_t n; } s;
        struct jlist *l;
        struct jdict *d;
    } u;
    const char *name; /* JV_UNDEF: the name that was missing (messages), or NULL */
} jv;

typedef struct jlist { jv *v; size_t n, cap; } jlist;
typedef struct jdict { jv *key; jv *val; size_t n, cap; bool ns; } jdict; /* string keys, insertion order */

jv jv_undef(const char *name);
jv jv_none(void);
jv jv_bool(bool b);
jv jv_int(int64_t i);
jv jv_float(double f);
jv jv_str(const char *p, size_t n); /* not copied */
jv jv_list(jarena *a);
jv jv_dict(jarena *a);
bool jl_push(jarena *a, jlist *l, jv v);
bool jd_set(jarena *a, jdict *d, const char *k, size_t kn, jv v);
jv jd_get(const jdict *d, const char *k, size_t kn); /* JV_UNDEF when absent */
jv jv_from_json(jarena *a, const cJSON *j);

bool jv_truthy(jv v);
bool jv_equal(jv a, jv b);
const char *jv_kind_name(jkind k);

/* ---- output / string building ---- */
typedef struct jbuf { char *p; size_t n, cap; bool oom; } jbuf; /* fm_malloc'd */
void jb_put(jbuf *b, const char *s, size_t n);
void jb_puts(jbuf *b, const char *s);
/* str(v) as Python prints it (None, True, 1.5, ['a']); JV_UNDEF: "" */
void jv_to_text(jbuf *b, jv v);
/* json.dumps(v, ensure_ascii=False[, indent]) (indent < 0: none; separators ", " and ": ") */
void jv_to_json(jbuf *b, jv v, int indent, int depth);
/* the text of a string value into the arena */
jv jv_str_copy(jarena *a, const char *p, size_t n);

/* ---- tokens and the syntax tree ---- */
typedef enum {
    E_LIT, E_NAME, E_ATTR, E_INDEX, E_SLICE, E_CALL, E_FILTER, E_TEST, E_NEG, E_NOT, E_BIN, E_AND, E_OR,
    E_COND, E_LIST, E_DICT
} ekind;

typedef enum { OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT, OP_EQ, OP_NE, OP_LT, OP_LE,
               OP_GT, OP_GE, OP_IN, OP_NOTIN } jop;

typedef struct jexpr {
    ekind k;
    int line;
    jop op;
    bool negate;               /* E_TEST: is not */
    jv lit;                    /* E_LIT */
    const char *name;          /* E_NAME, E_ATTR (attribute), E_FILTER / E_TEST (its name) */
    struct jexpr *a, *b, *c;   /* operands: E_ATTR/E_INDEX/E_CALL/E_FILTER/E_TEST: a = the object;
                                  E_INDEX: b = key; E_SLICE: a[b:c:args[0]]; E_COND: b if a else c */
    struct jexpr **args;       /* call / filter / test arguments, list items, dict keys and values */
    const char **kw;           /* keyword names of args (NULL entries: positional) */
    int nargs;
} jexpr;

typedef enum { S_TEXT, S_OUT, S_IF, S_FOR, S_SET, S_SETATTR, S_BREAK, S_CONTINUE, S_MACRO } skind;

typedef struct jbody { struct jstmt **s; int n, cap; } jbody;

typedef struct jstmt {
    skind k;
    int line;
    const char *text; size_t n; /* S_TEXT */
    jexpr *e;                   /* S_OUT, S_IF (cond), S_FOR (iterable), S_SET / S_SETATTR (value); S_MACRO:
                                   the parameters as a call's arguments (a name, or name=default) */
    jexpr *cond;                /* S_FOR: the `if` filter, or NULL */
    const char *var, *var2;     /* S_FOR: targets (var2 NULL: one); S_SET, S_MACRO: the name; S_SETATTR: ns name */
    const char *attr;           /* S_SETATTR: attribute */
    jbody body, els;            /* S_IF: then / else; S_FOR: body / else; S_MACRO: body */
} jstmt;

struct fm_jinja {
    jarena arena;
    jbody root;
    char name[256];
};

/* ---- the evaluator's helpers (fm_jinja_value.c) ---- */
typedef struct jctx jctx; /* the render state (fm_jinja_eval.c) */
/* A filter applied to v with args (already evaluated; kw names or NULL). */
fm_status jv_filter(jctx *c, const char *name, jv v, const jv *args, const char *const *kw, int nargs, int line,
                    jv *out);
/* A test (is NAME args). */
fm_status jv_test(jctx *c, const char *name, jv v, const jv *args, int nargs, int line, bool *out);
/* A method call obj.name(args). */
fm_status jv_method(jctx *c, jv obj, const char *name, const jv *args, const char *const *kw, int nargs, int line,
                    jv *out);
jarena *jctx_arena(jctx *c);
const char *jctx_name(const jctx *c);

#endif
