"""The messages between the API process and the engine process (msgpack through msgspec, over zmq PUSH/PULL).

API -> engine: :class:`Submit` (one request, already checked), :class:`Cancel` (requests whose client went away or
whose stop string hit), :class:`Shutdown`. Engine -> API: :class:`Loaded` once the models are loaded (the tokenizer:
the API processes unpickle it and get everything else ready while the engine warms up), :class:`Ready` once
(what the API needs to check requests: limits, K/V capacity, the engine's start-up marks), then one :class:`Step` per engine step carrying every request's
new token ids and finish reasons (never one message per token; the logprobs of the requests that asked for them
beside, raw, and those of the prompt for the requests that echo it: the API process turns them into text), :class:`Rejected` for a request the engine refused,
:class:`Failed` when the engine died. Counters ride on steps at most every ``STATS_EVERY_S`` seconds.
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec

STATS_EVERY_S = 0.1


class Submit(msgspec.Struct, tag=True, array_like=True):
    id: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    gamma: Optional[int] = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    transforms: bool = False        # whether the request carries logit transforms at all
    logprobs: Optional[int] = None  # top alternatives per token (BatchRequest.logprobs); None: no logprobs
    prompt_logprobs: Optional[int] = None   # the same for the prompt's tokens (BatchRequest.prompt_logprobs: echo)
    grammar: Optional[tuple[str, str]] = None   # (kind, spec): the structured output (BatchRequest.grammar)


class Cancel(msgspec.Struct, tag=True, array_like=True):
    ids: list[int]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Loaded(msgspec.Struct, tag=True, array_like=True):
    tokenizer: bytes = b""          # the engine's tokenizer, pickled (empty when the API process brought its own)


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: dict


# per new token: (its log-probability, [(id, log-probability), ...] top first), as BatchEvent.logprobs
TokenLogprobs = list[tuple[float, list[tuple[int, float]]]]


class Step(msgspec.Struct, tag=True, array_like=True):
    """One engine step: ``outputs`` holds (request id, new token ids, finish reason or None) for every request that
    got tokens or ended; ``stats`` the engine's counters and gauges (or None between stats intervals);
    ``logprobs``: request id -> its new tokens' logprobs, for the requests that asked (None when none did: a step
    costs one byte more than without logprobs, not one per request); ``prompt_logprobs``: request id -> its prompt
    tokens' entries after the first (BatchEvent.prompt_logprobs, with a request's first event; None when none did)."""

    outputs: list[tuple[int, list[int], Optional[str]]]
    stats: Optional[dict] = None
    logprobs: Optional[dict[int, TokenLogprobs]] = None
    prompt_logprobs: Optional[dict[int, TokenLogprobs]] = None


def split_by_process(entries: Optional[dict], n: int) -> list:
    """A request id -> entries map split across ``n`` API processes (request ``i`` is process ``i % n``'s): one map
    per process, None where it has none."""
    parts: list = [None] * n
    for i, value in (entries or {}).items():
        parts[i % n] = parts[i % n] or {}
        parts[i % n][i] = value
    return parts


class Rejected(msgspec.Struct, tag=True, array_like=True):
    id: int
    message: str


class Failed(msgspec.Struct, tag=True, array_like=True):
    error: str
    kind: str = "RuntimeError"      # ValueError / TypeError: a bad option the caller gave; re-raised as such


ToEngine = Union[Submit, Cancel, Shutdown]
ToAPI = Union[Loaded, Ready, Step, Rejected, Failed]

encode = msgspec.msgpack.Encoder().encode
decode_to_engine = msgspec.msgpack.Decoder(ToEngine).decode
decode_to_api = msgspec.msgpack.Decoder(ToAPI).decode
