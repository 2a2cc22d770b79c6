"""Counter-based random numbers shared by every tilespec sampler (PyTorch here, Triton kernels bit-for-bit alike).

A random number is a pure function of (seed, position, purpose, token): Philox-4x32-10 with key = the 64-bit
request seed and counter = (token, position mod 2^32, purpose, 0); the first 32-bit output word is used. This is the
same function as Triton's ``tl.philox(seed, token, position, purpose, 0)``, so a kernel and the PyTorch reference
draw identical numbers. Keying by request seed and absolute position makes results independent of batch order and
composition, reproducible, and free of generator state (safe under CUDA-graph capture).

Sampling a token (:func:`inverse_cdf`) takes ONE uniform per (request, position): the first vocabulary id whose
running sum of weights exceeds u * total, summed tile by tile (SAMPLE_TILE ids) so that a kernel can find the tile
from per-tile masses and then scan one tile only.
"""
from __future__ import annotations

import numbers

import torch

PURPOSE_ACCEPT = 1   # the uniform u of the acceptance test at a draft position (token = 0)
PURPOSE_SAMPLE = 2   # the uniform of the inverse-CDF draw of the residual / bonus token at a position (token = 0)
PURPOSE_EXTRA = 3    # free for methods that need further streams (token = their own index)

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_ROUNDS = 10
SAMPLE_TILE = 1024   # ids per tile of the inverse-CDF scan (the kernels' pass-2 tile)
_BIG = 2**31 - 1


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """32x32 -> 64 bit product of a constant and a uint32-valued int64 tensor, as (hi, lo).

    The product may exceed 2^63; int64 multiplication wraps modulo 2^64 (two's complement) on every torch backend,
    which keeps all 64 bits of the unsigned product, so masking recovers both halves exactly.
    """
    prod = b * a
    return (prod >> 32) & _MASK32, prod & _MASK32


def _word(x, device: torch.device) -> torch.Tensor:
    """A counter word as int64 on ``device`` (a Python int becomes a fill, never a host-to-device copy, so the
    generator can be captured in a CUDA graph)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.int64) & _MASK32
    return torch.full((), int(x) & _MASK32, dtype=torch.int64, device=device)


def philox_uint32(seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: int | torch.Tensor,
                  c3: int | torch.Tensor = 0) -> torch.Tensor:
    """First output word of Philox-4x32-10 as an int64 tensor holding values in [0, 2^32).

    All arguments broadcast together; seed is an int64 tensor (its 64 bits are the key), counters are
    non-negative integers below 2^32 (higher bits are dropped).
    """
    seed = torch.as_tensor(seed, dtype=torch.int64)
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    c0, c1, c2, c3 = (_word(c, seed.device) for c in (c0, c1, c2, c3))
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(c0, c1, c2, c3, k0, k1)
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0


def uniform_from_uint32(x: torch.Tensor) -> torch.Tensor:
    """Map uint32 values (in int64) to float32 uniforms in the open interval (0, 1): ((x >> 9) + 0.5) / 2^23."""
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def uniform(seed: torch.Tensor, position: torch.Tensor, purpose: int, token: torch.Tensor | int = 0) -> torch.Tensor:
    """Uniform (0, 1) float32 keyed by (seed, position, purpose, token); arguments broadcast."""
    return uniform_from_uint32(philox_uint32(seed, token, position, purpose))


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor, tile: int = SAMPLE_TILE) -> torch.Tensor:
    """One draw per row from norm(weights) [N, V] (fp32, >= 0) with uniforms u [N]: the inverse CDF in vocabulary
    order, evaluated in two levels as the kernels do it (fp32 throughout).

    mass[t] = sum of the weights in tile t (ids t*tile .. t*tile+tile-1); cum = running sum of mass; target = u *
    cum[-1]; tile t* = the first t with cum[t] > target; inside it, the first id whose running sum of weights
    exceeds target - cum[t*-1]. Where rounding leaves no such tile / id, the last one with positive weight is
    taken, so an id of weight 0 is never drawn (a row of zeros gives id 0). Differences in fp32 summation order
    between implementations can move a draw only when u lands within rounding error of a boundary.
    Returns int64 [N].
    """
    n, vocab = weights.shape
    tile = min(tile, vocab) or 1    # one tile holds a short row whole (no padding: the same two-level law)
    n_tiles = -(-vocab // tile)
    w = torch.nn.functional.pad(weights.float(), (0, n_tiles * tile - vocab)).view(n, n_tiles, tile)
    mass = w.sum(dim=-1)
    cum = torch.cumsum(mass, dim=-1)
    target = u.float() * cum[:, -1]
    t = _cdf_pick(mass, cum, target)
    before = torch.where(t > 0, cum.gather(1, (t - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(target))
    inside = w.gather(1, t.view(n, 1, 1).expand(n, 1, tile))[:, 0]
    j = _cdf_pick(inside, torch.cumsum(inside, dim=-1), target - before)
    return t * tile + j


def _cdf_pick(w: torch.Tensor, cum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[N, M] weights and their running sums, [N] targets -> [N] int64: first index with cum > target, else the
    last index with w > 0, else 0."""
    idx = torch.arange(w.shape[-1], device=w.device)
    first = torch.where(cum > target[:, None], idx, _BIG).amin(dim=-1)
    last = torch.where(w > 0, idx, -1).amax(dim=-1)
    return torch.minimum(first, last).clamp(min=0)


