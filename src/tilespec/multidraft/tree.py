"""Exact selection over a token tree: the accepted path, its tokens and the correction / bonus token.

A batch of trees (one per request, ragged, padded to N nodes): node 0 is the root (the pending token, whose target
law gives the first emitted token); node n >= 1 has a parent ``parents[b, n] < n`` and a draft token
``tokens[b, n]``; nodes ``n >= sizes[b]`` are padding (parent -1). The target scored every node in one forward, so
``target_logits[b, n]`` is p(. | context, path to n). Selection walks down from the root, one depth t at a time:

* ``kind="distinct"`` (deterministic drafts: top-k of a head, several context matches; ``draft_probs`` None):
  recursive rejection with one-hot draft laws, the children of the current node tried in index order
  (SpecInfer / EAGLE at T > 0; greedy rows follow the longest path matching the argmax): :mod:`.tree_distinct`.
* ``kind="iid"`` (K drafts sampled independently from ``draft_probs``: K sampled children, or K sampled chains
  under the root): the multi-draft schemes of Khisti et al. 2024 (``scheme``: specinfer, spectr, is, ...) select the token among
  the children of every alive node (nodes whose path equals the emitted tokens; duplicates of a token are separate
  drafts), as :func:`~.chain.verify_multidraft` does for K chains. The law of candidate c is ``draft_probs`` at
  its parent (``identical=True``: at the first alive node, for drafts from one law).

The emitted sequence has exactly the target's law (tests/test_tree_sampler.py; ``tree_exactness``).
Randomness of depth t is keyed by (seed_b, offsets_b + t) as in ``tilespec.verify``: accept uniforms
(PURPOSE_ACCEPT, sibling rank) and one categorical draw (PURPOSE_SAMPLE); drafts must not use these streams.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..verify import rng
from ..verify.distributions import log_probs
from ..verify.types import ResolvedSampling, SamplingParams
from .common import DTYPE, EPS_MASS, Stream, TableStream, check_law, uniform_tables  # noqa: F401 (re-exported)
from .schemes import STATIC_KINDS, SchemeSpec, parse_scheme, select
from .token_tree import (KINDS, MAX_NODES, TokenTree, TreeSelection, ancestors, capped,  # noqa: F401 (re-exported)
                         depths, resolved_sampling)
from .tree_distinct import select_distinct


def _target_probs(target_logits: Optional[torch.Tensor], target_probs: Optional[torch.Tensor],
                  sampling: SamplingParams, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """float64 law [R, V] at node nodes[r] of request rows[r] (filters and temperature applied to logits)."""
    if target_probs is not None:
        return target_probs[rows, nodes].to(DTYPE)
    b = target_logits.shape[0]
    resolved = resolved_sampling(sampling, b, target_logits.device)
    full = torch.zeros(b, target_logits.shape[-1], dtype=target_logits.dtype, device=target_logits.device)
    full[rows] = target_logits[rows, nodes]
    probs = torch.exp(log_probs(full[:, None, :].float(), resolved)[:, 0].to(DTYPE))[rows]
    return probs / probs.sum(-1, keepdim=True)


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
        if bool((resolved_sampling(sampling, b, tgt.device).lenience != 1).any()):
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
        return select_distinct(tree, target_logits, target_probs, sampling, seeds, offs, sampler,
                                max_depth=max_depth, depth_cap=depth_cap)
    spec = scheme if isinstance(scheme, SchemeSpec) else parse_scheme(scheme)
    if max_depth is not None and max_width is not None and spec.kind in STATIC_KINDS:
        return _select_iid_static(tree, target_logits, target_probs, sampling, spec, seeds, offs, sampler,
                                  uniforms, depth_cap, max_depth, max_width)
    return _select_iid(tree, target_logits, target_probs, sampling, spec, seeds, offs, sampler, uniforms, depth_cap)


def _walk_start(tree, depth_cap, max_depth: int) -> tuple:
    """The state an iid walk starts from: (parents, real nodes under the depth cap, tokens (0 on padding), draft laws
    float64, path [B, D+1] (root taken), output tokens [B, D+1], alive nodes (the root), going rows, accepted)."""
    b, n = tree.parents.shape
    dev = tree.parents.device
    parents = tree.parents.long()
    real = capped(tree.real(), depths(parents), depth_cap)
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
