"""Pass 2 of every method: acceptance test, then sample the one row each request needs, all in one launch.

  1. Acceptance: for draft positions i < K_b in blocks of RB, gather the target (and draft) value at the drafted
     token, combine the pass-1 chunk statistics into the row's log-sum-exp, and test
     log u_i < log p_i(x_i) - log q_i(x_i) - log l  (u_i keyed by (seed, offset + i, ACCEPT); q(x) = 0 rejects;
     greedy requests accept iff x_i is the first argmax, or p1(x_i) >= l max p1 with lenience).
     n = the first rejected position, or K_b.
  2. Row n only: the weights w_r = max(0, p_n - l q_n) (the residual; 0 unless n < K_b) and w_p = p_n, summed per
     BLOCK-wide tile. No random numbers per vocabulary entry.
  3. The two-level inverse CDF of :func:`tilespec.verify.rng.inverse_cdf` with ONE uniform keyed by
     (seed, offset + n, SAMPLE, 0): the tile from the tile masses (of the residual, or of p_n when nothing was
     rejected or the residual is zero everywhere), then the id inside that one tile. Greedy ``fused`` requests
     skip 2-3: the token is the argmax of row n from pass-1 statistics.
MODE (constexpr: each mode compiles to its own kernel) picks how a row becomes log-weights: exact logits (fused:
z / T - lse, with optional per-row keep thresholds), the paper's sigmoid surrogate (no normalisation, not exact),
or probabilities (tiled: tau and b_k from its pass 1).
Outputs: out [B, K+1] int64 (-1 padded), nacc / nemit [B] int64, accepted [B, K] bool.

Two layouts with the same helpers (``common`` and the two below), differing only in indexing:
``accept_sample_kernel``, grid (NC2, B): program (c, b) handles vocabulary chunk c (TILES tiles) of request b;
every program of b runs step 1 redundantly and identically (no sync needed), writes its tiles' masses to
tsum [B, NC2 * TILES, 2], and the last one done (atomic counter, acq_rel; reset to 0 for CUDA-graph replay) draws
(:func:`_sample_tiles`); ``sigmoid`` and ``tiled`` use it (``fused`` in this layout runs step 1 once per request
at the end of pass 1, ``stats._accept_tail``, then ``residual.sample_wide_kernel``).
``accept_sample_rows_kernel``, grid (1, ceil(B / BLOCK_B)): BLOCK_B requests per program, each whole row n in one
[BLOCK_B, BLOCK] tile (small vocabularies), so the tile step is trivial and no cross-program reduction is needed.
Both take the same arguments (the batched kernel ignores tsum, cnt, NC2, TILES and NT2_BLOCK; the per-request one
B); buffers a variant never reads (thresholds without filters, pass-1 statistics outside ``fused``, tau / b_k
outside ``tiled``) are a dummy tensor.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (DRAFT_LOGITS, DRAFT_PROBS, MODE_LOGITS, MODE_PROBS, PURPOSE_ACCEPT, PURPOSE_SAMPLE, cdf_pick,
                     cdf_tile, keyed_uniform, log_sigmoid_hat, row_lse, scale_loaded, scaled,
                     stats_argmax, threshold, write_outputs)


@triton.jit
def _first_rejection(tgt_b, drf_b, req, rows, k_b, seed, off, temp, scale, lenience, log_l, tok_ptr, thr_t_ptr,
                     thr_q_ptr, m_ptr, s_ptr, a_ptr, tau_ptr, K, NC1, cols, stride_tr, stride_dr, alpha, beta,
                     MODE: tl.constexpr, DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr):
    """Step 1 for draft positions ``rows`` ([RB], or [1, RB] with request values as [BB, 1] columns): per request,
    the first rejected position among them, or k_b."""
    valid = rows < k_b
    x = tl.load(tok_ptr + req * K + rows, mask=valid, other=0).to(tl.int32)
    u = keyed_uniform(seed, off + rows, PURPOSE_ACCEPT, tl.zeros_like(x))
    t_rows = tgt_b + rows * stride_tr
    greedy = (tl.zeros_like(u) + temp) == 0.0   # (masks need it as a vector)
    if MODE == MODE_PROBS:
        p_x = tl.load(t_rows + x, mask=valid, other=0.0).to(tl.float32)
        tau = tl.load(tau_ptr + req * K + rows, mask=valid, other=-1.0)
        acc = tl.where(temp == 0.0, p_x == 1.0, u < tau)
    else:
        zx = scaled(t_rows + x, valid, scale, threshold(thr_t_ptr, req * (K + 1) + rows, valid, HAS_THR), HAS_THR)
        slot0 = (req * (2 * K + 1) + rows) * NC1
        if MODE == MODE_LOGITS:
            big_m, lse, mm = row_lse(m_ptr, s_ptr, slot0, cols, tl.expand_dims(valid, -1) & (cols < NC1))
            lp_x = zx - lse
        else:
            lp_x = log_sigmoid_hat(zx, alpha, beta)
        if DRAFT_KIND == DRAFT_LOGITS:
            zq = scaled(drf_b + rows * stride_dr + x, valid, scale,
                        threshold(thr_q_ptr, req * K + rows, valid, HAS_THR), HAS_THR)
            if MODE == MODE_LOGITS:   # greedy requests have no draft statistics
                qmask = tl.expand_dims(valid & ~greedy, -1) & (cols < NC1)
                _, q_lse, _ = row_lse(m_ptr, s_ptr, slot0 + (K + 1) * NC1, cols, qmask)
                lq_x = zq - q_lse
            else:
                lq_x = log_sigmoid_hat(zq, alpha, beta)
        elif DRAFT_KIND == DRAFT_PROBS:
            lq_x = tl.log(tl.load(drf_b + rows * stride_dr + x, mask=valid, other=1.0).to(tl.float32))
        else:
            lq_x = tl.zeros_like(u)
        acc = tl.log(u) < tl.where(lq_x > float("-inf"), lp_x - lq_x - log_l, float("-inf"))
        if MODE == MODE_LOGITS:
            amax = stats_argmax(a_ptr, slot0, mm, big_m, cols, valid & greedy)
            lenient_ok = (zx - lse) >= (big_m - lse) + log_l
            acc = tl.where(temp == 0.0, tl.where(lenience < 1.0, lenient_ok, x == amax), acc)
    return tl.min(tl.where(acc | ~valid, k_b, rows), axis=-1)



@triton.jit
def _request_n(tgt_b, drf_b, tok_ptr, nd_ptr, seed_ptr, off_ptr, temp_ptr, len_ptr, thr_t_ptr, thr_q_ptr,
               m_ptr, s_ptr, a_ptr, tau_ptr, b, K, NC1, stride_tr, stride_dr, alpha, beta,
               MODE: tl.constexpr, DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr, NC1_BLOCK: tl.constexpr,
               RB: tl.constexpr):
    """Request b's parameters and n, its first rejected position (k_b when every draft token is accepted), from
    the complete pass-1 statistics (per-request layout; tgt_b / drf_b: its logits rows): (n, k_b, seed, off, temp,
    scale, lenience, log_l)."""
    k_b = tl.load(nd_ptr + b)
    seed = tl.load(seed_ptr + b)
    off = tl.load(off_ptr + b)
    temp = tl.load(temp_ptr + b)
    lenience = tl.load(len_ptr + b)
    scale = tl.where(temp == 0.0, 1.0, temp)
    log_l = tl.log(lenience)
    cols = tl.arange(0, NC1_BLOCK)
    n = k_b
    for kb in range(0, k_b, RB):
        n = tl.minimum(n, _first_rejection(tgt_b, drf_b, b, kb + tl.arange(0, RB), k_b, seed, off, temp, scale,
                                           lenience, log_l, tok_ptr, thr_t_ptr, thr_q_ptr, m_ptr, s_ptr, a_ptr,
                                           tau_ptr, K, NC1, cols, stride_tr, stride_dr, alpha, beta, MODE,
                                           DRAFT_KIND, HAS_THR))
    return n, k_b, seed, off, temp, scale, lenience, log_l

@triton.jit
def _row_weights(row_t, row_q, idx, mask, live, rej, x_n, thr_t_ptr, thr_q_ptr, t_slot, q_slot, scale, lse_n,
                 lse_qn, lenience, log_l, alpha, beta, MODE: tl.constexpr, DRAFT_KIND: tl.constexpr,
                 HAS_THR: tl.constexpr):
    """Step 2: (w_p, w_r) of row n at ids ``idx`` (block, valid where ``mask``): p_n (logits: exp(z / T - lse);
    sigmoid: p_hat; probs: p) and the residual max(0, p_n - l q_n), 0 unless ``rej`` (log space for logits, as the
    reference). Row values (pointers, slots, live, rej, x_n, ...) are scalars or [BB, 1] columns."""
    rmask = _rej_mask(mask, idx, rej)
    if MODE == MODE_PROBS:
        w_p = tl.load(row_t + idx, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(row_q + idx, mask=rmask, other=0.0).to(tl.float32)
        return w_p, tl.where(rmask, tl.maximum(w_p - lenience * q, 0.0), 0.0)
    xt, xq = _load_rows(row_t, row_q, idx, mask, rmask, DRAFT_KIND)
    return _log_weights(xt, xq, idx, mask, rmask, live, rej, x_n, thr_t_ptr, thr_q_ptr, t_slot, q_slot, scale,
                        lse_n, lse_qn, log_l, alpha, beta, MODE, DRAFT_KIND, HAS_THR)


@triton.jit
def _rej_mask(mask, idx, rej):
    """``mask`` where the row was rejected (``rej``: scalar or column; as a vector, see _first_rejection)."""
    return mask & ((tl.zeros_like(idx) + rej.to(tl.int32)) != 0)


@triton.jit
def _load_rows(row_t, row_q, idx, mask, rmask, DRAFT_KIND: tl.constexpr):
    """The raw values :func:`_log_weights` needs at ids ``idx``: target logits (-inf where ~mask) and the draft's
    (logits: -inf, probabilities: 0 where ~rmask; no draft: the target's, unused)."""
    xt = tl.load(row_t + idx, mask=mask, other=float("-inf"))
    xq = xt
    if DRAFT_KIND == DRAFT_LOGITS:
        xq = tl.load(row_q + idx, mask=rmask, other=float("-inf"))
    elif DRAFT_KIND == DRAFT_PROBS:
        xq = tl.load(row_q + idx, mask=rmask, other=0.0)
    return xt, xq


@triton.jit
def _log_weights(xt, xq, idx, mask, rmask, live, rej, x_n, thr_t_ptr, thr_q_ptr, t_slot, q_slot, scale, lse_n,
                 lse_qn, log_l, alpha, beta, MODE: tl.constexpr, DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr):
    """:func:`_row_weights` for logits / sigmoid on values loaded by :func:`_load_rows` (the same operations as
    loading them here, so the same bits whenever the load was issued)."""
    z = scale_loaded(xt, mask, scale, threshold(thr_t_ptr, t_slot, live, HAS_THR), HAS_THR)
    if MODE == MODE_LOGITS:
        lp = z - lse_n
    else:
        lp = log_sigmoid_hat(z, alpha, beta)
    if DRAFT_KIND == DRAFT_LOGITS:
        zq = scale_loaded(xq, rmask, scale, threshold(thr_q_ptr, q_slot, live & rej, HAS_THR), HAS_THR)
        if MODE == MODE_LOGITS:
            lq = zq - lse_qn
        else:
            lq = log_sigmoid_hat(zq, alpha, beta)
    elif DRAFT_KIND == DRAFT_PROBS:
        lq = tl.log(xq.to(tl.float32))
    else:
        lq = tl.where(idx == x_n, 0.0, float("-inf"))
    lq = lq + log_l
    keep = (lp > lq) & rmask
    res = tl.where(keep, lp + tl.log(1.0 - tl.exp(tl.where(keep, lq - lp, 0.0))), float("-inf"))
    return tl.exp(lp), tl.exp(res)


@triton.jit
def _use_residual(rej, r_mass, bpart_ptr, slot0, tiles, mask, MODE: tl.constexpr):
    """Step 3: draw from the residual (else from p_n): after a rejection, unless the residual is zero everywhere
    (its tile masses ``r_mass``; tiled: b = sum of its pass-1 b_k at bpart_ptr[slot0 + tiles], as the paper)."""
    if MODE == MODE_PROBS:
        total = tl.sum(tl.load(bpart_ptr + tl.expand_dims(slot0, -1) + tiles, mask=mask, other=0.0), axis=-1)
    else:
        total = tl.max(r_mass, axis=-1)
    return rej & (total > 0.0)


@triton.jit
def _sample_uniform(seed, position):
    """The SAMPLE uniform (token counter 0) of each request at ``position`` (seed / position: scalars or [BB])."""
    pos = tl.expand_dims(position, -1)
    u = keyed_uniform(tl.expand_dims(seed, -1), pos, PURPOSE_SAMPLE, tl.zeros_like(pos).to(tl.int32))
    return tl.max(u, axis=-1)


@triton.jit(do_not_specialize=["B", "K", "V", "NC1", "NC2", "TILES", "NT", "stride_tb", "stride_tr", "stride_db",
                               "stride_dr"])
def accept_sample_kernel(tgt_ptr, drf_ptr, tok_ptr, nd_ptr, seed_ptr, off_ptr, temp_ptr, len_ptr, thr_t_ptr,
                         thr_q_ptr, m_ptr, s_ptr, a_ptr, tau_ptr, bpart_ptr, tsum_ptr, cnt_ptr,
                         out_ptr, nacc_ptr, nemit_ptr, accd_ptr,
                         B, K, V, NC1, NC2, TILES, NT, stride_tb, stride_tr, stride_db, stride_dr, alpha, beta,
                         MODE: tl.constexpr, DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr,
                         BLOCK: tl.constexpr, NC1_BLOCK: tl.constexpr, NT2_BLOCK: tl.constexpr, RB: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1)
    live = b >= 0   # always (one request per program): a mask the compiler folds away
    tgt_b = tgt_ptr + b.to(tl.int64) * stride_tb
    drf_b = drf_ptr + b.to(tl.int64) * stride_db
    n, k_b, seed, off, temp, scale, lenience, log_l = _request_n(
        tgt_b, drf_b, tok_ptr, nd_ptr, seed_ptr, off_ptr, temp_ptr, len_ptr, thr_t_ptr, thr_q_ptr, m_ptr, s_ptr,
        a_ptr, tau_ptr, b, K, NC1, stride_tr, stride_dr, alpha, beta, MODE, DRAFT_KIND, HAS_THR, NC1_BLOCK, RB)
    cols = tl.arange(0, NC1_BLOCK)
    slot_n = (b * (2 * K + 1) + n) * NC1
    greedy_path = False   # only ``fused`` reads greedy answers from pass-1 statistics
    if MODE == MODE_LOGITS:
        greedy_path = temp == 0.0
    if greedy_path:
        if c == 0:
            big_m, _, mm = row_lse(m_ptr, s_ptr, slot_n, cols, cols < NC1)
            token = stats_argmax(a_ptr, slot_n, mm, big_m, cols, live)
            write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, b, live, n, token, K, 32)
    else:
        # is_rej as a vector (the interpreter turns scalar-bool & tensor-bool into int32)
        rej_v = (cols * 0 + n) < k_b
        lse_n = tl.full([], 0.0, tl.float32)
        lse_qn = tl.full([], 0.0, tl.float32)
        if MODE == MODE_LOGITS:
            _, lse_n, _ = row_lse(m_ptr, s_ptr, slot_n, cols, cols < NC1)
            if DRAFT_KIND == DRAFT_LOGITS:   # draft row n exists only after a rejection
                _, lse_qn, _ = row_lse(m_ptr, s_ptr, slot_n + (K + 1) * NC1, cols, (cols < NC1) & rej_v)
        _sample_tiles(tgt_b, drf_b, tok_ptr, thr_t_ptr, thr_q_ptr, bpart_ptr, tsum_ptr, cnt_ptr, out_ptr, nacc_ptr,
                      nemit_ptr, accd_ptr, b, c, n, k_b, seed, off, scale, lenience, log_l, lse_n, lse_qn, cols,
                      rej_v, K, V, NC2, TILES, NT, stride_tr, stride_dr, alpha, beta, MODE, DRAFT_KIND, HAS_THR,
                      BLOCK, NT2_BLOCK)


