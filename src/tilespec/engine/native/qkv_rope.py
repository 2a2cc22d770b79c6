"""A decode layer's front in one Triton kernel: residual add + RMSNorm + q/k/v projection + bias + RoPE + K/V write.

Why: in the compiled layer this is five launches (the residual add fused into the norm, cuBLAS' q/k/v GEMM with its
bias, two inductor kernels for RoPE and the two cache writes) around a 6.3 MB weight that the GPU streams in ~2 µs
(Qwen2.5-1.5B; ``bench/results/forward-profile-*.json``). Here every program owns a slice of W's rows that holds
RoPE pairs (dims d and d + D/2 of one head: two accumulators), so the rotation, the bias and the store to q or to
the cache happen in the program that computed them, before anything is written.

Shapes: h, r [M, K] with M = B * Q rows (row m = (b, t) = (m // Q, m % Q)), the layer's incoming pair whose bf16 sum
is the hidden state; norm weight [K]; w [(H + 2 H_kv) D, K] (the fused q/k/v weight, row-major), bias [(H + 2 H_kv) D]
or None; cos, sin [M, D] fp32 (the prologue's tables, halves not interleaved); K/V caches [B, H_kv, C, D] with D
contiguous and write_pos a 0-d int64 device tensor (K/V written at slots write_pos + t), or paged caches
[S, H_kv, D] (slot-major) and write_pos [M] int64, row m's slot (``slots=True``). Outputs: res = h + r [M, K] (the
residual for the output projection), q [B, H, Q, D] contiguous (RoPE applied), and the K/V writes.

Rounding follows the PyTorch layer step by step: the bf16 residual sum, the RMS scale (fp32 mean of squares), the
normed input rounded to the model dtype and multiplied by the norm weight (rounded), fp32 accumulation of the
projection (a different summation order than cuBLAS), bias added in fp32 and the projection rounded, RoPE in fp32 from
the rounded projection, rounded once more. So outputs equal the PyTorch path up to the GEMM's summation order.

Where it runs: CUDA (in CUDA graphs: no host sync, grid from shapes) or under ``TRITON_INTERPRET=1`` (CPU tests);
:func:`can_run` says when, else the caller keeps the PyTorch ops.
"""
from __future__ import annotations

import torch

from tilespec.env import triton_interpreted, use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()   # before the kernel is decorated (CPU tests run it in the interpreter)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_ROWS = 8             # rows the kernel takes (the fused layer uses it at one row: fused_layer.ROWS)
# launch parameters (module globals: bench/scripts/forward_profile.py sweeps them); the fastest at M = 1 for the
# Qwen2.5-1.5B shape on an H200 (forward-profile-qwen1.5b-shape-h200.json)
BLOCK_K = 1024
HALF_BLOCK = 8           # rows of each half of a RoPE pair per program
NUM_STAGES = 3
NUM_WARPS = 4
_INTERPRET = triton_interpreted()


