"""Device helpers shared by the verification kernels (Triton ``@jit`` functions, inlined into callers).

Both kernel layouts call the same helpers and differ only in indexing. In the per-request layout a request's
values are scalars and a block of vocabulary ids / chunks / draft positions is 1-D ([N]); in the batched layout
(BB requests per program) a request's values are [BB] vectors or [BB, 1] columns (each helper says which) and
blocks are [BB, N]. Helpers reduce along the LAST axis, so they return one value per request in either layout.
With the same arithmetic, both layouts emit the same tokens (tests/test_kernels.py checks it bit for bit).

Random numbers follow :mod:`tilespec.verify.rng` exactly: the first word of Philox-4x32-10 keyed by the 64-bit
request seed with counter (token, position mod 2^32, purpose, 0), mapped to ((x >> 9) + 0.5) / 2^23.
"""
from __future__ import annotations

import functools

import torch

from . import __name__ as _pkg  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton.jit runs)

import triton
import triton.language as tl

from .. import rng

PURPOSE_ACCEPT = tl.constexpr(rng.PURPOSE_ACCEPT)
PURPOSE_SAMPLE = tl.constexpr(rng.PURPOSE_SAMPLE)
PHILOX_ROUNDS = tl.constexpr(rng.PHILOX_ROUNDS)
BIG = tl.constexpr(2147483647)

# Draft kinds (constexpr switch): no draft distribution (one-hot at the drafted token), logits, probabilities.
DRAFT_NONE = tl.constexpr(0)
DRAFT_LOGITS = tl.constexpr(1)
DRAFT_PROBS = tl.constexpr(2)
# How pass 2 turns a row into log-weights: exact logits (fused), sigmoid approximation, probabilities (tiled).
MODE_LOGITS = tl.constexpr(0)
MODE_SIGMOID = tl.constexpr(1)
MODE_PROBS = tl.constexpr(2)


@triton.jit
def keyed_uniform(seed, position, purpose: tl.constexpr, token):
    """Uniform (0, 1) float32 for int32 tensor ``token`` at int64 ``position`` with int64 ``seed`` (scalars or
    tensors that broadcast to ``token``'s shape)."""
    c0 = token.to(tl.uint32, bitcast=True)
    pos32 = (position & 0xFFFFFFFF).to(tl.uint32)
    c1 = tl.zeros_like(c0) + pos32
    c2 = tl.full(c0.shape, purpose, tl.uint32)
    c3 = tl.zeros_like(c0)
    x, _, _, _ = tl.philox(seed, c0, c1, c2, c3, PHILOX_ROUNDS)
    return ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def exp2_scaled(d, c, FAST: tl.constexpr):
    """exp2(d * c) for fp32 ``d``: with FAST (GPU only) one ``ex2.approx.ftz.f32`` instruction (Triton's exp adds
    ~3 instructions per element to keep subnormal results, which the weights and sums here never need: a result
    below 2^-126 flushes to 0); otherwise ``tl.exp2`` (the CPU interpreter has no inline assembly)."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [d * c], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(d * c)


@triton.jit
def exp_fast(x, FAST: tl.constexpr):
    """exp(x) as :func:`exp2_scaled` (x * log2 e); -inf gives 0."""
    return exp2_scaled(x, 1.4426950408889634, FAST)


@triton.jit
def scaled(ptr, mask, scale, thr, HAS_THR: tl.constexpr):
    """Logits at ``ptr`` upcast to fp32 and divided by the temperature; -inf where ~mask and (with filters) below
    the row's keep threshold ``thr``."""
    return scale_loaded(tl.load(ptr, mask=mask, other=float("-inf")), mask, scale, thr, HAS_THR)


@triton.jit
def multiples_of_8(V, stride_tb, stride_tr, stride_db, stride_dr):
    """V and the four strides rewritten as multiples of 8 (the same values when ``launch._aligned`` holds), so the
    compiler can prove 16-byte alignment and emit vector loads (V and the strides are not specialised)."""
    return V // 8 * 8, stride_tb // 8 * 8, stride_tr // 8 * 8, stride_db // 8 * 8, stride_dr // 8 * 8


