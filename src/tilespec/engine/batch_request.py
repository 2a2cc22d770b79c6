"""The requests of continuous batching (engine/batching.py): :class:`BatchRequest` (what a client asks, and the
engine's record of it), :class:`BatchEvent` (its new tokens after one engine iteration) and :func:`check_request`
(the checks a request passes before it is queued: a bad one fails at submission with the reason, never mid-step).
No torch: the server's API processes check their requests with this module."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tilespec.verify.logit_settings import LogitSettings
from tilespec.verify.sampling_rules import check_plain

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")     # a request's sampling, in SamplingParams order


MAX_LOGPROBS = 20       # top alternatives per token, as OpenAI's top_logprobs allows


@dataclass
class BatchRequest:
    """One request: ``prompt`` token ids (>= 1), at most ``max_tokens`` new tokens, its sampling parameters and seed;
    ``gamma``: cap on its draft tokens per step (0: never speculate; None or above the engine's gamma: the engine's).
    ``logits``: transforms of the target's logits (penalties, logit_bias, min_tokens: verify/logit_transforms.py;
    its ``banned`` ids are set by the engine to the request's stop ids); ``stop_token_ids``: more ids that end it
    (finish reason "stop"); ``ignore_eos``: EOS does not end it. ``logprobs``: None, or how many top alternatives
    (0-20) to report beside each emitted token's log-probability (the paged engine; raw: the target's log-softmax
    before temperature, filters and logit transforms, as vLLM reports them by default); ``prompt_logprobs``: the
    same for every prompt token after the first (its prompt is then computed, not taken from the prefix cache),
    delivered with its first event. ``grammar``: (kind, spec), the structured output its tokens must form
    (engine/paged/grammar.py: "json_object", "json_schema", "regex", "choice", "ebnf"; the paged engine only; its
    logprobs are then those of the masked logits: refused tokens have none).
    Filled in by the engine: ``rid``, ``tokens`` (new tokens), ``finish_reason`` ("stop" = EOS, "length", "cancelled"),
    ``drafted`` / ``accepted`` draft tokens, ``steps``, times of admission / first token / end (perf_counter)."""

    prompt: list
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    gamma: Optional[int] = None
    logits: Optional[LogitSettings] = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    grammar: Optional[tuple] = None
    rid: int = -1
    tokens: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    t_submit: float = 0.0
    t_first: Optional[float] = None
    t_end: Optional[float] = None
    # engine-private
    row: Optional[int] = None
    start: int = 0            # first slot of the prompt region
    done: int = 0             # prompt tokens (of the first P - 1) already in the caches
    context: object = None    # the context drafter's per-request state
    cap: int = 0              # resolved draft cap
    live: bool = False        # prefill done: the row decodes

    @property
    def sampling(self) -> tuple:
        return tuple(getattr(self, f) for f in SAMPLING_FIELDS)


@dataclass
class BatchEvent:
    """New tokens of request ``rid`` after one engine iteration; ``finish_reason`` set when it ended."""

    rid: int
    tokens: list
    finish_reason: Optional[str] = None
    logprobs: Optional[list] = None     # per token: (its log-probability, [(id, log-probability), ...] top first)
    prompt_logprobs: Optional[list] = None   # with the first event: the same for every prompt token after the first


def keep_tokens(req: BatchRequest, new: list, stops: set, now: float) -> tuple:
    """Record one step's ``new`` tokens of ``req``: those within its budget, up to and including the first stop id,
    appended to ``req.tokens`` (the step counted, the first token's time stamped with ``now``) -> (the tokens kept,
    the finish reason: "stop", "length" or None). Both engines commit through this, so they end requests alike."""
    toks, reason = new[:req.max_tokens - len(req.tokens)], None
    for j, t in enumerate(toks):
        if t in stops:
            toks, reason = toks[:j + 1], "stop"
            break
    req.tokens += toks
    req.steps += 1
    if req.t_first is None:
        req.t_first = now
    if reason is None and len(req.tokens) >= req.max_tokens:
        reason = "length"
    return toks, reason


def keep_plain(req: BatchRequest, token: int, stops: frozenset) -> bool:
    """:func:`keep_tokens`' common case, cheaply (an overlapped step commits one token per row, every step): ``token``
    kept when it is not ``req``'s first, no stop id and leaves room in its budget (True); False: nothing done, the
    caller takes :func:`keep_tokens`."""
    tokens = req.tokens
    if not tokens or token in stops or len(tokens) + 1 >= req.max_tokens:
        return False
    tokens.append(token)
    req.steps += 1
    return True


def check_request(req: BatchRequest, max_len: int, vocab: Optional[int]) -> None:
    """Raise ValueError with the reason when ``req`` cannot be served by an engine taking ``max_len`` positions (prompt
    + max_tokens) and token ids below ``vocab`` (None: unchecked): empty / too long / bad ids or values."""
    if not req.prompt:
        raise ValueError("the prompt is empty: every request needs at least one token")
    if not (isinstance(req.max_tokens, int) and req.max_tokens >= 1):
        raise ValueError(f"max_tokens must be an integer >= 1, got {req.max_tokens!r}")
    if len(req.prompt) >= max_len:
        over = len(req.prompt) - max_len
        raise ValueError(f"the prompt is {len(req.prompt)} tokens, " + (f"{over} over the context of {max_len} positions"
                         if over else f"filling the context of {max_len} positions, no room for a new token")
                         + "; shorten it")
    if len(req.prompt) + req.max_tokens > max_len:
        raise ValueError(f"the prompt has {len(req.prompt)} tokens and max_tokens is {req.max_tokens}: together "
                         f"more than this server's {max_len} positions; shorten the prompt or lower "
                         f"max_tokens to at most {max_len - len(req.prompt)}")
    if vocab is not None and not all(0 <= t < vocab for t in req.prompt):
        raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {vocab})")
    if req.gamma is not None and not (isinstance(req.gamma, int) and 0 <= req.gamma <= 32):
        raise ValueError(f"gamma must be an integer in [0, 32], got {req.gamma!r}")
    if vocab is not None and not all(isinstance(t, int) and 0 <= t < vocab for t in req.stop_token_ids):
        raise ValueError(f"stop_token_ids hold ids outside the vocabulary [0, {vocab})")
    if req.logits is not None:
        req.logits.check(vocab)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(req, name)
        if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
            raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (top alternatives per token), "
                             f"got {value!r}")
    if not -2**63 <= req.seed < 2**63:
        raise ValueError(f"seed {req.seed} does not fit int64")
    if not check_plain(*req.sampling):      # not plain numbers: the verify contract's own checks, with torch
        from tilespec.verify.types import SamplingParams
        from tilespec.verify.validation import resolve_sampling
        resolve_sampling(SamplingParams(*req.sampling), 1, "cpu")
