"""Token trees from a draft head (drafters/head.py): EAGLE-2-style dynamic trees and K sampled chains.

Both grow from ``hidden`` [B, d] (the head's output at the last committed entry, which predicts the first draft
token) by running the head on a frontier of draft nodes at once: frontier node j at depth t gets the head entry
(parent's output, its token) at position ``seq_len - 2 + t`` in draft slot ``W + (t - 1) * F + j`` of the head's
cache (F = frontier width), attending to the committed entries and to its own ancestors' draft slots. Those slots
are overwritten by the ``observe`` that follows verification, so only committed entries survive.

* :func:`propose_tree` (``kind="distinct"``, deterministic drafts, exact at every temperature): depth 1 = the top-k
  tokens of the head's law; each later depth expands the k frontier nodes by their top-k children and keeps the k
  best by path score (sum of the head's log-probabilities) as the next frontier; finally the N - 1 best-scoring
  candidates form the tree (EAGLE-2's re-ranking; a child never outscores its parent, so the set is a tree).
* :func:`propose_chains` (``kind="iid"``): K chains of length L, each token sampled from the head's processed law
  at the draft temperature, independently per chain (Gumbel noise keyed by a per-chain seed, a stream no verify
  scheme uses); the laws are kept as the tree's ``draft_probs`` for the multi-draft schemes
  (Khisti et al. 2024).
Static shapes, no host syncs: both can run inside a captured CUDA graph (the selection of sampled chains cannot: it
reads the alive drafts on the host, so those steps run on the host-commit path).
:class:`HeadTreeDrafter` (the tree form of a HeadDrafter) hands out a :class:`HeadTreeRunner`: the head's runner whose
``propose`` returns these trees as a tree :class:`~.contract.Proposal`; ``observe`` is the chain's (the step body
hands it the accepted path).
"""
from __future__ import annotations

import torch

from tilespec.multidraft.schemes import static_scheme
from tilespec.multidraft.tree import TokenTree
from tilespec.verify import wide_rows
from tilespec.verify.distributions import log_probs

from ..fused import fused, wanted
from ..tree_step import sample_chains, window_gather
from .base import Drafter
from .contract import Proposal, StepView
from .head import HeadDrafter, HeadRunner
from .trees import capped, draft_resolved, no_trees, tree_form

CHAIN_SEED_STRIDE = 1 << 44     # chain k samples with seed + (k + 1) * stride: independent of the verify streams


def tree_candidates(branch: int, depth: int) -> int:
    """How many candidate nodes :func:`propose_tree` generates (the most nodes a tree can keep, root excluded)."""
    return branch + (depth - 1) * branch * branch


def _own_slots(width: int, slots: int, depth_t: int, device) -> torch.Tensor:
    """[1, F, S] bool: frontier node j at depth t owns draft slot (t - 1) F + j (no indexed writes: graph-safe)."""
    own = (depth_t - 1) * width + torch.arange(width, device=device)
    return (torch.arange(slots, device=device)[None, :] == own[:, None])[None]


def _grow(head_runner, feat, tokens, depth_t: int, width: int, anc_slots, valid, seq_len, write):
    """Head entries of one frontier -> outputs [B, F, d]. feat [B, F, d] the parents' outputs, tokens [B, F],
    anc_slots [B, F, S] draft slots each node sees (its own included)."""
    b = tokens.shape[0]
    slot = write + (depth_t - 1) * width
    positions = (seq_len - 2 + depth_t)[:, None].expand(b, width)
    mask = (valid[:, None, :] | window_gather(anc_slots, write, valid.shape[1])).unsqueeze(1)
    return head_runner.entries(feat, tokens, positions, mask, slot)


def _frontier_mask(anc, slot, valid, write, width: int) -> tuple:
    """A frontier of ``width`` nodes entering draft slots ``slot`` + j (slot: a 0-d tensor) -> (anc [B, F, S] with
    those own slots added, the head's mask [B, 1, F, C])."""
    own = (slot - write) + torch.arange(width, device=anc.device)
    anc = anc | (torch.arange(anc.shape[-1], device=anc.device)[None, :] == own[:, None])[None]
    return anc, (valid[:, None, :] | window_gather(anc, write, valid.shape[1])).unsqueeze(1)


def _children(head, out, score, branch: int) -> tuple:
    """The top-``branch`` children of each frontier node (outputs ``out`` [B, k, d], path scores ``score`` [B, k])
    -> (their path scores [B, k, k], their draft-vocabulary ids [B, k, k])."""
    s2, i2 = _top_log_probs(head.logits(out).float(), branch)                        # [B, k, k]
    return score[:, :, None] + s2, i2


