"""Top-p keep thresholds of bf16 / fp16 logits from a count histogram of 16-bit order keys: no sort, exact,
CUDA-graph safe.

A 16-bit value has one of 2^16 order keys (:mod:`.keys16`; -0.0 is counted as +0.0, its value), so the softmax
mass of every id holding key u is count(u) * exp(z(u) - M), z(u) = float(value of u) / T correctly rounded (T = 1
for greedy rows) and M the row's largest z. Counts are integers: the per-key masses need no float sum over ids.

1. ``_max_kernel``, grid (N, C): the row's largest key (an integer max: order-independent).
2. ``_window_kernel``, grid (N, C): per chunk, the fp32 sum of exp(z - M) over its ids (the row total is the sum
   of these in chunk order: it depends on V and CHUNK only, batch invariant), and the count of every key in the
   window of WINDOW keys below the largest (one integer atomic per id in the window).
3. ``_finish_kernel``, grid (N,): per window key u, from the top: S(u) = the mass of the keys above u (an
   exclusive cumulative sum in key order, as the sort-based reference sums in sorted order); t_p = the value of
   the smallest present key with S(u) / total < top_p (``filters``' definition: ties are one key, kept together).
   The window decides the row when some present key in it is not kept (every key below it has a larger S) or when
   it holds every id of the row; otherwise the row is flagged.
4. Flagged rows only (thresholds far below the largest logit: a flat row): :mod:`.thresholds`' one-program-per-row
   search, gated by the flag (one launch that returns at once for every other row).

The fp32 mass sums differ from the reference's in order only, so the kept set equals the reference's unless some
S(z) is within float rounding of top_p (as for :mod:`.radix`). Rows whose top_p >= 1 get -inf. Top-p after
top-k is :mod:`.topk16`'s; min-p is not handled here.
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import torch
import triton
import triton.language as tl

from . import direct, thresholds
from .keys16 import bits_to_key, key_to_z, load_bits

CHUNK = 4096          # ids per program of the two passes over the logits (fixed per V: batch invariance)
WINDOW = 512          # keys counted below the row's largest (bf16: 4 binades; 128 keys per binade)
NUM_WARPS = 8
HEAD_WORDS = 2
_MAX = tl.constexpr(0)     # work-area words per row: the largest key, the fallback flag, then WINDOW counts
_FLAG = tl.constexpr(1)
_HEAD = tl.constexpr(HEAD_WORDS)


@triton.jit
def _row_keys(x_ptr, n, c, R, V, stride_b, stride_r, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    offs = c * CHUNK + tl.arange(0, CHUNK)
    s = load_bits(x_ptr, n, offs, R, V, stride_b, stride_r, ALIGNED)
    u = bits_to_key(s)
    return offs, s, tl.where(u == 32767, 32768, u)        # -0.0 -> +0.0 (one value, one key)


@triton.jit(do_not_specialize=["R", "V", "stride_b", "stride_r"])
def _max_kernel(x_ptr, area_ptr, p_ptr, R, V, stride_b, stride_r, CHUNK: tl.constexpr, ALIGNED: tl.constexpr,
                AREA: tl.constexpr):
    n = tl.program_id(0)
    c = tl.program_id(1)
    if tl.load(p_ptr + n // R) < 1.0:
        offs, _, u = _row_keys(x_ptr, n, c, R, V, stride_b, stride_r, CHUNK, ALIGNED)
        tl.atomic_max(area_ptr + n.to(tl.int64) * AREA + _MAX, tl.max(tl.where(offs < V, u, 0), axis=0))


@triton.jit(do_not_specialize=["R", "V", "stride_b", "stride_r", "n_chunks"])
def _window_kernel(x_ptr, area_ptr, tot_ptr, p_ptr, temp_ptr, R, V, stride_b, stride_r, n_chunks,
                   CHUNK: tl.constexpr, ALIGNED: tl.constexpr, FP16: tl.constexpr, WINDOW: tl.constexpr,
                   AREA: tl.constexpr):
    n = tl.program_id(0)
    c = tl.program_id(1)
    if tl.load(p_ptr + n // R) < 1.0:
        area = area_ptr + n.to(tl.int64) * AREA
        kmax = tl.load(area + _MAX)
        t = tl.load(temp_ptr + n // R)
        m = key_to_z(kmax, t, FP16)
        m = tl.where(m == float("-inf"), 0.0, m)
        offs, s, u = _row_keys(x_ptr, n, c, R, V, stride_b, stride_r, CHUNK, ALIGNED)
        valid = offs < V
        z = key_to_z(u, t, FP16)
        tl.store(tot_ptr + n.to(tl.int64) * n_chunks + c, tl.sum(tl.where(valid, tl.exp(z - m), 0.0), axis=0))
        d = kmax - u
        tl.atomic_add(area + _HEAD + d, 1, mask=valid & (d < WINDOW))


@triton.jit(do_not_specialize=["R", "V", "n_chunks"])
def _finish_kernel(area_ptr, tot_ptr, p_ptr, temp_ptr, thr_ptr, R, V, n_chunks, NC_PAD: tl.constexpr,
                   FP16: tl.constexpr, WINDOW: tl.constexpr, AREA: tl.constexpr):
    n = tl.program_id(0)
    p = tl.load(p_ptr + n // R)
    thr = float("-inf")
    if p < 1.0:
        area = area_ptr + n.to(tl.int64) * AREA
        kmax = tl.load(area + _MAX)
        t = tl.load(temp_ptr + n // R)
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
        thr = tl.where(total > 0, key_to_z(kmax - tl.maximum(last, 0), t, FP16), float("-inf"))
        decided = decided | ~(total > 0)
        tl.store(area + _FLAG, (~decided).to(tl.int32))
    tl.store(thr_ptr + n, thr)


class _Cache:
    """Compiled kernels of the direct launches (see :class:`.direct._Launcher`), per argument signature."""
    direct: dict = {}


def _key(tensors: tuple, ints: tuple, consts: dict, device: torch.device):
    if not direct._DIRECT or device.type != "cuda" or device.index != torch.cuda.current_device():
        return None
    ptr = 0
    for t in tensors:
        ptr |= t.data_ptr()
    if ptr & direct._ALIGN_MASK or max(ints) > direct._INT32_MAX:
        return None
    return (tuple(t.dtype for t in tensors), ints, tuple(sorted(consts.items())))


def _launch(kernel, grid, tensors: tuple, ints: tuple, consts: dict) -> None:
    direct._launcher(kernel)(_Cache, grid, (*tensors, *ints), consts, _key(tensors, ints, consts,
                                                                           tensors[0].device))


def supports(logits: torch.Tensor) -> bool:
    """Whether :func:`top_p_thresholds16` takes these logits (16-bit floats, ids contiguous)."""
    return logits.dtype in (torch.bfloat16, torch.float16) and logits.stride(-1) == 1


def top_p_thresholds16(logits: torch.Tensor, top_p: torch.Tensor, temperature: torch.Tensor, *,
                       window: int = 0, chunk: int = 0, fallback: bool = True) -> torch.Tensor:
    """Top-p keep thresholds float32 [B, R] of logits [B, R, V] (bf16 / fp16, unit stride over V): keep
    z = logit / T >= thr; -inf where top_p >= 1. ``top_p`` / ``temperature``: float32 [B] on the logits' device.
    ``window`` / ``chunk``: :data:`WINDOW` / :data:`CHUNK` when 0 (powers of two). ``fallback=False`` (tests)
    leaves flagged rows with the window's value. Four launches and a memset; no host sync."""
    if not supports(logits):
        raise ValueError(f"top_p_thresholds16 takes bf16 / fp16 logits with unit stride over V, got "
                         f"{logits.dtype} with strides {tuple(logits.stride())}")
    for name, t in (("top_p", top_p), ("temperature", temperature)):
        if t.shape != logits.shape[:1] or t.device != logits.device or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [B] = [{logits.shape[0]}] on {logits.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    window, chunk = window or WINDOW, chunk or CHUNK
    if window & (window - 1) or chunk & (chunk - 1):
        raise ValueError(f"window and chunk must be powers of 2, got {window}, {chunk}")
    batch, rows, vocab = logits.shape
    thr = torch.empty((batch, rows), device=logits.device, dtype=torch.float32)
    n_rows = batch * rows
    if n_rows == 0:
        return thr
    n_chunks = triton.cdiv(vocab, chunk)
    bits = logits.view(torch.int16)
    area_words = HEAD_WORDS + window
    area = torch.zeros((n_rows, area_words), device=logits.device, dtype=torch.int32)
    tot = torch.empty((n_rows, n_chunks), device=logits.device, dtype=torch.float32)
    strides = (bits.stride(0), bits.stride(1))
    aligned = bits.data_ptr() % 16 == 0 and vocab % 8 == 0 and all(s % 8 == 0 for s in strides)
    fp16 = logits.dtype == torch.float16
    grid = (n_rows, n_chunks, 1)
    sizes = (rows, vocab, *strides)
    _launch(_max_kernel, grid, (bits, area, top_p), sizes,
            dict(CHUNK=chunk, ALIGNED=aligned, AREA=area_words, num_warps=NUM_WARPS))
    _launch(_window_kernel, grid, (bits, area, tot, top_p, temperature), (*sizes, n_chunks),
            dict(CHUNK=chunk, ALIGNED=aligned, FP16=fp16, WINDOW=window, AREA=area_words, num_warps=NUM_WARPS))
    _launch(_finish_kernel, (n_rows, 1, 1), (area, tot, top_p, temperature, thr), (rows, vocab, n_chunks),
            dict(NC_PAD=triton.next_power_of_2(n_chunks), FP16=fp16, WINDOW=window, AREA=area_words,
                 num_warps=4))
    if fallback:
        thresholds.gated_top_p(logits, temperature, top_p, area[:, 1:], area_words, thr)
    return thr
