"""Token trees from the request's own context: several n-gram matches as branches (deterministic drafts).

For each request: the last n tokens of prompt + output (n from ``n_max`` down to ``n_min``, longest first) are looked
up at every earlier position of the history, most recent first; the tokens that followed each occurrence (up to
``length``) are the candidate continuations, at most ``matches`` distinct ones, longer matches first. The
continuations are merged into a trie rooted at the pending token (shared prefixes become one path), nodes in
insertion order (parents first), at most ``nodes`` nodes. A request without a match gets the root alone (its step
decodes one token). Host-side, O(history) per request and step.

:class:`ContextTreeDrafter` (the tree form of a ContextDrafter without a model, ``draft="ngram"``) hands out a
:class:`ContextTreeRunner`: it keeps every request's history (prompt from the prefill, emitted tokens from
``observe``, read on the host next to the step's own host read) and proposes these tries as tree proposals (host-commit
path: the trees are built on the host).
"""
from __future__ import annotations

from typing import Sequence

import torch

from tilespec.multidraft.tree import TokenTree

from .base import ContextDrafter, Drafter
from .contract import DraftRunner, Proposal
from .trees import capped, no_trees, tree_form


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


class ContextTreeRunner(DraftRunner):
    """Per-generation histories and context trees of ``shape.tree`` = (matches, length, nodes)."""

    observes = True
    captures = False

    def __init__(self, shape):
        self.shape = shape
        self.histories: list = []

    def span(self, gamma: int) -> int:
        return max(self.shape.nodes, self.shape.depth + 1)

    def prefill(self, ids, positions, mask, features, short: bool):
        real = torch.cat([mask[:, 0, -1, :ids.shape[1] - 1], torch.ones_like(ids[:, :1], dtype=torch.bool)], dim=1)
        self.histories = [row[keep].tolist() for row, keep in zip(ids.cpu(), real.cpu())]
        return None

    def propose(self, view, gamma: int, resolved, greedy: bool, ex) -> Proposal:
        matches, length, nodes = self.shape.tree
        tree = context_trees(self.histories, matches, length, nodes, view.pending.device)
        return capped(Proposal.of_tree(tree, sampler=self.shape.sampler), gamma, length)

    def observe(self, view, features, out_tokens, num_emitted, ex):
        host = torch.cat([num_emitted[:, None], out_tokens], dim=1).tolist()
        for hist, (n, *toks) in zip(self.histories, host):
            hist.extend(toks[:n])
        return None

    def select(self, rows: torch.Tensor, slot_index: torch.Tensor) -> None:
        self.histories = [self.histories[i] for i in rows.tolist()]


class ContextTreeDrafter(Drafter):
    """A context drafter (``base``, no model) proposing several of its matches as a tree of ``shape``."""

    def __init__(self, base, shape):
        self.base, self.shape = base, shape
        self.name = "%s:tree-%d-%d-%d" % (base.name, *shape.tree)

    def span(self, gamma: int) -> int:
        return max(self.shape.nodes, self.shape.depth + 1)

    def runner(self, batch: int, capacity: int, *, target, compile=None) -> ContextTreeRunner:
        return ContextTreeRunner(self.shape)


@tree_form(ContextDrafter)
def context_tree(drafter: ContextDrafter, shape) -> ContextTreeDrafter:
    if drafter.model is not None:
        raise no_trees(drafter)
    if shape.chains is not None:
        raise ValueError("context trees are deterministic drafts: use tree=(matches, length, nodes), not chains")
    return ContextTreeDrafter(drafter, shape)
