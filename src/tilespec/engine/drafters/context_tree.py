"""Token trees from the request's own context: several n-gram matches as branches (deterministic drafts).

For each request: the last n tokens of prompt + output (n from ``n_max`` down to ``n_min``, longest first) are looked
up at every earlier position of the history, most recent first; the tokens that followed each occurrence (up to
``length``) are the candidate continuations, at most ``matches`` distinct ones, longer matches first. The
continuations are merged into a trie rooted at the pending token (shared prefixes become one path), nodes in
insertion order (parents first), at most ``nodes`` nodes. A request without a match gets the root alone (its step
decodes one token). Host-side, O(history) per request and step.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tilespec.multidraft.tree import TokenTree


def continuations(history: Sequence[int], matches: int, length: int, n_min: int = 1, n_max: int = 4) -> list:
    """Up to ``matches`` distinct continuations (lists of <= ``length`` tokens) of the history's suffix."""
    hist = list(history)
    found, seen = [], set()
    for n in range(min(n_max, len(hist) - 1), n_min - 1, -1):
        suffix = hist[len(hist) - n:]
        for end in range(len(hist) - 1, n - 1, -1):          # occurrence hist[end - n:end], next token at end
            if hist[end - n:end] == suffix:
                cont = tuple(hist[end:end + length])
                if cont and cont not in seen:
                    seen.add(cont)
                    found.append(list(cont))
                    if len(found) == matches:
                        return found
    return found


def trie(pending: int, branches: Sequence[Sequence[int]], nodes: int) -> tuple[list, list]:
    """(parents, tokens) of the trie of ``branches`` under the root ``pending``, at most ``nodes`` nodes."""
    parents, tokens, child = [-1], [int(pending)], {}
    for branch in branches:
        at = 0
        for tok in branch:
            nxt = child.get((at, tok))
            if nxt is None:
                if len(tokens) == nodes:
                    break
                nxt = len(tokens)
                parents.append(at)
                tokens.append(int(tok))
                child[at, tok] = nxt
            at = nxt
    return parents, tokens


def context_trees(histories: Sequence[Sequence[int]], matches: int, length: int, nodes: int, device) -> TokenTree:
    """A distinct :class:`TokenTree` [B, nodes] (padded) from every request's history (ending with its pending
    token)."""
    b = len(histories)
    parents = torch.full((b, nodes), -1, dtype=torch.int64)
    tokens = torch.zeros((b, nodes), dtype=torch.int64)
    sizes = torch.ones(b, dtype=torch.int64)
    for i, hist in enumerate(histories):
        par, tok = trie(hist[-1], continuations(hist, matches, length), nodes)
        parents[i, :len(par)] = torch.tensor(par)
        tokens[i, :len(tok)] = torch.tensor(tok)
        sizes[i] = len(tok)
    return TokenTree(parents=parents.to(device), tokens=tokens.to(device), sizes=sizes.to(device))
