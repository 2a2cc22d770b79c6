"""The response bodies of ``/v1/completions`` and ``/v1/chat/completions``: a streamed chunk and a full response.

``chunk_encoder`` gives a request's streamed chunks as ready SSE strings: the JSON around the text is built once per
request, so a chunk costs one ``json.dumps`` of its text (a stream of many chunks a second stays cheap). A request
with logprobs has its chunks built whole (``chunk(..., logprobs=)``): ``logprobs`` formats them for the shape."""
from __future__ import annotations

import json

from .logprobs import chat_logprobs, completion_logprobs


def sse(obj) -> str:
    """One server-sent event (ASCII JSON: encodes any text)."""
    return f"data: {json.dumps(obj)}\n\n"


def _encoder(head: str, tail: str, opening: str):
    """(text, reason, first=False) -> one SSE event ``head + json(text) + tail + json(reason)``; the first event of
    a stream is ``opening``."""
    reasons = {None: "null", "stop": '"stop"', "length": '"length"', "abort": '"abort"'}

    def chunk(text, reason, first=False) -> str:
        if first:
            return opening
        return f"data: {head}{json.dumps(text or '')}{tail}{reasons.get(reason) or json.dumps(reason)}}}]}}\n\n"
    return chunk


class CompletionShape:
    prefix = "cmpl"
    logprobs = staticmethod(completion_logprobs)

    @staticmethod
    def chunk_encoder(rid, created, model):
        base = json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model})[:-1]
        head = base + ', "choices": [{"index": 0, "text": '
        return _encoder(head, ', "logprobs": null, "finish_reason": ',
                        sse(CompletionShape.chunk(rid, created, model, None, None)))

    @staticmethod
    def chunk(rid, created, model, text, reason, first=False, logprobs=None):
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}]}

    @staticmethod
    def full(rid, created, model, text, reason, usage, logprobs=None):
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}],
                "usage": usage}


class ChatShape:
    prefix = "chatcmpl"
    logprobs = staticmethod(chat_logprobs)

    @staticmethod
    def chunk_encoder(rid, created, model):
        base = json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model})[:-1]
        head = base + ', "choices": [{"index": 0, "delta": {"content": '
        return _encoder(head, '}, "logprobs": null, "finish_reason": ',
                        sse(ChatShape.chunk(rid, created, model, None, None, first=True)))

    @staticmethod
    def chunk(rid, created, model, text, reason, first=False, logprobs=None):
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

    @staticmethod
    def full(rid, created, model, text, reason, usage, logprobs=None):
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                             "finish_reason": reason}], "usage": usage}
