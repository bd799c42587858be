#!/usr/bin/env python3
"""Renders chat templates with Python's Jinja2 in the environment transformers uses for
apply_chat_template (transformers/utils/chat_template_utils.py _compile_jinja_template:
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]),
tojson = json.dumps(ensure_ascii=False, ...), raise_exception, strftime_now). Reads on stdin
{"template": str, "vars": [{...}, ...], "date": "YYYY-MM-DD" (optional: the day strftime_now
gives, at noon; else now)} and prints the list of rendered texts as JSON.
Used by tools/chat_golden.mjs (the goldens of tests/test_chat_template.c)."""
import datetime
import json
import sys

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def main():
    req = json.load(sys.stdin)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    now = datetime.datetime.strptime(req["date"], "%Y-%m-%d").replace(hour=12) if req.get("date") else None
    env.globals["strftime_now"] = lambda fmt: (now or datetime.datetime.now()).strftime(fmt)
    tmpl = env.from_string(req["template"])
    json.dump([tmpl.render(**v) for v in req["vars"]], sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
