"""Pass 1 of ``fused`` in the per-request layout: per-chunk statistics of the logit rows in few registers.

Grid (ceil(NC / CPP), R, B): program (g, r, b) reduces chunks g * CPP .. g * CPP + CPP - 1 of row r of request b
and writes m / s / a at slot = (b * (2K + 1) + r) * NC + c (definitions in :mod:`.stats`); the last program of
request b runs the acceptance test (``stats._accept_tail``). How a chunk is reduced:

* Sampling rows (:func:`_stream_chunks_grouped`): lanes of GROUP contiguous ids; a thread's 16-byte load is one
  group, the group max a reduction inside the thread, and each lane keeps (m, s) with one exp per element plus one
  per group. Without filters the loop never divides: max and exp run on the raw logits and the stored chunk max is
  max(x) / T, the same fp32 value as the max of z (division by T > 0 is monotone).
* Greedy rows (:func:`_stream_chunks`): lane-wise online statistics with the first argmax. Each of the SUB lanes
  keeps its own running max m_l, sum s_l = sum exp(z - m_l) and first argmax over the chunk's CHUNK / SUB slices
  (e = exp(min(m_l, z) - max(m_l, z)); s_l = z > m_l ? s_l * e + 1 : s_l + e). The lanes are combined once per
  chunk (M = max m_l, S = sum s_l exp(m_l - M), a = the smallest lane argmax among lanes with m_l = M).
  Neither loop has a cross-thread reduction or a barrier: a warp's next load is never held up by the others.
* Vector loads. With ``ALIGNED`` (the caller checked: 16-byte aligned base pointers, strides and V multiples of
  16 bytes), row offsets and V are declared multiples of 16 bytes (``tl.multiple_of``), so each thread loads
  16 bytes per instruction (bf16 rows as int32 pairs widened by one shift / one mask).
* PREFETCH: the next slice(s) (across chunk boundaries within the program's chunks) are loaded before this one is
  reduced. It moves no bits.

Values: z = x / T (``common.div_t``: correctly rounded where a keep threshold is compared) with -inf where masked
or below the threshold; m is a max, a the first argmax, s a sum in fp32. Each chunk's arithmetic depends on
CHUNK, SUB, GROUP and the warp count only (fixed by V and the module globals, never by B or CPP), so the
statistics, hence the tokens, are batch invariant and the same bits for every CPP and PREFETCH. Running maxima
start at -FLT_MAX (not -inf), which needs no -inf guard per element: a lane that saw only -inf keeps s_l = 0, and
a chunk with S = 0 (nothing unmasked) stores m = -inf, s = 0.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import BIG, div_t, exp2_scaled
from .stats import _accept_tail

NEG_MAX = tl.constexpr(-3.4028234663852886e38)   # -FLT_MAX: the lanes' initial running max


@triton.jit(do_not_specialize=["B", "K", "V", "NC", "stride_tb", "stride_tr", "stride_db", "stride_dr"])
def row_stats_stream_kernel(tgt_ptr, drf_ptr, nd_ptr, temp_ptr, thr_t_ptr, thr_q_ptr,
                            m_ptr, s_ptr, a_ptr,
                            B, K, V, NC, stride_tb, stride_tr, stride_db, stride_dr,
                            tok_ptr, seed_ptr, off_ptr, len_ptr, nrow_ptr, lse_ptr, cnt_ptr,
                            out_ptr, nacc_ptr, nemit_ptr, accd_ptr,
                            DRAFT_KIND: tl.constexpr, HAS_THR: tl.constexpr, CHUNK: tl.constexpr,
                            SUB: tl.constexpr, NC_BLOCK: tl.constexpr, RB: tl.constexpr, CPP: tl.constexpr,
                            ALIGNED: tl.constexpr, PREFETCH: tl.constexpr, GROUP: tl.constexpr,
                            FAST: tl.constexpr = False, PDL: tl.constexpr = False):
    if PDL:   # let pass 2 (launched as a programmatic dependent) get resident; it waits for this grid to finish
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.program_id(0)   # chunks g * CPP .. g * CPP + CPP - 1 (those < NC) of row r of request b
    r = tl.program_id(1)
    b = tl.program_id(2)
    k_b = tl.load(nd_ptr + b)
    temp = tl.load(temp_ptr + b)
    greedy = temp == 0.0
    scale = tl.where(greedy, 1.0, temp)
    is_target = r <= K
    row = tl.where(is_target, r, r - K - 1)
    active = (is_target & (row <= k_b)) | ((r > K) & (row < k_b) & (temp != 0.0))
    if active:
        b64 = b.to(tl.int64)
        c0 = g * CPP
        n_chunks = tl.minimum(CPP, NC - c0)
        slot0 = (b * (2 * K + 1) + r) * NC
        # (each branch has its own pointer: target and draft logits may differ in dtype)
        if is_target:
            row_off = b64 * stride_tb + row * stride_tr
            if ALIGNED:
                row_off = tl.multiple_of(row_off, 128 // tgt_ptr.dtype.element_ty.primitive_bitwidth)
            thr = 0.0
            if HAS_THR:
                thr = tl.load(thr_t_ptr + b * (K + 1) + row)
            if greedy:   # lane-wise, for the first argmax
                _stream_chunks(tgt_ptr + row_off, c0, n_chunks, V, scale, thr, m_ptr, s_ptr, a_ptr, slot0,
                               HAS_THR, CHUNK, SUB, PREFETCH, ALIGNED)
            else:
                _stream_chunks_grouped(tgt_ptr + row_off, c0, n_chunks, V, scale, thr, m_ptr, s_ptr, slot0,
                                       HAS_THR, CHUNK, SUB, GROUP, PREFETCH, ALIGNED, FAST)
        else:
            row_off = b64 * stride_db + row * stride_dr
            if ALIGNED:
                row_off = tl.multiple_of(row_off, 128 // drf_ptr.dtype.element_ty.primitive_bitwidth)
            thr = 0.0
            if HAS_THR:
                thr = tl.load(thr_q_ptr + b * K + row)
            _stream_chunks_grouped(drf_ptr + row_off, c0, n_chunks, V, scale, thr, m_ptr, s_ptr, slot0,
                                   HAS_THR, CHUNK, SUB, GROUP, PREFETCH, ALIGNED, FAST)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel")
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:
        _accept_tail(tgt_ptr, drf_ptr, tok_ptr, nd_ptr, seed_ptr, off_ptr, temp_ptr, len_ptr, thr_t_ptr,
                     thr_q_ptr, m_ptr, s_ptr, a_ptr, nrow_ptr, lse_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, b,
                     K, NC, stride_tb, stride_tr, stride_db, stride_dr, DRAFT_KIND, HAS_THR, NC_BLOCK, RB)
        tl.atomic_xchg(cnt_ptr + b, 0)


@triton.jit
def _stream_chunks(row_ptr, c0, n_chunks, V, scale, thr, m_ptr, s_ptr, a_ptr, slot0, HAS_THR: tl.constexpr,
                   CHUNK: tl.constexpr, SUB: tl.constexpr, PREFETCH: tl.constexpr, ALIGNED: tl.constexpr):
    """Chunks c0 .. c0 + n_chunks - 1 (CHUNK / SUB slices of SUB ids each) of a greedy row at ``row_ptr``:
    lane-wise online max / sum-exp / first argmax per chunk, combined and stored at slot0 + c after the chunk's
    last slice. Ids >= V read as -inf (no memory traffic); so do prefetches past the program's last chunk."""
    NSUB: tl.constexpr = CHUNK // SUB
    lane = tl.arange(0, SUB)
    base = c0 * CHUNK
    lim = tl.minimum(V, (c0 + n_chunks) * CHUNK)
    if ALIGNED:   # V % 8 == 0 (checked by the caller): masks are constant over 8-id groups, loads stay vectors
        lim = tl.multiple_of(lim, 8)
    x = 0
    if PREFETCH:
        x = tl.load(row_ptr + base + lane, mask=base + lane < lim, other=float("-inf"))
    m = tl.full([SUB], NEG_MAX, tl.float32)
    s = tl.zeros([SUB], tl.float32)
    at = tl.full([SUB], BIG, tl.int32)
    for it in range(0, n_chunks * NSUB):
        offs = base + it * SUB + lane      # (from the induction variable: Triton keeps its contiguity)
        if PREFETCH:   # issue the next slice's load (maybe the next chunk's first) before this one's arithmetic
            x_next = tl.load(row_ptr + offs + SUB, mask=offs + SUB < lim, other=float("-inf"))
            xv = x
        else:
            xv = tl.load(row_ptr + offs, mask=offs < lim, other=float("-inf"))
        z = div_t(xv.to(tl.float32), scale, HAS_THR)   # masked ids: -inf / T = -inf, as common.scaled
        if HAS_THR:
            z = tl.where(z >= thr, z, float("-inf"))
        up = z > m
        # the lane's first id holding its running max (also a first z equal to the initial -FLT_MAX)
        at = tl.where(up | ((z == m) & (at == BIG)), offs, at)
        e = tl.exp(tl.minimum(m, z) - tl.maximum(m, z))
        s = tl.where(up, s * e + 1.0, s + e)
        m = tl.maximum(m, z)
        if it % NSUB == NSUB - 1:   # the chunk's last slice: combine the lanes, store, restart
            big_m = tl.max(m, axis=0)
            total = tl.sum(s * tl.exp(m - big_m), axis=0)
            slot = slot0 + c0 + it // NSUB
            tl.store(m_ptr + slot, tl.where(total > 0.0, big_m, float("-inf")))
            tl.store(s_ptr + slot, total)
            first = tl.min(tl.where(m == big_m, at, BIG), axis=0)   # a fully masked chunk: its first id
            tl.store(a_ptr + slot, tl.where(total > 0.0, first, base + (it // NSUB) * CHUNK))
            at = tl.full([SUB], BIG, tl.int32)
            m = tl.full([SUB], NEG_MAX, tl.float32)
            s = tl.zeros([SUB], tl.float32)
        if PREFETCH:
            x = x_next


@triton.jit
def _stream_chunks_grouped(row_ptr, c0, n_chunks, V, scale, thr, m_ptr, s_ptr, slot0, HAS_THR: tl.constexpr,
                           CHUNK: tl.constexpr, SUB: tl.constexpr, GROUP: tl.constexpr, PREFETCH: tl.constexpr,
                           ALIGNED: tl.constexpr, FAST: tl.constexpr):
    """:func:`_stream_chunks` for sampling rows (no argmax) with GROUP contiguous ids per lane: each slice is a
    [SUB / GROUP, GROUP] block (a thread's 16-byte load is one group), and lane g keeps a running (max, sum) over
    its groups: m' = max(m, max of the group), s = s exp(m - m') + sum exp(z - m'): one exp per element plus one
    per group, and the group max is a reduction inside a thread. Combined and stored per chunk as there.

    Without filters the loop never divides: it runs on the raw logits x (max of x; exp((x - m) / T) as
    exp2((x - m) c), c = log2(e) / T) and stores m = max(x) / T, the same fp32 value as the max of
    ``common.scaled``'s z = x / T (division by T > 0 is monotone, so it commutes with the max); s is the same sum
    as sum exp(z - m) up to fp32 rounding (not the same bits). The per-element division cost 3 instructions
    (``div.full``'s range fix-ups are issued per element). bf16 rows with ALIGNED load int32 pairs and widen them
    with one shift / mask each. With filters z = x / T is needed per element (the keep test) and used throughout.
    FAST: ex2.approx.ftz (``common.exp_fast``)."""
    NSUB: tl.constexpr = CHUNK // SUB
    NG: tl.constexpr = SUB // GROUP
    PAIRS: tl.constexpr = ALIGNED and not HAS_THR and row_ptr.dtype.element_ty == tl.bfloat16
    W: tl.constexpr = GROUP // 2 if PAIRS else GROUP      # loaded words per group
    ids = tl.arange(0, NG)[:, None] * W + tl.arange(0, W)[None, :]            # [NG, W], row g = group g
    ptr = row_ptr
    if PAIRS:
        ptr = row_ptr.to(tl.pointer_type(tl.int32))
    STEP: tl.constexpr = SUB // 2 if PAIRS else SUB                             # words per slice
    base = c0 * (CHUNK // 2 if PAIRS else CHUNK)
    lim = tl.minimum(V, (c0 + n_chunks) * CHUNK)
    if ALIGNED:
        lim = tl.multiple_of(lim, 8)
    if PAIRS:
        lim = lim // 2
    x = 0
    x1 = 0
    if PREFETCH:   # PREFETCH = 2: two slices in flight ahead of the arithmetic (no bits change)
        x = _load_words(ptr, base + ids, lim, PAIRS)
    if PREFETCH >= 2:
        x1 = _load_words(ptr, base + STEP + ids, lim, PAIRS)
    inv_l2 = 1.4426950408889634 / scale     # exp(v / T) = exp2(v * inv_l2)
    if HAS_THR:
        inv_l2 = 1.4426950408889634
    m = tl.full([NG], NEG_MAX, tl.float32)
    s = tl.zeros([NG], tl.float32)
    for it in range(0, n_chunks * NSUB):
        offs = base + it * STEP + ids
        if PREFETCH >= 2:
            x_next = _load_words(ptr, offs + 2 * STEP, lim, PAIRS)
            xv = x
        elif PREFETCH:
            x_next = _load_words(ptr, offs + STEP, lim, PAIRS)
            xv = x
        else:
            xv = _load_words(ptr, offs, lim, PAIRS)
        if PAIRS:
            lo = (xv << 16).to(tl.float32, bitcast=True)          # the even id of each pair, widened exactly
            hi = (xv & -65536).to(tl.float32, bitcast=True)       # the odd id
            m_new = tl.maximum(m, tl.maximum(tl.max(lo, axis=1), tl.max(hi, axis=1)))
            mc = m_new[:, None]
            part = (tl.sum(exp2_scaled(lo - mc, inv_l2, FAST), axis=1)
                    + tl.sum(exp2_scaled(hi - mc, inv_l2, FAST), axis=1))
        else:
            z = xv.to(tl.float32)
            if HAS_THR:
                z = div_t(z, scale, True)         # the same fp32 z as common.scaled (masked ids: -inf)
                z = tl.where(z >= thr, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=1))
            part = tl.sum(exp2_scaled(z - m_new[:, None], inv_l2, FAST), axis=1)
        # differences before scaling: m_new >= -FLT_MAX, so no inf - inf (a product could overflow first)
        s = s * exp2_scaled(m - m_new, inv_l2, FAST) + part
        m = m_new
        if it % NSUB == NSUB - 1:
            big_m = tl.max(m, axis=0)
            total = tl.sum(s * exp2_scaled(m - big_m, inv_l2, False), axis=0)
            if not HAS_THR:
                big_m = big_m / scale
            slot = slot0 + c0 + it // NSUB
            tl.store(m_ptr + slot, tl.where(total > 0.0, big_m, float("-inf")))
            tl.store(s_ptr + slot, total)
            m = tl.full([NG], NEG_MAX, tl.float32)
            s = tl.zeros([NG], tl.float32)
        if PREFETCH >= 2:
            x = x1
            x1 = x_next
        elif PREFETCH:
            x = x_next


@triton.jit
def _load_words(ptr, offs, lim, PAIRS: tl.constexpr):
    """Raw values at ``offs`` < lim: bf16 pairs as int32 words (-inf, -inf where masked) or single values (-inf)."""
    if PAIRS:
        return tl.load(ptr + offs, mask=offs < lim, other=-8323200)     # 0xff80ff80: two bf16 -inf
    else:
        return tl.load(ptr + offs, mask=offs < lim, other=float("-inf"))
