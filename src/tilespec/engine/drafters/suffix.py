"""``suffix``: suffix drafting (after ArcticInference's suffix decoding) with frequency counts.

Index: for every context length n in [n_min, n_max], n-gram -> Counter of the tokens that followed it, over the
request's prompt + output so far and, with ``remember=True``, the outputs of the drafter's earlier generations
(a shared index that grows as generations finish; capped at ``max_remembered`` tokens).

Proposal: walk greedily -- find the longest suffix of (history + tokens proposed so far) seen in the index, append
its most frequent continuation (ties: the one seen first), repeat; stop at ``cap`` tokens, at
``n * tokens_per_match`` tokens (n = the first match's length), when nothing matches, or when the chosen token's
share of its context's continuations falls below ``min_share``.

Reproducibility: with ``remember=True`` the drafts of a request depend on earlier generations; the output law does
not (verification is exact), and greedy outputs are unchanged, but a seeded sampled output may differ.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from .base import ContextDrafter, ContextState


def _new_index(n_max: int) -> list:
    return [dict() for _ in range(n_max + 1)]


def _add(index: list, hist: list, t: int, n_min: int, n_max: int) -> None:
    end = len(hist)
    for n in range(n_min, min(n_max, end) + 1):
        index[n].setdefault(tuple(hist[end - n:end]), Counter())[t] += 1


class SuffixState(ContextState):
    def __init__(self, drafter: "SuffixDrafter", prompts: Sequence[Sequence[int]]):
        self.d = drafter
        self.history = [[] for _ in prompts]
        self.prompt_len = [len(p) for p in prompts]
        self.index = [_new_index(drafter.n_max) for _ in prompts]
        for row, prompt in enumerate(prompts):
            self.extend(row, prompt)

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        hist = self.history[row]
        for t in tokens:
            _add(self.index[row], hist, int(t), self.d.n_min, self.d.n_max)
            hist.append(int(t))

    def _counts(self, row: int, ctx: list):
        """(n, Counter) of the longest suffix of ``ctx`` with known continuations; (0, None) when none."""
        for n in range(min(self.d.n_max, len(ctx)), self.d.n_min - 1, -1):
            gram = tuple(ctx[len(ctx) - n:])
            local = self.index[row][n].get(gram)
            shared = self.d.shared[n].get(gram) if self.d.remember else None
            if local or shared:
                return n, (local or Counter()) + (shared or Counter())
        return 0, None

    def propose(self, row: int, cap: int) -> list:
        ctx = self.history[row][-self.d.n_max:]
        first, out = 0, []
        while len(out) < cap:
            n, counts = self._counts(row, ctx)
            if n == 0:
                break
            if not out:
                first = n
                cap = min(cap, n * self.d.tokens_per_match)
            token, count = counts.most_common(1)[0]
            if count < self.d.min_share * sum(counts.values()):
                break
            out.append(token)
            ctx = ctx[1:] + [token] if len(ctx) >= self.d.n_max else ctx + [token]
        return out if first else []

    def close(self) -> None:
        if not self.d.remember:
            return
        for row, hist in enumerate(self.history):
            output = hist[self.prompt_len[row]:]
            if self.d.remembered + len(output) > self.d.max_remembered:
                return
            seen: list = []
            for t in output:
                _add(self.d.shared, seen, t, self.d.n_min, self.d.n_max)
                seen.append(t)
            self.d.remembered += len(output)


class SuffixDrafter(ContextDrafter):
    """Suffix drafting; ``remember``: also learn from earlier generations' outputs (see the module docstring)."""

    kind = "suffix"

    def __init__(self, n_min: int = 1, n_max: int = 8, *, min_share: float = 0.1, remember: bool = False,
                 max_remembered: int = 1_000_000, tokens_per_match: int = 4, fallback=None):
        super().__init__(fallback=fallback, tokens_per_match=tokens_per_match)
        if not (isinstance(n_min, int) and isinstance(n_max, int) and 1 <= n_min <= n_max):
            raise ValueError(f"need integers 1 <= n_min <= n_max, got n_min={n_min!r}, n_max={n_max!r}")
        if not 0.0 <= min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {min_share!r}")
        self.n_min, self.n_max, self.min_share = n_min, n_max, float(min_share)
        self.remember, self.max_remembered, self.remembered = bool(remember), int(max_remembered), 0
        self.shared = _new_index(n_max)

    def start(self, prompts: Sequence[Sequence[int]]) -> SuffixState:
        return SuffixState(self, prompts)