def _top_log_probs(logits: torch.Tensor, branch: int) -> tuple:
    """logits [..., Vd] -> the ``branch`` largest log-probabilities and their ids [..., branch], largest first
    (chunked passes: few rows of a wide vocabulary; verify/wide_rows.py)."""
    top, ids = wide_rows.topk(logits, branch)
    return top - wide_rows.logsumexp(logits)[..., None], ids


def _tree_root(head, hidden, valid, seq_len, write, branch: int, slots: int) -> tuple:
    """Depth 1 of :func:`propose_tree`: the head's top-``branch`` tokens at ``hidden`` [B, d] -> (score [B, k],
    tok [B, k], anc [B, k, S], the depth-1 frontier's mask [B, 1, k, C], its position [B] (seq_len - 1), its draft
    slot W (a copy: a :func:`_tree_level` input aliasing another, W, would be a separate compiled variant))."""
    b = hidden.shape[0]
    score, ids = _top_log_probs(head.logits(hidden).float(), branch)                # [B, k]
    anc = torch.zeros(b, branch, slots, dtype=torch.bool, device=hidden.device)
    anc, mask = _frontier_mask(anc, write, valid, write, branch)
    return score, head.vocab_ids[ids], anc, mask, seq_len - 1, write.clone()


def _tree_level(head, out, score, anc, pos, slot, valid, write, branch: int) -> tuple:
    """Depth t's frontier (head outputs ``out`` [B, k, d], ``score`` [B, k], ``anc`` [B, k, S], position ``pos``
    [B], draft slot ``slot``) -> depth t + 1's k² candidates (tokens, scores [B, k²]), the pick [B, k] of the k best
    among them, and the next frontier: (score, tok [B, k], feat [B, k, d], anc, mask, pos + 1, slot + k)."""
    b = out.shape[0]
    s2, i2 = _children(head, out, score, branch)
    score, pick = s2.reshape(b, -1).topk(branch, dim=-1)
    parent_j = pick // branch
    tok = head.vocab_ids[i2.reshape(b, -1).gather(1, pick)]
    feat = out.gather(1, parent_j[:, :, None].expand(-1, -1, out.shape[-1]))
    anc = anc.gather(1, parent_j[:, :, None].expand(-1, -1, anc.shape[-1]))
    anc, mask = _frontier_mask(anc, slot + branch, valid, write, branch)
    return (head.vocab_ids[i2].reshape(b, -1), s2.reshape(b, -1), pick, score, tok, feat, anc, mask, pos + 1,
            slot + branch)


def _tree_finish(head, out, score, pending, toks: list, scores: list, picks: list, branch: int, nodes: int) -> tuple:
    """The deepest frontier's children (``out`` None when depth = 1), then the N - 1 best of all candidates as a
    tree: (parents, tokens [B, N], sizes [B]). Candidate blocks: depth 1 (``toks[0]``: the root's children), then
    depth t + 1 the children of depth t's frontier, whose candidate ids are block t's start + ``picks[t - 2]``
    (depth 1's frontier: the first k candidates)."""
    b, dev = pending.shape[0], pending.device
    toks, scores = list(toks), list(scores)
    if out is not None:
        s2, i2 = _children(head, out, score, branch)
        toks.append(head.vocab_ids[i2].reshape(b, -1))
        scores.append(s2.reshape(b, -1))
    par = [torch.full((b, branch), -1, dtype=torch.int64, device=dev)]
    fronts = [torch.arange(branch, device=dev)[None, :].expand(b, branch)]
    fronts += [branch + t * branch * branch + pick for t, pick in enumerate(picks)]
    par += [f[:, :, None].expand(b, branch, branch).reshape(b, -1) for f in fronts[:len(toks) - 1]]
    all_tok, all_score, all_par = (torch.cat(x, dim=1) for x in (toks, scores, par))
    order = torch.sort(-all_score, dim=1, stable=True).indices[:, :nodes - 1]           # best first, parents first
    keep = torch.sort(order, dim=1).values                                              # topological order
    node_of = torch.full((b, all_tok.shape[1]), -1, dtype=torch.int64, device=dev)
    node_of.scatter_(1, keep, torch.arange(1, nodes, device=dev)[None, :].expand(b, -1))
    par_c = all_par.gather(1, keep)
    par_n = torch.where(par_c >= 0, node_of.gather(1, par_c.clamp(min=0)), torch.zeros_like(par_c))
    parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), par_n], dim=1)
    tokens = torch.cat([pending[:, None], all_tok.gather(1, keep)], dim=1)
    return parents, tokens, torch.full((b,), nodes, dtype=torch.int64, device=dev)


