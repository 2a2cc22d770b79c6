"""Pass 2 of every method: acceptance test, then sample the one row each request needs, all in one launch.

Grid (NC2, B): program (c, b) handles vocabulary chunk c (TILES tiles of BLOCK ids) of request b.
  1. Acceptance (done redundantly and identically by every program of request b, so no sync is needed): for draft
     positions i < K_b in blocks of RB rows, gather the target (and draft) value at the drafted token, combine the
     pass-1 chunk statistics into the row's log-sum-exp, and test  log u_i < log p_i(x_i) - log q_i(x_i) - log l
     (u_i keyed by (seed, offset + i, ACCEPT); q(x) = 0 rejects; greedy requests accept iff x_i is the first
     argmax, or p1(x_i) >= l max p1 with lenience). n = the first rejected position, or K_b.
  2. Row n only: per BLOCK-wide tile, the masses (fp32 sums) of the residual weights max(0, p_n - l q_n) (if
     n < K_b, else 0) and of p_n -> tsum [B, NC2 * TILES, 2]. No random numbers per vocabulary entry.
  3. The last program of request b to finish (atomic counter, acq_rel) draws the token by the two-level inverse CDF
     of :func:`tilespec.verify.rng.inverse_cdf` with ONE uniform keyed by (seed, offset + n, SAMPLE, 0): the tile
     from the tile masses (of the residual, or of p_n when nothing was rejected or the residual is zero everywhere),
     then the id inside that one tile (its weights recomputed by the same code); it writes the outputs and resets
     the counter to 0 (so a CUDA graph can replay the launch). Greedy requests skip 2-3: program 0 writes argmax.
MODE picks how a row becomes log-weights: exact logits (fused: z / T - lse, with optional per-row keep thresholds),
the paper's sigmoid surrogate (no normalisation, not exact), or probabilities (tiled: tau and b_k from its pass 1).
Outputs: out [B, K+1] int64 (-1 padded), nacc / nemit [B] int64, accepted [B, K] bool.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (DRAFT_LOGITS, DRAFT_PROBS, MODE_LOGITS, MODE_PROBS, PURPOSE_ACCEPT, PURPOSE_SAMPLE, cdf_pick,
                     cdf_tile, chunk_lse, keyed_uniform, log_sigmoid_hat)

BIG = tl.constexpr(2147483647)


@triton.jit
def _row_lse(m_ptr, s_ptr, slot0, cols, cmask):
    """Combine a row's chunk stats (m, s) into (max, log-sum-exp); slot0 = first chunk's flat index."""
    mm = tl.load(m_ptr + slot0 + cols, mask=cmask, other=float("-inf"))
    ss = tl.load(s_ptr + slot0 + cols, mask=cmask, other=0.0)
    big_m, lse = chunk_lse(mm, ss, 0)
    return big_m, lse, mm


@triton.jit
def _write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, b, n, token, K, RB: tl.constexpr):
    for j0 in range(0, K + 1, RB):
        j = j0 + tl.arange(0, RB)
        d = tl.load(tok_ptr + b * K + j, mask=(j < n) & (j < K), other=0)
        val = tl.where(j < n, d, tl.where(j == n, token, -1))
        tl.store(out_ptr + b * (K + 1) + j, val.to(tl.int64), mask=j < K + 1)
        tl.store(accd_ptr + b * K + j, j < n, mask=j < K)
    tl.store(nacc_ptr + b, n.to(tl.int64))
    tl.store(nemit_ptr + b, n.to(tl.int64) + 1)


@triton.jit
def _scaled(ptr, thr_ptr, thr_slot, offs, mask, scale, HAS_THR: tl.constexpr):
    """Load logits at offs, upcast, divide by the temperature and drop those below the row's keep threshold."""
    z = tl.load(ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) / scale
    if HAS_THR:
        z = tl.where(z >= tl.load(thr_ptr + thr_slot), z, float("-inf"))
    return tl.where(mask, z, float("-inf"))


