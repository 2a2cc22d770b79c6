"""Keyed Gumbel-max sampling in one launch: one token per row from logits (or log-weights) without a probability
tensor and without PyTorch's Philox (~150 small kernels per call over a row; they dominated a draft head's time per
token at T > 0 on an H100).

Row b's token is argmax_i (x[b, i] / T_b + G(seed_b, position_b, purpose, id_i)) with G = -log(-log u) and u the
keyed uniform of :mod:`tilespec.verify.rng` (``keyed_uniform``: the same numbers as ``rng.uniform``), the first index
on ties; a row with T_b = 0 takes argmax_i x[b, i] (no noise). ``ids`` (optional) maps column i to the vocabulary id
that keys its noise and is returned (a draft head's reduced vocabulary). One program per row walks the row in blocks
keeping a running maximum, so a row's result never depends on the batch. The PyTorch reference is
``tilespec.verify.sampling.gumbel_argmax_reference``.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import triton
import triton.language as tl

from .common import keyed_uniform

BLOCK, NUM_WARPS = 2048, 8     # sm_90, offline compile: 61 registers, no spills (4 warps: 111)


@triton.jit
def gumbel_argmax_kernel(x_ptr, ids_ptr, temp_ptr, seed_ptr, pos_ptr, out_ptr, N, stride_x,
                         PURPOSE: tl.constexpr, HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    temp = tl.load(temp_ptr + row)
    greedy = temp == 0.0
    safe_t = tl.where(greedy, 1.0, temp)
    best_v = float("-inf")
    best_i = 0
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < N
        x = tl.load(x_ptr + row * stride_x + offs, mask=inside, other=float("-inf")).to(tl.float32)
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
    ids_arg = ids if ids is not None else out
    gumbel_argmax_kernel[(b,)](x, ids_arg, temperature, seeds, positions, out, n, x.stride(0),
                               PURPOSE=purpose, HAS_IDS=ids is not None, BLOCK=min(BLOCK, triton.next_power_of_2(n)),
                               num_warps=NUM_WARPS)
    return out
