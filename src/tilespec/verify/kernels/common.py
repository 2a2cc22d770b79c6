"""Device helpers shared by the verification kernels (Triton ``@jit`` functions, inlined into callers).

Random numbers follow :mod:`tilespec.verify.rng` exactly: the first word of Philox-4x32-10 keyed by the 64-bit
request seed with counter (token, position mod 2^32, purpose, 0), mapped to ((x >> 9) + 0.5) / 2^23.
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import triton
import triton.language as tl

from .. import rng

PURPOSE_ACCEPT = tl.constexpr(rng.PURPOSE_ACCEPT)
PURPOSE_SAMPLE = tl.constexpr(rng.PURPOSE_SAMPLE)
PHILOX_ROUNDS = tl.constexpr(rng.PHILOX_ROUNDS)

# Draft kinds (constexpr switch): no draft distribution (one-hot at the drafted token), logits, probabilities.
DRAFT_NONE = tl.constexpr(0)
DRAFT_LOGITS = tl.constexpr(1)
DRAFT_PROBS = tl.constexpr(2)
# How pass 2 turns a row into log-weights: exact logits (fused), sigmoid approximation, probabilities (tiled).
MODE_LOGITS = tl.constexpr(0)
MODE_SIGMOID = tl.constexpr(1)
MODE_PROBS = tl.constexpr(2)


@triton.jit
def keyed_uniform(seed, position, purpose: tl.constexpr, token):
    """Uniform (0, 1) float32 for int32 tensor ``token`` at int64 scalar/tensor ``position``."""
    c0 = token.to(tl.uint32, bitcast=True)
    pos32 = (position & 0xFFFFFFFF).to(tl.uint32)
    c1 = tl.zeros_like(c0) + pos32
    c2 = tl.full(c0.shape, purpose, tl.uint32)
    c3 = tl.zeros_like(c0)
    x, _, _, _ = tl.philox(seed, c0, c1, c2, c3, PHILOX_ROUNDS)
    return ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)




@triton.jit
def log_sigmoid_hat(z, alpha, beta):
    """log of the paper's sigmoid surrogate: 0 prob below alpha, 1 above beta, else sigmoid((z-a)/(b-a))."""
    t = (z - alpha) / (beta - alpha)
    mid = -tl.log(1.0 + tl.exp(-t))
    out = tl.where(z > beta, 0.0, mid)
    return tl.where(z < alpha, float("-inf"), out)


@triton.jit
def chunk_lse(mm, ss, AXIS: tl.constexpr):
    """(max, log-sum-exp) along AXIS of a row from its pass-1 chunk statistics: maxima ``mm`` and sums
    ``ss`` = sum exp(z - mm) (fully masked chunks: -inf / 0; a fully masked row gives (-inf, -inf))."""
    big_m = tl.max(mm, axis=AXIS)
    safe = tl.where(big_m == float("-inf"), 0.0, big_m)
    total = tl.sum(tl.where(mm == float("-inf"), 0.0, ss * tl.exp(mm - tl.expand_dims(safe, AXIS))), axis=AXIS)
    return big_m, safe + tl.log(total)


@triton.jit
def cdf_pick(w, idx, target, start, AXIS: tl.constexpr = 0):
    """Inverse-CDF step along AXIS: the first ``idx`` whose running sum of weights ``w`` (>= 0, fp32) exceeds
    ``target``; if rounding leaves none, the last ``idx`` with w > 0; never below ``start`` (rows without weight).
    ``target`` / ``start`` are scalars (1-D blocks) or one value per row (2-D blocks, AXIS = 1)."""
    cum = tl.cumsum(w, axis=AXIS)
    first = tl.min(tl.where(cum > tl.expand_dims(target, AXIS), idx, 2147483647), axis=AXIS)
    last = tl.max(tl.where(w > 0.0, idx, -1), axis=AXIS)
    return tl.maximum(tl.minimum(first, last), start)


@triton.jit
def cdf_tile(mass, tiles, u, AXIS: tl.constexpr = 0):
    """First level of the inverse-CDF draw over per-tile masses ``mass`` (tile index ``tiles``, 0-based):
    target = u * total (total = the running sum's last value), the tile holding it, and the part of the target
    left for that tile (target minus the running sum before it; fp32, the order of :func:`rng.inverse_cdf`)."""
    cum = tl.cumsum(mass, axis=AXIS)
    total = tl.max(cum, axis=AXIS)
    target = u * total
    tile = cdf_pick(mass, tiles, target, 0, AXIS)
    before = tl.sum(tl.where(tiles == tl.expand_dims(tile - 1, AXIS), cum, 0.0), axis=AXIS)
    return tile, target - before


# ---- the same functions for blocks of several requests (``batched`` kernels): one row per request ----

@triton.jit
def keyed_uniform_rows(seed, position, purpose: tl.constexpr, token):
    """:func:`keyed_uniform` for a [R, N] block: ``token`` [R, N] int32, ``seed`` / ``position`` [R, 1] int64
    (one request per row). Bit-identical to keyed_uniform element by element."""
    c0 = token.to(tl.uint32, bitcast=True)
    pos32 = (position & 0xFFFFFFFF).to(tl.uint32)
    c1 = tl.broadcast_to(pos32, c0.shape)
    c2 = tl.full(c0.shape, purpose, tl.uint32)
    c3 = tl.zeros_like(c0)
    x, _, _, _ = tl.philox(seed, c0, c1, c2, c3, PHILOX_ROUNDS)
    return ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)

