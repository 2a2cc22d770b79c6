"""A trained head's token trees (drafters/head_tree.py) on the paged engine: EAGLE-2-style dynamic trees and K sampled
chains.

Per step, for the decoding requests the head drafts for (L = len(tokens), t_{L-1} pending):
  * the head's catch-up (head.py: entries [base, L - 2] in one ragged paged forward) gives h at the last committed
    entry, the law of draft depth 1;
  * the tree grows as the decoder's does (drafters/head_tree.propose_tree: the top-k children of each frontier node,
    the k best by path score as the next frontier, the N - 1 best candidates re-ranked into a tree; or
    propose_chains: each chain's next token sampled from the head's processed law, the request's sampling or the
    shape's ``draft_sampling``, noise keyed by (seed + chain stride, position): batch-independent). Its frontier
    entries live in the request's own blocks of the paged head cache, frontier slot s (depth s // k + 1) at key
    L - 1 + s, RoPE position L - 2 + depth: the slots past the committed entries, which the next catch-up
    overwrites with the real ones. The forward at depth t feeds every frontier entry so far, t k rows per request,
    as the request's new tokens with their ancestor bitmasks (attention.py's ``tree_mask``: an entry sees the
    committed entries, its ancestors and itself); the earlier frontiers' entries are recomputed (the same K/V), so
    one call's new tokens cover every ancestor: (depth - 1) k <= 64. The request offers max(N - 1, (depth - 1) k)
    placeholder drafts, so the scheduler grows blocks for the frontiers too;
  * one host copy brings the trees to the host; a request allowed a shallower tree (near its token limit) keeps the
    nodes within its depth, in their (topological) order (sampled chains: a prefix, level by level).
The tree is then the request's new tokens like a context tree's (tree.py): the target writes every node's K/V and
head feature, select_tree picks the accepted path (dynamic trees: distinct drafts, exact at every temperature, no
draft law; chains: kind "iid" with each node's draft law, the shape's multi-draft scheme), and the compaction moves
both of the target's caches' path entries, so the next catch-up reads the path's features in place.
"""
from __future__ import annotations

import torch

from tilespec.verify.validation import resolve_sampling

from ..drafters.head_tree import HeadTreeDrafter, propose_chains, propose_tree
from ..drafters.trees import draft_resolved
from .draft_model import PLACEHOLDER
from .head import HeadState, PagedHead
from .layout import Fed, mixed_inputs
from .tree import TreeVerify
from .verify_rows import sampling_params


def is_head_tree(drafter) -> bool:
    """Whether ``drafter`` is a head's token tree: a dynamic tree (``tree=(branch, depth, nodes)``) or sampled
    chains (``chains=(K, L)``)."""
    return isinstance(drafter, HeadTreeDrafter)


class HeadTreeState(HeadState):
    """A request's head state when the head drafts trees: the placeholders it offers (``slots``: every node, every
    frontier entry), the depth it may accept this step (``cap``), its tree's parents (node 0's -1 first) and, for
    sampled chains, each node's draft law (``probs``; both set by :meth:`PagedHeadTrees.run`)."""

    def __init__(self, length: int, slots: int):
        super().__init__(length)
        self.slots, self.cap, self.parents, self.probs = slots, 0, [-1], None

    def propose(self, row: int, cap: int) -> list:
        """Placeholders (the scheduler grows blocks for them), none before a target feature exists."""
        self.model, self.cap = True, cap
        return [PLACEHOLDER] * self.slots if self.length >= 2 else []