@triton.jit
def div_t(x, scale, EXACT: tl.constexpr):
    """x / T. EXACT: the correctly rounded quotient (div.rn), the z that torch and the keep-threshold kernels
    compute, so an id whose z is its row's threshold compares equal to it and stays kept. Otherwise Triton's ``/``
    (div.full, within 2 ulp; fewer instructions), enough where z only feeds exp and max."""
    if EXACT:
        return tl.div_rn(x, scale)
    else:
        return x / scale


@triton.jit
def scale_loaded(x, mask, scale, thr, HAS_THR: tl.constexpr):
    """:func:`scaled` on raw logits already loaded (-inf where ~mask): the same fp32 operations, hence the same bits
    (for kernels that issue a load early and use it later). With filters the division is correctly rounded
    (:func:`div_t`)."""
    z = div_t(x.to(tl.float32), scale, HAS_THR)
    if HAS_THR:
        z = tl.where(z >= thr, z, float("-inf"))
    return tl.where(mask, z, float("-inf"))


@triton.jit
def threshold(thr_ptr, slot, mask, HAS_THR: tl.constexpr):
    """Keep thresholds thr_ptr[slot] where ``mask`` holds (fp32, the shape of ``slot``; 0 elsewhere, and
    everywhere without filters: then thr_ptr is never read)."""
    thr = tl.zeros_like(slot).to(tl.float32)
    if HAS_THR:
        thr = tl.load(thr_ptr + slot, mask=mask, other=0.0)
    return thr


@triton.jit
def log_sigmoid_hat(z, alpha, beta):
    """log of the paper's sigmoid surrogate: 0 prob below alpha, 1 above beta, else sigmoid((z-a)/(b-a))."""
    t = (z - alpha) / (beta - alpha)
    mid = -tl.log(1.0 + tl.exp(-t))
    out = tl.where(z > beta, 0.0, mid)
    return tl.where(z < alpha, float("-inf"), out)


@triton.jit
def first_index(x, value, idx):
    """The smallest ``idx`` along the last axis where ``x`` equals ``value`` (one per row; BIG if none)."""
    return tl.min(tl.where(x == tl.expand_dims(value, -1), idx, BIG), axis=-1)


@triton.jit
def online_max_sumexp(m, s, z):
    """One step of the running (max m, sum s of exp(z - m)) over the last axis of ``z`` (fp32, -inf = masked),
    from (m, s) so far (start: -inf, 0). Returns (new m, new s, max of this z)."""
    m_z = tl.max(z, axis=-1)
    m_new = tl.maximum(m, m_z)
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    s = s * tl.exp(m - safe) + tl.sum(tl.exp(z - tl.expand_dims(safe, -1)), axis=-1)
    return m_new, s, m_z


@triton.jit
def row_lse(m_ptr, s_ptr, slot0, cols, mask):
    """(max, log-sum-exp, chunk maxima) of rows from their pass-1 chunk statistics: maxima m and sums
    s = sum exp(z - m) at m_ptr / s_ptr [slot0 + cols] (``slot0`` one per row, ``mask`` of the block's shape).
    Fully masked chunks hold -inf / 0; a fully masked row gives (-inf, -inf)."""
    slots = tl.expand_dims(slot0, -1) + cols
    mm = tl.load(m_ptr + slots, mask=mask, other=float("-inf"))
    ss = tl.load(s_ptr + slots, mask=mask, other=0.0)
    big_m = tl.max(mm, axis=-1)
    safe = tl.where(big_m == float("-inf"), 0.0, big_m)
    total = tl.sum(tl.where(mm == float("-inf"), 0.0, ss * tl.exp(mm - tl.expand_dims(safe, -1))), axis=-1)
    return big_m, safe + tl.log(total), mm


