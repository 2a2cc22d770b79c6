"""Reductions over wide rows (a vocabulary: ~10^5 entries) when there are few rows: argmax, top-k, log-softmax.

Why: a reduction kernel walks a row in one program, so a few rows of 151,936 logits (a token tree's 32 nodes, one
request's verify rows) keep a handful of the GPU's SMs busy for 30-100 µs; inductor's kernels in a captured step do
exactly that (``step-cost-*.json``). Here each row is cut into chunks of :data:`CHUNK` entries (the tail chunk
padded with -inf): a first pass reduces every chunk (rows x chunks programs), a second the few chunk results.

Same results as the one-pass ops: :func:`argmax` keeps the first index of the maximum (NaN counts as the maximum,
as in ``torch.argmax``); :func:`topk` returns the same values, largest first (indices of tied values may differ,
as ``torch.topk``'s may); :func:`logsumexp` / :func:`log_softmax` agree with torch's to float rounding. Plain
PyTorch ops, so they compile inside inductor regions and run unchanged on CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 2048


def _chunked(x: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [..., S, CHUNK], S = ceil(V / CHUNK), the tail padded with -inf."""
    pad = -x.shape[-1] % CHUNK
    if pad:
        x = F.pad(x, (0, pad), value=float("-inf"))
    return x.reshape(*x.shape[:-1], -1, CHUNK)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """[..., V] float -> [...] int64: the first index of each row's maximum."""
    if x.shape[-1] <= CHUNK:
        return x.argmax(dim=-1)
    vals, idx = _chunked(x).max(dim=-1)                     # [..., S]: first maximum of every chunk
    best = vals.argmax(dim=-1, keepdim=True)                # the first chunk holding the row's maximum
    return (best * CHUNK + idx.gather(-1, best)).squeeze(-1)


def topk(x: torch.Tensor, k: int) -> tuple:
    """[..., V] float -> (values, indices) [..., k], largest first: ``x.topk(k, dim=-1)``. A row with fewer than k
    entries above -inf may get -inf entries (any of them), as from torch.topk."""
    v = x.shape[-1]
    if v <= 2 * CHUNK or k > CHUNK:
        return x.topk(k, dim=-1)
    vals, idx = _chunked(x).topk(k, dim=-1)                  # [..., S, k]: the top k of every chunk
    idx = idx + CHUNK * torch.arange(vals.shape[-2], device=x.device)[:, None]
    top, pick = vals.flatten(-2).topk(k, dim=-1)             # the row's top k are among the chunks' top k
    return top, idx.flatten(-2).gather(-1, pick).clamp(max=v - 1)   # clamp: a padding -inf tied with real ones


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[..., V] float -> [...]: log sum exp over the row (-inf for a row of -inf)."""
    if x.shape[-1] <= CHUNK:
        return torch.logsumexp(x, dim=-1)
    c = _chunked(x)
    m = c.amax(dim=-1)                                       # [..., S]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(c - m_safe[..., None]).sum(dim=-1)         # [..., S]
    top = m.amax(dim=-1, keepdim=True)
    top_safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = (s * torch.exp(m_safe - top_safe)).sum(dim=-1)
    return torch.log(total) + top_safe.squeeze(-1)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """[..., V] float -> [..., V]: x minus the row's :func:`logsumexp`."""
    return x - logsumexp(x)[..., None]
