"""Leviathan et al. (2023) analysis of speculative decoding: acceptance rates, expected speedups, choosing gamma.

Notation (paper §3): p is the target distribution, q the draft distribution, gamma (γ) the number of drafted tokens
per target call, c the cost coefficient (time of one draft-model step / time of one target-model step),
c_hat (ĉ) the ratio of arithmetic operations per token of draft to target.

* β (Definition 3.1, Theorem 3.5) is the probability that a token x ~ q is accepted at one position::

      β = Σ_x min(p(x), q(x)) = 1 - D_LK(p, q)

  and with lenience l ∈ (0, 1] (App. A.5; a token is accepted with probability min(1, p(x) / (l q(x))))::

      β_l = Σ_x min(p(x) / l, q(x))

* α = E[β] (Corollary 3.6), the mean over positions. Assuming i.i.d. βs, one step emits a capped geometric number
  of tokens with (Equation 1)::

      E[#tokens per target call] = (1 - α^(γ+1)) / (1 - α)          (= γ + 1 at α = 1)

* Expected walltime improvement factor (Theorem 3.8)::

      S(α, γ, c) = (1 - α^(γ+1)) / ((1 - α)(γ c + 1))

* Expected factor of increase in total arithmetic operations (Theorem 3.11)::

      O(α, γ, ĉ) = (1 - α)(γ ĉ + γ + 1) / (1 - α^(γ+1))

* The optimal γ maximises S over the integers (§3.5); it is found by exhaustive search over [γ_min, γ_max].

The lenient versions are the same formulas evaluated at α_l = E[β_l]. Online estimates of α and c during decoding
(and the γ schedules built on them) live in :mod:`tilespec.engine.gamma`. Everything here is cheap host-side math,
except :func:`acceptance_rate` / :func:`acceptance_rate_from_logits`, which are batched over rows.

Numerics: (1 - α^(γ+1)) / (1 - α) is evaluated as -expm1((γ+1) log α) / (1 - α), which is accurate for α close to
1 (no cancellation) and exact at the edges: α = 0 gives 1, α = 1 gives γ + 1 (no division by zero).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

ArrayLike = Union[torch.Tensor, np.ndarray]

__all__ = [
    "acceptance_rate", "expected_alpha", "acceptance_rate_from_logits", "lenient_output_distribution",
    "expected_tokens", "walltime_improvement", "operations_factor", "optimal_gamma", "GammaChoice",
    "SpeculationAnalysis", "analyze",
]


# ----------------------------------------------------------------------------------------------- validation helpers

def _scalar(x):
    """0-d / one-element tensors and arrays as Python numbers; everything else unchanged."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    if isinstance(x, np.ndarray) and x.size == 1:
        return x.item()
    return x


def _check_alpha(alpha) -> float:
    alpha = _scalar(alpha)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"alpha must be a real number, got {type(alpha).__name__}")
    a = float(alpha)
    if not (0.0 <= a <= 1.0):  # also rejects NaN
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return a


def _check_cost(name: str, c) -> float:
    c = _scalar(c)
    if isinstance(c, bool) or not isinstance(c, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(c).__name__}")
    v = float(c)
    if not (v >= 0.0) or math.isinf(v):  # rejects negatives, NaN and inf
        raise ValueError(f"{name} must be a finite number >= 0, got {c}")
    return v


def _check_gamma(gamma, name: str = "gamma") -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(gamma).__name__}")
    g = int(gamma)
    if g < 1:
        raise ValueError(f"{name} must be >= 1, got {gamma}")
    return g


def _check_lenience(lenience) -> float:
    if isinstance(lenience, bool) or not isinstance(lenience, numbers.Real):
        raise TypeError(f"lenience must be a real number, got {type(lenience).__name__}")
    v = float(lenience)
    if not (0.0 < v <= 1.0):
        raise ValueError(f"lenience must be in (0, 1], got {lenience}")
    return v


