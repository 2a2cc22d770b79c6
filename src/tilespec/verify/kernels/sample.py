"""Pass 2 of every method: acceptance test, then sample the one row each request needs, all in one launch.

Grid (NC2, ceil(B / BLOCK_B)): program (c, j) handles vocabulary chunk c (TILES tiles of BLOCK ids) of requests
j*BLOCK_B .. j*BLOCK_B + BLOCK_B - 1 (BLOCK_B = 1 for large vocabularies; small vocabularies, whose rows fit in one
tile, batch many requests per program, each in its own lanes, so no request's result depends on the others).
  1. Acceptance (done redundantly and identically by every program of a request, so no sync is needed): for draft
     positions i < K_b in blocks of RB rows, gather the target (and draft) value at the drafted token, combine the
     pass-1 chunk statistics into the row's log-sum-exp, and test  log u_i < log p_i(x_i) - log q_i(x_i) - log l
     (u_i keyed by (seed, offset + i, ACCEPT); q(x) = 0 rejects; greedy requests accept iff x_i is the first
     argmax, or p1(x_i) >= l max p1 with lenience). n = the first rejected position, or K_b.
  2. Row n only: log-weights of the residual max(0, p_n - l q_n) (if n < K_b) and of p_n, Gumbel noise keyed by
     (seed, offset + n, SAMPLE, token), and the chunk's (max, first argmax) of both -> partials [B, NC2, 2].
  3. The last program of request b to finish (atomic counter, acq_rel) reduces the partials: the residual's argmax,
     or p_n's when nothing was rejected or the residual is zero everywhere (fallback), writes the outputs and resets
     the counter to 0 (so a CUDA graph can replay the launch). Greedy requests skip 2-3: program 0 writes argmax.
MODE picks how a row becomes log-weights: exact logits (fused: z / T - lse, with optional per-row keep thresholds),
the paper's sigmoid surrogate (no normalisation, not exact), or probabilities (tiled: tau and b_k from its pass 1).
Outputs: out [B, K+1] int64 (-1 padded), nacc / nemit [B] int64, accepted [B, K] bool.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (DRAFT_LOGITS, DRAFT_PROBS, MODE_LOGITS, MODE_PROBS, PURPOSE_ACCEPT, first_argmax,
                     keyed_gumbel, keyed_uniform, log_sigmoid_hat)

BIG = tl.constexpr(2147483647)


@triton.jit
def _rows_lse(m_ptr, s_ptr, slot0, cols, smask):
    """Combine each row's chunk stats (m, s) into (max, log-sum-exp, m); slot0 [R] = first chunk's flat index."""
    mm = tl.load(m_ptr + slot0[:, None] + cols[None, :], mask=smask, other=float("-inf"))
    ss = tl.load(s_ptr + slot0[:, None] + cols[None, :], mask=smask, other=0.0)
    big_m = tl.max(mm, axis=1)
    safe = tl.where(big_m == float("-inf"), 0.0, big_m)
    total = tl.sum(tl.where(mm == float("-inf"), 0.0, ss * tl.exp(mm - safe[:, None])), axis=1)
    return big_m, safe + tl.log(total), mm


@triton.jit
def _write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, req, rmask, n, token, K, WB: tl.constexpr):
    """Write the outputs of the requests ``req`` [R] selected by ``rmask``: n accepted drafts, then ``token``."""
    nn = n[:, None]
    for j0 in range(0, K + 1, WB):
        j = (j0 + tl.arange(0, WB))[None, :]
        d = tl.load(tok_ptr + req[:, None] * K + j, mask=rmask[:, None] & (j < nn) & (j < K), other=0)
        val = tl.where(j < nn, d, tl.where(j == nn, token[:, None], -1))
        tl.store(out_ptr + req[:, None] * (K + 1) + j, val.to(tl.int64), mask=rmask[:, None] & (j < K + 1))
        tl.store(accd_ptr + req[:, None] * K + j, j < nn, mask=rmask[:, None] & (j < K))
    tl.store(nacc_ptr + req, n.to(tl.int64), mask=rmask)
    tl.store(nemit_ptr + req, n.to(tl.int64) + 1, mask=rmask)


@triton.jit
def _scaled(ptr, thr_ptr, thr_slot, offs, mask, scale, HAS_THR: tl.constexpr):
    """Load logits at ptr + offs, upcast, divide by the temperature and drop those below the row's keep threshold
    (thr_ptr[thr_slot], read where ``mask`` holds)."""
    z = tl.load(ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) / scale
    if HAS_THR:
        z = tl.where(z >= tl.load(thr_ptr + thr_slot, mask=mask, other=0.0), z, float("-inf"))
    return tl.where(mask, z, float("-inf"))


@triton.jit(do_not_specialize=["B", "K", "V", "NC1", "NC2", "TILES", "NT", "stride_tb", "stride_tr", "stride_db",
                               "stride_dr"])
def accept_sample_kernel(tgt_ptr, drf_ptr, tok_ptr, nd_ptr, seed_ptr, off_ptr, temp_ptr, len_ptr, thr_t_ptr,
                         thr_q_ptr, m_ptr, s_ptr, a_ptr, tau_ptr, bpart_ptr, pval_ptr, pidx_ptr, cnt_ptr,
                         out_ptr, nacc_ptr, nemit_ptr, accd_ptr,
                         B, K, V, NC1, NC2, TILES, NT, stride_tb, stride_tr, stride_db, stride_dr, alpha, beta,
                         MODE: tl.constexpr, DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr,
                         BLOCK: tl.constexpr, NC1_BLOCK: tl.constexpr, NC2_BLOCK: tl.constexpr, RB: tl.constexpr,
                         BLOCK_B: tl.constexpr, WB: tl.constexpr):
    c = tl.program_id(0)
    req = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)          # [BB] request ids of this program
    live = req < B
    k_b = tl.load(nd_ptr + req, mask=live, other=0)
    seed = tl.load(seed_ptr + req, mask=live, other=0)
    off = tl.load(off_ptr + req, mask=live, other=0)
    temp = tl.load(temp_ptr + req, mask=live, other=1.0)
    lenience = tl.load(len_ptr + req, mask=live, other=1.0)
    greedy = temp == 0.0
    scale = tl.where(greedy, 1.0, temp)
    log_l = tl.log(lenience)
    r2 = 2 * K + 1
    cols = tl.arange(0, NC1_BLOCK)
    cmask = cols < NC1
    req64 = req.to(tl.int64)
    tgt_b = tgt_ptr + req64 * stride_tb                                 # [BB] row-0 pointers
    drf_b = drf_ptr + req64 * stride_db

    # ---- 1. acceptance over the K_b draft positions, [BB, RB] at a time ----
    n = k_b
    for kb in range(0, tl.max(k_b, axis=0), RB):
        rows = (kb + tl.arange(0, RB))[None, :]                         # [1, RB]
        rmask = rows < k_b[:, None]                                     # [BB, RB]
        x = tl.load(tok_ptr + req[:, None] * K + rows, mask=rmask, other=0).to(tl.int32)
        u = keyed_uniform(seed[:, None], off[:, None] + rows, PURPOSE_ACCEPT, tl.zeros([BLOCK_B, RB], tl.int32))
        if MODE == MODE_PROBS:
            p_x = tl.load(tgt_b[:, None] + rows * stride_tr + x, mask=rmask, other=0.0).to(tl.float32)
            tau = tl.load(tau_ptr + req[:, None] * K + rows, mask=rmask, other=-1.0)
            acc = tl.where(greedy[:, None], p_x == 1.0, u < tau)
        else:
            zx = _scaled(tgt_b[:, None] + rows * stride_tr, thr_t_ptr, req[:, None] * (K + 1) + rows, x, rmask,
                         scale[:, None], HAS_THR)
            if MODE == MODE_LOGITS:
                slots = ((req[:, None] * r2 + rows) * NC1)[:, :, None] + cols[None, None, :]
                smask = rmask[:, :, None] & cmask[None, None, :]
                mm = tl.load(m_ptr + slots, mask=smask, other=float("-inf"))
                ss = tl.load(s_ptr + slots, mask=smask, other=0.0)
                big_m = tl.max(mm, axis=2)
                safe = tl.where(big_m == float("-inf"), 0.0, big_m)
                lse = safe + tl.log(tl.sum(tl.where(mm == float("-inf"), 0.0, ss * tl.exp(mm - safe[:, :, None])),
                                           axis=2))
                lp_x = zx - lse
            else:
                lp_x = log_sigmoid_hat(zx, alpha, beta)
            if DRAFT_KIND == DRAFT_LOGITS:
                zq = _scaled(drf_b[:, None] + rows * stride_dr, thr_q_ptr, req[:, None] * K + rows, x, rmask,
                             scale[:, None], HAS_THR)
                if MODE == MODE_LOGITS:
                    qslots = ((req[:, None] * r2 + K + 1 + rows) * NC1)[:, :, None] + cols[None, None, :]
                    qmask = smask & (temp != 0.0)[:, None, None]  # greedy: no q stats
                    qm = tl.load(m_ptr + qslots, mask=qmask, other=float("-inf"))
                    qs = tl.load(s_ptr + qslots, mask=qmask, other=0.0)
                    q_max = tl.max(qm, axis=2)
                    qsafe = tl.where(q_max == float("-inf"), 0.0, q_max)
                    q_lse = qsafe + tl.log(tl.sum(tl.where(qm == float("-inf"), 0.0,
                                                           qs * tl.exp(qm - qsafe[:, :, None])), axis=2))
                    lq_x = zq - q_lse
                else:
                    lq_x = log_sigmoid_hat(zq, alpha, beta)
            elif DRAFT_KIND == DRAFT_PROBS:
                lq_x = tl.log(tl.load(drf_b[:, None] + rows * stride_dr + x, mask=rmask, other=1.0).to(tl.float32))
            else:
                lq_x = tl.zeros([BLOCK_B, RB], tl.float32)
            ratio = tl.where(lq_x > float("-inf"), lp_x - lq_x - log_l[:, None], float("-inf"))
            acc = tl.log(u) < ratio
            if MODE == MODE_LOGITS:
                cstar = tl.min(tl.where(mm == big_m[:, :, None], cols[None, None, :], BIG), axis=2)
                gmask = rmask & greedy[:, None]
                amax = tl.load(a_ptr + (req[:, None] * r2 + rows) * NC1 + cstar, mask=gmask, other=-1)
                lenient_ok = (zx - lse) >= (big_m - lse) + log_l[:, None]
                greedy_acc = tl.where(lenience[:, None] < 1.0, lenient_ok, x == amax)
                acc = tl.where(greedy[:, None], greedy_acc, acc)
        rejected_at = tl.where(acc | (rows >= k_b[:, None]), k_b[:, None], rows)
        n = tl.minimum(n, tl.min(rejected_at, axis=1))
    is_rej = n < k_b
    pos_n = off + n
    row_t = tgt_b + n * stride_tr                                        # [BB] pointers to row n
    row_q = drf_b + n * stride_dr

    if MODE == MODE_LOGITS:  # only the logits mode reads greedy answers from pass-1 stats
        greedy_row = live & greedy
        # ---- greedy: the next token is the (first) argmax of target row n, from pass-1 stats ----
        if c == 0:
            if tl.max(greedy_row.to(tl.int32), axis=0) > 0:
                slot0 = (req * r2 + n) * NC1
                big_m, _, mm = _rows_lse(m_ptr, s_ptr, slot0, cols, greedy_row[:, None] & cmask[None, :])
                cstar = tl.min(tl.where(mm == big_m[:, None], cols[None, :], BIG), axis=1)
                token = tl.load(a_ptr + slot0 + cstar, mask=greedy_row, other=0)
                _write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, req, greedy_row, n, token, K, WB)
        sample_row = live & (temp != 0.0)
    else:
        sample_row = live
    if tl.max(sample_row.to(tl.int32), axis=0) > 0:
        # ---- 2. Gumbel-max over this program's chunk of row n (residual and p) ----
        rej_row = sample_row & is_rej
        any_rej = tl.max(rej_row.to(tl.int32), axis=0) > 0
        lse_n = tl.zeros([BLOCK_B], tl.float32)
        lse_qn = tl.zeros([BLOCK_B], tl.float32)
        if MODE == MODE_LOGITS:
            _, lse_n, _ = _rows_lse(m_ptr, s_ptr, (req * r2 + n) * NC1, cols, sample_row[:, None] & cmask[None, :])
            lse_n = tl.where(sample_row, lse_n, 0.0)
            if DRAFT_KIND == DRAFT_LOGITS:  # draft row n exists only after a rejection
                _, lse_qn, _ = _rows_lse(m_ptr, s_ptr, (req * r2 + K + 1 + n) * NC1, cols,
                                         rej_row[:, None] & cmask[None, :])
                lse_qn = tl.where(rej_row, lse_qn, 0.0)
        x_n = tl.load(tok_ptr + req * K + n, mask=rej_row, other=-1).to(tl.int32)
        best_r = tl.full([BLOCK_B], float("-inf"), tl.float32)
        idx_r = tl.zeros([BLOCK_B], tl.int32)
        best_p = tl.full([BLOCK_B], float("-inf"), tl.float32)
        idx_p = tl.zeros([BLOCK_B], tl.int32)
        for t in range(TILES):
            offs = (c * TILES + t) * BLOCK + tl.arange(0, BLOCK)
            ids = tl.broadcast_to(offs[None, :], [BLOCK_B, BLOCK])         # [BB, BLOCK] vocabulary ids
            mask = (ids < V) & sample_row[:, None]
            if MODE == MODE_PROBS:
                p = tl.load(row_t[:, None] + ids, mask=mask, other=0.0).to(tl.float32)
                lp = tl.log(p)
            else:
                z = _scaled(row_t[:, None], thr_t_ptr, (req * (K + 1) + n)[:, None], ids, mask, scale[:, None],
                            HAS_THR)
                if MODE == MODE_LOGITS:
                    lp = z - lse_n[:, None]
                else:
                    lp = log_sigmoid_hat(z, alpha, beta)
            g = keyed_gumbel(seed[:, None], pos_n[:, None], ids)
            bp, ip = first_argmax(lp + g, ids, BIG)
            idx_p = tl.where(bp > best_p, ip, idx_p)
            best_p = tl.maximum(bp, best_p)
            if any_rej:
                rmask = mask & rej_row[:, None]
                if MODE == MODE_PROBS:
                    q = tl.load(row_q[:, None] + ids, mask=rmask, other=0.0).to(tl.float32)
                    res = tl.log(tl.maximum(p - lenience[:, None] * q, 0.0))
                else:
                    if DRAFT_KIND == DRAFT_LOGITS:
                        zq = _scaled(row_q[:, None], thr_q_ptr, (req * K + n)[:, None], ids, rmask, scale[:, None],
                                     HAS_THR)
                        if MODE == MODE_LOGITS:
                            lq = zq - lse_qn[:, None]
                        else:
                            lq = log_sigmoid_hat(zq, alpha, beta)
                    elif DRAFT_KIND == DRAFT_PROBS:
                        lq = tl.log(tl.load(row_q[:, None] + ids, mask=rmask, other=0.0).to(tl.float32))
                    else:
                        lq = tl.where(ids == x_n[:, None], 0.0, float("-inf"))
                    lq = lq + log_l[:, None]
                    keep = lp > lq
                    res = tl.where(keep, lp + tl.log(1.0 - tl.exp(tl.where(keep, lq - lp, 0.0))), float("-inf"))
                br, ir = first_argmax(res + g, ids, BIG)
                idx_r = tl.where(br > best_r, ir, idx_r)
                best_r = tl.maximum(br, best_r)
        slot = (req * NC2 + c) * 2
        tl.store(pval_ptr + slot, best_r, mask=sample_row)
        tl.store(pval_ptr + slot + 1, best_p, mask=sample_row)
        tl.store(pidx_ptr + slot, idx_r, mask=sample_row)
        tl.store(pidx_ptr + slot + 1, idx_p, mask=sample_row)
        # ---- 3. the last program of each request reduces the partials ----
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + req, 1, mask=sample_row, sem="acq_rel")
        last = sample_row & (done == NC2 - 1)
        if tl.max(last.to(tl.int32), axis=0) > 0:
            cc = tl.arange(0, NC2_BLOCK)[None, :]
            cm = last[:, None] & (cc < NC2)
            base = (req[:, None] * NC2 + cc) * 2
            vr = tl.load(pval_ptr + base, mask=cm, other=float("-inf"), cache_modifier=".cg")
            vp = tl.load(pval_ptr + base + 1, mask=cm, other=float("-inf"), cache_modifier=".cg")
            ir_all = tl.load(pidx_ptr + base, mask=cm, other=BIG, cache_modifier=".cg")
            ip_all = tl.load(pidx_ptr + base + 1, mask=cm, other=BIG, cache_modifier=".cg")
            top_r = tl.max(vr, axis=1)
            tok_r = tl.min(tl.where(vr == top_r[:, None], ir_all, BIG), axis=1)
            top_p = tl.max(vp, axis=1)
            tok_p = tl.min(tl.where(vp == top_p[:, None], ip_all, BIG), axis=1)
            if MODE == MODE_PROBS:
                tiles = tl.arange(0, NC1_BLOCK)[None, :]
                t_mask = (last & is_rej)[:, None] & (tiles < NT)
                b_sum = tl.sum(tl.load(bpart_ptr + (req * K + n)[:, None] * NT + tiles, mask=t_mask, other=0.0),
                               axis=1)
                use_res = is_rej & (b_sum > 0.0)
            else:
                use_res = is_rej & (top_r > float("-inf"))
            token = tl.where(use_res, tok_r, tok_p)
            _write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, req, last, n, token, K, WB)
            tl.atomic_xchg(cnt_ptr + req, 0, mask=last)