@triton.jit
def _weights(row_t, row_q, thr_t_ptr, thr_q_ptr, thr_tn, thr_qn, offs, mask, rej, x_n, scale, lse_n, lse_qn,
             lenience, log_l, alpha, beta, MODE: tl.constexpr, DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr):
    """(w_p, w_r) at ``offs`` of row n: the weights p_n (logits: exp(z / T - lse); sigmoid: p_hat; probs: p) and the
    residual max(0, p_n - l q_n) (0 everywhere unless ``rej``; log space for logits, as the reference)."""
    rmask = mask & ((tl.zeros_like(offs) + rej.to(tl.int32)) != 0)   # (vector first: see batched.py)
    if MODE == MODE_PROBS:
        w_p = tl.load(row_t + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(row_q + offs, mask=rmask, other=0.0).to(tl.float32)
        w_r = tl.where(rmask, tl.maximum(w_p - lenience * q, 0.0), 0.0)
    else:
        w_p, w_r = _logit_weights(row_t, row_q, thr_t_ptr, thr_q_ptr, thr_tn, thr_qn, offs, mask, rmask, x_n, scale,
                                  lse_n, lse_qn, log_l, alpha, beta, MODE, DRAFT_KIND, HAS_THR)
    return w_p, w_r


@triton.jit
def _logit_weights(row_t, row_q, thr_t_ptr, thr_q_ptr, thr_tn, thr_qn, offs, mask, rmask, x_n, scale, lse_n, lse_qn,
                   log_l, alpha, beta, MODE: tl.constexpr, DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr):
    z = _scaled(row_t, thr_t_ptr, thr_tn, offs, mask, scale, HAS_THR)
    if MODE == MODE_LOGITS:
        lp = z - lse_n
    else:
        lp = log_sigmoid_hat(z, alpha, beta)
    if DRAFT_KIND == DRAFT_LOGITS:
        zq = _scaled(row_q, thr_q_ptr, thr_qn, offs, rmask, scale, HAS_THR)
        if MODE == MODE_LOGITS:
            lq = zq - lse_qn
        else:
            lq = log_sigmoid_hat(zq, alpha, beta)
    elif DRAFT_KIND == DRAFT_PROBS:
        lq = tl.log(tl.load(row_q + offs, mask=rmask, other=0.0).to(tl.float32))
    else:
        lq = tl.where(offs == x_n, 0.0, float("-inf"))
    lq = lq + log_l
    keep = (lp > lq) & rmask
    res = tl.where(keep, lp + tl.log(1.0 - tl.exp(tl.where(keep, lq - lp, 0.0))), float("-inf"))
    return tl.exp(lp), tl.exp(res)


@triton.jit(do_not_specialize=["K", "V", "NC1", "NC2", "TILES", "NT", "stride_tb", "stride_tr", "stride_db",
                               "stride_dr"])
def accept_sample_kernel(tgt_ptr, drf_ptr, tok_ptr, nd_ptr, seed_ptr, off_ptr, temp_ptr, len_ptr, thr_t_ptr,
                         thr_q_ptr, m_ptr, s_ptr, a_ptr, tau_ptr, bpart_ptr, tsum_ptr, cnt_ptr,
                         out_ptr, nacc_ptr, nemit_ptr, accd_ptr,
                         K, V, NC1, NC2, TILES, NT, stride_tb, stride_tr, stride_db, stride_dr, alpha, beta,
                         MODE: tl.constexpr, DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr,
                         BLOCK: tl.constexpr, NC1_BLOCK: tl.constexpr, NT2_BLOCK: tl.constexpr, RB: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    k_b = tl.load(nd_ptr + b)
    seed = tl.load(seed_ptr + b)
    off = tl.load(off_ptr + b)
    temp = tl.load(temp_ptr + b)
    lenience = tl.load(len_ptr + b)
    greedy = temp == 0.0
    scale = tl.where(greedy, 1.0, temp)
    log_l = tl.log(lenience)
    r2 = 2 * K + 1
    cols = tl.arange(0, NC1_BLOCK)
    cmask = cols < NC1
    tgt_b = tgt_ptr + b64 * stride_tb
    drf_b = drf_ptr + b64 * stride_db

    # ---- 1. acceptance over the K_b draft positions ----
    n = k_b
    for kb in range(0, k_b, RB):
        rows = kb + tl.arange(0, RB)
        rmask = rows < k_b
        x = tl.load(tok_ptr + b * K + rows, mask=rmask, other=0).to(tl.int32)
        u = keyed_uniform(seed, off + rows, PURPOSE_ACCEPT, tl.zeros([RB], tl.int32))
        if MODE == MODE_PROBS:
            p_x = tl.load(tgt_b + rows * stride_tr + x, mask=rmask, other=0.0).to(tl.float32)
            tau = tl.load(tau_ptr + b * K + rows, mask=rmask, other=-1.0)
            acc = tl.where(greedy, p_x == 1.0, u < tau)
        else:
            zx = _scaled(tgt_b + rows * stride_tr, thr_t_ptr, b * (K + 1) + rows, x, rmask, scale, HAS_THR)
            if MODE == MODE_LOGITS:
                slots = (b * r2 + rows)[:, None] * NC1 + cols[None, :]
                smask = rmask[:, None] & cmask[None, :]
                mm = tl.load(m_ptr + slots, mask=smask, other=float("-inf"))
                ss = tl.load(s_ptr + slots, mask=smask, other=0.0)
                big_m, lse = chunk_lse(mm, ss, 1)
                lp_x = zx - lse
            else:
                lp_x = log_sigmoid_hat(zx, alpha, beta)
            if DRAFT_KIND == DRAFT_LOGITS:
                zq = _scaled(drf_b + rows * stride_dr, thr_q_ptr, b * K + rows, x, rmask, scale, HAS_THR)
                if MODE == MODE_LOGITS:
                    qslots = (b * r2 + K + 1 + rows)[:, None] * NC1 + cols[None, :]
                    qmask = smask & ((tl.zeros([RB, NC1_BLOCK], tl.float32) + temp) != 0.0)  # greedy: no q stats
                    qm = tl.load(m_ptr + qslots, mask=qmask, other=float("-inf"))
                    qs = tl.load(s_ptr + qslots, mask=qmask, other=0.0)
                    _, q_lse = chunk_lse(qm, qs, 1)
                    lq_x = zq - q_lse
                else:
                    lq_x = log_sigmoid_hat(zq, alpha, beta)
            elif DRAFT_KIND == DRAFT_PROBS:
                lq_x = tl.log(tl.load(drf_b + rows * stride_dr + x, mask=rmask, other=1.0).to(tl.float32))
            else:
                lq_x = tl.zeros([RB], tl.float32)
            ratio = tl.where(lq_x > float("-inf"), lp_x - lq_x - log_l, float("-inf"))
            acc = tl.log(u) < ratio
            if MODE == MODE_LOGITS:
                cstar = tl.min(tl.where(mm == big_m[:, None], cols[None, :], BIG), axis=1)
                gmask = rmask & ((tl.zeros([RB], tl.float32) + temp) == 0.0)
                amax = tl.load(a_ptr + (b * r2 + rows) * NC1 + cstar, mask=gmask, other=-1)
                lenient_ok = (zx - lse) >= (big_m - lse) + log_l
                greedy_acc = tl.where(lenience < 1.0, lenient_ok, x == amax)
                acc = tl.where(greedy, greedy_acc, acc)
        rejected_at = tl.where(acc | (rows >= k_b), k_b, rows)
        n = tl.minimum(n, tl.min(rejected_at, axis=0))
    is_rej = n < k_b
    pos_n = off + n
    row_t = tgt_b + n * stride_tr
    row_q = drf_b + n * stride_dr

    if MODE == MODE_LOGITS:
        greedy_path = greedy
    else:
        greedy_path = temp < 0.0  # never: only the logits mode reads greedy answers from pass-1 stats
    if greedy_path:
        # ---- greedy: the next token is the (first) argmax of target row n, from pass-1 stats ----
        if c == 0:
            big_m, lse_n, mm = _row_lse(m_ptr, s_ptr, (b * r2 + n) * NC1, cols, cmask)
            cstar = tl.min(tl.where(mm == big_m, cols, BIG), axis=0)
            token = tl.load(a_ptr + (b * r2 + n) * NC1 + cstar)
            _write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, b, n, token, K, 32)
    else:
        # ---- 2. per-tile masses of row n: residual max(0, p_n - l q_n) and p_n ----
        lse_n = tl.full([], 0.0, tl.float32)
        lse_qn = tl.full([], 0.0, tl.float32)
        if MODE == MODE_LOGITS:
            _, lse_n, _ = _row_lse(m_ptr, s_ptr, (b * r2 + n) * NC1, cols, cmask)
            if DRAFT_KIND == DRAFT_LOGITS:  # draft row n exists only after a rejection
                q_cols = cmask & ((cols * 0 + n) < k_b)
                _, lse_qn, _ = _row_lse(m_ptr, s_ptr, (b * r2 + K + 1 + n) * NC1, cols, q_cols)
        x_n = tl.load(tok_ptr + b * K + n, mask=is_rej, other=-1).to(tl.int32)
        thr_tn = b * (K + 1) + n
        thr_qn = b * K + n
        nt2 = NC2 * TILES
        for t in range(TILES):
            tile = c * TILES + t
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            w_p, w_r = _weights(row_t, row_q, thr_t_ptr, thr_q_ptr, thr_tn, thr_qn, offs, offs < V, is_rej, x_n,
                                scale, lse_n, lse_qn, lenience, log_l, alpha, beta, MODE, DRAFT_KIND, HAS_THR)
            slot = (b * nt2 + tile) * 2
            tl.store(tsum_ptr + slot, tl.sum(w_r, axis=0))
            tl.store(tsum_ptr + slot + 1, tl.sum(w_p, axis=0))
        # ---- 3. the last program of request b: inverse CDF over the tile masses, then inside the chosen tile ----
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel")
        if done == NC2 - 1:
            tt = tl.arange(0, NT2_BLOCK)
            tm = tt < nt2
            sr = tl.load(tsum_ptr + (b * nt2 + tt) * 2, mask=tm, other=0.0, cache_modifier=".cg")
            sp = tl.load(tsum_ptr + (b * nt2 + tt) * 2 + 1, mask=tm, other=0.0, cache_modifier=".cg")
            if MODE == MODE_PROBS:
                tiles = tl.arange(0, NC1_BLOCK)
                t_mask = (tiles < NT) & ((tiles * 0 + n) < k_b)
                b_sum = tl.sum(tl.load(bpart_ptr + (b * K + n) * NT + tiles, mask=t_mask, other=0.0), axis=0)
                use_res = is_rej & (b_sum > 0.0)
            else:
                use_res = is_rej & (tl.max(sr, axis=0) > 0.0)
            mass = tl.where(use_res, sr, sp)
            u = tl.max(keyed_uniform(seed, pos_n, PURPOSE_SAMPLE, tl.zeros([1], tl.int32)), axis=0)
            tile, rest = cdf_tile(mass, tt, u)
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            w_p, w_r = _weights(row_t, row_q, thr_t_ptr, thr_q_ptr, thr_tn, thr_qn, offs, offs < V, use_res, x_n,
                                scale, lse_n, lse_qn, lenience, log_l, alpha, beta, MODE, DRAFT_KIND, HAS_THR)
            token = cdf_pick(tl.where(use_res, w_r, w_p), offs, rest, tile * BLOCK)
            _write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, b, n, token, K, 32)
            tl.atomic_xchg(cnt_ptr + b, 0)
