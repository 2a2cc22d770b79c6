"""Draft-length (γ) schedules: constant, the HF heuristic, and Leviathan-optimal with online estimates of α and c
(:class:`OnlineGammaEstimator`; the closed forms of Equation 1 / Theorem 3.8 come from :mod:`tilespec.analysis`).

A schedule is asked for γ before each step (``next()``) and told the outcome of each speculative step after it
(``update``, γ >= 1 only). One schedule serves one generation; with a batch, one γ serves all active requests (the
verify shapes stay uniform):
  * ``constant``: always ``gamma`` (>= 1).
  * ``heuristic`` (HF assisted generation, Wagner §4.1): start at ``gamma`` (5 by default), +2 when every active
    request accepted its whole draft, otherwise -1, never below 1 (capped at ``max_gamma``).
  * ``optimal``: pick the draft cap with the most expected tokens per *measured* second (:mod:`.payoff`: per-request
    α, draft seconds per forward or per context step, the target forward's seconds by verify width with q = 1 kept
    apart, host overheads), and stop drafting where it loses. Fallback (γ = 0, target-only with run-ahead): with a
    measured target-only rate, when the measured drafting rate's upper confidence bound is below ``fallback_below``
    times it (after ``quick_steps`` drafting steps), or the middle of point and bound is (after ``min_steps``)
    (:mod:`.rates`); without one, when the prediction is below ``fallback_below``, or below ``explore_below`` (to
    measure one: a prediction that has never seen a target-only step may misprice it). A context drafter resumes
    after ``backoff`` target-only steps (doubling); a draft model's or head's cache is stale after a fallback, so it
    stays off for the generation, decided on ``min_steps`` steps of its own; the next 1, 2, 4, ... generations skip
    it after a loss (an exploring fallback is a loss only if the measured rates say so) before it is probed again
    with its drafting rate measured afresh. Costs, rates and the pooled α are inherited by the decoder's next
    generation of the same batch size (same models, machine and sampling parameters), which falls back before its
    first step when they say the draft loses (:attr:`falls_back_at_start`). Only ``optimal`` ever returns 0.
"""
from __future__ import annotations

import math
from typing import Optional

from tilespec import analysis
from tilespec.analysis import optimal_gamma as _optimal, walltime_improvement

from .estimator import OnlineGammaEstimator
from .rates import RateMeter, speedup as rate_speedup
from .schedule import ScheduleHooks, as_schedule  # noqa: F401  (the protocol GammaSchedule implements)
from .payoff import RequestAlphas, WidthCost, best_cap, best_gamma, chain_gamma, overhead_improvement  # noqa: F401

SCHEDULES = ("constant", "heuristic", "optimal")
ALPHA_DECAY = 0.98      # per step: the pooled α's memory (about 50 steps)
AR_RATE_DECAY = 0.99    # per step: the measured target-only rate's memory
SPEC_RATE_DECAY = 0.97  # per step: the measured drafting rate's memory (about 33 steps: the current rate)
# The engine's names for Leviathan's Equation 1 and Theorem 3.8 (re-exported by tilespec.engine).
expected_tokens = analysis.expected_tokens
expected_speedup = walltime_improvement


def optimal_gamma(alpha: float, c: float, max_gamma: int = 16) -> int:
    """argmax over γ in [1, max_gamma] of Theorem 3.8 (ties -> smaller γ): ``tilespec.analysis.optimal_gamma``'s γ."""
    return int(_optimal(min(max(alpha, 0.0), 1.0), max(c, 0.0), gamma_max=max_gamma).gamma)


