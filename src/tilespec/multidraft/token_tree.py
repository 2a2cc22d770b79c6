"""A batch of token trees and what selection needs of their shape: ancestors, depths, the nodes in play.

Layout (one tree per request, ragged, padded to N nodes): node 0 is the root (the pending token); node n >= 1 has a
parent ``parents[b, n] < n`` and a draft token ``tokens[b, n]``; nodes ``n >= sizes[b]`` are padding (parent -1).
``kind="distinct"`` trees hold deterministic drafts (top-k of a head, several context matches); ``kind="iid"``
trees hold drafts sampled independently from ``draft_probs`` (K sampled children, K sampled chains). Selection:
:mod:`.tree` (dispatch and the iid schemes) and :mod:`.tree_distinct`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..verify.types import ResolvedSampling
from ..verify.validation import resolve_sampling

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


def capped(real: torch.Tensor, depth: torch.Tensor, depth_cap: Optional[torch.Tensor]) -> torch.Tensor:
    """The real nodes no deeper than ``depth_cap`` [B] (None: all real nodes)."""
    return real if depth_cap is None else real & (depth <= depth_cap[:, None])


def resolved_sampling(sampling, batch: int, device) -> ResolvedSampling:
    """``sampling`` as per-request tensors [B]: a ResolvedSampling as given (a compiled caller resolves outside its
    region: the cached constants are read, not built, inside it), SamplingParams resolved."""
    return sampling if isinstance(sampling, ResolvedSampling) else resolve_sampling(sampling, batch, device)
