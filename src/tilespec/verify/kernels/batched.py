"""The verification kernels for small vocabularies: many requests per program ("batched" layout).

When a whole logit row fits in one pass-1 chunk / pass-2 tile (V <= CHUNK / BLOCK), the launch wrappers run these
instead of the one-request-per-program kernels of ``stats`` / ``sample`` / ``tiled``: each program handles
BLOCK_B requests, one per row of a [BLOCK_B, block] tile, with exactly the arithmetic of the per-request kernels
(same keyed Philox numbers, same log-space tests, same inverse-CDF draw and tie rules), so for the same keys
they emit the same tokens as ``reference``; every request is reduced in its own lanes, so none depends on the others
(batch invariance). On a GPU this packs small rows into full-width programs; in Triton's CPU interpreter, which runs
one Python program per grid point, it turns B programs into B / BLOCK_B large NumPy operations - what lets the
exactness suite sample the kernels 10^5-10^6 times per case on a CPU.

  row_stats_rows_kernel       pass 1 of ``fused``  (grid (NC, R, ceil(B / BLOCK_B)); see ``stats``)
  tiled_partials_rows_kernel  pass 1 of ``tiled``  (grid (NT, K, ceil(B / BLOCK_B)); see ``tiled``)
  accept_sample_rows_kernel   pass 2 of every method (grid (NC2, ceil(B / BLOCK_B)); see ``sample``)

Pointer arguments a variant never reads (thresholds without filters, pass-1 statistics outside ``fused``, tau / b_k
outside ``tiled``) are passed as None, i.e. compile-time constants.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (DRAFT_LOGITS, DRAFT_PROBS, MODE_LOGITS, MODE_PROBS, PURPOSE_ACCEPT, PURPOSE_SAMPLE, cdf_pick,
                     cdf_tile, chunk_lse, keyed_uniform_rows, log_sigmoid_hat)

BIG = tl.constexpr(2147483647)


@triton.jit(do_not_specialize=["B", "K", "V", "NC", "stride_tb", "stride_tr", "stride_db", "stride_dr"])
def row_stats_rows_kernel(tgt_ptr, drf_ptr, nd_ptr, temp_ptr, thr_t_ptr, thr_q_ptr,
                          m_ptr, s_ptr, a_ptr,
                          B, K, V, NC, stride_tb, stride_tr, stride_db, stride_dr,
                          HAS_DRAFT_LOGITS: tl.constexpr, HAS_THR: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK_B: tl.constexpr):
    """``stats.row_stats_kernel`` for BLOCK_B requests per program (row r of each, chunk c)."""
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


@triton.jit(do_not_specialize=["B", "K", "V", "NT", "stride_pb", "stride_pr", "stride_qb", "stride_qr"])
def tiled_partials_rows_kernel(p_ptr, q_ptr, tok_ptr, nd_ptr, len_ptr, tau_ptr, bpart_ptr,
                               B, K, V, NT, stride_pb, stride_pr, stride_qb, stride_qr, TILE: tl.constexpr,
                               BLOCK_B: tl.constexpr):
    """``tiled.tiled_partials_kernel`` for BLOCK_B requests per program (draft row i of each, tile k)."""
    k = tl.program_id(0)
    i = tl.program_id(1)
    req = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
    live = req < B
    active = live & (i < tl.load(nd_ptr + req, mask=live, other=0))
    if tl.max(active.to(tl.int32), axis=0) > 0:
        lenience = tl.load(len_ptr + req, mask=active, other=1.0)
        offs = k * TILE + tl.arange(0, TILE)
        mask = active[:, None] & (offs < V)[None, :]
        req64 = req.to(tl.int64)
        p = tl.load(p_ptr + (req64 * stride_pb + i * stride_pr)[:, None] + offs[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        q = tl.load(q_ptr + (req64 * stride_qb + i * stride_qr)[:, None] + offs[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        f = p - lenience[:, None] * q
        a = tl.maximum(f, 0.0)
        tl.store(bpart_ptr + (req * K + i) * NT + k, tl.sum(a, axis=1), mask=active)
        x = tl.load(tok_ptr + req * K + i, mask=active, other=-1).to(tl.int32)
        inside = active & (x >= k * TILE) & (x < (k + 1) * TILE)
        if tl.max(inside.to(tl.int32), axis=0) > 0:
            hit = offs[None, :] == x[:, None]
            p_x = tl.sum(tl.where(hit, p, 0.0), axis=1)
            q_x = tl.sum(tl.where(hit, q, 0.0), axis=1)
            safe_q = tl.where(q_x > 0.0, q_x, 1.0)
            tau = tl.where(q_x > 0.0, tl.minimum(1.0, p_x / (lenience * safe_q)), -1.0)
            tl.store(tau_ptr + req * K + i, tau, mask=inside)


@triton.jit
def _rows_lse(m_ptr, s_ptr, slot0, cols, smask):
    """Combine each row's chunk stats (m, s) into (max, log-sum-exp, m); slot0 [R] = first chunk's flat index."""
    mm = tl.load(m_ptr + slot0[:, None] + cols[None, :], mask=smask, other=float("-inf"))
    ss = tl.load(s_ptr + slot0[:, None] + cols[None, :], mask=smask, other=0.0)
    big_m, lse = chunk_lse(mm, ss, 1)
    return big_m, lse, mm


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
def accept_sample_rows_kernel(tgt_ptr, drf_ptr, tok_ptr, nd_ptr, seed_ptr, off_ptr, temp_ptr, len_ptr, thr_t_ptr,
                              thr_q_ptr, m_ptr, s_ptr, a_ptr, tau_ptr, bpart_ptr,
                              out_ptr, nacc_ptr, nemit_ptr, accd_ptr,
                              B, K, V, NC1, NC2, TILES, NT, stride_tb, stride_tr, stride_db, stride_dr, alpha, beta,
                              MODE: tl.constexpr, DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr,
                              BLOCK: tl.constexpr, NC1_BLOCK: tl.constexpr, RB: tl.constexpr,
                              BLOCK_B: tl.constexpr, WB: tl.constexpr):
    """``sample.accept_sample_kernel`` for BLOCK_B requests per program: acceptance on [BLOCK_B, RB] blocks (pass-1
    statistics as [BLOCK_B, RB, NC1_BLOCK]), then the inverse-CDF draw on the [BLOCK_B, BLOCK] tile that holds each
    request's whole row n (one program per request, so no cross-program reduction; NC2 = TILES = 1)."""
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
        u = keyed_uniform_rows(seed[:, None], off[:, None] + rows, PURPOSE_ACCEPT, tl.zeros([BLOCK_B, RB], tl.int32))
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
                big_m, lse = chunk_lse(mm, ss, 2)
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
                    _, q_lse = chunk_lse(qm, qs, 2)
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
        # ---- 2. weights of row n (the whole row is this program's one tile): residual and p ----
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
        ids = tl.broadcast_to(tl.arange(0, BLOCK)[None, :], [BLOCK_B, BLOCK])     # [BB, BLOCK] vocabulary ids
        mask = (ids < V) & sample_row[:, None]
        rmask = mask & rej_row[:, None]
        if MODE == MODE_PROBS:
            w_p = tl.load(row_t[:, None] + ids, mask=mask, other=0.0).to(tl.float32)
            w_r = tl.zeros([BLOCK_B, BLOCK], tl.float32)
            if any_rej:
                q = tl.load(row_q[:, None] + ids, mask=rmask, other=0.0).to(tl.float32)
                w_r = tl.where(rmask, tl.maximum(w_p - lenience[:, None] * q, 0.0), 0.0)
        else:
            z = _scaled(row_t[:, None], thr_t_ptr, (req * (K + 1) + n)[:, None], ids, mask, scale[:, None], HAS_THR)
            if MODE == MODE_LOGITS:
                lp = z - lse_n[:, None]
            else:
                lp = log_sigmoid_hat(z, alpha, beta)
            w_p = tl.exp(lp)
            w_r = tl.zeros([BLOCK_B, BLOCK], tl.float32)
            if any_rej:
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
                keep = (lp > lq) & rmask
                w_r = tl.exp(tl.where(keep, lp + tl.log(1.0 - tl.exp(tl.where(keep, lq - lp, 0.0))), float("-inf")))
        # ---- 3. inverse CDF with one keyed uniform per request (the row is one tile: the tile step is trivial) ----
        if MODE == MODE_PROBS:
            tiles = tl.arange(0, NC1_BLOCK)[None, :]
            t_mask = rej_row[:, None] & (tiles < NT)
            b_sum = tl.sum(tl.load(bpart_ptr + (req * K + n)[:, None] * NT + tiles, mask=t_mask, other=0.0),
                           axis=1)
            use_res = rej_row & (b_sum > 0.0)
        else:
            use_res = rej_row & (tl.max(w_r, axis=1) > 0.0)
        w = tl.where(use_res[:, None], w_r, w_p)
        u = tl.max(keyed_uniform_rows(seed[:, None], pos_n[:, None], PURPOSE_SAMPLE, tl.zeros([BLOCK_B, 1], tl.int32)),
                   axis=1)
        _, rest = cdf_tile(tl.sum(w, axis=1)[:, None], tl.zeros([BLOCK_B, 1], tl.int32), u, 1)
        token = cdf_pick(w, ids, rest, 0, 1)
        _write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, req, sample_row, n, token, K, WB)
