"""The exact fallback of :mod:`.topk16` for rows whose pivot pass collected more than CAP ids (many ties or a flat
top, or k above the number of segments): u* fixed digit by digit, most significant first.

* ``count_kernel``, grid (N, C) per digit (``DIGITS``, 6 / 5 / 5 key bits by default): program (n, c) derives the
  digits fixed so far from the earlier counts (at each pass the largest digit d with count(digit >= d) >= the rank
  left), counts the next digit (``tl.histogram``) over the ids of its chunk that carry that prefix and adds the
  counts to row n's work area (int32 atomics: integer counts, so their order does not matter).
* ``select_kernel``, grid (N,): u* = all digits and its multiplicity.
* ``collect_above_kernel``, grid (N, C): appends the keys > u* (fewer than k) to ``vals`` for the top-p step.

Each program returns at once unless its row overflowed, so a call without fallback rows costs only the launches.
The passes are ALU-bound in tl.histogram (a ballot per digit bit, then bit logic per bin): ~180 us per pass for
384 rows of 151,936 ids on an H100 (``ncu-topk16-H100-session14-*``), hence the pivot path first.
"""
from __future__ import annotations

import os

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import triton
import triton.language as tl

from .keys16 import ROW_WORDS, W_ABOVE_N, W_AT, W_PIVOT_N, W_USTAR, append_keys, row_keys, top_on

# key bits fixed per counting pass (sum 16, at most 4 passes; env TILESPEC_TOPK16_DIGITS="8,8" etc.)
DIGITS = tuple(int(d) for d in os.environ.get("TILESPEC_TOPK16_DIGITS", "6,5,5").split(","))


@triton.jit
def _top_bin(counts, k, BINS: tl.constexpr):
    """(largest bin j with count(bins >= j) >= k, count(bins > j), count(j)) of ``counts`` [BINS]."""
    j_all = tl.arange(0, BINS)
    above_incl = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts     # count(bins >= j)
    j = tl.max(tl.where(above_incl >= k, j_all, -1), axis=0)
    return j, tl.sum(tl.where(j_all > j, counts, 0), axis=0), tl.sum(tl.where(j_all == j, counts, 0), axis=0)


@triton.jit
def _step(area, LEVEL: tl.constexpr, BITS: tl.constexpr, prefix, rem):
    counts = tl.load(area + LEVEL * 256 + tl.arange(0, 1 << BITS))
    j, above, at = _top_bin(counts, rem, 1 << BITS)
    return (prefix << BITS) | j, rem - above, at


@triton.jit
def _prefix(area, k, LEVELS: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
            B3: tl.constexpr):
    """The key digits fixed by the first LEVELS passes' counts (as one integer), the rank left to find below
    them, and the count of the last digit's bin."""
    prefix = k * 0
    rem = k
    at = k * 0
    if LEVELS > 0:
        prefix, rem, at = _step(area, 0, B0, prefix, rem)
    if LEVELS > 1:
        prefix, rem, at = _step(area, 1, B1, prefix, rem)
    if LEVELS > 2:
        prefix, rem, at = _step(area, 2, B2, prefix, rem)
    if LEVELS > 3:
        prefix, rem, at = _step(area, 3, B3, prefix, rem)
    return prefix, rem, at


@triton.jit
def _fallback(k_ptr, hist_ptr, n, R, V, CAP: tl.constexpr):
    """(k, whether row n takes the fallback: top-k on and its pivot pass overflowed)."""
    k, on = top_on(k_ptr, n, R, V)
    return k, on & (tl.load(hist_ptr + n * ROW_WORDS + W_PIVOT_N) > CAP)


@triton.jit(do_not_specialize=["R", "V", "stride_b", "stride_r"])
def count_kernel(x_ptr, hist_ptr, k_ptr, R, V, stride_b, stride_r, CHUNK: tl.constexpr, CAP: tl.constexpr,
                 ALIGNED: tl.constexpr, LEVEL: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr,
                 B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
    """Pass LEVEL: counts of key digit (u >> SHIFT) & (2^BITS - 1) over the ids whose higher digits are the
    prefix fixed by the previous passes, added to words [256 LEVEL, 256 LEVEL + 2^BITS) of row n's work area."""
    n = tl.program_id(0)
    c = tl.program_id(1)
    k, run = _fallback(k_ptr, hist_ptr, n, R, V, CAP)
    if run:
        area = hist_ptr + n * ROW_WORDS
        prefix, _, _ = _prefix(area, k, LEVEL, B0, B1, B2, B3)
        u = row_keys(x_ptr, n, c * CHUNK + tl.arange(0, CHUNK), R, V, stride_b, stride_r, ALIGNED)
        mask = u >= 0
        if LEVEL > 0:
            mask = mask & ((u >> (SHIFT + BITS)) == prefix)
        # tl.histogram without its mask argument (older Triton lacks it): dropped ids go to bin 0, then corrected
        counts = tl.histogram(tl.where(mask, (u >> SHIFT) & ((1 << BITS) - 1), 0), 1 << BITS)
        counts -= tl.where(tl.arange(0, 1 << BITS) == 0, CHUNK - tl.sum(mask.to(tl.int32), axis=0), 0)
        tl.atomic_add(area + LEVEL * 256 + tl.arange(0, 1 << BITS), counts, mask=counts > 0)


@triton.jit(do_not_specialize=["R", "V"])
def select_kernel(hist_ptr, k_ptr, R, V, CAP: tl.constexpr, LEVELS: tl.constexpr, B0: tl.constexpr,
                  B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
    n = tl.program_id(0)
    k, run = _fallback(k_ptr, hist_ptr, n, R, V, CAP)
    if run:
        area = hist_ptr + n * ROW_WORDS
        u, _, at = _prefix(area, k, LEVELS, B0, B1, B2, B3)
        tl.store(area + W_USTAR, u.to(tl.int32))
        tl.store(area + W_AT, at.to(tl.int32))


@triton.jit(do_not_specialize=["R", "V", "stride_b", "stride_r"])
def collect_above_kernel(x_ptr, hist_ptr, vals_ptr, k_ptr, R, V, stride_b, stride_r, CHUNK: tl.constexpr,
                         CAP: tl.constexpr, ALIGNED: tl.constexpr):
    n = tl.program_id(0)
    c = tl.program_id(1)
    _, run = _fallback(k_ptr, hist_ptr, n, R, V, CAP)
    if run:
        area = hist_ptr + n * ROW_WORDS
        u = row_keys(x_ptr, n, c * CHUNK + tl.arange(0, CHUNK), R, V, stride_b, stride_r, ALIGNED)
        append_keys(u, u > tl.load(area + W_USTAR), area, W_ABOVE_N, vals_ptr + n.to(tl.int64) * CAP, CAP)
