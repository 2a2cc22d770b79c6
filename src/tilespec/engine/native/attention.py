"""Decode attention over the slot KV cache: split-KV ("flash decoding") Triton kernels for few query tokens.

Why: at decode and verification shapes (q <= 64 new tokens: a chain or a token tree, a cache of C slots) cuDNN's
SDPA kernels loop a handful of thread blocks over the whole capacity, masked slots included: at B = 1 ~9 µs per
layer at q = 1, C = 512 (Qwen2.5-1.5B heads), and at q > 1 ~15 µs at C = 512 but ~88-94 µs at C = 4,352 (a server's
rows; bench/results/attention-shapes-h200.json, ``sdpa_us``). Here the capacity is split into SPLIT-slot pieces,
each (request, KV head, piece) program handles every query head of its group at once (G = H / H_kv heads x q tokens
= one [M, D] tile, so K/V are read once per group), skips slot blocks that the mask hides entirely (unused capacity
costs a mask read, not a K/V read), and a second small kernel merges the pieces' online-softmax partials.

Semantics: ``F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)`` with the
default scale 1/sqrt(D), for an additive mask in the model dtype whose masked entries are finfo.min (never -inf,
as the engine builds them). A row masked everywhere (padding) stays finite (zeros or an average of V rows; SDPA
gives the mean of V there: such rows are ignored by the engine).

Shapes: q [B, H, Q, D] any strides (the engine passes a transposed view); k_cache, v_cache [B, H_kv, C, D]
contiguous; mask [B, 1, Q, C] (any strides). Output [B, H, Q, D] in q's dtype (a view of [B, Q, H, D]). D a power
of two (16-256), Q <= MAX_Q.

Where it runs: CUDA (inside ``torch.compile`` as user-defined Triton kernels, and in CUDA graphs: no host sync,
grids from shapes only) or under ``TRITON_INTERPRET=1``; :func:`supported` says when, else the caller keeps SDPA.
"""
from __future__ import annotations

import math

import torch

