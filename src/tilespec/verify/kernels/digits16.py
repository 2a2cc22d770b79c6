"""The exact fallback of :mod:`.topk16` for rows whose pivot pass collected more than CAP ids (many ties or a flat
top, or k above the number of segments): u* fixed digit by digit, most significant first.

``fallback_row``, run by :mod:`.topk16`'s finish kernel (one program per row) before it reads the work area;
it does nothing unless its row overflowed. For each digit (``DIGITS``, 6 / 5 / 5 key bits by default) it streams the
row in chunks, counts the digit (``tl.histogram``) over the ids that carry the digits fixed so far, and fixes the
largest digit d with count(digit >= d) >= the rank left. Then u* and its multiplicity go to the work area, and
with top-p the bits of the ids with key > u* (fewer than k) to ``vals``. Integer counts: exact and deterministic.
One program reads its row once per digit (and once more for top-p): slow (~100s of us), but only for such rows.
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import triton
import triton.language as tl

from .keys16 import ROW_WORDS, W_ABOVE_N, W_AT, W_PIVOT_N, W_USTAR, bits_to_key, load_bits, top_on

# key bits fixed per counting pass (sum 16, at most 4 passes; top_k_thresholds16's ``digits`` takes others)
DIGITS = (6, 5, 5)


@triton.jit
def _digit(row, V, prefix, rem, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr,
           CHUNK: tl.constexpr):
    """Fixes the digit (u >> SHIFT) & (2^BITS - 1) of u* below ``prefix`` (the digits above it): returns the
    extended prefix, the rank left below it and the count of ids carrying the extended prefix."""
    counts = tl.zeros([1 << BITS], tl.int32)
    for start in range(0, V, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        u = bits_to_key(load_bits(row, offs, V))
        mask = offs < V
        if not FIRST:
            mask = mask & ((u >> (SHIFT + BITS)) == prefix)
        # tl.histogram without its mask argument (older Triton lacks it): dropped ids go to bin 0, then corrected
        part = tl.histogram(tl.where(mask, (u >> SHIFT) & ((1 << BITS) - 1), 0), 1 << BITS)
        counts += part - tl.where(tl.arange(0, 1 << BITS) == 0, CHUNK - tl.sum(mask.to(tl.int32), axis=0), 0)
    j_all = tl.arange(0, 1 << BITS)
    above_incl = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts     # count(digit >= j)
    j = tl.max(tl.where(above_incl >= rem, j_all, -1), axis=0)
    above = tl.sum(tl.where(j_all > j, counts, 0), axis=0)
    return (prefix << BITS) | j, rem - above, tl.sum(tl.where(j_all == j, counts, 0), axis=0)


@triton.jit
def fallback_row(row, b, hist_ptr, vals_ptr, k_ptr, n, V, CHUNK: tl.constexpr, CAP: tl.constexpr,
                 COLLECT: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
    """Row n's fallback (``row`` its pointer, ``b`` its request; nothing unless the row is on and overflowed);
    called by :mod:`.topk16`'s finish kernel, which reads the work area after a barrier."""
    k, on = top_on(k_ptr, b, V)
    area = hist_ptr + n * ROW_WORDS
    if on & (tl.load(area + W_PIVOT_N) > CAP):
        u, rem, at = _digit(row, V, k * 0, k, 16 - B0, B0, True, CHUNK)
        if B1 > 0:
            u, rem, at = _digit(row, V, u, rem, 16 - B0 - B1, B1, False, CHUNK)
        if B2 > 0:
            u, rem, at = _digit(row, V, u, rem, 16 - B0 - B1 - B2, B2, False, CHUNK)
        if B3 > 0:
            u, rem, at = _digit(row, V, u, rem, 0, B3, False, CHUNK)
        tl.store(area + W_USTAR, u.to(tl.int32))
        tl.store(area + W_AT, at.to(tl.int32))
        if COLLECT:   # bits of the ids with key > u* (fewer than k <= CAP), in id order
            base = 0
            for start in range(0, V, CHUNK):
                offs = start + tl.arange(0, CHUNK)
                s = load_bits(row, offs, V)
                take = (offs < V) & (bits_to_key(s) > u)
                slot = base + tl.cumsum(take.to(tl.int32), axis=0) - 1
                tl.store(vals_ptr + n.to(tl.int64) * CAP + slot, s, mask=take & (slot < CAP))
                base += tl.sum(take.to(tl.int32), axis=0)
            tl.store(area + W_ABOVE_N, base)