@triton.jit
def _sample_tiles(tgt_b, drf_b, tok_ptr, thr_t_ptr, thr_q_ptr, bpart_ptr, tsum_ptr, cnt_ptr, out_ptr, nacc_ptr,
                  nemit_ptr, accd_ptr, b, c, n, k_b, seed, off, scale, lenience, log_l, lse_n, lse_qn, cols, rej_v,
                  K, V, NC2, TILES, NT, stride_tr, stride_dr, alpha, beta, MODE: tl.constexpr,
                  DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr, BLOCK: tl.constexpr, NT2_BLOCK: tl.constexpr):
    """Steps 2-3 for program (c, b) of the per-request layout, once n (the row to sample) and its log-sum-exps are
    known: the masses (residual, p) of tiles c * TILES .. c * TILES + TILES - 1 of row n -> tsum [B, NC2 * TILES, 2];
    the last of the NC2 programs of b (counter at cnt_ptr[b], acq_rel; reset to 0) picks the tile with the SAMPLE
    uniform, scans that one tile and writes the outputs. ``cols`` / ``rej_v``: tiled's b_k columns (n < k_b)."""
    live = b >= 0   # always (one request per program): a mask the compiler folds away
    is_rej = n < k_b
    x_n = tl.load(tok_ptr + b * K + n, mask=is_rej, other=-1).to(tl.int32)
    row_t = tgt_b + n * stride_tr
    row_q = drf_b + n * stride_dr
    nt2 = NC2 * TILES
    for t in range(TILES):
        tile = c * TILES + t
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        w_p, w_r = _row_weights(row_t, row_q, offs, offs < V, live, is_rej, x_n, thr_t_ptr, thr_q_ptr,
                                b * (K + 1) + n, b * K + n, scale, lse_n, lse_qn, lenience, log_l, alpha, beta,
                                MODE, DRAFT_KIND, HAS_THR)
        tl.store(tsum_ptr + (b * nt2 + tile) * 2, tl.sum(w_r, axis=0))
        tl.store(tsum_ptr + (b * nt2 + tile) * 2 + 1, tl.sum(w_p, axis=0))
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel")
    if done == NC2 - 1:   # the last program of request b: inverse CDF over tile masses, then inside one tile
        tt = tl.arange(0, NT2_BLOCK)
        tm = tt < nt2
        sr = tl.load(tsum_ptr + (b * nt2 + tt) * 2, mask=tm, other=0.0, cache_modifier=".cg")
        sp = tl.load(tsum_ptr + (b * nt2 + tt) * 2 + 1, mask=tm, other=0.0, cache_modifier=".cg")
        use_res = _use_residual(is_rej, sr, bpart_ptr, (b * K + n) * NT, cols, (cols < NT) & rej_v, MODE)
        tile, rest = cdf_tile(tl.where(use_res, sr, sp), tt, _sample_uniform(seed, off + n))
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        w_p, w_r = _row_weights(row_t, row_q, offs, offs < V, live, use_res, x_n, thr_t_ptr, thr_q_ptr,
                                b * (K + 1) + n, b * K + n, scale, lse_n, lse_qn, lenience, log_l, alpha, beta,
                                MODE, DRAFT_KIND, HAS_THR)
        token = cdf_pick(tl.where(use_res, w_r, w_p), offs, rest, tile * BLOCK)
        write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, b, live, n, token, K, 32)
        tl.atomic_xchg(cnt_ptr + b, 0)