from tilespec.env import triton_interpreted, use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()   # before the kernels are decorated (CPU tests run them in the interpreter)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SPLIT = None  # cache slots per program (a power of two >= BLOCK_N); None: split_for(B, H_kv, C)
BLOCK_N = 64             # slots per inner step (a skipped step reads only its mask)
MAX_Q = 64               # query tokens per request (a token tree's nodes)
MAX_ROWS = 128           # rows (query heads of a KV group x tokens) per program
MERGE_ROWS = 32          # rows per program of the merge (a tree's 128-row blocks: 4 programs each)
_INTERPRET = triton_interpreted()


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, pm_ptr, pl_ptr, pacc_ptr, H, HKV, Q, C, NS, NCH, scale,
                    skip_below, sqb, sqh, sqq, smb, smq, smn,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SPLIT: tl.constexpr, F32DOT: tl.constexpr):
    """Program ((b * H_kv + j) * NCH + ch, s): rows m = ch * BLOCK_M + r of the group's G * Q rows (m = g * Q + t:
    head j * G + g, query token t) over slots [s * SPLIT, ...). Writes the piece's row max pm, sum pl and
    unnormalised P @ V pacc ([BLOCK_M, D], fp32)."""
    bjc = tl.program_id(0)
    s = tl.program_id(1)
    bj = bjc // NCH
    b = bj // HKV
    j = bj % HKV
    rl = tl.arange(0, BLOCK_M)
    rm = (bjc % NCH) * BLOCK_M + rl
    g = rm // Q
    t = rm % Q
    row_ok = rm < G * Q
    rd = tl.arange(0, D)
    head = j * G + g
    qv = tl.load(q_ptr + b * sqb + head[:, None] * sqh + t[:, None] * sqq + rd[None, :], mask=row_ok[:, None],
                 other=0.0)
    if F32DOT:
        qv = qv.to(tl.float32)
    kv_base = (b * HKV + j).to(tl.int64) * C * D
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(s * SPLIT, s * SPLIT + SPLIT, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < C
        add = tl.load(mask_ptr + b * smb + t[:, None] * smq + rn[None, :] * smn,
                      mask=row_ok[:, None] & n_ok[None, :], other=-3.0e38).to(tl.float32)
        # a step whose slots are all masked (or past C) for every row of the group is skipped: exp(masked - max)
        # is 0 in fp32 for any row that attends anywhere, so the step could not change the result
        if tl.max(tl.max(add, axis=1), axis=0) > skip_below:
            kt = tl.load(k_ptr + kv_base + rn[:, None] * D + rd[None, :], mask=n_ok[:, None], other=0.0)
            vt = tl.load(v_ptr + kv_base + rn[:, None] * D + rd[None, :], mask=n_ok[:, None], other=0.0)
            if F32DOT:
                sc = tl.dot(qv, tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                sc = tl.dot(qv, tl.trans(kt))
            sc = sc * scale + add
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if F32DOT:
                acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
    slot = bjc * NS + s
    tl.store(pm_ptr + slot * BLOCK_M + rl, m_i)
    tl.store(pl_ptr + slot * BLOCK_M + rl, l_i)
    tl.store(pacc_ptr + (slot * BLOCK_M + rl[:, None]) * D + rd[None, :], acc)


@triton.jit
def _merge_kernel(pm_ptr, pl_ptr, pacc_ptr, o_ptr, H, HKV, Q, NS, NCH,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
                  ROWS: tl.constexpr):
    """Program ((b * H_kv + j) * NCH + ch, r): merges the NS pieces of rows r * ROWS .. of its row block into o,
    stored [B, Q, H, D] (ROWS < BLOCK_M spreads a tree's large row blocks over more programs: each reads NS
    [ROWS, D] fp32 partials). A row that no piece attended to (every slot of the group masked) gets zeros."""
    bj = tl.program_id(0)           # (b * H_kv + j) * NCH + ch: the partials' row block
    b = bj // NCH // HKV
    j = bj // NCH % HKV
    rm = tl.program_id(1) * ROWS + tl.arange(0, ROWS)   # local row of the block (the partials' layout)
    rs = tl.arange(0, BLOCK_S)
    rd = tl.arange(0, D)
    s_ok = rs < NS
    pm = tl.load(pm_ptr + (bj * NS + rs[:, None]) * BLOCK_M + rm[None, :], mask=s_ok[:, None], other=float("-inf"))
    pl = tl.load(pl_ptr + (bj * NS + rs[:, None]) * BLOCK_M + rm[None, :], mask=s_ok[:, None], other=0.0)
    m = tl.max(pm, axis=0)                                              # [ROWS]
    seen = m > float("-inf")
    w = tl.where(seen[None, :], tl.exp(pm - tl.where(seen, m, 0.0)[None, :]), 0.0)   # [BLOCK_S, ROWS]
    denom = tl.sum(w * pl, axis=0)
    out = tl.zeros([ROWS, D], tl.float32)
    for si in range(NS):
        ws = tl.sum(tl.where(rs[:, None] == si, w, 0.0), axis=0)         # weight of piece si per row
        # pieces whose slots were all masked (unused capacity) have weight 0: their partials are never read
        part = tl.load(pacc_ptr + ((bj * NS + si) * BLOCK_M + rm[:, None]) * D + rd[None, :],
                       mask=(ws > 0)[:, None], other=0.0)
        out += part * ws[:, None]
    out = out / tl.where(seen, denom, 1.0)[:, None]
    row = (bj % NCH) * BLOCK_M + rm                                     # the group's row m = g * Q + t
    g = row // Q
    t = row % Q
    row_ok = row < G * Q
    o_off = ((b * Q + t) * H + j * G + g)[:, None] * D + rd[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when :func:`decode_attention` runs its kernels for these shapes / dtypes (else use SDPA)."""
    b, h, nq, d = q.shape
    return ((q.is_cuda or _INTERPRET) and q.dtype == k_cache.dtype
            and q.dtype in (torch.bfloat16, torch.float16, torch.float32) and 1 <= nq <= MAX_Q
            and k_cache.dim() == 4 and k_cache.shape[0] == b and k_cache.shape[3] == d and h % k_cache.shape[1] == 0
            and d >= 16 and d <= 256 and d & (d - 1) == 0 and k_cache.is_contiguous())


def preferred(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True where these kernels beat cuDNN's SDPA (bf16, Qwen2.5-1.5B heads, graph replay;
    bench/results/attention-shapes-h200.json, and attention-tree-shapes-h200.json since the merge spreads a tree's
    row blocks): every verify shape of 2-8 query tokens (cuDNN's q > 1 kernel walks the whole capacity: 15.7 µs
    against 9.5 at B 1, C 512; 89.9 against 18.6 at C 4,352), token trees (q > 8) of one request (q 32: 13.1 against
    16.3 µs at C 512, 19.6 against 31.8 at C 1,280) or over a large capacity or batch (C >= 1024 or B >= 32), and
    single-token steps of large batches over large caches (B >= 32, C >= 1024: 34 against 71 µs at B 64, C 4,352).
    Elsewhere cuDNN is as fast or faster (q = 1 at B <= 8: ~9 µs; trees of 2-31 requests over small caches, not
    re-measured since the merge change)."""
    if not supported(q, k_cache):
        return False
    b, nq, c = q.shape[0], q.shape[2], k_cache.shape[2]
    if nq == 1:
        return b >= 32 and c >= 1024
    return nq <= 8 or b == 1 or c >= 1024 or b >= 32


def split_for(b: int, hkv: int, c: int) -> int:
    """Cache slots per program: about C / 12 (a power of two in [64, 512]) while few programs run, so a request's
    capacity spreads over enough of them; 256 / 512 once B x H_kv >= 64 programs per piece fill the GPU anyway
    (the fastest of 64 / 128 / 256 / 512 in the measured shapes, or within 10 % of it)."""
    if b * hkv >= 64:
        return 512 if c >= 2048 else 256
    target = max(c / 12, 1.0)
    p = 64
    while p < 512 and abs(2 * p - target) < abs(p - target):
        p *= 2
    return p


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor
                     ) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v over the cache, GQA groups shared; see the module docstring for shapes.
    Returns [B, H, Q, D] (a transposed view of a contiguous [B, Q, H, D] tensor). Callers check :func:`supported`
    first."""
    return _launch(q, k_cache, v_cache, mask).transpose(1, 2)


@torch.library.custom_op("tilespec::decode_attention", mutates_args=())
def decode_attention_bqhd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor
                          ) -> torch.Tensor:
    """:func:`decode_attention` as an opaque operator for compiled code, returning [B, Q, H, D] contiguous (the
    layer flattens the heads next: no copy). Opaque, so inductor neither re-compiles the Triton kernels nor
    specialises on their shapes; inside a CUDA graph its launches cost nothing at replay."""
    return _launch(q, k_cache, v_cache, mask)


@decode_attention_bqhd.register_fake
def _(q, k_cache, v_cache, mask):
    b, h, nq, d = q.shape
    return q.new_empty((b, nq, h, d))


def _launch(q, k_cache, v_cache, mask) -> torch.Tensor:
    """Both kernels; returns o [B, Q, H, D] contiguous."""
    b, h, nq, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    grp = h // hkv
    # a group's G * Q rows in blocks of at most MAX_ROWS (token trees: Q up to 64); each block reads K/V once
    block_m = min(_pow2_at_least(grp * nq, 16), MAX_ROWS)  # (comparisons only: shapes may be symbolic when compiled)
    nch = (grp * nq + block_m - 1) // block_m
    split = SPLIT or split_for(b, hkv, c)
    ns = (c + split - 1) // split
    f32 = dict(dtype=torch.float32, device=q.device)
    pm = torch.empty((b * hkv * nch * ns, block_m), **f32)
    pl = torch.empty((b * hkv * nch * ns, block_m), **f32)
    pacc = torch.empty((b * hkv * nch * ns, block_m, d), **f32)
    out = torch.empty((b, nq, h, d), dtype=q.dtype, device=q.device)
    # steps whose mask is <= half of finfo.min everywhere are skipped (the engine's masked entries are finfo.min)
    skip_below = torch.finfo(mask.dtype).min / 2 if mask.dtype.is_floating_point else -1e30
    f32dot = q.dtype == torch.float32 or _INTERPRET     # (the interpreter's bf16 / fp16 dot is wrong in Triton 3.9)
    _partial_kernel[(b * hkv * nch, ns)](
        q, k_cache, v_cache, mask, pm, pl, pacc, h, hkv, nq, c, ns, nch, 1.0 / math.sqrt(d), skip_below,
        q.stride(0), q.stride(1), q.stride(2), mask.stride(0), mask.stride(2), mask.stride(3),
        G=grp, D=d, BLOCK_M=block_m, BLOCK_N=BLOCK_N, SPLIT=split, F32DOT=f32dot, num_warps=4)
    rows = min(block_m, MERGE_ROWS)
    _merge_kernel[(b * hkv * nch, block_m // rows)](pm, pl, pacc, out, h, hkv, nq, ns, nch, G=grp, D=d,
                                                    BLOCK_M=block_m, BLOCK_S=_pow2_at_least(ns, 2), ROWS=rows,
                                                    num_warps=4)
    return out


def _pow2_at_least(n, low: int) -> int:
    p = low
    while p < n:
        p *= 2
    return p


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor
                               ) -> torch.Tensor:
    """The same in PyTorch (fp32 math, K/V repeated over the groups), for tests."""
    grp = q.shape[1] // k_cache.shape[1]
    k = k_cache.float().repeat_interleave(grp, dim=1)
    v = v_cache.float().repeat_interleave(grp, dim=1)
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask.float()
    return (scores.softmax(-1) @ v).to(q.dtype)
