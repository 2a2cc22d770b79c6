"""Where the tokens at the end of a context occurred earlier in a request's history: one numpy scan, no index.

The context drafters (ngram.py, suffix.py) keep a request's history as an ``array('q')`` (appends are C-level, and
numpy reads it in one copy), so a request that is not proposing costs one append per token. Their proposals come
from :func:`longest_suffix`: O(history) compares in C and O(matches) after, ~5-20 us per request however long
ago it was last asked. The paged engine's draft gate leaves a drafter off for long stretches at high load and asks
every request at once when it explores: an index caught up there cost 1-2 us per token per request in Python (at
256 rows of 300 tokens, ~100 ms for one step), the scan ~3 ms.
"""
from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np

FEW = 16               # candidates below which the rest of a match is extended in Python


def history(tokens: Sequence[int]) -> array:
    """A history buffer holding ``tokens`` (ints, or anything with ``__index__``: numpy or 0-d torch integers)."""
    return array("q", tokens)


def scanned(hist: array) -> np.ndarray:
    """The history as numpy, copied (a view would keep the array from growing while it lives)."""
    return np.array(hist)


def longest_suffix(h: np.ndarray, hist: array, query: Sequence[int], n_max: int) -> tuple:
    """(n, ends): the longest n <= n_max such that ``query``'s last n tokens occur in the history (``hist``, and ``h``
    its :func:`scanned` copy) ending at some e with n <= e < len(hist) (the token after them is known), and every
    such e, ascending (a list); (0, []) when none."""
    size, top = len(hist), min(n_max, len(query), len(hist) - 1)
    if top < 1:
        return 0, []
    ends, n = np.flatnonzero(h[:size - 1] == query[-1]) + 1, 1
    while len(ends) > FEW and n < top:      # each longer match is one of the shorter's ends
        longer = ends[ends > n]
        longer = longer[h[longer - n - 1] == query[-n - 1]]
        if not len(longer):
            return n, ends.tolist()
        n, ends = n + 1, longer
    ends = ends.tolist()
    if not ends or n == top:
        return (n if ends else 0), ends
    lengths = []
    for e in ends:                          # few candidates left: numpy's per-call cost would dominate
        m, most = n, min(top, e)
        while m < most and hist[e - m - 1] == query[-m - 1]:
            m += 1
        lengths.append(m)
    n = max(lengths)
    return n, [e for e, m in zip(ends, lengths) if m == n]
