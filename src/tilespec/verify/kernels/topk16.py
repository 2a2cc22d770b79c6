"""Top-k (then top-p) keep thresholds of bf16 / fp16 logits without a sort: exact, CUDA-graph safe.

t_k is the value of u*, the k-th largest order key of the row (:mod:`.keys16`), divided by T with a correctly
rounded division (T = 1 for greedy rows): bit for bit what ``keep._top_k_thresholds`` gets from ``torch.topk``.
Rows whose request has k = 0 or k >= V get -inf.

1. :mod:`.pivot16`: per-segment maxima, a pivot <= u* per row (the k-th largest segment max), and one pass that
   collects every key >= pivot into ``vals`` [N, CAP] (one read of the logits for the maxima, one for the keys).
2. :mod:`.digits16`, only for rows that collected more than CAP keys (run by the finish kernel, in the row's
   program): u* digit by digit from counting passes, and (for top-p) the keys above it.
3. ``_finish_kernel``, grid (N,): sorts the row's collected keys; u* = the k-th of them (pivot rows) or the
   fallback's; t_k; then, with top-p, t_p over the top-k-kept set (``filters``' definition: the softmax of the kept
   logits only): the smallest kept value whose mass strictly above it, over the kept total, is below top_p (ties
   kept together, as ``filters.top_p_threshold_sorted``). Its fp32 sums run over the kept values in sorted order,
   the reference's over the whole row, so the kept sets can differ only where some S(z) is within float rounding of
   top_p (as for :mod:`.radix`).

Collected keys are sorted before any use and counts are integers: deterministic and batch invariant. Fixed grids,
no host sync. NaN logits are rejected by validation; with ``check_values=False`` a NaN sorts above +inf (sign clear)
or below -inf (sign set).
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from . import digits16, direct, pivot16, thresholds
from .common import pdl_capable
from .keys16 import (ROW_WORDS, ROW_WORDS_INT, W_ABOVE_N, W_AT, W_PIVOT_N, W_USTAR, bits_to_key, cached_work_areas,
                     key_to_z, row_of, supports16, top_on)

CHUNK = 2048         # ids per program of the passes over the logits
SEG = 512            # ids per segment of the pivot pass (k above the number of segments: the fallback)
CAP_MIN, CAP_MAX = 256, 2048   # ids collected per row: 4 k_max within these bounds (more: the row takes the fallback)
CAP_INTERPRETER = 128   # under TRITON_INTERPRET (CPU tests): its sort and scans are Python loops over CAP keys
NUM_WARPS = 4
TOP_P_K_MAX = 1024   # top-p after top-k: the largest k (the keys above u* must fit in CAP)
# the pivot, collect and finish kernels as programmatic dependents of the kernel before them (GPU, compute
# capability >= 9, a Triton with launch_pdl; each waits for its predecessor first): shorter launch gaps only
PDL = True


@triton.jit(do_not_specialize=["NT", "RT", "RD", "V", "sbt", "srt", "sbd", "srd"])
def _finish_kernel(t_ptr, d_ptr, vals_ptr, hist_ptr, k_ptr, temp_ptr, p_ptr, mp_ptr, thr_t_ptr, thr_d_ptr, NT, RT, RD, V, sbt,
                   srt, sbd, srd, CAP: tl.constexpr, HAS_P: tl.constexpr, MIN_P: tl.constexpr,
                   FP16: tl.constexpr, CHUNK: tl.constexpr, ALIGNED: tl.constexpr, B0: tl.constexpr,
                   B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, PDL: tl.constexpr):
    """thr of row n (target rows at thr_t_ptr[n], draft rows at thr_d_ptr[n - NT]) = t_k, with top-p
    max(t_k, t_p), with min-p also max'ed with min-p's threshold from the row max, from row n's collected ids
    (pivot rows: every id >= the pivot, so every id >= u*; fallback rows, which run
    :func:`.digits16.fallback_row` first: the ids above u*, with u* and its count from the work area). Resets the
    row's work area to 0 for the next call."""
    if PDL:   # a programmatic dependent of the collect kernel
        tl.extra.cuda.gdc_wait()
    n = tl.program_id(0)
    row, b = row_of(t_ptr, d_ptr, n, NT, RT, RD, sbt, srt, sbd, srd, ALIGNED)
    digits16.fallback_row(row, b, hist_ptr, vals_ptr, k_ptr, n, V, CHUNK, CAP, HAS_P | MIN_P, B0, B1, B2, B3)
    tl.debug_barrier()                     # the fallback's work area and ids are visible to every warp
    k, on = top_on(k_ptr, b, V)
    thr = float("-inf")
    if on:
        area = hist_ptr + n * ROW_WORDS
        fallback = tl.load(area + W_PIVOT_N) > CAP
        count = tl.where(fallback, tl.load(area + W_ABOVE_N), tl.load(area + W_PIVOT_N))
        i = tl.arange(0, CAP)
        valid = (i < count) & (HAS_P | MIN_P | ~fallback)
        keys = tl.where(valid, bits_to_key(tl.load(vals_ptr + n.to(tl.int64) * CAP + i, mask=valid, other=0)), -1)
        keys = tl.sort(keys, descending=True)
        u_star = tl.where(fallback, tl.load(area + W_USTAR), tl.sum(tl.where(i == k - 1, keys, 0), axis=0))
        at = tl.where(fallback, tl.load(area + W_AT), tl.sum((keys == u_star).to(tl.int32), axis=0))
        t = tl.load(temp_ptr + b)
        thr = key_to_z(u_star, t, FP16)
        if HAS_P:
            p = tl.load(p_ptr + b)
            above = keys > u_star
            z = tl.where(above, key_to_z(keys, t, FP16), float("-inf"))      # sorted descending, as the keys
            top = tl.maximum(tl.max(z, axis=0), thr)
            w = tl.exp(z - top)                                               # 0 where not above
            mass_above = tl.sum(w, axis=0)
            total = mass_above + at.to(tl.float32) * tl.exp(thr - top)
            kept = ((tl.cumsum(w, axis=0) - w) / total < p) & above
            t_p = tl.min(tl.where(kept, z, float("inf")), axis=0)
            # the boundary value t_k stays kept iff the mass above it is < top_p (a row of -inf only: nothing to do)
            thr = tl.where((p < 1.0) & (top > float("-inf")) & ~(mass_above / total < p), t_p, thr)
        if MIN_P:   # the row max: the largest collected key (every id above u* is collected), or u*
            m = key_to_z(tl.maximum(tl.max(keys, axis=0), u_star), t, FP16)
            thr = tl.maximum(thr, thresholds.min_p_threshold(m, tl.load(mp_ptr + b)))
    tl.debug_barrier()                     # every warp has read the work area before it is reset
    tl.store(hist_ptr + n * ROW_WORDS + tl.arange(0, ROW_WORDS), tl.zeros([ROW_WORDS], tl.int32))
    if n < NT:
        tl.store(thr_t_ptr + n, thr)
    else:
        tl.store(thr_d_ptr + (n - NT), thr)


