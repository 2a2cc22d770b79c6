"""Triton kernel for the top-k / top-p keep thresholds (definitions in :mod:`tilespec.verify.filters`).

One program per row of logits [B, R, V] (raw, any float dtype; z = fp32(logit) / T computed on the fly with a
correctly rounded division, so z is bit-identical to ``logits.float() / T`` in PyTorch, T = 1 for greedy rows).
The row is re-read on every pass (from L2 when it fits) and nothing of size V is written.

Both thresholds are vocabulary values found by a 2^BITS-way search over the order-preserving int32 key of the
fp32 value: each pass evaluates the candidates base + j * 2^s (j = 1 .. 2^BITS - 1) at once and fixes BITS bits of
the key, so 32 / BITS passes (16 at the default BITS = 2, 4-way) cover all 2^32 keys exactly (fixed trip counts,
no host sync: safe in CUDA-graph capture).

* top-k (rows with 0 < k < V): base starts at key(-inf), where count(z >= .) = V >= k; each pass keeps the largest
  candidate with count(z >= c) >= k. t_k = float(base): the k-th largest z. Integer counts: exact.
* top-p (rows with top_p < 1): one pass for m = max z, then base starts below every key (S = 1 there) and each pass
  keeps the largest candidate with S(c) / total >= top_p, S(c) = sum of exp(z - m) over kept-by-top-k tokens with
  z > c, total = the same sum over all of them (accumulated in the first search pass). t_p = float(base + 1).
  fp32 sums in block order: the kept set equals the reference's unless some S(z_x) is within rounding of top_p.

Output: thr [B, R] float32 = max(t_k, t_p) (-inf where neither filter is on); the filters keep z >= thr.
"""
from __future__ import annotations

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import torch
import triton
import triton.language as tl

from ..order_keys import KEY_NAN, KEY_NEG_INF

# Key bits fixed per pass (2^BITS candidates incl. the current base, 32 / BITS passes per threshold); fewer bits
# mean more passes over the row but fewer compares per element.
BITS = 2
_KEY_NEG_INF = tl.constexpr(KEY_NEG_INF)
_KEY_NAN = tl.constexpr(KEY_NAN)


@triton.jit
def _key_float(key):
    """int64 order keys -> float32 (keys above key(+inf) give NaN)."""
    k = tl.minimum(key, _KEY_NAN).to(tl.int32)
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _float_key(x):
    """float32 -> int32 order key (the inverse of :func:`_key_float`; -0.0 and +0.0 get different keys)."""
    xi = x.to(tl.int32, bitcast=True)
    return xi ^ ((xi >> 31) & 0x7FFFFFFF)


