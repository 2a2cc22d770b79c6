"""``ngram``: prompt-lookup drafting (Saxena's prompt lookup decoding; vLLM's n-gram proposer).

For each request: take the last n tokens of prompt + output (n from ``n_max`` down to ``n_min``, longest first),
find their most recent earlier occurrence in the same history, and propose the tokens that followed it.

Index (per request, per n): n-gram -> the end index e (exclusive) of its most recent occurrence whose next token
is known (e < len(history)). Appending only stores the tokens; a lookup first indexes the n-grams ending at the
positions appended since the last one (O(n_max) each), so a request that is not proposing (the paged engine's
draft gate off) costs one append per token, and a lookup O(n_max): no scan of the history per step. Proposal length for a match of length n:
min(cap, n * tokens_per_match, tokens available after the occurrence).

An n-gram's key is one integer, its ids packed KEY_BITS apart: integers are not tracked by the garbage collector,
tuples are, and at 256 requests the tuples' churn made collections cost 4x the indexing itself.
"""
from __future__ import annotations

from typing import Sequence

from .base import ContextDrafter, ContextState

KEY_BITS = 32          # token ids are below 2**32


class NgramState(ContextState):
    def __init__(self, prompts: Sequence[Sequence[int]], n_min: int, n_max: int, tokens_per_match: int):
        self.n_min, self.n_max, self.per_match = n_min, n_max, tokens_per_match
        self.history = [[int(t) for t in prompt] for prompt in prompts]
        self.index = [[{} for _ in range(n_max + 1)] for _ in prompts]
        self.indexed = [0] * len(prompts)    # positions whose n-grams (ending there) are in the index

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        self.history[row] += tokens if isinstance(tokens, list) else map(int, tokens)   # engines pass int lists

    def _catch_up(self, row: int) -> None:
        """Index the n-grams ending at every position appended since the last lookup (their next token is known)."""
        hist, index, lo, hi = self.history[row], self.index[row], self.n_min, self.n_max
        for end in range(self.indexed[row], len(hist)):
            key, shift = 0, 0
            for n in range(1, min(hi, end) + 1):  # keys of the suffixes, shortest first: key_n = id << .. | key_n-1
                key |= hist[end - n] << shift
                shift += KEY_BITS
                if n >= lo:
                    index[n][key] = end
        self.indexed[row] = len(hist)

    def match(self, row: int) -> tuple[int, int]:
        """(n, e): the longest suffix n-gram with an earlier occurrence ending at e; (0, -1) when none."""
        self._catch_up(row)
        hist, index = self.history[row], self.index[row]
        end, best, key, shift = len(hist), (0, -1), 0, 0
        for n in range(1, min(self.n_max, end) + 1):
            key |= hist[end - n] << shift
            shift += KEY_BITS
            if n >= self.n_min:
                hit = index[n].get(key)
                if hit is not None:
                    best = (n, hit)
        return best

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