def propose_tree(head_runner, hidden, pending, valid, seq_len, write, branch: int, depth: int,
                 nodes: int, compiled: bool = False) -> TokenTree:
    """EAGLE-2-style tree of ``nodes`` nodes (root = ``pending`` [B]) -> a distinct :class:`TokenTree` [B, nodes].
    ``write``: W as a 0-d tensor. ``compiled``: the bookkeeping between the head's forwards (:func:`_tree_root`,
    :func:`_tree_level`, :func:`_tree_finish`) runs as inductor-compiled regions (engine/fused.py)."""
    head = head_runner.head
    if nodes - 1 > tree_candidates(branch, depth):
        raise ValueError(f"a tree of {nodes} nodes needs more than the {tree_candidates(branch, depth)} candidates "
                         f"of branch {branch} x depth {depth}")
    b = hidden.shape[0]
    score, tok, anc, mask, pos, slot = fused(_tree_root, compiled)(head, hidden, valid, seq_len, write, branch,
                                                                  max((depth - 1) * branch, 1))
    feat, out = hidden[:, None, :].expand(b, branch, hidden.shape[-1]), None
    toks, scores, picks = [tok], [score], []
    for t in range(1, depth):
        # depth t's frontier node j: the head entry (parent's output, its token) in draft slot W + (t - 1) k + j
        out = head_runner.entries(feat, tok, pos[:, None].expand(b, branch), mask, slot)          # [B, k, d]
        if t < depth - 1:
            tok_c, score_c, pick, score, tok, feat, anc, mask, pos, slot = fused(_tree_level, compiled)(
                head, out, score, anc, pos, slot, valid, write, branch)
            toks.append(tok_c)
            scores.append(score_c)
            picks.append(pick)
    parents, tokens, sizes = fused(_tree_finish, compiled)(head, out, score, pending, toks, scores, picks, branch,
                                                           nodes)
    return TokenTree(parents=parents, tokens=tokens, sizes=sizes)


def propose_chains(head_runner, hidden, pending, valid, seq_len, seeds, write, resolved, chains: int,
                   length: int) -> TokenTree:
    """K = ``chains`` sampled chains of ``length`` tokens under the root (``pending`` [B]) -> an iid
    :class:`TokenTree` with 1 + K L nodes (node 1 + (t - 1) K + j = chain j's token t) and draft_probs [B, N, V]
    (the processed head law each node's child was drawn from). ``resolved``: the draft's sampling (e.g. a draft
    temperature)."""
    head = head_runner.head
    b, dev = hidden.shape[0], hidden.device
    k = chains
    chain_seeds = seeds[:, None] + CHAIN_SEED_STRIDE * torch.arange(1, k + 1, device=dev)[None, :]    # [B, K]
    small = head.logits(hidden).float()                                                 # [B, Vd]
    full = head.full_logits(small)
    law = torch.exp(log_probs(full[:, None, :], resolved)[:, 0])                        # [B, V]
    probs = [law[:, None, :]]
    feat = hidden[:, None, :].expand(b, k, hidden.shape[-1])
    law = law[:, None, :].expand(b, k, law.shape[-1])
    anc = torch.zeros(b, k, max((length - 1) * k, 1), dtype=torch.bool, device=dev)
    toks = []
    for t in range(1, length + 1):
        pos = (seq_len - 1 + t)[:, None]
        vocab = head.vocab_ids
        logq = torch.log(law.gather(2, vocab[None, None, :].expand(b, k, -1)))
        tok = sample_chains(logq, vocab, chain_seeds, pos[:, 0])                         # [B, K]
        toks.append(tok)
        if t == length:
            probs.append(torch.full((b, k, law.shape[-1]), 1.0 / law.shape[-1], device=dev))   # leaves: unused
            break
        anc = anc | _own_slots(k, anc.shape[-1], t, dev)
        feat = _grow(head_runner, feat, tok, t, k, anc, valid, seq_len, write)
        law = torch.exp(log_probs(head.full_logits(head.logits(feat).float()), resolved))  # [B, K, V]
        probs.append(law)
    return chains_tree(pending, toks, probs)