# ------------------------------------------------------------------------------------------------- acceptance rates

def _as_array_pair(p, q):
    """Both inputs as torch tensors or both as numpy arrays (torch if either is a tensor)."""
    if isinstance(p, torch.Tensor) or isinstance(q, torch.Tensor):
        pt = p if isinstance(p, torch.Tensor) else torch.as_tensor(np.asarray(p))
        qt = q if isinstance(q, torch.Tensor) else torch.as_tensor(np.asarray(q))
        if not pt.is_floating_point() or not qt.is_floating_point():
            raise TypeError(f"p and q must be floating point, got {pt.dtype} and {qt.dtype}")
        dtype = torch.promote_types(pt.dtype, qt.dtype)
        if dtype in (torch.bfloat16, torch.float16):
            dtype = torch.float32
        return pt.to(dtype), qt.to(device=pt.device, dtype=dtype), torch
    pn, qn = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    return pn, qn, np


def acceptance_rate(p, q, lenience: float = 1.0):
    """Per-row acceptance probability β = Σ_x min(p(x) / l, q(x)) (Theorem 3.5; App. A.5 for l < 1).

    Args:
        p: target probabilities [..., V] (torch tensor, numpy array or nested lists); rows should sum to 1.
        q: draft probabilities [..., V], broadcastable against p.
        lenience: l in (0, 1]; 1 is exact speculative sampling.

    Returns:
        β with the broadcast leading shape [...] (torch tensor in the promoted float dtype, at least fp32, if either
        input is a tensor; numpy float64 otherwise). With l = 1, β = 1 - D_LK(p, q): 1 iff p = q, 0 iff the
        supports are disjoint.
    """
    lenience = _check_lenience(lenience)
    p, q, xp = _as_array_pair(p, q)
    if p.ndim == 0 or q.ndim == 0:
        raise ValueError("p and q must have a vocabulary dimension [..., V]")
    if p.shape[-1] != q.shape[-1]:
        raise ValueError(f"vocabulary mismatch: p has V = {p.shape[-1]}, q has V = {q.shape[-1]}")
    for name, x in (("p", p), ("q", q)):
        finite = bool(xp.isfinite(x).all())
        if not finite or bool((x < 0).any()):
            raise ValueError(f"{name} must hold finite non-negative probabilities (did you pass logits?)")
    scaled = p / lenience if lenience != 1.0 else p
    return xp.minimum(scaled, q).sum(-1)


def expected_alpha(p, q, lenience: float = 1.0, weights=None) -> float:
    """α = E[β] (Corollary 3.6): the (optionally weighted) mean of :func:`acceptance_rate` over all rows.

    ``weights`` (broadcastable to the row shape, non-negative) weigh each row, e.g. a validity mask of a ragged
    batch. Returns a Python float in [0, 1] (clipped against rounding, so it can be fed to the other functions).
    """
    beta = acceptance_rate(p, q, lenience)
    if isinstance(beta, torch.Tensor):
        beta = beta.detach().double().cpu().numpy()
    beta = np.asarray(beta, dtype=np.float64)
    if weights is None:
        if beta.size == 0:
            raise ValueError("no rows to average over")
        alpha = float(beta.mean())
    else:
        w = weights.detach().double().cpu().numpy() if isinstance(weights, torch.Tensor) else np.asarray(weights)
        w = np.broadcast_to(np.asarray(w, dtype=np.float64), beta.shape)
        if (w < 0).any() or not np.isfinite(w).all():
            raise ValueError("weights must be finite and non-negative")
        total = float(w.sum())
        if total <= 0:
            raise ValueError("weights sum to zero: no rows to average over")
        alpha = float((beta * w).sum() / total)
    return min(max(alpha, 0.0), 1.0)


