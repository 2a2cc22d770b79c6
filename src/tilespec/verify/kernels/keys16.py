"""Order keys of 16-bit logits and the per-row work area shared by the top-k / top-p kernels of :mod:`.topk16`.

A bf16 / fp16 value has one of 2^16 bit patterns; its order key u in [0, 2^16) is bits + 2^15 for a clear sign bit
and 2^15 - 1 - (bits & 0x7FFF) for a set one, so u is non-decreasing in the value (-0.0 and +0.0 get different keys
but one value). The ids a pass selects are appended to ``vals`` [N, CAP] as their raw bits (int32, sign-extended;
in arbitrary order: the reader converts them to keys and sorts).

Row n's int32 work area (``ROW_WORDS`` words, zeroed before a call) holds the words below.
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import torch
import triton
import triton.language as tl

ROW_WORDS_INT = 8
ROW_WORDS = tl.constexpr(ROW_WORDS_INT)
W_USTAR = tl.constexpr(0)      # fallback: u*, the k-th largest key
W_AT = tl.constexpr(1)         # fallback: the number of ids with key u*
W_PIVOT_N = tl.constexpr(2)    # ids collected with a value >= the pivot's (> CAP: the row takes the fallback)
W_ABOVE_N = tl.constexpr(3)    # fallback: ids collected with key > u*
W_PIVOT = tl.constexpr(4)      # the pivot key


@triton.jit
def row_of(t_ptr, d_ptr, n, NT, RT, RD, sbt, srt, sbd, srd, ALIGNED: tl.constexpr):
    """(row pointer, request) of row n: the target rows first (n < NT, RT per request, strides sbt / srt), then
    the draft rows (RD per request, strides sbd / srd; ``d_ptr`` = ``t_ptr`` and NT = N without a draft)."""
    if n < NT:
        b = n // RT
        row = t_ptr + b.to(tl.int64) * sbt + (n % RT).to(tl.int64) * srt
    else:
        b = (n - NT) // RD
        row = d_ptr + b.to(tl.int64) * sbd + ((n - NT) % RD).to(tl.int64) * srd
    if ALIGNED:
        row = tl.multiple_of(row, 16)
    return row, b


@triton.jit
def request_of(n, NT, RT, RD):
    return tl.where(n < NT, n // RT, (n - NT) // RD)


@triton.jit
def load_bits(row, offs, V):
    """Raw bits (int32, sign-extended) of a bf16 / fp16 row at ids ``offs``; 0 where >= V."""
    return tl.load(row + offs, mask=offs < V, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)


@triton.jit
def bits_to_key(s):
    return tl.where(s >= 0, s + 32768, -1 - s)


@triton.jit
def bits_to_float(s, FP16: tl.constexpr):
    if FP16:
        return s.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return s.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)


@triton.jit
def key_to_z(u, t, FP16: tl.constexpr):
    """z = float(value of key u) / T (correctly rounded; T = 1 for greedy rows), as ``filters.scaled_logits``."""
    x = bits_to_float(tl.where(u >= 32768, u - 32768, -1 - u), FP16)
    return tl.div_rn(x, tl.where(t > 0, t, 1.0))


@triton.jit
def top_on(k_ptr, b, V):
    """Request b's k and whether top-k is on for it (0 < k < V)."""
    k = tl.load(k_ptr + b)
    return k, (k > 0) & (k < V)


def supports16(logits: torch.Tensor) -> bool:
    """Whether the 16-bit threshold kernels take these logits: bf16 / fp16, ids contiguous."""
    return logits.dtype in (torch.bfloat16, torch.float16) and logits.stride(-1) == 1


def cached_work_areas(cache: dict, key, limit: int, make) -> tuple:
    """The work areas of ``key`` from ``cache``, else ``make()``, kept while the cache holds fewer than ``limit``
    shapes and no CUDA graph is being captured (a captured graph may hold their addresses; the kernels reset what
    they use, so the areas are zero between calls)."""
    bufs = cache.get(key)
    if bufs is None:
        bufs = make()
        device = bufs[0].device
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if len(cache) < limit and not capturing:
            cache[key] = bufs
    return bufs
