"""Argument checks for :func:`tilespec.verify`: clear errors instead of crashes inside kernels.

Shape, dtype and device checks (``check_target_logits``, ``check_draft_tokens``, ``check_draft_distributions``,
``check_seed_arguments``) are free: no device work. ``check_input_values`` reads the inputs once (NaN/Inf logits,
draft token ids, draft distributions) and so synchronises with the device. These functions only raise; converting
and broadcasting the arguments is :mod:`.validation`'s job, which calls them in a fixed order (the first failing
check names the error).
"""
from __future__ import annotations

from typing import Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def _require_tensor(name: str, value, *, ndim: int) -> torch.Tensor:
    """``value`` must be a torch.Tensor with real data (not on the meta device) and ``ndim`` dimensions."""
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


def check_target_logits(target_logits) -> tuple[int, int, int]:
    """``target_logits`` must be a float tensor [B, K+1, V] with B >= 1, K+1 >= 1 and V >= 1; returns (B, K+1, V)."""
    _require_tensor("target_logits", target_logits, ndim=3)
    _require_float("target_logits", target_logits)
    batch, rows, vocab = target_logits.shape
    if batch == 0:
        raise ValueError("empty batch: target_logits has B = 0 requests")
    if rows == 0 or vocab == 0:
        raise ValueError(f"target_logits must have shape [B, K+1, V] with K+1 >= 1 and V >= 1, "
                         f"got {tuple(target_logits.shape)}")
    return batch, rows, vocab


def check_draft_tokens(draft_tokens, target_logits: torch.Tensor) -> None:
    """``draft_tokens`` must be an integer (not bool) tensor [B, K] on target_logits' device, where
    target_logits is [B, K+1, V]. Its values are checked by :func:`check_input_values`."""
    batch, k_max = target_logits.shape[0], target_logits.shape[1] - 1
    _require_tensor("draft_tokens", draft_tokens, ndim=2)
    if draft_tokens.dtype.is_floating_point or draft_tokens.dtype == torch.bool:
        raise TypeError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    if tuple(draft_tokens.shape) != (batch, k_max):
        raise ValueError(f"draft_tokens must have shape [B, K] = [{batch}, {k_max}] to match target_logits "
                         f"[B, K+1, V] = {tuple(target_logits.shape)}, got {tuple(draft_tokens.shape)}")
    if draft_tokens.device != target_logits.device:
        raise ValueError(f"draft_tokens is on {draft_tokens.device} but target_logits on {target_logits.device}")


def check_draft_distributions(draft_logits, draft_probs, target_logits: torch.Tensor) -> None:
    """At most one of ``draft_logits`` / ``draft_probs``; the one given must be a float tensor [B, K, V] on
    target_logits' device, where target_logits is [B, K+1, V]. Values are checked by :func:`check_input_values`."""
    batch, rows, vocab = target_logits.shape
    k_max, device = rows - 1, target_logits.device
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


def _check_draft_token_ids(draft_tokens: torch.Tensor, valid: torch.Tensor, vocab: int) -> None:
    """Drafted positions (``valid`` [B, K] True) must hold ids in [0, V); padding positions may hold anything
    (prepare_inputs zeroes them for methods that gather there)."""
    bad = valid & ((draft_tokens < 0) | (draft_tokens >= vocab))
    if bad.any():
        b, i = (int(v) for v in bad.nonzero()[0])
        value = int(draft_tokens[b, i])
        fix = (f"; for a shorter draft pass num_draft_tokens (request {b} drafted K_b tokens => "
               f"num_draft_tokens[{b}] = K_b); positions past K_b are padding and may hold any value, "
               f"e.g. -1" if value < 0 else
               f"; ids must index the target's vocabulary (target_logits.shape[-1] = {vocab})")
        raise ValueError(f"draft_tokens[{b}, {i}] = {value} is out of range [0, {vocab}){fix}")


def check_input_values(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_logits, draft_probs,
                       num_draft: torch.Tensor, valid: torch.Tensor) -> None:
    """Value checks of the used entries (one host sync): draft token ids in [0, V), target / draft logits free of
    NaN and +inf with no used row all -inf, draft_probs rows finite, non-negative and summing to 1.

    Shapes (already checked): target_logits [B, K+1, V], draft_tokens [B, K], draft_logits / draft_probs [B, K, V]
    or None, num_draft [B] int64 with 0 <= K_b <= K, valid [B, K] bool = (i < K_b). Request b uses target rows
    0..K_b and draft positions 0..K_b-1; the rest is padding and is not checked."""
    if draft_tokens.shape[1] > 0:
        _check_draft_token_ids(draft_tokens, valid, target_logits.shape[2])
    rows_valid = torch.arange(target_logits.shape[1], device=target_logits.device)[None, :] <= num_draft[:, None]
    _check_finite_logits("target_logits", target_logits, rows_valid)
    if draft_logits is not None:
        _check_finite_logits("draft_logits", draft_logits, valid)
    if draft_probs is not None:
        _check_draft_probs(draft_probs, valid)


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


def check_int64_ranges(seed, offsets, batch: int) -> None:
    """Python-int ``offsets`` and ``seed`` (or sequences of them) fit int64; an int seed also for seed + B - 1."""
    _check_int64("offsets", offsets, 0)
    _check_int64("seed", seed, batch - 1)


def check_seed_arguments(seed, generator, batch: int) -> None:
    """``seed`` is None, an int, or B integers (a sequence or an integer tensor of shape [B]); ``generator`` is None
    or a torch.Generator. Free: reads no tensor values."""
    if seed is not None and not isinstance(seed, int):
        if isinstance(seed, float) or (isinstance(seed, torch.Tensor) and seed.is_floating_point()):
            raise TypeError(f"seed must be an int or integers (one per request), got {seed!r:.40}: pass int(seed)")
        seed_shape = tuple(torch.as_tensor(seed).shape) if not isinstance(seed, torch.Tensor) else tuple(seed.shape)
        if seed_shape != (batch,):
            raise ValueError(f"seed must be an int or one seed per request (shape [{batch}]), got shape {seed_shape}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")


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
