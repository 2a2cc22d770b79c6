"""Exact selection over a token tree: the accepted path, its tokens and the correction / bonus token.

A batch of trees (one per request, ragged, padded to N nodes): node 0 is the root (the pending token, whose target
law gives the first emitted token); node n >= 1 has a parent ``parents[b, n] < n`` and a draft token
``tokens[b, n]``; nodes ``n >= sizes[b]`` are padding (parent -1). The target scored every node in one forward, so
``target_logits[b, n]`` is p(. | context, path to n). Selection walks down from the root, one depth t at a time:

* ``kind="distinct"`` (deterministic drafts: top-k of a head, several context matches; ``draft_probs`` None):
  the children x_1..x_m of the current node are tried in index order, recursive rejection with a one-hot draft law
  (SpecInfer / EAGLE at T > 0): accept x_k with probability r_{k-1}(x_k), where r_0 = p and r_k is p with
  x_1..x_k removed and renormalised, i.e. with u_k < p(x_k) / (1 - p(x_1) - ... - p(x_{k-1})); if every child
  is rejected, emit a draw from p with the children removed. A sibling repeating an earlier sibling's token is
  never accepted (its residual mass is 0). Greedy rows (one-hot p) follow the longest path matching the argmax.
  Every node's test is computed at once and the path is read off with one gather per depth (no host sync).
* ``kind="iid"`` (K drafts sampled independently from ``draft_probs``: K sampled children, or K sampled chains
  under the root): the seed-004 multi-draft schemes (``scheme``: specinfer, spectr, is, ...) select the token among
  the children of every alive node (nodes whose path equals the emitted tokens; duplicates of a token are separate
  drafts), as :func:`~.chain.verify_multidraft` does for K chains. The law of candidate c is ``draft_probs`` at
  its parent (``identical=True``: at the first alive node, for drafts from one law).

The emitted sequence has exactly the target's law (tests/test_tree_sampler.py; ``tree_exactness``).
Randomness of depth t is keyed by (seed_b, offsets_b + t) as in ``tilespec.verify``: accept uniforms
(PURPOSE_ACCEPT, sibling rank) and one categorical draw (PURPOSE_SAMPLE); drafts must not use these streams.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..verify import rng, wide_rows
from ..verify.distributions import log_probs
from ..verify.filters import scaled_logits
from ..verify.types import ResolvedSampling, SamplingParams
from ..verify.validation import resolve_sampling
from .common import DTYPE, EPS_MASS, Stream, TableStream, check_law, uniform_tables  # noqa: F401 (re-exported)
from .schemes import STATIC_KINDS, SchemeSpec, parse_scheme, select

MAX_NODES = 64
KINDS = ("distinct", "iid")


@dataclass
class TokenTree:
    """A batch of draft trees; see the module docstring. parents / tokens [B, N] int64, sizes [B] int64 in
    [1, N]; draft_probs [B, N, V] (the law node n's children were drawn from) for ``kind="iid"``, else None."""

    parents: torch.Tensor
    tokens: torch.Tensor
    sizes: torch.Tensor
    kind: str = "distinct"
    draft_probs: Optional[torch.Tensor] = None
    identical: bool = True

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1]

    def real(self) -> torch.Tensor:
        """[B, N] bool: real (non-padding) nodes."""
        n = torch.arange(self.num_nodes, device=self.parents.device)
        return n[None, :] < self.sizes[:, None]

    def validate(self, vocab: int) -> None:
        """ValueError for malformed trees (shapes, dtypes, parents not earlier nodes, tokens out of range)."""
        if self.kind not in KINDS:
            raise ValueError(f"tree kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("parents", "tokens", "sizes"):
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"{name} must be an integer tensor")
        if self.parents.dim() != 2 or self.tokens.shape != self.parents.shape:
            raise ValueError(f"parents and tokens must both be [B, N], got {tuple(self.parents.shape)} and "
                             f"{tuple(self.tokens.shape)}")
        b, n = self.parents.shape
        if b == 0:
            raise ValueError("empty batch: no trees")
        if not 1 <= n <= MAX_NODES:
            raise ValueError(f"a tree has 1..{MAX_NODES} nodes, got N = {n}")
        if self.sizes.shape != (b,) or bool((self.sizes < 1).any()) or bool((self.sizes > n).any()):
            raise ValueError(f"sizes must be [B] = [{b}] with values in [1, {n}]")
        real = self.real()
        idx = torch.arange(n, device=self.parents.device)[None, :]
        par = self.parents.long()
        ok_real = (par >= 0) & (par < idx)
        if bool((real[:, 1:] & ~ok_real[:, 1:]).any()) or bool((par[:, 0] != -1).any()):
            raise ValueError("parents[b, 0] must be -1 and every real node n >= 1 needs a parent in [0, n)")
        if bool((~real & (par != -1)).any()):
            raise ValueError("padding nodes (n >= sizes[b]) must have parent -1")
        tok = self.tokens.long()
        if bool(((tok < 0) | (tok >= vocab))[real].any()):
            raise ValueError(f"tree tokens must lie in [0, {vocab})")
        if self.kind == "iid":
            if self.draft_probs is None or tuple(self.draft_probs.shape) != (b, n, vocab):
                raise ValueError(f"an iid tree needs draft_probs [B, N, V] = [{b}, {n}, {vocab}]")
        elif self.draft_probs is not None:
            raise ValueError("a distinct tree holds deterministic drafts: draft_probs must be None")


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: anc[b, n, m] = node m is node n itself or one of its ancestors (padding: itself only).
    Transitive closure by repeated squaring in boolean ops (log2 N rounds of [B, N, N, N] ands, no host sync)."""
    b, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    anc = (idx[None, :, None] == idx[None, None, :]) | (
        (parents.long()[:, :, None] == idx[None, None, :]) & (parents[:, :, None] >= 0))
    for _ in range(max(1, (n - 1).bit_length())):
        anc = (anc[:, :, :, None] & anc[:, None, :, :]).any(dim=2)
    return anc


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] int64 depth of every node (root and padding: 0)."""
    return ancestors(parents).sum(dim=-1) - 1


