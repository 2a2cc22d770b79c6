"""The response bodies of ``/v1/completions`` and ``/v1/chat/completions``: a streamed chunk and a full response.

``chunk_encoder`` gives one choice's streamed chunks as ready SSE strings: the JSON around the text is built once per
choice, so a chunk costs one ``json.dumps`` of its text (a stream of many chunks a second stays cheap). A chunk with
logprobs or tool calls is built whole (``chunk(..., logprobs=, delta=)``): ``logprobs`` formats them for the shape.
A full response holds ``choice`` s, one per index (``n``), built by the shape."""
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


def tool_call_deltas(index: int, call) -> list:
    """A parsed call as OpenAI streams one: its id, type and name with empty arguments, then the arguments (here in
    one delta: the call is parsed once its block closed)."""
    return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


class CompletionShape:
    prefix = "cmpl"
    logprobs = staticmethod(completion_logprobs)

    @staticmethod
    def chunk_encoder(rid, created, model, index=0):
        base = json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model})[:-1]
        head = base + f', "choices": [{{"index": {index}, "text": '
        return _encoder(head, ', "logprobs": null, "finish_reason": ',
                        sse(CompletionShape.chunk(rid, created, model, None, None, index=index)))

    @staticmethod
    def chunk(rid, created, model, text, reason, first=False, logprobs=None, index=0, delta=None):
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}]}

    @staticmethod
    def choice(index, text, reason, logprobs=None, tool_calls=None):
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    @staticmethod
    def full(rid, created, model, choices, usage):
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": usage}


class ChatShape:
    prefix = "chatcmpl"
    logprobs = staticmethod(chat_logprobs)

    @staticmethod
    def chunk_encoder(rid, created, model, index=0):
        base = json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model})[:-1]
        head = base + f', "choices": [{{"index": {index}, "delta": {{"content": '
        return _encoder(head, '}, "logprobs": null, "finish_reason": ',
                        sse(ChatShape.chunk(rid, created, model, None, None, first=True, index=index)))

    @staticmethod
    def chunk(rid, created, model, text, reason, first=False, logprobs=None, index=0, delta=None):
        """``delta``: given whole (a tool call's); else the role (``first``) or the text."""
        if delta is None:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

    @staticmethod
    def choice(index, text, reason, logprobs=None, tool_calls=None):
        """``tool_calls``: the parsed calls (serve/tools.py's ToolCall), None when the request offered no tools."""
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = [c.message() for c in tool_calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    @staticmethod
    def full(rid, created, model, choices, usage):
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": usage}
