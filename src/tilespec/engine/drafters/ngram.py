"""``ngram``: prompt-lookup drafting (Saxena's prompt lookup decoding; vLLM's n-gram proposer).

For each request: take the last n tokens of prompt + output (n from ``n_max`` down to ``n_min``, longest first),
find their most recent earlier occurrence in the same history, and propose the tokens that followed it. Proposal
length for a match of length n: min(cap, n * tokens_per_match, tokens available after the occurrence).

Two ways to the same match, picked per request and lookup by how it is being asked:
  * a request asked steadily (its last lookup at most RECENT tokens ago: the drafter runs every step) keeps an index,
    per n, n-gram -> the end e (exclusive) of its most recent occurrence whose next token is known (e < len); each
    lookup indexes at most CATCH_UP of the positions appended since (O(n_max) each), then is O(n_max) when caught up;
  * any other lookup (a request's first, or the paged engine's draft gate exploring after a stretch off) scans the
    history instead (occurrences.py): O(history) in C, no Python work per token it has not seen.
So appending stores the tokens and nothing else, and no step pays to index a stretch of history at once (at 256
rows an exploring step that caught up every request's prompt cost ~100 ms). Both give the eager index's match.

An n-gram's key is one integer, its ids packed KEY_BITS apart: integers are not tracked by the garbage collector,
tuples are, and at 256 requests the tuples' churn made collections cost 4x the indexing itself.
"""
from __future__ import annotations

from typing import Sequence

from .base import ContextDrafter, ContextState
from .occurrences import history, longest_suffix, scanned

KEY_BITS = 32          # token ids are below 2**32
RECENT = 8             # a lookup this few tokens after the last one keeps the index (the drafter runs steadily)
CATCH_UP = 64          # positions indexed per lookup at most (~80 us): a long backlog is caught up over a few steps


class NgramState(ContextState):
    def __init__(self, prompts: Sequence[Sequence[int]], n_min: int, n_max: int, tokens_per_match: int):
        self.n_min, self.n_max, self.per_match = n_min, n_max, tokens_per_match
        self.history = [history(prompt) for prompt in prompts]
        self.index = [[{} for _ in range(n_max + 1)] for _ in prompts]
        self.indexed = [0] * len(prompts)    # positions whose n-grams (ending there) are in the index
        self.asked = [-RECENT - 1] * len(prompts)    # history length at the last lookup

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        self.history[row].extend(tokens)

    def _catch_up(self, row: int, most: int) -> None:
        """Index the n-grams ending at up to ``most`` positions appended since the last (their next token is known)."""
        hist, index, lo, hi = self.history[row], self.index[row], self.n_min, self.n_max
        stop = min(len(hist), self.indexed[row] + most)
        for end in range(self.indexed[row], stop):
            key, shift = 0, 0
            for n in range(1, min(hi, end) + 1):  # keys of the suffixes, shortest first: key_n = id << .. | key_n-1
                key |= hist[end - n] << shift
                shift += KEY_BITS
                if n >= lo:
                    index[n][key] = end
        self.indexed[row] = stop

    def match(self, row: int) -> tuple[int, int]:
        """(n, e): the longest suffix n-gram with an earlier occurrence ending at e; (0, -1) when none."""
        hist = self.history[row]
        end = len(hist)
        if end - self.asked[row] <= RECENT and self.indexed[row] < end:
            self._catch_up(row, CATCH_UP)
        self.asked[row] = end
        if self.indexed[row] < end:
            n, ends = longest_suffix(scanned(hist), hist, hist[-self.n_max:], self.n_max)
            return (n, ends[-1]) if n >= self.n_min else (0, -1)
        index, best, key, shift = self.index[row], (0, -1), 0, 0
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
        return self.history[row][end:end + min(cap, n * self.per_match)].tolist()


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
