"""Reductions over wide rows (a vocabulary: ~10^5 entries) when there are few rows: argmax, top-k, log-softmax.

Why: a reduction kernel walks a row in one program, so a few rows of 151,936 logits (a token tree's 32 nodes, one
request's verify rows) keep a handful of the GPU's SMs busy for 30-100 µs; inductor's kernels in a captured step do
exactly that (``step-cost-*.json``). Here each row is cut into chunks of :data:`CHUNK` entries (the tail chunk
padded with -inf): a first pass reduces every chunk (rows x chunks programs), a second the few chunk results.

Same results as the one-pass ops: :func:`argmax` keeps the first index of the maximum (NaN counts as the maximum,
as in ``torch.argmax``); :func:`topk` returns the same values, largest first (indices of tied values may differ,
as ``torch.topk``'s may; on CUDA a two-launch Triton kernel, verify/kernels/row_topk.py); :func:`logsumexp` / :func:`log_softmax` agree with torch's to float rounding. Plain
PyTorch ops, so they compile inside inductor regions and run unchanged on CPU.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from tilespec.env import triton_available

CHUNK = 2048          # entries per chunk (and per program of the top-k kernel)
MAX_K = 16            # the top-k kernel's largest k
MAX_CANDIDATES = 8192  # chunks x MAX_K of one row the kernel's second launch holds (rows up to 1,048,576)


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
    """[..., V] float -> (values, indices) [..., k], largest first: ``x.topk(k, dim=-1)``. On CUDA two launches of
    :mod:`tilespec.verify.kernels.row_topk` where :func:`kernel_takes` says so; else chunked ``torch.topk`` passes.
    A row with fewer than k entries above -inf may get -inf entries (any of them), as from torch.topk. ValueError for
    k outside [1, V]."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= x.shape[-1]:
        raise ValueError(f"top-k needs an int k in [1, {x.shape[-1]}] (the row width), got {k!r}")
    if x.is_cuda and kernel_takes(x, k):
        return torch.ops.tilespec.row_topk(x, k)
    return _chunked_topk(x, k)


def kernel_takes(x: torch.Tensor, k: int) -> bool:
    """Whether the row top-k kernel takes ``x`` [..., V]: fp32 / bf16 / fp16, 1 <= k <= min(16, V), a wide row
    whose chunks' candidates fit its second launch, Triton installed and the kernel never failed."""
    v = x.shape[-1]
    return (_TRITON and not _KERNEL_FAILED and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and 1 <= k <= min(MAX_K, v) and v > 2 * CHUNK and -(-v // CHUNK) * MAX_K <= MAX_CANDIDATES)


def _chunked_topk(x: torch.Tensor, k: int) -> tuple:
    v = x.shape[-1]
    if v <= 2 * CHUNK or k > CHUNK:
        return x.topk(k, dim=-1)
    vals, idx = _chunked(x).topk(k, dim=-1)                  # [..., S, k]: the top k of every chunk
    idx = idx + CHUNK * torch.arange(vals.shape[-2], device=x.device)[:, None]
    top, pick = vals.flatten(-2).topk(k, dim=-1)             # the row's top k are among the chunks' top k
    return top, idx.flatten(-2).gather(-1, pick).clamp(max=v - 1)   # clamp: a padding -inf tied with real ones


@torch.library.custom_op("tilespec::row_topk", mutates_args=())
def _row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row top-k kernel, opaque to compiled callers (inductor neither traces nor re-specialises it); torch's
    chunked top-k from the first time the kernel fails to build (warned once)."""
    if not _KERNEL_FAILED:
        try:
            from .kernels.row_topk import launch
            return launch(x, k, CHUNK)
        except Exception as err:   # noqa: BLE001 - a kernel that fails to build must not end decoding
            _KERNEL_FAILED.append(f"{type(err).__name__}: {err}")
            warnings.warn(f"the row top-k kernel failed ({_KERNEL_FAILED[0]}); using torch.topk")
    vals, idx = _chunked_topk(x, k)
    return vals.contiguous(), idx.contiguous()


@_row_topk.register_fake
def _(x, k):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


_TRITON = triton_available()
_KERNEL_FAILED: list = []     # the first failure of the row top-k kernel, if any (it is not tried again)


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