def gumbel(seed: torch.Tensor, position: torch.Tensor, purpose: int, token: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log u) keyed like :func:`uniform`; argmax(logp + gumbel) samples from exp(logp)."""
    return -torch.log(-torch.log(uniform(seed, position, purpose, token)))


def seeds_from(seed, batch_size: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Per-request int64 seeds [B] from an int (seed + request index), a sequence/tensor [B], or random draws.

    With seed None the seeds are drawn from ``generator`` (or torch's default generator of the device), which
    keeps the call reproducible under torch.manual_seed and needs no host sync.
    """
    if seed is None:
        gen_device = generator.device if generator is not None else device
        draws = torch.randint(0, 2**62, (batch_size,), generator=generator, device=gen_device, dtype=torch.int64)
        return draws.to(device, non_blocking=True)
    if isinstance(seed, int):
        return seed + torch.arange(batch_size, device=device, dtype=torch.int64)
    return torch.as_tensor(seed, dtype=torch.int64).to(device)


def normalize_seed(seed):
    """``seed`` as verify() documents it: None, a Python int (numpy and 0-d torch integer scalars become that int),
    or per-request integers (a sequence or an integer tensor [B]). Bools and other types raise TypeError, since
    ``True`` silently meaning 1 hides a bug."""
    if seed is None:
        return None
    if isinstance(seed, torch.Tensor):
        if seed.is_meta:
            raise ValueError("seed is on the meta device (it holds no values): pass an int or a real tensor")
        if seed.dtype == torch.bool or seed.is_floating_point() or seed.is_complex():
            raise TypeError(f"seed must be an int or integers (one per request), got a {seed.dtype} tensor: "
                            f"pass int(seed) or an integer tensor")
        return int(seed) if seed.ndim == 0 else seed
    if type(seed).__name__ in ("bool", "bool_") or (
            isinstance(seed, (numbers.Number, str, bytes)) and not isinstance(seed, numbers.Integral)):
        raise TypeError(f"seed must be an int or integers (one per request), got {seed!r:.40} "
                        f"({type(seed).__name__}){': pass int(seed)' if isinstance(seed, float) else ''}")
    if isinstance(seed, numbers.Integral):
        return int(seed)
    if isinstance(seed, (list, tuple)) or hasattr(seed, "__array__"):
        values = list(seed.tolist() if hasattr(seed, "tolist") else seed)
        odd = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
        if odd:
            raise TypeError(f"seed must be an int or integers (one per request), got {odd[0]!r} "
                            f"({type(odd[0]).__name__}) in the per-request seeds")
        return [int(v) for v in values]
    raise TypeError(f"seed must be an int or integers (one per request), got {seed!r:.40} ({type(seed).__name__})")
