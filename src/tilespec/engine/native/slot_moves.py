"""One launch that moves a token tree's accepted path into place in every K/V buffer of a model.

Why: a tree step ends by moving the accepted nodes' K/V to the slots W .. W + P - 1 (engine/tree_step.compact). As
PyTorch ops that is one gather and one copy per buffer -- 112 small kernels for a 28-layer model, ~430 µs of a
(8, 6, 32) tree step even inside the step's CUDA graph (bench/scripts/step_cost_profile.py's profile in
bench/results/step-cost-one-launch-compaction-random-qwen2.5-1.5b-shaped-h200.json, ``runs_gather_per_buffer``).
Here one program per (buffer, request, KV head) copies its P slots through a table of the buffers' addresses: one
launch for all layers.

Order: dst[j] = W + j and src[b, j] = W + path[b, j] with path[b, j] >= j (node indices grow along a tree path;
padding stays in place), so copying j = 0, 1, ... in order inside one program never overwrites a slot that a later
j reads; programs touch disjoint (request, head) rows.

Where: CUDA, or Triton's CPU interpreter for the tests. The address table is made once per set of buffers (a step's
warm-up run makes it before a CUDA-graph capture records the launch). Opt-in (the "compact" part of
TILESPEC_NATIVE_KERNELS, engine/tree_step.one_launch); timed against the gathers in the same results file
(``runs_one_launch``: 4.00 vs 4.44 ms per (8, 6, 32) tree step).
"""
from __future__ import annotations

import torch

from tilespec.env import triton_interpreted, use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()   # before the kernel is decorated (CPU tests run it in the interpreter)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

_TABLES: dict = {}      # (device, buffers' addresses) -> int64 device tensor of those addresses


@triton.jit
def _move_kernel(table_ptr, ref_ptr, dst_ptr, src_ptr, P, H, s_b, s_h, s_c, D, BLOCK_D: tl.constexpr):
    """Program (b * H + h, buffer i): slots dst[j] <- src[b, j] of row (b, h) of buffer i, for j = 0 .. P - 1.
    B * H is on grid axis 0 (up to 2^31 - 1 programs; CUDA caps axes 1 and 2 at 65,535), the buffers on axis 1."""
    bh = tl.program_id(0)
    i = tl.program_id(1)
    b = bh // H
    h = bh % H
    base = tl.load(table_ptr + i).to(ref_ptr.dtype)          # buffer i's address, typed like the first buffer
    row = base + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h
    rd = tl.arange(0, BLOCK_D)
    ok = rd < D
    for j in range(P):
        s = tl.load(src_ptr + b * P + j).to(tl.int64)
        d = tl.load(dst_ptr + j).to(tl.int64)
        x = tl.load(row + s * s_c + rd, mask=ok)
        tl.store(row + d * s_c + rd, x, mask=ok)


def supported(buffers) -> bool:
    """True when :func:`move_path_slots` can move these buffers in one launch: on CUDA (or under the interpreter),
    every buffer [B, H, C, D] with the same shape, strides and dtype, D contiguous."""
    if not buffers:
        return False
    ref = buffers[0]
    on = ref.is_cuda or (ref.device.type == "cpu" and triton_interpreted())
    return on and ref.dim() == 4 and ref.stride(3) == 1 and all(
        t.device == ref.device and t.dtype == ref.dtype and t.shape == ref.shape and t.stride() == ref.stride()
        for t in buffers)


def move_path_slots(buffers, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Every buffer [B, H, C, D]: slot dst[j] <- slot src[b, j] of request b, in place, for dst [P] = W + j and
    src [B, P] >= dst (a tree path's slots; see the module docstring). Raises ValueError for buffers
    :func:`supported` refuses or slot tensors of other shapes (the kernel would read or write out of bounds)."""
    if not supported(buffers):
        raise ValueError("move_path_slots needs CUDA (or interpreter) buffers [B, H, C, D] of one shape, stride and "
                         "dtype with contiguous D")
    ref = buffers[0]
    b, h, c, d = ref.shape
    p = dst.shape[0]
    if dst.dim() != 1 or tuple(src.shape) != (b, p) or dst.device != ref.device or src.device != ref.device:
        raise ValueError(f"slots must be dst [P] and src [B={b}, P] on {ref.device}, got {tuple(dst.shape)} and "
                         f"{tuple(src.shape)}")
    if p == 0 or b == 0:
        return
    key = (str(ref.device),) + tuple(t.data_ptr() for t in buffers)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) > 32:
            _TABLES.clear()
        table = _TABLES[key] = torch.tensor(key[1:], dtype=torch.int64, device=ref.device)
    dst = dst.to(torch.int64).contiguous()
    src = src.to(torch.int64).contiguous()
    _move_kernel[(b * h, len(buffers))](table, ref, dst, src, p, h, ref.stride(0), ref.stride(1), ref.stride(2), d,
                                        BLOCK_D=triton.next_power_of_2(d))
