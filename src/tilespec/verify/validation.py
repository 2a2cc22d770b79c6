"""Preparation of :func:`tilespec.verify`'s arguments: checked, broadcast to per-request tensors, on one device.

The checks live in :mod:`.input_checks`. Shape, dtype and device checks are free (no device work). Value checks
(NaN/Inf logits, token ids, per-request draft lengths, tensor-valued sampling parameters) read the inputs once and
synchronise with the device; callers that hand over trusted inputs in a hot loop pass ``check_values=False``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .input_checks import (check_draft_distributions, check_draft_tokens, check_input_values, check_int64_ranges,
                           check_seed_arguments, check_target_logits)
from .input_checks import check_shared_stream_seed, draft_probs_tolerance  # noqa: F401  (imported from here)
from .rng import normalize_seed, seeds_from  # noqa: F401  (normalize_seed: verify() imports it here)
from .sampling_rules import RULES
from .types import PerRequest, ResolvedSampling, SamplingParams, VerifyInputs


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


def _check_range(name: str, values: Optional[list], tensor: torch.Tensor, check_values: bool):
    ok, rule = RULES[name]      # shared with the API process's torch-free check (sampling_rules.check_plain)
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
    _check_range("temperature", temp_v, temp, check_values)
    _check_range("top_k", top_k_v, top_k, check_values)
    if top_k_v is not None and any(float(v) != int(v) for v in top_k_v):
        raise ValueError("sampling.top_k must be an integer")
    _check_range("top_p", top_p_v, top_p, check_values)
    _check_range("min_p", min_p_v, min_p, check_values)
    _check_range("lenience", len_v, len_, check_values)

    def known(values, test):  # a flag is exact when values are Python numbers, conservatively True otherwise
        return True if values is None else any(test(v) for v in set(values))

    return ResolvedSampling(
        temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, lenience=len_,
        any_greedy=known(temp_v, lambda v: v == 0),
        all_greedy=False if temp_v is None else all(v == 0 for v in temp_v),
        has_top_k=known(top_k_v, lambda v: v > 0), has_top_p=known(top_p_v, lambda v: v < 1),
        has_min_p=known(min_p_v, lambda v: v > 0), has_lenience=known(len_v, lambda v: v < 1),
        top_k_range=None if top_k_v is None else (int(min(top_k_v)), int(max(top_k_v))))


def _resolve_num_draft(num_draft_tokens, batch: int, k_max: int, device: torch.device,
                       check_values: bool) -> torch.Tensor:
    """[B] int64 on ``device``: K_b, the number of drafted tokens of each request (K_max for all when None, a cached
    constant). Integer values only: lists / numpy arrays go through as_tensor without a dtype so 1.5 or True are
    rejected, not truncated. The range 0 <= K_b <= K_max is checked (one host read) when ``check_values`` or when
    the value is not a tensor; a tensor with ``check_values=False`` is not read."""
    if num_draft_tokens is None:
        return const_full(device, batch, k_max, torch.int64)
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
    return num_draft


def _canonical_draft_tokens(draft_tokens: torch.Tensor, num_draft: torch.Tensor, ragged: bool) -> torch.Tensor:
    """[B, K] int64 draft tokens. In a ragged batch padding positions (i >= K_b) become 0, a valid id for methods
    that gather there; only a ragged batch has padding, so the full-length common case needs no mask at all."""
    if draft_tokens.dtype != torch.int64:
        draft_tokens = draft_tokens.long()
    k_max = draft_tokens.shape[1]
    if ragged and k_max > 0:
        draft_tokens = draft_tokens.masked_fill(_const_positions(draft_tokens.device, k_max) >= num_draft[:, None], 0)
    return draft_tokens


def _resolve_offsets(offsets, batch: int, device: torch.device) -> torch.Tensor:
    """[B] int64 RNG stream offsets on ``device``: zeros (cached) for None, an int broadcast, or B integers (used
    as given when already an int64 tensor on ``device``)."""
    if offsets is None:
        return const_full(device, batch, 0, torch.int64)
    if isinstance(offsets, int):
        return torch.full((batch,), offsets, device=device, dtype=torch.int64)
    offsets_t = (offsets if _ready(offsets, torch.int64, device)
                 else torch.as_tensor(offsets, dtype=torch.int64).to(device))
    if tuple(offsets_t.shape) != (batch,):
        raise ValueError(f"offsets must be an int or have shape [{batch}], got {tuple(offsets_t.shape)}")
    return offsets_t


def _resolve_seeds(seed, generator, batch: int, device: torch.device) -> torch.Tensor:
    """[B] int64 per-request seeds on ``device`` (arguments already checked): an int seed gives request b the seed
    + b (cached), an int64 tensor on ``device`` is used as given, anything else (None, a sequence, another tensor)
    goes through :func:`.rng.seeds_from` (None draws from ``generator``)."""
    if type(seed) is int:
        return _const_seeds(device, batch, seed)
    if _ready(seed, torch.int64, device):
        return seed
    return seeds_from(seed, batch, device, generator)


def _resolve_seeds_and_offsets(seed, offsets, generator, batch: int,
                               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Check and resolve ``seed`` / ``offsets`` / ``generator`` to ([B] int64 seeds, [B] int64 offsets)."""
    check_int64_ranges(seed, offsets, batch)
    offsets_t = _resolve_offsets(offsets, batch, device)
    check_seed_arguments(seed, generator, batch)
    return _resolve_seeds(seed, generator, batch, device), offsets_t


def prepare_inputs(target_logits, draft_tokens, *, draft_logits=None, draft_probs=None, num_draft_tokens=None,
                   sampling: SamplingParams = SamplingParams(), seed=None, generator=None, offsets=None,
                   check_values: bool = True) -> VerifyInputs:
    """Validate every argument of :func:`tilespec.verify` and return the prepared :class:`VerifyInputs`.

    Checks run in a fixed order and the first failure raises: target_logits [B, K+1, V], draft_tokens [B, K], the
    draft distribution [B, K, V], num_draft_tokens [B], then (when ``check_values``) the values, then seeds /
    offsets / generator, then sampling. With ``check_values=False`` no tensor argument is read back to the host
    (Python / numpy num_draft_tokens are still range-checked)."""
    batch, rows, _ = check_target_logits(target_logits)
    k_max, device = rows - 1, target_logits.device
    check_draft_tokens(draft_tokens, target_logits)
    check_draft_distributions(draft_logits, draft_probs, target_logits)
    num_draft = _resolve_num_draft(num_draft_tokens, batch, k_max, device, check_values)
    if check_values:
        valid = _const_positions(device, k_max) < num_draft[:, None]  # [B, K]: position i < K_b
        check_input_values(target_logits, draft_tokens, draft_logits, draft_probs, num_draft, valid)
    ragged = num_draft_tokens is not None
    draft_tokens = _canonical_draft_tokens(draft_tokens, num_draft, ragged)
    seeds, offsets_t = _resolve_seeds_and_offsets(seed, offsets, generator, batch, device)
    return VerifyInputs(target_logits=target_logits, draft_tokens=draft_tokens, num_draft_tokens=num_draft,
                        sampling=resolve_sampling(sampling, batch, device, check_values), seeds=seeds,
                        offsets=offsets_t, draft_logits=draft_logits, draft_probs=draft_probs, generator=generator,
                        ragged=ragged)


def as_seed_list(seeds: torch.Tensor) -> Sequence[int]:
    """Host copy of per-request seeds (for baselines that need torch.Generator objects)."""
    return [int(s) for s in seeds.tolist()]
