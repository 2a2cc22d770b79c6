"""The OpenAI API's request bodies and error shape, as far as ``tilespec serve`` implements them.

Requests are pydantic models. Fields OpenAI defines that this server does not implement are refused with a 400
naming the field (``check_supported``), never silently ignored: ``strict`` function tools with ``tool_choice``
"auto" (held to their schema only when the call is forced), ``best_of`` > 1, ``suffix``, the deprecated
``functions`` / ``function_call`` and function messages, non-text content parts. Structured outputs (both endpoints:
``response_format``, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` /
``structured_outputs``) are read and checked by serve/structured.py. Other unknown fields are ignored, as OpenAI's
clients send extras. ``n``: 1-128 choices (the server's own limits: serve/completion.py). Tools (``tools``,
``tool_choice`` "auto" / "none" / "required" / a named function (forced: ``forced_functions``, decoded under a
grammar of the call, serve/tools.forced_call_grammar), assistant ``tool_calls`` and ``tool`` messages): given to the
chat template in the structure transformers' templates take (``turns``, ``template_tools``); the calls in the reply
are serve/tools.py's. Logprobs (``logprob_count``): chat's ``logprobs: true`` with ``top_logprobs`` 0-20,
completions' ``logprobs`` 0-20 (OpenAI allows 5, vLLM 20); raw log-probabilities of the target, reported by the
paged engine only (serve/logprobs.py). Completions' ``echo``: the prompt's text before each choice's, with
``logprobs`` the prompt tokens' entries first (the first token's None); ``max_tokens`` 0 only with echo (the prompt
alone: scoring it). Implemented as logit transforms (verify/logit_transforms.py): ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, and vLLM's ``min_tokens``, ``stop_token_ids``, ``ignore_eos``. Extensions
(vLLM names): ``top_k``, ``min_p``; tilespec's own: ``gamma`` (cap on this request's draft tokens per step, 0 = no
speculation). Errors are :class:`APIError` s with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, Field

from tilespec.engine.batch_request import MAX_LOGPROBS
from tilespec.verify.logit_settings import LogitSettings


class APIError(Exception):
    """An error answered as OpenAI does: HTTP ``status`` with ``{"error": {...}}`` (and ``headers``, e.g.
    Retry-After on a 429)."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server", param=param, code="unsupported_parameter")


MAX_N = 128        # OpenAI's own cap on n; a server's batch rows and queue cap it further (serve/completion.py)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI's defaults: temperature 1, top_p 1, n 1)."""

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=-2**63, lt=2**63)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    logprobs: Any = None
    top_logprobs: Optional[int] = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    gamma: Optional[int] = Field(default=None, ge=0, le=32)
    user: Optional[str] = None
    # structured outputs, read by serve/structured.py (which names the field in its 400s)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes at most 4 non-empty strings", param="stop")
        return stops

    def check_supported(self) -> None:
        """Refuse the OpenAI fields this server does not implement (400 naming the field)."""
        self.logprob_count()

    def logprob_count(self) -> Optional[int]:
        """None (no logprobs), or how many top alternatives to report beside each token's log-probability."""
        raise NotImplementedError

    def forced_functions(self) -> Optional[list]:
        """The functions a forced tool call may be of, or None: the model decides (chat's tool_choice)."""
        return None

    def logit_settings(self) -> Optional[LogitSettings]:
        """The request's logit transforms (None when it has none); ``logit_bias`` keys must be token ids."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias keys are token ids (strings of integers), got {key!r}",
                               param="logit_bias") from None
        settings = LogitSettings(self.presence_penalty, self.frequency_penalty, bias, self.min_tokens)
        return settings if settings.active or self.min_tokens else None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int]]
    max_tokens: Optional[int] = Field(default=None, ge=0)      # 0: with echo only (scoring the prompt)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def logprob_count(self) -> Optional[int]:
        """OpenAI's legacy ``logprobs``: an integer, the alternatives per token (0: the chosen token's alone)."""
        if self.top_logprobs:
            raise APIError(400, "top_logprobs is a chat completions field; completions take logprobs: <count>",
                           param="top_logprobs")
        lp = self.logprobs
        if lp is None or lp is False:       # false: what clients of the older server sent for "none"
            return None
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (top alternatives per token), "
                                f"got {lp!r}", param="logprobs")
        return lp

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo: true, which returns the prompt "
                                "alone, to score it)", param="max_tokens")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"best_of={self.best_of}")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion)")


ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionCall(BaseModel):
    name: str
    arguments: str          # JSON text, as OpenAI's responses carry it


class ToolCallIn(BaseModel):
    """A call in an assistant message of the conversation (one an earlier response returned)."""

    id: Optional[str] = None
    type: str = "function"
    function: FunctionCall

    def template(self, where: str) -> dict:
        """The call as transformers' chat templates take it: ``arguments`` a dict (templates ``tojson`` it)."""
        if self.type != "function":
            raise unsupported(f"{where}.type", f"tool call type {self.type!r} (function only)")
        try:
            args = json.loads(self.function.arguments)
        except (ValueError, RecursionError):      # RecursionError: nested deeper than the parser goes
            args = None
        if not isinstance(args, dict):
            raise APIError(400, f"{where}.function.arguments must be a JSON object as text, got "
                                f"{self.function.arguments[:80]!r}", param=f"{where}.function.arguments")
        call = {"type": "function", "function": {"name": self.function.name, "arguments": args}}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(BaseModel):
    role: str
    content: Optional[Union[str, list[dict]]] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None

    def text(self, where: str) -> str:
        """The message's text; ``where`` names it in errors (``messages.3``)."""
        if self.role not in ROLES:
            hint = " (function messages are the deprecated functions API: send tool messages)" \
                if self.role == "function" else ""
            raise APIError(400, f"{where}.role {self.role!r} is not one of {', '.join(ROLES)}{hint}",
                           param=f"{where}.role")
        if self.content is None:
            if self.role != "assistant":
                raise APIError(400, f"{where}.content is null: a {self.role} message needs content",
                               param=f"{where}.content")
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise unsupported(f"{where}.content.{i}", f"content part type {part.get('type')!r} (text only)")
            parts.append(part["text"])
        return "".join(parts)

    def turn(self, where: str) -> dict:
        """The message for the chat template: {"role", "content"}, with ``tool_calls`` (an assistant's) or
        ``tool_call_id`` (a tool's; and ``name`` where given) as transformers' templates take them."""
        turn = {"role": "system" if self.role == "developer" else self.role, "content": self.text(where)}
        if self.tool_calls:
            if self.role != "assistant":
                raise APIError(400, f"{where}.tool_calls: only assistant messages carry tool calls",
                               param=f"{where}.tool_calls")
            turn["tool_calls"] = [c.template(f"{where}.tool_calls.{j}") for j, c in enumerate(self.tool_calls)]
        if self.role == "tool":
            if not self.tool_call_id:
                raise APIError(400, f"{where}.tool_call_id: a tool message names the call it answers",
                               param=f"{where}.tool_call_id")
            turn["tool_call_id"] = self.tool_call_id
            if self.name:
                turn["name"] = self.name
        return turn


