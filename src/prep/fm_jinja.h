/* A Jinja subset for Hugging Face chat templates (tokenizer_config.json "chat_template", or a
 * chat_template.jinja file), implemented in C so that `flatmoe prepare` renders chats with the
 * model's own template (issue 28 item 2). The language is Jinja2's (jinja.palletsprojects.com,
 * "Template Designer Documentation"), in the environment transformers renders chat templates with
 * (transformers/utils/chat_template_utils.py _compile_jinja_template: trim_blocks and
 * lstrip_blocks on, the loopcontrols extension, raise_exception, tojson as json.dumps with
 * ensure_ascii off, a single trailing newline of the template dropped as Jinja does).
 *
 * Supported:
 *   text, {{ expr }}, {# comments #}, whitespace control ({%- -%} {{- -}} {#- -#});
 *   {% if %} {% elif %} {% else %} {% endif %}; {% for x in e [if cond] %} ... [{% else %}]
 *   {% endfor %} (targets x or a, b; loop.index, index0, revindex, revindex0, first, last,
 *   length, previtem, nextitem); {% set x = e %}, {% set ns.attr = e %}; {% break %},
 *   {% continue %}; {% generation %} ... {% endgeneration %} (transformers' marker, rendered as
 *   its body); {% macro name(a, b=default) %} ... {% endmacro %} (called with positional and
 *   name=value arguments, recursion included; its value is its text; its body sees its
 *   parameters, the render's variables and the template's top level, not the caller's loops);
 *   literals (strings, integers, floats, true/false/none in either case, lists, dicts, tuples),
 *   names, .attr, [index], [a:b:c] slices, calls; operators or, and, not, ==, !=, <, <=, >, >=,
 *   in, not in, +, -, *, /, //, %, ~, unary -, x if c else y; tests (is [not]) defined,
 *   undefined, none, string, number, integer, float, boolean, true, false, mapping, iterable,
 *   sequence, odd, even, divisibleby, eq/equalto/sameas;
 *   filters trim, length/count, tojson (indent), string, upper, lower, capitalize, title, first,
 *   last, join, default/d, list, items, reverse, int, float, abs, replace, safe, map(attribute=),
 *   selectattr/rejectattr (attribute[, test[, value]]), unique;
 *   string methods startswith, endswith, split, strip, lstrip, rstrip, upper, lower, replace,
 *   title, capitalize, find, count; dict methods items, keys, values, get;
 *   globals namespace(...), range(...), raise_exception(msg), dict(...), strftime_now(format)
 *   (transformers' global: the local time now, so a template that prints the date, e.g.
 *   GPT-OSS's, renders the day it runs).
 * Anything else (call, filter blocks, include, import, extends, block, raw, set blocks, other
 * filters, tests or methods) is FM_ERR_UNSUPPORTED naming the construct and its line; a method
 * of the subset called on a value of another type (a message's content that is a list where the
 * template calls .strip()) is FM_ERR_FORMAT, the data's error, as Jinja2 raises it.
 */
#ifndef FM_JINJA_H
#define FM_JINJA_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "../core/fm_core.h"

typedef struct fm_jinja fm_jinja;

/* Parses template text src[0..n) (UTF-8); name (a file name) is used in messages. *out is the
 * compiled template, freed by fm_jinja_free. Errors: FM_ERR_FORMAT (a syntax error: the line and
 * what was expected), FM_ERR_UNSUPPORTED (a construct outside the subset, named with its line),
 * FM_ERR_NOMEM. */
fm_status fm_jinja_parse(const char *src, size_t n, const char *name, fm_jinja **out);

/* Renders t with the variables of the JSON object vars (each key a global name: messages, tools,
 * add_generation_prompt, bos_token, ...). *text is fm_malloc'd, NUL-terminated, *len bytes.
 * Errors: FM_ERR_FORMAT (the template's raise_exception, with its message; a type error such as
 * adding a string to a list, naming the line), FM_ERR_UNSUPPORTED (an unknown filter, test,
 * method or function met while rendering, with its line), FM_ERR_NOMEM. */
fm_status fm_jinja_render(const fm_jinja *t, const cJSON *vars, char **text, size_t *len);

/* Frees a template (NULL is fine). */
void fm_jinja_free(fm_jinja *t);

#endif
