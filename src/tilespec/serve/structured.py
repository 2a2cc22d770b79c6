"""Structured outputs: the request fields that hold a completion to a grammar, read into the engine's pair.

OpenAI's ``response_format`` (``{"type": "text"}``: none; ``{"type": "json_object"}``; ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}``) and vLLM's extensions ``guided_json`` (a JSON Schema, as an object
or as JSON text), ``guided_regex``, ``guided_choice`` (a list of strings), ``guided_grammar`` (xgrammar's EBNF) and
``structured_outputs: {"json" | "regex" | "choice" | "grammar": ..., "json_object": true}`` become one
:class:`Constraint`: the field it came from (named in errors) and ``BatchRequest.grammar``'s ``(kind, spec)``, kind
one of ``json_object`` (spec ""), ``json_schema`` (the schema as JSON text), ``regex``, ``choice`` (the list as JSON
text), ``ebnf``. A chat request's forced tool call (``tool_choice`` "required" or naming a function) is one more:
the EBNF of its call block (serve/tools.forced_call_grammar), param ``tool_choice``. More than one of them, a
malformed one, or vLLM's options this server does not implement (``guided_whitespace_pattern``, a backend other than
xgrammar, ``structured_outputs``' whitespace and structural tag options) are 400s naming the field.
:func:`check_grammar` parses the grammar with xgrammar (no tokenizer needed) in the API process, so that a bad
schema, regex or grammar is a 400 before the request is accepted, streamed or not; the engine compiles it against
the vocabulary and stays the authority (its refusal comes back as a 400 too).
"""
from __future__ import annotations

import importlib.util
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Optional

from .protocol import APIError, unsupported

KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf")
BACKENDS = (None, "auto", "xgrammar")
# structured_outputs' keys: the constraint ones, the ones accepted at their default only, and the rest
_SO_CONSTRAINTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf",
                   "json_object": "json_object"}
_SO_DEFAULTS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "structural_tag")
_SO_IGNORED = ("disable_fallback",)         # one backend here: nothing to fall back to
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


@dataclass(frozen=True)
class Constraint:
    """A request's structured output: ``param`` the field that asked (as errors name it), ``kind`` and ``spec`` the
    engine's grammar pair (``BatchRequest.grammar``)."""

    param: str
    kind: str
    spec: str

    @property
    def pair(self) -> tuple:
        return (self.kind, self.spec)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param} {message}", param=param)


def _schema(param: str, value: Any) -> str:
    """A JSON Schema given as an object (or, where ``param`` allows, JSON text of one) -> its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise _bad(param, f"is not valid JSON ({err}): send the JSON Schema as an object, or as its JSON "
                              f"text") from None
    if not isinstance(value, dict):
        raise _bad(param, f"must be a JSON Schema object such as {{\"type\": \"object\", \"properties\": {{...}}}}, "
                          f"got {type(value).__name__}")
    return json.dumps(value)


def _regex(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _bad(param, f"must be a string (a regular expression the whole output matches), got "
                          f"{type(value).__name__}")
    if not value:
        raise _bad(param, "is empty: send the regular expression the whole output must match")
    return value


def _choice(param: str, value: Any) -> str:
    if not isinstance(value, list) or not value:
        raise _bad(param, "must be a non-empty list of strings (the output is exactly one of them), got "
                          + ("an empty list" if isinstance(value, list) else type(value).__name__))
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            what = "empty" if isinstance(item, str) else f"a {type(item).__name__}"
            raise APIError(400, f"{param}.{i} is {what}: every choice is a non-empty string", param=f"{param}.{i}")
    return json.dumps(value)


def _ebnf(param: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        got = "empty" if isinstance(value, str) else type(value).__name__
        raise _bad(param, f"must be a grammar in xgrammar's EBNF (a rule named root: 'root ::= ...'), got {got}")
    return value


_READERS = {"json_schema": _schema, "regex": _regex, "choice": _choice, "ebnf": _ebnf}


def _response_format(value: Any) -> Optional[Constraint]:
    param = "response_format"
    if not isinstance(value, dict):
        raise _bad(param, f"must be an object such as {{\"type\": \"json_object\"}}, got {type(value).__name__}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(param, "json_object", "")
    if kind != "json_schema":
        if isinstance(kind, str):
            raise unsupported(f"{param}.type", f"response_format type {kind!r} (text, json_object and json_schema "
                                               f"only)")
        raise _bad(f"{param}.type", "must be \"text\", \"json_object\" or \"json_schema\"")
    spec = value.get("json_schema")
    where = f"{param}.json_schema"
    if not isinstance(spec, dict):
        raise _bad(where, "must be an object {\"name\": ..., \"schema\": {...}} with a JSON Schema under "
                          "\"schema\"")
    if "schema" not in spec:
        raise _bad(f"{where}.schema", "is missing: give the JSON Schema the output must follow")
    if spec.get("strict") not in (None, True, False):
        raise _bad(f"{where}.strict", f"must be a boolean, got {spec['strict']!r}")
    return Constraint(f"{where}.schema", "json_schema", _schema(f"{where}.schema", spec["schema"]))


def _structured_outputs(value: Any) -> list:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise _bad(param, f"must be an object such as {{\"json\": {{...schema...}}}} or {{\"regex\": \"...\"}}, "
                          f"got {type(value).__name__}")
    found = []
    for key, item in value.items():
        where = f"{param}.{key}"
        if item is None or key in _SO_IGNORED:
            continue
        if key in _SO_DEFAULTS:
            if item is not False:
                raise unsupported(where, f"{where}")
            continue
        kind = _SO_CONSTRAINTS.get(key)
        if kind is None:
            raise _bad(where, f"is not a field of structured_outputs (it takes one of {', '.join(_SO_CONSTRAINTS)})")
        if kind == "json_object":
            if item is not True and item is not False:
                raise _bad(where, f"must be true or false, got {item!r}")
            if item:
                found.append(Constraint(where, "json_object", ""))
            continue
        found.append(Constraint(where, kind, _READERS[kind](where, item)))
    return found


def constraint_of(body) -> Optional[Constraint]:
    """The request's structured output (None: unconstrained), or an APIError 400 naming the field (module doc)."""
    if body.guided_whitespace_pattern is not None:
        raise unsupported("guided_whitespace_pattern", "guided_whitespace_pattern (xgrammar's JSON whitespace)")
    if body.guided_decoding_backend not in BACKENDS:
        raise unsupported("guided_decoding_backend", f"guided_decoding_backend {body.guided_decoding_backend!r} "
                                                     f"(this server's grammars are xgrammar's: send \"xgrammar\" "
                                                     f"or leave it out)")
    found = []
    if body.response_format is not None:
        c = _response_format(body.response_format)
        found += [c] if c is not None else []
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "ebnf")):
        value = getattr(body, name)
        if value is not None:
            found.append(Constraint(name, kind, _READERS[kind](name, value)))
    if body.structured_outputs is not None:
        found += _structured_outputs(body.structured_outputs)
    forced = body.forced_functions()
    if forced is not None:          # tool_choice "required" / named: the call block's grammar (serve/tools.py)
        found.append(Constraint("tool_choice", "ebnf", _forced_call(forced)))
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise APIError(400, f"{names} each constrain the output: send one of them", param=found[1].param)
    return found[0] if found else None