class FunctionDef(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    type: str
    function: FunctionDef


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[str, dict]] = None
    functions: Optional[list] = None
    function_call: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None

    def logprob_count(self) -> Optional[int]:
        """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (alternatives per token, 0-20)."""
        if self.logprobs not in (None, False, True):
            raise APIError(400, f"logprobs must be a boolean for chat completions, got {self.logprobs!r} (the "
                                f"number of alternatives is top_logprobs)", param="logprobs")
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top}",
                           param="top_logprobs")
        if not self.logprobs:
            if top:
                raise APIError(400, "top_logprobs needs logprobs: send logprobs: true with it", param="top_logprobs")
            return None
        return top or 0

    def check_supported(self) -> None:
        super().check_supported()
        choice = self.tool_choice
        if isinstance(choice, dict):
            name = self._named()
            if not isinstance(name, str):
                raise APIError(400, f"tool_choice naming a function must be {{\"type\": \"function\", "
                                    f"\"function\": {{\"name\": ...}}}}, got {choice!r}", param="tool_choice")
            if name not in {t.function.name for t in self.tools or ()}:
                raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                                    f"offered; add it to tools or name one of them", param="tool_choice.function.name")
        elif choice not in (None, "auto", "none", "required"):
            raise APIError(400, f"tool_choice must be \"auto\", \"none\", \"required\" or a named function, got "
                                f"{choice!r}", param="tool_choice")
        elif choice == "required" and not self.tools:
            raise APIError(400, "tool_choice \"required\" needs tools to call: send tools with it",
                           param="tool_choice")
        for i, tool in enumerate(self.tools or ()):
            if tool.type != "function":
                raise unsupported(f"tools.{i}.type", f"tool type {tool.type!r} (function tools only)")
            if tool.function.strict and self.forced_functions() is None:
                raise APIError(400, "strict function tools are held to their schema only when the call is forced "
                                    "(tool_choice \"required\" or naming the function: then decoding follows a "
                                    "grammar of the call); with tool_choice \"auto\" send strict: false or leave "
                                    "it out", param=f"tools.{i}.function.strict", code="unsupported_parameter")
        if self.functions or self.function_call not in (None, "none"):
            raise unsupported("functions" if self.functions else "function_call",
                              "functions (deprecated by OpenAI: send tools)")

    def template_tools(self) -> Optional[list]:
        """The tools offered to the model (to the chat template, in OpenAI's shape, which transformers' templates
        take), or None: no tools, or ``tool_choice`` "none" (then the model is not offered them, as in vLLM)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [{"type": "function", "function": t.function.model_dump(exclude_none=True, exclude={"strict"})}
                for t in self.tools]

    def forced_functions(self) -> Optional[list]:
        """The functions a forced call may be of (``tool_choice`` "required": every tool; named: that one), or
        None when the model decides (serve/tools.forced_call_grammar builds the grammar from them)."""
        tools = [t.function for t in self.tools or ()]
        if self.tool_choice == "required":
            return tools
        name = self._named()
        return None if name is None else [f for f in tools if f.name == name]

    def _named(self):
        """The function ``tool_choice`` names ({"type": "function", "function": {"name": ...}}), else None."""
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            return (choice.get("function") or {}).get("name")
        return None

    def max_tool_calls(self) -> Optional[int]:
        """``parallel_tool_calls: false``: one call at most (later ones are dropped, as vLLM does)."""
        return 1 if self.parallel_tool_calls is False else None

    def turns(self) -> list[dict]:
        """The messages for the chat template ("developer" is given as "system"; tool calls as ``turn`` says)."""
        return [m.turn(f"messages.{i}") for i, m in enumerate(self.messages)]


def validation_message(errors: list) -> tuple[str, Optional[str]]:
    """pydantic's errors -> (one readable message, the first offending parameter as a dotted path)."""
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        name = ".".join(loc) or "body"
        param = param or (name if loc else None)
        parts.append(f"{name}: {err.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request body", param


__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "MAX_N", "SamplingFields",
           "Tool", "ToolCallIn", "validation_message"]
