"""The response bodies of ``/v1/completions`` and ``/v1/chat/completions``: a streamed chunk and a full response."""
from __future__ import annotations

import json


def sse(obj) -> str:
    """One server-sent event (ASCII JSON: encodes any text)."""
    return f"data: {json.dumps(obj)}\n\n"


class CompletionShape:
    prefix = "cmpl"

    @staticmethod
    def chunk(rid, created, model, text, reason, first=False):
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]}

    @staticmethod
    def full(rid, created, model, text, reason, usage):
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}], "usage": usage}


class ChatShape:
    prefix = "chatcmpl"

    @staticmethod
    def chunk(rid, created, model, text, reason, first=False):
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

    @staticmethod
    def full(rid, created, model, text, reason, usage):
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": reason}], "usage": usage}