def _forced_call(functions: list) -> str:
    from .tools import forced_call_grammar
    try:
        return forced_call_grammar(functions)
    except ImportError:
        raise APIError(400, "tool_choice \"required\" or naming a function decodes under a grammar, and this "
                            "server's grammar engine (xgrammar) is not installed: pip install 'tilespec[serve]', "
                            "or send tool_choice \"auto\"", param="tool_choice",
                       code="unsupported_parameter") from None
    except (RuntimeError, ValueError, TypeError) as err:
        raise APIError(400, f"tools: a function's parameters are not a JSON Schema this server's grammar engine "
                            f"(xgrammar) takes: {_clean(err)}", param="tools") from None


def _clean(err: Exception) -> str:
    """xgrammar's error text without its log prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    return _XGR_PREFIX.sub("", str(err).strip()).strip()


def preload() -> None:
    """Import xgrammar (seconds), where it is installed."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        pass


def preload_beside() -> None:
    """Start :func:`preload` on a thread where xgrammar is installed. An API process calls this once it has the
    tokenizer: the import (seconds, torch's included: xgrammar imports it, the API process's own modules do not)
    then runs beside the engine's warm-up, not while the process builds its app and starts listening."""
    if importlib.util.find_spec("xgrammar") is not None:
        threading.Thread(target=preload, name="tilespec-xgrammar-import", daemon=True).start()


def check_grammar(c: Constraint) -> None:
    """Parse ``c``'s grammar with xgrammar (no vocabulary needed): a 400 naming the field when it is not valid.
    Skipped where xgrammar is not installed (the engine then refuses the request itself)."""
    if c.kind in ("json_object", "choice") or c.param == "tool_choice":    # a forced call's: xgrammar built it
        return
    try:
        import xgrammar
    except ImportError:
        return
    parse = {"json_schema": xgrammar.Grammar.from_json_schema, "regex": xgrammar.Grammar.from_regex,
             "ebnf": xgrammar.Grammar.from_ebnf}[c.kind]
    what = {"json_schema": "the JSON Schema", "regex": "the regular expression", "ebnf": "the EBNF grammar"}[c.kind]
    try:
        parse(c.spec)
    except (RuntimeError, ValueError, TypeError) as err:
        raise APIError(400, f"{c.param}: {what} is not one this server's grammar engine (xgrammar) takes: "
                            f"{_clean(err)}", param=c.param) from None


__all__ = ["Constraint", "KINDS", "check_grammar", "constraint_of", "preload", "preload_beside"]
