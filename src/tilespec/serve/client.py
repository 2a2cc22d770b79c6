"""An API process's side of the engine process: it sends requests and cancellations to the engine and hands every
step's tokens to the request handlers.

:class:`EngineClient` connects to the engine's inbox, binds its own outbox (API process ``index`` of ``count``: its
request ids are ``index + count * k``) and waits for the engine's Loaded (the tokenizer) and Ready: the limits
requests are checked against, the K/V capacity. In the event loop one task reads the engine's messages -- one per
engine step -- and, per request in it, appends the new ids to that request's :class:`RequestStream` and wakes its
handler. A handler that is slower than the engine finds several steps' tokens waiting and sends them as one chunk
(coalescing), so a burst never queues chunk after chunk.

Failures cross the boundary: when the engine process dies (a step raised and it sent Failed; or it was killed and
the main process, which watches it, sends Failed on its behalf: serve/processes.py), every request in flight ends
with the error at once, ``alive`` turns false (/health 503) and new requests get 503. ``drain`` (shutdown) refuses
new requests and lets running ones finish for a while; stopping the engine is the main process's.
"""
from __future__ import annotations

import asyncio
import itertools
import pickle
import time
from typing import Callable, Optional

import zmq
import zmq.asyncio

from tilespec.engine.batch_request import BatchRequest, check_request

from .core import push_socket
from .messages import Cancel, Failed, Loaded, Ready, Rejected, Step, Submit, decode_to_api, encode

RAISED = {"ValueError": ValueError, "TypeError": TypeError, "FileNotFoundError": FileNotFoundError}


