"""Input checks and preparation for :func:`tilespec.verify`: clear errors instead of crashes inside kernels.

Shape, dtype and device checks are free (no device work). Value checks (NaN/Inf logits, token ids, per-request
draft lengths, tensor-valued sampling parameters) read the inputs once and synchronise with the device; callers
that hand over trusted inputs in a hot loop pass ``check_values=False``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .rng import normalize_seed, seeds_from  # noqa: F401  (normalize_seed: verify() imports it here)
from .types import PerRequest, ResolvedSampling, SamplingParams, VerifyInputs

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _require_tensor(name: str, value, *, ndim: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_meta:
        raise ValueError(f"{name} is on the meta device (a shape without values, e.g. from a model that was never "
                         f"loaded): move real data to a CPU or CUDA device first")
    if value.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    return value


def _require_float(name: str, value: torch.Tensor) -> None:
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {value.dtype}")


def _check_finite_logits(name: str, logits: torch.Tensor, rows_valid: Optional[torch.Tensor]) -> None:
    """NaN and +inf in used rows are errors; -inf (a masked token) is fine unless a whole used row is masked.
    Padding rows (rows_valid False) are never read by a method, so they may hold anything."""
    used = rows_valid[..., None] if rows_valid is not None else True
    if (torch.isnan(logits) & used).any():
        raise ValueError(f"{name} contains NaN")
    if (torch.isposinf(logits) & used).any():
        raise ValueError(f"{name} contains +inf")
    all_masked = torch.isneginf(logits).all(dim=-1)
    if rows_valid is not None:
        all_masked = all_masked & rows_valid
    if all_masked.any():
        b, r = (int(i) for i in all_masked.nonzero()[0])
        raise ValueError(f"{name}[{b}, {r}] is -inf everywhere: no token can be sampled from it")


def draft_probs_tolerance(dtype: torch.dtype) -> float:
    """How far a used draft_probs row's sum may be from 1: 1e-3, or one unit of rounding for bf16 (whose softmax
    rows are off by up to ~3e-3 after the cast)."""
    return max(1e-3, torch.finfo(dtype).eps)


def _check_draft_probs(draft_probs: torch.Tensor, valid: torch.Tensor) -> None:
    """Used rows must be finite, non-negative and sum to 1 within :func:`draft_probs_tolerance`. Rows are taken as
    given (never renormalised), so every method sees the same q; a row off by more than the tolerance would
    silently change the output law, hence an error. Padding rows (valid False) are not read."""
    if not torch.isfinite(draft_probs).all() or (draft_probs < 0).any():
        raise ValueError("draft_probs must be finite and non-negative")
    sums = draft_probs.sum(-1, dtype=torch.float32)
    if ((sums <= 0) & valid).any():
        raise ValueError("draft_probs has a used row with zero mass: pass the distribution the draft tokens were "
                         "sampled from")
    tol = draft_probs_tolerance(draft_probs.dtype)
    off = ((sums - 1).abs() > tol) & valid
    if off.any():
        b, i = (int(v) for v in off.nonzero()[0])
        raise ValueError(f"draft_probs[{b}, {i}] sums to {float(sums[b, i]):.6g}, not 1 (tolerance {tol:.3g}): "
                         f"pass normalised probabilities, e.g. probs / probs.sum(-1, keepdim=True), or pass "
                         f"draft_logits instead")


INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def _check_int64(name: str, value, spread: int) -> None:
    """Python-int seeds / offsets (or sequences of them) must fit int64, including ``value + spread`` (an int seed
    gives request b the seed + b). Tensors are already int64 or converted by torch."""
    if isinstance(value, int):
        values = [value]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        values, spread = list(value), 0
    else:
        return
    bad = [v for v in values if not INT64_MIN <= v <= INT64_MAX - spread]
    if bad:
        raise ValueError(f"{name} = {bad[0]} does not fit a signed 64-bit integer"
                         f"{f' (request b uses {name} + b, up to + {spread})' if spread else ''}: "
                         f"use values in [-2**63, 2**63 - {1 + spread}], e.g. {name} % 2**62")


def check_shared_stream_seed(method: str, seed, check_values: bool) -> None:
    """A method that draws the whole batch from one generator (``hf``) cannot honour per-request seeds: reject a
    per-request seed list/tensor with different values instead of silently ignoring it. Tensors are read only when
    ``check_values`` (one host sync)."""
    if seed is None or isinstance(seed, int):
        return
    if isinstance(seed, torch.Tensor):
        if not check_values:
            return
        distinct = int(torch.unique(seed).numel())
    else:
        distinct = len({int(s) for s in seed})
    if distinct > 1:
        raise ValueError(f"method {method!r} draws every request from one generator, so it cannot honour "
                         f"{distinct} different per-request seeds (its tokens depend on the batch); pass one int "
                         f"seed, or use method 'reference', 'tiled' or 'fused' for per-request seeds")


# ---------------------------------------------------------------------------------------------- constant tensors
# Tensors that are pure functions of Python values (a scalar broadcast to [B], K_max per request, zero offsets, int
# seeds) are made once per (device, value, B) and reused: every torch.full / arange is a kernel launch and ~5-10 us
# of host time per call, which dominated verify()'s cost in decode loops. Entries are never evicted (a CUDA graph
# captured with one of them holds its address; the cache stops growing at CONST_LIMIT entries and further values
# are built per call instead), never created during a CUDA-graph capture (the fill would only run on replay), and
# must never be modified in place (methods and callers only read them).
CONST_LIMIT = 4096
_CONSTS: dict = {}


def _device_key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _cacheable(device: torch.device) -> bool:
    return len(_CONSTS) < CONST_LIMIT and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _const(key: tuple, make) -> torch.Tensor:
    """The cached tensor for ``key`` (whose first element is its device), made by ``make()`` on a miss."""
    tensor = _CONSTS.get(key)
    if tensor is None:
        tensor = make()
        if _cacheable(key[0]):
            _CONSTS[key] = tensor
    return tensor


def const_full(device: torch.device, batch: int, value, dtype: torch.dtype) -> torch.Tensor:
    """[batch] filled with ``value`` (a Python number), cached. Read-only."""
    return _const((device, "full", batch, value, type(value), dtype),
                  lambda: torch.full((batch,), value, device=device, dtype=dtype))


def _const_values(device: torch.device, values: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A [len(values)] tensor of Python numbers, cached (torch.tensor would be a synchronous copy every call)."""
    return _const((device, "values", values, tuple(type(v) for v in values), dtype),
                  lambda: torch.tensor(values, device=device, dtype=dtype))