@dataclass
class TreeSelection:
    """path [B, D+1] accepted node indices (path[:, 0] = 0, -1 padded); output_tokens [B, D+1] the emitted tokens
    (-1 padded); num_accepted [B] draft tokens taken; num_emitted = num_accepted + 1. D = the deepest level."""

    path: torch.Tensor
    output_tokens: torch.Tensor
    num_accepted: torch.Tensor
    num_emitted: torch.Tensor


def _target_probs(target_logits: Optional[torch.Tensor], target_probs: Optional[torch.Tensor],
                  sampling: SamplingParams, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """float64 law [R, V] at node nodes[r] of request rows[r] (filters and temperature applied to logits)."""
    if target_probs is not None:
        return target_probs[rows, nodes].to(DTYPE)
    b = target_logits.shape[0]
    resolved = _resolved(sampling, b, target_logits.device)
    full = torch.zeros(b, target_logits.shape[-1], dtype=target_logits.dtype, device=target_logits.device)
    full[rows] = target_logits[rows, nodes]
    probs = torch.exp(log_probs(full[:, None, :].float(), resolved)[:, 0].to(DTYPE))[rows]
    return probs / probs.sum(-1, keepdim=True)


class _NodeLaws:
    """The target's processed law at every tree node, read where the selection needs it (never a float64
    [B, N, V] copy): :meth:`at` single entries, :meth:`row` one node's whole law per request. From logits: the
    fp32 log-law (:func:`~tilespec.verify.distributions.log_probs`; without filters or greedy rows a chunked
    log-softmax, :mod:`tilespec.verify.wide_rows`), exponentiated in float64 where read."""

    def __init__(self, target_logits, target_probs, sampling):
        if target_probs is not None:
            self.probs, self.logp = target_probs.to(DTYPE), None
            return
        b, _, v = target_logits.shape
        resolved = _resolved(sampling, b, target_logits.device)
        logits = target_logits.float()
        if resolved.has_filters or resolved.any_greedy:
            self.logp = log_probs(logits, resolved)
        else:
            self.logp = wide_rows.log_softmax(scaled_logits(logits, resolved.temperature))
        self.probs = None

    def at(self, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """nodes, tokens [B, M] -> [B, M] float64: p_nodes[b, m](tokens[b, m])."""
        rows = torch.arange(nodes.shape[0], device=nodes.device)[:, None]
        if self.probs is not None:
            return self.probs[rows, nodes, tokens]
        return torch.exp(self.logp[rows, nodes, tokens].to(DTYPE))

    def row(self, node: torch.Tensor) -> torch.Tensor:
        """node [B] -> [B, V] float64: the law at node[b]."""
        rows = torch.arange(node.shape[0], device=node.device)
        if self.probs is not None:
            return self.probs[rows, node]
        return torch.exp(self.logp[rows, node].to(DTYPE))


def _resolved(sampling, batch: int, device) -> ResolvedSampling:
    """``sampling`` as per-request tensors [B]: a ResolvedSampling as given (a compiled caller resolves outside its
    region: the cached constants are read, not built, inside it), SamplingParams resolved."""
    return sampling if isinstance(sampling, ResolvedSampling) else resolve_sampling(sampling, batch, device)


def select_tree(tree: TokenTree, target_logits: Optional[torch.Tensor] = None, *,
                target_probs: Optional[torch.Tensor] = None,
                sampling: Union[SamplingParams, ResolvedSampling] = SamplingParams(),
                scheme: Union[str, SchemeSpec] = "specinfer", seed=0, offsets=0, sampler: str = "gumbel",
                check_values: bool = True, max_depth: Optional[int] = None, uniforms=uniform_tables,
                depth_cap: Optional[torch.Tensor] = None, max_width: Optional[int] = None) -> TreeSelection:
    """Select the accepted path of every tree; see the module docstring.

    Args:
        tree: the :class:`TokenTree` batch (B trees of N <= 64 nodes).
        target_logits: [B, N, V] raw target logits per node (processed with ``sampling``), or target_probs
            [B, N, V] already processed laws.
        sampling: SamplingParams, or the same already resolved for the B requests (``resolve_sampling``).
        scheme: the multi-draft scheme of ``kind="iid"`` trees (ignored for distinct trees).
        seed: int (request b uses seed + b) or [B]; offsets: int or [B] absolute position of the first draft
            token (depth-1 nodes): depth t draws with key (seed, offsets + t).
        sampler: 'gumbel' or 'cdf' (see :class:`~.common.Stream`).
        max_depth: the trees' deepest level when the caller knows it (distinct trees then need no host sync, so
            the selection can be captured in a CUDA graph); None = read it from the tree.
        max_width: for iid trees, the most nodes of one level (K for K chains); with ``max_depth`` and a scheme of
            ``schemes.STATIC_KINDS`` the selection needs no host sync either (the same draws, same tokens).
        uniforms: :func:`uniform_tables` or a function like it (the engine's replays a CUDA graph): iid trees draw
            every accept / sample uniform of the selection in one batch.
        depth_cap: [B] int64 or None: request b's nodes deeper than depth_cap[b] count as padding (a smaller tree:
            at most depth_cap[b] draft tokens are accepted; the engine caps trees near a request's token limit).
    """
    if (target_logits is None) == (target_probs is None):
        raise ValueError("give exactly one of target_logits and target_probs")
    for name, bound in (("max_depth", max_depth), ("max_width", max_width)):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
            raise ValueError(f"{name} must be a non-negative int or None, got {bound!r}")
    tgt = target_logits if target_logits is not None else target_probs
    if not isinstance(tgt, torch.Tensor) or tgt.dim() != 3:
        raise ValueError("target logits/probs must be a [B, N, V] tensor")
    b, n, v = tgt.shape
    if tuple(tree.parents.shape) != (b, n):
        raise ValueError(f"target has {b} x {n} nodes but the tree {tuple(tree.parents.shape)}")
    if check_values:
        tree.validate(v)
        if bool((_resolved(sampling, b, tgt.device).lenience != 1).any()):
            raise ValueError("tree selection is exact only: lenience < 1 (a lossy acceptance rule) is not supported")
        if target_logits is not None and not bool(torch.isfinite(target_logits.float()).all()):
            raise ValueError("target_logits contain NaN or Inf")
        if target_probs is not None:
            check_law(target_probs, "target_probs")
        if tree.draft_probs is not None:
            check_law(tree.draft_probs, "draft_probs")
    dev = tgt.device
    seeds = rng.seeds_from(seed, b, dev)
    offs = torch.as_tensor(offsets, dtype=torch.int64, device=dev).expand(b)
    if tree.kind == "distinct":
        return _select_distinct(tree, target_logits, target_probs, sampling, seeds, offs, sampler,
                                max_depth=max_depth, depth_cap=depth_cap)
    spec = scheme if isinstance(scheme, SchemeSpec) else parse_scheme(scheme)
    if max_depth is not None and max_width is not None and spec.kind in STATIC_KINDS:
        return _select_iid_static(tree, target_logits, target_probs, sampling, spec, seeds, offs, sampler,
                                  uniforms, depth_cap, max_depth, max_width)
    return _select_iid(tree, target_logits, target_probs, sampling, spec, seeds, offs, sampler, uniforms, depth_cap)


def _select_distinct(tree, target_logits, target_probs, sampling, seeds, offs, sampler,
                     renormalise: bool = True, max_depth: Optional[int] = None,
                     depth_cap: Optional[torch.Tensor] = None) -> TreeSelection:
    """``renormalise=False`` drops the division by the rejected siblings' mass: a wrong sampler, kept only as the
    exactness suite's power check."""
    b, n = tree.parents.shape
    dev = tree.parents.device
    parents = tree.parents.long()
    anc = ancestors(parents)
    depth = anc.sum(dim=-1) - 1
    real = _capped(tree.real(), depth, depth_cap)
    tokens = torch.where(real, tree.tokens.long(), torch.zeros_like(tree.parents.long()))   # padding: any id
    greedy = target_logits is not None and _resolved(sampling, b, dev).all_greedy
    if greedy:      # one-hot laws: only each node's argmax is needed, never a [B, N, V] law
        top = wide_rows.argmax(target_logits)                                         # [B, N]
        p_node = (top.gather(1, parents.clamp(min=0)) == tokens).to(DTYPE)
    else:
        law = _NodeLaws(target_logits, target_probs, sampling)
        p_node = law.at(parents.clamp(min=0), tokens)          # p(x_n) under the law of n's parent
    idx = torch.arange(n, device=dev)
    sib = (parents[:, :, None] == parents[:, None, :]) & real[:, :, None] & real[:, None, :] \
        & (parents[:, :, None] >= 0) & (idx[None, None, :] < idx[None, :, None])       # [B, n, m]: m earlier sibling
    dup = (sib & (tokens[:, :, None] == tokens[:, None, :])).any(dim=-1)
    p_node = torch.where(real & ~dup & (parents >= 0), p_node, torch.zeros_like(p_node))
    if greedy:      # the one child whose token is the parent's argmax passes (u < 1 = its renormalised law)
        passes = p_node > 0
    else:
        rejected_mass = (sib.to(DTYPE) * p_node[:, None, :]).sum(-1)                 # mass of earlier siblings
        rank = sib.sum(-1)
        u = rng.uniform(seeds[:, None], offs[:, None] + (depth - 1).clamp(min=0), rng.PURPOSE_ACCEPT, rank).to(DTYPE)
        passes = (u * ((1 - rejected_mass).clamp(min=0) if renormalise else 1) < p_node) & (p_node > 0)     # [B, N]
    # chosen child of each node: the first child that passes
    child_of = (parents[:, None, :] == idx[None, :, None]) & passes[:, None, :]       # [B, parent, child]
    first = torch.where(child_of, idx[None, None, :], torch.full_like(child_of, n, dtype=torch.int64)).min(-1).values
    if max_depth is None:
        max_depth = int(depth.max()) if n > 1 else 0
    path = torch.full((b, max_depth + 1), -1, dtype=torch.int64, device=dev)
    out = torch.full((b, max_depth + 1), -1, dtype=torch.int64, device=dev)
    node = torch.zeros(b, dtype=torch.int64, device=dev)
    going = torch.ones(b, dtype=torch.bool, device=dev)
    path[:, 0] = 0
    for t in range(1, max_depth + 1):
        nxt = first.gather(1, node[:, None]).squeeze(1)
        take = going & (nxt < n)
        node = torch.where(take, nxt, node)
        path[:, t] = torch.where(take, node, path[:, t])
        out[:, t - 1] = torch.where(take, tokens.gather(1, node[:, None]).squeeze(1), out[:, t - 1])
        going = take
    n_acc = (path >= 0).sum(dim=1) - 1
    if greedy:      # the last node's argmax: a child holding it would have passed
        y = top.gather(1, node[:, None]).squeeze(1)
    else:           # the last token: p at the last path node with its children removed (none when it is a leaf)
        last = law.row(node)
        kids = (parents == node[:, None]) & real
        gone = torch.zeros(last.shape, dtype=torch.int64, device=dev).scatter_add_(1, tokens, kids.long()) > 0
        resid = torch.where(gone, torch.zeros_like(last), last)
        safe = resid.sum(-1, keepdim=True) > EPS_MASS
        resid = torch.where(safe, resid, last)        # rounding only: every child rejected means mass remained
        y = Stream(seeds, offs + n_acc, sampler).sample(resid)
    out.scatter_(1, n_acc[:, None], y[:, None])
    return TreeSelection(path=path, output_tokens=out, num_accepted=n_acc, num_emitted=n_acc + 1)


def _capped(real: torch.Tensor, depth: torch.Tensor, depth_cap: Optional[torch.Tensor]) -> torch.Tensor:
    """The real nodes no deeper than ``depth_cap`` [B] (None: all real nodes)."""
    return real if depth_cap is None else real & (depth <= depth_cap[:, None])


def _walk_start(tree, depth_cap, max_depth: int) -> tuple:
    """The state an iid walk starts from: (parents, real nodes under the depth cap, tokens (0 on padding), draft laws
    float64, path [B, D+1] (root taken), output tokens [B, D+1], alive nodes (the root), going rows, accepted)."""
    b, n = tree.parents.shape
    dev = tree.parents.device
    parents = tree.parents.long()
    real = _capped(tree.real(), depths(parents), depth_cap)
    tokens = torch.where(real, tree.tokens.long(), torch.zeros_like(parents))
    path = torch.full((b, max_depth + 1), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    alive = torch.zeros(b, n, dtype=torch.bool, device=dev)
    alive[:, 0] = True
    return (parents, real, tokens, tree.draft_probs.to(DTYPE), path, torch.full_like(path, -1), alive,
            torch.ones(b, dtype=torch.bool, device=dev), torch.zeros(b, dtype=torch.int64, device=dev))


def _select_iid(tree, target_logits, target_probs, sampling, spec, seeds, offs, sampler,
                uniforms=uniform_tables, depth_cap: Optional[torch.Tensor] = None) -> TreeSelection:
    b, n = tree.parents.shape
    dev = tree.parents.device
    max_depth = int(depths(tree.parents.long()).max()) if n > 1 else 0
    parents, real, tokens, q_all, path, out, alive, going, n_acc = _walk_start(tree, depth_cap, max_depth)
    ar = torch.arange(n, device=dev)
    acc_u, smp_u = uniforms(seeds, offs, max_depth + 1, n)      # every uniform the loop may read, in one batch
    for t in range(max_depth + 1):
        ref = alive.long().argmax(dim=1)                                         # first alive node
        cand = alive.gather(1, parents.clamp(min=0)) & (parents >= 0) & real        # children of alive nodes
        has = going & cand.any(dim=1)
        rows = going.nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        p_t = _target_probs(target_logits, target_probs, sampling, rows, ref[rows])
        stream = TableStream(seeds[rows], offs[rows] + t, acc_u[rows, t], smp_u[rows, t], sampler)
        y = torch.full((rows.numel(),), -1, dtype=torch.int64, device=dev)
        leaf = ~has[rows]
        if bool(leaf.any()):                                                     # bonus token
            y[leaf] = stream.subset(leaf.nonzero().squeeze(1)).sample(p_t[leaf])
        sel_rows = has[rows]
        if bool(sel_rows.any()):
            r = rows[sel_rows]
            counts = cand[r].sum(dim=1)
            k = int(counts.max())
            order = torch.sort(torch.where(cand[r], ar[None, :], ar[None, :] + n), dim=1).values[:, :k]
            cmask = order < n
            cnodes = torch.where(cmask, order, torch.zeros_like(order))
            ctoks = tokens[r[:, None], cnodes]
            if tree.identical:
                qs = q_all[r, ref[r]][:, None, :].expand(-1, k, -1)
            else:
                qs = q_all[r[:, None], parents[r[:, None], cnodes]]
            sub = sel_rows.nonzero().squeeze(1)
            sel = select(spec, p_t[sub], qs, ctoks, stream.subset(sub), cmask, validate=False)
            y[sub] = sel.token
            match = torch.zeros(r.numel(), n, dtype=torch.bool, device=dev)
            match.scatter_(1, cnodes, cmask & (ctoks == sel.token[:, None]))
            alive[r] = match
            cont = match.any(dim=1)
            first = match.long().argmax(dim=1)
            path[r[cont], t + 1] = first[cont]
            n_acc[r[cont]] += 1
            going[r[~cont]] = False
        out[rows, t] = y
        going[rows[leaf]] = False
    return TreeSelection(path=path, output_tokens=out, num_accepted=n_acc, num_emitted=n_acc + 1)


def _select_iid_static(tree, target_logits, target_probs, sampling, spec, seeds, offs, sampler, uniforms,
                       depth_cap, max_depth: int, width: int) -> TreeSelection:
    """:func:`_select_iid` without a host sync: every row takes part at every depth (rows that stopped are masked),
    the candidates of a level are the first ``width`` children of the alive nodes in index order, a row without
    candidates draws its bonus token through the same ``select`` (an empty mask draws from p: the same numbers)."""
    b, n = tree.parents.shape
    dev = tree.parents.device
    parents, real, tokens, q_all, path, out, alive, going, n_acc = _walk_start(tree, depth_cap, max_depth)
    rows = torch.arange(b, device=dev)
    ar = torch.arange(n, device=dev)
    acc_u, smp_u = uniforms(seeds, offs, max_depth + 1, n)
    for t in range(max_depth + 1):
        ref = alive.long().argmax(dim=1)                                         # first alive node
        cand = alive.gather(1, parents.clamp(min=0)) & (parents >= 0) & real & going[:, None]
        p_t = _target_probs(target_logits, target_probs, sampling, rows, ref)
        stream = TableStream(seeds, offs + t, acc_u[:, t], smp_u[:, t], sampler)
        order = torch.sort(torch.where(cand, ar[None, :], ar[None, :] + n), dim=1).values[:, :width]
        cmask = order < n
        cnodes = torch.where(cmask, order, torch.zeros_like(order))
        ctoks = tokens.gather(1, cnodes)
        if tree.identical:
            qs = q_all[rows, ref][:, None, :].expand(-1, width, -1)
        else:
            qs = q_all[rows[:, None], parents.gather(1, cnodes)]
        y = select(spec, p_t, qs, ctoks, stream, cmask, validate=False, static=True).token
        match = torch.zeros(b, n, dtype=torch.bool, device=dev).scatter_(1, cnodes, cmask & (ctoks == y[:, None]))
        cont = going & match.any(dim=1)
        out[:, t] = torch.where(going, y, out[:, t])
        if t < max_depth:                           # (at the last level nothing has children: cont is False)
            path[:, t + 1] = torch.where(cont, match.long().argmax(dim=1), path[:, t + 1])
        n_acc = n_acc + cont.long()
        alive = torch.where(cont[:, None], match, alive)
        going = cont
    return TreeSelection(path=path, output_tokens=out, num_accepted=n_acc, num_emitted=n_acc + 1)
