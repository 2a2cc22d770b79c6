"""``ngram``: prompt-lookup drafting (Saxena's prompt lookup decoding; vLLM's n-gram proposer).

For each request: take the last n tokens of prompt + output (n from ``n_max`` down to ``n_min``, longest first),
find their most recent earlier occurrence in the same history, and propose the tokens that followed it.

Index (per request, per n): n-gram -> the end index e (exclusive) of its most recent occurrence whose next token
is known (e < len(history)). Appending token t at index L records the n-gram ending at L, so every append costs
O(n_max) and a lookup O(n_max): no scan of the history per step. Proposal length for a match of length n:
min(cap, n * tokens_per_match, tokens available after the occurrence).
"""
from __future__ import annotations

from typing import Sequence

from .base import ContextDrafter, ContextState


class NgramState(ContextState):
    def __init__(self, prompts: Sequence[Sequence[int]], n_min: int, n_max: int, tokens_per_match: int):
        self.n_min, self.n_max, self.per_match = n_min, n_max, tokens_per_match
        self.history = [[] for _ in prompts]
        self.index = [[{} for _ in range(n_max + 1)] for _ in prompts]
        for row, prompt in enumerate(prompts):
            self.extend(row, prompt)

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        hist, index = self.history[row], self.index[row]
        for t in tokens:
            end = len(hist)                      # the n-grams ending here now have a known next token: t
            for n in range(self.n_min, min(self.n_max, end) + 1):
                index[n][tuple(hist[end - n:end])] = end
            hist.append(int(t))

    def match(self, row: int) -> tuple[int, int]:
        """(n, e): the longest suffix n-gram with an earlier occurrence ending at e; (0, -1) when none."""
        hist, index = self.history[row], self.index[row]
        for n in range(min(self.n_max, len(hist)), self.n_min - 1, -1):
            end = index[n].get(tuple(hist[len(hist) - n:]))
            if end is not None:
                return n, end
        return 0, -1

    def propose(self, row: int, cap: int) -> list:
        n, end = self.match(row)
        if n == 0:
            return []
        return self.history[row][end:end + min(cap, n * self.per_match)]


class NgramDrafter(ContextDrafter):
    """Prompt lookup: n in [n_min, n_max]; ``fallback`` model for requests without a match (default: none)."""

    kind = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 4, *, tokens_per_match: int = 4, fallback=None):
        super().__init__(fallback=fallback, tokens_per_match=tokens_per_match)
        if not (isinstance(n_min, int) and isinstance(n_max, int) and 1 <= n_min <= n_max):
            raise ValueError(f"need integers 1 <= n_min <= n_max, got n_min={n_min!r}, n_max={n_max!r}")
        self.n_min, self.n_max = n_min, n_max

    def start(self, prompts: Sequence[Sequence[int]]) -> NgramState:
        return NgramState(prompts, self.n_min, self.n_max, self.tokens_per_match)