def _const_positions(device: torch.device, n: int) -> torch.Tensor:
    """[1, n] = arange(n)[None, :], cached."""
    return _const((device, "positions", n), lambda: torch.arange(n, device=device)[None, :])


def _const_seeds(device: torch.device, batch: int, seed: int) -> torch.Tensor:
    return _const((device, "seeds", batch, seed),
                  lambda: seeds_from(seed, batch, device))


def _ready(value, dtype: torch.dtype, device: torch.device) -> bool:
    """A tensor that can be used as given (right dtype and device: no conversion op)."""
    return isinstance(value, torch.Tensor) and value.dtype == dtype and value.device == device


def _per_request(name: str, value: PerRequest, batch: int, device, dtype) -> tuple[torch.Tensor, Optional[list]]:
    """Broadcast a scalar / sequence / tensor to [B]; also return the Python values when known without a sync.
    Tensors are used as given (converted only when their device or dtype differs); Python values come from the
    constant cache."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            value = value.reshape(1).expand(batch)
        if value.shape != (batch,):
            raise ValueError(f"sampling.{name} must be a scalar or have shape [{batch}], got {tuple(value.shape)}")
        return value.to(device=device, dtype=dtype), None
    if isinstance(value, (int, float)):
        return const_full(device, batch, value, dtype), [value]
    else:
        values = list(value)
        if len(values) != batch:
            raise ValueError(f"sampling.{name} has {len(values)} entries for a batch of {batch}")
    if all(isinstance(v, (int, float)) for v in values):
        return _const_values(device, tuple(values), dtype), values
    return torch.tensor(values, device=device, dtype=dtype), values


def _check_range(name: str, values: Optional[list], tensor: torch.Tensor, ok, rule: str, check_values: bool):
    if values is not None:
        bad = [v for v in set(values) if not ok(float(v))]
        if bad:
            raise ValueError(f"sampling.{name} must be {rule}, got {bad[0]}")
    elif check_values and not bool(ok(tensor.double()).all()):
        raise ValueError(f"sampling.{name} must be {rule}")


_RESOLVED: dict = {}


def _python_key(value):
    """A hashable key for a Python-valued sampling field (number or sequence of numbers); None for tensors etc."""
    if isinstance(value, (int, float)):
        return (type(value), value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return tuple((type(v), v) for v in value)
    return None


def resolve_sampling(sampling: SamplingParams, batch: int, device, check_values: bool = True) -> ResolvedSampling:
    """Validate SamplingParams and broadcast them to per-request tensors [B] on ``device``.

    When every field is a Python number or sequence the result is cached per (device, B, values) - the checks then
    ran on the first call - and its tensors are shared, read-only constants. Tensor fields are used as given (no
    caching; converted only when their device or dtype differs)."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    device = _device_key(device)
    key = (device, batch, _python_key(sampling.temperature), _python_key(sampling.top_k),
           _python_key(sampling.top_p), _python_key(sampling.min_p), _python_key(sampling.lenience))
    if None in key:
        return _resolve_sampling(sampling, batch, device, check_values)
    resolved = _RESOLVED.get(key)
    if resolved is None:
        resolved = _resolve_sampling(sampling, batch, device, check_values)
        if len(_RESOLVED) < CONST_LIMIT and _cacheable(device):
            _RESOLVED[key] = resolved
    return resolved


