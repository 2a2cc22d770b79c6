"""Overlapped decode steps: the host plans and launches step N + 1 while the device still runs step N.

A decode step without drafts emits exactly one token per request, so everything the next step needs but that token
is known before it is drawn: each request's position, cache slot, block table, seed offset, and whether its length
budget ends it. The engine therefore launches such a step and returns without waiting: each request gets a
*placeholder* token (``-(row + 1)``, a reference to its row of the step's sampled tokens on the device), the step's
tokens are copied to pinned host memory behind it on the stream, and the next call plans the next step with the
placeholders, launches it (the placeholders replaced on the device, :func:`resolve`), and only then waits for step
N's tokens and commits them (stops, events, prefix sealing) while the device runs step N + 1. The host's
per-request work, the step's largest cost at many rows, leaves the device's critical path. SGLang's overlap scheduler
and vLLM's async scheduling do the same.

A step that admits waiting requests or carries prompt chunks is planned and launched the same way: its chunks'
tokens are the prompts', and its decode rows' placeholders are resolved as above; it is left in flight too (each
request whose prompt ends there gets a placeholder for its first token), so arrivals under load no longer stop the
pipeline. What stays synchronous (the engine drains the step in flight first, :func:`blocked`): a step that drafts
(drafts come from the request's own tokens), whose requests (running or joining) ask for logprobs, prompt logprobs or
transform their logits with their own history (penalties), or that might need blocks it cannot have without
preempting (admission only takes free blocks, never preempts). A request that ends on a stop token while the next step is in flight has fed one more token than it
needed: its output is dropped and its blocks are released at commit; the device writes of the step in flight are
ordered before any later step's on the one stream, so released blocks are reused safely. Tokens are those of the
synchronous engine: the same inputs, seeds and positions (tests/test_paged_overlap.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Sample:
    """What a step's wall time is a sample of: a mixed step (admission.py's averages) or a decode step of ``shape``
    (pricing.StepCosts), with the draft gate's decision for it and the tokens it made."""

    mixed: bool
    shape: tuple
    gated: Optional[tuple] = None
    made: int = 0
    started: float = 0.0        # when its device time began (host clock), for a drain that lands it


@dataclass
class InFlight:
    """A launched decode step whose tokens are not yet on the host: its sampling items (row order), each row's
    sampled token on the device, their pinned host copy and the event that marks it done (None on CPU)."""

    items: list
    tokens: torch.Tensor
    host: torch.Tensor
    done: Optional[torch.cuda.Event]
    sample: Optional[Sample] = None

    @classmethod
    def launch(cls, items: list, output_tokens: torch.Tensor) -> "InFlight":
        """Start the host copy of ``output_tokens[:, 0]`` (verify's output without drafts) behind the step."""
        tokens = output_tokens[:, 0]
        if tokens.device.type != "cuda":
            return cls(items, tokens, tokens[:len(items)].clone(), None)
        host = torch.empty(len(items), dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens[:len(items)], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(items, tokens, host, done)

    def wait(self) -> list:
        """The step's tokens, one per item (blocks until the device has them)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def placeholder(row: int) -> int:
    return -(row + 1)


def resolve(ids: torch.Tensor, previous: InFlight) -> None:
    """Replace, in place on the device, every placeholder in ``ids`` by the token the step in flight drew for that
    row (no host round trip)."""
    rows = (-ids - 1).clamp_(min=0)
    ids.copy_(torch.where(ids < 0, previous.tokens.index_select(0, rows), ids))


def blocked(engine, drafting: bool, admits: bool) -> Optional[str]:
    """Why the next step cannot be planned before the step in flight commits (None: it can): see the module
    docstring. ``drafting``: the draft gate runs the drafter this step; ``admits``: waiting requests may join it."""
    running = engine.scheduler.running
    if drafting and any(seq.context is not None and seq.req.cap > 0 for seq in running):
        return "drafts"
    if admits and any(not seq.plain or seq.prompt_lps is not None for seq in engine.scheduler.waiting):
        return "admission"
    if engine.blocks.num_free < len(running):
        return "blocks"
    if any(not seq.plain or seq.prompt_lps is not None for seq in running):
        return "request"
    return None


def plain(req) -> bool:
    """Whether ``req``'s next token needs nothing but the device: no logprobs, grammar or history-dependent
    transforms."""
    return req.logprobs is None and req.grammar is None and (req.logits is None or not req.logits.active)