@triton.jit
def stats_argmax(a_ptr, slot0, mm, big_m, cols, mask):
    """The rows' first argmax from pass 1: the argmax stored for the first chunk whose maximum is the row's
    (``mm`` / ``big_m`` from :func:`row_lse`); -1 where ~mask."""
    return tl.load(a_ptr + slot0 + first_index(mm, big_m, cols), mask=mask, other=-1)


@triton.jit
def tau_at(p, q, x, idx, lenience):
    """``tiled``'s tau = min(1, p(x) / (l q(x))) for a tile of rows p, q with ids ``idx`` that holds the drafted
    token x of each row (-1, i.e. reject, where q(x) = 0). ``x`` / ``lenience``: one per row."""
    hit = idx == tl.expand_dims(x, -1)
    p_x = tl.sum(tl.where(hit, p, 0.0), axis=-1)
    q_x = tl.sum(tl.where(hit, q, 0.0), axis=-1)
    return tl.where(q_x > 0.0, tl.minimum(1.0, p_x / (lenience * q_x)), -1.0)


@triton.jit
def cdf_pick(w, idx, target, start):
    """Inverse-CDF step along the last axis: the first ``idx`` whose running sum of weights ``w`` (>= 0, fp32)
    exceeds ``target``; if rounding leaves none, the last ``idx`` with w > 0; never below ``start`` (rows without
    weight). ``target`` / ``start``: one per row."""
    cum = tl.cumsum(w, axis=-1)
    first = tl.min(tl.where(cum > tl.expand_dims(target, -1), idx, BIG), axis=-1)
    last = tl.max(tl.where(w > 0.0, idx, -1), axis=-1)
    return tl.maximum(tl.minimum(first, last), start)


@triton.jit
def cdf_tile(mass, tiles, u):
    """First level of the inverse-CDF draw over per-tile masses ``mass`` (tile index ``tiles``, 0-based, last axis):
    target = u * total (total = the running sum's last value), the tile holding it, and the part of the target
    left for that tile (target minus the running sum before it; fp32, the order of :func:`rng.inverse_cdf`)."""
    cum = tl.cumsum(mass, axis=-1)
    total = tl.max(cum, axis=-1)
    target = u * total
    tile = cdf_pick(mass, tiles, target, 0)
    before = tl.sum(tl.where(tiles == tl.expand_dims(tile - 1, -1), cum, 0.0), axis=-1)
    return tile, target - before


@triton.jit
def write_outputs(tok_ptr, out_ptr, nacc_ptr, nemit_ptr, accd_ptr, req, live, n, token, K, WB: tl.constexpr):
    """Outputs of requests ``req`` where ``live`` (one value each: scalars or [BB]): n accepted drafts, then
    ``token``, then -1 in out [B, K+1]; accepted [B, K] = (j < n); nacc = n, nemit = n + 1."""
    nn = tl.expand_dims(n, -1)
    row = tl.expand_dims(req, -1)
    ok = tl.expand_dims(live.to(tl.int32), -1) != 0   # (the interpreter expands a scalar bool to int32)
    for j0 in range(0, K + 1, WB):
        j = j0 + tl.arange(0, WB)
        d = tl.load(tok_ptr + row * K + j, mask=ok & (j < nn) & (j < K), other=0)
        val = tl.where(j < nn, d, tl.where(j == nn, tl.expand_dims(token, -1), -1))
        tl.store(out_ptr + row * (K + 1) + j, val.to(tl.int64), mask=ok & (j < K + 1))
        tl.store(accd_ptr + row * K + j, j < nn, mask=ok & (j < K))
    tl.store(nacc_ptr + req, n.to(tl.int64), mask=live)
    tl.store(nemit_ptr + req, n.to(tl.int64) + 1, mask=live)


@functools.lru_cache(maxsize=None)
def pdl_capable(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched as programmatic dependents (compute capability >= 9 and a
    Triton with ``launch_pdl`` and ``gdc_wait``)."""
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        import triton.language.extra.cuda as tl_cuda
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and hasattr(tl_cuda, "gdc_wait")
