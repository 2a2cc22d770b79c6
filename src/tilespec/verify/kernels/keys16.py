"""Order keys of 16-bit logits and the per-row work area shared by the top-k / top-p kernels of :mod:`.topk16`.

A bf16 / fp16 value has one of 2^16 bit patterns; its order key u in [0, 2^16) is bits + 2^15 for a clear sign bit
and 2^15 - 1 - (bits & 0x7FFF) for a set one, so u is non-decreasing in the value (-0.0 and +0.0 get different keys
but one value). Keys of a row's kept values are collected into ``vals`` [N, CAP] (int32, in arbitrary order: the
readers sort them).

Row n's int32 work area (``ROW_WORDS`` words, zeroed before a call): the fallback's digit counts at 256 * pass
(< 1024), then the words below.
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import triton
import triton.language as tl

ROW_WORDS_INT = 1032
ROW_WORDS = tl.constexpr(ROW_WORDS_INT)
W_USTAR = tl.constexpr(1024)      # fallback: u*, the k-th largest key
W_AT = tl.constexpr(1025)         # fallback: the number of ids with key u*
W_PIVOT_N = tl.constexpr(1026)    # ids collected with key >= the pivot (> CAP: the row takes the fallback)
W_ABOVE_N = tl.constexpr(1027)    # fallback: ids collected with key > u*
W_PIVOT = tl.constexpr(1028)      # the pivot key


@triton.jit
def row_keys(x_ptr, n, offs, R, V, stride_b, stride_r, ALIGNED: tl.constexpr):
    """Order keys u (int32, the shape of ``offs``) of row n at ids ``offs``; -1 (below every key) where >= V."""
    row = x_ptr + (n // R).to(tl.int64) * stride_b + (n % R) * stride_r
    if ALIGNED:
        row = tl.multiple_of(row, 16)
    s = tl.load(row + offs, mask=offs < V, other=0).to(tl.int32)      # int16 bits, sign-extended
    return tl.where(offs < V, tl.where(s >= 0, s + 32768, -1 - s), -1)


@triton.jit
def key_to_z(u, t, FP16: tl.constexpr):
    """z = float(value of key u) / T (correctly rounded; T = 1 for greedy rows), as ``filters.scaled_logits``."""
    bits = tl.where(u >= 32768, u - 32768, -1 - u).to(tl.int16)
    if FP16:
        x = bits.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        x = bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    return tl.div_rn(x, tl.where(t > 0, t, 1.0))


@triton.jit
def top_on(k_ptr, n, R, V):
    """Row n's k and whether top-k is on for it (0 < k < V)."""
    k = tl.load(k_ptr + n // R)
    return k, (k > 0) & (k < V)


@triton.jit
def append_keys(u, take, area, slot_word, vals_row, CAP: tl.constexpr):
    """Appends the keys ``u`` where ``take`` to ``vals_row`` at slots from the counter in word ``slot_word`` of the
    row's work area: one atomic per taken id (few in a chunk); a chunk with more than CAP only adds its count (the
    row then overflows)."""
    count = tl.sum(take.to(tl.int32), axis=0)
    if count > CAP:
        tl.atomic_add(area + slot_word, count)
    elif count > 0:
        slot = tl.atomic_add(area + slot_word + tl.zeros_like(u), 1, mask=take)
        tl.store(vals_row + slot, u, mask=take & (slot < CAP))
