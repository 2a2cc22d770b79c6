"""Who runs in a step of the paged engine, and with how many tokens.

A request is a :class:`Seq`: its tokens (prompt, then emitted tokens), ``computed`` (how many of them have their K/V
in the cache), its block table and the prefix keys of its sealed blocks. Every step feeds each scheduled request the
tokens ``tokens[computed : computed + n]``; when that reaches its last token the request also feeds its drafts and
its logits are verified (it *samples*). So prefill, chunked prefill, decode, speculative verify and recompute after
preemption are one operation: a decode is a request with ``len(tokens) - computed == 1``.

Per step (vLLM v1's policy, simplified):
  1. Running requests in arrival order: a decoding one costs 1 + its drafts, a prefilling one the next chunk of its
     prompt. Blocks are grown to cover what it will write. When blocks run out: drop its drafts first, then preempt
     the newest running request (its blocks are released; it waits at the front of the queue and recomputes later,
     with its sealed prefix usually still cached), never failing a request that fits the cache.
  2. Waiting requests are admitted (prefix-cache lookup first) while the step's token budget, ``max_seqs`` and the
     free blocks allow (one whose prompt a running request is still prefilling waits for its blocks instead); a prompt larger than the remaining budget is prefilled in chunks over several steps, in the
     same forwards as the decoding requests (chunked prefill: no step ever waits for a whole prompt).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from .blocks import BlockManager


@dataclass(eq=False)
class Seq:
    """One request in the engine. ``req``: the caller's record (engine/batch_request.BatchRequest); ``tokens``: prompt
    + emitted tokens; ``drafts``: this step's draft tokens (set by the engine before scheduling; the scheduler may
    drop them); ``context``: its context drafter state (a draft model's: draft_model.DraftState) or None."""

    req: object
    tokens: list
    order: int
    computed: int = 0
    table: list = field(default_factory=list)
    keys: list = field(default_factory=list)
    drafts: list = field(default_factory=list)
    context: object = None
    acceptance: object = None         # its draft acceptance counts (pricing.Acceptance.new_request)
    told: int = 0                     # its tokens that ``context`` holds (the rest are given it when it proposes)
    stops: frozenset = frozenset()    # the ids that end it (EOS unless ignored, its stop_token_ids)
    preemptions: int = 0
    pending: int = 0                  # its tokens still in flight (placeholders at the end of tokens: overlap.py)
    held: bool = False                # its last token is in flight: it is not scheduled again
    prompt_key: int = 0               # hash of its prompt (0: none): requests with one prompt prefill it once
    cacheable: bool = True            # its prompt may come from the prefix cache (not when its logprobs are wanted)
    prompt_lps: Optional[list] = None  # its prompt tokens' logprobs so far, when the request asked for them
    matcher: object = None            # its grammar's matcher (grammar.py), when it has one
    plain: bool = True                # its tokens need nothing but the device (overlap.plain), fixed at submit

    def propose(self, cap: int) -> list:
        """Up to ``cap`` context drafts. Its drafter state gets the tokens it lacks here, not at every commit, so a
        drafter the gate keeps off costs nothing per token; they are all committed by then (a drafting step lands
        the step in flight first, overlap.blocked)."""
        if self.told < len(self.tokens):
            self.context.extend(0, self.tokens[self.told:])
            self.told = len(self.tokens)
        return self.context.propose(0, cap)

    @property
    def remaining(self) -> int:
        """Tokens not yet in the cache (>= 1 while the request runs: the last emitted token is fed next step)."""
        return len(self.tokens) - self.computed

    @property
    def decoding(self) -> bool:
        return self.remaining == 1

    def sealable(self, n: int) -> int:
        """How many leading positions may be sealed into the prefix cache: ``n``, within those a draft model's
        cache holds too (its context's ``draft_len``, engine/paged/draft_model.py), so a hit serves both."""
        draft_len = getattr(self.context, "draft_len", None)
        return n if draft_len is None else min(n, draft_len(self.tokens))


class Item:
    """One request's part of a step: it feeds ``tokens[start : start + n]`` (+ its drafts when it ``samples``: the
    fed tokens reach its last one, fixed when the step is scheduled). A slotted class, not a dataclass: a step
    builds one per running request, and at 256 rows the dataclass's init was a visible share of the host's step."""

    __slots__ = ("seq", "start", "n", "samples")

    def __init__(self, seq: Seq, start: int, n: int):
        self.seq, self.start, self.n = seq, start, n
        self.samples = start + n == len(seq.tokens)

    @property
    def width(self) -> int:
        """Tokens this item puts through the forward."""
        return self.n + (len(self.seq.drafts) if self.samples else 0)

    def __repr__(self) -> str:
        return f"Item(rid={getattr(self.seq.req, 'rid', None)}, start={self.start}, n={self.n}, samples={self.samples})"


class Scheduler:
    """Waiting queue + running list over a :class:`BlockManager` (see the module docstring).

    ``token_budget``: tokens per step (decode rows with their drafts, plus prefill chunks); ``max_seqs``: running
    requests at most (the largest decode batch)."""

    def __init__(self, blocks: BlockManager, *, token_budget: int = 2048, max_seqs: int = 256,
                 watermark: float = 0.01):
        if token_budget < 1 or max_seqs < 1:
            raise ValueError(f"token_budget and max_seqs must be >= 1, got {token_budget}, {max_seqs}")
        self.blocks, self.token_budget, self.max_seqs = blocks, token_budget, max_seqs
        self.watermark = max(1, int(watermark * blocks.num_blocks))
        self.waiting: deque = deque()
        self.running: list = []
        self.preemptions = 0

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Seq) -> None:
        """The request ended or was cancelled: release its blocks (sealed ones stay cached)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.table, seq.keys)

    def preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.table, seq.keys)
        seq.computed, seq.drafts = 0, []
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self, admit: bool = True) -> list:
        """The step's items (see the module docstring); may preempt. Empty when nothing can run. ``admit`` False:
        no waiting request joins this step (the engine coalesces prefills, admission.py)."""
        budget, items, preempted = self.token_budget, [], self.preemptions
        for seq in list(self.running):
            if self.preemptions != preempted and seq not in self.running:    # preempted for an earlier request
                continue
            item = self._running_item(seq, budget)
            if item is not None:
                items.append(item)
                budget -= item.width
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            if self._twin_prefilling(self.waiting[0]):
                break                            # it waits a step or two, then reuses its twin's prompt blocks
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            self.running.append(self.waiting.popleft())
            items.append(item)
            budget -= item.width
        return items

    def _running_item(self, seq: Seq, budget: int) -> Optional[Item]:
        if budget <= 0 or seq.held:
            if seq.drafts:
                seq.drafts = []
            return None
        computed, remaining = seq.computed, len(seq.tokens) - seq.computed
        n = min(remaining, budget)
        if seq.drafts and (remaining != 1 or n + len(seq.drafts) > budget):
            seq.drafts = []
        need = computed + n + (len(seq.drafts) if n == remaining else 0)
        if need <= len(seq.table) * self.blocks.block_size:     # most steps: its blocks hold it already
            return Item(seq, computed, n)
        while not self.blocks.grow(seq.table, need):
            if seq.drafts:
                seq.drafts, need = [], computed + n
                continue
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return None
        return Item(seq, computed, n)

    def _twin_prefilling(self, seq: Seq) -> bool:
        """Whether a running request with the same prompt (n choices of one request, or repeats) is still prefilling
        it: admitted now, this one would compute the prompt again instead of finding its blocks in the prefix cache."""
        key = seq.prompt_key
        if not key or not seq.cacheable or not self.blocks.prefix_caching or len(seq.req.prompt) <= self.blocks.block_size:
            return False
        return any(other.prompt_key == key and other.computed < len(other.req.prompt) and
                   other.req.prompt == seq.req.prompt for other in self.running)

    def _admit(self, seq: Seq, budget: int) -> Optional[Item]:
        seq.drafts = []
        if not seq.table:
            seq.computed = self.blocks.match_prefix(seq.tokens, seq.table, seq.keys) if seq.cacheable else 0
        reserve = self.watermark if self.running else 0     # room for the running requests' next tokens
        room = (len(seq.table) + self.blocks.num_free - reserve) * self.blocks.block_size - seq.computed
        n = min(seq.remaining, budget, room)
        if n < 1 or not self.blocks.grow(seq.table, seq.computed + n):
            self.blocks.release(seq.table, seq.keys)       # a waiting request holds no block
            seq.computed = 0
            return None
        return Item(seq, seq.computed, n)
