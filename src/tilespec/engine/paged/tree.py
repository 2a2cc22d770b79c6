"""Token trees on the paged engine: a step verifies a request's draft tree in the one ragged target forward.

Drafters: a context tree (drafters/context_tree.py: ``tree_drafter("ngram", tree_shape((matches, length, nodes)))``),
several matches of the request's own history merged into a trie under its pending token, built on the host per
request (:class:`TreeState`, the Seq's ``context``; deterministic drafts: no draft law), and a trained head's
dynamic trees or sampled chains (head_tree.py, the same :class:`TreeVerify` below; chains carry their draft law).

Layout (one decoding request, pending token at position L = its computed tokens): the step feeds the root (the
pending token) and the tree's nodes 1 .. N - 1 as the request's new tokens, node m at slot L + m of its blocks
(``seq.drafts`` holds the node tokens, so the scheduler grows blocks for them and drops them like a chain's), with
RoPE position L + depth(m) and an ancestor bitmask (attention.py's ``tree_mask``: node m sees the committed keys,
its ancestors and itself). The logit rows of the request are the nodes' (layout.py, as a chain's drafts'), so the
target's law at every node comes out of the step's logits [rows, 1 + gamma, V] with gamma = N - 1.

Verify (:meth:`TreeVerify.verify`): rows without a tree go through verify() as on any paged step (verify_rows.py);
tree rows through tilespec.multidraft.tree.select_tree (the one home of tree accept / resample, as the decoder's
tree steps use it: engine/tree_step.py), keyed by (seed, len(tokens) + depth) like verify. The accepted path's K/V
(and a head's features, when the target captures them) are then moved inside the request's blocks to the slots
after the committed ones: path node j's slot L + path[j] -> L + j (path[j] >= j; every source is read before any
write), so the request commits exactly like a chain step over the path: computed = L + 1 + accepted, the other
nodes' slots are past it and overwritten later, blocks are neither grown nor freed here.

Limits: trees of at most ``block_size`` nodes (gamma < block_size, as for chains) and 64 (the mask's bits); the
depth a request may accept is min(gamma argument, the shape's length, its remaining tokens - 1). Requests with a
grammar or history-dependent logit transforms (penalties, min_tokens) draft no tree (both act on chains). Tree steps
run eagerly: the decode graphs and piecewise graphs take chain steps only (model.py). Pricing does not cut trees
(its acceptance model is a chain's): every tree the scheduler keeps is verified; the draft gate still measures.
T = 0 tokens are target-only decoding's; T > 0 tokens follow the target's law, and are the same whatever the batch
when every step offers a request the same tree (``pricing=False`` and room enough: tests/test_paged_trees.py,
tests/test_paged_head_trees.py).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tilespec.multidraft.tree import TokenTree, select_tree

from ..drafters import ContextState
from ..drafters.context_tree import ContextTreeDrafter, continuations, trie
from .verify_rows import emitted_logprobs, sampling_params, verify_rows


def is_context_tree(drafter) -> bool:
    """Whether ``drafter`` drafts context trees (the tree form of ngram / suffix)."""
    return isinstance(drafter, ContextTreeDrafter)


def is_paged_tree(drafter) -> bool:
    """Whether the paged engine drafts token trees with ``drafter``: a context tree or a head's dynamic tree
    (head_tree.py)."""
    from .head_tree import is_head_tree
    return is_context_tree(drafter) or is_head_tree(drafter)


def tree_gamma(drafter, gamma: int) -> tuple:
    """(the engine's gamma: draft nodes per tree, the deepest path a request may accept) for a tree drafter
    (:func:`is_paged_tree`: its TreeShape's nodes and depth) and the caller's ``gamma`` (0: no drafting)."""
    shape = drafter.shape
    return (shape.nodes - 1, min(gamma, shape.depth)) if gamma > 0 else (0, 0)


def tree_parts(parents: list) -> tuple:
    """A tree's parents (node 0's -1 first) -> (each node's depth, each node's ancestor bitmask, int64 signed)."""
    depth, bits = [], []
    for m, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        mask = (1 << m) | (0 if p < 0 else bits[p])
        bits.append(mask)
    return depth, [b - (1 << 64) if b >= 1 << 63 else b for b in bits]


class TreeState(ContextState):
    """A request's context tree state: its history (prompt + emitted tokens, the last one pending when it
    proposes) and the parents of the tree it proposed last (node 0, the root, first)."""

    def __init__(self, prompt, shape: tuple):
        self.history, self.shape, self.parents = list(prompt), shape, [-1]

    def extend(self, row: int, tokens) -> None:
        self.history.extend(tokens)

    def propose(self, row: int, cap: int) -> list:
        """The trie's node tokens (nodes 1 ..), at most ``cap`` deep; [] without a match."""
        matches, length, nodes = self.shape
        self.parents, tokens = trie(self.history[-1], continuations(self.history, matches, min(length, cap)),
                                    nodes)
        return tokens[1:]


