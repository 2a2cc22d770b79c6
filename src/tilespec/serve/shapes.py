"""The response bodies of ``/v1/completions`` and ``/v1/chat/completions``: a streamed chunk and a full response.

``chunk_encoder`` gives a request's streamed chunks as ready SSE strings: the JSON around the text is built once per
request, so a chunk costs one ``json.dumps`` of its text (a stream of many chunks a second stays cheap)."""
from __future__ import annotations

import json


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

    @staticmethod
    def chunk_encoder(rid, created, model):
        base = json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model})[:-1]
        head = base + ', "choices": [{"index": 0, "text": '
        return _encoder(head, ', "logprobs": null, "finish_reason": ',
                        sse(CompletionShape.chunk(rid, created, model, None, None)))

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
    def chunk_encoder(rid, created, model):
        base = json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model})[:-1]
        head = base + ', "choices": [{"index": 0, "delta": {"content": '
        return _encoder(head, '}, "logprobs": null, "finish_reason": ',
                        sse(ChatShape.chunk(rid, created, model, None, None, first=True)))

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