_BUFFERS: dict = {}
BUFFER_LIMIT = 256    # shapes whose buffers stay allocated (a captured CUDA graph may hold their addresses)


def _buffers(device: torch.device, n_rows: int, cap: int, n_seg: int) -> tuple:
    """(work areas [N, ROW_WORDS] int32, zero between calls: the finish kernel resets them; collected ids [N, CAP];
    segment keys [N, n_seg]), cached per shape."""
    key = (device, n_rows, cap, n_seg)
    return cached_work_areas(_BUFFERS, key, BUFFER_LIMIT, lambda: (
        torch.zeros((n_rows, ROW_WORDS_INT), device=device, dtype=torch.int32),
        torch.empty((n_rows, cap), device=device, dtype=torch.int32),
        torch.empty((n_rows, n_seg), device=device, dtype=torch.int32)))


supports = supports16      # whether top_k_thresholds16 takes these logits


def top_k_thresholds16(logits: torch.Tensor, top_k: torch.Tensor, temperature: torch.Tensor,
                       top_p: Optional[torch.Tensor] = None, k_max: int = 0, *, draft: Optional[torch.Tensor] = None,
                       min_p: Optional[torch.Tensor] = None, digits: Sequence[int] = (), chunk: int = 0,
                       num_warps: int = 0, pivot: bool = True):
    """Keep thresholds float32 [B, R] of top-k (then top-p over the kept set when ``top_p`` is given, then min-p
    when ``min_p`` is, see :mod:`.topp16`): -inf where k = 0 or k >= V.

    ``logits`` [B, R, V] bf16 / fp16 with unit stride over V; ``top_k`` [B] int64, ``temperature``, ``top_p`` and
    ``min_p`` [B] float32, on the logits' device. ``draft`` [B, R_d, V] (same dtype and V): its rows go through the
    same launches and the result is the pair (thr [B, R], thr_draft [B, R_d]). ``k_max``: a bound on every k when
    the caller knows one (0: unknown); it sizes the buffer of collected ids, and with ``top_p`` / ``min_p`` it is
    required, at most :data:`TOP_P_K_MAX`. ``digits`` / ``chunk`` / ``num_warps``: :data:`digits16.DIGITS` /
    :data:`CHUNK` / :data:`NUM_WARPS` when not given; ``pivot=False`` sends every row to the fallback (benchmarks,
    tests). Four launches (three for the pivot path, the fallback and finish; direct launches after the first call
    of a shape, see :func:`.direct.launch`); work areas cached per shape and reset by the finish kernel, so calls
    of one shape must not run concurrently on different streams. No host sync."""
    for x in (logits, draft):
        if x is not None and not supports(x):
            raise ValueError(f"top_k_thresholds16 takes bf16 / fp16 logits with unit stride over V, got "
                             f"{x.dtype} with strides {tuple(x.stride())}")
    if draft is not None and (draft.dtype != logits.dtype or draft.shape[::2] != logits.shape[::2]):
        raise ValueError("draft logits must have the target's dtype, batch and vocabulary size")
    for name, t in (("top_k", top_k), ("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
        if t is not None and (t.shape != logits.shape[:1] or t.device != logits.device):
            raise ValueError(f"{name} must have shape [B] = [{logits.shape[0]}] on {logits.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    if (top_p is not None or min_p is not None) and not 1 <= k_max <= TOP_P_K_MAX:
        raise ValueError(f"top-p / min-p after top-k needs 1 <= k_max <= {TOP_P_K_MAX}, got {k_max}")
    digits, chunk, num_warps = tuple(digits or digits16.DIGITS), chunk or CHUNK, num_warps or NUM_WARPS
    if chunk % SEG or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of 2 and a multiple of {SEG}, got {chunk}")
    if sum(digits) != 16 or not 1 <= len(digits) <= 4 or not all(1 <= d <= 8 for d in digits):
        raise ValueError(f"digits must be 1 to 4 widths in [1, 8] summing to 16, got {digits}")
    batch, rows, vocab = logits.shape
    rows_d = draft.shape[1] if draft is not None else 0
    n_t = batch * rows
    n_rows, n_chunks = n_t + batch * rows_d, triton.cdiv(vocab, chunk)
    x_t, x_d = logits, draft if draft is not None else logits     # the kernels bitcast the 16-bit values
    device = logits.device
    cap = (min(max(triton.next_power_of_2(4 * k_max), CAP_MIN), CAP_MAX) if k_max > 0 else CAP_MAX) \
        if logits.is_cuda else CAP_INTERPRETER
    if top_p is not None or min_p is not None:
        cap = max(cap, triton.next_power_of_2(k_max))   # the keys above u* (< k of them) must fit
    n_seg = n_chunks * (chunk // SEG)
    thr_t = torch.empty((batch, rows), device=device, dtype=torch.float32)
    thr_d = torch.empty((batch, rows_d), device=device, dtype=torch.float32) if draft is not None else thr_t
    if n_rows == 0:
        return thr_t if draft is None else (thr_t, thr_d)
    hist, vals, seg = _buffers(device, n_rows, cap, n_seg)
    strides = (x_t.stride(0), x_t.stride(1), x_d.stride(0), x_d.stride(1))
    aligned = ((x_t.data_ptr() | x_d.data_ptr()) % 16 == 0 and vocab % 8 == 0
               and all(s % 8 == 0 for s in strides))
    grid = (n_rows, n_chunks, 1)
    fp16 = logits.dtype == torch.float16
    geometry = (n_t, rows, max(rows_d, 1), vocab)
    sizes = (*geometry, *strides)
    common = dict(CHUNK=chunk, ALIGNED=aligned, num_warps=num_warps)
    use_pdl = pivot and PDL and logits.is_cuda and pdl_capable(device)
    pdl = dict(launch_pdl=True, PDL=True) if use_pdl else dict(PDL=False)
    if pivot:
        direct.launch(pivot16.segment_max_kernel, grid, (x_t, x_d, seg, top_k), (*sizes, n_seg),
                      dict(SEG=SEG, FP16=fp16, PDL=pdl["PDL"], **common))
        direct.launch(pivot16.pivot_kernel, (n_rows, 1, 1), (seg, hist, top_k), (*geometry, n_seg),
                      dict(SEG_PAD=triton.next_power_of_2(n_seg), num_warps=4, **pdl))
        direct.launch(pivot16.collect_pivot_kernel, grid, (x_t, x_d, hist, vals, top_k), sizes,
                      dict(CAP=cap, FP16=fp16, **common, **pdl))
    else:
        hist[:, W_PIVOT_N.value] = cap + 1
    direct.launch(_finish_kernel, (n_rows, 1, 1),
                  (x_t, x_d, vals, hist, top_k, temperature, temperature if top_p is None else top_p,
                   temperature if min_p is None else min_p, thr_t, thr_d), sizes,
                  dict(CAP=cap, HAS_P=top_p is not None, MIN_P=min_p is not None, FP16=fp16, CHUNK=chunk,
                       ALIGNED=aligned, **pdl,
                       num_warps=num_warps, **dict(zip(("B0", "B1", "B2", "B3"), (*digits, 0, 0, 0)))))
    return thr_t if draft is None else (thr_t, thr_d)
