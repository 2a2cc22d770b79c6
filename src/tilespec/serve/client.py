"""The API process's side of the engine: it starts the engine process (serve/core.py), sends it requests and
cancellations, and hands every step's tokens to the request handlers.

:class:`EngineClient` binds two zmq sockets on private ipc paths, spawns the engine process (which connects to them)
and waits for its Ready: the limits requests are checked against, the tokenizer, the K/V capacity. In the event
loop one task reads the engine's messages -- one per engine step -- and, per request in it, appends the new ids to
that request's :class:`RequestStream` and wakes its handler. A handler that is slower than the engine finds several
steps' tokens waiting and sends them as one chunk (coalescing), so a burst never queues chunk after chunk.

Failures cross the boundary: if the engine process dies (a step raised: Failed; or it was killed: its sentinel
fires), every request in flight ends with the error at once, ``alive`` turns false (/health 503) and new requests
get 503. Shutdown (``drain``) refuses new requests, lets running ones finish for a while, cancels the rest, then
stops the engine process -- terminated, then killed, if it does not exit -- so no process outlives the server.
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
from typing import Optional

import zmq
import zmq.asyncio

from tilespec.engine.batch_request import BatchRequest, check_request

from .core import EngineSpec, run_engine
from .messages import Cancel, Failed, Ready, Rejected, Shutdown, Step, Submit, decode_to_api, encode

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
    ("stop", "length", "cancelled"), ``error`` when it failed; ``ready`` is set whenever something arrived."""

    __slots__ = ("id", "pending", "finish", "error", "ready", "done")

    def __init__(self, rid: int):
        self.id, self.pending, self.finish, self.error = rid, [], None, None
        self.ready = asyncio.Event()
        self.done = False

    def take(self) -> list:
        """The ids that arrived since the last take (the caller then awaits ``ready`` again)."""
        ids, self.pending = self.pending, []
        self.ready.clear()
        return ids


