"""Top-k (then top-p) keep thresholds of 16-bit logits (bf16 / fp16) from two 256-bin histograms: exact.

A 16-bit float has 2^16 bit patterns, so the k-th largest logit of a row is one of 2^16 order keys
(u in [0, 2^16): u = bits + 2^15 for a clear sign bit, 2^15 - 1 - (bits & 0x7FFF) for a set one; u is
non-decreasing in the value). The search fixes u digit by digit, most significant first (:data:`DIGITS`, 6 / 5 / 5
bits by default):

* ``_count_kernel``, grid (N, C) per digit (N = B * R rows, C = ceil(V / CHUNK) chunks per row): program (n, c)
  derives the prefix of digits fixed so far from the earlier counts (at each level the largest digit d with
  count(digit >= d) >= the rank left), counts the next digit (``tl.histogram``) over the ids of its chunk that carry
  that prefix and adds the counts to row n's work area (int32 atomics).
* ``_select_kernel``, grid (N,): u* = all digits; t_k = float(value(u*)) / T (a correctly rounded division; T = 1
  for greedy rows): bit for bit what ``keep._top_k_thresholds`` gets from ``torch.topk``. Rows whose request has
  k = 0 or k >= V get -inf.

Top-p after top-k (``filters``' definition: the mass of the top-k-kept set only) needs the kept values, fewer than
k above t_k plus t_k's multiplicity: ``_collect_kernel`` (grid (N, C)) appends z of every id with key > u* to a
[N, next_pow2(k_max)] buffer, ``_top_p_kernel`` (grid (N,)) sorts them and takes the smallest value whose mass
strictly above it, over the kept total, is below top_p (ties kept together, as ``filters.top_p_threshold_sorted``).
Its fp32 sums run over at most k values in sorted order, the reference's over the softmax of the whole row, so the
kept sets can differ only where some S(z) is within float rounding of top_p (as for ``radix``).

Counts are integers, so the atomics' order does not matter; the collected values are sorted before any sum:
deterministic and batch invariant. Fixed grids, no host sync: CUDA-graph safe. Replaces ``torch.topk`` (its radix
select plus a gather of k_max values per row: ~0.55 ms for 384 rows of 151,936 bf16 ids on an H100) and, for top-k
with top-p, the 32-bit radix search. -0.0 and +0.0 get different keys but one threshold value, so the kept set is
the same. NaN logits are rejected by validation; with ``check_values=False`` a NaN sorts above +inf (sign clear) or
below -inf (sign set).
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import os
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

CHUNK = int(os.environ.get("TILESPEC_TOPK16_CHUNK", 4096))    # ids per program of the counting passes
NUM_WARPS = int(os.environ.get("TILESPEC_TOPK16_WARPS", 4))
# key bits fixed per counting pass (sum 16, at most 4 passes). tl.histogram's cost grows with its bins (a ballot
# per bit, then per-lane bit logic for bins / 32 bins), so 3 passes of 64 / 32 / 32 bins beat 2 of 256 (H100).
DIGITS = tuple(int(d) for d in os.environ.get("TILESPEC_TOPK16_DIGITS", "6,5,5").split(","))
# a row's int32 work area: 256 words per pass (its counts), then u* (1024), its count (1025), the number of kept
# values collected for top-p (1026), padding
_ROW_WORDS = 1028
ROW_WORDS = tl.constexpr(_ROW_WORDS)
TOP_P_K_MAX = 1024  # top-p after top-k: the largest k whose kept values one program sorts


@triton.jit
def _row_keys(x_ptr, n, c, R, V, stride_b, stride_r, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    """Order keys u [CHUNK] (int32) of chunk c of row n and the mask of ids < V."""
    b = n // R
    row = x_ptr + b.to(tl.int64) * stride_b + (n % R) * stride_r
    if ALIGNED:
        row = tl.multiple_of(row, 16)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    s = tl.load(row + offs, mask=mask, other=0).to(tl.int32)      # int16 bits, sign-extended
    return tl.where(s >= 0, s + 32768, -1 - s), mask


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


@triton.jit(do_not_specialize=["R", "V", "stride_b", "stride_r"])
def _count_kernel(x_ptr, hist_ptr, k_ptr, R, V, stride_b, stride_r, CHUNK: tl.constexpr, ALIGNED: tl.constexpr,
                  LEVEL: tl.constexpr, SHIFT: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                  B2: tl.constexpr, B3: tl.constexpr, BITS: tl.constexpr):
    """Pass LEVEL: counts of key digit (u >> SHIFT) & (2^BITS - 1) over the ids whose higher digits are the
    prefix fixed by the previous passes, added to words [256 LEVEL, 256 LEVEL + 2^BITS) of row n's work area."""
    n = tl.program_id(0)
    c = tl.program_id(1)
    k = tl.load(k_ptr + n // R)
    if (k > 0) & (k < V):
        area = hist_ptr + n * ROW_WORDS
        prefix, _, _ = _prefix(area, k, LEVEL, B0, B1, B2, B3)
        u, mask = _row_keys(x_ptr, n, c, R, V, stride_b, stride_r, CHUNK, ALIGNED)
        if LEVEL > 0:
            mask = mask & ((u >> (SHIFT + BITS)) == prefix)
        # tl.histogram without its mask argument (older Triton lacks it): dropped ids go to bin 0, then corrected
        counts = tl.histogram(tl.where(mask, (u >> SHIFT) & ((1 << BITS) - 1), 0), 1 << BITS)
        counts -= tl.where(tl.arange(0, 1 << BITS) == 0, CHUNK - tl.sum(mask.to(tl.int32), axis=0), 0)
        tl.atomic_add(area + LEVEL * 256 + tl.arange(0, 1 << BITS), counts, mask=counts > 0)


@triton.jit
def _to_z(u, t, FP16: tl.constexpr):
    """z = float(value of key u) / T (correctly rounded; T = 1 for greedy rows), as ``filters.scaled_logits``."""
    bits = tl.where(u >= 32768, u - 32768, -1 - u).to(tl.int16)
    if FP16:
        x = bits.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        x = bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    return tl.div_rn(x, tl.where(t > 0, t, 1.0))


@triton.jit(do_not_specialize=["R", "V"])
def _select_kernel(hist_ptr, k_ptr, temp_ptr, thr_ptr, R, V, FP16: tl.constexpr, LEVELS: tl.constexpr,
                   B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
    """thr[n] = t_k; words 1024 / 1025 of row n's work area: u* and the number of ids with key u* (for top-p)."""
    n = tl.program_id(0)
    k = tl.load(k_ptr + n // R)
    thr = float("-inf")
    if (k > 0) & (k < V):
        area = hist_ptr + n * ROW_WORDS
        u, _, at = _prefix(area, k, LEVELS, B0, B1, B2, B3)
        thr = _to_z(u, tl.load(temp_ptr + n // R), FP16)
        tl.store(area + 1024, u.to(tl.int32))
        tl.store(area + 1025, at.to(tl.int32))
    tl.store(thr_ptr + n, thr)


@triton.jit(do_not_specialize=["R", "V", "stride_b", "stride_r"])
def _collect_kernel(x_ptr, hist_ptr, val_ptr, k_ptr, temp_ptr, R, V, stride_b, stride_r,
                    CHUNK: tl.constexpr, KCAP: tl.constexpr, ALIGNED: tl.constexpr, FP16: tl.constexpr):
    """Appends z of every id with key > u* (fewer than k of them) to val[n, :] (slots from the int32 counter in
    word 1026 of the row's work area; the order is arbitrary, the top-p step sorts)."""
    n = tl.program_id(0)
    c = tl.program_id(1)
    k = tl.load(k_ptr + n // R)
    if (k > 0) & (k < V):
        u, mask = _row_keys(x_ptr, n, c, R, V, stride_b, stride_r, CHUNK, ALIGNED)
        take = mask & (u > tl.load(hist_ptr + n * ROW_WORDS + 1024))
        count = tl.sum(take.to(tl.int32), axis=0)
        if count > 0:
            slot = tl.atomic_add(hist_ptr + n * ROW_WORDS + 1026, count) + tl.cumsum(take.to(tl.int32), axis=0) - 1
            z = _to_z(u, tl.load(temp_ptr + n // R), FP16)
            tl.store(val_ptr + n * KCAP + slot, z, mask=take & (slot < KCAP))


@triton.jit(do_not_specialize=["R"])
def _top_p_kernel(val_ptr, hist_ptr, thr_ptr, p_ptr, R, KCAP: tl.constexpr):
    """thr[n] = t_p of the top-k-kept set (its values above t_k in val[n], t_k = thr[n] with multiplicity
    word 1025 of the row's work area): the smallest kept value whose mass strictly above it, over the kept set's total, is < top_p."""
    n = tl.program_id(0)
    p = tl.load(p_ptr + n // R)
    t_k = tl.load(thr_ptr + n)
    if (p < 1.0) & (t_k > float("-inf")):
        i = tl.arange(0, KCAP)
        n_above = tl.load(hist_ptr + n * ROW_WORDS + 1026)
        v = tl.sort(tl.load(val_ptr + n * KCAP + i, mask=i < n_above, other=float("-inf")), descending=True)
        top = tl.maximum(tl.max(v, axis=0), t_k)
        w = tl.exp(v - top)                                         # -inf padding: 0
        above = tl.sum(w, axis=0)
        total = above + tl.load(hist_ptr + n * ROW_WORDS + 1025).to(tl.float32) * tl.exp(t_k - top)
        kept = ((tl.cumsum(w, axis=0) - w) / total < p) & (i < n_above)
        t_p = tl.min(tl.where(kept, v, float("inf")), axis=0)
        tl.store(thr_ptr + n, tl.where(above / total < p, t_k, t_p))


def supports(logits: torch.Tensor) -> bool:
    """Whether :func:`top_k_thresholds16` takes these logits (16-bit floats, ids contiguous)."""
    return logits.dtype in (torch.bfloat16, torch.float16) and logits.stride(-1) == 1


def top_k_thresholds16(logits: torch.Tensor, top_k: torch.Tensor, temperature: torch.Tensor,
                       top_p: Optional[torch.Tensor] = None, k_max: int = 0, *, digits: Sequence[int] = (),
                       chunk: int = 0, num_warps: int = 0) -> torch.Tensor:
    """Keep thresholds float32 [B, R] of top-k (then top-p over the kept set when ``top_p`` is given): -inf where
    k = 0 or k >= V.

    ``logits`` [B, R, V] bf16 / fp16 with unit stride over V; ``top_k`` [B] int64, ``temperature`` and ``top_p``
    [B] float32, on the logits' device. With ``top_p``, ``k_max`` >= every k (at most :data:`TOP_P_K_MAX`) sizes
    the buffer of kept values. ``digits`` / ``chunk`` / ``num_warps``: :data:`DIGITS` / :data:`CHUNK` /
    :data:`NUM_WARPS` when not given (for benchmarks). Launches: a memset, one per digit, the selection; top-p
    adds two. No host sync."""
    if not supports(logits):
        raise ValueError(f"top_k_thresholds16 takes bf16 / fp16 logits with unit stride over V, got "
                         f"{logits.dtype} with strides {tuple(logits.stride())}")
    if top_p is not None and not 1 <= k_max <= TOP_P_K_MAX:
        raise ValueError(f"top-p after top-k needs 1 <= k_max <= {TOP_P_K_MAX}, got {k_max}")
    digits, chunk, num_warps = tuple(digits or DIGITS), chunk or CHUNK, num_warps or NUM_WARPS
    if sum(digits) != 16 or not 1 <= len(digits) <= 4 or not all(1 <= d <= 8 for d in digits):
        raise ValueError(f"digits must be 1 to 4 widths in [1, 8] summing to 16, got {digits}")
    batch, rows, vocab = logits.shape
    n_rows = batch * rows
    bits = logits.view(torch.int16)
    hist = torch.zeros((n_rows, _ROW_WORDS), device=logits.device, dtype=torch.int32)   # per-row work areas
    thr = torch.empty((batch, rows), device=logits.device, dtype=torch.float32)
    strides = (bits.stride(0), bits.stride(1))
    aligned = bits.data_ptr() % 16 == 0 and vocab % 8 == 0 and all(s % 8 == 0 for s in strides)
    grid = (n_rows, triton.cdiv(vocab, chunk))
    fp16 = logits.dtype == torch.float16
    widths = dict(zip(("B0", "B1", "B2", "B3"), (*digits, 0, 0, 0)))
    args = (bits, hist, top_k, rows, vocab, *strides)
    for level, width in enumerate(digits):
        _count_kernel[grid](*args, CHUNK=chunk, ALIGNED=aligned, LEVEL=level, SHIFT=16 - sum(digits[:level + 1]),
                            BITS=width, num_warps=num_warps, **widths)
    _select_kernel[(n_rows,)](hist, top_k, temperature, thr, rows, vocab, FP16=fp16, LEVELS=len(digits),
                              num_warps=1, **widths)
    if top_p is not None:
        kcap = max(16, triton.next_power_of_2(k_max))
        vals = torch.empty((n_rows, kcap), device=logits.device, dtype=torch.float32)
        _collect_kernel[grid](bits, hist, vals, top_k, temperature, rows, vocab, *strides, CHUNK=chunk,
                              KCAP=kcap, ALIGNED=aligned, FP16=fp16, num_warps=num_warps)
        _top_p_kernel[(n_rows,)](vals, hist, thr, top_p, rows, KCAP=kcap, num_warps=4)
    return thr
