"""Top-p keep thresholds of bf16 / fp16 logits from a count histogram of 16-bit order keys: no sort, exact,
CUDA-graph safe.

A 16-bit value has one of 2^16 order keys (:mod:`.keys16`; -0.0 is counted as +0.0, its value), so the softmax
mass of every id holding key u is count(u) * exp(z(u) - M), z(u) = float(value of u) / T correctly rounded (T = 1
for greedy rows) and M the row's largest z. Counts are integers: the per-key masses need no float sum over ids.

1. ``_max_kernel``, grid (N, C): the row's largest key (an integer max: order-independent).
2. ``_window_kernel``, grid (N, C): per chunk, the fp32 sum of exp(z - M) over its ids (the row total is the sum
   of these in chunk order: it depends on V and CHUNK only, batch invariant), and the count of every key in the
   window of WINDOW keys below the largest (one integer atomic per id in the window).
3. ``_finish_kernel``, grid (N,), which also resets the row's work area for the next call: per window key u, from
   the top, S(u) = the mass of the keys above u (an exclusive cumulative sum in key order, as the sort-based
   reference sums in sorted order); t_p = the value of
   the smallest present key with S(u) / total < top_p (``filters``' definition: ties are one key, kept together).
   The window decides the row when some present key in it is not kept (every key below it has a larger S) or when
   it holds every id of the row.
   Rows the window does not decide (thresholds far below the largest logit: flat rows) run :mod:`.thresholds`'
   exact key search on their row in the same program (slow, but only for such rows).

The fp32 mass sums differ from the reference's in order only, so the kept set equals the reference's unless some
S(z) is within float rounding of top_p (as for :mod:`.radix`). Rows whose top_p >= 1 get -inf. Top-p after
top-k is :mod:`.topk16`'s.

Min-p (``min_p``): log p(x) - max log p = z - M for every filtered row (the normaliser cancels, and top-p keeps
the largest z), so its keep set is {fl(z - M) >= fl(log min_p)}: ``_finish_kernel`` finds the smallest such fp32
z by bisection over order keys (scalars only) and keeps the max of both thresholds. The reference evaluates the
same inequality through log_softmax, whose rounding of the normaliser can move a z within float rounding of the
boundary (as the top-p sums).
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

from typing import Optional

import torch
import triton
import triton.language as tl

from . import direct, thresholds
from .common import pdl_capable
from .keys16 import bits_to_key, cached_work_areas, key_to_z, load_bits, row_of, supports16

CHUNK = 4096          # ids per program of the two passes over the logits (fixed per V: batch invariance)
WINDOW = 512          # keys counted below the row's largest (bf16: 4 binades; 128 keys per binade)
NUM_WARPS = 8
SEARCH_BLOCK = 2048   # ids per step of the exact search for rows the window does not decide
# the window and finish kernels as programmatic dependents of the kernel before them (GPU, compute capability >= 9,
# a Triton with launch_pdl; each waits for its predecessor before reading what it wrote): shorter launch gaps only
PDL = True
HEAD_WORDS = 2
_MAX = tl.constexpr(0)     # work-area words per row: the largest key, the fallback flag, then WINDOW counts
_FLAG = tl.constexpr(1)   # set by the finish when the row needed the exact search (benchmarks count them)
_HEAD = tl.constexpr(HEAD_WORDS)


@triton.jit
def _row_keys(t_ptr, d_ptr, n, c, NT, RT, RD, V, sbt, srt, sbd, srd, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    """Row n of the target rows (n < NT, RT per request) then the draft rows (RD per request): its ids of chunk c,
    their order keys (-0.0 -> +0.0: one value, one key) and the row's request."""
    row, b = row_of(t_ptr, d_ptr, n, NT, RT, RD, sbt, srt, sbd, srd, ALIGNED)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    u = bits_to_key(load_bits(row, offs, V))
    return offs, tl.where(u == 32767, 32768, u), b


