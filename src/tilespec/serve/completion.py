"""One completion request, from its parsed body to the response: prompt ids, the engine requests, their answer.

:class:`Completions` holds what every request needs (the engine client, the tokenizer, the served model's name,
defaults).
Tokenizing and the chat template run on one worker thread (``encode_pool``), never on the event loop, so a long
prompt does not stall ``/health`` or other streams; the tokenizer is used by one encoding thread at a time. The
prompt is tokenized once; each of the ``n`` choices is its own engine request (choice i seeded ``seed + i`` when
the request has a seed, wrapping within int64; else each its own random seed), submitted together, all or none,
counting ``n`` against ``--max-queue``. ``n`` is at most the server's batch rows (its choices decode side by side)
and ``--max-queue``. The answer (streamed as server-sent events or whole) is serve/choices.py's; a client that
disconnects cancels every choice (their blocks are freed). Chat with tools offered also gets a tool-call parser for
the served model (serve/tools.py). Completions' ``echo`` (serve/choices.py): the prompt's text (the string given, or
the ids decoded) before each choice's; with ``logprobs`` the engine also reports the prompt's entries
(BatchRequest.prompt_logprobs); ``max_tokens`` 0 (echo only: scoring the prompt) asks the engine for one token,
which is dropped. Structured outputs (serve/structured.py): the request's grammar rides on every choice's engine
request, parsed with xgrammar on the worker thread first; an engine that cannot constrain (``grammar_refused`` in
its info) gets none: the request is a 400 before anything is submitted.
"""
from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from fastapi.responses import StreamingResponse

from tilespec.engine.batch_request import BatchRequest

from .choices import Choice, ClientGone, Reply
from .client import EngineClient, Overloaded
from .detokenize import fast_decoder
from .logprobs import Echo, TokenText
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields
from .shapes import ChatShape, CompletionShape
from .structured import check_grammar, constraint_of, preload
from .text import TextStream
from .tools import tool_parser_for

try:
    from jinja2.exceptions import TemplateError     # chat templates refuse messages with raise_exception
except ImportError:         # no jinja2: no template of transformers' can run either
    TemplateError = ()


def choice_seeds(seed, n: int) -> list:
    """Choice i's seed: ``seed + i`` wrapped into int64 (so choice 0 is the request alone), or random ones."""
    if seed is None:
        return [uuid.uuid4().int % 2**62 for _ in range(n)]
    return [(seed + i + 2**63) % 2**64 - 2**63 for i in range(n)]


