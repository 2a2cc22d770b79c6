"""Batch-invariant operators for the paged engine's deterministic mode (``PagedEngine(deterministic=True)``).

A request's logits change with the batch when a reduction's order depends on how many rows a step holds: cuBLAS
and Inductor pick other kernels (split-K, tile sizes, reduction layouts) for other row counts M. Here every
reduction runs in an order fixed per output element, whatever M and whatever the other rows hold (the approach of
vLLM's batch-invariant mode and of Thinking Machines' "Defeating Nondeterminism in LLM Inference", 2025):

  * :func:`linear` -- ``x [M, K] @ w.T (+ bias)`` as F.linear, a Triton kernel of ONE launch configuration
    (BLOCK_M / BLOCK_N / BLOCK_K, warps, stages fixed; M not specialised): each output element accumulates its K
    blocks in order 0, BLOCK_K, ... in fp32, no split-K, through a ``tl.dot`` of one shape. Under Triton's
    interpreter that dot is spelled as a sum of products (``SUM_DOT``): the interpreter's dot is numpy's BLAS matmul,
    whose result for a row depends on the row's place in the tile (measured), as a GPU MMA's is taken not to;
  * :func:`rms_norm` -- native.llama.rms_norm's maths, one program per row, the block fixed by the width alone.
The paged attention's invariant launch is attention.py's (``invariant=True``), its PyTorch path
attention_reference.attention_rows.

Both are ``torch.library.custom_op``s with fake impls: inside the torch.compile'd layer functions Inductor treats
them as opaque calls and cannot re-lower (re-tile) them. ``triton_op`` would let Inductor trace the body instead, but
the body picks the kernel or the fallback at run time and the fallback loops over rows, which does not trace.

The PyTorch fallback (off CUDA without Triton's interpreter, or a dtype the kernel does not take) computes one row
per call: each call then has the shape [1, K] whatever M, so the library's kernel choice cannot follow M either.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tilespec.env import triton_available, triton_interpreted, use_triton_interpreter_without_cuda

from ..native.llama import rms_norm as _torch_rms_norm

BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES = 64, 64, 64, 4, 3    # the one matmul configuration, for every M
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_TRITON = triton_available()
if _TRITON:
    use_triton_interpreter_without_cuda()   # before triton is imported (CPU runs use the interpreter)
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, K, sxm, swn, som, HAS_BIAS: tl.constexpr,
                       SUM_DOT: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (row block, column block): o = x @ w.T over the K blocks in order, fp32 accumulation."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(w_ptr + rn[None, :].to(tl.int64) * swn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None],
                        other=0.0)
            if SUM_DOT:
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
            elif IEEE:
                acc += tl.dot(a, b, input_precision="ieee")     # fp32 weights: no TF32, as F.linear
            else:
                acc += tl.dot(a, b)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptr + rm[:, None].to(tl.int64) * som + rn[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, o_ptr, sx, so, D, eps, BLOCK_D: tl.constexpr):
        """Program row: weight * (x * rsqrt(mean(x^2) + eps)).to(x's dtype), as native.llama.rms_norm."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        ok = cols < D
        x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
        y = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * so + cols, (w * y).to(o_ptr.dtype.element_ty), mask=ok)


def _kernel_takes(x: torch.Tensor, *others) -> bool:
    """Triton on CUDA or in its interpreter, and dtypes it handles (the rows must be contiguous: callers make them)."""
    return (_TRITON and (x.is_cuda or triton_interpreted()) and x.dtype in _DTYPES
            and all(t is None or t.dtype == x.dtype for t in others))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@torch.library.custom_op("tilespec::invariant_linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if not _kernel_takes(x, w, bias):
        for i in range(m):          # one [1, K] call per row: its kernel cannot depend on M
            out[i:i + 1] = F.linear(x[i:i + 1], w, bias)
        return out
    x, w = x.contiguous(), w.contiguous()
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](x, w, bias if bias is not None else w, out, m, n, k, x.stride(0), w.stride(0),
                         out.stride(0), HAS_BIAS=bias is not None, SUM_DOT=triton_interpreted(),
                         IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                         BLOCK_K=BLOCK_K, num_warps=WARPS, num_stages=STAGES)
    return out


@_linear_op.register_fake
def _(x, w, bias):
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.library.custom_op("tilespec::invariant_rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    m, d = x.shape
    out = torch.empty((m, d), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if m == 0:
        return out
    if not _kernel_takes(x, weight):
        for i in range(m):
            out[i:i + 1] = _torch_rms_norm(x[i:i + 1], weight, eps)
        return out
    x = x.contiguous()
    block = _pow2(d)
    _rms_norm_kernel[(m,)](x, weight.contiguous(), out, x.stride(0), out.stride(0), d, float(eps), BLOCK_D=block,
                           num_warps=8 if block >= 4096 else 4)
    return out


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, w, bias) with every row's result independent of the other rows and of their number."""
    lead = x.shape[:-1]
    return _linear_op(x.reshape(-1, x.shape[-1]), w, bias).view(*lead, w.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """native.llama.rms_norm(x, weight, eps), row by row (see :func:`linear`)."""
    return _rms_norm_op(x.reshape(-1, x.shape[-1]), weight, float(eps)).view(x.shape)

