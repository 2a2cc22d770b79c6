"""OpenAI's error body on every error path of the app, and the API-key check.

:func:`install_error_handlers` makes FastAPI answer with ``{"error": {"message", "type", "param", "code"}}``
everywhere: our :class:`APIError` s, its own validation errors, Starlette's HTTP errors (404 unknown route, 405
wrong method) and any other exception (500, no traceback in the body). A client that disconnects before its body
was read (Starlette's ClientDisconnect) is no error of the server's: nothing is logged past debug and nobody reads
the 499 written to the closed connection. Bodies are written as ASCII JSON, so no
message can fail to encode. :class:`APIKeyMiddleware` answers 401 to a request without ``Authorization: Bearer
<key>`` (``/health`` stays open for probes; CORS preflights are answered before it by CORSMiddleware).
"""
from __future__ import annotations

import json
import logging
import secrets
from typing import Iterable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from .protocol import APIError, validation_message

log = logging.getLogger("tilespec.serve")

_KINDS = {401: ("authentication_error", "invalid_api_key"), 404: ("invalid_request_error", "not_found"),
          405: ("invalid_request_error", "method_not_allowed"), 413: ("invalid_request_error", "request_too_large")}


class ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped: encodes whatever a message holds (lone surrogates included)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(err: APIError) -> ASCIIJSONResponse:
    return ASCIIJSONResponse(err.body(), status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error of ``app`` as OpenAI's error body (see the module docstring)."""

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, err: RequestValidationError):
        message, param = validation_message(err.errors())
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err: StarletteHTTPException):
        kind, code = _KINDS.get(err.status_code, ("invalid_request_error", None))
        message = f"{request.method} {request.url.path}: {err.detail}"
        return error_response(APIError(err.status_code, message, kind=kind, code=code,
                                       headers=getattr(err, "headers", None)))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request, err: ClientDisconnect):
        # left to the catch-all below it logged two tracebacks per client that timed out mid-upload
        log.debug("client disconnected before its body was read: %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def crash(request, err: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(err).__name__}", kind="server_error"))


class APIKeyMiddleware:
    """ASGI middleware: HTTP requests other than to ``open_paths`` need ``Authorization: Bearer <key>``."""

    def __init__(self, app, key: str, open_paths: Iterable[str] = ("/health",)):
        self.app, self.key, self.open_paths = app, key.encode(), frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, given = auth.partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), self.key):
            return await self.app(scope, receive, send)
        reason = "no API key given" if not auth else "the API key is not valid"
        err = APIError(401, f"{reason}: send the server's key (tilespec serve --api-key / TILESPEC_API_KEY) as "
                            "'Authorization: Bearer KEY'", kind="authentication_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
        await error_response(err)(scope, receive, send)
