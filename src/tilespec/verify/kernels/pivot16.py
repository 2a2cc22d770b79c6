"""The fast path of :mod:`.topk16`: a pivot below t_k from segment maxima, then one compacting pass.

* ``segment_max_kernel``, grid (N, C): program (n, c) reads chunk c of row n as [CHUNK / SEG, SEG] and writes the
  key of each segment's largest value to ``seg`` [N, C * CHUNK / SEG] (-1 for segments past V).
* ``pivot_kernel``, grid (N,): the pivot is the k-th largest segment key. At least k segments hold an id with a key
  >= it, so at least k ids do and pivot <= u* (the k-th largest key). Rows with fewer than k segments get pivot 0:
  every id is collected and the row overflows into the fallback.
* ``collect_pivot_kernel``, grid (N, C): appends the bits of every id whose value is >= the pivot's (so every key
  >= pivot, and -0.0 next to a +0.0 pivot) to ``vals``: on random-like rows about k ids, the top segments' maxima.
  More than CAP sends the row to the exact fallback (:mod:`.digits16`).
The two passes compare and reduce floats; keys are formed only for the segment maxima and the collected ids.
NaN logits (rejected by validation) would be skipped by the float max / compare.
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import triton
import triton.language as tl

from .keys16 import (ROW_WORDS, W_PIVOT, W_PIVOT_N, bits_to_float, bits_to_key, key_to_z, load_bits,
                     request_of, row_of, top_on)


@triton.jit(do_not_specialize=["NT", "RT", "RD", "V", "sbt", "srt", "sbd", "srd", "n_seg"])
def segment_max_kernel(t_ptr, d_ptr, seg_ptr, k_ptr, NT, RT, RD, V, sbt, srt, sbd, srd, n_seg,
                       CHUNK: tl.constexpr, SEG: tl.constexpr, ALIGNED: tl.constexpr, FP16: tl.constexpr,
                       PDL: tl.constexpr):
    if PDL:   # the pivot kernel (a programmatic dependent) may get resident; it waits for this grid to finish
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0)
    c = tl.program_id(1)
    row, b = row_of(t_ptr, d_ptr, n, NT, RT, RD, sbt, srt, sbd, srd, ALIGNED)
    _, on = top_on(k_ptr, b, V)
    if on:
        segs = tl.arange(0, CHUNK // SEG)
        offs = c * CHUNK + segs[:, None] * SEG + tl.arange(0, SEG)[None, :]
        x = tl.where(offs < V, bits_to_float(load_bits(row, offs, V), FP16), float("-inf"))
        m = tl.max(x, axis=1)                                   # a value some id of the segment holds
        if FP16:
            key = bits_to_key(m.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32))
        else:
            key = bits_to_key(m.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32))
        key = tl.where(c * CHUNK + segs * SEG < V, key, -1)
        tl.store(seg_ptr + n.to(tl.int64) * n_seg + c * (CHUNK // SEG) + segs, key)


@triton.jit(do_not_specialize=["NT", "RT", "RD", "V", "n_seg"])
def pivot_kernel(seg_ptr, hist_ptr, k_ptr, NT, RT, RD, V, n_seg, SEG_PAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:   # a programmatic dependent of the segment-max kernel: wait for it, let the next kernel get resident
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0)
    k, on = top_on(k_ptr, request_of(n, NT, RT, RD), V)
    if on:
        i = tl.arange(0, SEG_PAD)
        m = tl.sort(tl.load(seg_ptr + n.to(tl.int64) * n_seg + i, mask=i < n_seg, other=-1), descending=True)
        pivot = tl.sum(tl.where(i == k - 1, m, 0), axis=0)          # -1 (no such segment) when k > segments
        tl.store(hist_ptr + n * ROW_WORDS + W_PIVOT, tl.maximum(pivot, 0))


@triton.jit(do_not_specialize=["NT", "RT", "RD", "V", "sbt", "srt", "sbd", "srd"])
def collect_pivot_kernel(t_ptr, d_ptr, hist_ptr, vals_ptr, k_ptr, NT, RT, RD, V, sbt, srt, sbd, srd,
                         CHUNK: tl.constexpr, CAP: tl.constexpr, ALIGNED: tl.constexpr, FP16: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:   # a programmatic dependent of the pivot kernel: wait for it, let the finish get resident
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0)
    c = tl.program_id(1)
    row, b = row_of(t_ptr, d_ptr, n, NT, RT, RD, sbt, srt, sbd, srd, ALIGNED)
    _, on = top_on(k_ptr, b, V)
    if on:
        area = hist_ptr + n * ROW_WORDS
        key = tl.load(area + W_PIVOT)
        pivot = tl.where(key > 0, key_to_z(key, 1.0, FP16), float("-inf"))    # its value (key 0, a NaN: every id)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        s = load_bits(row, offs, V)
        take = (offs < V) & (bits_to_float(s, FP16) >= pivot)
        count = tl.sum(take.to(tl.int32), axis=0)
        if count > CAP:                    # the row overflows: only the count matters
            tl.atomic_add(area + W_PIVOT_N, count)
        elif count > 0:
            slot = tl.atomic_add(area + W_PIVOT_N + tl.zeros_like(s), 1, mask=take)   # one atomic per taken id
            tl.store(vals_ptr + n.to(tl.int64) * CAP + slot, s, mask=take & (slot < CAP))
