"""The OpenAI-compatible HTTP API over an :class:`~tilespec.serve.worker.EngineWorker` (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream=true`` as server-sent events,
``data: {...}`` chunks ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (200, or 503 while
draining or after an engine failure), ``GET /metrics`` (Prometheus text format).
Errors use OpenAI's body (protocol.APIError): 400 bad parameters or a prompt too long, 404 unknown model, 429 queue
full, 503 shutting down / engine failed. A client that disconnects (stream closed, or a non-streaming request
abandoned) has its request cancelled, which frees its batch row.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tilespec.engine.batching import BatchRequest

from .protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields, validation_message
from .text import TextStream
from .worker import EngineWorker, Overloaded

FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}


def build_app(worker: EngineWorker, model_name: str, tokenizer, *, default_max_tokens: int = 256,
              shutdown_timeout: float = 30.0, chat: bool = True) -> FastAPI:
    """The FastAPI app serving ``worker``'s engine as model ``model_name``; ``tokenizer`` encodes prompts (chat
    template when it has one and ``chat``) and decodes completions. The worker starts with the app and drains on
    shutdown (running requests get ``shutdown_timeout`` seconds, then are cancelled)."""

    @asynccontextmanager
    async def lifespan(app):
        if not worker._thread.is_alive():
            worker.start()
        yield
        await asyncio.to_thread(worker.drain, shutdown_timeout)

    app = FastAPI(title="tilespec", lifespan=lifespan)
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, err: RequestValidationError):
        message, param = validation_message(err.errors())
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(worker.started),
                                            "owned_by": "tilespec"}]}

    @app.get("/health")
    async def health():
        if not worker.alive or worker.draining:
            reason = worker.error or "shutting down"
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        eng = worker.engine
        lines = [f"tilespec_requests_running {eng.running}",
                 f"tilespec_requests_waiting {len(eng.waiting) + worker.queued}",
                 f"tilespec_batch_slots {eng.max_batch}"]
        lines += [f"tilespec_{name}_total {value}" for name, value in eng.counters.items()]
        drafted = eng.counters["drafted"]
        lines.append(f"tilespec_draft_acceptance_rate {eng.counters['accepted'] / drafted if drafted else 0.0}")
        for rows, entry in (eng.switch.state().items() if eng.switch is not None else ()):
            lines.append(f'tilespec_drafting{{rows="{rows}"}} {int(entry["drafting"])}')
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def encode(body: SamplingFields, prompt_ids: list) -> BatchRequest:
        if body.model != model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")
        body.check_supported()
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(default_max_tokens, worker.engine.max_len - len(prompt_ids)))
        seed = body.seed if body.seed is not None else uuid.uuid4().int % 2**62
        return BatchRequest(prompt=prompt_ids, max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                            top_p=body.top_p, min_p=body.min_p, seed=seed, gamma=body.gamma)

    def submit(req: BatchRequest):
        try:
            return worker.submit(req)
        except Overloaded as err:
            raise APIError(err.status, str(err), kind="server_error" if err.status == 503 else "rate_limit_error",
                           code="overloaded" if err.status == 429 else "unavailable")
        except ValueError as err:
            param = "max_tokens" if "max_tokens" in str(err) else "prompt" if "prompt" in str(err) else None
            raise APIError(400, str(err), param=param, code="context_length_exceeded" if "positions" in str(err)
                           else None)

    async def run(request: Request, body: SamplingFields, prompt_ids: list, shape):
        req = encode(body, prompt_ids)
        ticket = submit(req)
        text = TextStream(tokenizer, body.stops())
        rid, created = f"{shape.prefix}-{uuid.uuid4().hex[:24]}", int(time.time())

        def usage():
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(text.tokens),
                    "total_tokens": len(prompt_ids) + len(text.tokens)}

        async def next_event():
            while True:
                try:
                    return await asyncio.wait_for(ticket.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise ClientGone() from None

        async def events():
            """(new text, finish reason or None) per engine event; cancels the request when a stop string hits."""
            while True:
                event = await next_event()
                if isinstance(event, Exception):
                    raise APIError(503, f"the engine failed: {event}", kind="server_error")
                done = event.finish_reason is not None
                new = text.push(event.tokens, final=done)
                if text.stopped and not done:
                    worker.cancel(ticket)
                    yield new, "stop"
                    return
                yield new, (FINISH[event.finish_reason] if done else None)
                if done:
                    ticket.finished = True
                    return

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def sse():
                try:
                    yield _sse(shape.chunk(rid, created, model_name, None, None, first=True))
                    async for new, reason in events():
                        if new or reason:
                            yield _sse(shape.chunk(rid, created, model_name, new, reason))
                    if include_usage:
                        yield _sse({**shape.chunk(rid, created, model_name, None, None), "choices": [],
                                    "usage": usage()})
                    yield "data: [DONE]\n\n"
                except APIError as err:
                    yield _sse(err.body())
                except ClientGone:
                    pass
                finally:
                    worker.cancel(ticket)       # no-op when it finished; a disconnect frees the row

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts, reason = [], None
        try:
            async for new, reason in events():
                parts.append(new)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        finally:
            worker.cancel(ticket)
        return shape.full(rid, created, model_name, "".join(parts), reason, usage())

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        if isinstance(body.prompt, str):
            ids = list(tokenizer(body.prompt).input_ids) if body.prompt else []
        else:
            ids = list(body.prompt)
        if body.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        return await run(request, body, ids, CompletionShape)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if chat and getattr(tokenizer, "chat_template", None):
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = list(tokenizer(prompt, add_special_tokens=False).input_ids)
        else:
            ids = list(tokenizer("\n".join(m["content"] for m in messages)).input_ids)
        return await run(request, body, ids, ChatShape)

    return app


class ClientGone(Exception):
    """The client of a request disconnected."""


def _sse(obj) -> str:
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
