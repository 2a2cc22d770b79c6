"""What a speculative step costs and yields, measured online, for the ``optimal`` γ schedule (gamma.py).

Leviathan's Theorem 3.8 prices a step as γ draft forwards plus one target forward of the same cost as a target-only
step. On a fast runtime neither holds, and pricing a step by the theorem alone makes ``optimal`` draft where
target-only decoding is faster:

* the verify forward scores q = γ + 1 positions for *every* row of the batch, and at B = 8 a q = 6 forward costs
  visibly more than q = 1 -- rows whose drafts were empty or rejected still pay it. :class:`WidthCost` fits the
  target forward's seconds as a line in q, t(q) = t(1) + s·(q - 1), over every step (target-only steps give q = 1);
* a speculative step pays host work (reading the step, matching contexts, launching) that a target-only step of the
  fallback hides: the runtime launches those one step ahead of the host read. The schedule measures the per-step
  host overhead of both kinds (wall time minus the timed draft and target phases);
* the acceptance rate differs between requests of a batch: with a pooled α one request that copies its prompt makes
  every other row pay for verify positions it cannot use. :class:`RequestAlphas` keeps one estimate per request,
  shrunk to the pooled one, and forgetting a little each step so that a request that did not pay is re-probed.

:func:`best_cap` combines them: the draft cap g (0 = no drafting this step) maximising expected tokens per second
for the live rows, each row drafting min(k_i, g) tokens (k_i: what it can draft; a model drafts any g), against the
rate of a target-only step. Shapes: per-row lists of equal length; times in seconds. The closed forms beside it:
Theorem 3.8 with a per-step overhead (:func:`overhead_improvement`, :func:`best_gamma`) and the best chain length
for position-dependent acceptance (:func:`chain_gamma`, a trained head's or distilled draft's held-out rates).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from tilespec.analysis import (_check_alpha, _check_cost, _check_gamma, expected_tokens, optimal_gamma,
                               walltime_improvement)

DEFAULT_SLOPE = 0.03    # prior extra cost of one more verify position, as a fraction of t(1), until measured


class WidthCost:
    """The target forward's seconds as a function of its verify width q: q = 1 (a target-only step) kept apart, and a
    decayed least-squares line t(q) = a + b·q through the observations at q >= 2.

    q = 1 is not a point on the line: on the GPU a one-token forward takes other kernels (attention's q = 1 path,
    engine/native/attention.py), so the line through drafting widths, extrapolated to q = 1, prices target-only
    decoding wrongly (by about the step from q = 1 to q = 2). Until q = 1 is observed :meth:`at` extrapolates all the
    same (the schedule then measures a target-only rate before trusting it, gamma.py). With fewer than two distinct
    widths >= 2 seen, the slope is ``DEFAULT_SLOPE``·t(observed); before any observation :attr:`known` is False and
    :meth:`at` returns ``q``-proportional unit costs (1 + DEFAULT_SLOPE·(q - 1))."""

    FIELDS = ("n", "sq", "sqq", "st", "sqt", "n1", "st1")

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.n = self.sq = self.sqq = self.st = self.sqt = self.n1 = self.st1 = 0.0
        self._widths: set = set()

    def observe(self, q: int, seconds: float) -> None:
        if not (q >= 1 and math.isfinite(seconds) and seconds > 0.0):
            return
        d = self.decay
        if q == 1:
            self.n1, self.st1 = d * self.n1 + 1.0, d * self.st1 + seconds
            return
        self.n, self.sq, self.sqq = d * self.n + 1.0, d * self.sq + q, d * self.sqq + q * q
        self.st, self.sqt = d * self.st + seconds, d * self.sqt + q * seconds
        self._widths.add(int(q))

    @property
    def known(self) -> bool:
        return self.n > 0.0 or self.n1 > 0.0

    @property
    def single_known(self) -> bool:
        """Whether t(1) is measured (a target-only forward was timed), not extrapolated."""
        return self.n1 > 0.0

    def at(self, q: int) -> float:
        """Predicted seconds of a target forward over q positions (> 0)."""
        if q <= 1 and self.n1 > 0.0:
            return self.st1 / self.n1
        if self.n <= 0.0:
            base = self.st1 / self.n1 if self.n1 > 0.0 else 1.0
            return base * (1.0 + DEFAULT_SLOPE * (q - 1))
        mean_q, mean_t = self.sq / self.n, self.st / self.n
        var = self.sqq / self.n - mean_q * mean_q
        if len(self._widths) >= 2 and var > 1e-9:
            slope = max((self.sqt / self.n - mean_q * mean_t) / var, 0.0)
            base = mean_t - slope * (mean_q - 1.0)
            if base > 0.0:
                return base + slope * (q - 1)
        base = mean_t / (1.0 + DEFAULT_SLOPE * (mean_q - 1.0))
        return base * (1.0 + DEFAULT_SLOPE * (q - 1))

    def state(self) -> dict:
        return {f"width_{f}": getattr(self, f) for f in self.FIELDS} | {"width_seen": float(len(self._widths))}

    def load(self, state: dict) -> None:
        for f in self.FIELDS:
            setattr(self, f, float(state.get(f"width_{f}", 0.0)))
        # the distinct widths are not kept, only how many there were: enough to trust the fitted slope again
        self._widths = set(range(2, 2 + int(state.get("width_seen", 0.0))))


class RequestAlphas:
    """Per-request acceptance estimates: decayed MLE counts (accepted, trials) per request id, shrunk to a centre.

    α_i = (A_i + w·centre) / (T_i + w). ``forget()`` multiplies every request's counts by ``decay`` (called once per
    step), so a request that stopped drafting drifts back to the centre and is tried again."""

    def __init__(self, weight: float = 2.0, decay: float = 0.95):
        self.weight, self.decay = float(weight), float(decay)
        self.counts: dict = {}

    def observe(self, request, accepted: int, drafted: int) -> None:
        if drafted <= 0:
            return
        a, t = self.counts.get(request, (0.0, 0.0))
        self.counts[request] = (a + accepted, t + accepted + (1 if accepted < drafted else 0))

    def forget(self) -> None:
        self.counts = {r: (a * self.decay, t * self.decay) for r, (a, t) in self.counts.items()}

    def alpha(self, request, centre: float) -> float:
        a, t = self.counts.get(request, (0.0, 0.0))
        return min(max((a + self.weight * centre) / (t + self.weight), 0.0), 1.0 - 1e-6)


def step_tokens(alphas: Sequence[float], lengths: Sequence[int]) -> float:
    """Expected tokens a step emits over its rows: Σ_i E(α_i, k_i), with E = 1 for rows that draft nothing."""
    return float(sum(expected_tokens(a, k) if k > 0 else 1.0 for a, k in zip(alphas, lengths)))


def best_cap(alphas: Sequence[float], available: Optional[Sequence[int]], cap: int, spec_cost,
             idle_cost: Optional[float], ar_cost: float) -> tuple[int, float]:
    """(g, speedup): the draft cap g in [1, cap] (or 0) with the most expected tokens per second, and its predicted
    rate over target-only decoding's (rows / ``ar_cost``).

    alphas: α_i of the live rows; available: k_i, what each row can draft (None: any length, a draft model);
    spec_cost(g): seconds of a step drafting with cap g >= 1; idle_cost: seconds of a step in which no row drafts
    while drafting stays on (a context drafter's unmatched step: no run-ahead), or None when g = 0 is not a choice
    here (a draft model: not drafting is the fallback, decided by the caller from the returned speedup).
    """
    rows = len(alphas)
    if rows == 0 or cap < 1:
        return 0, 1.0
    ar_rate = rows / ar_cost
    best_g, best_rate = 0, (rows / idle_cost if idle_cost is not None else -1.0)
    top = cap if available is None else min(cap, max(available, default=0))
    for g in range(1, top + 1):
        lengths = [g] * rows if available is None else [min(k, g) for k in available]
        rate = step_tokens(alphas, lengths) / spec_cost(g)
        if rate > best_rate * (1.0 + 1e-9):
            best_g, best_rate = g, rate
    if best_rate < 0:
        return 0, 1.0
    return best_g, best_rate / ar_rate


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
        g = int(optimal_gamma(min(max(alpha, 0.0), 1.0), max(c, 0.0), gamma_max=max_gamma).gamma)
        return g, float(walltime_improvement(alpha, g, c))
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