def acceptance_rate_from_logits(target_logits: torch.Tensor, draft_logits: torch.Tensor, sampling=None
                                ) -> torch.Tensor:
    """β per row [B, R] for logits [B, R, V] processed exactly as :func:`tilespec.verify` processes them.

    The sampling parameters (temperature, top-k/p, min-p, lenience; scalars or per request) are applied to both
    target and draft. Sampling requests use β = Σ min(p/l, q). Greedy requests (temperature 0) accept the drafted
    argmax x when p1(x) >= l · max p1 (p1 the temperature-1 target distribution; App. A.5), which for l = 1 is
    "the two argmaxes agree".
    """
    from .verify.distributions import lenient_greedy_logprobs, log_probs
    from .verify.types import SamplingParams
    from .verify.validation import resolve_sampling

    if not isinstance(target_logits, torch.Tensor) or not isinstance(draft_logits, torch.Tensor):
        raise TypeError("target_logits and draft_logits must be torch tensors")
    if target_logits.ndim != 3 or target_logits.shape != draft_logits.shape:
        raise ValueError(f"target_logits and draft_logits must both have shape [B, R, V], got "
                         f"{tuple(target_logits.shape)} and {tuple(draft_logits.shape)}")
    sampling = SamplingParams() if sampling is None else sampling
    resolved = resolve_sampling(sampling, target_logits.shape[0], target_logits.device)
    p = log_probs(target_logits, resolved).exp()
    q = log_probs(draft_logits, resolved).exp()
    lenience = resolved.lenience.view(-1, 1, 1)
    beta = torch.minimum(p / lenience, q).sum(-1)
    if resolved.any_greedy:
        logp1 = lenient_greedy_logprobs(target_logits, resolved)
        max1 = logp1.max(dim=-1, keepdim=True).values
        ok = logp1 >= max1 + torch.log(lenience)  # p1(x) >= l * max p1, in log space
        greedy_beta = (q * ok).sum(-1)
        beta = torch.where(resolved.temperature.view(-1, 1) == 0, greedy_beta, beta)
    return beta


def lenient_output_distribution(p, q, lenience: float = 1.0):
    """The law of the token emitted at one position by lenient speculative sampling (App. A.5).

    A draft x ~ q is accepted with probability min(1, p(x) / (l q(x))), otherwise a token is drawn from
    norm(max(0, p - l q)). With α_l = Σ min(p/l, q) and Σ max(0, p - l q) = 1 - l α_l this is::

        out(x) = min(p(x)/l, q(x)) + (1 - α_l) · max(0, p(x) - l q(x)) / (1 - l α_l)

    which equals p for l = 1 and never exceeds p(x) / l. Rows [..., V] as in :func:`acceptance_rate`.
    """
    lenience = _check_lenience(lenience)
    alpha = acceptance_rate(p, q, lenience)
    p, q, xp = _as_array_pair(p, q)
    accepted = xp.minimum(p / lenience, q)
    residual = xp.clip(p - lenience * q, 0, None) if xp is np else (p - lenience * q).clamp(min=0)
    mass = residual.sum(-1, keepdims=True) if xp is np else residual.sum(-1, keepdim=True)
    reject = 1 - (alpha[..., None] if xp is np else alpha.unsqueeze(-1))
    safe = xp.where(mass > 0, mass, xp.ones_like(mass))
    return accepted + xp.where(mass > 0, reject * residual / safe, xp.zeros_like(residual))


# ---------------------------------------------------------------------------------------------------- closed forms

