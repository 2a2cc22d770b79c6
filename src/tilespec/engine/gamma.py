"""Draft-length (γ) schedules: constant, the HF heuristic, and Leviathan-optimal with online estimates of α and c
(:class:`OnlineGammaEstimator`; the closed forms of Equation 1 / Theorem 3.8 come from :mod:`tilespec.analysis`).

A schedule is asked for γ before each step (``next()``) and told the outcome of each speculative step after it
(``update``, γ >= 1 only). One schedule serves one generation; with a batch, one γ serves all active requests (the
verify shapes stay uniform):
  * ``constant``: always ``gamma`` (>= 1).
  * ``heuristic`` (HF assisted generation, Wagner §4.1): start at ``gamma`` (5 by default), +2 when every active
    request accepted its whole draft, otherwise -1, never below 1 (capped at ``max_gamma``).
  * ``optimal``: estimate the acceptance rate α (accepted / tested draft positions, the MLE under Leviathan's
    i.i.d. model) and the cost ratio c = (time of one draft forward) / (time of one target forward) online, and pick
    the γ in [1, max_gamma] maximising Leviathan Theorem 3.8's improvement S(α, γ, c) =
    (1 - α^(γ+1)) / ((1 - α)(γc + 1)). Fallback: once ``min_steps`` speculative steps have been timed (so c is
    measured, not the prior ``default_c``), if max_γ S < ``fallback_below`` (1.0: speculation is predicted to lose
    to target-only decoding; by Corollary 3.9 that is α <= c) the schedule returns γ = 0 from then on, for the rest
    of the generation, and records the decision in ``fallback_after`` / ``fallback_speedup``. The caller decodes
    γ = 0 steps target-only and never calls the draft again, so the draft's cache may go stale.
    Measured rates (``observe_rate``): Theorem 3.8 prices a step as γ draft forwards + one target forward, but on a
    fast runtime a speculative step also pays host work and launches that a run-ahead target-only step hides, and
    its (γ+1)-token target forward costs more than a 1-token one (on an H100 with the Qwen2.5 1.5B / 0.5B pair at
    B = 8 the model predicted 1.21x and the run measured 0.63x). So the schedule also times whole steps (wall time
    between two host reads) and tokens per request: once it has both a target-only rate (steps after a fallback)
    and ``min_steps`` speculative ones, the measured ratio decides the fallback instead of the model. Without a
    target-only rate yet, a generation whose model prediction is below ``explore_below`` falls back to measure it
    (its remaining steps are target-only, so nothing is wasted). Rates belong to the machine and the model pair,
    like c: they are inherited by the decoder's next generation, which then falls back before its first step
    (``falls_back_at_start``: the decoder skips the draft's prefill too) when speculation measured slower.
Only ``optimal`` ever returns 0.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from tilespec import analysis
from tilespec.analysis import _check_alpha, _check_cost, _check_gamma, optimal_gamma as _optimal, walltime_improvement

SCHEDULES = ("constant", "heuristic", "optimal")
# The engine's names for Leviathan's Equation 1 and Theorem 3.8 (re-exported by tilespec.engine).
expected_tokens = analysis.expected_tokens
expected_speedup = walltime_improvement


def optimal_gamma(alpha: float, c: float, max_gamma: int = 16) -> int:
    """argmax over γ in [1, max_gamma] of Theorem 3.8 (ties -> smaller γ): ``tilespec.analysis.optimal_gamma``'s γ."""
    return int(_optimal(min(max(alpha, 0.0), 1.0), max(c, 0.0), gamma_max=max_gamma).gamma)


def overhead_improvement(alpha: float, gamma: int, c: float, overhead: float = 0.0) -> float:
    """Theorem 3.8 with a per-step overhead o that target-only decoding does not pay: E(γ) / (γc + 1 + o).
    α in [0, 1], γ >= 1, c and o finite and >= 0 (in units of one target forward)."""
    gamma, c, overhead = _check_gamma(gamma), _check_cost("c", c), _check_cost("overhead", overhead)
    return float(expected_tokens(_check_alpha(alpha), gamma)) / (gamma * c + 1.0 + overhead)


def best_gamma(alpha: float, c: float, overhead: float, max_gamma: int) -> tuple[int, float]:
    """(γ in [1, max_gamma] maximising :func:`overhead_improvement`, ties -> smaller γ; that improvement)."""
    alpha, c, overhead = _check_alpha(alpha), _check_cost("c", c), _check_cost("overhead", overhead)
    max_gamma = _check_gamma(max_gamma, "max_gamma")
    if overhead == 0.0:
        g = optimal_gamma(alpha, c, max_gamma)
        return g, float(expected_speedup(alpha, g, c))
    best = max(range(1, max_gamma + 1), key=lambda g: (overhead_improvement(alpha, g, c, overhead), -g))
    return best, overhead_improvement(alpha, best, c, overhead)


