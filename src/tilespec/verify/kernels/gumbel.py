"""Keyed Gumbel-max sampling in one or two launches: one token per row from logits (or log-weights) without a
probability tensor and without PyTorch's Philox (~150 small kernels per call over a row).

Row b's token is argmax_i (x[b, i] / T_b + G(seed_b, position_b, purpose, id_i)) with G = -log(-log u) and u the
keyed uniform of :mod:`tilespec.verify.rng` (``keyed_uniform``: the same numbers as ``rng.uniform``), the first index
on ties; a row with T_b = 0 takes argmax_i x[b, i] (no noise). ``ids`` (optional) maps column i to the vocabulary id
that keys its noise and is returned (a draft head's reduced vocabulary).

Layout: a row is cut into CHUNK-wide chunks, one program each (so a B = 1 draw of a 151,936-id row runs on ~38
SMs, not one); each writes its chunk's maximum and first argmax, and a second launch picks, per row, the first chunk
holding the row maximum (a row of one chunk is finished by the first launch). The chunking depends on N only, so
a row's result never depends on the batch. The PyTorch reference is ``tilespec.verify.sampling``.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import triton
import triton.language as tl

from .common import keyed_uniform

BLOCK, NUM_WARPS = 2048, 8     # sm_90, offline compile: 63-73 registers, no spills (4 warps: 109-121)
CHUNK = 4096                   # ids per program (a multiple of BLOCK)


@triton.jit
def gumbel_chunks_kernel(x_ptr, ids_ptr, temp_ptr, seed_ptr, pos_ptr, val_ptr, idx_ptr, out_ptr, N, stride_x,
                         n_chunks, PURPOSE: tl.constexpr, HAS_IDS: tl.constexpr, FINAL: tl.constexpr,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    temp = tl.load(temp_ptr + row)
    greedy = temp == 0.0
    safe_t = tl.where(greedy, 1.0, temp)
    best_v = float("-inf")
    best_i = chunk * CHUNK
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < N
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=inside, other=float("-inf")).to(tl.float32)
        if HAS_IDS:
            tok = tl.load(ids_ptr + offs, mask=inside, other=0).to(tl.int32)
        else:
            tok = offs.to(tl.int32)
        u = keyed_uniform(seed, pos, PURPOSE, tok)
        noisy = tl.div_rn(x, safe_t) - tl.log(-tl.log(u))
        v = tl.where(inside, tl.where(greedy, x, noisy), float("-inf"))
        bv = tl.max(v, axis=0)
        bi = tl.argmax(v, axis=0)
        take = bv > best_v
        best_i = tl.where(take, start + bi, best_i)
        best_v = tl.where(take, bv, best_v)
    if FINAL:
        if HAS_IDS:
            best_i = tl.load(ids_ptr + best_i)
        tl.store(out_ptr + row, best_i.to(tl.int64))
    else:
        tl.store(val_ptr + row * n_chunks + chunk, best_v)
        tl.store(idx_ptr + row * n_chunks + chunk, best_i)


@triton.jit
def gumbel_pick_kernel(val_ptr, idx_ptr, ids_ptr, out_ptr, n_chunks, HAS_IDS: tl.constexpr, CB: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, CB)
    inside = offs < n_chunks
    v = tl.load(val_ptr + row * n_chunks + offs, mask=inside, other=float("-inf"))
    top = tl.max(v, axis=0)
    first = tl.min(tl.where(inside & (v == top), offs, CB), axis=0)
    best_i = tl.load(idx_ptr + row * n_chunks + first)
    if HAS_IDS:
        best_i = tl.load(ids_ptr + best_i)
    tl.store(out_ptr + row, best_i.to(tl.int64))


def gumbel_argmax(x: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  purpose: int, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [B, N] (fp32 / bf16 / fp16; copied if its last dimension is strided), temperature [B] fp32 (0: argmax),
    seeds / positions [B] int64, ids [N] int64 or None -> [B] int64 (``ids[i]`` of the chosen column, else i).
    No host sync."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    b, n = x.shape
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(n))
    chunk = min(max(CHUNK // block, 1), triton.cdiv(n, block)) * block
    n_chunks = triton.cdiv(n, chunk)
    ids_arg = ids if ids is not None else out
    val = torch.empty(b * n_chunks if n_chunks > 1 else 1, dtype=torch.float32, device=x.device)
    idx = torch.empty(b * n_chunks if n_chunks > 1 else 1, dtype=torch.int32, device=x.device)
    gumbel_chunks_kernel[(b, n_chunks)](x, ids_arg, temperature, seeds, positions, val, idx, out, n, x.stride(0),
                                        n_chunks, PURPOSE=purpose, HAS_IDS=ids is not None, FINAL=n_chunks == 1,
                                        CHUNK=chunk, BLOCK=block, num_warps=NUM_WARPS)
    if n_chunks > 1:
        gumbel_pick_kernel[(b,)](val, idx, ids_arg, out, n_chunks, HAS_IDS=ids is not None,
                                 CB=triton.next_power_of_2(n_chunks))
    return out