def _geometric_sum(alpha: float, n: int) -> float:
    """Σ_{i<n} α^i = (1 - α^n) / (1 - α), stable near 1 and exact at α ∈ {0, 1}."""
    if alpha == 1.0:
        return float(n)
    if alpha == 0.0:
        return 1.0
    return -math.expm1(n * math.log(alpha)) / (1.0 - alpha)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens emitted per target call (Equation 1): (1 - α^(γ+1)) / (1 - α), γ + 1 at α = 1.

    Raises ValueError for α ∉ [0, 1] or γ < 1.
    """
    return _geometric_sum(_check_alpha(alpha), _check_gamma(gamma) + 1)


def walltime_improvement(alpha: float, gamma: int, c: float) -> float:
    """Expected walltime improvement factor (Theorem 3.8): (1 - α^(γ+1)) / ((1 - α)(γ c + 1)).

    c is the draft/target cost ratio of one step (Definition 3.7). Raises ValueError for α ∉ [0, 1], c < 0, γ < 1.
    """
    a, g, cc = _check_alpha(alpha), _check_gamma(gamma), _check_cost("c", c)
    return _geometric_sum(a, g + 1) / (g * cc + 1.0)


def operations_factor(alpha: float, gamma: int, c_hat: float = 0.0) -> float:
    """Expected factor of increase in total arithmetic operations (Theorem 3.11):
    (1 - α)(γ ĉ + γ + 1) / (1 - α^(γ+1)).

    ĉ is the draft/target ratio of arithmetic operations per token (Definition 3.10).
    """
    a, g, ch = _check_alpha(alpha), _check_gamma(gamma), _check_cost("c_hat", c_hat)
    return (g * ch + g + 1.0) / _geometric_sum(a, g + 1)


class GammaChoice(NamedTuple):
    """Result of :func:`optimal_gamma`: the best γ and its Theorem 3.8 improvement factor."""

    gamma: int
    improvement: float


def optimal_gamma(alpha: float, c: float, gamma_max: int = 32, gamma_min: int = 1) -> GammaChoice:
    """γ ∈ [gamma_min, gamma_max] maximising Theorem 3.8 (§3.5, Figure 3), by exhaustive integer search.

    Ties go to the smallest γ. ``improvement < 1`` means speculation does not pay at these α, c (by Corollary 3.9
    some γ helps iff α > c); the caller may then decode without a draft. Edge cases: α = 0 gives γ = gamma_min;
    α = 1 gives gamma_max when c < 1 (each extra token is free) and gamma_min when c >= 1.
    """
    a, cc = _check_alpha(alpha), _check_cost("c", c)
    lo, hi = _check_gamma(gamma_min, "gamma_min"), _check_gamma(gamma_max, "gamma_max")
    if hi < lo:
        raise ValueError(f"gamma_max ({hi}) must be >= gamma_min ({lo})")
    best_g, best = lo, -1.0
    for g in range(lo, hi + 1):
        value = _geometric_sum(a, g + 1) / (g * cc + 1.0)
        if value > best * (1 + 1e-12):
            best_g, best = g, value
    return GammaChoice(best_g, best)


@dataclass(frozen=True)
class SpeculationAnalysis:
    """All §3 quantities for one (p, q, γ, c) setting; see :func:`analyze`."""

    alpha: float
    lenience: float
    gamma: int
    c: float
    expected_tokens: float
    walltime_improvement: float
    operations_factor: float
    optimal_gamma: int
    optimal_improvement: float


def analyze(p, q, gamma: int, c: float, lenience: float = 1.0, c_hat: Optional[float] = None,
            gamma_max: int = 32) -> SpeculationAnalysis:
    """α (or α_l with lenience) from distributions p, q [..., V], then Equation 1, Theorems 3.8 and 3.11 and the
    optimal γ evaluated at it. ``c_hat`` defaults to ``c``."""
    alpha = expected_alpha(p, q, lenience)
    best = optimal_gamma(alpha, c, gamma_max=max(gamma_max, _check_gamma(gamma)))
    return SpeculationAnalysis(
        alpha=alpha, lenience=float(lenience), gamma=int(gamma), c=float(c),
        expected_tokens=expected_tokens(alpha, gamma), walltime_improvement=walltime_improvement(alpha, gamma, c),
        operations_factor=operations_factor(alpha, gamma, c if c_hat is None else c_hat),
        optimal_gamma=best.gamma, optimal_improvement=best.improvement)
