"""Top-k (then top-p) keep thresholds of 16-bit logits (bf16 / fp16) from two 256-bin histograms: exact.

A 16-bit float has 2^16 bit patterns, so the k-th largest logit of a row is one of 2^16 order keys
(u in [0, 2^16): u = bits + 2^15 for a clear sign bit, 2^15 - 1 - (bits & 0x7FFF) for a set one; u is
non-decreasing in the value). The search fixes u's high byte, then its low byte:

* ``_high_kernel``, grid (N, C) (N = B * R rows, C = ceil(V / CHUNK) chunks per row): program (n, c) counts the high
  bytes of its chunk (``tl.histogram``, 256 bins) and adds them to row n's work area (int32 atomics).
* ``_low_kernel``, grid (N, C): every program derives h* from those counts (the largest h with
  count(high >= h) >= k) and counts the low bytes of the ids of its chunk whose high byte is h*.
* ``_select_kernel``, grid (N,): l* = the largest l with count(high > h*) + count(high = h*, low >= l) >= k;
  t_k = float(value(u* = h* l*)) / T (a correctly rounded division; T = 1 for greedy rows): bit for bit what
  ``keep._top_k_thresholds`` gets from ``torch.topk``. Rows whose request has k = 0 or k >= V get -inf.

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

from typing import Optional

import torch
import triton
import triton.language as tl

CHUNK = 4096        # ids per program of the two histogram passes
NUM_WARPS = 4
# a row's int32 work area: high-byte counts [0, 256), low-byte counts [256, 512), u* (512), its count (513), the
# number of kept values collected (514), padding
_ROW_WORDS = 516
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
def _top_bin(counts, k):
    """(largest bin j with count(bins >= j) >= k, count(bins > j)) of ``counts`` [256]."""
    above_incl = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts     # count(bins >= j)
    j = tl.max(tl.where(above_incl >= k, tl.arange(0, 256), -1), axis=0)
    above = tl.sum(tl.where(tl.arange(0, 256) > j, counts, 0), axis=0)
    return j, above


@triton.jit
def _masked_histogram(bins, keep, CHUNK: tl.constexpr):
    """256-bin histogram of ``bins`` where ``keep`` (tl.histogram without its mask argument, which older Triton
    lacks: dropped ids go to bin 0, whose count is then corrected)."""
    counts = tl.histogram(tl.where(keep, bins, 0), 256)
    dropped = CHUNK - tl.sum(keep.to(tl.int32), axis=0)
    return counts - tl.where(tl.arange(0, 256) == 0, dropped, 0)


@triton.jit(do_not_specialize=["R", "V", "stride_b", "stride_r"])
def _high_kernel(x_ptr, hist_ptr, k_ptr, R, V, stride_b, stride_r, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    n = tl.program_id(0)
    c = tl.program_id(1)
    k = tl.load(k_ptr + n // R)
    if (k > 0) & (k < V):
        u, mask = _row_keys(x_ptr, n, c, R, V, stride_b, stride_r, CHUNK, ALIGNED)
        counts = _masked_histogram(u >> 8, mask, CHUNK)
        tl.atomic_add(hist_ptr + n * ROW_WORDS + tl.arange(0, 256), counts, mask=counts > 0)


@triton.jit(do_not_specialize=["R", "V", "stride_b", "stride_r"])
def _low_kernel(x_ptr, hist_ptr, k_ptr, R, V, stride_b, stride_r, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    n = tl.program_id(0)
    c = tl.program_id(1)
    k = tl.load(k_ptr + n // R)
    if (k > 0) & (k < V):
        h_star, _ = _top_bin(tl.load(hist_ptr + n * ROW_WORDS + tl.arange(0, 256)), k)
        u, mask = _row_keys(x_ptr, n, c, R, V, stride_b, stride_r, CHUNK, ALIGNED)
        counts = _masked_histogram(u & 255, mask & ((u >> 8) == h_star), CHUNK)
        tl.atomic_add(hist_ptr + n * ROW_WORDS + 256 + tl.arange(0, 256), counts, mask=counts > 0)


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
def _select_kernel(hist_ptr, k_ptr, temp_ptr, thr_ptr, R, V, FP16: tl.constexpr):
    """thr[n] = t_k; words 512 / 513 of row n's work area: u* and the number of ids with key u* (for top-p)."""
    n = tl.program_id(0)
    k = tl.load(k_ptr + n // R)
    thr = float("-inf")
    if (k > 0) & (k < V):
        h_star, above = _top_bin(tl.load(hist_ptr + n * ROW_WORDS + tl.arange(0, 256)), k)
        low = tl.load(hist_ptr + n * ROW_WORDS + 256 + tl.arange(0, 256))
        l_star, _ = _top_bin(low, k - above)
        u = h_star * 256 + l_star
        thr = _to_z(u, tl.load(temp_ptr + n // R), FP16)
        tl.store(hist_ptr + n * ROW_WORDS + 512, u)
        tl.store(hist_ptr + n * ROW_WORDS + 513, tl.sum(tl.where(tl.arange(0, 256) == l_star, low, 0), axis=0))
    tl.store(thr_ptr + n, thr)


@triton.jit(do_not_specialize=["R", "V", "stride_b", "stride_r"])
def _collect_kernel(x_ptr, hist_ptr, val_ptr, k_ptr, temp_ptr, R, V, stride_b, stride_r,
                    CHUNK: tl.constexpr, KCAP: tl.constexpr, ALIGNED: tl.constexpr, FP16: tl.constexpr):
    """Appends z of every id with key > u* (fewer than k of them) to val[n, :] (slots from the int32 counter in
    word 514 of the row's work area; the order is arbitrary, the top-p step sorts)."""
    n = tl.program_id(0)
    c = tl.program_id(1)
    k = tl.load(k_ptr + n // R)
    if (k > 0) & (k < V):
        u, mask = _row_keys(x_ptr, n, c, R, V, stride_b, stride_r, CHUNK, ALIGNED)
        take = mask & (u > tl.load(hist_ptr + n * ROW_WORDS + 512))
        count = tl.sum(take.to(tl.int32), axis=0)
        if count > 0:
            slot = tl.atomic_add(hist_ptr + n * ROW_WORDS + 514, count) + tl.cumsum(take.to(tl.int32), axis=0) - 1
            z = _to_z(u, tl.load(temp_ptr + n // R), FP16)
            tl.store(val_ptr + n * KCAP + slot, z, mask=take & (slot < KCAP))


@triton.jit(do_not_specialize=["R"])
def _top_p_kernel(val_ptr, hist_ptr, thr_ptr, p_ptr, R, KCAP: tl.constexpr):
    """thr[n] = t_p of the top-k-kept set (its values above t_k in val[n], t_k = thr[n] with multiplicity
    word 513 of the row's work area): the smallest kept value whose mass strictly above it, over the kept set's total, is < top_p."""
    n = tl.program_id(0)
    p = tl.load(p_ptr + n // R)
    t_k = tl.load(thr_ptr + n)
    if (p < 1.0) & (t_k > float("-inf")):
        i = tl.arange(0, KCAP)
        n_above = tl.load(hist_ptr + n * ROW_WORDS + 514)
        v = tl.sort(tl.load(val_ptr + n * KCAP + i, mask=i < n_above, other=float("-inf")), descending=True)
        top = tl.maximum(tl.max(v, axis=0), t_k)
        w = tl.exp(v - top)                                         # -inf padding: 0
        above = tl.sum(w, axis=0)
        total = above + tl.load(hist_ptr + n * ROW_WORDS + 513).to(tl.float32) * tl.exp(t_k - top)
        kept = ((tl.cumsum(w, axis=0) - w) / total < p) & (i < n_above)
        t_p = tl.min(tl.where(kept, v, float("inf")), axis=0)
        tl.store(thr_ptr + n, tl.where(above / total < p, t_k, t_p))


def supports(logits: torch.Tensor) -> bool:
    """Whether :func:`top_k_thresholds16` takes these logits (16-bit floats, ids contiguous)."""
    return logits.dtype in (torch.bfloat16, torch.float16) and logits.stride(-1) == 1


def top_k_thresholds16(logits: torch.Tensor, top_k: torch.Tensor, temperature: torch.Tensor,
                       top_p: Optional[torch.Tensor] = None, k_max: int = 0) -> torch.Tensor:
    """Keep thresholds float32 [B, R] of top-k (then top-p over the kept set when ``top_p`` is given): -inf where
    k = 0 or k >= V.

    ``logits`` [B, R, V] bf16 / fp16 with unit stride over V; ``top_k`` [B] int64, ``temperature`` and ``top_p``
    [B] float32, on the logits' device. With ``top_p``, ``k_max`` >= every k (at most :data:`TOP_P_K_MAX`) sizes
    the buffer of kept values. Top-k: four launches (a memset and three kernels); top-p adds two; no host sync."""
    if not supports(logits):
        raise ValueError(f"top_k_thresholds16 takes bf16 / fp16 logits with unit stride over V, got "
                         f"{logits.dtype} with strides {tuple(logits.stride())}")
    if top_p is not None and not 1 <= k_max <= TOP_P_K_MAX:
        raise ValueError(f"top-p after top-k needs 1 <= k_max <= {TOP_P_K_MAX}, got {k_max}")
    batch, rows, vocab = logits.shape
    n_rows = batch * rows
    bits = logits.view(torch.int16)
    hist = torch.zeros((n_rows, _ROW_WORDS), device=logits.device, dtype=torch.int32)   # per-row work areas
    thr = torch.empty((batch, rows), device=logits.device, dtype=torch.float32)
    strides = (bits.stride(0), bits.stride(1))
    aligned = bits.data_ptr() % 16 == 0 and vocab % 8 == 0 and all(s % 8 == 0 for s in strides)
    grid = (n_rows, triton.cdiv(vocab, CHUNK))
    fp16 = logits.dtype == torch.float16
    args = (bits, hist, top_k, rows, vocab, *strides)
    _high_kernel[grid](*args, CHUNK=CHUNK, ALIGNED=aligned, num_warps=NUM_WARPS)
    _low_kernel[grid](*args, CHUNK=CHUNK, ALIGNED=aligned, num_warps=NUM_WARPS)
    _select_kernel[(n_rows,)](hist, top_k, temperature, thr, rows, vocab, FP16=fp16, num_warps=1)
    if top_p is not None:
        kcap = max(16, triton.next_power_of_2(k_max))
        vals = torch.empty((n_rows, kcap), device=logits.device, dtype=torch.float32)
        _collect_kernel[grid](bits, hist, vals, top_k, temperature, rows, vocab, *strides, CHUNK=CHUNK,
                              KCAP=kcap, ALIGNED=aligned, FP16=fp16, num_warps=NUM_WARPS)
        _top_p_kernel[(n_rows,)](vals, hist, thr, top_p, rows, KCAP=kcap, num_warps=4)
    return thr
