"""Pass 1 of ``fused``: per-chunk statistics of the logit rows, never writing probabilities.

Rows r of request b: target rows 0..K (r <= K), then draft rows 0..K-1 (r = K + 1 + i, draft logits only). For
vocabulary chunk c of CHUNK ids, read once (bf16/fp16/fp32, upcast to fp32 in registers), scaled by the
temperature and filtered by the optional per-row keep threshold (top-k / top-p / min-p), it writes at
slot = (b * (2K + 1) + r) * NC + c:
  m[slot] = max of the scaled, filtered logits in the chunk (-inf if the chunk is fully masked),
  s[slot] = sum exp(z - m) over the chunk (0 if fully masked),
  a[slot] = first argmax in the chunk (greedy requests only; target rows only).
Rows past a request's K_b (ragged padding) and draft rows of greedy requests are skipped. CHUNK is fixed by V
alone, so a request's statistics (hence its tokens) do not depend on the batch it is in.

Two layouts: ``stream.row_stats_stream_kernel``, grid (ceil(NC / CPP), R, B), one request and CPP contiguous
chunks per program (large vocabularies); ``row_stats_rows_kernel`` (here), grid (NC, R, ceil(B / BLOCK_B)),
BLOCK_B requests per program, one [BLOCK_B, CHUNK] block (small vocabularies: NC = 1). Both take the same
arguments (B, the batch size, bounds the batched layout's request blocks; the rows kernel ignores the tail's).

Tail of the per-request kernel (:func:`_accept_tail`, pass 2's step 1, run once per request, not once per pass-2
program): every program of request b increments cnt[b] (acq_rel, after its stores); the last of the
ceil(NC / CPP) * R programs sees complete statistics and runs the acceptance test of ``sample._request_n`` (same
code, so the same n).
Greedy request: writes all outputs (token = argmax of row n). Sampling request: nrow[b] = n (int32),
lse[b] = (log-sum-exp of target row n, of draft row n after a rejection with draft logits, else 0) (fp32), read
by ``residual.sample_wide_kernel``. It resets cnt[b] to 0 (CUDA-graph replay).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (DRAFT_LOGITS, MODE_LOGITS, first_index, online_max_sumexp, row_lse, scaled,
                     stats_argmax, threshold, write_outputs)
from .sample import _request_n


@triton.jit
def _accept_tail(tgt_ptr, drf_ptr, tok_ptr, nd_ptr, seed_ptr, off_ptr, temp_ptr, len_ptr, thr_t_ptr, thr_q_ptr,
                 m_ptr, s_ptr, a_ptr, nrow_ptr, lse_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, b, K, NC,
                 stride_tb, stride_tr, stride_db, stride_dr, DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr,
                 NC_BLOCK: tl.constexpr, RB: tl.constexpr):
    """Step 1 of pass 2 (``sample._request_n``, the same code), run once per request on its complete
    statistics: n = the first rejected position (or K_b). Greedy requests: the token is row n's argmax and every
    output is written here. Sampling requests: n -> nrow[b] (int32), (lse of target row n, lse of draft row n or 0)
    -> lse[b, 0:2] (fp32), for ``residual.sample_wide_kernel``."""
    live = b >= 0   # always: a mask the compiler folds away
    cols = tl.arange(0, NC_BLOCK)
    n, k_b, _, _, temp, _, _, _ = _request_n(
        tgt_ptr + b.to(tl.int64) * stride_tb, drf_ptr + b.to(tl.int64) * stride_db, tok_ptr, nd_ptr, seed_ptr, off_ptr,
        temp_ptr, len_ptr, thr_t_ptr, thr_q_ptr, m_ptr, s_ptr, a_ptr, m_ptr, b, K, NC, stride_tr, stride_dr,
        0.0, 1.0, MODE_LOGITS, DRAFT_KIND, HAS_THR, NC_BLOCK, RB)
    slot_n = (b * (2 * K + 1) + n) * NC
    if temp == 0.0:
        big_m, lse_g, mm = row_lse(m_ptr, s_ptr, slot_n, cols, cols < NC)   # (distinct names per branch: the
        token = stats_argmax(a_ptr, slot_n, mm, big_m, cols, live)          # compiler types each one)
        write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, b, live, n, token, K, 32)
    else:
        rej_v = (cols * 0 + n) < k_b   # (a vector: the interpreter turns scalar-bool & tensor-bool into int32)
        m_n, lse_n, mm_n = row_lse(m_ptr, s_ptr, slot_n, cols, cols < NC)
        lse_qn = tl.full([], 0.0, tl.float32)
        if DRAFT_KIND == DRAFT_LOGITS:   # draft row n exists only after a rejection
            m_q, lse_qn, mm_q = row_lse(m_ptr, s_ptr, slot_n + (K + 1) * NC, cols, (cols < NC) & rej_v)
            lse_qn = tl.where(n < k_b, lse_qn, 0.0)
        tl.store(nrow_ptr + b, n)
        tl.store(lse_ptr + 2 * b, lse_n)
        tl.store(lse_ptr + 2 * b + 1, lse_qn)


@triton.jit(do_not_specialize=["B", "K", "V", "NC", "stride_tb", "stride_tr", "stride_db", "stride_dr"])
def row_stats_rows_kernel(tgt_ptr, drf_ptr, nd_ptr, temp_ptr, thr_t_ptr, thr_q_ptr,
                          m_ptr, s_ptr, a_ptr,
                          B, K, V, NC, stride_tb, stride_tr, stride_db, stride_dr,
                          tok_ptr, seed_ptr, off_ptr, len_ptr, nrow_ptr, lse_ptr, cnt_ptr,
                          out_ptr, nacc_ptr, nemit_ptr, accd_ptr,
                          DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr, CHUNK: tl.constexpr,
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
    # the row index is broadcast to [BLOCK_B] first: the interpreter turns scalar-bool & tensor-bool into int32
    row_v = row + tl.zeros([BLOCK_B], tl.int32)
    if is_target:
        active = live & (row_v <= k_b)
    else:
        active = live & (row_v < k_b) & (temp != 0.0)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        offs = c * CHUNK + tl.arange(0, CHUNK)
        mask = active[:, None] & (offs < V)[None, :]
        req64 = req.to(tl.int64)
        if is_target:   # (z, not the row pointer, is chosen: target and draft logits may differ in dtype)
            thr = threshold(thr_t_ptr, req * (K + 1) + row, active, HAS_THR)
            z = scaled(tgt_ptr + (req64 * stride_tb + row * stride_tr)[:, None] + offs[None, :], mask,
                       scale[:, None], thr[:, None], HAS_THR)
        else:
            thr = threshold(thr_q_ptr, req * K + row, active, HAS_THR)
            z = scaled(drf_ptr + (req64 * stride_db + row * stride_dr)[:, None] + offs[None, :], mask,
                       scale[:, None], thr[:, None], HAS_THR)
        m_init = tl.full([BLOCK_B], float("-inf"), tl.float32)
        m, s, _ = online_max_sumexp(m_init, tl.zeros([BLOCK_B], tl.float32), z)
        slot = (req * (2 * K + 1) + r) * NC + c
        tl.store(m_ptr + slot, m, mask=active)
        tl.store(s_ptr + slot, s, mask=active)
        if is_target:
            gmask = active & greedy
            if tl.max(gmask.to(tl.int32), axis=0) > 0:
                tl.store(a_ptr + slot, first_index(z, m, offs[None, :]), mask=gmask)
