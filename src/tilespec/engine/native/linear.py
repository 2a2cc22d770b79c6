"""Skinny linear layers for decode shapes: y = epilogue(prologue(x) @ W^T) in one Triton kernel.

Why: at decode and verification shapes (M = B * q <= 64 rows) a projection is a matrix-vector product bound by
reading W once. cuBLAS streams the large fused gate/up weight of a 1.5B model at ~2.5 TB/s but the small q/k/v and
output projections at only ~1 TB/s (5-6 µs each, one wave of 32-64 blocks), and every RMSNorm in front of a
projection is a kernel of its own (~1.7 µs) (the ``profile`` of bench/results/native-forward-random-init-h100.json).
This kernel gives every program a BLOCK_N-row slice of W, streams it over K with pipelined loads, recomputes the RMS
of the few x rows itself (they are tiny and stay in L2), and applies the epilogue before the single store, so a
layer's norm + projection + bias / residual / SiLU-gate is one launch.

Shapes and dtypes: x [..., K] (M = prod(leading dims) rows), W [N, K] row-major (an ``nn.Linear`` weight, the
fused q/k/v or gate/up tensors of engine/native/llama.py), bias [N], residual [..., N], norm weight [K], all in
the model dtype (bf16 / fp16 / fp32); fp32 accumulation. With ``silu_mul`` W holds [gate; up] ([2F, K]) and the
output is silu(x W_gate^T) * (x W_up^T), [..., F].

Rounding: the RMS scale of each row is applied to the fp32 accumulator after the loop (rms_norm(x) W^T = inv_rms(x)
(g * x) W^T; one pass over x instead of a dependent norm pass first), so in bf16 the normed input is not rounded at
the same point as ``llama.rms_norm`` does (a different rounding, not a different function); the projection is
rounded to the model dtype before a residual add or the SiLU gate, as the PyTorch ops do. In fp32 it equals the
PyTorch path up to summation order.

Where it runs: CUDA (inside ``torch.compile`` as a user-defined Triton kernel, and in CUDA graphs: no host sync,
grid from shapes only) or under ``TRITON_INTERPRET=1`` (the CPU tests). Elsewhere, and for M > MAX_ROWS,
:func:`fused_linear` runs the same maths in PyTorch (:func:`fused_linear_reference`).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from tilespec.env import triton_interpreted, use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()   # before the kernel is decorated (CPU tests run it in the interpreter)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_ROWS = 64            # above this (prefill) a GEMM is compute-shaped: cuBLAS through F.linear
BLOCK_K = 256            # launch parameters (module globals: bench/scripts/native_kernels.py sweeps them)
NUM_STAGES = 4
NUM_WARPS = 4
BLOCK_N_SMALL = 16       # output columns per program below 8,192 columns (q/k/v, o, down: more programs)
BLOCK_N_LARGE = 32       # from 8,192 columns, and for the gate/up pair
# up to FEW_ROWS rows: CUDA-core multiply-add (no 16-row tl.dot minimum: small BLOCK_N, more programs); the
# fastest at M = 1 for the Qwen2.5-1.5B shapes on an H200 (forward-profile-qwen1.5b-shape-h200.json). One row only:
# at M = 5 and 8 the row-by-row products ran 3-5x slower than cuBLAS (the same file's sweep), so those take tl.dot
FEW_ROWS = 1
FEW_BLOCK_N = 4          # o, down (and q/k/v through the "qkv" part)
FEW_BLOCK_N_LARGE = 8    # gate/up
FEW_BLOCK_K = 512
FEW_BLOCK_K_LONG = 1024  # K >= 4,096 (the down projection)
SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles per program (sm_90 allows 227 KB a block; leave room for the rest)
_INTERPRET = triton_interpreted()


@triton.jit
def _fused_linear_kernel(x_ptr, w_ptr, b_ptr, r_ptr, g_ptr, y_ptr, M, N_OUT, K, eps,
                         HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                         SILU_MUL: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Program n: output columns [n * BLOCK_N, (n + 1) * BLOCK_N) of all M rows. x, y, residual contiguous [M, *]."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N_OUT
    dtype = y_ptr.dtype.element_ty
    ss = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        xv = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_NORM:   # rms_norm(x) @ W^T = inv_rms(x) * ((g * x) @ W^T): the row scale is applied after the loop
            xf = xv.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            g = tl.load(g_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
            xv = (g[None, :] * xf).to(dtype)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SILU_MUL:   # the up rows sit N_OUT rows below the gate rows
            w2 = tl.load(w_ptr + (rn + N_OUT)[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                         other=0.0)
        if not DOT:    # few rows: each multiplies the W tile held in registers (no 16-row padding of tl.dot)
            xf = xv.to(tl.float32)
            for mi in tl.static_range(BLOCK_M):
                pick = (rm == mi)[:, None]
                xr = tl.sum(tl.where(pick, xf, 0.0), axis=0)[None, :]
                acc += tl.where(pick, tl.sum(w.to(tl.float32) * xr, axis=1)[None, :], 0.0)
                if SILU_MUL:
                    acc2 += tl.where(pick, tl.sum(w2.to(tl.float32) * xr, axis=1)[None, :], 0.0)
        elif IEEE:   # fp32 operands (fp32 models, and the interpreter, whose bf16 / fp16 dot is wrong in Triton 3.9)
            xv = xv.to(tl.float32)
            acc = tl.dot(xv, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            if SILU_MUL:
                acc2 = tl.dot(xv, tl.trans(w2.to(tl.float32)), acc2, input_precision="ieee")
        else:
            acc = tl.dot(xv, tl.trans(w), acc)
            if SILU_MUL:
                acc2 = tl.dot(xv, tl.trans(w2), acc2)
    if HAS_NORM:
        inv = 1.0 / tl.sqrt(ss / K + eps)
        acc = acc * inv[:, None]
        acc2 = acc2 * inv[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype)
    if SILU_MUL:
        gate = y.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = (act * acc2.to(dtype).to(tl.float32)).to(dtype)
    out_mask = m_ok[:, None] & n_ok[None, :]
    offs = rm[:, None] * N_OUT + rn[None, :]
    if HAS_RES:
        res = tl.load(r_ptr + offs, mask=out_mask, other=0.0).to(tl.float32)
        y = (res + y.to(tl.float32)).to(dtype)
    tl.store(y_ptr + offs, y, mask=out_mask)


def fused_linear_reference(x: torch.Tensor, w: torch.Tensor, *, bias=None, residual=None, norm=None,
                           eps: float = 1e-6, silu_mul: bool = False) -> torch.Tensor:
    """The PyTorch ops :func:`fused_linear` replaces (the native decoder's own code path)."""
    if norm is not None:
        xf = x.float()
        x = norm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = F.linear(x, w, bias)
    if silu_mul:
        f = y.shape[-1] // 2
        y = F.silu(y[..., :f]) * y[..., f:]
    return y if residual is None else residual + y


def _block_n(n_out: int, silu_mul: bool, few: bool = False) -> int:
    """Output columns per program: enough programs to cover the SMs a few times over on small projections."""
    if few:
        return FEW_BLOCK_N_LARGE if silu_mul or n_out >= 8192 else FEW_BLOCK_N
    return BLOCK_N_LARGE if silu_mul or n_out >= 8192 else BLOCK_N_SMALL


def can_run(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when the Triton kernel runs for this call (else :func:`fused_linear` falls back to PyTorch)."""
    rows = x.numel() // max(1, x.shape[-1])
    return ((x.is_cuda or _INTERPRET) and 0 < rows <= MAX_ROWS and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w.is_contiguous()
            and x.shape[-1] == w.shape[1] and x.shape[-1] >= 16)


def fused_linear(x: torch.Tensor, w: torch.Tensor, *, bias=None, residual=None, norm=None, eps: float = 1e-6,
                 silu_mul: bool = False) -> torch.Tensor:
    """epilogue(rms_norm(x) @ w^T): x [..., K] -> [..., N] ([..., N / 2] with ``silu_mul``); see the module
    docstring for the optional pieces and the rounding. Runs the Triton kernel when :func:`can_run`."""
    if not can_run(x, w):
        return fused_linear_reference(x, w, bias=bias, residual=residual, norm=norm, eps=eps, silu_mul=silu_mul)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    n_out = w.shape[0] // 2 if silu_mul else w.shape[0]
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    res = residual.reshape(m, n_out).contiguous() if residual is not None else y
    few = m <= FEW_ROWS
    block_m = triton.next_power_of_2(m) if few else (16 if m <= 16 else (32 if m <= 32 else 64))
    block_n = _block_n(n_out, silu_mul, few)
    block_k = (FEW_BLOCK_K_LONG if k >= 4096 else FEW_BLOCK_K) if few else BLOCK_K
    # pipelined stages that fit in shared memory (x tile + one or two W tiles per stage; fp32 tiles are twice bf16's)
    per_stage = (block_m + block_n * (2 if silu_mul else 1)) * block_k * (4 if x.dtype == torch.float32 else 2)
    stages = max(1, min(NUM_STAGES, SMEM_BUDGET // per_stage))
    grid = (triton.cdiv(n_out, block_n),)
    _fused_linear_kernel[grid](
        x2, w, bias if bias is not None else w, res, norm if norm is not None else w, y, m, n_out, k, eps,
        HAS_NORM=norm is not None, HAS_BIAS=bias is not None, HAS_RES=residual is not None, SILU_MUL=silu_mul,
        IEEE=x.dtype == torch.float32 or _INTERPRET, DOT=not few, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        NUM_STAGES=stages, num_warps=NUM_WARPS)
    return y.view(*lead, n_out)