@triton.jit
def _load_z(row, offs, vocab, scale):
    x = tl.load(row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    return tl.div_rn(x, scale)


@triton.jit
def min_p_threshold(m, mp):
    """The smallest fp32 z with fl(z - m) >= fl(log(mp)): min-p's keep set {log p(x) - max log p >= log min_p}
    = {z - m >= log min_p} (the normaliser cancels), by bisection over fp32 order keys (-inf fails, m holds)."""
    lmp = tl.log(mp)
    lo = tl.full((), _KEY_NEG_INF, tl.int64)
    hi = _float_key(m).to(tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        ok = (_key_float(mid) - m) >= lmp
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid)
    return tl.where((mp > 0.0) & (m > float("-inf")), _key_float(hi), float("-inf"))


@triton.jit
def top_p_search(row, vocab, scale, top_p, thr_k, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """t_p of one row (pointer ``row``, ``vocab`` ids, z = logit / scale) over the ids with z >= thr_k: one pass for
    the max, then 32 / BITS passes of the 2^BITS-way key search (see the module docstring)."""
    ar = tl.arange(0, BLOCK)
    ways = tl.arange(0, 1 << BITS).to(tl.int64)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        m = tl.maximum(m, _load_z(row, start + ar, vocab, scale))
    m_row = tl.max(m, axis=0)
    m_row = tl.where(m_row == float("-inf"), 0.0, m_row)
    base = tl.full((), _KEY_NEG_INF - 1, tl.int64)
    total = tl.zeros((), tl.float32)
    for p in tl.static_range(32 // BITS):
        cand = _key_float(base + (ways << (32 - BITS * (p + 1))))
        mass = tl.zeros([1 << BITS], tl.float32)
        tot = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + ar
            z = _load_z(row, offs, vocab, scale)
            e = tl.where((offs < vocab) & (z >= thr_k), tl.exp(z - m_row), 0.0)
            mass += tl.sum(tl.where(z[None, :] > cand[:, None], e[None, :], 0.0), axis=1)
            if p == 0:
                tot += e
        if p == 0:
            total = tl.sum(tot, axis=0)
        ok = tl.div_rn(mass, tl.zeros([1 << BITS], tl.float32) + total) >= top_p
        best = tl.max(tl.where(ok, ways, 0), axis=0)
        base = base + (best << (32 - BITS * (p + 1)))
    return _key_float(base + 1)


@triton.jit
def _thresholds_kernel(x_ptr, out_ptr, temp_ptr, k_ptr, p_ptr, rows, vocab, stride_b, stride_r,
                       DO_K: tl.constexpr, DO_P: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // rows
    r = pid % rows
    row = x_ptr + b.to(tl.int64) * stride_b + r.to(tl.int64) * stride_r
    temp = tl.load(temp_ptr + b)
    scale = tl.where(temp > 0, temp, 1.0)
    ar = tl.arange(0, BLOCK)
    ways = tl.arange(0, 1 << BITS).to(tl.int64)
    thr = tl.full((), float("-inf"), tl.float32)
    if DO_K:
        k = tl.load(k_ptr + b)
        if (k > 0) & (k < vocab):
            base = tl.full((), _KEY_NEG_INF, tl.int64)
            for p in tl.static_range(32 // BITS):
                cand = _key_float(base + (ways << (32 - BITS * (p + 1))))
                cnt = tl.zeros([1 << BITS], tl.int32)
                for start in range(0, vocab, BLOCK):
                    offs = start + ar
                    z = _load_z(row, offs, vocab, scale)
                    hit = (z[None, :] >= cand[:, None]) & (offs < vocab)[None, :]
                    cnt += tl.sum(hit.to(tl.int32), axis=1)
                best = tl.max(tl.where(cnt >= k, ways, 0), axis=0)
                base = base + (best << (32 - BITS * (p + 1)))
            thr = _key_float(base)
    if DO_P:
        top_p = tl.load(p_ptr + b)
        if top_p < 1.0:
            thr = tl.maximum(thr, top_p_search(row, vocab, scale, top_p, thr, BLOCK, BITS))
    tl.store(out_ptr + pid, thr)


def prepare_thresholds(logits: torch.Tensor, do_k: bool, do_p: bool, bits: int) -> tuple:
    """Shared by both threshold kernels: (logits with unit stride in V, out [B, R] float32, done). ``done``: ``out``
    is already the answer (an empty batch, or -inf when neither filter is on). Rejects a bad ``bits``."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, rows, _ = logits.shape
    out = torch.empty(batch, rows, dtype=torch.float32, device=logits.device)
    if batch * rows == 0:
        return logits, out, True
    if not (do_k or do_p):
        return logits, out.fill_(float("-inf")), True
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    return logits, out, False


def filter_thresholds(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      do_k: bool, do_p: bool, block: int = 2048, num_warps: int = 8, bits: int = BITS
                      ) -> torch.Tensor:
    """thr [B, R] float32 for logits [B, R, V] and per-request temperature / top_p (float32 [B]), top_k (int [B]).

    ``do_k`` / ``do_p`` (host flags, e.g. ResolvedSampling.has_top_k / has_top_p) only skip work; rows whose k is
    0 or >= V, or whose top_p >= 1, get no such filter either way. No host sync, no allocation of size V."""
    logits, out, done = prepare_thresholds(logits, do_k, do_p, bits)
    if done:
        return out
    batch, rows, vocab = logits.shape
    block = min(block, max(16, triton.next_power_of_2(vocab)))
    _thresholds_kernel[(batch * rows,)](
        logits, out, temperature.float().contiguous(), top_k.contiguous(), top_p.float().contiguous(), rows, vocab,
        logits.stride(0), logits.stride(1), DO_K=bool(do_k), DO_P=bool(do_p), BLOCK=block, BITS=bits,
        num_warps=num_warps)
    return out
