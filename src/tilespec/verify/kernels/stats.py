"""Pass 1 of ``fused``: per-chunk statistics of the logit rows, never writing probabilities.

Grid (NC, R, B) with NC = ceil(V / CHUNK) vocabulary chunks, R = K+1 target rows (+ K draft rows when draft logits
are given), B requests. Program (c, r, b) reads the CHUNK logits of one row once, SUB at a time (CHUNK % SUB == 0) (bf16/fp16/fp32, upcast to fp32 in
registers), applies temperature and the optional per-row keep-threshold (top-k / top-p / min-p), and writes
  m[b, r, c]  = max of the scaled, filtered logits in the chunk (-inf if the chunk is fully masked),
  s[b, r, c]  = sum exp(z - m) over the chunk (0 if fully masked),
  a[b, r, c]  = first argmax in the chunk (greedy requests only; target rows only).
Rows past a request's K_b (ragged padding) and draft rows of greedy requests are skipped. CHUNK is fixed by V
alone, so a request's statistics (hence its tokens) do not depend on the batch it is in.
"""
from __future__ import annotations

from . import common  # noqa: F401  (interpreter setup)

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["K", "V", "NC", "stride_tb", "stride_tr", "stride_db", "stride_dr"])
def row_stats_kernel(tgt_ptr, drf_ptr, nd_ptr, temp_ptr, thr_t_ptr, thr_q_ptr,
                     m_ptr, s_ptr, a_ptr,
                     K, V, NC, stride_tb, stride_tr, stride_db, stride_dr,
                     HAS_DRAFT_LOGITS: tl.constexpr, HAS_THR: tl.constexpr, CHUNK: tl.constexpr,
                     SUB: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1)
    b = tl.program_id(2)
    k_b = tl.load(nd_ptr + b)
    temp = tl.load(temp_ptr + b)
    greedy = temp == 0.0
    scale = tl.where(greedy, 1.0, temp)
    is_target = r <= K
    row = tl.where(is_target, r, r - K - 1)
    # target rows 0..K_b; draft rows 0..K_b-1 of sampling (non-greedy) requests
    active = (is_target & (row <= k_b)) | ((r > K) & (row < k_b) & (temp != 0.0))
    if active:
        b64 = b.to(tl.int64)
        if is_target:
            row_ptr = tgt_ptr + b64 * stride_tb + row * stride_tr
        else:
            row_ptr = drf_ptr + b64 * stride_db + row * stride_dr
        if HAS_THR:
            if is_target:
                thr = tl.load(thr_t_ptr + b * (K + 1) + row)
            else:
                thr = tl.load(thr_q_ptr + b * K + row)
        # online max / sum-exp over SUB-wide slices: few registers per thread, so many programs stay resident and
        # the next slice's load overlaps this one's arithmetic (one CHUNK-wide load needed ~110 registers/thread)
        m = float("-inf")
        s = 0.0
        at = 2147483647
        for start in range(0, CHUNK, SUB):
            offs = c * CHUNK + start + tl.arange(0, SUB)
            mask = offs < V
            z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) / scale
            if HAS_THR:
                z = tl.where(z >= thr, z, float("-inf"))
            z = tl.where(mask, z, float("-inf"))
            m_sub = tl.max(z, axis=0)
            m_new = tl.maximum(m, m_sub)
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - safe) + tl.sum(tl.exp(z - safe), axis=0)
            if greedy & is_target:   # first argmax: a later slice wins only with a strictly larger maximum
                at_sub = tl.min(tl.where(z == m_sub, offs, 2147483647), axis=0)
                at = tl.where(m_sub > m, at_sub, at)
            m = m_new
        slot = (b * (2 * K + 1) + r) * NC + c
        tl.store(m_ptr + slot, m)
        tl.store(s_ptr + slot, s)
        if greedy & is_target:
            tl.store(a_ptr + slot, at)
