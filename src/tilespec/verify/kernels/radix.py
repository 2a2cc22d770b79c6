"""Chunked radix select for the top-k / top-p keep thresholds (definitions in :mod:`tilespec.verify.filters`).

Same search as :mod:`.thresholds` (a 2^BITS-way search over the order-preserving int32 key of z = fp32(logit) / T,
BITS key bits fixed per pass, 32 / BITS passes; z computed on the fly with a correctly rounded division, so it is
bit-identical to ``filters.scaled_logits``), but each pass is split over many programs per row:

* ``_hist_kernel``, grid N * C (N = B * R rows, C = ceil(V / CHUNK) chunks per row): program (n, c) loads chunk c
  of row n and writes its partial histogram hist[n, c, j] (j < 2^BITS) over the current key interval [lo, hi):
  the number (top-k) / the softmax mass exp(z - m) (top-p) of its tokens with key >= cand_j (top-k) or
  key > cand_j (top-p) and not beyond hi, cand_j = lo + j * 2^s. A chunk with no token left in [lo, hi) (known
  from the previous pass) writes zeros without reading its logits: after the first few passes most chunks skip.
* ``_combine_kernel``, grid N: adds the C partial histograms of its row to the row's running count / mass above
  hi, picks the digit (largest j whose count >= k, or whose mass / total >= top_p), narrows [lo, hi), marks which
  chunks still hold tokens inside it, and after the last pass writes the thresholds. Top-p stops a row early once
  its interval holds a single key (bf16 ties at the boundary): no chunk is read again for it.

Launches: top-k 2 * 32 / BITS; top-p 1 (chunk maxima) + 2 * 32 / BITS; both 4 * 32 / BITS (the chunk maxima
come from the first top-k pass). Fixed grids, trip counts and buffer shapes; no host sync: CUDA-graph safe.
Exactness: counts are integers, so t_k equals the one-program kernel's bit for bit; the top-p masses are fp32
sums in a fixed order (block, then chunk, then pass) that depends on V and CHUNK only, never on B or R (batch
invariant); the kept set equals the reference's unless some S(z_x) is within float rounding of top_p.
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import torch
import triton
import triton.language as tl

from .thresholds import _KEY_NAN, _KEY_NEG_INF, _float_key, _key_float, prepare_thresholds  # noqa: F401 (same keys)

_INT32_MAX = tl.constexpr(2**31 - 1)
_INT32_MIN = tl.constexpr(-2**31)
BITS = 4             # key bits per pass: 8 passes of a 16-way histogram
CHUNK = 2048         # tokens per program; fixed per V (batch invariance)


@triton.jit
def _row_on(k_ptr, p_ptr, b, vocab, MASS: tl.constexpr):
    if MASS:
        on = tl.load(p_ptr + b) < 1.0
    else:
        k = tl.load(k_ptr + b)
        on = (k > 0) & (k < vocab)
    return on


@triton.jit
def _hist_kernel(x_ptr, hist_ptr, mass_ptr, base_ptr, active_ptr, thr_ptr, cmax_ptr, temp_ptr, k_ptr, p_ptr,
                 kmin_ptr, kmax_ptr, rows, vocab, stride_b, stride_r, nchunks, SHIFT: tl.constexpr,
                 FIRST: tl.constexpr, MASS: tl.constexpr, WRITE_MAX: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, BITS: tl.constexpr, NC_PAD: tl.constexpr, COUNT: tl.constexpr = True,
                 STOP: tl.constexpr = True):
    """hist (counts, int32; for top-p the counts of tokens that top-k keeps) and mass (fp32, top-p)
    [N, C, 2^BITS] of chunk c over [lo, lo + 2^(SHIFT + BITS)); WRITE_MAX: cmax [N, C] = the chunk's max z.
    Column 0 is the whole interval (top-p pass 1: every token, lo being below all keys; its float is a NaN);
    it marks the chunks that still hold tokens inside it. COUNT=False: only cmax is wanted. MASS also writes
    kmin / kmax [N, C]: the smallest / largest order key of the chunk's tokens inside the interval (column 0's
    tokens; int32 max / min when there are none), so the combine kernel can see that only one value is left."""
    pid = tl.program_id(0)
    n = pid // nchunks
    c = pid % nchunks
    b = n // rows
    r = n % rows
    row = x_ptr + b.to(tl.int64) * stride_b + r.to(tl.int64) * stride_r
    ways = tl.arange(0, 1 << BITS)
    on = _row_on(k_ptr, p_ptr, b, vocab, MASS)
    if FIRST:
        lo = tl.full((), _KEY_NEG_INF - MASS, tl.int64)     # top-p: one below every key (mass above it = total)
        run = on | WRITE_MAX
    else:
        lo = tl.load(base_ptr + n)
        run = on & (tl.load(active_ptr + pid) != 0)
    cand = _key_float(lo + (ways.to(tl.int64) << SHIFT))
    f_hi = _key_float(lo + (tl.full((), 1, tl.int64) << (SHIFT + BITS)))
    temp = tl.load(temp_ptr + b)
    scale = tl.where(temp > 0, temp, 1.0)
    cnt = tl.zeros([1 << BITS], tl.int32)
    mass = tl.zeros([1 << BITS], tl.float32)
    kmin = tl.full((), _INT32_MAX, tl.int32)
    kmax = tl.full((), _INT32_MIN, tl.int32)
    if run:
        ar = tl.arange(0, BLOCK)
        if MASS:
            cm = tl.load(cmax_ptr + n * nchunks + tl.arange(0, NC_PAD), mask=tl.arange(0, NC_PAD) < nchunks,
                         other=float("-inf"))
            m = tl.max(cm, axis=0)
            m = tl.where(m == float("-inf"), 0.0, m)
            t_k = tl.load(thr_ptr + n)
            c0 = _key_float(lo)
        zmax = tl.full([BLOCK], float("-inf"), tl.float32)
        for i in range(0, CHUNK, BLOCK):
            offs = c * CHUNK + i + ar
            valid = offs < vocab
            x = tl.load(row + offs, mask=valid, other=float("-inf")).to(tl.float32)
            z = tl.div_rn(x, scale)
            if WRITE_MAX:
                zmax = tl.maximum(zmax, z)
            if MASS:
                below = valid & (z >= t_k) & ~(z > f_hi)                   # kept by top-k, key <= hi
                hit = ((z[None, :] > cand[:, None]) | ((ways == 0) & FIRST)[:, None]) & below[None, :]
                e = tl.where(below, tl.exp(z - m), 0.0)
                mass += tl.sum(tl.where(hit, e[None, :], 0.0), axis=1)
                cnt += tl.sum(hit.to(tl.int32), axis=1)
                if STOP:
                    if FIRST:                                                      # column 0's tokens
                        inside = below
                    else:
                        inside = below & (z > c0)
                    key = _float_key(z)
                    kmin = tl.minimum(kmin, tl.min(tl.where(inside, key, _INT32_MAX), axis=0))
                    kmax = tl.maximum(kmax, tl.max(tl.where(inside, key, _INT32_MIN), axis=0))
            elif COUNT:
                below = valid & (z == z) & ~(z >= f_hi)                    # key < hi (NaN: never counted)
                hit = (z[None, :] >= cand[:, None]) & below[None, :]
                cnt += tl.sum(hit.to(tl.int32), axis=1)
        if WRITE_MAX:
            tl.store(cmax_ptr + pid, tl.max(zmax, axis=0))
    cnt = tl.where(on, cnt, 0)
    slots = pid.to(tl.int64) * (1 << BITS) + ways   # int64: N * C * 2^BITS can pass 2^31
    tl.store(hist_ptr + slots, cnt)
    if MASS:
        tl.store(mass_ptr + slots, tl.where(on, mass, 0.0))
        tl.store(kmin_ptr + pid, kmin)
        tl.store(kmax_ptr + pid, kmax)


@triton.jit
def _combine_kernel(hist_ptr, mass_ptr, base_ptr, above_ptr, total_ptr, active_ptr, thr_ptr, out_ptr, k_ptr, p_ptr,
                    kmin_ptr, kmax_ptr, rows, vocab, nchunks, SHIFT: tl.constexpr, FIRST: tl.constexpr,
                    LAST: tl.constexpr, MASS: tl.constexpr, WRITE_OUT: tl.constexpr, BITS: tl.constexpr,
                    NC_PAD: tl.constexpr, STOP: tl.constexpr = True):
    """Row n: fix the next BITS key bits, update lo / above / active; on LAST write thr [N] (and out [N]).

    Top-p stops early when the interval holds a single key v (bf16 ties: every chunk holding the boundary value
    would otherwise stay active for the remaining passes): the invariants S(lo) >= top_p and S(hi) < top_p make v
    the boundary, so lo becomes v - 1 (what the remaining passes would reach, with the same sums) and every chunk
    goes inactive; later passes then read nothing and keep lo."""
    n = tl.program_id(0)
    b = n // rows
    ways = tl.arange(0, 1 << BITS)
    cs = tl.arange(0, NC_PAD)
    idx = (n.to(tl.int64) * nchunks + cs)[:, None] * (1 << BITS) + ways[None, :]   # int64: can pass 2^31
    cmask = (cs < nchunks)[:, None]
    hist = tl.load(hist_ptr + idx, mask=cmask, other=0)                    # [NC_PAD, 2^BITS] per-chunk counts
    if FIRST:
        lo = tl.full((), _KEY_NEG_INF - MASS, tl.int64)
    else:
        lo = tl.load(base_ptr + n)
    if MASS:
        kmn = tl.min(tl.load(kmin_ptr + n * nchunks + cs, mask=cs < nchunks, other=_INT32_MAX), axis=0)
        kmx = tl.max(tl.load(kmax_ptr + n * nchunks + cs, mask=cs < nchunks, other=_INT32_MIN), axis=0)
        single = kmn == kmx
        part = tl.sum(tl.load(mass_ptr + idx, mask=cmask, other=0.0), axis=0)
        if FIRST:
            above = tl.zeros((), tl.float32)
            total = tl.sum(tl.where(ways == 0, part, 0.0), axis=0)      # j = 0 at pass 1: every token's mass
            tl.store(total_ptr + n, total)
        else:
            above = tl.load(above_ptr + n)
            total = tl.load(total_ptr + n)
        s = above + part                                                 # S(cand_j), j >= 1
        top_p = tl.load(p_ptr + b)
        ok = (tl.div_rn(s, tl.zeros([1 << BITS], tl.float32) + total) >= top_p) | (ways == 0)
    else:
        if FIRST:
            above = tl.zeros((), tl.int32)
        else:
            above = tl.load(above_ptr + n)
        s = above + tl.sum(hist, axis=0)                                 # count(z >= cand_j), j >= 1
        ok = (s >= tl.load(k_ptr + b)) | (ways == 0)
    best = tl.max(tl.where(ok, ways, 0), axis=0)
    nxt = tl.sum(tl.where(ways == best + 1, s, tl.zeros_like(s)), axis=0)
    above_new = tl.where(best + 1 < (1 << BITS), nxt, above)
    lo_new = lo + (best.to(tl.int64) << SHIFT)
    inside = tl.sum(tl.where(ways[None, :] == best, hist, 0), axis=1) \
        - tl.sum(tl.where(ways[None, :] == best + 1, hist, 0), axis=1)   # chunk's tokens in the new interval
    if MASS and STOP:
        lo_new = tl.where(single, kmn.to(tl.int64) - 1, lo_new)
        above_new = tl.where(single, above, above_new)
        inside = tl.where(single, 0, inside)
    lo, above = lo_new, above_new
    tl.store(base_ptr + n, lo)
    tl.store(above_ptr + n, above)
    tl.store(active_ptr + n * nchunks + cs, (inside > 0).to(tl.int8), mask=cs < nchunks)
    if LAST:
        on = _row_on(k_ptr, p_ptr, b, vocab, MASS)
        if MASS:
            t = tl.where(on, _key_float(lo + 1), float("-inf"))
            t = tl.maximum(t, tl.load(thr_ptr + n))
        else:
            t = tl.where(on, _key_float(lo), float("-inf"))
            tl.store(thr_ptr + n, t)
        if WRITE_OUT:
            tl.store(out_ptr + n, t)


def radix_thresholds(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     do_k: bool, do_p: bool, bits: int = BITS, chunk: int = CHUNK, block: int = 1024,
                     num_warps: int = 4, active_counts: list | None = None, stop: bool = True) -> torch.Tensor:
    """thr [B, R] float32 for logits [B, R, V] and per-request temperature / top_p (float32 [B]), top_k (int [B]):
    the same thresholds as :func:`.thresholds.filter_thresholds` (keep z >= thr; -inf where no filter is on).

    ``do_k`` / ``do_p`` (host flags) only skip work. Scratch: O(B * R * C * 2^bits) words, nothing of size V.
    ``chunk`` (tokens per program) and ``block`` are powers of two; the chunk is clamped to V's next power of two,
    so it depends on V only (batch invariance). ``active_counts`` (tests, benchmarks): a list that gets, after each
    pass, how many (row, chunk) programs the next pass reads (one host sync per pass). ``stop=False`` turns the
    top-p single-value stop off (same thresholds, more chunks read)."""
    logits, out, done = prepare_thresholds(logits, do_k, do_p, bits)
    if done:
        return out
    batch, rows, vocab = logits.shape
    chunk = min(chunk, max(16, triton.next_power_of_2(vocab)))
    block = min(block, chunk)
    n, nc = batch * rows, triton.cdiv(vocab, chunk)
    dev = logits.device
    hist = torch.empty(n, nc, 1 << bits, dtype=torch.int32, device=dev)
    mass = torch.empty(n, nc, 1 << bits, dtype=torch.float32, device=dev) if do_p else hist
    base = torch.empty(n, dtype=torch.int64, device=dev)
    above_k = torch.empty(n, dtype=torch.int32, device=dev)
    above_p = torch.empty(n, dtype=torch.float32, device=dev)
    total = torch.empty(n, dtype=torch.float32, device=dev)
    active = torch.empty(n, nc, dtype=torch.int8, device=dev)
    thr = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    cmax = torch.empty(n, nc, dtype=torch.float32, device=dev) if do_p else thr
    kmin = torch.empty(n, nc, dtype=torch.int32, device=dev) if do_p else hist   # top-p's single-value stop
    kmax = torch.empty(n, nc, dtype=torch.int32, device=dev) if do_p else hist
    temp, k, p = temperature.float().contiguous(), top_k.contiguous(), top_p.float().contiguous()
    meta = dict(BITS=bits, NC_PAD=triton.next_power_of_2(nc), STOP=stop)
    passes = 32 // bits
    if do_p and not do_k:   # chunk maxima for exp(z - m): one read of every row
        _hist_kernel[(n * nc,)](logits, hist, mass, base, active, thr, cmax, temp, k, p, kmin, kmax, rows, vocab,
                                logits.stride(0), logits.stride(1), nc, SHIFT=32 - bits, FIRST=True, MASS=False,
                                WRITE_MAX=True, CHUNK=chunk, BLOCK=block, num_warps=num_warps, COUNT=False,
                                **meta)
    for mode, above in ((0, above_k), (1, above_p)):
        if not (do_p if mode else do_k):
            continue
        for i in range(passes):
            shift = 32 - bits * (i + 1)
            _hist_kernel[(n * nc,)](logits, hist, mass, base, active, thr, cmax, temp, k, p, kmin, kmax, rows,
                                    vocab, logits.stride(0), logits.stride(1), nc, SHIFT=shift, FIRST=i == 0,
                                    MASS=bool(mode), WRITE_MAX=bool(i == 0 and not mode and do_p), CHUNK=chunk,
                                    BLOCK=block, num_warps=num_warps, **meta)
            last = i == passes - 1
            _combine_kernel[(n,)](hist, mass, base, above, total, active, thr, out, k, p, kmin, kmax, rows, vocab, nc,
                                  SHIFT=shift, FIRST=i == 0, LAST=last, MASS=bool(mode),
                                  WRITE_OUT=bool(last and (mode or not do_p)), num_warps=4, **meta)
            if active_counts is not None:
                active_counts.append(int(active.sum()))
    return out