class Overloaded(Exception):
    """The server cannot take the request now: ``status`` 429 (queue full) or 503 (draining / failed)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EngineFailed(Exception):
    """The engine process died while the request was in flight."""


class RequestStream:
    """One submitted request in the API process: ``pending`` ids not yet handed out, ``finish`` once it ended
    ("stop", "length", "cancelled"), ``error`` when it failed; ``ready`` is set whenever something arrived (the
    choices of one ``n`` > 1 request share theirs, so that their handler waits on one event for any of them).
    ``logprobs``: None, or (a request that asked) every token's entry so far, entry i for the i-th token taken;
    ``prompt_logprobs``: None, or (a request that asked: echo) its prompt tokens' entries after the first, set with
    its first step."""

    __slots__ = ("id", "pending", "finish", "error", "ready", "done", "logprobs", "prompt_logprobs")

    def __init__(self, rid: int, logprobs: bool = False, ready: Optional[asyncio.Event] = None):
        self.id, self.pending, self.finish, self.error = rid, [], None, None
        self.ready = asyncio.Event() if ready is None else ready
        self.done = False
        self.logprobs: Optional[list] = [] if logprobs else None
        self.prompt_logprobs: Optional[list] = None

    @property
    def news(self) -> bool:
        """Something arrived that was not taken yet (ids, the end, an error)."""
        return bool(self.pending) or self.finish is not None or self.error is not None

    def take(self) -> list:
        """The ids that arrived since the last take (the caller then awaits ``ready`` again)."""
        ids, self.pending = self.pending, []
        self.ready.clear()
        return ids


class EngineClient:
    """API process ``index`` of ``count``'s sockets to the engine (see the module docstring); ``max_queue``:
    requests waiting for a batch row before 429; ``engine_alive``: whether the engine process runs (the main
    process's view; None: trust the messages)."""

    def __init__(self, inbox: str, outbox: str, *, index: int = 0, count: int = 1, max_queue: int = 256,
                 engine_alive: Optional[Callable[[], bool]] = None):
        self.max_queue, self.engine_alive = max_queue, engine_alive
        self.draining, self.error, self.started = False, None, time.time()
        self.info: dict = {}
        self.tokenizer, self.loaded = None, False
        self.stats: dict = {"counters": {}, "running": 0, "waiting": 0}
        self.streams: dict = {}
        self._ids = itertools.count(index, count)
        self._zmq = zmq.Context()
        self._out = push_socket(self._zmq, inbox)
        self._in = self._zmq.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(outbox)
        self._reader: Optional[asyncio.Task] = None

    # ------------------------------------------------------------------------------------------------ start-up
    def wait_ready(self, timeout: Optional[float] = None, loaded_only: bool = False) -> dict:
        """Block until the engine process is ready (its info) or raise what made it fail (ValueError for a bad
        option, RuntimeError when it died). The tokenizer arrives before (Loaded: the models are loaded, the warm-up
        runs); ``loaded_only``: return then (an empty dict), so the caller prepares beside the warm-up."""
        if self.info or (loaded_only and self.loaded):
            return self.info
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._in.poll(200):
                msg = decode_to_api(self._in.recv())
                if isinstance(msg, Loaded):
                    self.loaded = True
                    if msg.tokenizer:
                        self.tokenizer = pickle.loads(msg.tokenizer)
                    if loaded_only:
                        return {}
                if isinstance(msg, Ready):
                    self.info = msg.info
                    return self.info
                if isinstance(msg, Failed):
                    raise RAISED.get(msg.kind, RuntimeError)(msg.error)
            elif self.engine_alive is not None and not self.engine_alive():
                raise RuntimeError("the engine process exited before it was ready (its output above says why)")
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"the engine process was not ready within {timeout} s")

    async def start(self) -> None:
        """Start reading the engine's messages in the running event loop (the app's lifespan calls this)."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(
                self._read(zmq.asyncio.Socket.from_socket(self._in)))

    # ------------------------------------------------------------------------------------------------ requests
    @property
    def alive(self) -> bool:
        return self.error is None and (self.engine_alive is None or self.engine_alive())

    @property
    def max_len(self) -> int:
        return self.info["max_len"]

    @property
    def queued(self) -> int:
        """Requests submitted that hold no batch row yet (as of the engine's last stats)."""
        return max(0, len(self.streams) - self.stats.get("running", 0))

    def submit(self, req: BatchRequest) -> RequestStream:
        """Check ``req`` (ValueError: a 400) and send it; Overloaded (429 / 503) when it cannot be taken now."""
        return self.submit_all([req])[0]

    def submit_all(self, reqs: list) -> list:
        """Check and send ``reqs`` (the choices of one request) all or none: they count as ``len(reqs)`` requests
        against ``max_queue``; their streams share one ``ready`` event."""
        if self.error is not None:
            raise Overloaded(503, f"the engine failed and serves no more requests: {self.error}")
        if self.draining:
            raise Overloaded(503, "the server is shutting down")
        if self.queued + len(reqs) > self.max_queue:
            more = f" to take {len(reqs)} more (one per choice)" if len(reqs) > 1 else ""
            raise Overloaded(429, f"too many requests waiting ({self.max_queue}){more}; retry later")
        for req in reqs:
            check_request(req, self.info["max_request_len"], self.info["vocab"])
        ready = asyncio.Event()
        return [self._send(req, ready) for req in reqs]

    def _send(self, req: BatchRequest, ready: asyncio.Event) -> RequestStream:
        stream = RequestStream(next(self._ids), logprobs=req.logprobs is not None, ready=ready)
        self.streams[stream.id] = stream
        logits = req.logits
        self._out.send(encode(Submit(
            id=stream.id, prompt=req.prompt, max_tokens=req.max_tokens, temperature=req.temperature,
            top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, seed=req.seed, gamma=req.gamma,
            stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos, transforms=logits is not None,
            logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs, grammar=req.grammar,
            **({} if logits is None else dict(presence_penalty=logits.presence_penalty,
                                              frequency_penalty=logits.frequency_penalty,
                                              logit_bias=dict(logits.logit_bias), min_tokens=logits.min_tokens)))))
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Free the request's blocks (its client went away, or a stop string ended it); a no-op once it ended."""
        if not stream.done:
            stream.done = True
            self.streams.pop(stream.id, None)
            if self.error is None:
                self._out.send(encode(Cancel(ids=[stream.id])))

    # ------------------------------------------------------------------------------------------------ messages
    async def _read(self, sock) -> None:
        while True:
            try:
                msg = decode_to_api(await sock.recv())
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if isinstance(msg, Step):
                self._dispatch(msg)
            elif isinstance(msg, Rejected):
                stream = self.streams.pop(msg.id, None)
                if stream is not None:
                    stream.done, stream.error = True, ValueError(msg.message)
                    stream.ready.set()
            elif isinstance(msg, Failed):
                self._fail(msg.error)

    def _dispatch(self, msg: Step) -> None:
        streams, logprobs, prompts = self.streams, msg.logprobs or {}, msg.prompt_logprobs
        for rid, ids, finish in msg.outputs:
            stream = streams.get(rid)
            if stream is None:
                continue
            if prompts and rid in prompts:
                stream.prompt_logprobs = prompts[rid]
            if ids:
                stream.pending += ids
                if stream.logprobs is not None:     # one entry per id, so that entry i stays token i's
                    got = logprobs.get(rid, [])[:len(ids)]
                    stream.logprobs += got + [None] * (len(ids) - len(got))
            if finish is not None:
                stream.finish, stream.done = finish, True
                del streams[rid]
            stream.ready.set()
        if msg.stats is not None:
            self.stats = msg.stats

    def _fail(self, error: str) -> None:
        if self.error is None:
            self.error = error
        for stream in list(self.streams.values()):
            stream.done, stream.error = True, EngineFailed(self.error)
            stream.ready.set()
        self.streams.clear()

    # ------------------------------------------------------------------------------------------------ shutdown
    async def drain(self, timeout: float) -> None:
        """Refuse new requests, let running ones finish for up to ``timeout`` s, end the rest."""
        self.draining = True
        end = time.monotonic() + timeout
        while self.streams and self.alive and time.monotonic() < end:
            await asyncio.sleep(0.02)
        self._fail("the server shut down")

    def close(self) -> None:
        """Stop reading and release the sockets; safe to call twice."""
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if not self._zmq.closed:
            self._out.close()
            self._in.close()
            self._zmq.term()
