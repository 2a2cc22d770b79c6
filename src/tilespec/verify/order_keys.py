"""Order-preserving int keys of float32 values, shared by the threshold search in PyTorch (:mod:`.filters`) and the
Triton threshold kernels (:mod:`.kernels.thresholds`, :mod:`.kernels.radix`): key(a) < key(b) whenever a < b, so a
threshold search over values is an integer search over keys. Plain PyTorch, no other tilespec import.
"""
from __future__ import annotations

import torch

KEY_NEG_INF = -2139095041        # order_key(-inf); every non-NaN float has a key in [KEY_NEG_INF, KEY_POS_INF]
KEY_NAN = 2139095041             # order_key(+inf) + 1: a NaN, compares false with everything (count 0, S = 0)
KEY_BITS = 32


def order_key(x: torch.Tensor) -> torch.Tensor:
    """int64 keys of float32 ``x`` with key(a) < key(b) whenever a < b (-0.0 sorts just below +0.0)."""
    i = x.contiguous().view(torch.int32)
    return (i ^ ((i >> 31) & 0x7FFFFFFF)).to(torch.int64)


def key_float(key: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`order_key` (int64 -> float32); keys above order_key(+inf) give NaN."""
    k = key.clamp(max=KEY_NAN).to(torch.int32)
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).view(torch.float32)