def tree_ok(req) -> bool:
    """Whether request ``req`` may draft trees: no grammar, no history-dependent logit transforms."""
    return req.grammar is None and (req.logits is None or not req.logits.active)


class TreeVerify:
    """The layout and verification of tree rows (the module docstring), for a tree drafter's runner with
    ``engine`` and ``sampler`` (select_tree's categorical draw); each drafting Seq's ``context.parents`` holds its
    tree's parents (node 0's -1 first) for the node tokens in ``seq.drafts``. ``kind`` "iid" (sampled chains of a
    head: head_tree.py): the context also holds ``probs`` [nodes, V], the law each node's children were drawn from,
    selected by the multi-draft ``scheme`` (``identical``: one law for all, ``width``: K chains)."""

    engine = None
    sampler, kind, scheme, identical, width = "cdf", "distinct", "specinfer", True, None

    def lay_out(self, items: list, fed: list) -> None:
        """Tree positions and ancestor masks on the fed rows (layout.Fed) of the items that verify a tree."""
        for it, f in zip(items, fed):
            seq = it.seq
            if it.samples and seq.drafts:
                depth, bits = tree_parts(seq.context.parents[:1 + len(seq.drafts)])
                f.positions, f.masks = [it.start + d for d in depth], bits

    def verify(self, sampling: list, logits: torch.Tensor) -> tuple:
        """The step's sampling rows (logits [rows, 1 + gamma, V]) -> (per row [num_emitted, tokens...], per row its
        tokens' logprobs or None), the engine's ``_verify`` contract; tree rows selected and compacted."""
        eng, n = self.engine, len(sampling)
        result, logits = verify_rows(sampling, logits, pad=eng.pad, method=eng.method, chains=[[]] * n)
        trees = [i for i, it in enumerate(sampling) if it.seq.drafts]
        out, emitted, width = result.output_tokens[:n], result.num_emitted[:n], result.output_tokens.shape[1]
        if not trees:
            host = torch.cat([emitted[:, None], out], dim=1).cpu().tolist()
        else:
            sel = self._select(sampling, trees, logits)
            rows = torch.tensor(trees, device=logits.device)
            out, emitted = out.clone(), emitted.clone()
            out[rows] = -1
            out[rows, :sel.output_tokens.shape[1]] = sel.output_tokens
            emitted[rows] = sel.num_emitted
            paths = torch.full_like(out, -1)
            paths[rows, :sel.path.shape[1]] = sel.path
            host = torch.cat([emitted[:, None], out, paths], dim=1).cpu().tolist()      # the step's one sync
            self._compact(sampling, trees, [host[i][1 + width:] for i in trees], [host[i][0] for i in trees])
            host = [row[:1 + width] for row in host]
            if any(sampling[i].seq.req.logprobs is not None for i in trees):
                logits = _path_logits(logits, rows, sel.path)
        reqs = [it.seq.req for it in sampling]
        return host, emitted_logprobs(logits, reqs, SimpleNamespace(output_tokens=out), [row[0] for row in host])

    def _select(self, sampling: list, trees: list, logits: torch.Tensor):
        """select_tree over the tree rows: distinct trees (deterministic drafts), the node logits of each row."""
        width, dev = logits.shape[1], logits.device
        parents = torch.full((len(trees), width), -1, dtype=torch.int64)
        tokens = torch.zeros((len(trees), width), dtype=torch.int64)
        sizes, seeds, offsets, deepest = [], [], [], 0
        for b, i in enumerate(trees):
            seq = sampling[i].seq
            size = 1 + len(seq.drafts)
            deepest = max(deepest, max(tree_parts(seq.context.parents[:size])[0]))
            parents[b, :size] = torch.tensor(seq.context.parents[:size])
            tokens[b, :size] = torch.tensor([seq.tokens[-1]] + seq.drafts)
            sizes.append(size)
            seeds.append(seq.req.seed)
            offsets.append(len(seq.tokens))        # depth 1's position: verify's offset (verify_rows.py)
        tree = TokenTree(parents=parents.to(dev), tokens=tokens.to(dev), sizes=torch.tensor(sizes, device=dev))
        if self.kind == "iid":      # padding nodes: a uniform law, never read (no candidate has them as parent)
            probs = torch.full((len(trees), width, logits.shape[-1]), 1.0 / logits.shape[-1], dtype=torch.float64,
                               device=dev)
            for b, i in enumerate(trees):
                probs[b, :sizes[b]] = sampling[i].seq.context.probs[:sizes[b]]
            tree.kind, tree.draft_probs, tree.identical = "iid", probs, self.identical
        reqs = [sampling[i].seq.req for i in trees]
        return select_tree(tree, logits[torch.tensor(trees, device=dev)], sampling=sampling_params(reqs),
                           seed=torch.tensor(seeds, device=dev), offsets=torch.tensor(offsets, device=dev),
                           sampler=self.sampler, check_values=False, max_depth=deepest, scheme=self.scheme,
                           max_width=self.width)     # depth known: no sync

    def _compact(self, sampling: list, trees: list, paths: list, emitted: list) -> None:
        """Move every accepted path's K/V (and captured features) to the slots after the committed ones."""
        eng, bs = self.engine, self.engine.blocks.block_size
        src, dst = [], []
        for i, path, k in zip(trees, paths, emitted):
            seq, start = sampling[i].seq, sampling[i].start
            if seq.req.finish_reason is not None:      # ended meanwhile (not committed): its blocks may be gone
                continue
            for j in range(1, k):           # path[0] is the root, in place; k - 1 nodes accepted
                if path[j] != j:
                    src.append(_slot(seq.table, start + path[j], bs))
                    dst.append(_slot(seq.table, start + j, bs))
        if not src:
            return
        dev = eng.device
        src, dst = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        buffers = [c for kv in eng.model.caches for c in kv]
        if eng.model.feature_layers:
            buffers.append(eng.model.feature_cache)
        for buf in buffers:
            buf.index_copy_(0, dst, buf.index_select(0, src))     # index_select copies: sources read first


class PagedTrees(TreeVerify):
    """The paged engine's context-tree drafting and verification (see the module docstring)."""

    def __init__(self, engine, drafter: ContextTreeDrafter):
        self.engine, self.shape, self.sampler = engine, tuple(drafter.shape.tree), drafter.shape.sampler

    def start(self, prompts) -> TreeState:
        return TreeState(prompts[0], self.shape)

    def run(self, items: list, sampling: list, prev=None) -> None:
        """No device side: the trees come from the host (no draft law for verify)."""
        return None


def _slot(table: list, position: int, bs: int) -> int:
    return table[position // bs] * bs + position % bs


def _path_logits(logits: torch.Tensor, rows: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """The step's logits with each tree row's path nodes' rows first, as a chain's (emitted_logprobs reads them)."""
    logits = logits.clone()
    src = torch.where(path >= 0, path, torch.arange(path.shape[1], device=path.device)[None, :])
    logits[rows[:, None], torch.arange(path.shape[1], device=path.device)[None, :]] = logits[rows[:, None], src]
    return logits
