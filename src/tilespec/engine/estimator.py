"""Online estimates of the acceptance rate α and the cost ratio c from what the engine observes
(:class:`OnlineGammaEstimator`; used by the ``optimal`` γ schedule of :mod:`tilespec.engine.gamma`)."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from tilespec.analysis import _check_alpha, _check_cost, _check_gamma, optimal_gamma as _optimal, walltime_improvement


def _host_array(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.atleast_1d(np.asarray(x, dtype=np.float64))


class OnlineGammaEstimator:
    """Running estimates of α and c from what the engine observes, and the γ that maximises Theorem 3.8.

    α: a request that drafted K tokens and had n accepted made n + 1 Bernoulli(β) trials if n < K (n successes,
    then a rejection) and K trials if n = K (all successes). The estimate is the ratio of exponentially decayed sums,
    α̂ = A / T with A ← d·A + Σ n and T ← d·T + Σ (n + [n < K]), which is the maximum-likelihood α of the i.i.d.
    model (the naive n / K is biased low because the count is capped at K). ``prior_weight`` pseudo-trials at
    ``alpha0`` keep early estimates sane and keep T > 0.

    c: decayed averages of draft time per draft step and of target time per call, c = (draft / step) / (target /
    call). Timings are optional; without any, ``c0`` is used.

    ``gamma()`` returns argmax_γ S(α̂, γ, ĉ) over [1, gamma_max] (ties to the smaller γ). Edge cases are safe: α̂ = 1
    gives gamma_max (if ĉ < 1), α̂ = 0 gives 1, zero timings are ignored.

    Args:
        gamma_max: upper clamp for the chosen γ (>= 1).
        decay: d in (0, 1], the weight of the past per observation (1 = plain running average); the effective
            memory is about 1 / (1 - d) observations.
        alpha0, c0: initial guesses.  prior_weight: pseudo-trials behind alpha0 (> 0).
    """

    def __init__(self, gamma_max: int = 16, decay: float = 0.95, alpha0: float = 0.6, c0: float = 0.05,
                 prior_weight: float = 4.0):
        self.gamma_max = _check_gamma(gamma_max, "gamma_max")
        if not (0.0 < float(decay) <= 1.0):
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not (float(prior_weight) > 0.0) or math.isinf(float(prior_weight)):
            raise ValueError(f"prior_weight must be a finite number > 0, got {prior_weight}")
        self.decay = float(decay)
        self._accepted = _check_alpha(alpha0) * float(prior_weight)
        self._trials = float(prior_weight)
        self._c0 = _check_cost("c0", c0)
        self._draft_time = self._draft_steps = 0.0
        self._target_time = self._target_calls = 0.0
        self._overhead_time = self._overhead_steps = 0.0

    @property
    def alpha(self) -> float:
        """Current estimate of α in [0, 1]."""
        return min(max(self._accepted / self._trials, 0.0), 1.0)

    @property
    def c(self) -> float:
        """Current estimate of the cost ratio c (c0 until both draft and target timings were observed)."""
        if self._draft_steps > 0 and self._target_calls > 0 and self._target_time > 0:
            return (self._draft_time / self._draft_steps) / (self._target_time / self._target_calls)
        return self._c0

    @property
    def overhead(self) -> float:
        """Per-step host overhead in units of one target call (0 until step wall times were observed)."""
        if self._overhead_steps > 0 and self._target_calls > 0 and self._target_time > 0:
            return (self._overhead_time / self._overhead_steps) / (self._target_time / self._target_calls)
        return 0.0

    def observe(self, num_accepted, num_drafted, draft_time: Optional[float] = None,
                target_time: Optional[float] = None, step_time: Optional[float] = None) -> None:
        """Record one verification step.

        Args:
            num_accepted: accepted draft tokens per request (int, sequence, numpy array or tensor [B]).
            num_drafted: drafted tokens per request K_b, same shape or a scalar; requests with K_b = 0 add nothing.
            draft_time: seconds spent on the max(K_b) sequential draft steps of this step (optional).
            target_time: seconds of the target call of this step (optional).
            step_time: wall seconds of the whole step, host work included (optional; with draft and target
                times it gives the per-step overhead, see the module docstring).
        """
        n = _host_array(num_accepted)
        k = np.broadcast_to(_host_array(num_drafted), n.shape)
        if not (np.isfinite(n).all() and np.isfinite(k).all()):
            raise ValueError("num_accepted and num_drafted must be finite")
        if (n < 0).any() or (n > k).any():
            raise ValueError("num_accepted must lie in [0, num_drafted] for every request")
        trials = n + (n < k)
        self._accepted = self.decay * self._accepted + float(n.sum())
        self._trials = self.decay * self._trials + float(trials.sum())
        steps = float(k.max()) if k.size else 0.0
        if draft_time is not None and steps > 0:
            if not (float(draft_time) >= 0.0) or math.isinf(float(draft_time)):
                raise ValueError(f"draft_time must be a finite number >= 0, got {draft_time}")
            self._draft_time = self.decay * self._draft_time + float(draft_time)
            self._draft_steps = self.decay * self._draft_steps + steps
        if target_time is not None:
            if not (float(target_time) > 0.0) or math.isinf(float(target_time)):
                raise ValueError(f"target_time must be a finite number > 0, got {target_time}")
            self._target_time = self.decay * self._target_time + float(target_time)
            self._target_calls = self.decay * self._target_calls + 1.0
            if step_time is not None:
                if not (float(step_time) >= 0.0) or math.isinf(float(step_time)):
                    raise ValueError(f"step_time must be a finite number >= 0, got {step_time}")
                spent = float(target_time) + (float(draft_time) if draft_time is not None else 0.0)
                self._overhead_time = self.decay * self._overhead_time + max(float(step_time) - spent, 0.0)
                self._overhead_steps = self.decay * self._overhead_steps + 1.0

    @property
    def timed_steps(self) -> float:
        """How many target timings the estimate of c rests on (decayed; a plain count when decay = 1)."""
        return self._target_calls

    def gamma(self) -> int:
        """The γ in [1, gamma_max] maximising Theorem 3.8 at the current estimates."""
        return _optimal(self.alpha, self.c, gamma_max=self.gamma_max).gamma

    def expected_improvement(self, gamma: Optional[int] = None) -> float:
        """Theorem 3.8 at the current estimates for ``gamma`` (default: :meth:`gamma`)."""
        return walltime_improvement(self.alpha, self.gamma() if gamma is None else gamma, self.c)

    def __repr__(self) -> str:
        return (f"OnlineGammaEstimator(alpha={self.alpha:.4f}, c={self.c:.4f}, gamma={self.gamma()}, "
                f"gamma_max={self.gamma_max})")
