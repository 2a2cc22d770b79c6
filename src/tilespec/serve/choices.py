"""The answer to one completion request: its ``n`` choices, from their engine streams to the response body or SSE.

Each choice is its own engine request (serve/completion.py submits them together). Their streams share one
``ready`` event (serve/client.submit_all), so one loop serves them all (:meth:`Reply.events`): it waits while no
choice has news, then takes every choice's new tokens, in index order; a client slower than the engine gets fewer,
larger chunks, never a queue of them. Streamed, the chunks of the choices interleave as their tokens come, each
carrying its choice's ``index`` (first one role chunk per choice); whole, the choices are listed in index order,
each with its own finish reason and logprobs. Usage counts the prompt once and every choice's completion tokens. A
stop string ends its own choice (its engine request is cancelled there and then); a client that goes away, an
error, or the end of the response cancels them all (a no-op for those that finished).

A request with logprobs gets, with each piece of text, the entries of the tokens that piece accounts for
(serve/text.py's ``settled_tokens``), in its shape's format (serve/logprobs.py). With a tool parser (chat with tools
offered: serve/tools.py) a choice's text goes through it: content deltas as they settle, each parsed call as OpenAI
streams one (serve/shapes.tool_call_deltas), and the finish reason "tool_calls" when the model called a tool and
ended by itself ("length" stays "length": the text was cut). The logprobs of text the parser holds back ride on the
next chunk sent, the rest on the last one.

Echo (completions): a choice's text begins with the prompt's (``Choice.echo``) and its logprobs with the prompt's
tokens (serve/logprobs.echo_piece), on its first piece of text: streamed without logprobs, the prompt's text is the
choice's opening chunk at once; with them, the first chunk once the engine's first step brought the prompt's
entries. Offsets of the generated tokens count from the start of the echoed text. ``drop``: the request asked for
``max_tokens`` 0 (scoring its prompt); the one token the engine made is dropped.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Optional

from fastapi.responses import JSONResponse

from .client import EngineFailed, RequestStream
from .logprobs import Echo, echo_piece
from .protocol import APIError
from .shapes import sse, tool_call_deltas
from .text import TextStream
from .tools import split

FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}


class ClientGone(Exception):
    """The client of a request disconnected."""


class Choice:
    """One choice: its engine ``stream``, its ``text`` (stop strings), the logprobs handed out, its tool parser."""

    def __init__(self, index: int, stream: RequestStream, text: TextStream, tools=None,
                 echo: Optional[Echo] = None, drop: bool = False):
        self.index, self.stream, self.text, self.tools = index, stream, text, tools
        self.echo, self.drop = echo, drop       # the prompt to echo, until its text was handed out
        self.shift = len(echo.text) if echo is not None else 0      # where the completion starts in the text
        self.reported = 0           # tokens whose logprobs were handed out
        self.finished = False
        self.parts: list = []       # a whole response's text pieces
        self.reason: Optional[str] = None
        self.pieces: tuple = ([], [], [])     # logprobs gathered: a whole response's, or a parsed stream's unsent
        self.called = 0             # tool calls streamed
        self.chunk = None           # its chunk encoder (streamed)

    def _logprobs(self, done: bool):
        """None without logprobs, else (ids, entries, text offsets) of the tokens the text sent now accounts for."""
        if self.stream.logprobs is None:
            return None
        a, n = self.reported, max(self.reported, self.text.settled_tokens(done))
        self.reported = n
        return self.text.tokens[a:n], self.stream.logprobs[a:n], [self.shift + self.text.start(i) for i in range(a, n)]

    def take_echo(self) -> str:
        """The prompt's text to echo now ('' once handed out); its logprobs are then no more to come."""
        echo, self.echo = self.echo, None
        return "" if echo is None else echo.text

    def _echoed(self, event: Optional[tuple]) -> Optional[tuple]:
        """The first event's text and logprobs with the echoed prompt's before them."""
        if self.echo is None or event is None:
            return event
        echo, (new, reason, piece) = self.echo, event
        if piece is not None:
            piece = echo_piece(echo, self.stream.prompt_logprobs, piece)
        return self.take_echo() + new, reason, piece

    def advance(self, client) -> Optional[tuple]:
        """What arrived as (new text, finish reason or None, logprobs piece or None); None when it settles nothing.
        A stop string ends the choice: its engine request is cancelled."""
        stream = self.stream
        if stream.error is not None:
            if isinstance(stream.error, EngineFailed):
                raise APIError(503, f"the engine failed: {stream.error}", kind="server_error")
            raise APIError(400, str(stream.error))
        done = stream.finish is not None
        ids = stream.take()
        new = self.text.push([] if self.drop else ids, final=done)
        if self.text.stopped and not done:
            client.cancel(stream)
            self.finished = True
            return self._echoed((new, "stop", self._logprobs(True)))
        if done:
            self.finished = True
            return self._echoed((new, "stop" if self.text.stopped else FINISH[stream.finish], self._logprobs(True)))
        ready = new or (self.echo is not None and stream.prompt_logprobs is not None)   # the prompt's entries came
        return self._echoed((new, None, self._logprobs(False))) if ready else None

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if reason == "stop" and self.tools is not None and self.tools.calls else reason

    def gather(self, piece) -> None:
        for whole, part in zip(self.pieces, piece or ()):
            whole += part

    def take_pieces(self) -> tuple:
        pieces, self.pieces = self.pieces, ([], [], [])
        return pieces