class _Frontiers:
    """What propose_tree / propose_chains drive as the head's runner (``entries``) over the paged head cache: each
    call is one frontier of k entries per request at the next depth (module docstring). The masks they hand in are
    over the frontier slots alone (``valid`` all False, W = 0): row j's ancestors among slots [0, t k)."""

    def __init__(self, runner: "PagedHeadTrees", seqs: list):
        self.runner, self.head, self.seqs = runner, runner.head, seqs
        self.feats, self.tokens, self.bits = [], [], []         # per depth: [B, k, d], [B, k], [B, k] int64

    def entries(self, feat, tokens, positions, mask, write_pos):
        run, (b, k), t = self.runner, tokens.shape, len(self.feats) + 1
        powers = torch.ones((), dtype=torch.int64, device=tokens.device) << torch.arange(t * k, device=tokens.device)
        self.bits.append((mask[:, 0, :, :t * k].long() * powers).sum(-1))        # signed int64 bit patterns
        self.feats.append(feat)
        self.tokens.append(tokens)
        feeds = [Fed([run.pad] * (t * k), len(s.tokens) - 1, [run._slot(s, len(s.tokens) - 1 + j) for j in range(t * k)],
                     s.table, positions=[len(s.tokens) - 1 + j // k for j in range(t * k)], masks=[-1] * (t * k))
                 for s in self.seqs]
        inputs = mixed_inputs(feeds, 1, device=run.device, pad_id=run.pad, block_size=run.block_size)
        inputs.tokens.copy_(torch.cat(self.tokens, dim=1).reshape(-1))        # request-major, depth by depth
        inputs.tree_mask = torch.cat(self.bits, dim=1).reshape(-1)
        h = run.entries(torch.cat(self.feats, dim=1).reshape(b * t * k, -1), inputs)
        return h.view(b, t * k, -1)[:, (t - 1) * k:]


class PagedHeadTrees(TreeVerify, PagedHead):
    """The trained head of a :class:`~.engine.PagedEngine` drafting token trees (see the module docstring)."""

    def __init__(self, engine, drafter: HeadTreeDrafter):
        PagedHead.__init__(self, engine, drafter.base)
        shape = self.shape = drafter.shape
        self.engine, self.sampler, self.depth, self.nodes = engine, shape.sampler, shape.depth, shape.nodes
        if shape.chains is not None:        # K chains of L: an iid tree, its level width K
            self.width, self.depth = shape.chains
            self.kind, self.scheme, self.identical = "iid", shape.scheme, shape.identical
        else:
            self.branch = shape.tree[0]
        self.frontier = self.width if self.kind == "iid" else self.branch
        if (self.depth - 1) * self.frontier > 64:
            raise ValueError(f"a head's tree of {self.depth - 1} frontiers of {self.frontier} entries needs more "
                             f"than the 64 ancestor bits of the paged attention: lower depth or branch")

    def start(self, prompts) -> HeadTreeState:
        return HeadTreeState(len(prompts[0]), max(self.nodes - 1, (self.depth - 1) * self.frontier))

    @torch.inference_mode()
    def run(self, items: list, sampling: list, prev=None) -> None:
        """Fill every drafting row's ``seq.drafts`` with its tree's node tokens, ``context.parents`` with their
        parents (sampled chains: ``context.probs`` with their draft laws, which tree.py's verify reads); returns no
        chain draft law (verify() gets none: the tree rows are selected by select_tree)."""
        seqs = []
        for it in items:
            it.seq.context.admitted(it.seq.preemptions)
            if it.samples and it.seq.drafts:
                seqs.append(it.seq)
        if not seqs:
            return None
        tree = self._grow(seqs, self._catch_up(seqs, prev))
        n = tree.parents.shape[1]
        for b, (seq, row) in enumerate(zip(seqs, torch.cat([tree.parents, tree.tokens], dim=1).tolist())):
            parents, tokens = within_depth(row[:n], row[n:], seq.context.cap)
            seq.context.parents, seq.drafts[:] = parents, tokens[1:]
            if tree.draft_probs is not None:        # chains: level t's nodes follow level t - 1's, a prefix
                seq.context.probs = tree.draft_probs[b, :len(tokens)]
        return None

    def _grow(self, seqs: list, hidden: torch.Tensor):
        """propose_tree (propose_chains) from ``hidden`` [B, d] over the paged head cache (:class:`_Frontiers`)."""
        dev, b = self.device, len(seqs)
        slots = max((self.depth - 1) * self.frontier, 1)
        valid = torch.zeros((b, slots), dtype=torch.bool, device=dev)     # the masks: frontier slots only
        write = torch.zeros((), dtype=torch.int64, device=dev)
        seq_len = torch.tensor([len(s.tokens) for s in seqs], device=dev)
        pending = torch.tensor([s.tokens[-1] for s in seqs], device=dev)
        frontiers = _Frontiers(self, seqs)
        if self.kind == "iid":
            reqs, seeds = [s.req for s in seqs], torch.tensor([s.req.seed for s in seqs], device=dev)
            law = draft_resolved(self.shape, resolve_sampling(sampling_params(reqs), b, dev, check_values=False), b,
                                 dev)
            tree = propose_chains(frontiers, hidden, pending, valid, seq_len, seeds, write, law, self.width,
                                  self.depth)
            tree.identical = self.identical
            return tree
        return propose_tree(frontiers, hidden, pending, valid, seq_len, write, self.branch, self.depth, self.nodes)


def within_depth(parents: list, tokens: list, depth: int) -> tuple:
    """A tree's nodes no deeper than ``depth``, in their order (parents first), parents renumbered."""
    depths, index, keep = [], {}, []
    for m, p in enumerate(parents):
        depths.append(0 if p < 0 else depths[p] + 1)
        if depths[m] <= depth:
            index[m] = len(keep)
            keep.append(m)
    return [-1 if parents[m] < 0 else index[parents[m]] for m in keep], [tokens[m] for m in keep]
