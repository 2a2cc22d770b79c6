"""The OpenAI-compatible HTTP API over the engine process (FastAPI; :class:`~tilespec.serve.client.EngineClient`).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream=true`` as server-sent events,
``data: {...}`` chunks ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (200, or 503 while
draining or after an engine failure), ``GET /metrics`` (Prometheus text format, serve/metrics.py).
Every error has OpenAI's body (serve/errors.py): 400 bad parameters, fields this server does not implement, a prompt
too long, malformed bodies (serve/body.py); 401 without the API key (when one is set); 404 unknown model or route;
413 a body over ``max_body_mb``; 429 queue full (with Retry-After); 503 shutting down / engine failed. The request
work itself (prompt ids, the engine requests of its ``n`` choices, the events) is serve/completion.py and
serve/choices.py. A client that disconnects has its requests cancelled, which frees their batch rows.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from .body import parse_request
from .client import EngineClient
from .completion import Completions
from .errors import APIKeyMiddleware, install_error_handlers
from .metrics import metrics_registry, render
from .protocol import ChatCompletionRequest, CompletionRequest
from .shapes import ChatShape, CompletionShape


def build_app(client: EngineClient, model_name: str, tokenizer, *, default_max_tokens: int = 256,
              shutdown_timeout: float = 30.0, chat: bool = True, max_body_mb: float = 4.0,
              api_key: Optional[str] = None, cors_origins: Sequence[str] = (), engine=None) -> FastAPI:
    """The FastAPI app serving ``client``'s engine as model ``model_name``; ``tokenizer`` encodes prompts (chat
    template when it has one and ``chat``) and decodes completions. The client starts reading with the app and
    drains on shutdown (running requests get ``shutdown_timeout`` seconds, then are cancelled). ``max_body_mb``: larger
    request bodies get 413; ``api_key``: every route but /health needs ``Authorization: Bearer <key>``;
    ``cors_origins``: origins allowed by CORS ("*" for any); ``engine``: the main process's
    :class:`~tilespec.serve.processes.EngineProcess` (watched while serving, stopped at shutdown), None in the other
    API processes."""
    completions = Completions(client, tokenizer, model_name, default_max_tokens=default_max_tokens, chat=chat)
    app = FastAPI(title="tilespec", lifespan=_lifespan(client, completions, shutdown_timeout, engine))
    app.state.client, app.state.engine = client, engine
    install_error_handlers(app)
    _info_routes(app, client, model_name)
    _completion_routes(app, completions, int(max_body_mb * 2**20))
    if api_key:
        app.add_middleware(APIKeyMiddleware, key=api_key)
    if cors_origins:        # added last: the outermost layer, so preflights are answered without the key
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app


def _lifespan(client: EngineClient, completions: Completions, shutdown_timeout: float, engine):
    @asynccontextmanager
    async def lifespan(app):
        await client.start()
        if engine is not None:
            engine.watch()
            engine.serving()
        yield
        await client.drain(shutdown_timeout)
        if engine is not None:
            await engine.stop()
        client.close()
        completions.encode_pool.shutdown(wait=False)
    return lifespan


def _info_routes(app: FastAPI, client: EngineClient, model_name: str) -> None:
    """/v1/models, /health, /metrics."""
    registry = metrics_registry(client)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(client.started),
                                            "owned_by": "tilespec"}]}

    @app.get("/health")
    async def health():
        if not client.alive or client.draining:
            reason = client.error or "shutting down"
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        data, content_type = render(registry)
        return Response(data, media_type=content_type)


def _completion_routes(app: FastAPI, completions: Completions, max_bytes: int) -> None:
    """/v1/completions and /v1/chat/completions: the body is read and checked by serve/body.py."""

    @app.post("/v1/completions")
    async def completion(request: Request):
        body = await parse_request(request, CompletionRequest, max_bytes)
        ids = await completions.completion_ids(body)
        return await completions.respond(request, body, ids, CompletionShape, "prompt")

    @app.post("/v1/chat/completions")
    async def chat_completion(request: Request):
        body = await parse_request(request, ChatCompletionRequest, max_bytes)
        ids, tools = await completions.chat_ids(body)
        return await completions.respond(request, body, ids, ChatShape, "messages", tools=tools)