class Reply:
    """The answer to one request's submitted ``choices`` (see the module docstring)."""

    def __init__(self, owner, request, choices: list, shape, n_prompt: int):
        self.owner, self.request, self.choices, self.shape = owner, request, choices, shape
        self.n_prompt = n_prompt
        self.ready = choices[0].stream.ready        # shared by every choice's stream
        self.rid, self.created = f"{shape.prefix}-{uuid.uuid4().hex[:24]}", int(time.time())

    def cancel(self) -> None:
        """Every choice's engine request ends (a no-op for those that finished): their blocks are freed."""
        for choice in self.choices:
            self.owner.client.cancel(choice.stream)

    def usage(self) -> dict:
        done = sum(len(c.text.tokens) for c in self.choices)
        return {"prompt_tokens": self.n_prompt, "completion_tokens": done, "total_tokens": self.n_prompt + done}

    async def _arrival(self, watch: bool) -> None:
        """Until the engine sent something for a choice; ``watch``: also notice a client that went away (a streamed
        response is cancelled by Starlette on a disconnect instead, so it waits on the event alone)."""
        ready = self.ready
        while watch and not ready.is_set():
            try:
                return await asyncio.wait_for(ready.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    raise ClientGone() from None
        await ready.wait()

    async def events(self, watch: bool = False):
        """(choice, (new text, finish reason or None, logprobs piece or None)) per arrival of its tokens, until
        every choice ended. News is read off the streams, not the shared event (taking one stream's tokens clears
        it), and the event is cleared only when no stream has any, so no arrival is missed."""
        live = list(self.choices)
        client = self.owner.client
        while live:
            if not any(c.stream.news for c in live):
                self.ready.clear()
                await self._arrival(watch)
            for choice in tuple(live):
                if not choice.stream.news:
                    continue
                event = choice.advance(client)
                if choice.finished:
                    live.remove(choice)
                if event is not None:
                    yield choice, event

    async def events_sse(self, include_usage: bool):
        shape, model = self.shape, self.owner.model_name
        try:
            for choice in self.choices:
                choice.chunk = shape.chunk_encoder(self.rid, self.created, model, choice.index)
                if choice.echo is None:
                    yield choice.chunk(None, None, first=True)
                elif choice.stream.logprobs is None:        # echo: the prompt's text opens the choice at once
                    yield choice.chunk(choice.take_echo(), None)
            async for choice, (new, reason, piece) in self.events():
                if choice.tools is not None:
                    for chunk in self._tool_chunks(choice, new, reason, piece):
                        yield chunk
                elif piece is None:
                    yield choice.chunk(new, reason)
                else:       # built whole: the cheap encoder of text-only chunks has no room for logprobs
                    yield self._chunk(choice, new, reason, logprobs=self._logprobs(piece))
            if include_usage:
                yield sse({**shape.chunk(self.rid, self.created, model, None, None), "choices": [],
                           "usage": self.usage()})
            yield "data: [DONE]\n\n"
        except APIError as err:
            yield sse(err.body())
        except ClientGone:
            pass
        finally:
            self.cancel()       # a disconnect frees the blocks of every choice

    def _chunk(self, choice: Choice, text, reason, logprobs=None, delta=None) -> str:
        return sse(self.shape.chunk(self.rid, self.created, self.owner.model_name, text, reason, logprobs=logprobs,
                                    index=choice.index, delta=delta))

    def _logprobs(self, piece):
        return None if piece is None else self.shape.logprobs(self.owner.token_text, *piece)

    def _tool_chunks(self, choice: Choice, new: str, reason, piece) -> list:
        """A parsed choice's chunks for one event: its content and tool-call deltas, then the finish."""
        done = reason is not None
        choice.gather(piece)
        tracked = choice.stream.logprobs is not None
        chunks = []
        for delta in choice.tools.push(new, final=done):
            if isinstance(delta, str):
                deltas = [{"content": delta}]
            else:
                deltas, choice.called = tool_call_deltas(choice.called, delta), choice.called + 1
            for d in deltas:
                lp = self._logprobs(choice.take_pieces()) if tracked else None
                chunks.append(self._chunk(choice, None, None, logprobs=lp, delta=d))
        if done:
            lp = self._logprobs(choice.take_pieces()) if tracked else None
            chunks.append(self._chunk(choice, None, choice.finish_reason(reason), logprobs=lp, delta={}))
        return chunks

    async def full(self):
        try:
            async for choice, (new, reason, piece) in self.events(watch=True):
                choice.parts.append(new)
                choice.reason = reason
                choice.gather(piece)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        finally:
            self.cancel()
        return self.shape.full(self.rid, self.created, self.owner.model_name,
                               [self._whole(c) for c in self.choices], self.usage())

    def _whole(self, choice: Choice) -> dict:
        text, calls = "".join(choice.parts), None
        if choice.tools is not None:
            text, calls = split(choice.tools, text)
        logprobs = None if choice.stream.logprobs is None else self._logprobs(choice.pieces)
        return self.shape.choice(choice.index, text, choice.finish_reason(choice.reason), logprobs, calls)


__all__ = ["Choice", "ClientGone", "FINISH", "Reply"]