def _resolve_sampling(sampling: SamplingParams, batch: int, device, check_values: bool) -> ResolvedSampling:
    temp, temp_v = _per_request("temperature", sampling.temperature, batch, device, torch.float32)
    top_k, top_k_v = _per_request("top_k", sampling.top_k, batch, device, torch.int64)
    top_p, top_p_v = _per_request("top_p", sampling.top_p, batch, device, torch.float32)
    min_p, min_p_v = _per_request("min_p", sampling.min_p, batch, device, torch.float32)
    len_, len_v = _per_request("lenience", sampling.lenience, batch, device, torch.float32)
    _check_range("temperature", temp_v, temp, lambda t: (t >= 0) & (t < float("inf")), "a finite number >= 0",
                 check_values)
    _check_range("top_k", top_k_v, top_k, lambda t: t >= 0, "an integer >= 0", check_values)
    if top_k_v is not None and any(float(v) != int(v) for v in top_k_v):
        raise ValueError("sampling.top_k must be an integer")
    _check_range("top_p", top_p_v, top_p, lambda t: (t > 0) & (t <= 1), "in (0, 1]", check_values)
    _check_range("min_p", min_p_v, min_p, lambda t: (t >= 0) & (t <= 1), "in [0, 1]", check_values)
    _check_range("lenience", len_v, len_, lambda t: (t > 0) & (t <= 1), "in (0, 1]", check_values)

    def known(values, test):  # a flag is exact when values are Python numbers, conservatively True otherwise
        return True if values is None else any(test(v) for v in set(values))

    return ResolvedSampling(
        temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, lenience=len_,
        any_greedy=known(temp_v, lambda v: v == 0),
        all_greedy=False if temp_v is None else all(v == 0 for v in temp_v),
        has_top_k=known(top_k_v, lambda v: v > 0), has_top_p=known(top_p_v, lambda v: v < 1),
        has_min_p=known(min_p_v, lambda v: v > 0), has_lenience=known(len_v, lambda v: v < 1),
        top_k_range=None if top_k_v is None else (int(min(top_k_v)), int(max(top_k_v))))


