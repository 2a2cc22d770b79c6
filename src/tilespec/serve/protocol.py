"""The OpenAI API's request bodies and error shape, as far as ``tilespec serve`` implements them.

Requests are pydantic models. Fields OpenAI defines that this server does not implement are refused with a 400
naming the field (``check_supported``), never silently ignored: ``tools`` (unless ``tool_choice`` is "none"),
``response_format`` other than text, ``n`` > 1, ``best_of`` > 1, ``suffix``, ``echo``, tool / function messages and
non-text content parts. Other unknown fields are ignored, as OpenAI's clients send extras. Logprobs
(``logprob_count``): chat's ``logprobs: true`` with ``top_logprobs`` 0-20, completions' ``logprobs`` 0-20 (OpenAI
allows 5, vLLM 20); raw log-probabilities of the target, reported by the paged engine only (serve/logprobs.py).
Implemented as logit transforms (verify/logit_transforms.py): ``presence_penalty``, ``frequency_penalty``,
``logit_bias``, and vLLM's ``min_tokens``, ``stop_token_ids``, ``ignore_eos``. Extensions (vLLM names): ``top_k``,
``min_p``; tilespec's own: ``gamma`` (cap on this request's draft tokens per step, 0 = no speculation). Errors are
:class:`APIError` s with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, Field

from tilespec.engine.batch_request import MAX_LOGPROBS
from tilespec.verify.logit_transforms import LogitSettings


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
    n: int = 1
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

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes at most 4 non-empty strings", param="stop")
        return stops

    def check_supported(self) -> None:
        """Refuse the OpenAI fields this server does not implement (400 naming the field)."""
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: this server returns one choice per request", param="n")
        self.logprob_count()

    def logprob_count(self) -> Optional[int]:
        """None (no logprobs), or how many top alternatives to report beside each token's log-probability."""
        raise NotImplementedError

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
        if self.echo:
            raise unsupported("echo", "echo")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"best_of={self.best_of}")
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion)")


ROLES = ("system", "developer", "user", "assistant")


class ChatMessage(BaseModel):
    role: str
    content: Optional[Union[str, list[dict]]] = None
    tool_calls: Optional[list] = None

    def text(self, where: str) -> str:
        """The message's text; ``where`` names it in errors (``messages.3``)."""
        if self.role not in ROLES:
            hint = " (tool and function messages need tools, which this server does not support)" \
                if self.role in ("tool", "function") else ""
            raise APIError(400, f"{where}.role {self.role!r} is not one of {', '.join(ROLES)}{hint}",
                           param=f"{where}.role")
        if self.tool_calls:
            raise unsupported(f"{where}.tool_calls", "tool_calls")
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


class ResponseFormat(BaseModel):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    functions: Optional[list] = None
    function_call: Optional[Union[str, dict]] = None
    response_format: Optional[ResponseFormat] = None
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
        if self.tools and self.tool_choice != "none":
            raise unsupported("tools", 'tools (send tool_choice "none" to run without them)')
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise unsupported("tool_choice", f"tool_choice {self.tool_choice!r}")
        if self.functions or self.function_call not in (None, "none"):
            raise unsupported("functions" if self.functions else "function_call", "functions")
        if self.response_format is not None and self.response_format.type != "text":
            raise unsupported("response_format", f"response_format {self.response_format.type!r} (text only)")

    def turns(self) -> list[dict]:
        """The messages as {"role", "content"} for the chat template ("developer" is given as "system")."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(f"messages.{i}")}
                for i, m in enumerate(self.messages)]


def validation_message(errors: list) -> tuple[str, Optional[str]]:
    """pydantic's errors -> (one readable message, the first offending parameter as a dotted path)."""
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        name = ".".join(loc) or "body"
        param = param or (name if loc else None)
        parts.append(f"{name}: {err.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request body", param


__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "SamplingFields",
           "validation_message"]