@triton.jit(do_not_specialize=["B", "K", "V", "NC1", "NC2", "TILES", "NT", "stride_tb", "stride_tr", "stride_db",
                               "stride_dr"])
def accept_sample_rows_kernel(tgt_ptr, drf_ptr, tok_ptr, nd_ptr, seed_ptr, off_ptr, temp_ptr, len_ptr, thr_t_ptr,
                              thr_q_ptr, m_ptr, s_ptr, a_ptr, tau_ptr, bpart_ptr, tsum_ptr, cnt_ptr,
                              out_ptr, nacc_ptr, nemit_ptr, accd_ptr,
                              B, K, V, NC1, NC2, TILES, NT, stride_tb, stride_tr, stride_db, stride_dr, alpha, beta,
                              MODE: tl.constexpr, DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr,
                              BLOCK: tl.constexpr, NC1_BLOCK: tl.constexpr, NT2_BLOCK: tl.constexpr,
                              RB: tl.constexpr, BLOCK_B: tl.constexpr, WB: tl.constexpr):
    req = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)          # [BB] request ids of this program
    live = req < B
    k_b = tl.load(nd_ptr + req, mask=live, other=0)
    seed = tl.load(seed_ptr + req, mask=live, other=0)
    off = tl.load(off_ptr + req, mask=live, other=0)
    temp = tl.load(temp_ptr + req, mask=live, other=1.0)
    lenience = tl.load(len_ptr + req, mask=live, other=1.0)
    scale = tl.where(temp == 0.0, 1.0, temp)
    log_l = tl.log(lenience)
    cols = tl.arange(0, NC1_BLOCK)
    tgt_b = tgt_ptr + req.to(tl.int64) * stride_tb                    # [BB] row-0 pointers
    drf_b = drf_ptr + req.to(tl.int64) * stride_db
    n = k_b
    for kb in range(0, tl.max(k_b, axis=0), RB):
        n = tl.minimum(n, _first_rejection(tgt_b[:, None], drf_b[:, None], req[:, None],
                                           (kb + tl.arange(0, RB))[None, :], k_b[:, None], seed[:, None],
                                           off[:, None], temp[:, None], scale[:, None], lenience[:, None],
                                           log_l[:, None], tok_ptr, thr_t_ptr, thr_q_ptr, m_ptr, s_ptr, a_ptr,
                                           tau_ptr, K, NC1, cols, stride_tr, stride_dr, alpha, beta, MODE,
                                           DRAFT_KIND, HAS_THR))
    is_rej = n < k_b
    slot_n = (req * (2 * K + 1) + n) * NC1
    sample_row = live
    if MODE == MODE_LOGITS:   # only ``fused`` reads greedy answers from pass-1 statistics
        greedy_row = live & (temp == 0.0)
        if tl.max(greedy_row.to(tl.int32), axis=0) > 0:
            big_m, _, mm = row_lse(m_ptr, s_ptr, slot_n, cols, greedy_row[:, None] & (cols < NC1)[None, :])
            token = stats_argmax(a_ptr, slot_n, mm, big_m, cols, greedy_row)
            write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, req, greedy_row, n, token, K, WB)
        sample_row = live & (temp != 0.0)
    if tl.max(sample_row.to(tl.int32), axis=0) > 0:
        rej_row = sample_row & is_rej
        lse_n = tl.zeros([BLOCK_B], tl.float32)
        lse_qn = tl.zeros([BLOCK_B], tl.float32)
        if MODE == MODE_LOGITS:
            _, lse_n, _ = row_lse(m_ptr, s_ptr, slot_n, cols, sample_row[:, None] & (cols < NC1)[None, :])
            lse_n = tl.where(sample_row, lse_n, 0.0)
            if DRAFT_KIND == DRAFT_LOGITS:   # draft row n exists only after a rejection
                _, lse_qn, _ = row_lse(m_ptr, s_ptr, slot_n + (K + 1) * NC1, cols,
                                       rej_row[:, None] & (cols < NC1)[None, :])
                lse_qn = tl.where(rej_row, lse_qn, 0.0)
        x_n = tl.load(tok_ptr + req * K + n, mask=rej_row, other=-1).to(tl.int32)
        ids = tl.broadcast_to(tl.arange(0, BLOCK)[None, :], [BLOCK_B, BLOCK])     # row n is this one tile
        w_p, w_r = _row_weights((tgt_b + n * stride_tr)[:, None], (drf_b + n * stride_dr)[:, None], ids,
                                (ids < V) & sample_row[:, None], sample_row[:, None], rej_row[:, None],
                                x_n[:, None], thr_t_ptr, thr_q_ptr, (req * (K + 1) + n)[:, None],
                                (req * K + n)[:, None], scale[:, None], lse_n[:, None], lse_qn[:, None],
                                lenience[:, None], log_l[:, None], alpha, beta, MODE, DRAFT_KIND, HAS_THR)
        r_mass = tl.sum(w_r, axis=1)
        use_res = _use_residual(rej_row, r_mass[:, None], bpart_ptr, (req * K + n) * NT, cols[None, :],
                                rej_row[:, None] & (cols < NT)[None, :], MODE)
        mass = tl.where(use_res, r_mass, tl.sum(w_p, axis=1))
        _, rest = cdf_tile(mass[:, None], tl.zeros([BLOCK_B, 1], tl.int32), _sample_uniform(seed, off + n))
        token = cdf_pick(tl.where(use_res[:, None], w_r, w_p), ids, rest, 0)
        write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, req, sample_row, n, token, K, WB)
