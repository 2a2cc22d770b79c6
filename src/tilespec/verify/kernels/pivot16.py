"""The fast path of :mod:`.topk16`: a pivot below t_k from segment maxima, then one compacting pass.

* ``segment_max_kernel``, grid (N, C): program (n, c) reads chunk c of row n as [CHUNK / SEG, SEG] and writes the
  max key of each segment of SEG ids to ``seg`` [N, C * CHUNK / SEG].
* ``pivot_kernel``, grid (N,): the pivot is the k-th largest segment max. At least k segments hold a key >= it, one
  id each, so at least k ids are >= it and pivot <= u* (the k-th largest key). Rows with fewer than k segments get
  pivot 0: every id is collected and the row overflows into the fallback.
* ``collect_pivot_kernel``, grid (N, C): appends every key >= pivot to ``vals`` (usually a few times k ids: the
  ones in the top segments). More than CAP of them sends the row to the exact fallback (:mod:`.digits16`).
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import triton
import triton.language as tl

from .keys16 import ROW_WORDS, W_PIVOT, W_PIVOT_N, append_keys, row_keys, top_on


@triton.jit(do_not_specialize=["R", "V", "stride_b", "stride_r", "n_seg"])
def segment_max_kernel(x_ptr, seg_ptr, k_ptr, R, V, stride_b, stride_r, n_seg, CHUNK: tl.constexpr,
                       SEG: tl.constexpr, ALIGNED: tl.constexpr):
    n = tl.program_id(0)
    c = tl.program_id(1)
    _, on = top_on(k_ptr, n, R, V)
    if on:
        segs = tl.arange(0, CHUNK // SEG)
        offs = c * CHUNK + segs[:, None] * SEG + tl.arange(0, SEG)[None, :]
        u = row_keys(x_ptr, n, offs, R, V, stride_b, stride_r, ALIGNED)
        tl.store(seg_ptr + n.to(tl.int64) * n_seg + c * (CHUNK // SEG) + segs, tl.max(u, axis=1))


@triton.jit(do_not_specialize=["R", "V", "n_seg"])
def pivot_kernel(seg_ptr, hist_ptr, k_ptr, R, V, n_seg, SEG_PAD: tl.constexpr):
    n = tl.program_id(0)
    k, on = top_on(k_ptr, n, R, V)
    if on:
        i = tl.arange(0, SEG_PAD)
        m = tl.sort(tl.load(seg_ptr + n.to(tl.int64) * n_seg + i, mask=i < n_seg, other=-1), descending=True)
        pivot = tl.sum(tl.where(i == k - 1, m, 0), axis=0)          # -1 (empty segments) when k > segments
        tl.store(hist_ptr + n * ROW_WORDS + W_PIVOT, tl.maximum(pivot, 0))


@triton.jit(do_not_specialize=["R", "V", "stride_b", "stride_r"])
def collect_pivot_kernel(x_ptr, hist_ptr, vals_ptr, k_ptr, R, V, stride_b, stride_r, CHUNK: tl.constexpr,
                         CAP: tl.constexpr, ALIGNED: tl.constexpr):
    n = tl.program_id(0)
    c = tl.program_id(1)
    _, on = top_on(k_ptr, n, R, V)
    if on:
        area = hist_ptr + n * ROW_WORDS
        pivot = tl.load(area + W_PIVOT)
        u = row_keys(x_ptr, n, c * CHUNK + tl.arange(0, CHUNK), R, V, stride_b, stride_r, ALIGNED)
        append_keys(u, u >= pivot, area, W_PIVOT_N, vals_ptr + n.to(tl.int64) * CAP, CAP)
