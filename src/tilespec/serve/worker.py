"""The engine thread: runs :class:`~tilespec.engine.batching.BatchEngine` steps and hands tokens to the asyncio
request handlers.

Handlers call :meth:`EngineWorker.submit` (from the event loop): the request is checked at once (ValueError ->
a 400), refused with :class:`Overloaded` when ``max_queue`` requests already wait (429) or the worker is draining or
dead (503), and otherwise queued to the engine thread. The thread alternates "take the inbox (submissions,
cancellations)" and ``engine.step()``, and puts each :class:`~tilespec.engine.batching.BatchEvent` on the request's
asyncio queue with ``loop.call_soon_threadsafe``. It sleeps on an event while there is no work. A failing step ends
every request with an error message and marks the worker dead (health 503) instead of hanging the clients.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from tilespec.engine.batching import BatchEngine, BatchEvent, BatchRequest


class Overloaded(Exception):
    """The server cannot take the request now: ``status`` 429 (queue full) or 503 (draining / failed)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Ticket:
    """A submitted request: ``events`` receives BatchEvents (or an Exception), ``request`` is the engine's record."""

    request: BatchRequest
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    finished: bool = False


class EngineWorker:
    def __init__(self, engine: BatchEngine, max_queue: int = 256):
        self.engine, self.max_queue = engine, max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tickets: dict = {}            # id(request) -> Ticket, engine thread only
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.draining = False
        self.error: Optional[str] = None
        self._submitted = 0                 # written by the event loop's thread only
        self._taken = 0                     # written by the engine thread only
        self._cancels = 0                   # cancellations the engine thread has processed
        self._cancelled = threading.Condition()
        self.started = time.time()
        self._thread = threading.Thread(target=self._run, name="tilespec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def queued(self) -> int:
        """Requests submitted and not yet taken by the engine thread."""
        return self._submitted - self._taken

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, req: BatchRequest) -> Ticket:
        if self.error is not None:
            raise Overloaded(503, f"the engine failed and serves no more requests: {self.error}")
        if self.draining or not self._thread.is_alive():
            raise Overloaded(503, "the server is shutting down")
        if self.queued + len(self.engine.waiting) >= self.max_queue:
            raise Overloaded(429, f"too many requests waiting ({self.max_queue}); retry later")
        self.engine.check(req)              # reads configuration only: safe from this thread
        ticket = Ticket(request=req, events=asyncio.Queue(), loop=asyncio.get_running_loop())
        self._submitted += 1
        self._inbox.put(("submit", ticket))
        self._wake.set()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Free the request's row (a client went away, or a stop string ended it)."""
        if not ticket.finished:
            ticket.finished = True
            self._inbox.put(("cancel", ticket))
            self._wake.set()

    @property
    def cancels_processed(self) -> int:
        """Cancellations the engine thread has carried out (each freed a waiting or running request)."""
        return self._cancels

    def wait_cancels(self, count: int, timeout: float) -> bool:
        """Block until ``cancels_processed`` >= ``count`` (True) or ``timeout`` seconds passed (False)."""
        with self._cancelled:
            return self._cancelled.wait_for(lambda: self._cancels >= count, timeout=timeout)

    def drain(self, timeout: float) -> None:
        """Refuse new requests, let running ones finish for up to ``timeout`` s, cancel the rest, stop the thread."""
        self.draining = True
        end = time.time() + timeout
        while time.time() < end and self._thread.is_alive() and (self.engine.has_work or self.queued):
            time.sleep(0.02)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------------------------------ engine thread
    def _post(self, ticket: Ticket, item) -> None:
        try:
            ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, item)
        except RuntimeError:                # the handler's loop is gone
            pass

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, ticket = self._inbox.get_nowait()
            except queue.Empty:
                return
            req = ticket.request
            if kind == "submit":
                self._taken += 1
                if ticket.finished:         # cancelled before it reached the engine
                    continue
                self.engine.submit(req)
                self._tickets[id(req)] = ticket
            elif id(req) in self._tickets:
                self.engine.cancel(req.rid)
                self._tickets.pop(id(req), None)
                self._post(ticket, BatchEvent(rid=req.rid, tokens=[], finish_reason="cancelled"))
                with self._cancelled:
                    self._cancels += 1
                    self._cancelled.notify_all()

    def _finish_all(self, item) -> None:
        for ticket in list(self._tickets.values()):
            if ticket.request.finish_reason is None:
                self.engine.cancel(ticket.request.rid)
            self._post(ticket, item)
        self._tickets.clear()

    def _run(self) -> None:
        with torch.inference_mode():        # the engine's state tensors are inference tensors
            self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_inbox()
                if not self.engine.has_work:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                by_rid = {t.request.rid: t for t in self._tickets.values()}
                for event in self.engine.step():
                    ticket = by_rid.get(event.rid)
                    if ticket is None:
                        continue
                    self._post(ticket, event)
                    if event.finish_reason is not None:
                        self._tickets.pop(id(ticket.request), None)
            self._take_inbox()
            self._finish_all(BatchEvent(rid=-1, tokens=[], finish_reason="cancelled"))
        except Exception as err:            # never leave clients hanging on a dead engine
            self.error = f"{type(err).__name__}: {err}"
            self._finish_all(RuntimeError(self.error))
            raise