@triton.jit
def _qkv_rope_kernel(h_ptr, r_ptr, res_ptr, g_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, wp_ptr,
                     M, Q, K, eps, H, HKV, s_kb, s_kh, s_kc,
                     HAS_BIAS: tl.constexpr, SLOTS: tl.constexpr, D: tl.constexpr, HB: tl.constexpr,
                     BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Program p: head p // (D / 2 / HB) (q heads, then k, then v), dims [j HB, (j + 1) HB) and the same + D / 2.
    Multiply-add on CUDA cores, one row at a time against the W tile in registers (M <= 8: W is read once)."""
    pid = tl.program_id(0)
    per_head = (D // 2) // HB
    head = pid // per_head
    dl = (pid % per_head) * HB + tl.arange(0, HB)                 # dims of the first half
    rows_lo = head * D + dl
    rows_hi = rows_lo + D // 2
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    dtype = q_ptr.dtype.element_ty
    # pass 1: the RMS of each row of h + r (M x K activations, a few KB: they stay in L1 / L2 for pass 2)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        msk = m_ok[:, None] & (rk < K)[None, :]
        offs = rm[:, None] * K + rk[None, :]
        x = (tl.load(h_ptr + offs, mask=msk, other=0.0).to(tl.float32)
             + tl.load(r_ptr + offs, mask=msk, other=0.0).to(tl.float32)).to(dtype)
        if pid == 0:
            tl.store(res_ptr + offs, x, mask=msk)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    inv = 1.0 / tl.sqrt(ss / K + eps)
    # pass 2: stream the two row slices of W once; every row multiplies them
    acc_lo = tl.zeros([BLOCK_M, HB], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HB], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w_lo = tl.load(w_ptr + rows_lo[:, None] * K + rk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
        w_hi = tl.load(w_ptr + rows_hi[:, None] * K + rk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        for mi in tl.static_range(BLOCK_M):
            row = tl.minimum(M - 1, mi)    # padding rows (mi >= M) reread the last row; never stored
            x = (tl.load(h_ptr + row * K + rk, mask=k_ok, other=0.0).to(tl.float32)
                 + tl.load(r_ptr + row * K + rk, mask=k_ok, other=0.0).to(tl.float32)).to(dtype)
            inv_m = tl.sum(tl.where(rm == mi, inv, 0.0), axis=0)
            xn = (x.to(tl.float32) * inv_m).to(dtype)
            xg = (g * xn.to(tl.float32)).to(dtype).to(tl.float32)
            pick = (rm == mi)[:, None]
            acc_lo += tl.where(pick, tl.sum(w_lo * xg[None, :], axis=1)[None, :], 0.0)
            acc_hi += tl.where(pick, tl.sum(w_hi * xg[None, :], axis=1)[None, :], 0.0)
    if HAS_BIAS:
        acc_lo += tl.load(b_ptr + rows_lo).to(tl.float32)[None, :]
        acc_hi += tl.load(b_ptr + rows_hi).to(tl.float32)[None, :]
    y_lo = acc_lo.to(dtype).to(tl.float32)
    y_hi = acc_hi.to(dtype).to(tl.float32)
    t = rm % Q
    b = rm // Q
    out_mask = m_ok[:, None]
    if head < H + HKV:   # RoPE on q and k: (x * cos + rotate_half(x) * sin), rotate_half(x) = (-x_hi, x_lo)
        cs = rm[:, None] * D + dl[None, :]
        cos_lo = tl.load(cos_ptr + cs, mask=out_mask, other=0.0)
        sin_lo = tl.load(sin_ptr + cs, mask=out_mask, other=0.0)
        cos_hi = tl.load(cos_ptr + cs + D // 2, mask=out_mask, other=0.0)
        sin_hi = tl.load(sin_ptr + cs + D // 2, mask=out_mask, other=0.0)
        o_lo = (y_lo * cos_lo - y_hi * sin_lo).to(dtype)
        o_hi = (y_hi * cos_hi + y_lo * sin_hi).to(dtype)
    else:
        o_lo = y_lo.to(dtype)
        o_hi = y_hi.to(dtype)
    if head < H:
        qo = ((b * H + head) * Q + t)[:, None] * D + dl[None, :]
        tl.store(q_ptr + qo, o_lo, mask=out_mask)
        tl.store(q_ptr + qo + D // 2, o_hi, mask=out_mask)
    else:
        kvh = (head - H) % HKV
        if SLOTS:   # a slot per row (a paged cache): wp_ptr holds [M] slots, the batch stride is unused
            co = (kvh * s_kh + tl.load(wp_ptr + rm, mask=m_ok, other=0) * s_kc)[:, None] + dl[None, :]
        else:
            co = (b * s_kb + kvh * s_kh + (tl.load(wp_ptr) + t) * s_kc)[:, None] + dl[None, :]
        if head < H + HKV:
            tl.store(kc_ptr + co, o_lo, mask=out_mask)
            tl.store(kc_ptr + co + D // 2, o_hi, mask=out_mask)
        else:
            tl.store(vc_ptr + co, o_lo, mask=out_mask)
            tl.store(vc_ptr + co + D // 2, o_hi, mask=out_mask)


def _cache_strides(k_cache: torch.Tensor, slots: bool) -> tuple:
    """(batch, KV head, slot) strides in elements: [B, H_kv, C, D] caches, or [S, H_kv, D] paged ones (no batch)."""
    if slots:
        return 0, k_cache.stride(1), k_cache.stride(0)
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def can_run(h: torch.Tensor, w: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> bool:
    """True when :func:`qkv_rope` runs its kernel for these shapes and dtypes."""
    rows = h.numel() // max(1, h.shape[-1])
    half = head_dim // 2
    return ((h.is_cuda or _INTERPRET) and 0 < rows <= MAX_ROWS and h.dtype == w.dtype == k_cache.dtype
            and h.dtype in (torch.bfloat16, torch.float16, torch.float32) and w.is_contiguous()
            and h.shape[-1] == w.shape[1] and h.shape[-1] >= 16 and half % HALF_BLOCK == 0
            and head_dim & (head_dim - 1) == 0 and k_cache.stride(-1) == 1
            and v_cache.stride() == k_cache.stride() and v_cache.dtype == k_cache.dtype)


def qkv_rope(h: torch.Tensor, r: torch.Tensor, norm: torch.Tensor, w: torch.Tensor, bias, cos: torch.Tensor,
             sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, write_pos: torch.Tensor, *,
             heads: int, kv_heads: int, head_dim: int, eps: float, slots: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """h, r [B, Q, K] -> (res = h + r [B, Q, K], q [B, H, Q, D]); writes K/V at slots write_pos + [0, Q) of the
    caches [B, H_kv, C, D]. ``slots=True``: a paged cache [S, H_kv, D] (slot-major) and ``write_pos`` [B Q] int64,
    row m's slot. See the module docstring; callers check :func:`can_run` first."""
    b, nq, k = h.shape
    m = b * nq
    res = torch.empty_like(h)
    q = torch.empty((b, heads, nq, head_dim), dtype=h.dtype, device=h.device)
    grid = ((heads + 2 * kv_heads) * (head_dim // 2 // HALF_BLOCK),)
    _qkv_rope_kernel[grid](
        h.contiguous(), r.contiguous(), res, norm, w, bias if bias is not None else w,
        cos.reshape(m, head_dim).contiguous(), sin.reshape(m, head_dim).contiguous(), q, k_cache, v_cache,
        write_pos, m, nq, k, eps, heads, kv_heads, *_cache_strides(k_cache, slots),
        HAS_BIAS=bias is not None, SLOTS=slots, D=head_dim, HB=HALF_BLOCK, BLOCK_M=triton.next_power_of_2(m),
        BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)), NUM_STAGES=NUM_STAGES, num_warps=NUM_WARPS)
    return res, q
