"""Pass 1 of ``fused``: per-chunk statistics of the logit rows, never writing probabilities.

Grid (NC, R, ceil(B / BLOCK_B)) with NC = ceil(V / CHUNK) vocabulary chunks, R = K+1 target rows (+ K draft rows
when draft logits are given) and BLOCK_B requests per program. Program (c, r, j) reads CHUNK logits of row r of
requests j*BLOCK_B .. j*BLOCK_B + BLOCK_B - 1 once (bf16/fp16/fp32, upcast to fp32 in registers), applies the
temperature and the optional per-row keep-threshold (top-k / top-p / min-p), and writes per request b
  m[b, r, c]  = max of the scaled, filtered logits in the chunk (-inf if the chunk is fully masked),
  s[b, r, c]  = sum exp(z - m) over the chunk (0 if fully masked),
  a[b, r, c]  = first argmax in the chunk (greedy requests only; target rows only).
Rows past a request's K_b (ragged padding) and draft rows of greedy requests are skipped. CHUNK and BLOCK_B are
fixed by V alone (BLOCK_B = 1 unless a whole row fits in one chunk), and every request of a block is reduced in its
own lanes, so a request's statistics (hence its tokens) do not depend on the batch it is in.
"""
from __future__ import annotations

from . import common  # noqa: F401  (interpreter setup)

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["B", "K", "V", "NC", "stride_tb", "stride_tr", "stride_db", "stride_dr"])
def row_stats_kernel(tgt_ptr, drf_ptr, nd_ptr, temp_ptr, thr_t_ptr, thr_q_ptr,
                     m_ptr, s_ptr, a_ptr,
                     B, K, V, NC, stride_tb, stride_tr, stride_db, stride_dr,
                     HAS_DRAFT_LOGITS: tl.constexpr, HAS_THR: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK_B: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1)
    req = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
    live = req < B
    k_b = tl.load(nd_ptr + req, mask=live, other=0)
    temp = tl.load(temp_ptr + req, mask=live, other=1.0)
    greedy = temp == 0.0
    scale = tl.where(greedy, 1.0, temp)
    is_target = r <= K
    row = tl.where(is_target, r, r - K - 1)
    # target rows 0..K_b; draft rows 0..K_b-1 of sampling (non-greedy) requests (the row index is broadcast to
    # [BLOCK_B] first: the interpreter turns scalar-bool & tensor-bool into int32)
    row_v = row + tl.zeros([BLOCK_B], tl.int32)
    if is_target:
        active = live & (row_v <= k_b)
    else:
        active = live & (row_v < k_b) & (temp != 0.0)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        offs = c * CHUNK + tl.arange(0, CHUNK)
        mask = active[:, None] & (offs < V)[None, :]
        req64 = req.to(tl.int64)
        if is_target:
            z = tl.load(tgt_ptr + (req64 * stride_tb + row * stride_tr)[:, None] + offs[None, :], mask=mask,
                        other=float("-inf")).to(tl.float32)
        else:
            z = tl.load(drf_ptr + (req64 * stride_db + row * stride_dr)[:, None] + offs[None, :], mask=mask,
                        other=float("-inf")).to(tl.float32)
        z = z / scale[:, None]
        if HAS_THR:
            if is_target:
                thr = tl.load(thr_t_ptr + req * (K + 1) + row, mask=active, other=0.0)
            else:
                thr = tl.load(thr_q_ptr + req * K + row, mask=active, other=0.0)
            z = tl.where(z >= thr[:, None], z, float("-inf"))
        z = tl.where(mask, z, float("-inf"))
        m = tl.max(z, axis=1)
        safe_m = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(tl.exp(z - safe_m[:, None]), axis=1)
        slot = (req * (2 * K + 1) + r) * NC + c
        tl.store(m_ptr + slot, m, mask=active)
        tl.store(s_ptr + slot, s, mask=active)
        if is_target:
            gmask = active & greedy
            if tl.max(gmask.to(tl.int32), axis=0) > 0:
                at = tl.min(tl.where(z == m[:, None], offs[None, :], 2147483647), axis=1)
                tl.store(a_ptr + slot, at, mask=gmask)