class GammaSchedule(ScheduleHooks):
    """Stateful γ chooser for one generation (see the module docstring).

    gamma: the initial / constant value; max_gamma caps adaptive schedules. prior_alpha / prior_weight: pseudo
    counts of the α estimate; default_c: the cost ratio assumed until a step has been timed. ``optimal`` only:
    fallback_below: the speedup under which drafting stops (0 disables it); min_steps / quick_steps: drafting steps
    before the point estimate / the confidence bound (``z`` standard errors) may stop it (a draft model or head:
    steps of its own generation); explore_below: without a measured target-only rate, the predicted speedup under
    which the schedule falls back to measure one (0 never explores); backoff: target-only steps after a fallback
    before a context drafter drafts again (doubling after each fallback; :meth:`bind`).
    """

    wants_step_time = True   # update() takes step_time / requests (the decoder checks: injected ones may not)

    def __init__(self, kind: str = "constant", gamma: int = 5, max_gamma: int = 16,
                 prior_alpha: float = 0.7, prior_weight: float = 3.0, default_c: float = 0.2,
                 fallback_below: float = 1.0, min_steps: int = 4, explore_below: float = 1.3, backoff: int = 16,
                 quick_steps: int = 3, z: float = 1.645):
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
        if not isinstance(backoff, int) or backoff < 1:
            raise ValueError(f"backoff must be an integer >= 1, got {backoff!r}")
        if not (isinstance(quick_steps, int) and quick_steps >= 2 and z >= 0.0):   # z: also rejects NaN
            raise ValueError(f"quick_steps must be an integer >= 2 and z >= 0, got {quick_steps!r}, {z!r}")
        self.kind, self.gamma, self.max_gamma = kind, gamma, max(max_gamma, gamma)
        self._current = gamma
        # pooled α (what this generation's steps accepted, at the decoder's own sampling parameters; a memory of
        # about 50 steps, so a drift along a sampled output is followed) and the draft / target / overhead
        # timings: the analysis module's online estimator
        self.estimator = OnlineGammaEstimator(gamma_max=self.max_gamma, decay=ALPHA_DECAY, alpha0=prior_alpha,
                                              c0=default_c, prior_weight=prior_weight)
        self.prior_alpha, self.prior_weight = float(prior_alpha), float(prior_weight)
        self.default_c = default_c
        self.fallback_below, self.min_steps = float(fallback_below), min_steps
        self.quick_steps, self.z = min(quick_steps, min_steps), float(z)
        self.explore_below = float(explore_below)
        self.requests = RequestAlphas()   # per-request α, shrunk to the pooled estimate
        self.width = WidthCost()          # target seconds as a function of the verify width q
        self._ar_overhead = [0.0, 0.0]    # (seconds, steps): host overhead of fallback (run-ahead) target-only steps
        self._context_time = [0.0, 0.0]   # (seconds, steps): a context drafter's host matching per step
        # whole-step wall seconds and tokens per request (engine/rates.py): fallback target-only steps (ar) and
        # steps while drafting (spec: speculative steps and a context drafter's unmatched ones; since the last
        # resume or probe, decayed so the rate is the current one)
        self.ar_rate, self.spec_rate = RateMeter(AR_RATE_DECAY), RateMeter(SPEC_RATE_DECAY)
        self._explored = False                         # the fallback was taken to measure a target-only rate
        self._timed = 0.0                              # timed speculative steps (inherited ones included)
        self._last_kind: Optional[str] = None
        self.context, self.can_resume = False, False   # set by bind()
        self._live: list = []                          # request ids of the last recorded step's live rows
        self._fallen, self._idle_left, self._backoff = False, 0, backoff
        self._pinned: Optional[int] = None             # γ decided ahead of a read (fixed_gamma), for the next next()
        self._probe = [0.0, 0.0]                       # inherited: (generations still to skip, skip length)
        self._first = True                             # no next() yet (the start-of-generation check runs once)
        self.steps = 0                               # update() calls: speculative steps seen
        self.fallbacks = self.resumes = 0
        self.fallback_after: Optional[int] = None    # speculative steps seen when γ first fell back to 0, else None
        self.fallback_speedup: Optional[float] = None  # the predicted or measured speedup at that moment

    def bind(self, model: bool, context: bool) -> None:
        """Told by the decoder what drafts: a draft model (its cache goes stale while not drafting, so a fallback
        is for the rest of the generation) and / or a context drafter (priced per step; may resume drafting)."""
        self.context = bool(context) and not model
        self.can_resume = self.context

    _COST_FIELDS = ("_draft_time", "_draft_steps", "_target_time", "_target_calls", "_overhead_time",
                    "_overhead_steps")
    _RATE_FIELDS = tuple(f"{kind}_{f}" for kind in ("ar", "spec") for f in RateMeter.FIELDS)
    _EXTRA_FIELDS = ("alpha", "ar_overhead_time", "ar_overhead_steps", "context_time", "context_steps",
                     *(f"width_{f}" for f in WidthCost.FIELDS), "width_seen", "probe_left", "probe_span")

    def cost_state(self) -> Optional[dict]:
        """The measured timings behind the costs, the measured rates and the pooled α, to seed the next
        generation's schedule of the same decoder and batch size; None before any timed step."""
        est = self.estimator
        if est.timed_steps <= 0 and self.ar_rate.steps <= 0:
            return None
        state = {f: getattr(est, f) for f in self._COST_FIELDS}
        state.update(self.ar_rate.state("rate_ar"), **self.spec_rate.state("rate_spec"))
        left, span = self._probe      # a draft model or head that lost skips 1, 2, 4, ... generations, then probes
        if self.steps > 0:
            lost = self.fallback_after is not None
            if lost and self._explored:      # fell back to measure target-only: a loss only if the rates say so
                measured = self.measured()
                lost = measured is not None and measured[0] < self.fallback_below
            span = (min(2 * span, 64) if span else 1) if lost else 0
            left = span
        elif self.fallback_after == 0 and span == 0 and not self.context:
            span, left = 1.0, 0.0     # skipped on measured rates alone: counts as a loss, the next one probes
        else:
            left = max(left - 1, 0)
        state.update(self.width.state(), alpha=self.estimator.alpha, ar_overhead_time=self._ar_overhead[0],
                     ar_overhead_steps=self._ar_overhead[1], context_time=self._context_time[0],
                     context_steps=self._context_time[1], probe_left=left, probe_span=span)
        return state

    def inherit_cost(self, state: Optional[dict]) -> None:
        """Start from an earlier generation's measured costs and rates (they belong to the models and the machine,
        not to the prompt). α starts at the earlier pooled α (same decoder, so same sampling parameters: a greedy
        prior promises too much at T = 1) with the prior's weight. A probe after a loss measures drafting afresh."""
        if state is None:
            return
        rate_keys = tuple(f"rate_{k}" for k in self._RATE_FIELDS)
        allowed = set(self._COST_FIELDS) | set(rate_keys) | set(self._EXTRA_FIELDS)
        if not isinstance(state, dict) or not set(self._COST_FIELDS) <= set(state) <= allowed:
            raise ValueError(f"a cost state is a dict with exactly {self._COST_FIELDS} (+ {rate_keys} and the "
                             f"extra costs), got {state!r}")
        values = {f: float(v) for f, v in state.items()}
        if not all(math.isfinite(v) and v >= 0.0 for v in values.values()):
            raise ValueError(f"cost state values must be finite and >= 0, got {state!r}")
        for f in self._COST_FIELDS:
            setattr(self.estimator, f, values[f])
        self._timed = values["_target_calls"]
        self.ar_rate.load("rate_ar", values)
        self.spec_rate.load("rate_spec", values)
        self.width.load(values)
        self._ar_overhead = [values.get("ar_overhead_time", 0.0), values.get("ar_overhead_steps", 0.0)]
        self._context_time = [values.get("context_time", 0.0), values.get("context_steps", 0.0)]
        self._probe = [values.get("probe_left", 0.0), values.get("probe_span", 0.0)]
        if self._probe[1] > 0 and self._probe[0] <= 0:
            self.spec_rate.reset()
        if "alpha" in values:
            self.estimator._accepted = min(values["alpha"], 1.0) * self.prior_weight
            self.estimator._trials = self.prior_weight

    # ---------------------------------------------------------------------------------------------- costs (seconds)
    def _costs(self) -> tuple:
        """(spec_cost(g), idle_cost or None, ar_cost) in seconds, from the measurements (unit costs before any)."""
        est, width = self.estimator, self.width
        timed = width.known
        t1 = width.at(1)
        per_draft = (est._draft_time / est._draft_steps if est._draft_steps > 0 and timed
                     else self.default_c * t1)
        per_context = self._context_time[0] / self._context_time[1] if self._context_time[1] > 0 else 0.0
        spec_over = est._overhead_time / est._overhead_steps if est._overhead_steps > 0 else 0.0
        ar_over = self._ar_overhead[0] / self._ar_overhead[1] if self._ar_overhead[1] > 0 else 0.0
        if self.context:
            return (lambda g: per_context + width.at(g + 1) + spec_over), per_context + t1 + spec_over, t1 + ar_over
        return (lambda g: g * per_draft + width.at(g + 1) + spec_over), None, t1 + ar_over

    def _alphas(self, requests) -> list:
        centre = self.alpha
        return [self.requests.alpha(r, centre) for r in requests] if requests else [centre]

    def observe_rate(self, gamma: int, wall: float, tokens_per_request: float, target_time: Optional[float] = None,
                     fallback: Optional[bool] = None) -> None:
        """One step's wall seconds since the previous host read and its mean tokens per live request. ``fallback``:
        a target-only step of the fallback (default: γ == 0); other steps, a context drafter's unmatched ones
        included, are drafting steps. ``target_time``: the target phase's seconds of a target-only step (q = 1).
        The first step of a generation and the first after a switch between the two kinds are not counted (they
        carry the prefill, a capture or the switch)."""
        ar = gamma == 0 if fallback is None else bool(fallback)
        kind = "ar" if ar else "spec"
        if gamma == 0 and target_time is not None and target_time > 0:
            self.width.observe(1, target_time)
        first, self._last_kind = self._last_kind != kind, kind
        if first or not (math.isfinite(wall) and wall > 0.0):
            return
        if kind == "spec":
            self.spec_rate.observe(wall, tokens_per_request)
            return
        self.ar_rate.observe(wall, 1.0)
        if target_time is not None and target_time > 0:
            self._ar_overhead[0] += max(wall - target_time, 0.0)
            self._ar_overhead[1] += 1.0

    def measured(self) -> Optional[tuple]:
        """(point, upper): measured tokens per second while drafting over target-only tokens per second (per
        request, whole-step wall times) and its one-sided upper confidence bound (``z`` standard errors,
        engine/rates.py); None until >= 2 target-only and ``quick_steps`` drafting steps are counted."""
        if self.ar_rate.steps < 2 or self.spec_rate.steps < self.quick_steps:
            return None
        return rate_speedup(self.spec_rate, self.ar_rate, self.z)

    def measured_speedup(self) -> Optional[float]:
        """The point estimate of :meth:`measured` once ``min_steps`` drafting steps are counted, else None."""
        m = self.measured()
        return m[0] if m is not None and self.spec_rate.steps >= self.min_steps else None

    def _predicted(self) -> tuple[int, Optional[float]]:
        """(γ, predicted speedup or None when the estimates may not decide yet)."""
        spec_cost, idle_cost, ar_cost = self._costs()
        g, model = best_cap(self._alphas(self._live), None, self.max_gamma, spec_cost, None, ar_cost)
        if not self.width.known:   # nothing timed yet: a one-token probe, whatever the prior α promises
            g = min(g, 1)
        if self.context:   # drafting throughput as measured (matches come and go) against the modelled target-only
            rate = self.spec_rate.rate()
            if self.spec_rate.steps < self.min_steps or rate is None or not self.width.known:
                return g, None
            return g, rate * ar_cost
        return g, (model if self._timed >= self.min_steps else None)

    def _decision(self) -> tuple[int, Optional[float], bool]:
        """(γ, speedup, explore): speedup set when drafting should stop now (explore: to measure a target-only
        rate). Measured rates decide once there is a target-only rate: the upper confidence bound below
        ``fallback_below`` after ``quick_steps`` drafting steps, or the middle of point and bound after ``min_steps``
        (a draft model or head counts steps of its own generation)."""
        g, predicted = self._predicted()
        own = self.steps
        if not self.can_resume and own < self.quick_steps:
            return g, None, False
        measured = self.measured()
        if measured is not None:
            point, upper = measured
            settled = self.spec_rate.steps >= self.min_steps and (self.can_resume or own >= self.min_steps)
            stop = upper < self.fallback_below or (settled and 0.5 * (point + upper) < self.fallback_below)
            return g, (point if stop else None), False
        if predicted is None or not (self.can_resume or own >= self.min_steps):
            return g, None, False
        if predicted < self.fallback_below:
            return g, predicted, False
        if self.fallback_below > 0 and self.ar_rate.steps < 2 and predicted < self.explore_below:
            return g, predicted, True
        return g, None, False

    @property
    def falls_back_at_start(self) -> bool:
        """``optimal`` with inherited measurements that say drafting loses: it returns 0 from the first step."""
        if self.kind != "optimal" or self.steps > 0:
            return False
        if not self.context and self._probe[1] > 0:   # a draft model or head that lost: probe again after a backoff
            return self._probe[0] > 0
        measured = self.measured_speedup()
        if measured is not None:
            return measured < self.fallback_below
        _, predicted = self._predicted()
        return predicted is not None and not self.context and predicted < self.fallback_below

    @property
    def resumes_next(self) -> bool:
        """The next ``next()`` resumes drafting after a fallback (the decoder must not launch it ahead of a read)."""
        return self._fallen and self.can_resume and self._idle_left <= 0

    @property
    def alpha(self) -> float:
        return min(self.estimator.alpha, 1.0 - 1e-6)

    @property
    def cost_ratio(self) -> float:
        return self.estimator.c

    def _fall_back(self, speedup: float, explore: bool = False) -> int:
        self._explored = explore
        if self.fallback_after is None:
            self.fallback_after, self.fallback_speedup = self.steps, speedup
        self._fallen, self.fallbacks, self._current = True, self.fallbacks + 1, 0
        self._idle_left, self._backoff = self._backoff, min(2 * self._backoff, 1024)
        return 0

    def _resume(self) -> None:
        """Draft again: the drafting rates start afresh and per-request α drifts most of the way to the pool."""
        self._fallen, self.resumes = False, self.resumes + 1
        self.spec_rate.reset()
        self.requests.counts = {r: (a * 0.25, t * 0.25) for r, (a, t) in self.requests.counts.items()}

    def next(self) -> int:
        """γ for the next step: >= 1, or 0 (``optimal`` not drafting: decode this step target-only)."""
        if self.kind != "optimal":
            return self._current
        self.requests.forget()
        if self._pinned is not None:          # decided by fixed_gamma() for a step launched ahead of a read
            self._current, self._pinned = self._pinned, None
            return self._current
        if self._fallen:
            if not self.resumes_next:
                self._idle_left -= 1
                return 0
            self._resume()
        elif self._first and self.falls_back_at_start:    # inherited: the draft loses, or a skip after a loss
            measured = self.measured_speedup()
            return self._fall_back(measured if measured is not None else (self._predicted()[1] or 0.0))
        self._first = False
        self._current, stop, explore = self._decision()
        return self._fall_back(stop, explore) if stop is not None else self._current

    def select_drafts(self, drafts: list, requests: list) -> Optional[list]:
        """A context drafter's proposals for this step (per batch position; ``requests[i]`` the request id of a live
        row, None otherwise) cut to the cap that maximises expected tokens per second (:func:`best_cap`: every row
        pays the verify width of the longest draft), or None when no cap beats a step without drafts."""
        if self.kind != "optimal":
            return drafts
        live = [i for i, r in enumerate(requests) if r is not None]
        spec_cost, idle_cost, ar_cost = self._costs()
        lengths = [len(drafts[i]) for i in live]
        g, _ = best_cap(self._alphas([requests[i] for i in live]), lengths, max(lengths, default=0), spec_cost,
                        idle_cost, ar_cost)
        return [d[:g] for d in drafts] if g > 0 else None

    def fixed_gamma(self) -> Optional[int]:
        """γ of the next step, decided before the step in flight is read, or None (the decoder then waits for the
        read). The decoder launches such a step ahead of the read (docs/engine.md). ``constant``: always γ.
        ``optimal`` while a draft model or head drafts (a context drafter's drafts need the host): the decision
        from the steps recorded so far, one step older (exact all the same: γ never depends on the random numbers
        the step consumes), pinned for the next :meth:`next`; None before the first recorded step and where that
        decision is to stop drafting (the fallback is taken after the read)."""
        if self.kind == "constant":
            return self.gamma
        if self.kind != "optimal" or self.context or self._fallen or self.steps < 1:
            return None
        if self._pinned is None:
            g, stop, _ = self._decision()
            if stop is not None or g < 1:
                return None
            self._pinned = g
        return self._pinned

    def update(self, gamma: int, num_accepted: list[int], draft_time: float = 0.0, target_time: float = 0.0,
               step_time: Optional[float] = None, requests: Optional[list] = None,
               drafted: Optional[list] = None) -> None:
        """Record a step drafted with ``gamma`` (>= 1) where row i accepted ``num_accepted[i]`` tokens.

        draft_time / target_time: seconds spent in the draft phase / the one target forward; a step counts towards
        ``min_steps`` only when both are positive. step_time: the step's wall seconds (host work included), for the
        overhead term. requests / drafted (optional, same length as num_accepted): each row's request id and draft
        length (default γ; rows that drafted 0 add nothing to α), for per-request α. Not for target-only steps."""
        if gamma < 1:
            raise ValueError(f"update() records speculative steps (gamma >= 1), got gamma={gamma}")
        if not num_accepted:
            return
        ks = [gamma] * len(num_accepted) if drafted is None else [int(k) for k in drafted]
        if len(ks) != len(num_accepted) or (requests is not None and len(requests) != len(num_accepted)):
            raise ValueError("requests / drafted must have one entry per row of num_accepted")
        self.steps += 1
        timed = draft_time > 0 and target_time > 0
        self._timed += timed
        self.estimator.observe(list(num_accepted), ks, draft_time if timed else None,
                               target_time if timed else None, step_time if timed else None)
        if timed:
            self.width.observe(gamma + 1, target_time)
            self._context_time = [self._context_time[0] + draft_time, self._context_time[1] + 1.0]
        if requests is not None:
            for r, n, k in zip(requests, num_accepted, ks):
                self.requests.observe(r, int(n), k)
            self._live = list(requests)
        if self.kind == "heuristic":
            drafting = [n for n, k in zip(num_accepted, ks) if k > 0]
            if drafting and all(n == gamma for n in drafting):
                self._current = min(self._current + 2, self.max_gamma)
            else:
                self._current = max(1, self._current - 1)
