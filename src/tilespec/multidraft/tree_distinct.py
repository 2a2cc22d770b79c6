"""Exact selection over trees of distinct (deterministic) drafts: recursive rejection with one-hot draft laws.

The children x_1..x_m of the current node are tried in index order (SpecInfer / EAGLE at T > 0): accept x_k with
probability r_{k-1}(x_k), where r_0 = p and r_k is p with x_1..x_k removed and renormalised, i.e. with
u_k < p(x_k) / (1 - p(x_1) - ... - p(x_{k-1})); if every child is rejected, emit a draw from p with the children
removed. A sibling repeating an earlier sibling's token is never accepted (its residual mass is 0). Greedy rows
(one-hot p) follow the longest path matching the argmax. Every node's test is computed at once and the path is read
off with one gather per depth (no host sync). The target's law is read only where needed (:class:`_NodeLaws`);
all-greedy batches read only each node's argmax.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..verify import rng, wide_rows
from ..verify.distributions import log_probs
from ..verify.filters import scaled_logits
from .common import DTYPE, EPS_MASS, Stream
from .token_tree import TreeSelection, ancestors, capped, resolved_sampling


def select_distinct(tree, target_logits, target_probs, sampling, seeds, offs, sampler,
                     renormalise: bool = True, max_depth: Optional[int] = None,
                     depth_cap: Optional[torch.Tensor] = None) -> TreeSelection:
    """``renormalise=False`` drops the division by the rejected siblings' mass: a wrong sampler, kept only as the
    exactness suite's power check."""
    b, n = tree.parents.shape
    dev = tree.parents.device
    parents = tree.parents.long()
    anc = ancestors(parents)
    depth = anc.sum(dim=-1) - 1
    real = capped(tree.real(), depth, depth_cap)
    tokens = torch.where(real, tree.tokens.long(), torch.zeros_like(tree.parents.long()))   # padding: any id
    resolved = resolved_sampling(sampling, b, dev)
    greedy = target_logits is not None and resolved.all_greedy
    if greedy:      # one-hot laws: only each node's argmax is needed, never a [B, N, V] law
        top = wide_rows.argmax(target_logits)                                         # [B, N]
        p_node = (top.gather(1, parents.clamp(min=0)) == tokens).to(DTYPE)
    else:
        law = _NodeLaws(target_logits, target_probs, resolved)
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


class _NodeLaws:
    """The target's processed law at every tree node, read where the selection needs it (never a float64
    [B, N, V] copy): :meth:`at` single entries, :meth:`row` one node's whole law per request. From logits: the
    fp32 log-law (:func:`~tilespec.verify.distributions.log_probs`; without filters or greedy rows a chunked
    log-softmax, :mod:`tilespec.verify.wide_rows`), exponentiated in float64 where read; given probabilities are
    converted to float64 where read."""

    def __init__(self, target_logits, target_probs, resolved):
        if target_probs is not None:
            self.probs, self.logp = target_probs, None
            return
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
            return self.probs[rows, nodes, tokens].to(DTYPE)
        return torch.exp(self.logp[rows, nodes, tokens].to(DTYPE))

    def row(self, node: torch.Tensor) -> torch.Tensor:
        """node [B] -> [B, V] float64: the law at node[b]."""
        rows = torch.arange(node.shape[0], device=node.device)
        if self.probs is not None:
            return self.probs[rows, node].to(DTYPE)
        return torch.exp(self.logp[rows, node].to(DTYPE))
