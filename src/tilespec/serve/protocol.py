"""The OpenAI API's request bodies and error shape, as far as ``tilespec serve`` implements them.

Requests are pydantic models (unknown fields are ignored, as OpenAI's clients send extras); bad values become
:class:`APIError` s with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``. Extensions (vLLM
names): ``top_k``, ``min_p``; tilespec's own: ``gamma`` (cap on this request's draft tokens per step, 0 = no
speculation).
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, Field


class APIError(Exception):
    """An error answered as OpenAI does: HTTP ``status`` with ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


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
    gamma: Optional[int] = Field(default=None, ge=0, le=32)
    user: Optional[str] = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes at most 4 non-empty strings", param="stop")
        return stops

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: this server returns one choice per request", param="n")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported by this server", param="logprobs")


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int]]
    echo: bool = False


class ChatMessage(BaseModel):
    role: str
    content: Optional[Union[str, list[dict]]] = None

    def text(self) -> str:
        if isinstance(self.content, list):   # content parts: the text ones
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


def validation_message(errors: list) -> tuple[str, Optional[str]]:
    """pydantic's errors -> (one readable message, the first offending parameter)."""
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        name = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        parts.append(f"{name}: {err.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request body", param
