"""Shared pieces of the multi-draft token-level selection rules (TLSR): inputs, randomness, results.

Conventions (every scheme, batched over N rows = (request, position) pairs):

* ``p``      [N, V] float64 target law of the row (rows sum to 1).
* ``qs``     [N, K, V] float64 law of candidate k; identical drafts repeat the same row.
* ``tokens`` [N, K] int64 the candidates X_1..X_K, X_k ~ qs[:, k], independent.
* ``mask``   [N, K] bool, which candidates take part (the alive drafts in a chain); at least one per row.

Randomness is a :class:`Stream`: counter-based Philox uniforms keyed by (seed, position, purpose, index) from
:mod:`tilespec.verify.rng`, so results do not depend on batch layout. Index use (fixed, disjoint):
``PURPOSE_ACCEPT``/k is the accept test of candidate k (k = 0 is the single-draft test, so K = 1 matches the
``reference`` verify method), ``PURPOSE_EXTRA``/j are scheme-internal coins, ``PURPOSE_SAMPLE``/v is Gumbel
noise of token v (or /0 the inverse-CDF uniform with ``sampler='cdf'``) for the one categorical draw a scheme makes per row (residual, bonus or post-processing
sample; the branches that use it are mutually exclusive and decided independently of it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..verify import rng

EPS_MASS = 1e-12          # a residual mass below this is rounding noise: the accept test is then sure to pass
DTYPE = torch.float64


@torch.library.custom_op("tilespec::cumsum_last", mutates_args=())
def _opaque_cumsum(x: torch.Tensor) -> torch.Tensor:
    """ATen's cumsum over the last axis, opaque to inductor: a compiled caller (engine/fused.py) sums exactly as the
    eager one, and inductor's own scan kernel, which fails to generate for the 'cdf' draw's float64 rows over a whole
    vocabulary (torch 2.11), is never made."""
    return torch.cumsum(x, dim=-1)


@_opaque_cumsum.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@dataclass
class Selection:
    """Result of one TLSR on N rows.

    token [N] int64 emitted token Y (law exactly p).  index [N] int64 first active k with X_k == Y, else -1.
    is_candidate [N] bool  (= index >= 0, the "membership" acceptance event).
    test_pass [N] bool     a candidate passed the scheme's accept test (<= is_candidate).
    """

    token: torch.Tensor
    index: torch.Tensor
    is_candidate: torch.Tensor
    test_pass: torch.Tensor


class Stream:
    """Keyed uniforms and categorical draws for N rows: seeds [N] int64, positions [N] int64."""

    def __init__(self, seeds: torch.Tensor, positions: torch.Tensor, sampler: str = "gumbel"):
        if sampler not in ("gumbel", "cdf"):
            raise ValueError(f"sampler must be 'gumbel' or 'cdf', got {sampler!r}")
        seeds = torch.as_tensor(seeds, dtype=torch.int64)
        positions = torch.as_tensor(positions, dtype=torch.int64, device=seeds.device)
        self.seeds, self.positions = torch.broadcast_tensors(seeds, positions)
        self.sampler = sampler

    @classmethod
    def for_rows(cls, n: int, seed: int = 0, position: int = 0, device=None) -> "Stream":
        """N independent rows: seeds seed*2^20 + row, all at ``position``."""
        seeds = seed * (1 << 20) + torch.arange(n, dtype=torch.int64, device=device)
        return cls(seeds, torch.full((n,), position, dtype=torch.int64, device=device))

    def subset(self, rows: torch.Tensor) -> "Stream":
        return Stream(self.seeds[rows], self.positions[rows], self.sampler)

    def accept(self, k: int) -> torch.Tensor:
        """[N] float64 uniform of candidate k's accept test."""
        return rng.uniform(self.seeds, self.positions, rng.PURPOSE_ACCEPT, k).to(DTYPE)

    def extra(self, j: int) -> torch.Tensor:
        """[N] float64 uniform j of the scheme's internal coins."""
        return rng.uniform(self.seeds, self.positions, rng.PURPOSE_EXTRA, j).to(DTYPE)

    def sample(self, weights: torch.Tensor) -> torch.Tensor:
        """[N] int64 one draw per row from norm(weights) [N, V].

        'gumbel' (default): argmax(log w + Gumbel noise keyed by token id) (V Philox draws per row). 'cdf': inverse
        CDF with one keyed uniform u (PURPOSE_SAMPLE, index 0): the first token whose cumulative weight exceeds
        u * total (zero-weight tokens are never chosen); O(V) adds; the law of the ``reference`` method's sampler
        (``rng.inverse_cdf``, which sums in fp32 tile by tile: draws agree except within rounding of a boundary).
        """
        if self.sampler == "cdf":
            w = weights.clamp(min=0).to(DTYPE)
            cdf = _opaque_cumsum(w) if torch.compiler.is_compiling() else torch.cumsum(w, dim=-1)
            u = rng.uniform(self.seeds, self.positions, rng.PURPOSE_SAMPLE, 0).to(DTYPE)
            idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
            return idx.clamp(max=weights.shape[-1] - 1)
        vocab = torch.arange(weights.shape[-1], device=weights.device)
        noise = rng.gumbel(self.seeds[:, None], self.positions[:, None], rng.PURPOSE_SAMPLE, vocab[None, :])
        logw = torch.log(weights.clamp(min=0).to(DTYPE))
        return torch.argmax(logw + noise.to(DTYPE), dim=-1)