class EngineClient:
    """The engine process and the sockets to it (see the module docstring); ``max_queue``: requests waiting for a
    batch row before 429."""

    def __init__(self, spec: EngineSpec, *, max_queue: int = 256):
        self.max_queue = max_queue
        self.draining, self.error, self.started = False, None, time.time()
        self.info: dict = {}
        self.tokenizer = None
        self.stats: dict = {"counters": {}, "running": 0, "waiting": 0}
        self.streams: dict = {}
        self._ids = itertools.count()
        self._dir = tempfile.mkdtemp(prefix="tilespec-ipc-")
        self._zmq = zmq.Context()
        self._out = self._zmq.socket(zmq.PUSH)
        self._out.setsockopt(zmq.SNDHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._in = self._zmq.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        inbox, outbox = f"ipc://{self._dir}/to-engine", f"ipc://{self._dir}/to-api"
        self._out.bind(inbox)
        self._in.bind(outbox)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine, args=(spec, inbox, outbox, os.getpid()), name="tilespec-engine")
        with spec.portable():
            self.process.start()
        atexit.register(self.kill)
        self._reader: Optional[asyncio.Task] = None
        self._stopping = False

    # ------------------------------------------------------------------------------------------------ start-up
    def wait_ready(self, timeout: Optional[float] = None) -> dict:
        """Block until the engine process is ready (its info) or raise what made it fail (ValueError for a bad
        option, RuntimeError naming the exit code when it died)."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._in.poll(200):
                msg = decode_to_api(self._in.recv())
                if isinstance(msg, Ready):
                    self.info = msg.info
                    if msg.tokenizer:
                        self.tokenizer = pickle.loads(msg.tokenizer)
                    return self.info
                if isinstance(msg, Failed):
                    self.kill()
                    raise RAISED.get(msg.kind, RuntimeError)(msg.error)
            elif not self.process.is_alive():
                self.kill()
                raise RuntimeError(f"the engine process exited with code {self.process.exitcode} before it was "
                                   f"ready (its output above says why)")
            if end is not None and time.monotonic() > end:
                self.kill()
                raise TimeoutError(f"the engine process was not ready within {timeout} s")

    async def start(self) -> None:
        """Start reading the engine's messages in the running event loop (the app's lifespan calls this)."""
        if self._reader is None:
            loop = asyncio.get_running_loop()
            self._reader = loop.create_task(self._read(zmq.asyncio.Socket.from_socket(self._in)))
            loop.add_reader(self.process.sentinel, self._exited)

    # ------------------------------------------------------------------------------------------------ requests
    @property
    def alive(self) -> bool:
        return self.error is None and self.process.is_alive()

    @property
    def max_len(self) -> int:
        return self.info["max_len"]

    @property
    def queued(self) -> int:
        """Requests submitted that hold no batch row yet (as of the engine's last stats)."""
        return max(0, len(self.streams) - self.stats.get("running", 0))

    def submit(self, req: BatchRequest) -> RequestStream:
        """Check ``req`` (ValueError: a 400) and send it; Overloaded (429 / 503) when it cannot be taken now."""
        if self.error is not None:
            raise Overloaded(503, f"the engine failed and serves no more requests: {self.error}")
        if self.draining or self._stopping or not self.process.is_alive():
            raise Overloaded(503, "the server is shutting down")
        if self.queued >= self.max_queue:
            raise Overloaded(429, f"too many requests waiting ({self.max_queue}); retry later")
        check_request(req, self.info["max_request_len"], self.info["vocab"])
        stream = RequestStream(next(self._ids))
        self.streams[stream.id] = stream
        logits = req.logits
        self._out.send(encode(Submit(
            id=stream.id, prompt=req.prompt, max_tokens=req.max_tokens, temperature=req.temperature,
            top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, seed=req.seed, gamma=req.gamma,
            stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos, transforms=logits is not None,
            **({} if logits is None else dict(presence_penalty=logits.presence_penalty,
                                              frequency_penalty=logits.frequency_penalty,
                                              logit_bias=dict(logits.logit_bias), min_tokens=logits.min_tokens)))))
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Free the request's blocks (its client went away, or a stop string ended it); a no-op once it ended."""
        if not stream.done:
            stream.done = True
            self.streams.pop(stream.id, None)
            if self.process.is_alive():
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
        streams = self.streams
        for rid, ids, finish in msg.outputs:
            stream = streams.get(rid)
            if stream is None:
                continue
            if ids:
                stream.pending += ids
            if finish is not None:
                stream.finish, stream.done = finish, True
                del streams[rid]
            stream.ready.set()
        if msg.stats is not None:
            self.stats = msg.stats

    def _exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        if not self._stopping:
            self.process.join(1)
            self._fail(f"the engine process exited with code {self.process.exitcode}")

    def _fail(self, error: str) -> None:
        if self.error is None:
            self.error = error
        for stream in list(self.streams.values()):
            stream.done, stream.error = True, EngineFailed(self.error)
            stream.ready.set()
        self.streams.clear()

    # ------------------------------------------------------------------------------------------------ shutdown
    async def drain(self, timeout: float) -> None:
        """Refuse new requests, let running ones finish for up to ``timeout`` s, then stop the engine process."""
        self.draining = True
        end = time.monotonic() + timeout
        while self.streams and self.alive and time.monotonic() < end:
            await asyncio.sleep(0.02)
        self._stopping = True
        if self.process.is_alive():
            self._out.send(encode(Shutdown()))
        await asyncio.to_thread(self.process.join, 10)
        self._fail("the server shut down")
        if self._reader is not None:
            self._reader.cancel()
        self.kill()

    def kill(self) -> None:
        """Stop the engine process now (terminate, then kill) and release the sockets; safe to call twice."""
        self._stopping = True
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        if not self._zmq.closed:
            self._out.close()
            self._in.close()
            self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.kill)
