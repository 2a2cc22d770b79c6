"""Measured token rates of the ``optimal`` γ schedule (gamma.py): tokens per second of drafting steps against
target-only steps, with a confidence bound on their ratio.

A step contributes (wall seconds between two host reads, mean tokens emitted per live request). The rate of a kind of
step is the ratio estimator R = Σ tokens / Σ wall over its steps; its standard error comes from the spread of the
residuals tokens_i - R·wall_i (the delta method for a ratio of means): SE(R)² = Σ (t_i - R w_i)² · n / ((n - 1) W²).
Sums are exponentially decayed per observation (``decay``), so a rate follows what the draft does *now* (at T = 1 a
transcript's acceptance changes along it) instead of averaging every step ever seen.
"""
from __future__ import annotations

import math
from typing import Optional


class RateMeter:
    """Decayed sums over steps of wall w, tokens t, w², t² and w·t, plus an undecayed step count.

    decay in (0, 1]: the weight of the past per observation (1 = plain sums; memory about 1 / (1 - decay) steps).
    """

    FIELDS = ("steps", "n", "wall", "tokens", "wall2", "tokens2", "cross")

    def __init__(self, decay: float = 1.0):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.decay = float(decay)
        self.reset()

    def reset(self) -> None:
        self.steps = self.n = self.wall = self.tokens = self.wall2 = self.tokens2 = self.cross = 0.0

    def observe(self, wall: float, tokens: float) -> None:
        """One step: ``wall`` seconds (> 0, finite) that emitted ``tokens`` per live request (>= 0)."""
        if not (math.isfinite(wall) and wall > 0.0 and math.isfinite(tokens) and tokens >= 0.0):
            return
        d = self.decay
        self.steps += 1.0
        self.n, self.wall, self.tokens = d * self.n + 1.0, d * self.wall + wall, d * self.tokens + tokens
        self.wall2, self.tokens2 = d * self.wall2 + wall * wall, d * self.tokens2 + tokens * tokens
        self.cross = d * self.cross + wall * tokens

    def rate(self) -> Optional[float]:
        """Tokens per second (None before a step)."""
        return self.tokens / self.wall if self.n > 0.0 and self.wall > 0.0 and self.tokens > 0.0 else None

    def relative_error(self) -> float:
        """SE(R) / R of the rate (inf with fewer than two steps' worth of weight)."""
        rate = self.rate()
        if rate is None or self.n <= 1.0 + 1e-9:
            return math.inf
        resid = max(self.tokens2 - 2.0 * rate * self.cross + rate * rate * self.wall2, 0.0)
        var = resid * self.n / ((self.n - 1.0) * self.wall * self.wall)
        return math.sqrt(var) / rate

    def state(self, prefix: str) -> dict:
        return {f"{prefix}_{f}": getattr(self, f) for f in self.FIELDS}

    def load(self, prefix: str, values: dict) -> None:
        """Sums from :meth:`state`. A state of an older decoder (plain sums of steps, wall and tokens only) loads
        with no spread known: its rate is kept and its bound is infinite (one step's weight)."""
        for f in self.FIELDS:
            setattr(self, f, float(values.get(f"{prefix}_{f}", 0.0)))
        if f"{prefix}_n" not in values:
            self.n = min(self.steps, 1.0)


def speedup(spec: RateMeter, ar: RateMeter, z: float = 1.645) -> Optional[tuple]:
    """(point, upper): the drafting rate over the target-only rate and a one-sided upper confidence bound at ``z``
    standard errors (relative errors of the two rates added in quadrature, on the log scale); None until both
    rates exist."""
    s, a = spec.rate(), ar.rate()
    if s is None or a is None:
        return None
    point = s / a
    err = math.hypot(spec.relative_error(), ar.relative_error())
    return point, (point * math.exp(z * err) if math.isfinite(err) else math.inf)
