"""Keyed Gumbel-max sampling of one token per row from a processed distribution: what drafts sample with.

:func:`sample_keyed` draws token ~ exp(log_probs(logits, sampling)) with Gumbel noise keyed by (seed, position,
purpose, vocabulary id) (:func:`tilespec.verify.rng.gumbel`), so a draw never depends on the batch and replays under
CUDA graphs. On a GPU with Triton and without top-k / top-p / min-p it is one kernel launch
(:mod:`tilespec.verify.kernels.gumbel`: argmax of z / T + noise, the log-normaliser being the same for every id);
with filters the filtered log-probabilities are formed in PyTorch and the kernel adds the noise; on the CPU it is
:func:`gumbel_argmax_reference`. The kernel and the reference use the same uniforms and the same arithmetic up to
float rounding (an id can differ only at a near-tie of two noisy scores).
"""
from __future__ import annotations

from typing import Optional

import torch

from tilespec.env import triton_available

from . import rng
from .distributions import log_probs
from .types import ResolvedSampling


def gumbel_argmax_reference(logp: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, purpose: int,
                            ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """argmax_i (logp[b, i] + G(seed_b, position_b, purpose, id_i)) -> ids [B] (``ids[i]``, else i)."""
    vocab = ids if ids is not None else torch.arange(logp.shape[-1], device=logp.device)
    noise = rng.gumbel(seeds[:, None], positions[:, None], purpose, vocab[None, :])
    return vocab[torch.argmax(logp + noise, dim=-1)]


def sample_keyed(logits: torch.Tensor, sampling: ResolvedSampling, seeds: torch.Tensor, positions: torch.Tensor,
                 purpose: int = rng.PURPOSE_EXTRA, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row from exp(log_probs(logits [B, N], sampling)): [B] int64 (``ids[i]`` for column i when
    ``ids`` [N] maps columns to vocabulary ids, e.g. a draft head's reduced vocabulary; the noise is keyed by that
    id). ``sampling`` is resolved for the B rows. Greedy rows take the first argmax. Shapes and dtypes are checked
    (ValueError naming the argument; no host sync)."""
    _check(logits, sampling, seeds, positions, ids)
    if _kernel_on(logits):
        from .kernels.gumbel import gumbel_argmax
        rows = logits if logits.stride(-1) == 1 else logits.contiguous()
        if not sampling.has_filters:
            return gumbel_argmax(rows, sampling.temperature, seeds, positions, purpose, ids)
        logp = log_probs(rows.float()[:, None, :], sampling)[:, 0]
        return gumbel_argmax(logp, torch.ones_like(sampling.temperature), seeds, positions, purpose, ids)
    logp = log_probs(logits.float()[:, None, :], sampling)[:, 0]
    return gumbel_argmax_reference(logp, seeds, positions, purpose, ids)


def _check(logits, sampling, seeds, positions, ids) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [B, N], got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    b, n = logits.shape
    for name, t in (("seeds", seeds), ("positions", positions)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (b,) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be an int64 tensor [B] = [{b}]")
    if ids is not None and (not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (n,) or ids.dtype != torch.int64):
        raise ValueError(f"ids must be an int64 tensor [N] = [{n}] (the vocabulary id of each column)")
    if tuple(sampling.temperature.shape) != (b,):
        raise ValueError(f"sampling is resolved for {tuple(sampling.temperature.shape)} rows, the logits have {b}")


def _kernel_on(logits: torch.Tensor) -> bool:
    """Whether the Triton kernel samples ``logits`` (a GPU with Triton; the CPU's interpreter would be slow)."""
    return logits.is_cuda and triton_available()
