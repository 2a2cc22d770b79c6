"""Measured on / off switch of speculation by load, for continuous batching (engine/batching.py).

Whether drafting pays depends on the batch: with few live requests a step is bound by reading the weights and the
extra verified tokens are nearly free; with many it turns compute-bound and every rejected draft token costs. The
switch measures, per step row count R (a power of two, engine/batch_step.row_count), the rate of emitted tokens per
live request per second of speculative steps and of target-only steps (wall time between two host reads), and
drafts in a bucket only while speculation measures at least ``margin`` times the target-only rate there.

Exploration: a bucket starts drafting; every ``probe_every``-th step of a bucket is target-only until ``min_steps``
target-only steps are measured, then the better kind is used, re-measuring the other one every ``recheck`` steps
(one step) so a change of workload is noticed. Steps that captured or compiled a new shape are not counted (the
caller passes ``valid=False``). Estimates are exponential moving averages (``decay``).
With the ``coupled`` method and deterministic drafts the switch changes no token (verify/methods/coupled.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Bucket:
    spec_rate: float = 0.0
    plain_rate: float = 0.0
    spec_n: int = 0
    plain_n: int = 0
    steps: int = 0


class SpecSwitch:
    def __init__(self, min_steps: int = 8, probe_every: int = 4, recheck: int = 200, margin: float = 1.0,
                 decay: float = 0.9):
        self.min_steps, self.probe_every, self.recheck = min_steps, probe_every, recheck
        self.margin, self.decay = margin, decay
        self.buckets: dict = {}

    def draft(self, rows: int) -> bool:
        """Whether the next step over ``rows`` rows should draft (a step counter advances per call)."""
        b = self.buckets.setdefault(rows, _Bucket())
        b.steps += 1
        if b.spec_n < self.min_steps or b.plain_n < self.min_steps:    # explore: mostly drafting, some plain
            return b.steps % self.probe_every != 0 or b.plain_n >= self.min_steps
        better = b.spec_rate >= self.margin * b.plain_rate
        if b.steps % self.recheck == 0:                                  # re-measure the other kind once
            return not better
        return better

    def observe(self, rows: int, drafted: bool, seconds: float, tokens_per_request: float, valid: bool = True):
        """One finished step over ``rows`` rows: ``drafted`` or not, its wall time and mean emitted tokens per live
        request."""
        if not valid or seconds <= 0:
            return
        b = self.buckets.setdefault(rows, _Bucket())
        rate = tokens_per_request / seconds
        if drafted:
            b.spec_rate = rate if b.spec_n == 0 else self.decay * b.spec_rate + (1 - self.decay) * rate
            b.spec_n += 1
        else:
            b.plain_rate = rate if b.plain_n == 0 else self.decay * b.plain_rate + (1 - self.decay) * rate
            b.plain_n += 1

    def state(self) -> dict:
        """Per row count: measured rates and whether drafting is on (for /metrics and benchmarks)."""
        return {rows: {"spec_rate": b.spec_rate, "plain_rate": b.plain_rate, "spec_steps": b.spec_n,
                       "plain_steps": b.plain_n,
                       "drafting": b.spec_n < self.min_steps or b.plain_n < self.min_steps or
                       b.spec_rate >= self.margin * b.plain_rate} for rows, b in sorted(self.buckets.items())}