def chain_gamma(alphas: list, c: float, overhead: float = 0.0) -> tuple[int, float]:
    """γ for a drafter whose acceptance depends on the draft position (a trained head: alphas[k] = P(draft k+1
    accepted | the first k accepted), measured on held-out text): argmax over γ in [1, len(alphas)] of
    (1 + Σ_{k<=γ} Π_{j<=k} alphas[j]) / (1 + γ c + o), ties -> smaller γ; returns (γ, that improvement)."""
    if not alphas:
        raise ValueError("chain_gamma needs at least one acceptance rate")
    c, overhead = _check_cost("c", c), _check_cost("overhead", overhead)
    best, best_value, tau, run = 1, -1.0, 1.0, 1.0
    for g, a in enumerate(alphas, start=1):
        run *= _check_alpha(a)
        tau += run
        value = tau / (1.0 + g * c + overhead)
        if value > best_value + 1e-12:
            best, best_value = g, value
    return best, best_value


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


class GammaSchedule:
    """Stateful γ chooser for one generation (see the module docstring).

    gamma: the initial / constant value; max_gamma caps adaptive schedules. prior_alpha / prior_weight: pseudo
    counts of the α estimate; default_c: the cost ratio assumed until a step has been timed. ``optimal`` only:
    fallback_below: the predicted speedup under which the schedule falls back to γ = 0 for good (0 disables it);
    min_steps: timed speculative steps needed before that decision may be taken; explore_below: without a measured
    target-only rate, the predicted speedup under which it falls back to measure one (0 never explores).
    """

    wants_step_time = True   # update() takes step_time (the decoder checks, since injected schedules may not)

    def __init__(self, kind: str = "constant", gamma: int = 5, max_gamma: int = 16,
                 prior_alpha: float = 0.7, prior_weight: float = 10.0, default_c: float = 0.2,
                 fallback_below: float = 1.0, min_steps: int = 4, explore_below: float = 1.3):
        if kind not in SCHEDULES:
            raise ValueError(f"unknown gamma schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
        if not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
        if max_gamma < gamma and kind != "constant":
            raise ValueError(f"max_gamma ({max_gamma}) must be >= gamma ({gamma})")
        if not fallback_below >= 0.0:  # also rejects NaN
            raise ValueError(f"fallback_below must be >= 0, got {fallback_below!r}")
        if not explore_below >= 0.0:  # also rejects NaN
            raise ValueError(f"explore_below must be >= 0, got {explore_below!r}")
        if not isinstance(min_steps, int) or min_steps < 1:
            raise ValueError(f"min_steps must be an integer >= 1, got {min_steps!r}")
        self.kind, self.gamma, self.max_gamma = kind, gamma, max(max_gamma, gamma)
        self._current = gamma
        # α and c: the analysis module's online estimator without decay (a plain running MLE), whose pseudo counts
        # keep the first steps from swinging to extremes
        self.estimator = OnlineGammaEstimator(gamma_max=self.max_gamma, decay=1.0, alpha0=prior_alpha,
                                              c0=default_c, prior_weight=prior_weight)
        self.default_c = default_c
        self.fallback_below, self.min_steps = float(fallback_below), min_steps
        self.explore_below = float(explore_below)
        # whole-step wall seconds and tokens per request: target-only (ar) and speculative (spec) steps
        self._rates = {"ar_wall": 0.0, "ar_steps": 0.0, "spec_wall": 0.0, "spec_tokens": 0.0, "spec_steps": 0.0}
        self._last_kind: Optional[str] = None
        self.steps = 0                               # update() calls: speculative steps seen
        self.fallback_after: Optional[int] = None    # speculative steps seen when γ fell back to 0, else None
        self.fallback_speedup: Optional[float] = None  # the best predicted speedup max_γ S at that moment

    _COST_FIELDS = ("_draft_time", "_draft_steps", "_target_time", "_target_calls", "_overhead_time",
                    "_overhead_steps")
    _RATE_FIELDS = ("ar_wall", "ar_steps", "spec_wall", "spec_tokens", "spec_steps")

    def cost_state(self) -> Optional[dict]:
        """The measured timings behind c, the overhead and the measured rates (not α), to seed the next
        generation's schedule of the same decoder; None before any timed step."""
        est = self.estimator
        if est.timed_steps <= 0 and self._rates["ar_steps"] <= 0:
            return None
        state = {f: getattr(est, f) for f in self._COST_FIELDS}
        state.update({f"rate_{k}": v for k, v in self._rates.items()})
        return state

    def inherit_cost(self, state: Optional[dict]) -> None:
        """Start from an earlier generation's measured c and overhead (they belong to the models and the machine,
        not to the prompt); α keeps its prior. So ``optimal`` with learned costs speculates only while the prior α
        could pay, and falls back at once when even that cannot, instead of probing min_steps steps again."""
        if state is None:
            return
        rate_keys = tuple(f"rate_{k}" for k in self._RATE_FIELDS)
        if not isinstance(state, dict) or set(state) not in (set(self._COST_FIELDS),
                                                             set(self._COST_FIELDS) | set(rate_keys)):
            raise ValueError(f"a cost state is a dict with exactly {self._COST_FIELDS} (+ {rate_keys}), "
                             f"got {state!r}")
        values = {f: float(v) for f, v in state.items()}
        if not all(math.isfinite(v) and v >= 0.0 for v in values.values()):
            raise ValueError(f"cost state values must be finite and >= 0, got {state!r}")
        for f in self._COST_FIELDS:
            setattr(self.estimator, f, values[f])
        for k in self._RATE_FIELDS:
            self._rates[k] = values.get(f"rate_{k}", 0.0)

    def observe_rate(self, gamma: int, wall: float, tokens_per_request: float) -> None:
        """One step's wall seconds since the previous host read and its mean tokens per live request (γ = 0: a
        target-only step). The first step of a generation and the first after a switch between target-only and
        speculative steps are not counted (they carry the prefill, a capture or the switch)."""
        kind = "spec" if gamma > 0 else "ar"
        first, self._last_kind = self._last_kind != kind, kind
        if first or not (math.isfinite(wall) and wall > 0.0):
            return
        r = self._rates
        r[f"{kind}_wall"] += wall
        r[f"{kind}_steps"] += 1.0
        if kind == "spec":
            r["spec_tokens"] += tokens_per_request

    def measured_speedup(self) -> Optional[float]:
        """Speculative tokens per second over target-only tokens per second (per request), from whole-step wall
        times; None until there are >= 2 target-only and ``min_steps`` speculative steps."""
        r = self._rates
        if r["ar_steps"] < 2 or r["spec_steps"] < self.min_steps or r["spec_wall"] <= 0 or r["ar_wall"] <= 0:
            return None
        return (r["spec_tokens"] / r["spec_wall"]) / (r["ar_steps"] / r["ar_wall"])

    @property
    def falls_back_at_start(self) -> bool:
        """``optimal`` with inherited rates that say speculation is slower: it returns 0 from the first step."""
        measured = self.measured_speedup() if self.kind == "optimal" and self.steps == 0 else None
        return measured is not None and measured < self.fallback_below

    @property
    def alpha(self) -> float:
        return min(self.estimator.alpha, 1.0 - 1e-6)

    @property
    def cost_ratio(self) -> float:
        return self.estimator.c

    def next(self) -> int:
        """γ for the next step: >= 1, or 0 (``optimal`` after its fallback: decode target-only from now on)."""
        if self.kind == "optimal" and self.fallback_after is None:
            self._current, best = best_gamma(self.alpha, self.cost_ratio, self.estimator.overhead, self.max_gamma)
            measured = self.measured_speedup()
            if measured is not None:
                if measured < self.fallback_below:
                    self.fallback_after, self.fallback_speedup, self._current = self.steps, measured, 0
            elif self.estimator.timed_steps >= self.min_steps and (
                    best < self.fallback_below
                    or (self.fallback_below > 0 and self._rates["ar_steps"] == 0 and best < self.explore_below)):
                self.fallback_after, self.fallback_speedup, self._current = self.steps, best, 0
        return self._current

    def fixed_gamma(self) -> Optional[int]:
        """γ of every later step when it cannot depend on the outcome of steps not yet recorded (``constant``),
        else None. The decoder launches such steps before reading the previous one (docs/engine.md)."""
        return self.gamma if self.kind == "constant" else None

    def update(self, gamma: int, num_accepted: list[int], draft_time: float = 0.0, target_time: float = 0.0,
               step_time: Optional[float] = None) -> None:
        """Record a step drafted with ``gamma`` (>= 1) where active request i accepted ``num_accepted[i]`` tokens.

        draft_time / target_time: seconds spent in the γ draft forwards / the one target forward (for c); a step
        counts towards ``min_steps`` only when both are positive. step_time: the step's wall seconds (host work
        included), for the overhead term. Target-only steps (γ = 0) must not be recorded.
        """
        if gamma < 1:
            raise ValueError(f"update() records speculative steps (gamma >= 1), got gamma={gamma}")
        if not num_accepted:
            return
        self.steps += 1
        timed = draft_time > 0 and target_time > 0
        self.estimator.observe(list(num_accepted), gamma, draft_time if timed else None,
                               target_time if timed else None, step_time if timed else None)
        if self.kind == "heuristic":
            if all(n == gamma for n in num_accepted):
                self._current = min(self._current + 2, self.max_gamma)
            else:
                self._current = max(1, self._current - 1)
