"""Tool calls in a chat completion's text: the parsers of the formats models are trained to answer in, and which
parser a served model gets.

Only the hermes format exists now, which Qwen2.5 (and Qwen3, NousResearch's Hermes) templates ask for: each call is
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` in the text. :class:`HermesToolParser` is one
state machine for streamed and whole texts alike (a whole text is one push), so a response's tool calls and content
are the same however its text was split into chunks (tests/test_serve_tools.py tries every split):

* text outside the blocks is content; a tail that could begin ``<tool_call>`` is held back until it cannot;
* a block whose inside is a JSON object with a string ``name`` (and ``arguments`` an object, a JSON string or
  absent) is a call; anything else (invalid JSON, no name, a block left open when the text ends) stays content,
  as the model wrote it;
* when the text holds calls, whitespace that only separates them, or ends the text, is not content (so a reply of
  calls alone has content null); otherwise the content is the text exactly. Trailing whitespace is held back until
  more text shows whether a block follows;
* ``max_calls`` (1 for ``parallel_tool_calls: false``): later calls are dropped, as vLLM does.

:func:`tool_parser_for` picks the parser from the tokenizer's and the served model's names (``FAMILIES``), else from
the chat template itself; a template that does not render tools, or one in no format known here, is a 400 naming the
model. ``tool_choice`` "required" or a named function constrains decoding instead (:func:`forced_call_grammar`): the
text must be one call block of an offered function (or of the named one) whose JSON holds the function's ``name``
and ``arguments`` following its ``parameters`` schema, written as the template shows the model (``{"name": ...,
"arguments": ...}``, ", " and ": " separators): xgrammar's grammar of the block, a structured output as any other
(serve/structured.py), so it is exact under speculation. One call: "required" with several functions lets the model
pick which, not how many.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from .protocol import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """A parsed call: ``arguments`` is JSON text, as OpenAI's responses carry it."""

    name: str
    arguments: str
    id: str = field(default_factory=call_id)

    def message(self) -> dict:
        """OpenAI's ``message.tool_calls`` item."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(inner: str) -> Optional[ToolCall]:
    """The call a block's inside holds, or None when it holds none (then the block stays text)."""
    try:
        obj = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):       # some models write the arguments as a JSON string: kept when it is JSON
        try:
            json.loads(args)
        except (ValueError, RecursionError):
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial(text: str, token: str) -> int:
    """The length of the longest end of ``text`` that begins ``token`` (0: none)."""
    for k in range(min(len(text), len(token) - 1), 0, -1):
        if text.endswith(token[:k]):
            return k
    return 0


class HermesToolParser:
    """Text -> content and :class:`ToolCall` s, incrementally (see the module docstring). ``push`` returns the
    deltas its text settles, in order: ``str`` content pieces and ``ToolCall`` s (``calls`` lists the calls so far)."""

    def __init__(self, max_calls: Optional[int] = None):
        self.max_calls = max_calls
        self.calls: list = []
        self.buf = ""               # text not settled yet (inside a block: what follows its OPEN)
        self.in_call = False
        self.held = ""              # trailing whitespace of the content, until it is known not to end the text
        self.sent = False           # some content was handed out

    def push(self, text: str, final: bool = False) -> list:
        """Add ``text``; the deltas it settles. ``final``: the text ended, settle everything."""
        self.buf += text
        out: list = []
        while True:
            if self.in_call:
                end = self.buf.find(CLOSE)
                if end == -1:
                    if final:       # a block left open: the model's text as it is
                        self._content(out, OPEN + self.buf)
                        self.buf, self.in_call = "", False
                    break
                inner, self.buf, self.in_call = self.buf[:end], self.buf[end + len(CLOSE):], False
                call = parse_call(inner)
                if call is None:
                    self._content(out, OPEN + inner + CLOSE)
                elif self.max_calls is None or len(self.calls) < self.max_calls:
                    self.calls.append(call)
                    out.append(call)
                continue
            at = self.buf.find(OPEN)
            if at == -1:
                keep = 0 if final else _partial(self.buf, OPEN)
                self._content(out, self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            self._content(out, self.buf[:at])
            self.buf, self.in_call = self.buf[at + len(OPEN):], True
        if final and self.held and not self.calls:
            out.append(self.held)
            self.held = ""
        return out

    def _content(self, out: list, text: str) -> None:
        if self.calls and not self.sent:
            text = text.lstrip()        # whitespace after a call, before any content: a separator
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        if body:
            out.append(body)
            self.sent = True


def split(parser, text: str) -> tuple[Optional[str], list]:
    """A whole text through a fresh ``parser`` -> (content, calls): content None when the text holds calls and
    nothing else."""
    deltas = parser.push(text, final=True)
    content = "".join(d for d in deltas if isinstance(d, str))
    return (content or None) if parser.calls else content, parser.calls


PARSERS = {"hermes": HermesToolParser}
# name fragment (lower case) -> format: the first found in the tokenizer's or the served model's name wins
FAMILIES = (("qwen2", "hermes"), ("qwen3", "hermes"), ("hermes", "hermes"))
TEMPLATE_MARKS = ((OPEN, "hermes"),)     # a template that names the format, for models of no known name


def forced_call_grammar(functions: list) -> str:
    """The EBNF (xgrammar's) of one hermes call block of one of ``functions`` (serve/protocol.py's FunctionDef:
    name, parameters), for ``tool_choice`` "required" (every offered function) or a named one (that function).
    Cached by the functions: an agent sends the same tools with every request."""
    return _call_grammar(json.dumps([[f.name, f.parameters] for f in functions], sort_keys=True))


@functools.lru_cache(maxsize=256)
def _call_grammar(functions: str) -> str:
    import xgrammar
    opening = xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(OPEN + chr(10))}")
    closing = xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(chr(10) + CLOSE)}")
    blocks = []
    for name, parameters in json.loads(functions):
        schema = {"type": "object",
                  "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
        body = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        blocks.append(xgrammar.Grammar.concat(opening, body, closing))
    return str(blocks[0] if len(blocks) == 1 else xgrammar.Grammar.union(*blocks))


def tool_template(tokenizer) -> Optional[str]:
    """The chat template that renders tools (a dict of named templates: its "tool_use" one, else "default")."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


def tool_parser_for(tokenizer, model_name: str):
    """The parser class for the served model (see the module docstring); APIError 400 when it has none."""
    name = getattr(tokenizer, "name_or_path", None) or model_name
    template = tool_template(tokenizer)
    if template is None or not re.search(r"\btools\b", template):
        raise APIError(400, f"the chat template of {name} does not render tools, so this model cannot be offered "
                            f"them; send the request without tools (or with tool_choice \"none\")", param="tools",
                       code="unsupported_parameter")
    names = " ".join(n.lower() for n in (name, model_name) if n)
    for fragment, kind in FAMILIES:
        if fragment in names:
            return PARSERS[kind]
    for mark, kind in TEMPLATE_MARKS:
        if mark in template:
            return PARSERS[kind]
    raise APIError(400, f"no tool-call parser for {name}: this server parses the hermes / Qwen2.5 format "
                        f"({OPEN}{{json}}{CLOSE}) of the model families {', '.join(f for f, _ in FAMILIES)}",
                   param="tools", code="unsupported_parameter")


__all__ = ["FAMILIES", "HermesToolParser", "PARSERS", "ToolCall", "forced_call_grammar", "parse_call", "split",
           "tool_parser_for"]
