"""Reading a request body into a pydantic request: size cap, UTF-8, JSON, lone surrogates, then the model's checks.

Every failure is an :class:`~tilespec.serve.protocol.APIError` with OpenAI's body: 413 past ``max_bytes`` (from the
Content-Length header before reading, or while reading a chunked body), 400 for invalid UTF-8 (with the byte
offset), malformed JSON (line and column), JSON nested too deeply, a string holding a lone UTF-16 surrogate such as
"\\ud83e" (JSON allows the escape; no tokenizer or UTF-8 encoder takes it), and pydantic's validation errors (the
field as a dotted path). The JSON parse and the surrogate walk run in a worker thread, so a large body does not
stall the event loop.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Optional, Type

from pydantic import BaseModel, ValidationError

from .protocol import APIError, validation_message

MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


def too_large(size: int, max_bytes: int) -> APIError:
    return APIError(413, f"the request body is {size:,} bytes or more, over this server's limit of {max_bytes:,} "
                         f"bytes (tilespec serve --max-body-mb)", code="request_too_large")


async def read_capped(request, max_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it is known to pass ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _depth_and_surrogates(obj, path: str = "", depth: int = 0) -> Optional[str]:
    """The dotted path of the first string holding a lone surrogate (None: none); APIError past MAX_DEPTH."""
    if depth > MAX_DEPTH:
        raise APIError(400, f"the JSON body is nested more than {MAX_DEPTH} levels deep", param=path or None)
    if isinstance(obj, str):
        return path if _SURROGATE.search(obj) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        if isinstance(key, str) and _SURROGATE.search(key):
            return path or "body"
        inner = _depth_and_surrogates(value, f"{path}.{key}" if path else str(key), depth + 1)
        if inner is not None:
            return inner
    return None


def parse_json(raw: bytes):
    """bytes -> the JSON value, or APIError 400 saying what is wrong and where (never a byte offset as ``param``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {err.start}: {err.reason})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise APIError(400, f"the request body is not valid JSON: {err.msg} at line {err.lineno} column "
                            f"{err.colno}") from None
    except RecursionError:
        raise APIError(400, f"the JSON body is nested more than {MAX_DEPTH} levels deep") from None
    where = _depth_and_surrogates(obj)
    if where is not None:
        raise APIError(400, f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape): send "
                            f"the character as a surrogate pair or as UTF-8", param=where)
    return obj


async def parse_request(request, model: Type[BaseModel], max_bytes: int) -> BaseModel:
    """The request's body as ``model`` (see the module docstring for the errors)."""
    raw = await read_capped(request, max_bytes)
    obj = await asyncio.to_thread(parse_json, raw)
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(obj).__name__}")
    try:
        return model.model_validate(obj)
    except ValidationError as err:
        message, param = validation_message(err.errors())
        raise APIError(400, message, param=param) from None
