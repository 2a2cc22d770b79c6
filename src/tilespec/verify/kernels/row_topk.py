"""Top-k (k <= 16) of a few wide rows in two launches: a draft head's tree frontier (B·k rows of a 32,000-151,936
entry vocabulary) at every depth. ``torch.topk`` runs multi-pass radix selects there, then a sort: its radix-select
kernels alone took ~140 µs of a (8, 6, 32) tree step (bench/results/step-cost-random-qwen2.5-1.5b-shaped-h200.json,
measured before this kernel).

Launch 1, grid (R, S): chunk s (CHUNK entries) of row r -> its k largest entries, largest first, by k rounds of
(maximum, first index of it, knock it out) over the chunk held in registers. Launch 2, grid (R,): the same rounds
over the row's S·k candidates. Values are compared as order-preserving int32 keys of their fp32 value (a negative
float's low 31 bits flipped); knocked-out and padding entries get INT32_MIN, below every real key, -inf's included,
so an entry is never taken twice.

Result: the values of ``torch.topk(x.float(), k, sorted=True)`` and indices holding them; among equal values the
lowest index comes first (torch leaves that order unspecified). NaN sorts above +inf. Fixed grids, no host sync:
safe inside CUDA-graph capture. Called through ``wide_rows.topk`` (an opaque operator for compiled callers).
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import torch
import triton
import triton.language as tl

NONE = tl.constexpr(-2147483648)   # the key of a knocked-out or padding entry (INT32_MIN)


@triton.jit
def _to_key(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _from_key(key):
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return tl.where(key == NONE, float("-inf"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _rounds(keys, idx, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    """k rounds over ``keys`` [BLOCK] (indices ``idx``) -> (keys [KP], indices [KP]) largest first."""
    slot = tl.arange(0, KP)
    pos = tl.arange(0, BLOCK)
    out_k = tl.full([KP], NONE, tl.int32)
    out_i = tl.zeros([KP], tl.int32)
    for j in tl.static_range(K):
        best, at = tl.max(keys, axis=0, return_indices=True, return_indices_tie_break_left=True)
        out_k = tl.where(slot == j, best, out_k)
        out_i = tl.where(slot == j, tl.sum(tl.where(pos == at, idx, 0), axis=0), out_i)
        keys = tl.where(pos == at, NONE, keys)
    return out_k, out_i


@triton.jit
def _chunk_kernel(x_ptr, key_ptr, idx_ptr, V, stride_x, n_chunks, K: tl.constexpr, KP: tl.constexpr,
                  CHUNK: tl.constexpr):
    row = tl.program_id(0)
    ch = tl.program_id(1)
    offs = ch * CHUNK + tl.arange(0, CHUNK)
    inside = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=inside, other=0.0).to(tl.float32)
    keys = tl.where(inside, _to_key(x), NONE)
    out_k, out_i = _rounds(keys, offs, K, KP, CHUNK)
    dst = (row * n_chunks + ch) * KP + tl.arange(0, KP)
    tl.store(key_ptr + dst, out_k)
    tl.store(idx_ptr + dst, out_i)


@triton.jit
def _final_kernel(key_ptr, idx_ptr, val_ptr, out_idx_ptr, n_cand, K: tl.constexpr, KP: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inside = offs < n_cand
    keys = tl.load(key_ptr + row * n_cand + offs, mask=inside, other=NONE)
    idx = tl.load(idx_ptr + row * n_cand + offs, mask=inside, other=0)
    out_k, out_i = _rounds(keys, idx, K, KP, BLOCK)
    slot = tl.arange(0, KP)
    tl.store(val_ptr + row * K + slot, _from_key(out_k), mask=slot < K)
    tl.store(out_idx_ptr + row * K + slot, out_i.to(tl.int64), mask=slot < K)


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def launch(x: torch.Tensor, k: int, chunk: int = 2048) -> tuple:
    """x [..., V] float -> (values [..., k] in x's dtype, indices [..., k] int64), largest first; ``chunk``: entries
    per program of launch 1 (a power of two). Callers check :func:`tilespec.verify.wide_rows.kernel_takes` first
    (k <= 16, the candidates of launch 2 bounded)."""
    v = x.shape[-1]
    rows = x.reshape(-1, v)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    r, s, kp = rows.shape[0], -(-v // chunk), _pow2(k)
    keys = torch.empty((r, s, kp), dtype=torch.int32, device=x.device)
    idx = torch.empty((r, s, kp), dtype=torch.int32, device=x.device)
    _chunk_kernel[(r, s)](rows, keys, idx, v, rows.stride(0), s, K=k, KP=kp, CHUNK=chunk, num_warps=4)
    vals = torch.empty((r, k), dtype=torch.float32, device=x.device)
    out = torch.empty((r, k), dtype=torch.int64, device=x.device)
    _final_kernel[(r,)](keys, idx, vals, out, s * kp, K=k, KP=kp, BLOCK=_pow2(max(s * kp, 16)), num_warps=4)
    shape = (*x.shape[:-1], k)
    return vals.view(shape).to(x.dtype), out.view(shape)
