"""One completion request, from its parsed body to the response: prompt ids, the engine request, its tokens as text.

:class:`Completions` holds what every request needs (the engine client, the tokenizer, the served model's name,
defaults).
Tokenizing and the chat template run on one worker thread (``encode_pool``), never on the event loop, so a long
prompt does not stall ``/health`` or other streams; the tokenizer is used by one encoding thread at a time. A
streamed response is server-sent events: each chunk carries every token that arrived since the previous one (a
client slower than the engine gets fewer, larger chunks, never a queue of them); a client that disconnects cancels
its request (its blocks are freed). A request with logprobs gets, with each piece of text, the entries of the tokens
that piece accounts for (serve/text.py's ``settled_tokens``), in its shape's format (serve/logprobs.py).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi.responses import JSONResponse, StreamingResponse

from tilespec.engine.batch_request import BatchRequest

from .protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields
from .shapes import ChatShape, CompletionShape, sse
from .client import EngineClient, EngineFailed, Overloaded, RequestStream
from .detokenize import fast_decoder
from .logprobs import TokenText
from .text import TextStream

FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}


class ClientGone(Exception):
    """The client of a request disconnected."""


class Completions:
    """The completion routes' work for ``client``'s engine served as ``model_name`` (see the module docstring)."""

    def __init__(self, client: EngineClient, tokenizer, model_name: str, *, default_max_tokens: int = 256,
                 chat: bool = True, retry_after: int = 1):
        self.client, self.tok, self.model_name = client, tokenizer, model_name
        self.default_max_tokens, self.chat, self.retry_after = default_max_tokens, chat, retry_after
        self.decode = fast_decoder(tokenizer)
        self.token_text = TokenText(tokenizer)
        self.encode_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tilespec-encode")

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.encode_pool, fn, *args)

    # ---------------------------------------------------------------------------------------------- prompts
    def _completion_ids(self, body: CompletionRequest) -> list:
        if isinstance(body.prompt, str):
            return list(self.tok(body.prompt).input_ids) if body.prompt else []
        return list(body.prompt)

    def _chat_ids(self, turns: list) -> list:
        if self.chat and getattr(self.tok, "chat_template", None):
            prompt = self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            return list(self.tok(prompt, add_special_tokens=False).input_ids)
        return list(self.tok("\n".join(m["content"] for m in turns)).input_ids)

    async def completion_ids(self, body: CompletionRequest) -> list:
        self.check(body)
        return await self._off_loop(self._completion_ids, body)

    async def chat_ids(self, body: ChatCompletionRequest) -> list:
        self.check(body)
        return await self._off_loop(self._chat_ids, body.turns())

    # ---------------------------------------------------------------------------------------------- requests
    def check(self, body: SamplingFields) -> None:
        """The model name and the fields this server refuses, before any tokenizing."""
        if body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        body.check_supported()
        refused = self.client.info.get("logprobs_refused")
        if refused and body.logprob_count() is not None:
            info = self.client.info
            raise APIError(400, f"logprobs need the paged engine; this server runs {info.get('engine')} with "
                                f"draft {info.get('drafter') or 'none'}: {refused}", param="logprobs",
                           code="unsupported_parameter")

    def max_tokens(self, body: SamplingFields, n: int, prompt_param: str) -> int:
        """The request's token budget for a prompt of ``n`` tokens, or a 400 that says what is over the context."""
        c = self.client.max_len
        if n >= c:
            what = f"{n - c} over the context of {c}" if n > c else \
                f"filling the context of {c} with no room for a completion"
            raise APIError(400, f"the prompt is {n} tokens, {what}; shorten the prompt", param=prompt_param,
                           code="context_length_exceeded")
        asked = body.max_completion_tokens or body.max_tokens
        if asked is None:
            return min(self.default_max_tokens, c - n)
        if n + asked > c:
            name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            raise APIError(400, f"the prompt is {n} tokens and {name} is {asked}: {n + asked - c} over the context "
                                f"of {c}; lower {name} to at most {c - n} or shorten the prompt", param=name,
                           code="context_length_exceeded")
        return asked

    def request(self, body: SamplingFields, ids: list, prompt_param: str) -> BatchRequest:
        if not ids:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        seed = body.seed if body.seed is not None else uuid.uuid4().int % 2**62
        return BatchRequest(prompt=ids, max_tokens=self.max_tokens(body, len(ids), prompt_param),
                            temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                            seed=seed, gamma=body.gamma, logits=body.logit_settings(),
                            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                            logprobs=body.logprob_count())

    def submit(self, req: BatchRequest):
        try:
            return self.client.submit(req)
        except Overloaded as err:
            if err.status == 429:
                raise APIError(429, str(err), kind="rate_limit_error", code="overloaded",
                               headers={"Retry-After": str(self.retry_after)}) from None
            raise APIError(err.status, str(err), kind="server_error", code="unavailable") from None
        except ValueError as err:
            text = str(err)
            names = ("stop_token_ids", "logit_bias", "max_tokens", "logprobs", "prompt")
            param = next((p for p in names if p in text), None)
            raise APIError(400, text, param=param) from None

    # ---------------------------------------------------------------------------------------------- responses
    async def respond(self, request, body: SamplingFields, ids: list, shape, prompt_param: str):
        """Submit and answer: a StreamingResponse of server-sent events, or the full response body."""
        req = self.request(body, ids, prompt_param)
        stream = self.submit(req)
        text = TextStream(self.decode, body.stops(), track=req.logprobs is not None)
        reply = _Reply(self, request, stream, text, shape, len(ids))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return TicketStream(reply.events_sse(include_usage), lambda: self.client.cancel(stream),
                                media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await reply.full()


class TicketStream(StreamingResponse):
    """A streamed response that cancels its request however the response ends. When the client disconnects,
    Starlette's send raises out of the ``async for`` over the body and leaves the event generator suspended: its
    ``finally`` would run only when the garbage collector finalises it (seconds later, or never while a traceback
    holds it). Here the request is cancelled (a no-op when it finished) and the generator closed at once."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            try:
                await self.body_iterator.aclose()
            except RuntimeError:        # already closed by its own exception
                pass


class _Reply:
    """The answer to one submitted request (``stream``): its text as events, streamed or gathered."""

    def __init__(self, owner: Completions, request, stream: RequestStream, text: TextStream, shape, n_prompt: int):
        self.owner, self.request, self.stream, self.text, self.shape = owner, request, stream, text, shape
        self.n_prompt = n_prompt
        self.reported = 0           # tokens whose logprobs were handed out
        self.rid, self.created = f"{shape.prefix}-{uuid.uuid4().hex[:24]}", int(time.time())

    def usage(self) -> dict:
        done = len(self.text.tokens)
        return {"prompt_tokens": self.n_prompt, "completion_tokens": done, "total_tokens": self.n_prompt + done}

    async def _arrival(self, watch: bool) -> None:
        """Until the engine sent something for this request; ``watch``: also notice a client that went away (a
        streamed response is cancelled by Starlette on a disconnect instead, so it waits on the event alone)."""
        ready = self.stream.ready
        while watch and not ready.is_set():
            try:
                return await asyncio.wait_for(ready.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    raise ClientGone() from None
        await ready.wait()

    def _logprobs(self, done: bool):
        """None without logprobs, else (ids, entries, text offsets) of the tokens the text sent now accounts for."""
        if self.stream.logprobs is None:
            return None
        a, n = self.reported, max(self.reported, self.text.settled_tokens(done))
        self.reported = n
        return self.text.tokens[a:n], self.stream.logprobs[a:n], [self.text.start(i) for i in range(a, n)]

    async def events(self, watch: bool = False):
        """(new text, finish reason or None, logprobs piece or None: ``_logprobs``) per arrival of tokens; cancels
        the request when a stop string hits."""
        stream = self.stream
        while True:
            await self._arrival(watch)
            if stream.error is not None:
                if isinstance(stream.error, EngineFailed):
                    raise APIError(503, f"the engine failed: {stream.error}", kind="server_error")
                raise APIError(400, str(stream.error))
            done = stream.finish is not None
            new = self.text.push(stream.take(), final=done)
            if self.text.stopped and not done:
                self.owner.client.cancel(stream)
                yield new, "stop", self._logprobs(True)
                return
            if new or done:
                yield new, ("stop" if self.text.stopped else FINISH[stream.finish]) if done else None, \
                    self._logprobs(done)
            if done:
                return

    async def events_sse(self, include_usage: bool):
        chunk = self.shape.chunk_encoder(self.rid, self.created, self.owner.model_name)
        try:
            yield chunk(None, None, first=True)
            async for new, reason, piece in self.events():
                yield chunk(new, reason) if piece is None else self._chunk_with(new, reason, piece)
            if include_usage:
                yield sse({**self.shape.chunk(self.rid, self.created, self.owner.model_name, None, None),
                           "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        except APIError as err:
            yield sse(err.body())
        except ClientGone:
            pass
        finally:
            self.owner.client.cancel(self.stream)       # no-op when it finished; a disconnect frees the blocks

    def _chunk_with(self, new: str, reason, piece) -> str:
        """A chunk with logprobs: built whole (the cheap encoder of text-only chunks has no room for them)."""
        return sse(self.shape.chunk(self.rid, self.created, self.owner.model_name, new, reason,
                                    logprobs=self.shape.logprobs(self.owner.token_text, *piece)))

    async def full(self):
        parts, reason, pieces = [], None, ([], [], [])
        try:
            async for new, reason, piece in self.events(watch=True):
                parts.append(new)
                for whole, part in zip(pieces, piece or ()):
                    whole += part
        except ClientGone:
            return JSONResponse({}, status_code=499)
        finally:
            self.owner.client.cancel(self.stream)
        logprobs = None if self.stream.logprobs is None else self.shape.logprobs(self.owner.token_text, *pieces)
        return self.shape.full(self.rid, self.created, self.owner.model_name, "".join(parts), reason, self.usage(),
                               logprobs=logprobs)


__all__ = ["ChatShape", "ClientGone", "CompletionShape", "Completions"]