@triton.jit
def _request(n, NT, RT, RD):
    return tl.where(n < NT, n // RT, (n - NT) // RD)


@triton.jit
def _row_on(p_ptr, mp_ptr, b, MIN_P: tl.constexpr):
    on = tl.load(p_ptr + b) < 1.0
    if MIN_P:
        on = on | (tl.load(mp_ptr + b) > 0.0)
    return on


@triton.jit(do_not_specialize=["NT", "RT", "RD", "V", "sbt", "srt", "sbd", "srd"])
def _max_kernel(t_ptr, d_ptr, area_ptr, p_ptr, mp_ptr, NT, RT, RD, V, sbt, srt, sbd, srd, CHUNK: tl.constexpr,
                ALIGNED: tl.constexpr, AREA: tl.constexpr, MIN_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:   # the window kernel (a programmatic dependent) may get resident; it waits for this grid to finish
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0)
    c = tl.program_id(1)
    if _row_on(p_ptr, mp_ptr, _request(n, NT, RT, RD), MIN_P):
        offs, u, _ = _row_keys(t_ptr, d_ptr, n, c, NT, RT, RD, V, sbt, srt, sbd, srd, CHUNK, ALIGNED)
        tl.atomic_max(area_ptr + n.to(tl.int64) * AREA + _MAX, tl.max(tl.where(offs < V, u, 0), axis=0))


@triton.jit(do_not_specialize=["NT", "RT", "RD", "V", "sbt", "srt", "sbd", "srd", "n_chunks"])
def _window_kernel(t_ptr, d_ptr, area_ptr, tot_ptr, p_ptr, temp_ptr, NT, RT, RD, V, sbt, srt, sbd, srd, n_chunks,
                   CHUNK: tl.constexpr, ALIGNED: tl.constexpr, FP16: tl.constexpr, WINDOW: tl.constexpr,
                   AREA: tl.constexpr, PDL: tl.constexpr):
    if PDL:   # launched as a programmatic dependent of the max kernel: wait for it (and let the finish get resident)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0)
    c = tl.program_id(1)
    b = _request(n, NT, RT, RD)
    if tl.load(p_ptr + b) < 1.0:
        area = area_ptr + n.to(tl.int64) * AREA
        kmax = tl.load(area + _MAX)
        t = tl.load(temp_ptr + b)
        m = key_to_z(kmax, t, FP16)
        m = tl.where(m == float("-inf"), 0.0, m)
        offs, u, _ = _row_keys(t_ptr, d_ptr, n, c, NT, RT, RD, V, sbt, srt, sbd, srd, CHUNK, ALIGNED)
        valid = offs < V
        z = key_to_z(u, t, FP16)
        tl.store(tot_ptr + n.to(tl.int64) * n_chunks + c, tl.sum(tl.where(valid, tl.exp(z - m), 0.0), axis=0))
        d = kmax - u
        tl.atomic_add(area + _HEAD + d, 1, mask=valid & (d < WINDOW))


@triton.jit(do_not_specialize=["NT", "RT", "RD", "V", "sbt", "srt", "sbd", "srd", "n_chunks"])
def _finish_kernel(t_ptr, d_ptr, area_ptr, tot_ptr, p_ptr, mp_ptr, temp_ptr, thr_t_ptr, thr_d_ptr, NT, RT, RD, V, sbt, srt, sbd,
                   srd, n_chunks, NC_PAD: tl.constexpr, FP16: tl.constexpr, WINDOW: tl.constexpr,
                   AREA: tl.constexpr, MIN_P: tl.constexpr, SEARCH: tl.constexpr, BLOCK: tl.constexpr,
                   BITS: tl.constexpr, PDL: tl.constexpr):
    """thr of row n (target rows at thr_t_ptr[n], draft rows at thr_d_ptr[n - NT]): max(t_p, t_minp); rows
    the window does not decide run :func:`.thresholds.top_p_search` on their logits (SEARCH; ``t_ptr`` /
    ``d_ptr``) and set their flag word. Resets the row's largest key and counts to 0."""
    if PDL:   # launched as a programmatic dependent of the window kernel
        tl.extra.cuda.gdc_wait()
    n = tl.program_id(0)
    b = _request(n, NT, RT, RD)
    p = tl.load(p_ptr + b)
    area = area_ptr + n.to(tl.int64) * AREA
    thr = float("-inf")
    if MIN_P:
        mp = tl.load(mp_ptr + b)
        if mp > 0.0:
            thr = thresholds.min_p_threshold(key_to_z(tl.load(area + _MAX), tl.load(temp_ptr + b), FP16), mp)
            if p >= 1.0:
                tl.debug_barrier()          # every warp has read the largest key before it is reset
                tl.store(area + _MAX, 0)
    if p < 1.0:
        kmax = tl.load(area + _MAX)
        t = tl.load(temp_ptr + b)
        m = key_to_z(kmax, t, FP16)
        m = tl.where(m == float("-inf"), 0.0, m)
        cs = tl.arange(0, NC_PAD)
        total = tl.sum(tl.load(tot_ptr + n.to(tl.int64) * n_chunks + cs, mask=cs < n_chunks, other=0.0), axis=0)
        d = tl.arange(0, WINDOW)
        u = kmax - d
        cnt = tl.load(area + _HEAD + d)
        z = key_to_z(tl.maximum(u, 0), t, FP16)
        mass = tl.where(cnt > 0, cnt.to(tl.float32) * tl.exp(z - m), 0.0)
        above = tl.cumsum(mass, axis=0) - mass                       # mass of the keys above u (window = top)
        kept = tl.div_rn(above, tl.zeros([WINDOW], tl.float32) + total) < p
        present = cnt > 0
        last = tl.max(tl.where(kept & present, d, -1), axis=0)
        decided = (tl.max(tl.where(~kept & present, 1, 0), axis=0) > 0) | (tl.sum(cnt, axis=0) >= V)
        # a row of -inf only (no mass): keep it all
        t_p = tl.where(total > 0, key_to_z(kmax - tl.maximum(last, 0), t, FP16), float("-inf"))
        decided = decided | ~(total > 0)
        if SEARCH:
            if ~decided:
                if n < NT:
                    row = t_ptr + (n // RT).to(tl.int64) * sbt + (n % RT).to(tl.int64) * srt
                else:
                    row = d_ptr + ((n - NT) // RD).to(tl.int64) * sbd + ((n - NT) % RD).to(tl.int64) * srd
                t_p = thresholds.top_p_search(row, V, tl.where(t > 0, t, 1.0), p, float("-inf"), BLOCK, BITS)
        thr = tl.maximum(thr, t_p)
        tl.store(area + _FLAG, (~decided).to(tl.int32))
        tl.debug_barrier()                  # every warp has read the work area before it is reset
        tl.store(area + _MAX, 0)
        tl.store(area + _HEAD + d, tl.zeros([WINDOW], tl.int32))
    if n < NT:
        tl.store(thr_t_ptr + n, thr)
    else:
        tl.store(thr_d_ptr + (n - NT), thr)


_BUFFERS: dict = {}
BUFFER_LIMIT = 256    # shapes whose work areas stay allocated (a captured CUDA graph may hold their addresses)


def _buffers(device: torch.device, n_rows: int, n_chunks: int, window: int) -> tuple:
    """(area [N, HEAD_WORDS + window] int32 (zero between calls: the kernels reset what they use), tot [N, C])."""
    key = (device, n_rows, n_chunks, window)
    return cached_work_areas(_BUFFERS, key, BUFFER_LIMIT, lambda: (
        torch.zeros((n_rows, HEAD_WORDS + window), device=device, dtype=torch.int32),
        torch.empty((n_rows, n_chunks), device=device, dtype=torch.float32)))


supports = supports16      # whether top_p_thresholds16 takes these logits


def _check(logits: torch.Tensor, top_p: torch.Tensor, temperature: torch.Tensor, min_p) -> None:
    if not supports(logits):
        raise ValueError(f"top_p_thresholds16 takes bf16 / fp16 logits with unit stride over V, got "
                         f"{logits.dtype} with strides {tuple(logits.stride())}")
    for name, t in (("top_p", top_p), ("temperature", temperature), ("min_p", min_p)):
        if t is not None and (t.shape != logits.shape[:1] or t.device != logits.device or t.dtype != torch.float32):
            raise ValueError(f"{name} must be float32 [B] = [{logits.shape[0]}] on {logits.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")


def top_p_thresholds16(logits: torch.Tensor, top_p: torch.Tensor, temperature: torch.Tensor,
                       draft: Optional[torch.Tensor] = None, *, min_p: Optional[torch.Tensor] = None,
                       window: int = 0, chunk: int = 0, fallback: bool = True):
    """Top-p (then min-p) keep thresholds float32 [B, R] of logits [B, R, V] (bf16 / fp16, unit stride over V):
    keep z = logit / T >= thr; -inf where top_p >= 1 and min_p = 0 (or None). ``top_p`` / ``temperature`` /
    ``min_p``: float32 [B] on the logits' device. ``draft`` [B, R_d, V] (same dtype and V): its rows go through the
    same launches and the result is the pair (thr [B, R], thr_draft [B, R_d]). ``window`` / ``chunk``:
    :data:`WINDOW` / :data:`CHUNK` when 0 (powers of two). ``fallback=False`` (tests) leaves rows the window does
    not decide with its value. Three launches for target and draft rows together; no host sync. Work areas are
    cached per shape and reset by the kernels: calls of one shape must not run concurrently on different streams
    (as :mod:`.launch`'s plans)."""
    _check(logits, top_p, temperature, min_p)
    if draft is not None:
        _check(draft, top_p, temperature, min_p)
        if draft.dtype != logits.dtype or draft.shape[-1] != logits.shape[-1]:
            raise ValueError("draft logits must have the target's dtype and vocabulary size")
    window, chunk = window or WINDOW, chunk or CHUNK
    if window & (window - 1) or chunk & (chunk - 1):
        raise ValueError(f"window and chunk must be powers of 2, got {window}, {chunk}")
    batch, rows, vocab = logits.shape
    rows_d = draft.shape[1] if draft is not None else 0
    n_t, n_d = batch * rows, batch * rows_d
    thr_t = torch.empty((batch, rows), device=logits.device, dtype=torch.float32)
    thr_d = torch.empty((batch, rows_d), device=logits.device, dtype=torch.float32) if draft is not None else thr_t
    if n_t + n_d == 0:
        return thr_t if draft is None else (thr_t, thr_d)
    n_chunks = triton.cdiv(vocab, chunk)
    x_t, x_d = logits, draft if draft is not None else logits     # the kernels bitcast the 16-bit values
    area, tot = _buffers(logits.device, n_t + n_d, n_chunks, window)
    strides = (x_t.stride(0), x_t.stride(1), x_d.stride(0), x_d.stride(1))
    aligned = ((x_t.data_ptr() | x_d.data_ptr()) % 16 == 0 and vocab % 8 == 0
               and all(s % 8 == 0 for s in strides))
    fp16 = logits.dtype == torch.float16
    grid = (n_t + n_d, n_chunks, 1)
    sizes = (n_t, rows, max(rows_d, 1), vocab, *strides)
    area_words = HEAD_WORDS + window
    mp = min_p if min_p is not None else top_p
    use_pdl = PDL and logits.is_cuda and pdl_capable(logits.device)
    pdl = dict(launch_pdl=True, PDL=True) if use_pdl else dict(PDL=False)
    direct.launch(_max_kernel, grid, (x_t, x_d, area, top_p, mp), sizes,
                  dict(CHUNK=chunk, ALIGNED=aligned, AREA=area_words, MIN_P=min_p is not None,
                       PDL=pdl["PDL"], num_warps=NUM_WARPS))
    direct.launch(_window_kernel, grid, (x_t, x_d, area, tot, top_p, temperature), (*sizes, n_chunks),
                  dict(CHUNK=chunk, ALIGNED=aligned, FP16=fp16, WINDOW=window, AREA=area_words,
                       num_warps=NUM_WARPS, **pdl))
    direct.launch(_finish_kernel, (n_t + n_d, 1, 1),
                  (logits, x_d, area, tot, top_p, mp, temperature, thr_t, thr_d),
                  (n_t, rows, max(rows_d, 1), vocab, *strides, n_chunks),
                  dict(NC_PAD=triton.next_power_of_2(n_chunks), FP16=fp16, WINDOW=window, AREA=area_words,
                       MIN_P=min_p is not None, SEARCH=fallback, BLOCK=SEARCH_BLOCK, BITS=thresholds.BITS,
                       num_warps=4, **pdl))
    return thr_t if draft is None else (thr_t, thr_d)