def check_inputs(p: torch.Tensor, qs: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None,
                 validate: bool = True):
    """Validate shapes (and, with ``validate``, values) and return (p, qs, tokens, mask) as float64/int64/bool."""
    if p.dim() != 2:
        raise ValueError(f"p must be [N, V], got shape {tuple(p.shape)}")
    n, v = p.shape
    if qs.dim() != 3 or qs.shape[0] != n or qs.shape[2] != v:
        raise ValueError(f"qs must be [N, K, V] = [{n}, K, {v}], got {tuple(qs.shape)}")
    k = qs.shape[1]
    if k < 1:
        raise ValueError("need at least one candidate (K >= 1)")
    if tokens.shape != (n, k):
        raise ValueError(f"tokens must be [N, K] = [{n}, {k}], got {tuple(tokens.shape)}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must be integer, got {tokens.dtype}")
    if mask is None:
        mask = torch.ones(n, k, dtype=torch.bool, device=p.device)
    if mask.shape != (n, k):
        raise ValueError(f"mask must be [N, K] = [{n}, {k}], got {tuple(mask.shape)}")
    mask = mask.bool()
    p, qs, tokens = p.to(DTYPE), qs.to(DTYPE), tokens.long()
    if not validate:
        return p, qs, tokens, mask
    if n and not bool(mask.any(dim=1).all()):
        raise ValueError("every row needs at least one active candidate")
    if n and (bool((tokens[mask] < 0).any()) or bool((tokens[mask] >= v).any())):
        raise ValueError(f"candidate tokens must lie in [0, {v})")
    check_law(p, "p")
    check_law(qs, "qs")
    return p, qs, tokens, mask


def check_law(x: torch.Tensor, name: str, tol: float = 1e-4) -> None:
    """Raise ValueError unless x [..., V] holds finite non-negative rows summing to 1 (within tol)."""
    if x.numel() == 0:
        return
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf")
    if bool((x < 0).any()):
        raise ValueError(f"{name} has negative probabilities")
    if bool(((x.sum(-1) - 1).abs() > tol).any()):
        raise ValueError(f"{name} rows must sum to 1")


def gather(x: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """x [N, V], tok [N] -> x[n, tok[n]] [N]."""
    return x.gather(-1, tok.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def membership(y: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] int64: first active k with tokens[:, k] == y, else -1."""
    hit = (tokens == y[:, None]) & mask
    k = tokens.shape[1]
    first = torch.where(hit, torch.arange(k, device=y.device)[None, :], torch.full_like(tokens, k)).min(dim=1).values
    return torch.where(first < k, first, torch.full_like(first, -1))


def finish(p_or_w: torch.Tensor, chosen: torch.Tensor, passed: torch.Tensor, tokens: torch.Tensor,
           mask: torch.Tensor, stream: Stream, static: bool = False) -> Selection:
    """Rows with ``passed`` emit ``chosen``; the others draw from norm(p_or_w) [N, V]. ``static``: draw for every
    row and keep the draws of the others (the same numbers: a row's draw is keyed by its seed and position only) --
    no host sync, static shapes."""
    y = chosen.clone()
    need = ~passed
    if static:       # rows that passed draw too (their weights are non-negative; the draw is discarded)
        y = torch.where(need, stream.sample(p_or_w), y)
    elif bool(need.any()):
        rows = need.nonzero().squeeze(1)
        y[rows] = stream.subset(rows).sample(p_or_w[rows])
    idx = membership(y, tokens, mask)
    return Selection(token=y, index=idx, is_candidate=idx >= 0, test_pass=passed)


class TableStream(Stream):
    """A :class:`~.common.Stream` whose accept uniforms (PURPOSE_ACCEPT, k < K) and inverse-CDF uniform
    (PURPOSE_SAMPLE, 0) were drawn in one batch beforehand: the same numbers (same keys), read from tables, so a
    selection loop launches no Philox of its own per candidate. accept [R, K], sample_u [R]."""

    def __init__(self, seeds, positions, accept_u: torch.Tensor, sample_u: torch.Tensor, sampler: str):
        super().__init__(seeds, positions, sampler)
        self.accept_u, self.sample_u = accept_u, sample_u

    def subset(self, rows: torch.Tensor) -> "TableStream":
        return TableStream(self.seeds[rows], self.positions[rows], self.accept_u[rows], self.sample_u[rows],
                           self.sampler)

    def accept(self, k: int) -> torch.Tensor:
        if k < self.accept_u.shape[1]:
            return self.accept_u[:, k]
        return super().accept(k)

    def sample(self, weights: torch.Tensor) -> torch.Tensor:
        if self.sampler != "cdf":
            return super().sample(weights)
        cdf = torch.cumsum(weights.clamp(min=0).to(DTYPE), dim=-1)
        idx = torch.searchsorted(cdf, (self.sample_u * cdf[:, -1])[:, None], right=True).squeeze(1)
        return idx.clamp(max=weights.shape[-1] - 1)


def uniform_tables(seeds: torch.Tensor, offsets: torch.Tensor, depth: int, width: int) -> tuple:
    """(accept [B, depth, width], sample [B, depth]) float64 uniforms keyed (seed, offsets + t, purpose, k): the
    numbers :class:`~.common.Stream` would draw at depths t < depth, for candidates k < width."""
    pos = offsets[:, None] + torch.arange(depth, device=seeds.device)[None, :]
    k = torch.arange(width, device=seeds.device)
    acc = rng.uniform(seeds[:, None, None], pos[:, :, None], rng.PURPOSE_ACCEPT, k[None, None, :]).to(DTYPE)
    smp = rng.uniform(seeds[:, None], pos, rng.PURPOSE_SAMPLE, 0).to(DTYPE)
    return acc, smp
