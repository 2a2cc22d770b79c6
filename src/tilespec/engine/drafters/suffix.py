"""``suffix``: suffix drafting (after ArcticInference's suffix decoding) with frequency counts.

Counts: for every context length n in [n_min, n_max], n-gram -> Counter of the tokens that followed it, over the
request's prompt + output so far (found by a scan of its history when it proposes: :class:`SuffixState`) and, with
``remember=True``, the outputs of the drafter's earlier generations (a shared index that grows as generations
finish; capped at ``max_remembered`` tokens).

Proposal: walk greedily -- find the longest suffix of (history + tokens proposed so far) seen in them, append
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
from .occurrences import history, longest_suffix, scanned


def _new_index(n_max: int) -> list:
    return [dict() for _ in range(n_max + 1)]


def _add(index: list, hist: list, t: int, n_min: int, n_max: int) -> None:
    end = len(hist)
    for n in range(n_min, min(n_max, end) + 1):
        index[n].setdefault(tuple(hist[end - n:end]), Counter())[t] += 1


class SuffixState(ContextState):
    """No index of its own: each proposal step finds the context's longest earlier suffix by one scan of the history
    (occurrences.py) and counts what followed it there, the Counter an index would hold (keys in the order first
    seen), so appending a token costs an append (an index cost ~15 us a token, a request's start ~5 ms)."""

    def __init__(self, drafter: "SuffixDrafter", prompts: Sequence[Sequence[int]]):
        self.d = drafter
        self.history = [history(prompt) for prompt in prompts]
        self.prompt_len = [len(p) for p in prompts]

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        self.history[row].extend(tokens)

    def _counts(self, h, hist, ctx: list):
        """(n, Counter) of the longest suffix of ``ctx`` with known continuations in the history ``h`` (or the shared
        index); (0, None) when none."""
        top = min(self.d.n_max, len(ctx))
        n_local, ends = longest_suffix(h, hist, ctx, top)
        for n in range(top, max(n_local, self.d.n_min - 1), -1):     # longer than any local match: shared only
            shared = self.d.shared[n].get(tuple(ctx[len(ctx) - n:])) if self.d.remember else None
            if shared:
                return n, Counter() + shared
        if n_local < self.d.n_min:
            return 0, None
        local = Counter([hist[e] for e in ends])
        shared = self.d.shared[n_local].get(tuple(ctx[len(ctx) - n_local:])) if self.d.remember else None
        return n_local, local + shared if shared else local

    def propose(self, row: int, cap: int) -> list:
        hist = self.history[row]
        h, ctx = scanned(hist), hist[-self.d.n_max:].tolist()
        first, out = 0, []
        while len(out) < cap:
            n, counts = self._counts(h, hist, ctx)
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
