#!/usr/bin/env python3
"""Rebuild ``src/tilespec/assets/code_edit.jsonl``: code-editing prompts over CPython's own standard library.

Each row is one module-level function of a fixed list of pure-Python stdlib modules, its source as
``inspect.getsource`` returns it, and one editing instruction of five kinds (add type hints, add a docstring,
rename a variable, convert string formatting to f-strings, add input validation). Fields: ``id``, ``module``,
``function``, ``kind``, ``instruction``, ``source``, ``python`` (the CPython version the source came from).

Deterministic for a given CPython version: modules in the listed order, functions sorted by name, 6 to 40 source
lines, at most ``PER_MODULE`` per module; each function gets the applicable kind used least so far (ties in
``KINDS`` order), and rename targets are the function's first local name in source order. Run with the interpreter
whose stdlib you want (the committed file says which one it was):

    python3 -m bench.make_code_edit            # writes the package file
    python3 -m bench.make_code_edit --check    # exit 1 if the committed file differs from a rebuild
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import platform
import sys
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "tilespec" / "assets" / "code_edit.jsonl"
MODULES = ("textwrap", "string", "shlex", "fnmatch", "glob", "posixpath", "ntpath", "genericpath", "colorsys",
           "calendar", "statistics", "heapq", "bisect", "base64", "quopri", "html", "json", "json.encoder",
           "csv", "difflib", "filecmp", "fractions", "gettext", "ipaddress", "keyword", "locale", "mimetypes",
           "operator", "pprint", "random", "shutil", "tempfile", "tokenize", "urllib.parse", "wave", "zipfile",
           "email.utils", "email.quoprimime", "email.base64mime", "http.cookies", "platform", "sysconfig",
           "dataclasses", "functools", "copy", "reprlib", "linecache", "traceback", "warnings", "inspect",
           "argparse", "configparser", "smtplib", "ftplib", "uuid", "pathlib", "os")
PER_MODULE = 5
MIN_LINES, MAX_LINES = 6, 40
KINDS = ("type-hints", "docstring", "rename", "f-strings", "validation")
NEW_NAMES = ("value", "item", "result", "entry", "data")


def _tree(source: str) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(source)).body[0]


def _has_docstring(fn: ast.FunctionDef) -> bool:
    return ast.get_docstring(fn) is not None


def _old_formatting(fn: ast.FunctionDef) -> bool:
    """True when the function formats strings with ``%`` or ``str.format``."""
    for node in ast.walk(fn):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) \
                and isinstance(node.left.value, str):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format" \
                and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str):
            return True
    return False


def _params(fn: ast.FunctionDef) -> list:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]


def _local_name(fn: ast.FunctionDef) -> str | None:
    """The first parameter or assigned local (source order) of at least 2 characters, not a dunder."""
    names = _params(fn) + [n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    return next((n for n in names if len(n) >= 2 and not n.startswith("__")), None)


def instruction(kind: str, name: str, fn: ast.FunctionDef, k: int) -> str:
    if kind == "type-hints":
        return f"Add type hints to every parameter and to the return value of `{name}`."
    if kind == "docstring":
        return f"Add a docstring to `{name}` that says what it does, its arguments and what it returns."
    if kind == "rename":
        old = _local_name(fn)
        return f"Rename the variable `{old}` to `{old}_{NEW_NAMES[k % len(NEW_NAMES)]}` everywhere in `{name}`."
    if kind == "f-strings":
        return f"Convert every `%` formatting and `str.format` call in `{name}` to f-strings."
    return (f"Add input validation to `{name}`: raise TypeError or ValueError with a clear message when an "
            f"argument has the wrong type or value.")


def applicable(kind: str, fn: ast.FunctionDef) -> bool:
    return {"type-hints": bool(_params(fn)), "docstring": not _has_docstring(fn),
            "rename": _local_name(fn) is not None, "f-strings": _old_formatting(fn),
            "validation": bool(_params(fn))}[kind]


def functions(module_name: str) -> list:
    """(name, source) of the module's own functions with MIN_LINES..MAX_LINES ASCII source lines, sorted by name."""
    mod = importlib.import_module(module_name)
    out = []
    for name, obj in sorted(vars(mod).items()):
        if not inspect.isfunction(obj) or obj.__module__ != module_name or name.startswith("__"):
            continue
        try:
            src = inspect.getsource(obj)
        except (OSError, TypeError):
            continue
        if MIN_LINES <= src.count("\n") <= MAX_LINES and src.isascii() and not src.startswith("@"):
            out.append((name, src))
    return out


def build() -> list:
    version = platform.python_version()
    used = {k: 0 for k in KINDS}
    rows = []
    for module_name in MODULES:
        try:
            found = functions(module_name)
        except ImportError:
            continue
        for name, src in found[:PER_MODULE]:
            fn = _tree(src)
            kinds = [k for k in KINDS if applicable(k, fn)]
            if not kinds:
                continue
            kind = min(kinds, key=lambda k: (used[k], KINDS.index(k)))
            used[kind] += 1
            rows.append(dict(id=f"{module_name}.{name}", module=module_name, function=name, kind=kind,
                             instruction=instruction(kind, name, fn, len(rows)), source=src, python=version))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = p.parse_args()
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in build())
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        print("up to date" if same else f"{args.out} differs from a rebuild with Python {platform.python_version()}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    counts = {}
    for r in map(json.loads, text.splitlines()):
        counts[r["kind"]] = counts.get(r["kind"], 0) + 1
    print(f"wrote {len(counts) and sum(counts.values())} prompts to {args.out}: {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
