"""Pass 2 of ``fused`` (per-request layout): sample row n from the residual or the bonus distribution, many tiles
per program, linear weights.

After pass 1 (``stream``) has written, per request b, n = nrow[b] (the first rejected draft position,
or K_b) and the log-sum-exps lse[b] = (target row n, draft row n after a rejection with draft logits, else 0),
``sample_wide_kernel`` (grid (ceil(NT / TILES), B), NT = ceil(V / BLOCK) tiles of BLOCK ids) does steps 2-3 of
``sample``'s docstring for sampling requests (greedy requests were finished by pass 1):

* program (c, b) loads tiles c * TILES .. c * TILES + TILES - 1 of target row n (and of draft row n after a
  rejection) as ONE [TILES, BLOCK] block: every load of the program is in flight at once (one tile per program
  would pay a dependent chain of loads, a reduction and an acq_rel atomic for every 2-4 KB of logits);
* the weights are linear: w_p = exp(z - lse_n) and w_r = max(0, w_p - l q) with l q = exp(z_q - lse_q + log l)
  (two exps per id, ``common.exp_fast``), where ``sample`` evaluates the residual in log space (four exps / logs
  per id, ALU-bound at B = 64). Same law; the values differ from the log-space ones in fp32 rounding only;
* it writes the TILES tile masses (residual, p) to tsum [B, NT, 2]; the last program of request b (counter
  cnt[b], acq_rel, reset to 0 for CUDA-graph replay) draws by the two-level inverse CDF of
  :func:`tilespec.verify.rng.inverse_cdf` with the SAMPLE uniform at offset + n, recomputing the weights of the one
  chosen tile with the same function (so the tile step and the id step agree bit for bit).

Tile masses are per BLOCK-id tile (``rng.SAMPLE_TILE``) whatever TILES is, so the tokens do not depend on it up
to the fp32 order of a tile's sum. PDL (GPU, compute capability >= 9): the kernel is launched as a programmatic
dependent of pass 1 and waits (``griddepcontrol.wait``) before reading anything pass 1 wrote, so its launch and
prologue overlap pass 1's last programs. ALIGNED: V and the strides are multiples of 8 (16-byte loads).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (DRAFT_LOGITS, DRAFT_PROBS, PURPOSE_SAMPLE, cdf_pick, cdf_tile, exp_fast, keyed_uniform,
                     multiples_of_8, scale_loaded, write_outputs)
from .sample import _load_rows


@triton.jit
def lin_weights(xt, xq, idx, mask, rmask, x_n, temp, inv_t, thr_t, thr_q, lse_n, lse_ql, lenience,
                DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr, FAST: tl.constexpr):
    """(w_p, w_r) at ids ``idx`` from raw logits ``xt`` (-inf where ~mask) and the draft's ``xq`` (logits: -inf,
    probabilities: 0 where ~rmask), ``inv_t`` = 1 / T: p_n = exp(z / T - lse_n) and the residual
    max(0, p_n - l q_n), 0 where ~rmask (no rejection). ``lse_ql`` = lse of the draft row - log l. Without a draft
    distribution q is one-hot at x_n."""
    z = _scaled_rcp(xt, mask, temp, inv_t, thr_t, HAS_THR)
    w_p = exp_fast(z - lse_n, FAST)
    if DRAFT_KIND == DRAFT_LOGITS:
        lq = exp_fast(_scaled_rcp(xq, rmask, temp, inv_t, thr_q, HAS_THR) - lse_ql, FAST)
    elif DRAFT_KIND == DRAFT_PROBS:
        lq = lenience * xq.to(tl.float32)
    else:
        lq = tl.where(idx == x_n, lenience, 0.0)
    return w_p, tl.where(rmask, tl.maximum(w_p - lq, 0.0), 0.0)


@triton.jit
def _scaled_rcp(x, mask, temp, inv_t, thr, HAS_THR: tl.constexpr):
    """z = x / T (-inf where ~mask or below the keep threshold). Without filters it is x * ``inv_t``, the value the
    compiled x / T (div.full: x times the approximate reciprocal) gives for T in fp32's normal range, without the
    division's per-element range fix-ups (3 instructions per id). With filters it is the division itself,
    ``common.scale_loaded``: ``z >= thr`` must see the bits the threshold pass saw, or a kept id that sits on the
    threshold can fall 1 ulp below it and drop out of the support (the CPU interpreter divides exactly, so the two
    differ there on most rows)."""
    if HAS_THR:
        return scale_loaded(x, mask, temp, thr, HAS_THR)
    z = x.to(tl.float32) * inv_t
    return tl.where(mask, z, float("-inf"))


@triton.jit(do_not_specialize=["K", "V", "NT", "stride_tb", "stride_tr", "stride_db", "stride_dr"])
def sample_wide_kernel(tgt_ptr, drf_ptr, tok_ptr, nd_ptr, seed_ptr, off_ptr, temp_ptr, len_ptr, thr_t_ptr,
                       thr_q_ptr, nrow_ptr, lse_ptr, tsum_ptr, cnt_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr,
                       K, V, NT, stride_tb, stride_tr, stride_db, stride_dr,
                       DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
                       NT_BLOCK: tl.constexpr, ALIGNED: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1)
    if ALIGNED:
        V, stride_tb, stride_tr, stride_db, stride_dr = multiples_of_8(V, stride_tb, stride_tr, stride_db, stride_dr)
    temp = tl.load(temp_ptr + b)         # user inputs (pass 1 never writes them): read before the wait
    k_b = tl.load(nd_ptr + b)
    lenience = tl.load(len_ptr + b)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if temp != 0.0:
        inv_t = 1.0 / temp
        n = tl.load(nrow_ptr + b)
        lse_n = tl.load(lse_ptr + 2 * b)
        lse_ql = tl.load(lse_ptr + 2 * b + 1) - tl.log(lenience)
        is_rej = n < k_b
        x_n = tl.load(tok_ptr + b * K + n, mask=is_rej, other=-1).to(tl.int32)
        thr_t = 0.0
        thr_q = 0.0
        if HAS_THR:
            thr_t = tl.load(thr_t_ptr + b * (K + 1) + n)
            thr_q = tl.load(thr_q_ptr + b * K + n, mask=is_rej, other=0.0)
        row_t = tgt_ptr + b.to(tl.int64) * stride_tb + n * stride_tr
        row_q = drf_ptr + b.to(tl.int64) * stride_db + n * stride_dr
        if ALIGNED:
            row_t = tl.multiple_of(row_t, 16)
            row_q = tl.multiple_of(row_q, 16)
        tiles = c * TILES + tl.arange(0, TILES)                                    # [TILES]
        idx = tiles[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]                # [TILES, BLOCK]
        mask = idx < V
        rmask = mask & ((tl.zeros_like(idx) + is_rej.to(tl.int32)) != 0)
        xt, xq = _load_rows(row_t, row_q, idx, mask, rmask, DRAFT_KIND)
        w_p, w_r = lin_weights(xt, xq, idx, mask, rmask, x_n, temp, inv_t, thr_t, thr_q, lse_n, lse_ql, lenience,
                               DRAFT_KIND, HAS_THR, FAST)
        slots = (b * NT + tiles) * 2
        tl.store(tsum_ptr + slots, tl.sum(w_r, axis=1), mask=tiles < NT)
        tl.store(tsum_ptr + slots + 1, tl.sum(w_p, axis=1), mask=tiles < NT)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:   # the last program of request b: the draw
            tt = tl.arange(0, NT_BLOCK)
            tm = tt < NT
            sr = tl.load(tsum_ptr + (b * NT + tt) * 2, mask=tm, other=0.0, cache_modifier=".cg")
            sp = tl.load(tsum_ptr + (b * NT + tt) * 2 + 1, mask=tm, other=0.0, cache_modifier=".cg")
            use_res = is_rej & (tl.max(sr, axis=0) > 0.0)   # a residual that underflowed to 0: draw from p_n
            pos = tl.full([1], 0, tl.int64) + tl.load(off_ptr + b) + n
            u = tl.max(keyed_uniform(tl.load(seed_ptr + b), pos, PURPOSE_SAMPLE, tl.zeros([1], tl.int32)), axis=0)
            tile, rest = cdf_tile(tl.where(use_res, sr, sp), tt, u)
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            omask = offs < V
            ormask = omask & ((tl.zeros_like(offs) + is_rej.to(tl.int32)) != 0)
            yt, yq = _load_rows(row_t, row_q, offs, omask, ormask, DRAFT_KIND)
            v_p, v_r = lin_weights(yt, yq, offs, omask, ormask, x_n, temp, inv_t, thr_t, thr_q, lse_n, lse_ql,
                                   lenience, DRAFT_KIND, HAS_THR, FAST)
            token = cdf_pick(tl.where(use_res, v_r, v_p), offs, rest, tile * BLOCK)
            write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, b, b >= 0, n, token, K, 32)
            tl.atomic_xchg(cnt_ptr + b, 0)