def prepare_inputs(target_logits, draft_tokens, *, draft_logits=None, draft_probs=None, num_draft_tokens=None,
                   sampling: SamplingParams = SamplingParams(), seed=None, generator=None, offsets=None,
                   check_values: bool = True) -> VerifyInputs:
    """Validate every argument of :func:`tilespec.verify` and return the prepared :class:`VerifyInputs`."""
    target_logits = _require_tensor("target_logits", target_logits, ndim=3)
    _require_float("target_logits", target_logits)
    batch, rows, vocab = target_logits.shape
    if batch == 0:
        raise ValueError("empty batch: target_logits has B = 0 requests")
    if rows == 0 or vocab == 0:
        raise ValueError(f"target_logits must have shape [B, K+1, V] with K+1 >= 1 and V >= 1, "
                         f"got {tuple(target_logits.shape)}")
    device = target_logits.device
    draft_tokens = _require_tensor("draft_tokens", draft_tokens, ndim=2)
    if draft_tokens.dtype.is_floating_point or draft_tokens.dtype == torch.bool:
        raise TypeError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    k_max = rows - 1
    if tuple(draft_tokens.shape) != (batch, k_max):
        raise ValueError(f"draft_tokens must have shape [B, K] = [{batch}, {k_max}] to match target_logits "
                         f"[B, K+1, V] = {tuple(target_logits.shape)}, got {tuple(draft_tokens.shape)}")
    if draft_tokens.device != device:
        raise ValueError(f"draft_tokens is on {draft_tokens.device} but target_logits on {device}")
    if draft_logits is not None and draft_probs is not None:
        raise ValueError("pass draft_logits or draft_probs, not both")
    for name, draft in (("draft_logits", draft_logits), ("draft_probs", draft_probs)):
        if draft is None:
            continue
        _require_tensor(name, draft, ndim=3)
        _require_float(name, draft)
        if draft.shape[2] != vocab:
            raise ValueError(f"vocabulary mismatch: target_logits has V = {vocab}, {name} has V = {draft.shape[2]}")
        if tuple(draft.shape[:2]) != (batch, k_max):
            raise ValueError(f"{name} must have shape [B, K, V] = [{batch}, {k_max}, {vocab}], "
                             f"got {tuple(draft.shape)}")
        if draft.device != device:
            raise ValueError(f"{name} is on {draft.device} but target_logits on {device}")

    ragged = num_draft_tokens is not None
    if num_draft_tokens is None:
        num_draft = const_full(device, batch, k_max, torch.int64)
    else:
        # lists / numpy arrays go through as_tensor without a dtype so 1.5 or True are rejected, not truncated
        raw = num_draft_tokens if isinstance(num_draft_tokens, torch.Tensor) else torch.as_tensor(num_draft_tokens)
        if raw.dtype.is_floating_point or raw.dtype.is_complex or raw.dtype == torch.bool:
            raise TypeError(f"num_draft_tokens must hold integers, got {raw.dtype}")
        num_draft = raw.to(device=device, dtype=torch.int64)
        if tuple(num_draft.shape) != (batch,):
            raise ValueError(f"num_draft_tokens must have shape [{batch}], got {tuple(num_draft.shape)}")
        if check_values or not isinstance(num_draft_tokens, torch.Tensor):
            low, high = int(num_draft.min()), int(num_draft.max())
            if low < 0 or high > k_max:
                raise ValueError(f"num_draft_tokens must lie in [0, K_max = {k_max}], got values in [{low}, {high}]")

    # padding positions (i >= K_b) must hold ids in [0, V) for methods that gather there; only a ragged batch has
    # padding, so the full-length common case needs no mask at all
    valid = _const_positions(device, k_max) < num_draft[:, None] if check_values else None
    if check_values:
        if k_max > 0:
            bad = valid & ((draft_tokens < 0) | (draft_tokens >= vocab))
            if bad.any():
                b, i = (int(v) for v in bad.nonzero()[0])
                value = int(draft_tokens[b, i])
                fix = (f"; for a shorter draft pass num_draft_tokens (request {b} drafted K_b tokens => "
                       f"num_draft_tokens[{b}] = K_b); positions past K_b are padding and may hold any value, "
                       f"e.g. -1" if value < 0 else
                       f"; ids must index the target's vocabulary (target_logits.shape[-1] = {vocab})")
                raise ValueError(f"draft_tokens[{b}, {i}] = {value} is out of range [0, {vocab}){fix}")
        rows_valid = torch.arange(rows, device=device)[None, :] <= num_draft[:, None]
        _check_finite_logits("target_logits", target_logits, rows_valid)
        if draft_logits is not None:
            _check_finite_logits("draft_logits", draft_logits, valid)
        if draft_probs is not None:
            _check_draft_probs(draft_probs, valid)
    if draft_tokens.dtype != torch.int64:
        draft_tokens = draft_tokens.long()
    if ragged and k_max > 0:
        draft_tokens = draft_tokens.masked_fill(_const_positions(device, k_max) >= num_draft[:, None], 0)

    _check_int64("offsets", offsets, 0)
    _check_int64("seed", seed, batch - 1)
    if offsets is None:
        offsets_t = const_full(device, batch, 0, torch.int64)
    elif isinstance(offsets, int):
        offsets_t = torch.full((batch,), offsets, device=device, dtype=torch.int64)
    else:
        offsets_t = (offsets if _ready(offsets, torch.int64, device)
                     else torch.as_tensor(offsets, dtype=torch.int64).to(device))
        if tuple(offsets_t.shape) != (batch,):
            raise ValueError(f"offsets must be an int or have shape [{batch}], got {tuple(offsets_t.shape)}")
    if seed is not None and not isinstance(seed, int):
        if isinstance(seed, float) or (isinstance(seed, torch.Tensor) and seed.is_floating_point()):
            raise TypeError(f"seed must be an int or integers (one per request), got {seed!r:.40}: pass int(seed)")
        seed_shape = tuple(torch.as_tensor(seed).shape) if not isinstance(seed, torch.Tensor) else tuple(seed.shape)
        if seed_shape != (batch,):
            raise ValueError(f"seed must be an int or one seed per request (shape [{batch}]), got shape {seed_shape}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if type(seed) is int:
        seeds = _const_seeds(device, batch, seed)
    elif _ready(seed, torch.int64, device):
        seeds = seed
    else:
        seeds = seeds_from(seed, batch, device, generator)
    return VerifyInputs(target_logits=target_logits, draft_tokens=draft_tokens, num_draft_tokens=num_draft,
                        sampling=resolve_sampling(sampling, batch, device, check_values), seeds=seeds,
                        offsets=offsets_t, draft_logits=draft_logits, draft_probs=draft_probs, generator=generator,
                        ragged=ragged)


def as_seed_list(seeds: torch.Tensor) -> Sequence[int]:
    """Host copy of per-request seeds (for baselines that need torch.Generator objects)."""
    return [int(s) for s in seeds.tolist()]