class Completions:
    """The completion routes' work for ``client``'s engine served as ``model_name`` (see the module docstring)."""

    def __init__(self, client: EngineClient, tokenizer, model_name: str, *, default_max_tokens: int = 256,
                 chat: bool = True, retry_after: int = 1):
        self.client, self.tok, self.model_name = client, tokenizer, model_name
        self.default_max_tokens, self.chat, self.retry_after = default_max_tokens, chat, retry_after
        self.decode = fast_decoder(tokenizer)
        self.token_text = TokenText(tokenizer)
        self.encode_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tilespec-encode")
        info = getattr(client, "info", None) or {}
        if "grammar_refused" in info and not info["grammar_refused"]:
            self.encode_pool.submit(preload)        # xgrammar's import takes seconds: not on the first request

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.encode_pool, fn, *args)

    # ---------------------------------------------------------------------------------------------- prompts
    def _completion_ids(self, body: CompletionRequest) -> list:
        if isinstance(body.prompt, str):
            return list(self.tok(body.prompt).input_ids) if body.prompt else []
        return list(body.prompt)

    def templated(self) -> bool:
        return bool(self.chat and getattr(self.tok, "chat_template", None))

    def _chat_ids(self, turns: list, tools) -> list:
        if self.templated():
            extra = {} if tools is None else {"tools": tools}
            try:
                prompt = self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **extra)
            except TemplateError as err:
                raise APIError(400, f"the chat template refused the messages: {err}", param="messages") from None
            return list(self.tok(prompt, add_special_tokens=False).input_ids)
        return list(self.tok("\n".join(m["content"] for m in turns)).input_ids)

    async def completion_ids(self, body: CompletionRequest) -> list:
        await self.check_grammar(self.check(body))
        return await self._off_loop(self._completion_ids, body)

    async def chat_ids(self, body: ChatCompletionRequest) -> tuple:
        """(prompt ids, the tool parser's factory or None: no tools offered)."""
        constraint = self.check(body)
        tools, turns = body.template_tools(), body.turns()
        if (tools is not None or any("tool_calls" in t for t in turns)) and not self.templated():
            # joined as plain text, the calls would vanish from the prompt
            raise APIError(400, "tools and tool calls need the model's chat template; this server has none "
                                "(or runs with --no-chat)", param="tools" if tools else "messages",
                           code="unsupported_parameter")
        parser = None if tools is None else partial(tool_parser_for(self.tok, self.model_name), body.max_tool_calls())
        await self.check_grammar(constraint)
        return await self._off_loop(self._chat_ids, turns, tools), parser

    # ---------------------------------------------------------------------------------------------- requests
    def check(self, body: SamplingFields):
        """The model name and the fields this server refuses, before any tokenizing -> the request's structured
        output (serve/structured.py; None: none)."""
        if body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        body.check_supported()
        refused = self.client.info.get("logprobs_refused")
        if refused and body.logprob_count() is not None:
            info = self.client.info
            what = "logprobs (and echo's prompt logprobs)" if getattr(body, "echo", False) else "logprobs"
            raise APIError(400, f"{what} need the paged engine; this server runs {info.get('engine')} with "
                                f"draft {info.get('drafter') or 'none'}: {refused}", param="logprobs",
                           code="unsupported_parameter")
        constraint = constraint_of(body)
        refused = self.client.info.get("grammar_refused")
        if refused and constraint is not None:
            info = self.client.info
            raise APIError(400, f"{constraint.param}: structured outputs are not served by this server "
                                f"({info.get('engine')}, draft {info.get('drafter') or 'none'}): {refused}",
                           param=constraint.param, code="unsupported_parameter")
        self.check_n(body.n)
        return constraint

    async def check_grammar(self, constraint) -> None:
        """The grammar parsed (xgrammar, no vocabulary: serve/structured.check_grammar) off the event loop, so that
        a bad one is a 400 before the request is accepted, streamed or not."""
        if constraint is not None:
            await self._off_loop(check_grammar, constraint)

    def check_n(self, n: int) -> None:
        """``n`` choices are ``n`` engine requests: at most the batch rows (they decode side by side) and the queue
        (they may all wait at once), else a 400 naming the limit."""
        if n == 1:
            return
        rows, queue = self.client.info.get("max_batch", n), self.client.max_queue
        if n > rows:
            raise APIError(400, f"n={n} is over this server's {rows} batch rows (--max-batch): the choices of a "
                                f"request decode side by side; ask for at most {rows}", param="n")
        if n > queue:
            raise APIError(400, f"n={n} choices are {n} engine requests, more than the {queue} that may wait at "
                                f"once (--max-queue); ask for at most {queue}", param="n")

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

    def requests(self, body: SamplingFields, ids: list, prompt_param: str) -> list:
        """The engine requests of the ``n`` choices: one prompt, one budget, a seed each (``choice_seeds``)."""
        if not ids:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        max_tokens, logits = self.max_tokens(body, len(ids), prompt_param), body.logit_settings()
        lp, constraint = body.logprob_count(), constraint_of(body)
        return [BatchRequest(prompt=ids, max_tokens=max(1, max_tokens), temperature=body.temperature,
                             top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, seed=seed, gamma=body.gamma,
                             logits=logits, stop_token_ids=tuple(body.stop_token_ids or ()),
                             ignore_eos=body.ignore_eos, logprobs=lp,
                             prompt_logprobs=lp if getattr(body, "echo", False) else None,
                             grammar=None if constraint is None else constraint.pair)
                for seed in choice_seeds(body.seed, body.n)]

    def echo_of(self, body: CompletionRequest, ids: list) -> Echo:
        """The prompt to echo: its text (as given, or its ids decoded) and each token's start in its decoded text."""
        stream = TextStream(self.decode, [], track=True)
        decoded = stream.push(ids, final=True)
        text = body.prompt if isinstance(body.prompt, str) else decoded
        return Echo(text, list(ids), [stream.start(i) for i in range(len(ids))])

    def submit(self, reqs: list) -> list:
        try:
            return self.client.submit_all(reqs)
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
    async def respond(self, request, body: SamplingFields, ids: list, shape, prompt_param: str, tools=None):
        """Submit the choices and answer: a StreamingResponse of server-sent events, or the full response body.
        ``tools``: a factory of tool parsers (one a choice), None when the request offered no tools."""
        reqs = self.requests(body, ids, prompt_param)
        stops = body.stops()        # checked before submitting: a 400 here must leave nothing running
        echo = await self._off_loop(self.echo_of, body, ids) if getattr(body, "echo", False) else None
        drop = echo is not None and (body.max_completion_tokens or body.max_tokens) == 0     # scoring the prompt
        streams = self.submit(reqs)
        track = reqs[0].logprobs is not None
        choices = [Choice(i, stream, TextStream(self.decode, stops, track=track), tools() if tools else None,
                          echo=echo, drop=drop)
                   for i, stream in enumerate(streams)]
        reply = Reply(self, request, choices, shape, len(ids))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return TicketStream(reply.events_sse(include_usage), reply.cancel, media_type="text/event-stream",
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


__all__ = ["ChatShape", "ClientGone", "CompletionShape", "Completions", "choice_seeds"]