def chains_tree(pending: torch.Tensor, toks: list, probs: list) -> TokenTree:
    """K sampled chains of L tokens as one tree: the root ``pending`` [B], then level t's K tokens (``toks[t]``
    [B, K]) as children of level t-1's same chain; ``probs[t]`` [B, K, V] the law each level was sampled from."""
    b, k = toks[0].shape
    n, dev = 1 + k * len(toks), pending.device
    tokens = torch.cat([pending[:, None]] + toks, dim=1)
    idx = torch.arange(n, device=dev)
    # no indexed write of a Python number (a host-to-device copy, which a CUDA-graph capture refuses)
    par = torch.where(idx <= k, (idx > 0).long() - 1, idx - k)         # -1 for the root, 0 for level 1
    draft_probs = torch.cat(probs, dim=1).double()
    draft_probs = draft_probs / draft_probs.sum(-1, keepdim=True)
    return TokenTree(parents=par[None, :].expand(b, n).clone(), tokens=tokens,
                     sizes=torch.full((b,), n, dtype=torch.int64, device=dev), kind="iid", draft_probs=draft_probs,
                     identical=True)


def head_span(shape) -> int:
    """Slots past W a head's tree step writes: the target's nodes, the head's frontier entries, the observed path."""
    width, depth = shape.tree[:2] if shape.tree is not None else shape.chains
    return max(shape.nodes, (depth - 1) * width + 1, depth + 1)


class HeadTreeRunner(HeadRunner):
    """A head's runner proposing ``shape``'s trees (dynamic trees: captured with the whole step) or sampled chains
    (host-commit path)."""

    def __init__(self, head, batch: int, capacity: int, mode: str, shape):
        super().__init__(head, batch, capacity, mode)
        self.shape = shape
        self.captures = shape.tree is not None or static_scheme(shape.scheme)   # chains: selection without a sync
        self._write = torch.zeros((), dtype=torch.int64, device=self.device)

    def span(self, gamma: int) -> int:
        return head_span(self.shape)

    def _device_view(self, view: StepView) -> StepView:
        """W as a device scalar (the compiled head layer would recompile for every host int)."""
        if isinstance(view.write, torch.Tensor):
            return view
        self._write.fill_(view.write)
        return StepView(view.valid, view.seq_len, view.pending, view.prev, view.seeds, self._write, view.hidden)

    def propose(self, view: StepView, gamma: int, resolved, greedy: bool, ex) -> Proposal:
        v, shape = self._device_view(view), self.shape
        if shape.tree is not None:
            branch, depth, nodes = shape.tree
            tree = propose_tree(self, v.hidden, v.pending, v.valid, v.seq_len, v.write, branch, depth, nodes,
                                compiled=wanted(ex, v.hidden))
            return capped(Proposal.of_tree(tree, sampler=shape.sampler, depth=depth), gamma, depth)
        k, length = shape.chains
        law = draft_resolved(shape, resolved, v.pending.shape[0], v.pending.device)
        tree = propose_chains(self, v.hidden, v.pending, v.valid, v.seq_len, v.seeds, v.write, law, k, length)
        tree.identical = shape.identical
        return capped(Proposal.of_tree(tree, scheme=shape.scheme, sampler=shape.sampler, depth=length, width=k),
                      gamma, length)

    def observe(self, view: StepView, feats, out_tokens, num_emitted, ex) -> torch.Tensor:
        return super().observe(self._device_view(view), feats, out_tokens, num_emitted, ex)


class HeadTreeDrafter(Drafter):
    """A head (``base``, a HeadDrafter) proposing trees of ``shape`` (drafters/trees.py)."""

    def __init__(self, base, shape):
        if shape.tree is not None and shape.nodes - 1 > tree_candidates(*shape.tree[:2]):
            raise ValueError(f"tree {shape.tree}: at most {tree_candidates(*shape.tree[:2])} candidates for "
                             f"{shape.nodes - 1} nodes; raise branch or depth")
        self.base, self.shape = base, shape
        kind = "tree-%d-%d-%d" % shape.tree if shape.tree is not None else "chains-%d-%d-%s" % (*shape.chains,
                                                                                                shape.scheme)
        self.name = f"{base.name}:{kind}"

    def attach(self, target) -> None:
        self.base.attach(target)

    def span(self, gamma: int) -> int:
        return head_span(self.shape)

    def runner(self, batch: int, capacity: int, *, target, compile=None) -> HeadTreeRunner:
        shape = self.shape
        return self.base._shared_runner(batch, capacity, target.mode, ("head-tree", shape.key()),
                                        lambda *a: HeadTreeRunner(*a, shape))


@tree_form(HeadDrafter)
def head_tree(drafter: HeadDrafter, shape) -> HeadTreeDrafter:
    if drafter.context is not None:
        raise no_trees(drafter)
    return HeadTreeDrafter(drafter, shape)
